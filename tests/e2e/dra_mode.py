"""DRA mode on the cluster, shared by the e2e modules that move the node to it: the driver's names and paths on the
node, the node's ResourceSlice, the agent Pod's UID and sockets, and `dra_mode`, which moves the node to DRA mode as
docs/dra.md says and back (conftest.py gives it to each module as the fixture `dra_node`)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster import BUSYBOX, NAMESPACE, NODE, PRESET, REPO, RUN_DIR, TIMES, Cluster, eventually

DRIVER = "gpu.gpu-node-agent.io"
SLICE = f"{NODE}-{DRIVER}"
TEMPLATE = REPO / "deployments" / "dra" / "examples" / "two-gpus-one-nvlink-domain.yaml"
KUBELET = Path("/var/lib/kubelet")
REGISTRY = KUBELET / "plugins_registry"
PLUGIN_DIR = KUBELET / "plugins" / DRIVER
CHECKPOINT = KUBELET / "plugins" / DRIVER / "checkpoint.json"
CDI_DIR = Path("/var/run/cdi")
NVIDIA_MAJOR = 195
"""The NVIDIA driver's character device major (/proc/devices: nvidia-frontend), which the stand-ins have."""


def preset_gpus() -> list[dict[str, Any]]:
    """The preset's GPUs by index, as `gpu-agent inspect` shows them."""
    out = subprocess.run([str(REPO / ".venv" / "bin" / "gpu-agent"), "inspect", "--nvml", f"mock:{PRESET}", "--json"],
                         capture_output=True, text=True, check=True).stdout
    gpus: list[dict[str, Any]] = sorted(json.loads(out)["gpus"], key=lambda g: g["index"])
    return gpus


def the_slice(cluster: Cluster) -> Any:
    return cluster.get("resourceslice", SLICE)


