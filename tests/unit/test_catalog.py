"""The GPU model catalog against the figures in docs/reference/mig-profiles.md."""

from __future__ import annotations

import re

import pynvml
import pytest

from agent.nvml import catalog
from agent.nvml.catalog import MIB, Placement, lookup, profile_memory_gb


def _rows(key: str) -> dict[str, tuple[int, int, int, int, int]]:
    """name -> (GI id, index constant, max instances, memory MiB, SMs)."""
    return {
        p.name: (p.id, p.index, p.instance_count, p.memory_size_mib, p.multiprocessor_count)
        for p in lookup(key).mig_profiles
    }


def test_models_known_by_node_file_key() -> None:
    assert catalog.known_models() == [
        "A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB", "H100-NVL", "H20", "GH200-480GB",
        "B200", "GB200", "B300-SXM6", "GB300", "RTX-PRO-6000-BSE", "L40S", "T4",
    ]


def test_unknown_model_is_a_key_error_listing_known_keys() -> None:
    with pytest.raises(KeyError) as caught:
        lookup("H300")
    assert str(caught.value) == (
        "unknown GPU model 'H300' "
        "(known: A100-SXM4-40GB, A100-SXM4-80GB, H100-SXM5-80GB, H200-141GB, H100-NVL, H20, GH200-480GB, B200, "
        "GB200, B300-SXM6, GB300, RTX-PRO-6000-BSE, L40S, T4)"
    )


@pytest.mark.parametrize(
    ("key", "name", "memory", "arch", "arch_name", "cc", "family", "links", "pci_id"),
    [
        ("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 40960, pynvml.NVML_DEVICE_ARCH_AMPERE, "ampere", (8, 0),
         "ampere", 12, 0x20B010DE),
        ("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", 81920, pynvml.NVML_DEVICE_ARCH_AMPERE, "ampere", (8, 0),
         "ampere", 12, 0x20B210DE),
        ("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3", 81559, pynvml.NVML_DEVICE_ARCH_HOPPER, "hopper", (9, 0),
         "hopper", 18, 0x233010DE),
        ("H200-141GB", "NVIDIA H200", 143771, pynvml.NVML_DEVICE_ARCH_HOPPER, "hopper", (9, 0),
         "hopper", 18, 0x233510DE),
        ("L40S", "NVIDIA L40S", 46068, pynvml.NVML_DEVICE_ARCH_ADA, "ada", (8, 9),
         "ada-lovelace", 0, 0x26B910DE),
        ("T4", "Tesla T4", 15360, pynvml.NVML_DEVICE_ARCH_TURING, "turing", (7, 5), "turing", 0, 0x1EB810DE),
        # Names and device ids: the NVIDIA driver's list of supported GPUs; totals: nvidia-smi on each part;
        # compute capability: the MIG user guide's "Supported GPUs" (10.0, 12.0, 9.0) and nvidia-smi (10.3).
        ("H100-NVL", "NVIDIA H100 NVL", 95830, pynvml.NVML_DEVICE_ARCH_HOPPER, "hopper", (9, 0), "hopper", 12,
         0x232110DE),
        ("H20", "NVIDIA H20", 97871, pynvml.NVML_DEVICE_ARCH_HOPPER, "hopper", (9, 0), "hopper", 18, 0x232910DE),
        ("GH200-480GB", "NVIDIA GH200 480GB", 97871, pynvml.NVML_DEVICE_ARCH_HOPPER, "hopper", (9, 0), "hopper",
         18, 0x234210DE),
        ("B200", "NVIDIA B200", 183359, pynvml.NVML_DEVICE_ARCH_BLACKWELL, "blackwell", (10, 0), "blackwell", 18,
         0x290110DE),
        ("GB200", "NVIDIA GB200", 189471, pynvml.NVML_DEVICE_ARCH_BLACKWELL, "blackwell", (10, 0), "blackwell",
         18, 0x294110DE),
        ("B300-SXM6", "NVIDIA B300 SXM6 AC", 275040, pynvml.NVML_DEVICE_ARCH_BLACKWELL, "blackwell", (10, 3),
         "blackwell", 18, 0x318210DE),
        ("GB300", "NVIDIA GB300", 284208, pynvml.NVML_DEVICE_ARCH_BLACKWELL, "blackwell", (10, 3), "blackwell",
         18, 0x31C210DE),
        ("RTX-PRO-6000-BSE", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887,
         pynvml.NVML_DEVICE_ARCH_BLACKWELL, "blackwell", (12, 0), "blackwell", 0, 0x2BB510DE),
    ],
)
def test_model_identity(
    key: str, name: str, memory: int, arch: int, arch_name: str, cc: tuple[int, int], family: str, links: int,
    pci_id: int,
) -> None:
    model = lookup(key)
    assert (model.nvml_name, model.memory_mib) == (name, memory)
    assert (model.architecture, model.arch_name) == (arch, arch_name)
    assert (model.compute_capability, model.family, model.nvlink_links, model.pci_device_id) == (
        cc, family, links, pci_id,
    )


