"""Every shipped MIG layout on every node preset, against a table written by hand from the MIG profile tables
(docs/reference/mig-profiles.md) and the layouts' published counts (the GPU Operator's default mig-parted
config): feasible with the devices each resource ends with, or refused for a reason a person can act on.

Each feasible layout goes through the real applier on the fake NVML; the resources are what the agent would
advertise under migStrategy mixed. Nothing here asks the planner what to expect."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.inventory import plan
from agent.mig.applier import ApplyResult, apply_layout
from agent.mig.layout import load_layouts
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import NodeSpec, load_node
from agent.state import NodeState

MIXED = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")
RESET_HINT = "let the GPUs go idle and apply again, or reset the GPUs (reboot the node)"

# The presets: their GPU model (as the planner's messages name it), their GPU count, and whether a MIG mode
# change waits for a GPU reset (Ampere) or happens at once on an idle GPU (Hopper and Blackwell).
H100, A100_40, A100_80, H200, L40S = "H100 80GB HBM3", "A100-SXM4-40GB", "A100-SXM4-80GB", "H200", "L40S"
B200, B300, GB200, RTX = "B200", "B300 SXM6 AC", "GB200", "RTX PRO 6000 Blackwell Server Edition"
GB300, H100_NVL, H20, GH200 = "GB300", "H100 NVL", "H20", "GH200 480GB"
PRESETS: dict[str, tuple[str, int, bool]] = {
    "dgx-h100": (H100, 8, False),
    "hgx-16-nvswitch": (H100, 16, False),
    "dgx-a100": (A100_40, 8, True),
    "a100-pcie-nvlink-pairs": (A100_80, 4, True),
    "pcie-16-nvlink-pairs": (A100_80, 16, True),
    "hgx-h200": (H200, 8, False),
    "single-h200": (H200, 1, False),
    "pcie-l40s-4": (L40S, 4, False),
    "dgx-b200": (B200, 8, False),
    "hgx-b300": (B300, 8, False),
    "gb200-nvl72-tray": (GB200, 4, False),
    "pcie-rtx-pro-6000-8": (RTX, 8, False),
    "gb300-nvl72-tray": (GB300, 4, False),
    "pcie-h100-nvl-pair": (H100_NVL, 2, False),
    "hgx-h20": (H20, 8, False),
    "single-gh200": (GH200, 1, False),
}
NEW_PRESETS = ("dgx-b200", "hgx-b300", "gb200-nvl72-tray", "pcie-rtx-pro-6000-8", "gb300-nvl72-tray",
               "pcie-h100-nvl-pair", "hgx-h20", "single-gh200")


@dataclass(frozen=True)
class Applied:
    """The layout applies; the node then advertises exactly these resources, evenly over its GPUs."""

    resources: dict[str, int]
    already: bool = False
    """A fresh node has it already (MIG disabled everywhere): nothing to do."""


@dataclass(frozen=True)
class Untouched:
    """No entry of the layout selects a GPU of this node (its device filters name other models)."""

    gpus: int


@dataclass(frozen=True)
class Refused:
    """Every GPU refuses the layout, each with these words in its reason."""

    words: str


def mig(gpus: int, **per_gpu: int) -> Applied:
    """MIG devices per GPU by profile (written with ``_`` for ``.``), times the GPUs."""
    return Applied({f"nvidia.com/mig-{name.replace('_', '.')}": n * gpus
                    for name, n in per_gpu.items()})


def missing(profile: str, model: str) -> Refused:
    return Refused(f"profile {profile} does not exist on {model}")


NO_MIG = Refused("L40S does not support MIG")

# Per GPU (the MIG user guide's tables): A100-40GB has 7 x 1g.5gb, 1 x 1g.5gb+me, 4 x 1g.10gb (the 1-slice
# profile with two memory slices), 3 x 2g.10gb, 2 x 3g.20gb, 1 x 4g.20gb, 1 x 7g.40gb; the 80 GB parts
# (A100-80GB, H100) the same counts as 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb; H200
# as 1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb. Balanced is 2 x 1g + 2g + 3g, which
# fits as 2g at slices 0-1, the 1g at 2 and 3, the 3g at 4-7. The L40S has no MIG.
EXPECTED: dict[str, dict[str, Applied | Untouched | Refused]] = {
    "all-disabled": {
        "dgx-h100": Applied({"nvidia.com/gpu": 8}, already=True),
        "hgx-16-nvswitch": Applied({"nvidia.com/gpu": 16}, already=True),
        "dgx-a100": Applied({"nvidia.com/gpu": 8}, already=True),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/gpu": 4}, already=True),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/gpu": 16}, already=True),
        "hgx-h200": Applied({"nvidia.com/gpu": 8}, already=True),
        "single-h200": Applied({"nvidia.com/gpu": 1}, already=True),
        "pcie-l40s-4": Applied({"nvidia.com/gpu": 4}, already=True),
    },
    # MIG on, no instances: under migStrategy mixed a MIG GPU without MIG devices advertises nothing.
    "all-enabled": {
        "dgx-h100": Applied({}),
        "hgx-16-nvswitch": Applied({}),
        "dgx-a100": Applied({}),
        "a100-pcie-nvlink-pairs": Applied({}),
        "pcie-16-nvlink-pairs": Applied({}),
        "hgx-h200": Applied({}),
        "single-h200": Applied({}),
        "pcie-l40s-4": NO_MIG,
    },
    "all-1g.5gb": {
        "dgx-h100": missing("1g.5gb", H100),
        "hgx-16-nvswitch": missing("1g.5gb", H100),
        "dgx-a100": Applied({"nvidia.com/mig-1g.5gb": 56}),
        "a100-pcie-nvlink-pairs": missing("1g.5gb", A100_80),
        "pcie-16-nvlink-pairs": missing("1g.5gb", A100_80),
        "hgx-h200": missing("1g.5gb", H200),
        "single-h200": missing("1g.5gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-1g.5gb.me": {
        "dgx-h100": missing("1g.5gb+me", H100),
        "hgx-16-nvswitch": missing("1g.5gb+me", H100),
        "dgx-a100": Applied({"nvidia.com/mig-1g.5gb.me": 8}),
        "a100-pcie-nvlink-pairs": missing("1g.5gb+me", A100_80),
        "pcie-16-nvlink-pairs": missing("1g.5gb+me", A100_80),
        "hgx-h200": missing("1g.5gb+me", H200),
        "single-h200": missing("1g.5gb+me", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-2g.10gb": {
        "dgx-h100": missing("2g.10gb", H100),
        "hgx-16-nvswitch": missing("2g.10gb", H100),
        "dgx-a100": Applied({"nvidia.com/mig-2g.10gb": 24}),
        "a100-pcie-nvlink-pairs": missing("2g.10gb", A100_80),
        "pcie-16-nvlink-pairs": missing("2g.10gb", A100_80),
        "hgx-h200": missing("2g.10gb", H200),
        "single-h200": missing("2g.10gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-3g.20gb": {
        "dgx-h100": missing("3g.20gb", H100),
        "hgx-16-nvswitch": missing("3g.20gb", H100),
        "dgx-a100": Applied({"nvidia.com/mig-3g.20gb": 16}),
        "a100-pcie-nvlink-pairs": missing("3g.20gb", A100_80),
        "pcie-16-nvlink-pairs": missing("3g.20gb", A100_80),
        "hgx-h200": missing("3g.20gb", H200),
        "single-h200": missing("3g.20gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-4g.20gb": {
        "dgx-h100": missing("4g.20gb", H100),
        "hgx-16-nvswitch": missing("4g.20gb", H100),
        "dgx-a100": Applied({"nvidia.com/mig-4g.20gb": 8}),
        "a100-pcie-nvlink-pairs": missing("4g.20gb", A100_80),
        "pcie-16-nvlink-pairs": missing("4g.20gb", A100_80),
        "hgx-h200": missing("4g.20gb", H200),
        "single-h200": missing("4g.20gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-7g.40gb": {
        "dgx-h100": missing("7g.40gb", H100),
        "hgx-16-nvswitch": missing("7g.40gb", H100),
        "dgx-a100": Applied({"nvidia.com/mig-7g.40gb": 8}),
        "a100-pcie-nvlink-pairs": missing("7g.40gb", A100_80),
        "pcie-16-nvlink-pairs": missing("7g.40gb", A100_80),
        "hgx-h200": missing("7g.40gb", H200),
        "single-h200": missing("7g.40gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    # Filtered by PCI id: 7 per 80 GB GPU, 4 per A100-40GB (two memory slices each); H200 and L40S ids are
    # in neither filter.
    "all-1g.10gb": {
        "dgx-h100": Applied({"nvidia.com/mig-1g.10gb": 56}),
        "hgx-16-nvswitch": Applied({"nvidia.com/mig-1g.10gb": 112}),
        "dgx-a100": Applied({"nvidia.com/mig-1g.10gb": 32}),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/mig-1g.10gb": 28}),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/mig-1g.10gb": 112}),
        "hgx-h200": Untouched(8),
        "single-h200": Untouched(1),
        "pcie-l40s-4": Untouched(4),
    },
    "all-1g.10gb.me": {
        "dgx-h100": Applied({"nvidia.com/mig-1g.10gb.me": 8}),
        "hgx-16-nvswitch": Applied({"nvidia.com/mig-1g.10gb.me": 16}),
        "dgx-a100": missing("1g.10gb+me", A100_40),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/mig-1g.10gb.me": 4}),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/mig-1g.10gb.me": 16}),
        "hgx-h200": missing("1g.10gb+me", H200),
        "single-h200": missing("1g.10gb+me", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-1g.20gb": {
        "dgx-h100": Applied({"nvidia.com/mig-1g.20gb": 32}),
        "hgx-16-nvswitch": Applied({"nvidia.com/mig-1g.20gb": 64}),
        "dgx-a100": missing("1g.20gb", A100_40),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/mig-1g.20gb": 16}),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/mig-1g.20gb": 64}),
        "hgx-h200": missing("1g.20gb", H200),
        "single-h200": missing("1g.20gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-2g.20gb": {
        "dgx-h100": Applied({"nvidia.com/mig-2g.20gb": 24}),
        "hgx-16-nvswitch": Applied({"nvidia.com/mig-2g.20gb": 48}),
        "dgx-a100": missing("2g.20gb", A100_40),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/mig-2g.20gb": 12}),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/mig-2g.20gb": 48}),
        "hgx-h200": missing("2g.20gb", H200),
        "single-h200": missing("2g.20gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-3g.40gb": {
        "dgx-h100": Applied({"nvidia.com/mig-3g.40gb": 16}),
        "hgx-16-nvswitch": Applied({"nvidia.com/mig-3g.40gb": 32}),
        "dgx-a100": missing("3g.40gb", A100_40),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/mig-3g.40gb": 8}),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/mig-3g.40gb": 32}),
        "hgx-h200": missing("3g.40gb", H200),
        "single-h200": missing("3g.40gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-4g.40gb": {
        "dgx-h100": Applied({"nvidia.com/mig-4g.40gb": 8}),
        "hgx-16-nvswitch": Applied({"nvidia.com/mig-4g.40gb": 16}),
        "dgx-a100": missing("4g.40gb", A100_40),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/mig-4g.40gb": 4}),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/mig-4g.40gb": 16}),
        "hgx-h200": missing("4g.40gb", H200),
        "single-h200": missing("4g.40gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-7g.80gb": {
        "dgx-h100": Applied({"nvidia.com/mig-7g.80gb": 8}),
        "hgx-16-nvswitch": Applied({"nvidia.com/mig-7g.80gb": 16}),
        "dgx-a100": missing("7g.80gb", A100_40),
        "a100-pcie-nvlink-pairs": Applied({"nvidia.com/mig-7g.80gb": 4}),
        "pcie-16-nvlink-pairs": Applied({"nvidia.com/mig-7g.80gb": 16}),
        "hgx-h200": missing("7g.80gb", H200),
        "single-h200": missing("7g.80gb", H200),
        "pcie-l40s-4": NO_MIG,
    },
    "all-1g.18gb": {
        "dgx-h100": missing("1g.18gb", H100),
        "hgx-16-nvswitch": missing("1g.18gb", H100),
        "dgx-a100": missing("1g.18gb", A100_40),
        "a100-pcie-nvlink-pairs": missing("1g.18gb", A100_80),
        "pcie-16-nvlink-pairs": missing("1g.18gb", A100_80),
        "hgx-h200": Applied({"nvidia.com/mig-1g.18gb": 56}),
        "single-h200": Applied({"nvidia.com/mig-1g.18gb": 7}),
        "pcie-l40s-4": NO_MIG,
    },
    "all-1g.18gb.me": {
        "dgx-h100": missing("1g.18gb+me", H100),
        "hgx-16-nvswitch": missing("1g.18gb+me", H100),
        "dgx-a100": missing("1g.18gb+me", A100_40),
        "a100-pcie-nvlink-pairs": missing("1g.18gb+me", A100_80),
        "pcie-16-nvlink-pairs": missing("1g.18gb+me", A100_80),
        "hgx-h200": Applied({"nvidia.com/mig-1g.18gb.me": 8}),
        "single-h200": Applied({"nvidia.com/mig-1g.18gb.me": 1}),
        "pcie-l40s-4": NO_MIG,
    },
    # Filtered by PCI id since GB300 takes 7 where H200 takes 4: the other presets are in neither filter.
    "all-1g.35gb": {
        "dgx-h100": Untouched(8),
        "hgx-16-nvswitch": Untouched(16),
        "dgx-a100": Untouched(8),
        "a100-pcie-nvlink-pairs": Untouched(4),
        "pcie-16-nvlink-pairs": Untouched(16),
        "hgx-h200": Applied({"nvidia.com/mig-1g.35gb": 32}),
        "single-h200": Applied({"nvidia.com/mig-1g.35gb": 4}),
        "pcie-l40s-4": Untouched(4),
        "dgx-b200": Untouched(8),
        "hgx-b300": Untouched(8),
        "gb200-nvl72-tray": Untouched(4),
        "pcie-rtx-pro-6000-8": Untouched(8),
        "gb300-nvl72-tray": Applied({"nvidia.com/mig-1g.35gb": 28}),
        "pcie-h100-nvl-pair": Untouched(2),
        "hgx-h20": Untouched(8),
        "single-gh200": Untouched(1),
    },
    "all-2g.35gb": {
        "dgx-h100": missing("2g.35gb", H100),
        "hgx-16-nvswitch": missing("2g.35gb", H100),
        "dgx-a100": missing("2g.35gb", A100_40),
        "a100-pcie-nvlink-pairs": missing("2g.35gb", A100_80),
        "pcie-16-nvlink-pairs": missing("2g.35gb", A100_80),
        "hgx-h200": Applied({"nvidia.com/mig-2g.35gb": 24}),
        "single-h200": Applied({"nvidia.com/mig-2g.35gb": 3}),
        "pcie-l40s-4": NO_MIG,
    },
    "all-3g.71gb": {
        "dgx-h100": missing("3g.71gb", H100),
        "hgx-16-nvswitch": missing("3g.71gb", H100),
        "dgx-a100": missing("3g.71gb", A100_40),
        "a100-pcie-nvlink-pairs": missing("3g.71gb", A100_80),
        "pcie-16-nvlink-pairs": missing("3g.71gb", A100_80),
        "hgx-h200": Applied({"nvidia.com/mig-3g.71gb": 16}),
        "single-h200": Applied({"nvidia.com/mig-3g.71gb": 2}),
        "pcie-l40s-4": NO_MIG,
    },
    "all-4g.71gb": {
        "dgx-h100": missing("4g.71gb", H100),
        "hgx-16-nvswitch": missing("4g.71gb", H100),
        "dgx-a100": missing("4g.71gb", A100_40),
        "a100-pcie-nvlink-pairs": missing("4g.71gb", A100_80),
        "pcie-16-nvlink-pairs": missing("4g.71gb", A100_80),
        "hgx-h200": Applied({"nvidia.com/mig-4g.71gb": 8}),
        "single-h200": Applied({"nvidia.com/mig-4g.71gb": 1}),
        "pcie-l40s-4": NO_MIG,
    },
    "all-7g.141gb": {
        "dgx-h100": missing("7g.141gb", H100),
        "hgx-16-nvswitch": missing("7g.141gb", H100),
        "dgx-a100": missing("7g.141gb", A100_40),
        "a100-pcie-nvlink-pairs": missing("7g.141gb", A100_80),
        "pcie-16-nvlink-pairs": missing("7g.141gb", A100_80),
        "hgx-h200": Applied({"nvidia.com/mig-7g.141gb": 8}),
        "single-h200": Applied({"nvidia.com/mig-7g.141gb": 1}),
        "pcie-l40s-4": NO_MIG,
    },
    "all-balanced": {
        "dgx-h100": mig(8, **{"1g_10gb": 2, "2g_20gb": 1, "3g_40gb": 1}),
        "hgx-16-nvswitch": mig(16, **{"1g_10gb": 2, "2g_20gb": 1, "3g_40gb": 1}),
        "dgx-a100": mig(8, **{"1g_5gb": 2, "2g_10gb": 1, "3g_20gb": 1}),
        "a100-pcie-nvlink-pairs": mig(4, **{"1g_10gb": 2, "2g_20gb": 1, "3g_40gb": 1}),
        "pcie-16-nvlink-pairs": mig(16, **{"1g_10gb": 2, "2g_20gb": 1, "3g_40gb": 1}),
        "hgx-h200": mig(8, **{"1g_18gb": 2, "2g_35gb": 1, "3g_71gb": 1}),
        "single-h200": mig(1, **{"1g_18gb": 2, "2g_35gb": 1, "3g_71gb": 1}),
        "pcie-l40s-4": Untouched(4),
        # B200 and GB200: 2 x 1g, 2g and 3g as on the 8-slice parts; B300 the same with its names; RTX PRO 6000:
        # 2 x 1g.24gb + 2g.48gb (the GPU Operator's entry), a 2g half and two 1g quarters of its 12 units.
        "dgx-b200": mig(8, **{"1g_23gb": 2, "2g_45gb": 1, "3g_90gb": 1}),
        "hgx-b300": mig(8, **{"1g_34gb": 2, "2g_67gb": 1, "3g_135gb": 1}),
        "gb200-nvl72-tray": mig(4, **{"1g_23gb": 2, "2g_47gb": 1, "3g_93gb": 1}),
        "pcie-rtx-pro-6000-8": mig(8, **{"1g_24gb": 2, "2g_48gb": 1}),
        "gb300-nvl72-tray": mig(4, **{"1g_35gb": 2, "2g_70gb": 1, "3g_139gb": 1}),
        # H100 NVL, H20 and GH200: the 8-slice geometry with their names.
        "pcie-h100-nvl-pair": mig(2, **{"1g_12gb": 2, "2g_24gb": 1, "3g_47gb": 1}),
        "hgx-h20": mig(8, **{"1g_12gb": 2, "2g_24gb": 1, "3g_48gb": 1}),
        "single-gh200": mig(1, **{"1g_12gb": 2, "2g_24gb": 1, "3g_48gb": 1}),
    },
}

# The profile of each layout that names one profile: on a GPU whose model lacks it, the layout is refused
# naming it.
PROFILE_OF = {
    "all-1g.5gb": "1g.5gb", "all-1g.5gb.me": "1g.5gb+me", "all-2g.10gb": "2g.10gb", "all-3g.20gb": "3g.20gb",
    "all-4g.20gb": "4g.20gb", "all-7g.40gb": "7g.40gb", "all-1g.10gb.me": "1g.10gb+me", "all-1g.20gb": "1g.20gb",
    "all-2g.20gb": "2g.20gb", "all-3g.40gb": "3g.40gb", "all-4g.40gb": "4g.40gb", "all-7g.80gb": "7g.80gb",
    "all-1g.18gb": "1g.18gb", "all-1g.18gb.me": "1g.18gb+me", "all-2g.35gb": "2g.35gb", "all-3g.71gb": "3g.71gb",
    "all-4g.71gb": "4g.71gb", "all-7g.141gb": "7g.141gb",
    "all-1g.12gb": "1g.12gb", "all-1g.12gb.me": "1g.12gb+me", "all-1g.24gb": "1g.24gb", "all-2g.24gb": "2g.24gb",
    "all-3g.47gb": "3g.47gb", "all-4g.47gb": "4g.47gb", "all-7g.94gb": "7g.94gb", "all-3g.48gb": "3g.48gb",
    "all-4g.48gb": "4g.48gb", "all-7g.96gb": "7g.96gb",
    "all-1g.23gb": "1g.23gb", "all-1g.23gb.me": "1g.23gb+me",
    "all-1g.45gb": "1g.45gb", "all-2g.45gb": "2g.45gb", "all-3g.90gb": "3g.90gb", "all-4g.90gb": "4g.90gb",
    "all-7g.180gb": "7g.180gb",
    "all-1g.47gb": "1g.47gb", "all-2g.47gb": "2g.47gb", "all-3g.93gb": "3g.93gb", "all-4g.93gb": "4g.93gb",
    "all-7g.186gb": "7g.186gb",
    "all-1g.34gb": "1g.34gb", "all-1g.34gb.me": "1g.34gb+me", "all-1g.67gb": "1g.67gb", "all-2g.67gb": "2g.67gb",
    "all-3g.135gb": "3g.135gb", "all-4g.135gb": "4g.135gb", "all-7g.269gb": "7g.269gb",
    "all-1g.35gb.me": "1g.35gb+me", "all-1g.70gb": "1g.70gb", "all-2g.70gb": "2g.70gb", "all-3g.139gb": "3g.139gb",
    "all-4g.139gb": "4g.139gb", "all-7g.278gb": "7g.278gb",
    "all-1g.24gb.me": "1g.24gb+me", "all-1g.24gb.gfx": "1g.24gb+gfx", "all-1g.24gb.me.all": "1g.24gb+me.all",
    "all-1g.24gb-me": "1g.24gb-me", "all-2g.48gb": "2g.48gb", "all-2g.48gb.gfx": "2g.48gb+gfx",
    "all-2g.48gb.me.all": "2g.48gb+me.all", "all-2g.48gb-me": "2g.48gb-me", "all-4g.96gb": "4g.96gb",
    "all-4g.96gb.gfx": "4g.96gb+gfx",
}


def refused_elsewhere(layout: str, **applies: Applied) -> dict[str, Applied | Untouched | Refused]:
    """A one-profile layout's row: ``applies`` on the presets named (``-`` written ``_``), refused on every other
    preset: the L40S has no MIG, the other models lack the profile."""
    named = {preset.replace("_", "-"): outcome for preset, outcome in applies.items()}
    return {preset: named.get(preset, NO_MIG if model == L40S else missing(PROFILE_OF[layout], model))
            for preset, (model, _, _) in PRESETS.items()}


# The layouts the Blackwell presets gained. Per GPU (the MIG user guide's B200 table and the GPU Operator's
# counts): B200 7 x 1g.23gb, 1 x 1g.23gb+me, 4 x 1g.45gb, 3 x 2g.45gb, 2 x 3g.90gb, 1 x 4g.90gb, 1 x 7g.180gb;
# GB200 the same counts as 1g.23gb, 1g.47gb, 2g.47gb, 3g.93gb, 4g.93gb, 7g.186gb; B300 as 1g.34gb, 1g.67gb,
# 2g.67gb, 3g.135gb, 4g.135gb, 7g.269gb; GB300 as 1g.35gb, 1g.35gb+me, 1g.70gb, 2g.70gb, 3g.139gb, 4g.139gb,
# 7g.278gb. H100 NVL (the guide's 94 GB table) 7 x 1g.12gb, 1 x 1g.12gb+me, 4 x 1g.24gb, 3 x 2g.24gb,
# 2 x 3g.47gb, 1 x 4g.47gb, 1 x 7g.94gb; H20 and GH200 (the 96 GB table) the same with 3g.48gb, 4g.48gb, 7g.96gb.
# RTX PRO 6000 (the guide's RTX PRO 6000 table): 4 x 1g.24gb, +gfx and -me, 1 x +me and +me.all; 2 x 2g.48gb,
# +gfx and -me, 1 x 2g.48gb+me.all; 1 x 4g.96gb and +gfx.
EXPECTED.update({
    "all-1g.23gb": refused_elsewhere("all-1g.23gb", dgx_b200=mig(8, **{"1g_23gb": 7}),
                                     gb200_nvl72_tray=mig(4, **{"1g_23gb": 7})),
    "all-1g.23gb.me": refused_elsewhere("all-1g.23gb.me", dgx_b200=mig(8, **{"1g_23gb_me": 1}),
                                        gb200_nvl72_tray=mig(4, **{"1g_23gb_me": 1})),
    "all-1g.45gb": refused_elsewhere("all-1g.45gb", dgx_b200=mig(8, **{"1g_45gb": 4})),
    "all-2g.45gb": refused_elsewhere("all-2g.45gb", dgx_b200=mig(8, **{"2g_45gb": 3})),
    "all-3g.90gb": refused_elsewhere("all-3g.90gb", dgx_b200=mig(8, **{"3g_90gb": 2})),
    "all-4g.90gb": refused_elsewhere("all-4g.90gb", dgx_b200=mig(8, **{"4g_90gb": 1})),
    "all-7g.180gb": refused_elsewhere("all-7g.180gb", dgx_b200=mig(8, **{"7g_180gb": 1})),
    "all-1g.47gb": refused_elsewhere("all-1g.47gb", gb200_nvl72_tray=mig(4, **{"1g_47gb": 4})),
    "all-2g.47gb": refused_elsewhere("all-2g.47gb", gb200_nvl72_tray=mig(4, **{"2g_47gb": 3})),
    "all-3g.93gb": refused_elsewhere("all-3g.93gb", gb200_nvl72_tray=mig(4, **{"3g_93gb": 2})),
    "all-4g.93gb": refused_elsewhere("all-4g.93gb", gb200_nvl72_tray=mig(4, **{"4g_93gb": 1})),
    "all-7g.186gb": refused_elsewhere("all-7g.186gb", gb200_nvl72_tray=mig(4, **{"7g_186gb": 1})),
    "all-1g.34gb": refused_elsewhere("all-1g.34gb", hgx_b300=mig(8, **{"1g_34gb": 7})),
    "all-1g.34gb.me": refused_elsewhere("all-1g.34gb.me", hgx_b300=mig(8, **{"1g_34gb_me": 1})),
    "all-1g.67gb": refused_elsewhere("all-1g.67gb", hgx_b300=mig(8, **{"1g_67gb": 4})),
    "all-2g.67gb": refused_elsewhere("all-2g.67gb", hgx_b300=mig(8, **{"2g_67gb": 3})),
    "all-3g.135gb": refused_elsewhere("all-3g.135gb", hgx_b300=mig(8, **{"3g_135gb": 2})),
    "all-4g.135gb": refused_elsewhere("all-4g.135gb", hgx_b300=mig(8, **{"4g_135gb": 1})),
    "all-7g.269gb": refused_elsewhere("all-7g.269gb", hgx_b300=mig(8, **{"7g_269gb": 1})),
    "all-1g.24gb": refused_elsewhere("all-1g.24gb", pcie_rtx_pro_6000_8=mig(8, **{"1g_24gb": 4}),
                                     pcie_h100_nvl_pair=mig(2, **{"1g_24gb": 4}), hgx_h20=mig(8, **{"1g_24gb": 4}),
                                     single_gh200=mig(1, **{"1g_24gb": 4})),
    "all-1g.12gb": refused_elsewhere("all-1g.12gb", pcie_h100_nvl_pair=mig(2, **{"1g_12gb": 7}),
                                     hgx_h20=mig(8, **{"1g_12gb": 7}), single_gh200=mig(1, **{"1g_12gb": 7})),
    "all-1g.12gb.me": refused_elsewhere("all-1g.12gb.me", pcie_h100_nvl_pair=mig(2, **{"1g_12gb_me": 1}),
                                        hgx_h20=mig(8, **{"1g_12gb_me": 1}),
                                        single_gh200=mig(1, **{"1g_12gb_me": 1})),
    "all-2g.24gb": refused_elsewhere("all-2g.24gb", pcie_h100_nvl_pair=mig(2, **{"2g_24gb": 3}),
                                     hgx_h20=mig(8, **{"2g_24gb": 3}), single_gh200=mig(1, **{"2g_24gb": 3})),
    "all-3g.47gb": refused_elsewhere("all-3g.47gb", pcie_h100_nvl_pair=mig(2, **{"3g_47gb": 2})),
    "all-4g.47gb": refused_elsewhere("all-4g.47gb", pcie_h100_nvl_pair=mig(2, **{"4g_47gb": 1})),
    "all-7g.94gb": refused_elsewhere("all-7g.94gb", pcie_h100_nvl_pair=mig(2, **{"7g_94gb": 1})),
    "all-3g.48gb": refused_elsewhere("all-3g.48gb", hgx_h20=mig(8, **{"3g_48gb": 2}),
                                     single_gh200=mig(1, **{"3g_48gb": 2})),
    "all-4g.48gb": refused_elsewhere("all-4g.48gb", hgx_h20=mig(8, **{"4g_48gb": 1}),
                                     single_gh200=mig(1, **{"4g_48gb": 1})),
    "all-7g.96gb": refused_elsewhere("all-7g.96gb", hgx_h20=mig(8, **{"7g_96gb": 1}),
                                     single_gh200=mig(1, **{"7g_96gb": 1})),
    "all-1g.35gb.me": refused_elsewhere("all-1g.35gb.me", gb300_nvl72_tray=mig(4, **{"1g_35gb_me": 1})),
    "all-1g.70gb": refused_elsewhere("all-1g.70gb", gb300_nvl72_tray=mig(4, **{"1g_70gb": 4})),
    "all-2g.70gb": refused_elsewhere("all-2g.70gb", gb300_nvl72_tray=mig(4, **{"2g_70gb": 3})),
    "all-3g.139gb": refused_elsewhere("all-3g.139gb", gb300_nvl72_tray=mig(4, **{"3g_139gb": 2})),
    "all-4g.139gb": refused_elsewhere("all-4g.139gb", gb300_nvl72_tray=mig(4, **{"4g_139gb": 1})),
    "all-7g.278gb": refused_elsewhere("all-7g.278gb", gb300_nvl72_tray=mig(4, **{"7g_278gb": 1})),
    "all-1g.24gb.me": refused_elsewhere("all-1g.24gb.me", pcie_rtx_pro_6000_8=mig(8, **{"1g_24gb_me": 1})),
    "all-1g.24gb.gfx": refused_elsewhere("all-1g.24gb.gfx", pcie_rtx_pro_6000_8=mig(8, **{"1g_24gb_gfx": 4})),
    "all-1g.24gb.me.all": refused_elsewhere("all-1g.24gb.me.all",
                                            pcie_rtx_pro_6000_8=mig(8, **{"1g_24gb_me_all": 1})),
    "all-1g.24gb-me": refused_elsewhere("all-1g.24gb-me", pcie_rtx_pro_6000_8=mig(8, **{"1g_24gb-me": 4})),
    "all-2g.48gb": refused_elsewhere("all-2g.48gb", pcie_rtx_pro_6000_8=mig(8, **{"2g_48gb": 2})),
    "all-2g.48gb.gfx": refused_elsewhere("all-2g.48gb.gfx", pcie_rtx_pro_6000_8=mig(8, **{"2g_48gb_gfx": 2})),
    "all-2g.48gb.me.all": refused_elsewhere("all-2g.48gb.me.all",
                                            pcie_rtx_pro_6000_8=mig(8, **{"2g_48gb_me_all": 1})),
    "all-2g.48gb-me": refused_elsewhere("all-2g.48gb-me", pcie_rtx_pro_6000_8=mig(8, **{"2g_48gb-me": 2})),
    "all-4g.96gb": refused_elsewhere("all-4g.96gb", pcie_rtx_pro_6000_8=mig(8, **{"4g_96gb": 1})),
    "all-4g.96gb.gfx": refused_elsewhere("all-4g.96gb.gfx", pcie_rtx_pro_6000_8=mig(8, **{"4g_96gb_gfx": 1})),
})
# The newer presets on the layouts written before them: all disabled is where they start, MIG on without
# instances advertises nothing, the PCI-filtered 1g.10gb layout selects none of them, and every one-profile
# layout of the A100, H100 and H200 names a profile they lack.
for _preset in NEW_PRESETS:
    _model, _gpus, _ = PRESETS[_preset]
    EXPECTED["all-disabled"][_preset] = Applied({"nvidia.com/gpu": _gpus}, already=True)
    EXPECTED["all-enabled"][_preset] = Applied({})
    EXPECTED["all-1g.10gb"][_preset] = Untouched(_gpus)
    for _name, _row in EXPECTED.items():
        if _preset not in _row:
            _row[_preset] = missing(PROFILE_OF[_name], _model)
SHIPPED = load_layouts(None)
CASES = [(preset, name) for name in EXPECTED for preset in EXPECTED[name]]


def test_the_table_covers_every_shipped_layout_and_preset() -> None:
    presets = sorted(p.stem for p in (Path(__file__).parents[2] / "agent" / "nvml" / "presets").glob("*.yaml"))
    assert sorted(PRESETS) == presets
    assert sorted(EXPECTED) == sorted(SHIPPED.names())
    assert all(sorted(row) == presets for row in EXPECTED.values())


@dataclass(frozen=True)
class Look:
    """What the node shows at one moment, read through one inventory."""

    modes: list[tuple[bool, bool]]
    """(MIG enabled, mode change pending) per GPU."""
    mig_devices: list[Counter[str]]
    """Each GPU's MIG devices by profile."""
    mig_uuids: int
    """How many distinct MIG device UUIDs the node shows."""
    resources: dict[str, int]
    """What the agent would advertise under migStrategy mixed: devices per resource."""
    on_disk: bytes | None
    """The fake's state file."""

    def snapshot(self) -> tuple[list[tuple[bool, bool]], list[Counter[str]], bytes | None]:
        return self.modes, self.mig_devices, self.on_disk


