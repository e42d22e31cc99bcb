"""The fake NVML's fault injection and simulated operator actions: XIDs, lost GPUs, ECC and row-remap
states, busy GPUs, a missing driver, GPU resets and reboots, and failures of the next calls of a function.
None of these is a pynvml function; none needs nvmlInit."""

from __future__ import annotations

from collections import deque

import pynvml

from agent.nvml.fake_calls import FakeCalls
from agent.nvml.fake_state import API_FUNCTIONS, WHOLE_GPU, GpuState, fault_call, nvml_error


class FakeFaults(FakeCalls):
    """Fault injection and simulated operator actions (not pynvml functions; no nvmlInit needed)."""

    @fault_call
    def inject_xid(
        self, gpu_index: int, xid: int, gi_id: int | None = None, ci_id: int | None = None
    ) -> None:
        """Raise an XID critical-error event on a GPU (or on one of its MIG devices)."""
        self._check_gpu_index(gpu_index)
        if ci_id is not None and gi_id is None:
            raise ValueError("ci_id needs gi_id")
        gi = WHOLE_GPU if gi_id is None else gi_id
        ci = WHOLE_GPU if ci_id is None else ci_id
        self._record_event(gpu_index, pynvml.nvmlEventTypeXidCriticalError, xid, gi, ci)

    @fault_call
    def set_gpu_lost(self, gpu_index: int, lost: bool = True, *, keep_handle: bool = False) -> None:
        """A lost GPU (fallen off the bus) answers every call about it with GpuIsLost. NVML shows one in either of
        two ways: it gives no handle for it (nvmlDeviceGetHandleByIndex and the other lookups fail with GpuIsLost),
        or, with `keep_handle`, it gives the handle and every call on it fails with GpuIsLost."""
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        state.lost = lost
        state.lost_keeps_handle = lost and keep_handle

    def lose_after(self, gpu_index: int, changes: int, *, keep_handle: bool = False) -> None:
        """Make GPU `gpu_index` fall off the bus right after the `changes`-th state-changing NVML call from now (a
        MIG mode change, a GPU or compute instance made or destroyed), as set_gpu_lost would: the GPU lost in the
        middle of a MIG apply. In this process only (the state file learns it with the next change)."""
        self._check_gpu_index(gpu_index)
        if changes < 1:
            raise ValueError(f"changes must be at least 1, got {changes}")
        with self._lock:
            self._lose_at = (self._changes + changes, gpu_index, keep_handle)

    @fault_call
    def set_hung(self, gpu_index: int | None = None, hung: bool = True) -> None:
        """Make every NVML call about GPU `gpu_index` block (None: every call, the whole driver) until it is
        unhung, as the calls of a GPU off the bus or of a wedged driver do; a call already blocked returns once
        unhung."""
        if gpu_index is None:
            self._state.driver_hung = hung
        else:
            self._check_gpu_index(gpu_index)
            self._gpu_state(gpu_index).hung = hung
        self._events_ready.notify_all()  # the calls blocked in this process look again

    @fault_call
    def set_ecc_uncorrected(self, gpu_index: int, count: int) -> None:
        """Set the volatile uncorrected ECC count; a rise also adds to the aggregate count and raises a
        double-bit ECC event."""
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        rise = count - state.ecc_uncorrected_volatile
        state.ecc_uncorrected_volatile = count
        if rise > 0:
            state.ecc_uncorrected_aggregate += rise
            self._record_event(gpu_index, pynvml.nvmlEventTypeDoubleBitEccError, 0, WHOLE_GPU, WHOLE_GPU)

    @fault_call
    def set_ecc_corrected(self, gpu_index: int, count: int) -> None:
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        state.ecc_corrected_aggregate += max(0, count - state.ecc_corrected_volatile)
        state.ecc_corrected_volatile = count

    @fault_call
    def set_remapped_rows(
        self,
        gpu_index: int,
        pending: bool = False,
        failure: bool = False,
        correctable: int = 0,
        uncorrectable: int = 0,
    ) -> None:
        gpu = self._check_gpu_index(gpu_index)
        if gpu.model.architecture < pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise ValueError(f"GPU {gpu_index} ({gpu.model.key}) retires pages instead of remapping rows")
        state = self._gpu_state(gpu_index)
        state.remap_pending, state.remap_failure = pending, failure
        state.remapped_correctable, state.remapped_uncorrectable = correctable, uncorrectable

    @fault_call
    def set_retired_pages_pending(self, gpu_index: int, pending: bool = True) -> None:
        gpu = self._check_gpu_index(gpu_index)
        if gpu.model.architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise ValueError(f"GPU {gpu_index} ({gpu.model.key}) remaps rows instead of retiring pages")
        self._gpu_state(gpu_index).retired_pages_pending = pending

    @fault_call
    def set_clocks_event_reasons(self, gpu_index: int, reasons: int) -> None:
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).clocks_event_reasons = reasons

    @fault_call
    def set_temperature(self, gpu_index: int, celsius: int) -> None:
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).temperature_c = celsius

    @fault_call
    def set_power_usage(self, gpu_index: int, milliwatts: int) -> None:
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).power_mw = milliwatts

    @fault_call
    def set_utilization(self, gpu_index: int, gpu_percent: int, memory_percent: int = 0) -> None:
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        state.utilization_gpu, state.utilization_memory = gpu_percent, memory_percent

    @fault_call
    def set_gpu_busy(self, gpu_index: int, busy: bool = True) -> None:
        """Mark the GPU as held by clients: MIG mode changes stay pending and resets fail with InUse."""
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).busy = busy

    @fault_call
    def set_driver_loaded(self, loaded: bool = True) -> None:
        """Without the driver, nvmlInit raises DriverNotLoaded."""
        self._state.driver_loaded = loaded

    @fault_call
    def reset_gpu(self, gpu_index: int) -> None:
        """What ``nvidia-smi -r`` does: apply a pending MIG mode, drop the MIG layout, clear volatile ECC
        counts and apply pending row remaps or page retirements. Fails with InUse while the GPU has
        clients and with GpuIsLost for a lost GPU."""
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        if state.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if state.busy:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        self._reset(state)

    @fault_call
    def reboot(self) -> None:
        """A node reboot: every GPU is reset and loses its clients; MIG modes persist, layouts do not."""
        for gpu in self.spec.gpus:
            state = self._gpu_state(gpu.index)
            state.busy = False
            self._reset(state)

    def _reset(self, state: GpuState) -> None:
        state.mig_current = state.mig_pending
        self._clear_layout(state)
        state.ecc_corrected_volatile = 0
        state.ecc_uncorrected_volatile = 0
        state.remap_pending = False
        state.retired_pages_pending = False

    def fail_next(self, function_name: str, error_code: int, times: int = 1) -> None:
        """Make the next ``times`` calls of a pynvml function raise ``NVMLError(error_code)``. An alias
        (``...ProfileInfoV``) fails together with the function it names, as in pynvml."""
        function = getattr(type(self), function_name, None)
        name = getattr(function, "__name__", None)
        if name not in API_FUNCTIONS:
            raise ValueError(f"FakeNvml has no pynvml function {function_name!r}")
        if error_code not in pynvml.NVMLError._valClassMapping:
            raise ValueError(f"unknown NVML error code {error_code}")
        with self._lock:
            self._failures.setdefault(str(name), deque()).extend([error_code] * times)
