"""The eight controls as pure rules: for each, a history that opens it, one that must not,
and one where it opens then closes. Events go through the real join (the in-memory
driver of tests/streams/harness.py), then through the control engine — the same fold
and step functions the worker's agents call."""

from __future__ import annotations

import random
from datetime import timedelta

import orjson
import pytest

from streams.controls.policy import Policy, Role
from schemas import AlertEvent, Identity, SchedulerEvent, make_event_id
from schemas.alert import AlertPayload
from schemas.scheduler import ObjectRef, SchedulerPayload
from streams.controls.rules import ControlEngine, is_withdrawn
from tests.streams.harness import SRC, Driver, at, gpu_event, release

D1, D2 = "sha256:" + "b" * 64, "sha256:" + "e" * 64
POLICY = Policy()


def rel(etype, minutes, rid="r1", **payload):
    return release(etype, minutes, rid=rid, digest=D1, **payload)


def released(rid="r1", promoted=True, approver="alice"):
    out = [rel("release.registered", 0, rid, actor="ci-pipeline"), rel("release.approved", 1, rid, actor=approver, approval_id="CHG-1")]
    if promoted:
        out.append(rel("release.promoted", 2, rid, actor="alice", to_environment="prod"))
    return out


def sched(etype, minutes, pod="p1", workload="ml/Job/train", ns="ml", kind="Pod", release_id=None, env=None, digest=None, **payload):
    ident = Identity(namespace=ns, workload_id=workload, release_id=release_id, environment=env,
                     **({"pod": pod, "pod_uid": f"uid-{pod}"} if kind == "Pod" else {}))
    return SchedulerEvent(event_id=make_event_id("t", (ns, pod if kind == "Pod" else workload, etype), at(minutes).isoformat()),
                          event_type=etype, occurred_at=at(minutes), observed_at=at(minutes), source=SRC, identity=ident,
                          payload=SchedulerPayload(object_kind=kind, image_digests=(digest,) if digest else (), **payload))


def firing(minutes, fp="fp1", status="alert.firing", starts=None, name="GpuXidError", labels=None, **ident):
    starts = at(starts if starts is not None else minutes)
    return AlertEvent(event_id=make_event_id("am", (fp, status, starts.isoformat())), event_type=status, occurred_at=at(minutes),
                      observed_at=at(minutes), source=SRC, identity=Identity(alert_fingerprint=fp, **ident),
                      payload=AlertPayload(alertname=name, labels=labels or {}, starts_at=starts,
                                           ends_at=at(minutes) if status == "alert.resolved" else None))


def run(events, watermark=None, policy=POLICY, seed=None, chunks=1):
    driver = Driver(seed=seed).feed(events).flush_parked()
    engine = ControlEngine(driver.directory, policy, at(watermark) if watermark is not None else None)
    rows, allocs = list(driver.rows.values()), list(driver.allocations.values())
    if seed is not None:
        random.Random(seed).shuffle(rows)
        random.Random(seed).shuffle(allocs)
    for i in range(chunks):  # several evaluation rounds: inputs arrive over time, not at once
        engine.feed(rows[i::chunks], allocs[i::chunks]).run()
    return engine.current()


def of(violations, control):
    return [v for v in violations if v.control_id == control]


def one(violations, control):
    found = of(violations, control)
    assert len(found) == 1, f"control {control}: {[v.detail for v in violations]}"
    return found[0]


# --- 1. Admission ------------------------------------------------------------------------

def test_admission_without_release_identity_or_approval_opens():
    v = one(run([sched("scheduler.scheduled", 10, pod="u1", workload="ml/Job/u1")]), 1)
    assert "no release identity" in v.detail and v.opened_at == at(10) and v.closed_at is None
    assert v.owner == "team-platform" and v.severity == "critical" and v.identity.workload_id == "ml/Job/u1"
    unapproved = run([rel("release.registered", 0, "r2", actor="ci-pipeline"), sched("scheduler.scheduled", 10, release_id="r2")])
    v = one(unapproved, 1)
    assert "release r2 had no approval for prod" in v.detail and v.identity.release_id == "r2" and v.closed_at is None


def test_admission_with_approved_release_or_in_dev_does_not_open():
    assert of(run([*released(), sched("scheduler.scheduled", 10, release_id="r1"), sched("scheduler.running", 11, release_id="r1")]), 1) == []
    assert of(run([sched("scheduler.scheduled", 10, pod="d1", workload="dev/Job/d1", ns="dev", env="dev")]), 1) == []


def test_a_workloads_dev_label_in_a_namespace_the_policy_maps_to_prod_is_judged_as_prod():
    """The label is the workload creator's word: in a namespace the policy maps to prod, a Job
    labelled `gpuledger.io/environment: dev` skipped control 1 (and the admission webhook let it in)."""
    from streams.controls.policy import Admission, NamespaceAdmission

    policy = Policy(admission=Admission(namespaces={"fraud-prod": NamespaceAdmission(environment="prod")}))
    events = [rel("release.registered", 0, "r2", actor="ci-pipeline"),
              sched("scheduler.scheduled", 10, pod="x1", workload="fraud-prod/Job/x1", ns="fraud-prod", release_id="r2", env="dev")]
    v = one(run(events, policy=policy), 1)
    assert "release r2 had no approval for prod" in v.detail, v.detail
    assert of(run(events), 1) == []  # (without the mapping the label is all there is: dev needs no approval)


def test_admission_opens_then_closes_on_approval_or_when_the_workload_ends():
    events = [rel("release.registered", 0, "r2", actor="ci-pipeline"), sched("scheduler.scheduled", 10, release_id="r2"),
              rel("release.approved", 20, "r2", actor="alice")]
    v = one(run(events), 1)
    assert (v.opened_at, v.closed_at) == (at(10), at(20))
    ended = one(run([sched("scheduler.scheduled", 10, pod="u1", workload="ml/Job/u1"),
                     sched("scheduler.deleted", 30, pod="u1", workload="ml/Job/u1")]), 1)
    assert (ended.opened_at, ended.closed_at) == (at(10), at(30))


def test_an_approval_by_an_actor_without_the_right_does_not_count():
    out = run([*released("r2", promoted=True, approver="mallory"), sched("scheduler.scheduled", 10, release_id="r2")])
    # approved, but not by an actor with the right: said as such, not "no approval"
    detail = one(out, 1).detail
    assert ("release r2 was approved for prod only by mallory (unauthenticated) at 2026-11-01T08:01:00.000Z, which does not count: "
            "mallory holds no role; none grants approve") in detail
    assert "no approval" not in detail
    assert "mallory holds no role; none grants approve" in one(out, 7).detail


