"""`gpuledger audit`: the evidence report of the eight controls for a time range (exit 1 when one fails)."""

from __future__ import annotations

import json
from datetime import timedelta
from enum import Enum
from typing import Optional

import typer

from gpuledger.cli._common import DsnOpt, console, fail, failing_on, load_settings


class AuditFormat(str, Enum):
    table = "table"
    json = "json"
    html = "html"


def audit(
    start: Optional[str] = typer.Option(None, "--from", help="Start of the range (RFC 3339; no zone means UTC). Default: 24h before --to."),
    end: Optional[str] = typer.Option(None, "--to", help="End of the range, and the time the controls are evaluated as of. Default: now."),
    fmt: AuditFormat = typer.Option(AuditFormat.table, "--format", help="table, json or html."),
    policy_file: Optional[str] = typer.Option(None, "--policy", help="Policy YAML (default: GPULEDGER_POLICY_FILE, else the built-in default)."),
    lookback: str = typer.Option("30d", "--lookback", help="How much history before --from to read (workloads admitted earlier, reservations made earlier): 90s, 15m, 2h, 1d, 1h30m."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the report to this file instead of stdout."),
    dsn: Optional[str] = DsnOpt,
) -> None:
    """Evidence report of the eight controls: PASS/FAIL per control; exit 1 when one fails."""
    from gpuledger.audit import build_report, load_history, render_html, render_table
    from gpuledger.timefmt import TimeFormatError, iso_z, parse_duration, parse_time
    from sinks.errors import SinkError
    from sinks.query import open_reader
    from streams.controls.policy import PolicyError, load_policy

    with failing_on(TimeFormatError, code=2):
        to_time = parse_time(end or "now", "--to")
        from_time = parse_time(start, "--from") if start else to_time - timedelta(hours=24)
        span = parse_duration(lookback, "--lookback")
    if from_time > to_time:
        fail(f"--from {iso_z(from_time)} is after --to {iso_z(to_time)}", 2)
    settings = load_settings(dsn=dsn)
    path = policy_file or settings.policy.file
    with failing_on(PolicyError, code=2):
        policy = load_policy(path)
    with failing_on(SinkError, code=3):
        reader = open_reader(settings)
        history = load_history(reader, settings.clickhouse.database, from_time, to_time, span, settings.clickhouse.cluster)
    report = build_report(history, policy, from_time, to_time, str(path) if path else "built-in default")
    if fmt is AuditFormat.table:
        if output:
            from rich.console import Console

            with open(output, "w") as handle:
                render_table(report, Console(file=handle, width=200))
        else:
            render_table(report, console)
    else:
        text = json.dumps(report, indent=2, default=str) if fmt is AuditFormat.json else render_html(report)
        if output:
            with open(output, "w") as handle:
                handle.write(text)
        else:
            print(text)
    if not report["passed"]:
        raise typer.Exit(1)


def register(root: typer.Typer) -> None:
    root.command("audit")(audit)
