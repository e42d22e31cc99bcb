#!/usr/bin/env bash
# Builds the pinned Prometheus server and promtool that the metrics tests run
# (a real Prometheus scraping the agent, `promtool test rules`, `promtool check
# metrics`) from the Go module proxy into .cache/testbin/, with stamps: a
# binary whose stamp matches is not rebuilt.
#
# The pin lives in hack/testbin/prometheus/go.mod (with committed go.sum).
# Built with -tags remove_all_sd: the service-discovery plugins (cloud SDKs)
# are left out; the tests use static targets only.
#
# usage: hack/prometheus.sh [--print-versions] [prometheus|promtool...]
set -euo pipefail

# shellcheck source=hack/testbin/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/testbin/lib.sh"

mod=$repo_root/hack/testbin/prometheus
version=$(awk '$1 == "require" && $2 == "github.com/prometheus/prometheus" { print $3 }' "$mod/go.mod")
if [[ -z $version ]]; then
    log "cannot read the pinned Prometheus version from $mod/go.mod"
    exit 1
fi
# Module v0.316.0 is Prometheus 3.16.0.
release=${version#v0.}
release="3.${release:1}"
release=${release%%+*}
if [[ ${1:-} == --print-versions ]]; then
    printf 'prometheus %s (module %s)\npromtool %s (module %s)\n' "$release" "$version" "$release" "$version"
    exit 0
fi
wanted=("$@")
if ((${#wanted[@]} == 0)); then wanted=(prometheus promtool); fi
for name in "${wanted[@]}"; do
    if [[ $name != prometheus && $name != promtool ]]; then
        log "unknown binary '$name' (known: prometheus promtool)"
        exit 2
    fi
done

tags=remove_all_sd
ldflags="-s -w -X github.com/prometheus/common/version.Version=$release"
ldflags+=" -X github.com/prometheus/common/version.Branch=module-$version"

lock_testbin
for name in "${wanted[@]}"; do
    stamp=$(stamp_for "$name $version tags=$tags $ldflags" "$mod/go.mod" "$mod/go.sum" "$repo_root/hack/testbin/lib.sh")
    if is_current "$name" "$stamp"; then
        log "$name $release: up to date"
        continue
    fi
    log "$name $release: building"
    go_build_into "$mod" "$name" "$stamp" "github.com/prometheus/prometheus/cmd/$name" \
        -tags "$tags" -ldflags "$ldflags"
done
