"""The responder's trace as a rich ``Tree``: what ``gpuledger trace`` prints and the HTML reports embed as text.

Input: the dict ``sinks.trace.trace`` returns. Output: a ``rich.tree.Tree`` — the chain
alert → release → workloads → pods → GPUs → scheduler events and alerts, missing links in
red (``<gap>``). Pure: no I/O; ``sinks.report.tree_text`` turns it into plain text.
"""

from __future__ import annotations

from typing import Optional

from rich.tree import Tree


def _span(start: Optional[str], end: Optional[str], reason: Optional[str] = None) -> str:
    return f"{start} → {end or 'held'}" + (f" ({reason})" if reason and end else "")


def render_tree(result: dict) -> Tree:
    """The trace as a rich tree; missing links in red."""
    gap = "[red]<gap>[/]"
    entry = result.get("entry") or {}
    focal = [a for a in result.get("alerts", []) if entry.get("kind") == "alert" and a.get("alert_fingerprint") == entry.get("value")]
    if focal:
        a = focal[-1]
        title = (f"[bold]alert[/] {a.get('alertname', '?')} ({a.get('severity') or 'no severity'}) {a['status']} "
                 f"at {a.get('starts_at') or a['occurred_at']} (fingerprint {a['alert_fingerprint']})")
    else:
        title = f"[bold]trace[/] --{entry.get('kind')} {entry.get('value')}"
    root_info = entry.get("root")
    title += f"  [dim]as of {entry['at']}[/]" if entry.get("at") else ""
    root = Tree(title + ("" if root_info else "  [red]matches nothing[/]"))
    rel = result.get("release")
    if rel:
        node = root.add(f"[bold]release[/] {rel['release_id']}  state={rel.get('state') or gap}" +
                        (f" since {rel['state_since']}" if rel.get("state_since") else ""))
        for field in ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref", "owner", "environment"):
            node.add(f"{field}: {rel.get(field) or gap}")
        approvals = node.add("approvals" if rel.get("approvals") else f"approvals: {gap}")
        for ap in rel.get("approvals", []):
            approvals.add(f"{ap['occurred_at']}  {ap.get('actor', '?')}  {ap.get('approval_id', '')}")
        if rel.get("promotions"):
            promos = node.add("promotions")
            for pr in rel["promotions"]:
                promos.add(f"{pr['occurred_at']}  → {pr.get('to_environment', '?')} by {pr.get('actor', '?')} {pr.get('approval_id', '')}")
        life = node.add("lifecycle")
        for ev in rel.get("lifecycle", []):
            life.add(f"{ev['occurred_at']}  {ev['event_type']}  {ev.get('summary', '')}")
    elif entry.get("kind") in ("alert", "release", "model") or root_info:
        root.add(f"release: {gap}")
    pods = {f"{p['namespace']}/{p['pod']}": p for p in result.get("pods", [])}

    def add_pod(parent, key: str) -> None:
        p = pods[key]
        pnode = parent.add(f"pod {key}" + (f"  uid={p['pod_uid']}" if p.get("pod_uid") else "") +
                           (f"  nodes={','.join(p['nodes'])}" if p.get("nodes") else ""))
        for a in p.get("allocations", []):
            pnode.add(f"GPU {a['node']}/{a['gpu_id']}  {_span(a['started_at'], a.get('ended_at'), a.get('end_reason'))}")
        if not p.get("allocations"):
            pnode.add(f"GPU: {gap}")

    for wl in result.get("workloads", []):
        prio = f"{wl.get('priority_class') or '?'} ({wl['priority']})" if wl.get("priority") is not None else (wl.get("priority_class") or gap)
        wnode = root.add(f"[bold]workload[/] {wl['workload_id']}  queue={wl.get('queue') or gap} "
                         f"cluster_queue={wl.get('cluster_queue') or gap} priority={prio}")
        wnode.add(f"admitted {wl['admitted_at']}" + (f" ({len(wl['admissions'])} admissions)" if len(wl["admissions"]) > 1 else "")
                  if wl.get("admitted_at") else f"admission: {gap}")
        for ev in wl.get("preemptions", []) + wl.get("evictions", []):
            by = f" by {ev['preemptor']}" if ev.get("preemptor") else ""
            wnode.add(f"[yellow]{ev['event_type'].split('.', 1)[1]}[/] {ev['occurred_at']}{by}" + (f"  {ev['reason']}" if ev.get("reason") else ""))
        for key in wl.get("pods", []):
            if key in pods:
                add_pod(wnode, key)
    loose = [k for k, p in pods.items() if not any(k in wl.get("pods", []) for wl in result.get("workloads", []))]
    if loose:
        lnode = root.add("pods without a known workload")
        for key in loose:
            add_pod(lnode, key)
    if result.get("gpus"):
        gnode = root.add("[bold]GPUs[/]")
        for g in result["gpus"]:
            gg = gnode.add(f"{g['node']}/{g['gpu_id']}")
            for a in g["allocations"]:
                gg.add(f"{a['namespace']}/{a['pod']}  {_span(a['started_at'], a.get('ended_at'), a.get('end_reason'))}")
            for a in g.get("others_in_window", []):
                gg.add(f"[yellow]also[/] {a['namespace']}/{a['pod']}  {_span(a['started_at'], a.get('ended_at'), a.get('end_reason'))}"
                       + (f"  workload={a['workload_id']}" if a.get("workload_id") else ""))
    win = result.get("window") or {}
    if result.get("scheduler_events"):
        snode = root.add(f"[bold]scheduler events[/]  (other workloads on these nodes: {win.get('from')} → {win.get('to')})")
        for ev in result["scheduler_events"]:
            who = ev.get("workload_id") or (f"{ev.get('namespace')}/{ev.get('pod')}" if ev.get("pod") else "?")
            line = f"{ev['occurred_at']}  {ev['event_type']}  {who}" + (f" on {ev['node']}" if ev.get("node") else "")
            line += (f" by {ev['preemptor']}" if ev.get("preemptor") else "") + (f"  {ev['reason']}" if ev.get("reason") else "")
            snode.add(line + ("" if ev["in_chain"] else "  [dim](other workload)[/]"))
    if result.get("alerts"):
        anode = root.add("[bold]alerts[/]")
        for a in result["alerts"]:
            mark = "" if a["in_chain"] else "  [dim](other alert in the window)[/]"
            where = f" on {a['node']}" if a.get("node") else ""
            anode.add(f"{a['occurred_at']}  {a.get('alertname', '?')} ({a.get('severity') or '-'}) {a['status']}{where}{mark}")
    if result.get("gaps"):
        gaps = root.add("[red]gaps[/]")
        for g in result["gaps"]:
            gaps.add(f"[red]{g}[/]")
    return root
