# Shared by the hack/cluster scripts: where the single-node cluster keeps its
# files, and small helpers. Sourced, not executed.
#
# Two places, nothing else on the machine:
#   .cache/cluster/   images and their stamps, kept between runs (a build cache,
#                     ignored by git), and the logs of the last run
#   $run_dir          everything a running cluster needs (certificates, configs,
#                     containerd's root and state, sockets, pids); removed by
#                     cluster-down
# plus the kubelet's own directories (/var/lib/kubelet, which the DaemonSet's
# hostPaths name, and the hostPaths it creates), which cluster-down removes when
# they were not there before.

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache_dir=${CLUSTER_CACHE_DIR:-$repo_root/.cache/cluster}
run_dir=${CLUSTER_RUN_DIR:-/run/gpu-node-agent-cluster}
testbin_dir=${TESTBIN_DIR:-$repo_root/.cache/testbin}
# The Kubernetes release: that of the running cluster (up.sh records it), else
# $KUBE (make cluster KUBE=1.35), else the default, the newest GA release pinned
# (hack/testbin/release.sh).
# shellcheck source=hack/testbin/release.sh
source "$repo_root/hack/testbin/release.sh"
if [[ -z ${KUBE:-} && -s $run_dir/kube-release ]]; then
    cluster_release=$(<"$run_dir/kube-release")
else
    cluster_release=$(kube_release) || exit 2
fi
kube_bin_dir=$testbin_dir/kube-$cluster_release
netns=${CLUSTER_NETNS:-gpu-node-agent}
node_name=${CLUSTER_NODE_NAME:-gpu-node-1}
# Inside the cluster's network namespace only; nothing here is routed anywhere else.
node_ip=10.244.0.1
pod_cidr=10.244.0.0/24
service_cidr=10.0.0.0/24
service_ip=10.0.0.1
apiserver_port=6443
image_tag_file=$cache_dir/images/agent.tag

clog() { printf 'cluster: %s\n' "$*" >&2; }

# The feature gates the cluster needs that a release may leave off, each turned on only in the components that need
# it and have it off by default: ResourceHealthStatus (KEP-4680, a device's health in the status of the pod that
# holds it; alpha and off in 1.35, beta and on from 1.36) in the kubelet and the kube-apiserver (which drops the
# pod status field while the gate is off); DRAPartitionableDevices (dra.dynamicMig's placements with shared
# counters; alpha and off before 1.36, beta and on from 1.36, docs/reference/kubernetes-releases.md) in the
# kube-apiserver and the kube-scheduler; DRAExtendedResource (KEP-5004, pods asking for nvidia.com/gpu served
# through a DeviceClass's extendedResourceName; alpha and off in 1.35, beta from 1.36, GA in 1.37) in all three.

# usage: gates_off_by_default BINARY GATE...  The GATEs that BINARY has and leaves off by default, as the value
# of --feature-gates ("A=true,B=true"; empty when it has them all on). Asked of the binary itself: its --help
# lists every alpha and beta gate with its default (a GA gate is not listed, and is on).
gates_off_by_default() {
    local help gate out=
    help=$("$1" --help 2>&1) || true
    shift
    for gate in "$@"; do
        if grep -Eq "(^|[[:space:]:])$gate=true\|false \((ALPHA|BETA) - default=false\)" <<<"$help"; then
            out+=${out:+,}$gate=true
        fi
    done
    echo "$out"
}

# v2 when /sys/fs/cgroup is the unified cgroup v2 hierarchy, v1 otherwise (v1
# alone, or hybrid: v1 controllers with a v2 `unified` mount beside them), the
# test the kubelet itself makes (libcontainer's IsCgroup2UnifiedMode).
cgroup_version() {
    if [[ $(stat -fc %T /sys/fs/cgroup 2>/dev/null) == cgroup2fs ]]; then echo v2; else echo v1; fi
}
die() { clog "$*"; exit 1; }

# Seconds since an earlier `date +%s.%N`, one decimal.
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# buildah with its storage under .cache/cluster (not /var/lib/containers), and
# never its own network: without --network host it would add a cni-podman0
# bridge to the machine's network.
buildah_() {
    buildah --root "$cache_dir/buildah/root" --runroot "$cache_dir/buildah/runroot" \
        --storage-driver overlay "$@"
}

in_netns() { nsenter --net="/run/netns/$netns" "$@"; }

ctr_() { ctr --address "$run_dir/containerd/containerd.sock" --namespace k8s.io "$@"; }

kubectl_() {
    in_netns "$kube_bin_dir/kubectl" --kubeconfig "$run_dir/pki/admin.kubeconfig" "$@"
}

pids_dir=$run_dir/pids
logs_dir=$run_dir/logs

