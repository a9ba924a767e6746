"""Scheduler collector: the Kubernetes / Kueue scheduling plane as scheduler events.

Input: the Kubernetes API, through the official ``kubernetes`` client (kubeconfig or
in-cluster service account): list+watch of Pods (only those requesting one of the
configured extended resources, default ``nvidia.com/gpu``, or with DRA on naming a
ResourceClaim), Events about pods (``events.k8s.io/v1``, or core/v1 where that group is
not served) and Kueue Workloads (by the pods' rule, on their pod sets' templates:
``kueue.x-k8s.io`` v1beta2, else v1beta1; skipped while Kueue is absent
and re-discovered every ``discovery_interval_s``), DRA ResourceSlices
(``resource.k8s.io`` v1, v1beta2 or v1beta1, likewise re-discovered; cluster-wide only):
what each ``<driver>/<pool>/<device>`` of a GPU driver is (``producers.kubernetes.dra``),
and DRA ResourceClaims (same group and version; the namespace's own with ``namespace`` set):
which pod holds which of those devices (``producers.kubernetes.claims``).

Output: ``SchedulerEvent``s on the scheduler topic (and ``gpu.device`` events on the gpu
topic, from ResourceSlices; ``gpu.claim_reserved`` / ``gpu.claim_released`` there, from
ResourceClaims, keyed by the holding pod's namespace/pod), keyed by release_id where a label names it, else by workload_id (rule in ``producers.kubernetes.mapping``). The mapping of
each object to its transitions is pure and lives in ``producers.kubernetes.mapping``;
the settings in ``producers.kubernetes.config``.

Guarantees:
- Each object's transitions are derived from its current state, so a re-list (after
  ``410 Expired``, an error or a restart) re-derives the same facts with the same
  deterministic event ids. The keys of the facts published per object uid are kept
  in ``<state_dir>/scheduler-state.json``, written atomically (``producers._runtime.StateFile``)
  only after Kafka acknowledged the batch; an unchanged object is never
  re-sent, and a crash between ack and write re-sends the same ids (harmless).
- Objects that disappeared while the collector was not watching (down, or between a
  410 and the re-list) get their ``deleted`` event from the re-list.
- A watch resumes from the last resourceVersion it saw (objects and BOOKMARKs); 410
  leads to a re-list; API errors (5xx, 429, dropped connections) are retried with the
  producers' one back-off (``producers._runtime``), without advancing past unpublished events.
- ``stop()`` / SIGTERM ends the open watch streams, flushes the producer and writes
  the state before ``run`` returns (the lifecycle contract of ``producers._runtime``).
- Malformed objects (no uid, unparsable timestamps, ...) are skipped with a logged
  reason and counted as rejected ``malformed``; the rest of the batch is published.
- Nothing too large to travel is sent or silently dropped: messages are cut to 8 KiB
  with a marker (counted ``gpuledger.fields.truncated``); an event still over the
  publisher's ``max_event_bytes`` (a huge identity annotation, say) goes to the
  dead-letter topic with reason ``event_too_large``, its size and the limit, is counted
  rejected ``event_too_large`` and committed like a published one (not retried).

Limits:
- A transition the object no longer shows (a pod created and deleted between two
  lists, seen only by absence) cannot be re-derived; only its ``deleted`` is published.
- The state grows with the GPU objects alive plus tombstones kept ``tombstone_ttl_s``
  (so late Events still find their pod); one JSON file, rewritten per batch at most
  every ``state_flush_interval_s``.
- One replica: the Deployment uses strategy Recreate. Two replicas would publish the
  same ids twice (harmless downstream, but wasteful).
- Pod facts and Event facts about the same transition (PodScheduled vs a Scheduled
  Event) are separate observations; ``payload.object_kind`` tells them apart.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines
from pydantic import ValidationError
from tenacity import RetryCallState

from producers._config import ResourceMatcher
from producers.kubernetes.claims import claim_events, claim_view, gone_claim
from producers.kubernetes.dra import RESOURCE_GROUP, RESOURCE_VERSIONS, slice_devices
from producers._errors import EventTooLarge, ProducerError, PublishError, StateFileError
from producers._kafka import EventPublisher
from producers._limits import TextTrimmer
from producers._runtime import StateFile, Stopped, call_with_backoff, retry_delay, retry_error
from producers.kubernetes.config import SchedulerCollectorSettings
from producers.kubernetes.mapping import (
    SOURCE,
    EventView,
    Fact,
    KueueIndex,
    MalformedObject,
    claims_devices,
    event_fact,
    event_view,
    gpus_requested,
    meta_of,
    pod_facts,
    pod_view,
    to_event,
    workload_facts,
    workload_identity,
    workload_info,
    workload_payload,
)
from schemas.envelope import Identity, Source

log = logging.getLogger(__name__)

COMPONENT = "scheduler-collector"
STATE_FORMAT = 1
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
EVENTS_GROUP = "events.k8s.io"
_LIST_CHUNK = 500  # events per publish batch while a list is replayed


# --- errors ----------------------------------------------------------------------------

class SchedulerCollectorError(ProducerError):
    """Base error of the scheduler collector."""


class KubeConfigError(SchedulerCollectorError):
    """No usable kubeconfig / in-cluster configuration."""


class KubeApiError(SchedulerCollectorError):
    """The API server could not be listed (``run_once``: no retries there)."""

    retriable = True


class _Expired(Exception):
    """The watch's resourceVersion is too old (410): re-list."""


