"""Node labels (agent/labels.py): GPU feature discovery compatible values on uniform nodes and on nodes that are
not (MIG-enabled GPUs under a time-slicing config, two GPU models, migStrategy single where only some GPUs are
MIG-enabled), driver and CUDA versions, topology labels, and which keys the agent owns, so that the labels of
what went away are removed and nobody else's are touched."""

from __future__ import annotations

import dataclasses

from agent.config import DEFAULT_CONFIG, parse_config
from agent.kube.reconciler import label_diff
from agent.labels import family, node_labels, owned, sanitise
from agent.nvml.records import DriverInfo, GpuInfo, NodeInventory, PairLink
from agent.state import NodeState
from tests.builders import gpu, node

SHARED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
PAIRS = [PairLink(0, 1, 12, "single"), PairLink(0, 2, 0, "system"), PairLink(0, 3, 0, "system"),
         PairLink(1, 2, 0, "system"), PairLink(1, 3, 0, "system"), PairLink(2, 3, 12, "single")]


def inventory(*gpus: GpuInfo, links: tuple[PairLink, ...] = ()) -> NodeState:
    return NodeState(version=1, inventory=NodeInventory(driver=DriverInfo("570.133.20", "12.8"), gpus=gpus,
                                                        links=links))


def state(links: list[PairLink]) -> NodeState:
    """Four A100s, GPUs 0 and 1 on NUMA node 0, 2 and 3 on node 1."""
    return inventory(*(gpu(i, 0 if i < 2 else 1) for i in range(4)), links=tuple(links))


def gpu_labels(labels: dict[str, str]) -> dict[str, str]:
    keys = ("product", "count", "replicas", "sharing-strategy", "memory")
    return {k: labels[f"nvidia.com/gpu.{k}"] for k in keys if f"nvidia.com/gpu.{k}" in labels}


# --- a node's labels in full, and the values they are made of


def test_labels_of_a_node_with_nvlink_pairs() -> None:
    assert node_labels(state(PAIRS), DEFAULT_CONFIG) == {
        "nvidia.com/cuda.driver.major": "570",
        "nvidia.com/cuda.driver.minor": "133",
        "nvidia.com/cuda.driver.rev": "20",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "8",
        "nvidia.com/gpu.machine": "unknown",
        "nvidia.com/gpu.mode": "unknown",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/vgpu.present": "false",
        "nvidia.com/cuda.driver-version.full": "570.133.20",
        "nvidia.com/cuda.driver-version.major": "570",
        "nvidia.com/cuda.driver-version.minor": "133",
        "nvidia.com/cuda.driver-version.revision": "20",
        "nvidia.com/cuda.runtime-version.full": "12.8",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "8",
        "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.family": "ampere",
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mig.capable": "true",
        "gpu-node-agent.io/numa.nodes": "2",
        "gpu-node-agent.io/numa.max-gpus": "2",
        "gpu-node-agent.io/nvlink.largest-group": "2",
        "gpu-node-agent.io/nvlink.full-mesh": "false",
    }


