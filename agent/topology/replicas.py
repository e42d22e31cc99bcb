"""Preferred allocation of the replicas of shared GPUs (time-slicing and MPS): which replicas of a resource a
request gets, spread over GPUs ("distributed") or packed onto few ("packed"), with the load each GPU already
carries. `replica_index` is what a resource's replicas give once, for every call; the choice of GPUs to spread
over uses the whole-GPU search (gpus.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from agent.topology.gpus import preferred_gpus
from agent.topology.model import Topology
from agent.topology.request import AllocationError, by_gpu, check_request, is_index, replica_order, take

SharingPolicy = Literal["distributed", "packed"]



@dataclass(frozen=True)
class ReplicaIndex:
    """What `preferred_shared` derives from a resource's replicas alone, checked against the topology: each
    replica's rank in `replica_order` (equal keys, equal ranks) and each GPU's replica count. Built once per
    resource by `replica_index` and passed to every call, so that a call sorts small integers, not keys."""

    replicas: Mapping[str, int]
    topo: Topology
    rank: Mapping[str, int]
    total: Mapping[int, int]


def replica_index(topo: Topology, replicas: Mapping[str, int]) -> ReplicaIndex:
    gpu_count = topo.gpu_count
    total: dict[int, int] = {}
    for rid, gpu in replicas.items():
        if not is_index(gpu) or gpu >= gpu_count:
            raise AllocationError(f"replica {rid!r} is on GPU {gpu!r}, which the topology does not have")
        total[gpu] = total.get(gpu, 0) + 1
    rank: dict[str, int] = {}
    previous: tuple[tuple[int, str, int], ...] | None = None
    level = -1
    for rid in sorted(replicas, key=replica_order):
        key = replica_order(rid)
        if key != previous:
            level, previous = level + 1, key
        rank[rid] = level
    return ReplicaIndex(replicas, topo, rank, total)


def preferred_shared(
    topo: Topology,
    replicas: Mapping[str, int],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: SharingPolicy = "distributed",
    index: ReplicaIndex | None = None,
) -> list[str]:
    """The preferred `size` replicas of a time-sliced resource, sorted by `replica_order`.

    `replicas` maps every replica id of the resource to its physical GPU index. A replica that is neither in
    `available` nor in `must_include` counts as allocated: it is the load of its GPU.

    - "distributed": as many distinct GPUs as the request allows, the least-loaded GPUs first; among GPUs of
      equal load the set with the best `preferred_gpus` order (value, NUMA span, remainder, index). Further
      replicas go one at a time to the GPU with the lowest load counting this request, lowest index first.
    - "packed": the fewest GPUs. The GPUs of `must_include` are filled first; then, while no single GPU can
      finish the request, the GPU with the most free replicas; the GPU that finishes it is the fitting one
      with the most replicas already allocated (then the best score towards the GPUs used, lowest index).

    Within a GPU the lowest replicas by `replica_order` are taken.

    `index` is `replica_index(topo, replicas)`, made once for many calls; without it the call makes its own.
    """
    if policy not in ("distributed", "packed"):
        raise AllocationError(f"unknown sharing policy {policy!r}; use 'distributed' or 'packed'")
    if index is None or index.replicas is not replicas or index.topo is not topo:
        index = replica_index(topo, replicas)
    rank = index.rank.__getitem__
    offered_ids, required = check_request(available, must_include, size, replicas.__contains__, "replica id")
    required.sort(key=rank)
    offered = by_gpu(offered_ids, replicas.__getitem__, rank)
    total = index.total
    load = {g: total[g] - len(offered[g]) for g in offered}
    picked: dict[int, list[str]] = {}
    for rid in required:
        picked.setdefault(replicas[rid], []).append(rid)
    still = size - len(required)
    if policy == "distributed":
        _spread(topo, offered, load, picked, still)
    else:
        _pack(topo, offered, load, picked, still)
    return sorted((rid for ids in picked.values() for rid in ids), key=rank)



def _spread(
    topo: Topology,
    offered: Mapping[int, list[str]],
    load: Mapping[int, int],
    picked: dict[int, list[str]],
    still: int,
) -> None:
    others = sorted((g for g in offered if g not in picked), key=lambda g: (load[g], g))
    new = min(still, len(others))
    if new:
        cut = load[others[new - 1]]
        fixed = sorted([*picked, *(g for g in others if load[g] < cut)])
        tier = [g for g in others if load[g] == cut]
        gpus = preferred_gpus(topo, [*fixed, *tier], fixed, len(picked) + new)
        for g in gpus:
            if g not in picked:
                take(offered, picked, g, 1)
        still -= new
    if still:
        for g, count in _fill(offered, load, picked, still).items():
            take(offered, picked, g, count)


def _fill(offered: Mapping[int, list[str]], load: Mapping[int, int], picked: Mapping[int, list[str]],
          still: int) -> dict[int, int]:
    """How many more replicas each GPU gives when `still` replicas go one at a time to the GPU with the lowest
    load counting this request, lowest index first (a GPU leaves once its offered replicas are all taken).

    The one-at-a-time order takes the `still` smallest (level, GPU) pairs, a GPU holding the levels from its
    load up: so every GPU fills up to one common level, found by bisection, and the GPUs at that level get one
    more each, lowest index first, until `still` is used up. O(GPUs * log replicas), not O(still * log GPUs)."""
    start = {g: load[g] + len(picked.get(g, ())) for g in offered}
    room = {g: len(offered[g]) - len(picked.get(g, ())) for g in offered if len(picked.get(g, ())) < len(offered[g])}

    def below(level: int) -> int:
        """Replicas given with every GPU filled up to `level` (exclusive)."""
        return sum(min(max(level - start[g], 0), free) for g, free in room.items())

    low, high = min(start[g] for g in room), max(start[g] + free for g, free in room.items())
    while low < high:
        middle = (low + high + 1) // 2
        if below(middle) <= still:
            low = middle
        else:
            high = middle - 1
    extra = {g: min(max(low - start[g], 0), free) for g, free in room.items()}
    left = still - sum(extra.values())
    for g in sorted(room):
        if left == 0:
            break
        if start[g] <= low < start[g] + room[g]:
            extra[g] += 1
            left -= 1
    return {g: count for g, count in extra.items() if count}


def _pack(
    topo: Topology,
    offered: Mapping[int, list[str]],
    load: Mapping[int, int],
    picked: dict[int, list[str]],
    still: int,
) -> None:
    for g in sorted(picked, key=lambda g: (-load[g], g)):
        more = min(still, len(offered[g]) - len(picked[g]))
        take(offered, picked, g, more)
        still -= more
    while still:
        spare = {g: len(offered[g]) for g in offered if g not in picked}
        towards = {g: sum(topo.scores[g][u] for u in picked) for g in spare}
        fits = [g for g in spare if spare[g] >= still]
        if fits:
            take(offered, picked, max(fits, key=lambda g: (load[g], towards[g], -g)), still)
            return
        g = max(spare, key=lambda g: (spare[g], load[g], towards[g], -g))
        take(offered, picked, g, spare[g])
        still -= spare[g]
