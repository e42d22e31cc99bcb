#!/usr/bin/env bash
# Builds the pinned helm that lints, renders and installs the chart in
# deployments/helm/gpu-node-agent/ in the tests, from the Go module proxy,
# into .cache/testbin/helm.
#
# The pin lives in hack/testbin/helm/go.mod (with committed go.sum). A binary
# whose stamp matches is not rebuilt, so running it again costs a fraction of
# a second.
#
# usage: hack/helm.sh [--print-version]
set -euo pipefail

# shellcheck source=hack/testbin/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/testbin/lib.sh"

helm_mod=$repo_root/hack/testbin/helm

helm_version=$(awk '$1 == "require" && $2 == "helm.sh/helm/v3" { print $3 }' "$helm_mod/go.mod" | head -n1)
# The Kubernetes client libraries helm is built with decide the Kubernetes version that `helm template`
# and `helm lint` assume when no cluster is asked: client-go v0.34.x is Kubernetes 1.34.
client_go=$(awk '$1 == "k8s.io/client-go" && $2 ~ /^v0\./ { print $2 }' "$helm_mod/go.mod" | head -n1)
if [[ -z $helm_version || -z $client_go ]]; then
    log "cannot read the pinned helm and client-go versions from $helm_mod/go.mod"
    exit 1
fi

if [[ ${1:-} == --print-version ]]; then
    printf 'helm %s\n' "$helm_version"
    exit 0
fi

k8s_minor=${client_go#v0.}
k8s_minor=${k8s_minor%%.*}
# The flags helm's own Makefile sets for a release build. The git commit is left out: the module
# proxy does not say which commit a version is.
helm_ldflags="-s -w"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.version=$helm_version"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$k8s_minor"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$k8s_minor"

t_all=$(date +%s.%N)
lock_testbin

helm_stamp=$(stamp_for "helm $helm_version $helm_ldflags" \
    "$helm_mod/go.mod" "$helm_mod/go.sum" "$repo_root/hack/testbin/lib.sh")
if is_current helm "$helm_stamp"; then
    log "helm $helm_version: up to date"
else
    log "helm $helm_version: building (cold: a few minutes on 2 busy cores)"
    go_build_into "$helm_mod" helm "$helm_stamp" helm.sh/helm/v3/cmd/helm -ldflags "$helm_ldflags"
fi

# A binary that does not report its pin is wrong however it was built. An empty environment: helm
# reads nothing of the caller's to print its version.
got=$(env -i PATH=/usr/bin:/bin HOME=/nonexistent "$testbin_dir/helm" version --template '{{.Version}}')
if [[ $got != "$helm_version" ]]; then
    log "helm reports '$got', expected '$helm_version'"
    rm -f "$testbin_dir/helm.stamp"
    exit 1
fi

log "ready in $(elapsed "$t_all") s: $testbin_dir/helm"
