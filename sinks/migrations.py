"""Versioned, idempotent migrations of gpuledger's ClickHouse schema.

Input: a client and a database name (and, for a ClickHouse cluster, its name).
Output: the correlation tables, recorded in ``{db}.schema_migrations``.
Guarantees: every statement is idempotent (``IF NOT EXISTS``; a view's ``MODIFY QUERY``
sets its query again), so re-running — or running against another shard whose
``schema_migrations`` has not seen a migration — is harmless; applied migrations are never
edited, new ones are appended. Limit: migrations run in order, so re-running them on a
cluster sets the intake's query of migration 6 (ON CLUSTER) moments before migration 7's
again: records stored meanwhile lack migration 7's two columns ('' and NULL).

One definition, two renderings. Statements are templated with ``{db}``,
``{on_cluster}`` and ``{engine_*}``: on one node they become plain
ReplacingMergeTree tables; with ``--cluster NAME`` they become ``ON CLUSTER`` DDL over
Replicated* engines, plus a ``<table>_dist`` Distributed table per table (statements
marked ``{cluster_only}``), sharded by a function of the table's row identity so that
every version of a row lands on the same shard (FINAL is per shard). On a cluster,
writers and readers use the ``_dist`` tables (``table_name``).

Table design (docs/store.md has the why): a ReplacingMergeTree only collapses rows
with the same ORDER BY key, so every table's key is a function of what never changes
between versions of a row — correlation_id, event_id, allocation_id, violation_id, or
a lookup column the row's own input fixes (a release event's release_id, an alert's
fingerprint, an allocation's node and device). ``workload_timeline`` is the one keyed
by an attributed column (workload_id): rows enter it only once their workload is
known, and readers drop a row whose correlation_id has a newer version elsewhere
(``sinks/read/trace.py``).

TTL (``GPULEDGER_CLICKHOUSE_TTL_DAYS``) is configuration, not a migration: ``apply_ttl``
sets or removes it on the event tables when it differs from what the table has.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


IDENTITY_COLUMNS = """
    release_id String,
    model_name String,
    model_version String,
    artifact_digest String,
    image_digest String,
    config_digest String,
    dataset_ref String,
    environment LowCardinality(String),
    workload_id String,
    pod_uid String,
    namespace LowCardinality(String),
    pod String,
    node LowCardinality(String),
    gpu_id String,
    owner LowCardinality(String),
    data_class LowCardinality(String),
    alert_fingerprint String"""

# The identity block minus what a table carries as its own columns (allocations).
ALLOCATION_IDENTITY_COLUMNS = ",".join(
    column for column in IDENTITY_COLUMNS.split(",")
    if column.split()[0] not in ("namespace", "pod", "node", "gpu_id", "alert_fingerprint"))

SOURCE_COLUMNS = """
    source_topic LowCardinality(String),
    source_partition UInt32,
    source_offset UInt64"""

#: Distributed sharding expression per table: a function of the row identity (the
#: ReplacingMergeTree key's invariant part), so all versions of a row share a shard.
SHARD_KEYS: dict[str, str] = {
    "correlated_events": "cityHash64(correlation_id)",
    "dead_letters": "cityHash64(source_topic, source_partition, source_offset)",
    "raw_events": "cityHash64(event_id)",
    "gpu_allocations": "cityHash64(node, gpu_id)",
    "release_history": "cityHash64(release_id)",
    "workload_timeline": "cityHash64(workload_id)",
    "enriched_alerts": "cityHash64(alert_fingerprint)",
    "violations": "cityHash64(violation_id)",
}

#: Tables the configurable TTL applies to, and the (version-invariant) time column it
#: counts from. Not here on purpose: release_history (a release in prod for years must
#: keep its approvals), gpu_allocations (an open interval must not expire while held)
#: and violations (audit evidence has its own retention).
TTL_COLUMNS: dict[str, str] = {
    "raw_events": "occurred_at",
    "correlated_events": "occurred_at",
    "workload_timeline": "occurred_at",
    "enriched_alerts": "occurred_at",
    "dead_letters": "failed_at",
}


def _distributed(table: str) -> str:
    return ("{cluster_only}CREATE TABLE IF NOT EXISTS {db}.%s_dist {on_cluster} AS {db}.%s "
            "ENGINE = Distributed({cluster_name}, {db_name}, '%s', %s)") % (table, table, table, SHARD_KEYS[table])


#: The identity block's fields (``schemas.Identity``), as the intake of migration 4 reads them.
#: A copy, not an import: an applied migration's text must not change when the schema does.
_INTAKE_FIELDS = ("release_id", "model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
                  "environment", "workload_id", "pod_uid", "namespace", "pod", "node", "gpu_id", "owner", "data_class",
                  "alert_fingerprint")
_INTAKE_IDENTITY = ", ".join(f"{f} String" for f in _INTAKE_FIELDS)
#: A correlated record as the intake's view reads it, in one parse (``JSONExtract``).
_RECORD_TUPLE = ("Tuple(correlation_id Nullable(String), version Nullable(UInt64), event_type Nullable(String), "
                 "occurred_at Nullable(String), attribution Nullable(String), identity Tuple(" + _INTAKE_IDENTITY + "), "
                 "release_state Nullable(String), summary Nullable(String), source_topic Nullable(String), "
                 "source_partition Nullable(UInt32), source_offset Nullable(UInt64), payload_json Nullable(String))")
_MANIFEST_FIELDS = ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
                    "environment", "owner", "data_class")


def _identity_select(fields: tuple[str, ...]) -> str:
    # tupleElement, not ``identity.name``: the view's query is analysed at every insert, and a
    # compound name costs the analyser several times more to resolve (benchmarks: the views'
    # fixed cost per insert about halved).
    return ", ".join(f"tupleElement(identity, '{f}') AS {f}" for f in fields)


def _uint32(value: str, column: str) -> str:
    """``value`` (a Nullable(Float64): counts are extracted as floats, so that one past Int64 is a
    number too, not NULL) as ``column``, a Nullable(UInt32): out of its range, the record is
    refused with an error naming the column (ClickHouse's own cast would wrap around, and
    ``accurateCast``'s message names neither column nor value). The ``throwIf`` is the
    condition, so it holds whether or not the server evaluates ``if`` lazily."""
    return (f"if(throwIf(isNotNull({value}) AND NOT ({value} >= 0 AND {value} <= 4294967295), "
            f"'{column}: out of the range of UInt32') = 0, CAST({value}, 'Nullable(UInt32)'), NULL) AS {column}")


def _view(table: str, select: str, where: str, payload: str | None = None) -> str:
    """The materialized view that fills ``table`` from ``correlated_fields`` (migration 4):
    ``select`` over the record's fields and, with ``payload`` (a named Tuple type), ``p``: the
    record's payload parsed once into it."""
    return (f"CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{table}_mv {{on_cluster}} TO {{db}}.{table}{{dist}} AS\n"
            + _view_query(select, where, payload and f"JSONExtract(payload_json, '{payload}')"))


def _view_query(select: str, where: str, payload: str | None = None) -> str:
    """A family view's query: ``select`` over the rows of ``correlated_fields`` that match ``where``
    and, with ``payload`` (an expression), ``p``: the row's payload as that expression reads it."""
    source = "{db}.correlated_fields"
    if payload:
        source = f"(SELECT *, {payload} AS p FROM {{db}}.correlated_fields WHERE {where})"
        where = "1"
    return f"SELECT {select}\nFROM {source}" + ("" if where == "1" else f"\nWHERE {where}")


def _intake_query(record: str, more: str = "") -> str:
    """The query of ``correlated_fields_mv`` (migration 4): a correlated record's fields, ``record``
    (a named Tuple type) the record as it is parsed, in one ``JSONExtract``; then ``more`` (the
    columns later migrations added)."""
    return """SELECT ifNull(tupleElement(r, 'correlation_id'), '') AS correlation_id, tupleElement(r, 'version') AS version,
    ifNull(tupleElement(r, 'event_type'), '') AS event_type,
    parseDateTime64BestEffortOrNull(tupleElement(r, 'occurred_at'), 3, 'UTC') AS occurred_at,
    ifNull(tupleElement(r, 'attribution'), '') AS attribution, tupleElement(r, 'identity') AS identity,
    ifNull(tupleElement(r, 'release_state'), '') AS release_state, ifNull(tupleElement(r, 'summary'), '') AS summary,
    ifNull(tupleElement(r, 'source_topic'), '') AS source_topic, tupleElement(r, 'source_partition') AS source_partition,
    tupleElement(r, 'source_offset') AS source_offset, ifNull(tupleElement(r, 'payload_json'), '{}') AS payload_json,
    JSONType(record) = 'Object' AS record_is_object""" + (",\n    " + more if more else "") + """
FROM (SELECT record, JSONExtract(record, '""" + record + """') AS r FROM {db}.correlated_intake)"""


#: correlated_events' columns from a row of ``correlated_fields`` (migration 4).
_CORRELATED_EVENTS_SELECT = """correlation_id, assumeNotNull(version) AS version, event_type, assumeNotNull(occurred_at) AS occurred_at,
    attribution, """ + _identity_select(_INTAKE_FIELDS) + """, release_state, summary,
    source_topic, assumeNotNull(source_partition) AS source_partition, assumeNotNull(source_offset) AS source_offset, payload_json"""
#: The rows of release_history (of the correlated family), and the named Tuple their payload is read into.
_RELEASE_ROWS = "splitByChar('.', event_type)[1] = 'release' AND tupleElement(identity, 'release_id') != ''"
_RELEASE_PAYLOAD = ("Tuple(actor String, approval_id String, reason String, to_environment String, superseded_release_id String, "
                    "reservation Tuple(reservation_id String, gpus Nullable(Float64), pool String, window_start String, window_end String), "
                    "target String, expires_at String, tags Map(String, String))")
#: The rows of workload_timeline, and the named Tuple their payload is read into.
_WORKLOAD_ROWS = "splitByChar('.', event_type)[1] IN ('scheduler', 'admission') AND tupleElement(identity, 'workload_id') != ''"
_WORKLOAD_PAYLOAD = ("Tuple(object_kind String, queue String, cluster_queue String, priority_class String, priority Nullable(Int64), "
                     "reason String, decision String, rule String, message String, phase String, gpus_requested Nullable(Float64), "
                     "image_digests Array(String), preemptor Tuple(kind String, namespace String, name String, uid String), "
                     "victim Tuple(kind String, namespace String, name String), labels Map(String, String), flavors Map(String, String))")
#: The counts of those payloads (``p``), each a column of UInt32 range.
_RESERVATION_GPUS = "tupleElement(tupleElement(p, 'reservation'), 'gpus')"
_GPUS_REQUESTED = "tupleElement(p, 'gpus_requested')"
#: What migration 6 adds to a record's fields in the intake: the payload of a row of release_history
#: or workload_timeline parsed (once: the views read it from here), and its count range-checked —
#: a record with one out of range is refused before any view of the family sees it. Other rows'
#: payloads are not parsed (``'{}'`` is). The same Tuple types as migration 4's views, so a payload
#: reads as it did: a field of another type leaves the whole Tuple empty, count included.
_CHECKED_PAYLOADS = (f"JSONExtract(if({_RELEASE_ROWS}, payload_json, '{{}}'), '{_RELEASE_PAYLOAD}') AS release_payload,\n    "
                     f"JSONExtract(if({_WORKLOAD_ROWS}, payload_json, '{{}}'), '{_WORKLOAD_PAYLOAD}') AS workload_payload,\n    "
                     + _uint32(_RESERVATION_GPUS.replace("(p,", "(release_payload,"), "reservation_gpus") + ",\n    "
                     + _uint32(_GPUS_REQUESTED.replace("(p,", "(workload_payload,"), "gpus_requested"))
#: A correlated record as migration 7's intake reads it: with what the controls judge by that the
#: row's other fields do not say (``CorrelatedEvent.named_release_id``, ``.environment_labelled``).
_RECORD_TUPLE_7 = _RECORD_TUPLE[:-1] + ", named_release_id Nullable(String), environment_labelled Nullable(Bool))"
#: Those two fields as columns: '' for a record without a named release; NULL for a record that
#: does not say whose its environment is (a worker's before it did).
_JUDGED_FIELDS = ("ifNull(tupleElement(r, 'named_release_id'), '') AS named_release_id, "
                  "tupleElement(r, 'environment_labelled') AS environment_labelled")
#: The columns whose range the intake checks (``_CHECKED_PAYLOADS``), and the table each is a column of:
#: a record refused for one is the dead letter of that table (``sinks.agents``, its stage).
RANGE_CHECKED_COLUMNS = {"reservation_gpus": "release_history", "gpus_requested": "workload_timeline"}


def _release_history_select(reservation_gpus: str) -> str:
    """release_history's columns from a row of ``correlated_fields`` and its payload ``p``;
    ``reservation_gpus`` the expression of that column."""
    return """tupleElement(identity, 'release_id') AS release_id, assumeNotNull(occurred_at) AS occurred_at, correlation_id,
    assumeNotNull(version) AS version, event_type, """ + _identity_select(_MANIFEST_FIELDS) + """,
    tupleElement(p, 'actor') AS actor, tupleElement(p, 'approval_id') AS approval_id, tupleElement(p, 'reason') AS reason, tupleElement(p, 'to_environment') AS to_environment,
    tupleElement(p, 'superseded_release_id') AS superseded_release_id, tupleElement(tupleElement(p, 'reservation'), 'reservation_id') AS reservation_id,
    """ + reservation_gpus + """, tupleElement(tupleElement(p, 'reservation'), 'pool') AS reservation_pool,
    parseDateTime64BestEffortOrNull(tupleElement(tupleElement(p, 'reservation'), 'window_start'), 3, 'UTC') AS reservation_window_start,
    parseDateTime64BestEffortOrNull(tupleElement(tupleElement(p, 'reservation'), 'window_end'), 3, 'UTC') AS reservation_window_end, tupleElement(p, 'target') AS target,
    parseDateTime64BestEffortOrNull(tupleElement(p, 'expires_at'), 3, 'UTC') AS expires_at, tupleElement(p, 'tags') AS tags, release_state, summary,
    source_topic, assumeNotNull(source_partition) AS source_partition, assumeNotNull(source_offset) AS source_offset, payload_json"""


def _workload_timeline_select(gpus_requested: str) -> str:
    """workload_timeline's columns from a row of ``correlated_fields`` and its payload ``p``;
    ``gpus_requested`` the expression of that column."""
    return """tupleElement(identity, 'workload_id') AS workload_id, assumeNotNull(occurred_at) AS occurred_at, correlation_id,
    assumeNotNull(version) AS version, event_type, attribution,
    """ + _identity_select(tuple(f for f in _INTAKE_FIELDS if f != "workload_id")) + """, release_state,
    tupleElement(p, 'object_kind') AS object_kind, tupleElement(p, 'queue') AS queue, tupleElement(p, 'cluster_queue') AS cluster_queue, tupleElement(p, 'priority_class') AS priority_class,
    tupleElement(p, 'priority') AS priority,
    if(tupleElement(p, 'reason') = '' AND event_type = 'admission.decided', concat(tupleElement(p, 'decision'), ':', tupleElement(p, 'rule')), tupleElement(p, 'reason')) AS reason,
    tupleElement(p, 'message') AS message, tupleElement(p, 'phase') AS phase, """ + gpus_requested + """,
    tupleElement(p, 'image_digests') AS image_digests, tupleElement(tupleElement(p, 'preemptor'), 'kind') AS preemptor_kind, tupleElement(tupleElement(p, 'preemptor'), 'namespace') AS preemptor_namespace,
    tupleElement(tupleElement(p, 'preemptor'), 'name') AS preemptor_name, tupleElement(tupleElement(p, 'preemptor'), 'uid') AS preemptor_uid, tupleElement(tupleElement(p, 'victim'), 'kind') AS victim_kind,
    tupleElement(tupleElement(p, 'victim'), 'namespace') AS victim_namespace, tupleElement(tupleElement(p, 'victim'), 'name') AS victim_name, tupleElement(p, 'labels') AS labels, tupleElement(p, 'flavors') AS flavors, summary,
    source_topic, assumeNotNull(source_partition) AS source_partition, assumeNotNull(source_offset) AS source_offset, payload_json"""


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "correlated events and dead letters", (
        """CREATE TABLE IF NOT EXISTS {db}.correlated_events {on_cluster} (
    correlation_id String,
    version UInt64,
    event_type LowCardinality(String),
    occurred_at DateTime64(3, 'UTC'),
    attribution LowCardinality(String),""" + IDENTITY_COLUMNS + """,
    release_state LowCardinality(String),
    summary String,
    source_topic LowCardinality(String),
    source_partition UInt32,
    source_offset UInt64,
    payload_json String,
    inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_release release_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_alert alert_fingerprint TYPE bloom_filter GRANULARITY 4,
    INDEX idx_workload workload_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_node node TYPE bloom_filter GRANULARITY 4
) ENGINE = {engine_replacing_version}
ORDER BY correlation_id""",
        """CREATE TABLE IF NOT EXISTS {db}.dead_letters {on_cluster} (
    reason LowCardinality(String),
    error String,
    stage LowCardinality(String),
    source_topic String,
    source_partition Int32,
    source_offset Int64,
    key String,
    value String,
    failed_at DateTime64(3, 'UTC')
) ENGINE = {engine_replacing}
ORDER BY (source_topic, source_partition, source_offset, stage)""",
    )),
    Migration(2, "raw event log, allocations, release history, workload timeline, enriched alerts, violations", (
        # Audit/replay log of every envelope. Keyed by (event_type, occurred_at, event_id):
        # a re-delivered record (same event) collapses; family + time-window scans read a
        # key range; point lookups by event_id use the bloom filter. A collector that
        # re-sent one event_id with a different time would show as two rows — visible,
        # not silently merged. Version = Kafka offset, so which copy is kept is
        # deterministic.
        """CREATE TABLE IF NOT EXISTS {db}.raw_events {on_cluster} (
    event_id String,
    event_type LowCardinality(String),
    schema_version UInt16,
    occurred_at DateTime64(3, 'UTC'),
    observed_at DateTime64(3, 'UTC'),
    source_collector LowCardinality(String),
    source_host LowCardinality(String),""" + IDENTITY_COLUMNS + """,
    traceparent String,
    payload_json String,
    kafka_topic LowCardinality(String),
    kafka_partition UInt32,
    kafka_offset UInt64,
    inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_event_id event_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_release release_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_workload workload_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_node node TYPE bloom_filter GRANULARITY 4
) ENGINE = {engine_replacing_kafka_offset}
PARTITION BY toYYYYMM(occurred_at)
ORDER BY (event_type, occurred_at, event_id)""",
        # Allocation intervals. allocation_id hashes node, device, pod, container and the
        # assigning event, so node, gpu_id and started_at never change between versions:
        # keying by them answers "who held this GPU at T" with a key range and still
        # collapses every version of one allocation.
        """CREATE TABLE IF NOT EXISTS {db}.gpu_allocations {on_cluster} (
    allocation_id String,
    version UInt64,
    node LowCardinality(String),
    gpu_id String,
    gpu String,
    mig_instance String,
    resource_name LowCardinality(String),
    namespace LowCardinality(String),
    pod String,
    container String,""" + ALLOCATION_IDENTITY_COLUMNS + """,
    attribution LowCardinality(String),
    started_at DateTime64(3, 'UTC'),
    ended_at Nullable(DateTime64(3, 'UTC')),
    end_reason LowCardinality(String),
    start_event_id String,
    end_event_id String,
    inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_pod pod TYPE bloom_filter GRANULARITY 4,
    INDEX idx_workload workload_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_release release_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_allocation allocation_id TYPE bloom_filter GRANULARITY 4
) ENGINE = {engine_replacing_version}
ORDER BY (node, gpu_id, started_at, allocation_id)
SETTINGS index_granularity = 1024""",
        # Release lifecycle with manifests. release_id is the release event's own
        # (required) identifier and occurred_at its own time: neither changes between
        # versions, so re-renders (manifest filled later) collapse.
        """CREATE TABLE IF NOT EXISTS {db}.release_history {on_cluster} (
    release_id String,
    occurred_at DateTime64(3, 'UTC'),
    correlation_id String,
    version UInt64,
    event_type LowCardinality(String),
    model_name String,
    model_version String,
    artifact_digest String,
    image_digest String,
    config_digest String,
    dataset_ref String,
    environment LowCardinality(String),
    owner LowCardinality(String),
    data_class LowCardinality(String),
    actor LowCardinality(String),
    approval_id String,
    reason String,
    to_environment LowCardinality(String),
    superseded_release_id String,
    reservation_id String,
    reservation_gpus Nullable(UInt32),
    reservation_pool LowCardinality(String),
    reservation_window_start Nullable(DateTime64(3, 'UTC')),
    reservation_window_end Nullable(DateTime64(3, 'UTC')),
    target String,
    expires_at Nullable(DateTime64(3, 'UTC')),
    tags Map(String, String),
    release_state LowCardinality(String),
    summary String,""" + SOURCE_COLUMNS + """,
    payload_json String,
    inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_model model_name TYPE bloom_filter GRANULARITY 4,
    INDEX idx_image image_digest TYPE bloom_filter GRANULARITY 4
) ENGINE = {engine_replacing_version}
ORDER BY (release_id, occurred_at, correlation_id)
SETTINGS index_granularity = 1024""",
        # Scheduler rows of known workloads (rows without a workload stay in
        # correlated_events until one is attributed). Typed from the payload.
        """CREATE TABLE IF NOT EXISTS {db}.workload_timeline {on_cluster} (
    workload_id String,
    occurred_at DateTime64(3, 'UTC'),
    correlation_id String,
    version UInt64,
    event_type LowCardinality(String),
    attribution LowCardinality(String),""" + IDENTITY_COLUMNS.replace("    workload_id String,\n", "") + """,
    release_state LowCardinality(String),
    object_kind LowCardinality(String),
    queue LowCardinality(String),
    cluster_queue LowCardinality(String),
    priority_class LowCardinality(String),
    priority Nullable(Int64),
    reason LowCardinality(String),
    message String,
    phase LowCardinality(String),
    gpus_requested Nullable(UInt32),
    image_digests Array(String),
    preemptor_kind LowCardinality(String),
    preemptor_namespace LowCardinality(String),
    preemptor_name String,
    preemptor_uid String,
    victim_kind LowCardinality(String),
    victim_namespace LowCardinality(String),
    victim_name String,
    labels Map(String, String),
    flavors Map(String, String),
    summary String,""" + SOURCE_COLUMNS + """,
    payload_json String,
    inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_release release_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_pod pod TYPE bloom_filter GRANULARITY 4,
    INDEX idx_node node TYPE bloom_filter GRANULARITY 4,
    -- Candidate finders for readers that do not start from a workload. They hold every
    -- version (projections are not read with FINAL): readers take candidates from them
    -- and the truth from the table (sinks/read/trace.py).
    PROJECTION p_release (SELECT release_id, workload_id, occurred_at ORDER BY release_id),
    PROJECTION p_time (SELECT occurred_at, correlation_id, version, workload_id, node ORDER BY (occurred_at, correlation_id))
) ENGINE = {engine_replacing_version}
ORDER BY (workload_id, occurred_at, correlation_id)
SETTINGS index_granularity = 1024, deduplicate_merge_projection_mode = 'rebuild'""",
        # Alerts with their attribution. The fingerprint is the alert's own (required)
        # identifier: re-attribution (as-of GPU joins) changes columns, never the key.
        """CREATE TABLE IF NOT EXISTS {db}.enriched_alerts {on_cluster} (
    alert_fingerprint String,
    occurred_at DateTime64(3, 'UTC'),
    correlation_id String,
    version UInt64,
    event_type LowCardinality(String),
    attribution LowCardinality(String),""" + IDENTITY_COLUMNS.replace(",\n    alert_fingerprint String", "") + """,
    release_state LowCardinality(String),
    alertname LowCardinality(String),
    severity LowCardinality(String),
    starts_at DateTime64(3, 'UTC'),
    ends_at Nullable(DateTime64(3, 'UTC')),
    labels Map(String, String),
    annotations Map(String, String),
    generator_url String,
    receiver LowCardinality(String),
    group_key String,
    summary String,""" + SOURCE_COLUMNS + """,
    inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_release release_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_workload workload_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_pod pod TYPE bloom_filter GRANULARITY 4,
    INDEX idx_node node TYPE bloom_filter GRANULARITY 4,
    INDEX idx_time occurred_at TYPE minmax GRANULARITY 1
) ENGINE = {engine_replacing_version}
ORDER BY (alert_fingerprint, occurred_at, correlation_id)
SETTINGS index_granularity = 1024""",
        """CREATE TABLE IF NOT EXISTS {db}.violations {on_cluster} (
    violation_id String,
    version UInt64,
    control_id UInt8,
    title LowCardinality(String),
    severity LowCardinality(String),""" + IDENTITY_COLUMNS + """,
    evidence Array(String),
    accountable_owner LowCardinality(String),
    opened_at DateTime64(3, 'UTC'),
    closed_at Nullable(DateTime64(3, 'UTC')),
    detail String,
    inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_control control_id TYPE set(8) GRANULARITY 4,
    INDEX idx_release release_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_opened opened_at TYPE minmax GRANULARITY 1
) ENGINE = {engine_replacing_version}
ORDER BY violation_id""",
        # Lookups the trace falls back to on the source-of-truth table (pods that no
        # workload or allocation names yet).
        "ALTER TABLE {db}.correlated_events {on_cluster} ADD INDEX IF NOT EXISTS idx_pod pod TYPE bloom_filter GRANULARITY 4",
        *(_distributed(t) for t in SHARD_KEYS),
    )),
    Migration(3, "violations record the policy version they were judged under", (
        "ALTER TABLE {db}.violations {on_cluster} ADD COLUMN IF NOT EXISTS policy_version LowCardinality(String) DEFAULT '' AFTER detail",
        "{cluster_only}ALTER TABLE {db}.violations_dist {on_cluster} ADD COLUMN IF NOT EXISTS policy_version LowCardinality(String) "
        "DEFAULT '' AFTER detail",
    )),
    Migration(4, "the correlated family built by the store: an intake table and a view per table", (
        # The sink inserts the worker's correlated records as they are, each the one string of a
        # ``RowBinary`` row (length-prefixed: one record is one row whatever it holds — text
        # formats let a record close its row and open another, ``]\n[``, or read ``{..}{..}`` as
        # two), into ``correlated_intake``; a view parses each once (``JSONExtract`` into a named
        # tuple) into ``correlated_fields``, and four materialized views build the rows of the
        # correlated family from those — ClickHouse parsing JSON, not Python building rows (the
        # sink's costliest work: benchmarks/sink_cpu.py). Nothing is stored in either (ENGINE =
        # Null). The fields' constraints are that the record is a JSON object and has its required
        # fields (one absent, null, of the wrong type or out of its type's range — a negative or
        # 2^64 version, an unreadable time — reads as NULL and fails its constraint), checked before
        # the family's views run: a record without them is refused whole, no table keeping a row of
        # it (and dead-lettered by the sink, naming the constraint). Here a record a view refused (a
        # count out of its column's range) kept the rows of the views ClickHouse ran before that one —
        # correlated_events' when its view ran first, and that order is not the views' creation order
        # once one is altered (ALTER … MODIFY QUERY: it varied between stores and between processes):
        # migration 6 moved those checks into the intake's view, before any family view. An absent or
        # null identity, or one that is not an object, reads as an empty one. On a cluster the views
        # write into the ``_dist`` tables ({dist}); the intake is local to the node the sink inserts on.
        """CREATE TABLE IF NOT EXISTS {db}.correlated_intake {on_cluster} (record String) ENGINE = Null""",
        """CREATE TABLE IF NOT EXISTS {db}.correlated_fields {on_cluster} (
    correlation_id String,
    version Nullable(UInt64),
    event_type String,
    occurred_at Nullable(DateTime64(3, 'UTC')),
    attribution String,
    identity Tuple(""" + _INTAKE_IDENTITY + """),
    release_state String,
    summary String,
    source_topic String,
    source_partition Nullable(UInt32),
    source_offset Nullable(UInt64),
    payload_json String,
    record_is_object Bool,
    CONSTRAINT is_a_json_object CHECK record_is_object,
    CONSTRAINT has_correlation_id CHECK correlation_id != '',
    CONSTRAINT has_version CHECK version IS NOT NULL,
    CONSTRAINT has_event_type CHECK event_type != '',
    CONSTRAINT has_occurred_at CHECK occurred_at IS NOT NULL,
    CONSTRAINT has_attribution CHECK attribution != '',
    CONSTRAINT has_source CHECK source_topic != '' AND source_partition IS NOT NULL AND source_offset IS NOT NULL
) ENGINE = Null""",
        # The record's fields as columns: the text fields '' when absent or null (their constraints
        # refuse the required ones), the rest as they are.
        "CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.correlated_fields_mv {on_cluster} TO {db}.correlated_fields AS\n"
        + _intake_query(_RECORD_TUPLE),
        _view("correlated_events", _CORRELATED_EVENTS_SELECT, "1"),
        # The payload's fields as typed columns, each payload parsed once (``JSONExtract`` into a
        # named tuple): a field that is absent, null or of another JSON type reads as empty (a
        # number into a string column as its text), as the rows built in Python did. A count out
        # of its column's range (a reservation of -5 GPUs) refuses the record, naming the column
        # (``_uint32``), rather than wrapping around (since migration 6, in the intake's view).
        _view("release_history", _release_history_select(_uint32(_RESERVATION_GPUS, "reservation_gpus")), _RELEASE_ROWS, _RELEASE_PAYLOAD),
        # Scheduler (and admission) rows of known workloads. An admission decision without a
        # reason reads as ``decision:rule``.
        _view("workload_timeline", _workload_timeline_select(_uint32(_GPUS_REQUESTED, "gpus_requested")), _WORKLOAD_ROWS, _WORKLOAD_PAYLOAD),
        _view("enriched_alerts", """tupleElement(identity, 'alert_fingerprint') AS alert_fingerprint, assumeNotNull(occurred_at) AS occurred_at, correlation_id,
    assumeNotNull(version) AS version, event_type, attribution,
    """ + _identity_select(tuple(f for f in _INTAKE_FIELDS if f != "alert_fingerprint")) + """, release_state,
    tupleElement(p, 'alertname') AS alertname, tupleElement(p, 'severity') AS severity,
    ifNull(parseDateTime64BestEffortOrNull(tupleElement(p, 'starts_at'), 3, 'UTC'), assumeNotNull(occurred_at)) AS starts_at,
    parseDateTime64BestEffortOrNull(tupleElement(p, 'ends_at'), 3, 'UTC') AS ends_at, tupleElement(p, 'labels') AS labels, tupleElement(p, 'annotations') AS annotations,
    tupleElement(p, 'generator_url') AS generator_url, tupleElement(p, 'receiver') AS receiver, tupleElement(p, 'group_key') AS group_key, summary,
    source_topic, assumeNotNull(source_partition) AS source_partition, assumeNotNull(source_offset) AS source_offset""",
              "splitByChar('.', event_type)[1] = 'alert' AND tupleElement(identity, 'alert_fingerprint') != ''",
              "Tuple(alertname String, severity String, starts_at String, ends_at String, labels Map(String, String), "
              "annotations Map(String, String), generator_url String, receiver String, group_key String)"),
    )),
    Migration(5, "dead letters that name no source offset are kept apart", (
        # The key (source_topic, source_partition, source_offset, stage) collapsed every dead letter
        # without a source offset — the edge's (a collector's event too large to travel, a receiver's
        # event from a newer schema), an output refused that names no input, admit's — into one row per
        # topic and stage: N oversize events, one row. ``letter_id`` (the sink's ``dead_letter_rows``)
        # is empty for a letter that names its source offset, else a digest of its reason, key and value.
        # Added without a default, as ClickHouse requires of a column added to the sorting key.
        "ALTER TABLE {db}.dead_letters {on_cluster} ADD COLUMN IF NOT EXISTS letter_id String, "
        "MODIFY ORDER BY (source_topic, source_partition, source_offset, stage, letter_id)",
        "{cluster_only}ALTER TABLE {db}.dead_letters_dist {on_cluster} ADD COLUMN IF NOT EXISTS letter_id String",
    )),
    Migration(6, "a record's range checks run before any view of the correlated family", (
        # The counts' range checks (``_uint32``) were the views' of release_history and
        # workload_timeline: a record one of them refused was refused whole only when
        # correlated_events' view ran after it — ClickHouse keeps the rows of the views that ran
        # before the one that threw. That order is not the views' creation order once a view is
        # altered (chDB 26.9: ``ALTER TABLE … MODIFY QUERY`` of any of them made it vary between
        # stores and between processes; tests/sinks/test_correlated.py). Now the intake's view checks
        # them, parsing the two families' payloads into ``correlated_fields`` (``_CHECKED_PAYLOADS``),
        # and the two views read them from there: a record is refused before any family view sees it,
        # as one a constraint of ``correlated_fields`` refuses (those are checked before the table's
        # views run). Not constraints: a Null table cannot have constraints added (NOT_IMPLEMENTED).
        # In this order, so that at every step each view reads what the one before writes.
        "ALTER TABLE {db}.correlated_fields {on_cluster} ADD COLUMN IF NOT EXISTS release_payload " + _RELEASE_PAYLOAD
        + ", ADD COLUMN IF NOT EXISTS workload_payload " + _WORKLOAD_PAYLOAD
        + ", ADD COLUMN IF NOT EXISTS reservation_gpus Nullable(UInt32), ADD COLUMN IF NOT EXISTS gpus_requested Nullable(UInt32)",
        "ALTER TABLE {db}.correlated_fields_mv {on_cluster} MODIFY QUERY " + _intake_query(_RECORD_TUPLE, _CHECKED_PAYLOADS),
        "ALTER TABLE {db}.release_history_mv {on_cluster} MODIFY QUERY "
        + _view_query(_release_history_select("reservation_gpus"), _RELEASE_ROWS, "release_payload"),
        "ALTER TABLE {db}.workload_timeline_mv {on_cluster} MODIFY QUERY "
        + _view_query(_workload_timeline_select("gpus_requested"), _WORKLOAD_ROWS, "workload_payload"),
    )),
    Migration(7, "correlated events keep the named release and whose environment a row has", (
        # What control 1 and control 3 judge a row by beyond its identity: ``named_release_id``,
        # the release id a label named that no release event describes (the row attributed by a
        # fallback rule; control 3's "names release X, which no release event describes"), and
        # ``environment_labelled``, whether the row's environment is the workload's own label
        # (true) or its release's manifest (false: control 1 then judges the strictest environment
        # the release's events named by the admission). The worker's controls read them from the
        # topic; ``gpuledger audit --reevaluate`` re-judges from correlated_events, and judged a row
        # without them as one of a worker before them. Rows stored before this read '' and NULL —
        # what such a record says, and how the controls judge it (streams/controls/rules.py).
        # Safe to alter the views now: no refusal depends on their order (migration 6). In this order,
        # so that at every step each view reads what the one before writes.
        "ALTER TABLE {db}.correlated_events {on_cluster} ADD COLUMN IF NOT EXISTS named_release_id String DEFAULT '' AFTER payload_json, "
        "ADD COLUMN IF NOT EXISTS environment_labelled Nullable(Bool) AFTER named_release_id",
        "{cluster_only}ALTER TABLE {db}.correlated_events_dist {on_cluster} ADD COLUMN IF NOT EXISTS named_release_id String DEFAULT '' "
        "AFTER payload_json, ADD COLUMN IF NOT EXISTS environment_labelled Nullable(Bool) AFTER named_release_id",
        "ALTER TABLE {db}.correlated_fields {on_cluster} ADD COLUMN IF NOT EXISTS named_release_id String, "
        "ADD COLUMN IF NOT EXISTS environment_labelled Nullable(Bool)",
        "ALTER TABLE {db}.correlated_fields_mv {on_cluster} MODIFY QUERY "
        + _intake_query(_RECORD_TUPLE_7, _CHECKED_PAYLOADS + ",\n    " + _JUDGED_FIELDS),
        "ALTER TABLE {db}.correlated_events_mv {on_cluster} MODIFY QUERY "
        + _view_query(_CORRELATED_EVENTS_SELECT + ", named_release_id, environment_labelled", "1"),
    )),
)

