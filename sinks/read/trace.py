"""The responder's trace: from any identifier to the whole chain of an incident.

Input: a read-only reader (``sinks/read/query.py``), an entry point — alert fingerprint,
release, workload, pod, GPU or model — and optionally ``at`` (state as of that time)
and ``window`` (how far back to look for other alerts and scheduler events).
Output: a plain dict, the same for every entry point that leads to the same
incident::

    entry            what was asked and what it resolved to (the only entry-specific part)
    release          manifest (model, version, digests, owner, ...), state as of ``at``,
                     approvals, promotions, lifecycle
    workloads        queue, cluster queue, priority, admissions, gpuledger admit's decisions
                     (each with its gate, check state and status: allowed, deferred, waiting
                     — an AdmissionCheck left Pending — or denied; the webhook's deferral
                     of a queued Job under its Kueue Workload), preemptions (one per
                     preemption, with the sources that reported it and the preemptor by
                     name), evictions, pods
    pods             namespace/pod, uid, workload, nodes
    gpus             node/GPU with the chain's allocation intervals, and who else held it
                     in the window (in a range replay, an interval its pod's deletion ended
                     has ``end_note``: the GPU's release may be after the replay's end)
    scheduler_events preemptions, evictions, ... of the chain's workloads and, in the
                     window, of other workloads on the chain's nodes
    alerts           alerts attributed to the chain (all, as of ``at``) and other alerts on
                     its nodes in the window (``in_chain: false``)
    gaps             missing links, said out loud rather than hidden
    warnings         what the store cannot answer for the question asked, said before the
                     chain: ``at`` (or now) after the end of a range replay's store

How an entry becomes a chain: the entry resolves to a *root* — the release when one
is known (alert → its release; workload → the release its rows name; pod → its
workload; GPU → the allocation holding it at ``at``; model → its most recently active
release: ``_Resolver.model``), else the workload, else the pod, else the lone alert — and the chain is
expanded from the root only. So every entry that reaches the same root yields the
same chain. ``at`` hides rows that occurred after it and takes the release state as of
it; rows keep their latest version (the best attribution known now). The chain's own
rows are all shown (as of ``at``); the *window* — which other workloads' events, other
alerts and other GPU holders on the chain's nodes are shown — lasts ``window`` (default
2 h) and ends at ``at``, or without it at the entry point's own time: an alert's
startsAt, a workload's or pod's latest event, else (release, model, GPU) the chain's
latest event. ``window.anchor`` says which; so without ``at`` the window, unlike the
rest of the chain, depends on the entry point.

Every query is parameterised (``{name:Type}``; table names come from a fixed list).
Latest versions are read with FINAL (default) or argMax (``mode="argmax"``): see
docs/store.md for the measurement behind the default.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any

from producers.kubernetes.mapping import KUEUE_JOB_UID_LABEL
from schemas.envelope import nfc
from schemas.release import ENDING_EVENTS, LIFECYCLE_EVENTS, actor_text, decision_actor
from sinks.checksum import TOMBSTONES as CHECKSUM_TOMBSTONES
from sinks.migrations import table_name
from sinks.read.decisions import DEFERRED_RULE, check_state as decided_check_state, decision_status, is_dry_run
from sinks.read.replayed import after_end, ended_by_deletion, note as replay_note, replayed
from streams.correlate.release import LIFECYCLE_ORDER

DEFAULT_WINDOW = timedelta(hours=2)
MANIFEST_FIELDS = ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
                   "owner", "environment", "data_class")
ROW_LIMIT = 2000
#: ReplacingMergeTree sorting keys: what identifies one row across its versions.
KEYS = {
    "correlated_events": ("correlation_id",),
    "release_history": ("release_id", "occurred_at", "correlation_id"),
    "workload_timeline": ("workload_id", "occurred_at", "correlation_id"),
    "enriched_alerts": ("alert_fingerprint", "occurred_at", "correlation_id"),
    "gpu_allocations": ("node", "gpu_id", "started_at", "allocation_id"),
    "violations": ("violation_id",),
}
VIOLATION_COLS = ("violation_id", "version", "control_id", "title", "severity", "release_id", "workload_id", "namespace", "pod", "node",
                  "gpu_id", "opened_at", "closed_at", "detail")
#: Release rows in the order the release directory reads them (``streams.correlate.release._sort_key``):
#: by time, one instant's in the order a release lives them, then by id — by time and id alone, a
#: release registered, approved and promoted in one instant (one ``--at`` for every pipeline step)
#: read state ``release.approved`` or ``release.registered`` by the hash of the ids.
LIFECYCLE_RANK = "indexOf([" + ", ".join(f"'{etype}'" for etype in LIFECYCLE_ORDER) + "], event_type)"
RELEASE_ORDER = f"occurred_at, {LIFECYCLE_RANK}, correlation_id"
RELEASE_COLS = ("release_id", "occurred_at", "correlation_id", "version", "event_type", *MANIFEST_FIELDS, "actor", "approval_id",
                "reason", "to_environment", "superseded_release_id", "target", "expires_at", "release_state", "summary", "payload_json")
WORKLOAD_COLS = ("workload_id", "occurred_at", "correlation_id", "version", "event_type", "release_id", "namespace", "pod", "pod_uid",
                 "node", "queue", "cluster_queue", "priority_class", "priority", "reason", "message", "object_kind", "preemptor_kind",
                 "preemptor_namespace", "preemptor_name", "preemptor_uid", "victim_kind", "victim_namespace", "victim_name", "summary",
                 "source_topic", "source_partition", "source_offset")
#: The order of a workload's rows, which the section's ``state`` (its last row) and the latest
#: queue or priority follow: by time, and within one instant in the order the collector saw them —
#: Kubernetes times are whole seconds, so a workload's submission, quota reservation and
#: admission often share one, and the correlation id (a hash) ordered them at random (a workload
#: read "submitted" after its admission). A workload's events share a key, so they share the
#: partition of their topic, whose offsets are the order they were published in.
WORKLOAD_ORDER = "occurred_at, source_topic, source_partition, source_offset, correlation_id"
ALERT_COLS = ("alert_fingerprint", "occurred_at", "correlation_id", "version", "event_type", "attribution", "release_id",
              "model_name", "model_version", "workload_id", "namespace", "pod", "node", "gpu_id", "owner", "environment",
              "release_state", "alertname", "severity", "starts_at", "ends_at", "summary")
ALLOC_COLS = ("allocation_id", "version", "node", "gpu_id", "gpu", "mig_instance", "resource_name", "namespace", "pod", "container",
              "release_id", "workload_id", "pod_uid", "attribution", "started_at", "ended_at", "end_reason")
CORRELATED_COLS = ("correlation_id", "version", "event_type", "occurred_at", "attribution", "release_id", "workload_id",
                   "namespace", "pod", "pod_uid", "node", "gpu_id", "alert_fingerprint", "summary")
SCHEDULER_INCIDENT_TYPES = ("scheduler.preempted", "scheduler.evicted", "scheduler.requeued", "scheduler.failed_scheduling")
ENTRY_KINDS = ("alert", "release", "workload", "pod", "gpu", "model")


class TraceError(ValueError):
    """An entry point or option the trace cannot use (the message says which and why)."""


# --- parsing the CLI's options ------------------------------------------------------------

def parse_instant(value) -> datetime | None:
    """A stored or ISO 8601 time (string or datetime) as an aware UTC datetime; no zone
    means UTC; ``None`` for an empty value. The read side's one time parser."""
    if value in (None, ""):
        return None
    if not isinstance(value, datetime):
        value = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00").replace(" ", "T", 1))
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)


def parse_time(text: str, option: str = "--at") -> datetime:
    """RFC 3339 / ISO 8601; a time without zone is taken as UTC."""
    try:
        value = parse_instant(text)
    except ValueError:
        value = None
    if value is None:
        raise TraceError(f"{option} {text!r}: not an ISO 8601 time (e.g. 2026-11-30T13:40:00Z)")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")


def parse_window(text: str) -> timedelta:
    """'90s', '15m', '2h', '1d'."""
    match = _DURATION.match(text or "")
    if not match:
        raise TraceError(f"--window {text!r}: use a number and a unit: 90s, 15m, 2h, 1d")
    n, unit = float(match.group(1)), match.group(2)
    return timedelta(seconds=n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit])


