"""producers/_kafka.py against the real broker: the record limit and events that cannot travel.

Topics whose ``max.message.bytes`` is set small are created by the tests themselves;
what a test asserts is what Kafka holds afterwards (records on the topics) and what the
publisher raised.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timezone

import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from producers._errors import EventTooLarge, PublishError
from producers._kafka import EventPublisher, ensure_topics, read_record_limit
from schemas import decode_event
from schemas.envelope import Identity, Source, make_event_id
from schemas.release import ReleaseEvent, ReleasePayload
from schemas.topics import TopicCatalogue
from tests.fixtures.kafka import read_topic

NOW = datetime.now(timezone.utc).replace(microsecond=0)


def release(n: int, reason_bytes: int = 0) -> ReleaseEvent:
    """A release event; ``reason_bytes`` of random hex (incompressible for lz4) make it big."""
    return ReleaseEvent(
        event_id=make_event_id("test", (n, uuid.uuid4().hex)),
        event_type="release.approved",
        occurred_at=NOW, observed_at=NOW,
        source=Source(collector="test"),
        identity=Identity(release_id=f"model:{n % 5}"),
        payload=ReleasePayload(actor="ci", reason=os.urandom(reason_bytes // 2 + 1).hex()[:reason_bytes] if reason_bytes else None),
    )


def catalogue_with_small_release_topic(bootstrap: str, record_limit: int) -> TopicCatalogue:
    """A fresh catalogue whose release topic takes records up to ``record_limit`` bytes."""
    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=2)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(cat.release, 2, 1, config={"max.message.bytes": str(record_limit)})]).values():
        future.result()
    ensure_topics({"bootstrap.servers": bootstrap}, cat)  # the rest, with the broker's default
    wait_describable(bootstrap, cat.raw_topics)
    return cat


def wait_describable(bootstrap: str, topics, timeout: float = 30.0) -> None:
    """Until the broker serves the topics' configs (a just-created topic is briefly unknown)."""
    deadline = time.monotonic() + timeout
    while not read_record_limit({"bootstrap.servers": bootstrap}, topics).confirmed:
        assert time.monotonic() < deadline, f"{topics} not describable after {timeout}s"
        time.sleep(0.1)


def ids_on(bootstrap: str, topic: str, min_count: int) -> list[str]:
    return [decode_event(m.value()).event_id for m in read_topic(bootstrap, topic, min_count, timeout=30)]


def test_the_limit_follows_the_smallest_raw_topic_and_defaults_to_the_broker(kafka_bootstrap, catalogue):
    small = catalogue_with_small_release_topic(kafka_bootstrap, 200_000)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, small, "test")
    try:
        assert publisher.record_limit.bytes == 200_000 and small.release in publisher.record_limit.source
        assert publisher.max_event_bytes == 50_000
    finally:
        publisher.close(5)
    # Topics created with the broker's defaults: 1,048,588 bytes, so the 256 KiB cap holds.
    wait_describable(kafka_bootstrap, catalogue.raw_topics)
    default = read_record_limit({"bootstrap.servers": kafka_bootstrap}, catalogue.raw_topics)
    assert (default.bytes, default.max_event_bytes, default.confirmed) == (1_048_588, 256 * 1024, True)
    # A raw topic that does not exist yet counts with the broker's value, and is read again later.
    missing = read_record_limit({"bootstrap.servers": kafka_bootstrap}, [*catalogue.raw_topics, f"{catalogue.prefix}.missing.v1"])
    assert (missing.bytes, missing.confirmed) == (1_048_588, False)


def test_many_small_events_reach_a_small_limit_topic(kafka_bootstrap):
    """librdkafka batches are one record for the broker: they must stay under the topic's limit."""
    small = catalogue_with_small_release_topic(kafka_bootstrap, 200_000)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, small, "test")
    events = [release(i, reason_bytes=2_000) for i in range(400)]  # ~1 MB, far over one 200 KB record
    try:
        assert publisher.publish_batch(events) == 400
    finally:
        publisher.close(5)
    assert sorted(ids_on(kafka_bootstrap, small.release, 400)) == sorted(e.event_id for e in events)


