"""The one Faust app: correlate raw events, judge the controls, sink into ClickHouse.

Input: the four raw topics (scheduler, gpu, release, alert), co-partitioned and keyed
by the shared correlation key. Output, all in the run's own topics (``<prefix>.<app
id>.*``, ``schemas.topics.RunTopics``): correlated rows, enriched alerts, GPU
allocation intervals, violations, dead letters — and, through the sink agents, the
ClickHouse tables.

Agents (each in the module that holds its logic):
  - ``route_events``, ``correlate_entities`` (``streams.correlate.agents``);
  - ``evaluate_controls`` (``streams.controls.agents``);
  - the sink loop (``sinks.agents``: a plain consumer in its own group, ``<app id>.sinks``).

Before the worker joins its consumer group it creates every topic it reads or writes
and waits until the broker's metadata shows them (a consumer that subscribes to a
topic the broker does not show yet ignores it for the life of the process). After
every rebalance it checks that each agent got its partitions; ``/gpuledger/health/``
says ``degraded`` (and names the topic) when one did not.

The worker process owns the embedded store; it serves read-only queries for the CLI
on its loopback web port (``/gpuledger/query/``), recorded beside the data dir.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import faust

from gpuledger.dev.process import free_port
from gpuledger.telemetry import ComponentCounters
from producers._kafka import client_config, ensure_specs, resolve_bootstrap
from sinks.read.query import QueryError, run_readonly
from streams.controls.agents import install_control_agents
from streams.correlate.agents import install_correlate_agents
from streams.correlate.directory import ReleaseDirectory
from streams.output import BatchOutput

log = logging.getLogger(__name__)


class WorkerContext:
    """What every agent of one worker shares: settings, the run's topics, the one
    batched producer, the release directory, the counters."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.catalogue = settings.kafka.catalogue()
        self.run = self.catalogue.run(settings.streams.app_id)
        self.bootstrap = resolve_bootstrap(settings)
        self.consumer_config = client_config(settings)
        self.output = BatchOutput(self.consumer_config, f"gpuledger-{settings.streams.app_id}", self.run.deadletter)
        self.directory = ReleaseDirectory()
        self.stats: dict = {}
        self.subscriptions: dict = {"ok": False, "problems": ["not assigned yet"]}
        self._counters: dict[str, ComponentCounters] = {}
        self.correlator = None
        self.controller = None
        self.app = None
        spec = settings.streams.fault
        self._fault = [*spec.split(":")[:2], int(spec.split(":")[2])] if spec else None

    def fault(self, stage: str, point: str) -> None:
        """Fault injection (``GPULEDGER_STREAMS_FAULT``): end the process at once, as a
        kill -9 would, the Nth time ``stage`` reaches ``point``."""
        if self._fault is None or tuple(self._fault[:2]) != (stage, point):
            return
        self._fault[2] -= 1
        if self._fault[2] == 0:
            log.critical("fault injection: exiting at %s:%s", stage, point)
            logging.shutdown()
            os._exit(137)

    def packed_batch(self) -> int:
        """Records per batch for an agent reading packed records."""
        conf = self.settings.streams
        return max(1, conf.packed_batch_messages // conf.pack_max)

    def assigned(self, topic: str) -> set[int]:
        """The partitions of ``topic`` assigned to this worker right now."""
        if self.app is None or self.app.rebalancing:
            return set()
        return {tp.partition for tp in self.app.consumer.assignment() if tp.topic == topic}

    def counters(self, component: str) -> ComponentCounters:
        if component not in self._counters:
            self._counters[component] = ComponentCounters(component)
        return self._counters[component]

    def health(self) -> dict:
        ok = self.subscriptions["ok"] and self.directory.ready.is_set()
        return {
            "status": "ok" if ok else "degraded",
            "subscriptions": self.subscriptions,
            "release_directory": {"ready": self.directory.ready.is_set(), "releases": len(self.directory.releases)},
            "stats": {**self.stats, "outputs_produced": dict(self.output.produced), "output_dead_letters": self.output.dead_letters},
            "counters": {name: c.totals for name, c in self._counters.items()},
        }


def ensure_run_topics(settings) -> None:
    """Create the catalogue's and the run's topics (idempotent) and wait until visible."""
    cat = settings.kafka.catalogue()
    ensure_specs(client_config(settings), cat.specs() + cat.run(settings.streams.app_id).specs(), cat.replication_factor)


def create_app(settings, store=None) -> faust.App:
    """Build the Faust app from settings. ``store`` is the worker's ClickHouse client or
    lazy ``StoreConnection`` (None: no sink agents)."""
    ctx = WorkerContext(settings)
    cat, run = ctx.catalogue, ctx.run
    conf = settings.streams
    web_port = conf.web_port or free_port()
    app = faust.App(
        conf.app_id,
        broker=f"kafka://{ctx.bootstrap}",
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
        broker_commit_every=10_000,
        # A crashed worker's partitions move after this long (Kafka's default, 45 s, held a
        # restarted worker's input back for most of a minute). Faust heartbeats from its
        # consumer thread, so a long batch does not miss them. Static membership would
        # be faster still, but Faust's assignor asserts that a member's web URL is the one
        # it had when the assignment was made — a restarted worker gets a new port.
        broker_session_timeout=10.0,
        broker_heartbeat_interval=1.0,
        broker_commit_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
    )
    app.gpuledger = ctx
    ctx.app = app

    def topic(*names, partitions=None):
        return app.topic(*names, key_serializer="raw", value_serializer="raw", partitions=partitions)

    raw = topic(*cat.raw_topics)
    route = topic(run.route, partitions=run.partitions)
    controls = topic(run.controls, partitions=run.partitions)
    install_correlate_agents(app, ctx, raw, route)
    install_control_agents(app, ctx, controls)
    expected = {t: cat.raw_partitions for t in (*cat.raw_topics, run.route, run.controls)}
    if store is not None:
        from sinks.agents import install_sink_agents

        sink_topics = {"correlated": [run.correlated], "deadletter": [run.deadletter, cat.deadletter], "allocations": [run.allocations],
                       "raw": list(cat.raw_topics), "violations": [run.violations]}
        install_sink_agents(app, settings, store, sink_topics, ctx)
        install_query_view(app, store)

    @app.on_rebalance_complete.connect
    async def _check_subscriptions(sender, **kwargs):
        ctx.subscriptions = check_assignment(app.consumer.assignment(), expected)
        if not ctx.subscriptions["ok"]:
            log.error("after the rebalance some agents have no partitions: %s", "; ".join(ctx.subscriptions["problems"]))

    @app.on_partitions_revoked.connect
    async def _revoked(sender, revoked, **kwargs):
        parts = {tp.partition for tp in revoked if tp.topic == run.route}
        ctx.correlator.store.drop(parts)
        ctx.controller.store.drop({tp.partition for tp in revoked if tp.topic == run.controls})

    @app.page("/gpuledger/health/")
    class HealthView(faust.web.View):
        async def get(self, request):
            return self.json(ctx.health())

    app.gpuledger_web_url = f"http://127.0.0.1:{web_port}"
    return app


def check_assignment(assignment, expected: dict[str, int]) -> dict:
    """Every co-partitioned topic an agent reads has the same partitions assigned as
    the first raw topic (one worker: all of them)."""
    per_topic: dict[str, set[int]] = {}
    for tp in assignment:
        per_topic.setdefault(tp.topic, set()).add(tp.partition)
    reference_topic = next(iter(expected))
    reference = per_topic.get(reference_topic, set())
    problems = []
    if not reference:
        problems.append(f"no partition of {reference_topic} is assigned to this worker")
    for name in expected:
        got = per_topic.get(name, set())
        if got != reference:
            problems.append(f"{name}: partitions {sorted(got)} assigned, expected {sorted(reference)} like {reference_topic}")
    return {"ok": not problems, "problems": problems, "partitions": sorted(reference)}


def install_query_view(app: faust.App, store) -> None:
    """Serve read-only queries on the worker's loopback port (the owner of the store)."""
    from sinks.clickhouse import StoreConnection

    connection = StoreConnection.of(store)

    @app.page("/gpuledger/query/")
    class QueryView(faust.web.View):
        async def post(self, request):
            try:
                body = await request.json()
                sql, params = body["sql"], body.get("parameters") or {}
            except (ValueError, KeyError, TypeError):
                return self.json({"error": 'body must be JSON {"sql": ..., "parameters": {...}}'}, status=400)
            try:
                client = await asyncio.to_thread(connection.get)
                result = await asyncio.to_thread(run_readonly, client, sql, params)
            except QueryError as exc:
                return self.json({"error": str(exc)}, status=400)
            except Exception as exc:  # noqa: BLE001 - the store is unreachable: say so, do not crash the page
                return self.json({"error": f"store unavailable: {exc}"}, status=503)
            return self.json({"columns": result.columns, "rows": result.rows})


STOP_WITHIN_S = 8.0


def stop_within(app: faust.App, worker, cleanup) -> None:
    """On SIGTERM, stop as Faust does — and if that has not finished within
    ``STOP_WITHIN_S`` (a broker outage can hold Faust's shutdown for minutes), exit 0 at
    once. That is safe at any instant: a batch is acked only after its outputs and state
    are acknowledged, so an unfinished batch is simply processed again after a restart."""

    def hard_stop() -> None:
        log.warning("stop did not finish within %.0fs; exiting now (unfinished batches were not acked)", STOP_WITHIN_S)
        cleanup()
        logging.shutdown()
        os._exit(0)

    @app.task
    async def _watch_sigterm():
        loop = asyncio.get_running_loop()
        original = worker._on_sigterm

        def on_sigterm() -> None:
            timer = threading.Timer(STOP_WITHIN_S, hard_stop)
            timer.daemon = True
            timer.start()
            original()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)


