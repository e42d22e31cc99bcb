"""Shared test helpers: a short socket directory, one way to start an agent (on the fake NVML, with a test
kubelet and, when given, its Node), and the one wait helper."""

from __future__ import annotations

import asyncio
import ctypes
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pynvml

from agent.agent import Agent
from agent.config import DEFAULT_CONFIG, AgentConfig
from agent.daemon import AgentOptions
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.health.monitor import HealthMonitor
from agent.kube.reconciler import NodeClient
from agent.nvml.backend import NvmlBackend, fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import StandInKubelet

T = TypeVar("T")

POLL_S = 0.05
"""How often wait_until looks again."""
CONVERGE_S = 20.0
"""How long running_agent waits, by default, for the kubelet to list the agent's resources and for the agent
to converge its Node."""


def short_dir() -> Path:
    """A temp dir with a short path: AF_UNIX socket paths are limited to about 108 bytes."""
    return Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))


async def wait_until(check: Callable[[], T], timeout: float = 5.0, what: str = "condition", *,
                     blocking: bool = False) -> T:
    """Look at `check()` every POLL_S until it returns something true, and return that; fail naming `what`
    after `timeout` seconds. `blocking=True` runs each look on a worker thread (a synchronous API server
    client), so the event loop, and the agent on it, keeps running meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (result := await asyncio.to_thread(check) if blocking else check()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(POLL_S)
    return result


async def health_samples(monitor: HealthMonitor, count: int, timeout: float = 10.0) -> None:
    """Once the health monitor has taken `count` more samples (each replaces its telemetry whole): proof that
    that much of the agent's own time went by with it running."""
    for n in range(1, count + 1):
        last = monitor.telemetry
        await wait_until(lambda: monitor.telemetry is not last, timeout, f"health sample {n} of {count}")  # noqa: B023


@dataclass
class Rig:
    directory: Path
    fake: FakeNvml
    agent: Agent
    kubelet: StandInKubelet
    kube: NodeClient | None
    """The agent's Node (an InMemoryNode, or a NodeApi on the rig's kube-apiserver); None without one."""

    def stub(self, resource: str = "nvidia.com/gpu") -> api_pb2_grpc.DevicePluginStub:
        endpoint = self.kubelet.plugins[resource].endpoint
        channel = grpc.aio.insecure_channel(f"unix://{self.directory / endpoint}")
        return api_pb2_grpc.DevicePluginStub(channel)

    def devices(self, resource: str = "nvidia.com/gpu") -> list[api_pb2.Device]:
        return self.kubelet.plugins[resource].devices

    def open_streams(self, resource: str = "nvidia.com/gpu") -> int:
        """ListAndWatch streams the agent holds open for `resource` now (the kubelet's among them)."""
        return self.agent.plugins.plugins[resource].servicer.open_streams

    def health(self, resource: str = "nvidia.com/gpu") -> list[str]:
        """The health of each device of `resource` as the kubelet last heard it; [] before it heard any."""
        view = self.kubelet.plugins.get(resource)
        return [d.health for d in view.devices] if view else []

    @property
    def metrics_port(self) -> int:
        """The port of the agent's HTTP endpoint (started with `metrics_port`)."""
        assert self.agent.http is not None, "the agent was started without a metrics port"
        return self.agent.http.port

    def uuid(self, index: int) -> str:
        return self.agent.bus.current.inventory.gpus[index].uuid

    def restarts(self) -> dict[str, float]:
        """Supervised task restarts so far, by task."""
        return {
            s.labels["task"]: s.value
            for family in self.agent.metrics.registry.collect() if family.name == "gpu_agent_task_restarts"
            for s in family.samples if s.name == "gpu_agent_task_restarts_total"
        }

    async def converged(self, timeout: float = CONVERGE_S) -> int:
        """Once the Node shows the newest NodeState (or a newer one): the version it shows."""
        reconciler = self.agent.reconciler
        assert reconciler is not None, "the agent runs without a Node"
        return await asyncio.wait_for(reconciler.converged_at(self.agent.bus.current.version), timeout)

    async def restart_kubelet(self) -> None:
        """What a kubelet restart does: the old server goes, every socket in the dir is removed, a new one serves."""
        await self.kubelet.stop()
        for path in self.directory.iterdir():
            if path.is_socket():
                path.unlink()
        self.kubelet = StandInKubelet(self.directory)
        await self.kubelet.start()


