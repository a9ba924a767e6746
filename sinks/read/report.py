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
Guarantees: everything rendered is escaped; a missing section (no release, no
allocation) renders as an explicit gap, never as an error.
"""

from __future__ import annotations

import html
import io
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

from sinks.read.trace import ALERT_COLS, ALLOC_COLS, RELEASE_COLS, WORKLOAD_COLS, Store

MARKER_EVENT_TYPES = ("scheduler.preempted", "scheduler.evicted")
#: Release events worth a labelled marker (the rest get a small one).
KEY_RELEASE_EVENTS = ("release.promoted", "release.rolled_back", "release.revoked", "release.retired", "release.node_isolated",
                      "release.queue_paused", "release.priority_overridden", "release.approved")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#393b79")
UNATTRIBUTED = "#9e9e9e"


# --- reading ----------------------------------------------------------------------------------------

def _parse(value: str | datetime | None) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00").replace(" ", "T", 1)).astimezone(timezone.utc)


def _ch(t: datetime) -> str:
    t = t.astimezone(timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def _chain_nodes(result: dict) -> list[str]:
    nodes = {n for p in result.get("pods", []) for n in p.get("nodes", [])}
    nodes |= {g["node"] for g in result.get("gpus", [])}
    nodes |= {a["node"] for a in result.get("alerts", []) if a.get("node")}
    return sorted(nodes)


def _chain_times(result: dict) -> list[datetime]:
    times = []
    rel = result.get("release") or {}
    times += [_parse(e["occurred_at"]) for e in rel.get("lifecycle", [])]
    for w in result.get("workloads", []):
        times += [_parse(e["occurred_at"]) for e in w.get("events", [])]
    for g in result.get("gpus", []):
        for a in g.get("allocations", []):
            times += [_parse(a["started_at"]), _parse(a.get("ended_at"))]
    times += [_parse(a["occurred_at"]) for a in result.get("alerts", [])]
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
    span = {"from": _ch(start), "to": _ch(end)}
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
        rows = store.latest("workload_timeline", WORKLOAD_COLS, f"{in_range} AND event_type IN {{types:Array(String)}}",
                            {**span, "types": list(MARKER_EVENT_TYPES), "nodes": nodes, "ws": workloads},
                            after="node IN {nodes:Array(String)} OR workload_id IN {ws:Array(String)}", after_columns=("node", "workload_id"),
                            order="occurred_at, correlation_id")
        # Rows re-attributed to another workload leave an old version under the old key;
        # Store.latest drops them (older Store versions had a separate step for it).
        drop = getattr(store, "drop_superseded", None)
        events = drop("workload_timeline", rows) if drop else rows
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
        chain_text = tree_text(chain_text)
    entry = result.get("entry") or {}
    return render_html(result, data, title=title or f"gpuledger incident report: --{entry.get('kind')} {entry.get('value')}",
                       chain_text=chain_text)


def tree_text(tree, width: int = 140) -> str:
    """A rich Tree (the CLI's trace) as plain text."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, record=True, color_system=None, force_terminal=False)
    console.print(tree)
    return console.export_text()


# --- rendering ----------------------------------------------------------------------------------------

def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _fmt(t: datetime | None) -> str:
    return t.strftime("%H:%M:%S") if t else "—"


def _colours(release_ids: Iterable[str]) -> dict[str, str]:
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(sorted(set(release_ids)))}


