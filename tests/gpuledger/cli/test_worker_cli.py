"""`gpuledger worker` refuses a data dir it cannot create with the setting's name and exit 2
(a missing parent it creates: tests/test_lifecycle.py runs the worker in one)."""

import os
import subprocess
import sys


def test_a_data_dir_that_cannot_be_created_is_named_and_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {**os.environ, "GPULEDGER_DATA_DIR": str(blocker / "data"), "GPULEDGER_KAFKA_BOOTSTRAP": "127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-m", "gpuledger.cli", "worker"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot create the worker's data dir {blocker / 'data' / 'streams'} (data_dir, GPULEDGER_DATA_DIR): Not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr
