"""The sink: insert the raw and output topics into ClickHouse in batches (run by the
sink process, ``sinks/service.py``).

Input: the correlated, allocations, dead-letter and raw topics (and violations, when
the app passes that topic). Output: one insert per table per batch — correlated → the
records as they are into ``correlated_intake``, whose views write ``correlated_events`` +
``release_history`` / ``workload_timeline`` / ``enriched_alerts`` by family
(``sinks/migrations.py``, migrations 4, 6 and 7); allocations → ``gpu_allocations``; raw →
``raw_events`` (only the events of the run's replay range, when it has one:
``GPULEDGER_STREAMS_REPLAY_FROM/TO``); dead letters → ``dead_letters``; violations →
``violations``.
Batches close as ``BatchClock`` says: at ``GPULEDGER_CLICKHOUSE_BATCH_ROWS`` records; holding
correlated records, at the end of the correlation stage's burst (a fetch of
``GPULEDGER_CLICKHOUSE_BATCH_QUIET_SECONDS`` brings no more of them), no sooner than
``GPULEDGER_CLICKHOUSE_BATCH_SECONDS`` after the previous batch closed and no later than that
after the first of them came; holding none, ``GPULEDGER_CLICKHOUSE_BATCH_IDLE_SECONDS`` after the
previous batch closed (``SinkLoop.run``).

Guarantees: the sink consumer (``SinkLoop``, its own consumer group) commits a batch's
offsets only after every row of the batch was stored or rejected
(``TableWriter.write`` retries retriable failures with back-off, reconnecting through
one shared ``StoreConnection``) — so while ClickHouse is down the sink stops
consuming, and a crash re-delivers into idempotent tables. A row ClickHouse rejects
for its content does not stall its table: it is handed to ``on_rejected`` as a
``RejectedRow`` naming the Kafka record it came from, and the sink service sends it to the
dead-letter topic (reason ``store_rejected``, stage ``sinks.<table>``, the error and
a hint), acknowledged before the batch's offsets are committed. Rejected rows of
``dead_letters`` itself are logged at ERROR and dropped: a dead letter about a dead
letter would come back to the same table. The batch logic lives in ``SinkWriters``
(plain async methods) so it can be driven without Kafka.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

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
    dead_letter_rows,
)
from sinks.migrations import RANGE_CHECKED_COLUMNS, table_name
from sinks.raw import RAW_EVENT_COLUMNS, NotAnEnvelope, raw_event_row
from sinks.writer import RecordSource, RejectedRow, TableWriter

log = logging.getLogger(__name__)

RAW_OCCURRED_AT = RAW_EVENT_COLUMNS.index("occurred_at")

#: table -> columns of the correlated family: the tables the store builds from the intake of
#: correlated records (sinks/migrations.py, migrations 4, 6 and 7), each through its view.
CORRELATED_FAMILY = {
    "correlated_events": CORRELATED_COLUMNS,
    "release_history": RELEASE_HISTORY_COLUMNS,
    "workload_timeline": WORKLOAD_TIMELINE_COLUMNS,
    "enriched_alerts": ENRICHED_ALERT_COLUMNS,
}
#: The table the sink inserts correlated records into, as they are (ENGINE = Null: its views
#: write the CORRELATED_FAMILY tables).
CORRELATED_INTAKE = "correlated_intake"


#: What SinkWriters does with a row the store rejected (e.g. send its dead letter).
OnRejected = Callable[[RejectedRow], Awaitable[None]]
Sources = Sequence[RecordSource | None] | None


class SinkWriters:
    """One TableWriter per table over one shared (lazy) store connection.

    Each ``store_*`` method takes a batch and, optionally, ``sources``: the Kafka record
    of each batch item (same length), so a rejected row's dead letter names its topic,
    partition and offset. It returns the rows the store rejected, after awaiting
    ``on_rejected`` for each (not for ``dead_letters`` rows: those are logged, see the
    module header).
    """

    def __init__(self, store, database: str, cluster: str | None = None, max_backoff_s: float = 10.0,
                 initial_backoff_s: float = 0.2, on_rejected: OnRejected | None = None) -> None:
        self.store = StoreConnection.of(store)
        self.counters = ComponentCounters("sinks")
        self.on_rejected = on_rejected
        insert_settings = {"insert_distributed_sync": 1} if cluster else None

        def writer(table: str, columns) -> TableWriter:
            return TableWriter(self.store, database, table_name(table, cluster), columns, f"sinks.{table}",
                               max_backoff_s=max_backoff_s, initial_backoff_s=initial_backoff_s, insert_settings=insert_settings)

        # The correlated family's one writer: the records into the intake, named after the table
        # that is the source of truth (its stage ``sinks.correlated_events`` names a refused record).
        self.writers = {"correlated_events": TableWriter(
            self.store, database, CORRELATED_INTAKE, ("record",), "sinks.correlated_events", max_backoff_s=max_backoff_s,
            initial_backoff_s=initial_backoff_s, insert_settings=insert_settings, records=True)}
        self.writers["gpu_allocations"] = writer("gpu_allocations", GPU_ALLOCATION_COLUMNS)
        self.writers["raw_events"] = writer("raw_events", RAW_EVENT_COLUMNS)
        self.writers["dead_letters"] = writer("dead_letters", DEAD_LETTER_COLUMNS)
        self.writers["violations"] = writer("violations", VIOLATION_COLUMNS)
        self.raw_out_of_range = 0

    async def _write(self, table: str, rows: list[list], sources: Sources) -> list[RejectedRow]:
        rejected = await self.writers[table].write(rows, sources)
        if rejected and table == "correlated_events":
            rejected = [_refused_by_range_check(row) for row in rejected]
        if rejected and table == "dead_letters":
            log.error("%d dead letter(s) rejected by %s and dropped (first: %s[%s]@%s: %s)", len(rejected),
                      self.writers[table].table, *_coordinates(rejected[0]), rejected[0].error)
        elif self.on_rejected is not None:
            for row in rejected:
                await self.on_rejected(row)
        return rejected

    async def store_correlated(self, batch: Sequence[CorrelatedEvent | bytes], sources: Sources = None) -> list[RejectedRow]:
        """Correlated records into the intake (``CORRELATED_INTAKE``), from which the store builds
        every table of the correlated family in the same insert: a record is the worker's JSON as it
        came from Kafka (bytes), or a ``CorrelatedEvent``, encoded here. A record without its required
        fields is refused by the intake's constraints (stage ``sinks.correlated_events``, the
        constraint named); one that is not one JSON object, or has a field of the wrong type, by the
        intake's parser (the field named); one with a count out of its column's range by the
        intake's range checks (stage ``sinks.<table>`` of that column's table, the column named) —
        each before any table's view sees the record, so a refused record leaves no row anywhere.

        Why not rows built in Python: parsing the records and building the four tables' rows was
        most of the sink's CPU (``benchmarks/sink_cpu.py``: ~22 us per correlated record, against
        ~8-10 for the store to do the same from the JSON)."""
        from schemas import encode_event

        rows = [[item if isinstance(item, bytes) else encode_event(item)] for item in batch]
        return await self._write("correlated_events", rows, sources)

    async def store_allocations(self, batch: list[GpuAllocation], sources: Sources = None) -> list[RejectedRow]:
        return await self._write("gpu_allocations", allocation_rows(batch), sources)

    async def store_violations(self, batch: list[Violation], sources: Sources = None) -> list[RejectedRow]:
        return await self._write("violations", violation_rows(batch), sources)

    async def store_dead_letters(self, batch: list[DeadLetter], sources: Sources = None) -> list[RejectedRow]:
        return await self._write("dead_letters", dead_letter_rows(batch), sources)

    async def store_raw(self, records: list[tuple[bytes, str, int, int]], keep: Callable[[datetime], bool] | None = None) -> int:
        """Insert raw records (value, topic, partition, offset); return how many were skipped
        (not envelopes). Rows the store rejects go to ``on_rejected`` like any other.
        ``keep`` (the replay range, ``StreamsSettings.in_range``) tests each envelope's
        ``occurred_at``: the others are not stored, and counted in ``raw_out_of_range``."""
        rows, sources, skipped = [], [], 0
        for value, topic, partition, offset in records:
            try:
                row = raw_event_row(value, topic, partition, offset)
            except NotAnEnvelope:
                skipped += 1  # already dead-lettered by the correlate stage, with the reason
                continue
            if keep is not None and not keep(row[RAW_OCCURRED_AT]):
                self.raw_out_of_range += 1
                continue
            rows.append(row)
            sources.append(RecordSource(topic, partition, offset, None, value if isinstance(value, bytes) else value.encode()))
        if skipped:
            self.counters.add_rejected("not_an_envelope", skipped)
        await self._write("raw_events", rows, sources)
        return skipped


_RANGE_RE = re.compile(r"\b(\w+): out of the range of UInt32\b")
#: ClickHouse's code for a ``throwIf`` that fired: the intake's range checks (sinks/migrations.py, ``_uint32``).
THROW_IF = 395


def _refused_by_range_check(row: RejectedRow) -> RejectedRow:
    """A correlated record the intake refused for a count out of its column's range (a ``throwIf``
    of its range checks: "reservation_gpus: out of the range of UInt32") is named after the table
    that column is of — its stage ``sinks.<table>`` —, as a row that table refused was; any other
    refusal keeps ``correlated_events`` (a parse error quotes the record, which could say anything).
    The check runs in the intake's view, before any view of the family (migration 6)."""
    match = _RANGE_RE.search(row.error) if row.code == THROW_IF else None
    if match is None or (table := RANGE_CHECKED_COLUMNS.get(match.group(1))) is None:
        return row
    database = row.table.rsplit(".", 1)[0]  # (the writer's table: the intake, database-qualified)
    return dataclasses.replace(row, table=f"{database}.{table}", stage=f"sinks.{table}")


