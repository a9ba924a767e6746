"""Join rules under disorder, with the in-memory driver (same functions as the worker)."""

import random

import orjson
import pytest

from streams.correlate.entities import iso
from streams.correlate.routing import routed_event

from tests.streams.harness import Driver, alert, at, claim_event, dra_device, gpu_event, pod_event, release

DIGEST_R1 = "sha256:" + "b" * 64
RELEASES = [release("release.registered", 0), release("release.approved", 1, actor="alice"),
            release("release.promoted", 2, to_environment="prod")]


def test_gpu_assignment_before_the_pods_scheduler_event_is_parked_then_attributed():
    d = Driver().feed([*RELEASES, gpu_event("gpu.assigned", 10)])
    assert d.rows == {} or all(r.event_type.startswith("release.") for r in d.rows.values())  # parked, not emitted
    [alloc] = d.allocations.values()
    assert alloc.attribution == "unattributed" and alloc.identity.release_id is None
    d.feed([pod_event("scheduler.scheduled", 9, release_id="r1")])
    gpu_row = next(r for r in d.rows.values() if r.event_type == "gpu.assigned")
    assert gpu_row.identity.release_id == "r1" and gpu_row.identity.workload_id == "ml/Job/train"
    [alloc] = d.allocations.values()
    assert alloc.identity.release_id == "r1" and alloc.identity.model_version == "7" and alloc.ended_at is None


def test_alert_before_the_release_is_attributed_when_the_release_arrives():
    d = Driver().feed([alert(15, fp="q1", release_id="r1")])
    assert "q1" not in {r.identity.alert_fingerprint for r in d.rows.values()}  # parked
    d.feed(RELEASES)
    row = next(r for r in d.rows.values() if r.identity.alert_fingerprint == "q1")
    assert row.attribution == "release_label" and row.identity.artifact_digest == "sha256:" + "a" * 64
    assert row.release_state == "release.promoted"


def test_missing_release_label_falls_back_to_image_digest():
    d = Driver().feed([*RELEASES, pod_event("scheduler.running", 12, pod="p2", digest=DIGEST_R1), alert(14, fp="q2", namespace="ml", pod="p2")])
    row = next(r for r in d.rows.values() if r.identity.alert_fingerprint == "q2")
    assert row.attribution == "image_digest_match" and row.identity.release_id == "r1"


def test_two_releases_of_one_model_in_different_environments():
    staging = [release("release.registered", 0, rid="r-stg", env="staging", digest="sha256:" + "c" * 64),
               release("release.promoted", 3, rid="r-stg", env="staging", digest="sha256:" + "c" * 64, to_environment="staging")]
    d = Driver().feed([*RELEASES, *staging,
                       alert(20, fp="prod-alert", model_name="m", model_version="7", environment="prod"),
                       alert(21, fp="stg-alert", model_name="m", model_version="7", environment="staging"),
                       pod_event("scheduler.running", 22, ns="stg", pod="s1", digest="sha256:" + "c" * 64)])
    by_fp = {r.identity.alert_fingerprint: r for r in d.rows.values() if r.event_type.startswith("alert.")}
    assert by_fp["prod-alert"].identity.release_id == "r1" and by_fp["prod-alert"].attribution == "model_version_match"
    assert by_fp["stg-alert"].identity.release_id == "r-stg"
    pod_row = next(r for r in d.rows.values() if r.identity.pod == "s1")
    assert pod_row.identity.release_id == "r-stg" and pod_row.attribution == "image_digest_match"


def test_pod_rescheduled_to_another_node_has_two_intervals():
    d = Driver().feed([*RELEASES, pod_event("scheduler.scheduled", 5, release_id="r1"),
                       gpu_event("gpu.assigned", 6, node="n1", device="GPU-AAAA"), gpu_event("gpu.released", 30, node="n1", device="GPU-AAAA"),
                       pod_event("scheduler.scheduled", 31, node="n2", release_id="r1"), gpu_event("gpu.assigned", 32, node="n2", device="GPU-BBBB")])
    allocs = sorted(d.allocations.values(), key=lambda a: a.started_at)
    assert [(a.node, a.gpu_id) for a in allocs] == [("n1", "GPU-AAAA"), ("n2", "GPU-BBBB")]
    assert allocs[0].ended_at is not None and allocs[0].end_reason == "released" and allocs[1].ended_at is None
    assert {a.identity.release_id for a in allocs} == {"r1"}


def test_pod_deletion_closes_its_intervals():
    d = Driver().feed([*RELEASES, pod_event("scheduler.scheduled", 5, release_id="r1"), gpu_event("gpu.assigned", 6),
                       pod_event("scheduler.deleted", 40, release_id="r1")])
    [alloc] = d.allocations.values()
    assert alloc.end_reason == "pod_deleted" and alloc.ended_at.isoformat().startswith("2026-11-01T08:40")


def test_gpu_alert_goes_to_who_held_the_gpu_when_it_started():
    other = [release("release.registered", 0, rid="r2", model="n", version="1", digest="sha256:" + "d" * 64)]
    d = Driver().feed([*RELEASES, *other,
                       pod_event("scheduler.scheduled", 5, pod="old", release_id="r1"), gpu_event("gpu.assigned", 6, pod="old", device="GPU-X"),
                       gpu_event("gpu.released", 20, pod="old", device="GPU-X"),
                       pod_event("scheduler.scheduled", 21, pod="new", release_id="r2"), gpu_event("gpu.assigned", 22, pod="new", device="GPU-X"),
                       # processed after the GPU changed hands, but it started while "old" held it
                       alert(15, fp="xid", node="n1", gpu_id="GPU-X"), alert(25, fp="xid2", node="n1", gpu_id="GPU-X")])
    by_fp = {r.identity.alert_fingerprint: r for r in d.rows.values() if r.event_type.startswith("alert.")}
    assert by_fp["xid"].identity.release_id == "r1" and by_fp["xid"].identity.pod == "old"
    assert by_fp["xid"].attribution == "gpu_assignment"
    assert by_fp["xid2"].identity.release_id == "r2" and by_fp["xid2"].identity.pod == "new"


def test_workload_events_get_the_release_of_their_pods():
    from tests.streams.harness import SRC, at
    from schemas import Identity, SchedulerEvent, make_event_id
    from schemas.scheduler import SchedulerPayload

    admitted = SchedulerEvent(event_id=make_event_id("t", ("wl", "admitted")), event_type="scheduler.admitted", occurred_at=at(4),
                              observed_at=at(4), source=SRC, identity=Identity(workload_id="ml/Job/train"),
                              payload=SchedulerPayload(object_kind="Workload", queue="q"))
    d = Driver().feed([admitted, *RELEASES, pod_event("scheduler.scheduled", 5, digest=DIGEST_R1)])
    row = d.rows[admitted.event_id]
    assert row.identity.release_id == "r1" and row.attribution == "workload_release"


def test_unresolvable_rows_are_emitted_unattributed_after_expiry_never_dropped():
    d = Driver().feed([alert(5, fp="orphan")])
    assert not d.rows
    d.flush_parked()
    [row] = d.rows.values()
    assert row.attribution == "unattributed" and row.identity.alert_fingerprint == "orphan"
    # late identity still re-attributes an expired row
    d2 = Driver().feed([pod_event("scheduler.running", 1, pod="late"), alert(5, fp="q", namespace="ml", pod="late")]).flush_parked()
    first = next(r for r in d2.rows.values() if r.identity.alert_fingerprint == "q")
    assert first.attribution == "unattributed"
    d2.feed([pod_event("scheduler.running", 6, pod="late", release_id="r1"), *RELEASES])
    again = next(r for r in d2.rows.values() if r.identity.alert_fingerprint == "q")
    assert again.version > first.version and again.identity.release_id == "r1"


SCENARIO = [*RELEASES, release("release.rolled_back", 50), release("release.registered", 0, rid="r2", model="n", version="1", digest="sha256:" + "d" * 64),
            pod_event("scheduler.scheduled", 5, pod="a", release_id="r1"), gpu_event("gpu.assigned", 6, pod="a", device="GPU-1"),
            pod_event("scheduler.running", 7, pod="b", digest=DIGEST_R1), gpu_event("gpu.assigned", 8, pod="b", device="GPU-2"),
            gpu_event("gpu.released", 30, pod="a", device="GPU-1"), pod_event("scheduler.scheduled", 31, pod="c", release_id="r2"),
            gpu_event("gpu.assigned", 32, pod="c", device="GPU-1"), alert(20, fp="x1", node="n1", gpu_id="GPU-1"),
            alert(40, fp="x2", node="n1", gpu_id="GPU-1"), alert(41, fp="q", namespace="ml", pod="b"),
            alert(45, fp="m", model_name="m", model_version="7", environment="prod"), pod_event("scheduler.deleted", 60, pod="b")]


