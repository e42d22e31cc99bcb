"""Sharing selectors and resource names at their edges: a MIG UUID names one MIG device, a model name is
matched as nvidia-smi writes it, MIG profiles with a '+' and sharing conflicts between MIG devices."""

from __future__ import annotations

from agent.config import parse_config
from agent.inventory import mig_resource, mps_shared_gpus, plan, sanitise, sharing_conflicts
from agent.state import DeviceHealth
from tests.unit.test_inventory import counts, node

MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"
TWO_1G = {0: [("1g.10gb", 0), ("1g.10gb", 1)]}


def test_mig_profiles_with_a_plus_name_their_resource_with_a_dot() -> None:
    assert mig_resource("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    assert mig_resource("1g.20gb") == "nvidia.com/mig-1g.20gb"


def test_a_mig_uuid_selects_that_mig_device_only() -> None:
    probe = node(config=MIXED, mig=TWO_1G)
    first = probe.inventory.mig_devices[0].uuid
    config = (MIXED + "sharing:\n  timeSlicing:\n    resources:\n"
              f"    - {{name: nvidia.com/mig-1g.10gb, replicas: 3, devices: [{first}]}}\n")
    devices = plan(node(config=config, mig=TWO_1G)).resources["nvidia.com/mig-1g.10gb"].devices
    assert [d.id for d in devices] == [f"{first}::0", f"{first}::1", f"{first}::2",
                                       probe.inventory.mig_devices[1].uuid]


def test_a_model_selector_matches_the_name_as_nvidia_smi_writes_it() -> None:
    config = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
              "    - {name: nvidia.com/gpu, replicas: 2, devices: [NVIDIA L40S]}\n")
    assert len(plan(node("pcie-l40s-4", config=config)).resources["nvidia.com/gpu"].devices) == 8


def test_a_mig_device_shared_by_two_entries_is_named_by_its_index() -> None:
    config = parse_config(MIXED + "sharing:\n  timeSlicing:\n    resources:\n"
                          "    - {name: nvidia.com/mig-1g.10gb, replicas: 2, devices: ['0:1']}\n"
                          "    - {name: nvidia.com/mig-1g.10gb, replicas: 3, devices: all}\n")
    state = node(config=MIXED, mig=TWO_1G)
    assert sharing_conflicts(state, config) == [
        "MIG device 0:1 is selected for nvidia.com/mig-1g.10gb by sharing.timeSlicing.resources[0], "
        "sharing.timeSlicing.resources[1]"
    ]


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


def test_sanitise_as_gpu_feature_discovery_does() -> None:
    assert sanitise("NVIDIA A100 (PCIe)-") == "NVIDIA-A100-PCIe"
    assert sanitise("Quadro RTX .") == "Quadro-RTX"
    # A label value begins with a letter or digit: GFD's own '-H100' would be refused by the API server.
    assert sanitise("-H100") == "H100"
    assert sanitise("_Custom Build") == "Custom-Build"
    assert sanitise("A" * 70) == "A" * 63


def test_the_gpus_mps_shares_with_their_replica_counts() -> None:
    state = node("pcie-l40s-4", config="version: v1\nsharing:\n  mps:\n    resources:\n"
                                        "    - {name: nvidia.com/gpu, replicas: 3, devices: [0, 2]}\n")
    gpus = state.inventory.gpus
    assert mps_shared_gpus(state) == [(gpus[0], 3), (gpus[2], 3)]
    time_sliced = node("pcie-l40s-4", config="version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                                              "    - {name: nvidia.com/gpu, replicas: 3}\n")
    assert mps_shared_gpus(time_sliced) == []


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


def test_mig_devices_that_match_no_resource_pattern_are_each_named() -> None:
    config = MIXED + "resources:\n  mig:\n  - {pattern: '3g.*', name: mig-big}\n"
    state = node(config=config, mig=TWO_1G)
    result = plan(state)
    assert "nvidia.com/mig-big" not in result.resources
    assert [p for p in result.problems if "resources.mig" in p] == [
        "MIG device 0:0 (1g.10gb) matches no pattern of resources.mig; not advertised",
        "MIG device 0:1 (1g.10gb) matches no pattern of resources.mig; not advertised",
    ]


SINGLE = "version: v1\nflags:\n  migStrategy: single\n"


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


def test_mps_warnings_name_the_mps_section() -> None:
    config = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, devices: [9]}\n"
    assert plan(node(config=config)).warnings == (
        "sharing.mps.resources[0].devices[0]: 9 selects no device of nvidia.com/gpu on this node",)


def test_asking_for_exactly_as_many_devices_as_there_are_is_no_warning() -> None:
    config = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
              "    - {name: nvidia.com/gpu, replicas: 2, devices: 8}\n")
    assert plan(node(config=config)).warnings == ()


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
