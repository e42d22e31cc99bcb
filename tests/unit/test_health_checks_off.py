"""A health check set to `ignore` is off: a reading that only trips ignored checks is clean, with no reason."""

from __future__ import annotations

from agent.config import parse_config
from agent.health.policy import CLEAN, Verdict, classify_reading
from agent.nvml.records import HealthReading

OFF = parse_config("version: v1\nhealth:\n  checks:\n    thermalThrottle: ignore\n    powerBrake: ignore\n"
                   "    remappedRowsPending: ignore\n").health


def test_a_reading_that_trips_only_ignored_checks_is_clean() -> None:
    assert classify_reading(HealthReading("GPU-0", clock_event_reasons=0x40 | 0x80), OFF) == Verdict("ignore", "")
    assert classify_reading(HealthReading("GPU-0", remapped_rows_pending=True), OFF) == CLEAN


def test_an_ignored_check_does_not_hide_another() -> None:
    reading = HealthReading("GPU-0", clock_event_reasons=0x20, retired_pages_pending=True)
    assert classify_reading(reading, OFF) == Verdict("warn", "page retirement pending a GPU reset")
