"""The root ``gpuledger`` typer app: the global options, and every command group registered in order."""

from __future__ import annotations

import logging

import typer

from gpuledger.cli import audit, collect, db, exercise, kafka, read, receive, release, replay, schemas, topics, worker

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpuledger: one event-sourced history for GPU scheduling and model lifecycle.")


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO.")) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# One line per command module; the order is the order of `gpuledger --help`.
for _group in (kafka, topics, db, schemas, worker, read, audit, collect, receive, release, exercise, replay):
    _group.register(app)
