"""The epoch runner (``streams.runner.Epoch``) with commits that return a tail: the agent
handles its next batches while a commit's tail waits, an epoch's events are acked only when
its tail is done, tails run one at a time in commit order, and a failed batch's partitions
are reset only once every commit taken before the failure is durable.

The runner's own ordering, driven by plain asyncio (its tails here are gates the test
opens); the tail of the real worker (``WorkerContext.commit_state``: outputs acknowledged,
then the changelog) is proven against the broker by the fault tier (tests/streams/test_faults.py).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from streams import runner
from streams.runner import TAKE_S, Epoch, run_batches


def _events(name: str, n: int) -> list:
    return [SimpleNamespace(message=SimpleNamespace(topic="in", partition=0, offset=f"{name}{i}")) for i in range(n)]


class Agent:
    """Batch logic whose every commit returns a tail that waits for its own gate."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.log: list[str] = []
        self.gates: list[asyncio.Event] = []
        self.fail_on = fail_on

    async def handle(self, events) -> None:
        if self.fail_on is not None and len(events) > 1 and events[0].message.offset.startswith(self.fail_on):
            self.log.append(f"failed {events[0].message.offset}")
            raise ValueError("a bad batch")
        self.log.append("handled " + ",".join(e.message.offset for e in events))

    async def reset(self, events) -> None:
        self.log.append(f"reset {len(events)}")

    async def dead(self, event, exc) -> None:
        self.log.append(f"dead {event.message.offset}")

    async def commit(self):
        gate = asyncio.Event()
        self.gates.append(gate)
        n = len(self.gates)
        self.log.append(f"commit {n} taken")

        async def tail():
            await gate.wait()
            self.log.append(f"commit {n} durable")

        return tail()


async def _until(predicate, what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)  # one turn of the loop: the tasks under test run
    raise AssertionError(f"never: {what}")


def test_the_next_batches_are_handled_while_a_commit_waits_and_acks_follow_the_commits_in_order():
    agent, acked = Agent(), []
    epoch = Epoch("t", agent.handle, agent.reset, agent.dead, agent.commit, interval_s=0.0, hold=None, release=acked.extend)
    first, second = _events("a", 2), _events("b", 1)

    async def scenario():
        await epoch.run_batch(first)  # handled, commit 1 taken: its tail waits for its gate
        assert agent.log == ["handled a0,a1", "commit 1 taken"] and acked == [] and epoch.health()["committing"]
        handling = asyncio.ensure_future(epoch.run_batch(second))
        await _until(lambda: "handled b0" in agent.log, "the second batch handled while commit 1 waits")
        assert not handling.done() and acked == []  # its own commit waits for commit 1's tail: one tail at a time
        agent.gates[0].set()
        await handling
        assert acked == first and agent.log[-2:] == ["commit 1 durable", "commit 2 taken"]
        stopping = asyncio.ensure_future(epoch.commit_now())  # a stop: nothing pending, but commit 2 still waits
        for _ in range(20):
            await asyncio.sleep(0)
        assert not stopping.done() and acked == first
        agent.gates[1].set()
        await stopping
        assert acked == first + second and not epoch.health()["committing"]
        assert epoch.health()["commits"] == 2 and epoch.health()["acked"] == 3

    asyncio.run(scenario())
    assert agent.log == ["handled a0,a1", "commit 1 taken", "handled b0", "commit 1 durable", "commit 2 taken", "commit 2 durable"]


