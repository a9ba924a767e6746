"""The route stage, in a process of its own: decode each raw record once, dead-letter
poison, re-key the event to its entity, build the row it becomes in that entity's state
(``entities.event_row``) and pack it on the run's route topic.

Input: the four raw topics, through ``RawIntake`` (``streams.correlate.intake``: a plain
consumer in the group ``<app id>.route``). Output: routed rows packed on
``<run>.route``, addressed to their entity's partition (``streams.packing``), dead
letters (poison, with reason and source offset) on ``<run>.deadletter``, and the route
group's committed offsets. Health: ``/gpuledger/health/`` on a loopback port, merged into
the worker's page (``streams.app.WorkerContext.health``).

Why a process of its own (``gpuledger.child``): the stage is stateless — it needs neither
Faust's co-partitioned assignment nor any state — and in the worker's process it took
about a sixth of the one interpreter that runs every stateful stage (``make bench``'s
profile: decode, pack and produce of every raw record), while in a bulk read that
interpreter was the bottleneck with a core's worth of the machine idle. Apart, the
correlation stage gets that share back and the two run at once.

Guarantees: the runner's epochs (``streams.runner.Epoch``) over this process's own
producer — at every epoch commit every routed record produced so far is acknowledged,
then the epoch's offsets are committed (``RawIntake``). A crash of this process (or of the
worker, which ends it) at any instant re-routes from the last committed offset; the
correlation folds are idempotent (an event id folds once), so a re-routed event changes
nothing. The worker restarts the process when it ends (``ChildProcess.restart_if_dead``).
"""

from __future__ import annotations

import logging
import time
from operator import itemgetter

import orjson

from gpuledger import gctune
from gpuledger.child import ChildProcess, child_main
from gpuledger.telemetry import ComponentCounters
from gpuledger.timefmt import TimeFormatError, parse_timestamp
from schemas import EventDecodeError, decode_event, encode_event
from schemas.outputs import dead_letter
from streams import caps
from streams.correlate.entities import event_row
from streams.correlate.routing import entity_key, routed_event
from streams.intake import serve_stage
from streams.packing import Packer, kind_of
from streams.runner import FaultInjection

log = logging.getLogger(__name__)

#: Seconds the worker gives a stopping route stage before it kills it (inside the
#: worker's own stop bound, ``streams.app.STOP_WITHIN_S``).
ROUTE_STOP_S = 5.0
STAGE = "streams.route_events"


def _may_be_in_range(value: bytes, in_range) -> bool:
    """Whether a record that is not a valid event could belong to a replay's range: False only
    when it reads as a JSON object whose ``occurred_at`` is a time outside it (a malformed event
    of another day was dead-lettered into the range's sandbox and counted in range); anything
    unreadable stays the replay's to dead-letter."""
    try:
        doc = orjson.loads(value)
        at = parse_timestamp(doc.get("occurred_at")) if isinstance(doc, dict) else None
    except (orjson.JSONDecodeError, TimeFormatError, TypeError):
        return True
    return at is None or in_range(at)


