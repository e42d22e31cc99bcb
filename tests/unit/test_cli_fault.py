"""`gpu-agent fault`: a fault written into the --mock-state file reaches a running agent's fake NVML."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from agent.cli import main
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node


def running(state: Path) -> FakeNvml:
    """The fake NVML of an agent already running with --nvml mock:dgx-h100 --mock-state STATE."""
    lib = FakeNvml(load_node("dgx-h100"), state)
    lib.nvmlInit()
    return lib


def test_lost_then_clear_reach_the_running_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "mock-nvml.json"
    agent = running(state)
    handle = agent.nvmlDeviceGetHandleByIndex(3)
    assert agent.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 34

    args = ["fault", "--nvml", "mock:dgx-h100", "--mock-state", str(state)]
    assert main([*args, "lost", "3"]) == 0
    assert capsys.readouterr().out == f"GPU 3: lost written to {state}\n"
    with pytest.raises(pynvml.NVMLError) as lost:
        agent.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    assert lost.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    # The other GPUs are untouched.
    assert agent.nvmlDeviceGetTemperature(agent.nvmlDeviceGetHandleByIndex(2), pynvml.NVML_TEMPERATURE_GPU) == 34

    assert main([*args, "clear", "3"]) == 0
    assert agent.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 34


def test_ecc_and_xid_reach_the_running_agent(tmp_path: Path) -> None:
    state = tmp_path / "mock-nvml.json"
    agent = running(state)
    events = agent.nvmlEventSetCreate()
    agent.nvmlDeviceRegisterEvents(agent.nvmlDeviceGetHandleByIndex(5), pynvml.nvmlEventTypeXidCriticalError, events)
    args = ["fault", "--nvml", "mock:dgx-h100", "--mock-state", str(state)]

    assert main([*args, "ecc", "1", "2"]) == 0
    volatile = agent.nvmlDeviceGetTotalEccErrors(agent.nvmlDeviceGetHandleByIndex(1),
                                                 pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    assert volatile == 2

    assert main([*args, "xid", "5", "79"]) == 0
    event = agent.nvmlEventSetWait_v2(events, 2000)
    assert (event.eventType, event.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)


@pytest.mark.parametrize(("argv", "message"), [
    (["--nvml", "real", "lost", "0"], "--nvml must name the mock node (mock:PRESET or mock:FILE), got 'real'"),
    (["--nvml", "mock:dgx-h100", "lost", "8"], "GPU index 8 out of range 0..7"),
    (["--nvml", "mock:dgx-h100", "lost", "x"], "GPU must be a GPU index (a number), got 'x'"),
    (["--nvml", "mock:dgx-h100", "xid", "0"], "xid needs a VALUE that is a number, got None"),
    (["--nvml", "mock:dgx-h100", "lost", "0", "3"], "lost takes no VALUE, got '3'"),
    (["--nvml", "mock:no-such-node", "lost", "0"], None),
])
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str | None
) -> None:
    state = tmp_path / "mock-nvml.json"
    assert main(["fault", "--mock-state", str(state), *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu-agent fault: error: ")
    if message is not None:
        assert err == f"gpu-agent fault: error: {message}\n"
    assert not state.exists()


def test_a_missing_state_directory_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "absent" / "mock-nvml.json"
    assert main(["fault", "--nvml", "mock:dgx-h100", "--mock-state", str(state), "lost", "0"]) == 1
    assert capsys.readouterr().err == (
        f"gpu-agent fault: error: the directory of --mock-state {state} does not exist\n"
    )
    assert not state.parent.exists()
