"""The Helm chart in deployments/helm/gpu-node-agent through the pinned helm (hack/helm.sh): it lints clean, renders
the kustomize base in daemonset/ by default, each value changes the objects as its README says, bad values are
refused naming the value with nothing rendered, and what it renders is accepted by the real API server, where the
agent's pod-bound token can do exactly what it can with the base."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import KUBE_RELEASE, NODE, OTHER_NODE, REPO, TESTBIN, ApiServer, running
from base_manifests import (
    APPLIED,
    BASE,
    POLICY_DENIAL,
    RENDERED,
    User,
    agent_token_checks,
    apply_base,
    bound_token_kubeconfig,
    identity,
    kubectl,
    ok,
)

from agent.cli import parser
from agent.config import load_config, parse_config
from agent.mig.layout import default_layouts_text, parse_layouts

# The first test builds helm when `make test` has not (a cold build takes about six minutes on two busy cores).
pytestmark = [pytest.mark.testbin, pytest.mark.timeout(900)]

HELM = TESTBIN / "helm"
HELM_SCRIPT = REPO / "hack" / "helm.sh"
CHART = REPO / "deployments" / "helm" / "gpu-node-agent"
RELEASE = "gpu-node-agent"

# What Helm adds to the base's labels: every object's metadata.labels get these four. The DaemonSet's selector and pod
# template keep the base's labels, so the chart can take over the base's DaemonSet without rolling its pods.
HELM_LABELS = {
    "app.kubernetes.io/instance": "gpu-node-agent",
    "app.kubernetes.io/version": "0.1.0",
    "app.kubernetes.io/managed-by": "Helm",
    "helm.sh/chart": "gpu-node-agent-0.1.0",
}

# NVIDIA's named-configs example, copied from the comment above `config:` in NVIDIA/k8s-device-plugin
# deployments/helm/nvidia-device-plugin/values.yaml.
NVIDIA_CONFIG_MAP = """\
config:
  map:
    default: |-
      version: v1
      flags:
        migStrategy: none
    mig-single: |-
      version: v1
      flags:
        migStrategy: single
    mig-mixed: |-
      version: v1
      flags:
        migStrategy: mixed
"""


class Helm:
    """The pinned helm with a home, cache and config of its own; never reads the caller's kubeconfig."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def __call__(
        self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None, offline_version: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """helm ARGS. `helm template` and `helm lint` ask no cluster: unless told otherwise they are given the rig's
        release (--kube-version), as a user rendering offline for a supported cluster must."""
        if offline_version and args and args[0] in ("template", "lint") and "--kube-version" not in args:
            args = (*args, "--kube-version", f"{KUBE_RELEASE}.0")
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            "KUBECONFIG": str(kubeconfig) if kubeconfig else "/dev/null",
        }
        return subprocess.run([str(HELM), *args], input=stdin, capture_output=True, text=True, env=env, timeout=120)

    def render(
        self, values: str | dict[str, Any] | None = None, *flags: str, release: str = RELEASE
    ) -> list[dict[str, Any]]:
        """`helm template` with values (YAML text or a dict, on stdin) and flags; the objects it prints."""
        stdin = values if isinstance(values, str) or values is None else json.dumps(values)
        args = ["template", release, str(CHART), *flags]
        if stdin is not None:
            args += ["-f", "-"]
        result = self(*args, stdin=stdin)
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    # A no-op taking a fraction of a second when `make test` has built it.
    built = subprocess.run(
        ["bash", str(HELM_SCRIPT)], env={**os.environ, "TESTBIN_DIR": str(TESTBIN)}, stdout=sys.stderr, check=False
    )
    assert built.returncode == 0, f"{HELM_SCRIPT} failed with exit code {built.returncode}"
    return Helm(tmp_path_factory.mktemp("helm-home"))


def by_identity(docs: list[dict[str, Any]]) -> dict[tuple[str, str | None, str], dict[str, Any]]:
    found = {identity(doc): doc for doc in docs}
    assert len(found) == len(docs), "an object rendered twice"
    return found


def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [ds] = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    return ds


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset(docs)["spec"]["template"]["spec"]
    return spec


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [c] = pod_spec(docs)["containers"]
    assert c["name"] == "gpu-node-agent"
    return c  # type: ignore[no-any-return]


