"""`gpuledger release …`: release lifecycle events from CI/CD pipelines, straight to Kafka.

Input: command-line flags — every shared identifier (``--release-id``, ``--model``,
``--version``, ``--artifact-digest``, ``--image-digest``, ``--config-digest``,
``--dataset``, ``--env``, ``--owner``, ``--data-class``), who and why (``--actor``,
``--approval-id``, ``--reason``, ``--tag k=v``), reservations (``--reservation-id``,
``--gpus``, ``--pool``, ``--window-start``, ``--window-end``), admin actions
(``--target``, ``--expires-at``) and the event time ``--at`` (default: now).
Output: one ``ReleaseEvent`` on the release topic, keyed by release_id, published
through the one ``EventPublisher``; its event id is printed on stdout.
Guarantees: the command exits 0 only once Kafka acknowledged the event (acks=all);
missing identifiers exit 2 naming every missing flag, before any I/O; ``event_id =
make_event_id("cli", (release_id, event_type, approval_id, env, target,
reservation_id), occurred_at)``, so a pipeline step retried with the same ``--at``
publishes the same id and downstream tables keep one row.
Limits: without ``--at`` every run is a new fact (new id): pass the pipeline's own
timestamp to make retries idempotent. Release events always need a release id, admin
actions included (the release on whose behalf the action was taken).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

import typer

from gpuledger.timefmt import TimeFormatError, parse_time
from producers._kafka import ProducerError
from schemas.envelope import Identity, Source, make_event_id
from schemas.release import ReleaseEvent, ReleasePayload, Reservation

COLLECTOR = "releases"
EVENT_ID_SOURCE = "cli"


@dataclass(frozen=True)
class ReleaseCommand:
    """One `gpuledger release <name>` subcommand."""

    name: str
    event_type: str
    required: tuple[str, ...]
    help: str
    scopes: frozenset[str] = frozenset()


_RESERVATION = frozenset({"reservation"})
_ADMIN = frozenset({"admin"})
_MOVE = frozenset({"move"})

COMMANDS: tuple[ReleaseCommand, ...] = (
    ReleaseCommand("register", "release.registered", ("release_id", "model", "version", "artifact_digest"), "A new release exists: model version + artifact (+ image, config, dataset)."),
    ReleaseCommand("evaluate", "release.evaluated", ("release_id",), "The release passed (or went through) evaluation."),
    ReleaseCommand("approve", "release.approved", ("release_id", "actor"), "Someone with the right approved the release (give --approval-id for the ticket)."),
    ReleaseCommand("promote", "release.promoted", ("release_id", "env"), "The release was promoted to an environment.", _MOVE),
    ReleaseCommand("rollback", "release.rolled_back", ("release_id", "env"), "The release was rolled back out of an environment.", _MOVE),
    ReleaseCommand("revoke", "release.revoked", ("release_id", "reason"), "The release must no longer run anywhere (say why)."),
    ReleaseCommand("retire", "release.retired", ("release_id",), "The release reached end of life; its GPUs should be freed."),
    ReleaseCommand("reserve", "release.reservation_created", ("release_id", "reservation_id", "gpus"), "GPU capacity was reserved for the release.", _RESERVATION),
    ReleaseCommand("unreserve", "release.reservation_released", ("release_id", "reservation_id"), "A reservation of the release was released.", _RESERVATION),
    ReleaseCommand("pause-queue", "release.queue_paused", ("release_id", "target", "actor"), "Admin action: a queue was paused (--target = queue).", _ADMIN),
    ReleaseCommand("isolate-node", "release.node_isolated", ("release_id", "target", "actor"), "Admin action: a node was isolated (--target = node).", _ADMIN),
    ReleaseCommand("override-priority", "release.priority_overridden", ("release_id", "target", "actor"), "Admin action: a workload's priority was overridden (--target = workload).", _ADMIN),
)

#: Flag of each option, for messages.
FLAGS = {
    "release_id": "--release-id", "model": "--model", "version": "--version", "artifact_digest": "--artifact-digest",
    "image_digest": "--image-digest", "config_digest": "--config-digest", "dataset": "--dataset", "env": "--env",
    "owner": "--owner", "data_class": "--data-class", "actor": "--actor", "approval_id": "--approval-id",
    "reason": "--reason", "superseded": "--superseded", "tag": "--tag", "reservation_id": "--reservation-id",
    "gpus": "--gpus", "pool": "--pool", "window_start": "--window-start", "window_end": "--window-end",
    "target": "--target", "expires_at": "--expires-at", "at": "--at",
}
_SCOPED = {
    "reservation": ("reservation_id", "gpus", "pool", "window_start", "window_end"),
    "admin": ("target", "expires_at"),
    "move": ("superseded",),
}


class ReleaseInputError(ProducerError):
    """Flags that cannot make a valid release event; the message lists every problem."""


def _time(flag: str, value: str | None, problems: list[str]) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(value, flag)
    except TimeFormatError as exc:
        problems.append(str(exc))
        return None


def build_event(command: ReleaseCommand, options: dict, observed_at: datetime | None = None, host: str | None = None) -> ReleaseEvent:
    """Turn one subcommand's flags into its event; raises ``ReleaseInputError`` listing every problem."""
    given = {k: v for k, v in options.items() if v not in (None, "", [], ())}
    problems = []
    missing = [FLAGS[name] for name in command.required if name not in given]
    if missing:
        problems.append(f"release {command.name} needs {', '.join(missing)}")
    for scope, names in _SCOPED.items():
        if scope not in command.scopes:
            stray = [FLAGS[n] for n in names if n in given]
            if stray:
                problems.append(f"{', '.join(stray)} do(es) not apply to release {command.name}")
    tags = {}
    for item in given.get("tag", []):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--tag: expected KEY=VALUE, got {item!r}")
        else:
            tags[key.strip()] = value.strip()
    occurred = _time("--at", given.get("at"), problems) or datetime.now(timezone.utc)
    window_start = _time("--window-start", given.get("window_start"), problems)
    window_end = _time("--window-end", given.get("window_end"), problems)
    expires_at = _time("--expires-at", given.get("expires_at"), problems)
    if window_start and window_end and window_end <= window_start:
        problems.append("--window-end must be after --window-start")
    if "gpus" in given and given["gpus"] < 0:
        problems.append("--gpus must be 0 or more")
    if problems:
        raise ReleaseInputError("; ".join(problems))

    identity = Identity(
        release_id=given["release_id"], model_name=given.get("model"), model_version=given.get("version"),
        artifact_digest=given.get("artifact_digest"), image_digest=given.get("image_digest"),
        config_digest=given.get("config_digest"), dataset_ref=given.get("dataset"), environment=given.get("env"),
        owner=given.get("owner"), data_class=given.get("data_class"),
        node=given.get("target") if command.event_type == "release.node_isolated" else None,
    )
    reservation = None
    if "reservation" in command.scopes:
        # Releasing a reservation does not always restate its size: 0 = "not stated".
        reservation = Reservation(reservation_id=given["reservation_id"], gpus=given.get("gpus", 0), pool=given.get("pool"),
                                  window_start=window_start, window_end=window_end)
    payload = ReleasePayload(
        actor=given.get("actor"), approval_id=given.get("approval_id"), reason=given.get("reason"),
        to_environment=given.get("env") if "move" in command.scopes else None,
        superseded_release_id=given.get("superseded"), reservation=reservation, target=given.get("target"),
        expires_at=expires_at, tags=tags,
    )
    natural_key = (given["release_id"], command.event_type, given.get("approval_id"), given.get("env"), given.get("target"), given.get("reservation_id"))
    return ReleaseEvent(
        event_id=make_event_id(EVENT_ID_SOURCE, natural_key, occurred.isoformat()),
        event_type=command.event_type,
        occurred_at=occurred,
        observed_at=observed_at or datetime.now(timezone.utc),
        source=Source(collector=COLLECTOR, host=host if host is not None else socket.gethostname()),
        identity=identity,
        payload=payload,
    )


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
        actor: Optional[str] = typer.Option(None, "--actor", help="Who did it (user, service account, CI job)."),
        approval_id: Optional[str] = typer.Option(None, "--approval-id", help="Change/approval ticket id."),
        reason: Optional[str] = typer.Option(None, "--reason", help="Why."),
        superseded: Optional[str] = typer.Option(None, "--superseded", help="promote/rollback: the release this one replaced (or that replaced it)."),
        tag: Optional[list[str]] = typer.Option(None, "--tag", help="Extra KEY=VALUE carried in the payload (repeatable)."),
        reservation_id: Optional[str] = typer.Option(None, "--reservation-id", help="reserve/unreserve: reservation id."),
        gpus: Optional[int] = typer.Option(None, "--gpus", help="reserve/unreserve: number of GPUs."),
        pool: Optional[str] = typer.Option(None, "--pool", help="reserve/unreserve: node pool / ClusterQueue / flavor."),
        window_start: Optional[str] = typer.Option(None, "--window-start", help="reserve: window start (RFC 3339)."),
        window_end: Optional[str] = typer.Option(None, "--window-end", help="reserve: window end (RFC 3339)."),
        target: Optional[str] = typer.Option(None, "--target", help="Admin actions: the queue, node or workload acted on."),
        expires_at: Optional[str] = typer.Option(None, "--expires-at", help="Admin actions: when the override expires (RFC 3339)."),
        at: Optional[str] = typer.Option(None, "--at", help="Event time (RFC 3339, default now); pass the pipeline's timestamp so retries keep one id."),
        bootstrap: Optional[str] = typer.Option(None, "--bootstrap", help="Kafka bootstrap servers (default: GPULEDGER_KAFKA_BOOTSTRAP, else the local broker)."),
    ) -> None:
        options = {name: value for name, value in locals().items() if name in FLAGS}
        from gpuledger.cli import err, fail, load_settings
        from producers._kafka import EventPublisher

        try:
            event = build_event(command, options)
        except ReleaseInputError as exc:
            fail(str(exc), 2)
        settings = load_settings(bootstrap)
        try:
            publisher = EventPublisher.from_settings(settings, "releases")
            publisher.publish_batch([event])
            publisher.close(5)
        except ProducerError as exc:
            fail(f"release {command.name} for {event.identity.release_id} not published: {exc}")
        err.print(f"published {event.event_type} for {event.identity.release_id}", highlight=False)
        print(event.event_id)

    run.__doc__ = command.help
    return run


def register(app: typer.Typer) -> None:
    """Add ``gpuledger release <command>``."""
    release_app = typer.Typer(no_args_is_help=True, help="Publish release lifecycle events (for CI/CD pipelines).")
    for command in COMMANDS:
        release_app.command(command.name, help=command.help)(_make_command(command))
    app.add_typer(release_app, name="release")
