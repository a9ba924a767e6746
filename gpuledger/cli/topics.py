"""`gpuledger topics ensure`: the catalogue's Kafka topics, created idempotently."""

from __future__ import annotations

from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, failing_on, load_settings

app = typer.Typer(no_args_is_help=True, help="Kafka topics of the catalogue.")


@app.command("ensure")
def topics_ensure(bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Create the catalogue's topics that are missing (idempotent)."""
    from producers._errors import ProducerError
    from producers._kafka import client_config, ensure_topics

    settings = load_settings(bootstrap)
    with failing_on(ProducerError):
        created = ensure_topics(client_config(settings), settings.kafka.catalogue())
    for spec in settings.kafka.catalogue().specs():
        mark = "created" if spec.name in created else "exists"
        print(f"{spec.name}\t{spec.partitions} partitions\t{mark}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="topics")
