"""The kubelet side of DRA mode, its gRPC servers: registration through the kubelet's plugin registration API,
the DRA gRPC service (v1 and v1beta1) and the DRA health service (v1 and v1alpha1), on their unix sockets
(`DraKubeletPlugin`, which the composition root makes and starts).

A registration socket in the kubelet's plugins_registry directory answers GetInfo (a DRAPlugin named after the
driver, its endpoint, the services it serves) and NotifyRegistrationStatus (on success the ResourceSlice is
checked again: the kubelet deletes a driver's slices when the driver registers). The DRA socket answers
NodePrepareResources and NodeUnprepareResources for every claim the kubelet names, through prepare.py (which
reads the claim, writes its CDI spec and records it in the checkpoint of claims.py before it is answered, so a
restart in between loses nothing; both are idempotent, and one claim's run one at a time). Before it serves,
the plugin rolls back what a crash left half-done (Preparer.recover). The same socket streams the health of
every published or prepared device to the kubelet (NodeWatchResources, health.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from agent.dra.claims import ClaimError, ClaimReader, ClaimStore, Paths, Prepared
from agent.dra.dynamic import DynamicMig, DynamicMigError
from agent.dra.health import DeviceHealthStream, HealthV1, HealthV1alpha1
from agent.dra.health_v1 import api_pb2_grpc as health_v1_grpc
from agent.dra.health_v1alpha1 import api_pb2 as health_pb
from agent.dra.health_v1alpha1 import api_pb2_grpc as health_grpc
from agent.dra.pluginregistration import api_pb2 as reg
from agent.dra.pluginregistration import api_pb2_grpc as reg_grpc
from agent.dra.prepare import Preparer
from agent.dra.v1 import api_pb2 as v1
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.dra.v1beta1 import api_pb2 as v1beta1
from agent.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent.grpcserver import aio_server
from agent.podresources import DeviceHolder
from agent.state import StateBus

log = logging.getLogger(__name__)

MAX_FAILING = 1024
"""The most claims whose failing prepares are remembered (the oldest are forgotten first)."""

SUPPORTED_SERVICES = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
"""What GetInfo lists as supported versions: the gRPC services, newest first, as the kubelet names them. A 1.37
kubelet opens the health stream only for a plugin that lists a DRAResourceHealth service here (it prefers v1);
1.35 and 1.36 open it regardless, on v1alpha1; every release ignores the names it does not know."""

MAX_RECEIVE_BYTES = 4 * 1024 * 1024
"""The largest request the kubelet plugin's server takes (grpc's default, made explicit): the kubelet's
NodePrepareResources and NodeUnprepareResources name claims by namespace, name and uid, a few hundred bytes each."""


class DraKubeletPlugin:
    """Registration and DRA services on their unix sockets."""

    def __init__(self, paths: Paths, driver: str, node: str, bus: StateBus, claims: ClaimReader,
                 control_nodes: Sequence[str], dev_root: Path, on_registered: Callable[[], None],
                 mig_minors: Mapping[str, int] | None = None, dynamic: DynamicMig | None = None) -> None:
        self.paths = paths
        self.driver = driver
        self.node = node
        self._on_registered = on_registered
        self.store = dynamic.store if dynamic is not None else ClaimStore(paths, driver)
        """The claims' checkpoint; with dra.dynamicMig the one that records the MIG devices made for them."""
        self.health_stream = DeviceHealthStream(bus, node, self.store, dynamic)
        self.preparer = Preparer(self.store, driver, node, bus, claims, control_nodes, dev_root,
                                 self.health_stream.claims_changed, mig_minors, dynamic)
        self._server: grpc.aio.Server | None = None
        self.failing: dict[str, tuple[str, int]] = {}
        """By claim UID: the error its last prepare failed with (said when it changes) and how many prepares
        failed in a row."""
        self.registrations = 0
        self.registration_error = ""

    async def start(self) -> None:
        await self.preparer.recover()
        for socket in (self.paths.registration, self.paths.endpoint):
            socket.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                socket.unlink()
        server = aio_server(MAX_RECEIVE_BYTES)
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        v1_grpc.add_DRAPluginServicer_to_server(_DraV1(self), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(_DraV1beta1(self), server)
        health_grpc.add_DRAResourceHealthServicer_to_server(HealthV1alpha1(self.health_stream), server)
        health_v1_grpc.add_DRAResourceHealthServicer_to_server(HealthV1(self.health_stream), server)
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
        return await self.preparer.prepare(namespace, uid, name)

    async def unprepare(self, uid: str) -> None:
        """Destroy the MIG devices made for claim `uid` (dra.dynamicMig), forget the claim and remove its CDI
        spec; DynamicMigError or OSError when that cannot be done."""
        await self.preparer.unprepare(uid)

    def holders(self) -> list[DeviceHolder]:
        """The devices of the prepared claims as the MIG manager counts who holds a GPU."""
        return self.preparer.holders()

    def health(self) -> list[tuple[str, int, int]]:
        """The health of every device the slice carries and every prepared one (agent/dra/health.py)."""
        return self.health_stream.report()

    def watch_health(self) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        """The health stream: the full list at once, again on every change and every HEALTH_RESEND_S."""
        return self.health_stream.watch()


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def GetInfo(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        return self._plugin.info()

    async def NotifyRegistrationStatus(
            self, request: reg.RegistrationStatus, context: Any) -> reg.RegistrationStatusResponse:
        self._plugin.registered(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


async def _prepare_all(plugin: DraKubeletPlugin, claims: Any, pb: Any) -> Any:
    response = pb.NodePrepareResourcesResponse()
    for claim in claims:
        where = f"{claim.namespace}/{claim.name}"
        try:
            prepared = await plugin.prepare(claim.namespace, claim.uid, claim.name)
        except Exception as err:  # a claim that cannot be prepared, or an API server error: the kubelet retries
            error = str(err) if isinstance(err, ClaimError) else f"claim {where}: {type(err).__name__}: {err}"
            response.claims[claim.uid].error = error
            last, count = plugin.failing.pop(claim.uid, ("", 0))
            if error != last:  # said once while the kubelet's retries fail the same way
                log.warning("cannot prepare claim %s (%s): %s", where, claim.uid, error)
            plugin.failing[claim.uid] = (error, count + 1)
            while len(plugin.failing) > MAX_FAILING:
                del plugin.failing[next(iter(plugin.failing))]
            continue
        if (failed := plugin.failing.pop(claim.uid, None)) is not None:
            log.info("prepared claim %s (%s) after %d failed attempt(s)", where, claim.uid, failed[1])
        for d in prepared:
            response.claims[claim.uid].devices.append(pb.Device(
                request_names=list(d.request_names), pool_name=d.pool, device_name=d.device,
                cdi_device_ids=list(d.cdi_ids)))
    return response


async def _unprepare_all(plugin: DraKubeletPlugin, claims: Any, pb: Any) -> Any:
    response = pb.NodeUnprepareResourcesResponse()
    for claim in claims:
        plugin.failing.pop(claim.uid, None)
        try:
            await plugin.unprepare(claim.uid)
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