def test_a_late_approval_that_predates_the_admission_withdraws_the_violation():
    driver = Driver().feed([rel("release.registered", 0, "r2"), sched("scheduler.scheduled", 10, release_id="r2")])
    engine = ControlEngine(driver.directory, POLICY).feed(driver.rows.values())
    engine.run()
    [opened] = of(engine.current(), 1)
    driver.feed([rel("release.approved", 5, "r2", actor="alice")])  # arrives late, happened before the admission
    engine.run(refresh_all=True)
    [v] = [v for v in engine.violations.values() if v.control_id == 1]
    assert is_withdrawn(v) and v.version > opened.version and v.closed_at == v.opened_at
    assert of(engine.current(), 1) == []


# --- 2. Promotion ------------------------------------------------------------------------

def test_running_in_an_environment_never_promoted_to_opens():
    v = one(run([*released(promoted=False), sched("scheduler.running", 10, release_id="r1")]), 2)
    assert "never promoted to prod" in v.detail and v.opened_at == at(10) and v.closed_at is None and v.owner == "team-mlops"


def test_a_promotion_without_an_actor_is_not_never_promoted():
    events = [*released(promoted=False), rel("release.promoted", 2, actor=None, to_environment="prod"), sched("scheduler.running", 10, release_id="r1")]
    out = run(events)
    v = one(out, 2)
    assert "was promoted to prod only by no recorded actor at 2026-11-01T08:02:00.000Z, which does not count: no actor was recorded" in v.detail
    assert "never promoted" not in v.detail
    assert "promoted to prod of release r1 without the decision right: no actor was recorded" in one(out, 7).detail


def test_running_after_promotion_does_not_open():
    assert of(run([*released(), sched("scheduler.running", 10, release_id="r1")]), 2) == []


def test_promotion_opens_then_closes_on_promotion_and_rollback_reopens_until_the_pod_ends():
    v = one(run([*released(promoted=False), sched("scheduler.running", 10, release_id="r1"),
                 rel("release.promoted", 15, actor="alice", to_environment="prod")]), 2)
    assert (v.opened_at, v.closed_at) == (at(10), at(15))
    rolled = one(run([*released(), sched("scheduler.running", 10, release_id="r1"),
                      rel("release.rolled_back", 30, actor="bob", to_environment="prod"),
                      sched("scheduler.deleted", 40, release_id="r1")]), 2)
    assert (rolled.opened_at, rolled.closed_at) == (at(30), at(40)) and "rolled back from prod" in rolled.detail


# --- 3. Artifact identity ---------------------------------------------------------------

def test_running_image_that_differs_from_the_manifest_opens():
    v = one(run([*released(), sched("scheduler.running", 10, release_id="r1", digest=D2)]), 3)
    assert D2 in v.detail and D1 in v.detail and v.closed_at is None and v.identity.pod == "p1"


def test_identifiers_that_match_no_release_open():
    out = run([sched("scheduler.scheduled", 10, release_id="ghost", env="dev")])
    assert "names release ghost" in one(out, 3).detail
    model = run([SchedulerEvent(**{**sched("scheduler.scheduled", 10, env="dev").model_dump(),
                                   "identity": Identity(namespace="ml", pod="p1", workload_id="ml/Job/train", environment="dev",
                                                        model_name="unknown-model", model_version="3")})])
    assert "model unknown-model:3, which matches no release" in one(model, 3).detail


def test_matching_image_does_not_open():
    assert of(run([*released(), sched("scheduler.running", 10, release_id="r1", digest=D1)]), 3) == []


def test_artifact_mismatch_opens_then_closes_when_the_pod_ends():
    v = one(run([*released(), sched("scheduler.running", 10, release_id="r1", digest=D2), sched("scheduler.deleted", 25, release_id="r1")]), 3)
    assert (v.opened_at, v.closed_at) == (at(10), at(25))


def test_rows_of_a_stopped_pod_that_still_name_its_images_open_nothing_more():
    """From an exploratory review: the pod's stop (and anything after it) carrying the wrong image
    opened further control 3 violations, each opened and closed at the stop — three for one
    pod. A row outside the pod's running intervals is not running anything."""
    events = [*released(), sched("scheduler.queued", 9, release_id="r1", digest=D2), sched("scheduler.running", 10, release_id="r1", digest=D2),
              sched("scheduler.finished", 25, release_id="r1", digest=D2), sched("scheduler.deleted", 26, release_id="r1", digest=D2)]
    v = one(run(events), 3)
    assert (v.opened_at, v.closed_at) == (at(10), at(25))


# --- 4. Priority and preemption -----------------------------------------------------------------

KUEUE = dict(kind="Workload", workload="risk/scorer", ns="risk")


def _victim(preempt_at, preemptor=None, **extra):
    return [sched("scheduler.admitted", 10, release_id="r1", priority_class="prod-high", **KUEUE),
            sched("scheduler.preempted", preempt_at, release_id="r1", priority_class="prod-high", reason="Preempted",
                  preemptor=preemptor, **KUEUE, **extra)]


def test_preemption_inside_the_observation_window_opens_and_closes_at_the_window_end():
    events = [*released(), *_victim(30)]
    v = one(run(events, watermark=60), 4)
    assert "inside the prod observation window" in v.detail and v.opened_at == at(30) and v.closed_at is None
    closed = one(run(events, watermark=200), 4)  # the watermark passed promotion (2) + 2h
    assert closed.closed_at == at(122)


def test_preemption_by_a_lower_business_priority_opens_and_closes_on_readmission():
    burst = ObjectRef(kind="Workload", namespace="research", name="burst")
    events = [*released(), *_victim(150, preemptor=burst),
              sched("scheduler.admitted", 149, workload="research/burst", ns="research", kind="Workload", priority_class="research-burst")]
    v = one(run(events), 4)
    assert "business priority 90" in v.detail and "business priority 20" in v.detail and v.closed_at is None
    again = one(run([*events, sched("scheduler.admitted", 170, release_id="r1", priority_class="prod-high", **{**KUEUE})]), 4)
    assert again.closed_at == at(170)