_CREATE_RE = re.compile(r"^CREATE TABLE IF NOT EXISTS \{db\}\.(\w+) ")


def table_names() -> tuple[str, ...]:
    """Every table the migrations create, in creation order (no ``_dist`` tables, no
    ``schema_migrations`` bookkeeping, no intake: a Null table stores nothing)."""
    return tuple(m.group(1) for migration in MIGRATIONS for statement in migration.statements
                 if (m := _CREATE_RE.match(statement)) and not statement.endswith("ENGINE = Null"))


def table_name(table: str, cluster: str | None) -> str:
    """The table writers and readers use: ``<table>_dist`` on a cluster."""
    return f"{table}_dist" if cluster else table


def _engines(cluster: str | None) -> dict[str, str]:
    if cluster:
        path = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"
        return {
            "engine_replacing_version": f"ReplicatedReplacingMergeTree({path}, version)",
            "engine_replacing_kafka_offset": f"ReplicatedReplacingMergeTree({path}, kafka_offset)",
            "engine_replacing": f"ReplicatedReplacingMergeTree({path})",
        }
    return {"engine_replacing_version": "ReplacingMergeTree(version)", "engine_replacing_kafka_offset": "ReplacingMergeTree(kafka_offset)",
            "engine_replacing": "ReplacingMergeTree"}


