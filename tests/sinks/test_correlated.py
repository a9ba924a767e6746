"""sinks/correlated.py (+ the SinkWriters of sinks/agents.py) against real ClickHouse:
family routing, typed columns, re-delivery, and retry while the store is unreachable."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from gpuledger.dev.process import free_port
from sinks.agents import SinkWriters
from sinks.clickhouse import StoreConnection, connect
from sinks.errors import StoreUnavailable
from sinks.migrations import MIGRATIONS, migrate
from tests.sinks import incident as inc

REPO = Path(__file__).resolve().parents[2]


def _count(client, db: str, table: str, where: str = "1") -> int:
    return client.query(f"SELECT count() FROM `{db}`.{table} FINAL WHERE {where}").result_rows[0][0]


def _expected_counts() -> dict[str, int]:
    rows = list(inc.latest(inc.correlated_rows()).values())
    return {
        "correlated_events": len(rows),
        "release_history": sum(r.event_type.startswith("release.") for r in rows),
        # By (workload, time, id): the row re-attributed from a wrong workload stays behind
        # under the old key; readers drop it (test_trace), the table keeps it.
        "workload_timeline": sum(r.event_type.startswith("scheduler.") and bool(r.identity.workload_id) for r in rows) + 1,
        "enriched_alerts": sum(r.event_type.startswith("alert.") for r in rows),
        "gpu_allocations": len(inc.latest(inc.allocation_rows())),
    }


def _store(writers: SinkWriters) -> None:
    async def go():
        await writers.store_correlated(inc.correlated_rows())
        await writers.store_allocations(inc.allocation_rows())
    asyncio.run(go())


def test_rows_go_to_their_family_tables_and_redelivery_changes_nothing(clickhouse_client, clickhouse_db):
    migrate(clickhouse_client, clickhouse_db)
    writers = SinkWriters(clickhouse_client, clickhouse_db)
    _store(writers)
    expected = _expected_counts()
    counts = {t: _count(clickhouse_client, clickhouse_db, t) for t in expected}
    assert counts == expected
    # Re-delivery: the same batches again, and the superseded versions once more on their own.
    _store(writers)
    asyncio.run(writers.store_correlated([r for r in inc.correlated_rows() if r.version == 0]))
    assert {t: _count(clickhouse_client, clickhouse_db, t) for t in expected} == expected
    # A scheduler row without a workload stays out of the timeline (it is in correlated_events).
    failed = clickhouse_client.query(
        f"SELECT workload_id, version FROM `{clickhouse_db}`.workload_timeline FINAL WHERE event_type = 'scheduler.failed_scheduling'").result_rows
    assert failed == [(inc.W7, 1)]
    # The highest version wins, whatever order versions were inserted in.
    fp_rows = clickhouse_client.query(
        f"SELECT event_type, version, release_id, workload_id, node, gpu_id FROM `{clickhouse_db}`.enriched_alerts FINAL "
        "WHERE alert_fingerprint = {fp:String} ORDER BY occurred_at", parameters={"fp": inc.FP}).result_rows
    assert fp_rows == [("alert.firing", 1, inc.R7, inc.W7, "node-b", inc.GPU_B), ("alert.resolved", 0, inc.R7, inc.W7, "node-b", inc.GPU_B)]


def test_payload_fields_become_typed_columns(clickhouse_client, clickhouse_db):
    migrate(clickhouse_client, clickhouse_db)
    _store(SinkWriters(clickhouse_client, clickhouse_db))
    db = clickhouse_db
    promoted = clickhouse_client.query(
        f"SELECT actor, approval_id, to_environment, superseded_release_id, artifact_digest, owner FROM `{db}`.release_history FINAL "
        "WHERE release_id = {r:String} AND event_type = 'release.promoted'", parameters={"r": inc.R7}).result_rows
    assert promoted == [("alice", "CHG-1042", "prod", inc.R6, inc.MANIFEST7["artifact_digest"], "team-risk")]
    registered = clickhouse_client.query(
        f"SELECT version, model_version, image_digest FROM `{db}`.release_history FINAL WHERE release_id = {{r:String}} "
        "AND event_type = 'release.registered'", parameters={"r": inc.R7}).result_rows
    assert registered == [(1, "7", inc.MANIFEST7["image_digest"])]  # the re-rendered manifest superseded the partial one
    pre = clickhouse_client.query(
        f"SELECT preemptor_kind, preemptor_namespace, preemptor_name, reason, priority, queue FROM `{db}`.workload_timeline FINAL "
        "WHERE event_type = 'scheduler.preempted'").result_rows
    assert pre == [("Workload", "training", "llm-finetune-3", "Preempted", 1000, "prod-inference")]
    admitted = clickhouse_client.query(
        f"SELECT flavors, cluster_queue FROM `{db}`.workload_timeline FINAL WHERE workload_id = {{w:String}} "
        "AND event_type = 'scheduler.admitted' ORDER BY occurred_at LIMIT 1", parameters={"w": inc.W7}).result_rows
    assert admitted == [({"nvidia.com/gpu": "a100-80gb"}, "gpu-a100")]
    alert = clickhouse_client.query(
        f"SELECT alertname, severity, labels['pod'], annotations['summary'], ends_at FROM `{db}`.enriched_alerts FINAL "
        "WHERE alert_fingerprint = {fp:String} AND event_type = 'alert.firing'", parameters={"fp": inc.FP}).result_rows
    assert alert == [("ModelQualityDegraded", "critical", inc.P2, "precision@k dropped below 0.82", None)]


def test_writer_waits_for_an_unreachable_server_and_loses_nothing(clickhouse_client, clickhouse_db):
    """ClickHouse unreachable (a real HTTP connection refused), then reachable: the
    writer's connection factory is asked again until it gets a client."""
    dead = f"http://127.0.0.1:{free_port()}/"
    attempts: list[str] = []

    def factory():
        attempts.append("try")
        if len(attempts) <= 3:
            return connect(dead, clickhouse_db)  # raises StoreUnavailable: connection refused
        return clickhouse_client

    store = StoreConnection(factory, on_connect=lambda c: migrate(c, clickhouse_db), description="flaky")
    writers = SinkWriters(store, clickhouse_db, initial_backoff_s=0.05, max_backoff_s=0.1)
    started = time.monotonic()
    _store(writers)
    assert time.monotonic() - started < 10
    assert store.connect_attempts == 4
    assert writers.writers["correlated_events"].failures == 3
    assert writers.writers["correlated_events"].rows_written == len(inc.correlated_rows())
    expected = _expected_counts()
    assert {t: _count(clickhouse_client, clickhouse_db, t) for t in expected} == expected


