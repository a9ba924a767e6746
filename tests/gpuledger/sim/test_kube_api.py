"""Drives tests/fixtures/kube_api.FakeKubeApi with the real ``kubernetes`` client.

These tests pin down the wire behaviour collectors rely on (list shapes,
watch framing, bookmarks, 410 Expired, 404 for a missing CRD, pagination,
injected failures) so that a collector passing against the double has a fair
chance of passing against a real API server. Watches either stop as soon as
they have seen what they need or use a 1 s server-side timeout.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.fixtures.kube_api import (
    CORE_EVENTS,
    EVENTS,
    PODS,
    WORKLOADS_V1BETA1,
    WORKLOADS_V1BETA2,
    FakeKubeApi,
    disruption_target,
    make_core_event,
    make_event_v1,
    make_pod,
    make_pod_set,
    make_workload,
    pod_condition,
    pod_set_assignment,
    workload_condition,
)

T0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc)
DIGEST = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


@pytest.fixture
def api():
    with FakeKubeApi() as server:
        yield server


@pytest.fixture
def ac(api):
    with api.api_client() as api_client:
        yield api_client


def later(delay: float, fn, *args, **kwargs) -> threading.Timer:
    """Run a store mutation from another thread while the test is blocked in a watch."""
    t = threading.Timer(delay, fn, args, kwargs)
    t.daemon = True
    t.start()
    return t


def when_watching(api, fn, *args) -> threading.Thread:
    """Run ``fn`` from another thread once the test's watch is open on the server: a
    bookmark is sent only to open watches (a timer raced the watch request on a loaded
    machine, and the bookmark went nowhere)."""
    def run():
        api.wait_for_watches(1, PODS)
        fn(*args)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def later_in_order(delay: float, *steps) -> threading.Timer:
    """Run several mutations, in order, from one thread: two timers race on a loaded machine
    (CI saw a patch fire before the create it depends on)."""
    def run():
        for fn, *args in steps:
            fn(*args)
    return later(delay, run)


# ---------------------------------------------------------------- discovery


def test_discovery_documents_parse_into_client_models(api, ac):
    assert client.CoreApi(ac).get_api_versions().versions == ["v1"]
    groups = {g.name: g for g in client.ApisApi(ac).get_api_versions().groups}
    assert set(groups) == {"events.k8s.io", "kueue.x-k8s.io", "resource.k8s.io"}
    assert [v.version for v in groups["resource.k8s.io"].versions] == ["v1"]  # DRA GA (Kubernetes 1.34): ResourceSlices
    assert [v.version for v in groups["kueue.x-k8s.io"].versions] == ["v1beta2", "v1beta1"]
    assert groups["kueue.x-k8s.io"].preferred_version.version == "v1beta2"

    core = {r.name: r for r in client.CoreV1Api(ac).get_api_resources().resources}
    assert core["pods"].kind == "Pod" and core["pods"].namespaced
    assert core["events"].kind == "Event"
    ev = client.EventsV1Api(ac).get_api_resources()
    assert ev.group_version == "events.k8s.io/v1"
    assert client.VersionApi(ac).get_code().major == "1"


def test_dynamic_client_discovers_kueue_workloads(api, ac, tmp_path):
    from kubernetes.dynamic import DynamicClient

    api.create(WORKLOADS_V1BETA2, make_workload("ml", "wl-a"))
    dyn = DynamicClient(ac, cache_file=str(tmp_path / "discovery.json"))
    res = dyn.resources.get(api_version="kueue.x-k8s.io/v1beta2", kind="Workload")
    assert res.namespaced
    assert [w.metadata.name for w in res.get().items] == ["wl-a"]


def test_kueue_absent_is_404_and_not_advertised(ac):
    with FakeKubeApi(kueue_versions=()) as bare, bare.api_client() as bac:
        names = [g.name for g in client.ApisApi(bac).get_api_versions().groups]
        assert "kueue.x-k8s.io" not in names
        co = client.CustomObjectsApi(bac)
        with pytest.raises(ApiException) as exc:
            co.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloads")
        assert exc.value.status == 404
        with pytest.raises(ApiException) as exc:
            watch.Watch().stream(co.list_cluster_custom_object, "kueue.x-k8s.io", "v1beta1",
                                 "workloads", timeout_seconds=1).__next__()
        assert exc.value.status == 404

        # Installing the CRD later makes the group appear.
        bare.set_kueue_versions(["v1beta1"])
        assert co.list_cluster_custom_object("kueue.x-k8s.io", "v1beta1", "workloads")["items"] == []
        with pytest.raises(ApiException) as exc:
            co.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloads")
        assert exc.value.status == 404


# ---------------------------------------------------------------- lists


def test_list_pods_deserializes_into_v1pod(api, ac):
    api.create(PODS, make_pod(
        "ml", "train-0", node="gpu-1", gpus=2,
        labels={"app": "train"}, owner=("Job", "train-1", "11111111-2222-3333-4444-555555555555"),
        image=f"registry.example.com/org/img@sha256:{DIGEST}", priority_class="high", priority=1000,
        created=T0,
    ))
    api.create(PODS, make_pod("ml", "pending-0", created=T0))

    lst = client.CoreV1Api(ac).list_pod_for_all_namespaces()
    assert lst.metadata.resource_version == api.resource_version
    by_name = {p.metadata.name: p for p in lst.items}
    running, pending = by_name["train-0"], by_name["pending-0"]
    assert running.kind is None  # built-in list items carry no TypeMeta on the wire
    assert running.metadata.creation_timestamp == T0
    assert running.spec.node_name == "gpu-1"
    assert running.spec.priority_class_name == "high" and running.spec.priority == 1000
    assert running.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
    assert running.metadata.owner_references[0].kind == "Job"
    assert running.metadata.owner_references[0].api_version == "batch/v1"
    cs = running.status.container_statuses[0]
    assert cs.image_id == f"registry.example.com/org/img@sha256:{DIGEST}"
    assert cs.state.running.started_at == T0
    assert {c.type for c in running.status.conditions} >= {"PodScheduled", "Ready"}

    assert pending.spec.node_name is None and pending.status.phase == "Pending"
    sched = pending.status.conditions[0]
    assert (sched.type, sched.status, sched.reason) == ("PodScheduled", "False", "Unschedulable")


def test_pod_disruption_target_condition_round_trips(api, ac):
    api.create(PODS, make_pod("ml", "victim", node="gpu-1", phase="Running", conditions=[
        pod_condition("PodScheduled", at=T0),
        disruption_target("PreemptionByScheduler", at=T0),
    ]))
    pod = client.CoreV1Api(ac).read_namespaced_pod("victim", "ml")
    dt = pod.status.conditions[1]
    assert (dt.type, dt.reason) == ("DisruptionTarget", "PreemptionByScheduler")
    assert dt.message == "default-scheduler: preempting to accommodate a higher priority pod"

    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(ac).read_namespaced_pod("nope", "ml")
    assert exc.value.status == 404


def test_namespaced_list_and_selectors(api, ac):
    api.create(PODS, make_pod("a", "p1", node="n1", labels={"team": "x", "tier": "gpu"}))
    api.create(PODS, make_pod("a", "p2", labels={"team": "y"}))
    api.create(PODS, make_pod("b", "p3", node="n1", labels={"team": "x"}))
    v1 = client.CoreV1Api(ac)

    assert [p.metadata.name for p in v1.list_namespaced_pod("a").items] == ["p1", "p2"]
    names = lambda **kw: [p.metadata.name for p in v1.list_pod_for_all_namespaces(**kw).items]  # noqa: E731
    assert names(label_selector="team=x") == ["p1", "p3"]
    assert names(label_selector="team=x,tier") == ["p1"]
    assert names(label_selector="team in (x,y),!tier") == ["p2", "p3"]
    assert names(label_selector="team!=x") == ["p2"]
    assert names(field_selector="spec.nodeName=n1") == ["p1", "p3"]
    assert names(field_selector="spec.nodeName=") == ["p2"]
    assert names(field_selector="status.phase=Running,metadata.namespace=b") == ["p3"]
    assert names(field_selector="spec.unknownField=zzz") == ["p1", "p2", "p3"]  # ignored


def test_pagination_is_a_consistent_snapshot(api, ac):
    for i in range(5):
        api.create(PODS, make_pod("ml", f"p{i}"))
    v1 = client.CoreV1Api(ac)

    page1 = v1.list_pod_for_all_namespaces(limit=2)
    assert [p.metadata.name for p in page1.items] == ["p0", "p1"]
    assert page1.metadata._continue and page1.metadata.remaining_item_count == 3
    api.create(PODS, make_pod("ml", "p5"))  # not in the snapshot the token refers to
    page2 = v1.list_pod_for_all_namespaces(limit=2, _continue=page1.metadata._continue)
    page3 = v1.list_pod_for_all_namespaces(limit=2, _continue=page2.metadata._continue)
    assert [p.metadata.name for p in page2.items + page3.items] == ["p2", "p3", "p4"]
    assert page3.metadata._continue is None
    assert page2.metadata.resource_version == page1.metadata.resource_version


def test_events_v1_and_core_events(api, ac):
    pod = api.create(PODS, make_pod("ml", "train-0", node="gpu-1"))
    preemptor = api.create(PODS, make_pod("ml", "urgent-0", node="gpu-1", priority=10000))
    api.create(EVENTS, make_event_v1(
        "ml", "train-0.18a1", pod, "Preempted", "Preempted by pod urgent-0 on node gpu-1",
        related=preemptor, event_time=T0))
    api.create(EVENTS, make_event_v1(
        "ml", "urgent-0.18a2", preemptor, "FailedScheduling",
        "0/8 nodes are available: 8 Insufficient nvidia.com/gpu.", type="Warning", event_time=T0))
    api.create(CORE_EVENTS, make_core_event(
        "ml", "train-0.18a3", pod, "Scheduled", "Successfully assigned ml/train-0 to gpu-1",
        first_timestamp=T0, count=2))

    evs = client.EventsV1Api(ac).list_event_for_all_namespaces().items
    preempted = evs[0]
    assert preempted.reason == "Preempted" and preempted.action == "Preempting"
    assert preempted.regarding.uid == pod["metadata"]["uid"]
    assert preempted.related.name == "urgent-0"
    assert preempted.event_time == T0 and preempted.reporting_controller == "default-scheduler"
    assert evs[1].type == "Warning"
    fs = client.EventsV1Api(ac).list_namespaced_event(
        "ml", field_selector="regarding.name=urgent-0,reason=FailedScheduling").items
    assert [e.metadata.name for e in fs] == ["urgent-0.18a2"]

    core = client.CoreV1Api(ac).list_event_for_all_namespaces(
        field_selector="involvedObject.name=train-0").items
    assert len(core) == 1
    assert core[0].involved_object.kind == "Pod" and core[0].count == 2
    assert core[0].first_timestamp == T0 and core[0].source.component == "default-scheduler"


def test_custom_object_workloads_list_shapes(api, ac):
    adm = {"clusterQueue": "gpu-cq", "podSetAssignments": [
        pod_set_assignment("main", {"nvidia.com/gpu": "a100"}, {"nvidia.com/gpu": "8"}, count=8)]}
    api.create(WORKLOADS_V1BETA2, make_workload(
        "ml", "job-train-1-abcde", "team-q", "high-prio", 1000,
        pod_sets=[make_pod_set("main", count=8)],
        conditions=[workload_condition("QuotaReserved", at=T0), workload_condition("Admitted", at=T0)],
        admission=adm, owner=("Job", "train-1")))
    api.create(WORKLOADS_V1BETA1, make_workload(
        "ml", "job-train-1-abcde", "team-q", "high-prio", 1000, version="v1beta1"))
    co = client.CustomObjectsApi(ac)

    lst = co.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloads")
    assert (lst["kind"], lst["apiVersion"]) == ("WorkloadList", "kueue.x-k8s.io/v1beta2")
    wl = lst["items"][0]
    assert wl["kind"] == "Workload"  # CR list items keep TypeMeta
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high-prio"}
    assert wl["status"]["admission"]["podSetAssignments"][0]["flavors"] == {"nvidia.com/gpu": "a100"}
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "Job"

    old = co.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", "ml", "workloads")["items"][0]
    assert old["spec"]["priorityClassName"] == "high-prio"
    assert old["spec"]["priorityClassSource"] == "kueue.x-k8s.io/workloadpriorityclass"
    assert co.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "other", "workloads")["items"] == []


# ---------------------------------------------------------------- watch


def test_watch_replays_then_streams_live_changes(api, ac):
    v1 = client.CoreV1Api(ac)
    api.create(PODS, make_pod("ml", "existing"))
    rv = v1.list_pod_for_all_namespaces().metadata.resource_version
    api.create(PODS, make_pod("ml", "p"))                      # before the watch: replayed
    api.create(EVENTS, make_event_v1("ml", "e", {"kind": "Pod", "name": "p"}, "Scheduled", "x"))  # other resource

    later_in_order(0.2, (api.patch, PODS, "ml", "p", {"spec": {"nodeName": "gpu-1"}, "status": {"phase": "Running"}}),
                   (api.delete, PODS, "ml", "p"))

    w = watch.Watch()
    seen = []
    for ev in w.stream(v1.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=5):
        seen.append((ev["type"], ev["object"].metadata.name, ev["object"].spec.node_name))
        if ev["type"] == "DELETED":
            w.stop()
    assert seen == [("ADDED", "p", None), ("MODIFIED", "p", "gpu-1"), ("DELETED", "p", "gpu-1")]
    assert isinstance(ev["object"], client.V1Pod)
    assert w.resource_version == api.resource_version


def test_watch_without_resource_version_starts_with_current_state(api, ac):
    api.create(PODS, make_pod("ml", "a"))
    api.create(PODS, make_pod("ml", "b"))
    w = watch.Watch()
    names = []
    for ev in w.stream(client.CoreV1Api(ac).list_namespaced_pod, "ml", timeout_seconds=5):
        names.append((ev["type"], ev["object"].metadata.name))
        if len(names) == 2:
            w.stop()
    assert names == [("ADDED", "a"), ("ADDED", "b")]


def test_watch_label_selector_transitions(api, ac):
    rv = api.resource_version
    api.create(PODS, make_pod("ml", "p", labels={"gpu": "yes"}))
    api.patch(PODS, "ml", "p", {"metadata": {"labels": {"gpu": "no"}}})   # leaves the selector
    api.patch(PODS, "ml", "p", {"metadata": {"labels": {"gpu": "yes"}}})  # re-enters it
    w = watch.Watch()
    types = []
    for ev in w.stream(client.CoreV1Api(ac).list_pod_for_all_namespaces, resource_version=rv,
                       label_selector="gpu=yes", timeout_seconds=5):
        types.append(ev["type"])
        if len(types) == 3:
            w.stop()
    assert types == ["ADDED", "DELETED", "ADDED"]


def test_watch_bookmarks_on_demand_and_periodic(ac):
    with FakeKubeApi(bookmark_interval=0.2) as api, api.api_client() as bac:
        v1 = client.CoreV1Api(bac)
        rv = api.resource_version
        api.create(PODS, make_pod("ml", "p"))  # replayed from rv when the watch opens, before any bookmark
        w = watch.Watch()
        seen = []
        for ev in w.stream(v1.list_pod_for_all_namespaces, resource_version=rv,
                           allow_watch_bookmarks=True, timeout_seconds=5):
            seen.append(ev["type"])
            if ev["type"] == "BOOKMARK":
                obj = ev["raw_object"]
                assert obj["kind"] == "Pod" and obj["apiVersion"] == "v1"
                assert obj["metadata"]["resourceVersion"] == api.resource_version
                w.stop()
        assert seen == ["ADDED", "BOOKMARK"]

    # On demand, and never to watches that did not ask for bookmarks.
    with FakeKubeApi() as api, api.api_client() as bac:
        v1 = client.CoreV1Api(bac)
        api.create(PODS, make_pod("ml", "q"))
        rv = api.resource_version
        w = watch.Watch()
        when_watching(api, api.send_bookmark, PODS)
        seen = []
        for ev in w.stream(v1.list_pod_for_all_namespaces, resource_version=rv,
                           allow_watch_bookmarks=True, timeout_seconds=5):
            seen.append(ev["type"])
            assert ev["raw_object"]["metadata"]["resourceVersion"] == rv
            assert w.resource_version == rv
            w.stop()
        assert seen == ["BOOKMARK"]  # it came, before the 5 s server-side timeout ended the stream

        deadline = time.monotonic() + 5  # the first watch's session ends on the server, so the
        while api.open_watches() and time.monotonic() < deadline:  # next bookmark reaches only the second
            time.sleep(0.01)
        assert api.open_watches() == 0
        when_watching(api, api.send_bookmark)
        events = list(watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=rv,
                                           timeout_seconds=1))
        assert events == []  # bookmark suppressed, stream ended at the server-side timeout


def test_watch_too_old_resource_version_raises_410(api, ac):
    v1 = client.CoreV1Api(ac)
    old_rv = api.resource_version
    api.create(PODS, make_pod("ml", "p"))
    compacted = api.compact()

    # With timeout_seconds the client does not retry: the ERROR event raises.
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=old_rv, timeout_seconds=1))
    assert exc.value.status == 410
    assert exc.value.reason == f"Expired: too old resource version: {old_rv} ({compacted})"

    # Without it, the client retries once from the same rv, then raises.
    api.clear_requests()
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=old_rv))
    assert exc.value.status == 410
    assert len(api.requests_to("/api/v1/pods", watch=True)) == 2

    # Watching from the compaction point itself is fine.
    later(0.1, api.delete, PODS, "ml", "p")
    w = watch.Watch()
    for ev in w.stream(v1.list_pod_for_all_namespaces, resource_version=compacted, timeout_seconds=5):
        assert ev["type"] == "DELETED"
        w.stop()


def test_watch_custom_object_workloads(api, ac):
    co = client.CustomObjectsApi(ac)
    rv = co.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloads")["metadata"]["resourceVersion"]
    later_in_order(0.1, (api.create, WORKLOADS_V1BETA2, make_workload("ml", "wl-1")),
                   (api.patch, WORKLOADS_V1BETA2, "ml", "wl-1", {"status": {"conditions": [
                       workload_condition("Evicted", reason="Preempted", message="Preempted to accommodate a workload "
                                          "(UID: x, JobUID: y) due to prioritization in the ClusterQueue")]}}))
    w = watch.Watch()
    seen = []
    for ev in w.stream(co.list_cluster_custom_object, "kueue.x-k8s.io", "v1beta2", "workloads",
                       resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=5):
        seen.append(ev)
        if len(seen) == 2:
            w.stop()
    assert [e["type"] for e in seen] == ["ADDED", "MODIFIED"]
    assert isinstance(seen[1]["object"], dict)  # custom objects stay dicts
    assert seen[1]["object"]["status"]["conditions"][0]["reason"] == "Preempted"
    assert w.resource_version == seen[1]["object"]["metadata"]["resourceVersion"]
    assert api.requests[-1].path == "/apis/kueue.x-k8s.io/v1beta2/workloads"


def test_watch_ends_at_server_timeout(api, ac):
    t0 = time.monotonic()
    events = list(watch.Watch().stream(client.CoreV1Api(ac).list_pod_for_all_namespaces,
                                       resource_version=api.resource_version, timeout_seconds=1))
    assert events == []
    assert 0.9 < time.monotonic() - t0 < 3


# ---------------------------------------------------------------- faults


def test_fail_next_returns_status_errors_then_recovers(api, ac):
    v1 = client.CoreV1Api(ac)
    api.fail_next(2, status=500)
    for _ in range(2):
        with pytest.raises(ApiException) as exc:
            v1.list_pod_for_all_namespaces()
        assert exc.value.status == 500
        assert '"reason":"InternalError"' in exc.value.body
    assert v1.list_pod_for_all_namespaces().items == []

    api.fail_next(1, status=429, path="/apis/events.k8s.io")
    assert v1.list_pod_for_all_namespaces().items == []  # other paths unaffected
    with pytest.raises(ApiException) as exc:
        watch.Watch().stream(client.EventsV1Api(ac).list_event_for_all_namespaces,
                             timeout_seconds=1).__next__()
    assert exc.value.status == 429
    log = api.requests
    assert [(r.method, r.path) for r in log[:3]] == [("GET", "/api/v1/pods")] * 3
    assert log[-1].query["watch"] == "true" and log[-1].is_watch


def _watch_in_thread(v1, rv):
    out: dict = {"events": []}

    def run():
        try:
            for ev in watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=rv,
                                           timeout_seconds=10):
                out["events"].append(ev["type"])
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_drop_watches_abrupt_and_graceful(api, ac):
    v1 = client.CoreV1Api(ac)
    rv = api.resource_version
    api.create(PODS, make_pod("ml", "p"))

    t, out = _watch_in_thread(v1, rv)
    api.wait_for_watches(1, PODS)
    assert api.drop_watches() == 1
    t.join(5)
    assert not t.is_alive()
    assert out["events"] == ["ADDED"]
    # A truncated chunked body: urllib3 reports the broken connection.
    assert isinstance(out["error"], urllib3.exceptions.ProtocolError)

    t, out = _watch_in_thread(v1, rv)
    api.wait_for_watches(1, PODS)
    assert api.drop_watches(graceful=True) == 1
    t.join(5)
    assert not t.is_alive()
    assert out == {"events": ["ADDED"]}  # clean end: the generator just finishes
    assert api.open_watches() == 0


def test_stop_ends_open_watches(ac):
    api = FakeKubeApi().start()
    bac = api.api_client()
    t, out = _watch_in_thread(client.CoreV1Api(bac), api.resource_version)
    api.wait_for_watches(1)
    t0 = time.monotonic()
    api.stop()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 3
    bac.close()


def test_label_values_the_real_api_server_refuses_are_refused(api, ac):
    """The real API server refuses a label value with ':' (MLflow's ``model:version``), on a pod or a
    Job's template (tests/real_cluster/test_alerting.py shows it); so does the double."""
    bad = make_pod("ml", "bad", created=T0, labels={"gpuledger.io/release-id": "fraud-detector:7"})
    with pytest.raises(ValueError, match="a valid label must be"):
        api.create(PODS, bad)
    too_long = make_pod("ml", "long", created=T0, labels={"gpuledger.io/release-id": "r" * 64})
    with pytest.raises(ValueError, match="no more than 63 characters"):
        api.create(PODS, too_long)
    # As an annotation the same id is fine (annotations have no value syntax).
    ok = make_pod("ml", "ok", created=T0, labels={"gpuledger.io/release-id": "fraud-detector-7"})
    ok["metadata"].setdefault("annotations", {})["gpuledger.io/release-id"] = "fraud-detector:7"
    api.create(PODS, ok)
    assert [p.metadata.name for p in client.CoreV1Api(ac).list_namespaced_pod("ml").items] == ["ok"]
