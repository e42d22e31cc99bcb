"""Text rendering of a topology as a link matrix, in the style of `nvidia-smi topo -m`."""

from __future__ import annotations

from collections.abc import Sequence

from agent.topology.model import PcieLevel, Topology

PCIE_CELL: dict[PcieLevel, str] = {
    "single": "PIX",
    "multiple": "PXB",
    "hostbridge": "PHB",
    "node": "NODE",
    "system": "SYS",
}

LEGEND = (
    "Legend:",
    "",
    "  X    = Self",
    "  SYS  = PCIe path that also crosses the interconnect between NUMA nodes (e.g. QPI/UPI/xGMI)",
    "  NODE = PCIe path that also crosses between PCIe host bridges within one NUMA node",
    "  PHB  = PCIe path through a PCIe host bridge (typically the CPU)",
    "  PXB  = PCIe path through several PCIe bridges, without a host bridge",
    "  PIX  = PCIe path through at most one PCIe bridge",
    "  NV#  = NVLink, a bonded set of # links",
)


def cell(topo: Topology, a: int, b: int) -> str:
    """The matrix entry for GPUs a and b: "X", "NV<k>" or the PCIe abbreviation."""
    if a == b:
        return "X"
    links = topo.nvlink[a][b]
    if links:
        return f"NV{links}"
    level = topo.pcie[a][b]
    assert level is not None  # only the diagonal has no PCIe level
    return PCIE_CELL[level]


def render_matrix(topo: Topology, labels: Sequence[str] | None = None) -> str:
    """The link matrix with a "NUMA Affinity" column ("N/A" when unknown), followed by the legend.

    Rows and columns are named by `labels` (default GPU0, GPU1, ...). Columns are left-aligned and separated
    by two spaces; lines carry no trailing spaces; the text ends with a newline.
    """
    n = topo.gpu_count
    names = list(labels) if labels is not None else [f"GPU{i}" for i in range(n)]
    if len(names) != n:
        raise ValueError(f"{len(names)} labels given for {n} GPUs")
    header = ["", *names, "NUMA Affinity"]
    rows = [header] + [
        [
            names[a],
            *(cell(topo, a, b) for b in range(n)),
            "N/A" if topo.numa[a] is None else str(topo.numa[a]),
        ]
        for a in range(n)
    ]
    widths = [max(len(row[col]) for row in rows) for col in range(len(header))]
    lines = [
        "  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join([*lines, "", *LEGEND]) + "\n"
