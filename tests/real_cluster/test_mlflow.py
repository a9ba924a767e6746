"""MLflow's own webhook deliveries: registrations, tags and alias moves, as MLflow signs and sends them.

A real ``mlflow server`` (sqlite store) with a webhook made by ``MlflowClient.create_webhook``
to the real receiver's ``/v1/mlflow`` (in-process, real HTTP); the real broker and worker.
Nothing here builds an MLflow body: the registry calls are the test's only input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from producers._kafka import EventPublisher
from producers.receiver.config import ReceiverSettings
from schemas import decode_event
from sinks.read.trace import trace_release
from tests.fixtures.kafka import read_topic
from tests.producers.receiver.test_server import RunningReceiver
from tests.real_cluster.conftest import MLFLOW_SECRET as SECRET
from tests.real_cluster.conftest import REAL_CLUSTER, unique, wait_for

pytestmark = REAL_CLUSTER



def history(worker, model: str) -> list[dict]:
    return worker.reader.query(
        "SELECT release_id, event_type, to_environment, superseded_release_id, artifact_digest, owner, actor, occurred_at "
        "FROM gpuledger.release_history FINAL WHERE model_name = {m:String} ORDER BY occurred_at, event_type, release_id",
        {"m": model}).dicts()


def moves(rows: list[dict]) -> list[tuple]:
    return [(r["release_id"], r["event_type"], r["to_environment"], r["superseded_release_id"]) for r in rows
            if r["event_type"] in ("release.promoted", "release.rolled_back")]


def test_mlflow_registrations_tags_and_a_rollback_by_alias_arrive_as_mlflow_sends_them(mlflow_server, mlflow_webhook, catalogue,
                                                                                        settings_for, worker_factory):
    worker = worker_factory(catalogue)
    model = unique("fraud-detector")
    m = lambda v: f"{model}:{v}"  # noqa: E731 - the receiver's default release_id_template
    config = ReceiverSettings(mlflow_secret=SECRET)
    with RunningReceiver(config, EventPublisher.from_settings(settings_for(catalogue), "receiver")) as rx:
        mlflow_webhook(rx.url)
        client = mlflow_server.client()
        client.create_registered_model(model)
        for v in range(1, 16):  # MLflow numbers versions itself: 14 and 15 are the 14th and 15th
            client.create_model_version(model, source=f"s3://models/{model}/{v}",
                                        tags={"artifact_digest": f"sha256:{v:064x}", "owner": "risk-ml"})
        # The events' times are the webhook bodies' timestamps, set by MLflow, which delivers
        # asynchronously: twice under CI's load a tag set right after its version's creation was
        # stamped before the creation. The approval comes once the registrations are stored, as a
        # reviewer's would.
        wait_for(lambda: len([r for r in history(worker, model) if r["event_type"] == "release.registered"]) == 15,
                 120, "15 registrations stored")
        client.set_model_version_tag(model, "15", "approved", "true")
        wait_for(lambda: len([r for r in history(worker, model) if r["event_type"] in ("release.registered", "release.approved")]) == 16,
                 120, "15 registrations and the approval stored")
        # prod → 14 → 15, then back to 14: the move back is a rollback of 15 and a re-promotion of 14.
        for version, expected in (("14", 1), ("15", 2), ("14", 4)):
            client.set_registered_model_alias(model, "prod", version)
            wait_for(lambda: len(moves(history(worker, model))) == expected, 60, f"the move of prod to {version} stored")

    rows = history(worker, model)
    assert moves(rows) == [
        (m(14), "release.promoted", "prod", ""),
        (m(15), "release.promoted", "prod", m(14)),
        (m(14), "release.promoted", "prod", m(15)),  # same instant as the rollback
        (m(15), "release.rolled_back", "prod", m(14)),
    ]
    registered = {r["release_id"]: r for r in rows if r["event_type"] == "release.registered"}
    assert len(registered) == 15 and registered[m(14)]["artifact_digest"] == f"sha256:{14:064x}"
    assert registered[m(14)]["owner"] == "risk-ml"
    # A signed delivery's events are by the webhook's identity (nothing in MLflow's body names a user).
    assert {r["actor"] for r in rows} == {"service:mlflow/gpuledger"}, {r["actor"] for r in rows}

    later = trace_release(worker.reader, "gpuledger", m(15))["release"]
    assert [e["event_type"] for e in later["lifecycle"]] == ["release.registered", "release.approved", "release.promoted",
                                                           "release.rolled_back"]
    assert later["state"] == "release.rolled_back"
    env = {**os.environ, "COLUMNS": "200", "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "trace", "--release", m(15)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"release.rolled_back  rolled_back out of prod (replaced by {m(14)})" in out.stdout, out.stdout


def test_alias_moves_made_back_to_back_are_judged_in_the_order_they_were_made(mlflow_server, mlflow_webhook, catalogue, settings_for,
                                                                              worker_factory):
    worker = worker_factory(catalogue)
    model = unique("ranker")
    m = lambda v: f"{model}:{v}"  # noqa: E731
    with RunningReceiver(ReceiverSettings(mlflow_secret=SECRET), EventPublisher.from_settings(settings_for(catalogue), "receiver")) as rx:
        mlflow_webhook(rx.url)
        client = mlflow_server.client()
        client.create_registered_model(model)
        for v in range(1, 3):
            client.create_model_version(model, source=f"s3://models/{model}/{v}")
        # A script (or a hurried operator) moves prod 1 → 2 → 1 → 2 → 1 without waiting for anything.
        for version in ("1", "2", "1", "2", "1"):
            client.set_registered_model_alias(model, "prod", version)
        wait_for(lambda: len(moves(history(worker, model))) == 7, 60, "five moves stored (two of them rollbacks)")
    assert moves(history(worker, model)) == [
        (m(1), "release.promoted", "prod", ""),
        (m(2), "release.promoted", "prod", m(1)),
        (m(1), "release.promoted", "prod", m(2)),
        (m(2), "release.rolled_back", "prod", m(1)),
        (m(2), "release.promoted", "prod", m(1)),
        (m(1), "release.promoted", "prod", m(2)),
        (m(2), "release.rolled_back", "prod", m(1)),
    ]


def test_mlflows_test_delivery_is_answered_and_records_no_release(mlflow_server, mlflow_webhook, catalogue, settings_for,
                                                                  kafka_bootstrap):
    """MLflow's "Test webhook" (the UI's button, ``MlflowClient.test_webhook``) sends the example
    payload of the webhook's first event — ``model_version.created`` of ``example_model`` version 1
    from ``models:/123`` — signed like any delivery. It must not become a release."""
    with RunningReceiver(ReceiverSettings(mlflow_secret=SECRET), EventPublisher.from_settings(settings_for(catalogue), "receiver")) as rx:
        webhook = mlflow_webhook(rx.url)
        result = mlflow_server.client().test_webhook(webhook.webhook_id)
        assert result.success, result
        answer = json.loads(result.response_body)
        assert answer["accepted"] == 0 and answer["test_delivery"] is True, answer
        # A real registration through the same webhook still arrives: the topic holds exactly it.
        model = unique("after-test")
        client = mlflow_server.client()
        client.create_registered_model(model)
        client.create_model_version(model, source=f"s3://models/{model}/1")
        def on_topic():
            events = [decode_event(r.value()) for r in read_topic(kafka_bootstrap, catalogue.release, min_count=1, timeout=5, settle=0.5)]
            return events if any(e.identity.model_name == model for e in events) else None

        events = wait_for(on_topic, 60, "the real registration on the release topic")
    assert [(e.event_type, e.identity.release_id) for e in events] == [("release.registered", f"{model}:1")]
