"""Kubelet pod-resources collector: which GPU each container on a node holds.

Input: the kubelet's PodResourcesLister v1 gRPC service on its unix socket
(default /var/lib/kubelet/pod-resources/kubelet.sock), polled every ``interval_s``:
``List`` (the active pods' device-plugin allocations), ``GetAllocatableResources``
(the node's devices) and, where the kubelet serves it, ``Get`` (to confirm that a
pod missing from ``List`` is gone before its devices are released; the kubelet's
List purges the devices of inactive pods first, so Get never holds a release for a
finished pod — it only guards against a pod missing from one List answer).
Only resources matching the configured names (default ``nvidia.com/gpu``,
``nvidia.com/gpu.shared`` and the prefix ``nvidia.com/mig-*``) are considered.

Output: ``GpuEvent``s on the gpu topic, keyed by namespace/pod:
``gpu.assigned`` / ``gpu.released`` per (node, namespace/pod, container, resource,
device id), and one ``gpu.allocatable`` per resource whose allocatable device set
changed. Device ids are kept verbatim and also parsed (``parse_device_id``) into the
physical GPU, the MIG instance and the time-slicing share.

Guarantees:
- Each snapshot is diffed against the last *published* one, which is persisted
  atomically (temp file + rename) in the state dir only after Kafka acknowledged the
  whole batch; a failed publish leaves it untouched, so the next poll re-sends.
- Event ids are ``make_event_id("podresources", (node, ns, pod, container, resource,
  device_id, action), generation)``; the generation is the observed time of the first
  snapshot that saw the assignment and is persisted with it. A re-send of the same
  still-held assignment (after a failed publish or a restart) therefore has the same
  id, while an assignment re-made after a release gets a new one. Generations of a
  batch in flight are written ahead to the state file, so even a crash between the
  broker's ack and the state write re-sends with the same ids.
- A restart diffs against the persisted snapshot: no releases for devices still
  assigned, no duplicate assignments; what changed while the collector was down is
  published once.
- The kubelet being absent, rate limiting (RESOURCE_EXHAUSTED) and UNAVAILABLE are
  retried with capped exponential back-off and jitter; the process stays up, counts
  every failed poll, and logs once per change of failure state.
- Malformed entries (empty pod/container/resource name, empty or whitespace device
  id) are skipped with a logged reason and counted once each; the rest is published.
- An event too large to travel (over the publisher's ``max_event_bytes``; in practice
  only a ``gpu.allocatable`` listing thousands of devices) is not sent and not dropped:
  it goes to the dead-letter topic with reason ``event_too_large``, its size and the
  limit, is counted rejected, and its change is committed like a published one. These
  events carry no free text, so nothing is cut.

Limits:
- The API names pods by namespace/name only (no UID): a pod deleted and re-created
  under the same name with the same devices between two polls is invisible.
- A release is inferred from absence at poll time, so its ``occurred_at`` is when the
  collector noticed, at most one interval (plus back-off) late.
- A release may be published for an assignment whose publish failed part-way (the
  collector cannot know whether Kafka kept it); downstream treats a release of an
  unknown assignment as a no-op. Conversely, if a batch holding a release fails after
  part of it reached Kafka and the kubelet shows the device assigned again before the
  retry, that stray release stands until the assignment next changes.
- DRA (``dynamic_resources``) allocations are not published yet.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import stat
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Optional

import grpc
import typer
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gpuledger.settings import SettingsError, _lines
from gpuledger.telemetry import meter
from producers._kafka import EventPublisher, EventTooLarge, ProducerError, PublishError
from producers.proto import podresources_v1_pb2 as pb
from producers.proto import podresources_v1_pb2_grpc as pb_grpc
from schemas.envelope import Identity, Source, make_event_id
from schemas.gpu import GpuEvent, GpuPayload

log = logging.getLogger(__name__)

COLLECTOR = "podresources"
DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
STATE_FORMAT = 1
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


# --- settings ------------------------------------------------------------------------

class PodResourcesSettings(BaseSettings):
    """The pod-resources collector (one per node, usually a DaemonSet)."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_PODRESOURCES_", extra="ignore")

    node: str = Field(description="Name of the node this collector runs on (downward API spec.nodeName); required.")
    socket: Path = Field(default=DEFAULT_SOCKET, description="The kubelet's pod-resources unix socket.")
    interval_s: float = Field(default=10.0, gt=0, description="Seconds between two polls of the kubelet.")
    state_dir: Path = Field(default=Path("/var/lib/gpuledger"), description="Directory of the last published snapshot, podresources-<node>.json; must survive restarts (hostPath).")
    resources: Annotated[tuple[str, ...], NoDecode] = Field(
        default=("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*"),
        description="Resource names to publish, comma-separated in the environment; a trailing '*' makes an entry a prefix.",
    )
    rpc_timeout_s: float = Field(default=10.0, gt=0, description="Deadline of one gRPC call to the kubelet.")
    backoff_initial_s: float = Field(default=1.0, gt=0, description="First retry delay after a failed poll; doubles per failure, with jitter.")
    backoff_max_s: float = Field(default=60.0, gt=0, description="Cap of the retry delay.")
    max_message_mb: int = Field(default=16, ge=4, description="Largest List response accepted, in MiB (the kubelet sends up to 16).")
    confirm_releases_with_get: bool = Field(default=True, description="Ask Get whether a pod missing from List is really gone before releasing its devices (skipped when the kubelet does not serve Get).")

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        if not _NODE_NAME.match(value):
            raise ValueError(f"not a Kubernetes node name (lower-case DNS subdomain): {value!r}")
        return value

    @field_validator("resources", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("resources")
    @classmethod
    def _patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("give at least one resource name")
        bad = [v for v in value if "*" in v[:-1] or v == "*"]
        if bad:
            raise ValueError(f"'*' is only allowed at the end of a name prefix, got {', '.join(bad)}")
        return value

    @model_validator(mode="after")
    def _backoff_order(self) -> PodResourcesSettings:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(f"backoff_initial_s ({self.backoff_initial_s}) must not exceed backoff_max_s ({self.backoff_max_s})")
        return self

    @property
    def state_file(self) -> Path:
        return self.state_dir / f"podresources-{self.node}.json"

    @classmethod
    def load(cls, **overrides: Any) -> PodResourcesSettings:
        """Environment + non-None overrides; every problem reported at once."""
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        except ValidationError as exc:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(_lines(exc, cls.model_config["env_prefix"]))) from exc


