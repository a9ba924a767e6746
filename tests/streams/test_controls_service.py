"""The controls stage's process (``streams.controls.service``), on the real broker: a
rebalance of its consumer group makes the epoch durable before the partitions go."""

from __future__ import annotations

import asyncio
import threading
import uuid

from confluent_kafka import Consumer, TopicPartition

from tests.fixtures.kafka import read_topic
from tests.fixtures.waiting import until

KEYS = [f"rel:r{i}" for i in range(12)]


def release_row(i: int) -> dict:
    """A compact correlated row as the correlation stage packs it for the controls
    (``streams.controls.rules.compact_row``): a release registered."""
    return {"id": f"c{i}", "v": 1, "type": "release.registered", "at": f"2026-11-01T08:{i:02d}:00+00:00", "attr": "direct",
            "i": {"release_id": f"r{i}", "owner": "team-a"}, "p": {"actor": "ci-bot"}}


def test_a_rebalance_of_the_controls_group_commits_the_epoch_before_the_partitions_go(kafka_bootstrap, catalogue, settings_for):
    """The controls process holds an uncommitted epoch (a 60 s commit interval: only the
    rebalance commits) when a second member joins its group: before its partitions go, the
    epoch's states are on the changelog and its offsets committed — the next owner neither
    loses state nor processes the input again — and then the state of the partitions it
    lost is dropped."""
    from producers._kafka import client_config
    from streams.app import ensure_run_topics
    from streams.controls.service import ControlsStage
    from streams.output import BatchOutput
    from streams.packing import Packer

    settings = settings_for(catalogue)
    settings.streams.app_id = f"ctlrev-{uuid.uuid4().hex[:6]}"
    settings.streams.commit_interval_s = 60.0
    ensure_run_topics(settings)
    run = catalogue.run(settings.streams.app_id)
    group = f"{settings.streams.app_id}.controls"

    async def scenario():
        out = BatchOutput(client_config(settings), "test-controls-input", run.deadletter)
        packer = Packer(run.controls, run.partitions, max_messages=3)
        for i, key in enumerate(KEYS):
            packer.add(key, {"k": "row", "row": release_row(i)})
        packer.drain_into(out)
        await out.flush()
        records = sum(out.produced.values())
        out.close()

        stage = ControlsStage(settings)
        stage.directory.ready.set()  # no release events: the rows alone are judged
        task = asyncio.create_task(stage.consume())
        epoch = stage.intake.epoch
        await until("every input record handled", lambda: len(epoch.pending) == records)
        assert epoch.commits == 0 and len(stage.controller.store) >= len(KEYS)

        other = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, "group.instance.id": "another-worker.controls",
                          "enable.auto.commit": False, "auto.offset.reset": "earliest", "partition.assignment.strategy": "range",
                          "session.timeout.ms": 10_000})
        held: list = []  # the other member's assignment, as its own thread hears it (its calls are its thread's)
        other.subscribe([run.controls], on_assign=lambda _c, tps: held.__setitem__(slice(None), tps))
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                other.poll(0.1)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            await until("the rebalance to split the partitions",
                        lambda: len(stage.intake.assigned() or []) == run.partitions // 2 and len(held) == run.partitions // 2)
            mine = {tp.partition for tp in stage.intake.assigned()}
            changelog = await asyncio.to_thread(read_topic, kafka_bootstrap, run.controls_changelog, len(KEYS), 15.0, 0.5)
            health = stage.health()
        finally:
            stop.set()
            poller.join(5)
            other.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.to_thread(stage.output.close)
        return records, mine, changelog, health, epoch

    records, mine, changelog, health, epoch = asyncio.run(scenario())
    ends = {}
    probe = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})  # never subscribes: never joins the group
    try:
        committed = probe.committed([TopicPartition(run.controls, p) for p in range(run.partitions)], timeout=10)
        for p in range(run.partitions):
            ends[p] = probe.get_watermark_offsets(TopicPartition(run.controls, p), timeout=10)[1]
    finally:
        probe.close()
    # the offsets of everything handled were committed before the partitions went, on every partition
    assert {tp.partition: tp.offset for tp in committed if tp.offset >= 0} == {p: end for p, end in ends.items() if end}, (committed, ends)
    assert epoch.acked == records and epoch.forgotten == 0 and health["stats"]["controls_revocations_unsettled"] == 0
    # every key's state reached the changelog (written once: one commit)
    assert sorted(m.key().decode() for m in changelog if m.key().decode() in KEYS) == sorted(KEYS)
    # and only the partitions this member still holds are in its store
    assert set(health["stores"]["controls"]["partitions"]) <= mine and health["controls_assigned"] == sorted(
        [run.controls, p] for p in mine)
