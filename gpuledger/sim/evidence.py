"""A scenario's expected evidence, checked against what the store says.

Input: one ``Expectation`` (``gpuledger.sim.scenario``), the ``SimCluster`` that ran
the timeline (to turn the scenario's names — alert ids, workload names, ``n3/0`` —
into the identifiers the cluster actually used), and a read-only store reader.
Output: a ``CheckResult`` (PASS / FAIL / PENDING with a one-line detail).
How: every check reads back through ``sinks.read.trace.trace`` — the responder's own
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


class _Check:
    """One expectation against one trace result: each ``_…`` method checks one field of
    the expectation and records a problem (it does not hold) or a fact (it does)."""

    def __init__(self, exp: Expectation, sim, result: dict, entry: tuple[str, str], at: datetime | None) -> None:
        self.exp, self.sim, self.result, self.at = exp, sim, result, at
        self.kind, self.value = entry
        self.rel = result.get("release") or {}
        self.workloads = {w["workload_id"]: w for w in result.get("workloads", [])}
        self.problems: list[str] = []
        self.facts: list[str] = []
        self.focal: dict | None = None

    def expect(self, ok: bool, fact: str, problem: str) -> None:
        (self.facts if ok else self.problems).append(fact if ok else problem)

    def run(self) -> tuple[list[str], list[str]]:
        exp = self.exp
        self._entry()
        if exp.traces_to:
            self._traces_to(exp.traces_to)
        if exp.release_state is not None:
            self._release_state()
        if exp.lifecycle:
            self._lifecycle()
        if exp.preempted_by is not None:
            self._preempted_by()
        if exp.evicted is not None:
            self._evicted()
        if exp.admitted_before_approval is not None:
            self._admitted_before_approval()
        if exp.admission is not None:
            self._admission()
        if exp.unattributed is not None:
            self._unattributed()
        if exp.open_allocations is not None:
            self._open_allocations()
        if exp.reservations_held is not None:
            self._reservations_held()
        return self.problems, self.facts

    @property
    def target_workloads(self) -> list[dict]:
        """The entry's workload when the entry is one, else every workload of the chain."""
        if self.kind == "workload" and self.value in self.workloads:
            return [self.workloads[self.value]]
        return list(self.workloads.values())

    def _entry(self) -> None:
        if self.kind == "alert":
            # The alert as it fired (a later "resolved" row carries the release's state at resolution).
            rows = [a for a in self.result.get("alerts", []) if a.get("alert_fingerprint") == self.value]
            firing = [a for a in rows if a.get("status") == "firing"]
            self.focal = (firing or rows or [None])[0]
            if self.focal is None:
                self.problems.append(f"alert {self.exp.alert} ({self.value}) is not in the store")
        if self.result.get("entry", {}).get("root") is None and self.kind != "alert":
            self.problems.append(f"--{self.kind} {self.value} matches nothing in the store")

    # --- traces_to ------------------------------------------------------------------------------

    def _traces_to(self, t) -> None:
        focal = self.focal
        if t.release_id is not None:
            got = (focal or {}).get("release_id") if focal else self.rel.get("release_id")
            self.expect(got == t.release_id, f"release {got}", f"release is {got or 'none'}, expected {t.release_id}")
        if t.workload is not None:
            self._traced_workload(self.sim.workload_id(t.workload))
        if t.node is not None:
            self._traced_node(t.node)
        if t.gpu is not None:
            self._traced_gpu(t.gpu)
        if t.attribution is not None:
            got = (focal or {}).get("attribution")
            self.expect(got == t.attribution, f"by {got}", f"attributed by {got or 'nothing'}, expected {t.attribution}")
        if t.release_state is not None:
            got = (focal or {}).get("release_state")
            self.expect(got == t.release_state, f"while {got}", f"release state at correlation {got or 'none'}, expected {t.release_state}")

    def _traced_workload(self, wid: str) -> None:
        if self.focal is not None:
            got = self.focal.get("workload_id")
            self.expect(got == wid, f"workload {wid}", f"alert's workload is {got or 'none'}, expected {wid}")
        else:
            self.expect(wid in self.workloads, f"workload {wid}",
                        f"workload {wid} not in the chain (chain has {', '.join(self.workloads) or 'none'})")

    def _traced_node(self, node: str) -> None:
        if self.focal is not None:
            got = self.focal.get("node")
            ok = got == node
        else:
            nodes = {n for p in self.result.get("pods", []) for n in p.get("nodes", [])} | {g["node"] for g in self.result.get("gpus", [])}
            got = ", ".join(sorted(nodes)) or "none"
            ok = node in nodes
        self.expect(ok, f"node {node}", f"node is {got or 'none'}, expected {node}")

    def _traced_gpu(self, gpu: str) -> None:
        node, device = self.sim.device_id(gpu)
        if self.focal is not None:
            ok = self.focal.get("node") == node and self.focal.get("gpu_id") == device
            got = f"{self.focal.get('node')}/{self.focal.get('gpu_id')}"
        else:
            held = {(g["node"], g["gpu_id"]) for g in self.result.get("gpus", [])}
            ok = (node, device) in held
            got = ", ".join(f"{n}/{_short(g)}" for n, g in sorted(held)) or "none"
        self.expect(ok, f"GPU {gpu} = {_short(device)}", f"GPU is {got}, expected {gpu} ({node}/{device})")

    # --- the release ----------------------------------------------------------------------------

    def _release_state(self) -> None:
        got = lifecycle_state(self.rel)
        self.expect(got == self.exp.release_state, f"state {got}", f"release state {got or 'none'}, expected {self.exp.release_state}")

    def _lifecycle(self) -> None:
        seen = [ev["event_type"] for ev in self.rel.get("lifecycle", [])]
        pos = 0
        for want in self.exp.lifecycle:
            try:
                pos = seen.index(want, pos) + 1
            except ValueError:
                self.problems.append(f"lifecycle lacks {want} (in order); it has {', '.join(s.split('.', 1)[1] for s in seen) or 'nothing'}")
                return
        self.facts.append("lifecycle " + " → ".join(s.split(".", 1)[1] for s in self.exp.lifecycle))

    def _unattributed(self) -> None:
        got = not self.rel.get("release_id")
        if got != self.exp.unattributed:
            self.problems.append(f"chain resolves to release {self.rel.get('release_id')}" if not got else "chain resolves to no release")
        else:
            self.facts.append("no release (unattributed)" if got else f"release {self.rel['release_id']}")

    def _reservations_held(self) -> None:
        types = [ev["event_type"] for ev in self.rel.get("lifecycle", [])]
        held = types.count("release.reservation_created") - types.count("release.reservation_released")
        self.expect(held == self.exp.reservations_held, f"{held} reservation(s) held", f"{held} reservation(s) held, expected {self.exp.reservations_held}")

    # --- the workloads --------------------------------------------------------------------------

    def _preempted_by(self) -> None:
        by = self.sim.workloads[self.exp.preempted_by.split("/")[-1]]
        names = {by.kueue_name, *(p.name for p in by.all_pods)}
        preemptions = [ev for w in self.target_workloads for ev in w.get("preemptions", [])]
        hits = [ev for ev in preemptions if ev.get("preemptor") and ev["preemptor"].rsplit("/", 1)[-1] in names]
        if hits:
            self.facts.append(f"preempted by {hits[0]['preemptor']} at {hits[0]['occurred_at']}")
            return
        got = sorted({ev.get("preemptor") or "unknown" for ev in preemptions})
        self.problems.append(f"no preemption by {by.workload_id}" + (f" (preempted by {', '.join(got)})" if got else " (no preemption recorded)"))

    def _evicted(self) -> None:
        got = any(w.get("evictions") for w in self.target_workloads)
        self.expect(got == self.exp.evicted, "evicted" if got else "not evicted", "an eviction is recorded" if got else "no eviction recorded")

    def _admitted_before_approval(self) -> None:
        wl = self.target_workloads[0] if self.target_workloads else None
        approvals = sorted(a["occurred_at"] for a in self.rel.get("approvals", []))
        if wl is None or not wl.get("admitted_at"):
            self.problems.append("no admission recorded")
            return
        early = not approvals or wl["admitted_at"] < approvals[0]
        first = approvals[0] if approvals else "never"
        self.expect(early == self.exp.admitted_before_approval, f"admitted {wl['admitted_at']}, approved {first}",
                    f"admitted {wl['admitted_at']}, first approval {first}")

    def _admission(self) -> None:
        """gpuledger admit's decision (``admission.decided`` in the store) before the workload's
        queue entry, as trace shows it; a denied workload must have no pod and no GPU."""
        wl = self.target_workloads[0] if self.target_workloads else None
        decisions = (wl or {}).get("admission_decisions") or []
        if not decisions:
            self.problems.append("no admission decision recorded for the workload")
            return
        from sinks.read.audit import precedes
        from sinks.read.trace import parse_instant

        admitted = wl.get("admitted_at")
        before = [d for d in decisions if admitted is None or precedes(parse_instant(d["occurred_at"]), parse_instant(admitted))]
        if not before:
            self.problems.append(f"no admission decision before the workload's admission at {admitted}")
            return
        d = before[-1]
        when = f"before admission at {admitted}" if admitted else "never admitted"
        self.expect(d["decision"] == self.exp.admission, f"decision {d['decision']} at {d['occurred_at']} by rule {d['rule']}, {when}",
                    f"decision {d['decision']} by rule {d['rule']} ({d.get('message')}), expected {self.exp.admission}")
        if self.exp.admission == "deny":
            # The chain runs through the release to its other workloads: only this workload's allocations count.
            gpus = [a for g in self.result.get("gpus", []) for a in g.get("allocations", []) if a.get("workload_id") == wl["workload_id"]]
            self.expect(not wl.get("pods") and not gpus, "no pod, no GPU",
                        f"a denied workload reached the cluster: pods {wl.get('pods')}, {len(gpus)} allocation(s)")

    def _open_allocations(self) -> None:
        at_s = iso_z(self.at) if self.at else None
        allocs = {a["allocation_id"]: a for g in self.result.get("gpus", []) for a in g.get("allocations", [])}
        held = [a for a in allocs.values() if (at_s is None and a.get("ended_at") is None)
                or (at_s is not None and a["started_at"] <= at_s and (a.get("ended_at") is None or a["ended_at"] > at_s))]
        self.expect(len(held) >= self.exp.open_allocations, f"{len(held)} GPU allocation(s) held",
                    f"{len(held)} GPU allocation(s) held, expected at least {self.exp.open_allocations}")


