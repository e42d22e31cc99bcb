"""The agent's kubelet plugin in DRA mode, over real unix sockets, called as the kubelet calls it: registration
(GetInfo, NotifyRegistrationStatus) and the DRA service (v1 and v1beta1), with the claims allocated by the
real kube-scheduler on the rig's kube-apiserver; prepared claims survive a restart of the agent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from apiserver import ApiServer, wait_until
from dra_rig import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    DEVICE_CLASS,
    DRIVER,
    NAMESPACE,
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
    remove_workloads,
    setup_cluster,
    shipped,
    slices_of,
    unschedulable,
)
from kubernetes import client as k8s

from agent.dra.pluginregistration import api_pb2 as reg
from agent.dra.pluginregistration import api_pb2_grpc as reg_grpc
from agent.dra.v1 import api_pb2 as v1
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.dra.v1beta1 import api_pb2 as v1beta1
from agent.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from tests.plugin_harness import carve_mig, short_dir
from tests.plugin_harness import wait_until as until

NODE = "dra-kubelet"
# The fake's UUIDs of GPUs 0 and 1 of the a100-pcie-nvlink-pairs preset (gpu-agent inspect shows them).
GPU0 = "GPU-faece91d-e63e-4e89-483a-2d2887699a68"
GPU1 = "GPU-e82f0889-5f7f-04e5-28bc-e0ef65580f97"
ON_ONE_PAIR = {"devices": {
    "requests": [{"name": "gpus", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 2}}],
    "constraints": [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkPair"}]}}


@pytest.fixture(scope="module")
def scheduler(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    setup_cluster(apiserver)
    with control_plane(apiserver, tmp_path_factory.mktemp("control-plane")) as plane:
        yield plane


@pytest.fixture
def root() -> Iterator[Path]:
    directory = short_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def devices_of(response: v1.NodePrepareResourceResponse | v1beta1.NodePrepareResourceResponse
               ) -> list[tuple[list[str], str, str, list[str]]]:
    return [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in response.devices]


async def test_registration_prepare_unprepare_and_a_restart_in_between(
        apiserver: ApiServer, scheduler: ControlPlane, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    registration = root / "plugins_registry" / f"{DRIVER}-reg.sock"
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    spec_file = root / "cdi"
    custom = k8s.CustomObjectsApi(apiserver.admin_client())
    try:
        async with dra_agent(apiserver, kubeconfig, NODE, "a100-pcie-nvlink-pairs", root=root, keep=True):
            async with grpc.aio.insecure_channel(f"unix://{registration}") as channel:
                info = await reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)
                assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                    "DRAPlugin", DRIVER, str(endpoint),
                    ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
                # The kubelet deletes the driver's slices when it registers; the agent writes its slice again.
                await asyncio.to_thread(custom.delete_cluster_custom_object, "resource.k8s.io", "v1",
                                        "resourceslices", f"{NODE}-{DRIVER}")
                await reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=True), timeout=5)

            async def back() -> list[str]:
                while not (items := await asyncio.to_thread(slices_of, apiserver, NODE)):
                    await asyncio.sleep(0.1)
                return [d["name"] for d in items[0]["spec"]["devices"]]

            assert await asyncio.wait_for(back(), 10) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]

            await asyncio.to_thread(create_claim, apiserver, "train", ON_ONE_PAIR)
            await asyncio.to_thread(create_pod, apiserver, "train", "train")
            assert await asyncio.to_thread(allocated, apiserver, "train") == (
                NODE, [("gpus", NODE, "gpu-0"), ("gpus", NODE, "gpu-1")])
            claim = await asyncio.to_thread(claim_of_pod, apiserver, "train")
            assert claim is not None
            uid = claim["metadata"]["uid"]
            await asyncio.to_thread(create_claim, apiserver, "idle", ON_ONE_PAIR)  # never allocated
            idle = await asyncio.to_thread(custom.get_namespaced_custom_object, "resource.k8s.io", "v1",
                                           NAMESPACE, "resourceclaims", "idle")

            async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
                stub = v1_grpc.DRAPluginStub(channel)
                request = v1.NodePrepareResourcesRequest(claims=[
                    v1.Claim(namespace=NAMESPACE, uid=uid, name="train"),
                    v1.Claim(namespace=NAMESPACE, uid=idle["metadata"]["uid"], name="idle"),
                    v1.Claim(namespace=NAMESPACE, uid="0000-wrong", name="train"),
                ])
                answer = await stub.NodePrepareResources(request, timeout=10)
                kind = f"{DRIVER}/gpu"
                expected = [
                    (["gpus"], NODE, "gpu-0", [f"{kind}=claim-{uid}-gpu-0", f"{kind}=claim-{uid}"]),
                    (["gpus"], NODE, "gpu-1", [f"{kind}=claim-{uid}-gpu-1", f"{kind}=claim-{uid}"]),
                ]
                assert answer.claims[uid].error == ""
                assert devices_of(answer.claims[uid]) == expected
                assert answer.claims[idle["metadata"]["uid"]].error == f"claim {NAMESPACE}/idle: not allocated"
                assert answer.claims["0000-wrong"].error == (
                    f"claim {NAMESPACE}/train: the API server has UID {uid}, the kubelet asked for 0000-wrong")
                # Each refusal is in the agent's log too, not only in the kubelet's.
                assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                        and r.name == "agent.dra.plugin"] == [
                    f"cannot prepare claim {NAMESPACE}/idle ({idle['metadata']['uid']}): claim {NAMESPACE}/idle: "
                    "not allocated",
                    f"cannot prepare claim {NAMESPACE}/train (0000-wrong): claim {NAMESPACE}/train: the API server "
                    f"has UID {uid}, the kubelet asked for 0000-wrong"]
                written = spec_file / f"{DRIVER}-claim-{uid}.json"
                assert json.loads(written.read_text()) == {
                    "cdiVersion": "0.6.0", "kind": kind, "devices": [
                        {"name": f"claim-{uid}-gpu-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
                        {"name": f"claim-{uid}-gpu-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}},
                        # This machine has no /dev/nvidiactl or /dev/nvidia-uvm: no control device nodes.
                        {"name": f"claim-{uid}", "containerEdits": {"env": [f"NVIDIA_VISIBLE_DEVICES={GPU0},{GPU1}"]}},
                    ]}
                stamp = os.stat(written).st_mtime_ns
                # Again: the same answer, nothing written.
                again = await stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=NAMESPACE, uid=uid, name="train")]),
                    timeout=10)
                assert devices_of(again.claims[uid]) == expected
                assert os.stat(written).st_mtime_ns == stamp

        # The agent restarts between Prepare and Unprepare, and the claim is deleted from the API server.
        await asyncio.to_thread(remove_workloads, apiserver)
        async with (dra_agent(apiserver, kubeconfig, NODE, "a100-pcie-nvlink-pairs", root=root, keep=True),
                    grpc.aio.insecure_channel(f"unix://{endpoint}") as channel):
            stub_beta = v1beta1_grpc.DRAPluginStub(channel)
            prepared = await stub_beta.NodePrepareResources(v1beta1.NodePrepareResourcesRequest(
                claims=[v1beta1.Claim(namespace=NAMESPACE, uid=uid, name="train")]), timeout=10)
            assert devices_of(prepared.claims[uid]) == expected
            assert written.exists()
            gone = await stub_beta.NodeUnprepareResources(v1beta1.NodeUnprepareResourcesRequest(
                claims=[v1beta1.Claim(namespace=NAMESPACE, uid=uid, name="train")]), timeout=10)
            assert gone.claims[uid].error == ""
            assert not written.exists()
            checkpoint = json.loads((root / "plugins" / DRIVER / "checkpoint.json").read_text())
            assert checkpoint == {"version": 2, "claims": {},  # the SHA-256 of "{}"
                                  "checksum": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}
            # Unprepared already: still a success.
            twice = await v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[v1.Claim(namespace=NAMESPACE, uid=uid, name="train")]),
                timeout=10)
            assert twice.claims[uid].error == ""
        assert not registration.exists() and not endpoint.exists()
    finally:
        await asyncio.to_thread(remove_workloads, apiserver)
        await asyncio.to_thread(delete_node, apiserver, NODE)


async def test_a_mig_device_claim_is_allocated_and_prepared(
        apiserver: ApiServer, scheduler: ControlPlane, root: Path) -> None:
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    fake = FakeNvml(load_node("dgx-h100"))
    carve_mig(fake, 7, [("3g.40gb", 0), ("3g.40gb", 4)])
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    async with dra_agent(apiserver, kubeconfig, "dra-mig", "dgx-h100", root=root, fake=fake) as (agent, _):
        migs = {m.placement_start: m for m in agent.backend.inventory().mig_devices}
        first = f"gpu-7-mig-{migs[0].gpu_instance_id}-{migs[0].compute_instance_id}"
        await asyncio.to_thread(create_template, apiserver, "one-mig", example("one-mig-3g-40gb.yaml"))
        await asyncio.to_thread(create_pod, apiserver, "mig-one", template="one-mig")
        assert await asyncio.to_thread(allocated, apiserver, "mig-one") == ("dra-mig", [("mig", "dra-mig", first)])
        # Whole-GPU claims never get a MIG device, and MIG claims never a whole GPU: 7 GPUs and 2 MIG devices.
        await asyncio.to_thread(create_claim, apiserver, "seven", {"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 7}}]}})
        await asyncio.to_thread(create_pod, apiserver, "seven", "seven")
        assert [d for _, _, d in (await asyncio.to_thread(allocated, apiserver, "seven"))[1]] == [
            f"gpu-{i}" for i in range(7)]
        claim = await asyncio.to_thread(claim_of_pod, apiserver, "mig-one")
        assert claim is not None
        uid = claim["metadata"]["uid"]
        async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
            answer = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(v1.NodePrepareResourcesRequest(
                claims=[v1.Claim(namespace=NAMESPACE, uid=uid, name=claim["metadata"]["name"])]), timeout=10)
        kind = f"{DRIVER}/gpu"
        assert answer.claims[uid].error == ""
        assert devices_of(answer.claims[uid]) == [
            (["mig"], "dra-mig", first, [f"{kind}=claim-{uid}-{first}", f"{kind}=claim-{uid}"])]
        spec = json.loads((root / "cdi" / f"{DRIVER}-claim-{uid}.json").read_text())
        assert spec["devices"] == [
            {"name": f"claim-{uid}-{first}", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia7"}]}},
            {"name": f"claim-{uid}", "containerEdits": {"env": [f"NVIDIA_VISIBLE_DEVICES={migs[0].uuid}"]}},
        ]


ENV_CLASS = "gpu-env.gpu-node-agent.io"


def gpu_config(**env: str) -> dict[str, object]:
    return {"driver": DRIVER, "parameters": {"apiVersion": f"{DRIVER}/v1", "kind": "GpuConfig", "env": env}}


async def test_opaque_config_of_the_class_and_the_claim_reaches_the_containers_and_a_bad_one_is_refused(
        apiserver: ApiServer, scheduler: ControlPlane, root: Path) -> None:
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    custom = k8s.CustomObjectsApi(apiserver.admin_client())
    (whole_gpus,) = [c for c in shipped("deviceclass.yaml") if c["metadata"]["name"] == DEVICE_CLASS]
    await asyncio.to_thread(custom.create_cluster_custom_object, "resource.k8s.io", "v1", "deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": ENV_CLASS},
        "spec": {**whole_gpus["spec"], "config": [{"opaque": gpu_config(MODE="class", FROM_CLASS="1")}]}})
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    try:
        async with dra_agent(apiserver, kubeconfig, "dra-config", "a100-pcie-nvlink-pairs", root=root):
            await asyncio.to_thread(create_claim, apiserver, "tuned", {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": ENV_CLASS, "count": 1}}],
                "config": [{"requests": ["gpu"], "opaque": gpu_config(MODE="claim")}]}})
            await asyncio.to_thread(create_claim, apiserver, "wrong", {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": ENV_CLASS, "count": 1}}],
                "config": [{"opaque": {"driver": DRIVER, "parameters": {
                    "apiVersion": f"{DRIVER}/v1", "kind": "MpsConfig"}}}]}})
            # The shipped template: the shipped class has no config of its own.
            await asyncio.to_thread(create_template, apiserver, "with-env", example("one-gpu-with-env.yaml"))
            await asyncio.to_thread(create_pod, apiserver, "tuned", "tuned")
            await asyncio.to_thread(create_pod, apiserver, "wrong", "wrong")
            await asyncio.to_thread(create_pod, apiserver, "with-env", template="with-env")
            claims = {}
            for pod_name in ("tuned", "wrong", "with-env"):
                await asyncio.to_thread(allocated, apiserver, pod_name)
                claims[pod_name] = await asyncio.to_thread(claim_of_pod, apiserver, pod_name)
            uids = {name: c["metadata"]["uid"] for name, c in claims.items()}
            async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
                answer = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace=NAMESPACE, uid=uids[n], name=claims[n]["metadata"]["name"])
                            for n in claims]), timeout=10)
            assert answer.claims[uids["tuned"]].error == ""
            assert answer.claims[uids["with-env"]].error == ""
            assert answer.claims[uids["wrong"]].error == (
                f"claim {NAMESPACE}/wrong: the claim's config[0]: unknown configuration apiVersion "
                f"'{DRIVER}/v1' kind 'MpsConfig' (this driver reads apiVersion '{DRIVER}/v1' kind 'GpuConfig')")
            assert not (root / "cdi" / f"{DRIVER}-claim-{uids['wrong']}.json").exists()

            def gpu_env(pod_name: str) -> list[str]:
                spec = json.loads((root / "cdi" / f"{DRIVER}-claim-{uids[pod_name]}.json").read_text())
                (device,) = [d for d in spec["devices"] if d["name"] != f"claim-{uids[pod_name]}"]
                return list(device["containerEdits"].get("env", []))

            assert gpu_env("tuned") == ["FROM_CLASS=1", "MODE=claim"]
            assert gpu_env("with-env") == ["CUDA_DEVICE_MAX_CONNECTIONS=1"]
    finally:
        await asyncio.to_thread(custom.delete_cluster_custom_object, "resource.k8s.io", "v1", "deviceclasses",
                                ENV_CLASS)


SHARED_CLASS = "shared.gpu-node-agent.io"
OTHER_NAMESPACE = "dra-test-other"
ONE_SHARE = example("one-gpu-share.yaml")
"""One replica of the shared DeviceClass (the shipped template's claim spec)."""


async def test_time_sliced_replicas_go_to_claims_of_two_namespaces_and_each_sees_the_gpu(
        apiserver: ApiServer, scheduler: ControlPlane, root: Path) -> None:
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    admin = apiserver.admin_client()
    core, custom = k8s.CoreV1Api(admin), k8s.CustomObjectsApi(admin)
    for make in (lambda: core.create_namespace({"metadata": {"name": OTHER_NAMESPACE}}),
                 lambda: core.create_namespaced_service_account(OTHER_NAMESPACE, {"metadata": {"name": "default"}})):
        with contextlib.suppress(k8s.ApiException):
            await asyncio.to_thread(make)
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    sharing = "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [0]}]}}\n"
    try:
        async with dra_agent(apiserver, kubeconfig, "dra-shared", "a100-pcie-nvlink-pairs", root=root,
                             config=sharing):
            (found,) = await asyncio.to_thread(slices_of, apiserver, "dra-shared")
            assert [d["name"] for d in found["spec"]["devices"]] == [
                "gpu-0-replica-0", "gpu-0-replica-1", "gpu-1", "gpu-2", "gpu-3"]
            await asyncio.to_thread(create_claim, apiserver, "share", ONE_SHARE)
            await asyncio.to_thread(create_pod, apiserver, "share", "share")
            await asyncio.to_thread(custom.create_namespaced_custom_object, "resource.k8s.io", "v1", OTHER_NAMESPACE,
                                    "resourceclaims", {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                                       "metadata": {"name": "share"}, "spec": ONE_SHARE})
            await asyncio.to_thread(core.create_namespaced_pod, OTHER_NAMESPACE, {
                "metadata": {"name": "share"}, "spec": {
                    "resourceClaims": [{"name": "gpus", "resourceClaimName": "share"}],
                    "containers": [{"name": "main", "image": "registry.invalid/cuda:test",
                                    "resources": {"claims": [{"name": "gpus"}]}}]}})

            _, here = await asyncio.to_thread(allocated, apiserver, "share")

            there: list[str] = []

            def other_allocated() -> bool:
                claim = custom.get_namespaced_custom_object("resource.k8s.io", "v1", OTHER_NAMESPACE,
                                                            "resourceclaims", "share")
                results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
                there[:] = [r["device"] for r in results or []]
                return bool(there)

            await asyncio.to_thread(wait_until, other_allocated, 60, "the other namespace's claim to be allocated")
            assert sorted([here[0][2], *there]) == ["gpu-0-replica-0", "gpu-0-replica-1"]

            # A third share does not fit: GPU 0 has two.
            await asyncio.to_thread(create_claim, apiserver, "third", ONE_SHARE)
            await asyncio.to_thread(create_pod, apiserver, "third", "third")
            assert "cannot allocate all claims" in await asyncio.to_thread(unschedulable, apiserver, "third")

            claims = [await asyncio.to_thread(claim_of_pod, apiserver, "share"),
                      await asyncio.to_thread(custom.get_namespaced_custom_object, "resource.k8s.io", "v1",
                                              OTHER_NAMESPACE, "resourceclaims", "share")]
            async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
                answer = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace=c["metadata"]["namespace"], uid=c["metadata"]["uid"],
                                     name="share") for c in claims if c is not None]), timeout=10)
            for claim in claims:
                assert claim is not None
                uid = claim["metadata"]["uid"]
                assert answer.claims[uid].error == ""
                spec = json.loads((root / "cdi" / f"{DRIVER}-claim-{uid}.json").read_text())
                (device,) = [d for d in spec["devices"] if d["name"] != f"claim-{uid}"]
                assert device["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidia0"}]}
                assert spec["devices"][-1]["containerEdits"] == {"env": [f"NVIDIA_VISIBLE_DEVICES={GPU0}"]}
    finally:
        await asyncio.to_thread(core.delete_collection_namespaced_pod, OTHER_NAMESPACE, grace_period_seconds=0)
        await asyncio.to_thread(custom.delete_collection_namespaced_custom_object, "resource.k8s.io", "v1",
                                OTHER_NAMESPACE, "resourceclaims")