def test_mig_capable_models() -> None:
    # The MIG user guide's "Supported GPUs": every model of the catalog but the L40S and the T4.
    assert [m.key for m in catalog.MODELS.values() if m.mig_capable] == [
        "A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB", "H100-NVL", "H20", "GH200-480GB",
        "B200", "GB200", "B300-SXM6", "GB300", "RTX-PRO-6000-BSE",
    ]
    assert lookup("L40S").mig_profiles == ()
    assert lookup("T4").mig_profiles == ()


def test_a100_40gb_table() -> None:
    assert _rows("A100-SXM4-40GB") == {
        "1g.5gb": (19, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 7, 4864, 14),
        "1g.5gb+me": (20, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 1, 4864, 14),
        "1g.10gb": (15, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 4, 9856, 14),
        "2g.10gb": (14, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 3, 9856, 28),
        "3g.20gb": (9, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 2, 19968, 42),
        "4g.20gb": (5, pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 1, 19968, 56),
        "7g.40gb": (0, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 1, 40192, 98),
    }


def test_a100_80gb_uses_the_real_smi_figures_where_known() -> None:
    rows = _rows("A100-SXM4-80GB")
    assert rows["1g.10gb"] == (19, 0, 7, 9728, 14)  # 9.50 GiB in nvidia-smi; the mock's 9856 is wrong
    assert rows["2g.20gb"] == (14, 1, 3, 19968, 28)
    assert rows["3g.40gb"] == (9, 2, 2, 40192, 42)
    assert rows["7g.80gb"] == (0, 4, 1, 80384, 98)
    assert sorted(rows) == ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def test_h100_table() -> None:
    assert _rows("H100-SXM5-80GB") == {
        "1g.10gb": (19, 0, 7, 9984, 16),
        "1g.10gb+me": (20, 7, 1, 9984, 16),
        "1g.20gb": (15, 9, 4, 20096, 26),
        "2g.20gb": (14, 1, 3, 20096, 32),
        "3g.40gb": (9, 2, 2, 40448, 60),
        "4g.40gb": (5, 3, 1, 40448, 64),
        "7g.80gb": (0, 4, 1, 81152, 132),
    }


def test_h100_placements() -> None:
    model = lookup("H100-SXM5-80GB")

    def placements(name: str) -> tuple[Placement, ...]:
        profile = model.profile_by_name(name)
        assert profile is not None
        return profile.placements

    assert placements("1g.10gb") == tuple((s, 1) for s in range(7))
    assert placements("1g.10gb+me") == tuple((s, 1) for s in range(7))
    assert placements("1g.20gb") == ((0, 2), (2, 2), (4, 2), (6, 2))
    assert placements("2g.20gb") == ((0, 2), (2, 2), (4, 2))
    assert placements("3g.40gb") == ((0, 4), (4, 4))
    assert placements("4g.40gb") == ((0, 4),)
    assert placements("7g.80gb") == ((0, 8),)


