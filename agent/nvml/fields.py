"""NVML reads behind dcgm-exporter's default fields, for every GPU and MIG device, one pass per interval.

A value NVML does not support on a device (NotSupported, NoPermission, NotFound, a field whose nvmlReturn is not
success) is left out, never reported as zero: DCGM_FI_PROF_* come from GPM (Hopper and later) and are absent on
GPUs without it. GPM metrics are computed between two samples, so they appear from the second pass on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import pynvml

from agent.nvml.backend import NvmlBackend
from agent.nvml.records import GpuInfo, MigDeviceInfo, NodeInventory

log = logging.getLogger(__name__)

SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
MEM_CLOCK = "DCGM_FI_DEV_MEM_CLOCK"
MEMORY_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
TOTAL_ENERGY_CONSUMPTION = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
PCIE_REPLAY_COUNTER = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
MEM_COPY_UTIL = "DCGM_FI_DEV_MEM_COPY_UTIL"
ENC_UTIL = "DCGM_FI_DEV_ENC_UTIL"
DEC_UTIL = "DCGM_FI_DEV_DEC_UTIL"
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
NVLINK_BANDWIDTH_TOTAL = "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"
VGPU_LICENSE_STATUS = "DCGM_FI_DEV_VGPU_LICENSE_STATUS"
UNCORRECTABLE_REMAPPED_ROWS = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
CORRECTABLE_REMAPPED_ROWS = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
DRIVER_VERSION = "DCGM_FI_DRIVER_VERSION"
PROF_GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
PROF_PIPE_TENSOR_ACTIVE = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
PROF_DRAM_ACTIVE = "DCGM_FI_PROF_DRAM_ACTIVE"
PROF_PCIE_TX_BYTES = "DCGM_FI_PROF_PCIE_TX_BYTES"
PROF_PCIE_RX_BYTES = "DCGM_FI_PROF_PCIE_RX_BYTES"

MIB = 1024 * 1024

GPM_METRICS: dict[int, tuple[str, float]] = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: (PROF_GR_ENGINE_ACTIVE, 1 / 100),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: (PROF_PIPE_TENSOR_ACTIVE, 1 / 100),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: (PROF_DRAM_ACTIVE, 1 / 100),
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (PROF_PCIE_TX_BYTES, MIB),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (PROF_PCIE_RX_BYTES, MIB),
}
"""GPM metric -> (DCGM field, factor): GPM gives percentages and MiB/s; DCGM ratios and bytes/s."""

NVLINK_FIELDS = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
_FIELD_IDS: list[int | tuple[int, int]] = [pynvml.NVML_FI_DEV_MEMORY_TEMP] + [
    (fid, link) for link in range(pynvml.NVML_NVLINK_MAX_LINKS) for fid in NVLINK_FIELDS
]

_ABSENT = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission, pynvml.NVMLError_NotFound,
           pynvml.NVMLError_FunctionNotFound)


@dataclass(frozen=True)
class DeviceReading:
    """One device's field values (DCGM field name -> value in dcgm-exporter's unit) from one pass."""

    gpu_index: int
    gpu_uuid: str
    values: Mapping[str, float]
    mig: MigDeviceInfo | None = None
    """Set for a MIG device's reading."""

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu_uuid


