"""Release family: the model lifecycle plane, from registries, CI and admins.

Published by the receiver and the ``gpuledger release`` CLI, keyed by release_id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import Field, model_validator

from schemas.envelope import Count32, EventBase, Frozen, IdText, UtcDatetime

ReleaseEventType = Literal[
    "release.registered",
    "release.evaluated",
    "release.approved",
    "release.promoted",
    "release.rolled_back",
    "release.revoked",
    "release.retired",
    "release.reservation_created",
    "release.reservation_released",
    "release.queue_paused",
    "release.node_isolated",
    "release.priority_overridden",
    "release.admission_overridden",
]

#: Admin actions: decisions that need a named right in the policy file.
ADMIN_ACTIONS = frozenset({"release.queue_paused", "release.node_isolated", "release.priority_overridden", "release.admission_overridden"})
#: The release's own lifecycle (registered … retired): the other events — reservations and admin
#: actions — happen to a release in any state.
LIFECYCLE_EVENTS = frozenset(get_args(ReleaseEventType)) - ADMIN_ACTIONS - {"release.reservation_created", "release.reservation_released"}
#: Lifecycle events after which a release no longer serves where it was (the environment it is
#: rolled back out of, or anywhere once revoked or retired).
ENDING_EVENTS = frozenset({"release.rolled_back", "release.revoked", "release.retired"})


class Reservation(Frozen):
    """Capacity reserved for a release."""

    reservation_id: IdText = Field(description="Reservation id.")
    gpus: Count32 = Field(description="Number of GPUs reserved.")
    pool: IdText | None = Field(default=None, description="Node pool / ClusterQueue / flavor holding the GPUs.")
    window_start: UtcDatetime | None = Field(default=None, description="Start of the reservation window.")
    window_end: UtcDatetime | None = Field(default=None, description="End of the reservation window.")


class ReleasePayload(Frozen):
    """What happened to a release, by whom."""

    actor: IdText | None = Field(default=None, description="Who did it: the authenticated caller (e.g. 'user:alice', 'service:ci-gitlab') when authenticated_by is set, else the name the publisher typed.")
    on_behalf_of: IdText | None = Field(default=None, description="The person a service acted for (CI for the engineer who clicked); counts only if the policy gives the actor the 'delegate' right.")
    authenticated_by: IdText | None = Field(default=None, description="How the receiver proved the actor: 'token' (credentials file), 'oidc' (JWT), 'mlflow-webhook' (signed delivery), 'shared-token'; null = unauthenticated (e.g. the CLI straight to Kafka).")
    actor_groups: tuple[IdText, ...] = Field(default=(), description="Groups of the authenticated actor (credentials file or the token's groups claim).")
    approval_id: IdText | None = Field(default=None, description="Change/approval ticket id.")
    reason: str | None = Field(default=None, description="Free-text reason.")
    to_environment: IdText | None = Field(default=None, description="Target environment of a promotion/rollback.")
    superseded_release_id: IdText | None = Field(default=None, description="Release this one replaced (promotion) or that replaced it (rollback).")
    reservation: Reservation | None = Field(default=None, description="Reservation created or released.")
    target: IdText | None = Field(default=None, description="Admin action target: queue, node or workload name.")
    expires_at: UtcDatetime | None = Field(default=None, description="Expiry of an emergency override.")
    tags: dict[str, str] = Field(default_factory=dict, description="Registry tags/aliases carried along.")


#: Prefix of a decision actor whose identity no credential proved (see ``decision_actor``).
UNAUTHENTICATED = "unauthenticated:"
#: Separates the authenticated groups in a ``decision_actor`` string. A control character, so
#: it can occur in no actor, person or group name (``IdText`` refuses control characters).
GROUP_SEPARATOR = "\x1f"


@dataclass(frozen=True)
class Decision:
    """A ``decision_actor`` string taken apart (``parse_decision``)."""

    proven: bool  # a credential proved ``actor`` (the receiver set ``authenticated_by``)
    actor: str  # who published it: the person, or the service acting for ``person``; "" if none named
    person: str | None  # ``on_behalf_of``: the person a service acted for
    groups: tuple[str, ...]  # the authenticated groups of ``actor`` (never of ``person``); () when not proven


def parse_decision(decision: str) -> Decision:
    """The parts of a ``decision_actor`` string."""
    proven = not decision.startswith(UNAUTHENTICATED)
    who, *groups = decision.removeprefix(UNAUTHENTICATED).split(GROUP_SEPARATOR)
    service, delegated, person = who.rpartition(">")
    if delegated:
        return Decision(proven, service, person, tuple(groups))
    return Decision(proven, who, None, tuple(groups))


def actor_text(decision: str | None) -> str | None:
    """A ``decision_actor`` string for people: ``mallory (unauthenticated)``, ``ci for alice``."""
    if not decision:
        return None
    d = parse_decision(decision)
    text = f"{d.actor or 'someone'} for {d.person}" if d.person else d.actor
    return text + ("" if d.proven else " (unauthenticated)")


def decision_actor(payload) -> str | None:
    """The one string the decision-rights checks judge, from a payload (model or dict).

    ``actor`` alone when it was authenticated, ``actor>on_behalf_of`` for a delegation, and
    either prefixed with ``unauthenticated:`` when no credential proved it. A proven actor's
    ``actor_groups`` follow, each after ``GROUP_SEPARATOR`` (sorted, so the string is the same
    whatever order the credential listed them in); an unproven event's groups are dropped —
    only the receiver vouches for groups. ``Policy.allowed`` reads this form back
    (``parse_decision``); None when the event names no actor at all.
    """
    get = payload.get if isinstance(payload, dict) else (lambda name: getattr(payload, name))
    actor, person = get("actor"), get("on_behalf_of")
    if not actor and not person:
        return None
    who = f"{actor or ''}>{person}" if person else actor
    if not get("authenticated_by"):
        return UNAUTHENTICATED + who
    return who + "".join(GROUP_SEPARATOR + g for g in sorted(set(get("actor_groups") or ())))


class ReleaseEvent(EventBase):
    """One lifecycle event of a model release."""

    event_type: ReleaseEventType
    payload: ReleasePayload = Field(default_factory=ReleasePayload)

    @model_validator(mode="after")
    def _required_identity(self):
        ident = self.identity
        if not (ident.release_id):
            raise ValueError("identity.release_id is required for release events")
        return self
