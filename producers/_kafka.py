"""The one Kafka producer wrapper, the record size limit, and idempotent topic creation.

Input: contract events (schemas). Output: records on the catalogue's raw topics,
keyed by the shared correlation key, with W3C trace context in headers; dead letters
(``DeadLetter``, reason ``event_too_large``) on the dead-letter topic for collectors'
events too large to travel.
Guarantees: idempotent producer, acks=all; ``publish_batch`` returns only when every
record of the batch is acknowledged by the broker and raises ``PublishError`` if any
was not, so a caller that answers "accepted" after it has the acks never lies.
Size: the raw topics' ``max.message.bytes`` is read once per publisher (falling back to
the broker's ``message.max.bytes``, then Kafka's default 1,048,588) and gives one limit
for an encoded event, ``max_event_bytes`` (``producers._limits.max_event_bytes_for``).
``publish_batch`` refuses a batch holding an event over it with ``EventTooLarge`` before
producing any of its records; ``publish_fitting`` (collectors) dead-letters such events
and publishes the rest. librdkafka batches are kept to half the record limit, so a batch
of small events is never refused as a whole.
Limits: a failed batch may be partly written; re-sending it is harmless because
event ids are deterministic and every table downstream is idempotent. A topic limit
lowered while the publisher runs is noticed when Kafka refuses a record for its size
(``EventTooLarge``); the limit is then read again for the next batch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import NamedTuple

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from gpuledger.telemetry import ComponentCounters, inject_headers, tracer
from producers._errors import EventTooLarge, KafkaNotConfigured, ProducerError, PublishError
from producers._limits import DEFAULT_RECORD_LIMIT, Oversize, RecordLimit
from schemas import encode_event
from schemas.outputs import DEAD_LETTER_VALUE_BYTES, DeadLetter
from schemas.topics import TopicCatalogue

log = logging.getLogger(__name__)

#: Errors that mean "Kafka did not answer", not "Kafka said no".
_UNREACHABLE = frozenset({
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE,
    KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION, KafkaError.BROKER_NOT_AVAILABLE,
})
#: librdkafka's own batches stay this far under the record limit, and under its default.
_MAX_BATCH_BYTES = 1_000_000
#: A limit that is a fallback (a topic not yet visible, no DescribeConfigs right) is read
#: again after this long: a topic created a moment ago may have its own max.message.bytes.
_FALLBACK_RECHECK_S = 60.0


def _kafka_error(exc: BaseException) -> KafkaError | None:
    arg = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return arg if isinstance(arg, KafkaError) else None


def _unreachable(exc: BaseException) -> bool:
    err = _kafka_error(exc)
    return isinstance(exc, concurrent.futures.TimeoutError) or (err is not None and err.code() in _UNREACHABLE)


def read_record_limit(config: dict, topics: Sequence[str], timeout: float = 10.0) -> RecordLimit:
    """The smallest ``max.message.bytes`` of ``topics``; else the broker's ``message.max.bytes``; else Kafka's default.

    A topic whose config cannot be read (missing, no DescribeConfigs right) counts with
    the broker's value, which is what it gets when created. Raises ``PublishError``
    when Kafka does not answer at all (retriable: nothing is cached).
    """
    admin = AdminClient({**config, "logger": logging.getLogger("librdkafka")})
    found: dict[str, int] = {}
    problems: list[str] = []
    try:
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in topics], request_timeout=timeout)
        for resource, future in futures.items():
            try:
                found[resource.name] = int(future.result(timeout=timeout + 5)["max.message.bytes"].value)
            except (KafkaException, KeyError, ValueError) as exc:
                if _unreachable(exc):
                    raise
                problems.append(f"{resource.name}: {exc}")
        if found and not problems:
            topic = min(found, key=found.__getitem__)
            return RecordLimit(found[topic], f"max.message.bytes of {topic}")
        candidates = [RecordLimit(v, f"max.message.bytes of {t}", confirmed=False) for t, v in found.items()]
        try:
            md = admin.list_topics(timeout=timeout)
            broker = md.controller_id if md.controller_id in md.brokers else min(md.brokers)
            resource = ConfigResource(ResourceType.BROKER, str(broker))
            future = admin.describe_configs([resource], request_timeout=timeout)[resource]
            value = int(future.result(timeout=timeout + 5)["message.max.bytes"].value)
            candidates.append(RecordLimit(value, f"message.max.bytes of broker {broker}", confirmed=False))
        except (KafkaException, KeyError, ValueError) as exc:
            if _unreachable(exc):
                raise
            problems.append(f"broker: {exc}")
    except (KafkaException, concurrent.futures.TimeoutError) as exc:
        raise PublishError(f"cannot read max.message.bytes of {', '.join(topics)}: Kafka did not answer: {exc or 'timeout'}") from exc
    limit = (min(candidates, key=lambda c: c.bytes) if candidates
             else RecordLimit(DEFAULT_RECORD_LIMIT, "Kafka's default record limit", confirmed=False))
    log.warning("record size limit: some configs could not be read (%s); using %d bytes from %s",
                "; ".join(problems), limit.bytes, limit.source)
    return limit


#: How often a ``_DeliveryPump`` polls while records of its loop await their ack: under
#: librdkafka's linger (``linger.ms``, 5 ms and up), so an ack waits at most this long to be seen.
PUMP_INTERVAL_S = 0.001


class _DeliveryPump:
    """Serves the delivery reports of ``publish_batch_async`` on its event loop.

    While any record produced from this loop awaits its ack, the pump calls
    ``producer.poll(0)`` (never blocks) every ``PUMP_INTERVAL_S`` and settles the reports
    it finds; idle, it schedules nothing. Why not a poller thread: a thread that wakes for
    each report must take the GIL from the busy loop (up to the 5 ms switch interval) and
    hand every report over with ``call_soon_threadsafe`` (a self-pipe write and an extra
    loop wake-up per record) — measured as a large share of the receiver's CPU per request.
    Reports served elsewhere (``flush`` in ``close``, a synchronous publish polling the
    shared producer) land in the same queue and are settled on the next tick.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, producers: Callable[[], list[Producer]]) -> None:
        self.loop = loop
        self.producers = producers
        self.reports: collections.deque = collections.deque()  # (settle, index, error), appended from any thread
        self.outstanding = 0  # records produced from this loop, not yet settled
        self._handle: asyncio.TimerHandle | None = None

    def expect(self, n: int) -> None:
        self.outstanding += n
        if self._handle is None:
            self._handle = self.loop.call_later(PUMP_INTERVAL_S, self.tick)

    def tick(self) -> None:
        if self._handle is not None:  # called directly (a full local queue): one chain of ticks only
            self._handle.cancel()
            self._handle = None
        for producer in self.producers():
            producer.poll(0)
        reports = self.reports
        while reports:
            settle, index, err = reports.popleft()
            self.outstanding -= 1
            settle(index, err)
        if self.outstanding > 0 and not self.loop.is_closed():
            self._handle = self.loop.call_later(PUMP_INTERVAL_S, self.tick)


