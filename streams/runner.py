"""How every stream agent runs its batches: in epochs, acked only once durable.

An agent's batch produces its outputs and changes its in-memory state, and returns
without waiting for anything. Every ``COMMIT_INTERVAL_S`` (``streams.commit_interval_s``)
the agent's *epoch* is committed (``Epoch.commit_now``): the agent's ``commit``
callback waits until every output produced so far is acknowledged by Kafka, writes the
changelog of every state the epoch changed, waits for that too — and only then are the
epoch's input events acked (their offsets committed later by Faust). So at every
instant the durable state is not newer than the durable outputs, and the committed
input offsets are not newer than the durable state; a crash anywhere re-processes the
un-acked input against a state that has not seen it, and the folds are idempotent
(versions come from history: ``streams.correlate.entities``).

Why epochs rather than one wait per batch: a batch that waited for its outputs' acks
and then for its changelog's acks spent most of its time waiting when batches are
small (live input), and wrote one changelog record per touched key per batch. An
epoch writes a key's state once per commit, however many batches touched it, and the
batches in between never wait.

Acks are held back with Faust's own reference count: Faust's ``take_events`` acks a
batch's events when the agent's body leaves the batch, so the body takes one more
reference on each event's message (``Message.incref``: ``hold_faust_events``) and the
epoch drops it (``Event.ack``: ``release_faust_events``) at commit time — the offset
becomes committable then, and not before. A stage reading with a consumer of its own
(the route stage, ``streams.correlate.intake``) passes ``hold=None`` and a ``release``
that commits the epoch's offsets.

Failures:
- ``handle(events)`` processes a whole batch or raises. When it raises for a retriable
  reason (``streams.store.StateUnavailable``: the state it needs could not be read from
  its changelog), the batch is not the input's fault: it waits with back-off and is
  handled again, whole, until it succeeds (``waiting_for_state`` in health counts the
  attempts; the worker's status is ``degraded`` meanwhile) — never dead-lettered; after
  ``STATE_WAIT_S`` the process exits as a crash would and its restart reads afresh.
  When it raises otherwise, the agent's
  in-memory state of the batch's partitions is reset (``reset``: the durable state is
  the truth) and the epoch's events of those partitions are handled again record by
  record, each followed by a state commit; a record that fails alone is
  dead-lettered with the error (``dead``) and the rest go on — one bad record costs a
  dead letter, never the batch;
- when the worker stops mid-batch (cancellation), the batch is given ``STOP_GRACE_S``
  to finish and the epoch to commit; if that cannot happen (Kafka unreachable), the
  process exits at once without acking — a hard exit is as safe as a crash by design;
- on revocation, the epoch forgets the revoked partitions' events without acking them
  (``Epoch.forget``): the partitions' next owner re-processes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable

from sinks.retry import call_retrying  # the package's one back-off policy

log = logging.getLogger(__name__)

BATCH = 2000
WITHIN_S = 0.1
TAKE_S = 0.03  # with a cadence: take_events' own wait (an idle stage wakes this often: 0.01-0.02 of a core in make bench at rest)
COMMIT_INTERVAL_S = 1.0
STOP_GRACE_S = 5.0
HARD_EXIT = 75  # EX_TEMPFAIL: stopped with a batch unfinished; restart re-processes it
STATE_WAIT_S = 60.0  # how long a batch waits for a state that cannot be read before the process restarts


_now, _pause = time.monotonic, asyncio.sleep  # run_batches' clock and wait (a test drives them)


class FaultInjection:
    """``GPULEDGER_STREAMS_FAULT`` (``stage:point:N``): end the process at once, as a kill -9
    would, the Nth time ``stage`` reaches ``point`` (the fault tier, tests/streams/test_faults.py)."""

    def __init__(self, spec: str | None) -> None:
        self._fault = [*spec.split(":")[:2], int(spec.split(":")[2])] if spec else None

    def __call__(self, stage: str, point: str) -> None:
        if self._fault is None or tuple(self._fault[:2]) != (stage, point):
            return
        self._fault[2] -= 1
        if self._fault[2] == 0:
            log.critical("fault injection: exiting at %s:%s", stage, point)
            logging.shutdown()
            os._exit(137)


def _tp(event) -> tuple[str, int]:
    return event.message.topic, event.message.partition


def hold_faust_events(events: list) -> None:
    """Faust's ``take_events`` acks on leaving the body; one more reference on each
    event's message keeps its offset uncommitted until the epoch drops it."""
    for ev in events:
        ev.message.incref()


def release_faust_events(events: list) -> None:
    """Drop the epoch's reference: the offsets become committable (by Faust's committer)."""
    for ev in events:
        message = ev.message
        if ev.ack():  # the last reference: the offset may be committed now
            ev.app.sensors.on_message_out(message.tp, message.offset, message)