class Router:
    """The route stage's batch logic (``RawIntake`` drives it; a test or a benchmark can)."""

    def __init__(self, settings, output, fault=None) -> None:
        self.settings = settings
        self.run = settings.kafka.catalogue().run(settings.streams.app_id)
        self.output = output
        self.fault = fault or FaultInjection(None)
        self.packer = Packer(self.run.route, self.run.partitions, max_messages=settings.streams.pack_max)
        self.counters = ComponentCounters("streams.route")
        self.stats: dict = {"routed": 0, "out_of_range": 0, "dead_letters": 0, "capped": caps.counts()}  # (``streams.caps``)

    async def route_batch(self, events: list) -> None:
        in_range = self.settings.streams.in_range  # a replay's event-time range (`gpuledger replay --from/--to`)
        ranged = self.settings.streams.replay_from is not None or self.settings.streams.replay_to is not None
        skipped = 0
        self.counters.add_received(len(events))
        routed = []
        for ev in events:
            msg = ev.message
            try:
                event = decode_event(msg.value)
                key = entity_key(event)
            except EventDecodeError as exc:
                if ranged and not _may_be_in_range(msg.value, in_range):
                    skipped += 1  # (a replay's: its time, where the record names one, is outside the range)
                    continue
                self._dead(exc.reason, str(exc), msg)
                continue
            if not in_range(event.occurred_at):
                skipped += 1
                continue
            routed.append((event.occurred_at, key, event, msg))
        # In event-time order: a batch holds runs of records partition by partition (as
        # they were fetched), and an entity that sees its history in order re-derives and
        # re-emits less (an alert folded after its GPU's assignment is emitted once, not
        # first unattributed). Any order gives the same latest rows (versions from history).
        routed.sort(key=itemgetter(0))  # by occurred_at
        for _at, key, event, msg in routed:
            # The row the event becomes in its entity's state, built here: a function of the
            # event alone, and this process has room while the correlation's is the busiest.
            src = (msg.topic, msg.partition, msg.offset)
            self.packer.add(key, {"k": "row", "row": event_row(routed_event(event), kind_of(key), src)}, source=src)
        self.packer.drain_into(self.output)
        if not self.stats.get("first_route_batch"):
            # make bench's rate counts from the end of the first batch, as its pass-through's does
            # (time.monotonic() is one clock for every process on the machine).
            self.stats["first_route_batch"], self.stats["first_route_batch_at"] = len(events), time.monotonic()
        self.stats["routed"] += len(routed)  # (not the dead letters: they were counted as routed, and "in range")
        self.stats["out_of_range"] += skipped
        self.stats["capped"] = caps.counts()
        self.counters.add_sent(len(routed))

    async def commit(self) -> None:
        """The epoch commit: every routed record acknowledged (the intake commits the
        epoch's offsets after this returns)."""
        await self.output.flush()
        self.fault("route", "after_outputs")

    async def reset(self, events: list) -> None:
        """A failed batch: drop what it packed and has not produced yet (no state to reload)."""
        self.packer.discard()

    async def dead(self, event, exc: BaseException) -> None:
        self._dead("processing_error", f"{type(exc).__name__}: {exc}", event.message)
        await self.output.flush()

    def _dead(self, reason: str, error: str, msg) -> None:
        letter = dead_letter(reason, error, STAGE, msg.topic, msg.partition, msg.offset, msg.key, msg.value)
        self.output.produce(self.run.deadletter, msg.key, encode_event(letter))
        self.counters.add_rejected(reason)
        self.stats["dead_letters"] += 1


class RouteStage:
    """The process's parts: the router, its intake (consumer + epoch) and its health."""

    def __init__(self, settings) -> None:
        from producers._kafka import client_config
        from streams.correlate.intake import RawIntake
        from streams.output import BatchOutput

        catalogue, config = settings.kafka.catalogue(), client_config(settings)
        self.output = BatchOutput(config, f"gpuledger-{settings.streams.app_id}-route", catalogue.run(settings.streams.app_id).deadletter)
        self.router = r = Router(settings, self.output, FaultInjection(settings.streams.fault))
        self.intake = RawIntake(settings, config, catalogue.raw_topics,
                                ("route_events", r.route_batch, r.reset, r.dead, r.commit, settings.streams.commit_interval_s))

    def health(self) -> dict:
        held = self.intake.assigned()
        return {
            "status": "ok" if held else "degraded",
            "raw_assigned": None if held is None else sorted([tp.topic, tp.partition] for tp in held),
            "stats": {**self.router.stats, "route_outputs_produced": dict(self.output.produced),
                      "route_output_dead_letters": self.output.dead_letters},
            "counters": {self.router.counters.component: self.router.counters.totals},
            "epochs": {"route_events": self.intake.epoch.health()},
            "alignment": self.intake.align.health(),
            "lag": self.intake.lag.health(),
            "gc": gctune.stats(),
        }


async def serve(settings, port: int) -> None:
    """Run the route stage and its health page until SIGTERM or the worker is gone."""
    stage = RouteStage(settings)
    await serve_stage("route stage", stage, port, stage.intake.run(), {"idle commits": stage.intake.commit_idle()})


def route_main(settings, port: int, loglevel: str = "info") -> None:
    """Entry point of the route process (``multiprocessing``, spawn)."""
    child_main("route", loglevel, serve(settings, port))


def route_process(settings, loglevel: str = "info") -> ChildProcess:
    """The worker's handle on its route process."""
    return ChildProcess("route", route_main, settings, (loglevel,), stop_s=ROUTE_STOP_S)
