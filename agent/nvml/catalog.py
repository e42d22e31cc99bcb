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
NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX = 10
NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX = 11
NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX = 12
NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME = 13
NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME = 14
NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME = 15
NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME = 16
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10
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

# The other GH100 parts (H100 NVL, H20, GH200) have the H100's ids, counts and placements (the MIG user guide's
# tables for the 94 GB and 96 GB products list the same rows). No `nvidia-smi mig -lgip` capture of them was
# found: memory is one eighth of the total (rounded down to 256 MiB) per memory slice, a placeholder whose
# names come out as the guide's; SMs and engines are the H100's (H20: 11 SMs per compute slice, of its 78).
_H20_SMS = {"1g": 11, "1g+me": 11, "1g-double": 11, "2g": 22, "3g": 33, "4g": 44, "7g": 77}


def _eighths(slice_mib: int, names: dict[str, str]) -> dict[str, tuple[str, int]]:
    """Memory of every full-size shape from the memory of one memory slice (``names`` by shape)."""
    slices = {"1g": 1, "1g+me": 1, "1g-double": 2, "2g": 2, "3g": 4, "4g": 4, "7g": 8}
    return {shape: (name, slice_mib * slices[shape]) for shape, name in names.items()}


_H100_NVL_PROFILES = _table(
    _eighths(11776, {"1g": "1g.12gb", "1g+me": "1g.12gb+me", "1g-double": "1g.24gb", "2g": "2g.24gb",
                     "3g": "3g.47gb", "4g": "4g.47gb", "7g": "7g.94gb"}),
    _HOPPER_SMS,
    _HOPPER_ENGINES,
)
_GH100_96GB_NAMES = {"1g": "1g.12gb", "1g+me": "1g.12gb+me", "1g-double": "1g.24gb", "2g": "2g.24gb",
                     "3g": "3g.48gb", "4g": "4g.48gb", "7g": "7g.96gb"}
_H20_PROFILES = _table(_eighths(12032, _GH100_96GB_NAMES), _H20_SMS, _HOPPER_ENGINES)
_GH200_PROFILES = _table(_eighths(12032, _GH100_96GB_NAMES), _HOPPER_SMS, _HOPPER_ENGINES)

# Blackwell data-center parts (GB100 and Blackwell Ultra): the full-size geometry, ids and counts of A100/H100
# (the B200 and GB200 captures in NVIDIA/mig-parted#166, #187 and #227 list ids 19, 20, 15, 14 with 7, 1, 4, 3
# instances; the guide's B200 table the counts of the rest). Two copy engines per compute slice up to 2g
# (captured), 6, 8 and 16 for 3g, 4g and 7g (the guide); decoders and JPEG engines equal G, one OFA with +me
# and on 7g (captured up to 2g, the same pattern above).
_GB100_ENGINES = {
    "1g": (2, 1, 0, 1, 0),
    "1g+me": (2, 1, 0, 1, 1),
    "1g-double": (2, 1, 0, 1, 0),
    "2g": (4, 2, 0, 2, 0),
    "3g": (6, 3, 0, 3, 0),
    "4g": (8, 4, 0, 4, 0),
    "7g": (16, 7, 0, 7, 1),
}
# SMs up to 2g as captured; 3g, 4g and 7g (not captured) are G times half the 2g figure.
_B200_SMS = {"1g": 18, "1g+me": 18, "1g-double": 30, "2g": 36, "3g": 54, "4g": 72, "7g": 126}
_GB200_SMS = {"1g": 18, "1g+me": 18, "1g-double": 32, "2g": 38, "3g": 57, "4g": 76, "7g": 133}

