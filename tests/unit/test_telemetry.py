"""dcgm-exporter's default counters from the fake NVML: names, types, units and labels as dcgm-exporter serves
them, values that move with load, and absent (not zero) where the GPU has no such reading."""

from __future__ import annotations

import csv
from pathlib import Path

import pynvml
import pytest

from agent.config import ConfigError, parse_config
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.fields import FieldReader
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import load_node
from agent.state import NodeState
from agent.telemetry.collector import Holder, Snapshot, holders_by_device
from agent.telemetry.exposition import render
from agent.telemetry.fields import FIELDS
from tests.builders import exposition_samples

FIXTURES = Path(__file__).parents[1] / "fixtures" / "dcgm-exporter"
H100_MIB = 81559
"""nvmlDeviceGetMemoryInfo total of an H100 80GB HBM3, in MiB."""


def upstream_counters() -> list[tuple[str, str, str]]:
    """(field, type, help) of every line not commented out in dcgm-exporter's default-counters.csv."""
    rows = []
    with open(FIXTURES / "default-counters.csv") as f:
        for row in csv.reader(f):
            if not row or row[0].lstrip().startswith("#"):
                continue
            rows.append((row[0].strip(), row[1].strip(), ",".join(row[2:]).strip()))
    return rows


class Node:
    """A fake node, its NVML backend and a reader, with a clock the test moves."""

    def __init__(self, preset: str) -> None:
        self.fake = FakeNvml(load_node(preset))
        self.now = 1000.0
        self.fake.telemetry_clock = lambda: self.now  # type: ignore[method-assign]
        self.backend = NvmlBackend(lib=self.fake, numa_lookup=self.fake.numa_node)
        self.backend.init()
        self.reader = FieldReader(self.backend)
        self.holders: dict[str, tuple[Holder, ...]] = {}
        self.last_xid: dict[str, int] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the inventory again (the agent does after a MIG change)."""
        self.inventory = self.backend.inventory()

    def state(self) -> NodeState:
        return NodeState(version=1, inventory=self.inventory, config=parse_config("version: v1\n"))

    def scrape(self, seconds: float = 10.0) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Advance the clock, take one pass, and parse the exposition as Prometheus would."""
        self.now += seconds
        state = self.state()
        self.reader.note_allocated(self.holders)
        snapshot = Snapshot(self.reader.read(state.inventory), self.holders, self.last_xid)
        return exposition_samples(render(snapshot, state, "gpu-node-1").decode())

    def value(self, scraped: dict[str, list[tuple[dict[str, str], float]]], name: str, gpu: int) -> float:
        [value] = [v for labels, v in scraped[name] if labels["gpu"] == str(gpu) and "GPU_I_ID" not in labels]
        return value


def test_the_catalogue_is_dcgm_exporters_default_set() -> None:
    upstream = upstream_counters()
    assert len(upstream) == 26
    assert [(f.name, f.kind, f.help) for f in FIELDS] == upstream


def test_every_default_counter_with_dcgm_exporters_labels_and_types() -> None:
    node = Node("dgx-h100")
    node.scrape()
    text = render(Snapshot(node.reader.read(node.state().inventory)), node.state(), "gpu-node-1").decode()
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert types == {name: kind for name, kind, _ in upstream_counters() if kind != "label"}
    scraped = node.scrape()
    gpu = node.inventory.gpus[3]
    [(labels, _)] = [s for s in scraped["DCGM_FI_DEV_GPU_TEMP"] if s[0]["gpu"] == "3"]
    assert labels == {
        "gpu": "3", "UUID": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "device": "nvidia3",
        "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-node-1", "DCGM_FI_DRIVER_VERSION": "570.133.20",
    }
    assert gpu.pci_bus_id.startswith("00000000:")
    for name, kind, _ in upstream_counters():
        if kind != "label":
            assert sorted(int(labels["gpu"]) for labels, _ in scraped[name]) == list(range(8)), name


