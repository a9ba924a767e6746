"""Release state (manifest + history) is the same whatever order events arrive in."""

import itertools

from streams.correlate.directory import ReleaseDirectory
from tests.streams.harness import release

EVENTS = [release("release.registered", 0), release("release.approved", 5, actor="alice"),
          release("release.promoted", 10, to_environment="prod"), release("release.rolled_back", 20, to_environment="prod"),
          release("release.registered", 1, rid="r2", version="8", digest="sha256:" + "e" * 64)]


def snapshot(order):
    d = ReleaseDirectory()
    for ev in order:
        d.apply(ev)
    return ({rid: (d.manifest(rid), d.releases[rid]["history"]) for rid in d.releases},
            {k: sorted(v) for k, v in d.by_digest.items() if v}, {k: sorted(v) for k, v in d.by_model.items() if v})


def test_directory_is_order_independent():
    reference = snapshot(EVENTS)
    for perm in itertools.permutations(EVENTS):
        assert snapshot(perm) == reference


def test_state_and_environments_as_of_a_time():
    d = ReleaseDirectory()
    for ev in EVENTS:
        d.apply(ev)
    assert d.state_as_of("r1", "2026-11-01T08:07:00+00:00") == "release.approved"
    assert d.state_as_of("r1", "2026-11-01T07:00:00+00:00") is None
    assert d.environments_at("r1", "2026-11-01T08:15:00+00:00") == ["prod"]
    assert d.environments_at("r1", "2026-11-01T08:25:00+00:00") == []
    assert d.by_model_version("m", "8") == "r2"
    assert d.by_image_digest("sha256:" + "e" * 64) == "r2"


def test_reapplying_an_event_changes_nothing():
    d = ReleaseDirectory()
    assert d.apply(EVENTS[0])
    assert d.apply(EVENTS[0]) == []