class _Record(NamedTuple):
    topic: str
    key: bytes | None
    value: bytes
    event_id: str
    event_type: str


def resolve_bootstrap(settings) -> str:
    """The configured bootstrap servers (the CLI fills in the local broker of `gpuledger kafka up`)."""
    if settings.kafka.bootstrap:
        return settings.kafka.bootstrap
    raise KafkaNotConfigured("no Kafka to talk to: set GPULEDGER_KAFKA_BOOTSTRAP=host:port or start one with `gpuledger kafka up`")


def client_config(settings) -> dict:
    return {"bootstrap.servers": resolve_bootstrap(settings), **settings.kafka.client_config()}


#: librdkafka fetch settings of the worker's long-lived consumers: a fetch returns once
#: enough bytes are there or after 50 ms. With the defaults (1 byte, 500 ms) a consumer of a
#: live stream sends the next fetch the moment the last returned, a few records each, as fast
#: as the broker answers — and the broker (on the same two cores in ``make bench``) spends its
#: CPU on requests. A trickle waits at most 50 ms per fetch.
#:
#: The route stage's consumer of the raw topics (``ROUTE_FETCH``, 64 KiB): it reads ahead of
#: everything else, a backlog in full fetches either way.
#: The sink's consumer (``SINK_FETCH``, 16 KiB) trails the worker's outputs, so its fetches park
#: on partitions the worker appends to all the time, and the broker re-checks a parked fetch at
#: every such append: with 64 KiB the bulk phase of ``make bench`` cost the broker 0.11-0.12 ms
#: per event (0.07 without) and the worker ran 3,030-3,690 events/s (3,780-3,840 without).
#: Measured, live run at 2,400 events/s (two runs each), broker cores / event -> queryable p99:
#: neither 0.59, 0.55 / 5.9, 4.1 s; only the route's 0.56, 0.56 / 5.8, 6.7 s; both at 64 KiB
#: 0.44, 0.42, 0.42, 0.43 / 3.8, 2.2, 3.9, 2.4 s; route 64 + sink 16 KiB 0.46, 0.44 / 4.0, 3.3 s,
#: with the bulk phase at 3,930-4,090 events/s (broker 0.09 ms/event).
ROUTE_FETCH = {"fetch.min.bytes": 64 * 1024, "fetch.wait.max.ms": 50}
SINK_FETCH = {"fetch.min.bytes": 16 * 1024, "fetch.wait.max.ms": 50}