# Paths the cluster may create outside $run_dir; up.sh records which of them
# did not exist before, and cluster-down removes exactly those.
outside_paths=(
    /var/lib/kubelet /var/lib/gpu-node-agent /dev/nvidia-caps /var/log/pods /var/log/containers
    /run/containerd /var/lib/cni /opt/containerd /var/lib/containerd /run/netns /run/cdi
)
# The simulated GPUs' state the cluster's agent keeps on the host (its --mock-state, what it read of each GPU
# beside it, the state's lock) and its MIG journal: what an earlier cluster left there is what the next one's
# GPUs start as (MIG modes, instances, faults), unless up.sh runs with CLUSTER_FRESH_STATE=1.
sim_state_files=(
    /var/lib/gpu-node-agent/mock-nvml.json /var/lib/gpu-node-agent/mock-nvml.json.lock
    /var/lib/gpu-node-agent/mock-nvml-gpus.json /var/lib/gpu-node-agent/mock-nvml-cordon.json
    /var/lib/gpu-node-agent/mig-journal.json
)
# usage: sim_state_check FILE...  Of the simulated GPUs' state files FILE, those an earlier cluster left: removed
# when CLUSTER_FRESH_STATE=1 (the e2e suite's clusters start from the preset), else kept; said either way.
sim_state_check() {
    local left=() f
    for f in "$@"; do [[ -e $f || -L $f ]] && left+=("$f"); done
    ((${#left[@]})) || return 0
    if [[ ${CLUSTER_FRESH_STATE:-0} == 1 ]]; then
        clog "removing the simulated GPUs' state an earlier cluster left: ${left[*]}"
        rm -f -- "${left[@]}"
    else
        clog "starting on the simulated GPUs' state an earlier cluster left (MIG modes, instances and faults as" \
            "they were): ${left[*]}; CLUSTER_FRESH_STATE=1 starts from the preset instead"
    fi
}
# The cluster's daemons, in the order down.sh stops them (the kubelet first, so that it restarts nothing).
daemons=(kubelet kube-scheduler kube-controller-manager kube-apiserver etcd containerd)
# The kernel settings the kubelet rewrites at start; not namespaced, so saved and restored.
kubelet_sysctls=(
    vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
    kernel.keys.root_maxkeys kernel.keys.root_maxbytes
)

# usage: start_daemon NAME COMMAND...  (in the cluster's network namespace, its
# own session, output to $logs_dir/NAME.log; nsenter execs, so the pid file
# holds the daemon's own pid)
start_daemon() {
    local name=$1
    shift
    mkdir -p "$pids_dir" "$logs_dir"
    setsid nsenter --net="/run/netns/$netns" "$@" >>"$logs_dir/$name.log" 2>&1 </dev/null &
    echo $! >"$pids_dir/$name.pid"
}

# usage: is_daemon PID NAME  true while PID runs the daemon NAME: not ended (a zombie has), and still that
# program (after a machine restarts, another process may have the number)
is_daemon() {
    local stat argv0
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]] || return 1
    argv0=
    IFS= read -r -d '' argv0 <"/proc/$1/cmdline" 2>/dev/null || [[ -n $argv0 ]] || return 1
    [[ ${argv0##*/} == "$2" ]]
}

daemon_pid() {
    local f=$pids_dir/$1.pid pid
    [[ -f $f ]] || return 1
    pid=$(<"$f")
    is_daemon "$pid" "$1" || return 1
    echo "$pid"
}

# usage: stop_daemon NAME [SECONDS]  TERM, then KILL after SECONDS (default 15)
stop_daemon() {
    local name=$1 wait_s=${2:-15} pid i
    if pid=$(daemon_pid "$name"); then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < wait_s * 10; i++)); do
            is_daemon "$pid" "$name" || break
            sleep 0.1
        done
        if is_daemon "$pid" "$name"; then
            clog "$name did not stop in ${wait_s}s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
            while is_daemon "$pid" "$name"; do sleep 0.1; done
        fi
    fi
    rm -f "$pids_dir/$name.pid"
}

# usage: wait_for SECONDS WHAT COMMAND...  (polls every 0.2 s)
wait_for() {
    local limit=$1 what=$2 t0
    shift 2
    t0=$SECONDS
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS - t0 >= limit)); then
            clog "timed out after ${limit}s waiting for $what"
            return 1
        fi
        sleep 0.2
    done
}

apiserver_ready() {
    in_netns curl -fsS --max-time 2 --cacert "$run_dir/pki/ca.crt" --cert "$run_dir/pki/admin.crt" \
        --key "$run_dir/pki/admin.key" "https://127.0.0.1:$apiserver_port/readyz"
}

# usage: build_failure PLATFORM LOG  One line for a failed build: pip's own error where there is one (a wheel
# missing for the platform, or one whose hash the lock lacks), else the build's last line.
build_failure() {
    local platform=$1 log=$2 wheel line
    if grep -q 'DO NOT MATCH THE HASHES' "$log"; then
        wheel=$(sed -n '/DO NOT MATCH THE HASHES/,$p' "$log" | grep -m1 -oE '[^/ ]+\.whl' || echo "a wheel")
        echo "requirements.lock has no hash for $wheel, the wheel pip picked for $platform"
    elif line=$(grep -m1 -E '^ERROR: ' "$log"); then
        echo "pip on $platform: ${line#ERROR: }"
    else
        tail -n1 "$log"
    fi
}
