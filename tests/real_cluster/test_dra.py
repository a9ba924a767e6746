"""DRA on the real cluster: a ResourceSlice as NVIDIA's driver publishes it, a claim the real
kube-scheduler allocates, a pod KWOK runs — and who holds which GPU, from the API server alone.

No kubelet collector runs here: the allocation row and the XID alert's attribution come from the
scheduler collector's ResourceSlice (``gpu.device``) and ResourceClaim (``gpu.claim_*``) events,
through the real broker, the worker and its chDB store. The alert comes in through the receiver
as an Alertmanager v4 body naming only the node and the physical GPU (``Hostname``, ``UUID``), as
dcgm-exporter does for a GPU its pod mapping does not know.

A Job queued in Kueue whose pods get their GPU through a claim: its Workload, which requests no
GPU resource, is published with its pod.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kubernetes import client as k8s

from producers._kafka import EventPublisher
from producers.receiver.config import ReceiverSettings
from tests.producers.kubernetes.test_collector import running
from tests.producers.receiver.test_server import RunningReceiver
from tests.real_cluster.conftest import REAL_CLUSTER, gpu_job, queue_namespace, unique, wait_for, workloads_of
from tests.real_cluster.test_alerting import alert_rows, registered
from tests.real_cluster.test_scheduler_collector import kinds, on_topic

pytestmark = REAL_CLUSTER

GROUP, VERSION = "resource.k8s.io", "v1"
DRIVER = "gpu.nvidia.com"
NODE = "gpu-node-2"
XID_BODY = Path(__file__).parents[1] / "data" / "alertmanager" / "gpu_xid_firing.json"


def nvidia_slice(name: str, node: str, gpu_uuid: str, mig_uuid: str, mig_parent: str, pool: str | None = None) -> dict:
    """A ResourceSlice shaped like NVIDIA's DRA driver's: one whole GPU and one MIG device (on another GPU); its
    pool is named after the node unless ``pool`` says otherwise."""
    def attrs(**kv):
        return {k: ({"int": v} if isinstance(v, int) else {"string": v}) for k, v in kv.items()}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [
                         {"name": "gpu-0", "attributes": attrs(type="gpu", uuid=gpu_uuid, index=0, minor=0, productName="NVIDIA H100 80GB HBM3",
                                                               architecture="Hopper", brand="Nvidia", driverVersion="550.90.7"),
                          "capacity": {"memory": {"value": "81559Mi"}}},
                         {"name": "gpu-1-mig-1g10gb-0", "attributes": attrs(type="mig", uuid=mig_uuid, parentUUID=mig_parent, index=1, profile="1g.10gb",
                                                                            productName="NVIDIA H100 80GB HBM3"),
                          "capacity": {"memory": {"value": "9984Mi"}}}]}}


@dataclass(frozen=True)
class ClaimableGpu:
    """What ``claimable_gpu`` created: the DeviceClass, the ResourceSlice and its devices' uuids."""

    tag: str
    device_class: str
    slice_name: str
    gpu_uuid: str
    mig_uuid: str
    mig_parent: str


