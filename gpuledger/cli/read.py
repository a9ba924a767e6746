"""`gpuledger sql` and `gpuledger trace`: the read side of the store, for people and tools."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from gpuledger.cli._common import DsnOpt, console, err, fail, failing_on, load_settings, print_whole


class SqlFormat(str, Enum):
    table = "table"
    json = "json"


class TraceFormat(str, Enum):
    tree = "tree"
    json = "json"
    html = "html"


def sql(query: str = typer.Argument(..., help="A SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS statement; read-only is enforced by ClickHouse."),
        dsn: Optional[str] = DsnOpt,
        fmt: SqlFormat = typer.Option(SqlFormat.table, "--format", help="table (for people) or json (for tools).")) -> None:
    """Run a read-only SQL statement against the store (through its owner when it has one)."""
    from rich.table import Table

    from sinks.errors import SinkError
    from sinks.read.query import open_reader
    from sinks.read.text import markup

    settings = load_settings(dsn=dsn)
    with failing_on(SinkError):
        reader = open_reader(settings)
        result = reader.query(query, {})
    if fmt is SqlFormat.json:
        print(json.dumps(result.dicts(), indent=2, default=str))
        return
    table = Table(*[markup(c) for c in result.columns])
    for row in result.rows:
        table.add_row(*["[dim]NULL[/]" if v is None else markup(str(v)) for v in row])  # (SQL's NULL, not Python's None)
    print_whole(table)  # a value is never cut (with "…", at the terminal's width)


def trace(alert: Optional[str] = typer.Option(None, "--alert", help="Alert fingerprint."),
          release: Optional[str] = typer.Option(None, "--release", help="Release id."),
          workload: Optional[str] = typer.Option(None, "--workload", help="Workload id: NAMESPACE/NAME of the Kueue Workload (job-…), else NAMESPACE/KIND/NAME of the owning Job, JobSet… — as `trace --pod` shows it. An id no row has (NAMESPACE/NAME of a Job) is taken as the one workload of that namespace and name, if there is one (several: listed)."),
          pod: Optional[str] = typer.Option(None, "--pod", help="Pod as NAMESPACE/NAME."),
          gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU as NODE/GPU_ID with the device id the pod-resources API reported (GPU-… UUID, MIG-…), or as NODE/INDEX with the DCGM index when a DCGM alert in the store maps it (its gpu and UUID labels): the allocation holding it at --at, else the latest."),
          model: Optional[str] = typer.Option(None, "--model", help="Model as NAME[:VERSION] (its most recently active release)."),
          at: Optional[str] = typer.Option(None, "--at", help="State as of this time (RFC 3339; no zone means UTC)."),
          window: str = typer.Option("2h", "--window", help="How far back from --at (else from the entry's own time: an alert's startsAt, a workload's or pod's latest event) to look for other alerts, scheduler events and GPU holders on the chain's nodes (for --release, --model, --gpu without --at: from the chain's latest event): 90s, 15m, 2h, 1d, 1h30m; 0 for none."),
          fmt: TraceFormat = typer.Option(TraceFormat.tree, "--format", help="tree (for people), json (for tools) or html (the incident timeline report: one self-contained file)."),
          output: Optional[Path] = typer.Option(None, "--output", help="--format html: write the report to this file instead of stdout."),
          dsn: Optional[str] = DsnOpt) -> None:
    """The responder's chain: alert → release manifest → workloads → pods → nodes/GPUs → scheduler events and alerts → the controls' violations about it.

    Exit codes: 0 a chain; 4 the entry point matches nothing in the store (as of --at); 2 bad options; 1 the store cannot be read."""
    from gpuledger.timefmt import TimeFormatError, parse_duration, parse_time
    from sinks.errors import SinkError
    from sinks.read.query import open_reader
    from sinks.read.trace import TraceError, check_entry, found
    from sinks.read.trace import trace as run_trace
    from sinks.read.tree import render_tree

    entries = [(k, v) for k, v in (("alert", alert), ("release", release), ("workload", workload), ("pod", pod), ("gpu", gpu),
                                   ("model", model)) if v]
    if len(entries) != 1:
        fail("give exactly one entry point: --alert FP, --release ID, --workload ID, --pod NS/NAME, --gpu NODE/GPU_ID or --model NAME[:VERSION]", 2)
    if output and fmt is not TraceFormat.html:
        fail("--output goes with --format html", 2)
    with failing_on(TimeFormatError, code=2):
        at_time = parse_time(at, "--at") if at else None
        span = parse_duration(window, "--window")
    with failing_on(TraceError, code=2):
        check_entry(*entries[0])
    settings = load_settings(dsn=dsn)
    with failing_on(TraceError, code=2), failing_on(SinkError):
        reader = open_reader(settings)
        result = run_trace(reader, settings.clickhouse.database, *entries[0], at=at_time, window=span, cluster=settings.clickhouse.cluster)
    if fmt is TraceFormat.json:
        print(json.dumps(result, indent=2, default=str))
    elif fmt is TraceFormat.html:
        from sinks.read.report import trace_report

        with failing_on(SinkError):
            page = trace_report(reader, settings.clickhouse.database, result, chain_text=render_tree(result), until=at_time,
                                cluster=settings.clickhouse.cluster)
        if output:
            with failing_on(OSError, code=2, prefix=f"--output {output}: "):
                output.write_text(page)
            err.print(f"report written to {output}", highlight=False)
        else:
            print(page)
    else:
        console.print(render_tree(result), highlight=False)
    if not found(result):
        raise typer.Exit(4)


def register(root: typer.Typer) -> None:
    root.command("sql")(sql)
    root.command("trace")(trace)
