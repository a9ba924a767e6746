"""The topic catalogue, and idempotent creation against the real broker."""

import uuid

from confluent_kafka.admin import AdminClient

from producers._kafka import ensure_topics
from schemas.topics import TopicCatalogue


def test_names_follow_the_convention_and_raw_topics_are_co_partitioned():
    cat = TopicCatalogue(prefix="acme", raw_partitions=6)
    assert cat.alert == "acme.alert.v1"
    assert cat.for_family("release.promoted") == "acme.release.v1"
    raw = [s for s in cat.specs() if s.role == "raw"]
    assert {s.partitions for s in raw} == {6}
    assert {s.name for s in raw} == set(cat.raw_topics)
    assert all(s.retention_ms == -1 for s in raw)


def test_ensure_topics_is_idempotent(kafka_bootstrap):
    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:8]}", raw_partitions=3)
    conf = {"bootstrap.servers": kafka_bootstrap}
    created = ensure_topics(conf, cat)
    assert sorted(created) == sorted(s.name for s in cat.specs())
    assert ensure_topics(conf, cat) == []
    md = AdminClient(conf).list_topics(timeout=10)
    for name in cat.raw_topics:
        assert len(md.topics[name].partitions) == 3
