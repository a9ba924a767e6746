"""Scheduler family: what the scheduling plane did to a workload or pod.

Published by the Kubernetes/Kueue collector, keyed by release_id where a workload
label names it, else by workload_id.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.envelope import Count32, EventBase, Frozen, IdText, Int32, NonNegInt32

SchedulerEventType = Literal[
    "scheduler.submitted",
    "scheduler.queued",
    "scheduler.quota_reserved",
    "scheduler.admitted",
    "scheduler.scheduled",
    "scheduler.running",
    "scheduler.pods_ready",
    "scheduler.failed_scheduling",
    "scheduler.preempted",
    "scheduler.evicted",
    "scheduler.requeued",
    "scheduler.finished",
    "scheduler.deleted",
]


class ObjectRef(Frozen):
    """A reference to a Kubernetes object (the preemptor of a preemption, say)."""

    kind: IdText = Field(description="Pod, Workload, Job, ...")
    namespace: IdText | None = Field(default=None, description="Namespace of the object.")
    name: IdText = Field(description="Object name.")
    uid: IdText | None = Field(default=None, description="Object UID when known.")


class SchedulerPayload(Frozen):
    """Scheduling facts about one transition."""

    object_kind: str = Field(description="Kind of object the transition happened to: Pod, Workload or Event.")
    queue: IdText | None = Field(default=None, description="Kueue LocalQueue name.")
    cluster_queue: IdText | None = Field(default=None, description="Kueue ClusterQueue that admitted the workload.")
    priority_class: IdText | None = Field(default=None, description="Priority class name.")
    priority: Int32 | None = Field(default=None, description="Priority value (int32, as Kubernetes' PriorityClass).")
    reason: str | None = Field(default=None, description="Machine-readable reason (condition reason or event reason).")
    message: str | None = Field(default=None, description="Human-readable message from the source.")
    phase: str | None = Field(default=None, description="Pod phase when the object is a pod.")
    gpus_requested: Count32 | None = Field(default=None, description="GPUs (extended resource units) requested.")
    image_digests: tuple[str, ...] = Field(default=(), description="Running container image digests ('sha256:...').")
    preemptor: ObjectRef | None = Field(default=None, description="Who preempted this workload/pod, when known.")
    victim: ObjectRef | None = Field(default=None, description="Whom this workload/pod preempted, when known.")
    labels: dict[IdText, IdText] = Field(default_factory=dict, description="Labels that carry shared identifiers.")
    flavors: dict[str, str] = Field(default_factory=dict, description="Kueue resource flavor per resource.")
    pod_sets: dict[str, NonNegInt32] = Field(default_factory=dict, description="Kueue pod-set name -> pod count (admitted count when the workload has an admission).")


class SchedulerEvent(EventBase):
    """One scheduler transition."""

    event_type: SchedulerEventType
    payload: SchedulerPayload

    @model_validator(mode="after")
    def _required_identity(self):
        ident = self.identity
        if not (ident.workload_id or ident.pod_uid or (ident.namespace and ident.pod)):
            raise ValueError("a scheduler event needs identity.workload_id, identity.pod_uid or identity.namespace+pod")
        return self
