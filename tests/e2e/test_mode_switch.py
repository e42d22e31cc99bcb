"""A live switch between the device plugin and DRA on the real kubelet (docs/dra.md, "Switching a node live"): a
node whose agent has the DRA mounts and two named configs, `default` (device plugin) and `dra`, moves to DRA mode
and back by the label `nvidia.com/device-plugin.config`, with pods on its GPUs. No pod is restarted, no GPU is
handed out twice, and pods that ask for `nvidia.com/gpu` are served by whichever mode is in force (in DRA mode
through the DeviceClass's `extendedResourceName`)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import NAMESPACE, NODE, REPO, RUN_DIR, TIMES, Cluster, eventually, gpu_pod
from dra_mode import SLICE, device_plugin_mode_again, node_slices, rolled_out, slices_gone
from pod_status import gpu_indices, wait_running

CONFIG_LABEL = "nvidia.com/device-plugin.config"
MAPPING = REPO / "deployments" / "dra" / "examples" / "extended-resource-gpu.yaml"
KUSTOMIZE = RUN_DIR / "kustomize-switch"


def configs(dev_root: str) -> dict[str, Any]:
    common = f"version: v1\nmig:\n  layoutsFile: /etc/gpu-agent/mig-layouts.yaml\nflags:\n  nvidiaDevRoot: {dev_root}\n"
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "gpu-node-agent-configs", "namespace": NAMESPACE},
            "data": {"default.yaml": common, "dra.yaml": common + "dra:\n  enabled: true\n"}}


def write_kustomization() -> None:
    """The DRA overlay of the cluster (its mounts, permissions and DeviceClasses) with the agent reading the
    directory of named configs instead of its one file, as the chart's `config.map` renders it."""
    KUSTOMIZE.mkdir(exist_ok=True)
    (KUSTOMIZE / "configs.yaml").write_text(json.dumps(configs(str(RUN_DIR / "nvidia-dev"))))
    (KUSTOMIZE / "kustomization.yaml").write_text("""apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../kustomize-dra
  - configs.yaml
patches:
  - target: {kind: DaemonSet, name: gpu-node-agent}
    patch: |
      - op: replace
        path: /spec/template/spec/containers/0/args/2
        value: /etc/gpu-agent-configs
      - op: add
        path: /spec/template/spec/volumes/-
        value: {name: configs, configMap: {name: gpu-node-agent-configs}}
      - op: add
        path: /spec/template/spec/containers/0/volumeMounts/-
        value: {name: configs, mountPath: /etc/gpu-agent-configs, readOnly: true}
""")


@pytest.fixture(scope="module")
def switchable(cluster: Cluster) -> Iterator[Cluster]:
    """The node in device-plugin mode under the switchable DaemonSet, then as `make cluster` left it."""
    slices_gone()
    assert cluster.allocatable() == "8"
    write_kustomization()
    cluster.kubectl("apply", "-f", str(MAPPING))
    cluster.kubectl("apply", "--server-side", "-k", str(KUSTOMIZE))
    try:
        rolled_out(cluster)
        eventually(lambda: cluster.allocatable() == "8", 90, "Allocatable nvidia.com/gpu: 8 under named configs")
        yield cluster
    finally:
        cluster.delete_pods("held", "mapped", "after")
        cluster.kubectl("label", "node", NODE, f"{CONFIG_LABEL}-")
        device_plugin_mode_again(cluster)
        cluster.kubectl("delete", "configmap", "-n", NAMESPACE, "gpu-node-agent-configs", "--ignore-not-found")
        cluster.kubectl("delete", "-f", str(MAPPING), "--ignore-not-found")
        eventually(lambda: node_slices(cluster) == [], 60, "the node's ResourceSlices gone")
        shutil.rmtree(KUSTOMIZE, ignore_errors=True)


def visible(cluster: Cluster, pod: str) -> list[str]:
    """The GPUs the pod's container was given (it prints NVIDIA_VISIBLE_DEVICES first)."""
    line = eventually(lambda: cluster.kubectl("logs", "-n", "default", pod).strip(), 30, f"{pod}'s output")
    return sorted(line.splitlines()[0].split(","))


