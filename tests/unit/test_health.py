"""GPU health: the policy on single readings (agent/health/policy.py: each signal judged by its own check's action,
a check set to `ignore` off), and the monitor with its hysteresis (agent/health/monitor.py: XIDs and samples
through the fake NVML into NodeState)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent.config import DEFAULT_CONFIG, HealthSettings, parse_config
from agent.health.monitor import HealthMonitor
from agent.health.policy import CLEAN, Verdict, classify_reading
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvml.records import HealthReading
from agent.state import NodeState, StateBus

POLICY = DEFAULT_CONFIG.health
OFF = parse_config("version: v1\nhealth:\n  checks:\n    thermalThrottle: ignore\n    powerBrake: ignore\n"
                   "    remappedRowsPending: ignore\n").health
"""A check set to `ignore` is off: a reading that only trips ignored checks is clean, with no reason."""


# --- the policy on single readings


@pytest.mark.parametrize(("reading", "verdict"), [
    # Pending row remaps are a warning by default (the GPU works until its next reset), failed ones unhealthy.
    (HealthReading("GPU-0", remapped_rows_pending=True, remapped_rows_failure=False),
     Verdict("warn", "row remapping pending a GPU reset")),
    (HealthReading("GPU-0", remapped_rows_pending=False, remapped_rows_failure=True),
     Verdict("unhealthy", "row remapping failed")),
    (HealthReading("GPU-0", retired_pages_pending=True), Verdict("warn", "page retirement pending a GPU reset")),
    (HealthReading("GPU-0", ecc_uncorrected_volatile=2),
     Verdict("unhealthy", "2 uncorrected ECC error(s) since the last reset")),
    (HealthReading("GPU-0", clock_event_reasons=0x40), Verdict("warn", "thermal slowdown")),
    (HealthReading("GPU-0", clock_event_reasons=0x80), Verdict("warn", "power brake slowdown")),
    (HealthReading("GPU-0", lost=True), Verdict("node-fatal", "GPU is lost (fallen off the bus)")),
    (HealthReading("GPU-0"), Verdict("ignore", "")),
])
def test_each_signal_is_judged_by_its_own_check(reading: HealthReading, verdict: Verdict) -> None:
    assert classify_reading(reading, POLICY) == verdict


def test_each_check_follows_its_own_key() -> None:
    policy = parse_config("version: v1\nhealth:\n  checks:\n    remappedRowsPending: node-fatal\n"
                          "    remappedRowsFailure: warn\n").health
    assert classify_reading(HealthReading("GPU-0", remapped_rows_pending=True), policy) == Verdict(
        "node-fatal", "row remapping pending a GPU reset")
    assert classify_reading(HealthReading("GPU-0", remapped_rows_failure=True), policy) == Verdict(
        "warn", "row remapping failed")
    # The worst signal of a reading wins.
    both = HealthReading("GPU-0", remapped_rows_failure=True, ecc_uncorrected_volatile=1)
    assert classify_reading(both, policy).action == "unhealthy"


def test_a_reading_that_trips_only_ignored_checks_is_clean() -> None:
    assert classify_reading(HealthReading("GPU-0", clock_event_reasons=0x40 | 0x80), OFF) == Verdict("ignore", "")
    assert classify_reading(HealthReading("GPU-0", remapped_rows_pending=True), OFF) == CLEAN


def test_an_ignored_check_does_not_hide_another() -> None:
    reading = HealthReading("GPU-0", clock_event_reasons=0x20, retired_pages_pending=True)
    assert classify_reading(reading, OFF) == Verdict("warn", "page retirement pending a GPU reset")


# --- the monitor: XIDs and samples into NodeState, with hysteresis


async def inline(fn: Callable[[], Any], **_: Any) -> Any:
    return fn()


async def monitor_for(policy: HealthSettings = DEFAULT_CONFIG.health) -> tuple[HealthMonitor, StateBus, FakeNvml]:
    fake = FakeNvml(load_node("pcie-l40s-4"))
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    config = DEFAULT_CONFIG.model_copy(update={"health": policy})
    bus = StateBus(NodeState(version=1, inventory=backend.inventory(), config=config))
    return HealthMonitor(backend, bus, inline), bus, fake


def unhealthy(bus: StateBus) -> dict[int, str]:
    state = bus.current
    health = {g.index: state.gpu_health(g.uuid) for g in state.inventory.gpus}
    return {index: h.reason for index, h in health.items() if not h.healthy}


def uuid(bus: StateBus, index: int) -> str:
    return bus.current.inventory.gpus[index].uuid


async def test_application_xid_changes_nothing() -> None:
    monitor, bus, _ = await monitor_for()
    await monitor.on_xid(uuid(bus, 0), 13)
    assert (bus.current.version, unhealthy(bus), bus.current.incidents) == (1, {}, ())


async def test_fault_recovers_only_after_consecutive_clean_samples() -> None:
    monitor, bus, _ = await monitor_for()
    await monitor.on_xid(uuid(bus, 2), 48)
    assert unhealthy(bus) == {2: "XID 48"}
    await monitor.sample()
    await monitor.sample()
    assert unhealthy(bus) == {2: "XID 48"}
    await monitor.on_xid(uuid(bus, 2), 48)  # flapping: the clean streak starts again
    for _ in range(2):
        await monitor.sample()
    assert unhealthy(bus) == {2: "XID 48"}
    await monitor.sample()
    assert unhealthy(bus) == {}
    assert [(i.kind, i.message) for i in bus.current.incidents] == [
        ("fault", "XID 48"), ("recovered", "recovered from XID 48")
    ]


async def test_uncorrected_ecc_holds_until_reset() -> None:
    monitor, bus, fake = await monitor_for()
    fake.set_ecc_uncorrected(1, 2)
    for _ in range(5):
        await monitor.sample()
    assert unhealthy(bus) == {1: "2 uncorrected ECC error(s) since the last reset"}
    fake.set_ecc_uncorrected(1, 0)
    for _ in range(3):
        await monitor.sample()
    assert unhealthy(bus) == {}


async def test_lost_gpu_is_a_node_fault() -> None:
    monitor, bus, fake = await monitor_for()
    fake.set_gpu_lost(3)
    await monitor.sample()
    assert unhealthy(bus) == {3: "GPU is lost (fallen off the bus)"}
    assert bus.current.node_fault() == "GPU is lost (fallen off the bus)"


async def test_policy_from_config() -> None:
    config = parse_config("version: v1\nhealth:\n  xidDefault: ignore\n  xid: {13: unhealthy}\n")
    monitor, bus, _ = await monitor_for(config.health)
    await monitor.on_xid(uuid(bus, 0), 62)
    assert unhealthy(bus) == {}
    await monitor.on_xid(uuid(bus, 0), 13)
    await monitor.on_xid(uuid(bus, 1), 79)
    assert unhealthy(bus) == {0: "XID 13", 1: "XID 79"}
    assert bus.current.node_fault() == "XID 79"


async def test_unhealthy_gpu_count_threshold_makes_a_node_fault() -> None:
    config = parse_config("version: v1\nhealth:\n  nodeFatalUnhealthyGpus: 2\n")
    monitor, bus, _ = await monitor_for(config.health)
    await monitor.on_xid(uuid(bus, 0), 48)
    assert bus.current.node_fault(config.health.node_fatal_unhealthy_gpus) is None
    await monitor.on_xid(uuid(bus, 1), 48)
    assert bus.current.node_fault(config.health.node_fatal_unhealthy_gpus) == "2 GPUs unhealthy"


async def test_thermal_slowdown_warns_once() -> None:
    monitor, bus, fake = await monitor_for()
    fake.set_clocks_event_reasons(0, 0x40)
    for _ in range(3):
        await monitor.sample()
    assert unhealthy(bus) == {}
    assert [(i.kind, i.message) for i in bus.current.incidents] == [("warning", "thermal slowdown")]


async def test_a_growing_ecc_count_is_one_fault_per_ten_minutes() -> None:
    now = [1000.0]
    monitor, bus, fake = await monitor_for()
    monitor.clock = lambda: now[0]
    for count in range(1, 122):  # ten minutes of samples every 5 s, one more error each, and one more
        fake.set_ecc_uncorrected(1, count)
        await monitor.sample()
        now[0] += 5.0
    ecc = "uncorrected ECC error(s) since the last reset"
    assert [(i.kind, i.message) for i in bus.current.incidents] == [("fault", f"1 {ecc}"), ("fault", f"121 {ecc}")]
    assert bus.current.version == 3
    assert unhealthy(bus) == {1: f"121 {ecc}"}
    # A fault of another class is told at once: the GPU falls off the bus.
    fake.set_gpu_lost(1)
    await monitor.sample()
    assert bus.current.incidents[-1].message == "GPU is lost (fallen off the bus)"


async def test_a_storm_of_one_warning_xid_is_one_warning_with_its_count_per_sample() -> None:
    monitor, bus, _ = await monitor_for()
    for _ in range(3000):
        await monitor.on_xid(uuid(bus, 2), 63)
    await monitor.on_xid(uuid(bus, 3), 94)
    assert bus.current.version == 1  # nothing published per XID
    await monitor.sample()
    assert [(i.gpu_uuid, i.kind, i.message) for i in bus.current.incidents] == [
        (uuid(bus, 2), "warning", "XID 63 (3000 times)"), (uuid(bus, 3), "warning", "XID 94")]
    assert bus.current.version == 2
    assert monitor.xid_counts == {(uuid(bus, 2), 63): 3000, (uuid(bus, 3), 94): 1}
    await monitor.sample()
    assert bus.current.version == 2
