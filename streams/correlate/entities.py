"""Entity state and the join rules, as pure functions (no Faust, no Kafka).

Every routed message is processed against the state of one entity (see
``streams.correlate.routing``): a pod, a workload, a node/GPU, a release, a model, an
alert fingerprint. An entity keeps

- ``rows``: the input events attached to it (bounded: ``_bound`` — alerts before the entity's own rows, the oldest first, never one still needed), each with the
  identity facts it carries, whether it is parked, and the GPU operation it is;
- ``links``: identity forwarded by related entities (a pod's intervals to its
  node/GPU, a pod's release to every workload its rows named — ``left`` to those it no longer
  names —, a workload's release to its pods), each with the sender's version; the highest
  version of a link wins;
- ``sent`` / ``allocs`` / ``fwd``: the version last emitted per row, allocation and
  forward (``sent_version``; with its digest when the tests verify: ``VERIFY_UNCHANGED``);
  ``allocs_gone``: the allocations withdrawn (``_withdraw``: a holding found to start earlier);
- ``ctl``: the alert fingerprints whose rows go to the controls stage (below).

Facts (pod uid, workload, node, image digest, release/model labels, …) are derived
from the rows at each refresh: per field, the value of the latest event (sort key
``occurred_at|event_id``) that carries it — independent of processing order.

**Versions come from history.** A row's version is a sum of components, each a
function of the part of the history its content depends on, never of processing
order: 1 for the row's own event; per fact field the number of runs of equal values
in event order (``release.segments``: grows when the latest value can change, not
when an event repeats it); the versions of the links it reads; the directory's
``version_at`` of every release it may name and ``count`` of every candidate a
look-up consulted (a pod's or workload's rows: every release and look-up any of its rows
ever named, ``named_values`` — not only its latest facts', which lose one when a label changes). Each component only grows as history is added, so the latest
version is the row as the whole history has it, and two replays give identical rows
*and* versions. A row is emitted when its version grows (even if its content did not:
the final version must not depend on where a run happened to emit). Should its content
change without its version growing — a missing version component, a bug — the tests
catch it: they render and compare every output (``VERIFY_UNCHANGED``), bump the version
by one and count it in ``Outcome.conflicts``, which they assert is 0. The worker trusts
the versions and skips an output whose version did not grow without rendering it.

Parking: a row whose release cannot be resolved is *parked* (not emitted) until its
identity arrives, or until the event-time watermark passes its time + TTL; then it is
emitted ``unattributed``. Parking never changes a version: it only delays emission.

Alerts and the controls stage: the one control that reads alert rows (6, an alert no
row of which could be joined to a release: ``streams.controls.rules._telemetry``) can
only fire for a fingerprint of which some row was emitted *unjoined* (unattributed, no
release id — or one no release event describes: ``schemas.outputs.joined``). Every other alert row is sent to the controls stage only once its
fingerprint has had such a row go out on the correlated topic (``for_controls``, on a
batch's final rows, so a row unjoined in one local pass and joined in the next does not
count): at that moment the fingerprint joins ``ctl`` and every row of it emitted so far
is sent along, so the control key then holds the fingerprint's rows as the correlated
topic has them, as before. An attributed alert —
most of them — costs the controls stage no state, no changelog record and no
evaluation (the bench mix: half of all control keys, 0.5 changelog records per input).
This relies on a fingerprint's rows living in one entity: the entity key of an alert is
a function of its identity, which comes from the labels the fingerprint hashes. A state
written before ``ctl`` existed sends every alert row (as it did then).

Bounds: ``MAX_ROWS`` rows per entity and ``MAX_STATE_BYTES`` of row text (``_bound``: never a
row ``_needed`` names; of the others, alerts before the entity's own rows, the oldest first; what
the rows let go added to the versions stays), ``MAX_LINKS`` links (those whose latest interval started earliest
go; what they added to the versions stays: ``_let_go``), ``MAX_CTL_FPS`` fingerprints tracked for the
controls past their rows (``trim``); what is detached is counted in
``state["detached"]``, and in the process's health (``streams.caps``).
"""

from __future__ import annotations

import hashlib
import heapq
from bisect import bisect_left, bisect_right, insort
from collections import defaultdict
from dataclasses import dataclass, field, replace
from itertools import accumulate, islice
from operator import add, itemgetter

import orjson

from gpuledger.timefmt import utc_isoformat
from schemas import Identity
from schemas.outputs import ALLOCATION_WITHDRAWN, joined
from streams.caps import capped
from streams.correlate.directory import interests_for
from streams.correlate.release import segments, summarize
from streams.packing import kind_of
from streams.store import Journal, touched

MAX_ROWS = 2000
MAX_LINKS = 256
#: Steps of a node/GPU's detached links' versions, and releases they named, kept (``_let_go``).
MAX_GONE_STEPS = 64
MAX_GONE_RIDS = 64
#: Sources of another entity's detached links whose versions are kept one by one (``_gone_link``).
MAX_GONE_LINKS = 1024
MAX_STATE_BYTES = 600_000
MAX_ROW_PAYLOAD = 32 * 1024
#: Re-render rows whose version did not grow, to catch a content change without one (a
#: bug in the version components). The tests turn it on; the worker skips the work.
VERIFY_UNCHANGED = False
FACT_FIELDS = ("pod_uid", "workload_id", "namespace", "pod", "node", "image_digest", "release_id", "model_name", "model_version",
               "environment", "owner", "data_class")
# Fields an event's own identity sets on the entity it belongs to.
ENTITY_FACTS = {"pod": FACT_FIELDS, "wl": ("workload_id", "release_id", "model_name", "model_version", "environment", "owner", "data_class", "namespace")}
IDENTITY_FIELDS = frozenset(Identity.model_fields)


def digest(obj) -> str:
    return hashlib.blake2b(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS, default=str), digest_size=12).hexdigest()


def new_entity(key: str) -> dict:
    return {"key": key, "rows": {}, "links": {}, "sent": {}, "allocs": {}, "fwd": {}, "interests": [], "detached": 0, "ctl": []}


@dataclass
class Outcome:
    correlated: list[dict] = field(default_factory=list)   # CorrelatedEvent-shaped dicts
    allocations: list[dict] = field(default_factory=list)  # GpuAllocation-shaped dicts
    forwards: list[tuple[str, dict]] = field(default_factory=list)
    parked: list[tuple[str, str]] = field(default_factory=list)  # (occurred_at iso, row id) newly parked
    conflicts: int = 0


# --- folding inputs into state ---------------------------------------------------------

def iso(value: str | None) -> str | None:
    """A JSON time as the one format every sort key in streams uses (``isoformat()``,
    ``+00:00``): ``Z``-suffixed times would sort wrongly against it."""
    return utc_isoformat(value) if value else None


def event_row(event: dict, kind: str, src) -> dict:
    """The row an event becomes in the state of its entity (``kind``: the entity key's,
    ``kind_of``; ``src``: the raw record's topic, partition and offset) — a function of the
    event alone (its routed form, ``routing.routed_event``), so the route stage builds it
    (``streams.correlate.route``: a process of its own, while the correlation process is
    the worker's busiest) and the correlation stage only folds it in (``fold_row``)."""
    eid = event["event_id"]
    etype = event["event_type"]
    at = iso(event["occurred_at"])
    ident = {k: v for k, v in (event.get("identity") or {}).items() if v not in (None, "")}
    payload = event.get("payload") or {}
    facts = {}
    gpu = None
    if kind in ENTITY_FACTS:
        facts = {name: ident[name] for name in ENTITY_FACTS[kind] if name in ident}
        if etype.startswith("alert."):
            # An alert's environment label is its rule's, not the pod's: as the pod's fact it set the pod's
            # rows' environment and made it the pod's own (``environment_labelled``) — a Prometheus rule
            # labelled environment=dev withdrew the control 1 violation of a prod workload (review).
            facts.pop("environment", None)
        if etype.startswith("scheduler.") and kind == "pod" and payload.get("image_digests"):
            facts["image_digest"] = payload["image_digests"][0]
        if etype in ("gpu.assigned", "gpu.released"):
            gpu = [f"{payload.get('node')}|{payload.get('device_id')}|{payload.get('container') or ''}|{payload.get('resource_name')}",
                   "a" if etype == "gpu.assigned" else "r", payload.get("gpu"), payload.get("mig_instance")]
    row = {
        "id": eid, "type": etype, "at": at, "key": f"{at}|{eid}", "identity": ident, "facts": facts, "gpu": gpu,
        "summary": summarize(etype, payload), "topic": src[0], "partition": src[1], "offset": src[2],
        "payload": bounded_payload(payload, f"{src[0]}[{src[1]}]@{src[2]} ({etype} {eid})"), "starts_at": iso(payload.get("starts_at")) if etype.startswith("alert.") else None,
        "expired": False, "parked": False,
    }
    if etype.startswith("alert.") and (instance := gpu_instance(payload.get("labels") or {})):
        row["gpu_instance"] = instance
    if etype == "gpu.device":
        row["device"] = {"gpu": payload.get("gpu"), "mig": payload.get("mig_instance"), "profile": payload.get("profile")}
    if etype in CLAIM_EVENTS:
        row["claim"] = [f"{payload.get('node')}|{payload.get('device_id')}|{payload.get('resource_name')}",
                        CLAIM_EVENTS[etype], payload.get("reason")]
    return row


def fold_row(state: dict, row: dict) -> bool:
    """Fold one event's row (``event_row``, for this entity's kind; a dict of its own, which
    the state keeps and changes in place) into ``state``; False when it was already folded
    (re-delivery)."""
    rows = state["rows"]
    if row["id"] in rows or _gone(state, row["id"]):
        return False  # (a row let go past the bound went out before it went: ``_bound``)
    if state.get("key", "").startswith(("pod:", "wl:")):
        state["since"] = min(since_of(state) or row["at"], row["at"])  # (never later, even when rows are let go)
    rows[row["id"]] = row
    _bound(state)
    return True


#: Sets of the longer ``gone_ids`` lists, by the list's id (with the list itself, so that an id
#: reused by another list never matches): a list is searched per fold, and past a burst it holds
#: every id an epoch let go (thousands: a search of 5,000 cost ~50 us a fold). ``trim`` makes a
#: new list each time, so a cached set is never stale; at most ``_GONE_SETS_MAX`` are kept.
_GONE_SETS: dict[int, tuple[list, frozenset]] = {}
_GONE_SETS_MAX = 64


def _gone(state: dict, rid: str) -> bool:
    """Whether ``rid`` is one of the ids ``trim`` let go (``gone_ids``)."""
    gone = state.get("gone_ids")
    if not gone:
        return False
    if len(gone) <= MAX_GONE_IDS:  # (as long as the bound keeps it: searched as it is)
        return rid in gone
    cached = _GONE_SETS.get(id(gone))
    if cached is None or cached[0] is not gone:
        if len(_GONE_SETS) >= _GONE_SETS_MAX:
            _GONE_SETS.clear()
        cached = _GONE_SETS[id(gone)] = (gone, frozenset(gone))
    return rid in cached[1]


#: dcgm-exporter's labels for a MIG instance: ``UUID`` names the physical GPU, these the slice.
GPU_INSTANCE_LABELS = {"gi": "GPU_I_ID", "profile": "GPU_I_PROFILE"}


def gpu_instance(labels: dict) -> dict | None:
    """The MIG instance an alert's labels name (``GPU_I_ID``, ``GPU_I_PROFILE``), or None."""
    found = {k: str(labels[v]) for k, v in GPU_INSTANCE_LABELS.items() if labels.get(v) not in (None, "")}
    return found or None


def bounded_payload(payload: dict, source: str = "") -> str:
    """The payload as JSON, at most MAX_ROW_PAYLOAD bytes: a larger one keeps its short
    top-level fields and says how much was left out (the raw event log keeps it whole;
    counted: ``streams.caps``, ``source`` names the event)."""
    text = orjson.dumps(payload).decode()
    if len(text) <= MAX_ROW_PAYLOAD:
        return text
    capped("payloads_truncated", 1, source, f"a payload of {len(text):,} bytes cut to {MAX_ROW_PAYLOAD:,} (MAX_ROW_PAYLOAD)")
    kept = {k: v for k, v in payload.items() if len(orjson.dumps(v)) <= 1024}
    kept["_truncated_bytes"] = len(text)
    small = orjson.dumps(kept).decode()
    return small if len(small) <= MAX_ROW_PAYLOAD else orjson.dumps({"_truncated_bytes": len(text)}).decode()


def _row_bytes(rec: dict) -> int:
    return len(rec["payload"]) + len(rec["summary"]) + 256


