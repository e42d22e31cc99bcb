"""GPUs that MPS shares offered to DRA by consumable capacity (dra.sharedCapacity): the config's checks, the
device in the ResourceSlice, quantities as the API server writes them, and the MPS client's limits."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import PurePosixPath
from typing import Any

import pytest

from agent.config import ConfigError, parse_config
from agent.dra.publisher import SlicePublisher
from agent.dra.slices import quantity_value, slice_spec
from agent.mps_client import mps_client, mps_client_limits
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.state import NodeState, StateBus

DRIVER = "gpu.gpu-node-agent.io"
MPS_GPU_0 = "sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 4, devices: [0]}]}}\n"


def node(preset: str, config: str) -> NodeState:
    backend = fake_backend(FakeNvml(load_node(preset)))
    backend.init()
    state = NodeState(version=1, inventory=backend.inventory())
    state = dataclasses.replace(state, config=parse_config(f"version: v1\n{config}"))
    return state.evolve(mps={g.uuid: "" for g in state.inventory.gpus})  # every MPS daemon up


def devices(state: NodeState, capacity: bool) -> dict[str, dict[str, object]]:
    return {d["name"]: d for d in slice_spec(state, "n", DRIVER, 1, capacity=capacity)["devices"]}


def test_shared_capacity_without_mps_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\ndra: {enabled: true, sharedCapacity: {enabled: true}}\n", "cfg.yaml")
    assert str(caught.value) == (
        "cfg.yaml: dra.sharedCapacity.enabled: needs sharing.mps: a GPU shared by capacity is enforced by its MPS "
        "daemon (add sharing.mps.resources for nvidia.com/gpu, or turn it off)")
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n"
                     "dra: {sharedCapacity: {enabled: true}}\n", "cfg.yaml")
    assert str(caught.value).startswith("cfg.yaml: dra.sharedCapacity.enabled: needs sharing.mps")


@pytest.mark.parametrize(("key", "message"), [
    ("computeStepPercent: 0", "cfg.yaml: dra.sharedCapacity.computeStepPercent: got 0; must be at least 1"),
    ("computeStepPercent: 101", "cfg.yaml: dra.sharedCapacity.computeStepPercent: got 101; must be at most 100"),
    ("memoryStepMiB: 0", "cfg.yaml: dra.sharedCapacity.memoryStepMiB: got 0; must be at least 1"),
    ("memoryStep: 1Gi", "cfg.yaml: dra.sharedCapacity.memoryStep: unknown key"),
])
def test_bad_steps_are_named(key: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"version: v1\n{MPS_GPU_0}dra: {{sharedCapacity: {{enabled: true, {key}}}}}\n", "cfg.yaml")
    assert str(caught.value) == message


def test_the_defaults_are_off_with_steps_of_one_gib_and_one_percent() -> None:
    settings = parse_config("version: v1\n").dra.shared_capacity
    assert (settings.enabled, settings.memory_step_mib, settings.compute_step_percent) == (False, 1024, 1)


def test_an_mps_gpu_is_one_device_with_memory_and_compute_capacity() -> None:
    state = node("a100-pcie-nvlink-pairs", f"{MPS_GPU_0}dra: {{enabled: true, sharedCapacity: {{enabled: true}}}}\n")
    found = devices(state, capacity=True)
    assert list(found) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    gpu0 = found["gpu-0"]
    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["capacity"] == {  # the A100 80GB's 81920 MiB, in steps of 1 GiB; compute in percent
        "memory": {"value": "80Gi", "requestPolicy": {"default": "80Gi",
                                                      "validRange": {"min": "1Gi", "step": "1Gi"}}},
        "compute": {"value": "100", "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}}},
    }
    attributes = gpu0["attributes"]
    assert isinstance(attributes, dict)
    assert (attributes["type"], attributes["sharing"]) == ({"string": "shared"}, {"string": "mps"})
    assert "replica" not in attributes and "replicas" not in attributes
    assert attributes["uuid"] == {"string": state.inventory.gpus[0].uuid}
    # The GPUs MPS does not share are whole, as without the setting.
    assert found["gpu-1"]["capacity"] == {"memory": {"value": "80Gi"}, "multiprocessors": {"value": "108"}}
    assert "allowMultipleAllocations" not in found["gpu-1"]


def test_where_the_api_server_drops_capacity_the_gpu_is_its_replicas() -> None:
    state = node("a100-pcie-nvlink-pairs", f"{MPS_GPU_0}dra: {{enabled: true, sharedCapacity: {{enabled: true}}}}\n")
    assert list(devices(state, capacity=False)) == [
        "gpu-0-replica-0", "gpu-0-replica-1", "gpu-0-replica-2", "gpu-0-replica-3", "gpu-1", "gpu-2", "gpu-3"]


def test_without_the_setting_the_gpu_is_its_replicas_whatever_the_server_keeps() -> None:
    state = node("a100-pcie-nvlink-pairs", f"{MPS_GPU_0}dra: {{enabled: true}}\n")
    assert list(devices(state, capacity=True))[:2] == ["gpu-0-replica-0", "gpu-0-replica-1"]


def test_the_default_memory_is_the_whole_gpu_down_to_a_step_and_steps_follow_the_config() -> None:
    # An H100 80GB has 81559 MiB: 79 whole GiB; with 10 GiB steps, 70 GiB; compute in steps of 5%.
    config = ("sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [0]}]}}\n"
              "dra: {enabled: true, sharedCapacity: {enabled: true, memoryStepMiB: %d, computeStepPercent: 5}}\n")
    one_gib = devices(node("dgx-h100", config % 1024), capacity=True)["gpu-0"]["capacity"]
    assert isinstance(one_gib, dict)
    assert one_gib["memory"] == {"value": "81559Mi", "requestPolicy": {
        "default": "79Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}
    assert one_gib["compute"] == {"value": "100", "requestPolicy": {
        "default": "0", "validRange": {"min": "0", "step": "5"}}}
    ten_gib = devices(node("dgx-h100", config % 10240), capacity=True)["gpu-0"]["capacity"]
    assert isinstance(ten_gib, dict)
    assert ten_gib["memory"] == {"value": "81559Mi", "requestPolicy": {
        "default": "70Gi", "validRange": {"min": "10Gi", "step": "10Gi"}}}


@pytest.mark.parametrize(("text", "value"), [
    ("20Gi", 21474836480), ("21474836480", 21474836480), ("20480Mi", 21474836480), ("25", 25), ("0", 0),
    ("1.5G", 1500000000), ("1e3", 1000), ("100m", 1), ("2k", 2000),
])
def test_quantities_as_the_api_server_writes_them(text: str, value: int) -> None:
    assert quantity_value(text) == value


@pytest.mark.parametrize("text", ["", "20 Gi", "20GiB", "Gi", "twenty"])
def test_what_is_not_a_quantity_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a quantity"):
        quantity_value(text)


def test_an_mps_client_by_capacity_gets_exactly_its_limits() -> None:
    root = PurePosixPath("/run/nvidia/mps")
    client = mps_client_limits(root, "GPU-x", 20480, 25)
    assert client.env == (("CUDA_MPS_PIPE_DIRECTORY", "/mps/pipe"), ("CUDA_MPS_LOG_DIRECTORY", "/mps/log"),
                          ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
                          ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=20480M"))
    assert client.mounts == (("/mps/pipe", "/run/nvidia/mps/GPU-x/pipe"), ("/mps/log", "/run/nvidia/mps/GPU-x/log"),
                             ("/dev/shm", "/run/nvidia/mps/shm"))
    # Replicas as before: 1 of 4 on 81920 MiB.
    assert mps_client(root, "GPU-x", 81920, 1, 4).env[2:] == (
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"), ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=20480M"))


class StoredSlices:
    """A stand-in for the API server's ResourceSlices that keeps what is written, dropping consumable capacity
    (allowMultipleAllocations, requestPolicy) unless `keeps_capacity`, as the DRAConsumableCapacity gate decides;
    each write recorded as (verb, dry run)."""

    def __init__(self, keeps_capacity: bool) -> None:
        self.keeps_capacity = keeps_capacity
        self.stored: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, bool]] = []

    def _store(self, verb: str, body: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        self.writes.append((verb, dry_run))
        kept = copy.deepcopy(body)
        if not self.keeps_capacity:
            for device in kept["spec"]["devices"]:
                device.pop("allowMultipleAllocations", None)
                for capacity in (device.get("capacity") or {}).values():
                    capacity.pop("requestPolicy", None)
        if not dry_run:
            kept["metadata"] = {**kept["metadata"], "resourceVersion": str(len(self.writes))}
            self.stored[kept["metadata"]["name"]] = kept
        return kept

    async def get(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.stored.get(name))

    async def create(self, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self._store("create", body, dry_run)

    async def replace(self, name: str, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self._store("replace", body, dry_run)

    async def delete(self, name: str) -> None:
        self.stored.pop(name, None)

    async def list(self, node: str, driver: str) -> list[dict[str, Any]]:
        return list(self.stored.values())


@pytest.mark.parametrize(("keeps", "mode", "names"), [
    (True, "capacity", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]),
    (False, "replicas", ["gpu-0-replica-0", "gpu-0-replica-1", "gpu-0-replica-2", "gpu-0-replica-3",
                         "gpu-1", "gpu-2", "gpu-3"]),
])
async def test_one_dry_run_decides_whether_the_gpu_is_shared_by_capacity(
        keeps: bool, mode: str, names: list[str], caplog: pytest.LogCaptureFixture) -> None:
    state = node("a100-pcie-nvlink-pairs", f"{MPS_GPU_0}dra: {{enabled: true, sharedCapacity: {{enabled: true}}}}\n")
    api = StoredSlices(keeps_capacity=keeps)
    publisher = SlicePublisher(api, StateBus(state), "n", DRIVER, pcie_root=lambda bus_id: None)
    caplog.set_level(logging.INFO, logger="agent.dra.publisher")
    assert await publisher.sync(state)
    assert publisher.capacity_mode == mode
    assert api.writes == [("create", True), ("create", False)]  # the dry run, then the slice
    (stored,) = api.stored.values()
    assert [d["name"] for d in stored["spec"]["devices"]] == names
    said = [r.getMessage() for r in caplog.records if "consumable" in r.getMessage()]
    assert len(said) == 1
    # Decided once: the slice deleted (as the kubelet does at registration) is written again with no dry run.
    api.stored.clear()
    publisher.republish()
    publisher.verify = True
    assert await publisher.sync(state)
    assert api.writes[2:] == [("create", False)]
    assert [d["name"] for d in api.stored[stored["metadata"]["name"]]["spec"]["devices"]] == names
    assert len([r for r in caplog.records if "consumable" in r.getMessage()]) == 1
