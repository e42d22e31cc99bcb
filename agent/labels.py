"""Pure: NodeState + config -> the node labels the agent owns (GPU feature discovery compatible, plus topology)."""

from __future__ import annotations

from collections import Counter

from agent.config import AgentConfig, ReplicatedResource
from agent.health.policy import LOST_REASON
from agent.inventory import GPU_RESOURCE, mig_resource, sanitise
from agent.nvml.records import GpuInfo, MigDeviceInfo, node_clique
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


GFD_VGA_CLASS = 0x030000
GFD_3D_CLASS = 0x030200
VIRTUALIZATION_VGPU = 2
"""NVML_GPU_VIRTUALIZATION_MODE_VGPU: the GPU is a vGPU in a guest."""


def _entry(config: AgentConfig, resource: str) -> ReplicatedResource | None:
    """The sharing entry GPU feature discovery reads for a resource: the first with its name."""
    return next((e for e in config.sharing.replicated.resources if e.name == resource), None)


def _resource_labels(config: AgentConfig, resource: str, parts: list[str], count: int,
                     with_sharing: bool = True) -> dict[str, str]:
    """product, count, replicas and sharing-strategy of one resource, as GPU feature discovery writes them:
    the product is the sanitised parts joined with '-', plus -SHARED when the resource is shared under its
    own name."""
    entry = _entry(config, resource) if with_sharing else None
    shared = entry is not None and entry.replicas > 1
    renamed = entry is not None and (entry.rename is not None or config.sharing.replicated.rename_by_default)
    product = "-".join(p for p in (sanitise(part) for part in parts) if p)
    if shared and not renamed:
        product += "-SHARED"
    replicas = (entry.replicas if entry is not None else 1) if with_sharing else 0
    return {
        f"{resource}.product": product[:63],
        f"{resource}.count": str(count),
        f"{resource}.replicas": str(replicas),
        f"{resource}.sharing-strategy": config.sharing.strategy if shared else "none",
    }


def _mig_attributes(resource: str, mig: MigDeviceInfo) -> dict[str, str]:
    return {
        f"{resource}.memory": str(mig.attribute_memory_mib),
        f"{resource}.multiprocessors": str(mig.multiprocessors),
        f"{resource}.slices.gi": str(mig.gi_slices),
        f"{resource}.slices.ci": str(mig.ci_slices),
        f"{resource}.engines.copy": str(mig.copy_engines),
        f"{resource}.engines.decoder": str(mig.decoders),
        f"{resource}.engines.encoder": str(mig.encoders),
        f"{resource}.engines.jpeg": str(mig.jpegs),
        f"{resource}.engines.ofa": str(mig.ofas),
    }


def _gpu_labels(state: NodeState, config: AgentConfig) -> dict[str, str]:
    """The nvidia.com/gpu.* labels of the whole GPUs: per model, MIG-enabled GPUs first without sharing, then
    the others with it, so a model with any whole GPU is labelled as shared or not by the config."""
    labels: dict[str, str] = {}
    unread = sum(g.unread for g in state.inventory.gpus)
    gpus = tuple(g for g in state.inventory.gpus if not g.unread)
    counts = Counter(g.name for g in gpus)
    if unread and len(counts) == 1:
        # A lost GPU nothing was ever read of, on a node of one model, is one more of it: the count is NVML's.
        counts[next(iter(counts))] += unread
    for mig_enabled in (True, False):
        for name in sorted({g.name for g in gpus if g.mig_enabled == mig_enabled}):
            first = next(g for g in gpus if g.name == name and g.mig_enabled == mig_enabled)
            labels.update(_resource_labels(config, GPU_RESOURCE, [name], counts[name], not mig_enabled))
            labels[f"{GPU_RESOURCE}.memory"] = str(first.memory_mib)
            if first.compute_capability[0]:
                labels[f"{GPU_RESOURCE}.family"] = family(*first.compute_capability)
                labels[f"{GPU_RESOURCE}.compute.major"] = str(first.compute_capability[0])
                labels[f"{GPU_RESOURCE}.compute.minor"] = str(first.compute_capability[1])
    return labels


def _mig_labels(state: NodeState, config: AgentConfig) -> dict[str, str]:
    """mig.strategy, and the MIG device labels GPU feature discovery writes for single and mixed."""
    strategy = config.flags.mig_strategy
    if strategy == "none":
        return {}
    labels: dict[str, str] = {"nvidia.com/mig.strategy": strategy}
    inv = state.inventory
    parents = {g.index: g for g in inv.gpus}
    by_profile: dict[str, list[MigDeviceInfo]] = {}
    for m in inv.mig_devices:
        by_profile.setdefault(m.profile, []).append(m)
    if strategy == "mixed":
        for profile, devices in sorted(by_profile.items()):
            resource = mig_resource(profile)
            model = parents[devices[0].parent_index].name
            labels.update(_resource_labels(config, resource, [model, "MIG", profile], len(devices)))
            labels.update(_mig_attributes(resource, devices[0]))
        return labels
    enabled = [g for g in inv.gpus if g.mig_enabled]
    if not enabled:
        return labels
    invalid = (any(not any(m.parent_index == g.index for m in inv.mig_devices) for g in enabled)
               or len(enabled) != len(inv.gpus) or len(by_profile) != 1)
    if invalid:
        labels.update({
            f"{GPU_RESOURCE}.product": "-".join(sanitise(p) for p in (enabled[0].name, "MIG", "INVALID")),
            f"{GPU_RESOURCE}.count": "0",
            f"{GPU_RESOURCE}.replicas": "0",
            f"{GPU_RESOURCE}.sharing-strategy": "",
            f"{GPU_RESOURCE}.memory": "0",
        })
        return labels
    ((profile, devices),) = by_profile.items()
    labels.update(_resource_labels(config, GPU_RESOURCE, [enabled[0].name, "MIG", profile], len(devices)))
    labels.update(_mig_attributes(GPU_RESOURCE, devices[0]))
    return labels


