"""BatchOutput: one agent batch's output records, produced with confluent-kafka and
acknowledged before the batch's state is written and its input offsets are acked.

Input: ``produce(topic, key, value, partition=None, source=None)`` calls during one
batch; ``source`` is the (topic, partition, offset) of the input record the output
derives from. Output: records on the run's topics.

Why not Faust's ``topic.send()``: the profile of one worker was dominated by Faust's
and aiokafka's per-message produce path (coroutines, futures, tiny requests); each
input writes several records. librdkafka batches and compresses in its own thread.

Guarantees: ``flush()`` returns only when every record produced before it was called
is acknowledged (acks=all, idempotent producer). A retriable failure (broker away,
timeout) is produced again until it is acknowledged — the batch waits, the offsets
are not acked. A record Kafka refuses for what it is (too large, invalid) is never
retried and never dropped: it becomes a dead letter on the run's dead-letter topic
with the reason, the error and the source record's topic/partition/offset, and the
batch goes on. Keys without an explicit partition are placed by murmur2
(``murmur2_random``), the Java client's and aiokafka's partitioner.

Calm under faults: delivery trouble is logged once when it starts (with the error),
then at most once a minute with a count, and once when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from datetime import datetime, timezone

from confluent_kafka import KafkaError, KafkaException, Producer

from schemas import DeadLetter, encode_event

log = logging.getLogger(__name__)

#: librdkafka errors that say "this record can never be written", not "not now". A
#: missing topic or a missing ACL is an operator's problem, not the record's: those hold
#: the batch (and say so in the log) until fixed.
REFUSED = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE, KafkaError.INVALID_MSG,
})
MAX_DEAD_VALUE = 64 * 1024
MAX_DEAD_KEY = 1024  # bytes of a refused record's key kept in its dead letter (and as the letter's own key)
REPORT_EVERY_S = 60.0


class Deferred:
    """Records to produce later, collected through ``produce``'s signature: an epoch commit
    encodes its changed states when it is taken (the state as it is then) and produces them
    once the epoch's outputs are acknowledged (``WorkerContext.commit_state``)."""

    def __init__(self) -> None:
        self.records: list[tuple] = []

    def produce(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None = None, source: tuple | None = None,
                headers: list[tuple[str, bytes]] | None = None) -> None:
        self.records.append((topic, key, value, partition, source, headers))


