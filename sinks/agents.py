"""Sink agents: Faust agents that insert output and raw topics into ClickHouse in batches.

Input: the correlated, allocations, dead-letter and raw topics (and violations, when
the app passes that topic). Output: one columnar insert per table per batch —
correlated → ``correlated_events`` + ``release_history`` / ``workload_timeline`` /
``enriched_alerts`` by family; allocations → ``gpu_allocations``; raw →
``raw_events``; dead letters → ``dead_letters``; violations → ``violations``.
Batches close at ``GPULEDGER_CLICKHOUSE_BATCH_ROWS`` records or after
``GPULEDGER_CLICKHOUSE_BATCH_SECONDS``, whichever comes first.

Guarantees: ``take_events`` acks a batch's offsets only after the body returned, and
the body returns only after every insert of the batch succeeded (``TableWriter.write``
retries with back-off, reconnecting through one shared ``StoreConnection``) — so while
ClickHouse is down the agents stop consuming, and a crash re-delivers into idempotent
tables. The batch logic lives in ``SinkWriters`` (plain async methods) so it can be
driven without Faust.
"""

from __future__ import annotations

import logging

from gpuledger.telemetry import ComponentCounters
from schemas import CorrelatedEvent, DeadLetter, GpuAllocation, Violation
from sinks.allocations import GPU_ALLOCATION_COLUMNS, VIOLATION_COLUMNS, allocation_rows, violation_rows
from sinks.clickhouse import StoreConnection
from sinks.correlated import (
    CORRELATED_COLUMNS,
    DEAD_LETTER_COLUMNS,
    ENRICHED_ALERT_COLUMNS,
    RELEASE_HISTORY_COLUMNS,
    WORKLOAD_TIMELINE_COLUMNS,
    TableWriter,
    dead_letter_rows,
    family_rows,
)
from sinks.migrations import table_name
from sinks.raw import RAW_EVENT_COLUMNS, NotAnEnvelope, raw_event_row

log = logging.getLogger(__name__)

#: table -> insert columns. Order of the correlated family matters: the source of
#: truth first, so a crash between inserts leaves the derived tables behind, never ahead.
CORRELATED_FAMILY = {
    "correlated_events": CORRELATED_COLUMNS,
    "release_history": RELEASE_HISTORY_COLUMNS,
    "workload_timeline": WORKLOAD_TIMELINE_COLUMNS,
    "enriched_alerts": ENRICHED_ALERT_COLUMNS,
}


class SinkWriters:
    """One TableWriter per table over one shared (lazy) store connection."""

    def __init__(self, store, database: str, cluster: str | None = None, max_backoff_s: float = 10.0,
                 initial_backoff_s: float = 0.2) -> None:
        self.store = StoreConnection.of(store)
        self.counters = ComponentCounters("sinks")
        insert_settings = {"insert_distributed_sync": 1} if cluster else None

        def writer(table: str, columns) -> TableWriter:
            return TableWriter(self.store, database, table_name(table, cluster), columns, f"sinks.{table}",
                               max_backoff_s=max_backoff_s, initial_backoff_s=initial_backoff_s, insert_settings=insert_settings)

        self.writers = {table: writer(table, cols) for table, cols in CORRELATED_FAMILY.items()}
        self.writers["gpu_allocations"] = writer("gpu_allocations", GPU_ALLOCATION_COLUMNS)
        self.writers["raw_events"] = writer("raw_events", RAW_EVENT_COLUMNS)
        self.writers["dead_letters"] = writer("dead_letters", DEAD_LETTER_COLUMNS)
        self.writers["violations"] = writer("violations", VIOLATION_COLUMNS)

    async def store_correlated(self, batch: list[CorrelatedEvent]) -> None:
        rows = family_rows(batch, self.counters)
        for table in CORRELATED_FAMILY:
            await self.writers[table].write(rows[table])

    async def store_allocations(self, batch: list[GpuAllocation]) -> None:
        await self.writers["gpu_allocations"].write(allocation_rows(batch))

    async def store_violations(self, batch: list[Violation]) -> None:
        await self.writers["violations"].write(violation_rows(batch))

    async def store_dead_letters(self, batch: list[DeadLetter]) -> None:
        await self.writers["dead_letters"].write(dead_letter_rows(batch))

    async def store_raw(self, records: list[tuple[bytes, str, int, int]]) -> int:
        """Insert raw records (value, topic, partition, offset); return how many were skipped."""
        rows, skipped = [], 0
        for value, topic, partition, offset in records:
            try:
                rows.append(raw_event_row(value, topic, partition, offset))
            except NotAnEnvelope:
                skipped += 1  # already dead-lettered by the correlate stage, with the reason
        if skipped:
            self.counters.add_rejected("not_an_envelope", skipped)
        await self.writers["raw_events"].write(rows)
        return skipped