# --- errors ----------------------------------------------------------------------------

class PodResourcesError(ProducerError):
    """Base error of the pod-resources collector."""


class KubeletUnavailable(PodResourcesError):
    """The kubelet could not be asked this poll (socket missing, rate limited, down)."""

    retriable = True

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StateFileError(PodResourcesError):
    """The snapshot file cannot be read or written."""

    retriable = True


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
    ``DeviceIdError`` for an empty id or one with whitespace or control characters
    (it could not round-trip through the event unchanged).
    """
    if not device_id or not device_id.strip():
        raise DeviceIdError("empty_device_id", "device id is empty")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in device_id):
        raise DeviceIdError("invalid_device_id", f"device id {device_id!r} contains whitespace or control characters")
    base, share = device_id, None
    m = _SHARE_SUFFIX.match(device_id)
    if m:
        base, share = m["base"], int(m["share"] if m["share"] is not None else m["vgpu"])
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


class ResourceMatcher:
    """Configured resource names; an entry ending in '*' is a prefix."""

    def __init__(self, patterns: Iterable[str]) -> None:
        patterns = tuple(patterns)
        self.names = frozenset(p for p in patterns if not p.endswith("*"))
        self.prefixes = tuple(p[:-1] for p in patterns if p.endswith("*"))

    def __call__(self, resource_name: str) -> bool:
        return resource_name in self.names or resource_name.startswith(self.prefixes)


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


def observe_pod(pod: pb.PodResources, matches: ResourceMatcher, obs: Observation) -> None:
    """Add one pod's matching device assignments to ``obs``; malformed parts become rejects."""
    matching = [(c, d) for c in pod.containers for d in c.devices if d.resource_name and matches(d.resource_name)]
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
    for c, d in matching:
        subject = f"{pod.namespace}/{pod.name}/{c.name or '<no name>'}"
        if not c.name:
            obs.rejects.append(Reject("container_name_missing", subject, f"container without a name holds {len(d.device_ids)} {d.resource_name} device(s)"))
            continue
        numa = _numa(d.topology)
        for device_id in d.device_ids:
            try:
                parse_device_id(device_id)
            except DeviceIdError as exc:
                obs.rejects.append(Reject(exc.reason, f"{subject} {d.resource_name}", str(exc)))
                continue
            obs.assignments[AssignmentKey(pod.namespace, pod.name, c.name, d.resource_name, device_id)] = numa


