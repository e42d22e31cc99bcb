"""NodeState.evolve and the bus's update/record: typed keyword arguments (a misspelt field or a wrong type fails
`mypy --strict`, as it fails at run time), and health and mps kept read-only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest

from agent.nvml.records import DriverInfo, NodeInventory
from agent.state import DeviceHealth, NodeState, StateBus

REPO = Path(__file__).resolve().parents[2]
STATE = NodeState(1, NodeInventory(DriverInfo("570.1.2", "12.8"), (), ()))

PROBE = '''
from agent.state import NodeState, StateBus

async def changes(state: NodeState, bus: StateBus) -> None:
    state.evolve(helth={})
    state.evolve(machine=3)
    await bus.update(mig_requst="all-1g.10gb")
    await bus.record([], draining={"GPU-0"})
    state.evolve(machine="DGX H100", draining=frozenset({"GPU-0"}), mig_request=None)
'''


def test_mypy_refuses_a_misspelt_field_and_a_wrong_type(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--hide-error-context",
                             "--no-pretty", str(probe)], cwd=REPO, capture_output=True, text=True, timeout=300,
                            check=False)
    errors = sorted({(int(line.split(":")[1]), line.rsplit("[", 1)[-1].rstrip("]"))
                     for line in result.stdout.splitlines() if ": error: " in line})
    assert errors == [(5, "call-arg"), (6, "arg-type"), (7, "call-arg"), (8, "arg-type")], result.stdout
    assert result.returncode == 1


def test_a_misspelt_field_fails_at_run_time_too() -> None:
    with pytest.raises(TypeError, match="helth"):
        STATE.evolve(**{"helth": {}})  # type: ignore[arg-type]


async def test_each_change_is_the_next_version_with_health_and_mps_read_only() -> None:
    sick = {"GPU-0": DeviceHealth(False, "XID 79")}
    state = STATE.evolve(health=sick, mps={"GPU-0": ""})
    assert state.version == 2
    assert isinstance(state.health, MappingProxyType) and isinstance(state.mps, MappingProxyType)
    sick["GPU-1"] = DeviceHealth(False, "XID 48")  # the caller's dict is copied, not shared
    assert dict(state.health) == {"GPU-0": DeviceHealth(False, "XID 79")}
    bus = StateBus(state)
    updated = await bus.update(mps={"GPU-0": "not running"})
    assert (updated.version, dict(updated.mps)) == (3, {"GPU-0": "not running"})
    assert isinstance(updated.mps, MappingProxyType)
    recorded = await bus.record([("GPU-0", "fault", "XID 79")], health={})
    assert (recorded.version, dict(recorded.health), [i.message for i in recorded.incidents]) == (4, {}, ["XID 79"])
