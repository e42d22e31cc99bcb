"""The whole-GPU fallback above EXACT_LIMIT candidates: greedy growth from the most promising GPUs, then pair
swaps. On these nodes it reaches the optimum of its documented order (value, NUMA span, index tuple), which a
brute force over every set checks here; the nodes are ones where a weaker seed order, a greedy step that
ignores the NUMA span, or missing swaps end elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import pytest

from agent.topology.gpus import EXACT_LIMIT, preferred_gpus
from agent.topology.model import Topology


@dataclass(frozen=True)
class Case:
    numa: list[int | None]
    nvlink: str
    """Space-separated `a-b:links`."""
    size: int
    must: list[int]
    uniform_pcie: bool
    """Every pair without NVLink on the same PCIe level ("system"), so that only NVLink and NUMA differ."""
    expected: list[int]

    def topology(self) -> Topology:
        n = len(self.numa)
        pcie = {(a, b): "system" for a in range(n) for b in range(a + 1, n)} if self.uniform_pcie else {}
        links = {}
        for item in self.nvlink.split():
            pair, count = item.split(":")
            a, b = pair.split("-")
            links[(int(a), int(b))] = int(count)
        return Topology.build(self.numa, pcie, links)


def brute_force(topo: Topology, size: int, must: list[int]) -> list[int]:
    """The first set in (highest value, fewest NUMA nodes, smallest index tuple) order."""
    free = [g for g in range(topo.gpu_count) if g not in must]
    best = min((sorted([*must, *extra]) for extra in combinations(free, size - len(must))),
               key=lambda s: (-topo.value(s), topo.numa_span(s), s))
    return list(best)


SWAP_AT_EQUAL_VALUE = Case(
    # GPUs 0-9 on NUMA node 0, 10-19 on node 1, every pair on one PCIe level. NVLink joins 1-10 ... 7-16 and
    # 8-19 (cross-node pairs), 0-17 and 17-18. Every GPU has one NVLink partner worth 100, so the 16 seeds are
    # GPUs 0-8 and 10-16 (lowest indices first) and no seed leads to 17-18; growth from GPU 0 gives 0-17,
    # the first set in index order. Swapping 0 for 18 keeps the value and leaves one NUMA node: 17-18.
    numa=[0] * 10 + [1] * 10,
    nvlink="1-10:1 2-11:1 3-12:1 4-13:1 5-14:1 6-15:1 7-16:1 8-19:1 0-17:1 17-18:1",
    size=2, must=[], uniform_pcie=True, expected=[17, 18],
)

SEARCHED = [
    Case(
        numa=[0, 0, 0, 0, 0, 0, 0, None, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3],
        nvlink=(
            "0-9:1 0-13:2 0-27:2 1-7:3 1-8:3 1-10:4 1-11:2 2-25:4 3-4:4 3-5:4 3-16:2 4-20:2 5-13:3 5-18:3 "
            "6-12:3 6-24:1 6-25:3 7-15:4 8-15:2 8-16:3 9-13:3 9-15:1 10-15:2 11-20:2 11-23:2 11-24:2 11-26:2 "
            "12-27:4 13-16:3 14-17:4 14-24:4 15-20:3 16-17:2 17-22:1 18-25:3 19-23:4 19-26:3 21-25:4"
        ),
        size=4, must=[], uniform_pcie=False, expected=[1, 7, 10, 15],
    ),
    Case(
        numa=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
        nvlink=(
            "0-11:4 1-2:3 1-4:4 1-5:1 1-29:4 2-14:2 3-8:1 3-15:2 4-19:4 4-31:4 5-17:4 6-13:3 6-17:4 6-18:2 "
            "6-31:4 7-9:3 7-15:1 7-18:1 8-19:2 9-15:4 10-20:1 11-27:4 11-31:1 11-32:1 12-14:4 12-19:1 13-30:4 "
            "14-18:2 14-22:3 14-32:3 15-16:4 15-18:1 15-25:2 17-26:4 17-28:1 18-28:1 19-30:4 21-22:1 21-26:2 "
            "22-23:1 25-26:3 25-29:4 30-33:4"
        ),
        size=3, must=[], uniform_pcie=False, expected=[4, 6, 31],
    ),
    Case(
        numa=[0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3],
        nvlink=(
            "0-16:4 0-20:3 1-2:3 1-18:3 1-19:2 2-22:2 3-10:4 3-11:4 4-10:3 4-13:4 5-8:2 5-11:2 5-12:1 5-16:4 "
            "6-15:4 7-13:4 7-21:1 9-10:4 9-14:3 9-22:4 11-22:4 11-24:2 12-13:4 12-15:3 12-23:4 13-15:4 "
            "13-18:3 13-19:2 13-21:4 14-20:2 14-21:3 15-16:2 15-22:2 20-21:1 22-24:1"
        ),
        size=3, must=[], uniform_pcie=False, expected=[12, 13, 15],
    ),
    Case(
        numa=[0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3],
        nvlink=(
            "0-9:1 1-3:1 1-26:4 2-7:4 2-13:2 3-9:1 3-16:3 3-19:2 4-6:1 4-7:2 4-10:3 4-14:4 4-23:4 5-17:2 "
            "6-15:4 6-24:3 7-10:1 7-17:3 7-18:1 7-23:4 7-25:4 8-9:1 8-21:3 8-26:1 9-12:1 9-16:4 9-17:1 "
            "10-15:3 10-18:1 10-25:1 12-18:4 12-25:2 13-18:1 14-15:1 14-22:4 14-26:3 16-25:2 17-25:4 18-19:2 "
            "18-20:1 21-25:2 24-25:4"
        ),
        size=3, must=[], uniform_pcie=True, expected=[7, 17, 25],
    ),
    Case(
        numa=[0, 0, 0, 0, 0, 0, 0, 0, None, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        nvlink=(
            "0-2:1 0-3:3 0-4:3 0-5:4 0-14:3 0-21:1 0-22:3 1-15:3 2-8:4 2-9:1 3-5:3 3-23:3 4-9:1 5-15:4 5-18:2 "
            "6-8:3 6-15:3 6-16:3 7-11:2 7-19:4 8-15:3 9-13:4 10-14:4 10-24:4 11-13:4 11-16:4 11-23:4 11-24:4 "
            "15-18:4 15-22:4 20-21:3 22-23:3"
        ),
        size=4, must=[], uniform_pcie=True, expected=[0, 5, 15, 22],
    ),
    Case(
        numa=[None, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3],
        nvlink=(
            "0-2:2 0-11:1 0-13:3 1-18:4 1-20:2 2-5:2 2-6:1 2-15:2 3-19:1 4-10:4 5-12:4 5-16:4 6-8:1 6-10:4 "
            "6-14:3 6-15:2 7-9:3 7-10:2 7-18:4 8-18:3 10-18:2 11-13:2 15-17:3 18-20:2"
        ),
        size=5, must=[5], uniform_pcie=True, expected=[1, 5, 7, 16, 18],
    ),
    Case(
        # The greedy growth must count each NUMA node it reaches: with the span it tracks wrong, it ends at
        # 4, 6, 10, 16, whose value is lower.
        numa=[0] * 9 + [1] * 9,
        nvlink=(
            "0-2:4 0-3:2 0-4:18 1-8:18 1-10:12 1-11:18 1-14:12 1-15:18 1-17:4 2-10:4 3-11:2 3-14:18 3-16:1 "
            "4-5:12 4-10:18 4-15:18 5-7:1 5-11:2 5-12:18 6-10:18 6-11:12 6-12:12 6-13:2 6-16:18 6-17:4 "
            "7-10:4 7-11:1 7-14:1 7-16:4 8-13:1 8-17:18 9-10:18 9-15:1 10-11:2 10-12:4 10-16:12 11-13:4 "
            "11-15:4 12-15:18 14-16:2 16-17:1"
        ),
        size=4, must=[], uniform_pcie=False, expected=[1, 4, 10, 15],
    ),
]


@pytest.mark.parametrize("case", [SWAP_AT_EQUAL_VALUE, *SEARCHED])
def test_fallback_reaches_the_optimum(case: Case) -> None:
    topo = case.topology()
    assert topo.gpu_count > EXACT_LIMIT
    assert brute_force(topo, case.size, case.must) == case.expected
    assert preferred_gpus(topo, list(range(topo.gpu_count)), case.must, case.size) == case.expected
