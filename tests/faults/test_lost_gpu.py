"""A GPU lost before the agent starts, in both shapes NVML shows it (no handle; a handle whose every call fails
with GPU_IS_LOST): the agent starts and serves the others, the lost GPU is Unhealthy under its own NVML index
and UUID, the node stays tainted through a restart of the agent, and no GPU is ever taken for its neighbour."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pynvml
import pytest
import yaml

from agent.config import AgentConfig, parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.mig.applier import apply_layout
from agent.mig.layout import parse_layouts
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import load_node
from agent.simulate import InMemoryNode
from tests.plugin_harness import Rig, gpu_instances, running_agent, short_dir, wait_until

RESOURCE = "nvidia.com/gpu"
TAINT = {"key": "gpu-node-agent.io/gpu-fault", "value": "true", "effect": "NoSchedule"}
LOST = "GPU is lost (fallen off the bus)"
PRESET = load_node("dgx-h100")
UUIDS = [g.uuid for g in PRESET.gpus]
"""The preset's GPUs by NVML index, as its node file gives them (not as the agent reads them)."""
SHAPES = pytest.mark.parametrize("keep_handle", [False, True], ids=["no-handle", "handle-fails"])


def fast_health(**plugin: object) -> AgentConfig:
    """Health sampled every 0.1 s, recovered after 2 clean samples; `plugin`: flags.plugin settings."""
    return parse_config(yaml.safe_dump({"version": "v1", "flags": {"plugin": dict(plugin)},
                                        "health": {"sampleIntervalSeconds": 0.1, "recoveryChecks": 2}}))


def lost_metric(rig: object) -> dict[tuple[str, str], float]:
    registry = rig.agent.metrics.registry  # type: ignore[attr-defined]
    return {(s.labels["gpu"], s.labels["uuid"]): s.value for family in registry.collect()
            if family.name == "gpu_agent_gpu_lost" for s in family.samples}


class TaintRecord:
    """Every version of the Node's taints, read through the watch an API server client would use."""

    def __init__(self, node: InMemoryNode) -> None:
        self.seen: list[tuple[dict[str, str], ...]] = [node.view.taints]
        self._task = asyncio.create_task(self._follow(node, node.view.resource_version))

    async def _follow(self, node: InMemoryNode, since: str) -> None:
        async for view in node.watch(since):
            self.seen.append(view.taints)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def recording(node: InMemoryNode) -> AsyncIterator[TaintRecord]:
    record = TaintRecord(node)
    try:
        yield record
    finally:
        await record.stop()


@SHAPES
async def test_a_gpu_lost_before_a_restart_keeps_the_node_tainted_and_is_named_by_its_index(
        keep_handle: bool, tmp_path: Path) -> None:
    node = InMemoryNode("gpu-node-1")
    fake = FakeNvml(PRESET)
    config = fast_health()
    async with running_agent("dgx-h100", config, kube=node, fake=fake, gpu_identities=tmp_path / "gpus.json") as rig:
        assert rig.health() == ["Healthy"] * 8
        fake.set_gpu_lost(3, keep_handle=keep_handle)
        await wait_until(lambda: rig.health()[3] == "Unhealthy", 5, "GPU 3 unhealthy")
        await rig.converged(5)
        assert node.view.taints == (TAINT,)
    events_before = len(node.events)

    # The agent restarts (a rolling update, an OOM kill) with GPU 3 still lost.
    async with recording(node) as taints, running_agent(
            "dgx-h100", config, kube=node, fake=fake, gpu_identities=tmp_path / "gpus.json") as rig:
        await rig.converged(5)
        assert [d.ID for d in rig.devices()] == UUIDS
        assert rig.health() == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4
        assert rig.kubelet.capacity() == ({RESOURCE: "8"}, {RESOURCE: "7"})
        condition = node.view.conditions["GPUHealthy"]
        assert (condition.status, condition.reason, condition.message) == ("False", "NodeGPUFault", LOST)
        assert node.events[events_before:] == [("Warning", "GPUFault", f"GPU {UUIDS[3]}: {LOST}")]
        assert node.view.labels["nvidia.com/gpu.count"] == "8"
        assert node.view.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert node.view.labels["gpu-node-agent.io/gpu.lost"] == "1"
        assert lost_metric(rig) == {(str(i), UUIDS[i]): (1.0 if i == 3 else 0.0) for i in range(8)}
        assert rig.restarts() == {}
    assert taints.seen and all(t == (TAINT,) for t in taints.seen), taints.seen


