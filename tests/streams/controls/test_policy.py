"""streams/controls/policy.py: the decision-rights policy file."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from streams.controls.policy import Policy, PolicyError, PolicySettings, dump_policy, load_policy, parse_policy

DEFAULT = Path(__file__).resolve().parents[3] / "deploy" / "policy" / "default.yaml"


def test_the_documented_default_file_is_the_built_in_default():
    assert load_policy(DEFAULT) == Policy() == load_policy(None)


def test_default_policy_answers_the_demo_questions():
    p = Policy()
    assert [e.name for e in p.environments] == ["dev", "eval", "staging", "prod"]
    assert p.allowed("alice", "approve") and p.allowed("alice", "promote") and not p.allowed("ci-pipeline", "approve")
    assert p.allowed("bob", "rollback") and not p.allowed("bob", "approve") and not p.allowed(None, "approve")
    assert p.environment("prod").observation_window == timedelta(hours=2)
    assert p.owner_for(1) == "team-platform" and p.owner_for(8) == "team-capacity"
    assert p.business_priority.of(None, None, "prod-high") == 90 and p.business_priority.of(None, None, "nope") is None


def test_every_problem_is_reported_with_its_line(tmp_path):
    bad = tmp_path / "policy.yaml"
    bad.write_text("""environments:
  - name: prod
    observation_window: soon
  - name: prod
roles:
  sre:
    owner: team-platform
    actions: [fly]
controls:
  admission: {accountable: nobody}
extra: 1
""")
    with pytest.raises(PolicyError) as exc:
        load_policy(bad)
    text = str(exc.value)
    assert f"{bad}:3: environments.0.observation_window: not a duration: 'soon'" in text
    assert f"{bad}:8: roles.sre.actions.0: Input should be 'approve'" in text
    assert f"{bad}:4: environments.1.name: 'prod' is listed more than once" in text
    assert f"{bad}:10: controls.admission.accountable: no role named 'nobody'" in text
    assert f"{bad}:11: extra: Extra inputs are not permitted" in text
    assert "control promotion is accountable by default to 'release-managers'" in text


def test_unreadable_or_malformed_files_say_so(tmp_path):
    with pytest.raises(PolicyError, match="cannot read the policy file"):
        load_policy(tmp_path / "missing.yaml")
    with pytest.raises(PolicyError, match=r"<policy>:1: not valid YAML"):
        parse_policy("roles: [")
    with pytest.raises(PolicyError, match="a policy is a mapping"):
        parse_policy("- 1")


def test_settings_read_the_file_from_the_environment(tmp_path, monkeypatch):
    custom = tmp_path / "p.yaml"
    custom.write_text(DEFAULT.read_text().replace("max_duration: 4h", "max_duration: 30m"))
    monkeypatch.setenv("GPULEDGER_POLICY_FILE", str(custom))
    assert PolicySettings().load().emergency_overrides.max_duration == timedelta(minutes=30)


def test_compressed_policy_scales_every_duration_for_fast_exercises():
    fast = Policy().compressed(30)
    assert fast.retirement.grace == timedelta(minutes=2) and fast.reservations.grace == timedelta(minutes=2)
    assert fast.environment("prod").observation_window == timedelta(minutes=4)
    assert fast.emergency_overrides.max_duration == timedelta(minutes=8) and fast.roles == Policy().roles


def test_dump_reads_back_to_the_same_policy():
    fast = Policy().compressed(7)
    assert parse_policy(dump_policy(fast)) == fast
    assert parse_policy(dump_policy(Policy())) == Policy()


def test_a_group_member_needs_a_name_and_is_reported_with_its_line(tmp_path):
    bad = tmp_path / "policy.yaml"
    bad.write_text("roles:\n  oncall:\n    owner: team-platform\n    members: [bob, 'group:']\n    actions: [isolate_node]\n"
                   "controls:\n  admission: {accountable: oncall}\n  promotion: {accountable: oncall}\n  artifact_identity: {accountable: oncall}\n"
                   "  priority_preemption: {accountable: oncall}\n  capacity_reservation: {accountable: oncall}\n"
                   "  telemetry_correlation: {accountable: oncall}\n  incident_authority: {accountable: oncall}\n  retirement: {accountable: oncall}\n")
    with pytest.raises(PolicyError) as err:
        load_policy(bad)
    assert "policy.yaml:4: roles.oncall.members: a group member needs a name after 'group:'" in str(err.value)
    good = parse_policy(bad.read_text().replace("'group:'", "'group:oncall'"))
    assert good.memberships("user:zoe\x1foncall") == ["oncall via group:oncall"] and good.roles_of("bob") == ["oncall"]
    assert good.granted("user:zoe\x1foncall", "isolate_node") == "role oncall via group:oncall"
    assert good.granted("bob", "isolate_node") == "role oncall" and good.granted("user:zoe\x1fother", "isolate_node") is None


def test_admission_settings_naming_no_environment_are_reported_with_the_other_problems(tmp_path):
    """Found by an exploratory review: environment names under `admission` were never checked —
    `fail_closed: [prood]` loaded silently and left prod fail-open."""
    bad = tmp_path / "policy.yaml"
    bad.write_text("admission:\n  fail_closed: [prood]\n  modes: {prd: warn}\n  namespaces:\n    fraud-prod: {environment: production}\n"
                   "roles:\n  x: {owner: t, actions: [fly]}\n")
    with pytest.raises(PolicyError) as err:
        load_policy(bad)
    text = str(err.value)
    known = "(environments: dev, eval, staging, prod)"
    assert f"{bad}:2: admission.fail_closed.0: no environment named 'prood' {known}" in text
    assert f"{bad}:3: admission.modes.prd: no environment named 'prd' {known}" in text
    assert f"{bad}:5: admission.namespaces.fraud-prod.environment: no environment named 'production' {known}" in text
    assert f"{bad}:7: roles.x.actions.0: Input should be" in text  # together with the field errors
    # The default fail_closed names prod too: a policy calling it 'production' must say which is fail-closed.
    renamed = "environments: [{name: dev, requires_approval: false}, {name: production}]\n"
    with pytest.raises(PolicyError, match=r"admission.fail_closed is by default prod, which is not an environment here "
                                          r"\(environments: dev, production\); set admission.fail_closed"):
        parse_policy(renamed)
    assert parse_policy(renamed + "admission: {fail_closed: [production], modes: {dev: warn}}").admission.fail_closed == ("production",)


@pytest.mark.timeout(60)  # (without the check, admit would start and serve)
def test_the_admit_cli_exits_2_on_an_admission_setting_naming_no_environment(tmp_path):
    from typer.testing import CliRunner

    from gpuledger.cli import app as cli_app

    bad = tmp_path / "policy.yaml"
    bad.write_text("admission: {fail_closed: [prood]}\n")
    result = CliRunner().invoke(cli_app, ["admit", "--port", "0", "--bootstrap", "127.0.0.1:1"], env={"GPULEDGER_POLICY_FILE": str(bad)})
    assert result.exit_code == 2 and "admission.fail_closed.0: no environment named 'prood'" in result.output, result.output


def test_a_controls_block_changes_only_what_it_names(tmp_path):
    """From an exploratory review: `controls: {retirement: {enabled: false}}` failed with
    "controls.retirement.accountable: Field required" — and a block without `severity` took
    "critical" where the control's default is "warning"."""
    off = tmp_path / "off.yaml"
    off.write_text("controls:\n  retirement:\n    enabled: false\n  capacity_reservation:\n    accountable: release-managers\n")
    policy = load_policy(off)
    default = Policy()
    assert (policy.controls.retirement.enabled, policy.controls.retirement.accountable, policy.controls.retirement.severity) == \
        (False, default.controls.retirement.accountable, default.controls.retirement.severity)
    reservation = policy.controls.capacity_reservation
    assert (reservation.accountable, reservation.severity, reservation.enabled) == ("release-managers", "warning", True)
    assert policy.controls.admission == default.controls.admission and policy.fingerprint != default.fingerprint
    # A role the block names must still exist.
    bad = tmp_path / "bad.yaml"
    bad.write_text("controls:\n  retirement:\n    accountable: nobody\n")
    with pytest.raises(PolicyError, match="no role named 'nobody'"):
        load_policy(bad)