@dataclass
class Node:
    fake: FakeNvml
    backend: NvmlBackend
    ops: MigOps
    state_file: Path

    def apply(self, name: str, steps: list[str] | None = None) -> ApplyResult:
        return apply_layout(self.ops, len(self.fake.spec.gpus), SHIPPED.layout(name),
                            step=steps.append if steps is not None else lambda _: None)

    def modes(self) -> list[tuple[bool, bool]]:
        """(MIG enabled, mode change pending) per GPU."""
        return [(s.mig_enabled, s.mig_pending) for s in map(self.ops.state, range(len(self.fake.spec.gpus)))]

    def look(self) -> Look:
        on_disk = self.state_file.read_bytes() if self.state_file.exists() else None
        modes = self.modes()
        inventory = self.backend.inventory()
        found: list[Counter[str]] = [Counter() for _ in self.fake.spec.gpus]
        for device in inventory.mig_devices:
            found[device.parent_index][device.profile] += 1
        state = NodeState(version=1, inventory=inventory, config=MIXED)
        resources = {name: len(r.devices) for name, r in plan(state).resources.items()}
        return Look(modes, found, len({d.uuid for d in inventory.mig_devices}), resources, on_disk)


@functools.cache
def spec(preset: str) -> NodeSpec:
    """The preset's node, parsed once: a NodeSpec is frozen, and each FakeNvml keeps its state apart from it."""
    return load_node(preset)


