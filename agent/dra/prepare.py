"""NodePrepareResources and NodeUnprepareResources of the DRA kubelet plugin, whatever the gRPC version:
`Preparer` reads each claim from the API server, keeps its results for this driver and node, applies the
driver's opaque config (opaque.py), adds the MPS client's edits for a claim of MPS replicas or of a share of an
MPS-shared GPU by capacity (with the memory and compute it was allocated), makes the MIG
device of an allocated placement with dra.dynamicMig (dynamic.py), writes the claim's CDI spec and records it in
the `ClaimStore` (claims.py); unprepare removes them. It also says which devices the prepared claims hold, for
the MIG manager's busy check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.dra.cdi import cdi_id, claim_device_name, claim_spec, gpu_device_name, imex_channel_node
from agent.dra.claims import ClaimError, ClaimReader, ClaimStore, Prepared
from agent.dra.dynamic import DynamicMig, DynamicMigError
from agent.dra.opaque import ConfigProblem, device_env
from agent.dra.slices import (
    COMPUTE,
    MEMORY,
    channel_name,
    device_name,
    mig_device_name,
    published_channels,
    quantity_value,
    replica_name,
    shared_gpus,
)
from agent.mps_client import MpsClient, mps_client, mps_client_limits
from agent.podresources import CLAIM, DeviceHolder
from agent.state import StateBus

REPLICA = re.compile(r"^(gpu-\d+)-replica-\d+$")
"""A replica's device name (slices.replica_name), its GPU's device name first."""

log = logging.getLogger("agent.dra.plugin")
"""The plugin's lines keep the logger name they have always had."""


