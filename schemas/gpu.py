"""GPU family: which device is assigned to which container, from the kubelet; what a DRA device is.

``gpu.assigned`` / ``gpu.released`` / ``gpu.allocatable`` are published by the
pod-resources collector. The kubelet names pods only by namespace/name, so these events
are keyed by that and re-keyed by the streams. ``gpu.device`` is published by the
scheduler collector from a DRA ResourceSlice: what one ``<driver>/<pool>/<device>`` is
(its ``uuid`` and, for a MIG device, ``parentUUID`` and ``profile`` attributes).
``gpu.claim_reserved`` / ``gpu.claim_released`` are published by the scheduler collector from
a DRA ResourceClaim: the claim's allocated device (``status.allocation.devices.results[]``)
became / stopped being held by a pod in its ``status.reservedFor`` — who holds which DRA
device as the API server records it, with or without a kubelet collector on the node.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.envelope import EventBase, Frozen, IdText, Int64, NonNegInt64

GpuEventType = Literal["gpu.assigned", "gpu.released", "gpu.allocatable", "gpu.device", "gpu.claim_reserved", "gpu.claim_released"]
#: Why a pod stopped holding a claim's device (``gpu.claim_released``).
ClaimReleaseReason = Literal["unreserved", "deallocated", "claim_deleted"]


class GpuPayload(Frozen):
    """One device assignment (assigned/released) or a node's allocatable snapshot."""

    node: IdText = Field(description="Node name.")
    namespace: IdText | None = Field(default=None, description="Pod namespace (assigned/released).")
    pod: IdText | None = Field(default=None, description="Pod name (assigned/released).")
    container: IdText | None = Field(default=None, description="Container name (assigned/released).")
    resource_name: IdText = Field(default="nvidia.com/gpu", description="Extended resource name.")
    device_id: IdText | None = Field(default=None, description="Device ID verbatim as the device plugin reports it.")
    gpu: IdText | None = Field(default=None, description="Physical GPU parsed from the device id (GPU UUID or index name).")
    mig_instance: IdText | None = Field(default=None, description="MIG instance UUID when the device is a MIG slice.")
    share: NonNegInt64 | None = Field(default=None, description="Time-slicing replica index ('::N' suffix).")
    numa_nodes: tuple[Int64, ...] = Field(default=(), description="NUMA nodes from the topology hint.")
    devices: tuple[IdText, ...] = Field(default=(), description="Allocatable device ids (gpu.allocatable only).")
    driver: IdText | None = Field(default=None, description="DRA driver of a DRA-allocated device (gpu.device, and assigned/released of DRA devices).")
    pool: IdText | None = Field(default=None, description="DRA pool of the device.")
    profile: IdText | None = Field(default=None, description="MIG profile of a DRA MIG device (ResourceSlice attribute 'profile', e.g. 1g.10gb).")
    claim: IdText | None = Field(default=None, description="ResourceClaim name (in the pod's namespace) the device was allocated to (gpu.claim_*).")
    claim_uid: IdText | None = Field(default=None, description="ResourceClaim uid (gpu.claim_*).")
    request: IdText | None = Field(default=None, description="The claim's request the device satisfies (allocation result 'request'; 'req/sub' for a subrequest).")
    reason: ClaimReleaseReason | None = Field(default=None, description="gpu.claim_released: unreserved (the pod left reservedFor), "
                                              "deallocated (the claim's allocation was cleared or no longer names the device), "
                                              "claim_deleted (the claim is gone).")


class GpuEvent(EventBase):
    """One GPU assignment change or allocatable snapshot."""

    event_type: GpuEventType
    payload: GpuPayload

    @model_validator(mode="after")
    def _required_identity(self):
        ident = self.identity
        if not (ident.node):
            raise ValueError("identity.node is required for gpu events")
        p = self.payload
        # What names the entity the event belongs to (streams.correlate.routing.entity_key): without
        # it, assignments from every node were folded into one made-up pod "None/None" and a device
        # into "gpu:<node>/None" (exact-or-loud review) — refused here, the event is dead-lettered.
        if self.event_type in ("gpu.assigned", "gpu.released"):
            missing = [n for n, v in (("namespace", p.namespace or ident.namespace), ("pod", p.pod or ident.pod),
                                      ("device_id", p.device_id)) if not v]
            if missing:
                raise ValueError(f"{self.event_type} needs payload (or identity) {', '.join(missing)}")
        if self.event_type == "gpu.device" and not p.device_id:
            raise ValueError("gpu.device needs payload device_id")
        if self.event_type.startswith("gpu.claim_"):
            missing = [n for n in ("namespace", "pod", "device_id", "driver", "pool", "claim") if not getattr(p, n)]
            if missing:
                raise ValueError(f"{self.event_type} needs payload {', '.join(missing)}")
            if (self.event_type == "gpu.claim_released") != (p.reason is not None):
                raise ValueError("payload.reason is required for gpu.claim_released and only there")
        return self
