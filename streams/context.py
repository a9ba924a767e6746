"""What a stateful stage's process gives its batch logic: the settings, the run's topics,
one batched producer, the release directory, the counters, and the epoch commit.

Two processes hold a stateful stage: the Faust worker (the correlation stage,
``streams.app.WorkerContext``) and the controls process (``streams.controls.service``).
Each makes one ``StageContext`` (or a subclass) and hands it to its stage's batch logic
(``Correlator``, ``Controller``), which reads nothing else of its process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from gpuledger import gctune
from gpuledger.telemetry import ComponentCounters
from producers._kafka import client_config, resolve_bootstrap
from streams.correlate.directory import ReleaseDirectory
from streams.output import BatchOutput, Deferred
from streams.runner import FaultInjection

log = logging.getLogger(__name__)


class StageContext:
    """Settings, the run's topics, the process's one batched producer (client id
    ``gpuledger-<app id>[-<role>]``), its release directory and counters, and the epoch
    commit of a stage's ``PartitionStore`` (``commit_state``)."""

    def __init__(self, settings, role: str | None = None) -> None:
        self.settings = settings
        self.catalogue = settings.kafka.catalogue()
        self.run = self.catalogue.run(settings.streams.app_id)
        self.bootstrap = resolve_bootstrap(settings)
        self.consumer_config = client_config(settings)
        client_id = f"gpuledger-{settings.streams.app_id}" + (f"-{role}" if role else "")
        self.output = BatchOutput(self.consumer_config, client_id, self.run.deadletter)
        self.directory = ReleaseDirectory()
        self.stats: dict = {}
        self._counters: dict[str, ComponentCounters] = {}
        self.recovery_lock = asyncio.Lock()  # the stores recover one at a time (streams.store.PartitionStore)
        self.fault = FaultInjection(settings.streams.fault)  # (stage, point): a kill -9 there, for the fault tier
        if settings.streams.verify_journal:  # the tests: every chunk looked at too (streams.store.VERIFY_JOURNAL)
            from streams import store

            store.VERIFY_JOURNAL = True

    async def commit_state(self, stage: str, store) -> Awaitable[None]:
        """An epoch commit of a stateful stage (``streams.runner``), taken now, made durable by
        the tail it returns: ``store``'s changed states are encoded now (the state the epoch
        left), and the tail waits until every output produced so far is acknowledged, then
        produces that changelog and waits for it. The agent's next batches run while the tail
        waits (``Epoch`` acks the epoch's input when the tail is done, and runs the tails in
        order): their outputs are not waited for, and states they change are the next
        commit's."""
        mark = self.output.mark()
        changes = Deferred()
        store.write_changes(changes)
        return self._durable(stage, mark, changes, store, store.drops())

    async def _durable(self, stage: str, mark: set[int], changes: Deferred, store, drops: dict[int, int]) -> None:
        await self.output.flush(mark)
        self.fault(stage, "after_outputs")
        # A partition given up while this tail waited (its revocation could not wait any
        # longer) is its next owner's: none of its records are written from here (and the
        # epoch does not ack its events: ``Epoch.forget``).
        now = store.drops()
        stale = {p for p in {r[3] for r in changes.records} if now.get(p, 0) != drops.get(p, 0)}
        if stale:
            log.warning("%s: partition(s) %s were given up before this commit's changelog was written; leaving it to their next owner",
                        stage, sorted(stale))
            changes.records = [r for r in changes.records if r[3] not in stale]
        await self.output.flush(self.output.produce_all(changes))
        self.fault(stage, "after_changelog")
        gctune.freeze()  # what this epoch left alive is the store's: not walked by the collector again

    def snapshots(self, changelog: str):
        """Where a stateful stage's store keeps the local snapshots of ``changelog``
        (``streams.snapshot``), or None when they are off (``streams.snapshots``)."""
        from streams.snapshot import SnapshotDir

        if not self.settings.streams.snapshots:
            return None
        return SnapshotDir(self.settings.data_dir / "streams" / "snapshots", changelog)

    def packed_batch(self) -> int:
        """Records per batch for a stage reading packed records."""
        conf = self.settings.streams
        return max(1, conf.packed_batch_messages // conf.pack_max)

    def assigned(self, topic: str) -> set[int]:
        """The partitions of ``topic`` this process holds right now (none by default)."""
        return set()

    def counters(self, component: str) -> ComponentCounters:
        if component not in self._counters:
            self._counters[component] = ComponentCounters(component)
        return self._counters[component]