def run_worker(settings, loglevel: str = "info") -> None:
    """Run the worker in this process until SIGTERM/SIGINT (owns the embedded store).

    The store is connected lazily: the worker starts while ClickHouse is down, and the
    sinks hold their offsets until it is back (migrations run on the first connect).
    """
    from gpuledger.telemetry import calm_logging
    from sinks.clickhouse import is_embedded, migrated_store
    from sinks.read.query import clear_owner, write_owner

    calm_logging()
    dsn = settings.clickhouse_dsn
    conf = settings.clickhouse
    store = migrated_store(dsn, conf.database, conf.cluster, conf.ttl_days)
    if is_embedded(dsn):
        store.get()  # the embedded store is this process's own: open it now (fails fast if another process holds it)
    ensure_run_topics(settings)
    app = create_app(settings, store)
    if is_embedded(dsn):
        write_owner(dsn, app.gpuledger_web_url)
    profile = os.environ.get("GPULEDGER_PROFILE")  # benchmarks --profile
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False, override_logging=False)
        stop_within(app, worker, lambda: clear_owner(dsn) if is_embedded(dsn) else None)
        worker.execute_from_commandline()
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)
        left = app.gpuledger.output.close()
        if left:
            log.warning("%d output record(s) were not acknowledged at exit (their batches were not acked either)", left)
        if is_embedded(dsn):
            clear_owner(dsn)

