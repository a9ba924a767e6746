"""The correlation agents: fold routed events into their entities and join them.

Input: the run's internal route topic (events routed by the route stage, links and
expiries between entities). Output: correlated rows (``<run>.correlated``),
enriched alerts, GPU allocation intervals, the control inputs (packed on
``<run>.controls``), links and expiries to other entities (packed on
``<run>.route``), and dead letters with reason and source offset.

Topology:
  - ``route_events`` validates each raw record once (pydantic; poison → dead letter),
    re-keys it to its entity (``routing.entity_key``) and packs it on the route topic,
    addressed to the entity's partition. It runs in a process of its own, beside the
    worker (``streams.correlate.route``: it is stateless), reading the raw topics through
    a plain consumer of its own group (``streams.correlate.intake``).
  - ``correlate_entities`` unpacks routed messages, folds them into the entities of a
    ``PartitionStore`` (recovered from the run's entity changelog on assignment),
    re-derives each touched entity once per batch (``entities.refresh``) — and the
    targets of its links that live on the batch's partitions, which fold them at once
    (``LOCAL_PASSES``) — produces what changed, waits for the acks, then writes the
    changed states' changelog (``streams/store.py``: state never ahead of outputs).
  - ``follow_releases`` keeps the ReleaseDirectory (every release, on every worker);
    ``correlation_housekeeping`` re-attributes the dependents of a changed release and
    flushes parked rows on an idle source.

Guarantees: at-least-once processing into outputs whose versions are functions of the
history (``entities``), so re-processing after a crash re-emits identical records.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable
from datetime import datetime, timedelta

import orjson

from schemas import encode_event
from schemas.outputs import dead_letter
from streams import caps
from streams.controls.rules import allocation_key, compact_allocation, compact_row, row_key
from streams.correlate.directory import ReleaseDirectory, follow_release_topic
from streams.correlate.entities import GpuMemo, event_row, expire, fold_link, fold_row, for_controls, new_entity, refresh, state_written
from streams.packing import Packer, kind_of, partition_for, unpack
from streams.runner import Epoch, run_batches
from streams.store import DIRECTORY_MARK, Chunks, DirectoryMarks, PartitionStore, StateUnavailable

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 0.5
#: Rounds of local link folding per batch (``Correlator.correlate_batch``); the links of the
#: last round travel by the route topic only.
LOCAL_PASSES = 3


def entity_chunks(size: int, seal_from: int | None = None) -> Chunks:
    """An entity's rows (with their last emitted version) and links are written to the
    changelog in sealed chunks of ``size`` (``streams.store``; the ``state_chunk`` setting)
    once it holds ``seal_from`` of them (``state_chunk_from``): a node/GPU that collected
    thousands of alerts and holders costs one small record per touch, not its whole
    history. Rows change in place only in ``parked``/``expired`` (and say so: ``store.touched``).
    The store journals the rows and their sent versions itself; the links are journaled once a
    ``GpuMemo`` follows them (``JournaledLinks``) — the store never replaces them, the memo's
    coverage holds them."""
    return Chunks({"rows": ("sent",), "links": ()}, volatile={"rows": ("parked", "expired")}, size=size, seal_from=seal_from,
                  journal=("rows", "sent"))


def entity_summary(state: dict) -> list:
    """What ``Runtime.load`` needs of an entity after a restart — its interests and its
    parked rows (park time, row id) — written beside its state (``PartitionStore``'s
    ``summarize``), so that the state itself stays encoded until a batch touches it."""
    return [state.get("interests", []),
            [[rec["starts_at"] or rec["at"], rec["id"]] for rec in state.get("rows", {}).values() if rec.get("parked")]]


def _gpu_last(touched: dict[str, tuple[int, dict]]) -> list[tuple[str, tuple[int, dict]]]:
    """A round's touched entities in their order, node/GPU entities after the others."""
    others, gpus = [], []
    for item in touched.items():
        (gpus if kind_of(item[0]) == "gpu" else others).append(item)
    return others + gpus


