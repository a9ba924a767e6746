"""Faust's own ceiling: the least a Faust worker can do with gpuledger's raw topics.

    python benchmarks/passthrough.py --bootstrap HOST:PORT --topics a,b,c --output OUT \
        --app-id ID --datadir DIR --progress FILE

Input: the given topics, from the beginning (a fresh app id = a fresh consumer group).
Output: every record, decoded with orjson and encoded again, produced to ``--output``
with the record's key through librdkafka (linger 10 ms, lz4, acks=all, idempotent) and
flushed before the batch returns — the shape of the worker's batch path
(``take_events(1000, within=0.2)``, the same broker settings as streams/app.py) without
any of its work. After each batch, ``--progress`` is replaced atomically with
``{"events", "batches", "first_batch_events", "first_batch_done", "last_batch_done"}``
(``time.monotonic()`` seconds, comparable across processes on one machine), so the
bench reads a rate from the first processed batch to the last without a web page.
Runs until SIGTERM. A child process of ``benchmarks/bench.py``, not part of gpuledger;
its producer is written out here (not streams/output.py) so the baseline does not
move when the engine changes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path

import faust
import orjson
from confluent_kafka import Producer

BATCH = 1000
WITHIN_S = 0.2


def build_app(args) -> faust.App:
    app = faust.App(
        args.app_id,
        broker=f"kafka://{args.bootstrap}",
        store="memory://",
        datadir=args.datadir,
        web_enabled=False,
        topic_partitions=args.partitions,
        topic_replication_factor=1,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        producer_linger=0.02,
        producer_max_batch_size=512 * 1024,
        producer_compression_type="lz4",
        broker_commit_every=1000,
        broker_session_timeout=20.0,
        broker_heartbeat_interval=3.0,
        broker_commit_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
    )
    source = app.topic(*args.topics.split(","), key_serializer="raw", value_serializer="raw")
    producer = Producer({
        "bootstrap.servers": args.bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 10,
        "compression.type": "lz4",
        "partitioner": "murmur2_random",
        "queue.buffering.max.messages": 1_000_000,
        "client.id": f"bench-{args.app_id}",
        "logger": logging.getLogger("librdkafka"),
    })
    progress = Path(args.progress)
    state = {"events": 0, "batches": 0, "first_batch_events": 0, "first_batch_done": None, "last_batch_done": None}
    failed: list = []

    def on_delivery(err, _msg):
        if err is not None:
            failed.append(err)

    def produce(key, value: bytes) -> None:
        while True:
            try:
                producer.produce(args.output, key=key, value=value, on_delivery=on_delivery)
                return
            except BufferError:
                producer.poll(0.05)

    async def flush() -> None:
        while await asyncio.to_thread(producer.flush, 10):
            logging.warning("pass-through: records not acknowledged yet; waiting")
        if failed:
            # A baseline that silently lost records would flatter itself: stop loudly.
            raise RuntimeError(f"{len(failed)} record(s) not delivered to {args.output}: {failed[0]}")

    @app.agent(source, name="pass_through")
    async def pass_through(stream):
        async for events in stream.take_events(BATCH, within=WITHIN_S):
            for ev in events:
                msg = ev.message
                produce(msg.key, orjson.dumps(orjson.loads(msg.value)))
            await flush()
            now = time.monotonic()
            state["events"] += len(events)
            state["batches"] += 1
            if state["first_batch_done"] is None:
                state["first_batch_done"], state["first_batch_events"] = now, len(events)
            state["last_batch_done"] = now
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, progress)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description="Faust pass-through baseline (a child of benchmarks/bench.py)")
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topics", required=True, help="comma-separated input topics")
    ap.add_argument("--output", required=True, help="output topic (must exist)")
    ap.add_argument("--app-id", required=True)
    ap.add_argument("--datadir", required=True)
    ap.add_argument("--progress", required=True, help="JSON progress file, replaced after every batch")
    ap.add_argument("--partitions", type=int, default=4)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = build_app(args)
    worker = faust.Worker(app, loglevel="warning", quiet=True, redirect_stdouts=False, override_logging=False)
    worker.execute_from_commandline()


if __name__ == "__main__":
    main()
