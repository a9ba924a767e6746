"""Records at Kafka's size limits through the real worker: a raw record the broker
accepted but the worker cannot forward becomes a dead letter naming it — never a lost
batch — and a huge (but forwardable) alert is correlated with a bounded payload,
without growing its entity past what a changelog record can carry."""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import datetime, timedelta, timezone

from producers._kafka import EventPublisher
from schemas import AlertEvent, Identity, Source, encode_event, make_event_id
from schemas.alert import AlertPayload

T0 = datetime(2026, 11, 1, 9, tzinfo=timezone.utc)
FAST = {"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "1", "GPULEDGER_STREAMS_BATCH_MAX": "50"}


def alert(i: int, annotation: str = "", name: str = "Quality") -> AlertEvent:
    at = T0 + timedelta(seconds=i)
    return AlertEvent(event_id=make_event_id("big", (i,)), event_type="alert.firing", occurred_at=at, observed_at=at,
                      source=Source(collector="test"), identity=Identity(alert_fingerprint=f"big{i % 3}", namespace="ml", pod="p1"),
                      payload=AlertPayload(alertname=name, starts_at=at, annotations={"description": annotation} if annotation else {}))


def wait_rows(reader, sql: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    rows = []
    while time.monotonic() < deadline:
        rows = reader.query(sql).dicts()
        if check(rows):
            return rows
        time.sleep(0.5)
    raise AssertionError(f"never matched: {rows}")


def test_a_record_too_large_to_forward_is_dead_lettered_and_its_batch_is_not_lost(kafka_bootstrap, catalogue, worker_factory):
    worker = worker_factory(catalogue, extra_env=FAST)
    pub = EventPublisher({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 1_100_000}, catalogue, "test")
    small = [alert(i) for i in range(120)]
    # The broker takes it (topic limit 1,048,588 bytes), but its row cannot travel: the payload
    # is cut to 32 KiB on the way (entities.bounded_payload), the alert's name — in the row's
    # summary — is not ...
    boundary = alert(500, name="x" * 1_040_000)
    huge = alert(501, "y" * 700_000)              # ... and this one, which the worker can forward
    assert 1_000_000 < len(encode_event(boundary)) < 1_048_000
    for chunk in (small[:60], [boundary], [huge], small[60:]):
        for ev in chunk:
            pub.publish_raw(catalogue.alert, ev.correlation_key().encode(), encode_event(ev))
    ids = [ev.event_id for ev in small] + [huge.event_id]

    rows = wait_rows(worker.reader, "SELECT correlation_id, payload_json FROM gpuledger.correlated_events FINAL",
                     lambda rows: {r["correlation_id"] for r in rows} >= set(ids))
    assert boundary.event_id not in {r["correlation_id"] for r in rows}
    big_row = next(r for r in rows if r["correlation_id"] == huge.event_id)
    assert len(big_row["payload_json"]) <= 32 * 1024 and json.loads(big_row["payload_json"])["_truncated_bytes"] > 700_000

    [letter] = wait_rows(worker.reader, "SELECT reason, error, source_topic, source_offset FROM gpuledger.dead_letters FINAL",
                         lambda rows: len(rows) >= 1)
    assert letter["reason"] == "output_refused" and "MSG_SIZE_TOO_LARGE" in letter["error"]
    assert (letter["source_topic"], letter["source_offset"]) == (catalogue.alert, 60)  # one key: one partition, 60 records before it
    # the raw event log keeps even the record the worker could not forward
    raw = worker.reader.query("SELECT count() AS n FROM gpuledger.raw_events FINAL").dicts()[0]["n"]
    assert raw == len(small) + 2
    assert worker.service.alive()
    # both payloads were cut where their rows were built (the route stage), and the health page says so
    with urllib.request.urlopen(f"{worker.url}/gpuledger/health/", timeout=10) as resp:
        capped = json.load(resp)["stats"]["capped"]
    assert capped == {"payloads_truncated": 2, "rows_detached": 0, "links_detached": 0, "control_rows_dropped": 0,
                      "control_fingerprints_detached": 0}, capped
    from tests.streams.test_app import status_of

    status = status_of(kafka_bootstrap, catalogue, worker)
    assert "state bounds hit since start: payloads truncated 2\n" in status.stdout, status.output


def test_an_output_record_whose_key_alone_is_too_large_is_dead_lettered_with_its_key_cut(kafka_bootstrap, catalogue):
    """The worker's producer refuses a record whose key alone passes the record limit: its dead
    letter carries the first 1 KiB of that key (as its own Kafka key too) — before, the letter
    kept the whole key, was refused in turn, and dead-lettering it again recursed without end.
    A tombstone refused alike is dead-lettered as an empty value."""
    import asyncio
    import uuid

    from schemas.outputs import DeadLetter
    from streams.output import MAX_DEAD_KEY, BatchOutput
    from tests.fixtures.kafka import read_topic

    run = catalogue.run(f"keys-{uuid.uuid4().hex[:6]}")
    from producers._kafka import ensure_specs

    ensure_specs({"bootstrap.servers": kafka_bootstrap}, run.specs(), 1)
    out = BatchOutput({"bootstrap.servers": kafka_bootstrap}, "test-oversize-key", run.deadletter, max_message_bytes=4096)
    huge = b"k" * 10_000
    out.produce(run.correlated, huge, b"{}", source=(run.route, 1, 42))
    out.produce(run.correlated, huge, None)
    asyncio.run(out.flush())
    out.close()
    assert out.dead_letters == 2 and out.produced[run.deadletter] == 2, (out.dead_letters, out.produced)
    records = read_topic(kafka_bootstrap, run.deadletter, 2, 30.0, 0.5)
    letters = [DeadLetter.model_validate_json(m.value()) for m in records]
    assert [m.key() for m in records] == [huge[:MAX_DEAD_KEY]] * 2
    assert {(d.reason, d.key, d.source_offset) for d in letters} == {("output_refused", "k" * MAX_DEAD_KEY, 42),
                                                                      ("output_refused", "k" * MAX_DEAD_KEY, None)}
    assert sorted(d.value for d in letters) == ["", "{}"] and all("MSG_SIZE_TOO_LARGE" in d.error for d in letters), letters
