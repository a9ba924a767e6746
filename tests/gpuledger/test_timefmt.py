"""The one time and duration grammar (gpuledger/timefmt.py): flags, policy fields, scenarios, source timestamps."""

from datetime import datetime, timedelta, timezone

import pytest

from gpuledger.timefmt import (
    TimeFormatError,
    as_utc,
    clickhouse_time,
    format_duration,
    iso_z,
    parse_duration,
    parse_time,
    parse_timestamp,
    quick_utc_isoformat,
    utc_isoformat,
    within,
)

AT = datetime(2026, 11, 30, 13, 10, tzinfo=timezone.utc)


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-05-04T09:12:31Z", datetime(2026, 5, 4, 9, 12, 31, tzinfo=timezone.utc)),
    ("2026-05-04T09:12:31.123456789Z", datetime(2026, 5, 4, 9, 12, 31, 123456, tzinfo=timezone.utc)),
    ("2026-05-04T11:12:31.5+02:00", datetime(2026, 5, 4, 9, 12, 31, 500000, tzinfo=timezone.utc)),
    ("0001-01-01T00:00:00Z", datetime(1, 1, 1, tzinfo=timezone.utc)),
])
def test_parse_timestamp_reads_go_rfc3339nano(text, expected):
    assert parse_timestamp(text) == expected


@pytest.mark.parametrize("text", ["2026-05-04", "2026-05-04T09:12:31", "1714814000", "2026-13-04T09:12:31Z", None, 5])
def test_parse_timestamp_rejects_what_is_not_an_aware_rfc3339_time(text):
    with pytest.raises(ValueError, match="not a timestamp"):
        parse_timestamp(text)


def test_people_write_times_without_a_zone_meaning_utc():
    assert parse_time("2026-11-30T13:10:00Z") == parse_time("2026-11-30 13:10:00") == parse_time("2026-11-30T13:10") == AT
    assert parse_time("2026-11-30T14:10:00+01:00") == AT and parse_time("2026-11-30") == AT.replace(hour=0, minute=0)
    assert abs(parse_time("now") - datetime.now(timezone.utc)) < timedelta(seconds=5)
    for bad in ("yesterday", "", "2026-11-30T25:00:00Z", "2026-11-30T13:10:00 CET"):
        with pytest.raises(TimeFormatError, match="--at: not an RFC 3339 time"):
            parse_time(bad, "--at")


