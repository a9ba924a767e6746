"""producers/admission/service.py: the HTTPS webhook against a real broker (release topic in, decisions out)."""

from __future__ import annotations

import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid

import orjson
import pytest

from producers._kafka import EventPublisher
from producers.admission.config import AdmitSettings
from producers.admission.service import AdmitService
from producers.releases import COMMANDS, build_event
from schemas import decode_event
from streams.controls.policy import Policy
from tests.fixtures.kafka import read_topic
from tests.fixtures.waiting import poll

COMMAND = {c.name: c for c in COMMANDS}
RID = "fraud-scorer-v8-prod"


@pytest.fixture
def admit(catalogue, kafka_bootstrap, tmp_path):
    """A running AdmitService on a free port with a generated certificate; yields (base url, ssl context, publisher)."""
    ca = tmp_path / "ca.crt"
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "admit-test")
    bound = {}
    service = AdmitService(AdmitSettings(port=0, ca_out=ca), Policy(), publisher, kafka_bootstrap, catalogue.release,
                           on_listening=lambda h, p, pem: bound.update(host=h, port=p, pem=pem))
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    poll(lambda: bound, "admit to listen", 30)
    context = ssl.create_default_context(cafile=str(ca))
    releases = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "releases-test")
    yield f"https://127.0.0.1:{bound['port']}", context, releases, service
    service.stop()
    thread.join(20)
    releases.close(5)
    assert not thread.is_alive()


def call(url: str, context, path: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def review(obj: dict, uid: str | None = None) -> bytes:
    kind = {"Job": {"group": "batch", "version": "v1", "kind": "Job"}, "Pod": {"group": "", "version": "v1", "kind": "Pod"}}[obj["kind"]]
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid or str(uuid.uuid4()), "kind": kind, "operation": "CREATE", "namespace": obj["metadata"]["namespace"],
        "userInfo": {"username": "model-team-ci"}, "object": obj}})


def job(name: str = "score") -> dict:
    labels = {"gpuledger.io/release-id": RID, "gpuledger.io/environment": "prod"}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": "serving", "uid": str(uuid.uuid4()), "labels": labels},
            "spec": {"template": {"metadata": {"labels": labels}, "spec": {"containers": [
                {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}


def publish(releases, command: str, **options) -> None:
    releases.publish_batch([build_event(COMMAND[command], {"release_id": RID, **options})])


def test_webhook_denies_until_the_approval_arrives_within_a_second_and_records_every_decision(admit, catalogue, kafka_bootstrap):
    url, context, releases, service = admit
    publish(releases, "register", model="fraud-scorer", version="8", artifact_digest="sha256:" + "a" * 64)
    publish(releases, "evaluate")
    # Both events folded (the registration alone already puts the release in the state).
    poll(lambda: call(url, context, "/readyz")[0] == 200 and RID in service.state.releases and service.state.applied >= 2,
         "the release state loaded", 30)
    status, answer = call(url, context, "/validate", review(job(), uid="req-1"))
    assert status == 200 and answer["response"]["uid"] == "req-1" and answer["response"]["allowed"] is False
    assert answer["response"]["status"]["message"].startswith(f"release {RID} is evaluated, not approved for prod")
    publish(releases, "approve", actor="alice", env="prod")
    acked = time.monotonic()
    poll(lambda: call(url, context, "/validate", review(job("score-2")))[1]["response"]["allowed"], "the approval to count", 1.0, 0.05)
    assert time.monotonic() - acked <= 1.0
    decided = [decode_event(m.value()) for m in read_topic(kafka_bootstrap, catalogue.scheduler, 2, timeout=20)]
    first = next(e for e in decided if e.payload.object_name == "score")
    assert (first.event_type, first.payload.decision, first.payload.rule, first.payload.gate) == ("admission.decided", "deny", "unapproved", "webhook")
    assert first.identity.release_id == RID and first.identity.workload_id == "serving/Job/score" and first.payload.user == "model-team-ci"
    assert first.payload.policy_version == Policy().fingerprint and first.payload.release_state == "release.evaluated"
    assert any(e.payload.decision == "allow" and e.payload.rule == "approved" for e in decided)
    health = call(url, context, "/healthz")[1]
    assert health["webhook"]["denied"] >= 1 and health["recorder"]["dropped"] == 0


@pytest.mark.parametrize("body, error", [
    (b"{not json", "body is not JSON"),
    (b'{"apiVersion": "v1", "kind": "Pod"}', "expected an admission.k8s.io/v1 AdmissionReview"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}', "request.uid is missing"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "x", "kind": {"group": "batch", "kind": "Job"}}}',
     "request.object is missing"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "x", "kind": {"group": "batch", "kind": "Job"},'
     b' "object": {"metadata": {"name": "j"}, "spec": {"template": {"spec": {"containers": "no"}}}}}}', "request.object cannot be read"),
    (b'[]', "expected an admission.k8s.io/v1 AdmissionReview"),
])
def test_bad_bodies_get_400_with_the_reason_and_the_server_keeps_serving(admit, body, error):
    url, context, _releases, _service = admit
    status, answer = call(url, context, "/validate", body)
    assert status == 400 and answer["error"].startswith(error)
    assert call(url, context, "/healthz")[0] == 200
