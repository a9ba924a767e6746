"""The kubelet pod-resources doubles driven from the real cluster (``gpuledger.dev.kubelets``).

A Kueue Job's pod, bound by the real scheduler and run by KWOK, gets device ids from its node's
kubelet double; the real pod-resources collector polls that socket, the scheduler collector
watches the API server, and the worker joins both into one GPU allocation under the Job's release.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from kubernetes import client as k8s

from gpuledger.dev.kubelets import ClusterKubelets
from gpuledger.dev.peers import AlertingPeers, DcgmExporter, node_devices, write_caller
from producers._kafka import EventPublisher
from producers.podresources.collector import PodResourcesCollector
from producers.podresources.config import PodResourcesSettings
from producers.receiver.config import ReceiverSettings
from tests.producers.kubernetes.test_collector import running
from tests.producers.receiver.test_server import RunningReceiver
from tests.real_cluster.conftest import REAL_CLUSTER, gpu_job, queue_namespace, unique, wait_for
from tests.real_cluster.test_alerting import alert_rows, registered, running_pod

pytestmark = REAL_CLUSTER


@pytest.fixture
def socket_dir():
    d = Path(tempfile.mkdtemp(prefix="glk-", dir="/tmp"))  # unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def allocations(worker, pod: str) -> list[dict]:
    return worker.reader.query("SELECT node, gpu_id, release_id, workload_id, ended_at FROM gpuledger.gpu_allocations FINAL "
                               "WHERE pod = {p:String} ORDER BY gpu_id", {"p": pod}).dicts()


def test_a_kwok_pod_gets_devices_from_its_nodes_kubelet_and_both_collectors_agree(real_cluster, kube, make_collector, catalogue,
                                                                                   settings_for, worker_factory, tmp_path, socket_dir):
    settings = settings_for(catalogue)
    worker = worker_factory(catalogue)
    ns, job, rid = queue_namespace(real_cluster, "kubelet"), unique("train"), unique("rel-kubelet")
    devices = [d for n in real_cluster.nodes for d in node_devices(n)]
    batch = k8s.BatchV1Api(kube)
    with DcgmExporter(devices) as exporter, ClusterKubelets(real_cluster, socket_dir, exporter) as kubelets, \
            running(make_collector(ns)):
        batch.create_namespaced_job(ns, gpu_job(job, gpus=2, run_for="1h", namespace=ns, labels={"gpuledger.io/release-id": rid}))
        pod = wait_for(lambda: running_pod(kube, ns, job), 120, "the Job's pod Running on a GPU node")
        node, name = pod.spec.node_name, pod.metadata.name
        ids = wait_for(lambda: kubelets.assigned.get((pod.metadata.uid, "train")), 30, "the pod's devices on its node's kubelet")
        assert len(ids) == 2 and all(i.startswith("GPU-") for i in ids)
        assert {d.device_id for d in devices if d.node == node} >= set(ids)
        # dcgm-exporter's pod mapping reads the same socket: the page names the pod on those GPUs.
        assert {exporter.device(i).holder for i in ids} == {(ns, name, "train")}

        collector = PodResourcesCollector(PodResourcesSettings(node=node, socket=kubelets.sockets[node], state_dir=tmp_path / "pr",
                                                               rpc_timeout_s=5.0),
                                          EventPublisher.from_settings(settings, "podresources"))
        try:
            assert collector.poll_once().published >= 1
            rows = wait_for(lambda: (r := allocations(worker, name)) and len(r) == 2 and all(x["release_id"] for x in r) and r, 90,
                            "two GPU allocations joined to the Job's release")
            assert {(r["node"], r["gpu_id"], r["release_id"]) for r in rows} == {(node, i, rid) for i in ids}
            assert len({r["workload_id"] for r in rows}) == 1 and rows[0]["workload_id"]
            assert all(r["ended_at"] is None for r in rows)

            # The Job goes: the pod leaves the kubelet's list, the collector publishes the release.
            batch.delete_namespaced_job(job, ns, propagation_policy="Foreground")
            wait_for(lambda: (pod.metadata.uid, "train") not in kubelets.assigned, 60, "the pod's devices released on the kubelet")
            assert exporter.device(ids[0]).holder is None
            wait_for(lambda: collector.poll_once().published >= 1, 30, "the release published")
            wait_for(lambda: all(r["ended_at"] is not None for r in allocations(worker, name)), 90, "both allocations ended")
        finally:
            collector.close()


def test_an_xid_on_a_mig_slice_reaches_the_pod_kueue_placed_on_it(real_cluster, kube, make_collector, catalogue, settings_for,
                                                                 worker_factory, tmp_path, socket_dir):
    """MIG end to end: Kueue admits a ``nvidia.com/mig-1g.10gb`` Job, the scheduler binds it to the MIG
    node, its kubelet double hands it a MIG device, the DCGM page maps the pod onto that GPU instance,
    Prometheus fires on the instance's XID and Alertmanager delivers it."""
    settings = settings_for(catalogue)
    rid = unique("rel-mig")
    EventPublisher.from_settings(settings, "test").publish_batch([registered(rid)])
    worker = worker_factory(catalogue, extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})
    callers = tmp_path / "callers.yaml"
    token = write_caller(callers, "service:alertmanager", ("alertmanager",))
    ns, job = queue_namespace(real_cluster, "mig"), unique("eval")
    devices = [d for n in real_cluster.nodes for d in node_devices(n)]
    batch = k8s.BatchV1Api(kube)
    with DcgmExporter(devices) as exporter, ClusterKubelets(real_cluster, socket_dir, exporter) as kubelets, \
            running(make_collector(ns)), \
            RunningReceiver(ReceiverSettings(credentials_file=callers), EventPublisher.from_settings(settings, "receiver")) as rx, \
            AlertingPeers(tmp_path / "peers", exporter, rx.url, token):
        batch.create_namespaced_job(ns, gpu_job(job, gpus=1, resource="nvidia.com/mig-1g.10gb", run_for="1h", namespace=ns,
                                                labels={"gpuledger.io/release-id": rid}))
        pod = wait_for(lambda: running_pod(kube, ns, job), 120, "the MIG Job's pod Running")
        node, name = pod.spec.node_name, pod.metadata.name
        assert node == "gpu-node-mig"
        [mig] = wait_for(lambda: kubelets.assigned.get((pod.metadata.uid, "train")), 30, "the pod's MIG device on the kubelet")
        slice_ = exporter.device(mig)
        assert mig.startswith("MIG-") and slice_.gpu_instance == (7, "1g.10gb") and slice_.holder == (ns, name, "train")
        collector = PodResourcesCollector(PodResourcesSettings(node=node, socket=kubelets.sockets[node], state_dir=tmp_path / "pr",
                                                               rpc_timeout_s=5.0),
                                          EventPublisher.from_settings(settings, "podresources"))
        try:
            assert collector.poll_once().published >= 1
        finally:
            collector.close()
        exporter.set_xid(mig, 94)
        rows = wait_for(lambda: [r for r in alert_rows(worker, name) if r["release_id"]], 120, "the MIG XID attributed")
    batch.delete_namespaced_job(job, ns, propagation_policy="Background")
    row = rows[0]
    assert (row["release_id"], row["node"], row["gpu_id"], row["namespace"]) == (rid, node, slice_.uuid, ns), row
    assert (row["labels"]["GPU_I_ID"], row["labels"]["GPU_I_PROFILE"], row["labels"]["err_code"]) == ("7", "1g.10gb", "94")
    # The alert taught the store which physical GPU the pod's MIG device is a slice of.
    wait_for(lambda: worker.reader.query("SELECT gpu, gpu_id FROM gpuledger.gpu_allocations FINAL WHERE pod = {p:String}", {"p": name}
                                         ).dicts() == [{"gpu": slice_.uuid, "gpu_id": mig}], 60, "the slice mapped to its parent GPU")
