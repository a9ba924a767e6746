"""The worker: correlate raw events, judge the controls, sink into ClickHouse.

Input: the four raw topics (scheduler, gpu, release, alert), co-partitioned and keyed
by the shared correlation key, read by the route stage (a process of its own, in its own
consumer group ``<app id>.route``: ``streams.correlate.route``); the correlation agent
(Faust) reads the run's internal route topic, the controls stage its controls topic.
Output, all in the run's own topics (``<prefix>.<app id>.*``,
``schemas.topics.RunTopics``): correlated rows, enriched alerts, GPU allocation
intervals, violations, dead letters — and, through the sink, the ClickHouse tables.

Stages (each in the module that holds its logic), in four processes:
  - ``route_events``, in a child process the worker starts and supervises
    (``streams.correlate.route``: a plain consumer of the raw topics, ``streams.correlate.intake``);
  - ``correlate_entities`` (``streams.correlate.agents``): the Faust agent, in this process;
  - ``evaluate_controls`` (``streams.controls.agents``), in a child process too
    (``streams.controls.service``: a plain consumer of the controls topic in the group
    ``<app id>.controls``, at a lower priority);
  - the sink, in a child process too (``sinks.service``: a plain consumer in its own
    group, ``<app id>.sinks``). The children: ``gpuledger.child``.

Before the worker joins its consumer group it creates every topic it reads or writes
and waits until the broker's metadata shows them (a consumer that subscribes to a
topic the broker does not show yet ignores it for the life of the process). After
every rebalance it checks that its agent got its partitions, the route stage that its
consumer got the raw topics' and the controls stage the controls topic's (``assignment_health``); ``/gpuledger/health/`` says
``degraded`` (and names the topic) when one did not.

The worker's sink process owns the embedded store and serves the CLI's read-only
queries (token-protected, recorded beside the data dir: ``sinks.service``). The
worker's loopback web port serves ``/gpuledger/health/`` — the worker's and its
children's state in one page (``degraded`` while a child does not answer); Faust's own pages
(tables, router, graph, stats) are off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from typing import NamedTuple

import faust
from faust.tables import TableManager

from gpuledger import gctune
from gpuledger.child import HealthClient
from gpuledger.dev.process import free_port
from producers._kafka import client_config, ensure_specs
from streams.context import StageContext
from streams.controls.policy import PolicySettings
from streams.correlate.agents import install_correlate_agents
from streams.intake import REVOKE_WAIT_S

log = logging.getLogger(__name__)

#: How long a rebalance waits for the records this worker produced before it to be
#: acknowledged (``_revoked`` in ``create_app``): half the group session timeout (10 s), the
#: bound the stages outside Faust have too (``streams.intake.REVOKE_WAIT_S``).
REVOKE_FLUSH_S = REVOKE_WAIT_S
#: A child process that is running and answered its health fetch within this long is shown by
#: that page (with ``stale_s``) when a fetch goes unanswered: its stage serves the page on the
#: event loop its batches hold, and at a low priority (the controls: niceness 19) on a machine
#: whose cores are all busy a batch can outlast the fetch's 2 s — a stall, not a stage gone.
CHILD_PAGE_GRACE_S = 10.0
_clock = time.monotonic  # (a test drives it)


class WorkerContext(StageContext):
    """What the Faust worker's agents share (``StageContext``: settings, the run's topics, the
    one batched producer, the release directory, the counters), with the Faust app, its
    child processes and the health page that merges theirs."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.subscriptions: dict = {"ok": False, "problems": ["not assigned yet"]}  # the Faust agent's (route topic)
        self.route = None  # gpuledger.child.ChildProcess: the route stage's process (streams.correlate.route)
        self.controls = None  # gpuledger.child.ChildProcess: the controls stage's process (streams.controls.service)
        self.correlator = None
        self.epochs: dict = {}  # agent name -> streams.runner.Epoch
        self.app = None
        self.sink = None  # gpuledger.child.ChildProcess: the sink's process (sinks.service), when this worker runs one
        self.health_client = HealthClient()
        self._last_pages: dict[str, tuple[float, int | None, dict]] = {}  # child -> (when, its pid, its last page)
        self.stop_deadline: float | None = None  # time.monotonic() of the hard stop, once SIGTERM came (``stop_within``)
        self.saving_snapshots = False

    def assigned(self, topic: str) -> set[int]:
        """The partitions of ``topic`` assigned to this worker right now."""
        if self.app is None or self.app.rebalancing:
            return set()
        return {tp.partition for tp in self.app.consumer.assignment() if tp.topic == topic}

    def health(self, pages: dict[str, dict | None] | None = None) -> dict:
        """This worker's state, merged with its children's health pages (``pages``: child
        name -> its page, None when it did not answer; ``children_health``)."""
        pages = pages or {}
        subscriptions = self.assignment_health(pages.get("route"), pages.get("controls"))
        ok = subscriptions["ok"] and self.directory.ready.is_set()
        health = {
            "status": "ok" if ok else "degraded",
            "app_id": self.settings.streams.app_id,  # (whose page this is: `gpuledger status --app-id` checks it)
            "subscriptions": subscriptions,
            "release_directory": self.directory.freshness(),
            "stats": {**self.stats, **({"parked": self.correlator.parked()} if self.correlator else {}),
                      "outputs_produced": dict(self.output.produced), "output_dead_letters": self.output.dead_letters,
                      "changelog_unchanged_skipped": self.correlator.store.unchanged_skipped if self.correlator else 0},
            "counters": {name: c.totals for name, c in self._counters.items()},
            "epochs": {name: epoch.health() for name, epoch in self.epochs.items()},
            "stores": {self.correlator.store.name: self.correlator.store.health()} if self.correlator else {},
            "gc": gctune.stats(),
        }
        for name, child in self.children().items():
            page = pages.get(name)
            health[name] = child.health(page)
            if page is None:
                health["status"] = "degraded"
                continue
            health[name]["gc"] = page.get("gc")
            if "stale_s" in page:  # its last page: this fetch went unanswered (``children_health``)
                health[name]["stale_s"] = page["stale_s"]
            if "store" in page:
                health[name]["store"] = page["store"]
            if "alignment" in page:
                health[name]["alignment"] = page["alignment"]
            if "lag" in page:
                health[name]["lag"] = page["lag"]
            if page.get("problems"):  # a child that answers but is not well (the sink: its store failing)
                health[name]["problems"] = page["problems"]
                health.setdefault("problems", []).extend(f"{name}: {problem}" for problem in page["problems"])
            if page.get("status") not in (None, "ok"):
                health["status"] = "degraded"
            merge_stats(health["stats"], page.get("stats", {}))
            health["counters"].update(page.get("counters", {}))
            health["epochs"].update(page.get("epochs", {}))
            health["stores"].update(page.get("stores", {}))
        if any(epoch.get("waiting_for_state") for epoch in health["epochs"].values()):
            health["status"] = "degraded"  # a stage waits for a state it cannot read (streams.runner)
        return health

    def children(self) -> dict:
        """This worker's child processes (``gpuledger.child.ChildProcess``) by name."""
        return {name: child for name, child in (("route", self.route), ("controls", self.controls), ("sink", self.sink))
                if child is not None}

    def assignment_health(self, route: dict | None = None, controls: dict | None = None) -> dict:
        """The Faust agent's assignment check (after its last rebalance), the route stage's
        (its own group over the raw topics, from its health page ``route``) and the controls
        stage's (its own group over the controls topic, from ``controls``): ``ok`` only when
        all are."""
        out = dict(self.subscriptions)
        # child, its page, the page's field of held partitions, the topics it must hold (and
        # what they are called), the field of this answer that lists them
        for name, child, page, field, topics, what, listed in (
                ("route stage", self.route, route, "raw_assigned", self.catalogue.raw_topics, "raw topics", "raw_partitions"),
                ("controls stage", self.controls, controls, "controls_assigned", (self.run.controls,), "controls topic",
                 "controls_partitions")):
            if child is None:
                continue
            held = None if page is None else page.get(field)
            if page is None:
                got = {"ok": False, "problems": ["not answering"], "partitions": []}
            elif held is None:
                got = {"ok": False, "problems": [f"{what} not assigned yet"], "partitions": []}
            else:
                got = check_assignment([_TP(t, p) for t, p in held], dict.fromkeys(topics))
            out["ok"] = out["ok"] and got["ok"]
            out["problems"] = [*out["problems"], *(f"{name}: {problem}" for problem in got["problems"])]
            out[listed] = got["partitions"]
        out.setdefault("partitions", [])
        return out

    async def children_health(self) -> dict[str, dict | None]:
        """Every child's health page, asked at once. One that did not answer within 2 s is None —
        unless the same process is running and answered within ``CHILD_PAGE_GRACE_S``: then its
        last page, with ``stale_s`` (how old it is)."""
        children = self.children()
        pages = await asyncio.gather(*(self.health_client.fetch(child.url) for child in children.values()))
        now, out = _clock(), {}
        for (name, child), page in zip(children.items(), pages):
            pid = child.process.pid if child.process is not None else None
            if page is not None:
                self._last_pages[name] = (now, pid, page)
            elif name in self._last_pages and child.alive():
                when, answered_pid, last = self._last_pages[name]
                if answered_pid == pid and now - when <= CHILD_PAGE_GRACE_S:
                    page = {**last, "stale_s": round(now - when, 1)}
            out[name] = page
        return out