def test_preemption_outside_the_window_by_a_higher_priority_does_not_open():
    vip = ObjectRef(kind="Workload", namespace="risk", name="vip")
    events = [*released(), *_victim(150, preemptor=vip),
              sched("scheduler.admitted", 149, workload="risk/vip", ns="risk", kind="Workload", priority_class="prod-critical")]
    assert of(run(events), 4) == []


# --- 5. Capacity reservation ------------------------------------------------------------------

def _reserve(minutes=5, start=10, end=100, gpus=2, actor="carol"):
    return rel("release.reservation_created", minutes, actor=actor,
               reservation={"reservation_id": "res-1", "gpus": gpus, "pool": "a100", "window_start": at(start), "window_end": at(end)})


def _unreserve(minutes):
    return rel("release.reservation_released", minutes, actor="carol", reservation={"reservation_id": "res-1", "gpus": 2})


def test_reservation_unused_past_its_grace_opens():
    v = one(run([*released(), _reserve()], watermark=80), 5)
    assert "no GPU allocated" in v.detail and v.opened_at == at(70) and v.closed_at is None and v.owner == "team-capacity"


def test_reservation_used_to_plan_and_released_does_not_open():
    events = [*released(), _reserve(), sched("scheduler.scheduled", 19, release_id="r1"), sched("scheduler.scheduled", 19, pod="p2", release_id="r1"),
              gpu_event("gpu.assigned", 20), gpu_event("gpu.assigned", 20, pod="p2", device="GPU-2"),
              gpu_event("gpu.released", 90), gpu_event("gpu.released", 90, pod="p2", device="GPU-2"), _unreserve(95)]
    assert of(run(events, watermark=300), 5) == []


def test_reservation_opens_then_closes_on_first_use_and_when_released_after_the_window():
    events = [*released(), _reserve(gpus=4), sched("scheduler.scheduled", 74, release_id="r1"), gpu_event("gpu.assigned", 75), _unreserve(170)]
    out = of(run(events, watermark=200), 5)
    unused = next(v for v in out if "no GPU allocated" in v.detail)
    assert (unused.opened_at, unused.closed_at) == (at(70), at(75))
    held = next(v for v in out if "still held" in v.detail)
    assert (held.opened_at, held.closed_at) == (at(160), at(170))
    under = next(v for v in out if "peak" in v.detail)
    assert under.severity == "info" and "peak 1 of 4" in under.detail and (under.opened_at, under.closed_at) == (at(10), at(100))


# --- 6. Telemetry correlation -----------------------------------------------------------

def test_unattributed_alert_opens():
    v = one(run([firing(10, node="n9")]), 6)
    assert "GpuXidError" in v.detail and v.severity == "warning" and v.closed_at is None and v.identity.alert_fingerprint == "fp1"
    quality = one(run([firing(10, fp="q", name="ModelQualityDegraded")]), 6)
    assert quality.severity == "critical"


def test_attributed_alert_does_not_open():
    assert of(run([*released(), firing(10, release_id="r1")]), 6) == []


def test_unattributed_alert_opens_then_closes_when_resolved():
    v = one(run([firing(10), firing(20, status="alert.resolved", starts=10)]), 6)
    assert (v.opened_at, v.closed_at) == (at(10), at(20))


# --- 7. Incident authority --------------------------------------------------------------

def test_admin_action_without_the_right_and_override_without_expiry_open():
    out = of(run([*released(), rel("release.queue_paused", 10, actor="mallory", target="prod-inference", expires_at=at(70)),
                  rel("release.priority_overridden", 12, actor="bob", target="risk/scorer")], watermark=30), 7)
    details = sorted(v.detail for v in out)
    assert len(out) == 2
    assert "queue_paused prod-inference of release r1 without the decision right: mallory holds no role" in details[1]
    assert "has no expiry" in details[0]


def test_a_relay_with_no_recorded_actor_says_so():
    """An event naming on_behalf_of and no actor (the receiver took it anonymously; straight to Kafka
    it still can be written): control 7 read "without the decision right:  acted for user:alice"."""
    detail = one(run([*released(), rel("release.node_isolated", 10, on_behalf_of="user:alice", target="n3")], watermark=30), 7).detail
    assert "node_isolated n3 of release r1 without the decision right: no recorded actor acted for user:alice (nobody to hold the " \
           "delegate right)" in detail, detail
    assert ":  " not in detail, detail


PROVEN = POLICY.model_copy(update={
    "authentication": POLICY.authentication.model_copy(update={"require_for_rights": True}),
    "roles": {**POLICY.roles, "ci": Role(owner="team-mlops", members=("service:ci-gitlab",), actions=("delegate",))}})


def test_with_proof_required_rights_count_only_for_authenticated_actors_and_granted_delegations():
    def approved(approver_payload, rid="r2"):
        return run([rel("release.registered", 0, rid), rel("release.approved", 1, rid, approval_id="CHG-1", **approver_payload),
                    sched("scheduler.scheduled", 10, release_id=rid, pod=f"p-{rid}", workload=f"ml/Job/{rid}"),
                    rel("release.node_isolated", 12, rid, target="n3", **{**approver_payload, "actor": approver_payload.get("actor", "")
                                                                        .replace("alice", "oncall-sre")})], policy=PROVEN)
    # Typed, not proven (the CLI straight to Kafka): the approval does not count and control 7 says why.
    typed = approved({"actor": "alice"})
    assert "only by alice (unauthenticated)" in one(typed, 1).detail and "alice was not authenticated" in one(typed, 1).detail
    details = sorted(v.detail for v in of(typed, 7))
    assert any("alice was not authenticated" in d for d in details) and any("oncall-sre was not authenticated" in d for d in details)
    # The same people, proven by the receiver: nothing to report.
    proven = approved({"actor": "user:alice", "authenticated_by": "token"})
    assert of(proven, 1) == [] and of(proven, 7) == []
    # CI acting for alice: counts because the policy grants ci-gitlab the delegate right ...
    delegated = approved({"actor": "service:ci-gitlab", "on_behalf_of": "user:alice", "authenticated_by": "token"})
    assert of(delegated, 1) == []
    # ... and does not for a service without it.
    rogue = approved({"actor": "service:jenkins", "on_behalf_of": "user:alice", "authenticated_by": "token"})
    assert "which does not count: service:jenkins acted for user:alice without the delegate right" in one(rogue, 1).detail
    assert any("service:jenkins acted for user:alice without the delegate right" in v.detail for v in of(rogue, 7))
    # An unproven revocation (an anonymous POST naming 'mallory', or alice typed) does not end a proven approval.
    for revoker in ("mallory", "alice"):
        kept = run([rel("release.registered", 0, "r3"), rel("release.approved", 1, "r3", approval_id="CHG-3", actor="user:alice",
                                                             authenticated_by="token"),
                    rel("release.revoked", 5, "r3", actor=revoker, reason="drift"),
                    sched("scheduler.scheduled", 10, release_id="r3", pod="p-r3", workload="ml/Job/r3")], policy=PROVEN)
        assert of(kept, 1) == [], [v.detail for v in kept]
    revoked = run([rel("release.registered", 0, "r3"), rel("release.approved", 1, "r3", approval_id="CHG-3", actor="user:alice",
                                                            authenticated_by="token"),
                   rel("release.revoked", 5, "r3", actor="user:alice", authenticated_by="token", reason="drift"),
                   sched("scheduler.scheduled", 10, release_id="r3", pod="p-r3", workload="ml/Job/r3")], policy=PROVEN)
    assert "release r3 was revoked or retired before admission" in one(revoked, 1).detail
    # Without require_for_rights (the default), a typed name is judged as before.
    assert of(run([*released(), sched("scheduler.scheduled", 10, release_id="r1")]), 1) == []


