"""The fake NVML's pynvml call surface outside MIG and telemetry: init and system, enumeration and identity,
topology and NVLink, events, health."""

from __future__ import annotations

import ctypes
import time
import uuid as uuidlib
from typing import Any

import pynvml

from agent.nvml.catalog import MIB
from agent.nvml.fake_handles import KIND_EVENT_SET, KIND_MIG, PCIE_TOPOLOGY, Ref, referent, text_arg
from agent.nvml.fake_mig import FakeMig
from agent.nvml.fake_state import EventSet, api_call, nvml_error
from agent.nvml.nodefile import FabricSpec, normalize_bus_id

SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
)


_CROSS_PROCESS_POLL_S = 0.05


class FakeCalls(FakeMig):
    """The pynvml calls outside MIG and telemetry."""

    # --- init and system ---------------------------------------------------------------------------

    @api_call()
    def nvmlInitWithFlags(self, flags: int) -> None:
        if not self._state.driver_loaded:
            raise nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._refcount += 1

    @api_call()
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @api_call()
    def nvmlShutdown(self) -> None:
        self._refcount -= 1

    @api_call()
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.spec.driver_version

    @api_call()
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.spec.cuda_driver_version

    @api_call()
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.spec.cuda_driver_version

    @api_call()
    def nvmlSystemGetNVMLVersion(self) -> str:
        return f"{self.spec.cuda_version.split('.')[0]}.{self.spec.driver_version}"

    # --- enumeration and identity ------------------------------------------------------------------

    @api_call()
    def nvmlDeviceGetCount(self) -> int:
        return len(self.spec.gpus)

    @api_call()
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self.spec.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpu_state(index)
        if state.lost and not state.lost_keeps_handle:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpu_handle(index)

    @api_call()
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        text = text_arg(uuid)
        gpu = self._by_uuid.get(text)
        if gpu is not None:
            if self._gpu_state(gpu.index).lost:
                raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
            return self._gpu_handle(gpu.index)
        for g in self.spec.gpus:
            for gi, ci in self._mig_devices(g.index):
                if self.mig_uuid(g.index, gi.id, ci.id) == text:
                    if self._gpu_state(g.index).lost:
                        raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return self._mig_handle(g.index, gi, ci)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    @api_call()
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> Any:
        bus_id = normalize_bus_id(text_arg(pciBusId))
        gpu = self._by_bus.get(bus_id) if bus_id is not None else None
        if gpu is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        if self._gpu_state(gpu.index).lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpu_handle(gpu.index)

    @api_call()
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        ref = self._device(handle, allow_mig=True)
        if ref.kind == KIND_MIG:
            return self.mig_uuid(ref.gpu, ref.gi, ref.ci)
        return self.spec.gpus[ref.gpu].uuid

    @api_call()
    def nvmlDeviceGetName(self, handle: Any) -> str:
        ref = self._device(handle, allow_mig=True)
        model = self._model(ref)
        if ref.kind == KIND_MIG:
            gi, _ = self._mig_parts(ref)
            return f"{model.nvml_name} MIG {self._profile_for(gi, model).name}"
        return model.nvml_name

    @api_call()
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._device(handle).gpu

    @api_call()
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self.spec.gpus[self._device(handle).gpu].minor_number

    @api_call()
    def nvmlDeviceGetVirtualizationMode(self, handle: Any) -> int:
        self._device(handle)
        return int(pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE)  # bare metal

    @api_call()
    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        self._device(handle)
        # Every model of the catalog is a data-centre GPU, which NVML brands NVIDIA (nvidia-smi -q:
        # "Product Brand : NVIDIA").
        return int(pynvml.NVML_BRAND_NVIDIA)

    @api_call()
    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        return self.spec.gpus[self._device(handle).gpu].serial

    @api_call()
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        return self._pci_info(self.spec.gpus[self._device(handle).gpu])

    @api_call()
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    @api_call()
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        ref = self._device(handle, allow_mig=True)
        model = self._model(ref)
        if ref.kind == KIND_MIG:
            gi, _ = self._mig_parts(ref)
            total = self._profile_for(gi, model).memory_size_mib * MIB
        else:
            total = model.memory_mib * MIB
        mig_uuid = self.mig_uuid(ref.gpu, ref.gi, ref.ci) if ref.kind == KIND_MIG else None
        used, reserved = self._live_memory(ref.gpu, total, mig_uuid)
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)
        if version != pynvml.nvmlMemory_v2:
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved,
                                        free=total - used - reserved, used=used)

    @api_call()
    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        return self._model(self._device(handle, allow_mig=True)).architecture

    @api_call()
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._model(self._device(handle, allow_mig=True)).compute_capability

    @api_call()
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        # Only GPUs that are NUMA nodes themselves (coherent platforms) answer; these x86 nodes do not.
        self._device(handle)
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @api_call()
    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        ref = self._device(handle, allow_mig=True)
        model = self._model(ref)
        attrs = pynvml.c_nvmlDeviceAttributes()
        if ref.kind == KIND_MIG:
            gi, _ = self._mig_parts(ref)
            profile = self._profile_for(gi, model)
            attrs.multiprocessorCount = profile.multiprocessor_count
            attrs.sharedCopyEngineCount = profile.copy_engines
            attrs.sharedDecoderCount = profile.decoders
            attrs.sharedEncoderCount = profile.encoders
            attrs.sharedJpegCount = profile.jpegs
            attrs.sharedOfaCount = profile.ofas
            attrs.gpuInstanceSliceCount = profile.slice_count
            attrs.computeInstanceSliceCount = profile.slice_count
            attrs.memorySizeMB = profile.memory_size_mib
            return attrs
        attrs.multiprocessorCount = model.multiprocessor_count
        attrs.memorySizeMB = model.memory_mib
        return attrs

    # --- topology and NVLink -----------------------------------------------------------------------

    @api_call()
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a, b = self._device(device1).gpu, self._device(device2).gpu
        if a == b:
            return int(pynvml.NVML_TOPOLOGY_INTERNAL)
        return int(PCIE_TOPOLOGY[self.spec.pcie_level(a, b)])

    @api_call()
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        _, end = self._link_end(device, link)
        return int(pynvml.NVML_FEATURE_DISABLED if end is None else pynvml.NVML_FEATURE_ENABLED)

    @api_call()
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        gpu, end = self._active_link(device, link)
        if end.to_switch:
            return self._switch_pci_info(gpu, end.peer)
        return self._pci_info(self.spec.gpus[end.peer])

    @api_call()
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        _, end = self._active_link(handle, link)
        kind = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if end.to_switch else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
        return int(kind)

    # --- the multi-node NVLink fabric --------------------------------------------------------------

    @api_call()
    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        """Fill the caller's nvmlGpuFabricInfo_v2 or _v3 struct (passed by reference, its `version` set as
        pynvml's constructor sets it) from the node file's fabric: INVALID_ARGUMENT without a struct,
        ARGUMENT_VERSION_MISMATCH for a version the driver does not know or a struct of another size,
        NOT_SUPPORTED for a GPU without a fabric. The health mask (and v3's summary) say NOT_SUPPORTED: the fake
        does not model the fabric's health."""
        fabric = self._fabric_of(device)
        info = self._fabric_struct(gpuFabricInfo)
        sizes = {pynvml.nvmlGpuFabricInfo_v2: ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_v2_t),
                 pynvml.nvmlGpuFabricInfo_v3: ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_v3_t)}
        version = int(getattr(info, "version", 0))
        if sizes.get(version) != ctypes.sizeof(info):
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if fabric is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._fill_fabric(info, fabric)
        info.healthMask = 0
        if version == pynvml.nvmlGpuFabricInfo_v3:
            info.healthSummary = pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
        return int(pynvml.NVML_SUCCESS)

    @api_call()
    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any) -> int:
        """The call drivers had before nvmlDeviceGetGpuFabricInfoV: an nvmlGpuFabricInfo_t, without a version."""
        fabric = self._fabric_of(device)
        info = self._fabric_struct(gpuFabricInfo)
        if ctypes.sizeof(info) != ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_t):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if fabric is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._fill_fabric(info, fabric)
        return int(pynvml.NVML_SUCCESS)

    def _fabric_of(self, device: Any) -> FabricSpec | None:
        return self.spec.gpus[self._device(device).gpu].fabric

    @staticmethod
    def _fabric_struct(ref: Any) -> Any:
        if ref is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return referent(ref, "gpuFabricInfo")

    @staticmethod
    def _fill_fabric(info: Any, fabric: FabricSpec) -> None:
        info.clusterUuid[:] = list(uuidlib.UUID(fabric.cluster_uuid).bytes)
        info.status = fabric.status
        info.cliqueId = fabric.clique_id
        info.state = fabric.state

    # --- events ------------------------------------------------------------------------------------

    @api_call()
    def nvmlEventSetCreate(self) -> Any:
        key = self._next_event_set
        self._next_event_set += 1
        self._event_sets[key] = EventSet()
        return Ref(KIND_EVENT_SET, token=key).handle(pynvml.c_nvmlEventSet_t)

    @api_call()
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._device(handle)
        return int(SUPPORTED_EVENTS)

    @api_call()
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        ref = self._device(handle)
        event_set = self._event_set(eventSet)
        if eventTypes & ~SUPPORTED_EVENTS:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.registrations[ref.gpu] = event_set.registrations.get(ref.gpu, 0) | eventTypes

    @api_call()
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Block up to ``timeoutms`` for an event (the lock is released while waiting); Timeout if none."""
        event_set = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, timeoutms) / 1000
        while True:
            if event_set.freed:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if event_set.queue:
                record = event_set.queue.popleft()
                data = pynvml.c_nvmlEventData_t()
                gpu = self._by_uuid[record.gpu_uuid]
                data.device = self._gpu_handle(gpu.index)
                data.eventType = record.event_type
                data.eventData = record.data
                data.gpuInstanceId = record.gpu_instance
                data.computeInstanceId = record.compute_instance
                return data
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
            if self.state_file is None:
                self._events_ready.wait(remaining)
            else:
                # Another process may add events to the file: look at it now and then.
                self._events_ready.wait(min(remaining, _CROSS_PROCESS_POLL_S))
                self._sync()

    @api_call()
    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @api_call()
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        event_set = self._event_set(eventSet)
        event_set.freed = True
        self._events_ready.notify_all()

    # --- health ------------------------------------------------------------------------------------

    @api_call()
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        state = self._gpu_state(self._device(handle).gpu)
        corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        volatile, aggregate = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
        counters = {
            (corrected, volatile): state.ecc_corrected_volatile,
            (corrected, aggregate): state.ecc_corrected_aggregate,
            (uncorrected, volatile): state.ecc_uncorrected_volatile,
            (uncorrected, aggregate): state.ecc_uncorrected_aggregate,
        }
        if (errorType, counterType) not in counters:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return counters[errorType, counterType]

    @api_call()
    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        self._device(handle)
        return [pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_ENABLED]

    @api_call()
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        """Page retirement is the pre-Ampere mechanism; Ampere and later remap rows instead."""
        ref = self._device(device)
        if self._model(ref).architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(self._gpu_state(ref.gpu).retired_pages_pending)

    @api_call()
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        """Ampere and later; not on a MIG-enabled GPU while it has GPU instances."""
        ref = self._device(device)
        state = self._gpu_state(ref.gpu)
        if self._model(ref).architecture < pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if state.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE and state.gpu_instances:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (state.remapped_correctable, state.remapped_uncorrectable,
                int(state.remap_pending), int(state.remap_failure))

    @api_call()
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu_state(self._device(handle).gpu).clocks_event_reasons

    @api_call()
    def nvmlDeviceGetTemperatureV(
        self, handle: Any, sensor: int, version: int = pynvml.nvmlTemperature_v1
    ) -> int:
        if version != pynvml.nvmlTemperature_v1:
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return self._temperature(handle, sensor)

    @api_call()
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._temperature(handle, sensor)

    def _temperature(self, handle: Any, sensor: int) -> int:
        ref = self._device(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._live_temperature(ref.gpu, self._gpu_state(ref.gpu).temperature_c)

    @api_call()
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        ref = self._device(handle)
        return self._live_power_mw(ref.gpu, self._gpu_state(ref.gpu).power_mw)

    @api_call()
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        """Busy percentages over the last sample period; NotSupported with MIG on, as on real GPUs."""
        ref = self._device(handle)
        state = self._gpu_state(ref.gpu)
        if state.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlUtilization_t(*self._live_utilization(ref.gpu, state.utilization_gpu,
                                                                  state.utilization_memory))
