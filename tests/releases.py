"""What a Kubernetes release does by default, where the agent's behaviour or a test's expectation depends on it
(docs/reference/kubernetes-releases.md, from each release's pkg/features/kube_features.go). Tests ask the server
its release (ApiServer.release(), from /version) and look it up here rather than assume one."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KUBE_PINS = REPO / "hack" / "testbin" / "kube"


def releases() -> list[str]:
    """Every release with pins in hack/testbin/kube/<release>/go.mod, oldest first."""
    pinned = (p.parent.name for p in KUBE_PINS.glob("*/go.mod"))
    return sorted(pinned, key=lambda r: tuple(int(x) for x in r.split(".")))


def default_release() -> str:
    """The release run without KUBE: the one hack/testbin/kube/default names (its first line that is neither empty
    nor a comment), the newest GA release pinned (tests/unit/test_releases.py checks that it is)."""
    lines = [line.strip() for line in (KUBE_PINS / "default").read_text().splitlines()]
    named = next((line for line in lines if line and not line.startswith("#")), "")
    if named not in releases():
        raise RuntimeError(f"hack/testbin/kube/default names no release with pins (known: {' '.join(releases())})")
    return named


def pinned_kubernetes(release: str) -> str:
    """The k8s.io/kubernetes version hack/testbin/kube/<release>/go.mod requires, e.g. "v1.37.2"."""
    for line in (KUBE_PINS / release / "go.mod").read_text().splitlines():
        words = line.split()
        if words[:2] == ["require", "k8s.io/kubernetes"]:
            return words[2]
        if words[:1] == ["k8s.io/kubernetes"] and len(words) > 1 and words[1].startswith("v"):
            return words[1]
    raise RuntimeError(f"hack/testbin/kube/{release}/go.mod requires no k8s.io/kubernetes")


def kube_release() -> str:
    """The Kubernetes minor release the rig and the cluster run, as hack/testbin/release.sh picks it: $KUBE (e.g.
    "1.35") or, without it, the default release."""
    want = os.environ.get("KUBE", "").removeprefix("v")
    if not want:
        return default_release()
    if want not in releases():
        raise RuntimeError(f"KUBE={want}: no such release here (known: {' '.join(releases())})")
    return want


def kube_bin(testbin: Path | None = None) -> Path:
    """Where hack/testbin.sh puts that release's binaries."""
    root = testbin or Path(os.environ.get("TESTBIN_DIR", REPO / ".cache" / "testbin"))
    return root / f"kube-{kube_release()}"


DEFAULT_ON_FROM: dict[str, tuple[int, int]] = {
    "DRADeviceTaints": (1, 36),  # beta on in 1.36, GA (not locked) in 1.37, locked on in 1.38
    "DRAPartitionableDevices": (1, 36),  # beta on in 1.36 and 1.37, GA and locked on in 1.38
    "DRAConsumableCapacity": (1, 36),  # beta on in 1.36 and 1.37, GA (not locked) in 1.38; locked on from 1.39
    "DRAExtendedResource": (1, 36),  # beta on in 1.36, GA and locked on in 1.37
    "DRADeviceTaintRules": (1, 37),  # beta off in 1.36, GA in 1.37, locked on in 1.38
    "DRADeviceBindingConditions": (1, 36),  # beta on in 1.36 and 1.37, GA and locked on in 1.38
    "ResourceHealthStatus": (1, 36),  # beta on from 1.36 (still beta in 1.38)
}
"""The first release whose API server (and scheduler, kubelet) has the gate on without being asked."""

LOCKED_ON_FROM: dict[str, tuple[int, int]] = {
    "DRAExtendedResource": (1, 37),
    "DRADeviceTaints": (1, 38),
    "DRADeviceTaintRules": (1, 38),
    "DRAPartitionableDevices": (1, 38),
    "DRADeviceBindingConditions": (1, 38),
}
"""The first release in which the gate cannot be turned off (`--feature-gates=X=false` is refused: "cannot set
feature gate X to false, feature is locked to true"), from LockToDefault in the release's versioned spec of
pkg/features/kube_features.go. Such a release takes the gate off only when it emulates an earlier one
(`emulation_to_turn_off`)."""

EMULATION_RANGE = 3
"""How many minor releases back a component emulates (`--emulated-version`, from binary - 3 to the binary;
apiserver@v0.38.0-beta.0:pkg/util/compatibility/version.go, kubeEffectiveVersionFloors), never before 1.31."""

SPLIT_COUNTERS_FROM = (1, 35)
"""The first release whose API server takes shared counters only in a ResourceSlice without devices."""


def on_by_default(gate: str, release: tuple[int, int]) -> bool:
    return release >= DEFAULT_ON_FROM[gate]


def can_turn_off(gate: str, release: tuple[int, int]) -> bool:
    return gate not in LOCKED_ON_FROM or release < LOCKED_ON_FROM[gate]


def gates_turned_off(feature_gates: str) -> list[str]:
    """The gates a `--feature-gates` value turns off: "A=false,B=true" -> ["A"]."""
    pairs = [item.split("=", 1) for item in feature_gates.split(",") if item.strip()]
    return [gate.strip() for gate, value in pairs if value.strip().lower() == "false"]


def emulation_to_turn_off(feature_gates: str, release: tuple[int, int]) -> tuple[int, int] | None:
    """The release a component of `release` must emulate (`--emulated-version=<major.minor>`) to take the gates
    `feature_gates` turns off: None where `release` takes them off as it is; else the last release before the
    first of their locks, where each could still be turned off (1.37 for DRADeviceTaints=false on 1.38). The
    fallback a test checks that way is the one a user of that release gets by emulating it."""
    locked = [LOCKED_ON_FROM[gate] for gate in gates_turned_off(feature_gates) if not can_turn_off(gate, release)]
    if not locked:
        return None
    first = min(locked)
    emulated = (first[0], first[1] - 1)
    floor = max((release[0], release[1] - EMULATION_RANGE), (1, 31))
    if emulated < floor:
        raise ValueError(f"{feature_gates}: Kubernetes {release_name(release)} emulates releases back to "
                         f"{release_name(floor)} only, and the gates are locked on from {release_name(first)}")
    return emulated


def release_name(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}"
