"""The free GPUs and how fragmented they are (agent/topology/fragmentation.py): hand-made topologies whose figures
are worked out by hand here, MIG room read off NVIDIA's H100 placement table, the /metrics families with and
without known holdings, and a running agent's /metrics on presets with pods holding GPUs."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import urllib.request
from collections.abc import Iterable

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import parse_config
from agent.metrics import Metrics
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvml.records import DriverInfo, NodeInventory, PairLink
from agent.state import DeviceHealth, NodeState, StateBus
from agent.topology.fragmentation import Fragmentation, fragmentation, largest_clique, nvlink_adjacency
from agent.topology.model import Topology
from agent.topology.prefer import topology_of
from tests.builders import MIXED_GPU0, gpu, node, pod_resources
from tests.plugin_harness import carve_mig, running_agent, short_dir, wait_until

FREE_FAMILIES = ("gpu_agent_free_gpus", "gpu_agent_free_gpus_largest_nvlink_set",
                 "gpu_agent_free_gpus_largest_numa_set")


def hand_made(numa: list[int | None], nvlink: Iterable[tuple[int, int]]) -> NodeState:
    """A node of A100s on the given NUMA nodes, with NVLink (12 links) between exactly the given pairs."""
    joined = {(min(a, b), max(a, b)) for a, b in nvlink}
    n = len(numa)
    links = tuple(PairLink(a, b, 12 if (a, b) in joined else 0, "system") for a in range(n) for b in range(a + 1, n))
    gpus = tuple(dataclasses.replace(gpu(i, 0), numa_node=numa_node) for i, numa_node in enumerate(numa))
    return NodeState(version=1, inventory=NodeInventory(DriverInfo("570.133.20", "12.8"), gpus, links))


def every_pair(n: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(n) for b in range(a + 1, n)]


def uuids(state: NodeState, *indices: int) -> set[str]:
    return {state.inventory.gpus[i].uuid for i in indices}


def figures(state: NodeState, held: set[str] | None = None) -> Fragmentation:
    return fragmentation(state, held or set(), topology_of(state.inventory))


def summary(f: Fragmentation) -> tuple[int, int, int, int]:
    """(free, largest NVLink set, largest NUMA set, the node's largest NVLink set)."""
    return len(f.free), f.largest_nvlink_set, f.largest_numa_set, f.node_nvlink_set


# --- whole GPUs on hand-made topologies ---------------------------------------------------------------------------


def test_an_nvswitch_node_with_three_gpus_held_has_its_five_free_gpus_all_joined() -> None:
    state = hand_made([0, 0, 0, 0, 1, 1, 1, 1], every_pair(8))
    f = figures(state, uuids(state, 1, 3, 5))
    # Free: 0, 2, 4, 6, 7. NVSwitch joins every pair: all 5. NUMA node 0 has 0 and 2, node 1 has 4, 6 and 7.
    assert f.free == (0, 2, 4, 6, 7)
    assert summary(f) == (5, 5, 3, 8)


def test_nvlink_pairs_with_one_gpu_of_three_pairs_held_leave_one_whole_pair() -> None:
    state = hand_made([0, 0, 0, 0, 1, 1, 1, 1], [(0, 1), (2, 3), (4, 5), (6, 7)])
    f = figures(state, uuids(state, 0, 2, 4))
    # Free: 1, 3, 5, 6, 7. Only 6-7 are joined. NUMA node 0: 1, 3; node 1: 5, 6, 7.
    assert f.free == (1, 3, 5, 6, 7)
    assert summary(f) == (5, 2, 3, 2)


def test_a_hybrid_cube_mesh_with_one_gpu_of_each_quad_held_fits_no_four_gpu_job() -> None:
    # DGX-1's hybrid cube mesh: GPUs 0-3 all joined, 4-7 all joined, and each GPU i to i + 4.
    mesh = every_pair(4) + [(a + 4, b + 4) for a, b in every_pair(4)] + [(i, i + 4) for i in range(4)]
    state = hand_made([0, 0, 0, 0, 1, 1, 1, 1], mesh)
    # GPU 0 held: the quad 4-7 is whole.
    assert summary(figures(state, uuids(state, 0))) == (7, 4, 4, 4)
    # GPUs 0 and 4 held: six free, but a set across the quads has at most two GPUs (i and i + 4), and what is
    # left of each quad is three.
    assert summary(figures(state, uuids(state, 0, 4))) == (6, 3, 3, 4)


def test_the_numa_set_counts_free_gpus_per_node_and_gpus_without_a_node_as_one_node() -> None:
    state = hand_made([0, 0, 0, 0, 1, 1, 1, 1], every_pair(8))
    # Free: 2, 3 on node 0 and 6, 7 on node 1: all four joined, two on either node.
    assert summary(figures(state, uuids(state, 0, 1, 4, 5))) == (4, 4, 2, 8)
    unknown = hand_made([None, None, None, 0], [])
    # No NVLink at all: a free GPU is a set of one. GPUs 0-2 report no node: one group of three.
    assert summary(figures(unknown)) == (4, 1, 3, 1)


def test_a_gpu_unhealthy_draining_in_mig_mode_or_held_through_the_mode_left_is_not_free() -> None:
    base = hand_made([0] * 8, every_pair(8))
    gpus = list(base.inventory.gpus)
    gpus[3] = dataclasses.replace(gpus[3], mig_enabled=True)
    state = dataclasses.replace(
        base, inventory=dataclasses.replace(base.inventory, gpus=tuple(gpus)),
        health={gpus[0].uuid: DeviceHealth(False, "XID 48")}, draining=frozenset(uuids(base, 1)),
        held=frozenset(uuids(base, 2)))
    f = figures(state, uuids(base, 7))  # and GPU 7 held by a pod
    assert f.free == (4, 5, 6)
    assert summary(f) == (3, 3, 3, 8)


def test_while_the_mode_left_is_being_read_no_gpu_is_free() -> None:
    state = dataclasses.replace(hand_made([0] * 4, every_pair(4)), handover=True)
    assert summary(figures(state)) == (0, 0, 0, 4)


def test_the_largest_set_of_pairwise_joined_gpus() -> None:
    n = 16
    # The graph of 16 with the most maximal cliques: five groups of three, each GPU joined to every GPU outside
    # its group, and GPU 15 joined to all. A largest set takes one GPU of each group and GPU 15: 6.
    group = [i // 3 for i in range(15)] + [-1]
    adjacency = [sum(1 << b for b in range(n) if b != a and (-1 in (group[a], group[b]) or group[a] != group[b]))
                 for a in range(n)]
    assert largest_clique(adjacency, (1 << n) - 1) == 6
    # Without GPU 15, and with group 0 (GPUs 0-2) left out too: one GPU of each of the other four groups.
    assert largest_clique(adjacency, ((1 << 15) - 1) & ~0b111) == 4
    assert largest_clique(adjacency, 0) == 0
    assert largest_clique(adjacency, 1 << 4) == 1
    pairs = Topology.build([0] * 4, {}, {(0, 1): 2, (2, 3): 4})
    assert nvlink_adjacency(pairs) == (0b0010, 0b0001, 0b1000, 0b0100)


# --- MIG: NVIDIA's H100 placement table ---------------------------------------------------------------------------
#
# An H100 has 8 memory slices. Placements (start slices; size): 1g.10gb and 1g.10gb+me at 0-6 (1; +me at most one
# instance a GPU), 1g.20gb at 0, 2, 4, 6 (2), 2g.20gb at 0, 2, 4 (2), 3g.40gb at 0, 4 (4), 4g.40gb at 0 (4),
# 7g.80gb at 0 (8). The expectations below are read off that table.

EMPTY_H100 = {"1g.10gb": 7, "1g.10gb+me": 1, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1}


def test_an_h100_with_a_4g_instance_at_slice_0_takes_one_3g_one_2g_three_1g_more() -> None:
    # 4g.40gb holds slices 0-3: a 3g.40gb fits at 4; a 2g.20gb at 4 (6 is no 2g start); 1g.10gb at 4, 5, 6 (slice
    # 7 starts no 1g); 1g.20gb at 4 and 6; no second 4g, no 7g.
    f = figures(node("dgx-h100", mig={0: [("4g.40gb", 0)]}))
    assert f.mig_placeable == {"1g.10gb": 3, "1g.10gb+me": 1, "1g.20gb": 2, "2g.20gb": 1, "3g.40gb": 1,
                               "4g.40gb": 0, "7g.80gb": 0}
    assert summary(f) == (7, 7, 4, 8)


def test_two_1g_instances_at_0_and_4_leave_no_room_for_a_3g_in_six_free_slices() -> None:
    # Slices 1-3 and 5-7 free. 3g.40gb needs 0-3 or 4-7: none. 2g.20gb: only 2-3. 1g.20gb: 2-3 and 6-7.
    # 1g.10gb: 1, 2, 3, 5, 6 (and 2 + 5 is within its 7 instances).
    f = figures(node("dgx-h100", mig={0: [("1g.10gb", 0), ("1g.10gb", 4)]}))
    assert f.mig_placeable == {"1g.10gb": 5, "1g.10gb+me": 1, "1g.20gb": 2, "2g.20gb": 1, "3g.40gb": 0,
                               "4g.40gb": 0, "7g.80gb": 0}


def test_a_mixed_layout_with_slice_7_free_takes_nothing_more() -> None:
    # 3g.40gb at 0-3, 2g.20gb at 4-5, 1g.10gb at 6: slice 7 is free, and no profile starts there.
    f = figures(node("dgx-h100", mig={0: MIXED_GPU0}))
    assert f.mig_placeable == dict.fromkeys(EMPTY_H100, 0)


def test_the_room_of_several_mig_gpus_is_summed_and_an_unhealthy_one_left_out() -> None:
    state = node("dgx-h100", mig={0: [("4g.40gb", 0)], 1: [], 2: []})
    # GPU 0 as above; GPUs 1 and 2 in MIG mode without instances: each the whole table.
    assert figures(state).mig_placeable == {"1g.10gb": 3 + 7 + 7, "1g.10gb+me": 1 + 1 + 1, "1g.20gb": 2 + 4 + 4,
                                            "2g.20gb": 1 + 3 + 3, "3g.40gb": 1 + 2 + 2, "4g.40gb": 0 + 1 + 1,
                                            "7g.80gb": 0 + 1 + 1}
    sick = dataclasses.replace(state, health={state.inventory.gpus[2].uuid: DeviceHealth(False, "XID 48")})
    assert figures(sick).mig_placeable == {"1g.10gb": 3 + 7, "1g.10gb+me": 1 + 1, "1g.20gb": 2 + 4,
                                           "2g.20gb": 1 + 3, "3g.40gb": 1 + 2, "4g.40gb": 0 + 1, "7g.80gb": 0 + 1}
    draining = dataclasses.replace(state, draining=frozenset(uuids(state, 1, 2)))
    assert figures(draining).mig_placeable == {"1g.10gb": 3, "1g.10gb+me": 1, "1g.20gb": 2, "2g.20gb": 1,
                                               "3g.40gb": 1, "4g.40gb": 0, "7g.80gb": 0}


def test_a_node_without_mig_gpus_has_no_mig_room() -> None:
    assert figures(node("dgx-h100")).mig_placeable == {}


# --- the /metrics families ----------------------------------------------------------------------------------------


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by family name, for the families of this module (every one, with or without samples)."""
    wanted = (*FREE_FAMILIES, "gpu_agent_gpus_largest_nvlink_set", "gpu_agent_mig_placeable_instances")
    return {f.name: [(s.labels, s.value) for s in f.samples]
            for f in text_string_to_metric_families(text) if f.name in wanted}


def scrape(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    return samples(generate_latest(metrics.registry).decode())


async def test_the_families_and_no_free_figures_where_the_holdings_are_not_known() -> None:
    state = node("pcie-16-nvlink-pairs")
    holdings: list[frozenset[str] | None] = [None]
    metrics = Metrics()
    metrics.watch_free(StateBus(state), lambda: holdings[0])
    unknown = scrape(metrics)
    assert unknown == {**{name: [] for name in FREE_FAMILIES}, "gpu_agent_gpus_largest_nvlink_set": [({}, 2.0)],
                       "gpu_agent_mig_placeable_instances": []}
    holdings[0] = frozenset(uuids(state, 0, 2, 4, 6, 8))
    # Free: 1, 3, 5, 7, 9-15. Whole pairs: 10-11, 12-13, 14-15. NUMA node 3 (GPUs 12-15) is all free.
    assert scrape(metrics) == {"gpu_agent_free_gpus": [({}, 11.0)],
                               "gpu_agent_free_gpus_largest_nvlink_set": [({}, 2.0)],
                               "gpu_agent_free_gpus_largest_numa_set": [({}, 4.0)],
                               "gpu_agent_gpus_largest_nvlink_set": [({}, 2.0)],
                               "gpu_agent_mig_placeable_instances": []}


async def test_the_mig_family_has_one_sample_a_profile() -> None:
    metrics = Metrics()
    metrics.watch_free(StateBus(node("dgx-h100", mig={0: [("4g.40gb", 0)]})), frozenset)
    assert scrape(metrics)["gpu_agent_mig_placeable_instances"] == [
        ({"profile": "1g.10gb"}, 3.0), ({"profile": "1g.10gb+me"}, 1.0), ({"profile": "1g.20gb"}, 2.0),
        ({"profile": "2g.20gb"}, 1.0), ({"profile": "3g.40gb"}, 1.0), ({"profile": "4g.40gb"}, 0.0),
        ({"profile": "7g.80gb"}, 0.0)]


# --- a running agent ----------------------------------------------------------------------------------------------


def http_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


async def test_a_running_agents_metrics_follow_the_pods_the_kubelet_lists() -> None:
    directory = short_dir()
    socket = directory / "pr.sock"
    config = parse_config(yaml.safe_dump({"version": "v1", "telemetry": {"intervalSeconds": 1},
                                          "mig": {"podResourcesSocket": str(socket)}}))
    try:
        async with pod_resources(socket) as lister, \
                running_agent("pcie-16-nvlink-pairs", config, metrics_port=0) as rig:
            lister.pods = {"trainer-0": {"nvidia.com/gpu": [rig.uuid(i) for i in (0, 2, 4, 6, 8)]}}
            # Free: 1, 3, 5, 7, 9-15. Whole pairs: 10-11, 12-13, 14-15. NUMA node 3 (GPUs 12-15) is all free.
            held = {"gpu_agent_free_gpus": [({}, 11.0)],
                    "gpu_agent_free_gpus_largest_nvlink_set": [({}, 2.0)],
                    "gpu_agent_free_gpus_largest_numa_set": [({}, 4.0)],
                    "gpu_agent_gpus_largest_nvlink_set": [({}, 2.0)],
                    "gpu_agent_mig_placeable_instances": []}
            await wait_until(lambda: samples(http_metrics(rig.metrics_port)) == held, 10,
                             "the figures with the pod's five GPUs held", blocking=True)
            lister.pods = {}
            gone = {**held, "gpu_agent_free_gpus": [({}, 16.0)]}
            await wait_until(lambda: samples(http_metrics(rig.metrics_port)) == gone, 10,
                             "every GPU free once the pod is gone", blocking=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_a_running_agent_on_an_h100_node_with_a_4g_instance() -> None:
    fake = FakeNvml(load_node("dgx-h100"))
    carve_mig(fake, 0, [("4g.40gb", 0)])
    config = parse_config("version: v1\ntelemetry: {intervalSeconds: 1}\n")
    async with running_agent("dgx-h100", config, fake=fake, metrics_port=0) as rig:
        await wait_until(lambda: rig.agent.telemetry.passes >= 1, 10, "a telemetry pass")
        found = samples(await asyncio.to_thread(http_metrics, rig.metrics_port))
    # No kubelet PodResources here: no pod holds a GPU. GPUs 1-7 free, all joined (NVSwitch); NUMA node 1 has 4-7.
    assert {name: values for name, values in found.items() if name != "gpu_agent_mig_placeable_instances"} == {
        "gpu_agent_free_gpus": [({}, 7.0)], "gpu_agent_free_gpus_largest_nvlink_set": [({}, 7.0)],
        "gpu_agent_free_gpus_largest_numa_set": [({}, 4.0)], "gpu_agent_gpus_largest_nvlink_set": [({}, 8.0)]}
    assert dict((labels["profile"], value) for labels, value in found["gpu_agent_mig_placeable_instances"]) == {
        "1g.10gb": 3, "1g.10gb+me": 1, "1g.20gb": 2, "2g.20gb": 1, "3g.40gb": 1, "4g.40gb": 0, "7g.80gb": 0}


async def test_without_a_podresources_listing_the_free_figures_have_no_sample_outside_dra_mode() -> None:
    config = parse_config("version: v1\ntelemetry: {dcgmMetrics: false}\n")
    async with running_agent("dgx-h100", config, metrics_port=0) as rig:
        found = samples(await asyncio.to_thread(http_metrics, rig.metrics_port))
    assert found == {**{name: [] for name in FREE_FAMILIES}, "gpu_agent_gpus_largest_nvlink_set": [({}, 8.0)],
                     "gpu_agent_mig_placeable_instances": []}
    # In DRA mode pods get whole GPUs through the claims the agent prepares (none here): all 8 free, 4 a node.
    dra = parse_config("version: v1\ntelemetry: {dcgmMetrics: false}\ndra: {enabled: true}\n")
    free = {"gpu_agent_free_gpus": [({}, 8.0)], "gpu_agent_free_gpus_largest_nvlink_set": [({}, 8.0)],
            "gpu_agent_free_gpus_largest_numa_set": [({}, 4.0)], "gpu_agent_gpus_largest_nvlink_set": [({}, 8.0)],
            "gpu_agent_mig_placeable_instances": []}
    async with running_agent("dgx-h100", dra, metrics_port=0) as rig:
        await wait_until(lambda: samples(http_metrics(rig.metrics_port)) == free, 10,
                         "the figures once the mode left is read", blocking=True)
