"""A live switch between the device plugin and DRA (docs/dra.md, "Switching a node live") against the rig's
kube-apiserver, with the agent's own ServiceAccount: a config reload turns dra.enabled on and off while a stand-in
kubelet (device plugin registration, and PodResources answering what pods hold) serves the agent. The slice on the
API server leaves out the GPUs the device plugin's pods hold until they end; the device plugin keeps
nvidia.com/gpu registered, with no devices, while they do; going back withdraws the slice and gives the device
plugin every GPU again."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from apiserver import ApiServer
from dra_rig import DRIVER, create_schedulable_node, delete_node, slices_of

from agent.config import parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.dra.claims import ClaimStore, Paths, Prepared
from agent.dra.v1 import api_pb2 as dra_v1
from agent.dra.v1 import api_pb2_grpc as dra_v1_grpc
from agent.handover import POLL_S
from agent.kube.node import NodeApi
from tests.builders import pod_resources
from tests.plugin_harness import running_agent, short_dir, wait_until

NODE = "switch-node"


@pytest.fixture
def folder() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def slice_devices(apiserver: ApiServer) -> list[str] | None:
    """The device names of the node's one slice; None where it has none or several."""
    found = slices_of(apiserver, NODE)
    return [d["name"] for d in found[0]["spec"].get("devices") or []] if len(found) == 1 else None


async def test_a_reload_switches_to_dra_and_back_offering_only_what_pods_do_not_hold(
        apiserver: ApiServer, dra_kubeconfig: Path, folder: Path) -> None:
    socket = folder / "pr.sock"
    common = (f"version: v1\nmig: {{stateDir: {folder}/state, podResourcesSocket: {socket}}}\n"
              f"dra: {{cdiRoot: {folder}/cdi, enabled: ")
    path = folder / "config.yaml"
    path.write_text(common + "false}\n")
    kubelet_dir = folder / "device-plugins"
    kubelet_dir.mkdir(parents=True)
    await asyncio.to_thread(create_schedulable_node, apiserver, NODE)
    try:
        async with pod_resources(socket) as lister:
            api = await NodeApi.connect(dra_kubeconfig, NODE)
            async with running_agent("dgx-h100", parse_config(path.read_text()), kube=api, config_path=path,
                                     directory=kubelet_dir) as rig:
                uuids = [rig.uuid(i) for i in range(8)]
                assert len(rig.devices()) == 8
                assert rig.agent.dra is None  # device-plugin mode: no DRA part made
                lister.pods = {"trainer": {"nvidia.com/gpu": [uuids[2], uuids[5]]}}

                path.write_text(common + "true}\n")
                assert await rig.agent.reload_config()
                wanted = [f"gpu-{i}" for i in (0, 1, 3, 4, 6, 7)]
                await wait_until(lambda: slice_devices(apiserver) == wanted, 20, "the slice without GPUs 2 and 5",
                                 blocking=True)
                # nvidia.com/gpu stays registered, with no devices, and allocates nothing.
                await wait_until(lambda: rig.devices() == [], 5, "nvidia.com/gpu listing no device")
                assert "nvidia.com/gpu" in rig.agent.plugins.plugins
                request = api_pb2.AllocateRequest(container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=[uuids[0]])])
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await rig.stub().Allocate(request)
                assert (refused.value.code(), refused.value.details()) == (
                    grpc.StatusCode.INVALID_ARGUMENT, f"unknown device ID {uuids[0]!r} for resource nvidia.com/gpu")
                assert rig.agent.bus.current.held == {uuids[2], uuids[5]}

                # The trainer ends: its GPUs join the slice, and nvidia.com/gpu is no longer served.
                lister.pods = {}
                await wait_until(lambda: slice_devices(apiserver) == [f"gpu-{i}" for i in range(8)], 20,
                                 "the slice with all eight GPUs", blocking=True)
                await wait_until(lambda: "nvidia.com/gpu" not in rig.agent.plugins.plugins, 5,
                                 "nvidia.com/gpu's plugin stopped")

                # Back: the slices are withdrawn and the device plugin lists every GPU.
                path.write_text(common + "false}\n")
                assert await rig.agent.reload_config()
                await wait_until(lambda: slices_of(apiserver, NODE) == [], 20, "the slice withdrawn", blocking=True)
                await rig.kubelet.wait_for({"nvidia.com/gpu"}, 10)
                await wait_until(lambda: len(rig.devices()) == 8, 10, "eight GPUs through the device plugin")
                switches = [i.message for i in rig.agent.bus.current.incidents if i.kind == "mode-switched"]
                assert switches == ["switching to DRA mode with the pods on the GPUs kept",
                                    "switching to device-plugin mode with the pods on the GPUs kept"]
    finally:
        await asyncio.to_thread(delete_node, apiserver, NODE)


async def test_an_agent_started_in_device_plugin_mode_with_prepared_claims_unprepares_them_and_keeps_their_gpus(
        apiserver: ApiServer, dra_kubeconfig: Path, folder: Path) -> None:
    """Switched back, then restarted: the claim prepared in DRA mode is in the checkpoint. The agent serves its
    unprepare through its DRA plugin, publishes no slice, and keeps the claim's GPU out of the device plugin until
    the kubelet unprepared it."""
    config = parse_config(f"version: v1\nmig: {{stateDir: {folder}/state, podResourcesSocket: {folder}/pr.sock}}\n"
                          f"dra: {{cdiRoot: {folder}/cdi}}\n")
    kubelet_dir = folder / "device-plugins"
    kubelet_dir.mkdir(parents=True)
    paths = Paths.under(folder, DRIVER, folder / "cdi")
    paths.lock.mkdir(parents=True)
    paths.cdi_dir.mkdir(parents=True)
    store = ClaimStore(paths, DRIVER)
    store.put("uid-a", "ml", "train", [Prepared(("gpus",), NODE, "gpu-3", (f"{DRIVER}/gpu=claim-uid-a",))],
              {"cdiVersion": "0.6.0", "kind": f"{DRIVER}/gpu", "devices": []})
    await asyncio.to_thread(create_schedulable_node, apiserver, NODE)
    try:
        api = await NodeApi.connect(dra_kubeconfig, NODE)
        async with running_agent("dgx-h100", config, kube=api, directory=kubelet_dir) as rig:
            uuids = [rig.uuid(i) for i in range(8)]
            assert rig.agent.dra is not None
            assert [d.ID for d in rig.devices()] == [u for i, u in enumerate(uuids) if i != 3]
            assert rig.agent.bus.current.held == {uuids[3]}
            assert paths.registration.is_socket()
            async with grpc.aio.insecure_channel(f"unix://{paths.endpoint}") as channel:
                answer = await dra_v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                    dra_v1.NodeUnprepareResourcesRequest(claims=[dra_v1.Claim(namespace="ml", uid="uid-a",
                                                                              name="train")]), timeout=10)
            assert answer.claims["uid-a"].error == ""
            await wait_until(lambda: len(rig.devices()) == 8, 2 * POLL_S + 1, "GPU 3 back in the device plugin")
            assert slices_of(apiserver, NODE) == []  # device-plugin mode publishes nothing
    finally:
        await asyncio.to_thread(delete_node, apiserver, NODE)
    assert ClaimStore(paths, DRIVER).claims == {}
