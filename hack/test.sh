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
if [ -x hack/testbin.sh ]; then stage "test rig (kube-apiserver, etcd, kubectl, kubelet, kube-scheduler, kube-controller-manager)" hack/testbin.sh; fi
if [ -x hack/helm.sh ]; then stage "helm (for the chart tests)" hack/helm.sh; fi
if [ -x hack/kubelet-harness.sh ]; then stage "kubelet harness" hack/kubelet-harness.sh; fi
if [ -x hack/prometheus.sh ]; then stage "prometheus, promtool" hack/prometheus.sh; fi
stage "cluster packages (containerd, runc, buildah, mmdebstrap)" hack/cluster/packages.sh
stage "cluster images (base, pause, busybox, agent from the Dockerfile)" hack/cluster/images.sh
# The fuzz tests draw a fresh hypothesis seed when run alone; the whole suite runs them with a fixed one.
stage "pytest" env GPU_AGENT_FUZZ_SEED="${GPU_AGENT_FUZZ_SEED:-0}" .venv/bin/pytest -q --ignore=tests/e2e
stage "e2e (a real single-node cluster, hack/cluster)" .venv/bin/pytest -q tests/e2e
