#!/usr/bin/env bash
# Regenerates the committed Python stubs from protos/ with the pinned grpcio-tools.
# Usage: hack/protos.sh [OUTPUT_ROOT]   (default: the repository root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
py=${PYTHON:-$root/.venv/bin/python}
# generate PROTO_DIR PYTHON_PACKAGE_DIR DESCRIPTION
generate() {
  local protos=$1 package=$2 what=$3
  mkdir -p "$out/$package"
  "$py" -m grpc_tools.protoc \
    "-I$package=$root/$protos" \
    --plugin=protoc-gen-mypy="$(dirname "$py")/protoc-gen-mypy" \
    --plugin=protoc-gen-mypy_grpc="$(dirname "$py")/protoc-gen-mypy_grpc" \
    --python_out="$out" --mypy_out="$out" --grpc_python_out="$out" --mypy_grpc_out="$out" \
    "$root/$protos/api.proto"
  [ -f "$out/$package/__init__.py" ] || \
    echo "\"\"\"Generated $what stubs; regenerate with make protos, never edit.\"\"\"" > "$out/$package/__init__.py"
}
generate protos/deviceplugin/v1beta1 agent/deviceplugin/v1beta1 "kubelet Device Plugin API v1beta1"
generate protos/podresources/v1 agent/podresources_v1 "kubelet PodResources API v1"
generate protos/dra/v1 agent/dra/v1 "kubelet DRA plugin API v1"
generate protos/dra/v1beta1 agent/dra/v1beta1 "kubelet DRA plugin API v1beta1"
generate protos/pluginregistration/v1 agent/dra/pluginregistration "kubelet plugin registration API v1"
generate protos/dra-health/v1alpha1 agent/dra/health_v1alpha1 "kubelet DRA resource health API v1alpha1"
generate protos/dra-health/v1 agent/dra/health_v1 "kubelet DRA resource health API v1"
# The DRA stubs live inside agent/dra/, which lint checks: each generated file says it is exempt, and loses
# the flake8-pyi codes ruff does not know.
for f in "$out"/agent/dra/{v1,v1beta1,pluginregistration,health_v1alpha1,health_v1}/api_pb2*.py*; do
  printf '# ruff: noqa\n# mypy: ignore-errors\n%s\n' "$(sed -E 's/  # noqa: Y[0-9]+$//' "$f")" > "$f"
done