def _needed(state: dict) -> set[str]:
    """The rows ``_bound`` never lets go, whatever their age: those not yet emitted (a row must go
    out once: one let go before it was derived — a late event older than every kept row — was never
    emitted at all), the newest carrier of each fact (``facts_of`` takes a fact from its newest row:
    with it gone, an older value came back at the same version), the start of every interval still
    open (``_held``: with it gone, its GPU looked free) and the end of every interval whose start is
    kept, the pod's last deletion (it closes what is still open), and the newest alert teaching each
    MIG instance its physical GPU (``learned_parents``). The first are bounded by a batch and the rows
    parked within their TTL, the others by the entity's facts, devices and instances. And a pod's: the
    starting row of every allocation it emitted that is no longer among its intervals and not yet
    withdrawn (``_unwithdrawn_starts``: until its refresh withdraws it, within the batch)."""
    rows, sent = state["rows"], state["sent"]
    keep = {rid for rid in rows if rid not in sent}
    newest: dict = {}  # fact name / MIG instance / the deletions -> (row key, row id)
    holding: dict[tuple, list] = defaultdict(list)  # (field, allocation key) -> [(row key, "a" | "r", row id)]
    for rec in rows.values():
        key, rid = rec["key"], rec["id"]
        for name in rec["facts"]:
            if (held := newest.get(("f", name))) is None or held[0] < key:
                newest[("f", name)] = (key, rid)
        if _teaching(rec):
            inst = ("t", rec["identity"].get("gpu_id"), tuple(sorted(rec["gpu_instance"].items())))
            if (held := newest.get(inst)) is None or held[0] < key:
                newest[inst] = (key, rid)
        if rec["type"] == "scheduler.deleted" and ((held := newest.get("deleted")) is None or held[0] < key):
            newest["deleted"] = (key, rid)  # (the pod's last deletion closes what is still open: ``_held``)
        for field in ("gpu", "claim"):
            if op := rec.get(field):
                holding[(field, op[0])].append((key, op[1], rid))
    keep.update(rid for _key, rid in newest.values())
    if state["key"].startswith("pod:") and state["allocs"]:
        keep.update(_unwithdrawn_starts(state))  # (until the refresh withdraws their allocations: ``_withdraw``)
    if state["key"].startswith("pod:") and (inc := _facts_and_runs(state)[3]) is not None:
        # A pod of several incarnations (``Incarnations``): the newest carrier of each incarnation's facts,
        # the first row of each run of uids (where an incarnation starts: the others can go without a row
        # changing incarnation or ``seg_le``), and the newest carrier of each release and look-up value named.
        keys = [entries[-1][0] for mine in inc.own.values() for entries in mine.values()] + inc.run_starts()
        deleted: dict[str, str] = {}  # (each incarnation's last deletion closes what it still held: ``_held``)
        for rec in rows.values():
            if rec["type"] == "scheduler.deleted" and rec["key"] > deleted.get(uid := inc.uid_at(rec["key"]), ""):
                deleted[uid] = rec["key"]
        keys += deleted.values()
        keep.update(key.split("|", 1)[1] for key in keys)
    if state["key"].startswith(("pod:", "wl:")):
        # The newest carrier of each release and look-up value any row named (``named_values``: every row names
        # them all; with its last carrier gone, a value left the set and the versions counting it fell).
        for name in (*NAMED_FACTS, "workload_id"):  # (a pod links to every workload its rows named: ``own_named``)
            last: dict = {}
            for rec in rows.values():
                if name in rec["facts"] and rec["key"] > last.get(rec["facts"][name], ("",))[0]:
                    last[rec["facts"][name]] = (rec["key"], rec["id"])
            keep.update(rid for _key, rid in last.values())
    for ops in holding.values():  # the intervals as ``_held`` reads them
        ops.sort()
        start = None
        for _key, op, rid in ops:
            if op == "a" and start is None:
                start = rid
            elif op == "r" and start is not None:
                if start in keep:
                    keep.add(rid)  # a start kept keeps its end (without it, the interval would open again)
                start = None
        if start is not None:
            keep.add(start)  # still open
    return keep


def state_written(state: dict) -> bool:
    """The store has just encoded ``state`` for its changelog (``PartitionStore(on_written=...)``):
    the ids ``trim`` let go before the write before this one are no longer needed past
    ``MAX_GONE_IDS`` (their events' offsets are committed by now). In memory only: a state
    recovered from this record still keeps them, which only keeps more. True when that changed
    the state (the store then keeps the record for its snapshot, which must hold what the
    changelog holds)."""
    since = state.get("gone_w")
    if since is None or since == [0, since[0]]:
        return False
    since[0], since[1] = 0, since[0]
    return True


def _keep_rank(rec: dict) -> tuple:
    """The order ``_bound`` keeps the other rows in: the entity's own (scheduler, GPU, admission:
    a pod's facts and holding intervals) before alerts, the newest first in each. An alert-heavy
    pod — one flapping alert on a long-lived inference pod is a row per state change — lets its
    oldest alerts go, not its assignment (which, let go, made its allocation and every later alert
    unattributed)."""
    return not rec["type"].startswith("alert."), rec["key"]


def _teaching(rec: dict) -> bool:
    """An alert row that can teach a MIG slice its physical GPU (``learned_parents``)."""
    return bool(rec.get("gpu_instance")) and rec["identity"].get("gpu_id", "").startswith("GPU-")


#: Past a bound, ``_bound`` lets rows go down to this share of it, so that it sorts the rows once
#: per tenth of the bound rather than at every event (a sort of every row and two ``facts_of`` per
#: fold cost a pod at the cap ~2.5 ms per event, against 0.2 without them).
TRIM_TO = 0.9
#: Ids of rows let go that ``fold_row`` still recognises (a re-delivered event whose row went is
#: not folded again: it went out already, and folded again it counted twice in ``gone_facts``) —
#: at least these many, and every one let go since the state's record before its last (``trim``).
MAX_GONE_IDS = 256
#: Alert fingerprints an entity keeps sending to the controls stage (``ctl``, ``for_controls``) past
#: their rows (``trim``).
MAX_CTL_FPS = 1024


def _bound(state: dict) -> None:
    """Keep the rows within MAX_ROWS and MAX_STATE_BYTES: past either, let the rows ``_needed``
    does not name go, in ``_keep_rank``'s order, down to ``TRIM_TO`` of both (the state may stay
    over a bound by the needed rows: a batch's, the parked ones until they go out). What the rows
    let go added to the versions stays (``state["gone_facts"]``: the runs of facts they took with
    them; ``state["gone_teach"]``: the MIG-teaching alerts among them), so letting rows go lowers no
    row's version (else a re-derived row went out below its earlier version, and the stale one won
    in the tables); their ids are remembered (``gone_ids``: every one since the state's changelog record
    before its last one, and the last ``MAX_GONE_IDS``: ``trim``)."""
    rows = state["rows"]
    state["bytes"] = state.get("bytes", 0) + _row_bytes(rows[next(reversed(rows))])
    if len(rows) < state.get("retrim_at", 0):
        return  # the last look found only needed rows: not again before a tenth of the bound more (or the refresh's)
    trim(state)


def trim(state: dict) -> None:
    """``_bound`` without a new row: after a refresh emitted the rows ``_bound`` had to keep."""
    rows = state["rows"]
    state.pop("retrim_at", None)
    if len(rows) <= MAX_ROWS and state.get("bytes", 0) <= MAX_STATE_BYTES:
        return
    needed = _needed(state)
    n_room, budget = int(MAX_ROWS * TRIM_TO), int(MAX_STATE_BYTES * TRIM_TO)
    n_room -= len(needed)
    budget -= sum(_row_bytes(rows[rid]) for rid in needed)
    ordered = sorted((r for r in rows.values() if r["id"] not in needed), key=_keep_rank, reverse=True)
    going = []
    for i, rec in enumerate(ordered):
        budget -= _row_bytes(rec)
        if i >= n_room or budget < 0:
            going = ordered[i:]
            break
    going = _whole_holdings(rows, going)
    if not going:
        # Over a bound by needed rows only (a batch's, not yet out): a fold looks again only a tenth of
        # the bound later (each look walks every row: at every fold of a large batch it cost ~0.7 ms
        # a fold), the refresh's ``trim`` at once.
        state["bytes"] = sum(_row_bytes(r) for r in rows.values())
        state["retrim_at"] = len(rows) + max(1, MAX_ROWS - int(MAX_ROWS * TRIM_TO))
        return
    _, facts_before, _, inc, _ = _facts_and_runs(state)
    if inc is not None:
        facts_before = inc.const
    sent = state["sent"]
    for old in going:
        del rows[old["id"]]
        sent.pop(old["id"], None)
    state["gone_facts"] = state.get("gone_facts", 0) + facts_before - facts_of(state)[1]
    for old in going:  # what the MIG parents' and the intervals' versions counted (``learned_parents``, ``_held``)
        # (a pod of several incarnations: with the runs of uids up to the row, which ``_held`` counts per row)
        counted = 1 if inc is None else 1 + inc.seg_le(old["key"])
        if _teaching(old):
            state["gone_teach"] = state.get("gone_teach", 0) + 1
        for field in ("gpu", "claim"):
            if op := old.get(field):
                held = state.setdefault("gone_held", {})
                held[f"{field}|{op[0]}"] = held.get(f"{field}|{op[0]}", 0) + counted
        if old["type"] == "scheduler.deleted":
            state["gone_deleted"] = state.get("gone_deleted", 0) + counted
    # Every id let go since the state's changelog record before its last one (``state_written``), however
    # many, and of the ones before as many as leaves MAX_GONE_IDS in all. A crash after a state's
    # record was written and before its epoch's offsets were committed delivers the epoch again —
    # events folded since the epoch before closed, possibly before that epoch's record was
    # written, so two writes back — and each of their rows let go must be refused: with only
    # the last MAX_GONE_IDS kept, a batch (or an epoch of them) past the bound folded the rest
    # again, out a second time and counted twice in the versions.
    since = state.setdefault("gone_w", [0, 0])  # ids let go since the last write, and between the two before
    since[0] += len(going)
    state["gone_ids"] = (state.get("gone_ids", []) + [old["id"] for old in going])[-max(MAX_GONE_IDS, since[0] + since[1]):]
    state["detached"] += len(going)
    capped("rows_detached", len(going), state["key"],
           f"rows let go past {MAX_ROWS:,} rows or {MAX_STATE_BYTES:,} bytes of row text (MAX_ROWS, MAX_STATE_BYTES): "
           "alerts before the entity's own rows, the oldest first; never a row not yet emitted, nor one its facts, "
           "open intervals or MIG parents come from, nor part of an ended GPU holding")
    state["bytes"] = sum(_row_bytes(r) for r in rows.values())
    ctl = state.get("ctl")
    if ctl and len(ctl) > MAX_CTL_FPS:
        # A tracked fingerprint stays tracked when its rows go: a later row of one of its episodes
        # can still come out joined (an assignment that covered it, told late) and must reach the
        # controls to withdraw the episode's violation (pruned with its rows, it was never sent, and
        # the violation stayed open for ever). Bounded apart: past MAX_CTL_FPS the oldest tracked
        # whose rows are all gone go first.
        kept = {_fingerprint(r["identity"], r["id"]) for r in rows.values() if r["type"].startswith("alert.")}
        going_fps = set([fp for fp in ctl if fp not in kept][:len(ctl) - MAX_CTL_FPS])
        state["ctl"] = [fp for fp in ctl if fp not in going_fps]
        capped("control_fingerprints_detached", len(going_fps), state["key"],
               f"alert fingerprints no longer sent to the controls past {MAX_CTL_FPS:,} tracked (MAX_CTL_FPS): "
               "the oldest whose rows were all let go")


def _whole_holdings(rows: dict, going: list[dict]) -> list[dict]:
    """``going`` less the rows of an ended GPU holding some of whose rows stay: its rows (its start, the
    reports repeated while it was held, its end — per allocation key, as ``_held`` reads them) go all
    together or not at all. One let go in part started again at a repeated report that stayed: the same
    holding went out again under that report's id beside the first (whose starting row was gone: it
    could not be withdrawn, ``_withdraw``). An open holding's repeated reports may go (its start is
    needed and stays: ``_needed``; a kubelet collector re-lists what is held at every restart)."""
    if not any(rec.get("gpu") or rec.get("claim") for rec in going):
        return going
    going_ids = {rec["id"] for rec in going}
    per: dict[str, list[dict]] = defaultdict(list)
    for rec in rows.values():
        for field in ("gpu", "claim"):
            if op := rec.get(field):
                per[f"{field}|{op[0]}"].append(rec)
    stay: set[str] = set()
    for recs in per.values():
        if not any(rec["id"] in going_ids for rec in recs):
            continue
        recs.sort(key=itemgetter("key"))
        group: list[str] = []  # the holding open so far: its start and repeated reports
        for rec in recs:
            if (rec.get("gpu") or rec.get("claim"))[1] == "a":
                group.append(rec["id"])
            elif group:  # its end
                group.append(rec["id"])
                gone = [rid for rid in group if rid in going_ids]
                if gone and len(gone) < len(group):
                    stay.update(gone)
                group = []
            # (an end with none open: ``_held`` reads nothing of it, it goes alone)
    return [rec for rec in going if rec["id"] not in stay] if stay else going


def fold_link(state: dict, source: str, link: dict) -> bool:
    """Keep the highest version of the link from ``source``; True when it changed."""
    current = state["links"].get(source)
    if current is not None:
        if link.get("v", 0) < current.get("v", 0):
            return False
        if link.get("v", 0) == current.get("v", 0) and (link == current or digest(link) <= digest(current)):
            # Same version: keep one deterministically. (The same content again — every pod's link
            # is forwarded to its node/GPU twice in the bench mix — is told by comparing, in C,
            # before two digests, each an encoding: 2.5 % of a live worker's samples.)
            return False
    links = state["links"]
    gpu = state["key"].startswith("gpu:")
    if current is None and len(links) == MAX_LINKS and (_link_newest(link), source) < _least(links, 1)[0]:
        # It would go at once, the least of all: not attached. A node/GPU's is not kept in ``gone``
        # either — mostly a detached holder's link forwarded again (a release event makes every pod
        # of the release forward its links again); kept, it would count twice (``_let_go``). Another
        # entity's (a workload's pods, by name: they hold no intervals) keeps its version
        # (``_gone_link``) — a True when it grew. Not counted as detached (it never was attached),
        # and the state is left as it was: a state changed in memory without being put is not
        # its changelog record (and a local snapshot of it would not be: ``PartitionStore._records``).
        return False if gpu else _gone_link(state, source, link)
    if gpu and current is None and (gone := state.get("gone")):
        # A detached holder's link that comes back (a later allocation of the GPU to the same
        # pod): its step leaves ``gone`` — the link counts again, not twice.
        for k, step in enumerate(gone["steps"]):
            if step[3] == source:
                del gone["steps"][k]
                break
    links[source] = link
    if len(links) > MAX_LINKS:
        # The links that can matter least: those whose latest interval started earliest
        # (a function of the link set, so the survivors do not depend on arrival order).
        least = [src for _newest, src in _least(links, len(links) - MAX_LINKS)]
        gone = state.setdefault("gone", {"steps": [], "rids": {}}) if gpu else None
        for src in least:
            if gone is not None:
                _let_go(gone, src, links[src])
            else:
                _gone_link(state, src, links[src])
            del links[src]
            state["detached"] += 1
        capped("links_detached", len(least), state["key"], _detached())
    return source in links