#: What a list, a watch or a publish may fail with and still succeed later.
_RETRIABLE = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError, PublishError, StateFileError)
_DISCOVERY_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


def build_api_client(settings: SchedulerCollectorSettings) -> k8s.ApiClient:
    """An ApiClient from the in-cluster service account or a kubeconfig."""
    cfg = k8s.Configuration()
    in_cluster = settings.in_cluster or (not settings.kubeconfig and "KUBERNETES_SERVICE_HOST" in os.environ)
    try:
        if in_cluster:
            k8s_config.load_incluster_config(client_configuration=cfg)
        else:
            k8s_config.load_kube_config(config_file=str(settings.kubeconfig) if settings.kubeconfig else None,
                                        context=settings.context, client_configuration=cfg)
    except (ConfigException, OSError, TypeError) as exc:
        where = "in-cluster service account" if in_cluster else f"kubeconfig {settings.kubeconfig or '~/.kube/config'}"
        raise KubeConfigError(f"cannot configure the Kubernetes client from the {where}: {exc} "
                              "(hint: pass --kubeconfig PATH, or --in-cluster inside a pod)") from exc
    return k8s.ApiClient(cfg)


# --- state -----------------------------------------------------------------------------

class StateStore:
    """Per-object record of what was published: uid -> {k, ns, n, keys, id, gone}.

    ``k`` kind (Pod/Workload/Event), ``keys`` the fact keys published, ``id`` the
    identity last published (so a late Event or a deletion noticed by a re-list can
    still be attributed), ``gone`` the epoch second the object was deleted (tombstone).
    """

    def __init__(self, path: Path, flush_interval_s: float = 1.0) -> None:
        self.file = StateFile(path)
        self.path = self.file.path
        self.flush_interval_s = flush_interval_s
        self._lock = threading.RLock()
        self._objects: dict[str, dict[str, Any]] = {}
        self._dirty = False
        self._last_save = 0.0
        self._load()

    def _load(self) -> None:
        # Deterministic ids make a fresh start safe: downstream collapses re-sends.
        data = self.file.read()
        if data is None:
            return
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            log.warning("state file %s has format %r, expected %d; starting empty", self.path,
                        data.get("format") if isinstance(data, dict) else type(data).__name__, STATE_FORMAT)
            return
        self._objects = {uid: {**entry, "keys": set(entry.get("keys") or ())} for uid, entry in (data.get("objects") or {}).items()}

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def get(self, uid: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._objects.get(uid)
            return None if entry is None else {**entry, "keys": set(entry["keys"])}

    def keys(self, uid: str) -> set[str]:
        with self._lock:
            entry = self._objects.get(uid)
            return set(entry["keys"]) if entry else set()

    def live(self, kind: str, namespace: str | None = None) -> dict[str, dict[str, Any]]:
        """Entries of ``kind`` not marked gone (optionally in one namespace)."""
        with self._lock:
            return {uid: dict(e) for uid, e in self._objects.items()
                    if e.get("k") == kind and not e.get("gone") and (namespace is None or e.get("ns") == namespace)}

    def commit(self, updates: Mapping[str, dict[str, Any]], drops: Iterable[str] = ()) -> None:
        with self._lock:
            for uid, upd in updates.items():
                entry = self._objects.setdefault(uid, {"keys": set()})
                entry["keys"] |= set(upd.get("keys") or ())
                for k in ("k", "ns", "n", "id", "gone", "held"):
                    if upd.get(k) is not None:
                        entry[k] = upd[k]
            for uid in drops:
                self._objects.pop(uid, None)
            self._dirty = True
        self.save()

    def prune(self, ttl_s: float, now: float | None = None) -> int:
        now = now if now is not None else time.time()
        with self._lock:
            old = [uid for uid, e in self._objects.items() if e.get("gone") and now - e["gone"] > ttl_s]
            for uid in old:
                del self._objects[uid]
            if old:
                self._dirty = True
        return len(old)

    def save(self, force: bool = False) -> None:
        """Atomic write (``StateFile``) when dirty and the interval passed."""
        with self._lock:
            if not self._dirty or (not force and time.monotonic() - self._last_save < self.flush_interval_s):
                return
            self.file.write({"format": STATE_FORMAT, "objects": {uid: {**e, "keys": sorted(e["keys"])} for uid, e in self._objects.items()}},
                            separators=(",", ":"))
            self._dirty = False
            self._last_save = time.monotonic()


# --- helpers -----------------------------------------------------------------------------

@dataclass
class _PodEntry:
    namespace: str
    name: str
    gpu: bool
    identity: Identity | None = None
    payload: dict[str, Any] | None = None


@dataclass
class _Batch:
    """Events of one list page group or one watch event, and the state they commit."""

    events: list = field(default_factory=list)
    updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    drops: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.events or self.updates or self.drops)


@dataclass
class _Resource:
    """One watched resource: how to list it and how to map its objects."""

    name: str
    kind: str  # state kind: Pod / Event / Workload
    list_fn: Callable[..., Any] | None
    field_selector: str | None
    handle: Callable[[str, Mapping, _Batch], None]
    rv: str | None = None
    failing: bool = False  # its requests are failing (a streak ``_loop`` logged); cleared by ``_recovered``


class _Denied(Exception):
    """A resource the collector's credentials may not list (HTTP 401/403)."""


def _is_gone_status(exc: ApiException) -> bool:
    return exc.status == 410


# --- the collector -----------------------------------------------------------------------

