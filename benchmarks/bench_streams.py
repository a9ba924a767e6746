"""Benchmark: input events/s through ONE worker (route + correlate + sinks into chDB).

    .venv/bin/python benchmarks/bench_streams.py --events 200000 [--profile out.prof]

Publishes a realistic mix (releases, pods with scheduler transitions, GPU assignments,
alerts on pods and on node/GPUs) to fresh topics *before* starting the worker, then
starts one worker and measures from its first correlated batch until every input was
correlated (worker health stats), and until the last row is queryable in ClickHouse.
Not a test: numbers depend on the machine; run it on the 2-core target.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuledger.localkafka import LocalKafka  # noqa: E402
from gpuledger.process import ServiceProcess, wait_for_worker  # noqa: E402
from gpuledger.settings import default_cache_dir  # noqa: E402
from producers._kafka import EventPublisher, ensure_topics  # noqa: E402
from schemas import AlertEvent, GpuEvent, Identity, ReleaseEvent, SchedulerEvent, Source, make_event_id  # noqa: E402
from schemas.alert import AlertPayload  # noqa: E402
from schemas.gpu import GpuPayload  # noqa: E402
from schemas.release import ReleasePayload  # noqa: E402
from schemas.scheduler import SchedulerPayload  # noqa: E402
from schemas.topics import TopicCatalogue  # noqa: E402
from sinks.query import RemoteReader, owner_file  # noqa: E402

SRC = Source(collector="bench")


def events(n: int):
    t0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
    releases = 50
    for r in range(releases):
        at = t0 + timedelta(seconds=r)
        yield ReleaseEvent(event_id=make_event_id("b", (r, "reg")), event_type="release.registered", occurred_at=at, observed_at=at,
                           source=SRC, identity=Identity(release_id=f"rel-{r}", model_name=f"m{r % 10}", model_version=str(r),
                                                         image_digest=f"sha256:{r:064x}", owner=f"team-{r % 5}", environment="prod"),
                           payload=ReleasePayload(actor="ci"))
    i = 0
    while i < n - releases:
        p = i // 4
        ns, pod, node, gpu = "ml", f"pod-{p}", f"n{p % 64}", f"GPU-{p % 512:08d}"
        at = t0 + timedelta(seconds=100 + p)
        kind = i % 4
        if kind == 0:
            yield SchedulerEvent(event_id=make_event_id("b", (p, "sched")), event_type="scheduler.scheduled", occurred_at=at, observed_at=at,
                                 source=SRC, identity=Identity(namespace=ns, pod=pod, workload_id=f"ml/Job/j{p // 8}", node=node,
                                                               release_id=f"rel-{p % 50}" if p % 3 else None),
                                 payload=SchedulerPayload(object_kind="Pod", image_digests=(f"sha256:{p % 50:064x}",)))
        elif kind == 1:
            yield GpuEvent(event_id=make_event_id("b", (p, "gpu")), event_type="gpu.assigned", occurred_at=at, observed_at=at, source=SRC,
                           identity=Identity(namespace=ns, pod=pod, node=node, gpu_id=gpu),
                           payload=GpuPayload(node=node, namespace=ns, pod=pod, container="main", device_id=gpu, gpu=gpu))
        elif kind == 2:
            yield AlertEvent(event_id=make_event_id("b", (p, "alert")), event_type="alert.firing", occurred_at=at, observed_at=at, source=SRC,
                             identity=Identity(alert_fingerprint=f"fp{p}", namespace=ns, pod=pod),
                             payload=AlertPayload(alertname="Quality", starts_at=at))
        else:
            yield AlertEvent(event_id=make_event_id("b", (p, "xid")), event_type="alert.firing", occurred_at=at + timedelta(seconds=1),
                             observed_at=at, source=SRC, identity=Identity(alert_fingerprint=f"x{p}", node=node, gpu_id=gpu),
                             payload=AlertPayload(alertname="XID", starts_at=at + timedelta(seconds=1)))
        i += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--bootstrap")
    ap.add_argument("--profile", help="write a cProfile of the worker here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuledger-bench-"))
    broker = None if args.bootstrap else LocalKafka(work / "kafka", default_cache_dir(), log_level="WARN").start()
    bootstrap = args.bootstrap or broker.bootstrap
    cat = TopicCatalogue(prefix=f"bench{uuid.uuid4().hex[:6]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": bootstrap}, cat)
    pub = EventPublisher({"bootstrap.servers": bootstrap}, cat, "bench")
    t = time.monotonic()
    batch = []
    for ev in events(args.events):
        batch.append(ev)
        if len(batch) == 5000:
            pub.publish_batch(batch)
            batch = []
    pub.publish_batch(batch)
    print(f"published {args.events} events in {time.monotonic() - t:.1f}s")
    dsn = f"chdb://{work / 'clickhouse'}"
    env = {"GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": cat.prefix, "GPULEDGER_DATA_DIR": str(work),
           "GPULEDGER_CLICKHOUSE_DSN": dsn, "GPULEDGER_STREAMS_APP_ID": f"{cat.prefix}-app", "GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "3"}
    if args.profile:
        env["GPULEDGER_PROFILE"] = args.profile
    worker = ServiceProcess(["worker"], env, work / "worker.log").start()
    try:
        url = wait_for_worker(worker, owner_file(dsn), timeout=120)
        first = None
        while True:
            stats = json.loads(urllib.request.urlopen(f"{url}/gpuledger/health/").read())["stats"]
            now = time.monotonic()
            if stats["correlated_in"] and first is None:
                first = now
            if stats["correlated_in"] >= args.events:
                break
            time.sleep(0.2)
        done = time.monotonic()
        reader = RemoteReader(url)
        while reader.query("SELECT count() AS n FROM gpuledger.correlated_events").dicts()[0]["n"] < args.events * 0.99:
            time.sleep(0.2)
        stored = time.monotonic()
        print(f"correlated {args.events} events in {done - first:.1f}s -> {args.events / (done - first):,.0f} events/s (one worker)")
        print(f"stored (>=99% rows queryable) {stored - first:.1f}s after the first batch")
        print(f"topic prefix {cat.prefix} (records per topic: python /tmp/offsets.py {bootstrap} {cat.prefix})")
    finally:
        worker.stop(grace=30)
        if broker:
            broker.stop()


if __name__ == "__main__":
    main()
