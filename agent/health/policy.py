"""What each health signal means for a device: ignore, warn, unhealthy, or node-fatal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.nvml.backend import HealthReading

Action = Literal["ignore", "warn", "unhealthy", "node-fatal"]

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""Faults of the application, not the GPU: the GPU stays usable."""
WARN_XIDS = frozenset({63, 92, 94})
"""Pending row remap, excessive single-bit ECC, contained ECC error: the GPU stays usable."""
NODE_FATAL_XIDS = frozenset({79, 151, 160})
"""The GPU is off the bus or the node needs a reboot."""


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str


def classify_xid(xid: int) -> Verdict:
    if xid in APPLICATION_XIDS:
        return Verdict("ignore", f"XID {xid} (application error)")
    if xid in WARN_XIDS:
        return Verdict("warn", f"XID {xid}")
    if xid in NODE_FATAL_XIDS:
        return Verdict("node-fatal", f"XID {xid}")
    return Verdict("unhealthy", f"XID {xid}")


def classify_reading(reading: HealthReading) -> Verdict:
    """The verdict of one periodic sample; the worst signal wins."""
    if reading.lost:
        return Verdict("node-fatal", "GPU is lost (fallen off the bus)")
    if reading.remapped_rows_failure:
        return Verdict("unhealthy", "row remapping failed")
    if reading.ecc_uncorrected_volatile:
        return Verdict("unhealthy", f"{reading.ecc_uncorrected_volatile} uncorrected ECC error(s) since reset")
    if reading.remapped_rows_pending or reading.retired_pages_pending:
        return Verdict("warn", "memory repair pending a GPU reset")
    return Verdict("ignore", "")
