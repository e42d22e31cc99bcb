"""Pure: NodeState + config -> the resources the node advertises and their devices
(whole GPUs, MIG devices, time-sliced replicas)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from agent.config import AgentConfig, ReplicatedResource
from agent.nvml.backend import GpuInfo, MigDeviceInfo
from agent.state import NodeState

GPU_RESOURCE = "nvidia.com/gpu"
REPLICA_SEPARATOR = "::"


@dataclass(frozen=True)
class Device:
    """One schedulable unit as the kubelet sees it."""

    id: str
    healthy: bool
    numa: int | None
    gpu_index: int
    gpu_uuid: str
    visible: str
    """What the container runtime is given: a GPU or MIG UUID, or an index, per deviceIDStrategy."""
    reason: str = ""
    kind: Literal["gpu", "mig"] = "gpu"
    shared: bool = False
    """A time-sliced replica: several devices share one GPU or MIG device."""


@dataclass(frozen=True)
class Resource:
    name: str
    devices: tuple[Device, ...]
    fail_requests_greater_than_one: bool = False


@dataclass(frozen=True)
class ResourcePlan:
    resources: dict[str, Resource] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    """Why some GPUs are not advertised (for example a non-uniform node under migStrategy single)."""


def sanitise(value: str) -> str:
    """A label value: runs of characters outside [A-Za-z0-9_.-] become '-', at most 63 characters
    (how a product name appears in labels and in time-slicing model selectors)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", value.strip()).strip("-_.")
    return cleaned[:63].rstrip("-_.")


def mig_resource(profile: str) -> str:
    return f"nvidia.com/mig-{profile.replace('+', '.')}"


def selects(selector: int | str, gpu: GpuInfo) -> bool:
    if isinstance(selector, int):
        return selector == gpu.index
    if selector.startswith("GPU-"):
        return selector == gpu.uuid
    return selector.lower() in (gpu.name.lower(), sanitise(gpu.name).lower())


def _whole(gpu: GpuInfo, state: NodeState, by_index: bool) -> Device:
    health = state.gpu_health(gpu.uuid)
    return Device(gpu.uuid, health.healthy, gpu.numa_node, gpu.index, gpu.uuid,
                  str(gpu.index) if by_index else gpu.uuid, health.reason)


def _mig(mig: MigDeviceInfo, slot: int, gpu: GpuInfo, state: NodeState, by_index: bool) -> Device:
    health = state.gpu_health(gpu.uuid)
    return Device(mig.uuid, health.healthy, gpu.numa_node, gpu.index, gpu.uuid,
                  f"{gpu.index}:{slot}" if by_index else mig.uuid, health.reason, kind="mig")


def _base_units(state: NodeState, config: AgentConfig) -> tuple[list[tuple[str, Device]], list[str]]:
    """(resource name, device) before sharing, and why any GPU is left out."""
    by_index = config.flags.plugin.device_id_strategy == "index"
    strategy = config.flags.mig_strategy
    gpus = [g for g in state.inventory.gpus if g.uuid not in state.draining]
    migs: dict[int, list[MigDeviceInfo]] = {}
    for m in state.inventory.mig_devices:
        migs.setdefault(m.parent_index, []).append(m)
    units: list[tuple[str, Device]] = []
    problems: list[str] = []
    if strategy == "none" or (strategy == "single" and not any(g.mig_enabled for g in gpus)):
        return [(GPU_RESOURCE, _whole(g, state, by_index)) for g in gpus], problems
    if strategy == "mixed":
        for g in gpus:
            if not g.mig_enabled:
                units.append((GPU_RESOURCE, _whole(g, state, by_index)))
            for slot, m in enumerate(migs.get(g.index, [])):
                units.append((mig_resource(m.profile), _mig(m, slot, g, state, by_index)))
        return units, problems
    # single: every GPU MIG-enabled, all MIG devices of one profile; the most common profile wins and the
    # GPUs that do not match are left out, named.
    counts = Counter(m.profile for g in gpus for m in migs.get(g.index, []))
    profile = min(counts, key=lambda p: (-counts[p], p)) if counts else None
    offending = []
    for g in gpus:
        profiles = sorted({m.profile for m in migs.get(g.index, [])})
        if not g.mig_enabled:
            offending.append(f"GPU {g.index} (MIG disabled)")
        elif profiles != [profile]:
            offending.append(f"GPU {g.index} ({', '.join(profiles) or 'no MIG devices'})")
        else:
            units += [(GPU_RESOURCE, _mig(m, slot, g, state, by_index)) for slot, m in enumerate(migs[g.index])]
    if offending:
        problems.append(
            f"migStrategy single needs every GPU MIG-enabled with devices of one profile ({profile}); "
            f"not advertised: {'; '.join(offending)}"
        )
    return units, problems


