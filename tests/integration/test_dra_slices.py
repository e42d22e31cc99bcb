"""DRA mode against real components: the agent's ResourceSlice on the rig's kube-apiserver, written with the
agent's own ServiceAccount, and claims allocated from it by the real kube-scheduler (templates turned into
claims by the real kube-controller-manager), for pods bound to Nodes made here."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from apiserver import REPO, ApiServer
from dra_rig import (
    DEVICE_CLASS,
    DRIVER,
    GROUP,
    VERSION,
    ControlPlane,
    allocated,
    claim_of_pod,
    control_plane,
    create_claim,
    create_pod,
    create_template,
    delete_node,
    dra_agent,
    example,
    setup_cluster,
    slices_of,
    unschedulable,
)
from kubernetes import client as k8s

from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.podresources_v1 import api_pb2 as pr
from agent.podresources_v1 import api_pb2_grpc as pr_grpc
from agent.simulate import StandInKubelet
from tests.plugin_harness import carve_mig, short_dir, wait_until
from tests.releases import on_by_default, release_name

pytestmark = pytest.mark.matrix  # what the API server does here depends on its release

LOOSE = str(REPO / "tests" / "fixtures" / "dra" / "one-pair-two-loose.yaml")
PAIR = f"{DRIVER}/nvlinkPair"


@pytest.fixture(scope="module")
def scheduler(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    setup_cluster(apiserver)
    with control_plane(apiserver, tmp_path_factory.mktemp("control-plane")) as plane:
        yield plane


def devices(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in found["spec"].get("devices") or []}


def two(request: str = "gpus", **extra: Any) -> dict[str, Any]:
    return {"name": request, "exactly": {"deviceClassName": DEVICE_CLASS, "count": 2, **extra}}


def pinned(*indices: int) -> dict[str, Any]:
    """A claim for the GPUs with these indices, by CEL on the agent's `index` attribute."""
    listed = ", ".join(map(str, indices))
    return {"devices": {"requests": [{"name": "gpus", "exactly": {
        "deviceClassName": DEVICE_CLASS, "count": len(indices),
        "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].index in [{listed}]"}}]}}]}}


ON_ONE_PAIR = {"devices": {"requests": [two()], "constraints": [{"requests": ["gpus"], "matchAttribute": PAIR}]}}

BEST_TOPOLOGY_FIRST = example("two-gpus-best-topology.yaml")
"""2 GPUs: an NVLink pair, else two on one NUMA node, else any two (the shipped template's claim spec)."""
ONE_DOMAIN = example("two-gpus-one-nvlink-domain.yaml")


