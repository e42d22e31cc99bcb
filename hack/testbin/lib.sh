# Shared by hack/testbin.sh and hack/kubelet-harness.sh: a pinned, cached,
# interrupt-safe `go build` of one binary into .cache/testbin/.
# Sourced, not executed.

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
testbin_dir=${TESTBIN_DIR:-$repo_root/.cache/testbin}

# The environment of the caller must not change what gets built: the go.mod
# files and their committed go.sum decide every module version, and the same
# flags everywhere let the harness reuse the kube-apiserver build cache. The Go
# toolchain too: each build takes the one its module's go.mod names
# (module_toolchain below), else this machine's own Go, never the caller's
# GOTOOLCHAIN.
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

# The stamp of a binary names everything that decides its bytes (the Go
# toolchain a go.mod names is in that go.mod, and how it is chosen in lib.sh).
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

# The Go toolchain a module builds with: the `toolchain goX.Y.Z` line of its
# go.mod where it has one (a Kubernetes release whose sources need a newer Go
# than this machine's: 1.38 says `go 1.27.0` and `toolchain go1.27.3`), else
# this machine's own Go (local). GOTOOLCHAIN=goX.Y.Z makes the go command fetch
# exactly that release from the module proxy (golang.org/toolchain, about 76 MB,
# checked against the checksum database) into the module cache, once per
# machine, and run it; nothing else picks a toolchain. A go.mod that needs a
# newer Go than this machine's and names none is refused here, saying so.
# usage: module_toolchain MODULE_DIR
module_toolchain() {
    local gomod=$1/go.mod toolchain need have
    toolchain=$(awk '$1 == "toolchain" { print $2; exit }' "$gomod")
    if [[ -n $toolchain ]]; then
        if [[ ! $toolchain =~ ^go1\.[0-9]+\.[0-9]+$ ]]; then
            log "$gomod: 'toolchain $toolchain' is not an exact Go release such as go1.27.3"
            return 1
        fi
        echo "$toolchain"
        return
    fi
    need=$(awk '$1 == "go" { print $2; exit }' "$gomod")
    have=$(GOTOOLCHAIN=local "$go_bin" env GOVERSION)
    have=${have#go}
    if [[ -n $need && $(printf '%s\n' "$need" "$have" | sort -V | tail -n1) != "$have" ]]; then
        log "$gomod needs go >= $need and names no toolchain, and this machine's Go is $have:" \
            "add a line 'toolchain go<version>' to it"
        return 1
    fi
    echo local
}

# The files of a module that decide its build besides lib.sh: go.mod, go.sum,
# and every file of the directories its go.mod replaces modules with (a module
# the proxy does not serve, kept in the repository: hack/testbin/kube/1.38/
# iptables-wrappers), sorted so the stamp is stable.
# usage: module_files MODULE_DIR
module_files() {
    local moddir=$1 dir
    printf '%s\n' "$moddir/go.mod" "$moddir/go.sum"
    # `replace X => ./dir` or, in a replace block, `X => ./dir` (or ../dir).
    awk '{ for (i = 1; i < NF; i++) if ($i == "=>" && $(i + 1) ~ /^\.\.?\//) print $(i + 1) }' "$moddir/go.mod" |
        while read -r dir; do
            find "$moddir/${dir#./}" -type f \( -name '*.go' ! -name '*_test.go' -o -name go.mod -o -name go.sum \)
        done | LC_ALL=C sort
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

    local toolchain t0
    toolchain=$(module_toolchain "$moddir")
    t0=$(date +%s.%N)
    if [[ $toolchain != local ]]; then
        log "$name: Go $toolchain, as ${moddir#"$repo_root"/}/go.mod says (fetched from the module proxy once per machine)"
    fi
    (cd "$moddir" && GOTOOLCHAIN=$toolchain "$go_bin" list -deps "$pkg" >/dev/null)
    log "$name: modules ready in $(elapsed "$t0") s"

    t0=$(date +%s.%N)
    (cd "$moddir" && GOTOOLCHAIN=$toolchain "$go_bin" build -o "$tmp" "$@" "$pkg")
    mv -f "$tmp" "$testbin_dir/$name"
    log "$name: compiled in $(elapsed "$t0") s"
    printf '%s\n' "$stamp" >"$testbin_dir/$name.stamp"
}
