"""A GPU's health in the status of the pod that holds it (KEP-4680, the `ResourceHealthStatus` feature gate), on
the real kubelet, in both modes: an XID on the GPU shows as `Unhealthy` in the container's
`status.containerStatuses[].allocatedResourcesStatus`, under the resource's name and the device's ID, and goes
back to `Healthy` when the GPU recovers. In device-plugin mode the kubelet takes the health from the agent's
ListAndWatch; in DRA mode from the agent's health stream (DRAResourceHealth.NodeWatchResources).

The cluster turns the gate on (kubelet and kube-apiserver) only where its release leaves it off
(hack/cluster/lib.sh, `gates_off_by_default`). kubectl describe pod does not print the field (kubectl v1.37.2), so
the tests read it from the API."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from cluster import BUSYBOX, PRESET, REPO, RUN_DIR, TIMES, Cluster, eventually, gpu_pod
from dra_mode import DRIVER

from tests.releases import on_by_default, release_name

pytestmark = [pytest.mark.timeout(420), pytest.mark.matrix]

GATE = "ResourceHealthStatus"
XID = "48"
"""A double-bit ECC error: the GPU is unhealthy at once, and healthy again after the health policy's clean samples
(health.recoveryChecks), without a reset."""


def gpu_indices() -> dict[str, int]:
    """The preset's GPU indices by UUID, as `gpu-agent inspect` shows them."""
    out = subprocess.run([str(REPO / ".venv" / "bin" / "gpu-agent"), "inspect", "--nvml", f"mock:{PRESET}", "--json"],
                         capture_output=True, text=True, check=True).stdout
    return {g["uuid"]: g["index"] for g in json.loads(out)["gpus"]}


def allocated_status(cluster: Cluster, pod: str) -> Any:
    """The pod's one container's allocatedResourcesStatus, as the API server has it (None while absent)."""
    statuses = cluster.get("pod", "-n", "default", pod)["status"].get("containerStatuses", [])
    assert [s["name"] for s in statuses] == ["main"], statuses
    return statuses[0].get("allocatedResourcesStatus")


def one_resource(name: str, resource_id: str, health: str) -> list[dict[str, Any]]:
    return [{"name": name, "resources": [{"resourceID": resource_id, "health": health}]}]


COLUMNS = ("NAME:.metadata.name,CONTAINER:.status.containerStatuses[*].name,"
           "RESOURCE:.status.containerStatuses[*].allocatedResourcesStatus[*].name,"
           "ID:.status.containerStatuses[*].allocatedResourcesStatus[*].resources[*].resourceID,"
           "HEALTH:.status.containerStatuses[*].allocatedResourcesStatus[*].resources[*].health")
"""What docs/operations.md gives operators to see a pod's devices and their health."""


def wait_running(cluster: Cluster, pod: str) -> None:
    eventually(lambda: cluster.get("pod", "-n", "default", pod)["status"].get("phase") == "Running", 90,
               f"pod {pod} Running")


def follow_health(cluster: Cluster, pod: str, name: str, resource_id: str, gpu: int, mode: str) -> None:
    """Healthy, then an XID on the GPU: Unhealthy, then Healthy again once the GPU recovered."""
    def shows(expected: list[dict[str, Any]]) -> bool:
        now = allocated_status(cluster, pod)
        assert now == expected, f"allocatedResourcesStatus: {now}"  # the last one seen, when the wait times out
        return True

    healthy = one_resource(name, resource_id, "Healthy")
    eventually(lambda: shows(healthy), 60, f"{resource_id} Healthy in {pod}'s status")
    injected = time.monotonic()
    cluster.fault("xid", str(gpu), XID)
    unhealthy = one_resource(name, resource_id, "Unhealthy")
    eventually(lambda: shows(unhealthy), 60, f"{resource_id} Unhealthy in {pod}'s status", interval=0.1)
    TIMES[f"{mode}: XID {XID} injected -> Unhealthy in the pod's status"] = time.monotonic() - injected
    table = cluster.kubectl("get", "pod", "-n", "default", pod, "-o", f"custom-columns={COLUMNS}")
    print(table, cluster.kubectl("describe", "pod", "-n", "default", pod), sep="\n")
    assert [line.split() for line in table.splitlines()] == [
        ["NAME", "CONTAINER", "RESOURCE", "ID", "HEALTH"], [pod, "main", name, resource_id, "Unhealthy"]], table
    eventually(lambda: shows(healthy), 90, f"{resource_id} Healthy again in {pod}'s status", interval=0.1)
    TIMES[f"{mode}: XID {XID} injected -> Healthy again in the pod's status"] = time.monotonic() - injected


