"""Pure: NodeState -> the ResourceSlice (resource.k8s.io/v1) that publishes the node's whole GPUs to DRA.

One pool per node, one slice in it. Per GPU a device named gpu-<index> with the attributes NVIDIA's DRA driver
publishes under the same names (in this driver's domain), the standard PCI attributes, the NUMA node and the
NVLink cliques the link matrix shows, and the capacities `memory` and `multiprocessors`; per MIG device of a
MIG-enabled GPU a device named gpu-<index>-mig-<gi>-<ci> with its profile, parent and placement, its GPU's
model, driver and topology attributes, and its memory and engines; a GPU the sharing config shares
(time-slicing, or MPS once the GPU's daemon is up) is published as its N replicas, gpu-<index>-replica-<n>, or
with dra.sharedCapacity, where the API server keeps consumable capacity, an MPS-shared GPU as one device that
several claims share by its `memory` and `compute` capacities (allowMultipleAllocations, with request policies).
Every device of a GPU attached to a multi-node NVLink fabric carries its `clique` (<cluster UUID>.<clique ID>).
With imex.channelIDs, each IMEX channel whose device node the node has is a device of its own, channel-<id>, as
NVIDIA's DRA driver names it. The devices of unhealthy GPUs and of GPUs whose MIG layout is changing are left
out; where the API server keeps device taints, unhealthy devices stay in with a `<driver>/unhealthy` taint
instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from agent.inventory import GPU_RESOURCE, Resource, mps_shared_gpus, plan
from agent.nvml.catalog import MODELS
from agent.nvml.records import FabricInfo, node_clique, short_bus_id
from agent.state import DeviceHealth, NodeState
from agent.topology.model import Topology
from agent.topology.prefer import topology_of

STANDARD_PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
STANDARD_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"

ARCHITECTURE_NAMES = {
    "kepler": "Kepler", "maxwell": "Maxwell", "pascal": "Pascal", "volta": "Volta", "turing": "Turing",
    "ampere": "Ampere", "ada": "Ada Lovelace", "hopper": "Hopper", "blackwell": "Blackwell",
}
"""The architecture as NVIDIA's DRA driver writes it (go-nvlib's GetArchitectureAsString)."""

BRAND_NAMES = {
    0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan", 7: "NvidiaVApps",
    8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming", 12: "QuadroRTX", 13: "NvidiaRTX",
    14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX",
}
"""NVML_BRAND_* values as NVIDIA's DRA driver writes its `brand` attribute (go-nvlib's GetBrandAsString);
a value it does not name is left out."""

PcieRootLookup = Callable[[str], str | None]


class GpuInfo(Protocol):
    """What the slice needs of one GPU of the inventory."""

    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def pci_bus_id(self) -> str: ...
    @property
    def minor(self) -> int: ...
    @property
    def memory_mib(self) -> int: ...
    @property
    def architecture(self) -> str: ...
    @property
    def compute_capability(self) -> tuple[int, int]: ...
    @property
    def numa_node(self) -> int | None: ...
    @property
    def mig_enabled(self) -> bool: ...
    @property
    def brand(self) -> int | None: ...
    @property
    def fabric(self) -> FabricInfo | None: ...


class MigInfo(Protocol):
    """What the slice needs of one MIG device of the inventory."""

    @property
    def uuid(self) -> str: ...
    @property
    def parent_index(self) -> int: ...
    @property
    def gpu_instance_id(self) -> int: ...
    @property
    def compute_instance_id(self) -> int: ...
    @property
    def profile(self) -> str: ...
    @property
    def memory_mib(self) -> int: ...
    @property
    def placement_start(self) -> int: ...
    @property
    def placement_size(self) -> int: ...
    @property
    def multiprocessors(self) -> int: ...
    @property
    def copy_engines(self) -> int: ...
    @property
    def decoders(self) -> int: ...
    @property
    def encoders(self) -> int: ...
    @property
    def jpegs(self) -> int: ...
    @property
    def ofas(self) -> int: ...


@dataclass(frozen=True)
class Cliques:
    """NVLink cliques by GPU index, each identified by its lowest GPU index."""

    pair: Mapping[int, int]
    """GPUs that are each other's one strongest NVLink peer (NVLink bridges, hybrid meshes)."""
    group: Mapping[int, int]
    """GPUs connected by NVLink, directly or through other GPUs (a connected component of two or more)."""
    domain: Mapping[int, int]
    """A group in which every two GPUs are linked directly: an NVSwitch fabric, a bridged pair, a fully
    meshed board. Two GPUs with one domain id talk over NVLink without a hop through a third GPU."""


