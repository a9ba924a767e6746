"""`gpuledger admit` against the real API server and the real Kueue (the real-cluster tier).

The webhook is registered with a ``url`` clientConfig (no Service network here) and the
generated CA as caBundle — the same ``producers.admission.manifests.webhook_configuration``
that renders deploy/k8s/base/admit/webhook.yaml. The release state comes from a real
broker's release topic, fed by the real ``gpuledger release`` commands.
"""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import orjson
import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from typer.testing import CliRunner

from gpuledger.cli import app
from gpuledger.dev.cluster import FLAVOR, KUEUE_API, WEBHOOK_CLIENT_NAME
from gpuledger.dev.process import free_port
from producers._kafka import EventPublisher, ensure_topics
from producers.admission.config import AdmitSettings
from producers.admission.manifests import admission_check, webhook_configuration
from producers.admission.service import AdmitService
from schemas import decode_event
from schemas.topics import TopicCatalogue
from streams.controls.policy import Admission, NamespaceAdmission, Policy
from tests.fixtures.kafka import read_topic
from producers.kubernetes.collector import SchedulerCollector, build_api_client
from producers.kubernetes.config import SchedulerCollectorSettings
from producers.releases import COMMANDS, build_event
from streams.controls.rules import ControlEngine, directory_from_rows
from tests.producers.kubernetes.test_collector import running
from tests.streams.harness import Driver
from tests.real_cluster.conftest import REAL_CLUSTER, condition, gpu_job, unique, wait_for, workloads_of

pytestmark = REAL_CLUSTER

SUFFIX = uuid.uuid4().hex[:6]
PROD, STAGING, QUEUED = f"admit-prod-{SUFFIX}", f"admit-staging-{SUFFIX}", f"admit-queued-{SUFFIX}"
TEST_LABEL = "gpuledger.io/admit-test"
CHECK = f"release-approval-{SUFFIX}"
COMMAND = {c.name: c for c in COMMANDS}


def policy() -> Policy:
    return Policy(admission=Admission(namespaces={
        PROD: NamespaceAdmission(environment="prod"), STAGING: NamespaceAdmission(environment="staging"),
        QUEUED: NamespaceAdmission(environment="prod", gate="admission-check")}))


@pytest.fixture(scope="module")
def ledger(kafka_bootstrap):
    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    runner = CliRunner(env={"GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": cat.prefix})

    def release(command: str, rid: str, *args: str) -> None:
        result = runner.invoke(app, ["release", command, "--release-id", rid, *args])
        assert result.exit_code == 0, result.output

    return cat, release


@pytest.fixture(scope="module")
def admit(real_cluster, kube, kafka_bootstrap, ledger):
    """gpuledger admit (webhook + AdmissionCheck controller) registered with the API server."""
    cat, _ = ledger
    for ns, env in ((PROD, "prod"), (STAGING, "staging"), (QUEUED, "prod")):
        real_cluster.apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                  "metadata": {"name": ns, "labels": {"gpuledger.io/environment": env, TEST_LABEL: SUFFIX}}})
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "admit")
    bound = {}
    # The API server proves itself with its webhook client certificate (LocalCluster's
    # AdmissionConfiguration): decisions record it as their caller.
    service = AdmitService(AdmitSettings(port=free_port(), resync_s=5, client_ca_file=real_cluster.webhook_client_ca,
                                         client_names=(WEBHOOK_CLIENT_NAME,)), policy(), publisher, kafka_bootstrap, cat.release,
                           api_client=kube, on_listening=lambda h, p, pem: bound.update(port=p, pem=pem))
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    wait_for(lambda: bound and service.state.ready.is_set(), 30, "gpuledger admit to listen with its release state loaded")
    admission = k8s.AdmissionregistrationV1Api(kube)
    config = webhook_configuration({"url": f"https://127.0.0.1:{bound['port']}", "caBundle": base64.b64encode(bound["pem"]).decode()},
                                   name=f"gpuledger-admit-{SUFFIX}", extra_namespace_match=[{"key": TEST_LABEL, "operator": "In", "values": [SUFFIX]}])
    admission.create_validating_webhook_configuration(config)
    # The queued namespace: its own ClusterQueue gated by our AdmissionCheck.
    custom = k8s.CustomObjectsApi(kube)
    gated_queue(custom, QUEUED, f"cq-{SUFFIX}", admission_check(CHECK))
    yield service, config
    admission.delete_validating_webhook_configuration(config["metadata"]["name"])
    # The bare pods these tests let in run on KWOK until deleted and hold real GPUs of the
    # session's nodes: free them (and the gated queue) before the next module places its own.
    core = k8s.CoreV1Api(kube)
    for ns in (PROD, STAGING, QUEUED):
        # At once: KWOK removes a gracefully deleted pod only when its deletionTimestamp (now + the
        # 30 s default grace period) has come, and no kubelet here has anything to stop before that.
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        core.delete_namespace(ns)
    custom.delete_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", f"cq-{SUFFIX}")
    custom.delete_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "admissionchecks", CHECK)
    wait_for(lambda: not [p for ns in (PROD, STAGING, QUEUED) for p in core.list_namespaced_pod(ns).items], 120,
             "the admission tests' pods to be gone")
    service.stop()
    thread.join(20)
    assert not thread.is_alive()


