"""Sink agents: Faust agents that insert topics into ClickHouse in batches.

Input: the correlated, dead-letter (and further output) topics. Output: one
columnar insert per table per batch. Guarantees: ``take_events`` acks a batch's
offsets only after the body returned, and the body returns only after the insert
succeeded (``TableWriter.write`` retries with back-off) — so while ClickHouse is
down the agent stops consuming, and a crash re-delivers into idempotent tables.
"""

from __future__ import annotations

import logging

from schemas import CorrelatedEvent, DeadLetter
from sinks.correlated import CORRELATED_COLUMNS, DEAD_LETTER_COLUMNS, TableWriter, correlated_rows, dead_letter_rows

log = logging.getLogger(__name__)


def install_sink_agents(app, settings, client, topics: dict, send_dead) -> None:
    """Register the sink agents on ``app``. ``topics`` maps role -> faust topic."""
    from streams.app import dead_letter

    db = settings.clickhouse.database
    rows_max, within = settings.clickhouse.batch_rows, settings.clickhouse.batch_seconds
    correlated_writer = TableWriter(client, db, "correlated_events", CORRELATED_COLUMNS, "sinks.correlated")
    dead_writer = TableWriter(client, db, "dead_letters", DEAD_LETTER_COLUMNS, "sinks.dead_letters")

    @app.agent(topics["correlated"], name="store_correlated")
    async def store_correlated(stream):
        async for events in stream.take_events(rows_max, within=within):
            batch = []
            for ev in events:
                try:
                    batch.append(CorrelatedEvent.model_validate_json(ev.message.value))
                except Exception as exc:  # noqa: BLE001 - keep the sink going; the record is dead-lettered
                    await send_dead(dead_letter("validation", str(exc), "sinks.store_correlated", ev.message), ev.message.key)
            await correlated_writer.write(correlated_rows(batch))
            app.gpuledger_stats["stored"] += len(batch)

    @app.agent(topics["deadletter"], name="store_dead_letters")
    async def store_dead_letters(stream):
        async for events in stream.take_events(rows_max, within=within):
            batch = []
            for ev in events:
                try:
                    batch.append(DeadLetter.model_validate_json(ev.message.value))
                except Exception:  # noqa: BLE001 - a dead letter about a dead letter would loop
                    log.error("unreadable dead letter at %s[%d]@%d skipped", ev.message.topic, ev.message.partition, ev.message.offset)
            await dead_writer.write(dead_letter_rows(batch))
