"""Kubelet pod-resources collector: which GPU each container on a node holds.

Input: the kubelet's PodResourcesLister v1 gRPC service on its unix socket
(default /var/lib/kubelet/pod-resources/kubelet.sock), polled every ``interval_s``:
``List`` (the active pods' device-plugin allocations), ``GetAllocatableResources``
(the node's devices) and, where the kubelet serves it, ``Get`` (to confirm that a
pod missing from ``List`` is gone before its devices are released; the kubelet's
List purges the devices of inactive pods first, so Get never holds a release for a
finished pod — it only guards against a pod missing from one List answer).
Only resources matching the configured names (default ``producers._config.GPU_RESOURCES``,
shared with the scheduler collector: ``nvidia.com/gpu``, ``nvidia.com/gpu.shared``, the
prefix ``nvidia.com/mig-*``, ...) are considered.

Output: ``GpuEvent``s on the gpu topic, keyed by namespace/pod:
``gpu.assigned`` / ``gpu.released`` per (node, namespace/pod, container, resource,
device id), and one ``gpu.allocatable`` per resource whose allocatable device set
changed. Device ids are kept verbatim and also parsed (``parse_device_id``) into the
physical GPU, the MIG instance and the time-slicing share. The diff itself is pure and
lives in ``producers.podresources.snapshot``; the settings in ``producers.podresources.config``.

Guarantees:
- Each snapshot is diffed against the last *published* one, which is persisted
  atomically (``producers._runtime.StateFile``) in the state dir only after Kafka acknowledged the
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
  retried with the producers' one back-off (``producers._runtime``); the process stays up, counts
  every failed poll, and logs once per change of failure state.
- ``Get`` never fails a poll for being rate limited: the kubelet limits this API for all its
  clients together (burst 10, 100/s, refused at once), so a poll that asked about every pod
  gone from ``List`` (a drain, a multi-pod Job ending) would be refused again on every retry
  and never publish. A poll asks at most ``max_gets_per_poll`` of them, those asked longest
  ago first, and stops asking at the first refusal; the pods not asked stay held and are
  decided by a later poll, so their releases come a few polls late but do come.
- A kubelet restart does not release the node's GPUs: a restarted kubelet serves this API
  before its pods came from the API server, so its first List answers are empty. After each
  (re)connect (at start, or when the kubelet re-created its socket), a List that lacks at least
  half of the pods holding GPUs and shows no new GPU pod releases nothing until it has stayed so
  ``restart_grace_s`` (``_restart_guard``); pods really gone are released after it. Nor does it
  empty the node's allocatable sets: a restarted kubelet lists a resource's devices only once its
  device plugin registered again, so on a new connection a set smaller than the published one is
  not published until it has stayed so ``restart_grace_s`` (``_allocatable_guard``, per resource).
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
  collector noticed, at most one interval (plus back-off) late — more when more pods than
  ``max_gets_per_poll`` left at once or ``Get`` was rate limited (one interval per further poll),
  and up to ``restart_grace_s`` more when they left while the collector or the kubelet restarted
  (a device leaving the allocatable set across a restart likewise).
- A device plugin restarting under a running kubelet empties its resource's allocatable set until
  it registered again (the kubelet marks its devices unhealthy; the kubelet's socket stays): that
  is published, as the collector cannot tell it from the devices failing.
- A release may be published for an assignment whose publish failed part-way (the
  collector cannot know whether Kafka kept it); downstream treats a release of an
  unknown assignment as a no-op. Conversely, if a batch holding a release fails after
  part of it reached Kafka and the kubelet shows the device assigned again before the
  retry, that stray release stands until the assignment next changes.
- DRA (``dynamic_resources``) allocations of the GPU drivers in ``dra_drivers`` are published
  as assignments of ``<driver>/<pool>/<device>`` (``snapshot._dra_devices``); the claim behind
  them is not named (the worker merges them with the scheduler collector's ResourceClaim
  reports by node, device and time: ``streams.correlate.entities.merge_dra``).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

import grpc
from tenacity import RetryCallState

from gpuledger.telemetry import meter
from producers._config import ResourceMatcher
from producers._errors import EventTooLarge, PublishError, StateFileError
from producers._kafka import EventPublisher
from producers._runtime import StateFile, Stopped, call_with_backoff, retry_error
from producers.podresources.config import PodResourcesSettings
from producers.podresources.proto import podresources_v1_pb2 as pb
from producers.podresources.proto import podresources_v1_pb2_grpc as pb_grpc
from producers.podresources.snapshot import (
    COLLECTOR,
    AllocatableSet,
    AssignmentKey,
    CollectorState,
    Held,
    Observation,
    PodResourcesError,
    Reject,
    observe,
    observe_pod,
    parse_device_id,
    plan_changes,
)
from schemas.envelope import Identity, Source, make_event_id
from schemas.gpu import GpuEvent, GpuPayload

log = logging.getLogger(__name__)


# --- errors ----------------------------------------------------------------------------

class KubeletUnavailable(PodResourcesError):
    """The kubelet could not be asked this poll (socket missing, rate limited, down)."""

    retriable = True

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# --- state file ------------------------------------------------------------------------

class StateStore:
    """The snapshot file (``StateFile``): read once at start, replaced atomically after each commit."""

    def __init__(self, path: Path, node: str) -> None:
        self.file = StateFile(path, hint="mount a writable hostPath there or set GPULEDGER_PODRESOURCES_STATE_DIR")
        self.path = self.file.path
        self.node = node

    def check_writable(self) -> None:
        self.file.check_writable()

    def load(self) -> CollectorState:
        """The persisted state; an empty one when there is none.

        A file that cannot be parsed is moved aside (``*.corrupt-<time>``) and the
        collector starts empty: it then re-publishes what is assigned now (new ids)
        and cannot release what vanished meanwhile — logged as an error, because that
        is the one case where history can double up.
        """
        data = self.file.read()
        if data is None:
            return CollectorState(self.node)
        try:
            state = CollectorState.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.file.quarantine(f"{exc}; current assignments will be re-published with new ids")
            return CollectorState(self.node)
        if state.node != self.node:
            raise StateFileError(f"state file {self.path} belongs to node {state.node!r}, not {self.node!r}: "
                                 "is the state dir shared between nodes? It must be per node (hostPath).")
        return state

    def save(self, state: CollectorState) -> None:
        self.file.write(state.to_json(), indent=1, sort_keys=True)


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
    deferred: int = 0  # pods missing from List kept held without a Get answer (cap or rate limit)
    withheld: int = 0  # pods missing from List kept held because the kubelet may not have its pods yet (restart_grace_s)
    allocatable_withheld: int = 0  # resources whose shrunken allocatable set is not published yet: the device plugin may not have re-registered


class PodResourcesCollector:
    """Polls the kubelet's pod-resources API and publishes GPU assignment changes.

    ``poll_once`` does one cycle and raises on failure; ``run`` loops with back-off
    until ``stop`` is called (SIGTERM), then flushes the producer.
    """

    def __init__(self, settings: PodResourcesSettings, publisher: EventPublisher,
                 clock: Callable[[], datetime] | None = None) -> None:
        self.settings = settings
        #: The time of a poll (``observed_at``; the restart grace is measured with it); tests step it.
        self._clock = clock or (lambda: datetime.now(timezone.utc))
        self.publisher = publisher
        self.counters = publisher.counters
        self.node = settings.node
        self._matches = ResourceMatcher(settings.resources)
        self._dra = ResourceMatcher(settings.dra_drivers) if settings.dra_drivers else None
        self._store = StateStore(settings.state_file, settings.node)
        self._store.check_writable()
        self.state = self._store.load()
        self._dirty = False  # in-memory state ahead of the file (publish ok, commit write failed)
        self._stop = threading.Event()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.PodResourcesListerStub | None = None
        self._get_served: bool | None = None  # unknown until first asked
        self._alloc_served: bool | None = None
        self._polls = 0
        #: (namespace, pod) missing from List -> the poll that last asked Get about it (fair turns under the cap)
        self._asked: dict[tuple[str, str], int] = {}
        self._deferred = 0
        #: The kubelet's socket as last seen (device, inode, ctime): a new one is a restarted kubelet.
        self._socket_id: tuple[int, int, int] | None = None
        #: A new connection (at start, after a reconnect) whose kubelet has not yet shown the held pods.
        self._unproven = True
        #: When a List of an unproven connection first lacked most held pods (the restart grace runs from it).
        self._suspect_since: datetime | None = None
        self._withheld = 0
        #: Resources whose allocatable set this connection has shown no smaller than the published one.
        self._alloc_proven: set[str] = set()
        #: Resource -> when a connection not yet proven for it first showed its allocatable set shrunken (the grace runs from it).
        self._alloc_suspect: dict[str, datetime] = {}
        self._alloc_withheld = 0
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
            st = os.stat(path)
            mode = st.st_mode
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
        socket_id = (st.st_dev, st.st_ino, st.st_ctime_ns)
        if self._socket_id is not None and socket_id != self._socket_id and self._stub is not None:
            # The kubelet re-created its socket (it restarted) between two polls: gRPC's channel
            # may reconnect by itself and never fail a call, so the restart is noticed here.
            log.info("node %s: the kubelet's socket %s was re-created (a kubelet restart): reconnecting", self.node, path)
            self._disconnect()
        self._socket_id = socket_id
        if self._stub is None:
            limit = self.settings.max_message_mb * 1024 * 1024
            self._channel = grpc.insecure_channel(f"unix://{path}", options=[("grpc.max_receive_message_length", limit)])
            self._stub = pb_grpc.PodResourcesListerStub(self._channel)
            # A new connection may be a new (upgraded) kubelet: ask again what it serves.
            self._get_served = self._alloc_served = None
            # ... and a restarted one, which lists no pods until the API server sent them, and no
            # allocatable devices of a resource until its device plugin registered again.
            self._unproven = True
            self._alloc_proven.clear()
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
        if not self._asks_get():
            return None
        try:
            response = self._call("Get", pb.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace))
        except KubeletUnavailable as exc:
            cause = exc.__cause__
            if not isinstance(cause, grpc.RpcError) or exc.kind != "rpc_error":
                raise  # rate limited: the caller keeps the pod held; unavailable: the poll is retried
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

    def _asks_get(self) -> bool:
        return self._get_served is not False and self.settings.confirm_releases_with_get

    def _keep_held(self, obs: Observation, namespace: str, pod: str) -> None:
        """Observe a pod's published assignments as they are: its release waits for a poll that can ask Get."""
        for key, held in self.state.assignments.items():
            if key.namespace == namespace and key.pod == pod:
                obs.assignments[key] = held.numa

    def _restart_guard(self, obs: Observation, held_pods: set[tuple[str, str]], missing: set[tuple[str, str]], observed: datetime) -> bool:
        """Whether this List, on a connection whose kubelet has not yet shown the held pods, must
        not release any of them; it keeps them held in ``obs`` if so.

        A restarted kubelet serves this API before its pods came from the API server (its List and
        Get read the same pod list, empty until then; the whole outage if the API server is
        unreachable), and the collector reconnects within seconds. Such a List looks like every pod
        left. So a List of a new connection that lacks at least half of the pods holding GPUs (a
        restarted kubelet may already list static pods from its manifest directory) and shows no
        GPU pod that was not held (only a kubelet that has the API server's pods can have admitted a
        new one) releases nothing until it has stayed so ``restart_grace_s``. ``Get`` is not asked
        meanwhile: its "not found" comes from the same empty list. The first List showing more than
        half of the held pods, or a new GPU pod, proves the connection and ends the wait.
        """
        if not self._unproven:
            return False
        pending_pods = {(k.namespace, k.pod) for k in self.state.pending_assignments}
        newcomers = {(k.namespace, k.pod) for k in obs.assignments} - held_pods - pending_pods
        suspicious = bool(missing) and 2 * len(missing) >= len(held_pods) and not newcomers and self.settings.restart_grace_s > 0
        if not suspicious:
            if self._suspect_since is not None:
                log.info("node %s: the kubelet lists the node's pods again (%d of %d pod(s) holding GPUs listed%s): releases resume",
                         self.node, len(held_pods) - len(missing), len(held_pods),
                         f", {len(newcomers)} new GPU pod(s)" if newcomers else "")
            self._unproven, self._suspect_since = False, None
            return False
        if self._suspect_since is None:
            self._suspect_since = observed
            log.warning("node %s: right after connecting, the kubelet's List lacks %d of the %d pod(s) holding GPUs: a restarted kubelet "
                        "lists no pods until the API server sent them, so nothing is released unless it stays so for %gs",
                        self.node, len(missing), len(held_pods), self.settings.restart_grace_s)
        waited = observed - self._suspect_since
        if waited < timedelta(seconds=self.settings.restart_grace_s):
            for namespace, pod in missing:
                self._keep_held(obs, namespace, pod)
            self._withheld = len(missing)
            return True
        log.warning("node %s: %d of %d pod(s) holding GPUs still missing from the kubelet's List after %.0fs (since %s): releasing them, "
                    "%.0fs after the first poll that missed them", self.node, len(missing), len(held_pods), waited.total_seconds(),
                    self._suspect_since.isoformat(timespec="seconds"), waited.total_seconds())
        self._unproven, self._suspect_since = False, None
        return False

    def _allocatable_guard(self, obs: Observation, observed: datetime) -> None:
        """Keep in ``obs`` the published allocatable set of each resource whose set, on a connection
        that has not yet shown it whole, is smaller than the published one — for ``restart_grace_s``.

        A restarted kubelet serves this API before its device plugins registered again: its device
        manager restores from its checkpoint only the resource names, with no healthy device
        (``devicemanager.ManagerImpl.readCheckpoint``), and ``GetAllocatableResources`` lists a
        resource's devices only once its plugin has registered and sent them through ListAndWatch
        (``GetAllocatableDevices`` filters the devices known by the healthy ones). Taken at its word,
        the node's GPUs left and came back a few seconds later in two ``gpu.allocatable`` events.
        Per resource, since plugins register one by one: the first set that is not a strict subset of
        the published one (the same, or with a device not published) proves the resource for this
        connection; one still smaller after the grace is published (the devices really left).
        """
        if obs.allocatable is None or self.settings.restart_grace_s <= 0:
            return
        grace = timedelta(seconds=self.settings.restart_grace_s)
        for resource in sorted(set(self.state.allocatable) | set(obs.allocatable)):
            if resource in self._alloc_proven:
                continue
            published, seen = self.state.allocatable.get(resource), obs.allocatable.get(resource)
            seen_devices = set(seen.devices) if seen is not None else set()
            if published is None or not seen_devices < set(published.devices):
                if self._alloc_suspect.pop(resource, None) is not None:
                    log.info("node %s: the kubelet lists %d allocatable %s device(s) again: its device plugin registered",
                             self.node, len(seen_devices), resource)
                self._alloc_proven.add(resource)
                continue
            since = self._alloc_suspect.get(resource)
            if since is None:
                since = self._alloc_suspect[resource] = observed
                log.warning("node %s: right after connecting, the kubelet lists %d of the %d allocatable %s device(s): a restarted kubelet "
                            "lists a resource's devices only once its device plugin registered again, so the set is not published "
                            "unless it stays so for %gs", self.node, len(seen_devices), len(published.devices), resource,
                            self.settings.restart_grace_s)
            if observed - since < grace:
                obs.allocatable[resource] = published
                self._alloc_withheld += 1
                continue
            log.warning("node %s: the kubelet still lists %d of the %d allocatable %s device(s) after %.0fs (since %s): publishing the "
                        "smaller set", self.node, len(seen_devices), len(published.devices), resource, (observed - since).total_seconds(),
                        since.isoformat(timespec="seconds"))
            del self._alloc_suspect[resource]
            self._alloc_proven.add(resource)

    def _observe(self, observed: datetime) -> Observation:
        self._polls += 1
        self._withheld = self._alloc_withheld = 0
        listed = self._call("List", pb.ListPodResourcesRequest())
        obs = observe(listed.pod_resources, self._allocatable(), self._matches, self._dra)
        self._allocatable_guard(obs, observed)
        # A pod that vanished from List is confirmed with Get before its devices are released:
        # at most max_gets_per_poll of them per poll, and none after the kubelet's rate limit
        # refused one (its bucket is shared with every other client; asking on would only be
        # refused too). The others stay held this poll; the ones asked longest ago go first
        # next time, so a pod Get keeps finding cannot starve the rest.
        held_pods = {(k.namespace, k.pod) for k in self.state.assignments}
        missing = held_pods - {(p.namespace, p.name) for p in listed.pod_resources}
        self._asked = {p: n for p, n in self._asked.items() if p in missing}
        gets, refused, self._deferred = 0, False, 0
        if self._restart_guard(obs, held_pods, missing, observed):
            return obs
        for namespace, pod in sorted(missing, key=lambda p: (self._asked.get(p, 0), p)):
            if self._asks_get():
                if refused or gets >= self.settings.max_gets_per_poll:
                    self._keep_held(obs, namespace, pod)
                    self._deferred += 1
                    continue
                gets += 1
                self._asked[(namespace, pod)] = self._polls
            try:
                found = self._still_there(namespace, pod)
            except KubeletUnavailable as exc:
                if exc.kind != "resource_exhausted":
                    raise  # the kubelet is down or slow: retry the whole poll later
                log.info("node %s: kubelet rate-limited Get %s/%s: it and %d other pod(s) missing from List stay held until a later poll",
                         self.node, namespace, pod, len(missing) - gets)
                refused = True
                self._keep_held(obs, namespace, pod)
                self._deferred += 1
                continue
            if found is not None and found.name == pod and found.namespace == namespace:
                observe_pod(found, self._matches, obs, self._dra)
        return obs

    # -- events ------------------------------------------------------------------

    def _assignment_event(self, key: AssignmentKey, held: Held, action: Literal["assigned", "released"], observed: datetime) -> GpuEvent:
        ref = parse_device_id(key.device_id)
        # A DRA device (resource = its driver): '<driver>/<pool>/<device>'; pools may hold '/', device names do not.
        dra = self._dra is not None and self._dra(key.resource) and key.device_id.startswith(key.resource + "/")
        pool = key.device_id[len(key.resource) + 1:key.device_id.rindex("/")] if dra else None
        return GpuEvent(
            event_id=make_event_id(COLLECTOR, (self.node, key.namespace, key.pod, key.container, key.resource, key.device_id, action), held.since),
            event_type=f"gpu.{action}",
            occurred_at=datetime.fromisoformat(held.since) if action == "assigned" else observed,
            observed_at=observed,
            source=Source(collector=COLLECTOR, host=self.node),
            identity=Identity(namespace=key.namespace, pod=key.pod, node=self.node, gpu_id=key.device_id),
            payload=GpuPayload(node=self.node, namespace=key.namespace, pod=key.pod, container=key.container, resource_name=key.resource,
                               device_id=key.device_id, gpu=None if dra else ref.gpu, mig_instance=None if dra else ref.mig_instance,
                               share=None if dra else ref.share, numa_nodes=held.numa, driver=key.resource if dra else None, pool=pool),
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
        observed = self._clock()
        obs = self._observe(observed)
        rejected = self._account_rejects(obs.rejects)
        plan = plan_changes(self.state, obs, observed.isoformat(timespec="microseconds"))
        result = PollResult(len(plan.assigned), len(plan.released), len(plan.allocatable), rejected, 0, len(obs.assignments), self._deferred,
                            self._withheld, self._alloc_withheld)
        if plan.empty:
            if self._dirty:
                self._store.save(self.state)
                self._dirty = False
            log.debug("node %s: %d device assignment(s) held, no change; %d pod(s) missing from List await Get, %d the kubelet's pod list, "
                      "%d allocatable set(s) a device plugin", self.node, result.held, result.deferred, result.withheld,
                      result.allocatable_withheld)
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
        log.info("node %s: published %d event(s): %d assigned, %d released, %d allocatable; %d assignment(s) held, %d malformed skipped, "
                 "%d pod(s) missing from List await Get", self.node, result.published, result.assigned, result.released, result.allocatable,
                 result.held, rejected, result.deferred)
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

    def _poll_failed(self, state: RetryCallState) -> None:
        exc = retry_error(state)
        if isinstance(exc, KubeletUnavailable):
            self._failed(exc.kind, exc)
        elif isinstance(exc, PublishError):
            self._failed("kafka_unavailable", exc)
        elif isinstance(exc, EventTooLarge):
            # Kafka refused a record the size check passed (topic limit lowered): the
            # publisher re-reads the limit, so the retry dead-letters what no longer fits.
            self._failed("event_too_large", exc)
        else:
            self._failed("state_file", exc)

    def run(self) -> None:
        """Poll until ``stop()``, backing off while polls fail; then flush the producer and close the channel."""
        log.info("collecting pod resources on node %s from %s every %.1fs (resources: %s)", self.node, self.settings.socket,
                 self.settings.interval_s, ", ".join(self.settings.resources))
        try:
            while not self._stop.is_set():
                try:
                    call_with_backoff(self.poll_once, stop=self._stop, initial_s=self.settings.backoff_initial_s,
                                      max_s=self.settings.backoff_max_s, on_retry=self._poll_failed,
                                      retry_on=(KubeletUnavailable, PublishError, EventTooLarge, StateFileError))
                except Stopped:
                    break
                self._recovered()
                self._stop.wait(self.settings.interval_s)
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
