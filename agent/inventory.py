"""Pure: NodeState + config -> the devices each resource advertises."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.config import AgentConfig
from agent.state import NodeState

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Device:
    """One schedulable unit as the kubelet sees it."""

    id: str
    healthy: bool
    numa: int | None
    gpu_index: int
    gpu_uuid: str
    visible: str
    """What the container runtime is given for this device: the GPU UUID or index, per deviceIDStrategy."""
    reason: str = ""


Resources = Mapping[str, tuple[Device, ...]]


def resources(state: NodeState, config: AgentConfig) -> dict[str, tuple[Device, ...]]:
    """The devices of every resource the node advertises, in GPU index order.

    Draining GPUs (a MIG change in progress) are withdrawn entirely.
    """
    by_index = config.flags.plugin.device_id_strategy == "index"
    gpus = []
    for gpu in state.inventory.gpus:
        if gpu.uuid in state.draining:
            continue
        health = state.gpu_health(gpu.uuid)
        gpus.append(
            Device(
                id=gpu.uuid,
                healthy=health.healthy,
                numa=gpu.numa_node,
                gpu_index=gpu.index,
                gpu_uuid=gpu.uuid,
                visible=str(gpu.index) if by_index else gpu.uuid,
                reason=health.reason,
            )
        )
    return {GPU_RESOURCE: tuple(gpus)}
