"""Physical GPU vs. MIG slice vs. time-slicing share, end to end (issue #13.2).

The real scheduler collector reads the API-server double, the real pod-resources collector
the kubelet gRPC double, alerts are real-format Alertmanager v4 bodies (dcgm-exporter
labels) turned into events by the receiver's own mapping; the real broker, worker and
chDB join them, and ``gpuledger trace`` reads the answer back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from producers._kafka import EventPublisher
from producers.kubernetes.collector import COMPONENT, SchedulerCollector
from producers.kubernetes.config import SchedulerCollectorSettings
from producers.podresources.collector import PodResourcesCollector
from producers.podresources.config import PodResourcesSettings
from producers.receiver.alertmanager import alert_events
from schemas import Identity, ReleaseEvent, Source, make_event_id
from schemas.release import ReleasePayload
from tests.fixtures.waiting import poll
from tests.fixtures.kube_api import PODS, FakeKubeApi, make_pod
from tests.fixtures.kubelet import FakeKubelet, container, devices, pod

NODE = "gpu-node-a3"
GPU_P = "GPU-8f3c2b1a-6d4e-4f0a-9b7c-2e1d0c9b8a76"   # time-sliced (nvidia.com/gpu.shared)
GPU_Q = "GPU-1b2c3d4e-0000-4f0a-9b7c-00000000000q"   # MIG-partitioned
GPU_Z = "GPU-77777777-0000-4f0a-9b7c-00000000000z"   # a GPU no allocation names
MIG_A = "MIG-4f6a0d2e-81c3-5b7e-9a1f-3c2d1e0f9a8b"
MIG_C = "MIG-9c8b7a6f-0000-5b7e-9a1f-000000000ccc"
MIG_1G = "nvidia.com/mig-1g.10gb"


def _release(rid: str, model: str, now: datetime) -> list[ReleaseEvent]:
    ident = Identity(release_id=rid, model_name=model, model_version="1", environment="prod", owner=f"team-{model}",
                     artifact_digest="sha256:" + "a1" * 32, image_digest="sha256:" + "b2" * 32)
    at = now - timedelta(minutes=30)
    return [ReleaseEvent(event_id=make_event_id("test", (rid, "release.registered"), at.isoformat()), event_type="release.registered",
                         occurred_at=at, observed_at=at, source=Source(collector="test"), identity=ident, payload=ReleasePayload(actor="ci"))]


def _dcgm_alert(fingerprint: str, starts: datetime, gpu_uuid: str, pod_name: str | None = None, gi: str | None = None,
                profile: str | None = None) -> dict:
    """One alert as Alertmanager sends it for a dcgm-exporter series scraped with ``honor_labels: true``
    (the exporter's own namespace/pod do not overwrite the workload's; a series of no pod has none)."""
    labels = {"alertname": "GpuXidError", "Hostname": NODE, "UUID": gpu_uuid, "gpu": "3", "device": "nvidia3", "err_code": "79",
              "modelName": "NVIDIA A100-SXM4-80GB", "job": "nvidia-dcgm-exporter", "severity": "warning"}
    if pod_name:
        labels.update(namespace="ml", pod=pod_name, container="main")
    if gi:
        labels.update(GPU_I_ID=gi, GPU_I_PROFILE=profile or "")
    return {"status": "firing", "labels": labels, "annotations": {"summary": f"XID 79 on {NODE}"},
            "startsAt": starts.strftime("%Y-%m-%dT%H:%M:%S.%f000Z"), "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus-k8s-0:9090/graph", "fingerprint": fingerprint}


def _body(alerts: list[dict]) -> dict:
    return {"receiver": "gpuledger", "status": "firing", "alerts": alerts, "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://alertmanager-main-0:9093", "version": "4",
            "groupKey": "{}:{alertname=\"GpuXidError\"}", "truncatedAlerts": 0}




def _trace(worker, *args: str) -> dict:
    env = {**os.environ, "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "trace", *args, "--format", "json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _poll_kubelet(sock_path: Path, settings, tmp_path: Path, pods: list) -> int:
    """One poll of the real pod-resources collector against the kubelet double serving ``pods``."""
    with FakeKubelet(sock_path) as kubelet:
        kubelet.set_pods(pods)
        collector = PodResourcesCollector(PodResourcesSettings(node=NODE, socket=sock_path, state_dir=tmp_path / "pr", rpc_timeout_s=2.0),
                                          EventPublisher.from_settings(settings, "podresources"))
        try:
            return collector.poll_once().published
        finally:
            collector.close()


@pytest.fixture
def sock_path():
    d = Path(tempfile.mkdtemp(prefix="glgi-", dir="/tmp"))  # unix socket paths are short
    yield d / "kubelet.sock"
    shutil.rmtree(d, ignore_errors=True)


def test_physical_gpu_alerts_reach_slice_and_share_holders(kafka_bootstrap, catalogue, settings_for, worker_factory, tmp_path, sock_path):
    now = datetime.now(timezone.utc)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    publisher.publish_batch([*_release("r1", "alpha", now), *_release("r2", "beta", now)])

    # The scheduling plane: four GPU pods, each labelled with its release.
    created = now - timedelta(minutes=10)
    with FakeKubeApi() as api:
        for name, rid, resource in (("share-1", "r1", "nvidia.com/gpu.shared"), ("share-2", "r2", "nvidia.com/gpu.shared"),
                                    ("mig-1", "r1", MIG_1G), ("mig-3", "r2", MIG_1G)):
            api.create(PODS, make_pod("ml", name, node=NODE, created=created, gpu_resource=resource,
                                      labels={"gpuledger.io/release-id": rid}))
        settings = SchedulerCollectorSettings(state_flush_interval_s=0, host="test-host")
        sched = SchedulerCollector(settings, EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, COMPONENT),
                                   api.api_client(), tmp_path / "sched")
        try:
            assert sched.run_once() >= 4
        finally:
            sched.close()

    # The node: two shares of GPU_P, two MIG slices (MIG UUIDs: their parent is not in the id).
    assert _poll_kubelet(sock_path, settings_for(catalogue), tmp_path, [
        pod("ml", "share-1", containers=[container("main", devices=[devices("nvidia.com/gpu.shared", [f"{GPU_P}::0"])])]),
        pod("ml", "share-2", containers=[container("main", devices=[devices("nvidia.com/gpu.shared", [f"{GPU_P}::1"])])]),
        pod("ml", "mig-1", containers=[container("main", devices=[devices(MIG_1G, [MIG_A])])]),
        pod("ml", "mig-3", containers=[container("main", devices=[devices(MIG_1G, [MIG_C])])]),
    ]) == 4

    # dcgm-exporter (pod mapping on) names mig-1's slice by its parent and GPU_I_ID; then an XID
    # on the time-sliced GPU and one on mig-1's instance, neither with pod labels.
    starts = datetime.now(timezone.utc) + timedelta(seconds=1)
    body = _body([_dcgm_alert("mig1-metric", starts, GPU_Q, pod_name="mig-1", gi="7", profile="1g.10gb"),
                  _dcgm_alert("xid-shared", starts + timedelta(seconds=1), GPU_P),
                  _dcgm_alert("xid-gi7", starts + timedelta(seconds=2), GPU_Q, gi="7", profile="1g.10gb"),
                  _dcgm_alert("xid-unknown", starts + timedelta(seconds=3), GPU_Z)])
    publisher.publish_batch(alert_events(body, host="test"))

    worker = worker_factory(catalogue, extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})
    poll(lambda: worker.reader.query("SELECT count() AS n FROM gpuledger.enriched_alerts FINAL").dicts()[0]["n"] == 4, "4 alerts stored")
    poll(lambda: worker.reader.query("SELECT gpu FROM gpuledger.gpu_allocations FINAL WHERE pod = 'mig-1'").dicts() == [{"gpu": GPU_Q}],
          "mig-1's slice attributed to its physical GPU")

    # trace --gpu on the physical UUID of a time-sliced GPU: both share holders, listed as such.
    shared = _trace(worker, "--gpu", f"{NODE}/{GPU_P}")
    holders = {(h["pod"], h["gpu_id"], h["holds"]) for h in shared["entry"]["gpu_holders"]}
    assert holders == {("share-1", f"{GPU_P}::0", "share"), ("share-2", f"{GPU_P}::1", "share")}
    assert any("physical GPU held as 2 MIG slice(s), share(s)" in g and "share-1" in g for g in shared["gaps"])
    # The XID on it, as of its startsAt: joined to both (not "unattributed", which control 6 would count), the same holders.
    assert worker.reader.query("SELECT attribution, release_id FROM gpuledger.enriched_alerts FINAL WHERE alert_fingerprint = 'xid-shared'"
                               ).dicts() == [{"attribution": "gpu_shared", "release_id": ""}]
    xid = _trace(worker, "--alert", "xid-shared")
    assert {h["pod"] for h in xid["entry"]["gpu_holders"]} == {"share-1", "share-2"}

    # An alert naming a MIG instance reaches that slice's holder (and its release).
    gi7 = worker.reader.query("SELECT pod, release_id, attribution FROM gpuledger.enriched_alerts FINAL "
                              "WHERE alert_fingerprint = 'xid-gi7'").dicts()
    assert gi7 == [{"pod": "mig-1", "release_id": "r1", "attribution": "gpu_assignment"}]
    assert _trace(worker, "--alert", "xid-gi7")["release"]["release_id"] == "r1"
    # trace --gpu on the MIG parent shows its known slice's holder.
    parent = _trace(worker, "--gpu", f"{NODE}/{GPU_Q}")
    assert [(h["pod"], h["holds"]) for h in parent["entry"]["gpu_holders"]] == [("mig-1", "mig_slice")]

    # A GPU no allocation names while a slice of unknown parent was held: said so.
    unknown = _trace(worker, "--alert", "xid-unknown")
    assert any("MIG -> GPU mapping is unknown" in g and "mig-3" in g for g in unknown["gaps"]), unknown["gaps"]


def test_dra_allocated_gpus_are_attributed_like_device_plugin_ones(kafka_bootstrap, catalogue, settings_for, worker_factory, tmp_path,
                                                                   sock_path):
    """Issue #13.3: the kubelet reports (driver, pool, device) for a DRA claim; the ResourceSlice
    NVIDIA's driver publishes says which GPU / MIG device that is. An XID on the GPU's UUID and an
    alert on the MIG instance reach the pods, and trace --gpu on the UUIDs finds them."""
    from tests.fixtures.kube_api import RESOURCE_SLICES, dra_gpu_device, dra_mig_device, make_resource_slice
    from tests.fixtures.kubelet import claim_resource, dynamic_resource

    now = datetime.now(timezone.utc)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    publisher.publish_batch([*_release("r1", "alpha", now), *_release("r2", "beta", now)])
    created = now - timedelta(minutes=10)
    with FakeKubeApi() as api:
        api.create(RESOURCE_SLICES, make_resource_slice(NODE, [dra_gpu_device(0, GPU_P), dra_mig_device(1, "1g.10gb", 0, MIG_A, GPU_Q)],
                                                        created=created))
        for name, rid in (("dra-whole", "r1"), ("dra-mig", "r2")):
            # A DRA pod requests no extended resource: it names a ResourceClaim (from a template).
            spec_pod = make_pod("ml", name, node=NODE, created=created, gpus=0, labels={"gpuledger.io/release-id": rid})
            spec_pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}]
            spec_pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
            api.create(PODS, spec_pod)
        sched = SchedulerCollector(SchedulerCollectorSettings(state_flush_interval_s=0, host="test-host"),
                                   EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, COMPONENT), api.api_client(), tmp_path / "sched")
        try:
            assert sched.run_once() == 2 + 2 * 3  # the two devices; each pod: submitted, scheduled, running
        finally:
            sched.close()

    assert _poll_kubelet(sock_path, settings_for(catalogue), tmp_path, [
        pod("ml", "dra-whole", containers=[container("main", dynamic_resources=[
            dynamic_resource("dra-whole-gpu", "ml", [claim_resource("gpu.nvidia.com", NODE, "gpu-0")])])]),
        pod("ml", "dra-mig", containers=[container("main", dynamic_resources=[
            dynamic_resource("dra-mig-gpu", "ml", [claim_resource("gpu.nvidia.com", NODE, "gpu-1-mig-1g10gb-0")])])]),
    ]) == 2

    starts = datetime.now(timezone.utc) + timedelta(seconds=1)
    publisher.publish_batch(alert_events(_body([_dcgm_alert("xid-dra-gpu", starts, GPU_P),
                                                _dcgm_alert("xid-dra-mig", starts, GPU_Q, gi="3", profile="1g.10gb")]), host="test"))
    worker = worker_factory(catalogue, extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})
    def attributed():
        rows = worker.reader.query("SELECT alert_fingerprint, pod, release_id, attribution FROM gpuledger.enriched_alerts FINAL "
                                   "ORDER BY alert_fingerprint").dicts()
        return rows if len(rows) == 2 and all(r["release_id"] for r in rows) else None

    rows = poll(attributed, "both alerts attributed")
    assert rows == [{"alert_fingerprint": "xid-dra-gpu", "pod": "dra-whole", "release_id": "r1", "attribution": "gpu_assignment"},
                    {"alert_fingerprint": "xid-dra-mig", "pod": "dra-mig", "release_id": "r2", "attribution": "gpu_assignment"}]
    # (the allocations travel on their own topic: stored in the same sink batch as the alerts, or the next)
    allocs = poll(lambda: rows if len(rows := worker.reader.query("SELECT pod, gpu_id, gpu, mig_instance FROM gpuledger.gpu_allocations "
                                                                  "FINAL ORDER BY pod").dicts()) == 2 else None, "both allocations stored")
    assert allocs == [{"pod": "dra-mig", "gpu_id": f"gpu.nvidia.com/{NODE}/gpu-1-mig-1g10gb-0", "gpu": GPU_Q, "mig_instance": MIG_A},
                      {"pod": "dra-whole", "gpu_id": f"gpu.nvidia.com/{NODE}/gpu-0", "gpu": GPU_P, "mig_instance": ""}]
    assert _trace(worker, "--gpu", f"{NODE}/{GPU_Q}")["release"]["release_id"] == "r2"
    whole = _trace(worker, "--gpu", f"{NODE}/{GPU_P}")
    assert whole["release"]["release_id"] == "r1"
    assert [(h["pod"], h["holds"]) for h in whole["entry"]["gpu_holders"]] == [("dra-whole", "dra_device")]


def test_a_dra_holding_the_claim_and_the_kubelet_both_report_is_one_allocation_row(kafka_bootstrap, catalogue, settings_for,
                                                                                     worker_factory, tmp_path, sock_path):
    """Issue #13.3: the scheduler collector reports the holding from the ResourceClaim (reserved at
    scheduling), the pod-resources collector from the kubelet (later, naming the container): the
    worker stores one gpu_allocations row — the claim's start, the kubelet's container — and the
    claim's release ends it."""
    from tests.fixtures.kube_api import RESOURCE_CLAIMS, RESOURCE_SLICES, dra_gpu_device, make_resource_slice
    from tests.fixtures.kubelet import claim_resource, dynamic_resource

    now = datetime.now(timezone.utc)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    publisher.publish_batch(_release("r1", "alpha", now))
    created = now - timedelta(minutes=10)
    settings = SchedulerCollectorSettings(state_flush_interval_s=0, host="test-host")
    with FakeKubeApi() as api:
        api.create(RESOURCE_SLICES, make_resource_slice(NODE, [dra_gpu_device(0, GPU_P)], created=created))
        spec_pod = make_pod("ml", "dra-both", node=NODE, created=created, gpus=0, labels={"gpuledger.io/release-id": "r1"})
        spec_pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "dra-both-gpu"}]
        spec_pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
        uid = api.create(PODS, spec_pod)["metadata"]["uid"]
        api.create(RESOURCE_CLAIMS, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                     "metadata": {"name": "dra-both-gpu", "namespace": "ml", "creationTimestamp": created.isoformat()},
                                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
                                     "status": {"allocation": {"devices": {"results": [
                                         {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}]},
                                         "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                                             {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}},
                                         "reservedFor": [{"resource": "pods", "name": "dra-both", "uid": uid}]}})
        sched = SchedulerCollector(settings, EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, COMPONENT), api.api_client(),
                                   tmp_path / "sched")
        try:
            assert sched.run_once() == 1 + 1 + 3  # the device; the claim's holding; submitted, scheduled, running
            assert _poll_kubelet(sock_path, settings_for(catalogue), tmp_path, [
                pod("ml", "dra-both", containers=[container("main", dynamic_resources=[
                    dynamic_resource("dra-both-gpu", "ml", [claim_resource("gpu.nvidia.com", NODE, "gpu-0")])])])]) == 1
            worker = worker_factory(catalogue, extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})
            query = ("SELECT allocation_id, gpu_id, gpu, container, release_id, pod_uid, started_at, ended_at, end_reason "
                     "FROM gpuledger.gpu_allocations FINAL WHERE pod = 'dra-both'")
            held = poll(lambda: (rows := worker.reader.query(query).dicts()) and rows[0]["container"] and rows[0]["gpu"] and rows,
                        "the holding stored with the kubelet's container and the slice's GPU")
            # The pod finished: the resourceclaim controller drops it from reservedFor.
            api.patch(RESOURCE_CLAIMS, "ml", "dra-both-gpu", {"status": {"reservedFor": None}})
            assert sched.run_once() == 1
        finally:
            sched.close()
    ended = poll(lambda: (rows := worker.reader.query(query).dicts()) and all(r["ended_at"] for r in rows) and rows, "the holding ended")
    # One row, before and after: both sources and the end converge on one allocation.
    assert len(held) == 1 and len(ended) == 1 and ended[0]["allocation_id"] == held[0]["allocation_id"], (held, ended)
    row = ended[0]
    assert (row["gpu_id"], row["gpu"], row["container"], row["release_id"], row["pod_uid"], row["end_reason"]) == \
           (f"gpu.nvidia.com/{NODE}/gpu-0", GPU_P, "main", "r1", uid, "unreserved")
    assert row["started_at"] == held[0]["started_at"]
    everything = worker.reader.query("SELECT count() AS n FROM gpuledger.gpu_allocations FINAL").dicts()
    assert everything == [{"n": 1}]
