"""Glue between the device plugin and the allocator: device IDs in, the topology-optimal device IDs out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.inventory import Device
from agent.nvml.backend import NodeInventory
from agent.state import NodeState
from agent.topology.allocator import preferred_gpus
from agent.topology.model import Topology


def topology_of(inventory: NodeInventory) -> Topology:
    return Topology.build(
        numa=[g.numa_node for g in inventory.gpus],
        pcie={(link.a, link.b): link.pcie for link in inventory.links},
        nvlink={(link.a, link.b): link.nvlink for link in inventory.links if link.nvlink},
    )


def gpu_preference(
    current: Callable[[], NodeState],
) -> Callable[[tuple[Device, ...], Sequence[str], Sequence[str], int], list[str]]:
    """A Prefer function for whole-GPU resources; the topology is rebuilt only when the inventory changes."""
    cache: dict[int, tuple[NodeInventory, Topology]] = {}

    def prefer(devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        inventory = current().inventory
        cached = cache.get(id(inventory))
        if cached is None or cached[0] is not inventory:
            cache.clear()
            cached = cache[id(inventory)] = (inventory, topology_of(inventory))
        index = {d.id: d.gpu_index for d in devices}
        by_index = {d.gpu_index: d.id for d in devices}
        chosen = preferred_gpus(cached[1], [index[i] for i in available], [index[i] for i in must], size)
        return [by_index[i] for i in chosen]

    return prefer
