"""producers/admission/service.py: the HTTPS webhook against a real broker (release topic in, decisions out)."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def running(settings: AdmitSettings, publisher, bootstrap: str, release_topic: str):
    """An AdmitService run on its own thread until the block ends; yields (its base url, the service)
    once it listens. It must stop when asked (the thread is joined, and checked)."""
    bound = {}
    service = AdmitService(settings, Policy(), publisher, bootstrap, release_topic,
                           on_listening=lambda h, p, pem: bound.update(host=h, port=p, pem=pem))
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        poll(lambda: bound or not thread.is_alive(), "admit to listen", 30)
        assert thread.is_alive()
        yield f"https://127.0.0.1:{bound['port']}", service
    finally:
        service.stop()
        thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def admit(catalogue, kafka_bootstrap, tmp_path):
    """A running AdmitService on a free port with a generated certificate; yields (base url, ssl context, publisher)."""
    ca = tmp_path / "ca.crt"
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "admit-test")
    with running(AdmitSettings(port=0, ca_out=ca), publisher, kafka_bootstrap, catalogue.release) as (url, service):
        releases = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "releases-test")
        yield url, ssl.create_default_context(cafile=str(ca)), releases, service
        releases.close(5)


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


#: A review of ``request.kind`` (%s) whose request ends with (%s).
REVIEW = b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "x", "kind": %s, "operation": "CREATE", %s}}'
GPU_WORKLOAD = {"metadata": {"name": "w", "namespace": "ml", "labels": {"gpuledger.io/environment": "prod"}},
                "spec": {"podSets": [{"name": "main", "count": 1, "template": {"spec": {"containers": [
                    {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}]}}


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
    assert first.payload.caller is None  # no client CA: the caller is not authenticated, `user` is its claim
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
     b' "operation": "CREATE", "object": {"metadata": {"name": "j"}, "spec": {"template": {"spec": {"containers": "no"}}}}}}',
     "request.object cannot be read: request.object.spec.template.spec.containers must be a list, not a string"),
    (b'[]', "expected an admission.k8s.io/v1 AdmissionReview"),
    # Found by an exploratory review: a 500 with a traceback (request.kind a string, userInfo not an object); a
    # Workload whose podSets is not a list allowed as `not-gpu`; one whose kind has no group allowed unrecorded.
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "x", "kind": "Pod"}}',
     "request.kind must be an object (group, version, kind), not a string"),
    (REVIEW % (b'{"group": "", "kind": "Pod"}', b'"userInfo": "ci", "object": {"metadata": {"name": "p"}}'),
     "request.userInfo must be an object, not a string"),
    (REVIEW % (b'{"group": "kueue.x-k8s.io", "kind": "Workload"}', b'"object": {"metadata": {"name": "w"}, "spec": {"podSets": "x"}}'),
     "request.object cannot be read: request.object.spec.podSets must be a list, not a string"),
    (REVIEW % (b'{"version": "v1beta2", "kind": "Workload"}', b'"object": ' + orjson.dumps(GPU_WORKLOAD)),
     'request.kind.group must be a string (the core group is ""), not null'),
    (REVIEW % (b'{"group": "kueue.x-k8s.io", "kind": "Workload"}',
               b'"object": {"metadata": {"name": "w"}, "spec": {"podSets": [{"count": 2, "template": {"spec": {"containers": [null]}}}]}}'),
     "request.object cannot be read: request.object.spec.podSets[0].template.spec.containers[0] must not be null"),
    (REVIEW % (b'{"group": "", "kind": "Pod"}', b'"object": {"metadata": {"name": "p", "labels": ["gpuledger.io/release-id"]}}'),
     "request.object cannot be read: request.object.metadata.labels must be an object, not a list"),
    (REVIEW.replace(b'"operation": "CREATE", ', b"") % (b'{"group": "", "kind": "Pod"}', b'"object": {"metadata": {"name": "p"}}'),
     "request.operation must be CREATE, UPDATE, DELETE or CONNECT, not 'None'"),
])
def test_bad_bodies_get_400_with_the_reason_and_the_server_keeps_serving(admit, body, error):
    url, context, _releases, _service = admit
    status, answer = call(url, context, "/validate", body)
    assert status == 400 and answer["error"].startswith(error), answer
    status, health = call(url, context, "/healthz")
    assert status == 200 and health["recorder"]["recorded"] == 0 and health["webhook"]["bad_requests"] == 1, health  # no decision


@pytest.mark.timeout(120)
def test_health_says_how_many_decisions_wait_for_kafka_the_queue_limit_and_how_many_were_dropped(catalogue, kafka_bootstrap, tmp_path):
    """Found by a review: while decisions could not be published, `/healthz` said "(N more waiting;
    over 100000 are dropped)", which read as if 100000 decisions had been dropped. It now says how
    many wait, the limit beyond which new ones are dropped, and how many were dropped so far (the
    count `recorder.dropped` shows). The release state is read from the broker; the decisions go
    to a Kafka address where no broker listens."""
    from gpuledger.dev.process import free_port

    ca = tmp_path / "ca.crt"
    nowhere = EventPublisher({"bootstrap.servers": f"127.0.0.1:{free_port()}"}, catalogue, "admit-test", limit_lookup_timeout_s=1.0)
    settings = AdmitSettings(port=0, ca_out=ca, stale_after_s=10, publish_batch=1, publish_queue=2)
    with running(settings, nowhere, kafka_bootstrap, catalogue.release) as (url, _service):
        context = ssl.create_default_context(cafile=str(ca))
        poll(lambda: call(url, context, "/readyz")[0] == 200, "the release state loaded", 60)
        for n in range(6):  # one batch of 1 being retried and a queue of 2 hold 3 at most: 3 or more are dropped
            assert call(url, context, "/validate", review(job(f"score-{n}")))[0] == 200
        health = poll(lambda: (lambda h: h if h["status"] == "degraded" else None)(call(url, context, "/healthz")[1]),
                      "health to say the decisions are not published", 40)
        recorder = health["recorder"]
        assert recorder["published"] == 0 and recorder["dropped"] >= 3, recorder
        problem = health["problems"][0]
        assert problem.startswith("admission decisions not published for "), health
        assert (f" s: {6 - recorder['dropped']} waiting for Kafka (beyond 2 queued behind the batch being retried, new ones are dropped; "
                f"{recorder['dropped']} dropped since admit started): ") in problem, problem


@pytest.mark.timeout(180)
def test_the_path_of_a_fail_closed_environments_webhook_is_the_namespaces_environment(tmp_path):
    """The AdmissionReview carries no namespace labels: a namespace labelled prod, which the API
    server sends to the fail-closed webhook, but not mapped in the policy, was decided in an
    unknown environment — fail-open while the release state was not loaded. The fail-closed
    webhooks call /validate/<environment> (producers.admission.manifests), and that is a floor."""
    from gpuledger.dev.process import free_port
    from schemas.topics import TopicCatalogue

    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens: the release state never loads
    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=2)
    ca = tmp_path / "ca.crt"
    unlabelled = job("score")
    for labels in (unlabelled["metadata"]["labels"], unlabelled["spec"]["template"]["metadata"]["labels"]):
        labels.pop("gpuledger.io/environment", None)  # (one dict: the job and its template share it)
    with running(AdmitSettings(port=0, ca_out=ca), EventPublisher({"bootstrap.servers": bootstrap}, cat, "admit-test"), bootstrap,
                 cat.release) as (url, _service):
        context = ssl.create_default_context(cafile=str(ca))
        status, anywhere = call(url, context, "/validate", review(unlabelled))
        assert status == 200 and anywhere["response"]["allowed"] is True
        assert "an unknown environment is fail-open" in anywhere["response"]["warnings"][0]
        status, prod = call(url, context, "/validate/prod", review(unlabelled))
        assert status == 200 and prod["response"]["allowed"] is False
        assert prod["response"]["status"]["message"].startswith("gpuledger admit has not loaded the release state yet; prod is fail-closed")
        # Only a fail-closed environment of the policy has a path: another would make a decision laxer
        # than an unknown environment (dev: no approval needed) — the configuration and the policy disagree.
        for other in ("dev", "production"):
            status, refused = call(url, context, f"/validate/{other}", review(unlabelled))
            assert status == 400 and f"serves the policy's fail-closed environments (prod); '{other}' is not one" in refused["error"], refused
        # A workload's own label can make it stricter, never laxer than its namespace's.
        dev = job("score-dev")
        for labels in (dev["metadata"]["labels"], dev["spec"]["template"]["metadata"]["labels"]):
            labels["gpuledger.io/environment"] = "dev"
        assert call(url, context, "/validate/prod", review(dev))[1]["response"]["allowed"] is False


def test_started_while_kafka_is_down_it_answers_state_not_loaded_and_loads_when_kafka_comes_back(tmp_path, caplog):
    """Found by an exploratory review: with Kafka down at start `gpuledger admit` exited (1, "the
    release topic ... cannot be read: KafkaConnectionError"). It serves the state-not-loaded answers
    instead, keeps connecting — one warning, not a line per attempt — and loads once a broker
    answers on the bootstrap address (a broker of the test's own, started late on that port)."""
    import logging
    import tempfile
    from pathlib import Path

    from gpuledger.dev.localkafka import LocalKafka
    from gpuledger.dev.process import free_port
    from gpuledger.settings import default_cache_dir
    from producers._kafka import ensure_topics
    from schemas.topics import TopicCatalogue

    caplog.set_level(logging.INFO, logger="streams.correlate.directory")
    caplog.set_level(logging.DEBUG, logger="aiokafka")  # (last: the capturing handler's level is the last one set)
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=2)
    ca = tmp_path / "ca.crt"
    broker = None
    try:
        with running(AdmitSettings(port=0, ca_out=ca), EventPublisher({"bootstrap.servers": bootstrap}, cat, "admit-test"), bootstrap,
                     cat.release) as (url, service):
            context = ssl.create_default_context(cafile=str(ca))
            prod = call(url, context, "/validate", review(job("score-prod")))[1]["response"]
            assert prod["allowed"] is False and prod["status"]["message"].startswith("gpuledger admit has not loaded the release state yet; prod is fail-closed")
            staging_job = job("score-staging")
            for labels in (staging_job["metadata"]["labels"], staging_job["spec"]["template"]["metadata"]["labels"]):
                labels["gpuledger.io/environment"] = "staging"
            staging = call(url, context, "/validate", review(staging_job))[1]["response"]
            assert staging["allowed"] is True and "staging is fail-open" in staging["warnings"][0]
            assert call(url, context, "/readyz")[0] == 503
            refused = lambda: [r for r in caplog.records if r.name == "aiokafka" and "Unable connect" in r.getMessage()]  # noqa: E731
            poll(lambda: len(refused()) >= 3, "three refused connection attempts", 30)
            assert all(r.levelno == logging.DEBUG for r in refused())  # aiokafka's line per attempt, demoted
            warned = [r for r in caplog.records if r.name == "streams.correlate.directory" and r.levelno >= logging.WARNING]
            assert len(warned) == 1 and "failing" in warned[0].getMessage() and "KafkaConnectionError" in warned[0].getMessage()

            broker = LocalKafka(Path(tempfile.mkdtemp(prefix="gpuledger-admit-kafka-")), default_cache_dir(), port=port, log_level="WARN",
                                with_parent=True).start()
            ensure_topics({"bootstrap.servers": bootstrap}, cat)
            releases = EventPublisher({"bootstrap.servers": bootstrap}, cat, "releases-test")
            try:
                for command, options in (("register", {"model": "fraud-scorer", "version": "8", "artifact_digest": "sha256:" + "a" * 64}),
                                         ("approve", {"actor": "alice", "env": "prod"})):
                    publish(releases, command, **options)
            finally:
                releases.close(5)
            poll(lambda: call(url, context, "/readyz")[0] == 200 and service.state.applied >= 2, "the release state loaded", 60)
            assert call(url, context, "/validate", review(job("score-later")))[1]["response"]["allowed"] is True
            connected = [r.getMessage() for r in caplog.records if r.name == "streams.correlate.directory" and "connected after" in r.getMessage()]
            assert len(connected) == 1, connected
            # The answers given while Kafka was down are evidence too: published once it is back.
            decided = {e.payload.object_name: e.payload.rule for e in map(decode_event, (m.value() for m in read_topic(bootstrap, cat.scheduler, 3)))}
            assert decided == {"score-prod": "state-not-loaded", "score-staging": "state-not-loaded", "score-later": "approved"}, decided
    finally:
        if broker is not None:  # (after the service stopped: the block above)
            broker.stop()


def test_kafka_gone_after_the_state_loaded_health_degrades_and_every_decision_says_since_when_the_state_is_unconfirmed(tmp_path, monkeypatch):
    """Found by a review: once the release state had loaded, a broker gone for good left
    `gpuledger admit` deciding on that state for ever with `/healthz` "ok" — a revocation published
    meanwhile (to a broker the webhook no longer reaches) was never seen, and nothing said so.
    Now the follower confirms every few seconds that it has read the topic up to its end offsets;
    once the last confirmation is older than `stale_after_s`, `/healthz` says `degraded` (still
    200: a liveness restart would lose the state), each answer carries a warning naming the
    instant, and the recorded decision's message says it. When the broker is back, `ok` again."""
    import tempfile
    from pathlib import Path

    import streams.correlate.directory as directory_module
    from gpuledger.dev.localkafka import LocalKafka
    from gpuledger.dev.process import free_port
    from gpuledger.settings import default_cache_dir
    from producers._kafka import ensure_topics
    from schemas.topics import TopicCatalogue

    monkeypatch.setattr(directory_module, "CONFIRM_EVERY_S", 0.5)
    monkeypatch.setattr(directory_module, "CONFIRM_TIMEOUT_S", 1.0)
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    data = Path(tempfile.mkdtemp(prefix="gpuledger-admit-kafka-"))
    broker = LocalKafka(data, default_cache_dir(), port=port, log_level="WARN", with_parent=True).start()
    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=2)
    ensure_topics({"bootstrap.servers": bootstrap}, cat)
    releases = EventPublisher({"bootstrap.servers": bootstrap}, cat, "releases-test")
    for command, options in (("register", {"model": "fraud-scorer", "version": "8", "artifact_digest": "sha256:" + "a" * 64}),
                             ("approve", {"actor": "alice", "env": "prod"})):
        publish(releases, command, **options)
    releases.close(5)
    ca = tmp_path / "ca.crt"
    try:
        with running(AdmitSettings(port=0, ca_out=ca, stale_after_s=10), EventPublisher({"bootstrap.servers": bootstrap}, cat, "admit-test"),
                     bootstrap, cat.release) as (url, _service):
            context = ssl.create_default_context(cafile=str(ca))
            poll(lambda: call(url, context, "/readyz")[0] == 200, "the release state loaded", 60)
            poll(lambda: (call(url, context, "/healthz")[1]["release_state"]["confirmed_age_s"] or 99) < 2, "the state confirmed current", 30)
            health = call(url, context, "/healthz")[1]
            assert health["status"] == "ok" and "problems" not in health, health
            fresh = call(url, context, "/validate", review(job("score-fresh")))[1]["response"]
            assert fresh["allowed"] is True and not fresh.get("warnings"), fresh

            broker.stop()
            stopped = time.time()
            status, health = poll(lambda: (lambda r: r if r[1]["status"] == "degraded" else None)(call(url, context, "/healthz")),
                                  "health to say degraded", 40)
            assert status == 200
            assert time.time() - stopped >= 8  # not before the state was stale_after_s old (it was confirmed < 2 s before the stop)
            state = health["release_state"]
            assert state["ready"] is True and state["confirmed_age_s"] > 10, state
            assert health["problems"][0].startswith(f"release state not confirmed current for {state['confirmed_age_s']:.0f} s (since "), health
            assert f"since {state['confirmed_current_at']}" in health["problems"][0] and "stale after 10 s" in health["problems"][0], health
            answer = call(url, context, "/validate", review(job("score-stale")))[1]["response"]
            # The decision is still taken on the state in memory (approved), and says what it may miss.
            assert answer["allowed"] is True, answer
            assert answer["warnings"] == [f"gpuledger admit could not confirm its release state is current since {state['confirmed_current_at']} "
                                          "(the release topic cannot be read): approvals, revocations and overrides published after that are "
                                          "not seen by this decision"], answer

            broker = LocalKafka(data, default_cache_dir(), port=port, log_level="WARN", with_parent=True).start()
            poll(lambda: call(url, context, "/healthz")[1]["status"] == "ok", "health ok again once the broker is back", 90)
            assert not call(url, context, "/validate", review(job("score-back")))[1]["response"].get("warnings")
            decided = {e.payload.object_name: e.payload.message for e in map(decode_event, (m.value() for m in read_topic(bootstrap, cat.scheduler, 3)))}
            assert set(decided) == {"score-fresh", "score-stale", "score-back"}, decided
            assert decided["score-stale"].endswith(answer["warnings"][0]), decided
            assert "could not confirm" not in decided["score-fresh"] + decided["score-back"], decided
    finally:
        broker.stop()  # (after the service stopped: the block above)


