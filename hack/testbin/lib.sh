# Shared by hack/testbin.sh and hack/kubelet-harness.sh: a pinned, cached,
# interrupt-safe `go build` of one binary into .cache/testbin/.
# Sourced, not executed.

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
testbin_dir=${TESTBIN_DIR:-$repo_root/.cache/testbin}

# The environment of the caller must not change what gets built: the go.mod
# files and their committed go.sum decide every module version, and the same
# flags everywhere let the harness reuse the kube-apiserver build cache.
export GOTOOLCHAIN=local
export GOFLAGS="-mod=readonly -trimpath"
export GOWORK=off
export CGO_ENABLED=0
export GOPROXY=${GOPROXY:-https://proxy.golang.org,direct}
unset GOOS GOARCH GOARM GOAMD64 GOEXPERIMENT GOFIPS140 2>/dev/null || true

if [[ -n ${GO:-} ]]; then
    go_bin=$GO
elif command -v go >/dev/null 2>&1; then
    go_bin=$(command -v go)
else
    go_bin=/usr/local/go/bin/go
fi
if [[ ! -x $go_bin ]]; then
    echo "testbin: no Go toolchain found (set GO=/path/to/go)" >&2
    exit 1
fi

mkdir -p "$testbin_dir"

# Files to remove however the script ends; INT and TERM exit through EXIT.
cleanup_files=()
trap 'rm -f -- "${cleanup_files[@]}"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log() { printf 'testbin: %s\n' "$*" >&2; }

# Holds an exclusive lock on the output directory until the script exits, so
# that two callers (make and a pytest fixture, say) never build at once.
lock_testbin() {
    exec 9>"$testbin_dir/.lock"
    if ! flock -n 9; then
        log "waiting for another build in $testbin_dir"
        flock 9
    fi
}

# The stamp of a binary names everything that decides its bytes.
# usage: stamp_for LABEL FILE...
stamp_for() {
    local label=$1
    shift
    {
        printf '%s\n' "$label"
        "$go_bin" version
        printf 'GOFLAGS=%s CGO_ENABLED=%s\n' "$GOFLAGS" "$CGO_ENABLED"
        cat -- "$@"
    } | sha256sum | cut -d' ' -f1
}

# True when the binary exists and was built from exactly this stamp.
is_current() {
    local name=$1 stamp=$2
    [[ -x $testbin_dir/$name && -f $testbin_dir/$name.stamp ]] &&
        [[ $(<"$testbin_dir/$name.stamp") == "$stamp" ]]
}

# Seconds since an earlier `date +%s.%N`, one decimal.
elapsed() {
    awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'
}

# usage: go_build_into MODULE_DIR NAME STAMP PACKAGE [go build flags...]
# Loads (and downloads) the package graph, then builds to a temporary name and
# renames it into place, so an interrupted run never leaves a binary that
# looks finished. The stamp is written last.
go_build_into() {
    local moddir=$1 name=$2 stamp=$3 pkg=$4
    shift 4
    local tmp="$testbin_dir/.$name.tmp.$$"
    cleanup_files+=("$tmp")
    rm -f "$testbin_dir/$name.stamp"

    local t0
    t0=$(date +%s.%N)
    (cd "$moddir" && "$go_bin" list -deps "$pkg" >/dev/null)
    log "$name: modules ready in $(elapsed "$t0") s"

    t0=$(date +%s.%N)
    (cd "$moddir" && "$go_bin" build -o "$tmp" "$@" "$pkg")
    mv -f "$tmp" "$testbin_dir/$name"
    log "$name: compiled in $(elapsed "$t0") s"
    printf '%s\n' "$stamp" >"$testbin_dir/$name.stamp"
}
