"""sinks/agents.py in a real worker (Faust + its own chDB) fed through a real broker.

The incident's CorrelatedEvent / GpuAllocation records go straight onto the output
topics (as the streams stage would produce them), twice — the second round is a
re-delivery — and a few raw envelopes go onto the raw topics. One correlated record
is valid but holds a value its release_history column cannot take: the store rejects
that row, and the worker dead-letters it instead of stalling. Assertions read the
worker's store through its read-only endpoint and through `gpuledger trace`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

from producers._kafka import EventPublisher
from schemas import AlertEvent, Identity, ReleaseEvent, Source, encode_event, make_event_id
from schemas.alert import AlertPayload
from schemas.release import ReleasePayload
from sinks.agents import SinkWriters
from sinks.migrations import migrate
from sinks.read.query import DirectReader
from sinks.read.trace import chain_of, trace
from tests.sinks import incident as inc

AT = inc.T0 + timedelta(minutes=70)


def _raw_events():
    src = Source(collector="test", host="h")
    at = inc.T0 - timedelta(days=10)
    rel = ReleaseEvent(event_id=make_event_id("test", ("raw-only", "registered")), event_type="release.registered", occurred_at=at,
                       observed_at=at, source=src, identity=Identity(release_id="raw-only-release", model_name="other"),
                       payload=ReleasePayload(actor="ci"))
    alert = AlertEvent(event_id=make_event_id("test", ("raw-only", "alert")), event_type="alert.firing", occurred_at=at, observed_at=at,
                       source=src, identity=Identity(alert_fingerprint="raw-only-fp", release_id="raw-only-release"),
                       payload=AlertPayload(alertname="Other", starts_at=at))
    return [rel, alert]


def _health(worker) -> dict:
    with urllib.request.urlopen(f"{worker.url}/gpuledger/health/", timeout=5) as resp:
        return json.loads(resp.read())["stats"]


def _counts(reader, ids: list[str]) -> dict[str, int]:
    q = {
        "correlated_events": "SELECT count() AS n FROM gpuledger.correlated_events FINAL WHERE correlation_id IN {ids:Array(String)}",
        "release_history": "SELECT count() AS n FROM gpuledger.release_history FINAL WHERE correlation_id IN {ids:Array(String)}",
        "workload_timeline": "SELECT count() AS n FROM gpuledger.workload_timeline FINAL WHERE correlation_id IN {ids:Array(String)}",
        "enriched_alerts": "SELECT count() AS n FROM gpuledger.enriched_alerts FINAL WHERE correlation_id IN {ids:Array(String)}",
        "gpu_allocations": "SELECT count() AS n FROM gpuledger.gpu_allocations FINAL",
        "raw_events": "SELECT count() AS n FROM gpuledger.raw_events FINAL",
        # The record that is not a correlated event: refused by the intake's constraint, named.
        "sink_dead_letters": "SELECT count() AS n FROM gpuledger.dead_letters FINAL WHERE stage = 'sinks.correlated_events' "
                             "AND reason = 'store_rejected' AND position(error, 'has_correlation_id') > 0",
        "store_rejected": "SELECT count() AS n FROM gpuledger.dead_letters FINAL WHERE stage = 'sinks.release_history' "
                          "AND reason = 'store_rejected' AND position(value, 'poison-release') > 0",
    }
    return {name: reader.query(sql, {"ids": ids}).dicts()[0]["n"] for name, sql in q.items()}


def test_sink_agents_store_every_output_once_through_a_real_worker(kafka_bootstrap, catalogue, worker_factory, clickhouse_client,
                                                                  clickhouse_db):
    worker = worker_factory(catalogue)
    pub = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    correlated, allocations, raw = inc.correlated_rows(), inc.allocation_rows(), _raw_events()
    for _round in range(2):  # the second round is a re-delivery of the same records
        for row in correlated:
            pub.publish_raw(catalogue.run(f"{catalogue.prefix}-app").correlated, (row.identity.release_id or row.correlation_id).encode(), encode_event(row))
        for alloc in allocations:
            pub.publish_raw(catalogue.run(f"{catalogue.prefix}-app").allocations, f"{alloc.node}/{alloc.gpu_id}".encode(), encode_event(alloc))
        pub.publish_batch(raw)
    run = catalogue.run(f"{catalogue.prefix}-app")
    pub.publish_raw(run.correlated, b"k", b'{"not": "a correlated event"}')
    poison = correlated[0].model_copy(update={"correlation_id": "poison-release", "identity": Identity(release_id="poison-release"),
                                              "payload_json": '{"reservation": {"gpus": -5}}'})
    pub.publish_raw(run.correlated, b"poison", encode_event(poison))  # reservation_gpus is Nullable(UInt32)
    pub.publish_raw(catalogue.release, b"k", b"not json either")

    # What the sink must hold: exactly what writing the incident directly holds.
    migrate(clickhouse_client, clickhouse_db)
    writers = SinkWriters(clickhouse_client, clickhouse_db)
    asyncio.run(writers.store_correlated(correlated))
    asyncio.run(writers.store_allocations(allocations))
    ids = sorted({r.correlation_id for r in correlated})
    expected: dict[str, int] = {}
    direct = DirectReader(clickhouse_client)
    for table in ("correlated_events", "release_history", "workload_timeline", "enriched_alerts", "gpu_allocations"):
        where = "1" if table == "gpu_allocations" else "correlation_id IN {ids:Array(String)}"
        expected[table] = direct.query(f"SELECT count() AS n FROM {{db:Identifier}}.{table} FINAL WHERE {where}",
                                       {"db": clickhouse_db, "ids": ids}).dicts()[0]["n"]
    expected["raw_events"] = len(raw)
    expected["sink_dead_letters"] = 1
    expected["store_rejected"] = 1

    deadline = time.monotonic() + 60
    while True:
        stats, counts = _health(worker), _counts(worker.reader, ids)
        consumed = (stats.get("stored", 0) >= 2 * len(correlated) and stats.get("allocations_stored", 0) >= 2 * len(allocations)
                    and stats.get("raw_stored", 0) >= 2 * len(raw) and stats.get("raw_skipped", 0) >= 1)
        if consumed and counts == expected:
            break
        assert time.monotonic() < deadline, f"stats {stats}\ncounts {counts}\nexpected {expected}\n{worker.service.log_tail()}"
        time.sleep(0.3)
    assert stats["raw_skipped"] == 1  # the record that is not an envelope: skipped, counted (and dead-lettered upstream)
    assert stats["store_rejected"] == 2  # the poison release (by the intake's range checks) and the record that is not one (its parser)
    letter = worker.reader.query(
        "SELECT source_topic, key, error FROM gpuledger.dead_letters FINAL WHERE reason = 'store_rejected' "
        "AND stage = 'sinks.release_history'", {}).dicts()
    assert [(d["source_topic"], d["key"]) for d in letter] == [(run.correlated, "poison")]
    assert "reservation_gpus" in letter[0]["error"] and "correlated_fields_mv" in letter[0]["error"] and "Hint:" in letter[0]["error"]

    # The chain read through the worker's endpoint equals the one read from the direct write.
    through_worker = trace(worker.reader, "gpuledger", "alert", inc.FP, at=AT)
    assert chain_of(through_worker) == chain_of(trace(direct, clickhouse_db, "alert", inc.FP, at=AT))

    # And `gpuledger trace` finds the owning worker by itself.
    env = {**os.environ, "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "trace", "--gpu", f"node-b/{inc.GPU_B}", "--at", AT.isoformat(),
                          "--format", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert chain_of(json.loads(out.stdout)) == chain_of(through_worker)
