"""The latency benchmark's load generator (``benchmarks/bench.py``, ``LiveLoad``) publishes
what the product's publisher would: the same events of the mix, on the same family topic,
under the same key, with ``occurred_at``/``observed_at`` set to the instant the fixed rate
scheduled each (its wait for a tick is part of the lag measured)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import orjson
import pytest

from benchmarks.bench import LiveLoad, Stamps
from benchmarks.mix import RELEASES, events
from producers._kafka import EventPublisher, ensure_topics
from schemas import decode_event, encode_event
from schemas.topics import TopicCatalogue
from tests.fixtures.kafka import read_topic


def _published(bootstrap: str, cat: TopicCatalogue, expected: list) -> dict:
    """event id -> (topic, key, event decoded) of what is on the family topics of ``expected``
    (waiting for as many records on each as ``expected`` has for it)."""
    got = {}
    for family in {cat.for_family(e.event_type) for e in expected}:
        n = sum(1 for e in expected if cat.for_family(e.event_type) == family)
        for m in read_topic(bootstrap, family, min_count=n):
            event = decode_event(m.value())
            got[event.event_id] = (m.topic(), m.key(), event)
    return got


def test_the_live_load_sends_the_mix_stamped_at_the_time_the_rate_schedules_it(kafka_bootstrap):
    cat = TopicCatalogue(prefix=f"loadtest-{uuid.uuid4().hex[:8]}", raw_partitions=1)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "bench")
    load = LiveLoad(publisher, 12, start=RELEASES)
    start = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)
    due = lambda j: start.timestamp() + j / 4  # 4 events/s  # noqa: E731
    assert load.publish(5, due) == 5 and load.publish(100, due) == 7 and load.publish(1, due) == 0  # 12 in all, then none left
    load.close()
    publisher.close(5)

    expected = list(events(12, start=RELEASES))  # the historical form of the same 12 events
    assert [e.event_id for e in expected] == [e.event_id for e in list(events(RELEASES + 12))[RELEASES:]]  # start= skips
    got = _published(kafka_bootstrap, cat, expected)
    assert set(got) == {e.event_id for e in expected}
    for j, e in enumerate(expected):
        topic, key, sent = got[e.event_id]
        assert topic == cat.for_family(e.event_type) and key == e.correlation_key().encode()
        assert sent.occurred_at == start + timedelta(seconds=j / 4) and sent.observed_at == sent.occurred_at
        payload = sent.payload
        if getattr(payload, "starts_at", None) is not None:  # an alert starts when it occurs
            assert payload.starts_at == sent.occurred_at
            payload = payload.model_copy(update={"starts_at": e.payload.starts_at})
        # apart from the times, the event the product's encoder gives
        assert encode_event(sent.model_copy(update={"occurred_at": e.occurred_at, "observed_at": e.observed_at,
                                                    "payload": payload})) == encode_event(e)


def test_the_live_loads_stamps_are_the_times_the_encoder_writes_for_the_scheduled_instants():
    """``Stamps`` (the text up to the second made once per second) writes what the product's
    encoder writes for ``datetime.fromtimestamp`` of each scheduled instant — at rates whose
    instants fall on every microsecond rounding, across second (and day) boundaries."""
    stamps = Stamps()
    start = datetime(2026, 12, 4, 23, 59, 58, 999_999, tzinfo=timezone.utc).timestamp()
    checked = 0
    for rate in (7_850.0, 3_100.0, 999.7):
        for j in range(int(3 * rate)):
            instant = start + j / rate
            expected = orjson.dumps(datetime.fromtimestamp(instant, timezone.utc), option=orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC)
            written = stamps(instant)
            if b"." not in expected:  # (orjson, as isoformat, writes no fraction for a whole second; the stamp writes six zeros)
                expected = expected[:-2] + b'.000000Z"'
            assert written == expected, (rate, j)
            checked += 1
    assert checked > 30_000 and stamps(start) == b'"2026-12-04T23:59:58.999999Z"' and stamps(start + 1e-6) == b'"2026-12-04T23:59:59.000000Z"'


def _bulk_and_live(live_sink_ms: float) -> dict:
    """A bench result with a bulk phase (5,000/s) and a latency run (4,000/s), as the summary reads them."""
    return {"published": 1000, "config": {"prefix": "p"}, "ratios": {"worker_vs_passthrough_pct": None, "replay_vs_worker": None},
            "worker": {"events_per_s": 5000.0, "cpu_ms_per_event": {"worker": 0.1, "route": 0.02, "sink": 0.08, "broker": 0.05}},
            "latency": {"p50_s": 1.0, "p99_s": 2.5, "achieved_rate": 4000.0, "complete": True, "machine_busy_cores": 1.6, "machine_cores": 2,
                        "cpu_ms_per_event": {"worker": 0.15, "route": 0.03, "sink": live_sink_ms}, "broker_cpu_cores": 0.4,
                        "publisher_cpu_cores": 0.08}}


def test_the_summary_sets_the_live_cpu_per_event_of_all_processes_beside_the_bulk_phases():
    """``make bench``'s summary line for what the latency target asks of the machine: the live
    run's CPU per event with the publisher's and the broker's share (cores / events/s), the bulk
    phase's (its processes' and broker's ms per event), and the cores each kept busy."""
    from benchmarks.bench import report

    r = _bulk_and_live(live_sink_ms=0.1)
    line = next(x for x in report(r).splitlines() if x.startswith("CPU per event, all processes: live"))
    # live: 0.15 + 0.03 + 0.1 + (0.4 + 0.08) / 4000 s = 0.28 + 0.12 ms; bulk: 0.25 ms
    assert line == ("CPU per event, all processes: live 0.400 ms (publisher and broker included), bulk 0.250 ms; "
                    "cores busy: live 1.60 at 4,000/s, bulk 1.25 at 5,000/s")


