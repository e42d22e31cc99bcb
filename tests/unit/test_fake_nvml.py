"""The fake NVML behaves like pynvml (same calls, shapes and errors), with persisted state and faults."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.nvml.catalog import lookup
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node, parse_node

WHOLE_GPU = 0xFFFFFFFF
GI_1G = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
GI_2G = pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE
GI_3G = pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE
GI_4G = pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE
CI_3G = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE
CI_1G = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE
SHARED = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
UNCORRECTED, VOLATILE, AGGREGATE = (
    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC,
)


def started(source: str, state_file: Path | None = None) -> FakeNvml:
    lib = FakeNvml(load_node(source), state_file)
    lib.nvmlInit()
    return lib


def mig_on(lib: FakeNvml, index: int = 0) -> Any:
    h = lib.nvmlDeviceGetHandleByIndex(index)
    assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    return h


def at(start: int, size: int) -> Any:
    """A placement passed the way the C call needs it: by reference."""
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))


def profile_id(lib: FakeNvml, h: Any, index: int) -> int:
    return int(lib.nvmlDeviceGetGpuInstanceProfileInfo(h, index).id)


def with_ci(lib: FakeNvml, gi: Any, ci_index: int) -> Any:
    return lib.nvmlGpuInstanceCreateComputeInstance(
        gi, lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_index, SHARED).id
    )


def placement_of(lib: FakeNvml, gi: Any) -> tuple[int, int, int]:
    info = lib.nvmlGpuInstanceGetInfo(gi)
    return int(info.id), int(info.placement.start), int(info.placement.size)


def raises(code: int, call: Callable[[], Any]) -> None:
    with pytest.raises(pynvml.NVMLError) as caught:
        call()
    assert type(caught.value) is pynvml.nvmlExceptionClass(code)


# --- init, system, enumeration ---------------------------------------------------------------------------


def test_calls_before_init_and_after_shutdown_are_uninitialized() -> None:
    lib = FakeNvml(load_node("single-h200"))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        lib.nvmlDeviceGetCount()
    lib.nvmlInit()
    lib.nvmlInitWithFlags(0)
    lib.nvmlShutdown()
    assert lib.nvmlDeviceGetCount() == 1  # init is reference counted
    lib.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        lib.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        lib.nvmlShutdown()


def test_driver_not_loaded() -> None:
    lib = FakeNvml(load_node("single-h200"))
    lib.set_driver_loaded(False)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        lib.nvmlInit()
    lib.set_driver_loaded(True)
    lib.nvmlInit()


def test_system_versions() -> None:
    lib = started("dgx-h100")
    assert lib.nvmlSystemGetDriverVersion() == "570.133.20"
    assert lib.nvmlSystemGetCudaDriverVersion() == 12080
    assert lib.nvmlSystemGetCudaDriverVersion_v2() == 12080
    assert lib.nvmlSystemGetNVMLVersion() == "12.570.133.20"


@pytest.mark.parametrize(
    ("preset", "name", "memory_mib", "cc"),
    [
        ("dgx-h100", "NVIDIA H100 80GB HBM3", 81559, (9, 0)),
        ("dgx-a100", "NVIDIA A100-SXM4-40GB", 40960, (8, 0)),
        ("hgx-h200", "NVIDIA H200", 143771, (9, 0)),
        ("pcie-l40s-4", "NVIDIA L40S", 46068, (8, 9)),
        ("a100-pcie-nvlink-pairs", "NVIDIA A100-SXM4-80GB", 81920, (8, 0)),
        ("single-h200", "NVIDIA H200", 143771, (9, 0)),
    ],
)
def test_enumeration(preset: str, name: str, memory_mib: int, cc: tuple[int, int]) -> None:
    spec = load_node(preset)
    lib = started(preset)
    count = lib.nvmlDeviceGetCount()
    assert count == len(spec.gpus)
    handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    assert all(isinstance(h, pynvml.c_nvmlDevice_t) for h in handles)
    assert [lib.nvmlDeviceGetName(h) for h in handles] == [name] * count
    assert {lib.nvmlDeviceGetMemoryInfo(h).total for h in handles} == {memory_mib * 1024 * 1024}
    assert {lib.nvmlDeviceGetCudaComputeCapability(h) for h in handles} == {cc}
    assert [lib.nvmlDeviceGetIndex(h) for h in handles] == list(range(count))
    assert [lib.nvmlDeviceGetMinorNumber(h) for h in handles] == list(range(count))
    # nvmlPciInfo_t is one of pynvml's printable structs, which decode char arrays to str on access.
    bus_ids = [lib.nvmlDeviceGetPciInfo(h).busId for h in handles]
    assert bus_ids == [g.pci_bus_id for g in spec.gpus]
    assert len(set(bus_ids)) == count
    uuids = [lib.nvmlDeviceGetUUID(h) for h in handles]
    assert uuids == [g.uuid for g in spec.gpus]
    again = started(preset)
    assert [again.nvmlDeviceGetUUID(again.nvmlDeviceGetHandleByIndex(i)) for i in range(count)] == uuids
    for i, gpu_uuid in enumerate(uuids):
        assert lib.nvmlDeviceGetIndex(lib.nvmlDeviceGetHandleByUUID(gpu_uuid)) == i
        assert lib.nvmlDeviceGetIndex(lib.nvmlDeviceGetHandleByPciBusId(bus_ids[i].lower())) == i
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetHandleByIndex(count)
    with pytest.raises(pynvml.NVMLError_NotFound):
        lib.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def test_pci_info_fields() -> None:
    lib = started("dgx-h100")
    info = lib.nvmlDeviceGetPciInfo(lib.nvmlDeviceGetHandleByIndex(5))
    assert isinstance(info, pynvml.nvmlPciInfo_t)
    assert (info.busId, info.busIdLegacy) == ("00000000:AB:00.0", "0000:AB:00.0")
    assert (info.domain, info.bus, info.device, info.pciDeviceId) == (0, 0xAB, 0, 0x233010DE)


def test_identity_and_architecture() -> None:
    lib = started("dgx-a100")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert lib.nvmlDeviceGetSerial(h) == load_node("dgx-a100").gpus[0].serial
    assert lib.nvmlDeviceGetAttributes(h).multiprocessorCount == 108
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetNumaNodeId(h)
    v2 = lib.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert (v2.version, v2.total) == (pynvml.nvmlMemory_v2, 40960 * 1024 * 1024)


def test_numa_node_answers_like_sysfs() -> None:
    lib = FakeNvml(load_node("dgx-h100"))
    assert lib.numa_node("00000000:18:00.0") == 0
    assert lib.numa_node("0000:9a:00.0") == 1
    assert lib.numa_node("0000:01:00.0") is None


# --- topology and NVLink ---------------------------------------------------------------------------------


def test_dgx_h100_topology_levels() -> None:
    lib = started("dgx-h100")
    h = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
    assert [lib.nvmlDeviceGetTopologyCommonAncestor(h[0], h[j]) for j in range(8)] == [
        pynvml.NVML_TOPOLOGY_INTERNAL,
        pynvml.NVML_TOPOLOGY_SINGLE,
        pynvml.NVML_TOPOLOGY_NODE,
        pynvml.NVML_TOPOLOGY_NODE,
        pynvml.NVML_TOPOLOGY_SYSTEM,
        pynvml.NVML_TOPOLOGY_SYSTEM,
        pynvml.NVML_TOPOLOGY_SYSTEM,
        pynvml.NVML_TOPOLOGY_SYSTEM,
    ]
    assert lib.nvmlDeviceGetTopologyCommonAncestor(h[6], h[7]) == pynvml.NVML_TOPOLOGY_SINGLE


def test_dgx_h100_nvlinks_go_to_four_nvswitches() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(3)
    assert [lib.nvmlDeviceGetNvLinkState(h, link) for link in range(18)] == [pynvml.NVML_FEATURE_ENABLED] * 18
    assert {lib.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) for link in range(18)} == {
        pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    }
    remotes = [lib.nvmlDeviceGetNvLinkRemotePciInfo(h, link) for link in range(18)]
    assert [r.busId for r in remotes] == (
        ["00000000:E0:00.0"] * 5 + ["00000000:E1:00.0"] * 4 + ["00000000:E2:00.0"] * 4
        + ["00000000:E3:00.0"] * 5
    )
    assert {r.pciDeviceId for r in remotes} == {0x22A310DE}
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetNvLinkState(h, 18)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetNvLinkState(h, pynvml.NVML_NVLINK_MAX_LINKS)


def test_nvlink_bridges_point_at_the_peer_gpu() -> None:
    lib = started("a100-pcie-nvlink-pairs")
    spec = load_node("a100-pcie-nvlink-pairs")
    for a, b in ((0, 1), (1, 0), (2, 3), (3, 2)):
        h = lib.nvmlDeviceGetHandleByIndex(a)
        assert [lib.nvmlDeviceGetNvLinkState(h, link) for link in range(12)] == [1] * 12
        assert {lib.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId for link in range(12)} == {
            spec.gpus[b].pci_bus_id
        }
        assert {lib.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) for link in range(12)} == {
            pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
        }


def test_partly_wired_gpu_has_inactive_links() -> None:
    spec = parse_node(
        "version: v1\ngpus: [{model: H100-SXM5-80GB, numa_node: 0}, {model: H100-SXM5-80GB, numa_node: 0}]\n"
        "links: [{gpus: [0, 1], nvlink: 4}]\n",
        "pair.yaml",
    )
    lib = FakeNvml(spec)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(1)
    assert [lib.nvmlDeviceGetNvLinkState(h, link) for link in range(18)] == [1] * 4 + [0] * 14
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetNvLinkRemotePciInfo(h, 4)


def test_gpus_without_nvlink() -> None:
    lib = started("pcie-l40s-4")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetNvLinkState(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetNvLinkRemotePciInfo(h, 0)


# --- MIG mode ----------------------------------------------------------------------------------------------


def test_hopper_switches_mig_mode_when_idle() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceGetMigMode(h) == [0, 0]
    assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert lib.nvmlDeviceGetMigMode(h) == [1, 1]
    assert lib.nvmlDeviceGetMigMode(lib.nvmlDeviceGetHandleByIndex(1)) == [0, 0]
    assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_SUCCESS
    assert lib.nvmlDeviceGetMigMode(h) == [0, 0]


def test_busy_hopper_keeps_the_mode_pending_until_idle() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(2)
    lib.set_gpu_busy(2)
    assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_IN_USE
    assert lib.nvmlDeviceGetMigMode(h) == [0, 1]
    with pytest.raises(pynvml.NVMLError_InUse):
        lib.reset_gpu(2)
    lib.set_gpu_busy(2, False)
    assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert lib.nvmlDeviceGetMigMode(h) == [1, 1]


def test_ampere_needs_a_reset_to_apply_the_mode() -> None:
    lib = started("dgx-a100")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_IN_USE
    assert lib.nvmlDeviceGetMigMode(h) == [0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_1G))
    lib.reset_gpu(0)
    assert lib.nvmlDeviceGetMigMode(h) == [1, 1]
    lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_1G))


def test_disabling_mig_needs_the_instances_gone() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    gi = lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_3G))
    with pytest.raises(pynvml.NVMLError_InUse):
        lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE)
    assert lib.nvmlDeviceGetMigMode(h) == [1, 1]
    lib.nvmlGpuInstanceDestroy(gi)
    assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceSetMigMode(h, 2)


def test_mig_calls_on_a_gpu_without_mig() -> None:
    lib = started("pcie-l40s-4")
    h = lib.nvmlDeviceGetHandleByIndex(1)
    for call in (
        lambda: lib.nvmlDeviceGetMigMode(h),
        lambda: lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE),
        lambda: lib.nvmlDeviceGetGpuInstanceProfileInfo(h, GI_1G),
        lambda: lib.nvmlDeviceCreateGpuInstance(h, 19),
        lambda: lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 0),
    ):
        raises(pynvml.NVML_ERROR_NOT_SUPPORTED, call)
    assert lib.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    assert lib.nvmlDeviceIsMigDeviceHandle(h).value == 0


# --- profiles and placements ---------------------------------------------------------------------------


def test_h100_profiles_match_the_catalog() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    reported = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
        except pynvml.NVMLError_NotSupported:
            continue
        assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
        assert info.version == pynvml.nvmlGpuInstanceProfileInfo_v2
        reported[index] = (info.name, info.id, info.sliceCount, info.instanceCount, info.memorySizeMB,
                           info.multiprocessorCount)
    assert reported == {
        p.index: (f"MIG {p.name}", p.id, p.slice_count, p.instance_count, p.memory_size_mib,
                  p.multiprocessor_count)
        for p in lookup("H100-SXM5-80GB").mig_profiles
    }
    assert reported[GI_1G] == ("MIG 1g.10gb", 19, 1, 7, 9984, 16)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
    v1 = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, GI_3G, version=1)
    assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t)
    assert (v1.id, v1.memorySizeMB) == (9, 40448)
    assert lib.nvmlDeviceGetGpuInstanceProfileInfoById(h, 15).name == "MIG 1g.20gb"


def test_profiles_listed_with_mig_disabled_only_on_newer_drivers() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceGetGpuInstanceProfileInfo(h, GI_2G).name == "MIG 2g.20gb"
    old = FakeNvml(parse_node(
        "version: v1\ndriver: {version: '535.216.01', cuda: '12.2'}\n"
        "gpus: [{model: A100-SXM4-80GB, numa_node: 0}]\n",
        "r535.yaml",
    ))
    old.nvmlInit()
    h = old.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        old.nvmlDeviceGetGpuInstanceProfileInfo(h, GI_2G)


def test_possible_placements_through_caller_allocated_arrays() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    pid = profile_id(lib, h, GI_3G)
    count = ctypes.c_uint(0)
    status = lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, None, ctypes.byref(count))
    assert status == pynvml.NVML_SUCCESS
    assert count.value == 2
    placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, placements, ctypes.byref(count))
    assert [(p.start, p.size) for p in placements] == [(0, 4), (4, 4)]

    one_g = profile_id(lib, h, GI_1G)
    short = (pynvml.c_nvmlGpuInstancePlacement_t * 3)()
    capacity = ctypes.c_uint(3)
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, one_g, short, ctypes.byref(capacity))
    assert capacity.value == 7
    enough = (pynvml.c_nvmlGpuInstancePlacement_t * 7)()
    lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, one_g, ctypes.byref(enough), ctypes.byref(capacity))
    assert [(p.start, p.size) for p in enough] == [(s, 1) for s in range(7)]

    double = profile_id(lib, h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
    lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, double, enough, ctypes.byref(capacity))
    assert capacity.value == 4
    assert [(p.start, p.size) for p in enough[:4]] == [(0, 2), (2, 2), (4, 2), (6, 2)]


def test_placement_queries_need_mig_enabled() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, None, ctypes.byref(count))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 9)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceCreateGpuInstance(h, 9)


def test_count_must_be_passed_by_reference() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    with pytest.raises(TypeError, match="count must be passed by reference"):
        lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, None, ctypes.c_uint(0))


# --- GPU and compute instances ---------------------------------------------------------------------------


def test_create_with_placement_and_overlap() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    three = profile_id(lib, h, GI_3G)
    gi = lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, three, at(0, 4))
    assert isinstance(gi, pynvml.c_nvmlGpuInstance_t)
    assert placement_of(lib, gi) == (1, 0, 4)
    info = lib.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, lib.nvmlDeviceGetUUID(info.device)) == (three, lib.nvmlDeviceGetUUID(h))

    two = profile_id(lib, h, GI_2G)
    for start in (0, 2):
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, two, at(start, 2))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, two, at(6, 2))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, two, at(4, 1))
    gi2 = lib.nvmlDeviceCreateGpuInstanceWithPlacement(
        h, two, ctypes.pointer(pynvml.c_nvmlGpuInstancePlacement_t(4, 2))
    )
    assert placement_of(lib, gi2) == (5, 4, 2)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        lib.nvmlDeviceCreateGpuInstance(h, three)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceCreateGpuInstance(h, 7)  # an index constant is not a profile id


def test_placement_struct_by_value_is_rejected() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    with pytest.raises(TypeError, match="placement must be passed by reference"):
        lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, pynvml.c_nvmlGpuInstancePlacement_t(0, 4))


def test_nvml_chosen_placements_leave_room_like_the_real_driver() -> None:
    """mig-parted's largest-first order on an 80 GB part gives the layout of NVIDIA/DCGM#138."""
    lib = started("dgx-h100")
    h = mig_on(lib)
    created = [lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, index))
               for index in (GI_3G, GI_2G, GI_1G, GI_1G)]
    assert [placement_of(lib, gi) for gi in created] == [(2, 4, 4), (3, 0, 2), (9, 2, 1), (10, 3, 1)]


