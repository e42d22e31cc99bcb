"""What Allocate hands the runtime (agent/deviceplugin/response.py) under each of NVIDIA's device-list strategies
and flags, on the fake DGX H100: the values a container runtime (NVIDIA's, or a CDI-enabled one) reads, written
out in full, for whole GPUs, MIG devices, time-sliced and MPS replicas; and the node's files they name."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.deviceplugin.nodefiles import read_node_files
from agent.deviceplugin.response import NodeFiles, RequestError, container_response
from agent.deviceplugin.v1beta1 import api_pb2
from agent.inventory import plan
from agent.state import NodeState
from tests.builders import node

FILES = NodeFiles(control_nodes=("/dev/nvidiactl", "/dev/nvidia-uvm"),
                  mig_minors={"gpu2/gi1/access": 21, "gpu2/gi1/ci0/access": 22}, imex_channel=True)


def respond(config: str, picks: tuple[int, ...] = (0, 5), files: NodeFiles = FILES,
            mig: dict[int, list[tuple[str, int]]] | None = None, resource: str = "nvidia.com/gpu",
            ) -> tuple[api_pb2.ContainerAllocateResponse, NodeState]:
    state = node(config="version: v1\n" + config, mig=mig)
    chosen = plan(state).resources[resource]
    devices = [chosen.devices[i] for i in picks]
    return container_response(devices, chosen, state.inventory, state.config, files, lambda: "r-1"), state


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


# --- device-list strategies: envvar, volume-mounts, CDI


def test_volume_mounts_name_each_gpu_under_the_device_directory() -> None:
    response, state = respond("flags:\n  plugin:\n    deviceListStrategy: volume-mounts\n")
    u0, u5 = state.inventory.gpus[0].uuid, state.inventory.gpus[5].uuid
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [(m.host_path, m.container_path) for m in response.mounts] == [
        ("/dev/null", f"/var/run/nvidia-container-devices/{u0}"),
        ("/dev/null", f"/var/run/nvidia-container-devices/{u5}"),
    ]


def test_volume_mounts_name_the_imex_channel_too() -> None:
    response, state = respond("flags:\n  plugin:\n    deviceListStrategy: volume-mounts\nimex:\n  channelIDs: [0]\n",
                              picks=(2,))
    assert [m.container_path for m in response.mounts] == [
        f"/var/run/nvidia-container-devices/{state.inventory.gpus[2].uuid}",
        "/var/run/nvidia-container-devices/imex/0"]


def test_cdi_annotations_with_nvidias_prefix_flag_and_no_envvar() -> None:
    response, _ = respond("flags:\n  plugin:\n    deviceListStrategy: cdi-annotations\n    deviceIDStrategy: index\n"
                          "    cdiAnnotationPrefix: cdi.example.com/\n")
    assert dict(response.annotations) == {"cdi.example.com/gpu-node-agent_r-1": "nvidia.com/gpu=0,nvidia.com/gpu=5"}
    assert (dict(response.envs), list(response.cdi_devices), list(response.devices)) == ({}, [], [])


def test_cdi_cri_and_envvar_together() -> None:
    response, _ = respond("flags:\n  plugin:\n    deviceListStrategy: [envvar, cdi-cri]\n    deviceIDStrategy: index\n")
    assert [d.name for d in response.cdi_devices] == ["nvidia.com/gpu=0", "nvidia.com/gpu=5"]
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": "0,5"}


@pytest.mark.parametrize("strategy", ["cdi-annotations", "cdi-cri", "[cdi-annotations, cdi-cri]"])
def test_cdi_alone_passes_no_device_specs_and_no_envvar(strategy: str) -> None:
    response, _ = respond(f"flags:\n  plugin:\n    deviceListStrategy: {strategy}\n    passDeviceSpecs: true\n",
                          files=FILES)
    assert (list(response.devices), dict(response.envs), list(response.mounts)) == ([], {}, [])


def test_cdi_with_envvar_still_passes_device_specs() -> None:
    response, _ = respond("flags:\n  plugin:\n    deviceListStrategy: [cdi-cri, envvar]\n    passDeviceSpecs: true\n",
                          picks=(3,), files=NodeFiles())
    assert [d.container_path for d in response.devices] == ["/dev/nvidia3"]


# --- device specs and the node's files


def test_pass_device_specs_under_the_dev_root_with_the_control_nodes() -> None:
    response, _ = respond("flags:\n  nvidiaDriverRoot: /run/nvidia/driver\n  plugin:\n    passDeviceSpecs: true\n")
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0", "rw"),
        ("/dev/nvidia5", "/run/nvidia/driver/dev/nvidia5", "rw"),
        ("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/run/nvidia/driver/dev/nvidia-uvm", "rw"),
    ]
    dev_root, _ = respond("flags:\n  nvidiaDriverRoot: /run/nvidia/driver\n  nvidiaDevRoot: /\n"
                          "  plugin:\n    passDeviceSpecs: true\n", picks=(3,), files=NodeFiles())
    assert [(d.container_path, d.host_path) for d in dev_root.devices] == [("/dev/nvidia3", "/dev/nvidia3")]


def test_a_mig_device_passes_its_parent_and_its_capability_nodes() -> None:
    response, state = respond("flags:\n  migStrategy: mixed\n  plugin:\n    passDeviceSpecs: true\n", picks=(0,),
                              mig={2: [("3g.40gb", 0)]}, resource="nvidia.com/mig-3g.40gb")
    assert [d.container_path for d in response.devices] == [
        "/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22", "/dev/nvidiactl",
        "/dev/nvidia-uvm"]
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": state.inventory.mig_devices[0].uuid}


def test_gdrcopy_gds_mofed_and_the_imex_channel() -> None:
    response, state = respond("flags:\n  gdrcopyEnabled: true\n  gdsEnabled: true\n  mofedEnabled: true\n"
                              "  plugin:\n    passDeviceSpecs: true\n    deviceListStrategy: [envvar, cdi-cri]\n"
                              "imex:\n  channelIDs: [0]\n", picks=(1,))
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": state.inventory.gpus[1].uuid,
                                   "NVIDIA_IMEX_CHANNELS": "0", "NVIDIA_GDRCOPY": "enabled", "NVIDIA_GDS": "enabled",
                                   "NVIDIA_MOFED": "enabled"}
    assert [d.name for d in response.cdi_devices] == [f"nvidia.com/gpu={state.inventory.gpus[1].uuid}",
                                                     "nvidia.com/imex-channel=0"]
    assert response.devices[-1].container_path == "/dev/nvidia-caps-imex-channels/channel0"
    without, _ = respond("imex:\n  channelIDs: [0]\n", picks=(1,), files=NodeFiles())
    assert "NVIDIA_IMEX_CHANNELS" not in without.envs


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


# --- time-sliced replicas


def test_replicas_of_one_gpu_name_it_once() -> None:
    response, state = respond("sharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
                              picks=(0, 1, 4))
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{state.inventory.gpus[0].uuid},"
                                                             f"{state.inventory.gpus[1].uuid}"}


def test_replicas_of_one_gpu_name_it_once_under_every_device_list_strategy() -> None:
    sharing = "sharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
    flags = ("flags:\n  plugin:\n    deviceListStrategy: [volume-mounts, cdi-annotations, cdi-cri]\n"
             "    deviceIDStrategy: index\n    passDeviceSpecs: true\n")
    # Four replicas of GPU 0 and two of GPU 1 (four replicas per GPU, in GPU order).
    response, _ = respond(flags + sharing, picks=(0, 1, 2, 3, 4, 5), files=NodeFiles())
    assert [m.container_path for m in response.mounts] == [
        "/var/run/nvidia-container-devices/0", "/var/run/nvidia-container-devices/1"]
    assert dict(response.annotations) == {"cdi.k8s.io/gpu-node-agent_r-1": "nvidia.com/gpu=0,nvidia.com/gpu=1"}
    assert [d.name for d in response.cdi_devices] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert [d.container_path for d in response.devices] == ["/dev/nvidia0", "/dev/nvidia1"]


def test_replicas_of_one_mig_device_name_it_once() -> None:
    config = ("flags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
              "    - {name: nvidia.com/mig-3g.40gb, replicas: 3}\n")
    response, state = respond(config, picks=(0, 2), mig={2: [("3g.40gb", 0)]}, resource="nvidia.com/mig-3g.40gb")
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": state.inventory.mig_devices[0].uuid}


def test_mig_replicas_pass_the_capability_nodes_of_their_mig_device() -> None:
    config = ("flags:\n  migStrategy: mixed\n  plugin:\n    passDeviceSpecs: true\nsharing:\n  timeSlicing:\n"
              "    resources:\n    - {name: nvidia.com/mig-3g.40gb, replicas: 2}\n")
    response, _ = respond(config, picks=(1,), mig={2: [("3g.40gb", 0)]}, resource="nvidia.com/mig-3g.40gb")
    assert [d.container_path for d in response.devices] == [
        "/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22", "/dev/nvidiactl",
        "/dev/nvidia-uvm"]


# --- MPS replicas


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


def test_two_of_three_mps_replicas_get_two_thirds_rounded_down() -> None:
    response, _ = mps_respond("sharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 3}\n",
                              picks=(0, 1))
    assert response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "66"
    assert response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={H100_MEMORY_MIB * 2 // 3}M"


def test_mps_replicas_of_two_gpus_are_refused() -> None:
    with pytest.raises(RequestError) as caught:
        mps_respond(MPS, picks=(3, 4))
    assert str(caught.value) == ("MPS replicas of nvidia.com/gpu from 2 GPUs cannot share one MPS client; "
                                 "ask for replicas of one GPU")