def format_window(value: timedelta) -> str:
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0 and seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def ch_time(value: datetime) -> str:
    """A DateTime64(3, 'UTC') parameter value (ClickHouse does not parse 'T…Z' here)."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}"


#: The earliest time a DateTime64 column holds: a window or look-back reaching further back covers
#: every row from there.
EARLIEST = datetime(1900, 1, 1, tzinfo=timezone.utc)


def time_before(value: datetime, span: timedelta) -> datetime:
    """``value - span``, or ``EARLIEST`` when that is earlier (or before year 1: an OverflowError,
    seen as a traceback for `trace --window 1000000d` and `audit --lookback 1000000d`)."""
    try:
        return max(value - span, EARLIEST)
    except OverflowError:
        return EARLIEST


def norm_time(value) -> str | None:
    """Every time in the output as 'YYYY-MM-DDTHH:MM:SS.fffZ', so strings sort as times."""
    value = parse_instant(value)
    if value is None:
        return None
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


#: Tables keyed by an attributed column, read with the newest-version check (see Store.latest).
SUPERSEDED_CHECK = frozenset({"workload_timeline"})
#: Tables whose tombstones ``Store.latest`` leaves out (on the latest version: ``sinks.checksum.TOMBSTONES``,
#: the same condition): an allocation withdrawn (``schemas.outputs.ALLOCATION_WITHDRAWN``). (Violations'
#: withdrawals are told apart by their readers: ``is_withdrawn``.)
TOMBSTONES = {"gpu_allocations": CHECKSUM_TOMBSTONES["gpu_allocations"]}
TOMBSTONE_COLUMNS = {"gpu_allocations": ("end_reason",)}
TIME_COLUMNS = {"opened_at", "closed_at", "occurred_at", "started_at", "ended_at", "starts_at", "ends_at", "expires_at"}


# --- reading latest versions ----------------------------------------------------------------

class Store:
    """Parameterised reads of the latest version of rows, with FINAL or argMax."""

    def __init__(self, reader, database: str, cluster: str | None = None, mode: str = "final") -> None:
        if mode not in ("final", "argmax"):
            raise TraceError(f"mode must be final or argmax, got {mode!r}")
        self.reader = reader
        self.database = database
        self.cluster = cluster
        self.mode = mode
        self.queries = 0
        self.truncated: set[str] = set()

    def _table(self, table: str) -> str:
        return "{db:Identifier}." + table_name(table, self.cluster)

    def latest(self, table: str, columns: tuple[str, ...], where: str, params: dict, after: str | None = None,
               after_columns: tuple[str, ...] = (), order: str | None = None, limit: int = ROW_LIMIT) -> list[dict[str, Any]]:
        """Rows of ``table`` at their latest version.

        ``where`` may only use columns that never change between versions of a row
        (its key, its own time, an allocation's pod): it is applied before the versions
        are collapsed. ``after`` may use any column (``after_columns`` lists them for the
        argMax form); it is applied to the latest version only — a row whose older
        version matched but whose latest does not is not returned.
        """
        keys = KEYS[table]
        t = self._table(table)
        order_sql = f" ORDER BY {order}" if order else ""
        if table in TOMBSTONES:
            # (on the latest version only: an allocation's withdrawal supersedes the interval it went out as)
            after = f"({after}) AND {TOMBSTONES[table]}" if after else TOMBSTONES[table]
            after_columns = (*after_columns, *TOMBSTONE_COLUMNS[table])
        in_op = "GLOBAL IN" if self.cluster else "IN"
        if table in SUPERSEDED_CHECK:
            # Keyed by an attributed column (workload_timeline): a row re-attributed from one
            # workload to another leaves its old version under the old key. Keep a row only
            # if it is the newest version of its correlation_id anywhere in the table. Every
            # version shares its occurred_at, so the (occurred_at, correlation_id)
            # projection answers this with a few granules.
            matching = f"({where})" + (f" AND ({after})" if after else "")
            newest = (f"(correlation_id, version) {in_op} (SELECT correlation_id, max(version) FROM {t} WHERE "
                      f"(occurred_at, correlation_id) {in_op} (SELECT occurred_at, correlation_id FROM {t} WHERE {matching}) "
                      f"GROUP BY correlation_id)")
            after = f"({after}) AND {newest}" if after else newest
        if self.mode == "final":
            cond = f"({where})" + (f" AND ({after})" if after else "")
            sql = f"SELECT {', '.join(columns)} FROM {t} FINAL WHERE {cond}{order_sql} LIMIT {int(limit)}"
        else:
            values = [c for c in dict.fromkeys((*columns, *after_columns)) if c not in keys and c != "version"]
            inner_cols = ", ".join([*keys, "max(version) AS version__v", *[f"argMax({c}, version) AS {c}__v" for c in values]])
            outer_cols = ", ".join([*keys, "version__v AS version", *[f"{c}__v AS {c}" for c in values]])
            prefilter = (f" AND ({', '.join(keys)}) {in_op} (SELECT {', '.join(keys)} FROM {t} WHERE ({where}) AND ({after}))"
                         if after else "")
            inner = f"SELECT {inner_cols} FROM {t} WHERE ({where}){prefilter} GROUP BY {', '.join(keys)}"
            sql = (f"SELECT {', '.join(columns)} FROM (SELECT {outer_cols} FROM ({inner}))"
                   + (f" WHERE {after}" if after else "") + f"{order_sql} LIMIT {int(limit)}")
        self.queries += 1
        rows = self.reader.query(sql, {"db": self.database, **params}).dicts()
        if len(rows) >= limit:
            self.truncated.add(table)
        for row in rows:
            for col in TIME_COLUMNS.intersection(row):
                row[col] = norm_time(row[col])
        return rows

    def candidates(self, table: str, column: str, where: str, params: dict) -> list[str]:
        """Distinct values of ``column`` over *every* version of the rows matching
        ``where`` (no FINAL, so projections serve it): a superset that the caller checks
        against the latest versions."""
        # An aggregate, not DISTINCT: DISTINCT on a sorting-key prefix is read in key order,
        # which makes ClickHouse pass over the projections.
        sql = f"SELECT groupUniqArray({ROW_LIMIT})({column}) AS v FROM {self._table(table)} WHERE {where}"
        self.queries += 1
        rows = self.reader.query(sql, {"db": self.database, **params}).dicts()
        values = sorted(rows[0]["v"]) if rows else []
        if len(values) >= ROW_LIMIT:
            self.truncated.add(table)
        return values


# Pairs travel as 'a/b' strings next to a plain list of the indexed half: tuples do not
# survive the JSON hop to the worker's query endpoint, and `pod IN` uses the bloom index.
POD_IN = "pod IN {pod_names:Array(String)} AND concat(namespace, '/', pod) IN {pod_keys:Array(String)}"


def _pod_params(pods) -> dict:
    return {"pod_names": sorted({p for _, p in pods}), "pod_keys": sorted(f"{ns}/{p}" for ns, p in pods)}


def _at_cond(column: str, at: datetime | None) -> str:
    return f"{column} <= {{at:DateTime64(3, 'UTC')}}" if at else "1"


def _at_params(at: datetime | None) -> dict:
    return {"at": ch_time(at)} if at else {}


# --- resolving an entry to a root ------------------------------------------------------------

def _root_from_identity(row: dict) -> tuple[str, str] | None:
    if row.get("release_id"):
        return ("release", row["release_id"])
    if row.get("workload_id"):
        return ("workload", row["workload_id"])
    if row.get("namespace") and row.get("pod"):
        return ("pod", f"{row['namespace']}/{row['pod']}")
    return None


def check_entry(kind: str, value: str) -> None:
    """Raise TraceError when an entry point's value is not of its form (``--pod NS/NAME``,
    ``--gpu NODE/GPU_ID``) — before the store is opened: a malformed flag is the person's to
    fix whether or not the store answers (``--gpu n3`` said the store was down)."""
    if kind == "gpu" and value and "/" not in value:
        # A node alone (a node-level alert names no GPU): say how to name one of its GPUs.
        raise TraceError(f"--gpu {value!r}: expected NODE/GPU_ID — a GPU of node {value} is {value}/<GPU UUID> or {value}/<DCGM "
                         f"index>; its GPUs: gpuledger sql \"SELECT DISTINCT gpu_id FROM gpu_allocations WHERE node = '{value}'\"")
    if kind in ENTRY_FORMS:
        _split_pair(value, kind, ENTRY_FORMS[kind])


#: The entry points given as a pair, and their form.
ENTRY_FORMS = {"pod": "NAMESPACE/NAME", "gpu": "NODE/GPU_ID"}


def _split_pair(value: str, what: str, example: str) -> tuple[str, str]:
    left, sep, right = (value or "").partition("/")
    if not sep or not left or not right:
        raise TraceError(f"--{what} {value!r}: expected {example}")
    return left, right


def _allocation_at(allocs: list[dict], at: str | None) -> dict | None:
    """The allocation holding a device at ``at`` (latest start wins); without ``at`` the
    latest one; if none held it at ``at``, the last one that started before."""
    if not allocs:
        return None
    ordered = sorted(allocs, key=lambda a: (a["started_at"], a["allocation_id"]))
    if at is None:
        return ordered[-1]
    holding = [a for a in ordered if a["started_at"] <= at and (a["ended_at"] is None or at < a["ended_at"])]
    return (holding or [a for a in ordered if a["started_at"] <= at] or [None])[-1]


def _holds(alloc: dict) -> str:
    """How an allocation holds the physical GPU its ``gpu`` names: a MIG slice, a
    time-slicing share, or (a DRA device named by driver/pool/device) the whole GPU."""
    if alloc["mig_instance"]:
        return "mig_slice"
    return "share" if "::" in alloc["gpu_id"] or "/vgpu" in alloc["gpu_id"] else "dra_device"


class _Resolver:
    def __init__(self, store: Store, at: datetime | None) -> None:
        self.store = store
        self.at = at
        self.at_s = norm_time(at) if at else None
        self.notes: list[str] = []
        self.holders: list[dict] = []  # slices/shares of a physical GPU entry point

    def workload(self, workload_id: str) -> tuple[str, str] | None:
        st = self.store
        rows = st.latest(
            "workload_timeline", ("workload_id", "occurred_at", "correlation_id", "version", "release_id"),
            f"workload_id = {{w:String}} AND {_at_cond('occurred_at', self.at)}", {"w": workload_id, **_at_params(self.at)},
            order="occurred_at, correlation_id")
        named = [r["release_id"] for r in rows if r["release_id"]]
        if named:
            return ("release", named[-1])
        allocs = st.latest("gpu_allocations", ("allocation_id", "version", "release_id", "started_at"),
                           _at_cond("started_at", self.at), {"w": workload_id, **_at_params(self.at)}, after="workload_id = {w:String}",
                           after_columns=("workload_id",), order="started_at, allocation_id")
        allocs = [a for a in allocs if a["release_id"]]
        if allocs:
            return ("release", allocs[-1]["release_id"])
        if rows or allocs:
            return ("workload", workload_id)
        return None

    def workload_named(self, value: str) -> tuple[tuple[str, str] | None, str | None]:
        """``--workload`` for an id no row has: (root, the workload id used) when exactly one
        workload of that namespace has that name, else (None, None); a note says which was
        picked, which match, or the form an id has. A workload id includes what owns the pods
        (``producers.kubernetes.mapping``): ``NS/NAME`` of a Kueue Workload, which Kueue names
        ``<kind>-<owner name>-<5 hex>`` after its Job…, else ``NS/KIND/NAME`` of the owning
        controller or bare pod — so ``ml/train`` for Job train finds nothing (it is ``ml/Job/train``,
        or ``ml/job-train-1a2b3`` when Kueue queues it). Matched: ``NS/<any kind>/NAME`` and
        ``NS/<kind>-NAME-<5 hex>``, for NAME the last segment of ``value`` (``ml/train`` and
        ``ml/Job/train`` alike); each checked as of ``--at`` as ``workload`` checks an id."""
        ns, sep, rest = value.partition("/")
        if not sep:  # (a name alone: no namespace to look in)
            ns, rest = "", value
        name = rest.rpartition("/")[2]
        n, w = ns or "NS", name or "NAME"  # (the examples in the person's own terms)
        form = (f"a workload id is NAMESPACE/NAME of its Kueue Workload ({n}/job-{w}-<hash> for a queued Job {w}) or else "
                f"NAMESPACE/KIND/NAME of what owns its pods ({n}/Job/{w}, {n}/JobSet/{w}, {n}/Deployment/{w}, {n}/Pod/{w} for a bare pod) "
                "— as `trace --pod` shows it")
        if not ns or not name:
            self.notes.append(f"no workload has id {value!r}: {form}")
            return None, None
        shape = re.compile(rf"^{re.escape(ns)}/(?:[^/]+/{re.escape(name)}|[a-z0-9]+-{re.escape(name)}-[0-9a-f]{{5}})$")
        cands = self.store.candidates("workload_timeline", "workload_id",
                                      "startsWith(workload_id, {prefix:String}) AND (endsWith(workload_id, {tail:String}) "
                                      "OR position(workload_id, {mid:String}) > 0)",
                                      {"prefix": f"{ns}/", "tail": f"/{name}", "mid": f"-{name}-"})
        found = [(c, root) for c in cands if c != value and shape.match(c) and (root := self.workload(c)) is not None]
        if len(found) > 1:
            # A queued Job's deferral (NS/Job/NAME) is its Kueue Workload's (NS/job-NAME-…): one workload, not two.
            ids = [c for c, _ in found]
            rows = self.store.latest("workload_timeline", ("workload_id", "occurred_at", "correlation_id", "version", "event_type", "payload_json"),
                                     f"workload_id IN {{ws:Array(String)}} AND {_at_cond('occurred_at', self.at)}", {"ws": ids, **_at_params(self.at)},
                                     order="workload_id, occurred_at, correlation_id")
            links = deferral_links(self.store, rows, self.at)
            found = [(c, root) for c, root in found if links.get(c) not in ids]
        if len(found) == 1:
            picked, root = found[0]
            self.notes.append(f"no workload has id {value}; traced {picked}, the one workload named {name} in {ns} — {form}")
            return root, picked
        if found:
            self.notes.append(f"no workload has id {value}; {len(found)} workloads named {name} in {ns}: "
                              f"{', '.join(c for c, _ in found)} — trace one of them with --workload; {form}")
        else:
            self.notes.append(f"no workload has id {value}{' as of --at' if self.at else ''}, nor any workload named {name} in {ns}: {form}")
        return None, None

    def pod(self, namespace: str, pod: str) -> tuple[str, str] | None:
        st = self.store
        params = {"ns": namespace, "pod": pod, **_at_params(self.at)}
        cands = st.candidates("workload_timeline", "workload_id", "pod = {pod:String} AND namespace = {ns:String}", params)
        rows = st.latest(
            "workload_timeline", ("workload_id", "occurred_at", "correlation_id", "version", "release_id"),
            f"workload_id IN {{ws:Array(String)}} AND {_at_cond('occurred_at', self.at)}", {**params, "ws": cands},
            after="namespace = {ns:String} AND pod = {pod:String}", after_columns=("namespace", "pod"),
            order="occurred_at, correlation_id") if cands else []
        if rows:
            return self.workload(rows[-1]["workload_id"]) or ("workload", rows[-1]["workload_id"])
        allocs = st.latest("gpu_allocations", ("allocation_id", "version", "release_id", "workload_id", "namespace", "pod", "started_at"),
                           f"namespace = {{ns:String}} AND pod = {{pod:String}} AND {_at_cond('started_at', self.at)}", params,
                           order="started_at, allocation_id")
        for alloc in reversed(allocs):
            if alloc["release_id"] or alloc["workload_id"]:
                return _root_from_identity(alloc)
        events = st.latest("correlated_events", ("correlation_id", "version", "occurred_at", "release_id", "workload_id"),
                           _at_cond("occurred_at", self.at), params, after="namespace = {ns:String} AND pod = {pod:String}",
                           after_columns=("namespace", "pod"), order="occurred_at, correlation_id")
        for ev in reversed(events):
            if ev["release_id"] or ev["workload_id"]:
                return _root_from_identity(ev)
        if allocs or events:
            return ("pod", f"{namespace}/{pod}")
        return None

    def gpu(self, node: str, gpu_id: str, at_s: str | None = None, entry: bool = False) -> tuple[str, str] | None:
        """``entry``: the trace's own entry point (``--gpu``), which a GPU's alerts can answer when
        no allocation held it; not when an alert's chain goes through its GPU."""
        at_s = at_s or self.at_s
        allocs = self.store.latest("gpu_allocations", ALLOC_COLS, "node = {node:String} AND gpu_id = {gpu:String}",
                                   {"node": node, "gpu": gpu_id}, order="started_at, allocation_id")
        alloc = _allocation_at(allocs, at_s)
        held_whole = alloc is not None and (at_s is None or alloc["ended_at"] is None or at_s < alloc["ended_at"])
        if not held_whole and (slices := self.slices(node, gpu_id, at_s)):
            return self._shared_root(node, gpu_id, at_s, slices)
        if alloc is None:
            if gpu_id.isdigit() and entry:  # the DCGM index (`n3/0`), which no allocation names
                return self._dcgm_index(node, gpu_id, at_s)
            if entry and (alerted := self._alerted_gpu(node, gpu_id)) is not None:
                return alerted
            self._unknown_parents(node, gpu_id, at_s)
            return None
        if at_s and alloc["ended_at"] is not None and alloc["ended_at"] <= at_s:
            self.notes.append(f"no allocation held {node}/{gpu_id} at {at_s}; the last one before ended at {alloc['ended_at']}")
        elif not at_s and alloc["ended_at"] is not None:
            # (the chain is its last holder's: said, or an idle GPU read as held by it now)
            self.notes.append(f"no allocation holds {node}/{gpu_id} now; the last one ended at {alloc['ended_at']} (the chain is its holder's)")
        return _root_from_identity(alloc)

    def _alerted_gpu(self, node: str, gpu_id: str) -> tuple[str, str] | None:
        """A GPU no allocation ever held but alerts name (an idle GPU failing): the chain of its
        latest alert as of ``--at`` — it read "matches nothing in the store" beside its alerts."""
        rows = self.store.latest("enriched_alerts", ALERT_COLS, _at_cond("occurred_at", self.at), {"node": node, "gpu": gpu_id, **_at_params(self.at)},
                                 after="node = {node:String} AND gpu_id = {gpu:String}", after_columns=("node", "gpu_id"),
                                 order="occurred_at, correlation_id")
        if not rows:
            return None
        last = rows[-1]
        fps = {r["alert_fingerprint"] for r in rows}
        self.notes.append(f"no allocation held {node}/{gpu_id}{' by ' + self.at_s if self.at_s else ''}; {len(fps)} alert(s) name it — the "
                          f"chain is its latest alert's, {last['alertname']} {last['alert_fingerprint']} at {last['occurred_at']}")
        return _root_from_identity(last) or ("alert", last["alert_fingerprint"])

    def _dcgm_index(self, node: str, index: str, at_s: str | None) -> tuple[str, str] | None:
        """``NODE/INDEX``: the GPU of that index on the node, as a DCGM exporter alert's labels map
        it (its ``gpu`` label is the index, ``UUID`` the device id the allocations name) — the
        latest such alert as of ``at_s`` (else the earliest after it: the index of a GPU is the
        slot's, its UUID changes only when the GPU is replaced). A responder reads ``n3/0`` off a
        DCGM dashboard; the pod-resources API names GPUs by UUID only."""
        rows = self.store.latest("enriched_alerts", ("alert_fingerprint", "occurred_at", "correlation_id", "version", "node", "gpu_id"),
                                 "labels['gpu'] = {index:String}", {"index": index, "node": node},
                                 after="node = {node:String} AND gpu_id != ''", after_columns=("node", "gpu_id"),
                                 order="occurred_at, correlation_id")
        before = [r for r in rows if at_s is None or r["occurred_at"] <= at_s]
        if not rows:
            self.notes.append(f"no allocation names {node}/{index}: a GPU id is the device id the pod-resources API reported (GPU-… UUID, "
                              f"MIG-…), and no DCGM alert in the store maps index {index} of {node} to one")
            return None
        row = before[-1] if before else rows[0]
        uuids = sorted({r["gpu_id"] for r in rows})
        self.notes.append(f"{node}/{index} is the DCGM index of {row['gpu_id']} (labels of alert {row['alert_fingerprint']} at {row['occurred_at']})"
                          + (f"; the store's alerts name {len(uuids)} GPUs at that index over time: {', '.join(uuids)}" if len(uuids) > 1 else ""))
        return self.gpu(node, row["gpu_id"], at_s, entry=True)

    def slices(self, node: str, gpu_id: str, at_s: str | None) -> list[dict]:
        """The allocations of MIG slices / time-slicing shares of physical GPU ``gpu_id``
        held at ``at_s`` (without it: those still held, else the last ones)."""
        # gpu can change between versions (a MIG parent learned later): filter the latest only.
        parts = self.store.latest("gpu_allocations", ALLOC_COLS, "node = {node:String} AND gpu_id != {gpu:String}", {"node": node, "gpu": gpu_id},
                                  after="gpu = {gpu:String}", after_columns=("gpu",), order="started_at, allocation_id")
        if at_s is not None:
            return [a for a in parts if a["started_at"] <= at_s and (a["ended_at"] is None or at_s < a["ended_at"])]
        held = [a for a in parts if a["ended_at"] is None]
        return held or [a for a in parts if parts and a["started_at"] == parts[-1]["started_at"]]

    def _shared_root(self, node: str, gpu_id: str, at_s: str | None, slices: list[dict]) -> tuple[str, str] | None:
        self.holders = [{**_brief_alloc(a, at_s), "holds": _holds(a)} for a in slices]
        who = ", ".join(f"{a['namespace']}/{a['pod']} ({a['gpu_id']}, {_holds(a).replace('_', ' ')})" for a in slices)
        self.notes.append(f"{node}/{gpu_id} is a physical GPU held as {len(slices)} MIG slice(s), share(s) or DRA device(s)"
                          f"{' at ' + at_s if at_s else ''}: {who}")
        releases = sorted({a["release_id"] for a in slices if a["release_id"]})
        if len(releases) == 1 and all(a["release_id"] for a in slices):
            return ("release", releases[0])
        if len(slices) > 1:
            self.notes.append(f"its holders belong to {len(releases) or 'no'} release(s) ({', '.join(releases) or 'unattributed'}); "
                              f"the chain follows the first, {slices[0]['namespace']}/{slices[0]['pod']}")
        return _root_from_identity(slices[0])

    def _unknown_parents(self, node: str, gpu_id: str, at_s: str | None) -> None:
        """Say why a GPU id matched nothing when MIG slices of unknown parent were held on its node."""
        parts = [a for a in self.store.latest("gpu_allocations", ALLOC_COLS, "node = {node:String}", {"node": node},
                                              after="mig_instance != '' AND gpu = ''", after_columns=("mig_instance", "gpu"),
                                              order="started_at, allocation_id")
                 if at_s is None or (a["started_at"] <= at_s and (a["ended_at"] is None or at_s < a["ended_at"]))]
        if parts:
            self.notes.append(f"no allocation names {node}/{gpu_id}, but {len(parts)} MIG slice(s) whose physical GPU is unknown were held on "
                              f"{node}{' at ' + at_s if at_s else ''}: " + ", ".join(f"{a['namespace']}/{a['pod']} ({a['gpu_id']})" for a in parts)
                              + " — the MIG -> GPU mapping is unknown (no DCGM alert with pod labels and no DRA ResourceSlice named their parent)")

    def model(self, name: str, version: str | None) -> tuple[tuple[str, str] | None, list[str]]:
        """The model's most recently active release as of ``at`` (and the others, in the same
        order): one holding GPUs first, then one whose lifecycle has not ended (its latest
        lifecycle event is not a rollback, revocation or retirement, and no later promotion
        replaced it), then by its latest event of any kind — a rollback counting as one of the
        release it restored. Ranked by the latest event alone, a release rolled back a minute ago (or one
        whose reservation was just released) came before the release serving in its place."""
        cond = "model_name = {model:String}" + (" AND model_version = {mv:String}" if version else "")
        rows = self.store.latest("release_history", ("release_id", "occurred_at", "correlation_id", "version", "event_type",
                                                     "superseded_release_id", "model_name", "model_version"),
                                 _at_cond("occurred_at", self.at), {"model": name, "mv": version or "", **_at_params(self.at)},
                                 after=cond, after_columns=("model_name", "model_version"), order=RELEASE_ORDER)
        last: dict[str, str] = {}
        ended: dict[str, bool] = {}
        ours = {row["release_id"] for row in rows}
        for row in rows:  # in event order: the last lifecycle event seen is the latest
            rid, at, etype, other = row["release_id"], row["occurred_at"], row["event_type"], row["superseded_release_id"]
            last[rid] = max(last.get(rid, ""), at)
            if etype in LIFECYCLE_EVENTS:
                ended[rid] = etype in ENDING_EVENTS
            if other in ours and other != rid:
                if etype == "release.promoted":  # it replaced ``other``, which serves no more
                    ended[other] = True
                elif etype == "release.rolled_back":  # ``other`` replaced it, and serves again from then
                    ended[other], last[other] = False, max(last.get(other, ""), at)
        if not last:
            return None, []
        holding = self._holding_gpus(list(last))
        ranked = sorted(last, key=lambda rid: (rid in holding, not ended.get(rid, False), last[rid], rid))
        return ("release", ranked[-1]), ranked[:-1][::-1]

    def _holding_gpus(self, release_ids: list[str]) -> set[str]:
        """The releases among ``release_ids`` with a GPU allocation held at ``at`` (now without it)."""
        allocs = self.store.latest("gpu_allocations", ("allocation_id", "version", "release_id", "started_at", "ended_at"),
                                   _at_cond("started_at", self.at), {"rids": release_ids, **_at_params(self.at)},
                                   after="release_id IN {rids:Array(String)}", after_columns=("release_id",), order="started_at, allocation_id")
        return {a["release_id"] for a in allocs if a["ended_at"] is None or (self.at_s is not None and self.at_s < a["ended_at"])}

    def alert(self, fingerprint: str) -> tuple[tuple[str, str] | None, list[dict]]:
        rows = self.store.latest("enriched_alerts", ALERT_COLS, f"alert_fingerprint = {{fp:String}} AND {_at_cond('occurred_at', self.at)}",
                                 {"fp": fingerprint, **_at_params(self.at)}, order="occurred_at, correlation_id")
        if not rows:
            return None, rows
        focal = rows[-1]
        root = _root_from_identity(focal)
        if root is None and focal.get("node") and focal.get("gpu_id"):
            root = self.gpu(focal["node"], focal["gpu_id"], focal["starts_at"])
        return root or ("alert", fingerprint), rows