def test_with_a_client_ca_only_a_caller_with_its_certificate_is_answered_and_the_decision_records_it(catalogue, kafka_bootstrap, tmp_path):
    """Who did it is proven, not typed: the webhook recorded `user` (the AdmissionReview's
    userInfo.username) from any caller of /validate. With a client CA, a caller without a
    certificate gets 401 and no decision, one whose certificate another CA signed fails the TLS
    handshake, one not in client_names gets 403; the API server's certificate is answered and
    the decision records `caller` — and the probes still need no certificate. Without one,
    `caller` stays empty (the existing tests' decisions)."""
    from producers.admission.certs import client_certificates

    ca_file, cert, key = client_certificates(tmp_path / "client")
    _other_ca, other_cert, other_key = client_certificates(tmp_path / "other")
    # A certificate the trusted bundle verifies (its CA is in it) but whose name client_names does not list:
    _, wrong_name_cert, wrong_name_key = client_certificates(tmp_path / "named", common_name="someone-else", ca_name="another-trusted-ca")
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(ca_file.read_bytes() + (tmp_path / "named" / "client-ca.crt").read_bytes())
    served_ca = tmp_path / "ca.crt"
    settings = AdmitSettings(port=0, ca_out=served_ca, client_ca_file=bundle, client_names=("kube-apiserver-webhook-client",))
    with running(settings, EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "admit-test"), kafka_bootstrap,
                 catalogue.release) as (url, service):

        def context(pair=None):
            ctx = ssl.create_default_context(cafile=str(served_ca))
            if pair:
                ctx.load_cert_chain(str(pair[0]), str(pair[1]))
            return ctx

        poll(lambda: call(url, context(), "/readyz")[0] == 200, "the release state loaded (the probe brings no certificate)", 60)
        assert call(url, context(), "/healthz")[0] == 200
        status, body = call(url, context(), "/validate", review(job("anonymous")))
        assert status == 401 and body["error"].startswith("client certificate required: /validate answers only callers"), body
        # Whatever the path: who calls is checked before what the path says (a 400 told an unproven caller about the policy).
        assert call(url, context(), "/validate/dev", review(job("anonymous")))[0] == 401
        # The handshake fails on the server's side (TLS 1.3: the client learns it as the connection
        # closing before any answer) — and no decision is recorded for it (below).
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            call(url, context((other_cert, other_key)), "/validate", review(job("forged")))
        status, body = call(url, context((wrong_name_cert, wrong_name_key)), "/validate", review(job("wrong-name")))
        assert status == 403 and "'someone-else' is not one of the allowed callers" in body["error"], body
        status, body = call(url, context((cert, key)), "/validate", review(job("from-the-api-server")))
        assert status == 200 and body["response"]["allowed"] is False, body  # (no release state: unknown release, prod)
        assert service.counters["unauthenticated"] == 3  # (the two anonymous calls and the wrong name)
        decided = [decode_event(m.value()).payload for m in read_topic(kafka_bootstrap, catalogue.scheduler, 1)]
        assert [(d.object_name, d.user, d.caller) for d in decided] == [("from-the-api-server", "model-team-ci", "x509:kube-apiserver-webhook-client")]


