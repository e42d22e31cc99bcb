"""NVML faults: no driver at start (bounded retries, unready meanwhile, one clear line at the end), a driver that
loads during the retries, a GPU falling off the bus at run time, and a transient NVML error while sampling."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
from pathlib import Path

import grpc
import pynvml
import pytest

from agent.config import parse_config
from agent.daemon import NVML_INIT_ATTEMPTS, NVML_INIT_BACKOFF_S
from agent.deviceplugin.v1beta1 import api_pb2
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import InMemoryNode, StandInKubelet
from tests.faults.agent_process import collect_lines, free_port, http_get
from tests.plugin_harness import running_agent, short_dir, wait_until

AGENT = [sys.executable, "-m", "agent.cli"]
RESOURCE = "nvidia.com/gpu"
FAST_HEALTH = parse_config("version: v1\nhealth:\n  sampleIntervalSeconds: 0.1\n  recoveryChecks: 2\n")
TAINT = {"key": "gpu-node-agent.io/gpu-fault", "value": "true", "effect": "NoSchedule"}
LOST = "GPU is lost (fallen off the bus)"
BACKOFF_TOTAL_S = sum(NVML_INIT_BACKOFF_S * attempt for attempt in range(1, NVML_INIT_ATTEMPTS))
"""The agent sleeps 1, 2, 3 and 4 s between its five attempts: it cannot give up sooner than this."""
GIVE_UP_S = BACKOFF_TOTAL_S + 8.0
"""...and must give up well before the kubelet's probes would have restarted it many times over."""






def state_without_driver(path: Path, preset: str) -> FakeNvml:
    """A fake NVML state file, shared with the agent's process, whose driver is not loaded."""
    fake = FakeNvml(load_node(preset), path)
    fake.set_driver_loaded(False)
    return fake


async def answers(port: int, path: str, expected: tuple[int, str], timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (got := await http_get(port, path)) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"{path} answered {got}, not {expected}"
        await asyncio.sleep(0.05)




async def test_no_driver_at_start_retries_unready_then_gives_up_with_one_line(tmp_path: Path) -> None:
    state = tmp_path / "nvml-state.json"
    state_without_driver(state, "single-h200")
    directory = short_dir()
    port = free_port()
    loop = asyncio.get_running_loop()
    started = loop.time()
    proc = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--nvml", "mock:single-h200", "--mock-state", str(state), "--kubelet-dir", str(directory),
        "--no-kube", "--metrics-port", str(port), stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    reader = asyncio.create_task(collect_lines(proc.stderr, lines))
    ready: list[tuple[int, str] | None] = []
    live: list[tuple[int, str] | None] = []
    try:
        while proc.returncode is None and loop.time() - started < GIVE_UP_S:
            ready.append(await http_get(port, "/readyz"))
            live.append(await http_get(port, "/healthz"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.25)
        await asyncio.wait_for(proc.wait(), max(0.1, GIVE_UP_S - (loop.time() - started)))
        elapsed = loop.time() - started
        await asyncio.wait_for(reader, 5)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(directory, ignore_errors=True)

    assert proc.returncode == 1
    assert BACKOFF_TOTAL_S <= elapsed < GIVE_UP_S, "\n".join(lines)
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    assert lines[-1] == "gpu-agent run: error: NVML initialisation failed: Driver Not Loaded"
    assert [line for line in lines if "error" in line.lower()] == [lines[-1]]
    retries = [line.split(": ", 1)[1] for line in lines if " WARNING agent.daemon: " in line]
    assert retries == [f"NVML initialisation failed: Driver Not Loaded (attempt {n} of {NVML_INIT_ATTEMPTS})"
                       for n in range(1, NVML_INIT_ATTEMPTS)]
    # Whenever the endpoint answered during the retries, the agent was alive but not ready.
    answered = [r for r in ready if r is not None]
    assert answered, "/readyz never answered while the agent retried"
    assert set(answered) == {(503, "NVML not initialised\n")}
    assert {r for r in live if r is not None} == {(200, "ok\n")}


async def test_a_driver_that_loads_during_the_retries_brings_the_agent_up(tmp_path: Path) -> None:
    state = tmp_path / "nvml-state.json"
    operator = state_without_driver(state, "single-h200")
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--nvml", "mock:single-h200", "--mock-state", str(state), "--kubelet-dir", str(directory),
        "--no-kube", "--metrics-port", str(port), stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    reader = asyncio.create_task(collect_lines(proc.stderr, lines))
    try:
        await wait_until(lambda: any("(attempt 1 of 5)" in line for line in lines), 15, "the first failed attempt")
        assert await http_get(port, "/readyz") == (503, "NVML not initialised\n")
        operator.set_driver_loaded(True)
        await kubelet.wait_for({RESOURCE}, 15)
        assert [d.health for d in kubelet.plugins[RESOURCE].devices] == ["Healthy"]
        await answers(port, "/readyz", (200, "ok\n"), 5)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        await asyncio.wait_for(reader, 5)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert [line.split(": ", 1)[1] for line in lines if " WARNING agent.daemon: " in line][:1] == [
        "NVML initialisation failed: Driver Not Loaded (attempt 1 of 5)"]
    assert not any("Traceback" in line or "error:" in line for line in lines), "\n".join(lines)


# --- run-time faults, in process: the agent on the fake, a test kubelet and an in-memory Node --------------


def allocate_request(*ids: str) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(ids))])