GROUPS = PROVEN.model_copy(update={"roles": {
    **PROVEN.roles,
    "oncall": Role(owner="team-platform", members=("group:oncall",), actions=("isolate_node", "approve")),
    "ci": Role(owner="team-mlops", members=("group:ci",), actions=("delegate",))}})


def test_a_right_granted_to_a_group_counts_only_through_authenticated_groups_and_the_evidence_names_it():
    def history(payload, rid="r2"):
        return run([rel("release.registered", 0, rid), sched("scheduler.scheduled", 10, release_id=rid, pod=f"p-{rid}", workload=f"ml/Job/{rid}"),
                    rel("release.node_isolated", 11, rid, target="n3", **payload), rel("release.approved", 12, rid, approval_id="CHG-2", **payload)],
                    policy=GROUPS, watermark=20)
    # Proven with the group: the isolation is within the right, and the approval closes control 1 naming the group.
    member = history({"actor": "user:zoe", "authenticated_by": "token", "actor_groups": ("oncall",)})
    assert of(member, 7) == []
    assert "; approved at 2026-11-01T08:12:00.000Z by user:zoe (role oncall via group:oncall)" in one(member, 1).detail
    assert one(member, 1).closed_at == at(12)
    # The same groups typed on an event nobody proved count for nothing, even where proof is not required.
    typed = [rel("release.registered", 0, "r3"), rel("release.node_isolated", 11, "r3", target="n3", actor="zoe", actor_groups=("oncall",))]
    assert "zoe was not authenticated" in one(run(typed, policy=GROUPS), 7).detail
    lax = GROUPS.model_copy(update={"authentication": POLICY.authentication})
    assert "zoe holds no role; none grants isolate_node" in one(run(typed, policy=lax), 7).detail
    # A typed actor named like the group is not the group.
    assert not lax.allowed("group:oncall", "isolate_node") and not lax.allowed("unauthenticated:group:oncall", "isolate_node")
    # Nor is a proven user whose name reads as one (an OIDC subject "group:oncall" is user:group:oncall), alone, acted
    # for by a service, or typed (exploratory review: the bare-name match read it as "group:oncall", and it held the role).
    assert not GROUPS.allowed("user:group:oncall", "isolate_node") and GROUPS.memberships("user:group:oncall") == []
    assert not GROUPS.allowed("service:ci-runner>user:group:oncall\x1fci", "isolate_node")
    assert not lax.allowed("unauthenticated:user:group:oncall", "isolate_node")
    forged = [rel("release.registered", 0, "r5"), rel("release.node_isolated", 11, "r5", target="n3", actor="user:group:oncall",
                                                      authenticated_by="oidc")]
    assert "user:group:oncall holds no role; none grants isolate_node" in one(run(forged, policy=GROUPS), 7).detail
    assert GROUPS.allowed("user:alice", "approve")  # a bare policy member ("alice") still matches its proven form
    # ... and so does a bare name with ':' in it that is not a typed member (an OIDC subject such as a service account's)
    deployer = GROUPS.model_copy(update={"roles": {**GROUPS.roles, "deployers": Role(owner="team-platform",
                                                                                      members=("system:serviceaccount:ci:deployer",),
                                                                                      actions=("approve",))}})
    assert deployer.allowed("user:system:serviceaccount:ci:deployer", "approve")
    # Proven, without the group: control 7 says which groups were considered.
    outsider = history({"actor": "user:yves", "authenticated_by": "token", "actor_groups": ("interns",)})
    assert any("user:yves (groups: interns) holds no role; none grants isolate_node" in v.detail for v in of(outsider, 7))
    # Ratified by a group member: the open violation closes and says through which group.
    ratified = one(run([rel("release.registered", 0, "r4"),
                        rel("release.node_isolated", 1, "r4", target="n3", actor="user:yves", authenticated_by="token"),
                        rel("release.node_isolated", 5, "r4", target="n3", actor="user:zoe", authenticated_by="token", actor_groups=("oncall",))],
                       policy=GROUPS), 7)
    assert ratified.closed_at == at(5) and "ratified at 2026-11-01T08:05:00.000Z by user:zoe (role oncall via group:oncall)" in ratified.detail
    # A delegation: the service's authenticated group holds delegate; the person's right is their own (a service vouches for no groups).
    ci = {"actor": "service:ci-runner", "on_behalf_of": "user:alice", "authenticated_by": "token", "actor_groups": ("ci",)}
    assert GROUPS.granted("service:ci-runner>user:alice\x1fci", "approve") == "role release-managers, delegated by service:ci-runner (role ci via group:ci)"
    assert not GROUPS.allowed("service:ci-runner>user:zoe\x1fci\x1foncall", "approve")
    delegated = history(ci)
    assert "by service:ci-runner for user:alice (role release-managers, delegated by service:ci-runner (role ci via group:ci))" in one(delegated, 1).detail
    assert "user:alice holds release-managers; none grants isolate_node" in one(delegated, 7).detail  # alice may approve, not isolate


