"""`gpuledger`: the one command in front of every component.

Only this module catches errors and turns them into clean, non-zero exits.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from gpuledger.settings import Settings, SettingsError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpuledger: one event-sourced history for GPU scheduling and model lifecycle.")
kafka_app = typer.Typer(no_args_is_help=True, help="The local Apache Kafka broker (for development and tests).")
topics_app = typer.Typer(no_args_is_help=True, help="Kafka topics of the catalogue.")
db_app = typer.Typer(no_args_is_help=True, help="The ClickHouse correlation store.")
schemas_app = typer.Typer(no_args_is_help=True, help="The shared event schemas.")
app.add_typer(kafka_app, name="kafka")
app.add_typer(topics_app, name="topics")
app.add_typer(db_app, name="db")
app.add_typer(schemas_app, name="schemas")

console = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def load_settings(bootstrap: Optional[str] = None, dsn: Optional[str] = None, **areas) -> Settings:
    try:
        settings = Settings.load(kafka={"bootstrap": bootstrap, **areas.pop("kafka", {})}, clickhouse={"dsn": dsn, **areas.pop("clickhouse", {})}, **areas)
    except SettingsError as exc:
        fail(str(exc), 2)
    from gpuledger.telemetry import setup_telemetry

    setup_telemetry(settings.telemetry)
    return settings


BootstrapOpt = typer.Option(None, "--bootstrap", help="Kafka bootstrap servers (default: GPULEDGER_KAFKA_BOOTSTRAP, else the local broker).")
DsnOpt = typer.Option(None, "--dsn", help="ClickHouse DSN (default: GPULEDGER_CLICKHOUSE_DSN, else chdb under the data dir).")


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO.")) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# --- kafka -----------------------------------------------------------------------

@kafka_app.command("up")
def kafka_up() -> None:
    """Start the local broker in the background; prints its bootstrap address last."""
    from gpuledger.localkafka import LocalKafkaError, up

    settings = load_settings()
    try:
        state = up(settings.data_dir, settings.cache_dir)
    except LocalKafkaError as exc:
        fail(str(exc))
    err.print(f"local Kafka running (pid {state['pid']}, log {state['log']})")
    print(state["bootstrap"])


@kafka_app.command("down")
def kafka_down() -> None:
    """Stop the local broker started by `kafka up`."""
    from gpuledger.localkafka import down

    state = down(load_settings().data_dir)
    print(f"stopped local Kafka at {state['bootstrap']}" if state else "no local Kafka running")


@kafka_app.command("status")
def kafka_status() -> None:
    """Say whether the local broker runs, and where."""
    from gpuledger.localkafka import running_broker

    state = running_broker(load_settings().data_dir)
    if not state:
        print("no local Kafka running")
        raise typer.Exit(3)
    print(f"running pid={state['pid']} log={state['log']}")
    print(state["bootstrap"])


# --- topics / db / schemas ---------------------------------------------------------

@topics_app.command("ensure")
def topics_ensure(bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Create the catalogue's topics that are missing (idempotent)."""
    from producers._kafka import ProducerError, client_config, ensure_topics

    settings = load_settings(bootstrap)
    try:
        created = ensure_topics(client_config(settings), settings.kafka.catalogue())
    except ProducerError as exc:
        fail(str(exc))
    for spec in settings.kafka.catalogue().specs():
        mark = "created" if spec.name in created else "exists"
        print(f"{spec.name}\t{spec.partitions} partitions\t{mark}")


@db_app.command("migrate")
def db_migrate(dsn: Optional[str] = DsnOpt,
               cluster: Optional[str] = typer.Option(None, "--cluster", help="ClickHouse cluster name (ON CLUSTER, Replicated*, <table>_dist Distributed tables)."),
               print_only: bool = typer.Option(False, "--print", help="Print the SQL every migration renders to (and the TTL statements) without connecting.")) -> None:
    """Apply pending schema migrations and the configured TTL (idempotent, recorded in schema_migrations)."""
    from sinks.clickhouse import connect
    from sinks.errors import SinkError
    from sinks.migrations import migrate, rendered

    settings = load_settings(dsn=dsn)
    conf = settings.clickhouse
    cluster = cluster or conf.cluster
    if print_only:
        for version, sql in rendered(conf.database, cluster, conf.ttl_days):
            label = {0: "bootstrap", -1: "ttl"}.get(version, f"migration {version}")
            print(f"-- {label}\n{sql};\n")
        return
    try:
        client = connect(settings.clickhouse_dsn, conf.database)
        applied = migrate(client, conf.database, cluster, conf.ttl_days)
    except SinkError as exc:
        fail(str(exc))
    print(f"applied {applied}" if applied else "schema up to date")