def _coordinates(row: RejectedRow) -> tuple:
    return (row.source.topic, row.source.partition, row.source.offset) if row.source else ("?", "?", "?")


class Loose:
    """A JSON object the worker produced, read with attribute access by the row builders.

    Why not the pydantic model: validating every correlated row cost more than the rest
    of the sink together (measured), and the rows come from gpuledger's own worker.
    What is checked here is what the builders need — an object with the model's required
    fields present; a value ClickHouse cannot store is still refused by ClickHouse itself
    and dead-lettered (``TableWriter``).
    """

    def __init__(self, data: dict, defaults: dict) -> None:
        # The fields become plain attributes (the row builders read each several times, and a
        # __getattr__ per read cost ~10 % of the sink), as they come, then the defaults where a
        # field is null or absent (else null reads as None): a walk over the few defaults, not a
        # filtered copy of every field (that copy was ~a fifth of the sink's CPU in py-spy).
        fields = self.__dict__
        fields.update(data)
        for name, value in defaults.items():
            if fields.get(name) is None:
                fields[name] = value
        if type(fields.get("identity")) is dict:
            fields["identity"] = Loose(fields["identity"], {})

    def __getattr__(self, name: str):
        return None  # only for a field the object lacks (and that has no default)


def _required(model) -> tuple[tuple[str, ...], dict]:
    fields = model.model_fields
    return (tuple(n for n, f in fields.items() if f.is_required()),
            {n: f.default for n, f in fields.items() if not f.is_required() and f.default is not None})


