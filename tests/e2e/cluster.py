"""A real single-node cluster (hack/cluster/up.sh) for end-to-end tests: the agent's DaemonSet on a real kubelet,
containerd and control plane, driven with the real kubectl as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack" / "cluster"
KUBECTL = HACK / "kubectl"
NODE = "gpu-node-1"
PRESET = "dgx-h100"
NAMESPACE = "gpu-node-agent"
RUN_DIR = Path(os.environ.get("CLUSTER_RUN_DIR", "/run/gpu-node-agent-cluster"))
MOCK_STATE = Path("/var/lib/gpu-node-agent/mock-nvml.json")
"""Where the overlay's --mock-state puts the fake NVML's state: in the agent's own state hostPath."""
SIM_STATE = (MOCK_STATE, MOCK_STATE.with_name("mock-nvml.json.lock"), MOCK_STATE.with_name("mock-nvml-gpus.json"),
             MOCK_STATE.with_name("mock-nvml-cordon.json"), MOCK_STATE.with_name("mig-journal.json"))
"""Everything of the simulated GPUs' state on the host (hack/cluster/lib.sh, sim_state_files): gone after the
suite's cluster, whatever an earlier one left."""
BUSYBOX = "localhost/busybox:local"

T = TypeVar("T")

TIMES: dict[str, float] = {}
"""Figures the tests measured on the cluster, printed at the end of the run."""


class Cluster:
    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        result = subprocess.run([str(KUBECTL), *args], input=input, capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def release(self) -> tuple[int, int]:
        """(major, minor) of the cluster's kube-apiserver, as it says (kubectl version)."""
        server = json.loads(self.kubectl("version", "-o", "json"))["serverVersion"]
        return int(server["major"]), int(str(server["minor"]).rstrip("+"))

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def node(self) -> Any:
        return self.get("node", NODE)

    def allocatable(self, resource: str = "nvidia.com/gpu") -> str | None:
        value: str | None = self.node()["status"].get("allocatable", {}).get(resource)
        return value

    def capacity(self) -> dict[str, str]:
        return {k: v for k, v in self.node()["status"].get("capacity", {}).items() if k.startswith("nvidia.com/")}

    def agent_pods(self) -> list[Any]:
        pods: list[Any] = self.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=gpu-node-agent")["items"]
        return pods

    def agent_pod(self) -> str:
        running = [p["metadata"]["name"] for p in self.agent_pods()
                   if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
        assert len(running) == 1, f"expected one running agent pod, found {running}"
        return running[0]

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def delete_pods(self, *names: str) -> None:
        if names:
            self.kubectl("delete", "pod", "-n", "default", "--grace-period=0", "--force", "--wait=true",
                         "--ignore-not-found", *names, timeout=120)

    def fault(self, *args: str) -> str:
        """`gpu-agent fault` on the host, writing into the running agent's --mock-state file."""
        result = subprocess.run(
            [str(REPO / ".venv" / "bin" / "gpu-agent"), "fault", "--nvml", f"mock:{PRESET}",
             "--mock-state", str(MOCK_STATE), *args], capture_output=True, text=True, check=True, timeout=30)
        return result.stdout

    def kubelet(self, action: str, *args: str) -> None:
        subprocess.run([str(HACK / "kubelet.sh"), action, *args], check=True, timeout=120)

    def kubelet_log(self) -> str:
        return (RUN_DIR / "logs" / "kubelet.log").read_text(errors="replace")


def gpu_pod(name: str, gpus: int, command: str = "echo \"$NVIDIA_VISIBLE_DEVICES\"; sleep 3600") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,  # the pod needs no API access
            "restartPolicy": "Never",
            "containers": [{
                "name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
                "command": ["sh", "-c", command],
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }],
        },
    }


def eventually(check: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError, subprocess.SubprocessError) as err:
            last = err
        if time.monotonic() > deadline:
            detail = f" (last: {last})" if last else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")
        time.sleep(interval)
