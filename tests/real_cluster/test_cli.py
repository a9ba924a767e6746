"""`gpuledger dev cluster up|status|down` as a developer runs it (a cluster of its own and its peers, in a temp data dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpuledger.dev.cluster import DEFAULT_NODES, down
from gpuledger.dev.process import pid_running
from tests.real_cluster.conftest import REAL_CLUSTER, wait_for

pytestmark = REAL_CLUSTER


def gpuledger(*args: str, data_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuledger.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "GPULEDGER_DATA_DIR": str(data_dir)})


def get_json(url: str, body: dict | None = None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_dev_cluster_up_prints_a_working_kubeconfig_and_its_peers_and_down_stops_them(tmp_path, cluster_binaries):
    # ``cluster_binaries`` first: the binaries are built, so ``up`` only starts processes. (Not the session's
    # ``real_cluster``: this module is a unit of its own on any xdist worker, tests/conftest.py.)
    data = tmp_path / "data"
    receiver = "http://127.0.0.1:19095"  # nothing needs to listen there for the wiring to be checked
    callers = tmp_path / "callers.yaml"
    assert gpuledger("dev", "cluster", "status", data_dir=data).returncode == 3
    try:
        started = gpuledger("dev", "cluster", "up", "--receiver-url", receiver, "--receiver-credentials", str(callers),
                            "--mlflow-secret", "whsec-dev", data_dir=data)
        assert started.returncode == 0, started.stderr
        kubeconfig = Path(started.stdout.strip().splitlines()[-1])
        assert kubeconfig.is_file() and f"export KUBECONFIG={kubeconfig}" in started.stdout
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        nodes = k8s.CoreV1Api(k8s.ApiClient(cfg)).list_node().items
        assert {n.metadata.name for n in nodes} == {n.name for n in DEFAULT_NODES}
        status = gpuledger("dev", "cluster", "status", data_dir=data)
        assert status.returncode == 0 and status.stdout.strip().splitlines()[-1] == str(kubeconfig)
        state = json.loads((data / "cluster" / "cluster.json").read_text())
        pids, peers = state["pids"], state["peers"]
        assert set(pids) == {"etcd", "apiserver", "controller_manager", "scheduler", "kwok", "kueue",
                             "peerhost", "alertmanager", "prometheus", "mlflow"}
        for printed in (started.stdout, status.stdout):  # how to reach each peer
            for url in (peers["dcgm_page"], peers["prometheus"], peers["alertmanager"], peers["mlflow"], f"{receiver}/v1/alertmanager"):
                assert url in printed, printed
        # The kubelet doubles serve one socket per KWOK node; the page lists every device of the nodes.
        assert {p.name for p in Path(peers["kubelet_sockets"]).glob("*.sock")} == {f"{n.name}.sock" for n in DEFAULT_NODES}
        devices = get_json(peers["xid_control"].replace("/v1/xid", "/v1/devices"))
        node = DEFAULT_NODES[0].name
        gpu = next(d for d in devices if d["node"] == node and d["index"] == 0)
        # An XID on the page: real Prometheus fires, real Alertmanager holds it and routes to the receiver with a token.
        get_json(peers["xid_control"], {"node": node, "index": 0, "xid": 79})
        query = urllib.parse.urlencode([("filter", 'alertname="GpuXidError"'), ("filter", f'UUID="{gpu["uuid"]}"')])
        wait_for(lambda: get_json(f"{peers['alertmanager']}/api/v2/alerts?{query}"), 90, "Alertmanager holding the XID alert")
        config = get_json(f"{peers['alertmanager']}/api/v2/status")["config"]["original"]
        assert f"{receiver}/v1/alertmanager" in config and "credentials_file" in config and "send_resolved: true" in config, config
        assert "service:alertmanager" in callers.read_text()
        # MLflow's webhook goes to the receiver's /v1/mlflow.
        from mlflow.tracking import MlflowClient

        hooks = MlflowClient(tracking_uri=peers["mlflow"], registry_uri=peers["mlflow"]).list_webhooks()
        assert [h.url for h in hooks] == [f"{receiver}/v1/mlflow"]
        stopped = gpuledger("dev", "cluster", "down", data_dir=data)
        assert stopped.returncode == 0 and "stopped the local cluster" in stopped.stdout
        assert gpuledger("dev", "cluster", "status", data_dir=data).returncode == 3
        assert not [name for name, pid in pids.items() if pid_running(pid)], "processes left running after down"
    finally:
        down(data)
