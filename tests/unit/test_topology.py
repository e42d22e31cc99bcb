"""Topology model, pair scores and the link-matrix rendering."""

from __future__ import annotations

import json

import pytest

from agent.topology.model import PCIE_LEVELS, Topology, TopologyError, pair_score
from agent.topology.render import render_matrix


def small() -> Topology:
    """GPU0-GPU1: NV4, one switch, node 0. GPU2-GPU3: NV2, nodes 1 and unknown. GPU1-GPU2: host bridge."""
    return Topology.build(
        numa=[0, 0, 1, None],
        pcie={(0, 1): "single", (3, 2): "multiple", (1, 2): "hostbridge"},
        nvlink={(0, 1): 4, (3, 2): 2},
    )


def test_pcie_score_table() -> None:
    assert {level: pair_score(0, level) for level in PCIE_LEVELS} == {
        "single": 60,
        "multiple": 50,
        "hostbridge": 40,
        "node": 30,
        "system": 10,
    }


def test_nvlink_scores_100_per_link_whatever_the_pcie_path() -> None:
    assert pair_score(1, "system") == 100
    assert pair_score(2, "single") == 200
    assert pair_score(18, "node") == 1800


def test_score_matrix() -> None:
    assert small().scores == (
        (0, 400, 10, 10),
        (400, 0, 40, 10),
        (10, 40, 0, 200),
        (10, 10, 200, 0),
    )


def test_missing_pcie_pairs_default_by_numa_node() -> None:
    topo = Topology.build(numa=[0, 0, 1, None, None], pcie={}, nvlink={})
    assert topo.pcie[0][1] == "node"
    assert topo.pcie[0][2] == "system"
    assert topo.pcie[2][3] == "system"
    assert topo.pcie[3][4] == "system"  # an unknown node is not known to be shared
    assert topo.nvlink[0][1] == 0
    assert topo.score(0, 1) == 30


def test_value_and_numa_span() -> None:
    topo = small()
    assert topo.value([0, 1, 2]) == 400 + 10 + 40
    assert topo.value([3]) == 0
    assert topo.numa_span([0, 1]) == 1
    assert topo.numa_span([1, 2, 3]) == 3
    assert Topology.build([None, None], {}, {}).numa_span([0, 1]) == 1


def test_pair_scores_are_json_ready() -> None:
    pairs = small().pair_scores()
    assert pairs == [
        {"gpus": [0, 1], "score": 400, "nvlink": 4, "pcie": "single"},
        {"gpus": [0, 2], "score": 10, "nvlink": 0, "pcie": "system"},
        {"gpus": [0, 3], "score": 10, "nvlink": 0, "pcie": "system"},
        {"gpus": [1, 2], "score": 40, "nvlink": 0, "pcie": "hostbridge"},
        {"gpus": [1, 3], "score": 10, "nvlink": 0, "pcie": "system"},
        {"gpus": [2, 3], "score": 200, "nvlink": 2, "pcie": "multiple"},
    ]
    assert json.loads(json.dumps(pairs)) == pairs


def test_interchangeable_classes() -> None:
    nvswitch = Topology.build([0, 0, 1, 1], {}, {(a, b): 12 for a in range(4) for b in range(a + 1, 4)})
    assert nvswitch.interchangeable == (0, 0, 0, 0)
    pairs = Topology.build([0, 0, 1, 1], {}, {(0, 1): 2, (2, 3): 2})
    assert pairs.interchangeable == (0, 0, 2, 2)
    assert small().interchangeable == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("pcie", "nvlink", "message"),
    [
        ({(0, 1): "nvlink"}, {}, "unknown PCIe level 'nvlink'"),
        ({(0, 1): "single", (1, 0): "system"}, {}, r"pcie: pair \(0, 1\) given twice"),
        ({}, {(0, 1): 1, (1, 0): 2}, r"nvlink: pair \(0, 1\) given twice"),
        ({(0, 3): "single"}, {}, r"pair \(0, 3\) is not a pair of distinct GPUs in 0..2"),
        ({}, {(1, 1): 1}, r"pair \(1, 1\) is not a pair"),
        ({}, {(0, 2): -1}, "NVLink count must be a non-negative integer"),
    ],
)
def test_build_rejects_bad_pairs(
    pcie: dict[tuple[int, int], str], nvlink: dict[tuple[int, int], int], message: str
) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology.build([0, 0, 1], pcie, nvlink)


def test_build_accepts_the_same_value_keyed_both_ways() -> None:
    topo = Topology.build([0, 1], {(0, 1): "single", (1, 0): "single"}, {(1, 0): 3})
    assert topo.nvlink == ((0, 3), (3, 0))


def test_direct_construction_rejects_asymmetric_links() -> None:
    with pytest.raises(TopologyError, match="link data differs between"):
        Topology(numa=(0, 0), nvlink=((0, 1), (2, 0)), pcie=((None, "single"), ("single", None)))
    with pytest.raises(TopologyError, match="NUMA node must be"):
        Topology.build([-1, 0], {}, {})


def test_render_matrix() -> None:
    assert render_matrix(small()) == (
        "      GPU0  GPU1  GPU2  GPU3  NUMA Affinity\n"
        "GPU0  X     NV4   SYS   SYS   0\n"
        "GPU1  NV4   X     PHB   SYS   0\n"
        "GPU2  SYS   PHB   X     NV2   1\n"
        "GPU3  SYS   SYS   NV2   X     N/A\n"
        "\n"
        "Legend:\n"
        "\n"
        "  X    = Self\n"
        "  SYS  = PCIe path that also crosses the interconnect between NUMA nodes (e.g. QPI/UPI/xGMI)\n"
        "  NODE = PCIe path that also crosses between PCIe host bridges within one NUMA node\n"
        "  PHB  = PCIe path through a PCIe host bridge (typically the CPU)\n"
        "  PXB  = PCIe path through several PCIe bridges, without a host bridge\n"
        "  PIX  = PCIe path through at most one PCIe bridge\n"
        "  NV#  = NVLink, a bonded set of # links\n"
    )


def test_render_matrix_pcie_cells_and_labels() -> None:
    topo = Topology.build([0, 0, 0], {(0, 1): "single", (0, 2): "multiple"}, {})
    lines = render_matrix(topo, labels=["a", "bb", "c"]).splitlines()
    assert lines[:4] == [
        "    a    bb    c     NUMA Affinity",
        "a   X    PIX   PXB   0",
        "bb  PIX  X     NODE  0",
        "c   PXB  NODE  X     0",
    ]


def test_render_matrix_rejects_wrong_label_count() -> None:
    with pytest.raises(ValueError, match="2 labels given for 4 GPUs"):
        render_matrix(small(), labels=["a", "b"])
