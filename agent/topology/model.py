"""The GPU interconnect of one node: per-pair NVLink and PCIe links, NUMA nodes and the pair score."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, TypedDict, TypeVar, cast, get_args

_V = TypeVar("_V")

PcieLevel = Literal["single", "multiple", "hostbridge", "node", "system"]
"""Closest common PCIe ancestor of two GPUs, named as NVML's nvmlDeviceGetTopologyCommonAncestor does
(NVML_TOPOLOGY_SINGLE ... NVML_TOPOLOGY_SYSTEM), nearest first."""

PCIE_LEVELS: tuple[PcieLevel, ...] = get_args(PcieLevel)

PCIE_SCORE: Mapping[PcieLevel, int] = {
    "single": 60,
    "multiple": 50,
    "hostbridge": 40,
    "node": 30,
    "system": 10,
}
"""Score of a pair without NVLink, by the closest PCIe ancestor the two GPUs share."""

NVLINK_SCORE_PER_LINK = 100
"""Score of a pair per NVLink between them; any NVLink outranks every PCIe path (max 60)."""


def pair_score(nvlink: int, pcie: PcieLevel) -> int:
    """The score of one GPU pair: `100 * nvlink` when the pair has NVLink, else the PCIe level's score.

    The PCIe path is ignored when NVLink exists because peer traffic then takes the links, not PCIe.
    """
    if nvlink > 0:
        return NVLINK_SCORE_PER_LINK * nvlink
    return PCIE_SCORE[pcie]


class PairScore(TypedDict):
    """One GPU pair as `Topology.pair_scores` reports it (JSON-ready)."""

    gpus: list[int]
    score: int
    nvlink: int
    pcie: PcieLevel


class TopologyError(ValueError):
    """A topology description that is inconsistent (shape, asymmetry, unknown level, bad index)."""


@dataclass(frozen=True)
class Topology:
    """Links between the GPUs of one node, GPUs indexed 0..n-1.

    `nvlink` and `pcie` are symmetric n x n matrices; their diagonals hold 0 and None (a GPU has no link to
    itself). `scores` is derived: the pair score of every pair, 0 on the diagonal. Build one with `build`.
    """

    numa: tuple[int | None, ...]
    nvlink: tuple[tuple[int, ...], ...]
    pcie: tuple[tuple[PcieLevel | None, ...], ...]
    scores: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.numa)
        for node in self.numa:
            if node is not None and (not _is_int(node) or node < 0):
                raise TopologyError(f"NUMA node must be a non-negative integer or None, got {node!r}")
        if len(self.nvlink) != n or any(len(row) != n for row in self.nvlink):
            raise TopologyError(f"nvlink must be a {n}x{n} matrix")
        if len(self.pcie) != n or any(len(row) != n for row in self.pcie):
            raise TopologyError(f"pcie must be a {n}x{n} matrix")
        for a in range(n):
            if self.nvlink[a][a] != 0 or self.pcie[a][a] is not None:
                raise TopologyError(f"GPU {a}: the diagonal must be nvlink 0 and pcie None")
            for b in range(a + 1, n):
                links, level = self.nvlink[a][b], self.pcie[a][b]
                if not _is_int(links) or links < 0:
                    raise TopologyError(f"GPUs {a},{b}: NVLink count must be a non-negative integer")
                if links != self.nvlink[b][a] or level != self.pcie[b][a]:
                    raise TopologyError(f"GPUs {a},{b}: link data differs between ({a},{b}) and ({b},{a})")
                if level not in PCIE_SCORE:
                    raise TopologyError(f"GPUs {a},{b}: unknown PCIe level {level!r}")
        scores = tuple(
            tuple(
                0 if a == b else pair_score(self.nvlink[a][b], cast(PcieLevel, self.pcie[a][b]))
                for b in range(n)
            )
            for a in range(n)
        )
        object.__setattr__(self, "scores", scores)

    @classmethod
    def build(
        cls,
        numa: Sequence[int | None],
        pcie: Mapping[tuple[int, int], str],
        nvlink: Mapping[tuple[int, int], int],
    ) -> Topology:
        """Build from per-pair maps; a pair may be keyed (i, j) or (j, i), but not both with different values.

        A pair missing from `pcie` is "node" when both GPUs report the same NUMA node, else "system"; a pair
        missing from `nvlink` has no NVLink.
        """
        n = len(numa)
        level: list[list[PcieLevel | None]] = [[None] * n for _ in range(n)]
        links = [[0] * n for _ in range(n)]
        given_level = _symmetric(pcie, n, "pcie")
        given_links = _symmetric(nvlink, n, "nvlink")
        for a in range(n):
            for b in range(a + 1, n):
                raw = given_level.get((a, b))
                if raw is None:
                    same_node = numa[a] is not None and numa[a] == numa[b]
                    chosen: PcieLevel = "node" if same_node else "system"
                elif raw in PCIE_SCORE:
                    chosen = cast(PcieLevel, raw)
                else:
                    raise TopologyError(f"GPUs {a},{b}: unknown PCIe level {raw!r}; use one of {PCIE_LEVELS}")
                level[a][b] = level[b][a] = chosen
                links[a][b] = links[b][a] = given_links.get((a, b), 0)
        return cls(
            numa=tuple(numa),
            nvlink=tuple(tuple(row) for row in links),
            pcie=tuple(tuple(row) for row in level),
        )

    @property
    def gpu_count(self) -> int:
        return len(self.numa)

    def score(self, a: int, b: int) -> int:
        """Pair score of GPUs `a` and `b` (0 when a == b)."""
        return self.scores[a][b]

    def value(self, gpus: Iterable[int]) -> int:
        """Value of a set of GPUs: the sum of its pair scores."""
        members = sorted(set(gpus))
        return sum(self.scores[a][b] for i, a in enumerate(members) for b in members[i + 1 :])

    def numa_span(self, gpus: Iterable[int]) -> int:
        """Number of NUMA nodes a set of GPUs spans; GPUs without a NUMA node together count as one node."""
        return len({self.numa[g] for g in gpus})

    def pair_scores(self) -> list[PairScore]:
        """Every pair (i < j) with its score and the links behind it, ready for JSON."""
        n = self.gpu_count
        return [
            PairScore(
                gpus=[a, b],
                score=self.scores[a][b],
                nvlink=self.nvlink[a][b],
                pcie=cast(PcieLevel, self.pcie[a][b]),
            )
            for a in range(n)
            for b in range(a + 1, n)
        ]

    @cached_property
    def interchangeable(self) -> tuple[int, ...]:
        """For each GPU, the lowest index of its class of interchangeable GPUs.

        GPUs a and b are interchangeable when they score the same against every other GPU: swapping them
        changes the value of no set, which lets the allocator search counts per class instead of members (an
        NVSwitch box is one class). The relation is an equivalence (the pair scores inside one class are all
        equal), so comparing against one member per class is enough. NUMA nodes are not considered here; the
        allocator splits classes by node itself.
        """
        n = self.gpu_count
        rows = self.scores
        classes: list[int] = []
        heads: list[int] = []
        for a in range(n):
            for head in heads:
                if all(rows[a][x] == rows[head][x] for x in range(n) if x != a and x != head):
                    classes.append(head)
                    break
            else:
                heads.append(a)
                classes.append(a)
        return tuple(classes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _symmetric(pairs: Mapping[tuple[int, int], _V], n: int, name: str) -> dict[tuple[int, int], _V]:
    """Normalise pair keys to (low, high), rejecting self pairs, bad indices and conflicting duplicates."""
    out: dict[tuple[int, int], _V] = {}
    for (a, b), value in pairs.items():
        if not (_is_int(a) and _is_int(b) and 0 <= a < n and 0 <= b < n) or a == b:
            raise TopologyError(f"{name}: pair ({a}, {b}) is not a pair of distinct GPUs in 0..{n - 1}")
        key = (min(a, b), max(a, b))
        if key in out and out[key] != value:
            raise TopologyError(f"{name}: pair {key} given twice with different values")
        out[key] = value
    return out
