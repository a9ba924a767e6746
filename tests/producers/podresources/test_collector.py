"""Tests for producers/podresources/ (collector.py, snapshot.py, config.py).

Pure parts (device-id parsing, resource matching, back-off, the snapshot diff, the
state file) are tested directly. The collector itself is the real one, talking gRPC
to FakeKubelet on a real unix socket and publishing to the real broker; assertions
read the gpu topic back.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest

from gpuledger.dev.process import ServiceProcess
from gpuledger.settings import Settings, SettingsError
from producers._errors import PublishError, StateFileError
from producers._kafka import EventPublisher
from producers.podresources.collector import KubeletUnavailable, PodResourcesCollector, StateStore
from producers.podresources.config import PodResourcesSettings
from producers.podresources.snapshot import (
    AllocatableSet,
    AssignmentKey,
    CollectorState,
    DeviceIdError,
    Held,
    Observation,
    ResourceMatcher,
    parse_device_id,
    plan_changes,
)
from schemas import DeadLetter, decode_event
from schemas.envelope import make_event_id
from tests.fixtures.kafka import read_topic
from producers.podresources.proto import podresources_v1_pb2 as pb
from producers.podresources.proto import podresources_v1_pb2_grpc as pb_grpc
from tests.fixtures.kubelet import DEFAULT_BURST, DEFAULT_QPS, FakeKubelet, container, devices, pod

NODE = "gpu-node-1"
GPU_A = "GPU-8f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
GPU_B = "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"
GPU_C = "GPU-c0ffee00-1111-2222-3333-444455556666"
MIG_A = "MIG-4f6a9c2e-1b3d-5e7f-8a9b-0c1d2e3f4a5b"
MIG_B = "MIG-7d2e1f0a-9b8c-4d3e-a2f1-0e9d8c7b6a59"
MIG_LEGACY = f"MIG-{GPU_B}/1/0"


# --- pure: device ids, matching ---------------------------------------------------

@pytest.mark.parametrize(("device_id", "form", "gpu", "mig", "share"), [
    (GPU_A, "gpu_uuid", GPU_A, None, None),
    (f"{GPU_A}::3", "gpu_uuid", GPU_A, None, 3),
    (MIG_A, "mig_uuid", None, MIG_A, None),
    (f"{MIG_A}::0", "mig_uuid", None, MIG_A, 0),
    (MIG_LEGACY, "mig_legacy", GPU_B, MIG_LEGACY, None),
    (f"{MIG_LEGACY}::2", "mig_legacy", GPU_B, MIG_LEGACY, 2),
    ("nvidia0", "index", "nvidia0", None, None),
    ("nvidia12", "index", "nvidia12", None, None),
    ("3", "index", "3", None, None),
    ("nvidia0/gi2", "mig_index", "nvidia0", "nvidia0/gi2", None),
    ("nvidia1/vgpu4", "index", "nvidia1", None, 4),
    ("nvidia0/gi1/vgpu0", "mig_index", "nvidia0", "nvidia0/gi1", 0),
    ("1:2", "mig_index", "1", "1:2", None),
    ("GPU-x::3", "gpu_uuid", "GPU-x", None, 3),
    ("0000:3b:00.0", "unknown", None, None, None),
    ("GPU-x::abc", "gpu_uuid", "GPU-x::abc", None, None),  # not a share suffix: kept whole
])
def test_parse_device_id(device_id, form, gpu, mig, share):
    ref = parse_device_id(device_id)
    assert (ref.device_id, ref.form, ref.gpu, ref.mig_instance, ref.share) == (device_id, form, gpu, mig, share)


@pytest.mark.parametrize(("device_id", "reason"), [
    ("", "empty_device_id"), ("   ", "empty_device_id"), (" GPU-1", "invalid_device_id"), ("GPU-1\n", "invalid_device_id"),
    (f"GPU-1::{2**63}", "invalid_device_id"),  # a share past the event's int64 (it stopped the collector: a ValidationError)
    ("GPU-\u202e1", "invalid_device_id"), ("GPU-\u200b1", "invalid_device_id"),  # bidi / format: not an identifier either
])
def test_parse_device_id_rejects_what_cannot_round_trip(device_id, reason):
    with pytest.raises(DeviceIdError) as info:
        parse_device_id(device_id)
    assert info.value.reason == reason


def test_resource_matcher_names_and_prefixes():
    matches = ResourceMatcher(["nvidia.com/gpu", "nvidia.com/mig-*"])
    assert matches("nvidia.com/gpu") and matches("nvidia.com/mig-1g.10gb") and matches("nvidia.com/mig-3g.40gb.shared")
    assert not matches("nvidia.com/gpu.shared") and not matches("amd.com/gpu") and not matches("nvidia.com/gpux")


def test_settings_report_every_problem_at_once(monkeypatch):
    monkeypatch.delenv("GPULEDGER_PODRESOURCES_NODE", raising=False)
    with pytest.raises(SettingsError) as info:
        Settings.load(run="collectors.podresources", collectors={"podresources": {"interval_s": 0, "resources": ("a*b",)}})
    text = str(info.value)
    assert "GPULEDGER_PODRESOURCES_NODE" in text and "GPULEDGER_PODRESOURCES_INTERVAL_S" in text and "GPULEDGER_PODRESOURCES_RESOURCES" in text
    monkeypatch.setenv("GPULEDGER_PODRESOURCES_RESOURCES", "nvidia.com/gpu, nvidia.com/mig-*")
    settings = Settings.load(run="collectors.podresources", collectors={"podresources": {"node": NODE}}).collectors.podresources
    assert settings.resources == ("nvidia.com/gpu", "nvidia.com/mig-*")
    assert settings.state_file == Path("/var/lib/gpuledger") / f"podresources-{NODE}.json"


# --- pure: the diff and its generations --------------------------------------------------------

def _key(pod_name="p", device=GPU_A):
    return AssignmentKey("ml", pod_name, "main", "nvidia.com/gpu", device)


def test_plan_reuses_generation_of_a_batch_in_flight_and_renews_it_after_release():
    state = CollectorState(NODE)
    obs = Observation(assignments={_key(): (0,)})
    first = plan_changes(state, obs, "2026-01-01T00:00:00.000001+00:00")
    assert [(k, h.since) for k, h in first.assigned] == [(_key(), "2026-01-01T00:00:00.000001+00:00")]
    # The batch failed: the in-flight state is what remains; a later poll re-sends with the same generation.
    retry = plan_changes(first.in_flight, obs, "2026-01-01T00:00:10+00:00")
    assert retry.assigned == first.assigned
    # Committed: nothing more to say while it is held.
    assert plan_changes(retry.after, obs, "2026-01-01T00:00:20+00:00").empty
    # Released: the release carries the assignment's generation; a re-assignment gets a new one.
    released = plan_changes(retry.after, Observation(), "2026-01-01T00:00:30+00:00")
    assert released.released == first.assigned and not released.assigned
    again = plan_changes(released.after, obs, "2026-01-01T00:00:40+00:00")
    assert again.assigned[0][1].since == "2026-01-01T00:00:40+00:00"


def test_plan_releases_an_in_flight_assignment_that_vanished():
    state = CollectorState(NODE, pending_assignments={_key(): Held("2026-01-01T00:00:00+00:00")})
    plan = plan_changes(state, Observation(), "2026-01-01T00:00:10+00:00")
    assert plan.released == [(_key(), Held("2026-01-01T00:00:00+00:00"))]
    assert plan.in_flight.pending_assignments == {_key(): Held("2026-01-01T00:00:00+00:00")}  # still tracked until acked
    assert plan.after.pending_assignments == {} and plan.after.assignments == {}


def test_plan_allocatable_changes_only():
    seen = {"nvidia.com/gpu": AllocatableSet((GPU_A, GPU_B), (0,))}
    first = plan_changes(CollectorState(NODE), Observation(allocatable=seen), "t1")
    assert [(r, s.devices, s.since) for r, s in first.allocatable] == [("nvidia.com/gpu", (GPU_A, GPU_B), "t1")]
    assert plan_changes(first.after, Observation(allocatable=seen), "t2").empty
    assert plan_changes(first.after, Observation(allocatable=None), "t2").empty  # not served: keep what we know
    gone = plan_changes(first.after, Observation(allocatable={}), "t3")
    assert [(r, s.devices) for r, s in gone.allocatable] == [("nvidia.com/gpu", ())]
    assert gone.after.allocatable == {}
    # That batch failed and the set came back: it may have reached Kafka, so say the set again.
    back = plan_changes(gone.in_flight, Observation(allocatable=seen), "t4")
    assert [(r, s.devices, s.since) for r, s in back.allocatable] == [("nvidia.com/gpu", (GPU_A, GPU_B), "t4")]
    assert plan_changes(back.after, Observation(allocatable=seen), "t5").empty


def test_state_store_round_trip_atomic_and_guarded(tmp_path):
    store = StateStore(tmp_path / f"podresources-{NODE}.json", NODE)
    assert store.load() == CollectorState(NODE)
    state = CollectorState(NODE, {_key(): Held("t1", (0, 1))}, {"nvidia.com/gpu": AllocatableSet((GPU_A,), (0,), "t1")},
                           {_key("q"): Held("t2")}, {})
    store.save(state)
    assert store.load() == state
    assert [p.name for p in tmp_path.iterdir()] == [store.path.name]  # no temp file left behind
    with pytest.raises(StateFileError, match="belongs to node"):
        StateStore(store.path, "other-node").load()
    store.path.write_text("{ truncated")
    assert store.load() == CollectorState(NODE)  # quarantined, started empty
    assert any(p.name.startswith(f"{store.path.name}.corrupt-") for p in tmp_path.iterdir())


# --- against FakeKubelet and the broker -----------------------------------------------------

@pytest.fixture
def sock_path() -> Iterator[Path]:
    # pytest's tmp_path can exceed the 107-byte unix socket limit; /tmp cannot.
    d = Path(tempfile.mkdtemp(prefix="glpr-", dir="/tmp"))
    yield d / "kubelet.sock"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sock_path) -> Iterator[FakeKubelet]:
    with FakeKubelet(sock_path) as fake:
        yield fake


@pytest.fixture
def make_collector(catalogue, settings_for, tmp_path, sock_path) -> Iterator[Callable[..., PodResourcesCollector]]:
    made: list[PodResourcesCollector] = []

    def build(publisher=None, clock=None, **overrides) -> PodResourcesCollector:
        settings = PodResourcesSettings(**{
            "node": NODE, "socket": sock_path, "state_dir": tmp_path / "state", "interval_s": 0.1, "rpc_timeout_s": 2.0,
            "backoff_initial_s": 0.05, "backoff_max_s": 0.4, **overrides})
        collector = PodResourcesCollector(settings, publisher or EventPublisher.from_settings(settings_for(catalogue), "podresources"),
                                          clock=clock)
        made.append(collector)
        return collector

    yield build
    for collector in made:
        collector.close()


def gpu_events(kafka_bootstrap, catalogue, min_count, settle=1.0) -> list:
    records = read_topic(kafka_bootstrap, catalogue.gpu, min_count=min_count, timeout=20, settle=settle)
    return [(r.key().decode(), decode_event(r.value())) for r in records]


def types(events) -> Counter:
    return Counter(e.event_type for _, e in events)


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def running(collector: PodResourcesCollector):
    thread = threading.Thread(target=collector.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        collector.stop()
        thread.join(15)
        assert not thread.is_alive(), "collector did not stop"


def trainer(name="trainer-0", ids=(GPU_A, GPU_B), numa=(0,)):
    return pod("ml", name, containers=[container("main", devices=[
        devices("nvidia.com/gpu", list(ids), numa=list(numa) if numa is not None else None),
        devices("example.com/fpga", ["fpga0"]),  # not a configured resource: ignored
    ])])


def test_assignments_published_once_with_identity_and_key(kubelet, make_collector, kafka_bootstrap, catalogue):
    kubelet.set_pods([trainer(), pod("kube-system", "coredns-0", containers=[container("coredns")])])
    collector = make_collector()
    first = collector.poll_once()
    assert (first.assigned, first.published, first.held) == (2, 2, 2)
    for _ in range(3):
        assert collector.poll_once().published == 0

    events = gpu_events(kafka_bootstrap, catalogue, 2)
    assert types(events) == {"gpu.assigned": 2}
    by_device = {e.payload.device_id: (key, e) for key, e in events}
    key, event = by_device[GPU_A]
    assert key == "ml/trainer-0"
    assert (event.identity.namespace, event.identity.pod, event.identity.node, event.identity.gpu_id) == ("ml", "trainer-0", NODE, GPU_A)
    assert (event.payload.container, event.payload.resource_name, event.payload.gpu, event.payload.numa_nodes) == ("main", "nvidia.com/gpu", GPU_A, (0,))
    assert event.source.collector == "podresources" and event.source.host == NODE
    assert event.event_id == make_event_id("podresources", (NODE, "ml", "trainer-0", "main", "nvidia.com/gpu", GPU_A, "assigned"),
                                           event.occurred_at.isoformat(timespec="microseconds"))


def test_a_device_without_numa_affinity_is_published(kubelet, make_collector, kafka_bootstrap, catalogue):
    # NUMA node -1 (Linux's "no affinity", passed on by some device plugins) once failed the
    # event's validation inside the poll, which ended the collector's loop for the node.
    kubelet.set_pods([trainer(ids=[GPU_A], numa=(-1,))])
    collector = make_collector()
    assert collector.poll_once().published == 1
    [(_key, event)] = gpu_events(kafka_bootstrap, catalogue, 1)
    assert event.payload.numa_nodes == (-1,) and event.payload.device_id == GPU_A


def test_pod_leaving_is_released_and_a_new_assignment_gets_a_new_id(kubelet, make_collector, kafka_bootstrap, catalogue):
    kubelet.set_pods([trainer(ids=[GPU_A])])
    collector = make_collector()
    collector.poll_once()
    kubelet.set_pods([])
    assert collector.poll_once().released == 1
    assert collector.poll_once().published == 0
    kubelet.set_pods([trainer(ids=[GPU_A])])  # same pod name, same device: a new assignment
    assert collector.poll_once().assigned == 1

    events = gpu_events(kafka_bootstrap, catalogue, 3)
    assert [e.event_type for _, e in sorted(events, key=lambda ke: ke[1].observed_at)] == ["gpu.assigned", "gpu.released", "gpu.assigned"]
    first, released, second = sorted((e for _, e in events), key=lambda e: e.observed_at)
    assert second.event_id != first.event_id
    assert released.event_id == make_event_id("podresources", (NODE, "ml", "trainer-0", "main", "nvidia.com/gpu", GPU_A, "released"),
                                              first.occurred_at.isoformat(timespec="microseconds"))
    assert released.payload.numa_nodes == (0,) and released.identity.gpu_id == GPU_A


def test_restart_publishes_nothing_new_and_downtime_changes_once(kubelet, make_collector, kafka_bootstrap, catalogue):
    kubelet.set_pods([trainer("a-0", [GPU_A]), trainer("b-0", [GPU_B])])
    make_collector().poll_once()
    again = make_collector()  # restart: same state dir
    assert again.poll_once().published == 0
    again.close()
    kubelet.set_pods([trainer("a-0", [GPU_A]), trainer("c-0", [GPU_C])])  # while down: b left, c arrived
    after = make_collector()
    result = after.poll_once()
    assert (result.assigned, result.released) == (1, 1)
    assert make_collector().poll_once().published == 0

    events = gpu_events(kafka_bootstrap, catalogue, 4)
    assert types(events) == {"gpu.assigned": 3, "gpu.released": 1}
    assert len({e.event_id for _, e in events}) == 4
    assert {(e.event_type, e.identity.pod) for _, e in events} == {
        ("gpu.assigned", "a-0"), ("gpu.assigned", "b-0"), ("gpu.released", "b-0"), ("gpu.assigned", "c-0")}


class _Crash(BaseException):
    """The process dies (kill -9) right after Kafka acknowledged the batch."""


class _AckedThenLost:
    """Publishes for real, then fails the way ``mode`` says: a lost ack or a crash."""

    def __init__(self, inner: EventPublisher, mode: str) -> None:
        self.inner, self.mode, self.counters = inner, mode, inner.counters

    def publish_fitting(self, events, stage, timeout=None):
        self.inner.publish_fitting(events, stage, timeout)
        if self.mode == "crash":
            raise _Crash()
        raise PublishError("1 of 1 record(s) not delivered to Kafka: (simulated lost ack)")

    def close(self, timeout=30.0):
        self.inner.close(timeout)


def test_resend_after_lost_ack_or_crash_reuses_event_ids(kubelet, make_collector, settings_for, kafka_bootstrap, catalogue, tmp_path):
    kubelet.set_pods([trainer(ids=[GPU_A])])
    settings = settings_for(catalogue)
    flaky = make_collector(publisher=_AckedThenLost(EventPublisher.from_settings(settings, "podresources"), "publish_error"))
    with pytest.raises(PublishError):
        flaky.poll_once()
    state = json.loads((tmp_path / "state" / f"podresources-{NODE}.json").read_text())
    assert state["assignments"] == [] and len(state["pending_assignments"]) == 1  # snapshot not advanced
    flaky.publisher = flaky.publisher.inner
    assert flaky.poll_once().published == 1  # the retry
    flaky.close()

    kubelet.set_pods([trainer(ids=[GPU_A]), trainer("other-0", ids=[GPU_B])])
    crashing = make_collector(publisher=_AckedThenLost(EventPublisher.from_settings(settings, "podresources"), "crash"))
    with pytest.raises(_Crash):
        crashing.poll_once()
    crashing.close()
    assert make_collector().poll_once().published == 1  # restarted: re-sends other-0 only
    assert make_collector().poll_once().published == 0

    events = gpu_events(kafka_bootstrap, catalogue, 4)
    ids = Counter((e.identity.pod, e.event_id) for _, e in events)
    assert sorted(ids.values()) == [2, 2]  # each assignment sent twice, under one id
    assert len({pod_name for pod_name, _ in ids}) == 2


def test_mig_and_time_sliced_device_lists(kubelet, make_collector, kafka_bootstrap, catalogue):
    kubelet.set_pods([
        pod("ml", "mig-0", containers=[container("main", devices=[devices("nvidia.com/mig-1g.10gb", [MIG_A, MIG_B], numa=[1])])]),
        pod("ml", "legacy-0", containers=[container("main", devices=[devices("nvidia.com/mig-3g.40gb", [MIG_LEGACY])])]),
        pod("ml", "shared-0", containers=[container("main", devices=[devices("nvidia.com/gpu.shared", [f"{GPU_C}::3"])])]),
    ])
    assert make_collector().poll_once().assigned == 4
    events = {e.payload.device_id: e for _, e in gpu_events(kafka_bootstrap, catalogue, 4)}
    assert set(events) == {MIG_A, MIG_B, MIG_LEGACY, f"{GPU_C}::3"}
    assert (events[MIG_A].payload.mig_instance, events[MIG_A].payload.gpu, events[MIG_A].payload.numa_nodes) == (MIG_A, None, (1,))
    assert events[MIG_A].payload.resource_name == "nvidia.com/mig-1g.10gb"
    assert (events[MIG_LEGACY].payload.gpu, events[MIG_LEGACY].payload.mig_instance) == (GPU_B, MIG_LEGACY)
    shared = events[f"{GPU_C}::3"]
    assert (shared.payload.gpu, shared.payload.share, shared.identity.gpu_id) == (GPU_C, 3, f"{GPU_C}::3")
    assert events[MIG_LEGACY].payload.numa_nodes == ()  # no topology reported


def test_allocatable_published_once_and_again_only_on_change(kubelet, make_collector, kafka_bootstrap, catalogue):
    original = [devices("nvidia.com/gpu", [GPU_B, GPU_A], numa=[0]), devices("nvidia.com/mig-1g.10gb", [MIG_A], numa=[1]),
                devices("example.com/fpga", ["fpga0"])]
    kubelet.set_allocatable(original)
    collector = make_collector()
    assert collector.poll_once().allocatable == 2
    assert collector.poll_once().published == 0
    kubelet.set_allocatable([devices("nvidia.com/gpu", [GPU_A], numa=[0]), devices("nvidia.com/mig-1g.10gb", [MIG_A], numa=[1])])
    assert collector.poll_once().allocatable == 1
    assert make_collector().poll_once().published == 0  # restart: unchanged
    kubelet.set_allocatable(original)  # back to the first set: a new fact, not the old one again
    assert collector.poll_once().allocatable == 1

    events = [e for _, e in gpu_events(kafka_bootstrap, catalogue, 4)]
    assert types([(None, e) for e in events]) == {"gpu.allocatable": 4}
    gpu_sets = [e for e in sorted(events, key=lambda e: e.observed_at) if e.payload.resource_name == "nvidia.com/gpu"]
    assert [e.payload.devices for e in gpu_sets] == [tuple(sorted((GPU_A, GPU_B))), (GPU_A,), tuple(sorted((GPU_A, GPU_B)))]
    assert len({e.event_id for e in gpu_sets}) == 3
    assert gpu_sets[0].payload.numa_nodes == (0,) and gpu_sets[0].identity.node == NODE


def test_allocatable_too_large_to_travel_is_dead_lettered_and_settled(kubelet, make_collector, kafka_bootstrap, catalogue):
    # Thousands of time-sliced replicas: one gpu.allocatable event over the 256 KiB event limit.
    replicas = [f"{GPU_A}::{i}" for i in range(8_000)]
    kubelet.set_allocatable([devices("nvidia.com/gpu", replicas, numa=[0]), devices("nvidia.com/mig-1g.10gb", [MIG_A], numa=[1])])
    kubelet.set_pods([trainer(ids=[GPU_B])])
    collector = make_collector()
    result = collector.poll_once()
    assert (result.allocatable, result.assigned, result.published) == (2, 1, 2)  # the big set was not sent
    dead = [DeadLetter.model_validate_json(m.value()) for m in read_topic(kafka_bootstrap, catalogue.deadletter, min_count=1, timeout=20)]
    assert len(dead) == 1 and (dead[0].reason, dead[0].stage, dead[0].source_topic) == ("event_too_large", "podresources", catalogue.gpu)
    assert f"limit_bytes={collector.publisher.max_event_bytes}" in dead[0].error and "gpu.allocatable" in dead[0].error
    assert collector.counters.totals["rejected.event_too_large"] == 1
    on_topic = [e for _, e in gpu_events(kafka_bootstrap, catalogue, 2)]
    assert {(e.event_type, e.payload.resource_name) for e in on_topic} == {("gpu.allocatable", "nvidia.com/mig-1g.10gb"),
                                                                          ("gpu.assigned", "nvidia.com/gpu")}
    assert collector.poll_once().published == 0  # settled: not dead-lettered again every poll


def test_rate_limited_kubelet_is_backed_off_then_published(kubelet, make_collector, kafka_bootstrap, catalogue):
    kubelet.set_pods([trainer(ids=[GPU_A])])
    kubelet.exhaust_next(3)
    collector = make_collector()
    started = time.monotonic()
    with running(collector):
        wait_for(lambda: collector.counters.totals["sent"] >= 1, what="publish after rate limiting")
    elapsed = time.monotonic() - started
    assert collector.failures == {"resource_exhausted": 3}
    assert elapsed >= 0.025 + 0.05 + 0.1  # at least the jittered minimum of three growing back-offs
    assert types(gpu_events(kafka_bootstrap, catalogue, 1)) == {"gpu.assigned": 1}


def test_many_pods_leaving_at_once_are_released_within_the_kubelets_rate_limit(kubelet, make_collector, kafka_bootstrap, catalogue):
    """A drain: 12 pods holding GPUs leave List at once. The kubelet limits this API for all its
    clients together (burst 10, 100/s, refused at once); the poll asked Get about every one of
    them, was refused part-way, failed, and every retry asked the same again: the node never
    published anything more. Now a poll asks at most max_gets_per_poll, a refused Get keeps its
    pod held, and later polls release the rest."""
    now = [0.0]
    kubelet.rate_limit(DEFAULT_QPS, DEFAULT_BURST, clock=lambda: now[0])  # time moves only when the test says so
    gpus = [f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(12)]
    kubelet.set_pods([trainer(f"job-{i}", ids=[gpu]) for i, gpu in enumerate(gpus)])
    collector = make_collector()
    assert collector.poll_once().assigned == 12
    kubelet.set_pods([])
    now[0] += 1.0  # the bucket full again; then another client of the socket (dcgm-exporter, say) spends 6 of its 10 tokens
    with grpc.insecure_channel(kubelet.address) as channel:
        other = pb_grpc.PodResourcesListerStub(channel)
        for _ in range(6):
            other.List(pb.ListPodResourcesRequest(), timeout=5)

    released, polls = [], 0
    while sum(released) < 12 and polls < 6:
        gets_before = kubelet.call_count("Get")
        released.append(collector.poll_once().released)  # a failed poll raises here
        assert kubelet.call_count("Get") - gets_before <= 5  # the default max_gets_per_poll
        polls += 1
        now[0] += 0.1  # one poll interval: the bucket refills
    # 4 tokens left: List, GetAllocatableResources, two Gets, the third refused; then 5 per poll.
    assert released == [2, 5, 5]
    assert kubelet.refused_count("Get") == 1 and kubelet.refused_count("List") == 0
    events = gpu_events(kafka_bootstrap, catalogue, 24)
    assert types(events) == {"gpu.assigned": 12, "gpu.released": 12}
    assert sorted(e.payload.device_id for _, e in events if e.event_type == "gpu.released") == sorted(gpus)


def test_socket_missing_is_retried_without_spinning_then_published(sock_path, make_collector, kafka_bootstrap, catalogue, caplog):
    caplog.set_level(logging.INFO, logger="producers.podresources")
    collector = make_collector()
    with running(collector) as thread:
        time.sleep(1.2)
        assert thread.is_alive()
        missing = collector.failures["socket_missing"]
        assert 2 <= missing <= 12  # back-off capped at 0.4 s: a handful of attempts, not a spin
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and "does not exist" in r.getMessage()]
        assert len(errors) == 1  # once per state change
        with FakeKubelet(sock_path) as kubelet:
            kubelet.set_pods([trainer(ids=[GPU_A])])
            wait_for(lambda: collector.counters.totals["sent"] >= 1, what="publish once the kubelet appeared")
    assert any("recovered after" in r.getMessage() for r in caplog.records)
    assert types(gpu_events(kafka_bootstrap, catalogue, 1)) == {"gpu.assigned": 1}


def test_kubelet_restart_is_picked_up(sock_path, make_collector, kafka_bootstrap, catalogue):
    collector = make_collector()
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_pods([trainer(ids=[GPU_A])])
        collector.poll_once()
    with pytest.raises(KubeletUnavailable) as info:
        collector.poll_once()
    assert info.value.kind == "socket_missing"
    with FakeKubelet(sock_path) as kubelet:  # a new kubelet process, a new socket at the same path
        kubelet.set_pods([trainer(ids=[GPU_A]), trainer("late-0", ids=[GPU_B])])
        assert (collector.poll_once().assigned, collector.poll_once().published) == (1, 0)
    assert types(gpu_events(kafka_bootstrap, catalogue, 2)) == {"gpu.assigned": 2}


class StepClock:
    """The collector's clock, moved only by the test (one poll interval per ``step``)."""

    def __init__(self) -> None:
        self.now = datetime.now(timezone.utc)

    def __call__(self) -> datetime:
        return self.now

    def step(self, seconds: float = 10.0) -> None:
        self.now += timedelta(seconds=seconds)


