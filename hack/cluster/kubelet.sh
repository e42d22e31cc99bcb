#!/usr/bin/env bash
# Starts, stops or restarts the cluster's kubelet (its configuration is written
# afresh on each start).
#
# usage: hack/cluster/kubelet.sh start|stop|restart [--topology-manager-policy POLICY]
#   POLICY: none (default), best-effort, restricted or single-numa-node
set -euo pipefail
# shellcheck source=hack/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

action=${1:-}
shift || true
policy=none
while (($#)); do
    case $1 in
        --topology-manager-policy) policy=${2:-}; shift 2 || die "--topology-manager-policy needs a value" ;;
        *) die "unknown argument '$1' (usage: kubelet.sh start|stop|restart [--topology-manager-policy POLICY])" ;;
    esac
done
case $policy in none | best-effort | restricted | single-numa-node) ;; *)
    die "topology manager policy '$policy' is not one of none, best-effort, restricted, single-numa-node" ;;
esac
[[ -d /run/netns && -e /run/netns/$netns && -d $run_dir/pki ]] || die "no cluster is running (make cluster)"

start() {
    mkdir -p "$run_dir/kubelet" "$run_dir/pod-logs"
    # From 1.35 the kubelet refuses a cgroup v1 host unless told otherwise; on v2 the default stays.
    local cgroup_v1_line=
    [[ $(cgroup_version) == v1 ]] && cgroup_v1_line="failCgroupV1: false"
    # The gates the release leaves off (lib.sh, gates_off_by_default), as `featureGates: {A: true, B: true}`.
    local gates gates_line=
    gates=$(gates_off_by_default "$kube_bin_dir/kubelet" ResourceHealthStatus DRAExtendedResource)
    gates=${gates//=/: }
    [[ -n $gates ]] && gates_line="featureGates: {${gates//,/, }}"
    local status_s=10 sync_s=15
    [[ -f $run_dir/kubelet-timing ]] && read -r status_s sync_s <"$run_dir/kubelet-timing"
    cat >"$run_dir/kubelet/config.yaml" <<KC
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $run_dir/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $run_dir/pki/kubelet-serving.crt
tlsPrivateKeyFile: $run_dir/pki/kubelet-serving.key
rotateCertificates: false
serverTLSBootstrap: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$run_dir/containerd/containerd.sock
failSwapOn: false
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
clusterDomain: cluster.local
podLogsDir: $run_dir/pod-logs
# Images here cannot be pulled again: never garbage-collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 2%
  imagefs.available: 2%
topologyManagerPolicy: $policy
# The kubelet calls a DRA driver's NodePrepareResources again, after a failed one, when it next syncs the pod: 15 s
# here (KUBELET_SYNC_S) instead of the default minute, so that the crash tests on this cluster wait on the agent, not
# the kubelet. A device plugin's devices reach the Node at its next node status update (KUBELET_STATUS_S).
syncFrequency: ${sync_s}s
nodeStatusUpdateFrequency: ${status_s}s
$cgroup_v1_line
$gates_line
KC
    start_daemon kubelet "$kube_bin_dir/kubelet" \
        --config="$run_dir/kubelet/config.yaml" \
        --kubeconfig="$run_dir/pki/kubelet.kubeconfig" \
        --hostname-override="$node_name" \
        --node-ip="$node_ip" \
        --v=1
    wait_for 30 "the kubelet's health port" in_netns curl -fsS --max-time 1 http://127.0.0.1:10248/healthz
}

case $action in
    start) start ;;
    stop) stop_daemon kubelet 20 ;;
    restart) stop_daemon kubelet 20; start ;;
    *) die "usage: kubelet.sh start|stop|restart [--topology-manager-policy POLICY]" ;;
esac
