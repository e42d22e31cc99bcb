#!/usr/bin/env bash
# Brings up a real single-node Kubernetes cluster on this machine and leaves it
# running: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# containerd and a kubelet, all inside one network namespace of their own (the
# machine's own network is not touched), then applies the agent's DaemonSet
# through hack/cluster/overlay (the fake NVML of PRESET instead of real GPUs)
# and waits until the kubelet advertises the GPUs. Run it as root.
#
# usage: [KUBE=1.35] hack/cluster/up.sh [PRESET]
#   PRESET  default dgx-h100 (make cluster PRESET=...)
#   KUBE    the Kubernetes release, default hack/testbin/kube/default, the newest GA
#           release pinned (make cluster KUBE=1.35; KUBE=1.38 for its beta)
#   KUBELET_STATUS_S  the kubelet's nodeStatusUpdateFrequency in seconds (default 10, the kubelet's own): a
#           device plugin's devices reach the Node's Allocatable at its next node status update
#   KUBELET_SYNC_S    its syncFrequency in seconds (default 15): a failed DRA prepare is retried at the next sync
#   CLUSTER_FRESH_STATE=1  remove the simulated GPUs' state an earlier cluster left (sim_state_files in lib.sh)
#           and start from the preset; without it the cluster starts on that state, and says so
#   CLUSTER_OWNER  "<pid> <start time>" of the process the cluster lives for (the e2e suite's pytest): a cluster
#           whose owner is gone is taken down by the next run of the suite (tests/e2e/conftest.py)
# Stop it with hack/cluster/down.sh (make cluster-down). Running it again first
# takes down what is running.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hack/cluster/lib.sh
source "$here/lib.sh"
# A new cluster runs $KUBE or the default release, whatever the last one ran.
cluster_release=$(kube_release) || exit 2
kube_bin_dir=$testbin_dir/kube-$cluster_release

preset=${1:-${PRESET:-dgx-h100}}
# The kustomization applied on top of daemonset/ (CLUSTER_OVERLAY: another one, e.g. a deliberately broken copy).
overlay=$(realpath "${CLUSTER_OVERLAY:-$repo_root/hack/cluster/overlay}")
preset_file=$repo_root/agent/nvml/presets/$preset.yaml
[[ -f $preset_file ]] || die "unknown preset '$preset' (presets: $(cd "$repo_root/agent/nvml/presets" && ls -- *.yaml | sed 's/\.yaml$//' | paste -sd' '))"
[[ $EUID == 0 ]] || die "run as root: it starts containerd and a kubelet"
status_s=${KUBELET_STATUS_S:-10} sync_s=${KUBELET_SYNC_S:-15}
[[ $status_s =~ ^[1-9][0-9]*$ && $sync_s =~ ^[1-9][0-9]*$ ]] ||
    die "KUBELET_STATUS_S and KUBELET_SYNC_S are whole seconds, at least 1 (got '$status_s' and '$sync_s')"
gpus=$(grep -c '^  - {model:' "$preset_file")

t_all=$(date +%s.%N)
case $(cgroup_version) in
    v1) clog "Kubernetes $cluster_release on a cgroup v1 host: the kubelet runs with failCgroupV1: false" ;;
    v2) clog "Kubernetes $cluster_release on a cgroup v2 host" ;;
esac
stage() {
    local name=$1 t0
    shift
    t0=$(date +%s.%N)
    "$@"
    clog "$name: $(since "$t0") s"
}

stage "packages" "$here/packages.sh"
stage "binaries" env KUBE="$cluster_release" "$repo_root/hack/testbin.sh"
stage "containerd" "$here/containerd.sh"
stage "images" "$here/images.sh"
"$here/down.sh" --quiet

# --- the simulated GPUs' state an earlier cluster left: kept (and said), or with CLUSTER_FRESH_STATE=1 removed ---
sim_state_check "${sim_state_files[@]}"

# --- what was there before, so that down.sh leaves the machine as it found it ---
mkdir -p "$run_dir" "$pids_dir" "$logs_dir"
for p in "${outside_paths[@]}" "${sim_state_files[@]}"; do [[ -e $p ]] || echo "$p"; done >"$run_dir/created-paths"
[[ -z ${CLUSTER_OWNER:-} ]] || echo "$CLUSTER_OWNER" >"$run_dir/owner"
mountpoint -q /run/netns 2>/dev/null || echo "/run/netns" >"$run_dir/unmount-after"
for s in "${kubelet_sysctls[@]}"; do printf '%s=%s\n' "$s" "$(sysctl -n "$s")"; done >"$run_dir/sysctls"
echo "$preset" >"$run_dir/preset"
echo "$cluster_release" >"$run_dir/kube-release"
# Read by kubelet.sh at each start, so that a restarted kubelet keeps them.
printf '%s %s\n' "$status_s" "$sync_s" >"$run_dir/kubelet-timing"