def test_kubelet_restart_with_an_empty_pod_list_releases_nothing(sock_path, make_collector, kafka_bootstrap, catalogue):
    """A restarted kubelet serves pod-resources before its pods came from the API server: its List
    is empty for a while. The collector took that for every pod leaving and released every GPU of
    the node, then assigned them again under new ids a few polls later: a gap in the history."""
    clock = StepClock()
    collector = make_collector(clock=clock, restart_grace_s=60)
    held = [trainer("a-0", [GPU_A]), trainer("b-0", [GPU_B]), trainer("c-0", [GPU_C])]
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_pods(held)
        assert collector.poll_once().assigned == 3
    # The kubelet restarts between two polls (no failed poll in between: gRPC could reconnect by itself).
    with FakeKubelet(sock_path) as kubelet:
        for _ in range(4):  # 40 s of empty answers
            clock.step()
            result = collector.poll_once()
            assert (result.released, result.assigned, result.published, result.withheld) == (0, 0, 0, 3)
        assert kubelet.call_count("Get") == 0  # its "not found" would come from the same empty list
        clock.step()
        kubelet.set_pods(held)  # the API server's pods arrived
        assert collector.poll_once().published == 0
        # The connection is proven: a pod that really leaves now is released at once.
        kubelet.set_pods(held[:2])
        clock.step()
        assert collector.poll_once().released == 1
    events = gpu_events(kafka_bootstrap, catalogue, 4)
    assert types(events) == {"gpu.assigned": 3, "gpu.released": 1}
    assert [e.identity.pod for _, e in events if e.event_type == "gpu.released"] == ["c-0"]


