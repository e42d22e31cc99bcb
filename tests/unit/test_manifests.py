"""Deployment files: the kustomize base in daemonset/ (what it grants, mounts and runs) and the image's locks.

The ValidatingAdmissionPolicy's CEL is only checked for form here; its behaviour needs a real API server.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from agent.config import parse_config
from agent.labels import OWN_PREFIX, OWNED_NVIDIA_KEYS

BASE = Path(__file__).resolve().parents[2] / "daemonset"
NAMESPACE = "gpu-node-agent"
SERVICE_ACCOUNT = "gpu-node-agent"
USERNAME = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"


def load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((BASE / name).read_text()) if doc is not None]


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object in the base, by (kind, name)."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(BASE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load(path.name):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} defined twice"
            objects[key] = doc
    return objects


def one(kind: str, name: str) -> dict[str, Any]:
    return manifests()[(kind, name)]


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = one("DaemonSet", "gpu-node-agent")["spec"]["template"]["spec"]
    return spec


def container() -> dict[str, Any]:
    containers = pod_spec()["containers"]
    assert [c["name"] for c in containers] == ["gpu-node-agent"]
    c: dict[str, Any] = containers[0]
    return c


def strings(value: Any) -> list[str]:
    """Every string in a parsed YAML value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [*strings(k), *strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


# --- the base as a whole ----------------------------------------------------------------------------


COMPONENTS = {"monitoring"}
"""Kustomize Components beside the base, not part of it (tests/unit/test_monitoring.py checks monitoring/)."""


def test_every_file_parses_and_holds_named_objects() -> None:
    assert {p.name for p in BASE.iterdir() if p.is_dir()} == COMPONENTS
    files = sorted(p.name for p in BASE.iterdir() if not p.is_dir())
    assert files, "daemonset/ is empty"
    for name in files:
        assert name.endswith(".yaml"), f"{name}: only YAML belongs in the base"
        docs = load(name)
        assert docs, f"{name} holds no document"
        if name == "kustomization.yaml":
            continue
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], name


def test_kustomization_lists_every_file_once() -> None:
    (kustomization,) = load("kustomization.yaml")
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(resources) == on_disk


def test_the_base_holds_exactly_these_objects() -> None:
    assert set(manifests()) == {
        ("Namespace", NAMESPACE),
        ("ServiceAccount", SERVICE_ACCOUNT),
        ("ClusterRole", "gpu-node-agent"),
        ("ClusterRoleBinding", "gpu-node-agent"),
        ("Role", "gpu-node-agent"),
        ("RoleBinding", "gpu-node-agent"),
        ("ValidatingAdmissionPolicy", "gpu-node-agent-own-node"),
        ("ValidatingAdmissionPolicyBinding", "gpu-node-agent-own-node"),
        ("PriorityLevelConfiguration", "gpu-node-agent"),
        ("FlowSchema", "gpu-node-agent"),
        ("ConfigMap", "gpu-node-agent-config"),
        ("ConfigMap", "gpu-node-agent-mig-layouts"),
        ("DaemonSet", "gpu-node-agent"),
    }


def test_namespaced_objects_live_in_the_agent_namespace() -> None:
    for (kind, name), doc in manifests().items():
        if kind in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "DaemonSet"):
            assert doc["metadata"]["namespace"] == NAMESPACE, f"{kind}/{name}"
        else:
            assert "namespace" not in doc["metadata"], f"{kind}/{name} is cluster-scoped"


def test_namespace_admits_the_agent_under_pod_security() -> None:
    labels = one("Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


# --- API access --------------------------------------------------------------------------------------


def test_cluster_role_grants_exactly_the_agent_verbs() -> None:
    role = one("ClusterRole", "gpu-node-agent")
    assert role["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]


def test_no_wildcard_and_no_secrets_in_any_rbac_object() -> None:
    for (kind, name), doc in manifests().items():
        if kind not in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
            continue
        values = strings({k: v for k, v in doc.items() if k != "metadata"})
        assert not [s for s in values if "*" in s], f"{kind}/{name} has a wildcard"
        assert not [s for s in values if "secret" in s.lower()], f"{kind}/{name} mentions secrets"


def test_cluster_role_binding_binds_the_role_to_the_service_account_only() -> None:
    binding = one("ClusterRoleBinding", "gpu-node-agent")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "gpu-node-agent",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}]


