"""An XID fault through the real alerting path: DCGM-shaped page → Prometheus → Alertmanager → receiver.

The release is registered in a real MLflow (its webhook → the receiver's ``/v1/mlflow``).

Real Prometheus (Debian) scrapes the DCGM-exporter-shaped page of ``gpuledger.dev.peers`` and
fires ``GpuXidError``; real Alertmanager (Debian) notifies the real receiver (in-process, real
HTTP) with the bearer token of a caller in its credentials file and ``send_resolved``; the
scheduler collector watches the real cluster, where Kueue admitted the Job whose pod holds the
GPU; the real worker joins it all into its chDB store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
from kubernetes import client as k8s

from gpuledger.dev.cluster import DEFAULT_NODES
from gpuledger.dev.peers import XID_ALERT, AlertingPeers, DcgmExporter, node_devices, write_caller
from producers._kafka import EventPublisher
from producers.receiver.config import ReceiverSettings
from schemas import Identity, ReleaseEvent, Source, make_event_id
from schemas.release import ReleasePayload
from tests.producers.kubernetes.test_collector import running
from tests.producers.receiver.test_server import RunningReceiver
from tests.real_cluster.conftest import MLFLOW_SECRET, REAL_CLUSTER, gpu_job, queue_namespace, unique, wait_for

pytestmark = REAL_CLUSTER


def registered(rid: str) -> ReleaseEvent:
    at = datetime.now(timezone.utc) - timedelta(minutes=30)
    return ReleaseEvent(event_id=make_event_id("test", (rid, "release.registered"), at.isoformat()), event_type="release.registered",
                        occurred_at=at, observed_at=at, source=Source(collector="test"), payload=ReleasePayload(actor="ci"),
                        identity=Identity(release_id=rid, model_name="xid-model", model_version="1", environment="prod", owner="team-xid"))


def running_pod(kube: k8s.ApiClient, ns: str, job: str):
    pods = k8s.CoreV1Api(kube).list_namespaced_pod(ns, label_selector=f"job-name={job}").items
    return next((p for p in pods if p.status.phase == "Running" and p.spec.node_name), None)


def alert_rows(worker, pod: str) -> list[dict]:
    return worker.reader.query(
        "SELECT alert_fingerprint, event_type, attribution, release_id, workload_id, namespace, pod, node, gpu_id, ends_at, labels "
        "FROM gpuledger.enriched_alerts FINAL WHERE alertname = {a:String} AND pod = {p:String} ORDER BY occurred_at, event_type",
        {"a": XID_ALERT, "p": pod}).dicts()


def trace(worker, *args: str) -> dict:
    env = {**os.environ, "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "trace", *args, "--format", "json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_prometheus_fired_xid_alert_arrives_through_alertmanager_and_reaches_the_mlflow_release_and_kueue_workload(
        real_cluster, kube, make_collector, mlflow_server, mlflow_webhook, catalogue, settings_for, worker_factory, tmp_path):
    settings = settings_for(catalogue)
    worker = worker_factory(catalogue, extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"})
    callers = tmp_path / "callers.yaml"
    token = write_caller(callers, "service:alertmanager", ("alertmanager",))
    ns, job = queue_namespace(real_cluster, "xid"), unique("train")
    devices = [d for node in DEFAULT_NODES for d in node_devices(node)]
    batch = k8s.BatchV1Api(kube)
    with running(make_collector(ns)), \
            RunningReceiver(ReceiverSettings(credentials_file=callers, mlflow_secret=MLFLOW_SECRET),
                            EventPublisher.from_settings(settings, "receiver")) as rx, \
            DcgmExporter(devices) as exporter, AlertingPeers(tmp_path / "peers", exporter, rx.url, token):
        # The release is registered in MLflow; its webhook tells the receiver.
        mlflow_webhook(rx.url)
        model = unique("xid-model")
        client = mlflow_server.client()
        client.create_registered_model(model)
        client.create_model_version(model, source=f"s3://models/{model}/1", tags={"owner": "team-xid"})
        rid = f"{model}:1"
        wait_for(lambda: worker.reader.query("SELECT count() AS n FROM gpuledger.release_history FINAL WHERE release_id = {r:String}",
                                             {"r": rid}).dicts()[0]["n"], 60, "the MLflow registration stored")
        # MLflow's release id (``model:version``) is not a valid label value: the real API server refuses
        # it (the API-server double took it). The pod template's annotation names the release instead.
        with pytest.raises(k8s.ApiException) as refused:
            batch.create_namespaced_job(ns, gpu_job(job, namespace=ns, labels={"gpuledger.io/release-id": rid}))
        assert refused.value.status == 422 and "a valid label must be" in refused.value.body
        batch.create_namespaced_job(ns, gpu_job(job, gpus=1, run_for="1h", namespace=ns, annotations={"gpuledger.io/release-id": rid}))
        pod = wait_for(lambda: running_pod(kube, ns, job), 120, "the Job's pod Running on a GPU node")
        node, name = pod.spec.node_name, pod.metadata.name
        gpu = next(d for d in exporter.devices if d.node == node)
        # dcgm-exporter's pod mapping names the holder; then the GPU falls off the bus.
        exporter.hold(gpu.device_id, ns, name, "train")
        exporter.set_xid(gpu.device_id, 79)

        firing = wait_for(lambda: [r for r in alert_rows(worker, name) if r["release_id"]], 120,
                          "the XID alert stored, attributed to the pod's release")
        row = firing[0]
        assert (row["event_type"], row["release_id"], row["namespace"], row["node"], row["gpu_id"]) == \
               ("alert.firing", rid, ns, node, gpu.uuid), row
        assert row["workload_id"], row
        # What Prometheus and Alertmanager added on their way: the rule's labels, the scrape job.
        assert row["labels"]["err_code"] == "79" and row["labels"]["severity"] == "critical"
        assert row["labels"]["job"] == "nvidia-dcgm-exporter" and row["ends_at"] is None

        # The fault clears: the series changes, the alert resolves, Alertmanager sends it (send_resolved).
        exporter.set_xid(gpu.device_id, 0)
        resolved = wait_for(lambda: [r for r in alert_rows(worker, name) if r["event_type"] == "alert.resolved"], 120,
                            "the resolved notification stored")
        assert resolved[0]["alert_fingerprint"] == row["alert_fingerprint"] and resolved[0]["ends_at"] is not None
        assert resolved[0]["release_id"] == rid
    batch.delete_namespaced_job(job, ns, propagation_policy="Background")

    # The responder's walk: alert → release, workload, node and GPU.
    chain = trace(worker, "--alert", row["alert_fingerprint"])
    assert chain["release"]["release_id"] == rid and chain["release"]["owner"] == "team-xid", chain
    text = json.dumps(chain)
    assert row["workload_id"] in text and node in text and gpu.uuid in text