# --- expanding a root into the chain -----------------------------------------------------------

def _brief_alert(row: dict, in_chain: bool) -> dict:
    keep = ("alert_fingerprint", "alertname", "severity", "event_type", "occurred_at", "starts_at", "ends_at", "attribution",
            "release_id", "release_state", "workload_id", "namespace", "pod", "node", "gpu_id", "summary", "correlation_id")
    out = {k: row.get(k) for k in keep if row.get(k) not in (None, "")}
    out["status"] = row["event_type"].split(".", 1)[1]
    out["in_chain"] = in_chain
    return out


def _brief_alloc(row: dict, at_s: str | None = None) -> dict:
    """An allocation as the trace shows it; as of ``at_s`` (``--at``), one that ended later is still held."""
    keep = ("allocation_id", "node", "gpu_id", "gpu", "mig_instance", "namespace", "pod", "container", "workload_id", "release_id",
            "attribution", "started_at", "ended_at", "end_reason")
    out = {k: row.get(k) for k in keep if row.get(k) not in (None, "") or k == "ended_at"}
    if at_s is not None and out["ended_at"] is not None and at_s < out["ended_at"]:
        out["ended_at"] = None
        out.pop("end_reason", None)
    return out


def _brief_scheduler(row: dict) -> dict:
    keep = ("occurred_at", "event_type", "workload_id", "namespace", "pod", "node", "reason", "message", "queue", "cluster_queue",
            "priority_class", "priority", "release_id", "summary", "correlation_id")
    out = {k: row.get(k) for k in keep if row.get(k) not in (None, "")}
    if row.get("preemptor_name"):
        out["preemptor"] = _ref_text(row.get("preemptor_kind"), row.get("preemptor_namespace"), row["preemptor_name"])
    elif row.get("preemptor_uid"):
        out["preemptor_uid"] = row["preemptor_uid"]
    if row.get("victim_name"):
        out["victim"] = "/".join(p for p in (row.get("victim_kind"), row.get("victim_namespace"), row["victim_name"]) if p)
    return out