def test_pods_gone_across_a_restart_are_released_after_the_grace(sock_path, make_collector, kafka_bootstrap, catalogue):
    """The node really drained while the kubelet (and the collector) restarted: the held pods are
    released once the List stayed without them restart_grace_s, observed that much late."""
    clock = StepClock()
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_pods([trainer("a-0", [GPU_A]), trainer("b-0", [GPU_B])])
        assert make_collector(clock=clock).poll_once().assigned == 2
    collector = make_collector(clock=clock, restart_grace_s=60)  # restarted: its state file holds both pods
    with FakeKubelet(sock_path) as kubelet:
        clock.step()
        first_missed = clock.now
        assert collector.poll_once().withheld == 2
        clock.step(59)
        assert (collector.poll_once().published, collector.poll_once().withheld) == (0, 2)
        clock.step(1)
        assert collector.poll_once().released == 2
        assert collector.poll_once().published == 0
    events = gpu_events(kafka_bootstrap, catalogue, 4)
    assert types(events) == {"gpu.assigned": 2, "gpu.released": 2}
    released = [e for _, e in events if e.event_type == "gpu.released"]
    assert {e.occurred_at for e in released} == {first_missed + timedelta(seconds=60)}  # when it was published: late, not earlier


def test_a_new_gpu_pod_after_a_restart_proves_the_pod_list_and_releases_at_once(sock_path, make_collector, kafka_bootstrap, catalogue):
    """Only a kubelet that has the API server's pods admits a new one: the held pods it lacks are gone."""
    clock = StepClock()
    collector = make_collector(clock=clock, restart_grace_s=60)
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_pods([trainer("a-0", [GPU_A]), trainer("b-0", [GPU_B])])
        collector.poll_once()
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_pods([trainer("next-0", [GPU_A])])
        clock.step()
        result = collector.poll_once()
        assert (result.released, result.assigned, result.withheld) == (2, 1, 0)
    assert types(gpu_events(kafka_bootstrap, catalogue, 5)) == {"gpu.assigned": 3, "gpu.released": 2}