def test_a_3g_first_still_lets_a_4g_fit() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_3G))
    assert lib.nvmlDeviceGetGpuInstanceRemainingCapacity(h, profile_id(lib, h, GI_4G)) == 1
    assert placement_of(lib, lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_4G))) == (1, 0, 4)
    assert lib.nvmlDeviceGetGpuInstanceRemainingCapacity(h, profile_id(lib, h, GI_1G)) == 0


def test_instance_count_limit() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    media = profile_id(lib, h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1)
    assert lib.nvmlDeviceGetGpuInstanceRemainingCapacity(h, media) == 1
    lib.nvmlDeviceCreateGpuInstance(h, media)
    assert lib.nvmlDeviceGetGpuInstanceRemainingCapacity(h, media) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        lib.nvmlDeviceCreateGpuInstance(h, media)
    one = profile_id(lib, h, GI_1G)
    assert lib.nvmlDeviceGetGpuInstanceRemainingCapacity(h, one) == 6


def test_destroying_a_gpu_instance_with_compute_instances_is_in_use() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    gi = lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_3G))
    ci = with_ci(lib, gi, CI_3G)
    with pytest.raises(pynvml.NVMLError_InUse):
        lib.nvmlGpuInstanceDestroy(gi)
    assert lib.nvmlComputeInstanceDestroy(ci) == pynvml.NVML_SUCCESS
    assert lib.nvmlGpuInstanceDestroy(gi) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlGpuInstanceGetInfo(gi)  # the handle died with its instance
    with pytest.raises(pynvml.NVMLError_NotFound):
        lib.nvmlDeviceGetGpuInstanceById(h, 2)