def _quote_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render(statement: str, database: str, cluster: str | None = None) -> str | None:
    """Fill a statement's placeholders for one node or a cluster (None: not for this mode)."""
    if statement.startswith("{cluster_only}"):
        if not cluster:
            return None
        statement = statement[len("{cluster_only}"):]
    values = {
        "db": f"`{database}`",
        "on_cluster": f"ON CLUSTER `{cluster}`" if cluster else "",
        "dist": "_dist" if cluster else "",
        "cluster_name": _quote_string(cluster or ""),
        "db_name": _quote_string(database),
        **_engines(cluster),
    }
    out = statement
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out


def bootstrap_statements(database: str, cluster: str | None = None) -> list[str]:
    on_cluster = f"ON CLUSTER `{cluster}`" if cluster else ""
    return [
        f"CREATE DATABASE IF NOT EXISTS `{database}` {on_cluster}".strip(),
        f"CREATE TABLE IF NOT EXISTS `{database}`.schema_migrations {on_cluster} "
        f"(version UInt32, name String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
        f"ENGINE = {_engines(cluster)['engine_replacing']} ORDER BY version",
    ]


def rendered(database: str, cluster: str | None = None, ttl_days: int | None = None) -> list[tuple[int, str]]:
    """Every statement of every migration as it would run, as (version, sql); version 0 is
    the bootstrap, -1 the TTL statements. For `gpuledger db migrate --print`."""
    out = [(0, sql) for sql in bootstrap_statements(database, cluster)]
    for migration in MIGRATIONS:
        for statement in migration.statements:
            sql = render(statement, database, cluster)
            if sql is not None:
                out.append((migration.version, sql))
    if ttl_days:
        out.extend((-1, ttl_statement(database, table, ttl_days, cluster)) for table in TTL_COLUMNS)
    return out


