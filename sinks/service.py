"""The sink service: the process that stores a run's topics into ClickHouse and serves
read-only queries of the store it writes.

``gpuledger worker`` starts it as a child process (``sink_process``, ``gpuledger.child``) and supervises it;
its health page merges the sink's (``/gpuledger/health/`` here). Why a process of its
own: the sink and the correlation agents shared one interpreter, and chDB holds the GIL
for much of an insert — correlation ran at a fraction of its speed while the sink
stored, and rows became queryable tens of seconds after their events (``make bench``,
latency run). Apart, each has a core.

Input: the raw topics, the run's correlated/allocations/violations/dead-letter topics
and the shared edge dead-letter topic (``sink_topics``), read by ``SinkLoop`` in its own
consumer group ``<app id>.sinks``. Output: the ClickHouse tables; rows the store rejects
go to the run's dead-letter topic (``store_rejected``) through this process's own
producer, acknowledged before the batch's offsets are committed.

Queries (``POST /gpuledger/query/``, JSON ``{"sql": …, "parameters": {…}}``) need the
bearer token this process writes, with its URL, into the owner file beside the chDB
directory (mode 0600; ``sinks.read.query.open_reader`` reads it). They run on a client
of their own — never the sink's — with the limits of ``ClickHouseSettings.query_*``
(``max_execution_time``, result rows and bytes, one thread each); at most
``query_concurrency`` are admitted at once and ``query_queue`` wait, later ones get a 503 — and
the admitted ones reach the store one at a time (``StoreConnection.reading``: chDB runs one
client's statements one at a time anyway).

Lifecycle: runs until SIGTERM/SIGINT or until its parent (the worker) is gone — a
kill -9 of the worker ends the sink too, after the batch in hand is stored and
committed. A second sink on the same chDB directory (a restarted worker's, while the
old one finishes) waits for the directory's lock: the writers back off on
``StoreLocked``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections import Counter

from gpuledger import gctune
from gpuledger.child import child_main, stop_requested

log = logging.getLogger(__name__)

#: Seconds the worker gives a stopping sink before it kills it (inside the worker's
#: own stop bound, ``streams.app.STOP_WITHIN_S``).
SINK_STOP_S = 5.0


def sink_topics(settings) -> dict[str, list[str]]:
    """kind -> the topics the sink stores (what ``SinkLoop`` subscribes to)."""
    cat = settings.kafka.catalogue()
    run = cat.run(settings.streams.app_id)
    return {"correlated": [run.correlated], "deadletter": [run.deadletter, cat.deadletter], "allocations": [run.allocations],
            "raw": list(cat.raw_topics), "violations": [run.violations]}


class SinkContext:
    """What ``SinkLoop`` needs of its process: settings, the run's topics, one producer
    (dead letters), stats and counters."""

    def __init__(self, settings) -> None:
        from producers._kafka import client_config
        from streams.output import BatchOutput

        self.settings = settings
        self.catalogue = settings.kafka.catalogue()
        self.run = self.catalogue.run(settings.streams.app_id)
        self.consumer_config = client_config(settings)
        self.output = BatchOutput(self.consumer_config, f"gpuledger-{settings.streams.app_id}-sinks", self.run.deadletter)
        self.stats: Counter = Counter({key: 0 for key in ("stored", "allocations_stored", "raw_stored", "raw_skipped", "raw_out_of_range",
                                                          "deadletters_out_of_range", "violations_stored", "store_rejected", "queries", "queries_refused")})
        self.sinks = None
        self.loop = None  # sinks.agents.SinkLoop, once built

    def health(self, store) -> dict:
        # A table whose writes are failing (the store down, or refusing every attempt): the sink holds
        # its batch and consumes nothing more, so the tables trail the topics — said here, and by the
        # worker's page (it was "ok" with a lag of 0 while nothing was stored: the lag comes from the
        # consumer's statistics, which a consumer that is not polled does not update).
        problems = [p for w in (self.sinks.writers.values() if self.sinks else ()) if (p := w.outage.problem())]
        return {
            "status": "degraded" if problems else "ok",
            "problems": problems,
            "store": {"connected": store.connected},
            "stats": {**self.stats, "sink_outputs_produced": dict(self.output.produced), "sink_output_dead_letters": self.output.dead_letters},
            "counters": {"sinks": self.sinks.counters.totals if self.sinks else {}},
            "lag": self.loop.lag.health() if self.loop else None,
            "gc": gctune.stats(),
        }


def build_sink(settings, ctx: SinkContext, store):
    """The sink loop over ``store`` (an open client or ``StoreConnection``)."""
    from schemas import encode_event
    from sinks.agents import SinkLoop, SinkWriters
    from sinks.clickhouse import StoreConnection
    from sinks.migrations import apply_ttl

    conf = settings.clickhouse
    store = StoreConnection.of(store)
    if store.connected:
        # Retention is configuration: keep it in step at every start (a lazy store does
        # this on connect, ``migrated_store``).
        apply_ttl(store.get(), conf.database, conf.ttl_days, conf.cluster)

    async def dead_letter_rejected(row) -> None:
        ctx.stats["store_rejected"] += 1
        ctx.output.produce(ctx.run.deadletter, row.source.key if row.source else None, encode_event(row.dead_letter()))

    ctx.sinks = SinkWriters(store, conf.database, conf.cluster, on_rejected=dead_letter_rejected)
    ctx.loop = SinkLoop(settings, ctx, ctx.sinks, sink_topics(settings))
    return ctx.loop


class QueryGate:
    """At most ``concurrency`` queries at once, ``queue`` waiting; beyond that, refuse."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self.running = asyncio.Semaphore(concurrency)
        self.limit = concurrency + queue
        self.inside = 0

    def admit(self) -> bool:
        if self.inside >= self.limit:
            return False
        self.inside += 1
        return True

    def leave(self) -> None:
        self.inside -= 1