def _gone_link(state: dict, source: str, link: dict) -> bool:
    """Keep the version of a link let go past ``MAX_LINKS`` by an entity other than a node/GPU (a
    workload's pods): ``state["gone_links"]``, per source the highest version it had (``{"v": …}``),
    counted in the entity's version as the link was (``links_version``) — so letting it go lowers
    no version, and one forwarded again (every pod of a release forwards again after a release
    event) counts its newer version once. A workload's links go by name (they hold no intervals),
    so a pod let go is let go whatever the order: the kept links and the versions are those of the
    whole link set. At most ``MAX_GONE_LINKS`` sources are kept by name (the least by name go
    first; their versions stay in ``extra``): one of those forwarded again counts its version again
    — a version too high, never one too low. And the releases it named (its ``release_id`` and
    ``rids``: ``gone_links["rids"]``), which the entity's rows still name (``link_rids``): with the
    link they left the set its rows' versions count, and those fell. True when either grew."""
    gone = state.setdefault("gone_links", {"v": {}, "extra": 0})
    named = {link["release_id"]} if link.get("release_id") else set()
    named.update(link.get("rids", ()))
    grew = False
    if named - set(gone.get("rids", ())):
        gone["rids"] = sorted(named.union(gone.get("rids", ())))
        grew = True
    v = link.get("v", 0)
    versions = gone["v"]
    old = versions.get(source)
    if old is not None and v <= old:
        return grew
    versions[source] = v
    if len(versions) > MAX_GONE_LINKS:
        least = min(versions)
        gone["extra"] += versions.pop(least)
    return True


def _detached() -> str:
    return f"links detached past {MAX_LINKS} (MAX_LINKS): those whose latest interval started earliest (a node/GPU's oldest holders) go first"


def _least(links: dict, n: int) -> list[tuple[str, str]]:
    """The ``_newest_item`` keys of the ``n`` links ``fold_link`` evicts first, least first."""
    if type(links) is JournaledLinks:
        # (a followed node/GPU — the entities that reach the cap, holder after holder — keeps
        # its links in that order as they change: finding the least by walking every link's
        # intervals at each new holder past the cap made each fold cost the whole cap — a long
        # live run's correlation fell behind once its GPUs had 256 holders)
        return links.least_keys(n)
    # (the few least by key, not a sort of every link; keys are unique — the source is in them —
    # so these are exactly the sort's first ones, as ``least_keys`` gives them)
    return heapq.nsmallest(n, map(_newest_item, links.items()))


def _let_go(gone: dict, source: str, link: dict) -> None:
    """What a node/GPU's detached link added to its rows, kept (``state["gone"]``), so that
    letting the link go changes no row's version: ``steps``, per detached link its earliest
    start, its version, the spans of its intervals that ended and its source (a link from it that
    comes back takes its step out: ``fold_link``) — a row counts the versions of
    the steps started by its time, as it counted the links (``gone_prefix``), and a row inside a
    span held (or shared) its time with that link: it keeps what it emitted (``resolve_row``:
    ``forgotten``; never emitted — it came after the link went — it is derived as it is);
    ``rids``, per release the earliest start of a detached interval naming it (a row names those
    started by its time, as it did through the links). A row's version then does not depend on
    whether it was derived before or after a detachment, and a replay that batches otherwise
    stores the same rows and versions (docs/architecture.md, Bounds).

    Bounded: at most ``MAX_GONE_STEPS`` steps — past it the oldest step's version joins the
    next one's, and the rows between their starts no longer count it: their versions fall and
    they emit nothing more (as every row after a detached link did before ``gone``); its spans
    stay (``cut``: the latest end of the steps joined) — and ``MAX_GONE_RIDS`` releases (past
    it the one named earliest goes, and the rows after it fall likewise: a row names every
    release of ``rids`` started by its time, each a version component and an interest).
    """
    intervals = link.get("intervals") or ()
    if not intervals:
        return
    steps = gone["steps"]
    spans = sorted([iv["start"], iv["end"]] for iv in intervals if iv["end"] is not None)
    insort(steps, [min(iv["start"] for iv in intervals), link.get("v", 0), spans, source])
    if len(steps) > MAX_GONE_STEPS:
        _t0, v0, spans0, _source = steps.pop(0)
        steps[0][1] += v0
        if spans0:  # its spans: a row in them still keeps what it emitted
            gone["cut"] = max(gone.get("cut", ""), max(end for _start, end in spans0))
    rids = gone["rids"]
    for iv in intervals:
        for rid in _iv_rids(iv):
            if rid not in rids or iv["start"] < rids[rid]:
                rids[rid] = iv["start"]
    if len(rids) > MAX_GONE_RIDS:  # the release named earliest goes: the rows after it no longer count it (they fall)
        del rids[min(rids, key=lambda rid: (rids[rid], rid))]


def gone_prefix(gone: dict, at: str) -> tuple[int, list[str], bool]:
    """What a row at ``at`` counts of the detached links (``_let_go``): their versions and the
    releases they named by then, and whether an interval of one of them that ended spanned ``at``
    (so held it, or shared it: the row keeps what it emitted). An interval that never reported its
    end spans every later time: a row there is derived as it is (with no other holder,
    unattributed) — kept, it could name a holder whose end came late, one known to have ended
    before it."""
    version, spanned = 0, at < gone.get("cut", "")
    for start, v, spans, _source in gone["steps"]:
        if start > at:
            break
        version += v
        spanned = spanned or any(s <= at < e for s, e in spans)
    return version, [rid for rid, start in gone["rids"].items() if start <= at], spanned


def _link_newest(link: dict) -> str:
    """When the latest interval a link holds started ("" for none): what ``fold_link`` keeps by."""
    return max((iv["start"] for iv in link.get("intervals", ())), default="")


def _newest_item(item: tuple[str, dict]) -> tuple[str, str]:
    return _link_newest(item[1]), item[0]


def expire(state: dict, row_ids: list[str]) -> bool:
    """Mark parked rows whose TTL passed; True when any was still parked."""
    changed = False
    for rid in row_ids:
        rec = state["rows"].get(rid)
        if rec and rec["parked"] and not rec["expired"]:
            rec["expired"] = True
            touched(state["rows"], rid)  # (in place: the store's journal is told)
            changed = True
    return changed


# --- derived facts ----------------------------------------------------------------------

#: The facts a pod's label fallback reads (``resolve_entity``: its label, else its image digest,
#: else its model+version, in its environment) — the version component of its labelled rows.
FALLBACK_FACTS = frozenset({"release_id", "image_digest", "model_name", "model_version", "environment"})
#: The facts that name a release or a look-up (``Incarnations``: every row of a pod of several names
#: every value any of its rows named; ``_needed`` keeps the newest carrier of each).
NAMED_FACTS = ("release_id", "image_digest", "model_name", "model_version")


def facts_of(state: dict) -> tuple[dict, int]:
    """(facts, version component): per field the latest event's value, and the number of
    runs of equal values per field summed (a pod of several incarnations: with what its
    incarnations add, ``Incarnations.const`` — what ``trim`` keeps in ``gone_facts``)."""
    facts, version, _, inc, _ = _facts_and_runs(state)
    return facts, version if inc is None else inc.const


def _facts_and_runs(state: dict, fields: frozenset[str] = frozenset()) -> tuple[dict, int, int, Incarnations | None, dict]:
    """``facts_of``, and the same version component for ``fields`` only (with the part of it
    rows let go took: ``gone_facts`` is all fields', and only grows, so the partial one never
    drops when rows go) — from one pass over the rows; and a pod's ``Incarnations`` when its
    rows name more than one pod uid (else None: one incarnation, the facts are the pod's)."""
    per: dict[str, list] = defaultdict(list)
    for rec in state["rows"].values():
        key = rec["key"]
        for name, value in rec["facts"].items():
            per[name].append([key, value])
    gone = state.get("gone_facts", 0)  # (what rows let go took with them: ``_bound``)
    facts, version, partial = {}, gone, gone
    for name, entries in per.items():
        runs = segments(entries)
        version += runs
        if name in fields:
            partial += runs
        facts[name] = entries[-1][1]
    inc = None
    uids = per.get("pod_uid")
    if uids and state["key"].startswith("pod:") and any(uid != uids[0][1] for _key, uid in uids):
        inc = Incarnations([r for r in state["rows"].values() if "pod_uid" in r["facts"]], version, partial, fields, per)
    return facts, version, partial, inc, per


def _several_named(per: dict[str, list]) -> bool:
    """Whether a fact ``named_values`` reads had more than one value among the rows."""
    for name in NAMED_FACTS:
        entries = per.get(name)
        if entries and len(entries) > 1:
            first = entries[0][1]
            if any(value != first for _key, value in entries):
                return True
    return False


def named_values(per: dict[str, list]) -> tuple[list[str], list[str]]:
    """Every release and look-up any of a pod's or workload's rows named (``per``: a fact's
    ``[key, value]`` entries, as ``_facts_and_runs`` gathers them), which every row of it names:
    a set that only grows as rows arrive (``_needed`` keeps the newest carrier of each value).
    The latest values' alone lost one when a fact changed — a pod relabelled from one model to
    another, a release label replaced — and the versions counting its candidates fell with it:
    rows changed at a version no higher than before (a shuffled-order probe: 93 conflicts in 40
    orders), and a run kept whichever it emitted last."""
    values = {name: sorted({value for _key, value in per.get(name, ())}) for name in NAMED_FACTS}
    models = values["model_name"]
    lookups = [*(key for d in values["image_digest"] for key in interests_for(image_digest=d)),
               *(key for m in models for key in interests_for(model_name=m)),
               *(interests_for(model_name=m, model_version=v)[-1] for m in models for v in values["model_version"])]
    return values["release_id"], lookups


class Incarnations:
    """A pod name's incarnations — the pods of one namespace/name told apart by their uid (a
    StatefulSet's ``ml/srv-0`` deleted and created again; a training operator's pod re-created
    after a failure) — when its rows name more than one uid. One entity holds them all (the
    kubelet's ``gpu.assigned``/``gpu.released`` and the alerts name the pod, not its uid), so:

    - a row's incarnation is the uid of the last row carrying one at or before the row's
      ``_point`` (its key; an alert's start), else the earliest's (``uid_at``);
    - an incarnation's facts are the latest of its own rows' (those carrying its uid) — a
      row without a uid cannot be told to belong to one before the uids around it arrive,
      and taken as latest it rewrote the other incarnation (the review's bug: the second
      pod's release and uid on the first one's allocation and alerts);
    - versions (module docstring): a row counts ``const`` — the pod's runs of facts over all
      its rows as with one incarnation, plus the runs of every incarnation's own facts, plus
      the runs of uids in key order — and ``seg_le`` of its point: the runs of uids up to it,
      which grow whenever the row's incarnation can change (the last uid up to it, or the
      earliest when there is none: ``seg_all``, in ``const``). Each only grows as rows are
      added, whatever their order; ``const`` is at least the one-incarnation component plus 2,
      so nothing falls when a second uid arrives. Every release and look-up any row's facts
      named is named by every row (``named``, ``lookups``), and a holder interval names every
      release the incarnations resolve to on its node/GPU (``_iv_rids``): a row or interval
      moving to another incarnation does not stop counting a release's versions. What does not
      grow with each event: a new row repeating its incarnation's facts, a uid repeating the last.
    """

    __slots__ = ("keys", "uids", "runs", "facts", "own", "const", "partial_const", "res", "named", "lookups")

    def __init__(self, rows: list[dict], version: int, partial: int, fields: frozenset[str], per: dict[str, list]) -> None:
        rows = sorted(rows, key=itemgetter("key"))
        self.keys = [rec["key"] for rec in rows]
        self.uids = [rec["facts"]["pod_uid"] for rec in rows]
        self.runs = [0]  # runs[k]: the runs of uids among the first k
        for k, uid in enumerate(self.uids):
            self.runs.append(self.runs[-1] + (k == 0 or uid != self.uids[k - 1]))
        own: dict[str, dict[str, list]] = {}
        for rec in rows:
            mine = own.setdefault(rec["facts"]["pod_uid"], {})
            for name, value in rec["facts"].items():
                mine.setdefault(name, []).append([rec["key"], value])
        self.facts: dict[str, dict] = {}
        own_v = own_partial = 0
        for uid, mine in own.items():
            for name, entries in mine.items():
                runs = segments(entries)
                own_v += runs
                if name in fields:
                    own_partial += runs
            self.facts[uid] = {name: entries[-1][1] for name, entries in mine.items()}
        self.own = own  # (the newest carrier of each incarnation's fact: ``_needed``)
        self.const = version + own_v + self.runs[-1]
        self.partial_const = partial + own_partial + self.runs[-1]
        self.res: dict[str, Resolution] = {}
        self.named, self.lookups = named_values(per)

    def uid_at(self, point: str) -> str:
        k = bisect_right(self.keys, point)
        return self.uids[k - 1] if k else self.uids[0]

    def seg_le(self, point: str) -> int:
        return self.runs[bisect_right(self.keys, point)]

    def latest(self) -> str:
        return self.uids[-1]

    def run_starts(self) -> list[str]:
        """The keys of the first row of each run of uids: letting one go would move where an
        incarnation starts (``_needed`` keeps them)."""
        return [self.keys[k] for k in range(len(self.keys)) if k == 0 or self.uids[k] != self.uids[k - 1]]

    def at(self, point: str) -> Resolution:
        """The resolution of a row at ``point``: its incarnation's, with ``seg_le`` of it."""
        k = bisect_right(self.keys, point)
        res, s = self.res[self.uids[k - 1] if k else self.uids[0]], self.runs[k]
        return replace(res, base=res.base + s, facts_version=res.facts_version + s, fallback_version=res.fallback_version + s)


def _point(rec: dict) -> str:
    """When a row happened, for its incarnation (``Incarnations``): an alert's start (a resolved
    alert is about the pod that was there when it fired), else its key."""
    return f"{rec['starts_at']}|{rec['id']}" if rec.get("starts_at") else rec["key"]


def links_version(links: dict, gone: dict | None = None) -> int:
    """The links' versions summed, with those of the links let go (``gone``: ``state["gone_links"]``)."""
    total = sum(link.get("v", 0) for link in links.values())
    return total if not gone else total + gone["extra"] + sum(gone["v"].values())


