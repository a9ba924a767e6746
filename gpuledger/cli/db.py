"""`gpuledger db migrate|status`: the ClickHouse correlation store's schema."""

from __future__ import annotations

from typing import Optional

import typer

from gpuledger.cli._common import DsnOpt, failing_on, load_settings

app = typer.Typer(no_args_is_help=True, help="The ClickHouse correlation store.")


@app.command("migrate")
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
    with failing_on(SinkError):
        client = connect(settings.clickhouse_dsn, conf.database)
        applied = migrate(client, conf.database, cluster, conf.ttl_days)
    print(f"applied {applied}" if applied else "schema up to date")


@app.command("status")
def db_status(dsn: Optional[str] = DsnOpt) -> None:
    """Applied migrations and the row count of every table (through the store's owner when it has one)."""
    from sinks.errors import SinkError
    from sinks.migrations import MIGRATIONS
    from sinks.read.query import open_reader

    settings = load_settings(dsn=dsn)
    db = settings.clickhouse.database
    with failing_on(SinkError):
        reader = open_reader(settings)
        applied = {r["version"] for r in reader.query("SELECT version FROM {db:Identifier}.schema_migrations FINAL", {"db": db}).dicts()}
        tables = reader.query("SELECT name, total_rows FROM system.tables WHERE database = {db:String} ORDER BY name", {"db": db}).dicts()
    for m in MIGRATIONS:
        print(f"migration {m.version}\t{'applied' if m.version in applied else 'PENDING'}\t{m.name}")
    for t in tables:
        print(f"{db}.{t['name']}\t{t['total_rows'] if t['total_rows'] is not None else '-'} rows (before FINAL)")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="db")