def test_compute_instances() -> None:
    lib = started("dgx-h100")
    h = mig_on(lib)
    gi = lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_3G))
    profile = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_3G, SHARED)
    assert isinstance(profile, pynvml.c_nvmlComputeInstanceProfileInfo_v2_t)
    assert (profile.id, profile.sliceCount, profile.instanceCount) == (2, 3, 1)
    assert profile.multiprocessorCount == 60
    assert profile.name == "MIG 3g.40gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_1G, SHARED)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_3G, 1)
    ci = lib.nvmlGpuInstanceCreateComputeInstance(gi, profile.id)
    assert isinstance(ci, pynvml.c_nvmlComputeInstance_t)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        lib.nvmlGpuInstanceCreateComputeInstance(gi, profile.id)
    info = lib.nvmlComputeInstanceGetInfo(ci)
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (0, 2, 0, 3)
    assert lib.nvmlDeviceGetUUID(info.device) == lib.nvmlDeviceGetUUID(h)
    assert placement_of(lib, info.gpuInstance) == placement_of(lib, gi)
    assert lib.nvmlComputeInstanceGetInfo(lib.nvmlGpuInstanceGetComputeInstanceById(gi, 0)).id == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        lib.nvmlGpuInstanceGetComputeInstanceById(gi, 1)


