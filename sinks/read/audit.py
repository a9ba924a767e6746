"""The audit: the evidence report of the eight controls for a time range (``gpuledger audit``).

Input: the store (read-only, through ``sinks.read.query.open_reader`` — the worker's loopback
endpoint when it owns the embedded store), a time range and a policy. Output: per
control PASS/FAIL with counts and the violations in the range, plus the evidence each
control asks for (DESIGN.md "Controls"; docs/controls.md), as a table, JSON or one
self-contained HTML file (``templates/audit.html.j2``, the layout and stylesheet of the
incident report). The command (``gpuledger/cli/audit.py``) exits 0 when every control passes,
1 when one fails (so it can gate a pipeline), 2 for bad options or policy, 3 when the
store cannot be read.

How: the controls are *re-evaluated* over the stored history — the same rules the
worker runs (``streams.controls.rules.ControlEngine``), fed with the latest version of
every correlated row and allocation up to ``--to``, with the watermark at ``--to`` —
so the report is "as of --to", works with any policy (``--policy``), and does not
depend on the worker having run the controls. What the worker recorded in the
``violations`` table over the same range is shown beside it (``recorded``).

Limits: history older than ``--lookback`` before ``--from`` is not read (release
lifecycle is always read in full); at most ``MAX_ROWS`` rows per table (the report
says when it was truncated). Rows keep their latest attribution, which may have been
learned after ``--to``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import datetime, timedelta

from gpuledger.timefmt import TimeFormatError, parse_duration, parse_time
from schemas.release import decision_actor
from sinks.migrations import table_name
from sinks.read.pages import render_page
from sinks.read.text import markup
from sinks.read.trace import Store, ch_time, parse_instant
from streams.controls.policy import ACTION_OF_EVENT, CONTROL_NAMES, CONTROL_TITLES, Policy
from streams.controls.rules import (
    PREEMPTION_CLUSTER,
    START,
    ControlEngine,
    Release,
    approval_changes,
    compact_row,
    directory_from_rows,
    intervals,
    is_withdrawn,
    peak_concurrency,
)

MAX_ROWS = 200_000
LIST_LIMIT = 25
QUEUE_ENTRY = ("scheduler.submitted", "scheduler.queued", "scheduler.quota_reserved", "scheduler.admitted", "scheduler.scheduled")
IDENTITY_COLUMNS = ("release_id", "model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
                    "environment", "workload_id", "pod_uid", "namespace", "pod", "node", "gpu_id", "owner", "data_class", "alert_fingerprint")
CONTAINMENT = ("release.queue_paused", "release.node_isolated", "release.priority_overridden", "release.rolled_back", "release.revoked",
               "release.retired")
FORMATS = ("table", "json", "html")


class AuditError(ValueError):
    """Options the audit cannot use."""


def audit_range(start: str | None, end: str | None, lookback: str) -> tuple[datetime, datetime, timedelta]:
    """``--from``, ``--to`` and ``--lookback`` as (from, to, lookback), in the grammar of
    ``gpuledger.timefmt`` (no zone means UTC; 90s, 15m, 2h, 1d, 1h30m): --to defaults to
    now, --from to 24 h before --to."""
    try:
        to_time = parse_time(end or "now", "--to")
        from_time = parse_time(start, "--from") if start else to_time - timedelta(hours=24)
        span = parse_duration(lookback, "--lookback")
    except TimeFormatError as exc:
        raise AuditError(str(exc)) from exc
    if from_time > to_time:
        raise AuditError(f"--from {_z(from_time)} is after --to {_z(to_time)}")
    return from_time, to_time, span


def _z(value) -> str | None:
    t = parse_instant(value)
    return None if t is None else t.strftime("%Y-%m-%dT%H:%M:%S") + (f".{t.microsecond // 1000:03d}" if t.microsecond else "") + "Z"


# --- reading the history --------------------------------------------------------------------

def load_history(reader, database: str, start: datetime, end: datetime, lookback: timedelta, cluster: str | None = None) -> dict:
    """Latest versions of the correlated rows and allocations the audit needs, and the
    violations the worker recorded over the range."""
    store = Store(reader, database, cluster)
    params = {"to": ch_time(end), "since": ch_time(start - lookback), "from": ch_time(start)}
    columns = ("correlation_id", "version", "event_type", "occurred_at", "attribution", *IDENTITY_COLUMNS, "release_state", "payload_json")
    raw = store.latest("correlated_events", columns,
                       "occurred_at <= {to:DateTime64(3)} AND (startsWith(event_type, 'release.') OR "
                       "(occurred_at >= {since:DateTime64(3)} AND NOT startsWith(event_type, 'gpu.')))",
                       params, order="occurred_at, correlation_id", limit=MAX_ROWS)
    rows = [{"correlation_id": r["correlation_id"], "version": int(r["version"]), "event_type": r["event_type"],
             "occurred_at": r["occurred_at"], "attribution": r["attribution"], "release_state": r.get("release_state") or None,
             "identity": {k: r[k] for k in IDENTITY_COLUMNS if r.get(k)}, "payload_json": r.get("payload_json") or "{}"} for r in raw]
    alloc_cols = ("allocation_id", "version", "node", "gpu_id", "namespace", "pod", "release_id", "workload_id", "attribution",
                  "started_at", "ended_at", "start_event_id", "end_event_id")
    raw_allocs = store.latest("gpu_allocations", alloc_cols, "started_at <= {to:DateTime64(3)}",
                              params, after="ended_at IS NULL OR ended_at >= {since:DateTime64(3)}",
                              order="started_at, allocation_id", limit=MAX_ROWS)
    allocations = []
    for a in raw_allocs:
        ended = parse_instant(a.get("ended_at"))
        held_at_end = ended is None or ended > end  # as of --to it was still held
        allocations.append({"allocation_id": a["allocation_id"], "version": int(a["version"]), "node": a["node"], "gpu_id": a["gpu_id"],
                            "namespace": a["namespace"], "pod": a["pod"], "attribution": a["attribution"],
                            "identity": {k: a[k] for k in ("release_id", "workload_id") if a.get(k)},
                            "started_at": a["started_at"], "ended_at": None if held_at_end else a["ended_at"],
                            "start_event_id": a["start_event_id"], "end_event_id": None if held_at_end else (a.get("end_event_id") or None)})
    recorded_sql = (f"SELECT violation_id, version, control_id, severity, opened_at, closed_at, detail FROM "
                    f"{{db:Identifier}}.{table_name('violations', cluster)} FINAL WHERE opened_at <= {{to:DateTime64(3)}} "
                    f"AND (closed_at IS NULL OR closed_at >= {{from:DateTime64(3)}}) LIMIT {MAX_ROWS}")
    recorded = [r for r in reader.query(recorded_sql, {"db": database, **params}).dicts() if not is_withdrawn(r)]
    return {"rows": rows, "allocations": allocations, "recorded": recorded, "truncated": sorted(store.truncated)}


# --- the report ------------------------------------------------------------------------------

def build_report(history: dict, policy: Policy, start: datetime, end: datetime, policy_source: str = "built-in default") -> dict:
    """Re-evaluate the controls over ``history`` as of ``end``; summarise ``[start, end]``."""
    rows = history["rows"]
    directory = directory_from_rows(rows)
    engine = ControlEngine(directory, policy, watermark=end).feed(rows, history["allocations"])
    engine.run()
    in_range = [v for v in engine.current() if v.opened_at <= end and (v.closed_at is None or v.closed_at >= start)]
    recorded = defaultdict(int)
    for r in history.get("recorded", []):
        recorded[int(r["control_id"])] += 1
    controls = []
    for cid in range(1, 9):
        mine = [v for v in in_range if v.control_id == cid]
        failing = [v for v in mine if v.severity != "info"]
        conf = policy.control(cid)
        controls.append({
            "id": cid, "name": CONTROL_NAMES[cid], "title": CONTROL_TITLES[cid],
            "status": "OFF" if not conf.enabled else ("FAIL" if failing else "PASS"),
            "violations": len(mine), "open": sum(1 for v in mine if v.closed_at is None), "closed": sum(1 for v in mine if v.closed_at is not None),
            "info": len(mine) - len(failing), "recorded": recorded.get(cid, 0), "owner": policy.owner_for(cid), "severity": conf.severity,
        })
    ev = Evidence(history, directory, policy, start, end, in_range)
    return {
        "range": {"from": _z(start), "to": _z(end)},
        "policy": policy_source,
        "passed": all(c["status"] != "FAIL" for c in controls),
        "controls": controls,
        "violations": [_violation_row(v) for v in in_range],
        "evidence": [ev.admission(), ev.promotion(), ev.prod_run(), ev.preemption(), ev.reservations(), ev.telemetry(), ev.authority(),
                     ev.retirement()],
        "truncated": history.get("truncated", []),
    }


def _violation_row(v) -> dict:
    ident = v.identity
    subject = ident.release_id or ident.workload_id or ident.alert_fingerprint or (f"{ident.namespace}/{ident.pod}" if ident.pod else "")
    return {"control": v.control_id, "severity": v.severity, "violation_id": v.violation_id, "opened_at": _z(v.opened_at),
            "closed_at": _z(v.closed_at), "owner": v.owner, "subject": subject, "detail": v.detail, "evidence": list(v.evidence)}


def _payload(row: dict) -> dict:
    return json.loads(row.get("payload_json") or "{}")


def _approval_text(approval: dict) -> str:
    return f"{approval['actor']} {approval.get('approval_id') or ''} at {approval['at']}"


def _history_time(entry: tuple) -> datetime | None:
    """When a release directory history entry (``"<time>|<id>", event type, …``) happened."""
    return parse_instant(entry[0].split("|")[0])


class Evidence:
    """The evidence each control asks for, from the same history: one public method per
    control, (1) to (8), each a section (title, summary, columns, rows)."""

    def __init__(self, history: dict, directory, policy: Policy, start: datetime, end: datetime, violations: list) -> None:
        self.rows = sorted(history["rows"], key=lambda r: (parse_instant(r["occurred_at"]), r["correlation_id"]))
        self.allocations = history["allocations"]
        self.directory = directory
        self.policy = policy
        self.start, self.end = start, end
        self.violations = violations
        self.release_rows = {r["correlation_id"]: r for r in self.rows if r["event_type"].startswith("release.")}
        self.workloads: dict[str, list[dict]] = defaultdict(list)
        for r in self.rows:
            if r["event_type"].startswith("scheduler."):
                ident = r["identity"]
                key = ident.get("workload_id") or (f"{ident.get('namespace')}/{ident.get('pod')}" if ident.get("pod") else r["correlation_id"])
                self.workloads[key].append(r)
        self.prod = policy.environments[-1].name

    def _in_range(self, value) -> bool:
        t = parse_instant(value)
        return t is not None and self.start <= t <= self.end

    def _section(self, control: int, title: str, summary: str, columns: list[str], rows: list[dict]) -> dict:
        return {"control": control, "title": title, "summary": summary, "columns": columns, "rows": rows[:LIST_LIMIT],
                "more": max(0, len(rows) - LIST_LIMIT)}

    def _approval_before(self, rid: str | None, env: str | None, at: datetime) -> dict | None:
        if not rid:
            return None
        changes = approval_changes(Release(self.directory, rid), self.policy, env)
        state = next((c for c in reversed(changes) if c[0] <= at), None)
        if not state or not state[1]:
            return None
        row = self.release_rows.get(state[2], {})
        p = _payload(row) if row else {}
        return {"at": _z(state[0]), "actor": p.get("actor"), "approval_id": p.get("approval_id"), "event_id": state[2]}

    def _release_of(self, rows: list[dict]) -> str | None:
        return next((r["identity"]["release_id"] for r in reversed(rows) if r["identity"].get("release_id")), None)

    def _rows_of_release(self, rid: str):
        """The scheduler rows, by workload, that name release ``rid``."""
        for wid, rows in self.workloads.items():
            for r in rows:
                if r["identity"].get("release_id") == rid:
                    yield wid, r

    # (1)
    def admission(self) -> dict:
        out = []
        for wid, rows in sorted(self.workloads.items()):
            entry = next((r for r in rows if r["event_type"] in QUEUE_ENTRY), None)
            if entry is None or not self._in_range(entry["occurred_at"]):
                continue
            rid = entry["identity"].get("release_id") or self._release_of(rows)
            env = entry["identity"].get("environment")
            approval = self._approval_before(rid, env, parse_instant(entry["occurred_at"]))
            envp = self.policy.environment(env)
            needed = envp.requires_approval if envp else True
            verdict = ("approved before queue entry" if approval else "no release identity" if not rid else
                       "no approval before queue entry" if needed else f"approval not required in {env}")
            out.append({"workload": wid, "release": rid or "", "environment": env or "", "queue_entry": _z(entry["occurred_at"]),
                        "entry_event": entry["event_type"], "approval": _approval_text(approval) if approval else "", "verdict": verdict})
        ok = sum(1 for r in out if r["verdict"] == "approved before queue entry")
        return self._section(1, "Approved identity before queue entry", f"{ok} of {len(out)} workload(s) entering a queue in the range "
                             "had an approved release identity first",
                             ["workload", "release", "environment", "queue_entry", "entry_event", "approval", "verdict"], out)

    # (2)
    def promotion(self) -> dict:
        out = [row for rid, state in sorted(self.directory.releases.items()) if (row := self._promotion_row(rid, state))]
        traced = sum(1 for r in out if r["approved"] != "NOT APPROVED")
        return self._section(2, f"Release approval traced to the scheduling policy applied in {self.prod}",
                             f"{traced} of {len(out)} release(s) promoted to {self.prod} trace to an approval",
                             ["release", "approved", "promoted", "state_at_end", "scheduling_applied"], out)

    def _promotion_row(self, rid: str, state: dict) -> dict | None:
        """The release's last promotion to prod (up to the end of the range), if any."""
        promos = [h for h in state["history"] if h[1] == "release.promoted" and h[3] == self.prod and _history_time(h) <= self.end]
        if not promos:
            return None
        last = promos[-1]
        p = _payload(self.release_rows.get(last[2], {}))
        approval = self._approval_before(rid, self.prod, _history_time(last))
        return {"release": rid, "approved": _approval_text(approval) if approval else "NOT APPROVED",
                "promoted": f"{last[4] or '?'} {p.get('approval_id') or ''} at {_z(last[0].split('|')[0])}"
                            + ("" if self.policy.allowed(last[4], "promote") else " (no promote right)"),
                "state_at_end": self.directory.state_as_of(rid, self.end.isoformat()) or "", "scheduling_applied": self._scheduling_applied(rid)}

    def _scheduling_applied(self, rid: str) -> str:
        """The queue and priority every prod workload of the release started with in the range."""
        sched = set()
        for _wid, r in self._rows_of_release(rid):
            if r["identity"].get("environment") == self.prod and r["event_type"] in START and self._in_range(r["occurred_at"]):
                q = _payload(r)
                sched.add((q.get("queue") or "", q.get("cluster_queue") or "", q.get("priority_class") or "",
                           "" if q.get("priority") is None else str(q.get("priority"))))
        return "; ".join(f"queue={q} cluster_queue={cq} class={pc} priority={pr} (business "
                         f"{self.policy.business_priority.of(rid, None, pc)})" for q, cq, pc, pr in sorted(sched)) or "no workload in the range"

    # (3)
    def prod_run(self) -> dict:
        title = f"One {self.prod} run, scheduler event to artifact manifest"
        run = self._latest_prod_run()
        if run is None:
            return self._section(3, title, f"no {self.prod} run in the range", ["step", "value"], [])
        wid, rows, first = run
        rid = first["identity"]["release_id"]
        steps = [{"step": "workload", "value": wid}, *self._scheduling_steps(rows), *self._gpu_steps(rows), *self._manifest_steps(rid, first, rows)]
        return self._section(3, title, f"workload {wid} of release {rid}", ["step", "value"], steps)

    def _latest_prod_run(self) -> tuple[str, list[dict], dict] | None:
        """The workload whose latest start in prod, with a release, is the latest in the range:
        (workload, its rows, its first such start)."""
        candidates = []
        for wid, rows in self.workloads.items():
            starts = [r for r in rows if r["event_type"] in START and r["identity"].get("release_id")
                      and r["identity"].get("environment") == self.prod and self._in_range(r["occurred_at"])]
            if starts:
                candidates.append((parse_instant(starts[-1]["occurred_at"]), wid, rows, starts[0]))
        if not candidates:
            return None
        _at, wid, rows, first = max(candidates, key=lambda c: (c[0], c[1]))
        return wid, rows, first

    def _scheduling_steps(self, rows: list[dict]) -> list[dict]:
        steps = []
        for r in rows[:12]:
            ident, q = r["identity"], _payload(r)
            where = " ".join(x for x in (f"pod {ident.get('namespace')}/{ident['pod']}" if ident.get("pod") else "",
                                         f"node {ident['node']}" if ident.get("node") else "",
                                         f"queue {q['queue']}" if q.get("queue") else "", f"class {q['priority_class']}" if q.get("priority_class") else "") if x)
            steps.append({"step": r["event_type"], "value": f"{_z(r['occurred_at'])} {where}".strip()})
        return steps

    def _gpu_steps(self, rows: list[dict]) -> list[dict]:
        pods = {f"{r['identity'].get('namespace')}/{r['identity']['pod']}" for r in rows if r["identity"].get("pod")}
        return [{"step": "gpu", "value": f"{a['node']}/{a['gpu_id']} {_z(a['started_at'])} → {_z(a['ended_at']) or 'held'}"}
                for a in self.allocations if f"{a['namespace']}/{a['pod']}" in pods]

    def _manifest_steps(self, rid: str, first: dict, rows: list[dict]) -> list[dict]:
        """The release at admission, its approval, its manifest, and whether the running image is the manifest's."""
        admitted = parse_instant(first["occurred_at"])
        manifest = self.directory.manifest(rid)
        approval = self._approval_before(rid, self.prod, admitted)
        steps = [{"step": "release", "value": f"{rid} (state at admission: {self.directory.state_as_of(rid, admitted.isoformat()) or '?'})"},
                 {"step": "approval", "value": _approval_text(approval) if approval else "none before admission"}]
        for f in ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref", "owner"):
            steps.append({"step": f"manifest.{f}", "value": manifest.get(f) or "<gap>"})
        running = sorted({d for r in rows for d in (_payload(r).get("image_digests") or [])})
        want = manifest.get("image_digest")
        verdict = ("no running image digest observed" if not running else "running image matches the manifest" if want in running
                   else f"running image(s) {', '.join(running)} do not include the manifest's {want}")
        steps.append({"step": "image check", "value": verdict})
        return steps

    # (4)
    def preemption(self) -> dict:
        bp = self.policy.business_priority
        preemptions = [self._preemption_row(wid, rows, cluster) for wid, rows in sorted(self.workloads.items())
                       for cluster in self._preemption_clusters(rows)]
        overrides = [self._override_row(r) for r in self.rows if r["event_type"] == "release.priority_overridden" and self._in_range(r["occurred_at"])]
        classes = self._priority_classes()
        summary = ("priority classes: " + ", ".join(f"{pc}={bp.by_priority_class.get(pc, '?')} ({len(w)} workload(s))" for pc, w in sorted(classes.items()))
                   if classes else "no priority classes seen") + f"; {len(preemptions)} preemption(s), {len(overrides)} override(s)"
        return self._section(4, "Priority classes and preemptions with their authority", summary,
                             ["at", "victim", "release", "class", "business", "preemptor", "preemptor_class", "preemptor_business", "verdict"],
                             preemptions + overrides)

    def _priority_classes(self) -> dict[str, set]:
        """Priority class → the workloads seen with it in the range."""
        classes: dict[str, set] = defaultdict(set)
        for wid, rows in self.workloads.items():
            for r in rows:
                pc = _payload(r).get("priority_class")
                if pc and self._in_range(r["occurred_at"]):
                    classes[pc].add(wid)
        return classes

    def _preemption_clusters(self, rows: list[dict]) -> list[list[dict]]:
        """One preemption often shows as several rows (the pod's, its Kueue workload's):
        rows of one workload within PREEMPTION_CLUSTER are one preemption."""
        clusters: list[list[dict]] = []
        for r in rows:
            q = _payload(r)
            preempt = r["event_type"] == "scheduler.preempted" or (r["event_type"] == "scheduler.evicted" and "preempt" in (q.get("reason") or "").lower())
            if not preempt or not self._in_range(r["occurred_at"]):
                continue
            if clusters and parse_instant(r["occurred_at"]) - parse_instant(clusters[-1][0]["occurred_at"]) <= PREEMPTION_CLUSTER:
                clusters[-1].append(r)
            else:
                clusters.append([r])
        return clusters

    def _preemption_row(self, wid: str, rows: list[dict], cluster: list[dict]) -> dict:
        bp = self.policy.business_priority
        r = next((x for x in cluster if (_payload(x).get("preemptor") or {}).get("name")), cluster[0])
        q = _payload(r)
        rid = next((x["identity"]["release_id"] for x in cluster if x["identity"].get("release_id")), None)
        pc = q.get("priority_class") or _first_priority_class(rows)
        ref = q.get("preemptor") or {}
        by = f"{ref.get('kind', '')} {ref.get('namespace') or ''}/{ref.get('name') or ref.get('uid') or ''}".strip() if ref else ""
        their = self.workloads.get(f"{ref.get('namespace')}/{ref.get('name')}", []) if ref else []
        their_pc = _first_priority_class(their)
        return {"at": _z(cluster[0]["occurred_at"]), "victim": wid, "release": rid or "", "class": pc or "",
                "business": bp.of(rid, None, pc), "preemptor": by or "unknown", "preemptor_class": their_pc or "",
                "preemptor_business": bp.of(self._release_of(their), None, their_pc) if their else None,
                "verdict": self._preemption_verdict(cluster)}

    def _preemption_verdict(self, cluster: list[dict]) -> str:
        """The control 4 violations whose evidence names a row of this preemption."""
        ids = {x["correlation_id"] for x in cluster}
        linked = [v for v in self.violations if v.control_id == 4 and ids & set(v.evidence)]
        return "; ".join(("inside observation window" if "observation window" in v.detail else "by lower business priority")
                         + f" ({v.violation_id[:8]})" for v in linked) or "within policy"

    def _override_row(self, r: dict) -> dict:
        p = _payload(r)
        return {"at": _z(r["occurred_at"]), "victim": p.get("target") or "", "release": r["identity"].get("release_id", ""),
                "class": "override", "business": None, "preemptor": f"actor {p.get('actor') or '?'}", "preemptor_class": "",
                "preemptor_business": None,
                "verdict": ("authorized" if self.policy.allowed(decision_actor(p), "override_priority") else "NO RIGHT")
                           + f", expires {_z(p.get('expires_at')) or 'never'}"}

    # (5)
    def reservations(self) -> dict:
        created, released = self._reservation_events()
        out = []
        for (rid, res_id), (row, res) in sorted(created.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
            we = parse_instant(res.get("window_end"))
            if we is not None and we < self.start:
                continue
            out.append(self._reservation_row(rid, res_id, row, res, released.get((rid, res_id))))
        return self._section(5, "Reservation plan vs. actual utilisation", f"{len(out)} reservation(s) active in the range",
                             ["release", "reservation", "gpus", "pool", "window", "reserved_by", "released", "peak_allocated", "gpu_hours", "utilisation"], out)

    def _reservation_events(self) -> tuple[dict, dict]:
        """(release, reservation id) → its first creation (row, reservation) and its first release row."""
        created: dict = {}
        released: dict = {}
        for r in self.rows:
            res = _payload(r).get("reservation") or {}
            if not res.get("reservation_id"):
                continue
            key = (r["identity"].get("release_id"), res["reservation_id"])
            if r["event_type"] == "release.reservation_created":
                created.setdefault(key, (r, res))
            elif r["event_type"] == "release.reservation_released":
                released.setdefault(key, r)
        return created, released

    def _reservation_row(self, rid: str | None, res_id: str, row: dict, res: dict, rel: dict | None) -> dict:
        """Planned GPU-hours over the reservation's window (up to the end of the range) against the release's allocations."""
        ws = parse_instant(res.get("window_start")) or parse_instant(row["occurred_at"])
        we = parse_instant(res.get("window_end"))
        gpus = int(res.get("gpus") or 0)
        allocs = [{"start": a["started_at"], "end": a["ended_at"], "id": a["allocation_id"]} for a in self.allocations
                  if a["identity"].get("release_id") == rid]
        until = min(we or self.end, self.end)
        peak = peak_concurrency(allocs, ws, until)
        used_h = sum(max(0.0, (min(parse_instant(a["end"]) or until, until) - max(parse_instant(a["start"]), ws)).total_seconds())
                     for a in allocs) / 3600
        planned_h = gpus * max(0.0, (until - ws).total_seconds()) / 3600
        actor = _payload(row).get("actor")
        return {"release": rid or "", "reservation": res_id, "gpus": gpus, "pool": res.get("pool") or "",
                "window": f"{_z(ws)} → {_z(we) or 'open'}", "reserved_by": f"{actor or '?'}" + ("" if self.policy.allowed(decision_actor(_payload(row)), "reserve") else " (no reserve right)"),
                "released": _z(rel["occurred_at"]) if rel else "held", "peak_allocated": peak,
                "gpu_hours": f"{used_h:.1f} of {planned_h:.1f}", "utilisation": f"{used_h / planned_h:.0%}" if planned_h else "-"}

    # (6)
    def telemetry(self) -> dict:
        total, attributed, q_total, q_attr, sample = self._coverage()
        ratio = f"{attributed}/{total} = {attributed / total:.0%}" if total else "no alerts in the range"
        q_ratio = f"{q_attr}/{q_total}" if q_total else "0/0"
        steps = self._sample_steps(sample[1], sample[2]) if sample else []
        return self._section(6, "Alert coverage and a sampled alert joined to scheduling, node and release",
                             f"coverage {ratio} (quality alerts {q_ratio})", ["step", "value"], steps)

    def _coverage(self) -> tuple[int, int, int, int, tuple | None]:
        """Alert episodes (fingerprint, startsAt) starting in the range: (total, attributed,
        quality total, quality attributed, a sample joined one — a quality alert when there is one)."""
        episodes: dict[tuple, list[dict]] = defaultdict(list)
        for r in self.rows:
            if r["event_type"].startswith("alert."):
                episodes[(r["identity"].get("alert_fingerprint"), _payload(r).get("starts_at"))].append(r)
        total = attributed = q_total = q_attr = 0
        sample = None
        matcher = self.policy.telemetry.quality_alerts
        for (_fp, starts), rows in sorted(episodes.items(), key=lambda kv: (str(kv[0][1]), str(kv[0][0]))):
            if not self._in_range(starts or rows[0]["occurred_at"]):
                continue
            p = _payload(rows[0])
            quality = matcher.matches(p.get("alertname"), p.get("labels"))
            joined = next((r for r in rows if r["attribution"] != "unattributed" or r["identity"].get("release_id")), None)
            total += 1
            q_total += quality
            if joined:
                attributed += 1
                q_attr += quality
                if sample is None or quality >= sample[0]:
                    sample = (quality, joined, p)
        return total, attributed, q_total, q_attr, sample

    def _sample_steps(self, row: dict, p: dict) -> list[dict]:
        """The sampled alert joined to its release, workload, pod, GPU and the scheduling before it."""
        ident = row["identity"]
        steps = [{"step": "alert", "value": f"{p.get('alertname')} ({p.get('severity') or '-'}) fingerprint {ident.get('alert_fingerprint')} "
                                            f"starts {_z(p.get('starts_at'))}"},
                 {"step": "attribution", "value": row["attribution"]},
                 {"step": "release", "value": f"{ident.get('release_id') or '<gap>'} (state {row.get('release_state') or '?'})"},
                 {"step": "workload", "value": ident.get("workload_id") or "<gap>"},
                 {"step": "pod", "value": f"{ident['namespace']}/{ident['pod']}" if ident.get("pod") else "<gap>"},
                 {"step": "node/gpu", "value": f"{ident.get('node') or '<gap>'}/{ident.get('gpu_id') or '<gap>'}"}]
        wl = self.workloads.get(ident.get("workload_id") or "", [])
        fired = parse_instant(p.get("starts_at") or row["occurred_at"])
        admitted = [r for r in wl if r["event_type"] in START and parse_instant(r["occurred_at"]) <= fired]
        if admitted:
            last, q = admitted[-1], _payload(admitted[-1])
            steps.append({"step": "scheduling", "value": f"{last['event_type']} {_z(last['occurred_at'])} queue={q.get('queue') or '?'} "
                                                         f"class={q.get('priority_class') or '?'} node={last['identity'].get('node') or '?'}"})
        return steps

    # (7)
    def authority(self) -> dict:
        out = []
        for r in self.rows:
            if r["event_type"] not in CONTAINMENT or not self._in_range(r["occurred_at"]):
                continue
            p = _payload(r)
            action = ACTION_OF_EVENT[r["event_type"]]
            actor = p.get("actor")
            out.append({"at": _z(r["occurred_at"]), "action": r["event_type"].split(".", 1)[1], "release": r["identity"].get("release_id", ""),
                        "target": p.get("target") or p.get("to_environment") or "", "actor": actor or "<none>",
                        "roles": ", ".join(self.policy.roles_of(actor)), "authorized": "yes" if self.policy.allowed(actor, action) else "NO",
                        "expires": _z(p.get("expires_at")) or "", "reason": p.get("reason") or ""})
        bad = sum(1 for r in out if r["authorized"] == "NO")
        return self._section(7, "Containment and rollback actions with their actors",
                             f"{len(out)} action(s), {bad} without the decision right",
                             ["at", "action", "release", "target", "actor", "roles", "authorized", "expires", "reason"], out)

    # (8)
    def retirement(self) -> dict:
        out = []
        for rid, state in sorted(self.directory.releases.items()):
            ended = next((h for h in state["history"] if h[1] in ("release.retired", "release.revoked") and _history_time(h) <= self.end), None)
            if ended:
                out.append(self._retirement_row(rid, ended))
        clean = sum(1 for r in out if r["verdict"] == "reconciled to zero")
        return self._section(8, "Retired releases reconciled to zero capacity", f"{clean} of {len(out)} retired/revoked release(s) hold nothing at the end of the range",
                             ["release", "ended", "gpus_held", "reservations_held", "running_workloads", "verdict"], out)

    def _retirement_row(self, rid: str, ended: tuple) -> dict:
        allocs = [a for a in self.allocations if a["identity"].get("release_id") == rid and a["ended_at"] is None]
        reservations = self._reservations_held(rid)
        running = self._running_objects(rid)
        held = len(allocs) + len(reservations) + len(running)
        return {"release": rid, "ended": f"{ended[1].split('.', 1)[1]} by {ended[4] or '?'} at {_z(ended[0].split('|')[0])}",
                "gpus_held": len(allocs), "reservations_held": len(reservations), "running_workloads": len(running),
                "verdict": "reconciled to zero" if not held else "STILL HOLDS CAPACITY"}

    def _reservations_held(self, rid: str) -> set[str]:
        held: set[str] = set()
        for r in self.rows:
            res = _payload(r).get("reservation") or {}
            if r["identity"].get("release_id") == rid and res.get("reservation_id"):
                if r["event_type"] == "release.reservation_created":
                    held.add(res["reservation_id"])
                elif r["event_type"] == "release.reservation_released":
                    held.discard(res["reservation_id"])
        return held

    def _running_objects(self, rid: str) -> list[str]:
        """Pods (else workloads) of the release whose last interval is still open."""
        objects: dict[str, list] = defaultdict(list)
        for wid, r in self._rows_of_release(rid):
            ident = r["identity"]
            objects[f"{ident.get('namespace')}/{ident['pod']}" if ident.get("pod") else wid].append(compact_row(r) or {})
        return [k for k, rows in objects.items() if any(iv[1] is None for iv in intervals([x for x in rows if x]))]


def _first_priority_class(rows: list[dict]) -> str | None:
    return next((_payload(x).get("priority_class") for x in rows if _payload(x).get("priority_class")), None)


# --- rendering --------------------------------------------------------------------------------

def render_table(report: dict, console) -> None:
    """The report as rich tables (``--format table``); stored text through ``markup``."""
    from rich.table import Table

    console.print(f"[bold]gpuledger audit[/] {report['range']['from']} → {report['range']['to']}  policy: {markup(report['policy'])}", highlight=False)
    summary = Table("control", "status", "violations", "open", "closed", "info", "recorded", "owner", title="Controls")
    for c in report["controls"]:
        style = {"PASS": "green", "FAIL": "bold red", "OFF": "dim"}[c["status"]]
        summary.add_row(f"{c['id']}. {c['title']}", f"[{style}]{c['status']}[/]", str(c["violations"]), str(c["open"]), str(c["closed"]),
                        str(c["info"]), str(c["recorded"]), markup(c["owner"]))
    console.print(summary)
    if report["violations"]:
        vt = Table("ctl", "severity", "opened", "closed", "owner", "detail", title="Violations in the range")
        for v in report["violations"]:
            vt.add_row(str(v["control"]), v["severity"], v["opened_at"], v["closed_at"] or "open", markup(v["owner"] or ""), markup(v["detail"]))
        console.print(vt)
    for sec in report["evidence"]:
        t = Table(*sec["columns"], title=f"({sec['control']}) {sec['title']}", caption=markup(sec["summary"]) + (f" (+{sec['more']} more)" if sec["more"] else ""))
        for row in sec["rows"]:
            t.add_row(*["" if row.get(c) is None else markup(row.get(c)) for c in sec["columns"]])
        console.print(t)
    if report["truncated"]:
        console.print(f"[yellow]truncated:[/] {', '.join(report['truncated'])} (more than {MAX_ROWS} rows; narrow the range)")
    console.print("[bold green]all controls pass[/]" if report["passed"] else "[bold red]at least one control fails[/]")


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page (``templates/audit.html.j2``)."""
    controls = [{"control": f"{c['id']}. {c['title']}", **c} for c in report["controls"]]
    return render_page("audit.html.j2", title=f"gpuledger audit {report['range']['from']} – {report['range']['to']}",
                       report=report, controls=controls)


def write_report(report: dict, fmt: str, output: str | None, console) -> None:
    """Print the report in ``fmt`` (one of ``FORMATS``) on ``console``/stdout, or write it to ``output``."""
    if fmt == "table":
        if output:
            from rich.console import Console

            with open(output, "w") as handle:
                render_table(report, Console(file=handle, width=200))
        else:
            render_table(report, console)
        return
    text = json.dumps(report, indent=2, default=str) if fmt == "json" else render_html(report)
    if output:
        with open(output, "w") as handle:
            handle.write(text)
    else:
        print(text)
