# The Kubernetes minor release the rig and the cluster run, shared by
# hack/testbin.sh, hack/test.sh and hack/cluster/. Sourced, not executed; needs
# $repo_root. tests/releases.py picks the same way (tests/unit/test_releases.py
# checks that the two agree).
#
# Every release with pins in hack/testbin/kube/<release>/go.mod can be run with
# KUBE=<release>. Without KUBE, the default: the release hack/testbin/kube/default
# names, the newest whose pins are a GA release (no -alpha, -beta or -rc), so
# that pinning the next release's beta to try it changes no default; moving
# the default is the one line of that file, in the commit that moves the
# release's pins to its .0 (tests/README.md, "A new Kubernetes release").

# kube_releases prints every release with pins, oldest first (1.35, 1.36, ...).
kube_releases() {
    (cd "$repo_root/hack/testbin/kube" && for d in */go.mod; do echo "${d%/go.mod}"; done | sort -V)
}

# kube_default_release prints the release hack/testbin/kube/default names: its
# first line that is neither empty nor a comment.
kube_default_release() {
    local file=$repo_root/hack/testbin/kube/default release
    release=$(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$file" 2>/dev/null | head -n1 | tr -d '[:space:]')
    if [[ -z $release || ! -f $repo_root/hack/testbin/kube/$release/go.mod ]]; then
        printf '%s names no release with pins (known: %s)\n' "${file#"$repo_root"/}" "$(kube_releases | paste -sd ' ' -)" >&2
        return 1
    fi
    echo "$release"
}

# kube_oldest_release prints the oldest release with pins: the oldest that
# upstream still patches, on which make test runs the tests marked matrix too.
kube_oldest_release() {
    kube_releases | head -n1
}

# kube_release prints $KUBE (1.35, 1.36, 1.37, 1.38; a leading v is allowed)
# or, without it, the default release.
kube_release() {
    local releases want=${KUBE:-}
    releases=$(kube_releases)
    want=${want#v}
    if [[ -z $want ]]; then
        kube_default_release
    elif grep -qxF -- "$want" <<<"$releases"; then
        echo "$want"
    else
        printf 'KUBE=%s: no such release here (known: %s)\n' "$KUBE" "$(paste -sd ' ' - <<<"$releases")" >&2
        return 1
    fi
}
