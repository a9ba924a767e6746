"""What the kubelet says a node's GPUs are doing, and what changed since the last publish: pure, no I/O.

Input: the kubelet's ``List`` / ``GetAllocatableResources`` answers (protobuf messages),
the configured resource names, and the last published ``CollectorState``.
Output: an ``Observation`` (device assignments per container, allocatable sets, malformed
entries as ``Reject``s) and a ``Plan`` (assigned / released / allocatable changes, the
state to write ahead and the state to commit once Kafka acknowledged the batch).
Guarantees: device ids are kept verbatim; ``parse_device_id`` only reads what they say
about the hardware. ``plan_changes`` reuses the generation of an assignment already in
flight, so a re-sent batch has the same event ids (see ``producers.podresources.collector``).
Limits: the kubelet names pods by namespace/name only (no UID).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from producers._config import ResourceMatcher, dra_device_id
from producers._errors import ProducerError
from producers.podresources.proto import podresources_v1_pb2 as pb
from schemas.envelope import INT64_MAX, identity_text_problem

COLLECTOR = "podresources"
STATE_FORMAT = 1


class PodResourcesError(ProducerError):
    """Base error of the pod-resources collector."""


class DeviceIdError(PodResourcesError, ValueError):
    """A device id that cannot be published as-is; ``reason`` is machine-readable."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --- device ids (pure) -------------------------------------------------------------------

DeviceForm = Literal["gpu_uuid", "mig_uuid", "mig_legacy", "index", "mig_index", "unknown"]


@dataclass(frozen=True)
class DeviceRef:
    """A device id as reported, and what it says about the hardware."""

    device_id: str
    form: DeviceForm
    gpu: str | None = None
    mig_instance: str | None = None
    share: int | None = None


_SHARE_SUFFIX = re.compile(r"^(?P<base>.+?)(?:::(?P<share>\d+)|/vgpu(?P<vgpu>\d+))$")
_MIG_LEGACY = re.compile(r"^MIG-(?P<gpu>GPU-[^/]+)/\d+/\d+$")
_GKE_MIG = re.compile(r"^(?P<gpu>nvidia\d+)/gi\d+$")
_NV_INDEX_MIG = re.compile(r"^(?P<gpu>\d+):\d+$")
_INDEX = re.compile(r"^(?:nvidia\d+|\d+)$")


def parse_device_id(device_id: str) -> DeviceRef:
    """Parse a device-plugin device id; the id itself is kept verbatim.

    Forms (NVIDIA device plugin, GKE's plugin):
    ``GPU-<uuid>`` physical GPU; ``MIG-<uuid>`` MIG instance (its parent GPU is not
    in the id); ``MIG-GPU-<uuid>/<gi>/<ci>`` legacy MIG id naming its parent;
    ``nvidia0`` / ``0`` index names; ``nvidia0/gi1`` and ``0:1`` MIG by index;
    a time-slicing suffix ``::N`` (NVIDIA) or ``/vgpuN`` (GKE) gives the share.
    Anything else is ``unknown`` but still published verbatim. Raises
    ``DeviceIdError`` for an empty id or one with whitespace, control, format or bidi
    characters (it could not round-trip through the event unchanged).
    """
    if not device_id or not device_id.strip():
        raise DeviceIdError("empty_device_id", "device id is empty")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in device_id):
        raise DeviceIdError("invalid_device_id", f"device id {device_id!r} contains whitespace or control characters")
    # The event's own rule for identifiers (a bidi or format character passed the check above
    # and then failed the GpuPayload built from it, inside the poll: that ended the collector).
    if problem := identity_text_problem(device_id):
        raise DeviceIdError("invalid_device_id", f"device id {device_id!r}: {problem}")
    base, share = device_id, None
    m = _SHARE_SUFFIX.match(device_id)
    if m:
        base, share = m["base"], int(m["share"] if m["share"] is not None else m["vgpu"])
        if share > INT64_MAX:  # (the event's share is an int64: ``schemas.gpu.GpuPayload``)
            raise DeviceIdError("invalid_device_id", f"device id {device_id!r}: share index past 64 bits")
    if m := _MIG_LEGACY.match(base):
        return DeviceRef(device_id, "mig_legacy", gpu=m["gpu"], mig_instance=base, share=share)
    if base.startswith("MIG-") and len(base) > 4:
        return DeviceRef(device_id, "mig_uuid", mig_instance=base, share=share)
    if base.startswith("GPU-") and len(base) > 4:
        return DeviceRef(device_id, "gpu_uuid", gpu=base, share=share)
    if m := (_GKE_MIG.match(base) or _NV_INDEX_MIG.match(base)):
        return DeviceRef(device_id, "mig_index", gpu=m["gpu"], mig_instance=base, share=share)
    if _INDEX.match(base):
        return DeviceRef(device_id, "index", gpu=base, share=share)
    return DeviceRef(device_id, "unknown", share=share)