@dataclass
class Resolution:
    """How an entity (or one row) resolves its release, and what that depends on."""

    identity: dict
    attribution: str
    release_id: str | None
    interests: list[str]
    named: tuple[str, ...] = ()        # releases named directly (label, link): version_at counts
    candidates: tuple[str, ...] = ()   # look-up interests consulted: candidates' counts
    base: int = 0                      # facts + links components
    facts_version: int = 0
    unknown_named: str | None = None   # the release id a label names that no release event describes (a fallback rule attributed it)
    forgotten: bool = False            # a node/GPU row inside a detached holder's interval: it keeps what it emitted (``_let_go``)
    fallback_version: int = 0          # a pod/workload entity's: the runs of the facts its label fallback reads (``_labelled``)
    incarnations: Incarnations | None = None  # a pod of several incarnations: its rows resolve by theirs (``Incarnations.at``)

    def unresolved(self, directory) -> bool:
        return self.attribution == "unattributed" or (self.release_id is not None and not directory.known(self.release_id))

    def version(self, directory, at_iso: str | None) -> int:
        return self.base + directory.versions_at(self.named, at_iso) + directory.candidates_version(self.candidates)


UNATTRIBUTED = Resolution({}, "unattributed", None, [])
#: A label names a release no release event describes: attribute by immutable identity instead,
#: under a rule name that says so (control 3 flags the mismatch).
FALLBACK = {"image_digest_match": "image_digest_fallback", "model_version_match": "model_version_fallback"}


def fallback_match(directory, digest: str | None, model: str | None, version: str | None, env: str | None,
                   at_iso: str | None = None) -> tuple[str | None, str]:
    """The release an image digest, else a model (+version), points to — the fallbacks'
    one order (the digest is immutable, the model+version only a name). ``at_iso``: a row's own
    time, for a row's own facts — the release serving then (``ReleaseDirectory._serving_at``)."""
    if (match := directory.by_image_digest(digest, env, at_iso, model, version)):
        return match, "image_digest_match"
    if model and (match := directory.by_model_version(model, version, env, at_iso)):
        return match, "model_version_match"
    return None, "unattributed"


def resolve_entity(state: dict, directory) -> Resolution:
    """Resolution of a pod or workload entity from its facts and links. A pod of several
    incarnations (``Incarnations``): its latest incarnation's, carrying every incarnation's
    (``Resolution.incarnations``), by which each of its rows resolves (``resolve_row``)."""
    f, fv, fallback_v, inc, per = _facts_and_runs(state, FALLBACK_FACTS)
    pod = state["key"].startswith("pod:")
    linked = sorted((src, link["release_id"]) for src, link in state["links"].items() if link.get("release_id"))
    since = since_of(state)
    # What the related entity's link says it could name (``link_rids``): the set only grows, where its
    # ``release_id`` can move from one release to another and the one left stopped counting here.
    also = link_rids(state["links"], state.get("gone_links"))
    if inc is None:
        # (one value per named fact — nearly every pod and workload — names nothing its latest facts do not)
        named, lookups = named_values(per) if _several_named(per) else ((), ())
        named = (*named, *also)
        return _resolve_facts(f, directory, linked, named, lookups, fv + links_version(state["links"], state.get("gone_links")), fv, fallback_v,
                              since, pod)
    # Every release and look-up any of its rows named is named by all of them (``Incarnations.named``): none
    # stops counting when a row moves to another incarnation, or a second uid arrives.
    base = inc.const + links_version(state["links"], state.get("gone_links"))
    for uid, facts in inc.facts.items():
        inc.res[uid] = _resolve_facts(facts, directory, linked, (*inc.named, *also), inc.lookups, base, inc.const, inc.partial_const, since,
                                      True)
    interests = sorted({i for res in inc.res.values() for i in res.interests})
    for res in inc.res.values():
        res.interests = interests
        res.incarnations = inc
    # (the pod as a whole — its interests, what it forwards to its workload: its latest incarnation, now)
    return inc.at("\uffff")


def link_rids(links: dict, gone: dict | None = None) -> tuple[str, ...]:
    """Every release the pods' and workload's links say their sender could name (``rids``: its own rows'
    release labels, and a pod's look-ups' candidates — ``own_named``), which a row of the receiver names:
    a link's ``release_id`` moves (a pod picking another release as an earlier row of it arrives, a
    label replaced) while the receiver's rows counted the one it named before — they fell (a review's
    probe: a workload row went from r0 at 36 to r3 at 30)."""
    rids = {rid for link in links.values() for rid in link.get("rids", ())}
    if gone and gone.get("rids"):
        rids.update(gone["rids"])  # (and those of the links let go past ``MAX_LINKS``: ``_gone_link``)
    return tuple(sorted(rids))


def own_named(state: dict) -> tuple[set[str], set[str]]:
    """The release labels an entity's own rows carry (every value: ``_needed`` keeps a carrier of each) —
    with a pod's look-ups' candidates, what its links carry (``link_rids``) —, and every workload its rows
    named (likewise kept): the workloads a pod links to (``_refresh_pod``)."""
    rids, workloads = set(), set()
    for rec in state["rows"].values():
        facts = rec["facts"]
        if "release_id" in facts:
            rids.add(facts["release_id"])
        if "workload_id" in facts:
            workloads.add(facts["workload_id"])
    return rids, workloads


def since_of(state: dict) -> str | None:
    """When a pod or workload began, for its own look-ups (``_resolve_facts``): its earliest row's
    time — kept in the state as rows are folded (``fold_row``), so it is never later than before,
    even when rows are let go past the cap; a state written before it was kept: its rows' earliest."""
    return state.get("since") or min((rec["at"] for rec in state["rows"].values()), default=None)


def _resolve_facts(f: dict, directory, linked: list, also_named, also_lookups, base: int, fv: int, fallback_v: int,
                   since: str | None = None, pod: bool = False) -> Resolution:
    """``resolve_entity`` of facts ``f`` (``also_*``: releases and look-ups named besides its own).

    Its own look-ups (an image digest or model that several releases answer) take the release
    serving when the pod or workload began (``since``: ``ReleaseDirectory._serving_at``), as a
    row's own look-up takes the one serving at the row's time: by their latest events overall, a
    pod labelled only with its model went to the model's newest release — one registered after
    the pod ended, or a staging release never promoted. That choice is a function of which of the
    candidates' events are after ``since``, and ``since`` only moves earlier as rows arrive, so
    the count of those events (``ReleaseDirectory.after``, of the look-ups more than one release
    answered) only grows: it is in every version the choice reaches."""
    env = f.get("environment")
    lookups = interests_for(f.get("image_digest"), f.get("model_name"), f.get("model_version"))
    if also_lookups:
        lookups = list(dict.fromkeys([*lookups, *also_lookups]))
    if since is not None and (after := directory.after(lookups, since)):
        base, fv, fallback_v = base + after, fv + after, fallback_v + after
    named = tuple(sorted(({f["release_id"]} if f.get("release_id") else set()) | {rid for _, rid in linked} | set(also_named)))
    if pod:
        # (a pod takes the release of the workload its facts name now; a link from one it named before — a
        # pod moved, or an earlier row of it that arrived late — is still counted, never followed)
        linked = [(src, rid) for src, rid in linked if src == f"wl:{f.get('workload_id')}"]
    rid, how, unknown = None, "unattributed", None
    if f.get("release_id"):
        rid, how = f["release_id"], "release_label"
        if not directory.known(rid):
            match, rule = fallback_match(directory, f.get("image_digest"), f.get("model_name"), f.get("model_version"), env, since)
            if match:
                rid, how, unknown = match, FALLBACK[rule], f["release_id"]
    elif linked:
        rid, how = linked[0][1], "workload_release"
    else:
        rid, how = fallback_match(directory, f.get("image_digest"), f.get("model_name"), f.get("model_version"), env, since)
    interests = lookups + [f"rid:{r}" for r in named] + ([f"rid:{rid}"] if rid and rid not in named else [])
    return Resolution(f, how, rid, interests, named, tuple(lookups), base, fv, unknown, fallback_version=fallback_v)



def own_release(state: dict, directory, facts: dict) -> tuple[str | None, str]:
    """A pod's release from its own facts only (never from links): what it forwards (its look-ups
    as of when it began, as ``_resolve_facts``'s)."""
    if facts.get("release_id"):
        return facts["release_id"], "release_label"
    return fallback_match(directory, facts.get("image_digest"), facts.get("model_name"), facts.get("model_version"), facts.get("environment"),
                          since_of(state))


def learned_parents(state: dict, spans: list[dict]) -> tuple[dict[str, dict], int]:
    """MIG device -> {gpu, gi, profile} a pod's own DCGM alerts prove, and the version
    component (the number of alert rows that can teach it).

    dcgm-exporter names a MIG instance by its physical GPU (``UUID=GPU-…``) plus
    ``GPU_I_ID``/``GPU_I_PROFILE``, and — with pod mapping — the pod holding it. When
    that pod held exactly one MIG device on the alert's node at its ``startsAt`` (of
    that profile, when the profile is named), that device is a slice of that GPU.
    The latest alert wins (sort key), so the answer is independent of arrival order."""
    # (the test of ``_teaching`` inline: a call per row of every refresh of a pod was a fifth of it near the cap)
    teaching = sorted((r for r in state["rows"].values() if r.get("gpu_instance") and r["identity"].get("gpu_id", "").startswith("GPU-")),
                      key=lambda r: r["key"])
    out: dict[str, dict] = {}
    for rec in teaching:
        at, node, inst = rec["starts_at"] or rec["at"], rec["identity"].get("node"), rec["gpu_instance"]
        held = {iv["device"] for iv in spans if iv["mig"] and not iv["gpu"] and (node is None or iv["node"] == node)
                and iv["start"] <= at and (iv["end"] is None or at < iv["end"])
                and (not inst.get("profile") or iv["resource"].endswith(inst["profile"]))}
        if len(held) == 1:
            out[held.pop()] = {"gpu": rec["identity"]["gpu_id"], **inst, "source": "dcgm_alert"}
    return out, len(teaching) + state.get("gone_teach", 0)  # (teaching rows let go still count: ``_bound``)


def dra_devices(state: dict) -> dict[str, dict]:
    """What the DRA devices a pod holds are (device id -> gpu, mig, profile), as the
    devices' entities forwarded it from their ResourceSlice (``device_link``); the links'
    versions are part of the pod's (``links_version``)."""
    return {link["device"]["id"]: link["device"] for link in state["links"].values() if link.get("device")}


def device_link(state: dict) -> tuple[dict | None, int]:
    """A DRA device entity's identity from its ``gpu.device`` rows (the latest wins) and the
    version component (runs of equal values, ``segments``)."""
    rows = [[r["key"], r["device"]] for r in state["rows"].values() if r.get("device")]
    if not rows:
        return None, 0
    version = segments(rows)
    return {"id": state["key"].split("/", 1)[1], **rows[-1][1]}, version


def intervals(state: dict, inc=...) -> list[dict]:
    """Allocation intervals derived from a pod's gpu rows (order-independent), each with
    the number of gpu events and deletions it was derived from; a MIG slice whose
    physical GPU is not in its id gets it from ``learned_parents``; a DRA device's
    kubelet and ResourceClaim reports are one interval (``merge_dra``). ``inc``: the pod's
    ``Incarnations`` (None: one; left out: found here) — an interval is its starting row's
    incarnation's, and only that incarnation's deletion ends it (``_held``)."""
    if inc is ...:
        inc = _facts_and_runs(state)[3]
    spans = merge_dra(state, _spans(state, inc), inc)
    dra = dra_devices(state)
    for iv in spans:
        if (known := dra.get(iv["device"])) and not iv["gpu"] and not iv["mig"]:
            iv.update(gpu=known["gpu"], mig=known["mig"], profile=known.get("profile"), dra=True)
    parents, learned_v = learned_parents(state, spans)
    for iv in spans:
        if iv["mig"] and not iv["gpu"]:
            iv["v"] += learned_v
            if (parent := parents.get(iv["device"])):
                iv.update(gpu=parent["gpu"], gi=parent.get("gi"), profile=parent.get("profile"), parent_source=parent["source"])
    return spans


def _spans(state: dict, inc: Incarnations | None = None) -> list[dict]:
    """Device-plugin / kubelet intervals from a pod's ``gpu.assigned``/``gpu.released`` rows."""
    def opened(akey: str, rec: dict) -> dict:
        node, device, container, resource = akey.split("|", 3)
        _akey, _op, gpu, mig = rec["gpu"]
        return {"node": node, "device": device, "container": container or None, "resource": resource, "gpu": gpu, "mig": mig}

    return _held(state, "gpu", opened, lambda _rec: "released", inc)


def _held(state: dict, field: str, opened, end_reason, inc: Incarnations | None = None) -> list[dict]:
    """Intervals from the rows carrying ``field`` (``[allocation key, "a" | "r", …]``),
    per allocation key in event order (sort key): an "a" opens one (``opened(key, row)``
    gives its identity), an "r" closes it (``end_reason(row)``), the pod's last deletion
    closes one still open. Each carries the number of its key's rows and the pod's
    deletions it was derived from (``v``).

    A pod of several incarnations (``inc``): the last deletion of the incarnation the
    interval started in closes it (another's deletion, later, is not its end), and ``v``
    adds, per row of its key and per deletion, the runs of uids up to it
    (``Incarnations.seg_le``): which incarnation each is can change only when one of those
    grows — so an allocation's forwards count it without counting each new row of the pod."""
    per: dict[str, list] = defaultdict(list)
    dels = [r for r in state["rows"].values() if r["type"] == "scheduler.deleted"]
    deletions = sorted(r["at"] for r in dels)
    # (the rows and deletions let go past the bound still count: ``_bound``)
    gone, gone_deleted = state.get("gone_held") or {}, state.get("gone_deleted", 0)
    if inc is not None:
        by_uid: dict[str, list[str]] = defaultdict(list)
        for r in dels:
            by_uid[inc.uid_at(r["key"])].append(r["at"])
            gone_deleted += inc.seg_le(r["key"])
    for rec in state["rows"].values():
        if rec.get(field):
            per[rec[field][0]].append(rec)
    out = []
    for akey, rows in sorted(per.items()):
        rows.sort(key=lambda r: r["key"])
        v = len(rows) + len(deletions) + gone.get(f"{field}|{akey}", 0) + gone_deleted
        if inc is not None:
            v += sum(inc.seg_le(r["key"]) for r in rows)
        current = None
        for rec in rows:
            op = rec[field][1]
            if op == "a" and current is None:
                current = {**opened(akey, rec), "start": rec["at"], "start_event": rec["id"], "end": None, "end_event": None,
                           "end_reason": None, "v": v}
                if inc is not None:
                    mine = by_uid.get(inc.uid_at(rec["key"]))
                    current["_deleted"] = max(mine) if mine else None
            elif op == "r" and current is not None:
                current.update(end=rec["at"], end_event=rec["id"], end_reason=end_reason(rec))
                current.pop("_deleted", None)
                out.append(current)
                current = None
        if current is not None:
            last = current.pop("_deleted") if inc is not None else (deletions[-1] if deletions else None)
            if last is not None and last >= current["start"]:
                current.update(end=last, end_reason="pod_deleted")
            out.append(current)
    return out