def test_a_member_typed_in_another_spelling_of_the_actors_name_holds_the_role():
    """Actors are stored in NFC (schemas.envelope.nfc): a member written with a combining accent
    ('jose' + U+0301) is the actor 'jos\u00e9' the events name."""
    from streams.controls.policy import Role

    policy = Policy().model_copy(update={"roles": {**Policy().roles, "approvers": Role(owner="team-a", members=("jose\u0301",),
                                                                                      actions=("approve",))}})
    assert policy.roles["approvers"].members == ("jos\u00e9",)
    assert policy.allowed("jos\u00e9", "approve") and policy.allowed("user:jos\u00e9", "approve")


def test_a_policy_duration_is_at_most_a_hundred_years():
    """``max_duration: 999999999d`` (the longest a timedelta holds) was accepted, and the worker's
    controls overflowed the first time they added it to an event time (a review of the fix that
    made such durations a clean error on the command line). The policy says so, naming the line."""
    with pytest.raises(PolicyError, match=r"pol.yaml:3: emergency_overrides.max_duration: at most 36500d \(100 years\)"):
        parse_policy("version: 1\nemergency_overrides:\n  max_duration: 999999999d\n", "pol.yaml")
    with pytest.raises(PolicyError, match=r"pol.yaml:4: environments.0.observation_window: at most 36500d"):
        parse_policy("version: 1\nenvironments:\n  - name: prod\n    observation_window: 40000d\n", "pol.yaml")
    assert parse_policy("version: 1\nretirement:\n  grace: 36500d\n").retirement.grace.days == 36500
