"""The one Faust app: correlate raw events, and sink the results into ClickHouse.

Input: the four raw topics (scheduler, gpu, release, alert), co-partitioned and keyed
by the shared correlation key. Output: the correlated topic (one row per input,
superseded by higher versions when attribution improves), GPU allocation intervals,
enriched alerts, dead letters, and — through the sink agents — the ClickHouse tables.

Topology (see docs/architecture.md for the diagram):
  - ``route_events`` reads every raw topic through one channel in batches, dead-letters
    poison records (with reason and topic/partition/offset) and re-keys each event to
    its entity (``streams.correlate.routing``) on the internal route topic.
  - ``correlate_entities`` folds routed messages into the ``entities`` table
    (changelog-backed; recovered on restart) and re-derives each touched entity once
    per batch (``streams.correlate.entities``): correlated rows, allocation intervals, and links
    forwarded to related entities (pod -> node/GPU, pod <-> workload) via the route topic.
  - ``follow_releases`` keeps the ReleaseDirectory (every release, on every worker);
    ``housekeeping`` re-attributes the dependents of a changed release, reconciles
    after a (re)start or rebalance, and flushes parked rows on an idle source.
  - sink agents (``sinks.agents``) insert output topics into ClickHouse.

The worker process owns the embedded store; it serves read-only queries for the CLI
on its loopback web port (``/gpuledger/query/``), recorded beside the data dir.
"""

from __future__ import annotations

import asyncio
import heapq
import os
import logging
import time
import weakref
from collections import defaultdict
from datetime import datetime, timedelta, timezone

import faust
import orjson
from faust.streams import _current_event

from gpuledger.localkafka import free_port
from producers._kafka import client_config, resolve_bootstrap
from schemas import DeadLetter, EventDecodeError, decode_event, encode_event
from sinks.query import QueryError, run_readonly
from streams.correlate.directory import ReleaseDirectory, follow_release_topic
from streams.output import BatchOutput
from streams.correlate.entities import expire, fold_event, fold_link, new_entity, refresh
from streams.correlate.routing import entity_key

log = logging.getLogger(__name__)

CORRELATE_BATCH = 1000
CORRELATE_WITHIN_S = 0.2
MAX_DEAD_VALUE = 64 * 1024


def _as_current(event) -> None:
    # Faust routes a table's changelog record to the partition of the *current*
    # event. Inside a take_events() batch the "current" event is the last one
    # buffered, which may sit on another partition than the key being written;
    # point the context at the event that touched the key so the changelog lands on
    # the key's own (co-partitioned) partition. Faust has no public API for this.
    _current_event.set(weakref.ref(event))


