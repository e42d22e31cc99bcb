"""The fake NVML's telemetry: clocks, energy, field values, encoder/decoder use, GPM, and a load model.

A GPU is idle unless it is marked busy (``set_gpu_busy``), a container holds it or one of its MIG devices
(``simulate_allocations``, which the agent calls with the devices the kubelet reports as held), its
utilisation was set (``set_utilization``), or its workload is pinned (``set_workload``). An idle GPU reads
exactly what its state says (temperature, power, utilisation: the values the fault-injection methods set). A
loaded one runs hotter, draws more power, clocks up, fills memory and moves data, with a slow wave on top so
dashboards show it alive; energy and NVLink counters are integrals of power and traffic over time and only ever
rise.

:class:`FakeTelemetry` is a mixin of :class:`agent.nvml.fake.FakeNvml`; its pynvml-named methods behave like the
others there (injected failures, the init check, GpuIsLost for a lost GPU).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import pynvml

if TYPE_CHECKING:
    from agent.nvml.nodefile import NodeSpec

P = ParamSpec("P")
R = TypeVar("R")

TELEMETRY_FUNCTIONS: set[str] = set()
"""Names of the pynvml functions this mixin implements."""

LOAD_PERIOD_S = 120.0
"""Period of the wave a loaded GPU's figures follow."""


@dataclass(frozen=True)
class _Envelope:
    sm_max_mhz: int
    mem_mhz: int
    max_power_w: int
    hbm: bool
    """HBM reports a memory temperature; GDDR boards do not."""


_ENVELOPES: dict[str, _Envelope] = {
    "A100-SXM4-40GB": _Envelope(1410, 1215, 400, True),
    "A100-SXM4-80GB": _Envelope(1410, 1593, 400, True),
    "H100-SXM5-80GB": _Envelope(1980, 2619, 700, True),
    "H200-141GB": _Envelope(1980, 3201, 700, True),
    "L40S": _Envelope(2520, 9001, 350, False),
    "T4": _Envelope(1590, 5001, 70, False),
}
_DEFAULT_ENVELOPE = _Envelope(1500, 1500, 300, True)
IDLE_SM_MHZ = 345
NVLINK_KIB_PER_S = 25e9 / 1024
"""Data a fully loaded NVLink moves each second, each way."""
RESERVED_SHARE = 0.0065
"""Framebuffer the driver reserves, as a share of the total (about 530 MiB on an 80 GB GPU)."""

KIND_GPM_SAMPLE = 0x7E


def _error(code: int) -> pynvml.NVMLError:
    error: pynvml.NVMLError = pynvml.NVMLError(code)
    return error


