"""FINAL vs argMax on the real schema in chDB: the measurement behind docs/store.md.

Not a test (pytest does not collect it). Run from the repo root:

    PYTHONPATH=. .venv/bin/python tests/sinks/bench_store.py --rows 1000000

Loads a synthetic store through the real migrations — ``--rows`` correlated events,
of which ~1% release lifecycle rows, ~40% scheduler rows of known workloads, ~5% alert
rows, the rest GPU/other rows; 20% of all rows superseded by a second version; loaded
in 50,000-row inserts, left as ingestion leaves it (no OPTIMIZE) — then times
``trace()`` from every entry point in both modes, and the single-table lookups.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time

import clickhouse_connect

from sinks.migrations import migrate
from sinks.read.query import DirectReader
from sinks.read.trace import chain_of, trace

BASE = "toDateTime64('2026-01-01 00:00:00', 3, 'UTC')"


def load(client, db: str, rows: int, block: int = 50_000) -> dict[str, int]:
    n_rel = max(rows // 500, 10)          # 5 lifecycle rows each -> ~1%
    n_wl = max(rows // 50, 10)            # 20 scheduler rows each -> ~40%
    n_alert = rows // 20                  # ~5%
    n_fp = max(n_alert // 5, 1)
    n_pod = n_wl * 2
    sizes = {"release_history": n_rel * 5, "workload_timeline": n_wl * 20, "enriched_alerts": n_alert, "gpu_allocations": n_pod}

    def insert(table: str, select: str, total: int) -> None:
        for start in range(0, total, block):
            client.command(f"INSERT INTO {db}.{table} {select.format(start=start, count=min(block, total - start))}")

    rel = f"""SELECT concat('rel-', toString(intDiv(number, 5))) AS release_id,
        {BASE} + toIntervalSecond(intDiv(number, 5) * 600 + (number % 5) * 60) AS occurred_at,
        hex(MD5(concat('r', toString(number)))) AS correlation_id, toUInt64(v) AS version,
        ['release.registered','release.evaluated','release.approved','release.promoted','release.rolled_back'][number % 5 + 1] AS event_type,
        concat('model-', toString(intDiv(number, 5) % {max(n_rel // 5, 1)})) AS model_name, toString(intDiv(number, 5 * {max(n_rel // 5, 1)})) AS model_version,
        concat('sha256:', hex(MD5(toString(intDiv(number, 5))))) AS artifact_digest, 'team-x' AS owner, 'prod' AS environment,
        if(number % 5 = 2, 'alice', 'ci') AS actor
        FROM numbers({{start}}, {{count}}) ARRAY JOIN if(number % 5 = 0, [0, 1], [0]) AS v"""
    insert("release_history (release_id, occurred_at, correlation_id, version, event_type, model_name, model_version, artifact_digest, owner, environment, actor)",
           rel, n_rel * 5)
    wl = f"""SELECT concat('wl-', toString(intDiv(number, 20))) AS workload_id,
        {BASE} + toIntervalSecond((intDiv(number, 20) % {n_rel}) * 600 + 1200 + (number % 20) * 30) AS occurred_at,
        hex(MD5(concat('w', toString(number)))) AS correlation_id, toUInt64(v) AS version,
        ['scheduler.submitted','scheduler.quota_reserved','scheduler.admitted','scheduler.scheduled','scheduler.running',
         'scheduler.preempted','scheduler.evicted','scheduler.requeued','scheduler.admitted','scheduler.scheduled',
         'scheduler.running','scheduler.pods_ready','scheduler.running','scheduler.running','scheduler.running',
         'scheduler.running','scheduler.running','scheduler.running','scheduler.finished','scheduler.deleted'][number % 20 + 1] AS event_type,
        concat('rel-', toString(intDiv(number, 20) % {n_rel})) AS release_id, 'ns' AS namespace,
        concat('pod-', toString(intDiv(number, 20)), '-', toString(intDiv(number % 20, 10))) AS pod,
        concat('node-', toString(intDiv(number, 20) % 500)) AS node, 'prod-q' AS queue, 'cq' AS cluster_queue, 'high' AS priority_class,
        toInt64(1000) AS priority
        FROM numbers({{start}}, {{count}}) ARRAY JOIN if(number % 5 = 0, [0, 1], [0]) AS v"""
    insert("workload_timeline (workload_id, occurred_at, correlation_id, version, event_type, release_id, namespace, pod, node, queue, cluster_queue, priority_class, priority)",
           wl, n_wl * 20)
    al = f"""SELECT concat('fp-', toString(number % {n_fp})) AS alert_fingerprint,
        {BASE} + toIntervalSecond(((number % {n_fp}) % {n_rel}) * 600 + 1800 + intDiv(number, {n_fp}) * 60) AS occurred_at,
        hex(MD5(concat('a', toString(number)))) AS correlation_id, toUInt64(v) AS version,
        if(intDiv(number, {n_fp}) % 2 = 0, 'alert.firing', 'alert.resolved') AS event_type,
        if(v = 0, '', concat('rel-', toString((number % {n_fp}) % {n_rel}))) AS release_id,
        if(v = 0, '', concat('wl-', toString((number % {n_fp}) % {n_wl}))) AS workload_id, 'ns' AS namespace,
        concat('pod-', toString((number % {n_fp}) % {n_wl}), '-0') AS pod, concat('node-', toString(((number % {n_fp}) % {n_wl}) % 500)) AS node,
        'QualityDegraded' AS alertname, 'critical' AS severity, occurred_at AS starts_at
        FROM numbers({{start}}, {{count}}) ARRAY JOIN if(number % 5 = 0, [0, 1], [1]) AS v"""
    insert("enriched_alerts (alert_fingerprint, occurred_at, correlation_id, version, event_type, release_id, workload_id, namespace, pod, node, alertname, severity, starts_at)",
           al, n_alert)
    ga = f"""SELECT hex(MD5(concat('g', toString(number)))) AS allocation_id, toUInt64(v) AS version,
        concat('node-', toString(intDiv(number, 2) % 500)) AS node, concat('GPU-', toString(intDiv(number, 2) % 500), '-', toString(number % 8)) AS gpu_id,
        'ns' AS namespace, concat('pod-', toString(intDiv(number, 2)), '-', toString(number % 2)) AS pod,
        concat('wl-', toString(intDiv(number, 2))) AS workload_id, concat('rel-', toString(intDiv(number, 2) % {n_rel})) AS release_id,
        {BASE} + toIntervalSecond((intDiv(number, 2) % {n_rel}) * 600 + 1260 + (number % 2) * 300) AS started_at,
        if(v = 1, started_at + toIntervalSecond(3000), NULL) AS ended_at
        FROM numbers({{start}}, {{count}}) ARRAY JOIN if(number % 2 = 0, [0, 1], [0]) AS v"""
    insert("gpu_allocations (allocation_id, version, node, gpu_id, namespace, pod, workload_id, release_id, started_at, ended_at)", ga, n_pod)
    # correlated_events: the same rows (the source of truth), padded with GPU/other rows.
    client.command(f"""INSERT INTO {db}.correlated_events (correlation_id, version, event_type, occurred_at, release_id, model_name, model_version)
        SELECT correlation_id, version, event_type, occurred_at, release_id, model_name, model_version FROM {db}.release_history""")
    client.command(f"""INSERT INTO {db}.correlated_events (correlation_id, version, event_type, occurred_at, release_id, workload_id, namespace, pod, node)
        SELECT correlation_id, version, event_type, occurred_at, release_id, workload_id, namespace, pod, node FROM {db}.workload_timeline""")
    client.command(f"""INSERT INTO {db}.correlated_events (correlation_id, version, event_type, occurred_at, release_id, workload_id, namespace, pod, node, alert_fingerprint)
        SELECT correlation_id, version, event_type, occurred_at, release_id, workload_id, namespace, pod, node, alert_fingerprint FROM {db}.enriched_alerts""")
    base_rows = n_rel * 5 + n_wl * 20 + n_alert
    filler = f"""SELECT hex(MD5(concat('o', toString(number)))), toUInt64(v), if(number % 2 = 0, 'gpu.assigned', 'gpu.released'),
        {BASE} + toIntervalSecond(number % 10000000), concat('rel-', toString(number % {n_rel})), 'ns',
        concat('pod-', toString(number % {n_wl}), '-0'), concat('node-', toString(number % 500))
        FROM numbers({{start}}, {{count}}) ARRAY JOIN if(number % 5 = 0, [0, 1], [0]) AS v"""
    insert("correlated_events (correlation_id, version, event_type, occurred_at, release_id, namespace, pod, node)", filler, max(rows - base_rows, 0))
    sizes["correlated_events"] = rows
    return {**sizes, "n_rel": n_rel, "n_wl": n_wl, "n_fp": n_fp}


def timed_pair(fa, fb, repeat: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median and p90 (ms) of two callables, run alternately so machine load hits both alike."""
    ta, tb = [], []
    for i in range(repeat):
        for fn, out in ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta)):
            t = time.perf_counter()
            fn(i)
            out.append((time.perf_counter() - t) * 1000)

    def stats(xs):
        xs = sorted(xs)
        return statistics.median(xs), xs[min(len(xs) - 1, math.ceil(len(xs) * 0.9) - 1)]
    return stats(ta), stats(tb)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    workdir = tempfile.TemporaryDirectory(prefix="gpuledger-bench-")  # removed when the process exits
    client = clickhouse_connect.get_client(dsn=f"chdb://{workdir.name}")
    db = "bench"
    migrate(client, db)
    t = time.perf_counter()
    sizes = load(client, db, args.rows)
    print(f"loaded in {time.perf_counter() - t:.1f}s: {sizes}")
    parts = client.query("SELECT table, count(), sum(rows) FROM system.parts WHERE database = {db:String} AND active GROUP BY table ORDER BY table",
                         parameters={"db": db}).result_rows
    print("active parts:", parts)
    reader = DirectReader(client)
    rng = random.Random(7)
    n_rel, n_wl, n_fp = sizes["n_rel"], sizes["n_wl"], sizes["n_fp"]
    entries = {
        "alert": lambda: f"fp-{rng.randrange(n_fp)}",
        "release": lambda: f"rel-{rng.randrange(n_rel)}",
        "workload": lambda: f"wl-{rng.randrange(n_wl)}",
        "pod": lambda: f"ns/pod-{rng.randrange(n_wl)}-0",
        "gpu": lambda: (lambda w: f"node-{w % 500}/GPU-{w % 500}-{2 * w % 8}")(rng.randrange(n_wl)),
        "model": lambda: f"model-{rng.randrange(max(n_rel // 5, 1))}",
    }
    print(f"\n{'entry':10s} {'FINAL median/p90 ms':>22s} {'argMax median/p90 ms':>22s}  queries  same chain")
    for kind, pick in entries.items():
        values = [pick() for _ in range(args.repeat)]
        f, a = timed_pair(lambda i: trace(reader, db, kind, values[i], mode="final"),
                          lambda i: trace(reader, db, kind, values[i], mode="argmax"), args.repeat)
        ra, rb = trace(reader, db, kind, values[0], mode="final"), trace(reader, db, kind, values[0], mode="argmax")
        print(f"{kind:10s} {f[0]:10.1f} / {f[1]:7.1f}   {a[0]:10.1f} / {a[1]:7.1f}   {ra['entry']['queries']:5d}    {chain_of(ra) == chain_of(rb)}")
    single = {
        "release_history by release_id (key)": ("release_history", "release_id = {r:String}", None, (), {"r": "rel-7"}),
        "workload_timeline by workload_id (key)": ("workload_timeline", "workload_id = {w:String}", None, (), {"w": "wl-77"}),
        "gpu_allocations by node/GPU (key)": ("gpu_allocations", "node = {n:String} AND gpu_id = {g:String}", None, (),
                                              {"n": "node-77", "g": "GPU-77-2"}),
        "enriched_alerts by release_id (bloom)": ("enriched_alerts", "1", "release_id = {r:String}", ("release_id",), {"r": "rel-7"}),
        "gpu_allocations by release_id (bloom)": ("gpu_allocations", "1", "release_id = {r:String}", ("release_id",), {"r": "rel-7"}),
        "correlated_events by release_id (bloom)": ("correlated_events", "1", "release_id = {r:String}", ("release_id",), {"r": "rel-7"}),
    }
    from sinks.read.trace import KEYS, Store

    print(f"\n{'single lookup':42s} {'FINAL median/p90 ms':>22s} {'argMax median/p90 ms':>22s}  rows")
    for name, (table, where, after, after_cols, params) in single.items():
        cols = KEYS[table] + ("version",)
        sf, sa = Store(reader, db, mode="final"), Store(reader, db, mode="argmax")
        f, a = timed_pair(lambda i: sf.latest(table, cols, where, params, after=after, after_columns=after_cols),
                          lambda i: sa.latest(table, cols, where, params, after=after, after_columns=after_cols), args.repeat)
        n = len(sf.latest(table, cols, where, params, after=after, after_columns=after_cols))
        print(f"{name:42s} {f[0]:10.1f} / {f[1]:7.1f}   {a[0]:10.1f} / {a[1]:7.1f}   {n}")


if __name__ == "__main__":
    main()