def test_role_grants_only_reading_pods_in_the_agent_namespace() -> None:
    # The agent reads its own Pod at start to check its tolerations against health.taint; nothing more.
    role = one("Role", "gpu-node-agent")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    binding = one("RoleBinding", "gpu-node-agent")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gpu-node-agent"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}]


def test_token_is_mounted_only_in_the_agent_pods() -> None:
    assert one("ServiceAccount", SERVICE_ACCOUNT)["automountServiceAccountToken"] is False
    spec = pod_spec()
    assert spec["serviceAccountName"] == SERVICE_ACCOUNT
    assert spec["automountServiceAccountToken"] is True


# --- the ValidatingAdmissionPolicy ----------------------------------------------------------------------


def policy_spec() -> dict[str, Any]:
    policy = one("ValidatingAdmissionPolicy", "gpu-node-agent-own-node")
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    spec: dict[str, Any] = policy["spec"]
    return spec


def variable(name: str) -> str:
    (expression,) = [v["expression"] for v in policy_spec()["variables"] if v["name"] == name]
    return str(expression)


def test_policy_applies_to_the_agent_service_account_only() -> None:
    spec = policy_spec()
    (condition,) = spec["matchConditions"]
    assert condition["expression"].strip() == f"request.userInfo.username == '{USERNAME}'"


def test_policy_covers_every_node_write_and_fails_closed() -> None:
    spec = policy_spec()
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["nodes", "nodes/status"],
            "scope": "Cluster",
        }
    ]


def test_policy_binding_denies() -> None:
    binding = one("ValidatingAdmissionPolicyBinding", "gpu-node-agent-own-node")
    assert binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": "gpu-node-agent-own-node", "validationActions": ["Deny"]}


def test_policy_binds_writes_to_the_node_named_in_the_token() -> None:
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name'][0]" in variable("boundNode")
    node_checks = [v["expression"] for v in policy_spec()["validations"] if "variables.boundNode" in v["expression"]]
    assert len(node_checks) == 1
    assert "object.metadata.name == variables.boundNode" in node_checks[0]


def test_policy_lets_the_agent_write_every_label_it_owns() -> None:
    foreign = variable("foreignLabelKeys")
    prefixes = re.findall(r"startsWith\('([^']+)'\)", foreign)
    reserved = re.findall(r"k == '([^']+)'", foreign)
    owned_prefixes = ["nvidia.com/gpu.", "nvidia.com/mig.", "nvidia.com/cuda.", "nvidia.com/mig-", "nvidia.com/mps.",
                      "nvidia.com/vgpu.", "nvidia.com/gfd.", "gpu-node-agent.io/"]
    assert prefixes == [*owned_prefixes, "nvidia.com/gpu.deploy."]
    assert reserved == ["nvidia.com/mig.config", "nvidia.com/gpu.present"]
    assert variable("oldForeignLabelKeys") == foreign.replace("variables.labels", "variables.oldLabels")
    for key in [*sorted(OWNED_NVIDIA_KEYS), OWN_PREFIX + "numa.nodes", "nvidia.com/mig-1g.10gb.count"]:
        assert any(key.startswith(p) for p in owned_prefixes), key
        assert key not in reserved and not key.startswith("nvidia.com/gpu.deploy."), key


def test_policy_owned_annotations_taints_and_condition() -> None:
    annotations = variable("foreignAnnotationKeys")
    assert re.findall(r"startsWith\('([^']+)'\)", annotations) == [
        "nvidia.com/mig.config.state",
        "gpu-node-agent.io/",
    ]
    assert "!t.key.startsWith('gpu-node-agent.io/')" in variable("foreignTaints")
    assert "c.type != 'GPUHealthy'" in variable("foreignConditions")


