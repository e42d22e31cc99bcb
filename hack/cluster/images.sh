#!/usr/bin/env bash
# Builds the images the single-node cluster runs, with no registry: each one is
# made here from Debian packages and this source tree, and saved as an OCI
# archive in .cache/cluster/images/ with a stamp of its inputs, so a warm run
# rebuilds nothing.
#
#   base.tar     Debian bookworm minbase with python3 and python3-venv
#                (mmdebstrap), the Dockerfile's PYTHON_IMAGE here
#   pause.tar    the pod sandbox image: a static binary that sleeps until told
#                to stop and reaps its children
#   busybox.tar  a shell for test pods, from busybox-static
#   agent.tar    the agent, built from the unchanged Dockerfile with
#                --build-arg PYTHON_IMAGE=<base>; rebuilt whenever agent/, the
#                locks, pyproject.toml or the Dockerfile change
#
# With --multiarch (hack/image.sh, `make image`, which first makes arm64
# programs run here under qemu), also:
#
#   base-arm64.tar   the same Debian base for arm64 (mmdebstrap --arch=arm64)
#   agent-index.tar  the agent for linux/amd64 (the image of agent.tar) and
#                    linux/arm64 (the Dockerfile built on base-arm64) as one OCI
#                    image index, what `docker buildx build --platform
#                    linux/amd64,linux/arm64` pushes
#
# usage: hack/cluster/images.sh [--multiarch]
set -euo pipefail
multiarch=false
case ${1:-} in
    '') ;;
    --multiarch) multiarch=true ;;
    *) echo "usage: hack/cluster/images.sh [--multiarch]" >&2; exit 2 ;;
esac
# shellcheck source=hack/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

images=$cache_dir/images
mkdir -p "$images" "$cache_dir/buildah"
exec 8>"$images/.lock"
flock 8

debian_suite=bookworm
debian_mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
base_packages=python3,python3-venv,python3-pip,python-is-python3,ca-certificates
base_ref=localhost/gpu-node-agent-base:$debian_suite
pause_ref=localhost/pause:3.10
busybox_ref=localhost/busybox:local

sha() { sha256sum | cut -d' ' -f1; }
current() { [[ -f $images/$1.tar && -f $images/$1.stamp && $(<"$images/$1.stamp") == "$2" ]]; }
# usage: save NAME REF STAMP  (the image must be in buildah's storage)
save() {
    rm -f "$images/$1.stamp" "$images/$1.tar.tmp"
    buildah_ push -q "$2" "oci-archive:$images/$1.tar.tmp:$2" >/dev/null
    mv -f "$images/$1.tar.tmp" "$images/$1.tar"
    printf '%s\n' "$2" >"$images/$1.ref"
    printf '%s\n' "$3" >"$images/$1.stamp"
}
# An image of one directory tree: buildah from scratch, copy, commit.
from_tree() {
    local ref=$1 tree=$2 c
    shift 2
    c=$(buildah_ from scratch)
    buildah_ copy -q "$c" "$tree" / >/dev/null
    buildah_ config "$@" "$c"
    buildah_ commit -q --rm "$c" "$ref" >/dev/null
}

# --- base: Debian minbase with Python, and this machine's CA bundle so pip in
# the image build verifies TLS the way the machine does ---
host_ca=/etc/ssl/certs/ca-certificates.crt
# usage: base_image NAME REF STAMP [ARCH]  (ARCH: a foreign Debian architecture; default this machine's)
base_image() {
    local name=$1 ref=$2 stamp=$3 arch=${4:-} t0 c
    if current "$name" "$stamp"; then
        clog "$name image: up to date"
        return
    fi
    t0=$(date +%s.%N)
    clog "$name image: mmdebstrap $debian_suite${arch:+ for $arch} (about 3 min, network-bound${arch:+, under qemu})"
    tmp=$(mktemp -d "$cache_dir/$name.XXXXXX")  # global: the EXIT trap removes it
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --quiet --variant=minbase ${arch:+"--architectures=$arch"} --include="$base_packages" --format=tar \
        "$debian_suite" "$tmp/rootfs.tar" "$debian_mirror"
    c=$(buildah_ from scratch)
    buildah_ add -q "$c" "$tmp/rootfs.tar" / >/dev/null
    buildah_ copy -q "$c" "$host_ca" "$host_ca" >/dev/null
    buildah_ config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        ${arch:+--arch "$arch" --os linux} --cmd /bin/bash "$c"
    buildah_ commit -q --rm "$c" "$ref" >/dev/null
    save "$name" "$ref" "$stamp"
    rm -rf "$tmp"
    trap - EXIT
    clog "$name image: built in $(since "$t0") s"
}
base_stamp=$( { echo "$debian_suite $debian_mirror $base_packages"; cat "$host_ca"; } | sha)
base_image base "$base_ref" "$base_stamp"

# --- pause ---
pause_src=$repo_root/hack/cluster/pause.c
pause_stamp=$( { cat "$pause_src"; gcc --version | head -n1; } | sha)
if current pause "$pause_stamp"; then
    clog "pause image: up to date"