def test_a_failed_batch_is_reset_only_once_the_commits_taken_before_it_are_durable():
    agent, acked = Agent(fail_on="b"), []
    epoch = Epoch("t", agent.handle, agent.reset, agent.dead, agent.commit, interval_s=0.0, hold=None, release=acked.extend)
    first, bad = _events("a", 1), _events("b", 2)

    async def scenario():
        await epoch.run_batch(first)  # commit 1 taken, its tail waiting
        failing = asyncio.ensure_future(epoch.run_batch(bad))
        await _until(lambda: "failed b0" in agent.log, "the bad batch failed")
        for _ in range(20):
            await asyncio.sleep(0)
        assert not any(line.startswith("reset") for line in agent.log)  # not while commit 1 is not durable
        agent.gates[0].set()
        while not failing.done() or epoch.health()["committing"]:  # the redo's commits, each waited for, then the batch's own
            for gate in agent.gates:
                gate.set()
            await asyncio.sleep(0)
        failing.result()

    asyncio.run(scenario())
    assert agent.log[:5] == ["handled a0", "commit 1 taken", "failed b0", "commit 1 durable", "reset 2"]
    assert agent.log[5:] == ["handled b0", "commit 2 taken", "commit 2 durable", "handled b1", "commit 3 taken", "commit 3 durable",
                             "commit 4 taken", "commit 4 durable"]
    assert acked == first + bad


def test_partitions_revoked_while_a_commit_waits_are_not_acked_by_it():
    agent, acked = Agent(), []
    epoch = Epoch("t", agent.handle, agent.reset, agent.dead, agent.commit, interval_s=0.0, hold=None, release=acked.extend)
    mine = _events("a", 2)
    theirs = [SimpleNamespace(message=SimpleNamespace(topic="in", partition=1, offset="b0"))]

    async def scenario():
        await epoch.run_batch(mine + theirs)  # commit 1 taken, waiting
        epoch.forget([("in", 1)])  # revoked meanwhile: its next owner re-processes b0
        agent.gates[0].set()
        await epoch.settle()

    asyncio.run(scenario())
    assert acked == mine and epoch.health()["forgotten"] == 1


def test_an_epoch_is_committed_after_the_batch_that_brought_it_to_max_events_whatever_the_clock():
    """``commit_max_records`` (``Epoch.max_events``): with a commit interval that never comes,
    an epoch commits after the batch that made it hold ``max_events`` input records — so a
    stage's commits follow its input, not how fast the machine went through it."""
    async def main() -> tuple[list[str], dict]:
        agent = Agent()
        epoch = Epoch("t", agent.handle, agent.reset, agent.dead, agent.commit, interval_s=3600, max_events=5,
                      hold=None, release=lambda events: None)
        for name in ("a", "b", "c", "d", "e"):
            await epoch.run_batch(_events(name, 2))
            if agent.gates:
                agent.gates[-1].set()
        await epoch.settle()
        return [line for line in agent.log if "durable" not in line], epoch.health()

    log, health = asyncio.run(main())
    assert log == ["handled a0,a1", "handled b0,b1", "handled c0,c1", "commit 1 taken", "handled d0,d1", "handled e0,e1"]
    assert health["commits"] == 1 and health["acked"] == 6 and health["pending"] == 4  # d and e: 4 records, under 5


def test_busy_seconds_count_handling_and_taking_commits_not_waiting_for_a_tail(monkeypatch):
    """``busy_s`` in an epoch's health: the time its batches and the taking of its commits held
    the agent (how saturated the stage is, against the time that passed) — not the time a
    commit waited for the previous commit's tail, when the agent could have taken input."""
    import streams.runner as runner

    now = [100.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: now[0])

    class Timed(Agent):
        async def handle(self, events) -> None:
            now[0] += 2.0 * len(events)  # a batch's work: 2 s per event
            await super().handle(events)

        async def commit(self):
            now[0] += 0.5  # taking a commit: encoding the epoch's states
            return await super().commit()

    agent, acked = Timed(), []
    epoch = runner.Epoch("t", agent.handle, agent.reset, agent.dead, agent.commit, interval_s=0.0, hold=None, release=acked.extend)

    async def scenario():
        await epoch.run_batch(_events("a", 2))  # 4 s of batch, 0.5 s of commit; its tail waits
        assert epoch.health()["busy_s"] == {"batches": 4.0, "commits": 0.5}
        second = asyncio.ensure_future(epoch.run_batch(_events("b", 1)))
        await _until(lambda: "handled b0" in agent.log, "the second batch handled while commit 1 waits")
        now[0] += 30.0  # the second commit waits this long for commit 1's tail: not busy
        agent.gates[0].set()
        await second
        agent.gates[1].set()
        await epoch.settle()
        assert epoch.health()["busy_s"] == {"batches": 6.0, "commits": 1.0} and len(acked) == 3

    asyncio.run(scenario())