def observe(pods: Iterable[pb.PodResources], allocatable: pb.AllocatableResourcesResponse | None, matches: ResourceMatcher) -> Observation:
    """Turn a List (and GetAllocatableResources) answer into an Observation."""
    obs = Observation()
    for pod in pods:
        observe_pod(pod, matches, obs)
    if allocatable is not None:
        devices: dict[str, set[str]] = {}
        numa: dict[str, set[int]] = {}
        for d in allocatable.devices:
            if not d.resource_name or not matches(d.resource_name):
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


# --- state file ------------------------------------------------------------------------

class StateStore:
    """The snapshot file: read once at start, replaced atomically (temp + rename + fsync)."""

    def __init__(self, path: Path, node: str) -> None:
        self.path = Path(path)
        self.node = node

    def check_writable(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateFileError(f"cannot create state dir {self.path.parent}: {exc} (mount a writable hostPath there or set GPULEDGER_PODRESOURCES_STATE_DIR)") from exc
        if not os.access(self.path.parent, os.W_OK):
            raise StateFileError(f"state dir {self.path.parent} is not writable by uid {os.getuid()} (mount a writable hostPath there or set GPULEDGER_PODRESOURCES_STATE_DIR)")

    def load(self) -> CollectorState:
        """The persisted state; an empty one when there is none.

        A file that cannot be parsed is renamed aside (``*.corrupt-<time>``) and the
        collector starts empty: it then re-publishes what is assigned now (new ids)
        and cannot release what vanished meanwhile — logged as an error, because that
        is the one case where history can double up.
        """
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return CollectorState(self.node)
        except OSError as exc:
            raise StateFileError(f"cannot read state file {self.path}: {exc}") from exc
        try:
            state = CollectorState.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            log.error("state file %s is unreadable (%s); moved it to %s and starting from an empty snapshot: "
                      "current assignments will be re-published with new ids", self.path, exc, aside)
            return CollectorState(self.node)
        if state.node != self.node:
            raise StateFileError(f"state file {self.path} belongs to node {state.node!r}, not {self.node!r}: "
                                 "is the state dir shared between nodes? It must be per node (hostPath).")
        return state

    def save(self, state: CollectorState) -> None:
        data = json.dumps(state.to_json(), indent=1, sort_keys=True).encode("utf-8")
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # make the rename itself durable
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateFileError(f"cannot write state file {self.path}: {exc}") from exc


# --- back-off --------------------------------------------------------------------------

class Backoff:
    """Capped exponential back-off with jitter: failure n waits within [d/2, d], d = min(cap, initial * 2**n)."""

    def __init__(self, initial: float, cap: float, rng: random.Random | None = None) -> None:
        self.initial = initial
        self.cap = cap
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.initial * (2 ** min(self.failures, 32)))
        self.failures += 1
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.failures = 0


# --- the collector -----------------------------------------------------------------------

# Status codes that say "ask again later", as opposed to a broken request.
_RETRY_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted", grpc.StatusCode.UNAVAILABLE: "unavailable",
                grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded"}


_HINTS = {"resource_exhausted": " (the kubelet rate-limits this API for all its clients; backing off)",
          "unavailable": " (kubelet restarting, or the socket is stale)"}


def _not_served(exc: grpc.RpcError) -> bool:
    """The method is absent (older kubelet) or behind a disabled feature gate (plain Go error: UNKNOWN)."""
    code, details = exc.code(), (exc.details() or "")
    return code == grpc.StatusCode.UNIMPLEMENTED or (code == grpc.StatusCode.UNKNOWN and ("disabled" in details or "unknown method" in details))


def _get_not_found(exc: grpc.RpcError) -> bool:
    """The pod is gone: NOT_FOUND, or the real kubelet's plain Go error (UNKNOWN '... not found')."""
    code, details = exc.code(), (exc.details() or "")
    return code == grpc.StatusCode.NOT_FOUND or (code == grpc.StatusCode.UNKNOWN and "not found" in details)


@dataclass
class PollResult:
    """What one successful poll did."""

    assigned: int = 0
    released: int = 0
    allocatable: int = 0
    rejected: int = 0
    published: int = 0
    held: int = 0