def test_h200_table() -> None:
    assert _rows("H200-141GB") == {
        "1g.18gb": (19, 0, 7, 16384, 16),
        "1g.18gb+me": (20, 7, 1, 16384, 16),
        "1g.35gb": (15, 9, 4, 33024, 26),
        "2g.35gb": (14, 1, 3, 33024, 32),
        "3g.71gb": (9, 2, 2, 71168, 60),
        "4g.71gb": (5, 3, 1, 71168, 64),
        "7g.141gb": (0, 4, 1, 143104, 132),
    }
    engines = {p.name: (p.decoders, p.encoders, p.jpegs, p.ofas) for p in lookup("H200-141GB").mig_profiles}
    assert engines["1g.18gb+me"] == (1, 0, 1, 1)
    assert engines["7g.141gb"] == (7, 0, 7, 1)


def test_ids_and_placements_shared_by_all_full_size_mig_gpus() -> None:
    shapes = {
        key: [(p.index, p.id, p.slice_count, p.placements, p.ci_profile_index, p.ci_profile_id)
              for p in lookup(key).mig_profiles]
        for key in ("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB", "H100-NVL", "H20",
                    "GH200-480GB", "B200", "GB200", "B300-SXM6", "GB300")
    }
    first = shapes.pop("A100-SXM4-40GB")
    assert all(s == first for s in shapes.values())
    assert {index: pid for index, pid, *_ in first} == {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}
    assert {pid: (ci_index, ci_id) for _, pid, _, _, ci_index, ci_id in first} == {
        19: (0, 0), 20: (0, 0), 15: (0, 0), 14: (1, 1), 9: (2, 2), 5: (3, 3), 0: (4, 4),
    }


@pytest.mark.parametrize("key", [m.key for m in catalog.MODELS.values() if m.mig_capable])
def test_every_profile_name_follows_from_its_memory(key: str) -> None:
    model = lookup(key)
    for profile in model.mig_profiles:
        size = re.fullmatch(r"\d+g\.(\d+gb)([+-][a-z.]+)?", profile.name)
        assert size is not None, profile.name
        assert size[1] == f"{profile_memory_gb(profile.memory_size_mib, model.memory_mib * MIB)}gb", profile.name


def test_name_rounding_is_half_away_from_zero() -> None:
    total = lookup("H200-141GB").memory_mib * MIB
    assert profile_memory_gb(16 * 1024, total) == 18  # 1/8 of 141 = 17.625
    assert profile_memory_gb(int(69.5 * 1024), total) == 71  # 70.5: banker's rounding would give 70


