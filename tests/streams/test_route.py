"""The route stage's batch logic (streams/correlate/route.py: ``Router.route_batch``) in a replay's
range, driven without Kafka: what it packs for the route topic and dead-letters is collected."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from types import SimpleNamespace

import orjson

from gpuledger.settings import Settings
from schemas import encode_event
from streams.correlate.route import Router
from tests.streams.harness import at, pod_event


class Collected:
    def __init__(self) -> None:
        self.topics: list[str] = []

    def produce(self, topic, key, value, partition=None, source=None, headers=None) -> None:
        self.topics.append(topic)


def test_a_malformed_record_of_a_time_outside_the_replays_range_is_skipped_not_dead_lettered():
    """A replay's route stage dead-lettered a malformed event before its range check: one from a
    month before the range went into the range's sandbox (dead_letters) and was counted in range."""
    settings = Settings()
    settings.streams.replay_from, settings.streams.replay_to = at(10), at(20)
    good = encode_event(pod_event("scheduler.scheduled", 15, pod="in-range"))
    malformed = orjson.loads(encode_event(pod_event("scheduler.scheduled", 15, pod="bad")))
    malformed["event_type"] = "scheduler.nonsense"
    outside = {**malformed, "occurred_at": (at(10) - timedelta(days=30)).isoformat()}
    no_utc = {**malformed, "occurred_at": "0001-01-01T00:00:00+01:00"}  # (no UTC time: it crashed the stage, on every restart)
    records = [good, orjson.dumps(malformed), orjson.dumps(outside), b"not json", orjson.dumps(no_utc)]
    out = Collected()
    router = Router(settings, out)
    raw = [SimpleNamespace(message=SimpleNamespace(topic="raw", partition=0, offset=i, key=None, value=v)) for i, v in enumerate(records)]
    asyncio.run(router.route_batch(raw))
    run = settings.kafka.catalogue().run(settings.streams.app_id)
    assert out.topics.count(run.deadletter) == 3  # the in-range malformed one, and the two with no time to judge them by
    assert (router.stats["routed"], router.stats["out_of_range"], router.stats["dead_letters"]) == (1, 1, 3)
