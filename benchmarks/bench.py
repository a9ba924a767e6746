"""`make bench`: one run, one process tree, the same input for every phase.

    .venv/bin/python benchmarks/bench.py [--events 50000] [--latency-seconds 60] [--json out.json]

Publishes the event mix (benchmarks/mix.py) ONCE to fresh raw topics on a local broker
(or ``--bootstrap``), warms the broker up (phase 0, not measured: a worker over
``--warmup-events`` (as many as the phases, by default) of their own topics, in rounds until a round costs the broker no less
CPU than the one before — a fresh JVM compiles its hot paths in its first minutes, and a
broker in service is warm), then runs, one after the other over those topics:

1. **bare loop** — a confluent-kafka consumer (own group) → ``orjson.loads`` → a
   clickhouse-connect insert of 10,000-row batches into a plain MergeTree table in its own
   chDB directory (in this process). What Python + Kafka + chDB can do at all.
2. **Faust pass-through** — benchmarks/passthrough.py as a child process: one Faust agent,
   ``take_events(1000, within=0.2)``, decode, produce through librdkafka, flush per batch.
   Faust's own ceiling; measured from its first processed batch to its last (the first
   batch's events left out), and its CPU per event (process tree, from /proc) over the same.
3. **worker** — ``gpuledger worker`` (fresh app id, own chDB store): correlated events/s
   from its health stats (the end of its correlation agent's first batch,
   ``first_correlate_batch_at``, → ``correlated_in`` = all inputs; that batch's events
   left out, as phase 2's; how long after the route stage's first batch that was is
   printed), the CPU per event of the worker process, its route stage's and its sink's
   processes apart, and the time from the first routed batch until ≥ 99 % of the inputs
   are queryable. Then, once the store is settled, the
   records it wrote to Kafka: every topic named ``<prefix>…`` except the raw inputs
   (outputs, route hops, changelogs — whatever the worker creates), per input event.
4. **latency** — a fresh prefix and app id; the worker starts first and stores the mix's
   releases (warm-up: its sink opens the store on its first batch), then
   ``--latency-warmup-seconds`` (15) of live input at the run's rate, not measured (its lag
   printed apart: the broker's JIT and the worker's heap reach their working state), then
   the rest is published live (``occurred_at = observed_at`` = the instant the fixed rate schedules
   the event) at 80 % of phase 3's throughput for ``--latency-seconds`` (by ``LiveLoad``:
   events encoded before the clock starts, so the load generator takes little of the
   cores the measured processes share; published in 50 ms ticks); p50/p99
   of ``inserted_at − observed_at`` over the stored correlated rows (the first version of
   each row to be stored), and the same by ten seconds of publishing (a queue growing for
   the whole run — a stage short of CPU — reads differently from a pause, which marks one
   bucket). Then the worker's share apart from the sink's, by hop, from
   the records' Kafka CreateTime: raw → the route record that carried the event (route
   stage), → its first correlated record (correlation stage); the worker's CPU per event
   while live (small batches cost more per event than phase 3's backlog); how much of the
   run each stage's event loop was held (health ``busy_s``: batches, taking commits — and the
   correlation process's collections): a stage near 100 % queues every pause; and how busy
   the machine's cores were (and the local broker's share): a live run that needs more
   than the machine has queues at every hop, whatever the worker does (the summary sets the
   live CPU per event of all processes, publisher and broker included, beside the bulk
   phase's, and the cores each kept busy, and by process what live cost beyond bulk, and the latency run's rate as a share of phase 3's end-to-end
   rate — 99 % of its inputs over the time until they were queryable: the correlated rate counts the
   correlation stage alone, while the sink, at a lower priority, stores behind it). Then **restart**:
   the latency worker, stopped cleanly, is started again with 200 new events waiting;
   seconds from the process start to its first correlated batch (target under 5 s).
5. **replay** — phase 3's raw topics again, new app id, new store: events/s, and per-table
   checksums (sinks/checksum.py) compared with phase 3's store.

Prints one table plus ratios against the targets (and the pass-through/worker ratio in CPU
per event, which a loaded machine disturbs less than the rates), and ``--json`` writes every number.
Every wait has a timeout (``--timeout``) and says what it waited for; every broker and
process started here is stopped on the way out. Not a test: numbers depend on the
machine (run it on the 2-core target, with nothing else running).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402
from confluent_kafka import Consumer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from benchmarks.mix import RELEASES, events  # noqa: E402
from gpuledger.dev.localkafka import LocalKafka, LocalKafkaError  # noqa: E402
from gpuledger.dev.process import ServiceError, ServiceProcess, wait_for_worker  # noqa: E402
from gpuledger.settings import default_cache_dir  # noqa: E402
from gpuledger.timefmt import iso_z  # noqa: E402
from producers._errors import ProducerError  # noqa: E402
from producers._kafka import EventPublisher, ensure_topics  # noqa: E402
from schemas import encode_event  # noqa: E402
from schemas.topics import TopicCatalogue  # noqa: E402
from sinks.checksum import differing  # noqa: E402
from sinks.clickhouse import connect  # noqa: E402
from sinks.errors import SinkError  # noqa: E402
from sinks.read.query import RemoteReader, owner_file  # noqa: E402

DB = "gpuledger"
PUBLISH_BATCH = 5000
BARE_BATCH = 10_000
POLL_S = 0.1
WARM_ROUNDS = 4  # phase 0's rounds at most (Bench.warm_up)
WARM_STEADY = 1.2  # a warm-up round not this many times cheaper for the broker than the one before: warm
#: Seconds the latency run measures its worker and the broker at rest — warmed up, no input —
#: before it publishes: the floor of CPU its processes use whatever the rate (poll loops, the
#: store's background work, the broker's idle requests), which the live CPU per event includes.
#: Measured 2026-12: 0.14-0.20 of the 2 cores, 0.08-0.11 of it the broker. Not in it: what a batch costs
#: whatever its size once input flows — at 200 events/s the same processes kept ~0.6 of a core
#: busy, the sink ~0.23 of it (a chDB insert costs 2-6 ms of CPU with a single row, and each
#: sink batch inserts into up to seven tables, ~3 batches a second).
REST_S = 5.0
TARGETS = {"worker_vs_passthrough_pct": 75.0, "outputs_per_input": 3.0, "latency_p99_s": 2.0, "restart_s": 5.0}
_QUIET = logging.getLogger("librdkafka.bench")


class BenchError(RuntimeError):
    """A phase could not complete (a wait timed out, a child died); the message says which."""


def wait_until(what: str, timeout: float, probe: Callable[[], object], poll: float = POLL_S,
               alive: ServiceProcess | None = None) -> object:
    """Poll ``probe`` until it returns something truthy; BenchError naming ``what`` if not."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None and not alive.alive():
            raise BenchError(f"{what}: the process exited with {alive.proc.returncode}:\n{alive.log_tail()}")
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            tail = f"\n--- log tail ({alive.log_path}) ---\n{alive.log_tail()}" if alive is not None else ""
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(poll)


# --- Kafka -----------------------------------------------------------------------

def publish(publisher: EventPublisher, stream) -> int:
    batch, n = [], 0
    for ev in stream:
        batch.append(ev)
        if len(batch) == PUBLISH_BATCH:
            n += publisher.publish_batch(batch)
            batch = []
    return n + publisher.publish_batch(batch)


class Stamps:
    """Epoch seconds as the encoder writes a time, quoted (``"YYYY-MM-DDTHH:MM:SS.ffffffZ"``), the
    microseconds rounded as ``datetime.fromtimestamp`` rounds them — the text up to the second made
    once per second: a datetime and ``iso_z`` per event were a third of the latency run's publisher
    (~9 us per event, CPU the measured processes share: ``LiveLoad``)."""

    def __init__(self) -> None:
        self._second, self._prefix = None, b""

    def __call__(self, epoch_s: float) -> bytes:
        fraction, whole = math.modf(epoch_s)
        second, micro = int(whole), round(fraction * 1_000_000)
        if micro == 1_000_000:
            second, micro = second + 1, 0
        if second != self._second:
            self._second, self._prefix = second, f'"{iso_z(datetime.fromtimestamp(second, timezone.utc), 0)[:-1]}.'.encode()
        return self._prefix + b'%06dZ"' % micro


