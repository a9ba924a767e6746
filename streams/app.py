"""The one Faust app: correlate raw events, and sink the results into ClickHouse.

Input: the four raw topics (scheduler, gpu, release, alert), co-partitioned and keyed
by the shared correlation key. Output: the correlated topic (one row per input,
superseded by higher versions when attribution improves), enriched alerts, dead
letters, and — through the sink agents — the ClickHouse tables.

Agents:
  - ``correlate_events`` reads every raw topic through one channel, in batches
    (``take_events``), folds each event into the ``releases`` table (changelog-backed,
    recovered on restart) and emits the correlated rows the change produced.
  - ``store_correlated`` / ``store_dead_letters`` insert their topics into ClickHouse
    in batches by size and time; offsets are acked only after the insert (see
    sinks/correlated.py), so a crash re-delivers into idempotent tables.
Poison records (not JSON, wrong types, unknown event types) go to the dead-letter
topic with the reason and their topic/partition/offset; the agent keeps going.

The worker process owns the embedded store; it serves read-only queries for the CLI
on its loopback web port (``/gpuledger/query/``), recorded beside the data dir.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from datetime import datetime, timezone

import faust
from faust.streams import _current_event

from gpuledger.localkafka import free_port
from producers._kafka import resolve_bootstrap
from schemas import CorrelatedEvent, DeadLetter, EventDecodeError, decode_event, encode_event
from sinks.query import QueryError, run_readonly
from streams.correlate import Input, correlate_attached, correlate_unattached, new_state

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
        table_standby_replicas=0,
        broker_commit_every=1000,
        broker_commit_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
    )
    raw = app.topic(*cat.raw_topics, key_serializer="raw", value_serializer="raw")
    correlated = app.topic(cat.correlated, key_serializer="raw", value_serializer="raw")
    enriched = app.topic(cat.enriched_alerts, key_serializer="raw", value_serializer="raw")
    dead = app.topic(cat.deadletter, key_serializer="raw", value_serializer="raw")
    allocations = app.topic(cat.allocations, key_serializer="raw", value_serializer="raw")
    releases = app.Table("releases", default=None, partitions=cat.raw_partitions,
                         schema=faust.Schema(key_type=bytes, value_type=dict, key_serializer="raw", value_serializer="json"))
    app.gpuledger_stats = {"correlated_in": 0, "correlated_out": 0, "dead_letters": 0, "stored": 0}

    async def send_dead(letter: DeadLetter, key) -> None:
        app.gpuledger_stats["dead_letters"] += 1
        await dead.send(key=key, value=encode_event(letter))

    @app.agent(raw, name="correlate_events")
    async def correlate_events(stream):
        async for events in stream.take_events(CORRELATE_BATCH, within=CORRELATE_WITHIN_S):
            outputs: list[CorrelatedEvent] = []
            touched: dict[str, tuple[dict, object]] = {}
            for ev in events:
                msg = ev.message
                try:
                    event = decode_event(msg.value)
                    inp = Input(event, msg.topic, msg.partition, msg.offset)
                    rid = event.identity.release_id
                    if rid:
                        state = touched[rid][0] if rid in touched else (releases.get(rid.encode()) or new_state(rid))
                        outputs.extend(correlate_attached(state, inp))
                        touched[rid] = (state, ev)
                    else:
                        outputs.append(correlate_unattached(inp))
                except EventDecodeError as exc:
                    await send_dead(dead_letter(exc.reason, str(exc), "streams.correlate_events", msg), msg.key)
                except Exception as exc:  # noqa: BLE001 - a poison record must not stop the agent
                    log.exception("correlate_events failed on %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                    await send_dead(dead_letter("processing_error", f"{type(exc).__name__}: {exc}", "streams.correlate_events", msg), msg.key)
            for rid, (state, ev) in touched.items():
                _as_current(ev)
                releases[rid.encode()] = state
            for row in outputs:
                key = (row.identity.release_id or row.correlation_id).encode()
                value = encode_event(row)
                await correlated.send(key=key, value=value)
                if row.event_type.startswith("alert."):
                    await enriched.send(key=(row.identity.alert_fingerprint or row.correlation_id).encode(), value=value)
            app.gpuledger_stats["correlated_in"] += len(events)
            app.gpuledger_stats["correlated_out"] += len(outputs)
            log.info("correlated %d event(s) into %d row(s)", len(events), len(outputs))

    if store_client is not None:
        from sinks.agents import install_sink_agents

        install_sink_agents(app, settings, store_client, {"correlated": correlated, "deadletter": dead, "allocations": allocations,
                                                          "raw": raw}, send_dead)
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
    try:
        worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False, override_logging=False)
        worker.execute_from_commandline()
    finally:
        if dsn.startswith("chdb:"):
            clear_owner(dsn)
