"""Prometheus metrics over the newest NodeState, and the /healthz and /readyz endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.inventory import Device
from agent.state import StateBus

log = logging.getLogger(__name__)


class StateCollector(Collector):
    """Reads the newest NodeState at scrape time; never calls NVML."""

    def __init__(self, bus: StateBus, devices: Callable[[], dict[str, tuple[Device, ...]]]) -> None:
        self._bus = bus
        self._devices = devices

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._bus.current
        version = GaugeMetricFamily("gpu_agent_state_version", "Version of the node state the agent serves.")
        version.add_metric([], state.version)
        yield version
        gpus = GaugeMetricFamily("gpu_agent_gpus", "GPUs the agent sees through NVML.")
        gpus.add_metric([], len(state.inventory.gpus))
        yield gpus
        devices = GaugeMetricFamily(
            "gpu_agent_devices", "Devices advertised to the kubelet.", labels=["resource", "health"]
        )
        for resource, items in sorted(self._devices().items()):
            healthy = sum(d.healthy for d in items)
            devices.add_metric([resource, "Healthy"], healthy)
            devices.add_metric([resource, "Unhealthy"], len(items) - healthy)
        yield devices


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.task_restarts = Counter(
            "gpu_agent_task_restarts", "Supervised tasks restarted after an error.", ["task"],
            registry=self.registry,
        )

    def watch_state(self, bus: StateBus, devices: Callable[[], dict[str, tuple[Device, ...]]]) -> None:
        self.registry.register(StateCollector(bus, devices))


class HttpEndpoint:
    """A small HTTP/1.0 server on the event loop for /metrics, /healthz and /readyz."""

    def __init__(self, metrics: Metrics, ready: Callable[[], tuple[bool, str]]) -> None:
        self._metrics = metrics
        self._ready = ready
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, port: int, host: str = "0.0.0.0") -> None:
        self._server = await asyncio.start_server(self._handle, host, port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def respond(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4", generate_latest(self._metrics.registry)
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            ok, why = self._ready()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            line = await asyncio.wait_for(reader.readline(), 5)
            parts = line.decode(errors="replace").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else "/"
            status, ctype, body = self.respond(path)
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.0 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()
