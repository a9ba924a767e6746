"""Pure mapping of DRA ResourceSlices (``resource.k8s.io``) to ``gpu.device`` events.

Input: a ResourceSlice exactly as the API server serves it — v1 / v1beta2 (``devices[].
attributes``) or v1beta1 (``devices[].basic.attributes``); each attribute a one-of
``{"string"|"int"|"bool"|"version": value}``, named plainly (the driver's own domain) or
qualified ``<domain>/<name>``.
Output: one ``gpu.device`` per device of a GPU driver that carries a ``uuid`` attribute:
``device_id`` = ``<driver>/<pool>/<device>`` (what the kubelet's pod-resources API reports
for a DRA allocation), ``gpu`` = the physical GPU (``parentUUID`` for a MIG device, else
``uuid``), ``mig_instance`` = the MIG UUID, ``profile`` = the MIG profile — the attributes
NVIDIA's DRA driver (``gpu.nvidia.com``) publishes: ``type`` gpu|mig, ``uuid``,
``parentUUID``, ``profile``.
Guarantees: no I/O; the event id is ``make_event_id("kubernetes", (slice uid, "device",
device name), <digest of what the device is>)`` — the same slice re-listed gives the same
ids, a device whose identity changed a new one.
Limits: devices without a ``uuid`` attribute (other drivers, counters-only devices) name
nothing gpuledger can join and are skipped; a slice's devices going away publishes nothing
(what a device *was* stays true for the allocations made while it existed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from datetime import datetime

from producers._config import ResourceMatcher, dra_device_id
from producers.kubernetes.mapping import SOURCE, MalformedObject, meta_of
from schemas.envelope import Identity, Source, make_event_id
from schemas.gpu import GpuEvent, GpuPayload

RESOURCE_GROUP = "resource.k8s.io"
#: Served versions, newest first: v1 (Kubernetes 1.34, GA), v1beta2 (1.33), v1beta1 (1.32).
RESOURCE_VERSIONS = ("v1", "v1beta2", "v1beta1")


def _attribute(attrs: Mapping, driver: str, name: str) -> str | None:
    """An attribute's value as text, named plainly or qualified by the driver's domain."""
    for key in (name, f"{driver}/{name}"):
        value = attrs.get(key)
        if isinstance(value, Mapping):
            for kind in ("string", "version", "int", "bool"):
                if value.get(kind) not in (None, ""):
                    return str(value[kind])
    return None


def slice_devices(obj: Mapping, drivers: ResourceMatcher | Iterable[str], source: Source, observed_at: datetime) -> list[GpuEvent]:
    """The ``gpu.device`` events of one ResourceSlice (empty for a non-GPU driver)."""
    drivers = drivers if isinstance(drivers, ResourceMatcher) else ResourceMatcher(drivers)
    meta = meta_of(obj, "ResourceSlice", namespaced=False)
    spec = obj.get("spec") or {}
    driver, node = spec.get("driver"), spec.get("nodeName")
    pool = (spec.get("pool") or {}).get("name")
    if not isinstance(driver, str) or not drivers(driver):
        return []
    if not isinstance(pool, str) or not pool:
        raise MalformedObject("ResourceSlice: spec.pool.name missing")
    if not isinstance(node, str) or not node:
        return []  # a network-attached pool (nodeSelector / allNodes): no node to join on
    out = []
    for dev in spec.get("devices") or []:
        if not isinstance(dev, Mapping) or not isinstance(dev.get("name"), str):
            continue
        attrs = dev.get("attributes") or (dev.get("basic") or {}).get("attributes") or {}
        uuid = _attribute(attrs, driver, "uuid")
        if not uuid:
            continue
        parent = _attribute(attrs, driver, "parentUUID")
        mig = uuid if (parent or _attribute(attrs, driver, "type") == "mig" or uuid.startswith("MIG-")) else None
        profile = _attribute(attrs, driver, "profile") if mig else None
        device_id = dra_device_id(driver, pool, dev["name"])
        what = hashlib.sha256(f"{uuid}|{parent or ''}|{profile or ''}".encode()).hexdigest()[:16]
        out.append(GpuEvent(
            event_id=make_event_id(SOURCE, (meta.uid, "device", dev["name"]), what),
            event_type="gpu.device", occurred_at=meta.created, observed_at=observed_at, source=source,
            identity=Identity(node=node, gpu_id=device_id),
            payload=GpuPayload(node=node, resource_name=driver, device_id=device_id, gpu=parent or (None if mig else uuid),
                               mig_instance=mig, driver=driver, pool=pool, profile=profile),
        ))
    return out