def test_instance_arrays_hold_usable_handles() -> None:
    """The ctypes patterns real code uses: arrays of handle pointers and a count passed by reference."""
    lib = started("hgx-h200")
    h = mig_on(lib, 4)
    info = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, GI_1G)
    for start in (6, 1, 3):
        lib.nvmlDeviceCreateGpuInstanceWithPlacement(
            h, info.id, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, 1))
        )
    gis = (pynvml.c_nvmlGpuInstance_t * info.instanceCount)()
    count = ctypes.c_uint(info.instanceCount)
    assert lib.nvmlDeviceGetGpuInstances(h, info.id, gis, ctypes.byref(count)) == pynvml.NVML_SUCCESS
    assert count.value == 3
    assert [placement_of(lib, gis[i]) for i in range(count.value)] == [(8, 1, 1), (10, 3, 1), (13, 6, 1)]

    ci_info = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gis[1], CI_1G, SHARED)
    lib.nvmlGpuInstanceCreateComputeInstance(gis[1], ci_info.id)
    cis = (pynvml.c_nvmlComputeInstance_t * ci_info.instanceCount)()
    ci_count = ctypes.c_uint(ci_info.instanceCount)
    lib.nvmlGpuInstanceGetComputeInstances(gis[1], ci_info.id, cis, ctypes.byref(ci_count))
    assert ci_count.value == 1
    assert lib.nvmlComputeInstanceGetInfo(cis[0]).id == 0

    small = (pynvml.c_nvmlGpuInstance_t * 2)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        lib.nvmlDeviceGetGpuInstances(h, info.id, small, ctypes.byref(count))
    assert count.value == 3
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetGpuInstances(h, info.id, None, ctypes.byref(count))


