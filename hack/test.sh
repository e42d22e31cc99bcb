#!/usr/bin/env bash
# The whole suite, stage by stage, printing how long each took: lint, the test rig, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() {
  local name=$1; shift
  local t0=$SECONDS
  echo "==> $name"
  "$@"
  echo "==> $name: $((SECONDS - t0))s"
}
stage "lint (ruff, mypy --strict)" make --no-print-directory lint
if [ -x hack/testbin.sh ]; then stage "test rig (kube-apiserver, etcd, kubectl)" hack/testbin.sh; fi
if [ -x hack/helm.sh ]; then stage "helm (for the chart tests)" hack/helm.sh; fi
if [ -x hack/kubelet-harness.sh ]; then stage "kubelet harness" hack/kubelet-harness.sh; fi
if [ -x hack/prometheus.sh ]; then stage "prometheus, promtool" hack/prometheus.sh; fi
stage "pytest" .venv/bin/pytest -q
