"""`gpuledger audit`: the evidence report of the eight controls for a time range.

Exit codes (sinks.read.audit): 0 every exercised control passes, 1 a control fails, 2 bad
options or policy, 3 the store cannot be read, 4 nothing to audit (no control exercised)."""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer

from gpuledger.cli._common import DsnOpt, console, failing_on, load_settings


# The values of sinks.read.audit.FORMATS (tests/gpuledger/cli checks they agree).
class AuditFormat(str, Enum):
    table = "table"
    json = "json"
    html = "html"


def audit(
    start: Optional[str] = typer.Option(None, "--from", help="Start of the range (RFC 3339; no zone means UTC). Default: 24h before --to."),
    end: Optional[str] = typer.Option(None, "--to", help="End of the range, and the time the controls are evaluated as of. Default: now."),
    fmt: AuditFormat = typer.Option(AuditFormat.table, "--format", help="table, json or html. json lists every evidence row; table and html show 25 of a list, violations and denials first."),
    policy_file: Optional[str] = typer.Option(None, "--policy", help="Policy YAML for --reevaluate and the descriptive columns (default: GPULEDGER_POLICY_FILE, else the built-in default)."),
    reevaluate: bool = typer.Option(False, "--reevaluate", help="Re-run the controls over the stored history under --policy instead of reporting the violations the worker recorded (labelled RE-EVALUATION)."),
    lookback: str = typer.Option("30d", "--lookback", help="How much history before --from to read (workloads admitted earlier, reservations made earlier): 90s, 15m, 2h, 1d, 1h30m."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the report to this file instead of stdout."),
    dsn: Optional[str] = DsnOpt,
) -> None:
    """Evidence report of the eight controls from the violations they recorded: exit 0 pass, 1 a control fails, 4 nothing to audit."""
    from sinks.errors import SinkError
    from sinks.read.audit import AuditError, audit_range, build_report, load_history, write_report
    from sinks.read.query import open_reader
    from streams.controls.policy import PolicyError, load_policy

    with failing_on(AuditError, code=2):
        from_time, to_time, span = audit_range(start, end, lookback)
    settings = load_settings(dsn=dsn)
    path = policy_file or settings.policy.file
    with failing_on(PolicyError, code=2):
        policy = load_policy(path)
    with failing_on(SinkError, code=3):
        reader = open_reader(settings)
        history = load_history(reader, settings.clickhouse.database, from_time, to_time, span, settings.clickhouse.cluster)
    report = build_report(history, policy, from_time, to_time, str(path) if path else "built-in default", reevaluate=reevaluate)
    with failing_on(OSError, code=2, prefix=f"--output {output}: "):  # (not 1: that is "a control fails")
        write_report(report, fmt.value, output, console)
    if report["exit_code"]:
        raise typer.Exit(report["exit_code"])


def register(root: typer.Typer) -> None:
    root.command("audit")(audit)
