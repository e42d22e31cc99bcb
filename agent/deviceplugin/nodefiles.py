"""Reads, once at start, what the Allocate answers and the DRA claims need from the node's files: which of the
optional control device nodes exist (/dev/nvidiactl, /dev/nvidia-uvm, ...), the MIG capability minors
(/proc/driver/nvidia-caps/mig-minors) and whether the IMEX channel exists (from the inventory's
`imex_channels`, which the NVML boundary reads, or the fake gives from its node file), into a `NodeFiles`
(response.py), so that the answers themselves read no file."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.deviceplugin.response import OPTIONAL_NODES, NodeFiles

MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")


def read_node_files(imex_channels: Iterable[int] = (), exists: Callable[[str], bool] = os.path.exists,
                    mig_minors: Path = MIG_MINORS) -> NodeFiles:
    """`imex_channels`: the IMEX channels whose device nodes exist (`NodeInventory.imex_channels`)."""
    minors: dict[str, int] = {}
    try:
        for line in mig_minors.read_text().splitlines():
            name, _, minor = line.partition(" ")
            if minor.strip().isdigit():
                minors[name] = int(minor)
    except OSError:
        pass
    return NodeFiles(tuple(p for p in OPTIONAL_NODES if exists(p)), minors, 0 in tuple(imex_channels))
