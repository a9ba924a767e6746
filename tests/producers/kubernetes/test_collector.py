"""The scheduler collector against FakeKubeApi (real HTTP) and the real broker.

Every collector test drives the real ``SchedulerCollector`` — in a thread through
``run(stop)`` or once through ``run_once()`` — with the official client pointed at
the API double, and reads the scheduler topic back. Pure mapping rules (workload_id,
message parsing) are tested without I/O at the end.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from producers._kafka import EventPublisher
from producers.kubernetes.mapping import (
    KueueIndex,
    derive_workload_id,
    event_fact,
    event_view,
    gpus_requested,
    image_digest,
    kueue_preemptor,
    pod_facts,
    workload_facts,
    workload_info,
)
from producers.kubernetes.collector import COMPONENT, SchedulerCollector
from producers.kubernetes.config import SchedulerCollectorSettings
from gpuledger.settings import Settings, SettingsError
from schemas import DeadLetter, decode_event
from tests.fixtures.kafka import read_topic
from tests.fixtures.kube_api import (
    CORE_EVENTS,
    EVENTS,
    EVENTS_GROUP,
    PODS,
    WORKLOADS_V1BETA1,
    WORKLOADS_V1BETA2,
    DEFAULT_IMAGE,
    FakeKubeApi,
    disruption_target,
    make_core_event,
    make_event_v1,
    make_pod,
    make_pod_set,
    make_workload,
    pod_condition,
    pod_set_assignment,
    workload_condition,
)

T0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc)
DIGEST = "sha256:" + DEFAULT_IMAGE.rsplit("sha256:", 1)[1]
FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.3, "watch_timeout_s": 20, "request_timeout_s": 5,
        "state_flush_interval_s": 0, "discovery_interval_s": 0.5, "host": "test-host"}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture
def api():
    with FakeKubeApi() as server:
        yield server


@pytest.fixture
def make_collector(kafka_bootstrap, catalogue, tmp_path):
    """``build(api, state_dir=None, **settings)`` -> a SchedulerCollector on the test topics."""
    made: list[SchedulerCollector] = []

    def build(server: FakeKubeApi, state_dir: Path | None = None, **overrides) -> SchedulerCollector:
        settings = SchedulerCollectorSettings(**{**FAST, **overrides})
        publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, COMPONENT)
        collector = SchedulerCollector(settings, publisher, server.api_client(), state_dir or tmp_path / "state")
        made.append(collector)
        return collector

    yield build
    for c in made:
        c.stop()
        c.close()


@contextmanager
def running(collector: SchedulerCollector):
    stop = threading.Event()
    thread = threading.Thread(target=collector.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield collector
    finally:
        stop.set()
        thread.join(15)
        assert not thread.is_alive(), "collector did not stop"


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def wait_sent(collector: SchedulerCollector, n: int, timeout: float = 20.0) -> None:
    wait_until(lambda: collector.counters.totals["sent"] >= n, timeout,
               f"{n} sent (have {collector.counters.totals['sent']})")


def wait_watching(server: FakeKubeApi, *resources: str) -> None:
    for res in resources or (PODS,):
        server.wait_for_watches(1, res, timeout=10)


def published(bootstrap: str, topic: str, n: int) -> list:
    """What is on the topic once ``n`` records arrived and nothing more came for 1 s."""
    records = sorted(read_topic(bootstrap, topic, min_count=n, timeout=20, settle=1.0), key=lambda m: (m.partition(), m.offset()))
    events = [decode_event(m.value()) for m in records]
    ids = Counter(e.event_id for e in events)
    assert not [i for i, c in ids.items() if c > 1], "duplicate event ids on the topic"
    return events  # publish order per key (one key -> one partition)


def of(events, **match) -> list:
    out = []
    for e in events:
        if all((getattr(e.identity, k, None) if k in ("pod", "workload_id", "pod_uid") else getattr(e.payload, k, None)) == v
               for k, v in match.items()):
            out.append(e)
    return out


def types(events) -> list[str]:
    return [e.event_type.split(".", 1)[1] for e in events]


# ------------------------------------------------------------------------------- pods


def test_pod_lifecycle_is_published_once_per_transition(api, make_collector, kafka_bootstrap, catalogue):
    labels = {"gpuledger.io/release-id": "rel-42", "gpuledger.io/model": "llama", "gpuledger.io/environment": "prod",
              "app.kubernetes.io/name": "serve", "pod-template-hash": "7d9f8c6b5", "team": "ignored"}
    owner = ("ReplicaSet", "serve-7d9f8c6b5")
    pod = api.create(PODS, make_pod("ml", "serve-7d9f8c6b5-x2x4z", gpus=2, labels=labels, owner=owner, created=T0,
                                    priority_class="prod-high", priority=1000))
    uid = pod["metadata"]["uid"]
    api.create(PODS, make_pod("ml", "cpu-only", gpus=0, node="cpu-1", created=T0))  # never published

    def update(**kw):
        api.update(PODS, make_pod("ml", "serve-7d9f8c6b5-x2x4z", gpus=2, labels=labels, owner=owner, uid=uid, created=T0,
                                  priority_class="prod-high", priority=1000, **kw))

    collector = make_collector(api)
    with running(collector):
        wait_sent(collector, 2)  # submitted + failed_scheduling (PodScheduled=False/Unschedulable)
        wait_watching(api, PODS)
        update(node="gpu-1", phase="Running", conditions=[
            pod_condition("PodScheduled", at=at(5)), pod_condition("Ready", at=at(9))])
        wait_sent(collector, 4)
        update(node="gpu-1", phase="Running", conditions=[pod_condition("PodScheduled", at=at(5))])  # no new transition
        update(node="gpu-1", phase="Running", conditions=[
            pod_condition("PodScheduled", at=at(5)), disruption_target("PreemptionByScheduler", at=at(60))])
        wait_sent(collector, 5)
        update(node="gpu-1", phase="Failed", conditions=[
            pod_condition("PodScheduled", at=at(5)), disruption_target("PreemptionByScheduler", at=at(60))])
        wait_sent(collector, 6)
        api.delete(PODS, "ml", "serve-7d9f8c6b5-x2x4z")
        wait_sent(collector, 7)

    events = published(kafka_bootstrap, catalogue.scheduler, 7)
    assert types(events) == ["submitted", "failed_scheduling", "scheduled", "running", "preempted", "finished", "deleted"]
    assert all(e.identity.pod_uid == uid for e in events)
    first = events[0]
    assert first.identity.workload_id == "ml/Deployment/serve"
    assert (first.identity.release_id, first.identity.model_name, first.identity.environment) == ("rel-42", "llama", "prod")
    assert first.correlation_key() == "rel-42"
    assert first.source.collector == "kubernetes" and first.source.host == "test-host"
    assert first.payload.labels == {k: v for k, v in labels.items() if k.startswith(("gpuledger.io/", "app.kubernetes.io/"))}
    assert (first.payload.gpus_requested, first.payload.priority_class, first.payload.priority) == (2, "prod-high", 1000)
    scheduled, running_ev, preempted = events[2], events[3], events[4]
    assert scheduled.identity.node == "gpu-1" and scheduled.occurred_at == at(5)
    assert running_ev.payload.image_digests == (DIGEST,) and running_ev.identity.image_digest == DIGEST
    assert preempted.payload.reason == "PreemptionByScheduler" and preempted.occurred_at == at(60)
    assert preempted.payload.victim.uid == uid
    assert events[5].payload.reason == "Failed"
    assert collector.counters.totals["rejected"] == 0


# ------------------------------------------------------------------------------- Kueue


def test_kueue_workload_transitions_with_preemptor(api, make_collector, kafka_bootstrap, catalogue):
    adm = {"clusterQueue": "gpu-cq", "podSetAssignments": [pod_set_assignment("main", {"nvidia.com/gpu": "a100"}, count=1)]}
    urgent = api.create(WORKLOADS_V1BETA2, make_workload(
        "ml", "job-urgent-1a2b3", "team-q", "urgent", 10000, owner=("Job", "urgent", "job-uid-urgent"), admission=adm,
        conditions=[workload_condition("QuotaReserved", at=at(1)), workload_condition("Admitted", at=at(1))], created=T0))
    tmpl_labels = {"gpuledger.io/release-id": "rel-7"}
    victim_spec = dict(queue_name="team-q", priority_class="low", priority=10, owner=("Job", "train", "job-uid-train"),
                       pod_sets=[make_pod_set("main", count=1, labels=tmpl_labels)], created=T0)
    wl = api.create(WORKLOADS_V1BETA2, make_workload("ml", "job-train-9z8y7", **victim_spec))
    wl_uid = wl["metadata"]["uid"]

    def set_status(conditions, admission=None):
        api.update(WORKLOADS_V1BETA2, make_workload("ml", "job-train-9z8y7", **victim_spec, uid=wl_uid,
                                                    conditions=conditions, admission=admission))

    collector = make_collector(api)
    with running(collector):
        wait_sent(collector, 4)  # urgent: queued, quota_reserved, admitted; train: queued
        wait_watching(api, PODS, WORKLOADS_V1BETA2, EVENTS)
        reserved = [workload_condition("QuotaReserved", at=at(10)), workload_condition("Admitted", at=at(10))]
        set_status(reserved, adm)
        wait_sent(collector, 6)
        # The Job's pod: owned by the Job whose uid the Workload carries in kueue.x-k8s.io/job-uid.
        pod = api.create(PODS, make_pod("ml", "train-0-abcde", node="gpu-1", created=at(11),
                                        labels={"kueue.x-k8s.io/queue-name": "team-q", "kueue.x-k8s.io/podset": "main"},
                                        owner=("Job", "train", "job-uid-train")))
        wait_sent(collector, 9)  # submitted, scheduled, running
        set_status(reserved + [workload_condition("PodsReady", at=at(20))], adm)
        wait_sent(collector, 10)
        msg = (f"Preempted to accommodate a workload (UID: {urgent['metadata']['uid']}, JobUID: job-uid-urgent) due to "
               "prioritization in the ClusterQueue; preemptor path: /gpu-cq; preemptee path: /gpu-cq")
        evicted = [workload_condition("QuotaReserved", "False", "Pending", at=at(30)),
                   workload_condition("Admitted", "False", "NoReservation", at=at(30)),
                   workload_condition("PodsReady", "False", "PodsReady", at=at(30)),
                   workload_condition("Evicted", reason="Preempted", message=msg, at=at(30)),
                   workload_condition("Preempted", reason="InClusterQueue", message=msg, at=at(30))]
        set_status(evicted)
        wait_sent(collector, 12)
        preemptor_pod = api.create(PODS, make_pod("ml", "urgent-0", node="gpu-1", created=at(29), priority=10000))
        api.create(EVENTS, make_event_v1("ml", "train-0-abcde.1", pod, "Preempted",
                                         f"Preempted by pod {preemptor_pod['metadata']['uid']} on node gpu-1",
                                         related=preemptor_pod, event_time=at(30), action="Preempting"))
        wait_sent(collector, 16)  # urgent-0: submitted, scheduled, running; the Preempted Event
        set_status(evicted[:3] + [workload_condition("Evicted", "False", "Preempted", at=at(45)),
                                  workload_condition("Requeued", reason="BackoffFinished", at=at(45))])
        wait_sent(collector, 17)

    events = published(kafka_bootstrap, catalogue.scheduler, 17)
    train = [e for e in events if e.identity.workload_id == "ml/job-train-9z8y7"]
    wl_events = [e for e in train if e.payload.object_kind == "Workload"]
    assert types(wl_events) == ["queued", "quota_reserved", "admitted", "pods_ready", "evicted", "preempted", "requeued"]
    assert all(e.identity.release_id == "rel-7" and e.correlation_key() == "rel-7" for e in wl_events)
    admitted = wl_events[2]
    assert (admitted.payload.queue, admitted.payload.cluster_queue) == ("team-q", "gpu-cq")
    assert (admitted.payload.priority_class, admitted.payload.priority) == ("low", 10)
    assert admitted.payload.flavors["nvidia.com/gpu"] == "a100" and admitted.payload.pod_sets == {"main": 1}
    by_type = {e.event_type: e for e in wl_events}
    for t, reason in (("scheduler.evicted", "Preempted"), ("scheduler.preempted", "InClusterQueue")):
        ev = by_type[t]
        assert ev.payload.reason == reason and ev.occurred_at == at(30)
        assert ev.payload.preemptor.model_dump() == {"kind": "Workload", "namespace": "ml", "name": "job-urgent-1a2b3",
                                                     "uid": urgent["metadata"]["uid"]}
        assert ev.payload.victim.uid == wl_uid
    assert by_type["scheduler.requeued"].payload.reason == "BackoffFinished"

    # The pod belongs to the Workload and carries what the Workload knows.
    pod_events = [e for e in train if e.payload.object_kind == "Pod"]
    assert types(pod_events) == ["submitted", "scheduled", "running"]
    assert pod_events[0].identity.release_id == "rel-7" and pod_events[0].payload.cluster_queue == "gpu-cq"
    assert pod_events[0].payload.queue == "team-q"
    (sched_preempted,) = [e for e in train if e.payload.object_kind == "Event"]
    assert sched_preempted.event_type == "scheduler.preempted" and sched_preempted.identity.pod == "train-0-abcde"
    assert sched_preempted.payload.preemptor.name == "urgent-0"
    assert sched_preempted.payload.preemptor.uid == preemptor_pod["metadata"]["uid"]
    assert sched_preempted.identity.node == "gpu-1"
    urgent_events = [e for e in events if e.identity.workload_id == "ml/job-urgent-1a2b3"]
    assert types(urgent_events) == ["queued", "quota_reserved", "admitted"]


def test_a_pods_last_events_keep_its_workload_after_the_workload_was_deleted(api, make_collector, kafka_bootstrap, catalogue):
    """Deleting a Job deletes its Workload and its pods together, and the pods usually go last. The
    Workload left the index at once, so the pod's finished/deleted were mapped without it: another
    workload_id (ns/Job/train: the pod carries no kueue.x-k8s.io/workload annotation), no
    cluster_queue, flavors or priority, no release id from the Workload's template."""
    adm = {"clusterQueue": "gpu-cq", "podSetAssignments": [pod_set_assignment("main", {"nvidia.com/gpu": "a100"}, count=1)]}
    api.create(WORKLOADS_V1BETA2, make_workload(
        "ml", "job-train-9z8y7", "team-q", "low", 10, owner=("Job", "train", "job-uid-train"), admission=adm,
        pod_sets=[make_pod_set("main", count=1, labels={"gpuledger.io/release-id": "rel-7"})],
        conditions=[workload_condition("QuotaReserved", at=at(1)), workload_condition("Admitted", at=at(1))], created=T0))
    pod_spec = dict(node="gpu-1", created=at(2), labels={"kueue.x-k8s.io/queue-name": "team-q", "kueue.x-k8s.io/podset": "main"},
                    owner=("Job", "train", "job-uid-train"))
    pod = api.create(PODS, make_pod("ml", "train-0-abcde", **pod_spec))
    collector = make_collector(api)
    with running(collector):
        wait_sent(collector, 3 + 3)  # the Workload: queued, quota_reserved, admitted; the pod: submitted, scheduled, running
        wait_watching(api, PODS, WORKLOADS_V1BETA2)
        api.delete(WORKLOADS_V1BETA2, "ml", "job-train-9z8y7")
        wait_sent(collector, 7)
        api.update(PODS, make_pod("ml", "train-0-abcde", phase="Failed", uid=pod["metadata"]["uid"], **pod_spec))
        wait_sent(collector, 8)
        api.delete(PODS, "ml", "train-0-abcde")
        wait_sent(collector, 9)

    events = published(kafka_bootstrap, catalogue.scheduler, 9)
    pod_events = [e for e in events if e.payload.object_kind == "Pod"]
    assert sorted(types(pod_events)) == ["deleted", "finished", "running", "scheduled", "submitted"]
    assert {e.event_type: e.identity.workload_id for e in pod_events} == dict.fromkeys(
        ("scheduler.submitted", "scheduler.scheduled", "scheduler.running", "scheduler.finished", "scheduler.deleted"), "ml/job-train-9z8y7")
    for e in pod_events:
        assert (e.identity.release_id, e.payload.queue, e.payload.cluster_queue) == ("rel-7", "team-q", "gpu-cq"), e.event_type
        assert e.payload.flavors == {"nvidia.com/gpu": "a100"} and e.payload.priority_class == "low", e.event_type
    state = collector.state.get(pod["metadata"]["uid"])
    assert state["id"]["workload_id"] == "ml/job-train-9z8y7" and state["id"]["release_id"] == "rel-7"