def test_any_processing_order_yields_the_same_latest_rows_and_versions():
    reference = Driver().feed(SCENARIO).flush_parked()
    ref_rows, ref_allocs = reference.latest(versions=True), reference.latest_allocations(versions=True)
    assert len(ref_rows) == len(SCENARIO) and len(ref_allocs) == 3
    assert reference.conflicts == 0
    for seed in range(24):
        order = list(SCENARIO)
        random.Random(seed).shuffle(order)
        if seed % 3 == 0:  # re-deliveries (a crash replays part of the input) change nothing
            order += order[: len(order) // 2]
        d = Driver(seed=seed).feed(order).flush_parked()
        got = d.latest(versions=True)
        assert {cid: got[cid] for cid in ref_rows} == ref_rows and len(got) == len(reference.latest()), f"seed {seed}"
        assert d.latest_allocations(versions=True) == ref_allocs, f"seed {seed}"
        assert d.conflicts == 0, f"seed {seed}: a content change without a version change"


def _busy_gpu() -> list:
    """One GPU held by 30 pods in turn (some released, some of another release, one whose
    release label is corrected) with 45 alerts on it, two of them before anyone held it."""
    events = [*RELEASES, release("release.registered", 0, rid="r2", model="n", version="1", digest="sha256:" + "d" * 64)]
    for i in range(30):
        pod = f"b{i}"
        events += [pod_event("scheduler.scheduled", 10 + 3 * i, pod=pod, release_id="r2" if i % 4 == 0 else "r1"),
                   gpu_event("gpu.assigned", 11 + 3 * i, pod=pod, device="GPU-9")]
        if i % 3 == 0:
            events.append(gpu_event("gpu.released", 12 + 3 * i, pod=pod, device="GPU-9"))
    # b7 was first scheduled under a release label its next event corrects: the GPU keeps its interest
    # in r3 (its rows' versions count every release b7's rows named: ``named_values``, ``_iv_rids``)
    events += [pod_event("scheduler.queued", 30, pod="b7", release_id="r3"), pod_event("scheduler.running", 33, pod="b7", release_id="r1")]
    events += [alert(5 + 2 * j, fp=f"x{j}", node="n1", gpu_id="GPU-9") for j in range(45)]
    return events


def test_a_busy_gpu_derives_the_same_rows_incrementally_as_in_full(monkeypatch):
    """The worker's GpuMemo looks only at the rows that may have changed (new, parked, at or
    after a changed link's start): under any order and batching it emits exactly what
    re-deriving every row every time emits — rows, versions and the entity's interests."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", False)  # the worker's path: the memo really skips
    events = _busy_gpu()
    reference = Driver(memos=False).feed(events).flush_parked()
    ref_rows = reference.latest(versions=True)
    xids = [r for r in ref_rows.values() if r["event_type"] == "alert.firing"]
    assert len(xids) == 45 and {r["attribution"] for r in xids} == {"gpu_assignment", "unattributed"}
    assert {r["identity"]["release_id"] for r in xids if r["identity"].get("release_id")} == {"r1", "r2"}
    for seed in range(12):
        order = list(events)
        random.Random(seed).shuffle(order)
        d = Driver(seed=seed).feed(order).flush_parked()
        got = d.latest(versions=True)
        assert {cid: got[cid] for cid in ref_rows} == ref_rows and len(got) == len(reference.latest()), f"seed {seed}"
        # (r3 too: b7's first label — a holder names every release its pod's rows named, ``_iv_rids``)
        assert d.entities["gpu:n1/GPU-9"]["interests"] == reference.entities["gpu:n1/GPU-9"]["interests"] == ["rid:r1", "rid:r2", "rid:r3"]


# --- physical GPU vs. MIG slice vs. time-slicing share (#13.2) -------------------------------------

GPU_P = "GPU-5a1e0000-0000-0000-0000-00000000aaaa"
MIG_A, MIG_B = "MIG-0b7c0000-0000-0000-0000-0000000000a1", "MIG-0b7c0000-0000-0000-0000-0000000000b2"
MIG_RES = "nvidia.com/mig-1g.10gb"
R2 = [release("release.registered", 0, rid="r2", model="n", version="1", digest="sha256:" + "d" * 64)]
SLICES = [*RELEASES, *R2,
          # two time-slicing shares of GPU_P on n1, held by two pods of two releases
          pod_event("scheduler.scheduled", 5, pod="s1", release_id="r1"), gpu_event("gpu.assigned", 6, pod="s1", device=f"{GPU_P}::0"),
          pod_event("scheduler.scheduled", 5, pod="s2", release_id="r2"), gpu_event("gpu.assigned", 6, pod="s2", device=f"{GPU_P}::1"),
          # two MIG slices of GPU_Q on n2 (MIG UUIDs: the parent is not in the id)
          pod_event("scheduler.scheduled", 5, pod="m1", node="n2", release_id="r1"),
          gpu_event("gpu.assigned", 6, pod="m1", node="n2", device=MIG_A, resource=MIG_RES),
          pod_event("scheduler.scheduled", 5, pod="m2", node="n2", release_id="r2"),
          gpu_event("gpu.assigned", 6, pod="m2", node="n2", device=MIG_B, resource="nvidia.com/mig-3g.40gb"),
          # dcgm-exporter with pod mapping: the slice's metrics name the physical GPU, GPU_I_ID and the pod
          alert(8, fp="m1-temp", namespace="ml", pod="m1", node="n2", gpu_id="GPU-Q",
                labels={"UUID": "GPU-Q", "GPU_I_ID": "7", "GPU_I_PROFILE": "1g.10gb"}),
          alert(8, fp="m2-temp", namespace="ml", pod="m2", node="n2", gpu_id="GPU-Q",
                labels={"UUID": "GPU-Q", "GPU_I_ID": "2", "GPU_I_PROFILE": "3g.40gb"}),
          # an XID on the physical GPUs, without pod labels
          alert(20, fp="xid-p", node="n1", gpu_id=GPU_P, labels={"UUID": GPU_P}),
          alert(20, fp="xid-q", node="n2", gpu_id="GPU-Q", labels={"UUID": "GPU-Q"}),
          # a MIG instance's own alert, named by its parent and GPU_I_ID
          alert(21, fp="gi-7", node="n2", gpu_id="GPU-Q", labels={"UUID": "GPU-Q", "GPU_I_ID": "7", "GPU_I_PROFILE": "1g.10gb"})]


def test_alert_on_a_physical_gpu_reaches_the_holders_of_its_shares_and_slices():
    d = Driver().feed(SLICES).flush_parked()
    allocs = {a.pod: a for a in d.allocations.values()}
    assert allocs["s1"].gpu == GPU_P and allocs["s2"].gpu == GPU_P
    # learned from the pods' own DCGM alerts: MIG UUID -> the physical GPU
    assert (allocs["m1"].gpu, allocs["m1"].mig_instance) == ("GPU-Q", MIG_A) and allocs["m2"].gpu == "GPU-Q"
    gpu_links = d.entities[f"gpu:n1/{GPU_P}"]["links"]
    assert sorted(iv["slice"] for link in gpu_links.values() for iv in link["intervals"]) == [f"{GPU_P}::0", f"{GPU_P}::1"]
    by_fp = {r.identity.alert_fingerprint: r for r in d.rows.values() if r.event_type.startswith("alert.")}
    # held by two pods of two releases: the row names what they share, the release only if common
    assert by_fp["xid-p"].identity.node == "n1" and by_fp["xid-p"].identity.release_id is None
    assert by_fp["xid-p"].identity.namespace == "ml" and by_fp["xid-p"].identity.pod is None
    assert by_fp["xid-p"].attribution == "gpu_shared"  # joined to both holders, emitted without waiting
    assert Driver().feed(SLICES).rows[by_fp["xid-p"].correlation_id].attribution == "gpu_shared"  # not parked
    # the instance's alert reaches exactly that slice's holder
    assert by_fp["gi-7"].identity.pod == "m1" and by_fp["gi-7"].identity.release_id == "r1"
    assert by_fp["gi-7"].attribution == "gpu_assignment" and by_fp["gi-7"].identity.gpu_id == "GPU-Q"


def test_instance_alert_matches_by_profile_where_the_instance_id_is_unknown():
    events = [*RELEASES, pod_event("scheduler.scheduled", 5, pod="m1", node="n2", release_id="r1"),
              gpu_event("gpu.assigned", 6, pod="m1", node="n2", device=f"MIG-GPU-Q/7/0", resource=MIG_RES),
              alert(21, fp="gi", node="n2", gpu_id="GPU-Q", labels={"UUID": "GPU-Q", "GPU_I_ID": "7", "GPU_I_PROFILE": "1g.10gb"}),
              alert(22, fp="other-gi", node="n2", gpu_id="GPU-Q", labels={"UUID": "GPU-Q", "GPU_I_ID": "3", "GPU_I_PROFILE": "7g.80gb"})]
    d = Driver().feed(events).flush_parked()
    by_fp = {r.identity.alert_fingerprint: r for r in d.rows.values() if r.event_type.startswith("alert.")}
    assert by_fp["gi"].identity.pod == "m1" and by_fp["gi"].identity.release_id == "r1"
    assert by_fp["other-gi"].attribution == "unattributed" and by_fp["other-gi"].identity.pod is None


def assert_order_independent(events: list, allocations: int, seeds: int = 16) -> None:
    """Shuffled (and partly re-delivered) processing yields the reference's latest rows,
    allocations and versions, with no content change that a version did not announce."""
    reference = Driver().feed(events).flush_parked()
    ref_rows, ref_allocs = reference.latest(versions=True), reference.latest_allocations(versions=True)
    assert len(ref_allocs) == allocations and reference.conflicts == 0
    for seed in range(seeds):
        order = list(events)
        random.Random(seed).shuffle(order)
        if seed % 4 == 0:
            order += order[: len(order) // 3]
        d = Driver(seed=seed).feed(order).flush_parked()
        got = d.latest(versions=True)
        assert {cid: got[cid] for cid in ref_rows} == ref_rows and len(got) == len(reference.latest()), f"seed {seed}"
        assert d.latest_allocations(versions=True) == ref_allocs, f"seed {seed}"
        assert d.conflicts == 0, f"seed {seed}: a content change without a version change"


def test_slice_joins_are_the_same_in_any_processing_order():
    assert_order_independent(SLICES, allocations=4)


# --- DRA devices (#13.3) ----------------------------------------------------------------------------

DRA = "gpu.nvidia.com"
DRA_EVENTS = [*RELEASES, *R2,
              dra_device(0, pool="n1", device="gpu-0", uuid=GPU_P),
              dra_device(0, pool="n1", device="gpu-1-mig-1g10gb-0", uuid=MIG_A, parent="GPU-Q", profile="1g.10gb"),
              pod_event("scheduler.scheduled", 5, pod="d1", release_id="r1"),
              gpu_event("gpu.assigned", 6, pod="d1", device=f"{DRA}/n1/gpu-0", resource=DRA),
              pod_event("scheduler.scheduled", 5, pod="d2", release_id="r2"),
              gpu_event("gpu.assigned", 6, pod="d2", device=f"{DRA}/n1/gpu-1-mig-1g10gb-0", resource=DRA),
              alert(20, fp="xid-whole", node="n1", gpu_id=GPU_P, labels={"UUID": GPU_P}),
              alert(21, fp="xid-mig", node="n1", gpu_id="GPU-Q", labels={"UUID": "GPU-Q", "GPU_I_ID": "1", "GPU_I_PROFILE": "1g.10gb"})]


def test_dra_devices_are_attributed_like_device_plugin_ones():
    d = Driver().feed(DRA_EVENTS).flush_parked()
    allocs = {a.pod: a for a in d.allocations.values()}
    assert (allocs["d1"].gpu, allocs["d1"].mig_instance) == (GPU_P, None)
    assert (allocs["d2"].gpu, allocs["d2"].mig_instance) == ("GPU-Q", MIG_A)
    by_fp = {r.identity.alert_fingerprint: r for r in d.rows.values() if r.event_type.startswith("alert.")}
    assert (by_fp["xid-whole"].identity.pod, by_fp["xid-whole"].identity.release_id, by_fp["xid-whole"].attribution) == ("d1", "r1", "gpu_assignment")
    assert (by_fp["xid-mig"].identity.pod, by_fp["xid-mig"].identity.release_id) == ("d2", "r2")


def test_dra_joins_are_the_same_in_any_processing_order():
    assert_order_independent(DRA_EVENTS, allocations=2)


# --- a release the labels name by an unknown id (#13.5) ----------------------------------------------

UNKNOWN_ID = [*RELEASES,
              # the pod names a release id no release event describes; its model labels name m:7 (= r1)
              pod_event("scheduler.scheduled", 5, pod="u1", release_id="m-7-typo", model_name="m", model_version="7"),
              alert(20, fp="on-u1", namespace="ml", pod="u1", model_name="m", model_version="7"),
              # only the alert names the model; the pod's label is unknown and it has no model labels
              pod_event("scheduler.scheduled", 5, pod="u2", release_id="ghost-release"),
              alert(21, fp="on-u2", namespace="ml", pod="u2", model_name="m", model_version="7"),
              # the same label once a release event describes it: the label wins again
              pod_event("scheduler.scheduled", 5, pod="u3", release_id="r-late"),
              release("release.registered", 30, rid="r-late", model="k", version="2", digest="sha256:" + "e" * 64)]


def test_unknown_release_id_falls_back_to_model_version_and_says_so():
    d = Driver().feed(UNKNOWN_ID).flush_parked()
    by_fp = {r.identity.alert_fingerprint: r for r in d.rows.values() if r.event_type.startswith("alert.")}
    assert (by_fp["on-u1"].identity.release_id, by_fp["on-u1"].attribution, by_fp["on-u1"].named_release_id) == \
        ("r1", "model_version_fallback", "m-7-typo")
    assert (by_fp["on-u2"].identity.release_id, by_fp["on-u2"].attribution, by_fp["on-u2"].named_release_id) == \
        ("r1", "model_version_fallback", "ghost-release")
    u1 = next(r for r in d.rows.values() if r.identity.pod == "u1" and r.event_type == "scheduler.scheduled")
    assert (u1.identity.release_id, u1.attribution, u1.named_release_id) == ("r1", "model_version_fallback", "m-7-typo")
    u3 = next(r for r in d.rows.values() if r.identity.pod == "u3")
    assert (u3.identity.release_id, u3.attribution, u3.named_release_id) == ("r-late", "release_label", None)


def test_fallback_attribution_is_the_same_in_any_processing_order():
    assert_order_independent(UNKNOWN_ID, allocations=0)


#: Pods labelled with a release that is registered only later, whose image digest (or model
#: labels) find another release meanwhile: the fallback attributes them first, the label once
#: its release is described.
LATE_LABEL = [*RELEASES,
              pod_event("scheduler.scheduled", 5, pod="l1", release_id="r-late", digest=DIGEST_R1, image_digest=DIGEST_R1),
              gpu_event("gpu.assigned", 6, pod="l1", device="GPU-7"),
              pod_event("scheduler.running", 7, pod="l1", release_id="r-late"),
              alert(20, fp="on-l1", namespace="ml", pod="l1"),
              pod_event("scheduler.scheduled", 8, pod="l2", release_id="r-late", model_name="m", model_version="7"),
              alert(21, fp="on-l2", namespace="ml", pod="l2", model_name="m", model_version="7", release_id="r-late"),
              release("release.registered", 30, rid="r-late", model="k", version="2", digest="sha256:" + "e" * 64)]


def test_a_label_whose_release_arrives_after_its_fallback_rows_went_out_is_the_same_in_any_order():
    """Found by an exploratory chaos review (a replay's tables differed from the live run's with
    no crash at all): a pod row naming a release not registered yet went out attributed by its
    image digest's release at a version — the fallback's candidates and the pod's facts — above
    the one the label's side had once the release arrived (the label alone). The corrected row
    was never emitted, so the stale attribution won, and which one a run kept depended on the
    order it read the topics in. Both sides now count the same components."""
    assert_order_independent(LATE_LABEL, allocations=1)
    d = Driver().feed(LATE_LABEL).flush_parked()
    rows = [r for r in d.rows.values() if r.identity.pod in ("l1", "l2")]
    assert rows and all((r.identity.release_id, r.attribution, r.named_release_id) == ("r-late", "release_label", None)
                        for r in rows if not r.event_type.startswith("alert.")), rows
    # Before the release is described: the fallbacks, naming the unknown label.
    early = Driver().feed([e for e in LATE_LABEL if getattr(e.identity, "release_id", None) != "r-late" or e.event_type != "release.registered"])
    early.flush_parked()
    l1 = next(r for r in early.rows.values() if r.identity.pod == "l1" and r.event_type == "scheduler.scheduled")
    assert (l1.identity.release_id, l1.attribution, l1.named_release_id) == ("r1", "image_digest_fallback", "r-late"), l1


def test_an_admission_decision_is_correlated_like_any_workload_event():
    from producers._config import GPU_RESOURCES, ResourceMatcher
    from producers.admission.events import decision_event
    from streams.controls.admission import AdmissionState, decide, subject_of
    from streams.controls.policy import Policy
    from tests.streams.harness import at

    job = {"kind": "Job", "metadata": {"name": "train", "namespace": "ml", "uid": "u1", "labels": {"gpuledger.io/release-id": "r1"}},
           "spec": {"template": {"spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}}
    subject = subject_of(job, ResourceMatcher(GPU_RESOURCES))
    state = AdmissionState()
    state.ready.set()
    for e in RELEASES:
        state.apply(e)
    event = decision_event(subject, decide(subject, state, Policy(), at(8)), at(8), gate="webhook", request_id="req-1", operation="CREATE")
    d = Driver().feed([*RELEASES, event])
    row = next(r for r in d.rows.values() if r.event_type == "admission.decided")
    assert row.identity.release_id == "r1" and row.identity.workload_id == "ml/Job/train" and row.attribution == "release_label"
    assert row.identity.artifact_digest == "sha256:" + "a" * 64  # enriched from the release like the workload's own events
    assert row.summary == f"admission {event.payload.decision} by rule {event.payload.rule} (webhook, enforce)"


def test_a_routed_event_carries_what_the_fold_reads_with_the_payload_as_the_envelope_writes_it():
    """routing.routed_event: id, type, time, the identity's set fields and the payload JSON
    exactly as in the event's own JSON (it becomes the row's payload_json)."""
    from benchmarks.mix import events

    seen = set()
    for event in events(60):
        routed = routed_event(event)
        full = orjson.loads(event.model_dump_json())
        assert set(routed) == {"event_id", "event_type", "occurred_at", "identity", "payload"}
        assert routed["payload"] == full["payload"] and routed["event_id"] == full["event_id"]
        assert routed["identity"] == {k: v for k, v in full["identity"].items() if v}
        assert routed["occurred_at"] == iso(full["occurred_at"])  # already in the one sort-key form
        seen.add(event.event_type.split(".")[0])
    assert seen == {"release", "scheduler", "gpu", "alert"}


# --- DRA devices held through a ResourceClaim (#13.3) ---------------------------------------------------

CLAIMED = f"{DRA}/n1/gpu-0"
CLAIM_ONLY = [*RELEASES, dra_device(0, pool="n1", device="gpu-0", uuid=GPU_P),
              pod_event("scheduler.scheduled", 5, pod="c1", release_id="r1"),
              claim_event("gpu.claim_reserved", 5, pod="c1", pod_uid="uid-c1"),
              alert(20, fp="xid-claimed", node="n1", gpu_id=GPU_P, labels={"UUID": GPU_P}),
              claim_event("gpu.claim_released", 30, pod="c1", pod_uid="uid-c1", reason="unreserved"),
              alert(40, fp="xid-after", node="n1", gpu_id=GPU_P, labels={"UUID": GPU_P})]


def test_a_claim_alone_says_who_holds_a_dra_gpu_and_when_it_stopped():
    d = Driver().feed(CLAIM_ONLY).flush_parked()
    [alloc] = d.allocations.values()
    assert (alloc.pod, alloc.gpu_id, alloc.gpu, alloc.container, alloc.identity.release_id, alloc.identity.pod_uid) == \
           ("c1", CLAIMED, GPU_P, None, "r1", "uid-c1")
    assert (alloc.started_at, alloc.ended_at, alloc.end_reason) == (at(5), at(30), "unreserved")
    by_fp = {r.identity.alert_fingerprint: r for r in d.rows.values() if r.event_type.startswith("alert.")}
    assert (by_fp["xid-claimed"].identity.pod, by_fp["xid-claimed"].identity.release_id, by_fp["xid-claimed"].attribution) == \
           ("c1", "r1", "gpu_assignment")
    assert by_fp["xid-after"].attribution == "unattributed"  # the claim had let go of the GPU


def test_claim_joins_are_the_same_in_any_processing_order():
    assert_order_independent(CLAIM_ONLY, allocations=1)


def both_sources(kubelet_at: float, claim_at: float) -> list:
    """One DRA holding reported by both collectors: the claim (reserved, released) and the
    kubelet (two containers sharing the claim), in the order the gpu topic holds them (the
    same partition: both are keyed by namespace/pod), i.e. by report time."""
    events = [claim_event("gpu.claim_reserved", claim_at, pod="c2", pod_uid="uid-c2", claim="c2-gpu"),
              gpu_event("gpu.assigned", kubelet_at, pod="c2", device=CLAIMED, resource=DRA, container="main"),
              gpu_event("gpu.assigned", kubelet_at + 0.1, pod="c2", device=CLAIMED, resource=DRA, container="sidecar"),
              gpu_event("gpu.released", 50, pod="c2", device=CLAIMED, resource=DRA, container="main"),
              gpu_event("gpu.released", 50, pod="c2", device=CLAIMED, resource=DRA, container="sidecar"),
              claim_event("gpu.claim_released", 52, pod="c2", pod_uid="uid-c2", claim="c2-gpu", reason="claim_deleted")]
    return [*RELEASES, dra_device(0, pool="n1", device="gpu-0", uuid=GPU_P), pod_event("scheduler.scheduled", 4, pod="c2", release_id="r1"),
            *sorted(events, key=lambda e: e.occurred_at), alert(20, fp="xid-both", node="n1", gpu_id=GPU_P, labels={"UUID": GPU_P})]


def test_a_holding_the_kubelet_and_the_claim_both_report_is_one_allocation():
    # The usual order (reserved at scheduling, the kubelet later) and a claim first seen late (a collector re-list).
    for kubelet_at, claim_at in ((6, 5), (6, 8)):
        events = both_sources(kubelet_at, claim_at)
        for seed in (None, *range(8)):  # any interleaving across keys; each key's messages in topic order
            d = Driver(seed=seed).feed(events).flush_parked()
            # Every allocation ever emitted is a row of gpu_allocations: one, so nothing is left behind.
            [alloc] = d.allocations.values()
            assert (alloc.pod, alloc.gpu_id, alloc.gpu, alloc.container) == ("c2", CLAIMED, GPU_P, "main,sidecar")
            # Starts at the earliest report, ends when the claim let go (the kubelet stopped listing it earlier).
            assert (alloc.started_at, alloc.ended_at, alloc.end_reason) == (at(min(kubelet_at, claim_at)), at(52), "claim_deleted")
            [row] = [r for r in d.rows.values() if r.identity.alert_fingerprint == "xid-both"]
            assert (row.identity.pod, row.identity.release_id) == ("c2", "r1")
            assert d.conflicts == 0


def test_coverage_answers_who_held_a_gpu_as_walking_every_link_does():
    """``entities.Coverage`` (the links' intervals indexed by start) against the definition,
    walked link by link: holders at t, the versions of the links with an interval started
    by t, and those intervals' releases — over random links, including open intervals,
    intervals without a release and times before, between and after them. Kept up to date
    link by link (``set``: links new, replaced, gone — as a GPU entity's memo keeps it), it
    answers as the definition does and as an index built at once from the same links,
    holders in the same order."""
    from streams.correlate.entities import Coverage, select_holders

    rng = random.Random(7)

    def t(i: int) -> str:
        return f"2026-11-01T00:{i // 60:02d}:{i % 60:02d}+00:00"

    def random_link(n: int) -> dict:
        intervals = []
        for j in range(rng.randint(0, 3)):
            shared = rng.random() < 0.2  # one allocation reported by two sources: equal (start, id) in two links
            start = 100 + j if shared else rng.randint(0, 200)
            end = None if rng.random() < 0.3 else start + rng.randint(1, 60)
            rid = rng.choice([None, "rel-a", "rel-b", "rel-c"])
            iv = {"id": f"shared{j}" if shared else f"a{n}-{j}", "start": t(start), "end": t(end) if end is not None else None,
                  "identity": {"release_id": rid} if rid else {}}
            if rng.random() < 0.3:  # a MIG slice / time-slicing share of the GPU
                iv.update({"slice": f"MIG-{n}-{j}", "gi": rng.choice(["1", "2"]), "profile": rng.choice(["1g.10gb", "3g.40gb"]),
                           "resource": "nvidia.com/mig"})
            intervals.append(iv)
        return {"intervals": intervals, "v": rng.randint(1, 9)}

    def check(coverage: Coverage, links: dict) -> None:
        built = Coverage(links)
        for probe in range(0, 270, 7):
            at = t(probe)
            holders, version, rids = [], 0, set()
            for link in links.values():
                early = [iv for iv in link["intervals"] if iv["start"] <= at]
                if early:
                    version += link["v"]
                    rids.update(iv["identity"]["release_id"] for iv in early if iv["identity"].get("release_id"))
                    holders += [iv["id"] for iv in early if iv["end"] is None or at < iv["end"]]
            got_holders, got_version, got_rids = coverage.at(at)
            assert sorted(iv["id"] for iv in got_holders) == sorted(holders), (links, at)
            assert (got_version, got_rids) == (version, tuple(sorted(rids))), (links, at)
            assert [iv["id"] for iv in got_holders] == [iv["id"] for iv in built.at(at)[0]], (links, at)
            # as a row resolves them: the holders select_holders picks (the latest whole one, or the slices)
            for instance in (None, {"gi": "1"}, {"profile": "1g.10gb"}):
                assert coverage.selected(at, instance) == (select_holders(got_holders, instance), got_version, got_rids), (links, at)

    for _case in range(200):
        links = {f"pod:ns/p{n}": random_link(n) for n in range(rng.randint(0, 6))}
        coverage = Coverage(links)
        check(coverage, links)
        kept = Coverage(links)
        for _change in range(6):
            n = rng.randint(0, 7)
            source = f"pod:ns/p{n}"
            if source in links and rng.random() < 0.3:
                del links[source]
                kept.set(source, None)
            else:
                links[source] = random_link(n)
                kept.set(source, links[source])
            check(kept, links)


def test_coverage_refuses_a_link_changed_in_place_after_it_was_indexed():
    """Links are replaced, never edited (``fold_link``); the kept-up index relies on it and
    says so loudly rather than answering from a wrong index."""
    from streams.correlate.entities import Coverage

    link = {"intervals": [{"id": "a1", "start": "2026-11-01T00:00:10+00:00", "end": None, "identity": {"release_id": "r1"}}], "v": 1}
    coverage = Coverage({"pod:ns/p1": link})
    assert [iv["id"] for iv in coverage.at("2026-11-01T00:00:20+00:00")[0]] == ["a1"]
    link["intervals"][0]["start"] = "2026-11-01T00:00:05+00:00"  # edited in place
    with pytest.raises(RuntimeError, match="pod:ns/p1 changed in place"):
        coverage.set("pod:ns/p1", {"intervals": [], "v": 2})


def test_a_gpu_memo_finds_changed_links_by_their_journal_and_refuses_unnoted_changes():
    """A followed node/GPU's links note every source set or deleted (``JournaledLinks``):
    the memo's order of links follows additions, replacements and evictions past
    ``MAX_LINKS`` without comparing every link, and a change that would go unnoted is refused."""
    import orjson

    from streams.correlate import entities
    from streams.correlate.entities import GpuMemo, JournaledLinks, fold_link, new_entity

    def link(second: int, v: int = 1) -> dict:
        start = f"2026-11-01T00:{second // 60:02d}:{second % 60:02d}+00:00"
        return {"intervals": [{"id": f"a{second}", "start": start, "end": None, "identity": {}}], "v": v}

    state, memo = new_entity("gpu:n1/GPU-1"), GpuMemo()
    fold_link(state, "pod:ns/a", link(10))
    assert memo.prefixes(state)[0] == ["2026-11-01T00:00:10+00:00"]
    assert type(state["links"]) is JournaledLinks
    fold_link(state, "pod:ns/b", link(5))
    fold_link(state, "pod:ns/a", link(20, v=2))  # replaced
    assert memo.prefixes(state)[0] == ["2026-11-01T00:00:05+00:00", "2026-11-01T00:00:20+00:00"]
    for i in range(entities.MAX_LINKS):  # later holders evict the earliest (b, then a)
        fold_link(state, f"pod:ns/p{i}", link(30 + i))
    starts = memo.prefixes(state)[0]
    assert len(starts) == entities.MAX_LINKS and starts[0] == "2026-11-01T00:00:30+00:00"
    assert starts == sorted(iv["start"] for lk in state["links"].values() for iv in lk["intervals"])
    with pytest.raises(TypeError, match="item by item"):
        state["links"].update({"pod:ns/z": link(1)})
    # Encoded as the plain dict it is; a state loaded again is compared link by link once
    loaded = orjson.loads(orjson.dumps(state))
    assert type(loaded["links"]) is dict and loaded["links"] == dict(state["links"])
    assert memo.prefixes(loaded)[0] == starts and type(loaded["links"]) is JournaledLinks


def test_a_gpu_memo_keeps_its_prefixes_and_interests_as_computing_them_again_gives(monkeypatch):
    """``GpuMemo.prefixes`` keeps each prefix's highest stamp up to date from the first position
    a change touched, and ``GpuMemo.interests`` the union of its rows' interests counted per set:
    under random holders new, replaced (earlier and later starts) and evicted past ``MAX_LINKS``,
    and rows derived again with other interests, both are what computing them from scratch gives."""
    from itertools import accumulate

    from streams.correlate import entities
    from streams.correlate.entities import GpuMemo, fold_link, new_entity

    monkeypatch.setattr(entities, "MAX_LINKS", 12)
    rng = random.Random(5)

    def link(v: int, second: int) -> dict:
        return {"intervals": [{"id": f"a{second}-{v}", "start": f"2026-11-01T00:{second // 60:02d}:{second % 60:02d}+00:00", "end": None,
                               "identity": {}}], "v": v}

    state, memo = new_entity("gpu:n1/GPU-1"), GpuMemo()
    versions: dict[str, int] = {}
    rows: dict[str, tuple] = {}
    for step in range(400):
        for _ in range(rng.randint(1, 3)):
            source = f"pod:ns/p{rng.randint(0, 30)}"
            versions[source] = versions.get(source, 0) + 1
            fold_link(state, source, link(versions[source], rng.randint(0, 900)))
        starts, top = memo.prefixes(state)
        stamps = [stamp for _start, stamp in memo._order[0]]
        assert starts == sorted(start for _link, _stamp, start in memo.links.values() if start is not None), step
        assert top == list(accumulate(stamps, max, initial=0)), step
        rid = f"r{step}"
        interests = tuple(sorted(rng.sample([f"rid:r{n}" for n in range(8)], rng.randint(0, 3))))
        record = {"id": rng.choice([rid, *list(rows)[:5]]), "starts_at": None, "at": f"2026-11-01T01:00:{step % 60:02d}+00:00", "parked": False}
        memo.derived(record, (), interests)
        rows[record["id"]] = interests
        assert memo.interests() == sorted(set().union(*rows.values())), step
        assert sum(memo.counts.values()) == len(rows), step
    assert state["detached"] > 100


def test_a_state_an_older_worker_wrote_with_version_digest_pairs_goes_on_as_one_with_bare_versions(monkeypatch):
    """The worker keeps a bare int per emitted row, allocation and forward (``sent_version``:
    no tracked container for the collector to walk); a worker before 2026-12 kept
    ``[version, digest]``, and its changelog still holds them. Read back, such a state emits
    exactly what a state of bare versions emits: nothing again at a version already sent (the
    Driver asserts every emission's version grows), and the same latest rows and versions."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", False)  # the worker's path
    events = _busy_gpu()
    half = len(events) // 2
    reference = Driver().feed(events).flush_parked()
    d = Driver().feed(events[:half])
    pairs = 0
    for state in d.entities.values():
        for name in ("sent", "allocs", "fwd"):
            assert all(type(v) is int for v in state[name].values())  # what this worker writes
            state[name] = {k: [v, ""] for k, v in state[name].items()}  # what an older one wrote
            pairs += len(state[name])
    assert pairs > 50
    d.feed(events[:half]).feed(events[half:]).flush_parked()  # the first half again (a re-delivery), then the rest
    assert d.latest(versions=True) == reference.latest(versions=True)
    assert d.latest_allocations(versions=True) == reference.latest_allocations(versions=True)
    assert d.conflicts == 0


def test_a_followed_gpu_past_the_link_cap_keeps_exactly_the_links_a_plain_one_keeps(monkeypatch):
    """Past ``MAX_LINKS`` a node/GPU keeps the links whose latest interval started latest. A
    followed one (``JournaledLinks``) keeps them in that order as links come, are replaced by
    higher versions (a holder's interval ending, or a later one starting) and are evicted,
    instead of walking every link at each fold: under any arrival order it keeps the same
    links, versions and eviction count as a plain dict of links does."""
    from streams.correlate import entities
    from streams.correlate.entities import GpuMemo, JournaledLinks, fold_link, new_entity

    monkeypatch.setattr(entities, "MAX_LINKS", 6)

    def link(v: int, *seconds: int) -> dict:
        return {"intervals": [{"id": f"a{s}", "start": f"2026-11-01T00:{s // 60:02d}:{s % 60:02d}+00:00", "end": None, "identity": {}}
                              for s in seconds], "v": v}

    # 20 holders; some get a second version with a later interval (or, for p3, none at all)
    arrivals = [(f"pod:ns/p{i}", link(1, (37 * i) % 200)) for i in range(20)]
    arrivals += [(f"pod:ns/p{i}", link(2, (37 * i) % 200, 100 + 7 * i)) for i in range(0, 20, 4)]
    arrivals += [("pod:ns/p3", link(3))]
    for seed in range(8):
        order = list(arrivals)
        random.Random(seed).shuffle(order)
        order.sort(key=lambda a: a[1]["v"])  # a source's versions in order (one partition of the route topic)
        plain, followed, memo = new_entity("gpu:n1/GPU-1"), new_entity("gpu:n1/GPU-1"), GpuMemo()
        for n, (source, lk) in enumerate(order):
            fold_link(plain, source, lk)
            fold_link(followed, source, lk)
            if n == 3:
                memo.prefixes(followed)  # from now on its links are followed
                assert type(followed["links"]) is JournaledLinks
        assert type(followed["links"]) is JournaledLinks and followed["links"]._order is not None
        assert dict(followed["links"]) == plain["links"] and len(plain["links"]) == 6, f"seed {seed}"
        assert followed["detached"] == plain["detached"] > 0, f"seed {seed}"
        assert followed["links"].least_keys(6) == sorted(map(entities._newest_item, plain["links"].items()))


@pytest.mark.parametrize("verify", [False, True])
def test_a_gpu_past_its_link_cap_does_not_derive_its_history_again_per_holder_and_emits_the_same(monkeypatch, verify):
    """Past ``MAX_LINKS`` every new holder detaches the link whose latest interval started
    earliest. The memo does not derive the rows after it again for that (they derive the same,
    or fall in version, or park: never emit): in any order, the rows, versions and allocations
    are the ones deriving every row every time gives in that order — with the tests' check of
    every skipped row (``verify``: it must emit nothing) and without (the worker's path).

    (In that order: these holders never report an end, so no row is after ``gone["w"]`` and the
    versions depend on the order the holders came in — a row derived before a detachment keeps
    the version it had. For holders that end, the next test.)"""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 8)  # 30 holders of one GPU: 22 detachments
    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", verify)
    events = _busy_gpu()
    for seed in range(10):
        order = list(events)
        random.Random(seed).shuffle(order)
        reference = Driver(seed=seed, memos=False).feed(order).flush_parked()
        assert reference.entities["gpu:n1/GPU-9"]["detached"] > 0 and len(reference.entities["gpu:n1/GPU-9"]["links"]) == 8
        d = Driver(seed=seed).feed(order).flush_parked()
        assert d.latest(versions=True) == reference.latest(versions=True), f"seed {seed}"
        assert d.latest_allocations(versions=True) == reference.latest_allocations(versions=True), f"seed {seed}"
        # (with ``verify`` every row is derived and compared: a detachment changes rows' content
        # with no version growth — the cap's known gap, counted as conflicts — the same ones either way)
        assert d.conflicts == reference.conflicts, f"seed {seed}"


def test_every_state_bound_that_bites_is_counted_for_the_health_page_and_logged_once(monkeypatch, caplog):
    """What a bound lets go is counted by kind (``streams.caps``: the health page's
    ``stats.capped``) — as many as the entities themselves say they detached — and the first
    of each kind in a process is logged with its entity, the rest only counted."""
    import logging
    from collections import Counter

    import streams.correlate.entities as entities
    from streams import caps
    from streams.controls import rules

    monkeypatch.setattr(caps, "CAPPED", Counter())  # this test's counts only
    monkeypatch.setattr(entities, "MAX_LINKS", 8)  # 30 holders of one GPU
    monkeypatch.setattr(entities, "MAX_ROWS", 20)  # 45 alerts on it
    assert caps.counts() == {"rows_detached": 0, "links_detached": 0, "payloads_truncated": 0, "control_rows_dropped": 0,
                            "control_fingerprints_detached": 0}
    with caplog.at_level(logging.WARNING, logger="streams.caps"):
        d = Driver().feed(_busy_gpu()).flush_parked()
    gpu = d.entities["gpu:n1/GPU-9"]
    assert len(gpu["links"]) == 8 and 18 <= len(gpu["rows"]) <= 20  # (let go down to TRIM_TO of the bound, then filled again)
    counted = caps.counts()
    assert counted["links_detached"] >= 22 and counted["rows_detached"] == 45 - len(gpu["rows"]), counted
    assert counted["links_detached"] + counted["rows_detached"] == sum(s["detached"] for s in d.entities.values())
    # (the workload's pods are its links too: 30 of them)
    assert [(r.getMessage().split(": ")[0], r.getMessage().rsplit(".", 1)[-1]) for r in caplog.records] == [
        ("wl:ml/Job/train", "links_detached"), ("gpu:n1/GPU-9", "rows_detached")]

    # a payload cut to MAX_ROW_PAYLOAD where the row is built (the route stage)
    big = alert(1, fp="big", labels={"note": "x" * (entities.MAX_ROW_PAYLOAD + 10)})
    row = entities.event_row(routed_event(big), "alert", ("raw.alerts", 3, 17))
    assert orjson.loads(row["payload"])["_truncated_bytes"] > entities.MAX_ROW_PAYLOAD
    assert caps.counts()["payloads_truncated"] == 1
    assert "raw.alerts[3]@17 (alert.firing" in caplog.records[-1].getMessage()

    # a control key's oldest rows past its bound
    monkeypatch.setattr(rules, "MAX_ROWS", 3)
    state = rules.new_state("wl:ml/Job/j")
    for i in range(5):
        rules.fold_row(state, {"id": f"r{i}", "v": 1, "at": f"2026-11-01T00:00:0{i}+00:00"})
    assert sorted(state["rows"]) == ["r2", "r3", "r4"] and caps.counts()["control_rows_dropped"] == 2


def _sequential_gpu() -> list:
    """One GPU held by 30 pods one after another (each released before the next is assigned;
    every fourth of another release; one whose release label is corrected), with 45 alerts on it."""
    events = [*RELEASES, release("release.registered", 0, rid="r2", model="n", version="1", digest="sha256:" + "d" * 64)]
    for i in range(30):
        pod = f"b{i}"
        events += [pod_event("scheduler.scheduled", 10 + 3 * i, pod=pod, release_id="r2" if i % 4 == 0 else "r1"),
                   gpu_event("gpu.assigned", 11 + 3 * i, pod=pod, device="GPU-9"),
                   gpu_event("gpu.released", 13 + 3 * i, pod=pod, device="GPU-9")]
    events += [pod_event("scheduler.queued", 30, pod="b7", release_id="r3"), pod_event("scheduler.running", 33, pod="b7", release_id="r1")]
    events += [alert(5 + 2 * j, fp=f"x{j}", node="n1", gpu_id="GPU-9") for j in range(45)]
    return events


@pytest.mark.parametrize("verify,steps", [(False, 64), (True, 64), (True, 4)])
def test_a_gpu_past_its_link_cap_stores_the_same_rows_and_versions_whatever_the_holders_order(monkeypatch, verify, steps):
    """Past ``MAX_LINKS`` a node/GPU lets its oldest holders go; what their links added to its
    rows' versions is kept (``state["gone"]``), so a row's version does not depend on whether
    it was derived before or after a detachment, and a row whose holder went keeps what it
    emitted: in any order the events come in near their time (each within 10 minutes; the
    releases first, as a cluster sees them) the rows, versions and allocations are those of
    event order — with the tests' check that no content changes without its version
    (``verify``). Before, a row derived after a detachment had a lower version than one
    derived before it: a replay, batching otherwise, stored other versions for every GPU past
    the cap. (``steps``: with 4, the oldest of the 22 detached links' steps join the next.)"""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 8)  # 30 holders of one GPU: 22 detachments
    monkeypatch.setattr(entities, "MAX_GONE_STEPS", steps)
    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", verify)
    events = _sequential_gpu()
    releases = [e for e in events if e.event_type.startswith("release.")]
    rest = sorted((e for e in events if not e.event_type.startswith("release.")), key=lambda e: e.occurred_at)
    reference = Driver(memos=False).feed(releases).feed(rest).flush_parked()
    gpu = reference.entities["gpu:n1/GPU-9"]
    assert gpu["detached"] == 22 and len(gpu["gone"]["steps"]) == min(22, steps) and reference.conflicts == 0
    # b0 (r2), b1 (r1), b7 (r3: its first label — a holder names every release its pod's rows named, ``_iv_rids``)
    assert gpu["gone"]["rids"] == {"r2": iso(at(11).isoformat()), "r1": iso(at(14).isoformat()), "r3": iso(at(32).isoformat())}
    assert gpu["gone"]["steps"][-1][2] == [[iso(at(11 + 3 * 21).isoformat()), iso(at(13 + 3 * 21).isoformat())]]  # b21, the last detached
    assert "gone" not in reference.entities["wl:ml/Job/train"]  # (its 30 pods past the cap: it keeps no ``gone``)
    # With steps joined, a GPU row before the earliest kept step no longer counts the joined
    # ones: its version falls (it emits nothing more), so it keeps whatever version it had when
    # it was last emitted — an order's — and only the rows from that step on are exact.
    exact_from = gpu["gone"]["steps"][0][0] if steps < 22 else ""
    ref_rows = {cid: row for cid, row in reference.latest(versions=True).items()
                if not (row["identity"].get("gpu_id") == "GPU-9" and iso(row["occurred_at"].isoformat()) < exact_from)}
    held = {row["identity"].get("pod") for row in ref_rows.values() if row["event_type"].startswith("alert.")}
    assert {"b22", "b27"} <= held and (steps < 22 or {"b0", "b10", "b21"} <= held)  # alerts held by detached holders and by kept ones
    for seed in range(12):
        rng = random.Random(seed)
        near = sorted(rest, key=lambda e: e.occurred_at.timestamp() + rng.uniform(0, 600))  # each within 10 min of its time
        d = Driver(seed=seed).feed(releases)
        for k in range(0, len(near), 4):
            d.feed(near[k:k + 4])
            if seed % 3 == 0 and k == 80:  # a restart: the states read back from their JSON, the memos gone
                d.entities = {key: orjson.loads(orjson.dumps(state)) for key, state in d.entities.items()}
                d.memos = {}
                assert "gone" in d.entities["gpu:n1/GPU-9"]
        d.flush_parked()
        got = d.latest(versions=True)
        assert {cid: got[cid] for cid in ref_rows} == ref_rows and len(got) == len(reference.latest()), f"seed {seed}"
        assert d.latest_allocations(versions=True) == reference.latest_allocations(versions=True), f"seed {seed}"
        assert d.entities["gpu:n1/GPU-9"]["gone"] == gpu["gone"] and d.conflicts == 0, f"seed {seed}"


def test_a_gpu_past_its_link_cap_renders_a_release_change_on_the_rows_of_its_kept_holders_only(monkeypatch):
    """A release event that changes r1's manifest makes every pod of r1 forward its links again,
    the detached holders' too: those are not attached again — not kept again in ``gone`` (they
    would count twice), not counted as detached again, the GPU's state left as it was (a state
    changed without being put is not its changelog record). The GPU's rows held by kept holders
    show the change; those whose holder went keep what they emitted, attributed (not
    ``unattributed``: the holder is forgotten, not wrong)."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 8)
    events = _sequential_gpu()
    releases = [e for e in events if e.event_type.startswith("release.")]
    rest = sorted((e for e in events if not e.event_type.startswith("release.")), key=lambda e: e.occurred_at)
    d = Driver(memos=False).feed(releases).feed(rest).flush_parked()
    gone = orjson.loads(orjson.dumps(d.entities["gpu:n1/GPU-9"]["gone"]))
    before = {cid: row for cid, row in d.latest(versions=True).items() if row["event_type"].startswith("alert.")}
    # (every park deadline passed too: the rows of detached holders still name them)
    assert {row["identity"].get("pod") for row in before.values()} >= {"b1", "b10", "b21", "b22", "b27"}
    d.feed([release("release.approved", 200, model="m-renamed", actor="bob")]).flush_parked()  # (and every park deadline passed)
    gpu = d.entities["gpu:n1/GPU-9"]
    assert gpu["detached"] == 22 and gpu["gone"] == gone
    after = {cid: row for cid, row in d.latest(versions=True).items() if row["event_type"].startswith("alert.")}
    kept = {f"b{i}" for i in range(22, 30)}
    for cid, row in after.items():
        was = before[cid]
        pod = was["identity"].get("pod")
        if was["identity"].get("release_id") != "r1":
            continue
        if pod in kept:
            assert row["identity"]["model_name"] == "m-renamed" and row["version"] > was["version"], row
        else:
            assert row == was and row["identity"]["model_name"] == "m" and row["attribution"] == "gpu_assignment", row
    assert {row["identity"]["pod"] for row in after.values() if row["identity"].get("model_name") == "m-renamed"} >= {"b23", "b27"}


def _holder(pod: str, start: int, end: int | None = None, rid: str = "r1") -> list:
    events = [pod_event("scheduler.scheduled", start - 1, pod=pod, release_id=rid), gpu_event("gpu.assigned", start, pod=pod, device="GPU-9")]
    return events + ([gpu_event("gpu.released", end, pod=pod, device="GPU-9")] if end is not None else [])


def test_a_gpu_row_without_holder_after_a_detached_holder_that_never_ended_is_derived_as_it_is(monkeypatch):
    """A row keeps what it emitted when its holder went (``forgotten``) only inside the span of a
    detached holder that ended: one that never reported its end spans every later time, and a
    row there may have been held by another holder whose end came late — kept, it would name a
    holder known to have ended before it. Here: d never ends and goes past the cap; h held the
    GPU 20-30 but its end comes after the alert at 35, which first names h — then, its park
    deadline passed, the alert is unattributed, not h's."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 3)
    alert35 = alert(35, fp="A", node="n1", gpu_id="GPU-9")
    d = Driver().feed([*RELEASES, *R2]).feed(_holder("d", 10) + _holder("h", 20, rid="r2") + [alert35])
    def row_at(minutes):
        return next(r for r in d.rows.values() if r.identity.alert_fingerprint == "A" and r.occurred_at == at(minutes))

    assert row_at(35).identity.pod == "h"
    d.feed(_holder("x", 40, 45) + _holder("y", 50, 55) + [gpu_event("gpu.released", 30, pod="h", device="GPU-9")]).flush_parked()
    gone = d.entities["gpu:n1/GPU-9"]["gone"]
    assert [step[2] for step in gone["steps"]] == [[]]  # d: detached, never ended
    row = row_at(35)
    assert row.attribution == "unattributed" and row.identity.pod is None and row.identity.release_id is None


def test_an_alert_fingerprint_with_a_row_kept_for_a_detached_holder_is_joined_for_the_controls(monkeypatch):
    """Control 6 (an alert none of whose rows joined a release) reads a fingerprint's rows only
    once one goes out unjoined (``for_controls``), with the ones emitted before rendered again.
    A row kept as it was emitted, joined, for a holder since detached (``forgotten``) cannot be
    rendered again — and the fingerprint did join: its later unjoined row does not send it to the
    controls stage."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 3)
    early, late = alert(12, fp="A", node="n1", gpu_id="GPU-9"), alert(70, fp="A", node="n1", gpu_id="GPU-9")

    def row_at(minutes):
        return next(r for r in d.rows.values() if r.identity.alert_fingerprint == "A" and r.occurred_at == at(minutes))

    d = Driver().feed(RELEASES).feed(_holder("d", 10, 15) + [early] + _holder("h", 20, 30) + _holder("x", 40, 45) + _holder("y", 50, 55))
    assert d.entities["gpu:n1/GPU-9"]["gone"]["steps"] and row_at(12).identity.pod == "d"
    d.feed([late]).flush_parked()  # no holder at 70: unattributed, the fingerprint's first unjoined row
    assert row_at(12).identity.pod == "d" and row_at(70).attribution == "unattributed"
    assert "A" not in d.entities["gpu:n1/GPU-9"]["ctl"]
    assert not [r for r in d.controls.values() if r.identity.alert_fingerprint == "A"]


def test_what_a_gpu_keeps_of_its_detached_links_is_bounded():
    """``gone`` keeps ``MAX_GONE_STEPS`` steps (the oldest joins the next: versions summed, its
    span kept as ``cut``) and ``MAX_GONE_RIDS`` releases (the one named earliest goes)."""
    import streams.correlate.entities as entities

    gone = {"steps": [], "rids": {}}
    n = max(entities.MAX_GONE_STEPS, entities.MAX_GONE_RIDS) + 6
    for i in range(n):
        start, end = f"2026-11-01T{i // 60:02d}:{i % 60:02d}:00+00:00", f"2026-11-01T{i // 60:02d}:{i % 60:02d}:30+00:00"
        entities._let_go(gone, f"pod:ns/p{i}", {"intervals": [{"id": f"a{i}", "start": start, "end": end, "identity": {"release_id": f"r{i:03d}"}}], "v": 2})
    assert len(gone["steps"]) == entities.MAX_GONE_STEPS and sum(step[1] for step in gone["steps"]) == 2 * n
    j = n - entities.MAX_GONE_STEPS - 1  # the last link whose step joined the next
    assert gone["cut"] == f"2026-11-01T{j // 60:02d}:{j % 60:02d}:30+00:00" and gone["steps"][0][0] == f"2026-11-01T{(j + 1) // 60:02d}:{(j + 1) % 60:02d}:00+00:00"
    assert sorted(gone["rids"]) == [f"r{i:03d}" for i in range(n - entities.MAX_GONE_RIDS, n)]
    version, rids, spanned = entities.gone_prefix(gone, "2026-11-01T00:00:10+00:00")  # before every kept step, in the cut
    assert (version, rids, spanned) == (0, [], True)


def test_a_gpu_row_whose_holder_went_while_an_older_one_still_covers_it_keeps_its_holder(monkeypatch):
    """Two whole holders at once (a double allocation, or an end that never came): a held the
    GPU 10-40 (and again 60-70), b 20-30 — the alert at 25 is b's, the latest to start. b goes
    past the cap while a stays (a's latest interval started later): the alert does not fall
    back to a at the same version (the content changing without its version, which the worker
    would never emit and a replay might store) — it keeps b, as emitted."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 2)
    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", True)  # a content change without its version is counted
    a_twice = _holder("a", 10, 40) + [gpu_event("gpu.assigned", 60, pod="a", device="GPU-9"), gpu_event("gpu.released", 70, pod="a", device="GPU-9")]
    d = Driver().feed(RELEASES).feed(a_twice + _holder("b", 20, 30) + [alert(25, fp="A", node="n1", gpu_id="GPU-9")])
    row = next(r for r in d.rows.values() if r.identity.alert_fingerprint == "A")
    assert row.identity.pod == "b"
    d.feed(_holder("c", 80, 85)).flush_parked()
    gpu = d.entities["gpu:n1/GPU-9"]
    assert sorted(gpu["links"]) == ["pod:ml/a", "pod:ml/c"] and gpu["gone"]["steps"][0][2] == [[iso(at(20).isoformat()), iso(at(30).isoformat())]]
    row = next(r for r in d.rows.values() if r.identity.alert_fingerprint == "A")
    assert row.identity.pod == "b" and d.conflicts == 0


def test_a_detached_holder_that_holds_the_gpu_again_counts_once(monkeypatch):
    """A pod whose link went past the cap and that is given the GPU again comes back with both
    allocations: its step leaves ``gone``, so its version counts once — the rows of the holders
    it keeps (a's and d's) store what the same events give with no cap at all (those of b and c,
    which went, keep what they emitted before: the versions they had then)."""
    import streams.correlate.entities as entities

    events = [*RELEASES, *_holder("a", 10, 12), *_holder("b", 20, 22), *_holder("c", 30, 32),
              gpu_event("gpu.assigned", 40, pod="a", device="GPU-9"), gpu_event("gpu.released", 42, pod="a", device="GPU-9"),
              *_holder("d", 50, 52), *[alert(m, fp=f"x{m}", node="n1", gpu_id="GPU-9") for m in (11, 21, 31, 41, 51)]]
    events.sort(key=lambda e: e.occurred_at)
    uncapped = Driver().feed(events).flush_parked()
    monkeypatch.setattr(entities, "MAX_LINKS", 2)
    capped = Driver().feed(events).flush_parked()
    gpu = capped.entities["gpu:n1/GPU-9"]
    assert sorted(gpu["links"]) == ["pod:ml/a", "pod:ml/d"] and [step[3] for step in gpu["gone"]["steps"]] == ["pod:ml/b", "pod:ml/c"]
    kept = {cid: row for cid, row in uncapped.latest(versions=True).items() if row["identity"].get("pod") in ("a", "d")}
    assert {row["occurred_at"] for row in kept.values() if row["event_type"].startswith("alert.")} == {at(11), at(41), at(51)}
    got = capped.latest(versions=True)
    assert {cid: got[cid] for cid in kept} == kept


def _alert_heavy_pod() -> list:
    """A long-lived pod with one GPU and many alert state changes of its own (a flapping alert on
    an inference pod: a row per change), more than its entity keeps."""
    return [*RELEASES, pod_event("scheduler.scheduled", 5, release_id="r1"), gpu_event("gpu.assigned", 6),
            *[alert(10 + i * 0.5, fp=f"flap{i % 7}", namespace="ml", pod="p1", node="n1" if i % 3 else "n2") for i in range(40)],
            pod_event("scheduler.running", 40, release_id="r1", node="n3")]


@pytest.mark.parametrize("verify", [False, True])
def test_a_pod_past_its_row_cap_lets_its_oldest_alerts_go_not_what_attributes_it_and_emits_every_row(monkeypatch, verify):
    """Past ``MAX_ROWS`` a pod entity keeps its own rows (scheduled, assigned: its facts and its
    interval) and lets its oldest alerts go: its allocation and every alert stay attributed to its
    release. (Before: the oldest rows went whatever they were — the assignment first — and the
    allocation and every later alert turned unattributed.) A row is never let go before it went
    out: in any order here — an old alert arriving after the cap filled — every event has its row,
    with the same content as in event order; no version falls (the harness asserts every row's
    versions grow), and with VERIFY no content changes without its version."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_ROWS", 12)
    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", verify)
    events = _alert_heavy_pod()
    reference = Driver().feed(events).flush_parked()
    pod = reference.entities["pod:ml/p1"]
    assert len(pod["rows"]) <= 12 and pod["detached"] == len(events) - len(RELEASES) - len(pod["rows"])
    kept = sorted(r["type"] for r in pod["rows"].values())
    assert kept.count("gpu.assigned") == 1 and kept.count("scheduler.scheduled") == 1 and kept.count("scheduler.running") == 1
    [alloc] = reference.allocations.values()
    assert (alloc.attribution, alloc.identity.release_id, alloc.ended_at) == ("release_label", "r1", None)
    # Letting rows go lowers no version: the pod's facts component (runs of its facts, here the
    # alerts' alternating nodes) never falls as the rows go, event after event.
    stepwise, components = Driver(), []
    for ev in events:
        stepwise.feed([ev])
        if (state := stepwise.entities.get("pod:ml/p1")) is not None:
            components.append(entities.facts_of(state)[1])
    assert components == sorted(components) and stepwise.entities["pod:ml/p1"]["detached"] > 0
    alerts = [r for r in reference.rows.values() if r.event_type.startswith("alert.")]
    assert len(alerts) == 40 and {(r.attribution, r.identity.release_id, r.identity.workload_id) for r in alerts} == {
        ("release_label", "r1", "ml/Job/train")}
    for seed in range(12):
        order = list(events)
        random.Random(seed).shuffle(order)
        d = Driver(seed=seed).feed(order).flush_parked()
        assert d.latest() == reference.latest(), f"seed {seed}"
        assert d.latest_allocations() == reference.latest_allocations(), f"seed {seed}"
        assert len(d.entities["pod:ml/p1"]["rows"]) <= 12, f"seed {seed}"
        assert d.conflicts == 0, f"seed {seed}"


def test_a_mig_slices_learned_parent_survives_its_teaching_alerts_going_past_the_row_cap(monkeypatch):
    """The alerts that taught a pod which physical GPU its MIG slice is a part of (``learned_parents``)
    are alerts like any other past ``MAX_ROWS``: the latest still teaches it, and the ones let go
    still count in the slice interval's version (``state["gone_teach"]``), which never falls."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_ROWS", 6)
    events = [*RELEASES, pod_event("scheduler.scheduled", 5, pod="m1", node="n2", release_id="r1"),
              gpu_event("gpu.assigned", 6, pod="m1", node="n2", device=MIG_A, resource=MIG_RES),
              *[alert(8 + i, fp=f"m1-temp{i}", namespace="ml", pod="m1", node="n2", gpu_id="GPU-Q",
                      labels={"UUID": "GPU-Q", "GPU_I_ID": "7", "GPU_I_PROFILE": "1g.10gb"}) for i in range(10)]]
    d, versions = Driver(), []
    for ev in events:
        d.feed([ev])
        if (state := d.entities.get("pod:ml/m1")) is not None and (spans := entities.intervals(state)):
            [span] = spans
            versions.append(span["v"])
    assert d.entities["pod:ml/m1"]["detached"] > 0 and versions == sorted(versions) and versions[-1] >= 10
    [alloc] = d.flush_parked().allocations.values()
    assert (alloc.gpu, alloc.identity.release_id) == ("GPU-Q", "r1")


def _big_workload() -> list:
    """A workload (a distributed job: its pods are its links) with its own events, 8 pods whose
    facts changed often (rescheduled across nodes: links of high versions), then 22 more whose
    names sort after theirs, then its release promoted."""
    from schemas import Identity, SchedulerEvent, make_event_id
    from schemas.scheduler import SchedulerPayload
    from tests.streams.harness import SRC

    def wl_event(etype: str, minutes: float) -> SchedulerEvent:
        return SchedulerEvent(event_id=make_event_id("t", ("wl-big", etype)), event_type=etype, occurred_at=at(minutes),
                              observed_at=at(minutes), source=SRC, identity=Identity(workload_id="ml/Job/big"),
                              payload=SchedulerPayload(object_kind="Workload", queue="q"))

    moved = [pod_event(etype, 5 + i * 0.5 + j * 0.05, pod=f"a-{i}", workload="ml/Job/big", node=f"n{j % 2}", release_id="r1")
             for i in range(8) for j, etype in enumerate(("scheduler.scheduled", "scheduler.running", "scheduler.preempted",
                                                           "scheduler.scheduled", "scheduler.running"))]
    late = [pod_event("scheduler.scheduled", 10 + i * 0.1, pod=f"z-{i:02d}", workload="ml/Job/big", release_id="r1") for i in range(22)]
    return [RELEASES[0], RELEASES[1], wl_event("scheduler.admitted", 4), wl_event("scheduler.finished", 40), *moved, *late,
            release("release.promoted", 30, to_environment="prod")]


def test_a_workload_past_its_link_cap_keeps_its_let_go_pods_versions_and_stores_what_event_order_stores(monkeypatch):
    """A workload's links are its pods, let go past ``MAX_LINKS`` by name (they hold no
    intervals): what they added to its versions stays (``gone_links``), so its rows' versions
    are those of the whole link set — the same rows and versions in any order, a pod forwarded
    again counting once — and a change after the cap (the release promoted) reaches its rows.
    (Before: letting the often-moved pods go took their versions out, the workload's rows fell
    below the versions they had been emitted at, and the promotion never reached them.)"""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 8)
    events = _big_workload()
    reference = Driver().feed(events).flush_parked()
    wl = reference.entities["wl:ml/Job/big"]
    assert len(wl["links"]) == 8 and len(wl["gone_links"]["v"]) == 22
    assert sorted(wl["links"]) == [f"pod:ml/z-{i:02d}" for i in range(14, 22)]  # the greatest names stay
    rows = {r.event_type: r for r in reference.rows.values() if r.identity.workload_id == "ml/Job/big" and r.identity.pod is None}
    assert {(t, r.attribution, r.identity.release_id, r.release_state) for t, r in rows.items()} == {
        ("scheduler.admitted", "workload_release", "r1", "release.approved"), ("scheduler.finished", "workload_release", "r1", "release.promoted")}
    for seed in range(12):
        order = list(events)
        random.Random(seed).shuffle(order)
        d = Driver(seed=seed).feed(order).flush_parked()
        assert d.latest(versions=True) == reference.latest(versions=True), f"seed {seed}"
        assert d.entities["wl:ml/Job/big"]["gone_links"] == wl["gone_links"], f"seed {seed}"


def test_a_workload_keeps_what_it_forwarded_only_for_the_pods_it_still_forwards_to(monkeypatch):
    """A workload forwards its release to its pods and to those it let go but keeps by name
    (``MAX_LINKS`` + ``MAX_GONE_LINKS``); what it last forwarded to every other pod it ever had is
    forgotten (``_forget_forwards``) — before, ``fwd`` grew with every pod a churning workload ever
    had (~46 bytes each in its head record, re-encoded at every touch) until the state no longer
    fitted in a changelog record. The rows are the same in any order, as before."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 8)
    monkeypatch.setattr(entities, "MAX_GONE_LINKS", 10)
    # 30 pods, the workload's release on its own event (Kueue's Workload labelled): it forwards it to its pods
    events = [*_big_workload(), pod_event("scheduler.admitted", 4.5, ns="ml", pod=None, workload="ml/Job/big", release_id="r1")]
    reference = Driver().feed(events).flush_parked()
    wl = reference.entities["wl:ml/Job/big"]
    kept = {*wl["links"], *wl["gone_links"]["v"]}
    assert len(kept) == 18 and set(wl["fwd"]) == kept
    assert wl["gone_links"]["extra"] > 0  # (12 pods' versions past MAX_GONE_LINKS: no longer forwarded to)
    for seed in range(8):
        order = list(events)
        random.Random(seed).shuffle(order)
        d = Driver(seed=seed).feed(order).flush_parked()
        # (the content: past ``MAX_GONE_LINKS`` a pod forwarded again counts its version again — a version
        # too high, never one too low: ``_gone_link``)
        assert d.latest() == reference.latest(), f"seed {seed}"
        assert set(d.entities["wl:ml/Job/big"]["fwd"]) == {*d.entities["wl:ml/Job/big"]["links"], *d.entities["wl:ml/Job/big"]["gone_links"]["v"]}


def test_a_dra_device_keeps_what_it_forwarded_only_for_the_pods_linked_to_it(monkeypatch):
    """A DRA device tells the pods linked to it what it is; a pod it let go past ``MAX_LINKS`` is no
    longer told, and what it last told it is forgotten (it grew with every pod the device ever
    had). Every claim's allocation still names the device's GPU."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_LINKS", 4)
    events = [*RELEASES, dra_device(0, pool="n1", device="gpu-0", uuid=GPU_P)]
    for i in range(12):
        events += [pod_event("scheduler.scheduled", 5 + i, pod=f"c{i}", release_id="r1"),
                   claim_event("gpu.claim_reserved", 5 + i, pod=f"c{i}", pod_uid=f"uid-c{i}", claim=f"c{i}-gpu"),
                   claim_event("gpu.claim_released", 5.5 + i, pod=f"c{i}", pod_uid=f"uid-c{i}", claim=f"c{i}-gpu", reason="unreserved")]
    d = Driver().feed(events).flush_parked()
    device = d.entities[f"gpu:n1/{CLAIMED}"]
    assert len(device["links"]) == 4 and set(device["fwd"]) == {src for src in device["links"] if src.startswith("pod:")}
    assert sorted((a.pod, a.gpu) for a in d.allocations.values()) == sorted((f"c{i}", GPU_P) for i in range(12))