def test_authorized_actions_with_expiry_do_not_open():
    events = [*released(), rel("release.priority_overridden", 10, actor="bob", target="risk/scorer", expires_at=at(70)),
              rel("release.node_isolated", 11, actor="oncall-sre", target="n3"), rel("release.rolled_back", 12, actor="bob", to_environment="prod")]
    assert of(run(events, watermark=500), 7) == []


def test_authority_opens_then_closes_on_ratification_and_overlong_override_closes_at_expiry():
    ratified = one(run([rel("release.registered", 0), rel("release.approved", 1, actor="mallory"), rel("release.approved", 5, actor="alice")]), 7)
    assert (ratified.opened_at, ratified.closed_at) == (at(1), at(5))
    long = [*released(), rel("release.priority_overridden", 10, actor="bob", target="risk/scorer", expires_at=at(10 + 360))]
    v = one(run(long, watermark=300), 7)
    assert "past the 4h maximum" in v.detail and v.opened_at == at(250) and v.closed_at is None
    assert one(run(long, watermark=400), 7).closed_at == at(370)


def test_a_ratification_in_the_same_instant_counts_whatever_the_event_ids():
    """Rows of one instant were taken in event-id order, and only a later row ratified: an
    authorised repeat in the same second as the unauthorised action counted or not by the hash of
    two ids — the documented pipeline gives every step one --at (docs/receiver.md). In the same
    instant it is no violation at all."""
    for ratifier_id, action_id in (("0" * 32, "f" * 32), ("f" * 32, "0" * 32)):
        unauthorised = rel("release.approved", 1, actor="ci-pipeline", approval_id="CHG-1").model_copy(update={"event_id": action_id})
        approver = rel("release.approved", 1, actor="alice", approval_id="CHG-1").model_copy(update={"event_id": ratifier_id})
        # Ratified in the same instant: the decision never stood on ci-pipeline's word alone — no violation
        # (one opened and closed at once failed the audit all the same).
        assert of(run([rel("release.registered", 0), unauthorised, approver], watermark=60), 7) == [], ratifier_id
        # A second later, it stood on it for a second: opened, then closed by the ratification.
        later = approver.model_copy(update={"occurred_at": at(1) + timedelta(seconds=1)})
        v = one(run([rel("release.registered", 0), unauthorised, later], watermark=60), 7)
        assert (v.opened_at, v.closed_at) == (at(1), at(1) + timedelta(seconds=1)), (ratifier_id, v)


def test_another_reservation_does_not_ratify_an_unentitled_one():
    """Review: "the same decision" compared type, target and environment — carol's reservation res-1
    of 2 GPUs ratified mallory's res-evil of 64 (in the same instant: no violation at all)."""
    def reserve(res_id, actor, gpus, minutes, eid):
        return rel("release.reservation_created", minutes, actor=actor, reservation={
            "reservation_id": res_id, "gpus": gpus, "pool": "a100", "window_start": at(10), "window_end": at(100)}).model_copy(update={"event_id": eid})

    for carol_id, mallory_id in (("0" * 32, "f" * 32), ("f" * 32, "0" * 32)):
        for minutes in (5, 6):  # the same instant, and carol's a minute later
            events = [*released(), reserve("res-evil", "mallory", 64, 5, mallory_id), reserve("res-1", "carol", 2, minutes, carol_id)]
            v = one(run(events, watermark=80), 7)
            assert v.closed_at is None and "reservation_created" in v.detail and "mallory" in v.detail, (minutes, v.detail)
    # Carol reserving res-evil itself ratifies it.
    events = [*released(), reserve("res-evil", "mallory", 64, 5, "f" * 32), reserve("res-evil", "carol", 64, 6, "0" * 32)]
    assert one(run(events, watermark=80), 7).closed_at == at(6)
    # Only reservation events compare reservations: an approval carrying one is still ratified by alice's (review).
    junk = rel("release.approved", 1, actor="mallory", reservation={"reservation_id": "x", "gpus": 1}).model_copy(update={"event_id": "f" * 32})
    v = one(run([rel("release.registered", 0), junk, rel("release.approved", 8, actor="alice")], watermark=60), 7)
    assert v.closed_at == at(8), v


def test_only_the_same_decision_ratifies_and_only_an_overrides_expiry_ends_it():
    """From an exploratory review: an unauthorised approval for prod was closed as "ratified" by an
    approval for dev (the environment of an approval is its identity's; only to_environment was
    compared), and an unauthorised approval carrying expires_at one second later closed its own
    violation then, saying nothing — expiry ends an emergency override only."""
    prod_by_mallory = [rel("release.registered", 0), rel("release.approved", 1, actor="mallory", approval_id="CHG-9")]
    dev = one(run([*prod_by_mallory, rel("release.approved", 5, actor="alice", env="dev", approval_id="CHG-10")], watermark=60), 7)
    assert dev.closed_at is None and "ratified" not in dev.detail, dev.detail
    prod = one(run([*prod_by_mallory, rel("release.approved", 5, actor="alice", env="dev", approval_id="CHG-10"),
                    rel("release.approved", 8, actor="alice", approval_id="CHG-11")], watermark=60), 7)
    assert prod.closed_at == at(8) and "; ratified at 2026-11-01T08:08:00.000Z by alice" in prod.detail, prod.detail
    # An approval naming no environment (it covers every one) is its own decision: its row reads the manifest's
    # environment, but a later approval for dev does not ratify it (review of the change).
    anywhere = one(run([rel("release.registered", 0), rel("release.approved", 1, actor="mallory", env=None),
                        rel("release.approved", 5, actor="alice", env="dev", approval_id="CHG-10")], watermark=60), 7)
    assert anywhere.closed_at is None and "ratified" not in anywhere.detail, anywhere.detail
    self_expiring = [rel("release.registered", 0), rel("release.approved", 1, actor="mallory", expires_at=at(1) + timedelta(seconds=1)),
                     rel("release.promoted", 2, actor="mallory", to_environment="prod", expires_at=at(2) + timedelta(seconds=1)),
                     rel("release.node_isolated", 3, actor="mallory", target="n3", expires_at=at(4))]
    assert [(v.opened_at, v.closed_at) for v in sorted(of(run(self_expiring, watermark=60), 7), key=lambda v: v.opened_at)] == \
        [(at(1), None), (at(2), None), (at(3), None)]
    # An emergency override by an actor without the right ends when it expires, and says so.
    paused = one(run([rel("release.registered", 0), rel("release.queue_paused", 3, actor="mallory", target="prod-inference",
                                                       expires_at=at(30))], watermark=60), 7)
    assert paused.closed_at == at(30) and paused.detail.endswith("; the override expired at 2026-11-01T08:30:00.000Z"), paused.detail