MPS_STAND_IN = Path(__file__).resolve().parents[1] / "mps" / "nvidia-cuda-mps-control"


async def test_mps_replicas_of_one_gpu_make_one_client_and_a_mixed_claim_is_refused(
        apiserver: ApiServer, scheduler: ControlPlane, root: Path) -> None:
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    driver_root, mps_root = root / "driver", root / "mps"
    (driver_root / "usr" / "bin").mkdir(parents=True)
    shutil.copy(MPS_STAND_IN, driver_root / "usr" / "bin" / "nvidia-cuda-mps-control")
    config = (f"flags: {{mpsRoot: {mps_root}, plugin: {{containerDriverRoot: {driver_root}}}}}\n"
              "sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 4, devices: [0]}]}}\n")
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    mps_share = {"deviceClassName": SHARED_CLASS, "selectors": [
        {"cel": {"expression": f"device.attributes['{DRIVER}'].sharing == 'mps'"}}]}
    try:
        async with dra_agent(apiserver, kubeconfig, "dra-mps", "a100-pcie-nvlink-pairs", root=root, config=config):

            async def replicas_published() -> list[str]:
                while True:
                    (found,) = await asyncio.to_thread(slices_of, apiserver, "dra-mps")
                    names = [d["name"] for d in found["spec"]["devices"]]
                    if "gpu-0-replica-0" in names:
                        return names
                    await asyncio.sleep(0.1)

            assert await asyncio.wait_for(replicas_published(), 15) == [
                *(f"gpu-0-replica-{n}" for n in range(4)), "gpu-1", "gpu-2", "gpu-3"]
            await asyncio.to_thread(create_claim, apiserver, "mps-two", {"devices": {"requests": [
                {"name": "share", "exactly": {**mps_share, "count": 2}}]}})
            await asyncio.to_thread(create_claim, apiserver, "mps-mixed", {"devices": {"requests": [
                {"name": "share", "exactly": {**mps_share, "count": 1}},
                {"name": "whole", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 1}}]}})
            for name in ("mps-two", "mps-mixed"):
                await asyncio.to_thread(create_pod, apiserver, name, name)
                await asyncio.to_thread(allocated, apiserver, name)
            claims = {n: await asyncio.to_thread(claim_of_pod, apiserver, n) for n in ("mps-two", "mps-mixed")}
            uids = {n: c["metadata"]["uid"] for n, c in claims.items() if c is not None}
            async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
                answer = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace=NAMESPACE, uid=uids[n], name=n) for n in uids]), timeout=10)
            assert answer.claims[uids["mps-two"]].error == ""
            assert answer.claims[uids["mps-mixed"]].error == (
                f"claim {NAMESPACE}/mps-mixed: MPS replicas of 1 GPU(s) and 1 other device(s) cannot share one "
                "MPS client; ask for replicas of one GPU only")
            uid = uids["mps-two"]
            spec = json.loads((root / "cdi" / f"{DRIVER}-claim-{uid}.json").read_text())
            options = ["rbind", "rw"]
            assert spec["devices"][-1] == {"name": f"claim-{uid}", "containerEdits": {
                "env": [f"NVIDIA_VISIBLE_DEVICES={GPU0}", "CUDA_MPS_PIPE_DIRECTORY=/mps/pipe",
                        "CUDA_MPS_LOG_DIRECTORY=/mps/log", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M"],  # half of the A100's 81920 MiB
                "mounts": [
                    {"hostPath": str(mps_root / GPU0 / "pipe"), "containerPath": "/mps/pipe", "options": options},
                    {"hostPath": str(mps_root / GPU0 / "log"), "containerPath": "/mps/log", "options": options},
                    {"hostPath": str(mps_root / "shm"), "containerPath": "/dev/shm", "options": options}]}}
    finally:
        for log in mps_root.glob("*/log/control.log"):
            for line in log.read_text().splitlines():
                if line.startswith("started pid="):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(line.split()[1].removeprefix("pid=")), signal.SIGKILL)


