"""The control agents through the real pipeline: real broker, the real `gpuledger worker`
(Faust + embedded ClickHouse) in its own process, violations read back from the
violations topic. The rules themselves are checked one by one in test_controls_rules.py;
here: violations open, close (same id, version + 1) and stay silent as events flow,
deadlines fire on the event-time watermark, and a replay into a fresh consumer group
ends with the same latest violations."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

from confluent_kafka import Consumer, TopicPartition

from producers._kafka import EventPublisher
from schemas import Violation
from streams.controls.rules import is_withdrawn
from streams.progress import RunProgress, wait_caught_up, worker_health
from tests.fixtures.kafka import read_topic
from tests.streams.harness import at, gpu_event
from tests.streams.test_controls_rules import firing, rel, released, sched

FAST = {"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"}

FIRST = [
    # approved and promoted: must stay silent
    *released("r-ok"), sched("scheduler.scheduled", 10, pod="ok-1", workload="ml/Job/ok", release_id="r-ok"),
    # admitted before any approval: control 1 opens (and 2: never promoted)
    rel("release.registered", 0, "r-late", actor="ci-pipeline"),
    sched("scheduler.scheduled", 10, pod="late-1", workload="ml/Job/late", release_id="r-late"),
    # an admin action by an actor without the right: control 7
    rel("release.queue_paused", 15, "r-ok", actor="mallory", target="prod-inference", expires_at=at(60)),
    # retired at 30 while still holding a GPU; grace 1h -> control 8 once the watermark passes 90
    *released("r-ret"), sched("scheduler.scheduled", 5, pod="ret-1", workload="ml/Job/ret", release_id="r-ret"),
    gpu_event("gpu.assigned", 6, pod="ret-1", device="GPU-RET"), rel("release.retired", 30, "r-ret", actor="alice"),
    # an alert on a pod of r-ok: joined, silent; an alert no label of which names anything: control 6
    firing(11, fp="on-ok", namespace="ml", pod="ok-1"), firing(12, fp="lonely"),
]
SECOND = [
    rel("release.approved", 20, "r-late", actor="alice"),      # closes control 1 at 20
    rel("release.evaluated", 200, "r-ok", actor="eval-bot"),   # moves the watermark past the retirement grace
]


def publish(bootstrap, cat, events):
    EventPublisher({"bootstrap.servers": bootstrap}, cat, "test").publish_batch(events)


def latest(bootstrap, cat) -> dict[str, Violation]:
    out: dict[str, Violation] = {}
    for msg in read_topic(bootstrap, cat.run(f"{cat.prefix}-app").violations, min_count=1, timeout=5, settle=1.0):
        v = Violation.model_validate_json(msg.value())
        if v.violation_id not in out or v.version > out[v.violation_id].version:
            out[v.violation_id] = v
    return out


def wait_until(bootstrap, cat, check, timeout=90.0) -> dict[str, Violation]:
    deadline = time.monotonic() + timeout
    got: dict[str, Violation] = {}
    while time.monotonic() < deadline:
        got = latest(bootstrap, cat)
        if check(got):
            return got
        time.sleep(1)
    raise AssertionError("violations never matched: " + "; ".join(f"{v.control_id} v{v.version} {v.opened_at}->{v.closed_at} {v.detail}"
                                                                  for v in got.values()))


def by_control(got: dict[str, Violation]) -> dict[int, list[Violation]]:
    out: dict[int, list[Violation]] = {}
    for v in got.values():
        out.setdefault(v.control_id, []).append(v)
    return out


def test_violations_open_close_and_replay_to_the_same_latest_state(kafka_bootstrap, catalogue, worker_factory):
    live = worker_factory(catalogue, extra_env=FAST)
    publish(kafka_bootstrap, catalogue, FIRST)

    def opened(got):
        c = by_control(got)
        return ({1, 2, 6, 7} <= set(c) and c[1][0].closed_at is None and 8 not in c)

    got = wait_until(kafka_bootstrap, catalogue, opened)
    c = by_control(got)
    assert [v.identity.release_id for v in c[1]] == ["r-late"] and c[1][0].opened_at == at(10) and c[1][0].owner == "team-platform"
    assert "mallory" in c[7][0].detail and c[7][0].evidence
    assert [v.identity.alert_fingerprint for v in c[6]] == ["lonely"]
    assert not any(v.identity.release_id == "r-ok" and v.control_id in (1, 2, 3) for v in got.values())
    open_id = c[1][0].violation_id
    # A fresh app id: the worker created its internal topics before joining, so every
    # stage — the controls process included, at its lower priority — got its partitions,
    # and health says so.
    with urllib.request.urlopen(f"{live.url}/gpuledger/health/", timeout=5) as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok" and health["subscriptions"] == {"ok": True, "problems": [], "partitions": [0, 1, 2, 3],
                                                                                 "raw_partitions": [0, 1, 2, 3],
                                                                                 "controls_partitions": [0, 1, 2, 3]}
    assert health["controls"]["answering"] and health["controls"]["nice"] >= 10 and health["epochs"]["evaluate_controls"]["acked"] > 0
    assert health["stats"]["controls_in"] > 0 and health["stats"]["violations_out"] >= 3

    publish(kafka_bootstrap, catalogue, SECOND)

    def closed(got):
        # Until the retirement finding names the GPU too: the allocation reaches the release's
        # key on its own path, and may do so after the first version of the finding.
        c = by_control(got)
        return (got.get(open_id) is not None and got[open_id].closed_at is not None and 8 in c
                and any("GPU n1/GPU-RET" in v.detail for v in c[8]))

    got = wait_until(kafka_bootstrap, catalogue, closed)
    v1 = got[open_id]
    assert v1.version >= 1 and (v1.opened_at, v1.closed_at) == (at(10), at(20))
    [retired] = by_control(got)[8]
    assert retired.identity.release_id == "r-ret" and retired.opened_at == at(90) and retired.closed_at is None
    assert "GPU n1/GPU-RET" in retired.detail

    # A replay (a fresh app id: its own output topics) reads the raw topics from offset
    # zero and ends with the same latest violations — versions included.
    live.service.stop(grace=10)
    want = {vid: v.model_dump() for vid, v in got.items() if not is_withdrawn(v)}
    assert {v["control_id"] for v in want.values()} == {1, 2, 6, 7, 8}
    replay_id = f"{catalogue.prefix}-replay"
    worker_factory(catalogue, app_id=replay_id, extra_env=FAST)
    deadline = time.monotonic() + 240  # a loaded machine's replay takes minutes; the loop ends as soon as it matches
    replayed: dict[str, dict] = {}
    while time.monotonic() < deadline and replayed != want:
        time.sleep(1)
        replayed = {vid: v.model_dump() for vid, v in read_from(kafka_bootstrap, catalogue.run(replay_id).violations, dict.fromkeys(range(catalogue.raw_partitions), 0)).items()
                    if not is_withdrawn(v)}
    assert replayed == want


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"offsets-{uuid.uuid4().hex}"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        consumer.close()


def read_from(bootstrap: str, topic: str, offsets: dict[int, int]) -> dict[str, Violation]:
    """Latest violation per id among the records after ``offsets``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, off) for p, off in offsets.items()])
    out: dict[str, Violation] = {}
    idle = time.monotonic()
    try:
        while time.monotonic() - idle < 1.5:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            idle = time.monotonic()
            v = Violation.model_validate_json(msg.value())
            if v.violation_id not in out or v.version > out[v.violation_id].version:
                out[v.violation_id] = v
    finally:
        consumer.close()
    return out


