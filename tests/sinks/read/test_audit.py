"""`gpuledger audit` against real ClickHouse holding one incident (tests/sinks/incident.py),
written by the real sink writers — output in every format, and the exit code."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta, timezone

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


def judged_store(clickhouse_client, clickhouse_dsn, data_dir, rows: list) -> dict:
    """``rows`` (with the incident's allocations) and the violations the control engine records for
    them, written to a fresh database through the sink's writers; the audit command's environment."""
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    recorded = ControlEngine(directory_from_rows(rows), Policy()).feed(rows, inc.allocation_rows())
    recorded.run()

    async def go():
        writers = SinkWriters(clickhouse_client, db)
        await writers.store_correlated(rows)
        await writers.store_allocations(inc.allocation_rows())
        await writers.store_violations(list(recorded.violations.values()))
    asyncio.run(go())
    return {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(data_dir),
            "COLUMNS": "250"}


@pytest.fixture(scope="module")
def store(clickhouse_client, clickhouse_dsn, tmp_path_factory):
    return judged_store(clickhouse_client, clickhouse_dsn, tmp_path_factory.mktemp("audit"), inc.correlated_rows())


def audit(env, *args):
    result = CliRunner().invoke(cli_app, ["audit", *args], env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def recorded_violations(env, control: int | None = None) -> dict[str, str]:
    """violation id -> detail, straight from the violations table (not withdrawn)."""
    from sinks.clickhouse import connect

    client = connect(env["GPULEDGER_CLICKHOUSE_DSN"], env["GPULEDGER_CLICKHOUSE_DATABASE"], create=False)
    where = f"AND control_id = {int(control)}" if control else ""
    rows = client.query(f"SELECT violation_id, detail FROM {env['GPULEDGER_CLICKHOUSE_DATABASE']}.violations FINAL "
                        f"WHERE NOT startsWith(detail, 'withdrawn:') {where}").result_rows
    return dict(rows)


def test_json_report_fails_the_controls_the_incident_breaks(store):
    result = audit(store, *RANGE, "--format", "json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    status = {c["id"]: c["status"] for c in report["controls"]}
    # 5 and 8: no reservation, no retirement in the incident — not exercised, not PASS
    assert status == {1: "FAIL", 2: "FAIL", 3: "PASS", 4: "FAIL", 5: "NOT EXERCISED", 6: "FAIL", 7: "PASS", 8: "NOT EXERCISED"}
    assert report["mode"] == "recorded" and report["judged_under"] == [Policy().fingerprint]
    by_id = {c["id"]: c for c in report["controls"]}
    assert by_id[2]["open"] == 1 and by_id[4]["closed"] == 2 and by_id[1]["owner"] == "team-platform"
    details = {v["control"]: v["detail"] for v in report["violations"]}
    assert "training/llm-finetune-3" in details[1] and "rolled back from prod" in details[2]
    assert "GpuXidError" in details[6]
    assert all(v["policy_version"] == Policy().fingerprint for v in report["violations"])
    evidence = {s["control"]: s for s in report["evidence"]}
    assert sorted(evidence) == list(range(1, 9))
    admission = {r["workload"]: r for r in evidence[1]["rows"]}
    assert admission[inc.W7]["verdict"] == "no violation recorded" and admission[inc.W7]["approvals"].startswith("alice (unauthenticated) CHG-1042")
    assert admission[inc.WT]["release"] == "no release identity" and "with no release identity" in admission[inc.WT]["verdict"]
    assert evidence[2]["rows"][-1]["approvals"].startswith("alice (unauthenticated) CHG-1042")
    steps = {r["step"]: r["value"] for r in evidence[3]["rows"]}
    assert steps["manifest.artifact_digest"] == inc.MANIFEST7["artifact_digest"]
    assert steps["running images"] == inc.MANIFEST7["image_digest"] and steps["control 3"] == "no violation recorded"
    # one preemption seen by the pod and by its Kueue workload: one row, both sources
    [preemption] = evidence[4]["rows"]
    assert preemption["preemptor"] == "Workload training/llm-finetune-3" and preemption["business"] == "90" and preemption["preemptor_business"] == "20"
    assert preemption["sources"] == "scheduler.preempted (Pod), scheduler.evicted (Workload)"
    assert "inside the prod observation window" in preemption["verdict"] and "business priority 20" in preemption["verdict"]
    assert evidence[6]["summary"].startswith("coverage 1/2 = 50%") and {"step": "node/gpu", "value": f"node-b/{inc.GPU_B}"} in evidence[6]["rows"]
    # Section 7's actors as judged, as sections 1 and 2 show them (the bare name read as authorised).
    assert [(r["action"], r["actor"], r["verdict"]) for r in evidence[7]["rows"]] == [
        ("approved", "alice (unauthenticated)", "no violation recorded"), ("promoted", "alice (unauthenticated)", "no violation recorded"),
        ("rolled_back", "bob (unauthenticated)", "no violation recorded")]
    assert evidence[7]["summary"] == "3 action(s); 0 with a control 7 violation (0 violation(s) in the range)"


def test_a_range_after_the_history_is_nothing_to_audit(store):
    """Found by an exploratory review: a range with no event at all, after a prod promotion, passed
    control 2 ("exercised: 1 release(s) promoted") and exited 0 — a pipeline gate read a pass. The
    promotion before the range is context in the evidence, not exercise (docs/controls.md)."""
    # Between v6's promotion to prod (3 days before) and its old alert (2 days before): nothing.
    after = ["--from", (inc.T0 - timedelta(days=2, hours=20)).isoformat(), "--to", (inc.T0 - timedelta(days=2, hours=1)).isoformat()]
    result = audit(store, *after, "--format", "json")
    report = json.loads(result.output)
    assert result.exit_code == 4 and report["events_in_range"] == 0, result.output
    assert {c["status"] for c in report["controls"]} == {"NO EVENTS"}, report["controls"]
    evidence = {s["control"]: s for s in report["evidence"]}
    assert [r["release"] for r in evidence[2]["rows"]] == [inc.R6]  # still shown, as context
    assert "nothing to audit: no events recorded" in audit(store, *after).output


def test_the_audit_reports_what_the_violations_table_holds(store):
    # One source of truth: every violation the report lists is a row of the table, and
    # every row of the table overlapping the range is in the report.
    report = json.loads(audit(store, *RANGE, "--format", "json").output)
    assert {v["violation_id"]: v["detail"] for v in report["violations"]} == recorded_violations(store)


def test_recorded_verdicts_do_not_change_with_the_policy_file(store, tmp_path):
    # The worker judged under the default policy; a stricter file changes nothing in the
    # recorded mode (it is named, with its version, beside the one the violations carry).
    policy = tmp_path / "policy.yaml"
    policy.write_text(STRICT)
    report = json.loads(audit(store, *RANGE, "--format", "json", "--policy", str(policy)).output)
    assert {c["id"]: c["status"] for c in report["controls"]}[7] == "PASS"
    assert report["policy_version"] != Policy().fingerprint and report["judged_under"] == [Policy().fingerprint]


def test_an_empty_store_is_nothing_to_audit(clickhouse_client, clickhouse_dsn, tmp_path):
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path),
           "COLUMNS": "250"}
    result = audit(env, *RANGE, "--format", "json")
    assert result.exit_code == 4, result.output
    report = json.loads(result.output)
    assert report["outcome"] == "nothing to audit" and report["events_in_range"] == 0
    for c in report["controls"]:
        assert c["status"] == "NO EVENTS" and c["note"] == "no events recorded between 2026-11-30T11:00:00Z and 2026-11-30T14:00:00Z"
    table = audit(env, *RANGE)
    assert table.exit_code == 4 and "nothing to audit: no events recorded between 2026-11-30T11:00:00Z and 2026-11-30T14:00:00Z" in table.output
    assert "all controls pass" not in table.output and "PASS" not in table.output


def test_a_mistyped_embedded_store_path_is_not_created_and_read_as_empty(tmp_path):
    """A reader opened (and so created, migrated) an embedded store at any path it was given:
    a typo in --dsn read as "no data" — trace all gaps, sql count 0, audit "nothing to audit"."""
    from typer.testing import CliRunner

    missing = tmp_path / "nosuch"
    env = {"GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    result = audit(env, *RANGE, "--dsn", f"chdb://{missing}")
    assert result.exit_code == 3 and f"no embedded store at {missing}" in result.output, result.output
    for args in (["sql", "SELECT 1"], ["trace", "--release", "x"]):
        out = CliRunner().invoke(cli_app, [*args, "--dsn", f"chdb://{missing}"], env=env)
        assert out.exit_code == 1 and f"no embedded store at {missing}" in out.output, (args, out.output)
    assert not missing.exists()
    # Any directory is not a store (chdb:///tmp was opened, a store created in it and migrated).
    plain = tmp_path / "plain"
    plain.mkdir()
    result = audit(env, *RANGE, "--dsn", f"chdb://{plain}")
    assert result.exit_code == 3 and f"no embedded store at {plain}" in result.output and list(plain.iterdir()) == [], result.output


def test_the_wrong_database_is_nothing_to_audit(store):
    result = audit({**store, "GPULEDGER_CLICKHOUSE_DATABASE": f"nope_{uuid.uuid4().hex[:8]}"}, *RANGE, "--format", "json")
    assert result.exit_code == 4, result.output
    assert {c["status"] for c in json.loads(result.output)["controls"]} == {"NO EVENTS"}


def test_table_and_html_formats(store, tmp_path):
    table = audit(store, *RANGE)
    assert table.exit_code == 1
    assert "FAIL" in table.output and "(8) Retired releases" in table.output and "NOT EXERCISED" in table.output
    assert "at least one control fails" in table.output
    out = tmp_path / "audit.html"
    html = audit(store, *RANGE, "--format", "html", "--output", str(out))
    assert html.exit_code == 1
    page = out.read_text()
    # The layout of the incident report (one base template): its doctype, its no-fetch CSP.
    assert page.lower().startswith("<!doctype html>") and "AT LEAST ONE CONTROL FAILS" in page and "containment and rollback actions" in page
    head = page.split("<body>", 1)[0]
    assert "<script" not in page and "src=" not in page and "http://" not in head and "https://" not in head  # self-contained
    assert "default-src 'none'" in head


def test_a_quiet_range_passes_only_what_it_exercised(store):
    # Three days before the incident: only v6's approval and promotion happened.
    result = audit(store, *QUIET, "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    status = {c["id"]: c["status"] for c in report["controls"]}
    assert status == {1: "NOT EXERCISED", 2: "PASS", 3: "NOT EXERCISED", 4: "NOT EXERCISED", 5: "NOT EXERCISED",
                      6: "NOT EXERCISED", 7: "PASS", 8: "NOT EXERCISED"}
    # control 6 with 0 of 0 alerts is not a pass
    assert "nothing this control checks happened in the range (alert episode(s))" == {c["id"]: c["note"] for c in report["controls"]}[6]
    assert "every exercised control passes (6 not exercised)" in audit(store, *QUIET).output


def test_a_lookback_reaching_before_year_one_reads_from_the_earliest_time(store):
    """`audit --lookback 1000000d` was an OverflowError traceback: it reads the history from the
    store's earliest time, as a look-back of years does."""
    wide, years = (json.loads(audit(store, *RANGE, "--lookback", lookback, "--format", "json").output)
                   for lookback in ("1000000d", "36500d"))
    assert {c["id"]: c["status"] for c in wide["controls"]} == {c["id"]: c["status"] for c in years["controls"]}
    assert [c for c in wide["controls"] if c["status"] == "FAIL"], wide["controls"]


STRICT = """roles:
  release-managers: {owner: team-mlops, members: [alice], actions: [approve, promote, rollback, revoke, retire]}
  platform-sre: {owner: team-platform, members: [bob], actions: [rollback, pause_queue, isolate_node, override_priority]}
  capacity-planners: {owner: team-capacity, members: [carol], actions: [reserve]}
"""


def test_reevaluate_judges_the_history_under_another_policy_and_says_so(store, tmp_path):
    # carol promoted the staging release; here she only plans capacity
    policy = tmp_path / "policy.yaml"
    policy.write_text(STRICT)
    report = json.loads(audit(store, *RANGE, "--format", "json", "--policy", str(policy), "--reevaluate").output)
    assert report["mode"] == "re-evaluation" and report["verdicts"].startswith(f"RE-EVALUATION under {policy}")
    assert {c["id"]: c["status"] for c in report["controls"]}[7] == "FAIL"
    [v] = [v for v in report["violations"] if v["control"] == 7]
    assert "promoted to staging of release fraud-scorer-v7-staging without the decision right: carol holds capacity-planners" in v["detail"]
    assert v["policy_version"] == report["policy_version"] != Policy().fingerprint
    assert report["policy"] == str(policy)
    assert "RE-EVALUATION" in audit(store, *RANGE, "--policy", str(policy), "--reevaluate").output


def test_bad_options_and_policy_exit_2(store, tmp_path):
    assert audit(store, *RANGE, "--format", "xml").exit_code == 2
    assert audit(store, "--from", "2026-12-01T00:00:00Z", "--to", "2026-11-30T00:00:00Z").exit_code == 2
    assert audit(store, "--from", "yesterday").exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("roles:\n  x: {owner: t, actions: [fly]}\n")
    result = audit(store, *RANGE, "--policy", str(bad))
    assert result.exit_code == 2 and "roles.x.actions.0" in result.output
    # An --output that cannot be written: exit 2 naming it (it was a traceback, exit 1 — "a control fails" to a gate).
    for fmt in ("table", "json"):
        result = audit(store, *RANGE, "--format", fmt, "--output", str(tmp_path / "missing" / "report.txt"))
        assert result.exit_code == 2 and f"--output {tmp_path / 'missing' / 'report.txt'}:" in result.output, result.output


@pytest.fixture(scope="module")
def enforced_store(clickhouse_client, clickhouse_dsn, tmp_path_factory):
    """The incident with gpuledger admit enforcing: the webhook's decision on W7 a moment before it was submitted."""
    submitted = next(r for r in inc.correlated_rows() if r.event_type == "scheduler.submitted" and r.identity.workload_id == inc.W7)
    rows = [*inc.correlated_rows(), inc.admission_row(timedelta(milliseconds=40))]
    return judged_store(clickhouse_client, clickhouse_dsn, tmp_path_factory.mktemp("audit-enforced"), rows), submitted


def test_control_1_evidence_shows_the_policy_result_before_queue_entry(enforced_store, store):
    env, submitted = enforced_store
    evidence = {s["control"]: s for s in json.loads(audit(env, *RANGE, "--format", "json").output)["evidence"]}
    rows = {r["workload"]: r for r in evidence[1]["rows"]}
    at = submitted.occurred_at.strftime("%Y-%m-%dT%H:%M:%S")
    assert rows[inc.W7]["policy_result"].startswith(f"workload {inc.W7}: decision allow at ") and "by rule approved (webhook, enforce)" in rows[inc.W7]["policy_result"]
    assert f"before queue entry at {at}" in rows[inc.W7]["policy_result"] and rows[inc.W7]["policy_result"].endswith("(+40ms)")
    from datetime import datetime, timezone

    from sinks.read.audit import precedes
    whole = datetime(2026, 12, 1, 17, 32, 47, tzinfo=timezone.utc)
    assert precedes(whole.replace(microsecond=62_000), whole) and not precedes(whole + timedelta(seconds=1, milliseconds=1), whole)
    assert not precedes(whole.replace(microsecond=500_000) + timedelta(milliseconds=1), whole.replace(microsecond=500_000))
    assert rows[inc.WT]["policy_result"] == "no admission decision recorded (gpuledger admit not enforcing here)"
    # Without enforcement the same workload says so.
    plain = {s["control"]: s for s in json.loads(audit(store, *RANGE, "--format", "json").output)["evidence"]}
    assert {r["workload"]: r for r in plain[1]["rows"]}[inc.W7]["policy_result"].startswith("no admission decision recorded")


def test_events_in_range_count_each_row_once_whatever_its_versions(clickhouse_client, clickhouse_dsn, tmp_path):
    """From an exploratory review: counted without FINAL, a row's superseded versions counted too —
    a live store and its replay, with identical tables, said 67 and 70 events."""
    import json

    db = inc.load_store(clickhouse_client)
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path)}
    before = json.loads(audit(env, *RANGE, "--format", "json").output)["events_in_range"]
    again = [row.model_copy(update={"version": row.version + 1}) for row in inc.correlated_rows()
             if inc.T0 <= row.occurred_at <= inc.T0 + timedelta(hours=2)]
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(again))
    assert again and json.loads(audit(env, *RANGE, "--format", "json").output)["events_in_range"] == before
    count = clickhouse_client.query(f"SELECT uniqExact(correlation_id) FROM {db}.correlated_events WHERE occurred_at BETWEEN "
                                    "'2026-11-30 11:00:00' AND '2026-11-30 14:00:00'").result_rows[0][0]
    assert before == count > 0


