"""The one time and duration grammar: every CLI flag, policy field, scenario field and source timestamp.

Input: text (or numbers, ``datetime``/``timedelta`` already parsed). Output: aware UTC
``datetime``s and ``timedelta``s; the few canonical texts gpuledger prints.

Times are RFC 3339 / ISO 8601: ``2026-11-30T13:40:00Z``, ``2026-11-30 13:40:00.123+01:00``,
``2026-11-30T13:40Z``, ``2026-11-30``. Any number of fractional digits is read (Go sends
nanoseconds) and truncated to microseconds, never rounded, so one text is always one
instant (event ids are computed from it).
- ``parse_time`` is the people's form (CLI flags, files): a time without a zone is UTC,
  the date alone is its midnight, ``now`` is now.
- ``parse_timestamp`` is the machines' form (Alertmanager, the Kubernetes API, MLflow):
  date, time with seconds, and a zone are required — guessing a zone for a machine's
  timestamp silently shifts timelines.
Durations: ``90s``, ``15m``, ``2h``, ``1d``, combined from the largest unit down
(``1h30m``, ``1d12h``), decimals (``1.5h``), or a bare number of seconds; never negative.
Output texts: ``iso_z`` (``…T13:40:00.000Z``: milliseconds, sorts as text), ``iso_z(t, 6)``
(microseconds, the form inside scheduler event ids), ``format_duration`` (``1h30m``),
``clickhouse_time`` (a ``DateTime64(3, 'UTC')`` query parameter).
Ranges: ``within`` — whether a time lies in a closed range, compared as the store compares
(``at_store_precision``: milliseconds), the one test every replay range is applied with.
Limits: no week/month units (months have no fixed length); no leap seconds.
"""

from __future__ import annotations

import math
import re
from datetime import date, datetime, timedelta, timezone
from typing import Any

_TIME = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})"
    r"(?:[Tt ](?P<hour>\d{2}):(?P<minute>\d{2})(?::(?P<second>\d{2})(?:[.,](?P<fraction>\d+))?)?)?"
    r"\s*(?P<zone>[Zz]|[+-]\d{2}(?::?\d{2})?)?$"
)
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")
_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))

TIME_EXAMPLE = "2026-11-30T13:40:00Z"
DURATION_EXAMPLES = "90s, 15m, 2h, 1d or 1h30m"


class TimeFormatError(ValueError):
    """Text that is not a time or a duration of the grammar; the message names where it came from."""


class TimeOutOfRange(TimeFormatError):
    """A time, but outside those the store keeps (``STORE_TIMES``)."""


class DurationOutOfRange(TimeFormatError):
    """A duration of the grammar, but longer than a ``timedelta`` holds (``timedelta.max``:
    999999999 days); it was an ``OverflowError``, a traceback."""


def _zone(text: str | None) -> timezone | None:
    if text is None:
        return None
    if text in ("Z", "z"):
        return timezone.utc
    sign = -1 if text[0] == "-" else 1
    digits = text[1:].replace(":", "")
    hours, minutes = int(digits[:2]), int(digits[2:] or 0)
    if hours > 23 or minutes > 59:
        raise ValueError(f"bad zone offset {text}")
    return timezone(sign * timedelta(hours=hours, minutes=minutes))


def _parse(text: str, *, machine: bool) -> datetime:
    match = _TIME.match(text.strip())
    if not match or (machine and (match["second"] is None or match["zone"] is None)):
        raise ValueError(text)
    day = date.fromisoformat(match["date"])
    micro = int((match["fraction"] or "")[:6].ljust(6, "0"))
    parsed = datetime(day.year, day.month, day.day, int(match["hour"] or 0), int(match["minute"] or 0), int(match["second"] or 0),
                      micro, tzinfo=_zone(match["zone"]) or timezone.utc)
    try:
        return parsed.astimezone(timezone.utc)
    except OverflowError:  # (year 1 at +01:00, 9999 at -01:00: no UTC time; callers catch ValueError)
        raise ValueError(f"{text}: outside the times a UTC datetime holds") from None