class ConsumerLag:
    """How far a confluent-kafka consumer's group is behind, per assigned partition: the
    records between the partition's end (its last stable offset) and the group's committed
    offset — what a stage still has to make durable, as ``kafka-consumer-groups`` shows it.

    Read from librdkafka's own statistics (``statistics.interval.ms``, delivered to
    ``stats_cb`` from inside the consumer's poll, in its thread): no request of our own to
    the broker, and no call into the consumer from another thread (which can block while it
    polls). ``consumer_config()`` goes into the consumer's configuration; ``health()`` is
    what a health page shows: ``total`` over the partitions whose lag is known, per
    partition ``topic[p]`` → lag (None while librdkafka does not know the end or the
    committed offset: a group that never committed), and the statistics' age.
    Why not the group's offsets from the admin API (``streams.progress``): that is a round trip
    per look, and a health page is polled by probes."""

    #: librdkafka's statistics interval: how stale the lag may be.
    INTERVAL_MS = 5_000

    def __init__(self, interval_ms: int = INTERVAL_MS) -> None:
        self.interval_ms = interval_ms
        self._partitions: dict[str, int | None] = {}
        self._at: float | None = None

    def consumer_config(self) -> dict:
        return {"statistics.interval.ms": self.interval_ms, "stats_cb": self._on_stats}

    def _on_stats(self, raw: str) -> None:
        import orjson

        try:
            stats = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return
        partitions: dict[str, int | None] = {}
        for topic, t in (stats.get("topics") or {}).items():
            for number, part in (t.get("partitions") or {}).items():
                # "-1" is librdkafka's internal unassigned partition; "desired" marks the assigned ones
                if number == "-1" or not part.get("desired"):
                    continue
                lag = part.get("consumer_lag", -1)
                partitions[f"{topic}[{number}]"] = lag if isinstance(lag, int) and lag >= 0 else None
        self._partitions, self._at = partitions, time.monotonic()  # one assignment: read whole by health()

    def health(self) -> dict:
        partitions = self._partitions
        age = None if self._at is None else round(time.monotonic() - self._at, 1)
        return {"total": sum(v for v in partitions.values() if v is not None), "partitions": dict(sorted(partitions.items())),
                "unknown": sum(v is None for v in partitions.values()), "age_s": age,
                # not read yet, or not for 3 intervals: a consumer that is not polled (its sink holding a
                # batch while the store is down) has no fresh statistics, and its total is not the lag;
                # nor is it with no partition assigned (a consumer that cannot reach its broker, or one
                # the group gave nothing): a 0 there read as "caught up" while the group trailed
                "stale": age is None or age > 3 * self.interval_ms / 1000 or not partitions}


