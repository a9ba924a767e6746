"""schemas/release.py: the names the decision-rights checks read back out of ``decision_actor``."""

import pytest

from schemas import EventDecodeError, decode_event
from schemas.release import parse_decision
from tests.schemas.test_envelope import release_event


@pytest.mark.parametrize(("payload", "field", "problem"), [
    # 'mallory>alice' read back as user:mallory acting for alice, though nobody named alice in
    # on_behalf_of and no delegate right was checked.
    ({"actor": "user:mallory>alice", "authenticated_by": "oidc"}, "payload.actor", "contains '>' at position 12"),
    ({"actor": "service:ci", "on_behalf_of": "x>alice"}, "payload.on_behalf_of", "contains '>' at position 1"),
    ({"actor": "service:ci", "authenticated_by": "token", "actor_groups": ["ci", "a>b"]}, "payload.actor_groups.1", "contains '>'"),
    # A proven actor named like this would read as unproven.
    ({"actor": "unauthenticated:bob", "authenticated_by": "token"}, "payload.actor", "starts with 'unauthenticated:'"),
    ({"actor": "service:ci", "authenticated_by": "token", "actor_groups": ["ci\x1fadmins"]}, "payload.actor_groups.0", "U+001F"),
])
def test_actor_names_cannot_carry_the_markers_of_a_decision(payload, field, problem):
    with pytest.raises(EventDecodeError) as info:
        decode_event(release_event().model_dump(mode="json") | {"payload": payload})
    assert field in str(info.value) and problem in str(info.value), info.value


def test_a_decision_of_a_valid_payload_reads_back_as_it_was_made():
    from schemas.release import decision_actor

    delegated = release_event(payload={"actor": "service:ci", "on_behalf_of": "user:alice", "authenticated_by": "token",
                                       "actor_groups": ["release-managers", "ci"]}).payload
    d = parse_decision(decision_actor(delegated))
    assert (d.proven, d.actor, d.person, d.groups) == (True, "service:ci", "user:alice", ("ci", "release-managers"))
    # An unproven actor that looks like a proven identity stays unproven, its groups dropped.
    d = parse_decision(decision_actor(release_event(payload={"actor": "user:alice", "actor_groups": ["admins"]}).payload))
    assert (d.proven, d.actor, d.person, d.groups) == (False, "user:alice", None, ())