def test_at_80_columns_no_value_is_cut(store):
    """From an exploratory review: at 80 columns every time in the audit's tables read
    "2026-11-…" — opened and closed could not be told apart. Values fold onto more lines now
    (every character printed, none replaced by an ellipsis)."""
    wide = audit(store, *RANGE)
    assert "…" not in wide.output  # (nothing of the report's own text has one)
    narrow = audit({**store, "COLUMNS": "80"}, *RANGE)
    assert narrow.exit_code == 1, narrow.output
    assert "…" not in narrow.output and "Violations in the range" in narrow.output, narrow.output
    assert max(len(line) for line in narrow.output.splitlines()) <= 80


def test_a_violation_closed_after_the_range_is_open_in_it(store):
    """From an exploratory review: a violation closed after --to was reported closed (and counted
    closed) in a range that ends before it closed; --to is the time the controls are evaluated as of."""
    full = json.loads(audit(store, *RANGE, "--format", "json").output)
    closed = [v for v in full["violations"] if v["control"] == 4]
    assert closed and all(v["closed_at"] == "2026-11-30T13:01:00Z" for v in closed), closed
    cut = json.loads(audit(store, "--from", RANGE[1], "--to", "2026-11-30T13:00:30Z", "--format", "json").output)
    mine = [v for v in cut["violations"] if v["control"] == 4]
    assert {v["violation_id"] for v in mine} == {v["violation_id"] for v in closed}
    for v in mine:
        assert v["closed_at"] is None and v["closed_after_range_at"] == "2026-11-30T13:01:00Z", v
        assert v["detail"].startswith("open at the range's end; closed after it, at 2026-11-30T13:01:00Z: "), v["detail"]
    control4 = next(c for c in cut["controls"] if c["id"] == 4)
    assert (control4["open"], control4["closed"], control4["status"]) == (len(mine), 0, "FAIL"), control4
    assert "open at the range's end" in audit(store, "--from", RANGE[1], "--to", "2026-11-30T13:00:30Z").output


