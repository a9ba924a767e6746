"""The control agents: the eight ownership-gap controls, continuously, in the Faust worker.

Input: the ``correlated`` topic (one row per input event, superseded by higher
versions) and the ``allocations`` topic (GPU allocation intervals), the worker's
``ReleaseDirectory`` and the policy (``GPULEDGER_POLICY_FILE``, see
``gpuledger/policy.py``). Output: ``Violation`` records on the ``violations`` topic,
keyed by violation_id — opened, then the same id with ``closed_at`` and
``version + 1`` when it ends (or withdrawn when later history no longer supports it).

Topology:
  - ``route_to_controls`` / ``route_allocations_to_controls`` keep what a control reads
    from each correlated row / allocation and re-key it to its *control key* (pod,
    workload, release, alert fingerprint, node/GPU: ``streams.controls.rules``) on the
    internal topic ``<prefix>.<app id>.controls.v1`` (co-partitioned).
  - ``evaluate_controls`` folds those messages into the changelog-backed ``controls``
    table (keyed by the internal topic's key), re-derives the violations of every
    touched key once per batch, emits what changed, and forwards what other keys need
    (a pod's rows to its workload, running intervals and allocations to their release,
    preemptions to the preemptor) on the same internal topic.
  - ``control_housekeeping`` (timer) re-evaluates keys whose releases changed in the
    directory and keys whose deadline (grace period, window end) the event-time
    watermark has passed, and after a (re)start or rebalance re-emits every key's
    current violations (the state may have been committed while the outputs were lost;
    re-sends carry the same version, so readers collapse them).

Guarantees: the latest version of every violation is a function of the topic history,
the release directory and the policy, whatever order inputs are processed in (the
rules re-derive from state; see ``streams.controls.rules``). Delivery is at least once.
Limits: the watermark is the latest event time *this worker* has seen (its partitions'
rows and every release event); with several workers a deadline may be reached by one
worker a little before another. A policy change applies to keys as they are next
evaluated (restart the worker to re-evaluate all keys at once).
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from datetime import datetime

import orjson

from gpuledger.policy import PolicySettings
from gpuledger.telemetry import ComponentCounters
from schemas import encode_event
from streams.controls.rules import (
    Context,
    allocation_key,
    compact_allocation,
    compact_row,
    digest,
    fold_link,
    fold_row,
    max_time,
    new_state,
    row_key,
    step,
)

log = logging.getLogger(__name__)

CONTROLS_BATCH = 1000
CONTROLS_WITHIN_S = 0.2
HOUSEKEEPING_S = 1.0
TICK = orjson.dumps({"k": "tick"})
RESEND = orjson.dumps({"k": "resend"})


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
        self.reconciled = False
        self._directory_seen = -1
        self._release_marks: dict[str, str] = {}

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

    def changed_releases(self, directory) -> list[str]:
        """Releases whose history or manifest changed since the last call (and advance
        the watermark to the latest release event)."""
        if len(directory.seen) == self._directory_seen:
            return []
        self._directory_seen = len(directory.seen)
        changed = []
        for rid, state in list(directory.releases.items()):
            if state["history"]:
                self.advance(state["history"][-1][0].split("|", 1)[0])
            mark = digest([len(state["history"]), state["history"][-1][0] if state["history"] else "", state["manifest"]])
            if self._release_marks.get(rid) != mark:
                self._release_marks[rid] = mark
                changed.append(rid)
        return changed


def install_control_agents(app, settings, topics: dict, directory, output):
    """Register the control agents on ``app``. ``topics`` maps role -> Faust topic:
    ``correlated``, ``allocations`` (inputs) and ``violations`` (output). ``output`` is
    the worker's ``streams.output.BatchOutput``: each batch's records are flushed
    before the batch is acked."""
    from streams.app import _as_current  # the one place that knows Faust's current-event context

    policy = PolicySettings().load()  # a bad policy stops the worker before it consumes anything
    cat = settings.kafka.catalogue()
    internal_name = f"{cat.prefix}.{settings.streams.app_id}.controls.v1"
    internal = app.topic(internal_name, internal=True, partitions=cat.raw_partitions,
                         key_serializer="raw", value_serializer="raw")
    violations_name = topics["violations"].get_topic_name()
    # key_type (not a Schema) is what Faust derives the changelog codecs from.
    table = app.Table("controls", default=None, partitions=cat.raw_partitions, key_type=str)
    runtime = ControlRuntime()
    app.gpuledger_policy = policy
    app.gpuledger_controls = runtime
    stats = app.gpuledger_stats
    for name in ("controls_in", "controls_keys", "violations_out"):
        stats.setdefault(name, 0)
    counters = ComponentCounters("streams.controls")
    app.gpuledger_control_counters = counters

    async def reroute(stream, compact, key_of) -> None:
        """Keep what the controls read from each record of ``stream``; re-key it to its control key."""
        async for events in stream.take_events(CONTROLS_BATCH, within=CONTROLS_WITHIN_S):
            for ev in events:
                msg = ev.message
                counters.add_received()
                try:
                    row = compact(orjson.loads(msg.value))
                except Exception:  # noqa: BLE001 - the sinks dead-letter unreadable rows
                    log.exception("controls could not read %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                    counters.add_rejected("unreadable")
                    continue
                if row is not None:
                    output.produce(internal_name, key_of(row).encode(), orjson.dumps({"k": "row", "row": row}))
            await output.flush()

    @app.agent(topics["correlated"], name="route_to_controls")
    async def route_to_controls(stream):
        """Correlated rows -> their control key (pod, workload, release, alert)."""
        await reroute(stream, compact_row, row_key)

    @app.agent(topics["allocations"], name="route_allocations_to_controls")
    async def route_allocations_to_controls(stream):
        """Allocation intervals -> their node/GPU control key."""
        await reroute(stream, compact_allocation, allocation_key)

    @app.agent(internal, name="evaluate_controls")
    async def evaluate_controls(stream):
        """Fold control inputs into state; emit changed violations; forward links."""
        await directory.ready.wait()
        async for events in stream.take_events(CONTROLS_BATCH, within=CONTROLS_WITHIN_S):
            touched: dict[str, tuple[dict, object]] = {}
            resend: set[str] = set()
            for ev in events:
                msg = ev.message
                key = msg.key.decode()
                try:
                    body = orjson.loads(msg.value)
                    kind = body["k"]
                    state = touched[key][0] if key in touched else table.get(key)
                    if state is None:
                        if kind in ("tick", "resend") or (kind == "link" and not body["link"]):
                            continue
                        state = new_state(key)
                    if kind == "row":
                        row = body["row"]
                        changed = fold_row(state, row)
                        for at in (row.get("at"), row.get("start"), row.get("end")):
                            runtime.advance(at)
                    elif kind == "link":
                        changed = fold_link(state, body["from"], body["link"])
                    else:  # tick (deadline or release change) / resend (after a restart)
                        changed = True
                        if kind == "resend":
                            resend.add(key)
                    if changed or key in touched:
                        touched[key] = (state, ev)
                except Exception:  # noqa: BLE001 - a poison message must not stop the agent
                    log.exception("evaluate_controls failed on %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                    counters.add_rejected("processing_error")
            ctx = Context(directory, policy, runtime.watermark)
            n_out = 0
            for key, (state, ev) in touched.items():
                try:
                    outcome = step(state, ctx, resend=key in resend)
                except Exception:  # noqa: BLE001 - one key's bad state must not stop the others
                    log.exception("control evaluation failed for %s", key)
                    counters.add_rejected("evaluation_error")
                    continue
                state["interests"] = outcome.interests
                state["deadline"] = outcome.deadline.isoformat() if outcome.deadline else None
                _as_current(ev)
                table[key] = state
                runtime.track(key, outcome.interests, outcome.deadline)
                for violation in outcome.violations:
                    value = encode_event(violation)
                    output.produce(violations_name, violation.violation_id.encode(), value)
                    counters.add_sent(1, len(value))
                for target, link in outcome.forwards:
                    output.produce(internal_name, target.encode(), orjson.dumps({"k": "link", "from": key, "link": link}))
                n_out += len(outcome.violations)
            for key in runtime.due():
                output.produce(internal_name, key.encode(), TICK)
            await output.flush()
            stats["controls_in"] += len(events)
            stats["violations_out"] += n_out
            if touched:
                log.info("controls evaluated %d message(s) for %d key(s) into %d violation record(s)", len(events), len(touched), n_out)

    @app.on_rebalance_complete.connect
    async def _controls_rebalanced(sender, **kwargs):
        runtime.reconciled = False

    @app.timer(interval=HOUSEKEEPING_S)
    async def control_housekeeping():
        """Reconcile after (re)start; re-evaluate dependents of changed releases and due deadlines."""
        if not directory.ready.is_set() or app.in_recovery or app.rebalancing:
            return
        if not runtime.reconciled:
            runtime.reconciled = True
            keys = []
            for key, state in list(table.items()):
                key = key.decode() if isinstance(key, bytes) else key
                if not state:
                    continue
                runtime.track(key, state.get("interests", []), _parse(state["deadline"]) if state.get("deadline") else None)
                runtime.advance(max_time(state))
                keys.append(key)
            runtime.changed_releases(directory)  # marks only: every key is re-sent below anyway
            stats["controls_keys"] = len(keys)
            for key in sorted(keys):
                await internal.send(key=key.encode(), value=RESEND)
            return
        targets: set[str] = set()
        for rid in runtime.changed_releases(directory):
            targets.update(runtime.dependents.get(f"rid:{rid}", ()))
        targets.update(runtime.due())
        for key in sorted(targets):
            await internal.send(key=key.encode(), value=TICK)

    return runtime
