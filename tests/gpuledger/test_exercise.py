"""`gpuledger exercise`: the shipped scenarios end to end through the real pipeline, and
what a bad scenario file gets told.

The end-to-end tests run the real services (worker with its own chDB store, receiver,
scheduler collector, one pod-resources collector per simulated node) as child
processes against the shared test broker; the expectations are read back from the
worker's store through ``sinks.read.trace`` (what ``gpuledger trace`` does).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from gpuledger.exercise import run_exercise
from gpuledger.settings import KafkaSettings, Settings
from gpuledger.sim.cluster import SimCluster, SimulationError, alert_fingerprint, dry_run
from gpuledger.sim.scenario import EXERCISES_DIR, ScenarioError, load_scenario, parse_scenario, shipped_scenarios

SPEED = 120  # compress hard: the runner keeps a minimum gap between steps anyway
SCENARIOS = ("incident-rollback", "retirement", "unapproved-admission", "unapproved-admission-enforced")


def test_the_three_scenarios_ship():
    assert set(SCENARIOS) <= set(shipped_scenarios())
    for name in SCENARIOS:
        sc = load_scenario(name)
        assert sc.name == name
        dry_run(sc, sc.seed)  # capacity and placements fit


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_through_the_real_pipeline(name, kafka_bootstrap, tmp_path):
    settings = Settings(data_dir=tmp_path / "data", kafka=KafkaSettings(bootstrap=kafka_bootstrap))
    out = io.StringIO()
    run = run_exercise(settings, name, Console(file=out, width=200), speed=SPEED)
    log = out.getvalue()
    assert run.error is None, log
    assert run.exit_code == 0, log
    scenario = load_scenario(name)
    assert [r.name for r in run.results] == [e.name for e in scenario.expect]
    for result in run.results:
        assert result.status == "PASS", (result, log)
    # retirement opens control 8, unapproved-admission control 1 (issue 8's controls, read back from ClickHouse)
    violation_checks = [r for r, e in zip(run.results, scenario.expect) if e.violation]
    if name in ("retirement", "unapproved-admission"):
        assert violation_checks and all(r.status == "PASS" for r in violation_checks)
    # One source of truth: `gpuledger audit` on the same store reports exactly the
    # violations the worker recorded (retirement: control 8 FAIL with its open violation).
    report, table = audit_and_violations(run)
    assert {v["violation_id"]: v["detail"] for v in report["violations"]} == table, report["violations"]
    if name == "unapproved-admission-enforced":
        # Control 1's evidence: every workload that entered a queue has its policy result before queue entry,
        # and the unapproved one never entered (no control 1 violation for it: prevention, not detection).
        [admission] = [s for s in report["evidence"] if s["control"] == 1]
        entered = {r["workload"]: r["policy_result"] for r in admission["rows"] if r["queue_entry"] != "never: denied"}
        assert set(entered) == {sim_id for sim_id in (run.cluster.workload_id("ranker-11"), run.cluster.workload_id("ranker-12-retry"))}, entered
        # The denied ones are there too, as denied at the door: who tried to run what, and why not.
        denied = {r["workload"]: r["policy_result"] for r in admission["rows"] if r["queue_entry"] == "never: denied"}
        assert set(denied) == {run.cluster.workload_id("ranker-12"), run.cluster.workload_id("adhoc-notebook")}, denied
        assert "by rule unapproved (webhook, enforce)" in denied[run.cluster.workload_id("ranker-12")], denied
        assert "by rule no-release-identity (webhook, enforce)" in denied[run.cluster.workload_id("adhoc-notebook")], denied
        assert all("decision allow at " in p and "by rule approved (webhook, enforce), before queue entry at " in p for p in entered.values()), entered
        assert not [v for v in report["violations"] if v["control"] == 1 and "recsys-ranker-v12-prod" in v["detail"]]
    if name == "retirement":
        assert any(v.startswith("release ") and "still held" in v for v in table.values())
        assert {c["id"]: c["status"] for c in report["controls"]}[8] == "FAIL"
    # The table on the console is the one the results came from.
    assert re.search(r"\d+ passed, 0 failed", log)
    # The evidence names the identifiers the simulated cluster used (read back from the store).
    sim = run.cluster
    if name == "incident-rollback":
        xid = run.results[0]
        _, device = sim.device_id("n3/0")
        assert device[:12] in xid.detail and "gpu_assignment" in xid.detail and sim.workload_id("fraud-scorer-7") in xid.detail
        # ... and so does the column "read back (gpuledger trace)": what a person pastes (it showed '--gpu n3/0').
        entries = {r.entry for r in run.results}
        assert f"--gpu n3/{device}" in entries and f"--alert {sim.alert_fingerprint('xid-n3')}" in entries, entries
        assert not {"--gpu n3/0", "--alert xid-n3", "--workload fraud-scorer-7"} & entries, entries
        assert run.trace["entry"]["root"] == {"kind": "release", "id": "fraud-scorer-v7-prod"}
        assert "release fraud-scorer-v7-prod" in log and "scheduler collector watching" in log
    # The report: one self-contained file with a lane per device of the cluster.
    html = run.report_path.read_text()
    assert html.startswith("<!DOCTYPE html>") and "http://" not in html.split("<body>", 1)[0]
    for lane in sim.lanes():
        assert f'data-lane="{lane["node"]}/{lane["gpu_id"]}"' in html
    # Nothing left running, the data dir kept and said.
    assert not run.services_left
    assert f"data     {run.data_dir}" in log
    assert (run.data_dir / "logs" / "worker.log").exists()


@pytest.mark.timeout(240)
def test_a_scenario_of_violation_checks_only_ends_with_its_report(kafka_bootstrap, tmp_path):
    """Found by an exploratory review: a scenario whose expectations were all `violation:` checks
    passed --check, ran, then crashed after its checks ("exercise failed: StopIteration:", exit 1,
    no report) — no expectation had an entry point for the report's trace. It now traces the
    release the violation check names."""
    shipped = load_scenario("unapproved-admission")
    sc = shipped.model_copy(update={"expect": [e for e in shipped.expect if e.violation], "report": None})
    settings = Settings(data_dir=tmp_path / "data", kafka=KafkaSettings(bootstrap=kafka_bootstrap))
    out = io.StringIO()
    run = run_exercise(settings, sc, Console(file=out, width=200), speed=SPEED)
    log = out.getvalue()
    assert run.error is None and run.exit_code == 0, log
    assert [r.status for r in run.results] == ["PASS"], log
    assert "gpuledger trace --release recsys-ranker-v12-prod" in log
    assert run.report_path.read_text().startswith("<!DOCTYPE html>")
    assert not run.services_left


def test_the_reports_trace_entry_defaults_to_an_entry_point_a_violation_check_or_a_release(tmp_path):
    def only_violations(d, release_id="r1"):
        d["expect"] = [{"name": "control 1", "violation": {"control": 1, **({"release_id": release_id} if release_id else {})}}]

    assert load_scenario(scenario_with(tmp_path, lambda d: None)).report_entry() == ("workload", "w")
    assert load_scenario(scenario_with(tmp_path, only_violations)).report_entry() == ("release", "r1")
    assert load_scenario(scenario_with(tmp_path, lambda d: only_violations(d, None))).report_entry() == ("release", "r1")


def audit_and_violations(run) -> tuple[dict, dict[str, str]]:
    """`gpuledger audit --format json` over the exercise's store, and the violations table's
    (id -> detail) over the same range — both by the real CLI in a child process (chDB
    opens one data dir per process)."""
    start = (run.cluster.started_at - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    end = (datetime.now(timezone.utc) + timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    env = {**os.environ, "GPULEDGER_CLICKHOUSE_DSN": run.dsn, "GPULEDGER_DATA_DIR": str(run.data_dir)}
    cli = [sys.executable, "-m", "gpuledger.cli"]
    audit = subprocess.run([*cli, "audit", "--from", start, "--to", end, "--format", "json"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert audit.returncode in (0, 1), audit.stderr + audit.stdout
    sql = subprocess.run([*cli, "sql", "--format", "json",
                          f"SELECT violation_id, detail FROM gpuledger.violations FINAL WHERE NOT startsWith(detail, 'withdrawn:') "
                          f"AND opened_at <= '{end[:-1]}' AND (closed_at IS NULL OR closed_at >= '{start[:-1]}')"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert sql.returncode == 0, sql.stderr + sql.stdout
    rows = json.loads(sql.stdout)
    return json.loads(audit.stdout), {r["violation_id"]: r["detail"] for r in (rows["rows"] if isinstance(rows, dict) else rows)}


# --- scenario validation --------------------------------------------------------------------------

GOOD = """
name: tiny
cluster:
  nodes: 2
  gpus_per_node: 2
  queues: [{name: q, namespace: ml}]
  priority_classes: {high: 100}
