"""The pure ResourceClaim mapping (``producers.kubernetes.claims``) on a claim as the real API server served it.

``tests/data/kubernetes/resourceclaim_v1_allocated.json`` is a v1 ResourceClaim generated from a
ResourceClaimTemplate, allocated and reserved by the real kube-scheduler 1.34.4 for a KWOK pod
(``gpuledger dev cluster``), saved verbatim.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from producers._config import GPU_DRA_DRIVERS, ResourceMatcher
from producers.kubernetes.claims import claim_events, claim_view
from producers.kubernetes.mapping import MalformedObject
from schemas import Source, decode_event, encode_event

CLAIM = json.loads((Path(__file__).parents[2] / "data" / "kubernetes" / "resourceclaim_v1_allocated.json").read_text())
GPUS = ResourceMatcher(GPU_DRA_DRIVERS)
SRC = Source(collector="kubernetes", host="t")
T1 = datetime(2026, 12, 1, 20, 0, tzinfo=timezone.utc)
T2 = datetime(2026, 12, 1, 20, 5, tzinfo=timezone.utc)


def claim(**status) -> dict:
    obj = copy.deepcopy(CLAIM)
    obj["status"] = {**obj["status"], **status}
    return obj


def test_a_reserved_claim_says_which_pod_holds_which_device():
    [h] = claim_view(CLAIM, GPUS).holdings
    pod = CLAIM["status"]["reservedFor"][0]
    assert (h.pod, h.pod_uid, h.node, h.device_id, h.request) == (pod["name"], pod["uid"], "gpu-node-1", "gpu.nvidia.com/gpu-node-1/gpu-0", "gpu")
    events, held = claim_events(claim_view(CLAIM, GPUS), {}, SRC, T1)
    [e] = events
    assert e.event_type == "gpu.claim_reserved" and e.occurred_at == T1
    assert (e.identity.namespace, e.identity.pod, e.identity.pod_uid, e.identity.node, e.identity.gpu_id) == \
           ("ml", pod["name"], pod["uid"], "gpu-node-1", h.device_id)
    assert (e.payload.claim, e.payload.claim_uid, e.payload.driver, e.payload.pool, e.payload.reason) == \
           (CLAIM["metadata"]["name"], CLAIM["metadata"]["uid"], "gpu.nvidia.com", "gpu-node-1", None)
    assert e.correlation_key() == f"ml/{pod['name']}"  # the partition of the pod's kubelet-reported assignments
    assert decode_event(encode_event(e)) == e
    # The same claim again (a re-list, a restart with the state): nothing new; the same reservation has the same id.
    assert claim_events(claim_view(CLAIM, GPUS), held, SRC, T2) == ([], held)
    assert claim_events(claim_view(CLAIM, GPUS), {}, SRC, T2)[0][0].event_id == e.event_id


@pytest.mark.parametrize(("change", "deleted", "reason"), [
    ({"reservedFor": []}, False, "unreserved"),
    ({"reservedFor": [], "allocation": None}, False, "deallocated"),
    ({}, True, "claim_deleted"),
])
def test_the_end_of_a_holding_is_released_once_with_why(change, deleted, reason):
    [reserved], held = claim_events(claim_view(CLAIM, GPUS), {}, SRC, T1)
    [released], after = claim_events(claim_view(claim(**change), GPUS), held, SRC, T2, deleted=deleted)
    assert (released.event_type, released.payload.reason, released.occurred_at, after) == ("gpu.claim_released", reason, T2, {})
    assert (released.identity.pod_uid, released.payload.device_id) == (reserved.identity.pod_uid, reserved.payload.device_id)
    # However the end was noticed, the release of that reservation is one event.
    again, _ = claim_events(claim_view(claim(reservedFor=[]), GPUS), held, SRC, T2, deleted=True)
    assert [e.event_id for e in again] == [released.event_id]


def test_other_drivers_other_consumers_admin_access_and_network_devices_hold_no_gpu():
    results = CLAIM["status"]["allocation"]["devices"]["results"]
    nic = claim(allocation={**CLAIM["status"]["allocation"], "devices": {"results": [{**results[0], "driver": "nic.example.com"}]}})
    admin = claim(allocation={**CLAIM["status"]["allocation"], "devices": {"results": [{**results[0], "adminAccess": True}]}})
    network = claim(allocation={"devices": CLAIM["status"]["allocation"]["devices"]})
    job = claim(reservedFor=[{"apiGroup": "batch", "resource": "jobs", "name": "j", "uid": "u"}])
    for obj in (nic, admin, network, job):
        assert claim_view(obj, GPUS).holdings == ()


@pytest.mark.parametrize(("break_it", "message"), [
    (lambda c: c["status"]["allocation"]["devices"]["results"][0].pop("pool"), r"results\[0\]\.pool: missing"),
    (lambda c: c["status"]["allocation"].pop("devices"), r"allocation\.devices\.results: missing"),
    (lambda c: c["status"]["reservedFor"][0].pop("uid"), r"reservedFor\[0\]\.uid: missing"),
    (lambda c: c["status"].update(reservedFor={"name": "x"}), r"reservedFor: not a list"),
    (lambda c: c["metadata"].pop("uid"), r"ResourceClaim ml/.*: missing metadata\.uid"),
])
def test_a_malformed_claim_is_refused_naming_the_field(break_it, message):
    obj = copy.deepcopy(CLAIM)
    break_it(obj)
    with pytest.raises(MalformedObject, match=message):
        claim_view(obj, GPUS)
