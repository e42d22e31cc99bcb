"""`gpu-agent run` in a Pod (POD_NAME, POD_NAMESPACE) checks against the real API server that its Pod tolerates the
taint it puts on its Node: with the base's RBAC applied and a Pod object of its own (no scheduler or kubelet needed:
a Pod with nodeName set is just an object), a tolerated taint starts, one that is not tolerated exits non-zero with
one line naming the toleration to add, and an identity without the Role gets one warning and starts."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from apiserver import REPO, SERVICE_ACCOUNT_ISSUER, ApiServer
from base_manifests import BASE, NAMESPACE, User, apply_base, ok, token_kubeconfig

from tests.plugin_harness import short_dir

AGENT = [sys.executable, "-m", "agent.cli"]
NODE = "selfpod-node"
POD = "gpu-node-agent-selfpod"
ACCOUNT = "gpu-node-agent"
# An identity with the agent's ClusterRole but not its Role: what a cluster that kept an older base has.
NO_ROLE = "gpu-node-agent-no-role"


@pytest.fixture(scope="module")
def admin(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> User:
    return User(apiserver.kubeconfig_path, tmp_path_factory.mktemp("kubectl-admin"))


@pytest.fixture(scope="module")
def pod(apiserver: ApiServer, admin: User) -> Iterator[dict[str, object]]:
    """The base applied, a Node of this module's own and the agent's Pod on it with the DaemonSet's tolerations."""
    apply_base(admin)
    ok(admin("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})))
    daemonset = yaml.safe_load((BASE / "daemonset.yaml").read_text())
    tolerations = daemonset["spec"]["template"]["spec"]["tolerations"]
    manifest = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NAMESPACE},
        "spec": {"nodeName": NODE, "serviceAccountName": ACCOUNT, "tolerations": tolerations,
                 "containers": [{"name": "gpu-node-agent", "image": "gpu-node-agent:test"}]},
    }  # fmt: skip
    ok(admin("create", "-f", "-", stdin=json.dumps(manifest)))
    try:
        yield manifest
    finally:
        admin("delete", "pod", "-n", NAMESPACE, POD, "--grace-period=0", "--force")
        admin("delete", "node", NODE)


@pytest.fixture(scope="module")
def agent_kubeconfig(apiserver: ApiServer, admin: User, pod: dict[str, object],
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent's ServiceAccount token bound to its Pod, as the kubelet mounts it."""
    token = ok(admin(
        "create", "token", ACCOUNT, "-n", NAMESPACE, "--bound-object-kind=Pod", f"--bound-object-name={POD}",
        f"--audience={SERVICE_ACCOUNT_ISSUER}", "--duration=1h",
    )).strip()  # fmt: skip
    return token_kubeconfig(apiserver, token, tmp_path_factory.mktemp("selfpod") / "kubeconfig")


@pytest.fixture(scope="module")
def no_role_kubeconfig(apiserver: ApiServer, admin: User, pod: dict[str, object],
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    ok(admin("create", "serviceaccount", NO_ROLE, "-n", NAMESPACE))
    ok(admin("create", "clusterrolebinding", NO_ROLE, "--clusterrole=gpu-node-agent",
             f"--serviceaccount={NAMESPACE}:{NO_ROLE}"))
    token = ok(admin("create", "token", NO_ROLE, "-n", NAMESPACE, f"--audience={SERVICE_ACCOUNT_ISSUER}",
                     "--duration=1h")).strip()
    try:
        yield token_kubeconfig(apiserver, token, tmp_path_factory.mktemp("selfpod-no-role") / "kubeconfig")
    finally:
        admin("delete", "clusterrolebinding", NO_ROLE)
        admin("delete", "serviceaccount", NO_ROLE, "-n", NAMESPACE)


def config(tmp_path: Path, key: str, effect: str) -> Path:
    (tmp_path / "pod-resources").mkdir()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"version": "v1", "health": {"taint": {"key": key, "effect": effect}}, "mig": {
        "stateDir": str(tmp_path / "state"), "podResourcesSocket": str(tmp_path / "pod-resources" / "kubelet.sock")}}))
    return path


def run(kubeconfig: Path, config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    kubelet_dir = short_dir()
    return subprocess.Popen(
        [*AGENT, "run", "--kubeconfig", str(kubeconfig), "--node-name", NODE, "--nvml", "mock:single-h200",
         "--kubelet-dir", str(kubelet_dir), "--metrics-port", "0", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("POD_")}, **env})


def started_then_stopped(agent: subprocess.Popen[str], timeout: float = 60) -> list[str]:
    """The agent's log lines up to and including `agent started`; then it is stopped with SIGTERM and exits 0."""
    assert agent.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in agent.stderr:
            lines.append(line.rstrip("\n"))
            if "agent started:" in line:
                break
            assert time.monotonic() < deadline, lines
        assert lines and "agent started:" in lines[-1], lines
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=30)
    assert agent.returncode == 0, lines
    return lines


