"""The preferred-allocation policies: whole GPUs (exact and fallback), time-sliced replicas, MIG devices."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.topology.gpus import EXACT_LIMIT, preferred_gpus
from agent.topology.mig_devices import preferred_mig
from agent.topology.model import PCIE_LEVELS, PcieLevel, Topology
from agent.topology.replicas import preferred_shared
from agent.topology.request import AllocationError


def nvlink_pairs(links01: int = 2, links23: int = 2) -> Topology:
    """GPU0-GPU1 and GPU2-GPU3 NVLink pairs; GPUs 0,1 on NUMA node 0 and 2,3 on node 1."""
    return Topology.build([0, 0, 1, 1], {}, {(0, 1): links01, (2, 3): links23})


def nvswitch(n: int = 8, links: int = 12) -> Topology:
    """Every pair joined through NVSwitch; first half of the GPUs on NUMA node 0, second half on node 1."""
    return Topology.build(
        [0 if g < n // 2 else 1 for g in range(n)],
        {},
        {(a, b): links for a in range(n) for b in range(a + 1, n)},
    )


# --- whole GPUs: hand-worked optima


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


# --- whole GPUs: invalid requests


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


# --- whole GPUs: the fallback above EXACT_LIMIT


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


# --- whole GPUs: agreement with brute force


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


# --- time-sliced replicas


def replicas(gpus: int = 4, per_gpu: int = 4) -> dict[str, int]:
    return {f"g{g}::{r}": g for g in range(gpus) for r in range(per_gpu)}


def offered(every: dict[str, int], allocated: Sequence[str]) -> list[str]:
    return [rid for rid in every if rid not in allocated]


def test_distributed_spreads_over_gpus_by_topology_when_load_is_equal() -> None:
    every = replicas()
    assert preferred_shared(nvlink_pairs(), every, list(every), [], 2) == ["g0::0", "g1::0"]
    # GPU 0 carries a replica already: of the idle GPUs 1, 2, 3 the NVLink pair 2-3 wins.
    available = offered(every, ["g0::0"])
    assert preferred_shared(nvlink_pairs(), every, available, [], 2) == ["g2::0", "g3::0"]


def test_distributed_prefers_least_loaded_gpus() -> None:
    every = replicas()
    available = offered(every, ["g0::0", "g0::1", "g1::0"])  # loads: GPU0 2, GPU1 1, GPU2 0, GPU3 0
    assert preferred_shared(nvlink_pairs(), every, available, [], 2) == ["g2::0", "g3::0"]
    assert preferred_shared(nvlink_pairs(), every, available, [], 3) == ["g1::1", "g2::0", "g3::0"]


def test_distributed_beyond_one_per_gpu_goes_to_the_least_loaded() -> None:
    every = replicas()
    assert preferred_shared(nvlink_pairs(), every, list(every), [], 6) == [
        "g0::0",
        "g0::1",
        "g1::0",
        "g1::1",
        "g2::0",
        "g3::0",
    ]


def test_distributed_with_must_include() -> None:
    every = replicas()
    assert preferred_shared(nvlink_pairs(), every, list(every), ["g0::3"], 2) == ["g0::3", "g1::0"]


def test_replica_ids_compare_numerically() -> None:
    every = replicas(gpus=1, per_gpu=12)
    available = offered(every, ["g0::0", "g0::1"])
    topo = Topology.build([0], {}, {})
    assert preferred_shared(topo, every, available, [], 1) == ["g0::2"]
    assert preferred_shared(topo, every, available, [], 9) == [f"g0::{r}" for r in range(2, 11)]


def test_packed_fills_the_busiest_gpu_that_fits() -> None:
    every = replicas()
    available = offered(every, ["g0::0", "g0::1", "g1::0"])  # free: GPU0 2, GPU1 3, GPU2 4, GPU3 4
    assert preferred_shared(nvlink_pairs(), every, available, [], 1, "packed") == ["g0::2"]
    assert preferred_shared(nvlink_pairs(), every, available, [], 3, "packed") == ["g1::1", "g1::2", "g1::3"]


def test_packed_uses_fewest_gpus() -> None:
    every = replicas()
    available = offered(every, ["g0::0", "g0::1", "g1::0"])
    # No GPU has 5 free: the largest idle GPU (2) first, then the busiest GPU that finishes the request.
    assert preferred_shared(nvlink_pairs(), every, available, [], 5, "packed") == [
        "g0::2",
        "g2::0",
        "g2::1",
        "g2::2",
        "g2::3",
    ]


def test_packed_fills_must_include_gpus_first() -> None:
    every = replicas()
    assert preferred_shared(nvlink_pairs(), every, list(every), ["g3::1"], 3, "packed") == [
        "g3::0",
        "g3::1",
        "g3::2",
    ]


def test_packed_prefers_linked_gpu_for_the_rest() -> None:
    every = replicas()
    # GPU 3 is full after the must-include replicas; the remaining two go to its NVLink partner GPU 2.
    must = ["g3::0", "g3::1", "g3::2", "g3::3"]
    assert preferred_shared(nvlink_pairs(), every, list(every), must, 6, "packed") == [
        "g2::0",
        "g2::1",
        *must,
    ]


def test_shared_rejects_bad_input() -> None:
    every = replicas()
    with pytest.raises(AllocationError, match="unknown sharing policy 'spread'"):
        preferred_shared(nvlink_pairs(), every, list(every), [], 1, "spread")  # type: ignore[arg-type]
    with pytest.raises(AllocationError, match="available: unknown replica id 'g9::0'"):
        preferred_shared(nvlink_pairs(), every, ["g9::0"], [], 1)
    with pytest.raises(AllocationError, match="replica 'x' is on GPU 7, which the topology does not have"):
        preferred_shared(nvlink_pairs(), {"x": 7}, ["x"], [], 1)
    with pytest.raises(AllocationError, match="size 17 is more than the 16 candidates offered"):
        preferred_shared(nvlink_pairs(), every, list(every), [], 17)


# --- MIG devices


def mig_devices() -> dict[str, tuple[int, int | None]]:
    """GPU0: 3 devices, GPU1: 2 (NUMA node 0); GPU2: 4, GPU3: 1 (node 1)."""
    layout = {0: (3, 0), 1: (2, 0), 2: (4, 1), 3: (1, 1)}
    return {f"mig-{g}-{i}": (g, node) for g, (count, node) in layout.items() for i in range(count)}


def test_mig_one_gpu_on_the_first_node_that_fits_exactly() -> None:
    devices = mig_devices()
    # Both nodes can serve 2 from one GPU; node 0 comes first, and GPU1 fits exactly (GPU0 stays whole).
    assert preferred_mig(devices, list(devices), [], 2) == ["mig-1-0", "mig-1-1"]


def test_mig_fewest_gpus_within_one_node() -> None:
    devices = mig_devices()
    # Node 0 needs GPUs 0 and 1 for 4 devices; node 1 serves them from GPU2 alone.
    assert preferred_mig(devices, list(devices), [], 4) == ["mig-2-0", "mig-2-1", "mig-2-2", "mig-2-3"]


def test_mig_spans_nodes_only_when_needed() -> None:
    devices = mig_devices()
    assert preferred_mig(devices, list(devices), [], 6) == [
        "mig-1-0",
        "mig-1-1",
        "mig-2-0",
        "mig-2-1",
        "mig-2-2",
        "mig-2-3",
    ]
    available = [d for d in devices if not d.startswith("mig-2-")]
    assert preferred_mig(devices, available, [], 4) == ["mig-0-0", "mig-0-1", "mig-0-2", "mig-1-0"]


def test_mig_must_include() -> None:
    devices = mig_devices()
    assert preferred_mig(devices, list(devices), ["mig-3-0"], 2) == ["mig-2-0", "mig-3-0"]
    assert preferred_mig(devices, list(devices), ["mig-0-2"], 2) == ["mig-0-0", "mig-0-2"]


def test_mig_devices_without_numa_node_form_one_node() -> None:
    devices: dict[str, tuple[int, int | None]] = {"a": (0, None), "b": (1, None), "c": (2, 0), "d": (2, 0)}
    assert preferred_mig(devices, list(devices), [], 2) == ["c", "d"]
    assert preferred_mig(devices, ["a", "b", "c"], [], 2) == ["a", "b"]


def test_mig_rejects_bad_input() -> None:
    devices = mig_devices()
    with pytest.raises(AllocationError, match="must_include: unknown MIG device id 'nope'"):
        preferred_mig(devices, list(devices), ["nope"], 1)
    with pytest.raises(AllocationError, match="GPU 0 is given two NUMA nodes"):
        preferred_mig({"a": (0, 0), "b": (0, 1)}, ["a"], [], 1)
    with pytest.raises(AllocationError, match="size must be a positive integer"):
        preferred_mig(devices, list(devices), [], 0)