def decode_loose(value: bytes, model, shape: tuple[tuple[str, ...], dict]) -> Loose:
    """``value`` as a ``Loose`` row of ``model``; ValueError naming what is missing."""
    import orjson

    obj = orjson.loads(value)
    if not isinstance(obj, dict):
        raise ValueError(f"not a {model.__name__}: a JSON {type(obj).__name__}")
    required, defaults = shape
    missing = [name for name in required if obj.get(name) is None]
    if missing:
        raise ValueError(f"not a {model.__name__}: missing {', '.join(missing)}")
    if not isinstance(obj.get("identity", {}), dict):
        raise ValueError(f"not a {model.__name__}: identity must be an object")
    return Loose(obj, defaults)


class _Record:
    """A confluent-kafka message seen through the attribute names RecordSource reads — and
    passed as a row's source itself (key and value are bytes, as RecordSource's): a
    RecordSource copy per record cost more than a microsecond each (a frozen dataclass),
    for the few rows the store ever rejects."""

    __slots__ = ("topic", "partition", "offset", "key", "value")

    def __init__(self, msg) -> None:
        self.topic, self.partition, self.offset = msg.topic(), msg.partition(), msg.offset()
        self.key, self.value = msg.key(), msg.value() or b""


#: How long a fetch into an empty batch waits for its first record (``BatchClock.fetch``).
IDLE_FETCH_S = 1.0

#: The kinds of record whose latency a batch is closed for (``BatchClock``): the correlated rows,
#: which responders query first ("event → queryable").
HOT_KINDS = frozenset({"correlated"})


