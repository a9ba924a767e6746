"""CPU per input event of the engine's own logic, for developing it: not the benchmark of record.

    .venv/bin/python benchmarks/engine_cpu.py [events=20000] [batch=1000]
    REPO=/path/to/other/checkout EVERY=2 ...   # A/B another checkout; commit every EVERY batches

Runs the bench mix (benchmarks/mix.py) through the real batch logic of the three stages —
``Router.route_batch`` → ``Correlator.correlate_batch`` → ``Controller.evaluate_batch``,
with epoch commits (the controls' violations produced, the changelogs written:
``Controller.emit_violations``, ``PartitionStore.write_changes``) — in one
process, with the internal hops (route, controls) handed from stage to stage in memory
and every other record counted and digested instead of sent. No broker, no Faust, no
sink: what is left is exactly the CPU the engine's own code costs per event, measured
as process time, which a shared or loaded machine disturbs much less than the wall-clock
rates ``make bench`` measures (that one, against the real broker and the Faust
pass-through, is the benchmark of record). Prints ms/event per stage, records and bytes per
input per topic, the entity states' encoded sizes by kind (a cost that grows with history
shows here, in the marginal cost per fifth of the run printed as it goes) and an order-free digest of each output topic (two checkouts that must give the
same outputs must print the same digests). Run it under ``py-spy record`` for a profile.
"""
import asyncio, collections, gc, hashlib, os, sys, time
import orjson
from pathlib import Path

sys.path.insert(0, os.environ.get("REPO", str(Path(__file__).resolve().parent.parent)))
from benchmarks.mix import events as mix_events
from schemas import encode_event
from gpuledger.settings import Settings

class Out:
    def __init__(self):
        self.recs = collections.defaultdict(list); self.produced = collections.Counter(); self.bytes = collections.Counter(); self.dead_letters = 0
        self.sums = collections.defaultdict(int); self.latest = {}
    def track(self, topic):  # (a store counts its changelog writes for its snapshots: never saved here)
        from streams.snapshot import ChangelogAcks
        return ChangelogAcks()
    def produce(self, topic, key, value, partition=None, source=None, headers=None):
        self.produced[topic] += 1; self.bytes[topic] += len(value or b"")
        if topic.endswith((".route.v1", ".controls.v1")) and "changelog" not in topic:
            self.recs[topic].append((partition, key, value))
        elif "changelog" not in topic:
            self.sums[topic] ^= int.from_bytes(hashlib.blake2b((key or b"") + b"|" + value, digest_size=8).digest(), "big")
            if topic.endswith(".violations.v1"):  # what the table keeps: the highest version of each violation id
                version = orjson.loads(value)["version"]
                if key not in self.latest or version > self.latest[key][0]:
                    self.latest[key] = (version, value)
    async def flush(self): return None
    def take(self, topic):
        r = self.recs.pop(topic, []); return r

class Msg:
    __slots__ = ("topic", "partition", "offset", "value", "key")
    def __init__(self, t, p, o, k, v): self.topic, self.partition, self.offset, self.key, self.value = t, p, o, k, v
class Ev:
    __slots__ = ("message",)
    def __init__(self, m): self.message = m

EVERY = int(os.environ.get("EVERY", "2"))

