"""GPU family: which device is assigned to which container, from the kubelet; what a DRA device is.

``gpu.assigned`` / ``gpu.released`` / ``gpu.allocatable`` are published by the
pod-resources collector. The kubelet names pods only by namespace/name, so these events
are keyed by that and re-keyed by the streams. ``gpu.device`` is published by the
scheduler collector from a DRA ResourceSlice: what one ``<driver>/<pool>/<device>`` is
(its ``uuid`` and, for a MIG device, ``parentUUID`` and ``profile`` attributes).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.envelope import EventBase, Frozen, IdText

GpuEventType = Literal["gpu.assigned", "gpu.released", "gpu.allocatable", "gpu.device"]


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
    share: int | None = Field(default=None, ge=0, description="Time-slicing replica index ('::N' suffix).")
    numa_nodes: tuple[int, ...] = Field(default=(), description="NUMA nodes from the topology hint.")
    devices: tuple[IdText, ...] = Field(default=(), description="Allocatable device ids (gpu.allocatable only).")
    driver: IdText | None = Field(default=None, description="DRA driver of a DRA-allocated device (gpu.device, and assigned/released of DRA devices).")
    pool: IdText | None = Field(default=None, description="DRA pool of the device.")
    profile: IdText | None = Field(default=None, description="MIG profile of a DRA MIG device (ResourceSlice attribute 'profile', e.g. 1g.10gb).")


class GpuEvent(EventBase):
    """One GPU assignment change or allocatable snapshot."""

    event_type: GpuEventType
    payload: GpuPayload

    @model_validator(mode="after")
    def _required_identity(self):
        ident = self.identity
        if not (ident.node):
            raise ValueError("identity.node is required for gpu events")
        return self
