"""A release the alert names by model and version while the pod's release id is unknown (issue #13.5).

The real scheduler collector reads a pod from the API-server double; the release comes in as
registry events; the alert is a real-format Alertmanager v4 body through the receiver's mapping.
The worker attributes the alert by model+version, says which rule did, and control 3 records
the id mismatch; ``gpuledger trace`` shows both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

from producers._kafka import EventPublisher
from producers.kubernetes.collector import COMPONENT, SchedulerCollector
from producers.kubernetes.config import SchedulerCollectorSettings
from producers.receiver.alertmanager import alert_events
from tests.fixtures.waiting import poll
from tests.fixtures.kube_api import PODS, FakeKubeApi, make_pod
from tests.fixtures.sample_events import MANIFEST, RELEASE_ID, sample_events

TYPO_ID = "fraud-scorer-v7-prod-typo"




def test_unknown_release_id_falls_back_to_the_model_version_the_alert_names(kafka_bootstrap, catalogue, worker_factory, tmp_path):
    now = datetime.now(timezone.utc)
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    publisher.publish_batch([e for e in sample_events(now) if e.event_type.startswith("release.")])  # fraud-scorer 7, approved, in prod

    with FakeKubeApi() as api:
        api.create(PODS, make_pod("risk", "fraud-scorer-7-abc12", node="gpu-node-a3", created=now - timedelta(minutes=10),
                                  labels={"gpuledger.io/release-id": TYPO_ID, "gpuledger.io/environment": "prod"}))
        sched = SchedulerCollector(SchedulerCollectorSettings(state_flush_interval_s=0, host="test-host"),
                                   EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, COMPONENT), api.api_client(), tmp_path / "s")
        try:
            assert sched.run_once() == 3  # submitted, scheduled, running
        finally:
            sched.close()

    starts = now - timedelta(minutes=1)
    body = {"receiver": "gpuledger", "status": "firing", "version": "4", "groupKey": "{}:{alertname=\"ModelQualityDegraded\"}",
            "truncatedAlerts": 0, "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am:9093",
            "alerts": [{"status": "firing", "fingerprint": "5e1f00d2c3b4a596",
                        "labels": {"alertname": "ModelQualityDegraded", "severity": "critical", "model": MANIFEST.model_name,
                                   "model_version": MANIFEST.model_version, "namespace": "risk", "pod": "fraud-scorer-7-abc12"},
                        "annotations": {"summary": "precision@k dropped"}, "startsAt": starts.strftime("%Y-%m-%dT%H:%M:%S.%f000Z"),
                        "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus:9090/graph"}]}
    publisher.publish_batch(alert_events(body, host="test"))

    worker = worker_factory(catalogue, extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})
    alert = poll(lambda: worker.reader.query("SELECT release_id, attribution, artifact_digest FROM gpuledger.enriched_alerts FINAL").dicts(),
                  "the alert stored")
    assert alert == [{"release_id": RELEASE_ID, "attribution": "model_version_fallback", "artifact_digest": MANIFEST.artifact_digest}]
    violations = poll(lambda: [v for v in worker.reader.query(
        "SELECT control_id, release_id, detail FROM gpuledger.violations FINAL WHERE control_id = 3").dicts() if TYPO_ID in v["detail"]],
        "control 3 on the id mismatch")
    assert violations[0]["release_id"] == RELEASE_ID and "which no release event describes" in violations[0]["detail"]
    assert "model version fallback" in violations[0]["detail"]

    env = {**os.environ, "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "trace", "--alert", "5e1f00d2c3b4a596", "--format", "json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    trace = json.loads(out.stdout)
    assert trace["release"]["release_id"] == RELEASE_ID
    assert [a["attribution"] for a in trace["alerts"] if a["alert_fingerprint"] == "5e1f00d2c3b4a596"] == ["model_version_fallback"]
    assert any("by its model+version (rule model_version_fallback)" in g and "control 3" in g for g in trace["gaps"]), trace["gaps"]
