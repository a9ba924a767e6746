"""The scheduler collector against the real API server, Kueue and KWOK, publishing to the real broker.

Each test watches a namespace of its own (with a LocalQueue on the cluster's ClusterQueue), so
the records on its topic are exactly what that test's objects produced.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

from kubernetes import client as k8s

from schemas import decode_event
from tests.fixtures.kafka import read_topic
from tests.producers.kubernetes.test_collector import running
from tests.real_cluster.conftest import REAL_CLUSTER, gpu_job, preempt_with_priority, queue_namespace, unique, wait_for, workloads_of

pytestmark = REAL_CLUSTER

def on_topic(bootstrap: str, topic: str, min_count: int, settle: float = 2.0) -> list:
    events = [decode_event(m.value()) for m in read_topic(bootstrap, topic, min_count=min_count, timeout=60, settle=settle)]
    dupes = [i for i, c in Counter(e.event_id for e in events).items() if c > 1]
    assert not dupes, f"duplicate event ids on the topic: {dupes}"
    return events


def kinds(events, object_kind: str) -> list[str]:
    return [e.event_type.split(".", 1)[1] for e in events if e.payload.object_kind == object_kind]


def test_a_kueue_job_is_published_once_and_a_restart_publishes_nothing(real_cluster, kube, make_collector, kafka_bootstrap,
                                                                       catalogue, tmp_path):
    ns = queue_namespace(real_cluster, "collect")
    name = unique("train")
    collector = make_collector(ns)
    with running(collector):
        k8s.BatchV1Api(kube).create_namespaced_job(ns, gpu_job(name, gpus=2, namespace=ns,
                                                               labels={"gpuledger.io/release-id": "rel-real-1"}))
        wait_for(lambda: any(c.type == "Complete" and c.status == "True"
                             for c in k8s.BatchV1Api(kube).read_namespaced_job(name, ns).status.conditions or []), 90,
                 "the Job to complete")
        # Pod: submitted, scheduled, running, finished; Workload: queued, quota_reserved, admitted, finished.
        wait_for(lambda: collector.counters.totals["sent"] >= 9, 60, "the collector to publish the Job's transitions")
    sent = collector.counters.totals["sent"]
    events = on_topic(kafka_bootstrap, catalogue.scheduler, sent)
    assert len(events) == sent
    pod_types, wl_types = kinds(events, "Pod"), kinds(events, "Workload")
    assert pod_types[:1] == ["submitted"] and {"scheduled", "running", "finished"} <= set(pod_types), pod_types
    assert {"queued", "quota_reserved", "admitted", "finished"} <= set(wl_types), wl_types
    assert "scheduled" in kinds(events, "Event")  # the scheduler's own Scheduled Event
    pod_events = [e for e in events if e.payload.object_kind == "Pod"]
    assert {e.identity.node for e in pod_events if e.identity.node} <= {"gpu-node-1", "gpu-node-2"}
    # The pod and the Kueue Workload that admitted it are one workload, under the release the Job names.
    wl_events = [e for e in events if e.payload.object_kind == "Workload"]
    assert {e.identity.workload_id for e in pod_events} == {e.identity.workload_id for e in wl_events}
    assert {e.identity.release_id for e in events} == {"rel-real-1"}
    assert all(e.payload.gpus_requested == 2 for e in pod_events)

    restarted = make_collector(ns, state_dir=tmp_path / "state")
    assert restarted.run_once() == 0
    assert len(on_topic(kafka_bootstrap, catalogue.scheduler, sent)) == sent

    # Deleted while no collector watched: the next start's re-list publishes each deletion once.
    k8s.BatchV1Api(kube).delete_namespaced_job(name, ns, propagation_policy="Foreground")
    wait_for(lambda: not workloads_of(kube, name, ns) and not k8s.CoreV1Api(kube).list_namespaced_pod(ns).items, 60,
             "the Job's pod and Workload to be gone")
    assert make_collector(ns, state_dir=tmp_path / "state").run_once() == 2
    events = on_topic(kafka_bootstrap, catalogue.scheduler, sent + 2)
    assert len(events) == sent + 2
    deleted = [e for e in events if e.event_type == "scheduler.deleted"]
    assert sorted(e.payload.object_kind for e in deleted) == ["Pod", "Workload"]
    assert {e.identity.workload_id for e in deleted} == {e.identity.workload_id for e in pod_events}


def gpu_pod(name: str, ns: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"containers": [{"name": "serve", "image": "registry.example/serve@sha256:" + "cd" * 32,
                                     "resources": {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}}]}}


def test_a_real_410_gone_leads_to_a_relist_that_publishes_nothing_twice(real_cluster, kube, make_collector, kafka_bootstrap,
                                                                        catalogue, caplog):
    caplog.set_level(logging.INFO, logger="producers.kubernetes.collector")
    ns = queue_namespace(real_cluster, "gone")
    core = k8s.CoreV1Api(kube)
    # Short server-side watch timeouts: the collector re-watches from its last resourceVersion every 2 s.
    collector = make_collector(ns, watch_timeout_s=2)
    with running(collector):
        core.create_namespaced_pod(ns, gpu_pod("first", ns))
        wait_for(lambda: collector.counters.totals["sent"] >= 3, 60, "submitted, scheduled, running of the first pod")
        wait_for(lambda: "Scheduled" in {e["reason"] for e in json.loads(
            k8s.EventsV1Api(kube).list_namespaced_event(ns, _preload_content=False).data)["items"]}, 30, "the Scheduled Event")
        wait_for(lambda: collector.counters.totals["sent"] >= 4, 30, "the Scheduled Event published")
        before = collector.counters.totals["sent"]
        # Move etcd's revision past what the collector saw (objects it does not watch), then compact.
        other = unique("other")
        real_cluster.ensure_namespace(other)
        for i in range(5):
            core.create_namespaced_config_map(other, {"metadata": {"name": f"cm-{i}"}})
        real_cluster.compact_etcd()
        wait_for(lambda: sum("watch expired" in r.getMessage() and r.getMessage().startswith("pods:") for r in caplog.records), 30,
                 "the pods watch to answer 410 Gone")
        wait_for(lambda: any(r.getMessage().startswith("pods: listed") for r in caplog.records
                             if r.created > next(x.created for x in caplog.records if "watch expired" in x.getMessage())), 30,
                 "the re-list after 410")
        assert collector.counters.totals["sent"] == before, "the re-list published again what was already on the topic"
        core.create_namespaced_pod(ns, gpu_pod("second", ns))
        wait_for(lambda: collector.counters.totals["sent"] >= before + 4, 60, "the second pod's transitions after the re-list")
    sent = collector.counters.totals["sent"]
    events = on_topic(kafka_bootstrap, catalogue.scheduler, sent)
    assert len(events) == sent
    by_pod = {pod: [e.event_type.split(".", 1)[1] for e in events if e.identity.pod == pod and e.payload.object_kind == "Pod"]
              for pod in ("first", "second")}
    assert by_pod == {"first": ["submitted", "scheduled", "running"], "second": ["submitted", "scheduled", "running"]}, by_pod
    for pod in ("first", "second"):  # they hold a GPU each until deleted
        core.delete_namespaced_pod(pod, ns)


def test_a_kueue_preemption_names_the_preempting_workload(real_cluster, kube, make_collector, kafka_bootstrap, catalogue):
    ns = queue_namespace(real_cluster, "preempt")
    batch = k8s.BatchV1Api(kube)
    collector = make_collector(ns)
    with running(collector):
        low, high, high_wl = preempt_with_priority(kube, ns)
        wait_for(lambda: any(e.event_type in ("scheduler.preempted", "scheduler.evicted") for e in
                             on_topic(kafka_bootstrap, catalogue.scheduler, 1, settle=0.5)), 60, "the preemption published")
    low_wl = workloads_of(kube, low, ns)[0]
    for job in (low, high):
        batch.delete_namespaced_job(job, ns, propagation_policy="Background")
    events = on_topic(kafka_bootstrap, catalogue.scheduler, collector.counters.totals["sent"])
    disrupted = [e for e in events if e.payload.object_kind == "Workload" and e.event_type in ("scheduler.preempted", "scheduler.evicted")]
    assert disrupted, [e.event_type for e in events]
    # Kueue's own condition message names the preemptor: the high Workload, resolved through the index.
    for e in disrupted:
        assert e.payload.preemptor is not None, f"{e.event_type} {e.payload.reason}: {e.payload.message}"
        assert (e.payload.preemptor.uid, e.payload.preemptor.name) == (high_wl["metadata"]["uid"], high_wl["metadata"]["name"])
        assert e.payload.victim.uid == low_wl["metadata"]["uid"]
