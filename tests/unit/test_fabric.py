"""The multi-node NVLink fabric through the NVML boundary: the fake's nvmlDeviceGetGpuFabricInfoV as the driver
answers it, the records the backend reads from it, the node file's `fabric` and `imex_channels`, and the IMEX
channel device nodes read from /dev."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pynvml
import pytest

from agent.cli import main
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import NodeFileError, load_node, parse_node
from agent.nvml.records import FabricInfo, NodeInventory
from agent.nvml.sysfs import dev_imex_channels

GB200_CLUSTER = "5d3c1e2a-8b4f-4c6d-9e7a-1f2b3c4d5e6f"
CLUSTER = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def node(gpus: str, extra: str = "") -> str:
    return f"version: v1\nnvswitch: true\ngpus:\n{gpus}{extra}"


def fabric_gpu(numa: int = 0, cluster: str = CLUSTER, clique: int = 7, more: str = "") -> str:
    return f"  - {{model: GB200, numa_node: {numa}, fabric: {{cluster_uuid: {cluster}, clique_id: {clique}{more}}}}}\n"


def inventory_of(text: str) -> NodeInventory:
    backend = fake_backend(FakeNvml(parse_node(text, "node.yaml")))
    backend.init()
    return backend.inventory()


def started(source: str) -> FakeNvml:
    fake = FakeNvml(load_node(source))
    fake.nvmlInit()
    return fake


def errors(text: str) -> list[str]:
    with pytest.raises(NodeFileError) as caught:
        parse_node(text, "node.yaml")
    return caught.value.lines


def test_the_fake_fills_the_v2_struct_as_the_driver_does() -> None:
    fake = started("gb200-nvl72-tray")
    info = pynvml.c_nvmlGpuFabricInfoV_t()
    assert fake.nvmlDeviceGetGpuFabricInfoV(fake.nvmlDeviceGetHandleByIndex(2), ctypes.byref(info)) == 0
    assert bytes(info.clusterUuid).hex() == "5d3c1e2a8b4f4c6d9e7a1f2b3c4d5e6f"
    assert (info.version, info.cliqueId, info.state, info.status, info.healthMask) == (0x02000024, 1, 3, 0, 0)


def test_the_v3_struct_and_the_call_older_drivers_have() -> None:
    fake = started("gb300-nvl72-tray")
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    v3 = pynvml.c_nvmlGpuFabricInfo_v3_t()
    fake.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(v3))
    assert (bytes(v3.clusterUuid).hex(), v3.cliqueId, v3.state, v3.healthSummary) == (
        "a4e2f0c16d3b4e598c7a2b1d0f9e8c7b", 1, 3, 0)
    legacy = pynvml.c_nvmlGpuFabricInfo_t()
    fake.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(legacy))
    assert (bytes(legacy.clusterUuid).hex(), legacy.cliqueId, legacy.state, legacy.status) == (
        "a4e2f0c16d3b4e598c7a2b1d0f9e8c7b", 1, 3, 0)


def test_the_fake_refuses_as_the_driver_does() -> None:
    without = started("dgx-h100")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        without.nvmlDeviceGetGpuFabricInfoV(without.nvmlDeviceGetHandleByIndex(0),
                                            ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        without.nvmlDeviceGetGpuFabricInfo(without.nvmlDeviceGetHandleByIndex(0),
                                           ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t()))
    fake = started("gb200-nvl72-tray")
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    unversioned = pynvml.c_nvmlGpuFabricInfoV_t()
    unversioned.version = 0
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        fake.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(unversioned))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuFabricInfoV(handle, None)
    fake.set_gpu_lost(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))


def test_the_backend_reads_each_gpus_fabric() -> None:
    inventory = inventory_of(node(fabric_gpu(0) + fabric_gpu(0, more=", state: in-progress")
                                  + fabric_gpu(1, more=", status: not-ready") + "  - {model: GB200, numa_node: 1}\n"))
    assert [g.fabric for g in inventory.gpus] == [
        FabricInfo(CLUSTER, 7, "completed", 0),
        FabricInfo(CLUSTER, 7, "in-progress", 0),
        FabricInfo(CLUSTER, 7, "completed", 27),
        None,
    ]
    assert [g.fabric is not None and g.fabric.attached for g in inventory.gpus] == [True, False, False, False]
    assert inventory.gpus[0].fabric is not None
    assert inventory.gpus[0].fabric.clique == f"{CLUSTER}.7"


def test_nvlink_without_a_multi_node_fabric_reads_as_not_attached() -> None:
    gpu = ("  - {model: H100-SXM5-80GB, numa_node: 0, fabric: {cluster_uuid: 00000000-0000-0000-0000-000000000000, "
           "clique_id: 0}}\n")
    hopper = "version: v1\nnvswitch: true\ngpus:\n" + gpu * 2
    (first, _) = inventory_of(hopper).gpus
    assert first.fabric == FabricInfo("00000000-0000-0000-0000-000000000000", 0, "completed", 0)
    assert first.fabric.attached is False


def test_a_driver_without_the_versioned_call_is_read_through_the_older_one_and_without_either_gives_none() -> None:
    fake = FakeNvml(load_node("gb200-nvl72-tray"))
    backend = fake_backend(fake)
    backend.init()
    fake.fail_next("nvmlDeviceGetGpuFabricInfoV", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, times=4)
    assert {g.fabric for g in backend.inventory().gpus} == {FabricInfo(GB200_CLUSTER, 1, "completed", 0)}
    fake.fail_next("nvmlDeviceGetGpuFabricInfoV", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, times=4)
    fake.fail_next("nvmlDeviceGetGpuFabricInfo", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, times=4)
    assert [g.fabric for g in backend.inventory().gpus] == [None] * 4


def test_the_presets_without_a_fabric_read_none_and_no_channels() -> None:
    inventory = inventory_of(Path(__file__).parents[2].joinpath("agent/nvml/presets/dgx-b200.yaml").read_text())
    assert [g.fabric for g in inventory.gpus] == [None] * 8
    assert inventory.imex_channels == ()


def test_the_nvl72_tray_presets_have_one_clique_and_channel_zero() -> None:
    gb200 = fake_backend(FakeNvml(load_node("gb200-nvl72-tray")))
    gb200.init()
    inventory = gb200.inventory()
    assert [g.fabric.clique if g.fabric else None for g in inventory.gpus] == [f"{GB200_CLUSTER}.1"] * 4
    assert inventory.imex_channels == (0,)


def test_imex_channel_device_nodes_are_listed_from_dev(tmp_path: Path) -> None:
    for name in ("channel7", "channel0", "channel12", "channel01", "chan3", "channelx"):
        (tmp_path / name).touch()
    assert dev_imex_channels(tmp_path) == (0, 7, 12)
    assert dev_imex_channels(tmp_path / "absent") == ()


def test_a_malformed_fabric_entry_is_one_line_naming_its_key_path() -> None:
    assert errors(node(fabric_gpu(cluster="GPU-0f1e2d3c"))) == [
        "node.yaml: gpus[0].fabric.cluster_uuid: must look like xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx in lowercase hex, "
        "got 'GPU-0f1e2d3c'"]
    assert errors(node(fabric_gpu(clique=-1))) == ["node.yaml: gpus[0].fabric.clique_id: must be >= 0, got -1"]
    assert errors(node(fabric_gpu(more=", state: done"))) == [
        "node.yaml: gpus[0].fabric.state: must be 'completed', 'in-progress', 'not-started' or 'not-supported', "
        "got 'done'"]
    assert errors(node(fabric_gpu(more=", status: fine"))) == [
        "node.yaml: gpus[0].fabric.status: must be success or an NVML error name such as not-ready or unknown, "
        "got 'fine'"]
    assert errors(node("  - {model: GB200, numa_node: 0, fabric: {clique_id: 1}}\n")) == [
        "node.yaml: gpus[0].fabric.cluster_uuid: required key is missing"]
    assert errors("version: v1\ngpus:\n  - {model: A100-SXM4-80GB, numa_node: 0, fabric: "
                  f"{{cluster_uuid: {CLUSTER}, clique_id: 1}}}}\n") == [
        "node.yaml: gpus[0].fabric: A100-SXM4-80GB has no NVLink fabric (a Hopper or newer GPU with NVLink has one)"]
    assert errors(node(fabric_gpu(), "imex_channels: [0, 2048]\n")) == [
        "node.yaml: imex_channels[1]: must be <= 2047, got 2048"]
    assert errors(node(fabric_gpu(), "imex_channels: [3, 0, 3]\n")) == [
        "node.yaml: imex_channels: lists channel 3 more than once"]


def test_inspect_shows_each_gpus_fabric_the_clique_and_the_channels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--nvml", "mock:gb200-nvl72-tray", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["gpus"][3]["fabric"] == {"cluster_uuid": GB200_CLUSTER, "clique_id": 1, "state": "completed",
                                         "status": 0, "attached": True}
    assert (view["clique"], view["clique_problem"], view["imex_channels"]) == (f"{GB200_CLUSTER}.1", None, [0])
    assert main(["inspect", "--nvml", "mock:gb200-nvl72-tray"]) == 0
    text = capsys.readouterr().out
    assert (f"  GPU 2: cluster {GB200_CLUSTER}  clique 1  completed  status 0  attached\n"
            f"  GPU 3: cluster {GB200_CLUSTER}  clique 1  completed  status 0  attached\n"
            f"  clique: {GB200_CLUSTER}.1\nIMEX channels: 0\n") in text
    assert main(["inspect", "--nvml", "mock:dgx-h100", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert ([g["fabric"] for g in view["gpus"]], view["clique"], view["imex_channels"]) == ([None] * 8, None, [])
