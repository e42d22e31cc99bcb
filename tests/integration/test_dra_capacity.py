"""GPU shares by consumable capacity (dra.sharedCapacity) with the real kube-scheduler on the rig's kube-apiserver:
an MPS-shared A100 80GB is one device that claims share by memory and compute; the scheduler packs them on it and
refuses the one that does not fit, and NodePrepareResources makes each claim an MPS client with exactly what it
was allocated. Where the release has DRAConsumableCapacity off (1.35), the GPU is published as its replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from apiserver import ApiServer, wait_until
from dra_rig import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    DRIVER,
    NAMESPACE,
    ControlPlane,
    GatedApiServer,
    allocated,
    claim_of_pod,
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

from agent.dra.v1 import api_pb2 as v1
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from tests.plugin_harness import short_dir
from tests.releases import on_by_default, release_name

NODE = "dra-capacity"
SHARED_CLASS = "shared.gpu-node-agent.io"
# The fake's UUID of GPU 0 of the a100-pcie-nvlink-pairs preset (gpu-agent inspect shows it).
GPU0 = "GPU-faece91d-e63e-4e89-483a-2d2887699a68"
MPS_STAND_IN = Path(__file__).resolve().parents[1] / "mps" / "nvidia-cuda-mps-control"


@pytest.fixture(scope="module")
def scheduler(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    setup_cluster(apiserver)
    with control_plane(apiserver, tmp_path_factory.mktemp("control-plane")) as plane:
        yield plane


@pytest.fixture(scope="module")
def without_capacity(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    """An API server that drops consumable capacity (DRAConsumableCapacity off), whatever its release's default
    (GA in 1.38 but not locked; a release that locks it emulates the last that could turn it off)."""
    with gated_apiserver(tmp_path_factory.mktemp("ungated-apiserver"), "DRAConsumableCapacity=false",
                         release=apiserver.release()) as rig:
        setup_cluster(rig)
        yield rig


def said_by_publisher(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "agent.dra.publisher" and r.levelno == level]


def mps_config(root: Path) -> str:
    """MPS for GPU 0 in 4 replicas, with the stand-in control program as the node's nvidia-cuda-mps-control."""
    driver_root, mps_root = root / "driver", root / "mps"
    (driver_root / "usr" / "bin").mkdir(parents=True)
    shutil.copy(MPS_STAND_IN, driver_root / "usr" / "bin" / "nvidia-cuda-mps-control")
    return (f"flags: {{mpsRoot: {mps_root}, plugin: {{containerDriverRoot: {driver_root}}}}}\n"
            "sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 4, devices: [0]}]}}\n")


def stop_mps_daemons(mps_root: Path) -> None:
    for log in mps_root.glob("*/log/control.log"):
        for line in log.read_text().splitlines():
            if line.startswith("started pid="):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[1].removeprefix("pid=")), signal.SIGKILL)


async def gpu0_published(apiserver: ApiServer, node: str) -> dict[str, dict[str, Any]]:
    """The node's devices once GPU 0 is in its slice (its MPS daemon up), whole or as replicas."""
    while True:
        found = await asyncio.to_thread(slices_of, apiserver, node)
        devices = {d["name"]: d for d in found[0]["spec"]["devices"]} if found else {}
        if "gpu-0" in devices or "gpu-0-replica-0" in devices:
            return devices
        await asyncio.sleep(0.1)


@pytest.fixture
def root() -> Iterator[Path]:
    directory = short_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def share(**capacity: str) -> dict[str, Any]:
    """A claim of one share of an MPS-shared GPU asking for `capacity` (memory, compute)."""
    return {"devices": {"requests": [{"name": "share", "exactly": {
        "deviceClassName": SHARED_CLASS, "capacity": {"requests": capacity}}}]}}


def results_of(apiserver: ApiServer, pod_name: str) -> list[dict[str, Any]]:
    claim = claim_of_pod(apiserver, pod_name)
    assert claim is not None
    return list(claim["status"]["allocation"]["devices"]["results"])


