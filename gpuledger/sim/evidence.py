"""A scenario's expected evidence, checked against what the store says.

Input: one ``Expectation`` (``gpuledger.sim.scenario``), the ``SimCluster`` that ran
the timeline (to turn the scenario's names — alert ids, workload names, ``n3/0`` —
into the identifiers the cluster actually used), and a read-only store reader.
Output: a ``CheckResult`` (PASS / FAIL / PENDING with a one-line detail).
How: every check reads back through ``sinks.trace.trace`` — the responder's own
path (``gpuledger trace``) — from the expectation's entry point, optionally as of
a step's time; only ``violation`` queries the violations table directly.
Guarantees: no check raises; a store or trace error is a FAIL that says why.
An expectation marked ``pending`` that fails is reported PENDING (its reason
shown), one that passes is PASS — so evidence waiting for a feature turns green by
itself when the feature lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpuledger.sim.scenario import Expectation, parse_duration
from gpuledger.timefmt import iso_z

#: Lifecycle events that change what a release *is* (admin actions and reservations do not).
LIFECYCLE_STATES = ("release.registered", "release.evaluated", "release.approved", "release.promoted", "release.rolled_back",
                    "release.revoked", "release.retired")


@dataclass
class CheckResult:
    name: str
    status: str  # PASS, FAIL, PENDING
    detail: str
    entry: str

    @property
    def ok(self) -> bool:
        return self.status != "FAIL"


def lifecycle_state(release: dict | None) -> str | None:
    """The latest lifecycle event (registered … retired) of a trace's release section."""
    if not release:
        return None
    states = [ev["event_type"] for ev in release.get("lifecycle", []) if ev.get("event_type") in LIFECYCLE_STATES]
    return states[-1] if states else None


def resolve_entry(exp: Expectation, sim) -> tuple[str, str]:
    """The trace entry point (kind, value) for an expectation, in the cluster's identifiers."""
    return resolve_ref(*exp.entry, sim)


def resolve_ref(kind: str, value: str, sim) -> tuple[str, str]:
    """A scenario's name for an entry point (alert id, workload name, WORKLOAD#N, NODE/INDEX)
    as the identifiers the cluster used (fingerprint, namespace/workload, namespace/pod, NODE/DEVICE)."""
    if kind == "alert":
        return "alert", sim.alert_fingerprint(value)
    if kind == "workload":
        return "workload", sim.workload_id(value)
    if kind == "pod":
        return "pod", sim.pod_key(value)
    if kind == "gpu":
        node, device = sim.device_id(value)
        return "gpu", f"{node}/{device}"
    return kind, value


def resolve_at(exp: Expectation, sim, to_wall) -> datetime | None:
    if exp.at is None:
        return None
    at = sim.step_time(exp.at)
    if at is not None:
        return at
    return sim.started_at + timedelta(seconds=to_wall(parse_duration(exp.at)))


def _short(device: str) -> str:
    return device if len(device) <= 14 else device[:12] + "…"


