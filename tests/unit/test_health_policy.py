"""The health policy on single readings: each signal is judged by its own check's action."""

from __future__ import annotations

import pytest

from agent.config import DEFAULT_CONFIG, parse_config
from agent.health.policy import Verdict, classify_reading
from agent.nvml.records import HealthReading

POLICY = DEFAULT_CONFIG.health


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