def test_a_deleted_workload_stays_in_the_index_for_the_tombstone_ttl_and_a_new_one_replaces_it():
    wl = workload_info(make_workload("ml", "wl", owner=("Job", "train", "job-uid"), uid="wl-1", created=T0), ("nvidia.com/gpu",), "gpuledger.io/")
    index = KueueIndex()
    index.add(wl)
    index.tombstone("wl-1", now=100.0)
    assert index.by_owner("job-uid") is wl and index.by_name("ml", "wl") is wl
    again = workload_info(make_workload("ml", "wl", owner=("Job", "train", "job-uid"), uid="wl-2", created=T0), ("nvidia.com/gpu",), "gpuledger.io/")
    index.add(again)  # Kueue re-creates the Job's Workload: the live one wins
    assert index.by_owner("job-uid") is again and index.by_name("ml", "wl") is again and index.by_uid("wl-1") is wl
    assert index.prune(3600, now=100.0 + 3600) == 0
    assert index.prune(3600, now=100.0 + 3601) == 1
    assert index.by_uid("wl-1") is None and index.by_owner("job-uid") is again and index.by_name("ml", "wl") is again


def test_every_preemption_cycle_of_a_workload_is_a_requeue(api, make_collector, kafka_bootstrap, catalogue, tmp_path):
    """Kueue sets Requeued without a transition time of its own: Requeued=True reason=Preempted
    stays True through re-admission and the next preemption sets it again unchanged, so the second
    requeue had the first one's (type, reason, lastTransitionTime) and was never published. The
    statuses below are the ones Kueue v0.17 writes (workload.Evict, the job reconciler's
    SetRequeuedCondition + UnsetQuotaReservationWithCondition, SetQuotaReservation on re-admission);
    each step is listed by a collector restarted on the same state file."""
    adm = {"clusterQueue": "gpu-cq", "podSetAssignments": [pod_set_assignment("main", {"nvidia.com/gpu": "a100"}, count=1)]}
    spec = dict(queue_name="team-q", priority_class="low", priority=10, owner=("Job", "train", "job-uid-train"), created=T0)
    wl = api.create(WORKLOADS_V1BETA2, make_workload("ml", "job-train-9z8y7", **spec))
    msg = "Preempted to accommodate a workload (UID: wl-urgent, JobUID: job-uid-urgent) due to prioritization in the ClusterQueue"

    def step(conditions, admission=None) -> int:
        api.update(WORKLOADS_V1BETA2, make_workload("ml", "job-train-9z8y7", **spec, uid=wl["metadata"]["uid"],
                                                    conditions=conditions, admission=admission))
        collector = make_collector(api, tmp_path / "wl-state")
        try:
            return collector.run_once()
        finally:
            collector.close()

    def admitted(t):
        return [workload_condition("QuotaReserved", reason="QuotaReserved", at=at(t)), workload_condition("Admitted", at=at(t))]

    def preempted(evicted_at, released_at):  # evicted, then the job stopped: quota released and requeued in one patch
        return [workload_condition("QuotaReserved", "False", "Pending", message=msg, at=at(released_at)),
                workload_condition("Admitted", "False", "NoReservation", at=at(released_at)),
                workload_condition("Evicted", reason="Preempted", message=msg, at=at(evicted_at)),
                workload_condition("Preempted", reason="InClusterQueue", message=msg, at=at(evicted_at))]

    requeued = workload_condition("Requeued", reason="Preempted", message=msg, at=at(31))  # never re-dated by Kueue
    assert step(admitted(10), adm) == 3  # queued, quota_reserved, admitted
    assert step(preempted(30, 31) + [requeued]) == 3  # evicted, preempted, requeued
    readmitted = admitted(40) + [workload_condition("Evicted", "False", "QuotaReserved", message="Previously: " + msg, at=at(40)),
                                 workload_condition("Preempted", "False", "QuotaReserved", message="Previously: " + msg, at=at(40)),
                                 requeued]
    assert step(readmitted, adm) == 2  # quota_reserved, admitted again
    # Preempted again: Evicted is re-dated; the quota is still held while the job stops ...
    stopping = admitted(40) + preempted(60, 60)[2:] + [requeued]
    assert step(stopping, adm) == 2  # evicted, preempted; no requeue yet
    assert step(preempted(60, 62) + [requeued]) == 1  # ... then released: the second requeue
    assert step(preempted(60, 62) + [requeued]) == 0

    events = published(kafka_bootstrap, catalogue.scheduler, 13)
    requeues = [e for e in events if e.event_type == "scheduler.requeued"]
    assert [(e.occurred_at, e.payload.reason) for e in requeues] == [(at(31), "Preempted"), (at(62), "Preempted")]
    assert types(events).count("evicted") == 2 and types(events).count("quota_reserved") == 2