@contextmanager
def claimable_gpu(custom: k8s.CustomObjectsApi, ns: str, pool: str | None = None) -> Iterator[ClaimableGpu]:
    """A fresh NVIDIA-shaped ResourceSlice on ``NODE`` (``nvidia_slice``), a DeviceClass selecting its whole
    GPU only (other slices may exist in the session), and a ResourceClaimTemplate ``one-gpu`` in ``ns``
    asking for one device of it; the cluster-scoped objects are deleted at exit."""
    tag = unique("dra")
    gpu_uuid, mig_uuid, mig_parent = (f"GPU-{tag[-6:]}00-0000-4000-8000-00000000000{i}" for i in (1, 2, 3))
    made = ClaimableGpu(tag, f"{tag}.nvidia.com", f"{NODE}-{tag}", gpu_uuid, mig_uuid, mig_parent)
    custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "DeviceClass", "metadata": {"name": made.device_class},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu' "
                                                      f"&& device.attributes['{DRIVER}'].uuid == '{gpu_uuid}'"}}]}})
    try:
        custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", nvidia_slice(made.slice_name, NODE, gpu_uuid, mig_uuid, mig_parent,
                                                                                         pool))
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaimtemplates", {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaimTemplate", "metadata": {"name": "one-gpu"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": made.device_class}}]}}}})
            yield made
        finally:
            custom.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", made.slice_name)
    finally:
        custom.delete_cluster_custom_object(GROUP, VERSION, "deviceclasses", made.device_class)


def xid_body(node: str, gpu_uuid: str, fingerprint: str, starts_at: datetime) -> dict:
    """The real-format Alertmanager v4 XID body, for ``gpu_uuid`` on ``node``, with no pod labels."""
    body = json.loads(XID_BODY.read_text())
    for labels in (body["alerts"][0]["labels"], body["commonLabels"]):
        for name in ("pod", "namespace", "container", "exported_pod", "exported_namespace", "exported_container"):
            labels.pop(name, None)
        labels.update(Hostname=node, UUID=gpu_uuid)
    body["groupLabels"]["Hostname"] = node
    body["alerts"][0].update(fingerprint=fingerprint, startsAt=starts_at.isoformat().replace("+00:00", "Z"))
    return body


def test_a_dra_gpu_the_scheduler_allocated_is_held_by_its_pod_and_its_xid_reaches_it(real_cluster, kube, make_collector, kafka_bootstrap,
                                                                                     catalogue, settings_for, worker_factory):
    custom, core = k8s.CustomObjectsApi(kube), k8s.CoreV1Api(kube)
    settings = settings_for(catalogue)
    rid = unique("rel-dra")
    EventPublisher.from_settings(settings, "test").publish_batch([registered(rid)])
    worker = worker_factory(catalogue, extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})
    ns, pod_name = unique("dra"), unique("infer")
    real_cluster.ensure_namespace(ns)
    collector = make_collector(None)  # cluster-wide: ResourceSlices are cluster-scoped
    with claimable_gpu(custom, ns) as made:
        gpu_uuid, mig_uuid, mig_parent, tag = made.gpu_uuid, made.mig_uuid, made.mig_parent, made.tag
        with running(collector), RunningReceiver(ReceiverSettings(), EventPublisher.from_settings(settings, "receiver")) as rx:
            core.create_namespaced_pod(ns, {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "labels": {"gpuledger.io/release-id": rid}},
                "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                         "containers": [{"name": "serve", "image": "registry.example/serve@sha256:" + "cd" * 32,
                                         "resources": {"claims": [{"name": "gpu"}]}}]}})
            pod = wait_for(lambda: (p := core.read_namespaced_pod(pod_name, ns)).status.phase == "Running" and p, 120,
                           "KWOK to run the pod the scheduler placed")
            # The real scheduler allocated the claim and reserved it for the pod (nobody else wrote its status).
            [claim_status] = pod.status.resource_claim_statuses
            claim = custom.get_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaims", claim_status.resource_claim_name)
            [result] = claim["status"]["allocation"]["devices"]["results"]
            assert (result["driver"], result["pool"], result["device"], result["request"]) == (DRIVER, NODE, "gpu-0", "gpu")
            assert [(r["resource"], r["name"], r["uid"]) for r in claim["status"]["reservedFor"]] == [("pods", pod_name, pod.metadata.uid)]
            assert pod.spec.node_name == NODE
            device_id = f"{DRIVER}/{NODE}/gpu-0"

            # Who holds it, from the API server: the allocation row, under the pod's release.
            def allocation():
                return worker.reader.query("SELECT gpu_id, gpu, node, container, release_id, pod_uid, started_at, ended_at, end_reason "
                                           "FROM gpuledger.gpu_allocations FINAL WHERE namespace = {n:String} AND pod = {p:String}",
                                           {"n": ns, "p": pod_name}).dicts()
            [row] = wait_for(lambda: (r := allocation()) and r[0]["gpu"] and r[0]["release_id"] and r, 90,
                             "the claim's GPU allocation stored, its GPU and release known")
            assert (row["gpu_id"], row["gpu"], row["node"], row["container"], row["release_id"], row["pod_uid"], row["ended_at"]) == \
                   (device_id, gpu_uuid, NODE, "", rid, pod.metadata.uid, None)

            # An XID on that physical GPU, through the receiver: it reaches the pod holding it.
            status, _answer = rx.post("/v1/alertmanager", xid_body(NODE, gpu_uuid, tag, datetime.now(timezone.utc)))
            assert status == 200
            [alert] = wait_for(lambda: [r for r in alert_rows(worker, pod_name) if r["release_id"]], 90, "the XID attributed to the pod")
            assert (alert["namespace"], alert["node"], alert["gpu_id"], alert["release_id"], alert["attribution"]) == \
                   (ns, NODE, gpu_uuid, rid, "gpu_assignment")

            # The pod goes: the resourceclaim controller deletes its claim, and the holding ends.
            core.delete_namespaced_pod(pod_name, ns, grace_period_seconds=0)
            [ended] = wait_for(lambda: (r := allocation()) and r[0]["ended_at"] is not None and r, 90, "the allocation ended")
            assert ended["end_reason"] in ("claim_deleted", "unreserved", "deallocated", "pod_deleted"), ended
            [released] = wait_for(lambda: [e for e in on_topic(kafka_bootstrap, catalogue.gpu, 1, settle=0.5)
                                           if e.event_type == "gpu.claim_released" and e.identity.pod == pod_name], 60,
                                  "the claim's release published")
            # The claim's end defines the holding's end (a pod deletion seen first only stands in for it).
            wait_for(lambda: allocation()[0]["end_reason"] == released.payload.reason, 60, "the allocation ended by the claim's release")

    # What the collector published, exactly once each: what the slice's devices are, and the holding.
    events = on_topic(kafka_bootstrap, catalogue.gpu, collector.counters.totals["sent"])
    devices = {e.payload.device_id: e for e in events if e.event_type == "gpu.device" and e.payload.pool == NODE}
    whole, mig = devices[device_id], devices[f"{DRIVER}/{NODE}/gpu-1-mig-1g10gb-0"]
    assert (whole.identity.node, whole.payload.gpu, whole.payload.mig_instance) == (NODE, gpu_uuid, None)
    assert (mig.payload.gpu, mig.payload.mig_instance, mig.payload.profile) == (mig_parent, mig_uuid, "1g.10gb")
    mine = [e for e in events if e.event_type.startswith("gpu.claim_") and e.identity.namespace == ns]
    assert [e.event_type for e in mine] == ["gpu.claim_reserved", "gpu.claim_released"], [e.event_type for e in mine]
    reserved, released = mine
    assert (reserved.identity.pod, reserved.identity.pod_uid, reserved.identity.node, reserved.payload.device_id, reserved.payload.claim,
            reserved.payload.request) == (pod_name, pod.metadata.uid, NODE, device_id, claim["metadata"]["name"], "gpu")
    assert mine[1] == released and released.payload.reason in ("claim_deleted", "unreserved", "deallocated")
    assert released.occurred_at >= reserved.occurred_at


