"""producers/admission/claims.py: which DRA claims of an object under admission are GPUs.

The shapes are the API server's (resource.k8s.io v1 ``exactly`` / ``firstAvailable``, v1beta1
on the request itself; NVIDIA's DeviceClass selectors); the reads against a real API server
are in tests/real_cluster/test_admit.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from producers._config import GPU_DRA_DRIVERS, GPU_RESOURCES, ResourceMatcher
from producers.admission.claims import Alternative, ClaimGpus, ClaimReader, claim_refs, class_is_gpu, device_requests, selects_gpus
from streams.controls.admission import subject_of

DRIVERS = ResourceMatcher(GPU_DRA_DRIVERS)


def test_a_pod_specs_claims_name_a_claim_or_a_template():
    spec = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}, {"name": "shared", "resourceClaimName": "pool-claim"},
                               {"name": "old", "source": {"resourceClaimTemplateName": "one-gpu"}}]}
    assert claim_refs(spec) == [("gpu", "resourceclaimtemplates", "one-gpu"), ("shared", "resourceclaims", "pool-claim"), ("old", "", "")]
    assert claim_refs({}) == [] and claim_refs(None) == []


def test_device_requests_in_every_served_shape():
    v1 = {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}},
                                   {"name": "all", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All", "adminAccess": True}},
                                   {"name": "any", "firstAvailable": [
                                       {"name": "big", "deviceClassName": "gpu.nvidia.com", "count": 1,
                                        "selectors": [{"cel": {"expression": "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"}}]},
                                       {"name": "small", "deviceClassName": "mig.nvidia.com", "count": 3}]}]}}
    assert device_requests(v1) == [[Alternative("gpu.nvidia.com", 2)], [Alternative("gpu.nvidia.com", 1, admin=True)],
                                   [Alternative("gpu.nvidia.com", 1, ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0",)),
                                    Alternative("mig.nvidia.com", 3)]]
    v1beta1 = {"devices": {"requests": [{"name": "g", "deviceClassName": "gpu.nvidia.com"}]}}
    assert device_requests(v1beta1) == [[Alternative("gpu.nvidia.com", 1)]]
    with pytest.raises(ValueError, match="device request 'x' names no deviceClassName"):
        device_requests({"devices": {"requests": [{"name": "x", "exactly": {}}]}})


def test_devices_are_gpus_unless_their_selectors_say_otherwise():
    """Named GPU driver: GPU; pinned to another driver (a NIC's class): not; anything else — no
    selectors (every device), attributes only, a driver prefix — may select GPUs: counted."""
    nvidia = ["device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"]
    assert selects_gpus(nvidia, DRIVERS) and selects_gpus(['device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA")'], DRIVERS)
    assert not selects_gpus(["device.driver == 'sriovnetwork.k8snetworkplumbingwg.io'"], DRIVERS)
    assert selects_gpus([], DRIVERS) and selects_gpus(["device.driver.startsWith('gpu.')"], DRIVERS)
    assert selects_gpus(["device.attributes['dra.net'].rdma == true"], DRIVERS)
    # a broad class narrowed to GPUs by the request's own selectors, and a NIC class asked for a GPU: GPU
    assert selects_gpus(["device.driver == 'sriov.example.com'", "device.driver == 'gpu.nvidia.com'"], DRIVERS)
    assert class_is_gpu({"spec": {"selectors": [{"cel": {"expression": nvidia[0]}}]}}, DRIVERS)
    assert not class_is_gpu({"spec": {"selectors": [{"cel": {"expression": "device.driver == 'sriov.example.com'"}}]}}, DRIVERS)
    assert class_is_gpu({"spec": {}}, DRIVERS)


class FakeApi:
    """The two reads ClaimReader makes, answered from dicts (``slow``: seconds each call takes)."""

    def __init__(self, objects: dict, classes: dict, slow: float = 0.0) -> None:
        self.objects, self.classes, self.slow, self.calls = objects, classes, slow, []

    def get_namespaced_custom_object(self, group, version, namespace, resource, name, _request_timeout=None):
        self.calls.append((resource, name, _request_timeout))
        time.sleep(min(self.slow, _request_timeout))  # the call's own timeout bounds it, as urllib3's read timeout would
        if self.slow > _request_timeout:
            raise TimeoutError("read timed out")
        if (resource, name) not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        return self.objects[(resource, name)]

    def get_cluster_custom_object(self, group, version, resource, name, _request_timeout=None):
        self.calls.append((resource, name, _request_timeout))
        if name not in self.classes:
            raise ApiException(status=404, reason="Not Found")
        return self.classes[name]


class FakeApis:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, 0

    def get_api_versions(self, _request_timeout=None):
        self.calls += 1
        if self.fail:
            raise ApiException(status=503, reason="Service Unavailable")
        group = SimpleNamespace(name="resource.k8s.io", versions=[SimpleNamespace(version="v1")])
        return SimpleNamespace(groups=[group])


def reader_of(objects: dict, slow: float = 0.0, discovery_fails: bool = False, budget_s: float = 3.0) -> ClaimReader:
    reader = ClaimReader(None, DRIVERS, budget_s=budget_s)
    reader._custom = FakeApi(objects, {"gpu": {"spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}},
                                       "nic": {"spec": {"selectors": [{"cel": {"expression": "device.driver == 'sriov.example.com'"}}]}},
                                       "any": {"spec": {}}}, slow)
    reader._apis = FakeApis(discovery_fails)
    return reader


def claim(*requests) -> dict:
    return {"spec": {"devices": {"requests": list(requests)}}}


def pod_naming(*claims: str) -> dict:
    return {"containers": [{"name": "c"}], "resourceClaims": [{"name": f"c{i}", "resourceClaimName": n} for i, n in enumerate(claims)]}


def test_a_reader_counts_gpu_requests_from_the_claims_and_classes_it_reads():
    reader = reader_of({
        ("resourceclaims", "eight"): claim({"name": "g", "exactly": {"deviceClassName": "any", "count": 8,
                                                                      "selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}}),
        ("resourceclaims", "nic"): claim({"name": "n", "exactly": {"deviceClassName": "nic", "count": 4}}),
        ("resourceclaims", "broad"): claim({"name": "b", "exactly": {"deviceClassName": "any"}}),
        ("resourceclaims", "either"): claim({"name": "e", "firstAvailable": [{"name": "g", "deviceClassName": "gpu", "count": 1},
                                                                             {"name": "n", "deviceClassName": "nic", "count": 16}]}),
        ("resourceclaims", "monitor"): claim({"name": "m", "exactly": {"deviceClassName": "gpu", "allocationMode": "All", "adminAccess": True}}),
        ("resourceclaimtemplates", "two"): {"spec": {"spec": {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu", "count": 2}}]}}}},
    })
    assert reader("ml", pod_naming("eight")) == ClaimGpus(8)  # a broad class narrowed to GPUs by the claim itself
    assert reader("ml", pod_naming("nic")) == ClaimGpus(0)
    assert reader("ml", pod_naming("broad")) == ClaimGpus(1)  # a class with no selectors may give a GPU
    assert reader("ml", pod_naming("either")) == ClaimGpus(1)  # the GPU alternative's count, not the NIC's 16
    assert reader("ml", pod_naming("monitor")) == ClaimGpus(0)  # admin access: monitoring, not allocation
    assert reader("ml", {"resourceClaims": [{"name": "t", "resourceClaimTemplateName": "two"}]}) == ClaimGpus(2)
    assert [c[:2] for c in reader._custom.calls].count(("deviceclasses", "gpu")) == 1  # classes are cached
    missing = reader("ml", pod_naming("missing"))
    assert missing.gpus == 1 and missing.unresolved == (
        "DRA claim 'c0' (resourceclaim ml/missing) could not be read, so it counts as a GPU: the API server answered 404 Not Found",)


def test_an_objects_lookups_share_one_budget_and_a_failed_discovery_is_not_asked_again_at_once():
    """The API server gives the webhook 5 s: an unanswered call is cut at what is left of the
    object's budget, the claims after it are not asked (each counted as a GPU), and a discovery
    that failed is not asked for every claim."""
    slow = reader_of({("resourceclaims", f"c{i}"): claim({"name": "g", "exactly": {"deviceClassName": "gpu"}}) for i in range(3)},
                     slow=10.0, budget_s=0.6)
    started = time.monotonic()
    found = slow("ml", pod_naming("c0", "c1", "c2"))
    assert time.monotonic() - started < 1.0 and found.gpus == 3 and len(found.unresolved) == 3
    assert "TimeoutError: read timed out" in found.unresolved[0] and "out of time" in found.unresolved[-1]
    down = reader_of({}, discovery_fails=True)
    found = down("ml", pod_naming("a", "b", "c"))
    assert found.gpus == 3 and down._apis.calls == 1 and "could not be read 0 s ago" in found.unresolved[1]
    assert "naming neither" in reader_of({})("ml", {"resourceClaims": [{"name": "old", "source": {}}]}).unresolved[0]


def test_without_api_access_each_claim_counts_as_a_gpu_and_the_subject_says_why():
    reader = ClaimReader(None, DRIVERS)
    pod = {"kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
           "spec": {"containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}
    subject = subject_of(pod, ResourceMatcher(GPU_RESOURCES), claims=reader)
    assert subject.gpus == 1 and reader.unresolved == 1
    assert subject.claim_notes == ("DRA claim 'gpu' (resourceclaimtemplate ml/one-gpu) could not be read, so it counts as a GPU: gpuledger admit "
                                   "has no API access (GPULEDGER_ADMIT_CLAIMS_IN_CLUSTER, GPULEDGER_ADMIT_IN_CLUSTER or GPULEDGER_ADMIT_KUBECONFIG)",)
    # a Job's pods each hold theirs; without a reader a claim is not counted (the scheduler collector's own mapping)
    job = {"kind": "Job", "metadata": {"name": "j", "namespace": "ml"},
           "spec": {"parallelism": 3, "template": {"spec": {"containers": [{"name": "c"}], "resourceClaims": pod["spec"]["resourceClaims"]}}}}
    assert subject_of(job, ResourceMatcher(GPU_RESOURCES), claims=reader).gpus == 3
    assert subject_of(job, ResourceMatcher(GPU_RESOURCES)).gpus == 0