def check(exp: Expectation, sim, result: dict, entry: tuple[str, str], at: datetime | None) -> tuple[list[str], list[str]]:
    """(problems, facts) of one expectation against one trace result."""
    problems: list[str] = []
    facts: list[str] = []
    kind, value = entry
    rel = result.get("release") or {}
    workloads = {w["workload_id"]: w for w in result.get("workloads", [])}
    focal = None
    if kind == "alert":
        # The alert as it fired (a later "resolved" row carries the release's state at resolution).
        rows = [a for a in result.get("alerts", []) if a.get("alert_fingerprint") == value]
        firing = [a for a in rows if a.get("status") == "firing"]
        focal = (firing or rows or [None])[0]
        if focal is None:
            problems.append(f"alert {exp.alert} ({value}) is not in the store")
    if result.get("entry", {}).get("root") is None and kind != "alert":
        problems.append(f"--{kind} {value} matches nothing in the store")

    t = exp.traces_to
    if t:
        if t.release_id is not None:
            got = (focal or {}).get("release_id") if focal else rel.get("release_id")
            if got != t.release_id:
                problems.append(f"release is {got or 'none'}, expected {t.release_id}")
            else:
                facts.append(f"release {got}")
        if t.workload is not None:
            wid = sim.workload_id(t.workload)
            got_wl = (focal or {}).get("workload_id") if focal else None
            if focal is not None and got_wl != wid:
                problems.append(f"alert's workload is {got_wl or 'none'}, expected {wid}")
            elif focal is None and wid not in workloads:
                problems.append(f"workload {wid} not in the chain (chain has {', '.join(workloads) or 'none'})")
            else:
                facts.append(f"workload {wid}")
        if t.node is not None:
            if focal is not None:
                got_node = focal.get("node")
                ok = got_node == t.node
            else:
                nodes = {n for p in result.get("pods", []) for n in p.get("nodes", [])} | {g["node"] for g in result.get("gpus", [])}
                got_node = ", ".join(sorted(nodes)) or "none"
                ok = t.node in nodes
            if not ok:
                problems.append(f"node is {got_node or 'none'}, expected {t.node}")
            else:
                facts.append(f"node {t.node}")
        if t.gpu is not None:
            node, device = sim.device_id(t.gpu)
            if focal is not None:
                ok = focal.get("node") == node and focal.get("gpu_id") == device
                got = f"{focal.get('node')}/{focal.get('gpu_id')}"
            else:
                held = {(g["node"], g["gpu_id"]) for g in result.get("gpus", [])}
                ok = (node, device) in held
                got = ", ".join(f"{n}/{_short(g)}" for n, g in sorted(held)) or "none"
            if not ok:
                problems.append(f"GPU is {got}, expected {t.gpu} ({node}/{device})")
            else:
                facts.append(f"GPU {t.gpu} = {_short(device)}")
        if t.attribution is not None:
            got = (focal or {}).get("attribution")
            if got != t.attribution:
                problems.append(f"attributed by {got or 'nothing'}, expected {t.attribution}")
            else:
                facts.append(f"by {got}")
        if t.release_state is not None:
            got = (focal or {}).get("release_state")
            if got != t.release_state:
                problems.append(f"release state at correlation {got or 'none'}, expected {t.release_state}")
            else:
                facts.append(f"while {got}")

    if exp.release_state is not None:
        got = lifecycle_state(rel)
        if got != exp.release_state:
            problems.append(f"release state {got or 'none'}, expected {exp.release_state}")
        else:
            facts.append(f"state {got}")

    if exp.lifecycle:
        seen = [ev["event_type"] for ev in rel.get("lifecycle", [])]
        pos = 0
        for want in exp.lifecycle:
            try:
                pos = seen.index(want, pos) + 1
            except ValueError:
                problems.append(f"lifecycle lacks {want} (in order); it has {', '.join(s.split('.', 1)[1] for s in seen) or 'nothing'}")
                break
        else:
            facts.append("lifecycle " + " → ".join(s.split(".", 1)[1] for s in exp.lifecycle))

    target_wls = [workloads[value]] if kind == "workload" and value in workloads else list(workloads.values())
    if exp.preempted_by is not None:
        by = sim.workloads[exp.preempted_by.split("/")[-1]]
        names = {by.kueue_name, *(p.name for p in by.all_pods)}
        hits = [ev for w in target_wls for ev in w.get("preemptions", [])
                if ev.get("preemptor") and ev["preemptor"].rsplit("/", 1)[-1] in names]
        if not hits:
            got = sorted({ev.get("preemptor") or "unknown" for w in target_wls for ev in w.get("preemptions", [])})
            problems.append(f"no preemption by {by.workload_id}" + (f" (preempted by {', '.join(got)})" if got else " (no preemption recorded)"))
        else:
            facts.append(f"preempted by {hits[0]['preemptor']} at {hits[0]['occurred_at']}")

    if exp.evicted is not None:
        got = any(w.get("evictions") for w in target_wls)
        if got != exp.evicted:
            problems.append("an eviction is recorded" if got else "no eviction recorded")
        else:
            facts.append("evicted" if got else "not evicted")

    if exp.admitted_before_approval is not None:
        wl = target_wls[0] if target_wls else None
        approvals = sorted(a["occurred_at"] for a in rel.get("approvals", []))
        if wl is None or not wl.get("admitted_at"):
            problems.append("no admission recorded")
        else:
            early = not approvals or wl["admitted_at"] < approvals[0]
            if early != exp.admitted_before_approval:
                problems.append(f"admitted {wl['admitted_at']}, first approval {approvals[0] if approvals else 'never'}")
            else:
                facts.append(f"admitted {wl['admitted_at']}, approved {approvals[0] if approvals else 'never'}")

    if exp.unattributed is not None:
        got = not rel.get("release_id")
        if got != exp.unattributed:
            problems.append(f"chain resolves to release {rel.get('release_id')}" if not got else "chain resolves to no release")
        else:
            facts.append("no release (unattributed)" if got else f"release {rel['release_id']}")

    if exp.open_allocations is not None:
        at_s = iso_z(at) if at else None
        allocs = {a["allocation_id"]: a for g in result.get("gpus", []) for a in g.get("allocations", [])}
        held = [a for a in allocs.values() if (at_s is None and a.get("ended_at") is None)
                or (at_s is not None and a["started_at"] <= at_s and (a.get("ended_at") is None or a["ended_at"] > at_s))]
        if len(held) < exp.open_allocations:
            problems.append(f"{len(held)} GPU allocation(s) held, expected at least {exp.open_allocations}")
        else:
            facts.append(f"{len(held)} GPU allocation(s) held")

    if exp.reservations_held is not None:
        types = [ev["event_type"] for ev in rel.get("lifecycle", [])]
        held = types.count("release.reservation_created") - types.count("release.reservation_released")
        if held != exp.reservations_held:
            problems.append(f"{held} reservation(s) held, expected {exp.reservations_held}")
        else:
            facts.append(f"{held} reservation(s) held")

    return problems, facts


