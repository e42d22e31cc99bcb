"""Dynamic MIG in DRA mode (`dra.dynamicMig`, KEP 4815 "partitionable devices", the DRAPartitionableDevices
feature gate): every possible MIG placement of a GPU in MIG mode is a device of the ResourceSlice, each
consuming the memory-slice counters of its placement from its GPU's counter set, so the scheduler never hands
out two overlapping placements. NodePrepareResources creates the GPU instance at the allocated placement and its
compute instance; NodeUnprepareResources destroys them.

The slice shape depends on the API server's version (as NVIDIA's DRA driver does it): up to 1.34 each such GPU
has a slice of its own with its counter set and its devices; from 1.35 a slice may hold counters or devices,
not both, so the counter sets go into one slice of their own and each GPU's devices into another. The node's
other devices (whole GPUs, replicas) stay in the node's usual slice; every slice of the pool has the same
generation and `resourceSliceCount`.

Where the API server drops the counters (the gate is off), a dry run shows it before anything is written: the
agent says so in one line and publishes as without dynamicMig for the rest of its run.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from agent.dra.claims import ClaimStore
from agent.dra.publisher import SliceClient, SlicePublisher
from agent.dra.slices import (
    GpuInfo,
    PcieRootLookup,
    gpu_attributes,
    health_taints,
    held_gpus,
    mib_quantity,
    mig_device_name,
    nvlink_cliques,
    published_migs,
    slice_name,
    slice_spec,
    split_slice,
)
from agent.nvml.backend import NvmlBackend
from agent.nvml.catalog import MODELS, MigProfile, Placement
from agent.nvml.mig_ops import GpuInstanceInfo, MigCallError, MigOps
from agent.state import NodeState, StateBus
from agent.topology.prefer import topology_of

log = logging.getLogger(__name__)

T = TypeVar("T")
NvmlCall = Callable[[Callable[[], T]], Awaitable[T]]

SPLIT_FROM = (1, 35)
"""The first Kubernetes version whose API server takes counters only in a slice without devices."""
UNDECIDED, COUNTERS, STATIC = "undecided", "counters", "static"
MAX_COUNTER_SETS = 8
"""The most counter sets a ResourceSlice takes from 1.35 (ResourceSliceMaxCounterSets)."""


# --- the slice shape (pure) ------------------------------------------------------------------------------


def server_version(git_version: str) -> tuple[int, int] | None:
    """(major, minor) of an API server's gitVersion ("v1.34.4", "v1.35.0-gke.1"); None when unreadable."""
    found = re.match(r"v?(\d+)\.(\d+)", git_version.strip())
    return (int(found.group(1)), int(found.group(2))) if found else None


def splits_counters(git_version: str) -> bool:
    """Whether counter sets need a slice of their own: Kubernetes 1.35 and later (an unreadable version is
    taken as the newer rule)."""
    version = server_version(git_version)
    return version is None or version >= SPLIT_FROM


def counter_set_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}-counter-set"


def memory_slice_counter(n: int) -> str:
    return f"memory-slice-{n}"


def profile_token(profile: str) -> str:
    """A profile name in a device name: "1g.10gb+me" -> "1g10gbme", "1g.24gb-me" -> "1g24gbnome" (apart from
    the +me profile of the same size)."""
    return re.sub(r"[^a-z0-9]", "", profile.lower().replace("-", "no"))


def instances_counter(profile: MigProfile) -> str:
    return f"instances-{profile_token(profile.name)}"


def placement_device_name(gpu_index: int, profile: str, start: int) -> str:
    """gpu-<index>-mig-<profile without dots>-<first memory slice>, e.g. gpu-0-mig-3g40gb-4."""
    return f"gpu-{gpu_index}-mig-{profile_token(profile)}-{start}"


def catalog_profiles(gpu: GpuInfo) -> tuple[MigProfile, ...]:
    """The MIG profiles of a GPU by its model, where NVML's own answer is not at hand."""
    return next((m.mig_profiles for m in MODELS.values() if m.nvml_name == gpu.name), ())


