"""GPU models and their MIG profile tables, as NVML reports them (facts and sources: docs/reference/mig-profiles.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

MIB = 1024 * 1024

# nvml.h's values for the enums the tables use, written out so that the MIG planner and the DRA slices read
# the tables without loading pynvml (tests/unit/test_boundaries.py holds them to pynvml's).
NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0
NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 1
NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 2
NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 3
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 4
NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 7
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 9
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 4
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_TURING = 6


class Placement(NamedTuple):
    """Where a GPU instance sits, in memory slices (NVML ``nvmlGpuInstancePlacement_t``)."""

    start: int
    size: int


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU model.

    ``index`` is the ``NVML_GPU_INSTANCE_PROFILE_*`` constant passed to ``...GetGpuInstanceProfileInfo``;
    ``id`` is the ``info.id`` NVML returns, which every later call takes (docs/reference/mig-profiles.md,
    "Profile index and profile id").
    ``slice_count`` counts compute slices (the G in ``<G>g``); placement sizes count memory slices.
    """

    name: str
    index: int
    id: int
    slice_count: int
    instance_count: int
    memory_size_mib: int
    multiprocessor_count: int
    placements: tuple[Placement, ...]
    ci_profile_index: int
    ci_profile_id: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int

    @property
    def memory_slices(self) -> int:
        return self.placements[0].size


@dataclass(frozen=True)
class GpuModel:
    """A GPU model as NVML describes it. An empty ``mig_profiles`` means the model is not MIG capable;
    ``multiprocessor_count`` is the whole GPU's SM count with MIG disabled."""

    key: str
    nvml_name: str
    memory_mib: int
    architecture: int
    arch_name: str
    compute_capability: tuple[int, int]
    family: str
    nvlink_links: int
    mig_profiles: tuple[MigProfile, ...]
    pci_device_id: int
    multiprocessor_count: int

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def profile_by_index(self, index: int) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.index == index), None)

    def profile_by_id(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.id == profile_id), None)

    def profile_by_name(self, name: str) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.name == name), None)