def nvlink_cliques(topology: Topology) -> Cliques:
    n = topology.gpu_count
    links = topology.nvlink
    peers = [[b for b in range(n) if links[a][b] > 0] for a in range(n)]
    group: dict[int, int] = {}
    for start in range(n):
        if start in group or not peers[start]:
            continue
        stack, members = [start], {start}
        while stack:
            for b in peers[stack.pop()]:
                if b not in members:
                    members.add(b)
                    stack.append(b)
        for g in members:
            group[g] = start
    domain: dict[int, int] = {}
    for head in set(group.values()):
        component = [g for g in range(n) if group.get(g) == head]
        if all(links[a][b] > 0 for a in component for b in component if a != b):
            for g in component:
                domain[g] = head

    def strongest(a: int) -> int | None:
        if not peers[a]:
            return None
        top = max(links[a][b] for b in peers[a])
        best = [b for b in peers[a] if links[a][b] == top]
        return best[0] if len(best) == 1 else None

    pair: dict[int, int] = {}
    for a in range(n):
        peer = strongest(a)
        if peer is not None and strongest(peer) == a:
            pair[a] = min(a, peer)
    return Cliques(pair, group, domain)


def semver(text: str) -> str:
    """A version NVML reports ("570.133.20", "12.8", "535.104.05") as semantic version 2.0 text ("12.8.0",
    "535.104.5"), as NVIDIA's driver publishes it."""
    parts = [str(int(p)) for p in text.split(".")[:3]]
    return ".".join(parts + ["0"] * (3 - len(parts)))


def _multiprocessors(gpu: GpuInfo) -> int | None:
    model = next((m for m in MODELS.values() if m.nvml_name == gpu.name), None)
    return model.multiprocessor_count if model is not None else None


def mib_quantity(mib: int) -> str:
    """`mib` MiB as the API server writes the quantity back (its canonical binary form: the largest suffix that
    keeps the number whole, 81920Mi as 80Gi), so that a slice read back compares equal to the one wanted."""
    value, suffixes = mib, ["Mi", "Gi", "Ti", "Pi", "Ei"]
    if value == 0:
        return "0"
    while value % 1024 == 0 and len(suffixes) > 1:
        value //= 1024
        suffixes.pop(0)
    return f"{value}{suffixes[0]}"


def device_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}"


def replica_name(gpu: GpuInfo, replica: int) -> str:
    """gpu-<index>-replica-<n>, n from 0: one of the shares of a GPU."""
    return f"gpu-{gpu.index}-replica-{replica}"


def shared_gpus(state: NodeState) -> dict[str, int]:
    """The whole GPUs the sharing config in force shares (sharing.timeSlicing or sharing.mps, by the device
    plugin's rules), by UUID, with their replica counts."""
    strategy = state.config.sharing.strategy
    if strategy == "mps":
        return {g.uuid: replicas for g, replicas in mps_shared_gpus(state)}
    if strategy != "time-slicing":
        return {}
    return {d.gpu_uuid: d.replicas for r in plan(state).resources.values() for d in r.devices
            if d.shared and d.kind == "gpu"}


def mps_waiting(state: NodeState) -> set[str]:
    """The GPUs MPS shares whose control daemon is not up: their replicas would not work yet."""
    if state.config.sharing.strategy != "mps":
        return set()
    return {g.uuid for g, _ in mps_shared_gpus(state) if state.mps.get(g.uuid) != ""}


