"""TableWriter: one table's batch inserts, held through outages, with rejected rows split off.

Input: a batch of rows (lists in the writer's column order) and, optionally, the Kafka
record each row was built from (``RecordSource``). Output: one columnar insert per batch
into ``database.table``; the rows ClickHouse refuses come back as ``RejectedRow`` values.

Guarantees:
- ``write`` returns only once every row of the batch is either stored or rejected, so a
  caller that acks offsets after it (a Faust agent using ``take_events``) never acks an
  unstored row: at-least-once into ReplacingMergeTree tables keyed by row identity.
- Retriable failures (``sinks/errors.py`` lists them: the store unreachable or
  overloaded, a chDB directory held by another process, …) are retried forever with
  capped exponential back-off and jitter (``sinks/retry.py``); the write call does not
  return meanwhile, so consumption stops and nothing is lost. The inserts run in a
  thread, the waits are ``asyncio.sleep``: the event loop keeps running.
- Rejected failures (a value that does not fit its column, a column set that does not
  match the table) do not stall the table: the batch is bisected down to the rows that
  fail, every other row is stored, and each failing row is returned with the error and
  a hint — the caller dead-letters it (``sinks/agents.py``). Rejected rows are counted
  (``rejected.store_rejected``), never retried.
- Logging is per state change: one WARNING when the table's writes start failing, at
  most one summary a minute, one INFO when they recover; one INFO line per batch.

Limits: bisecting costs about 2·log2(n) inserts per bad row (each a round trip); a
column-set mismatch rejects the whole batch at once instead. An insert the server
rejected part-way may have stored some blocks; the bisection re-inserts them, which the
ReplacingMergeTree keys collapse. Rows are lists, so a row with *more* values than
columns is not an error: the driver ignores the extra values.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import orjson
from clickhouse_connect.driver.common import write_leb128

from gpuledger.telemetry import ComponentCounters
from schemas.outputs import DeadLetter
from sinks.clickhouse import StoreConnection, driver_call
from sinks.errors import RowsRejected, classify_insert_error
from sinks.retry import OutageLog, call_retrying

log = logging.getLogger(__name__)

#: Dead letters keep at most this much of the record value (the schema says 64 KiB).
MAX_DEAD_VALUE = 64 * 1024
#: DeadLetter.error is a message, not a dump.
MAX_DEAD_ERROR = 2000


@dataclass(frozen=True)
class RecordSource:
    """The Kafka record a row was built from (what a dead letter names, and how to replay it)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None = None
    value: bytes = b""

    @classmethod
    def of(cls, message) -> RecordSource:
        """From a Faust/aiokafka message (anything with topic, partition, offset, key, value)."""
        value, key = message.value, message.key
        return cls(message.topic, message.partition, message.offset,
                   key if key is None or isinstance(key, bytes) else str(key).encode(),
                   value if isinstance(value, bytes) else str(value).encode())


@dataclass(frozen=True)
class RejectedRow:
    """A row the store refused, with why and where it came from.

    ``table`` is the database-qualified table, ``stage`` ``sinks.<table>``; ``error`` is
    ClickHouse's (or the driver's) message and ``code`` its error code when the server
    answered; ``hint`` says how to fix it. ``dead_letter()`` is the project's record of it.
    """

    table: str
    stage: str
    error: str
    hint: str
    row: list
    columns: tuple[str, ...]
    code: int | None = None
    source: RecordSource | None = None
    failed_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    def dead_letter(self) -> DeadLetter:
        """reason ``store_rejected``; the value is the source record's (replayable), or the
        row itself as a JSON object when the row has no source."""
        src = self.source
        if src is not None:
            value = src.value[:MAX_DEAD_VALUE].decode("utf-8", "replace")
        elif self.columns == ("record",):  # a record inserted as it came (TableWriter ``records``): itself, replayable
            value = self.row[0][:MAX_DEAD_VALUE].decode("utf-8", "replace")
        else:
            value = orjson.dumps(dict(zip(self.columns, self.row)), default=str).decode()[:MAX_DEAD_VALUE]
        return DeadLetter(
            reason="store_rejected", error=f"{self.table} rejected the row: {self.error}. Hint: {self.hint}"[:MAX_DEAD_ERROR],
            stage=self.stage,
            source_topic=src.topic if src else None, source_partition=src.partition if src else None,
            source_offset=src.offset if src else None,
            key=src.key.decode("utf-8", "replace") if src is not None and src.key is not None else None,
            value=value, failed_at=self.failed_at,
        )