class EventPublisher:
    """Publishes contract events to their raw topics; thread-safe (librdkafka is).

    The librdkafka producer is built on first use, once the raw topics' record limit is
    known (its batch size follows the limit); ``record_limit`` and ``max_event_bytes``
    read it then (and raise ``PublishError`` while Kafka does not answer).
    """

    def __init__(self, config: dict, catalogue: TopicCatalogue, component: str, delivery_timeout_s: float = 30.0,
                 limit_lookup_timeout_s: float = 10.0, linger_ms: float = 5) -> None:
        self.catalogue = catalogue
        self.component = component
        self.counters = ComponentCounters(component)
        self.limit_lookup_timeout_s = limit_lookup_timeout_s
        self._tracer = tracer(component)
        self._config = dict(config)
        self._producer_config = {
            **config,
            "enable.idempotence": True,
            "acks": "all",
            # How long a record waits to share a produce request with others; the receiver
            # (many one-event requests) sets more (ReceiverSettings.linger_ms).
            "linger.ms": linger_ms,
            "compression.type": "lz4",
            "delivery.timeout.ms": int(delivery_timeout_s * 1000),
            "client.id": f"gpuledger-{component}",
            "error_cb": self._on_error,
            # Same partitioner as the Java client and aiokafka (Faust), so a key lands
            # on the same partition whoever produces it: co-partitioning holds.
            "partitioner": "murmur2_random",
            # librdkafka logs through Python logging instead of raw stderr lines.
            "logger": logging.getLogger("librdkafka"),
        }
        self._producer: Producer | None = None
        self._retired: list[Producer] = []  # built for an older limit; flushed on close
        self._limit: RecordLimit | None = None
        self._limit_stale = False
        self._limit_read_at = 0.0
        self._last_error: str | None = None
        self._lock = threading.Lock()
        self._pumps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _DeliveryPump

    @property
    def client_config(self) -> dict:
        """The Kafka client settings (bootstrap, security) this publisher was built with."""
        return dict(self._config)

    @classmethod
    def from_settings(cls, settings, component: str, linger_ms: float = 5) -> EventPublisher:
        return cls(client_config(settings), settings.kafka.catalogue(), component, settings.kafka.delivery_timeout_s,
                   linger_ms=linger_ms)

    def _on_error(self, err: KafkaError) -> None:
        self._last_error = str(err)
        log.warning("kafka producer: %s", err)

    # --- the record limit ------------------------------------------------------------

    def _ready_cached(self) -> tuple[Producer, RecordLimit] | None:
        """The producer and its limit when no Kafka round trip is needed to know them, else None."""
        limit, producer = self._limit, self._producer
        if producer is not None and limit is not None and not self._limit_stale and (
                limit.confirmed or time.monotonic() - self._limit_read_at < _FALLBACK_RECHECK_S):
            return producer, limit
        return None

    def _ready(self, timeout: float | None = None) -> tuple[Producer, RecordLimit]:
        """The producer and the limit it was built for; learns the limit first if needed."""
        with self._lock:
            cached = self._ready_cached()
            if cached is not None:
                return cached
            wait = min(self.limit_lookup_timeout_s, timeout) if timeout is not None else self.limit_lookup_timeout_s
            limit = read_record_limit(self._config, self.catalogue.raw_topics, wait)
            if self._producer is None or self._limit is None or limit.bytes != self._limit.bytes:
                if self._producer is not None:
                    self._retired.append(self._producer)
                # A librdkafka batch is one record for the broker: at most batch.size plus its
                # first message (<= max_event_bytes), so half the limit leaves room for framing.
                batch_size = max(1, min(_MAX_BATCH_BYTES, limit.bytes // 2))
                self._producer = Producer({**self._producer_config, "batch.size": batch_size})
                log.info("%s: raw topics take records up to %d bytes (%s): events up to %d bytes, batches up to %d",
                         self.component, limit.bytes, limit.source, limit.max_event_bytes, batch_size)
            self._limit, self._limit_stale, self._limit_read_at = limit, False, time.monotonic()
            return self._producer, limit

    @property
    def record_limit(self) -> RecordLimit:
        """The largest record the raw topics take (read from Kafka once, then cached)."""
        return self._ready()[1]

    @property
    def max_event_bytes(self) -> int:
        """The largest encoded event this publisher sends (see ``max_event_bytes_for``)."""
        return self.record_limit.max_event_bytes

    # --- producing --------------------------------------------------------------------

    def connected(self, timeout: float = 2.0) -> bool:
        """True when the broker answers a metadata request (for readiness probes)."""
        try:
            producer, _ = self._ready(timeout)
            md = producer.list_topics(timeout=timeout)
            return bool(md.brokers)
        except (KafkaException, PublishError):
            return False

    def _records(self, events: Sequence, topic: str | None = None) -> list[_Record]:
        return [_Record(topic or self.catalogue.for_family(e.event_type), e.correlation_key().encode(), encode_event(e), e.event_id, e.event_type)
                for e in events]

    @staticmethod
    def _oversize(records: Sequence[_Record], limit: RecordLimit) -> list[Oversize]:
        most = limit.max_event_bytes
        return [Oversize(i, r.event_id, r.event_type, len(r.value)) for i, r in enumerate(records) if len(r.value) > most]

    def _send(self, producer: Producer, records: Sequence[_Record], limit: RecordLimit, timeout: float | None,
              headers: list | None = None) -> None:
        """Produce ``records`` and wait for each one's delivery report; raise on any failure."""
        results: list[tuple[int, KafkaError | None]] = []
        headers = headers or inject_headers()
        for i, record in enumerate(records):
            while True:
                try:
                    producer.produce(record.topic, key=record.key, value=record.value, headers=headers,
                                     on_delivery=lambda err, msg, _i=i: results.append((_i, err)))
                    break
                except BufferError:
                    # Local queue full: serve delivery reports to make room, then retry.
                    producer.poll(0.1)
                except KafkaException as exc:
                    err = _kafka_error(exc)
                    if err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                        raise EventTooLarge([Oversize(i, record.event_id, record.event_type, len(record.value))], limit, str(err)) from exc
                    raise PublishError(f"producing to {record.topic} failed: {exc}") from exc
        # Wait for this batch's own delivery reports, not for everything queued on the
        # shared producer: concurrent callers (receiver requests) must not wait on each
        # other's records. poll() serves whichever callbacks are due.
        deadline = time.monotonic() + (timeout if timeout is not None else 60)
        while len(results) < len(records) and time.monotonic() < deadline:
            producer.poll(0.05)
        self._raise_for(records, list(results), limit)

    def _raise_for(self, records: Sequence[_Record], results: list[tuple[int, KafkaError | None]], limit: RecordLimit) -> None:
        """Raise for a batch whose delivery reports are ``results`` (index, error): too large, or not delivered."""
        failures = [(i, err) for i, err in results if err is not None]
        too_large = [(i, err) for i, err in failures if err.code() == KafkaError.MSG_SIZE_TOO_LARGE]
        if too_large:
            # The pre-check passed them, so the topic takes less than we read: read it again, now.
            self._limit_stale = True
            try:
                fresh: RecordLimit | None = self._ready()[1]
            except Exception:  # noqa: BLE001 - the limit cannot be read now: every refused record is too large, as before
                fresh = None
            # Kafka refuses a whole librdkafka batch: a small record batched with a big one (of this
            # call, or of another request on the same producer) is refused with it. Only a record
            # over the re-read limit is too large; the others are sent again by the caller (a valid
            # 815-byte alert was answered 422 for its neighbour's size — Alertmanager drops a 4xx).
            # Only a limit read from the topic itself tells "batched with a big one" from "too large": with
            # a fallback (no DescribeConfigs right) a record refused alone would be retried for ever.
            over = [(i, err) for i, err in sorted(too_large)
                    if fresh is None or not fresh.confirmed or len(records[i].value) > fresh.max_event_bytes]
            if over:
                oversize = [Oversize(i, records[i].event_id, records[i].event_type, len(records[i].value)) for i, _ in over]
                raise EventTooLarge(oversize, limit, str(over[0][1]))
            self.counters.add_rejected("kafka_unavailable", len(records))
            raise PublishError(f"{len(too_large)} of {len(records)} record(s) refused by Kafka in a batch too large for the topic "
                               f"({too_large[0][1]}); each fits the limit read again ({fresh.bytes} bytes): send them again")
        remaining = len(records) - len(results)
        if remaining or failures:
            reason = str(failures[0][1]) if failures else (self._last_error or f"{remaining} record(s) not acknowledged in time")
            self.counters.add_rejected("kafka_unavailable", len(records))
            raise PublishError(f"{len(failures) + remaining} of {len(records)} record(s) not delivered to Kafka: {reason}")

    def publish_batch(self, events: Sequence, timeout: float | None = None, topic: str | None = None) -> int:
        """Publish events and wait for every ack.

        Raises ``EventTooLarge`` before producing anything when an event is over
        ``max_event_bytes`` (the caller owns that rejection and counts it), and
        ``PublishError`` when Kafka does not acknowledge every record.
        """
        if not events:
            return 0
        producer, limit = self._ready(timeout)
        records = self._records(events, topic)
        oversize = self._oversize(records, limit)
        if oversize:
            raise EventTooLarge(oversize, limit)
        nbytes = sum(len(r.value) for r in records)
        with self._tracer.start_as_current_span("publish_batch") as span:
            span.set_attribute("messaging.batch.message_count", len(events))
            self._send(producer, records, limit, timeout)
        self.counters.add_sent(len(events), nbytes)
        log.info("published %d event(s), %d bytes", len(events), nbytes)
        return len(events)

    async def publish_batch_async(self, events: Sequence, timeout: float | None = None) -> int:
        """``publish_batch`` for an asyncio caller (the receiver): the records are produced on
        the event loop and their acks awaited as one future, served on the loop itself by a
        ``_DeliveryPump``, so a request in flight holds no thread (a thread per request capped
        the receiver at the executor's few threads) and no thread competes with the loop for
        the GIL. Same errors and counters as ``publish_batch``; returns the bytes of the
        acknowledged records (the caller need not encode the events again)."""
        if not events:
            return 0
        ready = self._ready_cached()
        producer, limit = ready if ready is not None else await asyncio.to_thread(self._ready, timeout)
        records = self._records(events)
        oversize = self._oversize(records, limit)
        if oversize:
            raise EventTooLarge(oversize, limit)
        loop = asyncio.get_running_loop()
        pump = self._pump_for(loop)
        results: list[tuple[int, KafkaError | None]] = []
        pending = len(records)
        all_in = loop.create_future()

        def settle(i: int, err: KafkaError | None) -> None:
            nonlocal pending
            results.append((i, err))
            pending -= 1
            if pending == 0 and not all_in.done():
                all_in.set_result(None)

        headers = inject_headers()
        reports = pump.reports
        for i, record in enumerate(records):
            while True:
                try:
                    # The callback runs in whichever thread serves the report (the pump's poll on
                    # this loop, or a flush elsewhere): it only queues the report for the pump.
                    producer.produce(record.topic, key=record.key, value=record.value, headers=headers,
                                     on_delivery=lambda err, msg, _i=i: reports.append((settle, _i, err)))
                    pump.expect(1)
                    break
                except BufferError:
                    pump.tick()  # local queue full: serve delivery reports to make room, then retry
                    await asyncio.sleep(0.01)
                except KafkaException as exc:
                    err = _kafka_error(exc)
                    if err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                        raise EventTooLarge([Oversize(i, record.event_id, record.event_type, len(record.value))], limit, str(err)) from exc
                    raise PublishError(f"producing to {record.topic} failed: {exc}") from exc
        if pending:
            # A timer, not asyncio.timeout/wait_for: no task or cancellation per request. At the
            # deadline the wait ends and _raise_for reports the records without an ack.
            deadline = loop.call_later(timeout if timeout is not None else 60, lambda: all_in.done() or all_in.set_result(None))
            try:
                await all_in
            finally:
                deadline.cancel()
        self._raise_for(records, list(results), limit)
        nbytes = sum(len(r.value) for r in records)
        self.counters.add_sent(len(events), nbytes)
        return nbytes

    def _pump_for(self, loop: asyncio.AbstractEventLoop) -> _DeliveryPump:
        pump = self._pumps.get(loop)
        if pump is None:
            pump = self._pumps[loop] = _DeliveryPump(loop, self._all_producers)
        return pump

    def _all_producers(self) -> list[Producer]:
        return [p for p in (*self._retired, self._producer) if p is not None]

    def publish_fitting(self, events: Sequence, stage: str, timeout: float | None = None) -> int:
        """The collectors' publish: what fits as ``publish_batch``, the rest dead-lettered.

        Each event over ``max_event_bytes`` becomes a ``DeadLetter`` (reason
        ``event_too_large``, its size and the limit in ``error``, the start of its value)
        on the dead-letter topic, acknowledged with the batch, and is counted rejected.
        Returns how many events went to their raw topics. Raises ``PublishError`` as
        ``publish_batch`` does (nothing is counted then; re-send the whole batch).
        """
        if not events:
            return 0
        producer, limit = self._ready(timeout)
        records = self._records(events)
        oversize = self._oversize(records, limit)
        skip = {o.index for o in oversize}
        fitting = [r for i, r in enumerate(records) if i not in skip]
        letters = [self._dead_letter(records[o.index], o, limit, stage) for o in oversize]
        nbytes = sum(len(r.value) for r in fitting)
        with self._tracer.start_as_current_span("publish_batch") as span:
            span.set_attribute("messaging.batch.message_count", len(events))
            self._send(producer, fitting + letters, limit, timeout)
        self.counters.add_sent(len(fitting), nbytes)
        if oversize:
            self.counters.add_rejected("event_too_large", len(oversize))
            shown = "; ".join(f"{o.event_type} {o.event_id} ({o.size_bytes} bytes)" for o in oversize[:3])
            log.warning("%s: %d event(s) over the %d-byte event limit dead-lettered to %s: %s%s", stage, len(oversize),
                        limit.max_event_bytes, self.catalogue.deadletter, shown, f" (+{len(oversize) - 3} more)" if len(oversize) > 3 else "")
        log.info("published %d event(s), %d bytes%s", len(fitting), nbytes, f"; {len(oversize)} dead-lettered" if oversize else "")
        return len(fitting)

    def _dead_letter(self, record: _Record, oversize: Oversize, limit: RecordLimit, stage: str) -> _Record:
        # The dead letter itself must travel: keep at most an event's worth of the value.
        keep = min(DEAD_LETTER_VALUE_BYTES, limit.max_event_bytes // 2)
        letter = DeadLetter(
            reason="event_too_large",
            error=f"{EventTooLarge([oversize], limit)} [size_bytes={oversize.size_bytes} limit_bytes={limit.max_event_bytes}]",
            stage=stage,
            source_topic=record.topic,
            key=record.key.decode("utf-8", "replace") if record.key else None,
            value=record.value[:keep].decode("utf-8", "replace"),
            failed_at=datetime.now(timezone.utc),
        )
        return _Record(self.catalogue.deadletter, record.key, encode_event(letter), record.event_id, "deadletter")

    def publish(self, event, timeout: float | None = None) -> None:
        self.publish_batch([event], timeout=timeout)

    def publish_raw(self, topic: str, key: bytes | None, value: bytes, headers: list | None = None) -> None:
        """Send pre-encoded bytes (dead letters, tests); waits for the ack. No size check."""
        producer, limit = self._ready(30)
        self._send(producer, [_Record(topic, key, value, "-", "raw")], limit, 30, headers)

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            producers = [*self._retired, self._producer]
        for producer in producers:
            if producer is not None:
                producer.flush(timeout)


def read_to_end(config: dict, topic: str, on_value: Callable[[bytes], None], timeout: float = 30.0) -> int:
    """Read ``topic`` from the beginning to the end offsets it had when called; ``on_value``
    gets each record's value. No consumer group (nothing committed). Returns how many
    records were read; raises ``PublishError`` (retriable) when Kafka does not answer in time.
    """
    consumer = Consumer({**config, "group.id": f"gpuledger-reader-{topic}", "enable.auto.commit": False,
                         "enable.partition.eof": False, "logger": logging.getLogger("librdkafka")})
    deadline = time.monotonic() + timeout
    try:
        try:
            partitions = consumer.list_topics(topic, timeout=timeout).topics[topic].partitions
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1] for p in partitions}
        except (KafkaException, KeyError) as exc:
            raise PublishError(f"cannot read {topic}: {exc}") from exc
        todo = {p: end for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in todo])
        n = 0
        while todo:
            if time.monotonic() > deadline:
                raise PublishError(f"reading {topic} to its end took over {timeout:.0f}s ({len(todo)} partition(s) left)")
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            n += 1
            on_value(msg.value())
            if msg.offset() + 1 >= todo.get(msg.partition(), 0):
                todo.pop(msg.partition(), None)
        return n
    finally:
        consumer.close()