def test_a_reservation_released_after_a_rollback_leaves_the_release_rolled_back(clickhouse_client, clickhouse_dsn, tmp_path):
    """From an exploratory review: section 2's state_at_end read release.reservation_released for a
    release rolled back — a reservation is no lifecycle state (the trace says so beside it)."""
    db = inc.load_store(clickhouse_client)
    released = inc._ce("release", "release.reservation_released", inc.ROLLBACK_AT + timedelta(minutes=1),
                       {"release_id": inc.R7, **inc.MANIFEST7}, {"actor": "bob", "reservation": {"reservation_id": "res-7", "gpus": 4}},
                       attribution="release_event", release_state="release.reservation_released")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([released]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path)}
    report = json.loads(audit(env, *RANGE, "--format", "json").output)
    section = next(s for s in report["evidence"] if s["control"] == 2)
    assert {r["release"]: r["state_at_end"] for r in section["rows"]}[inc.R7] == "release.rolled_back", section["rows"]


def denial(workload: str, at):
    """gpuledger admit's webhook denying ``workload`` (namespace/name) R7-staging in prod, for mallory."""
    from schemas.admission import AdmissionPayload

    namespace, name = workload.split("/")
    payload = AdmissionPayload(decision="deny", outcome="deny", rule="unapproved", message=f"release {inc.R7_STAGING} is not approved for prod",
                               mode="enforce", gate="webhook", object_kind="Job", object_name=name, user="mallory", gpus_requested=2,
                               policy_version=Policy().fingerprint)
    return inc._ce("admission", "admission.decided", at, {"workload_id": workload, "namespace": namespace, "release_id": inc.R7_STAGING,
                                                          "environment": "prod"}, payload.model_dump(mode="json"),
                   summary="admission deny by rule unapproved (webhook, enforce)")


