#!/usr/bin/env bash
# Takes down the cluster hack/cluster/up.sh started and leaves the machine as
# it was: stops every process it started (the kubelet first, then the pods,
# then the control plane and containerd), unmounts what they mounted, deletes
# the network namespaces (with every iptables rule the kubelet made in them),
# removes the kubelet's cgroups, restores the kernel settings the kubelet
# changed, and removes every file and directory it created. The logs of the
# run are kept in .cache/cluster/last-logs, the last run's only: the daemons'
# (<name>.log) and the pods', the agent's among them, as the kubelet wrote them
# (pods/<namespace>_<pod>_<uid>/<container>/<n>.log, with containers/ holding
# /var/log/containers' links to them), so that a failed end-to-end test can be
# looked into afterwards. Safe to run with nothing up.
#
# usage: hack/cluster/down.sh [--quiet] [--if-stale]
#   --if-stale  only a cluster none of whose processes is alive (left by a run
#               stopped with the machine): a running one is left alone
set -euo pipefail
# shellcheck source=hack/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
quiet=false if_stale=false
for arg in "$@"; do
    case $arg in
        --quiet) quiet=true ;;
        --if-stale) if_stale=true ;;
        *) die "usage: hack/cluster/down.sh [--quiet] [--if-stale]" ;;
    esac
done
[[ $EUID == 0 ]] || die "run as root"

if [[ ! -d $run_dir && ! -e /run/netns/$netns ]]; then
    $quiet || clog "no cluster is running"
    exit 0
fi
if $if_stale; then
    for name in "${daemons[@]}"; do
        daemon_pid "$name" >/dev/null && exit 0
    done
    clog "a cluster none of whose processes is alive was left in $run_dir: taking it down"
fi
t0=$(date +%s.%N)
sock=$run_dir/containerd/containerd.sock

# 1. The kubelet, so that it restarts nothing.
stop_daemon kubelet 20

