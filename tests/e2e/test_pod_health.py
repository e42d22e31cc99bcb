"""A GPU's health in the status of the pod that holds it (KEP-4680, the `ResourceHealthStatus` feature gate), on
the real kubelet in device-plugin mode: an XID on the GPU shows as `Unhealthy` in the container's
`status.containerStatuses[].allocatedResourcesStatus`, under the resource's name and the device's ID (the kubelet
takes the health from the agent's ListAndWatch), and goes back to `Healthy` when the GPU recovers. DRA mode's
test is in test_dra.py, on the node that module moves to DRA mode (the kubelet takes the health from the agent's
DRAResourceHealth.NodeWatchResources); the reading of the status is pod_status.py's.

The cluster turns the gate on (kubelet and kube-apiserver) only where its release leaves it off
(hack/cluster/lib.sh, `gates_off_by_default`), and DRAExtendedResource likewise."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import RUN_DIR, Cluster, eventually, gpu_pod
from pod_status import GATE, follow_health, gpu_indices, wait_running

from tests.releases import on_by_default, release_name

pytestmark = [pytest.mark.timeout(420), pytest.mark.matrix]


KUBELET_GATES = (GATE, "DRAExtendedResource")
"""The gates the cluster's kubelet and kube-apiserver need (hack/cluster/lib.sh): the pod-status health, and pods
asking for nvidia.com/gpu served through DRA (test_mode_switch.py)."""


def test_the_cluster_turns_the_gates_on_only_where_the_release_leaves_them_off(cluster: Cluster) -> None:
    release = cluster.release()
    off = [gate for gate in KUBELET_GATES if not on_by_default(gate, release)]
    print(f"Kubernetes {release_name(release)}: off by default: {', '.join(off) or 'none of ' + str(KUBELET_GATES)}")
    kubelet_config = (RUN_DIR / "kubelet" / "config.yaml").read_text()
    apiserver_pid = (RUN_DIR / "pids" / "kube-apiserver.pid").read_text().strip()
    apiserver_args = (Path("/proc") / apiserver_pid / "cmdline").read_bytes().decode().split("\0")
    # The API server's gates, from each --feature-gates=A=true,B=true (others the release leaves off may be there).
    apiserver_gates = {gate for arg in apiserver_args if arg.startswith("--feature-gates=")
                       for gate in arg.split("=", 1)[1].split(",")}
    lines = [line for line in kubelet_config.splitlines() if line.startswith("featureGates:")]
    assert lines == ([f"featureGates: {{{', '.join(f'{gate}: true' for gate in off)}}}"] if off else [])
    for gate in KUBELET_GATES:
        assert (f"{gate}=true" in apiserver_gates) == (gate in off), gate


def follow_one_gpu_pod(cluster: Cluster, pod: str, fault: tuple[str, ...] = ("xid",),
                       undo: tuple[str, ...] = ()) -> None:
    """A pod holding one GPU through the device plugin; its GPU's health in the pod's status through `fault` (and
    `undo`): the resource's name and the device's ID, the GPU's UUID (what the pod was given)."""
    indices = gpu_indices()
    try:
        cluster.apply(gpu_pod(pod, 1))
        wait_running(cluster, pod)
        printed = eventually(lambda: cluster.kubectl("logs", "-n", "default", pod, check=False).strip(),
                             60, f"{pod} to print NVIDIA_VISIBLE_DEVICES")
        uuid = printed.splitlines()[0]
        assert uuid in indices, printed
        follow_health(cluster, pod, "nvidia.com/gpu", uuid, indices[uuid], "device plugin", fault, undo)
    finally:
        if undo:
            for gpu in range(8):
                cluster.fault(*undo, str(gpu))
        cluster.delete_pods(pod)
    # The node as the test found it: all eight GPUs advertised.
    eventually(lambda: cluster.allocatable() == "8", 90, "Allocatable nvidia.com/gpu: 8 again")


def test_an_xid_on_a_pods_gpu_shows_in_its_status_until_the_gpu_recovers(cluster: Cluster) -> None:
    """Device-plugin mode: an XID on the pod's GPU."""
    follow_one_gpu_pod(cluster, "health-one-gpu")


def test_a_hung_gpu_under_a_running_pod_shows_in_its_status_until_it_answers(cluster: Cluster) -> None:
    """Device-plugin mode: the GPU's NVML calls stop returning; past the agent's deadline (health.nvmlDeadlineSeconds,
    10 s) the kubelet lists it Unhealthy, and Healthy again once NVML answers and the GPU recovered."""
    follow_one_gpu_pod(cluster, "hung-one-gpu", fault=("hang",), undo=("unhang",))
