# The Kubernetes minor release the rig and the cluster run, shared by
# hack/testbin.sh and hack/cluster/. Sourced, not executed; needs $repo_root.
#
# kube_release prints $KUBE (1.35, 1.36, 1.37; a leading v is allowed) or,
# without it, the newest release with pins in hack/testbin/kube/<release>/.
kube_release() {
    local releases want=${KUBE:-}
    releases=$(cd "$repo_root/hack/testbin/kube" && for d in */go.mod; do echo "${d%/go.mod}"; done | sort -V)
    want=${want#v}
    if [[ -z $want ]]; then
        tail -n1 <<<"$releases"
    elif grep -qxF -- "$want" <<<"$releases"; then
        echo "$want"
    else
        printf 'KUBE=%s: no such release here (known: %s)\n' "$KUBE" "$(echo $releases)" >&2
        return 1
    fi
}
