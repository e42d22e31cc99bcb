"""Dynamic MIG (dra.dynamicMig) against a real kube-apiserver and kube-scheduler with the DRAPartitionableDevices
feature gate on (by hand on 1.35, by default from 1.36). The slice shape is the release's: from 1.35 the counter
sets are in a slice of their own and each GPU in MIG mode has a slice of its placements (up to 1.34 one slice
held both); the tests ask the server its release and expect that shape. The scheduler gives two claims for a
3g.40gb the two placements that do not overlap and finds no room for a 4g.40gb after them;
NodePrepareResources creates the MIG device on the fake NVML at the allocated placement and
NodeUnprepareResources destroys it. Where the gate is off (by default on 1.35, by hand later) the agent says so
and publishes the GPU's layout instead."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from apiserver import ApiServer
from dra_rig import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    DRIVER,
    MIG_CLASS,
    NAMESPACE,
    ControlPlane,
    GatedApiServer,
    allocated,
    claim_of_pod,
    control_plane,
    create_claim,
    create_pod,
    create_schedulable_node,
    delete_node,
    dra_agent,
    gated_apiserver,
    remove_workloads,
    setup_cluster,
    slices_of,
    unschedulable,
)

from agent.config import parse_config
from agent.dra import plugin as dra_plugin
from agent.dra.claims import ClaimStore, Paths
from agent.dra.dynamic import DynamicMig, DynamicSlicePublisher
from agent.dra.publisher import SliceApi
from agent.dra.v1 import api_pb2 as v1
from agent.kube.node import NodeApi
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.state import NodeState, StateBus
from tests.plugin_harness import carve_mig, gpu_instances, short_dir
from tests.releases import SPLIT_COUNTERS_FROM, on_by_default, release_name

pytestmark = [pytest.mark.testbin, pytest.mark.matrix]

GATES = "DRAPartitionableDevices=true"
UNGATED = "DRAPartitionableDevices=false"  # beta in 1.36 and 1.37; locked on from 1.38: there the server emulates 1.37


def slice_names(release: tuple[int, int], node: str) -> list[str]:
    """The names of the slices of a node whose GPU 0 is published with dynamic MIG, on `release`."""
    base = f"{node}-{DRIVER}"
    if release >= SPLIT_COUNTERS_FROM:
        return [base, f"{base}-counters", f"{base}-gpu-0"]
    return [base, f"{base}-gpu-0"]


def counters_and_placements(release: tuple[int, int], node: str, found: dict[str, Any]
                            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """GPU 0's counter sets and placements, from the slices the release's shape puts them in."""
    base = f"{node}-{DRIVER}"
    counters = found[f"{base}-counters" if release >= SPLIT_COUNTERS_FROM else f"{base}-gpu-0"]
    placements = found[f"{base}-gpu-0"]
    if release >= SPLIT_COUNTERS_FROM:
        assert "devices" not in counters and "sharedCounters" not in placements
    return counters["sharedCounters"], placements["devices"]


@pytest.fixture(scope="module")
def unpartitionable(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    """An API server that drops shared counters (DRAPartitionableDevices off), whatever its release's default;
    where the release locked the gate on (1.38), emulating the last release that could turn it off (1.37)."""
    with gated_apiserver(tmp_path_factory.mktemp("unpartitionable-apiserver"), UNGATED,
                         release=apiserver.release()) as rig:
        setup_cluster(rig)
        yield rig


@pytest.fixture(scope="module")
def partitionable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    with gated_apiserver(tmp_path_factory.mktemp("partitionable-apiserver"), GATES) as rig:
        setup_cluster(rig)
        yield rig


@pytest.fixture(scope="module")
def partitionable_scheduler(partitionable: GatedApiServer, tmp_path_factory: pytest.TempPathFactory
                            ) -> Iterator[ControlPlane]:
    with control_plane(partitionable, tmp_path_factory.mktemp("partitionable-control-plane"), GATES) as plane:
        yield plane


def profile_claim(profile: str) -> dict[str, Any]:
    expression = f"device.attributes['{DRIVER}'].profile == '{profile}'"
    return {"devices": {"requests": [{"name": "gpus", "exactly": {
        "deviceClassName": MIG_CLASS, "selectors": [{"cel": {"expression": expression}}]}}]}}


class Node:
    """A DGX H100 whose GPU 0 is in MIG mode with no instances, published with dra.dynamicMig by the agent's
    slice publisher, with the agent's DRA kubelet plugin."""

    def __init__(self, apiserver: ApiServer, name: str, directory: Path) -> None:
        self.apiserver, self.name, self.directory = apiserver, name, directory
        self.fake = FakeNvml(load_node("dgx-h100"))
        carve_mig(self.fake, 0, [])
        self.backend = fake_backend(self.fake)
        self.backend.init()
        config = parse_config(f"version: v1\ndra: {{enabled: true, dynamicMig: true, cdiRoot: {directory}/cdi}}\n")
        self.bus = StateBus(NodeState(version=1, inventory=self.backend.inventory(), config=config))
        self._pool = ThreadPoolExecutor(1)

    async def nvml(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    @staticmethod
    @contextlib.asynccontextmanager
    async def running(apiserver: ApiServer, name: str) -> AsyncIterator[Node]:
        directory = short_dir()
        await asyncio.to_thread(create_schedulable_node, apiserver, name)
        node = Node(apiserver, name, directory)
        kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
        api = await NodeApi.connect(kubeconfig, name)
        node.slices = SliceApi.sharing(api)
        paths = Paths.under(directory, DRIVER, directory / "cdi")
        node.dynamic = DynamicMig(node.backend, node.nvml, ClaimStore(paths, DRIVER))
        await node.dynamic.load_profiles(node.bus.current)
        node.publisher = DynamicSlicePublisher(node.slices, node.bus, name, DRIVER, node.dynamic)
        node.plugin = dra_plugin.DraKubeletPlugin(
            paths, DRIVER, name, node.bus,
            node.slices, [], Path("/"), lambda: None, {}, node.dynamic)
        try:
            yield node
        finally:
            await asyncio.to_thread(remove_workloads, apiserver)
            await node.slices.close()
            await api.close()
            node._pool.shutdown()
            await asyncio.to_thread(delete_node, apiserver, name)
            shutil.rmtree(directory, ignore_errors=True)

    async def prepare(self, pod_name: str) -> tuple[Any, dict[str, Any]]:
        claim = await asyncio.to_thread(claim_of_pod, self.apiserver, pod_name)
        assert claim is not None
        meta = claim["metadata"]
        request = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=NAMESPACE, uid=meta["uid"],
                                                                  name=meta["name"])])
        answer = await dra_plugin._DraV1(self.plugin).NodePrepareResources(request, None)
        return answer.claims[meta["uid"]], meta

    async def unprepare(self, meta: dict[str, Any]) -> Any:
        request = v1.NodeUnprepareResourcesRequest(claims=[v1.Claim(namespace=NAMESPACE, uid=meta["uid"],
                                                                    name=meta["name"])])
        answer = await dra_plugin._DraV1(self.plugin).NodeUnprepareResources(request, None)
        return answer.claims[meta["uid"]]