def test_a_workload_admit_denied_is_in_control_1s_evidence(clickhouse_client, clickhouse_dsn, tmp_path):
    """From an exploratory review: the audit listed only the workloads that entered a queue — who
    tried to run an unapproved release, and when, was nowhere in it (the decision in the store)."""
    db = inc.load_store(clickhouse_client)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([denial("risk/sneaky", inc.T0 + timedelta(minutes=20))]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    report = json.loads(audit(env, *RANGE, "--format", "json").output)
    section = next(s for s in report["evidence"] if s["control"] == 1)
    row = {r["workload"]: r for r in section["rows"]}["risk/sneaky"]
    assert (row["release"], row["queue_entry"], row["entry_event"]) == (inc.R7_STAGING, "never: denied", "admission.decided"), row
    assert row["policy_result"] == (f"workload risk/sneaky: decision deny at 2026-11-30T12:20:00Z by rule unapproved (webhook, enforce) "
                                    f"(user mallory): release {inc.R7_STAGING} is not approved for prod"), row["policy_result"]
    assert "denied before queue entry" in row["verdict"] and "1 denied before queue entry by gpuledger admit" in section["summary"]
    assert inc.W7 in {r["workload"] for r in section["rows"]}  # the admitted ones are still there
    assert "risk/sneaky" in audit(env, *RANGE).output


def dry_runs(at) -> list:
    """gpuledger admit's answers to server-side dry runs, as its webhook records them: a ``kubectl diff``
    of a prod pod naming an unknown release (denied, had it been real) that was never created, and an
    Argo CD diff of the incident's Workload W7 a minute before Kueue queued it — recorded by an older
    gpuledger admit (``operation`` "CREATE (dry run)", no ``dry_run`` field), whose records stay readable."""
    from streams.controls.admission import AdmissionState

    state = AdmissionState()
    state.ready.set()
    gpu = {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "diffed", "namespace": "risk", "labels": {
           "gpuledger.io/release-id": "fraud-scorer-v9-prod", "gpuledger.io/environment": "prod"}}, "spec": gpu}
    namespace, name = inc.W7.split("/")
    labels = {"gpuledger.io/release-id": inc.R7, "gpuledger.io/environment": "prod"}
    w7 = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": {"name": name, "namespace": namespace, "labels": labels},
          "spec": {"queueName": "prod-inference", "podSets": [{"name": "main", "count": 1, "template": {"spec": gpu}}]}}
    older = inc.webhook_row(w7, state, inc.T0 + timedelta(minutes=15), dry_run=True)
    payload = json.loads(older.payload_json)
    payload.pop("dry_run")
    payload["operation"] = "CREATE (dry run)"
    return [inc.webhook_row(pod, state, at, dry_run=True), older.model_copy(update={"payload_json": json.dumps(payload)})]


def test_a_dry_run_is_no_evidence_of_control_1_and_is_counted_as_a_dry_run(clickhouse_client, clickhouse_dsn, tmp_path):
    """Found by an exploratory review: the webhook's answers to server-side dry runs (kubectl diff,
    --dry-run=server, Argo CD) were read as enforcement — a diffed pod, never created, was listed
    "never: denied" (the control enforced) and counted, and a dry run before the real object's
    creation was its "decision before queue entry". They are counted apart in the summary now."""
    db = inc.load_store(clickhouse_client)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(dry_runs(inc.T0 + timedelta(minutes=20))))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    report = json.loads(audit(env, *RANGE, "--format", "json").output)
    section = next(s for s in report["evidence"] if s["control"] == 1)
    rows = {r["workload"]: r for r in section["rows"]}
    assert "risk/Pod/diffed" not in rows, rows.get("risk/Pod/diffed")
    assert rows[inc.W7]["policy_result"] == "no admission decision recorded (gpuledger admit not enforcing here)", rows[inc.W7]["policy_result"]
    assert "0 denied before queue entry by gpuledger admit" in section["summary"], section["summary"]
    assert section["summary"].endswith("; 2 server-side dry run(s) answered (kubectl diff, --dry-run=server: nothing created, not counted)"), \
        section["summary"]
    assert "risk/Pod/diffed" not in audit(env, *RANGE).output


BUSY = [f"batch/job-{i:02d}" for i in range(30)]
DENIED = [f"risk/denied-{i:02d}" for i in range(15)]


@pytest.fixture(scope="module")
def busy_store(clickhouse_client, clickhouse_dsn, tmp_path_factory):
    """The incident in a busy range: 30 more workloads entering a queue with no violation
    (namespace batch: listed before the incident's), and 15 gpuledger admit denied — 47 rows
    in control 1's evidence, the incident's training job with a recorded control 1 violation."""
    submitted = [inc._sched("scheduler.submitted", inc.T0 + timedelta(minutes=21, seconds=i), wid, None, {"queue": "batch"}, ns="batch")
                 for i, wid in enumerate(BUSY)]
    denied = [denial(wid, inc.T0 + timedelta(minutes=22, seconds=i)) for i, wid in enumerate(DENIED)]
    return judged_store(clickhouse_client, clickhouse_dsn, tmp_path_factory.mktemp("audit-busy"), [*inc.correlated_rows(), *submitted, *denied])


def test_the_json_lists_every_evidence_row(busy_store):
    """From a reviewer turning on admission: every evidence list was cut at 25 rows, the JSON's
    too — a whole-run audit with 15 denials listed none of them (they come after every workload
    that entered a queue). The JSON is what automation reads: every row, "more" 0."""
    report = json.loads(audit(busy_store, *RANGE, "--format", "json").output)
    section = next(s for s in report["evidence"] if s["control"] == 1)
    workloads = [r["workload"] for r in section["rows"]]
    assert sorted(workloads) == sorted([*BUSY, inc.W7, inc.WT, *DENIED]), workloads
    assert section["more"] == 0 and section["subjects"] == len(workloads) == 47
    assert workloads[-15:] == DENIED  # in its order: the workloads that entered a queue by name, then the denials
    assert all(r["verdict"] == "denied before queue entry (the control enforced; no violation)" for r in section["rows"][-15:])


def test_the_table_and_html_list_violations_and_denials_first(busy_store, tmp_path):
    """The human formats show 25 rows of a list: the training job's control 1 violation, then the
    15 denials, then the first 9 of the rest; what is left out is said, with how to see it all."""
    out = tmp_path / "audit.html"
    assert audit(busy_store, *RANGE, "--format", "html", "--output", str(out)).exit_code == 1
    section = out.read_text().split('data-control="1"', 1)[1].split("</section>", 1)[0]
    shown = [wid for wid in (inc.WT, *DENIED, *BUSY, inc.W7) if f"<td>{wid}</td>" in section]
    assert shown == [inc.WT, *DENIED, *BUSY[:9]], shown
    assert [section.index(f"<td>{wid}</td>") for wid in shown] == sorted(section.index(f"<td>{wid}</td>") for wid in shown)
    left_out = "(+22 more not shown: 22 with no violation recorded; --format json lists all 47)"
    assert left_out in section, section.split("<table>", 1)[0]
    table = audit(busy_store, *RANGE)
    assert table.exit_code == 1 and all(wid in table.output for wid in (inc.WT, *DENIED)), table.output
    assert left_out in " ".join(table.output.split()), table.output