def _ref_text(kind: str | None, namespace: str | None, name: str) -> str:
    return "/".join(p for p in (kind, namespace, name) if p)


def _preemptions(rows: list[dict], names: dict[str, str]) -> list[dict]:
    """One entry per preemption of a workload, however many sources reported it (the
    pod's Preempted event, the Kueue Workload's Preempted/Evicted condition…): the
    controls' clustering rule (``streams.controls.rules.preemption_clusters``), with
    the preemptor by name — a uid-only reference (Kueue names the preemptor by
    Workload uid) resolved through ``names`` (uid → Kind/namespace/name) when the
    store knows it, else said as an unresolved uid."""
    from streams.controls.rules import preemption_clusters

    by_id = {r["correlation_id"]: r for r in rows}
    compact = [{"id": r["correlation_id"], "type": r["event_type"], "at": r["occurred_at"], "p": {"reason": r.get("reason")}} for r in rows]
    out = []
    for cluster in preemption_clusters(compact):
        members = [_brief_scheduler(by_id[c["id"]]) for c in cluster]
        named = next((m["preemptor"] for m in members if m.get("preemptor")), None)
        uid = next((m["preemptor_uid"] for m in members if m.get("preemptor_uid")), None)
        entry = {"occurred_at": members[0]["occurred_at"], "event_type": "scheduler.preempted",
                 "reason": next((m["reason"] for m in members if m.get("reason")), None),
                 "sources": [f"{by_id[c['id']]['event_type']} ({by_id[c['id']].get('object_kind') or 'object'})" for c in cluster],
                 "correlation_ids": [c["id"] for c in cluster]}
        if named or (uid and uid in names):
            entry["preemptor"] = named or names[uid]
        elif uid:
            entry["preemptor_uid"] = uid
        out.append({k: v for k, v in entry.items() if v is not None})
    return out


