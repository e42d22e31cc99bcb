#!/usr/bin/env bash
# Builds the kubelet conformance harness (tests/kubelet/harness) and its
# stand-in plugin (tests/kubelet/stubplugin) into .cache/testbin/. They compile
# the kubelet's device manager from k8s.io/kubernetes, pinned in
# tests/kubelet/go.mod; with the kube-apiserver build cache warm this takes
# under a minute, and nothing when the sources have not changed.
#
# With --link-into DIR it also puts the two binaries in DIR (hard links, or
# copies across file systems) before it lets go of the build lock, so a caller
# keeps exactly what it built even if another tree sharing .cache/testbin
# rebuilds them from other sources.
#
# usage: hack/kubelet-harness.sh [--link-into DIR]
set -euo pipefail

link_into=
case $# in
0) ;;
2) [[ $1 == --link-into && -n $2 ]] || { echo "usage: $0 [--link-into DIR]" >&2; exit 2; }
   link_into=$2 ;;
*) echo "usage: $0 [--link-into DIR]" >&2; exit 2 ;;
esac

# shellcheck source=hack/testbin/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/testbin/lib.sh"

module=$repo_root/tests/kubelet
t_all=$(date +%s.%N)
lock_testbin

# Every Go source and the module files; sorted so the stamp is stable. Then a
# module kept in the repository that go.mod replaces one with, if any (as
# hack/testbin/kube/1.38 does iptables-wrappers). The Go it builds with is the
# one its go.mod names, as for the rig (lib.sh, module_toolchain).
mapfile -t sources < <(cd "$module" && find . -name '*.go' -o -name go.mod -o -name go.sum | LC_ALL=C sort)
mapfile -t replaced < <(module_files "$module" | tail -n +3)
stamp=$(stamp_for "kubelet-harness ${sources[*]}" "$repo_root/hack/testbin/lib.sh" "${sources[@]/#/$module/}" \
    "${replaced[@]}")

for name in kubelet-harness kubelet-stubplugin; do
    pkg=./${name#kubelet-}
    if is_current "$name" "$stamp"; then
        log "$name: up to date"
    else
        log "$name: building"
        go_build_into "$module" "$name" "$stamp" "$pkg"
    fi
done

if [[ -n $link_into ]]; then
    mkdir -p "$link_into"
    for name in kubelet-harness kubelet-stubplugin; do
        ln -f "$testbin_dir/$name" "$link_into/$name" 2>/dev/null || cp -f "$testbin_dir/$name" "$link_into/$name"
    done
fi

log "ready in $(elapsed "$t_all") s: $testbin_dir/{kubelet-harness,kubelet-stubplugin}"
