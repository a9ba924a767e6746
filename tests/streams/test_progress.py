"""streams.progress: the caught-up check reads exactly the groups and topics the worker, its route and controls stages and its sink read."""

from __future__ import annotations

import confluent_kafka

from gpuledger.settings import KafkaSettings, Settings
from sinks.clickhouse import migrated_store
from sinks.service import SinkContext, build_sink
from streams.app import create_app
from streams.controls.service import ControlsStage
from streams.correlate.route import RouteStage
from streams.progress import Look, worker_groups


class RecordingConsumer:
    """Stands in for the route and controls stages' and the sink loop's consumers: records their group and subscription."""

    made: list = []

    def __init__(self, config: dict) -> None:
        self.group, self.topics = config["group.id"], []
        RecordingConsumer.made.append(self)

    def subscribe(self, topics, **_callbacks) -> None:
        self.topics = list(topics)


def test_the_groups_and_topics_are_the_ones_the_worker_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(confluent_kafka, "Consumer", RecordingConsumer)
    settings = Settings(data_dir=tmp_path, kafka=KafkaSettings(bootstrap="127.0.0.1:9", topic_prefix="p"))
    app = create_app(settings)
    RouteStage(settings)  # what the route process builds
    ControlsStage(settings)  # what the controls process builds
    build_sink(settings, SinkContext(settings), migrated_store(f"chdb://{tmp_path / 'ch'}", "gpuledger"))  # lazy: nothing is opened
    read = {settings.streams.app_id: {t for agent in app.agents.values() for t in agent.channel.topics}}
    read.update({c.group: set(c.topics) for c in RecordingConsumer.made})
    assert read == {group: set(topics) for group, topics in worker_groups(settings.kafka.catalogue(), settings.streams.app_id).items()}


def test_a_look_is_caught_up_only_when_nothing_is_left_anywhere():
    assert Look(done=10, total=10, inputs_left=0, run_lag=0, parked=0, status="ok").caught_up
    for left in ({"inputs_left": 1}, {"run_lag": 3}, {"parked": 2}, {"parked": None}, {"status": "degraded"}, {"status": None}):
        look = {"done": 10, "total": 10, "inputs_left": 0, "run_lag": 0, "parked": 0, "status": "ok", **left}
        assert not Look(**look).caught_up, left