def ensure_topics(config: dict, catalogue: TopicCatalogue, timeout: float = 30.0) -> list[str]:
    """Create every catalogue topic that is missing; return the names created.

    Idempotent: existing topics are left alone, but a raw topic whose partition
    count differs from the catalogue's is reported, because it would break
    co-partitioning silently.
    """
    return ensure_specs(config, catalogue.specs(), catalogue.replication_factor, timeout)


def _align_internal_configs(admin: AdminClient, specs, timeout: float) -> None:
    """Set the spec's own settings on existing internal topics where the broker differs."""
    if not specs:
        return
    current = admin.describe_configs([ConfigResource(ResourceType.TOPIC, s.name) for s in specs], request_timeout=timeout)
    by_name = {resource.name: future for resource, future in current.items()}
    changes = []
    for spec in specs:
        try:
            entries = by_name[spec.name].result(timeout=timeout)
        except KafkaException as exc:  # e.g. no DescribeConfigs ACL: the topic works as it is
            log.warning("could not read the settings of existing topic %s (%s); leaving them as they are", spec.name, exc)
            continue
        differing = {k: v for k, v in spec.config.items() if k not in entries or entries[k].value != v}
        if differing:
            changes.append(ConfigResource(ResourceType.TOPIC, spec.name, incremental_configs=[
                ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in sorted(differing.items())]))
    if not changes:
        return
    for resource, future in admin.incremental_alter_configs(changes, request_timeout=timeout).items():
        settings = ", ".join(f"{e.name}={e.value}" for e in resource.incremental_configs)
        try:
            future.result(timeout=timeout)
            log.warning("set %s on existing topic %s (its settings predate this gpuledger)", settings, resource.name)
        except KafkaException as exc:  # e.g. no AlterConfigs ACL: the topic works, restarts just read more
            log.warning("could not set %s on existing topic %s (%s); set them with kafka-configs", settings, resource.name, exc)