GPU_SET = [devices("nvidia.com/gpu", [GPU_A, GPU_B, GPU_C], numa=[0]), devices("nvidia.com/mig-1g.10gb", [MIG_A], numa=[1])]


def allocatable_sets(events) -> dict[str, list[tuple[str, ...]]]:
    """Each resource's published gpu.allocatable device sets, in the order they were observed."""
    sets: dict[str, list[tuple[str, ...]]] = {}
    for _, e in sorted(events, key=lambda ke: ke[1].observed_at):
        if e.event_type == "gpu.allocatable":
            sets.setdefault(e.payload.resource_name, []).append(tuple(sorted(e.payload.devices)))
    return sets


def test_kubelet_restart_before_its_device_plugins_registered_keeps_the_allocatable_sets(sock_path, make_collector, kafka_bootstrap, catalogue):
    """A restarted kubelet lists no allocatable device of a resource until its device plugin registered
    again (devicemanager readCheckpoint / GetAllocatableDevices). The collector published an empty
    gpu.allocatable per resource, then the full set again seconds later: the node's GPUs vanished and
    came back for every consumer."""
    clock = StepClock()
    collector = make_collector(clock=clock, restart_grace_s=60)
    held = [trainer("a-0", [GPU_A])]
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_pods(held)
        kubelet.set_allocatable(GPU_SET)
        result = collector.poll_once()
        assert (result.assigned, result.allocatable) == (1, 2)
        kubelet.restart()
        clock.step()
        kubelet.sync_pods()  # the API server's pods came first: the List is whole, the devices are not
        result = collector.poll_once()
        assert (result.published, result.allocatable_withheld) == (0, 2)
        clock.step()
        kubelet.register_plugin("nvidia.com/gpu")  # plugins register one by one
        result = collector.poll_once()
        assert (result.published, result.allocatable_withheld) == (0, 1)
        clock.step()
        kubelet.register_plugin("nvidia.com/mig-1g.10gb")
        result = collector.poll_once()
        assert (result.published, result.allocatable_withheld) == (0, 0)
        # The resources are proven for this connection: a device that really leaves is published at once.
        kubelet.set_allocatable([devices("nvidia.com/gpu", [GPU_A, GPU_B], numa=[0]), GPU_SET[1]])
        clock.step()
        assert collector.poll_once().allocatable == 1
    events = gpu_events(kafka_bootstrap, catalogue, 4)
    assert types(events) == {"gpu.assigned": 1, "gpu.allocatable": 3}
    assert allocatable_sets(events) == {"nvidia.com/gpu": [tuple(sorted((GPU_A, GPU_B, GPU_C))), tuple(sorted((GPU_A, GPU_B)))],
                                        "nvidia.com/mig-1g.10gb": [(MIG_A,)]}