def migrate(client, database: str, cluster: str | None = None, ttl_days: int | None = None, embedded: bool = False,
            retention: bool = True) -> list[int]:
    """Apply pending migrations in order, then the configured TTL (not with ``retention=False``:
    a reader, which must not change what the worker's configuration keeps) and, with ``embedded`` —
    the embedded store — its small parts packed and its merges wider (``apply_embedded_settings``); return the versions applied."""
    for sql in bootstrap_statements(database, cluster):
        client.command(sql)
    done = {row[0] for row in client.query(f"SELECT version FROM `{database}`.schema_migrations FINAL").result_rows}
    applied = []
    for migration in MIGRATIONS:
        if migration.version in done:
            continue
        for statement in migration.statements:
            sql = render(statement, database, cluster)
            if sql is not None:
                client.command(sql)
        client.insert(f"{database}.schema_migrations", [[migration.version, migration.name]], column_names=["version", "name"])
        applied.append(migration.version)
        log.info("applied migration %d: %s", migration.version, migration.name)
    if retention:
        apply_ttl(client, database, ttl_days, cluster)
    if embedded:
        apply_embedded_settings(client, database)
    return applied


def ttl_statement(database: str, table: str, ttl_days: int | None, cluster: str | None = None) -> str:
    on_cluster = f" ON CLUSTER `{cluster}`" if cluster else ""
    if not ttl_days:
        return f"ALTER TABLE `{database}`.{table}{on_cluster} REMOVE TTL"
    return f"ALTER TABLE `{database}`.{table}{on_cluster} MODIFY TTL {TTL_COLUMNS[table]} + INTERVAL {int(ttl_days)} DAY"


