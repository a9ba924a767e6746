"""A stage's input through one plain confluent-kafka consumer, run in the runner's epochs.

Used by the stages that run in processes of their own: the route stage (the raw topics,
``streams.correlate.intake.RawIntake``, which adds time alignment) and the controls stage
(the run's controls topic, ``streams.controls.service``). Each reads in a consumer group
of its own (``<app id>.<stage>``, static membership per worker: ``<instance>.<stage>``).

Why not a Faust agent: a Faust agent pays Faust's per-record path for every record
(aiokafka's fetcher, a Message, an Event and the stream's ack bookkeeping per record),
and it runs in the Faust worker's one interpreter, beside the correlation stage. A stage
of its own needs neither: librdkafka reads a batch in one call, and the stage has its
own core.

Guarantees — the runner's epochs (``streams.runner.Epoch``), with the offsets committed
by this consumer instead of by Faust: a batch is handled, and at every epoch commit the
stage's commit runs first (every output produced so far acknowledged; a stateful stage's
changelog written after them), then the epoch's offsets are committed. A crash anywhere
re-delivers input whose outputs may already be on Kafka; the stages' folds are
idempotent. A commit may fail (a rebalance took the partition away): the next owner
re-reads from the last committed offset, again idempotently.

Rebalances: a stateful stage passes ``revoking``, a coroutine run on the stage's loop
before partitions are given up (the consumer's thread waits for it, up to
``REVOKE_WAIT_S``): it commits the epoch, so the partitions' state and offsets are durable
when their next owner reads them; then the partitions' events are forgotten (``forget``).
Lost partitions (the session expired) are only forgotten. Stop (the task is cancelled):
the batch in hand finishes and the epoch commits within ``STOP_GRACE_S`` each, then the
group is left; otherwise the process exits without committing (``HARD_EXIT``), as safe as
a crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from producers._kafka import ConsumerLag
from streams.runner import HARD_EXIT, STOP_GRACE_S, Epoch

log = logging.getLogger(__name__)

#: Seconds a consume call waits for its batch to fill (``batch_max`` records) before it takes
#: what arrived: the route and controls stages' batch window. 0.25 rather than 0.1: at 80 % of
#: the bulk rate the route stage's smaller batches made more, smaller route records, each a
#: correlation batch's worth of work, and the machine's cores ran out — measured (make bench's
#: latency run at 6,700 events/s, two runs, against four at 0.1 with the same correlation wait):
#: the machine 1.68-1.70 cores busy vs 1.79-1.90, the route stage 0.035-0.036 vs 0.038-0.039 ms
#: per event, the controls 0.024-0.025 vs 0.027-0.031, event → queryable p99 2.0-2.3 s vs
#: 2.3-4.6 s (an event waits up to 0.15 s longer in the route stage; the stages after it less).
WITHIN_S = 0.25
REPORT_EVERY_S = 60.0
#: How long a revocation waits for the stage's ``revoking`` (its epoch committed): half the
#: group session timeout (10 s); the Faust worker's revocation has the same bound.
REVOKE_WAIT_S = 5.0


class Record:
    """One Kafka record as a stage reads it (the attribute names of a Faust message, so the
    stages' batch logic and ``dead`` read both), with its Kafka timestamp (ms)."""

    __slots__ = ("topic", "partition", "offset", "key", "value", "ts")

    def __init__(self, msg) -> None:
        self.topic, self.partition, self.offset = msg.topic(), msg.partition(), msg.offset()
        self.key, self.value = msg.key(), msg.value() or b""
        self.ts = msg.timestamp()[1]  # -1 when the record has none

    @property
    def message(self) -> Record:  # an epoch reads ``event.message`` (Faust's Event shape)
        return self


class Intake:
    """A stage's consumer and its epoch loop (see the module docstring). ``label`` names the
    stage in log lines; ``epoch_args`` are ``Epoch``'s (name, handle, reset, dead, commit,
    interval); ``extra`` adds consumer settings. A stateful stage passes its hooks:
    ``revoking(partitions)`` is awaited before partitions are given up, ``forget(partitions)``
    drops its state of partitions gone, ``assigned(partitions)`` hears of a new assignment
    (a subclass may override ``forget`` and ``assigned_now`` instead: ``RawIntake``)."""

    def __init__(self, settings, consumer_config: dict, topics: tuple[str, ...], epoch_args: tuple, stage: str,
                 label: str, batch: int | None = None, extra: dict | None = None,
                 revoking: Callable[[list[tuple[str, int]]], Awaitable[None]] | None = None,
                 forget: Callable[[list[tuple[str, int]]], None] | None = None,
                 assigned: Callable[[list[TopicPartition]], Awaitable[None]] | None = None,
                 stopped: Callable[[float], object] | None = None) -> None:
        from confluent_kafka import Consumer  # looked up at construction (tests/streams/test_progress.py records it)

        from gpuledger.settings import worker_instance_id

        self.topics = tuple(topics)
        self.label = label
        self.batch = batch or settings.streams.batch_max
        self.lag = ConsumerLag()  # the group's lag on this stage's partitions, for its health page
        self.consumer = Consumer({
            **consumer_config,
            "group.id": f"{settings.streams.app_id}.{stage}",
            # Static membership: a restarted worker gets its partitions back without a rebalance.
            "group.instance.id": f"{worker_instance_id(settings)}.{stage}",
            "session.timeout.ms": 10_000,
            "heartbeat.interval.ms": 1_000,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            # Co-partitioned topics: each member gets the same partition numbers of every topic.
            "partition.assignment.strategy": "range",
            "max.poll.interval.ms": 600_000,
            **(extra or {}),
            **self.lag.consumer_config(),
            "on_commit": self._on_commit,
            "logger": logging.getLogger("librdkafka"),
        })
        self.consumer.subscribe(list(self.topics), on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)
        self.epoch = Epoch(*epoch_args, max_events=settings.streams.commit_max_records, hold=None, release=self._release)
        self._revoking = revoking
        self._forget_state = forget
        self._on_assigned = assigned
        self._on_stopped = stopped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_rebalance = False  # the consumer's thread waits in ``_on_revoke`` for ``revoking``
        self.assignment: set[tuple[str, int]] = set()
        self.assigned_once = False
        self._assigned_again = False  # set by the consumer's thread: a new assignment to apply on the loop
        self._revoked: list[tuple[str, int]] = []  # appended by the consumer's thread, applied on the loop
        self._lock = threading.Lock()
        self._committed: dict[tuple[str, int], int] = {}
        self._commit_reported = 0.0
        self.commit_failures = 0
        self.revocations_unsettled = 0

    # --- the consumer's callbacks (called from inside consume(), in its thread) -------------
    def _on_assign(self, _consumer, partitions) -> None:
        with self._lock:
            self.assignment = {(tp.topic, tp.partition) for tp in partitions}
            self.assigned_once = True
            self._assigned_again = True
        log.info("%s: %d partition(s) assigned", self.label, len(partitions))

    def _on_revoke(self, _consumer, partitions) -> None:
        gone = [(tp.topic, tp.partition) for tp in partitions]
        if self._revoking is not None and self._loop is not None and gone:
            # The loop is free: it waits for the consume() call this callback runs in. The
            # offsets the epoch releases meanwhile are committed here, by this thread: a commit
            # from another thread waits until this callback has returned (librdkafka), and
            # would then be refused (the group's generation moved on).
            self._in_rebalance = True
            done = None
            try:
                done = asyncio.run_coroutine_threadsafe(self._revoking(gone), self._loop)  # (a closed loop raises)
                done.result(REVOKE_WAIT_S + 1.0)
            except Exception as exc:  # noqa: BLE001 - the partitions go all the same; their next owner re-reads
                if done is not None:
                    done.cancel()
                self.revocations_unsettled += 1
                log.warning("%s: the epoch of %d revoked partition(s) was not committed before they went (%s); their next owner "
                            "processes it again", self.label, len(gone), str(exc) or type(exc).__name__)
            finally:
                self._in_rebalance = False
            self._commit_sync([TopicPartition(t, p, o) for (t, p), o in self._committed.items()])
        self._gone(gone)

    def _on_lost(self, _consumer, partitions) -> None:
        self._gone([(tp.topic, tp.partition) for tp in partitions])

    def _gone(self, gone: list[tuple[str, int]]) -> None:
        with self._lock:
            self.assignment -= set(gone)
            self._revoked.extend(gone)

    def _on_commit(self, err, partitions) -> None:
        if err is None:
            return
        # A commit refused by a rebalance is expected: the next owner re-reads (idempotently).
        self.commit_failures += 1
        now = time.monotonic()
        if now - self._commit_reported >= REPORT_EVERY_S:
            self._commit_reported = now
            log.warning("%s: offset commit failed (%s; %d so far); the records are read again from the last committed offset",
                        self.label, err, self.commit_failures)

    # --- the epoch's release: offsets committed once the outputs are acknowledged -----------
    def _release(self, records: list) -> None:
        offsets: dict[tuple[str, int], int] = {}
        for rec in records:
            tp = (rec.topic, rec.partition)
            if rec.offset + 1 > offsets.get(tp, -1):
                offsets[tp] = rec.offset + 1
        if offsets:
            self._committed.update(offsets)
            if self._in_rebalance:
                return  # the revocation commits them, from the consumer's thread (``_on_revoke``)
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=True)

    def _apply_revocations(self) -> list[TopicPartition]:
        """Forget what revoked partitions held; after a new assignment, return its partitions
        (``assigned_now`` is then told of them)."""
        with self._lock:
            revoked, self._revoked = self._revoked, []
            assigned_again, self._assigned_again = self._assigned_again, False
            assignment = list(self.assignment)
        if revoked:
            self.epoch.forget(revoked)
            self.forget(revoked)
            for tp in revoked:
                self._committed.pop(tp, None)
        if assigned_again and assignment:
            if not self.reassigned(assignment):
                with self._lock:
                    self._assigned_again = True
                return []
            return [TopicPartition(t, p) for t, p in assignment]
        return []

    # --- what a stage's intake adds -----------------------------------------------------------
    def forget(self, revoked: list[tuple[str, int]]) -> None:
        """Drop what the stage holds of revoked partitions (their events are the epoch's)."""
        if self._forget_state is not None:
            self._forget_state(revoked)

    def reassigned(self, assignment: list[tuple[str, int]]) -> bool:
        """A new assignment, on the loop, before its first batch; False: try again next time."""
        return True

    async def assigned_now(self, partitions: list[TopicPartition]) -> None:
        """Told of a new assignment's partitions (on the loop, before the next batch)."""
        if self._on_assigned is not None:
            await self._on_assigned(partitions)

    def received(self, records: list[Record]) -> list[Record]:
        """The records of a consume call that may be handled now (all of them by default)."""
        return records

    def assigned(self) -> list[TopicPartition] | None:
        """The partitions this stage holds now; None before its first assignment (the
        worker's health checks them: ``streams.app.WorkerContext.assignment_health``)."""
        with self._lock:
            if not self.assigned_once:
                return None
            return [TopicPartition(t, p) for t, p in self.assignment]

    async def commit_idle(self) -> None:
        """Commit an epoch whose input stopped before it was due, every half commit interval
        (the Faust agents' timer does this in the worker): a task beside ``run``."""
        while True:
            await asyncio.sleep(max(0.05, self.epoch.interval_s / 2))
            await self.epoch.commit_if_due()

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Handle batches until cancelled (the worker stops): then the batch in hand and the
        epoch are finished, the last offsets committed and the group left."""
        self._loop = asyncio.get_running_loop()
        pending: asyncio.Future | None = None
        try:
            while True:
                pending = asyncio.ensure_future(asyncio.to_thread(self.consumer.consume, self.batch, WITHIN_S))
                messages = await asyncio.shield(pending)
                pending = None
                assigned = self._apply_revocations()
                if assigned:  # tracked as ``pending``: a stop waits for it before closing the consumer
                    pending = asyncio.ensure_future(self.assigned_now(assigned))
                    await asyncio.shield(pending)
                    pending = None
                records = []
                for m in messages:
                    err = m.error()
                    if err is None:
                        records.append(Record(m))
                    elif err.code() != KafkaError._PARTITION_EOF:
                        log.warning("%s consumer: %s", self.label, err)
                ready = self.received(records)
                # What may be handled at once goes in batches of at most ``batch``, as consumed
                # records would. An epoch whose input stopped is committed by the stage's timer.
                for start in range(0, len(ready), self.batch):
                    pending = asyncio.ensure_future(self.epoch.run_batch(ready[start:start + self.batch]))
                    await asyncio.shield(pending)
                    pending = None
        except asyncio.CancelledError:
            await self._stop(pending)
            raise

    async def _stop(self, pending: asyncio.Future | None) -> None:
        try:
            if pending is not None:
                await asyncio.wait_for(pending, STOP_GRACE_S)
            await asyncio.wait_for(self.epoch.commit_now(), STOP_GRACE_S)
            if self._committed:
                offsets = [TopicPartition(t, p, o) for (t, p), o in self._committed.items()]
                await asyncio.wait_for(asyncio.to_thread(self._commit_sync, offsets), STOP_GRACE_S)
            if self._on_stopped is not None:
                await self._stopped()
            await asyncio.wait_for(asyncio.to_thread(self.consumer.close), STOP_GRACE_S)
        except BaseException:  # noqa: BLE001 - any way the batch, its commit or the leave did not finish
            log.critical("%s: stopping with a batch or commit unfinished; exiting without committing it", self.label)
            logging.shutdown()
            os._exit(HARD_EXIT)

    async def _stopped(self) -> None:
        """The stage's ``stopped`` hook (its state's snapshots: ``stopped(deadline)``), with the
        epoch committed and before the group is left — in a daemon thread given ``STOP_GRACE_S``:
        one that fails or takes longer only costs the next start a longer read, and a thread still
        writing does not hold the process's exit (the hook's own ``deadline`` has it begin nothing
        after that)."""
        deadline = time.monotonic() + STOP_GRACE_S - 0.5
        failed: list[BaseException] = []

        def run() -> None:
            try:
                self._on_stopped(deadline)
            except BaseException as exc:  # noqa: BLE001 - reported below; the stop goes on
                failed.append(exc)

        thread = threading.Thread(target=run, name=f"{self.label}: stop hook", daemon=True)
        thread.start()
        await asyncio.to_thread(thread.join, STOP_GRACE_S)
        if thread.is_alive():
            log.warning("%s: its stop hook did not finish within %.0fs; leaving without it", self.label, STOP_GRACE_S)
        elif failed:
            log.error("%s: its stop hook failed: %s: %s", self.label, type(failed[0]).__name__, failed[0])

    def _commit_sync(self, offsets: list[TopicPartition]) -> None:
        """Offsets committed synchronously (before leaving, or before partitions go: an
        asynchronous commit may still be in flight); a refusal (the partitions moved) only
        means reading again."""
        if not offsets:
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            log.info("%s: offset commit refused (%s); the next owner reads again from the one before", self.label, exc)


async def serve_stage(what: str, stage, port: int, main: Coroutine, helpers: dict[str, Coroutine]) -> None:
    """A stage's process (the route and controls stages): its health page (``stage.health()``)
    on ``port`` of the loopback, ``main`` (its intake) and its ``helpers`` (name -> loop: idle
    commits, housekeeping…) until SIGTERM or the worker is gone; then the batch in hand
    finishes and the epoch commits (``Intake``'s stop; bounded, and by the worker's stop
    bound for the child, after which it kills this process), and ``stage.output`` is closed."""
    from aiohttp import web

    from gpuledger.child import stop_requested

    async def health(request):
        return web.json_response(stage.health())

    app = web.Application()
    app.router.add_get("/gpuledger/health/", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = stop_requested(what)
    task = asyncio.create_task(main, name=f"{what}: intake")
    loops = [asyncio.create_task(coro, name=f"{what}: {name}") for name, coro in helpers.items()]
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, *loops, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for done in (task, *loops):
            if done.done():
                done.result()  # a loop ended on its own: an error, raised here
        for loop in loops:
            loop.cancel()
        task.cancel()
        await asyncio.gather(task, *loops, return_exceptions=True)
    finally:
        left = await asyncio.to_thread(stage.output.close)
        if left:
            log.warning("%s: %d output record(s) were not acknowledged at exit (their offsets were not committed)", what, left)
        await runner.cleanup()
