"""`extendedResourceName: nvidia.com/gpu` (deployments/dra/examples/extended-resource-gpu.yaml): on a kube-apiserver
and kube-scheduler with DRAExtendedResource on, a pod that asks for `nvidia.com/gpu: 2` in its resources, as it
would of the device plugin, is given two of the agent's devices on a DRA-mode node through a claim the scheduler
makes; the agent prepares that claim as any other. Without the gate the API server drops the field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from apiserver import ApiServer, wait_until
from dra_rig import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    DRIVER,
    GROUP,
    NAMESPACE,
    VERSION,
    ControlPlane,
    GatedApiServer,
    control_plane,
    dra_agent,
    gated_apiserver,
    setup_cluster,
    shipped,
)
from kubernetes import client as k8s

from agent.dra import plugin as dra_plugin
from agent.dra.v1 import api_pb2 as v1
from tests.releases import on_by_default, release_name

pytestmark = pytest.mark.matrix  # what the API server does here depends on its release

GATES = "DRAExtendedResource=true"
CLASS = shipped("examples/extended-resource-gpu.yaml")[0]


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    with gated_apiserver(tmp_path_factory.mktemp("extended-apiserver"), GATES) as rig:
        setup_cluster(rig)
        k8s.CustomObjectsApi(rig.admin_client()).create_cluster_custom_object(GROUP, VERSION, "deviceclasses", CLASS)
        yield rig


@pytest.fixture(scope="module")
def extended_scheduler(extended: GatedApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane(extended, tmp_path_factory.mktemp("extended-control-plane"), GATES) as plane:
        yield plane


def gpu_pod(name: str, count: int) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [{
        "name": "main", "image": "registry.invalid/cuda:test",
        "resources": {"limits": {"nvidia.com/gpu": str(count)}}}]}}


async def test_a_pod_asking_for_nvidia_com_gpu_gets_the_agents_devices_through_a_claim(
        extended: GatedApiServer, extended_scheduler: ControlPlane) -> None:
    admin = extended.admin_client()
    core, custom = k8s.CoreV1Api(admin), k8s.CustomObjectsApi(admin)
    stored = custom.get_cluster_custom_object(GROUP, VERSION, "deviceclasses", CLASS["metadata"]["name"])
    assert stored["spec"]["extendedResourceName"] == "nvidia.com/gpu"  # kept: the gate is on
    kubeconfig = extended.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
    async with dra_agent(extended, kubeconfig, "dra-extended", "a100-pcie-nvlink-pairs") as (agent, _):
        assert agent.dra is not None
        # The Node advertises no nvidia.com/gpu: the device plugin serves none in DRA mode.
        assert "nvidia.com/gpu" not in (core.read_node("dra-extended").status.allocatable or {})
        await asyncio.to_thread(core.create_namespaced_pod, NAMESPACE, gpu_pod("legacy", 2))

        def claim() -> dict[str, Any] | None:
            for item in custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "resourceclaims")["items"]:
                if (item.get("status") or {}).get("allocation"):
                    return dict(item)
            return None

        await asyncio.to_thread(wait_until, lambda: claim() is not None, 60, "the scheduler's claim")
        made = claim()
        assert made is not None
        results = made["status"]["allocation"]["devices"]["results"]
        assert sorted(r["device"] for r in results) == ["gpu-0", "gpu-1"]
        assert {(r["driver"], r["pool"]) for r in results} == {(DRIVER, "dra-extended")}
        assert made["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
        await asyncio.to_thread(wait_until, lambda: core.read_namespaced_pod("legacy", NAMESPACE).spec.node_name,
                                30, "the pod bound")

        meta = made["metadata"]
        request = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=NAMESPACE, uid=meta["uid"],
                                                                  name=meta["name"])])
        answer = (await dra_plugin._DraV1(agent.dra.plugin).NodePrepareResources(request, None)).claims[meta["uid"]]
        assert answer.error == ""
        assert sorted(d.device_name for d in answer.devices) == ["gpu-0", "gpu-1"]


def test_with_the_releases_defaults_the_mapping_is_kept_from_1_36_and_dropped_before(apiserver: ApiServer) -> None:
    """The shipped DeviceClass on the rig's API server as the release ships it: DRAExtendedResource is on by default
    from 1.36 (and cannot be turned off from 1.37), off in 1.35, where the API server drops the field."""
    release = apiserver.release()
    kept = on_by_default("DRAExtendedResource", release)
    print(f"Kubernetes {release_name(release)}: DRAExtendedResource {'on' if kept else 'off'} by default")
    custom = k8s.CustomObjectsApi(apiserver.admin_client())
    stored = custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", CLASS, dry_run="All")
    assert stored["spec"].get("extendedResourceName") == ("nvidia.com/gpu" if kept else None)
