"""Preferred allocation of MIG devices: which MIG devices of one resource a request gets, on the fewest NUMA
nodes and parent GPUs, keeping larger GPUs whole."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations

from agent.topology.request import AllocationError, by_gpu, check_request, is_index, replica_order, take


def preferred_mig(
    devices: Mapping[str, tuple[int, int | None]],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[str]:
    """The preferred `size` MIG devices of one resource, sorted by `replica_order`.

    `devices` maps each MIG device id to (parent GPU index, parent NUMA node or None). Order of preference:
    the fewest NUMA nodes (devices without a node count as one node); then the fewest parent GPUs; then the
    NUMA nodes with the smallest sorted ids (None last). GPUs of `must_include` are filled first, then the
    largest GPUs until one GPU can finish the request; the finishing GPU is the fitting one with the fewest
    free devices (keeping larger GPUs whole), lowest index first. Within a GPU the lowest ids by
    `replica_order` are taken.
    """
    node_of: dict[int, int | None] = {}
    for did, (gpu, node) in devices.items():
        if not is_index(gpu):
            raise AllocationError(
                f"MIG device {did!r}: parent GPU index {gpu!r} is not a non-negative integer"
            )
        if node_of.setdefault(gpu, node) != node:
            raise AllocationError(f"MIG device {did!r}: GPU {gpu} is given two NUMA nodes")
    offered_ids, required = check_request(available, must_include, size, lambda d: d in devices, "MIG device id")
    required.sort(key=replica_order)
    offered = by_gpu(offered_ids, lambda d: devices[d][0])
    picked: dict[int, list[str]] = {}
    for did in required:
        picked.setdefault(devices[did][0], []).append(did)
    fixed_nodes = {node_of[g] for g in picked}
    free_nodes = sorted({node_of[g] for g in offered} - fixed_nodes, key=_numa_order)

    def plan(nodes: set[int | None]) -> list[tuple[int, int]] | None:
        """(gpu, count) to take beyond the must-include GPUs when limited to `nodes`; None if too few."""
        still = size - sum(len(offered[g]) for g in picked)
        steps: list[tuple[int, int]] = []
        spare = {g: len(offered[g]) for g in offered if g not in picked and node_of[g] in nodes}
        while still > 0:
            if not spare:
                return None
            fits = [g for g in spare if spare[g] >= still]
            g = min(fits, key=lambda g: (spare[g], g)) if fits else max(spare, key=lambda g: (spare[g], -g))
            steps.append((g, min(still, spare[g])))
            still -= spare.pop(g)
        return steps

    best: tuple[int, list[tuple[int, bool, int]], list[tuple[int, int]]] | None = None
    for extra in range(len(free_nodes) + 1):
        for added in combinations(free_nodes, extra):
            nodes = fixed_nodes | set(added)
            steps = plan(nodes)
            if steps is None:
                continue
            rank = (len(steps), sorted(_numa_order(n) for n in nodes), steps)
            if best is None or rank[:2] < best[:2]:
                best = rank
        if best is not None:
            break
    assert best is not None  # validated: all candidates together hold `size` devices
    still = size - len(required)
    for g in sorted(picked):
        more = min(still, len(offered[g]) - len(picked[g]))
        take(offered, picked, g, more)
        still -= more
    for g, count in best[2]:
        take(offered, picked, g, count)
    return sorted((did for ids in picked.values() for did in ids), key=replica_order)


def _numa_order(node: int | None) -> tuple[int, bool, int]:
    return (0, node is None, node if node is not None else 0)