class _Counting:
    """The library, counting every call made through it."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.calls = 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._lib, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            return fn(*args)

        return call


@dataclass
class _GpmState:
    supported: bool | None = None
    previous: dict[int | None, Any] = field(default_factory=dict)
    """The last GPM sample by GPU-instance id (None: the whole GPU)."""


class FieldReader:
    """Reads every device's fields; keeps the previous GPM samples and MIG handles between passes.
    Call only on the NVML thread."""

    def __init__(self, backend: NvmlBackend) -> None:
        self._backend = backend
        self._lib = _Counting(backend.lib)
        self._gpm: dict[str, _GpmState] = {}
        self._mig_handles: dict[str, Any] = {}
        self._mig_key: tuple[str, ...] = ()
        self.calls = 0
        """NVML calls the last pass made."""
        self._start = 0

    def note_allocated(self, device_ids: Collection[str]) -> None:
        """Tell a simulated driver which devices containers hold, so it can model their load (the real
        library has no such call, and none is made)."""
        simulate = getattr(self._backend.lib, "simulate_allocations", None)
        if simulate is not None:
            simulate(device_ids)

    def read(self, inventory: NodeInventory) -> tuple[DeviceReading, ...]:
        """One pass over every GPU (`begin`, then `read_gpu` for each)."""
        self.begin(inventory)
        readings = [r for gpu in inventory.gpus for r in self.read_gpu(inventory, gpu)]
        return tuple(readings)

    def begin(self, inventory: NodeInventory) -> None:
        """Start a pass: the MIG devices' handles taken again where the layout changed, the calls counted anew."""
        self._start = self._lib.calls
        self._refresh_mig_handles(inventory)

    def read_gpu(self, inventory: NodeInventory, gpu: GpuInfo) -> list[DeviceReading]:
        """The readings of one GPU and its MIG devices (none for a GPU off the bus, as with dcgm-exporter)."""
        readings: list[DeviceReading] = []
        handles = self._backend.handles
        h = handles[gpu.index] if gpu.index < len(handles) else None
        if gpu.lost or h is None:
            self._forget_gpm(gpu.uuid)
            return readings
        try:
            values = self._gpu_values(h)
            gpm = self._gpm.setdefault(gpu.uuid, _GpmState())
            values.update(self._gpm_values(h, gpm, None))
            readings.append(DeviceReading(gpu.index, gpu.uuid, values))
            for mig in (m for m in inventory.mig_devices if m.parent_index == gpu.index):
                mig_values = self._mig_values(mig)
                mig_values.update(self._gpm_values(h, gpm, mig.gpu_instance_id))
                readings.append(DeviceReading(gpu.index, gpu.uuid, mig_values, mig))
        except pynvml.NVMLError_GpuIsLost:
            # A GPU off the bus has no series until it answers again, as with dcgm-exporter.
            self._forget_gpm(gpu.uuid)
            return []
        except pynvml.NVMLError as err:
            log.warning("GPU %s: telemetry read failed: %s", gpu.uuid, err)
            return readings
        finally:
            self.calls = self._lib.calls - self._start
        return readings

    def close(self) -> None:
        for uuid in list(self._gpm):
            self._forget_gpm(uuid)

    # -- per device ------------------------------------------------------------------------------------

    def _probe(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except _ABSENT:
            return None

    def _gpu_values(self, h: Any) -> dict[str, float]:
        lib = self._lib
        probe = self._probe
        values: dict[str, float] = {}

        def put(name: str, value: float | None) -> None:
            if value is not None:
                values[name] = value

        put(SM_CLOCK, probe(lambda: lib.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)))
        put(MEM_CLOCK, probe(lambda: lib.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)))
        fields = probe(lambda: lib.nvmlDeviceGetFieldValues(h, _FIELD_IDS))
        if fields is not None:
            nvlink, links = 0, 0
            for item in fields:
                if item.nvmlReturn != pynvml.NVML_SUCCESS:
                    continue
                if item.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                    put(MEMORY_TEMP, _field_number(item))
                else:
                    nvlink += int(_field_number(item))
                    links += 1
            if links:
                put(NVLINK_BANDWIDTH_TOTAL, nvlink)
        put(GPU_TEMP, probe(lambda: lib.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)))
        power = probe(lambda: lib.nvmlDeviceGetPowerUsage(h))
        put(POWER_USAGE, None if power is None else int(power) / 1000)
        put(TOTAL_ENERGY_CONSUMPTION, probe(lambda: lib.nvmlDeviceGetTotalEnergyConsumption(h)))
        put(PCIE_REPLAY_COUNTER, probe(lambda: lib.nvmlDeviceGetPcieReplayCounter(h)))
        utilization = probe(lambda: lib.nvmlDeviceGetUtilizationRates(h))
        if utilization is not None:
            put(GPU_UTIL, int(utilization.gpu))
            put(MEM_COPY_UTIL, int(utilization.memory))
        encoder = probe(lambda: lib.nvmlDeviceGetEncoderUtilization(h))
        put(ENC_UTIL, None if encoder is None else int(encoder[0]))
        decoder = probe(lambda: lib.nvmlDeviceGetDecoderUtilization(h))
        put(DEC_UTIL, None if decoder is None else int(decoder[0]))
        values.update(self._memory(h))
        mode = probe(lambda: lib.nvmlDeviceGetVirtualizationMode(h))
        if mode is not None:
            put(VGPU_LICENSE_STATUS, self._vgpu_licensed(h) if mode == pynvml.NVML_GPU_VIRTUALIZATION_MODE_VGPU else 0)
        remapped = probe(lambda: lib.nvmlDeviceGetRemappedRows(h))
        if remapped is not None:
            put(CORRECTABLE_REMAPPED_ROWS, int(remapped[0]))
            put(UNCORRECTABLE_REMAPPED_ROWS, int(remapped[1]))
            put(ROW_REMAP_FAILURE, int(remapped[3]))
        return values

    def _vgpu_licensed(self, h: Any) -> int | None:
        features = self._probe(lambda: self._lib.nvmlDeviceGetGridLicensableFeatures(h))
        if features is None:
            return None
        count = int(features.licensableFeaturesCount)
        return int(any(int(f.featureState) == 1 for f in features.gridLicensableFeatures[:count]))

    def _memory(self, h: Any) -> dict[str, float]:
        memory = self._probe(lambda: self._lib.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2))
        if memory is None:
            return {}
        return {FB_FREE: int(memory.free) // MIB, FB_USED: int(memory.used) // MIB,
                FB_RESERVED: int(memory.reserved) // MIB}

    def _mig_values(self, mig: MigDeviceInfo) -> dict[str, float]:
        h = self._mig_handles.get(mig.uuid)
        return {} if h is None else self._memory(h)

    def _refresh_mig_handles(self, inventory: NodeInventory) -> None:
        key = tuple(m.uuid for m in inventory.mig_devices)
        if key == self._mig_key:
            return
        lib = self._lib
        self._mig_handles = {}
        wanted = set(key)
        for gpu in inventory.gpus:
            if not gpu.mig_enabled or gpu.lost or gpu.index >= len(self._backend.handles):
                continue
            with contextlib.suppress(pynvml.NVMLError):
                h = self._backend.handle(gpu.index)
                for slot in range(int(lib.nvmlDeviceGetMaxMigDeviceCount(h))):
                    try:
                        mh = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
                    except pynvml.NVMLError_NotFound:
                        continue
                    uuid = _text(lib.nvmlDeviceGetUUID(mh))
                    if uuid in wanted:
                        self._mig_handles[uuid] = mh
        self._mig_key = key

    # -- GPM -------------------------------------------------------------------------------------------

    def _gpm_values(self, h: Any, state: _GpmState, gi_id: int | None) -> dict[str, float]:
        lib = self._lib
        if state.supported is None:
            support = self._probe(lambda: lib.nvmlGpmQueryDeviceSupport(h))
            state.supported = support is not None and bool(support.isSupportedDevice)
        if not state.supported:
            return {}
        sample = lib.nvmlGpmSampleAlloc()
        try:
            if gi_id is None:
                lib.nvmlGpmSampleGet(h, sample)
            else:
                lib.nvmlGpmMigSampleGet(h, gi_id, sample)
        except _ABSENT:
            # A GPU instance without a compute instance has no sample: its PROF fields are absent this pass.
            lib.nvmlGpmSampleFree(sample)
            return {}
        except pynvml.NVMLError:
            lib.nvmlGpmSampleFree(sample)
            raise
        previous = state.previous.get(gi_id)
        state.previous[gi_id] = sample
        if previous is None:
            return {}
        try:
            request = pynvml.c_nvmlGpmMetricsGet_t()
            request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(GPM_METRICS)
            request.sample1 = previous
            request.sample2 = sample
            for i, metric in enumerate(GPM_METRICS):
                request.metrics[i].metricId = metric
            result = self._probe(lambda: lib.nvmlGpmMetricsGet(request))
        finally:
            lib.nvmlGpmSampleFree(previous)
        if result is None:
            return {}
        values: dict[str, float] = {}
        for i in range(len(GPM_METRICS)):
            metric = result.metrics[i]
            if metric.nvmlReturn == pynvml.NVML_SUCCESS and int(metric.metricId) in GPM_METRICS:
                name, factor = GPM_METRICS[int(metric.metricId)]
                values[name] = float(metric.value) * factor
        return values

    def _forget_gpm(self, uuid: str) -> None:
        state = self._gpm.pop(uuid, None)
        if state is None:
            return
        for sample in state.previous.values():
            with contextlib.suppress(pynvml.NVMLError):
                self._lib.nvmlGpmSampleFree(sample)


def _field_number(item: Any) -> float:
    kind = int(item.valueType)
    value = item.value
    if kind == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(value.dVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return int(value.uiVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(value.ulVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(value.sllVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return int(value.siVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return int(value.usVal)
    return int(value.ullVal)


def _text(value: Any) -> str:
    return value.decode(errors="replace").rstrip("\x00") if isinstance(value, bytes) else str(value)