def test_a_time_outside_the_stores_range_is_refused_as_bad_input():
    """`trace --at 0001-01-01T00:00:00Z` reached the store as a query parameter and came back
    as a raw BAD_QUERY_PARAMETER (exit 1); now it is bad input, naming the range (exit 2)."""
    for bad in ("0001-01-01T00:00:00Z", "1899-12-31T23:59:59Z", "2300-01-01", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"):
        with pytest.raises(TimeFormatError, match=r"--at: (.* is outside the times the store keeps \(ClickHouse DateTime64: 1900-01-01 to 2299-12-31\)"
                                                   r"|not an RFC 3339 time)"):
            parse_time(bad, "--at")  # (year 1 at +01:00 has no UTC time at all: it was an OverflowError, a traceback)
    assert parse_time("1900-01-01T00:00:00Z").year == 1900 and parse_time("2299-12-31T23:59:59Z").year == 2299


def test_one_duration_grammar_for_every_flag_and_field():
    assert parse_duration("90s") == timedelta(seconds=90) and parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration(3600) == timedelta(hours=1) and parse_duration("2d") == timedelta(days=2)
    assert parse_duration("1.5h") == parse_duration("1h 30m") == parse_duration("5400") == timedelta(minutes=90)
    for bad in ("soon", "", "h", "2x", "-5", -1, True, "inf"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    with pytest.raises(ValueError, match="--window: not a duration: 'soon'"):
        parse_duration("soon", "--window")
    assert [format_duration(parse_duration(t)) for t in ("90s", "1h30m", "1d12h", "0")] == ["1m30s", "1h30m", "1d12h", "0s"]


def test_canonical_texts():
    t = datetime(2026, 11, 30, 13, 10, 0, 123456, tzinfo=timezone.utc)
    assert iso_z(t) == "2026-11-30T13:10:00.123Z" and iso_z(t, 6) == "2026-11-30T13:10:00.123456Z"
    assert iso_z(t, 0) == "2026-11-30T13:10:00Z" and iso_z("2026-11-30 14:10:00.123456+01:00") == "2026-11-30T13:10:00.123Z"
    assert iso_z(None) is None and as_utc(datetime(2026, 11, 30, 13, 10)) == AT
    assert clickhouse_time(t) == "2026-11-30 13:10:00.123"


def test_a_range_is_applied_at_the_precision_the_store_keeps_times_at():
    """``within``: both sides cut to the millisecond, as DateTime64(3) stores an event and reads a bound
    (``clickhouse_time``) — the replay's range reads what audit's same bounds read."""
    us = timedelta(microseconds=1)
    assert within(AT + 400 * us, None, AT) and within(AT + 999 * us, AT, AT)  # stored at AT, read by --to AT
    assert not within(AT + 1000 * us, None, AT)
    assert within(AT, AT + 400 * us, None)  # a bound with microseconds (--from 2h) keeps its own millisecond
    assert not within(AT - us, AT + 400 * us, None)
    assert within(AT, None, None)


def test_the_streams_time_text_is_isoformat_of_the_utc_time_whatever_the_shape():
    """utc_isoformat's quick path answers only what parsing would have answered."""
    from pydantic import TypeAdapter

    dump = TypeAdapter(datetime).dump_json
    times = [datetime(2026, 11, 30, 13, 10, 0, micro, tzinfo=tz) for micro in (0, 1, 123000, 999999)
             for tz in (timezone.utc, timezone(timedelta(hours=2)))]
    texts = [dump(t).decode().strip('"') for t in times] + [t.isoformat() for t in times] + [
        "2026-11-30T13:10:00.000000Z", "2026-11-30T13:10:00.000000+00:00", "2026-11-30T13:10:00.123Z", "2026-11-30T13:10:00.123+00:00",
        "2026-11-30 13:10:00Z", "2026-11-30T13:10:00.1234567Z", "2026-11-30T13:10:00-00:00"]
    quick = 0
    for text in texts:
        expected = datetime.fromisoformat(text).astimezone(timezone.utc).isoformat()
        assert utc_isoformat(text) == expected, text
        quick += quick_utc_isoformat(text) is not None
    assert quick == 8  # pydantic's JSON and isoformat() of the 4 UTC times; every other shape is parsed



def test_a_duration_longer_than_a_timedelta_holds_is_bad_input_on_every_flag(tmp_path):
    """`trace --window 99999999999d`, `audit --lookback …`, `replay --from/--to …` ended in
    an OverflowError traceback, exit 1 (exploratory review): the grammar's error, exit 2, like
    `--window soon`. A policy field of the grammar says so too (it was the same traceback)."""
    from typer.testing import CliRunner

    from gpuledger.cli import app
    from streams.controls.policy import PolicyError, parse_policy

    huge, longest = "99999999999d", f"{timedelta.max.days}d"
    with pytest.raises(TimeFormatError, match=rf"--window: '{huge}' is longer than the longest duration gpuledger holds \({longest}\)"):
        parse_duration(huge, "--window")
    for bad in ("9" * 400, float("inf"), float("nan")):
        with pytest.raises(TimeFormatError):
            parse_duration(bad)
    assert parse_duration(longest) == timedelta(days=timedelta.max.days)
    env = {"GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "200"}
    runner = CliRunner()
    for args, said in ((["trace", "--pod", "ml/ocr-a", "--window", huge], f"error: --window: '{huge}' is longer than"),
                       (["audit", "--lookback", huge], f"error: --lookback: '{huge}' is longer than"),
                       (["replay", "--into", f"chdb://{tmp_path / 'sb'}", "--from", huge], f"error: --from '{huge}': a duration before now reaching before 1900-01-01"),
                       (["replay", "--into", f"chdb://{tmp_path / 'sb'}", "--from", "1d", "--to", huge], f"error: --to '{huge}': a duration before now")):
        out = runner.invoke(app, args, env=env)
        assert out.exit_code == 2 and said in out.output, (args, out.output)
    with pytest.raises(PolicyError, match=rf"emergency_overrides.max_duration: '{huge}' is longer than the longest duration"):
        parse_policy(f"emergency_overrides:\n  max_duration: {huge}\n", "policy.yaml")
