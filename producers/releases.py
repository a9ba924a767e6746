"""Release lifecycle events from CI/CD pipelines (``gpuledger release …``): flags → one event.

Input: command-line flags — every shared identifier (``--release-id``, ``--model``,
``--version``, ``--artifact-digest``, ``--image-digest``, ``--config-digest``,
``--dataset``, ``--env``, ``--owner``, ``--data-class``), who and why (``--actor``,
``--approval-id``, ``--reason``, ``--tag k=v``), reservations (``--reservation-id``,
``--gpus``, ``--pool``, ``--window-start``, ``--window-end``), admin actions
(``--target``, ``--expires-at``) and the event time ``--at`` (default: now).
Output: one ``ReleaseEvent`` (``build_event``), which the command
(``gpuledger.cli.release``) publishes on the release topic, keyed by release_id, through
the one ``EventPublisher``, and whose event id it prints on stdout.
Guarantees: the command exits 0 only once Kafka acknowledged the event (acks=all);
missing identifiers exit 2 naming every missing flag, before any I/O; ``event_id =
make_event_id("cli", (release_id, event_type, approval_id, env, target,
reservation_id, "actor=…", "on_behalf_of=…"), occurred_at)`` (the last two only when given:
``deciders``), so a pipeline step retried with the same ``--at`` publishes the same id and
downstream tables keep one row, while another actor's same decision at that time is a fact of its own.
Limits: without ``--at`` every run is a new fact (new id): pass the pipeline's own
timestamp to make retries idempotent. Release events always need a release id, admin
actions included (the release on whose behalf the action was taken).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timezone

from pydantic import ValidationError

from gpuledger.timefmt import TimeFormatError, parse_time
from producers._errors import ProducerError
from schemas.envelope import MAX_FUTURE_SKEW, UINT32_MAX, Identity, Source, make_event_id
from schemas.release import ReleaseEvent, ReleasePayload, Reservation, actor_name_problem

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
    ReleaseCommand("override-admission", "release.admission_overridden", ("release_id", "target", "actor", "expires_at"),
                   "Emergency override: `gpuledger admit` lets the release's workloads matching --target (a workload id "
                   "namespace/Kind/name, an object namespace/name, or namespace/*) through until --expires-at.", _ADMIN),
)

#: Flag of each option, for messages.
FLAGS = {
    "release_id": "--release-id", "model": "--model", "version": "--version", "artifact_digest": "--artifact-digest",
    "image_digest": "--image-digest", "config_digest": "--config-digest", "dataset": "--dataset", "env": "--env",
    "owner": "--owner", "data_class": "--data-class", "actor": "--actor", "on_behalf_of": "--on-behalf-of", "approval_id": "--approval-id",
    "reason": "--reason", "superseded": "--superseded", "tag": "--tag", "reservation_id": "--reservation-id",
    "gpus": "--gpus", "pool": "--pool", "window_start": "--window-start", "window_end": "--window-end",
    "target": "--target", "expires_at": "--expires-at", "at": "--at",
}
_SCOPED = {
    "reservation": ("reservation_id", "gpus", "pool", "window_start", "window_end"),
    "admin": ("target", "expires_at"),
    "move": ("superseded",),
}


def release_natural_key(release_id: str, event_type: str, approval_id: str | None, environment: str | None,
                        target: str | None, reservation_id: str | None) -> tuple:
    """What identifies a release decision in its source, whoever publishes it (CLI or receiver)."""
    return (release_id, event_type, approval_id, environment, target, reservation_id)


def deciders(actor: str | None, on_behalf_of: str | None) -> tuple:
    """Who took a decision, as its event id names them (after the natural key): the same decision by
    another actor, or relayed for another person, is another fact. Without this, the documented
    pipeline (one ``--at`` for every step) gave an approval by ``ci/123`` and alice's ratification of
    it one id, and the tables kept whichever came first — control 7 never saw alice's. Empty for an
    event that names nobody, so those ids are what they were."""
    return tuple(f"{name}={value}" for name, value in (("actor", actor), ("on_behalf_of", on_behalf_of)) if value)


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


def build_event(command: ReleaseCommand, options: dict, observed_at: datetime | None = None, host: str | None = None,
                actor_from_credential: bool = False) -> ReleaseEvent:
    """Turn one subcommand's flags into its event; raises ``ReleaseInputError`` listing every problem.

    ``actor_from_credential``: the event goes through the receiver with a token, which names
    the actor, so ``--actor`` is not required (given, it must be the token's identity)."""
    given = {k: v for k, v in options.items() if v not in (None, "", [], ())}
    problems = []
    missing = [FLAGS[name] for name in command.required if name not in given and not (actor_from_credential and name == "actor")]
    if missing:
        problems.append(f"release {command.name} needs {', '.join(missing)}")
    if "on_behalf_of" in given and "actor" not in given and not actor_from_credential:
        # (stored with no actor, it read "someone for alice" and control 7 "  acted for alice")
        problems.append("--on-behalf-of names the person a service acts for: give the service as --actor "
                        "(through the receiver its token names it)")
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
    observed_at = observed_at or datetime.now(timezone.utc)
    if occurred - observed_at > MAX_FUTURE_SKEW:  # (``schemas.envelope.EventBase``: said here with the flag's name)
        problems.append(f"--at {given['at']} is in the future (now {observed_at.isoformat(timespec='seconds')}): a release event records "
                        f"what happened, at most {MAX_FUTURE_SKEW.total_seconds() / 60:.0f} min ahead of this clock")
    if window_start and window_end and window_end <= window_start:
        problems.append("--window-end must be after --window-start")
    if "gpus" in given and not 0 <= given["gpus"] <= UINT32_MAX:  # (``schemas.release.Reservation.gpus``)
        problems.append(f"--gpus must be from 0 to {UINT32_MAX:,}")
    for name in ("actor", "on_behalf_of"):  # (``schemas.release.ActorIdText``: 'ci>alice' is no delegation, --on-behalf-of is)
        problem = actor_name_problem(given[name]) if name in given else None
        if problem:
            problems.append(f"{FLAGS[name]}: {problem}")
    if problems:
        raise ReleaseInputError("; ".join(problems))

    try:
        return _event(command, given, occurred, window_start, window_end, expires_at, tags, observed_at, host)
    except ValidationError as exc:
        # A value the schema refuses (a control or bidi character in --release-id): the flag and why,
        # exit 2 — it was a pydantic traceback (exploratory review).
        raise ReleaseInputError("; ".join(f"{_flag_of(e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                                          for e in exc.errors(include_url=False))) from None


#: Schema fields → the flag that gives them (``_flag_of``).
_FIELD_OPTIONS = {"release_id": "release_id", "model_name": "model", "model_version": "version", "artifact_digest": "artifact_digest",
                  "image_digest": "image_digest", "config_digest": "config_digest", "dataset_ref": "dataset", "environment": "env",
                  "owner": "owner", "data_class": "data_class", "node": "target", "actor": "actor", "on_behalf_of": "on_behalf_of",
                  "approval_id": "approval_id", "reason": "reason", "to_environment": "env", "superseded_release_id": "superseded",
                  "target": "target", "reservation_id": "reservation_id", "pool": "pool", "gpus": "gpus", "tags": "tag"}


def _flag_of(loc: tuple) -> str:
    for part in reversed(loc):
        if isinstance(part, str) and _FIELD_OPTIONS.get(part) in FLAGS:
            return FLAGS[_FIELD_OPTIONS[part]]
    return ".".join(str(p) for p in loc)


def _event(command: ReleaseCommand, given: dict, occurred: datetime, window_start, window_end, expires_at, tags: dict,
           observed_at: datetime | None, host: str | None) -> ReleaseEvent:
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
        actor=given.get("actor"), on_behalf_of=given.get("on_behalf_of"), approval_id=given.get("approval_id"), reason=given.get("reason"),
        to_environment=given.get("env") if "move" in command.scopes else None,
        superseded_release_id=given.get("superseded"), reservation=reservation, target=given.get("target"),
        expires_at=expires_at, tags=tags,
    )
    natural_key = release_natural_key(given["release_id"], command.event_type, given.get("approval_id"), given.get("env"),
                                      given.get("target"), given.get("reservation_id"))
    return ReleaseEvent(
        event_id=make_event_id(EVENT_ID_SOURCE, (*natural_key, *deciders(given.get("actor"), given.get("on_behalf_of"))), occurred.isoformat()),
        event_type=command.event_type,
        occurred_at=occurred,
        observed_at=observed_at or datetime.now(timezone.utc),
        source=Source(collector=COLLECTOR, host=host if host is not None else socket.gethostname()),
        identity=identity,
        payload=payload,
    )