@SHAPES
async def test_a_gpu_lost_before_the_first_start_is_listed_unhealthy_under_its_index(keep_handle: bool) -> None:
    node = InMemoryNode("gpu-node-1")
    fake = FakeNvml(PRESET)
    fake.set_gpu_lost(3, keep_handle=keep_handle)
    async with running_agent("dgx-h100", fast_health(), kube=node, fake=fake) as rig:
        await rig.converged(5)
        ids = [d.ID for d in rig.devices()]
        # Nothing was ever read of GPU 3: it is named by its NVML index until it answers.
        assert ids == [*UUIDS[:3], "GPU-lost-nvml-3", *UUIDS[4:]]
        assert rig.health() == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4
        assert node.view.taints == (TAINT,)
        assert node.view.labels["nvidia.com/gpu.count"] == "8"
        assert node.view.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert node.view.labels["gpu-node-agent.io/gpu.lost"] == "1"

        # It answers again: read whole under the UUID NVML gives, healthy after the configured clean samples.
        fake.set_gpu_lost(3, False)
        await wait_until(lambda: [d.ID for d in rig.devices()] == UUIDS and rig.health() == ["Healthy"] * 8, 5,
                         "GPU 3 read whole and healthy")
        await rig.converged(5)
        assert node.view.taints == ()
        assert "gpu-node-agent.io/gpu.lost" not in node.view.labels
        assert node.events[-1] == ("Normal", "GPURecovered", f"GPU {UUIDS[3]}: recovered from {LOST}")


@SHAPES
async def test_with_index_ids_the_gpu_after_a_lost_one_is_handed_out_as_itself(keep_handle: bool) -> None:
    fake = FakeNvml(PRESET)
    fake.set_gpu_lost(3, keep_handle=keep_handle)
    config = fast_health(deviceIDStrategy="index", passDeviceSpecs=True)
    async with running_agent("dgx-h100", config, fake=fake) as rig:
        assert [d.ID for d in rig.devices()] == [*UUIDS[:3], "GPU-lost-nvml-3", *UUIDS[4:]]
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[UUIDS[4]])])
        response = await rig.stub().Allocate(request, timeout=5)
        (answer,) = response.container_responses
        assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": "4"}
        assert [d.host_path for d in answer.devices if d.host_path.startswith("/dev/nvidia") and
                d.host_path[len("/dev/nvidia"):].isdigit()] == [f"/dev/nvidia{PRESET.gpus[4].minor_number}"]
        lost = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["GPU-lost-nvml-3"])])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rig.stub().Allocate(lost, timeout=5)
        assert refused.value.details() == f"device GPU-lost-nvml-3 of resource {RESOURCE} is unhealthy: {LOST}"


@contextlib.asynccontextmanager
async def mig_agent(fake: FakeNvml, node: InMemoryNode) -> AsyncIterator[Rig]:
    """The agent on `fake` with MIG devices under their own names, fast health, and its MIG state in a directory
    of its own, removed afterwards."""
    directory = short_dir()
    config = parse_config(yaml.safe_dump({
        "version": "v1", "flags": {"migStrategy": "mixed"},
        "health": {"sampleIntervalSeconds": 0.1, "recoveryChecks": 2},
        "mig": {"stateDir": f"{directory}/state", "podResourcesSocket": f"{directory}/pr.sock"}}))
    try:
        async with running_agent("dgx-h100", config, kube=node, fake=fake, directory=directory) as rig:
            yield rig
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_a_layout_with_a_lost_gpu_fails_naming_it_changes_nothing_and_withholds_nothing() -> None:
    fake = FakeNvml(PRESET)
    node = InMemoryNode("gpu-node-1")
    async with mig_agent(fake, node) as rig:
        fake.set_gpu_lost(3, keep_handle=True)
        await wait_until(lambda: rig.health()[3] == "Unhealthy", 5, "GPU 3 unhealthy")
        await node.patch_metadata({"nvidia.com/mig.config": "all-1g.10gb"}, {})
        await wait_until(lambda: node.view.labels.get("nvidia.com/mig.config.state") == "failed", 10,
                         "the layout to fail")
        assert node.view.annotations["nvidia.com/mig.config.state.reason"].startswith(
            "cannot plan the layout: GPU 3: reading its MIG state: GPU is lost")
        # Nothing changed on any GPU, and nothing is withheld: the seven others are still offered, healthy.
        fake.set_gpu_lost(3, False)
        fake.nvmlInit()
        try:
            modes = [list(fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(i))) for i in range(8)]
        finally:
            fake.nvmlShutdown()
        assert modes == [[pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE]] * 8
        assert rig.agent.bus.current.draining == frozenset()
        assert [d.ID for d in rig.devices()] == UUIDS
        assert rig.restarts() == {}


