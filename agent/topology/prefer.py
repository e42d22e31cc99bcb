"""Glue between the device plugin and the allocator: device IDs in, the preferred device IDs out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.inventory import Device, Resource
from agent.nvml.records import NodeInventory
from agent.state import NodeState
from agent.topology.gpus import preferred_gpus
from agent.topology.mig_devices import preferred_mig
from agent.topology.model import Topology
from agent.topology.replicas import ReplicaIndex, preferred_shared, replica_index

Prefer = Callable[[tuple[Device, ...], Sequence[str], Sequence[str], int], list[str]]
ANSWERS_KEPT = 4096
"""Whole-GPU answers kept per device set (a few hundred bytes each); the cache starts over when full."""


def topology_of(inventory: NodeInventory) -> Topology:
    return Topology.build(
        numa=[g.numa_node for g in inventory.gpus],
        pcie={(link.a, link.b): link.pcie for link in inventory.links},
        nvlink={(link.a, link.b): link.nvlink for link in inventory.links if link.nvlink},
    )


class Preferences:
    """Chooses the allocation policy per resource: the optimal GPU set for whole GPUs, the sharing policy
    for replicas, NUMA-compact instances for MIG devices. The topology is rebuilt only when devices change."""

    def __init__(self, current: Callable[[], NodeState]) -> None:
        self._current = current
        self._cached: tuple[NodeInventory, Topology] | None = None
        """(inventory, its topology) in one attribute: gRPC handler threads share it."""
        self._answers: tuple[tuple[Device, ...], Topology, dict[str, int], dict[int, str],
                             dict[tuple[frozenset[str], frozenset[str], int], list[str]]] | None = None
        """(devices, topology, id -> GPU index, GPU index -> id, answers by request) for whole GPUs: the best
        set is a pure function of the request, and the kubelet asks the same questions again and again."""
        self._replicas: tuple[tuple[Device, ...], Topology, dict[str, int], ReplicaIndex] | None = None
        """(devices, topology, replica id -> GPU index, its ReplicaIndex) of the last replica resource asked."""

    def topology(self) -> Topology:
        inventory = self._current().inventory
        cached = self._cached
        if cached is None or cached[0] is not inventory:
            cached = (inventory, topology_of(inventory))
            self._cached = cached
        return cached[1]

    def __call__(self, resource: Resource) -> Prefer:
        if resource.sharing == "mps":
            return self._packed  # one MPS client talks to one GPU's daemon: keep a request on one GPU
        if any(d.shared for d in resource.devices):
            return self._shared
        if any(d.kind == "mig" for d in resource.devices):
            return self._mig
        return self._gpus

    def _gpus(self, devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        topo = self.topology()
        cached = self._answers
        if cached is None or cached[0] is not devices or cached[1] is not topo:
            cached = (devices, topo, {d.id: d.gpu_index for d in devices}, {d.gpu_index: d.id for d in devices}, {})
            self._answers = cached
        _, _, index, by_index, answers = cached
        # The answer depends on the sets offered and required only; a request repeating an ID is left to
        # preferred_gpus, which refuses it.
        key = (frozenset(available), frozenset(must), size)
        if len(key[0]) == len(available) and len(key[1]) == len(must):
            chosen = answers.get(key)
            if chosen is None:
                chosen = [by_index[i] for i in preferred_gpus(topo, [index[i] for i in available],
                                                              [index[i] for i in must], size)]
                if len(answers) >= ANSWERS_KEPT:
                    answers.clear()
                answers[key] = chosen
            return list(chosen)
        return [by_index[i] for i in preferred_gpus(topo, [index[i] for i in available], [index[i] for i in must],
                                                    size)]

    def _replica_index(self, devices: tuple[Device, ...]) -> ReplicaIndex:
        """The replicas of `devices` indexed once per device tuple and topology (both immutable)."""
        topo = self.topology()
        cached = self._replicas
        if cached is None or cached[0] is not devices or cached[1] is not topo:
            replicas = {d.id: d.gpu_index for d in devices}
            cached = (devices, topo, replicas, replica_index(topo, replicas))
            self._replicas = cached
        return cached[3]

    def _shared(
        self, devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int
    ) -> list[str]:
        policy = self._current().config.allocation_policy
        index = self._replica_index(devices)
        return preferred_shared(index.topo, index.replicas, available, must, size, policy, index)

    def _packed(
        self, devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int
    ) -> list[str]:
        index = self._replica_index(devices)
        return preferred_shared(index.topo, index.replicas, available, must, size, "packed", index)

    @staticmethod
    def _mig(devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        return preferred_mig({d.id: (d.gpu_index, d.numa) for d in devices}, available, must, size)
