"""Allocate responses for MPS replicas, for MIG replicas with passDeviceSpecs, and for CDI-only strategies."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.deviceplugin.nodefiles import read_node_files
from agent.deviceplugin.response import NodeFiles, RequestError, container_response
from agent.deviceplugin.v1beta1 import api_pb2
from agent.inventory import plan
from agent.state import NodeState
from tests.unit.test_allocate_response import FILES, respond
from tests.unit.test_inventory import node

MPS = "sharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
H100_MEMORY_MIB = 81559
"""The fake DGX H100's GPUs, as nvidia-smi reports an H100 80GB HBM3."""


def mps_respond(config: str, picks: tuple[int, ...]) -> tuple[api_pb2.ContainerAllocateResponse, NodeState]:
    """Allocate of the picked replicas once every GPU's MPS control daemon is up (replicas of a GPU whose
    daemon is not up are not advertised)."""
    state = node(config="version: v1\n" + config)
    state = state.evolve(mps={g.uuid: "" for g in state.inventory.gpus})
    resource = plan(state).resources["nvidia.com/gpu"]
    devices = [resource.devices[i] for i in picks]
    return container_response(devices, resource, state.inventory, state.config, NodeFiles()), state


def test_two_of_four_mps_replicas_get_half_the_threads_and_half_the_memory() -> None:
    response, state = mps_respond(MPS, picks=(4, 5))
    gpu1 = state.inventory.gpus[1].uuid
    assert dict(response.envs) == {
        "NVIDIA_VISIBLE_DEVICES": gpu1,
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/mps/log",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={H100_MEMORY_MIB // 2}M",
    }
    assert [(m.container_path, m.host_path) for m in response.mounts] == [
        ("/mps/pipe", f"/run/nvidia/mps/{gpu1}/pipe"),
        ("/mps/log", f"/run/nvidia/mps/{gpu1}/log"),
        ("/dev/shm", "/run/nvidia/mps/shm"),
    ]


def test_one_mps_replica_under_its_own_root() -> None:
    response, state = mps_respond("flags:\n  mpsRoot: /var/lib/mps\n" + MPS, picks=(0,))
    gpu0 = state.inventory.gpus[0].uuid
    assert response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={H100_MEMORY_MIB // 4}M"
    assert [m.host_path for m in response.mounts] == [f"/var/lib/mps/{gpu0}/pipe", f"/var/lib/mps/{gpu0}/log",
                                                      "/var/lib/mps/shm"]


def test_mps_replicas_of_two_gpus_are_refused() -> None:
    with pytest.raises(RequestError) as caught:
        mps_respond(MPS, picks=(3, 4))
    assert str(caught.value) == ("MPS replicas of nvidia.com/gpu from 2 GPUs cannot share one MPS client; "
                                 "ask for replicas of one GPU")


def test_mig_replicas_pass_the_capability_nodes_of_their_mig_device() -> None:
    config = ("flags:\n  migStrategy: mixed\n  plugin:\n    passDeviceSpecs: true\nsharing:\n  timeSlicing:\n"
              "    resources:\n    - {name: nvidia.com/mig-3g.40gb, replicas: 2}\n")
    response, _ = respond(config, picks=(1,), mig={2: [("3g.40gb", 0)]}, resource="nvidia.com/mig-3g.40gb")
    assert [d.container_path for d in response.devices] == [
        "/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22", "/dev/nvidiactl",
        "/dev/nvidia-uvm"]


@pytest.mark.parametrize("strategy", ["cdi-annotations", "cdi-cri", "[cdi-annotations, cdi-cri]"])
def test_cdi_alone_passes_no_device_specs_and_no_envvar(strategy: str) -> None:
    response, _ = respond(f"flags:\n  plugin:\n    deviceListStrategy: {strategy}\n    passDeviceSpecs: true\n",
                          files=FILES)
    assert (list(response.devices), dict(response.envs), list(response.mounts)) == ([], {}, [])


def test_cdi_with_envvar_still_passes_device_specs() -> None:
    response, _ = respond("flags:\n  plugin:\n    deviceListStrategy: [cdi-cri, envvar]\n    passDeviceSpecs: true\n",
                          picks=(3,), files=NodeFiles())
    assert [d.container_path for d in response.devices] == ["/dev/nvidia3"]


def test_volume_mounts_name_the_imex_channel_too() -> None:
    response, state = respond("flags:\n  plugin:\n    deviceListStrategy: volume-mounts\nimex:\n  channelIDs: [0]\n",
                              picks=(2,))
    assert [m.container_path for m in response.mounts] == [
        f"/var/run/nvidia-container-devices/{state.inventory.gpus[2].uuid}",
        "/var/run/nvidia-container-devices/imex/0"]


def test_node_files_are_read_from_the_capability_minors_and_the_device_nodes_present(tmp_path: Path) -> None:
    minors = tmp_path / "mig-minors"
    minors.write_text("config 1\nmonitor 2\ngpu0/gi1/access 21\ngpu0/gi1/ci0/access 22\nbroken line\n")
    present = {"/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia-caps-imex-channels/channel0"}
    files = read_node_files((0, 3), exists=present.__contains__, mig_minors=minors)
    assert files == NodeFiles(control_nodes=("/dev/nvidiactl", "/dev/nvidia-modeset"),
                              mig_minors={"config": 1, "monitor": 2, "gpu0/gi1/access": 21, "gpu0/gi1/ci0/access": 22},
                              imex_channel=True)
    assert read_node_files(exists=lambda _: False, mig_minors=tmp_path / "absent") == NodeFiles()
    # Channel 0 is the one NVIDIA's config can ask for: other channels alone do not make it present.
    assert read_node_files((3,), exists=present.__contains__, mig_minors=tmp_path / "absent").imex_channel is False


def test_two_of_three_mps_replicas_get_two_thirds_rounded_down() -> None:
    response, _ = mps_respond("sharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 3}\n",
                              picks=(0, 1))
    assert response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "66"
    assert response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={H100_MEMORY_MIB * 2 // 3}M"