def _release_section(rows: list[dict], release_id: str, gaps: list[str]) -> dict:
    manifest: dict[str, Any] = {}
    for field in MANIFEST_FIELDS:
        values = [r[field] for r in rows if r.get(field)]
        manifest[field] = values[-1] if values else None
    lifecycle = [{k: r[k] for k in ("occurred_at", "event_type", "actor", "approval_id", "to_environment", "reason",
                                    "superseded_release_id", "target", "summary", "correlation_id") if r.get(k) not in (None, "")}
                 for r in rows]
    def decided(r: dict, keys: tuple[str, ...]) -> dict:
        # The actor as the controls judged it ("alice (unauthenticated)", "ci for alice"), not
        # the bare name the payload carries: a typed "user:alice" and alice's proven approval
        # read the same (the audit's evidence says it the same way), and a delegation's person was lost.
        p = json.loads(r.get("payload_json") or "{}")
        out = {k: r[k] for k in keys if r.get(k)}
        actor = actor_text(decision_actor(p))
        if actor:
            out["actor"] = actor
        if p.get("authenticated_by"):
            out["authenticated_by"] = p["authenticated_by"]
        return out

    approvals = [decided(r, ("occurred_at", "approval_id")) for r in rows if r["event_type"] == "release.approved"]
    promotions = [decided(r, ("occurred_at", "to_environment", "approval_id")) for r in rows if r["event_type"] == "release.promoted"]
    if not rows:
        gaps.append(f"release {release_id}: no lifecycle event in the store (never registered with gpuledger, or after --at)")
    else:
        missing = [f for f in ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "owner") if not manifest[f]]
        if missing:
            gaps.append(f"release {release_id}: manifest lacks {', '.join(missing)}")
        if not approvals:
            gaps.append(f"release {release_id}: no approval recorded")
    # The state is the latest event of any kind (the definition the rows' release_state has); the
    # lifecycle state beside it is the latest of LIFECYCLE_EVENTS — a reservation released after a
    # rollback made the state "release.reservation_released", and the rollback was not on the line.
    # An evaluation counts only while the release has not moved past evaluation: one after its
    # approval or promotion (a scheduled re-evaluation) left a promoted, serving release reading
    # "lifecycle=release.evaluated" (an exploratory review's 3 a.m. responder).
    life = [r for r in rows if r["event_type"] in LIFECYCLE_EVENTS]
    moved_on = [i for i, r in enumerate(life) if r["event_type"] not in ("release.registered", "release.evaluated")]
    life = [r for i, r in enumerate(life) if r["event_type"] != "release.evaluated" or not moved_on or i < moved_on[0]]
    return {
        "release_id": release_id,
        "state": rows[-1]["event_type"] if rows else None,
        "state_since": rows[-1]["occurred_at"] if rows else None,
        "lifecycle_state": life[-1]["event_type"] if life else None,
        "lifecycle_since": life[-1]["occurred_at"] if life else None,
        **manifest,
        "approvals": approvals,
        "promotions": promotions,
        "lifecycle": lifecycle,
    }


def _admission_decision(r: dict) -> dict:
    """One ``admission.decided`` row as the trace shows it: the decision and rule (``reason``), who
    decided (``gate``), the state the AdmissionCheck controller set (``check_state``: the payload's
    ``operation`` at that gate) and ``status``. A ``deny`` is not always a refusal: the controller
    answers a Workload that may still pass (unapproved, unknown release, state not loaded) with
    its check ``Pending`` — the Workload keeps its place and is admitted once the approval
    arrives (producers/admission/controller.py) — so ``status`` is ``waiting`` for that,
    ``denied`` for a webhook deny or a ``Rejected`` check, ``deferred`` for the webhook letting a
    queued object in for the AdmissionCheck to decide (rule ``deferred-to-admission-check``), else
    ``allowed``; ``dry-run`` (with ``dry_run`` true) for the answer to a server-side dry run, where
    nothing was created."""
    decision, _, rule = (r.get("reason") or ":").partition(":")
    p = json.loads(r.get("payload_json") or "{}")
    gate = p.get("gate") or None
    check_state = decided_check_state(p)
    dry_run = is_dry_run(p)
    status = decision_status(decision, rule, check_state, dry_run)  # (sinks.read.decisions: the audit reads a decision the same way)
    out = {"occurred_at": r["occurred_at"], "decision": decision, "rule": rule, "status": status, "gate": gate, "check_state": check_state,
           "dry_run": dry_run, "message": r.get("message"), "summary": r.get("summary"), "correlation_id": r["correlation_id"]}
    if r.get("recorded_as"):  # (the webhook's deferral of a queued Job, recorded under the Job's id: ``_Chain._attach_deferrals``)
        out["recorded_as"] = r["recorded_as"]
    return out


def _workload_section(workload_id: str, rows: list[dict], pods: list[dict], gaps: list[str], names: dict[str, str] | None = None) -> dict:
    def latest(field):
        values = [r[field] for r in rows if r.get(field) not in (None, "")]
        return values[-1] if values else None

    decided = [_admission_decision(r) for r in rows if r["event_type"] == "admission.decided"]
    # A server-side dry run's answer decided nothing about this workload (nothing was created): shown
    # apart, never its last decision — a diffed pod read "not admitted: denied by gpuledger admit".
    decisions = [d for d in decided if not d["dry_run"]]
    rows = [r for r in rows if r["event_type"] != "admission.decided"]
    admissions = [r["occurred_at"] for r in rows if r["event_type"] == "scheduler.admitted"]
    # Held or refused by gpuledger admit and not admitted since: no admission and no pod are what
    # its decision says will happen, not missing links (the tree says "waiting" / "denied").
    held = not admissions and bool(decisions) and decisions[-1]["status"] in ("waiting", "denied")
    if rows and not admissions and not held:
        gaps.append(f"workload {workload_id}: no admission event (admitted before the store's history, or never admitted)")
    my_pods = sorted(f"{p['namespace']}/{p['pod']}" for p in pods if p.get("workload_id") == workload_id)
    if rows and not my_pods and not held:
        gaps.append(f"workload {workload_id}: no pod seen")
    return {
        "workload_id": workload_id,
        "queue": latest("queue"),
        "cluster_queue": latest("cluster_queue"),
        "priority_class": latest("priority_class"),
        "priority": latest("priority"),
        "admitted_at": admissions[0] if admissions else None,
        "admissions": admissions,
        # gpuledger admit's decisions on the workload (``_admission_decision``), and its answers to
        # server-side dry runs of it (status ``dry-run``: nothing was created).
        "admission_decisions": decisions,
        "dry_runs": [d for d in decided if d["dry_run"]],
        "state": rows[-1]["event_type"] if rows else None,
        "release_id": latest("release_id"),
        "preemptions": _preemptions(rows, names or {}),
        "evictions": [_brief_scheduler(r) for r in rows if r["event_type"] == "scheduler.evicted"],
        "pods": my_pods,
        "events": [_brief_scheduler(r) for r in rows],
    }


def _sorted_allocs(allocs) -> list[dict]:
    return sorted(allocs, key=lambda a: (a["started_at"], a["allocation_id"]))


def deferral_links(store: Store, rows: list[dict], at: datetime | None) -> dict[str, str]:
    """Workload id -> the Kueue Workload it is, for the ids among ``rows`` (workload_timeline rows
    with ``event_type`` and ``payload_json``) that hold only gpuledger admit's webhook deferrals.

    The webhook decides a Kueue-queued Job at its creation, before Kueue has made its Workload,
    and records the deferral under the Job's own id (``NS/Job/NAME``:
    ``streams.controls.admission.subject_of``); the Workload's events and its AdmissionCheck's
    decisions are under ``NS/<workload name>``. So the Job's id read as a second workload holding
    one deferral and nothing else — drawn as gaps. Its Workload is the one whose
    ``kueue.x-k8s.io/job-uid`` label (in its events' labels) is the deferred object's uid, as of
    ``at`` (the latest, if several). An id whose Workload the store does not have is left out."""
    deferred: dict[str, set[str]] = {}
    others: set[str] = set()  # ids with any other row
    for r in rows:
        p = json.loads(r.get("payload_json") or "{}") if r["event_type"] == "admission.decided" else {}
        if is_dry_run(p):
            continue  # (a dry run created no Job: no Workload has its uid, and it is no other row of the id either)
        if p.get("gate") == "webhook" and p.get("rule") == DEFERRED_RULE and p.get("object_uid"):
            deferred.setdefault(r["workload_id"], set()).add(p["object_uid"])
        else:
            others.add(r["workload_id"])
    deferred = {wid: uids for wid, uids in deferred.items() if wid not in others}
    if not deferred:
        return {}
    spaces = sorted({wid.partition("/")[0] + "/" for wid in deferred})
    # (by the namespace's prefix of the sorting key: the label alone would read the whole table)
    near = " OR ".join(f"startsWith(workload_id, {{ns{i}:String}})" for i in range(len(spaces)))
    found = store.latest("workload_timeline", ("workload_id", "occurred_at", "correlation_id", "version", "labels"),
                         f"({near}) AND labels[{{label:String}}] IN {{uids:Array(String)}} AND {_at_cond('occurred_at', at)}",
                         {**{f"ns{i}": p for i, p in enumerate(spaces)}, "label": KUEUE_JOB_UID_LABEL,
                          "uids": sorted(set().union(*deferred.values())), **_at_params(at)}, order="occurred_at, correlation_id")
    by_uid = {r["labels"][KUEUE_JOB_UID_LABEL]: r["workload_id"] for r in found}  # (in time order: the latest wins)
    return {wid: by_uid[uid] for wid, uids in deferred.items() for uid in sorted(uids) if uid in by_uid and by_uid[uid] != wid}


