"""A GPU's health in the status of the pod that holds it (KEP-4680, the `ResourceHealthStatus` feature gate), as
the e2e tests of both modes read it: test_pod_health.py (device-plugin mode, and the gate) and test_dra.py (DRA
mode). kubectl describe pod does not print the field (kubectl v1.37.2), so the tests read it from the API."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from cluster import PRESET, REPO, TIMES, Cluster, eventually
from dra_mode import DRIVER, claim_pod

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


def follow_health(cluster: Cluster, pod: str, name: str, resource_id: str, gpu: int, mode: str,
                  fault: tuple[str, ...] = ("xid",), undo: tuple[str, ...] = ()) -> None:
    """Healthy, then a fault on the GPU (`gpu-agent fault <fault> GPU`, by default an XID): Unhealthy, then (after
    `gpu-agent fault <undo> GPU` where given) Healthy again once the GPU recovered."""
    def shows(expected: list[dict[str, Any]]) -> bool:
        now = allocated_status(cluster, pod)
        assert now == expected, f"allocatedResourcesStatus: {now}"  # the last one seen, when the wait times out
        return True

    what = f"XID {XID}" if fault == ("xid",) else " ".join(fault)
    healthy = one_resource(name, resource_id, "Healthy")
    eventually(lambda: shows(healthy), 60, f"{resource_id} Healthy in {pod}'s status")
    injected = time.monotonic()
    cluster.fault(*fault, str(gpu), *((XID,) if fault == ("xid",) else ()))
    unhealthy = one_resource(name, resource_id, "Unhealthy")
    eventually(lambda: shows(unhealthy), 60, f"{resource_id} Unhealthy in {pod}'s status", interval=0.1)
    TIMES[f"{mode}: {what} injected -> Unhealthy in the pod's status"] = time.monotonic() - injected
    table = cluster.kubectl("get", "pod", "-n", "default", pod, "-o", f"custom-columns={COLUMNS}")
    print(table, cluster.kubectl("describe", "pod", "-n", "default", pod), sep="\n")
    assert [line.split() for line in table.splitlines()] == [
        ["NAME", "CONTAINER", "RESOURCE", "ID", "HEALTH"], [pod, "main", name, resource_id, "Unhealthy"]], table
    if undo:
        cluster.fault(*undo, str(gpu))
    eventually(lambda: shows(healthy), 90, f"{resource_id} Healthy again in {pod}'s status", interval=0.1)
    TIMES[f"{mode}: {what} injected -> Healthy again in the pod's status"] = time.monotonic() - injected


HEALTH_TEMPLATE = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
    "metadata": {"name": "health-gpu", "namespace": "default"},
    "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1}}]}}},
}
"""One GPU. A claim made from a template, not one the pod names (`resourceClaimName`): the 1.35 kubelet finds a
container's claim for its health only in the pod's status.resourceClaimStatuses, which lists the claims made from
templates (from 1.36 it falls back to the pod's spec; docs/reference/xid-and-health.md)."""


def template_claim_pod(name: str) -> dict[str, Any]:
    """A pod holding one GPU from HEALTH_TEMPLATE (the pod's name for the claim: `gpu`), sleeping."""
    return claim_pod(name, HEALTH_TEMPLATE["metadata"]["name"], claim="gpu", command="sleep 3600")
