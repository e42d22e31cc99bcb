"""Unhealthy GPUs in DRA mode, against the real kube-apiserver: where the DRADeviceTaints feature gate is off
(by default up to 1.35; turned off by hand on 1.36 and 1.37, and on 1.38, which locked it on, by emulating 1.37
with --emulated-version) the API server drops device taints, so the agent
withdraws unhealthy devices from its ResourceSlice; where it is on (by default from 1.36; turned on by hand on
1.35, with the real kube-scheduler gated the same way) they stay in with a taint the scheduler honours. Either way
a recovered GPU comes back without a restart. The kubelet's health stream (DRAResourceHealth/NodeWatchResources
on the DRA plugin socket, v1alpha1 and v1) reports the change too."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from apiserver import ApiServer
from dra_rig import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    DEVICE_CLASS,
    ControlPlane,
    GatedApiServer,
    allocated,
    control_plane,
    create_claim,
    create_pod,
    dra_agent,
    gated_apiserver,
    setup_cluster,
    slices_of,
    unschedulable,
)
from kubernetes import client as k8s

from agent.dra.health_v1 import api_pb2 as health_v1
from agent.dra.health_v1 import api_pb2_grpc as health_v1_grpc
from agent.dra.health_v1alpha1 import api_pb2 as health
from agent.dra.health_v1alpha1 import api_pb2_grpc as health_grpc
from tests.plugin_harness import short_dir
from tests.releases import on_by_default, release_name

pytestmark = pytest.mark.matrix  # what the API server does here depends on its release

GATES = "DRADeviceTaints=true"
UNGATED = "DRADeviceTaints=false,DRADeviceTaintRules=false"  # locked on from 1.38: there the server emulates 1.37


@pytest.fixture(scope="module")
def tainting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    """An API server that keeps device taints (DRADeviceTaints on; DeviceTaintRules, which the gated
    scheduler watches, served)."""
    with gated_apiserver(tmp_path_factory.mktemp("gated-apiserver"), GATES,
                         runtime_config="resource.k8s.io/v1alpha3=true") as rig:
        setup_cluster(rig)
        yield rig


@pytest.fixture(scope="module")
def untainting(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    """An API server that drops device taints (DRADeviceTaints off), whatever its release's default; where the
    release locked the gates on (1.38), emulating the last release that could turn them off (1.37)."""
    with gated_apiserver(tmp_path_factory.mktemp("ungated-apiserver"), UNGATED, release=apiserver.release()) as rig:
        setup_cluster(rig)
        yield rig


@pytest.fixture(scope="module")
def gated_scheduler(tainting: GatedApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane(tainting, tmp_path_factory.mktemp("gated-control-plane"), GATES) as plane:
        yield plane


def devices(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in found["spec"].get("devices") or []}


async def slice_when(apiserver: ApiServer, node: str, check: Any, timeout: float = 10.0) -> dict[str, Any]:
    """The node's slice once `check(devices)` holds."""
    async def poll() -> dict[str, Any]:
        while True:
            found = await asyncio.to_thread(slices_of, apiserver, node)
            if found and check(devices(found[0])):
                return found[0]
            await asyncio.sleep(0.1)
    return await asyncio.wait_for(poll(), timeout)


def said_by_publisher(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The slice publisher's warnings."""
    return [r.getMessage() for r in caplog.records if r.name == "agent.dra.publisher" and r.levelno >= logging.WARNING]


ALL_FOUR = {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 4}}]}}


async def test_without_the_gate_an_unhealthy_gpu_is_withdrawn_and_comes_back(
        untainting: GatedApiServer, caplog: pytest.LogCaptureFixture) -> None:
    apiserver = untainting
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    caplog.set_level(logging.INFO, logger="agent.dra.publisher")
    async with dra_agent(apiserver, kubeconfig, "dra-ungated", "a100-pcie-nvlink-pairs") as (agent, fake):
        mode = agent.metrics.registry.get_sample_value
        assert mode("gpu_agent_dra_health_mode", {"mode": "withdrawal"}) is None  # not decided before a fault
        fake.inject_xid(3, 48)  # a double-bit ECC error: unhealthy
        now = await slice_when(apiserver, "dra-ungated", lambda d: "gpu-3" not in d)
        assert (mode("gpu_agent_dra_health_mode", {"mode": "withdrawal"}),
                mode("gpu_agent_dra_health_mode", {"mode": "taints"})) == (1.0, 0.0)
        assert list(devices(now)) == ["gpu-0", "gpu-1", "gpu-2"]
        # The dry run found the taint dropped: no write published GPU 3 untainted.
        assert now["spec"]["pool"]["generation"] == 2
        assert [d.get("taints") for d in devices(now).values()] == [None, None, None]
        dropped = ("the API server drops the device taints of gpu-3 (the DRADeviceTaints feature gate is off): "
                   "unhealthy devices are withdrawn from ResourceSlice dra-ungated-gpu.gpu-node-agent.io instead")
        assert said_by_publisher(caplog) == [dropped]

        fake.reset_gpu(3)  # clears the volatile ECC count: the GPU recovers
        back = await slice_when(apiserver, "dra-ungated", lambda d: "gpu-3" in d)
        assert list(devices(back)) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        assert "taints" not in devices(back)["gpu-3"]

        # Decided once: the next fault is withdrawn at once, without another dry run or another warning.
        fake.inject_xid(1, 48)
        again = await slice_when(apiserver, "dra-ungated", lambda d: "gpu-1" not in d)
        assert list(devices(again)) == ["gpu-0", "gpu-2", "gpu-3"]
        assert again["spec"]["pool"]["generation"] == 4
        assert said_by_publisher(caplog) == [dropped]