def held_gpus(state: NodeState) -> set[str]:
    """The GPUs the slice leaves out because pods hold them, or one of their MIG devices, through the mode the
    node left (`state.held`, agent/handover.py); every GPU while that is not known yet (`state.handover`)."""
    if state.handover:
        return {g.uuid for g in state.inventory.gpus}
    if not state.held:
        return set()
    by_index = {g.index: g.uuid for g in state.inventory.gpus}
    return {g.uuid for g in state.inventory.gpus if g.uuid in state.held} | {
        by_index[m.parent_index] for m in state.inventory.mig_devices
        if m.uuid in state.held and m.parent_index in by_index}


def published_gpus(state: NodeState, taints: bool = False) -> list[GpuInfo]:
    """The whole GPUs the slice carries (whole or as replicas): not draining, not cordoned, not MIG-enabled, not
    waiting for their MPS daemon, not held through the mode the node left, and healthy unless unhealthy ones are
    published with a taint (`taints`); never a lost GPU of which nothing was ever read (it has no attributes to
    publish)."""
    waiting = mps_waiting(state)
    held = held_gpus(state)
    return [g for g in state.inventory.gpus
            if (taints or state.gpu_health(g.uuid).healthy) and g.uuid not in state.draining and not g.mig_enabled
            and g.uuid not in state.cordoned and g.uuid not in waiting and g.uuid not in held and not g.unread]


def mig_device_name(mig: MigInfo) -> str:
    """gpu-<parent index>-mig-<GPU instance id>-<compute instance id>."""
    return f"gpu-{mig.parent_index}-mig-{mig.gpu_instance_id}-{mig.compute_instance_id}"


def published_migs(state: NodeState, taints: bool = False) -> list[tuple[GpuInfo, MigInfo]]:
    """The MIG devices the slice carries, with their GPU: those of MIG-enabled GPUs whose layout is not being
    changed and that are not cordoned, that are not held through the mode the node left, and that are healthy
    unless unhealthy ones are published with a taint (`taints`)."""
    held = set() if state.handover else state.held
    parents = {g.index: g for g in state.inventory.gpus
               if g.mig_enabled and (taints or state.gpu_health(g.uuid).healthy) and g.uuid not in state.draining
               and g.uuid not in state.cordoned and not (state.handover or g.uuid in held)}
    return [(parents[m.parent_index], m) for m in state.inventory.mig_devices
            if m.parent_index in parents and m.uuid not in held]


def device_gpus(state: NodeState) -> dict[str, str]:
    """Every device name the node's inventory has (whole GPUs, their shared replicas and MIG devices),
    with its GPU's UUID."""
    named = {device_name(g): g.uuid for g in state.inventory.gpus}
    shared = shared_gpus(state)
    named.update({replica_name(g, n): g.uuid for g in state.inventory.gpus for n in range(shared.get(g.uuid, 0))})
    by_index = {g.index: g.uuid for g in state.inventory.gpus}
    named.update({mig_device_name(m): by_index[m.parent_index] for m in state.inventory.mig_devices
                  if m.parent_index in by_index})
    return named


def published_names(state: NodeState) -> list[str]:
    """The names of the devices the slice carries where unhealthy ones stay in (the layout's, not draining)."""
    shared = shared_gpus(state)
    return [*(name for g in published_gpus(state, taints=True)
              for name in ([replica_name(g, n) for n in range(shared[g.uuid])] if g.uuid in shared
                           else [device_name(g)])),
            *(mig_device_name(m) for _, m in published_migs(state, taints=True))]


def taint_key(driver: str) -> str:
    """The key of the device taint an unhealthy GPU and its MIG devices carry."""
    return f"{driver}/unhealthy"


def label_value(text: str) -> str:
    """`text` as a label value: lower case, runs of other characters as one '-', at most 63 characters."""
    value = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return value[:63].rstrip("-")


def health_taints(health: DeviceHealth, driver: str) -> list[dict[str, str]]:
    """The device taints of a GPU in this health: none when healthy; else one `<driver>/unhealthy` taint whose
    value is the reason, with effect NoExecute for a node-fatal fault (the pods using it cannot run on) and
    NoSchedule otherwise."""
    if health.healthy:
        return []
    return [{"key": taint_key(driver), "value": label_value(health.reason),
             "effect": "NoExecute" if health.node_fatal else "NoSchedule"}]


