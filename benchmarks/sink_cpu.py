"""CPU per record of the sink's own work, for developing it: not the benchmark of record.

    .venv/bin/python benchmarks/sink_cpu.py [events=20000] [batch=6000]
    REPO=/path/to/other/checkout ...   # A/B another checkout

Runs the bench mix (benchmarks/mix.py) through the engine in memory (as
``benchmarks/engine_cpu.py`` does) to get the records a worker would put on its
correlated and allocations topics, then stores them — with the raw records — into a fresh
embedded store through the sink's real batch logic (``sinks.agents.SinkLoop.store``:
decoding, the rows of every table, the chDB inserts), in batches of ``batch`` records
mixed as a live sink's are. No broker: what is measured is the process's CPU time (every
thread: the store engine's too) per input event and per stored record, which a loaded
machine disturbs much less than ``make bench``'s wall-clock figures. Prints the row
counts of every table, so two checkouts that must store the same rows can be compared.
"""
import asyncio
import collections
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("REPO", str(Path(__file__).resolve().parent.parent)))

from benchmarks import engine_cpu  # noqa: E402
from benchmarks.mix import events as mix_events  # noqa: E402
from schemas import encode_event  # noqa: E402


def engine_outputs(n: int) -> dict[str, list[tuple[bytes | None, bytes]]]:
    """topic -> (key, value) of every record the engine produced for ``n`` bench events."""
    kept: dict[str, list] = collections.defaultdict(list)
    produce = engine_cpu.Out.produce

    def keep(self, topic, key, value, partition=None, source=None, headers=None):
        if topic.endswith((".correlated.v1", ".allocations.v1")):
            kept[topic].append((key, value))
        return produce(self, topic, key, value, partition, source, headers)

    engine_cpu.Out.produce = keep
    with contextlib.redirect_stdout(io.StringIO()):
        asyncio.run(engine_cpu.main(n, 1000))
    engine_cpu.Out.produce = produce
    return kept


class NoKafka:
    """What ``SinkLoop.store`` needs of its process (``sinks.service.SinkContext``) without a
    producer: the mix has no dead letters, and one would fail the run here."""

    def __init__(self, settings) -> None:
        self.run = settings.kafka.catalogue().run(settings.streams.app_id)
        self.stats = collections.Counter()
        self.output = self

    def produce(self, topic, key, value, partition=None, source=None, headers=None):
        raise AssertionError(f"a dead letter for {topic}: the bench mix should store whole")

    async def flush(self, mark=None):
        return None


async def store_all(records: list, batch: int, data_dir: str) -> tuple[float, float, dict]:
    from gpuledger.settings import Settings
    from sinks.agents import SinkLoop, SinkWriters
    from sinks.clickhouse import migrated_store
    from sinks.service import sink_topics

    os.environ["GPULEDGER_CLICKHOUSE_DSN"] = f"chdb://{data_dir}"
    settings = Settings()
    conf = settings.clickhouse
    store = migrated_store(settings.clickhouse_dsn, conf.database, conf.cluster, conf.ttl_days)
    store.get()  # connect and migrate before measuring
    ctx = NoKafka(settings)
    ctx.sinks = SinkWriters(store, conf.database, conf.cluster)
    loop = SinkLoop.__new__(SinkLoop)  # the batch logic without its consumer
    topics = sink_topics(settings)
    loop.ctx, loop.sinks, loop.topics, loop._shapes, loop.in_range = ctx, ctx.sinks, topics, {}, settings.streams.in_range
    loop.kind = {name: kind for kind, names in topics.items() for name in names}
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(0, len(records), batch):
        await loop.store(records[i:i + batch])
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    client = store.get()
    from sinks.migrations import table_names

    counts = {t: client.command(f"SELECT count() FROM {conf.database}.{t}") for t in sorted(table_names())}
    client.close()
    return cpu, wall, counts


def main(n: int, batch: int) -> None:
    """(The records are engine_cpu's ``Msg``: what ``SinkLoop.store`` reads of a consumed message,
    ``sinks.agents._Record``.)"""
    from gpuledger.settings import Settings

    raw_topic = Settings().kafka.catalogue().raw_topics[0]
    outputs = engine_outputs(n)
    # Interleave as a live sink sees them: each input event's raw record, then the outputs,
    # spread evenly (the proportions are the engine's).
    streams = [[(raw_topic, None, encode_event(e)) for e in mix_events(n)]]
    for topic, recs in outputs.items():
        streams.append([(topic, k, v) for k, v in recs])
    merged = sorted(((j / len(s), t, k, v) for s in streams for j, (t, k, v) in enumerate(s)), key=lambda r: r[0])
    records = [engine_cpu.Msg(t, 0, i, k, v) for i, (_pos, t, k, v) in enumerate(merged)]
    by_topic = collections.Counter(r.topic.rsplit(".", 2)[-2] for r in records)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:  # (the engine may still be merging)
        cpu, wall, counts = asyncio.run(store_all(records, batch, tmp))
    print(f"events {n}, records {len(records)} {dict(by_topic)}, batches of {batch}")
    print(f"  cpu {cpu:.2f}s = {1e3 * cpu / n:.4f} ms/event, {1e6 * cpu / len(records):.1f} us/record; wall {wall:.2f}s")
    print(f"  rows: {counts}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000, int(sys.argv[2]) if len(sys.argv) > 2 else 6000)
