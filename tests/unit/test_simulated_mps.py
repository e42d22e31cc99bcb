"""The MPS control daemon of a simulated node answers as the driver's nvidia-cuda-mps-control does (the same
refusals as tests/mps/nvidia-cuda-mps-control, the stand-in `run` is tested with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.mps import ControlError, DaemonSpec
from agent.simulate import SimulatedMpsControl


def spec(uuid: str) -> DaemonSpec:
    return DaemonSpec(uuid, 0, 4, 81559, SimulatedMpsControl.PROGRAM, Path("/sim/mps"))


async def test_a_command_needs_a_running_daemon_and_a_second_start_is_refused() -> None:
    control = SimulatedMpsControl()
    gpu = spec("GPU-a")
    with pytest.raises(ControlError) as refused:
        await control(gpu, command="get_default_active_thread_percentage")
    assert str(refused.value) == ("nvidia-cuda-mps-control get_default_active_thread_percentage exited 1: "
                                  "Cannot find MPS control daemon process")
    assert await control(gpu, "-d") == ""
    with pytest.raises(ControlError) as refused:
        await control(gpu, "-d")
    assert str(refused.value) == "nvidia-cuda-mps-control -d exited 1: An instance of this daemon is already running"
    assert await control(spec("GPU-b"), "-d") == ""  # another GPU's pipe directory: a daemon of its own


async def test_limits_are_kept_and_quit_stops_the_daemon() -> None:
    control = SimulatedMpsControl()
    gpu = spec("GPU-a")
    await control(gpu, "-d")
    assert await control(gpu, command="get_default_active_thread_percentage") == "100.0"
    assert await control(gpu, command="set_default_active_thread_percentage 25") == "25.0"
    assert await control(gpu, command="set_default_device_pinned_mem_limit 0 20389M") == ""
    assert await control(gpu, command="get_default_active_thread_percentage") == "25.0"
    assert await control(gpu, command="frobnicate") == "unknown command frobnicate"
    assert await control(gpu, command="quit") == ""
    assert control.daemons == {}
    with pytest.raises(ControlError, match="Cannot find MPS control daemon process"):
        await control(gpu, command="quit")