class LiveLoad:
    """The latency run's load: the mix's events from its ``start``-th on, published at a
    fixed rate with ``occurred_at = observed_at = now``.

    Why not ``EventPublisher.publish_batch`` of events built as they go: building and
    encoding a pydantic event costs ~21 us and the publisher's per-batch acks, spans and
    logs as much again — ~0.2 of a core at 3,100 events/s, taken from the cores the measured
    processes share (the collectors run on other machines in a deployment). So the events
    are built and encoded before the clock starts, with the product's encoder, family topic
    and correlation key, stamped with ``STAMP``; publishing one is a ``bytes.replace`` of
    the stamp by the time of publishing and a produce on the publisher's own librdkafka
    producer (so configured as the collectors' are: lz4, the murmur2 partitioner, batches
    sized by the broker's record limit — a plain producer's uncompressed records cost the
    broker a third more CPU). Every record's delivery is checked (``close`` raises if any
    failed). Memory: ~1 KB per event held (60 s at 3,000 events/s: ~180 MB, ~6 s to build).

    Each event is stamped with the instant the fixed rate schedules it (``due``: the k-th at
    ``start + k / rate``), not with the instant it is handed to the producer: the load is
    published in ticks (``TICK_S``), and an event that waited for its tick — or for a
    full producer queue — waited as an event waits in a collector's batch, which the lag
    measured must include. Why ticks of 50 ms rather than a produce call per few ms: the
    producer sends one request per partition batch, and the 16 raw partitions at a 10 ms
    tick were ~940 produce requests/s — three quarters of every request the broker served
    during the run (its request log), and most of the broker's CPU, on the cores the
    measured processes share. Collectors run on other machines in a deployment; what a
    tick costs the lag (25 ms on average) is in the numbers reported."""

    #: Seconds between two publishing ticks of the latency run (see the class docstring).
    TICK_S = 0.05

    #: Stands for "now" in the encoded events (no event of the mix has it).
    STAMP = datetime(1999, 12, 31, 23, 59, 59, 999_999, tzinfo=timezone.utc)
    STAMP_BYTES = f'"{iso_z(STAMP, 6)}"'.encode()

    def __init__(self, publisher: EventPublisher, n: int, start: int) -> None:
        catalogue, self.records = publisher.catalogue, []
        for e in events(n, clock=lambda: self.STAMP, start=start):
            value = encode_event(e)
            if self.STAMP_BYTES not in value:
                raise BenchError(f"the encoder no longer renders times as {self.STAMP_BYTES!r}: {value[:200]!r}")
            self.records.append((catalogue.for_family(e.event_type), e.correlation_key().encode(), value))
        self.producer, _limit = publisher._ready(30)  # noqa: SLF001 - the product's producer, as configured (above)
        self.sent, self.failed = 0, []
        self._stamp = Stamps()

    def _delivered(self, err, _msg) -> None:
        if err is not None:
            self.failed.append(err)

    def publish(self, k: int, due: Callable[[int], float]) -> int:
        """Publish the next ``k`` events (fewer when none are left), the j-th (counted from the
        run's first) stamped ``due(j)`` (epoch seconds); returns how many."""
        produce, stamp, delivered, stamped = self.producer.produce, self.STAMP_BYTES, self._delivered, self._stamp
        batch = self.records[self.sent:self.sent + k]
        for j, (topic, key, value) in enumerate(batch, self.sent):
            value = value.replace(stamp, stamped(due(j)))
            while True:
                try:
                    produce(topic, value, key, on_delivery=delivered)
                    break
                except BufferError:
                    self.producer.poll(0.05)  # the wait counts in the lag: the stamp is the schedule's
        self.producer.poll(0)
        self.sent += len(batch)
        return len(batch)

    def close(self, timeout: float = 30.0) -> None:
        left = self.producer.flush(timeout)
        if left or self.failed:
            raise BenchError(f"latency run: {left} record(s) not delivered in {timeout:.0f}s, {len(self.failed)} failed"
                             + (f" (first: {self.failed[0]})" if self.failed else ""))


def publish_at(load: LiveLoad, rate: float, seconds: float, service: ServiceProcess | None = None, finish: bool = False) -> int:
    """Publish ``load`` at ``rate`` events/s for ``seconds``, in ticks (``LiveLoad.TICK_S``), each
    event stamped with the instant the rate schedules it; ``finish``: then the events still due by
    ``seconds`` (the last tick's; a load sized ``rate * seconds`` is then all published). Returns
    how many were published."""
    start, start_wall, sent = time.monotonic(), time.time(), 0
    due = lambda j: start_wall + j / rate  # noqa: E731
    while (elapsed := time.monotonic() - start) < seconds:
        behind = int(rate * elapsed) - sent
        if behind > 0:
            sent += load.publish(min(behind, PUBLISH_BATCH), due)
        if service is not None and not service.alive():
            raise BenchError(f"latency worker exited with {service.proc.returncode}:\n{service.log_tail()}")
        time.sleep(LiveLoad.TICK_S)  # a tick (LiveLoad): the wait is in the lag, by the events' stamps
    while finish and (left := math.ceil(rate * seconds) - sent) > 0 and (n := load.publish(min(left, PUBLISH_BATCH), due)):
        sent += n
    return sent


def end_offsets(bootstrap: str, topics: list[str]) -> dict[str, int]:
    """Sum of the high watermarks of every partition, per topic (= records written)."""
    if not topics:
        return {}
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-watermarks", "enable.auto.commit": False,
                         "logger": _QUIET})
    try:
        return {t: sum(consumer.get_watermark_offsets(TopicPartition(t, p), timeout=30)[1] for p in md.topics[t].partitions)
                for t in topics if t in md.topics}
    finally:
        consumer.close()


def derived_records(bootstrap: str, catalogue: TopicCatalogue) -> dict[str, int]:
    """Records in every topic named after the prefix, except the raw inputs."""
    names = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics
    raw = set(catalogue.raw_topics)
    return end_offsets(bootstrap, sorted(t for t in names if t.startswith(catalogue.prefix) and t not in raw))


# --- the worker ------------------------------------------------------------------