releases:
  r1: {model: m, version: 1, image: "registry.sim/m:1"}
timeline:
  - {at: 0s, register: {release: r1}}
  - {at: 10s, submit: {workload: w, queue: q, priority_class: high, release: r1, pods: 2}}
expect:
  - {name: it runs, workload: w, traces_to: {release_id: r1}}
"""


def scenario_with(tmp_path: Path, patch) -> Path:
    data = yaml.safe_load(GOOD)
    patch(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_valid_scenario_loads(tmp_path):
    path = scenario_with(tmp_path, lambda d: None)
    sc = load_scenario(path)
    assert [s.kind for s in sc.timeline] == ["register", "submit"]
    assert sc.timeline[1].at == 10.0


@pytest.mark.parametrize("patch, message", [
    (lambda d: d["timeline"][1]["submit"].update(pods="two"), "timeline[1].submit.pods: Input should be a valid integer"),
    (lambda d: d["timeline"][0]["register"].update(actr="x"), "timeline[0].register.actr: Extra inputs are not permitted"),
    (lambda d: d["timeline"][1].update(at="10 minutes"), "timeline[1].at: not a duration"),
    (lambda d: d["timeline"].append({"at": "20s"}), "timeline[2]: a step needs exactly one action"),
    (lambda d: d["timeline"].append({"at": "20s", "retire": {"release": "r2"}}), "timeline[2].retire.release: unknown release 'r2'"),
    (lambda d: d["timeline"].append({"at": "5s", "finish": {"workload": "w"}}), "timeline[2].at: steps must be in time order"),
    (lambda d: d["timeline"].append({"at": "20s", "preempt": {"victim": "nope", "preemptor": "w"}}),
     "timeline[2].preempt.victim: no workload 'nope' submitted before this step"),
    (lambda d: d["timeline"].append({"at": "20s", "fail_gpu": {"node": "n2", "gpu": 5, "alert": "a"}}),
     "timeline[2].fail_gpu.gpu: node n2 has devices 0..1, not 5"),
    (lambda d: d["timeline"][1]["submit"].update(placement=["n9"]), "timeline[1].submit.placement[0]: unknown node 'n9'"),
    (lambda d: d["expect"].append({"name": "x", "alert": "never"}), "expect[1]: an expectation needs at least one check"),
    (lambda d: d["expect"].append({"name": "x", "alert": "never", "traces_to": {"node": "n1"}}), "expect[1].alert: no alert 'never' in the timeline"),
    (lambda d: d["expect"].append({"name": "x", "gpu": "n1", "traces_to": {"node": "n1"}}), "expect[1].gpu: expected NODE/INDEX"),
    (lambda d: d["expect"][0].update(at="later"), "expect[0].at: 'later' is neither a step id"),
    (lambda d: d["expect"].append({"name": "x", "workload": "w", "traces_to": {"release_state": "release.promoted"}}),
     "expect[1].traces_to.release_state: only an alert's trace has one"),
    (lambda d: d["cluster"].update(nodes=["n1", "n1"]), "cluster.nodes: names must be unique: n1"),
])
def test_a_bad_scenario_is_refused_naming_the_place(tmp_path, patch, message):
    path = scenario_with(tmp_path, patch)
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert str(path) in str(err.value)
    assert message.replace("Value error, ", "") in str(err.value)


def test_every_problem_is_listed_at_once(tmp_path):
    def patch(d):
        d["timeline"][1]["submit"]["queue"] = "nope"
        d["timeline"][1]["submit"]["priority_class"] = "low"
        d["expect"][0]["traces_to"]["release_id"] = "r9"
    with pytest.raises(ScenarioError) as err:
        load_scenario(scenario_with(tmp_path, patch))
    text = str(err.value)
    assert "timeline[1].submit.queue: unknown queue 'nope'" in text
    assert "timeline[1].submit.priority_class: unknown priority class 'low'" in text
    assert "expect[0].traces_to.release_id: unknown release 'r9'" in text


def test_capacity_is_checked_before_anything_starts(tmp_path):
    sc = load_scenario(scenario_with(tmp_path, lambda d: d["timeline"][1]["submit"].update(pods=5)))
    with pytest.raises(SimulationError, match=r"timeline\[1\] \(submit\): pod 5 of w needs 1 free GPU"):
        dry_run(sc, 0)


def test_the_cli_exits_2_with_the_problem(tmp_path):
    from gpuledger.cli import app

    bad = scenario_with(tmp_path, lambda d: d["timeline"][1]["submit"].update(pods=0))
    result = CliRunner().invoke(app, ["exercise", str(bad)])
    assert result.exit_code == 2
    assert "timeline[1].submit.pods" in result.output
    assert CliRunner().invoke(app, ["exercise", "no-such-scenario"]).exit_code == 2
    ok = CliRunner().invoke(app, ["exercise", str(scenario_with(tmp_path, lambda d: None)), "--check"])
    assert ok.exit_code == 0 and "valid (2 steps, 1 expectations)" in ok.output
    listed = CliRunner().invoke(app, ["exercise", "--list"])
    assert all(name in listed.output for name in SCENARIOS)


def test_the_seed_makes_names_reproducible():
    sc = load_scenario("incident-rollback")
    a, b, c = SimCluster(sc, 7), SimCluster(sc, 7), SimCluster(sc, 8)
    assert a.lanes() == b.lanes() != c.lanes()
    assert [r.summary for r in dry_run(sc, 7)] == [r.summary for r in dry_run(sc, 7)]
    assert all(re.fullmatch(r"(GPU|MIG)-[0-9a-f-]{36}", lane["gpu_id"]) for lane in a.lanes())
    assert {lane["gpu_id"][:4] for lane in a.lanes() if lane["node"] == "n1"} == {"MIG-"}


def test_alert_fingerprints_are_alertmanagers():
    # Prometheus' LabelSet.Fingerprint: FNV-1a 64; the empty set hashes to the offset basis.
    assert alert_fingerprint({}) == "cbf29ce484222325"
    labels = {"alertname": "GpuXidError", "Hostname": "n3"}
    assert alert_fingerprint(labels) == alert_fingerprint(dict(reversed(list(labels.items()))))
    assert alert_fingerprint(labels) != alert_fingerprint({**labels, "Hostname": "n2"})


def test_scenario_files_parse_as_documented():
    # Every shipped file loads through the same path as user files do.
    for path in sorted(EXERCISES_DIR.glob("*.yaml")):
        parse_scenario(yaml.safe_load(path.read_text()), str(path))
