"""The fault tier: crashes at every point of a batch heal to the tables of an
uninterrupted run, and replays rebuild them identically — on the real broker, the
real worker and the real embedded ClickHouse.

One history (a GPU fleet's releases, pods, allocations and alerts, plus the control
scenario of test_controls.py) is published once per test. A reference worker runs it
without interruption; then workers are killed (``GPULEDGER_STREAMS_FAULT``: the
process ends at once, as kill -9 would) at a chosen point of a chosen batch — before
the batch produced anything, while its outputs are in flight, after they were
acknowledged but before the state was written, after the state was written but
before the batch was acked — and restarted on the same data dir and consumer group; and
the route stage's process after its routed records were acknowledged but before its
offsets were committed (the worker restarts it).
Every table, compared by checksum over FINAL (``sinks.checksum``), must end identical
to the reference's, versions included.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from gpuledger.dev.process import ServiceProcess, wait_for_worker
from producers._kafka import EventPublisher
from schemas import AlertEvent, GpuEvent, Identity, ReleaseEvent, SchedulerEvent, Source, make_event_id
from schemas.alert import AlertPayload
from schemas.gpu import GpuPayload
from schemas.release import ReleasePayload
from schemas.scheduler import SchedulerPayload
from sinks.read.query import RemoteReader, owner_file
from streams.progress import RunProgress, wait_caught_up, worker_health
from tests.fixtures.kafka import read_topic
from tests.streams.test_controls import FIRST, SECOND

pytestmark = pytest.mark.timeout(900)

SRC = Source(collector="fault-test")
T0 = datetime(2026, 11, 1, 6, tzinfo=timezone.utc)
# Small batches and packs: the ~1,000 events make many batches, so a fault at the Nth
# batch falls in the middle of the run, with state already durable before it.
ENV = {"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "1", "GPULEDGER_STREAMS_COMMIT_INTERVAL_S": "0.1", "GPULEDGER_STREAMS_BATCH_MAX": "10", "GPULEDGER_STREAMS_PACK_MAX": "10",
       "GPULEDGER_STREAMS_PACKED_BATCH_MESSAGES": "10",
       # a node/GPU's 5-6 alerts and holders go in sealed changelog chunks (streams.store.Chunks) that crashes cut between
       "GPULEDGER_STREAMS_STATE_CHUNK": "2", "GPULEDGER_STREAMS_STATE_CHUNK_FROM": "2",
       "GPULEDGER_CLICKHOUSE_BATCH_SECONDS": "0.2",
       # An epoch commit at least every 50 input records as well as every 0.1 s: a stage that
       # went through its input fast (the controls process, once its collections got cheaper,
       # in three commits on a loaded machine) still commits often enough to crash mid-run.
       "GPULEDGER_STREAMS_COMMIT_MAX_RECORDS": "50",
       # The controls process at the worker's priority: at its default niceness a loaded machine
       # (the suite's other tests) starved it until the correlation was done, and it then went
       # through its input in 0.4 s — four commits, too few to crash one in the middle.
       "GPULEDGER_STREAMS_CONTROLS_NICE": "0"}


def fleet(pods: int = 220) -> list:
    """Releases, then pods that are scheduled, get a GPU, raise alerts, and some release
    their GPU to the next pod; alerts on GPUs join by time (as-of)."""
    out = []
    for r in range(6):
        at = T0 + timedelta(seconds=r)
        ident = Identity(release_id=f"fr-{r}", model_name=f"fm{r % 3}", model_version=str(r), image_digest=f"sha256:{r:064x}",
                         owner=f"team-{r % 2}", environment="prod")
        for i, etype in enumerate(("release.registered", "release.approved", "release.promoted")):
            out.append(ReleaseEvent(event_id=make_event_id("f", (r, etype)), event_type=etype, occurred_at=at + timedelta(minutes=i),
                                    observed_at=at, source=SRC, identity=ident,
                                    payload=ReleasePayload(actor="alice", to_environment="prod" if etype == "release.promoted" else None)))
    for p in range(pods):
        ns, pod, node, gpu = "fleet", f"fp-{p}", f"fn{p % 8}", f"GPU-F{p % 40:04d}"
        at = T0 + timedelta(minutes=10, seconds=7 * p)
        labelled = f"fr-{p % 6}" if p % 3 else None
        out.append(SchedulerEvent(event_id=make_event_id("f", (p, "sched")), event_type="scheduler.scheduled", occurred_at=at, observed_at=at,
                                  source=SRC, identity=Identity(namespace=ns, pod=pod, workload_id=f"fleet/Job/j{p // 4}", node=node,
                                                                release_id=labelled),
                                  payload=SchedulerPayload(object_kind="Pod", image_digests=(f"sha256:{p % 6:064x}",))))
        out.append(GpuEvent(event_id=make_event_id("f", (p, "gpu")), event_type="gpu.assigned", occurred_at=at + timedelta(seconds=1),
                            observed_at=at, source=SRC, identity=Identity(namespace=ns, pod=pod, node=node, gpu_id=gpu),
                            payload=GpuPayload(node=node, namespace=ns, pod=pod, container="main", device_id=gpu, gpu=gpu)))
        out.append(AlertEvent(event_id=make_event_id("f", (p, "q")), event_type="alert.firing", occurred_at=at + timedelta(seconds=2),
                              observed_at=at, source=SRC, identity=Identity(alert_fingerprint=f"fq{p}", namespace=ns, pod=pod),
                              payload=AlertPayload(alertname="Quality", starts_at=at + timedelta(seconds=2))))
        out.append(AlertEvent(event_id=make_event_id("f", (p, "x")), event_type="alert.firing", occurred_at=at + timedelta(seconds=3),
                              observed_at=at, source=SRC, identity=Identity(alert_fingerprint=f"fx{p}", node=node, gpu_id=gpu),
                              payload=AlertPayload(alertname="XID", starts_at=at + timedelta(seconds=3))))
        if p % 2:
            out.append(GpuEvent(event_id=make_event_id("f", (p, "rel")), event_type="gpu.released", occurred_at=at + timedelta(seconds=5),
                                observed_at=at, source=SRC, identity=Identity(namespace=ns, pod=pod, node=node, gpu_id=gpu),
                                payload=GpuPayload(node=node, namespace=ns, pod=pod, container="main", device_id=gpu, gpu=gpu)))
    return out + FIRST + SECOND


class Run:
    """A worker run (app id, data dir): start, wait until the history is fully
    processed, stop, and read every table's checksum."""

    def __init__(self, bootstrap, catalogue, tmp_path, app_id: str) -> None:
        self.bootstrap, self.cat, self.app_id = bootstrap, catalogue, app_id
        self.data = tmp_path / app_id
        self.dsn = f"chdb://{self.data / 'clickhouse'}"
        self.service: ServiceProcess | None = None

    def start(self, fault: str | None = None) -> Run:
        env = {"GPULEDGER_KAFKA_BOOTSTRAP": self.bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": self.cat.prefix,
               "GPULEDGER_KAFKA_RAW_PARTITIONS": str(self.cat.raw_partitions), "GPULEDGER_DATA_DIR": str(self.data),
               "GPULEDGER_CLICKHOUSE_DSN": self.dsn, "GPULEDGER_STREAMS_APP_ID": self.app_id, **ENV}
        if fault:
            env["GPULEDGER_STREAMS_FAULT"] = fault
        self.service = ServiceProcess(["-v", "worker"], env, self.data / "worker.log").start()
        return self

    def wait_crashed(self, timeout: float = 180) -> int:
        deadline = time.monotonic() + timeout
        while self.service.alive():
            if time.monotonic() >= deadline:
                tail = self.service.log_tail()
                self.service.stop(grace=10)  # a failed test must not leave its worker running
                pytest.fail(f"the fault never fired:\n{tail}")
            time.sleep(0.2)
        return self.service.proc.returncode

    def wait_child_restarted(self, child: str, timeout: float = 180) -> dict:
        """Until the worker's health page shows ``child`` (a child process) restarted and
        answering again; its part of the page."""
        deadline = time.monotonic() + timeout
        while True:
            page = self.health().get(child, {})
            if page.get("restarts", 0) >= 1 and page.get("answering"):
                return page
            if time.monotonic() >= deadline:
                tail = self.service.log_tail()
                self.service.stop(grace=10)
                pytest.fail(f"the {child} process was not restarted: {page}\n{tail}")
            time.sleep(0.2)

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url()}/gpuledger/health/", timeout=5) as resp:
            return json.loads(resp.read())

    def url(self) -> str:
        return wait_for_worker(self.service, owner_file(self.dsn), timeout=120)

    def stored(self) -> int:
        return RemoteReader.from_owner(owner_file(self.dsn)).query("SELECT count() AS n FROM gpuledger.correlated_events FINAL").dicts()[0]["n"]

    def wait_done(self, expected_rows: int, timeout: float = 240) -> dict:
        """Until the run has caught up (``streams.progress.wait_caught_up``: both of its
        groups committed everything they read, nothing parked, twice in a row a second
        apart) and every input is stored."""
        with RunProgress({"bootstrap.servers": self.bootstrap}, self.cat, self.app_id) as progress:
            try:
                wait_caught_up(progress, lambda: worker_health(self.url()), timeout=timeout)
            except TimeoutError as exc:
                tail = self.service.log_tail()
                self.service.stop(grace=10)
                pytest.fail(f"{exc}\n{tail}")
        assert self.stored() >= expected_rows
        return self.health()

    @contextmanager
    def stopped_on_failure(self):
        """A failed check must not leave the run's worker running (it would load the machine
        for every test after it)."""
        try:
            yield
        except BaseException:
            self.service.stop(grace=10)
            raise

    def stop_and_checksum(self) -> dict:
        assert self.service.stop(grace=30) == 0, self.service.log_tail()
        out = subprocess.run([sys.executable, "-m", "sinks.checksum", self.dsn], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def history(kafka_bootstrap):
    from schemas.topics import TopicCatalogue
    from producers._kafka import ensure_topics

    cat = TopicCatalogue(prefix=f"fault{uuid.uuid4().hex[:6]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    events = fleet()
    EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "test").publish_batch(events)
    return cat, len(events)


@dataclass
class Reference:
    sums: dict
    health: dict
    run: Run


@pytest.fixture(scope="module")
def reference(kafka_bootstrap, history, tmp_path_factory):
    cat, n = history
    run = Run(kafka_bootstrap, cat, tmp_path_factory.mktemp("reference"), f"{cat.prefix}-reference").start()
    with run.stopped_on_failure():
        health = run.wait_done(n)
        assert health["status"] == "ok", health
        assert health["stats"]["conflicts"] == 0 and health["stats"]["control_conflicts"] == 0
    sums = run.stop_and_checksum()
    assert sums["correlated_events"][0] == n and sums["violations"][0] >= 4 and sums["gpu_allocations"][0] > 100
    return Reference(sums, health, run)


def test_a_state_is_written_once_per_epoch_however_many_batches_touched_it(kafka_bootstrap, reference):
    """Batches do not wait for acks; the epoch commit writes each changed state once
    (streams/runner.py). Many batches per commit, and no key's changelog holds more
    records than there were commits."""
    run = reference.run
    for agent, changelog in (("correlate_entities", "entities-changelog"), ("evaluate_controls", "controls-changelog")):
        epoch = reference.health["epochs"][agent]
        assert epoch["batches"] > 2 * epoch["commits"] > 0, epoch
        assert epoch["pending"] == 0 and epoch["acked"] > 0, epoch
        records = read_topic(kafka_bootstrap, f"{run.cat.prefix}.{run.app_id}.{changelog}.v1", min_count=1)
        # per partition: the release-directory mark (``~directory``) is one key in every partition
        per_key = Counter((m.partition(), m.key()) for m in records)
        assert max(per_key.values()) <= epoch["commits"], (agent, per_key.most_common(3), epoch)


def test_the_worker_and_its_children_run_with_the_tuned_garbage_collector(reference):
    """gpuledger.gctune: the four processes' health pages (worker, route, controls, sink) show
    the raised thresholds (higher in the two that freeze after every epoch commit), and the sink's the young collections it ran (and the seconds spent
    in them, the unreachable objects they freed; the route stage keeps too little alive to
    need one in a run this small). The worker froze what its epoch commits left alive
    (``gctune.freeze``), collecting first — full collections, which nothing else runs in a
    run this small (an automatic one takes 1,000 young ones)."""
    from gpuledger import gctune

    tuned, stateful = [gctune.GEN0, gctune.GEN1, gctune.GEN2], [gctune.GEN0_STATEFUL, gctune.GEN1, gctune.GEN2]
    assert reference.health["route"]["gc"]["thresholds"] == tuned, reference.health["route"]
    sink = reference.health["sink"]["gc"]
    assert sink["thresholds"] == tuned and sink["collections"][0] > 0 and sink["seconds"] >= 0 and sink["collected"] >= 0, sink
    assert reference.health["gc"]["thresholds"] == stateful, reference.health["gc"]
    assert reference.health["controls"]["gc"]["thresholds"] == stateful, reference.health["controls"]
    assert reference.health["gc"]["collections"][2] >= 1, reference.health["gc"]
    assert reference.health["stores"]["entities"]["recovered_records"] == 0, reference.health["stores"]


def test_a_replay_rebuilds_every_table_identically(kafka_bootstrap, history, reference, tmp_path):
    cat, n = history
    replay = Run(kafka_bootstrap, cat, tmp_path, f"{cat.prefix}-replay").start()
    replay.wait_done(n)
    assert replay.stop_and_checksum() == reference.sums


# A commit-point fault counts the stage's epoch commits (every 0.1 s here): the reference run's
# correlation and controls stages commit about ten times each (~90 batches per commit), so the
# crash comes at the third (the controls' at the second: in a process of their own they went
# through their input in as few as four commits on a loaded machine), mid-run, with state
# already durable. At 0.25 s they committed about six times, and a faster machine would have
# brought the third near the end; the test checks
# the reference's count first, so too few commits fail with that count, not with a fault that
# never fired.
@pytest.mark.parametrize("fault", ["route:after_outputs:1", "correlate:before_outputs:3", "correlate:during_outputs:4", "correlate:after_outputs:3",
                                   "correlate:after_changelog:3", "controls:during_outputs:2", "controls:after_outputs:2"])
def test_a_crash_at_any_point_of_a_batch_heals_to_the_uninterrupted_tables(kafka_bootstrap, history, reference, tmp_path, fault):
    cat, n = history
    stage, point, nth = fault.split(":")
    if point in ("after_outputs", "after_changelog") and stage != "route":
        # A commit-point fault counts the stage's epoch commits, which come by time: the
        # uninterrupted run must have committed at least twice more, or the crash would fall
        # at the end of the run (or never come) rather than in its middle.
        agent = {"correlate": "correlate_entities", "controls": "evaluate_controls"}[stage]
        commits = reference.health["epochs"][agent]["commits"]
        assert commits >= int(nth) + 2, f"the reference run's {agent} committed {commits} time(s): too few for {fault}"
    run = Run(kafka_bootstrap, cat, tmp_path, f"{cat.prefix}-{fault.replace(':', '-').replace('_', '-')}")
    if stage in ("route", "controls"):
        # The route and controls stages are child processes of the worker
        # (streams.correlate.route, streams.controls.service): one ends alone, and the worker
        # starts a new one (without the fault: gpuledger.child).
        run.start(fault)
        with run.stopped_on_failure():
            assert run.wait_child_restarted(stage)["last_exit"] == 137
    else:
        assert run.start(fault).wait_crashed() == 137
        run.start()  # same data dir, same consumer group: state from the changelogs
    with run.stopped_on_failure():
        health = run.wait_done(n)
        # the same entities and control keys as the uninterrupted run (the restart recovered
        # what the crashed run wrote, and found nothing it had not) — but for the controls'
        # alert keys: a fingerprint has one once one of its rows went out unjoined
        # (streams.correlate.entities.for_controls), which on a loaded machine happens to
        # some alerts whose parked rows expired before their pod or GPU holder was read, and
        # is a matter of timing (their violations are judged on the latest rows either way:
        # the checksums below)
        assert health["stores"]["entities"]["keys"] == reference.health["stores"]["entities"]["keys"] > 0, health["stores"]
        kinds, want = health["stores"]["controls"]["kinds"], reference.health["stores"]["controls"]["kinds"]
        assert {k: n for k, n in kinds.items() if k != "alert"} == {k: n for k, n in want.items() if k != "alert"}, (kinds, want)
        if fault.startswith("correlate:after_changelog"):
            assert health["stores"]["entities"]["recovered_records"] > 0, health["stores"]
    assert run.stop_and_checksum() == reference.sums


def test_a_release_changed_while_the_worker_was_down_re_derives_only_its_dependents(kafka_bootstrap, tmp_path):
    """The directory's load at start does not re-derive every entity: each partition's
    changelog marks the release event counts its refreshes covered (``DIRECTORY_MARK``), and a
    restarted worker refreshes the dependents of the releases that changed since — ending with
    the tables of a run that saw every event without stopping."""
    from producers._kafka import ensure_topics
    from schemas.topics import TopicCatalogue

    cat = TopicCatalogue(prefix=f"down{uuid.uuid4().hex[:6]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    first = fleet(pods=120)
    # while the worker is down: a release approved and promoted for fr-1's image digest
    # (the newest promoted release of a digest is what its unlabelled pods resolve to)
    at = T0 + timedelta(hours=2)
    ident = Identity(release_id="fr-new", model_name="fm1", model_version="9", image_digest=f"sha256:{1:064x}", owner="team-1",
                     environment="prod")
    later = [ReleaseEvent(event_id=make_event_id("f", ("fr-new", etype)), event_type=etype, occurred_at=at + timedelta(minutes=i),
                          observed_at=at, source=SRC, identity=ident,
                          payload=ReleasePayload(actor="alice", to_environment="prod" if etype == "release.promoted" else None))
             for i, etype in enumerate(("release.registered", "release.approved", "release.promoted"))]
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "test")
    publisher.publish_batch(first)

    run = Run(kafka_bootstrap, cat, tmp_path, f"{cat.prefix}-restarted").start()
    entities = run.wait_done(len(first))["stats"]["entities"]
    assert run.stop_and_checksum()["correlated_events"][0] == len(first)
    publisher.publish_batch(later)
    run.start()
    with run.stopped_on_failure():
        health = run.wait_done(len(first) + len(later))
        refreshed = health["stats"].get("catch_up_refreshes", 0)
        assert 0 < refreshed < entities / 4, (refreshed, entities)  # fr-1's dependents, not every entity
        ticks, keys = health["stats"].get("control_catch_up_ticks", 0), health["stats"]["controls_keys"]
        assert ticks < keys / 4, (ticks, keys)  # the controls too: only what depends on a changed release
    restarted = run.stop_and_checksum()

    reference = Run(kafka_bootstrap, cat, tmp_path, f"{cat.prefix}-straight").start()
    reference.wait_done(len(first) + len(later))
    assert restarted == reference.stop_and_checksum()


def _snapshots(health: dict) -> dict:
    return {name: store["snapshots"] for name, store in health["stores"].items()}


def test_a_clean_stop_mid_run_restarts_from_local_snapshots_and_heals_to_the_uninterrupted_tables(kafka_bootstrap, tmp_path):
    """SIGTERM in the middle of a history: both stateful stages write their partitions' state to
    local snapshots (streams.snapshot). The next start crashes (kill -9 after its second changelog
    write), so the one after it takes those snapshots plus the changelog records the crashed run
    wrote after them — and ends with the uninterrupted run's tables. A clean stop then snapshots
    the whole history, and a restart reads not one changelog record: the same tables again.

    Its own topics, the history published in two halves around the stop: with the module's
    (published whole), a loaded machine's slow child start-up (the stop waits for the controls
    stage's first input) let the correlation finish before the stop — CI once — and the crashing
    run then had nothing to write, so its fault never fired."""
    from producers._kafka import ensure_topics
    from schemas.topics import TopicCatalogue

    cat = TopicCatalogue(prefix=f"fault{uuid.uuid4().hex[:6]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    events = fleet()
    n, half = len(events), len(events) // 2
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "test")
    publisher.publish_batch(events[:half])
    run = Run(kafka_bootstrap, cat, tmp_path, f"{cat.prefix}-snapshot").start()
    with run.stopped_on_failure():
        deadline = time.monotonic() + 180
        # (the controls stage too: it has state to snapshot once it has evaluated something)
        while (stats := run.health()["stats"]).get("correlated_in", 0) < half // 2 or not stats.get("controls_in"):
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
    assert run.service.stop(grace=30) == 0, run.service.log_tail()
    where = run.data / "streams" / "snapshots"
    changelogs = [f"{cat.prefix}.{run.app_id}.{name}-changelog.v1" for name in ("controls", "entities")]
    files = sorted(str(f.relative_to(where)) for f in where.rglob("*.snapshot"))
    assert files == [f"{c}/{p}.snapshot" for c in changelogs for p in range(4)], (files, run.service.log_tail())
    snapped = {f: (where / f).read_bytes() for f in files}
    publisher.publish_batch(events[half:])  # the rest: the crashing run has work whenever the first one stopped
    publisher.close()

    reference = Run(kafka_bootstrap, cat, tmp_path, f"{cat.prefix}-straight").start()
    with reference.stopped_on_failure():
        reference_health = reference.wait_done(n)
    reference_sums = reference.stop_and_checksum()

    assert run.start("correlate:after_changelog:2").wait_crashed() == 137
    # A crash writes none of the crashed process's snapshots (the correlation stage's: the entities).
    # The controls stage is a process of its own that stops cleanly once the worker is gone
    # (gpuledger.child) — after the batch in hand, its epoch committed — and so may write its own,
    # consistent with what it committed (CI once: a snapshot file changed here, which one not recorded).
    changed = sorted(f for f in files if (where / f).read_bytes() != snapped[f])
    assert not [f for f in changed if "entities-changelog" in f], changed
    run.start()
    with run.stopped_on_failure():
        health = run.wait_done(n)
        entities = health["stores"]["entities"]
        assert entities["snapshots"]["loaded_partitions"] == 4 and entities["snapshots"]["read_whole"] == {}, entities
        assert 0 < entities["snapshots"]["tail_records"] == entities["recovered_records"], entities
        assert entities["keys"] == reference_health["stores"]["entities"]["keys"], entities
    assert run.stop_and_checksum() == reference_sums

    run.start()
    with run.stopped_on_failure():
        health = run.wait_done(n)
        snaps = _snapshots(health)
        assert snaps["entities"]["loaded_partitions"] == 4 and snaps["controls"]["loaded_partitions"] == 4, snaps
        assert health["stores"]["entities"]["recovered_records"] == health["stores"]["controls"]["recovered_records"] == 0, health["stores"]
        assert health["stores"]["entities"]["keys"] == reference_health["stores"]["entities"]["keys"], health["stores"]
    assert run.stop_and_checksum() == reference_sums
