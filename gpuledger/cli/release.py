"""`gpuledger release <command>`: publish one release lifecycle event (for CI/CD pipelines).

One subcommand per ``producers.releases.COMMANDS`` entry; each builds its event
(``producers.releases.build_event``: exit 2 naming every bad flag, before any I/O),
publishes it, waits for Kafka's ack and prints the event id.
"""

from __future__ import annotations

from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, err, fail, load_settings
from producers.releases import COMMANDS, FLAGS, ReleaseCommand

app = typer.Typer(no_args_is_help=True, help="Publish release lifecycle events (for CI/CD pipelines).")


def _make_command(command: ReleaseCommand):
    def run(
        release_id: Optional[str] = typer.Option(None, "--release-id", help="Release id (required by every command)."),
        model: Optional[str] = typer.Option(None, "--model", help="Model name as the registry names it."),
        version: Optional[str] = typer.Option(None, "--version", help="Model version as the registry names it."),
        artifact_digest: Optional[str] = typer.Option(None, "--artifact-digest", help="sha256 of the model artifact."),
        image_digest: Optional[str] = typer.Option(None, "--image-digest", help="Serving/training image digest, sha256:…"),
        config_digest: Optional[str] = typer.Option(None, "--config-digest", help="Serving/training config hash."),
        dataset: Optional[str] = typer.Option(None, "--dataset", help="Dataset reference."),
        env: Optional[str] = typer.Option(None, "--env", help="Environment (dev / eval / staging / prod); the target of promote/rollback."),
        owner: Optional[str] = typer.Option(None, "--owner", help="Accountable team."),
        data_class: Optional[str] = typer.Option(None, "--data-class", help="Data classification."),
        actor: Optional[str] = typer.Option(None, "--actor", help="Who did it (user, service account, CI job). Through the receiver the token names the actor: omit it, or give the token's identity."),
        on_behalf_of: Optional[str] = typer.Option(None, "--on-behalf-of", help="The person a service acts for (CI for the engineer who clicked); counts only with the policy's delegate right."),
        approval_id: Optional[str] = typer.Option(None, "--approval-id", help="Change/approval ticket id."),
        reason: Optional[str] = typer.Option(None, "--reason", help="Why."),
        superseded: Optional[str] = typer.Option(None, "--superseded", help="promote/rollback: the release this one replaced (or that replaced it)."),
        tag: Optional[list[str]] = typer.Option(None, "--tag", help="Extra KEY=VALUE carried in the payload (repeatable)."),
        reservation_id: Optional[str] = typer.Option(None, "--reservation-id", help="reserve/unreserve: reservation id."),
        gpus: Optional[int] = typer.Option(None, "--gpus", help="reserve/unreserve: number of GPUs."),
        pool: Optional[str] = typer.Option(None, "--pool", help="reserve/unreserve: node pool / ClusterQueue / flavor."),
        window_start: Optional[str] = typer.Option(None, "--window-start", help="reserve: window start (RFC 3339; no zone means UTC)."),
        window_end: Optional[str] = typer.Option(None, "--window-end", help="reserve: window end (RFC 3339; no zone means UTC)."),
        target: Optional[str] = typer.Option(None, "--target", help="Admin actions: the queue, node or workload acted on."),
        expires_at: Optional[str] = typer.Option(None, "--expires-at", help="Admin actions: when the override expires (RFC 3339; no zone means UTC)."),
        at: Optional[str] = typer.Option(None, "--at", help="Event time (RFC 3339, no zone means UTC; default now); pass the pipeline's timestamp so retries keep one id."),
        bootstrap: Optional[str] = BootstrapOpt,
    ) -> None:
        options = {name: value for name, value in locals().items() if name in FLAGS}
        from producers._errors import ProducerError
        from producers._kafka import EventPublisher
        from producers.release_sender import ReceiverRefused, send_through_receiver
        from producers.releases import ReleaseInputError, build_event
        from streams.controls.policy import ACTION_OF_EVENT

        settings = load_settings(bootstrap)
        sender = settings.release
        try:
            event = build_event(command, options, actor_from_credential=sender.through_receiver)
        except ReleaseInputError as exc:
            fail(str(exc), 2)
        what = f"release {command.name} for {event.identity.release_id}"
        if sender.through_receiver:
            try:
                event_id = send_through_receiver(sender, event)
            except ReceiverRefused as exc:
                fail(f"{what} refused: {exc}", 2)
            except ProducerError as exc:
                fail(f"{what} not published: {exc}")
            err.print(f"published {event.event_type} for {event.identity.release_id} through {sender.receiver_url} (authenticated)",
                      highlight=False)
            print(event_id)
            return
        try:
            publisher = EventPublisher.from_settings(settings, "releases")
            publisher.publish_batch([event])
            publisher.close(5)
        except ProducerError as exc:
            fail(f"{what} not published: {exc}")
        err.print(f"published {event.event_type} for {event.identity.release_id}", highlight=False)
        if event.event_type in ACTION_OF_EVENT:
            err.print("note: published straight to Kafka, so unauthenticated: under a policy with authentication.require_for_rights "
                      "it holds no right. Set GPULEDGER_RELEASE_RECEIVER_URL and GPULEDGER_RELEASE_TOKEN_FILE to send it through "
                      "the receiver as your identity.", highlight=False)
        print(event.event_id)

    run.__doc__ = command.help
    return run


for _command in COMMANDS:
    app.command(_command.name, help=_command.help)(_make_command(_command))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="release")
