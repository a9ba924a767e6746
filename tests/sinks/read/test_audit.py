"""`gpuledger audit` against real ClickHouse holding one incident (tests/sinks/incident.py),
written by the real sink writers — output in every format, and the exit code."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app as cli_app
from streams.controls.policy import Policy
from sinks.agents import SinkWriters
from sinks.migrations import migrate
from streams.controls.rules import ControlEngine, directory_from_rows
from tests.sinks import incident as inc

RANGE = ["--from", "2026-11-30T11:00:00Z", "--to", "2026-11-30T14:00:00Z"]
QUIET = ["--from", (inc.T0 - timedelta(days=3, hours=1)).isoformat(), "--to", (inc.T0 - timedelta(days=2, hours=12)).isoformat()]


@pytest.fixture(scope="module")
def store(clickhouse_client, clickhouse_dsn, tmp_path_factory):
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    writers = SinkWriters(clickhouse_client, db)
    rows = inc.correlated_rows()
    recorded = ControlEngine(directory_from_rows(rows), Policy()).feed(rows, inc.allocation_rows())
    recorded.run()

    async def go():
        await writers.store_correlated(rows)
        await writers.store_allocations(inc.allocation_rows())
        await writers.store_violations(list(recorded.violations.values()))
    asyncio.run(go())
    return {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db,
            "GPULEDGER_DATA_DIR": str(tmp_path_factory.mktemp("audit")), "COLUMNS": "250"}


def audit(env, *args):
    result = CliRunner().invoke(cli_app, ["audit", *args], env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_json_report_fails_the_controls_the_incident_breaks(store):
    result = audit(store, *RANGE, "--format", "json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    status = {c["id"]: c["status"] for c in report["controls"]}
    assert status == {1: "FAIL", 2: "FAIL", 3: "PASS", 4: "FAIL", 5: "PASS", 6: "FAIL", 7: "PASS", 8: "PASS"}
    by_id = {c["id"]: c for c in report["controls"]}
    assert by_id[2]["open"] == 1 and by_id[4]["closed"] == 2 and by_id[4]["recorded"] == 2 and by_id[1]["owner"] == "team-platform"
    details = {v["control"]: v["detail"] for v in report["violations"]}
    assert "training/llm-finetune-3" in details[1] and "rolled back from prod" in details[2]
    assert "GpuXidError" in details[6]
    evidence = {s["control"]: s for s in report["evidence"]}
    assert sorted(evidence) == list(range(1, 9))
    assert {r["workload"]: r["verdict"] for r in evidence[1]["rows"]} == {
        inc.W7: "approved before queue entry", inc.WT: "no release identity"}
    assert evidence[2]["rows"][-1]["approved"].startswith("alice CHG-1042")
    steps = {r["step"]: r["value"] for r in evidence[3]["rows"]}
    assert steps["manifest.artifact_digest"] == inc.MANIFEST7["artifact_digest"] and steps["image check"] == "running image matches the manifest"
    [preemption] = evidence[4]["rows"]
    assert preemption["preemptor"] == "Workload training/llm-finetune-3" and preemption["business"] == 90 and preemption["preemptor_business"] == 20
    assert "inside observation window" in preemption["verdict"] and "lower business priority" in preemption["verdict"]
    assert evidence[6]["summary"].startswith("coverage 1/2 = 50%") and {"step": "node/gpu", "value": f"node-b/{inc.GPU_B}"} in evidence[6]["rows"]
    assert [(r["action"], r["actor"], r["authorized"]) for r in evidence[7]["rows"]] == [("rolled_back", "bob", "yes")]


def test_table_and_html_formats(store, tmp_path):
    table = audit(store, *RANGE)
    assert table.exit_code == 1
    assert "FAIL" in table.output and "(8) Retired releases reconciled to zero capacity" in table.output
    assert "at least one control fails" in table.output
    out = tmp_path / "audit.html"
    html = audit(store, *RANGE, "--format", "html", "--output", str(out))
    assert html.exit_code == 1
    page = out.read_text()
    # The layout of the incident report (one base template): its doctype, its no-fetch CSP.
    assert page.lower().startswith("<!doctype html>") and "AT LEAST ONE CONTROL FAILS" in page and "Containment and rollback actions" in page
    head = page.split("<body>", 1)[0]
    assert "<script" not in page and "src=" not in page and "http://" not in head and "https://" not in head  # self-contained
    assert "default-src 'none'" in head


def test_a_quiet_range_passes_with_exit_code_zero(store):
    result = audit(store, *QUIET, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["passed"] is True


def test_policy_option_re_evaluates_with_other_decision_rights(store, tmp_path):
    # carol promoted the staging release; here she only plans capacity
    policy = tmp_path / "policy.yaml"
    policy.write_text("""roles:
  release-managers: {owner: team-mlops, members: [alice], actions: [approve, promote, rollback, revoke, retire]}
  platform-sre: {owner: team-platform, members: [bob], actions: [rollback, pause_queue, isolate_node, override_priority]}
  capacity-planners: {owner: team-capacity, members: [carol], actions: [reserve]}
""")
    report = json.loads(audit(store, *RANGE, "--format", "json", "--policy", str(policy)).output)
    assert {c["id"]: c["status"] for c in report["controls"]}[7] == "FAIL"
    [v] = [v for v in report["violations"] if v["control"] == 7]
    assert "promoted to staging of release fraud-scorer-v7-staging without the decision right: carol holds capacity-planners" in v["detail"]
    assert report["policy"] == str(policy)


def test_bad_options_and_policy_exit_2(store, tmp_path):
    assert audit(store, *RANGE, "--format", "xml").exit_code == 2
    assert audit(store, "--from", "2026-12-01T00:00:00Z", "--to", "2026-11-30T00:00:00Z").exit_code == 2
    assert audit(store, "--from", "yesterday").exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("roles:\n  x: {owner: t, actions: [fly]}\n")
    result = audit(store, *RANGE, "--policy", str(bad))
    assert result.exit_code == 2 and "roles.x.actions.0" in result.output
