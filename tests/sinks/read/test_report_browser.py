"""sinks/read/report.py in a real browser: headless Chromium loads the incident report
(file://, no network) and the test checks the DOM it rendered — device lanes,
allocation bars coloured by release, markers for preemption, eviction, release
lifecycle events and alerts — and saves a screenshot under test-artifacts/.

The report is rendered from real ClickHouse holding the incident of
tests/sinks/incident.py (written by the real sink writers), through
``gpuledger trace --format html``.
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app as cli_app
from sinks.read.query import DirectReader
from sinks.read.report import collect_report_data, render_html
from sinks.read.trace import trace
from tests.sinks import incident as inc

ROOT = Path(__file__).resolve().parents[3]
ARTIFACTS = ROOT / "test-artifacts"


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def run_chromium(binary: str, url: str, profile: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-default-apps", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={profile}", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class Dom(HTMLParser):
    """Elements of the dumped DOM, as (tag, attrs) in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    handle_startendtag = handle_starttag

    def having(self, attr: str, tag: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.elements if attr in a and (tag is None or t == tag)]

    def with_class(self, cls: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if cls in a.get("class", "").split()]


@pytest.fixture(scope="module")
def store(clickhouse_client):
    return DirectReader(clickhouse_client), inc.load_store(clickhouse_client)


@pytest.fixture(scope="module")
def chromium():
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium on PATH (install Debian's `chromium` package: apt-get install -y chromium)")
    return binary


def test_report_data_comes_from_the_store(store):
    reader, db = store
    result = trace(reader, db, "alert", inc.FP)
    data = collect_report_data(reader, db, result)
    assert data["nodes"] == ["node-a", "node-b"]
    assert {(a["node"], a["gpu_id"], a["pod"]) for a in data["allocations"]} == {
        ("node-a", inc.GPU_A, inc.P1), ("node-a", inc.GPU_A, inc.PT), ("node-b", inc.GPU_B, inc.P2)}
    assert {e["event_type"] for e in data["scheduler_events"]} == {"scheduler.preempted", "scheduler.evicted"}
    assert {a["alertname"] for a in data["alerts"]} >= {"ModelQualityDegraded", "GpuXidError"}
    assert {r["event_type"] for r in data["release_events"]} >= {"release.promoted", "release.rolled_back"}


def test_the_page_is_self_contained(store):
    reader, db = store
    result = trace(reader, db, "alert", inc.FP)
    page = render_html(result, collect_report_data(reader, db, result), chain_text="<script>alert(1)</script>")
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    for ref in ("src=", "href=", "@import", "url(", "http://", "https://"):
        assert ref not in page.replace('xmlns="http://www.w3.org/2000/svg"', ""), ref


def test_chromium_renders_lanes_and_markers(store, chromium, clickhouse_dsn, tmp_path):
    reader, db = store
    report = tmp_path / "incident.html"
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path)}
    out = CliRunner().invoke(cli_app, ["trace", "--alert", inc.FP, "--format", "html", "--output", str(report)], env=env)
    assert out.exit_code == 0, out.output
    url = report.resolve().as_uri()

    dumped = run_chromium(chromium, url, tmp_path / "profile-dom", "--virtual-time-budget=3000", "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = Dom()
    dom.feed(dumped.stdout)

    # The inline script ran in the browser (it marks the body once it has wired the legend).
    body = next(a for t, a in dom.elements if t == "body")
    assert body.get("data-rendered") == "true"
    # One lane per node/GPU the chain touched, plus the node headers and the top lanes.
    lanes = {a["data-lane"] for a in dom.having("data-lane", "g") if "lane" in a.get("class", "").split()}
    assert {f"node-a/{inc.GPU_A}", f"node-b/{inc.GPU_B}", "node:node-a", "node:node-b", "releases", "alerts"} <= lanes
    # Allocation bars coloured by release: the release's pods, and the training job unattributed.
    bars = {(a["data-pod"], a["data-release"]) for a in dom.with_class("alloc")}
    assert bars == {(f"risk/{inc.P1}", inc.R7), (f"risk/{inc.P2}", inc.R7), (f"training/{inc.PT}", "unattributed")}
    fills = {a["data-release"]: a["fill"] for a in dom.with_class("alloc")}
    assert fills[inc.R7] != fills["unattributed"]
    # Markers: the preemption on the GPU the pod held, the eviction, lifecycle events, alerts.
    markers = dom.with_class("marker")
    kinds = {m["data-kind"] for m in markers}
    assert {"preempted", "evicted", "release", "alert"} <= kinds
    preempted = [m for m in markers if m["data-kind"] == "preempted"]
    assert any(m["data-lane"] == f"node-a/{inc.GPU_A}" and m.get("data-pod") == f"risk/{inc.P1}" for m in preempted)
    release_events = {(m["data-release"], m["data-event-type"]) for m in markers if m["data-kind"] == "release"}
    assert {(inc.R7, "release.promoted"), (inc.R7, "release.rolled_back"), (inc.R7, "release.approved")} <= release_events
    alerts = {(m["data-alertname"], m["data-lane"]) for m in markers if m["data-kind"] == "alert"}
    assert ("ModelQualityDegraded", f"node-b/{inc.GPU_B}") in alerts  # attributed via the pod on node-b's GPU
    assert ("GpuXidError", "node:node-b") in alerts  # a node-level alert on the node's header lane
    # The manifest and the text chain beside the timeline.
    assert any(a.get("data-release") == inc.R7 for a in dom.having("data-release", "table"))
    assert any(a.get("id") == "chain" for _, a in dom.elements)
    assert f"release {inc.R7}" in dumped.stdout and inc.MANIFEST7["artifact_digest"] in dumped.stdout

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "incident-report.png"
    shot.unlink(missing_ok=True)
    taken = run_chromium(chromium, url, tmp_path / "profile-shot", "--window-size=1400,900", f"--screenshot={shot}")
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    shutil.copy(report, ARTIFACTS / "incident-report.html")
