"""The worker against an authenticating broker (SASL_PLAINTEXT, PLAIN): Faust's
transport and the release directory's consumer both carry the credentials from
GPULEDGER_KAFKA_* settings, as collectors do through librdkafka."""

from __future__ import annotations

import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.fixtures.sample_events import FINGERPRINT, MANIFEST, RELEASE_ID, sample_events
from gpuledger.dev.localkafka import LocalKafka
from gpuledger.settings import default_cache_dir
from producers._kafka import EventPublisher, ensure_topics
from schemas.topics import TopicCatalogue

USERS = {"admin": "admin-secret", "gpuledger": "s3cret"}


@pytest.fixture(scope="module")
def sasl_broker():
    with LocalKafka(Path(tempfile.mkdtemp(prefix="gpuledger-sasl-")), default_cache_dir(), sasl_users=USERS, log_level="WARN", with_parent=True) as broker:
        yield broker


def test_worker_joins_and_correlates_over_sasl(sasl_broker, worker_factory):
    security = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": "gpuledger", "sasl.password": "s3cret"}
    conf = {"bootstrap.servers": sasl_broker.bootstrap, **security}
    cat = TopicCatalogue(prefix="sasl", raw_partitions=2)
    ensure_topics(conf, cat)
    env = {"GPULEDGER_KAFKA_BOOTSTRAP": sasl_broker.bootstrap, "GPULEDGER_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
           "GPULEDGER_KAFKA_SASL_MECHANISM": "PLAIN", "GPULEDGER_KAFKA_SASL_USERNAME": "gpuledger", "GPULEDGER_KAFKA_SASL_PASSWORD": "s3cret"}
    worker = worker_factory(cat, extra_env=env)
    EventPublisher(conf, cat, "test").publish_batch(sample_events(datetime.now(timezone.utc)))
    deadline = time.monotonic() + 90
    rows = []
    while time.monotonic() < deadline:
        rows = worker.reader.query(
            "SELECT release_id, artifact_digest FROM gpuledger.correlated_events FINAL WHERE alert_fingerprint = {fp:String}",
            {"fp": FINGERPRINT}).dicts()
        if rows and rows[0]["artifact_digest"]:
            break
        time.sleep(0.5)
    assert rows == [{"release_id": RELEASE_ID, "artifact_digest": MANIFEST.artifact_digest}]


def test_wrong_password_is_refused_by_the_broker(sasl_broker):
    from confluent_kafka.admin import AdminClient

    bad = AdminClient({"bootstrap.servers": sasl_broker.bootstrap, "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                       "sasl.username": "gpuledger", "sasl.password": "wrong"})
    with pytest.raises(Exception):
        bad.list_topics(timeout=5)