def balanced(expression: str) -> bool:
    """Brackets pair up and quotes close, outside string literals."""
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    quote = ""
    for ch in expression:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack and not quote


def test_policy_expressions_are_well_formed() -> None:
    spec = policy_spec()
    defined: list[str] = []
    expressions = [c["expression"] for c in spec["matchConditions"]]
    for v in spec["variables"]:
        # A variable may use only those defined before it.
        used = set(re.findall(r"variables\.(\w+)", v["expression"]))
        assert used <= set(defined), f"{v['name']} uses {used - set(defined)} before their definition"
        defined.append(v["name"])
        expressions.append(v["expression"])
    assert len(defined) == len(set(defined))
    for rule in spec["validations"]:
        assert rule.get("message") or rule.get("messageExpression")
        assert rule["reason"] == "Forbidden"
        expressions += [rule["expression"], rule.get("messageExpression", "''")]
        assert set(re.findall(r"variables\.(\w+)", rule["expression"])) <= set(defined)
    for expression in expressions:
        assert isinstance(expression, str) and expression.strip()
        assert balanced(expression), expression


# --- configuration ----------------------------------------------------------------------------------------


# --- the DaemonSet ------------------------------------------------------------------------------------------


def test_daemonset_runs_on_gpu_nodes_as_node_critical() -> None:
    ds = one("DaemonSet", "gpu-node-agent")
    assert ds["apiVersion"] == "apps/v1"
    assert ds["spec"]["selector"]["matchLabels"] == ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    spec = pod_spec()
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [
        {"key": "gpu-node-agent.io/gpu-fault", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "kubernetes.io/arch", "operator": "Equal", "value": "arm64", "effect": "NoSchedule"},
    ]
    for host_namespace in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(host_namespace, False), host_namespace


def test_container_runs_the_agent_for_its_own_node() -> None:
    c = container()
    assert c["image"] == "gpu-node-agent:0.1.0"
    assert c["command"] == ["gpu-agent"]
    assert c["args"] == [
        "run", "--config", "/etc/gpu-agent/config.yaml", "--node-name", "$(NODE_NAME)", "--nvml", "real",
        "--kubelet-dir", "/var/lib/kubelet/device-plugins", "--metrics-port", "9400", "--log-format", "json",
    ]  # fmt: skip
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"] == {
        "name": "NODE_NAME",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}},
    }
    # The pod's own name and namespace, for the toleration check at start.
    assert env["POD_NAME"] == {
        "name": "POD_NAME",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
    }
    assert env["POD_NAMESPACE"] == {
        "name": "POD_NAMESPACE",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}},
    }
    downward = ("NODE_NAME", "POD_NAME", "POD_NAMESPACE")
    assert {name: e.get("value") for name, e in env.items() if name not in downward} == {
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "utility",
        "NVIDIA_MIG_CONFIG_DEVICES": "all",
        "NVIDIA_MIG_MONITOR_DEVICES": "all",
    }