def test_v1beta1_only_cluster(make_collector, kafka_bootstrap, catalogue):
    with FakeKubeApi(kueue_versions=("v1beta1",)) as server:
        adm = {"clusterQueue": "cq-b", "podSetAssignments": [pod_set_assignment("main", {"nvidia.com/gpu": "h100"}, count=2)]}
        server.create(WORKLOADS_V1BETA1, make_workload(
            "research", "pod-group-7", "lq", "high", 500, version="v1beta1", admission=adm,
            pod_sets=[make_pod_set("main", count=2)],
            conditions=[workload_condition("QuotaReserved", at=at(3)), workload_condition("Admitted", at=at(4))], created=T0))
        # A plain pod naming its Workload through the annotation Kueue sets on the pod template.
        server.create(PODS, make_pod("research", "worker-0", node="gpu-9", created=at(5),
                                     annotations={"kueue.x-k8s.io/workload": "pod-group-7"}))
        collector = make_collector(server)
        assert collector.run_once() == 6
        assert collector.kueue_version == "v1beta1"
        assert not [r for r in server.requests if "v1beta2" in r.path and r.path.endswith("workloads")]
    events = published(kafka_bootstrap, catalogue.scheduler, 6)
    assert {e.identity.workload_id for e in events} == {"research/pod-group-7"}
    admitted = [e for e in events if e.event_type == "scheduler.admitted"][0]
    assert (admitted.payload.priority_class, admitted.payload.priority, admitted.payload.cluster_queue) == ("high", 500, "cq-b")
    assert admitted.payload.gpus_requested == 2 and admitted.payload.flavors == {"nvidia.com/gpu": "h100"}
    pod_event = [e for e in events if e.payload.object_kind == "Pod"][0]
    assert pod_event.payload.cluster_queue == "cq-b"


def test_the_workload_version_is_one_that_serves_workloads_not_just_one_the_group_lists(make_collector, kafka_bootstrap, catalogue):
    """From an exploratory review on a real cluster: Workloads served at v1beta1 only (the CRD's
    v1beta2 `served: false`) while Kueue's other kinds kept v1beta2, so the group still listed it:
    the collector chose v1beta2, every Workload request was 404 and nothing at all was collected
    (`--once`: "HTTP 404 Not Found", exit 1)."""
    from gpuledger.sim.kube_api import KUEUE_GROUP

    with FakeKubeApi(kueue_versions=("v1beta2", "v1beta1")) as server:
        server.set_served(KUEUE_GROUP, "v1beta2", "workloads", False)
        server.create(WORKLOADS_V1BETA1, make_workload("research", "pod-group-7", "lq", "high", 500, version="v1beta1", created=T0))
        server.create(PODS, make_pod("research", "worker-0", node="gpu-9", created=at(5),
                                     annotations={"kueue.x-k8s.io/workload": "pod-group-7"}))
        collector = make_collector(server)
        assert collector.run_once() == 4  # the Workload queued; the pod submitted, scheduled, running
        assert collector.kueue_version == "v1beta1"
    events = published(kafka_bootstrap, catalogue.scheduler, 4)
    assert [e.identity.workload_id for e in events if e.payload.object_kind == "Workload"] == ["research/pod-group-7"]


def test_kueue_absent_pods_still_collected_and_kueue_found_later(make_collector, kafka_bootstrap, catalogue):
    with FakeKubeApi(kueue_versions=()) as server:
        server.create(PODS, make_pod("ml", "train-0", node="gpu-1", created=T0, owner=("Job", "train"),
                                     labels={"kueue.x-k8s.io/queue-name": "q"}))
        collector = make_collector(server)
        with running(collector):
            wait_sent(collector, 3)
            assert collector.kueue_version is None
            wait_watching(server, PODS, EVENTS)
            server.set_kueue_versions(["v1beta2"])  # Kueue installed while we run
            server.create(WORKLOADS_V1BETA2, make_workload("ml", "later", created=at(1)))
            wait_sent(collector, 4)
            assert collector.kueue_version == "v1beta2"
        assert collector.counters.totals["rejected"] == 0
    events = published(kafka_bootstrap, catalogue.scheduler, 4)
    pods = [e for e in events if e.payload.object_kind == "Pod"]
    assert types(pods) == ["submitted", "scheduled", "running"]
    assert pods[0].identity.workload_id == "ml/Job/train"  # no Workload known: the owning controller
    assert [e.identity.workload_id for e in events if e.payload.object_kind == "Workload"] == ["ml/later"]


class CoreEventsOnlyApi(FakeKubeApi):
    """A cluster that does not serve events.k8s.io (older or trimmed API server)."""

    def _group_versions(self, group):
        return () if group == EVENTS_GROUP else super()._group_versions(group)

    def _served(self, rt):
        return rt.group != EVENTS_GROUP and super()._served(rt)


def test_core_v1_events_fallback(make_collector, kafka_bootstrap, catalogue):
    with CoreEventsOnlyApi(kueue_versions=()) as server:
        pod = server.create(PODS, make_pod("ml", "train-0", node="gpu-1", created=T0))
        cpu = server.create(PODS, make_pod("ml", "web-0", gpus=0, node="cpu-1", created=T0))
        server.create(CORE_EVENTS, make_core_event("ml", "train-0.1", pod, "Scheduled",
                                                   "Successfully assigned ml/train-0 to gpu-1", first_timestamp=at(1)))
        server.create(CORE_EVENTS, make_core_event("ml", "train-0.2", pod, "Preempted",
                                                   "Preempted by ml/urgent-0 on node gpu-1", first_timestamp=at(2)))
        server.create(CORE_EVENTS, make_core_event("ml", "train-0.3", pod, "Killing", "Stopping container main",
                                                   source_component="kubelet", first_timestamp=at(3)))  # not mapped
        server.create(CORE_EVENTS, make_core_event("ml", "web-0.1", cpu, "Scheduled",
                                                   "Successfully assigned ml/web-0 to cpu-1", first_timestamp=at(1)))
        collector = make_collector(server)
        assert collector.run_once() == 5
        assert collector.events_api == "v1"
        assert server.requests_to("/api/v1/events") and not [r for r in server.requests if r.path.startswith("/apis/events.k8s.io/v1/")]
        assert server.requests_to("/api/v1/events")[0].query["fieldSelector"] == "involvedObject.kind=Pod"
    events = published(kafka_bootstrap, catalogue.scheduler, 5)
    from_events = [e for e in events if e.payload.object_kind == "Event"]
    assert types(from_events) == ["scheduled", "preempted"]
    assert from_events[0].identity.node == "gpu-1" and from_events[0].occurred_at == at(1)
    assert from_events[1].payload.preemptor.model_dump() == {"kind": "Pod", "namespace": "ml", "name": "urgent-0", "uid": None}
    assert {e.identity.pod for e in events} == {"train-0"}


# ------------------------------------------------------------------------------- resilience


def test_410_relist_publishes_missed_changes_and_no_duplicates(api, make_collector, kafka_bootstrap, catalogue, caplog):
    caplog.set_level(logging.DEBUG, logger="producers.kubernetes")  # repeats of a failure streak log at DEBUG
    p1 = api.create(PODS, make_pod("ml", "p1", created=T0))  # pending
    api.create(PODS, make_pod("ml", "p2", node="gpu-1", created=T0))
    collector = make_collector(api, backoff_initial_s=0.2, backoff_max_s=0.4)
    with running(collector):
        wait_sent(collector, 2 + 3)
        wait_watching(api, PODS)
        # Keep the collector off the pods API for a while, cut its watch, change things
        # behind its back and compact history past its resourceVersion.
        api.fail_next(2, 503, path="/api/v1/pods")
        api.drop_watches(PODS)
        wait_until(lambda: api.open_watches(PODS) == 0, what="pod watch closed")
        api.update(PODS, make_pod("ml", "p1", node="gpu-2", uid=p1["metadata"]["uid"], created=T0))
        api.delete(PODS, "ml", "p2")
        api.create(WORKLOADS_V1BETA2, make_workload("ml", "unrelated", pod_sets=[make_pod_set(gpus=0)]))
        api.compact()
        wait_sent(collector, 5 + 3)  # p1 scheduled + running, p2 deleted (seen by its absence)
        wait_watching(api, PODS)
        # A second 410 with nothing changed re-publishes nothing.
        api.create(WORKLOADS_V1BETA2, make_workload("ml", "unrelated-2", pod_sets=[make_pod_set(gpus=0)]))
        api.compact()
        n_lists = len(api.requests_to("/api/v1/pods", watch=False))
        api.drop_watches(PODS)
        wait_until(lambda: len(api.requests_to("/api/v1/pods", watch=False)) > n_lists, what="re-list")
        wait_watching(api, PODS)
        time.sleep(0.3)
    assert caplog.text.count("pods: watch expired") == 2
    assert "HTTP 503 Service Unavailable; retrying" in caplog.text
    watches = api.requests_to("/api/v1/pods", watch=True)
    assert len(watches) >= 3 and all(w.query.get("allowWatchBookmarks") == "true" for w in watches)
    assert collector.counters.totals["sent"] == 8
    events = published(kafka_bootstrap, catalogue.scheduler, 8)
    assert Counter((e.identity.pod, e.event_type.split(".")[1]) for e in events) == Counter({
        ("p1", "submitted"): 1, ("p1", "failed_scheduling"): 1, ("p1", "scheduled"): 1, ("p1", "running"): 1,
        ("p2", "submitted"): 1, ("p2", "scheduled"): 1, ("p2", "running"): 1, ("p2", "deleted"): 1})