def node_slices(cluster: Cluster) -> list[str]:
    items = cluster.get("resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    return [s["metadata"]["name"] for s in items]


def agent_log(cluster: Cluster, pod: str | None = None) -> str:
    return cluster.kubectl("logs", "-n", NAMESPACE, pod or cluster.agent_pod())


def agent_uid(cluster: Cluster, pod: str | None = None) -> str:
    """The agent Pod's UID, which names its DRA sockets (POD_UID, from the Component deployments/dra/mode)."""
    uid: str = cluster.get("pod", "-n", NAMESPACE, pod or cluster.agent_pod())["metadata"]["uid"]
    return uid


def registration_socket(uid: str) -> Path:
    return REGISTRY / f"{DRIVER}-{uid}-reg.sock"


def dra_socket(uid: str) -> Path:
    return PLUGIN_DIR / f"dra-{uid}.sock"


def sockets(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_socket()) if folder.exists() else []


def rolled_out(cluster: Cluster) -> None:
    cluster.kubectl("rollout", "status", "-n", NAMESPACE, "daemonset/gpu-node-agent", "--timeout=120s", timeout=140)


def agent_setup(cluster: Cluster) -> tuple[Any, Any]:
    """The agent's DaemonSet pod spec and its config, to compare after a module went back to device-plugin mode."""
    return (cluster.get("daemonset", "-n", NAMESPACE, "gpu-node-agent")["spec"]["template"]["spec"],
            cluster.get("configmap", "-n", NAMESPACE, "gpu-node-agent-config")["data"])


def device_plugin_mode_again(cluster: Cluster) -> None:
    """docs/dra.md, going back: the device-plugin DaemonSet and config again, the DRA objects deleted, and every GPU
    through the device plugin again."""
    cluster.kubectl("apply", "--server-side", "-k", str(RUN_DIR / "kustomize"))
    cluster.kubectl("delete", "-k", str(REPO / "deployments" / "dra"), "--ignore-not-found", "--wait=true")
    rolled_out(cluster)
    eventually(lambda: cluster.allocatable() == "8", 90, "Allocatable nvidia.com/gpu: 8 again")


def left_as_before(cluster: Cluster, before: tuple[Any, Any]) -> None:
    """The DaemonSet's pods and the config exactly as `before` (no DRA mount, no dra key), and no DRA registration."""
    assert agent_setup(cluster) == before
    assert [name for name in sockets(REGISTRY) if name.startswith(DRIVER)] == []


class SlicesGone(threading.Thread):
    """Looks at the node's ResourceSlices every half second from `since`, for up to 60 s, until there are none: the
    kubelet deletes the slices of a driver that left 30 s after it unregistered. It runs beside the next module's
    tests; `check` waits for it and fails if a slice was left."""

    def __init__(self, cluster: Cluster, since: float, what: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.since, self.what = cluster, since, what
        self.left: list[str] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while (left := node_slices(self.cluster)) and time.monotonic() < self.since + 60:
                time.sleep(0.5)
            self.left = left
            if not left:
                TIMES[f"{self.what}device-plugin mode applied again -> the kubelet deleted the slice"] = (
                    time.monotonic() - self.since)
        except BaseException as err:  # handed to check()
            self.error = err

    def check(self) -> None:
        self.join(75)
        if self.error is not None:
            raise self.error
        assert self.left == [], f"the kubelet left the node's ResourceSlices {self.left} 60 s after the driver left"


@dataclass
class Visit:
    """The node's stay in DRA mode across the modules of a session."""

    before: tuple[Any, Any] | None = None
    """The device-plugin setup (agent_setup) the first module of the stay found; None in device-plugin mode."""
    following: Any = None
    """The test after the one ending (conftest.py's pytest_runtest_teardown), whose fixtures a module's teardown
    asks about."""
    slices: SlicesGone | None = None
    """The last stay's slices going, watched beside what follows until `slices_gone`."""


def slices_gone() -> None:
    """Wait until the kubelet deleted the slices the last stay in DRA mode left (at most 60 s after it went back),
    and fail if it did not: before the next stay, before a module that changes the DaemonSet, at the session's
    end."""
    watch, VISIT.slices = VISIT.slices, None
    if watch is not None:
        watch.check()


VISIT = Visit()
DRA_FIXTURES = ("dra_node", "capacity_node")
"""The module fixtures that put the node in DRA mode."""


def enter_dra_mode(cluster: Cluster, kustomization: Path) -> None:
    """Apply `kustomization` (DRA mode, perhaps another config of it) and wait for the rollout. From device-plugin
    mode, the setup found is kept for leave_dra_mode to compare with."""
    if VISIT.before is None:
        slices_gone()
        assert cluster.allocatable() == "8"
        VISIT.before = agent_setup(cluster)
    cluster.kubectl("apply", "--server-side", "-k", str(kustomization))
    rolled_out(cluster)


def leave_dra_mode(cluster: Cluster, what: str = "") -> bool:
    """Back in device-plugin mode with nothing of DRA mode left, unless the next module's tests are in DRA mode too:
    then the node stays, and the last module of the stay goes back (the kubelet's 30 s before it deletes the slices
    of a driver that left are waited once, beside the next module: slices_gone). Returns whether it went back."""
    following = VISIT.following
    if following is not None and any(f in getattr(following, "fixturenames", ()) for f in DRA_FIXTURES):
        return False
    before, VISIT.before = VISIT.before, None
    back = time.monotonic()
    device_plugin_mode_again(cluster)
    TIMES[f"{what}device-plugin mode applied again -> Allocatable nvidia.com/gpu 8"] = time.monotonic() - back
    assert before is not None
    left_as_before(cluster, before)
    VISIT.slices = SlicesGone(cluster, back, what)
    VISIT.slices.start()
    return True


def dra_mode(cluster: Cluster) -> Iterator[Cluster]:
    """The node in DRA mode for this module, then back in device-plugin mode with nothing of DRA mode left (or still
    in DRA mode for the next module: leave_dra_mode)."""
    started = time.monotonic()
    try:
        enter_dra_mode(cluster, RUN_DIR / "kustomize-dra")
        eventually(lambda: len(the_slice(cluster)["spec"]["devices"]) == 8, 60, "the node's ResourceSlice")
        TIMES["DRA mode applied -> ResourceSlice with 8 GPUs"] = time.monotonic() - started
        yield cluster
    finally:
        leave_dra_mode(cluster)


def claim_pod(name: str, template: str, claim: str = "gpus", command: str | None = None) -> dict[str, Any]:
    """A pod holding one claim (the pod's name for it: `claim`) made from `template`; by default it prints what its
    container was given, then sleeps."""
    if command is None:
        command = ('echo "VISIBLE $NVIDIA_VISIBLE_DEVICES"; '
                   "for d in /dev/nvidia*; do [ -e \"$d\" ] && stat -c 'DEV %n %F %t:%T' \"$d\"; done; sleep 3600")
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "resourceClaims": [{"name": claim, "resourceClaimTemplateName": template}],
            "containers": [{
                "name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
                "command": ["sh", "-c", command],
                "resources": {"claims": [{"name": claim}]},
            }],
        },
    }
