"""The incident timeline report: one self-contained HTML file.

Input: a trace (the dict ``sinks.read.trace.trace`` returns) and the rows around it that
``collect_report_data`` reads from the store — GPU allocation intervals on the
chain's nodes, scheduler preemptions/evictions, alerts and the lifecycle events of
the releases involved, over the chain's time range.
Output: HTML with inline CSS, a few lines of inline JS and an inline SVG timeline —
no network fetch of any kind, so it can be opened anywhere or attached to a
postmortem. The timeline has one lane per node/GPU with allocation intervals
coloured by release, markers for scheduler events (preemption, eviction), release
lifecycle events (promotion, rollback, retirement, admin actions) and alerts; the
release manifest and the text trace chain sit beside it.
Stable hooks for tools and the browser test: lanes are ``g.lane[data-lane]``
(``NODE/GPU_ID`` for devices, ``node:NODE``, ``releases``, ``alerts``,
``workloads``), allocations ``rect.alloc[data-release][data-pod]``, markers
``g.marker[data-kind][data-event-type][data-lane]`` where data-kind is one of
``alert``, ``preempted``, ``evicted``, ``release``.
How: ``render_html`` lays the rows out on one time axis in named steps (lanes,
allocations, release events, scheduler incidents, alerts) and hands the result to the
``incident.html.j2`` template (``sinks/read/pages.py``: the layout and stylesheet it
shares with the audit report).
Guarantees: everything rendered is escaped — HTML by Jinja2's autoescape, control and
bidi characters by ``sinks.read.text.printable``; a missing section (no release, no
allocation) renders as an explicit gap, never as an error.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

from schemas.release import actor_text, decision_actor
from sinks.read.pages import render_page
from sinks.read.trace import ALERT_COLS, ALLOC_COLS, RELEASE_COLS, WORKLOAD_COLS, Store, ch_time, parse_instant

MARKER_EVENT_TYPES = ("scheduler.preempted", "scheduler.evicted")
#: Release events worth a labelled marker (the rest get a small one).
KEY_RELEASE_EVENTS = ("release.promoted", "release.rolled_back", "release.revoked", "release.retired", "release.node_isolated",
                      "release.queue_paused", "release.priority_overridden", "release.approved")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#393b79")
UNATTRIBUTED = "#9e9e9e"


# --- reading ----------------------------------------------------------------------------------------

def _chain_nodes(result: dict) -> list[str]:
    nodes = {n for p in result.get("pods", []) for n in p.get("nodes", [])}
    nodes |= {g["node"] for g in result.get("gpus", [])}
    nodes |= {a["node"] for a in result.get("alerts", []) if a.get("node")}
    return sorted(nodes)


def _chain_times(result: dict) -> list[datetime]:
    times = []
    rel = result.get("release") or {}
    times += [parse_instant(e["occurred_at"]) for e in rel.get("lifecycle", [])]
    for w in result.get("workloads", []):
        times += [parse_instant(e["occurred_at"]) for e in w.get("events", [])]
    for g in result.get("gpus", []):
        for a in g.get("allocations", []):
            times += [parse_instant(a["started_at"]), parse_instant(a.get("ended_at"))]
    times += [parse_instant(a["occurred_at"]) for a in result.get("alerts", [])]
    return [t for t in times if t]


def collect_report_data(reader, database: str, result: dict, *, nodes: Iterable[str] | None = None, since: datetime | None = None,
                        until: datetime | None = None, cluster: str | None = None, mode: str = "final") -> dict[str, Any]:
    """Rows around a trace for the timeline: allocations, scheduler incidents, alerts, release events.

    ``nodes`` default to the chain's nodes; the time range defaults to the chain's
    first and last event (``since``/``until`` override either end).
    """
    store = Store(reader, database, cluster, mode)
    nodes = sorted(set(nodes) if nodes is not None else _chain_nodes(result))
    times = _chain_times(result)
    start = since or (min(times) if times else datetime.now(timezone.utc) - timedelta(hours=1))
    end = until or datetime.now(timezone.utc)
    span = {"from": ch_time(start), "to": ch_time(end)}
    in_range = "occurred_at >= {from:DateTime64(3, 'UTC')} AND occurred_at <= {to:DateTime64(3, 'UTC')}"
    allocations: list[dict] = []
    events: list[dict] = []
    alerts: list[dict] = []
    if nodes:
        allocations = store.latest("gpu_allocations", ALLOC_COLS, "node IN {nodes:Array(String)} AND started_at <= {to:DateTime64(3, 'UTC')}",
                                   {**span, "nodes": nodes}, after="ended_at IS NULL OR ended_at >= {from:DateTime64(3, 'UTC')}",
                                   after_columns=("ended_at",), order="node, gpu_id, started_at, allocation_id")
    workloads = sorted({a["workload_id"] for a in allocations if a.get("workload_id")} | {w["workload_id"] for w in result.get("workloads", [])})
    if nodes or workloads:
        events = store.latest("workload_timeline", WORKLOAD_COLS, f"{in_range} AND event_type IN {{types:Array(String)}}",
                            {**span, "types": list(MARKER_EVENT_TYPES), "nodes": nodes, "ws": workloads},
                            after="node IN {nodes:Array(String)} OR workload_id IN {ws:Array(String)}", after_columns=("node", "workload_id"),
                            order="occurred_at, correlation_id")
    releases = sorted({a["release_id"] for a in allocations if a.get("release_id")}
                      | ({(result.get("release") or {}).get("release_id")} - {None}))
    alerts = store.latest("enriched_alerts", ALERT_COLS, in_range, {**span, "nodes": nodes, "rels": releases},
                          after="node IN {nodes:Array(String)} OR release_id IN {rels:Array(String)}", after_columns=("node", "release_id"),
                          order="occurred_at, correlation_id")
    release_events = store.latest("release_history", RELEASE_COLS, "release_id IN {rels:Array(String)} AND occurred_at <= {to:DateTime64(3, 'UTC')}",
                                  {**span, "rels": releases}, order="occurred_at, correlation_id") if releases else []
    return {"allocations": allocations, "scheduler_events": events, "alerts": alerts, "release_events": release_events,
            "nodes": nodes, "from": start.isoformat(), "to": end.isoformat(), "queries": store.queries}


def trace_report(reader, database: str, result: dict, *, chain_text=None, until: datetime | None = None, cluster: str | None = None,
                 title: str | None = None) -> str:
    """``gpuledger trace --format html``: the rows around ``result`` read and rendered.
    ``chain_text`` is the text trace (a string or the CLI's rich Tree)."""
    data = collect_report_data(reader, database, result, until=until, cluster=cluster)
    if chain_text is not None and not isinstance(chain_text, str):
        from sinks.read.tree import tree_text

        chain_text = tree_text(chain_text)
    entry = result.get("entry") or {}
    return render_html(result, data, title=title or f"gpuledger incident report: --{entry.get('kind')} {entry.get('value')}",
                       chain_text=chain_text)




# --- laying the rows out on one time axis ------------------------------------------------------------

def _fmt(t: datetime | None) -> str:
    return t.strftime("%H:%M:%S") if t else "—"


def _colours(release_ids: Iterable[str]) -> dict[str, str]:
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(sorted(set(release_ids)))}


