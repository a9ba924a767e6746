"""The controls stage, in a process of its own: the eight ownership-gap controls judged
continuously over the run's controls topic.

Input: the run's controls topic (``<run>.controls``: rows, allocations, links and ticks,
packed and addressed by control key — ``streams.controls.agents``), through a plain
consumer in the group ``<app id>.controls`` (``streams.intake.Intake``), and the release
directory (every release, read from the release topic by this process). Output:
violations (``<run>.violations``), links and ticks to other control keys on the controls
topic, the controls changelog (``<run>.controls-changelog``), dead letters, and the
group's committed offsets. Health: ``/gpuledger/health/`` on a loopback port, merged into
the worker's page (``streams.app.WorkerContext.health``).

Why a process of its own (``gpuledger.child``): the controls read the correlation stage's
outputs and nothing reads theirs on the way to the tables — yet in the worker's process
their batches took about a sixth of the one interpreter the correlation stage runs in
(``make bench``'s profile: evaluate, commit, changelog), and every correlated row waited
for them. Apart, the correlation stage gets that share back, and this process runs at a
lower priority (``streams.controls_nice``): when the machine's cores are all busy, the
correlated rows — what a responder queries — go first, and the controls catch up in
larger batches.

Guarantees: as in the worker (``streams.runner``: outputs acknowledged, then the
changelog, then the offsets, at every epoch commit; ``Controller`` says what the
violations guarantee). A rebalance commits the epoch before the partitions go
(``Intake``'s ``revoking``), then drops their state; their next owner recovers it from the
changelog. A crash of this process (or of the worker, which ends it) at any instant
re-reads from the last committed offset against state not newer than the outputs. The
worker restarts the process when it ends (``ChildProcess.restart_if_dead``).
"""

from __future__ import annotations

import asyncio
import logging

from gpuledger import gctune
from gpuledger.child import ChildProcess, child_main
from producers._kafka import ROUTE_FETCH
from streams.context import StageContext
from streams.controls.agents import HOUSEKEEPING_S, Controller
from streams.correlate.directory import follow_release_topic
from streams.intake import REVOKE_WAIT_S, Intake, serve_stage

log = logging.getLogger(__name__)

#: Seconds the worker gives a stopping controls stage before it kills it (inside the
#: worker's own stop bound, ``streams.app.STOP_WITHIN_S``).
CONTROLS_STOP_S = 5.0


class ControlsStage(StageContext):
    """The process's parts: the controller (the batch logic), its intake (consumer +
    epoch), the release directory it judges against, and its health."""

    def __init__(self, settings) -> None:
        super().__init__(settings, role="controls")
        self.controller = c = Controller(self)
        self.intake = Intake(settings, self.consumer_config, (self.run.controls,),
                             ("evaluate_controls", c.evaluate_batch, c.reset, c.dead, c.commit, settings.streams.commit_interval_s), "controls",
                             "controls stage", batch=self.packed_batch(), extra=dict(ROUTE_FETCH), revoking=self._revoking,
                             forget=self._forget, assigned=self._prefetch, stopped=lambda deadline: c.store.save_snapshots(deadline=deadline))

    def assigned(self, topic: str) -> set[int]:
        held = self.intake.assigned() or []
        return {tp.partition for tp in held if tp.topic == topic}

    async def _revoking(self, partitions: list[tuple[str, int]]) -> None:
        """Before partitions go: the epoch committed (their state and offsets durable, so
        their next owner does not process it again) and everything produced acknowledged."""
        try:
            await asyncio.wait_for(self._committed_then_flushed(), REVOKE_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("rebalance: the controls epoch was not durable after %.0fs; giving the partitions up", REVOKE_WAIT_S)

    async def _committed_then_flushed(self) -> None:
        await self.intake.epoch.commit_now()
        await self.output.flush()

    def _forget(self, partitions: list[tuple[str, int]]) -> None:
        self.controller.forget({p for t, p in partitions if t == self.run.controls})

    async def _prefetch(self, partitions) -> None:
        """Recover the newly assigned partitions' state now, in the background (as the worker does
        after a rebalance)."""
        self.controller.store.prefetch({tp.partition for tp in partitions if tp.topic == self.run.controls})

    def health(self) -> dict:
        held = self.intake.assigned()
        store = self.controller.store
        ready = self.directory.ready.is_set()
        return {
            "status": "ok" if held and ready else "degraded",
            "controls_assigned": None if held is None else sorted([tp.topic, tp.partition] for tp in held),
            "release_directory": self.directory.freshness(),
            "stats": {**self.stats, "controls_outputs_produced": dict(self.output.produced),
                      "controls_output_dead_letters": self.output.dead_letters, "changelog_unchanged_skipped": store.unchanged_skipped,
                      "controls_revocations_unsettled": self.intake.revocations_unsettled},
            "counters": {name: c.totals for name, c in self._counters.items()},
            "epochs": {"evaluate_controls": self.intake.epoch.health()},
            "stores": {store.name: store.health()},
            "lag": self.intake.lag.health(),
            "gc": gctune.stats(),
        }

    async def housekeeping(self) -> None:
        """Re-evaluate dependents of changed releases and keys whose deadline passed
        (``Controller.housekeeping``), every ``HOUSEKEEPING_S``."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            if self.intake.assigned():
                await self.controller.housekeeping()

    async def consume(self) -> None:
        """The intake, once the release directory is loaded (the controls judge against it)."""
        await self.directory.ready.wait()
        await self.intake.run()

    async def follow_releases(self) -> None:
        await follow_release_topic(self.bootstrap, self.catalogue.release, self.directory, lambda _keys: None,
                                   signal_initial=False, client_config=self.settings.kafka.aiokafka_config(),
                                   until=self.settings.streams.replay_to)


async def serve(settings, port: int) -> None:
    """Run the controls stage and its health page until SIGTERM or the worker is gone."""
    stage = ControlsStage(settings)
    await serve_stage("controls stage", stage, port, stage.consume(),
                      {"idle commits": stage.intake.commit_idle(), "housekeeping": stage.housekeeping(), "releases": stage.follow_releases()})


def controls_main(settings, port: int, loglevel: str = "info") -> None:
    """Entry point of the controls process (``multiprocessing``, spawn)."""
    from gpuledger import gctune

    child_main("controls", loglevel, serve(settings, port), nice=settings.streams.controls_nice,
               gc_young=gctune.GEN0_STATEFUL)  # it freezes what each epoch commit leaves alive


def controls_process(settings, loglevel: str = "info") -> ChildProcess:
    """The worker's handle on its controls process."""
    return ChildProcess("controls", controls_main, settings, (loglevel,), stop_s=CONTROLS_STOP_S)