async def test_with_the_releases_defaults_the_agent_taints_from_1_36_and_withdraws_before(
        apiserver: ApiServer, caplog: pytest.LogCaptureFixture) -> None:
    """What a user of each release gets without touching a gate: the rig's API server as the release ships it."""
    setup_cluster(apiserver)
    release = apiserver.release()
    taints = on_by_default("DRADeviceTaints", release)
    print(f"Kubernetes {release_name(release)}: DRADeviceTaints {'on' if taints else 'off'} by default")
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    caplog.set_level(logging.INFO, logger="agent.dra.publisher")
    async with dra_agent(apiserver, kubeconfig, "dra-default", "a100-pcie-nvlink-pairs") as (agent, fake):
        mode = agent.metrics.registry.get_sample_value
        fake.inject_xid(2, 48)
        if taints:
            now = await slice_when(apiserver, "dra-default", lambda d: "taints" in d.get("gpu-2", {}))
            assert list(devices(now)) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
            assert [(t["key"], t["value"], t["effect"]) for t in devices(now)["gpu-2"]["taints"]] == [
                ("gpu.gpu-node-agent.io/unhealthy", "xid-48", "NoSchedule")]
            assert (mode("gpu_agent_dra_health_mode", {"mode": "taints"}),
                    mode("gpu_agent_dra_health_mode", {"mode": "withdrawal"})) == (1.0, 0.0)
            assert said_by_publisher(caplog) == []
        else:
            now = await slice_when(apiserver, "dra-default", lambda d: "gpu-2" not in d)
            assert list(devices(now)) == ["gpu-0", "gpu-1", "gpu-3"]
            assert (mode("gpu_agent_dra_health_mode", {"mode": "taints"}),
                    mode("gpu_agent_dra_health_mode", {"mode": "withdrawal"})) == (0.0, 1.0)
        assert now["spec"]["pool"]["generation"] == 2
        fake.reset_gpu(2)
        back = await slice_when(apiserver, "dra-default",
                                lambda d: "gpu-2" in d and "taints" not in d["gpu-2"])
        assert list(devices(back)) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        assert back["spec"]["pool"]["generation"] == 3


async def test_with_the_gate_an_unhealthy_gpu_is_tainted_the_scheduler_avoids_it_and_recovery_lifts_it(
        tainting: GatedApiServer, gated_scheduler: ControlPlane, caplog: pytest.LogCaptureFixture) -> None:
    kubeconfig = tainting.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    caplog.set_level(logging.INFO, logger="agent.dra.publisher")
    # An XID's fault ends after the clean samples (30 x 0.1 s here): long enough for the scheduler to try the pod
    # below while GPU 3 is still tainted.
    async with dra_agent(tainting, kubeconfig, "dra-gated", "a100-pcie-nvlink-pairs",
                         recovery_checks=30) as (agent, fake):
        first = (await asyncio.to_thread(slices_of, tainting, "dra-gated"))[0]["spec"]["pool"]["generation"]
        fake.inject_xid(3, 48)
        now = await slice_when(tainting, "dra-gated", lambda d: "taints" in d.get("gpu-3", {}))
        assert list(devices(now)) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        (taint,) = devices(now)["gpu-3"]["taints"]
        assert {k: taint[k] for k in ("key", "value", "effect")} == {
            "key": "gpu.gpu-node-agent.io/unhealthy", "value": "xid-48", "effect": "NoSchedule"}
        assert taint["timeAdded"]  # set by the API server: the field was kept
        assert [d.get("taints") for n, d in devices(now).items() if n != "gpu-3"] == [None, None, None]
        assert said_by_publisher(caplog) == []
        mode = agent.metrics.registry.get_sample_value
        assert (mode("gpu_agent_dra_health_mode", {"mode": "taints"}),
                mode("gpu_agent_dra_health_mode", {"mode": "withdrawal"})) == (1.0, 0.0)
        assert "the API server keeps device taints (DRADeviceTaints): unhealthy devices stay in ResourceSlice " \
               "dra-gated-gpu.gpu-node-agent.io with the taint gpu.gpu-node-agent.io/unhealthy" in caplog.messages
        assert now["spec"]["pool"]["generation"] == first + 1

        # The gated scheduler does not hand out a tainted device: four GPUs cannot be had while GPU 3 is tainted.
        await asyncio.to_thread(create_claim, tainting, "four", ALL_FOUR)
        await asyncio.to_thread(create_pod, tainting, "four", "four")
        assert "cannot allocate all claims" in await asyncio.to_thread(unschedulable, tainting, "four")

        fake.reset_gpu(3)
        back = await slice_when(tainting, "dra-gated", lambda d: "taints" not in d.get("gpu-3", {"taints": 1}))
        assert [d.get("taints") for d in devices(back).values()] == [None, None, None, None]
        assert await asyncio.to_thread(allocated, tainting, "four") == (
            "dra-gated", [("gpus", "dra-gated", f"gpu-{i}") for i in range(4)])