def test_an_oversize_event_refuses_its_whole_batch_before_anything_is_written(kafka_bootstrap, catalogue):
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    big = release(1, reason_bytes=300_000)
    try:
        with pytest.raises(EventTooLarge) as info:
            publisher.publish_batch([release(0), big, release(2)])
        exc = info.value
        assert (exc.index, exc.event_id, exc.event_type, exc.limit_bytes) == (1, big.event_id, "release.approved", 256 * 1024)
        assert exc.size_bytes > 300_000 and exc.retriable is False and not isinstance(exc, PublishError)
        for part in (big.event_id, "release.approved", str(exc.size_bytes), str(256 * 1024)):
            assert part in str(exc)
        after = release(3)
        publisher.publish_batch([after])
    finally:
        publisher.close(5)
    # Only the batch sent afterwards is on the topic: nothing of the refused one.
    assert ids_on(kafka_bootstrap, catalogue.release, 1) == [after.event_id]


def test_kafka_refusing_a_record_for_its_size_is_too_large_not_retriable(kafka_bootstrap):
    cat = catalogue_with_small_release_topic(kafka_bootstrap, 1_048_588)
    config = {"bootstrap.servers": kafka_bootstrap}
    publisher = EventPublisher(config, cat, "test")
    try:
        assert publisher.max_event_bytes == 256 * 1024  # learned before the topic shrinks
        resource = ConfigResource(ResourceType.TOPIC, cat.release,
                                  incremental_configs=[ConfigEntry("max.message.bytes", "20000", incremental_operation=AlterConfigOpType.SET)])
        admin = AdminClient(config)
        admin.incremental_alter_configs([resource])[resource].result()
        deadline = time.monotonic() + 30
        while read_record_limit(config, [cat.release]).bytes != 20_000:
            assert time.monotonic() < deadline, "the broker never applied max.message.bytes=20000"
            time.sleep(0.1)
        event = release(1, reason_bytes=60_000)  # under the learned limit, over the topic's new one
        with pytest.raises(EventTooLarge) as info:
            publisher.publish_batch([event])
        assert info.value.retriable is False and "Kafka refused" in str(info.value) and info.value.event_id == event.event_id
        # The limit is read again: the same event is now refused before it is produced.
        assert publisher.record_limit.bytes == 20_000
        with pytest.raises(EventTooLarge) as again:
            publisher.publish_batch([event])
        assert again.value.limit_bytes == 5_000 and "Kafka refused" not in str(again.value)
    finally:
        publisher.close(5)


def test_a_small_event_refused_with_a_big_neighbour_is_retriable_not_too_large(kafka_bootstrap):
    """Kafka refuses a librdkafka batch whole: a small event that shared a batch with one over the
    topic's lowered limit (another request's, on the receiver's one producer) was reported too
    large with it — the receiver answered 422 for an 815-byte alert, which Alertmanager never sends
    again. Now the limit is read again at once and only an event over it is too large; one under
    it is a retriable failure (503: the sender retries; event ids are deterministic). The batching
    itself depends on timing, so the refusals are handed in as librdkafka reports them."""
    from confluent_kafka import KafkaError

    cat = catalogue_with_small_release_topic(kafka_bootstrap, 1_048_588)
    config = {"bootstrap.servers": kafka_bootstrap}
    publisher = EventPublisher(config, cat, "test")
    try:
        believed = publisher.record_limit  # learned before the topic shrinks
        assert believed.max_event_bytes == 256 * 1024
        resource = ConfigResource(ResourceType.TOPIC, cat.release,
                                  incremental_configs=[ConfigEntry("max.message.bytes", "20000", incremental_operation=AlterConfigOpType.SET)])
        admin = AdminClient(config)  # (kept: a client collected before its future resolves fails it)
        admin.incremental_alter_configs([resource])[resource].result()
        deadline = time.monotonic() + 30
        while read_record_limit(config, [cat.release]).bytes != 20_000:
            assert time.monotonic() < deadline, "the broker never applied max.message.bytes=20000"
            time.sleep(0.1)
        refused = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large")
        small, big = release(1), release(2, reason_bytes=60_000)
        records = publisher._records([small, big], None)
        with pytest.raises(EventTooLarge) as info:
            publisher._raise_for(records, [(0, refused), (1, refused)], believed)
        assert [o.event_id for o in info.value.oversize] == [big.event_id], info.value  # not the small one
        with pytest.raises(PublishError) as retriable:
            publisher._raise_for(records[:1], [(0, refused)], believed)
        assert retriable.value.retriable is True and "each fits the limit read again (20000 bytes)" in str(retriable.value)
        assert not isinstance(retriable.value, EventTooLarge)
    finally:
        publisher.close(5)