def test_family_and_sanitise() -> None:
    assert [family(7, 0), family(7, 5), family(8, 0), family(8, 9), family(9, 0), family(4, 0)] == [
        "volta", "turing", "ampere", "ada-lovelace", "hopper", "undefined"
    ]
    assert sanitise("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert sanitise("Tesla T4 (rev a1)") == "Tesla-T4-rev-a1"
    assert sanitise("NVIDIA A100-SXM4-40GB") == "NVIDIA-A100-SXM4-40GB"
    assert sanitise("DGX H100/H200 (Station)") == "DGX-H100H200-Station"  # GFD drops, not replaces


def test_machine_mode_timestamp_and_a_driver_without_revision() -> None:
    base = state(PAIRS)
    node = base.evolve(
        inventory=NodeInventory(
            driver=DriverInfo("580.65", "13.0"),
            gpus=tuple(dataclasses.replace(g, pci_class=0x030000) for g in base.inventory.gpus),
            links=base.inventory.links,
        ),
        machine="ProLiant DL380 Gen11", labelled_at=1764748800,
    )
    labels = node_labels(node, DEFAULT_CONFIG)
    assert {k: labels[k] for k in (
        "nvidia.com/gpu.machine", "nvidia.com/gpu.mode", "nvidia.com/gfd.timestamp",
        "nvidia.com/cuda.driver.rev", "nvidia.com/cuda.driver-version.revision", "nvidia.com/cuda.runtime.major",
    )} == {
        "nvidia.com/gpu.machine": "ProLiant-DL380-Gen11",
        "nvidia.com/gpu.mode": "graphics",
        "nvidia.com/gfd.timestamp": "1764748800",
        "nvidia.com/cuda.driver.rev": "",
        "nvidia.com/cuda.driver-version.revision": "",
        "nvidia.com/cuda.runtime.major": "13",
    }
    quiet = parse_config("version: v1\nflags:\n  gfd:\n    noTimestamp: true\n")
    assert "nvidia.com/gfd.timestamp" not in node_labels(node, quiet)
    mixed_classes = node.evolve(inventory=dataclasses.replace(node.inventory, gpus=(
        dataclasses.replace(node.inventory.gpus[0], pci_class=0x030200), *node.inventory.gpus[1:])))
    assert node_labels(mixed_classes, DEFAULT_CONFIG)["nvidia.com/gpu.mode"] == "unknown"


def test_a_machine_name_with_nothing_printable_is_unknown() -> None:
    state = dataclasses.replace(inventory(gpu(0, 0)), machine="???")
    assert node_labels(state, parse_config("version: v1\n"))["nvidia.com/gpu.machine"] == "unknown"


def test_compute_mode_gpus() -> None:
    state = inventory(*(dataclasses.replace(gpu(i, 0), pci_class=0x030200) for i in range(2)))
    assert node_labels(state, parse_config("version: v1\n"))["nvidia.com/gpu.mode"] == "compute"


# --- GPU labels of nodes that are not uniform, and of shared GPUs


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


def test_a_shared_product_label_is_cut_to_63_characters() -> None:
    long_name = "NVIDIA " + "X" * 53  # 60 characters: with -SHARED it would be 67
    state = inventory(dataclasses.replace(gpu(0, 0), name=long_name))
    product = node_labels(state, parse_config(SHARED))["nvidia.com/gpu.product"]
    assert product == "NVIDIA-" + "X" * 53 + "-SH"
    assert len(product) == 63


def test_single_strategy_with_some_gpus_not_mig_enabled_is_invalid() -> None:
    state = node(config="version: v1\nflags:\n  migStrategy: single\n",
                 mig={0: [("1g.10gb", i) for i in range(7)]})
    labels = node_labels(state, state.config)
    assert gpu_labels(labels) == {"product": "NVIDIA-H100-80GB-HBM3-MIG-INVALID", "count": "0", "replicas": "0",
                                  "sharing-strategy": "", "memory": "0"}


def test_single_strategy_on_a_one_gpu_node() -> None:
    state = node("single-h200", config="version: v1\nflags:\n  migStrategy: single\n",
                 mig={0: [("1g.18gb", i) for i in range(7)]})
    labels = node_labels(state, state.config)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"]) == ("NVIDIA-H200-MIG-1g.18gb", "7")


# --- driver and CUDA versions


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


# --- NVLink topology


def test_full_mesh_and_largest_group() -> None:
    mesh = [PairLink(a, b, 18, "node") for a in range(4) for b in range(a + 1, 4)]
    labels = node_labels(state(mesh), DEFAULT_CONFIG)
    assert (labels["gpu-node-agent.io/nvlink.largest-group"], labels["gpu-node-agent.io/nvlink.full-mesh"]) == (
        "4", "true"
    )


def topology_labels(state: NodeState) -> dict[str, str]:
    labels = node_labels(state, parse_config("version: v1\n"))
    return {k.removeprefix("gpu-node-agent.io/"): v for k, v in labels.items() if k.startswith("gpu-node-agent.io/nv")}


def test_nvlink_labels_without_nvlink_and_on_one_gpu() -> None:
    pcie_only = inventory(gpu(0, 0), gpu(1, 0), links=(PairLink(0, 1, 0, "node"),))
    assert topology_labels(pcie_only) == {"nvlink.largest-group": "0", "nvlink.full-mesh": "false"}
    assert topology_labels(inventory(gpu(0, 0))) == {"nvlink.largest-group": "0", "nvlink.full-mesh": "false"}
    pair = inventory(gpu(0, 0), gpu(1, 0), links=(PairLink(0, 1, 12, "node"),))
    assert topology_labels(pair) == {"nvlink.largest-group": "2", "nvlink.full-mesh": "true"}


# --- the keys the agent owns


def test_owned_keys() -> None:
    assert owned("nvidia.com/gpu.product") and owned("gpu-node-agent.io/nvlink.full-mesh")
    # docs/labels.md: the agent owns exactly the keys it lists, not everything under its prefix.
    assert not owned("gpu-node-agent.io/team")
    assert not owned("nvidia.com/gpu.present")
    assert not owned("nvidia.com/gpu.deploy.device-plugin")
    assert not owned("nvidia.com/mig.config")
    assert not owned("kubernetes.io/hostname")


def test_mig_resource_labels_are_owned() -> None:
    assert owned("nvidia.com/mig-1g.10gb.count")
    assert owned("nvidia.com/mig-3g.40gb.product")
    # The MIG manager's own label and GPU feature discovery's MIG capability are not resource labels.
    assert not owned("nvidia.com/mig.config")
    assert not owned("nvidia.com/migration")


def test_label_diff_touches_only_owned_keys() -> None:
    current = {
        "kubernetes.io/hostname": "n1",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu-node-agent.io/numa.max-gpus": "4",
        "gpu-node-agent.io/team": "infra",
        "nvidia.com/mig.config": "all-1g.10gb",
    }
    desired = {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-H200",
               "gpu-node-agent.io/numa.nodes": "1"}
    assert label_diff(current, desired, owned) == {
        "nvidia.com/gpu.product": "NVIDIA-H200",
        "gpu-node-agent.io/numa.nodes": "1",
        "gpu-node-agent.io/numa.max-gpus": None,
    }
    assert label_diff({**current, **desired, "gpu-node-agent.io/numa.max-gpus": "x"}, desired, owned) == {
        "gpu-node-agent.io/numa.max-gpus": None
    }
    assert label_diff(desired, desired, owned) == {}


def test_labels_of_a_profile_no_longer_carved_are_removed() -> None:
    current = {
        "kubernetes.io/hostname": "n1",
        "nvidia.com/mig-1g.10gb.count": "7",
        "nvidia.com/mig-1g.10gb.memory": "9984",
        "nvidia.com/mig.config": "all-1g.10gb",
    }
    desired = {"nvidia.com/mig-3g.40gb.count": "2"}
    assert label_diff(current, desired, owned) == {
        "nvidia.com/mig-3g.40gb.count": "2",
        "nvidia.com/mig-1g.10gb.count": None,
        "nvidia.com/mig-1g.10gb.memory": None,
    }
