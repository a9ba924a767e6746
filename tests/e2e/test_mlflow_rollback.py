"""An MLflow alias moved prod → 14 → 15 → 14 within a second, through the real path.

Real receiver (in-process, real HTTP), real broker, real worker with its chDB store. The
bodies and headers are shaped like MLflow 3.17's deliveries (``X-MLflow-Delivery-Id``,
``X-MLflow-Timestamp``, ``X-MLflow-Signature: v1,<base64 HMAC-SHA256>``, body timestamps
with microseconds). The move back must be a rollback of 15 and a re-promotion of 14, in
order, in ``release_history`` and in ``gpuledger trace --release``; a re-delivery — also to a
restarted receiver — must map to the very same event ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone

from producers._kafka import EventPublisher
from producers.receiver.config import ReceiverSettings
from sinks.read.trace import trace_release
from tests.e2e.test_thin_path import wait_rows
from tests.producers.receiver.test_server import RunningReceiver, mlflow_headers

SECRET = "whsec-rollback"
MODEL = "fraud-detector"


def body(entity: str, action: str, at: datetime, **data) -> bytes:
    return json.dumps({"entity": entity, "action": action, "timestamp": at.isoformat(), "data": {"name": MODEL, **data}}).encode()


def deliver(rx: RunningReceiver, payload: bytes, delivery_id: str | None = None) -> dict:
    status, answer = rx.post("/v1/mlflow", payload, headers=mlflow_headers(payload, SECRET, delivery_id))
    assert status == 200, answer
    return answer


def test_alias_moved_back_is_a_rollback_and_a_re_promotion(catalogue, settings_for, worker_factory):
    worker = worker_factory(catalogue)
    settings = settings_for(catalogue)
    t0 = datetime.now(timezone.utc) - timedelta(minutes=5)
    config = ReceiverSettings(mlflow_secret=SECRET)
    with RunningReceiver(config, EventPublisher.from_settings(settings, "receiver")) as rx:
        for version in ("14", "15"):
            deliver(rx, body("model_version", "created", t0, version=version, source=f"s3://models/{MODEL}/{version}",
                             tags={"artifact_digest": "sha256:" + version * 32, "owner": "risk-ml"}))
        first = deliver(rx, body("model_version_alias", "created", t0 + timedelta(seconds=1), alias="prod", version="14"))
        to_15 = deliver(rx, body("model_version_alias", "created", t0 + timedelta(seconds=1.3), alias="prod", version="15"))
        back_id = str(uuid.uuid4())
        back_body = body("model_version_alias", "created", t0 + timedelta(seconds=1.6), alias="prod", version="14")
        back = deliver(rx, back_body, back_id)
        assert len(first["event_ids"]) == len(to_15["event_ids"]) == 1
        assert len(back["event_ids"]) == 2 and first["event_ids"][0] not in back["event_ids"]
        # MLflow's retry of the same delivery: dropped by its delivery id.
        assert deliver(rx, back_body, back_id) == {"accepted": 0, "event_ids": [], "duplicate_delivery": True}

    # A restarted receiver re-learns the holders from the topic: the same delivery maps to the same ids.
    with RunningReceiver(config, EventPublisher.from_settings(settings, "receiver")) as rx:
        assert deliver(rx, back_body, back_id)["event_ids"] == back["event_ids"]

    rows = wait_rows(worker.reader, "SELECT release_id, event_type, to_environment, superseded_release_id, occurred_at "
                     "FROM gpuledger.release_history FINAL WHERE model_name = {m:String} ORDER BY occurred_at, event_type, release_id",
                     {"m": MODEL}, lambda rows: len(rows) >= 6, timeout=90)
    moves = [(r["release_id"], r["event_type"], r["to_environment"], r["superseded_release_id"]) for r in rows if r["event_type"] != "release.registered"]
    assert moves == [
        (f"{MODEL}:14", "release.promoted", "prod", ""),
        (f"{MODEL}:15", "release.promoted", "prod", f"{MODEL}:14"),
        (f"{MODEL}:14", "release.promoted", "prod", f"{MODEL}:15"),  # same instant as the rollback
        (f"{MODEL}:15", "release.rolled_back", "prod", f"{MODEL}:14"),
    ]
    assert len(rows) == 6  # two registrations, four moves: nothing collapsed, nothing doubled

    later = trace_release(worker.reader, "gpuledger", f"{MODEL}:15")["release"]
    assert [e["event_type"] for e in later["lifecycle"]] == ["release.registered", "release.promoted", "release.rolled_back"]
    assert later["state"] == "release.rolled_back"
    earlier = trace_release(worker.reader, "gpuledger", f"{MODEL}:14")["release"]
    assert [e["event_type"] for e in earlier["lifecycle"]] == ["release.registered", "release.promoted", "release.promoted"]
    assert earlier["lifecycle"][-1]["superseded_release_id"] == f"{MODEL}:15"

    env = {**os.environ, "COLUMNS": "200", "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "trace", "--release", f"{MODEL}:15"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"release.rolled_back  rolled_back out of prod (replaced by {MODEL}:14)" in out.stdout, out.stdout