# --- MIG devices -----------------------------------------------------------------------------------------


def _layout(lib: FakeNvml) -> Any:
    """GPU 0 with a 3g.40gb (GI 2, at 4:4) and a 2g.20gb (GI 3, at 0:2), each with its compute instance."""
    h = mig_on(lib)
    with_ci(lib, lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_3G)), CI_3G)
    with_ci(lib, lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_2G)),
            pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    return h


def test_mig_device_handles() -> None:
    lib = started("dgx-h100")
    h = _layout(lib)
    assert lib.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    migs = [lib.nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(2)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 7)
    is_mig = lib.nvmlDeviceIsMigDeviceHandle(migs[0])
    assert isinstance(is_mig, ctypes.c_uint)
    assert is_mig.value == 1
    assert is_mig != 1  # pynvml's trap: compare .value
    assert lib.nvmlDeviceIsMigDeviceHandle(h).value == 0
    assert [(lib.nvmlDeviceGetGpuInstanceId(m), lib.nvmlDeviceGetComputeInstanceId(m)) for m in migs] == [
        (2, 0), (3, 0),
    ]
    assert [lib.nvmlDeviceGetName(m) for m in migs] == [
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA H100 80GB HBM3 MIG 2g.20gb",
    ]
    assert [lib.nvmlDeviceGetMemoryInfo(m).total // (1024 * 1024) for m in migs] == [40448, 20096]
    uuids = [lib.nvmlDeviceGetUUID(m) for m in migs]
    assert uuids == [lib.mig_uuid(0, 2, 0), lib.mig_uuid(0, 3, 0)]
    assert all(u.startswith("MIG-") and len(u) == 40 for u in uuids)
    parent = lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migs[1])
    assert lib.nvmlDeviceGetUUID(parent) == lib.nvmlDeviceGetUUID(h)
    assert lib.nvmlDeviceGetGpuInstanceId(lib.nvmlDeviceGetHandleByUUID(uuids[1])) == 3
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetGpuInstanceId(h)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
    assert lib.nvmlDeviceGetAttributes(migs[0]).multiprocessorCount == 60


