"""The root ``gpuledger`` typer app: the global options, and every command group registered in order."""

from __future__ import annotations

import logging

import typer

# Each command group by its module path (importing them through the package would make
# gpuledger.cli and this module import each other).
import gpuledger.cli.admit as admit
import gpuledger.cli.audit as audit
import gpuledger.cli.collect as collect
import gpuledger.cli.db as db
import gpuledger.cli.dev as dev
import gpuledger.cli.exercise as exercise
import gpuledger.cli.kafka as kafka
import gpuledger.cli.read as read
import gpuledger.cli.receive as receive
import gpuledger.cli.release as release
import gpuledger.cli.replay as replay
import gpuledger.cli.schemas as schemas
import gpuledger.cli.topics as topics
import gpuledger.cli.worker as worker

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpuledger: one event-sourced history for GPU scheduling and model lifecycle.")


@app.callback()
def _root(ctx: typer.Context,
          verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO, the libraries' lines too (the worker, admit and "
                                                                        "the collectors log their own at INFO anyway).")) -> None:
    from gpuledger.telemetry import SERVICE_COMMANDS, log_format, log_levels

    root = logging.getLogger()
    before = list(root.handlers)
    command = ctx.invoked_subcommand or "gpuledger"
    logging.basicConfig(format=log_format(command))
    # Levels (a service's own INFO lines without -v: gpuledger.telemetry.OWN_LOGGERS) and a repeated
    # warning once a minute with a count, in every command (the receiver and the collectors
    # logged each Kafka reconnect attempt during an outage, ~7 lines a second; the worker did this already)
    # — on the handler set up here only: a host's own handlers (a test runner's capture) keep every line,
    # and its levels.
    if ours := [h for h in root.handlers if h not in before]:
        from gpuledger.telemetry import calm_logging

        log_levels(logging.INFO if verbose else logging.WARNING, service=command in SERVICE_COMMANDS)
        calm_logging(handlers=ours)


# One line per command module; the order is the order of `gpuledger --help`.
for _group in (kafka, topics, db, schemas, worker, read, audit, collect, receive, admit, release, exercise, replay, dev):
    _group.register(app)