class SchedulerCollector:
    """List+watch Pods, Events and Kueue Workloads; publish each transition once.

    ``run_once()`` lists everything once and publishes (tests, ``--once``);
    ``run(stop)`` does the same and then watches until ``stop`` is set.
    """

    def __init__(self, settings: SchedulerCollectorSettings, publisher: EventPublisher, api_client: k8s.ApiClient,
                 state_dir: Path | None = None) -> None:
        self.settings = settings
        self.publisher = publisher
        self.api = api_client
        self.counters = publisher.counters
        state_dir = Path(state_dir or settings.state_dir or Path.cwd() / "scheduler-collector")
        self.state = StateStore(state_dir / "scheduler-state.json", settings.state_flush_interval_s)
        self.source = Source(collector=SOURCE, host=settings.host)
        self.resources = ResourceMatcher(settings.gpu_resources)
        self.dra_drivers = ResourceMatcher(settings.dra_drivers)
        self.index = KueueIndex()
        self._pods: dict[str, _PodEntry] = {}
        self._gone_pods: set[str] = set()  # uids a GET answered 404 for (bounded)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._streams: set[Any] = set()
        self._streams_lock = threading.Lock()
        self.kueue_version: str | None = None
        self.dra_version: str | None = None
        self.events_api: str | None = None  # "events.k8s.io/v1" or "v1"
        self._discovered_at = 0.0
        self._discover_lock = threading.Lock()
        self._closed = False
        self.pods = _Resource("pods", "Pod", None, None, self._handle_pod)
        self.events = _Resource("events", "Event", None, None, self._handle_event)
        self.workloads = _Resource("workloads", "Workload", None, None, self._handle_workload)
        self.slices = _Resource("resourceslices", "ResourceSlice", None, None, self._handle_slice)
        self.claims = _Resource("resourceclaims", "ResourceClaim", None, None, self._handle_claim)

    # -- API plumbing -------------------------------------------------------------------

    def discover(self) -> None:
        """Which events API and which Kueue version the cluster serves."""
        with self._discover_lock:
            self._discover()

    def _discover(self) -> None:
        groups = k8s.ApisApi(self.api).get_api_versions(_request_timeout=self.settings.request_timeout_s)
        served = {g.name: [v.version for v in g.versions or []] for g in groups.groups or []}
        ns = self.settings.namespace
        core, ev1, custom = k8s.CoreV1Api(self.api), k8s.EventsV1Api(self.api), k8s.CustomObjectsApi(self.api)
        self.pods.list_fn = (lambda **kw: core.list_namespaced_pod(ns, **kw)) if ns else core.list_pod_for_all_namespaces
        events_api = f"{EVENTS_GROUP}/v1" if "v1" in served.get(EVENTS_GROUP, []) else "v1"
        if events_api != self.events_api:
            log.info("events: watching %s Events", events_api)
            self.events.rv = None
        self.events_api = events_api
        if events_api == "v1":
            self.events.list_fn = (lambda **kw: core.list_namespaced_event(ns, **kw)) if ns else core.list_event_for_all_namespaces
            self.events.field_selector = "involvedObject.kind=Pod"
        else:
            self.events.list_fn = (lambda **kw: ev1.list_namespaced_event(ns, **kw)) if ns else ev1.list_event_for_all_namespaces
            self.events.field_selector = "regarding.kind=Pod"
        # A version the group lists need not serve Workloads (a CRD's version can be served: false while
        # the group's other kinds are served at it): a listed version was taken, every request was 404 and
        # nothing at all was collected (exploratory review) — the version is the first that serves them.
        version = next((v for v in KUEUE_VERSIONS if v in served.get(KUEUE_GROUP, []) and _serves(custom, KUEUE_GROUP, v, "workloads",
                                                                                                  self.settings.request_timeout_s)),
                       None) if self.settings.kueue else None
        if version != self.kueue_version or not self._discovered_at:
            log.info("kueue: %s", f"watching {KUEUE_GROUP}/{version} Workloads" if version else "not served by this cluster; Workloads skipped")
            self.workloads.rv = None
        self.kueue_version = version
        if version is None:
            self.workloads.list_fn = None
        elif ns:
            self.workloads.list_fn = lambda **kw: custom.list_namespaced_custom_object(KUEUE_GROUP, version, ns, "workloads", **kw)
        else:
            self.workloads.list_fn = lambda **kw: custom.list_cluster_custom_object(KUEUE_GROUP, version, "workloads", **kw)
        self._discover_dra(served, custom)
        self._discovered_at = time.monotonic()

    def _discover_dra(self, served: Mapping[str, list[str]], custom: k8s.CustomObjectsApi) -> None:
        ns = self.settings.namespace
        version = next((v for v in RESOURCE_VERSIONS if v in served.get(RESOURCE_GROUP, [])), None) if self.settings.dra else None
        # ResourceSlices are cluster-scoped: a collector confined to one namespace has no right to them.
        # ResourceClaims are namespaced: such a collector watches its own namespace's.
        slices = version if not ns else None
        if version != self.dra_version or not self._discovered_at:
            what = (f"watching {RESOURCE_GROUP}/{version} " + ("ResourceSlices and ResourceClaims" if slices else f"ResourceClaims in {ns}")
                    + ("" if slices else " (ResourceSlices skipped: namespace-scoped)")) if version else \
                "ResourceSlices and ResourceClaims skipped (" + ("not served by this cluster" if self.settings.dra else "disabled") + ")"
            log.info("dra: %s", what)
            self.slices.rv = None
            self.claims.rv = None
        self.dra_version = version
        self.slices.list_fn = (lambda **kw: custom.list_cluster_custom_object(RESOURCE_GROUP, slices, "resourceslices", **kw)) \
            if slices else None
        if version is None:
            self.claims.list_fn = None
        elif ns:
            self.claims.list_fn = lambda **kw: custom.list_namespaced_custom_object(RESOURCE_GROUP, version, ns, "resourceclaims", **kw)
        else:
            self.claims.list_fn = lambda **kw: custom.list_cluster_custom_object(RESOURCE_GROUP, version, "resourceclaims", **kw)

    def _list(self, res: _Resource) -> tuple[list[dict], str]:
        """All items (paged) and the list's resourceVersion."""
        restarts = 0
        while True:
            items: list[dict] = []
            cont = None
            try:
                while True:
                    kw: dict[str, Any] = {"limit": self.settings.page_size, "_preload_content": False,
                                          "_request_timeout": self.settings.request_timeout_s}
                    if cont:
                        kw["_continue"] = cont
                    if res.field_selector:
                        kw["field_selector"] = res.field_selector
                    resp = res.list_fn(**kw)
                    try:
                        body = json.loads(resp.data)
                    finally:
                        resp.release_conn()
                    items.extend(i for i in body.get("items") or [] if isinstance(i, dict))
                    meta = body.get("metadata") or {}
                    cont = meta.get("continue")
                    if not cont:
                        return items, str(meta.get("resourceVersion") or "")
            except ApiException as exc:
                # A continue token older than the compaction window: start the list again.
                if _is_gone_status(exc) and cont and restarts < 3:
                    restarts += 1
                    continue
                raise

    def _abort_streams(self) -> None:
        with self._streams_lock:
            streams = list(self._streams)
        for resp in streams:
            try:
                conn = getattr(resp, "connection", None)
                sock = getattr(conn, "sock", None)
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- mapping per kind ---------------------------------------------------------------

    def _add(self, batch: _Batch, uid: str, kind: str, ns: str, name: str, facts: list[Fact], identity: Identity,
             payload: Mapping[str, Any], gone: bool = False) -> None:
        done = self.state.keys(uid) | set(batch.updates.get(uid, {}).get("keys", ()))
        now = datetime.now(timezone.utc)
        new = [f for f in facts if f.key not in done]
        for fact in new:
            trimmer = TextTrimmer()
            batch.events.append(to_event(uid, fact, identity, payload, self.source, now, trimmer))
            batch.counts[fact.event_type] = batch.counts.get(fact.event_type, 0) + 1
            if trimmer.cut:
                self.counters.add_truncated(len(trimmer.cut))
        if new or gone:
            upd = batch.updates.setdefault(uid, {"keys": set()})
            upd["keys"] |= {f.key for f in new}
            upd.update({"k": kind, "ns": ns, "n": name, "id": identity.model_dump(exclude_none=True)})
            if gone:
                upd["gone"] = time.time()

    def _handle_pod(self, etype: str, obj: Mapping, batch: _Batch) -> None:
        meta = meta_of(obj, "Pod")
        deleted = etype == "DELETED"
        if not self._gpu_pod(obj):
            with self._lock:
                if deleted:
                    self._pods.pop(meta.uid, None)
                else:
                    self._pods[meta.uid] = _PodEntry(meta.namespace, meta.name, False)
            return
        with self._lock:
            view = pod_view(obj, self.resources, self.settings.label_prefix, self.index)
        facts = pod_facts(obj, deleted=deleted)
        with self._lock:
            if deleted:
                self._pods.pop(meta.uid, None)
            else:
                self._pods[meta.uid] = _PodEntry(meta.namespace, meta.name, True, view.identity, view.payload)
        self._refused("Pod", meta.namespace, meta.name, view.refused)
        self._add(batch, meta.uid, "Pod", meta.namespace, meta.name, facts, view.identity, view.payload, gone=deleted)

    def _handle_workload(self, etype: str, obj: Mapping, batch: _Batch) -> None:
        info = workload_info(obj, self.resources, self.settings.label_prefix)
        deleted = etype == "DELETED"
        with self._lock:
            if deleted:
                # Kept for tombstone_ttl_s: its pods' finished/deleted usually come after it (a
                # deleted Job takes both), and must still name it. The state it was last seen in
                # stands (its pods ran under it), else the deleted object's.
                if self.index.by_uid(info.uid) is None:
                    self.index.add(info)
                self.index.tombstone(info.uid)
            else:
                self.index.add(info)
            facts = workload_facts(obj, self.index, deleted=deleted)
        if not self._gpu_work(info.gpus, info.claims):
            return
        self._refused("Workload", info.namespace, info.name, info.refused)
        self._add(batch, info.uid, "Workload", info.namespace, info.name, facts, workload_identity(info),
                  workload_payload(info), gone=deleted)

    def _refused(self, kind: str, namespace: str, name: str, refused: dict[str, str]) -> None:
        """Say which identity labels/annotations of a collected object were left out, and why (the
        object is published without them: ``mapping.identity_fields``)."""
        for key, why in refused.items():
            log.warning("%s %s/%s: %s left out of its identity (the object is collected without it): %s", kind, namespace, name, key, why)
            self.counters.add_refused(key.rsplit("/", 1)[-1])

    def _gpu_work(self, gpus: int, claims: bool) -> bool:
        """What the collector publishes, Pods and Kueue Workloads alike: a pod spec (a Workload: one
        of its pod sets' templates) requesting a GPU resource — or, with DRA on, naming any
        ResourceClaim (``mapping.claims_devices``). A Workload whose pods get their GPUs only
        through claims requests no GPU resource; it was skipped while its pods were published."""
        return bool(gpus) or (self.settings.dra and claims)

    def _gpu_pod(self, pod: Mapping) -> bool:
        spec = pod.get("spec") or {}
        return self._gpu_work(gpus_requested(spec, self.resources), claims_devices(spec))

    def _handle_slice(self, etype: str, obj: Mapping, batch: _Batch) -> None:
        """A ResourceSlice's GPU devices as ``gpu.device`` events, each published once."""
        if etype == "DELETED":
            return  # what a device was stays true for what was allocated while it existed
        meta = meta_of(obj, "ResourceSlice", namespaced=False)
        done = self.state.keys(meta.uid) | set(batch.updates.get(meta.uid, {}).get("keys", ()))
        new = [e for e in slice_devices(obj, self.dra_drivers, self.source, datetime.now(timezone.utc)) if e.event_id not in done]
        if new:
            batch.events.extend(new)
            batch.counts["gpu.device"] = batch.counts.get("gpu.device", 0) + len(new)
            upd = batch.updates.setdefault(meta.uid, {"keys": set()})
            upd["keys"] |= {e.event_id for e in new}
            upd.update({"k": "ResourceSlice", "ns": "", "n": meta.name, "id": {}})

    def _handle_claim(self, etype: str, obj: Mapping, batch: _Batch) -> None:
        """A ResourceClaim's holdings (reserved pod x allocated GPU device) as ``gpu.claim_reserved``
        / ``gpu.claim_released`` events: each change published once (state ``held``)."""
        view = claim_view(obj, self.dra_drivers)
        uid = view.meta.uid
        deleted = etype == "DELETED"
        previous = batch.updates.get(uid, {}).get("held")
        if previous is None:
            previous = (self.state.get(uid) or {}).get("held") or {}
        events, held = claim_events(view, previous, self.source, datetime.now(timezone.utc), deleted=deleted)
        self._claim_batch(batch, uid, view.meta.namespace, view.meta.name, events, held, deleted)

    def _claim_gone(self, uid: str, entry: Mapping[str, Any], batch: _Batch) -> None:
        """A claim the re-list no longer shows: what it held is released (``claim_deleted``)."""
        view = gone_claim(uid, entry.get("ns") or "", entry.get("n") or "")
        events, held = claim_events(view, entry.get("held") or {}, self.source, datetime.now(timezone.utc), deleted=True)
        self._claim_batch(batch, uid, entry.get("ns") or "", entry.get("n") or "", events, held, True)

    def _claim_batch(self, batch: _Batch, uid: str, ns: str, name: str, events: list, held: dict, deleted: bool) -> None:
        batch.events.extend(events)
        for e in events:
            batch.counts[e.event_type] = batch.counts.get(e.event_type, 0) + 1
        if not events:
            return
        if deleted or not held:
            # Only claims that hold a GPU are remembered (their holdings must be released later).
            batch.drops.add(uid)
            batch.updates.pop(uid, None)
        else:
            batch.drops.discard(uid)
            upd = batch.updates.setdefault(uid, {"keys": set()})
            upd.update({"k": "ResourceClaim", "ns": ns, "n": name, "id": {}, "held": held})

    def _pod_name(self, uid: str) -> tuple[str, str] | None:
        with self._lock:
            entry = self._pods.get(uid)
        if entry:
            return entry.namespace, entry.name
        st = self.state.get(uid)
        return (st.get("ns"), st.get("n")) if st and st.get("k") == "Pod" else None

    def _pod_for_event(self, ev: EventView, may_ask: bool) -> _PodEntry | None:
        reg = ev.regarding
        uid, ns, name = reg.get("uid"), reg.get("namespace") or ev.namespace, reg.get("name")
        with self._lock:
            entry = self._pods.get(uid) if uid else None
        if entry is not None:
            return entry if entry.gpu else None
        st = self.state.get(uid) if uid else None
        if st and st.get("k") == "Pod":
            return _PodEntry(st.get("ns"), st.get("n"), True, Identity(**st.get("id", {})), {"object_kind": "Pod"})
        if not may_ask or (uid and uid in self._gone_pods):
            # Listing Events right after Pods: an unknown pod is gone, and was not a GPU
            # pod we published (those are in the state file).
            return None
        if not uid:
            # An Event naming its pod without a UID (the taint manager's TaintManagerEviction is
            # recorded from a namespace/name only) is not looked up by name: the pod read now may
            # be a later pod of the same name — a StatefulSet re-creates it right after exactly
            # such an eviction — and nothing can tell the two apart safely. Comparing the Event's
            # time with the pod's creationTimestamp was the alternative, but both are whole
            # seconds from two clocks (the reporting controller's, the API server's), so an Event
            # and a re-creation in the same second, or a little clock skew, would still attach the
            # Event to the wrong pod. Nothing is lost by refusing: the taint manager sets
            # DisruptionTarget=True reason DeletionByTaintManager on the pod itself (with its UID)
            # before deleting it, which pod_facts publishes as scheduler.evicted.
            return None
        # A watched Event overtook its pod's watch event: ask once.
        try:
            resp = k8s.CoreV1Api(self.api).read_namespaced_pod(name, ns, _preload_content=False,
                                                               _request_timeout=self.settings.request_timeout_s)
            try:
                pod = json.loads(resp.data)
            finally:
                resp.release_conn()
        except ApiException as exc:
            if exc.status == 404:
                if uid:
                    if len(self._gone_pods) > 10_000:
                        self._gone_pods.clear()
                    self._gone_pods.add(uid)
                return None
            raise
        meta = meta_of(pod, "Pod")
        if uid and meta.uid != uid:
            return None  # a newer pod with the same name; the Event's pod is gone
        gpu = self._gpu_pod(pod)
        with self._lock:
            view = pod_view(pod, self.resources, self.settings.label_prefix, self.index) if gpu else None
            entry = _PodEntry(meta.namespace, meta.name, gpu, view.identity if view else None, view.payload if view else None)
            self._pods.setdefault(meta.uid, entry)
        return entry if gpu else None

    def _handle_event(self, etype: str, obj: Mapping, batch: _Batch) -> None:
        if etype == "DELETED":
            uid = ((obj.get("metadata") or {}).get("uid")) if isinstance(obj, Mapping) else None
            if uid and self.state.get(uid) is not None:
                batch.drops.add(uid)
            return
        ev = event_view(obj)
        if ev.regarding.get("kind", "Pod") != "Pod":
            return
        fact = event_fact(ev, self.settings.event_reasons, self._pod_name)
        if fact is None:
            return
        pod = self._pod_for_event(ev, may_ask=etype != "LISTED")
        if pod is None:
            return
        payload = {k: v for k, v in (pod.payload or {}).items() if k != "phase"}
        payload["object_kind"] = "Event"
        name = (obj.get("metadata") or {}).get("name", "")
        self._add(batch, ev.uid, "Event", ev.namespace, name, [fact], pod.identity or Identity(namespace=pod.namespace, pod=pod.name),
                  payload)

    # -- batches ------------------------------------------------------------------------

    def _map(self, res: _Resource, etype: str, obj: Any, batch: _Batch) -> None:
        self.counters.add_received()
        try:
            res.handle(etype, obj, batch)
        except (MalformedObject, ValidationError, TypeError, ValueError, AttributeError) as exc:
            meta = obj.get("metadata") if isinstance(obj, Mapping) else None
            where = f"{(meta or {}).get('namespace', '')}/{(meta or {}).get('name', '?')}" if isinstance(meta, Mapping) else "?"
            log.warning("%s %s skipped: %s", res.kind, where, str(exc).splitlines()[0][:300])
            self.counters.add_rejected("malformed")

    def _flush(self, batch: _Batch, stop: threading.Event) -> int:
        """Publish until acknowledged (retrying with back-off), then commit state; returns how many went to the topic.

        Raises ``Stopped`` when stopped before the batch was acknowledged (nothing is committed).
        """
        if not batch:
            return 0
        sent = 0
        if batch.events:
            # Events too large to travel are dead-lettered by the publisher, not sent. EventTooLarge
            # here: Kafka refused a record the size check passed (the topic limit was lowered); the
            # publisher re-reads the limit, so the retry dead-letters it.
            sent = call_with_backoff(lambda: self.publisher.publish_fitting(batch.events, COMPONENT), stop=stop,
                                     initial_s=self.settings.backoff_initial_s, max_s=self.settings.backoff_max_s,
                                     retry_on=(PublishError, EventTooLarge),
                                     on_retry=lambda st: log.warning("%s; retrying in %.1fs", retry_error(st), retry_delay(st)))
        self.state.commit(batch.updates, batch.drops)
        return sent

    def sync(self, res: _Resource, stop: threading.Event | None = None) -> int:
        """List ``res``, publish what is new, publish ``deleted`` for what vanished."""
        stop = stop or self._stop
        items, rv = self._list(res)
        seen: set[str] = set()
        published = 0
        counts: dict[str, int] = {}
        batch = _Batch()
        for obj in items:
            uid = (obj.get("metadata") or {}).get("uid")
            if uid:
                seen.add(uid)
            self._map(res, "LISTED", obj, batch)
            if len(batch.events) >= _LIST_CHUNK:
                published += self._flush(batch, stop)
                _merge(counts, batch.counts)
                batch = _Batch()
        ns = self.settings.namespace
        for uid, entry in self.state.live(res.kind, ns).items():
            if uid in seen:
                continue
            if res.kind in ("Event", "ResourceSlice"):
                batch.drops.add(uid)
                continue
            if res.kind == "ResourceClaim":
                self._claim_gone(uid, entry, batch)  # deleted while we were not watching: its holdings ended
                continue
            # Deleted while we were not watching: the last identity we published names it.
            gone = {"metadata": {"uid": uid, "namespace": entry.get("ns"), "name": entry.get("n")}}
            identity = Identity(**entry.get("id", {}))
            now = datetime.now(timezone.utc)
            fact = Fact("deleted", "deleted", "scheduler.deleted", now, "")
            self._add(batch, uid, res.kind, gone["metadata"]["namespace"], gone["metadata"]["name"], [fact], identity,
                      {"object_kind": res.kind}, gone=True)
            if res.kind == "Workload":
                with self._lock:
                    self.index.tombstone(uid)
        published += self._flush(batch, stop)
        _merge(counts, batch.counts)
        res.rv = rv
        log.info("%s: listed %d object(s) at resourceVersion %s; published %d event(s) %s", res.name, len(items), rv, published,
                 _fmt(counts) if published else "(nothing new)")
        return published

    def _watch(self, res: _Resource, stop: threading.Event) -> None:
        """One watch request from ``res.rv``; returns when the server ends it."""
        kw: dict[str, Any] = {"watch": True, "resource_version": res.rv, "allow_watch_bookmarks": True,
                              "timeout_seconds": self.settings.watch_timeout_s, "_preload_content": False,
                              "_request_timeout": (self.settings.request_timeout_s,
                                                   self.settings.watch_timeout_s + self.settings.request_timeout_s)}
        if res.field_selector:
            kw["field_selector"] = res.field_selector
        resp = res.list_fn(**kw)
        self._recovered(res)  # the watch is open: say so now, not when it ends (up to watch_timeout_s later)
        with self._streams_lock:
            self._streams.add(resp)
        try:
            if stop.is_set():
                return  # stopped while the request was in flight: _abort_streams missed it
            for line in iter_resp_lines(resp):
                if stop.is_set():
                    return
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                    etype, obj = event["type"], event["object"]
                except (ValueError, KeyError, TypeError):
                    log.warning("%s: undecodable watch line skipped (%d bytes)", res.name, len(line))
                    self.counters.add_rejected("malformed")
                    continue
                if etype == "ERROR":
                    code = obj.get("code") if isinstance(obj, Mapping) else None
                    if code == 410:
                        raise _Expired(obj.get("message", "resourceVersion too old"))
                    raise ApiException(status=code or 0, reason=f"watch error: {obj.get('reason') if isinstance(obj, Mapping) else obj}: "
                                                                 f"{obj.get('message') if isinstance(obj, Mapping) else ''}")
                rv = ((obj.get("metadata") or {}).get("resourceVersion")) if isinstance(obj, Mapping) else None
                if etype == "BOOKMARK":
                    if rv:
                        res.rv = rv
                    continue
                batch = _Batch()
                self._map(res, etype, obj, batch)
                n = self._flush(batch, stop)
                if n:
                    log.debug("%s: %s %s -> %d event(s)", res.name, etype, rv, n)
                if rv:
                    res.rv = rv
        finally:
            with self._streams_lock:
                self._streams.discard(resp)
            resp.close()
            resp.release_conn()

    def _step(self, res: _Resource, stop: threading.Event) -> None:
        """One step of a resource's loop: wait for Kueue to appear, one list, or one watch request."""
        if res.list_fn is None:
            # Only Workloads, ResourceSlices and ResourceClaims have none: Kueue / DRA is not served (yet).
            wait = self.settings.discovery_interval_s - (time.monotonic() - self._discovered_at)
            if wait > 0:
                stop.wait(wait)
            else:
                self.discover()
            return
        try:
            if res.rv is None:
                self.sync(res, stop)
                self._recovered(res)
            else:
                self._watch(res, stop)
        except _Expired as exc:
            log.info("%s: watch expired (%s); re-listing", res.name, exc)
            res.rv = None

    @staticmethod
    def _recovered(res: _Resource) -> None:
        """A request of ``res`` succeeded: the end of a failure streak is logged once, as soon as it
        ends — not when the request that ended it returns (a watch: up to ``watch_timeout_s``, 300 s,
        of a WARNING left unresolved while data flowed: exploratory review)."""
        if res.failing:
            res.failing = False
            log.info("%s: recovered", res.name)

    def _loop(self, res: _Resource, stop: threading.Event) -> None:
        """List once, then watch from the list's resourceVersion until stopped; failures back off."""

        def failed(state: RetryCallState) -> None:
            exc = retry_error(state)
            if isinstance(exc, ApiException) and exc.status == 404 and res is not self.pods:
                # The group/version went away (Kueue uninstalled, events API changed): look again.
                res.rv = None
                self._discovered_at = 0.0
                try:
                    self.discover()
                except _DISCOVERY_ERRORS as dexc:
                    log.warning("discovery failed: %s", dexc)
            # The first failure of a streak is logged at its level, the repeats at DEBUG; the resource is in
            # the message's template (``_per_resource``), so the repeat filter holds back repeats per resource.
            log.log(_level(exc) if state.attempt_number == 1 else logging.DEBUG, _per_resource(res, "%s: %s; retrying in %.1fs"),
                    type(exc).__name__, _short(exc), retry_delay(state))
            res.failing = True

        while not stop.is_set():
            try:
                call_with_backoff(lambda: self._step(res, stop), stop=stop, initial_s=self.settings.backoff_initial_s,
                                  max_s=self.settings.backoff_max_s, retry_on=_RETRIABLE, on_retry=failed)
            except Stopped:
                return
            self._recovered(res)

    # -- lifecycle ------------------------------------------------------------------------

    def run_once(self) -> int:
        """Discover, list Workloads, Pods and Events once and publish; no watches.

        Raises ``KubeApiError`` when the API server fails, ``ProducerError`` when Kafka does.
        """
        total, denied = 0, {}
        try:
            self.discover()
            for res in (self.slices, self.claims, self.workloads, self.pods, self.events):
                if res.list_fn is not None:
                    try:
                        total += self.sync(res, self._stop)
                    except ApiException as exc:
                        if not self._denied(res, exc):
                            raise
                        # Not granted (RBAC): as in watch mode, the others are not held back by it.
                        log.error(_per_resource(res, "the collector may not list it (%s); the other resources are listed without it"),
                                  _short(exc))
                        denied[res.name] = _short(exc)
        except _DISCOVERY_ERRORS as exc:
            raise KubeApiError(f"scheduler collector: {_short(exc)}") from exc
        self.state.save(force=True)
        if denied:
            raise KubeApiError(f"scheduler collector: the credentials may not list {', '.join(denied)} "
                               f"({', '.join(sorted(set(denied.values())))}; deploy/k8s RBAC): published {total} event(s) of the other resources")
        return total

    def run(self, stop: threading.Event | None = None) -> None:
        """Sync, then watch until ``stop`` is set (or ``stop()`` is called); then flush and close."""
        if stop is not None:
            self._stop = stop
        stop = self._stop
        log.info("scheduler collector: %s, resources %s, state %s", f"namespace {self.settings.namespace}" if self.settings.namespace
                 else "all namespaces", ",".join(self.resources.patterns), self.state.path)
        threads: list[threading.Thread] = []
        backoff = {"stop": stop, "initial_s": self.settings.backoff_initial_s, "max_s": self.settings.backoff_max_s}
        try:
            call_with_backoff(self.discover, retry_on=_DISCOVERY_ERRORS, **backoff,
                              on_retry=lambda st: log.warning("discovery failed: %s; retrying in %.1fs", _short(retry_error(st)), retry_delay(st)))
            # Workloads first (pods look their Workload up), then pods (Events look their pod up).
            for res in (self.slices, self.claims, self.workloads, self.pods, self.events):
                if res.list_fn is not None:
                    try:
                        call_with_backoff(lambda r=res: self._first_list(r, stop), retry_on=_RETRIABLE, **backoff,
                                          on_retry=lambda st, r=res: log.log(_level(retry_error(st)),
                                                                             _per_resource(r, "initial list failed: %s; retrying in %.1fs"),
                                                                             _short(retry_error(st)), retry_delay(st)))
                    except _Denied as exc:
                        # Not granted (RBAC): the others must not wait for it. Its own loop
                        # below keeps trying (backing off) and lists it once it is granted.
                        log.error(_per_resource(res, "the collector may not list it (%s); collecting the other resources without it until its "
                                                     f"credentials may list and watch {res.name} (deploy/k8s RBAC)"), _short(exc.__cause__))
            for res in (self.slices, self.claims, self.workloads, self.pods, self.events):
                t = threading.Thread(target=self._loop, args=(res, stop), name=f"scheduler-{res.name}", daemon=True)
                t.start()
                threads.append(t)
            while not stop.wait(1.0):
                with self._lock:
                    self.index.prune(self.settings.tombstone_ttl_s)
                try:
                    self.state.prune(self.settings.tombstone_ttl_s)
                    self.state.save()  # what the interval held back
                except StateFileError as exc:
                    log.warning("%s", exc)
        except Stopped:
            pass  # stopped before the watches started
        finally:
            stop.set()
            self._abort_streams()
            for t in threads:
                t.join(timeout=10)
            self.close()

    def _first_list(self, res: _Resource, stop: threading.Event) -> None:
        """``_initial_sync``; a resource other than pods that the credentials may not read
        (401/403) raises ``_Denied`` instead of being retried here."""
        try:
            self._initial_sync(res, stop)
        except ApiException as exc:
            if self._denied(res, exc):
                raise _Denied(res.name) from exc
            raise

    def _denied(self, res: _Resource, exc: ApiException) -> bool:
        """Whether ``exc`` is the credentials refusing ``res`` (401/403) where the others go on
        without it (``run``, ``run_once``): every resource but pods, without which there is nothing."""
        return res is not self.pods and exc.status in (401, 403)

    def _initial_sync(self, res: _Resource, stop: threading.Event) -> None:
        """The first list of ``res``; a list expired while it ran (410) is simply listed again."""
        while not stop.is_set() and res.rv is None:
            try:
                self.sync(res, stop)
            except _Expired:
                continue

    def stop(self) -> None:
        """Ask ``run`` to return (safe from any thread)."""
        self._stop.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.publisher.close()
        finally:
            try:
                self.state.save(force=True)
            except StateFileError as exc:
                log.error("%s", exc)


