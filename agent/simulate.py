"""An embedded kubelet stand-in and an in-memory Node, for `gpu-agent simulate`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from agent.config import AgentConfig
from agent.daemon import Agent, AgentOptions
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.kube.view import Condition, Conflict, NodeView
from agent.nvml.backend import NvmlBackend

SETTLE_TIMEOUT_S = 20.0


class SimulationError(ValueError):
    """The simulation was asked for something the simulated node cannot do."""


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


class InMemoryNode:
    """A Node object held in memory, with the same operations the agent uses on the API server."""

    def __init__(self, name: str) -> None:
        self.view = NodeView(name=name, resource_version="1", uid=f"uid-{name}")
        self.events: list[tuple[str, str, str]] = []
        self.writes = 0
        self.changed = asyncio.Event()

    def _next(self, **changes: Any) -> NodeView:
        self.writes += 1
        version = str(int(self.view.resource_version) + 1)
        self.view = dataclasses.replace(self.view, resource_version=version, **changes)
        self.changed.set()
        return self.view

    async def get(self) -> NodeView:
        return self.view

    async def watch(self, resource_version: str) -> AsyncIterator[NodeView]:
        while True:
            self.changed.clear()
            await self.changed.wait()
            yield self.view

    async def patch_metadata(
        self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
    ) -> NodeView:
        new_labels = {**self.view.labels, **labels}
        new_annotations = {**self.view.annotations, **annotations}
        return self._next(
            labels={k: v for k, v in new_labels.items() if v is not None},
            annotations={k: v for k, v in new_annotations.items() if v is not None},
        )

    async def set_taints(self, taints: Sequence[Mapping[str, str]], resource_version: str) -> NodeView:
        if resource_version != self.view.resource_version:
            raise Conflict(f"node is at {self.view.resource_version}, not {resource_version}")
        return self._next(taints=tuple(dict(t) for t in taints))

    async def set_condition(self, condition: Condition) -> NodeView:
        return self._next(conditions={**self.view.conditions, condition.type: condition})

    async def event(self, reason: str, message: str, kind: str = "Normal", uid: str = "") -> None:
        self.events.append((kind, reason, message))


async def _settle(agent: Agent, kubelet: StandInKubelet, node: InMemoryNode, xids_injected: int) -> None:
    """Wait until injected XIDs were seen, the kubelet holds the agent's device lists and the node converged."""
    assert agent.monitor is not None and agent.reconciler is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT_S

    def kubelet_current() -> bool:
        return all(
            r in kubelet.plugins
            and [(d.ID, d.health == "Healthy") for d in kubelet.plugins[r].devices]
            == [(d.id, d.healthy) for d in devices]
            for r, devices in agent.devices().items()
        )

    while not (
        agent.monitor.events_seen >= xids_injected and kubelet_current() and agent.reconciler.converged.is_set()
    ):
        if loop.time() > deadline:
            raise TimeoutError("the simulated node did not settle")
        await asyncio.sleep(0.02)


async def simulate(
    backend: NvmlBackend, config: AgentConfig, node_name: str, inject_xids: Sequence[tuple[int, int]] = ()
) -> dict[str, Any]:
    """Run the whole agent against the stand-in kubelet and an in-memory Node until it settles, optionally
    injecting XIDs (GPU index, XID) after start; return what the node shows."""
    with tempfile.TemporaryDirectory(prefix="gpu-agent-sim-") as tmp:
        directory = Path(tmp)
        kubelet = StandInKubelet(directory)
        await kubelet.start()
        node = InMemoryNode(node_name)
        agent = Agent(backend, AgentOptions(config=config, kubelet_dir=directory, metrics_port=None, kube=node))
        try:
            await agent.start()
            await _settle(agent, kubelet, node, 0)
            assert agent.bus is not None
            count = len(agent.bus.current.inventory.gpus)
            for gpu, _ in inject_xids:
                if gpu >= count:
                    raise SimulationError(f"--inject-xid: GPU {gpu} does not exist (the node has {count} GPUs)")
            for gpu, xid in inject_xids:
                backend.lib.inject_xid(gpu, xid)
            if inject_xids:
                await _settle(agent, kubelet, node, len(inject_xids))
            capacity, allocatable = kubelet.capacity()
            return {
                "node": {
                    "name": node_name,
                    "labels": dict(sorted(node.view.labels.items())),
                    "taints": [dict(t) for t in node.view.taints],
                    "conditions": {
                        c.type: {"status": c.status, "reason": c.reason, "message": c.message}
                        for c in node.view.conditions.values()
                    },
                    "capacity": capacity,
                    "allocatable": allocatable,
                },
                "events": [{"type": k, "reason": r, "message": m} for k, r, m in node.events],
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
    taints = [f"{t['key']}={t['value']}:{t['effect']}" if t.get("value") else f"{t['key']}:{t['effect']}"
              for t in node["taints"]]
    lines.append("Taints:             " + ("\n                    ".join(taints) or "<none>"))
    if node["conditions"]:
        lines.append("Conditions:")
        for ctype, c in node["conditions"].items():
            lines.append(f"  {ctype}  {c['status']}  {c['reason']}  {c['message']}")
    for title in ("Capacity", "Allocatable"):
        lines.append(f"{title}:")
        for resource, count in node[title.lower()].items():
            lines.append(f"  {resource}:  {count}")
    if view["events"]:
        lines.append("Events:")
        for e in view["events"]:
            lines.append(f"  {e['type']}  {e['reason']}  {e['message']}")
    lines.append("Devices:")
    for resource, devices in view["devices"].items():
        for d in devices:
            numa = "-" if d["numa"] is None else d["numa"]
            lines.append(f"  {resource}  {d['id']}  {d['health']}  numa={numa}")
    return "\n".join(lines)
