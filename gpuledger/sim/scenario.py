"""Exercise scenarios as data: the YAML format, validated before anything starts.

Input: a YAML file (``deploy/exercises/<name>.yaml``, or any path) describing a
simulated cluster, a model registry, a timeline of steps and the evidence the
exercise must find in the store afterwards (docs/exercises.md has the format).
Output: a ``Scenario`` (pydantic, frozen) or a ``ScenarioError`` that lists every
problem at once, each naming its place in the file: ``timeline[3].submit.pods``,
``expect[1].traces_to.gpu``.
Guarantees: unknown keys are rejected (a typo never silently does nothing); every
name a step or an expectation uses (release, workload, node, GPU index, queue,
priority class, alert, step id) is checked against what exists *at that point of
the timeline*; steps must be in time order.
Limits: capacity (enough free GPUs for a placement) depends on the run and is
checked by the simulator (``gpuledger.sim.cluster``), which names the step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuledger import timefmt

#: Where the shipped scenarios live (the repository's deploy/exercises/).
EXERCISES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "exercises"

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")


class ScenarioError(ValueError):
    """A scenario file that cannot run; the message lists every problem with its place."""


def parse_duration(value: Any) -> float:
    """Seconds of a duration in the one grammar (``gpuledger.timefmt``): ``90s``, ``2m``, ``1m30s``, ``1h`` or a number."""
    return timefmt.parse_duration(value).total_seconds()


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- the cluster and the registry -----------------------------------------------------------

class MigSpec(Strict):
    """A node whose GPUs are partitioned into MIG slices (each slice is one device)."""

    profile: str = Field(default="1g.10gb", description="MIG profile; the resource name is nvidia.com/mig-<profile>.")
    per_gpu: int = Field(default=2, ge=1, le=7, description="Slices per physical GPU.")


class NodeSpec(Strict):
    name: str = Field(description="Node name (a Kubernetes node name).")
    gpus: int | None = Field(default=None, ge=1, le=16, description="Physical GPUs; default cluster.gpus_per_node.")
    mig: MigSpec | None = Field(default=None, description="Partition the node's GPUs into MIG slices.")

    @field_validator("name")
    @classmethod
    def _dns(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"not a Kubernetes node name: {value!r}")
        return value


class QueueSpec(Strict):
    name: str = Field(description="Kueue LocalQueue name.")
    namespace: str = Field(description="Namespace of the LocalQueue (and of the workloads submitted to it).")
    cluster_queue: str = Field(default="gpu-cluster-queue", description="The ClusterQueue behind it.")
    flavor: str = Field(default="a100", description="Resource flavor Kueue assigns to admitted GPU pod sets.")


class ClusterSpec(Strict):
    nodes: list[NodeSpec] = Field(description="The GPU nodes; an integer N means n1..nN with defaults.")
    gpus_per_node: int = Field(default=4, ge=1, le=16, description="Default physical GPUs per node.")
    gpu_product: str = Field(default="NVIDIA-A100-SXM4-80GB", description="nvidia.com/gpu.product of every node.")
    queues: list[QueueSpec] = Field(min_length=1, description="Kueue LocalQueues.")
    priority_classes: dict[str, int] = Field(description="WorkloadPriorityClass name -> value.")

    @field_validator("nodes", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            if not 1 <= value <= 64:
                raise ValueError("between 1 and 64 nodes")
            return [{"name": f"n{i}"} for i in range(1, value + 1)]
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("nodes", "queues")
    @classmethod
    def _unique(cls, value: list) -> list:
        names = [item.name for item in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"names must be unique: {', '.join(dupes)}")
        return value

    def node(self, name: str) -> NodeSpec | None:
        return next((n for n in self.nodes if n.name == name), None)

    def devices_on(self, name: str) -> int:
        """How many schedulable devices (GPUs or MIG slices) a node has."""
        spec = self.node(name)
        if spec is None:
            return 0
        gpus = spec.gpus or self.gpus_per_node
        return gpus * (spec.mig.per_gpu if spec.mig else 1)


class ReleaseSpec(Strict):
    """One release in the simulated model registry (its manifest)."""

    model: str = Field(description="Registry model name.")
    version: str = Field(description="Registry model version.")
    environment: str = Field(default="prod", description="Environment the release is planned for.")
    owner: str = Field(default="team-ml", description="Accountable team.")
    image: str = Field(description="Serving/training image reference (its digest is derived, or give image_digest).")
    image_digest: str | None = Field(default=None, description="sha256:… of the image; default derived from `image`.")
    artifact_digest: str | None = Field(default=None, description="sha256:… of the model artifact; default derived.")
    dataset: str | None = Field(default=None, description="Dataset reference.")
    data_class: str | None = Field(default=None, description="Data classification.")

    @field_validator("version", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    @field_validator("image_digest", "artifact_digest")
    @classmethod
    def _digest(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", value):
            raise ValueError("expected sha256: and 64 lower-case hex digits")
        return value


# --- timeline actions ---------------------------------------------------------------------------

class ReleaseAction(Strict):
    release: str = Field(description="Release id (a key of `releases`).")
    actor: str | None = Field(default=None, description="Who did it.")
    approval_id: str | None = Field(default=None, description="Change/approval ticket.")
    reason: str | None = Field(default=None, description="Why.")


class PromoteAction(ReleaseAction):
    env: str | None = Field(default=None, description="Target environment; default the release's environment.")
    superseded: str | None = Field(default=None, description="The release this one replaces (promote) or that replaces it (rollback).")


class ReserveAction(ReleaseAction):
    reservation_id: str = Field(description="Reservation id.")
    gpus: int = Field(ge=1, description="GPUs reserved.")
    pool: str | None = Field(default=None, description="ClusterQueue / node pool holding them.")
    window: float | None = Field(default=None, description="Length of the reservation window from this step (duration).")

    @field_validator("window", mode="before")
    @classmethod
    def _window(cls, value: Any) -> Any:
        return None if value is None else parse_duration(value)


class UnreserveAction(ReleaseAction):
    reservation_id: str = Field(description="Reservation id.")


class RevokeAction(ReleaseAction):
    reason: str = Field(description="Why the release must no longer run.")


class SubmitAction(Strict):
    workload: str = Field(description="Workload name (unique in the scenario); its id is <queue namespace>/<name>.")
    queue: str = Field(description="LocalQueue (cluster.queues).")
    priority_class: str = Field(description="WorkloadPriorityClass (cluster.priority_classes).")
    release: str | None = Field(default=None, description="Release the pods are labelled with (gpuledger.io/release-id); unset: no release label.")
    image: str | None = Field(default=None, description="Image reference; default the release's image. Without release and image: an unregistered image.")
    label_release: bool = Field(default=True, description="Put the gpuledger.io/* release labels on the pods (false: only the image digest names the release).")
    pods: int = Field(default=1, ge=1, le=64, description="Pods (one pod set).")
    gpus_per_pod: int = Field(default=1, ge=1, le=16, description="Devices each pod requests.")
    mig: bool = Field(default=False, description="Request MIG slices (nvidia.com/mig-<profile>) instead of whole GPUs.")
    placement: list[str] = Field(default_factory=list, description="Node of each pod in order; the rest are placed first-fit.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")


class ScaleAction(Strict):
    workload: str = Field(description="A submitted workload.")
    pods: int = Field(ge=1, le=64, description="New total number of pods (only scaling up adds pods).")
    placement: list[str] = Field(default_factory=list, description="Node of each new pod in order; the rest first-fit.")


class PreemptAction(Strict):
    victim: str = Field(description="Workload that loses its GPUs.")
    preemptor: str = Field(description="Higher-priority workload that takes them (already submitted).")


class FinishAction(Strict):
    workload: str = Field(description="Workload whose pods complete and are deleted.")


class FailGpuAction(Strict):
    node: str = Field(description="Node of the failing GPU.")
    gpu: int = Field(ge=0, description="Device index on the node (0-based, in device order).")
    xid: int = Field(default=79, description="NVIDIA XID error code (79: GPU fell off the bus).")
    alert: str = Field(description="Id of the alert in this scenario (expectations refer to it).")
    severity: str = Field(default="critical", description="Alert severity label.")


class AlertAction(Strict):
    id: str = Field(description="Id of the alert in this scenario.")
    name: str = Field(description="alertname.")
    severity: str = Field(default="warning", description="severity label.")
    release: str | None = Field(default=None, description="Adds the gpuledger_release_id label.")
    model: str | None = Field(default=None, description="Adds the model label.")
    model_version: str | None = Field(default=None, description="Adds the model_version label.")
    environment: str | None = Field(default=None, description="Adds the environment label.")
    labels: dict[str, str] = Field(default_factory=dict, description="Any other labels.")
    summary: str | None = Field(default=None, description="summary annotation.")

    @field_validator("model_version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


class ResolveAction(Strict):
    alert: str = Field(description="Id of a firing alert.")


class IsolateNodeAction(Strict):
    node: str = Field(description="Node to cordon and drain.")
    release: str = Field(description="Release on whose behalf the admin acted (release events always name one).")
    actor: str = Field(description="Who isolated it.")
    reason: str | None = Field(default=None, description="Why.")
    evict: bool = Field(default=True, description="Evict the node's pods (eviction API), releasing their GPUs.")
    reschedule: bool = Field(default=False, description="Re-create the evicted pods of still-running workloads on other nodes.")


ACTIONS: dict[str, type[Strict]] = {
    "register": ReleaseAction, "evaluate": ReleaseAction, "approve": ReleaseAction, "promote": PromoteAction,
    "reserve": ReserveAction, "unreserve": UnreserveAction, "rollback": PromoteAction, "revoke": RevokeAction,
    "retire": ReleaseAction, "isolate_node": IsolateNodeAction, "submit": SubmitAction, "scale": ScaleAction,
    "preempt": PreemptAction, "finish": FinishAction, "fail_gpu": FailGpuAction, "alert": AlertAction, "resolve": ResolveAction,
}


def _attr(action: str) -> str:
    return "register_" if action == "register" else action


class Step(Strict):
    """One timeline step: when (``at``, from the start of the exercise) and exactly one action."""

    at: float = Field(description="Offset from the start (duration: 90s, 2m, 1m30s).")
    id: str | None = Field(default=None, description="Name for expectations' `at`.")
    note: str | None = Field(default=None, description="Shown in the progress output and the report.")
    # `register` is a name BaseModel's metaclass (ABCMeta) already uses: stored as register_.
    register_: ReleaseAction | None = Field(default=None, alias="register")
    evaluate: ReleaseAction | None = None
    approve: ReleaseAction | None = None
    promote: PromoteAction | None = None
    reserve: ReserveAction | None = None
    unreserve: UnreserveAction | None = None
    rollback: PromoteAction | None = None
    revoke: RevokeAction | None = None
    retire: ReleaseAction | None = None
    isolate_node: IsolateNodeAction | None = None
    submit: SubmitAction | None = None
    scale: ScaleAction | None = None
    preempt: PreemptAction | None = None
    finish: FinishAction | None = None
    fail_gpu: FailGpuAction | None = None
    alert: AlertAction | None = None
    resolve: ResolveAction | None = None

    @field_validator("at", mode="before")
    @classmethod
    def _at(cls, value: Any) -> Any:
        return parse_duration(value)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _one_action(self) -> Step:
        given = [name for name in ACTIONS if getattr(self, _attr(name)) is not None]
        if len(given) != 1:
            raise ValueError(f"a step needs exactly one action ({', '.join(ACTIONS)}), got "
                             + (", ".join(given) if given else "none"))
        return self

    @property
    def kind(self) -> str:
        return next(name for name in ACTIONS if getattr(self, _attr(name)) is not None)

    @property
    def action(self) -> Strict:
        return getattr(self, _attr(self.kind))


# --- expectations ----------------------------------------------------------------------------------

ENTRY_KINDS = ("alert", "release", "workload", "pod", "gpu", "model")


class TracesTo(Strict):
    """What the entry must trace to (every field optional)."""

    release_id: str | None = Field(default=None, description="The release the chain resolves to.")
    workload: str | None = Field(default=None, description="A workload name or namespace/name in the chain.")
    node: str | None = Field(default=None, description="A node in the chain (for an alert: the alert's node).")
    gpu: str | None = Field(default=None, description="NODE/INDEX of a device in the chain (for an alert: the alert's device).")
    attribution: str | None = Field(default=None, description="How the alert was attributed (gpu_assignment, release_label, ...).")
    release_state: str | None = Field(default=None, description="For an alert: the release's state when it was correlated.")


class ViolationCheck(Strict):
    control: int = Field(ge=1, le=8, description="Control id (DESIGN.md).")
    release_id: str | None = Field(default=None, description="Release the violation names.")


class Expectation(Strict):
    """One piece of evidence the exercise must find, read back through the trace."""

    name: str = Field(description="What is checked, in words (the row of the pass/fail table).")
    alert: str | None = Field(default=None, description="Entry point: an alert id of this scenario.")
    release: str | None = Field(default=None, description="Entry point: a release id.")
    workload: str | None = Field(default=None, description="Entry point: a workload name.")
    pod: str | None = Field(default=None, description="Entry point: WORKLOAD#INDEX (the index-th pod created for it).")
    gpu: str | None = Field(default=None, description="Entry point: NODE/INDEX.")
    model: str | None = Field(default=None, description="Entry point: NAME[:VERSION].")
    at: str | None = Field(default=None, description="Trace as of a step: its id, or a duration from the start.")
    traces_to: TracesTo | None = Field(default=None, description="Identity the chain must resolve to.")
    release_state: str | None = Field(default=None, description="The chain's release state (e.g. release.rolled_back).")
    lifecycle: list[str] = Field(default_factory=list, description="Release events that must appear in the lifecycle, in this order.")
    preempted_by: str | None = Field(default=None, description="A workload of the chain was preempted by this workload.")
    evicted: bool | None = Field(default=None, description="A workload of the chain shows an eviction.")
    admitted_before_approval: bool | None = Field(default=None, description="A workload was admitted while its release had no approval.")
    admission: Literal["allow", "deny", "warn"] | None = Field(default=None, description="gpuledger admit's decision on the entry workload before its queue entry (scenarios with enforce: true); deny also means it never reached a GPU.")
    unattributed: bool | None = Field(default=None, description="The chain resolves to no release (true) or to one (false).")
    open_allocations: int | None = Field(default=None, ge=0, description="At least this many GPU allocations of the chain are still held (as of `at`).")
    reservations_held: int | None = Field(default=None, ge=0, description="Reservations created and not released (as of `at`).")
    violation: ViolationCheck | None = Field(default=None, description="A control violation in the store (needs the controls).")
    pending: str | None = Field(default=None, description="Report the check as PENDING with this reason instead of failing it.")

    @model_validator(mode="after")
    def _entry(self) -> Expectation:
        given = [k for k in ENTRY_KINDS if getattr(self, k) is not None]
        if self.violation is not None and not given:
            return self
        if len(given) != 1:
            raise ValueError(f"an expectation needs exactly one entry point ({', '.join(ENTRY_KINDS)}), got "
                             + (", ".join(given) if given else "none"))
        checks = ("traces_to", "release_state", "preempted_by", "evicted", "admitted_before_approval", "admission", "unattributed", "open_allocations",
                  "reservations_held", "violation")
        if not self.lifecycle and all(getattr(self, c) is None for c in checks):
            raise ValueError("an expectation needs at least one check: " + ", ".join(("lifecycle", *checks)))
        return self

    @property
    def entry(self) -> tuple[str, str] | None:
        return next(((k, getattr(self, k)) for k in ENTRY_KINDS if getattr(self, k) is not None), None)


class ReportSpec(Strict):
    trace: dict[str, str] = Field(description="Entry point of the incident trace shown in the report, e.g. {alert: quality}.")

    @field_validator("trace")
    @classmethod
    def _one(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) != 1 or next(iter(value)) not in ENTRY_KINDS:
            raise ValueError(f"give one entry point: one of {', '.join(ENTRY_KINDS)}")
        return value


class Scenario(Strict):
    name: str = Field(description="Scenario name.")
    description: str = Field(default="", description="What the exercise rehearses.")
    speed: float = Field(default=1.0, gt=0, description="Default timeline compression (--speed overrides).")
    seed: int = Field(default=0, description="Default seed for names and UUIDs (--seed overrides).")
    enforce: bool = Field(default=False, description="Run gpuledger admit and send every submitted workload through its webhook first: a denied one is never created.")
    cluster: ClusterSpec
    releases: dict[str, ReleaseSpec] = Field(default_factory=dict, description="The model registry: release id -> manifest.")
    timeline: list[Step] = Field(min_length=1)
    expect: list[Expectation] = Field(min_length=1)
    report: ReportSpec | None = Field(default=None, description="The trace the report centres on; default the first expectation's entry "
                                      "point, else the release of the first violation check naming one, else the first release.")
    policy: dict[str, Any] = Field(default_factory=dict, description="Overrides merged into the policy file for this exercise "
                                   "(e.g. {retirement: {grace: 2m}}); durations are then compressed by the speed like the timeline.")

    @property
    def duration(self) -> float:
        return max(s.at for s in self.timeline)

    def report_entry(self) -> tuple[str, str] | None:
        """The report's trace entry (``report``'s description); None when the scenario names none.
        A scenario of violation checks only has no entry point (it crashed the run after its checks)."""
        if self.report:
            return next(iter(self.report.trace.items()))
        named = [e.entry for e in self.expect if e.entry]
        named += [("release", e.violation.release_id) for e in self.expect if e.violation and e.violation.release_id]
        named += [("release", rid) for rid in self.releases]
        return named[0] if named else None


# --- loading ---------------------------------------------------------------------------------------

def _loc(parts: tuple) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("function-after[_one_action()]",) or str(p).startswith(("function-", "list[", "dict[")):
            continue
        else:
            out += f".{p}" if out else str(p)
    return out or "<file>"


def _step_label(step: Step, i: int) -> str:
    return f"timeline[{i}].{step.kind}"


def check_references(sc: Scenario) -> list[str]:
    """Every name used where it does not exist (yet): one line per problem."""
    refs = _References(sc)
    for i, step in enumerate(sc.timeline):
        refs.step(i, step)
    for i, exp in enumerate(sc.expect):
        refs.expectation(f"expect[{i}]", exp)
    if sc.report:
        kind, value = next(iter(sc.report.trace.items()))
        if kind == "alert" and value not in refs.alerts:
            refs.problems.append(f"report.trace.alert: no alert {value!r} in the timeline")
        elif kind == "release":
            refs.release("report.trace.release", value)
    return refs.problems


class _References:
    """What the timeline has defined so far (workloads, pods, alerts, step ids), and the
    checks of each kind of step and expectation against it (``check_references``)."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.problems: list[str] = []
        self.nodes = {n.name for n in sc.cluster.nodes}
        self.queues = {q.name for q in sc.cluster.queues}
        self.mig_nodes = {n.name for n in sc.cluster.nodes if n.mig}
        self.workloads: dict[str, SubmitAction] = {}
        self.pods: dict[str, int] = {}
        self.alerts: set[str] = set()
        self.step_ids: set[str] = set()
        self.last_at = 0.0
        self.by_action = {SubmitAction: self._submit, ScaleAction: self._scale, PreemptAction: self._preempt, FinishAction: self._finish,
                          FailGpuAction: self._fail_gpu, AlertAction: self._alert, ResolveAction: self._resolve,
                          IsolateNodeAction: self._isolate}

    def release(self, where: str, rid: str | None) -> None:
        if rid is not None and rid not in self.sc.releases:
            self.problems.append(f"{where}: unknown release {rid!r} (releases: {', '.join(self.sc.releases) or 'none'})")

    def node(self, where: str, name: str) -> None:
        if name not in self.nodes:
            self.problems.append(f"{where}: unknown node {name!r} (nodes: {', '.join(sorted(self.nodes))})")

    def workload(self, where: str, name: str) -> None:
        if name not in self.workloads:
            self.problems.append(f"{where}: no workload {name!r} submitted before this step")

    def placement(self, here: str, placement, mig: bool) -> None:
        for j, n in enumerate(placement):
            self.node(f"{here}.placement[{j}]", n)
            if n in self.nodes and mig != (n in self.mig_nodes):
                self.problems.append(f"{here}.placement[{j}]: node {n!r} {'has no' if mig else 'only has'} MIG slices")

    def step(self, i: int, step: Step) -> None:
        here, a = _step_label(step, i), step.action
        if step.at < self.last_at:
            self.problems.append(f"timeline[{i}].at: steps must be in time order ({step.at:g}s comes after {self.last_at:g}s)")
        self.last_at = max(self.last_at, step.at)
        if step.id:
            if step.id in self.step_ids:
                self.problems.append(f"timeline[{i}].id: duplicate step id {step.id!r}")
            self.step_ids.add(step.id)
        for attr in ("release", "superseded"):
            if hasattr(a, attr):
                self.release(f"{here}.{attr}", getattr(a, attr))
        check = self.by_action.get(type(a))
        if check:
            check(here, a)

    def _submit(self, here: str, a: SubmitAction) -> None:
        cluster = self.sc.cluster
        if a.workload in self.workloads:
            self.problems.append(f"{here}.workload: workload {a.workload!r} already submitted")
        if a.queue not in self.queues:
            self.problems.append(f"{here}.queue: unknown queue {a.queue!r} (queues: {', '.join(sorted(self.queues))})")
        if a.priority_class not in cluster.priority_classes:
            self.problems.append(f"{here}.priority_class: unknown priority class {a.priority_class!r} "
                                 f"(priority_classes: {', '.join(cluster.priority_classes)})")
        if a.release is None and a.image is None:
            self.problems.append(f"{here}: give a release or an image")
        if len(a.placement) > a.pods:
            self.problems.append(f"{here}.placement: {len(a.placement)} nodes for {a.pods} pod(s)")
        self.placement(here, a.placement, a.mig)
        if a.mig and not self.mig_nodes:
            self.problems.append(f"{here}.mig: no node of the cluster is MIG-partitioned")
        self.workloads[a.workload] = a
        self.pods[a.workload] = a.pods

    def _scale(self, here: str, a: ScaleAction) -> None:
        self.workload(f"{here}.workload", a.workload)
        if a.workload in self.workloads:
            self.placement(here, a.placement, self.workloads[a.workload].mig)
            self.pods[a.workload] = max(self.pods[a.workload], a.pods)

    def _preempt(self, here: str, a: PreemptAction) -> None:
        self.workload(f"{here}.victim", a.victim)
        self.workload(f"{here}.preemptor", a.preemptor)
        if a.victim == a.preemptor:
            self.problems.append(f"{here}: a workload cannot preempt itself")

    def _finish(self, here: str, a: FinishAction) -> None:
        self.workload(f"{here}.workload", a.workload)

    def _fail_gpu(self, here: str, a: FailGpuAction) -> None:
        self.node(f"{here}.node", a.node)
        devices = self.sc.cluster.devices_on(a.node) if a.node in self.nodes else None
        if devices is not None and a.gpu >= devices:
            self.problems.append(f"{here}.gpu: node {a.node} has devices 0..{devices - 1}, not {a.gpu}")
        self._new_alert(f"{here}.alert", a.alert)

    def _alert(self, here: str, a: AlertAction) -> None:
        self._new_alert(f"{here}.id", a.id)

    def _new_alert(self, where: str, alert: str) -> None:
        if alert in self.alerts:
            self.problems.append(f"{where}: duplicate alert id {alert!r}")
        self.alerts.add(alert)

    def _resolve(self, here: str, a: ResolveAction) -> None:
        if a.alert not in self.alerts:
            self.problems.append(f"{here}.alert: no alert {a.alert!r} fired before this step")

    def _isolate(self, here: str, a: IsolateNodeAction) -> None:
        self.node(f"{here}.node", a.node)

    def in_timeline(self, where: str, workload: str | None) -> None:
        if workload and workload.split("/")[-1] not in self.workloads:
            self.problems.append(f"{where}: no workload {workload!r} in the timeline")

    def expectation(self, here: str, exp) -> None:
        if exp.entry:
            self._entry(here, *exp.entry)
        if exp.at is not None and exp.at not in self.step_ids:
            try:
                parse_duration(exp.at)
            except ValueError:
                self.problems.append(f"{here}.at: {exp.at!r} is neither a step id ({', '.join(sorted(self.step_ids)) or 'none'}) nor a duration")
        if exp.traces_to:
            to = exp.traces_to
            self.release(f"{here}.traces_to.release_id", to.release_id)
            if to.node:
                self.node(f"{here}.traces_to.node", to.node)
            if to.gpu:
                self.problems.extend(_gpu_ref_problems(self.sc, f"{here}.traces_to.gpu", to.gpu))
            self.in_timeline(f"{here}.traces_to.workload", to.workload)
            kind = exp.entry[0] if exp.entry else None
            for name in ("attribution", "release_state"):
                if getattr(to, name) is not None and kind != "alert":
                    # Read from the alert's own row (the trace's focal row): on any other entry point the
                    # check could never pass ("release state at correlation none"; exploratory review).
                    self.problems.append(f"{here}.traces_to.{name}: only an alert's trace has one (how, and in which release state, "
                                         f"the alert was correlated); for a release's state use `release_state` with `release:`")
        self.in_timeline(f"{here}.preempted_by", exp.preempted_by)
        if exp.violation:
            self.release(f"{here}.violation.release_id", exp.violation.release_id)

    def _entry(self, here: str, kind: str, value: str) -> None:
        if kind == "alert" and value not in self.alerts:
            self.problems.append(f"{here}.alert: no alert {value!r} in the timeline")
        elif kind == "release":
            self.release(f"{here}.release", value)
        elif kind == "workload":
            self.in_timeline(f"{here}.workload", value)
        elif kind == "pod":
            wl, sep, idx = value.partition("#")
            if not sep or not idx.isdigit():
                self.problems.append(f"{here}.pod: expected WORKLOAD#INDEX, got {value!r}")
            elif wl not in self.workloads or int(idx) >= self.pods.get(wl, 0):
                self.problems.append(f"{here}.pod: workload {wl!r} has no pod #{idx}")
        elif kind == "gpu":
            self.problems.extend(_gpu_ref_problems(self.sc, f"{here}.gpu", value))


