"""How fragmented the node's free capacity is: the free whole GPUs, the largest set of them an NVLink-connected job
could take, the largest on one NUMA node, and how many more instances of each MIG profile the MIG GPUs could take
beside the ones they have. Only the node knows its links and placements, so /metrics exports these figures
(agent/metrics.py) and the shipped rules turn "GPUs free, but no k-GPU job fits" into an alert (docs/operations.md,
"Free GPUs that no large job can use").

A whole GPU is free when the node offers it (agent/dra/slices.py `published_gpus`, the same in either mode:
healthy, not in MIG mode, not draining for a MIG change, not cordoned by an operator, not waiting for its MPS
daemon, not held through the mode the node left and not while that is being read) and no pod holds it, nor one of
its replicas (`held`: the GPU and MIG device UUIDs pods hold, as the caller knows them).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from agent.dra.slices import held_gpus, published_gpus
from agent.mig.planner import MigInstance, ProfileTable, Unplaceable, gpu_instances, place
from agent.nvml.catalog import MODELS
from agent.nvml.records import GpuInfo
from agent.state import NodeState
from agent.topology.model import Topology


@dataclass(frozen=True)
class Fragmentation:
    """The figures of one node at one moment."""

    free: tuple[int, ...]
    """Indices of the free whole GPUs."""
    largest_nvlink_set: int
    """The most free GPUs all joined pairwise by NVLink (every pair on an NVSwitch node); 1 for a free GPU
    without NVLink, 0 when none is free."""
    largest_numa_set: int
    """The most free GPUs on one NUMA node (GPUs without a NUMA node together count as one node)."""
    node_nvlink_set: int
    """The most of the node's GPUs, free or not, all joined pairwise by NVLink: what an NVLink-connected job can
    have here at best, with every pod gone and MIG off."""
    mig_placeable: Mapping[str, int] = field(default_factory=dict)
    """By MIG profile name: how many more instances of that profile alone the node's MIG GPUs could take now,
    beside the instances they have, summed over the GPUs; every profile of each MIG GPU's model is listed."""


def free_gpus(state: NodeState, held: Collection[str]) -> tuple[int, ...]:
    """The indices of the free whole GPUs (the module docstring says what free means), in order."""
    return tuple(g.index for g in published_gpus(state) if g.uuid not in held)


def nvlink_adjacency(topo: Topology) -> tuple[int, ...]:
    """For each GPU, the bitmask of the GPUs it has NVLink to."""
    n = topo.gpu_count
    return tuple(sum(1 << b for b in range(n) if topo.nvlink[a][b] > 0) for a in range(n))


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def largest_clique(adjacency: Sequence[int], candidates: int) -> int:
    """The size of the largest set of the GPUs in `candidates` (a bitmask) all joined pairwise in `adjacency`.

    Exact, over bitmasks: Bron and Kerbosch's search with Tomita's pivot (a largest set holds the pivot or one of
    the candidates it is not joined to, so only those are branched on) and a bound (a branch whose size plus its
    candidates cannot beat the best is dropped). Every call extends a different set of pairwise joined GPUs, so a
    node of n GPUs costs at most 2^n calls whatever its links: 65,536 on the largest node (16 GPUs). The pivot
    keeps it far below that: an NVSwitch node is one chain of n + 1 calls, NVLink pairs one call a GPU, and the
    graph of 16 with the most maximal cliques (five groups of three, each GPU joined to every GPU outside its
    group, and one GPU joined to all) under 300.
    """
    best = 0

    def grow(size: int, left: int) -> None:
        nonlocal best
        if not left:
            best = max(best, size)
            return
        if size + left.bit_count() <= best:
            return
        pivot = max(_bits(left), key=lambda v: (left & adjacency[v]).bit_count())
        for v in _bits(left & ~adjacency[pivot]):
            grow(size + 1, left & adjacency[v])
            left &= ~(1 << v)
            if size + left.bit_count() <= best:
                return

    grow(0, candidates)
    return best


def largest_numa_set(topo: Topology, gpus: Collection[int]) -> int:
    """The most of `gpus` on one NUMA node; GPUs without a node together count as one node."""
    return max(Counter(topo.numa[g] for g in gpus).values(), default=0)


def profile_table(gpu: GpuInfo) -> ProfileTable | None:
    """The MIG profile table of a GPU's model from the catalog (by its NVML name); None for a model the catalog
    does not know or that has no MIG."""
    model = next((m for m in MODELS.values() if m.nvml_name == gpu.name), None)
    return ProfileTable.of(model) if model is not None and model.mig_profiles else None


@functools.lru_cache(maxsize=256)
def placeable(table: ProfileTable, instances: tuple[MigInstance, ...]) -> tuple[tuple[str, int], ...]:
    """For each profile of `table`: how many more instances of it alone a GPU with `instances` could take, none
    of those moved (pods may use them). The MIG manager's own placement search decides (`planner.place`, which
    keeps as many of the instances it is given as it can): n more fit when it places them beside every instance
    there is. Instances the table cannot place leave no room for any. Cached: a GPU's layout changes rarely and
    every scrape asks again."""
    have = set(instances)
    existing = Counter(i.profile for i in instances)
    room: list[tuple[str, int]] = []
    for profile in table.profiles:
        more = 0
        while more < profile.instance_count:
            wanted = dict(existing)
            wanted[profile.name] = wanted.get(profile.name, 0) + more + 1
            try:
                target = place(table, wanted, prefer=instances)
            except Unplaceable:
                break
            if not have <= set(target):
                break
            more += 1
        room.append((profile.name, more))
    return tuple(room)


def fragmentation(state: NodeState, held: Collection[str], topo: Topology) -> Fragmentation:
    """The node's figures, `held` being the GPU and MIG device UUIDs pods hold and `topo` the topology of
    `state.inventory` (agent/topology/prefer.py `topology_of`). MIG GPUs count when they are healthy, not
    draining and not held through the mode the node left."""
    free = free_gpus(state, held)
    adjacency = nvlink_adjacency(topo)
    mask = sum(1 << g for g in free)
    mig: Counter[str] = Counter()
    kept_out = held_gpus(state) | state.draining | state.cordoned
    for gpu in state.inventory.gpus:
        if not gpu.mig_enabled or gpu.uuid in kept_out or not state.gpu_health(gpu.uuid).healthy:
            continue
        table = profile_table(gpu)
        if table is None:
            continue
        instances = gpu_instances(state.inventory.mig_devices, gpu.index)
        for name, more in placeable(table, instances):
            mig[name] += more
    return Fragmentation(
        free=free,
        largest_nvlink_set=largest_clique(adjacency, mask),
        largest_numa_set=largest_numa_set(topo, free),
        node_nvlink_set=largest_clique(adjacency, (1 << topo.gpu_count) - 1),
        mig_placeable=dict(sorted(mig.items())),
    )
