#!/usr/bin/env bash
# Regenerate the Python gRPC stubs for the kubelet PodResources v1 API.
#
# Usage (from anywhere):  producers/podresources/proto/generate.sh
# Uses $PYTHON if set, else the repo virtualenv, else python3 on PATH.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$repo_root"

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

"$python" -m grpc_tools.protoc \
    -I producers/podresources/proto \
    --python_out=producers/podresources/proto \
    --pyi_out=producers/podresources/proto \
    --grpc_python_out=producers/podresources/proto \
    producers/podresources/proto/podresources_v1.proto

# protoc emits a top-level `import podresources_v1_pb2`, which only works when
# producers/podresources/proto itself is on sys.path. Make it package-relative instead.
sed -i 's/^import podresources_v1_pb2 as /from . import podresources_v1_pb2 as /' \
    producers/podresources/proto/podresources_v1_pb2_grpc.py
