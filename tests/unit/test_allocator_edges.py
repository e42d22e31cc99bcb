"""Allocator choices that only show on particular loads and layouts: which GPU a time-sliced or MIG request
lands on when the simple cases tie, and the checks on what the caller passes in. Every expectation is worked
out by hand from the policy in the docstrings of agent/topology/gpus.py, replicas.py and mig_devices.py."""

from __future__ import annotations

import pytest

from agent.topology.gpus import preferred_gpus
from agent.topology.mig_devices import preferred_mig
from agent.topology.model import Topology
from agent.topology.replicas import preferred_shared
from agent.topology.request import AllocationError

UNLINKED = Topology.build([0, 0, 0], {}, {})
"""Three GPUs on one NUMA node with no NVLink: every pair scores the same."""
TWO = Topology.build([0, 0], {}, {})


def test_a_replica_on_a_gpu_past_the_last_is_refused() -> None:
    with pytest.raises(AllocationError) as caught:
        preferred_shared(TWO, {"g0::0": 0, "g2::0": 2}, ["g0::0"], [], 1)
    assert str(caught.value) == "replica 'g2::0' is on GPU 2, which the topology does not have"
    with pytest.raises(AllocationError) as last:
        preferred_shared(TWO, {"g0::0": 0, "g1::0": 1, "gx::0": 2}, ["g0::0"], [], 1)
    assert str(last.value) == "replica 'gx::0' is on GPU 2, which the topology does not have"


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


def test_packed_fills_the_busier_required_gpu_first() -> None:
    # One replica of each GPU is required; GPU 1 carries two replicas already, so the third request goes there.
    every = {f"g{g}::{r}": g for g in range(2) for r in range(4)}
    available = ["g0::0", "g0::1", "g0::2", "g0::3", "g1::2", "g1::3"]
    assert preferred_shared(TWO, every, available, ["g0::0", "g1::2"], 3, "packed") == [
        "g0::0", "g1::2", "g1::3"]


def test_packed_ties_go_to_the_lowest_gpu() -> None:
    every = {f"g{g}::{r}": g for g in range(3) for r in range(4)}
    assert preferred_shared(UNLINKED, every, list(every), [], 2, "packed") == ["g0::0", "g0::1"]


def test_mig_request_bigger_than_any_gpu_starts_on_the_lowest_of_the_largest() -> None:
    devices = {f"mig-{g}-{i}": (g, 0) for g in range(3) for i in range(2)}
    assert preferred_mig(devices, list(devices), [], 5) == ["mig-0-0", "mig-0-1", "mig-1-0", "mig-1-1", "mig-2-0"]


def test_mig_device_with_a_bad_parent_index_is_named() -> None:
    with pytest.raises(AllocationError) as caught:
        preferred_mig({"mig-a": (-1, 0)}, ["mig-a"], [], 1)
    assert str(caught.value) == "MIG device 'mig-a': parent GPU index -1 is not a non-negative integer"


def test_mig_one_node_that_cannot_serve_does_not_push_the_request_onto_two() -> None:
    # Node 0 has one GPU with two devices, node 1 two such GPUs: three devices fit on node 1 alone.
    devices = {f"mig-{g}-{i}": (g, 0 if g == 0 else 1) for g in range(3) for i in range(2)}
    assert preferred_mig(devices, list(devices), [], 3) == ["mig-1-0", "mig-1-1", "mig-2-0"]


def test_mig_must_include_gpus_give_only_what_the_request_still_needs() -> None:
    devices = {f"mig-{g}-{i}": (g, 0) for g in range(2) for i in range(3)}
    # One device of each GPU is required; the third comes from GPU 0, the lower index.
    assert preferred_mig(devices, list(devices), ["mig-0-0", "mig-1-0"], 3) == ["mig-0-0", "mig-0-1", "mig-1-0"]
    # Five: GPU 0 is filled first, then GPU 1 gives the one more needed.
    assert preferred_mig(devices, list(devices), ["mig-0-0", "mig-1-0"], 5) == [
        "mig-0-0", "mig-0-1", "mig-0-2", "mig-1-0", "mig-1-1"]


def test_mig_answer_is_in_natural_order() -> None:
    devices = {f"mig-0-{i}": (0, 0) for i in (2, 10, 11)}
    assert preferred_mig(devices, list(devices), [], 3) == ["mig-0-2", "mig-0-10", "mig-0-11"]


def test_mig_ties_go_to_the_lowest_numa_node_and_devices_without_one_last() -> None:
    no_node = {"mig-a-0": (0, None), "mig-a-1": (0, None), "mig-b-0": (1, 0), "mig-b-1": (1, 0)}
    assert preferred_mig(no_node, list(no_node), [], 2) == ["mig-b-0", "mig-b-1"]
    # Nodes 8 and 1: node 1 comes first by number, whatever order a set of them iterates in.
    numbered = {"mig-a-0": (0, 8), "mig-a-1": (0, 8), "mig-b-0": (1, 1), "mig-b-1": (1, 1)}
    assert preferred_mig(numbered, list(numbered), [], 2) == ["mig-b-0", "mig-b-1"]


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
