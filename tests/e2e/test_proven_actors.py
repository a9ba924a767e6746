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