#: The times a person may ask the store about: ClickHouse's documented DateTime64 range.
STORE_TIMES = (datetime(1900, 1, 1, tzinfo=timezone.utc), datetime(2299, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc))


def parse_time(value: str | datetime, what: str | None = None) -> datetime:
    """A time as people write it (flags, files) → aware UTC; no zone means UTC, ``now`` is now.

    Raises ``TimeFormatError`` otherwise, prefixed by ``what`` (e.g. the flag) when given.
    """
    if isinstance(value, datetime):
        return as_utc(value)
    prefix = f"{what}: " if what else ""
    if isinstance(value, str) and value.strip().lower() == "now":
        return datetime.now(timezone.utc)
    try:
        parsed = _parse(value, machine=False) if isinstance(value, str) else None
    except ValueError:
        parsed = None
    if parsed is None:
        raise TimeFormatError(f"{prefix}not an RFC 3339 time, e.g. {TIME_EXAMPLE} (no zone means UTC), got {value!r}")
    if not STORE_TIMES[0] <= parsed <= STORE_TIMES[1]:
        # (else the store refused it as a query parameter: a raw BAD_QUERY_PARAMETER, exit 1)
        raise TimeOutOfRange(f"{prefix}{value!r} is outside the times the store keeps (ClickHouse DateTime64: "
                              f"{STORE_TIMES[0]:%Y-%m-%d} to {STORE_TIMES[1]:%Y-%m-%d})")
    return parsed


def parse_timestamp(value: Any, what: str | None = None) -> datetime:
    """An RFC 3339 date-time a machine sent → aware UTC; seconds and a zone are required.

    Raises ``TimeFormatError`` ("not a timestamp", prefixed by ``what`` when given) for
    anything else, naive times included.
    """
    prefix = f"{what}: " if what else ""
    if not isinstance(value, str):
        raise TimeFormatError(f"{prefix}not a timestamp (expected an RFC 3339 string)")
    try:
        return _parse(value, machine=True)
    except ValueError:
        raise TimeFormatError(f"{prefix}not a timestamp: {value[:60]!r}") from None


def as_utc(value: datetime | str | None) -> datetime | None:
    """A time read back from a store or a JSON document (naive means UTC) → aware UTC; None stays None."""
    if value in (None, ""):
        return None
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return parse_time(str(value))


def iso_z(value: datetime | str | None, digits: int = 3) -> str | None:
    """``YYYY-MM-DDTHH:MM:SS.fffZ`` (``digits`` = 3, what traces and reports print) or ``….ffffffZ`` (6)."""
    t = as_utc(value)
    if t is None:
        return None
    fraction = f"{t.microsecond:06d}"[:digits]
    return t.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction}" if digits else "") + "Z"


def clickhouse_time(value: datetime) -> str:
    """A ``DateTime64(3, 'UTC')`` query parameter (ClickHouse does not parse ``T…Z`` there)."""
    t = as_utc(value)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def at_store_precision(value: datetime) -> datetime:
    """``value`` as the store keeps it: cut to the millisecond (``DateTime64(3)``; ClickHouse drops
    the digits after the third, never rounds — measured: ``…45.000999`` is stored as ``…45.000``).
    Query bounds are cut the same way (``clickhouse_time``)."""
    return value.replace(microsecond=value.microsecond - value.microsecond % 1000)