# The GPU Operator's default mig-parted config names these profiles for each model; the MIG user guide gives the
# counts (B200's table for the Blackwell data-center parts, the 94 GB and 96 GB tables for H100 NVL, GH200, H20).
FULL_SIZE_NAMES = {
    "H100-NVL": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    "H20": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
    "GH200-480GB": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
    "B200": ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
    "GB200": ["1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"],
    "B300-SXM6": ["1g.34gb", "1g.34gb+me", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"],
    "GB300": ["1g.35gb", "1g.35gb+me", "1g.70gb", "2g.70gb", "3g.139gb", "4g.139gb", "7g.278gb"],
}


@pytest.mark.parametrize("key", sorted(FULL_SIZE_NAMES))
def test_full_size_tables_name_the_published_profiles_with_the_published_counts(key: str) -> None:
    assert [(p.name, p.instance_count, p.slice_count) for p in lookup(key).mig_profiles] == list(zip(
        FULL_SIZE_NAMES[key], [7, 1, 4, 3, 2, 1, 1], [1, 1, 1, 2, 3, 4, 7], strict=True))


def test_b200_rows_captured_from_nvidia_smi() -> None:
    # `nvidia-smi mig -lgip` on a B200 (NVIDIA/mig-parted#187): id, instances, GiB, SMs; CE/DEC/JPEG/OFA.
    rows = _rows("B200")
    assert rows["1g.23gb"] == (19, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 7, int(20.50 * 1024), 18)
    assert rows["1g.23gb+me"] == (20, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 1, int(20.50 * 1024), 18)
    assert rows["1g.45gb"] == (15, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 4, int(44.25 * 1024), 30)
    assert rows["2g.45gb"] == (14, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 3, int(44.25 * 1024), 36)
    engines = {p.name: (p.copy_engines, p.decoders, p.jpegs, p.ofas) for p in lookup("B200").mig_profiles}
    assert engines["1g.23gb"] == (2, 1, 1, 0)
    assert engines["1g.23gb+me"] == (2, 1, 1, 1)
    assert engines["2g.45gb"] == (4, 2, 2, 0)
    # The MIG user guide's B200 table: copy engines of 3g, 4g and 7g; one OFA on 7g.
    assert [engines[n][0] for n in ("3g.90gb", "4g.90gb", "7g.180gb")] == [6, 8, 16]
    assert engines["7g.180gb"][3] == 1


def test_gb200_rows_captured_from_nvidia_smi() -> None:
    # `nvidia-smi mig -lgip` on a GB200 (NVIDIA/mig-parted#227).
    rows = _rows("GB200")
    assert rows["1g.23gb"] == (19, 0, 7, int(22.00 * 1024), 18)
    assert rows["1g.47gb"] == (15, 9, 4, int(45.50 * 1024), 32)
    assert rows["2g.47gb"] == (14, 1, 3, int(45.50 * 1024), 38)


def test_rtx_pro_6000_table() -> None:
    # `nvidia-smi mig -lgip` on an RTX PRO 6000 Blackwell Server Edition (GoogleCloudPlatform/
    # container-engine-accelerators#564): id, instances, memory (23.62, 47.38, 95.12 GiB), SMs.
    quarter, half, whole = int(23.625 * 1024), int(47.375 * 1024), int(95.125 * 1024)
    assert _rows("RTX-PRO-6000-BSE") == {
        "1g.24gb": (14, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 4, quarter, 46),
        "1g.24gb+me": (21, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 1, quarter, 46),
        "1g.24gb+gfx": (47, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX, 4, quarter, 46),
        "1g.24gb+me.all": (65, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, 1, quarter, 46),
        "1g.24gb-me": (67, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, 4, quarter, 46),
        "2g.48gb": (5, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 2, half, 94),
        "2g.48gb+gfx": (35, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX, 2, half, 94),
        "2g.48gb+me.all": (64, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, 1, half, 94),
        "2g.48gb-me": (66, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME, 2, half, 94),
        "4g.96gb": (0, pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 1, whole, 188),
        "4g.96gb+gfx": (32, pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX, 1, whole, 188),
    }
    engines = {p.name: (p.copy_engines, p.decoders, p.encoders, p.jpegs, p.ofas)
               for p in lookup("RTX-PRO-6000-BSE").mig_profiles}
    assert engines == {
        "1g.24gb": (1, 1, 1, 1, 0), "1g.24gb+me": (1, 1, 1, 1, 1), "1g.24gb+gfx": (1, 1, 1, 1, 0),
        "1g.24gb+me.all": (1, 4, 4, 4, 1), "1g.24gb-me": (1, 0, 0, 0, 0),
        "2g.48gb": (2, 2, 2, 2, 0), "2g.48gb+gfx": (2, 2, 2, 2, 0), "2g.48gb+me.all": (2, 4, 4, 4, 1),
        "2g.48gb-me": (2, 0, 0, 0, 0), "4g.96gb": (4, 4, 4, 4, 1), "4g.96gb+gfx": (4, 4, 4, 4, 1),
    }


def test_rtx_pro_6000_placements_on_twelve_units() -> None:
    # `nvidia-smi mig -lgipp`: {0,3,6,9}:3 for every 1g profile, {0,6}:6 for 2g, {0}:12 for 4g.
    placements = {p.name: p.placements for p in lookup("RTX-PRO-6000-BSE").mig_profiles}
    for name, found in placements.items():
        expected = {"1g": ((0, 3), (3, 3), (6, 3), (9, 3)), "2g": ((0, 6), (6, 6)), "4g": ((0, 12),)}[name[:2]]
        assert found == expected, name
