"""The thin end-to-end path: real broker, real Faust worker, real ClickHouse (chDB).

A release and a firing alert go in through the producer wrapper; the worker joins
them and stores correlated rows; assertions read rows back from ClickHouse through
the worker's read-only query endpoint and through `gpuledger trace`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

from tests.fixtures.sample_events import FINGERPRINT, MANIFEST, RELEASE_ID, sample_events
from producers._kafka import EventPublisher
from sinks.read.query import QueryError
from sinks.read.trace import trace_alert
from tests.fixtures.kafka import read_topic

import pytest


def wait_rows(reader, sql, params, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    rows = []
    while time.monotonic() < deadline:
        rows = reader.query(sql, params).dicts()
        if predicate(rows):
            return rows
        time.sleep(0.3)
    raise AssertionError(f"condition not met within {timeout}s; last rows: {rows}")


def test_release_and_alert_are_joined_and_stored(kafka_bootstrap, catalogue, worker_factory):
    worker = worker_factory(catalogue)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    # Alert first: out-of-order arrival must be corrected once the release is known.
    events = sample_events(datetime.now(timezone.utc))
    publisher.publish_batch(events[3:])
    publisher.publish_batch(events[:3])

    rows = wait_rows(
        worker.reader,
        "SELECT correlation_id, event_type, release_id, model_version, artifact_digest, attribution, release_state "
        "FROM gpuledger.correlated_events FINAL WHERE release_id = {rid:String} ORDER BY occurred_at",
        {"rid": RELEASE_ID},
        lambda rows: len(rows) == 4 and all(r["artifact_digest"] for r in rows),
    )
    assert [r["event_type"] for r in rows] == ["release.registered", "release.approved", "release.promoted", "alert.firing"]
    alert_row = rows[-1]
    assert alert_row["model_version"] == MANIFEST.model_version
    assert alert_row["artifact_digest"] == MANIFEST.artifact_digest
    assert alert_row["attribution"] == "release_label"
    assert alert_row["release_state"] == "release.promoted"

    # The reader sees one row per input even though the alert was emitted twice.
    counts = worker.reader.query("SELECT count() AS n FROM gpuledger.correlated_events FINAL").dicts()
    assert counts[0]["n"] == 4

    # The derived tables are written after correlated_events, batch by batch (source of
    # truth first): the trace reads them, so wait until they hold the chain too.
    wait_rows(worker.reader, "SELECT count() AS n FROM gpuledger.release_history FINAL WHERE release_id = {rid:String}", {"rid": RELEASE_ID},
              lambda rows: rows[0]["n"] == 3)
    wait_rows(worker.reader, "SELECT count() AS n FROM gpuledger.enriched_alerts FINAL WHERE alert_fingerprint = {fp:String}",
              {"fp": FINGERPRINT}, lambda rows: rows[0]["n"] == 1)
    trace = trace_alert(worker.reader, "gpuledger", FINGERPRINT)
    assert trace["release"]["release_id"] == RELEASE_ID
    assert trace["release"]["artifact_digest"] == MANIFEST.artifact_digest
    assert [e["event_type"] for e in trace["release"]["lifecycle"]] == ["release.registered", "release.approved", "release.promoted"]

    # The CLI finds the owning worker by itself and prints the same chain as JSON.
    env = {**os.environ, "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "trace", "--alert", FINGERPRINT, "--format", "json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    assert cli["release"]["model_version"] == "7" and cli["release"]["artifact_digest"] == MANIFEST.artifact_digest

    # Enriched alerts reach alert-routing consumers with the release manifest.
    enriched = read_topic(kafka_bootstrap, catalogue.run(f"{catalogue.prefix}-app").enriched_alerts, min_count=1)
    latest = json.loads(enriched[-1].value())
    assert latest["identity"]["owner"] == MANIFEST.owner and latest["identity"]["release_id"] == RELEASE_ID


def test_poison_records_go_to_dead_letters_and_the_worker_keeps_going(kafka_bootstrap, catalogue, worker_factory):
    worker = worker_factory(catalogue)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    good = sample_events(datetime.now(timezone.utc))
    missing_id = json.loads(good[0].model_dump_json())
    missing_id["identity"].pop("release_id")
    wrong_type = json.loads(good[3].model_dump_json())
    wrong_type["payload"]["starts_at"] = "not-a-time"
    unknown = {**json.loads(good[1].model_dump_json()), "event_type": "release.exploded"}
    future = {**json.loads(good[1].model_dump_json()), "schema_version": 99}
    poison = [
        (catalogue.release, b"this is not json", "not_json"),
        (catalogue.release, json.dumps(missing_id).encode(), "validation"),
        (catalogue.alert, json.dumps(wrong_type).encode(), "validation"),
        (catalogue.release, json.dumps(unknown).encode(), "unknown_event_type"),
        (catalogue.release, json.dumps(future).encode(), "unsupported_schema_version"),
    ]
    for topic, value, _ in poison:
        publisher.publish_raw(topic, RELEASE_ID.encode(), value)
    publisher.publish_batch(good)

    dead = wait_rows(worker.reader, "SELECT reason, error, source_topic, source_offset FROM gpuledger.dead_letters FINAL ORDER BY source_topic, source_offset",
                     {}, lambda rows: len(rows) == len(poison))
    assert sorted(r["reason"] for r in dead) == sorted(p[2] for p in poison)
    by_reason = {r["reason"]: r["error"] for r in dead}
    assert "identity.release_id is required" in " ".join(r["error"] for r in dead)
    assert "payload.starts_at" in " ".join(r["error"] for r in dead)
    assert "release.exploded" in by_reason["unknown_event_type"]
    assert "[schema_version=99 supported=1]" in by_reason["unsupported_schema_version"]
    assert all(r["source_topic"] in (catalogue.release, catalogue.alert) for r in dead)

    # The good events after the poison were still correlated.
    wait_rows(worker.reader, "SELECT correlation_id FROM gpuledger.correlated_events FINAL WHERE release_id = {rid:String}",
              {"rid": RELEASE_ID}, lambda rows: len(rows) == 4)
    dl_topic = read_topic(kafka_bootstrap, catalogue.run(f"{catalogue.prefix}-app").deadletter, min_count=len(poison))
    assert len(dl_topic) == len(poison)
    assert worker.service.alive()


def test_read_only_is_enforced_by_clickhouse(catalogue, worker_factory):
    worker = worker_factory(catalogue)
    with pytest.raises(QueryError):
        worker.reader.query("INSERT INTO gpuledger.dead_letters (reason) VALUES ('x')")
    with pytest.raises(QueryError, match="(?i)readonly"):
        worker.reader.query("SELECT * FROM url('http://127.0.0.1:9/x', CSV, 'a String')")
    with pytest.raises(QueryError, match="one statement at a time"):
        worker.reader.query("SELECT 1); INSERT INTO gpuledger.dead_letters (reason) VALUES ('x'); SELECT (1")
    rows = worker.reader.query("SELECT count() AS n FROM gpuledger.dead_letters").dicts()
    assert rows == [{"n": 0}]
    # A person's statements through the worker's endpoint, unqualified: the worker's database is the default.
    assert "dead_letters" in {r["name"] for r in worker.reader.query("SHOW TABLES").dicts()}
    assert "reason" in {r["name"] for r in worker.reader.query("DESCRIBE dead_letters").dicts()}
