#!/usr/bin/env bash
# Builds the pinned kube-apiserver and etcd that the integration tests run
# against, and the kubectl they drive it with, from the Go module proxy, into
# .cache/testbin/kube-<release>/; then the kubelet, kube-scheduler and
# kube-controller-manager that the single-node cluster (hack/cluster/up.sh,
# tests/e2e) runs, from the same wrapper module with the same flags, so they
# share one build cache.
#
# One Kubernetes minor release at a time: KUBE=1.35 (or 1.36, 1.37, 1.38) picks
# it; without KUBE, the default (hack/testbin/kube/default: the newest GA
# release pinned). Each release has its own pins in
# hack/testbin/{kube,etcd}/<release>/go.mod (with committed go.sum) and its own
# binaries side by side under .cache/testbin/kube-<release>/, so switching
# releases rebuilds nothing. A binary whose stamp matches is not rebuilt, so
# running it again costs a fraction of a second.
#
# Each module builds with the Go its go.mod names on a `toolchain` line, else
# this machine's Go (hack/testbin/lib.sh, module_toolchain): Kubernetes 1.38
# needs Go 1.27, so hack/testbin/kube/1.38/go.mod says `toolchain go1.27.3` and
# the go command fetches that toolchain from the module proxy once per machine.
#
# usage: KUBE=<release> hack/testbin.sh [--print-versions | --print-dir] [NAME...]
#   NAME...  build only these (kube-apiserver kubectl etcd kubelet
#            kube-scheduler kube-controller-manager); default: all of them
set -euo pipefail

# shellcheck source=hack/testbin/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/testbin/lib.sh"
# shellcheck source=hack/testbin/release.sh
source "$repo_root/hack/testbin/release.sh"

kube_release=$(kube_release) || exit 2
kube_mod=$repo_root/hack/testbin/kube/$kube_release
etcd_mod=$repo_root/hack/testbin/etcd/$kube_release
release_dir=$testbin_dir/kube-$kube_release

# The version a wrapper module requires, e.g. `pinned k8s.io/kubernetes "$kube_mod"`.
pinned() {
    awk -v m="$1" '$1 == "require" && $2 == m { print $3 } $1 == m && $2 ~ /^v/ { print $2 }' \
        "$2/go.mod" | head -n1
}

kube_version=$(pinned k8s.io/kubernetes "$kube_mod")
etcd_version=$(pinned go.etcd.io/etcd/server/v3 "$etcd_mod")
if [[ -z $kube_version || -z $etcd_version ]]; then
    log "cannot read the pinned versions from hack/testbin/{kube,etcd}/$kube_release/go.mod"
    exit 1
fi

kube_node_bins=(kubelet kube-scheduler kube-controller-manager)
all_bins=(kube-apiserver kubectl etcd "${kube_node_bins[@]}")
if [[ ${1:-} == --print-versions ]]; then
    printf 'kube-apiserver %s\nkubectl %s\netcd %s\n' "$kube_version" "$kube_version" "$etcd_version"
    for name in "${kube_node_bins[@]}"; do printf '%s %s\n' "$name" "$kube_version"; done
    exit 0
fi
if [[ ${1:-} == --print-dir ]]; then
    printf '%s\n' "$release_dir"
    exit 0