async def test_the_scheduler_keeps_placements_apart_and_prepare_makes_the_mig_device(
        partitionable: GatedApiServer, partitionable_scheduler: ControlPlane) -> None:
    async with Node.running(partitionable, "dyn-mig") as node:
        assert await node.publisher.sync(node.bus.current)
        release = partitionable.release()
        found = {s["metadata"]["name"]: s["spec"] for s in await asyncio.to_thread(slices_of, partitionable, "dyn-mig")}
        assert sorted(found) == slice_names(release, "dyn-mig")
        counters, placements = counters_and_placements(release, "dyn-mig", found)
        assert [c["name"] for c in counters] == ["gpu-0-counter-set"]  # kept: the gate is on
        assert len(placements) == 25

        for name in ("first", "second"):
            await asyncio.to_thread(create_claim, partitionable, name, profile_claim("3g.40gb"))
            await asyncio.to_thread(create_pod, partitionable, name, name)
        got = [await asyncio.to_thread(allocated, partitionable, name) for name in ("first", "second")]
        assert sorted(device for _, [(_, _, device)] in got) == ["gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"]
        await asyncio.to_thread(create_claim, partitionable, "third", profile_claim("4g.40gb"))
        await asyncio.to_thread(create_pod, partitionable, "third", "third")
        assert "cannot allocate all claims" in await asyncio.to_thread(unschedulable, partitionable, "third")

        assert gpu_instances(node.fake, 0) == []  # nothing is made before Prepare
        answer, meta = await node.prepare("first")
        assert answer.error == ""
        (device,) = answer.devices
        start = int(device.device_name.rsplit("-", 1)[1])
        assert gpu_instances(node.fake, 0) == [(start, 4, 1)]
        spec = json.loads((node.directory / "cdi" / f"{DRIVER}-claim-{meta['uid']}.json").read_text())
        visible = next(e for d in spec["devices"] for e in d["containerEdits"].get("env", [])
                       if e.startswith("NVIDIA_VISIBLE_DEVICES="))
        (made,) = node.dynamic.made.values()
        assert visible == f"NVIDIA_VISIBLE_DEVICES={made['uuid']}" and made["uuid"].startswith("MIG-")
        assert (await node.prepare("first"))[0].devices[0].device_name == device.device_name  # idempotent
        assert gpu_instances(node.fake, 0) == [(start, 4, 1)]

        assert (await node.unprepare(meta)).error == ""
        assert gpu_instances(node.fake, 0) == []
        assert (await node.unprepare(meta)).error == ""  # idempotent
        assert not (node.directory / "cdi" / f"{DRIVER}-claim-{meta['uid']}.json").exists()


