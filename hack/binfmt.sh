#!/usr/bin/env bash
# Makes this machine run linux/arm64 programs under qemu, and undoes exactly that afterwards: the
# machine's binfmt_misc registrations are left as they were found.
#
#   hack/binfmt.sh on          installs qemu-user-static, binfmt-support and arch-test (which
#                              mmdebstrap needs for a foreign architecture) if missing
#                              (hack/cluster/packages.sh), mounts binfmt_misc if it is not mounted and
#                              enables the qemu-aarch64 interpreter if it is not enabled; prints what
#                              differs from the state it found before installing anything, as words
#                              for `off` (mounted, enabled; nothing if nothing)
#   hack/binfmt.sh off WORD... undoes what `on` printed: disables qemu-aarch64 (enabled), unmounts
#                              binfmt_misc (mounted)
#
# The interpreter is registered with the fix-binary flag (Debian's qemu-user-static does so), so an
# arm64 program runs in a chroot or a container that has no qemu of its own. Needs root.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
binfmt=/proc/sys/fs/binfmt_misc
entry=$binfmt/qemu-aarch64

usage() { echo "usage: hack/binfmt.sh on | off [mounted] [enabled]" >&2; exit 2; }
(($# >= 1)) || usage
if [[ $EUID != 0 ]]; then
    echo "binfmt: running arm64 programs under qemu needs root (binfmt_misc)" >&2
    exit 1
fi
case $1 in
    on)
        (($# == 1)) || usage
        # As found before anything is installed: installing qemu-user-static may itself register it.
        was_mounted=false was_enabled=false
        if mountpoint -q "$binfmt"; then
            was_mounted=true
            [[ -e $entry && $(head -n1 "$entry") == enabled ]] && was_enabled=true
        fi
        "$here/cluster/packages.sh" qemu-user-static binfmt-support arch-test
        changed=()
        mountpoint -q "$binfmt" || mount -t binfmt_misc binfmt_misc "$binfmt"
        $was_mounted || changed+=(mounted)
        if [[ ! -e $entry || $(head -n1 "$entry") != enabled ]]; then
            update-binfmts --enable qemu-aarch64
            [[ -e $entry && $(head -n1 "$entry") == enabled ]] ||
                { echo "binfmt: qemu-aarch64 is still not enabled after update-binfmts --enable" >&2; exit 1; }
        fi
        $was_enabled || changed+=(enabled)
        echo "${changed[*]}"
        ;;
    off)
        shift
        for word in "$@"; do [[ $word == mounted || $word == enabled ]] || usage; done
        if [[ " $* " == *" enabled "* && -e $entry ]]; then update-binfmts --disable qemu-aarch64; fi
        if [[ " $* " == *" mounted "* ]] && mountpoint -q "$binfmt"; then umount "$binfmt"; fi
        ;;
    *) usage ;;
esac