async def test_a_cordoned_gpu_leaves_the_slice_within_2_s_also_where_unhealthy_ones_are_tainted(
        tainting: GatedApiServer) -> None:
    """An operator's cordon is not a fault: where the API server keeps device taints the GPU is still left out of
    the slice (not tainted), within 2 s of the annotation, and back within 2 s of its removal."""
    kubeconfig = tainting.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    core = k8s.CoreV1Api(tainting.admin_client())
    async with dra_agent(tainting, kubeconfig, "dra-cordon", "a100-pcie-nvlink-pairs"):
        await asyncio.to_thread(core.patch_node, "dra-cordon",
                                {"metadata": {"annotations": {"gpu-node-agent.io/cordon": "1,2"}}})
        now = await slice_when(tainting, "dra-cordon", lambda d: list(d) == ["gpu-0", "gpu-3"], timeout=2)
        assert [d.get("taints") for d in devices(now).values()] == [None, None]
        await asyncio.to_thread(core.patch_node, "dra-cordon",
                                {"metadata": {"annotations": {"gpu-node-agent.io/cordon": None}}})
        await slice_when(tainting, "dra-cordon", lambda d: list(d) == [f"gpu-{i}" for i in range(4)], timeout=2)


async def test_with_the_gate_a_node_fatal_fault_taints_no_execute(
        tainting: GatedApiServer) -> None:
    kubeconfig = tainting.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    async with dra_agent(tainting, kubeconfig, "dra-lost", "a100-pcie-nvlink-pairs") as (_, fake):
        fake.set_gpu_lost(1)
        now = await slice_when(tainting, "dra-lost", lambda d: "taints" in d.get("gpu-1", {}))
        (taint,) = devices(now)["gpu-1"]["taints"]
        assert (taint["key"], taint["value"], taint["effect"]) == (
            "gpu.gpu-node-agent.io/unhealthy", "gpu-is-lost-fallen-off-the-bus", "NoExecute")
        fake.set_gpu_lost(1, False)
        await slice_when(tainting, "dra-lost", lambda d: "gpu-1" in d and "taints" not in d["gpu-1"])


async def test_the_health_stream_reports_every_device_and_follows_an_xid_and_the_recovery(
        apiserver: ApiServer) -> None:
    setup_cluster(apiserver)
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    root = short_dir()
    try:
        async with dra_agent(apiserver, kubeconfig, "dra-stream", "a100-pcie-nvlink-pairs", root=root) as (_, fake):
            endpoint = root / "plugins" / "gpu.gpu-node-agent.io" / "dra.sock"
            async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
                # What the kubelet calls when ResourceHealthStatus is on: one stream, kept open.
                stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                    health.NodeWatchResourcesRequest())

                times: dict[str, int] = {}

                async def next_report(previous: list[tuple[str, str, int]] | None) -> list[tuple[str, str, int]]:
                    while True:
                        answer = await asyncio.wait_for(stream.read(), 5)
                        assert isinstance(answer, health.NodeWatchResourcesResponse)
                        report = [(d.device.pool_name, d.device.device_name, d.health) for d in answer.devices]
                        times.update({d.device.device_name: d.last_updated_time for d in answer.devices})
                        if report != previous:
                            return report

                first = await next_report(None)
                assert first == [("dra-stream", f"gpu-{i}", health.HEALTHY) for i in range(4)]

                before = int(time.time())
                fake.inject_xid(2, 48)
                second = await next_report(first)
                assert second == [("dra-stream", "gpu-0", health.HEALTHY), ("dra-stream", "gpu-1", health.HEALTHY),
                                  ("dra-stream", "gpu-2", health.UNHEALTHY), ("dra-stream", "gpu-3", health.HEALTHY)]
                assert before <= times["gpu-2"] <= int(time.time())  # when it became unhealthy

                fake.reset_gpu(2)
                assert await next_report(second) == first
                stream.cancel()

                # The same stream on v1, the service a 1.37 kubelet prefers (the plugin lists both).
                v1_stream = health_v1_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                    health_v1.NodeWatchResourcesRequest())
                answer = await asyncio.wait_for(v1_stream.read(), 5)
                assert isinstance(answer, health_v1.NodeWatchResourcesResponse)
                assert [(d.device.pool_name, d.device.device_name, d.health) for d in answer.devices] == [
                    ("dra-stream", f"gpu-{i}", health_v1.HEALTHY) for i in range(4)]
                v1_stream.cancel()
    finally:
        shutil.rmtree(root, ignore_errors=True)
