"""The trace as a tree for people: what ``gpuledger trace`` prints in a terminal.

Input: the dict ``sinks.read.trace.trace`` returns. Output: a rich ``Tree`` — the
release with its manifest, approvals, promotions and lifecycle; workloads with their
admissions, preemptions and pods; pods with their GPUs; GPUs with who else held them;
scheduler events and alerts in the window; and the gaps — missing links in red.
``tree_text`` turns it into plain text (the incident report shows it beside the timeline).
Guarantees: every value read from the store is shown through ``sinks.read.text.markup``,
so control and bidi characters are visible escapes and stored text cannot inject markup.
"""

from __future__ import annotations

import io

from rich.tree import Tree

from sinks.read.decisions import wait_run
from sinks.read.text import markup as m

GAP = "[red]<gap>[/]"
#: Manifest fields a release may lack without a gap (``sinks.read.trace._release_section`` lists the required ones).
OPTIONAL_FIELDS = frozenset({"dataset_ref", "environment"})
RELEASE_FIELDS = ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref", "owner", "environment")


def _or_gap(value) -> str:
    return m(value) if value else GAP


def _span(start, end, reason=None) -> str:
    return f"{m(start)} → {m(end) if end else 'held'}" + (f" ({m(reason)})" if reason and end else "")


def _interval(a: dict) -> str:
    """A GPU interval: its span and why it ended (a range replay's note on one its pod's deletion ended)."""
    return _span(a["started_at"], a.get("ended_at"), a.get("end_note") or a.get("end_reason"))


def render_tree(result: dict) -> Tree:
    """The trace as a rich tree; missing links in red."""
    entry = result.get("entry") or {}
    root = Tree(_title(result, entry))
    for text in result.get("warnings", []):  # (before the chain: what it cannot answer, a sandbox asked after its end)
        root.add(f"[bold red]warning: {m(text)}[/]")
    win = result.get("window") or {}
    if win.get("to") and win.get("from") == win.get("to"):  # (--window 0)
        root.add("[dim]no window (--window 0): only the chain's own rows" + (f" as of {m(entry['at'])}" if entry.get("at") else "") + "[/]")
    elif win.get("to"):
        root.add(f"[dim]window {m(win.get('from'))} → {m(win.get('to'))} (anchored on {m(win.get('anchor'))}): other workloads, "
                 "alerts and GPU holders on the chain's nodes; the chain's own rows: all" + (f" as of {m(entry['at'])}" if entry.get("at") else "") + "[/]")
    if entry.get("other_releases"):
        # (``--model``: the chain is the model's most recently active release; the others were only in the JSON)
        root.add(f"other releases of model {m(entry.get('value', '').partition(':')[0])}, most recently active first (trace one with --release): "
                 + ", ".join(m(r) for r in entry["other_releases"]))
    _add_release(root, result.get("release"), entry)
    pods = {f"{p['namespace']}/{p['pod']}": p for p in result.get("pods", [])}
    _add_workloads(root, result.get("workloads", []), pods)
    _add_gpus(root, result.get("gpus", []))
    _add_scheduler_events(root, result.get("scheduler_events", []), result.get("window") or {})
    _add_alerts(root, result.get("alerts", []))
    _add_violations(root, result.get("violations", []), entry)
    if result.get("gaps"):
        gaps = root.add("[red]gaps[/]")
        for g in result["gaps"]:
            gaps.add(f"[red]{m(g)}[/]")
    return root


def _title(result: dict, entry: dict) -> str:
    focal = [a for a in result.get("alerts", []) if entry.get("kind") == "alert" and a.get("alert_fingerprint") == entry.get("value")]
    if focal:
        a = focal[-1]
        started = a.get("starts_at") or a["occurred_at"]
        # (a resolved alert's time is when it resolved — its startsAt read as one, at 3 a.m.)
        when = (f"at {m(a.get('ends_at') or a['occurred_at'])}, firing since {m(started)}" if a["status"] == "resolved"
                else f"at {m(started)}")
        title = (f"[bold]alert[/] {m(a.get('alertname', '?'))} ({m(a.get('severity') or 'no severity')}) {m(a['status'])} "
                 f"{when} (fingerprint {m(a['alert_fingerprint'])})")
    else:
        title = f"[bold]trace[/] --{m(entry.get('kind'))} {m(entry.get('value'))}"
    title += f"  [dim]as of {m(entry['at'])}[/]" if entry.get("at") else ""
    return title + ("" if entry.get("root") else "  [red]matches nothing[/]")