bring_up() {
    "$here/certs.sh"

    # The network namespace: loopback, and the pod bridge with the node's address.
    ip netns add "$netns"
    ip -n "$netns" link set lo up
    ip -n "$netns" link add cni0 type bridge
    ip -n "$netns" addr add "$node_ip/24" dev cni0
    ip -n "$netns" link set cni0 up
    # No kube-proxy: the service IP of `kubernetes` goes straight to the API server, for pods
    # (PREROUTING) and for processes in the namespace (OUTPUT). No default route: nothing leaves.
    ip -n "$netns" route add "$service_cidr" dev cni0
    for chain in PREROUTING OUTPUT; do
        in_netns iptables -t nat -A "$chain" -d "$service_ip/32" -p tcp --dport 443 \
            -j DNAT --to-destination "$node_ip:$apiserver_port"
    done

    start_daemon etcd "$kube_bin_dir/etcd" --name=node --data-dir="$run_dir/etcd" \
        --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
        --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
        --initial-cluster=node=http://127.0.0.1:2380 --log-level=warn --unsafe-no-fsync

    write_containerd_config
    make_device_nodes
    # The CDI spec directory, before containerd starts watching it (DRA mode writes the claims' specs there).
    mkdir -p /run/cdi
    start_daemon containerd "$testbin_dir/containerd" --config "$run_dir/containerd/config.toml"

    local pki=$run_dir/pki gates scheduler_gates
    # The gates the release leaves off (lib.sh, gates_off_by_default); the kubelet's in kubelet.sh.
    gates=$(gates_off_by_default "$kube_bin_dir/kube-apiserver" ResourceHealthStatus DRAPartitionableDevices \
        DRAExtendedResource)
    scheduler_gates=$(gates_off_by_default "$kube_bin_dir/kube-scheduler" DRAPartitionableDevices DRAExtendedResource)
    [[ -z $gates ]] || clog "kube-apiserver with --feature-gates=$gates: off by default in $cluster_release"
    [[ -z $scheduler_gates ]] || clog "kube-scheduler with --feature-gates=$scheduler_gates: off by default in $cluster_release"
    wait_for 30 "etcd" in_netns curl -fsS --max-time 1 http://127.0.0.1:2379/health
    start_daemon kube-apiserver "$kube_bin_dir/kube-apiserver" \
        --bind-address=0.0.0.0 --advertise-address="$node_ip" --secure-port="$apiserver_port" \
        --etcd-servers=http://127.0.0.1:2379 \
        --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
        --client-ca-file="$pki/ca.crt" \
        --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
        --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types=InternalIP \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
        --service-cluster-ip-range="$service_cidr" \
        --authorization-mode=Node,RBAC \
        --enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy \
        --endpoint-reconciler-type=lease --allow-privileged=true --profiling=false \
        ${gates:+"--feature-gates=$gates"} --v=1
    wait_for 60 "kube-apiserver /readyz" apiserver_ready
    start_daemon kube-controller-manager "$kube_bin_dir/kube-controller-manager" \
        --kubeconfig="$pki/kube-controller-manager.kubeconfig" \
        --authentication-kubeconfig="$pki/kube-controller-manager.kubeconfig" \
        --authorization-kubeconfig="$pki/kube-controller-manager.kubeconfig" \
        --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials \
        --root-ca-file="$pki/ca.crt" --service-account-private-key-file="$pki/sa.key" \
        --service-cluster-ip-range="$service_cidr" --profiling=false --v=1
    start_daemon kube-scheduler "$kube_bin_dir/kube-scheduler" \
        --kubeconfig="$pki/kube-scheduler.kubeconfig" \
        --authentication-kubeconfig="$pki/kube-scheduler.kubeconfig" \
        --authorization-kubeconfig="$pki/kube-scheduler.kubeconfig" \
        --bind-address=127.0.0.1 --leader-elect=false --profiling=false \
        ${scheduler_gates:+"--feature-gates=$scheduler_gates"} --v=1

    wait_for 30 "containerd" ctr_ version
    for image in pause busybox agent; do
        ctr_ images import "$cache_dir/images/$image.tar" >/dev/null
    done
    "$here/kubelet.sh" start
    wait_for 60 "Node $node_name to be Ready" kubectl_ wait --for=condition=Ready "node/$node_name" --timeout=1s
    wait_for 60 "the default ServiceAccount" kubectl_ get serviceaccount default -n default
}

write_containerd_config() {
    local c=$run_dir/containerd
    mkdir -p "$c" "$run_dir/cni/net.d"
    cat >"$c/config.toml" <<TOML
version = 2
root = "$c/root"
state = "$c/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  # NRI (on by default in containerd 2.x) would make its socket and plugin directories in /run, /opt and /etc.
  "io.containerd.nri.v1.nri"]
[grpc]
  address = "$c/containerd.sock"
