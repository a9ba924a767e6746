"""Versioned, idempotent migrations of gpuledger's ClickHouse schema.

Each migration is a list of statements templated with ``{db}``, ``{on_cluster}`` and
``{engine(...)}`` so that the single-node schema and the cluster variant
(``--cluster NAME``: ON CLUSTER + Replicated* engines) come from one definition.
Applied migrations are recorded in ``{db}.schema_migrations``; re-running is a no-op.

Table design: rows are keyed by what makes them the same fact (correlation_id,
event id, ...) with ReplacingMergeTree(version), so re-delivered batches and
superseding corrections collapse; readers use FINAL (or argMax) to see the latest.
Lookup columns (release_id, alert_fingerprint, workload_id, node) carry bloom
filter skipping indexes because they are not in the ORDER BY key.
"""

from __future__ import annotations

import logging
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
)


def _engines(cluster: str | None, table_hint: str = "{table}") -> dict[str, str]:
    if cluster:
        path = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"
        return {
            "engine_replacing_version": f"ReplicatedReplacingMergeTree({path}, version)",
            "engine_replacing": f"ReplicatedReplacingMergeTree({path})",
        }
    return {"engine_replacing_version": "ReplacingMergeTree(version)", "engine_replacing": "ReplacingMergeTree"}


def render(statement: str, database: str, cluster: str | None = None) -> str:
    """Fill a migration statement's placeholders for a single node or a cluster."""
    values = {"db": f"`{database}`", "on_cluster": f"ON CLUSTER `{cluster}`" if cluster else "", **_engines(cluster)}
    out = statement
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out


def migrate(client, database: str, cluster: str | None = None) -> list[int]:
    """Apply pending migrations in order; return the versions applied."""
    on_cluster = f"ON CLUSTER `{cluster}`" if cluster else ""
    client.command(f"CREATE DATABASE IF NOT EXISTS `{database}` {on_cluster}")
    client.command(
        f"CREATE TABLE IF NOT EXISTS `{database}`.schema_migrations {on_cluster} "
        f"(version UInt32, name String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
        f"ENGINE = {_engines(cluster)['engine_replacing']} ORDER BY version"
    )
    done = {row[0] for row in client.query(f"SELECT version FROM `{database}`.schema_migrations FINAL").result_rows}
    applied = []
    for migration in MIGRATIONS:
        if migration.version in done:
            continue
        for statement in migration.statements:
            client.command(render(statement, database, cluster))
        client.insert(f"{database}.schema_migrations", [[migration.version, migration.name]], column_names=["version", "name"])
        applied.append(migration.version)
        log.info("applied migration %d: %s", migration.version, migration.name)
    return applied
