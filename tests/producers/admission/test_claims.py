"""producers/admission/claims.py: which DRA claims of an object under admission are GPUs.

The shapes are the API server's (resource.k8s.io v1 ``exactly`` / ``firstAvailable``, v1beta1
on the request itself; NVIDIA's DeviceClass selectors); the reads against a real API server
are in tests/real_cluster/test_admit.py."""

from __future__ import annotations

import pytest

from producers._config import GPU_DRA_DRIVERS, GPU_RESOURCES, ResourceMatcher
from producers.admission.claims import ClaimReader, class_is_gpu, claim_refs, device_requests
from streams.controls.admission import subject_of

DRIVERS = ResourceMatcher(GPU_DRA_DRIVERS)


def test_a_pod_specs_claims_name_a_claim_or_a_template():
    spec = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}, {"name": "shared", "resourceClaimName": "pool-claim"},
                               {"name": "neither"}]}
    assert claim_refs(spec) == [("gpu", "resourceclaimtemplates", "one-gpu"), ("shared", "resourceclaims", "pool-claim")]
    assert claim_refs({}) == [] and claim_refs(None) == []


def test_device_requests_in_every_served_shape():
    v1 = {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}},
                                   {"name": "all", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All"}},
                                   {"name": "any", "firstAvailable": [{"name": "big", "deviceClassName": "gpu.nvidia.com", "count": 1},
                                                                      {"name": "small", "deviceClassName": "mig.nvidia.com", "count": 3}]}]}}
    assert device_requests(v1) == [(("gpu.nvidia.com",), 2), (("gpu.nvidia.com",), 1), (("gpu.nvidia.com", "mig.nvidia.com"), 3)]
    v1beta1 = {"devices": {"requests": [{"name": "g", "deviceClassName": "gpu.nvidia.com"}]}}
    assert device_requests(v1beta1) == [(("gpu.nvidia.com",), 1)]
    with pytest.raises(ValueError, match="device request 'x' names no deviceClassName"):
        device_requests({"devices": {"requests": [{"name": "x", "exactly": {}}]}})


def test_a_device_class_is_a_gpu_one_when_its_selectors_name_a_gpu_driver():
    nvidia = {"spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]}}
    by_attribute = {"spec": {"selectors": [{"cel": {"expression": 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")'}}]}}
    nic = {"spec": {"selectors": [{"cel": {"expression": "device.driver == 'sriovnetwork.k8snetworkplumbingwg.io'"}}]}}
    assert class_is_gpu(nvidia, DRIVERS) and class_is_gpu(by_attribute, DRIVERS)
    assert not class_is_gpu(nic, DRIVERS) and not class_is_gpu({"spec": {}}, DRIVERS)


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
