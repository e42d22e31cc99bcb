"""NodePrepareResources and NodeUnprepareResources of the DRA kubelet plugin, whatever the gRPC version:
`Preparer` reads each claim from the API server, keeps its results for this driver and node, applies the
driver's opaque config (opaque.py), adds the MPS client's edits for a claim of MPS replicas, makes the MIG
device of an allocated placement with dra.dynamicMig (dynamic.py), writes the claim's CDI spec and records it in
the `ClaimStore` (claims.py); unprepare removes them. It also says which devices the prepared claims hold, for
the MIG manager's busy check."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.dra.cdi import cdi_id, claim_device_name, claim_spec, gpu_device_name, imex_channel_node
from agent.dra.claims import ClaimError, ClaimReader, ClaimStore, Prepared
from agent.dra.dynamic import DynamicMig, DynamicMigError
from agent.dra.opaque import ConfigProblem, device_env
from agent.dra.slices import channel_name, mig_device_name, published_channels, replica_name, shared_gpus
from agent.mps_client import mps_client
from agent.podresources import CLAIM, DeviceHolder
from agent.state import StateBus

log = logging.getLogger("agent.dra.plugin")
"""The plugin's lines keep the logger name they have always had."""


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

    async def prepare(self, namespace: str, uid: str, name: str) -> list[Prepared]:
        done = self._store.get(uid)
        if done is not None:
            return done
        claim = await self._claims.claim(namespace, name)
        where = f"claim {namespace}/{name}"
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
        for result in results:
            device = str(result.get("device"))
            if device not in known:
                raise ClaimError(f"{where}: device {device} is not a device of node {self.node}")
            picked.setdefault(device, []).append(str(result.get("request")))
        try:
            env = device_env(self.driver, (allocation.get("devices") or {}).get("config") or [], picked)
        except ConfigProblem as err:
            raise ClaimError(f"{where}: {err}") from None
        known.update(await self._make_dynamic(where, uid, sorted(picked)))
        listed = [(device, *known[device]) for device in sorted(picked)]
        try:
            edits = self._mps_edits(where, sorted(picked))
        except ClaimError:
            await self.release(uid)
            raise
        spec = claim_spec(self.driver, uid, listed, self._control_nodes, self._dev_root, env, edits)
        shared = cdi_id(self.driver, claim_device_name(uid))
        prepared = [Prepared(tuple(picked[device]), self.node, device,
                             (cdi_id(self.driver, gpu_device_name(uid, device)), shared))
                    for device, _, _ in listed]
        self._store.put(uid, namespace, name, prepared, spec)
        self._on_change()
        log.info("prepared %s (%s): %s", where, uid, ", ".join(device for device, _, _ in listed) or "no devices")
        return prepared

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
                await self.release(uid)
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

    def _mps_edits(self, where: str, devices: list[str]) -> dict[str, Any]:
        """For a claim of MPS replicas, what its containers need to be one client of the GPU's MPS control
        daemon (as the device plugin's Allocate gives): the daemon's pipe and log directories and /dev/shm,
        and the client's share of the threads and the memory. A claim of replicas of two GPUs, or of replicas
        and other devices, is refused: one client joins one daemon."""
        state = self._bus.current
        if state.config.sharing.strategy != "mps":
            return {}
        shared = shared_gpus(state)
        replicas = {replica_name(g, n): g for g in state.inventory.gpus for n in range(shared.get(g.uuid, 0))}
        chosen = [d for d in devices if d in replicas]
        if not chosen:
            return {}
        gpus = {replicas[d].uuid: replicas[d] for d in chosen}
        if len(gpus) > 1 or len(chosen) < len(devices):
            raise ClaimError(f"{where}: MPS replicas of {len(gpus)} GPU(s) and {len(devices) - len(chosen)} other "
                             "device(s) cannot share one MPS client; ask for replicas of one GPU only")
        (gpu,) = gpus.values()
        client = mps_client(state.config.flags.mps_root, gpu.uuid, gpu.memory_mib, len(chosen), shared[gpu.uuid])
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
        return [DeviceHolder(entry["namespace"], entry["name"], "", CLAIM, uuid)
                for entry in self._store.claims.values() for d in entry["devices"]
                if (uuid := known.get(d["device"], ("", []))[0])]

    def unprepare(self, uid: str) -> None:
        known = self._store.get(uid) is not None
        self._store.remove(uid)
        if known:
            log.info("unprepared claim %s", uid)
            self._on_change()
