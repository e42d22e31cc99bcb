"""Preferred allocation of whole GPUs: the search for the best-connected set of GPUs for a request. The
replicas of shared GPUs (replicas.py) and MIG devices (mig_devices.py) are chosen elsewhere; replicas use this
search to pick the GPUs they spread over.

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

from collections import Counter
from collections.abc import Iterable, Sequence

from agent.topology.model import Topology
from agent.topology.request import check_request, is_index

EXACT_LIMIT = 16
"""Largest candidate count that gets the exact search; larger requests use the greedy fallback."""

FALLBACK_SEEDS = 16
"""Greedy starts tried by the fallback (the most promising candidates)."""

FALLBACK_POLISHED = 4
"""Best greedy results the fallback improves with pair swaps."""



def preferred_gpus(
    topo: Topology, available: Sequence[int], must_include: Sequence[int], size: int
) -> list[int]:
    """The best set of `size` GPUs that contains `must_include`, sorted.

    Candidates are `available` plus `must_include` (a must-include GPU is a candidate even when the caller
    left it out of `available`). Raises `AllocationError` for a size below 1 or above the candidate count,
    more must-include GPUs than `size`, and unknown or repeated indices.
    """
    offered, must = check_request(
        available, must_include, size, lambda g: is_index(g) and g < topo.gpu_count, "GPU index"
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
