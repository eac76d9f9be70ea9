#!/usr/bin/env bash
# Regenerates the Python stubs under protos/v1 from the .proto sources with the pinned
# grpcio-tools. Usage: scripts/gen_protos.sh [OUT_ROOT]  (default: the repository root)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
py="${PYTHON:-$root/.venv/bin/python}"
cd "$root"
mkdir -p "$out/protos/v1"
"$py" -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/v1/common.proto protos/v1/worker.proto protos/v1/control_plane.proto
