"""The audit: the evidence report of the eight controls for a time range (``gpuledger audit``).

Input: the store (read-only, through ``sinks.read.query.open_reader`` — the worker's loopback
endpoint when it owns the embedded store), a time range and a policy. Output: per
control its status with counts and the violations in the range, plus the evidence each
control asks for (DESIGN.md "Controls"; docs/controls.md), as a table, JSON or one
self-contained HTML file (``templates/audit.html.j2``, the layout and stylesheet of the
incident report). The command (``gpuledger/cli/audit.py``) exits 0 when every exercised
control passes, 1 when one fails (so it can gate a pipeline), 2 for bad options or policy,
3 when the store cannot be read, 4 when there is nothing to audit (no control was
exercised in the range: an empty store, a quiet range, the wrong database).

One source of truth: the verdicts are the violations the worker's controls *recorded*
(the ``violations`` table, each with the policy version it was judged under); the
audit does not judge again. Every evidence row is a fact read from the store (the
workload, the approval events, the actions with their actors…) beside the recorded
violations that cite it — "no violation recorded" where none does. A control is
PASS only when it was exercised (something it checks happened in the range),
NOT EXERCISED otherwise, NO EVENTS when the range holds no event at all.

``--reevaluate`` is the other, labelled mode: the controls are re-run over the stored
history with the given policy (``streams.controls.rules.ControlEngine``, watermark at
``--to``) and those violations take the recorded ones' place — "what would this policy
have said", never the record.

Limits: history older than ``--lookback`` before ``--from`` is not read (release
lifecycle is always read in full); at most ``MAX_ROWS`` rows per table (the report
says when it was truncated). The JSON lists every evidence row; the table and HTML show
``LIST_LIMIT`` rows of a section, violations, denials and waits first (``shown_rows``), and
say what they left out. Descriptive columns (business priorities, quality alerts,
the last environment as "prod") use the given policy, not the one a violation was
judged under.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from datetime import datetime, timedelta

from gpuledger.timefmt import TimeFormatError, at_store_precision, format_duration, parse_duration, parse_time
from sinks.correlated import IDENTITY_FIELDS
from schemas.release import actor_text, decision_actor
from sinks.migrations import table_name
from sinks.read.replayed import after_end, ended_by_deletion, no_approval, note as replay_note, replayed
from sinks.read.pages import render_page
from sinks.read.text import markup
from sinks.read.decisions import check_state, decision_status, is_dry_run, wait_run
from sinks.read.trace import Store, ch_time, deferral_links, parse_instant, time_before
from streams.controls.policy import ACTION_OF_EVENT, CONTROL_NAMES, CONTROL_TITLES, Policy
from streams.controls.rules import START, TERMINAL, ControlEngine, first_ending, compact_row, directory_from_rows, is_withdrawn, peak_concurrency, preemption_clusters

MAX_ROWS = 200_000
LIST_LIMIT = 25
QUEUE_ENTRY = ("scheduler.submitted", "scheduler.queued", "scheduler.quota_reserved", "scheduler.admitted", "scheduler.scheduled")
IDENTITY_COLUMNS = tuple(IDENTITY_FIELDS)
FORMATS = ("table", "json", "html")
#: Exit codes of ``gpuledger audit`` (docs/operations.md).
EXIT_PASS, EXIT_FAIL, EXIT_NOTHING = 0, 1, 4


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

VIOLATION_READ = ("violation_id", "version", "control_id", "title", "severity", *IDENTITY_COLUMNS, "evidence", "accountable_owner",
                  "opened_at", "closed_at", "detail", "policy_version")


def load_history(reader, database: str, start: datetime, end: datetime, lookback: timedelta, cluster: str | None = None) -> dict:
    """Latest versions of the correlated rows and allocations the evidence needs, how many
    events the range holds, and the violations the worker recorded over the range."""
    store = Store(reader, database, cluster)
    params = {"to": ch_time(end), "since": ch_time(time_before(start, lookback)), "from": ch_time(start)}
    columns = ("correlation_id", "version", "event_type", "occurred_at", "attribution", *IDENTITY_COLUMNS, "release_state", "payload_json",
               "source_topic", "source_partition", "source_offset", "named_release_id", "environment_labelled")
    # Rows of one instant in the order they were published (a workload's queue entry among its
    # submission, quota reservation and admission in one whole second was picked by correlation id).
    raw = store.latest("correlated_events", columns,
                       "occurred_at <= {to:DateTime64(3)} AND (startsWith(event_type, 'release.') OR "
                       "(occurred_at >= {since:DateTime64(3)} AND NOT startsWith(event_type, 'gpu.')))",
                       params, order="occurred_at, source_topic, source_partition, source_offset, correlation_id", limit=MAX_ROWS)
    rows = [{"correlation_id": r["correlation_id"], "version": int(r["version"]), "event_type": r["event_type"],
             "occurred_at": r["occurred_at"], "attribution": r["attribution"], "release_state": r.get("release_state") or None,
             "identity": {k: r[k] for k in IDENTITY_COLUMNS if r.get(k)}, "payload_json": r.get("payload_json") or "{}",
             "source": (r["source_topic"], int(r["source_partition"]), int(r["source_offset"])),
             # What the controls judge by beyond the identity (control 3's named release, whose
             # environment control 1 judges in), as the worker's controls read them from the topic:
             # '' and NULL in a row stored before migration 7 — judged as a worker's before them.
             "named_release_id": r.get("named_release_id") or None, "environment_labelled": r.get("environment_labelled")} for r in raw]
    # Whether a release event describes a row's release (``CorrelatedEvent.release_known``, not a column: control 6
    # counts an alert naming a release no event describes as unjoined) — as the worker's directory had them by --to.
    described = {r["identity"].get("release_id") for r in rows if r["event_type"].startswith("release.")}
    for r in rows:
        if (rid := r["identity"].get("release_id")) and not r["event_type"].startswith("release."):
            r["release_known"] = rid in described
    alloc_cols = ("allocation_id", "version", "node", "gpu_id", "namespace", "pod", "release_id", "workload_id", "attribution",
                  "started_at", "ended_at", "end_reason", "start_event_id", "end_event_id")
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
                            "end_reason": None if held_at_end else (a.get("end_reason") or None),
                            "start_event_id": a["start_event_id"], "end_event_id": None if held_at_end else (a.get("end_event_id") or None)})
    # Each row once: its versions share its occurred_at, and counted without FINAL they made two stores
    # with identical tables say 67, 70 and 77 events (exploratory review).
    count_sql = (f"SELECT uniqExact(correlation_id) AS n FROM {{db:Identifier}}.{table_name('correlated_events', cluster)} "
                 f"WHERE occurred_at >= {{from:DateTime64(3)}} AND occurred_at <= {{to:DateTime64(3)}}")
    events = int(reader.query(count_sql, {"db": database, **params}).dicts()[0]["n"])
    recorded_sql = (f"SELECT {', '.join(VIOLATION_READ)} FROM {{db:Identifier}}.{table_name('violations', cluster)} FINAL "
                    f"WHERE opened_at <= {{to:DateTime64(3)}} AND (closed_at IS NULL OR closed_at >= {{from:DateTime64(3)}}) "
                    f"ORDER BY control_id, opened_at, violation_id LIMIT {MAX_ROWS}")
    recorded = [_stored_violation(r) for r in reader.query(recorded_sql, {"db": database, **params}).dicts() if not is_withdrawn(r)]
    # The webhook's deferral of a Kueue-queued Job is recorded under the Job's id (NS/Job/NAME), its
    # Workload's events and AdmissionCheck decisions under the Workload's: the Job id -> that Workload,
    # as of --to, found as the trace finds it (``deferral_links``), so control 1 reads them as one.
    links = deferral_links(store, [{"workload_id": r["identity"]["workload_id"], "event_type": r["event_type"], "payload_json": r["payload_json"]}
                                   for r in rows if r["identity"].get("workload_id")], end)
    # The latest event time in the store, whatever the range: what the worker's event-time watermark
    # reached at most, so what its recorded verdicts can have judged (``build_report``).
    latest_sql = f"SELECT max(occurred_at) AS latest, count() AS n FROM {{db:Identifier}}.{table_name('correlated_events', cluster)}"
    latest = reader.query(latest_sql, {"db": database}).dicts()[0]
    return {"rows": rows, "allocations": allocations, "recorded": recorded, "events_in_range": events, "truncated": sorted(store.truncated),
            "replayed": replayed(reader, database), "latest_event": parse_instant(latest["latest"]) if latest["n"] else None,
            "deferral_links": links}


def _as_of(v: dict, end: datetime) -> dict:
    """The violation as it stood at ``end`` (``--to``, what the controls are evaluated as of): one
    closed after it was open then. The table keeps a violation's latest version only, so its
    detail is the closing one; it is kept, after a note that the closing came later (an owner
    reading "closed … approved at 14:13" in a range ending 14:13:00 read a violation as settled
    within the range)."""
    closed = v["closed_at"]
    if closed is None or closed <= end:
        return v
    return {**v, "closed_at": None, "closed_later_at": closed,
            "detail": f"open at the range's end; closed after it, at {_z(closed)}: {v['detail']}"}


def _stored_violation(r: dict) -> dict:
    return {"violation_id": r["violation_id"], "version": int(r["version"]), "control_id": int(r["control_id"]), "title": r["title"],
            "severity": r["severity"], "identity": {k: r[k] for k in IDENTITY_COLUMNS if r.get(k)}, "evidence": list(r["evidence"]),
            "owner": r.get("accountable_owner") or None, "opened_at": parse_instant(r["opened_at"]),
            "closed_at": parse_instant(r.get("closed_at")), "detail": r["detail"], "policy_version": r.get("policy_version") or ""}


def _model_violation(v) -> dict:
    d = v.model_dump()
    return {**d, "identity": {k: val for k, val in d["identity"].items() if val}, "evidence": list(v.evidence)}


# --- the report ------------------------------------------------------------------------------

def build_report(history: dict, policy: Policy, start: datetime, end: datetime, policy_source: str = "built-in default",
                 reevaluate: bool = False) -> dict:
    """The report over ``[start, end]``: the recorded violations (or, with ``reevaluate``,
    the controls re-run under ``policy`` as of ``end``) beside each control's evidence."""
    # (the range at the store's precision, as its rows were read: ``--from`` with microseconds left out a
    # violation closed in its own millisecond, which the store's read had kept)
    start, end = at_store_precision(start), at_store_precision(end)
    rows = history["rows"]
    directory = directory_from_rows(rows)
    if reevaluate:
        engine = ControlEngine(directory, policy, watermark=end).feed(rows, history["allocations"])
        engine.run()
        judged = [_model_violation(v) for v in engine.current()]
    else:
        judged = history.get("recorded", [])
    in_range = sorted((_as_of(v, end) for v in judged if v["opened_at"] <= end and (v["closed_at"] is None or v["closed_at"] >= start)),
                      key=lambda v: (v["control_id"], v["opened_at"], v["violation_id"]))
    ev = Evidence(history, directory, policy, start, end, in_range)
    # Deadlines are judged on event time: the worker's recorded verdicts cannot have judged one
    # after the latest event it saw (a reservation window that ended in a range no event followed
    # read PASS while held). Re-evaluation judges as of --to.
    latest = history.get("latest_event")
    ev.judged_until = latest if not reevaluate and latest is not None and latest < end else None
    sections = [ev.admission(), ev.promotion(), ev.prod_run(), ev.preemption(), ev.reservations(), ev.telemetry(), ev.authority(),
                ev.retirement()]
    events = history.get("events_in_range", 0)
    controls = [_control_row(cid, in_range, sections[cid - 1], policy, events, start, end) for cid in range(1, 9)]
    failed = any(c["status"] == "FAIL" for c in controls)
    exercised = any(c["status"] in ("PASS", "FAIL") for c in controls)
    versions = sorted({v.get("policy_version") or "unrecorded" for v in in_range})
    return {
        "range": {"from": _z(start), "to": _z(end)},
        "mode": "re-evaluation" if reevaluate else "recorded",
        "verdicts": (f"RE-EVALUATION under {policy_source} ({policy.fingerprint}) — not the recorded verdicts" if reevaluate
                     else "recorded by the worker's controls" + (f", judged under policy {', '.join(versions)}" if versions else "")),
        "policy": policy_source,
        "policy_version": policy.fingerprint,
        "judged_under": versions,
        "events_in_range": events,
        "passed": not failed,
        "outcome": "fail" if failed else ("pass" if exercised else "nothing to audit"),
        "exit_code": EXIT_FAIL if failed else (EXIT_PASS if exercised else EXIT_NOTHING),
        "controls": controls,
        "violations": [_violation_row(v) for v in in_range],
        "evidence": sections,
        "truncated": history.get("truncated", []),
        "notes": ([replay_note(history["replayed"])] if history.get("replayed") else [])
                 + ([said] if (said := after_end(history.get("replayed"), end, "--to")) else [])
                 + ([f"the latest event in the store is at {_z(ev.judged_until)}, before --to: the worker judges deadlines on event time, "
                     f"so one between {_z(ev.judged_until)} and {_z(end)} (a reservation window's end, a grace period) is not judged in "
                     "these recorded verdicts — --reevaluate judges them as of --to"]
                    if any(section.get("unjudged") for section in sections) else []),
    }


