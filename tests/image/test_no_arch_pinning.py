"""The kustomize base (daemonset/) and the Helm chart (deployments/helm/gpu-node-agent) pin no CPU architecture: the
agent's image is one OCI image index for linux/amd64 and linux/arm64, so on a cluster of both (x86 nodes beside
GB200 trays) the DaemonSet must be allowed onto every GPU node, whatever its architecture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from image_archive import REPO

from tests.releases import kube_bin, kube_release

TESTBIN = Path(os.environ.get("TESTBIN_DIR", REPO / ".cache" / "testbin"))
CHART = REPO / "deployments" / "helm" / "gpu-node-agent"
BASE = REPO / "daemonset"
# The node labels the kubelet sets from its architecture (the well-known labels of Kubernetes); the second is
# the deprecated form, still honoured by selectors.
ARCH_LABELS = ("kubernetes.io/arch", "beta.kubernetes.io/arch")
# Where both renders put the agent: nodes labelled as having GPUs (daemonset/daemonset.yaml), nothing else.
GPU_NODES = {"nvidia.com/gpu.present": "true"}
WORKLOADS = ("DaemonSet", "Deployment", "StatefulSet", "Job", "CronJob", "Pod")
# The taint GKE puts on the nodes of an Arm node pool by default (its node pools' architecture taint behavior,
# ARM unless set to NONE), and which Alibaba's ACK asks users to put on theirs: a pod without a toleration for it
# stays off those nodes.
ARM64_TAINT = {"key": "kubernetes.io/arch", "value": "arm64", "effect": "NoSchedule"}


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Whether one of the tolerations tolerates the taint, by Kubernetes' matching rules (an empty key with
    Exists tolerates every taint; an empty effect every effect)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint["value"]:
            return True
    return False


def build(script: str) -> None:
    # Each is a no-op taking about a second when `make test` has built the binaries.
    done = subprocess.run(["bash", str(REPO / "hack" / script)], env={**os.environ, "TESTBIN_DIR": str(TESTBIN)},
                          stdout=sys.stderr, check=False)
    assert done.returncode == 0, f"hack/{script} failed with exit code {done.returncode}"


def objects(command: list[str], env: dict[str, str]) -> list[dict[str, Any]]:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def kustomize_base() -> list[dict[str, Any]]:
    build("testbin.sh")
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": "/dev/null", "HOME": "/nonexistent"}
    return objects([str(kube_bin(TESTBIN) / "kubectl"), "kustomize", str(BASE)], env)


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    build("helm.sh")
    home = tmp_path_factory.mktemp("helm-home")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data"), "KUBECONFIG": "/dev/null"}
    return objects([str(TESTBIN / "helm"), "template", "gpu-node-agent", str(CHART), "--kube-version",
                    f"{kube_release()}.0"], env)


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]
    if obj["kind"] == "Pod":
        return spec
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template: dict[str, Any] = spec["template"]["spec"]
    return template


def arch_pinning(objs: list[dict[str, Any]]) -> list[str]:
    """Every place where a workload's pods are held to, or kept off, nodes of one CPU architecture."""
    found = []
    for obj in objs:
        if obj["kind"] not in WORKLOADS:
            continue
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        spec = pod_spec(obj)
        found += [f"{name}: nodeSelector {k}" for k in spec.get("nodeSelector") or {} if k in ARCH_LABELS]
        node_affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
        required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
        preferred = node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        terms = [*(required.get("nodeSelectorTerms") or []), *(p["preference"] for p in preferred)]
        for term in terms:
            for match in [*(term.get("matchExpressions") or []), *(term.get("matchFields") or [])]:
                if match["key"] in ARCH_LABELS:
                    found.append(f"{name}: nodeAffinity {match['key']} {match['operator']} {match.get('values')}")
        found += [f"{name}: image {c['image']}" for c in [*spec["containers"], *spec.get("initContainers", [])]
                  if c["image"].rsplit(":", 1)[-1].endswith(("amd64", "x86_64", "arm64", "aarch64"))]
    return found


def daemonsets(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == "DaemonSet"]


def test_the_kustomize_base_runs_on_gpu_nodes_of_any_architecture(kustomize_base: list[dict[str, Any]]) -> None:
    assert arch_pinning(kustomize_base) == []
    [agent] = daemonsets(kustomize_base)
    assert (pod_spec(agent)["nodeSelector"], pod_spec(agent).get("affinity")) == (GPU_NODES, None)
    assert tolerates(pod_spec(agent)["tolerations"], ARM64_TAINT)


def test_the_chart_runs_on_gpu_nodes_of_any_architecture(chart: list[dict[str, Any]]) -> None:
    assert arch_pinning(chart) == []
    [agent] = daemonsets(chart)
    assert (pod_spec(agent)["nodeSelector"], pod_spec(agent).get("affinity")) == (GPU_NODES, None)
    assert tolerates(pod_spec(agent)["tolerations"], ARM64_TAINT)


def test_the_toleration_check_follows_kubernetes_matching() -> None:
    assert tolerates([{"operator": "Exists"}], ARM64_TAINT)
    assert tolerates([{"key": "kubernetes.io/arch", "operator": "Exists"}], ARM64_TAINT)
    assert not tolerates([{"key": "kubernetes.io/arch", "operator": "Equal", "value": "amd64"}], ARM64_TAINT)
    assert not tolerates([{"key": "kubernetes.io/arch", "operator": "Exists", "effect": "NoExecute"}], ARM64_TAINT)
    assert not tolerates([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], ARM64_TAINT)


def test_the_check_finds_each_way_of_pinning_an_architecture() -> None:
    def daemonset(**spec: Any) -> dict[str, Any]:
        pod = {"containers": [{"name": "agent", "image": "registry.example.com/gpu-node-agent:0.1.0"}], **spec}
        return {"kind": "DaemonSet", "metadata": {"name": "agent"}, "spec": {"template": {"spec": pod}}}

    term = {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
    pinned = [
        daemonset(nodeSelector={"kubernetes.io/arch": "amd64"}),
        daemonset(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}}),
        daemonset(affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": term}]}}),
        daemonset(containers=[{"name": "agent", "image": "registry.example.com/gpu-node-agent:0.1.0-amd64"}]),
    ]
    assert [arch_pinning([obj]) for obj in pinned] == [
        ["DaemonSet/agent: nodeSelector kubernetes.io/arch"],
        ["DaemonSet/agent: nodeAffinity kubernetes.io/arch In ['amd64']"],
        ["DaemonSet/agent: nodeAffinity kubernetes.io/arch In ['amd64']"],
        ["DaemonSet/agent: image registry.example.com/gpu-node-agent:0.1.0-amd64"],
    ]
