"""The correlated family: correlated events and the tables derived from them.

Input: batches of ``CorrelatedEvent`` (the correlated topic) and ``DeadLetter``.
Output: one columnar insert per table per batch into ``correlated_events`` (every
row: the source of truth) and, by event family, ``release_history`` (release.*),
``workload_timeline`` (scheduler.* rows whose workload is known) and
``enriched_alerts`` (alert.*), with the payload's fields as typed columns.
The rows are inserted by ``sinks/writer.py`` (``TableWriter``: held while the store is
unavailable, rejected rows split off and dead-lettered), driven by ``sinks/agents.py``.
Guarantees: rows are pure functions of their event, so a re-delivered event yields the
same rows, which the ReplacingMergeTree keys collapse.
Limits: a payload that is not the JSON its family expects still yields its rows, with
the typed columns empty (counted as ``payload_unparsed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import orjson

from gpuledger.telemetry import ComponentCounters
from schemas.outputs import CorrelatedEvent, DeadLetter

IDENTITY_FIELDS = (
    "release_id", "model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
    "environment", "workload_id", "pod_uid", "namespace", "pod", "node", "gpu_id", "owner", "data_class", "alert_fingerprint",
)
SOURCE_FIELDS = ("source_topic", "source_partition", "source_offset")
CORRELATED_COLUMNS = (
    "correlation_id", "version", "event_type", "occurred_at", "attribution", *IDENTITY_FIELDS,
    "release_state", "summary", *SOURCE_FIELDS, "payload_json",
)
DEAD_LETTER_COLUMNS = ("reason", "error", "stage", "source_topic", "source_partition", "source_offset", "key", "value", "failed_at")

MANIFEST_FIELDS = ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
                   "environment", "owner", "data_class")
RELEASE_HISTORY_COLUMNS = (
    "release_id", "occurred_at", "correlation_id", "version", "event_type", *MANIFEST_FIELDS,
    "actor", "approval_id", "reason", "to_environment", "superseded_release_id", "reservation_id", "reservation_gpus",
    "reservation_pool", "reservation_window_start", "reservation_window_end", "target", "expires_at", "tags",
    "release_state", "summary", *SOURCE_FIELDS, "payload_json",
)
WORKLOAD_IDENTITY = tuple(f for f in IDENTITY_FIELDS if f != "workload_id")
WORKLOAD_TIMELINE_COLUMNS = (
    "workload_id", "occurred_at", "correlation_id", "version", "event_type", "attribution", *WORKLOAD_IDENTITY,
    "release_state", "object_kind", "queue", "cluster_queue", "priority_class", "priority", "reason", "message", "phase",
    "gpus_requested", "image_digests", "preemptor_kind", "preemptor_namespace", "preemptor_name", "preemptor_uid",
    "victim_kind", "victim_namespace", "victim_name", "labels", "flavors", "summary", *SOURCE_FIELDS, "payload_json",
)
ALERT_IDENTITY = tuple(f for f in IDENTITY_FIELDS if f != "alert_fingerprint")
ENRICHED_ALERT_COLUMNS = (
    "alert_fingerprint", "occurred_at", "correlation_id", "version", "event_type", "attribution", *ALERT_IDENTITY,
    "release_state", "alertname", "severity", "starts_at", "ends_at", "labels", "annotations", "generator_url", "receiver",
    "group_key", "summary", *SOURCE_FIELDS,
)


def _s(value) -> str:
    """A string column's value: '' for missing, str() for anything else."""
    return "" if value is None else str(value)


