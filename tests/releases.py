"""What a Kubernetes release does by default, where the agent's behaviour or a test's expectation depends on it
(docs/reference/kubernetes-releases.md, from each release's pkg/features/kube_features.go). Tests ask the server
its release (ApiServer.release(), from /version) and look it up here rather than assume one."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kube_release() -> str:
    """The Kubernetes minor release the rig and the cluster run, as hack/testbin/release.sh picks it: $KUBE (e.g.
    "1.35") or, without it, the newest release pinned under hack/testbin/kube/."""
    releases = sorted(
        (p.parent.name for p in (REPO / "hack" / "testbin" / "kube").glob("*/go.mod")),
        key=lambda r: tuple(int(x) for x in r.split(".")),
    )
    want = os.environ.get("KUBE", "").removeprefix("v")
    if not want:
        return releases[-1]
    if want not in releases:
        raise RuntimeError(f"KUBE={want}: no such release here (known: {' '.join(releases)})")
    return want


def kube_bin(testbin: Path | None = None) -> Path:
    """Where hack/testbin.sh puts that release's binaries."""
    root = testbin or Path(os.environ.get("TESTBIN_DIR", REPO / ".cache" / "testbin"))
    return root / f"kube-{kube_release()}"

DEFAULT_ON_FROM: dict[str, tuple[int, int]] = {
    "DRADeviceTaints": (1, 36),  # beta on in 1.36, GA (not locked) in 1.37
    "DRAPartitionableDevices": (1, 36),  # beta on in 1.36 and 1.37
    "DRAConsumableCapacity": (1, 36),
    "DRAExtendedResource": (1, 36),  # beta on in 1.36, GA and locked on in 1.37
    "DRADeviceTaintRules": (1, 37),  # beta off in 1.36, GA in 1.37
    "ResourceHealthStatus": (1, 36),
}
"""The first release whose API server (and scheduler, kubelet) has the gate on without being asked."""

LOCKED_ON_FROM: dict[str, tuple[int, int]] = {"DRAExtendedResource": (1, 37)}
"""The first release in which the gate cannot be turned off (`--feature-gates=X=false` is refused)."""

SPLIT_COUNTERS_FROM = (1, 35)
"""The first release whose API server takes shared counters only in a ResourceSlice without devices."""


def on_by_default(gate: str, release: tuple[int, int]) -> bool:
    return release >= DEFAULT_ON_FROM[gate]


def can_turn_off(gate: str, release: tuple[int, int]) -> bool:
    return gate not in LOCKED_ON_FROM or release < LOCKED_ON_FROM[gate]


def release_name(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}"
