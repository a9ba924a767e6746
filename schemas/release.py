"""Release family: the model lifecycle plane, from registries, CI and admins.

Published by the receiver and the ``gpuledger release`` CLI, keyed by release_id.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.envelope import EventBase, Frozen, IdText, UtcDatetime

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
]

#: Admin actions: decisions that need a named right in the policy file.
ADMIN_ACTIONS = frozenset({"release.queue_paused", "release.node_isolated", "release.priority_overridden"})


class Reservation(Frozen):
    """Capacity reserved for a release."""

    reservation_id: IdText = Field(description="Reservation id.")
    gpus: int = Field(ge=0, description="Number of GPUs reserved.")
    pool: IdText | None = Field(default=None, description="Node pool / ClusterQueue / flavor holding the GPUs.")
    window_start: UtcDatetime | None = Field(default=None, description="Start of the reservation window.")
    window_end: UtcDatetime | None = Field(default=None, description="End of the reservation window.")


class ReleasePayload(Frozen):
    """What happened to a release, by whom."""

    actor: IdText | None = Field(default=None, description="Who did it (user, service account, CI job).")
    approval_id: IdText | None = Field(default=None, description="Change/approval ticket id.")
    reason: str | None = Field(default=None, description="Free-text reason.")
    to_environment: IdText | None = Field(default=None, description="Target environment of a promotion/rollback.")
    superseded_release_id: IdText | None = Field(default=None, description="Release this one replaced (promotion) or that replaced it (rollback).")
    reservation: Reservation | None = Field(default=None, description="Reservation created or released.")
    target: IdText | None = Field(default=None, description="Admin action target: queue, node or workload name.")
    expires_at: UtcDatetime | None = Field(default=None, description="Expiry of an emergency override.")
    tags: dict[str, str] = Field(default_factory=dict, description="Registry tags/aliases carried along.")


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
