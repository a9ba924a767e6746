"""The topic catalogue, and idempotent creation against the real broker."""

import uuid

from confluent_kafka.admin import AdminClient, ConfigResource

from producers._kafka import ensure_specs, ensure_topics
from schemas.topics import TopicCatalogue, TopicSpec
from tests.fixtures.waiting import poll


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


def _settings(admin: AdminClient, topic: str) -> dict[str, str]:
    """A topic's settings as the broker reports them."""
    (future,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
    return {name: entry.value for name, entry in future.result(timeout=30).items()}


def test_a_runs_state_changelogs_are_created_compacted_with_segments_the_cleaner_can_take(kafka_bootstrap):
    """The changelogs are read whole at every start: their segments must roll (the active
    one is never compacted), or a restart reads every version ever written."""
    conf = {"bootstrap.servers": kafka_bootstrap}
    run = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:8]}").run("app")
    ensure_specs(conf, run.specs(), 1)
    admin = AdminClient(conf)
    for topic in (run.entities_changelog, run.controls_changelog):
        configs = _settings(admin, topic)
        assert configs["cleanup.policy"] == "compact", topic
        assert configs["segment.bytes"] == str(16 * 1024 * 1024), topic
        assert configs["segment.ms"] == str(10 * 60 * 1000), topic
        assert configs["min.cleanable.dirty.ratio"] == "0.1", topic
    assert _settings(admin, run.correlated)["segment.bytes"] == str(1024 ** 3)  # outputs keep the broker's default


def test_a_changelog_created_with_the_brokers_defaults_gets_the_settings_when_the_run_starts_again(kafka_bootstrap):
    """A changelog an older gpuledger created keeps every superseded state until its settings
    are set; ensuring the run's topics (the worker does at every start) sets them."""
    conf = {"bootstrap.servers": kafka_bootstrap}
    run = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:8]}").run("app")
    admin = AdminClient(conf)
    # As an older gpuledger created it: compacted, no settings of its own (and visible once this returns).
    ensure_specs(conf, [TopicSpec(run.entities_changelog, run.partitions, "entity key", -1, "compact", role="internal")], 1)
    assert _settings(admin, run.entities_changelog)["segment.bytes"] == str(1024 ** 3)
    created = ensure_specs(conf, run.specs(), 1)
    assert run.entities_changelog not in created
    wanted = (str(16 * 1024 * 1024), str(600_000), "0.1")
    seen: list = []

    def applied() -> bool:  # the broker applies an altered config through its metadata log
        after = _settings(admin, run.entities_changelog)
        seen[:] = [(after["segment.bytes"], after["segment.ms"], after["min.cleanable.dirty.ratio"]), after["cleanup.policy"]]
        return seen[0] == wanted

    poll(applied, f"{run.entities_changelog} to carry {wanted}", timeout=15, every=0.1)
    assert seen == [wanted, "compact"]
