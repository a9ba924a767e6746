"""deploy/grafana: the dashboard's SQL runs against the real tables.

Every panel query (and the annotation query) of deploy/grafana/dashboards/gpuledger.json
is run, after substituting the ClickHouse plugin's macros the way Grafana does, against
a freshly migrated database holding one incident (tests/sinks/incident.py) and one
violation, written by the real sink writers — read-only, as Grafana's user should be.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml

from schemas import Identity
from schemas.outputs import Violation
from sinks.agents import SinkWriters
from sinks.migrations import migrate
from sinks.read.query import run_readonly
from tests.sinks import incident as inc

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gpuledger.json"
FROM, TO = inc.T0 - timedelta(hours=1), inc.T0 + timedelta(hours=3)
INTERVAL_S = 60
GHOST = "ghost-v1"  # a release id no release event describes


def substitute(sql: str, database: str, start: datetime = FROM, end: datetime = TO, interval_s: int = INTERVAL_S) -> str:
    """The grafana-clickhouse-datasource macros and the dashboard's ${database} variable."""
    f, t = int(start.timestamp()), int(end.timestamp())
    sql = re.sub(r"\$__timeFilter\(\s*([^)]+?)\s*\)", lambda m: f"{m[1]} >= toDateTime({f}) AND {m[1]} <= toDateTime({t})", sql)
    sql = re.sub(r"\$__timeInterval\(\s*([^)]+?)\s*\)", lambda m: f"toStartOfInterval(toDateTime({m[1]}), INTERVAL {interval_s} second)", sql)
    sql = sql.replace("$__fromTime", f"toDateTime({f})").replace("$__toTime", f"toDateTime({t})").replace("$__interval_s", str(interval_s))
    sql = sql.replace("${database}", f"`{database}`").replace("$database", f"`{database}`")
    assert "$" not in sql, f"unknown macro or variable left in: {sql}"
    return sql


def queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']}", t["rawSql"]) for p in dash["panels"] if p.get("type") != "row" for t in p["targets"]]
    out += [(f"annotation {a['name']}", a["target"]["rawSql"]) for a in dash["annotations"]["list"] if a.get("target")]
    return out


@pytest.fixture(scope="module")
def store(clickhouse_client):
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    writers = SinkWriters(clickhouse_client, db)
    violation = Violation(violation_id="v-1", version=0, control_id=8, title="Retirement", severity="critical",
                          identity=Identity(release_id=inc.R6, node="node-a", gpu_id=inc.GPU_A), evidence=("e1", "e2"),
                          owner="team-risk", opened_at=inc.T0 + timedelta(minutes=30), detail="retired release still holds a GPU")

    # A violation withdrawn (docs/controls.md: re-emitted closed at its opening, "withdrawn: …"):
    # readers skip it — the Violations panels showed it (exploratory review).
    withdrawn = Violation(violation_id="v-2", version=1, control_id=6, title="Alert without a release", severity="warning",
                          identity=Identity(node="node-a", gpu_id=inc.GPU_A), evidence=("e3",), owner="team-risk",
                          opened_at=inc.T0 + timedelta(minutes=40), closed_at=inc.T0 + timedelta(minutes=40),
                          detail="withdrawn: alert LateModel joined a release that arrived late")

    # An alert whose label names a release no release event describes (docs/architecture.md,
    # Parking): release_label, a release_id, no release_state — not an attributed alert.
    ghost_at = inc.T0 + timedelta(minutes=70)
    ghost = inc._ce("alert", "alert.firing", ghost_at, {"alert_fingerprint": "fp-ghost", "release_id": GHOST},
                    {"alertname": "GhostRelease", "severity": "warning", "starts_at": ghost_at.isoformat()},
                    summary="GhostRelease (warning) firing", key="fp-ghost")

    # An alert attributed to a described release before that release's first event: no release_state as of
    # its time, yet attributed (control 6 counts it) — not "no release event" (review of the change).
    early_at = inc.T0 - timedelta(minutes=10)
    early = inc._ce("alert", "alert.firing", early_at, {"alert_fingerprint": "fp-early", "release_id": inc.R7, **inc.MANIFEST7},
                    {"alertname": "EarlyBird", "severity": "warning", "starts_at": early_at.isoformat()},
                    summary="EarlyBird (warning) firing", key="fp-early")

    async def go():
        await writers.store_correlated([*inc.correlated_rows(), ghost, early])
        await writers.store_allocations(inc.allocation_rows())
        await writers.store_violations([violation, withdrawn])
    asyncio.run(go())
    return clickhouse_client, db


def test_dashboard_and_provisioning_agree():
    dash = json.loads(DASHBOARD.read_text())
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "clickhouse.yaml").read_text())["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "grafana-clickhouse-datasource"
    uid = sources[0]["uid"]
    panels = [p for p in dash["panels"] if p.get("type") != "row"]
    assert {p["datasource"]["uid"] for p in panels} == {uid}
    assert all(t["datasource"]["uid"] == uid for p in panels for t in p["targets"])
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("gpus held by release", "alerts by release", "violations"):
        assert topic in titles
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "gpuledger.yaml").read_text())["providers"][0]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["grafana"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in compose["volumes"]}
    assert mounts[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    assert "grafana-clickhouse-datasource" in compose["environment"]["GF_INSTALL_PLUGINS"]


@pytest.mark.parametrize("name, sql", queries(), ids=[q[0] for q in queries()])
def test_every_query_runs_against_the_real_tables(store, name, sql):
    client, db = store
    result = run_readonly(client, substitute(sql, db))
    assert result.rows, f"{name}: no rows over the incident's time range"


def test_the_panels_say_what_happened(store):
    client, db = store
    by_title = dict(queries())
    held = run_readonly(client, substitute(by_title["panel GPU-hours by release"], db)).dicts()
    assert {r["release"] for r in held} == {inc.R7, "unattributed"}
    alerts = run_readonly(client, substitute(by_title["panel Alerts by release and name"], db)).dicts()
    assert {(r["release"], r["alertname"]) for r in alerts} == {(inc.R7, "ModelQualityDegraded"), ("unattributed", "GpuXidError"),
                                                                 (f"{GHOST} (no release event)", "GhostRelease"), (inc.R7, "EarlyBird")}
    # Firing in range: ModelQualityDegraded (one row: its versions collapse), GpuXidError, GhostRelease, EarlyBird —
    # two of four joined to a described release (the ghost's label alone does not count; the early one does).
    coverage = run_readonly(client, substitute(by_title["panel Alert attribution coverage"], db)).dicts()
    assert coverage == [{"attributed_percent": 50.0, "alerts": 4}]
    firing = run_readonly(client, substitute(by_title["panel Firing alerts by release"], db)).dicts()
    assert {r["release"] for r in firing} == {inc.R7, "unattributed", f"{GHOST} (no release event)"}
    series = run_readonly(client, substitute(by_title["panel GPUs held by release"], db)).dicts()
    peak = max(r["gpus"] for r in series if r["release"] == inc.R7)
    assert peak == 1  # one pod at a time: preempted on node-a, then re-admitted on node-b
    violations = run_readonly(client, substitute(by_title["panel Violations"], db)).dicts()
    assert [(v["control_id"], v["release_id"]) for v in violations] == [(8, inc.R6)]  # not the withdrawn one
    opened = run_readonly(client, substitute(by_title["panel Violations opened by control"], db)).dicts()
    assert [(r["control"], r["violations"]) for r in opened] == [("control 8: Retirement", 1)]
