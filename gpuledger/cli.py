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
from rich.tree import Tree

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
    err.print(f"[bold red]error:[/] {message}", highlight=False)
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
def db_migrate(dsn: Optional[str] = DsnOpt, cluster: Optional[str] = typer.Option(None, "--cluster", help="ClickHouse cluster name (ON CLUSTER, Replicated*).")) -> None:
    """Apply pending schema migrations (idempotent)."""
    from sinks.clickhouse import connect
    from sinks.errors import SinkError
    from sinks.migrations import migrate

    settings = load_settings(dsn=dsn)
    try:
        client = connect(settings.clickhouse_dsn, settings.clickhouse.database)
        applied = migrate(client, settings.clickhouse.database, cluster or settings.clickhouse.cluster)
    except SinkError as exc:
        fail(str(exc))
    print(f"applied {applied}" if applied else "schema up to date")


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
    from producers._kafka import ProducerError
    from sinks.errors import SinkError
    from streams.app import run_worker

    settings = load_settings(bootstrap, dsn, streams={"app_id": app_id, "web_port": web_port})
    try:
        run_worker(settings)
    except (ProducerError, SinkError) as exc:
        fail(str(exc))


@app.command("sql")
def sql(query: str = typer.Argument(..., help="A SELECT query; read-only is enforced by ClickHouse."), dsn: Optional[str] = DsnOpt,
        fmt: str = typer.Option("table", "--format", help="table or json")) -> None:
    """Run a read-only SQL query against the store (through its owner when it has one)."""
    from rich.table import Table

    from sinks.errors import SinkError
    from sinks.query import open_reader

    settings = load_settings(dsn=dsn)
    try:
        reader = open_reader(settings)
        result = reader.query(query, {})
    except SinkError as exc:
        fail(str(exc))
    if fmt == "json":
        print(json.dumps(result.dicts(), indent=2, default=str))
        return
    table = Table(*result.columns)
    for row in result.rows:
        table.add_row(*[str(v) for v in row])
    console.print(table)


@app.command("trace")
def trace(alert: Optional[str] = typer.Option(None, "--alert", help="Alert fingerprint."),
          release: Optional[str] = typer.Option(None, "--release", help="Release id."),
          fmt: str = typer.Option("tree", "--format", help="tree (for people) or json (for tools)."),
          dsn: Optional[str] = DsnOpt) -> None:
    """Walk from an alert or a release to everything linked to it."""
    from sinks.errors import SinkError
    from sinks.query import open_reader
    from sinks.trace import trace_alert, trace_release

    if not (alert or release):
        fail("give an entry point: --alert FINGERPRINT or --release ID", 2)
    settings = load_settings(dsn=dsn)
    try:
        reader = open_reader(settings)
        db = settings.clickhouse.database
        result = trace_alert(reader, db, alert) if alert else trace_release(reader, db, release)
    except SinkError as exc:
        fail(str(exc))
    if fmt == "json":
        print(json.dumps(result, indent=2, default=str))
    else:
        console.print(render_tree(result))
    if (alert and result.get("alert") is None) or (release and not result["release"]["lifecycle"] and not result.get("alerts")):
        raise typer.Exit(4)


def render_tree(result: dict) -> Tree:
    alert = result.get("alert")
    rel = result.get("release")
    root = Tree(f"[bold]alert[/] {alert['summary']} at {alert['occurred_at']} (fingerprint {alert['fingerprint']})" if alert else "[bold]release trace[/]")
    if rel:
        node = root.add(f"[bold]release[/] {rel['release_id']}  state={rel.get('state') or '?'}")
        for field in ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "owner", "environment"):
            node.add(f"{field}: {rel.get(field) or '[red]<gap>[/]'}")
        life = node.add("lifecycle")
        for ev in rel.get("lifecycle", []):
            life.add(f"{ev['occurred_at']}  {ev['event_type']}  {ev.get('summary', '')}")
    elif alert:
        root.add("[red]release: <gap>[/]")
    for a in result.get("other_alerts", []) or result.get("alerts", []):
        root.add(f"[yellow]alert[/] {a['occurred_at']} {a.get('summary', '')}")
    for gap in result.get("gaps", []):
        root.add(f"[red]gap:[/] {gap}")
    return root


@app.command("demo")
def demo(keep: bool = typer.Option(False, "--keep", help="Leave the data dir for inspection (always kept; flag reserved).")) -> None:
    """The thin end-to-end path: local Kafka, a worker, sample events, and their trace."""
    from gpuledger.demo import run_demo

    settings = load_settings()
    code = run_demo(settings, console)
    raise typer.Exit(code)


# --- component commands ---------------------------------------------------------
# Each collector/component module exposes a `register(app)` that adds its commands.
# Keep one line per module here.
COMPONENT_COMMANDS: tuple[str, ...] = (
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