def sharing_conflicts(state: NodeState, config: AgentConfig) -> list[str]:
    """Config problems only the node can reveal: a GPU selected by two time-slicing entries of one resource."""
    problems = []
    entries = config.sharing.time_slicing.resources
    for gpu in state.inventory.gpus:
        by_name: dict[str, list[int]] = {}
        for i, entry in enumerate(entries):
            if entry.devices == "all" or any(selects(s, gpu) for s in entry.devices):
                by_name.setdefault(entry.name, []).append(i)
        for name, hits in sorted(by_name.items()):
            if len(hits) > 1:
                listed = ", ".join(f"sharing.timeSlicing.resources[{i}]" for i in hits)
                problems.append(f"GPU {gpu.index} ({gpu.uuid}) is selected for {name} by {listed}")
    return problems


def replicas_for(config: AgentConfig, name: str, gpu: GpuInfo) -> int:
    """How many replicas of `gpu` the resource `name` is shared into (1 when it is not shared)."""
    entry = _entry_for(config.sharing.time_slicing.resources, name, gpu)
    return entry.replicas if entry else 1


def _entry_for(entries: list[ReplicatedResource], name: str, gpu: GpuInfo) -> ReplicatedResource | None:
    for entry in entries:
        if entry.name == name and (entry.devices == "all" or any(selects(s, gpu) for s in entry.devices)):
            return entry
    return None


def plan(state: NodeState, config: AgentConfig | None = None) -> ResourcePlan:
    """Every resource the node advertises, devices in GPU order; draining GPUs are withdrawn entirely."""
    config = config or state.config
    units, problems = _base_units(state, config)
    slicing = config.sharing.time_slicing
    gpus = {g.index: g for g in state.inventory.gpus}
    devices: dict[str, list[Device]] = {}
    shared_names: set[str] = set()
    for name, unit in units:
        entry = _entry_for(slicing.resources, name, gpus[unit.gpu_index])
        if entry is None:
            devices.setdefault(name, []).append(unit)
            continue
        target = entry.rename or (f"{name}.shared" if slicing.rename_by_default else name)
        shared_names.add(target)
        devices.setdefault(target, []).extend(
            Device(f"{unit.id}{REPLICA_SEPARATOR}{n}", unit.healthy, unit.numa, unit.gpu_index, unit.gpu_uuid,
                   unit.visible, unit.reason, unit.kind, shared=True)
            for n in range(entry.replicas)
        )
    resources = {
        name: Resource(name, tuple(items), slicing.fail_requests_greater_than_one and name in shared_names)
        for name, items in sorted(devices.items())
    }
    return ResourcePlan(resources, tuple(problems))


class PlanCache:
    """The plan of the newest state, computed once per state version for all consumers."""

    def __init__(self) -> None:
        self._state: NodeState | None = None
        self._plan = ResourcePlan()

    def __call__(self, state: NodeState) -> ResourcePlan:
        if state is not self._state:
            self._plan, self._state = plan(state), state
        return self._plan