@db_app.command("status")
def db_status(dsn: Optional[str] = DsnOpt) -> None:
    """Applied migrations and the row count of every table (through the store's owner when it has one)."""
    from sinks.errors import SinkError
    from sinks.migrations import MIGRATIONS
    from sinks.read.query import open_reader

    settings = load_settings(dsn=dsn)
    db = settings.clickhouse.database
    try:
        reader = open_reader(settings)
        applied = {r["version"] for r in reader.query("SELECT version FROM {db:Identifier}.schema_migrations FINAL", {"db": db}).dicts()}
        tables = reader.query("SELECT name, total_rows FROM system.tables WHERE database = {db:String} ORDER BY name", {"db": db}).dicts()
    except SinkError as exc:
        fail(str(exc))
    for m in MIGRATIONS:
        print(f"migration {m.version}\t{'applied' if m.version in applied else 'PENDING'}\t{m.name}")
    for t in tables:
        print(f"{db}.{t['name']}\t{t['total_rows'] if t['total_rows'] is not None else '-'} rows (before FINAL)")


@schemas_app.command("generate")
def schemas_generate(check: bool = typer.Option(False, "--check", help="Fail if the committed files differ instead of writing.")) -> None:
    """Write JSON Schema files under schemas/json/ from the pydantic models."""
    from schemas.jsonschema import write_all

    changed = write_all(check=check)
    if check and changed:
        fail("JSON Schema files are out of date: " + ", ".join(changed) + " (run `gpuledger schemas generate`)")
    print("\n".join(changed) if changed else "schemas up to date")


# --- worker / query ------------------------------------------------------------------

@app.command("worker")
def worker(bootstrap: Optional[str] = BootstrapOpt, dsn: Optional[str] = DsnOpt,
           app_id: Optional[str] = typer.Option(None, "--app-id", help="Faust app id (consumer group)."),
           web_port: Optional[int] = typer.Option(None, "--web-port", help="Loopback port for health and read-only queries.")) -> None:
    """Run the Faust worker: correlate raw events and sink them into ClickHouse."""
    from gpuledger.policy import PolicyError
    from producers._kafka import ProducerError
    from sinks.errors import SinkError
    from streams.app import run_worker

    settings = load_settings(bootstrap, dsn, streams={"app_id": app_id, "web_port": web_port})
    try:
        run_worker(settings)
    except PolicyError as exc:
        fail(str(exc), 2)
    except (ProducerError, SinkError) as exc:
        fail(str(exc))


@app.command("sql")
def sql(query: str = typer.Argument(..., help="A SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS statement; read-only is enforced by ClickHouse."),
        dsn: Optional[str] = DsnOpt, fmt: str = typer.Option("table", "--format", help="table or json")) -> None:
    """Run a read-only SQL statement against the store (through its owner when it has one)."""
    from rich.table import Table

    from sinks.errors import SinkError
    from sinks.read.query import open_reader
    from sinks.read.text import markup

    settings = load_settings(dsn=dsn)
    try:
        reader = open_reader(settings)
        result = reader.query(query, {})
    except SinkError as exc:
        fail(str(exc))
    if fmt == "json":
        print(json.dumps(result.dicts(), indent=2, default=str))
        return
    table = Table(*[markup(c) for c in result.columns])
    for row in result.rows:
        table.add_row(*[markup(str(v)) for v in row])
    console.print(table)