class _Timeline:
    """Lanes and the marks on them, on one time axis; ``view()`` is what the template draws."""

    LABEL_W = 190
    WIDTH = 1000
    LANE_H = 22
    HEAD_H = 20
    TICK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)

    def __init__(self, t0: datetime, t1: datetime) -> None:
        if t1 <= t0:
            t1 = t0 + timedelta(seconds=1)
        pad = (t1 - t0) * 0.03
        self.t0, self.t1 = t0 - pad, t1 + pad
        self.rows: list[tuple[str, str, str, int]] = []  # (lane id, label, css class, height)
        self.marks: dict[str, list[dict]] = {}

    def x(self, t: datetime) -> float:
        span = (self.t1 - self.t0).total_seconds()
        frac = (t - self.t0).total_seconds() / span
        return round(self.LABEL_W + frac * (self.WIDTH - self.LABEL_W - 10), 2)

    def lane(self, lane_id: str, label: str, css: str = "lane", height: int | None = None) -> None:
        if lane_id not in self.marks:
            self.rows.append((lane_id, label, css, height or self.LANE_H))
            self.marks[lane_id] = []

    def has(self, lane_id: str) -> bool:
        return lane_id in self.marks

    def add(self, lane_id: str, mark: dict) -> None:
        self.marks[lane_id].append(mark)

    def _ticks(self) -> list[dict]:
        span = (self.t1 - self.t0).total_seconds()
        step = next((s for s in self.TICK_STEPS if span / s <= 10), 86400)
        start = self.t0.replace(microsecond=0)
        t = start + timedelta(seconds=step - start.timestamp() % step)
        ticks = []
        while t <= self.t1:
            ticks.append({"x": self.x(t), "label": t.strftime("%H:%M:%S")})
            t += timedelta(seconds=step)
        return ticks

    def view(self) -> dict[str, Any]:
        y = 6
        lanes = []
        for lane_id, label, css, h in self.rows:
            device = "/" in lane_id
            node = lane_id.split("/", 1)[0] if device else (lane_id[5:] if lane_id.startswith("node:") else "")
            lanes.append({"id": lane_id, "label": label, "css": css, "y": y, "h": h, "node": node,
                          "gpu": lane_id.split("/", 1)[1] if device else "", "label_y": f"{h / 2 + 4:.0f}", "mid": f"{h / 2:.0f}",
                          "marks": self.marks[lane_id]})
            y += h + 2
        axis_y = y + 4
        return {"width": self.WIDTH, "height": axis_y + 22, "axis_y": axis_y, "t0": self.t0.isoformat(), "t1": self.t1.isoformat(),
                "start_label": _fmt(self.t0), "end_label": _fmt(self.t1), "ticks": self._ticks(), "lanes": lanes,
                "device_lanes": sum(1 for lane_id in self.marks if "/" in lane_id)}