def test_connect_reports_a_refused_server_as_unavailable():
    try:
        connect(f"http://127.0.0.1:{free_port()}/", "x")
    except StoreUnavailable as exc:
        assert "127.0.0.1" in str(exc) and "GPULEDGER_CLICKHOUSE_DSN" in str(exc)
    else:
        raise AssertionError("connect to a closed port succeeded")


_HOLDER = textwrap.dedent("""
    import sys, time
    from sinks.clickhouse import connect
    client = connect(sys.argv[1], "hold")
    print("held", flush=True)
    sys.stdin.read()  # hold the directory until the test closes our stdin
""")

_WRITER = textwrap.dedent("""
    import asyncio, json, logging, sys
    from sinks.agents import SinkWriters
    from sinks.clickhouse import migrated_store
    from tests.sinks import incident as inc
    dsn, db = sys.argv[1], "gpuledger"
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append([record.levelname, record.getMessage()])
            if record.levelno == logging.WARNING and len(lines) == 1:
                print("refused", flush=True)  # the test releases the directory now

    logging.getLogger("sinks.clickhouse").addHandler(Lines())
    logging.getLogger("sinks.clickhouse").setLevel(logging.INFO)
    store = migrated_store(dsn, db)  # as a worker starting while another process holds the store
    writers = SinkWriters(store, db, initial_backoff_s=0.1, max_backoff_s=0.2)
    asyncio.run(writers.store_correlated(inc.correlated_rows()))
    client = store.get()
    count = client.query(f"SELECT count() FROM {db}.correlated_events FINAL").result_rows[0][0]
    versions = [v for (v,) in client.query(f"SELECT version FROM {db}.schema_migrations FINAL").result_rows]
    print(json.dumps({"lines": lines, "count": count, "attempts": store.connect_attempts, "versions": versions}), flush=True)
""")


def test_writer_waits_while_another_process_owns_the_chdb_directory(tmp_path):
    """The honest embedded case: another process holds the chDB directory (StoreLocked)
    when the worker's lazy store first connects; the writer retries, logging one line
    for the whole wait, then migrates and writes everything once the owner lets go."""
    dsn = f"chdb://{tmp_path / 'store'}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, dsn], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, dsn], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = writer.stdout.readline().split()
        assert first == ["refused"], (first, writer.stderr.read() if writer.poll() is not None else "")
        holder.stdin.close()  # the owner exits and releases the directory
        holder.wait(timeout=30)
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["count"] == len(inc.latest(inc.correlated_rows()))
        assert sorted(result["versions"]) == [m.version for m in MIGRATIONS]  # migrated on the first successful connect
        levels = [level for level, _ in result["lines"]]
        assert levels == ["WARNING", "INFO"], result["lines"]  # however many attempts the wait took
        assert "owned by another process" in result["lines"][0][1]  # StoreLocked
        assert f"after {result['attempts']} attempts" in result["lines"][1][1] and result["attempts"] >= 2
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_record_read_loosely_takes_defaults_for_null_fields_and_names_what_is_missing(clickhouse_client, clickhouse_db):
    """The sink reads the worker's records without pydantic (``sinks.agents.decode_loose``): a
    null field reads as the model's default where it has one (summary '', payload_json '{}'),
    else as None — also a null identity field, which the table stores as ''. A record missing
    a required field is refused with its name."""
    import orjson
    import pytest

    from schemas import CorrelatedEvent
    from sinks.agents import _required, decode_loose

    shape = _required(CorrelatedEvent)
    record = {"correlation_id": "c-null", "version": 3, "event_type": "scheduler.scheduled", "occurred_at": "2026-11-01T00:01:41+00:00",
              "attribution": "unattributed", "identity": {"namespace": "ml", "pod": "p-null", "release_id": None},
              "release_state": None, "summary": None, "source_topic": "raw", "source_partition": 0, "source_offset": 7}
    row = decode_loose(orjson.dumps(record), CorrelatedEvent, shape)
    assert (row.summary, row.payload_json, row.release_state, row.identity.release_id, row.identity.gpu_id) == ("", "{}", None, None, None)
    migrate(clickhouse_client, clickhouse_db)
    asyncio.run(SinkWriters(clickhouse_client, clickhouse_db).store_correlated([row]))
    stored = clickhouse_client.query(
        f"SELECT summary, payload_json, release_state, release_id, pod FROM `{clickhouse_db}`.correlated_events FINAL "
        "WHERE correlation_id = 'c-null'").result_rows
    assert stored == [("", "{}", "", "", "p-null")]
    with pytest.raises(ValueError, match="missing correlation_id"):
        decode_loose(orjson.dumps({k: v for k, v in record.items() if k != "correlation_id"}), CorrelatedEvent, shape)
