#!/usr/bin/env bash
# Installs the Debian packages the single-node cluster needs, only those that
# are missing: runc (the container runtime; containerd itself is built by
# hack/cluster/containerd.sh) and containerd (for its ctr client), buildah and
# mmdebstrap (the images, with no registry), the CNI plugins, iptables,
# busybox-static (the test pods' shell), openssl, curl and gcc (the pause
# binary). Nothing is installed when everything is there. Given package names, it
# installs those instead, the same way (hack/image.sh: qemu-user-static and
# binfmt-support for the arm64 image).
#
# usage: hack/cluster/packages.sh [PACKAGE...]
set -euo pipefail

packages=(containerd runc buildah mmdebstrap containernetworking-plugins iptables busybox-static
          openssl curl gcc libc6-dev iproute2 util-linux)
(($# == 0)) || packages=("$@")
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f '${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
    echo "packages: all installed" >&2
    exit 0
fi
if [[ $EUID != 0 ]]; then
    echo "packages: missing ${missing[*]}; run as root to install them" >&2
    exit 1
fi
echo "packages: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