def test_api_errors_and_dropped_watch_back_off_and_resume(api, make_collector, kafka_bootstrap, catalogue, caplog):
    caplog.set_level(logging.INFO, logger="producers.kubernetes")
    api.fail_next(3, 500, path="/api/v1/pods")  # the first lists fail
    api.create(PODS, make_pod("ml", "a", node="gpu-1", created=T0))
    collector = make_collector(api)
    with running(collector):
        wait_sent(collector, 3)
        wait_watching(api, PODS)
        # A bookmark moves the resume point past unrelated changes ...
        api.create(WORKLOADS_V1BETA2, make_workload("ml", "cpu", pod_sets=[make_pod_set(gpus=0)]))
        api.send_bookmark(PODS)
        wait_until(lambda: collector.pods.rv == api.resource_version, what="bookmark applied")
        bookmark_rv = collector.pods.rv
        api.compact()
        lists_before = len(api.requests_to("/api/v1/pods", watch=False))
        # ... so an abrupt disconnect (urllib3 ProtocolError) resumes without a re-list.
        api.drop_watches(PODS)
        wait_until(lambda: api.requests_to("/api/v1/pods", watch=True)[-1].query.get("resourceVersion") == bookmark_rv
                   and api.open_watches(PODS) == 1, what="re-watch from the bookmark")
        api.create(PODS, make_pod("ml", "b", created=at(1)))
        wait_sent(collector, 5)
        assert len(api.requests_to("/api/v1/pods", watch=False)) == lists_before
        # Watch requests failing with 500 are retried too.
        api.fail_next(2, 500, path="/api/v1/pods")
        api.drop_watches(PODS, graceful=True)
        api.create(PODS, make_pod("ml", "c", created=at(2)))
        wait_sent(collector, 7)
    assert len(api.requests_to("/api/v1/pods", watch=False)) == 4  # 3 failed + 1 initial list
    assert "pods: initial list failed: HTTP 500" in caplog.text
    assert "pods: ProtocolError" in caplog.text and "watch expired" not in caplog.text
    events = published(kafka_bootstrap, catalogue.scheduler, 7)
    assert Counter(e.identity.pod for e in events) == {"a": 3, "b": 2, "c": 2}


def test_event_that_overtakes_its_pod_is_linked_by_reading_the_pod(api, make_collector, kafka_bootstrap, catalogue):
    collector = make_collector(api, backoff_initial_s=0.5, backoff_max_s=1.0)
    with running(collector):
        wait_watching(api, PODS, EVENTS)
        api.fail_next(3, 503, path="/api/v1/pods")  # the pod watch is down for a while ...
        api.drop_watches(PODS)
        wait_until(lambda: api.open_watches(PODS) == 0, what="pod watch closed")
        pod = api.create(PODS, make_pod("ml", "fast", created=T0))
        api.create(EVENTS, make_event_v1("ml", "fast.1", pod, "FailedScheduling", "0/8 nodes are available",
                                         type="Warning", event_time=at(1)))
        wait_sent(collector, 1)  # ... so the Event came first and its pod was read by name
        assert api.requests_to("/api/v1/namespaces/ml/pods/fast")
        wait_sent(collector, 3)
    events = published(kafka_bootstrap, catalogue.scheduler, 3)
    assert [(e.payload.object_kind, e.event_type) for e in events][0] == ("Event", "scheduler.failed_scheduling")
    assert {e.identity.workload_id for e in events} == {"ml/Pod/fast"}


def test_a_cancelled_taint_eviction_is_not_an_eviction(api, make_collector, kafka_bootstrap, catalogue):
    """The taint manager records TaintManagerEviction both for "Marking for deletion Pod …" and for
    "Cancelling deletion of Pod …" (a scheduled deletion called off: the pod stays); both were
    published as scheduler.evicted. The Events here name the pod with its UID so that the pod is
    found and the message alone decides (the real taint manager's name no UID: next test)."""
    pod = api.create(PODS, make_pod("ml", "train-0", node="gpu-1", created=T0))
    collector = make_collector(api)
    with running(collector):
        wait_sent(collector, 3)  # submitted, scheduled, running
        wait_watching(api, PODS, EVENTS)
        api.create(EVENTS, make_event_v1("ml", "train-0.1", pod, "TaintManagerEviction", "Cancelling deletion of Pod ml/train-0",
                                         event_time=at(30), reporting_controller="taint-eviction-controller"))
        api.create(EVENTS, make_event_v1("ml", "train-0.2", pod, "TaintManagerEviction", "Marking for deletion Pod ml/train-0",
                                         event_time=at(40), reporting_controller="taint-eviction-controller"))
        wait_sent(collector, 4)  # the Events are handled in order: the cancellation came first
    events = published(kafka_bootstrap, catalogue.scheduler, 4)
    (evicted,) = [e for e in events if e.payload.object_kind == "Event"]
    assert (evicted.event_type, evicted.occurred_at, evicted.identity.pod_uid) == ("scheduler.evicted", at(40), pod["metadata"]["uid"])
    assert evicted.payload.message == "Marking for deletion Pod ml/train-0"


def test_an_event_naming_its_pod_without_uid_is_not_attached_to_a_later_pod_of_that_name(api, make_collector, kafka_bootstrap,
                                                                                        catalogue):
    """The taint manager's Events name the pod by namespace/name only. On a watch such an Event's
    pod was read by name, and after a StatefulSet re-created the pod that was the new pod: the
    eviction was published on the incarnation that was never evicted. Here the Event, the old
    pod's deletion and the new pod fall in one second, so a creationTimestamp comparison would not
    have told them apart either. The eviction is still recorded once, from the old pod's
    DisruptionTarget condition."""
    old = api.create(PODS, make_pod("ml", "db-0", node="gpu-1", created=T0, owner=("StatefulSet", "db")))
    collector = make_collector(api)
    with running(collector):
        wait_sent(collector, 3)
        wait_watching(api, PODS, EVENTS)
        api.update(PODS, make_pod("ml", "db-0", node="gpu-1", created=T0, owner=("StatefulSet", "db"), uid=old["metadata"]["uid"],
                                  conditions=[pod_condition("PodScheduled", at=T0),
                                              disruption_target("DeletionByTaintManager", at=at(61))]))
        api.delete(PODS, "ml", "db-0")
        new = api.create(PODS, make_pod("ml", "db-0", node="gpu-2", created=at(61), owner=("StatefulSet", "db")))
        wait_sent(collector, 8)  # old: evicted, deleted; new: submitted, scheduled, running
        api.create(EVENTS, make_event_v1("ml", "db-0.1", {"kind": "Pod", "namespace": "ml", "name": "db-0", "apiVersion": "v1"},
                                         "TaintManagerEviction", "Marking for deletion Pod ml/db-0", event_time=at(61),
                                         reporting_controller="taint-eviction-controller"))
        # Handled after the one above (one watch, in order): once it is sent, the one above was decided.
        api.create(EVENTS, make_event_v1("ml", "db-0.2", new, "Scheduled", "Successfully assigned ml/db-0 to gpu-2", event_time=at(62)))
        wait_sent(collector, 9)
    events = published(kafka_bootstrap, catalogue.scheduler, 9)
    assert [(e.payload.object_kind, e.event_type, e.identity.pod_uid) for e in events if e.payload.object_kind == "Event"] == [
        ("Event", "scheduler.scheduled", new["metadata"]["uid"])]
    (evicted,) = [e for e in events if e.event_type == "scheduler.evicted"]
    assert (evicted.identity.pod_uid, evicted.payload.object_kind, evicted.payload.reason) == (
        old["metadata"]["uid"], "Pod", "DeletionByTaintManager")
    assert not api.requests_to("/api/v1/namespaces/ml/pods/db-0")  # not looked up by name at all


def test_one_namespace_only(api, make_collector, kafka_bootstrap, catalogue):
    api.create(PODS, make_pod("ml", "mine", node="gpu-1", created=T0))
    api.create(PODS, make_pod("other", "theirs", node="gpu-1", created=T0))
    api.create(WORKLOADS_V1BETA2, make_workload("other", "wl", created=T0))
    collector = make_collector(api, namespace="ml")
    assert collector.run_once() == 3
    assert api.requests_to("/api/v1/namespaces/ml/pods") and not api.requests_to("/api/v1/pods")
    assert api.requests_to("/apis/kueue.x-k8s.io/v1beta2/namespaces/ml/workloads")
    assert {e.identity.pod for e in published(kafka_bootstrap, catalogue.scheduler, 3)} == {"mine"}