def config_map(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    [cm] = [doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == name]
    data: dict[str, str] = cm["data"]
    return data


def volume(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    [v] = [v for v in pod_spec(docs)["volumes"] if v["name"] == name]
    return v  # type: ignore[no-any-return]


def mounts(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container(docs)["volumeMounts"]}


BASE_ARGS = [
    "run", "--config", "/etc/gpu-agent/config.yaml", "--node-name", "$(NODE_NAME)", "--nvml", "real",
    "--kubelet-dir", "/var/lib/kubelet/device-plugins", "--metrics-port", "9400", "--log-format", "json",
]  # fmt: skip
LAYOUTS_SOURCE = {
    "configMap": {
        "name": "gpu-node-agent-mig-layouts",
        "items": [{"key": "mig-layouts.yaml", "path": "mig-layouts.yaml"}],
    }
}


# --- lint and the default render ----------------------------------------------------------------------------------

LINT_CLEAN = f"==> Linting {CHART}\n[INFO] Chart.yaml: icon is recommended\n\n1 chart(s) linted, 0 chart(s) failed\n"


def test_lint_is_clean_in_strict_mode(helm: Helm) -> None:
    # --strict fails on any warning; the one INFO line asks for an icon, which the project does not have.
    result = helm("lint", "--strict", str(CHART))
    assert (result.returncode, result.stdout, result.stderr) == (0, LINT_CLEAN, "")


def test_lint_is_clean_with_every_value_set(helm: Helm) -> None:
    values = {
        "image": {"repository": "registry.example.com/gpu-node-agent", "tag": "1.2.3", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "namespaceOverride": "ml-gpu",
        "config": {"map": {"default": {"version": "v1"}, "mixed": "version: v1\nflags:\n  migStrategy: mixed\n"}},
        "mig": {"existingConfigMap": "default-mig-parted-config", "existingConfigMapKey": "config.yaml"},
        "kubeletRootDir": "/var/lib/k0s/kubelet",
        "nodeSelector": {"pool": "gpu"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}},
        "tolerations": [{"operator": "Exists"}],
        "priorityClassName": "",
        "runtimeClassName": "nvidia",
        "resources": {"limits": {"memory": "256Mi"}},
        "podAnnotations": {"example.com/team": "ml"},
        "extraArgs": ["--log-format", "text"],
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
    }  # fmt: skip
    result = helm("lint", "--strict", str(CHART), "-f", "-", stdin=json.dumps(values))
    assert (result.returncode, result.stdout, result.stderr) == (0, LINT_CLEAN, "")


def test_helm_is_the_pinned_release(helm: Helm) -> None:
    pinned = subprocess.run(["bash", str(HELM_SCRIPT), "--print-version"], capture_output=True, text=True, check=True)
    assert pinned.stdout == "helm v3.19.5\n"
    assert ok(helm("version", "--template", "{{.Version}}")) == "v3.19.5"
    # Built with the Kubernetes 1.34 client libraries (hack/helm.sh sets the version they imply), it assumes
    # Kubernetes 1.34 when no cluster is asked, which the chart's kubeVersion (>= 1.35) refuses: offline, a user
    # renders with --kube-version (the wrapper gives the rig's release).
    assert helm("template", RELEASE, str(CHART), offline_version=False).stderr == (
        "Error: chart requires kubeVersion: >=1.35.0-0 which is incompatible with Kubernetes v1.34.0\n\n"
        "Use --debug flag to render out invalid YAML\n"
    )


@pytest.mark.parametrize("version", ["1.35.0", "1.36.0", "1.37.0"])
def test_the_supported_releases_render_the_same(helm: Helm, version: str) -> None:
    assert ok(helm("template", RELEASE, str(CHART), "--kube-version", version)) == ok(
        helm("template", RELEASE, str(CHART), "--kube-version", "1.37.0"))


def test_clusters_older_than_1_35_are_refused(helm: Helm) -> None:
    # 1.35 is the oldest release upstream still patches, and the oldest the agent is tested on.
    result = helm("template", RELEASE, str(CHART), "--kube-version", "1.34.0")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        "Error: chart requires kubeVersion: >=1.35.0-0 which is incompatible with Kubernetes v1.34.0\n\n"
        "Use --debug flag to render out invalid YAML\n"
    )


def test_the_packaged_chart_renders_the_same(helm: Helm, tmp_path: Path) -> None:
    packaged = ok(helm("package", str(CHART), "--destination", str(tmp_path)))
    archive = tmp_path / "gpu-node-agent-0.1.0.tgz"
    assert packaged == f"Successfully packaged chart and saved it to: {archive}\n"
    from_archive = helm("template", RELEASE, str(archive))
    assert (from_archive.returncode, from_archive.stderr) == (0, "")
    assert from_archive.stdout == ok(helm("template", RELEASE, str(CHART)))


def test_default_values_render_the_kustomize_base(helm: Helm) -> None:
    chart = helm.render()
    base = [doc for doc in yaml.safe_load_all(ok(kubectl("kustomize", str(BASE)))) if doc]
    assert sorted(map(identity, chart), key=str) == sorted(RENDERED, key=str)
    for doc in chart:
        labels = doc["metadata"]["labels"]
        added = {key: labels.pop(key) for key in HELM_LABELS if key in labels}
        assert added == HELM_LABELS, identity(doc)
    # Object for object, field for field, the base once Helm's labels are set aside.
    expected = by_identity(base)
    for key, doc in by_identity(chart).items():
        assert doc == expected[key], key


def test_the_admission_policy_is_the_base_s() -> None:
    # The chart renders the base's policy with its own names; after a change to the base:
    #   cp daemonset/validatingadmissionpolicy.yaml deployments/helm/gpu-node-agent/files/
    chart_copy = CHART / "files" / "validatingadmissionpolicy.yaml"
    assert chart_copy.read_text() == (BASE / "validatingadmissionpolicy.yaml").read_text()


def test_default_mig_layouts_are_the_ones_the_agent_ships(helm: Helm) -> None:
    assert (CHART / "files" / "mig-layouts.yaml").read_text() == default_layouts_text()
    layouts = config_map(helm.render(), "gpu-node-agent-mig-layouts")
    assert layouts == {"mig-layouts.yaml": default_layouts_text()}


# --- each value ---------------------------------------------------------------------------------------------------


def test_image(helm: Helm) -> None:
    tagged = container(helm.render({"image": {"repository": "registry.example.com/ml/gpu-node-agent", "tag": "1.4.2"}}))
    assert (tagged["image"], tagged["imagePullPolicy"]) == (
        "registry.example.com/ml/gpu-node-agent:1.4.2",
        "IfNotPresent",
    )
    digest = "sha256:" + "ab" * 32
    pinned = container(helm.render(
        {"image": {"repository": "registry.example.com/gpu-node-agent", "tag": "1.4.2", "digest": digest,
                   "pullPolicy": "Always"}}
    ))  # fmt: skip
    assert (pinned["image"], pinned["imagePullPolicy"]) == (f"registry.example.com/gpu-node-agent@{digest}", "Always")


def test_image_pull_secrets(helm: Helm) -> None:
    assert "imagePullSecrets" not in pod_spec(helm.render())
    spec = pod_spec(helm.render({"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]}))
    assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_config_file_merges_with_the_defaults_and_loads(helm: Helm, tmp_path: Path) -> None:
    docs = helm.render(
        "config:\n  file:\n    flags:\n      migStrategy: mixed\n    sharing:\n      timeSlicing:\n"
        "        resources:\n          - {name: nvidia.com/gpu, replicas: 4}\n"
    )
    text = config_map(docs, "gpu-node-agent-config")["config.yaml"]
    assert text == (
        "version: v1\n"
        "flags:\n  migStrategy: mixed\n"
        "mig:\n  layoutsFile: /etc/gpu-agent/mig-layouts.yaml\n"
        "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    config = parse_config(text, "config.yaml")
    assert config.flags.mig_strategy == "mixed"
    assert str(config.mig.layouts_file) == "/etc/gpu-agent/mig-layouts.yaml"
    assert container(docs)["args"] == BASE_ARGS

    # null drops a default key, as Helm merges values.
    dropped = config_map(helm.render("config:\n  file:\n    mig: null\n"), "gpu-node-agent-config")
    assert dropped == {"config.yaml": "version: v1\n"}


def write_configs(data: dict[str, str], directory: Path) -> Path:
    """The ConfigMap as the kubelet mounts it: one file per key."""
    directory.mkdir()
    for key, text in data.items():
        (directory / key).write_text(text)
    return directory


def test_named_configs_from_nvidia_chart_values(helm: Helm, tmp_path: Path) -> None:
    docs = helm.render(NVIDIA_CONFIG_MAP)
    data = config_map(docs, "gpu-node-agent-config")
    # Given as text, each config is the file as written.
    assert data == {
        "default": "version: v1\nflags:\n  migStrategy: none",
        "mig-mixed": "version: v1\nflags:\n  migStrategy: mixed",
        "mig-single": "version: v1\nflags:\n  migStrategy: single",
    }
    args = container(docs)["args"]
    assert args == [*BASE_ARGS[:2], "/etc/gpu-agent-configs", *BASE_ARGS[3:]]
    assert volume(docs, "configs") == {"name": "configs", "configMap": {"name": "gpu-node-agent-config"}}
    assert volume(docs, "config") == {"name": "config", "projected": {"sources": [LAYOUTS_SOURCE]}}
    assert mounts(docs)["configs"] == "/etc/gpu-agent-configs"
    assert mounts(docs)["config"] == "/etc/gpu-agent"

    # The agent reads the mounted directory: the node label picks a config, no label means `default`.
    directory = write_configs(data, tmp_path / "configs")
    assert load_config(directory).flags.mig_strategy == "none"
    assert load_config(directory, "mig-mixed").flags.mig_strategy == "mixed"
    assert load_config(directory, "mig-single").flags.mig_strategy == "single"


def test_named_configs_as_maps_get_the_layouts_file(helm: Helm, tmp_path: Path) -> None:
    values = {"config": {"map": {
        "default": {"version": "v1"},
        "shared-4": {"version": "v1", "flags": {"migStrategy": "mixed"},
                     "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}},
        "own-layouts": {"version": "v1", "mig": {"layoutsFile": "/etc/other/layouts.yaml"}},
    }}}  # fmt: skip
    data = config_map(helm.render(values), "gpu-node-agent-config")
    assert data == {
        "default": "version: v1\nmig:\n  layoutsFile: /etc/gpu-agent/mig-layouts.yaml\n",
        "own-layouts": "version: v1\nmig:\n  layoutsFile: /etc/other/layouts.yaml\n",
        "shared-4": "version: v1\nflags:\n  migStrategy: mixed\nmig:\n  layoutsFile: /etc/gpu-agent/mig-layouts.yaml\n"
        "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
    }
    directory = write_configs(data, tmp_path / "configs")
    shared = load_config(directory, "shared-4")
    assert shared.flags.mig_strategy == "mixed"
    assert str(shared.mig.layouts_file) == "/etc/gpu-agent/mig-layouts.yaml"


@pytest.mark.parametrize("key", ["existingConfigMap", "name"])
def test_existing_config_map(helm: Helm, key: str) -> None:
    docs = helm.render({"config": {key: "cluster-gpu-configs"}})
    assert [doc["metadata"]["name"] for doc in docs if doc["kind"] == "ConfigMap"] == ["gpu-node-agent-mig-layouts"]
    assert container(docs)["args"][2] == "/etc/gpu-agent-configs"
    assert volume(docs, "configs") == {"name": "configs", "configMap": {"name": "cluster-gpu-configs"}}
    assert volume(docs, "config") == {"name": "config", "projected": {"sources": [LAYOUTS_SOURCE]}}


def test_mig_layouts_as_a_map(helm: Helm) -> None:
    values = {"mig": {"layouts": {"version": "v1", "mig-configs": {
        "all-disabled": [{"devices": "all", "mig-enabled": False}],
        "all-3g.40gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"3g.40gb": 2}}],
    }}}}  # fmt: skip
    text = config_map(helm.render(values), "gpu-node-agent-mig-layouts")["mig-layouts.yaml"]
    assert text == (
        "version: v1\n"
        "mig-configs:\n"
        "  all-3g.40gb:\n  - devices: all\n    mig-devices:\n      3g.40gb: 2\n    mig-enabled: true\n"
        "  all-disabled:\n  - devices: all\n    mig-enabled: false\n"
    )
    assert parse_layouts(text, "mig-layouts.yaml").names() == ["all-3g.40gb", "all-disabled"]


def test_mig_layouts_from_an_existing_config_map(helm: Helm) -> None:
    # The GPU Operator's ConfigMap keeps its file under config.yaml.
    docs = helm.render(
        {"mig": {"existingConfigMap": "default-mig-parted-config", "existingConfigMapKey": "config.yaml"}}
    )
    assert [doc["metadata"]["name"] for doc in docs if doc["kind"] == "ConfigMap"] == ["gpu-node-agent-config"]
    assert volume(docs, "config")["projected"]["sources"][1] == {
        "configMap": {
            "name": "default-mig-parted-config",
            "items": [{"key": "config.yaml", "path": "mig-layouts.yaml"}],
        }
    }


def test_scheduling(helm: Helm) -> None:
    default = pod_spec(helm.render())
    assert default["priorityClassName"] == "system-node-critical"
    assert "runtimeClassName" not in default and "affinity" not in default

    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                               "values": ["p5.48xlarge"]}]}]}}}  # fmt: skip
    spec = pod_spec(helm.render({
        "nodeSelector": {"pool": "gpu"},
        "affinity": affinity,
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "priorityClassName": "gpu-critical",
        "runtimeClassName": "nvidia",
    }))  # fmt: skip
    # Maps merge with the defaults (set nvidia.com/gpu.present to null to drop it); lists replace them.
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "pool": "gpu"}
    assert spec["affinity"] == affinity
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
    assert (spec["priorityClassName"], spec["runtimeClassName"]) == ("gpu-critical", "nvidia")

    replaced = pod_spec(
        helm.render('nodeSelector:\n  nvidia.com/gpu.present: null\n  pool: gpu\npriorityClassName: ""\n')
    )
    assert replaced["nodeSelector"] == {"pool": "gpu"}
    assert "priorityClassName" not in replaced


