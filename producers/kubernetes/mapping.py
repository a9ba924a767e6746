"""Pure mapping from Kubernetes / Kueue API objects to scheduler facts and events.

Input: objects exactly as the API server serves them (JSON dicts: Pods, core/v1 and
events.k8s.io/v1 Events, Kueue Workloads in v1beta2 or v1beta1).
Output: ``Fact``s — one per transition an object's current state proves happened —
and the ``SchedulerEvent`` for each, plus the ``workload_id`` of a pod.
Guarantees: no I/O, no clock reads except where a caller passes ``now``; the same
object always yields the same facts with the same event ids, so a re-list, a restart
or an HA pair re-derives identical events (``make_event_id("kubernetes", (uid,
transition, reason), <transition time | message digest | '' for running and deleted>)``).
Size: the one free-text field, ``payload.message`` (condition and Event messages), is
cut to ``FREE_TEXT_BYTES`` (8 KiB) with a ``…[truncated N bytes]`` marker by ``to_event``;
the event id is derived from the full message, so it does not change.
Limits: a transition that left no trace in the object (a pod that was Running and is
now gone, seen only as DELETED) cannot be re-derived; what the object still shows is.

The workload_id rule (the same everywhere; see docs/collectors.md):

1. A pod that Kueue manages (it carries a ``kueue.x-k8s.io/*`` label or annotation)
   belongs to its Kueue Workload, named ``<namespace>/<workload name>``: from the
   ``kueue.x-k8s.io/workload`` annotation Kueue puts on the pod template, else the
   Workload whose ``kueue.x-k8s.io/job-uid`` label or owner reference matches the
   pod's ``kueue.x-k8s.io/job-uid`` label, controller uid or own uid (plain pods),
   else the pod group named by ``kueue.x-k8s.io/pod-group-name``.
2. Otherwise the owning controller, ``<namespace>/<Kind>/<name>``: a JobSet named by
   the ``jobset.sigs.k8s.io/jobset-name`` label; a ReplicaSet whose name ends in the
   pod's ``pod-template-hash`` is its Deployment (``-<hash>`` stripped); any other
   controller owner reference as is.
3. Otherwise the pod itself, ``<namespace>/Pod/<name>``.

A Workload's own workload_id is ``<namespace>/<name>`` (two segments); controllers and
bare pods have three, so the two forms never collide.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from gpuledger.timefmt import TimeFormatError, iso_z, parse_timestamp
from producers._config import ResourceMatcher
from producers._limits import TextTrimmer
from schemas.envelope import Identity, Source, make_event_id
from schemas.scheduler import ObjectRef, SchedulerEvent, SchedulerPayload

SOURCE = "kubernetes"
KUEUE_PREFIX = "kueue.x-k8s.io/"
KUEUE_WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"

#: Identity suffix under the configured prefix (default ``gpuledger.io/``) -> Identity field.
IDENTITY_KEYS: dict[str, str] = {
    "release-id": "release_id",
    "model": "model_name",
    "model-version": "model_version",
    "environment": "environment",
    "owner": "owner",
    "data-class": "data_class",
}
#: Well-known labels copied into the payload because they help attribution.
SHARED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/version", "app.kubernetes.io/instance")

#: Kueue Workload condition type -> scheduler event type (emitted when it turns True).
KUEUE_CONDITIONS: dict[str, str] = {
    "QuotaReserved": "scheduler.quota_reserved",
    "Admitted": "scheduler.admitted",
    "PodsReady": "scheduler.pods_ready",
    "Evicted": "scheduler.evicted",
    "Preempted": "scheduler.preempted",
    "Requeued": "scheduler.requeued",
    "Finished": "scheduler.finished",
}

#: Event reason -> scheduler event type, the default of GPULEDGER_SCHEDULER_EVENT_REASONS.
#: ``Killing`` is left out on purpose: the kubelet records it for every graceful
#: deletion and liveness restart, so it would read as an eviction that never was.
DEFAULT_EVENT_REASONS: dict[str, str] = {
    "Scheduled": "scheduler.scheduled",
    "FailedScheduling": "scheduler.failed_scheduling",
    "Preempted": "scheduler.preempted",
    "Preempting": "scheduler.preempted",  # kubelet preempting a pod to admit a critical one
    "Evicted": "scheduler.evicted",  # kubelet node-pressure eviction
    "TaintManagerEviction": "scheduler.evicted",  # only "Marking for deletion": EVENT_MESSAGE_PREFIXES
}

#: Event reasons that report both a transition and its calling-off: reason -> the message prefix
#: of the transition; other messages under the reason are not facts at all. The taint manager
#: records TaintManagerEviction for "Marking for deletion Pod <ns>/<name>" (it deletes the pod now)
#: and for "Cancelling deletion of Pod <ns>/<name>" (a scheduled deletion called off, the pod stays;
#: kubernetes pkg/controller/tainteviction/taint_eviction.go emitPodDeletionEvent,
#: emitCancelPodDeletionEvent). No scheduler event type says "an eviction did not happen", so a
#: cancellation is not published.
EVENT_MESSAGE_PREFIXES: dict[str, str] = {"TaintManagerEviction": "Marking for deletion"}

#: DisruptionTarget reasons that mean the scheduler preempted the pod; any other
#: reason (EvictionByEvictionAPI, DeletionByTaintManager, DeletionByPodGC,
#: TerminationByKubelet, ...) is an eviction.
PREEMPTION_REASONS = frozenset({"PreemptionByScheduler", "PreemptionByKubeScheduler"})


class MalformedObject(ValueError):
    """An API object that cannot be mapped (missing uid, unparsable timestamp, ...)."""


# ----------------------------------------------------------------------------- small parsers


def parse_time(value: Any, what: str) -> datetime:
    """metav1.Time / MicroTime (RFC 3339, ``gpuledger.timefmt``) -> aware UTC datetime; MalformedObject otherwise."""
    if not isinstance(value, str) or not value:
        raise MalformedObject(f"{what}: missing timestamp")
    try:
        return parse_timestamp(value)
    except TimeFormatError:
        raise MalformedObject(f"{what}: bad timestamp {value[:40]!r} (RFC 3339 with seconds and a zone)") from None


def optional_time(value: Any, what: str) -> datetime | None:
    return None if value in (None, "") else parse_time(value, what)


def iso(t: datetime) -> str:
    """The canonical text of a transition time inside an event id (microseconds, ``Z``)."""
    return iso_z(t, 6)


def image_digest(image_id: Any) -> str | None:
    """containerStatuses[].imageID ('repo@sha256:…', 'docker-pullable://…', 'sha256:…') -> 'sha256:…'."""
    if not isinstance(image_id, str) or "sha256:" not in image_id:
        return None
    digest = "sha256:" + image_id.rsplit("sha256:", 1)[1]
    return digest if re.fullmatch(r"sha256:[0-9a-f]{64}", digest) else None


def quantity(value: Any) -> int:
    """An extended-resource quantity (always an integer count) as int."""
    if value in (None, ""):
        return 0
    try:
        return int(str(value))
    except ValueError:
        try:
            return int(float(str(value)))
        except ValueError:
            raise MalformedObject(f"bad resource quantity {str(value)[:20]!r}") from None


def _container_units(container: Mapping, resources: ResourceMatcher) -> int:
    res = container.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    # Extended resources must have request == limit; the API server copies a lone limit.
    return sum(max(quantity(requests.get(r)), quantity(limits.get(r))) for r in resources.select([*requests, *limits]))


def gpus_requested(pod_spec: Mapping | None, resources: Iterable[str] | ResourceMatcher) -> int:
    """Units of the configured extended resources (names or ``prefix*`` patterns) a pod spec
    asks for (effective request)."""
    spec = pod_spec or {}
    resources = resources if isinstance(resources, ResourceMatcher) else ResourceMatcher(resources)
    regular = sum(_container_units(c, resources) for c in spec.get("containers") or [])
    sidecars = sum(_container_units(c, resources) for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always")
    init_peak = max((_container_units(c, resources) for c in spec.get("initContainers") or [] if c.get("restartPolicy") != "Always"), default=0)
    return max(regular + sidecars, init_peak)


def claims_devices(pod_spec: Mapping | None) -> bool:
    """Whether a pod spec gets devices through DRA: it names a ResourceClaim or a
    ResourceClaimTemplate (``spec.resourceClaims``). A claim names a device class, not a driver,
    so any claim counts: which device it got is the pod-resources collector's to say (and the
    ResourceClaim's). A Kueue Workload's pod sets carry their pods' template, claims included
    (Kueue 0.17: ``podSets[].template.spec.resourceClaims``, ``workload.HasDRA``)."""
    return bool((pod_spec or {}).get("resourceClaims"))


def message_digest(message: str | None) -> str:
    return hashlib.sha256((message or "").encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------- identity


def identity_fields(labels: Mapping[str, str] | None, annotations: Mapping[str, str] | None, prefix: str,
                    refused: dict[str, str] | None = None) -> dict[str, str]:
    """Identity fields named by ``<prefix><key>`` labels (or annotations; labels win).

    A value the event's identity refuses (``Identity``: a control or bidi character — an
    annotation's value is its creator's to write, a line break included) is left out, and noted
    in ``refused`` (``{label or annotation key: why}``) when one is given: the object is still
    collected. Before, it made the whole object unreadable — the collector skipped the pod, so a
    GPU workload with ``gpuledger.io/owner: "a\\nb"`` never reached gpuledger and no control saw it."""
    out: dict[str, str] = {}
    problems: dict[str, list[tuple[str, str]]] = {}  # field -> [(key, why)]; an annotation's go when a label gives the field
    for source in (annotations or {}, labels or {}):
        for suffix, field_name in IDENTITY_KEYS.items():
            value = source.get(prefix + suffix)
            if isinstance(value, str) and value.strip():
                if (why := _identity_problem(field_name, value.strip())) is not None:
                    problems.setdefault(field_name, []).append((prefix + suffix, why))
                    continue
                out[field_name] = value.strip()
                problems.pop(field_name, None)  # (the label wins over what an annotation said, usable or not)
    if refused is not None:
        refused.update(item for items in problems.values() for item in items)
    return out


def _identity_problem(field_name: str, value: str) -> str | None:
    """Why ``Identity`` refuses ``value`` as ``field_name``, or None (its own validation, one field)."""
    try:
        Identity(**{field_name: value})
    except ValidationError as exc:
        msg = exc.errors()[0]["msg"]
        return msg.removeprefix("Value error, ")
    return None


def shared_labels(labels: Mapping[str, str] | None, prefix: str) -> dict[str, str]:
    """The labels worth carrying in the payload: ours, app.kubernetes.io/*, Kueue's."""
    return {k: str(v) for k, v in sorted((labels or {}).items())
            if k.startswith(prefix) or k in SHARED_LABELS or k.startswith(KUEUE_PREFIX)}


# ----------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class Meta:
    uid: str
    namespace: str
    name: str
    created: datetime
    labels: dict[str, str]
    annotations: dict[str, str]
    owners: tuple[dict, ...]
    resource_version: str
    deletion: datetime | None


def meta_of(obj: Any, kind: str, namespaced: bool = True) -> Meta:
    """Validated metadata of ``obj``; MalformedObject names what is wrong."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("metadata"), Mapping):
        raise MalformedObject(f"{kind}: no metadata")
    m = obj["metadata"]
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedObject(f"{kind}: missing metadata.name")
    ns = m.get("namespace") or ""
    where = f"{kind} {ns}/{name}" if ns else f"{kind} {name}"
    uid = m.get("uid")
    if not isinstance(uid, str) or not uid:
        raise MalformedObject(f"{where}: missing metadata.uid")
    if namespaced and not ns:
        raise MalformedObject(f"{where}: missing metadata.namespace")
    labels = m.get("labels") or {}
    annotations = m.get("annotations") or {}
    if not isinstance(labels, Mapping) or not isinstance(annotations, Mapping):
        raise MalformedObject(f"{where}: labels/annotations are not maps")
    owners = tuple(o for o in (m.get("ownerReferences") or []) if isinstance(o, Mapping))
    return Meta(uid, ns, name, parse_time(m.get("creationTimestamp"), f"{where} metadata.creationTimestamp"),
                {str(k): str(v) for k, v in labels.items()}, {str(k): str(v) for k, v in annotations.items()},
                owners, str(m.get("resourceVersion") or ""),
                optional_time(m.get("deletionTimestamp"), f"{where} metadata.deletionTimestamp"))


# ----------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class Fact:
    """One transition of one object, ready to become an event."""

    key: str  # stable per object: what the collector remembers as published
    transition: str  # part of the event id ('scheduled', 'admitted', ...)
    event_type: str
    occurred_at: datetime
    version: str  # source version part of the event id (transition time or message digest)
    reason: str | None = None
    message: str | None = None
    node: str | None = None
    preemptor: ObjectRef | None = None
    victim: ObjectRef | None = None


def _cond(conditions: Any, type_: str) -> Mapping | None:
    for c in conditions or []:
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


def _ref(kind: str, namespace: str | None, name: str | None, uid: str | None) -> ObjectRef:
    # ObjectRef.name is required; when only a uid is known the name stays empty
    # (unknown) rather than being guessed.
    return ObjectRef(kind=kind, namespace=namespace or None, name=name or "", uid=uid or None)


# ----------------------------------------------------------------------------- Kueue workloads


@dataclass(frozen=True)
class WorkloadInfo:
    """What pods and preemption links need to know about one Kueue Workload."""

    uid: str
    namespace: str
    name: str
    queue: str | None
    cluster_queue: str | None
    priority_class: str | None
    priority: int | None
    flavors: dict[str, str]
    pod_sets: dict[str, int]
    gpus: int
    #: A pod set's template names a DRA ResourceClaim (``claims_devices``): GPUs it may get with no extended resource.
    claims: bool
    labels: dict[str, str]
    identity: dict[str, str]
    owner_uids: tuple[str, ...]
    job_uid: str | None
    #: Identity labels/annotations left out: ``{key: why}`` (``identity_fields``).
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def workload_id(self) -> str:
        return f"{self.namespace}/{self.name}"

    def ref(self) -> ObjectRef:
        return ObjectRef(kind="Workload", namespace=self.namespace, name=self.name, uid=self.uid)


def workload_info(wl: Mapping, resources: Iterable[str], prefix: str) -> WorkloadInfo:
    """Summarise a Workload (v1beta2 or v1beta1) for the index and for payloads."""
    meta = meta_of(wl, "Workload")
    spec = wl.get("spec") or {}
    status = wl.get("status") or {}
    resources = resources if isinstance(resources, ResourceMatcher) else ResourceMatcher(resources)
    # v1beta2: spec.priorityClassRef {group, kind, name}; v1beta1: spec.priorityClassName.
    ref = spec.get("priorityClassRef")
    priority_class = (ref.get("name") if isinstance(ref, Mapping) else None) or spec.get("priorityClassName") \
        or meta.labels.get("kueue.x-k8s.io/priority-class")
    priority = spec.get("priority")
    admission = status.get("admission") or {}
    flavors: dict[str, str] = {}
    pod_sets: dict[str, int] = {}
    assignments = [a for a in admission.get("podSetAssignments") or [] if isinstance(a, Mapping)]
    for a in assignments:
        for res, flavor in sorted((a.get("flavors") or {}).items()):
            # One pod set: plain resource names; several that disagree: '<podset>/<resource>'.
            key = res if len(assignments) == 1 or flavors.get(res, flavor) == flavor else f"{a.get('name')}/{res}"
            flavors[key] = str(flavor)
        if a.get("count") is not None:
            pod_sets[str(a.get("name") or "main")] = quantity(a.get("count"))
    gpus, claims = 0, False
    labels = dict(meta.labels)
    refused: dict[str, str] = {}
    identity = identity_fields(meta.labels, meta.annotations, prefix, refused)
    for ps in spec.get("podSets") or []:
        if not isinstance(ps, Mapping):
            continue
        tmpl = ps.get("template") or {}
        count = quantity(ps.get("count", 1))
        gpus += count * gpus_requested(tmpl.get("spec"), resources)
        claims = claims or claims_devices(tmpl.get("spec"))
        tmeta = tmpl.get("metadata") or {}
        # Jobs usually label their pod template, not the Workload Kueue derives from them.
        identity = {**identity_fields(tmeta.get("labels"), tmeta.get("annotations"), prefix, refused), **identity}
        labels = {**(tmeta.get("labels") or {}), **labels}
        if not assignments:
            pod_sets.setdefault(str(ps.get("name") or "main"), count)
    return WorkloadInfo(
        uid=meta.uid, namespace=meta.namespace, name=meta.name,
        queue=spec.get("queueName") or meta.labels.get(KUEUE_QUEUE_LABEL),
        cluster_queue=admission.get("clusterQueue"),
        priority_class=priority_class, priority=int(priority) if isinstance(priority, (int, float)) else None,
        flavors=flavors, pod_sets=pod_sets, gpus=gpus, claims=claims, labels=shared_labels(labels, prefix), identity=identity,
        owner_uids=tuple(str(o["uid"]) for o in meta.owners if o.get("uid")),
        job_uid=meta.labels.get(KUEUE_JOB_UID_LABEL), refused=refused,
    )


class KueueIndex:
    """Workloads by uid, by owner/job uid and by name: how pods find their Workload.

    A deleted Workload stays findable until ``prune`` (``tombstone``): deleting a Job deletes its
    Workload and its pods together, and the pods' ``finished``/``deleted`` usually come last; they
    must still carry the Workload's id, queue, flavors and identity. A live Workload of the same
    name or owner (Kueue re-creates one for a Job whose Workload was deleted) replaces it in the
    name and owner lookups.
    """

    def __init__(self) -> None:
        self._by_uid: dict[str, WorkloadInfo] = {}
        self._by_owner: dict[str, str] = {}
        self._by_name: dict[tuple[str, str], str] = {}
        self._gone: dict[str, float] = {}  # uid -> when it was deleted (epoch seconds)

    def __len__(self) -> int:
        return len(self._by_uid)

    def add(self, info: WorkloadInfo) -> None:
        self.remove(info.uid)
        self._by_uid[info.uid] = info
        for uid in (*info.owner_uids, info.job_uid):
            if uid:
                self._by_owner[uid] = info.uid
        self._by_name[(info.namespace, info.name)] = info.uid

    def tombstone(self, uid: str, now: float | None = None) -> None:
        """The Workload was deleted: keep it for its pods' last events, until ``prune``."""
        if uid in self._by_uid:
            self._gone.setdefault(uid, now if now is not None else time.time())

    def prune(self, ttl_s: float, now: float | None = None) -> int:
        """Forget the Workloads deleted more than ``ttl_s`` ago."""
        now = now if now is not None else time.time()
        old = [uid for uid, gone in self._gone.items() if now - gone > ttl_s]
        for uid in old:
            self.remove(uid)
        return len(old)

    def remove(self, uid: str) -> WorkloadInfo | None:
        self._gone.pop(uid, None)
        info = self._by_uid.pop(uid, None)
        if info is not None:
            for k in [k for k, v in self._by_owner.items() if v == uid]:
                del self._by_owner[k]
            if self._by_name.get((info.namespace, info.name)) == uid:
                del self._by_name[(info.namespace, info.name)]
        return info

    def by_uid(self, uid: str | None) -> WorkloadInfo | None:
        return self._by_uid.get(uid) if uid else None

    def by_owner(self, uid: str | None) -> WorkloadInfo | None:
        return self.by_uid(self._by_owner.get(uid)) if uid else None

    def by_name(self, namespace: str, name: str | None) -> WorkloadInfo | None:
        return self.by_uid(self._by_name.get((namespace, name))) if name else None

    def uids(self) -> set[str]:
        return set(self._by_uid)


_KUEUE_PREEMPTOR = re.compile(r"Preempted to accommodate a workload \(UID: ([^,)\s]+)(?:, JobUID: ([^)\s]+))?\)")


def kueue_preemptor(message: str | None, index: KueueIndex | None) -> ObjectRef | None:
    """The preempting Workload named in Kueue's Evicted/Preempted condition message."""
    m = _KUEUE_PREEMPTOR.search(message or "")
    if not m:
        return None
    wl_uid = None if m.group(1) == "UNKNOWN" else m.group(1)
    job_uid = None if m.group(2) in (None, "UNKNOWN") else m.group(2)
    if index is not None:
        info = index.by_uid(wl_uid) or index.by_owner(job_uid)
        if info is not None:
            return info.ref()
    if not wl_uid:
        return None
    return _ref("Workload", None, None, wl_uid)


def _requeued_again(conditions: Any, where: str) -> Fact | None:
    """A requeue after the one the Requeued condition's own lastTransitionTime stands for.

    Kueue sets Requeued without a transition time of its own (``workload.SetRequeuedCondition``):
    Requeued=True reason=Preempted stays True through re-admission, and the next preemption sets
    it again unchanged, so every later requeue looked like the first. The Evicted condition does
    get a new time per eviction (``SetEvictedCondition``; re-admission turns it False). So a
    later requeue is proven by Evicted=True with Requeued's reason and a lastTransitionTime after
    Requeued's, once the quota is released (QuotaReserved not True: the job reconciler sets
    Requeued and unsets the reservation in one patch, after the job stopped). The fact is keyed
    on that eviction's time and dated when the quota was released (else the eviction).
    ``status.requeueState.count`` does not tell: Kueue counts only PodsReady-timeout evictions
    there (``UpdateRequeueState``), and those requeue through Requeued=False then True, which
    gives the condition a new time anyway.
    """
    requeued, evicted, reserved = _cond(conditions, "Requeued"), _cond(conditions, "Evicted"), _cond(conditions, "QuotaReserved")
    if not (requeued and evicted and requeued.get("status") == "True" and evicted.get("status") == "True"):
        return None
    if evicted.get("reason") != requeued.get("reason") or (reserved and reserved.get("status") == "True"):
        return None
    since = parse_time(requeued.get("lastTransitionTime"), f"{where} condition Requeued.lastTransitionTime")
    evicted_at = parse_time(evicted.get("lastTransitionTime"), f"{where} condition Evicted.lastTransitionTime")
    if evicted_at <= since:
        return None  # the eviction the condition's own time already stands for
    released = optional_time((reserved or {}).get("lastTransitionTime"), f"{where} condition QuotaReserved.lastTransitionTime")
    at = released if released and released > evicted_at else evicted_at
    reason = requeued.get("reason") or "Requeued"
    return Fact(f"Requeued|{reason}|{iso(evicted_at)}", "requeued", "scheduler.requeued", at, iso(evicted_at), reason,
                requeued.get("message") or None)


def workload_facts(wl: Mapping, index: KueueIndex | None = None, deleted: bool = False, now: datetime | None = None) -> list[Fact]:
    """Every transition a Workload's current state proves: queued, each condition that
    is True (one fact per (type, reason, lastTransitionTime)), a requeue the Requeued
    condition does not date (``_requeued_again``), and deleted."""
    meta = meta_of(wl, "Workload")
    where = f"Workload {meta.namespace}/{meta.name}"
    spec = wl.get("spec") or {}
    status = wl.get("status") or {}
    facts: list[Fact] = []
    if spec.get("queueName"):
        # Every Workload with a queue waits in it first, even one we first see admitted.
        facts.append(Fact("queued", "queued", "scheduler.queued", meta.created, iso(meta.created)))
    self_ref = ObjectRef(kind="Workload", namespace=meta.namespace, name=meta.name, uid=meta.uid)
    for c in status.get("conditions") or []:
        if not isinstance(c, Mapping) or c.get("status") != "True" or c.get("type") not in KUEUE_CONDITIONS:
            continue
        ctype = c["type"]
        at = parse_time(c.get("lastTransitionTime"), f"{where} condition {ctype}.lastTransitionTime")
        reason = c.get("reason") or ctype
        message = c.get("message") or None
        event_type = KUEUE_CONDITIONS[ctype]
        preemptor = victim = None
        if ctype in ("Preempted", "Evicted"):
            preemptor = kueue_preemptor(message, index)
            victim = self_ref if preemptor else None
        facts.append(Fact(f"{ctype}|{reason}|{iso(at)}", event_type.split(".", 1)[1], event_type, at, iso(at),
                          reason, message, preemptor=preemptor, victim=victim))
    if again := _requeued_again(status.get("conditions"), where):
        facts.append(again)
    if deleted:
        facts.append(Fact("deleted", "deleted", "scheduler.deleted", _deleted_at(meta.deletion, now), ""))
    facts.sort(key=lambda f: f.occurred_at)
    return facts


# ----------------------------------------------------------------------------- pods


def is_kueue_managed(meta: Meta) -> bool:
    return any(k.startswith(KUEUE_PREFIX) for k in (*meta.labels, *meta.annotations))


def controller_of(meta: Meta) -> Mapping | None:
    owners = list(meta.owners)
    return next((o for o in owners if o.get("controller")), owners[0] if owners else None)


def derive_workload_id(pod: Mapping, index: KueueIndex | None = None) -> tuple[str, WorkloadInfo | None]:
    """The pod's workload_id (module docstring rule) and its Kueue Workload if known."""
    meta = meta_of(pod, "Pod")
    ns = meta.namespace
    owner = controller_of(meta)
    if is_kueue_managed(meta):
        annotated = meta.annotations.get(KUEUE_WORKLOAD_ANNOTATION)
        info = None
        if index is not None:
            info = (index.by_name(ns, annotated)
                    or index.by_owner(meta.labels.get(KUEUE_JOB_UID_LABEL))
                    or index.by_owner(str(owner.get("uid")) if owner else None)
                    or index.by_owner(meta.uid)
                    or index.by_name(ns, meta.labels.get(KUEUE_POD_GROUP_LABEL)))
        if info is not None:
            return info.workload_id, info
        if annotated:
            return f"{ns}/{annotated}", None
        if meta.labels.get(KUEUE_POD_GROUP_LABEL):
            return f"{ns}/{meta.labels[KUEUE_POD_GROUP_LABEL]}", None
    if meta.labels.get(JOBSET_NAME_LABEL):
        return f"{ns}/JobSet/{meta.labels[JOBSET_NAME_LABEL]}", None
    if owner and owner.get("kind") and owner.get("name"):
        kind, name = str(owner["kind"]), str(owner["name"])
        hash_ = meta.labels.get("pod-template-hash")
        if kind == "ReplicaSet" and hash_ and name.endswith(f"-{hash_}"):
            return f"{ns}/Deployment/{name[: -len(hash_) - 1]}", None
        return f"{ns}/{kind}/{name}", None
    return f"{ns}/Pod/{meta.name}", None


@dataclass(frozen=True)
class PodView:
    """A GPU pod's identity and payload basics, shared by its facts and its Events."""

    uid: str
    namespace: str
    name: str
    gpus: int
    identity: Identity
    payload: dict[str, Any] = field(default_factory=dict)
    #: Identity labels/annotations left out: ``{key: why}`` (``identity_fields``), the pod's and its Workload's.
    refused: dict[str, str] = field(default_factory=dict)


def pod_view(pod: Mapping, resources: Iterable[str], prefix: str, index: KueueIndex | None = None) -> PodView:
    meta = meta_of(pod, "Pod")
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    gpus = gpus_requested(spec, resources)
    workload_id, info = derive_workload_id(pod, index)
    digests = pod_image_digests(pod)
    refused: dict[str, str] = {}
    ident = identity_fields(meta.labels, meta.annotations, prefix, refused)
    if info is not None:
        ident = {**info.identity, **ident}
        refused = {**info.refused, **refused}
    identity = Identity(workload_id=workload_id, pod_uid=meta.uid, namespace=meta.namespace, pod=meta.name,
                        node=spec.get("nodeName") or None, image_digest=digests[0] if digests else None, **ident)
    # The priority class and its value from one source: the pod's own PriorityClass, else its Workload's
    # (Kueue's WorkloadPriorityClass: the pod then runs at spec.priority 0, and the pod's row read
    # "priority=high (0)" — a priority-1000 workload that looked like 0 beside the one it preempted).
    own_priority = spec.get("priority") if isinstance(spec.get("priority"), int) else None
    if spec.get("priorityClassName") or info is None or (info.priority_class is None and info.priority is None):
        priority_class, priority = spec.get("priorityClassName") or (info.priority_class if info else None), own_priority
        priority = priority if priority is not None else (info.priority if info else None)
    else:
        priority_class, priority = info.priority_class, info.priority
    payload: dict[str, Any] = {
        "object_kind": "Pod",
        "queue": meta.labels.get(KUEUE_QUEUE_LABEL) or (info.queue if info else None),
        "cluster_queue": info.cluster_queue if info else None,
        "priority_class": priority_class,
        "priority": priority,
        "phase": status.get("phase"),
        "gpus_requested": gpus,
        "image_digests": tuple(digests),
        "labels": shared_labels(meta.labels, prefix),
        "flavors": dict(info.flavors) if info else {},
        "pod_sets": dict(info.pod_sets) if info else {},
    }
    return PodView(meta.uid, meta.namespace, meta.name, gpus, identity, payload, refused)


def pod_image_digests(pod: Mapping) -> list[str]:
    """Image digests of the pod's containers in spec order (the main container first)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    order = {c.get("name"): i for i, c in enumerate(spec.get("containers") or []) if isinstance(c, Mapping)}
    statuses = sorted((s for s in status.get("containerStatuses") or [] if isinstance(s, Mapping)),
                      key=lambda s: order.get(s.get("name"), len(order)))
    out: list[str] = []
    for s in statuses:
        d = image_digest(s.get("imageID"))
        if d and d not in out:
            out.append(d)
    return out


def _container_times(status: Mapping, where: str) -> tuple[list[datetime], list[datetime]]:
    """(starts, finishes) of the containers: every start the status still shows — the current
    run's and the previous one's (``lastState.terminated``), so that a restart does not hide an
    earlier start — and the current finishes."""
    started, finished = [], []
    for s in status.get("containerStatuses") or []:
        if not isinstance(s, Mapping):
            continue
        state = s.get("state") or {}
        run = state.get("running") or {}
        term = state.get("terminated") or {}
        last = (s.get("lastState") or {}).get("terminated") or {}
        name = s.get("name")
        for value, bucket, what in ((run.get("startedAt"), started, "running.startedAt"),
                                    (term.get("startedAt"), started, "terminated.startedAt"),
                                    (last.get("startedAt"), started, "lastState.terminated.startedAt"),
                                    (term.get("finishedAt"), finished, "terminated.finishedAt")):
            t = optional_time(value, f"{where} container {name} {what}")
            if t:
                bucket.append(t)
    return started, finished


def pod_facts(pod: Mapping, deleted: bool = False, now: datetime | None = None) -> list[Fact]:
    """Every transition a Pod's current state proves: submitted, failed_scheduling
    (PodScheduled=False/Unschedulable), scheduled, running, preempted/evicted
    (DisruptionTarget, or status.reason Evicted/Preempting), finished, deleted."""
    meta = meta_of(pod, "Pod")
    where = f"Pod {meta.namespace}/{meta.name}"
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    cond_times = [parse_time(c["lastTransitionTime"], f"{where} condition {c.get('type')}.lastTransitionTime") for c in conditions
                  if isinstance(c, Mapping) and c.get("lastTransitionTime")]
    node = spec.get("nodeName") or None
    start_time = optional_time(status.get("startTime"), f"{where} status.startTime")
    started, finished = _container_times(status, where)
    # When a pod ended: its last container's finish, else its last condition change, else its start.
    ended_at = max(finished) if finished else (max(cond_times) if cond_times else (start_time or meta.created))

    facts = [Fact("submitted", "submitted", "scheduler.submitted", meta.created, iso(meta.created))]
    facts += _scheduling_facts(conditions, node, start_time or meta.created, where)
    phase = status.get("phase")
    if phase == "Running" or (phase in ("Succeeded", "Failed") and started):
        # One running per pod: its id does not carry the time (an empty version, as deleted),
        # because the earliest start the status shows moves — a restart replaces a container's
        # running.startedAt and keeps only the previous run in lastState — and a pod re-listed
        # after the state file was lost must not publish a second running under another id.
        at = min(started) if started else (start_time or meta.created)
        facts.append(Fact("running", "running", "scheduler.running", at, "", node=node))
    disrupted = _disruption_fact(conditions, status, node, ObjectRef(kind="Pod", namespace=meta.namespace, name=meta.name, uid=meta.uid),
                                 ended_at, where)
    facts += [disrupted] if disrupted else []
    if phase in ("Succeeded", "Failed"):
        facts.append(Fact("finished", "finished", "scheduler.finished", ended_at, iso(ended_at), status.get("reason") or phase,
                          status.get("message") or None, node=node))
    if deleted:
        facts.append(Fact("deleted", "deleted", "scheduler.deleted", _deleted_at(meta.deletion, now), "", node=node))
    return facts


def _deleted_at(deletion: datetime | None, now: datetime | None) -> datetime:
    """When a deleted object's deletion happened: its ``deletionTimestamp``, unless that is later
    than now. A graceful deletion's ``deletionTimestamp`` is the request's time *plus the grace
    period* — in the future while the object terminates; a GPU pod with a grace period of an hour
    that exits in seconds is DELETED with it ~1 h ahead. Dated so, the event was refused (an
    event cannot have happened after it was observed: ``schemas.envelope.EventBase``), the
    deletion went unpublished until a re-list, and before that check it pushed the controls'
    event-time watermark an hour ahead (a review of that check)."""
    clock = now or datetime.now(timezone.utc)
    return min(deletion, clock) if deletion else clock


def _scheduling_facts(conditions: list, node: str | None, fallback: datetime, where: str) -> list[Fact]:
    """failed_scheduling (PodScheduled=False, Unschedulable) and scheduled (a node is set;
    at PodScheduled=True's transition, else the pod's start or creation)."""
    facts = []
    sched = _cond(conditions, "PodScheduled")
    if sched and sched.get("status") == "False" and sched.get("reason") == "Unschedulable" and sched.get("lastTransitionTime"):
        at = parse_time(sched["lastTransitionTime"], where)
        facts.append(Fact(f"unschedulable|{iso(at)}", "failed_scheduling", "scheduler.failed_scheduling", at, iso(at),
                          "Unschedulable", sched.get("message") or None))
    if node:
        ok = sched and sched.get("status") == "True" and sched.get("lastTransitionTime")
        at = parse_time(sched["lastTransitionTime"], where) if ok else fallback
        facts.append(Fact("scheduled", "scheduled", "scheduler.scheduled", at, iso(at), node=node))
    return facts


def _disruption_fact(conditions: list, status: Mapping, node: str | None, victim: ObjectRef, ended_at: datetime, where: str) -> Fact | None:
    """preempted/evicted: the DisruptionTarget condition, or (older nodes, kubelet
    evictions and critical-pod preemptions set none) status.reason Evicted/Preempting."""
    dt = _cond(conditions, "DisruptionTarget")
    if dt and dt.get("status") == "True":
        reason = dt.get("reason") or "DisruptionTarget"
        at = parse_time(dt.get("lastTransitionTime"), f"{where} condition DisruptionTarget.lastTransitionTime")
        event_type = "scheduler.preempted" if reason in PREEMPTION_REASONS else "scheduler.evicted"
        return Fact("disrupted", event_type.split(".", 1)[1], event_type, at, iso(at), reason, dt.get("message") or None, node=node, victim=victim)
    if status.get("reason") in ("Evicted", "Preempting"):
        event_type = "scheduler.evicted" if status["reason"] == "Evicted" else "scheduler.preempted"
        return Fact("disrupted", event_type.split(".", 1)[1], event_type, ended_at, iso(ended_at), status["reason"],
                    status.get("message") or None, node=node, victim=victim)
    return None


# ----------------------------------------------------------------------------- Events


@dataclass(frozen=True)
class EventView:
    """A core/v1 or events.k8s.io/v1 Event, normalised."""

    uid: str
    namespace: str
    reason: str
    message: str
    regarding: Mapping
    related: Mapping | None
    occurred_at: datetime


def event_view(ev: Mapping) -> EventView:
    """Normalise either Event API version (events.k8s.io/v1 uses regarding/note/eventTime,
    core/v1 involvedObject/message/firstTimestamp)."""
    meta = meta_of(ev, "Event")
    where = f"Event {meta.namespace}/{meta.name}"
    regarding = ev.get("regarding") if "regarding" in ev else ev.get("involvedObject")
    if not isinstance(regarding, Mapping) or not regarding.get("name"):
        raise MalformedObject(f"{where}: no regarding/involvedObject")
    reason = ev.get("reason")
    if not isinstance(reason, str) or not reason:
        raise MalformedObject(f"{where}: missing reason")
    message = ev.get("note") if "note" in ev else ev.get("message")
    when = (ev.get("eventTime") or ev.get("deprecatedFirstTimestamp") or ev.get("firstTimestamp")
            or (ev.get("series") or {}).get("lastObservedTime") or ev.get("lastTimestamp"))
    occurred = parse_time(when, f"{where} eventTime") if when else meta.created
    related = ev.get("related") if isinstance(ev.get("related"), Mapping) else None
    return EventView(meta.uid, meta.namespace, reason, str(message or ""), regarding, related, occurred)


_PREEMPTED_BY_UID = re.compile(r"Preempted by pod ([0-9a-fA-F-]{8,}) on node (\S+)")
_PREEMPTED_BY_NAME = re.compile(r"Preempted by ([^/\s]+)/([^\s]+) on node (\S+)")
_ASSIGNED = re.compile(r"Successfully assigned ([^/\s]+)/(\S+) to (\S+)")


def scheduler_preemptor(ev: EventView, lookup: Callable[[str], tuple[str, str] | None] | None = None) -> tuple[ObjectRef | None, str | None]:
    """(preemptor, node) of a scheduler Preempted event: its ``related`` object, else
    the message ("Preempted by pod <uid> on node <n>" or "Preempted by <ns>/<name> on node <n>")."""
    node = None
    ref = None
    if m := _PREEMPTED_BY_UID.search(ev.message):
        uid, node = m.group(1), m.group(2)
        known = lookup(uid) if lookup else None
        ref = _ref("Pod", known[0] if known else None, known[1] if known else None, uid)
    elif m := _PREEMPTED_BY_NAME.search(ev.message):
        ref, node = _ref("Pod", m.group(1), m.group(2), None), m.group(3)
    rel = ev.related
    if rel and rel.get("name"):
        ref = _ref(str(rel.get("kind") or "Pod"), rel.get("namespace"), rel.get("name"), rel.get("uid") or (ref.uid if ref else None))
    return ref, node


def event_fact(ev: EventView, reasons: Mapping[str, str],
               lookup: Callable[[str], tuple[str, str] | None] | None = None) -> Fact | None:
    """The fact an Event reports, or None when its reason is not one we map (or its message
    calls the transition off: ``EVENT_MESSAGE_PREFIXES``)."""
    event_type = reasons.get(ev.reason)
    if not event_type:
        return None
    prefix = EVENT_MESSAGE_PREFIXES.get(ev.reason)
    if prefix is not None and not ev.message.startswith(prefix):
        return None
    digest = message_digest(ev.message)
    node = preemptor = victim = None
    if m := _ASSIGNED.search(ev.message):
        node = m.group(3)
    if event_type == "scheduler.preempted":
        preemptor, node = scheduler_preemptor(ev, lookup)
        reg = ev.regarding
        victim = _ref(str(reg.get("kind") or "Pod"), reg.get("namespace"), reg.get("name"), reg.get("uid"))
    return Fact(f"{ev.reason}|{digest}", event_type.split(".", 1)[1], event_type, ev.occurred_at, digest,
                ev.reason, ev.message or None, node=node, preemptor=preemptor, victim=victim)


# ----------------------------------------------------------------------------- events


def to_event(uid: str, fact: Fact, identity: Identity, payload: Mapping[str, Any], source: Source,
             observed_at: datetime, trimmer: TextTrimmer | None = None) -> SchedulerEvent:
    """The SchedulerEvent for one fact of object ``uid`` (deterministic event id).

    ``message`` is cut by ``trimmer`` (a fresh ``TextTrimmer`` when None).
    """
    if fact.node and identity.node != fact.node:
        identity = identity.model_copy(update={"node": fact.node})
    message = (trimmer if trimmer is not None else TextTrimmer())("payload.message", fact.message)
    body = {**payload, "reason": fact.reason, "message": message, "preemptor": fact.preemptor, "victim": fact.victim}
    return SchedulerEvent(
        event_id=make_event_id(SOURCE, (uid, fact.transition, fact.reason), fact.version),
        event_type=fact.event_type,
        occurred_at=fact.occurred_at,
        observed_at=observed_at,
        source=source,
        identity=identity,
        payload=SchedulerPayload(**body),
    )


def workload_identity(info: WorkloadInfo) -> Identity:
    return Identity(workload_id=info.workload_id, namespace=info.namespace, **info.identity)


def workload_payload(info: WorkloadInfo) -> dict[str, Any]:
    return {
        "object_kind": "Workload",
        "queue": info.queue,
        "cluster_queue": info.cluster_queue,
        "priority_class": info.priority_class,
        "priority": info.priority,
        "gpus_requested": info.gpus,
        "labels": dict(info.labels),
        "flavors": dict(info.flavors),
        "pod_sets": dict(info.pod_sets),
    }