#: How ClickHouse reads the JSON rows: times as orjson writes them (RFC 3339 with offset) —
#: and what an insert of a few thousand rows does not need, which cost the sink a quarter of
#: its CPU (``benchmarks/sink_cpu.py``: 0.091-0.103 -> 0.065-0.083 ms per bench event; an
#: insert of 2,000 correlated rows 18.5 -> 14 ms of CPU; the embedded store's inserts are
#: most of the sink's CPU): a single thread per insert (``max_threads``) and no parallel
#: parsing (it splits the input among threads it starts for each insert), and no
#: ``optimize_on_insert`` — the ReplacingMergeTree collapsing the block's duplicate keys at
#: insert time, which merges and ``FINAL`` do anyway (every reader reads with FINAL or takes
#: the highest version: a re-delivered batch is another insert, never collapsed at insert).
JSON_INSERT_SETTINGS = {"date_time_input_format": "best_effort", "max_threads": 1, "input_format_parallel_parsing": 0, "optimize_on_insert": 0}


class TableWriter:
    """Columnar batch inserts into one table: held while the store is unavailable,
    bisected when it rejects rows.

    ``store`` is an open client or a ``StoreConnection`` (lazy; reconnects while the
    store is unreachable). ``insert_settings`` go with every insert (on a cluster: wait
    for the Distributed insert to reach the shards before acking). ``component`` names
    the counters and is the dead letters' stage (``sinks.<table>``).
    """

    def __init__(self, store, database: str, table: str, columns: Sequence[str], component: str,
                 max_backoff_s: float = 10.0, initial_backoff_s: float = 0.2, insert_settings: dict | None = None,
                 summary_every_s: float = 60.0, records: bool = False) -> None:
        self.store = StoreConnection.of(store)
        self.table = f"{database}.{table}"
        self.columns = list(columns)
        #: ``records``: each row is one Kafka record's value (``[bytes]``), inserted as it is into a
        #: table of one String column (``correlated_intake``: sinks/migrations.py, migration 4);
        #: ``columns`` then only names the row in a RejectedRow.
        self.records = records
        self.component = component
        self.counters = ComponentCounters(component)
        self.max_backoff_s = max_backoff_s
        self.initial_backoff_s = initial_backoff_s
        self.insert_settings = insert_settings or {}
        self.outage = OutageLog(log, f"writes into {self.table}", summary_every_s)
        self.attempts = 0
        self.failures = 0  # retriable failures, over the writer's life
        self.rows_written = 0
        self.rows_rejected = 0

    @property
    def client(self):
        """The open client (connects if needed)."""
        return self.store.get()

    def insert_once(self, rows: list[list]) -> None:
        """One blocking insert; raises StoreUnavailable (retriable) or RowsRejected.

        Rows travel as one ``JSONCompactEachRow`` block (a JSON array per row, in the
        insert's column order, comma-separated) that ClickHouse parses itself: measured ~7x faster than
        clickhouse-connect's typed insert, which serialises every value in Python (the sink
        was the slowest stage of the worker); arrays rather than ``JSONEachRow`` objects
        spare building a dict per row (13 % of the sink's CPU in py-spy). A value ClickHouse
        cannot parse is refused with its code (CANNOT_PARSE_*), classified like any rejection.
        """
        client = self.store.get()  # raises StoreUnavailable / StoreLocked while unreachable
        if self.records:
            # The records as they came, each the one string of a ``RowBinary`` row (its length, then
            # its bytes): one record is one row, whatever it holds — in a text format a record could
            # close its row and open another (``]\n[`` in ``[record]`` rows; ``{..}{..}`` in
            # ``JSONEachRow``). Built here rather than by clickhouse-connect's typed insert, which
            # serialises each value in Python: a length (the driver's LEB128 writer) and the bytes.
            block = bytearray()
            for (value,) in rows:
                write_leb128(len(value), block)
                block += value
            columns, fmt = None, "RowBinary"
            settings = {**JSON_INSERT_SETTINGS, **self.insert_settings}
        else:
            # One dumps of every row, its brackets stripped: the rows separated by commas, which
            # ClickHouse's JSON*EachRow readers skip between rows as they skip whitespace. A
            # dumps per row then a join cost ~4 us a row (each result allocated and kept until
            # the join), one dumps of the block ~0.6 (py-spy: the sink's costliest line).
            columns, block, fmt = self.columns, orjson.dumps(rows, default=str)[1:-1], "JSONCompactEachRow"
            settings = {**JSON_INSERT_SETTINGS, **self.insert_settings}
        with driver_call() as report:
            try:
                client.raw_insert(self.table, column_names=columns, insert_block=block, fmt=fmt, settings=settings)
            except Exception as exc:  # noqa: BLE001 - driver errors vary by backend; classified below
                error = classify_insert_error(exc, self.table, len(rows), report.serialization_failed)
                if isinstance(error, RowsRejected) and report.column:
                    error = error.with_detail(report.column)
                raise error from exc

    def _before_sleep(self, state) -> None:
        self.failures += 1
        self.outage.failed(state.outcome.exception())

    async def _insert_held(self, rows: list[list]) -> None:
        """Insert, retrying retriable failures forever; RowsRejected passes through."""
        async def attempt() -> None:
            self.attempts += 1
            # The insert is blocking I/O (HTTP or in-process engine): keep the event
            # loop (and Faust's heartbeats) alive while it runs.
            await asyncio.to_thread(self.insert_once, rows)

        try:
            await call_retrying(attempt, self.initial_backoff_s, self.max_backoff_s, self._before_sleep)
        except RowsRejected:
            self.outage.succeeded()  # the store answered: the outage, if any, is over
            raise
        self.outage.succeeded()

    async def _write_part(self, rows: list[list], sources: list, rejected: list[RejectedRow]) -> None:
        try:
            await self._insert_held(rows)
        except RowsRejected as exc:
            if len(rows) > 1 and not exc.whole_batch:
                mid = len(rows) // 2
                await self._write_part(rows[:mid], sources[:mid], rejected)
                await self._write_part(rows[mid:], sources[mid:], rejected)
                return
            rejected.extend(RejectedRow(self.table, self.component, exc.detail, exc.hint, row, tuple(self.columns), exc.code, src)
                            for row, src in zip(rows, sources))

    async def write(self, rows: Sequence[list], sources: Sequence[RecordSource | None] | None = None) -> list[RejectedRow]:
        """Store the batch; return the rows the store rejected (empty when all were stored).

        ``sources[i]`` is the record ``rows[i]`` came from (same length as ``rows``), so
        a rejected row's dead letter names it. Does not return while the store is
        unavailable.
        """
        if not rows:
            return []
        rows = list(rows)
        if sources is None:
            sources = [None] * len(rows)
        elif len(sources) != len(rows):
            raise ValueError(f"{len(sources)} source(s) for {len(rows)} row(s) of {self.table}")
        started = time.monotonic()
        rejected: list[RejectedRow] = []
        await self._write_part(rows, list(sources), rejected)
        stored = len(rows) - len(rejected)
        self.rows_written += stored
        self.counters.add_sent(stored)
        elapsed_ms = (time.monotonic() - started) * 1000
        if rejected:
            self.rows_rejected += len(rejected)
            self.counters.add_rejected("store_rejected", len(rejected))
            first = rejected[0]
            where = f"{first.source.topic}[{first.source.partition}]@{first.source.offset}" if first.source else "no source"
            log.warning("inserted %d row(s) into %s in %.0f ms; rejected %d for their content (first from %s: %s)", stored,
                        self.table, elapsed_ms, len(rejected), where, first.error)
        else:
            log.info("inserted %d row(s) into %s in %.0f ms", stored, self.table, elapsed_ms)
        return rejected
