"""hack/cluster/overlay changes only what a machine without GPUs needs: the image and the NVML backend."""

from __future__ import annotations

import copy
import subprocess
from typing import Any

import yaml
from cluster import REPO

from tests.releases import kube_bin

KUBECTL = kube_bin() / "kubectl"


def render(path: str) -> dict[tuple[str, str], Any]:
    out = subprocess.run([str(KUBECTL), "kustomize", str(REPO / path)], capture_output=True, text=True, check=True,
                         env={"KUBECONFIG": "/dev/null", "PATH": "/usr/bin:/bin"}).stdout
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out)}


def test_the_overlay_changes_only_the_image_and_the_nvml_backend() -> None:
    base, overlay = render("daemonset"), render("hack/cluster/overlay")
    assert overlay.keys() == base.keys()
    expected = copy.deepcopy(base)
    container = expected["DaemonSet", "gpu-node-agent"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "gpu-node-agent:0.1.0" and container["args"][5:7] == ["--nvml", "real"]
    container["image"] = "localhost/gpu-node-agent:0.1.0"
    container["args"][6] = "mock:dgx-h100"
    # In the agent's own state hostPath (/var/lib/gpu-node-agent), where `gpu-agent fault` on the host finds it.
    container["args"] += ["--mock-state", "/var/lib/gpu-node-agent/mock-nvml.json"]
    assert overlay == expected
