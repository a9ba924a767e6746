"""The real cluster tier (marker ``real_cluster``): one local control plane per test session.

The fixture is ``gpuledger.dev.cluster.LocalCluster`` — the same code as ``gpuledger dev
cluster up`` — in a temp dir, stopped at session end. The first run builds the pinned
binaries into ~/.cache/gpuledger (minutes); later runs reuse them.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from producers._kafka import EventPublisher
from producers.kubernetes.collector import COMPONENT, SchedulerCollector, build_api_client
from producers.kubernetes.config import SchedulerCollectorSettings
from tests.fixtures.waiting import poll
from gpuledger.dev.cluster import CLUSTER_QUEUE, KUEUE_API, NAMESPACE, QUEUE, LocalCluster
from gpuledger.dev.peers import MlflowServer


#: Every module's ``pytestmark``. The long timeout covers the first test's fixture set-up, which
#: waits for a cold build of the binaries (tens of minutes on a fresh machine); each step of a
#: test is bounded by its own ``wait_for`` deadline.
REAL_CLUSTER = [pytest.mark.real_cluster, pytest.mark.timeout(3600)]


@pytest.fixture(scope="session")
def cluster_binaries() -> Path:
    """The cache dir once the pinned binaries and MLflow server's virtualenv are in it (built on a cold
    machine, or waited for while ``.ci/run``'s background build holds their locks): for the tests that
    start a cluster of their own, so that their own start-up timeouts do not include a build."""
    from gpuledger.dev import kubebin
    from gpuledger.dev.peers import ensure_mlflow_server
    from gpuledger.settings import default_cache_dir

    cache = default_cache_dir()
    kubebin.ensure_kube(cache)
    for module, version in (kubebin.KWOK, kubebin.KUEUE):
        kubebin.ensure_go_tool(module, version, cache)
    ensure_mlflow_server(cache)
    return cache


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[LocalCluster]:
    data = Path(tempfile.mkdtemp(prefix="gpuledger-cluster-"))
    # The first run builds the binaries (several minutes); start-up itself takes well under a minute.
    with LocalCluster(data) as cluster:
        yield cluster
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="session")
def kube(real_cluster: LocalCluster) -> k8s.ApiClient:
    """The official client on the cluster's kubeconfig (what kubectl would use)."""
    cfg = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(real_cluster.kubeconfig), client_configuration=cfg)
    return k8s.ApiClient(cfg)


#: The webhook secret of the tier's MLflow webhooks (the receiver's ``mlflow_secret``).
MLFLOW_SECRET = "whsec-real-mlflow"


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One MLflow server for the tier's tests (its start, sqlite migrations included, takes up to a minute)."""
    with MlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture
def mlflow_webhook(mlflow_server):
    """``hook(receiver_url)``: a webhook of the server to that receiver, deleted after the test."""
    made = []

    def hook(receiver_url: str):
        made.append(mlflow_server.create_webhook(receiver_url, MLFLOW_SECRET))
        return made[-1]

    yield hook
    for webhook in made:
        mlflow_server.delete_webhook(webhook.webhook_id)


FAST = {"backoff_initial_s": 0.1, "backoff_max_s": 1.0, "request_timeout_s": 10, "state_flush_interval_s": 0,
        "discovery_interval_s": 1.0, "host": "test-host"}