#: ResourceClaim events (scheduler collector) -> the interval operation they are.
CLAIM_EVENTS = {"gpu.claim_reserved": "a", "gpu.claim_released": "r"}


def claim_spans(state: dict, inc: Incarnations | None = None) -> list[dict]:
    """Holding intervals from a pod's ``gpu.claim_*`` rows: from the reservation to its
    release (``unreserved`` / ``deallocated`` / ``claim_deleted``), else the pod's deletion;
    shaped like ``_spans``' (no container: a claim is the pod's), marked ``claim``."""
    def opened(dkey: str, _rec: dict) -> dict:
        node, device, resource = dkey.split("|", 2)
        return {"node": node, "device": device, "container": None, "resource": resource, "gpu": None, "mig": None, "claim": True}

    return _held(state, "claim", opened, lambda rec: rec["claim"][2] or "released", inc)


def merge_dra(state: dict, spans: list[dict], inc: Incarnations | None = None) -> list[dict]:
    """One allocation per holding of a DRA device, however many sources report it.

    The kubelet (pod-resources collector: one span per container using the claim) and the
    API server (the ResourceClaim: one per pod) report the same holding. Per (node, device),
    spans that overlap in time are one holding. Its **end comes from the claim** where one
    is known: the claim's reservation is what keeps the device from every other pod, so
    the holding lasts until the API server drops it (the kubelet's list can lag or stop
    earlier). Its **start is the earliest report** of either source: the holding began no
    later than anyone saw it — and the earliest start is also the one that does not move
    when the other source reports later (normally the claim, reserved at scheduling,
    before the kubelet runs the container), so the row's key (``started_at``, the
    allocation id from the starting event, with no container in it) stays put and both
    sources converge on one ``gpu_allocations`` row. Containers: those the kubelet names.
    Device-plugin spans are returned untouched."""
    claims = claim_spans(state, inc)
    dra = [iv for iv in spans if iv["device"].startswith(iv["resource"] + "/")]
    if not claims and not dra:
        return spans
    out = [iv for iv in spans if not iv["device"].startswith(iv["resource"] + "/")]
    per: dict[tuple[str, str], list] = defaultdict(list)
    for iv in dra + claims:
        per[(iv["node"], iv["device"])].append(iv)
    for _dev, ivs in sorted(per.items()):
        ivs.sort(key=lambda iv: (iv["start"], iv["start_event"]))
        groups: list[list[dict]] = []
        for iv in ivs:
            if groups and _still_held(groups[-1], iv["start"]):
                groups[-1].append(iv)
            else:
                groups.append([iv])
        # Each holding's version counts every report of the device (of each source's key once: its spans
        # share it), not its group's: a group that splits again (a release read between two reports) took
        # the other spans' counts with it — a holding back from a withdrawal, or the other one, went out
        # below a version it had had, and the worker, trusting versions, kept it open for ever.
        dev_v = sum({(bool(iv.get("claim")), iv["container"], iv["resource"]): iv["v"] for iv in ivs}.values())
        out.extend({**_one_holding(group), "v": dev_v} for group in groups)
    return out


def _still_held(group: list[dict], at: str) -> bool:
    return any(iv["end"] is None or at <= iv["end"] for iv in group)


def _one_holding(group: list[dict]) -> dict:
    first = group[0]
    ends = [iv for iv in group if iv.get("claim")] or group
    merged = {**first, "container": ",".join(sorted({iv["container"] for iv in group if iv["container"]})) or None,
              "v": sum(iv["v"] for iv in group), "id_container": ""}
    if any(iv["end"] is None for iv in ends):
        merged.update(end=None, end_event=None, end_reason=None)
    else:
        last = max(ends, key=lambda iv: (iv["end"], iv["end_event"] or ""))
        merged.update(end=last["end"], end_event=last["end_event"], end_reason=last["end_reason"])
    merged.pop("claim", None)
    return merged


#: An interval that has not ended, in ``Coverage``'s running max of ends: after every timestamp.
OPEN_END = "\uffff"


def _extend_running(acc: list, values: list, func, saturated=None) -> list:
    """``acc`` made ``list(accumulate(values, func, initial=acc[0]))`` again, from the part of it
    still valid: a change at position k of ``values`` cuts ``acc`` after ``acc[k]``, and this
    extends it from there (``saturated``: a value ``func`` never leaves, so the rest is that).
    Why: ``Coverage`` and ``GpuMemo`` keep such running totals over a node/GPU's links, and a new
    holder starts last — recomputing them whole at every change grew with the holders it had
    (engine_cpu, 240,000 events: a fifth of ``_refresh_gpu``'s samples)."""
    if len(acc) <= len(values):
        if saturated is not None and acc[-1] == saturated:
            acc.extend([saturated] * (len(values) + 1 - len(acc)))
        else:
            acc.extend(islice(accumulate(values[len(acc) - 1:], func, initial=acc[-1]), 1, None))  # (without the initial one)
    return acc


class Coverage:
    """Who held a node/GPU when: its links' intervals (every allocation of it, of each of
    its MIG slices and time-slicing shares) indexed by start.

    ``at(t)`` gives the allocations that held it at ``t``, the versions of every link that
    could have held it then (a link with an interval started by ``t``) and those
    intervals' releases. Why an index: asked per row of the entity, walking every link
    each time cost rows × links — a node/GPU keeps every alert and every holder it had
    (measured: a restart's first batch, memos empty, spent 2 of its 3.4 s there).

    Kept up to date link by link (``set``, by the entity's ``GpuMemo``): a holder that
    starts or ends changes one link, and rebuilding the index from every link at each
    change was the fastest-growing cost of a long-running worker (engine_cpu, 200,000
    events: a fifth of the correlation stage's growth). Intervals are ordered by (start,
    allocation id, source), so an index built at once (a restart) and one kept up to date
    hold them in the same order."""

    __slots__ = ("_links", "_keys", "_starts", "_ends", "_ivs", "_reach", "_firsts", "_first_starts", "_vs", "_cum", "_rid_starts",
                 "_rid_index")

    def __init__(self, links: dict | None = None) -> None:
        self._links: dict[str, dict] = {}                 # source -> the link indexed
        self._keys: list[tuple[str, str, str]] = []       # (start, allocation id, source) of every interval, sorted
        self._starts: list[str] = []                      # in the order of _keys: each interval's start, end, itself
        self._ends: list[str] = []                        # (an open end as OPEN_END, which no time reaches)
        self._ivs: list[dict] = []
        self._reach: list[str] = [""]                     # running max of _ends, from "": the part still valid (``_reaches``)
        self._firsts: list[tuple[str, str]] = []          # (earliest start, source) of every link with intervals, sorted
        self._first_starts: list[str] = []                # in the order of _firsts: the start, the link's version
        self._vs: list[int] = []
        self._cum: list[int] = [0]                        # running sums of _vs, from 0: the part still valid (``_prefix``)
        self._rid_starts: dict[str, list[str]] = {}       # release -> the starts of the intervals naming it, sorted
        self._rid_index: tuple[list[str], list[str]] | None = None  # (earliest starts, releases) sorted (None: to compute)
        if links:
            self._build(links)

    def _build(self, links: dict) -> None:
        """The index of ``links`` at once (as ``set`` of each would give it, sorting once)."""
        entries: list[tuple[tuple[str, str, str], dict]] = []
        firsts: list[tuple[tuple[str, str], int]] = []
        for source, link in links.items():
            self._links[source] = link
            intervals = link.get("intervals") or ()
            if not intervals:
                continue
            firsts.append(((min(iv["start"] for iv in intervals), source), link.get("v", 0)))
            for iv in intervals:
                entries.append(((iv["start"], iv.get("id") or "", source), iv))
                for rid in _iv_rids(iv):
                    self._rid_starts.setdefault(rid, []).append(iv["start"])
        entries.sort(key=itemgetter(0))  # stable: equal keys in link order, as inserting one by one leaves them
        firsts.sort(key=itemgetter(0))
        self._keys = [key for key, _iv in entries]
        self._starts = [key[0] for key in self._keys]
        self._ivs = [iv for _key, iv in entries]
        self._ends = [OPEN_END if iv["end"] is None else iv["end"] for iv in self._ivs]
        self._firsts = [first for first, _v in firsts]
        self._first_starts = [first[0] for first in self._firsts]
        self._vs = [v for _first, v in firsts]
        for starts in self._rid_starts.values():
            starts.sort()

    def set(self, source: str, link: dict | None) -> None:
        """``source``'s link is now ``link`` (None: gone)."""
        old = self._links.pop(source, None)
        if old is not None:
            self._index(source, old, remove=True)
        if link is not None:
            self._links[source] = link
            self._index(source, link, remove=False)

    def _index(self, source: str, link: dict, remove: bool) -> None:
        intervals = link.get("intervals") or ()
        if not intervals:
            return
        for iv in intervals:
            key = (iv["start"], iv.get("id") or "", source)
            if remove:
                k = bisect_left(self._keys, key)
                while k < len(self._ivs) and self._keys[k] == key and self._ivs[k] is not iv:  # equal keys: this very interval
                    k += 1
                if k == len(self._ivs) or self._keys[k] != key or self._ivs[k] is not iv:
                    raise RuntimeError(f"Coverage: the link from {source} changed in place after it was indexed")
                del self._keys[k], self._starts[k], self._ends[k], self._ivs[k]
            else:
                k = bisect_right(self._keys, key)
                self._keys.insert(k, key)
                self._starts.insert(k, iv["start"])
                self._ends.insert(k, OPEN_END if iv["end"] is None else iv["end"])
                self._ivs.insert(k, iv)
            del self._reach[k + 1:]  # (the running max of the ends before k is as it was)
            for rid in _iv_rids(iv):
                starts = self._rid_starts.setdefault(rid, [])
                first = starts[0] if starts else None
                if remove:
                    starts.remove(iv["start"])
                    if not starts:
                        del self._rid_starts[rid]
                else:
                    insort(starts, iv["start"])
                if (starts[0] if starts else None) != first:
                    self._rid_index = None  # (only a release's earliest start is in the index: a later one changes nothing)
        first = (min(iv["start"] for iv in intervals), source)
        if remove:
            k = bisect_left(self._firsts, first)
            if k == len(self._firsts) or self._firsts[k] != first:
                # Only if a link's intervals were changed in place after it was indexed: links
                # are replaced, never edited (fold_link) — loud rather than a wrong index.
                raise RuntimeError(f"Coverage: the link from {source} changed in place after it was indexed")
            del self._firsts[k], self._first_starts[k], self._vs[k]
        else:
            k = bisect_right(self._firsts, first)
            self._firsts.insert(k, first)
            self._first_starts.insert(k, first[0])
            self._vs.insert(k, link.get("v", 0))
        del self._cum[k + 1:]  # (the sums of the versions before k are as they were)

    def _covering(self, at: str):
        """The intervals that hold it at ``at`` (started by ``at``, not ended by then), latest
        start first — walked back only as far as one of the earlier ones could still reach past
        ``at`` (the running max of their ends): a GPU's holders mostly follow one another, so
        that is the last one or two, not every holder it ever had (walking them all, per alert,
        grew with its history)."""
        reach, ends, ivs = self._reaches(), self._ends, self._ivs
        for k in range(bisect_right(self._starts, at) - 1, -1, -1):
            if reach[k + 1] <= at:
                return
            if at < ends[k]:
                yield ivs[k]

    def at(self, at: str) -> tuple[list[dict], int, tuple[str, ...]]:
        """Its holders at ``at`` (by start), the versions of the links with an interval started
        by ``at``, and those intervals' releases."""
        holders = list(self._covering(at))
        holders.reverse()
        return (holders, *self._prefix(at))

    def selected(self, at: str, instance: dict | None) -> tuple[list[dict], int, tuple[str, ...]]:
        """``at`` with its holders as ``select_holders(holders, instance)`` picks them. For an
        alert naming no GPU instance that is the latest-starting whole holder, and the walk back
        from the latest start stops at it (with the holders of its (start, allocation id), which
        ``select_holders`` chooses among) — not every holder open at ``at``: a GPU whose holders
        never release it (the bench mix's pods never do) keeps them all open, and walking them
        per alert grew with its history (engine_cpu, 100,000 → 480,000 events: ``Coverage.at``
        3 % → 10 % of the engine's samples)."""
        if instance:
            holders, version, rids = self.at(at)
            return select_holders(holders, instance), version, rids
        latest: list[dict] = []  # the holders from the latest start back to the first whole one's key
        whole = None
        for iv in self._covering(at):
            key = (iv["start"], iv["id"])
            if whole is not None and key != whole:
                break
            latest.append(iv)
            if whole is None and not iv.get("slice"):
                whole = key
        latest.reverse()
        return (select_holders(latest, None), *self._prefix(at))

    def _reaches(self) -> list[str]:
        """The running max of the ends: ``[k + 1]`` the latest end of the intervals up to k (an open
        end reaches past every time: the rest is open too)."""
        return _extend_running(self._reach, self._ends, max, OPEN_END)

    def _prefix(self, at: str) -> tuple[int, tuple[str, ...]]:
        """The versions of the links with an interval started by ``at``, and those intervals' releases."""
        version = _extend_running(self._cum, self._vs, add)[bisect_right(self._first_starts, at)]
        if self._rid_index is None:
            by_start = sorted((starts[0], rid) for rid, starts in self._rid_starts.items())
            self._rid_index = ([start for start, _rid in by_start], [rid for _start, rid in by_start])
        rid_starts, rids = self._rid_index
        return version, tuple(sorted(rids[:bisect_right(rid_starts, at)]))


