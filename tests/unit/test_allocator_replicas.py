"""The preferred allocation of time-sliced and MPS replicas (agent/topology/replicas.py): the `distributed` policy
(one replica at a time to the GPU with the lowest load counting the request, lowest index first) and the `packed`
one (fill the busiest GPU that fits, fewest GPUs), the replica fill against its definition, replica order by
precomputed rank against `replica_order` itself, and the checks on what the caller passes in. Every hand-worked
expectation is worked out from the policy in replicas.py's docstrings."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

import pytest

from agent.topology.model import Topology
from agent.topology.replicas import _fill, preferred_shared, replica_index
from agent.topology.request import AllocationError, replica_order
from tests.builders import nvlink_pairs

UNLINKED = Topology.build([0, 0, 0], {}, {})
"""Three GPUs on one NUMA node with no NVLink: every pair scores the same."""
TWO = Topology.build([0, 0], {}, {})


def replicas(gpus: int = 4, per_gpu: int = 4) -> dict[str, int]:
    return {f"g{g}::{r}": g for g in range(gpus) for r in range(per_gpu)}


def offered(every: dict[str, int], allocated: Sequence[str]) -> list[str]:
    return [rid for rid in every if rid not in allocated]


# --- distributed: spread over the least loaded GPUs


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


def test_distributed_extra_replicas_go_to_the_gpu_with_the_fewest_counting_this_request() -> None:
    every = {f"g{g}::{r}": g for g in range(2) for r in range(4)}
    # Two replicas of GPU 0 are required; one goes to GPU 1, and the fourth to GPU 1 again (1 < 2 on GPU 0).
    assert preferred_shared(TWO, every, list(every), ["g0::0", "g0::1"], 4) == ["g0::0", "g0::1", "g1::0", "g1::1"]


def test_distributed_never_asks_a_gpu_for_more_replicas_than_it_has_free() -> None:
    # GPU 0 has two replicas, both required (its level is 2); GPU 1 has four, two allocated already (load 2).
    every = {"g0::0": 0, "g0::1": 0, "g1::0": 1, "g1::1": 1, "g1::2": 1, "g1::3": 1}
    available = ["g1::2", "g1::3"]
    assert preferred_shared(TWO, every, available, ["g0::0", "g0::1"], 4) == ["g0::0", "g0::1", "g1::2", "g1::3"]


def test_distributed_fills_up_to_the_last_free_replica() -> None:
    # GPU 0: one free replica of two, GPU 1: three of three. Five replicas take every free one.
    every = {"g0::0": 0, "g0::1": 0, "g1::0": 1, "g1::1": 1, "g1::2": 1}
    available = ["g0::1", "g1::0", "g1::1", "g1::2"]
    assert preferred_shared(TWO, every, available, [], 4) == ["g0::1", "g1::0", "g1::1", "g1::2"]
    # Three free on GPU 0 and one on GPU 1: the fourth replica can only come from GPU 0.
    every = {"g0::0": 0, "g0::1": 0, "g0::2": 0, "g1::0": 1}
    assert preferred_shared(TWO, every, list(every), [], 4) == ["g0::0", "g0::1", "g0::2", "g1::0"]


def test_distributed_evens_out_the_load_one_replica_at_a_time() -> None:
    # GPU 0 is idle, GPU 1 carries one replica: one new replica each, then both extras go to GPU 0: the first
    # because its level is 1 against 2, the second because the tie at 2 goes to the lower index.
    every = {f"g{g}::{r}": g for g in range(2) for r in range(4)}
    available = [rid for rid in every if rid != "g1::0"]
    assert preferred_shared(TWO, every, available, [], 4) == ["g0::0", "g0::1", "g0::2", "g1::1"]


def test_a_gpus_load_counts_its_allocated_replicas_when_gpus_have_different_counts() -> None:
    # Time-sliced MIG devices: GPU 0 holds six replicas (three devices of two), GPU 1 two (one device of two).
    topo = Topology.build(numa=[0, 0], pcie={}, nvlink={})
    replicas = {**{f"a::{i}": 0 for i in range(6)}, "b::0": 1, "b::1": 1}
    # Three of GPU 0's replicas are allocated, none of GPU 1's: GPU 1 is the less loaded.
    assert preferred_shared(topo, replicas, ["a::3", "a::4", "a::5", "b::0", "b::1"], [], 1) == ["b::0"]
    # None of GPU 0's allocated and one of GPU 1's: GPU 0 is.
    assert preferred_shared(topo, replicas, [*(f"a::{i}" for i in range(6)), "b::1"], [], 1) == ["a::0"]


# --- the fill of the distributed policy against its definition


def one_at_a_time(offered: dict[int, list[str]], load: dict[int, int], picked: dict[int, list[str]],
                  still: int) -> dict[int, int]:
    """The definition, step by step."""
    extra: dict[int, int] = {}
    heap = [(load[g] + len(picked.get(g, ())), g) for g in offered if len(picked.get(g, ())) < len(offered[g])]
    heapq.heapify(heap)
    while still:
        level, g = heapq.heappop(heap)
        extra[g] = extra.get(g, 0) + 1
        still -= 1
        if len(picked.get(g, ())) + extra[g] < len(offered[g]):
            heapq.heappush(heap, (level + 1, g))
    return extra


@pytest.mark.parametrize("seed", range(300))
def test_the_fill_gives_what_one_at_a_time_gives(seed: int) -> None:
    rng = random.Random(seed)
    gpus = rng.randint(1, 16)
    offered = {g: [f"g{g}::{i}" for i in range(rng.randint(1, 60))] for g in range(gpus)}
    load = {g: rng.randint(0, 40) for g in offered}
    picked = {g: offered[g][:rng.randint(0, len(offered[g]))] for g in offered if rng.random() < 0.3}
    room = sum(len(offered[g]) - len(picked.get(g, ())) for g in offered)
    if room == 0:
        return
    still = rng.randint(1, room)
    assert _fill(offered, load, picked, still) == one_at_a_time(offered, load, picked, still)


def test_a_fill_with_ties_goes_to_the_lowest_index_first() -> None:
    offered = {0: ["a", "b", "c"], 1: ["d", "e", "f"], 2: ["g", "h"]}
    # Loads 1, 0, 1: GPU 1 first (level 0), then GPUs 0, 1, 2 at level 1 in index order.
    assert _fill(offered, {0: 1, 1: 0, 2: 1}, {}, 3) == {1: 2, 0: 1}
    assert _fill(offered, {0: 1, 1: 0, 2: 1}, {}, 4) == {1: 2, 0: 1, 2: 1}
    # A GPU whose offered replicas run out leaves the fill.
    assert _fill(offered, {0: 0, 1: 9, 2: 9}, {}, 5) == {0: 3, 1: 1, 2: 1}


# --- packed: the fewest GPUs


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


def test_packed_fills_the_busier_required_gpu_first() -> None:
    # One replica of each GPU is required; GPU 1 carries two replicas already, so the third request goes there.
    every = {f"g{g}::{r}": g for g in range(2) for r in range(4)}
    available = ["g0::0", "g0::1", "g0::2", "g0::3", "g1::2", "g1::3"]
    assert preferred_shared(TWO, every, available, ["g0::0", "g1::2"], 3, "packed") == [
        "g0::0", "g1::2", "g1::3"]


def test_packed_ties_go_to_the_lowest_gpu() -> None:
    every = {f"g{g}::{r}": g for g in range(3) for r in range(4)}
    assert preferred_shared(UNLINKED, every, list(every), [], 2, "packed") == ["g0::0", "g0::1"]


# --- replica order and the replica index


def test_replica_ids_compare_numerically() -> None:
    every = replicas(gpus=1, per_gpu=12)
    available = offered(every, ["g0::0", "g0::1"])
    topo = Topology.build([0], {}, {})
    assert preferred_shared(topo, every, available, [], 1) == ["g0::2"]
    assert preferred_shared(topo, every, available, [], 9) == [f"g0::{r}" for r in range(2, 11)]


def test_rank_keeps_replica_order_and_its_ties() -> None:
    # "g01::1" and "g1::1" are equal under replica_order (digit runs compare as numbers): equal ranks.
    replicas = {"g1::10": 0, "g1::2": 0, "g01::1": 0, "g1::1": 0, "g2::1": 1}
    topo = Topology.build(numa=[0, 0], pcie={}, nvlink={})
    index = replica_index(topo, replicas)
    assert index.rank == {"g01::1": 0, "g1::1": 0, "g1::2": 1, "g1::10": 2, "g2::1": 3}
    assert index.total == {0: 4, 1: 1}
    ids = ["g2::1", "g1::1", "g1::10", "g01::1", "g1::2"]
    assert sorted(ids, key=index.rank.__getitem__) == sorted(ids, key=replica_order) == [
        "g1::1", "g01::1", "g1::2", "g1::10", "g2::1"]


def test_an_index_made_once_answers_as_one_made_per_call() -> None:
    rng = random.Random(7)
    topo = Topology.build(numa=[0, 0, 0, 0, 1, 1, 1, 1], pcie={}, nvlink={(0, 1): 12, (2, 3): 12})
    replicas = {f"GPU-{g}::{r}": g for g in range(8) for r in range(10)}
    index = replica_index(topo, replicas)
    ids = list(replicas)
    for _ in range(200):
        size = rng.randint(1, len(ids))
        available = rng.sample(ids, rng.randint(size, len(ids)))
        must = available[:rng.randint(0, min(2, size))]
        for policy in ("distributed", "packed"):
            assert preferred_shared(topo, replicas, available, must, size, policy, index) == preferred_shared(
                topo, replicas, available, must, size, policy)


# --- invalid requests


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


def test_a_replica_on_a_gpu_past_the_last_is_refused() -> None:
    with pytest.raises(AllocationError) as caught:
        preferred_shared(TWO, {"g0::0": 0, "g2::0": 2}, ["g0::0"], [], 1)
    assert str(caught.value) == "replica 'g2::0' is on GPU 2, which the topology does not have"
    with pytest.raises(AllocationError) as last:
        preferred_shared(TWO, {"g0::0": 0, "g1::0": 1, "gx::0": 2}, ["g0::0"], [], 1)
    assert str(last.value) == "replica 'gx::0' is on GPU 2, which the topology does not have"