def _serves(custom: k8s.CustomObjectsApi, group: str, version: str, plural: str, timeout: float) -> bool:
    """Whether ``group/version`` serves ``plural`` (its APIResourceList names it)."""
    try:
        listed = custom.get_api_resources(group, version, _request_timeout=timeout)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return any(r.name == plural for r in listed.resources or [])


def _level(exc: BaseException) -> int:
    """A failed request's log level: ERROR when the credentials are refused (401/403: someone must
    grant them), WARNING otherwise (the API server away: it comes back)."""
    return logging.ERROR if isinstance(exc, ApiException) and exc.status in (401, 403) else logging.WARNING


def _per_resource(res: _Resource, template: str) -> str:
    """A log message template naming the resource itself — not as a %s argument: the repeat filter
    (``gpuledger.telemetry.RepeatFilter``) holds back a template's repeats for a minute, and with the
    resource as an argument a second resource's "may not list it" ERROR was held back as a repeat of
    the first's (three missing grants, one line: exploratory review)."""
    return f"{res.name}: {template}"  # (resource names are Kubernetes plurals: no '%' in them)


def _short(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}".strip()
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def _merge(into: dict[str, int], more: Mapping[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def _fmt(counts: Mapping[str, int]) -> str:
    return "(" + ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in sorted(counts.items())) + ")"