async def test_a_gpu_lost_at_run_time_is_unhealthy_taints_the_node_and_the_others_keep_allocating() -> None:
    node = InMemoryNode("gpu-node-1")
    async with running_agent("dgx-h100", FAST_HEALTH, kube=node) as rig:
        assert rig.health() == ["Healthy"] * 8
        rig.fake.set_gpu_lost(3)
        await wait_until(lambda: rig.health() == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4, 5,
                         "GPU 3 unhealthy in ListAndWatch")
        await rig.converged(5)
        assert node.view.taints == (TAINT,)
        condition = node.view.conditions["GPUHealthy"]
        assert (condition.status, condition.reason, condition.message) == ("False", "NodeGPUFault", LOST)
        assert node.events == [("Warning", "GPUFault", f"GPU {rig.uuid(3)}: {LOST}")]
        assert rig.kubelet.capacity() == ({RESOURCE: "8"}, {RESOURCE: "7"})

        stub = rig.stub()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Allocate(allocate_request(rig.uuid(3)), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == f"device {rig.uuid(3)} of resource {RESOURCE} is unhealthy: {LOST}"
        others = [rig.uuid(i) for i in (0, 1, 2, 4, 5, 6, 7)]
        response = await stub.Allocate(allocate_request(*others), timeout=5)
        assert [dict(c.envs) for c in response.container_responses] == [{"NVIDIA_VISIBLE_DEVICES": ",".join(others)}]

        # Back on the bus: healthy again after the configured clean samples; taint and condition go away.
        rig.fake.set_gpu_lost(3, False)
        await wait_until(lambda: rig.health() == ["Healthy"] * 8, 5, "GPU 3 healthy again")
        await rig.converged(5)
        assert node.view.taints == ()
        assert node.events == [("Warning", "GPUFault", f"GPU {rig.uuid(3)}: {LOST}"),
                                   ("Normal", "GPURecovered", f"GPU {rig.uuid(3)}: recovered from {LOST}")]
        assert rig.restarts() == {}


async def test_the_xid_of_a_gpu_falling_off_the_bus_is_counted_without_restarting_the_monitor() -> None:
    # A GPU that falls off the bus raises XID 79 as it goes: the event names a device that now answers every
    # call with GpuIsLost.
    node = InMemoryNode("gpu-node-1")
    async with running_agent("dgx-h100", FAST_HEALTH, kube=node) as rig:
        rig.fake.set_gpu_lost(3)
        rig.fake.inject_xid(3, 79)
        await wait_until(lambda: rig.health()[3] == "Unhealthy", 5, "GPU 3 unhealthy in ListAndWatch")
        monitor = rig.agent.monitor
        await wait_until(lambda: monitor.events_seen >= 1 or bool(rig.restarts()), 5, "the XID to be taken")
        assert monitor.xid_counts == {(rig.uuid(3), 79): 1}
        assert rig.restarts() == {}
        await rig.converged(5)
        assert node.view.taints == (TAINT,)


async def test_a_transient_nvml_error_while_sampling_is_skipped_and_faults_still_register() -> None:
    node = InMemoryNode("gpu-node-1")
    async with running_agent("dgx-h100", FAST_HEALTH, kube=node) as rig:
        monitor = rig.agent.monitor
        # The next ECC query fails once with an error NVML gives for no particular reason.
        rig.fake.fail_next("nvmlDeviceGetTotalEccErrors", pynvml.NVML_ERROR_UNKNOWN)
        await wait_until(lambda: monitor.read_errors == 1, 5, "the failed sample")
        last_sample = monitor.telemetry
        await wait_until(lambda: monitor.telemetry is not last_sample, 5, "the next sample")
        # A transient error says nothing about the GPUs: all stay healthy and the node untouched.
        assert rig.health() == ["Healthy"] * 8
        assert node.view.taints == ()
        assert node.events == []
        # The monitor kept running (no restart, so no XID was missed) and still judges faults.
        rig.fake.inject_xid(6, 48)
        await wait_until(lambda: rig.health()[6] == "Unhealthy", 5, "GPU 6 unhealthy after the XID")
        await rig.converged(5)
        assert node.events[0] == ("Warning", "GPUFault", f"GPU {rig.uuid(6)}: XID 48")
        assert rig.restarts() == {}
        assert monitor.read_errors == 1
        response = await rig.stub().Allocate(allocate_request(rig.uuid(0)), timeout=5)
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": rig.uuid(0)}


async def test_fail_on_init_error_false_serves_nothing_and_stays_up(tmp_path: Path) -> None:
    # NVIDIA's failOnInitError: false, for a DaemonSet that also lands on nodes without GPUs.
    state = tmp_path / "nvml-state.json"
    state_without_driver(state, "single-h200")
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n  failOnInitError: false\n")
    directory = short_dir()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--nvml", "mock:single-h200", "--mock-state", str(state), "--kubelet-dir", str(directory),
        "--no-kube", "--metrics-port", str(port), "--config", str(config), stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    reader = asyncio.create_task(collect_lines(proc.stderr, lines))
    idle = ("serving nothing: NVML initialisation failed: Driver Not Loaded (flags.failOnInitError is false)")
    try:
        # The idle answer comes once the retries are over and the start has returned: from here on the agent
        # waits for a signal, serving its endpoint, and nothing in it runs out.
        await answers(port, "/readyz", (200, idle + "\n"), GIVE_UP_S)
        assert await http_get(port, "/healthz") == (200, "ok\n")
        assert proc.returncode is None
        assert not [p for p in directory.iterdir() if p.is_socket()]  # no resource served
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        await asyncio.wait_for(reader, 5)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    assert [line.split(": ", 1)[1] for line in lines if " ERROR agent.daemon: " in line] == [idle]
    # The signal found the agent running (not still starting): it was up from the idle answer to the signal.
    assert [line.split(": ", 1)[1] for line in lines if " INFO agent.daemon: " in line] == [
        "signal received; shutting down"]


async def test_an_xid_while_the_monitor_restarts_is_not_lost() -> None:
    node = InMemoryNode("gpu-node-1")
    async with running_agent("dgx-h100", FAST_HEALTH, kube=node) as rig:
        monitor = rig.agent.monitor
        # A sample fails with an error that ends the monitor's run; the supervisor restarts it after a backoff.
        rig.fake.fail_next("nvmlDeviceGetUUID", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        await wait_until(lambda: rig.restarts().get("health") == 1, 10, "the health task restarted")
        # The XID lands while the monitor is down (inside the restart backoff) ...
        rig.fake.inject_xid(2, 79)
        # ... and is taken once it runs again: the event set stayed registered.
        await wait_until(lambda: rig.health()[2] == "Unhealthy", 10, "GPU 2 unhealthy after the XID")
        assert monitor.xid_counts == {(rig.uuid(2), 79): 1}


async def test_an_xid_after_a_failed_wait_for_events_is_not_lost() -> None:
    node = InMemoryNode("gpu-node-1")
    async with running_agent("dgx-h100", FAST_HEALTH, kube=node) as rig:
        monitor = rig.agent.monitor
        # The wait for events fails (a driver hiccup); the supervisor restarts the monitor after a backoff ...
        rig.fake.fail_next("nvmlEventSetWait_v2", pynvml.NVML_ERROR_UNKNOWN)
        await wait_until(lambda: rig.restarts().get("health") == 1, 10, "the health task restarted")
        # ... the XID that lands meanwhile is kept by the event set, which stayed registered ...
        rig.fake.inject_xid(3, 79)
        await wait_until(lambda: rig.health()[3] == "Unhealthy", 10, "GPU 3 unhealthy after the XID")
        assert monitor.xid_counts == {(rig.uuid(3), 79): 1}