def test_dropped_decisions_are_logged_once_when_drops_begin_and_counted_when_publishing_takes_decisions_again(catalogue, kafka_bootstrap, caplog):
    """A dropped decision is a gate decision nobody can audit: it was counted on /healthz only,
    though the setting said "counted, logged". One ERROR when drops begin (not one per decision),
    one WARNING with the count once the recorder publishes again — on the real broker."""
    import logging

    from producers.admission.service import DecisionRecorder

    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "admit-test")
    recorder = DecisionRecorder(publisher, batch=10, capacity=2)
    events = [build_event(COMMAND["register"], {"release_id": f"rel-drop-{uuid.uuid4().hex[:8]}-{i}", "model": "fraud-scorer",
                                                 "version": "8", "artifact_digest": "sha256:" + "a" * 64}) for i in range(5)]
    caplog.set_level(logging.WARNING, logger="producers.admission.service")
    try:
        for e in events:  # the recorder's thread is not running yet: its queue holds 2, the other 3 are dropped
            recorder(e)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert recorder.counters["dropped"] == 3 and len(errors) == 1, caplog.text
        assert errors[0].getMessage().startswith("admission decisions are being dropped: the queue of decisions waiting to be "
                                                 "published is full (publish_queue 2, behind a batch of 0 being published), "), errors
        recorder.start()
        poll(lambda: recorder.counters["published"] == 2, timeout=30, what="the 2 queued decisions published")
        resumed = poll(lambda: [r.getMessage() for r in caplog.records if "published again" in r.getMessage()], timeout=10,
                       what="the recovery line")
        assert resumed == ["admission decisions are published again; 3 were dropped while the queue was full (3 since admit started)"]
    finally:
        recorder.stop()
        publisher.close(5)


