"""Glue between the device plugin and the allocator: device IDs in, the preferred device IDs out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.inventory import Device, Resource
from agent.nvml.records import NodeInventory
from agent.state import NodeState
from agent.topology.allocator import preferred_gpus, preferred_mig, preferred_shared
from agent.topology.model import Topology

Prefer = Callable[[tuple[Device, ...], Sequence[str], Sequence[str], int], list[str]]


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
        index = {d.id: d.gpu_index for d in devices}
        by_index = {d.gpu_index: d.id for d in devices}
        chosen = preferred_gpus(self.topology(), [index[i] for i in available], [index[i] for i in must], size)
        return [by_index[i] for i in chosen]

    def _shared(
        self, devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int
    ) -> list[str]:
        policy = self._current().config.allocation_policy
        replicas = {d.id: d.gpu_index for d in devices}
        return preferred_shared(self.topology(), replicas, available, must, size, policy)

    def _packed(
        self, devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int
    ) -> list[str]:
        replicas = {d.id: d.gpu_index for d in devices}
        return preferred_shared(self.topology(), replicas, available, must, size, "packed")

    @staticmethod
    def _mig(devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        return preferred_mig({d.id: (d.gpu_index, d.numa) for d in devices}, available, must, size)
