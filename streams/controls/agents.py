"""The controls stage's logic: the eight ownership-gap controls, continuously.

It runs in a process of its own beside the worker (``streams.controls.service``: its
consumer, its loop, its health page); this module is the batch logic it drives.

Input: the ``correlated`` topic (one row per input event, superseded by higher
versions) and the ``allocations`` topic (GPU allocation intervals) as the correlation stage
packs them on the controls topic, the process's ``ReleaseDirectory`` and the policy (``GPULEDGER_POLICY_FILE``, see
``streams/controls/policy.py``). Output: ``Violation`` records on the ``violations`` topic,
keyed by violation_id — opened, then the same id with ``closed_at`` and
``version + 1`` when it ends (or withdrawn when later history no longer supports it).

Topology:
  - the correlation stage keeps what a control reads of each correlated row / allocation
    (``rules.compact_row``) and re-keys it to its *control key* (pod — an allocation goes
    to its pod's —, workload, release, alert fingerprint: ``streams.controls.rules``) on
    the internal topic ``<prefix>.<app id>.controls.v1``.
  - ``evaluate_controls`` (``Controller.evaluate_batch``) folds those messages into the
    changelog-backed ``controls`` store (keyed by the internal topic's key), re-derives the violations of every
    touched key once per batch, emits what changed, and forwards what other keys need
    (a pod's rows to its workload, running intervals and allocations to their release
    once its lifecycle makes a control read them — ``rules.holdings_read`` — and
    preemptions to the preemptor) on the same internal topic.
  - housekeeping (``Controller.housekeeping``, every ``HOUSEKEEPING_S``) re-evaluates keys whose releases changed in the
    directory and keys whose deadline (grace period, window end) the event-time
    watermark has passed, and after a (re)start or rebalance re-emits every key's
    current violations (the state may have been committed while the outputs were lost;
    re-sends carry the same version, so readers collapse them).

Guarantees: the latest version of every violation is a function of the topic history,
the release directory and the policy, whatever order inputs are processed in (the
rules re-derive from state; see ``streams.controls.rules``). Versions come from history (``rules.key_version``). Delivery is at least once.
Limits: the watermark is the latest event time *this worker* has seen (its partitions'
rows and every release event); with several workers a deadline may be reached by one
worker a little before another. A policy change applies to keys as they are next
evaluated (restart the worker to re-evaluate all keys at once).
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from collections.abc import Awaitable
from datetime import datetime

from streams import caps
from streams.controls.policy import PolicySettings
from schemas import encode_event
from streams.controls.rules import Context, digest, fold_link, fold_row, max_time, new_state, step
from streams.packing import Packer, unpack
from streams.store import DIRECTORY_MARK, Chunks, DirectoryMarks, PartitionStore, StateUnavailable

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 1.0


def _parse(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


class ControlRuntime:
    """Per-worker, in-memory indexes over the controls table (rebuilt after a restart):

    - ``dependents``: ``rid:<release>`` -> control keys whose evaluation reads that release;
    - a deadline heap: (event time, key) to re-evaluate when the watermark passes it;
    - ``watermark``: the latest event time seen (rows, allocations, release events);
    - a signature per release, to notice directory changes by polling (the directory
      has one change hook and the correlation stage owns it).
    """

    def __init__(self) -> None:
        self.dependents: dict[str, set[str]] = defaultdict(set)
        self.scheduled: dict[str, datetime] = {}
        self._heap: list[tuple[datetime, str]] = []
        self.watermark: datetime | None = None
        self._directory_seen = -1
        self._release_marks: dict[str, str] | None = None  # None until the first poll after the directory is ready
        # As the correlation stage's (streams.store.DIRECTORY_MARK): release id -> its mark,
        # whose dependents' ticks are on the controls topic, and each loaded partition's catch-up.
        self.marks = DirectoryMarks()
        self._marks_now: dict[str, str] | None = None

    def advance(self, at) -> None:
        if not at:
            return
        t = _parse(at) if isinstance(at, str) else at
        if self.watermark is None or t > self.watermark:
            self.watermark = t

    def track(self, key: str, interests, deadline: datetime | None) -> None:
        for interest in interests:
            self.dependents[interest].add(key)
        if deadline is None:
            self.scheduled.pop(key, None)
        elif self.scheduled.get(key) != deadline:
            self.scheduled[key] = deadline
            heapq.heappush(self._heap, (deadline, key))

    def due(self) -> list[str]:
        out = []
        while self._heap and self.watermark is not None and self._heap[0][0] <= self.watermark:
            deadline, key = heapq.heappop(self._heap)
            if self.scheduled.get(key) == deadline:
                del self.scheduled[key]
                out.append(key)
        return out

    def release_marks(self, directory) -> dict[str, str]:
        """Every release's mark (its history and manifest), advancing the watermark to the
        latest release event; computed again only when the directory saw new events."""
        if len(directory.seen) == self._directory_seen and self._marks_now is not None:
            return self._marks_now
        self._directory_seen = len(directory.seen)
        marks = {}
        for rid, state in list(directory.releases.items()):
            if state["history"]:
                self.advance(state["history"][-1][0].split("|", 1)[0])
            marks[rid] = digest([len(state["history"]), state["history"][-1][0] if state["history"] else "", state["manifest"]])
        self._marks_now = marks
        return marks

    def changed_releases(self, marks: dict[str, str]) -> list[str]:
        """Releases whose mark changed since the last call — none on the first call: what
        changed before it, each partition catches up on from its own mark."""
        if self._release_marks is None:
            self._release_marks = dict(marks)
            return []
        changed = [rid for rid, mark in marks.items() if self._release_marks.get(rid) != mark]
        self._release_marks = dict(marks)
        return changed


def control_chunks(size: int, seal_from: int | None = None) -> Chunks:
    """A control key's links and the violations it emitted are written to the changelog in sealed
    chunks of ``size`` once it holds ``seal_from`` of them (``streams.store``; the ``state_chunk``
    settings, as the entities'): a workload's key holds every one of its pods' scheduler rows (a link
    per pod, ~0.9 KB), a release's the allocations and running intervals of every pod and workload
    that ran it — whole in one record, a workload of ~1,080 pods no longer fitted in the broker's
    1 MB record, was dead-lettered, and the key started without it after a restart
    (``benchmarks/state_growth.py``). Both collections change only by an item replaced
    (``fold_link``, ``step``), which the store's chunk tokens see; a key of fewer than ``seal_from``
    is still one record, byte for byte as before."""
    return Chunks({"links": (), "emitted": ()}, size=size, seal_from=seal_from)


def control_summary(state: dict) -> list:
    """What ``Controller._loaded`` needs of a control key after a restart — its interests,
    its deadline and its latest event time — written beside its state (``PartitionStore``'s
    ``summarize``), so that the state itself stays encoded until a batch touches it."""
    return [state.get("interests", []), state.get("deadline"), max_time(state)]


class Controller:
    """The batch logic of the controls agent, driven by Faust or by a test."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.directory = ctx.directory
        self.policy = PolicySettings().load()  # a bad policy stops the worker before it consumes anything
        self.policy_version = self.policy.fingerprint  # hashed once: the policy does not change in a running worker
        self.runtime = ControlRuntime()
        self.store = PartitionStore("controls", ctx.run.controls_changelog, ctx.consumer_config, on_load=self._loaded,
                                    loading=getattr(ctx, "recovery_lock", None), summarize=control_summary,
                                    chunks=control_chunks(ctx.settings.streams.state_chunk, ctx.settings.streams.state_chunk_from),
                                    snapshots=ctx.snapshots(ctx.run.controls_changelog))
        self.store.follow(ctx.output)
        self.packer = Packer(ctx.run.controls, ctx.run.partitions, max_messages=ctx.settings.streams.pack_max)
        # The epoch's violation records, per input partition, the latest of each violation id
        # (``emit_violations``).
        self.violations: dict[int, dict[str, object]] = defaultdict(dict)
        self.counters = ctx.counters("streams.controls")
        self.stats = ctx.stats
        for name in ("controls_in", "controls_keys", "violations_out", "control_conflicts"):
            self.stats.setdefault(name, 0)
        self.stats["capped"] = caps.counts()  # (kept up to date batch by batch: ``streams.caps``)

    def _loaded(self, partition: int, summaries: dict) -> None:
        self.runtime.marks.loaded(partition, self.store.get(partition, DIRECTORY_MARK))
        for key, (interests, deadline, latest) in summaries.items():
            self.runtime.track(key, interests, _parse(deadline) if deadline else None)
            self.runtime.advance(latest)

    async def evaluate_batch(self, events: list) -> None:
        out = self.ctx.output
        messages = [(ev.message.partition, key, body) for ev in events for key, body in unpack(ev.message.value)]
        await self.store.ensure({p for p, _, _ in messages})
        touched: dict[str, tuple[int, dict]] = {}
        self.counters.add_received(len(messages))
        for p, key, body in messages:
            kind = body["k"]
            state = touched[key][1] if key in touched else self.store.get(p, key)
            if state is None:
                if kind == "tick" or (kind == "link" and len(body["link"]) <= 1):
                    continue
                state = new_state(key)
            if kind in ("row", "rows"):
                changed = False
                for row in body["rows"] if kind == "rows" else (body["row"],):  # ("rows": a pod's withdrawn allocations and their replacements)
                    changed = fold_row(state, row) or changed
                    for at in (row.get("at"), row.get("start"), row.get("end")):
                        self.runtime.advance(at)
            elif kind == "link":
                changed = fold_link(state, body["from"], body["link"])
            else:  # tick: a deadline passed or a release changed
                changed = True
            if changed or key in touched:
                touched[key] = (p, state)
        ctx = Context(self.directory, self.policy, self.runtime.watermark, policy_version=self.policy_version)
        n_out = 0
        self.ctx.fault("controls", "before_outputs")
        for key, (p, state) in touched.items():
            outcome = step(state, ctx)
            state["interests"] = outcome.interests
            state["deadline"] = outcome.deadline.isoformat() if outcome.deadline else None
            self.store.put(p, key, state)
            self.runtime.track(key, outcome.interests, outcome.deadline)
            self.stats["control_conflicts"] += outcome.conflicts
            for violation in outcome.violations:
                self.violations[p][violation.violation_id] = violation  # a later version replaces an earlier one
            for target, link in outcome.forwards:
                self.packer.add(target, {"k": "link", "from": key, "link": link})
            n_out += len(outcome.violations)
        for key in self.runtime.due():
            self.packer.add(key, {"k": "tick"})
        self.packer.drain_into(out)
        self.ctx.fault("controls", "during_outputs")
        self.stats["controls_in"] += len(messages)
        self.stats["capped"] = caps.counts()
        self.stats["controls_keys"] = len(self.store) - len(self.runtime.marks.written)
        if touched:
            log.info("controls evaluated %d message(s) for %d key(s) into %d violation version(s) (produced at the epoch commit)", len(messages), len(touched), n_out)

    def emit_violations(self) -> int:
        """Produce the epoch's violation records: of each violation id only the latest
        version its batches derived. Why per epoch, not per batch: a key's violations are
        derived again at every batch that touches it, each time at a higher version (versions
        come from the key's history, ``rules.key_version``) — measured: 1.5 to 3 records per
        violation on the bench mix, with the count depending on how the input fell into
        batches. The latest version is the one every run ends with; the ones in between said
        nothing a reader keeps (the table and the topic's readers keep the highest version).
        Costs a violation at most ``commit_interval_s`` before it is on Kafka. Returns how
        many were produced."""
        out, topic, n = self.ctx.output, self.ctx.run.violations, 0
        pending, self.violations = self.violations, defaultdict(dict)
        for by_id in pending.values():
            for violation in by_id.values():
                value = encode_event(violation)
                out.produce(topic, violation.violation_id.encode(), value)
                self.counters.add_sent(1, len(value))
                n += 1
        self.stats["violations_out"] += n
        return n

    async def commit(self) -> Awaitable[None]:
        """The epoch commit (``WorkerContext.commit_state``): the epoch's violations first,
        acknowledged with every other output before the changelog is written (by the tail
        returned)."""
        self.emit_violations()
        self.runtime.marks.write(self.store)
        return await self.ctx.commit_state("controls", self.store)

    async def reset(self, events: list) -> None:
        """A failed batch: reload its partitions' state from the changelog, once everything
        produced before the failure is acknowledged (``Correlator.reset`` says why)."""
        await self.ctx.output.flush()
        self.packer.discard()
        self.forget({ev.message.partition for ev in events})

    def forget(self, partitions: set[int]) -> None:
        """Drop the state of ``partitions`` (failed batch, revocation): loaded again, they
        catch up again from their changelog's mark. Their epoch's violations go too: the
        batches that derived them are handled again (a failed batch), or by the next owner."""
        self.store.drop(partitions)
        self.runtime.marks.forget(partitions)
        for p in partitions:
            self.violations.pop(p, None)

    async def dead(self, event, exc: BaseException) -> None:
        from schemas.outputs import dead_letter

        msg = event.message
        letter = dead_letter("processing_error", f"{type(exc).__name__}: {exc}", "streams.evaluate_controls", msg.topic, msg.partition,
                             msg.offset, msg.key, msg.value)
        self.ctx.output.produce(self.ctx.run.deadletter, msg.key, encode_event(letter))
        self.counters.add_rejected("processing_error")
        await self.ctx.output.flush()

    async def housekeeping(self) -> None:
        """Re-evaluate dependents of changed releases and keys whose deadline passed."""
        if not self.directory.ready.is_set():
            return
        # Dependents are indexed as partitions load: load every assigned one before a
        # release change is matched against them (else the change would find nobody).
        try:
            await self.store.ensure(self.ctx.assigned(self.ctx.run.controls))
        except StateUnavailable:
            return  # the store logged why; the next round tries again
        runtime = self.runtime
        marks = runtime.release_marks(self.directory)
        targets: set[str] = set()
        for rid in runtime.changed_releases(marks):
            targets.update(runtime.dependents.get(f"rid:{rid}", ()))
        caught_up, ticks = runtime.marks.catch_up(marks, lambda rid: runtime.dependents.get(f"rid:{rid}", ()), self.ctx.run.partitions)
        self.stats["control_catch_up_ticks"] = self.stats.get("control_catch_up_ticks", 0) + len(ticks)
        targets.update(ticks)
        targets.update(runtime.due())
        if late := self.store.take_late():  # (a crash between a key's chunks and its head: ``PartitionStore.take_late``)
            self.stats["control_late_chunk_ticks"] = self.stats.get("control_late_chunk_ticks", 0) + len(late)
            targets.update(late)
        for key in sorted(targets):
            self.packer.add(key, {"k": "tick"})
        if self.packer.pending():
            self.packer.drain_into(self.ctx.output)
            await self.ctx.output.flush()
        runtime.marks.done(caught_up, marks)
