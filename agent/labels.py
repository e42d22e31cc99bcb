"""Pure: NodeState + config -> the node labels the agent owns (GPU feature discovery compatible, plus topology)."""

from __future__ import annotations

from agent.config import AgentConfig
from agent.inventory import GPU_RESOURCE, Resource, mig_resource, plan, replicas_for, sanitise
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


def _mig_labels(state: NodeState, config: AgentConfig, product: str) -> dict[str, str]:
    """mig.strategy, and per-profile labels as GPU feature discovery writes them for single and mixed."""
    strategy = config.flags.mig_strategy
    if strategy == "none":
        return {}
    labels: dict[str, str] = {"nvidia.com/mig.strategy": strategy}
    gpus = {g.index: g for g in state.inventory.gpus}
    resources = plan(state, config).resources
    for profile in sorted({m.profile for m in state.inventory.mig_devices}):
        devices = [m for m in state.inventory.mig_devices if m.profile == profile]
        memory = str(devices[0].memory_mib)
        if strategy == "single":
            advertised = [d for d in resources.get(GPU_RESOURCE, Resource(GPU_RESOURCE, ())).devices
                          if d.kind == "mig"]
            if advertised:
                labels["nvidia.com/gpu.product"] = f"{product}-MIG-{profile}"
                labels["nvidia.com/gpu.count"] = str(len({d.id.split("::")[0] for d in advertised}))
                labels["nvidia.com/gpu.memory"] = memory
            continue
        prefix = mig_resource(profile)
        labels[f"{prefix}.count"] = str(len(devices))
        labels[f"{prefix}.memory"] = memory
        labels[f"{prefix}.product"] = f"{product}-MIG-{profile}"
        labels[f"{prefix}.replicas"] = str(replicas_for(config, prefix, gpus[devices[0].parent_index]))
    return labels


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
    product = sanitise(first.name)
    slicing = config.sharing.time_slicing
    shared = any(e.name == GPU_RESOURCE for e in slicing.resources)
    renamed = slicing.rename_by_default or any(e.name == GPU_RESOURCE and e.rename for e in slicing.resources)
    labels["nvidia.com/gpu.count"] = str(len(inv.gpus))
    labels["nvidia.com/gpu.product"] = product + ("-SHARED" if shared and not renamed else "")
    labels["nvidia.com/gpu.memory"] = str(first.memory_mib)
    labels["nvidia.com/gpu.family"] = family(*first.compute_capability)
    labels["nvidia.com/gpu.compute.major"] = str(first.compute_capability[0])
    labels["nvidia.com/gpu.compute.minor"] = str(first.compute_capability[1])
    labels["nvidia.com/gpu.replicas"] = str(replicas_for(config, GPU_RESOURCE, first))
    labels["nvidia.com/gpu.sharing-strategy"] = "time-slicing" if shared else "none"
    labels["nvidia.com/mig.capable"] = str(any(g.mig_capable for g in inv.gpus)).lower()
    labels.update(_mig_labels(state, config, product))
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
        "mig.strategy", "mig.config.state",
    )
)


def owned(key: str) -> bool:
    """Whether the agent owns a node label: it writes and removes these and never touches any other."""
    return key.startswith((OWN_PREFIX, "nvidia.com/mig-")) or key in OWNED_NVIDIA_KEYS
