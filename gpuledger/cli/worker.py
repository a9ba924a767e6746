"""`gpuledger worker`: the Faust worker (correlate, judge, store)."""

from __future__ import annotations

from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, DsnOpt, failing_on, load_settings


def worker(bootstrap: Optional[str] = BootstrapOpt, dsn: Optional[str] = DsnOpt,
           app_id: Optional[str] = typer.Option(None, "--app-id", help="Faust app id (consumer group)."),
           web_port: Optional[int] = typer.Option(None, "--web-port", help="Loopback port for health and read-only queries.")) -> None:
    """Run the Faust worker: correlate raw events and sink them into ClickHouse."""
    from gpuledger.settings import SettingsError
    from producers._errors import ProducerError
    from sinks.errors import SinkError
    from streams.app import run_worker
    from streams.controls.policy import PolicyError

    settings = load_settings(bootstrap, dsn, streams={"app_id": app_id, "web_port": web_port})
    with failing_on(PolicyError, SettingsError, code=2), failing_on(ProducerError, SinkError):
        run_worker(settings)


def register(root: typer.Typer) -> None:
    root.command("worker")(worker)
