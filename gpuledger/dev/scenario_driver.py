"""A scenario's steps on the real control plane: the driver of ``gpuledger exercise … --cluster real``.

Input: a validated ``Scenario``, and one timeline step at a time (``RealClusterDriver.apply``),
the same interface as ``gpuledger.sim.cluster.SimCluster`` so the exercise runner, the evidence
checks (``gpuledger.sim.evidence``) and the report use either.
Output — nothing is written where a real system keeps its own status:
- releases through the real MLflow registry (``register`` → a model version with the manifest's
  digests and owner as tags; ``evaluate``/``retire``/``revoke`` → version tags; ``promote`` → the
  environment's alias; ``rollback`` → the alias moved back to the release it superseded), which
  signs and delivers its webhooks to the receiver; ``approve``, ``reserve``, ``unreserve`` and the
  ``isolate_node`` admin action through the release CLI's event (``SimCluster.release_event``)
  POSTed to the receiver's ``/v1/releases``;
- workloads as batch/v1 Jobs on the scenario's Kueue LocalQueues (WorkloadPriorityClass label,
  release annotation): Kueue admits and preempts them, kube-scheduler places them, KWOK runs
  them; each node is a ResourceFlavor of its own (``<flavor>-<node>``, ``kubernetes.io/hostname``)
  so that Kueue's quota is per node and a placement (a nodeSelector) can make Kueue preempt;
- the XID fault as the DCGM-shaped page's ``DCGM_FI_DEV_XID_ERRORS`` (Prometheus fires, Alertmanager
  notifies the receiver) and the device left out of its kubelet double's allocatable set; other
  alerts POSTed to Alertmanager's ``/api/v2/alerts``; fingerprints read back from Alertmanager;
- containment as a cordon (``spec.unschedulable``) and Eviction API calls for the node's pods.
Where a scripted step cannot be expressed on a real control plane it is adapted, and the
adaptation is stated here and in docs/exercises.md ("On the real cluster"):
- a workload is submitted with the largest pod count any later ``scale`` step gives it (a Job's
  parallelism under Kueue is fixed at admission); ``scale`` then checks the pods run;
- ``preempt`` does not preempt: Kueue preempts when the preemptor's demand needs the victim's
  quota (at the preemptor's submission); the step waits until Kueue has preempted the victim;
- ``finish`` deletes the Job (KWOK completes a pod after a delay fixed at its creation);
- ``placement`` names one node for all of a workload's pods (a nodeSelector), or none;
- ``isolate_node`` with ``reschedule``: the Job controller's replacement pods stay Pending
  while their nodeSelector names the cordoned node;
- MLflow numbers a model's versions itself: the registry is seeded with a model's earlier
  versions (before the receiver's webhook exists) so that its numbers are the scenario's, and
  release ids must read ``<model>-v<version>-<suffix>`` (the receiver's
  ``release_id_template``).
Limits: ``enforce: true`` scenarios are not supported here; one container per pod.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from gpuledger.dev.cluster import ClusterError, GpuNode, LocalCluster
from gpuledger.dev.kubelets import ClusterKubelets
from gpuledger.dev.peers import XID_ALERT, DcgmExporter, MlflowServer
from gpuledger.sim.cluster import GPU_RESOURCE, LABEL_PREFIX, SimCluster, SimulationError, StepRecord, post_json
from gpuledger.sim.scenario import Scenario, Step
from gpuledger.timefmt import iso_z

log = logging.getLogger(__name__)

KUEUE_API = "kueue.x-k8s.io/v1beta2"
HOSTNAME = "kubernetes.io/hostname"
CONTAINER = "main"
STEP_TIMEOUT_S = 120.0
#: Release steps that are MLflow registry operations (the rest go through the release CLI's event).
MLFLOW_STEPS = ("register", "evaluate", "promote", "rollback", "retire", "revoke")
_TAG_OF = {"evaluate": "evaluated", "retire": "retired", "revoke": "revoked"}
_TERMINAL = ("Succeeded", "Failed")


class RealClusterError(SimulationError):
    """A step the real control plane did not carry out in time, or a scenario it cannot express."""


def scenario_nodes(scenario: Scenario) -> tuple[GpuNode, ...]:
    """The scenario's nodes as KWOK nodes: whole GPUs, or a MIG node's slices (``gpus × per_gpu``)."""
    cluster = scenario.cluster
    out = []
    for spec in cluster.nodes:
        gpus = spec.gpus or cluster.gpus_per_node
        if spec.mig:
            out.append(GpuNode(spec.name, mig=((spec.mig.profile, gpus * spec.mig.per_gpu),), product=cluster.gpu_product))
        else:
            out.append(GpuNode(spec.name, gpus=gpus, product=cluster.gpu_product))
    return tuple(out)


def mlflow_release_template(scenario: Scenario) -> str:
    """The receiver's MLflow ``release_id_template`` under which MLflow's versions get the scenario's release ids."""
    suffixes = set()
    for rid, spec in scenario.releases.items():
        head = f"{spec.model}-v{spec.version}-"
        if not rid.startswith(head) or not rid[len(head):]:
            raise RealClusterError(f"release {rid}: on --cluster real a release id must read <model>-v<version>-<suffix> "
                                   f"(here {head}…), as MLflow names a release by model and version")
        suffixes.add(rid[len(head):])
    if len(suffixes) > 1:
        raise RealClusterError(f"releases end in {', '.join(sorted(suffixes))}: on --cluster real they must share one suffix "
                               "(one release_id_template)")
    return "{model}-v{version}-" + (suffixes.pop() if suffixes else "prod")