def test_a_fact_only_an_old_alert_carries_stays_when_the_alert_goes_and_nothing_changes_without_its_version(monkeypatch):
    """The newest carrier of each of a pod's facts is never let go past ``MAX_ROWS``: a node only
    one early alert named stays the pod's node for every later row, as without a cap (with it gone,
    the scheduler row's older node came back at the same version: content changed without one)."""
    import streams.correlate.entities as entities

    events = [*RELEASES, pod_event("scheduler.scheduled", 5, release_id="r1", node="n1"), gpu_event("gpu.assigned", 6),
              alert(7, fp="early", namespace="ml", pod="p1", node="n2"),
              *[alert(10 + i, fp=f"later{i}", namespace="ml", pod="p1", node=None) for i in range(10)]]
    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", True)
    uncapped = Driver().feed(events).flush_parked()
    monkeypatch.setattr(entities, "MAX_ROWS", 6)
    capped = Driver().feed(events).flush_parked()
    assert capped.entities["pod:ml/p1"]["detached"] > 0 and capped.conflicts == 0
    assert capped.latest() == uncapped.latest()
    assert {r.identity.node for r in capped.rows.values() if r.event_type.startswith("alert.")} == {"n2"}


def test_a_batch_of_more_new_rows_than_the_cap_keeps_what_attributes_them(monkeypatch):
    """The worker folds a whole batch before it refreshes: a pod given more new rows in one batch
    than ``MAX_ROWS`` keeps them all until they go out (rows not yet emitted are never let go) and
    keeps its own rows too (scheduled, assigned) — every alert of the batch is attributed, and once
    they are out the pod is back within its bound."""
    import streams.correlate.entities as entities
    from streams.correlate.directory import ReleaseDirectory
    from streams.correlate.entities import event_row, fold_row, new_entity, refresh

    monkeypatch.setattr(entities, "MAX_ROWS", 6)
    directory = ReleaseDirectory()
    for ev in RELEASES:
        directory.apply(ev)
    state = new_entity("pod:ml/p1")
    for i, ev in enumerate([pod_event("scheduler.scheduled", 5, release_id="r1"), gpu_event("gpu.assigned", 6)]):
        fold_row(state, event_row(routed_event(ev), "pod", ("raw", 0, i)))
        refresh(state, directory)
    batch = [alert(10 + i, fp=f"x{i}", namespace="ml", pod="p1", node="n1") for i in range(9)]
    for i, ev in enumerate(batch):
        fold_row(state, event_row(routed_event(ev), "pod", ("raw", 0, 10 + i)))
    assert len(state["rows"]) == 11 and {"scheduler.scheduled", "gpu.assigned"} <= {r["type"] for r in state["rows"].values()}
    out = refresh(state, directory)
    assert sorted((r["attribution"], r["identity"].get("release_id")) for r in out.correlated) == [("release_label", "r1")] * 9
    assert len(state["rows"]) <= 6 and {"scheduler.scheduled", "gpu.assigned"} <= {r["type"] for r in state["rows"].values()}
    # A re-delivered event whose row went is not folded again (it went out; ``gone_ids``).
    assert not fold_row(state, event_row(routed_event(batch[0]), "pod", ("raw", 0, 10)))