def _add_release(root: Tree, rel: dict | None, entry: dict) -> None:
    if not rel:
        if entry.get("kind") in ("alert", "release", "model") or entry.get("root"):
            root.add(f"release: {GAP}")
        return
    lifecycle = rel.get("lifecycle_state")
    node = root.add(f"[bold]release[/] {m(rel['release_id'])}  state={_or_gap(rel.get('state'))}" +
                    (f" since {m(rel['state_since'])}" if rel.get("state_since") else "") +
                    # (when the latest event is not of the lifecycle — a reservation, a pause —: the lifecycle's too)
                    (f"  lifecycle={m(lifecycle)} since {m(rel['lifecycle_since'])}" if lifecycle and lifecycle != rel.get("state") else "") +
                    (f"  [yellow]replaced by {m(rel['replaced_by']['by'])} at {m(rel['replaced_by']['occurred_at'])}[/]" if rel.get("replaced_by") else ""))
    for field in RELEASE_FIELDS:
        # (optional in a manifest: missing is not a gap — the gaps list names the required ones)
        node.add(f"{field}: {_or_gap(rel.get(field))}" if field not in OPTIONAL_FIELDS or rel.get(field) else f"{field}: [dim]-[/]")
    approvals = node.add("approvals" if rel.get("approvals") else f"approvals: {GAP}")
    for ap in rel.get("approvals", []):
        approvals.add(f"{m(ap['occurred_at'])}  {m(ap.get('actor', '?'))}  {m(ap.get('approval_id', ''))}")
    if rel.get("promotions"):
        promos = node.add("promotions")
        for pr in rel["promotions"]:
            promos.add(f"{m(pr['occurred_at'])}  → {m(pr.get('to_environment', '?'))} by {m(pr.get('actor', '?'))} {m(pr.get('approval_id', ''))}")
    life = node.add("lifecycle")
    # (what another release's promotion or rollback did to this one, among its own events)
    succession = [{"occurred_at": st["occurred_at"], "line": f"[yellow]{'replaced by' if st['event'] == 'replaced' else 'restored by the rollback of'} "
                   f"{m(st['by'])}[/]" + (f" (promoted to {m(st['to_environment'])})" if st.get("to_environment") else "")}
                  for st in rel.get("succession", [])]
    own = [{"occurred_at": ev["occurred_at"], "line": _lifecycle_line(ev)} for ev in rel.get("lifecycle", [])]
    for ev in sorted(own + succession, key=lambda e: e["occurred_at"]):
        life.add(f"{m(ev['occurred_at'])}  {ev['line']}")


def _lifecycle_line(ev: dict) -> str:
    """One event of the release's own lifecycle: its type and summary, and the reason and target
    the summary leaves out (an isolation's node and "XID 79 on GPU 0", a rollback's reason)."""
    line = f"{m(ev['event_type'])}  {m(ev.get('summary', ''))}"
    summary = ev.get("summary") or ""
    extra = [f"{label} {m(ev[k])}" for k, label in (("target", "target"), ("to_environment", "to"), ("reason", "reason"), ("approval_id", "change"))
             if ev.get(k) and str(ev[k]) not in summary]
    return line + (f"  ({'; '.join(extra)})" if extra else "")


def _add_pod(parent: Tree, key: str, p: dict) -> None:
    pnode = parent.add(f"pod {m(key)}" + (f"  uid={m(p['pod_uid'])}" if p.get("pod_uid") else "") +
                       (f"  nodes={m(','.join(p['nodes']))}" if p.get("nodes") else ""))
    for a in p.get("allocations", []):
        pnode.add(f"GPU {m(a['node'])}/{m(a['gpu_id'])}  {_interval(a)}")
    if not p.get("allocations"):
        pnode.add(f"GPU: {GAP}")


