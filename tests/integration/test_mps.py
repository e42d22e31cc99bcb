"""MPS sharing end to end on the fake DGX H100: the agent starts one control daemon per shared GPU (the stand-in
tests/mps/nvidia-cuda-mps-control takes the real program's place and logs what it was started with and sent),
withholds the replicas until the daemon is up, restarts a daemon that dies, and hands a container what a CUDA
process needs to join its GPU's daemon."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent.config import parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.labels import node_labels
from tests.plugin_harness import running_agent, short_dir, wait_until

STAND_IN = Path(__file__).resolve().parents[1] / "mps" / "nvidia-cuda-mps-control"
H100_MIB = 81559
"""Total memory of the fake H100 80GB HBM3 as NVML reports it, in MiB."""


@pytest.fixture
def roots() -> Iterator[tuple[Path, Path]]:
    """(driver root holding usr/bin/nvidia-cuda-mps-control, MPS root); every daemon left is killed after."""
    top = short_dir()
    driver, mps = top / "driver", top / "mps"
    (driver / "usr" / "bin").mkdir(parents=True)
    shutil.copy(STAND_IN, driver / "usr" / "bin" / "nvidia-cuda-mps-control")
    yield driver, mps
    for log in mps.glob("*/log/control.log"):
        for line in log.read_text().splitlines():
            if line.startswith("started pid="):
                pid = int(line.split()[1].removeprefix("pid="))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    shutil.rmtree(top, ignore_errors=True)


def mps_config(driver: Path, mps: Path, extra: str = "") -> str:
    return (f"version: v1\nflags:\n  mpsRoot: {mps}\n  plugin:\n    containerDriverRoot: {driver}\n"
            f"sharing:\n  mps:\n{extra}    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")


def control_log(mps: Path, uuid: str) -> list[str]:
    path = mps / uuid / "log" / "control.log"
    return path.read_text().splitlines() if path.exists() else []


async def test_one_daemon_per_gpu_with_its_limits_then_four_replicas_each(roots: tuple[Path, Path]) -> None:
    driver, mps = roots
    config = parse_config(mps_config(driver, mps))
    async with running_agent(config=config) as rig:
        gpus = rig.agent.bus.current.inventory.gpus if rig.agent.bus else ()
        await wait_until(lambda: len(rig.devices()) == 32, 15, "32 MPS replicas advertised")
        for gpu in gpus:
            lines = control_log(mps, gpu.uuid)
            started = json.loads(lines[0].split(" env=", 1)[1])
            assert started == {
                "CUDA_MPS_LOG_DIRECTORY": str(mps / gpu.uuid / "log"),
                "CUDA_MPS_PIPE_DIRECTORY": str(mps / gpu.uuid / "pipe"),
                "CUDA_VISIBLE_DEVICES": gpu.uuid,
            }
            assert lines[1:] == ["command set_default_active_thread_percentage 25",
                                 f"command set_default_device_pinned_mem_limit 0 {H100_MIB // 4}M"]
        state = rig.agent.bus.current if rig.agent.bus else None
        assert state is not None
        labels = node_labels(state, state.config)
        assert (labels["nvidia.com/gpu.sharing-strategy"], labels["nvidia.com/mps.capable"],
                labels["nvidia.com/gpu.replicas"], labels["nvidia.com/gpu.product"]) == (
            "mps", "true", "4", "NVIDIA-H100-80GB-HBM3-SHARED")
    # The agent stopped: it told every daemon to quit.
    for gpu in gpus:
        assert control_log(mps, gpu.uuid)[-2:] == ["command quit", "stopped"]


async def test_allocate_gives_the_pipe_the_shares_and_refuses_two(roots: tuple[Path, Path]) -> None:
    driver, mps = roots
    async with running_agent(config=parse_config(mps_config(driver, mps))) as rig:
        await wait_until(lambda: len(rig.devices()) == 32, 15, "32 MPS replicas advertised")
        gpu0 = rig.devices()[0].ID.split("::")[0]
        response = await rig.stub().Allocate(api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=[f"{gpu0}::2"])]))
        (container,) = response.container_responses
        assert dict(container.envs) == {
            "NVIDIA_VISIBLE_DEVICES": gpu0,
            "CUDA_MPS_PIPE_DIRECTORY": "/mps/pipe",
            "CUDA_MPS_LOG_DIRECTORY": "/mps/log",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={H100_MIB // 4}M",
        }
        assert [(m.host_path, m.container_path) for m in container.mounts] == [
            (str(mps / gpu0 / "pipe"), "/mps/pipe"), (str(mps / gpu0 / "log"), "/mps/log"),
            (str(mps / "shm"), "/dev/shm")]
        # failRequestsGreaterThanOne is on by default for MPS, as NVIDIA's plugin has it.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rig.stub().Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=[f"{gpu0}::0", f"{gpu0}::1"])]))
        assert refused.value.details() == ("invalid request: maximum request size for shared resource "
                                           "nvidia.com/gpu is 1; found 2")


async def test_two_replicas_of_one_gpu_double_the_share_and_two_gpus_are_refused(roots: tuple[Path, Path]) -> None:
    driver, mps = roots
    config = parse_config(mps_config(driver, mps, "    failRequestsGreaterThanOne: false\n"))
    async with running_agent(config=config) as rig:
        await wait_until(lambda: len(rig.devices()) == 32, 15, "32 MPS replicas advertised")
        ids = [d.ID for d in rig.devices()]
        gpu0, gpu1 = ids[0].split("::")[0], ids[4].split("::")[0]
        preferred = await rig.stub().GetPreferredAllocation(api_pb2.PreferredAllocationRequest(container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=3)]))
        chosen = list(preferred.container_responses[0].deviceIDs)
        assert len({i.split("::")[0] for i in chosen}) == 1, chosen  # one GPU, so one daemon serves the pod
        response = await rig.stub().Allocate(api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=[f"{gpu0}::0", f"{gpu0}::1"])]))
        envs = response.container_responses[0].envs
        assert (envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
            "50", f"0={H100_MIB // 2}M")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rig.stub().Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=[f"{gpu0}::0", f"{gpu1}::0"])]))
        assert refused.value.details() == ("MPS replicas of nvidia.com/gpu from 2 GPUs cannot share one MPS "
                                           "client; ask for replicas of one GPU")


async def test_a_daemon_that_dies_is_restarted_and_its_replicas_come_back(roots: tuple[Path, Path]) -> None:
    driver, mps = roots
    async with running_agent(config=parse_config(mps_config(driver, mps))) as rig:
        await wait_until(lambda: len(rig.devices()) == 32, 15, "32 MPS replicas advertised")
        gpu0 = rig.devices()[0].ID.split("::")[0]
        pid = int(control_log(mps, gpu0)[0].split()[1].removeprefix("pid="))
        os.kill(pid, signal.SIGKILL)
        # The next check (every 5 s) finds it gone and starts a new one with the same limits.
        limits = ["command set_default_active_thread_percentage 25",
                  f"command set_default_device_pinned_mem_limit 0 {H100_MIB // 4}M"]
        await wait_until(lambda: sum(line.startswith("started") for line in control_log(mps, gpu0)) == 2
                         and control_log(mps, gpu0)[-2:] == limits, 20, "a second daemon for GPU 0, with its limits")
        await wait_until(lambda: len(rig.devices()) == 32, 15, "32 MPS replicas advertised again")


async def test_no_control_program_means_no_replicas_and_says_why(roots: tuple[Path, Path]) -> None:
    driver, mps = roots
    (driver / "usr" / "bin" / "nvidia-cuda-mps-control").unlink()
    saved = os.environ["PATH"]
    os.environ["PATH"] = str(driver)  # nothing called nvidia-cuda-mps-control on PATH either
    try:
        async with running_agent(config=parse_config(mps_config(driver, mps))) as rig:
            bus = rig.agent.bus
            await wait_until(lambda: len(bus.current.mps) == 8, 10, "the MPS status of 8 GPUs")
            assert rig.devices() == []
            (problem,) = rig.agent.plans(bus.current).problems
            assert problem.startswith("MPS replicas withheld until the GPU's MPS control daemon is up: GPU 0 "
                                      f"(nvidia-cuda-mps-control not found under {driver}/usr/bin or on PATH)")
    finally:
        os.environ["PATH"] = saved
