"""`gpuledger kafka up|status|down` drives a real background broker."""

import os
import subprocess
import sys

from confluent_kafka.admin import AdminClient


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