def within(value: datetime, start: datetime | None, end: datetime | None) -> bool:
    """Whether ``value`` lies in the closed range ``[start, end]`` (None: no bound), each side at the
    store's precision (``at_store_precision``) — so that a replay's range keeps the events that
    ``audit --from/--to`` and ``trace --at`` with the same bounds read from the store. Compared to
    the microsecond, an event at ``…45.000400`` (Kubernetes MicroTime, Alertmanager's nanoseconds),
    stored as ``…45.000``, was read by ``audit --to …45`` and skipped by ``replay --to …45``; and a
    bound with microseconds (``--from 2h``) skipped the events stored in its own millisecond."""
    if start is None and end is None:
        return True
    t = at_store_precision(value)
    return (start is None or t >= at_store_precision(start)) and (end is None or t <= at_store_precision(end))


def parse_duration(value: Any, what: str | None = None) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``1d``, ``1h30m``, ``1.5h`` or a number of seconds → ``timedelta`` (never negative).

    Raises ``TimeFormatError`` otherwise, prefixed by ``what`` (e.g. the flag) when given;
    ``DurationOutOfRange`` (one) for a duration longer than ``timedelta.max`` (``99999999999d``,
    a number of seconds of 400 digits: once an ``OverflowError`` that no caller caught).
    """
    prefix = f"{what}: " if what else ""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise TimeFormatError(f"{prefix}not a duration: {value!r} (use {DURATION_EXAMPLES} or a number of seconds)")
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().replace(" ", "")
        match = _DURATION.match(text)
        if text and match and any(match.groups()):
            seconds = sum(float(g) * size for g, (_, size) in zip(match.groups(), _UNITS) if g)
        elif _NUMBER.match(text):
            seconds = float(text)
        else:
            raise TimeFormatError(f"{prefix}not a duration: {value!r} (use {DURATION_EXAMPLES} or a number of seconds)")
    else:
        raise TimeFormatError(f"{prefix}not a duration: {value!r} (use {DURATION_EXAMPLES} or a number of seconds)")
    if math.isnan(seconds):
        raise TimeFormatError(f"{prefix}not a duration: {value!r} (use {DURATION_EXAMPLES} or a number of seconds)")
    if seconds < 0:
        raise TimeFormatError(f"{prefix}a duration cannot be negative, got {value!r}")
    if isinstance(value, timedelta):
        return value
    try:
        return timedelta(seconds=seconds)
    except OverflowError:  # (infinite, or more than 999999999 days)
        raise DurationOutOfRange(f"{prefix}{value!r} is longer than the longest duration gpuledger holds "
                                 f"({timedelta.max.days}d)") from None


def format_duration(value: timedelta) -> str:
    """The grammar's shortest text for whole seconds (``5400 s`` → ``1h30m``; ``0s``)."""
    seconds = int(value.total_seconds())
    if seconds == 0:
        return "0s"
    out = ""
    for unit, size in _UNITS:
        if seconds >= size:
            out += f"{seconds // size}{unit}"
            seconds %= size
    return out


def utc_isoformat(value: str) -> str:
    """``datetime.fromisoformat(value).astimezone(timezone.utc).isoformat()`` — the one
    text form every sort key in ``streams`` uses — for a time gpuledger itself validated
    (an event's JSON, a correlated row); ``quick_utc_isoformat`` answers the common shapes
    without parsing."""
    return quick_utc_isoformat(value) or datetime.fromisoformat(value).astimezone(timezone.utc).isoformat()


def quick_utc_isoformat(value: str) -> str | None:
    """The ``isoformat()`` text of a validated UTC time that already is that text
    (``…+00:00``) or only spells its zone ``Z`` (pydantic's JSON of a UTC time); None for
    any other shape (parse it). The stream stages normalise every time they read, several
    per event. ``isoformat`` writes no fraction for a whole second and six digits
    otherwise, so only those shapes pass."""
    n = len(value)
    if n in (20, 27) and value[-1] == "Z":
        if value[10] == "T" and (n == 20 or (value[19] == "." and value[20:26] != "000000")):
            return value[:-1] + "+00:00"
    elif n in (25, 32) and value.endswith("+00:00"):
        if value[10] == "T" and (n == 25 or (value[19] == "." and value[20:26] != "000000")):
            return value
    return None