# --- snapshots (pure) --------------------------------------------------------------------

class AssignmentKey(NamedTuple):
    """What one gpu.assigned / gpu.released event is about (the node is the collector's)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str


@dataclass(frozen=True)
class Held:
    """An assignment as published: since when (its generation) and its NUMA nodes."""

    since: str
    numa: tuple[int, ...] = ()


@dataclass(frozen=True)
class AllocatableSet:
    """One resource's allocatable devices, and since when the set looks like this."""

    devices: tuple[str, ...]
    numa: tuple[int, ...] = ()
    since: str = ""

    def same_set(self, other: AllocatableSet | None) -> bool:
        return other is not None and self.devices == other.devices and self.numa == other.numa


@dataclass(frozen=True)
class Reject:
    """A malformed entry the kubelet reported, skipped."""

    reason: str
    subject: str
    detail: str


@dataclass
class Observation:
    """One poll of the kubelet, filtered to the configured resources."""

    assignments: dict[AssignmentKey, tuple[int, ...]] = field(default_factory=dict)
    allocatable: dict[str, AllocatableSet] | None = None  # None: the kubelet does not serve it
    rejects: list[Reject] = field(default_factory=list)


def _numa(topology: pb.TopologyInfo) -> tuple[int, ...]:
    return tuple(sorted({int(n.ID) for n in topology.nodes}))


def _dra_devices(pod: pb.PodResources, dra: ResourceMatcher | None) -> list[tuple[pb.ContainerResources, pb.ContainerDevices]]:
    """A container's DRA allocations of GPU drivers as device-plugin-shaped entries: resource
    name = the driver, device id = ``<driver>/<pool>/<device>`` (``producers._config.dra_device_id``)."""
    if dra is None:
        return []
    out = []
    for c in pod.containers:
        for claim in c.dynamic_resources:
            by_driver: dict[str, list[str]] = {}
            for res in claim.claim_resources:
                if res.driver_name and dra(res.driver_name):
                    by_driver.setdefault(res.driver_name, []).append(dra_device_id(res.driver_name, res.pool_name, res.device_name))
            out.extend((c, pb.ContainerDevices(resource_name=driver, device_ids=ids)) for driver, ids in sorted(by_driver.items()))
    return out


def _name_problem(*named: tuple[str, str]) -> str | None:
    """What stops a kubelet-reported name from being an event identifier (``schemas.envelope.IdText``), if anything.

    The API server's validation keeps these out of real names; a kubelet (or a fake) that
    reports one anyway gets the entry skipped and counted, not the poll ended by the event's validation."""
    for what, value in named:
        if problem := identity_text_problem(value):
            return f"{what} {value!r} {problem}"
    return None


