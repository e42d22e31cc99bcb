"""The records the NVML boundary hands the rest of the agent: plain frozen data, no NVML, no I/O.

agent/nvml/ builds them from NVML calls (the real library or the fake); the pure core (NodeState, inventory,
labels, topology, health policy) and the outputs read them without loading pynvml.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass


def short_bus_id(bus_id: str) -> str:
    """NVML's bus id with its 8-digit domain ("00000000:18:00.0") in the 4-digit form sysfs and
    resource.kubernetes.io/pciBusID use ("0000:18:00.0"), lower case."""
    bdf = bus_id.lower()
    domain, sep, rest = bdf.partition(":")
    if sep and len(domain) == 8:
        bdf = domain[4:] + ":" + rest
    return bdf


@dataclass(frozen=True)
class DriverInfo:
    version: str
    cuda: str
    """CUDA driver API version as major.minor, e.g. "12.8"."""


FABRIC_STATES = ("not-supported", "not-started", "in-progress", "completed")
"""NVML_GPU_FABRIC_STATE_* 0..3 by name: where the GPU is in registering with the NVLink fabric."""
ZERO_CLUSTER = str(uuidlib.UUID(int=0))


@dataclass(frozen=True)
class FabricInfo:
    """What nvmlDeviceGetGpuFabricInfoV says of a GPU's place in a multi-node NVLink fabric (GB200/GB300 NVL72)."""

    cluster_uuid: str
    """The fabric's cluster UUID, the 16 bytes of clusterUuid in the standard UUID form."""
    clique_id: int
    state: str
    """One of FABRIC_STATES."""
    status: int
    """The NVML return code of the registration (0, NVML_SUCCESS, once it completed without error)."""

    @property
    def attached(self) -> bool:
        """Attached to the fabric as NVIDIA's go-nvlib tells it (IsFabricAttached): registration completed,
        without error, into a cluster with a non-zero UUID (NVLink systems without a multi-node fabric report
        the zero UUID)."""
        return self.state == "completed" and self.status == 0 and self.cluster_uuid != ZERO_CLUSTER

    @property
    def clique(self) -> str:
        """<cluster UUID>.<clique ID>, the form of GPU feature discovery's nvidia.com/gpu.clique."""
        return f"{self.cluster_uuid}.{self.clique_id}"


@dataclass(frozen=True)
class NodeClique:
    """The node's one fabric clique (`value`), or why it has none that it can label (`problem`, a warning)."""

    value: str | None = None
    problem: str | None = None


def node_clique(gpus: tuple[GpuInfo, ...]) -> NodeClique:
    """The clique of the node's fabric-attached GPUs as GPU feature discovery decides it: none when no GPU is
    attached; when they do not all share one cluster UUID, or one clique ID, none and a problem naming the
    GPUs (by index) of each."""
    attached = [(g.index, g.fabric) for g in gpus if g.fabric is not None and g.fabric.attached]
    if not attached:
        return NodeClique()
    clusters: dict[str, list[int]] = {}
    cliques: dict[str, list[int]] = {}
    for index, fabric in attached:
        clusters.setdefault(fabric.cluster_uuid, []).append(index)
        cliques.setdefault(str(fabric.clique_id), []).append(index)
    for what, owners in (("cluster UUIDs", clusters), ("clique IDs", cliques)):
        if len(owners) > 1:
            listed = "; ".join(f"{value}: GPU {', '.join(map(str, idx))}" for value, idx in owners.items())
            return NodeClique(problem=f"the fabric-attached GPUs have {len(owners)} {what} ({listed}), not one; "
                                      "the node has no clique")
    return NodeClique(value=attached[0][1].clique)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int
    memory_mib: int
    architecture: str
    compute_capability: tuple[int, int]
    numa_node: int | None
    mig_capable: bool
    mig_enabled: bool
    mig_pending: bool
    pci_class: int | None = None
    """The PCI class code (0x030200 a 3D controller, a GPU in compute mode; 0x030000 VGA, display mode)."""
    virtualization_mode: int = 0
    """NVML_GPU_VIRTUALIZATION_MODE_*: 0 bare metal, 1 passthrough, 2 a vGPU in a guest."""
    brand: int | None = None
    """nvmlDeviceGetBrand, an NVML_BRAND_* value (14 NVIDIA for data-centre GPUs); None where NVML does not say."""
    fabric: FabricInfo | None = None
    """nvmlDeviceGetGpuFabricInfoV; None where the GPU or the driver does not support it."""
    lost: bool = False
    """NVML counts the GPU but will not give its handle, or fails the calls the inventory needs (GPU_IS_LOST or
    another error). Its other fields are what was last read of it (in this process or, through the state
    directory's gpus.json, by an earlier agent), else placeholders (`unknown_gpu`); it is never served healthy."""

    @property
    def unread(self) -> bool:
        """A lost GPU of which nothing was ever read (`unknown_gpu`): all but its index are placeholders."""
        return self.lost and self.uuid.startswith(UNREAD_PREFIX)


UNREAD_PREFIX = "GPU-lost-nvml-"


def unknown_gpu(index: int) -> GpuInfo:
    """A lost GPU of which nothing is known but its NVML index: a UUID made from the index, so that it can be
    named and kept apart from its neighbours until it answers again."""
    return GpuInfo(index=index, uuid=f"{UNREAD_PREFIX}{index}", name="unknown", pci_bus_id="", minor=index,
                   memory_mib=0, architecture="unknown", compute_capability=(0, 0), numa_node=None,
                   mig_capable=False, mig_enabled=False, mig_pending=False, lost=True)


@dataclass(frozen=True)
class MigDeviceInfo:
    uuid: str
    parent_index: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    """GPU-instance profile name as NVML reports it, without the "MIG " prefix, e.g. "1g.10gb"."""
    memory_mib: int
    placement_start: int
    placement_size: int
    multiprocessors: int = 0
    gi_slices: int = 0
    ci_slices: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpegs: int = 0
    ofas: int = 0
    attribute_memory_mib: int = 0
    """nvmlDeviceGetAttributes: what GPU feature discovery labels a MIG profile with."""


@dataclass(frozen=True)
class PairLink:
    a: int
    b: int
    nvlink: int
    pcie: str


@dataclass(frozen=True)
class NodeInventory:
    """Everything about the node's GPUs that changes only when devices change."""

    driver: DriverInfo
    gpus: tuple[GpuInfo, ...]
    links: tuple[PairLink, ...]
    mig_devices: tuple[MigDeviceInfo, ...] = ()
    imex_channels: tuple[int, ...] = ()
    """The IMEX channels whose device nodes exist (/dev/nvidia-caps-imex-channels/channel<N>), in order."""


@dataclass(frozen=True)
class HealthReading:
    """One periodic sample of a GPU's health signals; None where the GPU does not support the query."""

    uuid: str
    lost: bool = False
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    clock_event_reasons: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    memory_used_mib: int | None = None
    utilization_pct: int | None = None
    unreadable: str | None = None
    """Set when NVML failed the sample for a reason that says nothing about the GPU (e.g. NVML_ERROR_UNKNOWN)."""


@dataclass(frozen=True)
class XidEvent:
    gpu_uuid: str
    xid: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
