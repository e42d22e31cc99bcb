"""NVIDIA's published device-plugin config files (tests/fixtures/nvidia/, each naming its source) load unchanged
on the fake DGX H100 and give what upstream's docs promise for them: the advertised resources, the GFD labels
and the Allocate response."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import load_config
from agent.deviceplugin.response import container_response
from agent.inventory import plan
from agent.labels import node_labels
from agent.state import NodeState
from tests.builders import MIXED_GPU0, node

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia"
H100 = "NVIDIA-H100-80GB-HBM3"

# (file, resources advertised on 8 H100s, gpu.replicas, gpu.sharing-strategy, gpu.product)
EXPECTED = [
    ("readme-config-file.yaml", {"nvidia.com/gpu": 8}, "1", "none", H100),
    ("dp-example-config0.yaml", {"nvidia.com/gpu": 8}, "1", "none", H100),
    ("dp-example-config1.yaml", {"nvidia.com/gpu": 8}, "1", "none", H100),
    ("time-slicing-10.yaml", {"nvidia.com/gpu": 80}, "10", "time-slicing", H100 + "-SHARED"),
    ("time-slicing-rename-10.yaml", {"nvidia.com/gpu.shared": 80}, "10", "time-slicing", H100),
    ("mps-10.yaml", {"nvidia.com/gpu": 80}, "10", "mps", H100 + "-SHARED"),
    ("mps-rename-10.yaml", {"nvidia.com/gpu.shared": 80}, "10", "mps", H100),
    ("mps-fail-requests-false.yaml", {"nvidia.com/gpu": 16}, "2", "mps", H100 + "-SHARED"),
    ("helm-map-default.yaml", {"nvidia.com/gpu": 8}, "1", "none", H100),
    ("helm-map-mig-single.yaml", {"nvidia.com/gpu": 8}, "1", "none", H100),
    ("helm-map-mig-mixed.yaml", {"nvidia.com/gpu": 8}, "1", "none", H100),
    ("gpu-operator-time-slicing-config-all.yaml", {"nvidia.com/gpu": 32}, "4", "time-slicing", H100 + "-SHARED"),
]


def loaded(name: str, mig: dict[int, list[tuple[str, int]]] | None = None) -> NodeState:
    config = load_config(FIXTURES / name)
    state = node(mig=mig).evolve(config=config)
    # MPS replicas are advertised once each GPU's control daemon is up (tests/integration/test_mps.py runs them).
    return state.evolve(mps={g.uuid: "" for g in state.inventory.gpus})


def test_every_published_file_is_a_fixture() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.yaml")) == sorted(name for name, *_ in EXPECTED)


@pytest.mark.parametrize(("name", "resources", "replicas", "strategy", "product"), EXPECTED)
def test_published_config_advertises_and_labels_as_upstream_documents(
    name: str, resources: dict[str, int], replicas: str, strategy: str, product: str
) -> None:
    state = loaded(name)
    assert state.config.without_effect == ()
    assert {n: len(r.devices) for n, r in plan(state).resources.items()} == resources
    labels = node_labels(state, state.config)
    assert (labels["nvidia.com/gpu.replicas"], labels["nvidia.com/gpu.sharing-strategy"],
            labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"]) == (replicas, strategy, product, "8")
    assert labels["nvidia.com/mps.capable"] == ("true" if strategy == "mps" else "false")


@pytest.mark.parametrize("name", ["readme-config-file.yaml", "dp-example-config0.yaml", "time-slicing-10.yaml"])
def test_allocate_hands_the_runtime_nvidia_visible_devices_with_uuids(name: str) -> None:
    state = loaded(name)
    (resource,) = plan(state).resources.values()
    chosen = [resource.devices[0], resource.devices[-1]]
    response = container_response(chosen, resource, state.inventory, state.config)
    gpus = state.inventory.gpus
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{gpus[0].uuid},{gpus[7].uuid}"}
    assert (list(response.mounts), list(response.devices), dict(response.annotations), list(response.cdi_devices)
            ) == ([], [], {}, [])


def test_mixed_strategy_file_advertises_mig_devices_per_profile() -> None:
    state = loaded("dp-example-config1.yaml", mig={0: MIXED_GPU0})
    counts = {n: len(r.devices) for n, r in plan(state).resources.items()}
    assert counts == {"nvidia.com/gpu": 7, "nvidia.com/mig-1g.10gb": 1, "nvidia.com/mig-2g.20gb": 1,
                      "nvidia.com/mig-3g.40gb": 1}
    single = loaded("helm-map-mig-single.yaml", mig={i: [("1g.10gb", s) for s in range(7)] for i in range(8)})
    assert {n: len(r.devices) for n, r in plan(single).resources.items()} == {"nvidia.com/gpu": 56}
    labels = node_labels(single, single.config)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"], labels["nvidia.com/gpu.memory"],
            labels["nvidia.com/gpu.multiprocessors"]) == (H100 + "-MIG-1g.10gb", "56", "9984", "16")


def test_an_empty_file_is_the_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "config.yaml"
    empty.write_text("")
    config = load_config(empty)
    assert config == load_config(FIXTURES / "helm-map-default.yaml")
    assert (config.flags.mig_strategy, config.flags.fail_on_init_error, config.flags.plugin.device_list_strategy,
            config.flags.plugin.device_id_strategy, config.sharing.strategy) == ("none", True, ("envvar",), "uuid",
                                                                                 "none")


def test_mps_defaults_fail_requests_greater_than_one_and_honours_false() -> None:
    # As upstream's TestNewConfigDefaultsMPSFailRequestsGreaterThanOne and its explicit-false twin.
    on = loaded("mps-10.yaml")
    off = loaded("mps-fail-requests-false.yaml")
    assert plan(on).resources["nvidia.com/gpu"].fail_requests_greater_than_one is True
    assert plan(off).resources["nvidia.com/gpu"].fail_requests_greater_than_one is False
