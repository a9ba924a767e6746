"""Admission family: what ``gpuledger admit`` decided about a GPU workload before it entered a queue.

Published by the admission webhook and the Kueue AdmissionCheck controller
(``producers/admission``), on the scheduler topic (the workload's history, co-partitioned
and keyed the same way: release_id where the object names it, else the workload id).
One event per decision: the policy result before queue entry that control 1's evidence shows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.envelope import Count32, EventBase, Frozen, IdText, NonNegInt64

AdmissionEventType = Literal["admission.decided"]


class AdmissionPayload(Frozen):
    """One decision, with what it read."""

    decision: Literal["allow", "deny", "warn"] = Field(description="What was answered: deny only in enforce mode; warn = allowed with a warning.")
    outcome: Literal["allow", "deny"] = Field(description="What the rule said before the mode applied (a dry-run deny is decision allow, outcome deny).")
    rule: IdText = Field(description="The rule that decided (streams.controls.admission.RULES).")
    message: str = Field(description="The message returned to whoever created the object (or set on the Workload's admission check), followed by a note for each DRA claim that could not be read and was counted as a GPU and, when gpuledger admit could not confirm its release state is current, a note saying since when (the webhook returns those notes as warnings); each part ends with a full stop before the next. A warn- or dry-run-mode allow of what enforce mode would deny starts by saying so.")
    mode: Literal["enforce", "warn", "dry-run"] = Field(description="The mode of the namespace/environment (policy admission section).")
    gate: Literal["webhook", "admission-check"] = Field(description="Who decided: the validating webhook, or the Kueue AdmissionCheck controller.")
    object_kind: IdText = Field(description="Pod, Job or Workload.")
    object_name: IdText = Field(description="Object name.")
    object_uid: IdText | None = Field(default=None, description="Object UID when the API server had assigned one.")
    operation: IdText | None = Field(default=None, description="CREATE / UPDATE (webhook), or the check state set (Ready / Rejected / Retry / Pending). Recorded by an older gpuledger admit, a dry run's reads \"CREATE (dry run)\" (see dry_run).")
    dry_run: bool = Field(default=False, description="The webhook answered a server-side dry run (AdmissionReview request.dryRun: kubectl diff, --dry-run=server): decided and answered like the real request, but nothing was created — never enforcement, nor a decision on a real object.")
    user: IdText | None = Field(default=None, description="Who created the object (AdmissionReview userInfo.username): authenticated by the API server when `caller` is set, else only what the webhook's caller said.")
    caller: IdText | None = Field(default=None, description="Who called the webhook, proven by its TLS client certificate (`x509:<subject common name>`, signed by admit's client_ca_file): the API server that authenticated `user`. Empty: the caller was not authenticated (no client_ca_file), or the AdmissionCheck gate (admit's own watch).")
    gpus_requested: Count32 = Field(default=0, description="GPUs the object requests (extended resource units).")
    release_state: IdText | None = Field(default=None, description="The release's latest lifecycle event at decision time.")
    fail_closed: bool = Field(default=False, description="The environment is decided fail-closed (policy admission.fail_closed).")
    policy_version: IdText = Field(description="Fingerprint of the policy decided under.")
    directory_version: NonNegInt64 = Field(default=0, description="Version of the release's state read (grows with its history).")
    override_event_id: IdText | None = Field(default=None, description="The release.admission_overridden event that let the object through.")
    evidence: tuple[IdText, ...] = Field(default=(), description="Release event ids the rule read (approval, revocation, override).")


class AdmissionEvent(EventBase):
    """One admission decision."""

    event_type: AdmissionEventType
    payload: AdmissionPayload