@pytest.fixture
def make_collector(real_cluster, kafka_bootstrap, catalogue, tmp_path):
    """The scheduler collector on the real cluster, publishing to the test's catalogue: ``build(namespace, state_dir=None, **settings)``."""
    made: list[SchedulerCollector] = []

    def build(namespace: str, state_dir: Path | None = None, **overrides) -> SchedulerCollector:
        settings = SchedulerCollectorSettings(kubeconfig=real_cluster.kubeconfig, namespace=namespace, **{**FAST, **overrides})
        publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, COMPONENT)
        collector = SchedulerCollector(settings, publisher, build_api_client(settings), state_dir or tmp_path / "state")
        made.append(collector)
        return collector

    yield build
    for c in made:
        c.stop()
        c.close()


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.5):
    """``tests.fixtures.waiting.poll`` in this tier's argument order."""
    return poll(predicate, what, timeout, interval)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def gpu_job(name: str, gpus: int = 1, *, resource: str = "nvidia.com/gpu", parallelism: int = 1, run_for: str | None = None,
            queue: str | None = "gpu", priority_class: str | None = None, labels: dict[str, str] | None = None,
            namespace: str = NAMESPACE, annotations: dict[str, str] | None = None, claim_template: str | None = None) -> dict:
    """A batch/v1 Job whose pods request ``gpus`` of ``resource``; ``run_for`` keeps KWOK's pods Running that long.
    ``labels`` go on the Job and its pod template, ``annotations`` on the pod template. With ``claim_template``
    its pods get their GPU through a DRA claim (``gpu``) from that ResourceClaimTemplate instead, and
    request no extended resource."""
    kwok = {"pod-complete.stage.kwok.x-k8s.io/delay": run_for, "pod-complete.stage.kwok.x-k8s.io/jitter-delay": run_for} if run_for else {}
    annotations = {**kwok, **(annotations or {})}
    job_labels = dict(labels or {})
    if queue:
        job_labels["kueue.x-k8s.io/queue-name"] = queue
    if priority_class:
        job_labels["kueue.x-k8s.io/priority-class"] = priority_class
    resources: dict = {"requests": {"cpu": "1", resource: str(gpus)}, "limits": {resource: str(gpus)}}
    pod_spec: dict = {"restartPolicy": "Never"}
    if claim_template:
        resources = {"requests": {"cpu": "1"}, "claims": [{"name": "gpu"}]}
        pod_spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": claim_template}]
    pod_spec["containers"] = [{"name": "train", "image": "registry.example/train@sha256:" + "ab" * 32, "resources": resources}]
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": job_labels},
        "spec": {"parallelism": parallelism, "completions": parallelism, "backoffLimit": 0,
                 "template": {"metadata": {"labels": dict(labels or {}), "annotations": annotations}, "spec": pod_spec}},
    }


def workloads_of(kube: k8s.ApiClient, job_name: str, namespace: str = NAMESPACE) -> list[dict]:
    items = k8s.CustomObjectsApi(kube).list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", namespace, "workloads")["items"]
    return [w for w in items if any(o.get("kind") == "Job" and o.get("name") == job_name for o in w["metadata"].get("ownerReferences", []))]


def queue_namespace(cluster: LocalCluster, prefix: str = "ns") -> str:
    """A fresh namespace with a LocalQueue ``gpu`` on the cluster's ClusterQueue (isolates one test's objects)."""
    ns = unique(prefix)
    cluster.ensure_namespace(ns)
    cluster.apply(f"/apis/{KUEUE_API}/namespaces/{ns}/localqueues", {
        "apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": ns}, "spec": {"clusterQueue": CLUSTER_QUEUE}})
    return ns


def condition(obj: dict, ctype: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype and c["status"] == "True"), None)


def preempt_with_priority(kube: k8s.ApiClient, namespace: str = NAMESPACE) -> tuple[str, str, dict]:
    """A low-priority Job holding every whole GPU of the queue (2 x 8, Running for an hour), then a
    high-priority 8-GPU Job; returns (low job, high job, the high Workload once Kueue admitted it)."""
    custom, batch = k8s.CustomObjectsApi(kube), k8s.BatchV1Api(kube)
    low_pc, high_pc = unique("low"), unique("high")
    for pc, value in ((low_pc, 10), (high_pc, 1000)):
        custom.create_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass", "metadata": {"name": pc}, "value": value})
    low, high = unique("low"), unique("high")
    batch.create_namespaced_job(namespace, gpu_job(low, gpus=8, parallelism=2, run_for="1h", priority_class=low_pc, namespace=namespace))
    wait_for(lambda: next((w for w in workloads_of(kube, low, namespace) if condition(w, "Admitted")), None), 90, "the low job admitted")
    batch.create_namespaced_job(namespace, gpu_job(high, gpus=8, run_for="1h", priority_class=high_pc, namespace=namespace))
    high_wl = wait_for(lambda: next((w for w in workloads_of(kube, high, namespace) if condition(w, "Admitted")), None), 120,
                       "Kueue to admit the high-priority job")
    return low, high, high_wl