@dataclass
class RealPod:
    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class RealWorkload:
    """A scenario workload: its Job, and the Kueue Workload Kueue made for it."""

    name: str
    namespace: str
    kueue_name: str
    uid: str
    pods: int
    all_pods: list[RealPod] = field(default_factory=list)

    @property
    def workload_id(self) -> str:
        return f"{self.namespace}/{self.kueue_name}"


@dataclass
class RealAlert:
    id: str
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: datetime
    device_id: str | None = None  # an XID on the DCGM page (resolved by clearing it)


class RealClusterDriver:
    """Plays a scenario's steps on a ``LocalCluster`` with its kubelet doubles, DCGM page and MLflow
    (module docstring); ``receiver_url`` and ``alertmanager_url`` are set once they listen."""

    def __init__(self, scenario: Scenario, seed: int, cluster: LocalCluster, kubelets: ClusterKubelets, exporter: DcgmExporter,
                 mlflow: MlflowServer, seconds_to_wall: Callable[[float], float] = lambda s: s) -> None:
        if scenario.enforce:
            raise RealClusterError("enforce: true scenarios do not run on --cluster real yet (docs/exercises.md)")
        self.scenario = scenario
        self.seed = seed
        # Manifests and release events as the simulator builds them (it publishes nothing without surfaces).
        self.model = SimCluster(scenario, seed, None, seconds_to_wall)
        self.cluster = cluster
        self.kubelets = kubelets
        self.exporter = exporter
        self.mlflow = mlflow
        self.nodes = {n.name: n for n in cluster.nodes}
        self.receiver_url: str | None = None
        self.alertmanager_url: str | None = None
        self.records: list[StepRecord] = []
        self.started_at: datetime | None = None
        self.workloads: dict[str, RealWorkload] = {}
        self.alerts: dict[str, RealAlert] = {}
        self.admit = None
        self.denied: dict[str, Any] = {}
        self.final_pods = self._final_pods()
        self.mlflow_template = mlflow_release_template(scenario)

    # -- what the runner and the checks ask ----------------------------------------------------

    @property
    def gpu_resources(self) -> list[str]:
        return sorted({r for n in self.nodes.values() for r in n.resources() if r.startswith("nvidia.com/")})

    def workload_id(self, name: str) -> str:
        if "/" in name:
            return name
        if name not in self.workloads:
            raise KeyError(f"no workload {name!r} was submitted")
        return self.workloads[name].workload_id

    def pod_key(self, ref: str) -> str:
        name, _, idx = ref.partition("#")
        return self.workloads[name].all_pods[int(idx)].key

    def device_id(self, ref: str) -> tuple[str, str]:
        node, _, idx = ref.partition("/")
        return node, self.kubelets.devices[node][int(idx)].device_id

    def alert_fingerprint(self, alert_id: str) -> str:
        return self.alerts[alert_id].fingerprint

    def step_time(self, step_id: str) -> datetime | None:
        return next((r.at for r in self.records if r.id == step_id), None)

    def release_manifest(self, rid: str) -> dict:
        return self.model.release_manifest(rid)

    def lanes(self) -> list[dict]:
        out = []
        for name, devs in self.kubelets.devices.items():
            for i, d in enumerate(devs):
                kind = "MIG" if d.gpu_instance else "GPU"
                out.append({"node": name, "gpu_id": d.device_id, "label": f"{name} · {kind} {i}",
                            "healthy": d.device_id not in self.kubelets.unhealthy})
        return out

    def describe(self) -> str:
        parts = []
        for name, devs in self.kubelets.devices.items():
            mig = [d for d in devs if d.gpu_instance]
            parts.append(f"{name}: {len(mig)} MIG slices ({mig[0].gpu_instance[1]})" if mig else f"{name}: {len(devs)} GPUs")
        return "real cluster (KWOK nodes) " + ", ".join(parts)

    # -- set-up -----------------------------------------------------------------------------------

    def _final_pods(self) -> dict[str, int]:
        """Each workload's largest pod count over its submit and scale steps."""
        out: dict[str, int] = {}
        for step in self.scenario.timeline:
            if step.kind == "submit":
                out[step.action.workload] = step.action.pods
            elif step.kind == "scale":
                out[step.action.workload] = max(out.get(step.action.workload, 0), step.action.pods)
        return out

    def setup(self, at: datetime) -> None:
        """Namespaces, per-node ResourceFlavors, ClusterQueues, LocalQueues, WorkloadPriorityClasses; MLflow's models."""
        self.started_at = at
        sc, c = self.scenario.cluster, self.cluster
        for ns in sorted({q.namespace for q in sc.queues}):
            c.ensure_namespace(ns)
        for cq in sorted({q.cluster_queue for q in sc.queues}):
            groups: dict[str, list[dict]] = {}
            for flavor in sorted({q.flavor for q in sc.queues if q.cluster_queue == cq}):
                for node in self.nodes.values():
                    name = f"{flavor}-{node.name}"
                    c.apply(f"/apis/{KUEUE_API}/resourceflavors", {"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
                                                                   "metadata": {"name": name},
                                                                   "spec": {"nodeLabels": {HOSTNAME: node.name}}})
                    for res, qty in node.resources().items():
                        if res.startswith("nvidia.com/"):
                            groups.setdefault(res, []).append({"name": name, "resources": [{"name": res, "nominalQuota": qty}]})
            c.apply(f"/apis/{KUEUE_API}/clusterqueues", {
                "apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": cq},
                "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                         "resourceGroups": [{"coveredResources": [res], "flavors": flavors} for res, flavors in sorted(groups.items())]}})
        for q in sc.queues:
            self._until(lambda q=q: self._try_apply(f"/apis/{KUEUE_API}/namespaces/{q.namespace}/localqueues", {
                "apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": q.name, "namespace": q.namespace},
                "spec": {"clusterQueue": q.cluster_queue}}), 60, f"LocalQueue {q.namespace}/{q.name} created")
        for name, value in sc.priority_classes.items():
            c.apply(f"/apis/{KUEUE_API}/workloadpriorityclasses", {"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass",
                                                                   "metadata": {"name": name}, "value": value})
        self._seed_registry()

    def _try_apply(self, path: str, body: dict) -> bool:
        try:
            self.cluster.apply(path, body)
            return True
        except ClusterError as exc:
            log.debug("%s", exc)
            return False

    def _seed_registry(self) -> None:
        """Each model registered in the timeline, with its versions before the first one the timeline
        registers (MLflow numbers versions itself: 1, 2, …). Runs before the receiver's webhook exists."""
        client = self.mlflow.client()
        # MLflow's client logs an INFO line per version it waits for (its import sets that level); the
        # exercise says what it does itself.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        versions: dict[str, list[int]] = {}
        for step in self.scenario.timeline:
            if step.kind == "register":
                m = self.model.release_manifest(step.action.release)
                try:
                    versions.setdefault(m["model"], []).append(int(m["version"]))
                except ValueError:
                    raise RealClusterError(f"release {m['release_id']}: MLflow versions are numbers, not {m['version']!r}") from None
        for model, registered in versions.items():
            if registered != list(range(registered[0], registered[0] + len(registered))):
                raise RealClusterError(f"model {model}: the timeline registers versions {registered}; MLflow numbers them one by one, "
                                       "so --cluster real needs consecutive versions in order")
            client.create_registered_model(model)
            for v in range(1, registered[0]):
                client.create_model_version(model, source=f"s3://models/{model}/{v}", tags={"gpuledger.io/exercise": "earlier version"})

    # -- the timeline -----------------------------------------------------------------------------

    def apply(self, step: Step, index: int, at: datetime) -> StepRecord:
        """Carry out one step now (the real clock: ``at`` is the runner's plan); RealClusterError names the step."""
        now = datetime.now(timezone.utc)
        try:
            # MLflow and Alertmanager deliver on their own time (MLflow stamps a delivery when it sends it):
            # a step that goes through them has taken effect once the receiver has published what they sent,
            # so that the next step's events come after it, as on the simulator's timeline.
            source = "mlflow" if step.kind in MLFLOW_STEPS else "alertmanager" if step.kind in ("fail_gpu", "alert", "resolve") else None
            before = self._receiver_sent(source) if source else 0
            if step.kind in MLFLOW_STEPS:
                summary = self._registry(step.kind, step.action)
            elif step.kind in ("approve", "reserve", "unreserve"):
                summary = self._release_event(step.kind, step.action, now)
            else:
                summary = getattr(self, f"_do_{step.kind}")(step.action, now)
            if source:
                self._until(lambda: self._receiver_sent(source) > before, 60, f"the receiver to publish what {source} delivered")
            self._refresh_pods()
        except (SimulationError, ClusterError, OSError) as exc:
            raise RealClusterError(f"timeline[{index}] ({step.kind}{f' {step.id}' if step.id else ''}): {exc}") from exc
        except Exception as exc:  # an MLflow client error: say which step
            raise RealClusterError(f"timeline[{index}] ({step.kind}{f' {step.id}' if step.id else ''}): {type(exc).__name__}: {exc}") from exc
        record = StepRecord(index, step.id, step.kind, now, summary, step.note)
        self.records.append(record)
        return record

    def _until(self, ready: Callable[[], Any], timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            time.sleep(0.3)
        raise RealClusterError(f"timed out after {timeout:.0f}s waiting for {what}")

    def _receiver_sent(self, source: str) -> int:
        """Events of ``source`` the receiver has published (Kafka acknowledged them), from its /healthz."""
        with urllib.request.urlopen(f"{self.receiver_url}/healthz", timeout=10) as resp:
            return int(json.loads(resp.read())["counters"][source]["sent"])

    # releases -----------------------------------------------------------------------------------

    def _release_event(self, kind: str, action, at: datetime, target: str | None = None) -> str:
        if not self.receiver_url:
            raise RealClusterError("the receiver is not running (no URL to send release events to)")
        event, summary = self.model.release_event(kind, action, at, target)
        post_json(self.receiver_url, "/v1/releases", event.model_dump(mode="json"))
        return summary + " (release CLI → receiver)"

    def _registry(self, kind: str, action) -> str:
        from producers.receiver.mlflow import MlflowReleaseMapping

        m = self.model.release_manifest(action.release)
        model, version = m["model"], m["version"]
        client = self.mlflow.client()
        if kind == "register":
            tags = {"owner": m["owner"], "artifact_digest": m["artifact_digest"], "image_digest": m["image_digest"],
                    "config_digest": m["config_digest"], "dataset_ref": m["dataset"], "data_class": m["data_class"]}
            made = client.create_model_version(model, source=f"s3://models/{model}/{version}",
                                               tags={k: v for k, v in tags.items() if v})
            if str(made.version) != version:
                raise RealClusterError(f"MLflow made version {made.version} of {model}, the scenario registers {version}")
            return f"MLflow: {model} version {version} registered ({m['release_id']})"
        if kind in _TAG_OF:
            client.set_model_version_tag(model, version, _TAG_OF[kind], "true")
            return f"MLflow: tag {_TAG_OF[kind]}=true on {model} version {version}"
        env = getattr(action, "env", None) or m["environment"]
        aliases = MlflowReleaseMapping().alias_environments
        alias = env if aliases.get(env) == env else next((a for a, e in aliases.items() if e == env), None)
        if alias is None:
            raise RealClusterError(f"no MLflow alias maps to environment {env}")
        if kind == "promote":
            client.set_registered_model_alias(model, alias, version)
            return f"MLflow: alias {alias} → {model} version {version}"
        if not action.superseded:
            raise RealClusterError("a rollback on --cluster real moves the alias back to the release it superseded: name it (superseded)")
        back = self.model.release_manifest(action.superseded)
        client.set_registered_model_alias(model, alias, back["version"])
        return f"MLflow: alias {alias} moved back to {model} version {back['version']} (rolls {version} back)"

    # workloads ----------------------------------------------------------------------------------

    def _job(self, a, queue, pods: int) -> dict:
        labels = {"app.kubernetes.io/name": a.workload, **a.labels}
        annotations = {"pod-complete.stage.kwok.x-k8s.io/delay": "24h", "pod-complete.stage.kwok.x-k8s.io/jitter-delay": "24h"}
        image = a.image
        if a.release:
            m = self.model.release_manifest(a.release)
            image = image or m["image"]
            if a.label_release:
                labels.update({f"{LABEL_PREFIX}release-id": m["release_id"], f"{LABEL_PREFIX}model": m["model"],
                               f"{LABEL_PREFIX}model-version": m["version"], f"{LABEL_PREFIX}environment": m["environment"],
                               f"{LABEL_PREFIX}owner": m["owner"], "app.kubernetes.io/version": m["version"]})
                annotations[f"{LABEL_PREFIX}release-id"] = m["release_id"]
        nodes = sorted(set(a.placement))
        if len(nodes) > 1:
            raise RealClusterError(f"placement {a.placement}: a Job's pods share one pod template, so --cluster real places "
                                   "all of a workload's pods on one node or leaves the choice to Kueue and the scheduler")
        resource = next(r for r in self.gpu_resources if r.startswith("nvidia.com/mig-")) if a.mig else GPU_RESOURCE
        spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [{
            "name": CONTAINER, "image": image, "resources": {"limits": {resource: str(a.gpus_per_pod)}}}]}
        if nodes:
            spec["nodeSelector"] = {HOSTNAME: nodes[0]}
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": a.workload, "namespace": queue.namespace,
                             "labels": {**labels, "kueue.x-k8s.io/queue-name": a.queue, "kueue.x-k8s.io/priority-class": a.priority_class}},
                "spec": {"parallelism": pods, "completions": pods, "backoffLimit": 6,
                         # An evicted or preempted pod is not the workload's failure (kubectl drain's case).
                         "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                         "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}}}

    def _kueue_workload(self, name: str, namespace: str) -> dict | None:
        items = self.cluster.request("GET", f"/apis/{KUEUE_API}/namespaces/{namespace}/workloads").get("items", [])
        return next((w for w in items if any(o.get("kind") == "Job" and o.get("name") == name
                                             for o in w["metadata"].get("ownerReferences", []))), None)

    def _pods(self, name: str, namespace: str) -> list[dict]:
        query = urllib.parse.urlencode({"labelSelector": f"batch.kubernetes.io/job-name={name}"})
        return self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods?{query}").get("items", [])

    def _running(self, wl: RealWorkload) -> list[dict]:
        """The workload's pods Running on a node whose kubelet double has assigned their devices."""
        return [p for p in self._pods(wl.name, wl.namespace)
                if p["status"].get("phase") == "Running" and p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
                and self.kubelets.assigned.get((p["metadata"]["uid"], CONTAINER))]

    def _refresh_pods(self) -> None:
        for wl in self.workloads.values():
            known = {p.uid for p in wl.all_pods}
            new = [p for p in self._pods(wl.name, wl.namespace) if p["metadata"]["uid"] not in known]
            for p in sorted(new, key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"])):
                wl.all_pods.append(RealPod(wl.namespace, p["metadata"]["name"], p["metadata"]["uid"]))

    def _do_submit(self, a, at: datetime) -> str:
        queue = next(q for q in self.scenario.cluster.queues if q.name == a.queue)
        pods = self.final_pods[a.workload]
        self.cluster.request("POST", f"/apis/batch/v1/namespaces/{queue.namespace}/jobs", self._job(a, queue, pods))
        kwl = self._until(lambda: (w := self._kueue_workload(a.workload, queue.namespace)) and _condition(w, "Admitted") and w,
                          STEP_TIMEOUT_S, f"Kueue to admit {a.workload}")
        wl = RealWorkload(a.workload, queue.namespace, kwl["metadata"]["name"], kwl["metadata"]["uid"], pods)
        self.workloads[a.workload] = wl
        running = self._until(lambda: (r := self._running(wl)) and len(r) >= pods and r, STEP_TIMEOUT_S,
                              f"{pods} pod(s) of {a.workload} Running with their devices")
        where = ", ".join(sorted({p["spec"]["nodeName"] for p in running}))
        grown = f" (its largest size: {a.pods} at submission)" if pods != a.pods else ""
        return (f"submit Job {queue.namespace}/{a.workload} → Kueue Workload {wl.kueue_name} admitted (priority class {a.priority_class}): "
                f"{pods} pod(s) × {a.gpus_per_pod} {'MIG slice' if a.mig else 'GPU'} on {where}{grown}")

    def _do_scale(self, a, at: datetime) -> str:
        wl = self.workloads[a.workload]
        self._until(lambda: len(self._running(wl)) >= a.pods, STEP_TIMEOUT_S, f"{a.pods} pod(s) of {a.workload} Running")
        return f"scale {wl.workload_id}: {a.pods} pod(s) Running (submitted at that size on the real cluster)"

    def _do_preempt(self, a, at: datetime) -> str:
        victim, by = self.workloads[a.victim], self.workloads[a.preemptor]

        def preempted() -> dict | None:
            w = self._kueue_workload(victim.name, victim.namespace)
            done = w and (_condition(w, "Preempted") or (_condition(w, "Evicted") or {}).get("reason") == "Preempted")
            return done if done and not self._running(victim) else None

        cond = self._until(preempted, 60, f"Kueue to preempt {a.victim} for {a.preemptor} (on the real cluster Kueue preempts when "
                                          "the preemptor's demand needs the victim's quota)")
        return f"preempted by Kueue: {victim.workload_id} for {by.workload_id} ({cond.get('message', '')[:120]})"

    def _do_finish(self, a, at: datetime) -> str:
        wl = self.workloads[a.workload]
        self.cluster.request("DELETE", f"/apis/batch/v1/namespaces/{wl.namespace}/jobs/{wl.name}",
                             {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
        self._until(lambda: not self._pods(wl.name, wl.namespace), STEP_TIMEOUT_S, f"the pods of {a.workload} gone")
        return f"finish {wl.workload_id}: Job deleted, its pods gone, GPUs freed"

    def _do_isolate_node(self, a, at: datetime) -> str:
        summary = self._release_event("isolate_node", a, at, target=a.node)
        self.cluster.request("PATCH", f"/api/v1/nodes/{a.node}", {"spec": {"unschedulable": True}},
                             content_type="application/merge-patch+json")
        summary += f"; node {a.node} cordoned"
        if not a.evict:
            return summary
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={a.node}"})
        namespaces = {q.namespace for q in self.scenario.cluster.queues}
        victims = [p for p in self.cluster.request("GET", f"/api/v1/pods?{query}").get("items", [])
                   if p["metadata"]["namespace"] in namespaces and p["status"].get("phase") not in _TERMINAL]
        for p in victims:
            ns, name = p["metadata"]["namespace"], p["metadata"]["name"]
            self.cluster.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction", {
                "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}})
        uids = {p["metadata"]["uid"] for p in victims}
        self._until(lambda: not uids & {p["metadata"]["uid"] for p in self.cluster.request("GET", f"/api/v1/pods?{query}").get("items", [])},
                    STEP_TIMEOUT_S, f"the evicted pods gone from {a.node}")
        summary += f", {len(victims)} pod(s) evicted (Eviction API)"
        if a.reschedule:
            summary += "; replacements Pending while their nodeSelector names the cordoned node"
        return summary

    # alerts -------------------------------------------------------------------------------------

    def _am_alerts(self, labels: dict[str, str]) -> list[dict]:
        if not self.alertmanager_url:
            raise RealClusterError("Alertmanager is not running")
        query = urllib.parse.urlencode([("filter", f'{k}="{v}"') for k, v in sorted(labels.items())])
        with urllib.request.urlopen(f"{self.alertmanager_url}/api/v2/alerts?{query}", timeout=10) as resp:
            return json.loads(resp.read())

    def _fingerprint(self, labels: dict[str, str], what: str) -> dict:
        return self._until(lambda: next(iter(self._am_alerts(labels)), None), 60, f"Alertmanager to hold {what}")

    def _do_fail_gpu(self, a, at: datetime) -> str:
        dev = self.kubelets.devices[a.node][a.gpu]
        self.kubelets.mark_unhealthy(dev.device_id)
        self.exporter.set_xid(dev.device_id, a.xid)
        match = {"alertname": XID_ALERT, "Hostname": a.node, "UUID": dev.uuid, "err_code": str(a.xid)}
        if dev.gpu_instance:
            match["GPU_I_ID"] = str(dev.gpu_instance[0])
        alert = self._fingerprint(match, f"the XID {a.xid} alert Prometheus fires for {a.node}/{a.gpu}")
        self.alerts[a.alert] = RealAlert(a.alert, alert["fingerprint"], alert["labels"], alert.get("annotations", {}), at, dev.device_id)
        holder = self.exporter.device(dev.device_id).holder
        return (f"XID {a.xid} on {a.node}/{a.gpu} ({dev.device_id[:12]}…) on the DCGM page → Prometheus {XID_ALERT} → Alertmanager "
                f"{alert['fingerprint']}" + (f", held by {holder[0]}/{holder[1]}" if holder else ""))

    def _do_alert(self, a, at: datetime) -> str:
        labels = {"alertname": a.name, "severity": a.severity, **a.labels}
        for key, value in (("gpuledger_release_id", a.release), ("model", a.model), ("model_version", a.model_version),
                           ("environment", a.environment)):
            if value:
                labels[key] = value
        annotations = {"summary": a.summary or f"{a.name} fired"}
        post_json(self.alertmanager_url, "/api/v2/alerts", [{"labels": labels, "annotations": annotations, "startsAt": iso_z(at)}])
        alert = self._fingerprint(labels, f"alert {a.id}")
        self.alerts[a.id] = RealAlert(a.id, alert["fingerprint"], labels, annotations, at)
        return f"alert {a.name} ({a.severity}) POSTed to Alertmanager, fingerprint {alert['fingerprint']}"

    def _do_resolve(self, a, at: datetime) -> str:
        alert = self.alerts[a.alert]
        if alert.device_id:
            self.exporter.set_xid(alert.device_id, 0)
            return f"XID cleared on {alert.device_id[:12]}…: Prometheus resolves {alert.labels.get('alertname')}"
        post_json(self.alertmanager_url, "/api/v2/alerts", [{"labels": alert.labels, "annotations": alert.annotations,
                                                             "startsAt": iso_z(alert.starts_at), "endsAt": iso_z(at)}])
        return f"alert {alert.labels['alertname']} resolved in Alertmanager"


def _condition(obj: dict, ctype: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype and c["status"] == "True"), None)
