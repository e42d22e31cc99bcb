"""Node labels: GPU feature discovery compatible values, topology labels, and what the agent owns."""

from __future__ import annotations

import dataclasses

from agent.config import DEFAULT_CONFIG, parse_config
from agent.kube.reconciler import label_diff
from agent.labels import family, node_labels, owned, sanitise
from agent.nvml.records import DriverInfo, GpuInfo, NodeInventory, PairLink
from agent.state import NodeState


def gpu(index: int, numa: int) -> GpuInfo:
    return GpuInfo(
        index=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000", name="NVIDIA A100-SXM4-80GB",
        pci_bus_id=f"00000000:{index + 16:02X}:00.0", minor=index, memory_mib=81920, architecture="ampere",
        compute_capability=(8, 0), numa_node=numa, mig_capable=True, mig_enabled=False, mig_pending=False,
    )


def state(links: list[PairLink]) -> NodeState:
    return NodeState(
        version=1,
        inventory=NodeInventory(
            driver=DriverInfo("570.133.20", "12.8"),
            gpus=tuple(gpu(i, 0 if i < 2 else 1) for i in range(4)),
            links=tuple(links),
        ),
    )


PAIRS = [PairLink(0, 1, 12, "single"), PairLink(0, 2, 0, "system"), PairLink(0, 3, 0, "system"),
         PairLink(1, 2, 0, "system"), PairLink(1, 3, 0, "system"), PairLink(2, 3, 12, "single")]


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


def test_full_mesh_and_largest_group() -> None:
    mesh = [PairLink(a, b, 18, "node") for a in range(4) for b in range(a + 1, 4)]
    labels = node_labels(state(mesh), DEFAULT_CONFIG)
    assert (labels["gpu-node-agent.io/nvlink.largest-group"], labels["gpu-node-agent.io/nvlink.full-mesh"]) == (
        "4", "true"
    )


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


def test_owned_keys() -> None:
    assert owned("nvidia.com/gpu.product") and owned("gpu-node-agent.io/nvlink.full-mesh")
    # docs/labels.md: the agent owns exactly the keys it lists, not everything under its prefix.
    assert not owned("gpu-node-agent.io/team")
    assert not owned("nvidia.com/gpu.present")
    assert not owned("nvidia.com/gpu.deploy.device-plugin")
    assert not owned("nvidia.com/mig.config")
    assert not owned("kubernetes.io/hostname")


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
