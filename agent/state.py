"""NodeState, the immutable versioned picture of the node, and the bus that publishes its versions."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, TypedDict

from agent.config import DEFAULT_CONFIG, AgentConfig
from agent.nvml.records import NodeInventory

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclass(frozen=True)
class DeviceHealth:
    healthy: bool = True
    reason: str = ""
    node_fatal: bool = False
    """The fault concerns the whole node (for example a GPU off the bus): the node is tainted."""


HEALTHY = DeviceHealth()


@dataclass(frozen=True)
class Incident:
    """A health change worth telling operators about; the node reconciler turns each into an Event."""

    seq: int
    gpu_uuid: str
    kind: str
    """"fault", "warning" or "recovered"."""
    message: str
    at: float = 0.0
    """When it happened (Unix time)."""


MAX_INCIDENTS = 64
MAX_INCIDENT_AGE_S = 3600.0
"""Incidents are kept until they are older than this or more than MAX_INCIDENTS came after them: enough for the
node reconciler to turn each into an Event across an API server outage of up to an hour, bounded in memory. The
reconciler says how many it never got to emit."""


@dataclass(frozen=True)
class MigStatus:
    """Where the requested MIG layout stands: pending, success, failed or rebooting, and why."""

    layout: str
    state: str
    reason: str = ""


class Changes(TypedDict, total=False):
    """The fields of NodeState that StateBus.record replaces besides the incidents it numbers (every field but
    `version` and `incidents`), each with its type: a misspelt field or a value of the wrong type fails the
    type check."""

    inventory: NodeInventory
    config: AgentConfig
    health: Mapping[str, DeviceHealth]
    draining: frozenset[str]
    held: frozenset[str]
    handover: bool
    mig_request: str | None
    mig_status: MigStatus | None
    config_request: str | None
    mps: Mapping[str, str]
    machine: str
    labelled_at: int
    cordon_request: str | None
    cordoned: frozenset[str]
    cordon_holders: Mapping[str, tuple[str, ...]]


class Evolution(Changes, total=False):
    """Every field of NodeState a new version may replace (NodeState.evolve, StateBus.update): Changes and the
    incidents."""

    incidents: tuple[Incident, ...]


@dataclass(frozen=True)
class NodeState:
    """One version of what the agent knows; consumers compare versions, never mutate."""

    version: int
    inventory: NodeInventory
    config: AgentConfig = DEFAULT_CONFIG
    """The config in force; a reload publishes a new state with the new config."""
    health: Mapping[str, DeviceHealth] = field(default_factory=lambda: MappingProxyType({}))
    """Health by GPU UUID; a GPU missing here is healthy. MIG devices and replicas inherit their GPU's."""
    draining: frozenset[str] = frozenset()
    """GPU UUIDs whose devices are withdrawn while their MIG layout changes."""
    held: frozenset[str] = frozenset()
    """GPU and MIG device UUIDs that pods hold through the mode the node left (agent/handover.py): in DRA mode
    the device plugin's allocations the kubelet still reports, in device-plugin mode the devices of the DRA
    claims still prepared. The mode in force offers none of them until they are released."""
    handover: bool = False
    """The mode just changed (or the agent started in DRA mode) and `held` is not read yet: neither mode offers
    whole GPUs until it is, so none can be handed out twice."""
    incidents: tuple[Incident, ...] = ()
    """The newest incidents, oldest first, at most MAX_INCIDENTS."""
    mig_request: str | None = None
    """The MIG layout the Node's nvidia.com/mig.config label asks for; None when it has none."""
    mig_status: MigStatus | None = None
    config_request: str | None = None
    """The named config the Node's nvidia.com/device-plugin.config label asks for; None when it has none."""
    mps: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """MPS control daemons by GPU UUID: "" when the GPU's daemon is up, else why not. A GPU missing here has
    no daemon yet."""
    machine: str = "unknown"
    """The machine type (flags.gfd.machineTypeFile, e.g. the DMI product name), for nvidia.com/gpu.machine."""
    labelled_at: int = 0
    """Unix time the agent started; nvidia.com/gfd.timestamp."""
    cordon_request: str | None = None
    """The value of the Node's gpu-node-agent.io/cordon annotation ("" when it has none); None until the Node is
    read (or without an API server)."""
    cordoned: frozenset[str] = frozenset()
    """GPU UUIDs an operator took out of service (agent/cordon.py): no new pod is given them or their MIG devices
    and replicas (the device plugin lists them Unhealthy, the slice leaves them out); pods holding them run on."""
    cordon_holders: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """For each cordoned GPU, the pods (``namespace/name``) and DRA claims (``ResourceClaim namespace/name``)
    that still hold it or one of its MIG devices or replicas, as last read."""

    def gpu_health(self, uuid: str) -> DeviceHealth:
        return self.health.get(uuid, HEALTHY)

    def node_fault(self, unhealthy_threshold: int = 0) -> str | None:
        """Why the node as a whole is faulty, or None: a node-fatal GPU fault, or at least
        `unhealthy_threshold` (when above 0) unhealthy GPUs."""
        fatal = sorted(h.reason for h in self.health.values() if h.node_fatal)
        if fatal:
            return fatal[0]
        unhealthy = sum(not h.healthy for h in self.health.values())
        if unhealthy_threshold and unhealthy >= unhealthy_threshold:
            return f"{unhealthy} GPUs unhealthy"
        return None

    def evolve(self, **changes: Unpack[Evolution]) -> NodeState:
        """The next version with the given fields replaced; health and mps are kept read-only."""
        if "health" in changes:
            changes["health"] = MappingProxyType(dict(changes["health"]))
        if "mps" in changes:
            changes["mps"] = MappingProxyType(dict(changes["mps"]))
        if "cordon_holders" in changes:
            changes["cordon_holders"] = MappingProxyType(dict(changes["cordon_holders"]))
        return dataclasses.replace(self, version=self.version + 1, **changes)


class StateBus:
    """Holds the newest NodeState and wakes consumers when a newer one is published.

    Lives on the event loop; producers on other threads publish with loop.call_soon_threadsafe.
    """

    def __init__(self, initial: NodeState) -> None:
        self._state = initial
        self._changed = asyncio.Condition()

    @property
    def current(self) -> NodeState:
        return self._state

    async def publish(self, state: NodeState) -> None:
        if state.version <= self._state.version:
            raise ValueError(f"state version {state.version} is not newer than {self._state.version}")
        async with self._changed:
            self._state = state
            self._changed.notify_all()

    async def update(self, **changes: Unpack[Evolution]) -> NodeState:
        """Publish the current state with the given fields replaced; returns the new version."""
        async with self._changed:
            self._state = self._state.evolve(**changes)
            self._changed.notify_all()
            return self._state

    async def record(self, incidents: list[tuple[str, str, str]], **changes: Unpack[Changes]) -> NodeState:
        """Publish `changes` together with new incidents, given as (gpu uuid, kind, message)."""
        async with self._changed:
            state = self._state
            seq = state.incidents[-1].seq if state.incidents else 0
            now = time.time()
            added = [Incident(seq + i, uuid, kind, message, now)
                     for i, (uuid, kind, message) in enumerate(incidents, 1)]
            kept = [i for i in (*state.incidents, *added) if now - i.at <= MAX_INCIDENT_AGE_S][-MAX_INCIDENTS:]
            self._state = state.evolve(incidents=tuple(kept), **changes)
            self._changed.notify_all()
            return self._state

    async def wait_newer(self, version: int) -> NodeState:
        """Return the newest state once its version is above `version`."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._state.version > version)
            return self._state
