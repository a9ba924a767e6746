"""The latency benchmark's load generator (``benchmarks/bench.py``, ``LiveLoad``) publishes
what the product's publisher would: the same events of the mix, on the same family topic,
under the same key, with ``occurred_at``/``observed_at`` set to the time each was sent."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from benchmarks.bench import LiveLoad
from benchmarks.mix import RELEASES, events
from producers._kafka import EventPublisher, ensure_topics
from schemas import decode_event, encode_event
from schemas.topics import TopicCatalogue
from tests.fixtures.kafka import read_topic


def test_the_live_load_sends_the_mix_stamped_at_the_time_of_sending(kafka_bootstrap):
    cat = TopicCatalogue(prefix=f"loadtest-{uuid.uuid4().hex[:8]}", raw_partitions=1)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "bench")
    load = LiveLoad(publisher, 12, start=RELEASES)
    before = datetime.now(timezone.utc)
    assert load.publish(5) == 5 and load.publish(100) == 7 and load.publish(1) == 0  # 12 in all, then none left
    load.close()
    publisher.close(5)
    after = datetime.now(timezone.utc)

    expected = list(events(12, start=RELEASES))  # the historical form of the same 12 events
    assert [e.event_id for e in expected] == [e.event_id for e in list(events(RELEASES + 12))[RELEASES:]]  # start= skips
    got = {}
    for family in {cat.for_family(e.event_type) for e in expected}:
        n = sum(1 for e in expected if cat.for_family(e.event_type) == family)
        for m in read_topic(kafka_bootstrap, family, min_count=n):
            event = decode_event(m.value())
            got[event.event_id] = (m.topic(), m.key(), event)
    assert set(got) == {e.event_id for e in expected}
    for e in expected:
        topic, key, sent = got[e.event_id]
        assert topic == cat.for_family(e.event_type) and key == e.correlation_key().encode()
        assert before - timedelta(seconds=1) <= sent.occurred_at <= after and sent.observed_at == sent.occurred_at
        payload = sent.payload
        if getattr(payload, "starts_at", None) is not None:  # an alert starts when it occurs
            assert payload.starts_at == sent.occurred_at
            payload = payload.model_copy(update={"starts_at": e.payload.starts_at})
        # apart from the times, the event the product's encoder gives
        assert encode_event(sent.model_copy(update={"occurred_at": e.occurred_at, "observed_at": e.observed_at,
                                                    "payload": payload})) == encode_event(e)