class BatchClock:
    """When the sink's batch closes, from what each fetch brought.

    - At ``rows_max`` records (a backlog: a bulk load, a catch-up).
    - Holding correlated records (``HOT_KINDS``): no sooner than ``within`` after the previous batch
      closed, and then as soon as a fetch of ``quiet`` seconds brings no more of them (the burst
      has ended) or the first of them has waited ``within``.
    - Holding none: ``idle_within`` after the previous batch closed (raw events, allocations,
      violations, dead letters only).

    Why: the correlation stage emits its rows in bursts, one per batch of its own (every ~0.7 s at
    ``make bench``'s live rate), and each insert costs the store a fixed ~6-8 ms a table however few
    rows it carries (docs/store.md) — five to seven tables a batch. Closed every ``within`` whatever
    came (before 2026-12), a live sink paid that three times a second for a burst it split in two
    or three; closed at the end of each burst, about once per burst, and a burst's rows wait no
    window's remainder. What follows the burst (raw events, allocations) rides with it.
    All times are ``time.monotonic()`` seconds, passed in (tests drive it with their own)."""

    def __init__(self, within: float, quiet: float, idle_within: float, rows_max: int, now: float | None = None) -> None:
        self.within, self.quiet, self.idle_within, self.rows_max = within, quiet, idle_within, rows_max
        self.closed = time.monotonic() if now is None else now  # when the previous batch closed
        self.first_hot: float | None = None  # when the batch's first correlated record was taken

    def fetch(self, now: float, held: int) -> tuple[int, float]:
        """The next fetch into a batch holding ``held`` records: how many records it may take, and
        how long it may wait for them. Into an empty batch, one record, waited for however long
        (up to ``IDLE_FETCH_S``, for a stop to be seen): a fetch returns at its count or its timeout,
        and a sink at rest that fetched every ``quiet`` woke 20 times a second for nothing (0.01 of
        a core). Else ``quiet`` at most — a fetch waits its whole time unless it fills the batch,
        and a correlated record it brings must not wait for it — and never past the idle window."""
        if held == 0:
            return 1, IDLE_FETCH_S
        if self.first_hot is not None:
            return self.rows_max - held, self.quiet
        return self.rows_max - held, max(0.0, min(self.quiet, self.closed + self.idle_within - now))

    def took(self, now: float, held: int, hot: int) -> bool:
        """A fetch ended at ``now`` with ``hot`` correlated records among what it brought; the
        batch holds ``held`` records in all. True: the batch closes now (the clock restarts)."""
        quiet_now = hot == 0 and self.first_hot is not None
        if hot and self.first_hot is None:
            self.first_hot = now
        if self.first_hot is not None:
            close = now - self.closed >= self.within and (quiet_now or now - self.first_hot >= self.within)
        else:
            close = held > 0 and now - self.closed >= self.idle_within
        if held >= self.rows_max or (close and held):
            self.closed, self.first_hot = now, None
            return True
        return False


