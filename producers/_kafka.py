"""The one Kafka producer wrapper, and idempotent topic creation.

Input: contract events (schemas). Output: records on the catalogue's raw topics,
keyed by the shared correlation key, with W3C trace context in headers.
Guarantees: idempotent producer, acks=all; ``publish_batch`` returns only when every
record of the batch is acknowledged by the broker and raises ``PublishError`` if any
was not, so a caller that answers "accepted" after it has the acks never lies.
Limits: a failed batch may be partly written; re-sending it is harmless because
event ids are deterministic and every table downstream is idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from gpuledger.telemetry import ComponentCounters, inject_headers, tracer
from schemas import encode_event
from schemas.topics import TopicCatalogue

log = logging.getLogger(__name__)


class ProducerError(RuntimeError):
    """Base error of the producers package."""

    retriable = False


class PublishError(ProducerError):
    """Some records of a batch were not acknowledged by Kafka (broker down, timeout)."""

    retriable = True


class KafkaNotConfigured(ProducerError):
    """No bootstrap servers given and no local broker running."""


def resolve_bootstrap(settings) -> str:
    """GPULEDGER_KAFKA_BOOTSTRAP if set, else the local broker of `gpuledger kafka up`."""
    if settings.kafka.bootstrap:
        return settings.kafka.bootstrap
    from gpuledger.localkafka import running_broker

    state = running_broker(Path(settings.data_dir))
    if state:
        return state["bootstrap"]
    raise KafkaNotConfigured("no Kafka to talk to: set GPULEDGER_KAFKA_BOOTSTRAP=host:port or start one with `gpuledger kafka up`")


def client_config(settings) -> dict:
    return {"bootstrap.servers": resolve_bootstrap(settings), **settings.kafka.client_config()}


class EventPublisher:
    """Publishes contract events to their raw topics; thread-safe (librdkafka is)."""

    def __init__(self, config: dict, catalogue: TopicCatalogue, component: str, delivery_timeout_s: float = 30.0) -> None:
        self.catalogue = catalogue
        self.counters = ComponentCounters(component)
        self._tracer = tracer(component)
        self._producer = Producer({
            **config,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "compression.type": "lz4",
            "delivery.timeout.ms": int(delivery_timeout_s * 1000),
            "client.id": f"gpuledger-{component}",
            "error_cb": self._on_error,
            # Same partitioner as the Java client and aiokafka (Faust), so a key lands
            # on the same partition whoever produces it: co-partitioning holds.
            "partitioner": "murmur2_random",
            # librdkafka logs through Python logging instead of raw stderr lines.
            "logger": logging.getLogger("librdkafka"),
        })
        self._last_error: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings, component: str) -> EventPublisher:
        return cls(client_config(settings), settings.kafka.catalogue(), component, settings.kafka.delivery_timeout_s)

    def _on_error(self, err: KafkaError) -> None:
        self._last_error = str(err)
        log.warning("kafka producer: %s", err)

    def connected(self, timeout: float = 2.0) -> bool:
        """True when the broker answers a metadata request (for readiness probes)."""
        try:
            md = self._producer.list_topics(timeout=timeout)
            return bool(md.brokers)
        except KafkaException:
            return False

    def _produce(self, topic: str, key: str, value: bytes, pending: list) -> None:
        def on_delivery(err, msg, _pending=pending):
            _pending.append(err)

        while True:
            try:
                self._producer.produce(topic, key=key.encode(), value=value, headers=inject_headers(), on_delivery=on_delivery)
                return
            except BufferError:
                # Local queue full: serve delivery reports to make room, then retry.
                self._producer.poll(0.1)

    def publish_batch(self, events: Sequence, timeout: float | None = None, topic: str | None = None) -> int:
        """Publish events and wait for every ack; raises PublishError on any failure."""
        if not events:
            return 0
        results: list = []
        nbytes = 0
        with self._tracer.start_as_current_span("publish_batch") as span:
            span.set_attribute("messaging.batch.message_count", len(events))
            for event in events:
                value = encode_event(event)
                nbytes += len(value)
                self._produce(topic or self.catalogue.for_family(event.event_type), event.correlation_key(), value, results)
            # Wait for this batch's own delivery reports, not for everything queued on
            # the shared producer: concurrent callers (receiver requests) must not wait
            # on each other's records. poll() serves whichever callbacks are due.
            deadline = time.monotonic() + (timeout if timeout is not None else 60)
            while len(results) < len(events) and time.monotonic() < deadline:
                self._producer.poll(0.05)
            remaining = len(events) - len(results)
        failures = [r for r in results if r is not None]
        if remaining or failures or len(results) < len(events):
            reason = str(failures[0]) if failures else (self._last_error or f"{remaining} record(s) not acknowledged in time")
            self.counters.add_rejected("kafka_unavailable", len(events))
            raise PublishError(f"{len(failures) + remaining or len(events)} of {len(events)} record(s) not delivered to Kafka: {reason}")
        self.counters.add_sent(len(events), nbytes)
        log.info("published %d event(s), %d bytes", len(events), nbytes)
        return len(events)

    def publish(self, event, timeout: float | None = None) -> None:
        self.publish_batch([event], timeout=timeout)

    def publish_raw(self, topic: str, key: bytes | None, value: bytes, headers: list | None = None) -> None:
        """Send pre-encoded bytes (dead letters, tests); waits for the ack."""
        results: list = []
        self._producer.produce(topic, key=key, value=value, headers=headers or inject_headers(),
                               on_delivery=lambda err, msg: results.append(err))
        self._producer.flush(30)
        if not results or results[0] is not None:
            raise PublishError(f"record not delivered to {topic}: {results[0] if results else 'timeout'}")

    def close(self, timeout: float = 30.0) -> None:
        self._producer.flush(timeout)


def ensure_topics(config: dict, catalogue: TopicCatalogue, timeout: float = 30.0) -> list[str]:
    """Create every catalogue topic that is missing; return the names created.

    Idempotent: existing topics are left alone, but a raw topic whose partition
    count differs from the catalogue's is reported, because it would break
    co-partitioning silently.
    """
    return ensure_specs(config, catalogue.specs(), catalogue.replication_factor, timeout)


def ensure_specs(config: dict, specs, replication_factor: int, timeout: float = 30.0) -> list[str]:
    """Create the missing topics of ``specs`` and wait until the broker's metadata shows
    every one of them with all its partitions (a consumer that joins its group before
    that would silently ignore the topic). Raw and internal topics must have the
    partition count the spec says (co-partitioning)."""
    admin = AdminClient(config)
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