IN_POD = {"POD_NAME": POD, "POD_NAMESPACE": NAMESPACE}


def test_a_taint_the_pod_tolerates_starts(agent_kubeconfig: Path, tmp_path: Path) -> None:
    # The shipped toleration (key gpu-node-agent.io/gpu-fault, operator Exists) covers every effect, NoExecute too.
    agent = run(agent_kubeconfig, config(tmp_path, "gpu-node-agent.io/gpu-fault", "NoExecute"), IN_POD)
    lines = started_then_stopped(agent)
    assert not [line for line in lines if "agent.kube.selfpod" in line], lines


def test_a_taint_the_pod_does_not_tolerate_is_refused_in_one_line(agent_kubeconfig: Path, tmp_path: Path) -> None:
    agent = run(agent_kubeconfig, config(tmp_path, "gpu-node-agent.io/node-fatal", "NoExecute"), IN_POD)
    out, err = agent.communicate(timeout=60)
    assert agent.returncode == 1, err
    assert out == ""
    assert err.splitlines()[-1] == (
        "gpu-agent run: error: health.taint gpu-node-agent.io/node-fatal=true:NoExecute is not tolerated by pod "
        f"{NAMESPACE}/{POD} (on a node fault the agent would evict itself and the node would never recover); add "
        "{key: gpu-node-agent.io/node-fatal, operator: Exists} to the DaemonSet's tolerations, or set health.taint "
        "to a taint the pod tolerates")
    assert "Traceback" not in err
    # Nothing else was said (the refusal comes before any other check), and the agent wrote nothing to its Node.
    assert len(err.splitlines()) == 1, err


def test_without_the_role_the_check_is_one_warning_and_the_agent_starts(no_role_kubeconfig: Path,
                                                                        tmp_path: Path) -> None:
    agent = run(no_role_kubeconfig, config(tmp_path, "gpu-node-agent.io/node-fatal", "NoExecute"), IN_POD)
    lines = started_then_stopped(agent)
    mine = [line.split(" agent.kube.selfpod: ", 1) for line in lines if " agent.kube.selfpod: " in line]
    assert [(head.split()[-1], text) for head, text in mine] == [(
        "WARNING", f"cannot check that pod {NAMESPACE}/{POD} tolerates health.taint "
                   "gpu-node-agent.io/node-fatal=true:NoExecute: its ServiceAccount may not read it (it needs `get` on "
                   f"pods in namespace {NAMESPACE}, which the shipped Role grants); not checked")]


def test_outside_a_pod_the_check_is_skipped_with_one_info_line(agent_kubeconfig: Path, tmp_path: Path) -> None:
    agent = run(agent_kubeconfig, config(tmp_path, "gpu-node-agent.io/node-fatal", "NoSchedule"), {})
    lines = started_then_stopped(agent)
    mine = [line.split(" agent.kube.selfpod: ", 1)[1] for line in lines if " agent.kube.selfpod: " in line]
    assert mine == ["not running in a pod (POD_NAME is not set): not checking that it tolerates health.taint "
                    "gpu-node-agent.io/node-fatal=true:NoSchedule"]


def test_a_reloaded_taint_the_pod_does_not_tolerate_is_rejected_and_the_last_good_config_kept(
        agent_kubeconfig: Path, tmp_path: Path) -> None:
    path = config(tmp_path, "gpu-node-agent.io/gpu-fault", "NoSchedule")
    agent = run(agent_kubeconfig, path, IN_POD)
    assert agent.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in agent.stderr or ()], daemon=True).start()
    seen: list[str] = []

    def wait_for(text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=0.5))
                if text in seen[-1]:
                    return seen[-1]
        raise AssertionError(f"no line with {text!r} in {seen}")

    try:
        wait_for("agent started:")
        # What a ConfigMap update does: the mounted file is replaced.
        replaced = tmp_path / "config.yaml.new"
        replaced.write_text(path.read_text().replace("gpu-node-agent.io/gpu-fault", "gpu-node-agent.io/node-fatal"))
        replaced.replace(path)
        rejected = wait_for("config reload rejected", 30)
        assert rejected.split(" agent.daemon: ", 1)[1] == (
            "config reload rejected; keeping the last good config: health.taint "
            "gpu-node-agent.io/node-fatal=true:NoSchedule is not tolerated by pod "
            f"{NAMESPACE}/{POD} (once the agent restarts on a node it tainted, its pod cannot come back and the "
            "node never recovers); add {key: gpu-node-agent.io/node-fatal, operator: Exists} to the DaemonSet's "
            "tolerations, or set health.taint to a taint the pod tolerates")
        assert agent.poll() is None  # still serving, on the last good config
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    assert agent.returncode == 0
    assert not [line for line in seen if "Traceback" in line]