def observe_pod(pod: pb.PodResources, matches: ResourceMatcher, obs: Observation, dra: ResourceMatcher | None = None) -> None:
    """Add one pod's matching device assignments (device plugin, and DRA devices of the
    drivers ``dra`` matches) to ``obs``; malformed parts become rejects."""
    matching = [(c, d) for c in pod.containers for d in c.devices if d.resource_name and matches(d.resource_name)]
    matching += _dra_devices(pod, dra)
    for c in pod.containers:
        for d in c.devices:
            if not d.resource_name and d.device_ids:
                obs.rejects.append(Reject("resource_name_missing", f"{pod.namespace}/{pod.name}/{c.name}", f"{len(d.device_ids)} device(s) without a resource name"))
    if not matching:
        return
    if not pod.namespace or not pod.name:
        n = sum(len(d.device_ids) for _, d in matching)
        obs.rejects.append(Reject("pod_name_missing", f"{pod.namespace or '<no namespace>'}/{pod.name or '<no name>'}", f"pod without a namespace or name holds {n} device(s)"))
        return
    if problem := _name_problem(("namespace", pod.namespace), ("pod", pod.name)):
        obs.rejects.append(Reject("invalid_name", f"{pod.namespace!r}/{pod.name!r}", problem))
        return
    for c, d in matching:
        subject = f"{pod.namespace}/{pod.name}/{c.name or '<no name>'}"
        if not c.name:
            obs.rejects.append(Reject("container_name_missing", subject, f"container without a name holds {len(d.device_ids)} {d.resource_name} device(s)"))
            continue
        if problem := _name_problem(("container", c.name), ("resource name", d.resource_name)):
            obs.rejects.append(Reject("invalid_name", f"{pod.namespace}/{pod.name}/{c.name!r}", problem))
            continue
        numa = _numa(d.topology)
        for device_id in d.device_ids:
            try:
                parse_device_id(device_id)
            except DeviceIdError as exc:
                obs.rejects.append(Reject(exc.reason, f"{subject} {d.resource_name}", str(exc)))
                continue
            obs.assignments[AssignmentKey(pod.namespace, pod.name, c.name, d.resource_name, device_id)] = numa


def observe(pods: Iterable[pb.PodResources], allocatable: pb.AllocatableResourcesResponse | None, matches: ResourceMatcher,
            dra: ResourceMatcher | None = None) -> Observation:
    """Turn a List (and GetAllocatableResources) answer into an Observation."""
    obs = Observation()
    for pod in pods:
        observe_pod(pod, matches, obs, dra)
    if allocatable is not None:
        devices: dict[str, set[str]] = {}
        numa: dict[str, set[int]] = {}
        for d in allocatable.devices:
            if not d.resource_name or not matches(d.resource_name):
                continue
            if problem := _name_problem(("resource name", d.resource_name)):
                obs.rejects.append(Reject("invalid_name", f"allocatable {d.resource_name!r}", problem))
                continue
            for device_id in d.device_ids:
                try:
                    parse_device_id(device_id)
                except DeviceIdError as exc:
                    obs.rejects.append(Reject(exc.reason, f"allocatable {d.resource_name}", str(exc)))
                    continue
                devices.setdefault(d.resource_name, set()).add(device_id)
            numa.setdefault(d.resource_name, set()).update(_numa(d.topology))
        obs.allocatable = {res: AllocatableSet(tuple(sorted(ids)), tuple(sorted(numa.get(res, ())))) for res, ids in devices.items()}
    return obs


