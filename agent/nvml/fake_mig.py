"""The fake NVML's MIG model: mode changes, GPU-instance profiles and placements, GPU and compute instances,
and MIG device handles, with NVML's errors for each misuse."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from agent.nvml.catalog import GpuModel, MigProfile, Placement
from agent.nvml.fake_handles import KIND_MIG, FakeHandles, Ref, count_reference, out_array, placement_arg
from agent.nvml.fake_state import ComputeInstance, GpuInstance, GpuState, api_call, nvml_error

MAX_MIG_DEVICES = 7
"""One MIG device per compute slice at most."""

# Drivers up to R535 cannot list GPU-instance profiles while MIG is disabled (NVIDIA/mig-parted#312); the
# first later production branch is taken as the one that can.
PROFILES_WITHOUT_MIG_FROM_DRIVER = 550


def _overlaps(a: Placement, b: Placement) -> bool:
    return a.start < b.start + b.size and b.start < a.start + a.size


def _gi_id_for(placement: Placement, whole: int) -> int:
    """GPU-instance id by placement, as a freshly configured GPU numbers them: whole GPU 0, halves 1-2,
    quarters 3-6, eighths 7-14 (an A100 in NVIDIA/DCGM#138; an RTX PRO 6000, whose ``whole`` is 12 placement
    units, numbers its quarters 3-6 the same way)."""
    parts = whole // placement.size
    return parts - 1 + placement.start // placement.size


class FakeMig(FakeHandles):
    """The MIG model and the pynvml MIG calls."""

    # --- MIG helpers -------------------------------------------------------------------------------

    def _mig_model(self, ref: Ref) -> GpuModel:
        model = self._model(ref)
        if not model.mig_capable:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    def _mig_enabled(self, ref: Ref) -> GpuModel:
        model = self._mig_model(ref)
        if self._gpu_state(ref.gpu).mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    def _gi_profile(self, model: GpuModel, profile_id: int) -> MigProfile:
        profile = model.profile_by_id(profile_id)
        if profile is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return profile

    def _profiles_listable(self, ref: Ref) -> GpuModel:
        model = self._mig_model(ref)
        mig_on = self._gpu_state(ref.gpu).mig_current == pynvml.NVML_DEVICE_MIG_ENABLE
        if not mig_on and self.spec.driver_major < PROFILES_WITHOUT_MIG_FROM_DRIVER:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    @staticmethod
    def _gi_profile_struct(profile: MigProfile, version: int) -> Any:
        if version == 2:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = f"MIG {profile.name}".encode()
        elif version == 1:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = profile.id
        info.isP2pSupported = 0
        info.sliceCount = profile.slice_count
        info.instanceCount = profile.instance_count
        info.multiprocessorCount = profile.multiprocessor_count
        info.copyEngineCount = profile.copy_engines
        info.decoderCount = profile.decoders
        info.encoderCount = profile.encoders
        info.jpegCount = profile.jpegs
        info.ofaCount = profile.ofas
        info.memorySizeMB = profile.memory_size_mib
        return info

    @staticmethod
    def _occupied(state: GpuState) -> list[Placement]:
        return [Placement(g.start, g.size) for g in state.gpu_instances]

    @staticmethod
    def _free(placements: tuple[Placement, ...], occupied: list[Placement]) -> list[Placement]:
        return [p for p in placements if not any(_overlaps(p, o) for o in occupied)]

    def _choose_placement(self, model: GpuModel, profile: MigProfile, occupied: list[Placement]) -> Placement:
        """NVML's own pick when no placement is given: the free one that blocks the fewest other free
        placements, lowest start on a tie. This reproduces real layouts (3g lands at 4:4 first, so a 4g
        still fits at 0:4); it is a model, not NVIDIA's algorithm."""
        candidates = self._free(profile.placements, occupied)
        if not candidates:
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        every = sorted({p for q in model.mig_profiles for p in q.placements})
        still_free = self._free(tuple(every), occupied)
        return min(candidates, key=lambda c: (sum(_overlaps(c, p) for p in still_free), c.start))

    def _create_gi(self, handle: Any, profile_id: int, placement: Placement | None) -> Any:
        ref = self._device(handle)
        model = self._mig_enabled(ref)
        profile = self._gi_profile(model, profile_id)
        state = self._gpu_state(ref.gpu)
        if placement is not None and placement not in profile.placements:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if sum(g.profile_id == profile_id for g in state.gpu_instances) >= profile.instance_count:
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        occupied = self._occupied(state)
        if placement is None:
            placement = self._choose_placement(model, profile, occupied)
        elif any(_overlaps(placement, o) for o in occupied):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi = GpuInstance(
            id=_gi_id_for(placement, max(p.start + p.size for q in model.mig_profiles for p in q.placements)),
            profile_id=profile_id,
            start=placement.start,
            size=placement.size,
            token=self._next_token(),
        )
        state.gpu_instances.append(gi)
        return self._gi_handle(ref.gpu, gi)

    def _write_handles(self, out: Any, count_ref: Any, handles: list[Any], element: Any) -> None:
        count = count_reference(count_ref)
        pointer, length = out_array(out, element)
        if pointer is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        capacity = length if length is not None else count.value
        if capacity < len(handles):
            count.value = len(handles)
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, h in enumerate(handles):
            pointer[i] = h
        count.value = len(handles)

    def _clear_layout(self, state: GpuState) -> None:
        state.gpu_instances = []

    # --- MIG mode ----------------------------------------------------------------------------------

    @api_call()
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        ref = self._device(device)
        self._mig_model(ref)
        state = self._gpu_state(ref.gpu)
        return [state.mig_current, state.mig_pending]

    @api_call(mutates=True)
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        """Returns the activation status (docs/reference/mig-profiles.md, "Mode changes"). Hopper and later
        switch at once when the GPU is idle; Ampere keeps the new mode pending until a GPU reset (``reset_gpu``),
        as does any GPU with clients (``set_gpu_busy``): both report NVML_ERROR_IN_USE as the activation status.
        Disabling MIG while GPU instances exist fails with InUse: destroy them first."""
        ref = self._device(device)
        model = self._mig_model(ref)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpu_state(ref.gpu)
        if mode == pynvml.NVML_DEVICE_MIG_DISABLE and state.gpu_instances:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        state.mig_pending = mode
        if state.mig_current == mode:
            return int(pynvml.NVML_SUCCESS)
        if model.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER and not state.busy:
            state.mig_current = mode
            self._clear_layout(state)
            return int(pynvml.NVML_SUCCESS)
        return int(pynvml.NVML_ERROR_IN_USE)

    # --- GPU-instance profiles ---------------------------------------------------------------------

    @api_call()
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        ref = self._device(device)
        model = self._mig_model(ref)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._profiles_listable(ref)
        found = model.profile_by_index(profile)
        if found is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._gi_profile_struct(found, version)

    @api_call()
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        ref = self._device(device)
        model = self._profiles_listable(ref)
        return self._gi_profile_struct(self._gi_profile(model, profileId), 2)

    # pynvml binds these names to the same functions.
    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo
    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    @api_call()
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        ref = self._device(device)
        profile = self._gi_profile(self._mig_enabled(ref), profileId)
        state = self._gpu_state(ref.gpu)
        left = profile.instance_count - sum(g.profile_id == profileId for g in state.gpu_instances)
        return max(0, min(left, len(self._free(profile.placements, self._occupied(state)))))

    @api_call()
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """All placements of the profile, free or not. ``placementsRef`` None asks for the count only;
        otherwise ``countRef`` holds the array's capacity on entry (InsufficientSize when short)."""
        ref = self._device(device)
        profile = self._gi_profile(self._mig_enabled(ref), profileId)
        count = count_reference(countRef)
        pointer, length = out_array(placementsRef, pynvml.c_nvmlGpuInstancePlacement_t)
        needed = len(profile.placements)
        if pointer is not None:
            capacity = count.value if length is None else min(count.value, length)
            if capacity < needed:
                count.value = needed
                raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, p in enumerate(profile.placements):
                pointer[i].start = p.start
                pointer[i].size = p.size
        count.value = needed
        return int(pynvml.NVML_SUCCESS)

    # --- GPU instances -----------------------------------------------------------------------------

    @api_call(mutates=True)
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        return self._create_gi(device, profileId, None)

    @api_call(mutates=True)
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        return self._create_gi(device, profileId, placement_arg(placement))

    @api_call()
    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        ref = self._device(device)
        self._gi_profile(self._mig_enabled(ref), profileId)
        found = sorted((g for g in self._gpu_state(ref.gpu).gpu_instances if g.profile_id == profileId),
                       key=lambda g: g.id)
        handles = [self._gi_handle(ref.gpu, g) for g in found]
        self._write_handles(gpuInstancesRef, countRef, handles, pynvml.c_nvmlGpuInstance_t)
        return int(pynvml.NVML_SUCCESS)

    @api_call()
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        ref = self._device(device)
        self._mig_enabled(ref)
        gi = self._gpu_state(ref.gpu).gi(gpuInstanceId)
        if gi is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._gi_handle(ref.gpu, gi)

    @api_call()
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        ref, gi = self._gi(gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._gpu_handle(ref.gpu)
        info.id = gi.id
        info.profileId = gi.profile_id
        info.placement = pynvml.c_nvmlGpuInstancePlacement_t(gi.start, gi.size)
        return info

    @api_call(mutates=True)
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        ref, gi = self._gi(gpuInstance)
        if gi.compute_instances:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        state = self._gpu_state(ref.gpu)
        state.gpu_instances = [g for g in state.gpu_instances if g.id != gi.id]
        return int(pynvml.NVML_SUCCESS)

    # --- compute instances -------------------------------------------------------------------------

    def _ci_profile(self, ref: Ref, gi: GpuInstance) -> MigProfile:
        return self._profile_for(gi, self._model(ref))

    @api_call()
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        """Only the compute-instance profile that spans the whole GPU instance is offered."""
        ref, gi = self._gi(device)
        if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= engProfile < pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi_profile = self._ci_profile(ref, gi)
        if profile != gi_profile.ci_profile_index:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            info.name = f"MIG {gi_profile.name}".encode()
        elif version == 1:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = gi_profile.ci_profile_id
        info.sliceCount = gi_profile.slice_count
        info.instanceCount = 1
        info.multiprocessorCount = gi_profile.multiprocessor_count
        info.sharedCopyEngineCount = gi_profile.copy_engines
        info.sharedDecoderCount = gi_profile.decoders
        info.sharedEncoderCount = gi_profile.encoders
        info.sharedJpegCount = gi_profile.jpegs
        info.sharedOfaCount = gi_profile.ofas
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    @api_call()
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any, profileId: int) -> int:
        ref, gi = self._gi(gpuInstance)
        if profileId != self._ci_profile(ref, gi).ci_profile_id:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 0 if gi.compute_instances else 1

    @api_call(mutates=True)
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        ref, gi = self._gi(gpuInstance)
        profile = self._ci_profile(ref, gi)
        if profileId != profile.ci_profile_id:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gi.compute_instances:
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci = ComputeInstance(id=0, profile_id=profileId, start=0, size=profile.slice_count,
                              token=self._next_token())
        gi.compute_instances.append(ci)
        return self._ci_handle(ref.gpu, gi, ci)

    @api_call()
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        ref, gi = self._gi(gpuInstance)
        if profileId != self._ci_profile(ref, gi).ci_profile_id:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        handles = [self._ci_handle(ref.gpu, gi, c) for c in sorted(gi.compute_instances, key=lambda c: c.id)]
        self._write_handles(computeInstancesRef, countRef, handles, pynvml.c_nvmlComputeInstance_t)
        return int(pynvml.NVML_SUCCESS)

    @api_call()
    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        ref, gi = self._gi(gpuInstance)
        ci = gi.ci(computeInstanceId)
        if ci is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._ci_handle(ref.gpu, gi, ci)

    @api_call()
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any:
        ref, gi, ci = self._ci(computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._gpu_handle(ref.gpu)
        info.gpuInstance = self._gi_handle(ref.gpu, gi)
        info.id = ci.id
        info.profileId = ci.profile_id
        info.placement = pynvml.c_nvmlComputeInstancePlacement_t(ci.start, ci.size)
        return info

    @api_call()
    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)

    @api_call(mutates=True)
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        _, gi, ci = self._ci(computeInstance)
        gi.compute_instances = [c for c in gi.compute_instances if c.id != ci.id]
        return int(pynvml.NVML_SUCCESS)

    # --- MIG devices -------------------------------------------------------------------------------

    @api_call()
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        """Zero unless MIG is supported and enabled."""
        ref = self._device(device)
        enabled = self._gpu_state(ref.gpu).mig_current == pynvml.NVML_DEVICE_MIG_ENABLE
        return MAX_MIG_DEVICES if self._model(ref).mig_capable and enabled else 0

    @api_call()
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        ref = self._device(device)
        self._mig_model(ref)
        if not 0 <= index < MAX_MIG_DEVICES:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = self._mig_devices(ref.gpu)
        if index >= len(devices):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = devices[index]
        return self._mig_handle(ref.gpu, gi, ci)

    @api_call()
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        ref = self._ref(migDevice, (KIND_MIG,))
        self._mig_parts(ref)
        return self._gpu_handle(ref.gpu)

    @api_call()
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        ref = self._device(device, allow_mig=True, check_lost=False)
        return ctypes.c_uint(1 if ref.kind == KIND_MIG else 0)

    @api_call()
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        ref = self._ref(device, (KIND_MIG,))
        gi, _ = self._mig_parts(ref)
        return gi.id

    @api_call()
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        ref = self._ref(device, (KIND_MIG,))
        _, ci = self._mig_parts(ref)
        return ci.id
