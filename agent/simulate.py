"""An embedded kubelet stand-in and an in-memory Node, for `gpu-agent simulate`."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from agent.config import AgentConfig
from agent.daemon import Agent, AgentOptions
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.labels import node_labels
from agent.nvml.backend import NvmlBackend

SETTLE_TIMEOUT_S = 20.0


@dataclass
class PluginView:
    """What the stand-in kubelet holds for one registered resource."""

    endpoint: str
    options: api_pb2.DevicePluginOptions
    devices: list[api_pb2.Device] = field(default_factory=list)
    updates: int = 0


class StandInKubelet(api_pb2_grpc.RegistrationServicer):
    """Serves Registration on kubelet.sock the way the kubelet does: on Register it dials the plugin back,
    reads its options and opens ListAndWatch before answering."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.plugins: dict[str, PluginView] = {}
        self.changed = asyncio.Condition()
        self._server: grpc.aio.Server | None = None
        self._streams: list[asyncio.Task[None]] = []
        self._channels: list[grpc.aio.Channel] = []

    async def start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        await self._server.start()

    async def stop(self) -> None:
        for task in self._streams:
            task.cancel()
        for channel in self._channels:
            await channel.close()
        if self._server is not None:
            await self._server.stop(None)

    async def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.Empty:
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
        channel = grpc.aio.insecure_channel(f"unix://{self.directory / request.endpoint}")
        self._channels.append(channel)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        options = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        view = PluginView(request.endpoint, options)
        async with self.changed:
            self.plugins[request.resource_name] = view
            self.changed.notify_all()
        self._streams.append(asyncio.create_task(self._watch(request.resource_name, view, stub)))
        return api_pb2.Empty()

    async def _watch(self, resource: str, view: PluginView, stub: api_pb2_grpc.DevicePluginStub) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in stub.ListAndWatch(api_pb2.Empty()):
                async with self.changed:
                    view.devices = list(response.devices)
                    view.updates += 1
                    self.changed.notify_all()

    async def wait_for(self, resources: set[str], timeout: float) -> None:
        async with self.changed:
            await asyncio.wait_for(
                self.changed.wait_for(lambda: all(r in self.plugins and self.plugins[r].updates for r in resources)),
                timeout,
            )

    def capacity(self) -> tuple[dict[str, str], dict[str, str]]:
        capacity = {r: str(len(v.devices)) for r, v in sorted(self.plugins.items())}
        allocatable = {r: str(sum(d.health == "Healthy" for d in v.devices)) for r, v in sorted(self.plugins.items())}
        return capacity, allocatable


async def simulate(backend: NvmlBackend, config: AgentConfig, node_name: str) -> dict[str, Any]:
    """Run the whole agent against the stand-in kubelet until every resource is listed; return the node view."""
    with tempfile.TemporaryDirectory(prefix="gpu-agent-sim-") as tmp:
        directory = Path(tmp)
        kubelet = StandInKubelet(directory)
        await kubelet.start()
        agent = Agent(backend, AgentOptions(config=config, kubelet_dir=directory, metrics_port=None))
        try:
            await agent.start()
            assert agent.bus is not None
            expected = set(agent.devices())
            await kubelet.wait_for(expected, SETTLE_TIMEOUT_S)
            capacity, allocatable = kubelet.capacity()
            labels = node_labels(agent.bus.current, config)
            return {
                "node": {
                    "name": node_name,
                    "labels": dict(sorted(labels.items())),
                    "taints": [],
                    "capacity": capacity,
                    "allocatable": allocatable,
                },
                "devices": {
                    resource: [
                        {
                            "id": d.ID,
                            "health": d.health,
                            "numa": d.topology.nodes[0].ID if d.topology.nodes else None,
                        }
                        for d in view.devices
                    ]
                    for resource, view in sorted(kubelet.plugins.items())
                },
            }
        finally:
            await agent.stop()
            await kubelet.stop()


def describe(view: dict[str, Any]) -> str:
    """The node as `kubectl describe node` would show it."""
    node = view["node"]
    lines = [f"Name:               {node['name']}", "Labels:"]
    for key, value in node["labels"].items():
        lines.append(f"                    {key}={value}")
    lines.append("Taints:             " + (", ".join(node["taints"]) or "<none>"))
    for title in ("Capacity", "Allocatable"):
        lines.append(f"{title}:")
        for resource, count in node[title.lower()].items():
            lines.append(f"  {resource}:  {count}")
    lines.append("Devices:")
    for resource, devices in view["devices"].items():
        for d in devices:
            numa = "-" if d["numa"] is None else d["numa"]
            lines.append(f"  {resource}  {d['id']}  {d['health']}  numa={numa}")
    return "\n".join(lines)