def gated_queue(custom: k8s.CustomObjectsApi, namespace: str, cluster_queue: str, check: dict) -> None:
    """The AdmissionCheck ``check``, a ClusterQueue gated by it for ``namespace`` alone and its LocalQueue
    ``gpu`` there, once the ClusterQueue is active (the check's controller marked it Active)."""
    custom.create_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "admissionchecks", check)
    quota = [{"name": "cpu", "nominalQuota": "64"}, {"name": "nvidia.com/gpu", "nominalQuota": "16"}]
    custom.create_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", {
        "apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                 "admissionChecksStrategy": {"admissionChecks": [{"name": check["metadata"]["name"]}]},
                 "resourceGroups": [{"coveredResources": ["cpu", "nvidia.com/gpu"], "flavors": [{"name": FLAVOR, "resources": quota}]}]}})
    custom.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", namespace, "localqueues", {
        "apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": "gpu", "namespace": namespace}, "spec": {"clusterQueue": cluster_queue}})
    wait_for(lambda: condition(custom.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", cluster_queue), "Active"),
             60, f"the gated ClusterQueue {cluster_queue} to be active (its AdmissionCheck marked Active)")


def denial(call) -> str:
    with pytest.raises(ApiException) as info:
        call()
    assert info.value.status in (400, 403, 500), info.value
    return orjson.loads(info.value.body)["message"]


def gpu_pod(name: str, namespace: str, rid: str | None) -> dict:
    labels = {"gpuledger.io/release-id": rid} if rid else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "registry.example/serve@sha256:" + "cd" * 32,
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def registered(release, rid: str) -> None:
    release("register", rid, "--model", "fraud-scorer", "--version", "8", "--artifact-digest", "sha256:" + "a" * 64)
    release("evaluate", rid)


def test_an_unapproved_release_job_is_denied_by_the_api_server_with_our_message(admit, kube, ledger, kafka_bootstrap):
    cat, release = ledger
    rid = unique("fraud-scorer-v8-prod")
    registered(release, rid)
    batch = k8s.BatchV1Api(kube)
    job = gpu_job(unique("score"), queue=None, labels={"gpuledger.io/release-id": rid}, namespace=PROD)
    wait_for(lambda: admit[0].state.state_as_of(rid, datetime.now(timezone.utc).isoformat()) == "release.evaluated", 10, "the release in the state")
    message = denial(lambda: batch.create_namespaced_job(PROD, job))
    assert 'admission webhook "jobs.fail-closed.admit.gpuledger.io" denied the request' in message
    assert f"release {rid} is evaluated, not approved for prod; approvals need the `approve` right" in message
    # An object cannot opt itself out (an objectSelector on gpuledger.io/admit let a Job labelled
    # 'disabled' by its creator skip even the fail-closed webhook): still sent to us, still denied.
    opted_out = gpu_job(unique("score"), queue=None, labels={"gpuledger.io/release-id": rid, "gpuledger.io/admit": "disabled"}, namespace=PROD)
    assert 'admission webhook "jobs.fail-closed.admit.gpuledger.io" denied the request' in denial(lambda: batch.create_namespaced_job(PROD, opted_out))
    # A CPU-only Job is never sent to us (matchConditions): created at once.
    cpu = gpu_job(unique("cpu"), queue=None, namespace=PROD)
    cpu["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
    batch.create_namespaced_job(PROD, cpu)
    release("approve", rid, "--actor", "alice", "--env", "prod")
    wait_for(lambda: _creates(lambda: batch.create_namespaced_job(PROD, {**job, "metadata": {**job["metadata"], "name": unique("score")}})),
             5, "the approved release's Job to be created")
    decided = [decode_event(m.value()) for m in read_topic(kafka_bootstrap, cat.scheduler, 2, timeout=20)]
    mine = [e for e in decided if e.identity.release_id == rid]
    assert {(e.payload.decision, e.payload.rule) for e in mine} >= {("deny", "unapproved"), ("allow", "approved")}
    assert all(e.event_type == "admission.decided" and e.payload.gate == "webhook" and e.identity.namespace == PROD for e in mine)
    # Who asked is proven: the real API server's client certificate; the user it authenticated (the test's admin token).
    assert {(e.payload.caller, e.payload.user) for e in mine} == {(f"x509:{WEBHOOK_CLIENT_NAME}", "admin")}, {(e.payload.caller, e.payload.user) for e in mine}


def test_a_namespace_labelled_prod_and_not_in_the_policy_is_decided_as_prod(admit, kube, ledger, real_cluster):
    """The real API server calls the fail-closed webhook's own path (/validate/prod) for a namespace
    labelled prod: admit decides its work in prod although the policy does not map it (before, in
    an unknown environment: "not approved for its environment (none is known …)", and fail-open
    while the release state loaded, behind a webhook the API server calls fail-closed)."""
    _, release = ledger
    rid = unique("unmapped-scorer-v1")
    registered(release, rid)
    unmapped = f"admit-unmapped-{SUFFIX}"
    assert unmapped not in admit[0].handler.policy.admission.namespaces
    real_cluster.apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                              "metadata": {"name": unmapped, "labels": {"gpuledger.io/environment": "prod", TEST_LABEL: SUFFIX}}})
    core = k8s.CoreV1Api(kube)
    try:
        wait_for(lambda: admit[0].state.state_as_of(rid, datetime.now(timezone.utc).isoformat()) == "release.evaluated", 10, "the release in the state")
        message = denial(lambda: core.create_namespaced_pod(unmapped, gpu_pod(unique("serve"), unmapped, rid)))
        assert 'admission webhook "pods.fail-closed.admit.gpuledger.io" denied the request' in message
        assert f"release {rid} is evaluated, not approved for prod" in message, message
        release("approve", rid, "--actor", "alice", "--env", "staging")  # not enough for prod
        message = wait_for(lambda: (m := _denied(lambda: core.create_namespaced_pod(unmapped, gpu_pod(unique("serve"), unmapped, rid), dry_run="All")))
                           and "approved for staging" in m and m, 10, "the staging approval to be read")
        assert "is approved for staging, not approved for prod" in message, message
    finally:
        core.delete_namespace(unmapped)


