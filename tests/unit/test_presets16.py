"""The two 16-GPU presets as the NVML backend reads them, and the allocator's answers on them."""

from __future__ import annotations

from collections import Counter

import pytest

from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvml.records import NodeInventory
from agent.topology.gpus import preferred_gpus
from agent.topology.prefer import topology_of

PAIRS = [(a, a + 1) for a in range(0, 16, 2)]


def inventory(preset: str) -> NodeInventory:
    fake = FakeNvml(load_node(preset))
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    try:
        return backend.inventory()
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def hgx16() -> NodeInventory:
    return inventory("hgx-16-nvswitch")


@pytest.fixture(scope="module")
def pcie16() -> NodeInventory:
    return inventory("pcie-16-nvlink-pairs")


def test_hgx16_inventory(hgx16: NodeInventory) -> None:
    assert [g.index for g in hgx16.gpus] == list(range(16))
    assert {g.name for g in hgx16.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert [g.numa_node for g in hgx16.gpus] == [0] * 8 + [1] * 8
    assert len({g.uuid for g in hgx16.gpus}) == 16
    assert [g.pci_bus_id for g in hgx16.gpus[7:9]] == ["00000000:DB:00.0", "00000001:18:00.0"]
    # NVSwitch joins every one of the 120 pairs over all 18 links of an H100.
    assert len(hgx16.links) == 120
    assert {link.nvlink for link in hgx16.links} == {18}
    pcie = {(link.a, link.b): link.pcie for link in hgx16.links}
    assert sorted(pair for pair, level in pcie.items() if level == "single") == PAIRS
    assert Counter(pcie.values()) == {"single": 8, "node": 48, "system": 64}


def test_pcie16_inventory(pcie16: NodeInventory) -> None:
    assert [g.index for g in pcie16.gpus] == list(range(16))
    assert {g.name for g in pcie16.gpus} == {"NVIDIA A100-SXM4-80GB"}
    assert [g.numa_node for g in pcie16.gpus] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    nvlinked = {(link.a, link.b): link.nvlink for link in pcie16.links if link.nvlink}
    assert nvlinked == {pair: 12 for pair in PAIRS}
    pcie = {(link.a, link.b): link.pcie for link in pcie16.links}
    assert sorted(pair for pair, level in pcie.items() if level == "single") == PAIRS
    assert (pcie[0, 2], pcie[1, 3], pcie[3, 4], pcie[0, 15]) == ("node", "node", "system", "system")
    assert Counter(pcie.values()) == {"single": 8, "node": 16, "system": 96}


def test_hgx16_eight_gpus_go_whole_to_the_numa_node_that_has_eight_free(hgx16: NodeInventory) -> None:
    # GPU 7 is taken, so only NUMA node 1 can still give eight GPUs on one node.
    available = [g for g in range(16) if g != 7]
    assert preferred_gpus(topology_of(hgx16), available, [], 8) == [8, 9, 10, 11, 12, 13, 14, 15]


def test_hgx16_must_include_keeps_the_request_on_its_numa_node(hgx16: NodeInventory) -> None:
    # Every pair scores the same through NVSwitch; GPU 12 pins NUMA node 1, where the lowest indices win.
    assert preferred_gpus(topology_of(hgx16), list(range(16)), [12], 4) == [8, 9, 10, 12]


def test_pcie16_pair_request_takes_an_intact_bridge(pcie16: NodeInventory) -> None:
    # GPU 0 is taken: GPU 1 has lost its bridge partner, so the pair is the next bridged one.
    assert preferred_gpus(topology_of(pcie16), list(range(1, 16)), [], 2) == [2, 3]


def test_pcie16_four_gpus_leave_the_best_remainder(pcie16: NodeInventory) -> None:
    # Free: GPUs 1-3 (node 0), 4-6 (node 1), 8-9 (node 2). Any two bridged pairs score 2440 over two nodes;
    # [2, 3, 4, 5] would leave {1, 6, 8, 9} (best four: 1250), [2, 3, 8, 9] leaves {1, 4, 5, 6} (1290).
    topo = topology_of(pcie16)
    assert topo.value([2, 3, 4, 5]) == topo.value([2, 3, 8, 9]) == 2440
    assert preferred_gpus(topo, [1, 2, 3, 4, 5, 6, 8, 9], [], 4) == [2, 3, 8, 9]