class _Chain:
    """The chain of one root, gathered in the steps ``_expand`` runs in order: the
    release, its workloads, their pods and allocations, the alerts attributed to any of
    them, and what else happened on their nodes in the window. Each step only widens
    the sets the next one reads (``workload_ids``, ``pods``, ``allocs``)."""

    def __init__(self, store: Store, root: tuple[str, str], at: datetime | None, window: timedelta) -> None:
        self.store, self.at, self.window = store, at, window
        self.at_p = _at_params(at)
        self.at_s = norm_time(at) if at else None
        self.gaps: list[str] = []
        self.kind, self.value = root
        self.release_id = self.value if self.kind == "release" else None
        self.release: dict | None = None
        self.workload_ids: set[str] = {self.value} if self.kind == "workload" else set()
        self.recorded_as: set[str] = set()  # ids whose rows moved to their Kueue Workload (_attach_deferrals)
        self.pod_keys: set[tuple[str, str]] = {tuple(self.value.split("/", 1))} if self.kind == "pod" else set()  # type: ignore[arg-type]
        self.release_rows: list[dict] = []
        self.release_allocs: list[dict] = []
        self.release_candidates: set[str] = set()
        self.wl_rows: list[dict] = []
        self.pods: dict[tuple[str, str], dict] = {}
        self.violations: list[dict] = []  # read_violations
        self.allocs: dict[str, dict] = {}
        self.alert_rows: dict[str, dict] = {}
        self.earlier_episodes: list[dict] = []  # the entry alert's episodes before its latest, not in the chain
        self.anchor_s: str | None = None
        self.anchor_what = "nothing"
        self.entry: tuple[str, str] = root  # the entry point (kind, value); set by _expand
        self.others_alerts: list[dict] = []
        self.neighbours: list[dict] = []
        self.other_allocs: list[dict] = []

    def _pod(self, namespace: str, pod: str, workload_id: str | None = None, nodes: list[str] | None = None) -> dict:
        return self.pods.setdefault((namespace, pod), {"namespace": namespace, "pod": pod, "pod_uid": None, "workload_id": workload_id,
                                                        "nodes": nodes if nodes is not None else []})

    # --- the steps -------------------------------------------------------------------------------

    def read_release(self) -> None:
        """The release's lifecycle, the workloads its rows may name, its allocations."""
        rid, at, at_p = self.release_id, self.at, self.at_p
        if not rid:
            self.gaps.append(f"{self.kind} {self.value}: no release attributed (unattributed)" if self.kind in ("workload", "pod")
                             else "alert is attributed to no release, workload or pod (unattributed)")
            return
        self.release_rows = self.store.latest("release_history", RELEASE_COLS, f"release_id = {{r:String}} AND {_at_cond('occurred_at', at)}",
                                              {"r": rid, **at_p}, order=RELEASE_ORDER)
        self.release = _release_section(self.release_rows, rid, self.gaps)
        if at is not None and self.release_rows:
            self.release.update(self._manifest_as_of(rid, at, at_p))
        self.release.update(self._succession(rid, at, at_p))
        # Candidates from the release_id projection; kept below only where a latest row names the release.
        self.release_candidates = set(self.store.candidates("workload_timeline", "workload_id",
                                                            f"release_id = {{r:String}} AND {_at_cond('occurred_at', at)}", {"r": rid, **at_p}))
        self.release_allocs = self.store.latest("gpu_allocations", ALLOC_COLS, _at_cond("started_at", at), {"r": rid, **at_p},
                                                after="release_id = {r:String}", after_columns=("release_id",), order="started_at, allocation_id")
        self.workload_ids.update(a["workload_id"] for a in self.release_allocs if a["workload_id"])
        self.pod_keys.update((a["namespace"], a["pod"]) for a in self.release_allocs)

    def _succession(self, rid: str, at: datetime | None, at_p: dict) -> dict:
        """What other releases did to this one (their rows naming it ``superseded_release_id``): a
        promotion that replaced it, a rollback that restored it. Its own rows say neither — a
        release replaced an hour ago read ``lifecycle=release.promoted``, as if it still served.
        ``replaced_by``: the replacement in force at ``at`` (now), if the latest of these came
        after the release's own last lifecycle event."""
        rows = self.store.latest("release_history", ("release_id", "occurred_at", "correlation_id", "version", "event_type",
                                                     "superseded_release_id", "to_environment"),
                                 _at_cond("occurred_at", at), {"r": rid, **at_p}, after="superseded_release_id = {r:String}",
                                 after_columns=("superseded_release_id",), order=RELEASE_ORDER)
        steps = []
        for r in rows:
            if r["release_id"] == rid:
                continue
            if r["event_type"] == "release.promoted":
                steps.append({"occurred_at": r["occurred_at"], "event": "replaced", "by": r["release_id"],
                              **({"to_environment": r["to_environment"]} if r.get("to_environment") else {})})
            elif r["event_type"] == "release.rolled_back":
                steps.append({"occurred_at": r["occurred_at"], "event": "restored", "by": r["release_id"]})
        if not steps:
            return {}
        out: dict[str, Any] = {"succession": steps}
        own = self.release.get("lifecycle_since") or ""
        if steps[-1]["event"] == "replaced" and steps[-1]["occurred_at"] >= own:
            out["replaced_by"] = steps[-1]
        return out

    def read_violations(self) -> None:
        """The controls' violations about the chain — its release, workloads and pods — as they
        stood at ``at`` (now): withdrawn ones left out. A trace showed a compliant-looking chain
        beside open control 2 and 8 violations for it (they were only in ``audit``)."""
        pods = sorted({f"{ns}/{pod}" for ns, pod in self.pods} | {f"{ns}/{pod}" for ns, pod in self.pod_keys})
        if not (self.release_id or self.workload_ids or pods):
            self.violations = []
            return
        rows = self.store.latest("violations", VIOLATION_COLS, _at_cond("opened_at", self.at),
                                 {"r": self.release_id or "", "wids": sorted(self.workload_ids | self.recorded_as), "pods": pods, **self.at_p},
                                 after="(release_id != '' AND release_id = {r:String}) OR (workload_id != '' AND workload_id IN {wids:Array(String)})"
                                       " OR concat(namespace, '/', pod) IN {pods:Array(String)}",
                                 after_columns=("release_id", "workload_id", "namespace", "pod"), order="opened_at, violation_id")
        from streams.controls.rules import WITHDRAWN

        out = []
        for v in rows:
            if (v.get("detail") or "").startswith(WITHDRAWN):
                continue
            closed = v.get("closed_at")
            if closed is not None and self.at_s is not None and closed > self.at_s:
                closed = None  # (closed after --at: open then)
            out.append({k: v[k] for k in ("control_id", "title", "severity", "opened_at", "detail", "violation_id", "release_id", "workload_id")
                        if v.get(k) not in (None, "")} | {"closed_at": closed, "open": closed is None})
        self.violations = out

    def _manifest_as_of(self, rid: str, at: datetime, at_p: dict) -> dict:
        """The release's manifest as it stood at ``at``, from its events as they were sent.

        A release's rows keep their latest version, rendered with the manifest as known now: a
        release registered in staging and promoted to prod later showed ``environment=prod``
        at an ``--at`` before the promotion. The worker's manifest is, per field, the value of
        the latest event (by time, one instant's in lifecycle order, then event id: ``RELEASE_ORDER``)
        that carries one (``streams.correlate.release``);
        this folds the same from ``raw_events`` (the identities as sent) up to ``at``. A field no
        raw event up to ``at`` carries — raw rows gone (TTL) or never stored — keeps the rows' value."""
        fields = ", ".join(MANIFEST_FIELDS)
        sql = (f"SELECT event_id, occurred_at, {fields} FROM {self.store._table('raw_events')} "
               f"WHERE release_id = {{r:String}} AND startsWith(event_type, 'release.') AND {_at_cond('occurred_at', at)} "
               f"ORDER BY occurred_at, {LIFECYCLE_RANK}, event_id LIMIT {ROW_LIMIT}")
        self.store.queries += 1
        rows = self.store.reader.query(sql, {"db": self.store.database, "r": rid, **at_p}).dicts()
        manifest: dict[str, str] = {}
        for row in rows:  # in event order: the latest value of each field wins
            manifest.update({f: row[f] for f in MANIFEST_FIELDS if row.get(f)})
        return manifest

    def read_workloads(self) -> None:
        """The workloads' rows (a candidate counts only if its latest row names the
        release), and the pods and nodes those rows name."""
        if self.workload_ids or self.release_candidates:
            rows = self.store.latest(
                # (payload_json: an admission decision's gate and check state, which no column holds)
                "workload_timeline", (*WORKLOAD_COLS, "payload_json"), f"workload_id IN {{ws:Array(String)}} AND {_at_cond('occurred_at', self.at)}",
                {"ws": sorted(self.workload_ids | self.release_candidates), **self.at_p}, order=f"workload_id, {WORKLOAD_ORDER}")
            self.workload_ids.update(r["workload_id"] for r in rows
                                     if r["workload_id"] in self.release_candidates and r["release_id"] == self.release_id)
            self.wl_rows = [r for r in rows if r["workload_id"] in self.workload_ids]
            self._attach_deferrals()
        for r in self.wl_rows:
            if r["namespace"] and r["pod"] and not (r["event_type"] == "admission.decided" and is_dry_run(json.loads(r.get("payload_json") or "{}"))):
                # (a dry run's pod was never created: no pod section, no "no GPU allocation seen")
                p = self._pod(r["namespace"], r["pod"], r["workload_id"])
                p["pod_uid"] = r["pod_uid"] or p["pod_uid"]
                if r["node"] and r["node"] not in p["nodes"]:
                    p["nodes"].append(r["node"])
        for ns, name in self.pod_keys:
            self._pod(ns, name)

    def _attach_deferrals(self) -> None:
        """The webhook's deferral of a Kueue-queued Job, under the Kueue Workload that queues it
        (``deferral_links``): its rows move there, each keeping the id it was recorded under
        (``recorded_as``). Without such a Workload the Job's id stays, shown as a deferral."""
        moved = deferral_links(self.store, self.wl_rows, self.at)
        if not moved:
            return
        new = sorted(set(moved.values()) - self.workload_ids)
        if new:
            self.wl_rows += self.store.latest("workload_timeline", (*WORKLOAD_COLS, "payload_json"),
                                              f"workload_id IN {{ws:Array(String)}} AND {_at_cond('occurred_at', self.at)}",
                                              {"ws": new, **self.at_p}, order=f"workload_id, {WORKLOAD_ORDER}")
        for r in self.wl_rows:
            if r["workload_id"] in moved:
                r["recorded_as"], r["workload_id"] = r["workload_id"], moved[r["workload_id"]]
        self.workload_ids = (self.workload_ids - set(moved)) | set(moved.values())
        self.recorded_as.update(moved)
        self.wl_rows.sort(key=lambda r: (r["workload_id"], r["occurred_at"], r["source_topic"], r["source_partition"], r["source_offset"],
                                         r["correlation_id"]))

    def read_allocations(self) -> None:
        """Every allocation of the chain's pods (and the release's), and the pods and nodes they add."""
        self.allocs = {a["allocation_id"]: a for a in self.release_allocs}
        if self.pods:
            for a in self.store.latest("gpu_allocations", ALLOC_COLS, f"{POD_IN} AND {_at_cond('started_at', self.at)}",
                                       {**_pod_params(self.pods), **self.at_p}, order="started_at, allocation_id"):
                self.allocs[a["allocation_id"]] = a
        for a in self.allocs.values():
            p = self._pod(a["namespace"], a["pod"], a["workload_id"] or None)
            p["pod_uid"] = p["pod_uid"] or a["pod_uid"] or None
            p["workload_id"] = p["workload_id"] or a["workload_id"] or None
            if a["node"] not in p["nodes"]:
                p["nodes"].append(a["node"])

    def read_alerts(self, focal_alerts: list[dict]) -> None:
        """Alerts attributed to the release, its workloads or pods (as of at), with the
        entry's own alert; an alert's pod joins the chain."""
        conds = []
        params: dict[str, Any] = {**self.at_p}
        if self.release_id:
            conds.append("release_id = {r:String}")
            params["r"] = self.release_id
        if self.workload_ids:
            conds.append("workload_id IN {ws:Array(String)}")
            params["ws"] = sorted(self.workload_ids)
        if self.pods:
            conds.append(POD_IN)
            params.update(_pod_params(self.pods))
        chain_alerts = self.store.latest(
            "enriched_alerts", ALERT_COLS, _at_cond("occurred_at", self.at), params, after=" OR ".join(f"({c})" for c in conds),
            after_columns=("release_id", "workload_id", "namespace", "pod"), order="occurred_at, correlation_id") if conds else []
        # The entry alert's latest episode (its rows of the latest startsAt) is the chain's; an earlier
        # episode is listed, out of the chain, unless attributed to it: it fired on another pod, which
        # joined the chain after its allocations were read ("no GPU allocation seen" of a pod that held
        # the GPU — an exploratory review), with its release's violations.
        episode = focal_alerts[-1].get("starts_at") if focal_alerts else None
        current = [r for r in focal_alerts if r.get("starts_at") == episode]
        self.alert_rows = {r["correlation_id"]: r for r in [*chain_alerts, *current]}
        self.earlier_episodes = [r for r in focal_alerts if r["correlation_id"] not in self.alert_rows]
        for r in self.alert_rows.values():
            if r.get("namespace") and r.get("pod") and (r["namespace"], r["pod"]) not in self.pods:
                self._pod(r["namespace"], r["pod"], r.get("workload_id") or None, [r["node"]] if r.get("node") else [])

    def _anchor(self) -> tuple[str | None, str]:
        """The window's end and what it is: --at; else the entry point's own time — an
        alert's startsAt (its latest episode), a workload's or pod's latest event — else
        (release, model, GPU) the chain's latest event."""
        if self.at:
            return norm_time(self.at), "--at"
        kind, value = self.entry
        if kind == "alert":
            starts = [r.get("starts_at") or r["occurred_at"] for r in self.alert_rows.values() if r.get("alert_fingerprint") == value]
            if starts:
                return max(starts), "the alert's startsAt"
        if kind == "workload":
            times = [r["occurred_at"] for r in self.wl_rows if value in (r["workload_id"], r.get("recorded_as"))]
            if times:
                return max(times), "the workload's latest event"
        if kind == "pod":
            ns, _, name = value.partition("/")
            times = [r["occurred_at"] for r in self.wl_rows if (r["namespace"], r["pod"]) == (ns, name)]
            times += [t for a in self.allocs.values() if (a["namespace"], a["pod"]) == (ns, name) for t in (a["started_at"], a["ended_at"]) if t]
            if times:
                return max(times), "the pod's latest event"
        times = [r["occurred_at"] for r in (*self.release_rows, *self.wl_rows, *self.alert_rows.values())]
        times += [t for a in self.allocs.values() for t in (a["started_at"], a["ended_at"]) if t]
        return (max(times), "the chain's latest event") if times else (None, "nothing")

    def _nodes(self) -> list[str]:
        return sorted({n for p in self.pods.values() for n in p["nodes"]} | {a["node"] for a in self.allocs.values()}
                      | {r["node"] for r in self.alert_rows.values() if r.get("node")})

    def read_window(self) -> None:
        """Other alerts and other workloads' scheduler events on the chain's nodes in the
        window, and who else held the chain's GPUs then."""
        self.anchor_s, self.anchor_what = self._anchor()
        nodes = self._nodes()
        if not (self.anchor_s and nodes) or not self.window:
            return  # (--window 0: the chain alone — a window from the anchor to itself still found its neighbours)
        anchor = datetime.fromisoformat(self.anchor_s.replace("Z", "+00:00"))
        wparams = {"from": ch_time(time_before(anchor, self.window)), "to": ch_time(anchor), "nodes": nodes}
        in_window = "occurred_at >= {from:DateTime64(3, 'UTC')} AND occurred_at <= {to:DateTime64(3, 'UTC')}"
        self.others_alerts = [r for r in self.store.latest("enriched_alerts", ALERT_COLS, in_window, wparams, after="node IN {nodes:Array(String)}",
                                                           after_columns=("node",), order="occurred_at, correlation_id")
                              if r["correlation_id"] not in self.alert_rows]
        others = [w for w in self.store.candidates("workload_timeline", "workload_id", f"{in_window} AND node IN {{nodes:Array(String)}}", wparams)
                  if w not in self.workload_ids]
        self.neighbours = self.store.latest(
            "workload_timeline", WORKLOAD_COLS, f"workload_id IN {{ws:Array(String)}} AND {in_window}",
            {**wparams, "ws": others}, after="node IN {nodes:Array(String)}", after_columns=("node",),
            order=WORKLOAD_ORDER) if others else []
        self.other_allocs = self._other_holders(wparams)

    def _other_holders(self, wparams: dict) -> list[dict]:
        gpus = sorted({(a["node"], a["gpu_id"]) for a in self.allocs.values()})
        if not gpus:
            return []
        return [a for a in self.store.latest(
            "gpu_allocations", ALLOC_COLS,
            "node IN {gpu_nodes:Array(String)} AND concat(node, '/', gpu_id) IN {gpus:Array(String)} "
            "AND started_at <= {to:DateTime64(3, 'UTC')}",
            {**wparams, "gpu_nodes": sorted({n for n, _ in gpus}), "gpus": [f"{n}/{g}" for n, g in gpus]},
            after="ended_at IS NULL OR ended_at >= {from:DateTime64(3, 'UTC')}", after_columns=("ended_at",),
            order="started_at, allocation_id") if a["allocation_id"] not in self.allocs]

    def _preemptor_names(self) -> dict[str, str]:
        """uid → Kind/namespace/name of preemptors the chain's rows name by uid only, from
        other scheduler rows that named the same uid with its name (another victim's row,
        written when the collector knew the Workload), within a day of the preemptions."""
        unresolved = sorted({r["preemptor_uid"] for r in self.wl_rows if r.get("preemptor_uid") and not r.get("preemptor_name")})
        if not unresolved:
            return {}
        times = [datetime.fromisoformat(r["occurred_at"].replace("Z", "+00:00")) for r in self.wl_rows if r.get("preemptor_uid") in unresolved]
        params = {"uids": unresolved, "from": ch_time(min(times) - timedelta(days=1)), "to": ch_time(max(times) + timedelta(days=1))}
        rows = self.store.latest("workload_timeline", ("workload_id", "occurred_at", "correlation_id", "version", "preemptor_kind",
                                                       "preemptor_namespace", "preemptor_name", "preemptor_uid"),
                                 "occurred_at >= {from:DateTime64(3, 'UTC')} AND occurred_at <= {to:DateTime64(3, 'UTC')}", params,
                                 after="preemptor_uid IN {uids:Array(String)} AND preemptor_name != ''",
                                 after_columns=("preemptor_uid", "preemptor_name"), order="occurred_at, correlation_id")
        return {r["preemptor_uid"]: _ref_text(r.get("preemptor_kind"), r.get("preemptor_namespace"), r["preemptor_name"]) for r in rows}

    # --- the result ------------------------------------------------------------------------------

    def _pod_sections(self) -> list[dict]:
        out = []
        for key in sorted(self.pods):
            p = self.pods[key]
            p["nodes"] = sorted(p["nodes"])
            p["allocations"] = [_brief_alloc(a, self.at_s) for a in _sorted_allocs(self.allocs.values()) if (a["namespace"], a["pod"]) == key]
            if not p["allocations"]:
                self.gaps.append(f"pod {key[0]}/{key[1]}: no GPU allocation seen")
            out.append(p)
        return out

    def _gpu_sections(self) -> list[dict]:
        by_gpu: dict[tuple[str, str], dict] = {}
        for a in _sorted_allocs(self.allocs.values()):
            g = by_gpu.setdefault((a["node"], a["gpu_id"]), {"node": a["node"], "gpu_id": a["gpu_id"], "allocations": [], "others_in_window": []})
            g["allocations"].append(_brief_alloc(a, self.at_s))
        for a in self.other_allocs:
            by_gpu[(a["node"], a["gpu_id"])]["others_in_window"].append(_brief_alloc(a, self.at_s))
        return [by_gpu[k] for k in sorted(by_gpu)]

    def _scheduler_events(self) -> list[dict]:
        events = {r["correlation_id"]: {**_brief_scheduler(r), "in_chain": True} for r in self.wl_rows if r["event_type"] in SCHEDULER_INCIDENT_TYPES}
        for r in self.neighbours:
            events.setdefault(r["correlation_id"], {**_brief_scheduler(r), "in_chain": False})
        return sorted(events.values(), key=lambda e: (e["occurred_at"], e["correlation_id"]))

    def _alerts(self) -> list[dict]:
        for r in sorted(self.alert_rows.values(), key=lambda r: (r["occurred_at"], r["correlation_id"])):
            if r.get("attribution", "").endswith("_fallback"):
                rule = {"model_version_fallback": "model+version", "image_digest_fallback": "image digest"}.get(r["attribution"], r["attribution"])
                self.gaps.append(f"alert {r['alert_fingerprint']}: attributed to {r['release_id']} by its {rule} (rule "
                                 f"{r['attribution']}): the release id its labels name matches no release event (control 3)")
        outside = {r["correlation_id"]: r for r in [*self.earlier_episodes, *self.others_alerts]}
        alerts = [_brief_alert(r, True) for r in self.alert_rows.values()] + [_brief_alert(r, False) for r in outside.values()]
        return sorted(alerts, key=lambda a: (a["occurred_at"], a["correlation_id"]))

    def result(self) -> dict:
        if self.release_id and not self.workload_ids:
            self.gaps.append(f"release {self.release_id}: no workload attributed to it" + (" as of --at" if self.at else ""))
        names = self._preemptor_names()
        workloads = [_workload_section(wid, [r for r in self.wl_rows if r["workload_id"] == wid], list(self.pods.values()), self.gaps, names)
                     for wid in sorted(self.workload_ids)]
        start = norm_time(time_before(datetime.fromisoformat(self.anchor_s.replace("Z", "+00:00")), self.window)) if self.anchor_s else None
        return {"release": self.release, "workloads": workloads, "pods": self._pod_sections(), "gpus": self._gpu_sections(),
                "scheduler_events": self._scheduler_events(), "alerts": self._alerts(), "violations": self.violations, "gaps": self.gaps,
                "window": {"from": start, "to": self.anchor_s, "length": format_window(self.window), "anchor": self.anchor_what}}


