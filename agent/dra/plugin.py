"""The kubelet side of DRA mode: registration through the kubelet's plugin registration API, the DRA gRPC
service (v1 and v1beta1) and the DRA health service (v1 and v1alpha1).

A registration socket in the kubelet's plugins_registry directory answers GetInfo (a DRAPlugin named after the
driver, its endpoint, the services it serves) and NotifyRegistrationStatus (on success the ResourceSlice is
checked again: the kubelet deletes a driver's slices when the driver registers). The DRA socket answers
NodePrepareResources, which reads each claim from the API server, keeps its results for this driver and node,
applies this driver's opaque config from the class and the claim (agent/dra/opaque.py), writes one CDI spec
per claim and returns the CDI ids, and NodeUnprepareResources, which removes them. Both are idempotent; every
change is written to a checkpoint file before it is answered, so a restart in between loses nothing. The same
socket streams the health of every published or prepared device to the kubelet (NodeWatchResources).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from agent.deviceplugin.response import MPS_CONTAINER_ROOT, mps_log_dir, mps_pipe_dir
from agent.dra.cdi import cdi_id, claim_device_name, claim_spec, gpu_device_name
from agent.dra.dynamic import DynamicMig, DynamicMigError
from agent.dra.health_v1 import api_pb2 as health_v1_pb
from agent.dra.health_v1 import api_pb2_grpc as health_v1_grpc
from agent.dra.health_v1alpha1 import api_pb2 as health_pb
from agent.dra.health_v1alpha1 import api_pb2_grpc as health_grpc
from agent.dra.opaque import ConfigProblem, device_env
from agent.dra.pluginregistration import api_pb2 as reg
from agent.dra.pluginregistration import api_pb2_grpc as reg_grpc
from agent.dra.slices import device_gpus, mig_device_name, published_names, replica_name, shared_gpus
from agent.dra.v1 import api_pb2 as v1
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.dra.v1beta1 import api_pb2 as v1beta1
from agent.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent.podresources import CLAIM, DeviceHolder
from agent.state import StateBus
from agent.yamlfile import CheckpointError, read_checkpoint, write_atomically, write_checkpoint

log = logging.getLogger(__name__)

SUPPORTED_SERVICES = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
"""What GetInfo lists as supported versions: the gRPC services, newest first, as the kubelet names them. A 1.37
kubelet opens the health stream only for a plugin that lists a DRAResourceHealth service here (it prefers v1);
1.35 and 1.36 open it regardless, on v1alpha1; every release ignores the names it does not know."""
CHECKPOINT_VERSION = 1
HEALTH_RESEND_S = 10.0
"""The health stream sends the full list again at this interval when nothing changed: the kubelet takes a
device's health as Unknown 30 s after it last received it (healthTimeout, pkg/kubelet/cm/dra/healthinfo.go)."""


class ClaimReader(Protocol):
    async def claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class Paths:
    registration: Path
    """The registration socket in the kubelet's plugins_registry directory."""
    endpoint: Path
    """The DRA service's socket."""
    checkpoint: Path
    cdi_dir: Path

    @classmethod
    def under(cls, kubelet_root: Path, driver: str, cdi_dir: Path) -> Paths:
        plugin_dir = kubelet_root / "plugins" / driver
        return cls(kubelet_root / "plugins_registry" / f"{driver}-reg.sock", plugin_dir / "dra.sock",
                   plugin_dir / "checkpoint.json", cdi_dir)


@dataclass(frozen=True)
class Prepared:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimError(Exception):
    """A claim cannot be prepared; the message says why in one line."""


