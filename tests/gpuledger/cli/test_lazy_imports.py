"""Each command imports its component inside the command: `--help` loads no client library it does not need."""

import json
import subprocess
import sys

import pytest

HEAVY = ("aiohttp", "grpc", "kubernetes", "gpuledger.sim")

PROBE = """
import json, sys
from gpuledger.cli import main
sys.argv = ["gpuledger", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def loaded_by(*args: str) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    return out["code"], out["modules"]


@pytest.mark.parametrize("args", [("release", "promote", "--help"), ("--help",), ("collect", "scheduler", "--help"), ("trace", "--help")])
def test_help_imports_no_client_library(args):
    code, modules = loaded_by(*args)
    assert code in (0, None)
    heavy = sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert not heavy, f"`gpuledger {' '.join(args)}` imported {heavy}"