def test_a_decision_on_an_object_whose_annotation_the_event_refuses_is_recorded_without_that_field_saying_so(admit, catalogue, kafka_bootstrap):
    """Found by a review: a ``gpuledger.io/owner`` annotation with a line break in it (an annotation is
    its creator's to write) made the decision's event impossible to build, which ended the recorder
    thread — no later decision was published while /healthz said "ok". The decision is recorded now,
    with that field left out of its identity and a note in its message naming it."""
    url, context, _releases, service = admit
    poll(lambda: call(url, context, "/readyz")[0] == 200, "the release state loaded", 60)
    bad = job("score-bad")
    bad["metadata"]["annotations"] = {"gpuledger.io/owner": "fraud\nteam"}
    assert call(url, context, "/validate", review(bad))[0] == 200  # the webhook answers it as any other
    assert call(url, context, "/validate", review(job("score-good")))[0] == 200
    decided = {e.payload.object_name: e for e in (decode_event(m.value()) for m in read_topic(kafka_bootstrap, catalogue.scheduler, 2, timeout=20))}
    assert sorted(decided) == ["score-bad", "score-good"], decided
    refused = decided["score-bad"]
    assert refused.identity.owner is None and refused.identity.release_id == RID, refused.identity
    assert refused.payload.message.endswith(". Its gpuledger.io/owner was not used: contains U+000A (control character) at position 5; "
                                            "identifiers must not carry control or bidi characters"), refused.payload.message
    assert decided["score-good"].payload.message == refused.payload.message.split(". Its gpuledger.io/owner")[0].replace("score-bad", "score-good")
    health = call(url, context, "/healthz")[1]
    assert (health["recorder"]["published"], health["recorder"]["unrecordable"]) == (2, 0), health


def test_a_decision_whose_event_cannot_be_built_does_not_stop_the_recording_of_the_others(catalogue, kafka_bootstrap, caplog):
    """The recorder builds each decision's event on its own thread: one that raised ended the thread
    (no later decision published, /healthz "ok", the drops that followed logged as waiting for
    Kafka). One that cannot be built is logged and counted (``unrecordable``); the others are
    published — on the real broker."""
    import logging

    from producers.admission.service import DecisionRecorder

    def unbuildable():
        raise ValueError("an event no schema accepts")

    good = build_event(COMMAND["register"], {"release_id": f"rel-{uuid.uuid4().hex[:8]}", "model": "fraud-scorer", "version": "8",
                                             "artifact_digest": "sha256:" + "a" * 64})
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "admit-test")
    recorder = DecisionRecorder(publisher, batch=10)
    caplog.set_level(logging.ERROR, logger="producers.admission.service")
    try:
        recorder(unbuildable)
        recorder(lambda: good)
        recorder.start()
        poll(lambda: recorder.counters["published"] == 1, "the buildable decision published", 30)
        assert recorder.counters["unrecordable"] == 1 and recorder._thread.is_alive()
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors == ["an admission decision could not be recorded (its event cannot be built): an event no schema accepts"], errors
        assert [decode_event(m.value()).event_id for m in read_topic(kafka_bootstrap, catalogue.release, 1, timeout=20)] == [good.event_id]
    finally:
        recorder.stop()
        publisher.close(5)