def delete_pod_and_claim(apiserver: ApiServer, name: str) -> None:
    """Delete pod `name` (at once: no kubelet runs it) and then its claim, and wait for both to be gone (the claim
    is deallocated once no pod reserves it)."""
    admin = apiserver.admin_client()
    core, custom = k8s.CoreV1Api(admin), k8s.CustomObjectsApi(admin)
    core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
    custom.delete_namespaced_custom_object("resource.k8s.io", "v1", NAMESPACE, "resourceclaims", name)

    def gone() -> bool:
        try:
            custom.get_namespaced_custom_object("resource.k8s.io", "v1", NAMESPACE, "resourceclaims", name)
        except k8s.ApiException as err:
            return err.status == 404
        return False

    wait_until(gone, 30, f"claim {name} to be deleted")


@pytest.mark.matrix  # 1.35 has DRAConsumableCapacity off: there the fallback is what is checked
async def test_claims_share_an_mps_gpu_by_memory_and_compute_with_exactly_their_limits(
        apiserver: ApiServer, scheduler: ControlPlane, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    caplog.set_level(logging.INFO, logger="agent.dra.publisher")
    config, mps_root = mps_config(root), root / "mps"
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    release = apiserver.release()
    capacity = on_by_default("DRAConsumableCapacity", release)
    print(f"Kubernetes {release_name(release)}: DRAConsumableCapacity {'on' if capacity else 'off'} by default")
    try:
        async with dra_agent(apiserver, kubeconfig, NODE, "a100-pcie-nvlink-pairs", root=root, config=config,
                             dra=", sharedCapacity: {enabled: true}"):
            devices = await asyncio.wait_for(gpu0_published(apiserver, NODE), 15)
            if not capacity:  # the API server drops consumable capacity: the GPU's replicas, as without the key
                assert list(devices) == [*(f"gpu-0-replica-{n}" for n in range(4)), "gpu-1", "gpu-2", "gpu-3"]
                return
            assert list(devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
            assert "the API server keeps consumable capacity (DRAConsumableCapacity): each GPU that MPS shares is " \
                   "one device that claims share by memory and compute" in said_by_publisher(caplog, logging.INFO)
            assert devices["gpu-0"]["allowMultipleAllocations"] is True
            assert devices["gpu-0"]["capacity"] == {
                "memory": {"value": "80Gi", "requestPolicy": {"default": "80Gi",
                                                              "validRange": {"min": "1Gi", "step": "1Gi"}}},
                "compute": {"value": "100", "requestPolicy": {"default": "0",
                                                              "validRange": {"min": "0", "step": "1"}}}}

            # Four claims of 20Gi fill the A100's 80Gi: all on gpu-0, each with a share of its own.
            for n in range(1, 5):
                await asyncio.to_thread(create_claim, apiserver, f"mem-{n}", share(memory="20Gi"))
                await asyncio.to_thread(create_pod, apiserver, f"mem-{n}", f"mem-{n}")
                assert await asyncio.to_thread(allocated, apiserver, f"mem-{n}") == (
                    NODE, [("share", NODE, "gpu-0")])
            results = {n: (await asyncio.to_thread(results_of, apiserver, f"mem-{n}"))[0] for n in range(1, 5)}
            assert {n: r["consumedCapacity"] for n, r in results.items()} == {
                n: {"memory": "20Gi", "compute": "0"} for n in range(1, 5)}
            assert len({r["shareID"] for r in results.values()}) == 4

            # A fifth does not fit: its pod stays pending.
            await asyncio.to_thread(create_claim, apiserver, "mem-5", share(memory="20Gi"))
            await asyncio.to_thread(create_pod, apiserver, "mem-5", "mem-5")
            await asyncio.to_thread(unschedulable, apiserver, "mem-5")
            fifth = await asyncio.to_thread(claim_of_pod, apiserver, "mem-5")
            assert fifth is not None and not (fifth.get("status") or {}).get("allocation")

            claims = {n: await asyncio.to_thread(claim_of_pod, apiserver, f"mem-{n}") for n in range(1, 5)}
            uids = {n: c["metadata"]["uid"] for n, c in claims.items() if c is not None}
            async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
                stub = v1_grpc.DRAPluginStub(channel)
                answer = await stub.NodePrepareResources(v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace=NAMESPACE, uid=uids[n], name=f"mem-{n}") for n in uids]), timeout=10)
                assert {n: answer.claims[uid].error for n, uid in uids.items()} == {n: "" for n in uids}
                options = ["rbind", "rw"]
                mounts = [
                    {"hostPath": str(mps_root / GPU0 / "pipe"), "containerPath": "/mps/pipe", "options": options},
                    {"hostPath": str(mps_root / GPU0 / "log"), "containerPath": "/mps/log", "options": options},
                    {"hostPath": str(mps_root / "shm"), "containerPath": "/dev/shm", "options": options}]
                for uid in uids.values():
                    spec = json.loads((root / "cdi" / f"{DRIVER}-claim-{uid}.json").read_text())
                    assert spec["devices"][-1]["containerEdits"] == {
                        "env": [f"NVIDIA_VISIBLE_DEVICES={GPU0}", "CUDA_MPS_PIPE_DIRECTORY=/mps/pipe",
                                # No compute asked for: all the threads, over the daemon's default of 100/4.
                                "CUDA_MPS_LOG_DIRECTORY=/mps/log", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100",
                                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"],  # 20Gi
                        "mounts": mounts}

                # The first claim ends: unprepared, its CDI spec gone, its memory free for a claim that asks for
                # compute. The pending fifth is removed first, so that it does not take the room.
                await asyncio.to_thread(delete_pod_and_claim, apiserver, "mem-5")
                gone = await stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(
                    claims=[v1.Claim(namespace=NAMESPACE, uid=uids[1], name="mem-1")]), timeout=10)
                assert gone.claims[uids[1]].error == ""
                assert not (root / "cdi" / f"{DRIVER}-claim-{uids[1]}.json").exists()
                await asyncio.to_thread(delete_pod_and_claim, apiserver, "mem-1")

                # 15000Mi is rounded up to the next step, 15Gi; compute 25 (percent of the SMs).
                await asyncio.to_thread(create_claim, apiserver, "compute", share(memory="15000Mi", compute="25"))
                await asyncio.to_thread(create_pod, apiserver, "compute", "compute")
                assert await asyncio.to_thread(allocated, apiserver, "compute") == (NODE, [("share", NODE, "gpu-0")])
                (result,) = await asyncio.to_thread(results_of, apiserver, "compute")
                assert result["consumedCapacity"] == {"memory": "15Gi", "compute": "25"}
                claim = await asyncio.to_thread(claim_of_pod, apiserver, "compute")
                assert claim is not None
                uid = claim["metadata"]["uid"]
                answer = await stub.NodePrepareResources(v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace=NAMESPACE, uid=uid, name="compute")]), timeout=10)
                assert answer.claims[uid].error == ""
                spec = json.loads((root / "cdi" / f"{DRIVER}-claim-{uid}.json").read_text())
                assert spec["devices"][-1]["containerEdits"]["env"] == [
                    f"NVIDIA_VISIBLE_DEVICES={GPU0}", "CUDA_MPS_PIPE_DIRECTORY=/mps/pipe",
                    "CUDA_MPS_LOG_DIRECTORY=/mps/log", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=15360M"]
    finally:
        stop_mps_daemons(mps_root)


async def test_where_the_api_server_drops_capacity_the_gpu_is_published_as_its_replicas(
        without_capacity: GatedApiServer, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    apiserver = without_capacity
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    caplog.set_level(logging.INFO, logger="agent.dra.publisher")
    try:
        async with dra_agent(apiserver, kubeconfig, "dra-no-capacity", "a100-pcie-nvlink-pairs", root=root,
                             config=mps_config(root), dra=", sharedCapacity: {enabled: true}"):
            devices = await asyncio.wait_for(gpu0_published(apiserver, "dra-no-capacity"), 15)
            assert list(devices) == [*(f"gpu-0-replica-{n}" for n in range(4)), "gpu-1", "gpu-2", "gpu-3"]
            assert [d.get("allowMultipleAllocations") for d in devices.values()] == [None] * 7
            assert said_by_publisher(caplog, logging.WARNING) == [
                "the API server drops the consumable capacity of gpu-0 (the DRAConsumableCapacity feature gate is "
                "off): dra.sharedCapacity is off until the agent restarts; GPUs that MPS shares are published as "
                "their replicas"]
    finally:
        stop_mps_daemons(root / "mps")
