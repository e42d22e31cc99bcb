"""The simulated-node file format: presets, defaults, derived topology and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.nvml.nodefile import (
    NodeFileError,
    default_bus_id,
    default_uuid,
    load_node,
    normalize_bus_id,
    parse_node,
    presets,
)

KNOWN_PRESETS = ("a100-pcie-nvlink-pairs, dgx-a100, dgx-b200, dgx-h100, gb200-nvl72-tray, gb300-nvl72-tray, "
                 "hgx-16-nvswitch, hgx-b300, hgx-h20, hgx-h200, pcie-16-nvlink-pairs, pcie-h100-nvl-pair, "
                 "pcie-l40s-4, pcie-rtx-pro-6000-8, single-gh200, single-h200")


def _errors(text: str) -> list[str]:
    with pytest.raises(NodeFileError) as caught:
        parse_node(text, "node.yaml")
    return caught.value.lines


def test_presets_listed() -> None:
    assert presets() == KNOWN_PRESETS.split(", ")


@pytest.mark.parametrize(
    ("preset", "models", "numa"),
    [
        ("dgx-h100", ["H100-SXM5-80GB"] * 8, [0, 0, 0, 0, 1, 1, 1, 1]),
        ("dgx-a100", ["A100-SXM4-40GB"] * 8, [0, 0, 0, 0, 1, 1, 1, 1]),
        ("hgx-h200", ["H200-141GB"] * 8, [0, 0, 0, 0, 1, 1, 1, 1]),
        ("pcie-l40s-4", ["L40S"] * 4, [0, 0, 1, 1]),
        ("a100-pcie-nvlink-pairs", ["A100-SXM4-80GB"] * 4, [0, 0, 1, 1]),
        ("single-h200", ["H200-141GB"], [0]),
    ],
)
def test_preset_gpus(preset: str, models: list[str], numa: list[int]) -> None:
    spec = load_node(preset)
    assert spec.name == preset
    assert spec.origin == f"preset {preset}"
    assert [g.model.key for g in spec.gpus] == models
    assert [g.numa_node for g in spec.gpus] == numa
    assert [g.index for g in spec.gpus] == list(range(len(models)))
    assert len({g.uuid for g in spec.gpus}) == len({g.pci_bus_id for g in spec.gpus}) == len(models)
    assert (spec.driver_version, spec.cuda_version, spec.cuda_driver_version) == ("570.133.20", "12.8", 12080)


def test_dgx_h100_topology() -> None:
    spec = load_node("dgx-h100")
    assert spec.nvswitch
    assert [g.pci_bus_id for g in spec.gpus] == [
        "00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
        "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0",
    ]
    assert [spec.pcie_level(0, j) for j in range(1, 8)] == [
        "single", "node", "node", "system", "system", "system", "system",
    ]
    assert spec.pcie_level(7, 6) == "single"
    assert spec.pcie_level(5, 7) == "node"
    assert {spec.nvlink(i, j) for i in range(8) for j in range(8) if i != j} == {18}
    assert spec.nvlink_peers(0) == ()


def test_dgx_a100_pairs_cross_two_switch_levels() -> None:
    spec = load_node("dgx-a100")
    levels = [spec.pcie_level(0, 1), spec.pcie_level(1, 2), spec.pcie_level(3, 4)]
    assert levels == ["multiple", "node", "system"]
    assert spec.nvlink(0, 5) == 12
    assert spec.gpus[7].pci_bus_id == "00000000:BD:00.0"


def test_nvlink_bridged_pairs() -> None:
    spec = load_node("a100-pcie-nvlink-pairs")
    assert not spec.nvswitch
    assert (spec.nvlink(0, 1), spec.nvlink(1, 0), spec.nvlink(2, 3), spec.nvlink(1, 2)) == (12, 12, 12, 0)
    assert spec.nvlink_peers(0) == ((1, 12),)
    assert spec.nvlink_peers(3) == ((2, 12),)
    assert (spec.pcie_level(0, 1), spec.pcie_level(1, 2)) == ("node", "system")


def test_pcie_only_node() -> None:
    spec = load_node("pcie-l40s-4")
    levels = [spec.pcie_level(0, 1), spec.pcie_level(2, 3), spec.pcie_level(0, 2)]
    assert levels == ["single", "single", "system"]
    assert spec.nvlink(0, 1) == 0


def test_pair_queries_reject_bad_indices() -> None:
    spec = load_node("pcie-l40s-4")
    with pytest.raises(ValueError, match="GPU 1 paired with itself"):
        spec.pcie_level(1, 1)
    with pytest.raises(IndexError, match=r"GPU index 4 out of range 0\.\.3"):
        spec.nvlink(0, 4)


def test_defaults_are_stable_and_derived_from_the_node_name() -> None:
    text = "version: v1\ngpus: [{model: T4, numa_node: 0}, {model: T4, numa_node: null}]\n"
    first = parse_node(text, "/tmp/edge-7.yaml")
    second = parse_node(text, "/tmp/edge-7.yaml")
    assert first.name == "edge-7"
    assert [g.uuid for g in first.gpus] == [g.uuid for g in second.gpus] == [
        default_uuid("edge-7", 0), default_uuid("edge-7", 1),
    ]
    assert [g.serial for g in first.gpus] == [g.serial for g in second.gpus]
    assert all(len(g.serial) == 13 and g.serial.isdigit() for g in first.gpus)
    assert [g.pci_bus_id for g in first.gpus] == ["00000000:18:00.0", "00000000:2A:00.0"]
    assert first.pcie_level(0, 1) == "system"  # an unknown NUMA node is not assumed to be shared
    renamed = parse_node(text, "/tmp/edge-7.yaml", node_name="gpu-b")
    assert renamed.name == "gpu-b"
    assert renamed.gpus[0].uuid != first.gpus[0].uuid
    named = parse_node("version: v1\nname: rack3-n1\n" + text.split("\n", 1)[1], "x.yaml", node_name="gpu-b")
    assert named.name == "rack3-n1"


def test_default_bus_ids_move_to_the_next_domain_after_eight() -> None:
    assert [default_bus_id(i) for i in (0, 7, 8, 63)] == [
        "00000000:18:00.0", "00000000:DB:00.0", "00000001:18:00.0", "00000007:DB:00.0",
    ]
    spec = parse_node("version: v1\ngpus:\n" + "  - {model: L40S, numa_node: 0}\n" * 64, "big.yaml")
    assert len({g.pci_bus_id for g in spec.gpus}) == 64


def test_explicit_identities_are_kept_and_bus_ids_normalized() -> None:
    spec = parse_node(
        "version: v1\n"
        "driver: {version: '535.216.01', cuda: '12.2'}\n"
        "gpus:\n"
        "  - {model: T4, numa_node: 1, uuid: GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16,\n"
        "     pci_bus_id: '0000:3b:00.0'}\n",
        "t4.yaml",
    )
    gpu = spec.gpus[0]
    assert (gpu.uuid, gpu.pci_bus_id, gpu.numa_node) == (
        "GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16", "00000000:3B:00.0", 1,
    )
    assert (spec.driver_version, spec.driver_major, spec.cuda_driver_version) == ("535.216.01", 535, 12020)
    assert normalize_bus_id("00000000:3B:00.0") == normalize_bus_id("0000:3b:00.0") == "00000000:3B:00.0"
    assert normalize_bus_id("0000:3b:20.0") is None


def test_load_node_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "lab-node.yaml"
    path.write_text("version: v1\ngpus: [{model: H200-141GB, numa_node: 0}]\n")
    spec = load_node(str(path))
    assert (spec.name, spec.origin, spec.gpus[0].model.nvml_name) == ("lab-node", str(path), "NVIDIA H200")


def test_unknown_preset() -> None:
    with pytest.raises(NodeFileError) as caught:
        load_node("dgx-vr200")
    assert str(caught.value) == f"unknown node preset 'dgx-vr200' (known: {KNOWN_PRESETS})"


def test_missing_file() -> None:
    with pytest.raises(NodeFileError) as caught:
        load_node("nodes/missing.yaml")
    assert str(caught.value) == "nodes/missing.yaml: no such node file"


def test_unknown_key() -> None:
    assert _errors("version: v1\ngpus: [{model: T4, numa_node: 0, colour: red}]\nnvswitches: true\n") == [
        "node.yaml: gpus[0].colour: unknown key",
        "node.yaml: nvswitches: unknown key",
    ]


def test_unknown_model() -> None:
    assert _errors("version: v1\ngpus: [{model: T4, numa_node: 0}, {model: VR200, numa_node: 0}]\n") == [
        "node.yaml: gpus[1].model: unknown GPU model 'VR200' (known: A100-SXM4-40GB, A100-SXM4-80GB, "
        "H100-SXM5-80GB, H200-141GB, H100-NVL, H20, GH200-480GB, B200, GB200, B300-SXM6, GB300, RTX-PRO-6000-BSE, "
        "L40S, T4)",
    ]


def test_bad_pcie_level() -> None:
    text = "version: v1\ngpus: [{model: T4, numa_node: 0}, {model: T4, numa_node: 0}]\n"
    assert _errors(text + "links: [{gpus: [0, 1], pcie: pxb}]\n") == [
        "node.yaml: links[0].pcie: must be 'single', 'multiple', 'hostbridge', 'node' or 'system', got 'pxb'",
    ]


def test_pair_out_of_range() -> None:
    text = "version: v1\ngpus: [{model: T4, numa_node: 0}, {model: T4, numa_node: 0}]\n"
    assert _errors(text + "links: [{gpus: [1, 2], pcie: single}, {gpus: [-1, 0], pcie: node}]\n") == [
        "node.yaml: links[0].gpus: GPU index 2 is out of range (the node has GPUs 0..1)",
        "node.yaml: links[1].gpus: GPU index -1 is out of range (the node has GPUs 0..1)",
    ]


TWO_A100 = "version: v1\ngpus:\n" + "  - {model: A100-SXM4-40GB, numa_node: 0}\n" * 2


def test_link_shape_errors() -> None:
    text = TWO_A100
    assert _errors(
        text + "links:\n"
        "  - {gpus: [1, 1], nvlink: 4}\n"
        "  - {gpus: [0, 1]}\n"
        "  - {gpus: [0, 1], nvlink: 2, pcie: node}\n"
        "  - {gpus: [0], pcie: node}\n"
        "  - {gpus: [0, 1], nvlink: 0}\n"
    ) == [
        "node.yaml: links[0].gpus: a GPU cannot link to itself, got [1, 1]",
        "node.yaml: links[1]: must set exactly one of 'nvlink' or 'pcie'",
        "node.yaml: links[2]: must set exactly one of 'nvlink' or 'pcie'",
        "node.yaml: links[3].gpus: must name exactly two GPU indices, got 1",
        "node.yaml: links[4].nvlink: must be >= 1, got 0",
    ]


def test_pair_listed_twice_for_one_kind() -> None:
    text = TWO_A100
    assert _errors(
        text + "links:\n"
        "  - {gpus: [0, 1], pcie: single}\n"
        "  - {gpus: [0, 1], nvlink: 4}\n"
        "  - {gpus: [1, 0], pcie: node}\n"
    ) == ["node.yaml: links[2]: pair [0, 1] already has a pcie entry at links[0]"]


def test_duplicate_uuid_and_bus_id() -> None:
    gpu_uuid = "GPU-00000000-0000-0000-0000-000000000001"
    assert _errors(
        "version: v1\ngpus:\n"
        f"  - {{model: L40S, numa_node: 0, uuid: {gpu_uuid}}}\n"
        f"  - {{model: L40S, numa_node: 0, uuid: {gpu_uuid}, pci_bus_id: '0000:18:00.0'}}\n"
    ) == [
        f"node.yaml: gpus[1].uuid: {gpu_uuid} is already used by gpus[0]",
        "node.yaml: gpus[1].pci_bus_id: 00000000:18:00.0 is already used by gpus[0]",
    ]


def test_identity_format_errors() -> None:
    assert _errors(
        "version: v1\ngpus:\n"
        "  - {model: T4, numa_node: -1, uuid: GPU-XYZ, pci_bus_id: '18:00.0'}\n"
        "  - {model: T4, numa_node: 0, pci_bus_id: 0000:18:00.0}\n"
    ) == [
        "node.yaml: gpus[0].numa_node: must be >= 0, got -1",
        "node.yaml: gpus[0].uuid: must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx in lowercase hex, "
        "got 'GPU-XYZ'",
        "node.yaml: gpus[0].pci_bus_id: must look like 00000000:18:00.0, got '18:00.0'",
        # YAML 1.1 reads an unquoted 0000:18:00.0 as a base-60 number.
        "node.yaml: gpus[1].pci_bus_id: must be a string, got 1080.0 (quote it)",
    ]


def test_top_level_errors() -> None:
    assert _errors("gpus: []\n") == [
        "node.yaml: version: required key is missing",
        "node.yaml: gpus: must have at least 1 entry, got 0",
    ]
    assert _errors("version: v2\ngpus: [{model: T4}]\n") == [
        "node.yaml: version: must be 'v1', got 'v2'",
        "node.yaml: gpus[0].numa_node: required key is missing",
    ]
    assert _errors("version: v1\ndriver: {cuda: 12.8}\ngpus: [{model: T4, numa_node: 0}]\n") == [
        "node.yaml: driver.cuda: must be a string, got 12.8 (quote it)",
    ]
    assert _errors("- just a list\n") == ["node.yaml: must be a mapping with 'version: v1', got list"]
    assert _errors("version: v1\nversion: v1\n") == [
        "node.yaml: invalid YAML: duplicate key 'version' (line 2, column 1)",
    ]
    many = "version: v1\ngpus:\n" + "  - {model: T4, numa_node: 0}\n" * 65
    assert _errors(many) == ["node.yaml: gpus: must have at most 64 entries, got 65"]


def test_nvlink_consistency_errors() -> None:
    assert _errors(
        "version: v1\nnvswitch: true\ngpus:\n"
        "  - {model: A100-SXM4-40GB, numa_node: 0}\n"
        "  - {model: L40S, numa_node: 0}\n"
        "links: [{gpus: [0, 1], nvlink: 2}]\n"
    ) == [
        "node.yaml: links[0].nvlink: not allowed with nvswitch: true (NVSwitch joins every pair)",
        "node.yaml: links[0].nvlink: GPU 1 (L40S) has no NVLink",
        "node.yaml: nvswitch: GPU 1 (L40S) has no NVLink",
    ]
    assert _errors(
        "version: v1\ngpus:\n"
        + "  - {model: A100-SXM4-40GB, numa_node: 0}\n" * 3
        + "links: [{gpus: [0, 1], nvlink: 8}, {gpus: [0, 2], nvlink: 8}]\n"
    ) == ["node.yaml: links: GPU 0 has 16 NVLink links listed, but A100-SXM4-40GB has only 12"]


def test_socket_local_pcie_level_across_numa_nodes() -> None:
    assert _errors(
        "version: v1\ngpus: [{model: T4, numa_node: 0}, {model: T4, numa_node: 1}]\n"
        "links: [{gpus: [0, 1], pcie: single}]\n"
    ) == ["node.yaml: links[0].pcie: 'single' needs both GPUs on one NUMA node; GPU 0 is on 0, GPU 1 on 1"]