def test_devices_gone_across_a_kubelet_restart_are_published_after_the_grace(sock_path, make_collector, kafka_bootstrap, catalogue):
    """A GPU really left while the kubelet restarted: its plugin registers without it, and the smaller
    set is published once it stayed so restart_grace_s, observed that much late."""
    clock = StepClock()
    collector = make_collector(clock=clock, restart_grace_s=60)
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_allocatable(GPU_SET)
        assert collector.poll_once().allocatable == 2
        kubelet.set_allocatable([devices("nvidia.com/gpu", [GPU_A, GPU_C], numa=[0]), GPU_SET[1]])  # GPU_B fell off the bus
        kubelet.restart()
        clock.step()
        first_missed = clock.now
        assert collector.poll_once().allocatable_withheld == 2
        kubelet.register_plugin("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")
        clock.step(59)
        result = collector.poll_once()
        assert (result.published, result.allocatable_withheld) == (0, 1)
        clock.step(1)
        result = collector.poll_once()
        assert (result.allocatable, result.allocatable_withheld) == (1, 0)
        assert collector.poll_once().published == 0
    events = gpu_events(kafka_bootstrap, catalogue, 3)
    assert allocatable_sets(events) == {"nvidia.com/gpu": [tuple(sorted((GPU_A, GPU_B, GPU_C))), tuple(sorted((GPU_A, GPU_C)))],
                                        "nvidia.com/mig-1g.10gb": [(MIG_A,)]}
    smaller = [e for _, e in events if e.event_type == "gpu.allocatable" and set(e.payload.devices) == {GPU_A, GPU_C}]
    assert [e.occurred_at for e in smaller] == [first_missed + timedelta(seconds=60)]  # when it was published: late, not earlier