else
    t0=$(date +%s.%N)
    tmp=$(mktemp -d "$cache_dir/pause.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    gcc -Os -static -o "$tmp/pause" "$pause_src"
    strip "$tmp/pause"
    mkdir "$tmp/tree" && mv "$tmp/pause" "$tmp/tree/pause"
    from_tree "$pause_ref" "$tmp/tree" --entrypoint '["/pause"]'
    save pause "$pause_ref" "$pause_stamp"
    rm -rf "$tmp"
    trap - EXIT
    clog "pause image: built in $(since "$t0") s"
fi

# --- busybox: a shell and the usual tools for test pods ---
busybox_bin=/bin/busybox
busybox_stamp=$(sha <"$busybox_bin")
if current busybox "$busybox_stamp"; then
    clog "busybox image: up to date"
else
    t0=$(date +%s.%N)
    tmp=$(mktemp -d "$cache_dir/busybox.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/tree/bin" "$tmp/tree/tmp"
    cp "$busybox_bin" "$tmp/tree/bin/busybox"
    for applet in $("$busybox_bin" --list); do
        [[ $applet == busybox ]] || ln -s busybox "$tmp/tree/bin/$applet"
    done
    from_tree "$busybox_ref" "$tmp/tree" --env PATH=/bin --cmd /bin/sh
    save busybox "$busybox_ref" "$busybox_stamp"
    rm -rf "$tmp"
    trap - EXIT
    clog "busybox image: built in $(since "$t0") s"
fi

# --- the agent, from the Dockerfile as it is ---
# usage: agent_inputs BASE_STAMP
agent_inputs() {
    cd "$repo_root"
    echo "base $1"
    find Dockerfile .dockerignore pyproject.toml README.md requirements.lock requirements-build.lock agent \
        -type f ! -path '*/__pycache__/*' ! -name '*.pyc' 2>/dev/null | LC_ALL=C sort | xargs sha256sum
}
agent_stamp=$(agent_inputs "$base_stamp" | sha)
agent_ref=localhost/gpu-node-agent:${agent_stamp:0:12}
if current agent "$agent_stamp"; then
    clog "agent image: up to date ($agent_ref)"
else
    t0=$(date +%s.%N)
    clog "agent image: building $agent_ref from Dockerfile"
    # The base comes from buildah's storage; from its archive if the storage was cleared.
    buildah_ inspect --type image "$base_ref" >/dev/null 2>&1 ||
        buildah_ pull -q "oci-archive:$images/base.tar" >/dev/null
    # Its output goes to a log, read back as one line on failure; --force-rm: a failed build removes its build
    # container too, which would otherwise stay mounted.
    log=$images/agent.log
    if ! buildah_ bud --network host --layers --force-rm --build-arg "PYTHON_IMAGE=$base_ref" \
        -t "$agent_ref" -f "$repo_root/Dockerfile" "$repo_root" >"$log" 2>&1; then
        die "agent image for linux/amd64 failed: $(build_failure linux/amd64 "$log") (the build's output: $log)"
    fi
    rm -f "$log"
    save agent "$agent_ref" "$agent_stamp"
    # Only the newest agent image is kept in buildah's storage (its layers stay as a build cache).
    buildah_ images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/gpu-node-agent:' |
        grep -vxF "$agent_ref" | while read -r old; do buildah_ rmi -f "$old" >/dev/null 2>&1 || true; done || true
    clog "agent image: built in $(since "$t0") s"
fi

$multiarch || exit 0

# --- linux/arm64: the same base for arm64, and the agent from the Dockerfile on it, under qemu ---
arm64_base_ref=localhost/gpu-node-agent-base:$debian_suite-arm64
arm64_base_stamp=$( { echo "arm64 $debian_suite $debian_mirror $base_packages"; cat "$host_ca"; } | sha)
base_image base-arm64 "$arm64_base_ref" "$arm64_base_stamp" arm64

index_stamp=$( { echo "linux/amd64 $agent_stamp"; echo linux/arm64; agent_inputs "$arm64_base_stamp"; } | sha)
index_ref=localhost/gpu-node-agent:${index_stamp:0:12}
arm64_ref=localhost/gpu-node-agent-arm64:${index_stamp:0:12}
if current agent-index "$index_stamp"; then
    clog "agent image index (linux/amd64, linux/arm64): up to date ($index_ref)"
    exit 0
fi
t0=$(date +%s.%N)
clog "agent image for linux/arm64: building $arm64_ref from Dockerfile under qemu"
buildah_ inspect --type image "$arm64_base_ref" >/dev/null 2>&1 ||
    buildah_ pull -q "oci-archive:$images/base-arm64.tar" >/dev/null
buildah_ inspect --type image "$agent_ref" >/dev/null 2>&1 ||
    buildah_ pull -q "oci-archive:$images/agent.tar" >/dev/null
log=$images/agent-arm64.log
if ! buildah_ bud --platform linux/arm64 --network host --layers --force-rm \
    --build-arg "PYTHON_IMAGE=$arm64_base_ref" -t "$arm64_ref" -f "$repo_root/Dockerfile" "$repo_root" \
    >"$log" 2>&1; then
    die "agent image for linux/arm64 failed: $(build_failure linux/arm64 "$log") (the build's output: $log)"
fi
rm -f "$log"
rm -f "$images/agent-index.stamp" "$images/agent-index.tar.tmp"
buildah_ rmi -f "$index_ref" >/dev/null 2>&1 || true
buildah_ manifest create "$index_ref" >/dev/null
buildah_ manifest add "$index_ref" "containers-storage:$agent_ref" >/dev/null
buildah_ manifest add "$index_ref" "containers-storage:$arm64_ref" >/dev/null
buildah_ manifest push -q --all --format oci "$index_ref" "oci-archive:$images/agent-index.tar.tmp:$index_ref" \
    >/dev/null
mv -f "$images/agent-index.tar.tmp" "$images/agent-index.tar"
printf '%s\n' "$index_ref" >"$images/agent-index.ref"
printf '%s\n' "$index_stamp" >"$images/agent-index.stamp"
# Only the newest arm64 image is kept in buildah's storage (its layers stay as a build cache).
buildah_ images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/gpu-node-agent-arm64:' |
    grep -vxF "$arm64_ref" | while read -r old; do buildah_ rmi -f "$old" >/dev/null 2>&1 || true; done || true
clog "agent image index (linux/amd64, linux/arm64): built in $(since "$t0") s ($index_ref)"