def test_a_list_with_more_denials_than_it_shows_says_how_many_it_left_out(busy_store, monkeypatch):
    # (a shorter list, so the 15 denials do not fit in it)
    monkeypatch.setattr("sinks.read.audit.LIST_LIMIT", 10)
    table = " ".join(audit(busy_store, *RANGE).output.split())
    assert "(+37 more not shown: 6 denied by gpuledger admit, 31 with no violation recorded; --format json lists all 47)" in table, table
    assert all(wid in table for wid in (inc.WT, *DENIED[:9])) and not any(wid in table for wid in DENIED[9:]), table


ADMIT_AT = inc.T0 + timedelta(hours=4)
ADMIT_RANGE = ["--from", (ADMIT_AT - timedelta(hours=1)).isoformat(), "--to", (ADMIT_AT + timedelta(hours=1)).isoformat()]
HELD, LET_IN = "ml/job-ranker-12-x7k2p", "ml/job-ranker-13-b8c4d"  # queued Kueue Workloads of Jobs ranker-12, ranker-13
REJECTED, HELD_UNSEEN = "ml/job-ranker-11-q9w8e", "ml/job-ranker-14-z5y6x"  # decided by the AdmissionCheck, no scheduler event stored
GONE = "ml/job-ranker-16-d3l3t"  # queued, held Pending, deleted while held
DEFERRED_ONLY = "ml/Job/ranker-15"  # deferred by the webhook; no Workload, scheduler event or check decision stored


def z(at) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def admit_store(clickhouse_client, clickhouse_dsn, tmp_path_factory):
    """gpuledger admit gating namespace ml with its Kueue AdmissionCheck: the webhook defers Jobs
    ranker-12 and ranker-13 (recorded under NS/Job/NAME), Kueue queues their Workloads, and the
    check holds both Pending (releases unapproved); v13 is approved and ranker-13 admitted,
    ranker-12 still held at --to. Two Workloads the store has only the check's decisions of: one
    Rejected (release revoked), one held Pending (release unknown). And a webhook denial. The
    decisions are the webhook's and the controller's own (tests/sinks/incident.py)."""
    from producers.releases import COMMANDS, build_event
    from streams.controls.admission import AdmissionState
    from streams.controls.policy import Admission, NamespaceAdmission

    command = {c.name: c for c in COMMANDS}
    t = ADMIT_AT
    state = AdmissionState()
    state.ready.set()

    def release(name: str, rid: str, at, **options) -> None:
        state.apply(build_event(command[name], {"release_id": rid, "at": at.isoformat(), **options}))

    for version in ("11", "12", "13"):
        release("register", f"ranker-v{version}-prod", t - timedelta(days=1), model="ranker", version=version, artifact_digest="sha256:" + "a" * 64)
    release("approve", "ranker-v11-prod", t - timedelta(hours=20), actor="alice", env="prod")
    release("revoke", "ranker-v11-prod", t - timedelta(hours=2), actor="alice", reason="drift")
    policy = Policy(admission=Admission(namespaces={"ml": NamespaceAdmission(gate="admission-check")}))

    def pod_template(rid: str) -> dict:
        return {"metadata": {"labels": {"gpuledger.io/release-id": rid, "gpuledger.io/environment": "prod"}},
                "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}

    def job(name: str, rid: str) -> dict:
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": "ml", "uid": f"uid-job-{name}", "labels": {
                "gpuledger.io/release-id": rid, "gpuledger.io/environment": "prod", "kueue.x-k8s.io/queue-name": "research"}},
                "spec": {"suspend": True, "template": pod_template(rid)}}

    def workload(wid: str, rid: str, job_name: str) -> dict:
        return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                "metadata": {"name": wid.split("/")[1], "namespace": "ml", "uid": f"uid-{wid}", "labels": {"kueue.x-k8s.io/job-uid": f"uid-job-{job_name}"}},
                "spec": {"queueName": "research", "podSets": [{"name": "main", "count": 1, "template": pod_template(rid)}]}}

    def scheduler(etype: str, wid: str, rid: str, job_name: str, at):
        return inc._ce("scheduler", etype, at, {"workload_id": wid, "namespace": "ml", "release_id": rid, "environment": "prod"},
                       {"object_kind": "Workload", "queue": "research", "cluster_queue": "gpu-a100", "gpus_requested": 1,
                        "labels": {"kueue.x-k8s.io/job-uid": f"uid-job-{job_name}"}})

    held, let_in = workload(HELD, "ranker-v12-prod", "ranker-12"), workload(LET_IN, "ranker-v13-prod", "ranker-13")
    rows = [inc.webhook_row(job("ranker-12", "ranker-v12-prod"), state, t, policy), inc.webhook_row(job("ranker-13", "ranker-v13-prod"), state, t, policy),
            scheduler("scheduler.submitted", HELD, "ranker-v12-prod", "ranker-12", t + timedelta(seconds=1)),
            scheduler("scheduler.submitted", LET_IN, "ranker-v13-prod", "ranker-13", t + timedelta(seconds=1)),
            inc.admission_check_row(held, state, t + timedelta(seconds=2)), inc.admission_check_row(let_in, state, t + timedelta(seconds=2))]
    release("approve", "ranker-v13-prod", t + timedelta(minutes=1), actor="alice", env="prod")
    rows += [inc.admission_check_row(let_in, state, t + timedelta(minutes=1, seconds=1)),
             scheduler("scheduler.admitted", LET_IN, "ranker-v13-prod", "ranker-13", t + timedelta(minutes=1, seconds=2)),
             inc.admission_check_row(held, state, t + timedelta(minutes=2)),
             inc.admission_check_row(workload(REJECTED, "ranker-v11-prod", "ranker-11"), state, t + timedelta(minutes=3)),
             inc.admission_check_row(workload(HELD_UNSEEN, "ranker-v14-prod", "ranker-14"), state, t + timedelta(minutes=3)),
             denial("risk/sneaky", t + timedelta(minutes=4)),
             # Queued, held Pending, then deleted while held: waiting no more.
             scheduler("scheduler.submitted", GONE, "ranker-v12-prod", "ranker-16", t + timedelta(seconds=1)),
             inc.admission_check_row(workload(GONE, "ranker-v12-prod", "ranker-16"), state, t + timedelta(seconds=2)),
             scheduler("scheduler.deleted", GONE, "ranker-v12-prod", "ranker-16", t + timedelta(seconds=60)),
             # Deferred by the webhook, and nothing after it: no Workload, scheduler event or check decision.
             inc.webhook_row(job("ranker-15", "ranker-v12-prod"), state, t + timedelta(minutes=5), policy)]
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(rows))
    return {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db,
            "GPULEDGER_DATA_DIR": str(tmp_path_factory.mktemp("audit-admit")), "COLUMNS": "250"}


