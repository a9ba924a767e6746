"""BatchOutput: one agent batch's output records, produced with confluent-kafka and
acknowledged before the batch's state is written and its input offsets are acked.

Input: ``produce(topic, key, value, partition=None, source=None)`` calls during one
batch; ``source`` is the (topic, partition, offset) of the input record the output
derives from. Output: records on the run's topics.

Why not Faust's ``topic.send()``: the profile of one worker was dominated by Faust's
and aiokafka's per-message produce path (coroutines, futures, tiny requests); each
input writes several records. librdkafka batches and compresses in its own thread.

Guarantees: ``flush()`` returns only when every record produced so far is
acknowledged (acks=all, idempotent producer). A retriable failure (broker away,
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
REPORT_EVERY_S = 60.0


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
        self._failed: list[tuple[tuple, KafkaError]] = []
        self.produced: Counter[str] = Counter()
        self.dead_letters = 0
        self._trouble_since: float | None = None
        self._trouble_count = 0
        self._trouble_reported = 0.0

    # --- producing ------------------------------------------------------------------
    def produce(self, topic: str, key: bytes | None, value: bytes, partition: int | None = None, source: tuple | None = None) -> None:
        self._produce((topic, key, value, partition, source))

    def _produce(self, record: tuple) -> None:
        topic, key, value, partition, _source = record

        def on_delivery(err, _msg, record=record):
            if err is not None:
                self._failed.append((record, err))

        while True:
            try:
                if partition is None:
                    self._producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
                else:
                    self._producer.produce(topic, key=key, value=value, partition=partition, on_delivery=on_delivery)
                self.produced[topic] += 1
                return
            except BufferError:
                self._producer.poll(0.05)
            except KafkaException as exc:  # refused before it left: too large for message.max.bytes
                self._dead(record, exc.args[0])
                return

    def _dead(self, record: tuple, err: KafkaError) -> None:
        topic, key, value, _partition, source = record
        src_topic, src_partition, src_offset = source if source else (None, None, None)
        letter = DeadLetter(
            reason="output_refused", stage=f"streams.output:{topic}",
            error=f"Kafka refused a {len(value)}-byte record for {topic}: {err.str()} ({err.name()})",
            source_topic=src_topic, source_partition=src_partition, source_offset=src_offset,
            key=key.decode("utf-8", "replace") if key else None,
            value=bytes(value[:MAX_DEAD_VALUE]).decode("utf-8", "replace"), failed_at=datetime.now(timezone.utc),
        )
        self.dead_letters += 1
        log.error("dead-lettered an output record for %s (%s, %d bytes) derived from %s", topic, err.name(), len(value), source)
        self._produce((self.deadletter_topic, key, encode_event(letter), None, None))

    # --- waiting for acks ---------------------------------------------------------------
    async def flush(self) -> None:
        """Wait until every record produced so far is acknowledged (retrying what can be)."""
        while True:
            remaining = await asyncio.to_thread(self._producer.flush, 5)
            if self._failed:
                failed, self._failed = self._failed, []
                retry = [(r, e) for r, e in failed if e.code() not in REFUSED or r[0] == self.deadletter_topic]
                for record, err in failed:
                    if (record, err) not in retry:
                        self._dead(record, err)
                if retry:
                    self._trouble(len(retry), retry[0][1])
                    for record, _err in retry:
                        self._produce(record)
                continue
            if remaining == 0:
                self._recovered()
                return
            self._trouble(remaining, None)

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
