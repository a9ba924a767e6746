"""The decision-rights and control policy: who may do what, and the thresholds of the eight controls.

Input: a YAML file (``GPULEDGER_POLICY_FILE``; unset means the built-in default, which
``deploy/policy/default.yaml`` documents line by line). Output: a frozen ``Policy``
the control agents (``streams/controls/agents.py``, rules in ``streams/controls/rules.py``) and
``gpuledger audit`` evaluate against.

Guarantees: unknown keys and wrong types are rejected; every problem is reported at
once, each with its dotted field path and the file's line number; cross-references
(a control's accountable role, a role's actions, the environments the admission section
names) are checked before the worker starts.
The built-in default and ``deploy/policy/default.yaml`` are the same policy (a test
keeps them equal), so an installed package without the deploy/ directory still runs.

Durations are written in the one grammar of ``gpuledger.timefmt``: ``90s``, ``30m``, ``2h``,
``1d`` or combined (``1h30m``); a bare number is seconds.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuledger.timefmt import parse_duration
from schemas.envelope import nfc
from schemas.release import actor_text, parse_decision

#: Every decision a role can be given. Release lifecycle events and admin actions map
#: onto them (``ACTION_OF_EVENT``).
Action = Literal["approve", "promote", "rollback", "revoke", "retire", "reserve", "pause_queue", "isolate_node", "override_priority",
                 "delegate", "override"]
Severity = Literal["info", "warning", "critical"]

ACTION_OF_EVENT: dict[str, str] = {
    "release.approved": "approve",
    "release.promoted": "promote",
    "release.rolled_back": "rollback",
    "release.revoked": "revoke",
    "release.retired": "retire",
    "release.reservation_created": "reserve",
    "release.reservation_released": "reserve",
    "release.queue_paused": "pause_queue",
    "release.node_isolated": "isolate_node",
    "release.priority_overridden": "override_priority",
    "release.admission_overridden": "override",
}

#: Control number -> field of ``Controls`` (and its title, DESIGN.md "Controls").
CONTROL_NAMES: dict[int, str] = {
    1: "admission", 2: "promotion", 3: "artifact_identity", 4: "priority_preemption",
    5: "capacity_reservation", 6: "telemetry_correlation", 7: "incident_authority", 8: "retirement",
}
CONTROL_TITLES: dict[int, str] = {
    1: "Admission", 2: "Promotion", 3: "Artifact identity", 4: "Priority and preemption",
    5: "Capacity reservation", 6: "Telemetry correlation", 7: "Incident authority", 8: "Retirement",
}

#: The longest duration a policy field takes: the controls add them to event times (a grace period
#: after a retirement, an override's maximum), and ``max_duration: 999999999d`` — accepted, the
#: longest a ``timedelta`` holds — overflowed the first date it was added to, in the worker.
MAX_POLICY_DURATION = timedelta(days=36500)


def _bounded(value: timedelta) -> timedelta:
    if value > MAX_POLICY_DURATION:
        raise ValueError(f"at most {MAX_POLICY_DURATION.days}d (100 years) — a duration is added to event times, and a longer one "
                         f"overflows them")
    return value


Duration = Annotated[timedelta, BeforeValidator(parse_duration), AfterValidator(_bounded)]

#: A role member naming a group (``group:oncall``): every actor the receiver authenticated
#: with that group (credentials file ``groups``, the OIDC groups claim) is a member.
GROUP_MEMBER = "group:"


class PolicyError(ValueError):
    """A policy file that cannot be used; the message lists every problem with its line."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Environment(_Model):
    """One environment, in promotion order (the list order of ``environments``)."""

    name: str = Field(min_length=1, description="Environment name as workloads and releases carry it (dev, eval, staging, prod).")
    requires_approval: bool = Field(default=True, description="Control 1: a workload admitted here needs a release approved (and not revoked) before admission.")
    requires_promotion: bool = Field(default=True, description="Control 2: a workload running here needs its release promoted here (and not rolled back).")
    observation_window: Duration = Field(default=timedelta(0), description="Control 4: how long after a promotion to this environment the release's workloads must not be preempted.")


