"""Sharing selectors and resource names at their edges: a MIG UUID names one MIG device, a model name is
matched as nvidia-smi writes it, MIG profiles with a '+' and sharing conflicts between MIG devices."""

from __future__ import annotations

from agent.config import parse_config
from agent.inventory import mig_resource, plan, sharing_conflicts
from tests.unit.test_inventory import node

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
