"""Per-GPU cordon: an operator takes GPUs out of service with one annotation on the Node,

    kubectl annotate node NODE gpu-node-agent.io/cordon=3,GPU-5c1f...     (NVML indices or GPU UUIDs)
    kubectl annotate node NODE gpu-node-agent.io/cordon-                  (every GPU back)

and the agent gives no new pod those GPUs, their MIG devices or their replicas, in either mode, while the pods that
hold them run on. The reconciler reads the annotation into `NodeState.cordon_request`; `Cordons` (a producer) turns
it into `NodeState.cordoned` and, while any GPU is cordoned, reads which pods still hold each
(`NodeState.cordon_holders`), with an Event at each change. A value that names something the node does not have is
refused whole in one line and an Event, and the GPUs cordoned before stay so.

The set in force is also kept in the state directory (`cordon.json`, beside `gpus.json`), so that an agent that
starts again withholds the same GPUs from its first ListAndWatch list on, before it has read its Node."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from agent.inventory import PlanCache
from agent.nvml.records import NodeInventory
from agent.podresources import CLAIM, DeviceHolder, PodResourcesUnavailable, allocations
from agent.state import NodeState, StateBus
from agent.yamlfile import InputFileError, read_text_file, write_atomically

log = logging.getLogger(__name__)

CORDON_ANNOTATION = "gpu-node-agent.io/cordon"
"""The operator's mark: GPUs by NVML index or UUID, separated by commas or spaces. The agent never writes it."""
CORDON_STATE_ANNOTATION = "gpu-node-agent.io/cordon.state"
"""The agent's answer on the Node: each cordoned GPU and the pods that still hold it."""
MAX_CORDON_CHARS = 8192
"""The longest mark read (a 64-GPU node's UUIDs take about 2,600 characters)."""
CORDON_FILE = "cordon.json"
MAX_CORDON_FILE_BYTES = 64 * 1024
POLL_S = 2.0
"""How often the pods holding cordoned GPUs are read again while any GPU is cordoned (a local call)."""
RETRY_MAX_S = 30.0


class CordonError(ValueError):
    """The mark names something this node does not have, or is not a list of GPUs."""


def parse_cordon(value: str, inventory: NodeInventory) -> frozenset[str]:
    """The GPU UUIDs `value` names: NVML indices ("3") and GPU UUIDs ("GPU-..."), separated by commas and/or
    whitespace; "" names none. CordonError, naming every item that is wrong, when any is."""
    if len(value) > MAX_CORDON_CHARS:
        raise CordonError(f"is {len(value)} characters long, at most {MAX_CORDON_CHARS}")
    by_index = {str(g.index): g.uuid for g in inventory.gpus}
    uuids = {g.uuid for g in inventory.gpus}
    migs = {m.uuid for m in inventory.mig_devices}
    wanted: set[str] = set()
    wrong: list[str] = []
    for item in (t for t in re.split(r"[\s,]+", value) if t):
        shown = item if len(item) <= 64 else item[:64] + "..."
        if item.isdigit() and item.isascii():
            if item in by_index:
                wanted.add(by_index[item])
            else:
                wrong.append(f"{shown!r} is no GPU's NVML index here (0 to {len(inventory.gpus) - 1})")
        elif item in uuids:
            wanted.add(item)
        elif item in migs:
            wrong.append(f"{shown!r} is a MIG device: cordon its GPU")
        elif item.startswith("GPU-"):
            wrong.append(f"{shown!r} is no GPU of this node")
        else:
            wrong.append(f"{shown!r} is neither an NVML index nor a GPU UUID")
        if len(wrong) == 3:
            break
    if wrong:
        raise CordonError("; ".join(wrong))
    return frozenset(wanted)


def describe(state: NodeState, uuids: Collection[str]) -> str:
    """'GPU 3' or 'GPUs 3, 5' for these UUIDs, in index order."""
    indices = sorted(g.index for g in state.inventory.gpus if g.uuid in uuids)
    return f"GPU {indices[0]}" if len(indices) == 1 else f"GPUs {', '.join(map(str, indices))}"


