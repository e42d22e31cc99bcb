"""The kustomize base in daemonset/ through the pinned kubectl, as the integration tests apply it: kubectl with a
kubeconfig of its own, the objects the base renders and applies, kubeconfigs for the agent's pod-bound token,
and the checks of what that token may do (`test_manifests_apply.py`, `test_helm_chart.py`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml
from apiserver import KUBE_BIN, NODE, OTHER_NODE, REPO, SERVICE_ACCOUNT_ISSUER, ApiServer

KUBECTL = KUBE_BIN / "kubectl"
BASE = REPO / "daemonset"
NAMESPACE = "gpu-node-agent"
ACCOUNT = "gpu-node-agent"
# A pod of our own to bind the token to: test_agent_on_apiserver.py binds its token to another one.
PROBE_POD = "gpu-node-agent-kubectl-probe"
POLICY_DENIAL = (
    "ValidatingAdmissionPolicy 'gpu-node-agent-own-node' with binding 'gpu-node-agent-own-node' denied request: "
)

# What `kubectl kustomize daemonset/` renders, in the order kustomize emits it (its legacy kind order, not the
# order of `resources:`): (kind, namespace, name), namespace None for cluster-scoped objects.
RENDERED = [
    ("Namespace", None, "gpu-node-agent"),
    ("ServiceAccount", NAMESPACE, "gpu-node-agent"),
    ("Role", NAMESPACE, "gpu-node-agent"),
    ("ClusterRole", None, "gpu-node-agent"),
    ("RoleBinding", NAMESPACE, "gpu-node-agent"),
    ("ClusterRoleBinding", None, "gpu-node-agent"),
    ("ConfigMap", NAMESPACE, "gpu-node-agent-config"),
    ("ConfigMap", NAMESPACE, "gpu-node-agent-mig-layouts"),
    ("ValidatingAdmissionPolicy", None, "gpu-node-agent-own-node"),
    ("ValidatingAdmissionPolicyBinding", None, "gpu-node-agent-own-node"),
    ("DaemonSet", NAMESPACE, "gpu-node-agent"),
    ("FlowSchema", None, "gpu-node-agent"),
    ("PriorityLevelConfiguration", None, "gpu-node-agent"),
]
# The same objects as kubectl names them in apply output, in the same order.
APPLIED = [
    "namespace/gpu-node-agent",
    "serviceaccount/gpu-node-agent",
    "role.rbac.authorization.k8s.io/gpu-node-agent",
    "clusterrole.rbac.authorization.k8s.io/gpu-node-agent",
    "rolebinding.rbac.authorization.k8s.io/gpu-node-agent",
    "clusterrolebinding.rbac.authorization.k8s.io/gpu-node-agent",
    "configmap/gpu-node-agent-config",
    "configmap/gpu-node-agent-mig-layouts",
    "validatingadmissionpolicy.admissionregistration.k8s.io/gpu-node-agent-own-node",
    "validatingadmissionpolicybinding.admissionregistration.k8s.io/gpu-node-agent-own-node",
    "daemonset.apps/gpu-node-agent",
    "flowschema.flowcontrol.apiserver.k8s.io/gpu-node-agent",
    "prioritylevelconfiguration.flowcontrol.apiserver.k8s.io/gpu-node-agent",
]


def kubectl(
    *args: str, kubeconfig: Path | None = None, stdin: str | None = None, cache: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs the pinned kubectl; never reads the caller's kubeconfig or writes to ~/.kube."""
    argv = [str(KUBECTL)]
    if kubeconfig is not None:
        argv.append(f"--kubeconfig={kubeconfig}")
    if cache is not None:
        argv.append(f"--cache-dir={cache}")
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": "/dev/null", "HOME": str(cache or "/nonexistent")}
    return subprocess.run([*argv, *args], input=stdin, capture_output=True, text=True, env=env, timeout=60)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args[1:]} failed ({result.returncode}): {result.stderr}"
    return result.stdout


class User:
    """kubectl with one kubeconfig and a discovery cache of its own."""

    def __init__(self, kubeconfig: Path, cache: Path) -> None:
        self.kubeconfig, self.cache = kubeconfig, cache

    def __call__(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return kubectl(*args, kubeconfig=self.kubeconfig, stdin=stdin, cache=self.cache)


def apply_base(admin: User) -> None:
    """Server-side apply of the whole base: idempotent, whoever created the objects first (test_agent_on_apiserver.py
    creates them with the Python client) and without --force-conflicts."""
    result = admin("apply", "--server-side", "-k", str(BASE))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.splitlines() == [f"{name} serverside-applied" for name in APPLIED]


def bound_token_kubeconfig(apiserver: ApiServer, admin: User, path: Path) -> Path:
    """A kubeconfig with a token of the agent's ServiceAccount bound to a pod on NODE, as the kubelet mounts it."""
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": PROBE_POD, "namespace": NAMESPACE},
        "spec": {"nodeName": NODE, "serviceAccountName": ACCOUNT,
                 "containers": [{"name": "agent", "image": "gpu-node-agent:test"}]},
    }  # fmt: skip
    ok(admin("apply", "--server-side", "-f", "-", stdin=json.dumps(pod)))
    token = ok(admin(
        "create", "token", ACCOUNT, "-n", NAMESPACE, "--bound-object-kind=Pod", f"--bound-object-name={PROBE_POD}",
        f"--audience={SERVICE_ACCOUNT_ISSUER}", "--duration=1h",
    )).strip()  # fmt: skip
    return token_kubeconfig(apiserver, token, path)


