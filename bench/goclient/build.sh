#!/usr/bin/env bash
# Builds bench-grpc (this module: the kubelet-like client and the Go floor server of bench/grpc_bench.py)
# into .cache/testbin/ with the test rig's Go, flags, lock and stamps (hack/testbin/lib.sh); nothing when the
# sources have not changed.
#
# usage: bench/goclient/build.sh
set -euo pipefail

# shellcheck source=hack/testbin/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../hack/testbin/lib.sh"

module=$repo_root/bench/goclient
lock_testbin
mapfile -t sources < <(cd "$module" && find . -name '*.go' -o -name go.mod -o -name go.sum | LC_ALL=C sort)
stamp=$(stamp_for "bench-grpc ${sources[*]}" "$repo_root/hack/testbin/lib.sh" "${sources[@]/#/$module/}")
if is_current bench-grpc "$stamp"; then
    log "bench-grpc: up to date"
else
    log "bench-grpc: building"
    go_build_into "$module" bench-grpc "$stamp" .
fi