# B200: 1g 20.50 GiB and 2g 44.25 GiB as NVML reports them (mig-parted#187; the same in MIG device totals in
# gpu-operator#2155); 3g/4g and 7g (not captured) are two and four times the 2g figure.
_B200_PROFILES = _table(
    {
        "1g": ("1g.23gb", 20992),
        "1g+me": ("1g.23gb+me", 20992),
        "1g-double": ("1g.45gb", 45312),
        "2g": ("2g.45gb", 45312),
        "3g": ("3g.90gb", 90624),
        "4g": ("4g.90gb", 90624),
        "7g": ("7g.180gb", 181248),
    },
    _B200_SMS,
    _GB100_ENGINES,
)
# GB200: 1g 22.00 GiB and 2g 45.50 GiB (mig-parted#227, a driver that names the 1g profile 1g.23gb; earlier
# drivers called it 1g.24gb, gpu-operator#1303); the rest as for B200.
_GB200_PROFILES = _table(
    {
        "1g": ("1g.23gb", 22528),
        "1g+me": ("1g.23gb+me", 22528),
        "1g-double": ("1g.47gb", 46592),
        "2g": ("2g.47gb", 46592),
        "3g": ("3g.93gb", 93184),
        "4g": ("4g.93gb", 93184),
        "7g": ("7g.186gb", 186368),
    },
    _GB200_SMS,
    _GB100_ENGINES,
)
# B300 and GB300 (Blackwell Ultra): names from the GPU Operator's default mig-parted config; no capture of their
# profile tables was found, so memory is one eighth of the total (rounded down to 256 MiB) per memory slice and
# SMs and engines are B200's and GB200's, placeholders that keep the names right.
_B300_PROFILES = _table(
    _eighths(34304, {"1g": "1g.34gb", "1g+me": "1g.34gb+me", "1g-double": "1g.67gb", "2g": "2g.67gb",
                     "3g": "3g.135gb", "4g": "4g.135gb", "7g": "7g.269gb"}),
    _B200_SMS,
    _GB100_ENGINES,
)
_GB300_PROFILES = _table(
    _eighths(35328, {"1g": "1g.35gb", "1g+me": "1g.35gb+me", "1g-double": "1g.70gb", "2g": "2g.70gb",
                     "3g": "3g.139gb", "4g": "4g.139gb", "7g": "7g.278gb"}),
    _GB200_SMS,
    _GB100_ENGINES,
)


def _row(
    name: str,
    index: int,
    profile_id: int,
    g: int,
    count: int,
    memory_mib: int,
    sms: int,
    placements: tuple[Placement, ...],
    ci: tuple[int, int],
    engines: tuple[int, int, int, int, int],
) -> MigProfile:
    copy, dec, enc, jpeg, ofa = engines
    return MigProfile(
        name=name, index=index, id=profile_id, slice_count=g, instance_count=count, memory_size_mib=memory_mib,
        multiprocessor_count=sms, placements=placements, ci_profile_index=ci[0], ci_profile_id=ci[1],
        copy_engines=copy, decoders=dec, encoders=enc, jpegs=jpeg, ofas=ofa,
    )


# RTX PRO 6000 Blackwell (GB202): four compute slices on a grid of 12 placement units, 3 per 1g
# (`nvidia-smi mig -lgipp`: {0,3,6,9}:3, {0,6}:6, {0}:12). Ids, counts, memory (23.62, 47.38, 95.12 GiB), SMs and
# engines: the `nvidia-smi mig -lgip` captures in GoogleCloudPlatform/container-engine-accelerators#564 and
# bigstack-oss/cubecos#312; the guide's RTX PRO 6000 table agrees on counts and engines. The index constants
# follow nvml.h's names (+gfx: *_GFX, -me: *_NO_ME, +me.all: *_ALL_ME).
_QUARTER = _placements((0, 3, 6, 9), 3)
_HALF = _placements((0, 6), 6)
_WHOLE = _placements((0,), 12)
_RTX_PRO_6000_PROFILES = (
    _row("1g.24gb", NVML_GPU_INSTANCE_PROFILE_1_SLICE, 14, 1, 4, 24192, 46, _QUARTER, _CI_1, (1, 1, 1, 1, 0)),
    _row("1g.24gb+me", NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 21, 1, 1, 24192, 46, _QUARTER, _CI_1,
         (1, 1, 1, 1, 1)),
    _row("1g.24gb+gfx", NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX, 47, 1, 4, 24192, 46, _QUARTER, _CI_1,
         (1, 1, 1, 1, 0)),
    _row("1g.24gb+me.all", NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, 65, 1, 1, 24192, 46, _QUARTER, _CI_1,
         (1, 4, 4, 4, 1)),
    _row("1g.24gb-me", NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, 67, 1, 4, 24192, 46, _QUARTER, _CI_1,
         (1, 0, 0, 0, 0)),
    _row("2g.48gb", NVML_GPU_INSTANCE_PROFILE_2_SLICE, 5, 2, 2, 48512, 94, _HALF, _CI_2, (2, 2, 2, 2, 0)),
    _row("2g.48gb+gfx", NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX, 35, 2, 2, 48512, 94, _HALF, _CI_2,
         (2, 2, 2, 2, 0)),
    _row("2g.48gb+me.all", NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, 64, 2, 1, 48512, 94, _HALF, _CI_2,
         (2, 4, 4, 4, 1)),
    _row("2g.48gb-me", NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME, 66, 2, 2, 48512, 94, _HALF, _CI_2,
         (2, 0, 0, 0, 0)),
    _row("4g.96gb", NVML_GPU_INSTANCE_PROFILE_4_SLICE, 0, 4, 1, 97408, 188, _WHOLE, _CI_4, (4, 4, 4, 4, 1)),
    _row("4g.96gb+gfx", NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX, 32, 4, 1, 97408, 188, _WHOLE, _CI_4,
         (4, 4, 4, 4, 1)),
)