def test_malformed_entries_skipped_logged_counted_rest_published(kubelet, make_collector, kafka_bootstrap, catalogue, caplog):
    caplog.set_level(logging.WARNING, logger="producers.podresources")
    kubelet.set_pods([
        pod("ml", "", containers=[container("main", devices=[devices("nvidia.com/gpu", [GPU_C])])]),
        pod("ml", "good-0", containers=[
            container("main", devices=[devices("nvidia.com/gpu", ["", GPU_A, "GPU bad"])]),
            container("", devices=[devices("nvidia.com/gpu", [GPU_B])]),
        ]),
    ])
    collector = make_collector()
    assert collector.poll_once().assigned == 1
    assert collector.poll_once().rejected == 0  # counted and logged once, not every poll
    totals = collector.counters.totals
    assert (totals["rejected.pod_name_missing"], totals["rejected.empty_device_id"], totals["rejected.invalid_device_id"],
            totals["rejected.container_name_missing"]) == (1, 1, 1, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 4 malformed" in warnings[0] and "empty_device_id" in warnings[0]
    events = gpu_events(kafka_bootstrap, catalogue, 1)
    assert [(e.identity.pod, e.payload.device_id) for _, e in events] == [("good-0", GPU_A)]


def test_names_an_event_cannot_carry_are_skipped_and_the_collector_keeps_running(kubelet, make_collector, kafka_bootstrap, catalogue):
    """A right-to-left override or a format character passed the collector's own checks and then
    failed the event's validation inside the poll: the ValidationError ended the collector's loop."""
    kubelet.set_pods([
        pod("ml", "good-0", containers=[
            container("main", devices=[devices("nvidia.com/gpu", [GPU_A, "GPU-\u202eevil", "GPU-zero\u200bwidth"])]),
            container("side\u202e", devices=[devices("nvidia.com/gpu", [GPU_B])]),
        ]),
        pod("ml\u202e", "bad-0", containers=[container("main", devices=[devices("nvidia.com/gpu", [GPU_C])])]),
    ])
    collector = make_collector()
    with running(collector) as thread:
        wait_for(lambda: collector.counters.totals["sent"] >= 1, what="the good device published")
        kubelet.set_pods([pod("ml", "good-0", containers=[container("main", devices=[devices("nvidia.com/gpu", [GPU_A])])]),
                          trainer("late-0", ids=[GPU_B])])
        wait_for(lambda: collector.counters.totals["sent"] >= 2, what="a later poll still published")
        assert thread.is_alive()
    totals = collector.counters.totals
    assert (totals["rejected.invalid_device_id"], totals["rejected.invalid_name"]) == (2, 2)
    events = gpu_events(kafka_bootstrap, catalogue, 2)
    assert sorted((e.identity.pod, e.payload.device_id) for _, e in events) == [("good-0", GPU_A), ("late-0", GPU_B)]


@pytest.mark.parametrize("mode", ["unimplemented", "gate_disabled", "not_found_as_unknown"])
def test_get_variants_are_tolerated(mode, kubelet, make_collector, kafka_bootstrap, catalogue):
    if mode == "unimplemented":
        kubelet.get_implemented = False
    elif mode == "gate_disabled":
        kubelet.get_gate_disabled = True
    else:
        kubelet.not_found_code = grpc.StatusCode.UNKNOWN  # the real kubelet's plain Go error
    kubelet.set_pods([trainer(ids=[GPU_A])])
    collector = make_collector()
    collector.poll_once()
    kubelet.set_pods([])
    assert collector.poll_once().released == 1
    kubelet.set_pods([trainer("next-0", ids=[GPU_A])])
    assert collector.poll_once().assigned == 1
    assert kubelet.call_count("Get") == 1  # asked once, about the pod that left
    assert collector._get_served is (mode == "not_found_as_unknown")
    assert types(gpu_events(kafka_bootstrap, catalogue, 3)) == {"gpu.assigned": 2, "gpu.released": 1}


def test_cli_runs_and_stops_cleanly_on_sigterm(kubelet, sock_path, kafka_bootstrap, catalogue, tmp_path):
    kubelet.set_pods([trainer(ids=[GPU_A])])
    state_dir = tmp_path / "cli-state"
    service = ServiceProcess(
        ["-v", "collect", "podresources", "--socket", str(sock_path), "--node", NODE, "--interval", "0.1", "--state-dir", str(state_dir)],
        {"GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
         "GPULEDGER_KAFKA_RAW_PARTITIONS": str(catalogue.raw_partitions), "GPULEDGER_DATA_DIR": str(tmp_path / "data")},
        tmp_path / "collector.log",
    ).start()
    try:
        events = gpu_events(kafka_bootstrap, catalogue, 1, settle=0.5)
        assert types(events) == {"gpu.assigned": 1}, service.log_tail()
    finally:
        code = service.stop(grace=15)
    assert code == 0, service.log_tail()
    state = json.loads((state_dir / f"podresources-{NODE}.json").read_text())
    assert [a["device_id"] for a in state["assignments"]] == [GPU_A]


def test_dra_allocations_of_gpu_drivers_are_published_by_driver_pool_device(kubelet, make_collector, kafka_bootstrap, catalogue):
    """Issue #13.3: with DRA the kubelet reports (driver, pool, device) per claim, not a device id;
    GPU drivers' devices are published as '<driver>/<pool>/<device>', other drivers' are not."""
    from tests.fixtures.kubelet import claim_resource, dynamic_resource

    kubelet.set_pods([pod("ml", "dra-0", containers=[container("main", dynamic_resources=[
        dynamic_resource("dra-0-gpu", "ml", [claim_resource("gpu.nvidia.com", NODE, "gpu-0", ["k8s.gpu.nvidia.com/device=gpu-0"]),
                                             claim_resource("gpu.nvidia.com", f"{NODE}/rack-2", "gpu-1-mig-1g10gb-0")]),
        dynamic_resource("dra-0-nic", "ml", [claim_resource("sriovnetwork.k8snetworkplumbingwg.io", NODE, "vf-3")]),
    ])])])
    assert make_collector().poll_once().assigned == 2
    events = {e.payload.device_id: (key, e) for key, e in gpu_events(kafka_bootstrap, catalogue, 2)}
    assert set(events) == {f"gpu.nvidia.com/{NODE}/gpu-0", f"gpu.nvidia.com/{NODE}/rack-2/gpu-1-mig-1g10gb-0"}
    key, whole = events[f"gpu.nvidia.com/{NODE}/gpu-0"]
    assert key == "ml/dra-0" and whole.event_type == "gpu.assigned" and whole.payload.resource_name == "gpu.nvidia.com"
    assert (whole.payload.driver, whole.payload.pool, whole.payload.gpu, whole.payload.mig_instance) == ("gpu.nvidia.com", NODE, None, None)
    assert events[f"gpu.nvidia.com/{NODE}/rack-2/gpu-1-mig-1g10gb-0"][1].payload.pool == f"{NODE}/rack-2"
