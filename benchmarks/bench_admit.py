"""gpuledger admit under load: p99 decision latency at a fixed request rate (issue 14: < 5 ms at 500 req/s).

    .venv/bin/python benchmarks/bench_admit.py [--rate 500] [--seconds 20] [--releases 2000] [--json out.json]

Starts a local broker (or uses ``--bootstrap``), publishes ``--releases`` releases to the
release topic (registered + evaluated; every other one approved for prod; a few revoked),
starts ``gpuledger admit --port 0`` as a child process (generated certificate, CA written
for the client), waits for ``/readyz``, then:

1. **decide** — the pure decision (``streams.controls.admission.decide``) in this process,
   on the same release history, for every kind of answer: p50/p99 per call.
2. **webhook** — an open-loop load generator: one AdmissionReview (a GPU Job of a random
   release) every 1/``--rate`` s for ``--seconds``, over HTTPS with keep-alive
   (aiohttp, 16 connections), whatever the previous answers' latency (so a slow answer
   does not slow the offered rate). Reports the achieved rate, p50/p99/max of the round
   trip (the API server's view of our latency, minus its network), allow/deny counts,
   and ``/healthz``: the server's own decision latency (body read to answer encoded, the
   last 10,000 reviews), every review decided, none dropped on the way to Kafka.

Not a test: the numbers depend on the machine and what else runs on it. Every process and
broker started here is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import ssl
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuledger.dev.localkafka import LocalKafka  # noqa: E402
from gpuledger.dev.process import ServiceProcess  # noqa: E402
from gpuledger.settings import default_cache_dir  # noqa: E402
from producers._config import GPU_RESOURCES, ResourceMatcher  # noqa: E402
from producers._kafka import EventPublisher, ensure_topics  # noqa: E402
from producers.releases import COMMANDS, build_event  # noqa: E402
from schemas.topics import TopicCatalogue  # noqa: E402
from streams.controls.admission import AdmissionState, decide, subject_of  # noqa: E402
from streams.controls.policy import Policy  # noqa: E402

COMMAND = {c.name: c for c in COMMANDS}


def release_events(n: int) -> list:
    events = []
    for i in range(n):
        rid = f"model-{i}-v1-prod"
        events.append(build_event(COMMAND["register"], {"release_id": rid, "model": f"model-{i}", "version": "1",
                                                         "artifact_digest": "sha256:" + f"{i:064x}"}))
        events.append(build_event(COMMAND["evaluate"], {"release_id": rid}))
        if i % 2 == 0:
            events.append(build_event(COMMAND["approve"], {"release_id": rid, "actor": "alice", "env": "prod"}))
        if i % 50 == 0:
            events.append(build_event(COMMAND["revoke"], {"release_id": rid, "reason": "bench"}))
    return events


def job(rid: str, n: int) -> dict:
    labels = {"gpuledger.io/release-id": rid, "gpuledger.io/environment": "prod"}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"job-{n}", "namespace": "serving", "uid": str(uuid.uuid4()), "labels": labels},
            "spec": {"parallelism": 2, "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                {"name": "main", "image": "registry.example/serve@sha256:" + "ab" * 32,
                 "resources": {"requests": {"cpu": "4", "nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}}]}}}}


def review(obj: dict) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "batch", "version": "v1", "kind": "Job"},
        "resource": {"group": "batch", "version": "v1", "resource": "jobs"}, "operation": "CREATE", "namespace": "serving",
        "userInfo": {"username": "ci"}, "object": obj}}).encode()


def pct(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=1000)[int(q * 1000) - 1], 3) if len(values) > 1 else (values[0] if values else 0.0)


def bench_decide(events: list, releases: int, calls: int = 20_000) -> dict:
    state = AdmissionState()
    for e in events:
        state.apply(e)
    state.ready.set()
    policy, resources = Policy(), ResourceMatcher(GPU_RESOURCES)
    version = policy.fingerprint
    subjects = [subject_of(job(f"model-{random.randrange(releases)}-v1-prod", i), resources) for i in range(1000)]
    times, rules = [], {}
    now = datetime.now(timezone.utc)
    for i in range(calls):
        s = subjects[i % len(subjects)]
        t = time.perf_counter()
        d = decide(s, state, policy, now, policy_version=version)
        times.append((time.perf_counter() - t) * 1000)
        rules[d.rule] = rules.get(d.rule, 0) + 1
    return {"calls": calls, "p50_ms": pct(times, 0.5), "p99_ms": pct(times, 0.99), "max_ms": round(max(times), 3), "rules": rules}


def start_admit(bootstrap: str, prefix: str, workdir: Path) -> tuple[ServiceProcess, str, Path]:
    log, ca = workdir / "admit.log", workdir / "ca.crt"
    service = ServiceProcess(["admit", "--port", "0", "--ca-out", str(ca)], {
        "GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": prefix, "GPULEDGER_KAFKA_RAW_PARTITIONS": "2",
        "GPULEDGER_DATA_DIR": str(workdir / "data")}, log).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"listening on (https://[0-9.]+:\d+)", log.read_text(errors="replace") if log.exists() else "")
        if found:
            return service, found.group(1), ca
        if not service.alive():
            raise SystemExit(f"gpuledger admit died:\n{service.log_tail()}")
        time.sleep(0.1)
    service.stop()
    raise SystemExit("gpuledger admit did not print its address within 60s")


async def load(url: str, ca: Path, rate: float, seconds: float, releases: int) -> dict:
    context = ssl.create_default_context(cafile=str(ca))
    bodies = [review(job(f"model-{random.randrange(releases)}-v1-prod", i)) for i in range(2000)]
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    connector = aiohttp.TCPConnector(ssl=context, limit=16)
    async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"}) as session:
        async with session.get(url + "/readyz") as resp:
            assert resp.status == 200

        async def one(body: bytes) -> None:
            t = time.perf_counter()
            async with session.post(url + "/validate", data=body) as resp:
                answer = await resp.json()
            latencies.append((time.perf_counter() - t) * 1000)
            key = str(resp.status) if resp.status != 200 else ("allow" if answer["response"]["allowed"] else "deny")
            statuses[key] = statuses.get(key, 0) + 1

        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(bodies[i % len(bodies)])))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        async with session.get(url + "/healthz") as resp:
            health = await resp.json()
    return {"requests": n, "offered_per_s": rate, "achieved_per_s": round(n / elapsed, 1), "p50_ms": pct(latencies, 0.5),
            "p99_ms": pct(latencies, 0.99), "max_ms": round(max(latencies), 3), "answers": statuses, "healthz": health}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0, help="AdmissionReviews per second offered (open loop).")
    parser.add_argument("--seconds", type=float, default=20.0, help="Length of the load phase.")
    parser.add_argument("--releases", type=int, default=2000, help="Releases in the release topic (the state the decisions read).")
    parser.add_argument("--bootstrap", help="Use this broker instead of starting one.")
    parser.add_argument("--json", type=Path, help="Write the numbers here too.")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-admit-"))
    broker = None if args.bootstrap else LocalKafka(workdir / "kafka", default_cache_dir(), log_level="WARN").start()
    bootstrap = args.bootstrap or broker.bootstrap
    catalogue = TopicCatalogue(prefix=f"bench{uuid.uuid4().hex[:8]}", raw_partitions=2)
    admit = None
    try:
        ensure_topics({"bootstrap.servers": bootstrap}, catalogue)
        events = release_events(args.releases)
        publisher = EventPublisher({"bootstrap.servers": bootstrap}, catalogue, "bench")
        for i in range(0, len(events), 1000):
            publisher.publish_batch(events[i:i + 1000])
        publisher.close(10)
        results = {"releases": args.releases, "release_events": len(events), "decide": bench_decide(events, args.releases)}
        admit, url, ca = start_admit(bootstrap, catalogue.prefix, workdir)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # ready = the release topic read to its end
            try:
                if asyncio.run(_ready(url, ca)):
                    break
            except aiohttp.ClientError:
                pass
            time.sleep(0.2)
        asyncio.run(load(url, ca, min(args.rate, 100), 2, args.releases))  # warm-up (TLS sessions, the producer's topic limit)
        results["webhook"] = asyncio.run(load(url, ca, args.rate, args.seconds, args.releases))
        print(json.dumps(results, indent=2))
        server = results["webhook"]["healthz"]["decision_latency"]
        ok = server["p99_ms"] < 5 and results["webhook"]["achieved_per_s"] >= 0.95 * args.rate
        print(f"target p99 decision latency < 5 ms at {args.rate:g} req/s: {'met' if ok else 'NOT met'} — server-side p99 "
              f"{server['p99_ms']} ms (body read to answer encoded, last {server['n']}), round trip p99 {results['webhook']['p99_ms']} ms "
              f"at {results['webhook']['achieved_per_s']} req/s achieved, decide() alone p99 {results['decide']['p99_ms']} ms")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 0
    finally:
        if admit is not None:
            admit.stop(grace=20)
        if broker is not None:
            broker.stop()


async def _ready(url: str, ca: Path) -> bool:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(ca)))) as session:
        async with session.get(url + "/readyz") as resp:
            return resp.status == 200


if __name__ == "__main__":
    sys.exit(main())