class _Timeline:
    """Lays lanes and marks out on one time axis and writes the SVG."""

    LABEL_W = 190
    WIDTH = 1000
    LANE_H = 22
    HEAD_H = 20

    def __init__(self, t0: datetime, t1: datetime) -> None:
        if t1 <= t0:
            t1 = t0 + timedelta(seconds=1)
        pad = (t1 - t0) * 0.03
        self.t0, self.t1 = t0 - pad, t1 + pad
        self.rows: list[tuple[str, str, str, int]] = []  # (lane id, label, css class, height)
        self.items: dict[str, list[str]] = {}

    def x(self, t: datetime) -> float:
        span = (self.t1 - self.t0).total_seconds()
        frac = (t - self.t0).total_seconds() / span
        return round(self.LABEL_W + frac * (self.WIDTH - self.LABEL_W - 10), 2)

    def lane(self, lane_id: str, label: str, css: str = "lane", height: int | None = None) -> None:
        if lane_id not in self.items:
            self.rows.append((lane_id, label, css, height or self.LANE_H))
            self.items[lane_id] = []

    def add(self, lane_id: str, svg: str) -> None:
        self.items[lane_id].append(svg)

    def svg(self, extra_attrs: str = "") -> str:
        y = 6
        parts = []
        for lane_id, label, css, h in self.rows:
            node = lane_id.split("/", 1)[0] if "/" in lane_id else (lane_id[5:] if lane_id.startswith("node:") else "")
            gpu = lane_id.split("/", 1)[1] if "/" in lane_id else ""
            attrs = f' data-lane="{_e(lane_id)}"' + (f' data-node="{_e(node)}"' if node else "") + (f' data-gpu="{_e(gpu)}"' if gpu else "")
            parts.append(f'<g class="lane {css}"{attrs} transform="translate(0,{y})">'
                         f'<rect class="lane-bg" x="0" y="0" width="{self.WIDTH}" height="{h}"/>'
                         f'<text class="lane-label" x="6" y="{h / 2 + 4:.0f}">{_e(label)}</text>'
                         f'<g transform="translate(0,{h / 2:.0f})">{"".join(self.items[lane_id])}</g></g>')
            y += h + 2
        axis_y = y + 4
        ticks = []
        span = (self.t1 - self.t0).total_seconds()
        step = next((s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400) if span / s <= 10), 86400)
        first = self.t0.replace(microsecond=0) + timedelta(seconds=step - self.t0.replace(microsecond=0).timestamp() % step)
        t = first
        while t <= self.t1:
            x = self.x(t)
            ticks.append(f'<line class="tick" x1="{x}" y1="0" x2="{x}" y2="{axis_y}"/>'
                         f'<text class="tick-label" x="{x}" y="{axis_y + 14}" text-anchor="middle">{t.strftime("%H:%M:%S")}</text>')
            t += timedelta(seconds=step)
        height = axis_y + 22
        return (f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.WIDTH} {height}" width="100%" '
                f'data-from="{_e(self.t0.isoformat())}" data-to="{_e(self.t1.isoformat())}"{extra_attrs}>'
                f'<g class="ticks">{"".join(ticks)}</g>{"".join(parts)}</svg>')


def _marker(kind: str, x: float, colour: str, title: str, attrs: dict[str, Any], label: str | None = None, dy: int = 0) -> str:
    data = "".join(f' data-{k}="{_e(v)}"' for k, v in attrs.items() if v not in (None, ""))
    if kind == "release":
        shape = f'<path d="M{x},{-7 + dy} L{x + 6},{dy} L{x},{7 + dy} L{x - 6},{dy} Z" fill="{colour}" class="shape"/>'
    elif kind == "alert":
        shape = f'<circle cx="{x}" cy="{dy}" r="6" fill="{colour}" class="shape"/><text x="{x}" y="{dy + 3.5}" class="glyph">!</text>'
    elif kind == "preempted":
        shape = f'<path d="M{x - 6},{-6 + dy} L{x + 6},{-6 + dy} L{x},{6 + dy} Z" fill="{colour}" class="shape"/>'
    else:  # evicted
        shape = f'<rect x="{x - 5}" y="{-5 + dy}" width="10" height="10" fill="{colour}" class="shape"/>'
    text = f'<text class="marker-label" x="{x + 8}" y="{dy + 4}">{_e(label)}</text>' if label else ""
    return f'<g class="marker" data-kind="{kind}"{data}><title>{_e(title)}</title>{shape}{text}</g>'


