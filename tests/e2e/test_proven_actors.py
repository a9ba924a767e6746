"""Decision rights judged on proven identities, through the real path: receiver (with a
credentials file) and a direct, unauthenticated publish → broker → worker → violations.

The policy requires proof (``authentication.require_for_rights``): the same admin action by
the same on-call engineer opens control 7 when it was published straight to Kafka (as the
CLI does) and stays silent when the receiver authenticated the caller.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta, timezone

from producers._kafka import EventPublisher
from producers.receiver.config import ReceiverSettings
from producers.releases import COMMANDS, build_event
from streams.controls.policy import load_policy
from tests.e2e.test_thin_path import wait_rows
from tests.producers.receiver.test_server import RunningReceiver
from tests.streams.test_controls import by_control, wait_until

TOKEN = "tok-oncall-" + "s" * 40


def test_an_unproven_admin_action_fails_control_7_and_the_proven_one_does_not(kafka_bootstrap, catalogue, settings_for, worker_factory, tmp_path):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("authentication:\n  require_for_rights: true\n")
    assert load_policy(policy_file).authentication.require_for_rights
    callers = tmp_path / "callers.yaml"
    callers.write_text(json.dumps({"callers": [{"identity": "user:oncall-sre", "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}]}))
    worker = worker_factory(catalogue, extra_env={"GPULEDGER_POLICY_FILE": str(policy_file), "GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})

    t0 = datetime.now(timezone.utc) - timedelta(minutes=30)
    isolate = next(c for c in COMMANDS if c.name == "isolate-node")
    register = next(c for c in COMMANDS if c.name == "register")
    # Straight to Kafka, as `gpuledger release isolate-node` does: typed, not proven.
    direct = [build_event(register, {"release_id": "r-7", "model": "m", "version": "7", "artifact_digest": "sha256:" + "a" * 64,
                                     "at": t0.isoformat()}),
              build_event(isolate, {"release_id": "r-7", "target": "gpu-node-a3", "actor": "oncall-sre", "at": (t0 + timedelta(minutes=1)).isoformat()})]
    EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test").publish_batch(direct)
    # The same engineer through the receiver, with their token: proven.
    proven = {"event_type": "release.node_isolated", "occurred_at": (t0 + timedelta(minutes=2)).isoformat(),
              "observed_at": t0.isoformat(), "source": {"collector": "oncall"}, "identity": {"release_id": "r-8", "node": "gpu-node-b1"},
              "payload": {"actor": "oncall-sre", "target": "gpu-node-b1"}}
    with RunningReceiver(ReceiverSettings(credentials_file=str(callers)), EventPublisher.from_settings(settings_for(catalogue), "receiver")) as rx:
        status, answer = rx.post("/v1/releases", proven, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, answer

    rows = wait_rows(worker.reader, "SELECT release_id, actor, summary FROM gpuledger.release_history FINAL "
                     "WHERE event_type = 'release.node_isolated' ORDER BY release_id", {}, lambda rows: len(rows) == 2, timeout=120)
    assert [(r["release_id"], r["actor"], r["summary"]) for r in rows] == [
        ("r-7", "oncall-sre", "node_isolated by oncall-sre (unauthenticated)"),
        ("r-8", "user:oncall-sre", "node_isolated by user:oncall-sre")]
    got = wait_until(kafka_bootstrap, catalogue, lambda got: any(v.control_id == 7 for v in got.values()), timeout=120)
    seven = by_control(got)[7]
    assert [v.identity.release_id for v in seven] == ["r-7"], [v.detail for v in seven]
    assert "oncall-sre was not authenticated" in seven[0].detail
    assert worker.service.alive()


ZOE, YVES = "tok-zoe-" + "z" * 40, "tok-yves-" + "y" * 40
ONCALL_POLICY = """
authentication:
  require_for_rights: true
roles:
  release-managers: {owner: team-mlops, members: [alice], actions: [approve, promote, rollback, revoke, retire, reserve]}
  oncall: {owner: team-platform, members: ['group:oncall'], actions: [isolate_node]}
  capacity-planners: {owner: team-capacity, members: [erin], actions: [reserve]}
  platform-sre: {owner: team-platform, members: [bob], actions: [pause_queue]}
"""


def test_a_right_granted_to_a_group_is_held_through_the_authenticated_groups_only(kafka_bootstrap, catalogue, settings_for, worker_factory,
                                                                                     tmp_path):
    """The policy grants isolate_node to `group:oncall`. Through the receiver, zoe (whose
    credential carries the group) holds it; yves (another group) does not, until zoe ratifies
    his action — the closed violation names the group. An event straight to Kafka that types
    the group into `actor_groups` holds nothing."""
    from schemas.release import ReleaseEvent, ReleasePayload
    from schemas import Identity, Source, make_event_id

    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(ONCALL_POLICY)
    assert load_policy(policy_file).allowed("user:zoe\x1foncall", "isolate_node")
    callers = tmp_path / "callers.yaml"
    callers.write_text(json.dumps({"callers": [
        {"identity": "user:zoe", "groups": ["oncall"], "token_sha256": hashlib.sha256(ZOE.encode()).hexdigest()},
        {"identity": "user:yves", "groups": ["interns"], "token_sha256": hashlib.sha256(YVES.encode()).hexdigest()}]}))
    worker = worker_factory(catalogue, extra_env={"GPULEDGER_POLICY_FILE": str(policy_file), "GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})

    t0 = datetime.now(timezone.utc) - timedelta(minutes=30)

    def isolate(rid, minute, node):
        return {"event_type": "release.node_isolated", "occurred_at": (t0 + timedelta(minutes=minute)).isoformat(), "observed_at": t0.isoformat(),
                "source": {"collector": "oncall"}, "identity": {"release_id": rid, "node": node}, "payload": {"target": node}}

    forged = ReleaseEvent(event_id=make_event_id("test", ("forged",)), event_type="release.node_isolated", occurred_at=t0 + timedelta(minutes=1),
                          observed_at=t0, source=Source(collector="cli"), identity=Identity(release_id="g-forged", node="n-3"),
                          payload=ReleasePayload(actor="user:zoe", actor_groups=("oncall",), target="n-3"))
    EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test").publish_batch([forged])
    with RunningReceiver(ReceiverSettings(credentials_file=str(callers)), EventPublisher.from_settings(settings_for(catalogue), "receiver")) as rx:
        for token, body in ((ZOE, isolate("g-zoe", 1, "n-1")), (YVES, isolate("g-yves", 1, "n-2")), (ZOE, isolate("g-yves", 5, "n-2"))):
            status, answer = rx.post("/v1/releases", body, headers={"Authorization": f"Bearer {token}"})
            assert status == 200, answer

    rows = wait_rows(worker.reader, "SELECT release_id, closed_at, detail FROM gpuledger.violations FINAL WHERE control_id = 7 "
                     "ORDER BY release_id", {}, lambda rows: len(rows) == 2 and any(r["closed_at"] for r in rows), timeout=120)
    by_release = {r["release_id"]: r for r in rows}
    assert sorted(by_release) == ["g-forged", "g-yves"], rows  # zoe's own action holds the right: no violation
    assert "user:zoe was not authenticated" in by_release["g-forged"]["detail"] and by_release["g-forged"]["closed_at"] is None
    yves = by_release["g-yves"]
    assert "user:yves (groups: interns) holds no role; none grants isolate_node" in yves["detail"]
    assert "by user:zoe (role oncall via group:oncall)" in yves["detail"] and yves["closed_at"] is not None
    assert worker.service.alive()