class Role(_Model):
    """A named role: its members hold its decision rights; its owner is accountable."""

    owner: str = Field(min_length=1, description="Accountable team for the role (named as owner on the violations of the controls it is accountable for).")
    members: tuple[str, ...] = Field(default=(), description="Who holds the role: actors as release events name them in `actor` (`user:alice`, `service:ci-gitlab`, or a bare `alice`, which matches `user:alice` too), and groups as `group:<name>` (any actor the receiver authenticated with that group).")
    actions: tuple[Action, ...] = Field(default=(), description="Decisions the members may take.")

    @field_validator("members")
    @classmethod
    def _named_groups(cls, members: tuple[str, ...]) -> tuple[str, ...]:
        empty = [m for m in members if m.startswith(GROUP_MEMBER) and not m[len(GROUP_MEMBER):].strip()]
        if empty:
            raise ValueError("a group member needs a name after 'group:' (e.g. group:oncall)")
        return tuple(nfc(m) for m in members)  # (as the actors they are compared with: ``schemas.envelope.nfc``)


class ControlPolicy(_Model):
    """How one control reports."""

    enabled: bool = Field(default=True, description="Evaluate this control.")
    accountable: str = Field(description="Role whose owner is accountable for this control's violations.")
    severity: Severity = Field(default="critical", description="Severity of its violations (info does not fail `gpuledger audit`).")


class Controls(_Model):
    """One block per control (DESIGN.md, Controls)."""

    admission: ControlPolicy = Field(default=ControlPolicy(accountable="platform-sre", severity="critical"), description="1. Admission.")
    promotion: ControlPolicy = Field(default=ControlPolicy(accountable="release-managers", severity="critical"), description="2. Promotion.")
    artifact_identity: ControlPolicy = Field(default=ControlPolicy(accountable="release-managers", severity="critical"), description="3. Artifact identity.")
    priority_preemption: ControlPolicy = Field(default=ControlPolicy(accountable="platform-sre", severity="warning"), description="4. Priority and preemption.")
    capacity_reservation: ControlPolicy = Field(default=ControlPolicy(accountable="capacity-planners", severity="warning"), description="5. Capacity reservation.")
    telemetry_correlation: ControlPolicy = Field(default=ControlPolicy(accountable="platform-sre", severity="warning"), description="6. Telemetry correlation.")
    incident_authority: ControlPolicy = Field(default=ControlPolicy(accountable="release-managers", severity="critical"), description="7. Incident authority.")
    retirement: ControlPolicy = Field(default=ControlPolicy(accountable="capacity-planners", severity="critical"), description="8. Retirement.")

    @model_validator(mode="before")
    @classmethod
    def _over_the_defaults(cls, data):
        """A control's block in a policy file changes what it names, over that control's default:
        ``retirement: {enabled: false}`` keeps retirement's accountable role and severity (it
        failed with "accountable: Field required", and a block without ``severity`` took the
        field's "critical" where the control's default is "warning")."""
        if not isinstance(data, dict):
            return data
        merged = {}
        for name, block in data.items():
            field = cls.model_fields.get(name)
            if isinstance(block, dict) and field is not None and isinstance(field.default, ControlPolicy):
                block = {**field.default.model_dump(), **block}
            merged[name] = block
        return merged


class Reservations(_Model):
    """Control 5 thresholds."""

    grace: Duration = Field(default=timedelta(hours=1), description="A reservation with no GPU allocated this long after its window starts is unused; one still held this long after its window ends is held past launch.")
    min_utilisation: float = Field(default=0.5, ge=0, le=1, description="Peak allocated / reserved GPUs below this over the window is reported (severity info); 0 disables.")


class Retirement(_Model):
    """Control 8 threshold."""

    grace: Duration = Field(default=timedelta(hours=1), description="How long after retirement/revocation a release may still hold GPUs, reservations or running workloads.")


class EmergencyOverrides(_Model):
    """Control 7: admin actions that are emergency overrides and must expire."""

    actions: tuple[Action, ...] = Field(default=("override_priority", "pause_queue", "override"), description="Actions that are emergency overrides (need expires_at).")
    max_duration: Duration = Field(default=timedelta(hours=4), description="Longest an override may last (expires_at - occurred_at).")


Endpoint = Literal["alertmanager", "releases", "mlflow"]