class Runtime:
    """Per-worker, in-memory indexes over the entity store (rebuilt when a partition loads).

    - ``dependents``: interest key (rid:/digest:/model:...) -> entity keys, so a release
      change re-attributes exactly the entities that depend on it;
    - the parking heap: (deadline, entity, row) ordered by event time; rows are expired
      when the event-time watermark passes their deadline, or all at once when no input
      arrived for ``idle_flush_s`` (an idle source must not hold rows back forever).
    """

    def __init__(self, park_ttl: timedelta, idle_flush_s: float) -> None:
        self.park_ttl = park_ttl
        self.idle_flush_s = idle_flush_s
        self.dependents: dict[str, set[str]] = defaultdict(set)
        self.pending_refresh: set[str] = set()
        # Release id -> the directory's event count for it, whose dependents' refreshes are on
        # the route topic (``DIRECTORY_MARK``), and each loaded partition's catch-up.
        self.marks = DirectoryMarks()
        self.watermark: str = ""
        self.last_input = time.monotonic()
        self._heap: list[tuple[str, str, str]] = []
        self._parked: set[tuple[str, str]] = set()

    def index(self, key: str, interests) -> None:
        for interest in interests:
            self.dependents[interest].add(key)

    def load(self, partition: int, summaries: dict, marker: dict | None) -> None:
        """A partition recovered: its keys' summaries (``entity_summary``) and its directory mark."""
        self.marks.loaded(partition, marker)
        for key, (interests, parked) in summaries.items():
            self.index(key, interests)
            for at, row_id in parked:
                self.park(at, key, row_id)

    def park(self, at_iso: str, key: str, row_id: str) -> None:
        if (key, row_id) in self._parked:
            return
        deadline = (datetime.fromisoformat(at_iso) + self.park_ttl).isoformat()
        heapq.heappush(self._heap, (deadline, key, row_id))
        self._parked.add((key, row_id))

    def advance(self, watermark: str) -> None:
        if watermark > self.watermark:
            self.watermark = watermark

    def idle(self) -> bool:
        return bool(self._heap) and time.monotonic() - self.last_input >= self.idle_flush_s

    def due(self, flush_all: bool = False) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        while self._heap and (flush_all or self._heap[0][0] <= self.watermark):
            _deadline, key, row_id = heapq.heappop(self._heap)
            self._parked.discard((key, row_id))
            out[key].append(row_id)
        return dict(out)

    def parked_count(self) -> int:
        return len(self._heap)