class _TP(NamedTuple):
    topic: str
    partition: int


def merge_stats(into: dict, more: dict) -> None:
    """A child's stats into the worker's: a number both count is summed (dead letters),
    a per-topic count too (records produced)."""
    for key, value in more.items():
        mine = into.get(key)
        if isinstance(mine, dict) and isinstance(value, dict):
            into[key] = {k: mine.get(k, 0) + value.get(k, 0) for k in {*mine, *value}}
        elif isinstance(mine, (int, float)) and isinstance(value, (int, float)) and not isinstance(mine, bool):
            into[key] = mine + value
        else:
            into[key] = value


def ensure_run_topics(settings) -> None:
    """Create the catalogue's and the run's topics (idempotent) and wait until visible."""
    cat = settings.kafka.catalogue()
    ensure_specs(client_config(settings), cat.specs() + cat.run(settings.streams.app_id).specs(), cat.replication_factor)


def create_app(settings) -> faust.App:
    """Build the Faust app from settings (the sink runs beside it: ``run_worker``)."""
    ctx = WorkerContext(settings)
    cat, run = ctx.catalogue, ctx.run
    conf = settings.streams
    web_port = conf.web_port or free_port()
    app = faust.App(
        conf.app_id,
        # Faust's aiokafka transport with a 100 ms fetch wait instead of its fixed 1.5 s
        # (streams/transport.py: live records waited for it on the internal hops).
        broker=f"gpuledger://{ctx.bootstrap}",
        broker_credentials=settings.kafka.faust_credentials(),
        store="memory://",
        TableManager=NoTablesManager,
        datadir=str(settings.data_dir / "streams"),
        web_enabled=True,
        web_bind="127.0.0.1",
        web_host="127.0.0.1",
        web_port=web_port,
        # Faust's own pages would show internal state to anyone on the host; ours need none of them.
        web_tables_enabled=False,
        web_router_enabled=False,
        web_graph_enabled=False,
        web_stats_enabled=False,
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

    route = topic(run.route, partitions=run.partitions)
    install_correlate_agents(app, ctx, route)
    # The controls stage runs in a process of its own (streams.controls.service); a bad
    # policy stops the worker here, before anything is consumed, all the same.
    app.gpuledger_policy = PolicySettings().load()
    expected = {run.route: cat.raw_partitions}

    @app.on_rebalance_complete.connect
    async def _check_subscriptions(sender, **kwargs):
        ctx.subscriptions = check_assignment(app.consumer.assignment(), expected)
        if not ctx.subscriptions["ok"]:
            log.error("after the rebalance some agents have no partitions: %s", "; ".join(ctx.subscriptions["problems"]))
        # Recover the assigned partitions' state now, while the release directory loads and
        # the route stage starts, rather than when the first batch needs it (a restart's
        # first batch waited for both, one after the other).
        ctx.correlator.store.prefetch({tp.partition for tp in app.consumer.assignment() if tp.topic == run.route})

    async def _settled_then_flushed() -> None:
        for epoch in ctx.epochs.values():
            await epoch.settle()  # an epoch's tail still to write its changelog writes it now
        await ctx.output.flush()

    @app.on_partitions_revoked.connect
    async def _revoked(sender, revoked, **kwargs):
        # Faust has waited for the handed-out events to be acked (each ack follows an epoch
        # commit, flushed) — unless that wait timed out, with a commit's changelog records
        # still queued. They are acknowledged before the partitions go: landing after their
        # next owner (or this worker, given them back) read the changelog, they would be
        # missing from the layout it loaded (``Correlator.reset`` says what that costs).
        try:
            await asyncio.wait_for(_settled_then_flushed(), REVOKE_FLUSH_S)
        except asyncio.TimeoutError:
            log.warning("rebalance: records produced before it still not acknowledged after %.0fs; giving the partitions up",
                        REVOKE_FLUSH_S)
        for epoch in ctx.epochs.values():
            epoch.forget((tp.topic, tp.partition) for tp in revoked)
        ctx.correlator.forget({tp.partition for tp in revoked if tp.topic == run.route})

    @app.page("/gpuledger/health/")
    class HealthView(faust.web.View):
        async def get(self, request):
            return self.json(ctx.health(await ctx.children_health()))

    @app.timer(max(0.05, conf.commit_interval_s / 2))
    async def _commit_idle_epochs():
        """Commit an epoch whose input stopped before it was due (``streams.runner``) — and
        every epoch at once while a rebalance is under way: before Faust gives partitions up
        it waits until every message it handed out is acked (``stream_wait_empty``), and
        only a commit acks an epoch's messages (skipping commits then held every rebalance
        until Faust's wait gave up). The revoked partitions' state is durable afterwards,
        so their next owner recovers it instead of re-processing the epoch."""
        for epoch in ctx.epochs.values():
            if app.rebalancing:
                await epoch.commit_now()
            else:
                await epoch.commit_if_due()

    @app.timer(1.0)
    async def _supervise_children():
        for child in ctx.children().values():
            child.restart_if_dead()

    app.gpuledger_web_url = f"http://127.0.0.1:{web_port}"
    return app


class NoTablesManager(TableManager):
    """Faust's table manager, started without its one-second pause: ``TableManager.on_start``
    sleeps a second so that tables can register before recovery starts, and the consumer
    subscribes only after that. This app has no Faust tables (its state is in
    ``PartitionStore``s), so every start and restart waited that second for nothing.
    Faust's documented extension point (the ``TableManager`` setting)."""

    logger = logging.getLogger(f"{TableManager.__module__}.gpuledger")  # lifecycle lines: Faust's (a library's INFO; streams.transport)

    async def on_start(self) -> None:
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()


def check_assignment(assignment, expected: dict) -> dict:
    """Every co-partitioned topic in ``expected`` (its keys) has the same partitions
    assigned as the first one, and that at least one (one worker: all of them)."""
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


STOP_WITHIN_S = 8.0


def stop_within(app: faust.App, worker, children) -> None:
    """On SIGTERM, tell the child processes (route stage, sink) to stop and stop as Faust
    does — and if that has not finished within ``STOP_WITHIN_S`` (a broker outage can hold Faust's shutdown for
    minutes), exit 0 at once. That is safe at any instant: a batch is acked only after its
    outputs and state are acknowledged, so an unfinished batch is simply processed again
    after a restart; the sink commits only what it stored."""

    def hard_stop() -> None:
        if app.gpuledger.saving_snapshots:
            log.warning("stop did not finish within %.0fs; exiting now, while writing state snapshots (every batch was acked; the next "
                        "start reads the changelog after each partition's last complete snapshot)", STOP_WITHIN_S)
        else:
            log.warning("stop did not finish within %.0fs; exiting now (unfinished batches were not acked)", STOP_WITHIN_S)
        for child in children:  # told to stop at SIGTERM, STOP_WITHIN_S ago
            child.stop(within_s=0.5)
        logging.shutdown()
        os._exit(0)

    commits: list[asyncio.Future] = []  # referenced until done

    @app.task
    async def _watch_sigterm():
        loop = asyncio.get_running_loop()
        original = worker._on_sigterm

        def on_sigterm() -> None:
            app.gpuledger.stop_deadline = time.monotonic() + STOP_WITHIN_S
            timer = threading.Timer(STOP_WITHIN_S, hard_stop)
            timer.daemon = True
            timer.start()
            for child in children:
                child.signal_stop()  # each stops (its batch routed or stored, and committed) while Faust does
            # Faust's stop first waits until every message it handed out is acked, and its
            # timers (ours included) have stopped by then: the epochs commit here, beside it,
            # until the loop closes (a batch Faust had already buffered still arrives).
            # Without this every clean stop ran into the hard stop above.
            commits.append(asyncio.ensure_future(commit_epochs_while_stopping(app.gpuledger)))
            original()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)


