"""GPU feature discovery labels on nodes that are not uniform: MIG-enabled GPUs under a time-slicing config,
two GPU models, and migStrategy single on a node where only some GPUs are MIG-enabled."""

from __future__ import annotations

import dataclasses

from agent.config import parse_config
from agent.labels import node_labels
from agent.nvml.records import DriverInfo, GpuInfo, NodeInventory, PairLink
from agent.state import NodeState
from tests.unit.test_inventory import node
from tests.unit.test_labels import gpu

SHARED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"


def gpu_labels(labels: dict[str, str]) -> dict[str, str]:
    keys = ("product", "count", "replicas", "sharing-strategy", "memory")
    return {k: labels[f"nvidia.com/gpu.{k}"] for k in keys if f"nvidia.com/gpu.{k}" in labels}


def inventory(*gpus: GpuInfo) -> NodeState:
    return NodeState(version=1, inventory=NodeInventory(driver=DriverInfo("570.133.20", "12.8"), gpus=gpus, links=()))


def test_mig_enabled_gpus_are_labelled_without_the_sharing_of_whole_gpus() -> None:
    state = inventory(*(dataclasses.replace(gpu(i, 0), mig_enabled=True) for i in range(2)))
    assert gpu_labels(node_labels(state, parse_config(SHARED))) == {
        "product": "NVIDIA-A100-SXM4-80GB", "count": "2", "replicas": "0", "sharing-strategy": "none",
        "memory": "81920"}


def test_the_gpu_labels_of_two_models_describe_one_model() -> None:
    l40s = dataclasses.replace(gpu(1, 0), name="NVIDIA L40S", memory_mib=46068, compute_capability=(8, 9))
    labels = node_labels(inventory(gpu(0, 0), l40s), parse_config("version: v1\n"))
    assert gpu_labels(labels) == {"product": "NVIDIA-L40S", "count": "1", "replicas": "1",
                                  "sharing-strategy": "none", "memory": "46068"}
    assert labels["nvidia.com/gpu.family"] == "ada-lovelace"


def test_single_strategy_with_some_gpus_not_mig_enabled_is_invalid() -> None:
    state = node(config="version: v1\nflags:\n  migStrategy: single\n",
                 mig={0: [("1g.10gb", i) for i in range(7)]})
    labels = node_labels(state, state.config)
    assert gpu_labels(labels) == {"product": "NVIDIA-H100-80GB-HBM3-MIG-INVALID", "count": "0", "replicas": "0",
                                  "sharing-strategy": "", "memory": "0"}


def test_a_shared_product_label_is_cut_to_63_characters() -> None:
    long_name = "NVIDIA " + "X" * 53  # 60 characters: with -SHARED it would be 67
    state = inventory(dataclasses.replace(gpu(0, 0), name=long_name))
    product = node_labels(state, parse_config(SHARED))["nvidia.com/gpu.product"]
    assert product == "NVIDIA-" + "X" * 53 + "-SH"
    assert len(product) == 63


def versions(driver: str, cuda: str) -> dict[str, str]:
    state = NodeState(version=1, inventory=NodeInventory(driver=DriverInfo(driver, cuda), gpus=(gpu(0, 0),), links=()))
    labels = node_labels(state, parse_config("version: v1\n"))
    return {k.removeprefix("nvidia.com/cuda."): v for k, v in labels.items() if k.startswith("nvidia.com/cuda.")}


def test_driver_and_cuda_versions_with_fewer_parts() -> None:
    assert versions("580.65", "13") == {
        "driver.major": "580", "driver.minor": "65", "driver.rev": "",
        "driver-version.full": "580.65", "driver-version.major": "580", "driver-version.minor": "65",
        "driver-version.revision": "",
        "runtime.major": "13", "runtime.minor": "0",
        "runtime-version.full": "13.0", "runtime-version.major": "13", "runtime-version.minor": "0",
    }
    only_major = versions("580", "13.0")
    assert (only_major["driver.minor"], only_major["driver-version.minor"], only_major["driver.rev"]) == ("", "", "")


def test_a_machine_name_with_nothing_printable_is_unknown() -> None:
    state = dataclasses.replace(inventory(gpu(0, 0)), machine="???")
    assert node_labels(state, parse_config("version: v1\n"))["nvidia.com/gpu.machine"] == "unknown"


def test_compute_mode_gpus() -> None:
    state = inventory(*(dataclasses.replace(gpu(i, 0), pci_class=0x030200) for i in range(2)))
    assert node_labels(state, parse_config("version: v1\n"))["nvidia.com/gpu.mode"] == "compute"


def topology_labels(state: NodeState) -> dict[str, str]:
    labels = node_labels(state, parse_config("version: v1\n"))
    return {k.removeprefix("gpu-node-agent.io/"): v for k, v in labels.items() if k.startswith("gpu-node-agent.io/nv")}


def test_nvlink_labels_without_nvlink_and_on_one_gpu() -> None:
    pcie_only = NodeState(version=1, inventory=NodeInventory(
        driver=DriverInfo("570.133.20", "12.8"), gpus=(gpu(0, 0), gpu(1, 0)), links=(PairLink(0, 1, 0, "node"),)))
    assert topology_labels(pcie_only) == {"nvlink.largest-group": "0", "nvlink.full-mesh": "false"}
    assert topology_labels(inventory(gpu(0, 0))) == {"nvlink.largest-group": "0", "nvlink.full-mesh": "false"}
    pair = NodeState(version=1, inventory=NodeInventory(
        driver=DriverInfo("570.133.20", "12.8"), gpus=(gpu(0, 0), gpu(1, 0)), links=(PairLink(0, 1, 12, "node"),)))
    assert topology_labels(pair) == {"nvlink.largest-group": "2", "nvlink.full-mesh": "true"}


def test_single_strategy_on_a_one_gpu_node() -> None:
    state = node("single-h200", config="version: v1\nflags:\n  migStrategy: single\n",
                 mig={0: [("1g.18gb", i) for i in range(7)]})
    labels = node_labels(state, state.config)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"]) == ("NVIDIA-H200-MIG-1g.18gb", "7")
