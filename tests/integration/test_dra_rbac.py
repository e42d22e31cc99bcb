"""The shipped DRA-mode permissions (deployments/dra/ on top of daemonset/) on the rig's kube-apiserver: with a
token bound to a pod on its node, the agent writes its node's ResourceSlice, and cannot write another node's
or another driver's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import OTHER_NODE, REPO, ApiServer
from dra_rig import DRIVER, GROUP, SHIPPED, VERSION, delete_node, dra_agent, slices_of
from kubernetes import client as k8s
from kubernetes import utils

from tests.releases import on_by_default

NODE = "dra-rbac"
NAMESPACE = "gpu-node-agent"
ACCOUNT = "gpu-node-agent"


def apply(admin: k8s.ApiClient, directory: Path, skip: tuple[str, ...] = ()) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((directory / name).read_text()):
            if not doc or doc["kind"] in skip:
                continue
            with contextlib.suppress(utils.FailToCreateError, k8s.ApiException):
                if doc["kind"] == "DeviceClass":
                    k8s.CustomObjectsApi(admin).create_cluster_custom_object(GROUP, VERSION, "deviceclasses", doc)
                else:
                    utils.create_from_dict(admin, doc)


def bound_kubeconfig(apiserver: ApiServer, node: str, path: Path) -> Path:
    """A kubeconfig with the agent's ServiceAccount token bound to a pod on `node`, as the kubelet mounts it."""
    admin = apiserver.admin_client()
    core = k8s.CoreV1Api(admin)
    pod_name = f"gpu-node-agent-{node}"
    with contextlib.suppress(k8s.ApiException):
        core.create_namespaced_pod(NAMESPACE, {"metadata": {"name": pod_name}, "spec": {
            "nodeName": node, "serviceAccountName": ACCOUNT,
            "containers": [{"name": "agent", "image": "gpu-node-agent:test"}]}})
    pod = core.read_namespaced_pod(pod_name, NAMESPACE)
    request = k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(
        audiences=["https://kubernetes.default.svc.cluster.local"], expiration_seconds=3600,
        bound_object_ref=k8s.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod_name, uid=pod.metadata.uid)))
    token = core.create_namespaced_service_account_token(ACCOUNT, NAMESPACE, request).status.token
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rig",
        "clusters": [{"name": "rig", "cluster": {"server": apiserver.url,
                                                 "certificate-authority": str(apiserver.ca_path)}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "rig", "context": {"cluster": "rig", "user": "agent"}}],
    }))
    return path


def a_slice(node: str, driver: str = DRIVER, name: str | None = None) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice",
            "metadata": {"name": name or f"probe-{node}-{driver}"},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                  "resourceSliceCount": 1}, "devices": []}}


def refused(call: Any) -> str:
    """The API server's message when it refuses the call with 403; fails when the call succeeds."""
    try:
        call()
    except k8s.ApiException as err:
        assert err.status == 403, err
        return str(yaml.safe_load(err.body)["message"])
    raise AssertionError("the API server allowed it")


@pytest.fixture(scope="module")
def agent_custom(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, k8s.CustomObjectsApi]:
    admin = apiserver.admin_client()
    apply(admin, REPO / "daemonset", skip=("DaemonSet",))
    apply(admin, SHIPPED)
    k8s.CoreV1Api(admin).create_node({"metadata": {"name": NODE}})
    path = bound_kubeconfig(apiserver, NODE, tmp_path_factory.mktemp("dra-rbac") / "kubeconfig")
    config = k8s.Configuration()
    from kubernetes import config as kube_config
    kube_config.load_kube_config(str(path), client_configuration=config)
    custom = k8s.CustomObjectsApi(k8s.ApiClient(config))
    # A new admission policy takes effect a moment after it is created: wait until it refuses.
    deadline = time.monotonic() + 30
    while True:
        try:
            custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", a_slice(OTHER_NODE))
        except k8s.ApiException as err:
            if err.status == 403:
                break
            raise
        k8s.CustomObjectsApi(admin).delete_cluster_custom_object(
            GROUP, VERSION, "resourceslices", f"probe-{OTHER_NODE}-{DRIVER}")
        assert time.monotonic() < deadline, "the admission policy never took effect"
        time.sleep(0.2)
    k8s.CoreV1Api(admin).delete_node(NODE)  # dra_agent makes it schedulable again
    return path, custom


@pytest.mark.matrix
async def test_the_agent_writes_its_own_nodes_slice(apiserver: ApiServer,
                                                    agent_custom: tuple[Path, k8s.CustomObjectsApi]) -> None:
    kubeconfig, _ = agent_custom
    async with dra_agent(apiserver, kubeconfig, NODE, "a100-pcie-nvlink-pairs") as (agent, fake):
        (found,) = await asyncio.to_thread(slices_of, apiserver, NODE)
        assert [d["name"] for d in found["spec"]["devices"]] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        fake.inject_xid(1, 48)  # an update of the slice

        async def updated() -> list[str]:
            while True:
                (now,) = await asyncio.to_thread(slices_of, apiserver, NODE)
                if now["spec"]["pool"]["generation"] == 2:
                    return [d["name"] for d in now["spec"]["devices"]]
                await asyncio.sleep(0.1)

        # Its own identity writes the update: from 1.36 the GPU tainted in place (device taints kept by default),
        # on 1.35 withdrawn.
        if on_by_default("DRADeviceTaints", apiserver.release()):
            assert await asyncio.wait_for(updated(), 10) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
            (now,) = await asyncio.to_thread(slices_of, apiserver, NODE)
            assert [(d["name"], t["value"]) for d in now["spec"]["devices"] for t in d.get("taints") or []] == [
                ("gpu-1", "xid-48")]
        else:
            assert await asyncio.wait_for(updated(), 10) == ["gpu-0", "gpu-2", "gpu-3"]
        assert agent.metrics.api_errors._value.get() == 0


def test_another_nodes_or_drivers_slice_is_refused(apiserver: ApiServer,
                                                  agent_custom: tuple[Path, k8s.CustomObjectsApi]) -> None:
    _, custom = agent_custom
    create = custom.create_cluster_custom_object
    assert refused(lambda: create(GROUP, VERSION, "resourceslices", a_slice(OTHER_NODE))).endswith(
        f"the GPU agent writes only the ResourceSlices of its own node ({NODE})")
    assert refused(lambda: create(GROUP, VERSION, "resourceslices", a_slice(NODE, "other.example.com"))).endswith(
        "the GPU agent writes only ResourceSlices of its driver gpu.gpu-node-agent.io")
    admin = k8s.CustomObjectsApi(apiserver.admin_client())
    admin.create_cluster_custom_object(GROUP, VERSION, "resourceslices", a_slice(OTHER_NODE, name="theirs"))
    try:
        assert refused(lambda: custom.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", "theirs")
                       ).endswith(f"the GPU agent writes only the ResourceSlices of its own node ({NODE})")
        changed = a_slice(OTHER_NODE, name="theirs")
        changed["spec"]["pool"]["generation"] = 2
        changed["metadata"]["resourceVersion"] = admin.get_cluster_custom_object(
            GROUP, VERSION, "resourceslices", "theirs")["metadata"]["resourceVersion"]
        assert refused(lambda: custom.replace_cluster_custom_object(
            GROUP, VERSION, "resourceslices", "theirs", changed)).endswith(
            f"the GPU agent writes only the ResourceSlices of its own node ({NODE})")
    finally:
        admin.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", "theirs")
        delete_node(apiserver, NODE)
