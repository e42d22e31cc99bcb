"""An embedded kubelet stand-in, an in-memory Node and the driver's MPS control daemon, for `gpu-agent simulate`."""

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

from agent.agent import Agent
from agent.config import AgentConfig
from agent.daemon import AgentOptions
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.kube.view import Condition, Conflict, NodeView
from agent.mps import CONTROL, ControlError, DaemonSpec
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
        async with self.changed, asyncio.timeout(timeout):
            await self.changed.wait_for(lambda: all(r in self.plugins and self.plugins[r].updates for r in resources))

    def capacity(self) -> tuple[dict[str, str], dict[str, str]]:
        capacity = {r: str(len(v.devices)) for r, v in sorted(self.plugins.items())}
        allocatable = {r: str(sum(d.health == "Healthy" for d in v.devices)) for r, v in sorted(self.plugins.items())}
        return capacity, allocatable


class InMemoryNode:
    """A Node object held in memory, answering the operations the agent uses the way the API server does
    (tests/integration/test_node_contract.py holds both to the same cases): each change gets the next
    resourceVersion and a change that changes nothing gets none; a watch delivers every version after the one
    it starts from, in order, and one that starts before the kept history fails with 410 Expired; taints
    written against a stale resourceVersion fail with 409 Conflict; labels and annotations are merge-patched
    (None removes a key), conditions merged by type."""

    HISTORY = 1000
    """Versions kept for watches (the API server's watch cache); a watch from before them gets 410."""

    class Expired(Exception):
        """A watch from a resourceVersion older than the kept history (HTTP 410)."""

        status = 410
        reason = "Expired"

    def __init__(self, name: str) -> None:
        self._current = NodeView(name=name, resource_version="1", uid=f"uid-{name}")
        self._history: list[NodeView] = []
        """The versions after ``_start``, oldest first."""
        self._start = 1
        """The oldest resourceVersion a watch may start from."""
        self._wakeup = asyncio.Event()
        self.events: list[tuple[str, str, str]] = []
        self.writes = 0
        """Write requests, as NodeApi counts them: patches, taints, conditions and Events, no-ops included."""
        self.watched: str | None = None
        """The resourceVersion up to which a watch has handed over every version and come back for more (its
        consumer has dealt with them all); None until a watch waits."""

    @property
    def view(self) -> NodeView:
        """The Node as it is now."""
        return self._current

    @view.setter
    def view(self, view: NodeView) -> None:
        """Replace the Node as stored, history and all (a test's starting point, before anything watches)."""
        self._current, self._history, self._start = view, [], int(view.resource_version)
        self._wake()

    def compact(self) -> None:
        """Forget every version before the current one, as the API server does when its watch cache starts
        over (a restart) or etcd compacts: a watch from an older resourceVersion then gets 410."""
        self._history.clear()
        self._start = int(self._current.resource_version)

    def _wake(self) -> None:
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    def _next(self, **changes: Any) -> NodeView:
        changed = dataclasses.replace(self._current, **changes)
        if changed == self._current:
            return self._current  # the API server stores nothing and keeps the resourceVersion
        self._current = dataclasses.replace(changed, resource_version=str(int(self._current.resource_version) + 1))
        self._history.append(self._current)
        if len(self._history) > self.HISTORY:
            self._start = int(self._history.pop(0).resource_version)
        self._wake()
        return self._current

    async def get(self) -> NodeView:
        return self._current

    async def list(self) -> tuple[NodeView, str]:
        return self._current, self._current.resource_version

    async def watch(self, resource_version: str) -> AsyncIterator[NodeView]:
        after = int(resource_version)
        while True:
            if after < self._start:
                raise self.Expired(f"too old resource version: {after} ({self._start})")
            for view in [v for v in self._history if int(v.resource_version) > after]:
                yield view
                after = int(view.resource_version)
            if after < self._start:
                continue  # the history moved on while the consumer was busy: expired
            wakeup = self._wakeup
            if int(self._current.resource_version) > after:
                continue
            self.watched = str(after)
            await wakeup.wait()

    async def patch_metadata(
        self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
    ) -> NodeView:
        self.writes += 1
        new_labels = {**self._current.labels, **labels}
        new_annotations = {**self._current.annotations, **annotations}
        return self._next(
            labels={k: v for k, v in new_labels.items() if v is not None},
            annotations={k: v for k, v in new_annotations.items() if v is not None},
        )

    async def set_taints(self, taints: Sequence[Mapping[str, str]], resource_version: str) -> NodeView:
        self.writes += 1
        if resource_version != self._current.resource_version:
            raise Conflict(f"node is at {self._current.resource_version}, not {resource_version}")
        return self._next(taints=tuple(dict(t) for t in taints))

    async def set_condition(self, condition: Condition) -> NodeView:
        self.writes += 1
        return self._next(conditions={**self._current.conditions, condition.type: condition})

    async def event(self, reason: str, message: str, kind: str = "Normal", uid: str = "") -> None:
        self.writes += 1
        self.events.append((kind, reason, message))

    def start_now(self) -> None:
        """Nothing to wait for: the in-memory Node has no start jitter."""