def test_probes_and_metrics_port() -> None:
    c = container()
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert {
        probe: (c[probe]["httpGet"]["path"], c[probe]["httpGet"]["port"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe")
    } == {
        "startupProbe": ("/healthz", 9400),
        "livenessProbe": ("/healthz", 9400),
        "readinessProbe": ("/readyz", 9400),
    }


def test_resources_fit_the_agent_budget() -> None:
    assert container()["resources"] == {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"cpu": "200m", "memory": "128Mi"},
    }


def test_security_context_adds_back_only_sys_admin() -> None:
    assert container()["securityContext"] == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod_spec()["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_host_paths_are_exactly_these() -> None:
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    host_paths = {
        name: (v["hostPath"]["path"], v["hostPath"]["type"]) for name, v in volumes.items() if "hostPath" in v
    }
    assert host_paths == {
        "device-plugins": ("/var/lib/kubelet/device-plugins", "Directory"),
        "pod-resources": ("/var/lib/kubelet/pod-resources", "Directory"),
        "state": ("/var/lib/gpu-node-agent", "DirectoryOrCreate"),
        "nvidia-caps": ("/dev/nvidia-caps", "DirectoryOrCreate"),
    }
    mounts = {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in container()["volumeMounts"]}
    assert mounts == {
        "device-plugins": ("/var/lib/kubelet/device-plugins", False),
        "pod-resources": ("/var/lib/kubelet/pod-resources", True),
        "state": ("/var/lib/gpu-node-agent", False),
        "nvidia-caps": ("/host/dev/nvidia-caps", True),
        "config": ("/etc/gpu-agent", True),
        "tmp": ("/tmp", False),
    }
    assert set(mounts) == set(volumes)


def test_config_volume_holds_both_config_maps_at_the_paths_the_agent_reads() -> None:
    (config,) = [v for v in pod_spec()["volumes"] if v["name"] == "config"]
    sources = [s["configMap"] for s in config["projected"]["sources"]]
    assert sources == [
        {"name": "gpu-node-agent-config", "items": [{"key": "config.yaml", "path": "config.yaml"}]},
        {
            "name": "gpu-node-agent-mig-layouts",
            "items": [{"key": "mig-layouts.yaml", "path": "mig-layouts.yaml"}],
        },
    ]
    for source in sources:
        assert source["items"][0]["key"] in one("ConfigMap", source["name"])["data"]
    args = container()["args"]
    assert args[args.index("--config") + 1] == "/etc/gpu-agent/config.yaml"


@pytest.mark.parametrize("flag", ["--kubelet-dir", "--metrics-port"])
def test_flags_agree_with_the_mounts_and_ports(flag: str) -> None:
    c = container()
    value = c["args"][c["args"].index(flag) + 1]
    if flag == "--kubelet-dir":
        assert value in [m["mountPath"] for m in c["volumeMounts"]]
    else:
        assert int(value) == c["ports"][0]["containerPort"]


# --- the image's dependency lock -----------------------------------------------------------------------


def locked(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (pinned version, number of hashes) from a pip-compile --generate-hashes file."""
    pins: dict[str, tuple[str, int]] = {}
    for entry in re.split(r"\n(?=\S)", path.read_text()):
        match = re.match(r"([A-Za-z0-9._-]+)==(\S+)", entry)
        if match:
            name = re.sub(r"[-_.]+", "-", match[1]).lower()
            pins[name] = (match[2], entry.count("--hash=sha256:"))
    return pins


@pytest.mark.parametrize(
    ("lock", "table"),
    [("requirements.lock", ("project", "dependencies")), ("requirements-build.lock", ("build-system", "requires"))],
)
def test_lock_pins_every_requirement_of_pyproject_with_hashes(lock: str, table: tuple[str, str]) -> None:
    root = BASE.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    pins = locked(root / lock)
    assert pins and all(hashes > 0 for _, hashes in pins.values())
    for text in pyproject[table[0]][table[1]]:
        requirement = Requirement(text)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in pins, f"{lock} lacks {name}: regenerate it with the command in its header"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), (
            f"{lock} pins {name}=={pins[name][0]}, outside {requirement.specifier}"
        )


def test_config_map_holds_a_valid_config_and_the_shipped_layouts() -> None:
    from agent.mig.layout import default_layouts_text, parse_layouts

    data = one("ConfigMap", "gpu-node-agent-config")["data"]
    assert list(data) == ["config.yaml"]
    assert yaml.safe_load(data["config.yaml"]) == {
        "version": "v1", "mig": {"layoutsFile": "/etc/gpu-agent/mig-layouts.yaml"}
    }
    assert str(parse_config(data["config.yaml"]).mig.layouts_file) == "/etc/gpu-agent/mig-layouts.yaml"
    layouts_data = one("ConfigMap", "gpu-node-agent-mig-layouts")["data"]
    assert list(layouts_data) == ["mig-layouts.yaml"]
    layouts = layouts_data["mig-layouts.yaml"]
    assert layouts == default_layouts_text()
    assert "all-1g.10gb" in parse_layouts(layouts, "configmap").names()


# --- DRA mode: the Component deployments/dra/mode and the overlay deployments/dra-overlay -------------------------

DRA_MODE = BASE.parent / "deployments" / "dra" / "mode"
DRA_OVERLAY = BASE.parent / "deployments" / "dra-overlay"


def dra_patch() -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = yaml.safe_load((DRA_MODE / "daemonset-mounts.yaml").read_text())
    return ops


def test_dra_mode_component_patches_the_daemonset_and_the_config() -> None:
    component = yaml.safe_load((DRA_MODE / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert component["patches"] == [
        {"target": {"kind": "DaemonSet", "name": "gpu-node-agent"}, "path": "daemonset-mounts.yaml"},
        {"target": {"kind": "DaemonSet", "name": "gpu-node-agent"}, "path": "daemonset-rolling.yaml"},
        {"path": "configmap-config.yaml"},
    ]
    overlay = yaml.safe_load((DRA_OVERLAY / "kustomization.yaml").read_text())
    assert (overlay["resources"], overlay["components"]) == (["../../daemonset", "../dra"], ["../dra/mode"])


def test_dra_mode_adds_only_appended_mounts_each_at_its_host_path() -> None:
    ops = dra_patch()
    assert {op["op"] for op in ops} == {"add"}
    mounts = {op["value"]["name"]: op["value"] for op in ops
              if op["path"] == "/spec/template/spec/containers/0/volumeMounts/-"}
    volumes = {op["value"]["name"]: op["value"] for op in ops if op["path"] == "/spec/template/spec/volumes/-"}
    assert len(mounts) + len(volumes) == len(ops)
    assert {name: (v["hostPath"]["path"], v["hostPath"]["type"]) for name, v in volumes.items()} == {
        "plugins-registry": ("/var/lib/kubelet/plugins_registry", "Directory"),
        "dra-plugin": ("/var/lib/kubelet/plugins/gpu.gpu-node-agent.io", "DirectoryOrCreate"),
        "cdi": ("/var/run/cdi", "DirectoryOrCreate"),
    }
    # Read-write, and where they are on the node: the kubelet dials the socket path the agent names.
    assert mounts == {
        name: {"name": name, "mountPath": v["hostPath"]["path"]} for name, v in volumes.items()}
    assert not set(volumes) & {v["name"] for v in pod_spec()["volumes"]}


def test_dra_mode_mounts_are_where_the_agent_puts_its_sockets_and_cdi_specs() -> None:
    from agent.config import DraSettings
    from agent.dra.claims import Paths

    args = container()["args"]
    kubelet_root = Path(args[args.index("--kubelet-dir") + 1]).parent
    dra = parse_config(yaml.safe_load(
        (DRA_MODE / "configmap-config.yaml").read_text())["data"]["config.yaml"]).dra
    assert dra == DraSettings(enabled=True)
    paths = Paths.under(kubelet_root, dra.driver_name, dra.cdi_root)
    mounted = {op["value"]["mountPath"] for op in dra_patch() if "mountPath" in op["value"]}
    assert {str(paths.registration.parent), str(paths.endpoint.parent), str(paths.checkpoint.parent),
            str(paths.cdi_dir)} == mounted


def test_dra_mode_rolls_the_new_agent_in_beside_the_old_one_with_its_pod_uid() -> None:
    ops = yaml.safe_load((DRA_MODE / "daemonset-rolling.yaml").read_text())
    assert ops == [
        {"op": "replace", "path": "/spec/updateStrategy/rollingUpdate", "value": {"maxUnavailable": 0, "maxSurge": 1}},
        {"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": {
            "name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}}},
    ]
    # What it replaces is there in the base, and the base passes no POD_UID of its own.
    assert one("DaemonSet", "gpu-node-agent")["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert "POD_UID" not in {e["name"] for e in container()["env"]}


def test_dra_sockets_with_a_pod_uid_fit_a_unix_socket_path() -> None:
    from agent.checks import SOCKET_PATH_MAX, check_dra_sockets, longest_dra_driver_name
    from agent.dra.claims import Paths

    uid = "0f4c2a9e-3b7d-4e21-9c55-6a1d8e2b7f30"  # a Pod UID: 36 characters
    paths = Paths.under(Path("/var/lib/kubelet"), "gpu.gpu-node-agent.io", Path("/var/run/cdi"), uid)
    assert str(paths.registration) == f"/var/lib/kubelet/plugins_registry/gpu.gpu-node-agent.io-{uid}-reg.sock"
    assert str(paths.endpoint) == f"/var/lib/kubelet/plugins/gpu.gpu-node-agent.io/dra-{uid}.sock"
    assert str(paths.lock) == "/var/lib/kubelet/plugins/gpu.gpu-node-agent.io"  # flocked itself: no lock file
    # 34 + 21 + 1 + 36 + 9 and 25 + 21 + 5 + 36 + 5 bytes: 6 to spare under AF_UNIX's 107.
    assert (len(str(paths.registration)), len(str(paths.endpoint)), SOCKET_PATH_MAX) == (101, 92, 107)
    check_dra_sockets(Path("/var/lib/kubelet"), "gpu.gpu-node-agent.io")
    # The registration socket is the longer: 34 + name + 1 + 36 + 9 bytes <= 107 leaves 27 for the name.
    assert longest_dra_driver_name(Path("/var/lib/kubelet")) == 27
    check_dra_sockets(Path("/var/lib/kubelet"), "gpu." + "g" * 19 + ".com")  # 27 characters


def test_a_dra_driver_name_whose_sockets_cannot_exist_is_refused_with_the_longest_that_fits() -> None:
    from agent.checks import StartupError, check_dra_sockets

    def refusal(root: str, driver: str) -> str:
        with pytest.raises(StartupError) as refused:
            check_dra_sockets(Path(root), driver)
        return str(refused.value)

    # 30 characters: 73 bytes without a Pod UID, which fits, but 110 with one, which the next rolling update
    # gives the agent; refused whether or not this agent has POD_UID (the check takes none).
    assert refusal("/var/lib/kubelet", "gpu.gpu-node-agent.example.com") == (
        "dra.driverName gpu.gpu-node-agent.example.com is 30 characters, and at most 27 fit under /var/lib/kubelet: "
        "with the agent Pod's UID in its name (as in a rolling update), its socket "
        "/var/lib/kubelet/plugins_registry/gpu.gpu-node-agent.example.com-<pod-uid>-reg.sock would be 110 bytes "
        "long, and a socket path holds at most 107 (use a dra.driverName of at most 27 characters, or a shorter "
        "kubelet directory)")
    assert refusal("/var/lib/kubelet", "gpu." + "g" * 20 + ".com").startswith(
        "dra.driverName gpu.gggggggggggggggggggg.com is 28 characters, and at most 27 fit under /var/lib/kubelet: ")
    # MicroK8s's kubelet root (41 bytes) leaves 2: no DRA driver name (at least a.b) fits there.
    assert refusal("/var/snap/microk8s/common/var/lib/kubelet", "gpu.example.com") == (
        "dra.driverName gpu.example.com is 15 characters, and no DRA driver name fits under "
        "/var/snap/microk8s/common/var/lib/kubelet: with the agent Pod's UID in its name (as in a rolling update), "
        "its socket /var/snap/microk8s/common/var/lib/kubelet/plugins_registry/gpu.example.com-<pod-uid>-reg.sock "
        "would be 120 bytes long, and a socket path holds at most 107 (use a shorter kubelet directory)")


def test_dra_mode_config_is_the_base_config_with_dra_enabled() -> None:
    base = yaml.safe_load(one("ConfigMap", "gpu-node-agent-config")["data"]["config.yaml"])
    mode = yaml.safe_load((DRA_MODE / "configmap-config.yaml").read_text())
    assert mode["metadata"] == {"name": "gpu-node-agent-config", "namespace": NAMESPACE}
    assert yaml.safe_load(mode["data"]["config.yaml"]) == base | {"dra": {"enabled": True}}