class Correlator:
    """The batch logic of both correlation agents, driven by Faust or by a test."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        run = ctx.run
        self.directory: ReleaseDirectory = ctx.directory
        self.runtime = Runtime(timedelta(seconds=ctx.settings.streams.park_ttl_s), ctx.settings.streams.park_idle_flush_s)
        self.store = PartitionStore("entities", run.entities_changelog, ctx.consumer_config, on_load=self._loaded,
                                    chunks=entity_chunks(ctx.settings.streams.state_chunk, ctx.settings.streams.state_chunk_from),
                                    loading=getattr(ctx, "recovery_lock", None), summarize=entity_summary,
                                    on_written=state_written, snapshots=ctx.snapshots(run.entities_changelog))
        self.store.follow(ctx.output)
        pack_max = ctx.settings.streams.pack_max
        self.route = Packer(run.route, run.partitions, max_messages=pack_max)
        self.controls = Packer(run.controls, run.partitions, max_messages=pack_max)
        self._outputs = (run.correlated, run.enriched_alerts, run.allocations)  # names, looked up once
        self.memos: dict[str, GpuMemo] = {}  # node/GPU entity -> what its rows were derived from (in memory only)
        self.counters = ctx.counters("streams.correlate")
        self.stats = ctx.stats
        for name in ("correlated_in", "correlated_out", "conflicts", "entities"):  # (``parked``: read live, ``parked()``)
            self.stats.setdefault(name, 0)
        self.stats["capped"] = caps.counts()  # (kept up to date batch by batch: ``streams.caps``)

    # --- correlate ----------------------------------------------------------------------
    async def correlate_batch(self, events: list) -> None:
        out = self.ctx.output
        messages = []
        for ev in events:
            msg = ev.message
            for key, body in unpack(msg.value):
                messages.append((msg.partition, key, body))
        await self.store.ensure({p for p, _, _ in messages})
        touched: dict[str, tuple[int, dict]] = {}
        watermark = None
        n_in = 0
        for p, key, body in messages:
            kind = body["k"]
            state = touched[key][1] if key in touched else self.store.get(p, key)
            if state is None:
                if kind in ("refresh", "expire"):
                    continue
                state = new_entity(key)
            if kind in ("row", "event"):
                n_in += 1
                # (a route stage before 2026-12 routed the event itself: its row is built here)
                row = body["row"] if kind == "row" else event_row(body["event"], kind_of(key), body["src"])
                if fold_row(state, row):
                    at = row["at"]
                    watermark = at if watermark is None or at > watermark else watermark
            elif kind == "link":
                if not fold_link(state, body["from"], body["link"]) and key not in touched:
                    continue  # nothing new (it was folded locally, or is a re-send): nothing to re-derive
            elif kind == "expire":
                expire(state, body["rows"])
            # "refresh": nothing to fold; the entity is re-derived below
            touched[key] = (p, state)
        self.ctx.fault("correlate", "before_outputs")
        # Links between entities of this batch's partitions are folded here too, and their
        # targets re-derived before anything is emitted (up to LOCAL_PASSES rounds): a GPU
        # alert and the assignment of the pod that now holds the GPU usually arrive in one
        # batch, and through the route topic alone the alert would first be emitted
        # attributed to the GPU's previous holder, then again a batch later. Every link still
        # travels on the route topic as well — that record, acknowledged before this batch's
        # states reach the changelog, is what makes it durable — and arrives as a no-op.
        local = {p for p, _, _ in messages}
        # (partition, entity key) -> correlation id -> the row as it goes out (a row belongs
        # to one entity; a later round's version of it is higher)
        out_rows: dict[tuple[int, str], dict[str, dict]] = defaultdict(dict)
        out_allocs: dict[str, dict] = {}
        refreshed: set[str] = set()
        for round_ in range(LOCAL_PASSES):
            linked: dict[str, tuple[int, dict]] = {}
            # Node/GPU entities last: the links this round's pods send them are folded before
            # they are derived, once — not derived first (a new alert joined to the GPU's
            # previous holder) and again next round with the link (half of all GPU refreshes
            # were such seconds on the bench mix). A link to an entity of this round not yet
            # refreshed is folded into it and waits for its refresh in this round.
            unrefreshed = set(touched)
            for key, (p, state) in _gpu_last(touched):
                unrefreshed.discard(key)
                memo = self.memos.setdefault(key, GpuMemo()) if kind_of(key) == "gpu" else None
                outcome = refresh(state, self.directory, memo=memo)
                self.store.put(p, key, state)
                refreshed.add(key)
                if memo is None or memo.indexed != state["interests"]:
                    # (a node/GPU's interests — every release its holders ran — are indexed again
                    # only when its refresh changed them: ``dependents`` only ever grows)
                    self.runtime.index(key, state["interests"])
                    if memo is not None:
                        memo.indexed = state["interests"]
                for at_iso, row_id in outcome.parked:
                    self.runtime.park(at_iso, key, row_id)
                for row in outcome.correlated:
                    out_rows[(p, key)][row["correlation_id"]] = row
                for alloc in outcome.allocations:
                    out_allocs[alloc["allocation_id"]] = alloc
                self.stats["conflicts"] += outcome.conflicts
                for target, link in outcome.forwards:
                    q = self.route.add(target, {"k": "link", "from": key, "link": link})
                    if q not in local or round_ == LOCAL_PASSES - 1:
                        continue
                    # This round's own states first: a new entity is in the store only once refreshed.
                    held = linked.get(target) or touched.get(target)
                    target_state = held[1] if held else self.store.get(q, target) or new_entity(target)
                    if fold_link(target_state, key, link) and target not in unrefreshed:
                        linked[target] = (q, target_state)
            touched = linked
            if not touched:
                break
        emitted = [row for entity_rows in out_rows.values() for row in entity_rows.values()]
        control_rows = [row for (p, key), entity_rows in out_rows.items()
                        for row in for_controls(self.store.get(p, key), self.directory, list(entity_rows.values()))]
        self._emit(emitted, control_rows, out_allocs.values())
        n_out = len(emitted)
        if watermark is not None:
            self.runtime.advance(watermark)
        for target, rows in self.runtime.due().items():
            self.route.add(target, {"k": "expire", "rows": rows})
        self.route.drain_into(out)
        self.controls.drain_into(out)
        self.ctx.fault("correlate", "during_outputs")
        if n_in and not self.stats.get("first_correlate_batch"):
            # make bench's rate counts from the end of the first batch that correlated events, as its
            # pass-through's does (time.monotonic() is one clock for every process on the machine).
            self.stats["first_correlate_batch"], self.stats["first_correlate_batch_at"] = n_in, time.monotonic()
        self.stats["correlated_in"] += n_in
        self.counters.add_received(n_in)
        if n_in:
            self.runtime.last_input = time.monotonic()  # input arrives: parked rows wait for their watermark
        self.stats["correlated_out"] += n_out
        self.stats["capped"] = caps.counts()
        self.stats["entities"] = len(self.store) - len(self.runtime.marks.written)
        self.counters.add_sent(n_out)
        if refreshed:
            log.info("correlated %d message(s) for %d entit(ies) into %d row(s)", len(messages), len(refreshed), n_out)

    async def commit_entities(self) -> Awaitable[None]:
        """The correlation stage's epoch commit (``WorkerContext.commit_state``): returns its tail."""
        self.runtime.marks.write(self.store)
        return await self.ctx.commit_state("correlate", self.store)

    def _emit(self, rows, control_rows, allocs) -> None:
        out = self.ctx.output
        correlated, enriched, allocations = self._outputs
        for row in rows:
            src = (row["source_topic"], row["source_partition"], row["source_offset"])
            value = orjson.dumps(row)
            ident = row["identity"]
            out.produce(correlated, (ident.get("release_id") or row["correlation_id"]).encode(), value, source=src)
            if row["event_type"].startswith("alert."):
                out.produce(enriched, (ident.get("alert_fingerprint") or row["correlation_id"]).encode(), value, source=src)
        for row in control_rows:
            compact = compact_row(row)
            if compact is not None:
                self.controls.add(row_key(compact), {"k": "row", "row": compact},
                                  source=(row["source_topic"], row["source_partition"], row["source_offset"]))
        compacts: list[tuple[str, dict]] = []  # (pod key, compact allocation)
        withdrawing: dict[str, list] = {}  # pod key -> its allocations, when one of them is a tombstone
        for alloc in allocs:
            out.produce(allocations, f"{alloc['node']}/{alloc['gpu_id']}".encode(), orjson.dumps(alloc))
            compact = compact_allocation(alloc)
            compacts.append((key := allocation_key(compact), compact))
            if compact.get("w"):
                withdrawing[key] = []
        for key, compact in compacts:
            if key in withdrawing:
                withdrawing[key].append(compact)
            else:
                self.controls.add(key, {"k": "row", "row": compact})
        for key, rows in withdrawing.items():
            # A pod's withdrawn allocations travel with the allocations that replaced them, one message: the
            # controls fold them in one batch — a tombstone alone lowered the pod's version (it counts as none:
            # ``streams.controls.rules.fold_row``) and what it forwarded changed at a lower version.
            self.controls.add(key, {"k": "rows", "rows": rows})

    # --- failure handling ---------------------------------------------------------------
    def parked(self) -> int | None:
        """Rows parked now, or None while an assigned partition's state is not loaded (its parked
        rows are not known yet). Health reads it (``stats.parked``), not the count the last batch
        left: after a restart with no input left, the rows a recovered state parked flush only on
        the idle timer, and a stale 0 let `gpuledger replay --resume` call the run caught up —
        and stop it — before they went out."""
        if set(self.ctx.assigned(self.ctx.run.route)) - set(self.store.parts):
            return None
        return self.runtime.parked_count()

    def _loaded(self, partition: int, summaries: dict) -> None:
        self.runtime.load(partition, summaries, self.store.get(partition, DIRECTORY_MARK))

    async def reset(self, events: list) -> None:
        """Forget the in-memory state of the batch's partitions: reload it from the
        changelog (what is durable is consistent with what was acknowledged).

        Every record produced before the failure is acknowledged first (``flush``): a commit
        that failed half-way may have left changelog records in the producer's queue, and
        one landing after the reload had read the changelog would leave the reloaded layout
        short of it — the key's next write would then tombstone chunks that record's head
        refers to. Outputs acknowledged here are ahead of their state, never behind it."""
        await self.ctx.output.flush()
        self.route.discard()
        self.controls.discard()
        self.forget({ev.message.partition for ev in events if ev.message.topic == self.ctx.run.route})

    def forget(self, partitions: set[int]) -> None:
        """Drop the in-memory state of ``partitions`` (failed batch, revocation)."""
        self.store.drop(partitions)
        self.runtime.marks.forget(partitions)  # loaded again, they catch up again from their changelog's mark
        # Only a cache, rebuilt as the entities are refreshed again: the other partitions' stays.
        n = self.ctx.run.partitions
        self.memos = {key: memo for key, memo in self.memos.items() if partition_for(key, n) not in partitions}

    async def dead(self, event, exc: BaseException) -> None:
        self._dead("processing_error", f"{type(exc).__name__}: {exc}", "streams.correlate_entities", event.message)
        await self.ctx.output.flush()

    def _dead(self, reason: str, error: str, stage: str, msg) -> None:
        letter = dead_letter(reason, error, stage, msg.topic, msg.partition, msg.offset, msg.key, msg.value)
        self.ctx.output.produce(self.ctx.run.deadletter, msg.key, encode_event(letter))
        self.counters.add_rejected(reason)
        self.stats["dead_letters"] = self.stats.get("dead_letters", 0) + 1

    # --- housekeeping -------------------------------------------------------------------
    async def housekeeping(self) -> None:
        """Re-attribute dependents of changed releases; idle flush of parked rows."""
        if not self.directory.ready.is_set():
            return
        # Dependents are indexed as partitions load: load every assigned one before a
        # release change is matched against them (else the change would find nobody).
        try:
            await self.store.ensure(self.ctx.assigned(self.ctx.run.route))
        except StateUnavailable:
            return  # the store logged why; the next round tries again
        runtime = self.runtime
        targets: set[str] = set()
        # What the directory holds now: every change it applied has been signalled (the
        # follower applies and signals with no await between), so once this round's
        # refreshes are acknowledged they cover these counts (``DirectoryMarks``).
        counts = self.directory.counts()
        if runtime.pending_refresh:
            changed, runtime.pending_refresh = runtime.pending_refresh, set()
            for interest in changed:
                targets.update(runtime.dependents.get(interest, ()))
        caught_up, stale = runtime.marks.catch_up(counts, self._dependents_of_release(), self.ctx.run.partitions)
        self.stats["catch_up_refreshes"] = self.stats.get("catch_up_refreshes", 0) + len(stale)
        targets.update(stale)
        if late := self.store.take_late():  # (a crash between an entity's chunks and its head: ``PartitionStore.take_late``)
            self.stats["late_chunk_refreshes"] = self.stats.get("late_chunk_refreshes", 0) + len(late)
            targets.update(late)
        for key in sorted(targets):
            self.route.add(key, {"k": "refresh"})
        if self.runtime.idle():
            for target, rows in self.runtime.due(flush_all=True).items():
                self.route.add(target, {"k": "expire", "rows": rows})
        if self.route.pending():
            self.route.drain_into(self.ctx.output)
            await self.ctx.output.flush()
        runtime.marks.done(caught_up, counts)

    def _dependents_of_release(self):
        """The entities that depend on a release: on any interest it ever answered
        (``directory.answered``), as its changes signal them (``ReleaseDirectory.apply``)."""
        answered = self.directory.answered

        def dependents(rid: str) -> set[str]:
            return {key for interest in {f"rid:{rid}", *answered.get(rid, ())} for key in self.runtime.dependents.get(interest, ())}
        return dependents


