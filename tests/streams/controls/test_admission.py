"""The admission decision (streams/controls/admission.py): every rule, every mode, overrides."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from producers._config import GPU_RESOURCES, ResourceMatcher
from producers.releases import COMMANDS, build_event
from streams.controls.admission import RULES, AdmissionState, decide, subject_of
from streams.controls.policy import Admission, NamespaceAdmission, Policy, parse_policy

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
NOW = T0 + timedelta(hours=1)
RID = "fraud-scorer-v8-prod"
GPUS = ResourceMatcher(GPU_RESOURCES)
COMMAND = {c.name: c for c in COMMANDS}


def release(state: AdmissionState, command: str, minutes: int, **options) -> AdmissionState:
    event = build_event(COMMAND[command], {"release_id": RID, "at": (T0 + timedelta(minutes=minutes)).isoformat(), **options})
    state.apply(event)
    return state


def loaded(*steps) -> AdmissionState:
    state = AdmissionState()
    state.ready.set()
    for step in steps:
        step(state)
    return state


def registered(state):
    release(state, "register", 0, model="fraud-scorer", version="8", artifact_digest="sha256:" + "a" * 64)
    release(state, "evaluate", 5)


def approved_by(actor: str, env: str = "prod", minutes: int = 10):
    return lambda state: release(state, "approve", minutes, actor=actor, env=env)


def job(labels: dict | None = None, gpus: int = 1, namespace: str = "serving", name: str = "score", queue: str | None = None,
        suspend: bool | None = None) -> dict:
    job_labels = {**(labels or {}), **({"kueue.x-k8s.io/queue-name": queue} if queue else {})}
    suspend = bool(queue) if suspend is None else suspend  # (Kueue's webhook suspends a Job it manages)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": namespace, "uid": "u-1", "labels": job_labels},
            "spec": {"parallelism": 2, "suspend": suspend, "template": {"metadata": {"labels": labels or {}}, "spec": {"containers": [
                {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}}]}}}}


PROD = {"gpuledger.io/release-id": RID, "gpuledger.io/environment": "prod"}


def decision(obj=None, state=None, policy=None, now=NOW, **kw):
    return decide(subject_of(obj or job(PROD), GPUS), state, policy or Policy(), now, **kw)


def test_an_approved_release_is_allowed_by_the_controls_own_approval_timeline():
    d = decision(state=loaded(registered, approved_by("alice")))
    assert (d.verdict, d.rule, d.outcome, d.release_state) == ("allow", "approved", "allow", "release.approved")
    assert d.evidence and d.policy_version == Policy().fingerprint and d.directory_version > 0


def test_an_evaluated_release_is_denied_with_what_to_do_and_who_may_approve():
    d = decision(state=loaded(registered))
    assert (d.verdict, d.rule) == ("deny", "unapproved")
    assert d.message.startswith(f"release {RID} is evaluated, not approved for prod; approvals need the `approve` right")
    assert "release-managers: alice, carol, dana" in d.message and f"gpuledger release approve --release-id {RID}" in d.message


def test_an_approval_by_someone_without_the_right_does_not_count():
    d = decision(state=loaded(registered, approved_by("mallory")))
    assert (d.verdict, d.rule) == ("deny", "approval-not-entitled")
    assert "approved only by mallory (unauthenticated)" in d.message and "mallory holds no role; none grants approve" in d.message


def test_an_approval_for_an_earlier_environment_does_not_cover_prod_but_one_for_prod_covers_staging():
    state = loaded(registered, approved_by("alice", env="staging"))
    assert decision(state=state).rule == "unapproved"
    staging = {**PROD, "gpuledger.io/environment": "staging"}
    assert decision(job(staging), loaded(registered, approved_by("alice"))).rule == "approved"


def test_an_approval_after_now_does_not_count_yet():
    assert decision(state=loaded(registered, approved_by("alice", minutes=90))).rule == "unapproved"


def test_a_revoked_or_retired_release_is_denied():
    for command in ("revoke", "retire"):
        state = loaded(registered, approved_by("alice"), lambda s, c=command: release(s, c, 20, reason="bad scores", actor="alice"))
        d = decision(state=state)
        assert (d.verdict, d.rule) == ("deny", "revoked") and f"was {'revoked' if command == 'revoke' else 'retired'}" in d.message


def test_a_release_revoked_without_ever_being_approved_here_is_revoked_not_unapproved():
    """From an exploratory review on a real cluster: a release approved for staging only and then
    revoked was denied as "unapproved" in prod — its Workload waited Pending in its queue for ever,
    holding quota, told to get the revoked release approved. A revocation ends it (Rejected)."""
    state = loaded(registered, approved_by("alice", env="staging"), lambda s: release(s, "revoke", 20, reason="data leak", actor="alice"))
    d = decision(state=state)
    assert (d.verdict, d.rule) == ("deny", "revoked") and "was revoked" in d.message and "gpuledger release approve" not in d.message, d.message
    assert decision(state=loaded(registered, lambda s: release(s, "retire", 20, reason="old", actor="alice"))).rule == "revoked"


def test_an_unproven_revocation_does_not_block_an_approved_release_where_proof_is_required():
    """With require_for_rights, an anonymous POST of release.revoked by 'mallory' made admission
    deny every new pod of an approved release. Without it (the default) a revocation is a brake,
    whoever pulls it (control 7 reports an unentitled one)."""
    from streams.controls.policy import Authentication

    strict = Policy(authentication=Authentication(require_for_rights=True))
    state = AdmissionState()
    state.ready.set()
    registered(state)
    approval = build_event(COMMAND["approve"], {"release_id": RID, "at": (T0 + timedelta(minutes=10)).isoformat(), "actor": "alice", "env": "prod"})
    state.apply(approval.model_copy(update={"payload": approval.payload.model_copy(update={"authenticated_by": "token"})}))
    release(state, "revoke", 20, reason="drift", actor="mallory")  # typed: unproven
    assert (decision(state=state, policy=strict).rule, decision(state=state).rule) == ("approved", "revoked")


def test_an_unknown_release_and_a_missing_release_label_are_denied():
    assert decision(state=loaded()).rule == "unknown-release"
    d = decision(job({"gpuledger.io/environment": "prod"}), loaded())
    assert d.rule == "no-release-identity" and "gpuledger.io/release-id=<release id>" in d.message and "2 GPU(s)" in d.message
    assert d.message.endswith("with a release approved for prod"), d.message
    # Nothing says its environment: the advice says how to name one, not "approved for an unknown environment".
    nowhere = decision(job({}), loaded())
    assert nowhere.rule == "no-release-identity" and "approved for an unknown environment" not in nowhere.message, nowhere.message
    assert "with a release approved for its environment (none is known: label it gpuledger.io/environment=<environment>" in nowhere.message


def test_an_environment_without_approval_requirement_and_a_cpu_only_object_are_allowed():
    assert decision(job({"gpuledger.io/environment": "dev"}), loaded()).rule == "approval-not-required"
    assert decision(job(PROD, gpus=0), loaded()).rule == "not-gpu"


def test_unknown_environment_requires_approval_like_control_1():
    assert decision(job({"gpuledger.io/release-id": RID}), loaded(registered)).rule == "unapproved"


def test_an_unlabelled_workload_is_decided_in_its_releases_environment_as_control_1_judges_it():
    """Control 1 reads a workload's environment from its correlated row, whose identity the
    correlation fills from the release's manifest (the environment its latest release event named).
    The webhook read only the workload's label: unlabelled, in a namespace the policy does not map,
    it was an unknown environment, which any approval covers — a release approved for staging and
    then promoted to prod without a prod approval had its workload let in, and control 1 then
    opened a violation for prod. The webhook takes the strictest environment the release's events
    named (never laxer than the row's, whatever their order) when it needs an approval."""
    def registered_for(env):
        return lambda state: (release(state, "register", 0, model="fraud-scorer", version="8", artifact_digest="sha256:" + "a" * 64, env=env),
                              release(state, "evaluate", 5))

    def promoted(state):
        release(state, "promote", 20, env="prod", actor="ci/4711")

    unlabelled = job({"gpuledger.io/release-id": RID}, namespace="scratch")
    staged = loaded(registered_for("staging"), approved_by("alice", env="staging"))
    assert (decision(unlabelled, staged).rule, decision(unlabelled, staged).environment) == ("approved", "staging")
    d = decision(unlabelled, loaded(registered_for("staging"), approved_by("alice", env="staging"), promoted))
    assert (d.verdict, d.rule, d.environment, d.fail_closed) == ("deny", "unapproved", "prod", True)
    assert "is promoted (approved for staging), not approved for prod" in d.message
    assert decision(unlabelled, loaded(registered_for("staging"), approved_by("alice", env="staging"), promoted,
                                       approved_by("carol", minutes=30))).rule == "approved"
    # The workload's own label still names its environment first (as the row's identity does) ...
    assert decision(job({"gpuledger.io/release-id": RID, "gpuledger.io/environment": "dev"}, namespace="scratch"),
                    loaded(registered_for("prod"))).rule == "approval-not-required"
    # ... the release's environment, like a label, cannot take it out of its namespace's ...
    mapped = Policy(admission=Admission(namespaces={"fraud-prod": NamespaceAdmission(environment="prod")}))
    d = decision(job({"gpuledger.io/release-id": RID}, namespace="fraud-prod"), loaded(registered_for("dev")), mapped)
    assert (d.rule, d.environment) == ("unapproved", "prod")
    # ... a name the policy does not list reads as its strictest environment ...
    d = decision(unlabelled, loaded(registered_for("production")))
    assert (d.rule, d.environment) == ("unapproved", "prod")
    # ... it is the strictest any of the release's events named, whatever the order of one instant's
    # events (the manifest's latest was the one whose id sorts last: the CI job's id decided) ...
    for promoter in ("ci/1", "ci/2", "ci/3", "ci/4", "ci/5", "ci/6"):
        one_instant = loaded(lambda state: release(state, "register", 0, model="m", version="8", artifact_digest="sha256:" + "a" * 64,
                                                   env="staging"),
                             lambda state: release(state, "approve", 0, actor="alice", env="staging"),
                             lambda state, p=promoter: release(state, "promote", 0, env="prod", actor=p))
        d = decision(unlabelled, one_instant)
        assert (d.verdict, d.rule, d.environment) == ("deny", "unapproved", "prod"), (promoter, d)
    # ... a later event naming a laxer environment does not lower it (anyone may publish one) ...
    lowered = loaded(registered_for("staging"), promoted, lambda state: release(state, "approve", 30, actor="mallory", env="dev"),
                     lambda state: release(state, "evaluate", 31, env="staging"))
    assert (decision(unlabelled, lowered).rule, decision(unlabelled, lowered).environment) == ("unapproved", "prod")
    # ... and a release naming only environments that need no approval leaves it unknown: approval needed, as before.
    d = decision(unlabelled, loaded(registered_for("dev")))
    assert (d.rule, d.environment) == ("unapproved", None), d
    # The release's environment tightens the approval rule, never the mode: with modes {staging: warn}, an
    # evaluation for staging (anyone may publish one) turned the unknown environment's enforce into warn (review).
    warned = Policy(admission=Admission(modes={"staging": "warn"}))
    d = decision(unlabelled, loaded(registered_for(None), lambda state: release(state, "evaluate", 1, env="staging", actor="mallory")), warned)
    assert (d.verdict, d.rule, d.mode, d.environment) == ("deny", "unapproved", "enforce", "staging"), d
    # A custom environment ranked strictest that needs no approval (or an unlisted name read as it) cannot
    # drop a release promoted to prod back to unknown, which a dev approval covers (review).
    from streams.controls.policy import Environment

    sandboxed = Policy(environments=(Environment(name="dev", requires_approval=False), Environment(name="staging"), Environment(name="prod"),
                                     Environment(name="sandbox", requires_approval=False)), admission=Admission(fail_closed=("prod",)))
    for name in ("sandbox", "sandbx"):
        history = loaded(registered_for("staging"), promoted, approved_by("alice", env="dev", minutes=30),
                         lambda state, n=name: release(state, "evaluate", 31, env=n, actor="mallory"))
        d = decision(unlabelled, history, sandboxed)
        assert (d.verdict, d.rule, d.environment) == ("deny", "unapproved", "prod"), (name, d)


def test_the_webhook_and_control_1_judge_an_unlabelled_workload_of_a_promoted_release_alike():
    """The same history through the worker's own join and control functions (the in-memory
    driver, ``ControlEngine``) and through the webhook's decision: control 1 opens a violation
    for prod, and the webhook denies for prod — it let the workload in before."""
    from streams.controls.rules import ControlEngine, directory_from_rows
    from tests.streams.harness import Driver, pod_event
    from tests.streams.harness import release as release_event

    history = [release_event("release.registered", 0, env="staging"), release_event("release.evaluated", 5, env=None),
               release_event("release.approved", 10, env="staging", actor="alice"),
               release_event("release.promoted", 20, env="prod", to_environment="prod", actor="ci/4711")]
    scheduled = pod_event("scheduler.scheduled", 30, ns="scratch", workload="scratch/Job/score", release_id="r1")
    rows = list(Driver().feed([*history, scheduled]).rows.values())
    engine = ControlEngine(directory_from_rows(rows), Policy()).feed(rows)
    engine.run()
    [violation] = [v for v in engine.current() if v.control_id == 1]
    assert "had no approval for prod" in violation.detail, violation.detail
    state = AdmissionState()
    for event in history:
        state.apply(event)
    state.ready.set()
    d = decide(subject_of(job({"gpuledger.io/release-id": "r1"}, namespace="scratch"), GPUS), state, Policy(), history[-1].occurred_at)
    assert (d.verdict, d.rule, d.environment) == ("deny", "unapproved", "prod"), d.message


def test_control_1_judges_an_unlabelled_workload_where_the_webhook_decided_it_whatever_came_later():
    """Control 1 read an unlabelled workload's environment from its row, the release's manifest: the
    environment its *latest* event named. Anyone's later event lowered it — an evaluation for dev after
    a promotion to prod without a prod approval withdrew the violation the webhook's denial stood for —
    and a later promotion raised it for workloads admitted before (a violation for prod of a staging
    run). It judges now as the webhook decides: the strictest environment needing an approval that the
    release's events named by the admission; the workload's own label when it has one. Each history runs
    through the worker's own join and controls and through the webhook at the admission."""
    from streams.controls.rules import ControlEngine, directory_from_rows
    from tests.streams.harness import Driver, at, pod_event
    from tests.streams.harness import release as release_event

    def judged(history, workloads, at_minute):
        rows = list(Driver().feed([*history, *workloads]).rows.values())
        engine = ControlEngine(directory_from_rows(rows), Policy()).feed(rows)
        engine.run()
        violations = {v.identity.pod: v.detail for v in engine.current() if v.control_id == 1}
        state = AdmissionState()
        for event in history:
            if event.occurred_at <= at(at_minute):
                state.apply(event)
        state.ready.set()
        return violations, state

    def scheduled(minute, pod, **labels):
        return pod_event("scheduler.scheduled", minute, ns="scratch", pod=pod, workload=f"scratch/Job/{pod}", release_id="r1", **labels)

    promoted = [release_event("release.registered", 0, env="staging"), release_event("release.approved", 10, env="staging", actor="alice"),
                release_event("release.promoted", 20, env="prod", to_environment="prod", actor="ci/4711")]
    lowered = [*promoted, release_event("release.evaluated", 40, env="dev", actor="mallory")]
    violations, state = judged(lowered, [scheduled(30, "unlabelled"), scheduled(30, "staged", environment="staging")], 30)
    assert set(violations) == {"unlabelled"} and "had no approval for prod" in violations["unlabelled"], violations
    d = decide(subject_of(job({"gpuledger.io/release-id": "r1"}, namespace="scratch"), GPUS), state, Policy(), at(30))
    assert (d.verdict, d.rule, d.environment) == ("deny", "unapproved", "prod"), d.message
    d = decide(subject_of(job({"gpuledger.io/release-id": "r1", "gpuledger.io/environment": "staging"}, namespace="scratch"), GPUS), state,
               Policy(), at(30))
    assert (d.verdict, d.rule, d.environment) == ("allow", "approved", "staging"), d.message
    # Admitted while the release named only staging (approved): a promotion to prod after it opens nothing.
    violations, state = judged(promoted, [scheduled(15, "early")], 15)
    assert violations == {}, violations
    d = decide(subject_of(job({"gpuledger.io/release-id": "r1"}, namespace="scratch"), GPUS), state, Policy(), at(15))
    assert (d.verdict, d.rule, d.environment) == ("allow", "approved", "staging"), d.message
    # A release whose events name only dev (anyone may publish one) leaves an unlabelled workload in an
    # unknown environment, which needs an approval: the webhook denies it and control 1 opens a violation.
    dev_only = [release_event("release.registered", 0, env="dev")]
    violations, state = judged(dev_only, [scheduled(5, "dev-run")], 5)
    assert set(violations) == {"dev-run"} and "had no approval for its environment" in violations["dev-run"], violations
    d = decide(subject_of(job({"gpuledger.io/release-id": "r1"}, namespace="scratch"), GPUS), state, Policy(), at(5))
    assert (d.verdict, d.rule, d.environment) == ("deny", "unapproved", None), d.message
    # Labelled dev, it is dev (needs none) for both.
    violations, _ = judged(dev_only, [scheduled(5, "labelled-dev", environment="dev")], 5)
    assert violations == {}, violations


def test_an_alerts_environment_label_does_not_make_a_workloads_environment():
    """Review: an alert's labels became its pod's facts, environment too — a later alert labelled
    environment=dev on a prod workload attributed by its image digest set its rows' environment to dev
    and made it the pod's own, and control 1 withdrew the violation the webhook's denial stood for. The
    alert's own row keeps its label."""
    from streams.controls.rules import ControlEngine, directory_from_rows
    from tests.streams.harness import Driver, alert, pod_event
    from tests.streams.harness import release as release_event

    promoted = [release_event("release.registered", 0, env="staging"), release_event("release.approved", 10, env="staging", actor="alice"),
                release_event("release.promoted", 20, env="prod", to_environment="prod", actor="ci/4711")]
    scheduled = pod_event("scheduler.scheduled", 30, ns="scratch", pod="unl", workload="scratch/Job/unl", digest="sha256:" + "b" * 64)
    for events in ([*promoted, scheduled], [*promoted, scheduled, alert(35, fp="x", namespace="scratch", pod="unl", environment="dev")]):
        rows = list(Driver().feed(events).rows.values())
        engine = ControlEngine(directory_from_rows(rows), Policy()).feed(rows)
        engine.run()
        [row] = [r for r in rows if r.event_type == "scheduler.scheduled"]
        assert (row.identity.release_id, row.identity.environment, row.environment_labelled) == ("r1", "prod", False), row
        [violation] = [v.detail for v in engine.current() if v.control_id == 1]
        assert "had no approval for prod" in violation, violation
    [alert_row] = [r for r in rows if r.event_type == "alert.firing"]
    assert alert_row.identity.environment == "dev"


def test_namespace_entry_names_the_environment_of_unlabelled_workloads():
    policy = Policy(admission=Admission(namespaces={"research": NamespaceAdmission(environment="dev")}))
    assert decision(job({}, namespace="research"), loaded(), policy).rule == "approval-not-required"


def test_a_workloads_own_label_cannot_move_it_out_of_its_namespaces_environment():
    """`gpuledger.io/environment: dev` on a Job in a namespace the policy maps to prod made an
    unapproved release 'approval-not-required' (env=dev): whoever creates a workload writes its labels."""
    policy = Policy(admission=Admission(namespaces={"fraud-prod": NamespaceAdmission(environment="prod")}))
    claims_dev = job({"gpuledger.io/release-id": RID, "gpuledger.io/environment": "dev"}, namespace="fraud-prod")
    verdict = decision(claims_dev, loaded(registered), policy)
    assert (verdict.verdict, verdict.rule, verdict.environment) == ("deny", "unapproved", "prod")
    # Where the policy maps no namespace, the label still names the environment ...
    assert decision(job({"gpuledger.io/environment": "dev"}, namespace="scratch"), loaded(), policy).rule == "approval-not-required"
    # ... and it can make a namespace's rules stricter, never laxer.
    lax = Policy(admission=Admission(namespaces={"sandbox": NamespaceAdmission(environment="dev")}))
    stricter = decision(job({"gpuledger.io/release-id": RID, "gpuledger.io/environment": "prod"}, namespace="sandbox"), loaded(registered), lax)
    assert (stricter.rule, stricter.environment) == ("unapproved", "prod")


def test_a_label_naming_an_environment_the_policy_does_not_list_cannot_weaken_a_prod_namespace():
    """Found by an exploratory review: `gpuledger.io/environment: production` (no environment of the
    policy) on a Job in a namespace mapped to prod was decided in 'production' — the default mode
    (warn: allowed with a warning suggesting `--env production`), and fail-open while the state was
    not loaded. An unlisted name is read as the strictest environment the policy lists."""
    policy = parse_policy("admission: {default_mode: warn, modes: {prod: enforce}, namespaces: {fraud-prod: {environment: prod}}}")
    production = job({"gpuledger.io/release-id": RID, "gpuledger.io/environment": "production"}, namespace="fraud-prod")
    d = decision(production, loaded(registered), policy)
    assert (d.verdict, d.rule, d.environment, d.mode, d.fail_closed) == ("deny", "unapproved", "prod", "enforce", True)
    assert "--env prod " in d.message and "label 'production' names no environment of the policy: decided as prod" in d.message
    not_loaded = decision(production, None, policy)
    assert (not_loaded.verdict, not_loaded.rule, not_loaded.fail_closed) == ("deny", "state-not-loaded", True)
    # An approval for prod is what it needs (it was: only one naming 'production' or no environment).
    assert decision(production, loaded(registered, approved_by("alice")), policy).rule == "approved"
    # Unmapped namespace: still the strictest listed environment, not an environment of its own.
    elsewhere = decide(subject_of(job({"gpuledger.io/release-id": RID, "gpuledger.io/environment": "prd"}, namespace="scratch"), GPUS),
                       None, policy, NOW)
    assert (elsewhere.environment, elsewhere.verdict, elsewhere.fail_closed) == ("prod", "deny", True)


def test_the_namespaces_environment_is_a_floor_for_mode_and_fail_closed():
    """A label naming a later environment makes a workload stricter in approval; its mode and
    fail-closed are never laxer than its namespace's environment's, whatever the policy sets for the later one."""
    policy = parse_policy("admission: {default_mode: enforce, modes: {prod: warn}, fail_closed: [staging],"
                          " namespaces: {fraud-staging: {environment: staging}}}")
    labelled_prod = job({"gpuledger.io/release-id": RID, "gpuledger.io/environment": "prod"}, namespace="fraud-staging")
    d = decision(labelled_prod, loaded(registered), policy)
    assert (d.environment, d.verdict, d.mode, d.fail_closed) == ("prod", "deny", "enforce", True)
    assert decision(labelled_prod, None, policy).verdict == "deny"
    # A namespace's own mode is the policy's word for that namespace: it still wins.
    own = parse_policy("admission: {modes: {prod: warn}, namespaces: {fraud-staging: {environment: staging, mode: dry-run}}}")
    assert decision(labelled_prod, loaded(registered), own).verdict == "allow"


@pytest.mark.parametrize("mode, verdict", [("enforce", "deny"), ("warn", "warn"), ("dry-run", "allow")])
def test_modes_turn_a_deny_into_a_warning_or_a_recorded_allow(mode, verdict):
    policy = Policy(admission=Admission(modes={"prod": mode}))
    d = decision(state=loaded(registered), policy=policy)
    assert (d.verdict, d.outcome, d.mode, d.rule) == (verdict, "deny", mode, "unapproved")
    assert d.allowed == (verdict != "deny") and d.warnings == ([d.message] if verdict == "warn" else [])


@pytest.mark.parametrize("mode", ["warn", "dry-run"])
def test_a_softened_denial_at_the_admission_check_says_enforce_mode_would_hold_the_workload_or_reject_it(mode):
    """Found by a review: warn and dry-run messages said "in enforce mode this would be denied", but at
    the AdmissionCheck enforce mode holds an unapproved Workload Pending in its queue until its
    approval; only the rules that end its wait (PERMANENT_RULES) reject it. The webhook does deny."""
    policy = Policy(admission=Admission(modes={"prod": mode}))
    lead = {"warn": "Allowed only because the admission mode for namespace serving in prod is warn; in enforce mode this ",
            "dry-run": "Allowed and recorded only: the admission mode for namespace serving in prod is dry-run; in enforce mode this "}[mode]
    enforced = decision(state=loaded(registered), gate="admission-check")
    held = decision(state=loaded(registered), policy=policy, gate="admission-check")
    assert held.message == f"{lead}would wait in its queue (its AdmissionCheck Pending): {enforced.message}"
    at_the_door = decision(state=loaded(registered), policy=policy)
    assert at_the_door.message == f"{lead}would be denied: {decision(state=loaded(registered)).message}"
    nameless = job({"gpuledger.io/environment": "prod"}, queue="q")
    rejected = decision(nameless, loaded(registered), policy, gate="admission-check")
    assert rejected.rule == "no-release-identity" and rejected.message.startswith(f"{lead}would be denied: ")


def test_a_namespace_mode_wins_over_the_environment_mode():
    policy = Policy(admission=Admission(modes={"prod": "enforce"}, namespaces={"serving": NamespaceAdmission(mode="dry-run")}))
    assert decision(state=loaded(registered), policy=policy).verdict == "allow"


def test_not_loaded_state_is_fail_closed_in_prod_and_fail_open_elsewhere():
    closed = decision(state=None)
    assert (closed.verdict, closed.rule, closed.fail_closed) == ("deny", "state-not-loaded", True)
    # Even dry-run does not turn a fail-closed refusal into an allow: nothing was decided.
    assert decision(state=None, policy=Policy(admission=Admission(modes={"prod": "dry-run"}))).verdict == "deny"
    staging = decision(job({**PROD, "gpuledger.io/environment": "staging"}), AdmissionState())
    assert (staging.verdict, staging.rule, staging.fail_closed) == ("allow", "state-not-loaded", False)
    assert staging.warnings == [staging.message] and closed.warnings == []  # allowed unchecked: told so


def test_not_loaded_state_holds_a_queued_workload_at_the_admission_check_whatever_the_environment_and_mode():
    """Found by an exploratory review: the AdmissionCheck gate allowed `state-not-loaded` in a
    fail-open environment like the webhook — the controller set the check Ready, and Kueue admitted
    the Workload unchecked. Fail-open is for the webhook, whose caller gives up after its timeout; a
    queued Workload can wait: a deny (its check Pending, not Rejected), in warn and dry-run mode too."""
    from producers.admission.controller import check_state

    staging = job({**PROD, "gpuledger.io/environment": "staging"}, queue="gpu")
    modes = {"staging": "warn"}, {"staging": "dry-run"}, {}
    for policy in (Policy(admission=Admission(modes=m)) for m in modes):
        for obj in (staging, job(PROD, queue="gpu")):
            held = decision(obj, AdmissionState(), policy, gate="admission-check")
            assert (held.verdict, held.rule, check_state(held), held.warnings) == ("deny", "state-not-loaded", "Pending", []), held
            assert held.message == ("gpuledger admit has not loaded the release state yet; Job serving/score waits in its queue (its "
                                    "AdmissionCheck Pending) until it has, and is decided then"), held.message
    assert decision(staging, AdmissionState()).verdict == "allow"  # the webhook: fail-open, unchanged


def test_admission_check_gate_lets_queued_work_through_the_webhook_but_not_the_check():
    policy = Policy(admission=Admission(namespaces={"serving": NamespaceAdmission(gate="admission-check")}))
    queued = job(PROD, queue="gpu")
    assert decision(queued, loaded(registered), policy).rule == "deferred-to-admission-check"
    assert decision(queued, loaded(registered), policy, gate="admission-check").rule == "unapproved"
    assert decision(job(PROD), loaded(registered), policy).rule == "unapproved"  # not queued: the webhook decides


def test_only_work_kueue_manages_is_deferred_not_work_that_merely_names_a_queue():
    """A bare Pod labelled with a queue that no Kueue manages (pods are not a Kueue integration
    here, or the queue does not exist) was let through as 'deferred-to-admission-check' — and no
    Workload, so no AdmissionCheck, ever saw it. Managed means Kueue's gate on a Pod (its pod
    integration's webhook runs before ours) or a suspended Job."""
    policy = Policy(admission=Admission(namespaces={"serving": NamespaceAdmission(gate="admission-check")}))

    def pod(gated: bool) -> dict:
        return {"kind": "Pod", "metadata": {"name": "p", "namespace": "serving", "labels": {**PROD, "kueue.x-k8s.io/queue-name": "gpu"}},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                         **({"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]} if gated else {})}}
    assert decision(pod(gated=False), loaded(registered), policy).rule == "unapproved"
    # Not even with Kueue's gate: its creator can write it too, and take it off (an UPDATE, never sent here).
    assert decision(pod(gated=True), loaded(registered), policy).rule == "unapproved"
    assert decision(job(PROD, queue="gpu", suspend=False), loaded(registered), policy).rule == "unapproved"


def override(actor="oncall-sre", target="serving/Job/score", minutes=30, expires=60):
    options = {"actor": actor, "target": target}
    if expires is not None:
        options["expires_at"] = (T0 + timedelta(minutes=minutes + expires)).isoformat()
    return lambda state: release(state, "override-admission", minutes, **options) if expires is not None else state.apply(
        build_event(COMMAND["override-priority"], {"release_id": RID, "at": (T0 + timedelta(minutes=minutes)).isoformat(), **options}))


def test_an_override_by_an_actor_with_the_right_lets_the_workload_through_until_it_expires():
    state = loaded(registered, override())
    d = decision(state=state)
    assert (d.verdict, d.rule) == ("allow", "override") and d.override_event_id and "oncall-sre" in d.message
    assert decision(state=state, now=T0 + timedelta(minutes=91)).rule == "unapproved"  # expired
    assert decision(state=state, now=T0 + timedelta(minutes=29)).rule == "unapproved"  # not yet given


def test_an_override_matches_its_target_and_release_only():
    assert decision(state=loaded(registered, override(target="serving/*"))).rule == "override"
    assert decision(state=loaded(registered, override(target="serving/score"))).rule == "override"
    assert decision(state=loaded(registered, override(target="other/*"))).rule == "unapproved"
    pod = {"kind": "Pod", "metadata": {"name": "score-abc", "namespace": "serving", "labels": PROD,
                                       "ownerReferences": [{"kind": "Job", "name": "score", "uid": "u-1", "controller": True}]},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    assert decision(pod, loaded(registered, override())).rule == "override"  # the Job's pods are the same workload


def test_an_override_without_the_right_or_too_long_does_not_count_and_says_why():
    d = decision(state=loaded(registered, override(actor="mallory")))
    assert d.rule == "unapproved" and "the override by mallory (unauthenticated) does not count" in d.message
    d = decision(state=loaded(registered, override(expires=5 * 60)))
    assert d.rule == "unapproved" and "needs an expiry at most" in d.message


def test_a_deny_names_the_releases_lifecycle_state_where_it_is_approved_and_an_expired_override():
    """Found by an exploratory review: the message named the latest event of any kind ('release
    ... is admission_overridden, not approved for prod'), a staging-only approval read 'is approved,
    not approved for prod', and an override that had expired went unmentioned."""
    after_override = decision(state=loaded(registered, override(minutes=10, expires=20)))
    assert after_override.rule == "unapproved" and after_override.release_state == "release.evaluated"
    assert after_override.message.startswith(f"release {RID} is evaluated, not approved for prod;")
    assert after_override.message.endswith("the override by oncall-sre (unauthenticated) (target serving/Job/score) expired at 2026-12-01T12:30:00+00:00")
    staging = decision(state=loaded(registered, approved_by("alice", env="staging")))
    assert staging.message.startswith(f"release {RID} is approved for staging, not approved for prod;")
    promoted = decision(state=loaded(registered, approved_by("alice", env="staging"),
                                     lambda s: release(s, "promote", 12, actor="alice", env="staging"),
                                     lambda s: release(s, "reserve", 13, actor="erin", reservation_id="r1", gpus=2,
                                                       window_start=(T0 + timedelta(hours=2)).isoformat(),
                                                       window_end=(T0 + timedelta(hours=3)).isoformat())))
    assert promoted.message.startswith(f"release {RID} is promoted (approved for staging), not approved for prod;"), promoted.message
    # A revocation ends it, whatever was approved before (an end, not a wait for an approval).
    revoked = decision(state=loaded(registered, approved_by("alice", env="staging"), approved_by("mallory", env="staging", minutes=11),
                                    lambda s: release(s, "revoke", 12, actor="alice", reason="drift")))
    assert revoked.rule == "revoked" and revoked.message.startswith(f"release {RID} was revoked;"), revoked.message


def test_kueue_workloads_and_pods_are_subjects_too():
    wl = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": {"name": "job-score-1a2b", "namespace": "serving"},
          "spec": {"queueName": "gpu", "podSets": [{"name": "main", "count": 3, "template": {"metadata": {"labels": PROD}, "spec": {
              "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}]}}}]}}
    s = subject_of(wl, GPUS)
    assert (s.gpus, s.workload_id, s.queued, s.identity["release_id"]) == (3, "serving/job-score-1a2b", True, RID)
    with pytest.raises(ValueError, match="not Deployment"):
        subject_of({"kind": "Deployment"}, GPUS)


def test_every_rule_is_exercised_here():
    import inspect
    import sys
    source = inspect.getsource(sys.modules[__name__])
    assert [r for r in RULES if f'"{r}"' not in source] == []
