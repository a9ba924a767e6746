"""Tests for the kubelet PodResources v1 proto and the FakeKubelet test double.

Two concerns:

* Wire compatibility: field numbers/types are asserted against upstream
  (kubernetes/kubernetes staging/src/k8s.io/kubelet/pkg/apis/podresources/v1/api.proto)
  so an accidental edit of producers/podresources/proto/podresources_v1.proto fails here.
* The double behaves like a kubelet over a real gRPC unix-socket channel:
  List / GetAllocatableResources / Get, UNIMPLEMENTED Get, rate limiting, a restart.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor as FD

from producers.podresources.proto import podresources_v1_pb2 as pb
from producers.podresources.proto import podresources_v1_pb2_grpc as pb_grpc
from tests.fixtures.kubelet import (
    DEFAULT_BURST,
    DEFAULT_QPS,
    GET_DISABLED_MESSAGE,
    RATE_LIMIT_MESSAGE,
    FakeKubelet,
    claim_resource,
    container,
    devices,
    dynamic_resource,
    pod,
)

TIMEOUT = 5  # seconds per RPC; a hang should fail fast, not stall the suite

MIG_A = "MIG-4f6a9c2e-1b3d-5e7f-8a9b-0c1d2e3f4a5b"
MIG_B = "MIG-7d2e1f0a-9b8c-4d3e-a2f1-0e9d8c7b6a59"
GPU_UUID = "GPU-8f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
TIMESLICED = f"{GPU_UUID}::2"  # nvidia device plugin replica id


# --------------------------------------------------------------------------
# Wire field numbers (drift from upstream must fail a test)
# --------------------------------------------------------------------------

# message -> {field: (number, type, repeated)}; exhaustive per message, so an
# added, removed or renumbered field all fail.
UPSTREAM_FIELDS = {
    "AllocatableResourcesRequest": {},
    "AllocatableResourcesResponse": {
        "devices": (1, FD.TYPE_MESSAGE, True),
        "cpu_ids": (2, FD.TYPE_INT64, True),
        "memory": (3, FD.TYPE_MESSAGE, True),
    },
    "ListPodResourcesRequest": {},
    "ListPodResourcesResponse": {
        "pod_resources": (1, FD.TYPE_MESSAGE, True),
    },
    "PodResources": {
        "name": (1, FD.TYPE_STRING, False),
        "namespace": (2, FD.TYPE_STRING, False),
        "containers": (3, FD.TYPE_MESSAGE, True),
    },
    "ContainerResources": {
        "name": (1, FD.TYPE_STRING, False),
        "devices": (2, FD.TYPE_MESSAGE, True),
        "cpu_ids": (3, FD.TYPE_INT64, True),
        "memory": (4, FD.TYPE_MESSAGE, True),
        "dynamic_resources": (5, FD.TYPE_MESSAGE, True),
    },
    "ContainerMemory": {
        "memory_type": (1, FD.TYPE_STRING, False),
        "size": (2, FD.TYPE_UINT64, False),
        "topology": (3, FD.TYPE_MESSAGE, False),
    },
    "ContainerDevices": {
        "resource_name": (1, FD.TYPE_STRING, False),
        "device_ids": (2, FD.TYPE_STRING, True),
        "topology": (3, FD.TYPE_MESSAGE, False),
    },
    "TopologyInfo": {
        "nodes": (1, FD.TYPE_MESSAGE, True),
    },
    "NUMANode": {
        "ID": (1, FD.TYPE_INT64, False),
    },
    "DynamicResource": {
        # class_name = 1 was removed upstream in 1.31; numbering starts at 2.
        "claim_name": (2, FD.TYPE_STRING, False),
        "claim_namespace": (3, FD.TYPE_STRING, False),
        "claim_resources": (4, FD.TYPE_MESSAGE, True),
    },
    "ClaimResource": {
        "cdi_devices": (1, FD.TYPE_MESSAGE, True),
        "driver_name": (2, FD.TYPE_STRING, False),
        "pool_name": (3, FD.TYPE_STRING, False),
        "device_name": (4, FD.TYPE_STRING, False),
    },
    "CDIDevice": {
        "name": (1, FD.TYPE_STRING, False),
    },
    "GetPodResourcesRequest": {
        "pod_name": (1, FD.TYPE_STRING, False),
        "pod_namespace": (2, FD.TYPE_STRING, False),
    },
    "GetPodResourcesResponse": {
        "pod_resources": (1, FD.TYPE_MESSAGE, False),
    },
}


def _is_repeated(field) -> bool:
    # FieldDescriptor.label is deprecated in newer protobuf releases.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == FD.LABEL_REPEATED


@pytest.mark.parametrize("message", sorted(UPSTREAM_FIELDS))
def test_field_numbers_match_upstream(message):
    desc = pb.DESCRIPTOR.message_types_by_name[message]
    actual = {
        f.name: (f.number, f.type, _is_repeated(f)) for f in desc.fields
    }
    assert actual == UPSTREAM_FIELDS[message]


def test_all_messages_are_covered():
    assert set(pb.DESCRIPTOR.message_types_by_name) == set(UPSTREAM_FIELDS)


def test_key_wire_numbers():
    # The numbers most likely to be "tidied up" by hand; called out explicitly.
    def fields(message):
        return pb.DESCRIPTOR.message_types_by_name[message].fields_by_name

    assert fields("ContainerResources")["dynamic_resources"].number == 5
    assert fields("ContainerDevices")["topology"].number == 3
    assert fields("ContainerDevices")["device_ids"].number == 2
    assert fields("DynamicResource")["claim_name"].number == 2
    assert fields("DynamicResource")["claim_resources"].number == 4
    assert fields("ClaimResource")["device_name"].number == 4


def test_removed_and_future_numbers_are_reserved():
    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    by_name = {m.name: m for m in fdp.message_type}

    def reserved(name):
        # reserved_range.end is exclusive
        return {n for r in by_name[name].reserved_range for n in range(r.start, r.end)}

    assert reserved("DynamicResource") == {1}
    assert list(by_name["DynamicResource"].reserved_name) == ["class_name"]
    # Used by newer kubelets; reserved so they are never reused with another meaning.
    assert reserved("ClaimResource") == {5}
    assert reserved("PodResources") == {4, 5}
    assert reserved("ContainerResources") == {6}


def test_service_method_paths_match_kubelet():
    # gRPC routes on "/<package>.<Service>/<Method>"; any rename breaks the wire.
    service = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse"),
        "GetAllocatableResources": (
            "AllocatableResourcesRequest",
            "AllocatableResourcesResponse",
        ),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse"),
    }


def test_hand_encoded_kubelet_bytes_decode():
    # DynamicResource{claim_name: "c"} as a kubelet encodes it: field 2, wire
    # type 2 -> tag 0x12. Independent of our descriptor, so it pins the number.
    assert pb.DynamicResource.FromString(b"\x12\x01c").claim_name == "c"
    # ContainerDevices.topology (field 3) holding NUMA node 1.
    raw = b"\x0a\x03gpu" + b"\x1a\x04\x0a\x02\x08\x01"
    msg = pb.ContainerDevices.FromString(raw)
    assert msg.resource_name == "gpu"
    assert [n.ID for n in msg.topology.nodes] == [1]


def test_newer_kubelet_fields_are_skipped_not_fatal():
    # A newer kubelet may send ClaimResource field 5 (share_id). proto3 must
    # skip it and still decode the fields we know.
    base = pb.ClaimResource(driver_name="gpu.nvidia.com").SerializeToString()
    newer = base + b"\x2a\x03abc"  # field 5, length-delimited "abc"
    assert pb.ClaimResource.FromString(newer).driver_name == "gpu.nvidia.com"


# --------------------------------------------------------------------------
# FakeKubelet over a real unix-socket channel
# --------------------------------------------------------------------------

@pytest.fixture
def socket_dir():
    # A short /tmp path, not pytest's tmp_path: AF_UNIX paths are capped at
    # 107 bytes and tmp_path embeds the (long) test name.
    d = tempfile.mkdtemp(prefix="kubelet-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(socket_dir):
    with FakeKubelet(f"{socket_dir}/kubelet.sock") as k:
        yield k


@pytest.fixture
def stub(kubelet):
    channel = grpc.insecure_channel(kubelet.address)
    try:
        yield pb_grpc.PodResourcesListerStub(channel)
    finally:
        channel.close()


def _gpu_pods():
    return [
        pod("ml", "trainer-0", containers=[
            container("main", devices=[
                devices("nvidia.com/mig-1g.10gb", [MIG_A, MIG_B], numa=[0]),
            ], cpu_ids=[2, 3]),
            container("sidecar"),
        ]),
        pod("inference", "server-7c9", containers=[
            container("model", devices=[
                devices("nvidia.com/gpu.shared", [TIMESLICED], numa=[1]),
            ]),
        ]),
    ]


def test_list_returns_pods_with_mig_and_timesliced_ids(kubelet, stub):
    kubelet.set_pods(_gpu_pods())

    resp = stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT)

    by_name = {(p.namespace, p.name): p for p in resp.pod_resources}
    assert set(by_name) == {("ml", "trainer-0"), ("inference", "server-7c9")}

    trainer = by_name[("ml", "trainer-0")]
    assert [c.name for c in trainer.containers] == ["main", "sidecar"]
    main = trainer.containers[0]
    assert main.devices[0].resource_name == "nvidia.com/mig-1g.10gb"
    assert list(main.devices[0].device_ids) == [MIG_A, MIG_B]
    assert [n.ID for n in main.devices[0].topology.nodes] == [0]
    assert list(main.cpu_ids) == [2, 3]
    assert len(trainer.containers[1].devices) == 0

    shared = by_name[("inference", "server-7c9")].containers[0].devices[0]
    assert list(shared.device_ids) == [TIMESLICED]
    assert shared.device_ids[0].endswith("::2")
    assert kubelet.call_count("List") == 1


def test_set_pods_accepts_dicts(kubelet, stub):
    kubelet.set_pods([
        {"namespace": "ml", "name": "p", "containers": [
            {"name": "c", "devices": [
                {"resource_name": "nvidia.com/gpu", "ids": [GPU_UUID], "numa": [0]},
            ]},
        ]},
    ])

    resp = stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT)

    dev = resp.pod_resources[0].containers[0].devices[0]
    assert (dev.resource_name, list(dev.device_ids)) == ("nvidia.com/gpu", [GPU_UUID])


def test_list_reports_dra_claims(kubelet, stub):
    kubelet.set_pods([
        pod("ml", "dra-0", containers=[
            container("main", dynamic_resources=[
                dynamic_resource("gpu-claim", "ml", [
                    claim_resource("gpu.nvidia.com", "node-a", "gpu-0",
                                   cdi_devices=["k8s.gpu.nvidia.com/device=gpu-0"]),
                ]),
            ]),
        ]),
    ])

    resp = stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT)

    dr = resp.pod_resources[0].containers[0].dynamic_resources[0]
    assert (dr.claim_name, dr.claim_namespace) == ("gpu-claim", "ml")
    cr = dr.claim_resources[0]
    assert (cr.driver_name, cr.pool_name, cr.device_name) == ("gpu.nvidia.com", "node-a", "gpu-0")
    assert [d.name for d in cr.cdi_devices] == ["k8s.gpu.nvidia.com/device=gpu-0"]


def test_get_allocatable_resources_with_numa(kubelet, stub):
    kubelet.set_allocatable(
        [
            devices("nvidia.com/gpu", [GPU_UUID], numa=[0]),
            devices("nvidia.com/mig-1g.10gb", [MIG_A, MIG_B], numa=[1]),
        ],
        cpu_ids=range(8),
    )

    resp = stub.GetAllocatableResources(pb.AllocatableResourcesRequest(), timeout=TIMEOUT)

    numa = {d.resource_name: [n.ID for n in d.topology.nodes] for d in resp.devices}
    assert numa == {"nvidia.com/gpu": [0], "nvidia.com/mig-1g.10gb": [1]}
    assert list(resp.cpu_ids) == list(range(8))
    assert kubelet.call_count("GetAllocatableResources") == 1


def test_get_known_pod(kubelet, stub):
    kubelet.set_pods(_gpu_pods())

    resp = stub.Get(
        pb.GetPodResourcesRequest(pod_name="server-7c9", pod_namespace="inference"),
        timeout=TIMEOUT,
    )

    assert resp.pod_resources.name == "server-7c9"
    assert list(resp.pod_resources.containers[0].devices[0].device_ids) == [TIMESLICED]


def test_get_unknown_pod_is_not_found(kubelet, stub):
    kubelet.set_pods(_gpu_pods())

    with pytest.raises(grpc.RpcError) as err:
        stub.Get(
            pb.GetPodResourcesRequest(pod_name="nope", pod_namespace="ml"),
            timeout=TIMEOUT,
        )

    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "pod nope in namespace ml not found"


def test_get_unknown_pod_kubelet_faithful_code(kubelet, stub):
    # The real kubelet returns a plain Go error -> UNKNOWN, same message.
    kubelet.not_found_code = grpc.StatusCode.UNKNOWN

    with pytest.raises(grpc.RpcError) as err:
        stub.Get(pb.GetPodResourcesRequest(pod_name="nope", pod_namespace="ml"), timeout=TIMEOUT)

    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "pod nope in namespace ml not found"


def test_get_unimplemented_like_older_kubelet(kubelet, stub):
    kubelet.set_pods(_gpu_pods())
    kubelet.get_implemented = False

    with pytest.raises(grpc.RpcError) as err:
        stub.Get(
            pb.GetPodResourcesRequest(pod_name="trainer-0", pod_namespace="ml"),
            timeout=TIMEOUT,
        )

    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # List keeps working, which is what a Get->List fallback relies on.
    assert len(stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT).pod_resources) == 2


def test_get_with_feature_gate_disabled(kubelet, stub):
    kubelet.set_pods(_gpu_pods())
    kubelet.get_gate_disabled = True

    with pytest.raises(grpc.RpcError) as err:
        stub.Get(pb.GetPodResourcesRequest(pod_name="trainer-0", pod_namespace="ml"), timeout=TIMEOUT)

    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == GET_DISABLED_MESSAGE


def test_exhaust_next_then_recovers(kubelet, stub):
    kubelet.set_pods(_gpu_pods())
    kubelet.exhaust_next(2)

    for call in (
        lambda: stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT),
        lambda: stub.GetAllocatableResources(pb.AllocatableResourcesRequest(), timeout=TIMEOUT),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == RATE_LIMIT_MESSAGE

    resp = stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT)
    assert len(resp.pod_resources) == 2
    # Rejected calls still count: the kubelet received them.
    assert kubelet.calls == {"List": 2, "GetAllocatableResources": 1, "Get": 0}


def test_rate_limit_is_one_token_bucket_for_all_methods_like_the_kubelets(kubelet, stub):
    """rate.NewLimiter(100, 10) with Allow(): full at start, refused at once when empty, refilled with time."""
    now = [0.0]
    kubelet.rate_limit(DEFAULT_QPS, DEFAULT_BURST, clock=lambda: now[0])
    kubelet.set_pods(_gpu_pods())
    calls = [lambda: stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT),
             lambda: stub.Get(pb.GetPodResourcesRequest(pod_name="trainer-0", pod_namespace="ml"), timeout=TIMEOUT)]

    def outcomes(n):
        codes = []
        for i in range(n):
            try:
                calls[i % 2]()
                codes.append("ok")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
        return codes

    assert outcomes(12) == ["ok"] * 10 + ["RESOURCE_EXHAUSTED"] * 2
    now[0] += 0.03  # 100/s: three tokens
    assert outcomes(4) == ["ok"] * 3 + ["RESOURCE_EXHAUSTED"]
    now[0] += 60  # never more than the burst
    assert outcomes(11).count("ok") == 10
    assert kubelet.refused_count("List") + kubelet.refused_count("Get") == 4


def test_set_pods_snapshot_is_isolated_from_caller(kubelet, stub):
    p = pod("ml", "p", containers=[container("c")])
    kubelet.set_pods([p])
    p.name = "mutated-after-set"

    resp = stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT)

    assert resp.pod_resources[0].name == "p"


def test_restart_serves_no_pods_before_sync_and_no_devices_before_their_plugin_registered(kubelet, socket_dir):
    # pkg/kubelet (v1.34): the API is served at start; pods come from the API server later, a
    # resource's allocatable devices once its device plugin registered again (readCheckpoint).
    kubelet.set_pods(_gpu_pods())
    kubelet.set_allocatable([devices("nvidia.com/gpu", [GPU_UUID], numa=[0]), devices("nvidia.com/mig-1g.10gb", [MIG_A], numa=[1])])
    before = os.stat(kubelet.socket_path)
    kubelet.restart()
    after = os.stat(kubelet.socket_path)
    assert (after.st_ino, after.st_ctime_ns) != (before.st_ino, before.st_ctime_ns)  # a re-created socket
    channel = grpc.insecure_channel(kubelet.address)
    try:
        stub = pb_grpc.PodResourcesListerStub(channel)

        def allocatable() -> set[str]:
            return {d.resource_name for d in stub.GetAllocatableResources(pb.AllocatableResourcesRequest(), timeout=TIMEOUT).devices}

        assert list(stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT).pod_resources) == []
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(pb.GetPodResourcesRequest(pod_name="trainer-0", pod_namespace="ml"), timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert allocatable() == set()
        kubelet.sync_pods()
        assert [p.name for p in stub.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT).pod_resources] == ["trainer-0", "server-7c9"]
        assert allocatable() == set()
        kubelet.register_plugin("nvidia.com/gpu")
        assert allocatable() == {"nvidia.com/gpu"}
        kubelet.register_plugin("nvidia.com/mig-1g.10gb")
        assert allocatable() == {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb"}
    finally:
        channel.close()


def test_stop_is_idempotent_and_removes_socket(socket_dir):
    path = f"{socket_dir}/k.sock"
    k = FakeKubelet(path).start()
    assert os.path.exists(path)
    k.stop()
    k.stop()
    assert not os.path.exists(path)


def test_rejects_overlong_socket_path():
    with pytest.raises(ValueError):
        FakeKubelet("/tmp/" + "x" * 200 + ".sock")