def _status(d: dict) -> str:
    """A decision's status (``sinks.read.trace._admission_decision``); a result without one
    (written before it existed) reads its deny as a denial, as it always did."""
    return d.get("status") or ("denied" if d.get("decision") == "deny" else "allowed")


def _last_denial(wl: dict) -> dict | None:
    """gpuledger admit's last decision on the workload, when it was a denial (not a wait)."""
    decisions = wl.get("admission_decisions") or []
    return decisions[-1] if decisions and _status(decisions[-1]) == "denied" else None


def _deferral(wl: dict) -> dict | None:
    """The webhook's deferral of a queued object, when it is all the store has under this id: its
    Kueue Workload (which ``sinks.read.trace`` attaches it to when found) is not in the store."""
    decisions = wl.get("admission_decisions") or []
    return decisions[-1] if not wl.get("state") and decisions and _status(decisions[-1]) == "deferred" else None


def _wait(wl: dict) -> tuple[dict, dict] | None:
    """(first, last) of the decisions that hold the workload now (``sinks.read.decisions.wait_run``)."""
    return wait_run(wl.get("admission_decisions") or [], _status)


#: What a Workload held Pending waits for, by the rule that holds it (streams.controls.admission):
#: each can still change without a new Workload, which is why the check is Pending, not Rejected.
WAITS_FOR = {
    "unapproved": "until {release} is approved for its environment (gpuledger release approve)",
    "approval-not-entitled": "until {release} is approved by an actor holding the approve right",
    "unknown-release": "until {release} is registered and approved",
    "state-not-loaded": "until gpuledger admit has loaded the release state",
}


def _no_admission(wl: dict) -> str:
    """A workload never admitted: a gap — unless gpuledger admit holds it (its AdmissionCheck
    Pending: it waits, and is admitted when what it waits for arrives) or denied it and nothing
    was let through after, the outcome expected of a denial (it read as a missing link, in red)."""
    if (held := _wait(wl)) is not None:
        first, last = held
        release = f"release {m(wl['release_id'])}" if wl.get("release_id") else "its release"
        until = WAITS_FOR.get(last.get("rule", ""), "until its release's state changes (the decision's message says what it needs)")
        again = f", last decided {m(last['occurred_at'])}" if last is not first else ""
        return (f"[yellow]waiting[/]: held by gpuledger admit since {m(first['occurred_at'])} (rule {m(last.get('rule', '?'))}{again}) — "
                f"its AdmissionCheck is Pending {until.format(release=release)}; the Workload keeps its place in its queue")
    if (d := _deferral(wl)) is not None:
        return (f"[yellow]deferred[/]: let in by gpuledger admit's webhook at {m(d['occurred_at'])} for the AdmissionCheck to decide on its "
                f"Kueue Workload (rule {m(d.get('rule', '?'))}); no Workload in the store carries its uid (label kueue.x-k8s.io/job-uid): "
                "its queue, admission and pods are under that Workload")
    if (d := _last_denial(wl)) is not None:
        how = " — its AdmissionCheck is Rejected (Kueue deactivates the Workload)" if d.get("check_state") == "Rejected" else ""
        return f"[yellow]not admitted[/]: denied by gpuledger admit at {m(d['occurred_at'])} (rule {m(d.get('rule', '?'))}){how}"
    return f"admission: {GAP}"


def _precedes(decision_at: str, mark: str) -> bool:
    """The audit's rule (``sinks.read.audit.precedes``: a Kubernetes time has whole seconds, so a
    decision within the second of one came before it) on the trace's ISO strings — the tree said
    nothing for a decision at .608 above "admitted .000", which the audit's table calls before."""
    from gpuledger.timefmt import as_utc
    from sinks.read.audit import precedes

    return precedes(as_utc(decision_at), as_utc(mark))


def _dry_run_only(wl: dict) -> bool:
    """All the store has of the workload is gpuledger admit's answer to server-side dry runs of it
    (``kubectl diff``, ``--dry-run=server``): nothing was created, so nothing is missing."""
    return not wl.get("state") and not wl.get("admission_decisions") and bool(wl.get("dry_runs"))


