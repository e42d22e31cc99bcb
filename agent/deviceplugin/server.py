"""Serves each resource on its own unix socket, registers with the kubelet and follows kubelet restarts.

Each resource's DevicePlugin service runs on a grpc.aio server of its own (`plugin_server`, made by grpcserver.py
as every gRPC server of the agent is), on the agent's event loop, with explicit limits: the largest message it
takes (MAX_RECEIVE_BYTES), keepalive, concurrent streams and calls. Registration,
the socket watch and the resource set run on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.deviceplugin.dirwatch import DirWatch
from agent.deviceplugin.servicer import DevicePluginServicer
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.grpcserver import aio_server
from agent.locks import DirectoryLock, Held
from agent.metrics import Metrics
from agent.state import StateBus

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"
REGISTER_TIMEOUT_S = 15.0
"""The kubelet dials back (up to 10 s) and calls GetDevicePluginOptions before Register returns."""
POLL_INTERVAL_S = 0.2
"""How often sockets are checked when inotify is not available."""
IDLE_CHECK_S = 10.0
"""With inotify, a check this often all the same, in case an event was missed."""
BACKOFF_MAX_S = 5.0

MAX_RECEIVE_BYTES = 2 * 1024 * 1024
"""The largest request a plugin server takes; a larger one is refused with RESOURCE_EXHAUSTED before it is parsed,
and the server goes on serving. The largest legitimate request is a GetPreferredAllocation that offers, and
requires, every replica of a 16-GPU node with 1024 replicas each (the most a config allows): 16384 IDs of up to 46
characters (`GPU-<uuid>::1023`) in each of its two lists, 1,537,352 bytes; an Allocate naming every one of them is
768,676 bytes (tests/unit/test_plugin_server.py builds both from the plan of hgx-16-nvswitch). 2 MiB leaves a
third more than the largest."""


def plugin_server(servicer: DevicePluginServicer, address: str) -> grpc.aio.Server:
    """A grpc.aio server of `servicer`'s DevicePlugin service listening on `address` (unix:///path), not yet
    started; OSError when the address cannot be bound."""
    server = aio_server(MAX_RECEIVE_BYTES)
    api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as err:  # grpc's words for a failed bind: "Failed to bind to address ..."
        raise OSError(str(err)) from None
    if not bound:
        raise OSError(f"grpc could not bind {address}")
    return server


INSTANCE = secrets.token_hex(4)
"""This process's part of every socket name: a restarted agent never takes the name of its predecessor's socket."""
_serves = itertools.count(1)
"""Numbers every serve in this process, whatever plugin or plugin set makes it: a resource that goes away and
comes back (a reload, a MIG layout that drops and re-adds a profile, a switch of mode) is served on a name no
earlier server of the process had."""


def socket_name(resource: str) -> str:
    """A new socket name for a serve of `resource`: gpu-agent-<resource>-<instance>-<serial>.sock, never used
    before by this process (agent.checks.socket_name_length gives its longest form)."""
    return f"gpu-agent-{_slug(resource)}-{INSTANCE}-{next(_serves)}.sock"


def _dir_inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _slug(resource: str) -> str:
    return resource.replace("/", "_").replace(".", "-")


def _bind_error(path: Path) -> str:
    """Why a unix socket cannot be made at `path` (grpc says only that it failed): the error of a bind tried
    here, or that one succeeded after all (then the cause was passing)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(str(path))
    except OSError as err:
        return err.strerror or str(err)
    finally:
        probe.close()
    with contextlib.suppress(OSError):
        path.unlink()
    return "grpc could not bind it, though a socket can be made there now"


def _not_a_socket(path: Path) -> str | None:
    """What is at `path` when it is there but not a socket (a file or directory left in the kubelet's place);
    None when it is a socket or absent."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"


def _inode(path: Path) -> tuple[int, int] | None:
    """Identity of a socket file, or None when no socket is there."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


async def register(kubelet_dir: Path, endpoint: str, resource: str, timeout: float = REGISTER_TIMEOUT_S) -> None:
    """One Register call on a fresh channel (a reused channel can sit in reconnect backoff after a restart)."""
    target = f"unix://{kubelet_dir / KUBELET_SOCKET}"
    async with grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        await stub.Register(
            api_pb2.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint,
                resource_name=resource,
                options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
            ),
            timeout=timeout,
        )