def check(exp: Expectation, sim, result: dict, entry: tuple[str, str], at: datetime | None) -> tuple[list[str], list[str]]:
    """(problems, facts) of one expectation against one trace result."""
    return _Check(exp, sim, result, entry, at).run()


def count_violations(reader, database: str, control: int, release_id: str | None) -> int:
    # Withdrawn violations (later history no longer supports them) do not count.
    sql = ("SELECT count() AS n FROM {db:Identifier}.violations FINAL WHERE control_id = {c:UInt8} AND NOT startsWith(detail, 'withdrawn:')"
           + (" AND release_id = {r:String}" if release_id else ""))
    rows = reader.query(sql, {"db": database, "c": control, "r": release_id or ""}).dicts()
    return int(rows[0]["n"]) if rows else 0


def evaluate(exp: Expectation, sim, reader, database: str, to_wall, cluster: str | None = None) -> tuple[CheckResult, dict | None]:
    """Run one expectation against the store: (result, the trace it read or None)."""
    from sinks.read.trace import trace

    label = "violations table" if exp.entry is None else f"--{exp.entry[0]} {exp.entry[1]}"
    result: dict | None = None
    try:
        problems: list[str] = []
        facts: list[str] = []
        at = resolve_at(exp, sim, to_wall)
        if exp.entry is not None:
            entry = resolve_entry(exp, sim)
            # What a person pastes into `gpuledger trace` (the cluster's identifiers, not the scenario's names).
            label = f"--{entry[0]} {entry[1]}"
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
