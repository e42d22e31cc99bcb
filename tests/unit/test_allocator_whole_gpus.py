"""The preferred allocation of whole GPUs (agent/topology/gpus.py): the exact search by value, NUMA span, best
remainder and index order, the invalid requests it refuses, the fallback above EXACT_LIMIT candidates, and both
against brute force. Every hand-worked expectation is worked out from the policy in gpus.py's docstrings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.topology.gpus import EXACT_LIMIT, preferred_gpus
from agent.topology.model import PCIE_LEVELS, PcieLevel, Topology
from agent.topology.request import AllocationError
from tests.builders import nvlink_pairs


def nvswitch(n: int = 8, links: int = 12) -> Topology:
    """Every pair joined through NVSwitch; first half of the GPUs on NUMA node 0, second half on node 1."""
    return Topology.build(
        [0 if g < n // 2 else 1 for g in range(n)],
        {},
        {(a, b): links for a in range(n) for b in range(a + 1, n)},
    )


# --- hand-worked optima


def test_nvlink_pair_is_preferred() -> None:
    # Both pairs score 200 on one NUMA node and leave a 200 pair behind: the index order decides.
    assert preferred_gpus(nvlink_pairs(), [0, 1, 2, 3], [], 2) == [0, 1]


def test_more_nvlinks_win_over_index_order() -> None:
    assert preferred_gpus(nvlink_pairs(links01=1, links23=2), [0, 1, 2, 3], [], 2) == [2, 3]


def test_unavailable_gpu_moves_to_the_intact_pair() -> None:
    # [1, 2] and [1, 3] score 10 (PCIe across NUMA nodes); [2, 3] scores 200.
    assert preferred_gpus(nvlink_pairs(), [1, 2, 3], [], 2) == [2, 3]


def test_must_include_is_honoured() -> None:
    assert preferred_gpus(nvlink_pairs(), [0, 1, 2, 3], [1], 2) == [0, 1]
    assert preferred_gpus(nvlink_pairs(), [1, 2, 3], [1], 2) == [1, 2]
    assert preferred_gpus(nvlink_pairs(), [1, 2, 3], [1, 3], 3) == [1, 2, 3]


def test_must_include_missing_from_available_still_counts_as_candidate() -> None:
    assert preferred_gpus(nvlink_pairs(), [0, 1, 3], [2], 2) == [2, 3]


def test_size_equal_to_candidates_returns_them_all() -> None:
    assert preferred_gpus(nvlink_pairs(), [3, 0, 2], [], 3) == [0, 2, 3]


def test_value_beats_numa_span() -> None:
    # The only NVLink crosses NUMA nodes: 100 across beats 30 within a node.
    topo = Topology.build([0, 0, 1, 1], {}, {(0, 2): 1})
    assert preferred_gpus(topo, [0, 1, 2, 3], [], 2) == [0, 2]


def test_nvswitch_prefers_one_numa_node_then_index_order() -> None:
    # 8 GPUs, every pair 1200, NUMA node 0 = GPUs 0-3, node 1 = GPUs 4-7. From {0,1,2,3,4} every pair is
    # worth 1200; pairs with GPU 4 span two nodes, so the pair comes from {0,1,2,3}. Each such pair leaves
    # three GPUs whose best pair is again 1200, so the remainder term ties and the smallest indices win.
    topo = nvswitch()
    assert preferred_gpus(topo, [0, 1, 2, 3, 4], [], 2) == [0, 1]
    assert topo.value([0, 1]) == 1200
    # From {3,...,7} the one-node pairs are within node 1.
    assert preferred_gpus(topo, [3, 4, 5, 6, 7], [], 2) == [4, 5]
    # With GPU 4 required every choice spans both nodes; the index order picks GPU 0.
    assert preferred_gpus(topo, [0, 1, 2, 3, 4], [4], 2) == [0, 4]
    # Four GPUs: a whole node when one is free.
    assert preferred_gpus(topo, [0, 1, 2, 4, 5, 6, 7], [], 4) == [4, 5, 6, 7]


def test_remainder_decides_between_equal_sets() -> None:
    # One NUMA node; PIX (60) for 0-1, 0-2 and 1-3, NODE (30) otherwise. Three pairs score 60:
    # taking [0, 1] leaves [2, 3] worth 30; [0, 2] leaves [1, 3] worth 60; [1, 3] leaves [0, 2] worth 60.
    topo = Topology.build([0, 0, 0, 0], {(0, 1): "single", (0, 2): "single", (1, 3): "single"}, {})
    assert preferred_gpus(topo, [0, 1, 2, 3], [], 2) == [0, 2]


def test_numa_span_beats_remainder() -> None:
    # PHB (40) for 0-1, 0-2, 1-3, SYS (10) otherwise; nodes {0, 1} and {2, 3}. [0, 1] spans one node but
    # leaves [2, 3] worth 10; [0, 2] and [1, 3] would leave 40 but span two nodes.
    pcie: dict[tuple[int, int], str] = {pair: "system" for pair in combinations(range(4), 2)}
    pcie.update({(0, 1): "hostbridge", (0, 2): "hostbridge", (1, 3): "hostbridge"})
    topo = Topology.build([0, 0, 1, 1], pcie, {})
    assert preferred_gpus(topo, [0, 1, 2, 3], [], 2) == [0, 1]


def test_ties_go_to_the_smallest_index_tuple() -> None:
    # NV1 for 1-3 and 2-4; PIX (60) for 0-1, 0-3, 0-4, 1-2, 2-3; NODE (30) for 0-2, 3-4; SYS (10) for 1-4.
    # [0, 1, 3] and [1, 2, 3] both score 60 + 60 + 100 = 220 (every other triple scores at most 190), both on
    # one node, and leave too few GPUs for a remainder: the smaller tuple wins.
    pcie = {
        (0, 1): "single",
        (0, 2): "node",
        (0, 3): "single",
        (0, 4): "single",
        (1, 2): "single",
        (1, 3): "system",
        (1, 4): "system",
        (2, 3): "single",
        (2, 4): "single",
        (3, 4): "node",
    }
    topo = Topology.build([0] * 5, pcie, {(1, 3): 1, (2, 4): 1})
    assert topo.value([0, 1, 3]) == topo.value([1, 2, 3]) == 220
    assert preferred_gpus(topo, list(range(5)), [], 3) == [0, 1, 3]


def test_remainder_is_not_compared_when_too_few_gpus_would_be_left() -> None:
    # Size 3 of 4: each choice leaves one GPU, so only value, span and index order count.
    assert preferred_gpus(nvlink_pairs(), [0, 1, 2, 3], [], 3) == [0, 1, 2]


def test_one_gpu_per_numa_node() -> None:
    # Every GPU on its own NUMA node (as on Grace Hopper): all sets of a size tie, the index order decides.
    topo = Topology.build(list(range(16)), {}, {(a, b): 18 for a in range(16) for b in range(a + 1, 16)})
    assert preferred_gpus(topo, list(range(16)), [], 8) == list(range(8))
    assert preferred_gpus(topo, [1, 3, 5, 7, 9, 11], [9], 3) == [1, 3, 9]


def test_sixteen_gpu_nvswitch_fills_one_node() -> None:
    topo = nvswitch(16, 18)
    assert preferred_gpus(topo, list(range(16)), [], 8) == list(range(8))
    assert preferred_gpus(topo, [*range(1, 16)], [], 8) == list(range(8, 16))
    # Nine with GPU 1 span both nodes whichever way, and too few would be left for a remainder: index order.
    assert preferred_gpus(topo, [*range(1, 16)], [1], 9) == list(range(1, 10))
    assert preferred_gpus(topo, [*range(1, 16)], [9], 4) == [8, 9, 10, 11]


def test_two_gpus_of_one_class_count_their_own_pair_in_the_remainder() -> None:
    # Triangles 0-1-2, 3-4-5 and 6-7-8 of 4 NVLinks each, 9 joined to 3, 4, 5 by 2; GPUs 0-4 on NUMA node 0.
    # Of 0, 2, 3, 7, 8 the pairs 0-2 and 7-8 tie on value (400), span (1) and remainder (the other pair, 400);
    # the index order gives 0-2. Scoring the pair inside one class of interchangeable GPUs wrongly in the
    # remainder makes the two remainders differ.
    topo = Topology.build([0] * 5 + [1] * 5, {}, {
        (0, 1): 4, (0, 2): 4, (1, 2): 4, (3, 4): 4, (3, 5): 4, (4, 5): 4, (6, 7): 4, (6, 8): 4, (7, 8): 4,
        (3, 9): 2, (4, 9): 2, (5, 9): 2})
    assert preferred_gpus(topo, [0, 2, 3, 7, 8], [], 2) == [0, 2]


def test_required_gpus_on_two_nodes_count_both_in_the_span() -> None:
    # GPUs 0, 1 on NUMA node 0 and 2, 3 on node 1, no NVLink. With 0 and 2 required, adding 1 or 3 gives the same
    # value (30 + 10 + 10) and the same span (both nodes are in use already); the index order gives 0, 1, 2.
    assert preferred_gpus(Topology.build([0, 0, 1, 1], {}, {}), [0, 1, 2, 3], [0, 2], 3) == [0, 1, 2]


def test_a_set_over_two_nodes_is_found_when_it_has_the_higher_value() -> None:
    # Triangles 0-1-2, 3-4-5 and 6-7-8 of 4 NVLinks each; 3, 4, 5 joined to 6, 7, 8 by 2. GPUs 0-3 on NUMA node 0.
    # Of 0, 1, 2, 3, 4, 6, 8, four GPUs: 3, 4, 6, 8 score 400 + 400 + 4 x 200 = 1600 across two nodes, against
    # 1200 + 90 for 0, 1, 2, 3 on one node.
    links = {(0, 1): 4, (0, 2): 4, (1, 2): 4, (3, 4): 4, (3, 5): 4, (4, 5): 4, (6, 7): 4, (6, 8): 4, (7, 8): 4}
    links.update({(a, b): 2 for a in (3, 4, 5) for b in (6, 7, 8)})
    topo = Topology.build([0] * 4 + [1] * 5, {}, links)
    assert preferred_gpus(topo, [0, 1, 2, 3, 4, 6, 8], [], 4) == [3, 4, 6, 8]


def test_sixteen_candidates_are_still_searched_exactly_with_the_remainder() -> None:
    # Two NUMA nodes of eight; NVLink only between 0 and 9 (12 links) and 1 and 14 (4). Every set of three with
    # 0 and 9 has the same value and spans both nodes; the remainder keeps the pair 1-14 for the next request,
    # so neither 1 nor 14 is taken: 0, 2, 9. The fallback, which does not weigh the remainder, would take 1.
    topo = Topology.build(numa=[i // 8 for i in range(16)], pcie={}, nvlink={(0, 9): 12, (1, 14): 4})
    assert preferred_gpus(topo, list(range(16)), [], 3) == [0, 2, 9]


def test_the_search_bound_counts_every_partner_a_class_can_still_give() -> None:
    # Nine GPUs on NUMA nodes 0,0,0,1,1,2,2,3,3 and one NVLink (0-2, 18 links). Four GPUs: 0, 1, 2 and one more
    # on another node; every fourth GPU leaves as good a remainder (two same-node pairs), so the lowest, 3.
    topo = Topology.build(numa=[0, 0, 0, 1, 1, 2, 2, 3, 3], pcie={}, nvlink={(0, 2): 18})
    assert preferred_gpus(topo, list(range(9)), [], 4) == [0, 1, 2, 3]


# --- invalid requests


@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        ([0, 1], [], 0, "size must be a positive integer, got 0"),
        ([0, 1], [], -2, "size must be a positive integer, got -2"),
        ([0, 1], [], 3, "size 3 is more than the 2 candidates offered"),
        ([0, 1, 2], [0, 1, 2], 2, "must_include has 3 entries, more than the requested size 2"),
        ([0, 4], [], 1, "available: unknown GPU index 4"),
        ([0, -1], [], 1, "available: unknown GPU index -1"),
        ([0, 1], [7], 1, "must_include: unknown GPU index 7"),
        ([0, 1, 1], [], 2, "available: GPU index 1 is listed twice"),
        ([0, 1], [0, 0], 2, "must_include: GPU index 0 is listed twice"),
    ],
)
def test_invalid_requests(available: list[int], must: list[int], size: int, message: str) -> None:
    with pytest.raises(AllocationError, match=message):
        preferred_gpus(nvlink_pairs(), available, must, size)


def test_allocation_error_is_a_value_error() -> None:
    assert issubclass(AllocationError, ValueError)


# --- the fallback above EXACT_LIMIT: greedy growth from the most promising GPUs, then pair swaps. On these nodes it
# reaches the optimum of its documented order (value, NUMA span, index tuple), which a brute force over every set
# checks; they are nodes where a weaker seed order, a greedy step that ignores the NUMA span, or missing swaps
# end elsewhere


def islands(count: int = 3) -> Topology:
    """`count` NVSwitch islands of 8 GPUs, one NUMA node each, joined only by PCIe across nodes."""
    n = 8 * count
    nvlink = {(a, b): 12 for a in range(n) for b in range(a + 1, n) if a // 8 == b // 8}
    return Topology.build([g // 8 for g in range(n)], {}, nvlink)


def test_fallback_keeps_requests_inside_an_island() -> None:
    topo = islands()
    every = list(range(24))
    assert len(every) > EXACT_LIMIT
    assert preferred_gpus(topo, every, [], 8) == list(range(8))
    assert preferred_gpus(topo, every[1:], [], 8) == list(range(8, 16))
    assert preferred_gpus(topo, every, [17], 4) == [16, 17, 18, 19]
    assert preferred_gpus(topo, every, [], 10) == [*range(8), 8, 9]


def test_fallback_result_is_valid_on_mixed_links() -> None:
    n = 20
    pcie: dict[tuple[int, int], str] = {
        (a, b): PCIE_LEVELS[(a * 7 + b * 3) % 5] for a in range(n) for b in range(a + 1, n)
    }
    topo = Topology.build([g % 3 for g in range(n)], pcie, {(a, a + 1): 1 + a % 3 for a in range(0, n, 2)})
    available = [g for g in range(n) if g % 5 != 4]
    got = preferred_gpus(topo, available, [3, 10], 7)
    assert len(got) == 7
    assert {3, 10} <= set(got) <= set(available) | {3, 10}
    assert got == sorted(got)
    assert got == preferred_gpus(topo, available, [3, 10], 7)


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


def fallback_optimum(topo: Topology, size: int, must: list[int]) -> list[int]:
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
    assert fallback_optimum(topo, case.size, case.must) == case.expected
    assert preferred_gpus(topo, list(range(topo.gpu_count)), case.must, case.size) == case.expected


# --- the exact search against brute force


def brute_force(topo: Topology, available: Sequence[int], must: Sequence[int], size: int) -> list[int]:
    """The reference, by enumeration: value, NUMA span, best remainder of the same size, index tuple."""
    candidates = sorted(set(available) | set(must))
    free = [g for g in candidates if g not in must]
    best: tuple[int, int, int, tuple[int, ...]] | None = None
    for extra in combinations(free, size - len(must)):
        chosen = tuple(sorted([*must, *extra]))
        left = [g for g in candidates if g not in chosen]
        remainder = max((topo.value(q) for q in combinations(left, size)), default=0)
        key = (-topo.value(chosen), topo.numa_span(chosen), -remainder, chosen)
        if best is None or key < best:
            best = key
    assert best is not None
    return list(best[3])


@st.composite
def requests(draw: st.DrawFn) -> tuple[Topology, list[int], list[int], int]:
    """Random topologies of up to 10 GPUs. GPUs are drawn into kinds whose pairs share link data, so that
    interchangeable GPUs, ties and one-GPU NUMA nodes are common; one kind per GPU gives arbitrary links."""
    n = draw(st.integers(1, 10))
    kinds = draw(st.integers(1, n))
    kind = draw(st.lists(st.integers(0, kinds - 1), min_size=n, max_size=n))
    node_of_kind = draw(st.lists(st.sampled_from([0, 1, 2, None]), min_size=kinds, max_size=kinds))
    links: dict[tuple[int, int], tuple[int, PcieLevel]] = {}
    for a in range(kinds):
        for b in range(a, kinds):
            links[(a, b)] = (draw(st.sampled_from([0, 0, 0, 1, 2, 4])), draw(st.sampled_from(PCIE_LEVELS)))
    pcie: dict[tuple[int, int], str] = {}
    nvlink: dict[tuple[int, int], int] = {}
    for a in range(n):
        for b in range(a + 1, n):
            count, level = links[(min(kind[a], kind[b]), max(kind[a], kind[b]))]
            pcie[(a, b)] = level
            nvlink[(a, b)] = count
    topo = Topology.build([node_of_kind[k] for k in kind], pcie, nvlink)
    available = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    size = draw(st.integers(1, len(available)))
    must = draw(st.lists(st.sampled_from(sorted(set(range(n)))), max_size=min(size, 3), unique=True))
    candidates = set(available) | set(must)
    size = min(max(size, len(must)), len(candidates))
    return topo, available, must, size


@st.composite
def two_level_requests(draw: st.DrawFn) -> tuple[Topology, list[int], list[int], int]:
    """PCIe-only topologies whose pairs are PIX or SYS at random, requests of at most half the candidates:
    many sets tie on value and span while their remainders differ, so the remainder term often decides."""
    n = draw(st.integers(4, 10))
    levels = draw(st.lists(st.sampled_from(["single", "system"]), min_size=n * n, max_size=n * n))
    pcie = {(a, b): levels[a * n + b] for a in range(n) for b in range(a + 1, n)}
    numa = draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n))
    available = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=n, unique=True))
    size = draw(st.integers(1, len(available) // 2))
    must = draw(st.lists(st.sampled_from(available), max_size=min(size, 2), unique=True))
    return Topology.build(numa, pcie, {}), available, must, size


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_matches_brute_force(request: tuple[Topology, list[int], list[int], int]) -> None:
    topo, available, must, size = request
    assert preferred_gpus(topo, available, must, size) == brute_force(topo, available, must, size)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_level_requests())
def test_matches_brute_force_where_the_remainder_decides(
    request: tuple[Topology, list[int], list[int], int],
) -> None:
    topo, available, must, size = request
    assert preferred_gpus(topo, available, must, size) == brute_force(topo, available, must, size)