def test_a_worker_killed_after_opening_violations_closes_them_after_restart(kafka_bootstrap, catalogue, worker_factory, tmp_path):
    data = tmp_path / "crashy"
    first = worker_factory(catalogue, data_dir=data, extra_env=FAST)
    publish(kafka_bootstrap, catalogue, FIRST)
    got = wait_until(kafka_bootstrap, catalogue, lambda got: 1 in by_control(got))
    open_id = by_control(got)[1][0].violation_id
    # The cold-state check below needs the first worker's work all durable when it is killed:
    # input it had not acked yet is handled again after the restart (by design), which decodes
    # the states it touches. Kill timing at every point of a commit is the fault tier's
    # (test_faults.py); here the kill comes once the run has caught up (streams.progress).
    with RunProgress({"bootstrap.servers": kafka_bootstrap}, catalogue, f"{catalogue.prefix}-app") as progress:
        wait_caught_up(progress, lambda: worker_health(first.url), timeout=60)
    first.service.kill()
    publish(kafka_bootstrap, catalogue, SECOND)
    again = worker_factory(catalogue, data_dir=data, extra_env=FAST)  # same group, same store: state from the changelog
    got = wait_until(kafka_bootstrap, catalogue, lambda got: got.get(open_id) is not None and got[open_id].closed_at is not None
                     and 8 in by_control(got))
    assert (got[open_id].opened_at, got[open_id].closed_at) == (at(10), at(20))
    assert {v.control_id for v in got.values() if not is_withdrawn(v)} == {1, 2, 6, 7, 8}
    # the restart recovered both stores' states without decoding them: the keys the second batch
    # did not touch are still cold (streams.store: cold states), and were judged right all the same
    # (read once each stage holds every partition again: the controls process's group is its
    # own, static, and the Faust agent's may still be moving from the killed member, whose
    # session ends 10 s after the kill)
    deadline = time.monotonic() + 60
    while True:
        stores = worker_health(again.url)["stores"]
        if all(stores[name]["partitions"] == [0, 1, 2, 3] for name in ("entities", "controls")) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stores["entities"]["cold"] > 0 and stores["controls"]["cold"] > 0, stores


