"""The route stage's input: the raw topics through one plain confluent-kafka consumer.

Input: the four raw topics, in the consumer group ``<app id>.route`` (static membership
per worker, ``<instance>.route``, as the sink's). Output: what ``Correlator.route_batch``
produces (routed events packed on ``<run>.route``, dead letters), and the group's
committed offsets.

Why a plain consumer and not a Faust agent, and the guarantees (the runner's epochs, the
offsets committed by this consumer once the routed messages are acknowledged):
``streams.intake``. The route stage is stateless (decode, re-key, pack): a revocation only
drops what the alignment held of the partitions. What this module adds is the time
alignment of a backlog (``TimeAlignment``).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from operator import attrgetter

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from producers._kafka import ROUTE_FETCH
from streams.intake import Intake, Record

log = logging.getLogger(__name__)

#: Bytes a fetch takes of one partition (librdkafka's default is 1 MiB, ~2,000 events: a
#: whole batch of one topic's partition while the others wait for the next).
PARTITION_FETCH_BYTES = 64 * 1024
#: ``TimeAlignment``: records held of one partition before its fetching pauses, and the
#: seconds the held records wait for a partition that is behind but delivers nothing.
HOLD_PER_PARTITION = 1000
HOLD_STALL_S = 0.5


class TimeAlignment:
    """Hands the route stage a backlog of the raw topics in the order it was published.

    Why: a pod's scheduling event and its GPU assignment are on different raw topics. Read
    from a backlog (a restart, a replay, ``make bench``'s bulk phase), the consumer returns
    what each fetch brought, partition by partition, and the topics drift apart in time
    as they are read (a fetch takes the same bytes of every partition; one topic's bytes
    span more time than another's): a pod's GPU assignment was routed batches before its
    scheduling event, and the correlation emitted its allocation and alert rows first
    unattributed, then again — the tables were right (versions from history), the records
    were not (``make bench``: 2.5 to 4.5 outputs per input event from one run to another,
    by how the backlog happened to be cut). Live, the topics arrive in publishing order.

    How (Kafka Streams' stream-time synchronisation, which it configures with
    ``max.task.idle.ms``): per partition, its records in offset order and the newest Kafka
    timestamp read from it. A partition is *behind* while the broker holds records of it
    that have not been read (its high watermark is beyond the next offset: the consumer's
    cached value, or until a fetch brought one, the value asked for at assignment; a
    partition not read yet counts from its committed offset). Records are released up to
    the *frontier*, the lowest newest-timestamp of the partitions behind — whatever is
    still to come of those is at least that new (-1 for one not read yet: anything may
    come) — and everything once nothing is behind. A partition's records leave in offset
    order: one held holds every later one of its partition, so the offsets the epoch
    commits never pass a held record (a crash re-reads it). A partition that holds
    ``per_partition`` records is paused (``paused``), so that the consumer fetches the ones
    behind — librdkafka drops what it had fetched of a paused partition and resumes it at
    the next offset not yet read, so nothing is lost. If the frontier does not move for
    ``stall_s`` while records wait (a partition behind that delivers nothing: its leader
    is away, or its high watermark is out of the consumer's reach — a transaction marker
    is never delivered), everything held is released, and the partitions behind then are
    not waited for again until their next offset or high watermark changes: ordering is
    an optimisation, never a stall, and a stuck partition costs one wait, not one per
    batch. Timestamps are the producers' (CreateTime): publishing order, what a live run
    sees."""

    def __init__(self, per_partition: int = HOLD_PER_PARTITION, stall_s: float = HOLD_STALL_S) -> None:
        self.per_partition = per_partition
        self.stall_s = stall_s
        self.queues: dict[tuple[str, int], deque[Record]] = {}
        self.newest: dict[tuple[str, int], int] = {}     # the newest timestamp read of each partition
        self.next_offset: dict[tuple[str, int], int] = {}
        self.initial_high: dict[tuple[str, int], int] = {}  # asked at assignment, until a fetch brings one
        self.stalled: dict[tuple[str, int], tuple[int, int]] = {}  # (next offset, high watermark) when it stalled
        self.paused: set[tuple[str, int]] = set()
        self.held = 0
        self._frontier: float | None = None
        self._moved_at = 0.0
        self.stall_releases = 0
        self.pauses = 0

    def add(self, records: list[Record]) -> None:
        for rec in records:
            tp = (rec.topic, rec.partition)
            queue = self.queues.get(tp)
            if queue is None:
                queue = self.queues[tp] = deque()
            queue.append(rec)
            if rec.ts > self.newest.get(tp, -1):
                self.newest[tp] = rec.ts
            self.next_offset[tp] = rec.offset + 1
        self.held += len(records)

    def start(self, tp: tuple[str, int], offset: int, high: int = -1) -> None:
        """Where the consumer starts reading a newly assigned partition (its committed
        offset) and its high watermark then: one not read yet is behind while that is beyond
        its start (the consumer's cached high watermark is unknown until a fetch brings one)."""
        if offset >= 0 and tp not in self.next_offset:
            self.next_offset[tp] = offset
            if high >= 0:
                self.initial_high[tp] = high

    def behind(self, high_watermark: Callable[[tuple[str, int]], int]) -> dict[tuple[str, int], tuple[int, int]]:
        """The partitions whose broker holds records not read yet (``high_watermark(tp)``:
        the consumer's cached value, negative when unknown), each with its next offset and
        high watermark — but for those that stalled the frontier, as long as neither of
        those changed."""
        out = {}
        for tp, nxt in self.next_offset.items():
            high = high_watermark(tp)
            if high < 0:
                high = self.initial_high.get(tp, -1)
            if high > nxt:
                mark = self.stalled.get(tp)
                if mark is not None:
                    if mark == (nxt, high):
                        continue
                    del self.stalled[tp]
                out[tp] = (nxt, high)
        return out

    def release(self, behind: dict[tuple[str, int], tuple[int, int]], now: float) -> list[Record]:
        """The records that may be routed now, in timestamp order (see the class docstring)."""
        if not self.held:
            self._frontier = None
            return []
        # A partition behind that was not read yet: anything may come of it (-1 holds everything).
        frontier = min((self.newest.get(tp, -1) for tp in behind), default=None)
        if frontier is not None:
            if frontier != self._frontier:
                self._frontier, self._moved_at = frontier, now
            elif now - self._moved_at >= self.stall_s:
                frontier = None
                self.stall_releases += 1
                self.stalled.update(behind)
        runs = []
        for queue in self.queues.values():
            if frontier is None:
                run = list(queue)
                queue.clear()
            else:
                run = []
                while queue and queue[0].ts <= frontier:
                    run.append(queue.popleft())
            if run:
                runs.append(run)
        out = list(heapq.merge(*runs, key=attrgetter("ts"))) if len(runs) > 1 else (runs[0] if runs else [])
        self.held -= len(out)
        if frontier is None or not self.held:
            self._frontier = None  # the stall time counts from when records start to wait again
        return out

    def to_pause(self) -> list[tuple[str, int]]:
        """Partitions to pause now (they hold ``per_partition`` records or more)."""
        full = [tp for tp, q in self.queues.items() if len(q) >= self.per_partition and tp not in self.paused]
        self.paused.update(full)
        self.pauses += len(full)
        return full

    def to_resume(self) -> list[tuple[str, int]]:
        """Paused partitions to resume now (below half of ``per_partition``)."""
        low = [tp for tp in self.paused if len(self.queues.get(tp, ())) < self.per_partition // 2]
        self.paused.difference_update(low)
        return low

    def forget(self, partitions) -> int:
        """Drop what is held of revoked partitions (never routed, never committed: their next
        owner reads them again); how many records that was."""
        dropped = 0
        for tp in partitions:
            dropped += len(self.queues.pop(tp, ()))
            self.newest.pop(tp, None)
            self.next_offset.pop(tp, None)
            self.initial_high.pop(tp, None)
            self.stalled.pop(tp, None)
            self.paused.discard(tp)
        self.held -= dropped
        return dropped

    def health(self) -> dict:
        return {"held": self.held, "paused": len(self.paused), "pauses": self.pauses, "stall_releases": self.stall_releases}


class RawIntake(Intake):
    """The raw topics' consumer (group ``<app id>.route``) and the route stage's epoch loop
    (``streams.intake.Intake``), its batches time-aligned (``TimeAlignment``)."""

    def __init__(self, settings, consumer_config: dict, topics: tuple[str, ...], epoch_args: tuple) -> None:
        # Asks the watermarks at assignment (``_starts``). Made now, and asked for the cluster's
        # description (a future nobody waits for), so that its connection and metadata are up
        # by the time the first assignment comes.
        self._admin = AdminClient({**consumer_config, "logger": logging.getLogger("librdkafka")})
        self._admin.describe_cluster(request_timeout=10)
        super().__init__(settings, consumer_config, topics, epoch_args, "route", "route stage", extra={
            # A batch returns records partition by partition as fetched; small per-partition
            # fetches make one batch span every raw topic (route_batch orders it by event time).
            "max.partition.fetch.bytes": PARTITION_FETCH_BYTES,
            **ROUTE_FETCH,  # fewer, fuller fetches of a live stream (producers._kafka.ROUTE_FETCH)
        })
        self.align = TimeAlignment()
        self._resume_refused = False

    def forget(self, revoked: list[tuple[str, int]]) -> None:
        self.align.forget(revoked)

    def reassigned(self, assignment: list[tuple[str, int]]) -> bool:
        # librdkafka keeps a partition's pause across a revocation and a new assignment:
        # a partition this stage paused, taken away and given back, would stay paused.
        return self._resume(assignment)

    async def assigned_now(self, partitions: list[TopicPartition]) -> None:
        await asyncio.to_thread(self._starts, partitions)

    def received(self, records: list[Record]) -> list[Record]:
        return self._aligned(records)

    def _resume(self, partitions: list[tuple[str, int]]) -> bool:
        """Resume ``partitions`` (unpaused ones are left as they are) and take them out of the
        alignment's paused set; False if librdkafka refused (the caller tries again), logged
        once per state change, not per attempt."""
        try:
            self.consumer.resume([TopicPartition(t, p) for t, p in partitions])
        except KafkaException as exc:
            if not self._resume_refused:
                log.warning("route stage: resuming %d partition(s) refused (%s); trying again", len(partitions), exc)
            self._resume_refused = True
            return False
        self._resume_refused = False
        self.align.paused.difference_update(partitions)
        return True

    def _starts(self, tps: list[TopicPartition]) -> None:
        """Tell the alignment where reading starts on newly assigned partitions (their
        committed offsets) and their high watermarks (the consumer's cached ones come with
        its first fetch of each): without them a partition not read yet would not count as
        behind, and the first batches of a backlog would not wait for it.

        The watermarks are asked in one request per kind on an admin client's connection of
        its own, not with the consumer's ``get_watermark_offsets``: that is a request per
        partition on the connection the consumer fetches on, where the broker answers one
        request at a time — each waited for the fetch before it (up to ``fetch.wait.max.ms``,
        50 ms: ``ROUTE_FETCH``), and a restarted route stage's 16 raw partitions held its first
        routed batch back 0.8 s (``make bench``'s restart: assigned at +0.6 s, the watermarks
        known at +1.4 s). The admin client is made with the intake, so that its connection is up
        by then (made at the assignment, its first request once took 3 s). Quick ``make bench``
        runs, restart → first correlated batch: 2.4-2.6 s before, 1.6-1.8 s after."""
        fresh = [tp for tp in tps if (tp.topic, tp.partition) not in self.align.next_offset]
        if not fresh:
            return
        try:
            committed = self.consumer.committed(fresh, timeout=5)
            highs = self._offsets(committed, OffsetSpec.latest())
            lows = self._offsets([tp for tp in committed if tp.offset < 0], OffsetSpec.earliest())
        except KafkaException as exc:  # alignment is an optimisation: read on without it
            log.info("route stage: committed offsets or watermarks not known (%s); the first batches are not aligned", exc)
            return
        for tp in committed:
            key = (tp.topic, tp.partition)
            # Nothing committed: reading starts at the low watermark (auto.offset.reset earliest).
            start = tp.offset if tp.offset >= 0 else lows.get(key)
            if key in highs and start is not None:
                self.align.start(key, start, highs[key])

    def _offsets(self, tps: list[TopicPartition], spec: OffsetSpec) -> dict[tuple[str, int], int]:
        """``spec``'s offset of each partition (one ListOffsets request per leader); a partition
        whose answer is an error or does not come is left out (its alignment starts with its
        first fetch). Raises KafkaException when the request cannot be made."""
        if not tps:
            return {}
        futures = self._admin.list_offsets({TopicPartition(tp.topic, tp.partition): spec for tp in tps}, request_timeout=5)
        out = {}
        for tp, future in futures.items():
            try:
                out[(tp.topic, tp.partition)] = future.result(timeout=10).offset
            except (KafkaException, FutureTimeout):
                continue
        return out

    def _high_watermark(self, tp: tuple[str, int]) -> int:
        """The partition's high watermark as the consumer last heard it (no request; -1 unknown)."""
        try:
            return self.consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)[1]
        except Exception:  # noqa: BLE001 - a partition being revoked; unknown is "not behind"
            return -1

    def _aligned(self, records: list[Record]) -> list[Record]:
        """``records`` held by ``TimeAlignment``, what may be routed now released, fetching
        paused and resumed per partition as it says."""
        align = self.align
        align.add(records)
        ready = align.release(align.behind(self._high_watermark), time.monotonic())
        pause, resume = align.to_pause(), align.to_resume()
        # Pausing is an optimisation; a partition left paused would stall. So the set of
        # paused partitions follows what librdkafka accepted, and a refused resume is retried.
        if pause:
            try:
                self.consumer.pause([TopicPartition(t, p) for t, p in pause])
            except KafkaException as exc:
                align.paused.difference_update(pause)
                log.info("route stage: pausing %d partition(s) refused (%s)", len(pause), exc)
        if resume and not self._resume(resume):
            align.paused.update(resume)  # still paused: resumed again next time
        return ready
