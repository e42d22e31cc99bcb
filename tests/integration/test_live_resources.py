"""Resources change live while a kubelet holds their streams: config reloads, sharing and MIG strategies."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from agent.config import load_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import InMemoryNode
from tests.plugin_harness import carve_mig, running_agent, wait_until

SHARED_HALF = """version: v1
sharing:
  timeSlicing:
    resources:
      - {{name: nvidia.com/gpu, replicas: {replicas}, rename: example.com/shared-gpu, devices: [0, 1, 2, 3]}}
"""


def allocate(*ids: str) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(ids))])


async def test_config_reload_changes_only_the_affected_resources(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(SHARED_HALF.format(replicas=2))
    async with running_agent("dgx-h100", load_config(path), config_path=path) as rig:
        kubelet = rig.kubelet
        assert {r: len(v.devices) for r, v in kubelet.plugins.items()} == {
            "example.com/shared-gpu": 8, "nvidia.com/gpu": 4
        }
        whole = kubelet.plugins["nvidia.com/gpu"]
        endpoint, updates = whole.endpoint, whole.updates

        path.write_text(SHARED_HALF.format(replicas=4))
        assert await rig.agent.reload_config() is True
        await wait_until(lambda: len(rig.devices("example.com/shared-gpu")) == 16, what="16 replicas")
        assert kubelet.plugins["nvidia.com/gpu"] is whole
        assert (whole.endpoint, whole.updates) == (endpoint, updates)

        path.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 1}]}}\n")
        assert await rig.agent.reload_config() is False
        assert {r: len(v.devices) for r, v in kubelet.plugins.items()} == {
            "example.com/shared-gpu": 16, "nvidia.com/gpu": 4
        }
        rejected = rig.agent.bus.current.incidents[-1]
        assert (rejected.kind, rejected.message) == (
            "config-rejected",
            f"config reload rejected: {path}: sharing.timeSlicing.resources[0].replicas: "
            "got 1; must be at least 2",
        )

        path.write_text("version: v1\n")
        assert await rig.agent.reload_config() is True
        await wait_until(lambda: len(rig.devices("nvidia.com/gpu")) == 8, what="8 whole GPUs")
        await wait_until(lambda: "example.com/shared-gpu" not in rig.agent.plugins.plugins,
                         what="the shared resource's server to stop")
        assert rig.devices("example.com/shared-gpu") == []
        assert whole.endpoint == endpoint


async def test_config_file_change_is_picked_up_without_a_signal(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    async with running_agent("pcie-l40s-4", load_config(path), config_path=path) as rig:
        path.write_text(SHARED_HALF.format(replicas=3))
        await wait_until(lambda: "example.com/shared-gpu" in rig.kubelet.plugins
                         and len(rig.devices("example.com/shared-gpu")) == 12, timeout=10, what="reload")


async def test_replicas_allocate_their_gpu_once_and_fail_requests_greater_than_one() -> None:
    config = load_config(None).model_copy(update={"sharing": load_config(None).sharing.model_validate(
        {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}})})
    async with running_agent("pcie-l40s-4", config) as rig:
        ids = [d.ID for d in rig.devices()]
        assert len(ids) == 16
        response = await rig.stub().Allocate(allocate(ids[0], ids[1], ids[5]))
        uuids = [g.uuid for g in rig.agent.bus.current.inventory.gpus]
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": f"{uuids[0]},{uuids[1]}"}

    strict = config.model_copy(update={"sharing": config.sharing.model_validate(
        {"timeSlicing": {"failRequestsGreaterThanOne": True,
                         "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}})})
    async with running_agent("pcie-l40s-4", strict) as rig:
        ids = [d.ID for d in rig.devices()]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rig.stub().Allocate(allocate(ids[0], ids[4]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == (
            "invalid request: maximum request size for shared resource nvidia.com/gpu is 1; found 2"
        )
        one = await rig.stub().Allocate(allocate(ids[4]))
        assert len(one.container_responses) == 1


async def test_mixed_strategy_over_grpc() -> None:
    fake = FakeNvml(load_node("dgx-h100"))
    carve_mig(fake, 0, [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)])
    config = load_config(None).model_copy(
        update={"flags": load_config(None).flags.model_copy(update={"mig_strategy": "mixed"})}
    )
    async with running_agent("dgx-h100", config, fake=fake) as rig:
        assert {r: len(v.devices) for r, v in rig.kubelet.plugins.items()} == {
            "nvidia.com/gpu": 7, "nvidia.com/mig-1g.10gb": 1, "nvidia.com/mig-2g.20gb": 1, "nvidia.com/mig-3g.40gb": 1,
        }
        (device,) = rig.devices("nvidia.com/mig-3g.40gb")
        assert device.ID.startswith("MIG-")
        assert [n.ID for n in device.topology.nodes] == [0]
        response = await rig.stub("nvidia.com/mig-3g.40gb").Allocate(allocate(device.ID))
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": device.ID}


async def test_node_label_selects_a_named_config(tmp_path: Path) -> None:
    (tmp_path / "default").write_text("version: v1\n")
    (tmp_path / "sliced").write_text(SHARED_HALF.format(replicas=2))
    node = InMemoryNode("n1")
    async with running_agent("pcie-l40s-4", load_config(tmp_path), kube=node, config_path=tmp_path) as rig:
        kubelet = rig.kubelet
        await node.patch_metadata({"nvidia.com/device-plugin.config": "sliced"}, {})
        await wait_until(lambda: "example.com/shared-gpu" in kubelet.plugins
                         and len(kubelet.plugins["example.com/shared-gpu"].devices) == 8, what="the sliced config")
        await node.patch_metadata({"nvidia.com/device-plugin.config": "missing"}, {})
        await wait_until(lambda: node.events and node.events[-1][1] == "ConfigRejected", what="rejection")
        assert node.events[-1] == (
            "Warning", "ConfigRejected",
            f"config reload rejected: {tmp_path}: no config named 'missing' (known: default, sliced)",
        )
        assert len(kubelet.plugins["example.com/shared-gpu"].devices) == 8


async def test_withheld_gpus_are_reported_once_as_an_incident() -> None:
    dgx = FakeNvml(load_node("dgx-h100"))
    carve_mig(dgx, 0, [("3g.40gb", 0), ("1g.10gb", 4)])
    config = load_config(None).model_copy(
        update={"flags": load_config(None).flags.model_copy(update={"mig_strategy": "single"})}
    )
    async with running_agent("dgx-h100", config, fake=dgx) as rig:
        bus = rig.agent.bus
        await wait_until(lambda: any(i.kind == "resources-withheld" for i in bus.current.incidents), what="report")
        withheld = [i.message for i in bus.current.incidents if i.kind == "resources-withheld"]
        assert withheld == [
            "migStrategy single needs every GPU MIG-enabled with devices of one profile (1g.10gb); not advertised: "
            "GPU 0 (1g.10gb, 3g.40gb); GPU 1 (MIG disabled); GPU 2 (MIG disabled); GPU 3 (MIG disabled); "
            "GPU 4 (MIG disabled); GPU 5 (MIG disabled); GPU 6 (MIG disabled); GPU 7 (MIG disabled)"
        ]
        assert rig.agent.devices() == {}