class UnknownGpuModel(KeyError):
    """Raised by :func:`lookup` for a key that is not in the catalog."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"unknown GPU model {self.key!r} (known: {', '.join(MODELS)})"


def profile_memory_gb(memory_size_mib: int, total_memory_bytes: int) -> int:
    """The ``<GB>`` of a profile name, by go-nvlib's rounding rule (docs/reference/mig-profiles.md, "Profile names").

    Rounds half away from zero: built-in ``round`` would turn 70.5 into 70.
    """
    eighths = math.ceil(8 * memory_size_mib * MIB / total_memory_bytes)
    total_gib = math.ceil(total_memory_bytes / (1024 * MIB))
    return math.floor(eighths / 8 * total_gib + 0.5)


def _placements(starts: tuple[int, ...], size: int) -> tuple[Placement, ...]:
    return tuple(Placement(start, size) for start in starts)


_ONE = _placements((0, 1, 2, 3, 4, 5, 6), 1)
_ONE_DOUBLE = _placements((0, 2, 4, 6), 2)
_TWO = _placements((0, 2, 4), 2)
_THREE = _placements((0, 4), 4)
_FOUR = _placements((0,), 4)
_SEVEN = _placements((0,), 8)

_CI_1 = (NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
_CI_2 = (NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, 1)
_CI_3 = (NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 2)
_CI_4 = (NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 3)
_CI_7 = (NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, 4)

# (index constant, id, G, max instances, placements, CI profile (index, id)) for the full-size MIG GPUs.
# Ids and placements are the same on A100, H100 and H200 (docs/reference/mig-profiles.md).
_SHAPES: dict[str, tuple[int, int, int, int, tuple[Placement, ...], tuple[int, int]]] = {
    "1g": (NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, 1, 7, _ONE, _CI_1),
    "1g+me": (NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1, 1, _ONE, _CI_1),
    "1g-double": (NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 1, 4, _ONE_DOUBLE, _CI_1),
    "2g": (NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, 2, 3, _TWO, _CI_2),
    "3g": (NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, 3, 2, _THREE, _CI_3),
    "4g": (NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, 4, 1, _FOUR, _CI_4),
    "7g": (NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, 7, 1, _SEVEN, _CI_7),
}


def _profile(
    shape: str,
    name: str,
    memory_mib: int,
    sms: int,
    engines: tuple[int, int, int, int, int],
) -> MigProfile:
    index, profile_id, g, count, placements, (ci_index, ci_id) = _SHAPES[shape]
    copy, dec, enc, jpeg, ofa = engines
    return MigProfile(
        name=name,
        index=index,
        id=profile_id,
        slice_count=g,
        instance_count=count,
        memory_size_mib=memory_mib,
        multiprocessor_count=sms,
        placements=placements,
        ci_profile_index=ci_index,
        ci_profile_id=ci_id,
        copy_engines=copy,
        decoders=dec,
        encoders=enc,
        jpegs=jpeg,
        ofas=ofa,
    )


# Engine counts (copy, decoder, encoder, jpeg, ofa). A100: the MIG user guide's A100 table and the
# `nvidia-smi mig -lgip` capture quoted in harvester/harvester#9093. Hopper: the H200 capture in
# NVIDIA/mig-parted#120 (GH100 pattern, so H100 shares it); copy engines there equal G.
_A100_ENGINES = {
    "1g": (1, 0, 0, 0, 0),
    "1g+me": (1, 1, 0, 1, 1),
    "1g-double": (1, 1, 0, 0, 0),
    "2g": (2, 1, 0, 0, 0),
    "3g": (3, 2, 0, 0, 0),
    "4g": (4, 2, 0, 0, 0),
    "7g": (7, 5, 0, 1, 1),
}
_HOPPER_ENGINES = {
    "1g": (1, 1, 0, 1, 0),
    "1g+me": (1, 1, 0, 1, 1),
    "1g-double": (1, 1, 0, 1, 0),
    "2g": (2, 2, 0, 2, 0),
    "3g": (3, 3, 0, 3, 0),
    "4g": (4, 4, 0, 4, 0),
    "7g": (7, 7, 0, 7, 1),
}
_A100_SMS = {"1g": 14, "1g+me": 14, "1g-double": 14, "2g": 28, "3g": 42, "4g": 56, "7g": 98}
_HOPPER_SMS = {"1g": 16, "1g+me": 16, "1g-double": 26, "2g": 32, "3g": 60, "4g": 64, "7g": 132}


def _table(
    names_and_memory: dict[str, tuple[str, int]],
    sms: dict[str, int],
    engines: dict[str, tuple[int, int, int, int, int]],
) -> tuple[MigProfile, ...]:
    return tuple(
        _profile(shape, name, memory, sms[shape], engines[shape])
        for shape, (name, memory) in names_and_memory.items()
    )


# Memory sizes in MiB; docs/reference/mig-profiles.md names the source of each table. A100-40GB: go-nvml's mock
# and the MIG guide's fractions. A100-80GB: the real `nvidia-smi` GiB figures where a capture has them
# (1g 9.50, 2g 19.50, 3g 39.25 GiB), the go-nvml mock figures otherwise (1g.20gb,
# 4g.40gb, 7g.80gb). H100: the `nvidia-smi` GiB column (the mock MiB column is known wrong). H200: the
# `nvidia-smi` capture. Every name follows from its memory by profile_memory_gb (checked in the tests).
_A100_40GB_PROFILES = _table(
    {
        "1g": ("1g.5gb", 4864),
        "1g+me": ("1g.5gb+me", 4864),
        "1g-double": ("1g.10gb", 9856),
        "2g": ("2g.10gb", 9856),
        "3g": ("3g.20gb", 19968),
        "4g": ("4g.20gb", 19968),
        "7g": ("7g.40gb", 40192),
    },
    _A100_SMS,
    _A100_ENGINES,
)
_A100_80GB_PROFILES = _table(
    {
        "1g": ("1g.10gb", 9728),
        "1g+me": ("1g.10gb+me", 9728),
        "1g-double": ("1g.20gb", 19968),
        "2g": ("2g.20gb", 19968),
        "3g": ("3g.40gb", 40192),
        "4g": ("4g.40gb", 40192),
        "7g": ("7g.80gb", 80384),
    },
    _A100_SMS,
    _A100_ENGINES,
)
_H100_80GB_PROFILES = _table(
    {
        "1g": ("1g.10gb", 9984),
        "1g+me": ("1g.10gb+me", 9984),
        "1g-double": ("1g.20gb", 20096),
        "2g": ("2g.20gb", 20096),
        "3g": ("3g.40gb", 40448),
        "4g": ("4g.40gb", 40448),
        "7g": ("7g.80gb", 81152),
    },
    _HOPPER_SMS,
    _HOPPER_ENGINES,
)
# H200 placements are not verified on hardware; the reference expects the H100 geometry.
_H200_141GB_PROFILES = _table(
    {
        "1g": ("1g.18gb", 16384),
        "1g+me": ("1g.18gb+me", 16384),
        "1g-double": ("1g.35gb", 33024),
        "2g": ("2g.35gb", 33024),
        "3g": ("3g.71gb", 71168),
        "4g": ("4g.71gb", 71168),
        "7g": ("7g.141gb", 143104),
    },
    _HOPPER_SMS,
    _HOPPER_ENGINES,
)

# Total memory as NVML reports it (nvmlDeviceGetMemoryInfo().total / MiB). PCI ids: docs/reference/mig-profiles.md
# for the MIG parts; the H200 SXM id is the GPU Operator's (go-nvml's mock uses 0x233310DE instead).
_MODELS: tuple[GpuModel, ...] = (
    GpuModel(
        key="A100-SXM4-40GB",
        nvml_name="NVIDIA A100-SXM4-40GB",
        memory_mib=40960,
        architecture=NVML_DEVICE_ARCH_AMPERE,
        arch_name="ampere",
        compute_capability=(8, 0),
        family="ampere",
        nvlink_links=12,
        mig_profiles=_A100_40GB_PROFILES,
        pci_device_id=0x20B010DE,
        multiprocessor_count=108,
    ),
    GpuModel(
        key="A100-SXM4-80GB",
        nvml_name="NVIDIA A100-SXM4-80GB",
        memory_mib=81920,
        architecture=NVML_DEVICE_ARCH_AMPERE,
        arch_name="ampere",
        compute_capability=(8, 0),
        family="ampere",
        nvlink_links=12,
        mig_profiles=_A100_80GB_PROFILES,
        pci_device_id=0x20B210DE,
        multiprocessor_count=108,
    ),
    GpuModel(
        key="H100-SXM5-80GB",
        nvml_name="NVIDIA H100 80GB HBM3",
        memory_mib=81559,
        architecture=NVML_DEVICE_ARCH_HOPPER,
        arch_name="hopper",
        compute_capability=(9, 0),
        family="hopper",
        nvlink_links=18,
        mig_profiles=_H100_80GB_PROFILES,
        pci_device_id=0x233010DE,
        multiprocessor_count=132,
    ),
    GpuModel(
        key="H200-141GB",
        nvml_name="NVIDIA H200",
        memory_mib=143771,
        architecture=NVML_DEVICE_ARCH_HOPPER,
        arch_name="hopper",
        compute_capability=(9, 0),
        family="hopper",
        nvlink_links=18,
        mig_profiles=_H200_141GB_PROFILES,
        pci_device_id=0x233510DE,
        multiprocessor_count=132,
    ),
    GpuModel(
        key="L40S",
        nvml_name="NVIDIA L40S",
        memory_mib=46068,
        architecture=NVML_DEVICE_ARCH_ADA,
        arch_name="ada",
        compute_capability=(8, 9),
        family="ada-lovelace",
        nvlink_links=0,
        mig_profiles=(),
        pci_device_id=0x26B910DE,
        multiprocessor_count=142,
    ),
    GpuModel(
        key="T4",
        nvml_name="Tesla T4",
        memory_mib=15360,
        architecture=NVML_DEVICE_ARCH_TURING,
        arch_name="turing",
        compute_capability=(7, 5),
        family="turing",
        nvlink_links=0,
        mig_profiles=(),
        pci_device_id=0x1EB810DE,
        multiprocessor_count=40,
    ),
)

MODELS: Mapping[str, GpuModel] = MappingProxyType({m.key: m for m in _MODELS})


def lookup(key: str) -> GpuModel:
    """The model for a node-file key such as ``H100-SXM5-80GB``; :class:`UnknownGpuModel` otherwise."""
    try:
        return MODELS[key]
    except KeyError:
        raise UnknownGpuModel(key) from None


def known_models() -> list[str]:
    return list(MODELS)
