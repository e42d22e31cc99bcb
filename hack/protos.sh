#!/usr/bin/env bash
# Regenerates the committed Python stubs from protos/ with the pinned grpcio-tools.
# Usage: hack/protos.sh [OUTPUT_ROOT]   (default: the repository root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out/agent/deviceplugin/v1beta1"
"$py" -m grpc_tools.protoc \
  "-Iagent/deviceplugin/v1beta1=$root/protos/deviceplugin/v1beta1" \
  --plugin=protoc-gen-mypy="$(dirname "$py")/protoc-gen-mypy" \
  --plugin=protoc-gen-mypy_grpc="$(dirname "$py")/protoc-gen-mypy_grpc" \
  --python_out="$out" --mypy_out="$out" --grpc_python_out="$out" --mypy_grpc_out="$out" \
  "$root/protos/deviceplugin/v1beta1/api.proto"
[ -f "$out/agent/deviceplugin/v1beta1/__init__.py" ] || \
  echo '"""Generated kubelet Device Plugin API v1beta1 stubs; regenerate with make protos, never edit."""' \
    > "$out/agent/deviceplugin/v1beta1/__init__.py"