class Authentication(_Model):
    """Who an actor is and how it must be proven (controls 1, 2, 7 and the receiver)."""

    require_for_rights: bool = Field(default=False, description="A decision right counts only when the receiver authenticated the actor: an unauthenticated approval, promotion or admin action (e.g. the CLI straight to Kafka) fails control 7 and does not approve or promote for controls 1 and 2.")
    required_on: tuple[Endpoint, ...] = Field(default=(), description="Receiver endpoints that refuse requests without a valid credential (401), whatever else is configured.")


class AlertMatcher(_Model):
    """Which alerts are quality alerts: a listed name, or all listed labels equal."""

    names: tuple[str, ...] = Field(default=("ModelQualityDegraded",), description="Alert names (alertname) that are quality alerts.")
    labels: dict[str, str] = Field(default_factory=lambda: {"category": "quality"}, description="Label values that make an alert a quality alert (all must match).")

    def matches(self, alertname: str | None, labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        if alertname and alertname in self.names:
            return True
        return bool(self.labels) and all(labels.get(k) == v for k, v in self.labels.items())


class Telemetry(_Model):
    """Control 6 scope."""

    quality_alerts: AlertMatcher = Field(default_factory=AlertMatcher, description="Which alerts are quality alerts (their violations are critical).")
    scope: Literal["all", "quality"] = Field(default="all", description="Alerts that must be attributable to a release: all, or only quality alerts.")


class BusinessPriority(_Model):
    """Control 4: business priority of a workload, first match wins: release, owner, priority class."""

    by_release: dict[str, int] = Field(default_factory=dict, description="release_id -> business priority.")
    by_owner: dict[str, int] = Field(default_factory=dict, description="Owning team -> business priority.")
    by_priority_class: dict[str, int] = Field(
        default_factory=lambda: {"prod-critical": 100, "prod-high": 90, "prod": 80, "staging": 50, "batch": 40, "research-burst": 20,
                                 "research": 10, "preemptible": 0},
        description="Kubernetes priority class -> business priority.")

    def of(self, release_id: str | None, owner: str | None, priority_class: str | None) -> int | None:
        if release_id and release_id in self.by_release:
            return self.by_release[release_id]
        if owner and owner in self.by_owner:
            return self.by_owner[owner]
        if priority_class and priority_class in self.by_priority_class:
            return self.by_priority_class[priority_class]
        return None


AdmissionMode = Literal["enforce", "warn", "dry-run"]
#: Admission modes from the laxest to the strictest.
MODE_STRICTNESS: tuple[AdmissionMode, ...] = ("dry-run", "warn", "enforce")
AdmissionGate = Literal["webhook", "admission-check"]


class NamespaceAdmission(_Model):
    """How ``gpuledger admit`` treats one namespace."""

    environment: str | None = Field(default=None, description="Environment of the namespace's workloads; a workload's gpuledger.io/environment label can make it stricter (a later environment), never laxer.")
    mode: AdmissionMode | None = Field(default=None, description="enforce (deny), warn (allow with a warning) or dry-run (decide and record only); unset: the environment's mode.")
    gate: AdmissionGate = Field(default="webhook", description="webhook: the admission webhook denies at creation; admission-check: Jobs Kueue manages (suspended, with a queue-name label) and Workloads are let through the webhook and wait in their queue on the gpuledger.io/release-approval AdmissionCheck instead; Pods are always decided by the webhook.")


class Admission(_Model):
    """``gpuledger admit``: control 1 as prevention (docs/admission.md)."""

    default_mode: AdmissionMode = Field(default="enforce", description="Mode of environments and namespaces not listed.")
    modes: dict[str, AdmissionMode] = Field(default_factory=dict, description="Environment -> mode.")
    namespaces: dict[str, NamespaceAdmission] = Field(default_factory=dict, description="Namespace -> environment, mode and gate.")
    fail_closed: tuple[str, ...] = Field(default=("prod",), description="Environments decided fail-closed: when the release state is not loaded or the decision fails, deny (elsewhere: allow with a warning). The webhook configuration's failurePolicy: Fail for their namespaces says the same to the API server.")

    def namespace(self, name: str | None) -> NamespaceAdmission:
        return self.namespaces.get(name or "") or NamespaceAdmission()

    def mode_for(self, namespace: str | None, environment: str | None, labelled_namespace: str | None = None) -> AdmissionMode:
        """The namespace's own mode, else the strictest of the environment's and the namespace's
        environment's: the namespace entry is a floor (a workload's label, which its creator
        writes, made a prod namespace's work 'warn' by naming a later environment set to warn).
        ``labelled_namespace``: the namespace's own ``gpuledger.io/environment`` label, as the API
        server's choice of webhook proves it (``/validate/<environment>``) — a floor as well."""
        ns = self.namespace(namespace)
        if ns.mode:
            return ns.mode
        envs = (environment, *(env for env in (ns.environment, labelled_namespace) if env))
        return max((self.modes.get(env or "", self.default_mode) for env in envs), key=MODE_STRICTNESS.index)

    def decided_fail_closed(self, namespace: str | None, environment: str | None, labelled_namespace: str | None = None) -> bool:
        """Whether the workload is decided fail-closed: its environment or its namespace's is
        (the namespace entry, and the namespace's own label, are floors here too)."""
        return any(env in self.fail_closed for env in (environment, self.namespace(namespace).environment, labelled_namespace) if env)


def _default_environments() -> tuple[Environment, ...]:
    return (
        Environment(name="dev", requires_approval=False, requires_promotion=False),
        Environment(name="eval", requires_approval=False, requires_promotion=True, observation_window=timedelta(minutes=30)),
        Environment(name="staging", requires_approval=True, requires_promotion=True, observation_window=timedelta(hours=1)),
        Environment(name="prod", requires_approval=True, requires_promotion=True, observation_window=timedelta(hours=2)),
    )


def _default_roles() -> dict[str, Role]:
    return {
        "release-managers": Role(owner="team-mlops", members=("alice", "carol", "dana"),
                                 actions=("approve", "promote", "rollback", "revoke", "retire", "reserve")),
        "release-automation": Role(owner="team-mlops", members=("ml-platform-bot",), actions=("retire",)),
        "platform-sre": Role(owner="team-platform", members=("bob", "oncall-bob", "oncall-sre"),
                             actions=("rollback", "pause_queue", "isolate_node", "override_priority", "reserve", "override")),
        "capacity-planners": Role(owner="team-capacity", members=("erin",), actions=("reserve",)),
    }


class Policy(_Model):
    """Decision rights and control thresholds (see deploy/policy/default.yaml)."""

    version: Literal[1] = Field(default=1, description="Policy file format version.")
    environments: tuple[Environment, ...] = Field(default_factory=_default_environments, description="Environments in promotion order.")
    roles: dict[str, Role] = Field(default_factory=_default_roles, description="Role name -> role.")
    controls: Controls = Field(default_factory=Controls, description="Per-control accountability and severity.")
    reservations: Reservations = Field(default_factory=Reservations, description="Control 5.")
    retirement: Retirement = Field(default_factory=Retirement, description="Control 8.")
    emergency_overrides: EmergencyOverrides = Field(default_factory=EmergencyOverrides, description="Control 7.")
    telemetry: Telemetry = Field(default_factory=Telemetry, description="Control 6.")
    business_priority: BusinessPriority = Field(default_factory=BusinessPriority, description="Control 4.")
    authentication: Authentication = Field(default_factory=Authentication, description="Proven actors (controls 1, 2, 7; receiver endpoints).")
    admission: Admission = Field(default_factory=Admission, description="gpuledger admit: modes, namespaces, fail-closed environments.")

    @model_validator(mode="after")
    def _cross_references(self) -> Policy:
        problems = reference_problems(self.model_dump(mode="json"))
        if problems:
            raise ValueError("; ".join(f"{'.'.join(map(str, path))}: {msg}" for path, msg in problems))
        return self

    def compressed(self, speed: float) -> Policy:
        """This policy with every duration divided by ``speed``: for exercises whose
        timeline runs ``speed`` times faster than real time (``gpuledger exercise --speed``)."""
        if speed <= 0:
            raise ValueError("speed must be positive")

        def scale(model):
            updates = {}
            for name, value in model:
                if isinstance(value, timedelta):
                    updates[name] = value / speed
                elif isinstance(value, BaseModel):
                    updates[name] = scale(value)
                elif isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
                    updates[name] = tuple(scale(v) for v in value)
            return model.model_copy(update=updates)

        return scale(self)

    @property
    def fingerprint(self) -> str:
        """The policy's version as recorded on every violation judged under it:
        ``sha256:`` and the first 16 hex digits of the SHA-256 of its canonical JSON (keys
        sorted, durations in ISO 8601). Equal policies have equal fingerprints whatever
        file or formatting they came from; any change of a right or threshold changes it.
        (Not cached: ``model_copy`` — ``compressed`` — would copy a cached value.)"""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]

    # --- questions the controls ask --------------------------------------------------
    def environment(self, name: str | None) -> Environment | None:
        return next((e for e in self.environments if e.name == name), None) if name else None

    def stops(self, actor: str | None) -> bool:
        """Whether a revocation or retirement by ``actor`` (a ``decision_actor`` string) takes the
        release out of service for controls 1 and 8 and admission: always — it is a brake, and an
        unentitled one is control 7's finding — except when the policy requires proof
        (``authentication.require_for_rights``) and nobody proved the actor: then an anonymous POST
        of ``release.revoked`` by 'mallory' made admission deny every new pod of an approved release.
        (Requiring the revoke/retire right itself stopped a signed MLflow webhook's retirement —
        ``service:mlflow/...`` holds no role by default — from counting at all.)"""
        return not self.authentication.require_for_rights or (bool(actor) and parse_decision(actor).proven)

    def workload_environment(self, namespace: str | None, labelled: str | None, labelled_namespace: str | None = None) -> str | None:
        """The environment a workload runs in: of its namespace's in the policy
        (``admission.namespaces.<ns>.environment``) and what its own ``gpuledger.io/environment``
        label (or annotation) says, the stricter — the later in promotion order; either alone when
        only one is known; None when neither is (unknown: needs approval).

        A workload's label is written by whoever creates the workload: ``gpuledger.io/environment:
        dev`` on a Job in a prod namespace made admission allow an unapproved release
        ('approval-not-required') and control 1 skip it. It can still make the rules stricter.

        A label naming an environment the policy does not list (``production``, ``prd``) is read
        as the strictest environment it does list (the last). It is a misspelling of a real one or
        an attempt to get out of one; returned as it was, it picked no mode of its own (the
        default: 'warn' in a prod namespace whose policy enforced prod), no fail-closed, no
        promotion check (control 2), and a deny message that asked for an approval for an
        environment nothing else knows. As the strictest listed environment it never loosens a
        rule, and approvals, modes and fail-closed are a real environment's.

        ``labelled_namespace``: the namespace's own ``gpuledger.io/environment`` label, known to
        ``gpuledger admit`` from the webhook the API server called (``/validate/<environment>``:
        the webhook configuration sends a namespace labelled with a fail-closed environment to
        its own path). It counts as the policy's namespace entry does, the stricter of the two:
        a namespace labelled prod and not mapped in the policy was decided in an unknown
        environment — fail-open while the release state loaded, in the namespace whose webhook
        the API server calls fail-closed."""
        mapped = self._stricter(self.admission.namespace(namespace).environment, self._listed(labelled_namespace))
        return self._stricter(mapped, self._listed(labelled))

    def _listed(self, labelled: str | None) -> str | None:
        """A labelled environment as the policy reads it: one it does not list is its strictest."""
        if labelled and self.environment(labelled) is None and self.environments:
            return self.environments[-1].name
        return labelled or None

    def _stricter(self, mapped: str | None, labelled: str | None) -> str | None:
        if not (mapped and labelled) or mapped == labelled:
            return mapped or labelled or None
        rank = {name: self.environment_rank(name) for name in (mapped, labelled)}
        if rank[mapped] is None:  # (a policy file cannot name one: reference_problems; a model built in code can)
            return mapped
        return mapped if rank[mapped] >= rank[labelled] else labelled

    def approval_environment(self, named) -> str | None:
        """Of the environments ``named`` (a release's events named them), the strictest that needs an
        approval, as a workload label would read it (an unlisted name: the strictest listed); None when
        none does. The environment an unlabelled workload of the release is judged in by admission
        (``streams.controls.admission.releases_environment``) and control 1 (``_approval_environment``).

        Only one needing an approval: the release's events are anyone's to publish, so they may make a
        judgement stricter than an unknown environment's, never laxer — a custom strictest environment
        needing none (a sandbox, or an unlisted name read as it) let anyone's event drop a release
        promoted to prod back to unknown."""
        listed = {self.workload_environment(None, env) for env in named if env}
        ranked = [env for env in listed if self.environment_rank(env) is not None and self.environment(env).requires_approval]
        return max(ranked, key=self.environment_rank) if ranked else None

    def environment_rank(self, name: str | None) -> int | None:
        return next((i for i, e in enumerate(self.environments) if e.name == name), None) if name else None

    @staticmethod
    def _member(identity: str, groups: tuple[str, ...], role: Role) -> str | None:
        """The entry of ``role.members`` that makes ``identity`` (with its authenticated
        ``groups``) a member, or None. The identity's own entry wins over a group's."""
        if not identity or identity.startswith(GROUP_MEMBER):
            return None  # a name typed as "group:x" is not the group
        if identity in role.members:
            return identity
        if (bare := _bare(identity)) is not None and bare in role.members:
            return bare  # "user:alice" is the proven form of the bare "alice" older policies list
        return next((GROUP_MEMBER + g for g in groups if GROUP_MEMBER + g in role.members), None)

    def _grant(self, identity: str, groups: tuple[str, ...], action: str) -> tuple[str, str] | None:
        """(role, member entry) through which ``identity`` holds ``action``, or None: a role
        naming the identity itself first, then one naming one of its groups (roles in policy
        order). On the controls' hot path: every evaluation asks it for every lifecycle event."""
        if not identity or identity.startswith(GROUP_MEMBER):
            return None
        bare = _bare(identity)
        through_group = None
        for name, role in self.roles.items():
            if action not in role.actions:
                continue
            members = role.members
            if identity in members:
                return name, identity
            if bare is not None and bare in members:
                return name, bare
            if through_group is None:
                through_group = next(((name, GROUP_MEMBER + g) for g in groups if GROUP_MEMBER + g in members), None)
        return through_group

    def memberships(self, actor: str | None) -> list[str]:
        """The roles of a decision actor's person (the actor, or the person a service acted
        for), each as ``role`` or ``role via group:<name>`` when only a group makes them a member."""
        if not actor:
            return []
        d = parse_decision(actor)
        who, groups = (d.person, ()) if d.person else (d.actor, d.groups)
        out = []
        for name, role in sorted(self.roles.items()):
            member = self._member(who, groups, role)
            if member is not None:
                out.append(f"{name} via {member}" if member.startswith(GROUP_MEMBER) else name)
        return out

    def roles_of(self, actor: str | None) -> list[str]:
        """Role names of a decision actor's person (see ``memberships``)."""
        return [m.split(" via ", 1)[0] for m in self.memberships(actor)]

    def allowed(self, actor: str | None, action: str) -> bool:
        """Whether ``actor`` — a plain name or a ``schemas.release.decision_actor`` string —
        may take ``action``: an unauthenticated actor only when the policy does not require
        proof, a delegation (``service>person``) only when the service may delegate and the
        person holds the right. Group members (``group:<name>``) count only for the groups the
        receiver authenticated with the actor; the person a service acts for has no groups here."""
        if not actor:
            return False
        d = parse_decision(actor)
        if not d.proven and self.authentication.require_for_rights:
            return False
        if d.person is not None:
            return self._grant(d.actor, d.groups, "delegate") is not None and self._grant(d.person, (), action) is not None
        return self._grant(d.actor, d.groups, action) is not None

    def granted(self, actor: str | None, action: str) -> str | None:
        """How ``actor`` holds ``action``, for evidence: ``role platform-sre`` or ``role
        platform-sre via group:oncall`` (a delegation: the person's, then ``delegated by`` the
        service's); None when it does not (``why_not`` says why)."""
        if not actor:
            return None
        d = parse_decision(actor)
        if not d.proven and self.authentication.require_for_rights:
            return None
        if d.person is not None:
            through, right = self._grant(d.actor, d.groups, "delegate"), self._grant(d.person, (), action)
            if through is None or right is None:
                return None
            return f"{_held(right)}, delegated by {d.actor} ({_held(through)})"
        right = self._grant(d.actor, d.groups, action)
        return _held(right) if right is not None else None

    def may_delegate(self, identity: str, groups: tuple[str, ...] = ()) -> bool:
        """Whether ``identity`` (a service, with its authenticated groups) may act on behalf of a person (``on_behalf_of``)."""
        return self._grant(identity, tuple(groups), "delegate") is not None

    def why_not(self, actor: str | None, action: str) -> str:
        """Why ``allowed(actor, action)`` is False, in one clause for a violation's detail."""
        if not actor:
            return "no actor was recorded"
        d = parse_decision(actor)
        if not d.proven and self.authentication.require_for_rights:
            return f"{actor_text(actor).removesuffix(' (unauthenticated)')} was not authenticated (no credential proved who published it)"
        if d.person is not None and not d.actor:  # (straight to Kafka with --on-behalf-of alone: an empty actor read "  acted for")
            return f"no recorded actor acted for {d.person} (nobody to hold the delegate right)"
        if d.person is not None and self._grant(d.actor, d.groups, "delegate") is None:
            return f"{d.actor} acted for {d.person} without the delegate right" + _groups_text(d.groups)
        who, groups = (d.person, ()) if d.person is not None else (d.actor, d.groups)
        roles = self.memberships(actor)
        return f"{who}{_groups_text(groups)} holds {', '.join(roles) if roles else 'no role'}; none grants {action}"

    def control(self, control_id: int) -> ControlPolicy:
        return getattr(self.controls, CONTROL_NAMES[control_id])

    def owner_for(self, control_id: int) -> str:
        return self.roles[self.control(control_id).accountable].owner


