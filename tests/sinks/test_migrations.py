"""sinks/migrations.py against real ClickHouse: idempotent, recorded, TTL as
configuration, and the cluster rendering (checked as text: no cluster here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from sinks.agents import CORRELATED_FAMILY
from sinks.allocations import GPU_ALLOCATION_COLUMNS, VIOLATION_COLUMNS
from sinks.correlated import DEAD_LETTER_COLUMNS
from sinks.migrations import (MERGE_SELECTOR_BASE, MIGRATIONS, PACKED_PART_BYTES, SHARD_KEYS, TTL_COLUMNS, apply_embedded_settings, apply_ttl,
                              migrate, rendered)
from sinks.raw import RAW_EVENT_COLUMNS

TABLES = ("correlated_events", "dead_letters", "raw_events", "gpu_allocations", "release_history", "workload_timeline",
          "enriched_alerts", "violations")


def _tables(client, db: str) -> dict[str, str]:
    """The tables that store rows (not the intake, a Null table, nor its views)."""
    rows = client.query("SELECT name, engine_full FROM system.tables WHERE database = {db:String} AND engine LIKE '%MergeTree'",
                        parameters={"db": db}).result_rows
    return dict(rows)


def test_migrations_are_idempotent_and_recorded(clickhouse_client, clickhouse_db):
    assert migrate(clickhouse_client, clickhouse_db) == [m.version for m in MIGRATIONS]
    assert migrate(clickhouse_client, clickhouse_db) == []
    recorded = clickhouse_client.query(f"SELECT version, name FROM `{clickhouse_db}`.schema_migrations FINAL ORDER BY version").result_rows
    assert [v for v, _ in recorded] == [m.version for m in MIGRATIONS]
    assert all(name for _, name in recorded)
    tables = _tables(clickhouse_client, clickhouse_db)
    assert set(TABLES) <= set(tables)
    assert not any(name.endswith("_dist") for name in tables), "no Distributed tables on a single node"
    assert "ReplacingMergeTree(version)" in tables["release_history"]
    assert "ORDER BY (release_id, occurred_at, correlation_id)" in tables["release_history"]
    assert "ORDER BY (node, gpu_id, started_at, allocation_id)" in tables["gpu_allocations"]
    assert "ReplacingMergeTree(kafka_offset)" in tables["raw_events"]
    # Re-running every statement by hand (as a second shard with an empty
    # schema_migrations would) is harmless too.
    for version, sql in rendered(clickhouse_db):
        clickhouse_client.command(sql)


def test_insert_columns_match_the_tables(clickhouse_client, clickhouse_db):
    migrate(clickhouse_client, clickhouse_db)
    writers = {**CORRELATED_FAMILY, "gpu_allocations": GPU_ALLOCATION_COLUMNS, "violations": VIOLATION_COLUMNS,
               "raw_events": RAW_EVENT_COLUMNS, "dead_letters": DEAD_LETTER_COLUMNS}
    for table, columns in writers.items():
        have = {r[0] for r in clickhouse_client.query(
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String}",
            parameters={"db": clickhouse_db, "t": table}).result_rows}
        assert set(columns) <= have, f"{table}: {set(columns) - have} not in the table"
        assert len(columns) == len(set(columns)), table
    # The correlated family's tables are written by the intake's views: each writes exactly the
    # columns the family's list names (sinks/correlated.py), which readers and docs go by.
    for table, columns in CORRELATED_FAMILY.items():
        view = {r[0] for r in clickhouse_client.query(
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String}",
            parameters={"db": clickhouse_db, "t": f"{table}_mv"}).result_rows}
        assert view == set(columns), (table, view ^ set(columns))


def test_ttl_is_configuration_applied_only_when_it_changes(clickhouse_client, clickhouse_db):
    migrate(clickhouse_client, clickhouse_db, ttl_days=30)
    tables = _tables(clickhouse_client, clickhouse_db)
    for table, column in TTL_COLUMNS.items():
        assert f"TTL {column} + toIntervalDay(30)" in tables[table], tables[table]
    assert "TTL" not in tables["release_history"] and "TTL" not in tables["gpu_allocations"]
    assert apply_ttl(clickhouse_client, clickhouse_db, 30) == []  # unchanged: no ALTER
    assert sorted(apply_ttl(clickhouse_client, clickhouse_db, 7)) == sorted(TTL_COLUMNS)
    assert sorted(apply_ttl(clickhouse_client, clickhouse_db, None)) == sorted(TTL_COLUMNS)
    assert all(" TTL " not in _tables(clickhouse_client, clickhouse_db)[t] for t in TTL_COLUMNS)
    assert apply_ttl(clickhouse_client, clickhouse_db, None) == []


def test_the_embedded_stores_small_parts_are_packed_and_merged_wider_from_the_next_start_on(clickhouse_dsn, clickhouse_client,
                                                                                              clickhouse_db):
    """A store whose tables an earlier version created (every part a directory of files, merges
    of ClickHouse's default width) gets ``min_bytes_for_full_part_storage`` and
    ``merge_selector_base`` when the worker's store connects (``migrated_store`` on a chdb:// DSN):
    the parts inserted before stay as they are, the next insert is one packed file, and FINAL
    reads both. Applied once; ``migrate`` without ``embedded`` (a server) never sets them."""
    import pytest

    from sinks.clickhouse import is_embedded, migrated_store

    if not is_embedded(clickhouse_dsn):
        pytest.skip("these settings are set on the embedded store only")
    db = clickhouse_db
    packed, wider = f"min_bytes_for_full_part_storage = {PACKED_PART_BYTES}", f"merge_selector_base = {MERGE_SELECTOR_BASE}"
    migrate(clickhouse_client, db)  # as before: nothing packed, default merges
    insert = (f"INSERT INTO `{db}`.dead_letters (reason, error, stage, source_topic, source_partition, source_offset, value, failed_at) "
              "VALUES ('validation', 'e', 'sinks.test', 'raw', 0, {offset}, '{n}', '2026-12-05 10:00:00')")
    clickhouse_client.command(insert.format(n="before", offset=1))
    assert all(packed not in engine and wider not in engine for engine in _tables(clickhouse_client, db).values())

    client = migrated_store(clickhouse_dsn, db).get()
    assert all(packed in engine and wider in engine for engine in _tables(client, db).values()), _tables(client, db)
    assert client.command("SELECT value FROM system.merge_tree_settings WHERE name = 'merge_selector_base'") != str(MERGE_SELECTOR_BASE)
    client.command(insert.format(n="after", offset=2))
    parts = client.query("SELECT part_storage_type, path FROM system.parts WHERE database = {db:String} AND table = 'dead_letters' "
                         "AND active ORDER BY min_block_number", parameters={"db": db}).result_rows
    assert [kind for kind, _ in parts] == ["Full", "Packed"]
    assert os.listdir(parts[1][1]) == ["data.packed"] and len(os.listdir(parts[0][1])) > 5
    assert sorted(r[0] for r in client.query(f"SELECT value FROM `{db}`.dead_letters FINAL").result_rows) == ["after", "before"]
    assert apply_embedded_settings(client, db) == []  # already set: no ALTER


def test_a_reader_opening_the_embedded_store_leaves_its_retention_alone(clickhouse_dsn, clickhouse_client, clickhouse_db, monkeypatch):
    """``gpuledger trace``/``sql`` open the embedded store themselves when no worker owns it
    (``open_reader``), creating any missing table — but the retention is the worker's
    configuration: a reader whose environment lacks ``GPULEDGER_CLICKHOUSE_TTL_DAYS`` used to
    remove the TTL from every event table."""
    import pytest

    from gpuledger.settings import Settings
    from sinks.clickhouse import is_embedded
    from sinks.read.query import open_reader

    if not is_embedded(clickhouse_dsn):
        pytest.skip("a reader opens the embedded store only")
    migrate(clickhouse_client, clickhouse_db, ttl_days=30)
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_DSN", clickhouse_dsn)
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_DATABASE", clickhouse_db)
    monkeypatch.delenv("GPULEDGER_CLICKHOUSE_TTL_DAYS", raising=False)
    reader = open_reader(Settings())
    assert reader.query(f"SELECT count() AS n FROM `{clickhouse_db}`.correlated_events").rows[0][0] == 0
    tables = _tables(clickhouse_client, clickhouse_db)
    for table, column in TTL_COLUMNS.items():
        assert f"TTL {column} + toIntervalDay(30)" in tables[table], tables[table]


def test_cluster_rendering_comes_from_the_same_definitions():
    single = [sql for _, sql in rendered("gl")]
    cluster = [sql for _, sql in rendered("gl", "prod", ttl_days=14)]
    creates = [s for s in cluster if s.startswith("CREATE TABLE")]
    local = [s for s in creates if "_dist" not in s.split("(")[0] and not s.endswith("ENGINE = Null")]
    # Every local table: ON CLUSTER and a Replicated engine whose path names shard and replica.
    assert len(local) == len([s for s in single if s.startswith("CREATE TABLE") and not s.endswith("ENGINE = Null")])
    # The intake stores nothing (local, on every node); its views write into the Distributed tables.
    assert [s.split(" (")[0] for s in creates if s.endswith("ENGINE = Null")] == [
        f"CREATE TABLE IF NOT EXISTS `gl`.{t} ON CLUSTER `prod`" for t in ("correlated_intake", "correlated_fields")]
    views = [s for s in cluster if s.startswith("CREATE MATERIALIZED VIEW")]
    assert [re.search(r"TO (\S+) AS", s).group(1) for s in views] == ["`gl`.correlated_fields", *(f"`gl`.{t}_dist" for t in CORRELATED_FAMILY)]
    assert [re.search(r"TO (\S+) AS", s).group(1) for s in single if s.startswith("CREATE MATERIALIZED VIEW")] == [
        "`gl`.correlated_fields", *(f"`gl`.{t}" for t in CORRELATED_FAMILY)]
    for sql in local:
        assert "ON CLUSTER `prod`" in sql, sql
        assert re.search(r"ENGINE = Replicated\w+MergeTree\('/clickhouse/tables/\{shard\}/\{database\}/\{table\}', '\{replica\}'", sql), sql
    # One Distributed table per table, sharded by its row identity.
    for table, key in SHARD_KEYS.items():
        dist = [s for s in creates if f".{table}_dist " in s]
        assert len(dist) == 1, table
        assert f"ENGINE = Distributed('prod', 'gl', '{table}', {key})" in dist[0]
    assert all("ON CLUSTER `prod`" in s for s in cluster if s.startswith(("ALTER", "CREATE")))
    assert [s for s in cluster if "MODIFY TTL" in s] and all("INTERVAL 14 DAY" in s for s in cluster if "MODIFY TTL" in s)
    # Single node: the same tables, no cluster constructs; no template placeholder left anywhere.
    assert not any("ON CLUSTER" in s or "Replicated" in s or "Distributed" in s for s in single)
    for sql in single + cluster:
        leftovers = set(re.findall(r"\{(\w+)\}", sql)) - {"shard", "database", "table", "replica"}
        assert not leftovers, (leftovers, sql)


def test_cli_prints_the_cluster_sql_without_connecting(tmp_path):
    env = {**os.environ, "GPULEDGER_DATA_DIR": str(tmp_path), "GPULEDGER_CLICKHOUSE_DSN": "http://127.0.0.1:9/nothing-listens-here",
           "GPULEDGER_CLICKHOUSE_TTL_DAYS": "30"}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "db", "migrate", "--cluster", "prod", "--print"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CREATE TABLE IF NOT EXISTS `gpuledger`.release_history ON CLUSTER `prod`" in out.stdout
    assert "ENGINE = Distributed('prod', 'gpuledger', 'workload_timeline', cityHash64(workload_id))" in out.stdout
    assert "MODIFY TTL occurred_at + INTERVAL 30 DAY" in out.stdout
    assert out.stdout.count(";\n") == len(rendered("gpuledger", "prod", 30))


def test_cli_db_migrate_and_status(clickhouse_dsn, clickhouse_db, tmp_path):
    from typer.testing import CliRunner

    from gpuledger.cli import app

    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": clickhouse_db, "GPULEDGER_DATA_DIR": str(tmp_path)}
    runner = CliRunner()
    first = runner.invoke(app, ["db", "migrate"], env=env)
    assert first.exit_code == 0 and first.stdout.strip() == f"applied {[m.version for m in MIGRATIONS]}", first.output
    assert runner.invoke(app, ["db", "migrate"], env=env).stdout.strip() == "schema up to date"
    status = runner.invoke(app, ["db", "status"], env=env)
    assert status.exit_code == 0, status.output
    assert all(f"migration {m.version}\tapplied" in status.stdout for m in MIGRATIONS)
    assert f"{clickhouse_db}.release_history\t0 rows" in status.stdout


def test_a_store_written_before_migrations_6_and_7_upgrades_and_its_rows_read_as_they_were(clickhouse_client, clickhouse_db, monkeypatch):
    """A store migrated to 5 and written to (the intake then dropped ``named_release_id`` and
    ``environment_labelled``), then migrated by this version: 6 and 7 are applied; its rows read as
    they were, with the new columns as a record without those fields says (named release '',
    environment labelled NULL: judged as a worker's before them). Records stored after it keep both
    fields, their typed columns are the same as before, and a count out of range is refused."""
    import asyncio

    import orjson

    import sinks.migrations as migrations
    from sinks.agents import SinkWriters

    def record(cid: str, event_type: str, identity: dict, payload: dict, **fields) -> bytes:
        return orjson.dumps({"correlation_id": cid, "version": 1, "event_type": event_type, "occurred_at": "2026-11-01T00:00:00Z",
                             "attribution": "image_digest_fallback", "identity": identity, "source_topic": "t.correlated.v1",
                             "source_partition": 0, "source_offset": 1, "payload_json": orjson.dumps(payload).decode(), **fields})

    def batch(prefix: str) -> list[bytes]:
        return [record(f"{prefix}-admitted", "scheduler.admitted", {"workload_id": "ml/Job/j", "release_id": "rel-1"}, {"gpus_requested": 2},
                       named_release_id="rel-typo", environment_labelled=False),
                record(f"{prefix}-labelled", "scheduler.scheduled", {"workload_id": "ml/Job/k", "environment": "prod"}, {},
                       environment_labelled=True),
                record(f"{prefix}-reserved", "release.reservation_created", {"release_id": "rel-1"}, {"reservation": {"gpus": 8}})]

    db = clickhouse_db
    monkeypatch.setattr(migrations, "MIGRATIONS", tuple(m for m in MIGRATIONS if m.version <= 5))
    assert migrate(clickhouse_client, db) == [1, 2, 3, 4, 5]
    assert asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(batch("old"))) == []
    monkeypatch.undo()
    assert migrate(clickhouse_client, db) == [6, 7]
    assert asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(batch("new"))) == []
    q = clickhouse_client.query
    assert q(f"SELECT correlation_id, named_release_id, environment_labelled FROM `{db}`.correlated_events FINAL ORDER BY 1").result_rows == [
        ("new-admitted", "rel-typo", False), ("new-labelled", "", True), ("new-reserved", "", None),
        ("old-admitted", "", None), ("old-labelled", "", None), ("old-reserved", "", None)]
    assert q(f"SELECT correlation_id, gpus_requested FROM `{db}`.workload_timeline FINAL ORDER BY 1").result_rows == [
        ("new-admitted", 2), ("new-labelled", None), ("old-admitted", 2), ("old-labelled", None)]
    assert q(f"SELECT correlation_id, reservation_gpus FROM `{db}`.release_history FINAL ORDER BY 1").result_rows == [
        ("new-reserved", 8), ("old-reserved", 8)]
    refused = asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(
        [record("new-negative", "release.reservation_created", {"release_id": "rel-1"}, {"reservation": {"gpus": -1}})]))
    assert [(r.stage, r.code) for r in refused] == [("sinks.release_history", 395)]
    assert q(f"SELECT count() FROM `{db}`.correlated_events WHERE correlation_id = 'new-negative'").result_rows == [(0,)]
