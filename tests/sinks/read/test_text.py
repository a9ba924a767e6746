"""sinks/read/text.py, and free text escaped on every output (issue 13 item 10): an alert
whose name carries a raw U+202E (right-to-left override), a terminal escape and
``<script>`` is written to real ClickHouse by the real sink writers, then read back by
``gpuledger trace`` as a tree and as the HTML report, and rendered in the audit page."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app as cli_app
from sinks.agents import SinkWriters
from sinks.read.audit import render_html as audit_html
from sinks.read.report import render_html
from sinks.read.text import markup, printable
from sinks.read.tree import render_tree, tree_text
from tests.sinks import incident as inc

RLO = "\u202e"
EVIL = f"Gpu{RLO}exe.gnp<script>alert(1)</script>\x1b[2J[bold]x[/]"
EVIL_FP = "e0e1e2e3e4e5e6e7"


def test_printable_shows_control_and_bidi_characters_as_escapes():
    assert printable(f"a{RLO}b") == "a\\u202eb"
    assert printable("nul\x00 esc\x1b[31m del\x7f csi\x9b cr\r lf\n tab\t") == "nul\\x00 esc\\x1b[31m del\\x7f csi\\x9b cr\\x0d lf\\x0a tab\\x09"
    assert printable("isolate\u2066 mark\u200f sep\u2028") == "isolate\\u2066 mark\\u200f sep\\u2028"
    assert printable("lf\n tab\t cr\r", multiline=True) == "lf\n tab\t cr\\x0d"
    # Text people write is left alone: accents, CJK, emoji with a joiner, box drawing.
    plain = "café 東京 👩\u200d💻 ├── →"
    assert printable(plain) == plain
    assert printable(None) == "" and printable(7) == "7"


def test_markup_cannot_style_or_break_a_rich_renderable():
    from rich.console import Console

    console = Console(record=True, width=200, color_system=None)
    console.print(markup("[bold]x[/] [/]"))  # an unbalanced [/] would raise MarkupError unescaped
    assert console.export_text().strip() == "[bold]x[/] [/]"


@pytest.fixture(scope="module")
def store(clickhouse_client, clickhouse_dsn, tmp_path_factory):
    db = inc.load_store(clickhouse_client)
    at = inc.T0 + timedelta(minutes=66)
    evil = inc._ce("alert", "alert.firing", at, {"alert_fingerprint": EVIL_FP, "node": "node-b"},
                   {"alertname": EVIL, "severity": "critical", "labels": {"alertname": EVIL}, "annotations": {}, "starts_at": at.isoformat()},
                   attribution="unattributed", summary=f"{EVIL} (critical) firing", key=EVIL_FP)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([evil]))
    return {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db,
            "GPULEDGER_DATA_DIR": str(tmp_path_factory.mktemp("text")), "COLUMNS": "250"}


def _assert_neutralised(text: str) -> None:
    assert RLO not in text and "\x1b" not in text
    assert "\\u202e" in text and "\\x1b" in text


def test_the_trace_tree_prints_the_alert_name_escaped(store):
    out = CliRunner().invoke(cli_app, ["trace", "--alert", EVIL_FP], env=store)
    assert out.exit_code == 0, out.output
    _assert_neutralised(out.stdout)
    assert "[bold]x[/]" in out.stdout  # shown as typed, not taken as markup


def test_the_html_report_escapes_the_alert_name(store, tmp_path):
    page_file = tmp_path / "evil.html"
    out = CliRunner().invoke(cli_app, ["trace", "--alert", EVIL_FP, "--format", "html", "--output", str(page_file)], env=store)
    assert out.exit_code == 0, out.output
    page = page_file.read_text()
    _assert_neutralised(page)
    assert "<script>alert(1)" not in page
    assert "Gpu\\u202eexe.gnp&lt;script&gt;alert(1)&lt;/script&gt;" in page  # marker label, title and data-alertname
    assert f'data-alertname="Gpu\\u202eexe.gnp&lt;script&gt;' in page
    assert page.count("<script>") == 1  # the report's own, inline


def test_every_free_text_field_of_both_pages_is_escaped():
    result = {"entry": {"kind": "alert", "value": EVIL, "root": None}, "gaps": [EVIL],
              "release": {"release_id": EVIL, "owner": EVIL, "approvals": [{"occurred_at": "2026-11-30T12:00:00Z", "actor": EVIL}]}}
    data = {"alerts": [{"event_type": "alert.firing", "occurred_at": "2026-11-30T12:00:00.000Z", "alertname": EVIL, "alert_fingerprint": EVIL,
                        "node": EVIL}], "nodes": [EVIL]}
    tree = tree_text(render_tree(result), width=400)
    page = render_html(result, data, title=EVIL, chain_text=tree, description=EVIL,
                       checks=[{"status": "FAIL", "name": EVIL, "entry": EVIL, "detail": EVIL}],
                       steps=[{"at": "2026-11-30T12:00:00Z", "offset": 5, "kind": EVIL, "summary": EVIL, "note": EVIL}])
    _assert_neutralised(tree)
    _assert_neutralised(page)
    assert "<script>alert" not in page
    report = {"range": {"from": "2026-11-30T11:00:00Z", "to": "2026-11-30T14:00:00Z"}, "policy": EVIL, "passed": False,
              "outcome": "fail", "policy_version": EVIL, "verdicts": EVIL, "events_in_range": 1,
              "controls": [{"id": 6, "title": EVIL, "status": "FAIL", "violations": 1, "open": 1, "closed": 0, "info": 0, "exercised": 1,
                            "owner": EVIL, "note": EVIL}],
              "violations": [{"control": 6, "severity": "critical", "opened_at": "x", "closed_at": None, "owner": EVIL, "subject": EVIL,
                              "detail": EVIL, "policy_version": EVIL}],
              "evidence": [{"control": 6, "title": EVIL, "summary": EVIL, "columns": ["step", EVIL], "rows": [{"step": EVIL, EVIL: EVIL}],
                            "more": 0}]}
    audit_page = audit_html(report)
    _assert_neutralised(audit_page)
    assert "<script" not in audit_page and "&lt;script&gt;alert(1)" in audit_page