#: An evidence row's verdict when no recorded violation cites it.
NO_VIOLATION = "no violation recorded"
#: Control 1's verdict on a workload gpuledger admit denied before it reached a queue.
DENIED = "denied before queue entry (the control enforced; no violation)"
#: Control 1's verdict on a Workload whose AdmissionCheck gpuledger admit set Rejected, not admitted
#: since (Kueue deactivates it): "denied in its queue: …" (``_stop_verdict``).
DENIED_IN_QUEUE = "denied in its queue"
#: Control 1's verdict on a Workload gpuledger admit's AdmissionCheck holds Pending, not admitted
#: since: "waiting in its queue: held by gpuledger admit (rule R) since T — no violation" (``_stop_verdict``).
WAITING = "waiting in its queue"
#: Control 1's verdict on a Job the webhook deferred to its AdmissionCheck when the store holds no
#: Workload, scheduler event or check decision of it: "deferred to its AdmissionCheck: …" (``_decided_only``).
DEFERRED = "deferred to its AdmissionCheck"
#: An evidence row's verdict when its deadline is after the latest event the store holds (``Evidence.judged_until``).
NOT_JUDGED = "not judged yet"
#: A preemption's verdict when a side's business priority is unknown to the policy.
NOT_COMPARED = "the priorities were not compared"
#: A promoted release's ``scheduling_applied`` when none of its prod workloads started in the range.
NO_PROD_WORKLOAD = "no workload in the range"


