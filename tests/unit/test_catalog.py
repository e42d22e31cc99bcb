"""The GPU model catalog against the figures in docs/reference/mig-profiles.md."""

from __future__ import annotations

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
        "A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB", "L40S", "T4",
    ]


def test_unknown_model_is_a_key_error_listing_known_keys() -> None:
    with pytest.raises(KeyError) as caught:
        lookup("H300")
    assert str(caught.value) == (
        "unknown GPU model 'H300' "
        "(known: A100-SXM4-40GB, A100-SXM4-80GB, H100-SXM5-80GB, H200-141GB, L40S, T4)"
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


def test_only_a100_h100_h200_are_mig_capable() -> None:
    assert [m.key for m in catalog.MODELS.values() if m.mig_capable] == [
        "A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB",
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
        for key in ("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB")
    }
    first = shapes.pop("A100-SXM4-40GB")
    assert all(s == first for s in shapes.values())
    assert {index: pid for index, pid, *_ in first} == {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}
    assert {pid: (ci_index, ci_id) for _, pid, _, _, ci_index, ci_id in first} == {
        19: (0, 0), 20: (0, 0), 15: (0, 0), 14: (1, 1), 9: (2, 2), 5: (3, 3), 0: (4, 4),
    }


@pytest.mark.parametrize("key", ["A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB"])
def test_every_profile_name_follows_from_its_memory(key: str) -> None:
    model = lookup(key)
    for profile in model.mig_profiles:
        size = profile.name.split(".")[1].split("+")[0]
        assert size == f"{profile_memory_gb(profile.memory_size_mib, model.memory_mib * MIB)}gb", profile.name


def test_name_rounding_is_half_away_from_zero() -> None:
    total = lookup("H200-141GB").memory_mib * MIB
    assert profile_memory_gb(16 * 1024, total) == 18  # 1/8 of 141 = 17.625
    assert profile_memory_gb(int(69.5 * 1024), total) == 71  # 70.5: banker's rounding would give 70