def gpu_attributes(gpu: GpuInfo, state: NodeState, cliques: Cliques,
                   pcie_root: PcieRootLookup) -> dict[str, dict[str, Any]]:
    """The attributes a GPU and its MIG devices share: the model, the driver, where the GPU sits."""
    driver = state.inventory.driver
    major, minor = gpu.compute_capability
    attributes: dict[str, dict[str, Any]] = {
        "productName": {"string": gpu.name},
        **({"brand": {"string": BRAND_NAMES[gpu.brand]}} if gpu.brand in BRAND_NAMES else {}),
        "architecture": {"string": ARCHITECTURE_NAMES.get(gpu.architecture, gpu.architecture.capitalize())},
        "cudaComputeCapability": {"version": f"{major}.{minor}.0"},
        "driverVersion": {"version": semver(driver.version)},
        "cudaDriverVersion": {"version": semver(driver.cuda)},
        STANDARD_PCI_BUS_ID: {"string": short_bus_id(gpu.pci_bus_id)},
    }
    root = pcie_root(gpu.pci_bus_id)
    if root is not None:
        attributes[STANDARD_PCIE_ROOT] = {"string": root}
    if gpu.numa_node is not None:
        attributes["numaNode"] = {"int": gpu.numa_node}
    for name, ids in (("nvlinkPair", cliques.pair), ("nvlinkGroup", cliques.group),
                      ("nvlinkDomain", cliques.domain)):
        if gpu.index in ids:
            attributes[name] = {"int": ids[gpu.index]}
    if gpu.fabric is not None and gpu.fabric.attached:
        attributes["clique"] = {"string": gpu.fabric.clique}
    return attributes


def channel_name(channel: int) -> str:
    """channel-<id>: an IMEX channel, named as NVIDIA's DRA driver names its channel devices."""
    return f"channel-{channel}"


def published_channels(state: NodeState) -> list[int]:
    """The IMEX channels the slice offers: those imex.channelIDs asks for whose device nodes the node has."""
    return [c for c in state.config.imex.channel_ids if c in state.inventory.imex_channels]


def channel_device(channel: int, clique: str | None) -> dict[str, Any]:
    """An IMEX channel as a device: `type` channel and `id` its number, as NVIDIA's DRA driver publishes them,
    and the node's `clique` where its fabric-attached GPUs share one."""
    attributes: dict[str, dict[str, Any]] = {"type": {"string": "channel"}, "id": {"int": channel}}
    if clique is not None:
        attributes["clique"] = {"string": clique}
    return {"name": channel_name(channel), "attributes": attributes}


def gpu_device(gpu: GpuInfo, state: NodeState, cliques: Cliques, pcie_root: PcieRootLookup) -> dict[str, Any]:
    attributes: dict[str, dict[str, Any]] = {
        "type": {"string": "gpu"}, "uuid": {"string": gpu.uuid}, "index": {"int": gpu.index},
        "minor": {"int": gpu.minor}, **gpu_attributes(gpu, state, cliques, pcie_root)}
    capacity: dict[str, dict[str, str]] = {"memory": {"value": mib_quantity(gpu.memory_mib)}}
    sms = _multiprocessors(gpu)
    if sms is not None:
        capacity["multiprocessors"] = {"value": str(sms)}
    return {"name": device_name(gpu), "attributes": attributes, "capacity": capacity}


def replica_devices(gpu: GpuInfo, replicas: int, state: NodeState, cliques: Cliques, pcie_root: PcieRootLookup
                    ) -> list[dict[str, Any]]:
    """The shares of a GPU: each the GPU's attributes and capacity with `type` shared, `sharing` (time-slicing
    or mps), `replica` (which share) and `replicas` (how many)."""
    whole = gpu_device(gpu, state, cliques, pcie_root)
    listed = []
    for n in range(replicas):
        attributes = {**whole["attributes"], "type": {"string": "shared"},
                      "sharing": {"string": state.config.sharing.strategy}, "replica": {"int": n},
                      "replicas": {"int": replicas}}
        listed.append({"name": replica_name(gpu, n), "attributes": attributes, "capacity": dict(whole["capacity"])})
    return listed


