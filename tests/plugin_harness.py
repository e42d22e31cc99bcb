"""Shared test helpers: a short socket directory, an agent on the fake NVML, and a test kubelet."""

from __future__ import annotations

import asyncio
import ctypes
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pynvml

from agent.config import DEFAULT_CONFIG, AgentConfig
from agent.daemon import Agent, AgentOptions
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import StandInKubelet


def short_dir() -> Path:
    """A temp dir with a short path: AF_UNIX socket paths are limited to about 108 bytes."""
    return Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Rig:
    directory: Path
    fake: FakeNvml
    agent: Agent
    kubelet: StandInKubelet

    def stub(self, resource: str = "nvidia.com/gpu") -> api_pb2_grpc.DevicePluginStub:
        endpoint = self.kubelet.plugins[resource].endpoint
        channel = grpc.aio.insecure_channel(f"unix://{self.directory / endpoint}")
        return api_pb2_grpc.DevicePluginStub(channel)

    def devices(self, resource: str = "nvidia.com/gpu") -> list[api_pb2.Device]:
        return self.kubelet.plugins[resource].devices

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
    kubelet_first: bool = True,
    config_path: Path | None = None,
    fake: FakeNvml | None = None,
    metrics_port: int | None = None,
) -> AsyncIterator[Rig]:
    directory = short_dir()
    fake = fake or FakeNvml(load_node(node))
    backend = fake_backend(fake)
    kubelet = StandInKubelet(directory)
    if kubelet_first:
        await kubelet.start()
    if config.mig.state_dir == DEFAULT_CONFIG.mig.state_dir:
        # Never the host's /var/lib/gpu-node-agent: a test's MIG journal stays in its own directory.
        config = config.model_copy(update={"mig": config.mig.model_copy(update={"state_dir": directory / "mig"})})
    options = AgentOptions(config=config, kubelet_dir=directory, metrics_port=metrics_port, metrics_host="127.0.0.1",
                           config_path=config_path)
    agent = Agent(backend, options)
    rig = Rig(directory, fake, agent, kubelet)
    try:
        await agent.start()
        if kubelet_first:
            await kubelet.wait_for(set(agent.devices()), 10)
        yield rig
    finally:
        await agent.stop()
        await rig.kubelet.stop()
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
