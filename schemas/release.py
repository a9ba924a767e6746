"""Release family: the model lifecycle plane, from registries, CI and admins.

Published by the receiver and the ``gpuledger release`` CLI, keyed by release_id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from pydantic import Field, model_validator

from schemas.envelope import Count32, EventBase, Frozen, IdText, UtcDatetime, identity_text_problem, refusing

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


# The markers of a ``decision_actor`` string, the one form the decision-rights checks read back
# (``parse_decision``). Each is unambiguous only because no name in the string can carry it.
#: Prefix of a decision actor whose identity no credential proved: no ``ActorIdText`` starts with it.
UNAUTHENTICATED = "unauthenticated:"
#: Between a service and the person it acted for (``actor>on_behalf_of``): no ``ActorIdText`` contains it.
DELEGATED = ">"
#: Before each authenticated group: a control character, which no ``IdText`` contains.
GROUP_SEPARATOR = "\x1f"


def actor_name_problem(value: str) -> str | None:
    """Why ``value`` cannot be an actor, a person acted for or an actor's group, or None.

    Besides an identifier's rule (``identity_text_problem``): a '>' in a name was read as a
    delegation — a token for 'mallory>alice' was judged as 'user:mallory' acting for alice,
    though nobody had named alice in ``on_behalf_of`` and no delegate right was checked — and a
    name starting with 'unauthenticated:' would read as unproven."""
    problem = identity_text_problem(value)
    if problem:
        return problem
    if DELEGATED in value:
        return (f"contains '>' at position {value.index(DELEGATED)}; '>' cannot be in an actor, on_behalf_of or group name: "
                "it separates a service from the person it acted for in the decision the controls judge")
    if value.startswith(UNAUTHENTICATED):
        return f"starts with {UNAUTHENTICATED!r}, which marks an actor no credential proved in the decision the controls judge"
    return None


#: An actor, person or group name (``ReleasePayload``): an ``IdText`` that also keeps clear of the
#: separators of ``decision_actor`` ('>' anywhere, 'unauthenticated:' at the start).
ActorIdText = Annotated[str, refusing(actor_name_problem)]


class Reservation(Frozen):
    """Capacity reserved for a release."""

    reservation_id: IdText = Field(description="Reservation id.")
    gpus: Count32 = Field(description="Number of GPUs reserved.")
    pool: IdText | None = Field(default=None, description="Node pool / ClusterQueue / flavor holding the GPUs.")
    window_start: UtcDatetime | None = Field(default=None, description="Start of the reservation window.")
    window_end: UtcDatetime | None = Field(default=None, description="End of the reservation window.")


class ReleasePayload(Frozen):
    """What happened to a release, by whom."""

    actor: ActorIdText | None = Field(default=None, description="Who did it: the authenticated caller (e.g. 'user:alice', 'service:ci-gitlab') when authenticated_by is set, else the name the publisher typed. Never contains '>' nor starts with 'unauthenticated:' (see decision_actor).")
    on_behalf_of: ActorIdText | None = Field(default=None, description="The person a service acted for (CI for the engineer who clicked); counts only if the policy gives the actor the 'delegate' right. Never contains '>' nor starts with 'unauthenticated:'.")
    authenticated_by: IdText | None = Field(default=None, description="How the receiver proved the actor: 'token' (credentials file), 'oidc' (JWT), 'mlflow-webhook' (signed delivery), 'shared-token'; null = unauthenticated (e.g. the CLI straight to Kafka).")
    actor_groups: tuple[ActorIdText, ...] = Field(default=(), description="Groups of the authenticated actor (credentials file or the token's groups claim). None contains '>' nor starts with 'unauthenticated:'.")
    approval_id: IdText | None = Field(default=None, description="Change/approval ticket id.")
    reason: str | None = Field(default=None, description="Free-text reason.")
    to_environment: IdText | None = Field(default=None, description="Target environment of a promotion/rollback.")
    superseded_release_id: IdText | None = Field(default=None, description="Release this one replaced (promotion) or that replaced it (rollback).")
    reservation: Reservation | None = Field(default=None, description="Reservation created or released.")
    target: IdText | None = Field(default=None, description="Admin action target: queue, node or workload name.")
    expires_at: UtcDatetime | None = Field(default=None, description="Expiry of an emergency override.")
    tags: dict[str, str] = Field(default_factory=dict, description="Registry tags/aliases carried along.")


@dataclass(frozen=True)
class Decision:
    """A ``decision_actor`` string taken apart (``parse_decision``)."""

    proven: bool  # a credential proved ``actor`` (the receiver set ``authenticated_by``)
    actor: str  # who published it: the person, or the service acting for ``person``; "" if none named
    person: str | None  # ``on_behalf_of``: the person a service acted for
    groups: tuple[str, ...]  # the authenticated groups of ``actor`` (never of ``person``); () when not proven


def parse_decision(decision: str) -> Decision:
    """The parts of a ``decision_actor`` string.

    Unambiguous for a string built from a valid payload: it starts with ``UNAUTHENTICATED`` only
    when unproven (no actor starts with it, and an actorless delegation starts with '>'); the
    first ``GROUP_SEPARATOR`` ends the actor part (no name contains a control character); and
    that part holds a '>' only as the delegation's (no actor or person contains one)."""
    proven = not decision.startswith(UNAUTHENTICATED)
    who, *groups = decision.removeprefix(UNAUTHENTICATED).split(GROUP_SEPARATOR)
    service, delegated, person = who.rpartition(DELEGATED)
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
    who = f"{actor or ''}{DELEGATED}{person}" if person else actor
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