def install_correlate_agents(app, ctx, route_topic) -> Correlator:
    corr = Correlator(ctx)
    ctx.correlator = corr
    interval = ctx.settings.streams.commit_interval_s
    entities = ctx.epochs["correlate_entities"] = Epoch("correlate_entities", corr.correlate_batch, corr.reset, corr.dead,
                                                        corr.commit_entities, interval, max_events=ctx.settings.streams.commit_max_records)

    @app.agent(route_topic, name="correlate_entities")
    async def correlate_entities(stream):
        """Fold routed messages into entity state; emit rows, allocations, links, control inputs."""
        await corr.directory.ready.wait()
        await run_batches(stream, entities, batch=ctx.packed_batch(), cadence=ctx.settings.streams.correlate_within_s)

    @app.task
    async def follow_releases():
        await follow_release_topic(ctx.bootstrap, ctx.catalogue.release, corr.directory, lambda keys: corr.runtime.pending_refresh.update(keys),
                                   signal_initial=False,  # a loaded partition catches up from its mark (DIRECTORY_MARK)
                                   client_config=ctx.settings.kafka.aiokafka_config(), until=ctx.settings.streams.replay_to)

    @app.timer(interval=HOUSEKEEPING_S)
    async def correlation_housekeeping():
        if app.rebalancing:
            return
        await corr.housekeeping()

    return corr