def test_restart_publishes_changes_made_while_down_and_no_duplicates(api, make_collector, kafka_bootstrap, catalogue, tmp_path):
    state_dir = tmp_path / "shared-state"
    keep = api.create(PODS, make_pod("ml", "keep", node="gpu-1", created=T0))
    api.create(PODS, make_pod("ml", "goes", node="gpu-2", created=T0))
    pend = api.create(PODS, make_pod("ml", "pend", created=T0))
    wl = api.create(WORKLOADS_V1BETA2, make_workload("ml", "wl", created=T0))
    first = make_collector(api, state_dir)
    with running(first):
        wait_sent(first, 3 + 3 + 2 + 1)
    assert json.loads((state_dir / "scheduler-state.json").read_text())["objects"][keep["metadata"]["uid"]]["keys"]

    # While the collector is down: a pod finishes, one is deleted, one is scheduled,
    # one is created, the Workload is admitted; history is compacted.
    api.update(PODS, make_pod("ml", "keep", node="gpu-1", phase="Succeeded", uid=keep["metadata"]["uid"], created=T0))
    api.delete(PODS, "ml", "goes")
    api.update(PODS, make_pod("ml", "pend", node="gpu-3", uid=pend["metadata"]["uid"], created=T0))
    api.create(PODS, make_pod("ml", "new", created=at(100)))
    api.update(WORKLOADS_V1BETA2, make_workload("ml", "wl", uid=wl["metadata"]["uid"], created=T0,
                                                conditions=[workload_condition("QuotaReserved", at=at(50))]))
    api.compact()

    second = make_collector(api, state_dir)
    with running(second):
        wait_sent(second, 1 + 1 + 2 + 2 + 1)
        time.sleep(0.5)
    assert second.counters.totals["sent"] == 7
    events = published(kafka_bootstrap, catalogue.scheduler, 9 + 7)
    got = Counter((e.identity.pod or e.identity.workload_id, e.event_type.split(".")[1]) for e in events)
    assert set(got.values()) == {1}
    assert {k for k in got if k[0] in ("keep", "goes", "pend", "new")} >= {
        ("keep", "finished"), ("goes", "deleted"), ("pend", "scheduled"), ("pend", "running"),
        ("new", "submitted"), ("new", "failed_scheduling")}
    assert ("ml/wl", "quota_reserved") in got


def test_one_running_per_pod_even_after_container_restarts_and_a_lost_state_file(api, make_collector, kafka_bootstrap, catalogue,
                                                                                 tmp_path):
    """running's id carried the earliest *current* container start: a restart replaces
    running.startedAt (the previous run moves to lastState), so a pod re-listed after the state file
    was lost published a second running under another id (and, while the container waited in
    CrashLoopBackOff, one more at startTime)."""
    state_dir = tmp_path / "state-lost"
    pod = make_pod("ml", "train-0", node="gpu-1", created=T0)
    uid = pod["metadata"]["uid"]
    status = pod["status"]["containerStatuses"][0]
    status["state"] = {"running": {"startedAt": "2026-11-30T10:00:10Z"}}
    api.create(PODS, pod)

    def relist_without_state(container_status) -> int:
        (state_dir / "scheduler-state.json").unlink(missing_ok=True)
        api.update(PODS, {**pod, "status": {**pod["status"], "containerStatuses": [{**status, **container_status}]}})
        collector = make_collector(api, state_dir)
        try:
            return collector.run_once()
        finally:
            collector.close()

    first = make_collector(api, state_dir)
    assert first.run_once() == 3  # submitted, scheduled, running
    first.close()
    restarted = {"state": {"running": {"startedAt": "2026-11-30T10:00:50Z"}}, "restartCount": 1,
                 "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": "2026-11-30T10:00:10Z",
                                              "finishedAt": "2026-11-30T10:00:49Z"}}}
    kept = make_collector(api, state_dir)  # with the state file: nothing new
    api.update(PODS, {**pod, "status": {**pod["status"], "containerStatuses": [{**status, **restarted}]}})
    assert kept.run_once() == 0
    kept.close()
    assert relist_without_state(restarted) == 3  # state lost: everything again, under the same ids
    crash_looping = {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "restartCount": 2, "ready": False, "started": False,
                     "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": "2026-11-30T10:00:50Z",
                                                  "finishedAt": "2026-11-30T10:00:55Z"}}}
    assert relist_without_state(crash_looping) == 3

    events = read_topic(kafka_bootstrap, catalogue.scheduler, min_count=9, timeout=20, settle=1.0)
    by_type: dict[str, list] = {}
    for e in (decode_event(m.value()) for m in events):
        assert e.identity.pod_uid == uid
        by_type.setdefault(e.event_type, []).append(e)
    assert sorted(by_type) == ["scheduler.running", "scheduler.scheduled", "scheduler.submitted"]
    assert all(len(evs) == 3 and len({e.event_id for e in evs}) == 1 for evs in by_type.values())  # one fact each, sent 3 times
    running_at = sorted(e.occurred_at for e in by_type["scheduler.running"])
    assert running_at == [at(10), at(10), at(50)]  # the earliest start the status still shows (lastState keeps one run)


def test_malformed_objects_are_skipped_counted_and_the_rest_published(api, make_collector, kafka_bootstrap, catalogue):
    no_uid = make_pod("ml", "no-uid", node="gpu-1")
    no_uid["metadata"]["uid"] = ""
    api.create(PODS, no_uid)
    api.create(PODS, make_pod("ml", "bad-time", node="gpu-1", created="yesterday"))
    api.create(WORKLOADS_V1BETA2, make_workload("ml", "bad-cond", conditions=[
        workload_condition("Admitted", at="not-a-time")]))
    good = api.create(PODS, make_pod("ml", "good", node="gpu-1", created=T0))
    bad_event = make_event_v1("ml", "good.1", good, "Scheduled", "Successfully assigned ml/good to gpu-1", event_time=T0)
    bad_event["eventTime"] = "31/12/2026"
    api.create(EVENTS, bad_event)
    api.create(WORKLOADS_V1BETA2, make_workload("ml", "fine", created=T0))

    collector = make_collector(api)
    assert collector.run_once() == 4
    assert collector.counters.totals["rejected.malformed"] == 4
    events = published(kafka_bootstrap, catalogue.scheduler, 4)
    assert Counter(e.identity.pod or e.identity.workload_id for e in events) == {"good": 3, "ml/fine": 1}


def test_an_identity_annotation_the_event_refuses_is_left_out_and_the_pod_is_still_collected(api, make_collector, kafka_bootstrap,
                                                                                               catalogue, caplog):
    """Found by a review: a line break in a ``gpuledger.io/owner`` annotation (an annotation's value is
    its creator's to write) made the pod unreadable as a whole — "Pod ml/p skipped", counted as
    malformed — so a GPU workload could keep its whole history out of gpuledger, and every control
    blind to it, with one annotation. The pod is collected without that field, which is said and
    counted; a label naming the same field still wins over the annotation."""
    caplog.set_level(logging.WARNING, logger="producers.kubernetes")
    api.create(PODS, make_pod("ml", "hidden", node="gpu-1", created=T0, labels={"gpuledger.io/release-id": "rel-1"},
                              annotations={"gpuledger.io/owner": "fraud\nteam", "gpuledger.io/model": "fraud-\u202escorer"}))
    api.create(PODS, make_pod("ml", "labelled", node="gpu-1", created=T0, labels={"gpuledger.io/owner": "fraud-team"},
                              annotations={"gpuledger.io/owner": "fraud\nteam"}))
    collector = make_collector(api)
    sent = collector.run_once()
    events = published(kafka_bootstrap, catalogue.scheduler, sent)
    by_pod = {e.identity.pod: e.identity for e in events}
    assert sorted(by_pod) == ["hidden", "labelled"] and sent >= 2, events
    assert (by_pod["hidden"].release_id, by_pod["hidden"].owner, by_pod["hidden"].model_name) == ("rel-1", None, None)
    assert by_pod["labelled"].owner == "fraud-team"  # the label's usable value; the annotation's is not said to be refused
    assert collector.counters.totals.get("rejected.malformed", 0) == 0 and collector.counters.totals["refused"] == 2
    said = sorted(r.getMessage() for r in caplog.records if "left out of its identity" in r.getMessage())
    assert said[0] == ("Pod ml/hidden: gpuledger.io/model left out of its identity (the object is collected without it): "
                       "contains U+202E (RIGHT-TO-LEFT OVERRIDE) at position 6; identifiers must not carry control or bidi characters")
    assert len(said) == 2 and said[1].startswith("Pod ml/hidden: gpuledger.io/owner left out of its identity"), said


def test_oversize_events_are_cut_or_dead_lettered_never_dropped(api, make_collector, kafka_bootstrap, catalogue):
    # A scheduler message far over its 8 KiB cap: cut with a marker, the event published.
    message = "0/64 nodes are available: " + "64 Insufficient nvidia.com/gpu. " * 10_000
    api.create(PODS, make_pod("ml", "wordy", created=T0, conditions=[
        pod_condition("PodScheduled", "False", "Unschedulable", message=message, at=T0)]))
    # An identity annotation no event can carry (identity is never cut): dead-lettered.
    api.create(PODS, make_pod("ml", "heavy", node="gpu-1", created=T0, annotations={"gpuledger.io/owner": "o" * 300_000}))

    collector = make_collector(api)
    published_count = collector.run_once()
    dead = [DeadLetter.model_validate_json(m.value()) for m in read_topic(kafka_bootstrap, catalogue.deadletter, min_count=1, timeout=20)]
    limit = collector.publisher.max_event_bytes
    assert dead and {d.reason for d in dead} == {"event_too_large"} and {d.stage for d in dead} == {COMPONENT}
    assert all(f"limit_bytes={limit}" in d.error and "size_bytes=" in d.error for d in dead)
    assert {d.source_topic for d in dead} == {catalogue.scheduler} and {d.key for d in dead} == {"ml/Pod/heavy"}
    assert collector.counters.totals["rejected.event_too_large"] == len(dead)

    events = published(kafka_bootstrap, catalogue.scheduler, published_count)
    assert len(events) == published_count and not of(events, pod="heavy")
    failed = [e for e in of(events, pod="wordy") if e.event_type == "scheduler.failed_scheduling"]
    assert len(failed) == 1 and len(failed[0].payload.message.encode()) <= 8 * 1024
    assert failed[0].payload.message.startswith("0/64 nodes are available: 64 Insufficient")
    assert "…[truncated " in failed[0].payload.message and collector.counters.totals["truncated"] >= 1

    # Dead-lettered events are settled like published ones: a re-list sends nothing again.
    assert make_collector(api).run_once() == 0
    assert len(read_topic(kafka_bootstrap, catalogue.deadletter, min_count=len(dead), timeout=20)) == len(dead)


