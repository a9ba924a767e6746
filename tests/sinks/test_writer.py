"""sinks/writer.py (+ SinkWriters, StoreConnection, migrated_store) against real ClickHouse:
rejected rows are split off and dead-lettered, outages are held and logged per state
change, and the worker's lazy store migrates on its first successful connect."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import orjson
import pytest

from gpuledger.dev.process import free_port
from schemas import encode_event
from sinks.agents import SinkWriters
from sinks.clickhouse import StoreConnection, connect, migrated_store
from sinks.migrations import MIGRATIONS, migrate
from sinks.read.query import run_readonly
from sinks.writer import RecordSource, RejectedRow, TableWriter
from tests.sinks import incident as inc

TOPIC = "gl.correlated.v1"
FAST = {"initial_backoff_s": 0.01, "max_backoff_s": 0.05}


def _count(client, table: str, where: str = "1") -> int:
    return client.query(f"SELECT count() FROM {table} FINAL WHERE {where}").result_rows[0][0]


def _bounded(client, db: str) -> str:
    """A table whose CHECK constraint ClickHouse itself enforces (server-side rejection)."""
    table = f"{db}.bounded"
    client.command(f"CREATE TABLE {table} (id UInt32, gpus UInt32, CONSTRAINT gpus_fit CHECK gpus <= 64) "
                   "ENGINE = ReplacingMergeTree ORDER BY id")
    return table


def _records(rows):
    return [RecordSource(TOPIC, 3, 100 + i, f"k{i}".encode(), encode_event(row)) for i, row in enumerate(rows)]


def test_a_poison_row_is_dead_lettered_and_the_rest_of_its_batch_stored(clickhouse_client, clickhouse_db):
    """A release event whose reservation asks for -5 GPUs: the intake's view refuses it, before
    any table's view sees it (reservation_gpus is Nullable(UInt32): refused by name, not wrapped
    around). The other records are stored in every table, the bad one in none, and it comes back
    named after the table whose column it did not fit, with ClickHouse's error, a hint and its
    Kafka record."""
    migrate(clickhouse_client, clickhouse_db)
    releases = inc.release_rows()
    poison = releases[3].model_copy(update={"correlation_id": "poison-1",
                                            "payload_json": orjson.dumps({"reservation": {"gpus": -5}}).decode()})
    batch = [*releases[:5], poison, *releases[5:]]
    sources = _records(batch)
    handed: list[RejectedRow] = []

    async def on_rejected(row: RejectedRow) -> None:
        handed.append(row)

    writers = SinkWriters(clickhouse_client, clickhouse_db, on_rejected=on_rejected, **FAST)
    rejected = asyncio.run(writers.store_correlated(batch, sources))

    assert rejected == handed and len(handed) == 1
    bad = handed[0]
    assert bad.table == f"{clickhouse_db}.release_history" and bad.stage == "sinks.release_history"
    assert "reservation_gpus: out of the range of UInt32" in bad.error and "correlated_fields_mv" in bad.error and bad.code == 395 and bad.hint
    assert bad.source == sources[5] and orjson.loads(bad.row[0])["correlation_id"] == "poison-1"
    history = f"{clickhouse_db}.release_history"
    assert _count(clickhouse_client, history) == len(inc.latest(releases))  # every other row stored
    assert _count(clickhouse_client, history, "correlation_id = 'poison-1'") == 0
    assert _count(clickhouse_client, f"{clickhouse_db}.correlated_events", "correlation_id != 'poison-1'") == len(inc.latest(releases))
    assert _count(clickhouse_client, f"{clickhouse_db}.correlated_events", "correlation_id = 'poison-1'") == 0
    writer = writers.writers["correlated_events"]
    assert writer.rows_rejected == 1 and writer.counters.totals["rejected.store_rejected"] == 1 and writer.failures == 0

    letter = bad.dead_letter()
    assert (letter.reason, letter.stage, letter.source_topic, letter.source_partition, letter.source_offset, letter.key) == (
        "store_rejected", "sinks.release_history", TOPIC, 3, 105, "k5")
    assert letter.value == encode_event(poison).decode() and "reservation_gpus" in letter.error and "Hint:" in letter.error
    # The dead letter fits the project's dead_letters table.
    assert asyncio.run(writers.store_dead_letters([letter])) == []
    stored = clickhouse_client.query(
        f"SELECT reason, stage, source_topic, source_offset FROM `{clickhouse_db}`.dead_letters FINAL").result_rows
    assert stored == [("store_rejected", "sinks.release_history", TOPIC, 105)]


def test_rows_clickhouse_rejects_are_found_by_bisecting(clickhouse_client, clickhouse_db, caplog):
    """Server-side rejection (Code 469, a violated CHECK): the writer bisects down to the
    two bad rows, stores the other eight, and the driver's per-attempt ERROR lines stay
    out of the log."""
    table = _bounded(clickhouse_client, clickhouse_db)
    writer = TableWriter(clickhouse_client, clickhouse_db, "bounded", ["id", "gpus"], "sinks.bounded", **FAST)
    rows = [[i, 1000 if i in (3, 7) else i] for i in range(10)]
    with caplog.at_level(logging.INFO):
        rejected = asyncio.run(writer.write(rows))
    assert sorted(r.row[0] for r in rejected) == [3, 7]
    assert all(r.code == 469 and "VIOLATED_CONSTRAINT" in r.error and r.source is None for r in rejected)
    assert _count(clickhouse_client, table) == 8 and writer.rows_written == 8
    assert 2 < writer.attempts < len(rows) * 2  # bisected, not row by row
    driver = [r for r in caplog.records if r.levelno >= logging.WARNING and not r.name.startswith("sinks.")]
    assert driver == [], [r.getMessage() for r in driver]
    assert [r.levelname for r in caplog.records if r.name == "sinks.writer"] == ["WARNING"]  # one line for the batch


def test_a_column_set_the_table_lacks_rejects_the_batch_at_once(clickhouse_client, clickhouse_db):
    _bounded(clickhouse_client, clickhouse_db)
    writer = TableWriter(clickhouse_client, clickhouse_db, "bounded", ["id", "no_such_column"], "sinks.bounded", **FAST)
    rejected = asyncio.run(writer.write([[i, i] for i in range(6)], [RecordSource("t", 0, i) for i in range(6)]))
    assert [r.source.offset for r in rejected] == list(range(6))
    assert writer.attempts == 1 and "db migrate" in rejected[0].hint


def test_an_unreachable_store_is_retried_and_logged_once_per_state_change(clickhouse_client, clickhouse_db, caplog):
    """Five real refused connections, then the store: the write is held and completes, and
    the log has one failure line and one recovery line per component, not one per attempt."""
    dead = f"http://127.0.0.1:{free_port()}/"
    table = _bounded(clickhouse_client, clickhouse_db)
    tries: list[int] = []

    def factory():
        tries.append(1)
        return connect(dead, clickhouse_db) if len(tries) <= 5 else clickhouse_client  # connection refused, 5 times

    store = StoreConnection(factory, description="flaky")
    writer = TableWriter(store, clickhouse_db, "bounded", ["id", "gpus"], "sinks.bounded", **FAST)
    with caplog.at_level(logging.INFO):
        assert asyncio.run(writer.write([[1, 1], [2, 2]])) == []
    assert _count(clickhouse_client, table) == 2 and writer.failures == 5 and store.connect_attempts == 6

    def lines(logger: str, level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]

    for logger, subject in (("sinks.writer", f"writes into {table}"), ("sinks.clickhouse", "connecting to flaky")):
        assert len(lines(logger, logging.WARNING)) == 1 and lines(logger, logging.WARNING)[0].startswith(f"{subject} failing")
        assert "Connection refused" in lines(logger, logging.WARNING)[0]
        recovered = [m for m in lines(logger, logging.INFO) if "reachable again" in m]
        assert len(recovered) == 1 and "after 6 attempts" in recovered[0], lines(logger, logging.INFO)
    # urllib3's "Retrying ..." and clickhouse-connect's "Unexpected Http Driver Exception",
    # once per attempt, are demoted to DEBUG.
    driver = [r for r in caplog.records if r.levelno >= logging.WARNING and not r.name.startswith("sinks.")]
    assert driver == [], [f"{r.name}: {r.getMessage()}" for r in driver]


def test_a_long_outage_adds_one_summary_line_a_minute(clickhouse_client, caplog):
    """Real refused connects on a fake clock: 11 attempts over 150 s give the first
    failure, summaries at 60 s and 120 s, and the recovery with the totals."""
    dead = f"http://127.0.0.1:{free_port()}/"
    now = [0.0]
    up = [False]
    store = StoreConnection(lambda: clickhouse_client if up[0] else connect(dead, "x"), description="server",
                            clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="sinks.clickhouse"):
        for _ in range(10):
            with pytest.raises(Exception, match="Connection refused"):
                store.get()
            now[0] += 15
        up[0] = True
        assert store.get() is clickhouse_client
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "sinks.clickhouse"]
    assert [level for level, _ in lines] == ["WARNING", "WARNING", "WARNING", "INFO"], lines
    assert "still failing: 5 attempts in 60 s" in lines[1][1] and "still failing: 9 attempts in 120 s" in lines[2][1]
    assert lines[3][1] == "connecting to server: store reachable again after 11 attempts, 150.0 s"


def test_a_retriable_server_error_holds_the_batch_until_it_clears(clickhouse_client, clickhouse_dsn, clickhouse_db):
    """The table does not exist yet (Code 60, UNKNOWN_TABLE): the rows are fine, so the
    write is held — not dead-lettered — and completes once the table is created."""
    writer = TableWriter(clickhouse_client, clickhouse_db, "bounded", ["id", "gpus"], "sinks.bounded",
                         initial_backoff_s=0.02, max_backoff_s=0.1)

    async def scenario() -> list[RejectedRow]:
        task = asyncio.create_task(writer.write([[1, 1], [2, 2], [3, 3]]))
        deadline = time.monotonic() + 30
        while writer.failures < 2:  # held: retried, not returned
            assert not task.done(), task.result()
            assert time.monotonic() < deadline, "the writer never retried"
            await asyncio.sleep(0.01)
        ddl = connect(clickhouse_dsn, clickhouse_db, create=False)  # its own connection: the writer's may be mid-insert
        await asyncio.to_thread(_bounded, ddl, clickhouse_db)
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(scenario()) == []
    assert _count(clickhouse_client, f"{clickhouse_db}.bounded") == 3 and writer.rows_rejected == 0


def test_the_worker_store_is_lazy_and_migrates_on_its_first_connect(clickhouse_client, clickhouse_dsn):
    """migrated_store opens nothing when built (a worker can start while the store is
    down); the first write connects, migrates, applies the TTL, then inserts."""
    db = f"t_lazy_{uuid.uuid4().hex[:12]}"
    store = migrated_store(clickhouse_dsn, db, ttl_days=30)
    assert not store.connected and store.connect_attempts == 0
    assert _databases(clickhouse_client, db) == []
    writers = SinkWriters(store, db, **FAST)
    assert asyncio.run(writers.store_correlated(inc.correlated_rows())) == []
    assert store.connected and store.connect_attempts == 1
    applied = clickhouse_client.query(f"SELECT version FROM `{db}`.schema_migrations FINAL ORDER BY version").result_rows
    assert [v for (v,) in applied] == [m.version for m in MIGRATIONS]
    engine = clickhouse_client.query("SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = 'correlated_events'",
                                     parameters={"db": db}).result_rows[0][0]
    assert "TTL occurred_at + toIntervalDay(30)" in engine
    assert _count(clickhouse_client, f"`{db}`.correlated_events") == len(inc.latest(inc.correlated_rows()))
    # The worker's query endpoint reads through the same lazy store.
    assert run_readonly(store, f"SELECT count() AS n FROM `{db}`.correlated_events FINAL").rows == [[len(inc.latest(inc.correlated_rows()))]]


def _databases(client, name: str) -> list:
    return client.query("SELECT name FROM system.databases WHERE name = {n:String}", parameters={"n": name}).result_rows


def test_dead_letters_that_name_no_source_offset_are_each_a_row(clickhouse_client, clickhouse_db):
    """Found by a review: ``dead_letters`` is keyed by (source_topic, source_partition, source_offset,
    stage), and a letter without a source offset — the edge's (a collector's events too large to
    travel, a receiver's events from a newer schema), admit's, an output refused that names no
    input — is stored with -1, -1: three oversize events of the scheduler collector were one row
    (FINAL, and after a merge on disk too). Each is a row now; a letter sent again (the same event)
    and a source record dead-lettered again by the same stage are still one."""
    from datetime import datetime, timedelta, timezone

    from schemas import DeadLetter

    migrate(clickhouse_client, clickhouse_db)
    now = datetime.now(timezone.utc)
    edge = [DeadLetter(reason="event_too_large", error=f"{300_000 + i} bytes", stage="scheduler-collector", source_topic="gl.scheduler.v1",
                       key=f"ns/pod-{i}", value=f'{{"event_id": "e{i}"', failed_at=now) for i in range(3)]
    future = [DeadLetter(reason="unsupported_schema_version", error="newer", stage="receiver.releases", key=f"rel-{i}",
                         value=f'{{"schema_version": 2, "n": {i}}}', failed_at=now) for i in range(2)]
    sourced = [DeadLetter(reason="not_json", error="not JSON", stage="streams.route_events", source_topic="gl.alert.v1",
                          source_partition=0, source_offset=7, key="k", value="{oops", failed_at=now + timedelta(seconds=s)) for s in (0, 5)]
    writers = SinkWriters(clickhouse_client, clickhouse_db, **FAST)
    assert asyncio.run(writers.store_dead_letters([*edge, *future, *sourced])) == []
    assert asyncio.run(writers.store_dead_letters([edge[0].model_copy(update={"failed_at": now + timedelta(minutes=1)})])) == []
    clickhouse_client.command(f"OPTIMIZE TABLE `{clickhouse_db}`.dead_letters FINAL")
    stored = sorted(clickhouse_client.query(f"SELECT stage, key FROM `{clickhouse_db}`.dead_letters").result_rows)
    assert stored == [("receiver.releases", "rel-0"), ("receiver.releases", "rel-1"), ("scheduler-collector", "ns/pod-0"),
                      ("scheduler-collector", "ns/pod-1"), ("scheduler-collector", "ns/pod-2"), ("streams.route_events", "k")]


def test_the_sinks_stored_counts_leave_out_the_rows_the_store_rejected(clickhouse_client, clickhouse_db):
    """``allocations_stored`` (and ``violations_stored``) on the worker's health page counted every
    decoded record, the rows the store refused (and dead-lettered) too (exact-or-loud review)."""
    import collections

    from benchmarks.engine_cpu import Msg
    from sinks.agents import SinkLoop

    migrate(clickhouse_client, clickhouse_db)
    rejected: list[RejectedRow] = []

    async def on_rejected(row: RejectedRow) -> None:
        rejected.append(row)

    class Context:  # what SinkLoop.store reads of its process: its stats, and an output for dead letters it makes itself
        stats: collections.Counter = collections.Counter()
        output = None

    loop = SinkLoop.__new__(SinkLoop)  # the batch logic without its consumer
    loop.ctx, loop._shapes, loop.in_range = Context(), {}, lambda _at: True
    loop.sinks = SinkWriters(clickhouse_client, clickhouse_db, on_rejected=on_rejected, **FAST)
    loop.kind = {"run.allocations.v1": "allocations"}

    async def flush(mark=None):
        return None

    loop.ctx.output = type("Output", (), {"flush": staticmethod(flush)})()
    allocations = inc.allocation_rows()
    bad = {**orjson.loads(encode_event(allocations[0])), "allocation_id": "bad", "version": -1}  # version is a UInt64
    records = [Msg("run.allocations.v1", 0, i, b"k", encode_event(a)) for i, a in enumerate(allocations)]
    asyncio.run(loop.store([*records, Msg("run.allocations.v1", 0, 99, b"k", orjson.dumps(bad))]))
    assert [r.source.offset for r in rejected] == [99]
    stored = clickhouse_client.query(f"SELECT count() FROM {clickhouse_db}.gpu_allocations").result_rows[0][0]  # every version
    assert loop.ctx.stats["allocations_stored"] == len(allocations) == stored