@dataclass
class _Serving:
    server: grpc.aio.Server
    socket: Path
    identity: tuple[int, int] | None


class ResourcePlugin:
    """One resource's gRPC server and its registration with the kubelet.

    Each serve uses a new socket name (`socket_name`), never used before by this process, so a kubelet that
    still tracks an earlier socket never mistakes the new one for it.
    """

    def __init__(self, servicer: DevicePluginServicer, kubelet_dir: Path, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self.servicer = servicer
        self.resource = servicer.resource
        self.kubelet_dir = kubelet_dir
        self._serving: _Serving | None = None
        self.registered_kubelet: tuple[int, int] | None = None
        self.registrations = 0

    @property
    def socket(self) -> Path | None:
        return self._serving.socket if self._serving else None

    async def serve(self) -> Path:
        await self.stop()
        self.servicer.open()
        path = self.kubelet_dir / socket_name(self.resource)
        try:
            server = plugin_server(self.servicer, f"unix://{path}")
        except OSError:
            raise OSError(f"cannot listen on {path}: {_bind_error(path)}") from None
        await server.start()
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
        self._serving = _Serving(server, path, _inode(path))
        log.info("serving %s on %s", self.resource, path)
        return path

    def socket_intact(self) -> bool:
        return self._serving is not None and _inode(self._serving.socket) == self._serving.identity

    async def register(self, kubelet_identity: tuple[int, int] | None) -> None:
        assert self._serving is not None
        await register(self.kubelet_dir, self._serving.socket.name, self.resource)
        self.registered_kubelet = kubelet_identity
        self.registrations += 1
        if self.metrics:
            self.metrics.registrations.labels(resource=self.resource).inc()
        log.info("registered %s with the kubelet (endpoint %s)", self.resource, self._serving.socket.name)

    async def stop(self, grace: float | None = None) -> None:
        serving, self._serving = self._serving, None
        if serving is None:
            return
        self.servicer.close()  # streams end now; the grace is for Allocate calls in flight
        await serving.server.stop(grace)  # what is still running after the grace is cancelled
        # Remove the socket only if it is still ours: a restarted kubelet may have cleaned it already.
        if _inode(serving.socket) == serving.identity:
            with contextlib.suppress(OSError):
                serving.socket.unlink()


class PluginSet:
    """One plugin per advertised resource, and the loop that keeps the set registered with the kubelet.

    Resources that appear get a server and a registration; resources that vanish are stopped (their last
    ListAndWatch message was already an empty list); unchanged ones keep their server and streams.
    """

    def __init__(
        self,
        make_servicer: Callable[[str], DevicePluginServicer],
        wanted: Callable[[], set[str]],
        kubelet_dir: Path,
        bus: StateBus,
        metrics: Metrics | None = None,
        lock: DirectoryLock | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self._metrics = metrics
        self._lock = lock
        """The kubelet directory's lock, held by this agent: moved to a directory that replaces it before
        anything is served there."""
        self._on_lost = on_lost
        """Told, in one line, that another agent holds the lock of the directory that replaced this one's; the
        plugin set then serves nothing."""
        self._make_servicer = make_servicer
        self._wanted = wanted
        self._bus = bus
        self.kubelet_dir = kubelet_dir
        self.plugins: dict[str, ResourcePlugin] = {}
        self.registered = asyncio.Event()
        self._failures: dict[str, str] = {}
        """The last reason each resource could not be served or registered, until it is."""

    async def _sync_resources(self) -> None:
        wanted = self._wanted()
        for name in sorted(set(self.plugins) - wanted):
            log.info("resource %s is no longer advertised; stopping its server", name)
            await self.plugins.pop(name).stop(grace=0.5)
        for name in sorted(wanted - set(self.plugins)):
            self.plugins[name] = ResourcePlugin(self._make_servicer(name), self.kubelet_dir, self._metrics)

    async def _wait(self, watch: DirWatch, timeout: float) -> None:
        """Until the socket directory changes, the resources may have changed, or `timeout` passes."""
        version = self._bus.current.version
        newer = asyncio.ensure_future(self._bus.wait_newer(version))
        changed = asyncio.ensure_future(watch.changed.wait())
        try:
            await asyncio.wait({newer, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            newer.cancel()
            changed.cancel()
        watch.changed.clear()

    async def run(self) -> None:
        """Serve and register every resource; follow resource changes and kubelet restarts. Never returns; serves
        nothing once another agent holds the lock of a directory that replaced the kubelet directory
        (`on_lost`)."""
        watch = DirWatch(self.kubelet_dir)
        try:
            await self._run(watch)
        finally:
            watch.stop()

    async def _run(self, watch: DirWatch) -> None:
        kubelet_sock = self.kubelet_dir / KUBELET_SOCKET
        backoff = 0.0
        retry_at = 0.0
        failed_on: tuple[int, int] | None = None
        loop = asyncio.get_running_loop()
        watched: int | None = None
        reported: str | None = None  # what was said to be in the kubelet socket's place: said once
        while True:
            directory = _dir_inode(self.kubelet_dir)
            if directory != watched:  # first pass, or the directory was replaced: watch the new one
                if not await self._take_directory():
                    await asyncio.Event().wait()  # the agent stops: nothing more is served here
                watch.stop()
                watched = directory if directory is not None and watch.start() else None
                if _dir_inode(self.kubelet_dir) != directory:
                    continue  # replaced while the watch started, which now watches the new one: look again
            await self._sync_resources()
            kubelet = _inode(kubelet_sock)
            impostor = _not_a_socket(kubelet_sock) if kubelet is None else None
            if impostor != reported:
                if impostor is not None:
                    log.warning("%s is %s, not the kubelet's socket; waiting for the kubelet to make its socket "
                                "there", kubelet_sock, impostor)
                reported = impostor
            plugins = list(self.plugins.values())
            pending = [p for p in plugins if not p.socket_intact() or p.registered_kubelet != kubelet]
            # A new kubelet socket ends any backoff: the restarted kubelet is ready now.
            if kubelet is not None and pending and (loop.time() >= retry_at or kubelet != failed_on):
                # Each plugin on its own: one that cannot be served or registered holds up none of the others.
                failures = [f for f in [await self._serve_and_register(p, kubelet) for p in pending] if f]
                if failures:
                    failed_on = kubelet
                    backoff = min(BACKOFF_MAX_S, max(0.5, backoff * 2))
                    retry_at = loop.time() + backoff
                    for resource, detail in failures:
                        # Said once per resource and reason: a plugin that can never be served does not fill
                        # the log while it is retried.
                        said = self._failures.get(resource) == detail
                        self._failures[resource] = detail
                        log.log(logging.DEBUG if said else logging.WARNING,
                                "registration of %s with the kubelet failed, retrying in %.1fs: %s", resource,
                                backoff, detail)
                else:
                    backoff = 0.0
            if kubelet is not None and all(p.registered_kubelet == kubelet and p.socket_intact() for p in plugins):
                self.registered.set()
            else:
                self.registered.clear()
            timeout = IDLE_CHECK_S if watch.active else POLL_INTERVAL_S
            if backoff:
                timeout = min(timeout, max(0.0, retry_at - loop.time()))
            await self._wait(watch, timeout)

    async def _take_directory(self) -> bool:
        """Move the lock to the kubelet directory now at its path (a replaced one), before anything is served
        there. False, with every plugin stopped and the agent told, when another agent holds it."""
        if self._lock is None or not self._lock.held:
            return True
        try:
            if self._lock.follow():
                log.info("the kubelet directory %s was replaced; holding its lock now", self.kubelet_dir)
            return True
        except Held as err:
            await self.stop(grace=0.5)
            self.plugins.clear()
            self.registered.clear()
            if self._on_lost is not None:
                self._on_lost(f"the kubelet directory {self.kubelet_dir} was replaced and {err}; this agent "
                              "serves nothing there")
            return False

    async def _serve_and_register(self, plugin: ResourcePlugin, kubelet: tuple[int, int]) -> tuple[str, str] | None:
        """Serve `plugin` (unless its socket is intact) and register it: None when done, else its resource and
        why not."""
        try:
            if not plugin.socket_intact():
                await plugin.serve()
            await plugin.register(kubelet)
        except (grpc.aio.AioRpcError, OSError) as err:
            return plugin.resource, err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        self._failures.pop(plugin.resource, None)
        return None

    async def stop(self, grace: float = 1.0) -> None:
        await asyncio.gather(*(p.stop(grace) for p in self.plugins.values()))