def _telemetry_api(fn: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """As the fake's own API wrapper: injected failures first, then the init check, then a state refresh."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            self._take_injected_failure(name)
            if self._refcount == 0:
                raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
            self._sync()
            return fn(self, *args, **kwargs)

    TELEMETRY_FUNCTIONS.add(name)
    return call


@dataclass
class _GpmSample:
    gpu: int
    gpu_instance: int | None
    taken_at: float | None = None
    activity: tuple[float, ...] = ()


class FakeTelemetry:
    """Telemetry calls and the load model; mixed into FakeNvml."""

    telemetry_clock: Callable[[], float] = staticmethod(time.monotonic)
    """Seconds on a monotonic clock; tests replace it to move time."""

    if TYPE_CHECKING:
        spec: NodeSpec
        _lock: threading.RLock
        _refcount: int
        _links: list[list[Any]]

        def _device(self, handle: Any, *, allow_mig: bool = False, check_lost: bool = True) -> Any: ...
        def _gpu_state(self, index: int) -> Any: ...
        def _mig_parts(self, ref: Any) -> tuple[Any, Any]: ...
        def _take_injected_failure(self, name: str) -> None: ...
        def _sync(self) -> None: ...
        def mig_uuid(self, gpu_index: int, gi_id: int, ci_id: int) -> str: ...

    # --- the load model ------------------------------------------------------------------------------

    def _telemetry(self) -> dict[str, Any]:
        """This instance's telemetry bookkeeping (not persisted: it is per process, like a sampling window)."""
        found: dict[str, Any] | None = self.__dict__.get("_telemetry_state")
        if found is None:
            found = {"allocated": frozenset(), "workload": {}, "energy": {}, "nvlink": {}, "gpm": {},
                     "next_sample": 1}
            self.__dict__["_telemetry_state"] = found
        return found

    def simulate_allocations(self, device_ids: Collection[str]) -> None:
        """The devices (GPU or MIG UUIDs; replica IDs ``<id>::<n>`` count for their device) containers hold now;
        they carry load until they are left out of a later call. Not a pynvml function."""
        with self._lock:
            self._telemetry()["allocated"] = frozenset(d.split("::", 1)[0] for d in device_ids)

    def set_workload(self, gpu_index: int, utilization: float | None, memory: float | None = None) -> None:
        """Pin a GPU's load (0 to 1) and the share of its memory in use, whoever holds it; None for both goes
        back to the model. Not a pynvml function; not shared through the state file."""
        if not 0 <= gpu_index < len(self.spec.gpus):
            raise IndexError(f"GPU index {gpu_index} out of range 0..{len(self.spec.gpus) - 1}")
        for name, value in (("utilization", utilization), ("memory", memory)):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        with self._lock:
            workloads = self._telemetry()["workload"]
            if utilization is None and memory is None:
                workloads.pop(gpu_index, None)
            else:
                workloads[gpu_index] = (utilization, memory)

    def _envelope(self, index: int) -> _Envelope:
        return _ENVELOPES.get(self.spec.gpus[index].model.key, _DEFAULT_ENVELOPE)

    def _wave(self, index: int, phase: float = 0.0) -> float:
        t = self.telemetry_clock()
        return 0.5 + 0.5 * math.sin(2 * math.pi * t / LOAD_PERIOD_S + index * 0.9 + phase)

    def _device_held(self, index: int, uuid: str | None = None) -> bool:
        allocated = self._telemetry()["allocated"]
        if uuid is not None:
            return uuid in allocated
        if self.spec.gpus[index].uuid in allocated:
            return True
        state = self._gpu_state(index)
        return any(self.mig_uuid(index, gi.id, ci.id) in allocated
                   for gi in state.gpu_instances for ci in gi.compute_instances)

    def _load(self, index: int, mig_uuid: str | None = None) -> float:
        """0 (idle) to 1 (flat out)."""
        pinned = self._telemetry()["workload"].get(index, (None, None))[0]
        if pinned is not None and mig_uuid is None:
            return float(pinned)
        state = self._gpu_state(index)
        base = state.utilization_gpu / 100 if mig_uuid is None else 0.0
        if not (self._device_held(index, mig_uuid) or (state.busy and mig_uuid is None)):
            return base
        return max(base, 0.55 + 0.4 * self._wave(index))

    # Hooks FakeNvml's own readings go through: an idle GPU reads its state unchanged.

    def _live_temperature(self, index: int, celsius: int) -> int:
        return celsius + round(38 * self._load(index))

    def _live_power_mw(self, index: int, milliwatts: int) -> int:
        load = self._load(index)
        if load == 0:
            return milliwatts
        headroom = max(0, self._envelope(index).max_power_w * 1000 - milliwatts)
        return milliwatts + round(headroom * load * 0.9)

    def _live_utilization(self, index: int, gpu_percent: int, memory_percent: int) -> tuple[int, int]:
        load = self._load(index)
        return max(gpu_percent, round(100 * load)), max(memory_percent, round(60 * load))

    def _live_memory(self, index: int, total: int, mig_uuid: str | None = None) -> tuple[int, int]:
        """(used, reserved) bytes of a GPU or MIG device with ``total`` bytes."""
        reserved = 0 if mig_uuid is not None else int(total * RESERVED_SHARE) // (1024 * 1024) * 1024 * 1024
        share = self._telemetry()["workload"].get(index, (None, None))[1] if mig_uuid is None else None
        if share is None:
            load = self._load(index, mig_uuid)
            share = 0.0 if load == 0 else 0.35 + 0.5 * load
        used = int((total - reserved) * share) // (1024 * 1024) * 1024 * 1024
        return used, reserved

    def _integrate(self, book: str, index: int, rate: float) -> float:
        """A counter that rises at ``rate`` per second from the last reading to now."""
        now = self.telemetry_clock()
        counters: dict[int, tuple[float, float]] = self._telemetry()[book]
        last_at, total = counters.get(index, (now, 0.0))
        total += rate * max(0.0, now - last_at)
        counters[index] = (now, total)
        return total

    # --- pynvml functions ----------------------------------------------------------------------------

    @_telemetry_api
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        ref = self._device(handle)
        envelope = self._envelope(ref.gpu)
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return IDLE_SM_MHZ + round((envelope.sm_max_mhz - IDLE_SM_MHZ) * min(1.0, 1.2 * self._load(ref.gpu)))
        if type == pynvml.NVML_CLOCK_MEM:
            return envelope.mem_mhz
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    @_telemetry_api
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        ref = self._device(handle)
        power_mw = self._live_power_mw(ref.gpu, self._gpu_state(ref.gpu).power_mw)
        return int(self._integrate("energy", ref.gpu, power_mw))

    @_telemetry_api
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        self._device(handle)
        return 0

    @_telemetry_api
    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        """[percent, sampling period in µs]; NotSupported with MIG on, like the utilisation rates."""
        ref = self._device(handle)
        if self._gpu_state(ref.gpu).mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [0, 167_000]

    @_telemetry_api
    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        ref = self._device(handle)
        if self._gpu_state(ref.gpu).mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [round(8 * self._load(ref.gpu)), 167_000]

    @_telemetry_api
    def nvmlDeviceGetVirtualizationMode(self, handle: Any) -> int:
        self._device(handle)
        return int(pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE)

    @_telemetry_api
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[int | tuple[int, int]]) -> Any:
        """Memory temperature (HBM only) and NVLink data throughput in KiB per link (scopeId = link); any
        other field answers NotSupported in its nvmlReturn."""
        ref = self._device(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        links = [end for end in self._links[ref.gpu] if end is not None]
        load = self._load(ref.gpu)
        moved = self._integrate("nvlink", ref.gpu, len(links) * NVLINK_KIB_PER_S * load) if links else 0.0
        now_us = int(time.time() * 1e6)
        for i, requested in enumerate(fieldIds):
            fid, scope = requested if isinstance(requested, tuple) else (requested, 0)
            item = values[i]
            item.fieldId, item.scopeId, item.timestamp = fid, scope, now_us
            item.nvmlReturn = pynvml.NVML_SUCCESS
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP and self._envelope(ref.gpu).hbm:
                item.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                item.value.uiVal = self._live_temperature(ref.gpu, self._gpu_state(ref.gpu).temperature_c) + 4
            elif fid in (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX):
                if not links:
                    item.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                elif scope >= len(self._links[ref.gpu]):
                    item.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
                else:
                    item.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    active = self._links[ref.gpu][scope] is not None
                    item.value.ullVal = int(moved / len(links)) if active else 0
            else:
                item.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    # --- GPM (Hopper and later) ----------------------------------------------------------------------

    def _gpm_samples(self) -> dict[int, _GpmSample]:
        samples: dict[int, _GpmSample] = self._telemetry()["gpm"]
        return samples

    def _gpm_sample(self, sample: Any) -> tuple[int, _GpmSample]:
        try:
            address = ctypes.cast(sample, ctypes.c_void_p).value or 0
        except (TypeError, ctypes.ArgumentError):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        found = self._gpm_samples().get(address)
        if address >> 56 != KIND_GPM_SAMPLE or found is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return address, found

    def _gpm_supported(self, index: int) -> bool:
        return bool(self.spec.gpus[index].model.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER)

    @_telemetry_api
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        ref = self._device(device)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(self._gpm_supported(ref.gpu))
        return support

    @_telemetry_api
    def nvmlGpmSampleAlloc(self) -> Any:
        state = self._telemetry()
        token = state["next_sample"]
        state["next_sample"] = token + 1
        address = (KIND_GPM_SAMPLE << 56) | token
        self._gpm_samples()[address] = _GpmSample(gpu=-1, gpu_instance=None)
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    @_telemetry_api
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        address, _ = self._gpm_sample(gpmSample)
        del self._gpm_samples()[address]

    def _take_gpm(self, device: Any, gpu_instance: int | None, gpmSample: Any) -> Any:
        ref = self._device(device)
        if not self._gpm_supported(ref.gpu):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        _, sample = self._gpm_sample(gpmSample)
        mig_uuid = None
        if gpu_instance is not None:
            state = self._gpu_state(ref.gpu)
            gi = next((g for g in state.gpu_instances if g.id == gpu_instance), None)
            if gi is None or not gi.compute_instances:
                raise _error(pynvml.NVML_ERROR_NOT_FOUND)
            mig_uuid = self.mig_uuid(ref.gpu, gi.id, gi.compute_instances[0].id)
        load = self._load(ref.gpu, mig_uuid)
        tensor = load * (0.55 + 0.25 * self._wave(ref.gpu, 1.3)) if load else 0.0
        sample.gpu, sample.gpu_instance, sample.taken_at = ref.gpu, gpu_instance, self.telemetry_clock()
        # Percentages for graphics, tensor and DRAM activity; MiB/s for PCIe.
        sample.activity = (100 * load, 100 * tensor, 100 * load * 0.6, 2800 * load, 5200 * load)
        return gpmSample

    @_telemetry_api
    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        return self._take_gpm(device, None, gpmSample)

    @_telemetry_api
    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        return self._take_gpm(device, int(gpuInstanceId), gpmSample)

    @_telemetry_api
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        if int(metricsGet.version) != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        _, first = self._gpm_sample(metricsGet.sample1)
        _, second = self._gpm_sample(metricsGet.sample2)
        if (first.taken_at is None or second.taken_at is None or (first.gpu, first.gpu_instance)
                != (second.gpu, second.gpu_instance) or second.taken_at < first.taken_at):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        order = {
            pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 0,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 1,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 2,
            pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 3,
            pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 4,
        }
        for i in range(int(metricsGet.numMetrics)):
            metric = metricsGet.metrics[i]
            slot = order.get(int(metric.metricId))
            if slot is None:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            metric.nvmlReturn = pynvml.NVML_SUCCESS
            metric.value = (first.activity[slot] + second.activity[slot]) / 2
        return metricsGet