def test_mig_uuids_are_stable_across_instances() -> None:
    first, second = started("dgx-h100"), started("dgx-h100")
    for lib in (first, second):
        _layout(lib)
    uuids = [
        lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetMigDeviceHandleByIndex(lib.nvmlDeviceGetHandleByIndex(0), 1))
        for lib in (first, second)
    ]
    assert uuids[0] == uuids[1] == first.mig_uuid(0, 3, 0)
    assert first.mig_uuid(0, 3, 0) != first.mig_uuid(1, 3, 0)


def test_no_mig_devices_while_mig_is_disabled() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)


def test_reset_and_reboot_drop_the_layout_but_keep_the_mode() -> None:
    lib = started("dgx-h100")
    h = _layout(lib)
    mig = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    lib.reset_gpu(0)
    assert lib.nvmlDeviceGetMigMode(h) == [1, 1]
    with pytest.raises(pynvml.NVMLError_NotFound):
        lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetUUID(mig)
    _layout_again = lib.nvmlDeviceCreateGpuInstance(h, profile_id(lib, h, GI_1G))
    lib.reboot()
    assert lib.nvmlDeviceGetMigMode(h) == [1, 1]
    count = ctypes.c_uint(7)
    lib.nvmlDeviceGetGpuInstances(h, 19, (pynvml.c_nvmlGpuInstance_t * 7)(), ctypes.byref(count))
    assert count.value == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlGpuInstanceGetInfo(_layout_again)


# --- persistence -----------------------------------------------------------------------------------------


