"""The replica fill of the `distributed` sharing policy against its definition (one replica at a time to the GPU
with the lowest load counting the request, lowest index first), and replica order by precomputed rank against
`replica_order` itself, ties included."""

from __future__ import annotations

import heapq
import random

import pytest

from agent.topology.model import Topology
from agent.topology.replicas import _fill, preferred_shared, replica_index
from agent.topology.request import replica_order


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


def test_a_gpus_load_counts_its_allocated_replicas_when_gpus_have_different_counts() -> None:
    # Time-sliced MIG devices: GPU 0 holds six replicas (three devices of two), GPU 1 two (one device of two).
    topo = Topology.build(numa=[0, 0], pcie={}, nvlink={})
    replicas = {**{f"a::{i}": 0 for i in range(6)}, "b::0": 1, "b::1": 1}
    # Three of GPU 0's replicas are allocated, none of GPU 1's: GPU 1 is the less loaded.
    assert preferred_shared(topo, replicas, ["a::3", "a::4", "a::5", "b::0", "b::1"], [], 1) == ["b::0"]
    # None of GPU 0's allocated and one of GPU 1's: GPU 0 is.
    assert preferred_shared(topo, replicas, [*(f"a::{i}" for i in range(6)), "b::1"], [], 1) == ["a::0"]
