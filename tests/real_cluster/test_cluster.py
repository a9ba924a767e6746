"""The local real cluster itself: KWOK GPU nodes, the real scheduler, Kueue admitting and preempting."""

from __future__ import annotations

import json

import pytest
from kubernetes import client as k8s

from gpuledger.dev.cluster import CLUSTER_QUEUE, DEFAULT_NODES, NAMESPACE
from tests.real_cluster.conftest import REAL_CLUSTER, condition, gpu_job, preempt_with_priority, unique, wait_for, workloads_of

pytestmark = REAL_CLUSTER


def test_kwok_nodes_advertise_gpus_as_the_device_plugin_does(kube):
    nodes = {n.metadata.name: n for n in k8s.CoreV1Api(kube).list_node().items}
    assert set(nodes) == {n.name for n in DEFAULT_NODES}
    for spec in DEFAULT_NODES:
        node = nodes[spec.name]
        assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions), f"{spec.name} not Ready"
        for resource, qty in spec.resources().items():
            assert node.status.allocatable[resource] == qty and node.status.capacity[resource] == qty
    assert nodes["gpu-node-1"].status.allocatable["nvidia.com/gpu"] == "8"
    assert nodes["gpu-node-mig"].status.allocatable["nvidia.com/mig-1g.10gb"] == "7"
    assert "nvidia.com/gpu" not in nodes["gpu-node-mig"].status.allocatable


def test_a_queued_job_is_admitted_by_kueue_scheduled_on_a_gpu_node_and_run_by_kwok(kube):
    name = unique("train")
    k8s.BatchV1Api(kube).create_namespaced_job(NAMESPACE, gpu_job(name, gpus=2))
    # Kueue's own webhook suspended the Job; Kueue created the Workload and admitted it.
    workload = wait_for(lambda: next((w for w in workloads_of(kube, name) if condition(w, "Admitted")), None), 60,
                        f"Kueue to admit the Workload of Job {name}")
    assert workload["status"]["admission"]["clusterQueue"] == CLUSTER_QUEUE
    assert workload["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "2"
    core = k8s.CoreV1Api(kube)
    pod = wait_for(lambda: next(iter(core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={name}").items), None), 60,
                   f"the Job controller to create the pod of {name}")
    done = wait_for(lambda: (p := core.read_namespaced_pod(pod.metadata.name, NAMESPACE)).status.phase == "Succeeded" and p, 90,
                    "KWOK to run the pod to completion")
    assert done.spec.node_name in {"gpu-node-1", "gpu-node-2"}  # the real scheduler placed it where GPUs are
    scheduled = next(c for c in done.status.conditions if c.type == "PodScheduled")
    assert scheduled.status == "True"
    # Raw JSON: the client's typed EventsV1Event refuses the null eventTime of core/v1-recorded Events.
    events = json.loads(k8s.EventsV1Api(kube).list_namespaced_event(
        NAMESPACE, field_selector=f"regarding.name={pod.metadata.name}", _preload_content=False).data)["items"]
    assert any(e["reason"] == "Scheduled" and e["reportingController"] == "default-scheduler" for e in events), events
    wait_for(lambda: any(c.type == "Complete" and c.status == "True"
                         for c in k8s.BatchV1Api(kube).read_namespaced_job(name, NAMESPACE).status.conditions or []), 60,
             "the Job to complete")
    wait_for(lambda: condition(workloads_of(kube, name)[0], "Finished"), 60, "Kueue to mark the Workload Finished")


def test_a_mig_job_lands_on_the_mig_node(kube):
    name = unique("mig")
    k8s.BatchV1Api(kube).create_namespaced_job(NAMESPACE, gpu_job(name, gpus=1, resource="nvidia.com/mig-1g.10gb"))
    core = k8s.CoreV1Api(kube)
    pod = wait_for(lambda: next((p for p in core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={name}").items
                                 if p.spec.node_name), None), 90, "the MIG pod to be scheduled")
    assert pod.spec.node_name == "gpu-node-mig"
    assert condition(workloads_of(kube, name)[0], "Admitted")


def test_a_higher_priority_workload_preempts_a_lower_one_through_kueue(kube):
    low, high, high_wl = preempt_with_priority(kube)
    low_wl = workloads_of(kube, low)[0]
    preempted = condition(low_wl, "Preempted") or condition(low_wl, "Evicted")
    assert preempted, f"low workload not preempted: {low_wl['status'].get('conditions')}"
    assert "Preempted" in preempted["reason"] or preempted["reason"] == "InClusterQueue"
    assert high_wl["spec"]["priority"] == 1000 and low_wl["spec"]["priority"] == 10
    # Kueue suspended the low Job, so its pods go away and the high job's pod is placed.
    core, batch = k8s.CoreV1Api(kube), k8s.BatchV1Api(kube)
    wait_for(lambda: next((p for p in core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={high}").items
                           if p.status.phase == "Running"), None), 90, "the high job's pod Running")
    assert batch.read_namespaced_job(low, NAMESPACE).spec.suspend is True
    for job in (low, high):
        batch.delete_namespaced_job(job, NAMESPACE, propagation_policy="Background")
