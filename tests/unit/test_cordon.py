"""Per-GPU cordon (agent/cordon.py): the operator's mark read as NVML indices and GPU UUIDs, refused whole in one
line when any item is wrong; what each output makes of a cordoned GPU (the device plugin's list, the slice, the free
GPUs, the Node's annotation); the set kept for the next start."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agent.cordon import CordonError, cordon_report, load_cordoned, parse_cordon, save_cordoned
from agent.dra.slices import published_gpus, published_migs
from agent.inventory import plan
from agent.kube.reconciler import TaintPolicy, label_diff, node_intent, owned_annotation
from agent.state import DeviceHealth, NodeState
from agent.topology.fragmentation import fragmentation
from agent.topology.prefer import topology_of
from tests.builders import MIXED_GPU0, node

H100 = node("dgx-h100")
UUID = [g.uuid for g in H100.inventory.gpus]
TAINT = TaintPolicy("gpu-node-agent.io/gpu-fault", "NoSchedule")


def cordoned(state: NodeState, *indices: int) -> NodeState:
    return dataclasses.replace(state, cordoned=frozenset(state.inventory.gpus[i].uuid for i in indices))


def test_the_mark_names_gpus_by_nvml_index_or_uuid_separated_by_commas_or_spaces() -> None:
    inventory = H100.inventory
    assert parse_cordon("3", inventory) == {UUID[3]}
    assert parse_cordon(f"3,{UUID[5]}", inventory) == {UUID[3], UUID[5]}
    assert parse_cordon(f" 0 , 7  {UUID[7]}\n", inventory) == {UUID[0], UUID[7]}
    assert parse_cordon("", inventory) == frozenset()
    assert parse_cordon(" , ", inventory) == frozenset()


@pytest.mark.parametrize(("value", "why"), [
    ("8", "'8' is no GPU's NVML index here (0 to 7)"),
    ("3,12", "'12' is no GPU's NVML index here (0 to 7)"),
    ("GPU-00000000-0000-0000-0000-000000000000", "'GPU-00000000-0000-0000-0000-000000000000' is no GPU of this node"),
    ("gpu3", "'gpu3' is neither an NVML index nor a GPU UUID"),
    ("-1", "'-1' is neither an NVML index nor a GPU UUID"),
    ("3;4", "'3;4' is neither an NVML index nor a GPU UUID"),
    ("²", "'²' is neither an NVML index nor a GPU UUID"),
    ("9 x 10 y", "'9' is no GPU's NVML index here (0 to 7); 'x' is neither an NVML index nor a GPU UUID; "
                 "'10' is no GPU's NVML index here (0 to 7)"),
])
def test_a_mark_with_anything_wrong_is_refused_whole_naming_what_is_wrong(value: str, why: str) -> None:
    with pytest.raises(CordonError) as refused:
        parse_cordon(value, H100.inventory)
    assert str(refused.value) == why


def test_a_mig_device_is_refused_with_the_advice_to_cordon_its_gpu() -> None:
    state = node("dgx-h100", mig={0: MIXED_GPU0})
    mig = state.inventory.mig_devices[0].uuid
    with pytest.raises(CordonError) as refused:
        parse_cordon(mig, state.inventory)
    assert str(refused.value) == f"{mig!r} is a MIG device: cordon its GPU"


def test_a_mark_too_long_is_refused_by_its_length_without_reading_it() -> None:
    with pytest.raises(CordonError) as refused:
        parse_cordon("0," * 5000, H100.inventory)
    assert str(refused.value) == "is 10000 characters long, at most 8192"


def test_the_device_plugin_lists_a_cordoned_gpu_unhealthy_and_its_mig_devices_and_replicas_too() -> None:
    state = cordoned(H100, 3)
    devices = plan(state).resources["nvidia.com/gpu"].devices
    assert [d.healthy for d in devices] == [True, True, True, False, True, True, True, True]
    assert devices[3].reason == "cordoned (the Node's gpu-node-agent.io/cordon annotation)"

    mig = cordoned(node("dgx-h100", "version: v1\nflags: {migStrategy: mixed}\n", mig={0: MIXED_GPU0}), 0)
    resources = plan(mig).resources
    assert {name: [d.healthy for d in r.devices] for name, r in resources.items()} == {
        "nvidia.com/gpu": [True] * 7,
        "nvidia.com/mig-3g.40gb": [False],
        "nvidia.com/mig-2g.20gb": [False],
        "nvidia.com/mig-1g.10gb": [False],
    }

    shared = cordoned(node("dgx-h100", "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                                       "    - {name: nvidia.com/gpu, replicas: 2}\n"), 1)
    replicas = plan(shared).resources["nvidia.com/gpu"].devices
    assert [d.id for d in replicas if not d.healthy] == [f"{UUID[1]}::0", f"{UUID[1]}::1"]


def test_a_gpu_that_is_faulty_and_cordoned_says_its_fault() -> None:
    state = dataclasses.replace(cordoned(H100, 3), health={UUID[3]: DeviceHealth(False, "XID 79")})
    assert plan(state).resources["nvidia.com/gpu"].devices[3].reason == "XID 79"


def test_the_slice_leaves_a_cordoned_gpu_and_its_mig_devices_out_also_where_unhealthy_ones_are_tainted() -> None:
    state = cordoned(H100, 2, 6)
    for taints in (False, True):
        assert [g.index for g in published_gpus(state, taints)] == [0, 1, 3, 4, 5, 7]
    mig = cordoned(node("dgx-h100", mig={0: MIXED_GPU0}), 0)
    assert published_migs(mig) == []
    assert [m.uuid for _, m in published_migs(node("dgx-h100", mig={0: MIXED_GPU0}))] == [
        m.uuid for m in mig.inventory.mig_devices]


def test_a_cordoned_gpu_is_not_free_and_breaks_the_free_nvlink_set() -> None:
    state = cordoned(H100, 3)
    figures = fragmentation(state, frozenset(), topology_of(state.inventory))
    assert figures.free == (0, 1, 2, 4, 5, 6, 7)
    assert figures.largest_numa_set == 4  # NUMA node 0 keeps 0, 1, 2; node 1 has 4, 5, 6, 7
    assert figures.largest_nvlink_set == 7  # NVSwitch: every pair joined


def test_the_node_shows_each_cordoned_gpu_and_who_holds_it_and_nothing_once_none_is() -> None:
    state = dataclasses.replace(cordoned(H100, 5, 1), cordon_holders={UUID[1]: ("ml/train-0", "ml/train-1"),
                                                                      UUID[5]: ()})
    intent = node_intent(state, {}, TAINT)
    assert intent.annotations == {"gpu-node-agent.io/cordon.state":
                                  f"GPU 1 ({UUID[1]}): held by ml/train-0, ml/train-1; GPU 5 ({UUID[5]}): free"}
    assert cordon_report(cordoned(H100, 2)) == f"GPU 2 ({UUID[2]}): holders not known"
    assert node_intent(H100, {}, TAINT).annotations == {}
    # Uncordoned: the agent removes its answer and never the operator's mark.
    current = {"gpu-node-agent.io/cordon": "1,5", "gpu-node-agent.io/cordon.state": "GPU 1 ...", "team": "ml"}
    assert label_diff(current, {}, owned_annotation) == {"gpu-node-agent.io/cordon.state": None}


def test_the_set_in_force_is_kept_for_the_next_start_and_a_gpu_the_node_lost_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "cordon.json"
    save_cordoned(path, {UUID[4], UUID[2], "GPU-gone"})
    assert json.loads(path.read_text()) == {"format": 1, "cordoned": sorted([UUID[2], UUID[4], "GPU-gone"])}
    assert load_cordoned(path, H100.inventory) == {UUID[2], UUID[4]}
    assert load_cordoned(tmp_path / "missing.json", H100.inventory) == frozenset()


def test_a_damaged_file_is_one_warning_and_cordons_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cordon.json"
    path.write_text('{"format": 2, "cordoned": []}')
    assert load_cordoned(path, H100.inventory) == frozenset()
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == [
        f"cordoned GPUs from {path} not used (the Node's gpu-node-agent.io/cordon annotation decides once read)"]
