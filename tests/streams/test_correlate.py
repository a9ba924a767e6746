"""Release state (manifest + history) is the same whatever order events arrive in; a correlation
batch derives a node/GPU once when it brings the GPU's alert and its new holder together."""

import asyncio
import itertools

from streams.correlate.directory import ReleaseDirectory
from tests.streams.harness import release

EVENTS = [release("release.registered", 0), release("release.approved", 5, actor="alice"),
          release("release.promoted", 10, to_environment="prod"), release("release.rolled_back", 20, to_environment="prod"),
          release("release.registered", 1, rid="r2", version="8", digest="sha256:" + "e" * 64)]


def snapshot(order):
    d = ReleaseDirectory()
    for ev in order:
        d.apply(ev)
    return ({rid: (d.manifest(rid), d.releases[rid]["history"]) for rid in d.releases},
            {k: sorted(v) for k, v in d.by_digest.items() if v}, {k: sorted(v) for k, v in d.by_model.items() if v})


def test_directory_is_order_independent():
    reference = snapshot(EVENTS)
    for perm in itertools.permutations(EVENTS):
        assert snapshot(perm) == reference


def test_state_and_environments_as_of_a_time():
    d = ReleaseDirectory()
    for ev in EVENTS:
        d.apply(ev)
    assert d.state_as_of("r1", "2026-11-01T08:07:00+00:00") == "release.approved"
    assert d.state_as_of("r1", "2026-11-01T07:00:00+00:00") is None
    assert d.environments_at("r1", "2026-11-01T08:15:00+00:00") == ["prod"]
    assert d.environments_at("r1", "2026-11-01T08:25:00+00:00") == []
    assert d.by_model_version("m", "8") == "r2"
    assert d.by_image_digest("sha256:" + "e" * 64) == "r2"


def test_events_of_one_instant_are_in_lifecycle_order_whatever_their_ids():
    """The documented pipeline gives every step one --at: registered, approved and promoted in one
    instant read ``release.approved`` or ``release.registered`` (and the manifest's environment
    staging, not prod) by the hash of the ids — a CI job's id decided it (exploratory review)."""
    from datetime import datetime, timezone

    from producers.releases import COMMANDS, build_event

    command = {c.name: c for c in COMMANDS}
    at = "2026-12-07T09:10:00Z"
    for job in range(1, 9):
        steps = [build_event(command["register"], {"release_id": "relB:1", "model": "m", "version": "1", "artifact_digest": "sha256:" + "a" * 64,
                                                   "env": "staging", "actor": f"ci/{job}", "at": at}),
                 build_event(command["approve"], {"release_id": "relB:1", "actor": "alice", "env": "staging", "at": at}),
                 build_event(command["promote"], {"release_id": "relB:1", "env": "prod", "actor": f"ci/{job}", "at": at})]
        for order in itertools.permutations(steps):
            d = ReleaseDirectory()
            for ev in order:
                d.apply(ev)
            assert d.state_as_of("relB:1", datetime(2026, 12, 7, 9, 10, tzinfo=timezone.utc).isoformat()) == "release.promoted", job
            assert d.manifest("relB:1")["environment"] == "prod", job


def test_reapplying_an_event_changes_nothing():
    d = ReleaseDirectory()
    assert d.apply(EVENTS[0])
    assert d.apply(EVENTS[0]) == []


