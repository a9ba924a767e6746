"""deploy/clickhouse/queries/*.sql run unchanged (parameters bound, read-only as the
CLI runs them) against the real tables holding tests/sinks/incident.py."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest

from tests.fixtures.sample_events import sample_events
from sinks.read.query import DirectReader
from tests.sinks import incident as inc

QUERIES = Path(__file__).resolve().parents[2] / "deploy" / "clickhouse" / "queries"
AT = inc.T0 + timedelta(minutes=70)
WINDOW = {"from": inc.T0 + timedelta(minutes=50), "to": AT}
RAW = sample_events(inc.T0)


@pytest.fixture(scope="module")
def store(clickhouse_client):
    db = inc.load_store(clickhouse_client, RAW)
    return DirectReader(clickhouse_client), db


def run(store, name: str, **params) -> list[dict]:
    reader, db = store
    sql = (QUERIES / name).read_text()
    return reader.query(sql, {"db": db, **params}).dicts()


def test_every_file_is_covered_and_documents_its_parameters():
    files = sorted(p.name for p in QUERIES.glob("*.sql"))
    tested = sorted(name[5:] + ".sql" for name in globals() if name.startswith("test_") and (QUERIES / (name[5:] + ".sql")).exists())
    assert files == tested
    for path in QUERIES.glob("*.sql"):
        text = path.read_text()
        for param in set(re.findall(r"\{(\w+):", text)):
            assert f"--param_{param}" in text, f"{path.name}: the header does not show --param_{param}"


def test_alert(store):
    rows = run(store, "alert.sql", fp=inc.FP, at=None)
    assert [(r["event_type"], r["release_id"], r["workload_id"], r["node"], r["gpu_id"]) for r in rows] == [
        ("alert.firing", inc.R7, inc.W7, "node-b", inc.GPU_B), ("alert.resolved", inc.R7, inc.W7, "node-b", inc.GPU_B)]
    assert [r["release_state"] for r in run(store, "alert.sql", fp=inc.FP, at=AT)] == ["release.promoted"]


def test_release_lifecycle(store):
    before = run(store, "release_lifecycle.sql", release=inc.R7, at=inc.ROLLBACK_AT - timedelta(minutes=1))
    assert [r["event_type"] for r in before] == ["release.registered", "release.evaluated", "release.approved", "release.promoted"]
    assert before[2]["actor"] == "alice" and before[2]["approval_id"] == "CHG-1042"
    assert before[-1]["artifact_digest"] == inc.MANIFEST7["artifact_digest"]
    now = run(store, "release_lifecycle.sql", release=inc.R7, at=None)
    assert now[-1]["event_type"] == "release.rolled_back" and now[-1]["reason"] == "precision regression"


def test_release_workloads(store):
    [wl] = run(store, "release_workloads.sql", release=inc.R7, at=AT)
    assert (wl["workload_id"], wl["queue"], wl["cluster_queue"], wl["priority_class"], wl["priority"]) == \
        (inc.W7, "prod-inference", "gpu-a100", "prod-high", 1000)
    assert wl["first_admitted_at"].startswith("2026-11-30T12:17:30") and wl["admissions"] == 2
    assert (wl["preemptions"], wl["evictions"]) == (1, 1)
    assert sorted(wl["pods"]) == [f"risk/{inc.P1}", f"risk/{inc.P2}"] and sorted(wl["nodes"]) == ["node-a", "node-b"]


def test_workload_timeline(store):
    rows = run(store, "workload_timeline.sql", workload=inc.W7, at=None)
    types = [r["event_type"] for r in rows]
    assert types[0] == "scheduler.submitted" and types.count("scheduler.pods_ready") == 1
    assert [r["preemptor"] for r in rows if r["event_type"] == "scheduler.preempted"] == ["Workload/training/llm-finetune-3"]
    assert run(store, "workload_timeline.sql", workload=inc.W_WRONG, at=None) == []  # superseded under another workload


def test_pod_allocations(store):
    rows = run(store, "pod_allocations.sql", namespace="risk", pod=inc.P1, at=inc.T0 + timedelta(minutes=30))
    assert [(r["node"], r["gpu_id"], r["ended_at"]) for r in rows] == [("node-a", inc.GPU_A, None)]  # still held then
    rows = run(store, "pod_allocations.sql", namespace="risk", pod=inc.P1, at=None)
    assert rows[0]["ended_at"].startswith("2026-11-30T13:00:00") and rows[0]["end_reason"] == "released"


def test_gpu_holders(store):
    rows = run(store, "gpu_holders.sql", node="node-a", gpu=inc.GPU_A, at=AT)
    assert [(r["pod"], r["held_at_time"]) for r in rows] == [(inc.P1, 0), (inc.PT, 1)]
    [holder] = [r for r in run(store, "gpu_holders.sql", node="node-b", gpu=inc.GPU_B, at=AT) if r["held_at_time"]]
    assert (holder["pod"], holder["release_id"], holder["workload_id"]) == (inc.P2, inc.R7, inc.W7)


def test_model_releases(store):
    rows = run(store, "model_releases.sql", model="fraud-scorer", version="7", at=AT)
    assert [(r["release_id"], r["state"], r["environment"]) for r in rows] == [
        (inc.R7, "release.promoted", "prod"), (inc.R7_STAGING, "release.promoted", "staging")]
    # Now: v7 was rolled back (ended), restoring v6 — the rollback is v6's latest activity; but v7's
    # pod still holds node-b's GPU, so v7 comes first, as `gpuledger trace --model fraud-scorer` has it.
    now = run(store, "model_releases.sql", model="fraud-scorer", version="", at=None)
    assert [(r["release_id"], r["lifecycle_state"], r["holding_gpus"]) for r in now] == [
        (inc.R7, "release.rolled_back", 1), (inc.R6, "release.promoted", 0), (inc.R7_STAGING, "release.promoted", 0)]
    from sinks.read.trace import trace
    reader, db = store
    assert trace(reader, db, "model", "fraud-scorer")["entry"]["root"] == {"kind": "release", "id": now[0]["release_id"]}


def test_node_scheduler_events(store):
    rows = run(store, "node_scheduler_events.sql", nodes=["node-a"], **WINDOW)
    assert [(r["event_type"], r["workload_id"]) for r in rows] == [("scheduler.preempted", inc.W7), ("scheduler.scheduled", inc.WT)]
    assert rows[0]["preemptor"] == "Workload/training/llm-finetune-3"


def test_alerts_in_window(store):
    rows = run(store, "alerts_in_window.sql", release=inc.R7, nodes=["node-b"], **WINDOW)
    assert [(r["alertname"], r["release_id"]) for r in rows] == [("GpuXidError", ""), ("ModelQualityDegraded", inc.R7)]


def test_raw_event(store):
    rows = run(store, "raw_event.sql", event_id=RAW[-1].event_id)
    assert len(rows) == 1 and rows[0]["event_type"] == "alert.firing" and rows[0]["kafka_offset"] == len(RAW) - 1