def test_the_summary_says_which_process_costs_more_per_event_live_than_in_bulk_largest_first():
    """Where the live run's extra CPU per event goes, process by process (the publisher's whole
    share is extra: the bulk phase published before its clock started), largest first: the line
    that tells a session chasing the latency target where to look."""
    from benchmarks.bench import report

    r = _bulk_and_live(live_sink_ms=0.07)
    line = next(x for x in report(r).splitlines() if x.startswith("  live − bulk"))
    # broker 0.4 / 4000 s = 0.1 ms live vs 0.05; publisher 0.08 / 4000 s = 0.02 ms vs none; sink cheaper live
    assert line == ("  live − bulk per event, by process: broker +0.050 ms, worker +0.050 ms, publisher +0.020 ms, "
                    "route +0.010 ms, sink -0.010 ms")


def test_each_stage_busy_share_is_its_loops_held_time_over_the_run_and_the_correlations_collections():
    """``stage_busy``: per stage, the change of its health ``busy_s`` over the live run's wall
    time; the correlation stage (the worker's own process) adds its collections (health ``gc``)."""
    from benchmarks.bench import stage_busy

    before = ({"correlate_entities": {"busy_s": {"batches": 10.0, "commits": 1.0}},
               "route_events": {"busy_s": {"batches": 3.0, "commits": 0.5}},
               "evaluate_controls": {"batches": 4}},  # an older worker: no busy_s, left out
              {"seconds": 2.0})
    after = ({"correlate_entities": {"busy_s": {"batches": 55.0, "commits": 7.0}},
              "route_events": {"busy_s": {"batches": 15.0, "commits": 0.5}},
              "evaluate_controls": {"batches": 9}},
             {"seconds": 5.0})
    busy = stage_busy(before, after, 60.0)
    assert sorted(busy) == ["correlate_entities", "route_events"]
    assert busy["correlate_entities"] == pytest.approx({"total": (45 + 6 + 3) / 60, "batches": 45 / 60, "commits": 6 / 60,
                                                        "collections": 3 / 60})
    assert busy["route_events"] == pytest.approx({"total": 12 / 60, "batches": 12 / 60, "commits": 0.0})
    # the line the bulk and the live phase print (fmt_busy): collections only where measured
    from benchmarks.bench import fmt_busy

    assert fmt_busy(busy) == ("correlate_entities 90% (batches 75%, taking commits 10%, collections 5%); "
                              "route_events 20% (batches 20%, taking commits 0%)")