_TTL_RE = re.compile(r"\bTTL\s+(\w+)\s*\+\s*toIntervalDay\((\d+)\)")


def apply_ttl(client, database: str, ttl_days: int | None, cluster: str | None = None) -> list[str]:
    """Set (or remove) the retention TTL on the event tables where it differs; return the
    tables changed. Changing a TTL makes ClickHouse rewrite parts once, so it is only
    issued when the table's current TTL is not already the configured one."""
    rows = client.query(
        "SELECT name, engine_full FROM system.tables WHERE database = {db:String} AND name IN {names:Array(String)}",
        parameters={"db": database, "names": list(TTL_COLUMNS)},
    ).result_rows
    changed = []
    for name, engine_full in rows:
        match = _TTL_RE.search(engine_full or "")
        current = int(match.group(2)) if match and match.group(1) == TTL_COLUMNS[name] else None
        has_ttl = " TTL " in f" {engine_full} "
        if (ttl_days and current == int(ttl_days)) or (not ttl_days and not has_ttl):
            continue
        client.command(ttl_statement(database, name, ttl_days, cluster))
        changed.append(name)
        log.info("retention TTL of %s.%s set to %s", database, name, f"{ttl_days} days" if ttl_days else "none")
    return changed


#: In the embedded store, a part smaller than this (uncompressed) is written *packed* — its files in
#: one archive (ClickHouse's Packed part storage, the MergeTree setting ``min_bytes_for_full_part_storage``)
#: — and larger ones, which only merges make, one file per stream as before. Every insert of the sink
#: is such a small part, and each used to create a dozen files (a part directory of a compact part: data,
#: marks, primary index, checksums, columns, count, …). Creating files was most of an insert's CPU where
#: the store's directory is on ext4 without a journal — as on the machines ``make bench`` runs on, whose
#: kernel spent ~45 % of an insert in the allocator looking past recently deleted inodes (``perf``), which
#: a store that merges and deletes parts all the time has many of. Measured (benchmarks/sink_cpu.py,
#: 30,000 events): the sink's CPU per event 0.074 → 0.059 ms in batches of 6,000 records, 0.123 → 0.088
#: in batches of 2,000 — and later, after more deletions on the disk, 0.17–0.20 → 0.10 in batches of 2,000
#: and no difference in batches of 6,000 (the gain is what the file system makes creating files cost). The same size as ``min_bytes_for_wide_part``'s default: what is packed is what
#: would be a compact part. Not set on a ClickHouse server: a server older than the format cannot read
#: packed parts (no downgrade), an operator's decision (docs/store.md).
PACKED_PART_BYTES = 10 * 1024 * 1024
#: In the embedded store, how many parts of about one size a merge waits for before it merges them
#: (ClickHouse's ``merge_selector_base``, default 5): the wider a merge, the fewer times a row is
#: rewritten by merges on its way into one large part (about log_base of the parts an insert size
#: makes). Every insert of the sink is a small part, so merges were a fifth of the sink's CPU
#: (``perf``: the MergeMutate thread). Measured (benchmarks/sink_cpu.py's store phase, then until
#: no merge runs): in batches of 5,000 records 0.064-0.079 -> 0.050-0.069 ms per event, in batches
#: of 1,000 0.136-0.157 -> 0.103-0.111; 20 was no better than 10. The price: more active parts
#: between merges (after 60,000 events 44 instead of 20, all tables), which a ``FINAL`` read merges
#: as it reads — at these counts nothing a query notices. Not set on a ClickHouse server: its
#: operator's decision, as packed parts are.
MERGE_SELECTOR_BASE = 10
#: The MergeTree settings of every table of the embedded store (``apply_embedded_settings``).
EMBEDDED_TABLE_SETTINGS = {"min_bytes_for_full_part_storage": PACKED_PART_BYTES, "merge_selector_base": MERGE_SELECTOR_BASE}


