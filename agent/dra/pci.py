"""Where a GPU sits in the PCIe tree, from sysfs: the resource.kubernetes.io/pcieRoot attribute."""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent.dra.slices import pci_bus_id


def sysfs_pcie_root(bus_id: str, sysfs: Path = Path("/sys")) -> str | None:
    """The PCIe root complex of a device as resource.kubernetes.io/pcieRoot names it ("pci0000:00"): the first
    directory under <sysfs>/devices on the way to the device; None when sysfs does not know the device."""
    try:
        target = Path(os.path.realpath(sysfs / "bus" / "pci" / "devices" / pci_bus_id(bus_id), strict=True))
        below = target.relative_to(Path(os.path.realpath(sysfs)) / "devices").parts
    except (OSError, ValueError):
        return None
    if len(below) > 1 and re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", below[0]):
        return below[0]
    return None