def _gpu_past_a_small_bound(monkeypatch):
    """A node/GPU entity with MAX_ROWS 6 and MAX_GONE_IDS 8, and a directory holding RELEASES."""
    import streams.correlate.entities as entities
    from streams.correlate.directory import ReleaseDirectory

    monkeypatch.setattr(entities, "MAX_ROWS", 6)
    monkeypatch.setattr(entities, "MAX_GONE_IDS", 8)
    directory = ReleaseDirectory()
    for ev in RELEASES:
        directory.apply(ev)
    return entities, directory, entities.new_entity("gpu:n1/GPU-1111")


def test_every_row_one_trim_lets_go_is_remembered_however_many(monkeypatch):
    """A batch of more new rows than ``MAX_GONE_IDS`` past the cap: its refresh's trim lets them
    go together, and a crash after the state's changelog was written but before the batch's
    offsets were committed delivers the whole batch again. Every one of its events must be
    refused (``gone_ids`` keeps every id of the latest trim, not only the last 256): one folded
    again went out a second time and counted twice in the versions."""
    entities, directory, state = _gpu_past_a_small_bound(monkeypatch)
    from streams.correlate.entities import event_row, fold_row, refresh
    batch = [event_row(routed_event(alert(10 + i / 100, fp=f"x{i}", node="n1", gpu_id="GPU-1111")), "gpu", ("raw", 0, i))
             for i in range(40)]
    for row in batch:
        fold_row(state, dict(row))
    out = refresh(state, directory, park=False)
    assert len(out.correlated) == 40 and len(state["rows"]) <= 6 and state["detached"] >= 34
    before = orjson.dumps(state, option=orjson.OPT_SORT_KEYS)
    assert [fold_row(state, dict(row)) for row in batch] == [False] * 40
    assert orjson.dumps(state, option=orjson.OPT_SORT_KEYS) == before and not refresh(state, directory, park=False).correlated
    # Once the state was written twice more (its epoch's offsets committed), the ids go back to the bound.
    entities.state_written(state)
    entities.state_written(state)
    for i, ev in enumerate([alert(20 + i, fp=f"y{i}", node="n1", gpu_id="GPU-1111") for i in range(12)]):
        fold_row(state, event_row(routed_event(ev), "gpu", ("raw", 0, 100 + i)))
        refresh(state, directory, park=False)
        entities.state_written(state)  # an epoch a fold
    assert len(state["gone_ids"]) == 8