def test_a_pod_whose_gpu_comes_from_a_dra_claim_is_decided_like_one_requesting_it(admit, kube, ledger):
    """A pod that gets its GPU through a ResourceClaimTemplate requests no extended resource:
    the webhook is sent it anyway (matchConditions: spec.resourceClaims), reads the template and
    its DeviceClass from the API server, and denies it for an unapproved release — while a
    pod whose claim is for a NIC's device class is not GPU work and is created, and one naming a
    claim that does not exist counts as a GPU (denied: unreadable is not let through)."""
    _, release = ledger
    rid = unique("dra-scorer-v1")
    registered(release, rid)
    wait_for(lambda: admit[0].state.state_as_of(rid, datetime.now(timezone.utc).isoformat()) == "release.evaluated", 10, "the release in the state")
    custom, core = k8s.CustomObjectsApi(kube), k8s.CoreV1Api(kube)
    group, version = "resource.k8s.io", "v1"
    classes = {"gpu": f"gpu-{SUFFIX}.example.com", "nic": f"nic-{SUFFIX}.example.com"}
    selectors = {"gpu": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
                 "nic": "device.driver == 'sriovnetwork.example.com'"}
    for kind, name in classes.items():
        custom.create_cluster_custom_object(group, version, "deviceclasses", {
            "apiVersion": f"{group}/{version}", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": selectors[kind]}}]}})
        custom.create_namespaced_custom_object(group, version, PROD, "resourceclaimtemplates", {
            "apiVersion": f"{group}/{version}", "kind": "ResourceClaimTemplate", "metadata": {"name": f"one-{kind}"},
            "spec": {"spec": {"devices": {"requests": [{"name": kind, "exactly": {"deviceClassName": name}}]}}}})
    try:
        def pod(kind: str, claim: dict) -> dict:
            body = gpu_pod(unique(f"dra-{kind}"), PROD, rid)
            container = body["spec"]["containers"][0]
            container["resources"] = {"claims": [{"name": kind}]}
            body["spec"]["resourceClaims"] = [{"name": kind, **claim}]
            return body

        message = denial(lambda: core.create_namespaced_pod(PROD, pod("gpu", {"resourceClaimTemplateName": "one-gpu"})))
        assert 'admission webhook "pods.fail-closed.admit.gpuledger.io" denied the request' in message
        assert f"release {rid} is evaluated, not approved for prod" in message
        created = core.create_namespaced_pod(PROD, pod("nic", {"resourceClaimTemplateName": "one-nic"}))
        assert created.metadata.name.startswith("dra-nic")
        message = denial(lambda: core.create_namespaced_pod(PROD, pod("gpu", {"resourceClaimName": "no-such-claim"})))
        assert f"release {rid} is evaluated, not approved for prod" in message
        assert admit[0].claims.lookups >= 3 and admit[0].claims.unresolved >= 1
    finally:
        for kind, name in classes.items():
            custom.delete_namespaced_custom_object(group, version, PROD, "resourceclaimtemplates", f"one-{kind}")
            custom.delete_cluster_custom_object(group, version, "deviceclasses", name)


def _creates(call) -> bool:
    try:
        call()
        return True
    except ApiException:
        return False


def test_in_admission_check_mode_the_workload_waits_and_is_admitted_after_approval_without_touching_the_job(admit, kube, ledger, kafka_bootstrap):
    cat, release = ledger
    rid = unique("fraud-scorer-v9-prod")
    registered(release, rid)
    batch = k8s.BatchV1Api(kube)
    name = unique("train")
    created = batch.create_namespaced_job(QUEUED, gpu_job(name, labels={"gpuledger.io/release-id": rid}, namespace=QUEUED))

    def our_check():
        wl = next(iter(workloads_of(kube, name, QUEUED)), None)
        check = next((c for c in (wl or {}).get("status", {}).get("admissionChecks") or [] if c["name"] == CHECK), None)
        return (wl, check) if check and check.get("message") else None

    wl, check = wait_for(our_check, 60, "our AdmissionCheck to hold the Workload with a message")
    assert check["state"] == "Pending" and f"release {rid} is evaluated, not approved for prod" in check["message"]
    assert not condition(wl, "Admitted") and batch.read_namespaced_job(name, QUEUED).spec.suspend is True
    release("approve", rid, "--actor", "carol", "--env", "prod")
    admitted = wait_for(lambda: next((w for w in workloads_of(kube, name, QUEUED) if condition(w, "Admitted")), None), 30,
                        "Kueue to admit the Workload once the release is approved")
    assert admitted["metadata"]["uid"] == wl["metadata"]["uid"]  # the same Workload: no resubmission
    job = wait_for(lambda: (j := batch.read_namespaced_job(name, QUEUED)).spec.suspend is False and j, 30, "Kueue to start the Job")
    assert job.metadata.uid == created.metadata.uid and job.metadata.generation == created.metadata.generation + 1  # Kueue's unsuspend only
    ready = next(c for c in admitted["status"]["admissionChecks"] if c["name"] == CHECK)
    assert ready["state"] == "Ready" and ready["message"] == f"release {rid} is approved for prod"
    decided = [decode_event(m.value()) for m in read_topic(kafka_bootstrap, cat.scheduler, 2, timeout=20)]
    states = [(e.payload.operation, e.payload.rule) for e in decided if e.payload.gate == "admission-check" and e.identity.release_id == rid]
    assert states == [("Pending", "unapproved"), ("Ready", "approved")] or sorted(states) == sorted([("Pending", "unapproved"), ("Ready", "approved")])
    webhook = {(e.payload.object_kind, e.payload.rule) for e in decided if e.payload.gate == "webhook" and e.identity.release_id == rid}
    # The Job and its Workload were let through to wait in the queue; the pods Kueue's start created were approved.
    assert webhook == {("Job", "deferred-to-admission-check"), ("Workload", "deferred-to-admission-check"), ("Pod", "approved")}


def _check_of(kube, job_name: str, namespace: str, check_name: str) -> tuple[dict, dict] | tuple[None, None]:
    """(the Job's Workload, its state of the AdmissionCheck ``check_name``), or (None, None)."""
    wl = next(iter(workloads_of(kube, job_name, namespace)), None)
    check = next((c for c in (wl or {}).get("status", {}).get("admissionChecks") or [] if c["name"] == check_name), None)
    return (wl, check) if check else (None, None)


def _check_decisions(bootstrap: str, topic: str, workload_id: str, until: Callable[[list], bool], what: str) -> list:
    """The AdmissionCheck controller's decisions on ``workload_id`` on ``topic``, in the order they were
    decided, once ``until`` holds for them (the recorder publishes off the controller's thread)."""
    def read():
        mine = sorted((e for e in (decode_event(m.value()) for m in read_topic(bootstrap, topic, 1, timeout=5))
                       if e.event_type == "admission.decided" and e.payload.gate == "admission-check" and e.identity.workload_id == workload_id),
                      key=lambda e: e.occurred_at)
        return mine if mine and until(mine) else None
    return wait_for(read, 30, f"{what} on {workload_id}")


def test_a_controller_whose_release_state_has_not_loaded_decides_nothing_and_holds_fail_open_workloads_once_it_has(
        real_cluster, kube, kafka_bootstrap):
    """Found by an exploratory review: at every start of `gpuledger admit --kubeconfig` (the Deployment
    is Recreate) the controller decided the waiting Workloads before its release state had loaded —
    `state-not-loaded`, which a fail-open environment allowed — so it set their checks Ready, Kueue
    admitted them unchecked, and an admitted Workload is never revisited. Now nothing is decided before
    the state has loaded (a queued Workload can wait), then every waiting Workload is.

    The state cannot load while the release topic does not exist (the follower waits for it): the
    controller sees the Workload waiting on its check meanwhile; then the topic appears with the
    release, registered and evaluated, and the Workload is held Pending for its approval — its only
    decision. A staging namespace of its own (fail-open), its own AdmissionCheck and controller name,
    so the module's admit does not decide it."""
    suffix = uuid.uuid4().hex[:6]
    ns, check, controller = f"admit-restart-{suffix}", f"release-approval-restart-{suffix}", f"gpuledger.io/release-approval-{suffix}"
    out = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, out)
    releases = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=4)  # not created yet: the state cannot load
    real_cluster.apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                              "metadata": {"name": ns, "labels": {"gpuledger.io/environment": "staging"}}})
    custom, batch, core = k8s.CustomObjectsApi(kube), k8s.BatchV1Api(kube), k8s.CoreV1Api(kube)
    policy = Policy(admission=Admission(namespaces={ns: NamespaceAdmission(environment="staging", gate="admission-check")}))
    assert "staging" not in policy.admission.fail_closed  # fail-open: the webhook would let its work in unchecked
    service = AdmitService(AdmitSettings(port=free_port(), resync_s=5, controller_name=controller), policy,
                           EventPublisher({"bootstrap.servers": kafka_bootstrap}, out, "admit"), kafka_bootstrap, releases.release, api_client=kube)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        # (the controller marks its AdmissionCheck Active before its state has loaded)
        gated_queue(custom, ns, f"cq-{ns}", admission_check(check, controller))
        rid, name = unique("restart-scorer-v1"), unique("train")
        batch.create_namespaced_job(ns, gpu_job(name, labels={"gpuledger.io/release-id": rid}, namespace=ns))

        def seen_waiting():
            wl, _ = _check_of(kube, name, ns, check)
            key = wl and f"{ns}/{wl['metadata']['name']}"
            cached = service.controller.cache.get(key) if key else None
            return key if cached and any(c["name"] == check for c in (cached.get("status") or {}).get("admissionChecks") or []) else None

        key = wait_for(seen_waiting, 60, "the controller to see the Workload waiting on its check")
        assert not service.state.ready.is_set(), "the release state loaded before its topic existed"

        ensure_topics({"bootstrap.servers": kafka_bootstrap}, releases)
        runner = CliRunner(env={"GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": releases.prefix})
        for command, args in (("register", ["--model", "restart-scorer", "--version", "1", "--artifact-digest", "sha256:" + "a" * 64]),
                              ("evaluate", [])):
            result = runner.invoke(app, ["release", command, "--release-id", rid, *args])
            assert result.exit_code == 0, result.output
        unapproved = f"release {rid} is evaluated, not approved for staging"
        wl, held = wait_for(lambda: (r := _check_of(kube, name, ns, check))[1] and unapproved in (r[1].get("message") or "") and r,
                            60, "the Workload held for its approval once the state has loaded")
        assert held["state"] == "Pending" and held["message"].startswith(unapproved), held
        assert not condition(wl, "Admitted") and batch.read_namespaced_job(name, ns).spec.suspend is True
        # Every decision a hold (the state may have loaded with the topic empty or the registration alone:
        # unknown-release, "registered, not approved" first), none before the state loaded.
        decided = _check_decisions(kafka_bootstrap, out.scheduler, key, lambda es: unapproved in es[-1].payload.message, "the hold recorded")
        assert [(e.payload.operation, e.payload.decision) for e in decided] == [("Pending", "deny")] * len(decided), decided
        assert "state-not-loaded" not in {e.payload.rule for e in decided} and decided[-1].payload.rule == "unapproved", decided
    finally:
        service.stop()
        thread.join(20)
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        core.delete_namespace(ns)
        custom.delete_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", f"cq-{ns}")
        custom.delete_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "admissionchecks", check)
    assert not thread.is_alive()


