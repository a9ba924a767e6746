"""A simulated GPU cluster that exposes the surfaces the real world does.

Input: a validated ``Scenario`` (``gpuledger.sim.scenario``), a seed, and one
timeline step at a time (``SimCluster.apply``) with the event time it happens at.
Output, only through real wire protocols — the simulator is a *source*, never a
shortcut into Kafka or ClickHouse:
- a Kubernetes API server over HTTP (``FakeKubeApi``: Pods, events.k8s.io/v1
  Events, Kueue v1beta2 Workloads, Nodes, ClusterQueues, LocalQueues,
  WorkloadPriorityClasses, ResourceFlavors) that the real scheduler collector
  lists and watches through a kubeconfig;
- one kubelet pod-resources gRPC socket per node (``FakeKubelet``) that the real
  pod-resources collectors poll: which pod's container holds which device, and the
  node's allocatable (healthy) devices;
- webhook POSTs into the real receiver: release lifecycle events as gpuledger
  ``ReleaseEvent`` JSON to ``/v1/releases`` (built by ``producers.releases.build_event``,
  the same function behind ``gpuledger release``) and Alertmanager v4 payloads to
  ``/v1/alertmanager`` (XID alerts with dcgm-exporter's ``Hostname``/``UUID`` labels,
  quality alerts with model/release labels).

What it models: N nodes × M GPUs (``GPU-<uuid>`` device ids, or ``MIG-<uuid>``
slices on MIG-partitioned nodes), Kueue queues and priority classes, a model
registry (``releases`` of the scenario, with derived image/artifact digests).
Workloads are Kueue Workloads owned by a Job; their pods carry the
``gpuledger.io/*`` release labels (unless the scenario says not to), the Kueue
queue label and the ``kueue.x-k8s.io/workload`` annotation, run the release's
image (``imageID`` = ``repo@sha256:…``) and are bound to nodes first-fit or as
placed. Preemption sets the victim Workload's Evicted/Preempted conditions (the
message names the preemptor's UID, as Kueue's does), a ``DisruptionTarget``
condition on the victim pods, and a scheduler ``Preempted`` Event naming the
preemptor pod.

Guarantees: with the same scenario and seed every name, UID, GPU UUID and alert
fingerprint is the same (event *times* are whatever the caller passes). Capacity is
checked: a placement that does not fit raises ``SimulationError`` naming the step.
Without ``surfaces`` the cluster runs as a dry model (``dry_run``), which is how a
scenario's capacity is checked before anything starts.
Limits: no scheduler logic (placement is scripted), no pod restarts, no
multi-container pods; a failed GPU keeps its pod (only the allocatable set
shrinks); Events are recorded in events.k8s.io/v1 only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

from gpuledger.sim.kube_api import (
    EVENTS,
    KUEUE_GROUP,
    NODES,
    PODS,
    FakeKubeApi,
    disruption_target,
    make_event_v1,
    make_node,
    make_pod,
    make_pod_set,
    make_workload,
    pod_set_assignment,
    rfc3339,
    workload_condition,
    workloads,
)
from gpuledger.sim.kubelet import FakeKubelet, container, devices, pod
from gpuledger.sim.scenario import (
    AlertAction,
    FailGpuAction,
    FinishAction,
    IsolateNodeAction,
    PreemptAction,
    ReleaseAction,
    ReserveAction,
    ResolveAction,
    ScaleAction,
    Scenario,
    Step,
    SubmitAction,
    UnreserveAction,
)
from gpuledger.timefmt import iso_z

log = logging.getLogger(__name__)

KUEUE_VERSION = "v1beta2"
WORKLOADS = workloads(KUEUE_VERSION)
LABEL_PREFIX = "gpuledger.io/"
GPU_RESOURCE = "nvidia.com/gpu"
REGISTRY_HOST = "sim-registry"
ALERTMANAGER_URL = "http://alertmanager.sim:9093"
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what Kubernetes uses for generated names
#: Release step kind -> `gpuledger release` subcommand (producers.releases.COMMANDS).
RELEASE_COMMANDS = {"register": "register", "evaluate": "evaluate", "approve": "approve", "promote": "promote",
                    "rollback": "rollback", "revoke": "revoke", "retire": "retire", "reserve": "reserve",
                    "unreserve": "unreserve", "isolate_node": "isolate-node"}


class SimulationError(RuntimeError):
    """A step that cannot happen in the simulated cluster (no capacity, receiver refused)."""


# --- state ------------------------------------------------------------------------------------------

@dataclass
class Device:
    id: str
    index: int  # device index on the node (what scenarios name)
    gpu_uuid: str
    gpu_index: int  # physical GPU index (differs from index on MIG nodes)
    numa: int
    healthy: bool = True
    holder: str | None = None  # namespace/pod


@dataclass
class SimNode:
    name: str
    resource: str
    devices: list[Device]
    mig: bool
    unschedulable: bool = False

    def free(self) -> list[Device]:
        return [d for d in self.devices if d.holder is None and d.healthy]


@dataclass
class SimPod:
    namespace: str
    name: str
    uid: str
    node: str
    devices: list[str]
    workload: str
    created: datetime

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class SimWorkload:
    name: str  # the scenario's name
    kueue_name: str  # the Workload object's name (Kueue's job-<name>-<hash>)
    namespace: str
    uid: str
    job_uid: str
    spec: SubmitAction
    release_id: str | None
    image: str
    image_id: str
    priority: int
    cluster_queue: str
    flavor: str
    resource: str
    pods_total: int
    created_at: datetime
    conditions: list[dict] = field(default_factory=list)
    live: list[SimPod] = field(default_factory=list)
    all_pods: list[SimPod] = field(default_factory=list)
    done: bool = False

    @property
    def workload_id(self) -> str:
        return f"{self.namespace}/{self.kueue_name}"


@dataclass
class SimAlert:
    id: str
    labels: dict[str, str]
    annotations: dict[str, str]
    fingerprint: str
    starts_at: datetime
    ends_at: datetime | None = None


@dataclass
class StepRecord:
    """What one step did, for the progress output and the report."""

    index: int
    id: str | None
    kind: str
    at: datetime
    summary: str
    note: str | None = None


# --- the real-protocol surfaces -----------------------------------------------------------------------

class Surfaces:
    """The endpoints collectors and the receiver see: the API server, one kubelet
    socket per node, and the receiver's URL for webhooks (set once it listens)."""

    def __init__(self, node_names: list[str], socket_dir: Path, request_timeout_s: float = 30.0) -> None:
        self.api = FakeKubeApi(kueue_versions=(KUEUE_VERSION,), default_watch_timeout=60.0)
        self.socket_dir = Path(socket_dir)
        self.kubelets = {n: FakeKubelet(self.socket_dir / f"{n}.sock") for n in node_names}
        self.receiver_url: str | None = None
        self.request_timeout_s = request_timeout_s
        self.posts = 0

    def start(self) -> Surfaces:
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        self.api.start()
        for kubelet in self.kubelets.values():
            kubelet.start()
        return self

    def stop(self) -> None:
        for kubelet in self.kubelets.values():
            kubelet.stop(grace=0.5)
        self.api.stop()

    def __enter__(self) -> Surfaces:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def kubeconfig(self) -> dict:
        """A kubeconfig naming the simulated API server (no credentials: it has no auth)."""
        return {"apiVersion": "v1", "kind": "Config", "current-context": "gpuledger-sim",
                "clusters": [{"name": "gpuledger-sim", "cluster": {"server": self.api.url}}],
                "users": [{"name": "sim", "user": {}}],
                "contexts": [{"name": "gpuledger-sim", "context": {"cluster": "gpuledger-sim", "user": "sim"}}]}

    def post(self, path: str, body: Any) -> dict:
        """POST JSON to the receiver; retried while it answers 503 (Kafka not acknowledging)."""
        if not self.receiver_url:
            raise SimulationError("the receiver is not running (no URL to send webhooks to)")
        answer = post_json(self.receiver_url, path, body, self.request_timeout_s)
        self.posts += 1
        return answer