def started(preset: str, tmp_path: Path) -> Node:
    state_file = tmp_path / "nvml.json"
    fake = FakeNvml(spec(preset), state_file)
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    return Node(fake, backend, MigOps(backend), state_file)


def per_gpu(resources: dict[str, int], gpus: int) -> Counter[str]:
    """The MIG profiles one GPU holds when the MIG resources are spread evenly over ``gpus`` GPUs."""
    assert all(n % gpus == 0 for n in resources.values()), resources
    return Counter({name.removeprefix("nvidia.com/mig-"): n // gpus for name, n in resources.items()
                    if name.startswith("nvidia.com/mig-")})


def profile_key(name: str) -> str:
    """A MIG device's profile as its resource name writes it (``+`` as ``.``)."""
    return name.replace("+", ".")


@pytest.mark.parametrize(("preset", "name"), CASES)
def test_a_shipped_layout_ends_as_the_table_says(tmp_path: Path, preset: str, name: str) -> None:
    model, gpus, needs_reset = PRESETS[preset]
    expected = EXPECTED[name][preset]
    node = started(preset, tmp_path)
    assert [g.model.nvml_name.removeprefix("NVIDIA ") for g in node.fake.spec.gpus] == [model] * gpus
    fresh = node.look()
    assert fresh.modes == [(False, False)] * gpus and fresh.mig_devices == [Counter()] * gpus
    steps: list[str] = []

    result = node.apply(name, steps)

    if isinstance(expected, Refused):
        assert result.outcome == "failed", result
        head = f"layout {name!r} cannot be applied: "
        assert result.reason.startswith(head), result.reason
        lines = result.reason.removeprefix(head).split("\n")
        assert [line.split(": ", 1)[0] for line in lines] == [f"GPU {i}" for i in range(gpus)], result.reason
        assert all(expected.words in line for line in lines), result.reason
        assert steps == []
        after = node.look()
        assert after.snapshot() == fresh.snapshot()
        assert after.resources == {"nvidia.com/gpu": gpus}
        return

    if isinstance(expected, Untouched):
        assert (result.outcome, result.reason) == (
            "success", f"layout {name!r} selects no GPU on this node: none of its device filters and device lists "
            f"matches the node's {gpus} GPU{'s' if gpus != 1 else ''}; nothing changed")
        assert steps == []
        after = node.look()
        assert after.snapshot() == fresh.snapshot()
        assert after.resources == {"nvidia.com/gpu": expected.gpus}
        return

    mig_on = "nvidia.com/gpu" not in expected.resources
    if expected.already:
        assert (result.outcome, result.reason, steps) == ("success", f"layout {name!r} is already applied", [])
    elif needs_reset:
        # Ampere: enabling MIG waits for a GPU reset; the agent says so and finishes after it.
        pending = "; ".join(f"GPU {i}: MIG enable is pending (the GPU is in use or needs a reset)"
                            for i in range(gpus))
        assert (result.outcome, result.reason) == ("rebooting", f"{pending}; {RESET_HINT}")
        assert steps == [f"GPU {i}: enable MIG" for i in range(gpus)]
        assert node.modes() == [(False, True)] * gpus
        for index in range(gpus):
            node.fake.reset_gpu(index)
        result = node.apply(name)
        creates = sum(expected.resources.values())
        assert (result.outcome, result.reason) == (
            "success", f"layout {name!r} applied: {creates} change(s)" if creates else
            f"layout {name!r} is already applied")
    else:
        # Hopper: MIG on at once, then every instance created; one step each.
        creates = sum(expected.resources.values())
        assert (result.outcome, result.reason) == ("success", f"layout {name!r} applied: {gpus + creates} change(s)")
        assert len(steps) == gpus + creates

    done = node.look()
    assert done.modes == [(mig_on, False)] * gpus
    assert done.resources == expected.resources
    one_gpu = per_gpu(expected.resources, gpus)
    assert [Counter({profile_key(p): n for p, n in c.items()}) for c in done.mig_devices] == [one_gpu] * gpus
    assert done.mig_uuids == sum(one_gpu.values()) * gpus

    # Applying it again finds nothing to do.
    again: list[str] = []
    second = node.apply(name, again)
    assert (second.outcome, second.reason, again) == ("success", f"layout {name!r} is already applied", [])
    assert node.look().resources == expected.resources
