"""`gpuledger exercise SCENARIO --cluster real`: the shipped scenarios on the local real control plane.

The exercise starts its own ``LocalCluster`` with the scenario's nodes (KWOK, Kueue), MLflow, the
DCGM-shaped page, Prometheus and Alertmanager (``gpuledger.dev.scenario_driver``), and the real
collectors, receiver and worker against the test broker; the expectations are read back from the
worker's store, as on the simulator. Each test is a scheduling unit of its own (tests/conftest.py), so
the three run on whichever xdist worker is free, beside the tier's shared cluster.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from gpuledger.dev.peers import XID_ALERT
from gpuledger.exercise import run_exercise
from gpuledger.settings import KafkaSettings, Settings
from gpuledger.sim.scenario import load_scenario
from tests.real_cluster.conftest import REAL_CLUSTER

pytestmark = REAL_CLUSTER

#: Real steps wait for Kueue, the scheduler and KWOK (seconds each); a higher speed only shortens the gaps.
SPEED = 60


def gpuledger_json(run, *args: str) -> dict:
    env = {**os.environ, "GPULEDGER_CLICKHOUSE_DSN": run.dsn, "GPULEDGER_DATA_DIR": str(run.data_dir)}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", *args, "--format", "json"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    return json.loads(out.stdout)


def run_real(name: str, kafka_bootstrap: str, tmp_path):
    settings = Settings(data_dir=tmp_path / "data", kafka=KafkaSettings(bootstrap=kafka_bootstrap))
    out = io.StringIO()
    run = run_exercise(settings, name, Console(file=out, width=200), speed=SPEED, cluster="real")
    log = out.getvalue()
    assert run.error is None, log
    assert [r.name for r in run.results] == [e.name for e in load_scenario(name).expect]
    assert [r for r in run.results if r.status != "PASS"] == [], log
    assert run.exit_code == 0 and not run.services_left, log
    return run, log


def test_incident_rollback_on_the_real_cluster_passes_and_its_prometheus_xid_alert_traces_to_the_mlflow_release(
        kafka_bootstrap, tmp_path, cluster_binaries):
    run, log = run_real("incident-rollback", kafka_bootstrap, tmp_path)
    sim = run.cluster
    # Each step was done by the real system: MLflow registered and moved the alias, Kueue admitted and
    # preempted, the Eviction API evicted, Prometheus fired the XID.
    assert "MLflow: fraud-scorer version 7 registered" in log and "alias prod moved back to fraud-scorer version 6" in log, log
    assert "preempted by Kueue: research/" in log and "pod(s) evicted (Eviction API)" in log, log
    xid = sim.alerts["xid-n3"]
    assert xid.labels["alertname"] == XID_ALERT and xid.labels["job"] == "nvidia-dcgm-exporter" and xid.labels["err_code"] == "79"

    # The responder's walk from the Prometheus-fired alert: the MLflow-registered release, the Kueue
    # workload, the node and the GPU.
    chain = gpuledger_json(run, "trace", "--alert", xid.fingerprint)
    release = chain["release"]
    assert release["release_id"] == "fraud-scorer-v7-prod", chain
    registered = [e for e in release["lifecycle"] if e["event_type"] == "release.registered"]
    assert registered and "service:mlflow/gpuledger" in json.dumps(registered), release["lifecycle"]
    [alert] = [a for a in chain["alerts"] if a["alert_fingerprint"] == xid.fingerprint and a["status"] == "firing"]
    node, gpu = sim.device_id("n3/0")
    workload = sim.workload_id("fraud-scorer-7")
    assert (alert["release_id"], alert["workload_id"], alert["node"], alert["gpu_id"]) == ("fraud-scorer-v7-prod", workload, "n3", gpu)
    assert workload.startswith("risk/job-fraud-scorer-7-")  # the name Kueue gave the Workload of the Job
    assert workload in {w["workload_id"] for w in chain["workloads"]}
    assert (node, gpu) in {(g["node"], g["gpu_id"]) for g in chain["gpus"]}


@pytest.mark.parametrize("name", ["retirement", "unapproved-admission"])
def test_the_other_scenarios_pass_on_the_real_cluster(name, kafka_bootstrap, tmp_path, cluster_binaries):
    run_real(name, kafka_bootstrap, tmp_path)