@asynccontextmanager
async def running_agent(
    node: str = "dgx-h100",
    config: AgentConfig = DEFAULT_CONFIG,
    *,
    kube: NodeClient | None = None,
    fake: FakeNvml | None = None,
    backend: NvmlBackend | None = None,
    kubelet_first: bool = True,
    config_path: Path | None = None,
    metrics_port: int | None = None,
    directory: Path | None = None,
    timeout: float = CONVERGE_S,
    await_node: bool = True,
    gpu_identities: Path | None = None,
    cordon_file: Path | None = None,
) -> AsyncIterator[Rig]:
    """The agent on the fake NVML of preset `node` (or `fake`, or a `backend` over it), serving a stand-in
    kubelet in a short directory of its own, removed afterwards (or in `directory`, which stays) and, with
    `kube`, keeping that Node (the agent closes the client when it stops). Yields once the kubelet lists every
    advertised resource (unless the kubelet starts after the agent, `kubelet_first=False`) and the Node shows
    the first NodeState. The MIG state stays in that directory unless the config names another;
    `metrics_port` 0 picks a free port; `timeout` bounds each of the two waits; `await_node=False` yields
    without waiting for the Node (one that never answers); `gpu_identities`: the file where the agent keeps
    what it read of each GPU (AgentOptions.gpu_identities; by default none); `cordon_file`: where it keeps the
    cordoned GPUs (AgentOptions.cordon_file; by default none)."""
    made = directory is None
    directory = directory or short_dir()
    fake = fake or FakeNvml(load_node(node))
    backend = backend or fake_backend(fake)
    kubelet = StandInKubelet(directory)
    if config.mig.state_dir == DEFAULT_CONFIG.mig.state_dir:
        # Never the host's /var/lib/gpu-node-agent: a test's MIG journal stays in its own directory.
        config = config.model_copy(update={"mig": config.mig.model_copy(update={"state_dir": directory / "mig"})})
    options = AgentOptions(config=config, kubelet_dir=directory, metrics_port=metrics_port, metrics_host="127.0.0.1",
                           kube=kube, config_path=config_path, gpu_identities=gpu_identities,
                           cordon_file=cordon_file)
    try:
        if kubelet_first:
            await kubelet.start()
        agent = await Agent.start(backend, options)
    except BaseException:
        await kubelet.stop()
        if made:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    rig = Rig(directory, fake, agent, kubelet, kube)
    try:
        if kubelet_first:
            await kubelet.wait_for(set(agent.devices()), timeout)
        if kube is not None and await_node:
            await rig.converged(timeout)
        yield rig
    finally:
        await rig.kubelet.stop()  # first: its ListAndWatch streams would hold the agent's shutdown for the grace
        await agent.stop()
        if made:
            shutil.rmtree(directory, ignore_errors=True)


def carve_mig(fake: FakeNvml, gpu: int, instances: list[tuple[str, int]]) -> None:
    """Enable MIG on a GPU of the fake and create (profile, start) instances, each with one full compute
    instance, through the same pynvml calls an operator's tool makes."""
    fake.nvmlInit()
    try:
        handle = fake.nvmlDeviceGetHandleByIndex(gpu)
        fake.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        if fake.nvmlDeviceGetMigMode(handle)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            fake.reset_gpu(gpu)  # Ampere applies a MIG mode change only at a GPU reset
            handle = fake.nvmlDeviceGetHandleByIndex(gpu)
        model = fake.spec.gpus[gpu].model
        for name, start in instances:
            profile = model.profile_by_name(name)
            assert profile is not None, name
            info = fake.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile.index)
            placement = pynvml.c_nvmlGpuInstancePlacement_t(start, profile.memory_slices)
            gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(placement))
            ci = fake.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, profile.ci_profile_index, 0)
            fake.nvmlGpuInstanceCreateComputeInstance(gi, ci.id)
    finally:
        fake.nvmlShutdown()


def gpu_instances(fake: FakeNvml, gpu: int) -> list[tuple[int, int, int]]:
    """(placement start, size, compute instances) of each GPU instance of a GPU in MIG mode, by the fake's own
    MIG calls."""
    fake.nvmlInit()
    try:
        handle = fake.nvmlDeviceGetHandleByIndex(gpu)
        found = []
        for slot in range(fake.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError_NotFound:
                continue
            gi = fake.nvmlDeviceGetGpuInstanceById(handle, fake.nvmlDeviceGetGpuInstanceId(mig))
            info = fake.nvmlGpuInstanceGetInfo(gi)
            found.append((int(info.placement.start), int(info.placement.size), 1))
        return sorted(found)
    finally:
        fake.nvmlShutdown()