def token_kubeconfig(apiserver: ApiServer, token: str, path: Path) -> Path:
    """A kubeconfig at `path` for the rig's API server with `token`, readable by its owner only."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rig",
        "clusters": [{"name": "rig",
                      "cluster": {"server": apiserver.url, "certificate-authority": str(apiserver.ca_path)}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "rig", "context": {"cluster": "rig", "user": "agent"}}],
    }))  # fmt: skip
    path.chmod(0o600)
    return path


def identity(doc: dict[str, Any]) -> tuple[str, str | None, str]:
    return doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]



def agent_token_checks(agent: User) -> None:
    """What the agent's pod-bound token can and cannot do, by RBAC and by the admission policy, seen through
    kubectl as `agent`; leaves the label gpu-node-agent.io/probe on NODE."""
    def can_i(*args: str) -> tuple[int, str]:
        result = agent("auth", "can-i", *args)
        return result.returncode, result.stdout

    assert can_i("patch", "nodes") == (0, "yes\n")
    assert can_i("get", "secrets", "-n", "kube-system") == (1, "no\n")
    assert can_i("create", "events") == (0, "yes\n")
    assert can_i("delete", "nodes") == (1, "no\n")
    # Its own Pod, to check its tolerations: get in its namespace, nothing else on pods.
    assert can_i("get", "pods", "-n", NAMESPACE) == (0, "yes\n")
    assert can_i("get", "pods", "-n", "default") == (1, "no\n")
    assert can_i("list", "pods", "-n", NAMESPACE) == (1, "no\n")
    assert can_i("patch", "pods", "-n", NAMESPACE) == (1, "no\n")
    pod = agent("get", "pod", "-n", NAMESPACE, PROBE_POD, "-o", "jsonpath={.spec.nodeName}")
    assert (pod.returncode, pod.stdout) == (0, NODE), pod.stderr

    labelled = agent("label", "node", NODE, "gpu-node-agent.io/probe=1", "--overwrite")
    assert (labelled.returncode, labelled.stdout) == (0, f"node/{NODE} labeled\n"), labelled.stderr

    other = agent("label", "node", OTHER_NODE, "gpu-node-agent.io/probe=1")
    assert other.returncode != 0
    assert "gpu-node-agent may change only its own Node gpu-node-1, not other-node" in other.stderr
    assert other.stderr == (
        f'Error from server (Forbidden): nodes "{OTHER_NODE}" is forbidden: {POLICY_DENIAL}'
        f"gpu-node-agent may change only its own Node {NODE}, not {OTHER_NODE}\n"
    )

    # --overwrite: test_agent_on_apiserver.py leaves team=ml on the node, and without it kubectl refuses
    # client-side, before the server is asked.
    foreign = agent("label", "node", NODE, "team=x", "--overwrite")
    assert foreign.returncode != 0
    assert POLICY_DENIAL + "gpu-node-agent may change only labels under" in foreign.stderr

    foreign_taint = agent("taint", "node", NODE, "example.com/x=y:NoSchedule")
    assert foreign_taint.returncode != 0
    assert foreign_taint.stderr == (
        f'Error from server (Forbidden): nodes "{NODE}" is forbidden: {POLICY_DENIAL}'
        "gpu-node-agent may add, change or remove only taints with keys under gpu-node-agent.io/\n"
    )

    tainted = agent("taint", "node", NODE, "gpu-node-agent.io/gpu-fault=true:NoSchedule")
    assert (tainted.returncode, tainted.stdout) == (0, f"node/{NODE} tainted\n"), tainted.stderr
    untainted = agent("taint", "node", NODE, "gpu-node-agent.io/gpu-fault-")
    assert (untainted.returncode, untainted.stdout) == (0, f"node/{NODE} untainted\n"), untainted.stderr

    node = json.loads(ok(agent("get", "node", NODE, "-o", "json")))
    assert node["metadata"]["labels"]["gpu-node-agent.io/probe"] == "1"
    assert node["metadata"]["labels"].get("team") != "x"
    assert all(t["key"] not in ("example.com/x", "gpu-node-agent.io/gpu-fault") for t in node["spec"].get("taints", []))