def test_a_workload_the_admission_check_holds_pending_is_waiting_in_its_queue_not_denied(admit_store):
    """From a review: the AdmissionCheck controller records ``deny`` both when it rejects a
    Workload and when it holds it Pending until its release is approved, and control 1 read every
    deny as "denied before queue entry" — a Workload waiting in its queue for an approval, which
    it gets with no resubmission, reported as refused. The check state (the payload's operation)
    tells them apart, as the trace does. And the webhook's deferral of a queued Job, recorded
    under the Job's id, was in no Workload's policy result."""
    report = json.loads(audit(admit_store, *ADMIT_RANGE, "--format", "json").output)
    section = next(s for s in report["evidence"] if s["control"] == 1)
    rows = {r["workload"]: r for r in section["rows"]}
    assert set(rows) == {HELD, LET_IN, REJECTED, HELD_UNSEEN, "risk/sneaky", DEFERRED_ONLY, GONE}, rows  # (the Jobs' ids are their Workloads')
    t = ADMIT_AT
    since, last = z(t + timedelta(seconds=2)), z(t + timedelta(minutes=2))

    held = rows[HELD]
    assert held["verdict"] == f"waiting in its queue: held by gpuledger admit (rule unapproved) since {since} — no violation", held
    # (the webhook's deferral of its Job first: it came first; the check's message last: what it waits for)
    assert held["policy_result"].startswith(
        f"workload {HELD}: deferred by the webhook: decision allow at {z(t)} by rule deferred-to-admission-check (webhook, enforce, "
        f"recorded as ml/Job/ranker-12); held in its queue by gpuledger admit since {since}: decision deny at {last} by rule unapproved "
        f"(admission-check Pending, enforce), after queue entry at {z(t + timedelta(seconds=1))}: release ranker-v12-prod is registered, "
        "not approved for prod"), held["policy_result"]

    # Held Pending, then admitted once v13 was approved: an admitted workload, its evidence showing the hold.
    let_in = rows[LET_IN]
    assert let_in["verdict"] == "no violation recorded", let_in
    assert let_in["policy_result"] == (
        f"workload {LET_IN}: decision allow at {z(t + timedelta(minutes=1, seconds=1))} by rule approved (admission-check Ready, enforce), "
        f"before admission at {z(t + timedelta(minutes=1, seconds=2))} (+1s); held in its queue before it since {since} (rule unapproved, "
        f"AdmissionCheck Pending; 1 decision(s)); deferred by the webhook: decision allow at {z(t)} by rule deferred-to-admission-check "
        "(webhook, enforce, recorded as ml/Job/ranker-13)"), let_in["policy_result"]

    # Only the check's decisions in the store: a Workload in its queue, held or refused there.
    unseen = rows[HELD_UNSEEN]
    assert unseen["queue_entry"] == "in its queue (no scheduler event in the store)", unseen
    assert unseen["verdict"] == f"waiting in its queue: held by gpuledger admit (rule unknown-release) since {z(t + timedelta(minutes=3))} — no violation"
    rejected = rows[REJECTED]
    assert rejected["verdict"] == (f"denied in its queue: its AdmissionCheck Rejected by gpuledger admit (rule revoked) at "
                                   f"{z(t + timedelta(minutes=3))} (the control enforced; no violation)"), rejected
    assert rejected["policy_result"].startswith(f"workload {REJECTED}: decision deny at {z(t + timedelta(minutes=3))} by rule revoked "
                                                "(admission-check Rejected, enforce): "), rejected
    assert rows["risk/sneaky"]["verdict"] == "denied before queue entry (the control enforced; no violation)"
    # Held, then deleted while held: it entered its queue in the range, and waits no more.
    assert rows[GONE]["verdict"] == "no violation recorded", rows[GONE]
    assert ("3 workload(s) entering a queue in the range; 0 with a control 1 violation (0 violation(s)); 1 denied before queue entry by "
            "gpuledger admit; 1 denied in their queue (AdmissionCheck Rejected) and 2 waiting in their queue (AdmissionCheck Pending) "
            "by gpuledger admit; 1 deferred to their AdmissionCheck by the webhook with no Workload or check decision in the store") \
        in section["summary"], section["summary"]
    # A Job the webhook deferred, and nothing after it in the store (the trace showed it "deferred"; the audit nowhere).
    deferred = rows[DEFERRED_ONLY]
    assert (deferred["queue_entry"], deferred["release"]) == ("deferred (no Workload in the store)", "ranker-v12-prod"), deferred
    assert deferred["verdict"] == (f"deferred to its AdmissionCheck: by the webhook at {z(t + timedelta(minutes=5))}; the store has no "
                                   "Workload, scheduler event or check decision of it — no violation"), deferred
    assert deferred["policy_result"].startswith(f"workload {DEFERRED_ONLY}: decision allow at {z(t + timedelta(minutes=5))} by rule "
                                                "deferred-to-admission-check (webhook, enforce)"), deferred


def test_a_workload_queued_before_the_range_and_held_or_rejected_in_it_is_listed(admit_store):
    """A Workload that entered its queue before --from and that the AdmissionCheck holds as of
    --to was in no row of control 1: its queue entry was outside the range, and the store has its
    scheduler events, so it was not among the workloads known only by their decisions either."""
    t = ADMIT_AT
    report = json.loads(audit(admit_store, "--from", (t + timedelta(seconds=90)).isoformat(), "--to", ADMIT_RANGE[3], "--format", "json").output)
    section = next(s for s in report["evidence"] if s["control"] == 1)
    rows = {r["workload"]: r for r in section["rows"]}
    held = rows[HELD]
    assert held["queue_entry"] == z(t + timedelta(seconds=1)), held  # before --from: the fact as it is
    assert held["verdict"] == f"waiting in its queue: held by gpuledger admit (rule unapproved) since {z(t + timedelta(seconds=2))} — no violation"
    # Admitted at +1m2s, before this range: nothing of control 1's in it; deleted while held at +60s: neither.
    assert LET_IN not in rows, rows[LET_IN]
    assert GONE not in rows, rows[GONE]
    assert section["summary"].startswith("0 workload(s) entering a queue in the range; "), section["summary"]
    assert "and 2 waiting in their queue (AdmissionCheck Pending)" in section["summary"], section["summary"]


def test_waiting_workloads_are_listed_after_the_denials_and_counted_when_left_out(admit_store, monkeypatch, tmp_path):
    """A held Workload is what control 1 is stopping for now: after the denials, before the rows
    that only show the control was exercised — and a list too short for it says how many."""
    monkeypatch.setattr("sinks.read.audit.LIST_LIMIT", 3)
    out = tmp_path / "audit.html"
    assert audit(admit_store, *ADMIT_RANGE, "--format", "html", "--output", str(out)).exit_code == 0
    section = out.read_text().split('data-control="1"', 1)[1].split("</section>", 1)[0]
    shown = sorted((section.index(f"<td>{wid}</td>"), wid) for wid in (HELD, LET_IN, REJECTED, HELD_UNSEEN, "risk/sneaky")
                   if f"<td>{wid}</td>" in section)
    assert [wid for _at, wid in shown] == [REJECTED, "risk/sneaky", HELD], shown
    left_out = ("(+4 more not shown: 1 waiting in their queue, 1 not judged yet (or deferred, no check decision) or not compared, "
                "2 with no violation recorded; --format json lists all 7)")
    assert left_out in section, section.split("<table>", 1)[0]
    assert left_out in " ".join(audit(admit_store, *ADMIT_RANGE).output.split())


