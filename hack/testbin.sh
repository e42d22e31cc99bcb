#!/usr/bin/env bash
# Builds the pinned kube-apiserver and etcd that the integration tests run
# against, and the kubectl they drive it with, from the Go module proxy, into
# .cache/testbin/.
#
# The pins live in hack/testbin/{kube,etcd}/go.mod (with committed go.sum);
# this script reads them from there. A binary whose stamp matches is not
# rebuilt, so running it again costs a fraction of a second.
#
# usage: hack/testbin.sh [--print-versions]
set -euo pipefail

# shellcheck source=hack/testbin/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/testbin/lib.sh"

kube_mod=$repo_root/hack/testbin/kube
etcd_mod=$repo_root/hack/testbin/etcd

# The version a wrapper module requires, e.g. `pinned k8s.io/kubernetes kube`.
pinned() {
    awk -v m="$1" '$1 == "require" && $2 == m { print $3 } $1 == m && $2 ~ /^v/ { print $2 }' \
        "$repo_root/hack/testbin/$2/go.mod" | head -n1
}

kube_version=$(pinned k8s.io/kubernetes kube)
etcd_version=$(pinned go.etcd.io/etcd/server/v3 etcd)
if [[ -z $kube_version || -z $etcd_version ]]; then
    log "cannot read the pinned versions from hack/testbin/*/go.mod"
    exit 1
fi

if [[ ${1:-} == --print-versions ]]; then
    printf 'kube-apiserver %s\nkubectl %s\netcd %s\n' "$kube_version" "$kube_version" "$etcd_version"
    exit 0
fi

# v1.34.4 -> major 1, minor 34: what `kubectl version` and /version report.
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

kube_stamp=$(stamp_for "kube-apiserver $kube_version $kube_ldflags" \
    "$kube_mod/go.mod" "$kube_mod/go.sum" "$repo_root/hack/testbin/lib.sh")
if is_current kube-apiserver "$kube_stamp"; then
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
    "$kube_mod/go.mod" "$kube_mod/go.sum" "$repo_root/hack/testbin/lib.sh")
if is_current kubectl "$kubectl_stamp"; then
    log "kubectl $kube_version: up to date"
else
    log "kubectl $kube_version: building (about a minute after kube-apiserver)"
    go_build_into "$kube_mod" kubectl "$kubectl_stamp" \
        k8s.io/kubernetes/cmd/kubectl -ldflags "$kube_ldflags"
    log "kubectl $kube_version: stage took $(elapsed "$t_stage") s"
fi

etcd_stamp=$(stamp_for "etcd $etcd_version $etcd_ldflags" \
    "$etcd_mod/go.mod" "$etcd_mod/go.sum" "$repo_root/hack/testbin/lib.sh")
if is_current etcd "$etcd_stamp"; then
    log "etcd $etcd_version: up to date"
else
    log "etcd $etcd_version: building (cold: under a minute after kube-apiserver)"
    go_build_into "$etcd_mod" etcd "$etcd_stamp" \
        go.etcd.io/etcd/server/v3 -ldflags "$etcd_ldflags"
fi

# A binary that does not report its pin is wrong however it was built.
got=$("$testbin_dir/kube-apiserver" --version)
if [[ $got != "Kubernetes $kube_version" ]]; then
    log "kube-apiserver reports '$got', expected 'Kubernetes $kube_version'"
    rm -f "$testbin_dir/kube-apiserver.stamp"
    exit 1
fi
# --client: no server, and no kubeconfig of the caller's is read.
got=$(KUBECONFIG=/dev/null "$testbin_dir/kubectl" version --client | sed -n 1p)
if [[ $got != "Client Version: $kube_version" ]]; then
    log "kubectl reports '$got', expected 'Client Version: $kube_version'"
    rm -f "$testbin_dir/kubectl.stamp"
    exit 1
fi
got=$("$testbin_dir/etcd" --version | sed -n 1p)  # sed reads to the end: no SIGPIPE under pipefail
if [[ $got != "etcd Version: ${etcd_version#v}" ]]; then
    log "etcd reports '$got', expected 'etcd Version: ${etcd_version#v}'"
    rm -f "$testbin_dir/etcd.stamp"
    exit 1
fi

log "ready in $(elapsed "$t_all") s: $testbin_dir/{kube-apiserver,kubectl,etcd}"
