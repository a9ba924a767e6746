"""Control 1 as prevention: may this GPU workload enter its queue now? A pure function.

Input: the release state (a ``ReleaseDirectory``, plus the emergency overrides folded from
the same release topic: ``AdmissionState``), the ``Policy`` and one Kubernetes object —
a Pod, a batch Job or a Kueue Workload (``subject_of``). Output: a ``Decision``: what we
answer (allow / deny / warn), the rule that decided, a message a model team can act on,
and what the decision read (release state, policy version, directory version, override).

One verdict: whether a release is approved for an environment is the controls' own
timeline (``streams.controls.rules.approval_changes`` — an approval by an actor holding
``approve``, covering the environment, not since revoked or retired), read at ``now``
instead of at the admission time control 1 later checks. So what the webhook admits is
what control 1 accepts, and what it denies is what control 1 would have opened a
violation for.

Rules, in order (``RULES``): ``not-gpu``, ``state-not-loaded`` (the webhook: fail-closed or -open;
the AdmissionCheck: always a wait), ``approval-not-required``, ``override``, ``no-release-identity``, ``unknown-release``,
``revoked``, ``approval-not-entitled``, ``unapproved``, ``approved``. The mode of the
namespace / environment (``Policy.admission``) then turns a deny into a warning (warn: its
message then starts by saying it was allowed only because of warn mode and would be denied
in enforce mode) or into an allow that is only recorded (dry-run: its recorded message says so the
same way).

Limits: control 1 only (approval), not control 2 (promotion); the environment is the strictest of
the policy's namespace entry, the namespace's own ``gpuledger.io/environment`` label when the
webhook's path says it (``Subject.namespace_environment``: only fail-closed environments have a
path of their own) and the object's label, else the strictest environment needing an approval
that its release's events named (``releases_environment``: the mode stays no laxer than without it;
``Policy.workload_environment``; a name the policy does not list reads as its strictest
environment), else it is unknown and approval is required (as control 1 treats it). Mode and fail-closed are never laxer than the namespace's environment's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Literal

from gpuledger.timefmt import iso_z
from producers._config import ResourceMatcher
from producers.kubernetes.mapping import (KUEUE_QUEUE_LABEL, claims_devices, derive_workload_id, gpus_requested, identity_fields, quantity,
                                          workload_info)
from schemas.release import actor_text, decision_actor
from streams.controls.policy import MODE_STRICTNESS, Policy
from streams.controls.rules import Release, _covers, approval_changes, iso
from streams.correlate.directory import ReleaseDirectory

if TYPE_CHECKING:
    from producers.admission.claims import ClaimGpus

Verdict = Literal["allow", "deny", "warn"]
Gate = Literal["webhook", "admission-check"]

#: Every rule a decision can name, in evaluation order.
#: The deny rules that end a queued Workload's wait (its AdmissionCheck ``Rejected``: neither can change
#: without a new Workload); every other deny holds it ``Pending`` in its queue until the answer changes
#: (``producers.admission.controller.check_state``).
PERMANENT_RULES = frozenset({"revoked", "no-release-identity"})
RULES = ("not-gpu", "state-not-loaded", "approval-not-required", "deferred-to-admission-check", "override", "no-release-identity",
         "unknown-release", "revoked", "approval-not-entitled", "unapproved", "approved")
OVERRIDE_EVENT = "release.admission_overridden"


@dataclass(frozen=True)
class Subject:
    """The object a decision is about, reduced to what the rules read."""

    kind: str  # Pod, Job, Workload
    namespace: str
    name: str
    uid: str | None
    gpus: int
    identity: dict[str, str]  # shared identifiers from the object's labels/annotations
    workload_id: str  # as the scheduler collector names the workload (namespace/Kind/name; a Kueue Workload: namespace/name)
    queued: bool  # managed by Kueue: a suspended Job with a queue-name label, or a Workload itself (a Pod: never)
    claim_notes: tuple[str, ...] = ()  # DRA claims that could not be read, each counted as a GPU (producers.admission.claims); identity labels/annotations left out (refusal_notes)
    # The namespace's gpuledger.io/environment label, when the webhook the API server called says it
    # (``/validate/<environment>``: producers.admission.manifests); None when not known.
    namespace_environment: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


def subject_of(obj: Mapping, resources: ResourceMatcher, prefix: str = "gpuledger.io/",
               claims: Callable[[str, Mapping | None], ClaimGpus] | None = None) -> Subject:
    """A Pod, batch/v1 Job or Kueue Workload (v1beta1/v1beta2) as a ``Subject``.
    ``claims``: the GPUs a pod spec gets through DRA claims (``producers.admission.claims.ClaimReader``,
    which reads them from the API server), added to its extended resources; without it a claim
    is not counted. ValueError for any other kind."""
    kind = obj.get("kind")
    meta = obj.get("metadata") or {}
    ns, name, uid = meta.get("namespace") or "", meta.get("name") or meta.get("generateName") or "", meta.get("uid") or None
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    # The collector's mapping wants a uid; an object under admission may not have one yet.
    obj = {**obj, "metadata": {"creationTimestamp": "1970-01-01T00:00:00Z", **meta, "name": name, "uid": uid or "-"}}
    notes: list[str] = []
    refused: dict[str, str] = {}  # identity labels/annotations left out (identity_fields), said in the decision's notes

    def claimed(pod_spec: Mapping | None) -> int:
        if claims is None or not claims_devices(pod_spec):
            return 0
        found = claims(ns, pod_spec)
        notes.extend(found.unresolved)
        return found.gpus

    if kind == "Pod":
        wid, _ = derive_workload_id(obj)
        # Never deferred: a Pod's queue label and scheduling gates are its creator's to write, and
        # the gate's later removal is an UPDATE this webhook is not sent (a Job Kueue admits creates
        # its pods after the AdmissionCheck: they are decided here, as approved work).
        gpus = gpus_requested(obj.get("spec"), resources) + claimed(obj.get("spec"))
        ident = identity_fields(labels, annotations, prefix, refused)
        return Subject("Pod", ns, name, uid, gpus, ident, wid, False, tuple(notes + refusal_notes(refused)))
    if kind == "Job":
        spec = obj.get("spec") or {}
        tmpl = spec.get("template") or {}
        tmeta = tmpl.get("metadata") or {}
        parallelism = spec.get("parallelism", 1)
        per_pod = gpus_requested(tmpl.get("spec"), resources) + claimed(tmpl.get("spec"))
        ident = {**identity_fields(tmeta.get("labels"), tmeta.get("annotations"), prefix, refused),
                 **identity_fields(labels, annotations, prefix, refused)}
        # Queued means managed, not labelled: a queue-name label alone (a Job no Kueue manages) was
        # let through as deferred, and no Workload, so no check, ever saw it. Kueue's webhook
        # suspends the Jobs it manages; one its creator suspended and resumes creates pods, which
        # are decided here.
        return Subject("Job", ns, name, uid, per_pod * (parallelism if isinstance(parallelism, int) and parallelism > 0 else 1), ident,
                       f"{ns}/Job/{name}", KUEUE_QUEUE_LABEL in labels and spec.get("suspend") is True, tuple(notes + refusal_notes(refused)))
    if kind == "Workload":
        info = workload_info(obj, resources, prefix)
        gpus = info.gpus + sum(quantity(ps.get("count", 1)) * claimed((ps.get("template") or {}).get("spec"))
                               for ps in (obj.get("spec") or {}).get("podSets") or [] if isinstance(ps, Mapping))
        return Subject("Workload", ns, name, uid, gpus, dict(info.identity), info.workload_id, True, tuple(notes + refusal_notes(info.refused)))
    raise ValueError(f"gpuledger admit decides Pods, Jobs and Kueue Workloads, not {kind or 'an object without kind'}")


def refusal_notes(refused: Mapping[str, str]) -> list[str]:
    """A note per identity label/annotation left out of the subject (``identity_fields``): the
    decision is taken without it, and says why — a release id that was refused otherwise read as
    "names no release"."""
    return [f"Its {key} was not used: {why}" for key, why in refused.items()]


@dataclass(frozen=True)
class Override:
    """One ``release.admission_overridden`` event, as the decision needs it."""

    event_id: str
    release_id: str
    target: str
    actor: str | None  # decision_actor form
    at: datetime
    expires_at: datetime | None

    def covers(self, subject: Subject) -> bool:
        if self.release_id != subject.identity.get("release_id"):
            return False
        return self.target in (subject.workload_id, f"{subject.namespace}/{subject.name}", f"{subject.namespace}/*")


class AdmissionState(ReleaseDirectory):
    """The release directory plus the emergency admission overrides of the same topic
    (the directory's history keeps no target or expiry). Fed by
    ``streams.correlate.directory.follow_release_topic`` like any directory."""

    def __init__(self) -> None:
        super().__init__()
        self.overrides: dict[str, list[Override]] = {}
        self.applied = 0  # release events folded in: the admit server's freshness counter
        # Folds happen on the follower's event loop; a reader on another thread (the
        # AdmissionCheck controller) holds this while it decides.
        self.lock = threading.RLock()

    def apply(self, event) -> list[str]:
        with self.lock:
            return self._apply(event)

    def stale_note(self, stale_after_s: float, now: float | None = None) -> str | None:
        """What a decision on this state says when the state was last confirmed current
        (``ReleaseDirectory.confirmed_at``) more than ``stale_after_s`` ago — the release topic
        cannot be read: the decision may miss a revocation or an approval published since. Names
        the instant, not the age, so that the AdmissionCheck controller's message does not change
        at every resync of one outage. None while fresh, and before the state loaded (the
        ``state-not-loaded`` rule says that)."""
        at = self.confirmed_at
        if at is None or not self.ready.is_set() or (time.time() if now is None else now) - at <= stale_after_s:
            return None
        when = iso_z(datetime.fromtimestamp(at, timezone.utc), 0)
        return (f"gpuledger admit could not confirm its release state is current since {when} (the release topic cannot be read): "
                "approvals, revocations and overrides published after that are not seen by this decision")

    def _apply(self, event) -> list[str]:
        changed = super().apply(event)
        self.applied += 1
        if event.event_type == OVERRIDE_EVENT and event.payload.target:
            entry = Override(event.event_id, event.identity.release_id, event.payload.target, decision_actor(event.payload),
                             event.occurred_at, event.payload.expires_at)
            items = self.overrides.setdefault(event.identity.release_id, [])
            if entry not in items:
                items.append(entry)
        return changed


@dataclass(frozen=True)
class Decision:
    """What ``gpuledger admit`` answers, and why."""

    verdict: Verdict  # what we answer: deny only in enforce mode
    rule: str  # one of RULES
    message: str  # for the model team (the API server shows it to whoever created the object)
    outcome: Literal["allow", "deny"]  # what the rule said, before the mode
    mode: str
    environment: str | None
    release_id: str | None
    release_state: str | None  # the release's latest lifecycle event at decision time
    fail_closed: bool
    policy_version: str
    directory_version: int
    override_event_id: str | None = None
    evidence: tuple[str, ...] = field(default=())  # release event ids the rule read (approval, revocation, override)

    @property
    def allowed(self) -> bool:
        return self.verdict != "deny"

    @property
    def warnings(self) -> list[str]:
        # A fail-open 'state-not-loaded' allow is let through unchecked: its creator is told so
        # (docs/admission.md: "allow with a warning"), as in warn mode.
        unchecked = self.rule == "state-not-loaded" and self.allowed
        return [self.message] if self.verdict == "warn" or unchecked else []


def _approvers(policy: Policy) -> str:
    holders = [f"{name}: {', '.join(role.members) or 'no members'}" for name, role in sorted(policy.roles.items()) if "approve" in role.actions]
    return "; ".join(holders) or "no role has it in the policy"


def _approved_for(rel: Release, policy: Policy, now: datetime) -> list[str]:
    """The environments the release is approved for at ``now`` by actors holding ``approve``, as
    ``approval_changes`` counts them: approvals since its last revocation or retirement."""
    envs: list[str] = []
    for at, etype, _eid, env, actor in rel.history:
        if at > now:
            break
        if etype in ("release.revoked", "release.retired") and policy.stops(actor):
            envs = []
        elif etype == "release.approved" and env and env not in envs and policy.allowed(actor, "approve"):
            envs.append(env)
    return envs


def releases_environment(subject: Subject, state: ReleaseDirectory | None, policy: Policy) -> str | None:
    """The environment an unlabelled workload's release names for it: the strictest of the
    environments needing an approval that any of the release's events named (``--env`` of its
    registration, approval, promotion, …) — else None (an unknown environment, as without it).
    It tightens the approval rule; ``decide`` keeps the mode no laxer than without it.

    Control 1 judges the same workload in the same environment (``rules._approval_environment``, the
    release's events up to its admission), so what the webhook admits, control 1 accepts.

    Why not the workload's label alone: an unlabelled workload in a namespace the policy does not map
    was then decided in an unknown environment, which any approval covers — a release approved for
    staging and promoted to prod without a prod approval had such workloads let in. Why the strictest
    of all, not the manifest's latest (what the row's identity shows): the latest of events of one
    instant is the one whose id sorts last, and any later event naming a laxer environment (an
    approval for dev by anyone, an evaluation) would lower it. The strictest never falls, whatever the
    order. Why only one needing an approval: ``Policy.approval_environment`` (a release registered for
    dev alone does not let its unlabelled workloads in unapproved)."""
    rid = subject.identity.get("release_id")
    if state is None or not rid or not state.ready.is_set() or not state.known(rid):
        return None
    return policy.approval_environment(state.environments_named(rid))


def decide(subject: Subject, state: AdmissionState | None, policy: Policy, now: datetime | None = None, *,
           gate: Gate = "webhook", policy_version: str | None = None) -> Decision:
    """The decision for ``subject`` at ``now`` (default: the current time).

    ``state`` None means the release state is not loaded yet. ``gate`` is who asks: the
    webhook (at creation) or the AdmissionCheck controller (a Workload in its queue).
    ``policy_version``: ``policy.fingerprint``, computed once by a long-running caller."""
    now = now or datetime.now(timezone.utc)
    version = policy_version or policy.fingerprint
    labelled = subject.identity.get("environment")
    released = None if labelled else releases_environment(subject, state, policy)
    env = policy.workload_environment(subject.namespace, labelled or released, subject.namespace_environment)
    rid = subject.identity.get("release_id")
    # Mode and fail-closed: never laxer than the namespace's environment (Admission.mode_for).
    floor = policy.workload_environment(None, None, subject.namespace_environment)  # (an unlisted label: the strictest)
    mode = policy.admission.mode_for(subject.namespace, env, floor)
    fail_closed = policy.admission.decided_fail_closed(subject.namespace, env, floor)
    if released:
        # The release's environment (anyone's events name it) tightens the approval rule, never the mode:
        # the mode stays at least what the workload had without it (modes: {staging: warn} turned an
        # unknown environment's enforce into warn once someone published an evaluation for staging).
        without = policy.workload_environment(subject.namespace, None, subject.namespace_environment)
        mode = max(mode, policy.admission.mode_for(subject.namespace, without, floor), key=MODE_STRICTNESS.index)
    where = env or "an unknown environment"
    # What to have the release approved for (the advice of a denial): "approved for an unknown
    # environment" named nothing anyone can approve for.
    approve_for = env or ("its environment (none is known: label it gpuledger.io/environment=<environment> or map its namespace "
                          "in the policy's admission.namespaces)")
    at_iso = now.isoformat()
    loaded = state is not None and state.ready.is_set()

    if labelled and env and policy.environment(labelled) is None:
        # Said once, after the rule's message: why the environment is not the one the label names.
        unlisted = (f" (its gpuledger.io/environment label {labelled!r} names no environment of the policy: "
                    f"decided as {env}, the strictest it lists)")
    else:
        unlisted = ""

    def done(outcome: str, rule: str, message: str, *, evidence=(), override: str | None = None, applies_mode: bool = True) -> Decision:
        message += unlisted
        verdict: Verdict = "allow"
        if outcome == "deny":
            verdict = {"enforce": "deny", "warn": "warn", "dry-run": "allow"}[mode] if applies_mode else "deny"
        if outcome == "deny" and verdict in ("warn", "allow"):
            # Warn: the same text is the AdmissionReview warning, the Ready check's message and the
            # recorded message — worded as a denial alone, it read as one (or as nothing to fix).
            # Dry-run: nothing is said to whoever created the object, but the recorded message (and
            # the Ready check's) read as a denial of a workload that was let in. At the
            # AdmissionCheck, enforce mode holds a Workload in its queue unless the rule ends its
            # wait (PERMANENT_RULES): "would be denied" overstated a wait for an approval.
            scope = f"namespace {subject.namespace} in {where}" if subject.namespace else where
            enforced = ("would wait in its queue (its AdmissionCheck Pending)" if gate == "admission-check" and rule not in PERMANENT_RULES
                        else "would be denied")
            message = (f"Allowed only because the admission mode for {scope} is warn; in enforce mode this {enforced}: {message}"
                       if verdict == "warn" else
                       f"Allowed and recorded only: the admission mode for {scope} is dry-run; in enforce mode this {enforced}: {message}")
        return Decision(verdict, rule, message, outcome, mode, env, rid,
                        state.lifecycle_state_as_of(rid, at_iso) if (loaded and rid) else None, fail_closed, version,
                        state.version_at(rid, at_iso) if (loaded and rid) else 0, override, tuple(e for e in evidence if e))

    if subject.gpus <= 0:
        return done("allow", "not-gpu", f"{subject.ref} requests no GPU")
    if not loaded:
        if gate == "admission-check":
            # A queued Workload can wait: fail-open exists for the webhook, whose caller (the API server)
            # gives up after its timeout. Let through here, a Workload of a fail-open environment was
            # admitted unchecked at every restart of the controller, which never revisits admitted ones.
            return done("deny", "state-not-loaded", f"gpuledger admit has not loaded the release state yet; {subject.ref} waits in its "
                        "queue (its AdmissionCheck Pending) until it has, and is decided then", applies_mode=False)
        if fail_closed:
            return done("deny", "state-not-loaded", f"gpuledger admit has not loaded the release state yet; {where} is fail-closed, "
                        "so GPU workloads wait until it has (retry in a moment)", applies_mode=False)
        return done("allow", "state-not-loaded", f"gpuledger admit has not loaded the release state yet; {where} is fail-open, "
                    f"so {subject.ref} was let through unchecked (control 1 still checks it after admission)")
    envp = policy.environment(env)
    if envp is not None and not envp.requires_approval:
        return done("allow", "approval-not-required", f"{env} needs no approved release (policy environments.{env}.requires_approval)")
    if gate == "webhook" and subject.queued and policy.admission.namespace(subject.namespace).gate == "admission-check":
        return done("allow", "deferred-to-admission-check", f"{subject.ref} is queued by Kueue in {subject.namespace}, whose gate is "
                    "the gpuledger.io/release-approval AdmissionCheck: it waits in its queue until its release is approved")
    rejected_overrides: list[str] = []
    for ov in (state.overrides.get(rid, []) if rid else []):
        if not ov.covers(subject):
            continue
        limit = policy.emergency_overrides.max_duration
        if not policy.allowed(ov.actor, "override"):
            rejected_overrides.append(f"the override by {actor_text(ov.actor) or 'no recorded actor'} does not count: "
                                      f"{policy.why_not(ov.actor, 'override')}")
        elif ov.expires_at is None or ov.expires_at - ov.at > limit:
            rejected_overrides.append(f"the override by {actor_text(ov.actor)} does not count: it needs an expiry at most "
                                      f"{limit} after it was given")
        elif ov.at <= now < ov.expires_at:
            return done("allow", "override", f"{subject.ref} let through by the emergency override of {actor_text(ov.actor)} "
                        f"(target {ov.target}) until {iso(ov.expires_at)}", evidence=(ov.event_id,), override=ov.event_id)
        elif now >= ov.expires_at:
            # Said, so that whoever relied on it sees why the same workload is now denied.
            rejected_overrides.append(f"the override by {actor_text(ov.actor)} (target {ov.target}) expired at {iso(ov.expires_at)}")
    tail = ("; " + "; ".join(rejected_overrides)) if rejected_overrides else ""
    if not rid:
        return done("deny", "no-release-identity", f"{subject.ref} requests {subject.gpus} GPU(s) in {where} but names no release: "
                    f"label it (and its pod template) gpuledger.io/release-id=<release id> with a release approved for {approve_for}" + tail)
    rel = Release(state, rid)
    if not rel.known:
        return done("deny", "unknown-release", f"release {rid} is not known to gpuledger (no release event names it): register it "
                    f"(gpuledger release register) and have it approved for {approve_for}" + tail)
    approved, cause = False, None
    for at, value, eid in approval_changes(rel, policy, env):
        if at > now:
            break
        approved, cause = value, eid
    if approved:
        return done("allow", "approved", f"release {rid} is approved for {where}", evidence=(cause,))
    if cause is not None:
        how = next((e[1].split(".", 1)[1] for e in rel.history if e[2] == cause), "revoked")
        return done("deny", "revoked", f"release {rid} was {how}; it may not start new GPU work in {where}; "
                    "run an approved release instead" + tail, evidence=(cause,))
    # Revoked or retired without ever having been approved here: an end, not a wait for an approval. As
    # "unapproved" its Workload stayed Pending in its queue for ever, holding quota, and the message asked for an
    # approval of a revoked release (exploratory review). (A revocation the policy does not count: Policy.stops.)
    ended = [e for e in rel.history if e[0] <= now and e[1] in ("release.revoked", "release.retired") and policy.stops(e[4])]
    if ended:
        return done("deny", "revoked", f"release {rid} was {ended[-1][1].split('.', 1)[1]}; it may not start new GPU work in {where}; "
                    "run an approved release instead" + tail, evidence=(ended[-1][2],))
    # The lifecycle state, not the latest event of any kind: after an override the message said
    # 'is admission_overridden, not approved for prod'.
    latest = state.lifecycle_state_as_of(rid, at_iso)
    shown = latest.split(".", 1)[1] if latest else "not registered"
    elsewhere = _approved_for(rel, policy, now)
    if elsewhere:
        # Approved, but for earlier environments only: say which ('is approved, not approved for prod' did not).
        shown = f"{shown} for {', '.join(elsewhere)}" if latest == "release.approved" else f"{shown} (approved for {', '.join(elsewhere)})"
    unentitled = [e for e in rel.history if e[1] == "release.approved" and e[0] <= now and _covers(policy, e[3], env)]
    if unentitled:
        last = unentitled[-1]
        return done("deny", "approval-not-entitled", f"release {rid} was approved only by {actor_text(last[4]) or 'no recorded actor'}, "
                    f"which does not count for {where}: {policy.why_not(last[4], 'approve')}; approvals need the `approve` right "
                    f"({_approvers(policy)}): gpuledger release approve --release-id {rid} --env {env or '<env>'} --actor <approver>" + tail,
                    evidence=(last[2],))
    return done("deny", "unapproved", f"release {rid} is {shown}, not approved for {where}; approvals need the `approve` right "
                f"({_approvers(policy)}): gpuledger release approve --release-id {rid} --env {env or '<env>'} --actor <approver>" + tail)