def _setting_of(engine_full: str, name: str) -> str | None:
    match = re.search(rf"\b{name}\s*=\s*([^,\s]+)", engine_full or "")
    return match.group(1).strip("'") if match else None


def apply_embedded_settings(client, database: str) -> list[str]:
    """Set the embedded store's MergeTree settings (``EMBEDDED_TABLE_SETTINGS``: packed small
    parts, wider merges) on every MergeTree table of ``database`` that does not have them (a table
    an older version created included); return the tables changed. A metadata change: the parts
    already written keep their storage until merged, and merges from now on follow the new base."""
    rows = client.query("SELECT name, engine_full FROM system.tables WHERE database = {db:String} AND engine LIKE '%MergeTree'",
                        parameters={"db": database}).result_rows
    changed = []
    for name, engine_full in rows:
        missing = {k: v for k, v in EMBEDDED_TABLE_SETTINGS.items() if _setting_of(engine_full, k) != str(v)}
        if not missing:
            continue
        client.command(f"ALTER TABLE `{database}`.`{name}` MODIFY SETTING " + ", ".join(f"{k} = {v}" for k, v in missing.items()))
        changed.append(name)
    if changed:
        log.info("tables %s.%s: small parts written packed, merges %d parts wide, from now on", database, ", ".join(changed),
                 MERGE_SELECTOR_BASE)
    return changed