def test_every_row_let_go_since_the_write_before_the_last_is_remembered(monkeypatch):
    """One epoch of several batches past the bound (a trim after each) — the epoch's events may have
    been folded before the previous epoch's record was written, so a crash after this epoch's record
    and before its offsets delivers all of them again: every one must be refused, the state unchanged.
    Before, each trim kept only its own ids (and MAX_GONE_IDS): the first batch's were folded again,
    and folding them let the second's go. Written twice more, the ids go back to the bound."""
    entities, directory, state = _gpu_past_a_small_bound(monkeypatch)
    from streams.correlate.entities import event_row, fold_row, refresh

    def batch(start, n):
        return [event_row(routed_event(alert(10 + (start + i) / 100, fp=f"x{start + i}", node="n1", gpu_id="GPU-1111")),
                          "gpu", ("raw", 0, start + i)) for i in range(n)]

    before = batch(0, 5)  # an earlier epoch, written
    for row in before:
        fold_row(state, dict(row))
    refresh(state, directory, park=False)
    entities.state_written(state)
    epoch = [batch(100, 20), batch(200, 20), batch(300, 3)]  # its first batch folded before the write above happened
    for rows in epoch:
        for row in rows:
            fold_row(state, dict(row))
        refresh(state, directory, park=False)
    entities.state_written(state)  # the epoch's record; then the crash, before its offsets
    snapshot = orjson.dumps(state, option=orjson.OPT_SORT_KEYS)
    redelivered = [row for rows in epoch for row in rows]
    assert [r["id"] for r in redelivered if fold_row(state, dict(r))] == []
    assert orjson.dumps(state, option=orjson.OPT_SORT_KEYS) == snapshot and not refresh(state, directory, park=False).correlated
    entities.state_written(state)
    entities.state_written(state)
    for row in batch(400, 12):
        fold_row(state, dict(row))
        refresh(state, directory, park=False)
        entities.state_written(state)  # an epoch a fold
    assert len(state["gone_ids"]) == 8


