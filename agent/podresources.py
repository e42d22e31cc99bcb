"""Kubelet PodResources client: which pods hold which devices."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.podresources_v1 import api_pb2, api_pb2_grpc

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
TIMEOUT_S = 5.0


class PodResourcesUnavailable(RuntimeError):
    """The kubelet's PodResources socket did not answer."""


@dataclass(frozen=True)
class DeviceHolder:
    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod} ({self.container}, {self.resource} {self.device_id})"


async def holders(socket: Path, device_ids: Collection[str]) -> list[DeviceHolder]:
    """The containers holding any of `device_ids` (replica IDs count for their GPU: `<id>::<n>`)."""
    wanted = set(device_ids)
    return [h for h in await allocations(socket)
            if h.device_id in wanted or h.device_id.split("::", 1)[0] in wanted]


async def allocations(socket: Path) -> list[DeviceHolder]:
    """Every device the kubelet reports as held by a container, from one List call."""
    # A channel of its own subchannels: a failed dial (the kubelet restarting) must not leave a shared connection
    # in backoff for the next caller.
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"unix://{socket}", options=options) as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            reason = err.details() or err.code().name
            raise PodResourcesUnavailable(f"kubelet PodResources at {socket}: {reason}") from err
    found = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    found.append(DeviceHolder(pod.namespace, pod.name, container.name, devices.resource_name,
                                              device_id))
    return found