def cordon_report(state: NodeState) -> str:
    """The Node's gpu-node-agent.io/cordon.state: each cordoned GPU, by index and UUID, and who holds it;
    "" when none is cordoned."""
    parts = []
    for gpu in state.inventory.gpus:
        if gpu.uuid in state.cordoned:
            held = state.cordon_holders.get(gpu.uuid)
            who = "holders not known" if held is None else (f"held by {', '.join(held)}" if held else "free")
            parts.append(f"GPU {gpu.index} ({gpu.uuid}): {who}")
    return "; ".join(parts)


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: StrictInt = Field(ge=1, le=1)
    cordoned: list[StrictStr] = Field(max_length=1024)


def load_cordoned(path: Path, inventory: NodeInventory) -> frozenset[str]:
    """The cordoned GPUs an earlier agent kept in `path` that this node still has; none (with one warning) when
    the file is missing, unreadable or not the agent's."""
    try:
        data = _File.model_validate(json.loads(read_text_file(path, MAX_CORDON_FILE_BYTES)))
    except FileNotFoundError:
        return frozenset()
    except (InputFileError, OSError, ValueError, ValidationError) as err:
        log.warning("cordoned GPUs from %s not used (the Node's %s annotation decides once read): %s", path,
                    CORDON_ANNOTATION, str(err).splitlines()[0])
        return frozenset()
    known = {g.uuid for g in inventory.gpus}
    return frozenset(u for u in data.cordoned if u in known)


def save_cordoned(path: Path, cordoned: Collection[str]) -> None:
    write_atomically(path, json.dumps({"format": 1, "cordoned": sorted(cordoned)}, indent=1) + "\n")


def holders_by_gpu(state: NodeState, plans: PlanCache, found: list[DeviceHolder]) -> dict[str, tuple[str, ...]]:
    """Who holds each cordoned GPU: a device ID the device plugin gave (a UUID or an index, a replica counting for
    its device) or a claim's GPU or MIG UUID, mapped to its GPU; each pod or claim once, sorted."""
    gpu_of: dict[str, str] = {g.uuid: g.uuid for g in state.inventory.gpus}
    by_index = {g.index: g.uuid for g in state.inventory.gpus}
    gpu_of.update({m.uuid: by_index[m.parent_index] for m in state.inventory.mig_devices
                   if m.parent_index in by_index})
    for resource in plans(state).resources.values():
        gpu_of.update({d.id: d.gpu_uuid for d in resource.devices})
    held: dict[str, set[str]] = {uuid: set() for uuid in state.cordoned}
    for h in found:
        gpu = gpu_of.get(h.device_id) or gpu_of.get(h.device_id.split("::", 1)[0])
        if gpu in held:
            held[gpu].add(f"{CLAIM} {h.namespace}/{h.pod}" if h.resource == CLAIM else f"{h.namespace}/{h.pod}")
    return {uuid: tuple(sorted(who)) for uuid, who in held.items()}