class ClaimStore:
    """The prepared claims by UID, in memory and in the checkpoint file, with their CDI spec files."""

    def __init__(self, paths: Paths, driver: str) -> None:
        self._paths = paths
        self._driver = driver
        self.claims: dict[str, dict[str, Any]] = {}
        self._load()

    def _load(self) -> None:
        try:
            self.claims = read_checkpoint(self._paths.checkpoint, "the DRA checkpoint", "claims", CHECKPOINT_VERSION)
        except CheckpointError as err:
            raise ClaimError(str(err)) from None

    def _save(self) -> None:
        write_checkpoint(self._paths.checkpoint, "claims", CHECKPOINT_VERSION, self.claims)

    def spec_path(self, uid: str) -> Path:
        return self._paths.cdi_dir / f"{self._driver.replace('/', '_')}-claim-{uid}.json"

    def get(self, uid: str) -> list[Prepared] | None:
        entry = self.claims.get(uid)
        if entry is None:
            return None
        return [Prepared(tuple(d["requests"]), d["pool"], d["device"], tuple(d["cdi"])) for d in entry["devices"]]

    def put(self, uid: str, namespace: str, name: str, devices: list[Prepared], spec: dict[str, Any]) -> None:
        write_atomically(self.spec_path(uid), json.dumps(spec, indent=2) + "\n")
        self.claims[uid] = {"namespace": namespace, "name": name, "devices": [
            {"requests": list(d.request_names), "pool": d.pool, "device": d.device, "cdi": list(d.cdi_ids)}
            for d in devices]}
        self._save()

    def remove(self, uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.spec_path(uid).unlink()
        if self.claims.pop(uid, None) is not None:
            self._save()


class DraKubeletPlugin:
    """Registration and DRA services on their unix sockets."""

    def __init__(self, paths: Paths, driver: str, node: str, bus: StateBus, claims: ClaimReader,
                 control_nodes: Sequence[str], dev_root: Path, on_registered: Callable[[], None],
                 mig_minors: Mapping[str, int] | None = None, dynamic: DynamicMig | None = None) -> None:
        self.paths = paths
        self._dynamic = dynamic
        """With dra.dynamicMig: makes the MIG device of an allocated placement (agent/dra/dynamic.py)."""
        self.driver = driver
        self.node = node
        self._bus = bus
        self._claims = claims
        self._control_nodes = tuple(control_nodes)
        self._mig_minors = dict(mig_minors or {})
        self._dev_root = dev_root
        self._on_registered = on_registered
        self.store = ClaimStore(paths, driver)
        self._server: grpc.aio.Server | None = None
        self.registrations = 0
        self.registration_error = ""
        self._claims_changed = asyncio.Event()
        """Set (and replaced) whenever a claim is prepared or unprepared: the health streams list prepared
        devices too."""
        self._health_since: dict[str, tuple[int, int]] = {}
        """Per device, the health last reported and since when (Unix seconds)."""

    async def start(self) -> None:
        for socket in (self.paths.registration, self.paths.endpoint):
            socket.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                socket.unlink()
        server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        v1_grpc.add_DRAPluginServicer_to_server(_DraV1(self), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(_DraV1beta1(self), server)
        health_grpc.add_DRAResourceHealthServicer_to_server(_Health(self), server)
        health_v1_grpc.add_DRAResourceHealthServicer_to_server(_HealthV1(self), server)
        # The endpoint first: by the time the kubelet sees the registration socket, the service answers.
        server.add_insecure_port(f"unix://{self.paths.endpoint}")
        server.add_insecure_port(f"unix://{self.paths.registration}")
        await server.start()
        self._server = server
        log.info("DRA plugin %s: registration socket %s, endpoint %s", self.driver, self.paths.registration,
                 self.paths.endpoint)

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        for socket in (self.paths.registration, self.paths.endpoint):
            with contextlib.suppress(FileNotFoundError):
                socket.unlink()

    def info(self) -> reg.PluginInfo:
        return reg.PluginInfo(type="DRAPlugin", name=self.driver, endpoint=str(self.paths.endpoint),
                              supported_versions=SUPPORTED_SERVICES)

    def registered(self, ok: bool, error: str) -> None:
        if ok:
            self.registrations += 1
            self.registration_error = ""
            log.info("registered DRA driver %s with the kubelet", self.driver)
            self._on_registered()
        else:
            self.registration_error = error
            log.error("the kubelet refused DRA driver %s: %s", self.driver, error)

    async def prepare(self, namespace: str, uid: str, name: str) -> list[Prepared]:
        done = self.store.get(uid)
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
        self.store.put(uid, namespace, name, prepared, spec)
        self._claims_change()
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
        share = len(chosen)
        root = state.config.flags.mps_root
        pipe, logs = MPS_CONTAINER_ROOT / "pipe", MPS_CONTAINER_ROOT / "log"
        return {
            "env": [f"CUDA_MPS_PIPE_DIRECTORY={pipe}", f"CUDA_MPS_LOG_DIRECTORY={logs}",
                    f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 * share // shared[gpu.uuid]}",
                    f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={gpu.memory_mib * share // shared[gpu.uuid]}M"],
            "mounts": [{"hostPath": str(host), "containerPath": str(inside), "options": ["rbind", "rw"]}
                       for host, inside in ((mps_pipe_dir(root, gpu.uuid), pipe), (mps_log_dir(root, gpu.uuid), logs),
                                            (root / "shm", Path("/dev/shm")))],
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
        return known

    def holders(self) -> list[DeviceHolder]:
        """The devices of the prepared claims as the MIG manager counts who holds a GPU: one per device, by the
        UUID of its GPU or MIG device (a replica's is its GPU's), the claim where a pod would be named."""
        known = self._devices()
        return [DeviceHolder(entry["namespace"], entry["name"], "", CLAIM, uuid)
                for entry in self.store.claims.values() for d in entry["devices"]
                if (uuid := known.get(d["device"], ("", []))[0])]

    def unprepare(self, uid: str) -> None:
        known = self.store.get(uid) is not None
        self.store.remove(uid)
        if known:
            log.info("unprepared claim %s", uid)
            self._claims_change()

    def _claims_change(self) -> None:
        changed, self._claims_changed = self._claims_changed, asyncio.Event()
        changed.set()

    def health(self) -> list[tuple[str, int, int]]:
        """The health of every device the slice carries (unhealthy ones included) and every prepared one, as
        (device name, HealthStatus, since when in Unix seconds): a device's GPU's health; Unknown for a
        prepared device the node no longer has (a MIG device of a replaced layout)."""
        state = self._bus.current
        gpus = device_gpus(state)
        if self._dynamic is not None:
            gpus.update(self._dynamic.device_gpus(state))
        names = set(published_names(state)) | {
            d.device for uid in self.store.claims for d in self.store.get(uid) or [] if d.pool == self.node}
        now = int(time.time())
        report: list[tuple[str, int, int]] = []
        for name in sorted(names):
            uuid = gpus.get(name)
            status: int = (health_pb.UNKNOWN if uuid is None else
                      health_pb.HEALTHY if state.gpu_health(uuid).healthy else health_pb.UNHEALTHY)
            last = self._health_since.get(name)
            if last is None or last[0] != status:
                last = self._health_since[name] = (status, now)
            report.append((name, status, last[1]))
        return report

    async def watch_health(self) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        """The health stream: the full list at once, again on every change and every HEALTH_RESEND_S."""
        sent: list[tuple[str, int, int]] | None = None
        last_sent = 0.0
        while True:
            state = self._bus.current
            claims_changed = self._claims_changed
            report = self.health()
            if report != sent or time.monotonic() - last_sent >= HEALTH_RESEND_S:
                yield health_pb.NodeWatchResourcesResponse(devices=[
                    health_pb.DeviceHealth(device=health_pb.DeviceIdentifier(pool_name=self.node, device_name=name),
                                           health=status, last_updated_time=since)  # type: ignore[arg-type]
                    for name, status, since in report])
                sent, last_sent = report, time.monotonic()
            newer = asyncio.ensure_future(self._bus.wait_newer(state.version))
            claims = asyncio.ensure_future(claims_changed.wait())
            try:
                await asyncio.wait({newer, claims}, timeout=max(0.0, HEALTH_RESEND_S - (time.monotonic() - last_sent)),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                newer.cancel()
                claims.cancel()


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def GetInfo(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        return self._plugin.info()

    async def NotifyRegistrationStatus(
            self, request: reg.RegistrationStatus, context: Any) -> reg.RegistrationStatusResponse:
        self._plugin.registered(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


class _Health(health_grpc.DRAResourceHealthServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def NodeWatchResources(
            self, request: health_pb.NodeWatchResourcesRequest, context: Any
    ) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        async for response in self._plugin.watch_health():
            yield response


class _HealthV1(health_v1_grpc.DRAResourceHealthServicer):
    """The same stream on the v1 service (Kubernetes 1.37), whose messages are v1alpha1's on the wire."""

    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def NodeWatchResources(
            self, request: health_v1_pb.NodeWatchResourcesRequest, context: Any
    ) -> AsyncIterator[health_v1_pb.NodeWatchResourcesResponse]:
        async for response in self._plugin.watch_health():
            yield health_v1_pb.NodeWatchResourcesResponse.FromString(response.SerializeToString())


async def _prepare_all(plugin: DraKubeletPlugin, claims: Any, pb: Any) -> Any:
    response = pb.NodePrepareResourcesResponse()
    for claim in claims:
        try:
            prepared = await plugin.prepare(claim.namespace, claim.uid, claim.name)
        except ClaimError as err:
            response.claims[claim.uid].error = str(err)
            log.warning("cannot prepare claim %s (%s): %s", f"{claim.namespace}/{claim.name}", claim.uid, err)
            continue
        except Exception as err:  # an API server error: the kubelet retries
            response.claims[claim.uid].error = f"claim {claim.namespace}/{claim.name}: {type(err).__name__}: {err}"
            log.warning("cannot prepare claim %s (%s): %s", f"{claim.namespace}/{claim.name}", claim.uid,
                        response.claims[claim.uid].error)
            continue
        for d in prepared:
            response.claims[claim.uid].devices.append(pb.Device(
                request_names=list(d.request_names), pool_name=d.pool, device_name=d.device,
                cdi_device_ids=list(d.cdi_ids)))
    return response


async def _unprepare_all(plugin: DraKubeletPlugin, claims: Any, pb: Any) -> Any:
    response = pb.NodeUnprepareResourcesResponse()
    for claim in claims:
        try:
            await plugin.release(claim.uid)
            plugin.unprepare(claim.uid)
            response.claims[claim.uid].error = ""
        except (DynamicMigError, OSError) as err:
            response.claims[claim.uid].error = f"claim {claim.namespace}/{claim.name}: {err}"
            log.warning("cannot unprepare claim %s (%s): %s", f"{claim.namespace}/{claim.name}", claim.uid, err)
    return response


class _DraV1(v1_grpc.DRAPluginServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def NodePrepareResources(
            self, request: v1.NodePrepareResourcesRequest, context: Any) -> v1.NodePrepareResourcesResponse:
        response: v1.NodePrepareResourcesResponse = await _prepare_all(self._plugin, request.claims, v1)
        return response

    async def NodeUnprepareResources(
            self, request: v1.NodeUnprepareResourcesRequest, context: Any) -> v1.NodeUnprepareResourcesResponse:
        response: v1.NodeUnprepareResourcesResponse = await _unprepare_all(self._plugin, request.claims, v1)
        return response


class _DraV1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def NodePrepareResources(
            self, request: v1beta1.NodePrepareResourcesRequest, context: Any
    ) -> v1beta1.NodePrepareResourcesResponse:
        response: v1beta1.NodePrepareResourcesResponse = await _prepare_all(self._plugin, request.claims, v1beta1)
        return response

    async def NodeUnprepareResources(
            self, request: v1beta1.NodeUnprepareResourcesRequest, context: Any
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        response: v1beta1.NodeUnprepareResourcesResponse = await _unprepare_all(self._plugin, request.claims, v1beta1)
        return response