def test_cli_once_and_sigterm_stop(api, kafka_bootstrap, catalogue, tmp_path):
    from gpuledger.cli import app
    from gpuledger.dev.process import ServiceProcess

    api.create(PODS, make_pod("ml", "train-0", node="gpu-1", created=T0))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    env = {"GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix, "GPULEDGER_DATA_DIR": str(tmp_path / "data"),
           "GPULEDGER_SCHEDULER_BACKOFF_INITIAL_S": "0.05", "GPULEDGER_SCHEDULER_HOST": "cli"}
    state = tmp_path / "cli-state"
    args = ["collect", "scheduler", "--kubeconfig", str(kubeconfig), "--state-dir", str(state), "--bootstrap", kafka_bootstrap]
    result = CliRunner().invoke(app, [*args, "--once"], env=env)
    assert result.exit_code == 0, result.output
    assert "published 3 event(s)" in result.output

    bad = CliRunner().invoke(app, [*args, "--once", "--in-cluster"], env={**env, "GPULEDGER_SCHEDULER_LABEL_PREFIX": "x"})
    assert bad.exit_code == 2
    assert "GPULEDGER_SCHEDULER_LABEL_PREFIX" in bad.output
    both = CliRunner().invoke(app, [*args, "--once", "--in-cluster"], env=env)
    assert both.exit_code == 2 and "exclude each other" in both.output

    # The long-running form: a real process, stopped with SIGTERM after it published.
    service = ServiceProcess([*args, "--gpu-resource", "nvidia.com/gpu"], env, tmp_path / "collector.log").start()
    try:
        api.wait_for_watches(1, PODS, timeout=20)
        api.create(PODS, make_pod("ml", "train-1", created=at(1)))
        wait_until(lambda: len(json.loads((state / "scheduler-state.json").read_text())["objects"]) == 2, 10, "state written")
    finally:
        code = service.stop(grace=10)
    assert code == 0, service.log_tail()
    events = published(kafka_bootstrap, catalogue.scheduler, 5)
    assert Counter(e.identity.pod for e in events) == {"train-0": 3, "train-1": 2}


def test_deployment_manifest_matches_the_collector():
    import yaml

    from gpuledger.cli import app

    path = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "base" / "scheduler" / "collector.yaml"
    docs = {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}
    rules = sorted((tuple(r["apiGroups"]), tuple(sorted(r["resources"])), tuple(sorted(r["verbs"]))) for r in docs["ClusterRole"]["rules"])
    read = ("get", "list", "watch")
    assert rules == [(("",), ("events", "pods"), read), (("events.k8s.io",), ("events",), read), (("kueue.x-k8s.io",), ("workloads",), read),
                     (("resource.k8s.io",), ("resourceclaims", "resourceslices"), read)]
    assert docs["ClusterRoleBinding"]["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]
    spec = docs["Deployment"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    (container,) = spec["template"]["spec"]["containers"]
    known = {f"GPULEDGER_SCHEDULER_{name.upper()}" for name in SchedulerCollectorSettings.model_fields}
    env = {e["name"] for e in container["env"]}
    assert not {n for n in env if n.startswith("GPULEDGER_SCHEDULER_")} - known
    assert "GPULEDGER_SCHEDULER_STATE_DIR" in env
    result = CliRunner().invoke(app, [*container["args"], "--help"])
    assert result.exit_code == 0, result.output


def test_settings_report_every_problem_at_once(monkeypatch):
    monkeypatch.setenv("GPULEDGER_SCHEDULER_GPU_RESOURCES", "nvidia.com/gpu, amd.com/gpu")
    assert SchedulerCollectorSettings().gpu_resources == ("nvidia.com/gpu", "amd.com/gpu")
    monkeypatch.setenv("GPULEDGER_SCHEDULER_EVENT_REASONS", '{"Killing": "scheduler.killed"}')
    with pytest.raises(SettingsError) as exc:
        Settings.load(collectors={"scheduler": {"label_prefix": "acme.io", "page_size": 0}})
    text = str(exc.value)
    assert "GPULEDGER_SCHEDULER_EVENT_REASONS" in text and "GPULEDGER_SCHEDULER_LABEL_PREFIX" in text
    assert "GPULEDGER_SCHEDULER_PAGE_SIZE" in text


# ------------------------------------------------------------------------------- pure mapping


def _pod(labels=None, annotations=None, owner=None, name="p-0", uid="pod-uid"):
    return make_pod("ns", name, labels=labels, annotations=annotations, owner=owner, uid=uid, created=T0)


def _index(*workloads) -> KueueIndex:
    index = KueueIndex()
    for wl in workloads:
        index.add(workload_info(wl, ("nvidia.com/gpu",), "gpuledger.io/"))
    return index


WL_JOB = make_workload("ns", "job-train-abcde", owner=("Job", "train", "job-uid-1"), uid="wl-uid-1")
WL_PODGROUP = make_workload("ns", "group-a", owner=("Pod", "p-0", "pod-uid"), uid="wl-uid-2")


@pytest.mark.parametrize("pod, index, expected", [
    # Kueue-managed: the annotation Kueue puts on the pod template names the Workload.
    (_pod(annotations={"kueue.x-k8s.io/workload": "job-train-abcde"}), None, "ns/job-train-abcde"),
    # Kueue-managed: the Workload whose job-uid / owner is the pod's controller.
    (_pod(labels={"kueue.x-k8s.io/podset": "main"}, owner=("Job", "train", "job-uid-1")), _index(WL_JOB), "ns/job-train-abcde"),
    (_pod(labels={"kueue.x-k8s.io/job-uid": "job-uid-1"}, owner=("Job", "train", "other")), _index(WL_JOB), "ns/job-train-abcde"),
    # Plain pod groups: the Workload is owned by the pods themselves / named after the group.
    (_pod(labels={"kueue.x-k8s.io/managed": "true"}), _index(WL_PODGROUP), "ns/group-a"),
    (_pod(labels={"kueue.x-k8s.io/pod-group-name": "group-b"}, uid="x"), _index(), "ns/group-b"),
    # Kueue labels but no Workload known: fall back to the controller.
    (_pod(labels={"kueue.x-k8s.io/queue-name": "q"}, owner=("Job", "train", "job-uid-9")), _index(WL_JOB), "ns/Job/train"),
    # Controllers.
    (_pod(labels={"pod-template-hash": "5d8f7b9c4"}, owner=("ReplicaSet", "web-5d8f7b9c4")), None, "ns/Deployment/web"),
    (_pod(owner=("ReplicaSet", "standalone-rs")), None, "ns/ReplicaSet/standalone-rs"),
    (_pod(labels={"pod-template-hash": "abc"}, owner=("ReplicaSet", "web-5d8f7b9c4")), None, "ns/ReplicaSet/web-5d8f7b9c4"),
    (_pod(owner=("StatefulSet", "db")), None, "ns/StatefulSet/db"),
    (_pod(owner=("PyTorchJob", "bert")), None, "ns/PyTorchJob/bert"),
    (_pod(labels={"jobset.sigs.k8s.io/jobset-name": "llm"}, owner=("Job", "llm-workers-0")), None, "ns/JobSet/llm"),
    # Nothing owns it.
    (_pod(), None, "ns/Pod/p-0"),
])
def test_workload_id_rule(pod, index, expected):
    assert derive_workload_id(pod, index)[0] == expected


def test_pure_helpers():
    assert image_digest("docker.io/acme/x@sha256:" + "a" * 64) == "sha256:" + "a" * 64
    assert image_digest("docker-pullable://acme/x@sha256:" + "b" * 64) == "sha256:" + "b" * 64
    assert image_digest("sha256:" + "c" * 64) == "sha256:" + "c" * 64
    assert image_digest("") is None and image_digest("sha256:short") is None
    spec = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "2"}}}, {"resources": {"requests": {"amd.com/gpu": 1}}}],
            "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}]}
    assert gpus_requested(spec, ["nvidia.com/gpu"]) == 4
    assert gpus_requested(spec, ["nvidia.com/gpu", "amd.com/gpu"]) == 4
    assert gpus_requested({"containers": [{}]}, ["nvidia.com/gpu"]) == 0


def test_pod_facts_and_event_ids_are_deterministic():
    pod = make_pod("ns", "p", node="n1", phase="Succeeded", created=T0, uid="u1", conditions=[
        pod_condition("PodScheduled", at=at(1)), disruption_target("EvictionByEvictionAPI", at=at(7))])
    facts = pod_facts(pod)
    assert [f.transition for f in facts] == ["submitted", "scheduled", "running", "evicted", "finished"]
    assert facts[3].reason == "EvictionByEvictionAPI"
    kubelet_evicted = make_pod("ns", "q", node="n1", phase="Failed", created=T0)
    kubelet_evicted["status"]["reason"] = "Evicted"
    assert [f.event_type for f in pod_facts(kubelet_evicted)][-2:] == ["scheduler.evicted", "scheduler.finished"]
    assert pod_facts(pod) == facts


def test_kueue_and_scheduler_preemptor_parsing():
    index = _index(WL_JOB)
    old = kueue_preemptor("Preempted to accommodate a workload (UID: wl-uid-1) due to prioritization in the ClusterQueue", index)
    assert (old.kind, old.name, old.namespace) == ("Workload", "job-train-abcde", "ns")
    by_job = kueue_preemptor("Preempted to accommodate a workload (UID: zzz, JobUID: job-uid-1) due to x", index)
    assert by_job.uid == "wl-uid-1"
    unknown = kueue_preemptor("Preempted to accommodate a workload (UID: 1234, JobUID: UNKNOWN) due to x", index)
    assert (unknown.uid, unknown.name) == ("1234", "")
    assert kueue_preemptor("Previously: something else", index) is None

    victim = make_pod("ns", "v", node="n1", uid="victim-uid")
    ev = make_event_v1("ns", "v.1", victim, "Preempted", "Preempted by pod 6f1e2d3c-aaaa-bbbb-cccc-000000000001 on node n1",
                       event_time=T0)
    fact = event_fact(event_view(ev), {"Preempted": "scheduler.preempted"}, lambda uid: ("ns", "urgent"))
    assert fact.preemptor.model_dump() == {"kind": "Pod", "namespace": "ns", "name": "urgent",
                                           "uid": "6f1e2d3c-aaaa-bbbb-cccc-000000000001"}
    assert fact.victim.uid == "victim-uid" and fact.node == "n1"
    assert event_fact(event_view(ev), {}) is None