def test_a_batch_with_a_gpus_alert_and_its_new_holder_derives_the_gpu_once(kafka_bootstrap, settings_for, monkeypatch):
    """The correlation batch (``Correlator.correlate_batch``, through the route stage's packing,
    on the real broker): a GPU's XID alert and the assignment of the pod that now holds the GPU
    arrive in one batch. Node/GPU entities are derived after the batch's other entities, so the
    link the new holder sends is folded in first: the GPU is derived once (not first with its
    previous holder, then again with the link next round) and its alert goes out attributed to
    the new holder."""
    import uuid
    from types import SimpleNamespace

    import orjson

    from producers._kafka import ensure_topics
    from schemas import encode_event
    from schemas.topics import TopicCatalogue
    from streams.app import WorkerContext, ensure_run_topics
    from streams.correlate import agents
    from streams.correlate.route import Router
    from tests.fixtures.kafka import read_topic
    from tests.streams.harness import alert, gpu_event, pod_event

    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=1)  # one partition: every entity of a batch is local
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    settings = settings_for(cat)
    settings.streams.app_id = f"once-{uuid.uuid4().hex[:6]}"
    ensure_run_topics(settings)
    gpu = "gpu:n1/GPU-1111"
    derived: list[str] = []
    real_refresh = agents.refresh

    def refresh(state, directory, **kwargs):
        derived.append(state["key"])
        return real_refresh(state, directory, **kwargs)

    monkeypatch.setattr(agents, "refresh", refresh)

    class Packed:  # what the route stage packs for the route topic (its records, before they are produced)
        def __init__(self) -> None:
            self.records: list = []

        def produce(self, topic, key, value, partition=None, source=None, headers=None) -> None:
            self.records.append(SimpleNamespace(message=SimpleNamespace(topic=topic, partition=partition, offset=len(self.records),
                                                                        key=key, value=value)))

    async def run():
        ctx = WorkerContext(settings)
        for rid in ("r1", "r2"):
            ctx.directory.apply(release("release.registered", 0, rid=rid))
        corr = agents.Correlator(ctx)
        for batch in ([pod_event("scheduler.scheduled", 0, pod="a", release_id="r1"), gpu_event("gpu.assigned", 1, pod="a")],
                      [pod_event("scheduler.scheduled", 9, pod="b", release_id="r2"), gpu_event("gpu.assigned", 10, pod="b"),
                       alert(11, fp="xid-1", node="n1", gpu_id="GPU-1111")]):
            packed = Packed()
            raw = [SimpleNamespace(message=SimpleNamespace(topic=cat.gpu, partition=0, offset=i, key=None, value=encode_event(e)))
                   for i, e in enumerate(batch)]
            await Router(settings, packed).route_batch(raw)
            derived.clear()
            await corr.correlate_batch(packed.records)
        await ctx.output.flush()
        ctx.output.close()
        return list(derived)

    second_batch = asyncio.run(run())
    assert second_batch.count(gpu) == 1, second_batch
    rows = [orjson.loads(m.value()) for m in read_topic(kafka_bootstrap, settings.kafka.catalogue().run(settings.streams.app_id).correlated, 5)]
    xid = max((r for r in rows if r["identity"].get("alert_fingerprint") == "xid-1"), key=lambda r: r["version"])
    assert (xid["identity"]["pod"], xid["identity"]["release_id"], xid["attribution"]) == ("b", "r2", "gpu_assignment")
    assert sum(1 for r in rows if r["identity"].get("alert_fingerprint") == "xid-1") == 1  # emitted once


