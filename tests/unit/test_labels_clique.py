"""nvidia.com/gpu.clique as GPU feature discovery writes it: <cluster UUID>.<clique ID> of the node's
fabric-attached GPUs, only when they share one of each; a warning at start and no label when they do not."""

from __future__ import annotations

import logging
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.agent import Agent
from agent.config import DEFAULT_CONFIG, parse_config
from agent.daemon import AgentOptions
from agent.kube.reconciler import label_diff
from agent.labels import node_labels, owned
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node, parse_node
from agent.nvml.records import DriverInfo, FabricInfo, GpuInfo, NodeInventory, node_clique
from agent.state import NodeState
from tests.plugin_harness import short_dir

CLUSTER = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
OTHER = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
ZERO = "00000000-0000-0000-0000-000000000000"
CLIQUE = "nvidia.com/gpu.clique"


def gpu(index: int, fabric: FabricInfo | None) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000", name="NVIDIA GB200",
                   pci_bus_id=f"00000000:{index + 16:02X}:00.0", minor=index, memory_mib=189471,
                   architecture="blackwell", compute_capability=(10, 0), numa_node=index // 2, mig_capable=True,
                   mig_enabled=False, mig_pending=False, fabric=fabric)


def labels(*fabrics: FabricInfo | None) -> dict[str, str]:
    inventory = NodeInventory(DriverInfo("580.95.05", "13.0"), tuple(gpu(i, f) for i, f in enumerate(fabrics)), ())
    return node_labels(NodeState(version=1, inventory=inventory), DEFAULT_CONFIG)


def test_the_gb200_tray_is_labelled_with_its_clique() -> None:
    backend = fake_backend(FakeNvml(load_node("gb200-nvl72-tray")))
    backend.init()
    state = NodeState(version=1, inventory=backend.inventory())
    assert node_labels(state, DEFAULT_CONFIG)[CLIQUE] == "5d3c1e2a-8b4f-4c6d-9e7a-1f2b3c4d5e6f.1"


def test_gpus_that_are_not_attached_do_not_count() -> None:
    assert labels(FabricInfo(CLUSTER, 4294967295, "completed", 0),
                  FabricInfo(OTHER, 3, "in-progress", 0),
                  FabricInfo(OTHER, 3, "completed", 27),
                  FabricInfo(ZERO, 0, "completed", 0),
                  None)[CLIQUE] == f"{CLUSTER}.4294967295"


@pytest.mark.parametrize("fabrics", [
    (None, None),
    (FabricInfo(CLUSTER, 1, "not-started", 0), FabricInfo(CLUSTER, 1, "not-supported", 0)),
    (FabricInfo(ZERO, 0, "completed", 0),) * 2,
], ids=["no-fabric", "not-registered", "nvlink-without-a-multi-node-fabric"])
def test_no_attached_gpu_no_label_and_no_warning(fabrics: tuple[FabricInfo | None, ...]) -> None:
    assert CLIQUE not in labels(*fabrics)
    assert node_clique(tuple(gpu(i, f) for i, f in enumerate(fabrics))) == node_clique(())


def test_two_cluster_uuids_or_two_clique_ids_give_no_label_and_say_why() -> None:
    clusters = (FabricInfo(CLUSTER, 1, "completed", 0), FabricInfo(OTHER, 1, "completed", 0),
                FabricInfo(CLUSTER, 1, "completed", 0))
    cliques = (FabricInfo(CLUSTER, 1, "completed", 0), FabricInfo(CLUSTER, 2, "completed", 0))
    assert CLIQUE not in labels(*clusters)
    assert CLIQUE not in labels(*cliques)
    assert node_clique(tuple(gpu(i, f) for i, f in enumerate(clusters))).problem == (
        f"the fabric-attached GPUs have 2 cluster UUIDs ({CLUSTER}: GPU 0, 2; {OTHER}: GPU 1), not one; "
        "the node has no clique")
    assert node_clique(tuple(gpu(i, f) for i, f in enumerate(cliques))).problem == (
        "the fabric-attached GPUs have 2 clique IDs (1: GPU 0; 2: GPU 1), not one; the node has no clique")


def test_the_label_is_owned_so_a_clique_that_goes_away_is_removed() -> None:
    assert owned(CLIQUE)
    current = labels(FabricInfo(CLUSTER, 1, "completed", 0))
    assert label_diff(current, labels(None), owned) == {CLIQUE: None}


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    directory = short_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_node_of_two_cliques_warns_once_at_start(kubelet_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    tray = "".join(f"  - {{model: GB200, numa_node: {i // 2}, "
                   f"fabric: {{cluster_uuid: {CLUSTER}, clique_id: {i % 2 + 1}}}}}\n" for i in range(4))
    fake = FakeNvml(parse_node(f"version: v1\nnvswitch: true\ngpus:\n{tray}", "two-cliques.yaml"))
    options = AgentOptions(config=parse_config(f"version: v1\nmig: {{stateDir: {kubelet_dir}/mig}}\n"),
                           kubelet_dir=kubelet_dir, metrics_port=free_port(), metrics_host="127.0.0.1")
    with caplog.at_level(logging.WARNING):
        agent = await Agent.start(fake_backend(fake), options)
        try:
            assert CLIQUE not in node_labels(agent.bus.current, agent.bus.current.config)
        finally:
            await agent.stop()
    assert [(r.name, r.getMessage()) for r in caplog.records if "clique" in r.getMessage()] == [
        ("agent.labels", "nvidia.com/gpu.clique: the fabric-attached GPUs have 2 clique IDs "
                         "(1: GPU 0, 2; 2: GPU 1, 3), not one; the node has no clique")]
