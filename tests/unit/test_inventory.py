"""What each resource advertises (agent/inventory.py's plan) under every MIG strategy, time-slicing, MPS and
resource-name config, on the fake NVML: the devices, their health, the sharing selectors read as NVIDIA's plugin
reads them, the problems and warnings named, and the labels the plan feeds."""

from __future__ import annotations

import pytest

from agent.config import parse_config
from agent.inventory import mig_resource, mps_shared_gpus, plan, sanitise, sharing_conflicts
from agent.labels import node_labels
from agent.state import DeviceHealth, NodeState
from tests.builders import MIXED_GPU0, counts, node

ALL_1G = [("1g.10gb", i) for i in range(7)]
MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"
SINGLE = "version: v1\nflags:\n  migStrategy: single\n"
TWO_1G = {0: [("1g.10gb", 0), ("1g.10gb", 1)]}


# --- whole GPUs and time-sliced replicas


def test_whole_gpus_by_default() -> None:
    state = node()
    (gpu,) = plan(state).resources.values()
    assert [d.id for d in gpu.devices] == [g.uuid for g in state.inventory.gpus]
    assert [d.numa for d in gpu.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_four_replicas_per_gpu() -> None:
    state = node(config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - {name: nvidia.com/gpu, replicas: 4}\n")
    resource = plan(state).resources["nvidia.com/gpu"]
    first = state.inventory.gpus[0].uuid
    assert len(resource.devices) == 32
    assert [d.id for d in resource.devices[:4]] == [f"{first}::{n}" for n in range(4)]
    assert {d.visible for d in resource.devices[:4]} == {first}
    assert all(d.shared for d in resource.devices)
    assert resource.fail_requests_greater_than_one is False


def test_rename_by_default_advertises_gpu_shared() -> None:
    state = node(config="version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
                        "    failRequestsGreaterThanOne: true\n    resources:\n"
                        "    - {name: nvidia.com/gpu, replicas: 4}\n")
    assert counts(state) == {"nvidia.com/gpu.shared": 32}
    assert plan(state).resources["nvidia.com/gpu.shared"].fail_requests_greater_than_one is True


def test_replicas_carry_their_gpus_numa_node_index_and_health() -> None:
    state = node(config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - {name: nvidia.com/gpu, replicas: 2}\n")
    gpu3 = state.inventory.gpus[3].uuid
    devices = plan(state.evolve(health={gpu3: DeviceHealth(False, "XID 79")})).resources["nvidia.com/gpu"].devices
    assert [d.numa for d in devices] == [0] * 8 + [1] * 8
    assert [d.index for d in devices[6:8]] == ["3", "3"]
    assert [(d.healthy, d.reason) for d in devices[5:9]] == [(True, ""), (False, "XID 79"), (False, "XID 79"),
                                                             (True, "")]


def test_only_shared_resources_report_a_sharing_strategy() -> None:
    state = node(config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - {name: nvidia.com/gpu, replicas: 2, rename: example.com/slice, devices: [0]}\n")
    resources = plan(state).resources
    assert {name: r.sharing for name, r in resources.items()} == {"example.com/slice": "time-slicing",
                                                                  "nvidia.com/gpu": "none"}


# --- sharing selectors: which devices an entry shares, conflicts and warnings


def test_per_gpu_selectors_give_two_replica_counts_on_one_node() -> None:
    state = node(config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - {name: nvidia.com/gpu, replicas: 2, devices: [0, 1, 2, 3]}\n"
                        "    - {name: nvidia.com/gpu, replicas: 4, devices: [4, 5, 6, 7]}\n")
    devices = plan(state).resources["nvidia.com/gpu"].devices
    per_gpu = [sum(d.gpu_index == i for d in devices) for i in range(8)]
    assert per_gpu == [2, 2, 2, 2, 4, 4, 4, 4]


def test_selectors_by_uuid_and_model_and_rename() -> None:
    probe = node("pcie-l40s-4")
    uuid = probe.inventory.gpus[2].uuid
    state = node("pcie-l40s-4", config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                 f"    - {{name: nvidia.com/gpu, replicas: 3, rename: example.com/l40s-slice, devices: [{uuid}]}}\n")
    assert counts(state) == {"example.com/l40s-slice": 3, "nvidia.com/gpu": 3}
    by_model = node("pcie-l40s-4", config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                    "    - {name: nvidia.com/gpu, replicas: 2, devices: [NVIDIA-L40S]}\n")
    assert counts(by_model) == {"nvidia.com/gpu": 8}


def test_a_model_selector_matches_the_name_as_nvidia_smi_writes_it() -> None:
    config = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
              "    - {name: nvidia.com/gpu, replicas: 2, devices: [NVIDIA L40S]}\n")
    assert len(plan(node("pcie-l40s-4", config=config)).resources["nvidia.com/gpu"].devices) == 8


def test_a_gpu_selected_twice_is_a_conflict() -> None:
    state = node("pcie-l40s-4")
    config = parse_config("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                          "    - {name: nvidia.com/gpu, replicas: 2, devices: [0, 1]}\n"
                          "    - {name: nvidia.com/gpu, replicas: 4, devices: [1]}\n")
    uuid = state.inventory.gpus[1].uuid
    assert sharing_conflicts(state, config) == [
        f"GPU 1 ({uuid}) is selected for nvidia.com/gpu by sharing.timeSlicing.resources[0], "
        "sharing.timeSlicing.resources[1]"
    ]


def test_a_mig_device_shared_by_two_entries_is_named_by_its_index() -> None:
    config = parse_config(MIXED + "sharing:\n  timeSlicing:\n    resources:\n"
                          "    - {name: nvidia.com/mig-1g.10gb, replicas: 2, devices: ['0:1']}\n"
                          "    - {name: nvidia.com/mig-1g.10gb, replicas: 3, devices: all}\n")
    state = node(config=MIXED, mig=TWO_1G)
    assert sharing_conflicts(state, config) == [
        "MIG device 0:1 is selected for nvidia.com/mig-1g.10gb by sharing.timeSlicing.resources[0], "
        "sharing.timeSlicing.resources[1]"
    ]


def test_a_mig_uuid_selects_that_mig_device_only() -> None:
    probe = node(config=MIXED, mig=TWO_1G)
    first = probe.inventory.mig_devices[0].uuid
    config = (MIXED + "sharing:\n  timeSlicing:\n    resources:\n"
              f"    - {{name: nvidia.com/mig-1g.10gb, replicas: 3, devices: [{first}]}}\n")
    devices = plan(node(config=config, mig=TWO_1G)).resources["nvidia.com/mig-1g.10gb"].devices
    assert [d.id for d in devices] == [f"{first}::0", f"{first}::1", f"{first}::2",
                                       probe.inventory.mig_devices[1].uuid]


def shared(devices: str, name: str = "nvidia.com/gpu", strategy: str = "none", extra: str = "") -> NodeState:
    return node(config=f"version: v1\nflags:\n  migStrategy: {strategy}\n{extra}sharing:\n  timeSlicing:\n"
                       f"    resources:\n    - {{name: {name}, replicas: 2, devices: {devices}}}\n",
                mig={0: MIXED_GPU0} if strategy == "mixed" else None)


def test_selectors_read_as_nvidias_plugin_reads_them() -> None:
    # An index as a string is a GPU index, as upstream reads devices: ["0"].
    assert sum(d.shared for d in plan(shared('["0", 3]')).resources["nvidia.com/gpu"].devices) == 4
    # A count shares the first N devices.
    by_count = plan(shared("3")).resources["nvidia.com/gpu"].devices
    assert [d.gpu_index for d in by_count if d.shared] == [0, 0, 1, 1, 2, 2]
    # A MIG index "<gpu>:<mig>" and a MIG UUID select MIG devices of a mixed node.
    state = shared('["0:1"]', name="nvidia.com/mig-2g.20gb", strategy="mixed")
    assert len(plan(state).resources["nvidia.com/mig-2g.20gb"].devices) == 2
    mig_uuid = state.inventory.mig_devices[0].uuid
    by_uuid = shared(f"[{mig_uuid}]", name="nvidia.com/mig-3g.40gb", strategy="mixed")
    assert len(plan(by_uuid).resources["nvidia.com/mig-3g.40gb"].devices) == 2
    assert plan(by_uuid).warnings == ()


def test_a_selector_that_matches_nothing_is_a_warning_naming_it() -> None:
    assert plan(shared('[0, "7", 9, "GPU-00000000-0000-0000-0000-000000000000"]')).warnings == (
        "sharing.timeSlicing.resources[0].devices[2]: 9 selects no device of nvidia.com/gpu on this node",
        "sharing.timeSlicing.resources[0].devices[3]: 'GPU-00000000-0000-0000-0000-000000000000' selects no device "
        "of nvidia.com/gpu on this node",
    )
    assert plan(shared("12")).warnings == (
        "sharing.timeSlicing.resources[0].devices: asks for the first 12 devices of nvidia.com/gpu, the node has 8; "
        "all 8 are shared",)
    assert plan(shared("all", name="nvidia.com/mig-1g.10gb")).warnings == (
        "sharing.timeSlicing.resources[0]: nvidia.com/mig-1g.10gb has no devices on this node; nothing is shared",)


def test_asking_for_exactly_as_many_devices_as_there_are_is_no_warning() -> None:
    config = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
              "    - {name: nvidia.com/gpu, replicas: 2, devices: 8}\n")
    assert plan(node(config=config)).warnings == ()


def test_mps_warnings_name_the_mps_section() -> None:
    config = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, devices: [9]}\n"
    assert plan(node(config=config)).warnings == (
        "sharing.mps.resources[0].devices[0]: 9 selects no device of nvidia.com/gpu on this node",)


# --- MIG strategies


def test_mixed_strategy_counts_per_profile() -> None:
    state = node(config="version: v1\nflags:\n  migStrategy: mixed\n", mig={0: MIXED_GPU0, 1: ALL_1G})
    assert counts(state) == {
        "nvidia.com/gpu": 6,
        "nvidia.com/mig-1g.10gb": 8,
        "nvidia.com/mig-2g.20gb": 1,
        "nvidia.com/mig-3g.40gb": 1,
    }
    mig = {m.profile: m for m in state.inventory.mig_devices if m.parent_index == 0}
    (device,) = plan(state).resources["nvidia.com/mig-3g.40gb"].devices
    assert (device.id, device.visible, device.kind, device.gpu_index, device.numa) == (
        mig["3g.40gb"].uuid, mig["3g.40gb"].uuid, "mig", 0, 0
    )


def test_mixed_strategy_with_replicas_of_a_mig_profile() -> None:
    state = node(config="version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - {name: nvidia.com/mig-1g.10gb, replicas: 2}\n", mig={1: ALL_1G})
    assert counts(state) == {"nvidia.com/gpu": 7, "nvidia.com/mig-1g.10gb": 14}


def test_mig_profiles_with_a_plus_name_their_resource_with_a_dot() -> None:
    assert mig_resource("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    assert mig_resource("1g.20gb") == "nvidia.com/mig-1g.20gb"


def test_profiles_with_a_suffix_are_resources_of_their_own() -> None:
    """As NVIDIA's device plugin v0.20 (mixed strategy): 1g.24gb, 1g.24gb-me, 1g.24gb+gfx and 1g.24gb+me.all on
    RTX PRO 6000 Blackwell are four resources, not one ('+' written '.')."""
    state = node("pcie-rtx-pro-6000-8", config=MIXED, mig={
        0: [("1g.24gb", 0), ("1g.24gb", 3)],
        1: [("1g.24gb-me", 0), ("1g.24gb-me", 3)],
        2: [("1g.24gb+gfx", 0)],
        3: [("1g.24gb+me.all", 0), ("1g.24gb-me", 3)],  # all media engines on one, none on the other
    })
    assert {name: n for name, n in counts(state).items() if name.startswith("nvidia.com/mig-")} == {
        "nvidia.com/mig-1g.24gb": 2, "nvidia.com/mig-1g.24gb-me": 3, "nvidia.com/mig-1g.24gb.gfx": 1,
        "nvidia.com/mig-1g.24gb.me.all": 1}


def test_single_strategy_uniform_node() -> None:
    state = node("pcie-l40s-4", config="version: v1\nflags:\n  migStrategy: single\n")
    assert counts(state) == {"nvidia.com/gpu": 4}  # no MIG anywhere: whole GPUs
    uniform = node("a100-pcie-nvlink-pairs", config="version: v1\nflags:\n  migStrategy: single\n",
                   mig={i: [("1g.10gb", s) for s in range(7)] for i in range(4)})
    assert counts(uniform) == {"nvidia.com/gpu": 28}
    assert plan(uniform).problems == ()


def test_single_strategy_refuses_a_non_uniform_node_naming_the_gpus() -> None:
    state = node(config="version: v1\nflags:\n  migStrategy: single\n", mig={0: MIXED_GPU0, 1: ALL_1G})
    result = plan(state)
    assert {n: len(r.devices) for n, r in result.resources.items()} == {"nvidia.com/gpu": 7}
    assert {d.gpu_index for d in result.resources["nvidia.com/gpu"].devices} == {1}
    assert result.problems == (
        "migStrategy single needs every GPU MIG-enabled with devices of one profile (1g.10gb); not advertised: "
        "GPU 0 (1g.10gb, 2g.20gb, 3g.40gb); GPU 2 (MIG disabled); GPU 3 (MIG disabled); GPU 4 (MIG disabled); "
        "GPU 5 (MIG disabled); GPU 6 (MIG disabled); GPU 7 (MIG disabled)",
    )


def test_single_strategy_takes_the_most_common_profile() -> None:
    state = node(config=SINGLE, mig={0: [("3g.40gb", 0), ("3g.40gb", 4)], 1: [("3g.40gb", 0), ("3g.40gb", 4)],
                                     2: [("1g.10gb", 0)]})
    result = plan(state)
    assert len(result.resources["nvidia.com/gpu"].devices) == 4
    assert result.problems[0].startswith("migStrategy single needs every GPU MIG-enabled with devices of one "
                                         "profile (3g.40gb); not advertised: GPU 2 (1g.10gb); GPU 3 (MIG disabled)")


def test_single_strategy_with_mig_enabled_but_no_devices() -> None:
    result = plan(node(config=SINGLE, mig={0: []}))
    assert result.problems[0].startswith("migStrategy single needs every GPU MIG-enabled with devices of one "
                                         "profile (None); not advertised: GPU 0 (no MIG devices); GPU 1 (MIG disabled)")


@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_index_strategy_for_every_mig_strategy(strategy: str) -> None:
    state = node(config=f"version: v1\nflags:\n  migStrategy: {strategy}\n  plugin:\n    deviceIDStrategy: index\n",
                 mig={1: ALL_1G} if strategy != "none" else None)
    visible = sorted({d.visible for r in plan(state).resources.values() for d in r.devices})
    expected = {
        "none": [str(i) for i in range(8)],
        "single": [f"1:{s}" for s in range(7)],
        "mixed": sorted([str(i) for i in range(8) if i != 1] + [f"1:{s}" for s in range(7)]),
    }[strategy]
    assert visible == expected


# --- resource names from resources.gpus and resources.mig


def test_resources_rename_gpus_and_mig_devices_by_pattern() -> None:
    state = node(config="version: v1\nflags:\n  migStrategy: mixed\nresources:\n  gpus:\n"
                        "  - {pattern: '*H100*', name: h100}\n  mig:\n  - {pattern: '1g.*', name: mig-small}\n"
                        "  - {pattern: '*', name: nvidia.com/mig-large}\n", mig={0: MIXED_GPU0})
    assert counts(state) == {"nvidia.com/h100": 7, "nvidia.com/mig-small": 1, "nvidia.com/mig-large": 2}
    unmatched = node(config="version: v1\nresources:\n  gpus:\n  - {pattern: 'NVIDIA A100*', name: a100}\n")
    result = plan(unmatched)
    assert (result.resources, result.problems[0]) == (
        {}, "GPU 0 (NVIDIA H100 80GB HBM3) matches no pattern of resources.gpus; not advertised")


def test_mig_devices_that_match_no_resource_pattern_are_each_named() -> None:
    config = MIXED + "resources:\n  mig:\n  - {pattern: '3g.*', name: mig-big}\n"
    state = node(config=config, mig=TWO_1G)
    result = plan(state)
    assert "nvidia.com/mig-big" not in result.resources
    assert [p for p in result.problems if "resources.mig" in p] == [
        "MIG device 0:0 (1g.10gb) matches no pattern of resources.mig; not advertised",
        "MIG device 0:1 (1g.10gb) matches no pattern of resources.mig; not advertised",
    ]


def test_a_resource_that_would_hold_two_kinds_of_device_is_withheld_naming_both() -> None:
    # Replicas of the 1g.10gb MIG device renamed into the 2g.20gb resource, beside GPU 0's own 2g.20gb device.
    state = node(config="version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - {name: mig-1g.10gb, replicas: 2, rename: mig-2g.20gb}\n", mig={0: MIXED_GPU0})
    assert counts(state) == {"nvidia.com/gpu": 7, "nvidia.com/mig-3g.40gb": 1}
    assert plan(state).problems == (
        "nvidia.com/mig-2g.20gb would hold MIG devices and replicas of nvidia.com/mig-1g.10gb; a resource holds one "
        "kind of device, so it is not advertised",)
    # renameByDefault's <name>.shared taken by a resources.mig name.
    state = node(config="version: v1\nflags:\n  migStrategy: mixed\nresources:\n  mig:\n"
                        "  - {pattern: '1g.*', name: gpu.shared}\n  - {pattern: '*', name: mig-other}\n"
                        "sharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                        "    - {name: gpu, replicas: 2, devices: [1]}\n", mig={0: MIXED_GPU0})
    assert counts(state) == {"nvidia.com/gpu": 6, "nvidia.com/mig-other": 2}
    assert plan(state).problems == (
        "nvidia.com/gpu.shared would hold MIG devices and replicas of nvidia.com/gpu; a resource holds one kind of "
        "device, so it is not advertised",)


# --- health, draining and MPS control daemons


def test_replicas_and_mig_devices_inherit_their_gpus_health() -> None:
    base = node(config="version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                       "    - {name: nvidia.com/gpu, replicas: 2}\n", mig={0: MIXED_GPU0})
    sick = {base.inventory.gpus[0].uuid: DeviceHealth(False, "XID 48"),
            base.inventory.gpus[3].uuid: DeviceHealth(False, "XID 62")}
    state = base.evolve(health=sick)
    result = plan(state).resources
    assert [d.healthy for d in result["nvidia.com/mig-3g.40gb"].devices] == [False]
    assert [d.gpu_index for d in result["nvidia.com/gpu"].devices if not d.healthy] == [3, 3]


def test_devices_carry_the_reason_their_gpu_is_unhealthy() -> None:
    state = node(config=MIXED, mig=TWO_1G)
    gpu0 = state.inventory.gpus[0].uuid
    state = state.evolve(health={gpu0: DeviceHealth(False, "XID 48")})
    resources = plan(state).resources
    assert [(d.healthy, d.reason) for d in resources["nvidia.com/mig-1g.10gb"].devices] == [(False, "XID 48")] * 2
    assert [(d.healthy, d.reason) for d in resources["nvidia.com/gpu"].devices[:1]] == [(True, "")]
    whole = node().evolve(health={gpu0: DeviceHealth(False, "XID 79")})
    assert [(d.healthy, d.reason) for d in plan(whole).resources["nvidia.com/gpu"].devices[:2]] == [
        (False, "XID 79"), (True, "")]


def test_draining_gpus_are_withdrawn() -> None:
    base = node("pcie-l40s-4")
    state = base.evolve(draining=frozenset({base.inventory.gpus[1].uuid}))
    assert [d.gpu_index for d in plan(state).resources["nvidia.com/gpu"].devices] == [0, 2, 3]


def test_mps_replicas_wait_for_their_gpus_control_daemon() -> None:
    """Replicas only for a GPU whose daemon is up; a daemon that failed is reported, one still starting is not
    (every start of an MPS node would otherwise record a warning)."""
    state = node("pcie-l40s-4", config="version: v1\nsharing:\n  mps:\n    resources:\n"
                                        "    - {name: nvidia.com/gpu, replicas: 2}\n")
    uuids = [g.uuid for g in state.inventory.gpus]
    state = state.evolve(mps={uuids[0]: "", uuids[1]: "control daemon exited"})
    result = plan(state)
    assert [d.id for d in result.resources["nvidia.com/gpu"].devices] == [f"{uuids[0]}::0", f"{uuids[0]}::1"]
    assert result.problems == ("MPS replicas withheld until the GPU's MPS control daemon is up: "
                               "GPU 1 (control daemon exited)",)


def test_the_gpus_mps_shares_with_their_replica_counts() -> None:
    state = node("pcie-l40s-4", config="version: v1\nsharing:\n  mps:\n    resources:\n"
                                        "    - {name: nvidia.com/gpu, replicas: 3, devices: [0, 2]}\n")
    gpus = state.inventory.gpus
    assert mps_shared_gpus(state) == [(gpus[0], 3), (gpus[2], 3)]
    time_sliced = node("pcie-l40s-4", config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                                              "    - {name: nvidia.com/gpu, replicas: 3}\n")
    assert mps_shared_gpus(time_sliced) == []


# --- labels and config keys the plan feeds


def test_sharing_labels_follow_gpu_feature_discovery() -> None:
    shared = node(config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                         "    - {name: nvidia.com/gpu, replicas: 4}\n")
    labels = node_labels(shared, shared.config)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.replicas"],
            labels["nvidia.com/gpu.sharing-strategy"]) == ("NVIDIA-H100-80GB-HBM3-SHARED", "4", "time-slicing")
    renamed = node(config="version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                          "    - {name: nvidia.com/gpu, replicas: 4}\n")
    assert node_labels(renamed, renamed.config)["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_mig_labels_for_mixed_and_single() -> None:
    mixed = node(config="version: v1\nflags:\n  migStrategy: mixed\n", mig={0: MIXED_GPU0, 1: ALL_1G})
    labels = node_labels(mixed, mixed.config)
    assert {k: v for k, v in labels.items() if k.startswith(("nvidia.com/mig-", "nvidia.com/mig."))} == {
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig-1g.10gb.count": "8",
        "nvidia.com/mig-1g.10gb.memory": "9984",
        "nvidia.com/mig-1g.10gb.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
        "nvidia.com/mig-1g.10gb.replicas": "1",
        "nvidia.com/mig-1g.10gb.engines.copy": "1",
        "nvidia.com/mig-1g.10gb.engines.decoder": "1",
        "nvidia.com/mig-1g.10gb.engines.encoder": "0",
        "nvidia.com/mig-1g.10gb.engines.jpeg": "1",
        "nvidia.com/mig-1g.10gb.engines.ofa": "0",
        "nvidia.com/mig-1g.10gb.multiprocessors": "16",
        "nvidia.com/mig-1g.10gb.sharing-strategy": "none",
        "nvidia.com/mig-1g.10gb.slices.ci": "1",
        "nvidia.com/mig-1g.10gb.slices.gi": "1",
        "nvidia.com/mig-2g.20gb.count": "1",
        "nvidia.com/mig-2g.20gb.memory": "20096",
        "nvidia.com/mig-2g.20gb.product": "NVIDIA-H100-80GB-HBM3-MIG-2g.20gb",
        "nvidia.com/mig-2g.20gb.replicas": "1",
        "nvidia.com/mig-2g.20gb.engines.copy": "2",
        "nvidia.com/mig-2g.20gb.engines.decoder": "2",
        "nvidia.com/mig-2g.20gb.engines.encoder": "0",
        "nvidia.com/mig-2g.20gb.engines.jpeg": "2",
        "nvidia.com/mig-2g.20gb.engines.ofa": "0",
        "nvidia.com/mig-2g.20gb.multiprocessors": "32",
        "nvidia.com/mig-2g.20gb.sharing-strategy": "none",
        "nvidia.com/mig-2g.20gb.slices.ci": "2",
        "nvidia.com/mig-2g.20gb.slices.gi": "2",
        "nvidia.com/mig-3g.40gb.count": "1",
        "nvidia.com/mig-3g.40gb.memory": "40448",
        "nvidia.com/mig-3g.40gb.product": "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb",
        "nvidia.com/mig-3g.40gb.replicas": "1",
        "nvidia.com/mig-3g.40gb.engines.copy": "3",
        "nvidia.com/mig-3g.40gb.engines.decoder": "3",
        "nvidia.com/mig-3g.40gb.engines.encoder": "0",
        "nvidia.com/mig-3g.40gb.engines.jpeg": "3",
        "nvidia.com/mig-3g.40gb.engines.ofa": "0",
        "nvidia.com/mig-3g.40gb.multiprocessors": "60",
        "nvidia.com/mig-3g.40gb.sharing-strategy": "none",
        "nvidia.com/mig-3g.40gb.slices.ci": "3",
        "nvidia.com/mig-3g.40gb.slices.gi": "3",
    }
    single = node("a100-pcie-nvlink-pairs", config="version: v1\nflags:\n  migStrategy: single\n",
                  mig={i: [("1g.10gb", s) for s in range(7)] for i in range(4)})
    labels = node_labels(single, single.config)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"], labels["nvidia.com/mig.strategy"]) == (
        "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "28", "single"
    )


def test_sanitise_as_gpu_feature_discovery_does() -> None:
    assert sanitise("NVIDIA A100 (PCIe)-") == "NVIDIA-A100-PCIe"
    assert sanitise("Quadro RTX .") == "Quadro-RTX"
    # A label value begins with a letter or digit: GFD's own '-H100' would be refused by the API server.
    assert sanitise("-H100") == "H100"
    assert sanitise("_Custom Build") == "Custom-Build"
    assert sanitise("A" * 70) == "A" * 63


def test_nvidias_allocation_policy_flag_sets_the_policy_and_keys_without_effect_are_named() -> None:
    state = node(config="version: v1\nflags:\n  useNodeFeatureAPI: true\n  gfd:\n    oneshot: true\n"
                        "    sleepInterval: 60s\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n"
                        "sharing:\n  allocationPolicy: distributed\n")
    assert state.config.allocation_policy == "packed"
    assert state.config.without_effect == (
        "config: flags.useNodeFeatureAPI is accepted but has no effect: labels are written to the Node object "
        "itself; no NodeFeature objects are made",
        "config: flags.gfd.oneshot is accepted but has no effect: labels are kept up to date for as long as the "
        "agent runs",
        "config: flags.gfd.sleepInterval is accepted but has no effect: labels follow each change as it happens, "
        "not an interval",
    )
