"""The small builders that tests in more than one module share: nodes of the fake NVML and their parts, the MIG
view of a fresh node, the agent's command line, a DevicePlugin servicer over real gRPC, a topology, and readers
of the docs' code blocks and of a metrics exposition. A test module imports them from here, never from another
test module (`unit/test_boundaries.py` checks it)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from agent.config import GPU_RESOURCE, parse_config
from agent.deviceplugin.response import NodeFiles
from agent.deviceplugin.server import plugin_server
from agent.deviceplugin.servicer import DevicePluginServicer, PreferFor
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.inventory import PlanCache, plan
from agent.metrics import Metrics
from agent.mig.applier import ApplyResult, Journal, apply_layout
from agent.mig.layout import MigLayout
from agent.mig.planner import GpuMigState
from agent.nvml.backend import NvmlBackend, fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import NodeSpec, load_node
from agent.nvml.records import GpuInfo
from agent.podresources_v1 import api_pb2 as pr
from agent.podresources_v1 import api_pb2_grpc as pr_grpc
from agent.state import NodeState, StateBus
from agent.topology.model import Topology
from agent.topology.prefer import Preferences
from tests.plugin_harness import carve_mig, running_agent, short_dir

T = TypeVar("T")

# --- nodes of the fake NVML -------------------------------------------------------------------------------------

MIXED_GPU0 = [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)]
"""A mixed MIG layout of one H100: 3g.40gb at slice 0, 2g.20gb at 4, 1g.10gb at 6."""


def node(preset: str = "dgx-h100", config: str = "version: v1\n", mig: dict[int, list[tuple[str, int]]] | None = None,
         ) -> NodeState:
    """The state of a fake node of the preset, with `config` and the MIG devices `mig` ({gpu: [(profile, start)]})
    carved as an operator's tool carves them."""
    fake = FakeNvml(load_node(preset))
    for gpu_index, instances in (mig or {}).items():
        carve_mig(fake, gpu_index, instances)
    backend = fake_backend(fake)
    backend.init()
    return NodeState(version=1, inventory=backend.inventory(), config=parse_config(config))


def counts(state: NodeState) -> dict[str, int]:
    """How many devices each resource of the node advertises."""
    return {name: len(r.devices) for name, r in plan(state).resources.items()}


def gpu(index: int, numa: int) -> GpuInfo:
    """An A100 SXM4 80GB at `index` on NUMA node `numa`, MIG-capable and MIG disabled."""
    return GpuInfo(
        index=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000", name="NVIDIA A100-SXM4-80GB",
        pci_bus_id=f"00000000:{index + 16:02X}:00.0", minor=index, memory_mib=81920, architecture="ampere",
        compute_capability=(8, 0), numa_node=numa, mig_capable=True, mig_enabled=False, mig_pending=False,
    )


def nvlink_pairs(links01: int = 2, links23: int = 2) -> Topology:
    """GPU0-GPU1 and GPU2-GPU3 NVLink pairs; GPUs 0,1 on NUMA node 0 and 2,3 on node 1."""
    return Topology.build([0, 0, 1, 1], {}, {(0, 1): links01, (2, 3): links23})


# --- MIG on a fake node, driven as the agent drives a real one ----------------------------------------------------


@dataclass
class MigNode:
    """A simulated node driven the way the agent drives a real one."""

    fake: FakeNvml
    backend: NvmlBackend
    ops: MigOps

    @property
    def spec(self) -> NodeSpec:
        return self.fake.spec

    @property
    def count(self) -> int:
        return len(self.spec.gpus)

    def apply(self, layout: MigLayout, journal: Journal | None = None,
              steps: list[str] | None = None) -> ApplyResult:
        record = steps.append if steps is not None else (lambda _: None)
        return apply_layout(self.ops, self.count, layout, journal, step=record)


def started(source: str, state_file: Path | None = None) -> MigNode:
    fake = FakeNvml(load_node(source), state_file)
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    return MigNode(fake, backend, MigOps(backend))


def fresh_view(spec: NodeSpec) -> list[GpuMigState]:
    """The node as a fresh boot has it (MIG disabled everywhere), straight from the catalog."""
    return [GpuMigState.of(g.index, g.model) for g in spec.gpus]


# --- the agent's command line -----------------------------------------------------------------------------------

AGENT = [sys.executable, "-m", "agent.cli"]


