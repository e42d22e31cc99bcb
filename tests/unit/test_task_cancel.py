"""The agent's long-running loops stop when they are cancelled (Agent.stop cancels them and waits for each),
also when the cancellation arrives just as the state they wait for changes. On Python 3.11 a loop that waits
with asyncio.wait_for loses such a cancellation and runs on, and the agent's stop then never returns."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
import yaml

from agent.agent import STOP_TASK_S
from agent.config import AgentConfig, parse_config
from agent.mps import MpsDaemons
from agent.nvml.backend import NvmlBackend, fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvmlthread import NvmlThread
from agent.state import NodeState, StateBus
from agent.telemetry.collector import TelemetryCollector
from tests.plugin_harness import running_agent

OFFSETS = range(8)
"""Loop turns between the new state and the cancellation: wider than the window asyncio.wait_for has."""


def telemetry_config(interval: float) -> AgentConfig:
    return parse_config(yaml.safe_dump({"version": "v1", "telemetry": {"dcgmMetrics": False,
                                                                       "intervalSeconds": interval}}))


def new_bus(backend: NvmlBackend) -> StateBus:
    return StateBus(NodeState(version=1, inventory=backend.inventory(), config=telemetry_config(60)))


async def cancelled_as_the_state_changes(run: Callable[[], Awaitable[None]], change: Callable[[], Awaitable[object]],
                                         offset: int) -> None:
    task = asyncio.ensure_future(run())
    for _ in range(5):
        await asyncio.sleep(0)  # let the loop reach its wait
    assert not task.done()
    await change()
    for _ in range(offset):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done == {task}, f"the loop ran on after a cancellation {offset} loop turns after a new state"
    assert task.cancelled()


@pytest.fixture
def backend() -> NvmlBackend:
    backend = fake_backend(FakeNvml(load_node("pcie-l40s-4")))
    backend.init()
    return backend


@pytest.mark.parametrize("offset", OFFSETS)
async def test_the_mps_loop_stops_when_cancelled_as_a_state_arrives(backend: NvmlBackend, offset: int) -> None:
    bus = new_bus(backend)
    daemons = MpsDaemons(bus, interval=60)
    await cancelled_as_the_state_changes(daemons.run, lambda: bus.update(mps={}), offset)


@pytest.mark.parametrize("offset", OFFSETS)
async def test_the_telemetry_loop_stops_when_cancelled_as_its_config_changes(backend: NvmlBackend,
                                                                              offset: int) -> None:
    bus = new_bus(backend)
    nvml = NvmlThread()
    collector = TelemetryCollector(backend, bus, nvml, dict)
    try:
        await cancelled_as_the_state_changes(collector.run, lambda: bus.update(config=telemetry_config(30)), offset)
    finally:
        nvml.close()


async def test_agent_stop_cancels_again_a_task_that_swallowed_its_cancellation(
        caplog: pytest.LogCaptureFixture) -> None:
    running = asyncio.Event()
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            running.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(3600)

    caplog.set_level(logging.WARNING, logger="agent.daemon")
    async with running_agent("pcie-l40s-4") as rig:
        task = rig.agent.spawn("stubborn", stubborn)
        await asyncio.wait_for(running.wait(), 5)
    assert swallowed.is_set() and task.cancelled() and rig.agent.stopped.is_set()
    assert rig.restarts() == {}  # the cancellations were taken as a stop, not as failures
    assert [r.getMessage() for r in caplog.records if r.name == "agent.daemon"] == [
        f"task stubborn did not stop within {STOP_TASK_S:g}s of being cancelled; cancelling it again"]
