"""SIGTERM to a running `gpu-agent run`: under a stream of Allocate calls it exits 0 within a bound, removes its
socket and leaves no call hanging; while it still waits for NVML it stops at once instead of retrying on."""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
from pathlib import Path

import grpc

from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import StandInKubelet
from tests.plugin_harness import short_dir, wait_until

AGENT = [sys.executable, "-m", "agent.cli"]
RESOURCE = "nvidia.com/gpu"
CLIENTS = 32
"""Concurrent callers, each sending its next Allocate as soon as the last is answered."""
CALLS_BEFORE_SIGTERM = 300
CALL_TIMEOUT_S = 10.0
"""Far beyond an Allocate's time: a call that runs into it hung."""
EXIT_S = 5.0
"""The agent gives in-flight calls 1 s, then removes its socket and exits."""
ENDED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
"""What a call the stopping server did not answer may end with; never DEADLINE_EXCEEDED (a hang)."""


async def start_agent(directory: Path, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *AGENT, "run", "--kubelet-dir", str(directory), "--no-kube", "--metrics-port", "0", *extra,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_sigterm_under_a_stream_of_allocate_calls_answers_or_ends_each_and_exits_zero() -> None:
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    proc = await start_agent(directory, "--nvml", "mock:dgx-h100")
    loop = asyncio.get_running_loop()
    outcomes: list[tuple[str, str, object]] = []
    try:
        await kubelet.wait_for({RESOURCE}, 30)
        socket = directory / kubelet.plugins[RESOURCE].endpoint
        ids = [d.ID for d in kubelet.plugins[RESOURCE].devices]
        assert len(ids) == 8
        channel = grpc.aio.insecure_channel(f"unix://{socket}")
        stub = api_pb2_grpc.DevicePluginStub(channel)

        async def caller(n: int) -> None:
            for i in range(1_000_000):  # bounded by the first failure: the server is gone
                device = ids[(n + i) % len(ids)]
                request = api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[device])])
                try:
                    response = await stub.Allocate(request, timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as err:
                    outcomes.append(("failed", device, err.code()))
                    return
                outcomes.append(("answered", device, [dict(c.envs) for c in response.container_responses]))

        callers = [asyncio.create_task(caller(n)) for n in range(CLIENTS)]
        await wait_until(lambda: len(outcomes) >= CALLS_BEFORE_SIGTERM, 20, "the stream of calls to flow")
        assert {kind for kind, _, _ in outcomes} == {"answered"}
        sent = loop.time()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), EXIT_S + 5)
        took = loop.time() - sent
        await asyncio.wait_for(asyncio.gather(*callers), CALL_TIMEOUT_S + 5)
        await channel.close()
        assert proc.stderr is not None
        stderr = (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await kubelet.stop()

    try:
        assert code == 0, stderr
        assert took < EXIT_S
        assert not socket.exists()
        assert "Traceback" not in stderr, stderr
        assert "signal received; shutting down" in stderr
        answered = [(device, envs) for kind, device, envs in outcomes if kind == "answered"]
        failed = [(device, status) for kind, device, status in outcomes if kind == "failed"]
        assert len(failed) == CLIENTS  # each caller's stream ended in a status, none hung
        assert {status for _, status in failed} <= ENDED, failed
        assert all(envs == [{"NVIDIA_VISIBLE_DEVICES": device}] for device, envs in answered)
        assert len(answered) >= CALLS_BEFORE_SIGTERM
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_sigterm_while_waiting_for_nvml_exits_zero_at_once(tmp_path: Path) -> None:
    state = tmp_path / "nvml-state.json"
    FakeNvml(load_node("single-h200"), state).set_driver_loaded(False)
    directory = short_dir()
    proc = await start_agent(directory, "--nvml", "mock:single-h200", "--mock-state", str(state))
    assert proc.stderr is not None
    loop = asyncio.get_running_loop()
    lines: list[str] = []
    try:
        while not any("(attempt 1 of 5)" in line for line in lines):
            line = await asyncio.wait_for(proc.stderr.readline(), 15)
            assert line, f"the agent ended before its first NVML retry: {lines}"
            lines.append(line.decode().rstrip("\n"))
        sent = loop.time()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)
        took = loop.time() - sent
        lines += (await proc.stderr.read()).decode().splitlines()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
    # A pod being deleted must not sit out the remaining retries (1 + 2 + 3 + 4 s) and then report an error.
    assert (code, took < EXIT_S) == (0, True), "\n".join(lines)
    assert not any("Traceback" in line or "error:" in line for line in lines), "\n".join(lines)