def test_the_at_rest_floor_is_taken_out_of_the_live_cpu_per_event_and_summed_in_the_summary():
    """The latency run measures its processes with no input first (``REST_S``): the live CPU per
    event less that floor's share at the achieved rate is what each further event cost, and the
    summary gives the floor in cores."""
    from benchmarks.bench import above_rest, report

    # 0.2 of a core at rest is 0.05 ms of each of 4,000 events/s; a process not measured at rest keeps its figure
    assert above_rest({"worker": 0.15, "sink": 0.1, "route": 0.03}, {"worker": 0.2, "sink": 0.3}, 4000.0) == \
        pytest.approx({"worker": 0.1, "sink": 0.025, "route": 0.03})
    r = {"published": 1000, "config": {"prefix": "p"}, "ratios": {"worker_vs_passthrough_pct": None, "replay_vs_worker": None},
         "latency": {"p50_s": 1.0, "p99_s": 2.5, "achieved_rate": 4000.0, "complete": True, "machine_cores": 2,
                     "rest_cores": {"worker": 0.1, "route": 0.02, "sink": 0.25, "broker": 0.2}}}
    line = next(x for x in report(r).splitlines() if x.startswith("at rest"))
    assert line == ("at rest (warmed up, no input): 0.57 of 2 cores busy "
                    "(worker 0.10, its route stage 0.02, its sink 0.25, the broker 0.20)")


def test_the_summary_sets_the_latency_runs_rate_against_the_end_to_end_rate_of_the_bulk_phase():
    """The correlated rate counts the correlation stage alone while the sink (a lower priority)
    stores behind it; the summary gives what the whole pipeline sustained in phase 3 — 99 % of its
    inputs over the time until they were queryable — and the latency run's rate as a share of it."""
    from benchmarks.bench import report

    r = {"published": 50_000, "config": {"prefix": "p"}, "ratios": {"worker_vs_passthrough_pct": None, "replay_vs_worker": None},
         "worker": {"events": 50_000, "events_per_s": 7000.0, "queryable_s": 9.0, "first_routed": 4_500},
         "latency": {"p50_s": 1.0, "p99_s": 2.5, "achieved_rate": 5000.0, "complete": True}}
    line = next(x for x in report(r).splitlines() if x.startswith("end to end"))
    # (0.99 * 50,000 - the first routed batch's 4,500, routed before the clock started) / 9 s = 5,000/s
    assert line == "end to end (phase 3, ≥99% queryable): 5,000 events/s; the latency run's rate is 100 % of it"
    del r["worker"]["queryable_s"]  # the store never got there: no line rather than a made-up rate
    assert not [x for x in report(r).splitlines() if x.startswith("end to end")]


def test_publishing_at_a_rate_for_a_time_with_finish_sends_all_it_schedules(kafka_bootstrap):
    """The latency run's warm-up (``publish_at(..., finish=True)``) publishes every event its
    rate schedules in its time — the run after it starts at the next event of the mix, so none
    may be left unsent — stamped at the rate's instants."""
    from benchmarks.bench import publish_at

    cat = TopicCatalogue(prefix=f"loadtest-{uuid.uuid4().hex[:8]}", raw_partitions=1)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "bench")
    rate, seconds = 40.0, 0.3  # 12 events scheduled, the last ones due in the final tick
    load = LiveLoad(publisher, 12, start=RELEASES)
    sent = publish_at(load, rate, seconds, finish=True)
    load.close()
    publisher.close(5)
    assert sent == 12 and load.sent == 12

    expected = list(events(12, start=RELEASES))
    stamps = {event_id: event.occurred_at for event_id, (_topic, _key, event) in _published(kafka_bootstrap, cat, expected).items()}
    assert set(stamps) == {e.event_id for e in expected}
    ordered = [stamps[e.event_id] for e in expected]
    gaps = [(b - a).total_seconds() for a, b in zip(ordered, ordered[1:])]
    assert all(abs(g - 1 / rate) < 0.001 for g in gaps), gaps  # stamped 25 ms apart: the rate's schedule
