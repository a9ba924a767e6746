"""The eight ownership-gap controls as pure functions (no Faust, no Kafka, no ClickHouse).

Input: correlated rows (``CorrelatedEvent``) and GPU allocation intervals
(``GpuAllocation``), the ``ReleaseDirectory`` (every release's manifest and lifecycle
history), the ``Policy`` and an event-time watermark. Output: ``Violation`` records —
each one opened, later re-emitted with ``closed_at`` and ``version + 1`` when it ends.

State is kept per *control key*, a key that never changes between versions of the
rows it holds (so a newer version always lands where the older one is):

| key | holds | evaluates |
|---|---|---|
| ``pod:<ns>/<pod>`` | the pod's scheduler rows and GPU allocation intervals | 3 (running image vs manifest); forwards its rows to its workload and its allocations to their release |
| ``wl:<workload_id>`` | a workload's own rows + its pods' rows (links) | 1, 2, 3 (identifiers), 4 (observation window); forwards running intervals to its releases and preemptions to the preemptor |
| ``rel:<release_id>`` | the release's lifecycle rows + allocations and running intervals (links) | 5, 7, 8 |
| ``alert:<fingerprint>`` | the alert's rows, once one went out unjoined (``streams.correlate.entities.for_controls``) | 6 |
| ``gpu:<node>/<gpu_id>`` | allocation intervals, in changelogs written before allocations were kept by their pod | forwards them to their release |

Allocations and running intervals are forwarded to a release only once its lifecycle
(the directory) makes a control read them (``holdings_read``): a reservation for 5, a
retirement or revocation for 8. Most releases have neither, and carrying every GPU
interval of a busy release in its state made that one state the largest record the
worker wrote, on every commit. Both senders are interested in the release
(``rid:<release_id>``), so the directory change that makes the holdings matter
re-evaluates them and they forward then; the directory only grows, so a forward is never
taken back for this reason.

(A pod without a workload id is its own workload; any key that receives preemptions
from a victim evaluates 4 for the preemptor side.)

Determinism: a key keeps the highest version of every row; a link from another key
is replaced as a whole by that key's latest forward (an empty one retracts it). Each
step re-derives every violation of the key from that state (``evaluate``) and emits
only those whose content changed, with ``version + 1`` (``step``) — so the latest
version of every violation is a function of the topic history and the directory,
whatever order things were processed in. A violation the history no longer supports
(a late approval that predates the admission, say) is *withdrawn*: re-emitted with
``closed_at = opened_at`` and a detail starting ``withdrawn:`` (``is_withdrawn``).

Time: every rule uses event time. Grace periods and windows end on the *watermark*
(the latest event time seen): a deadline that the watermark has not passed yet is
returned in ``Outcome.deadline`` so the caller re-evaluates the key when it has.

Limits: ``MAX_ROWS`` rows per key (oldest dropped; their versions stay in the key's:
``fold_row``), ``MAX_EVIDENCE`` event ids per
violation; preemption rows of one workload less than ``PREEMPTION_CLUSTER`` apart are
one preemption.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import orjson

from streams.caps import capped
from streams.controls.policy import ACTION_OF_EVENT, CONTROL_TITLES, Policy
from streams.packing import kind_of
from gpuledger.timefmt import format_duration, iso_z, quick_utc_isoformat
from schemas import Identity
from schemas.outputs import ALLOCATION_WITHDRAWN, Violation, joined
from schemas.release import actor_text, decision_actor

START = frozenset({"scheduler.admitted", "scheduler.scheduled", "scheduler.running", "scheduler.pods_ready"})
STOP = frozenset({"scheduler.preempted", "scheduler.evicted", "scheduler.finished", "scheduler.deleted", "scheduler.requeued"})
#: Stops after which the object cannot start again (``intervals``: the last of their instant).
TERMINAL = frozenset({"scheduler.finished", "scheduler.deleted"})
SCHEDULER_KEPT = START | STOP
MAX_ROWS = 1000
MAX_DROPPED_IDS = 256
MAX_EVIDENCE = 50
PREEMPTION_CLUSTER = timedelta(minutes=2)
WITHDRAWN = "withdrawn: "

IDENTITY_KEPT = ("release_id", "model_name", "model_version", "image_digest", "environment", "workload_id", "pod_uid", "namespace", "pod",
                 "node", "gpu_id", "owner", "alert_fingerprint")
PAYLOAD_KEPT = {
    "scheduler": ("object_kind", "queue", "cluster_queue", "priority_class", "priority", "reason", "image_digests", "preemptor"),
    "release": ("actor", "on_behalf_of", "authenticated_by", "actor_groups", "approval_id", "to_environment", "reservation", "target", "expires_at", "reason"),
    "alert": ("alertname", "severity", "labels", "starts_at", "ends_at"),
}


# --- time ---------------------------------------------------------------------------

def _t(value) -> datetime:
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc)
    parsed = datetime.fromisoformat(value)
    return parsed.astimezone(timezone.utc) if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def iso(value) -> str | None:
    if value is None:
        return None
    return (isinstance(value, str) and quick_utc_isoformat(value)) or _t(value).isoformat()


def _min(*values):
    present = [v for v in values if v is not None]
    return min(present) if present else None


def digest(obj) -> str:
    return hashlib.blake2b(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS, default=str), digest_size=12).hexdigest()


def violation_id(control: int, *parts: str) -> str:
    return hashlib.sha256("\x1f".join(["gpuledger.control", str(control), *parts]).encode()).hexdigest()[:32]


def is_withdrawn(violation) -> bool:
    detail = violation["detail"] if isinstance(violation, dict) else violation.detail
    return detail.startswith(WITHDRAWN)


# --- inputs -------------------------------------------------------------------------

def _as_dict(record) -> dict:
    return record if isinstance(record, dict) else record.model_dump(mode="json")


def compact_row(record) -> dict | None:
    """The part of a correlated row the controls need, or None when no control reads it."""
    row = _as_dict(record)
    etype = row["event_type"]
    family = etype.split(".", 1)[0]
    if family not in PAYLOAD_KEPT or (family == "scheduler" and etype not in SCHEDULER_KEPT):
        return None
    ident = row.get("identity") or {}
    payload = orjson.loads(row.get("payload_json") or "{}")
    kept = {k: payload[k] for k in PAYLOAD_KEPT[family] if payload.get(k) not in (None, "", [], {}, ())}
    for k in ("starts_at", "ends_at", "expires_at"):
        if k in kept:
            kept[k] = iso(kept[k])
    res = kept.get("reservation")
    if isinstance(res, dict):
        kept["reservation"] = {**res, "window_start": iso(res.get("window_start")), "window_end": iso(res.get("window_end"))}
    out = {"id": row["correlation_id"], "v": int(row["version"]), "type": etype, "at": iso(row["occurred_at"]), "attr": row["attribution"],
           "i": {k: ident[k] for k in IDENTITY_KEPT if ident.get(k)}, "p": kept}
    if row.get("named_release_id"):
        out["named"] = row["named_release_id"]  # a label named this unknown release; a fallback rule attributed the row
    if row.get("environment_labelled") is not None:
        out["el"] = bool(row["environment_labelled"])  # the environment is the row's own (True) or its release's (``_approval_environment``)
    if row.get("release_known") is False:
        out["unknown"] = True  # its release_id is one no release event describes: not joined (``_telemetry``)
    return out


def compact_allocation(record) -> dict:
    a = _as_dict(record)
    ident = a.get("identity") or {}
    out = {"id": a["allocation_id"], "v": int(a["version"]), "node": a["node"], "gpu_id": a["gpu_id"], "pod": f"{a['namespace']}/{a['pod']}",
           "rid": ident.get("release_id"), "wid": ident.get("workload_id"), "attr": a.get("attribution"), "start": iso(a["started_at"]),
           "end": iso(a.get("ended_at")), "se": a["start_event_id"], "ee": a.get("end_event_id")}
    if a.get("end_reason") == ALLOCATION_WITHDRAWN:
        out["w"] = 1  # a tombstone (``streams.correlate.entities._withdraw``): ``fold_row`` keeps it as one
    return out


def row_key(row: dict) -> str:
    """The control key of a compact correlated row (invariant across its versions)."""
    family = row["type"].split(".", 1)[0]
    ident = row["i"]
    if family == "release":
        return f"rel:{ident.get('release_id')}"
    if family == "alert":
        return f"alert:{ident.get('alert_fingerprint') or row['id']}"
    if ident.get("namespace") and ident.get("pod"):
        return f"pod:{ident['namespace']}/{ident['pod']}"
    if ident.get("workload_id"):
        return f"wl:{ident['workload_id']}"
    return f"uid:{ident.get('pod_uid') or row['id']}"


def allocation_key(alloc: dict) -> str:
    """An allocation is kept by its pod's key (it never changes between the allocation's versions)."""
    return f"pod:{alloc['pod']}"


# --- state --------------------------------------------------------------------------

def new_state(key: str) -> dict:
    return {"key": key, "rows": {}, "links": {}, "emitted": {}, "fwd": {}}


def _drop_order(row: dict) -> tuple:
    """What ``fold_row`` drops by past ``MAX_ROWS`` (the least first): closed allocations
    before open ones (an open one still holds a GPU), then the oldest."""
    return row.get("end", "") is None, row.get("at") or row.get("start"), row["id"]


def fold_row(state: dict, row: dict) -> bool:
    """Keep the highest version of a row (correlated row or allocation); False if older/equal.

    Past ``MAX_ROWS`` the least (``_drop_order``) go, and their versions stay in the key's version
    (``state["dropped"]``: their sum, and the ids of the last ``MAX_DROPPED_IDS`` with theirs — one
    that comes back counts once), so dropping a row lowers no violation's version: the latest
    version stays a function of the history, not of when the drop happened. A row that would go at
    once — one seen again after it went (a re-delivery), or one older than every row the key keeps
    — is not kept and not counted (counted, a re-delivery would raise every violation's version)."""
    rows = state["rows"]
    incoming = row["v"]
    if row.get("w"):
        # A withdrawn allocation (``compact_allocation``): kept at its version (``wv``: an older version of
        # it re-delivered stays out) but counted as none in the key's version (``key_version``) — a run that
        # read the holding's events in order never had it, and the violations' versions would differ by
        # order. It comes in one message with the allocation that replaced it (``Correlator._emit``), whose
        # version is higher than the one it had (the same device's reports, and more): the key's version
        # grows, and ends as that run's.
        row = {**row, "v": 0, "wv": incoming}
    current = rows.get(row["id"])
    if current is not None and current.get("wv", current["v"]) >= incoming:
        return False
    if current is None and len(rows) >= MAX_ROWS and _drop_order(row) < min(map(_drop_order, rows.values())):
        capped("control_rows_dropped", 1, state["key"], _dropped_text())
        return False
    dropped = state.get("dropped")
    if current is None and dropped and row["id"] in dropped["ids"]:
        dropped["v"] -= dropped["ids"].pop(row["id"])  # back: counted once, at its new version
    rows[row["id"]] = row
    if len(rows) > MAX_ROWS:
        gone = sorted(rows.values(), key=_drop_order)[: len(rows) - MAX_ROWS]
        dropped = state.setdefault("dropped", {"v": 0, "ids": {}})
        for old in gone:
            del rows[old["id"]]
            dropped["v"] += old["v"]
            dropped["ids"][old["id"]] = old["v"]
        while len(dropped["ids"]) > MAX_DROPPED_IDS:
            del dropped["ids"][next(iter(dropped["ids"]))]
        capped("control_rows_dropped", len(gone), state["key"], _dropped_text())
    return True


def _dropped_text() -> str:
    return f"its oldest rows dropped past {MAX_ROWS:,} (MAX_ROWS)"


def fold_link(state: dict, source: str, link: dict) -> bool:
    """Keep the highest version of the link from ``source`` (an empty link — only its
    version — retracts what the source sent before)."""
    current = state["links"].get(source)
    if current is not None:
        if link.get("v", 0) < current.get("v", 0) or current == link:
            return False
        if link.get("v", 0) == current.get("v", 0) and digest(link) <= digest(current):
            return False
    state["links"][source] = link
    return True


def max_time(state: dict) -> str | None:
    """The latest event time a key holds (to rebuild a watermark after a restart)."""
    times = [t for r in state["rows"].values() for t in (r.get("at"), r.get("start"), r.get("end")) if t]
    return max(times, key=_t) if times else None


# --- evaluation context ---------------------------------------------------------------

class Release:
    """One release's lifecycle as the directory has it, with times parsed."""

    def __init__(self, directory, rid: str) -> None:
        state = directory.releases.get(rid) if rid else None
        self.rid = rid
        self.history = [(_t(k.split("|", 1)[0]), etype, eid, env, actor) for k, etype, eid, env, actor in (state["history"] if state else [])]
        self.manifest = directory.manifest(rid) if state else {}
        self.known = bool(self.history)
        self.first_seen = self.history[0][0] if self.history else None
        self.event_types: frozenset | None = None  # computed by holdings_read when first asked


HOLDINGS_READ_BY = {"allocs": (("release.reservation_created", 5), ("release.retired", 8), ("release.revoked", 8)),
                    "running": (("release.retired", 8), ("release.revoked", 8))}


def holdings_read(ctx: "Context", rid: str, what: str) -> bool:
    """Whether a control of release ``rid`` reads its ``what`` ("allocs": GPU allocations,
    read by 5 for a reservation and 8 after a retirement or revocation; "running": running
    intervals, read by 8), judged from the directory's lifecycle of the release and the policy."""
    rel = ctx.release(rid)
    if rel.event_types is None:
        rel.event_types = frozenset(etype for _at, etype, *_ in rel.history)
    return any(etype in rel.event_types and ctx.policy.control(control).enabled for etype, control in HOLDINGS_READ_BY[what])


class Clock:
    """The event-time watermark; remembers the deadlines it has not reached yet."""

    def __init__(self, watermark: datetime | None) -> None:
        self.watermark = watermark
        self.deadlines: list[datetime] = []
        self.passed_count = 0  # deadlines found passed: a version component

    def passed(self, at: datetime) -> bool:
        if self.watermark is not None and at <= self.watermark:
            self.passed_count += 1
            return True
        self.deadlines.append(at)
        return False

    def reached(self, at: datetime | None) -> datetime | None:
        """``at`` once the watermark passed it, else None (and remember it)."""
        return at if at is not None and self.passed(at) else None


@dataclass
class Context:
    directory: object
    policy: Policy
    watermark: datetime | None
    _releases: dict = field(default_factory=dict)
    accessed: set = field(default_factory=set)  # releases read by the current evaluation
    policy_version: str = ""  # the policy's fingerprint: given by a caller that keeps it, else computed here

    def __post_init__(self) -> None:
        if not self.policy_version:
            self.policy_version = self.policy.fingerprint

    def release(self, rid: str | None) -> Release:
        self.accessed.add(rid)
        if rid not in self._releases:
            self._releases[rid] = Release(self.directory, rid)
        return self._releases[rid]


class Findings:
    """Violations derived in one evaluation, keyed by violation id."""

    def __init__(self, ctx: Context, key: str) -> None:
        self.ctx = ctx
        self.key = key
        self.items: dict[str, dict] = {}

    def add(self, control: int, parts: tuple, opened: datetime, closed: datetime | None, evidence, identity: dict, detail: str,
            severity: str | None = None) -> None:
        policy = self.ctx.policy
        if not policy.control(control).enabled:
            return
        vid = violation_id(control, *[str(p) for p in parts])
        seen: list[str] = []
        for e in evidence:
            if e and e not in seen:
                seen.append(e)
        if closed is not None and closed < opened:
            closed = opened
        self.items[vid] = {
            "violation_id": vid, "control_id": control, "title": CONTROL_TITLES[control],
            "severity": severity or policy.control(control).severity,
            "identity": {k: v for k, v in identity.items() if v and k in Identity.model_fields},
            "evidence": seen[:MAX_EVIDENCE], "owner": policy.owner_for(control), "opened_at": iso(opened), "closed_at": iso(closed),
            "detail": detail, "policy_version": self.ctx.policy_version,
        }


# --- lifecycle timelines (from the directory) ----------------------------------------------

def _covers(policy: Policy, granted_env: str | None, env: str | None) -> bool:
    """An approval for ``granted_env`` covers ``env``: no environment on either side, the
    same one, or a later one in the policy's order."""
    if not granted_env or not env or granted_env == env:
        return True
    granted, wanted = policy.environment_rank(granted_env), policy.environment_rank(env)
    return granted is not None and wanted is not None and granted >= wanted


def _timeline(rel: Release, sets, clears) -> list[tuple[datetime, bool, str]]:
    """A true/false timeline of a release from its history: (time, new value, event id)
    at every change; ``sets(event)`` / ``clears(event)`` say which events turn it on / off."""
    out, state = [], False
    for event in rel.history:
        if sets(event):
            new = True
        elif clears(event):
            new = False
        else:
            continue
        if new != state:
            out.append((event[0], new, event[2]))
            state = new
    return out


def approval_changes(rel: Release, policy: Policy, env: str | None) -> list[tuple[datetime, bool, str]]:
    """When the release became / stopped being approved for ``env``: an approval by an
    actor holding the approve right (covering env) sets it; a revocation or retirement clears it
    (``Policy.stops``: unless the policy requires proof and nobody proved its actor)."""
    return _timeline(rel, lambda e: e[1] == "release.approved" and policy.allowed(e[4], "approve") and _covers(policy, e[3], env),
                     lambda e: e[1] in ("release.revoked", "release.retired") and policy.stops(e[4]))


def promotion_changes(rel: Release, policy: Policy, env: str) -> list[tuple[datetime, bool, str]]:
    """When the release was promoted to / rolled back from ``env``. Promotions by actors
    without the promote right do not count (control 7 reports them); revocation and
    retirement are control 8's business, not this timeline's."""
    return _timeline(rel, lambda e: e[1] == "release.promoted" and e[3] == env and policy.allowed(e[4], "promote"),
                     lambda e: e[1] == "release.rolled_back" and e[3] == env)


def gaps(changes: list[tuple[datetime, bool, str]], start: datetime, end: datetime | None) -> list[tuple]:
    """Sub-intervals of [start, end) where the timeline is False:
    (gap start, gap end or None, event that made it False or None, event that ended it)."""
    state, cause, i = False, None, 0
    while i < len(changes) and changes[i][0] <= start:
        _, state, cause = changes[i]
        i += 1
    out = []
    gap_start, gap_cause = (None, None) if state else (start, cause)
    for at, value, eid in changes[i:]:
        if end is not None and at >= end:
            break
        if value and gap_start is not None:
            out.append((gap_start, at, gap_cause, eid))
            gap_start = None
        elif not value and gap_start is None:
            gap_start, gap_cause = at, eid
    if gap_start is not None:
        out.append((gap_start, end, gap_cause, None))
    return out


# --- scheduler rows --------------------------------------------------------------------

def _sorted(rows) -> list[dict]:
    return sorted(rows, key=lambda r: (_t(r["at"]), r["id"]))


def intervals(rows: list[dict]) -> list[tuple]:
    """Running intervals of one object: (start, end|None, start row, end row|None).

    Kubernetes times are whole seconds, so a start and a stop often share one: the rows of one
    instant are taken in the order that gives both their meaning — its starts before its stops when
    one of those ends the object (finished, deleted: nothing starts after it; a pod running and
    finished in one second) or while nothing runs (started and stopped at once: a zero-length
    interval); while it runs and the stop is a preemption, eviction or requeue, the stops first
    (stopped and admitted again). By id alone (a hash) a finish sorted before the running row
    opened an interval no later row closed: a control 1/2 violation open for ever on a workload
    that had finished (exploratory review, real cluster)."""
    out, current = [], None
    kept = _sorted(r for r in rows if r["type"] in SCHEDULER_KEPT)
    i = 0
    while i < len(kept):
        at = _t(kept[i]["at"])
        j = i
        while j < len(kept) and _t(kept[j]["at"]) == at:
            j += 1
        instant = kept[i:j]
        ends = any(r["type"] in TERMINAL for r in instant)
        first = START if current is None or ends else STOP
        ordered = [r for r in instant if r["type"] in first] + [r for r in instant if r["type"] not in first]
        for row in sorted(ordered, key=lambda r: r["type"] in TERMINAL):  # (stable: a terminal stop last of all)
            if current is None and row["type"] in START:
                current = [at, None, row, None]
            elif current is not None and row["type"] in STOP:
                current[1], current[3] = at, row
                out.append(tuple(current))
                current = None
        i = j
    if current is not None:
        out.append(tuple(current))
    return out


def merge_intervals(ivs: list[tuple]) -> list[tuple]:
    """Union of several objects' intervals (a workload runs while any of its pods runs)."""
    out: list[list] = []
    for s, e, srow, erow in sorted(ivs, key=lambda iv: (iv[0], iv[2]["id"])):
        if out and (out[-1][1] is None or s <= out[-1][1]):
            last = out[-1]
            if last[1] is not None and (e is None or e > last[1]):
                last[1], last[3] = e, erow
        else:
            out.append([s, e, srow, erow])
    return [tuple(iv) for iv in out]


def _is_preemption(row: dict) -> bool:
    return row["type"] == "scheduler.preempted" or (row["type"] == "scheduler.evicted" and "preempt" in (row["p"].get("reason") or "").lower())


def _preemptor_key(ref: dict | None) -> str | None:
    if not isinstance(ref, dict) or not ref.get("name") or not ref.get("namespace"):
        return None
    if ref.get("kind") == "Workload":
        return f"wl:{ref['namespace']}/{ref['name']}"
    return f"pod:{ref['namespace']}/{ref['name']}"


def _workload_of(rows: list[dict]) -> str | None:
    ids = [r for r in _sorted(rows) if r["i"].get("workload_id")]
    return ids[-1]["i"]["workload_id"] if ids else None


def _label(ident: dict) -> str:
    if ident.get("workload_id"):
        return f"workload {ident['workload_id']}" + (f" (pod {ident['namespace']}/{ident['pod']})" if ident.get("pod") else "")
    if ident.get("pod"):
        return f"pod {ident.get('namespace')}/{ident['pod']}"
    return "an unnamed workload"


def _business(ctx: Context, rows: list[dict]) -> tuple[int | None, str | None, str | None]:
    """(business priority, priority class, release) of a workload from its rows."""
    ordered = _sorted(rows)
    pc = next((r["p"]["priority_class"] for r in reversed(ordered) if r["p"].get("priority_class")), None)
    rid = next((r["i"]["release_id"] for r in reversed(ordered) if r["i"].get("release_id")), None)
    owner = ctx.release(rid).manifest.get("owner") if rid else None
    owner = owner or next((r["i"]["owner"] for r in reversed(ordered) if r["i"].get("owner")), None)
    return ctx.policy.business_priority.of(rid, owner, pc), pc, rid


# --- evaluation ------------------------------------------------------------------------

@dataclass
class Evaluation:
    findings: dict[str, dict]
    forwards: dict[str, dict]
    deadline: datetime | None
    interests: set[str]
    version: int = 0


def evaluate(state: dict, ctx: Context) -> Evaluation:
    """Every violation a key's state supports now, and what it forwards to other keys."""
    key = state["key"]
    kind = kind_of(key)
    found = Findings(ctx, key)
    clock = Clock(ctx.watermark)
    ctx.accessed = set()
    forwards: dict[str, dict] = {}
    interests: set[str] = set()
    rows = list(state["rows"].values())
    if kind in ("pod", "uid", "wl"):
        own = [r for r in rows if not _is_allocation(r) and r["type"].startswith("scheduler.")]
        interests.update(f"rid:{r['i']['release_id']}" for r in own if r["i"].get("release_id"))
        if kind == "pod":
            _artifact_digests(own, found, ctx, key)
        workload = _workload_of(own) if kind != "wl" else None
        if workload:
            forwards[f"wl:{workload}"] = {"rows": _sorted(own)}
        else:
            objects = {key: own}
            for src, link in sorted(state["links"].items()):
                if link.get("rows"):
                    objects[src] = link["rows"]
                    interests.update(f"rid:{r['i']['release_id']}" for r in link["rows"] if r["i"].get("release_id"))
            _workload_unit(objects, key, found, forwards, clock, ctx)
        victims = {vid: v for link in state["links"].values() for vid, v in (link.get("victims") or {}).items()}
        if victims:
            preemptor_rows = own + [r for src, link in state["links"].items() for r in link.get("rows", [])]
            _preemptor_side(preemptor_rows, victims, key, found, ctx)
            interests.update(f"rid:{v['rid']}" for v in victims.values() if v.get("rid"))
        if kind == "pod":
            _forward_allocations([r for r in rows if _is_allocation(r)], forwards, interests, ctx)
    elif kind == "rel":
        rid = key[4:]
        interests.add(f"rid:{rid}")
        _release_controls(rid, rows, state["links"], found, clock, ctx)
    elif kind == "alert":
        _telemetry(rows, found, ctx)
    elif kind == "gpu":  # the layout before allocations were kept by their pod: changelogs written then still hold these
        _forward_allocations(rows, forwards, interests, ctx)
    future = [d for d in clock.deadlines if ctx.watermark is None or d > ctx.watermark]
    return Evaluation(found.items, forwards, min(future) if future else None, interests, key_version(state, ctx, clock))


def _is_allocation(row: dict) -> bool:
    """A compact allocation (``compact_allocation``), not a compact correlated row: it has no type."""
    return "type" not in row


def _forward_allocations(allocs: list[dict], forwards: dict, interests: set, ctx: Context) -> None:
    """A pod's GPU allocation intervals, to each release whose controls read them."""
    per_release: dict[str, list] = defaultdict(list)
    for a in sorted(allocs, key=lambda a: (a["start"], a["id"])):
        rid = a.get("rid")
        if not rid:
            continue
        interests.add(f"rid:{rid}")  # a reservation or retirement later makes the release read them
        if a.get("w"):
            # Withdrawn (``fold_row``): no holding. Its release still gets the pod's list, if empty — it
            # replaces the one that named it.
            if holdings_read(ctx, rid, "allocs"):
                per_release.setdefault(rid, [])
            continue
        if holdings_read(ctx, rid, "allocs"):
            per_release[rid].append({"id": a["id"], "start": a["start"], "end": a["end"], "se": a["se"], "ee": a["ee"],
                                     "pod": a["pod"], "gpu": f"{a['node']}/{a['gpu_id']}"})
    for rid, items in per_release.items():
        target = f"rel:{rid}"
        forwards[target] = {**forwards.get(target, {}), "allocs": items}


def key_version(state: dict, ctx: Context, clock: Clock) -> int:
    """The version of everything a key's evaluation read — rows and links (their own
    versions, which come from history), the releases it looked at (their event counts)
    and the deadlines the watermark has passed, the rows dropped past ``MAX_ROWS`` included
    (``fold_row``). It grows with history and not with processing, so a violation's latest
    version is the same in every run."""
    rids = {r for r in ctx.accessed if r}
    return (sum(r["v"] for r in state["rows"].values()) + (state["dropped"]["v"] if state.get("dropped") else 0)
            + sum(link.get("v", 0) for link in state["links"].values()) + sum(ctx.directory.count(r) for r in rids) + clock.passed_count)


def _artifact_digests(rows: list[dict], found: Findings, ctx: Context, key: str) -> None:
    """3: the pod's running image digests must include its release manifest's image_digest."""
    ivs = intervals(rows)

    def interval_end(at: datetime):
        """The end (time, row) of the running interval holding ``at``; None outside every one."""
        for s, e, _sr, er in ivs:
            if s <= at and (e is None or at < e):
                return e, er
        return None

    segment = None  # [first row, end of its interval, end row, evidence, manifest digest, rid]

    def close(at, closing_id):
        first, _end, _er, evidence, want, rid = segment
        ident = {**first["i"], "release_id": rid}
        running = ", ".join(first["p"].get("image_digests") or [])
        found.add(3, ("digest", key, first["id"]), _t(first["at"]), at, evidence + [closing_id],
                  ident, f"{_label(first['i'])} runs image(s) {running}; release {rid} manifest image_digest is {want}")

    for row in _sorted(r for r in rows if r["p"].get("image_digests")):
        at = _t(row["at"])
        if segment is not None and segment[1] is not None and at >= segment[1]:
            close(segment[1], segment[2]["id"] if segment[2] else None)
            segment = None
        rid = row["i"].get("release_id")
        want = ctx.release(rid).manifest.get("image_digest") if rid else None
        if not want:
            continue
        mismatch = want not in row["p"]["image_digests"]
        if mismatch and segment is None:
            # A row outside the pod's running intervals (queued before it, its stop, anything
            # after) runs nothing: it opened a violation closed at its own time — one more per
            # such row of a pod that ran the wrong image (exploratory review).
            held = interval_end(at)
            if held is None:
                continue
            segment = [row, *held, [row["id"]], want, rid]
        elif mismatch:
            segment[3].append(row["id"])
        elif segment is not None:
            close(at, row["id"])
            segment = None
    if segment is not None:
        close(segment[1], segment[2]["id"] if segment[2] else None)


def _workload_unit(objects: dict[str, list[dict]], key: str, found: Findings, forwards: dict, clock: Clock, ctx: Context) -> None:
    """1, 2, 3 (identifiers) and 4 (observation window) for one workload."""
    unit_ivs = _unit_intervals(objects, key)
    running: dict[str, list] = defaultdict(list)
    for start, end, srow, erow in unit_ivs:
        rid = srow["i"].get("release_id")
        if rid and holdings_read(ctx, rid, "running"):
            running[rid].append({"start": iso(start), "end": iso(end), "se": srow["id"], "ee": erow["id"] if erow else None, "unit": key})
        _admission(key, start, end, srow, erow, found, ctx)
        _identifiers(key, start, end, srow, erow, found, ctx)
        _promotion(key, start, end, srow, erow, found, ctx)
    for rid, ivs in running.items():
        forwards[f"rel:{rid}"] = {"running": ivs}
    victims: dict[str, dict] = defaultdict(dict)
    all_rows = [r for obj_rows in objects.values() for r in obj_rows]
    for cluster in preemption_clusters(r for obj_rows in objects.values() for r in obj_rows):
        _preempted(cluster, key, unit_ivs, all_rows, found, victims, clock, ctx)
    for target, items in victims.items():
        forwards[target] = {**forwards.get(target, {}), "victims": items}


def _unit_intervals(objects: dict[str, list[dict]], key: str) -> list[tuple]:
    """The workload's running intervals: its own rows' when it has any, else the union of its pods'."""
    own_ivs = intervals(objects.get(key, []))
    if own_ivs:
        return own_ivs
    return merge_intervals([iv for src, obj_rows in objects.items() if src != key for iv in intervals(obj_rows)])


def _environment(ident: dict, ctx: Context) -> str | None:
    """The environment a row's workload runs in (``Policy.workload_environment``)."""
    return ctx.policy.workload_environment(ident.get("namespace"), ident.get("environment"))


def _approval_environment(srow: dict, start: datetime, ctx: Context) -> str | None:
    """The environment control 1 judges a workload admitted at ``start`` in: its row's when the
    environment is the workload's own (its label: ``el``, ``CorrelatedEvent.environment_labelled``,
    true) — else the strictest needing an approval that its release's events named by ``start``
    (``Policy.approval_environment``), floored by its namespace's: the environment the admission
    webhook decides it in (``admission.releases_environment``).

    Why: an unlabelled workload's row carries its release's manifest environment, the one the
    release's *latest* event named — which anyone's later event (an evaluation for dev, say) lowered:
    a release promoted to prod without a prod approval then had its unlabelled workloads judged in
    dev, which needs none, and control 1 closed or never opened their violation, while the webhook
    denied the same workloads. A row without ``el`` (stored by a worker before it was recorded) is
    judged by its row's environment, as it was."""
    ident = srow["i"]
    rid = ident.get("release_id")
    if srow.get("el") is not False or not rid:
        return _environment(ident, ctx)
    ctx.release(rid)  # (read: a release event that changes the answer re-evaluates the key)
    named = ctx.directory.environments_named(rid, start.astimezone(timezone.utc).isoformat())
    return ctx.policy.workload_environment(ident.get("namespace"), ctx.policy.approval_environment(named))


def _admission(key: str, start: datetime, end: datetime | None, srow: dict, erow: dict | None, found: Findings, ctx: Context) -> None:
    """1: admitted with no release identity, or with no approval covering its environment."""
    ident = srow["i"]
    rid, env = ident.get("release_id"), _approval_environment(srow, start, ctx)
    envp = ctx.policy.environment(env)
    if not (envp.requires_approval if envp else True):
        return
    who, ev = _label(ident), [srow["id"], erow["id"] if erow else None]
    if not rid:
        found.add(1, ("identity", key, srow["id"]), start, end, ev, ident,
                  f"{who} was admitted ({srow['type']}) with no release identity" + (f" in {env}" if env else " (environment unknown)"))
        return
    rel = ctx.release(rid)
    first = gaps(approval_changes(rel, ctx.policy, env), start, end)
    if not first or first[0][0] != start:
        return
    _gs, ge, cause, closing = first[0]
    if not rel.known:
        why = f"release {rid} is not known (no release event names it)"
    elif cause:
        why = f"release {rid} was revoked or retired before admission"
    else:
        unentitled = [e for e in rel.history if e[1] == "release.approved" and e[0] <= start and _covers(ctx.policy, e[3], env)]
        why = (f"release {rid} was approved for {env or 'its environment'} only by " + _actors(unentitled)
               + f", which does not count: {ctx.policy.why_not(unentitled[-1][4], 'approve')}"
               if unentitled else f"release {rid} had no approval for {env or 'its environment'}")
    closed_by = _closed_by(rel, closing, "approve", ctx.policy) if ge is not None and (end is None or ge <= end) else ""
    found.add(1, ("approval", key, srow["id"]), start, _min(ge, end), ev + [cause, closing], {**ident, "release_id": rid},
              f"{who} was admitted ({srow['type']}) at {iso_z(start)} but {why}{closed_by}")


def _identifiers(key: str, start: datetime, end: datetime | None, srow: dict, erow: dict | None, found: Findings, ctx: Context) -> None:
    """3: a workload naming a release no release event describes (attributed by a fallback
    rule instead, or not at all, or first seen after it ran), or a model no release matches."""
    ident = srow["i"]
    rid = ident.get("release_id")
    who, ev = _label(ident), [srow["id"], erow["id"] if erow else None]
    rel = ctx.release(rid)
    if srow.get("named"):
        found.add(3, ("release-id-mismatch", key, srow["id"]), start, end, ev, {**ident, "release_id": rid},
                  f"{who} names release {srow['named']}, which no release event describes; attributed to {rid} "
                  f"by {srow['attr'].replace('_', ' ')} instead")
    elif rid and (not rel.known or rel.first_seen > start):
        closed = _min(rel.first_seen, end) if rel.known else end
        found.add(3, ("unknown-release", key, srow["id"]), start, closed, ev, ident,
                  f"{who} names release {rid}, which " + ("no release event describes" if not rel.known else
                                                         f"was first seen only at {iso_z(rel.first_seen)}"))
    elif not rid and ident.get("model_name"):
        model = ident["model_name"] + (f":{ident['model_version']}" if ident.get("model_version") else "")
        found.add(3, ("unknown-model", key, srow["id"]), start, end, ev, ident, f"{who} names model {model}, which matches no release")


def _promotion(key: str, start: datetime, end: datetime | None, srow: dict, erow: dict | None, found: Findings, ctx: Context) -> None:
    """2: running in an environment the release was never promoted to, or was rolled back from."""
    ident = srow["i"]
    rid, env = ident.get("release_id"), _environment(ident, ctx)
    envp = ctx.policy.environment(env)
    rel = ctx.release(rid)
    if not (rid and rel.known and env and envp and envp.requires_promotion):
        return
    for gs, ge, cause, closing in gaps(promotion_changes(rel, ctx.policy, env), start, end):
        unentitled = [e for e in rel.history if e[1] == "release.promoted" and e[3] == env and e[0] <= gs]
        if cause:
            why = f"was rolled back from {env}"
        elif unentitled:
            why = f"was promoted to {env} only by {_actors(unentitled)}, which does not count: {ctx.policy.why_not(unentitled[-1][4], 'promote')}"
        else:
            why = f"was never promoted to {env}"
        closed_by = _closed_by(rel, closing, "promote", ctx.policy) if ge is not None and (end is None or ge <= end) else ""
        found.add(2, ("promotion", key, rid, env, srow["id"], cause or ""), gs, _min(ge, end),
                  [srow["id"], cause, closing, erow["id"] if erow else None] + [e[2] for e in unentitled],
                  {**ident, "release_id": rid}, f"{_label(ident)} runs in {env} while release {rid} {why}{closed_by}")


def _closed_by(rel: Release, event_id: str | None, action: str, policy: Policy) -> str:
    """"; approved at T by X (role R via group:G)": the event that closed a gap, and the
    decision right it was counted under (the evidence names the group that held it)."""
    event = next((e for e in rel.history if e[2] == event_id), None) if event_id else None
    if event is None:
        return ""
    what = event[1].split(".", 1)[1]
    return f"; {what} at {iso_z(event[0])} by {actor_text(event[4]) or 'no recorded actor'} ({policy.granted(event[4], action)})"


def _actors(events: list[tuple]) -> str:
    """Who did these lifecycle events ("bob at T", "no recorded actor at T")."""
    return ", ".join(f"{actor_text(e[4]) or 'no recorded actor'} at {iso_z(e[0])}" for e in events[-3:])


def preemption_clusters(rows) -> list[list[dict]]:
    """One preemption often shows as several rows (the pod's, its Kueue workload's):
    preemption rows of one workload less than ``PREEMPTION_CLUSTER`` apart are one preemption."""
    clusters: list[list[dict]] = []
    for row in _sorted(r for r in rows if _is_preemption(r)):
        if clusters and _t(row["at"]) - _t(clusters[-1][0]["at"]) <= PREEMPTION_CLUSTER:
            clusters[-1].append(row)
        else:
            clusters.append([row])
    return clusters


def _preempted(cluster: list[dict], key: str, unit_ivs: list[tuple], all_rows: list[dict], found: Findings, victims: dict,
               clock: Clock, ctx: Context) -> None:
    """4 (victim side): a preemption inside the release's observation window; and the
    victim's side of it forwarded to the preemptor (``victims``)."""
    at = _t(cluster[0]["at"])
    ident = {**next((r for r in cluster if r["i"].get("release_id")), cluster[0])["i"]}
    rid, env = ident.get("release_id"), _environment(ident, ctx)
    restarted, restart_row = next(((s, sr["id"]) for s, _e, sr, _er in unit_ivs if s > at), (None, None))
    evidence = [r["id"] for r in cluster]
    ref = next((r["p"]["preemptor"] for r in cluster if isinstance(r["p"].get("preemptor"), dict)), None)
    by = f" by {ref.get('kind', '?')} {ref.get('namespace') or '?'}/{ref.get('name') or ref.get('uid') or '?'}" if ref else ""
    envp = ctx.policy.environment(env)
    if rid and envp and envp.observation_window > timedelta(0):
        changes = promotion_changes(ctx.release(rid), ctx.policy, env)
        promoted = next((c for c in reversed(changes) if c[0] <= at), None)
        if promoted and promoted[1] and at < promoted[0] + envp.observation_window:
            window_end = promoted[0] + envp.observation_window
            closed = restarted if restarted is not None and restarted <= window_end else clock.reached(window_end)
            found.add(4, ("window", key, iso(at)), at, closed, evidence + [promoted[2], restart_row], ident,
                      f"{_label(ident)} of release {rid} was preempted{by} at {iso_z(at)}, inside the {env} observation window "
                      f"(promoted {iso_z(promoted[0])}, window ends {iso_z(window_end)})")
    target = _preemptor_key(ref)
    if target and target != key:
        bp, pc, _rid = _business(ctx, all_rows)
        victims[target][f"{key}@{iso(at)}"] = {"at": iso(at), "restarted": iso(restarted), "rid": rid, "bp": bp, "pc": pc,
                                             "identity": ident, "evidence": evidence + [restart_row], "victim": key}


def _preemptor_side(rows: list[dict], victims: dict[str, dict], key: str, found: Findings, ctx: Context) -> None:
    """4: a preemption by a workload of lower business priority than its victim's."""
    bp, pc, rid = _business(ctx, rows)
    if bp is None:
        return
    me = next((r["i"] for r in reversed(_sorted(rows))), {})
    admitted = next((r["id"] for r in _sorted(rows) if r["type"] in START), None)
    for vid, v in sorted(victims.items()):
        if v.get("bp") is None or bp >= v["bp"]:
            continue
        found.add(4, ("lower-priority", v["victim"], vid), _t(v["at"]), _t(v["restarted"]) if v.get("restarted") else None,
                  v["evidence"] + [admitted], v["identity"],
                  f"{_label(v['identity'])} (release {v.get('rid') or 'none'}, class {v.get('pc') or '?'}, business priority {v['bp']}) "
                  f"was preempted by {_label(me) if me else key} (release {rid or 'none'}, class {pc or '?'}, business priority {bp})")


def _telemetry(rows: list[dict], found: Findings, ctx: Context) -> None:
    """6: an alert episode no row of which could be joined to a release."""
    telemetry = ctx.policy.telemetry
    episodes: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        episodes[row["p"].get("starts_at") or row["at"]].append(row)
    for starts, ep in sorted(episodes.items()):
        ep = _sorted(ep)
        if any(joined(r["attr"], r["i"].get("release_id"), False if r.get("unknown") else None) for r in ep):
            continue
        name = next((r["p"].get("alertname") for r in ep if r["p"].get("alertname")), None)
        labels = next((r["p"].get("labels") for r in ep if r["p"].get("labels")), {}) or {}
        quality = telemetry.quality_alerts.matches(name, labels)
        if telemetry.scope == "quality" and not quality:
            continue
        resolved = [r for r in ep if r["type"] == "alert.resolved"]
        ends = _min(*[_t(r["p"].get("ends_at") or r["at"]) for r in resolved]) if resolved else None
        ident = {k: v for r in ep for k, v in r["i"].items()}
        where = ", ".join(f"{k}={ident[k]}" for k in ("namespace", "pod", "node", "gpu_id") if ident.get(k)) or "no workload or node labels"
        found.add(6, ("unattributed", ident.get("alert_fingerprint") or ep[0]["id"], starts), _t(starts), ends, [r["id"] for r in ep], ident,
                  f"{'quality ' if quality else ''}alert {name or '?'} ({where}) could not be joined to a release or workload",
                  severity="critical" if quality else None)


def _release_controls(rid: str, rows: list[dict], links: dict, found: Findings, clock: Clock, ctx: Context) -> None:
    """5, 7 and 8 for one release."""
    rows = _sorted(r for r in rows if r["type"].startswith("release."))
    manifest = ctx.release(rid).manifest
    own_env = {eid: env for _at, _etype, eid, env, _actor in ctx.release(rid).history}  # each event's own environment
    base = {"release_id": rid, **{k: manifest.get(k) for k in ("model_name", "model_version", "environment", "owner", "image_digest")}}
    # By allocation id: a changelog from before allocations were kept by their pod can still
    # hold a node/GPU key's copy of one; the pod's (its newer versions) wins.
    by_id = {a["id"]: a for src, link in sorted(links.items(), key=lambda item: item[0].startswith("pod:")) for a in link.get("allocs", [])}
    allocs = sorted(by_id.values(), key=lambda a: (a["start"], a["id"]))
    running = sorted((r for link in links.values() for r in link.get("running", [])), key=lambda r: (r["start"], r["se"]))
    for n, row in enumerate(rows):
        action = ACTION_OF_EVENT.get(row["type"])
        if action:
            # A repeat in the same instant ratifies too: rows of one instant are in id order, which
            # says nothing of which came first — a pipeline giving every step one --at (docs/receiver.md)
            # had the approver's ratification count or not by the hash of two event ids.
            at = _t(row["at"])
            later = [r for m, r in enumerate(rows) if m != n and (m > n or _t(r["at"]) == at) and r["type"] == row["type"]
                     and r["p"].get("target") == row["p"].get("target") and _decided_for(r, own_env) == _decided_for(row, own_env)
                     and _reservation_of(r) == _reservation_of(row)]
            _authority(rid, row, action, later, base, found, clock, ctx.policy)
    reservations = reservation_events(rows)
    for res_id, entry in sorted(reservations.items()):
        if entry["created"] is not None:
            _capacity(rid, res_id, entry, allocs, base, found, clock, ctx.policy)
    _retirement(rid, rows, reservations, allocs, running, base, found, clock, ctx.policy)


def _decided_for(row: dict, own_env: dict[str, str | None]) -> str | None:
    """The environment a lifecycle decision is for, as the event itself named it: its
    ``to_environment``, else its identity's ``environment`` — read from the release directory's
    entry of the event (``own_env``), because the row's identity is filled in from the release's
    manifest where the event names none (an approval naming no environment, which covers every
    one, read as the manifest's). A repeat ratifies only the same decision: an approval for dev
    closed an unauthorised approval for prod as "ratified" while nobody with the right ever
    approved prod (exploratory review). An event the directory no longer holds (past its history
    bound) falls back to the row."""
    if row["id"] in own_env:
        return own_env[row["id"]]
    return row["p"].get("to_environment") or row["i"].get("environment")


def _reservation_of(row: dict) -> object:
    """The reservation a reservation event is about: part of "the same decision" for control 7 —
    carol's reservation res-1 ratified mallory's res-evil of 64 GPUs (later, or since the same
    instant counts, then) as if it were the same (review). Other events: None (a reservation
    their payload may carry is not what they decide). A reservation event naming none: an object
    equal to nothing, so it ratifies nothing and nothing ratifies it."""
    if not row["type"].startswith("release.reservation_"):
        return None
    return (row["p"].get("reservation") or {}).get("reservation_id") or object()


def _action_text(row: dict) -> str:
    p = row["p"]
    return (row["type"].split(".", 1)[1] + (f" {p['target']}" if p.get("target") else "")
            + (f" to {p['to_environment']}" if p.get("to_environment") else ""))


def _authority(rid: str, row: dict, action: str, later: list[dict], base: dict, found: Findings, clock: Clock, policy: Policy) -> None:
    """7: an action by an actor without the right (until one with it repeats it), an
    emergency override with no expiry (until re-issued with one) or lasting past the maximum."""
    p, at, what = row["p"], _t(row["at"]), _action_text(row)
    actor = p.get("actor")
    proven = decision_actor(p)  # proven or not, delegated or not: the policy judges both
    entitled = policy.allowed(proven, action)
    ratified = None if entitled else next((r for r in later if policy.allowed(decision_actor(r["p"]), action)), None)
    # Taken in the same instant by one who holds the right: the decision never stood on the unentitled
    # actor's word alone (a pipeline's CI step and its approver, one --at) — no violation, rather than
    # one opened and closed at once, which failed the audit all the same.
    same_instant = ratified is not None and _t(ratified["at"]) == at and action not in policy.emergency_overrides.actions
    if not entitled and not same_instant:
        # Only an emergency override's expiry ends it: any other event's expires_at is the actor's own word (an
        # unauthorised approval carrying expires_at one second later closed its own violation: exploratory review).
        override = action in policy.emergency_overrides.actions
        expiry = clock.reached(_t(p["expires_at"])) if override and p.get("expires_at") else None
        closed = _min(_t(ratified["at"]) if ratified else None, expiry)
        why = policy.why_not(proven, action)
        if ratified is not None and (expiry is None or _t(ratified["at"]) <= expiry):
            by = decision_actor(ratified["p"])
            why += f"; ratified at {iso_z(ratified['at'])} by {actor_text(by)} ({policy.granted(by, action)})"
        elif expiry is not None:
            why += f"; the override expired at {iso_z(expiry)}"
        found.add(7, ("unauthorized", row["id"]), at, closed, [row["id"], ratified["id"] if ratified else None],
                  {**base, "node": p.get("target") if row["type"] == "release.node_isolated" else None},
                  f"{what} of release {rid} without the decision right: {why}")
    if action not in policy.emergency_overrides.actions:
        return
    limit_text = format_duration(policy.emergency_overrides.max_duration)
    if not p.get("expires_at"):
        reissued = next((r for r in later if r["p"].get("expires_at")), None)
        found.add(7, ("no-expiry", row["id"]), at, _t(reissued["at"]) if reissued else None,
                  [row["id"], reissued["id"] if reissued else None], base,
                  f"emergency override {what} by {actor or 'unknown'} has no expiry (policy: at most {limit_text})")
        return
    expires, deadline = _t(p["expires_at"]), at + policy.emergency_overrides.max_duration
    if expires > deadline and clock.passed(deadline):
        found.add(7, ("too-long", row["id"]), deadline, clock.reached(expires), [row["id"]], base,
                  f"emergency override {what} by {actor or 'unknown'} runs until {iso_z(expires)}, past the {limit_text} maximum "
                  f"({iso_z(deadline)})")


def reservation_events(rows: list[dict]) -> dict[str, dict]:
    """Reservation id → its first creation and first release row (rows sorted by time)."""
    reservations: dict[str, dict] = {}
    for row in rows:
        res_id = (row["p"].get("reservation") or {}).get("reservation_id")
        if not res_id:
            continue
        entry = reservations.setdefault(res_id, {"created": None, "released": None})
        if row["type"] == "release.reservation_created" and entry["created"] is None:
            entry["created"] = row
        elif row["type"] == "release.reservation_released" and entry["released"] is None:
            entry["released"] = row
    return reservations


def _capacity(rid: str, res_id: str, entry: dict, allocs: list[dict], base: dict, found: Findings, clock: Clock, policy: Policy) -> None:
    """5: a reservation unused by window start + grace, held past window end + grace, or
    peaking below the policy's minimum utilisation (info)."""
    created, released = entry["created"], entry["released"]
    res = created["p"]["reservation"]
    gpus = int(res.get("gpus") or 0)
    ws = _t(res["window_start"]) if res.get("window_start") else _t(created["at"])
    we = _t(res["window_end"]) if res.get("window_end") else None
    released_at = _t(released["at"]) if released and _t(released["at"]) >= _t(created["at"]) else None
    released_id = released["id"] if released_at else None
    pool = f" in {res['pool']}" if res.get("pool") else ""
    plan = f"reservation {res_id} ({gpus} GPU(s){pool}, window {iso_z(ws)} → {iso_z(we) if we else 'open'})"
    grace = policy.reservations.grace
    unused_at = ws + grace
    if not (released_at and released_at <= unused_at) and clock.passed(unused_at):
        _unused(rid, res_id, plan, ws, unused_at, released_at, [created["id"], released_id], allocs, base, found, grace)
    if we is None:
        return
    held_at = we + grace
    if not (released_at and released_at <= held_at) and clock.passed(held_at):
        found.add(5, ("held", rid, res_id), held_at, released_at, [created["id"], released_id], base,
                  f"{plan} of release {rid} is still held {format_duration(grace)} after its window ended")
    in_window = [a for a in allocs if _t(a["start"]) < we and (a["end"] is None or _t(a["end"]) > ws)]
    peak = peak_concurrency(in_window, ws, we)
    minimum = policy.reservations.min_utilisation
    if gpus > 0 and minimum > 0 and clock.passed(we) and peak < gpus * minimum:
        found.add(5, ("underused", rid, res_id), ws, we, [created["id"]] + [a["se"] for a in in_window], base,
                  f"{plan} of release {rid}: peak {peak} of {gpus} reserved GPU(s) allocated ({peak / gpus:.0%}, "
                  f"plan asks at least {minimum:.0%})", severity="info")


def _unused(rid: str, res_id: str, plan: str, ws: datetime, unused_at: datetime, released_at: datetime | None, evidence: list,
            allocs: list[dict], base: dict, found: Findings, grace: timedelta) -> None:
    """5: no GPU allocated to the release by window start + grace (closes at the first use or the release)."""
    if [a for a in allocs if _t(a["start"]) <= unused_at and (a["end"] is None or _t(a["end"]) > ws)]:
        return
    later = [a for a in allocs if _t(a["start"]) > unused_at]
    first_use = _t(later[0]["start"]) if later else None
    found.add(5, ("unused", rid, res_id), unused_at, _min(first_use, released_at), [*evidence, later[0]["se"] if later else None], base,
              f"{plan} of release {rid}: no GPU allocated to the release by {iso_z(unused_at)} ({format_duration(grace)} after the window opened)")


def _holdings(deadline: datetime, reservations: dict, allocs: list[dict], running: list[dict]) -> list[tuple]:
    """What a release still held after ``deadline``: (start, end|None, evidence ids, what)."""
    out = []
    for a in allocs:
        if a["end"] is None or _t(a["end"]) > deadline:
            out.append((_t(a["start"]), _t(a["end"]) if a["end"] else None, [a["se"], a["ee"]], f"GPU {a['gpu']} ({a['pod']})"))
    for res_id, entry in sorted(reservations.items()):
        if entry["created"] is None:
            continue
        rel_row = entry["released"]
        rel_at = _t(rel_row["at"]) if rel_row else None
        if rel_at is None or rel_at > deadline:
            out.append((_t(entry["created"]["at"]), rel_at, [entry["created"]["id"], rel_row["id"] if rel_row else None],
                        f"reservation {res_id}"))
    for r in running:
        if r["end"] is None or _t(r["end"]) > deadline:
            out.append((_t(r["start"]), _t(r["end"]) if r["end"] else None, [r["se"], r["ee"]], f"running {r['unit']}"))
    return out


def first_ending(endings: list, time_of, type_of, actor_of, policy: Policy, counted_only: bool = True):
    """The release's ending that control 8 counts from (and the audit names): the earliest retirement
    or revocation the policy counts (``Policy.stops``; any, without ``counted_only``) — of one
    instant's, one by an actor holding the right (its revoke/retire) before one by an actor without
    it, so that a CI step and its ratifying approver at one ``--at`` read as the approver's
    (exploratory review). ``endings`` in time order; ``*_of`` read an entry's time, event type and
    ``decision_actor``."""
    counted = [e for e in endings if not counted_only or policy.stops(actor_of(e))]
    if not counted:
        return None
    first = [e for e in counted if time_of(e) == time_of(counted[0])]
    return next((e for e in first if policy.allowed(actor_of(e), ACTION_OF_EVENT[type_of(e)])), first[0])


def _retirement(rid: str, rows: list[dict], reservations: dict, allocs: list[dict], running: list[dict], base: dict, found: Findings,
                clock: Clock, policy: Policy) -> None:
    """8: a retired or revoked release still holding GPUs, reservations or running workloads after the grace period."""
    # (as for control 1 and admission: ``Policy.stops``)
    ended = first_ending([r for r in rows if r["type"] in ("release.retired", "release.revoked")], lambda r: _t(r["at"]),
                         lambda r: r["type"], lambda r: decision_actor(r["p"]), policy)
    if ended is None:
        return
    grace = policy.retirement.grace
    deadline = _t(ended["at"]) + grace
    if not clock.passed(deadline):
        return
    holdings = _holdings(deadline, reservations, allocs, running)
    if not holdings:
        return
    opened = max(deadline, min(h[0] for h in holdings))
    closed = max(h[1] for h in holdings) if all(h[1] is not None for h in holdings) else None
    kinds = defaultdict(int)
    for h in holdings:
        kinds[h[3].split(" ", 1)[0]] += 1
    held = ", ".join(f"{n} {k}(s)" for k, n in sorted(kinds.items()))
    found.add(8, ("retired", rid, ended["id"]), opened, closed, [ended["id"]] + [e for h in holdings for e in h[2]], base,
              f"release {rid} was {ended['type'].split('.', 1)[1]} at {iso_z(ended['at'])} and still held {held} after the {format_duration(grace)} grace period: "
              + "; ".join(h[3] for h in sorted(holdings, key=lambda h: (h[0], h[3]))[:10]))  # by time, then name: ids do not order text


def peak_concurrency(allocs: list[dict], start: datetime, end: datetime | None) -> int:
    """Most allocations held at once within [start, end)."""
    points = []
    for a in allocs:
        s = max(_t(a["start"]), start)
        e = _t(a["end"]) if a["end"] else None
        if end is not None:
            e = min(e, end) if e else end
        if e is not None and e <= s:
            continue
        points.append((s, 1))
        if e is not None:
            points.append((e, -1))
    peak = level = 0
    for _at, delta in sorted(points, key=lambda p: (p[0], p[1])):
        level += delta
        peak = max(peak, level)
    return peak


# --- the step -------------------------------------------------------------------------

@dataclass
class Outcome:
    violations: list[Violation] = field(default_factory=list)
    forwards: list[tuple[str, dict]] = field(default_factory=list)
    deadline: datetime | None = None
    interests: list[str] = field(default_factory=list)
    conflicts: int = 0


def _violation(rec: dict) -> Violation:
    c = rec["c"]
    return Violation(version=rec["v"], **{**c, "identity": Identity(**c["identity"]), "evidence": tuple(c["evidence"])})


def step(state: dict, ctx: Context) -> Outcome:
    """Re-derive a key's violations and forwards; return what changed.

    Every violation the key supports is emitted at the key's version (``key_version``)
    when that version grew; one the history no longer supports is *withdrawn* once
    (re-emitted closed at its opening with a ``withdrawn:`` detail). A content change
    without a version change bumps the version by one and is counted (``conflicts``).
    """
    ev = evaluate(state, ctx)
    out = Outcome(deadline=ev.deadline, interests=sorted(ev.interests))
    emitted = state["emitted"]
    for vid, content in sorted(ev.findings.items()):
        rec = emitted.get(vid)
        version = _next_version(rec, ev.version, content, out)
        if version is not None:
            emitted[vid] = {"v": version, "d": digest(content), "c": content}
            out.violations.append(_violation(emitted[vid]))
    for vid, rec in sorted(emitted.items()):
        if vid in ev.findings or is_withdrawn(rec["c"]):
            continue
        content = {**rec["c"], "closed_at": rec["c"]["opened_at"], "detail": WITHDRAWN + rec["c"]["detail"]}
        emitted[vid] = {"v": max(ev.version, rec["v"] + 1), "d": digest(content), "c": content}
        out.violations.append(_violation(emitted[vid]))
    for target, link in sorted(ev.forwards.items()):
        _forward(state, target, link, ev.version, out)
    for target in sorted(set(state["fwd"]) - set(ev.forwards)):
        if state["fwd"][target][1] != "":
            _forward(state, target, {}, ev.version, out)
    return out


def _next_version(rec: dict | None, version: int, content: dict, out: Outcome) -> int | None:
    if rec is None:
        return version
    same = rec["d"] == digest(content)
    if version > rec["v"]:
        return version
    if same:
        return None
    out.conflicts += 1
    return rec["v"] + 1


def _forward(state: dict, target: str, link: dict, version: int, out: Outcome) -> None:
    d = digest(link) if link else ""
    last = state["fwd"].get(target)
    if last is not None and version <= last[0]:
        if d == last[1]:
            return
        out.conflicts += 1
        version = last[0] + 1
    state["fwd"][target] = [version, d]
    out.forwards.append((target, {**link, "v": version}))


# --- an in-memory engine over a whole history (audit re-evaluation, tests) --------------------

class ControlEngine:
    """Runs the controls over a history in memory: the same fold/step functions the
    worker runs, with the internal topic replaced by a queue. The result does not depend
    on the order rows are fed in."""

    def __init__(self, directory, policy: Policy, watermark: datetime | None = None) -> None:
        self.directory = directory
        self.policy = policy
        self.fixed_watermark = watermark
        self.states: dict[str, dict] = {}
        self.violations: dict[str, Violation] = {}
        self.queue: list[tuple[str, str, object]] = []
        self.latest: datetime | None = None

    def _seen(self, at: str | None) -> None:
        if at:
            t = _t(at)
            self.latest = t if self.latest is None or t > self.latest else self.latest

    def feed(self, rows=(), allocations=()) -> ControlEngine:
        for record in rows:
            row = compact_row(record)
            if row is not None:
                self._seen(row["at"])
                self.queue.append((row_key(row), "row", row))
        for record in allocations:
            alloc = compact_allocation(record)
            self._seen(alloc["start"])
            self._seen(alloc["end"])
            self.queue.append((allocation_key(alloc), "row", alloc))
        return self

    def watermark(self) -> datetime | None:
        if self.fixed_watermark is not None:
            return self.fixed_watermark
        latest = self.latest
        for state in self.directory.releases.values():
            if state["history"]:
                t = _t(state["history"][-1][0].split("|", 1)[0])
                latest = t if latest is None or t > latest else latest
        return latest

    def run(self, refresh_all: bool = True) -> dict[str, Violation]:
        touched = set(self.states) if refresh_all else set()
        while self.queue or touched:
            batch, self.queue = self.queue, []
            for key, kind, item in batch:
                state = self.states.setdefault(key, new_state(key))
                if kind == "row":
                    fold_row(state, item)
                else:
                    fold_link(state, item[0], item[1])
                touched.add(key)
            ctx = Context(self.directory, self.policy, self.watermark())
            for key in sorted(touched):
                outcome = step(self.states[key], ctx)
                for v in outcome.violations:
                    current = self.violations.get(v.violation_id)
                    if current is None or v.version > current.version:
                        self.violations[v.violation_id] = v
                for target, link in outcome.forwards:
                    self.queue.append((target, "link", (key, link)))
            touched = set()
        return self.violations

    def current(self, include_withdrawn: bool = False) -> list[Violation]:
        return sorted((v for v in self.violations.values() if include_withdrawn or not is_withdrawn(v)),
                      key=lambda v: (v.control_id, v.opened_at, v.violation_id))


def directory_from_rows(rows) -> object:
    """A ReleaseDirectory rebuilt from stored correlated release rows (for re-evaluation
    over ClickHouse history): each row is its release event (event id = correlation id)."""
    from schemas import ReleaseEvent, Source
    from schemas.release import ReleasePayload
    from streams.correlate.directory import ReleaseDirectory

    directory = ReleaseDirectory()
    for record in rows:
        row = _as_dict(record)
        if not row["event_type"].startswith("release."):
            continue
        ident = {k: v for k, v in (row.get("identity") or {}).items() if v}
        event = ReleaseEvent(event_id=row["correlation_id"], event_type=row["event_type"], occurred_at=row["occurred_at"],
                             observed_at=row["occurred_at"], source=Source(collector="store"), identity=Identity(**ident),
                             payload=ReleasePayload.model_validate_json(row.get("payload_json") or "{}"))
        directory.apply(event)
    return directory