def post_json(base_url: str, path: str, body: Any, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> dict:
    """POST JSON to ``base_url + path``; retried while it answers 503 (the receiver: Kafka not acknowledging)."""
    data = json.dumps(body).encode()
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        req = urllib.request.Request(base_url.rstrip("/") + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:500]
            if exc.code != 503 or time.monotonic() > deadline:
                raise SimulationError(f"{base_url} answered {exc.code} to POST {path}: {detail}") from exc
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SimulationError(f"{base_url} unreachable: {exc}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


# --- helpers ----------------------------------------------------------------------------------------

def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def image_repo(image: str) -> str:
    """Repository of an image reference (tag and digest stripped)."""
    ref = image.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return ref.rsplit(":", 1)[0] if ":" in last else ref


def alert_fingerprint(labels: dict[str, str]) -> str:
    """Alertmanager's fingerprint of a label set: FNV-1a 64 over the sorted labels
    (name, 0xff, value, 0xff), as Prometheus' ``LabelSet.Fingerprint``."""
    h = 0xCBF29CE484222325
    for name in sorted(labels):
        for part in (name.encode(), b"\xff", labels[name].encode(), b"\xff"):
            for byte in part:
                h ^= byte
                h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# --- the cluster --------------------------------------------------------------------------------------

class SimCluster:
    """The simulated cluster: state plus the surfaces it publishes it on (see module docstring).

    ``seconds_to_wall`` converts scenario durations (a reservation window) to the
    compressed clock the run uses.
    """

    def __init__(self, scenario: Scenario, seed: int, surfaces: Surfaces | None = None,
                 seconds_to_wall: Callable[[float], float] = lambda s: s) -> None:
        self.scenario = scenario
        self.seed = seed
        self.surfaces = surfaces
        self.seconds_to_wall = seconds_to_wall
        self.rng = random.Random(f"{scenario.name}:{seed}")
        self.nodes: dict[str, SimNode] = {}
        self.workloads: dict[str, SimWorkload] = {}
        self.alerts: dict[str, SimAlert] = {}
        self.records: list[StepRecord] = []
        self.started_at: datetime | None = None
        # Enforcement (scenario enforce: true): the Workload object at creation -> (allowed, message),
        # gpuledger admit's webhook answer; a denied workload is kept here and never created.
        self.admit: Callable[[dict], tuple[bool, str]] | None = None
        self.denied: dict[str, tuple[SimWorkload, str]] = {}
        cluster = scenario.cluster
        for spec in cluster.nodes:
            gpus = spec.gpus or cluster.gpus_per_node
            devs: list[Device] = []
            for g in range(gpus):
                gpu_uuid = f"GPU-{self._uuid()}"
                numa = 0 if g < max(gpus // 2, 1) else 1
                if spec.mig:
                    for _ in range(spec.mig.per_gpu):
                        devs.append(Device(f"MIG-{self._uuid()}", len(devs), gpu_uuid, g, numa))
                else:
                    devs.append(Device(gpu_uuid, len(devs), gpu_uuid, g, numa))
            resource = f"nvidia.com/mig-{spec.mig.profile}" if spec.mig else GPU_RESOURCE
            self.nodes[spec.name] = SimNode(spec.name, resource, devs, bool(spec.mig))
        self._releases = {rid: self._manifest(rid) for rid in scenario.releases}

    # -- deterministic names ---------------------------------------------------------------------

    def _uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def _suffix(self, n: int = 5) -> str:
        return "".join(self.rng.choice(_SUFFIX_ALPHABET) for _ in range(n))

    def _manifest(self, rid: str) -> dict[str, str | None]:
        spec = self.scenario.releases[rid]
        return {
            "release_id": rid, "model": spec.model, "version": spec.version, "owner": spec.owner,
            "artifact_digest": spec.artifact_digest or "sha256:" + _sha(f"artifact:{spec.model}:{spec.version}:{rid}"),
            "image_digest": spec.image_digest or "sha256:" + _sha(spec.image),
            "config_digest": "sha256:" + _sha(f"config:{rid}"),
            "dataset": spec.dataset, "data_class": spec.data_class, "environment": spec.environment, "image": spec.image,
        }

    # -- what resources the collectors must watch -------------------------------------------------

    @property
    def gpu_resources(self) -> list[str]:
        return sorted({n.resource for n in self.nodes.values()})

    # -- symbols used by expectations and the report ----------------------------------------------

    def workload_id(self, name: str) -> str:
        if "/" in name:
            return name
        wl = self.workloads.get(name) or (self.denied[name][0] if name in self.denied else None)
        if wl is None:
            raise KeyError(f"no workload {name!r} was submitted")
        return wl.workload_id

    def pod_key(self, ref: str) -> str:
        name, _, idx = ref.partition("#")
        return self.workloads[name].all_pods[int(idx)].key

    def device_id(self, ref: str) -> tuple[str, str]:
        node, _, idx = ref.partition("/")
        return node, self.nodes[node].devices[int(idx)].id

    def alert_fingerprint(self, alert_id: str) -> str:
        return self.alerts[alert_id].fingerprint

    def step_time(self, step_id: str) -> datetime | None:
        return next((r.at for r in self.records if r.id == step_id), None)

    def release_manifest(self, rid: str) -> dict:
        return dict(self._releases[rid])

    def lanes(self) -> list[dict]:
        """Every device of the cluster, for the report's lanes."""
        out = []
        for node in self.nodes.values():
            for d in node.devices:
                label = f"{node.name} · GPU {d.index}" if not node.mig else f"{node.name} · MIG {d.index}"
                out.append({"node": node.name, "gpu_id": d.id, "label": label, "healthy": d.healthy})
        return out

    def describe(self) -> str:
        parts = []
        for node in self.nodes.values():
            kind = f"{len(node.devices)} MIG slices ({node.resource.split('/', 1)[1]})" if node.mig else f"{len(node.devices)} GPUs"
            parts.append(f"{node.name}: {kind}")
        return ", ".join(parts)

    # -- setting up --------------------------------------------------------------------------------

    def setup(self, at: datetime) -> None:
        """Create nodes, Kueue objects and the kubelets' allocatable devices."""
        self.started_at = at
        if not self.surfaces:
            return
        api = self.surfaces.api
        cluster = self.scenario.cluster
        for node in self.nodes.values():
            obj = make_node(node.name, gpus=len(node.devices), gpu_product=cluster.gpu_product, gpu_resource=node.resource,
                            created=at - timedelta(days=30))
            obj["metadata"]["uid"] = self._uuid()
            api.create(NODES, obj)
            self._publish_allocatable(node)
            self.surfaces.kubelets[node.name].set_pods([])
        kueue = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
        flavors = sorted({q.flavor for q in cluster.queues})
        for flavor in flavors:
            api.create(f"{kueue}/resourceflavors", {"metadata": {"name": flavor, "uid": self._uuid()}, "spec": {}})
        for cq in sorted({q.cluster_queue for q in cluster.queues}):
            quota = sum(len(n.devices) for n in self.nodes.values())
            api.create(f"{kueue}/clusterqueues", {"metadata": {"name": cq, "uid": self._uuid()}, "spec": {
                "namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [{"coveredResources": self.gpu_resources, "flavors": [
                    {"name": f, "resources": [{"name": r, "nominalQuota": str(quota)} for r in self.gpu_resources]} for f in flavors]}]}})
        for q in cluster.queues:
            api.create(f"{kueue}/localqueues", {"metadata": {"name": q.name, "namespace": q.namespace, "uid": self._uuid()},
                                                "spec": {"clusterQueue": q.cluster_queue}})
        for name, value in cluster.priority_classes.items():
            api.create(f"{kueue}/workloadpriorityclasses", {"metadata": {"name": name, "uid": self._uuid()}, "value": value,
                                                            "description": f"{name} ({value})"})

    def _publish_allocatable(self, node: SimNode) -> None:
        if self.surfaces:
            healthy = [devices(node.resource, [d.id], numa=[d.numa]) for d in node.devices if d.healthy]
            self.surfaces.kubelets[node.name].set_allocatable(healthy)

    def _publish_kubelet(self, node_name: str) -> None:
        """The node's kubelet view: every live pod on it with its devices."""
        if not self.surfaces:
            return
        node = self.nodes[node_name]
        pods = []
        for wl in self.workloads.values():
            for p in wl.live:
                if p.node == node_name:
                    numa = sorted({d.numa for d in node.devices if d.id in p.devices})
                    pods.append(pod(p.namespace, p.name, containers=[container("main", devices=[devices(node.resource, p.devices, numa=numa)])]))
        self.surfaces.kubelets[node_name].set_pods(pods)

    # -- the timeline ------------------------------------------------------------------------------

    def apply(self, step: Step, index: int, at: datetime) -> StepRecord:
        """Carry out one step at event time ``at``; SimulationError names the step on failure."""
        handler = getattr(self, f"_do_{step.kind}", None)
        try:
            if step.kind in RELEASE_COMMANDS and step.kind != "isolate_node":
                summary = self._release_event(step.kind, step.action, at)
            else:
                summary = handler(step.action, at)
        except SimulationError as exc:
            raise SimulationError(f"timeline[{index}] ({step.kind}{f' {step.id}' if step.id else ''}): {exc}") from exc
        record = StepRecord(index, step.id, step.kind, at, summary, step.note)
        self.records.append(record)
        return record

    # release lifecycle ------------------------------------------------------------------------------

    def _release_event(self, kind: str, action: ReleaseAction, at: datetime, target: str | None = None) -> str:
        event, summary = self.release_event(kind, action, at, target)
        if self.surfaces:
            self.surfaces.post("/v1/releases", event.model_dump(mode="json"))
        return summary

    def release_event(self, kind: str, action: ReleaseAction, at: datetime, target: str | None = None):
        """The release step as the event ``gpuledger release …`` would build, and its one-line summary."""
        from producers.releases import COMMANDS, build_event

        command = next(c for c in COMMANDS if c.name == RELEASE_COMMANDS[kind])
        m = self._releases[action.release]
        env = getattr(action, "env", None) or m["environment"]
        options: dict[str, Any] = {
            "release_id": m["release_id"], "model": m["model"], "version": m["version"], "artifact_digest": m["artifact_digest"],
            "image_digest": m["image_digest"], "config_digest": m["config_digest"], "dataset": m["dataset"], "env": env,
            "owner": m["owner"], "data_class": m["data_class"], "actor": action.actor or ("ci-pipeline" if kind in ("register", "evaluate") else None),
            "approval_id": getattr(action, "approval_id", None), "reason": action.reason, "superseded": getattr(action, "superseded", None),
            "target": target, "at": at.isoformat(),
        }
        if isinstance(action, ReserveAction):
            options.update(reservation_id=action.reservation_id, gpus=action.gpus, pool=action.pool)
            if action.window:
                options.update(window_start=at.isoformat(), window_end=(at + timedelta(seconds=self.seconds_to_wall(action.window))).isoformat())
        elif isinstance(action, UnreserveAction):
            options.update(reservation_id=action.reservation_id)
        event = build_event(command, options, observed_at=at, host=REGISTRY_HOST)
        who = f" by {options['actor']}" if options["actor"] else ""
        extra = {"promote": f" to {env}", "rollback": f" out of {env}", "reserve": f" ({getattr(action, 'gpus', '')} GPUs)",
                 "isolate_node": f" ({target})"}.get(kind, "")
        return event, f"{event.event_type} {m['release_id']}{extra}{who}"

    def _do_isolate_node(self, a: IsolateNodeAction, at: datetime) -> str:
        summary = self._release_event("isolate_node", a, at, target=a.node)
        node = self.nodes[a.node]
        node.unschedulable = True
        if self.surfaces:
            self.surfaces.api.patch(NODES, None, a.node, {"spec": {"unschedulable": True, "taints": [
                {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": rfc3339(at)},
                {"key": "gpuledger.io/isolated", "value": a.actor, "effect": "NoExecute", "timeAdded": rfc3339(at)}]}})
        moved: list[str] = []
        if a.evict:
            victims = [(wl, p) for wl in self.workloads.values() for p in list(wl.live) if p.node == a.node]
            for wl, p in victims:
                self._end_pod(wl, p, at, "Failed", extra=[disruption_target("EvictionByEvictionAPI", at)])
            self._publish_kubelet(a.node)
            if a.reschedule:
                for wl, p in victims:
                    if not wl.done:
                        new = self._place(wl, 1, [], at)
                        moved.extend(f"{q.name}→{q.node}" for q in new)
            summary += f"; cordoned, {len(victims)} pod(s) evicted" + (f", rescheduled {', '.join(moved)}" if moved else "")
        return summary

    # workloads --------------------------------------------------------------------------------------

    def _do_submit(self, a: SubmitAction, at: datetime) -> str:
        cluster = self.scenario.cluster
        queue = next(q for q in cluster.queues if q.name == a.queue)
        if a.release:
            m = self._releases[a.release]
            image = a.image or m["image"]
            digest = m["image_digest"] if image == m["image"] else "sha256:" + _sha(image)
        else:
            image = a.image or ""
            digest = "sha256:" + _sha(image)
        resource = GPU_RESOURCE
        if a.mig:
            resource = next(n.resource for n in self.nodes.values() if n.mig)
        job_uid = self._uuid()
        wl = SimWorkload(
            name=a.workload, kueue_name=f"job-{a.workload}-{_sha(job_uid)[:5]}", namespace=queue.namespace, uid=self._uuid(),
            job_uid=job_uid, spec=a, release_id=a.release, image=image, image_id=f"{image_repo(image)}@{digest}",
            priority=cluster.priority_classes[a.priority_class], cluster_queue=queue.cluster_queue, flavor=queue.flavor,
            resource=resource, pods_total=a.pods, created_at=at,
        )
        if self.admit is not None:
            allowed, message = self.admit(self._workload_object(wl))
            if not allowed:
                self.denied[a.workload] = (wl, message)
                return f"submit {wl.workload_id}: denied by gpuledger admit: {message}"
            # The webhook decided on the real clock, a moment after the step's planned time: the
            # workload is created once the answer came, as in a cluster.
            at = max(at, datetime.now(timezone.utc))
            wl.created_at = at
        wl.conditions = [
            workload_condition("QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {wl.cluster_queue}", at),
            workload_condition("Admitted", "True", "Admitted", "The workload is admitted", at),
        ]
        # Place first so a placement that does not fit fails before anything is published.
        placed = self._plan(wl, a.pods, a.placement)
        self.workloads[a.workload] = wl
        if self.surfaces:
            self.surfaces.api.create(WORKLOADS, self._workload_object(wl))
        pods = self._start_pods(wl, placed, at)
        rel = f" (release {a.release}{'' if a.label_release else ', image digest only'})" if a.release else " (no release)"
        return (f"submit {wl.workload_id} [{a.priority_class}={wl.priority}]: {len(pods)} pod(s) × {a.gpus_per_pod} "
                f"{'MIG slice' if a.mig else 'GPU'}{'s' if a.gpus_per_pod > 1 else ''} on {', '.join(p.node for p in pods)}{rel}")

    def _do_scale(self, a: ScaleAction, at: datetime) -> str:
        wl = self.workloads[a.workload]
        add = a.pods - len(wl.live)
        if add <= 0:
            return f"scale {wl.workload_id}: already {len(wl.live)} pod(s)"
        pods = self._place(wl, add, a.placement, at)
        return f"scale {wl.workload_id} to {len(wl.live)} pod(s): +{', '.join(f'{p.name} on {p.node}' for p in pods)}"

    def _do_preempt(self, a: PreemptAction, at: datetime) -> str:
        victim, by = self.workloads[a.victim], self.workloads[a.preemptor]
        if not victim.live:
            raise SimulationError(f"workload {a.victim} has no running pod to preempt")
        if by.priority <= victim.priority:
            log.info("preemptor %s has priority %d <= victim %s's %d (scripted anyway)", a.preemptor, by.priority, a.victim, victim.priority)
        message = (f"Preempted to accommodate a workload (UID: {by.uid}, JobUID: {by.job_uid}) due to prioritization in the "
                   f"ClusterQueue")
        victim.conditions = [c for c in victim.conditions if c["type"] not in ("QuotaReserved", "Admitted")] + [
            workload_condition("QuotaReserved", "False", "Preempted", message, at),
            workload_condition("Admitted", "False", "Preempted", message, at),
            workload_condition("Evicted", "True", "Preempted", message, at),
            workload_condition("Preempted", "True", "InClusterQueue", message, at),
        ]
        nodes = set()
        for p in list(victim.live):
            preemptor_pod = next((q for q in by.live if q.node == p.node), by.live[0] if by.live else None)
            if self.surfaces:
                related = ({"kind": "Pod", "namespace": preemptor_pod.namespace, "name": preemptor_pod.name, "uid": preemptor_pod.uid,
                            "apiVersion": "v1"} if preemptor_pod else None)
                who = f"pod {preemptor_pod.uid}" if preemptor_pod else f"{by.namespace}/{by.kueue_name}"
                self.surfaces.api.create(EVENTS, make_event_v1(
                    p.namespace, f"{p.name}.{self._suffix(16)}", self._pod_ref(p), "Preempted", f"Preempted by {who} on node {p.node}",
                    "Normal", related, at, uid=self._uuid()))
            self._end_pod(victim, p, at, "Failed", extra=[disruption_target("PreemptionByScheduler", at)])
            nodes.add(p.node)
        victim.done = True
        self._update_workload(victim)
        for n in sorted(nodes):
            self._publish_kubelet(n)
        return f"preempt {victim.workload_id} (priority {victim.priority}) by {by.workload_id} (priority {by.priority}) on {', '.join(sorted(nodes))}"

    def _do_finish(self, a: FinishAction, at: datetime) -> str:
        wl = self.workloads[a.workload]
        nodes = {p.node for p in wl.live}
        n = len(wl.live)
        for p in list(wl.live):
            self._end_pod(wl, p, at, "Succeeded")
        wl.conditions = [c for c in wl.conditions if c["type"] != "Finished"] + [
            workload_condition("Finished", "True", "Succeeded", "Job finished successfully", at)]
        wl.done = True
        self._update_workload(wl)
        for node in sorted(nodes):
            self._publish_kubelet(node)
        return f"finish {wl.workload_id}: {n} pod(s) completed, GPUs freed"

    # alerts -----------------------------------------------------------------------------------------

    def _do_fail_gpu(self, a: FailGpuAction, at: datetime) -> str:
        node = self.nodes[a.node]
        dev = node.devices[a.gpu]
        dev.healthy = False
        self._publish_allocatable(node)
        labels = {
            # dcgm-exporter names the physical GPU (UUID) even on MIG nodes; the slice is GPU_I_ID.
            "alertname": "GpuXidError", "severity": a.severity, "Hostname": a.node, "UUID": dev.gpu_uuid,
            "gpu": str(dev.gpu_index), "device": f"nvidia{dev.gpu_index}",
            "err_code": str(a.xid), "err_msg": _XID_MESSAGES.get(a.xid, "XID error"), "modelName": self.scenario.cluster.gpu_product,
            "job": "nvidia-dcgm-exporter", "instance": f"{a.node}:9400",
        }
        if node.mig:
            labels.update(GPU_I_ID=str(dev.index - dev.gpu_index * sum(d.gpu_index == dev.gpu_index for d in node.devices)),
                          GPU_I_PROFILE=node.resource.rsplit("mig-", 1)[1])
        annotations = {"summary": f"XID {a.xid} on {a.node} GPU {dev.gpu_index} ({labels['err_msg']})"}
        self._fire(a.alert, labels, annotations, at)
        holder = f", held by {dev.holder}" if dev.holder else ", idle"
        return f"fail GPU {a.node}/{dev.index} ({dev.id[:12]}…{holder}): XID {a.xid} alert {self.alerts[a.alert].fingerprint}"

    def _do_alert(self, a: AlertAction, at: datetime) -> str:
        labels = {"alertname": a.name, "severity": a.severity, **a.labels}
        if a.release:
            labels["gpuledger_release_id"] = a.release
        if a.model:
            labels["model"] = a.model
        if a.model_version:
            labels["model_version"] = a.model_version
        if a.environment:
            labels["environment"] = a.environment
        annotations = {"summary": a.summary or f"{a.name} fired"}
        self._fire(a.id, labels, annotations, at)
        return f"alert {a.name} ({a.severity}) firing, fingerprint {self.alerts[a.id].fingerprint}"

    def _do_resolve(self, a: ResolveAction, at: datetime) -> str:
        alert = self.alerts[a.alert]
        alert.ends_at = at
        self._send_alert(alert, "resolved")
        return f"alert {alert.labels['alertname']} resolved"

    def _fire(self, alert_id: str, labels: dict[str, str], annotations: dict[str, str], at: datetime) -> None:
        alert = SimAlert(alert_id, labels, annotations, alert_fingerprint(labels), at)
        self.alerts[alert_id] = alert
        self._send_alert(alert, "firing")

    def _send_alert(self, alert: SimAlert, status: str) -> None:
        if not self.surfaces:
            return
        body = {
            "version": "4", "receiver": "gpuledger", "status": status, "externalURL": ALERTMANAGER_URL,
            "groupKey": f'{{}}:{{alertname="{alert.labels["alertname"]}"}}', "truncatedAlerts": 0,
            "groupLabels": {"alertname": alert.labels["alertname"]}, "commonLabels": dict(alert.labels),
            "commonAnnotations": dict(alert.annotations),
            "alerts": [{
                "status": status, "labels": dict(alert.labels), "annotations": dict(alert.annotations),
                "startsAt": iso_z(alert.starts_at), "endsAt": iso_z(alert.ends_at) if alert.ends_at else "0001-01-01T00:00:00Z",
                "generatorURL": f"http://prometheus.sim:9090/graph?g0.expr={alert.labels['alertname']}", "fingerprint": alert.fingerprint,
            }],
        }
        self.surfaces.post("/v1/alertmanager", body)

    # pods -------------------------------------------------------------------------------------------

    def _plan(self, wl: SimWorkload, count: int, placement: list[str]) -> list[tuple[str, list[Device]]]:
        """Choose node and devices for ``count`` new pods without taking them yet."""
        taken: set[str] = set()
        plan = []
        per_pod = wl.spec.gpus_per_pod
        for i in range(count):
            wanted = placement[i] if i < len(placement) else None
            candidates = [self.nodes[wanted]] if wanted else [n for n in self.nodes.values() if n.mig == wl.spec.mig]
            chosen = None
            for node in candidates:
                if node.unschedulable and not wanted:
                    continue
                free = [d for d in node.free() if d.id not in taken]
                if len(free) >= per_pod and node.mig == wl.spec.mig:
                    chosen = (node.name, free[:per_pod])
                    break
            if chosen is None:
                where = f"node {wanted}" if wanted else "any schedulable node"
                free_now = {n.name: len([d for d in n.free() if d.id not in taken]) for n in candidates}
                raise SimulationError(f"pod {i + 1} of {wl.name} needs {per_pod} free {'MIG slice' if wl.spec.mig else 'GPU'}(s) on "
                                      f"{where}; free: {free_now}")
            if wanted and self.nodes[wanted].unschedulable:
                raise SimulationError(f"node {wanted} is cordoned (isolated)")
            taken.update(d.id for d in chosen[1])
            plan.append(chosen)
        return plan

    def _place(self, wl: SimWorkload, count: int, placement: list[str], at: datetime) -> list[SimPod]:
        return self._start_pods(wl, self._plan(wl, count, placement), at)

    def _start_pods(self, wl: SimWorkload, plan: list[tuple[str, list[Device]]], at: datetime) -> list[SimPod]:
        out = []
        for node_name, devs in plan:
            index = len(wl.all_pods)
            p = SimPod(wl.namespace, f"{wl.name}-{index}-{self._suffix()}", self._uuid(), node_name, [d.id for d in devs], wl.name, at)
            for d in devs:
                d.holder = p.key
            wl.live.append(p)
            wl.all_pods.append(p)
            out.append(p)
            if self.surfaces:
                self.surfaces.api.create(PODS, self._pod_object(wl, p, "Running"))
                self.surfaces.api.create(EVENTS, make_event_v1(
                    p.namespace, f"{p.name}.{self._suffix(16)}", self._pod_ref(p), "Scheduled",
                    f"Successfully assigned {p.namespace}/{p.name} to {node_name}", "Normal", None, at, uid=self._uuid()))
        wl.pods_total = max(wl.pods_total, len(wl.live))
        if len(wl.all_pods) > len(plan):  # scale-up: the Workload's pod count changed
            self._update_workload(wl)
        for node_name in sorted({n for n, _ in plan}):
            self._publish_kubelet(node_name)
        return out

    def _end_pod(self, wl: SimWorkload, p: SimPod, at: datetime, phase: str, extra: list[dict] | None = None) -> None:
        """The pod terminates (phase Succeeded/Failed, optional disruption condition) and is deleted."""
        wl.live.remove(p)
        for d in self.nodes[p.node].devices:
            if d.holder == p.key:
                d.holder = None
        if not self.surfaces:
            return
        api = self.surfaces.api
        obj = self._pod_object(wl, p, phase, conditions_extra=extra or [], ended=at)
        api.update(PODS, obj)
        api.patch(PODS, p.namespace, p.name, {"metadata": {"deletionTimestamp": rfc3339(at), "deletionGracePeriodSeconds": 0}})
        api.delete(PODS, p.namespace, p.name)

    def _pod_ref(self, p: SimPod) -> dict:
        return {"kind": "Pod", "namespace": p.namespace, "name": p.name, "uid": p.uid, "apiVersion": "v1"}

    def _labels(self, wl: SimWorkload) -> dict[str, str]:
        labels = {"kueue.x-k8s.io/queue-name": wl.spec.queue, "batch.kubernetes.io/job-name": wl.name,
                  "batch.kubernetes.io/controller-uid": wl.job_uid, "app.kubernetes.io/name": wl.name, **wl.spec.labels}
        if wl.release_id and wl.spec.label_release:
            m = self._releases[wl.release_id]
            labels.update({f"{LABEL_PREFIX}release-id": wl.release_id, f"{LABEL_PREFIX}model": m["model"],
                           f"{LABEL_PREFIX}model-version": m["version"], f"{LABEL_PREFIX}environment": m["environment"],
                           f"{LABEL_PREFIX}owner": m["owner"], "app.kubernetes.io/version": m["version"]})
        return labels

    def _pod_object(self, wl: SimWorkload, p: SimPod, phase: str, conditions_extra: list[dict] = (), ended: datetime | None = None) -> dict:
        obj = make_pod(p.namespace, p.name, p.node, wl.spec.gpus_per_pod, labels=self._labels(wl),
                       annotations={"kueue.x-k8s.io/workload": wl.kueue_name}, owner=("Job", wl.name, wl.job_uid, "batch/v1"),
                       image=wl.image, image_id=wl.image_id, phase="Running", priority_class=wl.spec.priority_class,
                       priority=wl.priority, uid=p.uid, created=p.created, gpu_resource=wl.resource)
        if phase != "Running":
            status = obj["status"]
            status["phase"] = phase
            state = status["containerStatuses"][0]
            code, reason = (0, "Completed") if phase == "Succeeded" else (137, "Error")
            state["state"] = {"terminated": {"exitCode": code, "reason": reason, "startedAt": rfc3339(p.created),
                                             "finishedAt": rfc3339(ended)}}
            state["ready"] = False
            state["started"] = False
            for c in status["conditions"]:
                if c["type"] in ("Ready", "ContainersReady"):
                    c.update(status="False", reason="PodCompleted" if phase == "Succeeded" else "PodFailed", lastTransitionTime=rfc3339(ended))
            status["conditions"].extend(dict(c) for c in conditions_extra)
        return obj

    def _workload_object(self, wl: SimWorkload) -> dict:
        count = max(wl.pods_total, len(wl.live))
        gpus = count * wl.spec.gpus_per_pod
        labels = {k: v for k, v in self._labels(wl).items() if k.startswith(LABEL_PREFIX) or k == "kueue.x-k8s.io/queue-name"}
        admission = None
        if any(c["type"] == "Admitted" and c["status"] == "True" for c in wl.conditions):
            admission = {"clusterQueue": wl.cluster_queue, "podSetAssignments": [pod_set_assignment(
                "main", {wl.resource: wl.flavor, "cpu": "default-flavor", "memory": "default-flavor"},
                {wl.resource: str(gpus), "cpu": str(4 * count), "memory": f"{16 * count}Gi"}, count)]}
        obj = make_workload(
            wl.namespace, wl.kueue_name, wl.spec.queue, wl.spec.priority_class, wl.priority,
            pod_sets=[make_pod_set("main", count, wl.spec.gpus_per_pod, image=wl.image, gpu_resource=wl.resource, labels=labels)],
            conditions=wl.conditions, admission=admission, owner=("Job", wl.name, wl.job_uid, "batch/v1"), version=KUEUE_VERSION,
            uid=wl.uid, created=wl.created_at, labels={"kueue.x-k8s.io/queue-name": wl.spec.queue},
        )
        return obj

    def _update_workload(self, wl: SimWorkload) -> None:
        if self.surfaces:
            self.surfaces.api.update(WORKLOADS, self._workload_object(wl))


_XID_MESSAGES = {
    13: "Graphics Engine Exception", 31: "GPU memory page fault", 43: "GPU stopped processing", 48: "Double Bit ECC Error",
    63: "ECC page retirement or row remapping", 64: "ECC page retirement or row remapper recording failure",
    74: "NVLink Error", 79: "GPU has fallen off the bus", 94: "Contained ECC error", 95: "Uncontained ECC error",
}


def dry_run(scenario: Scenario, seed: int) -> list[StepRecord]:
    """Play the timeline without any surface (capacity and references); SimulationError on a step that cannot happen."""
    sim = SimCluster(scenario, seed)
    t0 = datetime(2000, 1, 1, tzinfo=timezone.utc)
    sim.setup(t0)
    for i, step in enumerate(scenario.timeline):
        sim.apply(step, i, t0 + timedelta(seconds=step.at))
    return sim.records
