"""DRA on a multi-node NVLink fabric: every device of a fabric-attached GPU carries its clique, and an IMEX
channel the config asks for and the node has is a device of its own, whose CDI spec gives the channel's device
node and NVIDIA_IMEX_CHANNELS."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from agent.config import parse_config
from agent.dra.cdi import claim_spec
from agent.dra.slices import slice_spec
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node, parse_node
from agent.state import DeviceHealth, NodeState

DRIVER = "gpu.gpu-node-agent.io"
GB200_CLIQUE = "5d3c1e2a-8b4f-4c6d-9e7a-1f2b3c4d5e6f.1"
IMEX = "version: v1\nimex: {channelIDs: [0]}\n"
CLUSTER = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def node(source: str, config: str = "version: v1\n") -> NodeState:
    spec = parse_node(source, "node.yaml") if source.startswith("version:") else load_node(source)
    backend = fake_backend(FakeNvml(spec))
    backend.init()
    return NodeState(version=1, inventory=backend.inventory(), config=parse_config(config))


def devices(state: NodeState) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in slice_spec(state, "tray-1", DRIVER, 1)["devices"]}


def test_each_gpu_of_the_gb200_tray_carries_its_clique_and_the_channel_is_a_device() -> None:
    found = devices(node("gb200-nvl72-tray", IMEX))
    assert list(found) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "channel-0"]
    assert [d["attributes"]["clique"] for n, d in found.items() if n.startswith("gpu-")] == [
        {"string": GB200_CLIQUE}] * 4
    assert found["channel-0"] == {"name": "channel-0", "attributes": {
        "type": {"string": "channel"}, "id": {"int": 0}, "clique": {"string": GB200_CLIQUE}}}


def test_replicas_of_a_shared_gpu_carry_the_clique_too() -> None:
    shared = ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
              "      - {name: nvidia.com/gpu, replicas: 2, devices: [1]}\n")
    found = devices(node("gb200-nvl72-tray", shared))
    assert {n: d["attributes"]["clique"]["string"] for n, d in found.items() if "replica" in n} == {
        "gpu-1-replica-0": GB200_CLIQUE, "gpu-1-replica-1": GB200_CLIQUE}


def test_no_channel_without_the_config_or_without_the_device_node() -> None:
    assert "channel-0" not in devices(node("gb200-nvl72-tray"))
    without_node = devices(node("dgx-b200", IMEX))
    assert list(without_node) == [f"gpu-{i}" for i in range(8)]
    assert [n for n, d in without_node.items() if "clique" in d["attributes"]] == []


def test_gpus_not_attached_carry_no_clique_and_a_node_of_two_cliques_offers_its_channel_without_one() -> None:
    gpus = "".join(f"  - {{model: GB200, numa_node: 0, fabric: {{cluster_uuid: {CLUSTER}, clique_id: {c}{more}}}}}\n"
                   for c, more in ((1, ""), (2, ""), (2, ", state: in-progress")))
    state = node(f"version: v1\nnvswitch: true\nimex_channels: [0, 5]\ngpus:\n{gpus}", IMEX)
    found = devices(state)
    assert {n: d["attributes"].get("clique") for n, d in found.items()} == {
        "gpu-0": {"string": f"{CLUSTER}.1"}, "gpu-1": {"string": f"{CLUSTER}.2"}, "gpu-2": None, "channel-0": None}
    # A channel unhealthy GPUs cannot take away: the GPUs leave the slice, the channel stays.
    fault = DeviceHealth(False, "XID 79", True)
    sick = dataclasses.replace(state, health={g.uuid: fault for g in state.inventory.gpus})
    assert list(devices(sick)) == ["channel-0"]


def test_the_cdi_spec_of_a_claim_of_gpus_and_the_channel() -> None:
    spec = claim_spec(DRIVER, "u1", [("channel-0", "", ["/dev/nvidia-caps-imex-channels/channel0"]),
                                     ("gpu-0", "GPU-a", ["/dev/nvidia0"])], ["/dev/nvidiactl"], Path("/"))
    assert spec["devices"] == [
        {"name": "claim-u1-channel-0", "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidia-caps-imex-channels/channel0"}], "env": ["NVIDIA_IMEX_CHANNELS=0"]}},
        {"name": "claim-u1-gpu-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
        {"name": "claim-u1", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-a"],
                                                "deviceNodes": [{"path": "/dev/nvidiactl"}]}},
    ]


def test_a_claim_of_the_channel_alone_names_no_gpus_and_follows_the_driver_root() -> None:
    spec = claim_spec(DRIVER, "u2", [("channel-0", "", ["/dev/nvidia-caps-imex-channels/channel0"])], [],
                      Path("/run/nvidia/driver"))
    assert spec["devices"] == [
        {"name": "claim-u2-channel-0", "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidia-caps-imex-channels/channel0",
                             "hostPath": "/run/nvidia/driver/dev/nvidia-caps-imex-channels/channel0"}],
            "env": ["NVIDIA_IMEX_CHANNELS=0"]}},
        {"name": "claim-u2", "containerEdits": {}},
    ]