def _control_row(cid: int, violations: list[dict], section: dict, policy: Policy, events: int, start: datetime, end: datetime) -> dict:
    mine = [v for v in violations if v["control_id"] == cid]
    failing = [v for v in mine if v["severity"] != "info"]
    conf = policy.control(cid)
    if failing:
        status, note = "FAIL", f"{len(failing)} warning/critical violation(s) in the range"
    elif not conf.enabled:
        status, note = "OFF", "disabled in the policy"
    elif events == 0 and not section["subjects"]:
        status, note = "NO EVENTS", f"no events recorded between {_z(start)} and {_z(end)}"
    elif not section["subjects"]:
        status, note = "NOT EXERCISED", f"nothing this control checks happened in the range ({section['exercise']})"
    else:
        status, note = "PASS", f"exercised: {section['subjects']} {section['exercise']}, no warning/critical violation"
        if section.get("uncompared"):
            note += (f"; {section['uncompared']} preemption(s) not compared: a side's business priority is unknown to the policy "
                     "(business_priority.by_priority_class / by_release / by_owner)")
        if section.get("unjudged"):
            note += (f"; {section['unjudged']} deadline(s) after the latest event in the store, not judged yet "
                     "(see the section; --reevaluate judges them as of --to)")
    return {"id": cid, "name": CONTROL_NAMES[cid], "title": CONTROL_TITLES[cid], "status": status, "note": note,
            "violations": len(mine), "open": sum(1 for v in mine if v["closed_at"] is None),
            "closed": sum(1 for v in mine if v["closed_at"] is not None), "info": len(mine) - len(failing),
            "exercised": section["subjects"], "owner": policy.owner_for(cid), "severity": conf.severity}


def _violation_row(v: dict) -> dict:
    ident = v["identity"]
    subject = (ident.get("release_id") or ident.get("workload_id") or ident.get("alert_fingerprint")
               or (f"{ident.get('namespace')}/{ident['pod']}" if ident.get("pod") else ""))
    row = {"control": v["control_id"], "severity": v["severity"], "violation_id": v["violation_id"], "opened_at": _z(v["opened_at"]),
           "closed_at": _z(v["closed_at"]), "owner": v["owner"], "subject": subject, "detail": v["detail"], "evidence": list(v["evidence"]),
           "policy_version": v.get("policy_version") or ""}
    if v.get("closed_later_at") is not None:
        row["closed_after_range_at"] = _z(v["closed_later_at"])
    return row


def _payload(row: dict) -> dict:
    return json.loads(row.get("payload_json") or "{}")


def precedes(decision_at: datetime, mark: datetime) -> bool:
    """A decision at ``decision_at`` came before the object event at ``mark``. Kubernetes
    timestamps (creationTimestamp, condition times) have whole seconds and the API server sets
    creationTimestamp *before* it calls the validating webhooks, so a decision within the
    second of a whole-second mark counts as before it."""
    return decision_at <= mark or (mark.microsecond == 0 and decision_at < mark + timedelta(seconds=1))


def _history_time(entry: tuple) -> datetime | None:
    """When a release directory history entry (``"<time>|<id>", event type, …``) happened."""
    return parse_instant(entry[0].split("|")[0])


def _event_text(entry: tuple, with_id: str | None = None) -> str:
    """A directory history entry as "actor [id] at time" (no actor: said so)."""
    actor = actor_text(entry[4]) or "no actor recorded"
    return f"{actor}{' ' + with_id if with_id else ''} at {_z(_history_time(entry))}"


def _stop_verdict(status: str, first: dict, last: dict) -> str:
    """Control 1's verdict on a workload gpuledger admit stops in its queue (``Evidence._stopped``)
    and no recorded violation cites: the control enforcing, as a denial at the door is — a wait
    is not a refusal (the approval ends it with no resubmission), so it is told apart."""
    rule = _payload(last).get("rule")
    if status == "waiting":
        return f"{WAITING}: held by gpuledger admit (rule {rule}) since {_z(first['occurred_at'])} — no violation"
    return (f"{DENIED_IN_QUEUE}: its AdmissionCheck Rejected by gpuledger admit (rule {rule}) at {_z(last['occurred_at'])} "
            "(the control enforced; no violation)")


def _decision_text(d: dict) -> str:
    """One of gpuledger admit's decisions as control 1 cites it: "decision D at T by rule R (gate
    [check state], mode[, recorded as ID])" — the check state the AdmissionCheck set tells its
    wait (Pending) from its refusal (Rejected); the id is the one it was recorded under when
    that is not the workload's (the webhook's deferral of a queued Job: ``deferral_links``)."""
    p = _payload(d)
    check = check_state(p)
    return (f"decision {p.get('decision')} at {_z(d['occurred_at'])} by rule {p.get('rule')} ({p.get('gate')}{' ' + check if check else ''}, "
            f"{p.get('mode')}{', recorded as ' + d['recorded_as'] if d.get('recorded_as') else ''})")


def _verdict(violations: list[dict]) -> str:
    """What the recorded violations say about one evidence row (nothing more)."""
    if not violations:
        return NO_VIOLATION
    return "; ".join(f"{'open' if v['closed_at'] is None else 'closed ' + _z(v['closed_at'])} {v['violation_id'][:8]} "
                     f"[{v['severity']}]: {v['detail']}" for v in violations)