def ensure_specs(config: dict, specs, replication_factor: int, timeout: float = 30.0) -> list[str]:
    """Create the missing topics of ``specs`` and wait until the broker's metadata shows
    every one of them with all its partitions (a consumer that joins its group before
    that would silently ignore the topic). Raw and internal topics must have the
    partition count the spec says (co-partitioning). An existing internal topic whose
    settings differ from its spec's own (``TopicSpec.config``: the state changelogs'
    segment and cleaner settings) gets them set: gpuledger owns those topics, and a
    changelog created by an older version would otherwise keep every superseded state."""
    try:
        return _ensure_specs(AdminClient({**config, "logger": logging.getLogger("librdkafka")}), specs, replication_factor, timeout)
    except KafkaException as exc:  # the broker not answering: one clear error (it was a traceback, and a crash-loop)
        raise ProducerError(f"Kafka at {config.get('bootstrap.servers')}: {exc.args[0].str() if exc.args else exc}") from exc


def _ensure_specs(admin, specs, replication_factor: int, timeout: float) -> list[str]:
    existing = admin.list_topics(timeout=timeout).topics
    problems = [
        f"{s.name} has {len(existing[s.name].partitions)} partitions, catalogue says {s.partitions}"
        for s in specs if s.name in existing and s.role in ("raw", "internal") and len(existing[s.name].partitions) != s.partitions
    ]
    if problems:
        raise ProducerError("topics are not co-partitioned: " + "; ".join(problems))
    missing = [s for s in specs if s.name not in existing]
    created = []
    if missing:
        futures = admin.create_topics(
            [NewTopic(s.name, num_partitions=s.partitions, replication_factor=replication_factor, config=s.kafka_config()) for s in missing],
            request_timeout=timeout,
        )
        for name, fut in futures.items():
            try:
                fut.result()
                created.append(name)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise ProducerError(f"creating topic {name} failed: {exc}") from exc
        log.info("created %d topic(s): %s", len(created), ", ".join(created))
    _align_internal_configs(admin, [s for s in specs if s.name in existing and s.role == "internal" and s.config], timeout)
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        absent = [s.name for s in specs if s.name not in topics or len(topics[s.name].partitions) < s.partitions
                  or any(p.leader < 0 for p in topics[s.name].partitions.values())]
        if not absent:
            return created
        if time.monotonic() > deadline:
            raise ProducerError(f"topics not visible in the broker's metadata after {timeout:.0f}s: {', '.join(absent)}")
        time.sleep(0.1)  # polling the broker's metadata: there is no notification to wait on