def test_routed_rows_and_routed_events_correlate_alike(kafka_bootstrap, settings_for):
    """The route stage builds each event's row itself (``entities.event_row``: the correlation
    process only folds it in); a route topic written before that carries the events, which the
    correlation stage still folds (building the row itself). The same raw events either way — the bench
    mix, through ``Router`` on one side and the old packing on the other, on the real broker —
    leave identical entity states and identical correlated records."""
    import uuid
    from types import SimpleNamespace

    import orjson

    from benchmarks.mix import events as mix_events
    from producers._kafka import ensure_topics
    from schemas import decode_event, encode_event
    from schemas.topics import TopicCatalogue
    from streams.app import WorkerContext, ensure_run_topics
    from streams.correlate import agents
    from streams.correlate.route import Router
    from streams.correlate.routing import entity_key, routed_event
    from streams.packing import Packer
    from tests.fixtures.kafka import read_topic

    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=2)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    mix = list(mix_events(600))

    class Packed:  # the route records as produced (before they reach the broker)
        def __init__(self) -> None:
            self.records: list = []

        def produce(self, topic, key, value, partition=None, source=None, headers=None) -> None:
            self.records.append(SimpleNamespace(message=SimpleNamespace(topic=topic, partition=partition, offset=len(self.records),
                                                                        key=key, value=value)))

    def raw(batch, start):
        return [SimpleNamespace(message=SimpleNamespace(topic=cat.gpu, partition=0, offset=start + i, key=None, value=encode_event(e)))
                for i, e in enumerate(batch)]

    async def correlate(settings, legacy: bool):
        ctx = WorkerContext(settings)
        for e in mix:
            if e.event_type.startswith("release."):
                ctx.directory.apply(e)
        corr = agents.Correlator(ctx)
        corr.store.start_empty(range(ctx.run.partitions))
        for start in range(0, len(mix), 100):
            packed = Packed()
            if legacy:  # what the route stage packed before it built the rows
                packer = Packer(ctx.run.route, ctx.run.partitions)
                for m in raw(mix[start:start + 100], start):
                    event = decode_event(m.message.value)
                    src = [m.message.topic, m.message.partition, m.message.offset]
                    packer.add(entity_key(event), {"k": "event", "src": src, "event": routed_event(event)})
                packer.drain_into(packed)
            else:
                await Router(settings, packed).route_batch(raw(mix[start:start + 100], start))
            await corr.correlate_batch(packed.records)
        await ctx.output.flush()
        ctx.output.close()
        return {key: orjson.dumps(state, option=orjson.OPT_SORT_KEYS) for _p, key, state in corr.store.items()}

    results = []
    for legacy in (False, True):
        settings = settings_for(cat)
        settings.streams.app_id = f"alike-{uuid.uuid4().hex[:6]}"
        ensure_run_topics(settings)
        states = asyncio.run(correlate(settings, legacy))
        topic = settings.kafka.catalogue().run(settings.streams.app_id).correlated
        records = sorted(m.value() for m in read_topic(kafka_bootstrap, topic, 600))
        results.append((states, records))
    (states, records), (old_states, old_records) = results
    assert len(states) > 100 and len(records) >= 600
    assert states == old_states
    assert records == old_records


def test_the_summed_versions_of_a_set_of_releases_are_their_versions_summed_one_by_one():
    """``ReleaseDirectory.versions_at`` (a node/GPU row's releases, merged and kept per set until
    the next release event) answers as ``version_at`` summed release by release: sets small and
    large, with a release no event describes, at times before, between and after the events —
    and again after each new release event changes the histories it merged."""
    import random

    from tests.streams.harness import at

    rng = random.Random(11)
    kinds = ["release.registered", "release.approved", "release.promoted", "release.rolled_back", "release.retired"]
    events = [release(kind, rng.randint(0, 120), rid=f"r{n}", version=str(n), digest=f"sha256:{n:064x}",
                      **({"to_environment": "prod"} if kind in ("release.promoted", "release.rolled_back") else {}))
              for n in range(8) for kind in rng.sample(kinds, rng.randint(1, 4))]
    rng.shuffle(events)
    d = ReleaseDirectory()
    sets = [(), ("r1",), ("r0", "r1", "r2"), tuple(f"r{n}" for n in range(8)), ("r1", "r3", "r5", "r7", "r-unknown"),
            tuple(f"r{n}" for n in range(2, 7))]
    checked = 0
    for event in events:
        d.apply(event)
        for rids in sets:
            for when in [at(minutes).isoformat() for minutes in range(-5, 130, 9)] + [None]:  # (None: the manifests' versions)
                assert d.versions_at(rids, when) == sum(d.version_at(rid, when) for rid in rids), (rids, when)
                checked += 1
    assert checked > 1000 and d.versions_at(sets[3], at(200).isoformat()) > 2 * len(events)