def _marker(kind: str, x: float, colour: str, title: str, attrs: dict[str, Any], label: str | None = None, dy: int = 0) -> dict:
    """A marker: ``kind`` (release, alert, preempted, evicted) picks its shape in the template."""
    return {"type": "marker", "kind": kind, "x": x, "dy": dy, "colour": colour, "title": title, "label": label,
            "data": {k: v for k, v in attrs.items() if v not in (None, "")}}


def _time_range(data: dict, generated_at: datetime) -> tuple[datetime, datetime]:
    """First and last time in the rows (else the range they were read over, else the last five minutes)."""
    times = []
    for a in data.get("allocations", []):
        times += [parse_instant(a["started_at"]), parse_instant(a.get("ended_at"))]
    for group in ("scheduler_events", "alerts", "release_events"):
        times += [parse_instant(r["occurred_at"]) for r in data.get(group, [])]
    times = [t for t in times if t] or [t for t in (parse_instant(data.get("from")), parse_instant(data.get("to"))) if t]
    if not times:
        return generated_at - timedelta(minutes=5), generated_at
    return min(times), max(times)


def _lane_label(node: str, gpu_id: str) -> str:
    return f"{node} · {gpu_id[:12]}"


def _device_lanes(result: dict, allocations: list[dict], lanes: list[dict] | None) -> list[dict]:
    """The device lanes: ``lanes`` as given (idle devices included) or those of the rows,
    plus every GPU of the chain."""
    found = {(a["node"], a["gpu_id"]): {"node": a["node"], "gpu_id": a["gpu_id"], "label": _lane_label(a["node"], a["gpu_id"])}
             for a in allocations}
    listed = list(lanes) if lanes else sorted(found.values(), key=lambda d: (d["node"], d["gpu_id"]))
    for g in result.get("gpus", []):
        if not any(ln["node"] == g["node"] and ln["gpu_id"] == g["gpu_id"] for ln in listed):
            listed.append({"node": g["node"], "gpu_id": g["gpu_id"], "label": _lane_label(g["node"], g["gpu_id"])})
    return listed


def _add_lanes(tl: _Timeline, result: dict, data: dict, lanes: list[dict] | None) -> None:
    tl.lane("releases", "release lifecycle", "lane-top", 34)
    tl.lane("alerts", "alerts (no device)", "lane-top")
    tl.lane("workloads", "workload events (no node)", "lane-top")
    by_node: dict[str, list[dict]] = {}
    for ln in _device_lanes(result, data.get("allocations", []), lanes):
        by_node.setdefault(ln["node"], []).append(ln)
    for node in sorted(set(by_node) | set(data.get("nodes", []))):
        tl.lane(f"node:{node}", f"node {node}", "lane-node", tl.HEAD_H)
        for ln in by_node.get(node, []):
            css = "lane-gpu" + ("" if ln.get("healthy", True) else " lane-unhealthy")
            tl.lane(f"{node}/{ln['gpu_id']}", ln.get("label") or ln["gpu_id"], css)


PodLanes = dict[str, list[tuple[str, datetime, datetime | None]]]