def test_what_a_pod_past_its_row_cap_never_lets_go():
    """``_needed``: the rows not yet emitted, the newest carrier of each fact, the start of an
    interval still open, the end of one whose start is kept (an assignment arriving late, after its
    release: without its end it would open again) and the last deletion."""
    import streams.correlate.entities as entities
    from streams.correlate.entities import event_row, new_entity

    state = new_entity("pod:ml/p1")
    evs = {"scheduled": pod_event("scheduler.scheduled", 5, release_id="r1"), "a1": gpu_event("gpu.assigned", 6),
           "r1": gpu_event("gpu.released", 8), "a2": gpu_event("gpu.assigned", 9, device="GPU-2222"),
           "late-a": gpu_event("gpu.assigned", 10, device="GPU-3333"), "late-r": gpu_event("gpu.released", 12, device="GPU-3333"),
           "deleted": pod_event("scheduler.deleted", 20, release_id="r1"), "after": pod_event("scheduler.finished", 21, release_id="r1"),
           **{f"alert{i}": alert(13 + i * 0.1, fp=f"x{i}", namespace="ml", pod="p1") for i in range(3)}}
    ids = {}
    for name, ev in evs.items():
        row = event_row(routed_event(ev), "pod", ("raw", 0, len(ids)))
        state["rows"][row["id"]] = row
        ids[name] = row["id"]
    state["sent"] = {rid: 1 for name, rid in ids.items() if name != "late-a"}  # the late assignment not emitted yet
    needed = {name for name, rid in ids.items() if rid in entities._needed(state)}
    assert {"late-a", "late-r", "a2", "deleted"} <= needed  # unsent; its end; an open interval's start; the last deletion
    assert "a1" not in needed and "r1" not in needed  # a closed interval, its start not kept otherwise


