#!/usr/bin/env bash
# The whole suite, stage by stage, printing how long each took: lint, the test rigs, then pytest beside the
# end-to-end tests; each pytest stage ends with its 25 slowest tests (--durations=25).
#
# On the Kubernetes release KUBE (1.35, 1.36, 1.37, 1.38; default the one hack/testbin/kube/default names, the newest
# GA release pinned: a release pinned to its beta runs only when asked for). Without KUBE it then runs the tests that
# depend on the release (the pytest marker `matrix`) once more on the oldest supported release.
#
# usage: [KUBE=<release>] hack/test.sh            the whole suite (and, without KUBE, the oldest release's part)
#        KUBE=<release> hack/test.sh --matrix     only the tests marked `matrix`, on that release
set -euo pipefail
cd "$(dirname "$0")/.."
repo_root=$PWD
# shellcheck source=hack/testbin/release.sh
source hack/testbin/release.sh
# Each stage ends with its wall time and the CPU its processes used (user and system, children included).
stage() {
  local name=$1; shift
  echo "==> $name"
  local TIMEFORMAT="==> $name: %0Rs (CPU %0Us user, %0Ss system)"
  time "$@"
}
# Two stages side by side: the oldest release's end-to-end tests wait on a real kubelet, containerd and pods most
# of the time, so they run beside its rig tests. The stage in
# the background keeps its output in a file, printed whole once both have ended; the run fails if either failed.
side_by_side_logs=()
trap 'rm -f "${side_by_side_logs[@]}"' EXIT
side_by_side() {  # side_by_side "<background stage>" <its command...> -- "<foreground stage>" <its command...>
  local background=$1; shift
  local command=()
  while [[ $1 != -- ]]; do command+=("$1"); shift; done
  shift
  local log
  log=$(mktemp)
  side_by_side_logs+=("$log")
  stage "$background" "${command[@]}" >"$log" 2>&1 &
  local pid=$! status=0 background_status=0
  stage "$@" || status=$?
  wait "$pid" || background_status=$?
  cat "$log"
  ((status == 0 && background_status == 0))
}

# pytest in parallel workers (pytest-xdist), each test file whole on one worker so that a module's rig is started
# once: most of the suite waits on processes, sockets and timers rather than computing, so more workers than cores
# pay. The files go out longest first by the last run's times (tests/conftest.py), not by their number of tests.
# TEST_WORKERS=0 runs it in this one process.
workers=${TEST_WORKERS:-6}
parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
[[ $workers == 0 ]] && parallel=(-p no:xdist)
release=$(kube_release)
oldest=$(kube_oldest_release)

# The tests that depend on the release, on `$1`: the rig's part, then the cluster's.
matrix() {
  local r=$1
  stage "Kubernetes $r: test rig" env KUBE="$r" hack/testbin.sh
  side_by_side "Kubernetes $r: e2e that depends on the release (-m matrix)" \
      env KUBE="$r" .venv/bin/pytest -q --durations=25 -m matrix tests/e2e -- \
    "Kubernetes $r: the tests that depend on the release (-m matrix)" env KUBE="$r" \
      GPU_AGENT_FUZZ_SEED="${GPU_AGENT_FUZZ_SEED:-0}" .venv/bin/pytest -q --durations=25 -m matrix --ignore=tests/e2e
}

if [[ ${1:-} == --matrix ]]; then
  stage "lint (ruff, mypy --strict)" make --no-print-directory lint
  stage "cluster packages (containerd, runc, buildah, mmdebstrap)" hack/cluster/packages.sh
  stage "cluster images (base, pause, busybox, agent from the Dockerfile)" hack/cluster/images.sh
  matrix "$release"
  exit 0
fi

echo "==> Kubernetes $release"
stage "lint (ruff, mypy --strict)" make --no-print-directory lint
if [ -x hack/testbin.sh ]; then stage "test rig (kube-apiserver, etcd, kubectl, kubelet, kube-scheduler, kube-controller-manager)" hack/testbin.sh; fi
if [ -x hack/helm.sh ]; then stage "helm (for the chart tests)" hack/helm.sh; fi
if [ -x hack/kubelet-harness.sh ]; then stage "kubelet harness" hack/kubelet-harness.sh; fi
if [ -x hack/prometheus.sh ]; then stage "prometheus, promtool" hack/prometheus.sh; fi
stage "cluster packages (containerd, runc, buildah, mmdebstrap)" hack/cluster/packages.sh
stage "cluster images (base, pause, busybox, agent from the Dockerfile)" hack/cluster/images.sh
# The agent's image for linux/amd64 and linux/arm64 as one OCI image index (the arm64 half built under qemu);
# pytest's tests/image then check the index and run the arm64 image's agent under qemu.
stage "multi-arch image (agent for linux/amd64 and linux/arm64, one OCI image index)" hack/image.sh
# The end-to-end tests wait on a real kubelet, containerd and pods (little CPU), so they run beside the rest of pytest:
# the default release's, then the oldest release's that depend on the release, on the one cluster at a time, while
# pytest runs the default release's suite, then the oldest release's rig tests that depend on the release. The fuzz
# tests draw a fresh hypothesis seed when run alone; the whole suite runs them with a fixed one.
# A cluster left by a run stopped with the machine (none of its processes alive) is taken down first: its kubelet
# directory and pod namespaces would otherwise be in every test's way.
if [[ $EUID == 0 ]]; then hack/cluster/down.sh --quiet --if-stale; fi
check_oldest=false
[[ -z ${KUBE:-} && $oldest != "$release" ]] && check_oldest=true
if $check_oldest; then stage "Kubernetes $oldest (the oldest supported release): test rig" env KUBE="$oldest" hack/testbin.sh; fi
end_to_end() {
  stage "e2e (a real single-node cluster, hack/cluster)" .venv/bin/pytest -q --durations=25 tests/e2e || return
  if $check_oldest; then
    stage "Kubernetes $oldest: e2e that depends on the release (-m matrix)" \
      env KUBE="$oldest" .venv/bin/pytest -q --durations=25 -m matrix tests/e2e
  fi
}
# The end-to-end chain is the longer one and waits on the cluster's answers, the rest is CPU-bound with time to
# spare: the rest runs at a lower priority (nice 10), so that the cluster answers without waiting for a core.
the_rest() {
  stage "pytest" nice -n 10 env GPU_AGENT_FUZZ_SEED="${GPU_AGENT_FUZZ_SEED:-0}" .venv/bin/pytest -q "${parallel[@]}" \
    --durations=25 --ignore=tests/e2e || return
  if $check_oldest; then
    stage "Kubernetes $oldest: the tests that depend on the release (-m matrix)" nice -n 10 env KUBE="$oldest" \
      GPU_AGENT_FUZZ_SEED="${GPU_AGENT_FUZZ_SEED:-0}" .venv/bin/pytest -q --durations=25 -m matrix --ignore=tests/e2e
  fi
}
side_by_side "end to end, then the oldest release's" end_to_end -- "pytest, then the oldest release's rig tests" the_rest