def container(cluster: Cluster, pod: str) -> tuple[str, int, str]:
    """(container ID, restart count, start time) of the pod's one container."""
    [status] = cluster.get("pod", "-n", "default", pod)["status"]["containerStatuses"]
    return status["containerID"], status["restartCount"], status["state"]["running"]["startedAt"]


def slice_gpus(cluster: Cluster) -> list[int] | None:
    slices = cluster.get("resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    if [s["metadata"]["name"] for s in slices] != [SLICE]:
        return None
    return sorted(int(d["name"].removeprefix("gpu-")) for d in slices[0]["spec"]["devices"])


def test_a_node_switches_to_dra_and_back_with_its_pods_running(switchable: Cluster) -> None:
    cluster = switchable
    index = gpu_indices()
    cluster.apply(gpu_pod("held", 2))
    wait_running(cluster, "held")
    held = visible(cluster, "held")
    held_gpus = sorted(index[u] for u in held)
    before = container(cluster, "held")

    # To DRA mode: the device plugin's pod keeps its GPUs; the slice offers the other six.
    started = time.monotonic()
    cluster.kubectl("label", "node", NODE, f"{CONFIG_LABEL}=dra", "--overwrite")
    others = [i for i in range(8) if i not in held_gpus]
    eventually(lambda: slice_gpus(cluster) == others, 60, f"the slice with GPUs {others}")
    TIMES["label to DRA mode -> the slice without the held GPUs"] = time.monotonic() - started
    eventually(lambda: cluster.allocatable() == "0", 60, "Allocatable nvidia.com/gpu: 0")
    # A pod that asks for nvidia.com/gpu as before is served through DRA, with a GPU the first pod does not hold.
    cluster.apply(gpu_pod("mapped", 1))
    wait_running(cluster, "mapped")
    mapped_pod = cluster.get("pod", "-n", "default", "mapped")
    [mapping] = mapped_pod["status"]["extendedResourceClaimStatus"]["requestMappings"]
    assert (mapping["containerName"], mapping["resourceName"]) == ("main", "nvidia.com/gpu")
    mapped = visible(cluster, "mapped")
    assert len(mapped) == 1 and index[mapped[0]] in others
    assert container(cluster, "held") == before  # never restarted

    # The first pod ends: its GPUs are offered through DRA.
    cluster.delete_pods("held")
    eventually(lambda: slice_gpus(cluster) == list(range(8)), 30, "the slice with all eight GPUs")

    # Back to the device plugin: the DRA pod keeps its GPU, the device plugin offers the other seven.
    running = container(cluster, "mapped")
    started = time.monotonic()
    cluster.kubectl("label", "node", NODE, f"{CONFIG_LABEL}-")
    eventually(lambda: cluster.allocatable() == "7", 60, "Allocatable nvidia.com/gpu: 7")
    TIMES["label back to device-plugin mode -> Allocatable without the DRA pod's GPU"] = time.monotonic() - started
    eventually(lambda: node_slices(cluster) == [], 30, "the node's ResourceSlice withdrawn")
    cluster.apply(gpu_pod("after", 1))
    wait_running(cluster, "after")
    assert visible(cluster, "after") != mapped
    assert container(cluster, "mapped") == running
    # The DRA pod ends: the kubelet unprepares its claim through the agent's DRA plugin, and the GPU is back.
    cluster.delete_pods("mapped")
    eventually(lambda: cluster.allocatable() == "8", 60, "Allocatable nvidia.com/gpu: 8")
    log = cluster.kubectl("logs", "-n", NAMESPACE, cluster.agent_pod())
    assert "DRA mode: 2 device(s) held through the device plugin stay out of the ResourceSlice until released: " \
        f"{', '.join(sorted(held))}" in log
    assert "device-plugin mode: 1 device(s) held through DRA claims stay out of the device plugin until released: " \
        f"{mapped[0]}" in log