class Evidence:
    """The evidence each control asks for: one public method per control, (1) to (8),
    each a section (title, summary, columns, rows, and ``subjects``: how many things the
    control checked in the range — its proof of being exercised). Facts come from the
    stored rows; verdicts only from the violations that cite them."""

    def __init__(self, history: dict, directory, policy: Policy, start: datetime, end: datetime, violations: list[dict]) -> None:
        self.rows = sorted(history["rows"], key=lambda r: (parse_instant(r["occurred_at"]), r.get("source", ()), r["correlation_id"]))
        self.allocations = history["allocations"]
        self.directory = directory
        self.policy = policy
        self.start, self.end = start, end
        self.violations = violations
        #: The replay that built the store (``sinks.read.replayed``), None for the live store: an approval
        #: before its range is not in it, a GPU release after its end neither.
        self.replay = history.get("replayed")
        #: The latest event time in the store when it is before ``end`` in a recorded report: a
        #: deadline after it is not judged by the recorded verdicts (``build_report``).
        self.judged_until: datetime | None = None
        self.release_rows = {r["correlation_id"]: r for r in self.rows if r["event_type"].startswith("release.")}
        self.workloads: dict[str, list[dict]] = defaultdict(list)
        self.workload_of: dict[str, str] = {}
        # gpuledger admit's admission.decided, by workload, in time order, each with its status
        # (``sinks.read.decisions``: the trace reads it the same way). The webhook's deferral of a
        # Kueue-queued Job is under the Workload that queues it (``load_history``), keeping the id it
        # was recorded under (``recorded_as``): apart, it was nowhere in the Workload's policy result.
        links = history.get("deferral_links") or {}
        self.decisions: dict[str, list[dict]] = defaultdict(list)
        # Answers to server-side dry runs (kubectl diff, --dry-run=server): nothing was created, so
        # they are no evidence of control 1 — counted in its summary only. Among the decisions, a diffed
        # pod read "never: denied" (the control enforced), and a dry run's allow could be picked as the
        # decision before queue entry of the real object created after it.
        self.dry_runs: list[dict] = []
        for r in self.rows:
            if r["event_type"] == "admission.decided" and is_dry_run(_payload(r)):
                self.dry_runs.append(r)
            elif r["event_type"] == "admission.decided" and (wid := r["identity"].get("workload_id")):
                p = _payload(r)
                d = {**r, "status": decision_status(p.get("decision"), p.get("rule"), check_state(p))}
                if links.get(wid):
                    d["recorded_as"] = wid
                self.decisions[links.get(wid) or wid].append(d)
            if r["event_type"].startswith("scheduler."):
                ident = r["identity"]
                key = ident.get("workload_id") or (f"{ident.get('namespace')}/{ident.get('pod')}" if ident.get("pod") else r["correlation_id"])
                self.workloads[key].append(r)
                self.workload_of[r["correlation_id"]] = key
        self.prod = policy.environments[-1].name

    def _in_range(self, value) -> bool:
        t = parse_instant(value)
        return t is not None and self.start <= t <= self.end

    def _section(self, control: int, title: str, summary: str, columns: list[str], rows: list[dict], subjects: int, exercise: str) -> dict:
        # Every row: the JSON is what automation reads, and a list cut here dropped the evidence
        # itself (control 1's denials come after every workload that entered a queue). The table
        # and HTML cap what they show (``shown_rows``); "more" stays, 0, for readers of the JSON
        # that checked it for a cut list.
        return {"control": control, "title": title, "summary": summary, "columns": columns, "rows": rows,
                "more": 0, "subjects": subjects, "exercise": exercise}

    def _of(self, control: int) -> list[dict]:
        return [v for v in self.violations if v["control_id"] == control]

    def _citing(self, control: int, ids, first_only: bool = False) -> list[dict]:
        """The recorded violations of ``control`` whose evidence names one of ``ids``
        (``first_only``: as their first, the event the violation is about)."""
        ids = set(ids)
        return [v for v in self._of(control) if (v["evidence"][:1] if first_only else v["evidence"]) and
                ids & set(v["evidence"][:1] if first_only else v["evidence"])]

    def _cited_workloads(self, control: int) -> set[str]:
        return {self.workload_of[e] for v in self._of(control) for e in v["evidence"] if e in self.workload_of}

    def _approvals_before(self, rid: str, at: datetime) -> list[str]:
        """Every release.approved of ``rid`` up to ``at``, as facts (actor, approval id, time)."""
        state = self.directory.releases.get(rid)
        out = []
        for h in state["history"] if state else []:
            if h[1] == "release.approved" and _history_time(h) <= at:
                p = _payload(self.release_rows.get(h[2], {}))
                out.append(_event_text(h, p.get("approval_id")) + (f" for {h[3]}" if h[3] else ""))
        return out

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
        out, flagged, entered = [], 0, 0
        cited = self._cited_workloads(1)
        for wid, rows in sorted(self.workloads.items()):
            entry = next((r for r in rows if r["event_type"] in QUEUE_ENTRY), None) or (rows[0] if wid in cited else None)
            stopped = self._stopped(wid, rows) if entry is not None else None
            # A Workload queued before --from that the AdmissionCheck holds as of --to, or rejected
            # inside the range, is control 1 at work in the range: it was listed nowhere (its queue
            # entry is outside the range, and the store has its scheduler events, so it is not
            # among the decided-only ones either).
            stopped_here = stopped is not None and (stopped[0] == "waiting" or self._in_range(stopped[2]["occurred_at"]))
            entering = entry is not None and (self._in_range(entry["occurred_at"]) or wid in cited)
            if not (entering or stopped_here):
                continue
            entered += entering
            rid = entry["identity"].get("release_id") or self._release_of(rows)
            approvals = self._approvals_before(rid, parse_instant(entry["occurred_at"])) if rid else []
            mine = self._citing(1, [r["correlation_id"] for r in rows])
            flagged += bool(mine)
            out.append({"workload": wid, "release": rid or "no release identity", "environment": entry["identity"].get("environment") or "",
                        "queue_entry": _z(entry["occurred_at"]), "entry_event": entry["event_type"],
                        "policy_result": self._policy_result(wid, rows, entry, stopped),
                        "approvals": "; ".join(approvals) or ("" if not rid else no_approval(self.replay, "queue entry")),
                        # (a recorded violation is the verdict whatever admit decided: the record, not our reading of it)
                        "verdict": _verdict(mine) if mine or stopped is None else _stop_verdict(*stopped)})
        decided = self._decided_only()
        listed = out + decided
        door = sum(1 for r in listed if r["verdict"] == DENIED)
        rejected = sum(1 for r in listed if r["verdict"].startswith(DENIED_IN_QUEUE + ":"))
        waiting = sum(1 for r in listed if r["verdict"].startswith(WAITING + ":"))
        deferred = sum(1 for r in listed if r["verdict"].startswith(DEFERRED + ":"))
        return self._section(1, "Approved identity before queue entry",
                             f"{entered} workload(s) entering a queue in the range; {flagged} with a control 1 violation "
                             f"({len(self._of(1))} violation(s)); {door} denied before queue entry by gpuledger admit; {rejected} denied "
                             f"in their queue (AdmissionCheck Rejected) and {waiting} waiting in their queue (AdmissionCheck Pending) "
                             "by gpuledger admit" + (f"; {deferred} deferred to their AdmissionCheck by the webhook with no Workload or "
                                                     "check decision in the store" if deferred else "") +
                             (f"; {dry} server-side dry run(s) answered (kubectl diff, --dry-run=server: nothing created, not counted)"
                              if (dry := sum(1 for r in self.dry_runs if self._in_range(r["occurred_at"]))) else ""),
                             ["workload", "release", "environment", "queue_entry", "entry_event", "policy_result", "approvals", "verdict"],
                             listed, len(listed), "workload(s) entering a queue, or denied or held by gpuledger admit")

    def _stopped(self, wid: str, rows: list[dict]) -> tuple[str, dict, dict] | None:
        """How gpuledger admit's AdmissionCheck stops the workload as of the range's end, when it
        does and nothing among ``rows`` (its scheduler rows) started it since: ``("waiting", first,
        last)`` — its last decisions hold it Pending in its queue, since the first of that run —
        or ``("denied", last, last)`` — its last set the check Rejected. A ``deny`` the check left
        Pending is a wait, not a refusal: it read "denied" like the webhook's. A webhook's denial
        is not one of these: it refuses an object's creation (``_decided_only``)."""
        decisions = self.decisions.get(wid, [])
        held = wait_run(decisions, lambda d: d["status"])
        if held is not None:
            status, (first, last) = "waiting", held
        elif decisions and decisions[-1]["status"] == "denied" and check_state(_payload(decisions[-1])) == "Rejected":
            status, first, last = "denied", decisions[-1], decisions[-1]
        else:
            return None
        since = parse_instant(first["occurred_at"])
        if any(r["event_type"] in START and precedes(since, parse_instant(r["occurred_at"])) for r in rows):
            return None  # (admitted after all: its allow was not recorded, or no longer needed)
        if status == "waiting" and any(r["event_type"] in TERMINAL and precedes(since, parse_instant(r["occurred_at"])) for r in rows):
            return None  # (deleted or finished while held: it waits no more — it read "waiting" for as long as the lookback held it)
        return status, first, last

    def _decided_only(self) -> list[dict]:
        """The workloads gpuledger admit denied or holds, last decided in the range, whose
        scheduler events the store does not have: who tried to run what, when, and why not (they
        were in no section of the audit: it listed the workloads that entered a queue only). The
        webhook's denial: denied before queue entry ("never: denied"). The AdmissionCheck's: a
        Workload in its queue (the check is decided there) held Pending — waiting — or Rejected."""
        out = []
        for wid, decisions in sorted(self.decisions.items()):
            last = decisions[-1]
            if wid in self.workloads or not self._in_range(last["occurred_at"]):
                continue
            stopped = self._stopped(wid, [])
            p = _payload(last)
            # A deferral with nothing after it in the store: handed to the AdmissionCheck, and no Workload
            # queued it, or the check never decided (its controller down: Kueue holds it), or the collector
            # missed it. It was in no row (the trace showed it "deferred").
            deferred = last["status"] == "deferred"
            if stopped is None and p.get("decision") != "deny" and not deferred:
                continue
            ident = last["identity"]
            rid = ident.get("release_id")
            if stopped is not None:
                queue_entry, policy_result, verdict = ("in its queue (no scheduler event in the store)",
                                                       self._stopped_text(wid, *stopped), _stop_verdict(*stopped))
            else:
                who = f" (user {p['user']})" if p.get("user") else ""
                policy_result = f"workload {wid}: {_decision_text(last)}{who}: {p.get('message') or ''}".rstrip(": ")
                queue_entry, verdict = (("deferred (no Workload in the store)", f"{DEFERRED}: by the webhook at {_z(last['occurred_at'])}; "
                                         "the store has no Workload, scheduler event or check decision of it — no violation")
                                        if deferred else ("never: denied", DENIED))
            approvals = self._approvals_before(rid, parse_instant(last["occurred_at"])) if rid and not deferred else []
            out.append({"workload": wid, "release": rid or "no release identity", "environment": ident.get("environment") or "",
                        "queue_entry": queue_entry, "entry_event": "admission.decided", "policy_result": policy_result,
                        "approvals": "; ".join(approvals) or ("" if not rid or deferred else no_approval(self.replay, "the decision")),
                        "verdict": verdict})
        return out

    def _stopped_text(self, wid: str, status: str, first: dict, last: dict, after: str = "") -> str:
        """The policy result of a workload gpuledger admit's AdmissionCheck stops (``_stopped``):
        the webhook's deferral of its Job first, when recorded (it came first), then the check's
        last decision (since when it holds it, for a wait), ``after``, and that decision's message
        — what it waits for, or why it was refused — last, as a denial's is."""
        deferred = "".join(f"{text}; " for text in self._deferrals(wid, last))
        held = f"held in its queue by gpuledger admit since {_z(first['occurred_at'])}: " if status == "waiting" else ""
        message = _payload(last).get("message") or ""
        return f"workload {wid}: {deferred}{held}{_decision_text(last)}{after}: {message}".rstrip(": ")

    def _deferrals(self, wid: str, chosen: dict) -> list[str]:
        """The webhook's deferrals of the workload to its AdmissionCheck (its Job's, recorded under
        the Job's id), beside the decision ``chosen`` for its policy result: "deferred by the
        webhook: decision allow at T by rule deferred-to-admission-check (webhook, …)"."""
        return [f"deferred by the webhook: {_decision_text(d)}" for d in self.decisions.get(wid, [])
                if d["status"] == "deferred" and d is not chosen]

    def _policy_result(self, wid: str, rows: list[dict], entry: dict, stopped: tuple | None = None) -> str:
        """gpuledger admit's decision that let the workload in (``admission.decided``): the
        latest one before its queue entry, else (an AdmissionCheck decides a Workload already
        queued) the latest before its admission — with the waits that held it before (a Pending
        hold later admitted), and the webhook's deferral of its Job. One ``stopped`` (held or
        refused in its queue: ``_stopped``): that decision. Facts only: what was recorded."""
        decisions = self.decisions.get(wid, [])
        if not decisions:
            return "no admission decision recorded (gpuledger admit not enforcing here)"
        entry_at = parse_instant(entry["occurred_at"])
        if stopped is not None:
            return self._stopped_text(wid, *stopped, after=f", after queue entry at {_z(entry_at)}")
        # The webhook's deferral hands the decision to the AdmissionCheck: what let the workload in
        # is the check's decision (the deferral, before queue entry, would be picked at that mark).
        deciding = [d for d in decisions if d["status"] != "deferred"] or decisions
        admitted = next((r for r in rows if r["event_type"] in START), None)
        marks = [(entry_at, "queue entry")] + ([(parse_instant(admitted["occurred_at"]), "admission")] if admitted else [])
        for mark, what in marks:
            before = [d for d in deciding if precedes(parse_instant(d["occurred_at"]), mark)]
            if before:
                d = before[-1]
                gap = mark - parse_instant(d["occurred_at"])
                delta = ("+0s: within the second of a Kubernetes timestamp" if gap < timedelta(0) else
                         f"+{gap.total_seconds() * 1000:.0f}ms" if gap < timedelta(seconds=1) else f"+{format_duration(gap)}")
                head = f"workload {wid}: {_decision_text(d)}, before {what} at {_z(mark)} ({delta})"
                break
        else:
            d = deciding[0]
            head = f"workload {wid}: {_decision_text(d)}, after queue entry at {_z(entry_at)}"
        # A Pending hold the workload was admitted after: the run of waits just before the decision.
        i = next(k for k, x in enumerate(decisions) if x is d)
        held = wait_run(decisions[:i], lambda x: x["status"])
        if held is not None:
            first = next(k for k, x in enumerate(decisions) if x is held[0])
            rules = ", ".join(dict.fromkeys(str(_payload(x).get("rule")) for x in decisions[first:i]))
            head += (f"; held in its queue before it since {_z(decisions[first]['occurred_at'])} (rule {rules}, AdmissionCheck Pending; "
                     f"{i - first} decision(s))")
        return "; ".join([head, *self._deferrals(wid, d)])

    # (2)
    def promotion(self) -> dict:
        cited = {v["identity"].get("release_id") for v in self._of(2)} - {None}
        out, exercised = [], 0
        for rid, state in sorted(self.directory.releases.items()):
            promos = [h for h in state["history"] if h[1] == "release.promoted" and h[3] == self.prod and _history_time(h) <= self.end]
            if (row := self._promotion_row(rid, state, promos, rid in cited)) is not None:
                out.append(row)
                # Exercised in the range: promoted in it, running in prod in it, or cited by a control 2
                # violation in it. A promotion before the range is the row's context only — counted, it
                # made a range with no event at all a PASS, exit 0 (docs/controls.md: NO EVENTS, exit 4).
                exercised += bool(rid in cited or (promos and self._in_range(_history_time(promos[-1])))
                                  or row["scheduling_applied"] != NO_PROD_WORKLOAD)
        flagged = sum(1 for r in out if r["verdict"] != NO_VIOLATION)
        return self._section(2, f"Release approval traced to the scheduling policy applied in {self.prod}",
                             f"{len(out)} release(s) promoted to {self.prod} or cited by control 2; {flagged} with a control 2 "
                             "violation or a control 7 violation on their approval or promotion",
                             ["release", "approvals", "promoted", "state_at_end", "scheduling_applied", "verdict"], out,
                             exercised, f"release(s) promoted to {self.prod} or running where promotion is required")

    def _promotion_row(self, rid: str, state: dict, promos: list, cited: bool) -> dict | None:
        """The release's last promotion to prod (``promos``: its promotions to prod up to the end of
        the range, directory history entries), with the approvals before it and the violations that
        cite the release's promotion."""
        if not promos and not cited:
            return None
        last = promos[-1] if promos else None
        at = _history_time(last) if last else self.end
        approvals = self._approvals_before(rid, at)
        lifecycle = [h[2] for h in state["history"] if h[1] in ("release.approved", "release.promoted")]
        mine = [v for v in self._of(2) if v["identity"].get("release_id") == rid] + self._citing(7, lifecycle, first_only=True)
        promoted = (_event_text(last, _payload(self.release_rows.get(last[2], {})).get("approval_id")) if last
                    else f"no release.promoted to {self.prod} by {_z(self.end)}")
        return {"release": rid, "approvals": "; ".join(approvals) or no_approval(self.replay, "the promotion"), "promoted": promoted,
                # The lifecycle state (a reservation released after a rollback is no state of its own).
                "state_at_end": self.directory.lifecycle_state_as_of(rid, self.end.isoformat()) or "",
                "scheduling_applied": self._scheduling_applied(rid),
                "verdict": _verdict(mine)}

    def _scheduling_applied(self, rid: str) -> str:
        """The queue and priority every prod workload of the release started with in the range."""
        sched = set()
        for _wid, r in self._rows_of_release(rid):
            if r["identity"].get("environment") == self.prod and r["event_type"] in START and self._in_range(r["occurred_at"]):
                q = _payload(r)
                sched.add((q.get("queue") or "", q.get("cluster_queue") or "", q.get("priority_class") or "",
                           "" if q.get("priority") is None else str(q.get("priority"))))
        return "; ".join(f"queue={q} cluster_queue={cq} class={pc} priority={pr} (business "
                         f"{_business_text(self.policy.business_priority.of(rid, None, pc))})" for q, cq, pc, pr in sorted(sched)) or NO_PROD_WORKLOAD

    # (3)
    def prod_run(self) -> dict:
        title = f"One {self.prod} run, scheduler event to artifact manifest"
        checked = sorted(wid for wid, rows in self.workloads.items()
                         if any(r["event_type"] in START and self._in_range(r["occurred_at"])
                                and (r["identity"].get("release_id") or r["identity"].get("model_name")) for r in rows)
                         ) or sorted(self._cited_workloads(3))
        flagged = len(self._of(3))
        counts = f"{len(checked)} workload(s) started with a release or model identity in the range; {flagged} control 3 violation(s)"
        run = self._latest_prod_run()
        if run is None:
            return self._section(3, title, f"{counts}; no {self.prod} run in the range to reconstruct", ["step", "value"], [],
                                 len(checked), "workload start(s) with a release or model identity")
        wid, rows, first = run
        rid = first["identity"]["release_id"]
        steps = [{"step": "workload", "value": wid},
                 {"step": "control 3", "value": _verdict(self._citing(3, [r["correlation_id"] for r in rows]))},
                 *self._scheduling_steps(rows), *self._gpu_steps(rows), *self._manifest_steps(rid, first, rows)]
        return self._section(3, title, f"{counts}; reconstructed: workload {wid} of release {rid}", ["step", "value"], steps,
                             len(checked), "workload start(s) with a release or model identity")

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
        # (in a range replay, an interval its pod's deletion ended may have held the GPU past the replay's end:
        # the live store, which has the release, read "held" where the sandbox read an end, unexplained)
        deleted = ended_by_deletion(self.replay)
        return [{"step": "gpu", "value": f"{a['node']}/{a['gpu_id']} {_z(a['started_at'])} → {_z(a['ended_at']) or 'held'}"
                 + (f" ({deleted})" if deleted and a["ended_at"] and a.get("end_reason") == "pod_deleted" else "")}
                for a in self.allocations if f"{a['namespace']}/{a['pod']}" in pods]

    def _manifest_steps(self, rid: str, first: dict, rows: list[dict]) -> list[dict]:
        """The release at admission, its approvals, its manifest and the running image digests."""
        admitted = parse_instant(first["occurred_at"])
        manifest = self.directory.manifest(rid)
        steps = [{"step": "release", "value": f"{rid} (state at admission: {self.directory.state_as_of(rid, admitted.isoformat()) or '?'})"},
                 {"step": "approvals", "value": "; ".join(self._approvals_before(rid, admitted)) or no_approval(self.replay, "admission")}]
        for f in ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref", "owner"):
            steps.append({"step": f"manifest.{f}", "value": manifest.get(f) or "<gap>"})
        running = sorted({d for r in rows for d in (_payload(r).get("image_digests") or [])})
        steps.append({"step": "running images", "value": ", ".join(running) or "no running image digest observed"})
        return steps

    # (4)
    def preemption(self) -> dict:
        bp = self.policy.business_priority
        preemptions = []
        cited = self._cited_workloads(4)
        for wid, rows in sorted(self.workloads.items()):
            by_id = {r["correlation_id"]: r for r in rows}
            for cluster in preemption_clusters(c for r in rows if (c := compact_row(r)) is not None):
                full = [by_id[c["id"]] for c in cluster]
                if self._in_range(full[0]["occurred_at"]) or wid in cited:
                    preemptions.append(self._preemption_row(wid, rows, full))
        overrides = [self._override_row(r) for r in self.rows if r["event_type"] == "release.priority_overridden" and self._in_range(r["occurred_at"])]
        classes = self._priority_classes()
        summary = ("priority classes: " + ", ".join(f"{pc}={_business_text(bp.by_priority_class.get(pc))} ({len(w)} workload(s))"
                                                    for pc, w in sorted(classes.items()))
                   if classes else "no priority classes seen") + (f"; {len(preemptions)} preemption(s), {len(overrides)} override(s); "
                                                                  f"{len(self._of(4))} control 4 violation(s)")
        section = self._section(4, "Priority classes and preemptions with their authority", summary,
                                ["at", "victim", "release", "class", "business", "preemptor", "preemptor_class", "preemptor_business",
                                 "sources", "verdict"], preemptions + overrides, len(preemptions), "preemption(s)")
        # A preemption whose sides' business priorities the policy does not know was not judged:
        # said at the control too (its PASS read as a comparison made).
        section["uncompared"] = sum(1 for row in preemptions if NOT_COMPARED in row["verdict"])
        return section

    def _priority_classes(self) -> dict[str, set]:
        """Priority class → the workloads seen with it in the range."""
        classes: dict[str, set] = defaultdict(set)
        for wid, rows in self.workloads.items():
            for r in rows:
                pc = _payload(r).get("priority_class")
                if pc and self._in_range(r["occurred_at"]):
                    classes[pc].add(wid)
        return classes

    def _preemption_row(self, wid: str, rows: list[dict], cluster: list[dict]) -> dict:
        """One preemption (its rows from every source as one), both sides' business priority, and the violations citing it."""
        bp = self.policy.business_priority
        r = next((x for x in cluster if (_payload(x).get("preemptor") or {}).get("name")), cluster[0])
        q = _payload(r)
        rid = next((x["identity"]["release_id"] for x in cluster if x["identity"].get("release_id")), None)
        pc = q.get("priority_class") or _first_priority_class(rows)
        ref = q.get("preemptor") or {}
        by = f"{ref.get('kind', '')} {ref.get('namespace') or ''}/{ref.get('name') or ref.get('uid') or ''}".strip() if ref else ""
        their = self.workloads.get(f"{ref.get('namespace')}/{ref.get('name')}", []) if ref else []
        their_pc = _first_priority_class(their)
        mine, theirs = bp.of(rid, None, pc), (bp.of(self._release_of(their), None, their_pc) if their else None)
        recorded = self._citing(4, [x["correlation_id"] for x in cluster])
        verdict = _verdict(recorded)
        if not recorded and (mine is None or theirs is None):
            verdict += "; business priority unknown for " + " and ".join(
                side for side, value in (("the victim", mine), ("the preemptor", theirs)) if value is None) + f": {NOT_COMPARED}"
        sources = ", ".join(f"{x['event_type']} ({_payload(x).get('object_kind') or 'object'})" for x in cluster)
        return {"at": _z(cluster[0]["occurred_at"]), "victim": wid, "release": rid or "", "class": pc or "",
                "business": _business_text(mine), "preemptor": by or "unknown", "preemptor_class": their_pc or "",
                "preemptor_business": _business_text(theirs) if ref else "", "sources": sources, "verdict": verdict}

    def _override_row(self, r: dict) -> dict:
        p = _payload(r)
        return {"at": _z(r["occurred_at"]), "victim": p.get("target") or "", "release": r["identity"].get("release_id", ""),
                "class": "override", "business": "", "preemptor": f"actor {actor_text(decision_actor(p)) or 'none recorded'}", "preemptor_class": "",
                "preemptor_business": "", "sources": r["event_type"],
                "verdict": f"expires {_z(p.get('expires_at')) or 'never'}; " + _verdict(self._citing(7, [r["correlation_id"]], first_only=True))}

    # (5)
    def reservations(self) -> dict:
        created, released = self._reservation_events()
        out = []
        for (rid, res_id), (row, res) in sorted(created.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
            we = parse_instant(res.get("window_end"))
            if we is not None and we < self.start:
                continue
            out.append(self._reservation_row(rid, res_id, row, res, released.get((rid, res_id))))
        section = self._section(5, "Reservation plan vs. actual utilisation",
                                f"{len(out)} reservation(s) active in the range; {len(self._of(5))} control 5 violation(s)",
                                ["release", "reservation", "gpus", "pool", "window", "reserved_by", "released", "peak_allocated", "gpu_hours",
                                 "utilisation", "verdict"], out, len(out), "reservation(s) active")
        section["unjudged"] = sum(1 for r in out if r["verdict"].startswith(NOT_JUDGED))
        return section

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
        ids = [row["correlation_id"]] + ([rel["correlation_id"]] if rel else [])
        verdict = _verdict(self._citing(5, ids) + self._citing(7, ids, first_only=True))
        if (verdict == NO_VIOLATION and rel is None and we is not None and self.judged_until is not None
                and self.judged_until < we <= self.end):
            verdict = (f"{NOT_JUDGED}: the window ended at {_z(we)}, after the latest event in the store ({_z(self.judged_until)}); "
                       "the worker judges it when an event's time passes it")
        return {"release": rid or "", "reservation": res_id, "gpus": gpus, "pool": res.get("pool") or "",
                "window": f"{_z(ws)} → {_z(we) or 'open'}", "reserved_by": actor_text(decision_actor(_payload(row))) or "no actor recorded",
                "released": _z(rel["occurred_at"]) if rel else "held", "peak_allocated": peak,
                "gpu_hours": f"{used_h:.1f} of {planned_h:.1f}", "utilisation": f"{used_h / planned_h:.0%}" if planned_h else "-",
                "verdict": verdict}

    # (6)
    def telemetry(self) -> dict:
        total, attributed, q_total, q_attr, sample = self._coverage()
        ratio = f"{attributed}/{total} = {attributed / total:.0%}" if total else "no alerts in the range"
        q_ratio = f"{q_attr}/{q_total}" if q_total else "0/0"
        steps = self._sample_steps(sample[1], sample[2]) if sample else []
        return self._section(6, "Alert coverage and a sampled alert joined to scheduling, node and release",
                             f"coverage {ratio} (quality alerts {q_ratio}); {len(self._of(6))} control 6 violation(s)", ["step", "value"], steps,
                             total, "alert episode(s)")

    def _coverage(self) -> tuple[int, int, int, int, tuple | None]:
        """Alert episodes (fingerprint, startsAt) starting in the range: (total, attributed,
        quality total, quality attributed, a sample joined one — the most completely joined (release,
        workload, pod, node, GPU: what the sample shows), a quality alert first among equals; a quality
        alert joined by its model alone was shown with three gaps beside a GPU alert joined whole)."""
        episodes: dict[tuple, list[dict]] = defaultdict(list)
        for r in self.rows:
            if r["event_type"].startswith("alert."):
                episodes[(r["identity"].get("alert_fingerprint"), _payload(r).get("starts_at"))].append(r)
        total = attributed = q_total = q_attr = 0
        sample, sample_rank = None, None
        matcher = self.policy.telemetry.quality_alerts
        for (_fp, starts), rows in sorted(episodes.items(), key=lambda kv: (str(kv[0][1]), str(kv[0][0]))):
            if not self._in_range(starts or rows[0]["occurred_at"]):
                continue
            p = _payload(rows[0])
            quality = matcher.matches(p.get("alertname"), p.get("labels"))
            joined_rows = [r for r in rows if r["attribution"] != "unattributed" or r["identity"].get("release_id")]
            total += 1
            q_total += quality
            if joined_rows:
                attributed += 1
                q_attr += quality
                joined = max(joined_rows, key=_joined_links)  # (the first of the most complete)
                rank = (_joined_links(joined), quality)
                if sample_rank is None or rank >= sample_rank:
                    sample, sample_rank = (quality, joined, p), rank
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
        """Every lifecycle or admin action in the range (and any a control 7 violation in the
        range is about), with its actor and the control 7 violations about it."""
        cited = {v["evidence"][0] for v in self._of(7) if v["evidence"]}
        out = []
        for r in self.rows:
            if r["event_type"] not in ACTION_OF_EVENT or not (self._in_range(r["occurred_at"]) or r["correlation_id"] in cited):
                continue
            p = _payload(r)
            # The actor as judged — proven or "(unauthenticated)", as sections 1, 2 and 5 show it (the
            # payload's bare name read as authorised beside a violation saying it was not).
            actor = actor_text(decision_actor(p))
            out.append({"at": _z(r["occurred_at"]), "action": r["event_type"].split(".", 1)[1], "release": r["identity"].get("release_id", ""),
                        "target": p.get("target") or p.get("to_environment") or "", "actor": actor or "no actor recorded",
                        "roles": ", ".join(self.policy.memberships(decision_actor(p))), "expires": _z(p.get("expires_at")) or "", "reason": p.get("reason") or "",
                        "verdict": _verdict(self._citing(7, [r["correlation_id"]], first_only=True))})
        flagged = sum(1 for r in out if r["verdict"] != NO_VIOLATION)
        return self._section(7, "Lifecycle, containment and rollback actions with their actors",
                             f"{len(out)} action(s); {flagged} with a control 7 violation ({len(self._of(7))} violation(s) in the range)",
                             ["at", "action", "release", "target", "actor", "roles", "expires", "reason", "verdict"], out,
                             len(out), "action(s)")

    # (8)
    def retirement(self) -> dict:
        cited = {v["identity"].get("release_id") for v in self._of(8)} - {None}
        out, exercised = [], 0
        for rid, state in sorted(self.directory.releases.items()):
            ended = first_ending([h for h in state["history"] if h[1] in ("release.retired", "release.revoked") and _history_time(h) <= self.end],
                                 _history_time, lambda h: h[1], lambda h: h[4], self.policy, counted_only=False)
            if ended or rid in cited:
                mine = [v for v in self._of(8) if v["identity"].get("release_id") == rid]
                verdict = _verdict(mine)
                # (a retirement the policy does not count — unproven, with require_for_rights — is never judged: ``Policy.stops``)
                deadline = _history_time(ended) + self.policy.retirement.grace if ended and self.policy.stops(ended[4]) else None
                if (verdict == NO_VIOLATION and deadline is not None and self.judged_until is not None
                        and self.judged_until < deadline <= self.end):
                    # (as control 5's windows: the worker judges the grace period's end on event time)
                    verdict = (f"{NOT_JUDGED}: the grace period ended at {_z(deadline)}, after the latest event in the store "
                               f"({_z(self.judged_until)}); the worker judges it when an event's time passes it")
                out.append({"release": rid, "ended": f"{ended[1].split('.', 1)[1]} by {_event_text(ended)}" if ended else "",
                            "verdict": verdict})
                # Exercised in the range: ended in it, or cited by a control 8 violation in it (one ended
                # before the range is listed, as context; counted, a quiet range passed control 8).
                exercised += bool(rid in cited or (ended and self._in_range(_history_time(ended))))
        flagged = [v for v in self._of(8)]
        section = self._section(8, "Retired releases reconciled to zero capacity",
                                f"{len(out)} retired/revoked release(s); {len({v['identity'].get('release_id') for v in flagged})} still held "
                                f"capacity after the grace period ({len(flagged)} control 8 violation(s), "
                                f"{sum(1 for v in flagged if v['closed_at'] is None)} open)",
                                ["release", "ended", "verdict"], out, exercised, "retired/revoked release(s)")
        section["unjudged"] = sum(1 for r in out if r["verdict"].startswith(NOT_JUDGED))
        return section


def _first_priority_class(rows: list[dict]) -> str | None:
    return next((_payload(x).get("priority_class") for x in rows if _payload(x).get("priority_class")), None)


def _joined_links(row: dict) -> int:
    """How many of the links an alert's sample shows its row has (release, workload, pod, node, GPU)."""
    return sum(1 for k in ("release_id", "workload_id", "pod", "node", "gpu_id") if row["identity"].get(k))


def _business_text(value: int | None) -> str:
    return "unknown" if value is None else str(value)


# --- rendering --------------------------------------------------------------------------------

STATUS_STYLE = {"PASS": "green", "FAIL": "bold red", "OFF": "dim", "NOT EXERCISED": "yellow", "NO EVENTS": "bold yellow"}


def conclusion(report: dict) -> str:
    """The report's last sentence: what its exit code means."""
    if report["outcome"] == "fail":
        return "at least one control fails"
    not_exercised = sum(1 for c in report["controls"] if c["status"] in ("NOT EXERCISED", "NO EVENTS"))
    if report["outcome"] == "pass":
        return "every exercised control passes" + (f" ({not_exercised} not exercised)" if not_exercised else "")
    if report["events_in_range"] == 0:
        return f"nothing to audit: no events recorded between {report['range']['from']} and {report['range']['to']}"
    return f"nothing to audit: no control was exercised between {report['range']['from']} and {report['range']['to']}"


#: The kinds of row an evidence list holds, by verdict, in the order the table and HTML list them (``_attention``).
ROW_KINDS = ("with a recorded violation", "denied by gpuledger admit", "waiting in their queue", "not judged yet (or deferred, no check decision) or not compared",
             "with no violation recorded")


def _attention(row: dict) -> int:
    """The kind of an evidence row, an index into ``ROW_KINDS``, read off its verdict. The order
    is a responder's: what the control caught first (a recorded violation, open or closed: what
    makes it FAIL), then what it stopped (a denial: who tried to run what, and why not), then
    what it holds (a Workload waiting in its queue for an approval: stopped for now, and let
    through once that arrives), then what it has not judged, and last the rows that only show
    it was exercised — the bulk of a busy range, and what a capped list drops. A verdict not
    recognised here counts as a violation: listed first, never the first dropped."""
    verdict = row["verdict"]
    if verdict == DENIED or verdict.startswith(DENIED_IN_QUEUE + ":"):
        return 1
    if verdict.startswith(WAITING + ":"):
        return 2
    if verdict.startswith(NOT_JUDGED) or verdict.endswith(NOT_COMPARED) or verdict.startswith(DEFERRED + ":"):
        return 3  # (a deferral with no check decision: nothing judged it yet)
    if verdict == NO_VIOLATION or verdict.endswith("; " + NO_VIOLATION):  # (a priority override's: "expires T; " before it)
        return 4
    return 0


def shown_rows(section: dict) -> tuple[list[dict], str]:
    """The rows of an evidence section the table and HTML show, and what they say of the rest
    ("" when nothing is left out). A list of subjects (it has a verdict column) is shown in
    ``_attention`` order — in the order the JSON has them within a kind —, its first
    ``LIST_LIMIT`` rows; a reconstruction (control 3's run, control 6's sample: steps) whole,
    in its order."""
    rows = section["rows"]
    if "verdict" not in section["columns"]:
        return rows, ""
    ordered = sorted(rows, key=_attention)
    hidden = ordered[LIST_LIMIT:]
    if not hidden:
        return ordered, ""
    kinds = sorted(Counter(_attention(r) for r in hidden).items())
    return ordered[:LIST_LIMIT], (f"+{len(hidden)} more not shown: {', '.join(f'{n} {ROW_KINDS[k]}' for k, n in kinds)}; "
                                  f"--format json lists all {len(rows)}")


def render_table(report: dict, console) -> None:
    """The report as rich tables (``--format table``); stored text through ``markup``. Every value
    whole: a column too narrow folds its values onto more lines rather than cutting them with
    "…" (at 80 columns every time read "2026-12-…", opened and closed alike)."""
    from rich.table import Column, Table as RichTable

    def Table(*headers: str, **kwargs) -> RichTable:  # noqa: N802 - rich's Table, its columns folding
        return RichTable(*[Column(h, overflow="fold") for h in headers], **kwargs)

    console.print(f"[bold]gpuledger audit[/] {report['range']['from']} → {report['range']['to']}  policy: {markup(report['policy'])} "
                  f"({report['policy_version']})", highlight=False)
    console.print(f"verdicts: {markup(report['verdicts'])}", highlight=False)
    for text in report.get("notes", []):
        console.print(f"[bold yellow]note:[/] {markup(text)}", highlight=False)
    summary = Table("control", "status", "violations", "open", "closed", "info", "exercised", "owner", "note", title="Controls")
    for c in report["controls"]:
        summary.add_row(f"{c['id']}. {c['title']}", f"[{STATUS_STYLE[c['status']]}]{c['status']}[/]", str(c["violations"]), str(c["open"]),
                        str(c["closed"]), str(c["info"]), str(c["exercised"]), markup(c["owner"]), markup(c["note"]))
    console.print(summary)
    if report["violations"]:
        vt = Table("ctl", "severity", "opened", "closed", "owner", "policy", "detail", title="Violations in the range")
        for v in report["violations"]:
            vt.add_row(str(v["control"]), v["severity"], v["opened_at"], v["closed_at"] or "open", markup(v["owner"] or ""),
                       markup(v["policy_version"] or "unrecorded"), markup(v["detail"]))
        console.print(vt)
    for sec in report["evidence"]:
        rows, left_out = shown_rows(sec)
        t = Table(*sec["columns"], title=f"({sec['control']}) {sec['title']}", caption=markup(sec["summary"]) + (f" ({left_out})" if left_out else ""))
        for row in rows:
            t.add_row(*["" if row.get(c) is None else markup(row.get(c)) for c in sec["columns"]])
        console.print(t)
    if report["truncated"]:
        console.print(f"[yellow]truncated:[/] {', '.join(report['truncated'])} (more than {MAX_ROWS} rows; narrow the range)")
    style = {"fail": "bold red", "pass": "bold green"}.get(report["outcome"], "bold yellow")
    console.print(f"[{style}]{markup(conclusion(report))}[/]")


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page (``templates/audit.html.j2``)."""
    controls = [{"control": f"{c['id']}. {c['title']}", **c} for c in report["controls"]]
    evidence = []
    for sec in report["evidence"]:
        rows, left_out = shown_rows(sec)
        evidence.append({**sec, "rows": rows, "left_out": left_out})
    return render_page("audit.html.j2", title=f"gpuledger audit {report['range']['from']} – {report['range']['to']}",
                       report=report, controls=controls, evidence=evidence, conclusion=conclusion(report))


def write_report(report: dict, fmt: str, output: str | None, console) -> None:
    """Print the report in ``fmt`` (one of ``FORMATS``) on ``console``/stdout, or write it to ``output``."""
    if fmt == "table":
        if output:
            from rich.console import Console

            with open(output, "w") as handle:
                render_table(report, Console(file=handle, width=200, emoji=False))
        else:
            render_table(report, console)
        return
    text = json.dumps(report, indent=2, default=str) if fmt == "json" else render_html(report)
    if output:
        with open(output, "w") as handle:
            handle.write(text)
    else:
        print(text)