def query_app(settings, ctx: SinkContext, store, token: str):
    """The aiohttp application: ``/gpuledger/health/`` and ``/gpuledger/query/``."""
    from aiohttp import web

    from sinks.clickhouse import StoreConnection, connect
    from sinks.read.query import QueryError, QueryLimits, run_readonly

    conf = settings.clickhouse
    limits = QueryLimits.of(conf)
    # The readers' own client: a long query must not hold the sink's inserts (chDB
    # serialises the statements of one client).
    # It opens after the sink's own (migrated first: a reader sees every table).
    readers = StoreConnection(lambda: (StoreConnection.of(store).get(), connect(settings.clickhouse_dsn, conf.database))[1])
    gate = QueryGate(conf.query_concurrency, conf.query_queue)

    async def health(request):
        return web.json_response(ctx.health(store))

    async def query(request):
        offered = request.headers.get("Authorization", "")
        if not hmac.compare_digest(offered.encode(), f"Bearer {token}".encode()):
            ctx.stats["queries_refused"] += 1
            return web.json_response({"error": "a bearer token is required: the one in the store's owner file (mode 0600)"}, status=401)
        try:
            body = await request.json()
            sql, params = body["sql"], body.get("parameters") or {}
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'body must be JSON {"sql": ..., "parameters": {...}}'}, status=400)
        if not gate.admit():
            ctx.stats["queries_refused"] += 1
            return web.json_response({"error": f"busy: {gate.limit} queries running or waiting; try again"}, status=503,
                                     headers={"Retry-After": "1"})
        try:
            async with gate.running:
                ctx.stats["queries"] += 1
                result = await asyncio.to_thread(run_readonly, readers, sql, params, limits)
        except QueryError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # noqa: BLE001 - the store is unreachable: say so, do not crash the page
            return web.json_response({"error": f"store unavailable: {exc}"}, status=503)
        finally:
            gate.leave()
        return web.json_response({"columns": result.columns, "rows": result.rows})

    app = web.Application(client_max_size=1 << 20)
    app.router.add_get("/gpuledger/health/", health)
    app.router.add_post("/gpuledger/query/", query)
    return app


async def serve(settings, port: int, worker_url: str) -> None:
    """Run the sink and its query endpoint until stopped (module docstring)."""
    from aiohttp import web

    from sinks.clickhouse import is_embedded, migrated_store
    from sinks.read.query import clear_owner, write_owner

    dsn, conf = settings.clickhouse_dsn, settings.clickhouse
    store = migrated_store(dsn, conf.database, conf.cluster, conf.ttl_days)
    ctx = SinkContext(settings)
    sink = build_sink(settings, ctx, store)
    token = secrets.token_urlsafe(32)
    runner = web.AppRunner(query_app(settings, ctx, store, token), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    if is_embedded(dsn):
        write_owner(dsn, url, token, health=worker_url)
    stop = stop_requested("sink")
    task = asyncio.create_task(sink.run(), name="sink-loop")
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # the loop ended on its own: an error, raised here
        # Stop between batches: the batch in hand is stored and committed first
        # (bounded by the worker's SINK_STOP_S, after which it kills this process).
        await sink.stop()
        await task
    finally:
        if is_embedded(dsn):
            clear_owner(dsn)
        left = await asyncio.to_thread(ctx.output.close)
        if left:
            log.warning("%d dead letter(s) were not acknowledged at exit (their batch was not committed)", left)
        await runner.cleanup()


def sink_main(settings, port: int, worker_url: str, loglevel: str = "info") -> None:
    """Entry point of the sink process (``multiprocessing``, spawn)."""
    child_main("sink", loglevel, serve(settings, port, worker_url), nice=settings.streams.sink_nice)


def sink_process(settings, worker_url: str, loglevel: str = "info"):
    """The worker's handle on its sink process (``gpuledger.child.ChildProcess``)."""
    from gpuledger.child import ChildProcess

    return ChildProcess("sink", sink_main, settings, (worker_url, loglevel), stop_s=SINK_STOP_S)