def _add_allocations(tl: _Timeline, allocations: list[dict], colours: dict[str, str], end_of_view: datetime) -> PodLanes:
    """Allocation intervals on their device lanes, coloured by release; returns which
    lanes each pod held when (scheduler incidents are drawn there)."""
    pod_lanes: PodLanes = {}
    for a in allocations:
        lane_id = f"{a['node']}/{a['gpu_id']}"
        if not tl.has(lane_id):
            continue
        start, end = parse_instant(a["started_at"]), parse_instant(a.get("ended_at"))
        x0, x1 = tl.x(start), tl.x(end or end_of_view)
        rid = a.get("release_id") or ""
        pod = f"{a['namespace']}/{a['pod']}"
        pod_lanes.setdefault(pod, []).append((lane_id, start, end))
        tip = (f"{pod} on {a['node']}/{a['gpu_id']}\n{_fmt(start)} → {_fmt(end) if end else 'held'}"
               + (f" ({a['end_reason']})" if end and a.get("end_reason") else "")
               + f"\nrelease: {rid or 'unattributed'} ({a.get('attribution', '')})" + (f"\nworkload: {a['workload_id']}" if a.get("workload_id") else ""))
        tl.add(lane_id, {"type": "alloc", "x": x0, "width": f"{max(x1 - x0, 1.5):.2f}", "colour": colours.get(rid, UNATTRIBUTED),
                         "open": end is None, "title": tip, "release": rid or "unattributed", "pod": pod, "workload": a.get("workload_id") or "",
                         "allocation_id": a["allocation_id"], "start": a["started_at"], "end": a.get("ended_at") or "",
                         "label": a["pod"] if x1 - x0 > 5.6 * len(a["pod"]) + 8 else ""})
    return pod_lanes


def _add_release_events(tl: _Timeline, events: list[dict], colours: dict[str, str]) -> None:
    """Release lifecycle events on the releases lane (key ones labelled, alternating above
    and below); a node isolation also on that node's lane."""
    for i, r in enumerate(events):
        t = parse_instant(r["occurred_at"])
        et = r["event_type"]
        colour = colours.get(r["release_id"], UNATTRIBUTED)
        key = et in KEY_RELEASE_EVENTS
        label = et.split(".", 1)[1].replace("_", " ") if key else None
        actor = actor_text(decision_actor(json.loads(r.get("payload_json") or "{}")))  # as judged: "(unauthenticated)", "ci for alice"
        tip = (f"{et} {r['release_id']} at {r['occurred_at']}" + (f"\nby {actor}" if actor else "")
               + (f"\nto {r['to_environment']}" if r.get("to_environment") else "") + (f"\ntarget {r['target']}" if r.get("target") else "")
               + (f"\n{r['reason']}" if r.get("reason") else ""))
        attrs = {"event-type": et, "release": r["release_id"], "time": r["occurred_at"], "lane": "releases"}
        tl.add("releases", _marker("release", tl.x(t), colour, tip, attrs, label, dy=(-7 if i % 2 == 0 else 7) if key else 0))
        if et == "release.node_isolated" and r.get("target") and tl.has(f"node:{r['target']}"):
            tl.add(f"node:{r['target']}", _marker("release", tl.x(t), colour, tip, {**attrs, "lane": f"node:{r['target']}"}, "isolated"))


def _add_scheduler_events(tl: _Timeline, events: list[dict], pod_lanes: PodLanes) -> None:
    """Scheduler incidents on the lanes of the devices the pod held then, else the node, else the workload lane."""
    for ev in events:
        t = parse_instant(ev["occurred_at"])
        kind = ev["event_type"].split(".", 1)[1]
        who = f"{ev['namespace']}/{ev['pod']}" if ev.get("pod") else ev.get("workload_id", "?")
        tip = (f"{ev['event_type']} {who} at {ev['occurred_at']}" + (f" on {ev['node']}" if ev.get("node") else "")
               + (f"\nby {ev['preemptor_kind']}/{ev.get('preemptor_namespace') or ''}/{ev['preemptor_name']}" if ev.get("preemptor_name") else "")
               + (f"\n{ev['reason']}" if ev.get("reason") else "") + (f": {ev['message']}" if ev.get("message") else ""))
        colour = "#e65100" if kind == "preempted" else "#b71c1c"
        slack = timedelta(seconds=2)
        held = [lane for lane, s, e in pod_lanes.get(who, []) if s <= t + slack and (e is None or e >= t - slack)]
        targets = held or ([f"node:{ev['node']}"] if ev.get("node") and tl.has(f"node:{ev['node']}") else ["workloads"])
        for lane_id in targets:
            attrs = {"event-type": ev["event_type"], "workload": ev.get("workload_id"), "pod": who if ev.get("pod") else None,
                     "time": ev["occurred_at"], "lane": lane_id, "release": ev.get("release_id")}
            tl.add(lane_id, _marker(kind, tl.x(t), colour, tip, attrs))


def _alert_lane(tl: _Timeline, a: dict) -> str:
    """The device lane, else the node's, else the alerts lane."""
    if a.get("node") and a.get("gpu_id") and tl.has(f"{a['node']}/{a['gpu_id']}"):
        return f"{a['node']}/{a['gpu_id']}"
    return f"node:{a['node']}" if a.get("node") and tl.has(f"node:{a['node']}") else "alerts"