async def test_a_mig_label_waits_for_the_gpus_a_prepared_claim_holds(
        apiserver: ApiServer, scheduler: ControlPlane, root: Path) -> None:
    """The MIG manager counts the devices of prepared claims as held: the kubelet's PodResources API lists only
    the device plugin's, so without them a relabel would re-partition GPUs a running pod has."""
    kubeconfig = apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    core = k8s.CoreV1Api(apiserver.admin_client())
    async with dra_agent(apiserver, kubeconfig, "dra-mig-busy", "a100-pcie-nvlink-pairs", root=root) as (agent, _):
        await asyncio.to_thread(create_claim, apiserver, "held", ON_ONE_PAIR)
        await asyncio.to_thread(create_pod, apiserver, "held", "held")
        assert await asyncio.to_thread(allocated, apiserver, "held") == (
            "dra-mig-busy", [("gpus", "dra-mig-busy", "gpu-0"), ("gpus", "dra-mig-busy", "gpu-1")])
        claim = await asyncio.to_thread(claim_of_pod, apiserver, "held")
        assert claim is not None
        meta = claim["metadata"]
        async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
            answer = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(v1.NodePrepareResourcesRequest(
                claims=[v1.Claim(namespace=NAMESPACE, uid=meta["uid"], name=meta["name"])]), timeout=10)
        assert answer.claims[meta["uid"]].error == ""

        await asyncio.to_thread(core.patch_node, "dra-mig-busy",
                                {"metadata": {"labels": {"nvidia.com/mig.config": "all-1g.10gb"}}})

        def state() -> tuple[str | None, str | None]:
            found = core.read_node("dra-mig-busy").metadata
            return ((found.labels or {}).get("nvidia.com/mig.config.state"),
                    (found.annotations or {}).get("nvidia.com/mig.config.state.reason"))

        _, reason = await until(lambda: (s := state())[0] == "failed" and s, timeout=30,
                                what="the layout refused", blocking=True)
        assert reason is not None and reason.startswith(
            f"GPUs 0, 1 are in use by ResourceClaim {NAMESPACE}/{meta['name']}")
        assert agent.backend.inventory().mig_devices == ()  # nothing changed