def install_sink_agents(app, settings, client, topics: dict, ctx) -> SinkWriters:
    """Register the sink agents on ``app``. ``topics`` maps role -> faust topic
    (correlated, deadletter, allocations, raw; violations when present). ``client`` is
    an open client or a ``StoreConnection``; ``ctx`` the worker's context (its one
    producer writes the dead letters, its stats count what was stored)."""
    from schemas import encode_event
    from schemas.outputs import dead_letter
    from sinks.migrations import apply_ttl

    async def send_dead(letter: DeadLetter, key) -> None:
        ctx.output.produce(ctx.run.deadletter, key, encode_event(letter))
        await ctx.output.flush()

    conf = settings.clickhouse
    db = conf.database
    rows_max, within = conf.batch_rows, conf.batch_seconds
    store = StoreConnection.of(client)
    if store.connected:
        # Retention is configuration: keep it in step at every start (a no-op when unchanged).
        apply_ttl(store.get(), db, conf.ttl_days, conf.cluster)
    sinks = SinkWriters(store, db, conf.cluster)
    ctx.sinks = sinks
    stats = ctx.stats
    for key in ("stored", "allocations_stored", "raw_stored", "raw_skipped", "violations_stored"):
        stats.setdefault(key, 0)

    async def decode_all(events, model, stage: str) -> list:
        batch = []
        for ev in events:
            try:
                batch.append(model.model_validate_json(ev.message.value))
            except Exception as exc:  # noqa: BLE001 - keep the sink going; the record is dead-lettered
                msg = ev.message
                await send_dead(dead_letter("validation", str(exc), stage, msg.topic, msg.partition, msg.offset, msg.key, msg.value), msg.key)
        return batch

    @app.agent(topics["correlated"], name="store_correlated")
    async def store_correlated(stream):
        async for events in stream.take_events(rows_max, within=within):
            batch = await decode_all(events, CorrelatedEvent, "sinks.store_correlated")
            await sinks.store_correlated(batch)
            stats["stored"] += len(batch)

    @app.agent(topics["deadletter"], name="store_dead_letters")
    async def store_dead_letters(stream):
        async for events in stream.take_events(rows_max, within=within):
            batch = []
            for ev in events:
                try:
                    batch.append(DeadLetter.model_validate_json(ev.message.value))
                except Exception:  # noqa: BLE001 - a dead letter about a dead letter would loop
                    log.error("unreadable dead letter at %s[%d]@%d skipped", ev.message.topic, ev.message.partition, ev.message.offset)
            await sinks.store_dead_letters(batch)

    if "allocations" in topics:
        @app.agent(topics["allocations"], name="store_allocations")
        async def store_allocations(stream):
            async for events in stream.take_events(rows_max, within=within):
                batch = await decode_all(events, GpuAllocation, "sinks.store_allocations")
                await sinks.store_allocations(batch)
                stats["allocations_stored"] += len(batch)

    if "raw" in topics:
        @app.agent(topics["raw"], name="store_raw_events")
        async def store_raw_events(stream):
            async for events in stream.take_events(rows_max, within=within):
                records = [(ev.message.value, ev.message.topic, ev.message.partition, ev.message.offset) for ev in events]
                skipped = await sinks.store_raw(records)
                stats["raw_stored"] += len(records) - skipped
                stats["raw_skipped"] += skipped

    if "violations" in topics:
        @app.agent(topics["violations"], name="store_violations")
        async def store_violations(stream):
            async for events in stream.take_events(rows_max, within=within):
                batch = await decode_all(events, Violation, "sinks.store_violations")
                await sinks.store_violations(batch)
                stats["violations_stored"] += len(batch)

    return sinks