def _iv_rids(iv: dict) -> tuple[str, ...]:
    """The releases a holder's interval names to its node/GPU's rows (a version component and an interest
    of each row after its start): its own, and — from a pod of several incarnations — every release one
    of them resolves to (``rids``): an interval that turns out to be another incarnation's (its uid told
    late) changes release without its GPU's rows ceasing to count the one it named before."""
    rid = iv["identity"].get("release_id")
    if "rids" in iv:
        return tuple(dict.fromkeys((rid, *iv["rids"]) if rid else iv["rids"]))
    return (rid,) if rid else ()


def select_holders(holders: list[dict], instance: dict | None) -> list[dict]:
    """Who an alert on a node/GPU is about: the device's own holder (latest start wins)
    if it was held whole, else every slice/share holder; an alert naming a MIG instance
    (``GPU_I_ID``/``GPU_I_PROFILE``) only that instance's holder — by instance id where
    the slice's is known, else by profile. Sorted by (start, allocation id)."""
    if not instance:
        # The latest-starting whole holder (``max`` by (start, allocation id): the first of
        # equal ones). ``holders`` come sorted by (start, allocation id, source)
        # (``Coverage.at``), so it is the last whole one, or the first of its key just
        # before it — found from the end, not by walking every holder a node/GPU ever had.
        for k in range(len(holders) - 1, -1, -1):
            if not holders[k].get("slice"):
                latest = holders[k]
                key = (latest["start"], latest["id"])
                for j in range(k - 1, -1, -1):
                    h = holders[j]
                    if (h["start"], h["id"]) != key:
                        break
                    if not h.get("slice"):
                        latest = h
                return [latest]
    parts = [h for h in holders if h.get("slice")]
    if instance:
        by_gi = [h for h in parts if instance.get("gi") and h.get("gi") == instance["gi"]]
        profile = instance.get("profile")
        parts = by_gi or [h for h in parts if not h.get("gi") and (not profile or h.get("profile") == profile
                                                                   or h.get("resource", "").endswith(profile))]
    return sorted(parts, key=lambda h: (h["start"], h["id"]))


def shared_identity(holders: list[dict]) -> dict:
    """The identity fields every holder agrees on (all of them for one holder)."""
    if not holders:
        return {}
    first, rest = holders[0]["identity"], [h["identity"] for h in holders[1:]]
    return {k: v for k, v in first.items() if all(other.get(k) == v for other in rest)}


def resolve_row(state: dict, record: dict, directory, entity_res: Resolution, coverage: Coverage | None = None) -> Resolution:
    """How one attached row resolves its release (``coverage``: the node/GPU entity's
    ``Coverage``, when the caller resolves several of its rows)."""
    kind = kind_of(state["key"])
    own = record["identity"]
    at = record["starts_at"] or record["at"]
    if entity_res.incarnations is not None:
        entity_res = entity_res.incarnations.at(_point(record))  # (a pod of several incarnations: the row's)
    if record["type"] == "gpu.device":
        return UNATTRIBUTED  # what a device is, not something that happened to a release
    if record["type"].startswith("release."):
        rid = own.get("release_id")
        return Resolution({}, "release_event", rid, [f"rid:{rid}"], (rid,) if rid else ())
    if own.get("release_id"):
        return _labelled(own, directory, own["release_id"], entity_res if kind in ("pod", "wl") else None, at)
    if kind in ("pod", "wl"):
        return _own_fallback(own, directory, entity_res, entity_res.release_id, at) if entity_res.unresolved(directory) else entity_res
    if kind == "gpu":
        holders, version, rids = (coverage or Coverage(state["links"])).selected(at, record.get("gpu_instance"))
        spanned = False
        if gone := state.get("gone"):  # what the detached links added, as the links did (``_let_go``)
            gone_v, gone_rids, spanned = gone_prefix(gone, at)
            version += gone_v
            if gone_rids:
                rids = tuple(sorted({*rids, *gone_rids}))
        interests = [f"rid:{r}" for r in rids]
        # (``forgotten``: a detached holder held or shared its time — it keeps what it emitted)
        if not holders:
            return Resolution({}, "unattributed", None, interests, rids, (), version, forgotten=spanned)
        ident = shared_identity(holders)
        if len(holders) > 1 or holders[0].get("slice"):
            # The alert names the physical GPU; the device a pod held is a slice/share of it.
            ident = {k: v for k, v in ident.items() if k != "gpu_id"}
        rid = ident.get("release_id")
        # Several holders of different releases (slices/shares of one GPU): joined, to all of them, not to one release.
        how = "gpu_assignment" if rid else ("gpu_shared" if len(holders) > 1 else "unattributed")
        return Resolution(ident, how, rid, interests, rids, (), version, forgotten=spanned)
    if kind == "model":
        name, version = own.get("model_name"), own.get("model_version")
        rid = directory.by_model_version(name, version, own.get("environment"), at)  # the release serving when it happened
        lookups = interests_for(model_name=name, model_version=version)
        lookups = lookups[-1:] if version else lookups
        return Resolution({}, "model_version_match" if rid else "unattributed", rid,
                          lookups + ([f"rid:{rid}"] if rid else []), (), tuple(lookups))
    return UNATTRIBUTED


def _labelled(own: dict, directory, rid: str, entity_res: Resolution | None, at: str | None = None) -> Resolution:
    """A row that names its release (a label): that release once a release event describes it;
    until then the fallback — the pod's (``entity_res``, a pod/workload entity's resolution, when
    its own label is this one: its facts' image digest, else model+version), else the row's own
    digest or model+version — naming the unknown id; else the label, unresolved (parked).

    One version for both sides of the release becoming known, so it grows when it does: the
    label's ``version_at`` (0 while unknown) + the candidates of every look-up either side
    consults (the pod's and the row's own) + the runs of the facts the pod's fallback reads
    (``FALLBACK_FACTS``). The known side used to count the label alone: a row emitted by the
    fallback at a higher version was never replaced when the release arrived — its stale
    attribution won for ever, and which one a run kept depended on the order it read the
    topics in (an exploratory chaos review). The identity is the row's own (and the release's
    manifest) on both sides: the pod's facts, which the fallback side carried, would make the
    version follow every fact of the pod."""
    own_lookups = interests_for(own.get("image_digest"), own.get("model_name"), own.get("model_version"))
    candidates = tuple(dict.fromkeys((*(entity_res.candidates if entity_res else ()), *own_lookups)))
    base = entity_res.fallback_version if entity_res else 0
    interests = [f"rid:{rid}", *own_lookups]
    if directory.known(rid):
        return Resolution({}, "release_label", rid, interests, (rid,), candidates, base)
    if entity_res is not None and entity_res.unknown_named == rid:
        match, how = entity_res.release_id, entity_res.attribution
    else:
        match, rule = fallback_match(directory, own.get("image_digest"), own.get("model_name"), own.get("model_version"), own.get("environment"), at)
        how = FALLBACK[rule] if match else "release_label"
    if match is None:
        return Resolution({}, "release_label", rid, interests, (rid,), candidates, base)
    return Resolution({}, how, match, [*interests, f"rid:{match}"], (rid,), candidates, base, unknown_named=rid)


def _own_fallback(own: dict, directory, res: Resolution, named: str | None, at: str | None = None) -> Resolution:
    """``res`` (unresolved: no release, or one no release event describes), unless the row's
    own model+version (an alert's labels) or image digest find a release — then that, as a
    fallback naming the unknown id. The version keeps every component ``res`` had, plus the
    candidates consulted, so it grows whenever the choice can change."""
    lookups = interests_for(own.get("image_digest"), own.get("model_name"), own.get("model_version"))
    if not lookups:
        return res
    candidates = tuple(dict.fromkeys((*res.candidates, *lookups)))
    match, rule = fallback_match(directory, own.get("image_digest"), own.get("model_name"), own.get("model_version"), own.get("environment"), at)
    interests = list(dict.fromkeys([*res.interests, *lookups, *([f"rid:{match}"] if match else [])]))
    if match is None:
        return Resolution(res.identity, res.attribution, res.release_id, interests, res.named, candidates, res.base, res.facts_version,
                          res.unknown_named)
    return Resolution(res.identity, FALLBACK[rule] if named else rule, match, interests, res.named, candidates, res.base,
                      res.facts_version, named)


def render_row(record: dict, directory, res: Resolution, version: int) -> dict:
    rid = res.release_id
    manifest = directory.manifest(rid) if rid else {}
    identity = {**manifest, **{k: v for k, v in res.identity.items() if k in IDENTITY_FIELDS}, **record["identity"]}
    if rid:
        identity["release_id"] = rid
    return {
        "correlation_id": record["id"], "version": version, "event_type": record["type"], "occurred_at": record["at"],
        "attribution": res.attribution, "identity": identity,
        "release_state": directory.state_as_of(rid, record["at"]) if rid else None,
        "summary": record["summary"], "source_topic": record["topic"], "source_partition": record["partition"],
        "source_offset": record["offset"], "payload_json": record["payload"], "named_release_id": res.unknown_named,
        # Whose the environment is: the row's (its labels) or its release's (control 1 reads it, ``_approval_environment``).
        "environment_labelled": bool(record["identity"].get("environment") or res.identity.get("environment")),
        # (a label naming a release no event describes, emitted past its park TTL: not joined — control 6, routers)
        "release_known": directory.known(rid) if rid else None,
    }


def _emit(sent: dict, key: str, version: int, content: dict, out: Outcome) -> int | None:
    """The version to emit ``content`` at, or None when nothing changed.

    The worker trusts the versions: an output whose version did not grow is not compared
    (and no digest is kept). The tests (``VERIFY_UNCHANGED``) compare every one, and a
    content change without a version change fails them (``Outcome.conflicts``)."""
    last = sent.get(key)
    if not VERIFY_UNCHANGED:
        if last is not None and version <= sent_version(last):
            return None
        sent[key] = version
        return version
    d = digest({k: v for k, v in content.items() if k != "version"})
    if last is not None:
        before = sent_version(last)
        if version <= before:
            if type(last) is int or d == last[1]:  # (no digest kept: written by a worker, which trusts the versions)
                return None
            out.conflicts += 1
            version = before + 1
    sent[key] = [version, d]
    return version


def sent_version(entry) -> int:
    """The version of a ``sent``/``allocs``/``fwd`` entry: a bare int as the worker keeps it,
    ``[version, digest]`` as the tests' ``VERIFY_UNCHANGED`` does (and workers did before
    2026-12: a changelog written then still holds that form).

    Why a bare int: every emitted row, allocation and forward keeps one, and each such
    entry alive after an epoch commit is walked by its freeze's collection
    (``gpuledger.gctune.freeze``) — a two-item list is a tracked container, an int is not, and a
    dict holding only ints is not tracked at all. ``benchmarks/engine_cpu.py``: these lists were
    17 % of the objects each freeze walked (2 per input event)."""
    return entry if type(entry) is int else entry[0]


# --- the step ---------------------------------------------------------------------------

def _derive_row(state: dict, record: dict, directory, res: Resolution, park: bool, out: Outcome) -> None:
    """Park, skip or emit one row under its resolution ``res``."""
    if res.forgotten and record["id"] in state["sent"]:
        return  # its holder may have gone with a detached link: it keeps what it emitted (``_let_go``)
    # Unresolved = no release, or a release named (label) that no release event has
    # described yet: wait for the manifest rather than emit a half-filled row.
    unresolved = res.unresolved(directory) and not record["type"].startswith(("release.", "gpu.allocatable", "gpu.device"))
    if park and unresolved and not record["expired"]:
        if not record["parked"]:
            record["parked"] = True
            touched(state["rows"], record["id"])  # (in place: the store's journal is told)
            out.parked.append((record["starts_at"] or record["at"], record["id"]))
        return
    if record["parked"]:
        record["parked"] = False
        touched(state["rows"], record["id"])
    version = 1 + res.version(directory, record["at"])
    last = state["sent"].get(record["id"])
    if last is not None and version <= sent_version(last) and not VERIFY_UNCHANGED:
        return
    content = render_row(record, directory, res, version)
    emitted = _emit(state["sent"], record["id"], version, content, out)
    if emitted is not None:
        content["version"] = emitted
        out.correlated.append(content)


class JournaledLinks(Journal):
    """A node/GPU entity's links while its ``GpuMemo`` follows them: the sources set or
    deleted since the memo last looked (``changed``), so that a refresh finds the changed
    links without comparing every one — and, as a store ``Journal``, since the store last
    wrote them. Links change only by ``fold_link`` (an item set, or deleted past
    ``MAX_LINKS``); any other change in place is refused, so none can go unnoted. Encoded
    (orjson, the store) as the plain dict it is."""

    __slots__ = ("changed", "_order")

    def __init__(self, items=(), /) -> None:
        super().__init__(items)
        self.changed: set = set()
        # (when the latest interval started, source) of every link, sorted — what ``fold_link``
        # evicts by past ``MAX_LINKS`` — built on the first ``least_keys`` and kept up to date item by
        # item from then on (None: not built, or dropped when a link turned out changed in place)
        self._order: list[tuple[str, str]] | None = None

    def __setitem__(self, key, value) -> None:
        if self._order is not None:
            if key in self:
                self._unorder(key, dict.__getitem__(self, key))
            if self._order is not None:
                insort(self._order, (_link_newest(value), key))
        Journal.__setitem__(self, key, value)
        self.changed.add(key)

    def __delitem__(self, key) -> None:
        if self._order is not None and key in self:
            self._unorder(key, dict.__getitem__(self, key))
        Journal.__delitem__(self, key)
        self.changed.add(key)

    def _unorder(self, key: str, link: dict) -> None:
        entry = (_link_newest(link), key)
        k = bisect_left(self._order, entry)
        if k < len(self._order) and self._order[k] == entry:
            del self._order[k]
        else:
            self._order = None  # a link changed in place after it was ordered: built again when next needed

    def least_keys(self, n: int) -> list[tuple[str, str]]:
        """The ``_newest_item`` keys of the ``n`` links ``fold_link`` evicts first."""
        if self._order is None:
            self._order = sorted((_link_newest(link), src) for src, link in self.items())
        return self._order[:n]


    def _refused(self, *_args, **_kwargs):
        raise TypeError("an entity's links change only item by item (fold_link), so that its GpuMemo notes every change")

    pop = popitem = clear = update = setdefault = __ior__ = _refused


