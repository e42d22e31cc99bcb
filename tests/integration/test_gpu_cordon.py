"""Per-GPU cordon on a running agent (agent/cordon.py): the operator's annotation on the Node takes a GPU out of the
device plugin's offer within 2 s while the pod holding it runs on, the Node says who still holds it and Events tell
each change, a wrong mark changes nothing, removing the mark gives the GPU back, and an agent that starts again
withholds the GPU before it has read its Node."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.agent import Agent
from agent.config import AgentConfig, parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.kube.view import NodeView
from agent.simulate import InMemoryNode
from tests.builders import pod_resources
from tests.plugin_harness import running_agent, short_dir, wait_until

MARK = "gpu-node-agent.io/cordon"
STATE = "gpu-node-agent.io/cordon.state"
RESOURCE = "nvidia.com/gpu"
CORDONED = "cordoned (the Node's gpu-node-agent.io/cordon annotation)"


@pytest.fixture
def directory() -> Iterator[Path]:
    """A short directory of the test's own (the PodResources socket, the kept cordon), removed afterwards."""
    made = short_dir()
    yield made
    shutil.rmtree(made, ignore_errors=True)


def config(socket: Path) -> AgentConfig:
    return parse_config(yaml.safe_dump({"version": "v1", "mig": {"podResourcesSocket": str(socket)}}))


async def operator_marks(node: InMemoryNode, value: str | None) -> None:
    """`kubectl annotate node ... gpu-node-agent.io/cordon=VALUE` (None: `gpu-node-agent.io/cordon-`)."""
    await node.patch_metadata({}, {MARK: value})


def events(node: InMemoryNode, *reasons: str) -> list[tuple[str, str, str]]:
    return [e for e in node.events if e[1] in reasons]


def cordoned_gauge(agent: Agent) -> list[float]:
    """gpu_agent_gpu_cordoned of GPUs 0, 1, ... as /metrics shows it."""
    text = generate_latest(agent.metrics.registry).decode()
    found = {int(s.labels["gpu"]): s.value for f in text_string_to_metric_families(text)
             if f.name == "gpu_agent_gpu_cordoned" for s in f.samples}
    return [found[i] for i in sorted(found)]


CORDON_REASONS = ("GPUCordoned", "GPUUncordoned", "GPUCordonRefused", "CordonedGPUInUse", "CordonedGPUFree")


async def test_a_cordoned_gpu_is_offered_to_no_new_pod_while_its_pod_runs_on_and_comes_back_uncordoned(
        directory: Path) -> None:
    socket = directory / "pr.sock"
    node = InMemoryNode("gpu-node-1")
    async with pod_resources(socket) as lister, running_agent("dgx-h100", config(socket), kube=node) as rig:
        uuid3 = rig.uuid(3)
        lister.pods = {"train-0": {RESOURCE: [uuid3]}}
        assert rig.health() == ["Healthy"] * 8

        marked = asyncio.get_running_loop().time()
        await operator_marks(node, "3")
        await wait_until(lambda: rig.health() == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4, 2,
                         "GPU 3 Unhealthy in ListAndWatch within 2 s of the mark")
        assert asyncio.get_running_loop().time() - marked < 2
        assert rig.kubelet.capacity() == ({RESOURCE: "8"}, {RESOURCE: "7"})
        assert cordoned_gauge(rig.agent) == [0, 0, 0, 1, 0, 0, 0, 0]
        await wait_until(lambda: node.view.annotations.get(STATE) == f"GPU 3 ({uuid3}): held by ml/train-0", 5,
                         "the Node saying who holds GPU 3")
        assert events(node, *CORDON_REASONS) == [
            ("Normal", "GPUCordoned", "GPU 3 cordoned (gpu-node-agent.io/cordon): no new pod is given it; pods "
                                      "holding it run on"),
            ("Normal", "CordonedGPUInUse", f"GPU {uuid3}: cordoned GPU 3 is held by ml/train-0")]
        # No new allocation of it; the others allocate.
        stub = rig.stub()
        request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[uuid3])])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Allocate(request, timeout=5)
        assert refused.value.details() == f"device {uuid3} of resource {RESOURCE} is unhealthy: {CORDONED}"
        others = api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=[rig.uuid(4)])])
        assert [dict(c.envs) for c in (await stub.Allocate(others, timeout=5)).container_responses] == [
            {"NVIDIA_VISIBLE_DEVICES": rig.uuid(4)}]

        # The pod ends: the GPU is free for maintenance, and said so.
        lister.pods = {}
        await wait_until(lambda: node.view.annotations.get(STATE) == f"GPU 3 ({uuid3}): free", 5, "GPU 3 free")
        assert events(node, "CordonedGPUFree") == [
            ("Normal", "CordonedGPUFree", f"GPU {uuid3}: cordoned GPU 3 is free: no pod holds it")]

        # The mark removed: offered again, the agent's answer removed, the operator's mark never touched.
        await operator_marks(node, None)
        await wait_until(lambda: rig.health() == ["Healthy"] * 8, 2, "GPU 3 Healthy again within 2 s")
        await rig.converged(5)
        assert STATE not in node.view.annotations
        assert events(node, "GPUUncordoned") == [("Normal", "GPUUncordoned", "GPU 3 uncordoned: offered again")]
        assert rig.kubelet.capacity() == ({RESOURCE: "8"}, {RESOURCE: "8"})
        assert cordoned_gauge(rig.agent) == [0] * 8
        assert rig.restarts() == {}


