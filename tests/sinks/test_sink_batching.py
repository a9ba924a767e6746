"""The sink's batches close as ``BatchClock`` says, against the real broker and store: records
taken are stored and committed together — raw events alone wait for the idle window (taken,
neither stored nor committed), a correlated record closes the batch they ride in, and a clean
stop stores what was taken."""

from __future__ import annotations

import asyncio
import contextlib

from confluent_kafka import Consumer, Producer, TopicPartition

from gpuledger.settings import ClickHouseSettings
from producers._kafka import EventPublisher
from schemas import encode_event
from tests.fixtures.waiting import until
from tests.sinks.incident import release_rows
from tests.streams.harness import release


def _count(store, db: str, table: str) -> int:
    return int(store.get().command(f"SELECT count() FROM `{db}`.{table}"))


def _committed(settings, topics: list[str]) -> int:
    """The records the sink group has committed on ``topics``, all partitions together."""
    consumer = Consumer({"bootstrap.servers": settings.kafka.bootstrap, "group.id": f"{settings.streams.app_id}.sinks"})
    try:
        parts = [TopicPartition(t, p) for t in topics for p in consumer.list_topics(t, timeout=10).topics[t].partitions]
        return sum(max(tp.offset, 0) for tp in consumer.committed(parts, timeout=10))
    finally:
        consumer.close()


@contextlib.asynccontextmanager
async def _running_sink(settings, db: str):
    """A sink over ``settings``'s topics and store, running; on the way out, cancelled (as a crash
    would leave it) unless the body stopped it."""
    from sinks.clickhouse import migrated_store
    from sinks.service import SinkContext, build_sink

    ctx = SinkContext(settings)
    store = migrated_store(settings.clickhouse_dsn, db, None, None)
    loop = build_sink(settings, ctx, store)
    task = asyncio.ensure_future(loop.run())
    try:
        yield loop, task, store
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        ctx.output.close()
        store.discard(store.get())


def test_raw_events_ride_with_the_next_correlated_burst_and_a_clean_stop_stores_what_was_taken(catalogue, settings_for, clickhouse_dsn,
                                                                                                 clickhouse_db):
    from streams.app import ensure_run_topics

    # An idle window of an hour: raw events alone are never stored on time, only with a correlated batch or at a stop.
    settings = settings_for(catalogue, clickhouse=ClickHouseSettings(dsn=clickhouse_dsn, database=clickhouse_db, batch_seconds=0.1,
                                                                      batch_quiet_seconds=0.1, batch_idle_seconds=3600))
    ensure_run_topics(settings)
    run = catalogue.run(settings.streams.app_id)
    raw_topics = list(catalogue.raw_topics)

    def publish_raw(first: int, n: int) -> int:
        publisher = EventPublisher({"bootstrap.servers": settings.kafka.bootstrap}, catalogue, "test")
        assert publisher.publish_batch([release("release.registered", k, rid=f"bat-{k}") for k in range(first, first + n)]) == n
        publisher.close(10)
        return n

    async def scenario(raw_before: int, correlated: list) -> None:
        async with _running_sink(settings, clickhouse_db) as (loop, _task, store):
            await until("the raw records taken", lambda: len(loop.batch) == raw_before)
            assert _count(store, clickhouse_db, "raw_events") == 0 and _committed(settings, raw_topics) == 0
            producer = Producer({"bootstrap.servers": settings.kafka.bootstrap})
            for row in correlated:
                producer.produce(run.correlated, encode_event(row), row.correlation_id.encode())
            assert producer.flush(10) == 0
            await until("the correlated rows stored", lambda: _count(store, clickhouse_db, "correlated_events") >= len(correlated))
            # the raw events taken before rode in the same batch: stored, and committed with it
            await until("the batch committed", lambda: _committed(settings, [run.correlated]) == len(correlated))
            assert _count(store, clickhouse_db, "raw_events") == raw_before and loop.batch == []
            assert _committed(settings, raw_topics) == raw_before

    rows = release_rows()
    asyncio.run(scenario(publish_raw(0, 6), rows))
    # More raw events, no correlated record: taken and held; a clean stop stores and commits them.
    more = publish_raw(6, 4)

    async def stopping() -> None:
        async with _running_sink(settings, clickhouse_db) as (loop, task, store):
            await until("the new raw records taken", lambda: len(loop.batch) == more)
            assert _count(store, clickhouse_db, "raw_events") == 6 and _committed(settings, raw_topics) == 6
            await loop.stop()
            await asyncio.wait_for(task, 30)
            assert _count(store, clickhouse_db, "raw_events") == 6 + more and _committed(settings, raw_topics) == 6 + more

    asyncio.run(stopping())
