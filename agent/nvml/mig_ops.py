"""MIG through NVML: `MigOps` reads a GPU's MIG mode, profiles and GPU instances (`MigGpuState`) and changes
them (mode, create, destroy, compute instances); `agent/mig/` and DRA's dynamic MIG call it on the NVML thread.
NVML's errors leave as `MigCallError` (NVML's message) or `MigResetRequired` (a mode change that waits for a
reset), so its callers need no pynvml. It works through an `NvmlBackend`'s library and device handles."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import pynvml

from agent.nvml.backend import NvmlBackend, nvml_text
from agent.nvml.catalog import MODELS, MigProfile, Placement

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class GpuInstanceInfo:
    gpu_instance_id: int
    profile: str
    start: int
    size: int
    compute_instances: int


@dataclass(frozen=True)
class MigGpuState:
    """One GPU's MIG state as NVML reports it, for planning a layout."""

    index: int
    name: str
    pci_device_id: int
    mig_capable: bool
    mig_enabled: bool
    mig_pending: bool
    profiles: tuple[MigProfile, ...]
    instances: tuple[GpuInstanceInfo, ...]


class MigResetRequired(RuntimeError):
    """The MIG mode change is pending until the GPU is reset."""


class MigCallError(RuntimeError):
    """An NVML call of a MIG read or change failed; the message is NVML's (e.g. "Insufficient Resources")."""