@pytest.mark.parametrize("username", ["mallory\u202egnp.exe", 42])
def test_a_decision_whose_user_the_event_refuses_is_dead_lettered_with_what_was_decided(admit, catalogue, kafka_bootstrap, username):
    """Found by a review: a userInfo.username with a bidi override (or not a string) makes the
    decision's event unbuildable — ``decision_event`` leaves out only identity fields the event
    refuses, not the payload's ``user``. The recorder then logged and counted it and the decision
    was lost: published nowhere, in no table. It goes to the dead-letter topic now, with the error
    and what was decided; the decisions after it are published."""
    url, context, releases, service = admit
    poll(lambda: call(url, context, "/readyz")[0] == 200, "the release state loaded", 30)
    bad = orjson.loads(review(job("bad-user"), uid="req-bad"))
    bad["request"]["userInfo"]["username"] = username
    status, answer = call(url, context, "/validate", orjson.dumps(bad))
    assert status == 200 and answer["response"]["uid"] == "req-bad"
    status, _answer = call(url, context, "/validate", review(job("after-it"), uid="req-after"))
    assert status == 200
    decided = [decode_event(m.value()) for m in read_topic(kafka_bootstrap, catalogue.scheduler, 1, timeout=20)]
    assert [e.payload.object_name for e in decided] == ["after-it"]
    from schemas import DeadLetter
    letters = [DeadLetter.model_validate_json(m.value()) for m in read_topic(kafka_bootstrap, catalogue.deadletter, 1, timeout=20)]
    assert [(d.reason, d.stage) for d in letters] == [("validation", "admit.recorder")]
    assert letters[0].error.startswith("admission decision could not be recorded: 1 validation error for AdmissionPayload user "), letters[0].error
    described = orjson.loads(letters[0].value)
    assert (described["request_uid"], described["object"], described["user"], described["decision"]) == ("req-bad", "serving/Job/bad-user", username, "deny")
    health = call(url, context, "/healthz")[1]
    assert health["recorder"]["unrecordable"] == 1 and health["recorder"]["published"] == 1