def test_a_pod_running_and_finished_in_one_second_closes_its_violation():
    """From an exploratory review on a real cluster: `scheduler.running` and `scheduler.finished` in
    one whole second were ordered by id (a hash); a finish sorted first was ignored and the running
    row opened an interval nothing closed — control 1 open for ever on workloads that had finished.
    Six pods (their ids order both ways); each one's violation closes at the finish."""
    events = [rel("release.registered", 0, "r9")]
    for n in range(6):
        pod, wl = f"quick-{n}", f"ml/Job/quick-{n}"
        events += [sched("scheduler.scheduled", 10, pod=pod, workload=wl, release_id="r9"),
                   sched("scheduler.running", 11, pod=pod, workload=wl, release_id="r9"),
                   sched("scheduler.finished", 11, pod=pod, workload=wl, release_id="r9")]
    found = of(run(events, watermark=60), 1)
    assert len(found) == 6 and all(v.closed_at == at(11) for v in found), [(v.detail, v.closed_at) for v in found]
    # Preempted and admitted again in one second while it runs: stopped, then running again — the first
    # admission's violation closes, the second's is open.
    again = [rel("release.registered", 0, "r9"), sched("scheduler.admitted", 10, kind="Workload", release_id="r9"),
             sched("scheduler.preempted", 12, kind="Workload", release_id="r9"), sched("scheduler.admitted", 12, kind="Workload", release_id="r9")]
    assert sorted(((v.opened_at, v.closed_at) for v in of(run(again, watermark=60), 1)), key=str) == [(at(10), at(12)), (at(12), None)]


# --- 8. Retirement ----------------------------------------------------------------------------

def _holding():
    return [sched("scheduler.scheduled", 9, release_id="r1"), gpu_event("gpu.assigned", 10)]


def test_retired_release_still_holding_a_gpu_after_grace_opens():
    v = one(run([*released(), *_holding(), rel("release.retired", 30, actor="alice")], watermark=100), 8)
    assert v.opened_at == at(90) and v.closed_at is None and "GPU n1/GPU-1111" in v.detail and v.owner == "team-capacity"


def test_of_one_instants_revocations_control_8_counts_from_the_one_by_an_actor_with_the_right():
    """A CI step revoking without the right and the approver revoking at the same --at: the
    violation named the CI's revocation, or the approver's, by the hash of the ids."""
    for entitled_id, unentitled_id in (("0" * 32, "f" * 32), ("f" * 32, "0" * 32)):
        ci = rel("release.revoked", 30, actor="ci-pipeline", reason="drift").model_copy(update={"event_id": unentitled_id})
        alice = rel("release.revoked", 30, actor="alice", reason="drift").model_copy(update={"event_id": entitled_id})
        v = one(run([*released(), *_holding(), ci, alice], watermark=200), 8)
        assert v.evidence[0] == entitled_id, (entitled_id, v.evidence)


def test_a_violations_times_read_as_the_store_keeps_them():
    """Found by an exploratory review: a detail quoted the event's time to the microsecond
    ("retired at …29.577602+00:00") while the store, `trace` and `audit` have it to the millisecond
    ("…29.577Z"), and `audit --reevaluate` (from the stored rows) wrote "….577000+00:00"."""
    retired = at(30) + timedelta(seconds=29, microseconds=577_602)
    events = [*released(), *_holding(), rel("release.retired", 30, actor="alice").model_copy(update={"occurred_at": retired})]
    v = one(run(events, watermark=100), 8)
    assert "was retired at 2026-11-01T08:30:29.577Z and still held" in v.detail, v.detail


def test_an_unproven_revocation_opens_no_control_8_where_proof_is_required():
    """Control 1 and admission ignore an unproven revocation where the policy requires proof;
    control 8 opened a critical violation for it all the same ("revoked … still held …")."""
    events = [*released(), *_holding(), rel("release.revoked", 30, actor="mallory", reason="drift")]
    assert of(run(events, watermark=200, policy=PROVEN), 8) == []
    proven = one(run([*events, rel("release.revoked", 40, actor="user:alice", authenticated_by="token", reason="drift")],
                     watermark=200, policy=PROVEN), 8)
    assert "was revoked at" in proven.detail and proven.opened_at >= at(40), proven.detail
    assert one(run(events, watermark=200), 8)  # the default policy: a revocation is a brake, whoever pulls it


def test_retired_release_that_released_everything_within_grace_does_not_open():
    events = [*released(), *_holding(), rel("release.retired", 30, actor="alice"), gpu_event("gpu.released", 50),
              sched("scheduler.deleted", 50, release_id="r1")]
    assert of(run(events, watermark=200), 8) == []


def test_retirement_opens_then_closes_when_the_last_holding_ends():
    events = [*released(), *_holding(), rel("release.revoked", 30, actor="alice"), gpu_event("gpu.released", 120),
              sched("scheduler.deleted", 121, release_id="r1")]
    v = one(run(events, watermark=200), 8)
    assert (v.opened_at, v.closed_at) == (at(90), at(121))


def test_a_node_gpu_key_left_by_the_older_layout_is_superseded_by_the_pods_newer_allocation_versions():
    """Changelogs written before allocations were kept by their pod hold ``gpu:`` keys with
    a copy of each allocation: the release must judge the pod's newer versions, and still
    count an allocation only the old key has."""
    from streams.controls.rules import compact_allocation, fold_row, new_state, step, Context

    events = [*released(), *_holding(), rel("release.retired", 30, actor="alice"), gpu_event("gpu.released", 50),
              sched("scheduler.deleted", 50, release_id="r1")]
    driver = Driver().feed(events).flush_parked()
    (alloc,) = driver.allocations.values()
    ended = compact_allocation(alloc)
    assert ended["end"] is not None
    legacy = new_state("gpu:n1/GPU-1111")  # the old key's copy: the same allocation, still open
    fold_row(legacy, {**ended, "v": ended["v"] - 1, "end": None, "ee": None})
    ctx = Context(driver.directory, POLICY, at(200))
    engine = ControlEngine(driver.directory, POLICY, at(200)).feed(driver.rows.values(), [alloc])
    for target, link in step(legacy, ctx).forwards:
        engine.queue.append((target, "link", ("gpu:n1/GPU-1111", link)))
    engine.run()
    assert of(engine.current(), 8) == []  # the pod's version (released at 50, within the grace period) wins
    only_old = ControlEngine(driver.directory, POLICY, at(200)).feed(driver.rows.values(), [])
    for target, link in step(new_state("gpu:n1/GPU-1111") | {"rows": legacy["rows"]}, ctx).forwards:
        only_old.queue.append((target, "link", ("gpu:n1/GPU-1111", link)))
    only_old.run()
    assert "GPU n1/GPU-1111" in one(only_old.current(), 8).detail  # an allocation only the old key has still counts