def _denied_at_the_door(wl: dict) -> bool:
    """gpuledger admit denied the workload and the scheduler never saw it: its queue, cluster
    queue and priority are nowhere to be found, and that is the denial's outcome, not a gap —
    nor under a deferral's id (they are its Kueue Workload's), nor for a dry run's object."""
    return not wl.get("state") and (_last_denial(wl) is not None or _deferral(wl) is not None or _dry_run_only(wl))


def _add_workloads(root: Tree, workloads: list[dict], pods: dict[str, dict]) -> None:
    for wl in workloads:
        field = (lambda value: m(value) if value else "-") if _denied_at_the_door(wl) else _or_gap
        prio = (f"{m(wl.get('priority_class') or '?')} ({m(wl['priority'])})" if wl.get("priority") is not None
                else field(wl.get("priority_class")))
        wnode = root.add(f"[bold]workload[/] {m(wl['workload_id'])}  queue={field(wl.get('queue'))} "
                         f"cluster_queue={field(wl.get('cluster_queue'))} priority={prio}")
        for d in wl.get("admission_decisions", []):
            before = f", before admission at {m(wl['admitted_at'])}" if wl.get("admitted_at") and _precedes(d["occurred_at"], wl["admitted_at"]) else ""
            # By whom (a deny of the AdmissionCheck controller is a wait when it set the check Pending)
            # and the id it was recorded under (the webhook's deferral of a queued Job names the Job).
            via = ", ".join(v for v in (f"AdmissionCheck {m(d['check_state'])}" if d.get("check_state") else m(d.get("gate") or ""),
                                        f"recorded as {m(d['recorded_as'])}" if d.get("recorded_as") else "") if v)
            gate = f"  [dim]({via})[/]" if via else ""
            wnode.add(f"decision {m(d['decision'])} at {m(d['occurred_at'])} by rule {m(d['rule'])}{before}{gate}")
        for d in wl.get("dry_runs", []):
            via = f", recorded as {m(d['recorded_as'])}" if d.get("recorded_as") else ""
            wnode.add(f"[dim]dry run[/] at {m(d['occurred_at'])}: would be {m(d['decision'])} by rule {m(d['rule'])}  "
                      f"[dim](webhook, server-side dry run: nothing created, not enforcement{via})[/]")
        if _dry_run_only(wl):
            wnode.add("[dim]dry run only[/]: gpuledger admit answered server-side dry runs of it (kubectl diff, --dry-run=server); "
                      "nothing was created")
        else:
            wnode.add(f"admitted {m(wl['admitted_at'])}" + (f" ({len(wl['admissions'])} admissions)" if len(wl["admissions"]) > 1 else "")
                      if wl.get("admitted_at") else _no_admission(wl))
        in_preemption = {c for ev in wl.get("preemptions", []) for c in ev.get("correlation_ids", [])}
        for ev in wl.get("preemptions", []):
            by = (f" by {m(ev['preemptor'])}" if ev.get("preemptor") else
                  f" by Workload uid {m(ev['preemptor_uid'])} (name unknown to the store)" if ev.get("preemptor_uid") else " by an unknown preemptor")
            wnode.add(f"[yellow]preempted[/] {m(ev['occurred_at'])}{by}  [dim]seen by {m(', '.join(ev.get('sources', [])))}[/]")
        for ev in wl.get("evictions", []):
            if ev.get("correlation_id") not in in_preemption:
                # (which pod: a workload's pods evicted together were identical lines)
                who = f" {m(ev['namespace'])}/{m(ev['pod'])}" if ev.get("pod") else ""
                wnode.add(f"[yellow]evicted[/]{who} {m(ev['occurred_at'])}" + (f"  {m(ev['reason'])}" if ev.get("reason") else ""))
        for key in wl.get("pods", []):
            if key in pods:
                _add_pod(wnode, key, pods[key])
    loose = [k for k in pods if not any(k in wl.get("pods", []) for wl in workloads)]
    if loose:
        lnode = root.add("pods without a known workload")
        for key in loose:
            _add_pod(lnode, key, pods[key])