async def test_a_placement_taken_outside_the_agent_fails_the_claim_in_one_line(
        partitionable: GatedApiServer, partitionable_scheduler: ControlPlane) -> None:
    async with Node.running(partitionable, "dyn-mig-taken") as node:
        await node.publisher.sync(node.bus.current)
        await asyncio.to_thread(create_claim, partitionable, "whole", profile_claim("7g.80gb"))
        await asyncio.to_thread(create_pod, partitionable, "whole", "whole")
        assert await asyncio.to_thread(allocated, partitionable, "whole") == (
            "dyn-mig-taken", [("gpus", "dyn-mig-taken", "gpu-0-mig-7g80gb-0")])
        carve_mig(node.fake, 0, [("1g.10gb", 6)])  # an operator's nvidia-smi, behind the agent's back
        answer, _ = await node.prepare("whole")
        assert answer.error.startswith(f"claim {NAMESPACE}/whole: cannot create MIG device 7g.80gb at memory "
                                       "slice 0 of GPU 0: ")
        assert answer.error.endswith("(is the placement taken by a GPU instance made outside the agent?)")
        assert gpu_instances(node.fake, 0) == [(6, 1, 1)]
        assert node.dynamic.made == {}


async def test_without_the_gate_the_agent_says_so_and_publishes_the_layout(
        unpartitionable: GatedApiServer, caplog: pytest.LogCaptureFixture) -> None:
    apiserver = unpartitionable
    counters_slice = slice_names(apiserver.behaves_as(), "dyn-mig-ungated")[1]
    caplog.set_level(logging.INFO, logger="agent.dra.dynamic")
    async with Node.running(apiserver, "dyn-mig-ungated") as node:
        assert await node.publisher.sync(node.bus.current)
        (only,) = await asyncio.to_thread(slices_of, apiserver, "dyn-mig-ungated")
        assert only["metadata"]["name"] == f"dyn-mig-ungated-{DRIVER}"
        assert [d["name"] for d in only["spec"]["devices"]] == [f"gpu-{i}" for i in range(1, 8)]
        assert not node.dynamic.active
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
            f"the API server drops the shared counters of ResourceSlice {counters_slice} (the "
            "DRAPartitionableDevices feature gate is off): dra.dynamicMig is off until the agent restarts; MIG "
            "devices are published as the GPUs' layout has them"]