# Total memory as NVML reports it (nvmlDeviceGetMemoryInfo().total / MiB). PCI ids: docs/reference/mig-profiles.md
# for the MIG parts; the H200 SXM id is the GPU Operator's (go-nvml's mock uses 0x233310DE instead). Names, ids,
# totals and SM counts of the later parts: docs/reference/gpu-models.md.
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
        key="H100-NVL",
        nvml_name="NVIDIA H100 NVL",
        memory_mib=95830,
        architecture=NVML_DEVICE_ARCH_HOPPER,
        arch_name="hopper",
        compute_capability=(9, 0),
        family="hopper",
        nvlink_links=12,
        mig_profiles=_H100_NVL_PROFILES,
        pci_device_id=0x232110DE,
        multiprocessor_count=132,
    ),
    GpuModel(
        key="H20",
        nvml_name="NVIDIA H20",
        memory_mib=97871,
        architecture=NVML_DEVICE_ARCH_HOPPER,
        arch_name="hopper",
        compute_capability=(9, 0),
        family="hopper",
        nvlink_links=18,
        mig_profiles=_H20_PROFILES,
        pci_device_id=0x232910DE,
        multiprocessor_count=78,
    ),
    GpuModel(
        key="GH200-480GB",
        nvml_name="NVIDIA GH200 480GB",
        memory_mib=97871,
        architecture=NVML_DEVICE_ARCH_HOPPER,
        arch_name="hopper",
        compute_capability=(9, 0),
        family="hopper",
        nvlink_links=18,
        mig_profiles=_GH200_PROFILES,
        pci_device_id=0x234210DE,
        multiprocessor_count=132,
    ),
    GpuModel(
        key="B200",
        nvml_name="NVIDIA B200",
        memory_mib=183359,
        architecture=NVML_DEVICE_ARCH_BLACKWELL,
        arch_name="blackwell",
        compute_capability=(10, 0),
        family="blackwell",
        nvlink_links=18,
        mig_profiles=_B200_PROFILES,
        pci_device_id=0x290110DE,
        multiprocessor_count=148,
    ),
    GpuModel(
        key="GB200",
        nvml_name="NVIDIA GB200",
        memory_mib=189471,
        architecture=NVML_DEVICE_ARCH_BLACKWELL,
        arch_name="blackwell",
        compute_capability=(10, 0),
        family="blackwell",
        nvlink_links=18,
        mig_profiles=_GB200_PROFILES,
        pci_device_id=0x294110DE,
        multiprocessor_count=152,
    ),
    GpuModel(
        key="B300-SXM6",
        nvml_name="NVIDIA B300 SXM6 AC",
        memory_mib=275040,
        architecture=NVML_DEVICE_ARCH_BLACKWELL,
        arch_name="blackwell",
        compute_capability=(10, 3),
        family="blackwell",
        nvlink_links=18,
        mig_profiles=_B300_PROFILES,
        pci_device_id=0x318210DE,
        multiprocessor_count=148,
    ),
    GpuModel(
        key="GB300",
        nvml_name="NVIDIA GB300",
        memory_mib=284208,
        architecture=NVML_DEVICE_ARCH_BLACKWELL,
        arch_name="blackwell",
        compute_capability=(10, 3),
        family="blackwell",
        nvlink_links=18,
        mig_profiles=_GB300_PROFILES,
        pci_device_id=0x31C210DE,
        multiprocessor_count=152,
    ),
    GpuModel(
        key="RTX-PRO-6000-BSE",
        nvml_name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
        memory_mib=97887,
        architecture=NVML_DEVICE_ARCH_BLACKWELL,
        arch_name="blackwell",
        compute_capability=(12, 0),
        family="blackwell",
        nvlink_links=0,
        mig_profiles=_RTX_PRO_6000_PROFILES,
        pci_device_id=0x2BB510DE,
        multiprocessor_count=188,
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