def test_a_reservation_window_ending_after_the_last_event_is_not_judged_yet(clickhouse_client, clickhouse_dsn, tmp_path):
    """From an exploratory review: a reservation whose window ended in the range, still held, read
    PASS — the worker judges deadlines on event time, and no event came after the window's end."""
    db = inc.load_store(clickhouse_client)

    def reservation(res_id: str, minutes_end: int):
        at = inc.T0 + timedelta(minutes=20)
        return inc._ce("release", "release.reservation_created", at, {"release_id": inc.R7, **inc.MANIFEST7},
                       {"actor": "alice", "reservation": {"reservation_id": res_id, "gpus": 2, "pool": "a100", "window_start": at.isoformat(),
                                                          "window_end": (inc.T0 + timedelta(minutes=minutes_end)).isoformat()}},
                       attribution="release_event", release_state="release.reservation_created", key=res_id)
    # The store's latest event is the quality alert's resolution, T0 + 95 min.
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([reservation("res-late", 100), reservation("res-early", 60)]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    report = json.loads(audit(env, *RANGE, "--format", "json").output)
    rows = {r["reservation"]: r for r in next(s for s in report["evidence"] if s["control"] == 5)["rows"]}
    assert rows["res-late"]["verdict"].startswith("not judged yet: the window ended at 2026-11-30T13:40:00Z, after the latest event in the "
                                                  "store (2026-11-30T13:35:00Z)"), rows["res-late"]
    assert rows["res-early"]["verdict"] == "no violation recorded", rows["res-early"]  # its end was before the latest event: judged
    control5 = next(c for c in report["controls"] if c["id"] == 5)
    assert control5["status"] == "PASS" and "1 deadline(s) after the latest event in the store, not judged yet" in control5["note"], control5
    assert any(n.startswith("the latest event in the store is at 2026-11-30T13:35:00Z, before --to") for n in report["notes"]), report["notes"]
    assert "not judged yet" in audit(env, *RANGE).output
    # A re-evaluation judges as of --to: nothing is left unjudged.
    again = json.loads(audit(env, *RANGE, "--reevaluate", "--format", "json").output)
    assert not [r for s in again["evidence"] for r in s["rows"] if str(r.get("verdict", "")).startswith("not judged")]
    assert not [n for n in again["notes"] if n.startswith("the latest event")]


def test_a_retirement_grace_period_ending_after_the_last_event_is_not_judged_yet(clickhouse_client, clickhouse_dsn, tmp_path):
    """As control 5's windows: a release retired in the range whose grace period (1 h by default)
    ended after the store's latest event read "no violation recorded" — the worker judges the
    grace period's end on event time, and no event came after it."""
    db = inc.load_store(clickhouse_client)

    def retired(rid: str, manifest: dict, minutes: int):
        return inc._ce("release", "release.retired", inc.T0 + timedelta(minutes=minutes), {"release_id": rid, **manifest},
                       {"actor": "alice", "reason": "superseded"}, attribution="release_event", release_state="release.retired")
    # The store's latest event is at T0 + 95 min: R6's grace ends at T0 + 80 (judged), R7-staging's at T0 + 100 (not yet).
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([retired(inc.R6, inc.MANIFEST6, 20),
                                                                     retired(inc.R7_STAGING, inc.MANIFEST7_STAGING, 40)]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    report = json.loads(audit(env, *RANGE, "--format", "json").output)
    rows = {r["release"]: r for r in next(s for s in report["evidence"] if s["control"] == 8)["rows"]}
    assert rows[inc.R7_STAGING]["verdict"].startswith("not judged yet: the grace period ended at 2026-11-30T13:40:00Z, after the latest "
                                                      "event in the store (2026-11-30T13:35:00Z)"), rows[inc.R7_STAGING]
    assert rows[inc.R6]["verdict"] == "no violation recorded", rows[inc.R6]
    control8 = next(c for c in report["controls"] if c["id"] == 8)
    assert control8["status"] == "PASS" and "1 deadline(s) after the latest event in the store, not judged yet" in control8["note"], control8
    again = json.loads(audit(env, *RANGE, "--reevaluate", "--format", "json").output)
    assert not [r for s in again["evidence"] for r in s["rows"] if str(r.get("verdict", "")).startswith("not judged")]
    # A retirement the policy does not count (unproven, with require_for_rights: Policy.stops) is never judged: not "yet".
    strict = tmp_path / "strict.yaml"
    strict.write_text("version: 1\nauthentication:\n  require_for_rights: true\n")
    report = json.loads(audit(env, *RANGE, "--format", "json", "--policy", str(strict)).output)
    rows = {r["release"]: r for r in next(s for s in report["evidence"] if s["control"] == 8)["rows"]}
    assert rows[inc.R7_STAGING]["verdict"] == "no violation recorded", rows[inc.R7_STAGING]


def test_control_1s_queue_entry_is_the_first_event_published_within_its_second(clickhouse_client, clickhouse_dsn, tmp_path):
    """From an exploratory review: among a workload's submission, quota reservation and admission
    in one whole second, the entry event was picked by correlation id (a hash)."""
    from schemas import CorrelatedEvent, Identity

    db = inc.load_store(clickhouse_client)
    at = inc.T0 + timedelta(minutes=30)
    seen = ["scheduler.submitted", "scheduler.quota_reserved", "scheduler.admitted"]
    rows = [CorrelatedEvent(correlation_id=f"c-{3 - i}", version=0, event_type=etype, occurred_at=at, attribution="unattributed",
                            identity=Identity(workload_id="risk/same-second", namespace="risk"), summary=etype,
                            source_topic="test.scheduler.v1", source_partition=1, source_offset=500 + i,
                            payload_json='{"object_kind": "Workload", "queue": "prod"}') for i, etype in enumerate(seen)]
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(rows))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path)}
    section = next(s for s in json.loads(audit(env, *RANGE, "--format", "json").output)["evidence"] if s["control"] == 1)
    row = {r["workload"]: r for r in section["rows"]}["risk/same-second"]
    assert (row["entry_event"], row["queue_entry"]) == ("scheduler.submitted", "2026-11-30T12:30:00Z"), row


