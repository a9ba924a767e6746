"""sinks/raw.py: the raw event log keeps every envelope once, skips what is not one."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest

from tests.fixtures.sample_events import sample_events
from sinks.agents import SinkWriters
from sinks.migrations import migrate
from sinks.raw import NotAnEnvelope, raw_event_row


def _records():
    events = sample_events(datetime(2026, 11, 30, 13, 0, tzinfo=timezone.utc))
    return [(e.model_dump_json().encode(), f"t.{e.event_type.split('.')[0]}.v1", 0, i) for i, e in enumerate(events)], events


def test_loose_decoding_keeps_envelopes_the_family_schema_would_reject():
    records, events = _records()
    bad_family = json.loads(records[0][0])
    bad_family["identity"].pop("release_id")  # a release event without release_id: dead-lettered, but an envelope
    row = raw_event_row(json.dumps(bad_family), "t.release.v1", 1, 7)
    assert row[0] == events[0].event_id and row[1] == "release.registered"
    assert row[-3:] == ["t.release.v1", 1, 7]
    for value in (b"not json", b"[1, 2]", json.dumps({"event_type": "x"}),
                  json.dumps({**bad_family, "occurred_at": "2026-11-30T13:00:00"}),  # naive time
                  json.dumps({**bad_family, "occurred_at": "yesterday"})):
        with pytest.raises(NotAnEnvelope):
            raw_event_row(value, "t", 0, 0)


def test_raw_events_are_stored_once_with_their_kafka_coordinates(clickhouse_client, clickhouse_db):
    migrate(clickhouse_client, clickhouse_db)
    writers = SinkWriters(clickhouse_client, clickhouse_db)
    records, events = _records()
    poison = [(b"this is not json", "t.release.v1", 0, 99)]
    skipped = asyncio.run(writers.store_raw(records + poison))
    assert skipped == 1 and writers.counters.totals["rejected.not_an_envelope"] == 1
    # Re-delivered, and the first event re-sent by its collector (same id, later offset).
    asyncio.run(writers.store_raw(records))
    asyncio.run(writers.store_raw([(records[0][0], records[0][1], 0, 500)]))
    rows = clickhouse_client.query(
        f"SELECT event_id, event_type, source_collector, release_id, alert_fingerprint, kafka_offset "
        f"FROM `{clickhouse_db}`.raw_events FINAL ORDER BY occurred_at").result_rows
    assert [r[0] for r in rows] == [e.event_id for e in events]
    assert rows[0][5] == 500  # the copy kept is deterministic: the highest offset
    assert rows[-1][4] == events[-1].identity.alert_fingerprint and all(r[2] == "demo" for r in rows)
    payload = clickhouse_client.query(
        f"SELECT JSONExtractString(payload_json, 'alertname') FROM `{clickhouse_db}`.raw_events FINAL WHERE event_type = 'alert.firing'"
    ).result_rows
    assert payload == [("ModelQualityDegraded",)]


def test_an_event_the_route_stage_accepts_is_in_the_log_whatever_form_its_time_takes(clickhouse_client, clickhouse_db):
    """Found by a review: the envelope's schema (pydantic) reads a time given as seconds since the
    epoch, or with a lower-case 't'/'z'; the route stage routed such an event into the correlated
    tables, but the raw log skipped it as "not an envelope" (counted, with a comment saying it was
    dead-lettered — by nobody): missing from ``raw_events``, and from the trace's manifest as of a
    time. It is stored now, at the time ``decode_event`` reads."""
    from schemas import decode_event

    migrate(clickhouse_client, clickhouse_db)
    records, events = _records()
    base = json.loads(records[0][0])
    forms = {"epoch": 1796043600, "epoch-text": "1796043600", "lower-case": "2026-11-30t13:00:00z"}
    values = [json.dumps({**base, "event_id": f"{name}-{base['event_id']}"[:64], "occurred_at": at, "observed_at": at}).encode()
              for name, at in forms.items()]
    decoded = [decode_event(v) for v in values]  # what the route stage accepts (it raises otherwise)
    writers = SinkWriters(clickhouse_client, clickhouse_db)
    skipped = asyncio.run(writers.store_raw([(v, "t.release.v1", 0, i) for i, v in enumerate(values)]))
    assert skipped == 0 and "rejected.not_an_envelope" not in writers.counters.totals
    rows = clickhouse_client.query(f"SELECT event_id, occurred_at, observed_at FROM `{clickhouse_db}`.raw_events FINAL ORDER BY event_id").result_rows
    assert sorted((e.event_id, e.occurred_at, e.observed_at) for e in decoded) == [
        (i, o.replace(tzinfo=timezone.utc), b.replace(tzinfo=timezone.utc)) for i, o, b in rows]
    for bad in ("2026-11-30T13:00:00", "yesterday", [2026], True):  # naive, not a time: not an envelope, as the route stage says
        with pytest.raises(NotAnEnvelope):
            raw_event_row(json.dumps({**base, "occurred_at": bad}), "t", 0, 0)
