"""sinks/checksum.py against real ClickHouse: the same rows in any order, batching or
re-delivery give the same checksums; a changed value or a missing row does not."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from schemas import DeadLetter
from sinks.agents import SinkWriters
from sinks.checksum import differing, table_checksums
from sinks.migrations import migrate, table_names
from tests.sinks import incident as inc

REPO = Path(__file__).resolve().parents[2]


def _dead_letters(failed_at: datetime) -> list[DeadLetter]:
    return [DeadLetter(reason="not_json", error="not JSON", stage="streams.route_events", source_topic="t.alert.v1",
                       source_partition=0, source_offset=i, key=f"k{i}", value="{oops", failed_at=failed_at) for i in range(3)]


def _store(client, batches) -> str:
    """A fresh migrated database holding ``batches`` (coroutines on its writers), in order."""
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(client, db)
    writers = SinkWriters(client, db)

    async def go():
        for batch in batches(writers):
            await batch
    asyncio.run(go())
    return db


def _chunks(rows: list, size: int) -> list[list]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def test_same_rows_in_any_order_give_the_same_checksums(clickhouse_client):
    correlated, allocations = inc.correlated_rows(), inc.allocation_rows()
    now = datetime.now(timezone.utc)

    def in_one_go(w):
        yield w.store_correlated(correlated)
        yield w.store_allocations(allocations)
        yield w.store_dead_letters(_dead_letters(now))

    def reversed_in_small_batches_with_a_redelivery(w):
        # Another order, other batches, a re-delivered batch (same versions), dead
        # letters rejected at another (wall-clock) time: none of it is content.
        yield w.store_dead_letters(_dead_letters(now + timedelta(hours=1)))
        for batch in _chunks(list(reversed(allocations)), 3):
            yield w.store_allocations(batch)
        for batch in _chunks(list(reversed(correlated)), 4):
            yield w.store_correlated(batch)
        yield w.store_correlated(correlated[:5])

    a = table_checksums(clickhouse_client, _store(clickhouse_client, in_one_go))
    b = table_checksums(clickhouse_client, _store(clickhouse_client, reversed_in_small_batches_with_a_redelivery))
    assert set(a) == set(table_names()), "every gpuledger table, no bookkeeping"
    assert a["correlated_events"][0] == len(inc.latest(correlated)), "rows as readers see them (FINAL)"
    assert a["dead_letters"][0] == 3
    assert a == b
    assert differing(a, b) == []


def test_a_changed_value_or_a_missing_row_changes_the_checksum(clickhouse_client):
    correlated = inc.correlated_rows()
    base = table_checksums(clickhouse_client, _store(clickhouse_client, lambda w: [w.store_correlated(correlated)]))

    changed = [correlated[0].model_copy(update={"summary": correlated[0].summary + "!"}), *correlated[1:]]
    other = table_checksums(clickhouse_client, _store(clickhouse_client, lambda w: [w.store_correlated(changed)]))
    assert other["correlated_events"][0] == base["correlated_events"][0]
    assert other["correlated_events"][1] != base["correlated_events"][1]
    assert "correlated_events" in differing(base, other)

    # The same content reached through one more version: different, unless version is left out.
    bumped = [r.model_copy(update={"version": r.version + 1}) for r in correlated]
    db_base = _store(clickhouse_client, lambda w: [w.store_correlated(correlated)])
    db_bumped = _store(clickhouse_client, lambda w: [w.store_correlated(bumped)])
    assert "correlated_events" in differing(table_checksums(clickhouse_client, db_base), table_checksums(clickhouse_client, db_bumped))
    assert differing(table_checksums(clickhouse_client, db_base, exclude=["version"]),
                     table_checksums(clickhouse_client, db_bumped, exclude=["version"])) == []

    latest = inc.latest(correlated)
    fewer = [r for r in correlated if r.correlation_id != next(iter(latest))]
    missing = table_checksums(clickhouse_client, _store(clickhouse_client, lambda w: [w.store_correlated(fewer)]))
    assert missing["correlated_events"][0] == base["correlated_events"][0] - 1
    assert "correlated_events" in differing(base, missing)


def _incident_store(tmp_path, database: str) -> str:
    """The incident's correlated rows in an embedded store of their own, in ``database``, written by
    another process (a chDB directory per process); its DSN."""
    dsn = f"chdb://{tmp_path / 'store'}"
    script = ("import asyncio; from sinks.clickhouse import connect; from sinks.migrations import migrate; "
              "from sinks.agents import SinkWriters; from tests.sinks import incident as inc; "
              f"c = connect({dsn!r}, {database!r}); migrate(c, {database!r}); "
              f"asyncio.run(SinkWriters(c, {database!r}).store_correlated(inc.correlated_rows()))")
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=120)
    return dsn


def test_command_prints_the_checksums_of_a_store_it_opens(tmp_path):
    # A chDB directory per process: the command is how a process that already holds one
    # (the bench) reads another store.
    dsn = _incident_store(tmp_path, "gpuledger")
    out = subprocess.run([sys.executable, "-m", "sinks.checksum", dsn], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sums = json.loads(out.stdout)
    assert sums["correlated_events"][0] == len(inc.latest(inc.correlated_rows()))
    assert sums["gpu_allocations"] == [0, 0]


def test_command_reads_the_database_the_readers_setting_names(tmp_path):
    """A sandbox replayed with --database is read with GPULEDGER_CLICKHOUSE_DATABASE set, as trace and
    sql read it (docs/operations.md); the command read 'gpuledger' regardless (docs review)."""
    import os

    dsn = _incident_store(tmp_path, "pm")
    out = subprocess.run([sys.executable, "-m", "sinks.checksum", dsn], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GPULEDGER_CLICKHOUSE_DATABASE": "pm"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["correlated_events"][0] == len(inc.latest(inc.correlated_rows()))



def test_a_withdrawn_allocations_tombstone_is_not_content(clickhouse_client):
    """A run that read a holding's later assignment first stored an allocation under it, then withdrew it
    (``end_reason`` withdrawn, closed at its start); a run that read them in order never did. Both stores
    hold what readers see alike: the checksums leave the tombstone out (as the withdrawn violations')."""
    allocations = inc.allocation_rows()
    without = [a for a in allocations if a.allocation_id != inc.GHOST]
    assert len(without) == len(allocations) - 2
    a = table_checksums(clickhouse_client, _store(clickhouse_client, lambda w: [w.store_allocations(allocations)]))
    b = table_checksums(clickhouse_client, _store(clickhouse_client, lambda w: [w.store_allocations(without)]))
    assert a["gpu_allocations"] == b["gpu_allocations"] and a["gpu_allocations"][0] == 3
    # the withdrawal supersedes the open interval it went out as: without it, that one is content
    opened = table_checksums(clickhouse_client, _store(clickhouse_client, lambda w: [w.store_allocations(allocations[:-1])]))
    assert opened["gpu_allocations"][0] == 4 and "gpu_allocations" in differing(opened, b)