STOP_COMMIT_EVERY_S = 0.1


async def commit_epochs_while_stopping(ctx: WorkerContext) -> None:
    """Commit every agent's epoch (outputs, then state, then the acks) now and every
    ``STOP_COMMIT_EVERY_S`` until the worker's loop closes (a stop; cancelled then)."""
    while True:
        for name, epoch in ctx.epochs.items():
            try:
                await epoch.commit_now()
            except Exception:  # noqa: BLE001 - the stop goes on; the epoch is simply not acked
                log.exception("%s: the epoch could not be committed at stop; it is processed again after a restart", name)
                return
        await asyncio.sleep(STOP_COMMIT_EVERY_S)


def prepare_data_dir(settings) -> None:
    """Create the worker's data dir with its parents (Faust creates only its own last
    directory, and a missing parent ended the worker with a traceback); one that cannot be
    created is a ``SettingsError`` naming it."""
    from gpuledger.settings import SettingsError

    where = settings.data_dir / "streams"
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingsError(f"cannot create the worker's data dir {where} (data_dir, GPULEDGER_DATA_DIR): "
                            f"{exc.strerror or exc}") from exc


def run_worker(settings, loglevel: str = "info") -> None:
    """Run the worker in this process, and its route stage and sink in child processes,
    until SIGTERM/SIGINT.

    The sink connects to the store lazily: the worker starts while ClickHouse is down,
    and the sink holds its offsets until it is back (migrations run on the first connect).
    """
    from gpuledger.telemetry import calm_logging
    from sinks.service import sink_process
    from streams.controls.service import controls_process
    from streams.correlate.route import route_process

    calm_logging()
    gctune.tune(gctune.GEN0_STATEFUL)  # the correlation stage freezes what each epoch commit leaves alive
    prepare_data_dir(settings)
    ensure_run_topics(settings)
    app = create_app(settings)
    ctx = app.gpuledger
    ctx.route = route_process(settings, loglevel)
    ctx.controls = controls_process(settings, loglevel)
    ctx.sink = sink_process(settings, app.gpuledger_web_url, loglevel)
    children = list(ctx.children().values())
    for child in children:
        child.start()
    from sinks.clickhouse import redact

    log.info("worker %s starting: health at %s, Kafka at %s, store %s", settings.streams.app_id, app.gpuledger_web_url,
             ctx.bootstrap, redact(settings.clickhouse_dsn))
    profile = os.environ.get("GPULEDGER_PROFILE")  # benchmarks --profile
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False, override_logging=False)
        # No start-up spinner: Faust's writes a backspace and "show cursor" (ESC[?25h) to stdout when
        # it ends even where stdout is not a terminal, and they opened a line of the worker's log.
        worker.spinner = None
        stop_within(app, worker, children)
        worker.execute_from_commandline()
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)
        left = ctx.output.close()
        if left:
            log.warning("%d output record(s) were not acknowledged at exit (their batches were not acked either)", left)
        elif ctx.correlator is not None and ctx.correlator.store.parts:
            # Faust leaves its group on the way out without revoking anything: the store still
            # holds every partition, its last epoch committed (``commit_epochs_while_stopping``;
            # a state changed after it is not snapshotted: ``save_snapshots``). Within the stop's
            # bound: no partition is begun in its last second (the hard stop ends a save cut short).
            ctx.saving_snapshots = True
            try:
                ctx.correlator.store.save_snapshots(deadline=ctx.stop_deadline - 1.0 if ctx.stop_deadline else None)
            finally:
                ctx.saving_snapshots = False
        for child in children:
            child.signal_stop()  # both stop at once, then each is waited for
        for child in children:
            child.stop()
        log.info("worker %s stopped", settings.streams.app_id)

