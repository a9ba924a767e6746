"""`gpuledger kafka up|down|status`: the local Apache Kafka broker (development and tests)."""

from __future__ import annotations

import typer

from gpuledger.cli._common import err, fail, load_settings

app = typer.Typer(no_args_is_help=True, help="The local Apache Kafka broker (for development and tests).")


@app.command("up")
def kafka_up() -> None:
    """Start the local broker in the background; prints its bootstrap address last."""
    from gpuledger.dev.localkafka import LocalKafkaError, up

    settings = load_settings(local_broker=False)
    try:
        state = up(settings.data_dir, settings.cache_dir)
    except LocalKafkaError as exc:
        fail(str(exc))
    err.print(f"local Kafka running (pid {state['pid']}, log {state['log']})")
    print(state["bootstrap"])


@app.command("down")
def kafka_down() -> None:
    """Stop the local broker started by `kafka up`."""
    from gpuledger.dev.localkafka import down

    state = down(load_settings(local_broker=False).data_dir)
    print(f"stopped local Kafka at {state['bootstrap']}" if state else "no local Kafka running")


@app.command("status")
def kafka_status() -> None:
    """Say whether the local broker runs, and where."""
    from gpuledger.dev.localkafka import running_broker

    state = running_broker(load_settings(local_broker=False).data_dir)
    if not state:
        print("no local Kafka running")
        raise typer.Exit(3)
    print(f"running pid={state['pid']} log={state['log']}")
    print(state["bootstrap"])


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="kafka")