class KeyedLock:
    """A lock per key, kept only while held or awaited."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class Preparer:
    """Prepares and unprepares claims on this node for one driver."""

    def __init__(self, store: ClaimStore, driver: str, node: str, bus: StateBus, claims: ClaimReader,
                 control_nodes: Sequence[str], dev_root: Path, on_change: Callable[[], None],
                 mig_minors: Mapping[str, int] | None = None, dynamic: DynamicMig | None = None) -> None:
        self._store = store
        self.driver = driver
        self.node = node
        self._bus = bus
        self._claims = claims
        self._control_nodes = tuple(control_nodes)
        self._dev_root = dev_root
        self._on_change = on_change
        """Called whenever a claim is prepared or unprepared."""
        self._mig_minors = dict(mig_minors or {})
        self._dynamic = dynamic
        """With dra.dynamicMig: makes the MIG device of an allocated placement (agent/dra/dynamic.py)."""
        self._locks = KeyedLock()
        """One prepare or unprepare of a claim at a time (by UID)."""

    async def prepare(self, namespace: str, uid: str, name: str) -> list[Prepared]:
        """Prepare claim `uid` (idempotent). Prepares and unprepares of one claim run one at a time, so an
        unprepare that arrives while a prepare waits for the API server is not undone by it. What changes the
        node runs under the node's prepare lock (`ClaimStore.serialized`), with the checkpoint as the other
        agent of a rolling update may have left it; the claim is read from the API server before, outside it."""
        async with self._locks.hold(uid):
            async with self._store.serialized():
                done = self._store.get(uid)
            if done is not None:
                return done
            claim = await self._claims.claim(namespace, name)
            async with self._store.serialized():
                return await self._prepare(namespace, uid, name, claim)

    async def _prepare(self, namespace: str, uid: str, name: str, claim: dict[str, Any] | None) -> list[Prepared]:
        done = self._store.get(uid)
        if done is not None:  # prepared meanwhile by the other agent of a rolling update
            return done
        if self._store.state(uid) is not None:  # a prepare cut short (PrepareStarted): undone, then done again
            await self._roll_back(uid)
        where = f"claim {namespace}/{name}"
        if not self._bus.current.config.dra.enabled:
            # Switched back to the device plugin (docs/dra.md, "Switching a node live"): it owns the GPUs now, and
            # a claim allocated from the slice before it was withdrawn would take one the device plugin gives out.
            raise ClaimError(f"{where}: the node is in device-plugin mode, its GPUs are the device plugin's; a claim "
                             "allocated before the switch is not prepared (delete its pod)")
        if claim is None:
            raise ClaimError(f"{where}: not found")
        if (claim.get("metadata") or {}).get("uid") != uid:
            raise ClaimError(f"{where}: the API server has UID {(claim.get('metadata') or {}).get('uid')}, "
                             f"the kubelet asked for {uid}")
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError(f"{where}: not allocated")
        results = [r for r in (allocation.get("devices") or {}).get("results") or []
                   if r.get("driver") == self.driver and r.get("pool") == self.node]
        known = self._devices()
        picked: dict[str, list[str]] = {}
        shares: set[str] = set()
        consumed: dict[str, dict[str, int]] = {}
        """By device allocated with consumable capacity: the capacity its results consumed, summed."""
        for result in results:
            device = str(result.get("device"))
            if device not in known:
                raise ClaimError(f"{where}: device {device} is not a device of node {self.node}")
            picked.setdefault(device, []).append(str(result.get("request")))
            if result.get("shareID"):
                shares.add(device)
            if isinstance(result.get("consumedCapacity"), dict):
                total = consumed.setdefault(device, {})
                for capacity, amount in result["consumedCapacity"].items():
                    try:
                        total[str(capacity)] = total.get(str(capacity), 0) + quantity_value(str(amount))
                    except ValueError:
                        raise ClaimError(f"{where}: device {device} consumed {capacity} {amount!r}, which is not "
                                         "a quantity") from None
        try:
            env = device_env(self.driver, (allocation.get("devices") or {}).get("config") or [], picked)
        except ConfigProblem as err:
            raise ClaimError(f"{where}: {err}") from None
        edits = self._mps_edits(where, sorted(picked), consumed)
        self._check_overlap(where, uid, sorted(picked), shares, known)
        shared = cdi_id(self.driver, claim_device_name(uid))
        prepared = [Prepared(tuple(picked[device]), self.node, device,
                             (cdi_id(self.driver, gpu_device_name(uid, device)), shared))
                    for device in sorted(picked)]
        # Checked and recorded with no await in between: no other claim can take these devices meanwhile.
        self._store.begin(uid, namespace, name, prepared)
        try:
            known.update(await self._make_dynamic(where, uid, sorted(picked)))
            listed = [(device, *known[device]) for device in sorted(picked)]
            spec = claim_spec(self.driver, uid, listed, self._control_nodes, self._dev_root, env, edits)
            self._store.complete(uid, prepared, spec)
        except (ClaimError, OSError) as err:
            await self._roll_back(uid)
            if isinstance(err, OSError):
                raise ClaimError(f"{where}: cannot write its CDI spec or the checkpoint: {err}") from None
            raise
        self._on_change()
        log.info("prepared %s (%s): %s", where, uid, ", ".join(sorted(picked)) or "no devices")
        return prepared

    def _check_overlap(self, where: str, uid: str, devices: list[str], shares: set[str],
                       known: Mapping[str, tuple[str, list[str]]]) -> None:
        """Refuse devices another claim holds (prepared or being prepared): the same device, or another name of
        the same GPU (a whole GPU and a replica of it, after a change of the sharing config). Replicas of one
        GPU are its shares, and a device allocated with a share ID (consumable capacity) is shared by design."""
        def gpu_uuid(device: str) -> str:
            """The GPU or MIG UUID of a device name, a replica's by its GPU even where the sharing config that
            made it is gone."""
            found = REPLICA.match(device)
            return known.get(found.group(1) if found else device, ("", []))[0]

        for other, entry in self._store.claims.items():
            if other == uid:
                continue
            for held in entry["devices"]:
                theirs = str(held["device"])
                their_uuid = gpu_uuid(theirs)
                for device in devices:
                    if device == theirs:
                        if device in shares:
                            continue
                    elif not (their_uuid and gpu_uuid(device) == their_uuid) or (
                            REPLICA.match(device) and REPLICA.match(theirs)):
                        continue
                    same = "" if device == theirs else f" (as {theirs}, the same GPU)"
                    raise ClaimError(f"{where}: device {device} is already prepared for claim "
                                     f"{entry['namespace']}/{entry['name']} ({other}){same}; it is given to one "
                                     "claim at a time")

    async def _roll_back(self, uid: str) -> None:
        """Undo a prepare that did not complete: its MIG devices destroyed, the claim forgotten, its CDI spec
        removed."""
        await self.release(uid)
        self._store.remove(uid)

    async def _make_dynamic(self, where: str, uid: str, devices: list[str]) -> dict[str, tuple[str, list[str]]]:
        """The MIG devices of the claim's allocated placements (dra.dynamicMig), made now: by device name, the
        MIG UUID and the device nodes (its GPU's and its capability nodes). One that cannot be made fails the
        claim, and the ones made for it are destroyed again."""
        if self._dynamic is None:
            return {}
        placements = self._dynamic.devices(self._bus.current)
        made: dict[str, tuple[str, list[str]]] = {}
        for device in devices:
            if device not in placements:
                continue
            try:
                mig = await self._dynamic.create(uid, placements[device])
            except DynamicMigError as err:
                raise ClaimError(f"{where}: {err}") from None
            gpu = f"gpu{mig.gpu_minor}/gi{mig.gpu_instance_id}"
            wanted = (f"{gpu}/access", f"{gpu}/ci{mig.compute_instance_id}/access")
            caps = [f"/dev/nvidia-caps/nvidia-cap{self._mig_minors[cap]}" for cap in wanted if cap in self._mig_minors]
            made[device] = (mig.uuid, [f"/dev/nvidia{mig.gpu_minor}", *caps])
        return made

    async def release(self, uid: str) -> None:
        """Destroy the MIG devices made for claim `uid` (dra.dynamicMig); DynamicMigError when one cannot be."""
        if self._dynamic is not None:
            released = await self._dynamic.release(uid)
            if released:
                log.info("destroyed the MIG device(s) of claim %s: %s", uid, ", ".join(released))

    def _mps_edits(self, where: str, devices: list[str], consumed: Mapping[str, Mapping[str, int]]
                   ) -> dict[str, Any]:
        """For a claim of MPS replicas, or of a share by capacity of an MPS-shared GPU (`consumed`: what it was
        allocated, by device), what its containers need to be one client of the GPU's MPS control daemon (as
        the device plugin's Allocate gives): the daemon's pipe and log directories and /dev/shm, and the
        client's share of the threads and the memory (by capacity: the memory and compute allocated). A claim of
        shares of two GPUs, or of shares and other devices, is refused: one client joins one daemon."""
        state = self._bus.current
        if state.config.sharing.strategy != "mps":
            return {}
        shared = shared_gpus(state)
        by_capacity = {device_name(g): g for g in state.inventory.gpus if g.uuid in shared}
        shares = [d for d in devices if d in by_capacity and d in consumed]
        if shares:
            if len(shares) > 1 or len(shares) < len(devices):
                raise ClaimError(f"{where}: MPS shares of {len(shares)} GPU(s) and {len(devices) - len(shares)} "
                                 "other device(s) cannot share one MPS client; ask for a share of one GPU only")
            (name,) = shares
            gpu = by_capacity[name]
            memory = consumed[name].get(MEMORY)
            client = mps_client_limits(state.config.flags.mps_root, gpu.uuid,
                                       gpu.memory_mib if memory is None else memory // 2**20,
                                       consumed[name].get(COMPUTE, 0) or 100)  # none asked: no thread limit
            return self._client_edits(client)
        replicas = {replica_name(g, n): g for g in state.inventory.gpus for n in range(shared.get(g.uuid, 0))}
        chosen = [d for d in devices if d in replicas]
        if not chosen:
            return {}
        gpus = {replicas[d].uuid: replicas[d] for d in chosen}
        if len(gpus) > 1 or len(chosen) < len(devices):
            raise ClaimError(f"{where}: MPS replicas of {len(gpus)} GPU(s) and {len(devices) - len(chosen)} other "
                             "device(s) cannot share one MPS client; ask for replicas of one GPU only")
        (gpu,) = gpus.values()
        return self._client_edits(
            mps_client(state.config.flags.mps_root, gpu.uuid, gpu.memory_mib, len(chosen), shared[gpu.uuid]))

    @staticmethod
    def _client_edits(client: MpsClient) -> dict[str, Any]:
        return {
            "env": [f"{name}={value}" for name, value in client.env],
            "mounts": [{"hostPath": host, "containerPath": inside, "options": ["rbind", "rw"]}
                       for inside, host in client.mounts],
        }

    def _devices(self) -> dict[str, tuple[str, list[str]]]:
        """Every device the slice can name, by device name: the UUID to make visible and its device nodes (for a
        time-sliced replica its GPU's; for a MIG device its GPU's and its capability nodes, as NVIDIA's device
        plugin passes them)."""
        state = self._bus.current
        inventory = state.inventory
        known = {f"gpu-{g.index}": (g.uuid, [f"/dev/nvidia{g.minor}"]) for g in inventory.gpus}
        shared = shared_gpus(state)
        for g in inventory.gpus:
            for n in range(shared.get(g.uuid, 0)):
                known[replica_name(g, n)] = known[f"gpu-{g.index}"]
        minors = {g.index: g.minor for g in inventory.gpus}
        for mig in inventory.mig_devices:
            gpu = f"gpu{minors[mig.parent_index]}/gi{mig.gpu_instance_id}"
            wanted = (f"{gpu}/access", f"{gpu}/ci{mig.compute_instance_id}/access")
            caps = [f"/dev/nvidia-caps/nvidia-cap{self._mig_minors[cap]}" for cap in wanted if cap in self._mig_minors]
            known[mig_device_name(mig)] = (mig.uuid, [f"/dev/nvidia{minors[mig.parent_index]}", *caps])
        if self._dynamic is not None:  # made at Prepare: the UUID and nodes are known only then
            known.update({name: ("", []) for name in self._dynamic.devices(state)})
        # An IMEX channel: no GPU to make visible, its device node (cdi.claim_spec adds NVIDIA_IMEX_CHANNELS).
        known.update({channel_name(c): ("", [imex_channel_node(c)]) for c in published_channels(state)})
        return known

    def holders(self) -> list[DeviceHolder]:
        """The devices of the prepared claims as the MIG manager counts who holds a GPU: one per device, by the
        UUID of its GPU or MIG device (a replica's is its GPU's), the claim where a pod would be named."""
        known = self._devices()
        self._store.refresh()  # the claims the other agent of a rolling update prepared count too
        return [DeviceHolder(entry["namespace"], entry["name"], "", CLAIM, uuid)
                for entry in self._store.claims.values() for d in entry["devices"]
                if (uuid := known.get(d["device"], ("", []))[0])]

    async def unprepare(self, uid: str) -> None:
        """Unprepare claim `uid` (idempotent): its MIG devices destroyed, then the claim forgotten and its CDI
        spec removed. DynamicMigError or OSError when that cannot be done; the kubelet retries."""
        async with self._locks.hold(uid), self._store.serialized():
            known = self._store.state(uid) is not None
            await self.release(uid)
            self._store.remove(uid)
        if known:
            log.info("unprepared claim %s", uid)
            self._on_change()

    async def recover(self) -> None:
        """At start, before the kubelet is served: roll back the prepares a crash cut short (the kubelet, which
        got no answer, prepares them again) and remove the CDI specs no claim of the checkpoint owns; one log
        line each. Under the node's prepare lock: a prepare the other agent of a rolling update has under way is
        not cut short, and one it left PrepareStarted was."""
        async with self._store.serialized():
            await self._recover()

    async def _recover(self) -> None:
        for uid in self._store.started():
            entry = self._store.claims[uid]
            where = f"claim {entry['namespace']}/{entry['name']} ({uid})" if entry["name"] else f"claim {uid}"
            try:
                await self._roll_back(uid)
            except (DynamicMigError, OSError) as err:
                log.warning("cannot roll back the prepare of %s that a restart cut short: %s; the kubelet's next "
                            "call tries again", where, err)
                continue
            log.info("rolled back the prepare of %s that a restart cut short; the kubelet prepares it again",
                     where)
        if not self._store.sweep_allowed:
            log.warning("removing no CDI spec or MIG device that no claim owns: a damaged checkpoint is kept "
                        "beside %s (remove the .corrupt file once the node's claims are unprepared)",
                        self._store.corrupt_copy.parent)
            return
        for path in self._store.orphan_specs():
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as err:
                log.warning("cannot remove CDI spec %s, which no prepared claim owns: %s", path, err.strerror)
                continue
            log.info("removed CDI spec %s: no prepared claim owns it", path)