fi
wanted=("$@")
if ((${#wanted[@]} == 0)); then wanted=("${all_bins[@]}"); fi
for name in "${wanted[@]}"; do
    if [[ " ${all_bins[*]} " != *" $name "* ]]; then
        log "unknown binary '$name' (known: ${all_bins[*]})"
        exit 2
    fi
done
want() { [[ " ${wanted[*]} " == *" $1 "* ]]; }

# v1.37.2 -> major 1, minor 37: what `kubectl version` and /version report.
# kube-apiserver and kubectl take the same flags, so they share one build cache.
kube_minor=${kube_version#v*.}
kube_minor=${kube_minor%%.*}
kube_major=${kube_version#v}
kube_major=${kube_major%%.*}
kube_ldflags="-s -w"
kube_ldflags+=" -X k8s.io/component-base/version.gitVersion=$kube_version"
kube_ldflags+=" -X k8s.io/component-base/version.gitMajor=$kube_major"
kube_ldflags+=" -X k8s.io/component-base/version.gitMinor=$kube_minor"
# etcd takes its version from source; only the git commit would need a flag,
# and the module proxy does not say which commit a version is.
etcd_ldflags="-s -w"

t_all=$(date +%s.%N)
lock_testbin
# From here on every binary, stamp and temporary file is the release's own.
testbin_dir=$release_dir
mkdir -p "$testbin_dir"
log "Kubernetes $kube_release: $kube_version, etcd $etcd_version, into $testbin_dir"

# What decides the bytes of each module's binaries besides lib.sh: go.mod (its
# toolchain line included), go.sum, and a module kept in the repository that
# go.mod replaces one with (1.38's iptables-wrappers).
mapfile -t kube_files < <(module_files "$kube_mod")
mapfile -t etcd_files < <(module_files "$etcd_mod")
kube_stamp=$(stamp_for "kube-apiserver $kube_version $kube_ldflags" \
    "${kube_files[@]}" "$repo_root/hack/testbin/lib.sh")
if ! want kube-apiserver; then
    :
elif is_current kube-apiserver "$kube_stamp"; then
    log "kube-apiserver $kube_version: up to date"
else
    log "kube-apiserver $kube_version: building (cold: about 13 min on 2 busy cores)"
    go_build_into "$kube_mod" kube-apiserver "$kube_stamp" \
        k8s.io/kubernetes/cmd/kube-apiserver -ldflags "$kube_ldflags"
fi

# kubectl comes from the same wrapper module (hack/testbin/kube/tools.go lists
# it, so go.sum covers it) at the same version as the server it talks to.
t_stage=$(date +%s.%N)
kubectl_stamp=$(stamp_for "kubectl $kube_version $kube_ldflags" \
    "${kube_files[@]}" "$repo_root/hack/testbin/lib.sh")
if ! want kubectl; then
    :
elif is_current kubectl "$kubectl_stamp"; then
    log "kubectl $kube_version: up to date"
else
    log "kubectl $kube_version: building (about a minute after kube-apiserver)"
    go_build_into "$kube_mod" kubectl "$kubectl_stamp" \
        k8s.io/kubernetes/cmd/kubectl -ldflags "$kube_ldflags"
    log "kubectl $kube_version: stage took $(elapsed "$t_stage") s"
fi

etcd_stamp=$(stamp_for "etcd $etcd_version $etcd_ldflags" \
    "${etcd_files[@]}" "$repo_root/hack/testbin/lib.sh")
if ! want etcd; then
    :
elif is_current etcd "$etcd_stamp"; then
    log "etcd $etcd_version: up to date"
else
    log "etcd $etcd_version: building (cold: under a minute after kube-apiserver)"
    go_build_into "$etcd_mod" etcd "$etcd_stamp" \
        go.etcd.io/etcd/server/v3 -ldflags "$etcd_ldflags"
fi

# The node's own components: same module, same flags, same build cache as
# kube-apiserver, so after it they compile in one to two minutes each (the
# kubelet about eight cold).
for name in "${kube_node_bins[@]}"; do
    want "$name" || continue
    t_stage=$(date +%s.%N)
    stamp=$(stamp_for "$name $kube_version $kube_ldflags" \
        "${kube_files[@]}" "$repo_root/hack/testbin/lib.sh")
    if is_current "$name" "$stamp"; then
        log "$name $kube_version: up to date"
    else
        log "$name $kube_version: building"
        go_build_into "$kube_mod" "$name" "$stamp" \
            "k8s.io/kubernetes/cmd/$name" -ldflags "$kube_ldflags"
        log "$name $kube_version: stage took $(elapsed "$t_stage") s"
    fi
done

# A binary that does not report its pin is wrong however it was built.
check_version() {
    local name=$1 expected=$2 got
    shift 2
    got=$("$@" | sed -n 1p)  # sed reads to the end: no SIGPIPE under pipefail
    if [[ $got != "$expected" ]]; then
        log "$name reports '$got', expected '$expected'"
        rm -f "$testbin_dir/$name.stamp"
        exit 1
    fi
}
want kube-apiserver && check_version kube-apiserver "Kubernetes $kube_version" \
    "$testbin_dir/kube-apiserver" --version
# --client: no server, and no kubeconfig of the caller's is read.
want kubectl && check_version kubectl "Client Version: $kube_version" \
    env KUBECONFIG=/dev/null "$testbin_dir/kubectl" version --client
want etcd && check_version etcd "etcd Version: ${etcd_version#v}" "$testbin_dir/etcd" --version
for name in "${kube_node_bins[@]}"; do
    want "$name" && check_version "$name" "Kubernetes $kube_version" "$testbin_dir/$name" --version
done

log "ready in $(elapsed "$t_all") s: $testbin_dir/{$(IFS=,; echo "${wanted[*]}")}"
