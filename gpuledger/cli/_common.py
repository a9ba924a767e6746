"""What every command shares: the consoles, the one error → exit mapping, settings loading, common options.

Exit codes: 0 done, 1 the component failed (Kafka, the store, a collector's source), 2 bad
flags, settings or policy, 3 the store cannot be read (``audit``), 4 nothing found (``trace``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn, Optional

import typer
from rich.console import Console

#: ``emoji=False``: rich replaced ``:name:`` in any printed text with an emoji — an OIDC identity
#: ``user:x:y`` printed as "user❌y", a release ``fraud:lock:7`` as "fraud🔒7" (``markup`` escapes
#: markup, not emoji codes). Every console of the CLI is made so.
console = Console(emoji=False)
err = Console(stderr=True, emoji=False)

BootstrapOpt = typer.Option(None, "--bootstrap", help="Kafka bootstrap servers (default: GPULEDGER_KAFKA_BOOTSTRAP, else the local broker).")
DsnOpt = typer.Option(None, "--dsn", help="ClickHouse DSN (default: GPULEDGER_CLICKHOUSE_DSN, else chdb under the data dir).")


def print_whole(table) -> None:
    """Print a rich table with every value whole: wider than the terminal when a value needs it
    (the terminal wraps the lines; a pipe or a file gets them as they are). At the console's width
    rich cut values with "…" — `gpuledger sql`'s fingerprints and GPU UUIDs, which a responder copies
    into `trace` — also when piped (80 columns there)."""
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    if need <= console.width:
        console.print(table)
        return
    # A console of that width on the same output (the shared one's width is not touched: set, it
    # would stay fixed rather than follow the terminal; print's own ``width`` only narrows).
    Console(file=console.file, width=need, force_terminal=console.is_terminal, color_system=console.color_system,
            no_color=console.no_color, emoji=False).print(table)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    from sinks.read.text import markup  # control and bidi characters of a message shown escaped, like stored text

    # (its own line breaks kept: a settings error lists one problem per line, they read as '\x0a')
    err.print(f"[bold red]error:[/] {markup(message, multiline=True)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def failing_on(*errors: type[BaseException], code: int = 1, prefix: str = "") -> Iterator[None]:
    """Turn ``errors`` raised inside the block into ``fail(prefix + str(exc), code)``."""
    try:
        yield
    except errors as exc:
        fail(f"{prefix}{exc}", code)


def load_settings(bootstrap: Optional[str] = None, dsn: Optional[str] = None, *, run: str | None = None,
                  local_broker: bool = True, **sections):
    """The root settings from env + flags (exit 2 listing every problem), telemetry set up.

    ``run`` names the section of the component about to run (its required fields are
    checked too). With ``local_broker`` and no bootstrap configured, the broker of
    ``gpuledger kafka up`` is used when one runs: that dev-only lookup lives here, not
    in the producers.
    """
    from gpuledger.settings import Settings, SettingsError
    from gpuledger.telemetry import setup_telemetry

    try:
        settings = Settings.load(run=run, kafka={"bootstrap": bootstrap, **sections.pop("kafka", {})},
                                 clickhouse={"dsn": dsn, **sections.pop("clickhouse", {})}, **sections)
    except SettingsError as exc:
        fail(str(exc), 2)
    if local_broker and not settings.kafka.bootstrap:
        from gpuledger.dev.localkafka import running_broker

        state = running_broker(settings.data_dir)
        if state:
            settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"bootstrap": state["bootstrap"]})})
    setup_telemetry(settings.telemetry)
    return settings


def run_component(component, what: str) -> None:
    """The lifecycle contract (``producers._runtime``): run until SIGTERM/SIGINT, flush, exit 0; errors exit 1."""
    from producers._errors import ProducerError
    from producers._runtime import run_until_signalled

    with failing_on(ProducerError, prefix=f"{what}: "):
        run_until_signalled(component)