# --- determinism ------------------------------------------------------------------------------

EVERYTHING = [
    *released(), sched("scheduler.scheduled", 10, pod="u1", workload="ml/Job/u1"),
    *_victim(30, preemptor=ObjectRef(kind="Workload", namespace="research", name="burst")),
    sched("scheduler.admitted", 29, workload="research/burst", ns="research", kind="Workload", priority_class="research-burst"),
    sched("scheduler.running", 12, pod="p5", workload="ml/Job/five", release_id="r1", digest=D2),
    _reserve(), firing(40), rel("release.queue_paused", 41, actor="mallory", target="q"),
    *_holding(), rel("release.retired", 100, actor="alice"),
]


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_latest_violations_and_versions_do_not_depend_on_processing_order(seed):
    want = {v.violation_id: v.model_dump() for v in run(EVERYTHING, watermark=400)}
    assert {v.control_id for v in run(EVERYTHING, watermark=400)} == {1, 3, 4, 5, 6, 7, 8}
    shuffled = list(EVERYTHING)
    random.Random(seed).shuffle(shuffled)
    got = {v.violation_id: v.model_dump() for v in run(shuffled, watermark=400, seed=seed, chunks=1 + seed % 3)}
    assert got == want


def test_a_disabled_control_reports_nothing():
    policy = Policy.model_validate({"controls": {"telemetry_correlation": {"accountable": "platform-sre", "enabled": False}}})
    assert of(run([firing(10)], policy=policy), 6) == []
    assert timedelta(hours=2) == POLICY.environment("prod").observation_window


# --- what the correlation stage sends the controls stage ---------------------------------------

ALERTS = [
    *released(), sched("scheduler.scheduled", 5, pod="h1", release_id="r1"), gpu_event("gpu.assigned", 6, pod="h1", device="GPU-1111"),
    firing(8, fp="pod-ok", namespace="ml", pod="h1"),                  # on a pod with a release: joined
    firing(10, fp="xid", node="n1", gpu_id="GPU-1111"),                # the GPU was h1's: joined
    gpu_event("gpu.released", 20, pod="h1", device="GPU-1111"),
    firing(30, fp="xid", node="n1", gpu_id="GPU-1111"),                # a later episode on the free GPU: unjoined
    firing(45, fp="xid", status="alert.resolved", starts=30, node="n1", gpu_id="GPU-1111"),
    firing(40),                                                        # no labels at all: unjoined
]


@pytest.mark.parametrize("seed", [None, 1, 2, 3, 4])
def test_the_controls_stage_gets_every_row_of_a_fingerprint_that_had_an_unjoined_row_and_no_other_alert(seed):
    driver = Driver(seed=seed).feed(ALERTS if seed is None else random.Random(seed).sample(ALERTS, len(ALERTS))).flush_parked()

    def verdicts(rows):
        engine = ControlEngine(driver.directory, POLICY, at(400)).feed(rows, driver.allocations.values())
        engine.run()
        return {v.violation_id: v.model_dump() for v in engine.current()}

    # The controls stage ends with the verdicts of the whole history, from fewer rows.
    assert verdicts(driver.controls.values()) == verdicts(driver.rows.values())
    assert sorted(v.identity.alert_fingerprint for v in of(run(ALERTS), 6)) == ["fp1", "xid"]
    fingerprints = {r.identity.alert_fingerprint for r in driver.controls.values() if r.event_type.startswith("alert.")}
    assert fingerprints == {"fp1", "xid"}  # never the pod's attributed alert
    # The joined episode of "xid" came along when its fingerprint had an unjoined row, at its latest version.
    xid = {cid: r.version for cid, r in driver.controls.items() if r.identity.alert_fingerprint == "xid"}
    assert len(xid) == 3 and xid == {cid: driver.rows[cid].version for cid in xid}
    # Every other row (scheduler, GPU) goes as before.
    others = {cid for cid, r in driver.rows.items() if not r.event_type.startswith("alert.")}
    assert others <= set(driver.controls)


def test_the_fingerprints_sent_to_the_controls_are_bounded(monkeypatch):
    from streams.correlate import entities

    monkeypatch.setattr(entities, "MAX_ROWS", 3)
    monkeypatch.setattr(entities, "MAX_CTL_FPS", 4)
    from collections import Counter

    from streams import caps

    monkeypatch.setattr(caps, "CAPPED", Counter())  # this test's counts only
    # XIDs on a GPU nobody holds: each parks, then goes out unattributed — a fingerprint for the controls each
    driver = Driver().feed(released())
    for i in range(6):
        driver.feed([firing(10 + i, fp=f"x{i}", node="n1", gpu_id="GPU-1111")]).flush_parked()
    state = driver.entities["gpu:n1/GPU-1111"]
    assert len(state["rows"]) <= 3 and state["detached"] == 6 - len(state["rows"])
    # Tracked past their rows (a later joined row of theirs must still reach the controls), down to
    # MAX_CTL_FPS at each trim, the oldest tracked whose rows went first (x5 came after the last trim).
    assert state["ctl"] == [f"x{i}" for i in range(1, 6)]
    assert caps.counts()["control_fingerprints_detached"] == 1  # x0, counted (the health page's stats.capped)
    assert {r.identity.alert_fingerprint for r in driver.controls.values() if r.event_type.startswith("alert.")} == {f"x{i}" for i in range(6)}


