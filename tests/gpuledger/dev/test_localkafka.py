"""`gpuledger kafka up|status|down` drives a real background broker."""

import os
import subprocess
import sys

from confluent_kafka.admin import AdminClient, ConfigResource

from gpuledger.dev.localkafka import CLEANER_BYTES_PER_S


def gl(*args, env):
    return subprocess.run([sys.executable, "-m", "gpuledger.cli", *args], env=env, capture_output=True, text=True, timeout=180)


def test_up_status_down(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GPULEDGER_KAFKA_BOOTSTRAP"}
    env["GPULEDGER_DATA_DIR"] = str(tmp_path)
    try:
        up = gl("kafka", "up", env=env)
        assert up.returncode == 0, up.stderr
        bootstrap = up.stdout.strip().splitlines()[-1]
        assert bootstrap.startswith("127.0.0.1:")
        md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
        assert md.brokers
        # The broker took the throttle of its log cleaner (a key it did not know it would ignore)
        resource = ConfigResource(ConfigResource.Type.BROKER, str(next(iter(md.brokers))))
        admin = AdminClient({"bootstrap.servers": bootstrap})
        configs = admin.describe_configs([resource])[resource].result(timeout=10)
        assert float(configs["log.cleaner.io.max.bytes.per.second"].value) == CLEANER_BYTES_PER_S, configs["log.cleaner.io.max.bytes.per.second"]
        status = gl("kafka", "status", env=env)
        assert status.returncode == 0 and status.stdout.strip().splitlines()[-1] == bootstrap
        # Other commands find the local broker when GPULEDGER_KAFKA_BOOTSTRAP is unset.
        ensure = gl("topics", "ensure", env=env)
        assert ensure.returncode == 0, ensure.stderr
        assert "gpuledger.alert.v1" in ensure.stdout
        assert "gpuledger.alert.v1" in AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    finally:
        down = gl("kafka", "down", env=env)
    assert down.returncode == 0 and "stopped" in down.stdout
    after = gl("kafka", "status", env=env)
    assert after.returncode == 3 and "no local Kafka" in after.stdout
    # Up again: on the same port (the worker, receiver and collectors read the bootstrap once at
    # start; on a new port they dialled the old one until restarted), and the topics are still there.
    try:
        again = gl("kafka", "up", env=env)
        assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == bootstrap, (again.stdout, again.stderr)
        assert "gpuledger.alert.v1" in AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    finally:
        assert gl("kafka", "down", env=env).returncode == 0


STARTER = r"""
import os, sys
from pathlib import Path
from gpuledger.dev.localkafka import LocalKafka
from gpuledger.settings import default_cache_dir
broker = LocalKafka(Path(sys.argv[1]), default_cache_dir(), log_level="WARN", with_parent=sys.argv[2] == "1").start()
print(broker.proc.pid, broker.bootstrap, flush=True)
os._exit(0)  # gone without stopping it, as a killed test run is
"""


def test_a_broker_started_with_its_parent_ends_when_the_parent_is_killed_and_the_daemon_one_stays(tmp_path):
    """The tests' brokers (``with_parent``) end with the process that started them, however it
    ends; ``gpuledger kafka up``'s outlives its command."""
    import time

    from gpuledger.dev.localkafka import stop_pid
    from gpuledger.dev.process import pid_running

    pids = {}
    for mode in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", STARTER, str(tmp_path / mode), mode], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        pids[mode] = int(out.stdout.split()[0])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pid_running(pids["1"]):
            time.sleep(0.2)
        assert not pid_running(pids["1"]), "the broker outlived the process that started it with_parent"
        assert pid_running(pids["0"])  # the daemon kind stays (stopped below)
    finally:
        for pid in pids.values():
            stop_pid(pid)