@app.command("trace")
def trace(alert: Optional[str] = typer.Option(None, "--alert", help="Alert fingerprint."),
          release: Optional[str] = typer.Option(None, "--release", help="Release id."),
          workload: Optional[str] = typer.Option(None, "--workload", help="Workload id."),
          pod: Optional[str] = typer.Option(None, "--pod", help="Pod as NAMESPACE/NAME."),
          gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU as NODE/GPU_ID (the allocation holding it at --at, else the latest)."),
          model: Optional[str] = typer.Option(None, "--model", help="Model as NAME[:VERSION] (its most recently active release)."),
          at: Optional[str] = typer.Option(None, "--at", help="State as of this time (ISO 8601; no zone means UTC)."),
          window: str = typer.Option("2h", "--window", help="How far back from --at (else the chain's latest event) to look for other alerts and scheduler events: 90s, 15m, 2h, 1d."),
          fmt: str = typer.Option("tree", "--format", help="tree (for people), json (for tools) or html (the incident timeline report: one self-contained file)."),
          output: Optional[Path] = typer.Option(None, "--output", help="--format html: write the report to this file instead of stdout."),
          dsn: Optional[str] = DsnOpt) -> None:
    """The responder's chain: alert → release manifest → workloads → pods → nodes/GPUs → scheduler events and alerts."""
    from sinks.errors import SinkError
    from sinks.read.query import open_reader
    from sinks.read.trace import TraceError, found, parse_time, parse_window
    from sinks.read.trace import trace as run_trace
    from sinks.read.tree import render_tree

    entries = [(k, v) for k, v in (("alert", alert), ("release", release), ("workload", workload), ("pod", pod), ("gpu", gpu),
                                   ("model", model)) if v]
    if len(entries) != 1:
        fail("give exactly one entry point: --alert FP, --release ID, --workload ID, --pod NS/NAME, --gpu NODE/GPU_ID or --model NAME[:VERSION]", 2)
    if fmt not in ("tree", "json", "html"):
        fail(f"--format must be tree, json or html, got {fmt!r}", 2)
    if output and fmt != "html":
        fail("--output goes with --format html", 2)
    try:
        at_time = parse_time(at) if at else None
        span = parse_window(window)
    except TraceError as exc:
        fail(str(exc), 2)
    settings = load_settings(dsn=dsn)
    try:
        reader = open_reader(settings)
        result = run_trace(reader, settings.clickhouse.database, *entries[0], at=at_time, window=span, cluster=settings.clickhouse.cluster)
    except TraceError as exc:
        fail(str(exc), 2)
    except SinkError as exc:
        fail(str(exc))
    if fmt == "json":
        print(json.dumps(result, indent=2, default=str))
    elif fmt == "html":
        from sinks.read.report import trace_report

        try:
            page = trace_report(reader, settings.clickhouse.database, result, chain_text=render_tree(result), until=at_time,
                                cluster=settings.clickhouse.cluster)
        except SinkError as exc:
            fail(str(exc))
        if output:
            output.write_text(page)
            err.print(f"report written to {output}", highlight=False)
        else:
            print(page)
    else:
        console.print(render_tree(result), highlight=False)
    if not found(result):
        raise typer.Exit(4)


@app.command("audit")
def audit(start: Optional[str] = typer.Option(None, "--from", help="Start of the range (ISO 8601; no zone means UTC). Default: 24h before --to."),
          end: Optional[str] = typer.Option(None, "--to", help="End of the range, and the time the controls are evaluated as of. Default: now."),
          fmt: str = typer.Option("table", "--format", help="table, json or html."),
          policy_file: Optional[str] = typer.Option(None, "--policy", help="Policy YAML (default: GPULEDGER_POLICY_FILE, else the built-in default)."),
          lookback: str = typer.Option("30d", "--lookback", help="How much history before --from to read (workloads admitted earlier, reservations made earlier)."),
          output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the report to this file instead of stdout."),
          dsn: Optional[str] = DsnOpt) -> None:
    """Evidence report of the eight controls: PASS/FAIL per control; exit 1 when one fails."""
    from gpuledger.policy import PolicyError, PolicySettings, load_policy
    from sinks.errors import SinkError
    from sinks.read.audit import FORMATS, AuditError, audit_range, build_report, load_history, write_report
    from sinks.read.query import open_reader

    if fmt not in FORMATS:
        fail(f"--format must be table, json or html, got {fmt!r}", 2)
    try:
        from_time, to_time, span = audit_range(start, end, lookback)
        path = policy_file or PolicySettings().file
        policy = load_policy(path)
    except (AuditError, PolicyError) as exc:
        fail(str(exc), 2)
    settings = load_settings(dsn=dsn)
    try:
        reader = open_reader(settings)
        history = load_history(reader, settings.clickhouse.database, from_time, to_time, span, settings.clickhouse.cluster)
    except SinkError as exc:
        fail(str(exc), 3)
    report = build_report(history, policy, from_time, to_time, str(path) if path else "built-in default")
    write_report(report, fmt, output, console)
    if not report["passed"]:
        raise typer.Exit(1)


@app.command("demo")
def demo(keep: bool = typer.Option(False, "--keep", help="Leave the data dir for inspection (always kept; flag reserved).")) -> None:
    """What `make demo` runs: the incident-rollback exercise (local Kafka, the real collectors, worker and store, a simulated cluster)."""
    from gpuledger.exercise import run_exercise

    settings = load_settings()
    raise typer.Exit(run_exercise(settings, "incident-rollback", console).exit_code)


# --- component commands ---------------------------------------------------------
# Each collector/component module exposes a `register(app)` that adds its commands.
# Keep one line per module here.
COMPONENT_COMMANDS: tuple[str, ...] = (
    "producers.receiver",
    "producers.releases",
    "producers.podresources",
    "producers.kubernetes",
    "gpuledger.exercise",
    "gpuledger.replay",
)


def _register_components() -> None:
    import importlib

    for module in COMPONENT_COMMANDS:
        importlib.import_module(module).register(app)


_register_components()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
