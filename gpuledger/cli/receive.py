"""`gpuledger receive`: the HTTP receiver (Alertmanager, MLflow and release webhooks into Kafka)."""

from __future__ import annotations

from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, err, failing_on, load_settings, run_component


def receive(
    host: Optional[str] = typer.Option(None, "--host", help="Listen address (default GPULEDGER_RECEIVER_HOST or 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, "--port", help="Listen port (default GPULEDGER_RECEIVER_PORT or 9095; 0 = any free port)."),
    bootstrap: Optional[str] = BootstrapOpt,
    allow_unauthenticated: bool = typer.Option(False, "--allow-unauthenticated",
                                               help="Serve on a non-loopback address with no credential configured (warned every minute)."),
) -> None:
    """Run the HTTP receiver: Alertmanager, MLflow and release events into Kafka."""
    from producers._errors import ProducerError
    from producers._kafka import EventPublisher
    from producers.receiver.server import ReceiverService

    settings = load_settings(bootstrap, receiver={"host": host, "port": port, "allow_unauthenticated": allow_unauthenticated or None})
    with failing_on(ProducerError):
        publisher = EventPublisher.from_settings(settings, "receiver", linger_ms=settings.receiver.linger_ms)

    def listening(bound_host: str, bound_port: int) -> None:
        err.print(f"gpuledger receiver listening on http://{bound_host}:{bound_port} → Kafka topics {settings.kafka.topic_prefix}.*", highlight=False)

    from streams.controls.policy import PolicyError

    with failing_on(PolicyError):
        policy = settings.policy.load()  # delegation rights and endpoints that require a credential
    service = ReceiverService(settings.receiver, publisher, settings.kafka.delivery_timeout_s + 5, listening, policy)
    run_component(service, "receiver")


def register(root: typer.Typer) -> None:
    root.command("receive")(receive)
