"""The Blackwell and later Hopper node presets as `gpu-agent simulate --node <preset>` shows them: the GPU
feature discovery labels, the advertised GPUs and their NUMA nodes, with every expected value taken from public
sources (NVML product names and totals as nvidia-smi prints them on these parts, the compute capabilities of the
MIG user guide and nvidia-smi, GPU feature discovery's family rule), and MIG on the RTX PRO 6000 as nvidia-smi
shows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.config import DEFAULT_CONFIG
from agent.mig.applier import apply_layout
from agent.mig.layout import parse_layouts
from agent.nvml.backend import open_backend
from agent.nvml.mig_ops import MigOps
from agent.simulate import simulate

# preset: (gpu.product, gpu.memory in MiB, compute major, minor, gpu.family, GPU count, NUMA node of each GPU,
#          largest NVLink group, CUDA driver major)
EXPECTED: dict[str, tuple[str, str, str, str, str, int, list[int], str, str]] = {
    # DGX B200: 8 x "NVIDIA B200", 183359MiB each in nvidia-smi, compute capability 10.0, NVSwitch.
    "dgx-b200": ("NVIDIA-B200", "183359", "10", "0", "blackwell", 8, [0] * 4 + [1] * 4, "8", "570"),
    # HGX B300: 8 x "NVIDIA B300 SXM6 AC", 275040MiB, compute capability 10.3 (sm_103), NVSwitch.
    "hgx-b300": ("NVIDIA-B300-SXM6-AC", "275040", "10", "3", "blackwell", 8, [0] * 4 + [1] * 4, "8", "580"),
    # GB200 NVL72 compute tray: 4 x "NVIDIA GB200", 189471MiB, 10.0; two Grace CPUs of two GPUs each.
    "gb200-nvl72-tray": ("NVIDIA-GB200", "189471", "10", "0", "blackwell", 4, [0, 0, 1, 1], "4", "580"),
    # GB300 NVL72 compute tray: 4 x "NVIDIA GB300", 284208MiB, 10.3.
    "gb300-nvl72-tray": ("NVIDIA-GB300", "284208", "10", "3", "blackwell", 4, [0, 0, 1, 1], "4", "580"),
    # 8 x "NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887MiB, 12.0, PCIe only.
    "pcie-rtx-pro-6000-8": ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", "97887", "12", "0", "blackwell", 8,
                            [0] * 4 + [1] * 4, "0", "580"),
    # Hopper: 8 x "NVIDIA H20" (97871MiB), one "NVIDIA GH200 480GB" (97871MiB), two "NVIDIA H100 NVL" (95830MiB)
    # on an NVLink bridge; compute capability 9.0.
    "hgx-h20": ("NVIDIA-H20", "97871", "9", "0", "hopper", 8, [0] * 4 + [1] * 4, "8", "570"),
    "single-gh200": ("NVIDIA-GH200-480GB", "97871", "9", "0", "hopper", 1, [0], "0", "570"),
    "pcie-h100-nvl-pair": ("NVIDIA-H100-NVL", "95830", "9", "0", "hopper", 2, [0, 0], "2", "570"),
}


async def simulated(preset: str) -> dict[str, Any]:
    return await simulate(open_backend(f"mock:{preset}"), DEFAULT_CONFIG, node_name=f"sim-{preset}")


@pytest.mark.parametrize("preset", sorted(EXPECTED))
async def test_a_preset_shows_its_gpus_as_gpu_feature_discovery_labels_them(preset: str) -> None:
    product, memory, major, minor, family, count, numa, nvlink_group, driver_major = EXPECTED[preset]

    view = await simulated(preset)

    labels = view["node"]["labels"]
    assert {key: labels[key] for key in (
        "nvidia.com/gpu.product", "nvidia.com/gpu.memory", "nvidia.com/gpu.compute.major",
        "nvidia.com/gpu.compute.minor", "nvidia.com/gpu.family", "nvidia.com/gpu.count", "nvidia.com/mig.capable",
        "nvidia.com/cuda.driver.major", "gpu-node-agent.io/nvlink.largest-group",
    )} == {
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.memory": memory,
        "nvidia.com/gpu.compute.major": major,
        "nvidia.com/gpu.compute.minor": minor,
        "nvidia.com/gpu.family": family,
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/mig.capable": "true",
        "nvidia.com/cuda.driver.major": driver_major,
        "gpu-node-agent.io/nvlink.largest-group": nvlink_group,
    }
    assert view["node"]["capacity"] == view["node"]["allocatable"] == {"nvidia.com/gpu": str(count)}
    assert view["node"]["taints"] == []
    devices = view["devices"]["nvidia.com/gpu"]
    assert [(d["health"], d["numa"]) for d in devices] == [("Healthy", n) for n in numa]
    assert len({d["id"] for d in devices}) == count


RTX_LAYOUTS = """\
version: v1
mig-configs:
  quarters:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.24gb": 4}
  half-and-quarters:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"2g.48gb": 1, "1g.24gb": 2}
"""


@pytest.mark.parametrize(("layout", "instances"), [
    # nvidia-smi mig -lgi after `-cgi 1g.24gb,1g.24gb,1g.24gb,1g.24gb -C`: GI 3 at 0:3, 4 at 3:3, 5 at 6:3, 6 at 9:3.
    ("quarters", [(3, "1g.24gb", 0, 3), (4, "1g.24gb", 3, 3), (5, "1g.24gb", 6, 3), (6, "1g.24gb", 9, 3)]),
    # ... and after `-cgi 2g.48gb,1g.24gb,1g.24gb -C`: GI 1 at 0:6, 5 at 6:3, 6 at 9:3.
    ("half-and-quarters", [(1, "2g.48gb", 0, 6), (5, "1g.24gb", 6, 3), (6, "1g.24gb", 9, 3)]),
])
def test_rtx_pro_6000_instances_sit_on_its_twelve_placement_units(
    tmp_path: Path, layout: str, instances: list[tuple[int, str, int, int]]
) -> None:
    backend = open_backend("mock:pcie-rtx-pro-6000-8", tmp_path / "nvml.json")
    backend.init()
    result = apply_layout(MigOps(backend), 8, parse_layouts(RTX_LAYOUTS, "layouts.yaml").layout(layout))
    assert result.outcome == "success", result.reason
    found = sorted((d.gpu_instance_id, d.profile, d.placement_start, d.placement_size)
                   for d in backend.inventory().mig_devices if d.parent_index == 0)
    assert found == instances
