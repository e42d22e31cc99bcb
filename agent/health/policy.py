"""What each health signal means for a GPU, by the config's policy: ignore, warn, unhealthy or node-fatal."""

from __future__ import annotations

from dataclasses import dataclass

from agent.config import Action, HealthSettings
from agent.nvml.records import HealthReading

SEVERITY: dict[Action, int] = {"ignore": 0, "warn": 1, "unhealthy": 2, "node-fatal": 3}

THERMAL_REASONS = 0x20 | 0x40
"""SwThermalSlowdown | HwThermalSlowdown clock-event reasons."""
POWER_BRAKE_REASON = 0x80
"""HwPowerBrakeSlowdown clock-event reason."""


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str

    @property
    def faulty(self) -> bool:
        return SEVERITY[self.action] >= SEVERITY["unhealthy"]


CLEAN = Verdict("ignore", "")


def worst(verdicts: list[Verdict]) -> Verdict:
    return max(verdicts, key=lambda v: SEVERITY[v.action], default=CLEAN)


def classify_xid(xid: int, policy: HealthSettings) -> Verdict:
    return Verdict(policy.xid_action(xid), f"XID {xid}")


LOST_REASON = "GPU is lost (fallen off the bus)"
NVML_UNRESPONSIVE = "NVML unresponsive"
"""The start of the reason of a fault from an NVML call past its deadline; the node condition's reason is then
NvmlUnresponsive."""


def classify_reading(reading: HealthReading, policy: HealthSettings) -> Verdict:
    """The verdict of one periodic sample; the worst signal wins."""
    checks = policy.checks
    if reading.lost:
        return Verdict(checks.gpu_lost, LOST_REASON)
    found = []
    if reading.ecc_uncorrected_volatile:
        found.append(Verdict(checks.ecc_uncorrected,
                             f"{reading.ecc_uncorrected_volatile} uncorrected ECC error(s) since the last reset"))
    if reading.remapped_rows_failure:
        found.append(Verdict(checks.remapped_rows_failure, "row remapping failed"))
    if reading.remapped_rows_pending:
        found.append(Verdict(checks.remapped_rows_pending, "row remapping pending a GPU reset"))
    if reading.retired_pages_pending:
        found.append(Verdict(checks.retired_pages_pending, "page retirement pending a GPU reset"))
    reasons = reading.clock_event_reasons or 0
    if reasons & THERMAL_REASONS:
        found.append(Verdict(checks.thermal_throttle, "thermal slowdown"))
    if reasons & POWER_BRAKE_REASON:
        found.append(Verdict(checks.power_brake, "power brake slowdown"))
    return worst([v for v in found if v.action != "ignore"])