def test_a_workload_held_again_after_an_eviction_has_its_second_hold_recorded(admit, kube, ledger, kafka_bootstrap):
    """Found by a review: the controller's decision id was its check state and rule alone, so a Workload
    held Pending (unapproved), let in by an override (Ready), evicted and held Pending (unapproved) again
    recorded its second hold under the first one's id — the store kept one row, and the override's Ready
    read as its last decision. Now each episode of the check (Kueue resets it to Pending, with a new
    lastTransitionTime, when it evicts the Workload) is its own fact."""
    cat, release = ledger
    rid = unique("fraud-scorer-v11-prod")
    registered(release, rid)
    wait_for(lambda: admit[0].state.state_as_of(rid, datetime.now(timezone.utc).isoformat()) == "release.evaluated", 10, "the release in the state")
    custom, batch = k8s.CustomObjectsApi(kube), k8s.BatchV1Api(kube)
    name = unique("train")
    batch.create_namespaced_job(QUEUED, gpu_job(name, labels={"gpuledger.io/release-id": rid}, namespace=QUEUED, run_for="1h"))
    unapproved = f"release {rid} is evaluated, not approved for prod"
    wl, check = wait_for(lambda: (r := _check_of(kube, name, QUEUED, CHECK))[1] and unapproved in (r[1].get("message") or "") and r, 60,
                         "our AdmissionCheck to hold the Workload")
    wl_name = wl["metadata"]["name"]
    expires = datetime.now(timezone.utc) + timedelta(seconds=15)
    release("override-admission", rid, "--actor", "oncall-sre", "--target", f"{QUEUED}/{wl_name}", "--expires-at", expires.isoformat(),
            "--reason", "INC-312 hotfix")
    wait_for(lambda: condition(custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", QUEUED, "workloads", wl_name), "Admitted"),
             30, "the override to have the Workload admitted")
    wait_for(lambda: datetime.now(timezone.utc) >= expires, 30, "the override to expire")
    # Evicted (deactivated): Kueue resets its checks to Pending and releases its quota; the controller holds it again.
    custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", QUEUED, "workloads", wl_name, {"spec": {"active": False}})
    wl, again = wait_for(lambda: (r := _check_of(kube, name, QUEUED, CHECK))[1] and not condition(r[0], "Admitted")
                         and unapproved in (r[1].get("message") or "") and r, 60, "the evicted Workload held again")
    assert again["state"] == "Pending" and again["lastTransitionTime"] > check["lastTransitionTime"], (check, again)
    decided = _check_decisions(kafka_bootstrap, cat.scheduler, f"{QUEUED}/{wl_name}", lambda es: len(es) >= 3, "three decisions")
    assert [(e.payload.operation, e.payload.rule) for e in decided] == [("Pending", "unapproved"), ("Ready", "override"), ("Pending", "unapproved")]
    assert len({e.event_id for e in decided}) == 3, [e.event_id for e in decided]  # the store keeps one row per id: the second hold too


def test_a_revoked_release_new_pods_are_denied(admit, kube, ledger):
    _cat, release = ledger
    rid = unique("fraud-scorer-v7-prod")
    registered(release, rid)
    release("approve", rid, "--actor", "alice", "--env", "prod")
    core = k8s.CoreV1Api(kube)
    wait_for(lambda: _creates(lambda: core.create_namespaced_pod(PROD, gpu_pod(unique("serve"), PROD, rid))), 10, "an approved release's pod")
    release("revoke", rid, "--reason", "scores drifted", "--actor", "alice")
    message = wait_for(lambda: _denied(lambda: core.create_namespaced_pod(PROD, gpu_pod(unique("serve"), PROD, rid))), 5,
                       "the revocation to deny new pods")
    assert 'admission webhook "pods.fail-closed.admit.gpuledger.io" denied the request' in message and f"release {rid} was revoked" in message


def _denied(call) -> str | None:
    try:
        call()
        return None
    except ApiException as exc:
        return orjson.loads(exc.body)["message"]


def test_an_override_lets_the_workload_through_until_it_expires(admit, kube, ledger):
    _cat, release = ledger
    rid = unique("fraud-scorer-v10-prod")
    registered(release, rid)
    core = k8s.CoreV1Api(kube)
    expires = datetime.now(timezone.utc) + timedelta(seconds=15)
    release("override-admission", rid, "--actor", "oncall-sre", "--target", f"{PROD}/*", "--expires-at", expires.isoformat(),
            "--reason", "INC-311 hotfix")
    wait_for(lambda: _creates(lambda: core.create_namespaced_pod(PROD, gpu_pod(unique("hotfix"), PROD, rid))), 10, "the override to let a pod in")
    # Server-side dry runs while waiting (the webhook is called for them too: sideEffects None), so the
    # allowed ones do not fill the GPUs.
    message = wait_for(lambda: _denied(lambda: core.create_namespaced_pod(PROD, gpu_pod(unique("hotfix"), PROD, rid), dry_run="All")), 30,
                       "the override to expire")
    assert datetime.now(timezone.utc) >= expires and "not approved for prod" in message
    # An override by someone without the override right never counted.
    release("override-admission", rid, "--actor", "mallory", "--target", f"{PROD}/*",
            "--expires-at", (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat())
    message = wait_for(lambda: (m := _denied(lambda: core.create_namespaced_pod(PROD, gpu_pod(unique("hotfix"), PROD, rid)))) and "mallory" in m and m,
                       10, "the unentitled override to be read and refused")
    assert "the override by mallory (unauthenticated) does not count" in message


def test_with_the_webhook_down_prod_gpu_pods_are_refused_and_others_allowed_and_control_1_catches_them(
        admit, kube, real_cluster, kafka_bootstrap, catalogue, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    prod, staging = f"down-prod-{suffix}", f"down-staging-{suffix}"
    for ns, env in ((prod, "prod"), (staging, "staging")):
        real_cluster.apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                  "metadata": {"name": ns, "labels": {"gpuledger.io/environment": env, "down-test": suffix}}})
    ca_bundle = admit[1]["webhooks"][0]["clientConfig"]["caBundle"]
    dead = webhook_configuration({"url": f"https://127.0.0.1:{free_port()}", "caBundle": ca_bundle},
                                 name=f"gpuledger-admit-down-{suffix}", timeout_seconds=2,
                                 extra_namespace_match=[{"key": "down-test", "operator": "In", "values": [suffix]}])
    admission = k8s.AdmissionregistrationV1Api(kube)
    admission.create_validating_webhook_configuration(dead)
    try:
        core = k8s.CoreV1Api(kube)
        message = denial(lambda: core.create_namespaced_pod(prod, gpu_pod("serve", prod, "any-release")))
        assert 'failed calling webhook "pods.fail-closed.admit.gpuledger.io"' in message
        rid = unique("unapproved-staging")
        pod = gpu_pod("serve", staging, rid)
        pod["metadata"]["labels"]["gpuledger.io/environment"] = "staging"
        created = core.create_namespaced_pod(staging, pod)
        assert created.metadata.uid
        cpu = {**gpu_pod("cpu", prod, None)}
        cpu["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m"}}
        assert core.create_namespaced_pod(prod, cpu).metadata.uid  # not a GPU request: never sent, even fail-closed
    finally:
        admission.delete_validating_webhook_configuration(dead["metadata"]["name"])
    # Fail-open let it in; control 1 still catches it after admission: the real scheduler
    # collector's events through the worker's own join and control functions.
    settings = SchedulerCollectorSettings(kubeconfig=real_cluster.kubeconfig, namespace=staging, watch_timeout_s=5,
                                          backoff_initial_s=0.2, backoff_max_s=1.0)
    collector = SchedulerCollector(settings, EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "scheduler"),
                                   build_api_client(settings), tmp_path / "state")
    with running(collector):
        events = wait_for(lambda: (es := [decode_event(m.value()) for m in read_topic(kafka_bootstrap, catalogue.scheduler, 1, timeout=5)])
                          and any(e.event_type in ("scheduler.scheduled", "scheduler.running") for e in es) and es, 90,
                          "the scheduler collector to see the fail-open pod scheduled")
    collector.close()
    releases = [build_event(COMMAND[c], {"release_id": rid, "at": (created.metadata.creation_timestamp - timedelta(minutes=m)).isoformat(), **o})
                for c, m, o in (("register", 5, {"model": "m", "version": "1", "artifact_digest": "sha256:" + "e" * 64}), ("evaluate", 4, {}))]
    rows = list(Driver().feed([*releases, *events]).rows.values())
    engine = ControlEngine(directory_from_rows(rows), Policy()).feed(rows)
    engine.run()
    [violation] = [v for v in engine.current() if v.control_id == 1]
    assert violation.identity.release_id == rid and f"release {rid} had no approval for staging" in violation.detail