class Cordons:
    """Keeps `NodeState.cordoned` and `NodeState.cordon_holders`; the Agent runs `run` as its cordon task (with an
    API server only: the mark is on the Node)."""

    def __init__(self, bus: StateBus, plans: PlanCache, claims: Callable[[], list[DeviceHolder]],
                 file: Path | None) -> None:
        self._bus = bus
        self._plans = plans
        self._claims = claims
        """The devices of the prepared DRA claims (none without the DRA kubelet plugin)."""
        self._file = file
        """Where the set in force is kept for the next start; None: not kept."""
        self._refused: tuple[str, NodeInventory] | None = None
        self._unreadable = ""

    async def run(self) -> None:
        delay = POLL_S
        while True:
            state = self._bus.current
            if state.cordon_request is not None:
                await self._follow_mark(state)
            state = self._bus.current
            if not state.cordoned:
                if state.cordon_holders:
                    await self._bus.update(cordon_holders={})
                await self._bus.wait_newer(state.version)
                continue
            ok = await self._read_holders(state)
            delay = POLL_S if ok else min(RETRY_MAX_S, delay * 2)
            # A new mark (or a new inventory) is acted on at once; otherwise the holders are read again.
            try:
                async with asyncio.timeout(delay):
                    while True:
                        newer = await self._bus.wait_newer(state.version)
                        if (newer.cordon_request, newer.inventory) != (state.cordon_request, state.inventory):
                            break
                        state = newer
            except TimeoutError:
                pass

    async def _follow_mark(self, state: NodeState) -> None:
        request = state.cordon_request
        assert request is not None
        try:
            wanted = parse_cordon(request, state.inventory)
        except CordonError as err:
            if self._refused != (request, state.inventory):
                self._refused = (request, state.inventory)
                stay = "stays" if len(state.cordoned) == 1 else "stay"
                kept = f"{describe(state, state.cordoned)} {stay} cordoned" if state.cordoned else "no GPU is cordoned"
                message = f"annotation {CORDON_ANNOTATION} refused: {err}; nothing changed ({kept})"
                log.warning("%s", message)
                await self._bus.record([("", "cordon-refused", message)])
            return
        self._refused = None
        if wanted == state.cordoned:
            return
        added, removed = wanted - state.cordoned, state.cordoned - wanted
        incidents = []
        if added:
            it = "it" if len(added) == 1 else "them"
            incidents.append(("", "cordoned", f"{describe(state, added)} cordoned ({CORDON_ANNOTATION}): no new pod "
                                              f"is given {it}; pods holding {it} run on"))
        if removed:
            incidents.append(("", "uncordoned", f"{describe(state, removed)} uncordoned: offered again"))
        for line in incidents:
            log.info("%s", line[2])
        holders = {u: h for u, h in state.cordon_holders.items() if u in wanted}
        await self._bus.record(incidents, cordoned=wanted, cordon_holders=holders)
        if self._file is not None:
            try:
                await asyncio.to_thread(save_cordoned, self._file, wanted)
            except OSError as err:
                log.warning("cannot keep the cordoned GPUs in %s for the next start: %s", self._file, err)

    async def _read_holders(self, state: NodeState) -> bool:
        """Read who holds the cordoned GPUs and publish a change, with an Event per GPU whose holders changed;
        False when the kubelet did not answer (the last reading stays)."""
        socket = state.config.mig.pod_resources_socket
        found = list(self._claims())
        try:
            if not socket.exists():
                raise PodResourcesUnavailable(f"no kubelet PodResources socket at {socket}")
            found += await allocations(socket)
        except PodResourcesUnavailable as err:
            if self._unreadable != str(err):
                self._unreadable = str(err)
                log.warning("cannot read which pods hold the cordoned GPUs (tried again): %s", err)
            return False
        if self._unreadable:
            log.info("the kubelet's PodResources answers again: the holders of cordoned GPUs are read")
            self._unreadable = ""
        holders = holders_by_gpu(state, self._plans, found)
        current = self._bus.current
        if current.cordoned != state.cordoned or dict(current.cordon_holders) == holders:
            return True
        await self._bus.record(self._changes(state, current.cordon_holders, holders), cordon_holders=holders)
        return True

    @staticmethod
    def _changes(state: NodeState, before: Mapping[str, tuple[str, ...]], after: dict[str, tuple[str, ...]]
                 ) -> list[tuple[str, str, str]]:
        incidents = []
        for gpu in state.inventory.gpus:
            now = after.get(gpu.uuid)
            if now is None or before.get(gpu.uuid) == now:
                continue
            if now:
                incidents.append((gpu.uuid, "cordon-held", f"cordoned GPU {gpu.index} is held by {', '.join(now)}"))
            else:
                incidents.append((gpu.uuid, "cordon-free", f"cordoned GPU {gpu.index} is free: no pod holds it"))
        return incidents