@dataclass
class CollectorState:
    """What was last published (committed), plus generations of a batch in flight (pending).

    ``pending_*`` are written before a batch is sent, so that its re-send — after a
    failed publish or a crash before the commit — reuses the same generations, i.e.
    the same event ids.
    """

    node: str
    assignments: dict[AssignmentKey, Held] = field(default_factory=dict)
    allocatable: dict[str, AllocatableSet] = field(default_factory=dict)
    pending_assignments: dict[AssignmentKey, Held] = field(default_factory=dict)
    pending_allocatable: dict[str, AllocatableSet] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        def rows(items: Mapping[AssignmentKey, Held]) -> list[dict]:
            return [{**k._asdict(), "since": h.since, "numa": list(h.numa)} for k, h in sorted(items.items())]

        def sets(items: Mapping[str, AllocatableSet]) -> list[dict]:
            return [{"resource": r, "devices": list(s.devices), "numa": list(s.numa), "since": s.since} for r, s in sorted(items.items())]

        return {
            "format": STATE_FORMAT, "collector": COLLECTOR, "node": self.node,
            "assignments": rows(self.assignments), "allocatable": sets(self.allocatable),
            "pending_assignments": rows(self.pending_assignments), "pending_allocatable": sets(self.pending_allocatable),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectorState:
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown state format {data.get('format')!r} (this version writes {STATE_FORMAT})")

        def rows(items: list[dict]) -> dict[AssignmentKey, Held]:
            return {AssignmentKey(r["namespace"], r["pod"], r["container"], r["resource"], r["device_id"]): Held(r["since"], tuple(r["numa"])) for r in items}

        def sets(items: list[dict]) -> dict[str, AllocatableSet]:
            return {r["resource"]: AllocatableSet(tuple(r["devices"]), tuple(r["numa"]), r["since"]) for r in items}

        return cls(node=data["node"], assignments=rows(data["assignments"]), allocatable=sets(data["allocatable"]),
                   pending_assignments=rows(data.get("pending_assignments", [])), pending_allocatable=sets(data.get("pending_allocatable", [])))


@dataclass
class Plan:
    """The changes between the published state and an observation."""

    assigned: list[tuple[AssignmentKey, Held]] = field(default_factory=list)
    released: list[tuple[AssignmentKey, Held]] = field(default_factory=list)
    allocatable: list[tuple[str, AllocatableSet]] = field(default_factory=list)
    after: CollectorState | None = None  # the state to commit once the batch is acknowledged
    in_flight: CollectorState | None = None  # the state to write ahead before sending

    @property
    def empty(self) -> bool:
        return not (self.assigned or self.released or self.allocatable)


def plan_changes(state: CollectorState, obs: Observation, now: str) -> Plan:
    """Diff ``obs`` against the published ``state``; ``now`` is this snapshot's time (ISO).

    New assignments take their generation from a pending (in-flight) entry when
    there is one, else ``now``. Releases cover what was published and is gone, and
    what was in flight and is gone (it may have reached Kafka).
    """
    plan = Plan()
    committed: dict[AssignmentKey, Held] = {}
    for key, numa in sorted(obs.assignments.items()):
        held = state.assignments.get(key)
        if held is None:
            held = state.pending_assignments.get(key) or Held(now, numa)
            plan.assigned.append((key, held))
        committed[key] = held
    gone = {**state.pending_assignments, **state.assignments}
    plan.released = sorted((k, h) for k, h in gone.items() if k not in obs.assignments)

    allocatable = dict(state.allocatable)
    if obs.allocatable is not None:
        for resource in sorted(set(state.allocatable) | set(obs.allocatable)):
            seen = obs.allocatable.get(resource, AllocatableSet(()))
            before = state.allocatable.get(resource)
            pending = state.pending_allocatable.get(resource)
            # Back to the published set after a batch with another one was attempted: that
            # batch may have reached Kafka, so the published set is said again (a new fact).
            in_doubt = pending is not None and not pending.same_set(before)
            if (seen.same_set(before) and not in_doubt) or (before is None and pending is None and not seen.devices):
                continue
            since = pending.since if seen.same_set(pending) else now
            current = AllocatableSet(seen.devices, seen.numa, since)
            plan.allocatable.append((resource, current))
            if current.devices:
                allocatable[resource] = current
            else:
                allocatable.pop(resource, None)

    plan.after = CollectorState(state.node, committed, allocatable)
    plan.in_flight = CollectorState(
        state.node, dict(state.assignments), dict(state.allocatable),
        pending_assignments={**{k: h for k, h in plan.released if k in state.pending_assignments}, **dict(plan.assigned)},
        pending_allocatable=dict(plan.allocatable),
    )
    return plan