def test_a_preemption_whose_priorities_are_unknown_is_said_at_the_control(clickhouse_client, clickhouse_dsn, tmp_path):
    """From an exploratory review: control 4 read "PASS … exercised: 1 preemption(s)" while its
    only preemption's priorities were unknown to the policy — not compared at all."""
    db = inc.load_store(clickhouse_client)  # no recorded violation: control 4 passes
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    known = next(c for c in json.loads(audit(env, *RANGE, "--format", "json").output)["controls"] if c["id"] == 4)
    assert known["status"] == "PASS" and "not compared" not in known["note"], known
    unknown_policy = tmp_path / "policy.yaml"
    unknown_policy.write_text("business_priority:\n  by_priority_class: {}\n")
    report = json.loads(audit(env, *RANGE, "--policy", str(unknown_policy), "--format", "json").output)
    control4 = next(c for c in report["controls"] if c["id"] == 4)
    assert control4["status"] == "PASS" and "1 preemption(s) not compared: a side's business priority is unknown" in control4["note"], control4


def test_control_6s_sample_is_the_most_completely_joined_alert(clickhouse_client, clickhouse_dsn, tmp_path):
    """From an exploratory review: the sampled alert was the last quality alert, joined by its model
    alone (workload, pod and node/GPU gaps), beside an alert joined whole."""
    db = inc.load_store(clickhouse_client)
    starts = inc.T0 + timedelta(minutes=80)
    payload = {"alertname": "ModelQualityDegraded", "severity": "critical", "labels": {"model": "fraud-scorer", "model_version": "7"},
               "annotations": {}, "starts_at": starts.isoformat()}
    by_model = inc._ce("alert", "alert.firing", starts, {"alert_fingerprint": "fp-model-only", "release_id": inc.R7, **inc.MANIFEST7}, payload,
                       attribution="model_version_match", summary="ModelQualityDegraded (critical) firing", key="fp-model-only")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([by_model]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path)}
    section = next(s for s in json.loads(audit(env, *RANGE, "--format", "json").output)["evidence"] if s["control"] == 6)
    steps = {r["step"]: r["value"] for r in section["rows"]}
    assert steps["workload"] == inc.W7 and steps["node/gpu"] == f"node-b/{inc.GPU_B}" and inc.FP in steps["alert"], steps


def test_reevaluate_judges_controls_1_and_3_as_the_worker_did_from_the_stored_rows(clickhouse_client, clickhouse_dsn, tmp_path):
    """The worker's controls judge a row by two fields beyond its identity: whose its environment is
    (``environment_labelled``) and the release id its label named that no release event describes
    (``named_release_id``). The store did not keep them, and ``--reevaluate`` judged an unlabelled
    workload of a release whose events named only dev in dev (its row's environment: no approval
    needed) where the worker judged it in an unknown environment (an approval needed, none given), and
    found no control 3 mismatch for a pod labelled with a mistyped release id that its image digest
    attributed to the real one. Rows from the real correlation (the entity rules), the worker's
    verdicts from the rows its controls stage gets; the re-evaluation now lists the same violations
    of both controls."""
    from tests.streams.harness import Driver, alert, pod_event, release as release_event

    digest = "sha256:" + "b" * 64
    d = Driver().feed([release_event("release.registered", 0, env="dev", digest=digest),
                       pod_event("scheduler.scheduled", 5, ns="scratch", pod="unl", workload="scratch/Job/unl", digest=digest),
                       pod_event("scheduler.scheduled", 6, ns="scratch", pod="typo", workload="scratch/Job/typo", release_id="r1-typo",
                                 digest=digest),
                       # an alert labelled with a release no release event describes: not joined (control 6, ``release_known``)
                       alert(7, fp="ghost", release_id="ghost-v1"), alert(8, fp="fine", release_id="r1")]).flush_parked()
    rows, live_rows = list(d.rows.values()), list(d.controls.values())
    live = ControlEngine(directory_from_rows(live_rows), Policy()).feed(live_rows, list(d.allocations.values()))
    live.run()
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)

    async def store():
        writers = SinkWriters(clickhouse_client, db)
        assert await writers.store_correlated(rows) == []
        assert await writers.store_violations(list(live.violations.values())) == []
    asyncio.run(store())
    stored = clickhouse_client.query(f"SELECT pod, release_id, attribution, named_release_id, environment_labelled FROM `{db}`.correlated_events "
                                     "FINAL WHERE event_type = 'scheduler.scheduled' ORDER BY pod").result_rows
    assert stored == [("typo", "r1", "image_digest_fallback", "r1-typo", False), ("unl", "r1", "image_digest_match", "", False)]

    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    span = ["--from", "2026-11-01T07:00:00Z", "--to", "2026-11-01T10:00:00Z", "--format", "json"]
    recorded, again = (json.loads(audit(env, *span, *extra).output) for extra in ((), ("--reevaluate",)))
    assert recorded["mode"] == "recorded" and again["mode"] == "re-evaluation"

    def judged(report, control):
        return sorted((v["subject"], v["detail"], v["opened_at"], v["closed_at"]) for v in report["violations"] if v["control"] == control)

    assert judged(again, 1) == judged(recorded, 1) == [
        ("r1", "workload scratch/Job/typo (pod scratch/typo) was admitted (scheduler.scheduled) at 2026-11-01T08:06:00.000Z but release r1 "
               "had no approval for its environment", "2026-11-01T08:06:00Z", None),
        ("r1", "workload scratch/Job/unl (pod scratch/unl) was admitted (scheduler.scheduled) at 2026-11-01T08:05:00.000Z but release r1 "
               "had no approval for its environment", "2026-11-01T08:05:00Z", None)]
    assert judged(again, 3) == judged(recorded, 3) == [
        ("r1", "workload scratch/Job/typo (pod scratch/typo) names release r1-typo, which no release event describes; attributed to r1 "
               "by image digest fallback instead", "2026-11-01T08:06:00Z", None)]
    assert [subject for subject, *_ in judged(again, 6)] == [subject for subject, *_ in judged(recorded, 6)] == ["ghost-v1"]
    status = {report["mode"]: {c["id"]: c["status"] for c in report["controls"]} for report in (recorded, again)}
    assert status["re-evaluation"][1] == status["recorded"][1] == "FAIL" and status["re-evaluation"][3] == status["recorded"][3] == "FAIL"


def test_a_bound_with_microseconds_keeps_what_the_store_read_in_its_millisecond(store):
    """``--from`` with microseconds: the store was read at its precision (ms: a violation closed in the same
    millisecond is in range), and the report's own range check compared to the microsecond and left it out."""
    from sinks.clickhouse import connect

    client = connect(store["GPULEDGER_CLICKHOUSE_DSN"], store["GPULEDGER_CLICKHOUSE_DATABASE"], create=False)
    closed = client.query(f"SELECT violation_id, closed_at FROM {store['GPULEDGER_CLICKHOUSE_DATABASE']}.violations FINAL "
                          "WHERE closed_at IS NOT NULL AND NOT startsWith(detail, 'withdrawn:') ORDER BY closed_at LIMIT 1").result_rows
    assert closed, "the incident has a violation that closed"
    vid, at = closed[0]
    start = at.replace(tzinfo=timezone.utc) + timedelta(microseconds=400)
    report = json.loads(audit(store, "--from", start.isoformat(), "--to", "2026-11-30T14:00:00Z", "--format", "json").output)
    assert vid in {v["violation_id"] for v in report["violations"]}