[ttrpc]
  address = "$c/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$c/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$(<"$cache_dir/images/pause.ref")"
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower a sandbox's oom_score_adj to -998.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  # CDI: the devices of DRA claims (the kubelet passes them as CDI names; containerd 2.x defaults, spelled out).
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      # The shim built with containerd (hack/cluster/containerd.sh), not Debian's 1.6 one.
      runtime_path = "$testbin_dir/containerd-shim-runc-v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$run_dir/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$run_dir/cni/net.d"
TOML
    cat >"$run_dir/cni/net.d/10-pods.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "pods",
  "plugins": [
    {
      "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {
        "type": "host-local", "dataDir": "$run_dir/cni/ipam",
        "ranges": [[{"subnet": "$pod_cidr", "gateway": "$node_ip", "rangeStart": "10.244.0.10"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
JSON
}

# Stand-ins for the GPUs' device nodes (/dev/nvidia<minor>, character devices 195:<minor> as the NVIDIA driver makes
# them) under a device root of their own, not in the machine's /dev: the agent in DRA mode (flags.nvidiaDevRoot)
# names them as the host paths of the device nodes in its CDI specs, and containerd gives them to the containers.
# Nothing opens them: with no NVIDIA driver loaded, an open fails with ENXIO.
make_device_nodes() {
    mkdir -p "$run_dir/nvidia-dev/dev"
    local i
    for ((i = 0; i < gpus; i++)); do mknod -m 666 "$run_dir/nvidia-dev/dev/nvidia$i" c 195 "$i"; done
}

write_kustomization() {
    local k=$run_dir/kustomize
    mkdir -p "$k"
    cat >"$k/kustomization.yaml" <<KZ
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(realpath --relative-to="$k" "$overlay")
images:
  - name: localhost/gpu-node-agent
    newTag: "$(cut -d: -f2 <"$cache_dir/images/agent.ref")"
patches:
  - target: {kind: DaemonSet, name: gpu-node-agent}
    patch: |
      - op: replace
        path: /spec/template/spec/containers/0/args/6
        value: mock:$preset
KZ
    # DRA mode (tests/e2e/test_dra.py applies it and goes back to the one above): the same agent with
    # deployments/dra/ and the Component deployments/dra/mode, and the stand-in device nodes as its device root.
    local d=$run_dir/kustomize-dra
    mkdir -p "$d"
    cat >"$d/kustomization.yaml" <<KZ
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../kustomize
  - $(realpath --relative-to="$d" "$repo_root/deployments/dra")
components:
  - $(realpath --relative-to="$d" "$repo_root/deployments/dra/mode")
patches:
  - patch: |
      apiVersion: v1
      kind: ConfigMap
      metadata: {name: gpu-node-agent-config, namespace: gpu-node-agent}
      data:
        config.yaml: |
          version: v1
          mig:
            layoutsFile: /etc/gpu-agent/mig-layouts.yaml
          dra:
            enabled: true
          flags:
            nvidiaDevRoot: $run_dir/nvidia-dev
KZ
}

# The install steps of docs/operations.md: label the node, apply, wait for the rollout.
deploy() {
    kubectl_ label node "$node_name" nvidia.com/gpu.present=true --overwrite >/dev/null
    kubectl_ apply --server-side -k "$run_dir/kustomize" >/dev/null
    kubectl_ rollout status daemonset/gpu-node-agent -n gpu-node-agent --timeout="${CLUSTER_ROLLOUT_TIMEOUT:-180s}" >/dev/null
}

allocatable_gpus() {
    [[ $(kubectl_ get node "$node_name" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}') == "$gpus" ]]
}

trap 'rc=$?; ((rc == 0)) || clog "bring-up failed; the logs are in $logs_dir (kept in $cache_dir/last-logs after cluster-down); make cluster-down removes what was started"' EXIT
stage "control plane, containerd and kubelet to Node Ready" bring_up
write_kustomization
if [[ ${CLUSTER_DEPLOY:-1} == 0 ]]; then
    # Without the agent (bench/cluster_bench.py times the apply itself).
    trap - EXIT
    clog "up in $(since "$t_all") s without the agent: apply it with hack/cluster/kubectl apply --server-side -k $run_dir/kustomize"
    exit 0
fi
stage "DaemonSet applied and rolled out" deploy
stage "kubelet advertises nvidia.com/gpu: $gpus" wait_for 90 "Allocatable nvidia.com/gpu: $gpus" allocatable_gpus
trap - EXIT

clog "up in $(since "$t_all") s: node $node_name, preset $preset, $gpus GPUs"
cat <<MSG

A single-node cluster is running (preset $preset). Try:
  hack/cluster/kubectl describe node $node_name
  hack/cluster/kubectl get pods -A
  hack/cluster/kubectl label node $node_name nvidia.com/mig.config=all-1g.10gb
Logs: $logs_dir. Stop it with: make cluster-down
MSG