def render_html(result: dict, data: dict, *, title: str = "gpuledger incident report", lanes: list[dict] | None = None,
                chain_text: str | None = None, checks: list[dict] | None = None, steps: list[dict] | None = None,
                description: str | None = None, generated_at: datetime | None = None) -> str:
    """The report as one HTML document (module docstring). ``lanes`` (node, gpu_id, label)
    fixes the device lanes, idle ones included; by default they come from the data."""
    generated_at = generated_at or datetime.now(timezone.utc)
    allocations = data.get("allocations", [])
    rel = result.get("release") or {}
    release_ids = {a["release_id"] for a in allocations if a.get("release_id")} | ({rel.get("release_id")} - {None})
    release_ids |= {r["release_id"] for r in data.get("release_events", [])}
    colours = _colours(release_ids)

    data_times = []
    for a in allocations:
        data_times += [_parse(a["started_at"]), _parse(a.get("ended_at"))]
    for group in ("scheduler_events", "alerts", "release_events"):
        data_times += [_parse(r["occurred_at"]) for r in data.get(group, [])]
    data_times = [t for t in data_times if t] or [t for t in (_parse(data.get("from")), _parse(data.get("to"))) if t]
    t0 = min(data_times) if data_times else generated_at - timedelta(minutes=5)
    t1 = max(data_times) if data_times else generated_at
    tl = _Timeline(t0, t1)
    end_of_view = t1

    tl.lane("releases", "release lifecycle", "lane-top", 34)
    tl.lane("alerts", "alerts (no device)", "lane-top")
    tl.lane("workloads", "workload events (no node)", "lane-top")
    lane_list = lanes or sorted({(a["node"], a["gpu_id"]): {"node": a["node"], "gpu_id": a["gpu_id"], "label": f"{a['node']} · {a['gpu_id'][:12]}"}
                                 for a in allocations}.values(), key=lambda d: (d["node"], d["gpu_id"]))
    for g in result.get("gpus", []):
        if not any(l["node"] == g["node"] and l["gpu_id"] == g["gpu_id"] for l in lane_list):
            lane_list.append({"node": g["node"], "gpu_id": g["gpu_id"], "label": f"{g['node']} · {g['gpu_id'][:12]}"})
    by_node: dict[str, list[dict]] = {}
    for ln in lane_list:
        by_node.setdefault(ln["node"], []).append(ln)
    for node in sorted(set(by_node) | set(data.get("nodes", []))):
        tl.lane(f"node:{node}", f"node {node}", "lane-node", tl.HEAD_H)
        for ln in by_node.get(node, []):
            css = "lane-gpu" + ("" if ln.get("healthy", True) else " lane-unhealthy")
            tl.lane(f"{node}/{ln['gpu_id']}", ln.get("label") or ln["gpu_id"], css)

    # Allocation intervals, coloured by release.
    pod_lanes: dict[str, list[tuple[str, datetime, datetime | None]]] = {}
    for a in allocations:
        lane_id = f"{a['node']}/{a['gpu_id']}"
        if lane_id not in tl.items:
            continue
        start, end = _parse(a["started_at"]), _parse(a.get("ended_at"))
        x0, x1 = tl.x(start), tl.x(end or end_of_view)
        rid = a.get("release_id") or ""
        colour = colours.get(rid, UNATTRIBUTED)
        pod = f"{a['namespace']}/{a['pod']}"
        pod_lanes.setdefault(pod, []).append((lane_id, start, end))
        tip = (f"{pod} on {a['node']}/{a['gpu_id']}\n{_fmt(start)} → {_fmt(end) if end else 'held'}"
               + (f" ({a['end_reason']})" if end and a.get("end_reason") else "")
               + f"\nrelease: {rid or 'unattributed'} ({a.get('attribution', '')})" + (f"\nworkload: {a['workload_id']}" if a.get("workload_id") else ""))
        open_cls = " open" if end is None else ""
        label = a["pod"] if x1 - x0 > 5.6 * len(a["pod"]) + 8 else ""
        tl.add(lane_id, f'<g class="alloc-g"><title>{_e(tip)}</title><rect class="alloc{open_cls}" x="{x0}" y="-8" width="{max(x1 - x0, 1.5):.2f}" '
                        f'height="16" rx="2" fill="{colour}" data-release="{_e(rid or "unattributed")}" data-pod="{_e(pod)}" '
                        f'data-workload="{_e(a.get("workload_id") or "")}" data-allocation-id="{_e(a["allocation_id"])}" '
                        f'data-start="{_e(a["started_at"])}" data-end="{_e(a.get("ended_at") or "")}"/>'
                        + (f'<text class="alloc-label" x="{x0 + 4}" y="4">{_e(label)}</text>' if label else "") + "</g>")

    # Release lifecycle events.
    for i, r in enumerate(data.get("release_events", [])):
        t = _parse(r["occurred_at"])
        et = r["event_type"]
        colour = colours.get(r["release_id"], UNATTRIBUTED)
        key = et in KEY_RELEASE_EVENTS
        label = et.split(".", 1)[1].replace("_", " ") if key else None
        tip = f"{et} {r['release_id']} at {r['occurred_at']}" + (f"\nby {r['actor']}" if r.get("actor") else "") \
            + (f"\nto {r['to_environment']}" if r.get("to_environment") else "") + (f"\ntarget {r['target']}" if r.get("target") else "") \
            + (f"\n{r['reason']}" if r.get("reason") else "")
        attrs = {"event-type": et, "release": r["release_id"], "time": r["occurred_at"], "lane": "releases"}
        tl.add("releases", _marker("release", tl.x(t), colour, tip, attrs, label, dy=(-7 if i % 2 == 0 else 7) if key else 0))
        if et == "release.node_isolated" and r.get("target") and f"node:{r['target']}" in tl.items:
            tl.add(f"node:{r['target']}", _marker("release", tl.x(t), colour, tip, {**attrs, "lane": f"node:{r['target']}"}, "isolated"))

    # Scheduler incidents: on the lanes of the devices the pod held then, else the node, else the workload lane.
    for ev in data.get("scheduler_events", []):
        t = _parse(ev["occurred_at"])
        kind = ev["event_type"].split(".", 1)[1]
        who = f"{ev['namespace']}/{ev['pod']}" if ev.get("pod") else ev.get("workload_id", "?")
        tip = f"{ev['event_type']} {who} at {ev['occurred_at']}" + (f" on {ev['node']}" if ev.get("node") else "") \
            + (f"\nby {ev['preemptor_kind']}/{ev.get('preemptor_namespace') or ''}/{ev['preemptor_name']}" if ev.get("preemptor_name") else "") \
            + (f"\n{ev['reason']}" if ev.get("reason") else "") + (f": {ev['message']}" if ev.get("message") else "")
        colour = "#e65100" if kind == "preempted" else "#b71c1c"
        held = [lane for lane, s, e in pod_lanes.get(who, []) if s <= t + timedelta(seconds=2) and (e is None or e >= t - timedelta(seconds=2))]
        targets = held or ([f"node:{ev['node']}"] if ev.get("node") and f"node:{ev['node']}" in tl.items else ["workloads"])
        for lane_id in targets:
            attrs = {"event-type": ev["event_type"], "workload": ev.get("workload_id"), "pod": who if ev.get("pod") else None,
                     "time": ev["occurred_at"], "lane": lane_id, "release": ev.get("release_id")}
            tl.add(lane_id, _marker(kind, tl.x(t), colour, tip, attrs))

    # Alerts: on the device lane, else the node, else the alerts lane.
    for a in data.get("alerts", []):
        t = _parse(a.get("starts_at") or a["occurred_at"])
        lane_id = f"{a['node']}/{a['gpu_id']}" if a.get("node") and a.get("gpu_id") else (f"node:{a['node']}" if a.get("node") else "alerts")
        if lane_id not in tl.items:
            lane_id = f"node:{a['node']}" if a.get("node") and f"node:{a['node']}" in tl.items else "alerts"
        status = a["event_type"].split(".", 1)[1]
        t = _parse(a["occurred_at"]) if status == "resolved" else t
        colour = "#c62828" if status == "firing" else "#66bb6a"
        tip = f"{a.get('alertname')} ({a.get('severity') or '-'}) {status} at {a['occurred_at']}\nfingerprint {a['alert_fingerprint']}" \
              + f"\nrelease: {a.get('release_id') or 'unattributed'} ({a.get('attribution', '')})" \
              + (f"\non {a['node']}/{a.get('gpu_id') or ''}" if a.get("node") else "")
        attrs = {"event-type": a["event_type"], "alertname": a.get("alertname"), "fingerprint": a["alert_fingerprint"],
                 "release": a.get("release_id"), "time": a["occurred_at"], "lane": lane_id}
        tl.add(lane_id, _marker("alert", tl.x(t), colour, tip, attrs, a.get("alertname") if status == "firing" else None))

    legend = "".join(f'<span class="legend-item" data-release="{_e(rid)}"><i style="background:{c}"></i>{_e(rid)}</span>'
                     for rid, c in sorted(colours.items()))
    legend += f'<span class="legend-item" data-release="unattributed"><i style="background:{UNATTRIBUTED}"></i>unattributed</span>'
    legend += ('<span class="legend-key"><svg width="14" height="14"><path d="M7,0 L14,7 L7,14 L0,7 Z" fill="#555"/></svg> release event</span>'
               '<span class="legend-key"><svg width="14" height="14"><circle cx="7" cy="7" r="6" fill="#c62828"/></svg> alert</span>'
               '<span class="legend-key"><svg width="14" height="14"><path d="M1,1 L13,1 L7,13 Z" fill="#e65100"/></svg> preempted</span>'
               '<span class="legend-key"><svg width="14" height="14"><rect x="2" y="2" width="10" height="10" fill="#b71c1c"/></svg> evicted</span>')

    entry = result.get("entry") or {}
    root = entry.get("root") or {}
    subtitle = (f"trace --{_e(entry.get('kind'))} {_e(entry.get('value'))}"
                + (f" → {_e(root.get('kind'))} {_e(root.get('id'))}" if root else " → <span class='gap'>matches nothing</span>")
                + f" · generated {_e(generated_at.strftime('%Y-%m-%d %H:%M:%S UTC'))}")
    sections = [f"<header><h1>{_e(title)}</h1><p class='sub'>{subtitle}</p>"
                + (f"<p class='desc'>{_e(description.strip())}</p>" if description else "") + "</header>"]
    if checks:
        rows = "".join(f"<tr class='check {c['status'].lower()}' data-status='{_e(c['status'])}'><td>{i}</td><td class='status'>{_e(c['status'])}</td>"
                       f"<td>{_e(c['name'])}</td><td><code>{_e(c.get('entry', ''))}</code> {_e(c.get('detail', ''))}</td></tr>"
                       for i, c in enumerate(checks, 1))
        counts = {s: sum(c["status"] == s for c in checks) for s in ("PASS", "FAIL", "PENDING")}
        sections.append(f"<section id='checks'><h2>Expected evidence — {counts['PASS']} passed, {counts['FAIL']} failed, "
                        f"{counts['PENDING']} pending</h2><table><thead><tr><th>#</th><th>result</th><th>expectation</th>"
                        f"<th>read back from the store</th></tr></thead><tbody>{rows}</tbody></table></section>")
    manifest_rows = "".join(f"<tr><th>{_e(f)}</th><td>{_e(rel.get(f)) if rel.get(f) else '<span class=gap>gap</span>'}</td></tr>"
                            for f in ("release_id", "state", "state_since", "model_name", "model_version", "artifact_digest", "image_digest",
                                      "config_digest", "dataset_ref", "owner", "environment"))
    approvals = "".join(f"<li>{_e(a.get('occurred_at'))} {_e(a.get('actor'))} {_e(a.get('approval_id', ''))}</li>" for a in rel.get("approvals", []))
    promotions = "".join(f"<li>{_e(p.get('occurred_at'))} → {_e(p.get('to_environment'))} by {_e(p.get('actor'))}</li>" for p in rel.get("promotions", []))
    manifest = (f"<table class='manifest' id='manifest' data-release='{_e(rel.get('release_id', ''))}'>{manifest_rows}</table>"
                f"<h3>approvals</h3><ul>{approvals or '<li class=gap>none recorded</li>'}</ul>"
                + (f"<h3>promotions</h3><ul>{promotions}</ul>" if promotions else "")) if rel else "<p class='gap'>no release in this chain</p>"
    gaps = "".join(f"<li>{_e(g)}</li>" for g in result.get("gaps", []))
    side = (f"<aside><h2>Release manifest</h2>{manifest}<h2>Chain (gpuledger trace)</h2>"
            f"<pre id='chain'>{_e(chain_text) if chain_text else '(not given)'}</pre>"
            + (f"<h2>Gaps</h2><ul class='gaps'>{gaps}</ul>" if gaps else "") + "</aside>")
    n_lanes = sum(1 for lane_id in tl.items if "/" in lane_id)
    timeline = (f"<section id='timeline-section'><h2>Timeline <small>{_e(_fmt(tl.t0))} → {_e(_fmt(tl.t1))} UTC · {n_lanes} device lanes</small></h2>"
                f"<div class='legend'>{legend}</div>{tl.svg()}</section>")
    sections.append(f"<div class='grid'><main>{timeline}</main>{side}</div>")
    if steps:
        rows = "".join(f"<tr><td>{int(s['offset']) // 60}m{int(s['offset']) % 60:02d}s</td><td>{_e(_fmt(_parse(s['at'])))}</td>"
                       f"<td>{_e(s['kind'])}</td><td>{_e(s['summary'])}{' — ' + _e(s['note']) if s.get('note') else ''}</td></tr>"
                       for s in steps)
        sections.append(f"<section id='steps'><h2>What the exercise did</h2><table><thead><tr><th>scenario time</th><th>at (UTC)</th>"
                        f"<th>step</th><th>what</th></tr></thead><tbody>{rows}</tbody></table></section>")
    return _PAGE.format(title=_e(title), css=_CSS, js=_JS, body="\n".join(sections))


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;padding:16px 20px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:15px;margin:14px 0 6px}h2 small{font-weight:normal;color:#666}h3{font-size:13px;margin:8px 0 2px}
.sub{color:#555;margin:0}.desc{color:#333;max-width:1100px}
.grid{display:flex;gap:18px;align-items:flex-start}main{flex:3;min-width:0}aside{flex:2;min-width:320px;max-width:560px}
table{border-collapse:collapse;background:#fff;font-size:13px}td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
#checks table{width:100%}tr.pass .status{color:#2e7d32;font-weight:bold}tr.fail .status{color:#c62828;font-weight:bold}tr.pending .status{color:#ef6c00;font-weight:bold}
table.manifest th{background:#f2f2f2;font-weight:normal;color:#555;white-space:nowrap}table.manifest td{font-family:ui-monospace,monospace;font-size:12px;word-break:break-all}
pre#chain{background:#fff;border:1px solid #ddd;padding:8px;font-size:11.5px;overflow:auto;max-height:640px}
.gap{color:#c62828}ul{margin:2px 0 6px 18px;padding:0}
svg#timeline{background:#fff;border:1px solid #ddd;font-size:10px}
.lane-bg{fill:transparent}.lane-gpu .lane-bg{fill:#fcfcfc}.lane-node .lane-bg{fill:#eceff1}.lane-top .lane-bg{fill:#f5f5f5}
.lane-unhealthy .lane-bg{fill:#ffebee}.lane-label{fill:#333;font-size:10.5px}.lane-node .lane-label{font-weight:bold}
.tick{stroke:#e0e0e0}.tick-label{fill:#777}.alloc{stroke:#0003;stroke-width:.5}.alloc.open{stroke-dasharray:3 2}
.alloc-label{fill:#fff;font-size:9px;pointer-events:none}.marker .shape{stroke:#fff;stroke-width:1}.marker-label{fill:#222;font-size:9.5px;paint-order:stroke;stroke:#fff;stroke-width:3px}
.glyph{fill:#fff;font-size:9px;font-weight:bold;text-anchor:middle;pointer-events:none}
.legend{margin:0 0 6px}.legend-item,.legend-key{display:inline-block;margin:0 12px 4px 0;cursor:pointer;font-size:12px}
.legend-item i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px;border-radius:2px}
.legend-key{cursor:default;color:#555}.legend-key svg{vertical-align:-3px}
svg.focus .alloc:not(.hl){opacity:.15}svg.focus .marker:not(.hl){opacity:.25}
"""

_JS = """
(function(){var svg=document.getElementById('timeline');if(!svg)return;var on=null;
document.querySelectorAll('.legend-item').forEach(function(el){el.addEventListener('click',function(){
var r=el.getAttribute('data-release');on=(on===r)?null:r;svg.classList.toggle('focus',on!==null);
svg.querySelectorAll('[data-release]').forEach(function(x){x.classList.toggle('hl',on!==null&&x.getAttribute('data-release')===on);});
svg.querySelectorAll('.marker').forEach(function(m){m.classList.toggle('hl',on!==null&&m.getAttribute('data-release')===on);});});});
document.body.setAttribute('data-rendered','true');})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>{title}</title><style>{css}</style></head>
<body>
{body}
<script>{js}</script>
</body></html>
"""