async def test_the_slice_on_the_api_server_carries_the_gpus_and_follows_health(
        apiserver: ApiServer, dra_kubeconfig: Path) -> None:
    async with dra_agent(apiserver, dra_kubeconfig, "dra-h100", "dgx-h100") as (_, fake):
        (found,) = await asyncio.to_thread(slices_of, apiserver, "dra-h100")
        assert found["metadata"]["name"] == "dra-h100-gpu.gpu-node-agent.io"
        assert found["spec"]["driver"] == DRIVER
        assert found["spec"]["pool"] == {"name": "dra-h100", "generation": 1, "resourceSliceCount": 1}
        gpu4 = devices(found)["gpu-4"]
        assert gpu4["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:9a:00.0"}
        assert gpu4["attributes"]["numaNode"] == {"int": 1}
        assert gpu4["attributes"]["nvlinkDomain"] == {"int": 0}
        assert gpu4["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
        assert gpu4["capacity"] == {"memory": {"value": "81559Mi"}, "multiprocessors": {"value": "132"}}
        assert list(devices(found)) == [f"gpu-{i}" for i in range(8)]

        fake.inject_xid(3, 48)  # a double-bit ECC error: the GPU is unhealthy

        # With the release's default gates: from 1.36 the API server keeps device taints, and the agent taints the
        # GPU in place; 1.35 drops them, and the agent withdraws it.
        release = apiserver.release()
        taints = on_by_default("DRADeviceTaints", release)
        print(f"Kubernetes {release_name(release)}: DRADeviceTaints {'on' if taints else 'off'} by default")

        async def marked() -> dict[str, Any]:
            while True:
                (now,) = await asyncio.to_thread(slices_of, apiserver, "dra-h100")
                if (taints and devices(now).get("gpu-3", {}).get("taints")) or (
                        not taints and "gpu-3" not in devices(now)):
                    return now
                await asyncio.sleep(0.1)

        now = await asyncio.wait_for(marked(), 10)
        assert now["spec"]["pool"]["generation"] == 2
        if taints:
            assert list(devices(now)) == [f"gpu-{i}" for i in range(8)]
            assert [(t["key"], t["value"], t["effect"]) for t in devices(now)["gpu-3"]["taints"]] == [
                ("gpu.gpu-node-agent.io/unhealthy", "xid-48", "NoSchedule")]
            assert [n for n, d in devices(now).items() if d.get("taints")] == ["gpu-3"]
        else:
            assert list(devices(now)) == ["gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]


async def test_the_slice_is_written_again_after_it_is_deleted(apiserver: ApiServer, dra_kubeconfig: Path) -> None:
    async with dra_agent(apiserver, dra_kubeconfig, "dra-gone", "a100-pcie-nvlink-pairs") as (agent, _):
        custom = k8s.CustomObjectsApi(apiserver.admin_client())
        await asyncio.to_thread(custom.delete_cluster_custom_object, "resource.k8s.io", "v1", "resourceslices",
                                "dra-gone-gpu.gpu-node-agent.io")
        assert agent.dra is not None
        agent.dra.slices.republish()  # what a (re)registration with the kubelet does

        async def back() -> dict[str, Any]:
            while True:
                items = await asyncio.to_thread(slices_of, apiserver, "dra-gone")
                if items:
                    return items[0]
                await asyncio.sleep(0.1)

        found = await asyncio.wait_for(back(), 10)
        assert list(devices(found)) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        assert found["spec"]["pool"]["generation"] == 2


def slice_requests(agent: Any) -> dict[tuple[str, str], int]:
    """The agent's requests for ResourceSlices, by verb and answer code, as it counts them for /metrics."""
    return {(verb, code): n for (verb, resource, code), n in agent.api_counts.requests.items()
            if resource == "resourceslices"}


async def test_a_check_of_the_slice_costs_one_list(apiserver: ApiServer, dra_kubeconfig: Path) -> None:
    """At start the agent looks for its slice with one LIST (which also finds stale ones) and creates it; a later
    check of a slice nobody changed (a kubelet re-registration, the half-hourly recheck) is that LIST alone."""
    async with dra_agent(apiserver, dra_kubeconfig, "dra-cost", "a100-pcie-nvlink-pairs") as (agent, _):
        assert slice_requests(agent) == {("list", "200"): 1, ("post", "201"): 1}
        assert agent.dra is not None
        agent.dra.slices.published.clear()
        agent.dra.slices.republish()
        await asyncio.wait_for(agent.dra.slices.published.wait(), 10)
        assert slice_requests(agent) == {("list", "200"): 2, ("post", "201"): 1}


async def test_a_restarted_agent_takes_its_unchanged_slice_with_one_list_and_no_write(
        apiserver: ApiServer, dra_kubeconfig: Path) -> None:
    """An agent restarted where its slice is still there as it left it (a DaemonSet rollout on a node whose
    kubelet kept the slice) lists it and writes nothing: the slice keeps its resourceVersion and generation 1,
    and the Node that owns it is read from the slice, not asked for again."""
    def node_gets(agent: Any) -> int:
        return sum(n for (verb, resource, _), n in agent.api_counts.requests.items()
                   if (verb, resource) == ("get", "nodes"))

    try:
        async with dra_agent(apiserver, dra_kubeconfig, "dra-again", "a100-pcie-nvlink-pairs", keep=True) as (
                agent, _):
            assert slice_requests(agent) == {("list", "200"): 1, ("post", "201"): 1}
            assert node_gets(agent) == 1  # the owner's UID, for the new slice
        [before] = await asyncio.to_thread(slices_of, apiserver, "dra-again")
        async with dra_agent(apiserver, dra_kubeconfig, "dra-again", "a100-pcie-nvlink-pairs", keep=True) as (
                agent, _):
            assert slice_requests(agent) == {("list", "200"): 1}
            assert node_gets(agent) == 0
        [after] = await asyncio.to_thread(slices_of, apiserver, "dra-again")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        assert after["spec"]["pool"]["generation"] == 1
    finally:
        await asyncio.to_thread(delete_node, apiserver, "dra-again")
        for stale in await asyncio.to_thread(slices_of, apiserver, "dra-again"):
            await asyncio.to_thread(k8s.CustomObjectsApi(apiserver.admin_client()).delete_cluster_custom_object,
                                    GROUP, VERSION, "resourceslices", stale["metadata"]["name"])


async def test_the_scheduler_keeps_a_two_gpu_claim_on_one_nvlink_pair(
        apiserver: ApiServer, dra_kubeconfig: Path, scheduler: ControlPlane) -> None:
    async with dra_agent(apiserver, dra_kubeconfig, "dra-pairs", "a100-pcie-nvlink-pairs"):
        # One GPU of the first pair is taken; a first-fit allocator would now split GPUs 1 and 2.
        await asyncio.to_thread(create_claim, apiserver, "pairs-gpu0", pinned(0))
        await asyncio.to_thread(create_pod, apiserver, "pairs-one", "pairs-gpu0")
        assert await asyncio.to_thread(allocated, apiserver, "pairs-one") == (
            "dra-pairs", [("gpus", "dra-pairs", "gpu-0")])
        await asyncio.to_thread(create_claim, apiserver, "pairs-pair", ON_ONE_PAIR)
        await asyncio.to_thread(create_pod, apiserver, "pairs-two", "pairs-pair")
        assert await asyncio.to_thread(allocated, apiserver, "pairs-two") == (
            "dra-pairs", [("gpus", "dra-pairs", "gpu-2"), ("gpus", "dra-pairs", "gpu-3")])
        # GPU 1 is free but has no free partner: a second pair claim does not fit.
        await asyncio.to_thread(create_claim, apiserver, "pairs-pair-2", ON_ONE_PAIR)
        await asyncio.to_thread(create_pod, apiserver, "pairs-three", "pairs-pair-2")
        message = await asyncio.to_thread(unschedulable, apiserver, "pairs-three")
        assert "cannot allocate all claims" in message
        claim = await asyncio.to_thread(claim_of_pod, apiserver, "pairs-three")
        assert claim is not None and "allocation" not in (claim.get("status") or {})


async def test_first_available_takes_a_pair_then_one_numa_node(
        apiserver: ApiServer, dra_kubeconfig: Path, scheduler: ControlPlane) -> None:
    async with dra_agent(apiserver, dra_kubeconfig, "dra-loose", LOOSE):
        await asyncio.to_thread(create_template, apiserver, "best-topology", BEST_TOPOLOGY_FIRST)
        await asyncio.to_thread(create_pod, apiserver, "loose-one", template="best-topology")
        assert await asyncio.to_thread(allocated, apiserver, "loose-one") == (
            "dra-loose", [("gpus/pair", "dra-loose", "gpu-0"), ("gpus/pair", "dra-loose", "gpu-1")])
        await asyncio.to_thread(create_pod, apiserver, "loose-two", template="best-topology")
        assert await asyncio.to_thread(allocated, apiserver, "loose-two") == (
            "dra-loose", [("gpus/numa", "dra-loose", "gpu-2"), ("gpus/numa", "dra-loose", "gpu-3")])
        await asyncio.to_thread(create_pod, apiserver, "loose-three", template="best-topology")
        assert "cannot allocate all claims" in await asyncio.to_thread(unschedulable, apiserver, "loose-three")


async def test_first_available_falls_back_to_any_two(
        apiserver: ApiServer, dra_kubeconfig: Path, scheduler: ControlPlane) -> None:
    async with dra_agent(apiserver, dra_kubeconfig, "dra-any", "a100-pcie-nvlink-pairs"):
        # GPUs 1 and 3 are taken: no pair and no NUMA node has two free GPUs.
        await asyncio.to_thread(create_claim, apiserver, "any-held", pinned(1, 3))
        await asyncio.to_thread(create_pod, apiserver, "any-held", "any-held")
        assert await asyncio.to_thread(allocated, apiserver, "any-held") == (
            "dra-any", [("gpus", "dra-any", "gpu-1"), ("gpus", "dra-any", "gpu-3")])
        await asyncio.to_thread(create_claim, apiserver, "any-best", BEST_TOPOLOGY_FIRST)
        await asyncio.to_thread(create_pod, apiserver, "any-best", "any-best")
        assert await asyncio.to_thread(allocated, apiserver, "any-best") == (
            "dra-any", [("gpus/any", "dra-any", "gpu-0"), ("gpus/any", "dra-any", "gpu-2")])


async def test_whole_gpus_leave_the_device_plugin_and_mig_devices_stay(
        apiserver: ApiServer, dra_kubeconfig: Path) -> None:
    root = short_dir()
    kubelet = StandInKubelet(root / "device-plugins")
    (root / "device-plugins").mkdir(parents=True)
    await kubelet.start()
    fake = FakeNvml(load_node("dgx-h100"))
    carve_mig(fake, 7, [("3g.40gb", 0), ("3g.40gb", 4)])
    try:
        async with dra_agent(apiserver, dra_kubeconfig, "dra-mixed", "dgx-h100", root=root, fake=fake,
                             config="flags: {migStrategy: mixed}\n") as (agent, _):
            await kubelet.wait_for({"nvidia.com/mig-3g.40gb"}, 20)
            assert sorted(kubelet.plugins) == ["nvidia.com/mig-3g.40gb"]
            assert len(kubelet.plugins["nvidia.com/mig-3g.40gb"].devices) == 2
            (found,) = await asyncio.to_thread(slices_of, apiserver, "dra-mixed")
            # GPU 7 is in MIG mode: its two MIG devices are in the slice (and still served as mig-3g.40gb).
            names = list(devices(found))
            assert names[:7] == [f"gpu-{i}" for i in range(7)]
            assert sorted(names[7:]) == sorted(f"gpu-7-mig-{m.gpu_instance_id}-{m.compute_instance_id}"
                                               for m in agent.bus.current.inventory.mig_devices)
    finally:
        await kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_the_shipped_domain_template_on_an_nvswitch_box_and_on_bridged_pairs(
        apiserver: ApiServer, dra_kubeconfig: Path, scheduler: ControlPlane) -> None:
    async with dra_agent(apiserver, dra_kubeconfig, "dra-domain", "dgx-h100"):
        await asyncio.to_thread(create_template, apiserver, "domain", ONE_DOMAIN)
        # GPUs 0 and 1 are taken: any two others reach each other through the NVSwitches.
        await asyncio.to_thread(create_claim, apiserver, "domain-held", pinned(0, 1))
        await asyncio.to_thread(create_pod, apiserver, "domain-held", "domain-held")
        await asyncio.to_thread(allocated, apiserver, "domain-held")
        await asyncio.to_thread(create_pod, apiserver, "domain-two", template="domain")
        assert await asyncio.to_thread(allocated, apiserver, "domain-two") == (
            "dra-domain", [("gpus", "dra-domain", "gpu-2"), ("gpus", "dra-domain", "gpu-3")])
    async with dra_agent(apiserver, dra_kubeconfig, "dra-domain-pairs", "a100-pcie-nvlink-pairs"):
        await asyncio.to_thread(create_template, apiserver, "domain", ONE_DOMAIN)
        await asyncio.to_thread(create_claim, apiserver, "domain-gpu1", pinned(1))
        await asyncio.to_thread(create_pod, apiserver, "domain-gpu1", "domain-gpu1")
        await asyncio.to_thread(allocated, apiserver, "domain-gpu1")
        await asyncio.to_thread(create_pod, apiserver, "domain-pair", template="domain")
        assert await asyncio.to_thread(allocated, apiserver, "domain-pair") == (
            "dra-domain-pairs", [("gpus", "dra-domain-pairs", "gpu-2"), ("gpus", "dra-domain-pairs", "gpu-3")])



class NoPods(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources API on a node where no pod holds a device."""

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse()


async def test_a_mig_layout_change_republishes_the_mig_devices(apiserver: ApiServer, dra_kubeconfig: Path) -> None:
    root = short_dir()
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(NoPods(), server)
    server.add_insecure_port(f"unix://{root}/pr.sock")
    await server.start()
    core = k8s.CoreV1Api(apiserver.admin_client())
    try:
        async with dra_agent(apiserver, dra_kubeconfig, "dra-relayout", "dgx-h100", root=root) as (_agent, _):
            (before,) = await asyncio.to_thread(slices_of, apiserver, "dra-relayout")
            assert list(devices(before)) == [f"gpu-{i}" for i in range(8)]
            await asyncio.to_thread(core.patch_node, "dra-relayout",
                                    {"metadata": {"labels": {"nvidia.com/mig.config": "all-3g.40gb"}}})

            async def relaid() -> dict[str, Any]:
                while True:
                    (now,) = await asyncio.to_thread(slices_of, apiserver, "dra-relayout")
                    if len(now["spec"].get("devices") or []) == 16:
                        return now
                    await asyncio.sleep(0.1)

            after = await asyncio.wait_for(relaid(), 30)
            assert {d["attributes"]["profile"]["string"] for d in after["spec"]["devices"]} == {"3g.40gb"}
            assert sorted(d["attributes"]["parentIndex"]["int"] for d in after["spec"]["devices"]) == sorted(
                [i for i in range(8)] * 2)
            assert after["spec"]["pool"]["generation"] > before["spec"]["pool"]["generation"]
            # The slice and the Node are written by two tasks: the MIG state label may follow the slice by a moment.
            await wait_until(lambda: core.read_node("dra-relayout").metadata.labels.get("nvidia.com/mig.config.state")
                             == "success", 10, "the Node's MIG state success", blocking=True)
    finally:
        await server.stop(None)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(("preset", "replicas", "firsts"), [
    ("dgx-h100", 17, [(0, 0), (7, 9)]),  # 136 devices: 128 and 8
    ("hgx-16-nvswitch", 64, [(2 * k, 0) for k in range(8)]),  # 1024 devices: 8 x 128
], ids=["8x17", "16x64"])
async def test_a_node_with_more_devices_than_a_slice_takes_is_published_in_several_and_allocated_from_each(
        apiserver: ApiServer, scheduler: ControlPlane, dra_kubeconfig: Path, preset: str, replicas: int,
        firsts: list[tuple[int, int]]) -> None:
    name = f"dra-many-{replicas}"
    sharing = f"sharing: {{timeSlicing: {{resources: [{{name: nvidia.com/gpu, replicas: {replicas}}}]}}}}\n"
    async with dra_agent(apiserver, dra_kubeconfig, name, preset, config=sharing):
        found = sorted(await asyncio.to_thread(slices_of, apiserver, name), key=lambda s: s["metadata"]["name"])
        main = f"{name}-{DRIVER}"
        count = len(firsts)
        assert [s["metadata"]["name"] for s in found] == sorted([main, *(f"{main}-{i}" for i in range(1, count))])
        assert [(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in found] == [
            (1, count)] * count
        uid = (await asyncio.to_thread(k8s.CoreV1Api(apiserver.admin_client()).read_node, name)).metadata.uid
        assert [s["metadata"]["ownerReferences"] for s in found] == [
            [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid, "controller": True}]] * count
        by_name = {s["metadata"]["name"]: s for s in found}
        ordered = [by_name[main], *(by_name[f"{main}-{i}"] for i in range(1, count))]
        assert [s["spec"]["devices"][0]["name"] for s in ordered] == [f"gpu-{g}-replica-{r}" for g, r in firsts]
        # One claim for the first device of each slice: the scheduler allocates from every one.
        for k, (gpu, replica) in enumerate(firsts):
            expression = (f"device.attributes['{DRIVER}'].index == {gpu} && "
                          f"device.attributes['{DRIVER}'].replica == {replica}")
            await asyncio.to_thread(create_claim, apiserver, f"slice-{k}", {"devices": {"requests": [
                {"name": "share", "exactly": {"deviceClassName": "shared.gpu-node-agent.io",
                                              "selectors": [{"cel": {"expression": expression}}]}}]}})
            await asyncio.to_thread(create_pod, apiserver, f"slice-{k}", f"slice-{k}")
        for k, (gpu, replica) in enumerate(firsts):
            assert await asyncio.to_thread(allocated, apiserver, f"slice-{k}") == (
                name, [("share", name, f"gpu-{gpu}-replica-{replica}")])