@dataclass(frozen=True)
class PlacementDevice:
    gpu: GpuInfo
    profile: MigProfile
    placement: Placement

    @property
    def name(self) -> str:
        return placement_device_name(self.gpu.index, self.profile.name, self.placement.start)


ProfilesOf = Callable[[GpuInfo], tuple[MigProfile, ...]]


def dynamic_gpus(state: NodeState, profiles: ProfilesOf = catalog_profiles, taints: bool = False
                 ) -> list[tuple[GpuInfo, tuple[MigProfile, ...]]]:
    """The GPUs in MIG mode whose placements are published: with MIG profiles, not draining, not cordoned, not
    held through the mode the node left, and healthy unless unhealthy ones are published with a taint."""
    held = held_gpus(state)
    return [(g, found) for g in state.inventory.gpus
            if g.mig_enabled and (found := profiles(g)) and g.uuid not in state.draining and g.uuid not in held
            and g.uuid not in state.cordoned and (taints or state.gpu_health(g.uuid).healthy)]


def placements(state: NodeState, profiles: ProfilesOf = catalog_profiles, taints: bool = False
               ) -> dict[str, PlacementDevice]:
    """Every possible MIG placement of the published GPUs, by device name."""
    found: dict[str, PlacementDevice] = {}
    for gpu, listed in dynamic_gpus(state, profiles, taints):
        for profile in listed:
            for placement in profile.placements:
                device = PlacementDevice(gpu, profile, placement)
                found[device.name] = device
    return found


def counter_set(gpu: GpuInfo, profiles: tuple[MigProfile, ...]) -> dict[str, Any]:
    """A GPU's counters: one per memory slice (1 each), and for a profile with fewer instances than
    placements (1g.10gb+me: one of seven) how many instances of it the GPU takes."""
    slices = max((p.start + p.size for profile in profiles for p in profile.placements), default=0)
    counters = {memory_slice_counter(n): {"value": "1"} for n in range(slices)}
    for profile in profiles:
        if profile.instance_count < len(profile.placements):
            counters[instances_counter(profile)] = {"value": str(profile.instance_count)}
    return {"name": counter_set_name(gpu), "counters": counters}


def placement_device(device: PlacementDevice, state: NodeState, cliques: Any, pcie_root: PcieRootLookup
                     ) -> dict[str, Any]:
    gpu, profile, placement = device.gpu, device.profile, device.placement
    attributes: dict[str, dict[str, Any]] = {
        "type": {"string": "mig"}, "profile": {"string": profile.name}, "dynamic": {"bool": True},
        "parentUUID": {"string": gpu.uuid}, "parentIndex": {"int": gpu.index}, "parentMinor": {"int": gpu.minor},
        "placementStart": {"int": placement.start}, "placementSize": {"int": placement.size},
        **gpu_attributes(gpu, state, cliques, pcie_root)}
    counts = {"multiprocessors": profile.multiprocessor_count, "copyEngines": profile.copy_engines,
              "decoders": profile.decoders, "encoders": profile.encoders, "jpegEngines": profile.jpegs,
              "ofaEngines": profile.ofas}
    capacity = {"memory": {"value": mib_quantity(profile.memory_size_mib)},
                **{k: {"value": str(v)} for k, v in counts.items()}}
    consumed = {memory_slice_counter(n): {"value": "1"}
                for n in range(placement.start, placement.start + placement.size)}
    if profile.instance_count < len(profile.placements):
        consumed[instances_counter(profile)] = {"value": "1"}
    return {"name": device.name, "attributes": attributes, "capacity": capacity,
            "consumesCounters": [{"counterSet": counter_set_name(gpu), "counters": consumed}]}