async def test_the_agent_with_dynamic_mig_publishes_placements_and_prepares_a_claim(
        partitionable: GatedApiServer, partitionable_scheduler: ControlPlane) -> None:
    """The whole agent, as `gpu-agent run` builds it, with dra.dynamicMig: GPU 0 (MIG mode, no instances) is
    offered as its placements in a slice of its own, the device plugin serves no MIG resource, and a claim the
    scheduler allocated is prepared by making the MIG device."""
    fake = FakeNvml(load_node("dgx-h100"))
    carve_mig(fake, 0, [])
    kubeconfig = partitionable.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    async with dra_agent(partitionable, kubeconfig, "dyn-agent", "dgx-h100", fake=fake,
                         config="flags: {migStrategy: mixed}\n", dra=", dynamicMig: true") as (agent, _):
        assert agent.dra is not None
        published = await asyncio.to_thread(slices_of, partitionable, "dyn-agent")
        release = partitionable.release()
        found = {s["metadata"]["name"]: s["spec"] for s in published}
        assert sorted(found) == slice_names(release, "dyn-agent")
        counters, placements = counters_and_placements(release, "dyn-agent", found)
        assert [c["name"] for c in counters] == ["gpu-0-counter-set"]
        # H100 80GB placements: 7 x 1g.10gb, 7 x 1g.10gb+me, 4 x 1g.20gb, 3 x 2g.20gb, 2 x 3g.40gb, 1 x 4g.40gb,
        # 1 x 7g.80gb.
        assert len(placements) == 25
        assert [d["name"] for d in found[f"dyn-agent-{DRIVER}"]["devices"]] == [f"gpu-{i}" for i in range(1, 8)]
        assert sorted(agent.devices()) == []  # whole GPUs and MIG devices are all the DRA driver's

        await asyncio.to_thread(create_claim, partitionable, "slice", profile_claim("3g.40gb"))
        await asyncio.to_thread(create_pod, partitionable, "slice", "slice")
        (_, [(_, _, device)]) = await asyncio.to_thread(allocated, partitionable, "slice")
        claim = await asyncio.to_thread(claim_of_pod, partitionable, "slice")
        assert claim is not None
        meta = claim["metadata"]
        request = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=NAMESPACE, uid=meta["uid"],
                                                                  name=meta["name"])])
        answer = (await dra_plugin._DraV1(agent.dra.plugin).NodePrepareResources(request, None)).claims[meta["uid"]]
        assert answer.error == ""
        assert [d.device_name for d in answer.devices] == [device]
        start = int(device.rsplit("-", 1)[1])
        assert gpu_instances(fake, 0) == [(start, 4, 1)]


async def test_with_the_releases_defaults_dynamic_mig_is_on_from_1_36_and_said_off_before(
        apiserver: ApiServer, caplog: pytest.LogCaptureFixture) -> None:
    """What a user of each release gets without touching a gate: the rig's API server as the release ships it."""
    setup_cluster(apiserver)
    release = apiserver.release()
    partitionable = on_by_default("DRAPartitionableDevices", release)
    print(f"Kubernetes {release_name(release)}: DRAPartitionableDevices {'on' if partitionable else 'off'} by default")
    caplog.set_level(logging.INFO, logger="agent.dra.dynamic")
    async with Node.running(apiserver, "dyn-mig-default") as node:
        assert await node.publisher.sync(node.bus.current)
        found = {s["metadata"]["name"]: s["spec"]
                 for s in await asyncio.to_thread(slices_of, apiserver, "dyn-mig-default")}
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if partitionable:
            assert sorted(found) == slice_names(release, "dyn-mig-default")
            counters, placements = counters_and_placements(release, "dyn-mig-default", found)
            assert [c["name"] for c in counters] == ["gpu-0-counter-set"]
            assert len(placements) == 25
            assert node.dynamic.active
            assert warnings == []
        else:
            assert sorted(found) == [f"dyn-mig-default-{DRIVER}"]
            assert [d["name"] for d in found[f"dyn-mig-default-{DRIVER}"]["devices"]] == [
                f"gpu-{i}" for i in range(1, 8)]
            assert not node.dynamic.active
            assert len(warnings) == 1 and "(the DRAPartitionableDevices feature gate is off)" in warnings[0]
