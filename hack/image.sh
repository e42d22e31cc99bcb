#!/usr/bin/env bash
# The agent's image for linux/amd64 and linux/arm64, built from the unchanged Dockerfile as one OCI image
# index (`make image`): .cache/cluster/images/agent-index.tar, an OCI archive whose index.json names the
# index, beside the cluster's images (hack/cluster/images.sh --multiarch builds them all; agent.tar, the
# amd64 image the cluster runs, is the index's linux/amd64 image). Each image is rebuilt only when its
# inputs change, so a warm run builds nothing.
#
# The arm64 half is built under qemu: hack/binfmt.sh enables it for the build and, on the way out,
# restores the machine's binfmt_misc registrations as they were. Needs root.
#
# usage: hack/image.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
(($# == 0)) || { echo "usage: hack/image.sh" >&2; exit 2; }
"$here/cluster/packages.sh"
changed=$("$here/binfmt.sh" on)
# shellcheck disable=SC2086  # the words `on` printed
trap '"$here/binfmt.sh" off $changed' EXIT
"$here/cluster/images.sh" --multiarch