def _mig_call(method: Callable[P, R]) -> Callable[P, R]:
    """MigOps' public methods: an NVML error leaves as MigCallError."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except pynvml.NVMLError as err:
            raise MigCallError(str(err)) from err

    return call


_CI_FULL_PROFILE = {1: "1", 2: "2", 3: "3", 4: "4", 6: "6", 7: "7", 8: "8"}


def _ci_profile_index(slices: int) -> int:
    return int(getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{_CI_FULL_PROFILE.get(slices, '1')}_SLICE"))


class MigOps:
    """MIG reads and writes through the backend's library; methods run on the NVML thread.

    A failing NVML call raises MigCallError with NVML's message, so callers need no pynvml.
    """

    def __init__(self, backend: NvmlBackend) -> None:
        self._b = backend

    @property
    def lib(self) -> Any:
        return self._b.lib

    def _handle(self, index: int) -> Any:
        return self._b.handle(index)

    def _refresh_handle(self, index: int) -> None:
        # Handles are re-enumerated after a MIG mode change.
        self._b.refresh_handle(index)

    def _profiles_from_nvml(self, h: Any) -> tuple[MigProfile, ...]:
        lib = self.lib
        profiles = []
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except pynvml.NVMLError:
                continue
            count = ctypes.c_uint(0)
            lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, int(info.id), None, ctypes.byref(count))
            array = (pynvml.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
            lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, int(info.id), array, ctypes.byref(count))
            slices = int(info.sliceCount)
            ci_index = _ci_profile_index(slices)
            profiles.append(MigProfile(
                name=nvml_text(info.name).removeprefix("MIG "), index=index, id=int(info.id), slice_count=slices,
                instance_count=int(info.instanceCount), memory_size_mib=int(info.memorySizeMB),
                multiprocessor_count=int(info.multiprocessorCount),
                placements=tuple(Placement(int(p.start), int(p.size)) for p in array[: count.value]),
                ci_profile_index=ci_index, ci_profile_id=ci_index, copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount), encoders=int(info.encoderCount), jpegs=int(info.jpegCount),
                ofas=int(info.ofaCount),
            ))
        return tuple(profiles)

    @_mig_call
    def state(self, index: int) -> MigGpuState:
        lib = self.lib
        h = self._handle(index)
        name = nvml_text(lib.nvmlDeviceGetName(h))
        pci_device_id = int(lib.nvmlDeviceGetPciInfo(h).pciDeviceId)
        try:
            current, pending = lib.nvmlDeviceGetMigMode(h)
        except pynvml.NVMLError_NotSupported:
            return MigGpuState(index, name, pci_device_id, False, False, False, (), ())
        enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
        if enabled:
            profiles = self._profiles_from_nvml(h)
        else:
            # Placements can be listed only with MIG on: plan from the known table of this model.
            profiles = next((m.mig_profiles for m in MODELS.values() if m.nvml_name == name), ())
        return MigGpuState(index, name, pci_device_id, True, enabled, pending != current, profiles,
                           self._instances(h, profiles) if enabled else ())

    def _gpu_instances(self, h: Any, profile: MigProfile) -> list[Any]:
        count = ctypes.c_uint(profile.instance_count)
        array = (pynvml.c_nvmlGpuInstance_t * max(1, profile.instance_count))()
        self.lib.nvmlDeviceGetGpuInstances(h, profile.id, array, ctypes.byref(count))
        return list(array[: count.value])

    def _compute_instances(self, gi: Any, slices: int) -> list[Any]:
        lib = self.lib
        info = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, _ci_profile_index(slices), 0)
        count = ctypes.c_uint(int(info.instanceCount))
        array = (pynvml.c_nvmlComputeInstance_t * max(1, count.value))()
        lib.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), array, ctypes.byref(count))
        return list(array[: count.value])

    def _instances(self, h: Any, profiles: tuple[MigProfile, ...]) -> tuple[GpuInstanceInfo, ...]:
        found = []
        for profile in profiles:
            for gi in self._gpu_instances(h, profile):
                info = self.lib.nvmlGpuInstanceGetInfo(gi)
                found.append(GpuInstanceInfo(
                    int(info.id), profile.name, int(info.placement.start), int(info.placement.size),
                    len(self._compute_instances(gi, profile.slice_count)),
                ))
        return tuple(sorted(found, key=lambda i: i.start))

    def _find(self, index: int, start: int) -> tuple[Any, MigProfile]:
        h = self._handle(index)
        for profile in self.state(index).profiles:
            for gi in self._gpu_instances(h, profile):
                if int(self.lib.nvmlGpuInstanceGetInfo(gi).placement.start) == start:
                    return gi, profile
        raise LookupError(f"GPU {index} has no GPU instance at slice {start}")

    @_mig_call
    def destroy(self, index: int, start: int) -> None:
        """Destroy the GPU instance at `start` and its compute instances."""
        gi, profile = self._find(index, start)
        for ci in self._compute_instances(gi, profile.slice_count):
            self.lib.nvmlComputeInstanceDestroy(ci)
        self.lib.nvmlGpuInstanceDestroy(gi)

    @_mig_call
    def set_mode(self, index: int, enabled: bool) -> None:
        """Switch MIG on or off; MigResetRequired when the change waits for a GPU reset."""
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        self.lib.nvmlDeviceSetMigMode(self._handle(index), mode)
        self._refresh_handle(index)
        current, _ = self.lib.nvmlDeviceGetMigMode(self._handle(index))
        if current != mode:
            raise MigResetRequired(
                f"GPU {index}: MIG {'enable' if enabled else 'disable'} is pending (the GPU is in use or needs a reset)"
            )

    @_mig_call
    def create(self, index: int, profile_name: str, start: int) -> None:
        """Create a GPU instance of `profile_name` at `start`, with one compute instance spanning it."""
        h = self._handle(index)
        profile = next(p for p in self.state(index).profiles if p.name == profile_name)
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, profile.memory_slices)
        gi = self.lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile.id, ctypes.byref(placement))
        self._ensure_compute_instance(gi, profile)

    def _ensure_compute_instance(self, gi: Any, profile: MigProfile) -> None:
        if not self._compute_instances(gi, profile.slice_count):
            info = self.lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, _ci_profile_index(profile.slice_count), 0)
            self.lib.nvmlGpuInstanceCreateComputeInstance(gi, int(info.id))

    @_mig_call
    def ensure_compute_instances(self, index: int) -> None:
        """Give every GPU instance a compute instance (one may be missing after an interrupted apply)."""
        h = self._handle(index)
        for profile in self.state(index).profiles:
            for gi in self._gpu_instances(h, profile):
                self._ensure_compute_instance(gi, profile)