def test_a_kueue_job_whose_pods_claim_their_gpu_has_its_workload_published(real_cluster, kube, make_collector, kafka_bootstrap, catalogue):
    """Kueue keeps the Job's pod template, its DRA claims included, in the Workload's pod sets; the
    Workload requests no GPU resource. The collector published the Job's pod (it names a claim) and
    skipped its Workload: the GPU job had no queued, admitted or finished Workload on the topic."""
    custom, batch = k8s.CustomObjectsApi(kube), k8s.BatchV1Api(kube)
    ns, name = queue_namespace(real_cluster, "drajob"), unique("train")
    with claimable_gpu(custom, ns, pool=unique("pool")):
        collector = make_collector(ns)
        with running(collector):
            batch.create_namespaced_job(ns, gpu_job(name, namespace=ns, claim_template="one-gpu", labels={"gpuledger.io/release-id": "rel-dra-job"}))
            wait_for(lambda: any(c.type == "Complete" and c.status == "True" for c in batch.read_namespaced_job(name, ns).status.conditions or []),
                     120, "the Job's pod to get its claim allocated, run and complete")
            [wl] = workloads_of(kube, name, ns)
            # Kueue's own Workload: the claim is in the pod set's template, no GPU among the container's requests.
            [pod_set] = wl["spec"]["podSets"]
            assert pod_set["template"]["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
            assert set(pod_set["template"]["spec"]["containers"][0]["resources"]["requests"]) == {"cpu"}
            wl_id = f"{ns}/{wl['metadata']['name']}"
            wait_for(lambda: {"admitted", "finished"} <= set(kinds(on_topic(kafka_bootstrap, catalogue.scheduler, 1, settle=0.5), "Workload")),
                     60, "the Workload's admission and end published")
    events = on_topic(kafka_bootstrap, catalogue.scheduler, collector.counters.totals["sent"])
    wl_events = [e for e in events if e.payload.object_kind == "Workload"]
    assert {"queued", "quota_reserved", "admitted", "finished"} <= set(kinds(events, "Workload")), kinds(events, "Workload")
    assert {e.identity.workload_id for e in wl_events} == {wl_id} and {e.identity.release_id for e in wl_events} == {"rel-dra-job"}
    # Its pod is the same workload: the history a control reads has both.
    pod_events = [e for e in events if e.payload.object_kind == "Pod"]
    assert pod_events and {e.identity.workload_id for e in pod_events} == {wl_id}