def test_the_cluster_turns_the_gate_on_only_where_the_release_leaves_it_off(cluster: Cluster) -> None:
    release = cluster.release()
    default_on = on_by_default(GATE, release)
    print(f"Kubernetes {release_name(release)}: {GATE} {'on' if default_on else 'off'} by default")
    kubelet_config = (RUN_DIR / "kubelet" / "config.yaml").read_text()
    apiserver_pid = (RUN_DIR / "pids" / "kube-apiserver.pid").read_text().strip()
    apiserver_args = (Path("/proc") / apiserver_pid / "cmdline").read_bytes().decode().split("\0")
    # The API server's gates, from each --feature-gates=A=true,B=true (others the release leaves off may be there).
    apiserver_gates = {gate for arg in apiserver_args if arg.startswith("--feature-gates=")
                       for gate in arg.split("=", 1)[1].split(",")}
    if default_on:
        assert GATE not in kubelet_config
        assert not [gate for gate in apiserver_gates if gate.startswith(f"{GATE}=")]
    else:
        assert f"featureGates: {{{GATE}: true}}" in kubelet_config.splitlines()
        assert f"{GATE}=true" in apiserver_gates


def test_an_xid_on_a_pods_gpu_shows_in_its_status_until_the_gpu_recovers(cluster: Cluster) -> None:
    """Device-plugin mode: the resource's name and the device's ID, the GPU's UUID (what the pod was given)."""
    indices = gpu_indices()
    try:
        cluster.apply(gpu_pod("health-one-gpu", 1))
        wait_running(cluster, "health-one-gpu")
        printed = eventually(lambda: cluster.kubectl("logs", "-n", "default", "health-one-gpu", check=False).strip(),
                             60, "health-one-gpu to print NVIDIA_VISIBLE_DEVICES")
        uuid = printed.splitlines()[0]
        assert uuid in indices, printed
        follow_health(cluster, "health-one-gpu", "nvidia.com/gpu", uuid, indices[uuid], "device plugin")
    finally:
        cluster.delete_pods("health-one-gpu")
    # The next test takes the node back to DRA mode with all eight GPUs advertised.
    eventually(lambda: cluster.allocatable() == "8", 60, "Allocatable nvidia.com/gpu: 8 again")


TEMPLATE = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
    "metadata": {"name": "health-gpu", "namespace": "default"},
    "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1}}]}}},
}
"""One GPU. A claim made from a template, not one the pod names (`resourceClaimName`): the 1.35 kubelet finds a
container's claim for its health only in the pod's status.resourceClaimStatuses, which lists the claims made from
templates (from 1.36 it falls back to the pod's spec; docs/reference/xid-and-health.md)."""


def claim_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE["metadata"]["name"]}],
            "containers": [{
                "name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
                "command": ["sh", "-c", "sleep 3600"],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
        },
    }


def test_an_xid_on_a_claims_gpu_shows_in_the_pods_status_until_the_gpu_recovers(dra_node: Cluster) -> None:
    """DRA mode: the name `claim:<the pod's name for the claim>`; the device's ID is the first CDI device ID the agent's
    NodePrepareResources gave the kubelet for it, `<driver>/gpu=claim-<claim UID>-<device>` (docs/dra.md)."""
    cluster = dra_node
    cluster.apply(TEMPLATE)
    try:
        cluster.apply(claim_pod("health-claim"))
        wait_running(cluster, "health-claim")
        [claim_status] = cluster.get("pod", "-n", "default", "health-claim")["status"]["resourceClaimStatuses"]
        claim = cluster.get("resourceclaim", "-n", "default", claim_status["resourceClaimName"])
        [result] = claim["status"]["allocation"]["devices"]["results"]
        device = result["device"]
        assert (result["driver"], device.startswith("gpu-")) == (DRIVER, True), result
        resource_id = f"{DRIVER}/gpu=claim-{claim['metadata']['uid']}-{device}"
        follow_health(cluster, "health-claim", "claim:gpu", resource_id, int(device.removeprefix("gpu-")), "DRA")
    finally:
        cluster.delete_pods("health-claim")
        cluster.kubectl("delete", "resourceclaimtemplate", "-n", "default", "health-gpu", "--ignore-not-found")
        # The claim made from the template goes with its pod.
        eventually(lambda: cluster.get("resourceclaims", "-n", "default")["items"] == [], 60, "the pod's claim deleted")