def test_workload_facts_v1beta2_and_v1beta1_priority_class():
    for version in ("v1beta2", "v1beta1"):
        wl = make_workload("ns", "w", "q", "gold", 77, version=version, conditions=[
            workload_condition("Admitted", at=at(2)), workload_condition("PodsReady", "False", at=at(3))], created=T0)
        info = workload_info(wl, ("nvidia.com/gpu",), "gpuledger.io/")
        assert (info.priority_class, info.priority, info.queue) == ("gold", 77, "q")
        assert [f.transition for f in workload_facts(wl)] == ["queued", "admitted"]


def test_a_kueue_pods_priority_is_its_workloads_class_and_value_not_the_pods_zero():
    """From an exploratory review on a real cluster: a pod of a Workload with a WorkloadPriorityClass
    runs at spec.priority 0 without a priorityClassName; its row took the class from the Workload
    and the value from the pod — `trace` read "priority=high (0)". Both come from one source."""
    from producers.kubernetes.mapping import KueueIndex, pod_view

    index = KueueIndex()
    index.add(workload_info(make_workload("ml", "job-serve-high-1", "gpu", "high", 1000, owner=("Job", "serve-high", "job-uid-high")),
                            ("nvidia.com/gpu",), "gpuledger.io/"))
    kueue_pod = make_pod("ml", "serve-high-0", node="gpu-1", priority=0, owner=("Job", "serve-high", "job-uid-high"),
                         labels={"kueue.x-k8s.io/queue-name": "gpu"})
    view = pod_view(kueue_pod, ("nvidia.com/gpu",), "gpuledger.io/", index)
    assert (view.payload["priority_class"], view.payload["priority"]) == ("high", 1000)
    # A pod with a PriorityClass of its own keeps its own class and value.
    own = make_pod("ml", "serve-high-1", node="gpu-1", priority_class="system-critical", priority=2000,
                   owner=("Job", "serve-high", "job-uid-high"))
    assert (pod_view(own, ("nvidia.com/gpu",), "gpuledger.io/", index).payload["priority_class"],
            pod_view(own, ("nvidia.com/gpu",), "gpuledger.io/", index).payload["priority"]) == ("system-critical", 2000)
    # Without a Workload: the pod's own value, as before.
    assert pod_view(make_pod("ml", "bare", node="gpu-1", priority=5), ("nvidia.com/gpu",), "gpuledger.io/", index).payload["priority"] == 5


def test_mig_job_and_its_workload_are_collected_with_defaults(api, make_collector, kafka_bootstrap, catalogue):
    """Issue #13.4: with default settings a job asking for MIG slices (nvidia.com/mig-*) is a
    GPU job — its Workload, its pod and its preemption reach the scheduler topic — and
    both collectors share that default."""
    from producers._config import GPU_RESOURCES
    from producers.podresources.config import PodResourcesSettings

    assert SchedulerCollectorSettings().gpu_resources == PodResourcesSettings().resources == GPU_RESOURCES
    mig = "nvidia.com/mig-1g.10gb"
    adm = {"clusterQueue": "mig-cq", "podSetAssignments": [pod_set_assignment("main", {mig: "a100-mig"}, {mig: "1"}, count=1)]}
    spec = dict(queue_name="team-q", priority_class="low", priority=10, owner=("Job", "mig-train", "job-uid-mig"),
                pod_sets=[make_pod_set("main", count=1, gpu_resource=mig)], created=T0)
    wl = api.create(WORKLOADS_V1BETA2, make_workload("ml", "job-mig-train-1", **spec, admission=adm,
                                                     conditions=[workload_condition("QuotaReserved", at=at(1)),
                                                                 workload_condition("Admitted", at=at(1))]))
    api.create(PODS, make_pod("ml", "mig-train-0", node="gpu-1", created=at(2), gpu_resource=mig,
                              labels={"kueue.x-k8s.io/queue-name": "team-q"}, owner=("Job", "mig-train", "job-uid-mig")))
    # Neither a CPU pod nor a pod asking for some other extended resource is a GPU pod.
    api.create(PODS, make_pod("ml", "cpu-only", node="cpu-1", gpus=0, created=at(2)))
    api.create(PODS, make_pod("ml", "fpga", node="cpu-1", created=at(2), gpu_resource="xilinx.com/fpga"))
    collector = make_collector(api, **{k: v for k, v in FAST.items()})  # defaults for the resource list
    with running(collector):
        wait_sent(collector, 6)  # workload: queued, quota_reserved, admitted; pod: submitted, scheduled, running
        wait_watching(api, PODS, WORKLOADS_V1BETA2)
        msg = "Preempted to accommodate a workload (UID: wl-urgent, JobUID: job-urgent) due to prioritization in the ClusterQueue"
        api.update(WORKLOADS_V1BETA2, make_workload("ml", "job-mig-train-1", **spec, uid=wl["metadata"]["uid"], conditions=[
            workload_condition("Evicted", reason="Preempted", message=msg, at=at(30)),
            workload_condition("Preempted", reason="InClusterQueue", message=msg, at=at(30))]))
        wait_sent(collector, 8)

    events = published(kafka_bootstrap, catalogue.scheduler, 8)
    assert {e.identity.pod for e in events if e.identity.pod} == {"mig-train-0"}
    wl_events = [e for e in events if e.payload.object_kind == "Workload"]
    assert types(wl_events) == ["queued", "quota_reserved", "admitted", "evicted", "preempted"]
    assert wl_events[0].payload.gpus_requested == 1 and wl_events[2].payload.flavors[mig] == "a100-mig"
    pod_events = [e for e in events if e.payload.object_kind == "Pod"]
    assert pod_events[0].identity.workload_id == "ml/job-mig-train-1" and pod_events[0].payload.gpus_requested == 1


def test_a_workload_whose_pods_claim_their_gpu_through_dra_is_collected_like_its_pods(api, make_collector, kafka_bootstrap, catalogue,
                                                                                      tmp_path):
    """Kueue 0.17 keeps a Job's pod template, its DRA claims included, in the Workload's pod sets
    (``workload_v1beta2_dra_finished.json``: saved from the real cluster, managedFields left out);
    the Workload requests no GPU resource. Its pod was published (it names a claim) and the Workload
    skipped: the DRA GPU job had no queued, admitted or finished Workload. One rule for both: a
    Workload without claims (CPU only) is not collected, nor with DRA off either kind."""
    import copy

    real = json.loads((Path(__file__).parents[2] / "data" / "kubernetes" / "workload_v1beta2_dra_finished.json").read_text())
    ns, job = real["metadata"]["namespace"], real["metadata"]["ownerReferences"][0]
    api.create(WORKLOADS_V1BETA2, real)
    cpu_only = copy.deepcopy(real)
    cpu_only["metadata"].update(name="job-cpu-only-1a2b3", uid="uid-cpu-only", ownerReferences=[])
    template = cpu_only["spec"]["podSets"][0]["template"]["spec"]
    del template["resourceClaims"], template["containers"][0]["resources"]["claims"]
    api.create(WORKLOADS_V1BETA2, cpu_only)
    pod = make_pod(ns, f"{job['name']}-x7k2p", node="gpu-node-2", gpus=0, created=at(2),
                   labels={"gpuledger.io/release-id": "rel-dra-job", "kueue.x-k8s.io/queue-name": "gpu"},
                   owner=("Job", job["name"], job["uid"], "batch/v1"))
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
    api.create(PODS, pod)

    assert make_collector(api, dra=False, state_dir=tmp_path / "dra-off").run_once() == 0
    collector = make_collector(api)
    assert collector.run_once() > 0
    events = published(kafka_bootstrap, catalogue.scheduler, collector.counters.totals["sent"])
    wl_events = [e for e in events if e.payload.object_kind == "Workload"]
    assert types(wl_events) == ["queued", "quota_reserved", "admitted", "finished"]
    wl_id = f"{ns}/{real['metadata']['name']}"
    assert {e.identity.workload_id for e in wl_events} == {wl_id}
    assert {e.identity.release_id for e in wl_events} == {"rel-dra-job"}  # from the pod set's template labels
    assert (wl_events[2].payload.cluster_queue, wl_events[2].payload.gpus_requested) == ("gpu-cluster-queue", 0)
    pod_events = [e for e in events if e.payload.object_kind == "Pod"]
    assert pod_events and {e.identity.workload_id for e in pod_events} == {wl_id}