@pytest.mark.parametrize("verify", [False, True])
def test_a_pod_whose_own_rows_pass_the_cap_still_ends_every_allocation(monkeypatch, verify):
    """A pod assigned and released a GPU five times past ``MAX_ROWS`` (its own rows pass the cap):
    the rows its intervals were counted from still count when they go (``gone_held``), so every
    release raises its interval's version and every allocation is stored ended, as without a cap
    (before, a release arriving as an old row of the same device went kept the version: the end
    was never written, the allocations stayed open for ever)."""
    import streams.correlate.entities as entities

    events = [*RELEASES, pod_event("scheduler.scheduled", 5, release_id="r1")]
    for cycle in range(5):
        events += [gpu_event("gpu.assigned", 10 + cycle * 10), gpu_event("gpu.released", 15 + cycle * 10)]
    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", verify)
    uncapped = Driver().feed(events).flush_parked()
    monkeypatch.setattr(entities, "MAX_ROWS", 6)
    capped = Driver().feed(events).flush_parked()
    assert capped.entities["pod:ml/p1"]["detached"] > 0 and capped.conflicts == 0
    ends = sorted((a.started_at, a.ended_at) for a in capped.allocations.values())
    assert ends == sorted((a.started_at, a.ended_at) for a in uncapped.allocations.values()) and all(end for _start, end in ends)