def _add_alerts(tl: _Timeline, alerts: list[dict]) -> None:
    """Alerts at their start (a resolution at its own time); firing ones labelled."""
    for a in alerts:
        lane_id = _alert_lane(tl, a)
        status = a["event_type"].split(".", 1)[1]
        t = parse_instant(a["occurred_at"] if status == "resolved" else (a.get("starts_at") or a["occurred_at"]))
        colour = "#c62828" if status == "firing" else "#66bb6a"
        tip = (f"{a.get('alertname')} ({a.get('severity') or '-'}) {status} at {a['occurred_at']}\nfingerprint {a['alert_fingerprint']}"
               + f"\nrelease: {a.get('release_id') or 'unattributed'} ({a.get('attribution', '')})"
               + (f"\non {a['node']}/{a.get('gpu_id') or ''}" if a.get("node") else ""))
        attrs = {"event-type": a["event_type"], "alertname": a.get("alertname"), "fingerprint": a["alert_fingerprint"],
                 "release": a.get("release_id"), "time": a["occurred_at"], "lane": lane_id}
        tl.add(lane_id, _marker("alert", tl.x(t), colour, tip, attrs, a.get("alertname") if status == "firing" else None))


# --- the page -----------------------------------------------------------------------------------------

MANIFEST_ROWS = ("release_id", "state", "state_since", "lifecycle_state", "lifecycle_since", "model_name", "model_version",
                 "artifact_digest", "image_digest", "config_digest", "dataset_ref", "owner", "environment")


def _release_view(rel: dict) -> dict | None:
    if not rel:
        return None
    return {"release_id": rel.get("release_id", ""), "fields": [(f, rel.get(f)) for f in MANIFEST_ROWS],
            "approvals": [{"occurred_at": a.get("occurred_at"), "actor": a.get("actor"), "approval_id": a.get("approval_id", "")}
                          for a in rel.get("approvals", [])],
            "promotions": [{"occurred_at": p.get("occurred_at"), "to_environment": p.get("to_environment"), "actor": p.get("actor")}
                           for p in rel.get("promotions", [])]}


def _checks_view(checks: list[dict] | None) -> dict | None:
    if not checks:
        return None
    return {"counts": {s: sum(c["status"] == s for c in checks) for s in ("PASS", "FAIL", "PENDING")},
            "rows": [{"status": c["status"], "name": c["name"], "entry": c.get("entry", ""), "detail": c.get("detail", "")} for c in checks]}


def _steps_view(steps: list[dict] | None) -> list[dict]:
    return [{"offset": f"{int(s['offset']) // 60}m{int(s['offset']) % 60:02d}s", "at": _fmt(parse_instant(s["at"])), "kind": s["kind"],
             "summary": s["summary"], "note": s.get("note")} for s in steps or []]


def render_html(result: dict, data: dict, *, title: str = "gpuledger incident report", lanes: list[dict] | None = None,
                chain_text: str | None = None, checks: list[dict] | None = None, steps: list[dict] | None = None,
                description: str | None = None, generated_at: datetime | None = None) -> str:
    """The report as one HTML document (module docstring). ``lanes`` (node, gpu_id, label)
    fixes the device lanes, idle ones included; by default they come from the data."""
    generated_at = generated_at or datetime.now(timezone.utc)
    allocations = data.get("allocations", [])
    rel = result.get("release") or {}
    colours = _colours({a["release_id"] for a in allocations if a.get("release_id")} | ({rel.get("release_id")} - {None})
                       | {r["release_id"] for r in data.get("release_events", [])})
    t0, t1 = _time_range(data, generated_at)
    tl = _Timeline(t0, t1)
    _add_lanes(tl, result, data, lanes)
    pod_lanes = _add_allocations(tl, allocations, colours, end_of_view=t1)
    _add_release_events(tl, data.get("release_events", []), colours)
    _add_scheduler_events(tl, data.get("scheduler_events", []), pod_lanes)
    _add_alerts(tl, data.get("alerts", []))
    entry = result.get("entry") or {}
    return render_page("incident.html.j2", title=title, entry_kind=entry.get("kind"), entry_value=entry.get("value"),
                       root=entry.get("root") or None, generated=generated_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
                       description=description.strip() if description else None, checks=_checks_view(checks), tl=tl.view(),
                       legend=sorted(colours.items()), unattributed=UNATTRIBUTED, release=_release_view(rel), chain_text=chain_text,
                       gaps=result.get("gaps", []), steps=_steps_view(steps))
