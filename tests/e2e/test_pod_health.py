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
    # The node as the test found it: all eight GPUs advertised.
    eventually(lambda: cluster.allocatable() == "8", 60, "Allocatable nvidia.com/gpu: 8 again")


def test_a_hung_gpu_under_a_running_pod_shows_in_its_status_until_it_answers(cluster: Cluster) -> None:
    """Device-plugin mode: the GPU's NVML calls stop returning; past the agent's deadline (health.nvmlDeadlineSeconds,
    10 s) the kubelet lists it Unhealthy, and Healthy again once NVML answers and the GPU recovered."""
    indices = gpu_indices()
    try:
        cluster.apply(gpu_pod("hung-one-gpu", 1))
        wait_running(cluster, "hung-one-gpu")
        printed = eventually(lambda: cluster.kubectl("logs", "-n", "default", "hung-one-gpu", check=False).strip(),
                             60, "hung-one-gpu to print NVIDIA_VISIBLE_DEVICES")
        uuid = printed.splitlines()[0]
        assert uuid in indices, printed
        follow_health(cluster, "hung-one-gpu", "nvidia.com/gpu", uuid, indices[uuid], "device plugin",
                      fault=("hang",), undo=("unhang",))
    finally:
        for gpu in range(8):
            cluster.fault("unhang", str(gpu))
        cluster.delete_pods("hung-one-gpu")
    eventually(lambda: cluster.allocatable() == "8", 90, "Allocatable nvidia.com/gpu: 8 again")