def _str_map(value) -> dict[str, str]:
    return {str(k): _s(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _int_or_none(value) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def _time_or_none(value) -> datetime | None:
    """An RFC 3339 time from a payload; None when absent or unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed.astimezone(timezone.utc) if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def identity_values(ident, fields: tuple[str, ...]) -> list[str]:
    """``ident``'s ``fields`` as string column values ('' for missing), read from its ``__dict__``
    (a pydantic model's fields are there, and a sink ``Loose`` row's): the worker writes only the
    identity fields that are set, and a ``getattr`` of each missing one went through
    ``Loose.__getattr__``, a Python call per field per row (about a fifth of building the rows)."""
    get = vars(ident).get
    return [get(f) or "" for f in fields]


def _source(ev: CorrelatedEvent) -> list:
    return [ev.source_topic, ev.source_partition, ev.source_offset]


def correlated_rows(batch: Sequence[CorrelatedEvent]) -> list[list]:
    rows = []
    for ev in batch:
        ident = ev.identity
        rows.append([
            ev.correlation_id, ev.version, ev.event_type, ev.occurred_at, ev.attribution,
            *identity_values(ident, IDENTITY_FIELDS),
            ev.release_state or "", ev.summary, *_source(ev), ev.payload_json,
        ])
    return rows


def dead_letter_rows(batch: Sequence[DeadLetter]) -> list[list]:
    return [[d.reason, d.error, d.stage, d.source_topic or "", -1 if d.source_partition is None else d.source_partition,
             -1 if d.source_offset is None else d.source_offset, d.key or "", d.value, d.failed_at] for d in batch]


def _payload(ev: CorrelatedEvent, counters: ComponentCounters | None) -> dict:
    try:
        value = orjson.loads(ev.payload_json)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        if counters is not None:  # the row is kept; only its typed columns stay empty
            counters.totals["payload_unparsed"] = counters.totals.get("payload_unparsed", 0) + 1
        return {}
    return value


def release_history_row(ev: CorrelatedEvent, counters: ComponentCounters | None = None) -> list:
    p = _payload(ev, counters)
    ident = ev.identity
    res = p.get("reservation") if isinstance(p.get("reservation"), dict) else {}
    return [
        ident.release_id or "", ev.occurred_at, ev.correlation_id, ev.version, ev.event_type,
        *identity_values(ident, MANIFEST_FIELDS),
        _s(p.get("actor")), _s(p.get("approval_id")), _s(p.get("reason")), _s(p.get("to_environment")),
        _s(p.get("superseded_release_id")), _s(res.get("reservation_id")), _int_or_none(res.get("gpus")), _s(res.get("pool")),
        _time_or_none(res.get("window_start")), _time_or_none(res.get("window_end")), _s(p.get("target")),
        _time_or_none(p.get("expires_at")), _str_map(p.get("tags")),
        ev.release_state or "", ev.summary, *_source(ev), ev.payload_json,
    ]


def workload_timeline_row(ev: CorrelatedEvent, counters: ComponentCounters | None = None) -> list:
    p = _payload(ev, counters)
    ident = ev.identity
    pre = p.get("preemptor") if isinstance(p.get("preemptor"), dict) else {}
    vic = p.get("victim") if isinstance(p.get("victim"), dict) else {}
    digests = p.get("image_digests") if isinstance(p.get("image_digests"), list) else []
    return [
        ident.workload_id or "", ev.occurred_at, ev.correlation_id, ev.version, ev.event_type, ev.attribution,
        *identity_values(ident, WORKLOAD_IDENTITY),
        ev.release_state or "", _s(p.get("object_kind")), _s(p.get("queue")), _s(p.get("cluster_queue")), _s(p.get("priority_class")),
        _int_or_none(p.get("priority")), _s(p.get("reason") or (f"{p.get('decision')}:{p.get('rule')}" if ev.event_type == "admission.decided" else None)),
        _s(p.get("message")), _s(p.get("phase")),
        _int_or_none(p.get("gpus_requested")), [_s(d) for d in digests],
        _s(pre.get("kind")), _s(pre.get("namespace")), _s(pre.get("name")), _s(pre.get("uid")),
        _s(vic.get("kind")), _s(vic.get("namespace")), _s(vic.get("name")),
        _str_map(p.get("labels")), _str_map(p.get("flavors")), ev.summary, *_source(ev), ev.payload_json,
    ]


def enriched_alert_row(ev: CorrelatedEvent, counters: ComponentCounters | None = None) -> list:
    p = _payload(ev, counters)
    ident = ev.identity
    return [
        ident.alert_fingerprint or "", ev.occurred_at, ev.correlation_id, ev.version, ev.event_type, ev.attribution,
        *identity_values(ident, ALERT_IDENTITY),
        ev.release_state or "", _s(p.get("alertname")), _s(p.get("severity")), _time_or_none(p.get("starts_at")) or ev.occurred_at,
        _time_or_none(p.get("ends_at")), _str_map(p.get("labels")), _str_map(p.get("annotations")), _s(p.get("generator_url")),
        _s(p.get("receiver")), _s(p.get("group_key")), ev.summary, *_source(ev),
    ]


def derived_rows(batch: Sequence[CorrelatedEvent],
                 counters: ComponentCounters | None = None) -> dict[str, tuple[list[list], list[int]]]:
    """Split a correlated batch into the rows of the tables derived from it (``correlated_events``
    takes every event as it is: ``correlated_rows``): per table, the rows and, for each row, the
    index of its event in ``batch`` (so the writer can name the record a rejected row came from).

    Scheduler rows go to ``workload_timeline`` only once their workload is known: the
    table is keyed by workload_id, and a row that later gains one would otherwise stay
    behind under the empty key (see sinks/migrations.py).
    """
    out: dict[str, tuple[list[list], list[int]]] = {"release_history": ([], []), "workload_timeline": ([], []), "enriched_alerts": ([], [])}

    def add(table: str, row: list, index: int) -> None:
        out[table][0].append(row)
        out[table][1].append(index)

    for i, ev in enumerate(batch):
        family = ev.event_type.split(".", 1)[0]
        if family == "release" and ev.identity.release_id:
            add("release_history", release_history_row(ev, counters), i)
        elif family in ("scheduler", "admission") and ev.identity.workload_id:  # a decision is part of the workload's history
            add("workload_timeline", workload_timeline_row(ev, counters), i)
        elif family == "alert" and ev.identity.alert_fingerprint:
            add("enriched_alerts", enriched_alert_row(ev, counters), i)
    return out
