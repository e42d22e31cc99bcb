"""The DRA health service (DRAResourceHealth.NodeWatchResources, v1 and v1alpha1): the health of every device
the ResourceSlice carries and every prepared one, streamed to the kubelet at once, on every change of the
state or of the prepared claims, and again every HEALTH_RESEND_S (`DeviceHealthStream`), and the two gRPC
servicers that serve the stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from agent.dra.claims import ClaimStore
from agent.dra.dynamic import DynamicMig
from agent.dra.health_v1 import api_pb2 as health_v1_pb
from agent.dra.health_v1 import api_pb2_grpc as health_v1_grpc
from agent.dra.health_v1alpha1 import api_pb2 as health_pb
from agent.dra.health_v1alpha1 import api_pb2_grpc as health_grpc
from agent.dra.slices import device_gpus, published_names
from agent.state import StateBus

HEALTH_RESEND_S = 10.0
"""The health stream sends the full list again at this interval when nothing changed: the kubelet takes a
device's health as Unknown 30 s after it last received it (healthTimeout, pkg/kubelet/cm/dra/healthinfo.go)."""


class DeviceHealthStream:
    """What the health stream reports, and when."""

    def __init__(self, bus: StateBus, node: str, store: ClaimStore, dynamic: DynamicMig | None = None) -> None:
        self._bus = bus
        self.node = node
        self._store = store
        self._dynamic = dynamic
        self._claims_changed = asyncio.Event()
        """Set (and replaced) whenever a claim is prepared or unprepared: the health streams list prepared
        devices too."""
        self._health_since: dict[str, tuple[int, int]] = {}
        """Per device, the health last reported and since when (Unix seconds)."""

    def claims_changed(self) -> None:
        """A claim was prepared or unprepared: the streams report again."""
        changed, self._claims_changed = self._claims_changed, asyncio.Event()
        changed.set()

    def report(self) -> list[tuple[str, int, int]]:
        """The health of every device the slice carries (unhealthy ones included) and every prepared one, as
        (device name, HealthStatus, since when in Unix seconds): a device's GPU's health; Unknown for a
        prepared device the node no longer has (a MIG device of a replaced layout)."""
        state = self._bus.current
        self._store.refresh()  # with the claims the other agent of a rolling update prepared
        gpus = device_gpus(state)
        if self._dynamic is not None:
            gpus.update(self._dynamic.device_gpus(state))
        names = set(published_names(state)) | {
            d.device for uid in self._store.claims for d in self._store.get(uid) or [] if d.pool == self.node}
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

    async def watch(self) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        """The health stream: the full list at once, again on every change and every HEALTH_RESEND_S."""
        sent: list[tuple[str, int, int]] | None = None
        last_sent = 0.0
        while True:
            state = self._bus.current
            claims_changed = self._claims_changed
            report = self.report()
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


class HealthV1alpha1(health_grpc.DRAResourceHealthServicer):
    def __init__(self, health: DeviceHealthStream) -> None:
        self._health = health

    async def NodeWatchResources(
            self, request: health_pb.NodeWatchResourcesRequest, context: Any
    ) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        async for response in self._health.watch():
            yield response


class HealthV1(health_v1_grpc.DRAResourceHealthServicer):
    """The same stream on the v1 service (Kubernetes 1.37), whose messages are v1alpha1's on the wire."""

    def __init__(self, health: DeviceHealthStream) -> None:
        self._health = health

    async def NodeWatchResources(
            self, request: health_v1_pb.NodeWatchResourcesRequest, context: Any
    ) -> AsyncIterator[health_v1_pb.NodeWatchResourcesResponse]:
        async for response in self._health.watch():
            yield health_v1_pb.NodeWatchResourcesResponse.FromString(response.SerializeToString())
