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
# usage: hack/cluster/images.sh
set -euo pipefail
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
base_stamp=$( { echo "$debian_suite $debian_mirror $base_packages"; cat "$host_ca"; } | sha)
if current base "$base_stamp"; then
    clog "base image: up to date"
else
    t0=$(date +%s.%N)
    clog "base image: mmdebstrap $debian_suite (about 3 min, network-bound)"
    tmp=$(mktemp -d "$cache_dir/base.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --quiet --variant=minbase --include="$base_packages" --format=tar \
        "$debian_suite" "$tmp/rootfs.tar" "$debian_mirror"
    c=$(buildah_ from scratch)
    buildah_ add -q "$c" "$tmp/rootfs.tar" / >/dev/null
    buildah_ copy -q "$c" "$host_ca" "$host_ca" >/dev/null
    buildah_ config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$c"
    buildah_ commit -q --rm "$c" "$base_ref" >/dev/null
    save base "$base_ref" "$base_stamp"
    rm -rf "$tmp"
    trap - EXIT
    clog "base image: built in $(since "$t0") s"
fi

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
agent_inputs() {
    cd "$repo_root"
    echo "base $base_stamp"
    find Dockerfile .dockerignore pyproject.toml README.md requirements.lock requirements-build.lock agent \
        -type f ! -path '*/__pycache__/*' ! -name '*.pyc' 2>/dev/null | LC_ALL=C sort | xargs sha256sum
}
agent_stamp=$(agent_inputs | sha)
agent_ref=localhost/gpu-node-agent:${agent_stamp:0:12}
if current agent "$agent_stamp"; then
    clog "agent image: up to date ($agent_ref)"
else
    t0=$(date +%s.%N)
    clog "agent image: building $agent_ref from Dockerfile"
    # The base comes from buildah's storage; from its archive if the storage was cleared.
    buildah_ inspect --type image "$base_ref" >/dev/null 2>&1 ||
        buildah_ pull -q "oci-archive:$images/base.tar" >/dev/null
    buildah_ bud -q --network host --layers --build-arg "PYTHON_IMAGE=$base_ref" \
        -t "$agent_ref" -f "$repo_root/Dockerfile" "$repo_root" >/dev/null
    save agent "$agent_ref" "$agent_stamp"
    # Only the newest agent image is kept in buildah's storage (its layers stay as a build cache).
    buildah_ images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/gpu-node-agent:' |
        grep -vxF "$agent_ref" | xargs -r buildah_ rmi -f >/dev/null 2>&1 || true
    clog "agent image: built in $(since "$t0") s"
fi