def _gpu_mode(gpus: tuple[GpuInfo, ...]) -> str:
    classes = {g.pci_class for g in gpus}
    if len(classes) != 1:
        return "unknown"
    return {GFD_VGA_CLASS: "graphics", GFD_3D_CLASS: "compute"}.get(classes.pop() or -1, "unknown")


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
    """Every label GPU feature discovery publishes for the node (same names and value formats, including the
    deprecated cuda.driver.* and cuda.runtime.*, and gpu.clique where the node's fabric-attached GPUs share one
    clique: `node_clique`), then the agent's own topology labels."""
    inv = state.inventory
    labels: dict[str, str] = {}
    driver = inv.driver.version.split(".")
    cuda_major, _, cuda_minor = inv.driver.cuda.partition(".")
    revision = driver[2] if len(driver) > 2 else ""
    labels["nvidia.com/cuda.driver.major"] = driver[0]
    labels["nvidia.com/cuda.driver.minor"] = driver[1] if len(driver) > 1 else ""
    labels["nvidia.com/cuda.driver.rev"] = revision
    labels["nvidia.com/cuda.driver-version.full"] = inv.driver.version
    labels["nvidia.com/cuda.driver-version.major"] = driver[0]
    labels["nvidia.com/cuda.driver-version.minor"] = driver[1] if len(driver) > 1 else ""
    labels["nvidia.com/cuda.driver-version.revision"] = revision
    labels["nvidia.com/cuda.runtime.major"] = cuda_major
    labels["nvidia.com/cuda.runtime.minor"] = cuda_minor or "0"
    labels["nvidia.com/cuda.runtime-version.full"] = f"{cuda_major}.{cuda_minor or '0'}"
    labels["nvidia.com/cuda.runtime-version.major"] = cuda_major
    labels["nvidia.com/cuda.runtime-version.minor"] = cuda_minor or "0"
    if state.labelled_at and not config.flags.gfd.no_timestamp:
        labels["nvidia.com/gfd.timestamp"] = str(state.labelled_at)
    labels["nvidia.com/vgpu.present"] = str(any(g.virtualization_mode == VIRTUALIZATION_VGPU
                                                for g in inv.gpus)).lower()
    if not inv.gpus:
        return labels
    labels["nvidia.com/gpu.machine"] = sanitise(state.machine) or "unknown"
    labels["nvidia.com/mig.capable"] = str(any(g.mig_capable for g in inv.gpus)).lower()
    mps = config.sharing.strategy == "mps"
    labels["nvidia.com/mps.capable"] = str(mps and not any(g.mig_enabled for g in inv.gpus)).lower()
    labels["nvidia.com/gpu.mode"] = _gpu_mode(inv.gpus)
    clique = node_clique(inv.gpus).value
    if clique is not None:
        labels["nvidia.com/gpu.clique"] = clique
    labels.update(_gpu_labels(state, config))
    labels.update(_mig_labels(state, config))
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
    lost = sum(g.lost or state.gpu_health(g.uuid).reason == LOST_REASON for g in inv.gpus)
    if lost:
        labels[OWN_PREFIX + "gpu.lost"] = str(lost)
    return labels


OWNED_NVIDIA_KEYS = frozenset(
    "nvidia.com/" + k
    for k in (
        "cuda.driver.major", "cuda.driver.minor", "cuda.driver.rev", "cuda.runtime.major", "cuda.runtime.minor",
        "cuda.driver-version.full", "cuda.driver-version.major", "cuda.driver-version.minor",
        "cuda.driver-version.revision", "cuda.runtime-version.full", "cuda.runtime-version.major",
        "cuda.runtime-version.minor", "gfd.timestamp", "vgpu.present", "gpu.machine", "gpu.mode", "gpu.count",
        "gpu.product", "gpu.memory", "gpu.family", "gpu.compute.major", "gpu.compute.minor", "gpu.replicas",
        "gpu.sharing-strategy", "gpu.multiprocessors", "gpu.slices.gi", "gpu.slices.ci", "gpu.engines.copy",
        "gpu.engines.decoder", "gpu.engines.encoder", "gpu.engines.jpeg", "gpu.engines.ofa", "mig.capable",
        "mps.capable", "mig.strategy", "mig.config.state", "gpu.clique",
    )
)


OWNED_OWN_KEYS = frozenset(OWN_PREFIX + k for k in ("numa.nodes", "numa.max-gpus", "nvlink.largest-group",
                                                    "nvlink.full-mesh", "gpu.lost"))
"""The agent's topology labels; any other key under gpu-node-agent.io/ belongs to whoever set it."""


def owned(key: str) -> bool:
    """Whether the agent owns a node label: it writes and removes these and never touches any other."""
    return key.startswith("nvidia.com/mig-") or key in OWNED_NVIDIA_KEYS or key in OWNED_OWN_KEYS