def test_state_is_shared_through_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    first = started("dgx-h100", state)
    _layout(first)
    assert json.loads(state.read_text())["gpus"][load_node("dgx-h100").gpus[0].uuid]["mig_current"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["nvml.json", "nvml.json.lock"]

    second = started("dgx-h100", state)
    h2 = second.nvmlDeviceGetHandleByIndex(0)
    assert second.nvmlDeviceGetMigMode(h2) == [1, 1]
    mig = second.nvmlDeviceGetMigDeviceHandleByIndex(h2, 0)
    assert second.nvmlDeviceGetUUID(mig) == first.mig_uuid(0, 2, 0)

    # A change made by one process is seen by the other on its next call.
    gi = second.nvmlDeviceGetGpuInstanceById(h2, 3)
    second.nvmlComputeInstanceDestroy(second.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
    second.nvmlGpuInstanceDestroy(gi)
    h1 = first.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        first.nvmlDeviceGetGpuInstanceById(h1, 3)
    assert first.nvmlDeviceGetGpuInstanceId(first.nvmlDeviceGetMigDeviceHandleByIndex(h1, 0)) == 2

    second.set_gpu_lost(6)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        first.nvmlDeviceGetHandleByIndex(6)
    third = FakeNvml(load_node("dgx-h100"), state)
    third.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        third.nvmlDeviceGetHandleByIndex(6)


def test_state_written_by_another_process(tmp_path: Path) -> None:
    state = tmp_path / "run" / "nvml.json"
    script = (
        "import sys, pynvml\n"
        "from pathlib import Path\n"
        "from agent.nvml.fake import FakeNvml\n"
        "from agent.nvml.nodefile import load_node\n"
        "lib = FakeNvml(load_node('hgx-h200'), Path(sys.argv[1]))\n"
        "lib.nvmlInit()\n"
        "h = lib.nvmlDeviceGetHandleByIndex(7)\n"
        "lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE)\n"
        "info = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)\n"
        "lib.nvmlDeviceCreateGpuInstance(h, info.id)\n"
        "lib.set_ecc_uncorrected(1, 5)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(state)], check=True, timeout=60)
    lib = started("hgx-h200", state)
    h = lib.nvmlDeviceGetHandleByIndex(7)
    assert lib.nvmlDeviceGetMigMode(h) == [1, 1]
    assert placement_of(lib, lib.nvmlDeviceGetGpuInstanceById(h, 0)) == (0, 0, 8)
    assert lib.nvmlDeviceGetTotalEccErrors(lib.nvmlDeviceGetHandleByIndex(1), UNCORRECTED, VOLATILE) == 5


def test_a_broken_state_file_is_reported(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    state.write_text('{"format": 7}')
    with pytest.raises(ValueError, match="not a fake NVML state file"):
        FakeNvml(load_node("dgx-h100"), state)


# --- events ----------------------------------------------------------------------------------------------


def _registered(lib: FakeNvml, *indices: int) -> Any:
    event_set = lib.nvmlEventSetCreate()
    for i in indices:
        h = lib.nvmlDeviceGetHandleByIndex(i)
        mask = lib.nvmlDeviceGetSupportedEventTypes(h)
        assert mask & pynvml.nvmlEventTypeXidCriticalError
        wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
        lib.nvmlDeviceRegisterEvents(h, wanted, event_set)
    return event_set


def test_event_wait_times_out() -> None:
    lib = started("dgx-h100")
    event_set = _registered(lib, 0)
    with pytest.raises(pynvml.NVMLError_Timeout):
        lib.nvmlEventSetWait_v2(event_set, 0)
    lib.inject_xid(1, 79)  # GPU 1 is not registered
    with pytest.raises(pynvml.NVMLError_Timeout):
        lib.nvmlEventSetWait(event_set, 20)


def test_event_delivered_to_a_waiting_thread() -> None:
    lib = started("dgx-h100")
    event_set = _registered(lib, 0, 5)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(lib.nvmlEventSetWait_v2(event_set, 10_000)))
    waiter.start()
    deadline = time.monotonic() + 5
    while not lib._events_ready._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.001)
    lib.inject_xid(5, 48)  # needs the lock, so it also proves the waiter released it
    waiter.join(5)
    assert not waiter.is_alive()
    data = got[0]
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert (data.eventType, data.eventData, data.gpuInstanceId, data.computeInstanceId) == (
        pynvml.nvmlEventTypeXidCriticalError, 48, WHOLE_GPU, WHOLE_GPU,
    )
    assert lib.nvmlDeviceGetUUID(data.device) == lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetHandleByIndex(5))


def test_mig_xid_and_ecc_events() -> None:
    lib = started("dgx-h100")
    event_set = _registered(lib, 0)
    lib.inject_xid(0, 31, gi_id=2, ci_id=0)
    lib.set_ecc_uncorrected(0, 2)
    xid = lib.nvmlEventSetWait_v2(event_set, 0)
    assert (xid.eventData, xid.gpuInstanceId, xid.computeInstanceId) == (31, 2, 0)
    ecc = lib.nvmlEventSetWait_v2(event_set, 0)
    assert (ecc.eventType, ecc.gpuInstanceId) == (pynvml.nvmlEventTypeDoubleBitEccError, WHOLE_GPU)
    with pytest.raises(ValueError, match="ci_id needs gi_id"):
        lib.inject_xid(0, 31, ci_id=0)


def test_freeing_an_event_set_wakes_its_waiter() -> None:
    lib = started("single-h200")
    event_set = _registered(lib, 0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            lib.nvmlEventSetWait_v2(event_set, 10_000)
        except pynvml.NVMLError as err:
            errors.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    lib.nvmlEventSetFree(event_set)
    waiter.join(5)
    assert not waiter.is_alive()
    assert [type(e) for e in errors] == [pynvml.NVMLError_InvalidArgument]


def test_events_injected_by_another_process_reach_the_waiter(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    agent = started("dgx-h100", state)
    event_set = _registered(agent, 2)
    injector = FakeNvml(load_node("dgx-h100"), state)
    injector.inject_xid(2, 94)
    data = agent.nvmlEventSetWait_v2(event_set, 5_000)
    assert data.eventData == 94
    with pytest.raises(pynvml.NVMLError_Timeout):
        agent.nvmlEventSetWait_v2(event_set, 0)
    later = started("dgx-h100", state)  # history is not replayed to a new process
    with pytest.raises(pynvml.NVMLError_Timeout):
        later.nvmlEventSetWait_v2(_registered(later, 2), 0)


def test_registering_unsupported_events() -> None:
    lib = started("single-h200")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    event_set = lib.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeGpuRecoveryAction, event_set)
    lib.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)


# --- faults and health -----------------------------------------------------------------------------------


def test_fail_next() -> None:
    lib = started("dgx-h100")
    lib.fail_next("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN, times=2)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            lib.nvmlDeviceGetCount()
    assert lib.nvmlDeviceGetCount() == 8
    lib.fail_next("nvmlEventSetWait_v2", pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        lib.nvmlEventSetWait(lib.nvmlEventSetCreate(), 0)  # pynvml's nvmlEventSetWait calls _v2
    lib.fail_next("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        lib.nvmlInit()
    lib.fail_next("nvmlDeviceGetGpuInstanceProfileInfoV", pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        lib.nvmlDeviceGetGpuInstanceProfileInfo(lib.nvmlDeviceGetHandleByIndex(0), GI_1G)
    with pytest.raises(ValueError, match="no pynvml function 'nvmlDeviceGetCuont'"):
        lib.fail_next("nvmlDeviceGetCuont", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(ValueError, match="unknown NVML error code 12345"):
        lib.fail_next("nvmlDeviceGetCount", 12345)


def test_lost_gpu() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(3)
    lib.set_gpu_lost(3)
    for call in (
        lambda: lib.nvmlDeviceGetHandleByIndex(3),
        lambda: lib.nvmlDeviceGetUUID(h),
        lambda: lib.nvmlDeviceGetPciInfo(h),
        lambda: lib.nvmlDeviceGetMemoryInfo(h),
        lambda: lib.nvmlDeviceGetTotalEccErrors(h, UNCORRECTED, VOLATILE),
        lambda: lib.nvmlDeviceGetMigMode(h),
    ):
        raises(pynvml.NVML_ERROR_GPU_IS_LOST, call)
    assert lib.nvmlDeviceGetCount() == 8
    assert lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(2)) == "NVIDIA H100 80GB HBM3"
    lib.set_gpu_lost(3, False)
    assert lib.nvmlDeviceGetUUID(h) == load_node("dgx-h100").gpus[3].uuid


def test_ecc_counters_and_reset() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(1)

    def uncorrected() -> tuple[int, int]:
        return (lib.nvmlDeviceGetTotalEccErrors(h, UNCORRECTED, VOLATILE),
                lib.nvmlDeviceGetTotalEccErrors(h, UNCORRECTED, AGGREGATE))

    assert lib.nvmlDeviceGetEccMode(h) == [1, 1]
    lib.set_ecc_uncorrected(1, 3)
    lib.set_ecc_corrected(1, 40)
    assert uncorrected() == (3, 3)
    lib.reset_gpu(1)
    assert uncorrected() == (0, 3)
    assert lib.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, AGGREGATE) == 40


def test_row_remapping_on_ampere_and_later() -> None:
    lib = started("dgx-h100")
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    lib.set_remapped_rows(0, pending=True, uncorrectable=2)
    assert lib.nvmlDeviceGetRemappedRows(h) == (0, 2, 1, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetRetiredPagesPendingStatus(h)
    lib.reset_gpu(0)
    assert lib.nvmlDeviceGetRemappedRows(h) == (0, 2, 0, 0)
    lib.set_remapped_rows(0, failure=True)
    assert lib.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 1)
    _layout(lib)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetRemappedRows(h)  # not while MIG instances exist


def test_page_retirement_before_ampere() -> None:
    lib = FakeNvml(parse_node("version: v1\ngpus: [{model: T4, numa_node: 0}]\n", "t4.yaml"))
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceGetRetiredPagesPendingStatus(h) == 0
    lib.set_retired_pages_pending(0)
    assert lib.nvmlDeviceGetRetiredPagesPendingStatus(h) == 1
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetRemappedRows(h)
    with pytest.raises(ValueError, match=r"GPU 0 \(T4\) retires pages instead of remapping rows"):
        lib.set_remapped_rows(0, pending=True)


def test_telemetry() -> None:
    lib = started("pcie-l40s-4")
    h = lib.nvmlDeviceGetHandleByIndex(2)
    assert lib.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle
    lib.set_clocks_event_reasons(2, pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    assert lib.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    lib.set_temperature(2, 91)
    assert lib.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU) == 91
    assert lib.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 91
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        lib.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU, version=3)
    lib.set_power_usage(2, 312_000)
    assert lib.nvmlDeviceGetPowerUsage(h) == 312_000


def test_handles_from_elsewhere_are_invalid_arguments() -> None:
    lib = started("single-h200")
    for bogus in (None, pynvml.c_nvmlDevice_t(), 5):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            lib.nvmlDeviceGetUUID(bogus)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetUUID(lib.nvmlEventSetCreate())
