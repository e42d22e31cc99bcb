"""A driver that stops answering: an NVML call past its deadline makes the GPU it concerns Unhealthy and the node
`NvmlUnresponsive` while the kubelet's calls and XIDs on other GPUs are still served; NVML answering again ends
the episode in one line and the usual recovery; SIGTERM with the whole driver hung ends the agent within the
DaemonSet's grace period."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from agent.config import parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import InMemoryNode
from tests.faults.agent_process import collect_lines, free_port, http_get
from tests.plugin_harness import running_agent, short_dir, wait_until

AGENT = [sys.executable, "-m", "agent.cli"]
PRESET = load_node("dgx-h100")
UUIDS = [g.uuid for g in PRESET.gpus]
DEADLINE_S = 1.0
TAINT = {"key": "gpu-node-agent.io/gpu-fault", "value": "true", "effect": "NoSchedule"}
STUCK = f"NVML unresponsive: the health sample on GPU 3 did not return within {DEADLINE_S:g}s"
CONFIG = {"version": "v1", "telemetry": {"dcgmMetrics": False},
          "health": {"sampleIntervalSeconds": 0.1, "recoveryChecks": 2, "nvmlDeadlineSeconds": DEADLINE_S}}
"""Without dcgm-exporter's counters, the health sample is the only reader of GPU 3, so the call that hangs is
known to be its sample of GPU 3."""


def series(rig: object, name: str) -> list[object]:
    registry = rig.agent.metrics.registry  # type: ignore[attr-defined]
    return [s for family in registry.collect() for s in family.samples if s.name == name]


def metric(rig: object, name: str) -> float:
    registry = rig.agent.metrics.registry  # type: ignore[attr-defined]
    return next(s.value for family in registry.collect() for s in family.samples if s.name == name)


async def test_a_hung_gpu_is_unhealthy_within_its_deadline_and_the_rest_is_served(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.health.monitor")
    node = InMemoryNode("gpu-node-1")
    fake = FakeNvml(PRESET)
    async with running_agent("dgx-h100", parse_config(yaml.safe_dump(CONFIG)), kube=node, fake=fake) as rig:
        try:
            fake.set_hung(3)
            hung_at = time.monotonic()
            await wait_until(lambda: rig.health()[3] == "Unhealthy", DEADLINE_S + 2, "GPU 3 unhealthy")
            assert time.monotonic() - hung_at <= DEADLINE_S + 2
            await rig.converged(5)
            assert node.view.taints == (TAINT,)
            condition = node.view.conditions["GPUHealthy"]
            assert (condition.status, condition.reason, condition.message) == ("False", "NvmlUnresponsive", STUCK)
            assert node.events[-1] == ("Warning", "GPUFault", f"GPU {UUIDS[3]}: {STUCK}")
            assert rig.agent._ready() == (False, rig.agent.monitor.stuck.describe())  # type: ignore[union-attr]
            assert metric(rig, "gpu_agent_nvml_call_age_seconds") > DEADLINE_S
            assert metric(rig, "gpu_agent_nvml_overdue_calls_total") == 1
            # GPU 3's reading is not served as current; the other GPUs are still sampled, on another worker.
            def sampled() -> list[str]:
                found = series(rig, "gpu_agent_gpu_temperature_celsius")
                return sorted(s.labels["gpu"] for s in found)  # type: ignore[attr-defined]
            before = rig.agent.monitor.sampled_at
            others = ["0", "1", "2", "4", "5", "6", "7"]
            await wait_until(lambda: rig.agent.monitor.sampled_at != before and sampled() == others, 5,
                             "the other GPUs sampled, GPU 3 without a reading")

            # The kubelet is served meanwhile, and an XID on another GPU is taken.
            request = api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[UUIDS[0]])])
            response = await rig.stub().Allocate(request, timeout=2)
            assert [dict(c.envs) for c in response.container_responses] == [{"NVIDIA_VISIBLE_DEVICES": UUIDS[0]}]
            fake.inject_xid(5, 48)
            await wait_until(lambda: rig.health()[5] == "Unhealthy", 2, "GPU 5 unhealthy after its XID")
            assert rig.health() == ["Healthy"] * 3 + ["Unhealthy", "Healthy", "Unhealthy", "Healthy", "Healthy"]

            # NVML answers again: one line, and GPU 3 recovers after the clean samples, as any fault does.
            fake.set_hung(3, False)
            await wait_until(lambda: rig.agent.monitor.stuck is None and rig.health() == ["Healthy"] * 8, 5,
                             "every GPU healthy again")
            await rig.converged(5)
            assert node.view.taints == ()
            assert node.view.conditions["GPUHealthy"].reason == "GPUsHealthy"
            assert node.events[-2:] == [
                ("Normal", "GPURecovered", f"GPU {UUIDS[3]}: recovered from {STUCK}"),
                ("Normal", "GPURecovered", f"GPU {UUIDS[5]}: recovered from XID 48")] or node.events[-2:] == [
                ("Normal", "GPURecovered", f"GPU {UUIDS[5]}: recovered from XID 48"),
                ("Normal", "GPURecovered", f"GPU {UUIDS[3]}: recovered from {STUCK}")]
            answers = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NVML answers again")]
            assert len(answers) == 1
            assert answers[0].startswith("NVML answers again: the health sample on GPU 3 returned after about ")
            assert metric(rig, "gpu_agent_nvml_overdue_calls_total") == 1
            assert len(series(rig, "gpu_agent_gpu_temperature_celsius")) == 8
            assert rig.restarts() == {}
        finally:
            fake.set_hung(3, False)


async def test_sigterm_with_the_driver_hung_exits_within_the_grace_period(tmp_path: Path) -> None:
    state = tmp_path / "nvml-state.json"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "mig": {"stateDir": str(tmp_path / "state")}}))
    fake = FakeNvml(PRESET, state)
    directory = short_dir()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--nvml", "mock:dgx-h100", "--mock-state", str(state), "--kubelet-dir", str(directory),
        "--config", str(config), "--no-kube", "--metrics-port", str(port), stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    lines: list[str] = []
    reader = asyncio.create_task(collect_lines(proc.stderr, lines))
    try:
        await wait_until(lambda: any("agent started" in line for line in lines), 20, "the agent to start")
        fake.set_hung(None)  # the whole driver
        await asyncio.sleep(DEADLINE_S + 1.5)
        # The endpoint answers at once all the same: alive, and not ready, saying why.
        started = time.monotonic()
        assert await http_get(port, "/healthz") == (200, "ok\n")
        ready = await http_get(port, "/readyz")
        assert time.monotonic() - started < 1.0
        assert ready is not None and ready[0] == 503 and "unanswered for" in ready[1], ready
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)
        stopped_in = time.monotonic() - sent
        await asyncio.wait_for(reader, 5)
    finally:
        fake.set_hung(None, False)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        with contextlib.suppress(OSError):
            leftovers = sorted(p.name for p in directory.iterdir())
        shutil.rmtree(directory, ignore_errors=True)
    assert proc.returncode == 0, "\n".join(lines)
    assert stopped_in < 10
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    # One line for each call past its deadline: the wait for events, and the health sample of the GPU it had come
    # to when the driver hung (then of the next one, on a new worker, if that one too ran past its deadline).
    stuck = [line.split(": ", 1)[1].split(" unanswered")[0] for line in lines
             if " WARNING agent.health.monitor: NVML call " in line]
    samples = [call for call in stuck if re.fullmatch(r"NVML call the health sample on GPU \d", call)]
    assert sorted(stuck) == sorted(["NVML call nvmlEventSetWait", *samples]), "\n".join(lines)
    assert 1 <= len(samples) == len(set(samples)), "\n".join(lines)
    assert len([line for line in lines if "stopping without shutting NVML down: NVML call" in line]) == 1, (
        "\n".join(lines))
    assert [name for name in leftovers if name.endswith(".sock")] == []


async def test_an_agent_started_while_a_gpu_hangs_serves_the_others_and_takes_the_gpu_once_it_answers() -> None:
    node = InMemoryNode("gpu-node-1")
    fake = FakeNvml(PRESET)
    fake.set_hung(3)
    started = time.monotonic()
    try:
        async with running_agent("dgx-h100", parse_config(yaml.safe_dump(CONFIG)), kube=node, fake=fake) as rig:
            # The first inventory waits for GPU 3 at most its deadline, the first sample as long again.
            assert time.monotonic() - started < 4 * DEADLINE_S + 3
            await rig.converged(5)
            assert [d.ID for d in rig.devices()] == [*UUIDS[:3], "GPU-lost-nvml-3", *UUIDS[4:]]
            assert rig.health() == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4
            assert node.view.taints == (TAINT,)
            fake.set_hung(3, False)
            await wait_until(lambda: [d.ID for d in rig.devices()] == UUIDS and rig.health() == ["Healthy"] * 8, 10,
                             "GPU 3 read whole and healthy")
            await rig.converged(5)
            assert node.view.taints == ()
            assert rig.restarts() == {}
    finally:
        fake.set_hung(3, False)


async def test_a_second_gpu_that_hangs_while_one_does_is_reported_too() -> None:
    fake = FakeNvml(PRESET)
    async with running_agent("dgx-h100", parse_config(yaml.safe_dump(CONFIG)), fake=fake) as rig:
        try:
            fake.set_hung(3)
            await wait_until(lambda: rig.health()[3] == "Unhealthy", DEADLINE_S + 2, "GPU 3 unhealthy")
            fake.set_hung(5)
            # GPU 5's sample is asked for once the sample loop comes to it (at most a wait on GPU 3's later), and
            # hangs on a worker of its own: past its deadline it is reported as well.
            await wait_until(lambda: rig.health()[5] == "Unhealthy", DEADLINE_S + 2 * DEADLINE_S + 2,
                             "GPU 5 unhealthy as well")
            assert rig.health() == ["Healthy"] * 3 + ["Unhealthy", "Healthy", "Unhealthy", "Healthy", "Healthy"]
            fake.set_hung(3, False)
            fake.set_hung(5, False)
            await wait_until(lambda: rig.health() == ["Healthy"] * 8 and rig.agent.monitor.stuck is None, 10,
                             "every GPU healthy again")
        finally:
            fake.set_hung(3, False)
            fake.set_hung(5, False)