def dynamic_slices(state: NodeState, node: str, driver: str, generation: int, split: bool,
                   profiles: ProfilesOf = catalog_profiles, pcie_root: PcieRootLookup = lambda bus_id: None,
                   taints: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The node's slices as (object name, spec): the usual slice with the devices of the GPUs not in MIG mode
    (named as without dynamicMig), then, unless `split`, a slice per GPU in MIG mode with its counter set and
    its placements (`<usual name>-gpu-<index>`); with `split` (Kubernetes 1.35 and later), one slice of every
    counter set (`<usual name>-counters`) and one of each GPU's placements."""
    base = slice_spec(state, node, driver, generation, pcie_root, taints)
    gpus = dynamic_gpus(state, profiles, taints)
    dynamic_parents = {g.index for g, _ in gpus}
    static_migs = {mig_device_name(m) for _, m in published_migs(state, taints=True)
                   if m.parent_index in dynamic_parents}
    base["devices"] = [d for d in base["devices"] if d["name"] not in static_migs]
    cliques = nvlink_cliques(topology_of(state.inventory))
    name = slice_name(node, driver)
    slices = split_slice(name, base)  # the base slice at the API's limits, as without dynamicMig
    base_count = len(slices)
    if split and gpus:  # at most MAX_COUNTER_SETS a slice
        sets = [counter_set(g, p) for g, p in gpus]
        for n in range(0, len(sets), MAX_COUNTER_SETS):
            suffix = "" if n == 0 else f"-{n // MAX_COUNTER_SETS}"
            slices.append((f"{name}-counters{suffix}", {"sharedCounters": sets[n:n + MAX_COUNTER_SETS]}))
    for gpu, listed in gpus:
        devices = [placement_device(PlacementDevice(gpu, profile, placement), state, cliques, pcie_root)
                   for profile in listed for placement in profile.placements]
        for device in devices:
            if found := health_taints(state.gpu_health(gpu.uuid), driver):
                device["taints"] = found
        spec: dict[str, Any] = {"devices": devices}
        if not split:
            spec = {"sharedCounters": [counter_set(gpu, listed)], **spec}
        slices.append((f"{name}-gpu-{gpu.index}", spec))
    for _, spec in slices[base_count:]:
        spec.update({"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 0}})
    for _, spec in slices:
        spec["pool"]["resourceSliceCount"] = len(slices)
    return [(n, _ordered(s)) for n, s in slices]


def _ordered(spec: dict[str, Any]) -> dict[str, Any]:
    keys = ("driver", "nodeName", "pool", "sharedCounters", "devices")
    return {**{k: spec[k] for k in keys if k in spec}, **{k: v for k, v in spec.items() if k not in keys}}


# --- creating and destroying the MIG devices (on the NVML thread) ----------------------------------------


@dataclass(frozen=True)
class MadeDevice:
    """A MIG device this agent made for a claim."""

    uuid: str
    gpu_index: int
    gpu_minor: int
    gpu_instance_id: int
    compute_instance_id: int


class DynamicMigError(Exception):
    """A MIG device could not be made for a claim; the message says why in one line."""


class DynamicMig:
    """The MIG profiles NVML reports per GPU, and the MIG devices made for prepared claims, kept with their
    claims in the DRA checkpoint (`ClaimStore`) with their instance ids, written before and after each create and
    after each destroy: a restart in between loses nothing."""

    def __init__(self, backend: NvmlBackend, nvml: NvmlCall[Any], store: ClaimStore) -> None:
        self._backend = backend
        self._ops = MigOps(backend)
        self._nvml = nvml
        self.store = store
        self.profiles: dict[str, tuple[MigProfile, ...]] = {}
        """By GPU UUID: what NVML lists (placements included) for each GPU in MIG mode."""
        self.active = False
        """Set by the publisher once the API server is known to keep the counters."""
        self.loaded = False
        """Whether load_profiles ran (the publisher runs it before its first write)."""
        self._lock = asyncio.Lock()

    @property
    def made(self) -> dict[str, dict[str, Any]]:
        """By "<claim uid>/<device>": the placement and, once made, the instance ids and MIG UUID."""
        return self.store.mig_records()

    async def load_profiles(self, state: NodeState) -> None:
        """Ask NVML for the profiles and placements of each GPU in MIG mode."""
        for gpu in state.inventory.gpus:
            if gpu.mig_enabled:
                found = await self._nvml(functools.partial(self._ops.state, gpu.index))
                if found.mig_enabled and found.profiles:
                    self.profiles[gpu.uuid] = found.profiles
        self.loaded = True

    def profiles_of(self, gpu: GpuInfo) -> tuple[MigProfile, ...]:
        return self.profiles.get(gpu.uuid) or catalog_profiles(gpu)

    def devices(self, state: NodeState) -> dict[str, PlacementDevice]:
        """The placement devices the slice names (none unless the publisher found the counters kept)."""
        return placements(state, self.profiles_of, taints=True) if self.active else {}

    def device_gpus(self, state: NodeState) -> dict[str, str]:
        return {name: d.gpu.uuid for name, d in self.devices(state).items()}

    async def create(self, uid: str, device: PlacementDevice) -> MadeDevice:
        """The MIG device of `device` for claim `uid`: made now, or the one made before (an interrupted
        Prepare finds its instance by the checkpoint's record)."""
        async with self._lock:
            record = self.made.get(f"{uid}/{device.name}")
            if record is not None and "uuid" in record:
                return _made(record)
            gpu, profile, start = device.gpu, device.profile, device.placement.start
            if record is None:
                self.store.set_mig(uid, device.name, {"gpu": gpu.index, "minor": gpu.minor, "profile": profile.name,
                                                      "start": start})
            else:  # a create was under way when the agent stopped: take its instance if it is there
                existing = await self._nvml(lambda: self._instance_at(gpu.index, start))
                if existing is not None and existing.profile == profile.name:
                    return self._record(uid, device.name, existing)
            try:
                await self._nvml(lambda: self._ops.create(gpu.index, profile.name, start))
            except MigCallError as err:
                self.store.drop_mig(uid, device.name)
                raise DynamicMigError(
                    f"cannot create MIG device {profile.name} at memory slice {start} of GPU {gpu.index}: {err} "
                    "(is the placement taken by a GPU instance made outside the agent?)") from None
            found = await self._nvml(lambda: self._instance_at(gpu.index, start))
            if found is None:
                raise DynamicMigError(f"MIG device {profile.name} at memory slice {start} of GPU {gpu.index} was "
                                      "created but NVML does not list it")
            return self._record(uid, device.name, found)

    def _record(self, uid: str, device: str, found: Any) -> MadeDevice:
        record = {**self.made[f"{uid}/{device}"], "uuid": found.uuid, "gi": found.gpu_instance_id,
                  "ci": found.compute_instance_id}
        self.store.set_mig(uid, device, record)
        return _made(record)

    def _gpu_instance_at(self, index: int, start: int) -> GpuInstanceInfo | None:
        """The GPU instance at memory slice `start` of GPU `index`, with or without its compute instance."""
        return next((i for i in self._ops.state(index).instances if i.start == start), None)

    def _instance_at(self, index: int, start: int) -> Any:
        """The MIG device (GPU and compute instance) at memory slice `start` of GPU `index`, if any."""
        return next((m for m in self._backend.mig_devices(index) if m.placement_start == start), None)

    async def release(self, uid: str) -> list[str]:
        """Destroy the MIG devices made for claim `uid` (those already gone are a success); returns the
        device names."""
        released = []
        async with self._lock:
            for key in [k for k in self.made if k.split("/", 1)[0] == uid]:
                record = self.made[key]
                index, start = int(record["gpu"]), int(record["start"])
                gi = record.get("gi")

                def destroy(index: int = index, start: int = start, gi: Any = gi) -> None:
                    found = self._gpu_instance_at(index, start)
                    if found is None or (gi is not None and found.gpu_instance_id != gi):
                        return  # gone already (or another instance sits there now: not this claim's)
                    self._ops.destroy(index, start)

                try:
                    await self._nvml(destroy)
                except (MigCallError, LookupError) as err:
                    raise DynamicMigError(f"cannot destroy MIG device {key.split('/', 1)[1]}: {err}") from None
                self.store.drop_mig(uid, key.split("/", 1)[1])
                released.append(key.split("/", 1)[1])
        return released

    async def sweep(self, state: NodeState) -> list[str]:
        """Destroy the MIG devices of the published GPUs that no claim's record owns (left by a crash, or made
        outside the agent), one log line each; returns them as "<profile> at memory slice <n> of GPU <i>". A
        record owns the MIG device at its GPU and placement (one whose create was cut short included)."""
        if not self.store.sweep_allowed:
            return []
        swept = []
        # Under the node's prepare lock, with the claims as the checkpoint has them: a MIG device the other agent
        # of a rolling update made for a claim is that claim's.
        async with self.store.serialized(), self._lock:
            owned = {(int(r["gpu"]), int(r["start"])) for r in self.made.values()}
            for gpu, _ in dynamic_gpus(state, self.profiles_of, taints=True):
                try:
                    found = await self._nvml(functools.partial(self._ops.state, gpu.index))
                except MigCallError as err:
                    log.warning("cannot list the MIG devices of GPU %d to destroy those no prepared claim owns: %s",
                                gpu.index, err)
                    continue
                for instance in found.instances:
                    if (gpu.index, instance.start) in owned:
                        continue
                    what = f"{instance.profile} at memory slice {instance.start} of GPU {gpu.index}"
                    try:
                        await self._nvml(functools.partial(self._ops.destroy, gpu.index, instance.start))
                    except (MigCallError, LookupError) as err:
                        log.warning("cannot destroy MIG device %s, which no prepared claim owns: %s", what, err)
                        continue
                    log.info("destroyed MIG device %s: no prepared claim owns it", what)
                    swept.append(what)
        return swept


def _made(record: Mapping[str, Any]) -> MadeDevice:
    return MadeDevice(str(record["uuid"]), int(record["gpu"]), int(record["minor"]), int(record["gi"]),
                      int(record["ci"]))


# --- publishing the slices --------------------------------------------------------------------------------


class DynamicSlicePublisher(SlicePublisher):
    """The node's slices with dynamic MIG: as SlicePublisher, but several slices of one pool. The first time,
    the API server's version decides the shape and a dry run whether it keeps the counters; where it does not,
    this publisher says so once and publishes as SlicePublisher does."""

    def __init__(self, api: SliceClient, bus: StateBus, node: str, driver: str, dynamic: DynamicMig,
                 **kwargs: Any) -> None:
        super().__init__(api, bus, node, driver, **kwargs)
        self.dynamic = dynamic
        self.counters_mode = UNDECIDED
        self.split: bool | None = None

    async def _decide_split(self) -> bool:
        if self.split is None:
            version_of = getattr(self._api, "version", None)
            git_version = str((await version_of()).get("gitVersion", "")) if version_of is not None else ""
            self.split = splits_counters(git_version)
            log.info("API server %s: %s", git_version or "of unknown version",
                     "counter sets in a ResourceSlice of their own" if self.split
                     else "each GPU's counter set in the ResourceSlice of its devices")
        return self.split

    async def sync(self, state: NodeState) -> bool:
        if self.counters_mode == STATIC:
            return await super().sync(state)
        split = await self._decide_split()
        if not self.dynamic.loaded:
            await self.dynamic.load_profiles(state)
        wanted = dynamic_slices(state, self.node, self.driver, 0, split, self.dynamic.profiles_of,
                                self._pcie_root)
        if self.counters_mode == UNDECIDED and not any(s.get("sharedCounters") for _, s in wanted):
            return await super().sync(state)  # no GPU in MIG mode (yet): nothing to decide
        await self._read_owner()
        existing = await self._listed()
        if self.counters_mode == UNDECIDED:
            name, spec = next((n, s) for n, s in wanted if s.get("sharedCounters"))
            body = self._body(name, {**copy.deepcopy(spec), "pool": {**spec["pool"], "generation": 1}},
                              existing.get(name))
            stored = await (self._api.replace(name, body, dry_run=True) if name in existing
                            else self._api.create(body, dry_run=True))
            if not (stored.get("spec") or {}).get("sharedCounters"):
                log.warning("the API server drops the shared counters of ResourceSlice %s (the "
                            "DRAPartitionableDevices feature gate is off): dra.dynamicMig is off until the agent "
                            "restarts; MIG devices are published as the GPUs' layout has them", name)
                self.counters_mode = STATIC
                return await super().sync(state)
            log.info("the API server keeps shared counters (DRAPartitionableDevices): each MIG placement of a GPU "
                     "in MIG mode is a device, created at NodePrepareResources")
            self.counters_mode = COUNTERS
            self.dynamic.active = True
            await self.dynamic.sweep(state)
        return await self._write_slices(wanted, existing)