class BatchOutput:
    def __init__(self, config: dict, client_id: str, deadletter_topic: str, max_message_bytes: int = 1_000_000) -> None:
        self._producer = Producer({
            **config,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 10,
            "compression.type": "lz4",
            "partitioner": "murmur2_random",
            "message.max.bytes": max_message_bytes,
            "queue.buffering.max.messages": 1_000_000,
            "client.id": client_id,
            "logger": logging.getLogger("librdkafka"),
        })
        self.deadletter_topic = deadletter_topic
        self._failed: list[tuple[int, tuple, KafkaError]] = []
        self._seq = 0
        self._inflight: set[int] = set()
        self.produced: Counter[str] = Counter()
        self.dead_letters = 0
        self._trouble_since: float | None = None
        self._trouble_count = 0
        self._trouble_reported = 0.0
        self._tracked: dict = {}  # topic -> streams.snapshot.ChangelogAcks (``track``)

    def track(self, topic: str):
        """Count the records produced to ``topic`` (with an explicit partition) and their
        acknowledgements, per partition: a ``streams.snapshot.ChangelogAcks``, shared by every
        caller tracking the topic (a store's changelog: ``PartitionStore.follow``)."""
        from streams.snapshot import ChangelogAcks

        return self._tracked.setdefault(topic, ChangelogAcks())

    # --- producing ------------------------------------------------------------------
    def produce(self, topic: str, key: bytes | None, value: bytes, partition: int | None = None, source: tuple | None = None,
                headers: list[tuple[str, bytes]] | None = None) -> None:
        seq = self._seq
        self._seq += 1
        self._inflight.add(seq)
        if self._tracked and partition is not None and topic in self._tracked:
            self._tracked[topic].on_produce(partition)
        self._send(seq, (topic, key, value, partition, source, headers))

    def _send(self, seq: int, record: tuple) -> None:
        """Hand one record to librdkafka; ``seq`` stays in flight until it (or the dead
        letter that replaces it) is acknowledged."""
        topic, key, value, partition, _source, headers = record

        def on_delivery(err, msg, seq=seq, record=record):
            if err is None:
                self._inflight.discard(seq)
                if self._tracked and record[0] in self._tracked and record[3] is not None:
                    self._tracked[record[0]].on_ack(msg.partition(), msg.offset())
            else:
                self._failed.append((seq, record, err))

        while True:
            try:
                if partition is None:
                    self._producer.produce(topic, key=key, value=value, on_delivery=on_delivery, headers=headers)
                else:
                    self._producer.produce(topic, key=key, value=value, partition=partition, on_delivery=on_delivery, headers=headers)
                self.produced[topic] += 1
                return
            except BufferError:
                self._producer.poll(0.05)
            except KafkaException as exc:  # refused before it left: too large for message.max.bytes
                if topic == self.deadletter_topic:
                    # A dead letter is small by construction (value and key cut): one refused
                    # means the dead-letter topic itself refuses it. Loud, never a loop.
                    raise RuntimeError(f"the dead letter for a refused output record could not be produced to {topic}: "
                                       f"{exc.args[0].str()}") from exc
                self._dead(seq, record, exc.args[0])
                return

    def _dead(self, seq: int, record: tuple, err: KafkaError) -> None:
        topic, key, value, partition, source, _headers = record
        if topic in self._tracked and partition is not None:
            self._tracked[topic].on_refused(partition)
        value = value or b""  # a refused tombstone has none
        src_topic, src_partition, src_offset = source if source else (None, None, None)
        letter = DeadLetter(
            reason="output_refused", stage=f"streams.output:{topic}",
            error=f"Kafka refused a {len(value)}-byte record for {topic}: {err.str()} ({err.name()})",
            source_topic=src_topic, source_partition=src_partition, source_offset=src_offset,
            key=key[:MAX_DEAD_KEY].decode("utf-8", "replace") if key else None,
            value=bytes(value[:MAX_DEAD_VALUE]).decode("utf-8", "replace"), failed_at=datetime.now(timezone.utc),
        )
        self.dead_letters += 1
        log.error("dead-lettered an output record for %s (%s, %d bytes) derived from %s", topic, err.name(), len(value), source)
        # The letter's own key is cut as its value is: a key too large for the broker was
        # the refusal's cause as often as a value (the letter names it, cut too).
        self._send(seq, (self.deadletter_topic, key[:MAX_DEAD_KEY] if key else None, encode_event(letter), None, None, None))

    # --- waiting for acks ---------------------------------------------------------------
    def mark(self) -> set[int]:
        """The records produced so far and not yet acknowledged: ``flush(mark)`` waits for
        these only (an epoch's tail, ``streams.runner``, waits for its own epoch's outputs
        while later batches go on producing)."""
        return set(self._inflight)

    def produce_all(self, records: Deferred) -> set[int]:
        """Produce ``records`` (collected by a ``Deferred``) and return their mark."""
        first = self._seq
        for topic, key, value, partition, source, headers in records.records:
            self.produce(topic, key, value, partition=partition, source=source, headers=headers)
        return set(range(first, self._seq))  # produce is synchronous: the seqs in between are these

    async def flush(self, mark: set[int] | None = None) -> None:
        """Wait until every record produced *before this call* (or every record of ``mark``)
        is acknowledged (retrying what can be retried). Records other agents produce
        meanwhile are not waited for: with several agents producing all the time, "until the
        queue is empty" could wait for ever (measured: correlation batches stalled for seconds)."""
        mine = set(self._inflight) if mark is None else mark
        waited = 0.0
        while True:
            if self._failed:
                failed, self._failed = self._failed, []
                for seq, record, err in failed:
                    if err.code() in REFUSED and record[0] != self.deadletter_topic:
                        self._dead(seq, record, err)
                    else:
                        self._trouble(1, err)
                        self._send(seq, record)
            if mine.isdisjoint(self._inflight):
                self._recovered()
                return
            await asyncio.to_thread(self._producer.poll, 0.05)
            waited += 0.05
            if waited >= 5.0:
                waited = 0.0
                self._trouble(len(mine & self._inflight), None)

    def _trouble(self, n: int, err: KafkaError | None) -> None:
        now = time.monotonic()
        self._trouble_count += n
        if self._trouble_since is None:
            self._trouble_since = self._trouble_reported = now
            log.warning("output records not acknowledged (%s); holding the batch and retrying", err.str() if err else f"{n} waiting")
        elif now - self._trouble_reported >= REPORT_EVERY_S:
            self._trouble_reported = now
            log.warning("output still not acknowledged after %.0fs (%d retries so far)", now - self._trouble_since, self._trouble_count)

    def _recovered(self) -> None:
        if self._trouble_since is not None:
            log.info("output acknowledged again after %.1fs (%d retries)", time.monotonic() - self._trouble_since, self._trouble_count)
            self._trouble_since = None
            self._trouble_count = 0

    def close(self, timeout: float = 5.0) -> int:
        """Flush what is queued (bounded); return how many records were still unacknowledged."""
        return self._producer.flush(timeout)