def test_async_batches_are_acknowledged_while_a_thread_publishes_on_the_same_producer(kafka_bootstrap, catalogue):
    # publish_batch_async's acks are served on the event loop; a synchronous publish polling the
    # shared producer from another thread (the receiver's dead letters) may serve some of them:
    # every awaited batch still returns, and every record is on its topic once.
    import asyncio

    from schemas import encode_event

    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    events = [release(n) for n in range(60)]
    raw = [release(1000 + n) for n in range(20)]

    async def main() -> list[int]:
        def sync_side() -> None:
            for event in raw:
                publisher.publish_raw(catalogue.release, event.correlation_key().encode(), encode_event(event))

        thread = asyncio.to_thread(sync_side)
        batches = [publisher.publish_batch_async(events[i:i + 3], timeout=30) for i in range(0, len(events), 3)]
        *sizes, _ = await asyncio.gather(*batches, thread)
        return sizes

    try:
        sizes = asyncio.run(main())
        assert sizes == [sum(len(encode_event(e)) for e in events[i:i + 3]) for i in range(0, len(events), 3)]
        assert sorted(ids_on(kafka_bootstrap, catalogue.release, len(events) + len(raw))) == sorted(e.event_id for e in events + raw)
        assert publisher.counters.totals["sent"] == len(events)
    finally:
        publisher.close(5)


def test_consumer_lag_counts_what_the_group_has_not_committed_per_assigned_partition(kafka_bootstrap):
    """ConsumerLag (the health pages' ``lag``): from librdkafka's statistics, the records
    between each assigned partition's end and the group's committed offset."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from producers._kafka import ConsumerLag

    topic = f"lag-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_topics([NewTopic(topic, 2, 1)]).values():
        future.result(30)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(10):
        producer.produce(topic, b"x", partition=0)
    for i in range(3):
        producer.produce(topic, b"y", partition=1)
    assert producer.flush(30) == 0
    lag = ConsumerLag(interval_ms=200)
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{topic}", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **lag.consumer_config()})
    try:
        assert lag.health() == {"total": 0, "partitions": {}, "unknown": 0, "age_s": None, "stale": True}  # no statistics yet
        # Statistics with no partition assigned (not subscribed yet: as a consumer that cannot reach
        # its broker) are no lag: stale, not a fresh 0 (an SRE read "caught up" while the group trailed).
        deadline = time.monotonic() + 10
        while lag.health()["age_s"] is None and time.monotonic() < deadline:
            consumer.poll(0.1)
        assert lag.health()["age_s"] is not None and lag.health()["partitions"] == {} and lag.health()["stale"] is True
        consumer.subscribe([topic])
        read = 0
        deadline = time.monotonic() + 30
        while read < 13 and time.monotonic() < deadline:
            read += sum(1 for m in consumer.consume(20, 0.5) if not m.error())
        assert read == 13
        # nothing committed yet: the lag is not known (not 0, not the whole partition)
        deadline = time.monotonic() + 10
        while lag.health()["unknown"] != 2 and time.monotonic() < deadline:
            consumer.poll(0.1)
        assert lag.health()["partitions"] == {f"{topic}[0]": None, f"{topic}[1]": None}
        consumer.commit(offsets=[TopicPartition(topic, 0, 4), TopicPartition(topic, 1, 3)], asynchronous=False)

        def seen() -> dict:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                consumer.poll(0.1)
                health = lag.health()
                if health["unknown"] == 0 and health["partitions"]:
                    return health
            return lag.health()

        first = seen()
        assert first["partitions"] == {f"{topic}[0]": 6, f"{topic}[1]": 0} and first["total"] == 6, first
        assert first["age_s"] is not None and first["age_s"] < 5 and first["stale"] is False
        consumer.commit(offsets=[TopicPartition(topic, 0, 10)], asynchronous=False)
        deadline = time.monotonic() + 10
        while lag.health()["total"] != 0 and time.monotonic() < deadline:
            consumer.poll(0.1)
        assert lag.health()["partitions"] == {f"{topic}[0]": 0, f"{topic}[1]": 0}
    finally:
        consumer.close()