def test_resources_and_pod_annotations(helm: Helm) -> None:
    docs = helm.render({
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": None, "memory": "256Mi"}},
        "podAnnotations": {"example.com/team": "ml", "example.com/cost-center": "42"},
    })  # fmt: skip
    assert container(docs)["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert daemonset(docs)["spec"]["template"]["metadata"]["annotations"] == {
        "example.com/team": "ml", "example.com/cost-center": "42",
    }  # fmt: skip
    assert "annotations" not in daemonset(helm.render())["spec"]["template"]["metadata"]


def test_extra_args_and_env(helm: Helm) -> None:
    docs = helm.render({
        "extraArgs": ["--log-format", "text"],
        "extraEnv": [{"name": "TZ", "value": "UTC"},
                     {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
    })  # fmt: skip
    c = container(docs)
    assert c["args"] == [*BASE_ARGS, "--log-format", "text"]
    # As the agent reads them, a flag given again wins.
    assert parser().parse_args(c["args"]).log_format == "text"
    assert [e["name"] for e in c["env"]] == [
        "NODE_NAME", "POD_NAME", "POD_NAMESPACE", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
        "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES", "TZ", "POD_IP",
    ]  # fmt: skip
    assert c["env"][-2:] == [
        {"name": "TZ", "value": "UTC"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def namespaces(docs: list[dict[str, Any]]) -> set[str | None]:
    return {doc["metadata"].get("namespace") for doc in docs if doc["kind"] not in CLUSTER_SCOPED}


CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    "FlowSchema", "PriorityLevelConfiguration",
}  # fmt: skip


def policy_username(docs: list[dict[str, Any]]) -> str:
    [policy] = [doc for doc in docs if doc["kind"] == "ValidatingAdmissionPolicy"]
    [condition] = policy["spec"]["matchConditions"]
    expression: str = condition["expression"]
    return expression


def test_namespace(helm: Helm) -> None:
    # The release's own namespace, created by `helm install --create-namespace`, not by the chart.
    docs = helm.render({"namespaceOverride": "", "createNamespace": False}, "--namespace", "ml-infra")
    assert "Namespace" not in {doc["kind"] for doc in docs}
    assert namespaces(docs) == {"ml-infra"}
    [binding] = [doc for doc in docs if doc["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-node-agent", "namespace": "ml-infra"}]
    [pod_reader] = [doc for doc in docs if doc["kind"] == "RoleBinding"]
    assert pod_reader["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-node-agent", "namespace": "ml-infra"}]
    assert policy_username(docs) == "request.userInfo.username == 'system:serviceaccount:ml-infra:gpu-node-agent'"

    other = helm.render({"namespaceOverride": "gpu-system"}, "--namespace", "ml-infra")
    [namespace] = [doc for doc in other if doc["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == "gpu-system"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert namespaces(other) == {"gpu-system"}
    assert policy_username(other) == "request.userInfo.username == 'system:serviceaccount:gpu-system:gpu-node-agent'"


def test_release_name_and_name_overrides(helm: Helm) -> None:
    docs = helm.render(release="edge")
    assert sorted(identity(doc) for doc in docs if doc["kind"] != "Namespace") == [
        ("ClusterRole", None, "edge-gpu-node-agent"),
        ("ClusterRoleBinding", None, "edge-gpu-node-agent"),
        ("ConfigMap", "gpu-node-agent", "edge-gpu-node-agent-config"),
        ("ConfigMap", "gpu-node-agent", "edge-gpu-node-agent-mig-layouts"),
        ("DaemonSet", "gpu-node-agent", "edge-gpu-node-agent"),
        ("FlowSchema", None, "edge-gpu-node-agent"),
        ("PriorityLevelConfiguration", None, "edge-gpu-node-agent"),
        ("Role", "gpu-node-agent", "edge-gpu-node-agent"),
        ("RoleBinding", "gpu-node-agent", "edge-gpu-node-agent"),
        ("ServiceAccount", "gpu-node-agent", "edge-gpu-node-agent"),
        ("ValidatingAdmissionPolicy", None, "edge-gpu-node-agent-own-node"),
        ("ValidatingAdmissionPolicyBinding", None, "edge-gpu-node-agent-own-node"),
    ]
    [binding] = [doc for doc in docs if doc["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == "edge-gpu-node-agent-own-node"
    [role_binding] = [doc for doc in docs if doc["kind"] == "ClusterRoleBinding"]
    assert role_binding["roleRef"]["name"] == "edge-gpu-node-agent"
    assert role_binding["subjects"][0]["name"] == "edge-gpu-node-agent"
    [pod_reader] = [doc for doc in docs if doc["kind"] == "RoleBinding"]
    assert pod_reader["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                     "name": "edge-gpu-node-agent"}
    assert pod_reader["subjects"] == [{"kind": "ServiceAccount", "name": "edge-gpu-node-agent",
                                       "namespace": "gpu-node-agent"}]
    assert pod_spec(docs)["serviceAccountName"] == "edge-gpu-node-agent"
    assert policy_username(docs) == (
        "request.userInfo.username == 'system:serviceaccount:gpu-node-agent:edge-gpu-node-agent'"
    )
    assert [s["configMap"]["name"] for s in volume(docs, "config")["projected"]["sources"]] == [
        "edge-gpu-node-agent-config", "edge-gpu-node-agent-mig-layouts",
    ]  # fmt: skip

    full = helm.render({"fullnameOverride": "gna"}, release="edge")
    assert daemonset(full)["metadata"]["name"] == "gna"
    assert pod_spec(full)["serviceAccountName"] == "gna"
    renamed = helm.render({"nameOverride": "gpu-agent"}, release="edge")
    assert daemonset(renamed)["metadata"]["name"] == "edge-gpu-agent"
    assert daemonset(renamed)["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": "gpu-agent"}}


def test_kubelet_root_dir(helm: Helm) -> None:
    docs = helm.render({"kubeletRootDir": "/var/lib/k0s/kubelet/"})
    assert volume(docs, "device-plugins")["hostPath"] == {
        "path": "/var/lib/k0s/kubelet/device-plugins",
        "type": "Directory",
    }
    assert volume(docs, "pod-resources")["hostPath"] == {
        "path": "/var/lib/k0s/kubelet/pod-resources",
        "type": "Directory",
    }
    # Inside the container nothing moves: the agent looks where --kubelet-dir says.
    assert mounts(docs)["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert mounts(docs)["pod-resources"] == "/var/lib/kubelet/pod-resources"
    assert container(docs)["args"] == BASE_ARGS


SCHEMA_ERROR = (
    "Error: values don't meet the specifications of the schema(s) in the following chart(s):\ngpu-node-agent:\n"
)
TEMPLATE_ERROR = "Error: execution error at (gpu-node-agent/templates/configmap-config.yaml:1:4): "


@pytest.mark.parametrize(
    ("values", "stderr"),
    [
        ("nodeSelctor: {pool: gpu}\n", SCHEMA_ERROR + "- at '': additional properties 'nodeSelctor' not allowed\n\n"),
        ("createNamespace: maybe\n", SCHEMA_ERROR + "- at '/createNamespace': got string, want boolean\n\n"),
        ("config: {default: shared-4}\n",
         SCHEMA_ERROR + "- at '/config': additional properties 'default' not allowed\n\n"),
        ("config: {map: {default: 3}}\n",
         SCHEMA_ERROR + "- at '/config/map/default': got number, want string or object\n\n"),
        ("image: {pullPolicy: Sometimes}\n",
         SCHEMA_ERROR + "- at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'\n\n"),
        ("kubeletRootDir: var/lib/kubelet\n",
         SCHEMA_ERROR + "- at '/kubeletRootDir': 'var/lib/kubelet' does not match pattern '^/'\n\n"),
        ("config: {map: {shared-4: {version: v1}, shared-8: {version: v1}}}\n",
         TEMPLATE_ERROR + "config.map: 2 configs and none named default, which nodes without the "
         "nvidia.com/device-plugin.config label use\n\nUse --debug flag to render out invalid YAML\n"),
        ("config: {map: {default: {version: v1}}, existingConfigMap: gpu-configs}\n",
         TEMPLATE_ERROR + "config.map and config.existingConfigMap are both set: give the named configs in one of "
         "them\n\nUse --debug flag to render out invalid YAML\n"),
        ("config: {name: a, existingConfigMap: b}\n",
         TEMPLATE_ERROR + "config.name (a) and config.existingConfigMap (b) name different ConfigMaps: set one of "
         "them\n\nUse --debug flag to render out invalid YAML\n"),
        ("mig: {layouts: {version: v1}}\n",
         TEMPLATE_ERROR + "mig.layouts: no mig-configs key; expected a mig-parted v1 file: {version: v1, mig-configs: "
         "{<name>: [...]}}\n\nUse --debug flag to render out invalid YAML\n"),
        ("mig: {layouts: {version: v1, mig-configs: {}}, existingConfigMap: default-mig-parted-config}\n",
         TEMPLATE_ERROR + "mig.layouts and mig.existingConfigMap are both set: give the MIG layouts in one of "
         "them\n\nUse --debug flag to render out invalid YAML\n"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_value(helm: Helm, values: str, stderr: str) -> None:
    result = helm("template", RELEASE, str(CHART), "-f", "-", stdin=values)
    assert (result.returncode, result.stdout, result.stderr) == (1, "", stderr)


def test_readme_lists_every_value_and_the_schema_covers_them() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert sorted(values) == sorted(schema)
    # A group (image, config, ...) is listed key by key; any other value as a whole.
    expected = set()
    for key, value in values.items():
        if "properties" in schema[key]:
            assert sorted(value) == sorted(schema[key]["properties"]), key
            expected |= {f"{key}.{child}" for child in value}
        else:
            expected.add(key)
    readme = (CHART / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    listed = [row.split("`")[1] for row in rows]
    assert sorted(listed) == sorted(expected)


# --- on the real API server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """An API server of this module's own: the chart installs objects with the base's names, which the session's
    rig already holds from the base's tests, and a Namespace is never deleted there (no namespace controller)."""
    with running(tmp_path_factory.mktemp("helm-rig"), nodes=(NODE, OTHER_NODE)) as server:
        yield server


@pytest.fixture(scope="module")
def admin(rig: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> User:
    return User(rig.kubeconfig_path, tmp_path_factory.mktemp("kubectl-admin"))


@pytest.fixture(scope="module")
def installed(helm: Helm, rig: ApiServer, admin: User) -> str:
    """The move from the kustomize base to the chart: the base applied with kubectl, then `helm install gpu-node-agent
    --take-ownership` with the default values. The release stays in the namespace `default`."""
    apply_base(admin)
    before = json.loads(ok(admin("get", "-k", str(BASE), "-o", "json")))["items"]
    # Without --take-ownership Helm refuses objects it did not create, and installs nothing.
    refused = helm("install", RELEASE, str(CHART), kubeconfig=rig.kubeconfig_path)
    assert refused.returncode == 1
    assert refused.stderr.startswith(
        'Error: INSTALLATION FAILED: Unable to continue with install: Namespace "gpu-node-agent" in namespace "" '
        "exists and cannot be imported into the current release: invalid ownership metadata"
    ), refused.stderr
    assert ok(helm("list", "--all", "-q", kubeconfig=rig.kubeconfig_path)) == ""

    result = helm("install", RELEASE, str(CHART), "--take-ownership", kubeconfig=rig.kubeconfig_path)
    # No warnings either: the server found nothing deprecated or dubious in any object.
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    after = json.loads(ok(admin("get", "-k", str(BASE), "-o", "json")))["items"]
    assert [identity(doc) for doc in after] == [identity(doc) for doc in before]
    for old, new in zip(before, after, strict=True):
        assert new["metadata"]["labels"] == old["metadata"]["labels"] | HELM_LABELS, identity(new)
        annotations = new["metadata"]["annotations"]
        assert (annotations["meta.helm.sh/release-name"], annotations["meta.helm.sh/release-namespace"]) == (
            RELEASE, "default",
        ), identity(new)  # fmt: skip
        if new["kind"] == "DaemonSet":
            # The pods' template is the base's: taking over rolled no agent.
            assert new["metadata"]["generation"] == old["metadata"]["generation"] == 1
            assert new["spec"]["template"] == old["spec"]["template"]
    return result.stdout


def test_helm_install_takes_over_the_objects_of_the_base(installed: str, admin: User) -> None:
    lines = installed.splitlines()
    assert lines[0] == f"NAME: {RELEASE}"
    assert lines[2:5] == ["NAMESPACE: default", "STATUS: deployed", "REVISION: 1"]
    assert ok(admin("get", "-k", str(BASE), "-o", "name")).splitlines() == APPLIED
    # The base applied again over the chart's objects (a second writer, or a way back): nothing to conflict with.
    dry = admin("apply", "--server-side", "--dry-run=server", "-k", str(BASE))
    assert (dry.returncode, dry.stderr) == (0, ""), dry.stderr
    assert dry.stdout.splitlines() == [f"{name} serverside-applied (server dry run)" for name in APPLIED]


def test_helm_install_into_the_release_namespace(helm: Helm, installed: str, rig: ApiServer, admin: User) -> None:
    """The README's other way: the objects in the release's own namespace, created and labelled beforehand."""
    ok(admin("create", "namespace", "gpu-system"))
    ok(admin("label", "namespace", "gpu-system", "pod-security.kubernetes.io/enforce=privileged"))
    result = helm(
        "install", "lab", str(CHART), "--namespace", "gpu-system", "--set", "namespaceOverride=",
        "--set", "createNamespace=false", kubeconfig=rig.kubeconfig_path,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert "STATUS: deployed" in result.stdout.splitlines()
    names = ok(admin("get", "daemonset,serviceaccount,configmap", "-n", "gpu-system", "-o", "name",
                     "-l", "app.kubernetes.io/instance=lab"))  # fmt: skip
    assert names.splitlines() == [
        "daemonset.apps/lab-gpu-node-agent",
        "serviceaccount/lab-gpu-node-agent",
        "configmap/lab-gpu-node-agent-config",
        "configmap/lab-gpu-node-agent-mig-layouts",
    ]
    releases = json.loads(ok(helm("list", "-A", "-o", "json", kubeconfig=rig.kubeconfig_path)))
    assert sorted((r["name"], r["namespace"], r["status"]) for r in releases) == [
        ("gpu-node-agent", "default", "deployed"), ("lab", "gpu-system", "deployed"),
    ]  # fmt: skip


def test_agent_token_of_the_helm_installed_agent(installed: str, rig: ApiServer, admin: User, tmp_path: Path) -> None:
    agent = User(bound_token_kubeconfig(rig, admin, tmp_path / "kubeconfig"), tmp_path / "cache")
    # A new policy takes effect a moment after it is created (as in test_manifests_apply.py's `agent` fixture).
    deadline = time.monotonic() + 30
    while True:
        probe = agent("label", "node", OTHER_NODE, "gpu-node-agent.io/probe=1", "--dry-run=server")
        if probe.returncode != 0 and POLICY_DENIAL in probe.stderr:
            break
        assert time.monotonic() < deadline, f"the admission policy never took effect: {probe.stderr}"
        time.sleep(0.2)
    # This rig is the module's own: the Node needs no restoring afterwards.
    agent_token_checks(agent)


def test_install_notes_name_the_configs_that_miss_the_layouts(helm: Helm, rig: ApiServer) -> None:
    # NVIDIA's configs, given as text, are used as written: with layouts of one's own, the notes say which
    # configs would not read them.
    values = yaml.safe_load(NVIDIA_CONFIG_MAP)
    values["config"]["map"]["mig-mixed"] += "\nmig:\n  layoutsFile: /etc/gpu-agent/mig-layouts.yaml"
    values["mig"] = {"existingConfigMap": "default-mig-parted-config", "existingConfigMapKey": "config.yaml"}
    result = helm(
        "install", "notes", str(CHART), "--dry-run=client", "--set", "namespaceOverride=gpu-notes", "-f", "-",
        kubeconfig=rig.kubeconfig_path, stdin=json.dumps(values),
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    notes = result.stdout[result.stdout.index("NOTES:\n") :]
    assert notes == (
        "NOTES:\n"
        "gpu-node-agent runs on the nodes labelled nvidia.com/gpu.present=true in namespace gpu-notes.\n\n"
        "  kubectl get daemonset notes-gpu-node-agent -n gpu-notes\n"
        "  kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count,nvidia.com/mig.config.state\n\n"
        "Note: config.map.default does not set mig.layoutsFile, so it uses the MIG layouts built into the agent,\n"
        "not the ones in mig.existingConfigMap. Add `mig: {layoutsFile: /etc/gpu-agent/mig-layouts.yaml}` to it.\n\n"
        "Note: config.map.mig-single does not set mig.layoutsFile, so it uses the MIG layouts built into the agent,\n"
        "not the ones in mig.existingConfigMap. Add `mig: {layoutsFile: /etc/gpu-agent/mig-layouts.yaml}` to it.\n"
    )


def test_a_config_change_reaches_the_agents_without_a_rollout(helm: Helm, installed: str, rig: ApiServer,
                                                               admin: User) -> None:  # fmt: skip
    before = json.loads(ok(admin("get", "daemonset", "-n", "gpu-node-agent", RELEASE, "-o", "json")))
    result = helm(
        "upgrade", RELEASE, str(CHART), "--reuse-values", "--set", "config.file.flags.migStrategy=mixed",
        kubeconfig=rig.kubeconfig_path,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert "REVISION: 2" in result.stdout.splitlines()
    data = json.loads(ok(admin("get", "configmap", "-n", "gpu-node-agent", "gpu-node-agent-config", "-o", "json")))
    assert data["data"] == {
        "config.yaml": "version: v1\nflags:\n  migStrategy: mixed\n"
        "mig:\n  layoutsFile: /etc/gpu-agent/mig-layouts.yaml\n"
    }
    # The pods' template did not change, so the DaemonSet rolls no pod: the agents reload the mounted file.
    after = json.loads(ok(admin("get", "daemonset", "-n", "gpu-node-agent", RELEASE, "-o", "json")))
    assert after["metadata"]["generation"] == before["metadata"]["generation"] == 1
    assert after["spec"]["template"] == before["spec"]["template"]


def test_helm_template_output_applies_to_the_api_server(
    helm: Helm, rig: ApiServer, admin: User, tmp_path: Path
) -> None:
    """What a GitOps user does: render with their values, apply with kubectl. A second release beside the first,
    in a namespace of its own, with named configs and MIG layouts of its own."""
    values = yaml.safe_load(NVIDIA_CONFIG_MAP) | {
        "namespaceOverride": "gpu-edge",
        "mig": {"layouts": {"version": "v1",
                            "mig-configs": {"all-disabled": [{"devices": "all", "mig-enabled": False}]}}},
        "runtimeClassName": "nvidia",
        "kubeletRootDir": "/var/lib/k0s/kubelet",
        "podAnnotations": {"example.com/team": "edge"},
    }  # fmt: skip
    result = helm("template", "edge", str(CHART), "-f", "-", stdin=json.dumps(values))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    applied = admin("apply", "--server-side", "-f", "-", stdin=result.stdout)
    assert (applied.returncode, applied.stderr) == (0, ""), applied.stderr
    assert applied.stdout.splitlines() == [
        "namespace/gpu-edge serverside-applied",
        "serviceaccount/edge-gpu-node-agent serverside-applied",
        "configmap/edge-gpu-node-agent-config serverside-applied",
        "configmap/edge-gpu-node-agent-mig-layouts serverside-applied",
        "clusterrole.rbac.authorization.k8s.io/edge-gpu-node-agent serverside-applied",
        "clusterrolebinding.rbac.authorization.k8s.io/edge-gpu-node-agent serverside-applied",
        "role.rbac.authorization.k8s.io/edge-gpu-node-agent serverside-applied",
        "rolebinding.rbac.authorization.k8s.io/edge-gpu-node-agent serverside-applied",
        "daemonset.apps/edge-gpu-node-agent serverside-applied",
        "flowschema.flowcontrol.apiserver.k8s.io/edge-gpu-node-agent serverside-applied",
        "prioritylevelconfiguration.flowcontrol.apiserver.k8s.io/edge-gpu-node-agent serverside-applied",
        "validatingadmissionpolicy.admissionregistration.k8s.io/edge-gpu-node-agent-own-node serverside-applied",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/edge-gpu-node-agent-own-node serverside-applied",
    ]
    # The release's policy holds its own ServiceAccount: a token of it not bound to a pod changes no Node.
    unbound = User(rig.service_account_kubeconfig("edge-gpu-node-agent", "gpu-edge"), tmp_path / "cache")
    assert unbound("auth", "can-i", "patch", "nodes").stdout == "yes\n"
    denial = (
        "ValidatingAdmissionPolicy 'edge-gpu-node-agent-own-node' with binding 'edge-gpu-node-agent-own-node' "
        "denied request: gpu-node-agent may change no Node: its token is not bound to a pod on a node"
    )
    # A label key of this test's own: kubectl sends no patch for a label the Node already has (the install tests
    # leave gpu-node-agent.io/probe=1 on it), and a request never sent is never refused.
    deadline = time.monotonic() + 30
    while True:
        refused = unbound("label", "node", NODE, "gpu-node-agent.io/edge-probe=1", "--dry-run=server")
        if refused.returncode != 0 and denial in refused.stderr:
            break
        assert time.monotonic() < deadline, f"the admission policy never took effect: {refused.stderr}"
        time.sleep(0.2)
    assert refused.stderr == f'Error from server (Forbidden): nodes "{NODE}" is forbidden: {denial}\n'


# --- DRA mode (dra.enabled) ---------------------------------------------------------------------------------------

DRA_OVERLAY = REPO / "deployments" / "dra-overlay"
DRA_VALUES = {"dra": {"enabled": True}, "config": {"file": {"dra": {"enabled": True}}}}
"""The chart's objects of DRA mode, and every node's agent in DRA mode: what deployments/dra-overlay applies."""
DEVICE_CLASSES = [doc["metadata"]["name"] for doc in yaml.safe_load_all(
    (REPO / "deployments" / "dra" / "deviceclass.yaml").read_text()) if doc]
DRA_OBJECTS = [
    ("ClusterRole", None, "gpu-node-agent-dra"),
    ("ClusterRoleBinding", None, "gpu-node-agent-dra"),
    ("ValidatingAdmissionPolicy", None, "gpu-node-agent-own-resourceslices"),
    ("ValidatingAdmissionPolicyBinding", None, "gpu-node-agent-own-resourceslices"),
    *[("DeviceClass", None, name) for name in DEVICE_CLASSES],
]


def test_lint_is_clean_with_dra_enabled(helm: Helm) -> None:
    result = helm("lint", "--strict", str(CHART), "-f", "-", stdin=json.dumps(DRA_VALUES))
    assert (result.returncode, result.stdout, result.stderr) == (0, LINT_CLEAN, "")


def test_dra_enabled_renders_the_dra_overlay(helm: Helm) -> None:
    chart = helm.render(DRA_VALUES)
    overlay = [doc for doc in yaml.safe_load_all(ok(kubectl("kustomize", str(DRA_OVERLAY)))) if doc]
    assert sorted(map(identity, chart), key=str) == sorted(RENDERED + DRA_OBJECTS, key=str)
    for doc in chart:
        labels = doc["metadata"]["labels"]
        added = {key: labels.pop(key) for key in HELM_LABELS if key in labels}
        assert added == HELM_LABELS, identity(doc)
    expected = by_identity(overlay)
    assert by_identity(chart).keys() == expected.keys()
    for key, doc in by_identity(chart).items():
        assert doc == expected[key], key
    # What DRA mode adds to the DaemonSet: three mounts, each at its path on the node.
    host_paths = {v["name"]: v["hostPath"] for v in pod_spec(chart)["volumes"] if "hostPath" in v}
    assert {name: (mounts(chart)[name], host_paths[name]) for name in ("plugins-registry", "dra-plugin", "cdi")} == {
        "plugins-registry": ("/var/lib/kubelet/plugins_registry",
                             {"path": "/var/lib/kubelet/plugins_registry", "type": "Directory"}),
        "dra-plugin": ("/var/lib/kubelet/plugins/gpu.gpu-node-agent.io",
                       {"path": "/var/lib/kubelet/plugins/gpu.gpu-node-agent.io", "type": "DirectoryOrCreate"}),
        "cdi": ("/var/run/cdi", {"path": "/var/run/cdi", "type": "DirectoryOrCreate"}),
    }  # fmt: skip
    assert config_map(chart, "gpu-node-agent-config") == {
        "config.yaml": "version: v1\ndra:\n  enabled: true\nmig:\n  layoutsFile: /etc/gpu-agent/mig-layouts.yaml\n"
    }
    # Rolling updates with surge, the Pod's UID passed to the agent; without DRA, one node at a time, no surge.
    assert daemonset(chart)["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert [e for e in container(chart)["env"] if e["name"] == "POD_UID"] == [
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}}]
    plain = helm.render({})
    assert daemonset(plain)["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    assert "POD_UID" not in {e["name"] for e in container(plain)["env"]}


def test_dra_enabled_alone_leaves_the_agents_config_to_the_nodes(helm: Helm, tmp_path: Path) -> None:
    # Node by node: the objects and mounts for every node, DRA mode only where the node's named config says so.
    values = {"dra": {"enabled": True}, "config": {"map": {
        "default": {"version": "v1"}, "dra": {"version": "v1", "dra": {"enabled": True}}}}}
    docs = helm.render(values)
    assert set(DRA_OBJECTS) <= set(map(identity, docs))
    configs = write_configs(config_map(docs, "gpu-node-agent-config"), tmp_path / "configs")
    assert load_config(configs).dra.enabled is False
    assert load_config(configs, "dra").dra.enabled is True
    assert "dra" not in yaml.safe_load(config_map(helm.render({"dra": {"enabled": True}}),
                                                  "gpu-node-agent-config")["config.yaml"])


@pytest.mark.parametrize("name", ["validatingadmissionpolicy.yaml", "deviceclass.yaml"])
def test_the_dra_objects_are_deployments_dra_s(name: str) -> None:
    # After a change to deployments/dra/<name>, from deployments/: cp dra/<name> helm/gpu-node-agent/files/dra-<name>
    chart_copy = CHART / "files" / f"dra-{name}"
    assert chart_copy.read_text() == (REPO / "deployments" / "dra" / name).read_text()
    assert DEVICE_CLASSES[:2] == ["gpu.gpu-node-agent.io", "mig.gpu-node-agent.io"]


def test_dra_with_another_kubelet_root_dir_is_refused(helm: Helm) -> None:
    result = helm("template", RELEASE, str(CHART), "--set", "dra.enabled=true",
                  "--set", "kubeletRootDir=/var/lib/k0s/kubelet")  # fmt: skip
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        "Error: execution error at (gpu-node-agent/templates/dra-rbac.yaml:3:4): dra.enabled: the agent gives the "
        "kubelet its DRA socket by its path in the container, /var/lib/kubelet/plugins/...; with kubeletRootDir "
        "/var/lib/k0s/kubelet the kubelet would not find it\n\nUse --debug flag to render out invalid YAML\n"
    )


def test_dra_objects_apply_to_the_api_server_and_hold_the_agent_to_its_nodes_slices(
    helm: Helm, rig: ApiServer, admin: User, tmp_path: Path
) -> None:
    values = DRA_VALUES | {"namespaceOverride": "gpu-dra"}
    result = helm("template", "dra", str(CHART), "-f", "-", stdin=json.dumps(values))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    applied = admin("apply", "--server-side", "-f", "-", stdin=result.stdout)
    assert (applied.returncode, applied.stderr) == (0, ""), applied.stderr
    lines = applied.stdout.splitlines()
    for name in ("clusterrole.rbac.authorization.k8s.io/dra-gpu-node-agent-dra",
                 "clusterrolebinding.rbac.authorization.k8s.io/dra-gpu-node-agent-dra",
                 "validatingadmissionpolicy.admissionregistration.k8s.io/dra-gpu-node-agent-own-resourceslices",
                 "validatingadmissionpolicybinding.admissionregistration.k8s.io/dra-gpu-node-agent-own-resourceslices",
                 *[f"deviceclass.resource.k8s.io/{name}" for name in DEVICE_CLASSES],
                 "daemonset.apps/dra-gpu-node-agent"):  # fmt: skip
        assert f"{name} serverside-applied" in lines, applied.stdout

    # The release's ServiceAccount with a token bound to a pod on NODE, as the kubelet mounts it.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dra-probe", "namespace": "gpu-dra"},
           "spec": {"nodeName": NODE, "serviceAccountName": "dra-gpu-node-agent",
                    "containers": [{"name": "agent", "image": "gpu-node-agent:test"}]}}  # fmt: skip
    ok(admin("apply", "--server-side", "-f", "-", stdin=json.dumps(pod)))
    token = ok(admin("create", "token", "dra-gpu-node-agent", "-n", "gpu-dra", "--bound-object-kind=Pod",
                     "--bound-object-name=dra-probe", "--duration=1h")).strip()  # fmt: skip
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rig",
        "clusters": [{"name": "rig", "cluster": {"server": rig.url, "certificate-authority": str(rig.ca_path)}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "rig", "context": {"cluster": "rig", "user": "agent"}}],
    }))  # fmt: skip
    agent = User(kubeconfig, tmp_path / "cache")

    def a_slice(node: str, driver: str = "gpu.gpu-node-agent.io") -> str:
        return json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                           "metadata": {"name": f"probe-{node}"},
                           "spec": {"driver": driver, "nodeName": node,
                                    "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}})  # fmt: skip

    denial = ("ValidatingAdmissionPolicy 'dra-gpu-node-agent-own-resourceslices' with binding "
              "'dra-gpu-node-agent-own-resourceslices' denied request: ")  # fmt: skip
    deadline = time.monotonic() + 30
    while True:  # a new policy takes effect a moment after it is created
        other = agent("create", "--dry-run=server", "-f", "-", stdin=a_slice(OTHER_NODE))
        if other.returncode != 0 and denial in other.stderr:
            break
        assert time.monotonic() < deadline, f"the admission policy never took effect: {other.stderr}"
        time.sleep(0.2)
    assert other.stderr.endswith(f"{denial}the GPU agent writes only the ResourceSlices of its own node ({NODE})\n")
    foreign = agent("create", "--dry-run=server", "-f", "-", stdin=a_slice(NODE, "other.example.com"))
    assert foreign.stderr.endswith(f"{denial}the GPU agent writes only ResourceSlices of its driver "
                                   "gpu.gpu-node-agent.io\n"), foreign.stderr  # fmt: skip
    own = agent("create", "--dry-run=server", "-f", "-", stdin=a_slice(NODE))
    assert (own.returncode, own.stdout, own.stderr) == (0, f"resourceslice.resource.k8s.io/probe-{NODE} created "
                                                           "(server dry run)\n", "")  # fmt: skip
    assert ok(agent("auth", "can-i", "get", "resourceclaims.resource.k8s.io", "-n", "default")) == "yes\n"


def test_flow_control_objects_are_switchable(helm: Helm) -> None:
    kinds = {doc["kind"] for doc in helm.render({"flowControl": {"enabled": False}})}
    assert not kinds & {"FlowSchema", "PriorityLevelConfiguration"}
    docs = helm.render({"flowControl": {"concurrencyShares": 40, "matchingPrecedence": 500}})
    [level] = [doc for doc in docs if doc["kind"] == "PriorityLevelConfiguration"]
    [schema] = [doc for doc in docs if doc["kind"] == "FlowSchema"]
    assert level["spec"]["limited"]["nominalConcurrencyShares"] == 40
    assert schema["spec"]["matchingPrecedence"] == 500
    assert schema["spec"]["priorityLevelConfiguration"] == {"name": "gpu-node-agent"}
    assert schema["spec"]["rules"][0]["subjects"] == [
        {"kind": "ServiceAccount", "serviceAccount": {"name": "gpu-node-agent", "namespace": "gpu-node-agent"}}]