def test_resource_patterns_count_every_matching_extended_resource():
    spec = {"containers": [{"resources": {"limits": {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-3g.40gb": "1", "cpu": "4"}}},
                           {"resources": {"requests": {"amd.com/gpu": "1"}, "limits": {"amd.com/gpu": "1"}}}]}
    assert gpus_requested(spec, ["nvidia.com/mig-*"]) == 3
    assert gpus_requested(spec, ["nvidia.com/gpu", "nvidia.com/mig-*", "amd.com/gpu"]) == 4
    assert gpus_requested(spec, ["nvidia.com/gpu"]) == 0
    with pytest.raises(SettingsError) as exc:
        Settings.load(collectors={"scheduler": {"gpu_resources": ("nvidia.com/*gpu",)}})
    assert "GPULEDGER_SCHEDULER_GPU_RESOURCES" in str(exc.value)


def test_dra_resource_slices_publish_what_each_gpu_device_is(api, make_collector, kafka_bootstrap, catalogue):
    """Issue #13.3: NVIDIA's DRA driver announces its GPUs and MIG devices in ResourceSlices;
    the collector publishes one gpu.device per device (uuid, parentUUID, profile), once."""
    from tests.fixtures.kube_api import RESOURCE_SLICES, dra_gpu_device, dra_mig_device, make_resource_slice

    gpu, parent, mig = "GPU-8f3c2b1a-6d4e-4f0a-9b7c-2e1d0c9b8a76", "GPU-1b2c3d4e-0000-4f0a-9b7c-00000000000q", "MIG-4f6a0d2e-81c3-5b7e-9a1f-3c2d1e0f9a8b"
    api.create(RESOURCE_SLICES, make_resource_slice("gpu-1", [dra_gpu_device(0, gpu), dra_mig_device(1, "1g.10gb", 0, mig, parent)],
                                                    created=T0))
    api.create(RESOURCE_SLICES, make_resource_slice("gpu-1", [{"name": "nic-0", "attributes": {"uuid": {"string": "x"}}}],
                                                    driver="sriovnetwork.k8snetworkplumbingwg.io", created=T0))  # not a GPU driver
    collector = make_collector(api)
    assert collector.run_once() == 2
    assert collector.run_once() == 0  # re-listed: nothing new
    collector.state.save(force=True)
    again = make_collector(api, state_dir=collector.state.path.parent)
    assert again.run_once() == 0  # restarted: nothing new
    events = {e.payload.device_id: e for e in published(kafka_bootstrap, catalogue.gpu, 2)}
    whole, part = events["gpu.nvidia.com/gpu-1/gpu-0"], events["gpu.nvidia.com/gpu-1/gpu-1-mig-1g10gb-0"]
    assert (whole.event_type, whole.identity.node, whole.payload.gpu, whole.payload.mig_instance) == ("gpu.device", "gpu-1", gpu, None)
    assert (part.payload.gpu, part.payload.mig_instance, part.payload.profile, part.payload.pool) == (parent, mig, "1g.10gb", "gpu-1")


def test_dra_resource_claims_publish_who_holds_which_gpu_once_and_every_end(api, make_collector, kafka_bootstrap, catalogue):
    """Issue #13.3: a ResourceClaim's allocation x reservedFor says which pod holds which DRA GPU; each
    reservation is published once (re-lists, restarts), each end once, with why — a deletion while
    no collector watched included; a malformed claim is skipped and counted, the others published."""
    import copy
    import json

    from tests.fixtures.kube_api import RESOURCE_CLAIMS

    real = json.loads((Path(__file__).parents[2] / "data" / "kubernetes" / "resourceclaim_v1_allocated.json").read_text())

    def claim(name: str, pod: str) -> dict:
        obj = copy.deepcopy(real)
        obj["metadata"] = {"name": name, "namespace": "ml", "creationTimestamp": real["metadata"]["creationTimestamp"]}
        obj["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}]
        return obj

    api.create(RESOURCE_CLAIMS, claim("a-gpu", "a"))
    api.create(RESOURCE_CLAIMS, claim("b-gpu", "b"))
    broken = claim("c-gpu", "c")
    del broken["status"]["allocation"]["devices"]["results"][0]["device"]
    api.create(RESOURCE_CLAIMS, broken)
    collector = make_collector(api)
    assert collector.run_once() == 2
    assert collector.counters.totals["rejected"] == 1
    assert collector.run_once() == 0  # re-listed: nothing new
    collector.state.save(force=True)
    again = make_collector(api, state_dir=collector.state.path.parent)
    assert again.run_once() == 0  # restarted: nothing new
    # a's pod finished (the resourceclaim controller drops it from reservedFor); b's claim goes while nobody watches.
    api.patch(RESOURCE_CLAIMS, "ml", "a-gpu", {"status": {"reservedFor": None}})
    api.delete(RESOURCE_CLAIMS, "ml", "b-gpu")
    assert again.run_once() == 2
    assert again.run_once() == 0
    events = published(kafka_bootstrap, catalogue.gpu, 4)
    got = sorted((e.identity.pod, e.event_type, e.payload.reason) for e in events)
    assert got == [("a", "gpu.claim_released", "unreserved"), ("a", "gpu.claim_reserved", None),
                   ("b", "gpu.claim_released", "claim_deleted"), ("b", "gpu.claim_reserved", None)]
    assert {(e.identity.node, e.payload.device_id, e.payload.claim) for e in events if e.identity.pod == "b"} == \
           {("gpu-node-1", "gpu.nvidia.com/gpu-node-1/gpu-0", "b-gpu")}


def test_recovery_is_logged_when_the_watch_opens_again_not_when_it_ends(api, make_collector, caplog):
    """From an exploratory review on a real cluster: after an API server restart, "pods: recovered"
    came only when the watch that ended the outage returned (up to watch_timeout_s, 300 s): a
    WARNING stood unresolved in the log while data flowed. It is logged when the watch opens."""
    caplog.set_level(logging.INFO, logger="producers.kubernetes")
    api.create(PODS, make_pod("ml", "a", node="gpu-1", created=T0))
    collector = make_collector(api, watch_timeout_s=120)
    with running(collector):
        wait_sent(collector, 3)
        wait_watching(api, PODS)
        api.fail_next(3, 503, path="pods")
        api.drop_watches(PODS)  # the API server goes away; the next requests fail, then it is back
        wait_until(lambda: [r for r in caplog.records if r.getMessage() == "pods: recovered"], timeout=20, what="'pods: recovered' logged")
        assert api.open_watches(PODS) == 1  # ... while the watch that ended the outage is still open
        failed = [r for r in caplog.records if r.getMessage().startswith("pods: ") and r.levelno == logging.WARNING]
        assert failed and failed[0].created < next(r.created for r in caplog.records if r.getMessage() == "pods: recovered")


def test_once_lists_what_it_may_and_then_names_what_it_may_not(api, make_collector, kafka_bootstrap, catalogue):
    """`collect scheduler --once` with credentials that may not list Workloads ended at the first
    refusal — "error: scheduler collector: HTTP 403 Forbidden", no resource named, nothing
    published. It now lists the others, publishes them, and fails naming what it could not list."""
    from producers.kubernetes.collector import KubeApiError

    api.create(PODS, make_pod("ml", "a", node="gpu-1", created=T0))
    api.create(WORKLOADS_V1BETA2, make_workload("ml", "train", pod_sets=[make_pod_set(gpus=1)]))
    api.fail_next(5, 403, path="workloads", reason="Forbidden", message="workloads.kueue.x-k8s.io is forbidden")
    collector = make_collector(api)
    try:
        with pytest.raises(KubeApiError) as exc:
            collector.run_once()
    finally:
        collector.close()
    assert str(exc.value).startswith("scheduler collector: the credentials may not list workloads (HTTP 403 Forbidden; deploy/k8s RBAC): "
                                     "published 3 event(s) of the other resources"), str(exc.value)
    events = published(kafka_bootstrap, catalogue.scheduler, 3)
    assert {e.identity.pod for e in events} == {"a"} and not [e for e in events if e.payload.object_kind == "Workload"]


def test_a_resource_the_credentials_may_not_list_does_not_hold_back_the_others(api, make_collector, kafka_bootstrap, catalogue,
                                                                             caplog):
    """Workloads forbidden (a ClusterRole without kueue.x-k8s.io): pods are still collected,
    the refusal is an ERROR naming the resource, and Workloads are listed once granted."""
    from tests.fixtures.logs import calm_records

    caplog.set_level(logging.INFO, logger="producers.kubernetes")
    api.create(PODS, make_pod("ml", "a", node="gpu-1", created=T0))
    api.create(WORKLOADS_V1BETA2, make_workload("ml", "train", pod_sets=[make_pod_set(gpus=1)]))
    for path in ("workloads", "resourceclaims"):
        api.fail_next(12, 403, path=path, reason="Forbidden",
                      message=f'{path} is forbidden: User "system:serviceaccount:gpuledger:collector" cannot list resource')
    collector = make_collector(api)
    # As the CLI logs: three missing grants were one ERROR line, the others held back for a minute as
    # repeats of the first's template (exploratory review).
    with calm_records("producers.kubernetes") as calm:
        with running(collector):
            wait_sent(collector, 3)  # the pod's events, while every Workload request is refused
            assert collector.workloads.rv is None
            errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.getMessage().startswith("workloads: the collector may not list it")]
            assert len(errors) == 1 and "HTTP 403" in errors[0].getMessage()
            shown = {r.getMessage().split(":", 1)[0] for r in calm if r.levelno == logging.ERROR and "may not list it" in r.getMessage()}
            assert shown == {"workloads", "resourceclaims"}, [r.getMessage() for r in calm]
            wait_until(lambda: collector.workloads.rv is not None, timeout=30, what="workloads listed once the refusals stop")
            wait_sent(collector, 4)
    events = published(kafka_bootstrap, catalogue.scheduler, 4)
    assert Counter(e.identity.pod or e.identity.workload_id for e in events)["a"] == 3
    assert [e for e in events if e.payload.object_kind == "Workload"], "the Workload was never published"


def test_a_graceful_deletion_is_dated_when_seen_not_at_its_grace_periods_end():
    """A graceful deletion's deletionTimestamp is the request's time plus the grace period: a GPU pod
    with a grace period of an hour that exits in seconds is DELETED with it ~1 h ahead. Dated so, the
    event was refused (an event cannot have happened 15 min after it was observed) and the deletion
    went unpublished until a re-list (review of that check). A deletion already past is kept as it is."""
    from producers.kubernetes.mapping import to_event
    from schemas import Identity, Source

    seen = T0 + timedelta(hours=2)
    for kind, facts_of, obj in (("Pod", pod_facts, _pod()), ("Workload", workload_facts, WL_JOB)):
        ahead = {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": (seen + timedelta(seconds=3590)).strftime("%Y-%m-%dT%H:%M:%SZ")}}
        [deleted] = [f for f in facts_of(ahead, deleted=True, now=seen) if f.event_type == "scheduler.deleted"]
        assert deleted.occurred_at == seen, (kind, deleted)
        event = to_event("uid", deleted, Identity(namespace="ns", pod_uid="uid"), {"object_kind": kind}, Source(collector="kubernetes", host="h"), seen)
        assert (event.event_type, event.occurred_at) == ("scheduler.deleted", seen)
        past = {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": (seen - timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")}}
        [deleted] = [f for f in facts_of(past, deleted=True, now=seen) if f.event_type == "scheduler.deleted"]
        assert deleted.occurred_at == seen - timedelta(seconds=30), (kind, deleted)