def _expand(store: Store, root: tuple[str, str] | None, at: datetime | None, window: timedelta, focal_alerts: list[dict],
            entry: tuple[str, str] | None = None) -> dict:
    """The chain of ``root`` (module docstring), in the steps of ``_Chain``; the window is
    anchored on ``entry``'s own time (``_Chain._anchor``)."""
    if root is None:
        return {"release": None, "workloads": [], "pods": [], "gpus": [], "scheduler_events": [], "alerts": [], "violations": [],
                "gaps": ["the entry point matches nothing in the store" + (" as of --at" if at else "")]}
    chain = _Chain(store, root, at, window)
    chain.entry = entry or root
    chain.read_release()
    chain.read_workloads()
    chain.read_allocations()
    chain.read_alerts(focal_alerts)
    chain.read_window()
    chain.read_violations()
    return chain.result()


def trace(reader, database: str, kind: str, value: str, at: datetime | None = None, window: timedelta | None = None,
          cluster: str | None = None, mode: str = "final") -> dict[str, Any]:
    """The chain for one entry point (see module docstring)."""
    if kind not in ENTRY_KINDS:
        raise TraceError(f"unknown entry point {kind!r}; use one of {', '.join(ENTRY_KINDS)}")
    if not value:
        raise TraceError(f"--{kind}: empty value")
    value = nfc(value)  # (identifiers are stored in NFC: 'cafe' + U+0301 is the release 'café')
    window = DEFAULT_WINDOW if window is None else window  # (0 is a window: the chain alone, no neighbours)
    store = Store(reader, database, cluster, mode)
    resolver = _Resolver(store, at)
    focal: list[dict] = []
    alternatives: list[str] = []
    entry_point = (kind, value)  # what the window is anchored on (``_Chain._anchor``)
    if kind == "alert":
        root, focal = resolver.alert(value)
    elif kind == "release":
        root = ("release", value)
    elif kind == "workload":
        root = resolver.workload(value)
        if root is None:  # (``ns/name`` for ``ns/Job/name``: the one workload of that name, else the form an id has)
            root, picked = resolver.workload_named(value)
            entry_point = ("workload", picked) if picked else entry_point
    elif kind == "pod":
        root = resolver.pod(*_split_pair(value, "pod", ENTRY_FORMS["pod"]))
    elif kind == "gpu":
        root = resolver.gpu(*_split_pair(value, "gpu", ENTRY_FORMS["gpu"]), entry=True)
        if root is not None and root[0] == "alert":  # a GPU no allocation held, answered by its latest alert
            _same, focal = resolver.alert(root[1])
    else:
        name, _, version = value.partition(":")
        root, alternatives = resolver.model(name, version or None)
    chain = _expand(store, root, at, window, focal, entry_point)
    if kind == "release" and not ((chain["release"] or {}).get("lifecycle") or chain["workloads"] or chain["pods"] or chain["alerts"]):
        # A release id is taken as the root as given: one nothing in the store names (a typo, or
        # not yet told) matches nothing — a tree of gaps and exit 0 read as "found, all missing".
        root = None
        chain = _expand(store, root, at, window, focal, (kind, value))
    if kind == "alert" and not focal:
        chain["gaps"].insert(0, f"no alert with fingerprint {value} in the store" + (" as of --at" if at else ""))
    chain["gaps"][:0] = resolver.notes
    chain["warnings"] = []
    if (replay := replayed(reader, database)):
        chain["gaps"].insert(0, replay_note(replay))
        # (said first, above the chain — at the bottom among the gaps, a sandbox's "firing, promoted"
        # as of a time after its end read as the answer at 3 a.m.)
        chain["warnings"] = [said] if (said := after_end(replay, at, "--at")) else []
        _mark_deletion_ends(chain, resolver.holders, ended_by_deletion(replay))
    chain["gaps"].extend(f"{t}: more than {ROW_LIMIT} rows matched; the chain shows the first {ROW_LIMIT} (narrow it with --at)"
                         for t in sorted(store.truncated))
    entry = {"kind": kind, "value": value, "at": norm_time(at) if at else None, "window": format_window(window),
             "root": {"kind": root[0], "id": root[1]} if root else None, "queries": store.queries}
    if entry_point[1] != value:  # (--workload NS/NAME: the one workload of that name)
        entry["workload_id"] = entry_point[1]
    if alternatives:
        entry["other_releases"] = alternatives
    if resolver.holders:
        entry["gpu_holders"] = resolver.holders
    return {"entry": entry, **chain}


def _mark_deletion_ends(chain: dict, holders: list[dict], note: str | None) -> None:
    """In a range replay, each GPU interval its pod's deletion ended gets ``end_note`` (``note``): the
    GPU's release may be after the replay's end — the live store ends it there, held as of ``--to``."""
    if note is None:
        return
    intervals = [*holders, *(a for p in chain["pods"] for a in p.get("allocations", [])),
                 *(a for g in chain["gpus"] for a in (*g.get("allocations", []), *g.get("others_in_window", [])))]
    for a in intervals:
        if a.get("ended_at") and a.get("end_reason") == "pod_deleted":
            a["end_note"] = note


def chain_of(result: dict) -> dict:
    """The entry-independent part of a trace (what every entry point must agree on)."""
    return {k: v for k, v in result.items() if k != "entry"}


def found(result: dict) -> bool:
    return result["entry"]["root"] is not None


# The skeleton's entry points, kept for callers that know only these two.
def trace_alert(reader, database: str, fingerprint: str, **kwargs) -> dict[str, Any]:
    return trace(reader, database, "alert", fingerprint, **kwargs)


def trace_release(reader, database: str, release_id: str, **kwargs) -> dict[str, Any]:
    return trace(reader, database, "release", release_id, **kwargs)