def _gpu_ref_problems(sc: Scenario, where: str, ref: str) -> list[str]:
    node, sep, idx = ref.partition("/")
    if not sep or not idx.isdigit():
        return [f"{where}: expected NODE/INDEX (e.g. n3/0), got {ref!r}"]
    if sc.cluster.node(node) is None:
        return [f"{where}: unknown node {node!r}"]
    if int(idx) >= sc.cluster.devices_on(node):
        return [f"{where}: node {node} has devices 0..{sc.cluster.devices_on(node) - 1}, not {idx}"]
    return []


def parse_scenario(data: Any, origin: str = "<scenario>") -> Scenario:
    """Validate already-parsed YAML; ScenarioError lists every problem with its place."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{origin}: a scenario is a mapping (name, cluster, releases, timeline, expect), got {type(data).__name__}")
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{_loc(err['loc'])}: {msg}")
        raise ScenarioError(f"{origin}: invalid scenario:\n  " + "\n  ".join(lines)) from exc
    problems = check_references(scenario)
    if problems:
        raise ScenarioError(f"{origin}: invalid scenario:\n  " + "\n  ".join(problems))
    return scenario


def find_scenario(ref: str | Path) -> Path:
    """A scenario name (deploy/exercises/<name>.yaml) or a path to a YAML file."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ScenarioError(f"{ref}: no such scenario file")
        return path
    for base in (EXERCISES_DIR, Path.cwd() / "deploy" / "exercises"):
        candidate = base / f"{ref}.yaml"
        if candidate.is_file():
            return candidate
    raise ScenarioError(f"no scenario {str(ref)!r}; shipped: {', '.join(shipped_scenarios()) or 'none'} (or give a path to a .yaml file)")


def shipped_scenarios() -> list[str]:
    for base in (EXERCISES_DIR, Path.cwd() / "deploy" / "exercises"):
        if base.is_dir():
            return sorted(p.stem for p in base.glob("*.yaml"))
    return []


def load_scenario(ref: str | Path) -> Scenario:
    """Find, read and validate a scenario (ScenarioError on any problem)."""
    path = find_scenario(ref)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from exc
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from exc
    return parse_scenario(data, str(path))


RunStatus = Literal["PASS", "FAIL", "PENDING"]