def test_with_a_cadence_batches_start_at_most_that_often_and_one_that_ran_longer_is_followed_at_once(monkeypatch):
    """``run_batches(cadence=...)`` (the correlation stage): Faust's ``take_events`` waits only
    ``TAKE_S``; a batch that took less than the cadence waits out the rest of it after itself
    (what arrives meanwhile queues), one that took longer — or came full — does not wait at all.
    Without a cadence, ``within`` goes to ``take_events`` and nothing else waits. (The clock is
    the batches' own: each batch says how long it takes.)"""
    clock = [1000.0]
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(round(seconds, 6))
        clock[0] += seconds

    monkeypatch.setattr(runner, "_now", lambda: clock[0])
    monkeypatch.setattr(runner, "_pause", pause)

    class Stream:
        def __init__(self, batches):
            self.batches, self.takes = batches, []

        async def take_events(self, max_, within):
            for batch in self.batches:
                self.takes.append((max_, within, round(clock[0], 6)))
                yield batch

    async def handle(events) -> None:
        clock[0] += events[0].message.took  # how long this batch takes

    def batch(took: float, n: int) -> list:
        return [SimpleNamespace(message=SimpleNamespace(topic="in", partition=0, offset=i, took=took)) for i in range(n)]

    async def drive(stream, **kw) -> None:
        epoch = Epoch("test", handle, None, None, None, interval_s=10_000, hold=None, release=lambda events: None)
        await run_batches(stream, epoch, batch=50, **kw)

    # short (waits 0.25 - TAKE_S - 0.05), long (none), full (none), short again (0.25 - TAKE_S - 0.1)
    stream = Stream([batch(0.05, 3), batch(0.4, 3), batch(0.01, 50), batch(0.1, 1)])
    asyncio.run(drive(stream, within=0.1, cadence=0.25))
    assert TAKE_S == 0.03 and pauses == [0.17, 0.12]
    assert [t[:2] for t in stream.takes] == [(50, TAKE_S)] * 4
    assert [t[2] for t in stream.takes] == [1000.0, 1000.22, 1000.62, 1000.63]  # each batch begins right after the previous ended or waited

    pauses.clear()
    stream = Stream([batch(0.05, 3), batch(0.4, 3)])
    asyncio.run(drive(stream, within=0.25))
    assert pauses == [] and [t[:2] for t in stream.takes] == [(50, 0.25)] * 2


def test_a_stop_in_the_cadences_pause_closes_faust_take_events_at_once(monkeypatch):
    """Cancelled while it waits out a cadence, ``run_batches`` closes Faust's ``take_events``
    generator on the way out — whose ``finally`` acks the batch it yielded last and detaches its
    buffer — rather than leaving that to the abandoned generator's finalization, after a stop's
    last commit."""
    forever = asyncio.Event()
    pausing = asyncio.Event()

    async def pause(seconds: float) -> None:
        pausing.set()
        await forever.wait()

    monkeypatch.setattr(runner, "_pause", pause)
    closed: list[str] = []

    class Stream:
        async def take_events(self, max_, within):
            try:
                yield _events("a", 2)
                yield _events("b", 2)
            finally:
                closed.append("take_events closed")

    async def handle(events) -> None:
        pass

    async def main() -> None:
        epoch = Epoch("test", handle, None, None, None, interval_s=10_000, hold=None, release=lambda events: None)
        task = asyncio.ensure_future(run_batches(Stream(), epoch, batch=50, cadence=0.25))
        await pausing.wait()
        assert closed == [] and epoch.batches == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert closed == ["take_events closed"] and epoch.batches == 1 and len(epoch.pending) == 2

    asyncio.run(main())