@dataclass
class WorkerRun:
    events: int
    events_per_s: float | None
    correlated_s: float
    after_route_s: float | None  # the first correlated batch ended this long after the first routed batch
    queryable_s: float | None
    settled: bool = False
    notes: list[str] = field(default_factory=list)
    cpu_ms_per_event: dict | None = None  # {"worker": ms, "route": ms, "sink": ms, "broker": ms} over the rate's window
    gc: dict | None = None  # the worker's, its route stage's and its sink's garbage collections so far (gpuledger.gctune.stats)
    stolen_cores: float | None = None  # of the machine's CPU, what the hypervisor took for others meanwhile (machine_busy)
    stage_busy: dict | None = None  # each stage's event loop held over the rate's window (stage_busy)
    first_routed: int = 0  # events of the first routed batch (routed before queryable_s's clock started)


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``pid`` and each of its descendants, now, by pid —
    read from /proc: the standard library has no per-process CPU of other processes, and
    one function does not justify a dependency (psutil) the product does not need."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        child = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(child)  # fields after "(comm)": state, ppid, ...
        times[child] = (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in times:
            out[p] = times[p]
        todo.extend(children.get(p, ()))
    return out


def machine_busy() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, elapsed CPU seconds, of the busy ones stolen by
    the hypervisor) now, from /proc/stat's first line: two readings tell how many of the
    machine's cores were busy in between — and how much of that was not this machine's work
    at all (``steal``: a virtual machine's neighbours; a run with much of it is a noisy one)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    return (sum(fields[:8]) - idle) / _CLK_TCK, sum(fields[:8]) / _CLK_TCK, steal / _CLK_TCK


#: The worker's child processes as its health page names them (gpuledger.child).
CHILDREN = ("route", "controls", "sink")


def worker_children(url: str) -> dict[str, int]:
    """The worker's child processes, name -> pid, from its health page (route, controls, sink)."""
    return {name: page["pid"] for name in CHILDREN if (page := health(url, name)).get("pid")}


def cpu_by_process(before: dict[int, float], after: dict[int, float], root: int, children: dict[str, int]) -> dict[str, float]:
    """CPU seconds between two ``cpu_seconds`` readings: the worker's own process (``root``),
    each named child, and any other descendant summed as ``other`` (none: left out)."""
    out = {"worker": after.get(root, 0.0) - before.get(root, 0.0)}
    named = {pid: name for name, pid in children.items()}
    for pid, t in after.items():
        if pid != root:
            name = named.get(pid, "other")
            out[name] = out.get(name, 0.0) + t - before.get(pid, 0.0)
    return out


#: How the bench's lines name each process (``cpu_by_process``'s keys and the broker), in their order.
PROCESS_LABELS = {"worker": "worker", "route": "its route stage", "controls": "its controls stage", "sink": "its sink",
                  "other": "other children", "broker": "the broker"}


def fmt_cores(cores: dict[str, float]) -> str:
    """Cores busy by process (``cpu_by_process`` over a wall time, and the broker)."""
    return ", ".join(f"{label} {cores[name]:.2f}" for name, label in PROCESS_LABELS.items() if name in cores)


def above_rest(live_ms: dict[str, float], rest_cores: dict[str, float], rate: float) -> dict[str, float]:
    """The live CPU ms per event of each process less its at-rest floor's share at ``rate``
    events/s (what each further event cost): ``rest_cores`` cores are ``1000 * cores / rate``
    ms of every event."""
    return {name: ms - rest_cores.get(name, 0.0) * 1000 / rate for name, ms in live_ms.items()}


def fmt_cpu(cpu: dict[str, float]) -> str:
    """CPU ms per event by process: the worker, its route and controls stages, its sink, the broker."""
    return ", ".join(f"{label} {cpu[name]:.3f} ms" for name, label in PROCESS_LABELS.items() if name in cpu)


def worker_env(bootstrap: str, prefix: str, app_id: str, data_dir: Path) -> dict[str, str]:
    return {"GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": prefix, "GPULEDGER_DATA_DIR": str(data_dir),
            "GPULEDGER_CLICKHOUSE_DSN": store_dsn(data_dir), "GPULEDGER_CLICKHOUSE_DATABASE": DB,
            "GPULEDGER_STREAMS_APP_ID": app_id, "GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "3"}


def store_dsn(data_dir: Path) -> str:
    return f"chdb://{data_dir / 'clickhouse'}"


def health(url: str, part: str = "stats") -> dict:
    """One part of the worker's health page ({} while it does not answer)."""
    try:
        with urllib.request.urlopen(f"{url}/gpuledger/health/", timeout=5) as resp:
            return json.loads(resp.read())[part]
    except (OSError, ValueError, KeyError):
        return {}


def stage_busy(before: tuple[dict, dict], after: tuple[dict, dict], wall: float) -> dict:
    """Per stage (epoch name): the share of ``wall`` its event loop spent handling batches and
    taking commits (health ``epochs``/``busy_s``) — and for the correlation stage, whose process
    is the worker's own, its garbage collections (the freeze after each commit: health ``gc``)."""
    (epochs0, gc0), (epochs1, gc1) = before, after
    out = {}
    for name, epoch in epochs1.items():
        b0, b1 = (epochs0.get(name) or {}).get("busy_s"), epoch.get("busy_s")
        if not b0 or not b1 or wall <= 0:
            continue
        shares = {part: (b1[part] - b0[part]) / wall for part in ("batches", "commits")}
        if name == "correlate_entities" and "seconds" in gc0 and "seconds" in gc1:
            shares["collections"] = (gc1["seconds"] - gc0["seconds"]) / wall
        out[name] = {"total": sum(shares.values()), **shares}
    return out


def fmt_busy(stages: dict) -> str:
    return "; ".join(f"{name} {b['total']:.0%} (batches {b['batches']:.0%}, taking commits {b['commits']:.0%}"
                     + (f", collections {b['collections']:.0%}" if "collections" in b else "") + ")" for name, b in stages.items())


def stored_rows(reader: RemoteReader) -> int:
    """Inputs with a queryable row; -1 while the worker's query endpoint does not answer."""
    try:
        return int(reader.query(f"SELECT count() AS n FROM {DB}.correlated_events FINAL").rows[0][0])
    except SinkError:
        return -1


def broker_seconds(pid: int | None) -> float | None:
    """CPU seconds the local broker (``pid``) has used so far; None without one (``--bootstrap``)."""
    return sum(cpu_seconds(pid).values()) if pid else None


def follow_worker(service: ServiceProcess, url: str, reader: RemoteReader, expected: int, timeout: float,
                  broker_pid: int | None = None) -> WorkerRun:
    """Correlated events/s (the end of the first batch that correlated events → every input
    correlated, that batch's events left out: as the pass-through's first batch → last),
    then the time from the first routed batch until ≥ 99 % of the inputs are queryable."""
    first: list[float] = []  # the end of the first correlated batch
    n_first = [0]
    routed_at: list[float] = []  # the end of the first routed batch
    routed_first: list[int] = []  # how many events that batch routed
    cpu_first: list = []  # (CPU readings, correlated_in) at the first look that saw a routed batch

    def correlated():
        stats = health(url)
        if stats.get("routed", 0) and not cpu_first:
            cpu_first.append((cpu_seconds(service.proc.pid), stats.get("correlated_in", 0), broker_seconds(broker_pid),
                              machine_busy()[2], time.monotonic(), (health(url, "epochs"), health(url, "gc")), stats.get("routed", 0)))
            routed_at.append(stats.get("first_route_batch_at", time.monotonic()))
            routed_first.append(stats.get("first_route_batch", 0))
        if stats.get("correlated_in", 0) and not first:
            # The route stage is a process of its own and may start routing before the
            # correlation agent has its partitions: the clock starts when that agent has
            # done its first batch, as the pass-through's starts at its agent's first.
            first.append(stats.get("first_correlate_batch_at", time.monotonic()))
            n_first[0] = stats.get("first_correlate_batch", stats["correlated_in"])
        return stats.get("correlated_in", 0) >= expected

    wait_until(f"the worker to correlate {expected} events (health stats correlated_in)", timeout, correlated, alive=service)
    done = time.monotonic()
    cpu_done, broker_done, stolen_done = cpu_seconds(service.proc.pid), broker_seconds(broker_pid), machine_busy()[2]
    busy = stage_busy(cpu_first[0][5], (health(url, "epochs"), health(url, "gc")), done - cpu_first[0][4]) if cpu_first else None
    children = worker_children(url)
    stolen = (stolen_done - cpu_first[0][3]) / (done - cpu_first[0][4]) if cpu_first and done > cpu_first[0][4] else None
    rate = (expected - n_first[0]) / (done - first[0]) if done > first[0] and expected > n_first[0] else None
    cpu = None
    if cpu_first and expected > cpu_first[0][1]:
        # CPU per event correlated between the two looks: what a loaded machine disturbs far
        # less than a rate (the worker's own process; its route stage and its sink apart).
        n_cpu = expected - cpu_first[0][1]
        cpu = {name: s * 1000 / n_cpu for name, s in cpu_by_process(cpu_first[0][0], cpu_done, service.proc.pid, children).items()}
        if "route" in cpu and expected > cpu_first[0][6]:
            # The route stage runs ahead of the correlation stage: what it had routed by the first
            # look was routed with CPU before that look, so it is not in its share either (divided
            # by every event correlated since, it read as a third of what a replay's route costs).
            cpu["route"] *= n_cpu / (expected - cpu_first[0][6])
        if broker_done is not None:
            cpu["broker"] = (broker_done - cpu_first[0][2]) * 1000 / n_cpu
    queryable = None
    try:
        wait_until(f"≥ 99% of {expected} rows to be queryable in {DB}.correlated_events", timeout,
                   lambda: stored_rows(reader) >= expected * 0.99, poll=0.2, alive=service)
        queryable = time.monotonic() - (routed_at or first)[0]
    except BenchError as exc:
        print(f"  ! {exc}", flush=True)
    gc = {"worker": health(url, "gc"), **{name: (health(url, name) or {}).get("gc") or {} for name in CHILDREN}}
    run = WorkerRun(events=expected, events_per_s=rate, correlated_s=done - first[0], queryable_s=queryable, cpu_ms_per_event=cpu, gc=gc,
                    after_route_s=first[0] - routed_at[0] if routed_at else None, stolen_cores=stolen, stage_busy=busy,
                    first_routed=routed_first[0] if routed_first else 0)
    if rate is None:
        run.notes.append("every input arrived in the first routed batch: too few events to measure a rate")
    return run


def settle(service: ServiceProcess, url: str, reader: RemoteReader, expected: int, timeout: float, quiet_s: float = 3.0) -> bool:
    """Wait until every input has its row and no table grew for ``quiet_s`` (parked rows
    flushed, derived tables and allocations written) — so stores can be compared."""
    tables = [r[0] for r in reader.query("SELECT name FROM system.tables WHERE database = {db:String}", {"db": DB}).rows]
    count_sql = " + ".join(f"(SELECT count() FROM {DB}.`{t}`)" for t in tables) or "0"
    last: list = [None, time.monotonic()]

    def quiet():
        try:
            total = int(reader.query(f"SELECT {count_sql} AS n").rows[0][0])
        except SinkError:
            return False
        if total != last[0]:
            last[:] = [total, time.monotonic()]
            return False
        return time.monotonic() - last[1] >= quiet_s and stored_rows(reader) >= expected and not health(url).get("parked", 0)

    try:
        wait_until(f"the store to settle (all {expected} rows, no table growing for {quiet_s:.0f}s, nothing parked)",
                   timeout, quiet, poll=0.5, alive=service)
        return True
    except BenchError as exc:
        print(f"  ! {exc}", flush=True)
        return False


# --- the phases ------------------------------------------------------------------

class Bench:
    def __init__(self, args, work: Path, bootstrap: str, broker_pid: int | None = None) -> None:
        self.args = args
        self.broker_pid = broker_pid  # the local broker this run started (None with --bootstrap)
        self.work = work
        self.bootstrap = bootstrap
        self.run_id = uuid.uuid4().hex[:6]
        self.catalogue = TopicCatalogue(prefix=f"bench-{self.run_id}", raw_partitions=4)
        self.children: list[ServiceProcess] = []
        self.results: dict = {"config": {"events": args.events, "latency_seconds": args.latency_seconds, "prefix": self.catalogue.prefix,
                                         "work_dir": str(work), "bootstrap": bootstrap}}

    def start(self, service: ServiceProcess) -> ServiceProcess:
        self.children.append(service)
        return service.start()

    def stop(self, service: ServiceProcess, grace: float = 30.0) -> None:
        service.stop(grace=grace)
        self.children.remove(service)

    def stop_all(self) -> None:
        for service in reversed(self.children):
            service.stop(grace=15)
        self.children.clear()

    def publish_input(self) -> int:
        ensure_topics({"bootstrap.servers": self.bootstrap}, self.catalogue)
        pub = EventPublisher({"bootstrap.servers": self.bootstrap}, self.catalogue, "bench")
        t = time.monotonic()
        n = publish(pub, events(self.args.events))
        pub.close()
        on_topics = sum(end_offsets(self.bootstrap, list(self.catalogue.raw_topics)).values())
        if on_topics != n:
            raise BenchError(f"published {n} events but the raw topics hold {on_topics} records (topics not fresh?)")
        print(f"published {n:,} events to {self.catalogue.prefix}.* in {time.monotonic() - t:.1f}s", flush=True)
        self.results["published"] = n
        return n

    def warm_up(self, n: int) -> None:
        """Phase 0, not measured: a worker over ``n`` events of topics of their own, in rounds
        until the broker is warm. The local broker is a fresh JVM that compiles its hot paths
        in its first minutes — its JIT spent ~2 s of CPU inside phase 3 alone when phase 3 was
        the broker's first worker (``jstat -compiler``), and phase 3 cost it twice the CPU per
        event that the replay, the same work a minute later, did. A broker in service is warm;
        so is this one before the measured phases: a round that did not cost the broker at
        least ``WARM_STEADY`` times less CPU than the one before ends the warm-up (at most
        ``WARM_ROUNDS``). Why rounds: after one round the broker was not always warm — the
        second round usually costs it a third less CPU than the first — and on a cold machine
        one round left phase 3 at half the replay's rate (the broker 0.12 ms per event against
        0.02; worker / pass-through printed 44 % where warm runs of the same code printed
        76-94 %). Rounds of 10,000 events were not enough either, on a freshly booted machine:
        such a round costs the broker ~2 CPU s whatever its size (topics, groups, joins), so
        two rounds looked alike and ended the warm-up while its per-record paths were still
        cold — phase 3 ran at 53-56 % of the pass-through and at 0.06 ms of broker CPU per
        event against the replay's 0.02, in two runs in a row. Rounds of the phases' own size
        (3.7, 2.1, 1.9 broker CPU s) left phase 3 at 84 %, the broker at 0.02 ms — as the
        replay: a round as big as what it warms up for."""
        if n <= 0:
            return
        print(f"0/5 warm-up (not measured): a worker over {n:,} events of their own topics, until the broker is warm", flush=True)
        rounds, previous = [], None
        for i in range(1, WARM_ROUNDS + 1):
            seconds, used = self._warm_round(n, i)
            rounds.append({"seconds": seconds, "broker_cpu_s": used})
            print(f"    round {i}: done in {seconds:.1f}s" + (f" (the broker used {used:.1f} CPU s)" if used is not None else ""), flush=True)
            if used is None or (previous is not None and used * WARM_STEADY >= previous):
                break  # not our broker (--bootstrap), or no cheaper than the round before: warm
            previous = used
        self.results["warm_up"] = rounds

    def _warm_round(self, n: int, i: int) -> tuple[float, float | None]:
        cat = TopicCatalogue(prefix=f"benchwarm{i}-{self.run_id}", raw_partitions=self.catalogue.raw_partitions)
        ensure_topics({"bootstrap.servers": self.bootstrap}, cat)
        pub = EventPublisher({"bootstrap.servers": self.bootstrap}, cat, "bench")
        publish(pub, events(n))
        pub.close()
        data_dir = self.work / f"warm{i}"
        broker = broker_seconds(self.broker_pid)
        t = time.monotonic()
        service = self.start(ServiceProcess(["worker"], worker_env(self.bootstrap, cat.prefix, f"{cat.prefix}-app", data_dir), data_dir / "worker.log"))
        try:
            url = wait_for_worker(service, owner_file(store_dsn(data_dir)), timeout=120)
            wait_until(f"the warm-up worker to correlate {n} events", self.args.timeout,
                       lambda: health(url).get("correlated_in", 0) >= n, alive=service)
        finally:
            self.stop(service)
        used = broker_seconds(self.broker_pid)
        return time.monotonic() - t, (used - broker if broker is not None else None)

    def bare_loop(self, expected: int) -> float:
        print("1/5 bare loop: confluent-kafka → orjson → chDB (10k-row inserts)", flush=True)
        client = connect(store_dsn(self.work / "bare"), "bench")
        client.command("CREATE TABLE IF NOT EXISTS bench.bare_events (topic LowCardinality(String), partition UInt32, offset UInt64, "
                       "event_id String, event_type LowCardinality(String), occurred_at DateTime64(3, 'UTC'), value String) "
                       "ENGINE = MergeTree ORDER BY (event_type, occurred_at, event_id)")
        columns = ["topic", "partition", "offset", "event_id", "event_type", "occurred_at", "value"]
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"bench-bare-{self.run_id}", "auto.offset.reset": "earliest",
                             "enable.auto.commit": False, "logger": _QUIET})
        consumer.subscribe(list(self.catalogue.raw_topics))
        rows: list[list] = []
        stored, first = 0, None
        deadline = time.monotonic() + self.args.timeout
        try:
            while stored < expected:
                if time.monotonic() > deadline:
                    raise BenchError(f"bare loop: {stored + len(rows)} of {expected} events read after {self.args.timeout:.0f}s")
                for msg in consumer.consume(num_messages=BARE_BATCH, timeout=0.5):
                    if msg.error():
                        raise BenchError(f"bare loop: consumer error {msg.error()}")
                    if first is None:
                        first = time.monotonic()
                    value = msg.value()
                    ev = orjson.loads(value)
                    rows.append([msg.topic(), msg.partition(), msg.offset(), ev["event_id"], ev["event_type"],
                                 datetime.fromisoformat(ev["occurred_at"]), value.decode()])
                while len(rows) >= BARE_BATCH or (rows and stored + len(rows) >= expected):
                    batch, rows = rows[:BARE_BATCH], rows[BARE_BATCH:]
                    client.insert("bench.bare_events", batch, column_names=columns)
                    stored += len(batch)
            elapsed = time.monotonic() - first
            in_table = client.query("SELECT count() FROM bench.bare_events").result_rows[0][0]
            if in_table != expected:
                raise BenchError(f"bare loop: {in_table} rows in the table, expected {expected}")
        finally:
            consumer.close()
            client.close()
        rate = expected / elapsed
        print(f"    {rate:,.0f} events/s ({expected:,} in {elapsed:.1f}s)", flush=True)
        self.results["bare_loop"] = {"events_per_s": rate, "seconds": elapsed}
        return rate

    def passthrough(self, expected: int) -> float | None:
        print("2/5 Faust pass-through: one agent, take_events(1000, 0.2), librdkafka out, flush per batch", flush=True)
        output, app_id = f"passthrough-{self.run_id}.out", f"passthrough-{self.run_id}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for fut in admin.create_topics([NewTopic(output, num_partitions=self.catalogue.raw_partitions, replication_factor=1)],
                                       request_timeout=30).values():
            fut.result()
        progress = self.work / "passthrough" / "progress.json"
        progress.parent.mkdir(parents=True, exist_ok=True)
        child = self.start(ServiceProcess(
            ["--bootstrap", self.bootstrap, "--topics", ",".join(self.catalogue.raw_topics), "--output", output, "--app-id", app_id,
             "--datadir", str(progress.parent), "--progress", str(progress), "--partitions", str(self.catalogue.raw_partitions)],
            {}, self.work / "passthrough" / "passthrough.log", program=(sys.executable, str(REPO / "benchmarks" / "passthrough.py"))))

        cpu_first: list = []  # (CPU readings, events) at the first look after its first batch

        def state():
            try:
                s = json.loads(progress.read_text())
            except (OSError, ValueError):
                return None
            if not cpu_first and s["batches"]:
                cpu_first.append((cpu_seconds(child.proc.pid), s["events"], broker_seconds(self.broker_pid), machine_busy()[2], time.monotonic()))
            return s if s["events"] >= expected else None

        try:
            s = wait_until(f"the Faust pass-through to process {expected} events", self.args.timeout, state, poll=0.2, alive=child)
            cpu_done, broker_done, stolen_done, done_at = cpu_seconds(child.proc.pid), broker_seconds(self.broker_pid), machine_busy()[2], time.monotonic()
        finally:
            self.stop(child)
        cpu_ms = broker_ms = stolen = None
        if cpu_first and done_at > cpu_first[0][4]:
            stolen = (stolen_done - cpu_first[0][3]) / (done_at - cpu_first[0][4])
        if cpu_first and s["events"] > cpu_first[0][1]:
            # the pass-through's process tree, all of it
            cpu_ms = sum(cpu_by_process(cpu_first[0][0], cpu_done, child.proc.pid, {}).values()) * 1000 / (s["events"] - cpu_first[0][1])
            if broker_done is not None:
                broker_ms = (broker_done - cpu_first[0][2]) * 1000 / (s["events"] - cpu_first[0][1])
        written = end_offsets(self.bootstrap, [output]).get(output, 0)
        if written < expected:
            raise BenchError(f"pass-through reported {s['events']} events but {output} holds {written} records")
        span = s["last_batch_done"] - s["first_batch_done"]
        rate = (s["events"] - s["first_batch_events"]) / span if span > 0 else None
        print(f"    {fmt_rate(rate)} events/s ({s['events']:,} in {s['batches']} batches, {span:.1f}s after the first)", flush=True)
        self.results["passthrough"] = {"events_per_s": rate, "seconds": span, "batches": s["batches"], "cpu_ms_per_event": cpu_ms,
                                       "broker_cpu_ms_per_event": broker_ms, "stolen_cores": stolen}
        if cpu_ms is not None:
            print(f"    CPU {cpu_ms:.3f} ms per event" + (f", the broker {broker_ms:.3f} ms" if broker_ms is not None else "")
                  + (f"; the hypervisor stole {stolen:.2f} of a core meanwhile" if stolen is not None else ""), flush=True)
        return rate

    def worker(self, name: str, app_id: str, data_dir: Path, expected: int, extra_env: dict | None = None,
               after: Callable[[ServiceProcess, str], None] | None = None) -> WorkerRun:
        env = {**worker_env(self.bootstrap, self.catalogue.prefix, app_id, data_dir), **(extra_env or {})}
        service = self.start(ServiceProcess(["worker"], env, data_dir / "worker.log"))
        try:
            url = wait_for_worker(service, owner_file(store_dsn(data_dir)), timeout=120)
            reader = RemoteReader.from_owner(owner_file(store_dsn(data_dir)))
            run = follow_worker(service, url, reader, expected, self.args.timeout, self.broker_pid)
            # Settling takes seconds once 99 % is queryable; do not spend the whole --timeout on it.
            run.settled = settle(service, url, reader, expected, min(self.args.timeout, 180))
            if not run.settled:
                run.notes.append("store did not settle before the timeout; checksums may differ for that reason")
            if after:
                after(service, url)
        finally:
            self.stop(service)
        print(f"    {fmt_rate(run.events_per_s)} events/s correlated ({expected:,} in {run.correlated_s:.1f}s after the first correlated "
              f"batch, which ended {fmt_s(run.after_route_s)} after the first routed one), "
              f"≥99% queryable {fmt_s(run.queryable_s)} after the first routed batch", flush=True)
        if run.cpu_ms_per_event:
            print("    CPU per event: " + fmt_cpu(run.cpu_ms_per_event)
                  + (f"; the hypervisor stole {run.stolen_cores:.2f} of a core meanwhile" if run.stolen_cores is not None else ""), flush=True)
        if run.stage_busy:
            print("    how much of it each stage's event loop was held: " + fmt_busy(run.stage_busy), flush=True)
        for proc, stats in (run.gc or {}).items():
            if stats.get("collections"):
                print(f"    {proc}'s garbage collections since it started: {stats['seconds']:.2f}s in {stats['collections']} (young, middle, full)"
                      f", {stats.get('collected', 0):,} unreachable objects freed",
                      flush=True)
        self.results[name] = asdict(run)
        return run

    def outputs(self, _service, _url) -> None:
        per_topic = derived_records(self.bootstrap, self.catalogue)
        total = sum(per_topic.values())
        self.results["outputs"] = {"records": total, "per_input": total / self.results["published"], "per_topic": per_topic}
        print(f"    {total:,} records in {len(per_topic)} derived topic(s): {total / self.results['published']:.2f} per input event", flush=True)

    def latency(self, rate: float) -> dict:
        seconds = self.args.latency_seconds
        print(f"4/5 latency: live publishing at {rate:,.0f} events/s for {seconds:.0f}s to a worker already running", flush=True)
        cat = TopicCatalogue(prefix=f"benchlat-{self.run_id}", raw_partitions=self.catalogue.raw_partitions)
        ensure_topics({"bootstrap.servers": self.bootstrap}, cat)
        data_dir = self.work / "latency"
        service = self.start(ServiceProcess(["worker"], worker_env(self.bootstrap, cat.prefix, f"{cat.prefix}-app", data_dir),
                                            data_dir / "worker.log"))
        pub = EventPublisher({"bootstrap.servers": self.bootstrap}, cat, "bench")
        try:
            url = wait_for_worker(service, owner_file(store_dsn(data_dir)), timeout=120)
            # Every live event encoded before the clock starts (LiveLoad): the warm-up's, then the run's.
            warm_s = self.args.latency_warmup_seconds
            warm = LiveLoad(pub, math.ceil(rate * warm_s), start=RELEASES) if warm_s > 0 else None
            first = RELEASES + (len(warm.records) if warm else 0)
            load = LiveLoad(pub, math.ceil(rate * seconds), start=first)
            # The releases first, as a warm-up: the clock starts once the worker has its
            # partitions and its sink has stored them (the sink opens the store and runs
            # its migrations on its first batch), not while either is still starting: the
            # target is the steady state of sustained input. Start-up is measured apart
            # (docs/operations.md: restart to first processed batch).
            pub.publish_batch(list(events(RELEASES, clock=lambda: datetime.now(timezone.utc))))
            reader = RemoteReader.from_owner(owner_file(store_dsn(data_dir)))
            wait_until("the latency worker to store the warm-up releases", 120,
                       lambda: health(url).get("correlated_in", 0) >= RELEASES and stored_rows(reader) >= RELEASES, alive=service)
            children = worker_children(url)
            # The floor: what the warmed-up worker and the broker use with no input (a window
            # measured, not a wait for a condition).
            rest_cpu, rest_broker, rest_start = cpu_seconds(service.proc.pid), broker_seconds(self.broker_pid), time.monotonic()
            time.sleep(REST_S)
            rest_wall = time.monotonic() - rest_start
            rest = {name: s / rest_wall for name, s in
                    cpu_by_process(rest_cpu, cpu_seconds(service.proc.pid), service.proc.pid, children).items()}
            if rest_broker is not None:
                rest["broker"] = (broker_seconds(self.broker_pid) - rest_broker) / rest_wall
            print(f"    at rest first ({REST_S:.0f}s warmed up, no input), cores busy: {fmt_cores(rest)}; "
                  f"{sum(rest.values()):.2f} in all", flush=True)
            # The live warm-up (``--latency-warmup-seconds``, not measured; its lag is printed apart):
            # the clock measures the steady state of sustained input, which a worker fresh from its
            # start and a broker warmed by bulk input are not in for the first seconds at a live
            # rate — the broker's JIT compiles the paths of small requests then (its C2 compiler
            # 0.1-0.2 of a core in a live run's first 10 s, measured 2026-12), and the worker's heap
            # grows to its working size. Straight on into the run: no pause between them.
            if warm:
                print(f"    warm-up (not measured): {rate:,.0f} events/s for {warm_s:.0f}s, the run's clock starting when it ends", flush=True)
                warm_since_ms = int(time.time() * 1000)
                warm_sent = publish_at(warm, rate, warm_s, service, finish=True)
            since_ms = int(time.time() * 1000)
            worker_cpu = cpu_seconds(service.proc.pid)
            broker_cpu = broker_seconds(self.broker_pid)
            busy = machine_busy()
            stages_before = (health(url, "epochs"), health(url, "gc"))
            start, cpu = time.monotonic(), time.process_time()
            sent = publish_at(load, rate, seconds, service)
            stages = stage_busy(stages_before, (health(url, "epochs"), health(url, "gc")), time.monotonic() - start)
            load.close()
            if warm:
                warm.close()
            live = events(clock=lambda: datetime.now(timezone.utc), start=first + load.sent)  # the restart's: the next ones
            wall = time.monotonic() - start
            achieved, publisher_cpu = sent / wall, (time.process_time() - cpu) / wall
            # How saturated the machine was: a live run whose processes need more than its cores queues everywhere.
            busy_now = machine_busy()
            machine_cores = (busy_now[0] - busy[0]) / wall
            stolen_cores = (busy_now[2] - busy[2]) / wall
            cores = os.cpu_count() or 1
            broker_cores = (broker_seconds(self.broker_pid) - broker_cpu) / wall if broker_cpu is not None else None
            # CPU per event while live (small batches): what the latency depends on, beside phase 3's bulk figure.
            live_cpu = {name: s * 1000 / max(sent, 1)
                        for name, s in cpu_by_process(worker_cpu, cpu_seconds(service.proc.pid), service.proc.pid, children).items()}
            total = first + sent
            complete = True
            try:
                wait_until(f"all {total} latency rows to be stored (a worker that fell behind catches up here)", self.args.timeout,
                           lambda: stored_rows(reader) >= total, poll=0.5, alive=service)
            except BenchError as exc:
                complete = False
                print(f"  ! {exc} — reporting over the rows stored", flush=True)
            lag = self._lag(reader, since_ms)
            # How many inserts stored them (every row of one insert has its insert's ``inserted_at``):
            # the sink's fixed cost per insert is most of what a live run costs it beyond a bulk one.
            inserts = int(reader.query(f"SELECT uniqExact(inserted_at) AS n FROM {DB}.correlated_events "
                                       "WHERE toUnixTimestamp64Milli(occurred_at) >= {since:Int64}", {"since": since_ms}).dicts()[0]["n"])
            # The same by ten seconds of publishing: a queue that grows for the whole run (a
            # stage short of CPU) reads differently from pauses (one bucket's p99 only).
            buckets = reader.query(
                "SELECT intDiv(toUnixTimestamp64Milli(at) - {since:Int64}, 10000) AS b, quantileExact(0.5)(lag) AS p50,"
                " quantileExact(0.99)(lag) AS p99 FROM ("
                f" SELECT any(occurred_at) AS at, toUnixTimestamp64Milli(min(inserted_at)) - toUnixTimestamp64Milli(any(occurred_at)) AS lag"
                f" FROM {DB}.correlated_events WHERE toUnixTimestamp64Milli(occurred_at) >= {{since:Int64}} GROUP BY correlation_id)"
                " GROUP BY b ORDER BY b", {"since": since_ms}).dicts()
            warmed = self._lag(reader, warm_since_ms, since_ms) | {"seconds": warm_s, "published": warm_sent} if warm else None
        finally:
            pub.close(5)
            self.stop(service)
        if not lag["rows"]:
            raise BenchError("latency run: no correlated row was stored")
        worker = self.correlated_lag(cat.run(f"{cat.prefix}-app"), since_ms)
        out = {"target_rate": rate, "achieved_rate": achieved, "seconds": seconds, "published": sent, **lag, "complete": complete,
               "publisher_cpu_cores": publisher_cpu, "broker_cpu_cores": broker_cores, "machine_busy_cores": machine_cores,
               "machine_stolen_cores": stolen_cores, "machine_cores": cores, "cpu_ms_per_event": live_cpu, "worker": worker,
               "stage_busy": stages, "rest_cores": rest, "correlated_inserts": inserts, "warm_up": warmed,
               "by_10s": [{"from_s": int(b["b"]) * 10, "p50_s": b["p50"] / 1000, "p99_s": b["p99"] / 1000} for b in buckets]}
        print(f"    p50 {out['p50_s']:.2f}s, p99 {out['p99_s']:.2f}s, max {out['max_s']:.2f}s over {out['rows']:,} rows "
              f"({achieved:,.0f} events/s achieved; the publisher used {publisher_cpu:.2f} of a core)", flush=True)
        print(f"    the sink stored them in {inserts:,} inserts of the correlated family ({inserts / max(seconds, 1):.1f} a second of publishing)",
              flush=True)
        if out["warm_up"]:
            w = out["warm_up"]
            print(f"    the {w['seconds']:.0f}s warm-up before the clock (not measured): p50 {w['p50_s']:.2f}s, p99 {w['p99_s']:.2f}s "
                  f"over {w['rows']:,} rows", flush=True)
        print("    by ten seconds of publishing (p50/p99 s): "
              + ", ".join(f"{b['from_s']}s {b['p50_s']:.2f}/{b['p99_s']:.2f}" for b in out["by_10s"]), flush=True)
        print("    CPU per event while live: " + fmt_cpu(live_cpu), flush=True)
        print("      less the at-rest floor's share of each event (what each further event cost): "
              + fmt_cpu(above_rest(live_cpu, rest, achieved)), flush=True)
        broker_part = f" (the broker {broker_cores:.2f})" if broker_cores is not None else ""
        print(f"    the machine was busy {machine_cores:.2f} of its {cores} cores while publishing{broker_part}; "
              f"{stolen_cores:.2f} of a core of that stolen by the hypervisor", flush=True)
        if worker:
            hops = "".join(f"; {name} p50 {worker[name]['p50_s']:.2f}s p99 {worker[name]['p99_s']:.2f}s"
                           for name in ("route", "correlate") if worker.get(name))
            if not worker.get("route"):
                hops = "; by hop: not measured (no route record named an input event of the run)"
            print(f"    of which the worker (event → its first correlated record on Kafka): p50 {worker['p50_s']:.2f}s, "
                  f"p99 {worker['p99_s']:.2f}s{hops}; the rest is the sink", flush=True)
        if stages:
            # A stage whose loop is busy most of the time queues its input: every pause (a commit,
            # a collection) comes back as a backlog that takes pause / (1 - busy) to drain.
            print("    how much of the run each stage's event loop was held: " + fmt_busy(stages), flush=True)
        else:  # (health reads give {} when the page does not answer: say so rather than leave the line out)
            print("    how much of the run each stage's event loop was held: not read — the worker's health page did not "
                  "answer within 5s before or after the run (its event loop held that long: a saturated stage)", flush=True)
        self.results["latency"] = out
        self.restart(cat, data_dir, live)
        return out

    @staticmethod
    def _lag(reader: RemoteReader, since_ms: int, until_ms: int | None = None) -> dict:
        """p50/p99/max of event → queryable over the events stamped from ``since_ms`` (to before
        ``until_ms``): the first time each became queryable, min(inserted_at) over its versions
        (no FINAL; a merge that already dropped the first version makes it later, never earlier).
        occurred_at == observed_at in the latency run (correlated_events carries occurred_at)."""
        until = " AND toUnixTimestamp64Milli(occurred_at) < {until:Int64}" if until_ms is not None else ""
        row = reader.query(
            "SELECT quantileExact(0.5)(lag) AS p50, quantileExact(0.99)(lag) AS p99, max(lag) AS max, count() AS n FROM ("
            f" SELECT toUnixTimestamp64Milli(min(inserted_at)) - toUnixTimestamp64Milli(any(occurred_at)) AS lag"
            f" FROM {DB}.correlated_events WHERE toUnixTimestamp64Milli(occurred_at) >= {{since:Int64}}{until} GROUP BY correlation_id)",
            {"since": since_ms} | ({"until": until_ms} if until_ms is not None else {})).dicts()[0]
        return {"rows": int(row["n"]), "p50_s": (row["p50"] or 0) / 1000, "p99_s": (row["p99"] or 0) / 1000, "max_s": (row["max"] or 0) / 1000}

    def restart(self, cat: TopicCatalogue, data_dir: Path, live, n: int = 200) -> dict:
        """Restart to first processed batch after a clean stop (issue 15: under 5 s): the
        latency worker, stopped cleanly above, is started again on its own data dir and
        topics with ``n`` new events already waiting (the next ``n`` of the latency run's
        generator ``live``: new ids); seconds from the process start to its health page, to
        its first correlated batch, and to all ``n`` correlated."""
        pub = EventPublisher({"bootstrap.servers": self.bootstrap}, cat, "bench")
        try:
            pub.publish_batch([next(live) for _ in range(n)])
        finally:
            pub.close(5)
        print(f"    restart after the clean stop, {n} events waiting:", end=" ", flush=True)
        started = time.monotonic()
        # -v: worker-restart.log says what the restart spent its time on (state recovered, first batches)
        service = self.start(ServiceProcess(["-v", "worker"], worker_env(self.bootstrap, cat.prefix, f"{cat.prefix}-app", data_dir),
                                            data_dir / "worker-restart.log"))
        try:
            url = wait_for_worker(service, owner_file(store_dsn(data_dir)), timeout=120)
            answered = time.monotonic() - started
            wait_until("the restarted worker's first correlated batch", 120, lambda: health(url).get("correlated_in", 0) > 0,
                       poll=0.02, alive=service)
            first = time.monotonic() - started
            wait_until(f"the restarted worker to correlate the {n} waiting events", 120,
                       lambda: health(url).get("correlated_in", 0) >= n, poll=0.02, alive=service)
            every = time.monotonic() - started
            stores = health(url, "stores")
        finally:
            self.stop(service)
        out = {"events": n, "health_s": answered, "first_batch_s": first, "all_s": every, "stores": stores}
        print(f"health answered after {answered:.1f}s, first correlated batch after {first:.1f}s, all {n} after {every:.1f}s",
              flush=True)
        for name, st in stores.items():
            if not st.get("last_loaded_at"):
                print(f"      {name} store: still loading ({st['recovered_records']:,} changelog records read so far)", flush=True)
                continue
            # the worker's time.monotonic() is this process's clock
            snaps = st.get("snapshots") or {}
            from_snapshots = (f" and {snaps['loaded_partitions']} partition snapshot(s) ({snaps['read_seconds']:.1f}s of reading them)"
                              if snaps.get("loaded_partitions") else "")
            print(f"      {name} store: {st['keys']:,} keys recovered from {st['recovered_records']:,} changelog records{from_snapshots} in "
                  f"{st['recovery_seconds']:.1f}s of loading, the last load ended {st['last_loaded_at'] - started:.1f}s after the start",
                  flush=True)
            if snaps.get("read_whole"):
                print(f"      {name} store: snapshots not used: {snaps['read_whole']}", flush=True)
        self.results["restart"] = out
        return out

    def _records(self, topic: str):
        """Every record of ``topic`` now (a throwaway consumer from the start to the end offsets)."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"bench-lag-{uuid.uuid4().hex[:8]}",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False, "logger": _QUIET})
        ends, seen = end_offsets(self.bootstrap, [topic]).get(topic, 0), 0
        try:
            consumer.subscribe([topic])
            deadline = time.monotonic() + 60
            while seen < ends and time.monotonic() < deadline:
                for msg in consumer.consume(num_messages=5000, timeout=1.0):
                    if not msg.error():
                        seen += 1
                        yield msg
        finally:
            consumer.close()

    def correlated_lag(self, run, since_ms: int) -> dict | None:
        """The worker's share of the latency, by hop: for each input, the CreateTime of the
        route record that carried it (route stage: raw → route) and of its first correlated
        record (correlation stage: route → correlated), against its occurred_at."""
        from streams.packing import unpack

        routed: dict[tuple, int] = {}
        for msg in self._records(run.route):
            for _key, body in unpack(msg.value()):
                if body.get("k") == "row":  # an input event, as the route stage sends it (streams.correlate.route)
                    row = body["row"]
                    src = (row["topic"], row["partition"], row["offset"])
                    routed[src] = min(routed.get(src, msg.timestamp()[1]), msg.timestamp()[1])
        first: dict[str, tuple[int, int, int | None]] = {}
        for msg in self._records(run.correlated):
            row = orjson.loads(msg.value())
            occurred = int(datetime.fromisoformat(row["occurred_at"]).timestamp() * 1000)
            created, cid = msg.timestamp()[1], row["correlation_id"]
            if occurred >= since_ms and (cid not in first or created < first[cid][0]):
                first[cid] = (created, occurred, routed.get((row["source_topic"], row["source_partition"], row["source_offset"])))

        def quantiles(values: list[int]) -> dict:
            values = sorted(values)
            return {"p50_s": values[len(values) // 2] / 1000, "p99_s": values[min(len(values) - 1, int(len(values) * 0.99))] / 1000}

        if not first:
            return None
        hops = [(r - o, c - r) for c, o, r in first.values() if r is not None]
        return {"rows": len(first), **quantiles([c - o for c, o, _r in first.values()]),
                "route": quantiles([a for a, _b in hops]) if hops else None, "correlate": quantiles([b for _a, b in hops]) if hops else None}

    def checksums(self, *data_dirs: Path, exclude: tuple[str, ...] = ()) -> list[dict]:
        """Per-table checksums of stopped workers' stores, each read by a child process
        (this process already holds the bare loop's chDB directory; one per process)."""
        out = []
        for data_dir in data_dirs:
            extra = [arg for column in exclude for arg in ("--exclude", column)]
            proc = subprocess.run([sys.executable, "-m", "sinks.checksum", store_dsn(data_dir), "--database", DB, *extra], cwd=REPO,
                                  capture_output=True, text=True, timeout=self.args.timeout)
            if proc.returncode != 0:
                raise BenchError(f"checksums of {data_dir}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
            out.append({t: tuple(v) for t, v in json.loads(proc.stdout).items()})
        return out

    def run(self) -> dict:
        n = self.publish_input()
        self.warm_up(self.args.events if self.args.warmup_events is None else self.args.warmup_events)
        self.bare_loop(n)
        self.passthrough(n)
        print("3/5 worker: gpuledger worker over the same topics", flush=True)
        env = {"GPULEDGER_PROFILE": str(Path(self.args.profile).resolve())} if self.args.profile else None
        worker = self.worker("worker", f"{self.catalogue.prefix}-app", self.work / "worker", n, env, after=self.outputs)
        if self.args.latency_seconds > 0:
            rate = self.args.latency_rate or (0.8 * worker.events_per_s if worker.events_per_s else None)
            if rate:
                self.latency(rate)
            else:
                print("4/5 latency: skipped (no worker throughput to take 80% of; pass --latency-rate)", flush=True)
        print("5/5 replay: the same raw topics, new app id, new store", flush=True)
        replay_id = f"{self.catalogue.prefix}-replay"
        before = derived_records(self.bootstrap, self.catalogue)
        self.worker("replay", replay_id, self.work / "replay", n)
        after = derived_records(self.bootstrap, self.catalogue)
        # Topics phase 3 wrote that the replay wrote to as well: outputs not namespaced by
        # app id, so the replay's sinks also read phase 3's records from them.
        shared = sorted(t for t, records in after.items() if before.get(t) and records > before[t] and replay_id not in t)
        self.results["replay"]["shared_output_topics"] = shared
        if shared:
            print(f"    ! the replay wrote to {len(shared)} topic(s) phase 3 wrote to (its sinks read both runs' records): "
                  + ", ".join(shared), flush=True)
        original, replay = self.checksums(self.work / "worker", self.work / "replay")
        diff = differing(original, replay)
        content_diff = differing(*self.checksums(self.work / "worker", self.work / "replay", exclude=("version",))) if diff else []
        self.results["checksums"] = {"identical": not diff, "differing": diff, "differing_ignoring_version": content_diff,
                                     "worker": original, "replay": replay}
        return self.results


# --- the report ------------------------------------------------------------------

def fmt_rate(rate: float | None) -> str:
    return "n/a" if rate is None or math.isnan(rate) else f"{rate:,.0f}"


def fmt_s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f}s"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _rate(r: dict, phase: str) -> float | None:
    return (r.get(phase) or {}).get("events_per_s")


def end_to_end_rate(worker: dict) -> float | None:
    """Phase 3's inputs stored per second: 99 % of them, less the first routed batch's (routed before
    the clock started), over the time from the end of that batch until that many were queryable
    (``WorkerRun.queryable_s``)."""
    queryable, events = worker.get("queryable_s"), worker.get("events")
    return (0.99 * events - worker.get("first_routed", 0)) / queryable if queryable and events else None


def live_shares(live_cpu: dict, lat: dict) -> dict[str, float]:
    """The latency run's CPU per event (ms) of every process: the worker's and its children's, and
    the broker's and the publisher's from the cores they kept busy over the achieved rate."""
    return {**live_cpu, "broker": lat["broker_cpu_cores"] * 1000 / lat["achieved_rate"],
            "publisher": lat["publisher_cpu_cores"] * 1000 / lat["achieved_rate"]}


def live_premium(live_cpu: dict, bulk_cpu: dict, lat: dict) -> list[tuple[str, float]]:
    """What each process cost per event live (``live_shares``) beyond what it cost in the bulk
    phase (ms; the bulk phase published before its clock started: its publisher costs nothing
    there), largest first."""
    live = live_shares(live_cpu, lat)
    deltas = {name: live.get(name, 0.0) - bulk_cpu.get(name, 0.0) for name in {*live, *bulk_cpu}}
    return sorted(((name, d) for name, d in deltas.items() if name != "other" or round(d, 6)),  # (no other child: left out)
                  key=lambda item: (-round(item[1], 6), item[0]))


def ratios(r: dict) -> dict:
    wp = _ratio(_rate(r, "worker"), _rate(r, "passthrough"))
    return {"worker_vs_passthrough_pct": wp * 100 if wp else None, "replay_vs_worker": _ratio(_rate(r, "replay"), _rate(r, "worker"))}


def report(r: dict) -> str:
    def rate(phase: str) -> float | None:
        return _rate(r, phase)

    rows = [("bare loop", rate("bare_loop"), "confluent-kafka → orjson → chDB, 10k-row inserts"),
            ("Faust pass-through", rate("passthrough"), "1 agent, take_events(1000, 0.2), librdkafka out"),
            ("worker (correlated)", rate("worker"), f"≥99% queryable {fmt_s((r.get('worker') or {}).get('queryable_s'))} after the first routed batch"),
            ("replay", rate("replay"), "new app id + store, same raw topics")]
    lines = [f"{r['published']:,} input events, one run (prefix {r['config']['prefix']})", "",
             f"{'phase':<22}{'events/s':>10}   notes", "-" * 78]
    lines += [f"{name:<22}{fmt_rate(value):>10}   {note}" for name, value, note in rows]
    lines.append("")
    wp, rw = r["ratios"]["worker_vs_passthrough_pct"], r["ratios"]["replay_vs_worker"]
    lines.append(f"worker / pass-through = {wp:.0f} %  (target ≥ {TARGETS['worker_vs_passthrough_pct']:.0f} %)" if wp
                 else "worker / pass-through = n/a")
    lines.append(f"replay / worker = {rw:.2f}" if rw else "replay / worker = n/a")
    pt_cpu, w_cpu = (r.get("passthrough") or {}).get("cpu_ms_per_event"), (r.get("worker") or {}).get("cpu_ms_per_event")
    if pt_cpu and w_cpu:
        # The same comparison in CPU (what a loaded machine disturbs least): the worker's own
        # process per correlated event against the pass-through's per passed event.
        children = " + ".join(f"{name} {w_cpu[name]:.3f} ms" for name in (*CHILDREN, "other") if name in w_cpu)
        lines.append(f"CPU per event: pass-through {pt_cpu:.3f} ms, worker {w_cpu['worker']:.3f} ms (+ {children}); "
                     f"pass-through / worker = {pt_cpu / w_cpu['worker'] * 100:.0f} %")
        pt_broker, w_broker = r["passthrough"].get("broker_cpu_ms_per_event"), w_cpu.get("broker")
        if pt_broker is not None and w_broker is not None:
            # Both share the machine with the broker: what each costs it per event (2 cores in all).
            lines.append(f"CPU per event, all processes: pass-through {pt_cpu + pt_broker:.3f} ms (broker {pt_broker:.3f}), "
                         f"worker {sum(w_cpu.values()):.3f} ms (broker {w_broker:.3f})")
    if "outputs" in r:
        lines.append(f"outputs per input event = {r['outputs']['per_input']:.2f}  (target ≤ {TARGETS['outputs_per_input']:.0f})")
    if "latency" in r:
        lat = r["latency"]
        lines.append(f"event → queryable p50 = {lat['p50_s']:.2f} s, p99 = {lat['p99_s']:.2f} s at {lat['achieved_rate']:,.0f} events/s"
                     f"  (target p99 < {TARGETS['latency_p99_s']:.0f} s)" + ("" if lat["complete"] else "  [not every row was stored]")
                     + (f"; machine busy {lat['machine_busy_cores']:.2f} of {lat['machine_cores']} cores" if lat.get("machine_busy_cores") is not None else ""))
        if lat.get("warm_up"):
            w = lat["warm_up"]
            lines.append(f"  after {w['seconds']:.0f} s of the same input not measured (its p50 = {w['p50_s']:.2f} s, p99 = {w['p99_s']:.2f} s)")
        live_cpu, bulk_cpu, bulk_rate = lat.get("cpu_ms_per_event"), (r.get("worker") or {}).get("cpu_ms_per_event"), rate("worker")
        if live_cpu and bulk_cpu and bulk_rate and lat.get("broker_cpu_cores") is not None and "broker" in bulk_cpu:
            # What the latency target asks of the machine: the live run does the bulk phase's
            # work per event and more (smaller batches, and the publishing the bulk phase did
            # before its clock started), so at 80 % of a rate the machine bounded it needs
            # about the cores the bulk phase had, and queues at every hop.
            live_ms = sum(live_shares(live_cpu, lat).values())
            bulk_ms = sum(bulk_cpu.values())
            lines.append(f"CPU per event, all processes: live {live_ms:.3f} ms (publisher and broker included), bulk {bulk_ms:.3f} ms; "
                         f"cores busy: live {lat['achieved_rate'] * live_ms / 1000:.2f} at {lat['achieved_rate']:,.0f}/s, "
                         f"bulk {bulk_rate * bulk_ms / 1000:.2f} at {bulk_rate:,.0f}/s")
            lines.append("  live − bulk per event, by process: " + ", ".join(
                f"{name} {delta:+.3f} ms" for name, delta in live_premium(live_cpu, bulk_cpu, lat)))
        e2e = end_to_end_rate(r.get("worker") or {})
        if e2e:
            # The rate the whole pipeline, sink included, sustained in phase 3. The correlated
            # rate above counts the correlation stage alone, while the sink — at a lower priority
            # (streams.sink_nice) — falls behind and stores the rest after it: a live rate at or
            # above this one cannot be sustained, and its queue grows for as long as it runs.
            lines.append(f"end to end (phase 3, ≥99% queryable): {e2e:,.0f} events/s; the latency run's rate is "
                         f"{lat['achieved_rate'] / e2e * 100:.0f} % of it")
        if lat.get("rest_cores"):
            rest = lat["rest_cores"]
            lines.append(f"at rest (warmed up, no input): {sum(rest.values()):.2f} of {lat.get('machine_cores', '?')} cores busy "
                         f"({fmt_cores(rest)})")
    else:
        lines.append("event → queryable: not measured")
    if "restart" in r:
        rs = r["restart"]
        lines.append(f"restart after a clean stop → first correlated batch = {rs['first_batch_s']:.1f} s"
                     f"  (target < {TARGETS['restart_s']:.0f} s; health after {rs['health_s']:.1f} s)")
    if "checksums" in r:
        c = r["checksums"]
        lines.append("replay checksums identical: " + ("yes" if c["identical"] else
                     f"no (tables differing: {', '.join(c['differing'])}; ignoring version: {', '.join(c['differing_ignoring_version']) or 'none'})"))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=50_000, help="input events published once (default 50,000)")
    ap.add_argument("--warmup-events", type=int, default=None,
                    help="events of each round of the unmeasured warm-up (phase 0); 0 skips it (default: --events)")
    ap.add_argument("--latency-seconds", type=float, default=60.0, help="duration of the live latency run; 0 skips it (default 60)")
    ap.add_argument("--latency-warmup-seconds", type=float, default=15.0,
                    help="seconds of live input at the latency run's rate before its clock starts, not measured (default 15; 0: none)")
    ap.add_argument("--latency-rate", type=float, default=None, help="events/s of the latency run (default: 80%% of phase 3's throughput)")
    ap.add_argument("--timeout", type=float, default=600.0, help="limit of every wait for processing, in seconds (default 600)")
    ap.add_argument("--bootstrap", help="use this broker instead of starting a local one")
    ap.add_argument("--json", help="write every result to this file")
    ap.add_argument("--profile", help="write a cProfile of the phase-3 worker here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (broker data, stores, logs); kept anyway on failure")
    args = ap.parse_args()
    if args.events <= RELEASES:
        ap.error(f"--events must be more than {RELEASES} (the mix starts with {RELEASES} releases)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("librdkafka.bench").setLevel(logging.CRITICAL)
    work = Path(tempfile.mkdtemp(prefix="gpuledger-bench-"))
    broker = None
    bench = None
    ok = False
    try:
        if not args.bootstrap:
            broker = LocalKafka(work / "kafka", default_cache_dir(), log_level="WARN", with_parent=True).start()
        bench = Bench(args, work, args.bootstrap or broker.bootstrap, broker.proc.pid if broker else None)
        results = bench.run()
        results["ratios"] = ratios(results)
        print("\n" + report(results))
        ok = True
        return 0
    except (BenchError, ServiceError, ProducerError, LocalKafkaError, SinkError) as exc:
        print(f"\nbench failed: {exc}", file=sys.stderr)
        if bench is not None:
            bench.results["error"] = str(exc)
        return 1
    finally:
        if args.json and bench is not None:
            Path(args.json).write_text(json.dumps(bench.results, indent=2, default=str))
            print(f"\nresults{'' if ok else ' so far'} written to {args.json}")
        if bench is not None:
            bench.stop_all()
        if broker is not None:
            broker.stop()
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work dir kept: {work}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