def gpu_agent(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=timeout)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single error line a refused command prints, checked to be the only output and no traceback."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    # The agent's own INFO log lines may come first (it logs as it starts); nothing else may.
    lines = [line for line in result.stderr.strip().splitlines() if " INFO agent." not in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def run_agent(kubelet_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return gpu_agent("run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir),
                     "--metrics-port", "0", *extra, timeout=30)


# --- one resource's DevicePlugin service over real gRPC ---------------------------------------------------------


class LoopThread:
    """An event loop on a thread of its own, where the server under test and its state bus live."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()

    def run(self, work: Awaitable[T], timeout: float = 10) -> T:
        async def wrapped() -> T:
            return await work

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Served:
    stub: api_pb2_grpc.DevicePluginStub
    bus: StateBus
    servicer: DevicePluginServicer
    metrics: Metrics
    ids: list[str]
    """The GPU UUIDs, by index."""
    loop: LoopThread
    server: Any
    target: str

    def update(self, **changes: Any) -> NodeState:
        """Publish the current state with `changes`, as a producer of the agent does."""
        return self.loop.run(self.bus.update(**changes))

    def close(self) -> None:
        """End every open ListAndWatch stream, as the agent does before it stops a server."""
        self.loop.call(self.servicer.close)


@contextlib.contextmanager
def serving(state: NodeState, resource: str = GPU_RESOURCE, files: NodeFiles | None = None,
            prefer_for: PreferFor | None = None, search: Executor | None = None) -> Iterator[Served]:
    """The DevicePlugin service of `resource` on a unix socket of its own, served by `server.plugin_server` (as the
    agent serves each resource) on an event loop of its own thread, with grpc's blocking client."""
    directory = short_dir()
    target = f"unix://{directory}/plugin.sock"
    loop = LoopThread()

    async def start() -> tuple[StateBus, Metrics, DevicePluginServicer, Any]:
        bus = StateBus(state)
        metrics = Metrics()
        servicer = DevicePluginServicer(resource, bus, PlanCache(), prefer_for or Preferences(lambda: bus.current),
                                        metrics, files, search)
        servicer.open()
        server = plugin_server(servicer, target)
        await server.start()
        return bus, metrics, servicer, server

    bus, metrics, servicer, server = loop.run(start())
    channel = grpc.insecure_channel(target)
    try:
        yield Served(api_pb2_grpc.DevicePluginStub(channel), bus, servicer, metrics,
                     [g.uuid for g in state.inventory.gpus], loop, server, target)
    finally:
        loop.call(servicer.close)
        channel.close()
        loop.run(server.stop(0))
        loop.close()
        shutil.rmtree(directory)


def refusal(call: object) -> tuple[grpc.StatusCode, str]:
    assert isinstance(call, grpc.RpcError)
    return call.code(), call.details()  # type: ignore[attr-defined]


def allocate(served: Served, *requests: list[str]) -> api_pb2.AllocateResponse:
    return served.stub.Allocate(api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in requests]))


# --- the kubelet's PodResources API ------------------------------------------------------------------------------


class StandInPodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources v1 Lister: List answers the devices each pod's one container ("main", namespace
    "ml") holds, by resource, as the kubelet does (a replica as `<uuid>::<n>`)."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, list[str]]] = {}
        """By pod name: device IDs by resource name."""
        self.failing = False
        """List answers UNAVAILABLE, as a kubelet does while its pod manager is not synced yet."""
        self.lists = 0

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        self.lists += 1
        if self.failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "pod manager not synced")
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(namespace="ml", name=name, containers=[pr.ContainerResources(name="main", devices=[
                pr.ContainerDevices(resource_name=resource, device_ids=ids) for resource, ids in held.items()])])
            for name, held in self.pods.items()])


L = TypeVar("L", bound=pr_grpc.PodResourcesListerServicer)


@contextlib.asynccontextmanager
async def serving_pod_resources(socket: Path, lister: L) -> AsyncIterator[L]:
    """`lister` (a PodResources v1 Lister) serving on the unix socket `socket` until the block ends."""
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    try:
        yield lister
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def pod_resources(socket: Path) -> AsyncIterator[StandInPodResources]:
    """StandInPodResources serving on the unix socket `socket` until the block ends."""
    async with serving_pod_resources(socket, StandInPodResources()) as lister:
        yield lister


# --- the docs ---------------------------------------------------------------------------------------------------

FENCE = re.compile(r"^( *)```([A-Za-z]*)\n(.*?)^\1```$", re.M | re.S)
"""A fenced code block of Markdown, indented ones (inside list items) included."""


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, indented ones (inside list items) included, dedented."""
    blocks = []
    for match in FENCE.finditer(text):
        indent = len(match.group(1))
        body = "\n".join(line[indent:] for line in match.group(3).splitlines())
        blocks.append((match.group(2), body))
    return blocks


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


# --- metrics ----------------------------------------------------------------------------------------------------


def scrape_metrics() -> str:
    """/metrics of an in-process agent on the simulated DGX H100."""

    async def run() -> str:
        # Two telemetry passes: GPM's DCGM_FI_PROF_* fields come from the second.
        config = parse_config("version: v1\ntelemetry: {intervalSeconds: 1}\n")
        async with running_agent("dgx-h100", config, metrics_port=0) as rig:
            assert rig.agent.http is not None
            while rig.agent.telemetry.passes < 2:
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{rig.agent.http.port}/metrics"

            def get() -> str:
                with urllib.request.urlopen(url, timeout=10) as response:
                    return str(response.read().decode())

            return await asyncio.to_thread(get)

    return asyncio.run(run())


SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\} (\S+)$')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def exposition_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a metrics exposition by metric name, exactly as written (prometheus_client's parser would rename
    counters)."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in LABEL.findall(match[2])}
        found.setdefault(match[1], []).append((labels, float(match[3])))
    return found