def test_a_decision_too_large_for_a_record_is_dead_lettered_and_the_others_published(catalogue, kafka_bootstrap):
    """Found by a review: an event over the raw topic's record limit (an object name no API server
    would accept, from a direct caller) raised EventTooLarge, a ProducerError, and was retried for
    ever: no later decision was published. It is dead-lettered (reason event_too_large), the others
    published — on the real broker."""
    from datetime import datetime, timezone

    from producers.admission.events import decision_event
    from producers.admission.service import DecisionRecorder
    from schemas import DeadLetter
    from streams.controls.admission import AdmissionState, Subject, decide

    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "admit-test")
    state = AdmissionState()
    state.ready.set()
    at = datetime(2026, 12, 6, tzinfo=timezone.utc)

    def event_for(name: str):
        subject = Subject("Pod", "serving", name, f"uid-{len(name)}", 1, {"environment": "prod"}, f"serving/Pod/{name[:20]}", False)
        return decision_event(subject, decide(subject, state, Policy(), at), at, gate="webhook", request_id=name[:20])

    huge = event_for("p" * (publisher.max_event_bytes + 1000))
    fine = event_for("fine")
    recorder = DecisionRecorder(publisher, batch=10)
    try:
        recorder(huge)
        recorder(fine)
        recorder.start()
        poll(lambda: recorder.counters["published"] == 1, "the decision that fits published", 30)
        assert recorder.counters["too_large"] == 1
        letters = [DeadLetter.model_validate_json(m.value()) for m in read_topic(kafka_bootstrap, catalogue.deadletter, 1, timeout=20)]
        assert [(d.reason, d.stage) for d in letters] == [("event_too_large", "admit.recorder")], letters
        assert [decode_event(m.value()).event_id for m in read_topic(kafka_bootstrap, catalogue.scheduler, 1, timeout=20)] == [fine.event_id]
    finally:
        recorder.stop()
        publisher.close(5)

