"""Kubelet PodResources client: which pods hold which devices."""

from __future__ import annotations

import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.podresources_v1 import api_pb2, api_pb2_grpc

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
TIMEOUT_S = 5.0


class PodResourcesUnavailable(RuntimeError):
    """The kubelet's PodResources socket did not answer."""


CLAIM = "ResourceClaim"
"""The resource of a DeviceHolder that is a prepared DRA claim (its pod field names the claim)."""


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


class SocketPathError(ValueError):
    """The configured PodResources socket path cannot be the kubelet's socket; the message is one line."""


def check_socket(path: Path, configured: bool = True) -> str | None:
    """Check `mig.podResourcesSocket` before the agent starts. Raises SocketPathError for a path that cannot be
    the socket (something other than a socket is there, or its directory is not a directory); returns a warning
    line when the socket is not there yet (the kubelet makes it when it starts), None when it is there.

    A directory that does not exist is refused when the path was set in the config (a mistyped overlay). The
    default path's directory is missing wherever no kubelet runs (a simulated node, a test machine): that is not
    mentioned here, the MIG controller and the telemetry say so when they need the socket."""
    where = f"mig.podResourcesSocket {path}"
    try:
        found = path.lstat()
    except FileNotFoundError:
        found = None
    except NotADirectoryError:
        found = None
    except OSError as err:
        return f"{where}: cannot be checked ({err.strerror}); the agent starts without knowing"
    if found is not None:
        if stat.S_ISSOCK(found.st_mode):
            return None
        if stat.S_ISLNK(found.st_mode):
            try:
                if stat.S_ISSOCK(path.stat().st_mode):
                    return None
            except OSError:
                return _missing(where)  # a dangling link: the kubelet may not have made its target yet
        raise SocketPathError(f"{where} is {_kind(path)}, not a socket: set it to the kubelet's PodResources "
                              "socket (<kubelet root>/pod-resources/kubelet.sock)")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise SocketPathError(f"{where}: {existing} is {_kind(existing)}, not a directory")
    if existing != path.parent:
        if configured:
            raise SocketPathError(f"{where}: the directory {path.parent} does not exist (the kubelet makes its "
                                  "socket in <kubelet root>/pod-resources; mount that directory into the container)")
        return None
    return _missing(where)


def _missing(where: str) -> str:
    return (f"{where} does not exist yet (the kubelet makes it): until it does, MIG changes do not check for pods "
            "on the GPUs and GPU metrics carry no pod labels")


def _kind(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError:
        return "not usable"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"
