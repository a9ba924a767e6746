"""The raw event log: every envelope as it arrived, with its Kafka coordinates.

Input: records of the four raw topics (bytes). Output: rows of ``raw_events``, one
columnar insert per batch (the agent in ``sinks/agents.py``).
Decoding is loose on purpose: the log keeps every record that *is* an envelope —
a JSON object with ``event_id``, ``event_type`` and a timezone-aware ``occurred_at`` (RFC 3339,
or any other form the envelope's schema reads) —
even when its family schema rejects it (the dead letter says why). Records that are
not envelopes at all (not JSON, no id, naive or unreadable time) are skipped and
counted (``rejected.not_an_envelope``): the correlate agent has already dead-lettered
them with the reason. Guarantees: ``raw_events`` is a ReplacingMergeTree keyed by
(event_type, occurred_at, event_id), so a re-delivered record collapses.
"""

from __future__ import annotations

import functools
from datetime import datetime, timezone

import orjson

from sinks.correlated import IDENTITY_FIELDS

RAW_EVENT_COLUMNS = (
    "event_id", "event_type", "schema_version", "occurred_at", "observed_at", "source_collector", "source_host",
    *IDENTITY_FIELDS, "traceparent", "payload_json", "kafka_topic", "kafka_partition", "kafka_offset",
)


class NotAnEnvelope(ValueError):
    """A raw record without the envelope fields the log needs."""


@functools.cache
def _time_adapter():
    """pydantic's reading of an envelope time, built on first use (only a time the fast path cannot read needs it)."""
    from pydantic import TypeAdapter

    from schemas.envelope import UtcDatetime

    return TypeAdapter(UtcDatetime)


def _schema_time(value) -> datetime | None:
    """``value`` as the envelope's schema reads a time (``schemas.envelope.UtcDatetime``), or None."""
    from pydantic import ValidationError

    try:
        return _time_adapter().validate_python(value)
    except ValidationError:
        return None


def _aware(value, field: str, required: bool = True) -> datetime | None:
    if value is None or value == "":
        if required:
            raise NotAnEnvelope(f"{field}: missing")
        return None
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            parsed = None
        if parsed is not None:
            if parsed.tzinfo is None:
                raise NotAnEnvelope(f"{field}: no timezone")
            return parsed.astimezone(timezone.utc)
    # A time the envelope's schema reads and this fast path does not (a number of seconds since the
    # epoch, a lower-case 't' or 'z'): the route stage routes such an event — the log keeps it too,
    # at the time the correlated tables have (it was skipped as "not an envelope", dead-lettered by
    # nobody, and the trace's manifest as of a time missed it).
    parsed = _schema_time(value)
    if parsed is None:
        raise NotAnEnvelope(f"{field}: not an RFC 3339 time" if isinstance(value, str) else f"{field}: missing")
    return parsed


def raw_event_row(value: bytes | str, topic: str, partition: int, offset: int) -> list:
    """One ``raw_events`` row from a raw record; raises NotAnEnvelope."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise NotAnEnvelope("not JSON") from exc
    if not isinstance(obj, dict):
        raise NotAnEnvelope("not a JSON object")
    event_id, event_type = obj.get("event_id"), obj.get("event_type")
    if not isinstance(event_id, str) or not event_id or not isinstance(event_type, str) or not event_type:
        raise NotAnEnvelope("event_id/event_type missing")
    occurred_at = _aware(obj.get("occurred_at"), "occurred_at")
    observed_at = _aware(obj.get("observed_at"), "observed_at", required=False) or occurred_at
    source = obj.get("source") if isinstance(obj.get("source"), dict) else {}
    ident = obj.get("identity") if isinstance(obj.get("identity"), dict) else {}
    trace = obj.get("trace") if isinstance(obj.get("trace"), dict) else {}
    schema_version = obj.get("schema_version")
    return [
        event_id, event_type, schema_version if isinstance(schema_version, int) and 0 <= schema_version < 65536 else 0,
        occurred_at, observed_at, str(source.get("collector") or ""), str(source.get("host") or ""),
        *[str(ident.get(f) or "") for f in IDENTITY_FIELDS],
        str(trace.get("traceparent") or ""), orjson.dumps(obj.get("payload", {})).decode(),
        topic, partition, offset,
    ]