def _telemetry_verdicts(driver):
    engine = ControlEngine(driver.directory, POLICY, at(400)).feed(driver.controls.values(), driver.allocations.values())
    engine.run()
    return {v.identity.alert_fingerprint: (v.violation_id, v.closed_at, v.evidence) for v in engine.current() if v.control_id == 6}


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_an_alert_naming_a_release_no_event_describes_is_unjoined_until_one_does(seed):
    """An alert labelled with a release id no release event describes (a typo, a release never
    registered) goes out past its park TTL naming that id, with ``release_known`` false: not joined —
    control 6 opens on its episode (it counted as joined: control 6 silent, the audit passing, an
    exploratory review). The release's first event then joins it: written again, known, withdrawn."""
    ghost = firing(10, fp="ghost", release_id="ghost-v1-prod", environment="prod")
    driver = Driver(seed=seed).feed([*released(), ghost]).flush_parked()
    [row] = [r for r in driver.rows.values() if r.identity.alert_fingerprint == "ghost"]
    assert (row.attribution, row.identity.release_id, row.release_known) == ("release_label", "ghost-v1-prod", False)
    assert "ghost" in {r.identity.alert_fingerprint for r in driver.controls.values()}  # sent to the controls stage
    opened = _telemetry_verdicts(driver)
    assert "ghost" in opened and opened["ghost"][1] is None  # open
    [violation] = of(run([*released(), ghost], watermark=400), 6)
    assert "could not be joined to a release" in violation.detail
    # The release turns up: the row is written again, known, and the violation withdrawn.
    driver.feed([release("release.registered", 20, rid="ghost-v1-prod")]).flush_parked()
    [row] = [r for r in driver.rows.values() if r.identity.alert_fingerprint == "ghost"]
    assert row.release_known is True
    assert "ghost" not in _telemetry_verdicts(driver)
    # An alert on a described release stays joined and is never sent (as before).
    ok = Driver(seed=seed).feed([*released(), firing(10, fp="fine", release_id="r1")]).flush_parked()
    assert [r.release_known for r in ok.rows.values() if r.identity.alert_fingerprint == "fine"] == [True]
    assert "fine" not in {r.identity.alert_fingerprint for r in ok.controls.values()}


def _held_gpu(minutes, pod):
    return [sched("scheduler.scheduled", minutes, pod=pod, release_id="r1"), gpu_event("gpu.assigned", minutes, pod=pod, device="GPU-1111")]


def _noise(start, n):
    """Alerts of other fingerprints on the GPU, each its own row: they push older rows past a small MAX_ROWS."""
    return [firing(start + i / 10, fp=f"noise{i}", node="n1", gpu_id="GPU-1111") for i in range(n)]


@pytest.mark.parametrize("cap", [3, 4])
def test_a_tracked_fingerprint_whose_rows_went_past_the_row_bound_still_sends_its_joined_rows(monkeypatch, cap):
    """A fingerprint tracked for the controls (it had an unjoined row: control 6 opened) stays
    tracked when all its rows go past ``MAX_ROWS``: a later row of the episode that comes out
    joined (an assignment that covered it arrived late) must reach the controls and withdraw the
    violation, as it does without the bound. Before, the fingerprint left the tracked list with
    its rows, the joined row was not sent, and the violation stayed open for ever."""
    from streams.correlate import entities

    events = [*released(),
              firing(8, fp="xid", node="n1", gpu_id="GPU-1111"),                  # the GPU looks free: unjoined, tracked
              *_noise(9, 6),                                                       # pushing xid's row out
              *_held_gpu(5, "h1"), gpu_event("gpu.released", 20, pod="h1", device="GPU-1111"),  # h1 held it from 5 to 20, told late
              firing(25, fp="xid", status="alert.resolved", starts=8, node="n1", gpu_id="GPU-1111")]  # the episode ends: joined
    steps = (events[:8], events[8:-1], events[-1:])  # history, the late assignment, the episode's end

    def drive():
        driver, seen = Driver(), []
        for step in steps:
            seen.append(_telemetry_verdicts(driver.feed(step).flush_parked()))
        return driver, seen

    uncapped, (opened, _, _) = drive()
    monkeypatch.setattr(entities, "MAX_ROWS", cap)
    capped, _ = drive()
    assert capped.entities["gpu:n1/GPU-1111"]["detached"] > 0
    assert "xid" in opened and "xid" not in _telemetry_verdicts(uncapped)  # opened, then withdrawn by the joined rows
    # (The noise's own episodes that went past the bound keep what they were when they went —
    # rows let go are not derived again — so only xid's verdict is the same either way.)
    assert _telemetry_verdicts(capped).get("xid") == _telemetry_verdicts(uncapped).get("xid") is None


def test_a_control_key_past_its_row_bound_keeps_the_dropped_rows_versions(monkeypatch):
    """Past ``MAX_ROWS`` a control key drops its oldest rows and keeps their versions
    (``state["dropped"]``, counted in ``key_version``): the key's version is the same whether a
    row was dropped before or after the others came — in event order, near it, with rows
    delivered again (a row seen again after it went is not kept, nor counted twice) — and a
    dropped row that comes back at a higher version counts once, at that version."""
    from streams.controls import rules

    monkeypatch.setattr(rules, "MAX_ROWS", 3)
    rows = [{"id": f"r{i}", "v": i + 1, "at": f"2026-11-01T00:00:{i:02d}+00:00"} for i in range(6)]

    def folded(order):
        state = rules.new_state("alert:x")
        for row in order:
            rules.fold_row(state, dict(row))
        return state, sum(r["v"] for r in state["rows"].values()) + state["dropped"]["v"]

    near = [rows[1], rows[0], rows[3], rows[2], rows[5], rows[4]]
    for order in (rows, near, rows + rows[:3], rows[:4] + rows[:2] + rows[4:]):
        state, version = folded(order)
        assert sorted(state["rows"]) == ["r3", "r4", "r5"] and version == 21, (order, state)
    state, _ = folded(rows)
    rules.fold_row(state, {"id": "r2", "v": 10, "at": "2026-11-01T00:00:09+00:00"})
    assert sorted(state["rows"]) == ["r2", "r4", "r5"]
    assert sum(r["v"] for r in state["rows"].values()) + state["dropped"]["v"] == 21 - 3 + 10
    # the key's version counts them (what every violation of the key is emitted at)
    from types import SimpleNamespace

    ctx, clock = SimpleNamespace(accessed=set(), directory=None), SimpleNamespace(passed_count=0)
    assert rules.key_version(state, ctx, clock) == 28
    # a row older than every row kept, never seen: it would go at once — not kept, not counted
    before = orjson.loads(orjson.dumps(state))
    assert rules.fold_row(state, {"id": "old", "v": 7, "at": "2026-10-31T00:00:00+00:00"}) is False and state == before
