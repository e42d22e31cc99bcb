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
from agent.yamlfile import InputFileError, read_text_file

MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
MIG_MINORS_MAX_BYTES = 1024 * 1024
"""The most read of the mig-minors file: the driver's lists every capability of 32 GPUs (15 GPU instances of 8
compute instances each), 4,322 lines and 107 KiB; a larger file is not the driver's, and is not read."""


def read_node_files(imex_channels: Iterable[int] = (), exists: Callable[[str], bool] = os.path.exists,
                    mig_minors: Path = MIG_MINORS) -> NodeFiles:
    """`imex_channels`: the IMEX channels whose device nodes exist (`NodeInventory.imex_channels`)."""
    minors: dict[str, int] = {}
    try:
        for line in read_text_file(mig_minors, MIG_MINORS_MAX_BYTES).splitlines():
            name, _, minor = line.partition(" ")
            if minor.strip().isdigit():
                minors[name] = int(minor)
    except InputFileError:  # no such file (a node without MIG), not a regular file, too large, not text
        pass
    return NodeFiles(tuple(p for p in OPTIONAL_NODES if exists(p)), minors, 0 in tuple(imex_channels))