class GpuMemo:
    """What a node/GPU entity's rows depended on when they were last derived, so a refresh
    re-derives only the rows whose inputs changed (in memory only; ``Correlator`` keeps one
    per entity and forgets them with the entity's partition).

    A GPU row (an alert) depends on the directory and on the links (holders' intervals)
    with an interval that started by the row's time — with the links ordered by their
    earliest start, a *prefix* of them. Every link object gets a stamp, a new one whenever
    the link is replaced; a prefix is then identified by its length and its highest stamp
    (any link that enters, leaves or changes within it changes one or the other: a link's
    membership of a prefix changes only when the link itself is new, replaced or gone).
    A row whose prefix, directory generation, parked/expired flags and last emitted version
    are all as last time derives exactly what it derived then: nothing new to emit.

    Which rows to look at, without walking them all (a node/GPU keeps every alert it had):
    the rows that are new since the last refresh (appended to ``rows``), the rows still
    parked, and the rows at or after ``low`` — the earliest start of any link that is new or
    replaced since (a row before it has the same prefix as before; a link *gone* — detached
    past ``MAX_LINKS`` — moves no row: ``prefixes`` says why). A change of the
    directory (its generation), or rows that left, mean a full pass. The rows are counted per
    set of interests (``counts``), so the entity's interests need no walk either."""

    __slots__ = ("links", "stamp", "rows", "_order", "_top", "_prefixes", "low", "generation", "times", "watch", "counts", "_interests", "devices", "coverage",
                 "_followed", "indexed", "gone", "floor")

    def __init__(self) -> None:
        self.links: dict[str, tuple[dict, int, str | None]] = {}  # source -> (link object, its stamp, its earliest start)
        self.stamp = 0
        self.rows: dict[str, tuple] = {}                 # row id -> (deps, interests) when last derived
        self._order: tuple[list, list[str], list[int]] = ([], [], [])  # (earliest start, stamp) of the links, sorted; its two columns
        self._top: list[int] = [0]                       # highest stamp of each prefix of _order, from the empty one: the part still valid
        self._prefixes: tuple[list[str], list[int]] | None = None
        self.low: str | None = None                      # earliest start of a link changed since the last refresh
        self.generation = -1                             # the directory's, at the last full pass
        self.times: list[tuple[str, str]] = []           # (row time, row id) of the rows in ``rows``, sorted
        self.watch: set[str] = set()                     # parked rows
        self.counts: dict[tuple, int] = {}               # a row's interests (a tuple) -> rows that have them
        self._interests: list[str] | None = None         # every interest of ``counts``, sorted (None: to compute)
        self.devices = False                             # a ``gpu.device`` row (a DRA device entity) is among the rows
        self.coverage: Coverage | None = None            # of the current links (built when a row is first derived, then kept up to date)
        self._followed: JournaledLinks | None = None     # the state's links, as last seen (``prefixes``)
        self.indexed: list[str] | None = None            # the interests the runtime last indexed the entity under (``Correlator``)
        self.gone: str | None = None                     # the earliest row time a detachment since the last refresh touched (``prefixes``)
        self.floor: str | None = None                    # the earliest start of the state's ``gone`` steps at the last refresh

    def _changed(self, *starts: str | None) -> None:
        for at in starts:
            if at is not None and (self.low is None or at < self.low):
                self.low = at

    def prefixes(self, state: dict) -> tuple[list[str], list[int]]:
        """(earliest starts sorted, highest stamp of each prefix) of the entity's current
        links — the order kept up to date link by link, as the ``coverage`` is, when a link
        is new, replaced or gone (a live GPU entity is refreshed batch after batch with the
        same links; sorting them all again at each change grew with its history).

        Which links changed: the ones its ``JournaledLinks`` noted since the last refresh.
        The first time (or when the state's links are another object: a state loaded again)
        every link is compared with what the memo saw, and the state's links are then
        replaced by a ``JournaledLinks`` of the same items — comparing every link at every
        refresh was a node/GPU's fastest-growing cost (engine_cpu, 400,000 events: a tenth
        of the engine's CPU by the end, and growing with its holders)."""
        links = state["links"]
        seen = self.links
        if links is self._followed:
            # (the memo's link object is not the current one; None for absent on either side)
            changed = [src for src in links.changed if (seen[src][0] if src in seen else None) is not links.get(src)]
        else:
            changed = [src for src, link in links.items() if (known := seen.get(src)) is None or known[0] is not link]
            new = sum(1 for src in changed if src not in seen)
            if len(seen) + new != len(links):  # every source in links is in seen: more in seen means some are gone
                changed += [src for src in seen if src not in links]
            links = state["links"] = self._followed = JournaledLinks(links)
        links.changed = set()
        if not changed and self._prefixes is not None:
            return self._prefixes
        order, starts, stamps = self._order
        top = self._top
        for src in changed:
            link = links.get(src)
            known = seen.pop(src, None)
            if known is not None:
                if link is not None:
                    self._changed(known[2])  # replaced: the rows from its start may derive otherwise
                elif known[2] is not None:
                    # Gone — detached past MAX_LINKS, the only way a followed link leaves: the
                    # rows after its start are not derived again for it (nor, when the detachment
                    # made the oldest of ``gone``'s steps join the next, the rows after that step's
                    # start). The link is the one whose latest interval started earliest, long
                    # before the rows that keep arriving. A row after its start derives the same
                    # version (the link's version and releases moved into ``gone``: ``_let_go``);
                    # its content can change only if the link held it — then it finds no holder
                    # and keeps what it emitted (``forgotten``), or one never emitted parks — and
                    # a row whose step joined the next falls in version: none of them emits.
                    # Deriving them all again at every new holder past the cap was a node/GPU's
                    # full history per holder (engine_cpu 640,000 events: ~258 row derivations per
                    # detachment, none emitting; the correlation ~25x per event). A row derived
                    # later for another reason (a link before it, the directory) sees it then.
                    since = min(known[2], self.floor) if self.floor else known[2]
                    if self.gone is None or since < self.gone:
                        self.gone = since
                if known[2] is not None:
                    k = bisect_left(order, (known[2], known[1]))
                    del order[k], starts[k], stamps[k], top[k + 1:]
            if link is not None:
                self.stamp += 1
                first = min((iv["start"] for iv in link.get("intervals", ())), default=None)
                self._changed(first)
                seen[src] = (link, self.stamp, first)
                if first is not None:
                    k = bisect_right(order, (first, self.stamp))
                    order.insert(k, (first, self.stamp))
                    starts.insert(k, first)
                    stamps.insert(k, self.stamp)
                    del top[k + 1:]
            if self.coverage is not None:
                self.coverage.set(src, link)
        # The prefixes' highest stamps (a new or replaced link takes the highest stamp yet, so every
        # prefix that holds it has that one).
        self._prefixes = (starts, _extend_running(top, stamps, max, self.stamp))
        return self._prefixes

    def candidates(self, rows: dict, generation: int) -> list[str] | None:
        """The rows that may derive something new, or None for all of them (a full pass)."""
        new = []
        for rid in reversed(rows):
            if rid in self.rows:
                break
            new.append(rid)
        if generation != self.generation or len(self.rows) + len(new) != len(rows):
            return None
        picked = set(new) | self.watch
        if self.low is not None:
            picked.update(rid for _at, rid in self.times[bisect_left(self.times, (self.low,)):])
        return sorted(picked, key=lambda rid: rows[rid]["key"])

    def derived(self, record: dict, deps: tuple, interests: tuple) -> None:
        rid = record["id"]
        old = self.rows.get(rid)
        if old is None:
            insort(self.times, (record["starts_at"] or record["at"], rid))
        elif old[1] != interests:
            self._count(old[1], -1)
        if old is None or old[1] != interests:
            self._count(interests, 1)
        self.rows[rid] = (deps, interests)
        self.devices = self.devices or "device" in record
        if record["parked"]:
            self.watch.add(rid)
        else:
            self.watch.discard(rid)

    def _count(self, interests: tuple, by: int) -> None:
        """Rows counted by their interests as a whole: a node/GPU row's are a release for every
        release run on it before the row (tens), counting them one by one per row derived was a
        twentieth of a node/GPU refresh (engine_cpu, 240,000 events) — and the rows of a GPU
        share a few such sets."""
        n = self.counts.get(interests, 0) + by
        if n:
            self.counts[interests] = n
            if n == by:
                self._interests = None  # (a new set)
        else:
            del self.counts[interests]
            self._interests = None

    def interests(self) -> list[str]:
        """Every interest of the rows, sorted."""
        if self._interests is None:
            self._interests = sorted(set().union(*self.counts))
        return self._interests

    def reset(self, generation: int) -> None:
        """Before a full pass: every row is derived (or found unchanged) again."""
        self.rows, self.times, self.watch, self.counts, self._interests = {}, [], set(), {}, None
        self.generation, self.devices = generation, False


def refresh(state: dict, directory, park: bool = True, memo: GpuMemo | None = None) -> Outcome:
    """Re-derive every output of an entity and return what changed (see the module
    docstring for the versions). ``memo`` (node/GPU entities): look only at the rows whose
    inputs may have changed since they were last derived (``GpuMemo``)."""
    out = Outcome()
    kind = kind_of(state["key"])
    if kind != "gpu":
        memo = None
    if memo is not None:
        _refresh_gpu(state, directory, park, memo, out)
    else:
        _refresh_all(state, directory, park, kind, out)
    trim(state)  # (the rows ``_bound`` kept until they went out)
    return out


def _refresh_all(state: dict, directory, park: bool, kind: str, out: Outcome) -> None:
    """``refresh`` without a memo: every row derived."""
    entity_res = resolve_entity(state, directory) if kind in ("pod", "wl") else UNATTRIBUTED
    coverage = Coverage(state["links"]) if kind == "gpu" else None
    interests = set(entity_res.interests)
    for record in state["rows"].values():
        res = resolve_row(state, record, directory, entity_res, coverage)
        interests.update(res.interests)
        _derive_row(state, record, directory, res, park, out)
    state["interests"] = sorted(interests)
    if kind == "gpu":
        _refresh_device(state, out)
    if kind == "pod":
        _refresh_pod(state, directory, entity_res, out)
    elif kind == "wl":
        _refresh_workload(state, entity_res, out)


def _fingerprint(identity: dict, row_id: str) -> str:
    """An alert row's control key part (``streams.controls.rules.row_key``)."""
    return identity.get("alert_fingerprint") or row_id


def for_controls(state: dict, directory, rows: list[dict]) -> list[dict]:
    """The rows the controls stage reads, of ``rows`` (the entity's rows as they go to the
    correlated topic, after a batch): every one, except alert rows of a fingerprint none of
    whose emitted rows was unjoined (module docstring). When a fingerprint's first unjoined
    row goes out, the fingerprint's rows emitted before are rendered again at the version
    they were emitted with and go along."""
    tracked = state.get("ctl")
    out = []
    for row in rows:
        if tracked is None or not row["event_type"].startswith("alert."):
            out.append(row)
            continue
        fp = _fingerprint(row["identity"], row["correlation_id"])
        if fp in tracked:
            out.append(row)
            continue
        if joined(row["attribution"], row["identity"].get("release_id"), row.get("release_known")):
            continue  # joined: control 6 cannot fire on this fingerprint (yet)
        emitted = {r["correlation_id"] for r in rows}
        kind = kind_of(state["key"])
        entity_res = resolve_entity(state, directory) if kind in ("pod", "wl") else UNATTRIBUTED
        coverage = Coverage(state["links"]) if kind == "gpu" else None
        earlier = []
        for record in state["rows"].values():
            sent = state["sent"].get(record["id"])
            if (sent is None or record["id"] in emitted or not record["type"].startswith("alert.")
                    or _fingerprint(record["identity"], record["id"]) != fp):
                continue
            # Not in this output: its version did not grow since it was emitted.
            earlier.append((record, resolve_row(state, record, directory, entity_res, coverage), sent_version(sent)))
        if any(res.forgotten for _record, res, _v in earlier):
            # One went out joined, to a holder since detached (it keeps what it emitted, which
            # this cannot render again): the fingerprint joined — control 6 cannot fire on it.
            continue
        tracked.append(fp)
        out.append(row)
        out.extend(render_row(record, directory, res, version) for record, res, version in earlier)
    return out


def _refresh_gpu(state: dict, directory, park: bool, memo: GpuMemo, out: Outcome) -> Outcome:
    """``refresh`` of a node/GPU entity with its memo: only the candidate rows (``GpuMemo``)."""
    rows = state["rows"]
    starts, top = memo.prefixes(state)
    generation = len(directory.seen)
    picked = memo.candidates(rows, generation)
    memo.low, gone, memo.gone = None, memo.gone, None
    if VERIFY_UNCHANGED:
        # The tests derive every row and check that each one the memo would have skipped is
        # unchanged (same inputs, same interests, nothing emitted).
        previous = dict(memo.rows)
        skipped = set(rows) - set(picked) if picked is not None else set()
        memo.reset(generation)
        ids = list(rows)
    elif picked is None:
        memo.reset(generation)
        ids = list(rows)
    else:
        ids = picked
    def inputs(record: dict, k: int) -> tuple:
        """What the row's outputs depend on (``GpuMemo``)."""
        sent = state["sent"].get(record["id"])
        return generation, k, top[k], record["parked"], record["expired"], None if sent is None else sent_version(sent)

    for rid in ids:
        record = rows[rid]
        k = bisect_right(starts, record["starts_at"] or record["at"])
        deps = inputs(record, k)
        hit = memo.rows.get(rid) if not VERIFY_UNCHANGED else None
        if hit is not None and hit[0] == deps:
            continue
        emitted = len(out.correlated)
        if memo.coverage is None:
            memo.coverage = Coverage(state["links"])
        res = resolve_row(state, record, directory, UNATTRIBUTED, memo.coverage)
        _derive_row(state, record, directory, res, park, out)
        after = inputs(record, k)
        if VERIFY_UNCHANGED and rid in skipped:
            if gone is not None and (record["starts_at"] or record["at"]) >= gone:
                # skipped as a detached link's only change (``GpuMemo.prefixes``): it may derive
                # otherwise (a lower version, no holder: parked), but it must emit nothing
                assert len(out.correlated) == emitted, f"GpuMemo skipped a row after a detached link that emits: {rid}"
            else:
                assert previous.get(rid) == (deps, tuple(res.interests)) and after == deps and len(out.correlated) == emitted, \
                    f"GpuMemo skipped a row that changed: {rid}"
        memo.derived(record, after, tuple(res.interests))
    state["interests"] = list(memo.interests())
    memo.floor = state["gone"]["steps"][0][0] if state.get("gone") and state["gone"]["steps"] else None
    if memo.devices:  # (device_link walks every row: not for the node/GPUs of alerts, which have none)
        _refresh_device(state, out)
    return out