#: The prefixes of a typed policy member (``group:oncall``, ``user:alice``, ``service:ci``): a bare
#: name never starts with one.
TYPED_MEMBER = ("group:", "user:", "service:")


def _bare(identity: str) -> str | None:
    """The bare policy name a proven ``user:<name>`` identity stands for (``alice`` for
    ``user:alice``; ``system:serviceaccount:ci:deployer`` for an OIDC subject of that name), None
    for any other. Never a typed member: ``user:group:oncall`` (an OIDC subject "group:oncall")
    is a user, and read as "group:oncall" it held that group's roles with no group proven
    (exploratory review)."""
    if not identity.startswith("user:") or identity[5:].startswith(TYPED_MEMBER):
        return None
    return identity[5:]


def _held(grant: tuple[str, str]) -> str:
    role, member = grant
    return f"role {role} via {member}" if member.startswith(GROUP_MEMBER) else f"role {role}"


def _groups_text(groups: tuple[str, ...]) -> str:
    return f" (groups: {', '.join(groups)})" if groups else ""


class PolicySettings(BaseSettings):
    """Where the policy comes from."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_POLICY_", extra="ignore")

    file: Path | None = Field(default=None, description="Policy YAML file; unset uses the built-in default (documented in deploy/policy/default.yaml).")

    def load(self) -> Policy:
        return load_policy(self.file)


def reference_problems(data: dict) -> list[tuple[tuple, str]]:
    """Cross-field problems of raw policy data, as (path, message): duplicate or missing
    environments, controls accountable to a role that does not exist, admission settings
    naming an environment that does not exist. Works on the raw mapping too, so they are
    reported together with field errors."""
    problems: list[tuple[tuple, str]] = []
    envs = data.get("environments", None)
    env_names: list | None = [e.name for e in _default_environments()] if envs is None else None
    if isinstance(envs, (list, tuple)):
        if not envs:
            problems.append((("environments",), "at least one environment is needed"))
        names = [e.get("name") for e in envs if isinstance(e, dict)]
        env_names = names
        for i, name in enumerate(names):
            if name is not None and names.index(name) != i:
                problems.append((("environments", i, "name"), f"{name!r} is listed more than once"))
    if env_names is not None:
        problems += _admission_environment_problems(data.get("admission"), env_names)
    roles = data.get("roles", None)
    role_names = set(roles) if isinstance(roles, dict) else set(_default_roles()) if roles is None else set()
    controls = data.get("controls") or {}
    if isinstance(controls, dict):
        for field in CONTROL_NAMES.values():
            block = controls.get(field)
            given = isinstance(block, dict) and "accountable" in block
            accountable = block["accountable"] if given else getattr(Controls(), field).accountable
            if isinstance(accountable, str) and accountable not in role_names:
                known = ", ".join(sorted(role_names)) or "none"
                if given:
                    problems.append((("controls", field, "accountable"), f"no role named {accountable!r} (roles: {known})"))
                else:
                    problems.append((("controls", field) if isinstance(block, dict) else ("roles",),
                                     f"control {field} is accountable by default to {accountable!r}, which is not a role here "
                                     f"(roles: {known}); add the role or set controls.{field}.accountable"))
    return problems


def _admission_environment_problems(admission, env_names: list) -> list[tuple[tuple, str]]:
    """The environments the ``admission`` section names, each checked against ``env_names``: a
    misspelt one loaded silently — ``fail_closed: [prood]`` left prod fail-open, ``modes: {prd:
    warn}`` changed nothing, a namespace mapped to ``production`` took the default mode."""
    known = ", ".join(str(n) for n in env_names if n is not None) or "none"
    missing = f"(environments: {known})"
    problems: list[tuple[tuple, str]] = []
    section = admission if isinstance(admission, dict) else {}
    if "fail_closed" in section:
        listed = section["fail_closed"]
        for i, name in enumerate(listed if isinstance(listed, (list, tuple)) else ()):
            if isinstance(name, str) and name not in env_names:
                problems.append((("admission", "fail_closed", i), f"no environment named {name!r} {missing}"))
    else:
        # The default is a name too: a policy that calls prod 'production' was fail-open everywhere.
        unknown = [name for name in Admission().fail_closed if name not in env_names]
        if unknown:
            problems.append((("admission",) if isinstance(admission, dict) else ("environments",),
                             f"admission.fail_closed is by default {', '.join(unknown)}, which is not an environment here {missing}; "
                             "set admission.fail_closed"))
    modes = section.get("modes")
    for name in (modes if isinstance(modes, dict) else {}):
        if name not in env_names:
            problems.append((("admission", "modes", name), f"no environment named {name!r} {missing}"))
    namespaces = section.get("namespaces")
    for ns, entry in (namespaces if isinstance(namespaces, dict) else {}).items():
        name = entry.get("environment") if isinstance(entry, dict) else None
        if isinstance(name, str) and name not in env_names:
            problems.append((("admission", "namespaces", ns, "environment"), f"no environment named {name!r} {missing}"))
    return problems


def _line_index(text: str) -> dict[tuple, int]:
    """YAML path (keys and list indexes) -> 1-based line, for error messages."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    lines: dict[tuple, int] = {}

    def walk(node, path: tuple) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = path + (key.value,)
                lines[child] = key.start_mark.line + 1
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                walk(value, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def _describe(exc: ValidationError, where: str, lines: dict[tuple, int]) -> list[str]:
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        if not loc:
            continue
        line = None
        for n in range(len(loc), -1, -1):
            if loc[:n] in lines:
                line = lines[loc[:n]]
                break
        path = ".".join(str(p) for p in loc) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        out.append(f"{where}:{line}: {path}: {msg}" if line else f"{where}: {path}: {msg}")
    return out


def parse_policy(text: str, where: str = "<policy>") -> Policy:
    """Validate policy YAML text; PolicyError lists every problem with its line."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark else where
        raise PolicyError(f"{at}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"{where}: a policy is a mapping of sections (environments, roles, controls, ...), got {type(data).__name__}")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        lines = _line_index(text)
        # Root-level errors come from the cross-reference validator: re-derived below
        # from the raw data, with their lines, together with the field errors.
        problems = _describe(exc, where, lines)
        for path, msg in reference_problems(data):
            line = next((lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in lines), None)
            text_path = ".".join(map(str, path))
            problem = f"{where}:{line}: {text_path}: {msg}" if line else f"{where}: {text_path}: {msg}"
            if problem not in problems:
                problems.append(problem)
        raise PolicyError("invalid policy:\n  " + "\n  ".join(problems)) from exc


def dump_policy(policy: Policy) -> str:
    """The policy as YAML that ``parse_policy`` reads back to an equal policy (durations
    in seconds) — e.g. to hand a compressed policy to an exercise's worker through
    GPULEDGER_POLICY_FILE."""

    def plain(value):
        if isinstance(value, timedelta):
            seconds = value.total_seconds()
            return int(seconds) if seconds == int(seconds) else seconds
        if isinstance(value, BaseModel):
            return {name: plain(v) for name, v in value}
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return yaml.safe_dump(plain(policy), sort_keys=False)


def load_policy(path: str | Path | None = None) -> Policy:
    """The policy in ``path``, or the built-in default when ``path`` is None."""
    if path is None:
        return Policy()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read the policy file {path}: {exc.strerror or exc} (GPULEDGER_POLICY_FILE / --policy)") from exc
    return parse_policy(text, str(path))
