#!/usr/bin/env bash
# Builds the single-node cluster's container runtime, containerd and its runc
# shim (containerd-shim-runc-v2), from the Go module proxy at the version
# pinned in hack/cluster/containerd/go.mod (committed go.sum), into
# .cache/testbin/ with stamps, as hack/testbin.sh builds the Kubernetes binaries.
# Debian 12's containerd (1.6) has no CDI support, which DRA devices need: the
# kubelet hands a container its claim's devices only as CDI device names.
# runc and ctr stay Debian's.
#
# usage: hack/cluster/containerd.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hack/testbin/lib.sh
source "$here/../testbin/lib.sh"

mod=$here/containerd
version=$(awk '$1 == "require" && $2 == "github.com/containerd/containerd/v2" { print $3 }' "$mod/go.mod")
[[ -n $version ]] || { log "cannot read the containerd version from $mod/go.mod"; exit 1; }
ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$version"

t_all=$(date +%s.%N)
lock_testbin
for name in containerd containerd-shim-runc-v2; do
    stamp=$(stamp_for "$name $version $ldflags" "$mod/go.mod" "$mod/go.sum" "$repo_root/hack/testbin/lib.sh")
    if is_current "$name" "$stamp"; then
        log "$name $version: up to date"
        continue
    fi
    log "$name $version: building (cold: a few minutes on 2 busy cores)"
    go_build_into "$mod" "$name" "$stamp" "github.com/containerd/containerd/v2/cmd/$name" -ldflags "$ldflags"
done
got=$("$testbin_dir/containerd" --version | sed -n 1p)
if [[ $got != *" $version "* ]]; then
    log "containerd reports '$got', expected version $version"
    rm -f "$testbin_dir/containerd.stamp"
    exit 1
fi
log "containerd $version ready in $(elapsed "$t_all") s"
