"""`gpuledger dev cluster up|status|down` as a developer runs it (a cluster of its own, in a temp data dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpuledger.dev.cluster import DEFAULT_NODES, down
from tests.real_cluster.conftest import REAL_CLUSTER

pytestmark = REAL_CLUSTER


def gpuledger(*args: str, data_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuledger.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "GPULEDGER_DATA_DIR": str(data_dir)})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # our grandchild is not ours to reap, but a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_dev_cluster_up_prints_a_working_kubeconfig_and_down_stops_it(tmp_path, real_cluster):
    # ``real_cluster`` first: its start has built the binaries, so ``up`` only starts processes.
    data = tmp_path / "data"
    assert gpuledger("dev", "cluster", "status", data_dir=data).returncode == 3
    try:
        started = gpuledger("dev", "cluster", "up", data_dir=data)
        assert started.returncode == 0, started.stderr
        kubeconfig = Path(started.stdout.strip().splitlines()[-1])
        assert kubeconfig.is_file() and f"export KUBECONFIG={kubeconfig}" in started.stdout
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        nodes = k8s.CoreV1Api(k8s.ApiClient(cfg)).list_node().items
        assert {n.metadata.name for n in nodes} == {n.name for n in DEFAULT_NODES}
        status = gpuledger("dev", "cluster", "status", data_dir=data)
        assert status.returncode == 0 and status.stdout.strip().splitlines()[-1] == str(kubeconfig)
        pids = json.loads((data / "cluster" / "cluster.json").read_text())["pids"]
        assert set(pids) == {"etcd", "apiserver", "controller_manager", "scheduler", "kwok", "kueue"}
        stopped = gpuledger("dev", "cluster", "down", data_dir=data)
        assert stopped.returncode == 0 and "stopped the local cluster" in stopped.stdout
        assert gpuledger("dev", "cluster", "status", data_dir=data).returncode == 3
        assert not [name for name, pid in pids.items() if alive(pid)], "processes left running after down"
    finally:
        down(data)