def _pod_identity(directory, res: Resolution) -> dict:
    rid = res.release_id
    identity = {**(directory.manifest(rid) if rid else {}), **{k: v for k, v in res.identity.items() if k in IDENTITY_FIELDS}}
    if rid:
        identity["release_id"] = rid
    return identity


def _refresh_pod(state: dict, directory, res: Resolution, out: Outcome) -> None:
    inc = res.incarnations
    identity = _pod_identity(directory, res)
    ns, _, pod = state["key"][4:].partition("/")
    identity_version = res.version(directory, None)
    if inc is not None:
        # What every incarnation's resolution has alike (the runs of uids up to an interval's start, which say
        # whose it is, are in its ``v``: ``_held``); each allocation counts its own start's on top.
        identity_version = inc.res[inc.latest()].version(directory, None)
        per_uid: dict[str, tuple[Resolution, dict]] = {}
        every_rid = sorted({r.release_id for r in inc.res.values() if r.release_id})  # (``_iv_rids``)
    else:
        every_rid = None
    # Every release the pod's resolution could name — those its rows named and every candidate of its
    # look-ups, a set that only grows — is named by its holdings to their GPU's rows (``_iv_rids``).
    candidates = {rid for interest in res.candidates for rid in directory.candidates(interest)}
    could = {*res.named, *candidates}
    if inc is not None:
        could.update(every_rid)
    if could - {res.release_id}:
        every_rid = sorted(could)
    per_gpu: dict[str, list] = {}
    gpu_version: dict[str, dict] = defaultdict(dict)  # target -> {allocation key: its event count}
    current: set[str] = set()
    withdrawn = state.get("allocs_gone")
    for iv in intervals(state, inc):
        alloc_id = _interval_alloc_id(iv, ns, pod)
        current.add(alloc_id)
        res_iv, identity_iv, alloc_v = res, identity, iv["v"] + identity_version
        if withdrawn and alloc_id in withdrawn:
            # An interval withdrawn, back (a release between its start and the one that took it over arrived):
            # above its withdrawal, whatever the versions say.
            del withdrawn[alloc_id]
            alloc_v = max(alloc_v, sent_version(state["allocs"][alloc_id]) + 1)
        if inc is not None:  # the incarnation its starting row is of
            start_key = state["rows"][iv["start_event"]]["key"]
            uid = inc.uid_at(start_key)
            if uid not in per_uid:
                per_uid[uid] = (inc.res[uid], _pod_identity(directory, inc.res[uid]))
            res_iv, identity_iv = per_uid[uid]
            alloc_v += inc.seg_le(start_key)
        ident_iv = {**identity_iv, "node": iv["node"], "gpu_id": iv["device"], "namespace": ns, "pod": pod}
        row = {"allocation_id": alloc_id, "node": iv["node"], "gpu_id": iv["device"], "gpu": iv["gpu"], "mig_instance": iv["mig"],
               "resource_name": iv["resource"], "namespace": ns, "pod": pod, "container": iv["container"], "identity": ident_iv,
               "attribution": res_iv.attribution, "started_at": iv["start"], "ended_at": iv["end"], "end_reason": iv["end_reason"],
               "start_event_id": iv["start_event"], "end_event_id": iv["end_event"]}
        version = _emit(state["allocs"], alloc_id, alloc_v, row, out)
        if version is not None:
            out.allocations.append({**row, "version": version})
        held = {"id": alloc_id, "start": iv["start"], "end": iv["end"], "identity": ident_iv, "attribution": res_iv.attribution}
        if every_rid is not None:
            held["rids"] = every_rid
        target = f"gpu:{iv['node']}/{iv['device']}"
        per_gpu.setdefault(target, []).append(held)
        # (a DRA holding by its device alone: its containers' list changes as its groups do — ``merge_dra``)
        gkey = (iv["container"] if "id_container" not in iv else "", iv["resource"], iv["device"])
        gpu_version[target][gkey] = iv["v"]
        if iv["gpu"] and iv["gpu"] != iv["device"]:
            # A MIG slice or time-slicing share — or a DRA device, named by its pool — of a
            # physical GPU: that GPU's alerts reach its holder too (a whole DRA GPU as a whole holder).
            physical = f"gpu:{iv['node']}/{iv['gpu']}"
            whole = iv.get("dra") and not iv["mig"]
            per_gpu.setdefault(physical, []).append(held if whole else {**held, "slice": iv["device"], "resource": iv["resource"],
                                                                       "gi": iv.get("gi"), "profile": iv.get("profile")})
            gpu_version[physical][gkey] = iv["v"]
    for target, ivs in per_gpu.items():
        _forward(state, target, sum(gpu_version[target].values()) + identity_version, {"intervals": ivs}, out)
    if len(state["allocs"]) > len(current) + len(withdrawn or ()):
        _withdraw(state, current, ns, pod, identity, res.attribution, out)
    rids, workloads = own_named(state)
    if not workloads:
        return
    # The workload each incarnation's facts name now (the latest incarnation's, of one named by several) gets
    # the release the pod's own facts give; every other workload its rows ever named gets a link naming none
    # (``release_id`` None) — a pod moved to another workload, or whose row naming another arrived first,
    # let the first one keep it for ever, and what it emitted then depended on the order (order_fuzz).
    live = {f["workload_id"]: f for f in (inc.facts.values() if inc is not None else (res.identity,)) if f.get("workload_id")}
    rids |= candidates
    # (the look-ups its rows count: every value any row named, ``named_values``)
    version = res.facts_version + directory.candidates_version(res.candidates)
    for wl in sorted(workloads):
        if (f := live.get(wl)) is not None:
            rel, rel_how = own_release(state, directory, f)
            link = {"release_id": rel, "attribution": rel_how, "from": "pod"}
            if rids - {rel}:
                link["rids"] = sorted(rids)  # (every release it could forward: ``link_rids``)
        else:
            link = {"release_id": None, "attribution": "left", "from": "pod", "rids": sorted(rids)}
        _forward(state, f"wl:{wl}", version, link, out)


def _alloc_id(node: str, device: str, ns: str, pod: str, container_part, start_event: str) -> str:
    return hashlib.sha256(f"{node}|{device}|{ns}/{pod}|{container_part}|{start_event}".encode()).hexdigest()[:32]


def _interval_alloc_id(iv: dict, ns: str, pod: str) -> str:
    """The allocation id of an interval (``intervals``): ``id_container`` is "" for a DRA holding (``merge_dra``:
    no source's container in its key)."""
    return _alloc_id(iv["node"], iv["device"], ns, pod, iv.get("id_container", iv["container"]), iv["start_event"])


def _orphans(state: dict, current: set[str]) -> list[str]:
    """The allocations a pod emitted that are no longer among its intervals (``current``: their ids) and not
    yet withdrawn (``allocs_gone``)."""
    gone = state.get("allocs_gone") or {}
    return [aid for aid in state["allocs"] if aid not in current and aid not in gone]


def _alloc_starts(state: dict, ns: str, pod: str) -> dict[str, tuple[dict, str, str, str | None, str]]:
    """Allocation id -> (its starting row, node, device, container, resource), for every row that can
    start one (every ``gpu.assigned`` and claim reservation the pod has, hashed as ``_refresh_pod``
    hashes its intervals' starts)."""
    starts: dict[str, tuple[dict, str, str, str | None, str]] = {}
    for rec in state["rows"].values():
        if (op := rec.get("gpu")) and op[1] == "a":
            node, device, container, resource = op[0].split("|", 3)
            for part in ({container or None, ""}):  # (a device plugin's container; a DRA holding's none: ``merge_dra``)
                starts[_alloc_id(node, device, ns, pod, part, rec["id"])] = (rec, node, device, container or None, resource)
        elif (op := rec.get("claim")) and op[1] == "a":
            node, device, resource = op[0].split("|", 2)
            starts[_alloc_id(node, device, ns, pod, "", rec["id"])] = (rec, node, device, None, resource)
    return starts


def _unwithdrawn_starts(state: dict) -> set[str]:
    """The starting rows of the allocations a pod emitted that are no longer among its intervals and not
    yet withdrawn — an earlier report of their holding folded, the refresh that withdraws them still to
    come (``_needed`` keeps them: let go now, their allocation could not be rebuilt and stayed open)."""
    if len(state["allocs"]) <= len(state.get("allocs_gone") or ()):
        return set()
    ns, _, pod = state["key"][4:].partition("/")
    orphans = _orphans(state, {_interval_alloc_id(iv, ns, pod) for iv in intervals(state)})
    if not orphans:
        return set()
    starts = _alloc_starts(state, ns, pod)
    return {starts[aid][0]["id"] for aid in orphans if aid in starts}


def _withdraw(state: dict, current: set[str], ns: str, pod: str, identity: dict, attribution: str, out: Outcome) -> None:
    """Withdraw the allocations a pod emitted that are no longer among its intervals.

    An allocation's id is that of the event that started it; when an earlier ``gpu.assigned`` of the
    same holding is read later (another partition's order, a collector's re-list), the interval starts
    there and gets another id — the first one was stored for ever, a holding that never ended (or one
    ended twice). Each such id is sent again closed at its start with ``end_reason`` ``withdrawn``
    (``schemas.outputs.ALLOCATION_WITHDRAWN``) one version above what it went out at: a tombstone, which readers and the store's
    checksums skip (``sinks.checksum.TOMBSTONES``) — a run that read the events in order never emitted
    it. Kept in ``allocs_gone`` (one that comes back is sent above its withdrawal: ``_refresh_pod``).
    The controls stage gets a pod's tombstones and the allocations of the same refresh (those that
    replaced them: a new id is always sent) in one message (``Correlator._emit``): it counts a tombstone
    as no version, and the allocation that replaced it as a higher one than the withdrawn had
    (``streams.controls.rules.fold_row``).

    The id is found again from its starting row (every ``gpu.assigned`` and claim reservation the pod
    has, hashed as ``_refresh_pod`` hashes its intervals' starts). One whose starting row is gone was
    let go past the row cap (``_bound``) — what it stored stays, as every row let go keeps what it
    emitted — and is only marked, not withdrawn (the cap keeps an unwithdrawn one's starting row until
    then, ``_unwithdrawn_starts``, and lets an ended holding's rows go together, ``_whole_holdings``)."""
    orphans = _orphans(state, current)
    if not orphans:
        return
    allocs, gone = state["allocs"], state.setdefault("allocs_gone", {})
    starts = _alloc_starts(state, ns, pod)
    for aid in sorted(orphans):
        version = sent_version(allocs[aid]) + 1
        gone[aid] = version
        if (start := starts.get(aid)) is None:
            continue  # (let go with its rows: docstring)
        rec, node, device, container, resource = start
        gpu, mig = (rec["gpu"][2], rec["gpu"][3]) if rec.get("gpu") else (None, None)
        row = {"allocation_id": aid, "node": node, "gpu_id": device, "gpu": gpu, "mig_instance": mig, "resource_name": resource,
               "namespace": ns, "pod": pod, "container": container,
               "identity": {**identity, "node": node, "gpu_id": device, "namespace": ns, "pod": pod}, "attribution": attribution,
               "started_at": rec["at"], "ended_at": rec["at"], "end_reason": ALLOCATION_WITHDRAWN, "start_event_id": rec["id"], "end_event_id": None}
        if (emitted := _emit(allocs, aid, version, row, out)) is not None:
            out.allocations.append({**row, "version": emitted})


def _refresh_device(state: dict, out: Outcome) -> None:
    """A DRA device tells the pods that hold it what it is (uuid, parent, profile)."""
    device, version = device_link(state)
    if device is None:
        return
    targets = [src for src in sorted(state["links"]) if src.startswith("pod:")]
    for src in targets:
        _forward(state, src, version, {"device": device}, out)
    _forget_forwards(state, targets)


def _refresh_workload(state: dict, res: Resolution, out: Outcome) -> None:
    f = res.identity
    if not f.get("release_id"):
        return
    link = {"release_id": f["release_id"], "attribution": "workload_release", "from": "wl"}
    if (rids := own_named(state)[0]) - {f["release_id"]}:
        link["rids"] = sorted(rids)  # (every release label its rows had: ``link_rids``)
    # Its pods — and those it let go past ``MAX_LINKS`` (``_gone_link``: kept by name): a pod let go kept
    # whichever link it had got before, and its rows differed by the order the run read them in.
    gone = state.get("gone_links")
    targets = [src for src in sorted({*state["links"], *(gone["v"] if gone else ())}) if src.startswith("pod:")]
    for src in targets:
        _forward(state, src, res.facts_version, link, out)
    _forget_forwards(state, targets)


def _forget_forwards(state: dict, targets: list[str]) -> None:
    """Keep ``fwd`` (what was last forwarded to each target) for the entity's current ``targets`` only.

    A workload forwards to its pods and those it let go it still keeps by name (``MAX_LINKS`` +
    ``MAX_GONE_LINKS``), a DRA device to the pods linked to it (``MAX_LINKS``); the entry of every
    other pod it ever forwarded to is never read again. Kept, they grew with every pod the entity
    ever had — a serving Deployment's churning pods — ~46 bytes each in the state's head record,
    re-encoded at every touch, until the head no longer fitted in a changelog record (~21,000 pods)
    and the entity lost its state (``streams.store``: refused, dead-lettered). A pod that links
    again is forwarded to again at its deterministic version: the same link at the same version,
    which its ``fold_link`` keeps once."""
    fwd = state["fwd"]
    if len(fwd) > len(targets):
        keep = set(targets)
        for target in [t for t in fwd if t not in keep]:
            del fwd[target]


def _forward(state: dict, target: str, version: int, link: dict, out: Outcome) -> None:
    emitted = _emit(state["fwd"], target, version, link, out)
    if emitted is not None:
        out.forwards.append((target, {**link, "v": emitted}))