def _add_gpus(root: Tree, gpus: list[dict]) -> None:
    if not gpus:
        return
    gnode = root.add("[bold]GPUs[/]")
    for g in gpus:
        gg = gnode.add(f"{m(g['node'])}/{m(g['gpu_id'])}")
        for a in g["allocations"]:
            gg.add(f"{m(a['namespace'])}/{m(a['pod'])}  {_interval(a)}")
        for a in g.get("others_in_window", []):
            gg.add(f"[yellow]also[/] {m(a['namespace'])}/{m(a['pod'])}  {_interval(a)}"
                   + (f"  workload={m(a['workload_id'])}" if a.get("workload_id") else ""))


def _add_scheduler_events(root: Tree, events: list[dict], win: dict) -> None:
    if not events:
        return
    snode = root.add(f"[bold]scheduler events[/]  (other workloads on these nodes: {m(win.get('from'))} → {m(win.get('to'))})")
    for ev in events:
        # The workload and, for a pod's event, the pod: a workload's pods evicted together were as
        # many identical lines ("scheduler.evicted risk/job-x on n3 …" four times).
        pod = ev.get("pod")
        who = ev.get("workload_id") or (f"{ev.get('namespace')}/{pod}" if pod else "?")
        if ev.get("workload_id") and pod:
            who += f" pod {pod}"
        line = f"{m(ev['occurred_at'])}  {m(ev['event_type'])}  {m(who)}" + (f" on {m(ev['node'])}" if ev.get("node") else "")
        line += (f" by {m(ev['preemptor'])}" if ev.get("preemptor") else "") + (f"  {m(ev['reason'])}" if ev.get("reason") else "")
        snode.add(line + ("" if ev["in_chain"] else "  [dim](other workload)[/]"))


def _add_alerts(root: Tree, alerts: list[dict]) -> None:
    if not alerts:
        return
    anode = root.add("[bold]alerts[/]")
    for a in alerts:
        mark = "" if a["in_chain"] else "  [dim](other alert in the window)[/]"
        where = f" on {m(a['node'])}" + (f"/{m(a['gpu_id'])}" if a.get("gpu_id") else "") if a.get("node") else ""
        # Who it hit and how that was known (an XID's pod and rule were only in the JSON), and the
        # fingerprint to trace it by (--alert).
        hit = ", ".join(p for p in ((f"pod {m(a['namespace'])}/{m(a['pod'])}" if a.get("pod") else ""),
                                    (f"release {m(a['release_id'])}" + (f" ({m(a['release_state'])})" if a.get("release_state") else "")
                                     if a.get("release_id") else ""),
                                    (f"by {m(a['attribution'])}" if a.get("attribution") else "")) if p)
        anode.add(f"{m(a['occurred_at'])}  {m(a.get('alertname', '?'))} ({m(a.get('severity') or '-')}) {m(a['status'])}{where}"
                  + (f"  {hit}" if hit else "") + (f"  [dim]fingerprint {m(a['alert_fingerprint'])}[/]" if a.get("alert_fingerprint") else "") + mark)


def _add_violations(root: Tree, violations: list[dict], entry: dict) -> None:
    """The controls' violations about the chain (``read_violations``): open ones in red."""
    if not violations:
        return
    at = f" as of {m(entry['at'])}" if entry.get("at") else ""
    vnode = root.add(f"[bold]violations[/] of the controls about this chain{at} (gpuledger audit has their evidence)")
    for v in violations:
        state = "[red]open[/]" if v["open"] else f"closed {m(v['closed_at'])}"
        vnode.add(f"control {m(v.get('control_id'))} {m(v.get('title', ''))} ({m(v.get('severity') or '-')}): opened {m(v.get('opened_at'))}, "
                  f"{state} — {m(v.get('detail', ''))}")


def tree_text(tree: Tree, width: int = 140) -> str:
    """A rich Tree (the CLI's trace) as plain text."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, record=True, color_system=None, force_terminal=False, emoji=False)
    console.print(tree)
    return console.export_text()