class Epoch:
    """One agent's handled-but-unacked events and the commit that makes them durable.

    ``handle(events)``, ``reset(events)``, ``dead(event, exc)`` are the agent's batch
    logic; ``commit()`` waits for the outputs produced so far, writes the changed
    states' changelog and waits for it (no acks: the epoch acks after it returns) — or
    takes the commit (encodes the changed states as they are) and returns its *tail*, an
    awaitable that does the waiting and the writing (``WorkerContext.commit_state``).
    A tail runs as a task of its own while the next batches are handled (a commit no
    longer stops the agent for two round trips to the broker each second); the next
    commit waits for it (one tail at a time, in commit order), and an epoch's events are
    acked when its tail is done; a tail that fails ends the process as a crash would.
    ``settle()`` waits for the tails taken so far: before a failed batch's partitions are
    reset (their durable state must be all there is), at a stop, and before partitions
    are given up.
    """

    def __init__(self, name: str, handle: Callable[[list], Awaitable[None]], reset: Callable[[list], Awaitable[None]],
                 dead: Callable[[object, BaseException], Awaitable[None]], commit: Callable[[], Awaitable[None]],
                 interval_s: float = COMMIT_INTERVAL_S, max_events: int = 200_000,
                 hold: Callable[[list], None] | None = hold_faust_events,
                 release: Callable[[list], None] = release_faust_events) -> None:
        self.name = name
        self.handle = handle
        self.reset = reset
        self.dead = dead
        self.commit = commit
        self.interval_s = interval_s
        self.max_events = max_events
        self.hold = hold
        self.release = release
        self.pending: list = []
        self._since: float | None = None
        self._tail: asyncio.Future | None = None  # the last commit's tail, while it runs
        self._tail_events: list = []  # the events that tail acks when it is done
        self._lock = asyncio.Lock()
        self.batches = 0
        self.commits = 0
        self.acked = 0
        self.forgotten = 0
        self.waiting_for_state = 0  # failed attempts of the batch in hand for a retriable reason
        self._handling_since = 0.0  # when the batch in hand was first tried (its STATE_WAIT_S runs from there)
        # Wall-clock seconds the agent spent handling batches and taking commits (its event
        # loop held): against the time that passed, how saturated the stage is (health ``busy_s``).
        self.batch_s = 0.0
        self.commit_s = 0.0

    # --- batches ----------------------------------------------------------------------
    async def run_batch(self, events: list) -> None:
        """Handle one batch (failures as the module docstring says) and commit the epoch
        if it is due. Holds the events' acks until a commit covers them."""
        async with self._lock:
            if self.hold is not None:
                self.hold(events)
            started = time.monotonic()
            await self._handle(events)
            self.batch_s += time.monotonic() - started
            self.batches += 1
            self.pending.extend(events)
            if self._since is None:
                self._since = time.monotonic()
            if self._due():
                await self._commit()

    async def _handle_retrying(self, events: list) -> None:
        """``handle(events)``, waited on and repeated while it fails for a retriable reason
        (``StateUnavailable``: the state it needs could not be read; the store logs why, once
        per outage) — ``waiting_for_state`` in health counts the attempts meanwhile. After
        ``STATE_WAIT_S`` the process ends as a crash would (``HARD_EXIT``, nothing acked):
        a batch that holds its acks blocks every rebalance (Faust waits for them), and a
        restart creates a missing topic and reads the changelog afresh."""
        self._handling_since = time.monotonic()
        try:
            await call_retrying(lambda: self.handle(events), 0.5, 5.0, self._waiting)
        finally:
            self.waiting_for_state = 0

    def _waiting(self, retry_state) -> None:
        self.waiting_for_state += 1
        if time.monotonic() - self._handling_since >= STATE_WAIT_S:
            log.critical("%s: a batch's state could not be read for %.0fs (%s); exiting without acking it, to start afresh",
                         self.name, STATE_WAIT_S, retry_state.outcome.exception())
            logging.shutdown()
            os._exit(HARD_EXIT)

    async def _handle(self, events: list) -> None:
        try:
            await self._handle_retrying(events)
            return
        except Exception:  # noqa: BLE001 - retried record by record below
            log.exception("%s: a batch of %d failed; handling its partitions' epoch record by record", self.name, len(events))
        await self.settle()  # the commits taken before the failure are durable (and acked): not re-done
        parts = {_tp(ev) for ev in events}
        redo = [ev for ev in self.pending if _tp(ev) in parts] + list(events)
        await self.reset(redo)
        for event in redo:
            try:
                await self._handle_retrying([event])
                tail = await self.commit()  # durable now: a later record's reset must not take this one's state with it
                if tail is not None:
                    await tail
            except Exception as exc:  # noqa: BLE001 - the record is dead-lettered with the error
                log.exception("%s: record %s[%d]@%d failed on its own; dead-lettering it", self.name, event.message.topic,
                              event.message.partition, event.message.offset)
                await self.reset([event])
                await self.dead(event, exc)

    # --- commits ----------------------------------------------------------------------
    def _due(self) -> bool:
        return bool(self.pending) and (len(self.pending) >= self.max_events or time.monotonic() - self._since >= self.interval_s)

    async def commit_if_due(self) -> None:
        """For a timer: commit an epoch whose input stopped before it was due."""
        if self._due():
            async with self._lock:
                if self._due():
                    await self._commit()

    async def commit_now(self) -> None:
        """Commit what is pending and wait until every commit taken is durable and acked."""
        async with self._lock:
            if self.pending:
                await self._commit()
        await self.settle()

    async def _commit(self) -> None:
        # One tail at a time: the previous commit's changelog goes first (a key's records stay
        # in commit order), and an agent whose tails cannot finish (Kafka away) stops at its
        # next commit rather than piling up encoded states.
        await self.settle()
        started = time.monotonic()
        tail = await self.commit()
        self.commit_s += time.monotonic() - started
        pending, self.pending, self._since = self.pending, [], None
        if tail is None:
            self._acked(pending)
        else:
            self._tail_events = pending  # what the tail acks when it is done (forget() takes revoked partitions' out)
            self._tail = asyncio.ensure_future(self._durable(tail))

    async def _durable(self, tail: Awaitable[None]) -> None:
        try:
            await tail
        except Exception:  # noqa: BLE001 - the state this commit took may never be written: end as a crash would
            log.critical("%s: a commit could not be made durable; exiting without acking its %d event(s)", self.name,
                         len(self._tail_events), exc_info=True)
            logging.shutdown()
            os._exit(HARD_EXIT)
        self._acked(self._tail_events)

    def _acked(self, pending: list) -> None:
        self.release(pending)
        self.commits += 1
        self.acked += len(pending)

    async def settle(self) -> None:
        """Wait until the tail of every commit taken so far is done (its events acked)."""
        while self._tail is not None:
            tail = self._tail
            await asyncio.shield(tail)  # a caller cancelled (stop) does not cancel the tail with it
            if self._tail is tail:
                self._tail = None

    def forget(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Drop the revoked partitions' events without acking them (their next owner —
        maybe this worker again — re-processes them from the committed offset)."""
        revoked = set(partitions)
        if self._tail is not None and not self._tail.done():  # a tail still waiting does not ack them either
            kept = [ev for ev in self._tail_events if _tp(ev) not in revoked]
            self.forgotten += len(self._tail_events) - len(kept)
            self._tail_events = kept
        kept = [ev for ev in self.pending if _tp(ev) not in revoked]
        self.forgotten += len(self.pending) - len(kept)
        self.pending = kept
        if not kept:
            self._since = None

    def health(self) -> dict:
        return {"pending": len(self.pending), "committing": self._tail is not None and not self._tail.done(), "batches": self.batches,
                "commits": self.commits, "acked": self.acked, "forgotten": self.forgotten, "waiting_for_state": self.waiting_for_state,
                "busy_s": {"batches": round(self.batch_s, 3), "commits": round(self.commit_s, 3)}}


async def run_batches(stream, epoch: Epoch, batch: int = BATCH, within: float = WITHIN_S, cadence: float | None = None) -> None:
    """Run a Faust agent's stream in batches of at most ``batch`` events (``Epoch.run_batch``).

    ``within`` is how long Faust's ``take_events`` waits for ``batch`` events after the
    previous batch was handled — whether or not records are already waiting — before it
    yields what it has: a live stream that never fills a batch waits that long after every
    batch, however long the batch took.

    ``cadence`` (the correlation stage's, ``streams.correlate_within_s``): batches *start*
    at most this often instead — ``take_events`` waits only ``TAKE_S`` and a batch that took
    less than the cadence waits out the rest after it, while what arrives queues in the
    stream's channel. A lightly loaded stage then takes the same batches as with ``within``
    of that length, and a loaded one no longer idles after every batch: with a fixed wait,
    the time a batch's input arrives over is the wait plus the batch itself, so under load
    the wait came back multiplied by 1 / (1 − the stage's busy share) in every batch's
    latency (measured in make bench's latency run: the correlation stage held its event
    loop 81 % of the run and idled in that wait the rest, while its backlog grew)."""
    take = within if cadence is None else min(within, TAKE_S)
    # Closed on the way out (a stop, also one in the cadence's pause): Faust's take_events acks the
    # batch it yielded last (its own reference; the epoch holds another) and detaches its buffer in
    # its ``finally`` — at once, not whenever the abandoned generator is finalized.
    async with contextlib.aclosing(stream.take_events(batch, within=take)) as batches:
        async for events in batches:
            began = _now()
            task = asyncio.ensure_future(epoch.run_batch(events))
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                try:
                    await asyncio.wait_for(task, STOP_GRACE_S)
                    await asyncio.wait_for(epoch.commit_now(), STOP_GRACE_S)
                except BaseException:  # noqa: BLE001 - any way the batch or its commit did not finish
                    log.critical("%s: stopping with a batch of %d unfinished; exiting without acking it", epoch.name, len(events))
                    os._exit(HARD_EXIT)
                raise
            if cadence is not None and len(events) < batch:
                rest = cadence - take - (_now() - began)
                if rest > 0:
                    await _pause(rest)  # (cancelled by a stop: the batch is handled, its epoch committed by the stop)