TWO_OF_EIGHT = """\
version: v1
mig-configs:
  first-two:
    - devices: [0, 1]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
"""
CHANGES = 2 * (1 + 7 + 7)
"""What `first-two` changes from a fresh boot: per GPU, its MIG mode and seven GPU and seven compute instances."""


def untouched(fake: FakeNvml, indices: range) -> list[tuple[int, list[int], int]]:
    """(index, MIG mode current and pending, GPU instances) of the GPUs, by the fake's own calls."""
    fake.nvmlInit()
    try:
        found = []
        for i in indices:
            handle = fake.nvmlDeviceGetHandleByIndex(i)
            found.append((i, list(fake.nvmlDeviceGetMigMode(handle)), len(gpu_instances(fake, i))))
        return found
    finally:
        fake.nvmlShutdown()


@pytest.mark.parametrize("keep_handle", [False, True], ids=["no-handle", "handle-fails"])
def test_a_gpu_lost_after_any_driver_call_of_an_apply_fails_it_naming_the_gpu_and_touches_no_other(
        keep_handle: bool) -> None:
    layout = parse_layouts(TWO_OF_EIGHT, "layouts.yaml").layout("first-two")
    outcomes = []
    for n in range(1, CHANGES + 2):
        fake = FakeNvml(PRESET)
        backend = fake_backend(fake)
        backend.init()
        fake.lose_after(1, n, keep_handle=keep_handle)
        result = apply_layout(MigOps(backend), 8, layout)
        outcomes.append(result.outcome)
        if n <= CHANGES:
            assert result.outcome == "failed", (n, result)
            assert "GPU 1" in result.reason and result.reason.endswith("GPU is lost"), (n, result.reason)
        else:
            assert result.outcome == "success", (n, result)
        # GPUs 2..7 are not in the layout: nothing changed on them, whenever GPU 1 went.
        assert untouched(fake, range(2, 8)) == [(i, [0, 0], 0) for i in range(2, 8)], n
        backend.shutdown()
    assert outcomes == ["failed"] * CHANGES + ["success"]


async def test_a_gpu_lost_in_the_middle_of_an_apply_ends_it_failed_and_gives_the_drained_gpus_back() -> None:
    fake = FakeNvml(PRESET)
    node = InMemoryNode("gpu-node-1")
    async with mig_agent(fake, node) as rig:
        fake.lose_after(5, 20)  # GPU 5 goes in the middle of the apply of all-1g.10gb (8 x 15 changes)
        await node.patch_metadata({"nvidia.com/mig.config": "all-1g.10gb"}, {})
        await wait_until(lambda: node.view.labels.get("nvidia.com/mig.config.state") == "failed", 20,
                         "the layout to fail")
        assert node.view.annotations["nvidia.com/mig.config.state.reason"].startswith("NVML error on GPU 5 (after ")
        assert "GPU is lost" in node.view.annotations["nvidia.com/mig.config.state.reason"]
        assert rig.agent.bus.current.draining == frozenset()
        await wait_until(lambda: rig.agent.bus.current.gpu_health(UUIDS[5]).reason == LOST, 5, "GPU 5 lost")
        await rig.converged(5)
        assert node.view.taints == (TAINT,)
        # GPU 5 is lost in the inventory under its own index; the GPUs the apply did not reach are served whole.
        inventory = rig.agent.bus.current.inventory
        assert [g.index for g in inventory.gpus] == list(range(8)) and inventory.gpus[5].uuid == UUIDS[5]
        assert inventory.gpus[5].lost
        # nvidia.com/gpu had no device while every GPU was withdrawn for the apply, so its server stopped; served
        # again, it reaches the kubelet on a new registration (asynchronously).
        await wait_until(lambda: {UUIDS[5], UUIDS[7]} <= {d.ID for d in rig.devices()}, 5,
                         "GPUs 5 and 7 listed whole again")
        assert rig.restarts() == {}