def mig_device(gpu: GpuInfo, mig: MigInfo, state: NodeState, cliques: Cliques, pcie_root: PcieRootLookup
               ) -> dict[str, Any]:
    attributes: dict[str, dict[str, Any]] = {
        "type": {"string": "mig"}, "uuid": {"string": mig.uuid}, "profile": {"string": mig.profile},
        "parentUUID": {"string": gpu.uuid}, "parentIndex": {"int": gpu.index}, "parentMinor": {"int": gpu.minor},
        "placementStart": {"int": mig.placement_start}, "placementSize": {"int": mig.placement_size},
        **gpu_attributes(gpu, state, cliques, pcie_root)}
    counts = {"multiprocessors": mig.multiprocessors, "copyEngines": mig.copy_engines, "decoders": mig.decoders,
              "encoders": mig.encoders, "jpegEngines": mig.jpegs, "ofaEngines": mig.ofas}
    capacity = {"memory": {"value": mib_quantity(mig.memory_mib)}, **{k: {"value": str(v)} for k, v in counts.items()}}
    return {"name": mig_device_name(mig), "attributes": attributes, "capacity": capacity}


MEMORY, COMPUTE = "memory", "compute"
"""The capacities a GPU shared by capacity offers: bytes of memory, percent of the SMs."""

_SUFFIXES: dict[str, int | Fraction] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_value(text: str) -> int:
    """A Kubernetes quantity ("20Gi", "25", "21474836480", "1.5G", "1e3") as a whole number, rounded up;
    ValueError for text that is not one."""
    found = re.fullmatch(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E))?",
                         text.strip())
    if found is None:
        raise ValueError(f"{text!r} is not a quantity")
    number, exponent, suffix = found.groups()
    scale = Fraction(f"1{exponent}") if exponent else Fraction(_SUFFIXES[suffix] if suffix else 1)
    return math.ceil(Fraction(number) * scale)


def capacity_gpus(state: NodeState, capacity: bool) -> set[str]:
    """The GPUs published as one device shared by capacity: with `capacity` (dra.sharedCapacity on and kept by
    the API server), those MPS shares."""
    if not capacity or not state.config.dra.shared_capacity.enabled:
        return set()
    return {g.uuid for g, _ in mps_shared_gpus(state)}