def test_a_holding_read_late_through_the_worker_stores_what_a_run_in_order_stores(kafka_bootstrap, catalogue, worker_factory):
    """A pod's later re-report of its GPU assignment read before the first one (the first published after
    the worker had stored the holding from the later one): the worker withdraws that allocation (a
    tombstone readers skip), and stores the same allocations — and the same control 8 violation of the
    release retired while holding it, version included — as a worker that read them in order (before, the
    first allocation stayed open beside the real one, and the tombstone's version was in the violation's)."""
    from producers._kafka import ensure_topics
    from schemas.topics import TopicCatalogue

    in_order = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=4)  # a second run's topics: read in order
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, in_order)
    history = [*released("r-w"), sched("scheduler.scheduled", 9, pod="w-1", workload="ml/Job/w", release_id="r-w")]
    a10, a12 = gpu_event("gpu.assigned", 10, pod="w-1", device="GPU-W"), gpu_event("gpu.assigned", 12, pod="w-1", device="GPU-W")
    later = [rel("release.retired", 30, "r-w", actor="alice"), rel("release.evaluated", 200, "r-w", actor="eval-bot")]
    late = worker_factory(catalogue, extra_env=FAST)
    publish(kafka_bootstrap, catalogue, [*history, a12])
    holdings = "SELECT allocation_id, started_at, ended_at, end_reason, version FROM gpuledger.gpu_allocations FINAL ORDER BY allocation_id"
    deadline = time.monotonic() + 60
    while not late.reader.query(holdings).dicts():
        assert time.monotonic() < deadline, "the holding from the later assignment was never stored"
        time.sleep(0.3)
    publish(kafka_bootstrap, catalogue, [a10, *later])
    ordered = worker_factory(in_order, extra_env=FAST)
    publish(kafka_bootstrap, in_order, [*history, a10, a12, *later])

    def settled(reader, cat):
        allocations = [r for r in reader.query(holdings).dicts() if r["end_reason"] != "withdrawn"]
        violations = {vid: (v.control_id, v.opened_at, v.closed_at, v.detail, v.version) for vid, v in latest(kafka_bootstrap, cat).items()
                      if not is_withdrawn(v)}
        return allocations, violations

    deadline, got = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        got = (settled(late.reader, catalogue), settled(ordered.reader, in_order))
        if got[0] == got[1] and [c for c, *_ in got[0][1].values()] == [8] and len(got[0][0]) == 1:
            break
        time.sleep(1)
    assert got[0] == got[1] and len(got[0][0]) == 1, got
    [allocation] = got[0][0]
    assert "08:10:00" in str(allocation["started_at"]) and allocation["ended_at"] is None, allocation
    tombstones = [r for r in late.reader.query(holdings).dicts() if r["end_reason"] == "withdrawn"]
    assert len(tombstones) == 1 and tombstones[0]["started_at"] == tombstones[0]["ended_at"]
