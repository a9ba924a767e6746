"""The correlated family: correlated events and the tables derived from them.

Input: ``CorrelatedEvent`` records (the correlated topic) and ``DeadLetter``.
Output: the columns of ``correlated_events`` (every row: the source of truth) and, by event
family, ``release_history`` (release.*), ``workload_timeline`` (scheduler.* and admission.*
rows whose workload is known) and ``enriched_alerts`` (alert.*), with the payload's fields
as typed columns. The store builds those rows itself: the sink inserts the records as they
are into ``correlated_intake``, whose materialized views write the four tables
(``sinks/migrations.py``, migrations 4, 6 and 7; ``sinks/agents.py``). The column lists here name them
for the readers, the checksums and the docs, and must match the views (tests/sinks/test_migrations.py).
Dead letters are rows built here (``dead_letter_rows``).
Guarantees: rows are pure functions of their record, so a re-delivered record yields the
same rows, which the ReplacingMergeTree keys collapse.
Limits: a payload that is not the JSON its family expects still yields its rows, with the
typed columns empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from schemas.outputs import DeadLetter

IDENTITY_FIELDS = (
    "release_id", "model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
    "environment", "workload_id", "pod_uid", "namespace", "pod", "node", "gpu_id", "owner", "data_class", "alert_fingerprint",
)
SOURCE_FIELDS = ("source_topic", "source_partition", "source_offset")
#: ``named_release_id`` and ``environment_labelled`` since migration 7 ('' and NULL in rows stored before).
CORRELATED_COLUMNS = (
    "correlation_id", "version", "event_type", "occurred_at", "attribution", *IDENTITY_FIELDS,
    "release_state", "summary", *SOURCE_FIELDS, "payload_json", "named_release_id", "environment_labelled",
)
DEAD_LETTER_COLUMNS = ("reason", "error", "stage", "source_topic", "source_partition", "source_offset", "key", "value", "failed_at",
                       "letter_id")

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


def identity_values(ident, fields: tuple[str, ...]) -> list[str]:
    """``ident``'s ``fields`` as string column values ('' for missing), read from its ``__dict__``
    (a pydantic model's fields are there, and a sink ``Loose`` row's): the worker writes only the
    identity fields that are set, and a ``getattr`` of each missing one went through
    ``Loose.__getattr__``, a Python call per field per row (about a fifth of building the rows)."""
    get = vars(ident).get
    return [get(f) or "" for f in fields]


def letter_id(letter: DeadLetter) -> str:
    """What tells apart, in ``dead_letters``, the letters that share a source offset and stage: nothing
    for one that names its source offset (a record processed again and dead-lettered again is one
    row), else a digest of its reason, key and value — letters without a source offset (the edge's:
    a collector's event too large to travel, a receiver's event from a newer schema; an output
    refused that names no input; admit's) all had the key (topic, -1, -1, stage), and N of them were
    one row (migration 5)."""
    if letter.source_partition is not None and letter.source_offset is not None:
        return ""
    material = "\x1f".join((letter.reason, letter.key or "", letter.value))
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def dead_letter_rows(batch: Sequence[DeadLetter]) -> list[list]:
    return [[d.reason, d.error, d.stage, d.source_topic or "", -1 if d.source_partition is None else d.source_partition,
             -1 if d.source_offset is None else d.source_offset, d.key or "", d.value, d.failed_at, letter_id(d)] for d in batch]