def capacity_device(gpu: GpuInfo, state: NodeState, cliques: Cliques, pcie_root: PcieRootLookup) -> dict[str, Any]:
    """An MPS-shared GPU as one device that several claims share (allowMultipleAllocations): the GPU's attributes
    with `type` shared and `sharing` mps, and the capacities `memory` (the GPU's, in steps of
    dra.sharedCapacity.memoryStepMiB from one step; a claim that does not ask gets all of it that the steps
    reach) and `compute` (100, percent of the SMs, in steps of computeStepPercent; a claim that does not ask
    consumes none and gets no thread limit). The rest of the GPU's capacities are left out: claims do not
    consume them."""
    settings = state.config.dra.shared_capacity
    whole = gpu_device(gpu, state, cliques, pcie_root)
    step = max(1, min(settings.memory_step_mib, gpu.memory_mib // 2))  # the API wants min + step <= value
    attributes = {**whole["attributes"], "type": {"string": "shared"}, "sharing": {"string": "mps"}}
    capacity = {
        MEMORY: {"value": mib_quantity(gpu.memory_mib), "requestPolicy": {
            "default": mib_quantity(gpu.memory_mib // step * step),
            "validRange": {"min": mib_quantity(step), "step": mib_quantity(step)}}},
        COMPUTE: {"value": "100", "requestPolicy": {
            "default": "0", "validRange": {"min": "0", "step": str(settings.compute_step_percent)}}},
    }
    return {"name": device_name(gpu), "attributes": attributes, "capacity": capacity,
            "allowMultipleAllocations": True}


def slice_name(node: str, driver: str) -> str:
    """The slice's object name: the node and the driver, a DNS subdomain of at most 253 characters."""
    return f"{node}-{driver}"[:253].rstrip("-.")


def slice_spec(state: NodeState, node: str, driver: str, generation: int,
               pcie_root: PcieRootLookup = lambda bus_id: None, taints: bool = False,
               capacity: bool = False) -> dict[str, Any]:
    """The spec of the node's one ResourceSlice for `state`, at pool generation `generation`. With `taints`
    (the API server keeps device taints: DRADeviceTaints) the devices of unhealthy GPUs stay in the slice
    with a taint; without, they are left out. With `capacity` (the API server keeps consumable capacity:
    DRAConsumableCapacity) and dra.sharedCapacity, an MPS-shared GPU is one device shared by capacity rather
    than its replicas."""
    cliques = nvlink_cliques(topology_of(state.inventory))
    shared = shared_gpus(state)
    by_capacity = capacity_gpus(state, capacity)

    def of_gpu(g: GpuInfo) -> list[dict[str, Any]]:
        if g.uuid in by_capacity:
            return [capacity_device(g, state, cliques, pcie_root)]
        if g.uuid in shared:
            return replica_devices(g, shared[g.uuid], state, cliques, pcie_root)
        return [gpu_device(g, state, cliques, pcie_root)]

    devices = [*((g, d) for g in published_gpus(state, taints) for d in of_gpu(g)),
               *((g, mig_device(g, m, state, cliques, pcie_root)) for g, m in published_migs(state, taints))]
    for gpu, device in devices:
        if found := health_taints(state.gpu_health(gpu.uuid), driver):
            device["taints"] = found
    clique = node_clique(state.inventory.gpus).value
    channels = [channel_device(c, clique) for c in published_channels(state)]
    return {
        "driver": driver,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "devices": [*(device for _, device in devices), *channels],
    }


MAX_DEVICES = 128
"""The most devices a ResourceSlice takes (resource/v1 ResourceSliceMaxDevices)."""
MAX_DEVICES_TAINTED = 64
"""The most where any device has taints or consumes counters (ResourceSliceMaxDevicesWithTaintsOrConsumesCounters,
from 1.35; 128 in 1.34)."""


def split_slice(name: str, spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One slice's spec as the slices the API takes, as (object name, spec): the devices in order, MAX_DEVICES a
    slice, or MAX_DEVICES_TAINTED where any of them has taints or consumes counters; the first keeps `name`,
    the others are `<name>-1`, `<name>-2`... Each has the pool of `spec`; resourceSliceCount is the caller's."""
    devices = spec.get("devices") or []
    limit = MAX_DEVICES_TAINTED if any(d.get("taints") or d.get("consumesCounters") for d in devices) else MAX_DEVICES
    if len(devices) <= limit:
        return [(name, spec)]
    chunks = [devices[i:i + limit] for i in range(0, len(devices), limit)]
    return [(name if n == 0 else f"{name[:253 - len(str(n)) - 1].rstrip('-.')}-{n}",
             {**spec, "pool": dict(spec["pool"]), "devices": chunk}) for n, chunk in enumerate(chunks)]


def pool_slices(state: NodeState, node: str, driver: str, generation: int,
                pcie_root: PcieRootLookup = lambda bus_id: None, taints: bool = False, capacity: bool = False
                ) -> list[tuple[str, dict[str, Any]]]:
    """The node's slices for `state` (slice_spec split at the API's limits, split_slice), each with
    resourceSliceCount the number of them."""
    found = split_slice(slice_name(node, driver),
                        slice_spec(state, node, driver, generation, pcie_root, taints, capacity))
    for _, spec in found:
        spec["pool"]["resourceSliceCount"] = len(found)
    return found


def plugin_resources(names: Iterable[str] | Mapping[str, Resource], dra: bool, dynamic_mig: bool = False) -> set[str]:
    """The resources the device plugin serves: in DRA mode whole GPUs are the DRA driver's, not nvidia.com/gpu's,
    and so are their shared replicas (time-sliced or MPS) under any name (given the plan's resources, by name);
    with dra.dynamicMig (`dynamic_mig`) the MIG devices are the DRA driver's too (it makes them for its claims)."""
    if not dra:
        return set(names)
    kinds = {"gpu", "mig"} if dynamic_mig else {"gpu"}
    return {n for n in names if n != GPU_RESOURCE and not (
        isinstance(names, Mapping) and any(d.kind in kinds for d in names[n].devices))}