def test_an_idle_gpu_reads_what_nvml_says_in_dcgm_units() -> None:
    node = Node("dgx-h100")
    node.fake.set_temperature(2, 51)
    node.fake.set_power_usage(2, 123_456)
    node.fake.set_remapped_rows(2, correctable=3, uncorrectable=1, failure=True)
    scraped = node.scrape()
    assert node.value(scraped, "DCGM_FI_DEV_GPU_TEMP", 2) == 51
    assert node.value(scraped, "DCGM_FI_DEV_POWER_USAGE", 2) == 123.456
    assert node.value(scraped, "DCGM_FI_DEV_GPU_UTIL", 2) == 0
    assert node.value(scraped, "DCGM_FI_DEV_FB_USED", 2) == 0
    assert node.value(scraped, "DCGM_FI_DEV_MEM_CLOCK", 2) == 2619
    assert node.value(scraped, "DCGM_FI_DEV_SM_CLOCK", 2) == 345
    fb = [node.value(scraped, f"DCGM_FI_DEV_FB_{k}", 2) for k in ("FREE", "USED", "RESERVED")]
    assert sum(fb) == H100_MIB and fb[2] > 0
    assert node.value(scraped, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", 2) == 3
    assert node.value(scraped, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 2) == 1
    assert node.value(scraped, "DCGM_FI_DEV_ROW_REMAP_FAILURE", 2) == 1
    assert node.value(scraped, "DCGM_FI_DEV_ROW_REMAP_FAILURE", 3) == 0
    assert node.value(scraped, "DCGM_FI_DEV_VGPU_LICENSE_STATUS", 2) == 0
    assert node.value(scraped, "DCGM_FI_DEV_XID_ERRORS", 2) == 0


def test_energy_is_power_integrated_over_time_in_millijoules() -> None:
    node = Node("single-h200")
    node.fake.set_power_usage(0, 100_000)
    first = node.value(node.scrape(), "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 0)
    second = node.value(node.scrape(seconds=30), "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 0)
    assert second - first == 100 * 30 * 1000  # 100 W for 30 s is 3 kJ


def test_a_held_gpu_carries_load_and_its_pod_and_the_others_stay_idle() -> None:
    node = Node("dgx-h100")
    gpus = node.inventory.gpus
    node.holders = {gpus[4].uuid: (Holder("ml", "trainer-0", "train"),)}
    before = node.scrape()
    during = node.scrape()
    assert node.value(during, "DCGM_FI_DEV_GPU_UTIL", 4) >= 55
    assert node.value(during, "DCGM_FI_DEV_GPU_TEMP", 4) > node.value(during, "DCGM_FI_DEV_GPU_TEMP", 5)
    assert node.value(during, "DCGM_FI_DEV_POWER_USAGE", 4) > 300
    assert node.value(during, "DCGM_FI_DEV_FB_USED", 4) > H100_MIB / 3
    assert node.value(during, "DCGM_FI_DEV_SM_CLOCK", 4) > 1500
    assert node.value(during, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 4) > 0
    assert node.value(during, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", 4) > node.value(
        before, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", 4)
    assert node.value(during, "DCGM_FI_DEV_GPU_UTIL", 5) == 0
    assert node.value(during, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", 5) == 0
    held = [labels for labels, _ in during["DCGM_FI_DEV_GPU_UTIL"] if "pod" in labels]
    assert [(h["gpu"], h["pod"], h["namespace"], h["container"]) for h in held] == [("4", "trainer-0", "ml", "train")]
    node.holders = {}
    node.scrape()
    after = node.scrape()
    assert not [labels for labels, _ in after["DCGM_FI_DEV_GPU_UTIL"] if "pod" in labels]
    assert node.value(after, "DCGM_FI_DEV_GPU_UTIL", 4) == 0


def test_values_move_over_time_under_load() -> None:
    node = Node("single-h200")
    node.holders = {node.inventory.gpus[0].uuid: (Holder("ml", "p", "c"),)}
    temperatures = {node.value(node.scrape(seconds=20), "DCGM_FI_DEV_GPU_TEMP", 0) for _ in range(6)}
    assert len(temperatures) >= 3


def test_profiling_fields_need_gpm_and_two_samples() -> None:
    hopper = Node("dgx-h100")
    first = hopper.scrape()
    assert not [n for n in first if n.startswith("DCGM_FI_PROF_")]
    second = hopper.scrape()
    for name in ("GR_ENGINE_ACTIVE", "PIPE_TENSOR_ACTIVE", "DRAM_ACTIVE", "PCIE_TX_BYTES", "PCIE_RX_BYTES"):
        assert len(second[f"DCGM_FI_PROF_{name}"]) == 8
    ampere = Node("dgx-a100")
    ampere.scrape()
    scraped = ampere.scrape()
    assert not [n for n in scraped if n.startswith("DCGM_FI_PROF_")]
    assert len(scraped["DCGM_FI_DEV_GPU_TEMP"]) == 8


def test_nvlink_and_memory_temperature_are_absent_where_the_board_has_none() -> None:
    node = Node("pcie-l40s-4")
    scraped = node.scrape()
    assert "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" not in scraped
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in scraped
    assert len(scraped["DCGM_FI_DEV_GPU_TEMP"]) == 4


def test_a_field_nvml_does_not_support_is_left_out_for_that_gpu_only() -> None:
    node = Node("dgx-h100")
    node.scrape()
    node.fake.fail_next("nvmlDeviceGetPcieReplayCounter", pynvml.NVML_ERROR_NOT_SUPPORTED)
    scraped = node.scrape()
    assert sorted(labels["gpu"] for labels, _ in scraped["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"]) == [
        str(i) for i in range(1, 8)]
    assert len(scraped["DCGM_FI_DEV_GPU_TEMP"]) == 8


def test_a_lost_gpu_has_no_series() -> None:
    node = Node("dgx-h100")
    node.scrape()
    node.fake.set_gpu_lost(6)
    scraped = node.scrape()
    assert sorted(int(labels["gpu"]) for labels, _ in scraped["DCGM_FI_DEV_GPU_TEMP"]) == [0, 1, 2, 3, 4, 5, 7]


def test_the_last_xid_with_its_code_and_message() -> None:
    node = Node("dgx-h100")
    uuid = node.inventory.gpus[1].uuid
    node.last_xid = {uuid: 48}
    [(labels, value)] = [s for s in node.scrape()["DCGM_FI_DEV_XID_ERRORS"] if s[0]["gpu"] == "1"]
    assert value == 48
    assert (labels["err_code"], labels["err_msg"]) == ("48", "Double Bit ECC Error")
    node.last_xid = {uuid: 999}
    [(labels, value)] = [s for s in node.scrape()["DCGM_FI_DEV_XID_ERRORS"] if s[0]["gpu"] == "1"]
    assert (value, labels["err_msg"]) == (999, "Unknown Error")


def mig_node() -> Node:
    node = Node("dgx-h100")
    ops = MigOps(node.backend)
    ops.set_mode(0, True)
    ops.create(0, "3g.40gb", 0)
    ops.create(0, "1g.10gb", 4)
    node.refresh()
    return node


def test_mig_devices_carry_their_profile_and_instance_and_their_pod() -> None:
    node = mig_node()
    migs = node.inventory.mig_devices
    assert [m.profile for m in migs] == ["3g.40gb", "1g.10gb"]
    node.holders = {migs[1].uuid: (Holder("ml", "small-0", "main"),)}
    node.scrape()
    scraped = node.scrape()
    mig_series = sorted((labels["GPU_I_PROFILE"], labels["GPU_I_ID"], labels.get("pod", ""))
                        for labels, _ in scraped["DCGM_FI_DEV_FB_USED"] if "GPU_I_ID" in labels)
    assert mig_series == [("1g.10gb", str(migs[1].gpu_instance_id), "small-0"),
                          ("3g.40gb", str(migs[0].gpu_instance_id), "")]
    [(labels, _)] = [s for s in scraped["DCGM_FI_DEV_FB_USED"] if s[0].get("GPU_I_PROFILE") == "1g.10gb"]
    assert (labels["gpu"], labels["UUID"], labels["device"]) == ("0", node.inventory.gpus[0].uuid,
                                                                 "nvidia0")
    assert len([s for s in scraped["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] if "GPU_I_ID" in s[0]]) == 2
    # GPU-wide fields stay on the GPU's own series: MIG devices have none of their own.
    assert not [s for s in scraped["DCGM_FI_DEV_GPU_TEMP"] if "GPU_I_ID" in s[0]]
    # NVML reports no utilisation rates with MIG on: absent, not zero.
    assert "0" not in {labels["gpu"] for labels, _ in scraped["DCGM_FI_DEV_GPU_UTIL"]}


def test_replicas_count_for_their_gpu_and_each_container_gets_a_series() -> None:
    class Found:
        def __init__(self, namespace: str, pod: str, container: str, device_id: str) -> None:
            self.namespace, self.pod, self.container, self.device_id = namespace, pod, container, device_id

    grouped = holders_by_device([
        Found("ml", "b", "c", "GPU-1::2"), Found("ml", "a", "c", "GPU-1::1"), Found("ml", "a", "c", "GPU-1::3"),
        Found("web", "x", "y", "MIG-9"),
    ])
    assert grouped == {"GPU-1": (Holder("ml", "a", "c"), Holder("ml", "b", "c")), "MIG-9": (Holder("web", "x", "y"),)}
    node = Node("single-h200")
    node.holders = {node.inventory.gpus[0].uuid: grouped["GPU-1"]}
    pods = sorted(labels["pod"] for labels, _ in node.scrape()["DCGM_FI_DEV_GPU_TEMP"])
    assert pods == ["a", "b"]


def test_nvml_calls_per_pass_are_bounded() -> None:
    node = Node("dgx-h100")
    node.scrape()
    node.scrape()
    # 8 GPUs: 13 reads each, and 4 for GPM (allocate, sample, metrics, free the last sample).
    assert node.reader.calls == 8 * 17
    ampere = Node("dgx-a100")  # no GPM
    ampere.scrape()
    ampere.scrape()
    assert ampere.reader.calls == 8 * 13
    mig = mig_node()  # two MIG devices on GPU 0: memory and GPM each
    mig.scrape()
    mig.scrape()
    assert mig.reader.calls == 8 * 17 + 2 * 5


def test_the_switch_and_the_interval_in_the_config() -> None:
    config = parse_config("version: v1\ntelemetry: {dcgmMetrics: false, intervalSeconds: 30}\n")
    assert (config.telemetry.dcgm_metrics, config.telemetry.interval_seconds) == (False, 30)
    default = parse_config("version: v1\n")
    assert (default.telemetry.dcgm_metrics, default.telemetry.interval_seconds) == (True, 10)
    with pytest.raises(ConfigError) as err:
        parse_config("version: v1\ntelemetry: {intervalSeconds: 0}\n")
    assert "telemetry.intervalSeconds" in str(err.value)
    assert "\n" not in str(err.value).strip()


def test_every_call_a_pass_makes_is_a_pynvml_function_with_the_fakes_signature() -> None:
    import inspect

    from agent.nvml import fields as nvfields

    node = mig_node()
    called: list[str] = []
    original = nvfields._Counting.__getattr__

    def spy(self: nvfields._Counting, name: str) -> object:
        called.append(name)
        return original(self, name)

    nvfields._Counting.__getattr__ = spy  # type: ignore[method-assign]
    try:
        node.reader = FieldReader(node.backend)
        node.scrape()
        node.scrape()
    finally:
        nvfields._Counting.__getattr__ = original  # type: ignore[method-assign]
    assert {"nvmlGpmMetricsGet", "nvmlGpmMigSampleGet", "nvmlDeviceGetFieldValues",
            "nvmlDeviceGetMigDeviceHandleByIndex"} <= set(called)
    for name in sorted(set(called)):
        real = getattr(pynvml, name)
        fake = getattr(FakeNvml, name)
        real_params = [p for p in inspect.signature(real).parameters.values()]
        fake_params = [p for p in inspect.signature(fake).parameters.values()][1:]  # without self
        assert [p.name for p in fake_params] == [p.name for p in real_params], name


def test_a_mig_device_nvml_has_no_gpm_sample_for_loses_only_its_profiling_fields() -> None:
    node = mig_node()
    node.scrape()
    node.fake.fail_next("nvmlGpmMigSampleGet", pynvml.NVML_ERROR_NOT_FOUND)
    scraped = node.scrape()
    assert len([s for s in scraped["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] if "GPU_I_ID" in s[0]]) == 1
    assert len([s for s in scraped["DCGM_FI_DEV_FB_USED"] if "GPU_I_ID" in s[0]]) == 2
    assert len(scraped["DCGM_FI_DEV_GPU_TEMP"]) == 8
