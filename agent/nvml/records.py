"""The records the NVML boundary hands the rest of the agent: plain frozen data, no NVML, no I/O.

agent/nvml/ builds them from NVML calls (the real library or the fake); the pure core (NodeState, inventory,
labels, topology, health policy) and the outputs read them without loading pynvml.
"""

from __future__ import annotations

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