class SinkLoop:
    """The sink consumer: one confluent-kafka consumer (its own group, ``<app id>.sinks``)
    over every topic the store is built from, one insert per table per batch, offsets
    committed only after the batch is stored (or its rejected rows dead-lettered).

    Why not Faust agents: a Faust agent costs about as much per record as the whole
    correlation does, and the sinks read every input twice (raw and correlated); a plain
    consumer reads a batch in one call (``make bench``'s bare loop is this shape).
    """

    def __init__(self, settings, ctx, sinks: SinkWriters, topics: dict[str, list[str]]) -> None:
        from confluent_kafka import Consumer

        from producers._kafka import SINK_FETCH, ConsumerLag

        conf = settings.clickhouse
        self.ctx, self.sinks, self.topics = ctx, sinks, topics
        self.kind = {name: kind for kind, names in topics.items() for name in names}
        self.rows_max, self.within = conf.batch_rows, conf.batch_seconds
        self.quiet, self.idle_within = conf.batch_quiet_seconds, max(conf.batch_idle_seconds, conf.batch_seconds)
        self.batch: list[_Record] = []  # taken, not yet stored (their offsets not committed)
        self.in_range = settings.streams.in_range  # a replay's event-time range (`gpuledger replay --from/--to`)
        # The edge's dead-letter topic (receiver, collectors) is read whole by every run; a ranged
        # replay keeps the letters that failed in its range, as it keeps the raw events of it.
        self.edge_deadletter = settings.kafka.catalogue().deadletter
        self.lag = ConsumerLag()  # how far the tables are behind the topics, for the sink's health page
        from gpuledger.settings import worker_instance_id

        self.consumer = Consumer({**ctx.consumer_config, "group.id": f"{settings.streams.app_id}.sinks", "enable.auto.commit": False,
                                  "group.instance.id": f"{worker_instance_id(settings)}.sinks", "session.timeout.ms": 20_000,
                                  "auto.offset.reset": "earliest", "enable.partition.eof": False,
                                  "max.poll.interval.ms": 600_000, "logger": logging.getLogger("librdkafka"),
                                  **self.lag.consumer_config(),
                                  **SINK_FETCH})  # fewer, fuller fetches of a live stream (producers._kafka.SINK_FETCH)
        self.consumer.subscribe(sorted(self.kind))
        self._shapes: dict = {}
        self._stopping = False

    async def run(self) -> None:
        """Store batches until ``stop()``: the batch in hand is stored and committed first.

        What closes a batch is ``BatchClock``'s: the records are taken a fetch at a time (each
        ``consume`` takes and waits what the clock says) and the batch is stored once, when it closes.
        Offsets are committed only after the whole batch is stored — nothing is taken between the
        store and the commit, so the consumer's positions are the batch's end."""
        import asyncio

        clock = BatchClock(self.within, self.quiet, self.idle_within, self.rows_max)
        try:
            while not self._stopping:
                messages = await asyncio.to_thread(self.consumer.consume, *clock.fetch(time.monotonic(), len(self.batch)))
                hot = 0
                for m in messages:
                    if m.error():
                        log.warning("sink consumer: %s", m.error())
                        continue
                    rec = _Record(m)
                    self.batch.append(rec)
                    hot += self.kind[rec.topic] in HOT_KINDS
                if clock.took(time.monotonic(), len(self.batch), hot):
                    await self._store_batch()
            await self._store_batch()  # a clean stop stores what it took
        finally:
            self.consumer.close()  # leave the group now (also when cancelled at shutdown)

    async def _store_batch(self) -> None:
        import asyncio

        batch, self.batch = self.batch, []
        if batch:
            await self.store(batch)
            await asyncio.to_thread(self.consumer.commit, asynchronous=False)

    async def stop(self) -> None:
        self._stopping = True

    async def store(self, records: list[_Record]) -> None:
        from schemas import DeadLetter, GpuAllocation, Violation

        by_kind: dict[str, list[_Record]] = {}
        for rec in records:
            by_kind.setdefault(self.kind[rec.topic], []).append(rec)
        stats = self.ctx.stats
        # The tables responders query first, the raw event log last: each insert is a round
        # trip, and the correlated rows of a batch must not wait for the raw log's.
        if "correlated" in by_kind:
            # As they came: the store reads them (SinkWriters.store_correlated).
            records = by_kind["correlated"]
            rejected = await self.sinks.store_correlated([r.value for r in records], records)
            stats["stored"] += len(records) - len(rejected)
        if "allocations" in by_kind:
            batch, sources = await self._decode(by_kind["allocations"], GpuAllocation, "sinks.store_allocations")
            rejected = await self.sinks.store_allocations(batch, sources)
            stats["allocations_stored"] += len(batch) - len(rejected)  # (the rejected ones are dead-lettered)
        if "violations" in by_kind:
            batch, sources = await self._decode(by_kind["violations"], Violation, "sinks.store_violations")
            rejected = await self.sinks.store_violations(batch, sources)
            stats["violations_stored"] += len(batch) - len(rejected)
        if "raw" in by_kind:
            raw = by_kind["raw"]
            outside = self.sinks.raw_out_of_range
            skipped = await self.sinks.store_raw([(r.value, r.topic, r.partition, r.offset) for r in raw], keep=self.in_range)
            outside = self.sinks.raw_out_of_range - outside
            stats["raw_stored"] += len(raw) - skipped - outside
            stats["raw_skipped"] += skipped
            stats["raw_out_of_range"] += outside
        if "deadletter" in by_kind:
            batch, sources = [], []
            for rec in by_kind["deadletter"]:
                try:
                    letter = DeadLetter.model_validate_json(rec.value)
                except Exception:  # noqa: BLE001 - a dead letter about a dead letter would loop
                    log.error("unreadable dead letter at %s[%d]@%d skipped", rec.topic, rec.partition, rec.offset)
                    continue
                if rec.topic == self.edge_deadletter and not self.in_range(letter.failed_at):
                    stats["deadletters_out_of_range"] += 1
                    continue
                batch.append(letter)
                sources.append(rec)
            await self.sinks.store_dead_letters(batch, sources)
        await self.ctx.output.flush()  # the dead letters of rejected rows, before the offsets are committed

    async def _decode(self, records: list[_Record], model, stage: str) -> tuple[list, list[RecordSource]]:
        from schemas import encode_event
        from schemas.outputs import dead_letter

        batch, sources = [], []
        shape = self._shapes.get(model) or self._shapes.setdefault(model, _required(model))
        for rec in records:
            try:
                batch.append(decode_loose(rec.value, model, shape))
                sources.append(rec)
            except Exception as exc:  # noqa: BLE001 - keep the sink going; the record is dead-lettered
                letter = dead_letter("validation", str(exc), stage, rec.topic, rec.partition, rec.offset, rec.key, rec.value)
                self.ctx.output.produce(self.ctx.run.deadletter, rec.key, encode_event(letter))
        return batch, sources
