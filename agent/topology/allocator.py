"""Preferred allocation: the best-connected set of GPUs, time-sliced replicas or MIG devices for a request.

`preferred_gpus` answers the kubelet's GetPreferredAllocation for whole GPUs with the true optimum of

    1. value: the sum of the pair scores of the set (highest),
    2. NUMA span: the number of NUMA nodes the set touches (fewest; GPUs without a node count as one node),
    3. remainder: the best value a request of the same size could still get from the candidates left over
       (highest; all equal, and skipped, when fewer than `size` would be left),
    4. the lexicographically smallest sorted index tuple,

compared in that order. Up to `EXACT_LIMIT` candidates this is an exact branch and bound; above it a
bounded greedy search (see `docs/allocation.md`).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Literal, NoReturn, TypeVar

from agent.topology.model import Topology

EXACT_LIMIT = 16
"""Largest candidate count that gets the exact search; larger requests use the greedy fallback."""

FALLBACK_SEEDS = 16
"""Greedy starts tried by the fallback (the most promising candidates)."""

FALLBACK_POLISHED = 4
"""Best greedy results the fallback improves with pair swaps."""

SharingPolicy = Literal["distributed", "packed"]

_Id = TypeVar("_Id", bound=Hashable)


class AllocationError(ValueError):
    """A preferred-allocation request that cannot be answered as asked."""


# ----------------------------------------------------------------------------------------------------------
# Whole GPUs


def preferred_gpus(
    topo: Topology, available: Sequence[int], must_include: Sequence[int], size: int
) -> list[int]:
    """The best set of `size` GPUs that contains `must_include`, sorted.

    Candidates are `available` plus `must_include` (a must-include GPU is a candidate even when the caller
    left it out of `available`). Raises `AllocationError` for a size below 1 or above the candidate count,
    more must-include GPUs than `size`, and unknown or repeated indices.
    """
    offered, must = _request(
        available, must_include, size, lambda g: _is_index(g) and g < topo.gpu_count, "GPU index"
    )
    candidates, required = sorted(offered), sorted(must)
    if size == len(candidates):
        return candidates
    if size == len(required):
        return required
    if len(candidates) <= EXACT_LIMIT:
        return _ExactSearch(topo, candidates, required, size).best()
    return _fallback(topo, candidates, required, size)


class _ExactSearch:
    """Branch and bound over classes of interchangeable GPUs.

    Free candidates (not required) are grouped by `Topology.interchangeable` and NUMA node. Swapping two
    members of a class changes no part of the ordering except the index tuple, and taking the lowest-indexed
    members of each class gives the smallest tuple, so a choice is a count per class. The search decides
    classes one after another, larger counts first, with the bound below; the remainder term is computed
    only for the sets that tie on value and NUMA span.

    Bound (kept doubled to stay in integers): with `val` the value so far, `gain[c]` the score of one member
    of class c towards everything chosen so far, and r picks still to make from classes p.., each new member
    x adds gain[x] plus its scores to the other r-1 new members. Counting each new pair half from each side,
    2 * value <= 2 * val + (sum of the r largest of 2 * gain[x] + top(x, r - 1)), where top(x, t) is the sum
    of the t largest scores from x to the still undecided candidates, precomputed per depth.
    """

    def __init__(self, topo: Topology, candidates: list[int], required: list[int], size: int) -> None:
        scores = topo.scores
        taken = set(required)
        # A GPU that is the only candidate of its NUMA node adds one node to the span whichever node that
        # is, so such GPUs are interchangeable across nodes; all others only within their node.
        per_node = Counter(topo.numa[g] for g in candidates)
        by_class: dict[tuple[int, bool, int | None], list[int]] = {}
        for gpu in candidates:
            if gpu not in taken:
                node = topo.numa[gpu]
                alone = per_node[node] == 1
                key = (topo.interchangeable[gpu], alone, None if alone else node)
                by_class.setdefault(key, []).append(gpu)
        numa_bit: dict[int | None, int] = {}
        for gpu in candidates:
            numa_bit.setdefault(topo.numa[gpu], 1 << len(numa_bit))

        groups = list(by_class.values())
        gain = [sum(scores[m[0]][r] for r in required) for m in groups]
        # Decide the most promising classes first so that a good incumbent is found early.
        groups, gain = _promising_first(scores, groups, gain, size - len(required))

        self.size = size
        self.required = required
        self.groups = groups
        self.counts = [len(m) for m in groups]
        self.gain = gain
        self.alone = [int(per_node[topo.numa[m[0]]] == 1) for m in groups]
        self.numa = [
            0 if lone else numa_bit[topo.numa[m[0]]] for m, lone in zip(groups, self.alone, strict=True)
        ]
        self.required_numa = 0
        for gpu in required:
            self.required_numa |= numa_bit[topo.numa[gpu]]
        self.base = topo.value(required)
        self.spare = len(candidates) - size
        k = len(groups)
        self.weight = [
            [
                (scores[groups[c][0]][groups[c][1]] if len(groups[c]) > 1 else 0)
                if c == d
                else scores[groups[c][0]][groups[d][0]]
                for d in range(k)
            ]
            for c in range(k)
        ]
        self.top = _suffix_tops(self.weight, self.counts, size - 1)

    def best(self) -> list[int]:
        value, ties = self._best_value_and_span()
        chosen = sorted((self._members(picks), picks) for picks in ties)
        if self.spare < self.size or len(chosen) == 1:
            return list(chosen[0][0])
        # No remainder can beat the best `size` GPUs among all free candidates; once one reaches that, the
        # lexicographic order decides among the rest.
        ceiling = value if not self.required else self.best_value(self.counts, self.size, -1)
        best_tuple: tuple[int, ...] = ()
        best_left = -1
        for members, picks in chosen:
            if best_left >= ceiling:
                break
            left = self.best_value(
                [n - t for n, t in zip(self.counts, picks, strict=True)], self.size, best_left
            )
            if left > best_left:
                best_tuple, best_left = members, left
        return list(best_tuple)

    def _members(self, picks: tuple[int, ...]) -> tuple[int, ...]:
        out = list(self.required)
        for members, t in zip(self.groups, picks, strict=True):
            out.extend(members[:t])
        return tuple(sorted(out))

    def _bound(self, p: int, r: int, gain: list[int], counts: list[int]) -> int:
        """Doubled upper bound on what r more picks from classes p.. can add (see the class docstring)."""
        tops = self.top[p]
        r1 = r - 1
        ranked = sorted(
            ((2 * gain[c] + tops[c][r1], counts[c]) for c in range(p, len(counts)) if counts[c]), reverse=True
        )
        total = 0
        for h, n in ranked:
            if n >= r:
                return total + h * r
            total += h * n
            r -= n
        return total

    def _best_value_and_span(self) -> tuple[int, list[tuple[int, ...]]]:
        """The highest value, and every choice of counts with it and, among those, the smallest NUMA span."""
        counts, weight, numa, alone = self.counts, self.weight, self.numa, self.alone
        k = len(counts)
        room = _suffix_sums(counts)
        picks = [0] * k
        best_val = -1
        best_span = k + 64
        ties: list[tuple[int, ...]] = []

        def search(p: int, r: int, val: int, gain: list[int], span_mask: int, lone: int) -> None:
            """`span_mask`: NUMA nodes of several candidates now in use; `lone`: one-GPU nodes in use."""
            nonlocal best_val, best_span, ties
            if r == 0:
                span = span_mask.bit_count() + lone
                if val > best_val or (val == best_val and span < best_span):
                    best_val, best_span, ties = val, span, [tuple(picks)]
                elif val == best_val and span == best_span:
                    ties.append(tuple(picks))
                return
            bound = 2 * val + self._bound(p, r, gain, counts)
            if bound < 2 * best_val or (bound == 2 * best_val and span_mask.bit_count() + lone > best_span):
                return
            row = weight[p]
            after = room[p + 1]
            for t in range(min(counts[p], r), -1, -1):
                if after < r - t:
                    break
                picks[p] = t
                if t:
                    grown = gain[:]
                    for d in range(p + 1, k):
                        grown[d] += t * row[d]
                    search(
                        p + 1,
                        r - t,
                        val + t * gain[p] + t * (t - 1) // 2 * row[p],
                        grown,
                        span_mask | numa[p],
                        lone + t * alone[p],
                    )
                else:
                    search(p + 1, r, val, gain, span_mask, lone)
            picks[p] = 0

        search(0, self.size - len(self.required), self.base, self.gain, self.required_numa, 0)
        return best_val, ties

    def best_value(self, counts: list[int], size: int, floor: int) -> int:
        """Highest value of `size` GPUs drawn from `counts` members per class, or `floor` if none beats it."""
        weight = self.weight
        k = len(counts)
        room = _suffix_sums(counts)
        best = floor

        def search(p: int, r: int, val: int, gain: list[int]) -> None:
            nonlocal best
            if r == 0:
                best = max(best, val)
                return
            if 2 * val + self._bound(p, r, gain, counts) <= 2 * best:
                return
            row = weight[p]
            after = room[p + 1]
            for t in range(min(counts[p], r), -1, -1):
                if after < r - t:
                    break
                if t:
                    grown = gain[:]
                    for d in range(p + 1, k):
                        grown[d] += t * row[d]
                    search(p + 1, r - t, val + t * gain[p] + t * (t - 1) // 2 * row[p], grown)
                else:
                    search(p + 1, r, val, gain)

        search(0, size, 0, [0] * k)
        return best


def _promising_first(
    scores: Sequence[Sequence[int]], groups: list[list[int]], gain: list[int], picks: int
) -> tuple[list[list[int]], list[int]]:
    """Order classes by what one member could add at best: its gain plus its best `picks - 1` partners."""
    k = len(groups)
    potential = []
    for c in range(k):
        head = groups[c][0]
        partners = sorted((scores[head][m] for d in range(k) for m in groups[d] if m != head), reverse=True)
        potential.append(2 * gain[c] + sum(partners[: max(picks - 1, 0)]))
    order = sorted(range(k), key=lambda c: (-potential[c], groups[c][0]))
    return [groups[c] for c in order], [gain[c] for c in order]


def _suffix_tops(weight: list[list[int]], counts: list[int], depth: int) -> list[list[list[int]]]:
    """tops[p][c][t]: the sum of the t largest scores from one member of class c to the other members of
    classes p.. (c >= p), for t = 0..depth; shorter multisets are padded with their full sum."""
    k = len(counts)
    ranked = [sorted(range(k), key=row.__getitem__, reverse=True) for row in weight]
    tops: list[list[list[int]]] = []
    for p in range(k):
        level: list[list[int]] = [[] for _ in range(p)]
        for c in range(p, k):
            row = weight[c]
            sums = [0]
            total = 0
            left = depth
            for d in ranked[c]:
                if d < p:
                    continue
                times = min(counts[d] - 1 if d == c else counts[d], left)
                w = row[d]
                for _ in range(times):
                    total += w
                    sums.append(total)
                left -= times
                if not left:
                    break
            sums.extend([total] * (depth + 1 - len(sums)))
            level.append(sums)
        tops.append(level)
    return tops


def _suffix_sums(counts: Sequence[int]) -> list[int]:
    out = [0] * (len(counts) + 1)
    for i in range(len(counts) - 1, -1, -1):
        out[i] = out[i + 1] + counts[i]
    return out


def _fallback(topo: Topology, candidates: list[int], required: list[int], size: int) -> list[int]:
    """Bounded search for large nodes: greedy growth from the most promising seeds (and from the required
    GPUs alone), then pair swaps.

    Orders by value, NUMA span and index tuple (the remainder term is not evaluated). Work is
    O(FALLBACK_SEEDS * size * n) for the greedy part plus, on each of the FALLBACK_POLISHED best sets, at
    most `size` passes over the size * n possible swaps, so the answer is deterministic and its cost bounded.
    """
    scores = topo.scores
    numa = topo.numa
    taken = set(required)
    free = [g for g in candidates if g not in taken]
    partners = size - len(required) - 1

    def promise(g: int) -> tuple[int, int]:
        """What g could add at best: twice its score to the required GPUs plus its best free partners."""
        best_free = sorted((scores[g][x] for x in free if x != g), reverse=True)[:partners]
        return (-(2 * sum(scores[g][r] for r in required) + sum(best_free)), g)

    seeds = sorted(free, key=promise)

    def key(members: Iterable[int]) -> tuple[int, int, tuple[int, ...]]:
        ordered = tuple(sorted(members))
        return (-topo.value(ordered), topo.numa_span(ordered), ordered)

    def grow(start: list[int]) -> list[int]:
        chosen = list(start)
        spans = {numa[g] for g in chosen}
        gain = {g: sum(scores[g][c] for c in chosen) for g in free if g not in chosen}
        while len(chosen) < size:
            pick = max(gain, key=lambda g: (gain[g], numa[g] in spans, -g))
            del gain[pick]
            chosen.append(pick)
            spans.add(numa[pick])
            for g in gain:
                gain[g] += scores[g][pick]
        return chosen

    grown = [grow([*required, seed]) for seed in seeds[:FALLBACK_SEEDS]]
    if required:
        grown.append(grow(required))
    grown.sort(key=key)
    results = [_swap_improve(topo, members, taken, free, size) for members in grown[:FALLBACK_POLISHED]]
    return list(min(key(members) for members in results)[2])


def _swap_improve(
    topo: Topology, members: list[int], fixed: set[int], free: list[int], passes: int
) -> list[int]:
    """Swap a chosen GPU for an unchosen one while that raises the value, or at equal value cuts the span."""
    scores = topo.scores
    chosen = set(members)
    for _ in range(passes):
        gain = {g: sum(scores[g][c] for c in chosen) for g in free}
        span = topo.numa_span(chosen)
        best: tuple[int, int, int, int] | None = None
        for out in sorted(chosen - fixed):
            for into in free:
                if into in chosen:
                    continue
                delta = gain[into] - scores[into][out] - gain[out]
                if delta < 0 or (best is not None and delta < best[0]):
                    continue
                new_span = topo.numa_span((chosen - {out}) | {into})
                if delta == 0 and new_span >= span:
                    continue
                if best is None or (delta, -new_span) > (best[0], best[1]):
                    best = (delta, -new_span, out, into)
        if best is None:
            break
        chosen.remove(best[2])
        chosen.add(best[3])
    return sorted(chosen)


# ----------------------------------------------------------------------------------------------------------
# Time-sliced replicas


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
        if not _is_index(gpu) or gpu >= gpu_count:
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
    offered_ids, required = _request(available, must_include, size, replicas.__contains__, "replica id")
    required.sort(key=rank)
    offered = _by_gpu(offered_ids, replicas.__getitem__, rank)
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


def _take(offered: Mapping[int, list[str]], picked: dict[int, list[str]], gpu: int, count: int) -> None:
    have = picked.setdefault(gpu, [])
    taken = set(have)
    for rid in offered[gpu]:
        if count <= 0:
            break
        if rid not in taken:
            have.append(rid)
            count -= 1


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
                _take(offered, picked, g, 1)
        still -= new
    if still:
        for g, count in _fill(offered, load, picked, still).items():
            _take(offered, picked, g, count)


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
        _take(offered, picked, g, more)
        still -= more
    while still:
        spare = {g: len(offered[g]) for g in offered if g not in picked}
        towards = {g: sum(topo.scores[g][u] for u in picked) for g in spare}
        fits = [g for g in spare if spare[g] >= still]
        if fits:
            _take(offered, picked, max(fits, key=lambda g: (load[g], towards[g], -g)), still)
            return
        g = max(spare, key=lambda g: (spare[g], load[g], towards[g], -g))
        _take(offered, picked, g, spare[g])
        still -= spare[g]


# ----------------------------------------------------------------------------------------------------------
# MIG devices


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
        if not _is_index(gpu):
            raise AllocationError(
                f"MIG device {did!r}: parent GPU index {gpu!r} is not a non-negative integer"
            )
        if node_of.setdefault(gpu, node) != node:
            raise AllocationError(f"MIG device {did!r}: GPU {gpu} is given two NUMA nodes")
    offered_ids, required = _request(available, must_include, size, lambda d: d in devices, "MIG device id")
    required.sort(key=replica_order)
    offered = _by_gpu(offered_ids, lambda d: devices[d][0])
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
        _take(offered, picked, g, more)
        still -= more
    for g, count in best[2]:
        _take(offered, picked, g, count)
    return sorted((did for ids in picked.values() for did in ids), key=replica_order)


def _numa_order(node: int | None) -> tuple[int, bool, int]:
    return (0, node is None, node if node is not None else 0)


# ----------------------------------------------------------------------------------------------------------
# Shared helpers


@functools.lru_cache(maxsize=16384)
def replica_order(device_id: str) -> tuple[tuple[int, str, int], ...]:
    """Natural sort key for device ids: digit runs compare as numbers ("gpu::2" before "gpu::10")."""
    return tuple(
        (1, "", int(part)) if part.isdigit() else (0, part, 0)
        for part in re.split(r"(\d+)", device_id)
        if part
    )


def _by_gpu(ids: Iterable[str], gpu_of: Callable[[str], int],
            order: Callable[[str], Any] = replica_order) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for did in sorted(ids, key=order):
        out.setdefault(gpu_of(did), []).append(did)
    return out


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _request(
    available: Sequence[_Id], must_include: Sequence[_Id], size: int, known: Callable[[_Id], bool], what: str
) -> tuple[set[_Id], list[_Id]]:
    """Validate a request; return (candidates, required). Candidates include `must_include`."""
    if not _is_index(size) or size < 1:
        raise AllocationError(f"size must be a positive integer, got {size!r}")
    offered, required = set(available), set(must_include)
    if len(offered) < len(available) or len(required) < len(must_include) or not all(map(known, offered | required)):
        _refuse(available, must_include, known, what)
    if len(must_include) > size:
        raise AllocationError(
            f"must_include has {len(must_include)} entries, more than the requested size {size}"
        )
    candidates = offered | required
    if size > len(candidates):
        raise AllocationError(f"size {size} is more than the {len(candidates)} candidates offered")
    return candidates, list(must_include)


def _refuse(available: Sequence[_Id], must_include: Sequence[_Id], known: Callable[[_Id], bool], what: str) -> NoReturn:
    """The AllocationError for the first unknown or repeated id, in the request's order."""
    for name, ids in (("available", available), ("must_include", must_include)):
        seen: set[_Id] = set()
        for item in ids:
            if not known(item):
                raise AllocationError(f"{name}: unknown {what} {item!r}")
            if item in seen:
                raise AllocationError(f"{name}: {what} {item!r} is listed twice")
            seen.add(item)
    raise AssertionError("an unknown or repeated id was found, and then not")
