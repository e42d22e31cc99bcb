"""Pure: NodeState + config -> the node labels the agent owns (GPU feature discovery compatible, plus topology)."""

from __future__ import annotations

import re

from agent.config import AgentConfig
from agent.state import NodeState

OWN_PREFIX = "gpu-node-agent.io/"

_FAMILIES = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell",
             12: "blackwell", 13: "rubin"}


def family(major: int, minor: int) -> str:
    """GPU family as GPU feature discovery names it, from the compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ada-lovelace" if minor == 9 else "ampere"
    return _FAMILIES.get(major, "undefined")


def sanitise(value: str) -> str:
    """A label value: runs of characters outside [A-Za-z0-9_.-] become '-', at most 63 characters."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", value.strip()).strip("-_.")
    return cleaned[:63].rstrip("-_.")


def _nvlink_groups(state: NodeState) -> list[set[int]]:
    """GPUs connected to each other through NVLink, as connected components."""
    n = len(state.inventory.gpus)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for link in state.inventory.links:
        if link.nvlink:
            parent[root(link.a)] = root(link.b)
    groups: dict[int, set[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), set()).add(i)
    return list(groups.values())


def node_labels(state: NodeState, config: AgentConfig) -> dict[str, str]:
    inv = state.inventory
    labels: dict[str, str] = {}
    driver = inv.driver.version.split(".")
    cuda_major, _, cuda_minor = inv.driver.cuda.partition(".")
    labels["nvidia.com/cuda.driver-version.full"] = inv.driver.version
    labels["nvidia.com/cuda.driver-version.major"] = driver[0]
    labels["nvidia.com/cuda.driver-version.minor"] = driver[1] if len(driver) > 1 else "0"
    labels["nvidia.com/cuda.driver-version.revision"] = driver[2] if len(driver) > 2 else "0"
    labels["nvidia.com/cuda.runtime-version.full"] = inv.driver.cuda
    labels["nvidia.com/cuda.runtime-version.major"] = cuda_major
    labels["nvidia.com/cuda.runtime-version.minor"] = cuda_minor or "0"
    if not inv.gpus:
        return labels
    first = inv.gpus[0]
    labels["nvidia.com/gpu.count"] = str(len(inv.gpus))
    labels["nvidia.com/gpu.product"] = sanitise(first.name)
    labels["nvidia.com/gpu.memory"] = str(first.memory_mib)
    labels["nvidia.com/gpu.family"] = family(*first.compute_capability)
    labels["nvidia.com/gpu.compute.major"] = str(first.compute_capability[0])
    labels["nvidia.com/gpu.compute.minor"] = str(first.compute_capability[1])
    labels["nvidia.com/gpu.replicas"] = "1"
    labels["nvidia.com/gpu.sharing-strategy"] = "none"
    labels["nvidia.com/mig.capable"] = str(any(g.mig_capable for g in inv.gpus)).lower()
    numa = [g.numa_node for g in inv.gpus]
    per_numa: dict[int | None, int] = {}
    for node in numa:
        per_numa[node] = per_numa.get(node, 0) + 1
    labels[OWN_PREFIX + "numa.nodes"] = str(len([k for k in per_numa if k is not None]))
    labels[OWN_PREFIX + "numa.max-gpus"] = str(max(per_numa.values()))
    groups = _nvlink_groups(state)
    labels[OWN_PREFIX + "nvlink.largest-group"] = str(max((len(g) for g in groups if len(g) > 1), default=0))
    full_mesh = all(link.nvlink for link in inv.links) and len(inv.gpus) > 1
    labels[OWN_PREFIX + "nvlink.full-mesh"] = str(full_mesh).lower()
    return labels


OWNED_NVIDIA_KEYS = frozenset(
    "nvidia.com/" + k
    for k in (
        "cuda.driver-version.full", "cuda.driver-version.major", "cuda.driver-version.minor",
        "cuda.driver-version.revision", "cuda.runtime-version.full", "cuda.runtime-version.major",
        "cuda.runtime-version.minor", "gpu.count", "gpu.product", "gpu.memory", "gpu.family",
        "gpu.compute.major", "gpu.compute.minor", "gpu.replicas", "gpu.sharing-strategy", "mig.capable",
    )
)


def owned(key: str) -> bool:
    """Whether the agent owns a node label: it writes and removes these and never touches any other."""
    return key.startswith(OWN_PREFIX) or key in OWNED_NVIDIA_KEYS
