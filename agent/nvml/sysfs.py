"""What sysfs says about a GPU's place on the PCI bus, beside NVML: its NUMA node and PCI class (read by
`NvmlBackend` into `GpuInfo`), and its PCIe root complex (the DRA slice's resource.kubernetes.io/pcieRoot
attribute). Each reader takes NVML's bus id ("00000000:18:00.0") and answers None when sysfs does not know the
device; the fake NVML answers the same questions from its node file instead. Also which IMEX channel device
nodes exist under /dev (`dev_imex_channels`, into `NodeInventory`). No NVML here."""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent.nvml.records import short_bus_id
from agent.yamlfile import read_text_file

PCI_DEVICES = Path("/sys/bus/pci/devices")
IMEX_CHANNELS = Path("/dev/nvidia-caps-imex-channels")
"""Where the driver's IMEX channel device nodes are: channel<N>, one per channel made (channel0 by the driver's
NVreg_CreateImexChannel0=1, or by an administrator)."""
SYSFS_MAX_BYTES = 4096
"""The most read of a sysfs attribute (`numa_node`, `class`): each is one short line, and the kernel gives an
attribute at most a page; a larger file is not the kernel's, and is not read."""


def sysfs_numa_node(bus_id: str, root: Path = PCI_DEVICES) -> int | None:
    """Linux NUMA node of a PCI device, or None when the platform reports none."""
    try:
        value = int(read_text_file(root / short_bus_id(bus_id) / "numa_node", SYSFS_MAX_BYTES).strip())
    except (OSError, ValueError):  # InputFileError (a ValueError): unreadable, not a regular file, too large
        return None
    return value if value >= 0 else None


def sysfs_pci_class(bus_id: str, root: Path = PCI_DEVICES) -> int | None:
    """The PCI class code of a device from sysfs (``class``, e.g. 0x030200), or None when unreadable."""
    try:
        return int(read_text_file(root / short_bus_id(bus_id) / "class", SYSFS_MAX_BYTES).strip(), 16)
    except (OSError, ValueError):  # InputFileError (a ValueError): unreadable, not a regular file, too large
        return None


def sysfs_pcie_root(bus_id: str, sysfs: Path = Path("/sys")) -> str | None:
    """The PCIe root complex of a device as resource.kubernetes.io/pcieRoot names it ("pci0000:00"): the first
    directory under <sysfs>/devices on the way to the device; None when sysfs does not know the device."""
    try:
        target = Path(os.path.realpath(sysfs / "bus" / "pci" / "devices" / short_bus_id(bus_id), strict=True))
        below = target.relative_to(Path(os.path.realpath(sysfs)) / "devices").parts
    except (OSError, ValueError):
        return None
    if len(below) > 1 and re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", below[0]):
        return below[0]
    return None


def dev_imex_channels(root: Path = IMEX_CHANNELS) -> tuple[int, ...]:
    """The IMEX channels whose device nodes exist under `root`, in order; none when the directory does not."""
    try:
        names = os.listdir(root)
    except OSError:
        return ()
    return tuple(sorted(int(m[1]) for n in names if (m := re.fullmatch(r"channel(0|[1-9][0-9]{0,5})", n))))