def count_violations(reader, database: str, control: int, release_id: str | None) -> int:
    sql = ("SELECT count() AS n FROM {db:Identifier}.violations FINAL WHERE control_id = {c:UInt8}"
           + (" AND release_id = {r:String}" if release_id else ""))
    rows = reader.query(sql, {"db": database, "c": control, "r": release_id or ""}).dicts()
    return int(rows[0]["n"]) if rows else 0


def evaluate(exp: Expectation, sim, reader, database: str, to_wall, cluster: str | None = None) -> tuple[CheckResult, dict | None]:
    """Run one expectation against the store: (result, the trace it read or None)."""
    from sinks.trace import trace

    label = "violations table" if exp.entry is None else f"--{exp.entry[0]} {exp.entry[1]}"
    result: dict | None = None
    try:
        problems: list[str] = []
        facts: list[str] = []
        at = resolve_at(exp, sim, to_wall)
        if exp.entry is not None:
            entry = resolve_entry(exp, sim)
            result = trace(reader, database, *entry, at=at, cluster=cluster)
            problems, facts = check(exp, sim, result, entry, at)
        if exp.violation is not None:
            n = count_violations(reader, database, exp.violation.control, exp.violation.release_id)
            if n == 0:
                problems.append(f"no control {exp.violation.control} violation" + (f" for {exp.violation.release_id}" if exp.violation.release_id else ""))
            else:
                facts.append(f"{n} control {exp.violation.control} violation(s)")
        if at is not None:
            facts.append(f"as of {exp.at}")
    except Exception as exc:  # noqa: BLE001 - a check never raises: an error is a failed check that says why
        problems, facts = [f"{type(exc).__name__}: {exc}"], []
    if not problems:
        return CheckResult(exp.name, "PASS", "; ".join(facts), label), result
    if exp.pending:
        return CheckResult(exp.name, "PENDING", f"{exp.pending} ({'; '.join(problems)})", label), result
    return CheckResult(exp.name, "FAIL", "; ".join(problems), label), result


def summary(results: list[CheckResult]) -> dict[str, Any]:
    return {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "PENDING")}