async def main(n, batch):
    from streams.app import WorkerContext
    s = Settings()
    ctx = WorkerContext.__new__(WorkerContext)
    ctx.settings = s; ctx.catalogue = s.kafka.catalogue(); ctx.run = ctx.catalogue.run(s.streams.app_id)
    ctx.output = Out(); from streams.correlate.directory import ReleaseDirectory
    ctx.directory = ReleaseDirectory(); ctx.stats = {}; ctx._counters = {}; ctx.fault = lambda stage, point: None; ctx.epochs = {}; ctx.app = None
    ctx.consumer_config = {}
    from streams.correlate.agents import Correlator
    from streams.controls.agents import Controller
    corr = Correlator(ctx); ctrl = Controller(ctx)
    from gpuledger import gctune
    try:  # the route stage's own process since 2026-12 (streams.correlate.route); before, the Correlator's
        from streams.correlate.route import Router
        route = Router(s, ctx.output).route_batch
    except ImportError:
        ctx._fault = None; route = corr.route_batch
    for st in (corr.store, ctrl.store):
        st.start_empty(range(ctx.run.partitions))
    evs = list(mix_events(n))
    raw = [(e, encode_event(e)) for e in evs]
    for e, _ in raw:
        if e.event_type.startswith("release."): ctx.directory.apply(e)
    ctx.directory.ready.set()
    run = ctx.run
    t0 = time.process_time(); w0 = time.perf_counter()
    stage = collections.Counter()
    off = 0
    def wrap(topic, recs):
        nonlocal off
        out = []
        for p, k, v in recs:
            off += 1; out.append(Ev(Msg(topic, p or 0, off, k, v)))
        return out
    SEG = max(batch, n // 5 // batch * batch)  # marginal cost per fifth of the run: a cost that grows with history shows as a rising row
    seg_t, seg_stage = time.process_time(), collections.Counter()
    for i in range(0, len(raw), batch):
        if i and i % SEG == 0:
            now = time.process_time()
            print(f"  events {i - SEG:>7}-{i:<7} {1e3 * (now - seg_t) / SEG:.3f} ms/event",
                  {k: round(1e3 * (v - seg_stage[k]) / SEG, 3) for k, v in stage.items()}, flush=True)
            seg_t, seg_stage = now, collections.Counter(stage)
        chunk = [Ev(Msg("raw", 0, j, None, v)) for j, (_, v) in enumerate(raw[i:i+batch], start=i)]
        a = time.process_time(); await route(chunk); stage["route"] += time.process_time() - a
        # drain internal hops until quiet
        for _ in range(6):
            r = ctx.output.take(run.route)
            if r:
                a = time.process_time(); await corr.correlate_batch(wrap(run.route, r)); stage["correlate"] += time.process_time() - a
            c = ctx.output.take(run.controls)
            if c:
                a = time.process_time(); await ctrl.evaluate_batch(wrap(run.controls, c)); stage["controls"] += time.process_time() - a
            if not r and not c: break
        if (i // batch) % EVERY == EVERY - 1:  # an epoch commit every EVERY batches
            a = time.process_time(); ctrl.emit_violations(); corr.store.write_changes(ctx.output); ctrl.store.write_changes(ctx.output); stage["commit"] += time.process_time() - a
            gctune.freeze()  # as the worker's epoch commit does
    a = time.process_time(); ctrl.emit_violations(); corr.store.write_changes(ctx.output); ctrl.store.write_changes(ctx.output); stage["commit"] += time.process_time() - a
    cpu = time.process_time() - t0
    prod = ctx.output.produced
    print(f"events {n} batch {batch}: cpu {cpu:.2f}s = {1e3*cpu/n:.3f} ms/event; wall {time.perf_counter()-w0:.2f}s; gc {gc.get_threshold()} {gctune.stats()}")
    print("  stages ms/event:", {k: round(1e3*v/n, 3) for k, v in stage.items()})
    print("  records/input:", round(sum(prod.values())/n, 2), {t.split('.')[-2]: round(v/n, 2) for t, v in sorted(prod.items())})
    print("  bytes/input:", {t.split('.')[-2]: round(v/n) for t, v in sorted(ctx.output.bytes.items())})
    sizes = collections.defaultdict(list)
    for _p, key, state in corr.store.items(): sizes[key.split(":", 1)[0]].append(len(orjson.dumps(state)))
    print("  entity state bytes (n, mean, max):", {k: (len(v), sum(v) // len(v), max(v)) for k, v in sorted(sizes.items())})
    print("  outputs digest (order-free)", {t.split('.')[-2]: f"{v:016x}" for t, v in sorted(ctx.output.sums.items())})
    latest = 0
    for key, (_version, value) in ctx.output.latest.items():
        latest ^= int.from_bytes(hashlib.blake2b(key + b"|" + value, digest_size=8).digest(), "big")
    print(f"  violations, latest version of each id (order-free): {latest:016x} ({len(ctx.output.latest)} ids)")

if __name__ == "__main__":
    from gpuledger import gctune

    gctune.tune(int(os.environ.get("GEN0", gctune.GEN0_STATEFUL)))  # as the worker does
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000, int(sys.argv[2]) if len(sys.argv) > 2 else 1000))