# 2. The pods: every task in containerd's k8s.io namespace, and the network
#    namespaces containerd made for them (named in its own container specs).
# They are written down first, so that a second run finds them if this one is interrupted.
pod_netns=()
[[ -f $run_dir/pod-netns ]] && mapfile -t pod_netns <"$run_dir/pod-netns"
if [[ -S $sock ]] && ctr_ version >/dev/null 2>&1; then
    mapfile -t containers < <(ctr_ containers ls -q 2>/dev/null)
    for id in "${containers[@]}"; do
        while read -r path; do
            # /var/run is a link to /run: the mount table names the resolved path.
            [[ -n $path ]] && pod_netns+=("$(readlink -f -- "$path" || echo "$path")")
        done < <(ctr_ containers info "$id" 2>/dev/null |
            python3 -c 'import json,sys
for ns in json.load(sys.stdin).get("Spec", {}).get("linux", {}).get("namespaces", []):
    if ns.get("type") == "network" and ns.get("path"): print(ns["path"])' 2>/dev/null || true)
    done
    if ((${#pod_netns[@]})); then printf '%s\n' "${pod_netns[@]}" | sort -u >"$run_dir/pod-netns"; fi
    for id in "${containers[@]}"; do ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    for id in "${containers[@]}"; do
        for _ in $(seq 50); do
            ctr_ tasks delete "$id" >/dev/null 2>&1 && break
            ctr_ tasks ls -q 2>/dev/null | grep -qxF "$id" || break
            sleep 0.1
        done
        ctr_ containers delete "$id" >/dev/null 2>&1 || true
    done
elif [[ -f $run_dir/unmount-after ]] && mountpoint -q /run/netns; then
    # containerd is gone (a run killed with the machine, say) and cannot name its pods' namespaces. /run/netns
    # was mounted by up.sh, so every CNI namespace in it is one of our pods': those no process is in go.
    for path in /run/netns/cni-*; do
        [[ -e $path && -z $(ip netns pids "${path##*/}" 2>/dev/null) ]] && pod_netns+=("$path")
    done
fi

# 3. The control plane, then containerd.
for name in "${daemons[@]:1}"; do
    stop_daemon "$name" 15
done

# 4. Anything of ours still alive: processes in the cluster's network namespace,
#    containerd shims serving our socket, processes in the kubelet's cgroups.
ours=()
if [[ -e /run/netns/$netns ]]; then mapfile -t ours < <(ip netns pids "$netns" 2>/dev/null); fi
for cmdline in /proc/[0-9]*/cmdline; do
    if grep -qaF -- "$sock" "$cmdline" 2>/dev/null; then
        pid=${cmdline#/proc/}; ours+=("${pid%/cmdline}")
    fi
done
# cgroup v1 (a controller's hierarchy each) and v2 (one unified hierarchy).
for procs in /sys/fs/cgroup/pids/kubepods /sys/fs/cgroup/memory/kubepods /sys/fs/cgroup/kubepods; do
    [[ -d $procs ]] && mapfile -t -O "${#ours[@]}" ours < <(find "$procs" -name cgroup.procs -exec cat {} + 2>/dev/null)
done
for pid in "${ours[@]}"; do
    [[ $pid != "$$" && -n $pid ]] && kill -KILL "$pid" 2>/dev/null || true
done
for pid in "${ours[@]}"; do
    while [[ -n $pid && -d /proc/$pid ]]; do sleep 0.1; done
done

# 5. Mounts under what the cluster used (deepest first), and the pods' namespaces.
created=()
[[ -f $run_dir/created-paths ]] && mapfile -t created <"$run_dir/created-paths"
roots=("$run_dir" "${pod_netns[@]}")
for p in "${created[@]}"; do [[ $p != /run/netns ]] && roots+=("$p"); done
[[ " ${created[*]} " == *" /var/lib/kubelet "* ]] || roots+=(/var/lib/kubelet/pods /var/lib/kubelet/plugins)
mounts_under() {
    awk '{ print $5 }' /proc/self/mountinfo | while read -r m; do
        for r in "${roots[@]}"; do
            if [[ $m == "$r" || $m == "$r"/* ]]; then echo "$m"; break; fi
        done
    done | awk '{ print length, $0 }' | sort -rn | cut -d' ' -f2-
}
while read -r m; do
    [[ -n $m ]] && { umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || clog "cannot unmount $m"; }
done < <(mounts_under)
for p in "${pod_netns[@]}"; do rm -f "$p" || clog "cannot remove $p"; done

# 6. The cluster's network namespace (its links, routes and iptables rules go with it).
if [[ -e /run/netns/$netns ]]; then ip netns del "$netns"; fi
if [[ -f $run_dir/unmount-after ]] && mountpoint -q /run/netns; then umount /run/netns || true; fi

# 7. The kubelet's cgroups (depth first; a cgroup directory goes with rmdir).
for hierarchy in /sys/fs/cgroup/ /sys/fs/cgroup/*/; do
    [[ -d ${hierarchy}kubepods ]] && find "${hierarchy}kubepods" -depth -type d -exec rmdir {} + 2>/dev/null
    [[ -d ${hierarchy}kubepods ]] && clog "cannot remove the cgroup ${hierarchy}kubepods"
done

# 8. The kernel settings the kubelet changed.
if [[ -f $run_dir/sysctls ]]; then
    while IFS= read -r line; do sysctl -q -w "$line" >/dev/null || clog "cannot restore $line"; done <"$run_dir/sysctls"
fi

# 9. Files: what the cluster created outside $run_dir, then $run_dir (its logs kept).
left=$(mounts_under)
if [[ -n $left ]]; then
    die "still mounted, not removing files under them: $(echo "$left" | tr '\n' ' ')"
fi
# The pods' logs first, into $logs_dir: from the kubelet's podLogsDir ($run_dir/pod-logs, kubelet.sh) and from
# /var/log/pods where the cluster made it (a directory that was there before holds no log of ours); each link of
# /var/log/containers to one of them becomes a link to the copy in $logs_dir/containers. A /var/log/containers
# that was there before keeps no link of ours (they would point at nothing once $run_dir is gone).
pod_log_roots=("$run_dir/pod-logs")
[[ " ${created[*]} " == *" /var/log/pods "* ]] && pod_log_roots+=(/var/log/pods)
for root in "${pod_log_roots[@]}"; do
    if [[ -d $root ]] && [[ -n $(ls -A -- "$root") ]]; then
        mkdir -p "$logs_dir/pods"
        cp -a -- "$root"/. "$logs_dir/pods/" || clog "cannot keep all the pod logs of $root"
    fi
done
for link in /var/log/containers/*.log; do
    [[ -L $link ]] || continue
    target=$(readlink -- "$link")
    for root in "${pod_log_roots[@]}"; do
        [[ $target == "$root"/* ]] || continue
        mkdir -p "$logs_dir/containers"
        ln -sfn -- "../pods/${target#"$root"/}" "$logs_dir/containers/${link##*/}"
        [[ " ${created[*]} " == *" /var/log/containers "* ]] || rm -f -- "$link"
    done
done
for p in "${created[@]}"; do
    [[ -e $p ]] && rm -rf --one-file-system -- "$p"
done
# The last run's logs only: the run before's go.
if [[ -d $logs_dir ]]; then
    rm -rf "$cache_dir/last-logs"
    mkdir -p "$cache_dir"
    mv "$logs_dir" "$cache_dir/last-logs"
fi
rm -rf --one-file-system -- "$run_dir"
$quiet || clog "down in $(since "$t0") s"
