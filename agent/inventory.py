"""Pure: NodeState + config -> the resources the node advertises and their devices
(whole GPUs, MIG devices, time-sliced replicas)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from agent.config import GPU_RESOURCE as GPU_RESOURCE
from agent.config import AgentConfig, ReplicatedResource, ResourcePattern
from agent.nvml.records import GpuInfo, MigDeviceInfo
from agent.state import NodeState

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
    """A replica: several devices share one GPU or MIG device (time-slicing or MPS)."""
    index: str = ""
    """The device's index as nvidia-smi and NVIDIA's selectors write it: "3" for a GPU, "3:1" for a MIG device."""
    replicas: int = 1
    """How many replicas its GPU or MIG device is shared into (1 when it is not shared)."""


Sharing = Literal["none", "time-slicing", "mps"]


@dataclass(frozen=True)
class Resource:
    name: str
    devices: tuple[Device, ...]
    fail_requests_greater_than_one: bool = False
    sharing: Sharing = "none"


@dataclass(frozen=True)
class ResourcePlan:
    resources: dict[str, Resource] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    """Why some GPUs or resources are not advertised (for example a non-uniform node under migStrategy single,
    or a resource name that would hold two kinds of device)."""
    warnings: tuple[str, ...] = ()
    """Config entries that select nothing on this node (a sharing selector that matches no device)."""


def sanitise(value: str) -> str:
    """A label value as GPU feature discovery makes one: characters outside [A-Za-z0-9-_. ] dropped, runs of
    spaces joined with '-', cut to 63 characters (a label value's limit); '-', '_' and '.' trimmed from both
    ends, since a label value must begin and end with a letter or digit."""
    kept = re.sub(r"[^A-Za-z0-9\-_. ]", "", value)
    return "-".join(kept.split()).lstrip("-_.")[:63].rstrip("-_.")


def mig_resource(profile: str) -> str:
    return f"nvidia.com/mig-{profile.replace('+', '.')}"


def selects(selector: int | str, unit: Device, gpu: GpuInfo) -> bool:
    """Whether a sharing `devices` entry names this device, read as NVIDIA's plugin reads it: a GPU index
    (0 or "0") or a MIG index ("0:1"), a GPU or MIG UUID; a model name (this agent's addition) names every
    device of GPUs of that model."""
    if isinstance(selector, int):
        return unit.kind == "gpu" and selector == gpu.index
    if selector.isdigit() or re.fullmatch(r"\d+:\d+", selector):
        return selector == unit.index
    if selector.startswith("GPU-"):
        return unit.kind == "gpu" and selector == gpu.uuid
    if selector.startswith("MIG-"):
        return unit.kind == "mig" and selector == unit.id
    return selector.lower() in (gpu.name.lower(), sanitise(gpu.name).lower())


CORDONED = "cordoned (the Node's gpu-node-agent.io/cordon annotation)"
"""Why a healthy GPU's devices are listed Unhealthy: an operator took it out of service (agent/cordon.py)."""


def _health(gpu: GpuInfo, state: NodeState) -> tuple[bool, str]:
    """Whether the GPU's devices are offered, and why not: its health, then the operator's cordon."""
    health = state.gpu_health(gpu.uuid)
    if health.healthy and gpu.uuid in state.cordoned:
        return False, CORDONED
    return health.healthy, health.reason


def _whole(gpu: GpuInfo, state: NodeState, by_index: bool) -> Device:
    healthy, reason = _health(gpu, state)
    return Device(gpu.uuid, healthy, gpu.numa_node, gpu.index, gpu.uuid,
                  str(gpu.index) if by_index else gpu.uuid, reason, index=str(gpu.index))


def _mig(mig: MigDeviceInfo, slot: int, gpu: GpuInfo, state: NodeState, by_index: bool) -> Device:
    healthy, reason = _health(gpu, state)
    return Device(mig.uuid, healthy, gpu.numa_node, gpu.index, gpu.uuid,
                  f"{gpu.index}:{slot}" if by_index else mig.uuid, reason, kind="mig",
                  index=f"{gpu.index}:{slot}")


def _named(patterns: list[ResourcePattern], text: str, default: str) -> str | None:
    """The resource a GPU name or MIG profile goes to under `resources`: the first matching pattern, the
    default when no patterns are given, None when patterns are given and none matches."""
    if not patterns:
        return default
    return next((p.name for p in patterns if p.matches(text)), None)


def _base_units(state: NodeState, config: AgentConfig) -> tuple[list[tuple[str, Device]], list[str]]:
    """(resource name, device) before sharing, and why any GPU is left out."""
    units, problems = _strategy_units(state, config)
    named: list[tuple[str, Device]] = []
    gpus = {g.index: g for g in state.inventory.gpus}
    profiles = {m.uuid: m.profile for m in state.inventory.mig_devices}
    for default, unit in units:
        if unit.kind == "gpu":
            patterns, text, key = config.resources.gpus, gpus[unit.gpu_index].name, "resources.gpus"
        else:
            patterns, text, key = config.resources.mig, profiles[unit.id], "resources.mig"
        name = _named(patterns, text, default)
        if name is None:
            what = f"GPU {unit.index}" if unit.kind == "gpu" else f"MIG device {unit.index}"
            problems.append(f"{what} ({text}) matches no pattern of {key}; not advertised")
            continue
        named.append((name, unit))
    return named, problems


def _strategy_units(state: NodeState, config: AgentConfig) -> tuple[list[tuple[str, Device]], list[str]]:
    by_index = config.flags.plugin.device_id_strategy == "index"
    strategy = config.flags.mig_strategy
    gpus = [g for g in state.inventory.gpus if g.uuid not in state.draining and g.uuid not in state.held]
    migs: dict[int, list[MigDeviceInfo]] = {}
    for m in state.inventory.mig_devices:
        if m.uuid not in state.held:
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


def _chosen(entry: ReplicatedResource, units: list[Device], gpus: dict[int, GpuInfo]) -> list[Device]:
    """The devices of one resource that a sharing entry shares."""
    if entry.devices == "all":
        return units
    if isinstance(entry.devices, int):
        return units[: entry.devices]
    return [u for u in units if any(selects(s, u, gpus[u.gpu_index]) for s in entry.devices)]


def _sharing_path(config: AgentConfig) -> str:
    return "sharing.mps" if config.sharing.strategy == "mps" else "sharing.timeSlicing"


def _assignments(state: NodeState, config: AgentConfig, units: list[tuple[str, Device]]
                 ) -> tuple[dict[str, list[tuple[int, ReplicatedResource]]], list[str]]:
    """For each device id, the sharing entries (with their position) that select it, and the warnings for
    entries or selectors that select nothing on this node."""
    gpus = {g.index: g for g in state.inventory.gpus}
    by_resource: dict[str, list[Device]] = {}
    for name, unit in units:
        by_resource.setdefault(name, []).append(unit)
    chosen: dict[str, list[tuple[int, ReplicatedResource]]] = {}
    warnings: list[str] = []
    path = _sharing_path(config)
    for i, entry in enumerate(config.sharing.replicated.resources):
        here = by_resource.get(entry.name, [])
        for unit in _chosen(entry, here, gpus):
            chosen.setdefault(unit.id, []).append((i, entry))
        where = f"{path}.resources[{i}]"
        if not here:
            warnings.append(f"{where}: {entry.name} has no devices on this node; nothing is shared")
        elif isinstance(entry.devices, int) and entry.devices > len(here):
            warnings.append(f"{where}.devices: asks for the first {entry.devices} devices of {entry.name}, "
                            f"the node has {len(here)}; all {len(here)} are shared")
        elif isinstance(entry.devices, list):
            for j, selector in enumerate(entry.devices):
                if not any(selects(selector, u, gpus[u.gpu_index]) for u in here):
                    warnings.append(f"{where}.devices[{j}]: {selector!r} selects no device of {entry.name} "
                                    "on this node")
    return chosen, warnings


def sharing_conflicts(state: NodeState, config: AgentConfig) -> list[str]:
    """Config problems only the node can reveal: a device selected by two sharing entries."""
    units, _ = _base_units(state, config)
    chosen, _ = _assignments(state, config, units)
    path = _sharing_path(config)
    problems = []
    for _, unit in units:
        hits = chosen.get(unit.id, [])
        if len(hits) > 1:
            listed = ", ".join(f"{path}.resources[{i}]" for i, _ in hits)
            what = f"GPU {unit.index} ({unit.gpu_uuid})" if unit.kind == "gpu" else f"MIG device {unit.index}"
            problems.append(f"{what} is selected for {hits[0][1].name} by {listed}")
    return problems


def mps_shared_gpus(state: NodeState) -> list[tuple[GpuInfo, int]]:
    """The GPUs the config in force shares with MPS, with their replica counts."""
    config = state.config
    if config.sharing.strategy != "mps":
        return []
    units, _ = _base_units(state, config)
    chosen, _ = _assignments(state, config, units)
    gpus = {g.uuid: g for g in state.inventory.gpus}
    return [(gpus[unit.gpu_uuid], chosen[unit.id][0][1].replicas) for _, unit in units if unit.id in chosen]


def _kind(unit: Device, name: str, target: str) -> tuple[str, str]:
    """What kind of device `unit` (of resource `name`) puts into resource `target`, and that kind in words: a
    whole GPU or a MIG device, shared or not, in its own resource; or the replicas of another resource."""
    if target != name:
        return f"replicas:{unit.kind}", f"replicas of {name}"
    return unit.kind, "whole GPUs" if unit.kind == "gpu" else "MIG devices"


def plan(state: NodeState, config: AgentConfig | None = None) -> ResourcePlan:
    """Every resource the node advertises, devices in GPU order; draining GPUs are withdrawn entirely, the
    GPUs and MIG devices DRA claims hold after a switch from DRA mode (`state.held`) too, MPS
    replicas of a GPU whose control daemon is not up are withheld, and so is a resource the config would fill
    with two kinds of device (whole GPUs, MIG devices, replicas of another resource: see _kind)."""
    config = config or state.config
    units, problems = _base_units(state, config)
    chosen, warnings = _assignments(state, config, units)
    sharing = config.sharing.replicated
    strategy = config.sharing.strategy
    devices: dict[str, list[Device]] = {}
    kinds: dict[str, dict[str, str]] = {}
    shared_names: set[str] = set()
    waiting: list[str] = []
    for name, unit in units:
        hits = chosen.get(unit.id)
        if not hits:
            kind, words = _kind(unit, name, name)
            kinds.setdefault(name, {}).setdefault(kind, words)
            devices.setdefault(name, []).append(unit)
            continue
        entry = hits[0][1]
        target = entry.rename or (f"{name}.shared" if sharing.rename_by_default else name)
        kind, words = _kind(unit, name, target)
        kinds.setdefault(target, {}).setdefault(kind, words)
        shared_names.add(target)
        devices.setdefault(target, [])
        if strategy == "mps" and state.mps.get(unit.gpu_uuid) != "":
            # Withheld until the daemon is up; only a daemon that failed is a problem (a start takes moments).
            why = state.mps.get(unit.gpu_uuid)
            if why:
                waiting.append(f"GPU {unit.index} ({why})")
            continue
        devices[target].extend(
            Device(f"{unit.id}{REPLICA_SEPARATOR}{n}", unit.healthy, unit.numa, unit.gpu_index, unit.gpu_uuid,
                   unit.visible, unit.reason, unit.kind, shared=True, index=unit.index, replicas=entry.replicas)
            for n in range(entry.replicas)
        )
    if waiting:
        problems.append(f"MPS replicas withheld until the GPU's MPS control daemon is up: {'; '.join(waiting)}")
    for name in sorted(kinds):
        if len(kinds[name]) > 1:
            del devices[name]
            *first, last = kinds[name].values()
            problems.append(f"{name} would hold {', '.join(first)} and {last}; a resource holds one kind of device, "
                            "so it is not advertised")
    resources = {
        name: Resource(name, tuple(items),
                       sharing.fail_requests_greater_than_one and name in shared_names,
                       strategy if name in shared_names else "none")
        for name, items in sorted(devices.items())
    }
    return ResourcePlan(resources, tuple(problems), tuple(warnings))


class PlanCache:
    """The plan of the newest state, computed once per state version for all consumers."""

    def __init__(self) -> None:
        self._cached: tuple[NodeState | None, ResourcePlan] = (None, ResourcePlan())
        """(state, its plan) in one attribute: gRPC handler threads read it while the event loop replaces it."""

    def __call__(self, state: NodeState) -> ResourcePlan:
        cached_state, cached = self._cached
        if state is not cached_state:
            cached = plan(state)
            self._cached = (state, cached)
        return cached