class SimulatedMpsControl:
    """The driver's MPS control daemon on a simulated node, answering as nvidia-cuda-mps-control does: `-d`
    starts a daemon for the spec's pipe directory (refused while one runs there), a command goes to that daemon
    (refused when none runs), `quit` stops it. Nothing runs outside the agent; `run` on a node uses the
    driver's program."""

    PROGRAM = f"{CONTROL} (simulated)"

    def __init__(self) -> None:
        self.daemons: dict[str, dict[str, str]] = {}
        """The running daemons by pipe directory: their settings."""

    def program(self, config: AgentConfig) -> str | None:
        return self.PROGRAM

    async def __call__(self, spec: DaemonSpec, *args: str, command: str | None = None) -> str:
        pipe = spec.env["CUDA_MPS_PIPE_DIRECTORY"]
        if args:
            if args != ("-d",):
                raise ControlError(f"{CONTROL} {' '.join(args)} exited 2: unknown arguments")
            if pipe in self.daemons:
                raise ControlError(f"{CONTROL} -d exited 1: An instance of this daemon is already running")
            self.daemons[pipe] = {"active_thread_percentage": "100.0", "pinned_mem_limit": ""}
            return ""
        settings = self.daemons.get(pipe)
        if settings is None:
            raise ControlError(f"{CONTROL} {command} exited 1: Cannot find MPS control daemon process")
        word, *rest = (command or "").split() or [""]
        if word == "set_default_active_thread_percentage" and len(rest) == 1:
            settings["active_thread_percentage"] = f"{float(rest[0]):.1f}"
            return settings["active_thread_percentage"]
        if word == "get_default_active_thread_percentage":
            return settings["active_thread_percentage"]
        if word == "set_default_device_pinned_mem_limit" and len(rest) == 2:
            settings["pinned_mem_limit"] = rest[1]
            return ""
        if word == "quit":
            del self.daemons[pipe]
            return ""
        return f"unknown command {word}"


async def _settle(agent: Agent, kubelet: StandInKubelet, node: InMemoryNode, xids_injected: int) -> None:
    """Wait until injected XIDs were seen, the kubelet holds the agent's device lists and the node converged."""
    reconciler = agent.reconciler
    assert reconciler is not None
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
        agent.monitor.events_seen >= xids_injected and kubelet_current()
        and reconciler.converged_version >= agent.bus.current.version
    ):
        if loop.time() > deadline:
            raise SimulationError(f"the simulated node did not settle within {SETTLE_TIMEOUT_S:g}s")
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
        # The simulated MPS daemons' pipe and log directories go with the simulated node's.
        flags = config.flags.model_copy(update={"mps_root": directory / "mps"})
        try:
            agent = await Agent.start(
                backend, AgentOptions(config=config.model_copy(update={"flags": flags}), kubelet_dir=directory,
                                      metrics_port=None, kube=node, mps_control=SimulatedMpsControl()))
        except BaseException:
            await kubelet.stop()
            raise
        try:
            await _settle(agent, kubelet, node, 0)
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