class PodResourcesCollector:
    """Polls the kubelet's pod-resources API and publishes GPU assignment changes.

    ``poll_once`` does one cycle and raises on failure; ``run`` loops with back-off
    until ``stop`` is called (SIGTERM), then flushes the producer.
    """

    def __init__(self, settings: PodResourcesSettings, publisher: EventPublisher, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.publisher = publisher
        self.counters = publisher.counters
        self.node = settings.node
        self._matches = ResourceMatcher(settings.resources)
        self._store = StateStore(settings.state_file, settings.node)
        self._store.check_writable()
        self.state = self._store.load()
        self._dirty = False  # in-memory state ahead of the file (publish ok, commit write failed)
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s, rng)
        self._stop = threading.Event()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.PodResourcesListerStub | None = None
        self._get_served: bool | None = None  # unknown until first asked
        self._alloc_served: bool | None = None
        self._last_rejects: set[Reject] = set()
        self._failing: str | None = None
        self._failed_polls = 0
        #: Failed polls by kind (socket_missing, unavailable, resource_exhausted, ...), for health and tests.
        self.failures: Counter[str] = Counter()
        self._failure_counter = meter(COLLECTOR).create_counter(
            "gpuledger.source.failures", description="Polls of the source that failed, by kind")
        if self.state.assignments or self.state.allocatable:
            log.info("resuming node %s from %s: %d assignment(s), %d allocatable set(s) already published",
                     self.node, self._store.path, len(self.state.assignments), len(self.state.allocatable))

    # -- kubelet -----------------------------------------------------------------

    def _connect(self) -> pb_grpc.PodResourcesListerStub:
        path = self.settings.socket
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            self._disconnect()  # the kubelet went away; its next socket gets a fresh channel
            raise KubeletUnavailable("socket_missing", f"kubelet pod-resources socket {path} does not exist: is the kubelet running, "
                                     "and is /var/lib/kubelet/pod-resources mounted (hostPath, the directory)?") from None
        except OSError as exc:
            raise KubeletUnavailable("socket_missing", f"cannot stat kubelet socket {path}: {exc}") from exc
        if not stat.S_ISSOCK(mode):
            self._disconnect()
            raise KubeletUnavailable("not_a_socket", f"{path} exists but is not a unix socket (a hostPath of the socket file "
                                     "itself turns into a directory when the kubelet is down: mount the directory instead)")
        if self._stub is None:
            limit = self.settings.max_message_mb * 1024 * 1024
            self._channel = grpc.insecure_channel(f"unix://{path}", options=[("grpc.max_receive_message_length", limit)])
            self._stub = pb_grpc.PodResourcesListerStub(self._channel)
            # A new connection may be a new (upgraded) kubelet: ask again what it serves.
            self._get_served = self._alloc_served = None
        return self._stub

    def _disconnect(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def _call(self, method: str, request: Any) -> Any:
        stub = self._connect()
        try:
            return getattr(stub, method)(request, timeout=self.settings.rpc_timeout_s)
        except grpc.RpcError as exc:
            kind = _RETRY_CODES.get(exc.code(), "rpc_error")
            if kind in ("unavailable", "deadline_exceeded"):
                self._disconnect()  # a new channel finds a re-created socket without gRPC's own reconnect delay
            raise KubeletUnavailable(kind, f"kubelet {method} failed: {exc.code().name} {exc.details()}{_HINTS.get(kind, '')}") from exc

    def _allocatable(self) -> pb.AllocatableResourcesResponse | None:
        if self._alloc_served is False:
            return None
        try:
            response = self._call("GetAllocatableResources", pb.AllocatableResourcesRequest())
        except KubeletUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.RpcError) and exc.kind == "rpc_error" and _not_served(cause):
                log.warning("kubelet on %s does not serve GetAllocatableResources (%s): no gpu.allocatable events", self.node, cause.details())
                self._alloc_served = False
                return None
            raise
        self._alloc_served = True
        return response

    def _still_there(self, namespace: str, pod: str) -> pb.PodResources | None:
        """Ask Get about a pod List no longer shows; the pod if it still exists, else None."""
        if self._get_served is False or not self.settings.confirm_releases_with_get:
            return None
        try:
            response = self._call("Get", pb.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace))
        except KubeletUnavailable as exc:
            cause = exc.__cause__
            if not isinstance(cause, grpc.RpcError) or exc.kind != "rpc_error":
                raise  # rate limited / unavailable: retry the whole poll later
            if _not_served(cause):
                log.info("kubelet on %s does not serve Get (%s): releases are taken from List alone", self.node, cause.details())
                self._get_served = False
                return None
            if _get_not_found(cause):
                self._get_served = True
                return None
            log.warning("kubelet Get %s/%s failed (%s): taking List's word that the pod is gone", namespace, pod, exc)
            return None
        self._get_served = True
        return response.pod_resources

    def _observe(self) -> Observation:
        listed = self._call("List", pb.ListPodResourcesRequest())
        obs = observe(listed.pod_resources, self._allocatable(), self._matches)
        # A pod that vanished from List is confirmed with Get before its devices are released.
        held_pods = {(k.namespace, k.pod) for k in self.state.assignments}
        for namespace, pod in sorted(held_pods - {(p.namespace, p.name) for p in listed.pod_resources}):
            found = self._still_there(namespace, pod)
            if found is not None and found.name == pod and found.namespace == namespace:
                observe_pod(found, self._matches, obs)
        return obs

    # -- events ------------------------------------------------------------------

    def _assignment_event(self, key: AssignmentKey, held: Held, action: Literal["assigned", "released"], observed: datetime) -> GpuEvent:
        ref = parse_device_id(key.device_id)
        return GpuEvent(
            event_id=make_event_id(COLLECTOR, (self.node, key.namespace, key.pod, key.container, key.resource, key.device_id, action), held.since),
            event_type=f"gpu.{action}",
            occurred_at=datetime.fromisoformat(held.since) if action == "assigned" else observed,
            observed_at=observed,
            source=Source(collector=COLLECTOR, host=self.node),
            identity=Identity(namespace=key.namespace, pod=key.pod, node=self.node, gpu_id=key.device_id),
            payload=GpuPayload(node=self.node, namespace=key.namespace, pod=key.pod, container=key.container, resource_name=key.resource,
                               device_id=key.device_id, gpu=ref.gpu, mig_instance=ref.mig_instance, share=ref.share, numa_nodes=held.numa),
        )

    def _allocatable_event(self, resource: str, current: AllocatableSet, observed: datetime) -> GpuEvent:
        return GpuEvent(
            event_id=make_event_id(COLLECTOR, (self.node, resource, "allocatable"), current.since),
            event_type="gpu.allocatable",
            occurred_at=datetime.fromisoformat(current.since),
            observed_at=observed,
            source=Source(collector=COLLECTOR, host=self.node),
            identity=Identity(node=self.node),
            payload=GpuPayload(node=self.node, resource_name=resource, devices=current.devices, numa_nodes=current.numa),
        )

    # -- one cycle -----------------------------------------------------------------

    def _account_rejects(self, rejects: list[Reject]) -> int:
        """Count and log each malformed entry once (until it disappears); one line per poll."""
        current = set(rejects)
        new = sorted(current - self._last_rejects, key=lambda r: (r.reason, r.subject))
        self._last_rejects = current
        if new:
            self.counters.add_received(len(new))
        for r in new:
            self.counters.add_rejected(r.reason)
        if new:
            shown = "; ".join(f"{r.subject}: {r.detail} [{r.reason}]" for r in new[:5])
            more = f" (+{len(new) - 5} more)" if len(new) > 5 else ""
            log.warning("node %s: skipped %d malformed kubelet entr%s: %s%s", self.node, len(new), "y" if len(new) == 1 else "ies", shown, more)
        return len(new)

    def poll_once(self) -> PollResult:
        """Ask the kubelet, diff, publish, commit. Raises KubeletUnavailable, PublishError, EventTooLarge, StateFileError."""
        observed = datetime.now(timezone.utc)
        obs = self._observe()
        rejected = self._account_rejects(obs.rejects)
        plan = plan_changes(self.state, obs, observed.isoformat(timespec="microseconds"))
        result = PollResult(len(plan.assigned), len(plan.released), len(plan.allocatable), rejected, 0, len(obs.assignments))
        if plan.empty:
            if self._dirty:
                self._store.save(self.state)
                self._dirty = False
            log.debug("node %s: %d device assignment(s) held, no change", self.node, result.held)
            return result
        events = ([self._assignment_event(k, h, "released", observed) for k, h in plan.released]
                  + [self._assignment_event(k, h, "assigned", observed) for k, h in plan.assigned]
                  + [self._allocatable_event(r, s, observed) for r, s in plan.allocatable])
        self.counters.add_received(len(events))
        # Write-ahead: the generations of this batch survive a crash before the commit.
        if plan.in_flight != self.state:
            self._store.save(plan.in_flight)
            self.state = plan.in_flight
        # Events too large to travel are dead-lettered by the publisher, not sent.
        result.published = self.publisher.publish_fitting(events, COLLECTOR)
        self.state = plan.after
        try:
            self._store.save(plan.after)
            self._dirty = False
        except StateFileError:
            self._dirty = True  # published; the next poll retries the write
            raise
        log.info("node %s: published %d event(s): %d assigned, %d released, %d allocatable; %d assignment(s) held, %d malformed skipped",
                 self.node, result.published, result.assigned, result.released, result.allocatable, result.held, rejected)
        return result

    # -- lifecycle ---------------------------------------------------------------

    def _failed(self, kind: str, exc: Exception) -> None:
        self.failures[kind] += 1
        self._failed_polls += 1
        self._failure_counter.add(1, {"component": COLLECTOR, "kind": kind})
        if kind != self._failing:
            log.error("node %s: %s (retrying with back-off; repeats are logged at DEBUG)", self.node, exc)
            self._failing = kind
        else:
            log.debug("node %s: still failing: %s", self.node, exc)

    def _recovered(self) -> None:
        if self._failing is not None:
            log.info("node %s: recovered after %d failed poll(s)", self.node, self._failed_polls)
        self._failing = None
        self._failed_polls = 0
        self._backoff.reset()

    def run(self) -> None:
        """Poll until ``stop()``; then flush the producer and close the channel."""
        log.info("collecting pod resources on node %s from %s every %.1fs (resources: %s)", self.node, self.settings.socket,
                 self.settings.interval_s, ", ".join(self.settings.resources))
        try:
            while not self._stop.is_set():
                try:
                    self.poll_once()
                except KubeletUnavailable as exc:
                    self._failed(exc.kind, exc)
                except PublishError as exc:
                    self._failed("kafka_unavailable", exc)
                except EventTooLarge as exc:
                    # Kafka refused a record the size check passed (topic limit lowered): the
                    # publisher re-reads the limit, so the retry dead-letters what no longer fits.
                    self._failed("event_too_large", exc)
                except StateFileError as exc:
                    self._failed("state_file", exc)
                else:
                    self._recovered()
                    self._stop.wait(self.settings.interval_s)
                    continue
                self._stop.wait(self._backoff.next_delay())
        finally:
            self.close()
            log.info("node %s: stopped, producer flushed", self.node)

    def stop(self) -> None:
        """Ask ``run`` to return after the current poll (from another thread)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        self._disconnect()
        self.publisher.close()


# --- CLI -------------------------------------------------------------------------------

def collect_podresources(
    socket: Optional[Path] = typer.Option(None, "--socket", help="Kubelet pod-resources socket (default: GPULEDGER_PODRESOURCES_SOCKET, else /var/lib/kubelet/pod-resources/kubelet.sock)."),
    node: Optional[str] = typer.Option(None, "--node", help="This node's name (default: GPULEDGER_PODRESOURCES_NODE)."),
    interval: Optional[float] = typer.Option(None, "--interval", help="Seconds between polls (default 10)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Where the last published snapshot lives (default /var/lib/gpuledger)."),
    resource: Optional[list[str]] = typer.Option(None, "--resource", help="Resource name to publish; repeat it; a trailing '*' makes a prefix."),
    bootstrap: Optional[str] = typer.Option(None, "--bootstrap", help="Kafka bootstrap servers (default: GPULEDGER_KAFKA_BOOTSTRAP, else the local broker)."),
) -> None:
    """Publish a node's GPU assignments from the kubelet's pod-resources API."""
    from gpuledger.cli import fail, load_settings

    settings = load_settings(bootstrap)
    try:
        pr_settings = PodResourcesSettings.load(socket=socket, node=node, interval_s=interval, state_dir=state_dir,
                                                resources=tuple(resource) if resource else None)
    except SettingsError as exc:
        fail(str(exc), 2)
    try:
        publisher = EventPublisher.from_settings(settings, COLLECTOR)
        collector = PodResourcesCollector(pr_settings, publisher)
    except ProducerError as exc:
        fail(str(exc))
    # The handler runs on the main thread, possibly while it holds the stop Event's lock
    # inside Event.wait(); setting the Event from a helper thread cannot deadlock.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=collector.stop, daemon=True).start())
    collector.run()


def register(app: typer.Typer) -> None:
    """Add `gpuledger collect podresources` (and the `collect` group if missing)."""
    from producers import collect_cli

    collect_cli.register(app)
    if not any(cmd.name == "podresources" for cmd in collect_cli.collect_app.registered_commands):
        collect_cli.collect_app.command("podresources")(collect_podresources)