def test_a_batch_past_the_cap_looks_for_rows_to_let_go_once_per_tenth_of_the_bound(monkeypatch):
    """Folding a batch of new rows into a pod over its bound: while only needed rows are there (none
    emitted yet), a fold looks again only a tenth of the bound later (each look walks every row), and
    the refresh's ``trim`` brings it back within the bound once they are out."""
    import streams.correlate.entities as entities
    from streams.correlate.directory import ReleaseDirectory
    from streams.correlate.entities import event_row, fold_row, new_entity, refresh

    monkeypatch.setattr(entities, "MAX_ROWS", 100)
    looks = []
    needed = entities._needed
    monkeypatch.setattr(entities, "_needed", lambda state: looks.append(1) or needed(state))
    directory = ReleaseDirectory()
    for ev in RELEASES:
        directory.apply(ev)
    state = new_entity("pod:ml/p1")
    fold_row(state, event_row(routed_event(pod_event("scheduler.scheduled", 5, release_id="r1")), "pod", ("raw", 0, 0)))
    refresh(state, directory)
    for i in range(300):
        fold_row(state, event_row(routed_event(alert(10 + i * 0.01, fp=f"x{i}", namespace="ml", pod="p1")), "pod", ("raw", 0, 1 + i)))
    assert len(state["rows"]) == 301 and 15 <= len(looks) <= 25  # (one per 10 rows past 100, not 200)
    out = refresh(state, directory)
    assert len(out.correlated) == 300 and len(state["rows"]) <= 100


def test_a_long_list_of_ids_let_go_is_searched_as_a_set_never_a_stale_one():
    """Past a burst ``gone_ids`` holds thousands of ids, searched per fold: as a set, cached by the
    list — and ``trim``'s next list (a new one) is searched afresh, never through the old one's set."""
    from streams.correlate.entities import _gone, fold_row

    state = {"rows": {}, "gone_ids": [f"id{i}" for i in range(1000)]}
    assert _gone(state, "id999") and _gone(state, "id0") and not _gone(state, "id1000")
    state["gone_ids"] = state["gone_ids"][500:] + ["id1000"]  # as trim makes it: a new list
    assert _gone(state, "id1000") and not _gone(state, "id0") and _gone(state, "id500")
    assert fold_row(state, {"id": "id0", "payload": "", "summary": ""}) is True
    assert fold_row(state, {"id": "id700", "payload": "", "summary": ""}) is False and sorted(state["rows"]) == ["id0"]


def test_a_gpu_rows_summary_names_its_device_or_for_a_nodes_allocatable_snapshot_how_many():
    """A node's allocatable snapshot names no one device: its summary read "allocatable  on n3" (a
    docs review ran the demo's query). It gives the count and the resource now."""
    from streams.correlate.release import summarize

    assert summarize("gpu.allocatable", {"node": "n3", "resource_name": "nvidia.com/gpu", "devices": ["GPU-a", "GPU-b"]}) == \
        "allocatable 2 device(s) of nvidia.com/gpu on n3"
    assert summarize("gpu.assigned", {"node": "n3", "device_id": "GPU-a"}) == "assigned GPU-a on n3"
    assert summarize("gpu.allocatable", {"node": "n3"}) == "allocatable on n3"


# --- an alert naming only its model: the release serving when it fired ------------------------------------------

def test_a_model_only_alert_is_attributed_to_the_release_serving_when_it_fired_in_any_order():
    """Chosen by their latest events overall, an alert naming only its model went to the model's
    newest release: one registered after it fired, and — once a third release was registered for
    staging a day later, never promoted — to that one, every model-only alert of the model with it
    (an exploratory review). Each alert now goes to the release serving at its own time, whatever
    order the events are processed in; one firing before any release of the model, to the first."""
    def rel(etype, minutes, rid, version, env="prod", **payload):
        return release(etype, minutes, rid=rid, model="churn", version=version, env=env, digest="sha256:" + version * 64, **payload)

    events = [rel("release.registered", 0, "churn:1", "1"), rel("release.approved", 5, "churn:1", "1", actor="alice"),
              rel("release.promoted", 10, "churn:1", "1", to_environment="prod"),
              rel("release.registered", 60, "churn:2", "2"), rel("release.promoted", 70, "churn:2", "2", to_environment="prod"),
              alert(-30, fp="before-any", model_name="churn"), alert(30, fp="while-1", model_name="churn"),
              alert(100, fp="while-2", model_name="churn"),
              rel("release.rolled_back", 200, "churn:2", "2", to_environment="prod"), alert(230, fp="after-rollback", model_name="churn"),
              rel("release.registered", 24 * 60, "churn:3", "3", env="staging"), alert(24 * 60 + 5, fp="day-2", model_name="churn"),
              rel("release.promoted", 24 * 60 + 10, "churn:3", "3", env="staging", to_environment="staging"),
              alert(24 * 60 + 15, fp="day-2-staged", model_name="churn")]
    # A release registered and never promoted does not take the alerts of the one in service (day 2);
    # once promoted too, the later one does.
    expected = {"before-any": "churn:1", "while-1": "churn:1", "while-2": "churn:2", "after-rollback": "churn:1", "day-2": "churn:1",
                "day-2-staged": "churn:3"}
    for seed in (None, 1, 2, 3):
        d = Driver(seed=seed).feed(events).flush_parked()
        got = {r.identity.alert_fingerprint: r.identity.release_id for r in d.rows.values() if r.event_type.startswith("alert.")}
        assert got == expected, (seed, got)
        assert d.conflicts == 0
