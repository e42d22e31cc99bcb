"""dcgm-exporter's default counters: name, Prometheus type, help text, unit, and the NVML call behind each.

Names, types and help texts are those of etc/default-counters.csv in NVIDIA/dcgm-exporter release 4.5.3-4.8.2
(commit 691c92762eb551313c825f6efe4ceeee20982801), so dashboards and alert rules written for dcgm-exporter read the
agent's series unchanged. docs/metrics.md renders this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.nvml import fields as nv

Kind = Literal["gauge", "counter", "label"]
Scope = Literal["gpu", "gpu+mig"]


@dataclass(frozen=True)
class DcgmField:
    name: str
    kind: Kind
    help: str
    unit: str
    nvml: str
    """Where the value comes from."""
    scope: Scope = "gpu"
    """gpu+mig: also reported per MIG device (with GPU_I_PROFILE and GPU_I_ID)."""


FIELDS: tuple[DcgmField, ...] = (
    DcgmField(nv.SM_CLOCK, "gauge", "SM clock frequency (in MHz).", "MHz", "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)"),
    DcgmField(nv.MEM_CLOCK, "gauge", "Memory clock frequency (in MHz).", "MHz",
              "nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)"),
    DcgmField(nv.MEMORY_TEMP, "gauge", "Memory temperature (in C).", "°C",
              "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)"),
    DcgmField(nv.GPU_TEMP, "gauge", "GPU temperature (in C).", "°C",
              "nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU)"),
    DcgmField(nv.POWER_USAGE, "gauge", "Power draw (in W).", "W", "nvmlDeviceGetPowerUsage (mW) / 1000"),
    DcgmField(nv.TOTAL_ENERGY_CONSUMPTION, "counter", "Total energy consumption since boot (in mJ).", "mJ",
              "nvmlDeviceGetTotalEnergyConsumption"),
    DcgmField(nv.PCIE_REPLAY_COUNTER, "counter", "Total number of PCIe retries.", "retries",
              "nvmlDeviceGetPcieReplayCounter"),
    DcgmField(nv.GPU_UTIL, "gauge", "GPU utilization (in %).", "%", "nvmlDeviceGetUtilizationRates().gpu"),
    DcgmField(nv.MEM_COPY_UTIL, "gauge", "Memory utilization (in %).", "%",
              "nvmlDeviceGetUtilizationRates().memory"),
    DcgmField(nv.ENC_UTIL, "gauge", "Encoder utilization (in %).", "%", "nvmlDeviceGetEncoderUtilization()[0]"),
    DcgmField(nv.DEC_UTIL, "gauge", "Decoder utilization (in %).", "%", "nvmlDeviceGetDecoderUtilization()[0]"),
    DcgmField(nv.XID_ERRORS, "gauge", "Value of the last XID error encountered.", "XID",
              "the last nvmlEventTypeXidCriticalError event (0 until one), labels err_code and err_msg"),
    DcgmField(nv.FB_FREE, "gauge", "Framebuffer memory free (in MiB).", "MiB",
              "nvmlDeviceGetMemoryInfo(nvmlMemory_v2).free", "gpu+mig"),
    DcgmField(nv.FB_USED, "gauge", "Framebuffer memory used (in MiB).", "MiB",
              "nvmlDeviceGetMemoryInfo(nvmlMemory_v2).used", "gpu+mig"),
    DcgmField(nv.FB_RESERVED, "gauge", "Framebuffer memory reserved (in MiB).", "MiB",
              "nvmlDeviceGetMemoryInfo(nvmlMemory_v2).reserved", "gpu+mig"),
    DcgmField(nv.NVLINK_BANDWIDTH_TOTAL, "counter", "Total number of NVLink bandwidth counters for all lanes.",
              "KiB", "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX), summed over links; "
              "absent without NVLink"),
    DcgmField(nv.VGPU_LICENSE_STATUS, "gauge", "vGPU License status", "0/1",
              "nvmlDeviceGetVirtualizationMode; 0 unless the GPU runs as a licensed vGPU"),
    DcgmField(nv.UNCORRECTABLE_REMAPPED_ROWS, "counter", "Number of remapped rows for uncorrectable errors", "rows",
              "nvmlDeviceGetRemappedRows()[1]"),
    DcgmField(nv.CORRECTABLE_REMAPPED_ROWS, "counter", "Number of remapped rows for correctable errors", "rows",
              "nvmlDeviceGetRemappedRows()[0]"),
    DcgmField(nv.ROW_REMAP_FAILURE, "gauge", "Whether remapping of rows has failed", "0/1",
              "nvmlDeviceGetRemappedRows()[3]"),
    DcgmField(nv.DRIVER_VERSION, "label", "Driver Version", "", "nvmlSystemGetDriverVersion"),
    DcgmField(nv.PROF_GR_ENGINE_ACTIVE, "gauge", "Ratio of time the graphics engine is active.", "ratio",
              "GPM NVML_GPM_METRIC_GRAPHICS_UTIL / 100; absent without GPM", "gpu+mig"),
    DcgmField(nv.PROF_PIPE_TENSOR_ACTIVE, "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.", "ratio",
              "GPM NVML_GPM_METRIC_ANY_TENSOR_UTIL / 100; absent without GPM", "gpu+mig"),
    DcgmField(nv.PROF_DRAM_ACTIVE, "gauge",
              "Ratio of cycles the device memory interface is active sending or receiving data.", "ratio",
              "GPM NVML_GPM_METRIC_DRAM_BW_UTIL / 100; absent without GPM", "gpu+mig"),
    DcgmField(nv.PROF_PCIE_TX_BYTES, "gauge",
              "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - "
              "in bytes per second.", "B/s", "GPM NVML_GPM_METRIC_PCIE_TX_PER_SEC (MiB/s) x 1048576; absent without "
              "GPM"),
    DcgmField(nv.PROF_PCIE_RX_BYTES, "gauge",
              "The rate of data received over the PCIe bus - including both protocol headers and data payloads - "
              "in bytes per second.", "B/s", "GPM NVML_GPM_METRIC_PCIE_RX_PER_SEC (MiB/s) x 1048576; absent without "
              "GPM"),
)

BY_NAME = {f.name: f for f in FIELDS}

GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName")
"""Labels on every series, in dcgm-exporter's order; MIG series add GPU_I_PROFILE and GPU_I_ID after these, then
Hostname, then DCGM_FI_DRIVER_VERSION, then pod, namespace and container while a container holds the device."""
