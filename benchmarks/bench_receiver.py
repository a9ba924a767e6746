"""The receiver under load, on loopback: throughput, latency, and 503s during a broker outage.

    .venv/bin/python benchmarks/bench_receiver.py [--seconds 20] [--concurrency 64] [--json out.json]

Starts a local broker (or uses ``--bootstrap``) and ``gpuledger receive --port 0`` as a child
process, then:

1. **load** — a bounded load generator (aiohttp client, ``--concurrency`` requests in flight,
   for ``--seconds``) POSTs single-alert Alertmanager webhook bodies (each a new fingerprint)
   to ``/v1/alertmanager``; reports requests/s, p50/p99/max latency and the status counts,
   and checks that ``/healthz`` ``sent`` matches the 200s.
2. **outage** (own broker only) — the broker is stopped, ``--outage-requests`` requests are
   sent at once; every one must be answered 503 within the publish timeout (Kafka delivery
   timeout + 5 s; ``--delivery-timeout``), reported as the slowest answer.

Targets (issue 16): ≥ 2,000 requests/s and p99 < 50 ms on the 2-core target; 503s within
the publish timeout. Not a test: the numbers depend on the machine and what else runs.
Every process and broker started here is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuledger.dev.localkafka import LocalKafka  # noqa: E402
from gpuledger.dev.process import ServiceProcess  # noqa: E402
from gpuledger.settings import default_cache_dir  # noqa: E402
from producers._kafka import ensure_topics  # noqa: E402
from schemas.topics import TopicCatalogue  # noqa: E402


def alert_body(i: int) -> bytes:
    fingerprint = f"{uuid.uuid4().hex[:16]}"
    return json.dumps({
        "version": "4", "status": "firing", "receiver": "gpuledger", "groupKey": f"{{}}:{{alertname=\"GpuXid\", n=\"{i}\"}}",
        "truncatedAlerts": 0, "groupLabels": {"alertname": "GpuXid"}, "commonLabels": {}, "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": [{"status": "firing", "fingerprint": fingerprint, "startsAt": "2026-12-01T07:55:20.152056325Z",
                    "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus:9090/graph",
                    "labels": {"alertname": "GpuXid", "severity": "critical", "Hostname": "gpu-node-a3",
                               "UUID": "GPU-8f3c2b1a-6d4e-4f0a-9b7c-2e1d0c9b8a76", "exported_namespace": "llm-train",
                               "exported_pod": f"worker-{i % 50}"},
                    "annotations": {"summary": "XID 79 on gpu-node-a3"}}],
    }).encode()


def start_receiver(bootstrap: str, prefix: str, partitions: int, workdir: Path, delivery_timeout: float) -> tuple[ServiceProcess, str]:
    log = workdir / "receiver.log"
    service = ServiceProcess(["receive", "--port", "0"], {
        "GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": prefix, "GPULEDGER_KAFKA_RAW_PARTITIONS": str(partitions),
        "GPULEDGER_KAFKA_DELIVERY_TIMEOUT_S": str(delivery_timeout), "GPULEDGER_DATA_DIR": str(workdir / "data"),
    }, log).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://[0-9.]+:\d+)", log.read_text(errors="replace") if log.exists() else "")
        if found:
            return service, found.group(1)
        if not service.alive():
            raise SystemExit(f"receiver died:\n{service.log_tail()}")
        time.sleep(0.1)
    service.stop()
    raise SystemExit("receiver did not print its address within 60s")


async def load(url: str, seconds: float, concurrency: int) -> dict:
    bodies = [alert_body(i) for i in range(2000)]
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    stop_at = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"}) as session:
        async def worker(n: int) -> None:
            i = n
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                async with session.post(f"{url}/v1/alertmanager", data=bodies[i % len(bodies)]) as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - started)
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
                i += concurrency

        started = time.monotonic()
        await asyncio.gather(*(worker(n) for n in range(concurrency)))
        elapsed = time.monotonic() - started
        async with session.get(f"{url}/healthz") as resp:
            health = await resp.json()
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    return {"requests": len(latencies), "seconds": round(elapsed, 2), "requests_per_s": round(len(latencies) / elapsed, 1),
            "p50_ms": round(q[49] * 1000, 1), "p99_ms": round(q[98] * 1000, 1), "max_ms": round(latencies[-1] * 1000, 1),
            "statuses": statuses, "healthz_sent": health["counters"]["alertmanager"]["sent"]}


async def outage(url: str, requests: int) -> dict:
    async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(i: int) -> tuple[int, float]:
            started = time.perf_counter()
            async with session.post(f"{url}/v1/alertmanager", data=alert_body(i)) as resp:
                await resp.read()
                return resp.status, time.perf_counter() - started

        answers = await asyncio.gather(*(one(i) for i in range(requests)))
    statuses: dict[int, int] = {}
    for status, _ in answers:
        statuses[status] = statuses.get(status, 0) + 1
    return {"requests": requests, "statuses": statuses, "slowest_s": round(max(t for _, t in answers), 2),
            "fastest_s": round(min(t for _, t in answers), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="Length of the load phase.")
    parser.add_argument("--concurrency", type=int, default=64, help="Requests in flight (the bound of the load generator).")
    parser.add_argument("--bootstrap", help="Use this broker instead of starting one (the outage phase is skipped).")
    parser.add_argument("--delivery-timeout", type=float, default=5.0, help="GPULEDGER_KAFKA_DELIVERY_TIMEOUT_S of the receiver.")
    parser.add_argument("--outage-requests", type=int, default=200, help="Requests sent at once while the broker is down (0 = skip).")
    parser.add_argument("--json", type=Path, help="Write the numbers here too.")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-receiver-"))
    broker = None if args.bootstrap else LocalKafka(workdir / "kafka", default_cache_dir(), log_level="WARN").start()
    bootstrap = args.bootstrap or broker.bootstrap
    catalogue = TopicCatalogue(prefix=f"bench{uuid.uuid4().hex[:8]}", raw_partitions=2)
    receiver = None
    try:
        ensure_topics({"bootstrap.servers": bootstrap}, catalogue)
        receiver, url = start_receiver(bootstrap, catalogue.prefix, 2, workdir, args.delivery_timeout)
        asyncio.run(load(url, 2, 8))  # warm-up: the producer learns the topics' record limit
        results = {"load": asyncio.run(load(url, args.seconds, args.concurrency)), "concurrency": args.concurrency}
        if broker is not None and args.outage_requests:
            broker.stop()
            broker = None
            results["outage"] = asyncio.run(outage(url, args.outage_requests))
            results["outage"]["publish_timeout_s"] = args.delivery_timeout + 5
        print(json.dumps(results, indent=2))
        load_ok = results["load"]["requests_per_s"] >= 2000 and results["load"]["p99_ms"] < 50
        print(f"target ≥ 2000 req/s and p99 < 50 ms: {'met' if load_ok else 'NOT met'}")
        if "outage" in results:
            o = results["outage"]
            ok = o["statuses"].get(503, 0) == o["requests"] and o["slowest_s"] <= o["publish_timeout_s"] + 1
            print(f"outage: every request 503 within the {o['publish_timeout_s']:g}s publish timeout: {'met' if ok else 'NOT met'}")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 0
    finally:
        if receiver is not None:
            receiver.stop(grace=20)
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    sys.exit(main())
