"""The route stage's input: the raw topics through one plain confluent-kafka consumer.

Input: the four raw topics, in the consumer group ``<app id>.route`` (static membership
per worker, ``<instance>.route``, as the sink's). Output: what ``Correlator.route_batch``
produces (routed events packed on ``<run>.route``, dead letters), and the group's
committed offsets.

Why not a Faust agent: a Faust agent pays Faust's per-record path for every raw record
(aiokafka's fetcher, a Message, an Event and the stream's ack bookkeeping per record) —
measured as Faust's pass-through ceiling, ~0.28 ms a record, more than the whole
correlation of an event costs (``benchmarks/engine_cpu.py``). The route stage needs none
of what that buys: it is stateless (decode, re-key, pack), so it needs neither Faust's
co-partitioned assignment nor its tables; the stateful stages behind it keep reading
their packed records (many messages a record) through Faust. librdkafka reads a batch
in one call (``make bench``'s bare loop and the sink have this shape).

Guarantees — the runner's epochs (``streams.runner.Epoch``), with the offsets committed
by this consumer instead of by Faust: a batch is handled (routed messages produced), and
at every epoch commit every output produced so far is acknowledged first, then the
epoch's offsets are committed. A crash anywhere re-delivers input whose routed messages
may already be on the route topic; the correlation folds are idempotent (an event id
folds once), so a re-routed event changes nothing. A commit may fail (a rebalance took
the partition away): the next owner re-routes from the last committed offset, again
idempotently. Stop (Faust cancels the task): the batch in hand finishes and the epoch
commits within ``STOP_GRACE_S`` each, then the group is left; otherwise the process exits
without committing (``HARD_EXIT``), as safe as a crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from confluent_kafka import KafkaError, TopicPartition

from producers._kafka import ROUTE_FETCH
from streams.runner import HARD_EXIT, STOP_GRACE_S, Epoch

log = logging.getLogger(__name__)

#: Seconds a consume call waits for its batch to fill (the Faust agents' ``take_events``
#: window, ``streams.runner.WITHIN_S``).
WITHIN_S = 0.1
REPORT_EVERY_S = 60.0
#: Bytes a fetch takes of one partition (librdkafka's default is 1 MiB, ~2,000 events: a
#: whole batch of one topic's partition while the others wait for the next).
PARTITION_FETCH_BYTES = 64 * 1024


class RawRecord:
    """One raw Kafka record as the route stage reads it (the attribute names of a Faust
    message, so ``route_batch`` and ``dead`` read both)."""

    __slots__ = ("topic", "partition", "offset", "key", "value")

    def __init__(self, msg) -> None:
        self.topic, self.partition, self.offset = msg.topic(), msg.partition(), msg.offset()
        self.key, self.value = msg.key(), msg.value() or b""

    @property
    def message(self) -> RawRecord:  # an epoch reads ``event.message`` (Faust's Event shape)
        return self


class RawIntake:
    """The raw topics' consumer and the route stage's epoch loop."""

    def __init__(self, settings, consumer_config: dict, topics: tuple[str, ...], epoch_args: tuple) -> None:
        from confluent_kafka import Consumer  # looked up at construction (tests/streams/test_progress.py records it)

        from gpuledger.settings import worker_instance_id

        self.topics = tuple(topics)
        self.batch = settings.streams.batch_max
        self.consumer = Consumer({
            **consumer_config,
            "group.id": f"{settings.streams.app_id}.route",
            # Static membership: a restarted worker gets its partitions back without a rebalance.
            "group.instance.id": f"{worker_instance_id(settings)}.route",
            "session.timeout.ms": 10_000,
            "heartbeat.interval.ms": 1_000,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            # Co-partitioned topics: each member gets the same partition numbers of every raw topic.
            "partition.assignment.strategy": "range",
            "max.poll.interval.ms": 600_000,
            # A batch returns records partition by partition as fetched; small per-partition
            # fetches make one batch span every raw topic (route_batch orders it by event time).
            "max.partition.fetch.bytes": PARTITION_FETCH_BYTES,
            **ROUTE_FETCH,  # fewer, fuller fetches of a live stream (producers._kafka.ROUTE_FETCH)
            "on_commit": self._on_commit,
            "logger": logging.getLogger("librdkafka"),
        })
        self.consumer.subscribe(list(self.topics), on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke)
        self.epoch = Epoch(*epoch_args, hold=None, release=self._release)
        self.assignment: set[tuple[str, int]] = set()
        self.assigned_once = False
        self._revoked: list[tuple[str, int]] = []  # appended by the consumer's thread, applied on the loop
        self._lock = threading.Lock()
        self._committed: dict[tuple[str, int], int] = {}
        self._commit_reported = 0.0
        self.commit_failures = 0

    # --- the consumer's callbacks (called from inside consume(), in its thread) -------------
    def _on_assign(self, _consumer, partitions) -> None:
        with self._lock:
            self.assignment = {(tp.topic, tp.partition) for tp in partitions}
            self.assigned_once = True
        log.info("route stage: %d raw partition(s) assigned", len(partitions))

    def _on_revoke(self, _consumer, partitions) -> None:
        with self._lock:
            gone = {(tp.topic, tp.partition) for tp in partitions}
            self.assignment -= gone
            self._revoked.extend(gone)

    def _on_commit(self, err, partitions) -> None:
        if err is None:
            return
        # A commit refused by a rebalance is expected: the next owner re-routes (idempotently).
        self.commit_failures += 1
        now = time.monotonic()
        if now - self._commit_reported >= REPORT_EVERY_S:
            self._commit_reported = now
            log.warning("route stage: offset commit failed (%s; %d so far); the records are routed again from the last "
                        "committed offset", err, self.commit_failures)

    # --- the epoch's release: offsets committed once the outputs are acknowledged -----------
    def _release(self, records: list[RawRecord]) -> None:
        offsets: dict[tuple[str, int], int] = {}
        for rec in records:
            tp = (rec.topic, rec.partition)
            if rec.offset + 1 > offsets.get(tp, -1):
                offsets[tp] = rec.offset + 1
        if offsets:
            self._committed.update(offsets)
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=True)

    def _apply_revocations(self) -> None:
        with self._lock:
            revoked, self._revoked = self._revoked, []
        if revoked:
            self.epoch.forget(revoked)

    def assigned(self) -> list[TopicPartition] | None:
        """The raw partitions this worker's route stage holds now; None before its first
        assignment (``streams.app.WorkerContext.assignment_health`` checks them)."""
        with self._lock:
            if not self.assigned_once:
                return None
            return [TopicPartition(t, p) for t, p in self.assignment]

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Route batches until cancelled (the worker stops): then the batch in hand and the
        epoch are finished, the last offsets committed and the group left."""
        pending: asyncio.Future | None = None
        try:
            while True:
                pending = asyncio.ensure_future(asyncio.to_thread(self.consumer.consume, self.batch, WITHIN_S))
                messages = await asyncio.shield(pending)
                pending = None
                self._apply_revocations()
                records = []
                for m in messages:
                    err = m.error()
                    if err is None:
                        records.append(RawRecord(m))
                    elif err.code() != KafkaError._PARTITION_EOF:
                        log.warning("route stage consumer: %s", err)
                if records:  # an epoch whose input stopped is committed by the worker's timer, as the agents' are
                    pending = asyncio.ensure_future(self.epoch.run_batch(records))
                    await asyncio.shield(pending)
                    pending = None
        except asyncio.CancelledError:
            await self._stop(pending)
            raise

    async def _stop(self, pending: asyncio.Future | None) -> None:
        try:
            if pending is not None:
                await asyncio.wait_for(pending, STOP_GRACE_S)
            await asyncio.wait_for(self.epoch.commit_now(), STOP_GRACE_S)
            if self._committed:
                offsets = [TopicPartition(t, p, o) for (t, p), o in self._committed.items()]
                await asyncio.wait_for(asyncio.to_thread(self._commit_sync, offsets), STOP_GRACE_S)
            await asyncio.wait_for(asyncio.to_thread(self.consumer.close), STOP_GRACE_S)
        except BaseException:  # noqa: BLE001 - any way the batch, its commit or the leave did not finish
            log.critical("route stage: stopping with a batch or commit unfinished; exiting without committing it")
            logging.shutdown()
            os._exit(HARD_EXIT)

    def _commit_sync(self, offsets: list[TopicPartition]) -> None:
        """The last offsets again, synchronously, before leaving (an asynchronous commit may
        still be in flight); a refusal (the partitions moved) only means re-routing."""
        from confluent_kafka import KafkaException

        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            log.info("route stage: last offset commit refused (%s); the next owner re-routes from the one before", exc)