class Runtime:
    """Per-worker, in-memory helpers around the entity table (rebuilt after a restart).

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
        self.reconciled = False
        self.handled: set[str] = set()  # entity keys this process wrote or re-sent
        self.watermark: str = ""
        self.last_input = time.monotonic()
        self._heap: list[tuple[str, str, str]] = []
        self._parked: set[tuple[str, str]] = set()

    def index(self, key: str, interests) -> None:
        for interest in interests:
            self.dependents[interest].add(key)

    def park(self, at_iso: str, key: str, row_id: str) -> None:
        if (key, row_id) in self._parked:
            return
        deadline = (datetime.fromisoformat(at_iso) + self.park_ttl).isoformat()
        heapq.heappush(self._heap, (deadline, key, row_id))
        self._parked.add((key, row_id))

    def advance(self, watermark: datetime) -> None:
        iso = watermark.isoformat()
        if iso > self.watermark:
            self.watermark = iso

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


def dead_letter(reason: str, error: str, stage: str, message) -> DeadLetter:
    value = message.value if isinstance(message.value, (bytes, bytearray)) else str(message.value).encode()
    key = message.key if isinstance(message.key, (bytes, bytearray)) else (str(message.key).encode() if message.key is not None else None)
    return DeadLetter(
        reason=reason, error=error[:2000], stage=stage, source_topic=message.topic, source_partition=message.partition,
        source_offset=message.offset, key=key.decode("utf-8", "replace") if key else None,
        value=bytes(value[:MAX_DEAD_VALUE]).decode("utf-8", "replace"), failed_at=datetime.now(timezone.utc),
    )


def create_app(settings, store_client=None) -> faust.App:
    """Build the Faust app from settings. ``store_client`` is the owned ClickHouse client."""
    cat = settings.kafka.catalogue()
    conf = settings.streams
    web_port = conf.web_port or free_port()
    app = faust.App(
        conf.app_id,
        broker=f"kafka://{resolve_bootstrap(settings)}",
        broker_credentials=settings.kafka.faust_credentials(),
        store="memory://",
        datadir=str(settings.data_dir / "streams"),
        web_enabled=True,
        web_bind="127.0.0.1",
        web_host="127.0.0.1",
        web_port=web_port,
        topic_partitions=cat.raw_partitions,
        topic_replication_factor=cat.replication_factor,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        # Outputs, links and changelog records go out in batches, not one request each
        # (the profile of one worker was dominated by tiny produce requests).
        producer_linger=0.02,
        producer_max_batch_size=512 * 1024,
        producer_compression_type="lz4",
        table_standby_replicas=0,
        broker_commit_every=1000,
        # A crashed worker's partitions move after this long (Kafka's default, 45 s,
        # holds a restarted worker's input back for most of a minute; much shorter and a
        # busy worker on a loaded machine misses heartbeats and rebalances needlessly).
        broker_session_timeout=20.0,
        broker_heartbeat_interval=3.0,
        broker_commit_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
    )
    raw = app.topic(*cat.raw_topics, key_serializer="raw", value_serializer="raw")
    correlated = app.topic(cat.correlated, key_serializer="raw", value_serializer="raw")
    dead = app.topic(cat.deadletter, key_serializer="raw", value_serializer="raw")
    allocations = app.topic(cat.allocations, key_serializer="raw", value_serializer="raw")
    # key_type/value_type (not a Schema) is what Faust derives the changelog codecs from.
    entities = app.Table("entities", default=None, partitions=cat.raw_partitions, key_type=str)
    app.gpuledger_stats = {"correlated_in": 0, "correlated_out": 0, "dead_letters": 0, "stored": 0}

    async def send_dead(letter: DeadLetter, key) -> None:
        app.gpuledger_stats["dead_letters"] += 1
        await dead.send(key=key, value=encode_event(letter))

    route_name = f"{cat.prefix}.{conf.app_id}.route.v1"
    # Batch outputs go through librdkafka (streams/output.py); flushed before each batch is acked.
    out = BatchOutput(client_config(settings), f"gpuledger-{conf.app_id}")
    route = app.topic(route_name, internal=True, partitions=cat.raw_partitions, key_serializer="raw", value_serializer="raw")
    directory = ReleaseDirectory()
    runtime = Runtime(park_ttl=timedelta(seconds=conf.park_ttl_s), idle_flush_s=conf.park_idle_flush_s)
    app.gpuledger_directory = directory
    app.gpuledger_runtime = runtime

    @app.agent(raw, name="route_events")
    async def route_events(stream):
        """Decode raw events, dead-letter poison, re-key each event to its entity."""
        async for events in stream.take_events(CORRELATE_BATCH, within=CORRELATE_WITHIN_S):
            for ev in events:
                msg = ev.message
                try:
                    event = decode_event(msg.value)
                    key = entity_key(event)
                except EventDecodeError as exc:
                    await send_dead(dead_letter(exc.reason, str(exc), "streams.route_events", msg), msg.key)
                    continue
                except Exception as exc:  # noqa: BLE001 - a poison record must not stop the agent
                    log.exception("route_events failed on %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                    await send_dead(dead_letter("processing_error", f"{type(exc).__name__}: {exc}", "streams.route_events", msg), msg.key)
                    continue
                envelope = {"k": "event", "src": [msg.topic, msg.partition, msg.offset], "event": orjson.loads(msg.value)}
                out.produce(route_name, key.encode(), orjson.dumps(envelope))
            await out.flush()
            app.gpuledger_stats["routed"] = app.gpuledger_stats.get("routed", 0) + len(events)
            runtime.last_input = time.monotonic()

    @app.agent(route, name="correlate_entities")
    async def correlate_entities(stream):
        """Fold routed messages into entity state; emit correlated rows, allocations, links."""
        await directory.ready.wait()
        async for events in stream.take_events(CORRELATE_BATCH, within=CORRELATE_WITHIN_S):
            touched: dict[str, tuple[dict, object]] = {}
            resend: set[str] = set()
            watermark = None
            n_in = 0
            for ev in events:
                msg = ev.message
                key = msg.key.decode()
                try:
                    body = orjson.loads(msg.value)
                    state = touched[key][0] if key in touched else entities.get(key)
                    if state is None:
                        if body["k"] in ("refresh", "resend"):
                            continue
                        state = new_entity(key)
                    if body["k"] == "event":
                        event = decode_event(body["event"])
                        n_in += 1
                        if fold_event(state, event, tuple(body["src"])):
                            at = event.occurred_at
                            watermark = at if watermark is None or at > watermark else watermark
                    elif body["k"] == "link":
                        fold_link(state, body["from"], body["link"])
                    elif body["k"] == "expire":
                        expire(state, body["rows"])
                    elif body["k"] == "resend":
                        resend.add(key)
                    # "refresh": nothing to fold; the entity is re-derived below
                    touched[key] = (state, ev)
                except Exception as exc:  # noqa: BLE001 - a poison record must not stop the agent
                    log.exception("correlate_entities failed on %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                    await send_dead(dead_letter("processing_error", f"{type(exc).__name__}: {exc}", "streams.correlate_entities", msg), msg.key)
            n_out = 0
            for key, (state, ev) in touched.items():
                outcome = refresh(state, directory, resend=key in resend)
                _as_current(ev)
                entities[key] = state
                runtime.handled.add(key)
                runtime.index(key, state["interests"])
                for at_iso, row_id in outcome.parked:
                    runtime.park(at_iso, key, row_id)
                for row in outcome.correlated:
                    value = encode_event(row)
                    out.produce(cat.correlated, (row.identity.release_id or row.correlation_id).encode(), value)
                    if row.event_type.startswith("alert."):
                        out.produce(cat.enriched_alerts, (row.identity.alert_fingerprint or row.correlation_id).encode(), value)
                for alloc in outcome.allocations:
                    out.produce(cat.allocations, f"{alloc.node}/{alloc.gpu_id}".encode(), encode_event(alloc))
                for target, link in outcome.forwards:
                    out.produce(route_name, target.encode(), orjson.dumps({"k": "link", "from": key, "link": link}))
                n_out += len(outcome.correlated)
            if watermark is not None:
                runtime.advance(watermark)
            for target, rows in runtime.due().items():
                out.produce(route_name, target.encode(), orjson.dumps({"k": "expire", "rows": rows}))
            await out.flush()
            app.gpuledger_stats["correlated_in"] += n_in
            app.gpuledger_stats["correlated_out"] += n_out
            app.gpuledger_stats["parked"] = runtime.parked_count()
            log.info("correlated %d message(s) for %d entit(ies) into %d row(s)", len(events), len(touched), n_out)

    def on_release_change(interest_keys: list[str]) -> None:
        runtime.pending_refresh.update(interest_keys)

    @app.task
    async def follow_releases():
        await follow_release_topic(resolve_bootstrap(settings), cat.release, directory, on_release_change,
                                   client_config=settings.kafka.aiokafka_config())

    @app.on_rebalance_complete.connect
    async def _rebalanced(sender, **kwargs):
        runtime.reconciled = False

    @app.timer(interval=0.5)
    async def housekeeping():
        """Re-attribute dependents of changed releases; reconcile after (re)start; idle flush."""
        if not directory.ready.is_set() or app.in_recovery or app.rebalancing:
            return
        targets: set[str] = set()
        resend_keys: set[str] = set()
        if not runtime.reconciled:
            runtime.reconciled = True
            for key, state in list(entities.items()):
                key = key.decode() if isinstance(key, bytes) else key
                runtime.index(key, state.get("interests", []))
                for rec in state.get("rows", {}).values():
                    if rec.get("parked"):
                        runtime.park(rec["starts_at"] or rec["at"], key, rec["id"])
                # Entities this process has not handled yet (all of them after a
                # restart, the moved ones after a rebalance) re-send their outputs once.
                if key not in runtime.handled:
                    runtime.handled.add(key)
                    resend_keys.add(key)
        if runtime.pending_refresh:
            changed, runtime.pending_refresh = runtime.pending_refresh, set()
            for interest in changed:
                targets.update(runtime.dependents.get(interest, ()))
        for key in sorted(resend_keys):
            await route.send(key=key.encode(), value=orjson.dumps({"k": "resend"}))
        for key in sorted(targets - resend_keys):
            await route.send(key=key.encode(), value=orjson.dumps({"k": "refresh"}))
        if runtime.idle():
            for target, rows in runtime.due(flush_all=True).items():
                await route.send(key=target.encode(), value=orjson.dumps({"k": "expire", "rows": rows}))

    from streams.controls.agents import install_control_agents

    violations_topic = app.topic(cat.violations, key_serializer="raw", value_serializer="raw")
    install_control_agents(app, settings, {"correlated": correlated, "allocations": allocations, "violations": violations_topic}, directory, out)

    if store_client is not None:
        from sinks.agents import install_sink_agents

        install_sink_agents(app, settings, store_client, {"correlated": correlated, "deadletter": dead, "allocations": allocations,
                                                          "raw": raw, "violations": violations_topic}, send_dead)
        install_query_view(app, store_client)

    @app.page("/gpuledger/health/")
    class HealthView(faust.web.View):
        async def get(self, request):
            return self.json({"status": "ok", "stats": app.gpuledger_stats})

    app.gpuledger_web_url = f"http://127.0.0.1:{web_port}"
    return app


def install_query_view(app: faust.App, store_client) -> None:
    """Serve read-only queries on the worker's loopback port (the owner of the store)."""

    @app.page("/gpuledger/query/")
    class QueryView(faust.web.View):
        async def post(self, request):
            try:
                body = await request.json()
                sql, params = body["sql"], body.get("parameters") or {}
            except (ValueError, KeyError, TypeError):
                return self.json({"error": 'body must be JSON {"sql": ..., "parameters": {...}}'}, status=400)
            try:
                result = await asyncio.to_thread(run_readonly, store_client, sql, params)
            except QueryError as exc:
                return self.json({"error": str(exc)}, status=400)
            return self.json({"columns": result.columns, "rows": result.rows})


def run_worker(settings, loglevel: str = "info") -> None:
    """Run the worker in this process until SIGTERM/SIGINT (owns the embedded store)."""
    from sinks.clickhouse import connect
    from sinks.migrations import migrate
    from sinks.query import clear_owner, write_owner

    dsn = settings.clickhouse_dsn
    client = connect(dsn, settings.clickhouse.database)
    migrate(client, settings.clickhouse.database, settings.clickhouse.cluster)
    app = create_app(settings, client)
    if dsn.startswith("chdb:"):
        write_owner(dsn, app.gpuledger_web_url)
    profile = os.environ.get("GPULEDGER_PROFILE")  # benchmarks/bench_streams.py --profile
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False, override_logging=False)
        worker.execute_from_commandline()
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)
        if dsn.startswith("chdb:"):
            clear_owner(dsn)