async def test_a_wrong_mark_is_one_event_and_changes_nothing(directory: Path) -> None:
    socket = directory / "pr.sock"
    node = InMemoryNode("gpu-node-1")
    async with pod_resources(socket), running_agent("dgx-h100", config(socket), kube=node) as rig:
        await operator_marks(node, "1, 6")
        expected = ["Healthy", "Unhealthy"] + ["Healthy"] * 4 + ["Unhealthy", "Healthy"]
        await wait_until(lambda: rig.health() == expected, 2, "GPUs 1 and 6 cordoned")
        await operator_marks(node, "1,6,GPU-3")
        refusal = ("Warning", "GPUCordonRefused", "annotation gpu-node-agent.io/cordon refused: 'GPU-3' is no GPU of "
                                                  "this node; nothing changed (GPUs 1, 6 stay cordoned)")
        await wait_until(lambda: events(node, "GPUCordonRefused") == [refusal], 5, "the refusal's Event")
        await rig.converged(5)
        assert rig.health() == expected
        assert node.view.annotations[MARK] == "1,6,GPU-3"
        # The same wrong mark seen again (any other change of the Node) is not refused twice.
        await node.patch_metadata({"team": "ml"}, {})
        await rig.converged(5)
        assert events(node, "GPUCordonRefused") == [refusal]
        assert rig.restarts() == {}


class UnreadNode(InMemoryNode):
    """A Node the agent cannot read (its API server does not answer): the list never returns."""

    async def list(self) -> tuple[NodeView, str]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def get(self) -> NodeView:
        return await self.list()  # type: ignore[return-value]


async def test_an_agent_that_starts_again_withholds_the_cordoned_gpu_before_it_reads_its_node(directory: Path) -> None:
    socket = directory / "pr.sock"
    kept = directory / "cordon.json"
    node = InMemoryNode("gpu-node-1")
    async with pod_resources(socket):
        async with running_agent("dgx-h100", config(socket), kube=node, cordon_file=kept) as rig:
            await operator_marks(node, "2")
            await wait_until(lambda: rig.health()[2] == "Unhealthy", 2, "GPU 2 cordoned")
            await wait_until(kept.exists, 5, "the cordon kept for the next start")
        # The next agent's Node does not answer: the first list the kubelet gets already withholds GPU 2.
        async with running_agent("dgx-h100", config(socket), kube=UnreadNode("gpu-node-1"), cordon_file=kept,
                                 await_node=False) as rig:
            assert rig.health() == ["Healthy"] * 2 + ["Unhealthy"] + ["Healthy"] * 5
        # Without the kept file the same start offers every GPU: the file, not the Node, withheld GPU 2.
        async with running_agent("dgx-h100", config(socket), kube=UnreadNode("gpu-node-1"),
                                 await_node=False) as rig:
            assert rig.health() == ["Healthy"] * 8
        # Once the Node is read again, its mark decides: removed meanwhile, GPU 2 is offered again.
        await operator_marks(node, None)
        async with running_agent("dgx-h100", config(socket), kube=node, cordon_file=kept) as rig:
            await wait_until(lambda: rig.health() == ["Healthy"] * 8, 2, "GPU 2 offered once the Node is read")
            await wait_until(lambda: "GPU 2 uncordoned" in str(events(node, "GPUUncordoned")), 5, "the Event")


async def test_a_layout_for_a_cordoned_gpu_waits_for_its_pod_and_the_new_mig_devices_stay_cordoned(
        directory: Path) -> None:
    """The maintenance workflow for a MIG change of one GPU: cordon it, label the layout (busyPolicy wait), the
    layout applies once the pod holding the GPU ends; the GPU's new MIG devices are still withheld until the mark
    goes."""
    socket = directory / "pr.sock"
    layouts = directory / "layouts.yaml"
    layouts.write_text("version: v1\nmig-configs:\n  gpu0-1g:\n    - devices: [0]\n      mig-enabled: true\n"
                       "      mig-devices: {1g.10gb: 7}\n")
    settings = {"stateDir": str(directory / "state"), "podResourcesSocket": str(socket), "layoutsFile": str(layouts),
                "busyPolicy": "wait", "busyWaitSeconds": 60}
    mixed = parse_config(yaml.safe_dump({"version": "v1", "flags": {"migStrategy": "mixed"}, "mig": settings}))
    node = InMemoryNode("gpu-node-1")
    async with pod_resources(socket) as lister, running_agent("dgx-h100", mixed, kube=node) as rig:
        lister.pods = {"train-0": {RESOURCE: [rig.uuid(0)]}}
        await operator_marks(node, "0")
        await wait_until(lambda: rig.health()[0] == "Unhealthy", 2, "GPU 0 cordoned")
        await node.patch_metadata({"nvidia.com/mig.config": "gpu0-1g"}, {})
        await wait_until(lambda: node.view.labels.get("nvidia.com/mig.config.state") == "pending", 10, "pending")
        await asyncio.sleep(3)  # more than a busy poll: the layout waits while the pod holds GPU 0
        assert node.view.labels.get("nvidia.com/mig.config.state") == "pending"
        assert not rig.agent.bus.current.inventory.gpus[0].mig_enabled

        lister.pods = {}
        await wait_until(lambda: node.view.labels.get("nvidia.com/mig.config.state") == "success", 30, "applied")
        # The new resource's plugin registers with the kubelet first: its list may take a moment on a busy machine.
        await wait_until(lambda: rig.health("nvidia.com/mig-1g.10gb") == ["Unhealthy"] * 7, 10,
                         "GPU 0's seven MIG devices, listed Unhealthy")
        assert rig.health() == ["Healthy"] * 7

        await operator_marks(node, None)
        await wait_until(lambda: rig.health("nvidia.com/mig-1g.10gb") == ["Healthy"] * 7, 2,
                         "GPU 0's MIG devices offered once the mark goes")
