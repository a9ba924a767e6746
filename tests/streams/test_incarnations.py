"""A reused pod name (a StatefulSet's ``ml/srv-0`` deleted and created again) is two incarnations
of one pod entity, told apart by the pod uid the scheduler events carry: the rows, allocations and
GPU holders of each take the identity of the incarnation they belong to, in any processing order
(an exploratory review: the second incarnation's release and uid rewrote the first one's history)."""

import random

import pytest

from tests.streams.harness import Driver, alert, gpu_event, pod_event, release

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
RELEASES = [release("release.registered", 0, rid="srv-1", model="srv", version="1", digest=D1),
            release("release.promoted", 1, rid="srv-1", model="srv", version="1", digest=D1, to_environment="prod"),
            release("release.registered", 100, rid="srv-2", model="srv", version="2", digest=D2),
            release("release.promoted", 101, rid="srv-2", model="srv", version="2", digest=D2, to_environment="prod")]
WL = "ml/StatefulSet/srv"


def first(etype, minutes, **kw):
    return pod_event(etype, minutes, pod="srv-0", workload=WL, node="node-2", release_id="srv-1", pod_uid="u1", **kw)


def second(etype, minutes, **kw):
    return pod_event(etype, minutes, pod="srv-0", workload=WL, node="node-3", release_id="srv-2", pod_uid="u2", **kw)


# Minutes after 08:00 — read 240 as 12:00: the first incarnation holds node-2/GPU-YYYY 12:00–13:00 and is
# deleted; the second, created at 13:02, holds node-3/GPU-ZZZZ from 13:05. Alerts at 12:30 name the pod,
# and node-2/GPU-YYYY.
SCENARIO = [*RELEASES,
            first("scheduler.scheduled", 238), first("scheduler.running", 239),
            gpu_event("gpu.assigned", 240, pod="srv-0", node="node-2", device="GPU-YYYY"),
            alert(270, fp="by-pod", namespace="ml", pod="srv-0"),
            alert(270, fp="by-gpu", node="node-2", gpu_id="GPU-YYYY"),
            gpu_event("gpu.released", 300, pod="srv-0", node="node-2", device="GPU-YYYY"),
            first("scheduler.deleted", 300),
            alert(301, fp="between", namespace="ml", pod="srv-0"),  # after the first's deletion, before the second exists
            pod_event("scheduler.queued", 302, pod="srv-0", workload=WL, node=None, pod_uid="u2"),
            alert(303, fp="second-starting", namespace="ml", pod="srv-0"),  # the second's, once its queued event is told
            second("scheduler.scheduled", 304), second("scheduler.running", 304.5),
            gpu_event("gpu.assigned", 305, pod="srv-0", node="node-3", device="GPU-ZZZZ"),
            alert(330, fp="later-pod", namespace="ml", pod="srv-0"),
            alert(330, fp="later-gpu", node="node-3", gpu_id="GPU-ZZZZ")]


def _check(d: Driver) -> None:
    rows = {r.correlation_id: r for r in d.rows.values()}
    by_type = {}
    for r in rows.values():
        by_type.setdefault((r.event_type, r.occurred_at.isoformat()), r)
    alerts = {r.identity.alert_fingerprint: r for r in rows.values() if r.event_type.startswith("alert.")}
    for fp in ("by-pod", "by-gpu", "between"):
        a = alerts[fp]
        assert (a.identity.release_id, a.identity.pod_uid) == ("srv-1", "u1"), (fp, a.identity)
        assert a.identity.node == "node-2", (fp, a.identity)
    for fp in ("later-pod", "later-gpu", "second-starting"):
        a = alerts[fp]
        assert (a.identity.release_id, a.identity.pod_uid, a.identity.node) == ("srv-2", "u2", "node-3"), (fp, a.identity)
    gpu_rows = sorted((r for r in rows.values() if r.event_type.startswith("gpu.")), key=lambda r: r.occurred_at)
    assert [(r.event_type, r.identity.gpu_id, r.identity.release_id, r.identity.pod_uid) for r in gpu_rows] == [
        ("gpu.assigned", "GPU-YYYY", "srv-1", "u1"), ("gpu.released", "GPU-YYYY", "srv-1", "u1"),
        ("gpu.assigned", "GPU-ZZZZ", "srv-2", "u2")]
    sched = [r for r in rows.values() if r.event_type.startswith("scheduler.")]
    assert {(r.identity.pod_uid, r.identity.release_id) for r in sched} == {("u1", "srv-1"), ("u2", "srv-2")}
    allocs = sorted(d.allocations.values(), key=lambda a: a.started_at)
    assert [(a.node, a.gpu_id, a.identity.pod_uid, a.identity.release_id, a.attribution, a.end_reason) for a in allocs] == [
        ("node-2", "GPU-YYYY", "u1", "srv-1", "release_label", "released"),
        ("node-3", "GPU-ZZZZ", "u2", "srv-2", "release_label", None)]
    # What the GPUs were told of their holders (``trace --release srv-1`` reads these): each its incarnation's.
    for gpu, rid in (("gpu:node-2/GPU-YYYY", "srv-1"), ("gpu:node-3/GPU-ZZZZ", "srv-2")):
        [link] = d.entities[gpu]["links"].values()
        assert [(iv["identity"]["release_id"], iv["identity"].get("pod_uid")) for iv in link["intervals"]] == [(rid, "u1" if rid == "srv-1" else "u2")]
    assert d.conflicts == 0


def test_a_reused_pod_name_keeps_each_incarnations_identity_in_event_order():
    _check(Driver().feed(SCENARIO).flush_parked())


@pytest.mark.parametrize("seed", range(16))
def test_a_reused_pod_name_keeps_each_incarnations_identity_in_any_order(seed):
    reference = Driver().feed(SCENARIO).flush_parked()
    order = list(SCENARIO)
    random.Random(seed).shuffle(order)
    if seed % 4 == 0:  # re-deliveries change nothing
        order += order[: len(order) // 3]
    d = Driver(seed=seed).feed(order).flush_parked()
    _check(d)
    assert d.latest(versions=True) == reference.latest(versions=True)
    assert d.latest_allocations(versions=True) == reference.latest_allocations(versions=True)
    assert d.conflicts == 0, "a content change without a version change"


def test_one_incarnation_is_the_pod_as_before_and_a_second_one_lowers_no_version():
    """A pod name with one uid resolves as a pod always did (no ``Incarnations``: the same rows and
    versions — tests/streams/test_entities.py and an A/B over random single-uid pods against the code
    before); the second uid arriving re-derives the first one's rows at higher versions, never lower."""
    from streams.correlate.entities import _facts_and_runs

    firsts = [e for e in SCENARIO if e.event_type.startswith("release.") or e.occurred_at.hour < 13]  # 08:00 + 300 min
    d = Driver().feed(firsts).flush_parked()
    assert _facts_and_runs(d.entities["pod:ml/srv-0"])[3] is None
    before = d.latest(versions=True)
    allocs = d.latest_allocations(versions=True)
    d.feed([e for e in SCENARIO if e not in firsts]).flush_parked()
    assert _facts_and_runs(d.entities["pod:ml/srv-0"])[3] is not None
    after = d.latest(versions=True)
    for cid, row in before.items():
        assert after[cid]["version"] >= row["version"]
        assert after[cid]["identity"]["release_id"] == row["identity"]["release_id"] == "srv-1" or row["event_type"].startswith("release.")
    for aid, alloc in allocs.items():
        assert d.latest_allocations(versions=True)[aid]["version"] >= alloc["version"]
    assert d.conflicts == 0
