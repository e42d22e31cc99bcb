"""The agent on a real single-node cluster (hack/cluster): how long a user waits, as the Node and the kubelet show it.

- DaemonSet applied -> the Node's Allocatable shows the GPUs (on a node whose kubelet had no agent before);
- kubelet restart -> the agent registered again (the kubelet's own log line) and Allocatable back on the Node;
- GPU pod created -> the agent answered Allocate (its gpu_agent_allocations_total counter, read from /metrics);
- a burst of 50 single-GPU pods created at once on the node shared by time-slicing (8 replicas per GPU, 64
  nvidia.com/gpu): each pod created -> its Allocate answered and -> Running, p50 and p99 over the 50.

Needs root and no cluster already running; brings one up with the agent's image built from the Dockerfile and
takes it down afterwards. Run by bench/run.py; alone: python bench/cluster_bench.py [--runs N] [--out FILE]
(default bench/out/cluster.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HACK = ROOT / "hack" / "cluster"
RUN_DIR = Path(os.environ.get("CLUSTER_RUN_DIR", "/run/gpu-node-agent-cluster"))
NODE = os.environ.get("CLUSTER_NODE_NAME", "gpu-node-1")
NETNS = os.environ.get("CLUSTER_NETNS", "gpu-node-agent")
PRESET = "dgx-h100"
GPUS = "8"
POLL_S = 0.05
BURST_PODS = 50
BURST_REPLICAS = 8
"""Time-slicing replicas per GPU for the burst: 8 GPUs x 8 = 64 nvidia.com/gpu, room for the 50 pods."""
ALLOCATIONS = re.compile(r'^gpu_agent_allocations_total\{resource="nvidia.com/gpu"\} ([0-9.e+]+)$', re.M)


def kubectl(*args: str, input: str | None = None, check: bool = True) -> str:
    result = subprocess.run([str(HACK / "kubectl"), *args], input=input, capture_output=True, text=True,
                            timeout=240, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def allocatable() -> str:
    return kubectl("get", "node", NODE, "-o", r"jsonpath={.status.allocatable.nvidia\.com/gpu}")


def until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls `check` every POLL_S; the monotonic time at which it first held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic()


def registrations() -> int:
    log = (RUN_DIR / "logs" / "kubelet.log").read_text(errors="replace")
    return sum("Got registration request from device plugin" in line and 'resourceName="nvidia.com/gpu"' in line
               for line in log.splitlines())


def allocations(pod_ip: str) -> float:
    metrics = subprocess.run(["nsenter", f"--net=/run/netns/{NETNS}", "curl", "-fsS", "--max-time", "2",
                              f"http://{pod_ip}:9400/metrics"], capture_output=True, text=True, check=False).stdout
    found = ALLOCATIONS.search(metrics)
    return float(found.group(1)) if found else 0.0


def summary(samples: list[float]) -> dict[str, Any]:
    return {"samples_s": [round(s, 2) for s in samples], "median_s": round(statistics.median(samples), 2),
            "max_s": round(max(samples), 2)}


def apply_to_allocatable(runs: int) -> dict[str, Any]:
    kubectl("label", "node", NODE, "nvidia.com/gpu.present=true", "--overwrite")
    samples = []
    for _ in range(runs):
        started = time.monotonic()
        kubectl("apply", "--server-side", "-k", str(RUN_DIR / "kustomize"))
        samples.append(until(lambda: allocatable() == GPUS, 180, "Allocatable 8") - started)
        kubectl("delete", "daemonset", "-n", "gpu-node-agent", "gpu-node-agent", "--wait=true")
        until(lambda: not kubectl("get", "pods", "-n", "gpu-node-agent", "-o", "name"), 120, "the agent pod gone")
        until(lambda: allocatable() == "0", 120, "Allocatable 0 once the agent is gone")
    kubectl("apply", "--server-side", "-k", str(RUN_DIR / "kustomize"))
    kubectl("rollout", "status", "-n", "gpu-node-agent", "daemonset/gpu-node-agent", "--timeout=180s")
    until(lambda: allocatable() == GPUS, 180, "Allocatable 8")
    return summary(samples)


def kubelet_restart(runs: int) -> dict[str, Any]:
    registered, restored = [], []
    for _ in range(runs):
        before = registrations()
        subprocess.run([str(HACK / "kubelet.sh"), "stop"], check=True, timeout=120)
        started = time.monotonic()
        subprocess.run([str(HACK / "kubelet.sh"), "start"], check=True, timeout=120)
        registered.append(until(lambda n=before: registrations() > n, 60, "the agent registered again") - started)
        restored.append(until(lambda: allocatable() == GPUS, 60, "Allocatable 8") - started)
        time.sleep(2)
    return {"registered": summary(registered), "allocatable": summary(restored)}


def pod_to_allocate(runs: int) -> dict[str, Any]:
    pod_ip = agent_pod_ip()
    answered, running = [], []
    for i in range(runs):
        name = f"bench-gpu-{i}"
        pod = gpu_pod(name, 2)
        before = allocations(pod_ip)
        started = time.monotonic()
        kubectl("create", "-f", "-", input=json.dumps(pod))
        answered.append(until(lambda n=before: allocations(pod_ip) > n, 60, "Allocate answered") - started)
        running.append(until(lambda p=name: kubectl("get", "pod", p, "-o", "jsonpath={.status.phase}") == "Running",
                             60, "the pod Running") - started)
        kubectl("delete", "pod", name, "--grace-period=0", "--force", "--wait=true")
    return {"allocate_answered": summary(answered), "running": summary(running)}


def agent_pod_ip() -> str:
    return kubectl("get", "pods", "-n", "gpu-node-agent", "-o", "jsonpath={.items[0].status.podIP}")


def gpu_pod(name: str, gpus: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": labels or {}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "main", "image": "localhost/busybox:local", "imagePullPolicy": "Never",
                                     "command": ["sleep", "3600"],
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def percentile(samples: list[float], q: float) -> float:
    """Nearest rank: the smallest sample with at least q of them at or below it (p99 of 50 is the largest)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def spread(samples: list[float]) -> dict[str, Any]:
    return {"samples_s": [round(s, 3) for s in sorted(samples)], "p50_s": round(percentile(samples, 0.50), 3),
            "p99_s": round(percentile(samples, 0.99), 3), "max_s": round(max(samples), 3)}


def share_gpus(replicas: int) -> None:
    """Time-slicing with `replicas` per GPU in the agent's ConfigMap, the agent restarted on it, and the Node's
    Allocatable grown to match."""
    config = json.loads(kubectl("get", "configmap", "-n", "gpu-node-agent", "gpu-node-agent-config", "-o",
                                "jsonpath={.data}"))["config.yaml"]
    config += f"sharing:\n  timeSlicing:\n    resources:\n      - {{name: nvidia.com/gpu, replicas: {replicas}}}\n"
    kubectl("patch", "configmap", "-n", "gpu-node-agent", "gpu-node-agent-config", "--type=merge", "-p",
            json.dumps({"data": {"config.yaml": config}}))
    kubectl("rollout", "restart", "-n", "gpu-node-agent", "daemonset/gpu-node-agent")
    kubectl("rollout", "status", "-n", "gpu-node-agent", "daemonset/gpu-node-agent", "--timeout=180s")
    want = str(int(GPUS) * replicas)
    until(lambda: allocatable() == want, 180, f"Allocatable {want}")
    until(lambda: len(kubectl("get", "pods", "-n", "gpu-node-agent", "-o", "name").split()) == 1, 120,
          "the old agent pod gone")


def burst(pods: int) -> dict[str, Any]:
    """`pods` single-GPU pods created by one request; for each, creation -> Allocate answered and -> Running.
    The agent's counter gives the moment of each answer, whichever pod it was for: the pods are created together,
    so the answers' times are the pods' times. Each look (the counter, then the pods' phases) takes one poll, and
    its duration is recorded: the figures are no finer than that, and each is taken at the end of the look that saw
    it."""
    share_gpus(BURST_REPLICAS)
    pod_ip = agent_pod_ip()
    names = [f"burst-{i:02d}" for i in range(pods)]
    batch = {"apiVersion": "v1", "kind": "List", "items": [gpu_pod(n, 1, {"bench": "burst"}) for n in names]}
    before = allocations(pod_ip)
    answered: list[float] = []
    running: dict[str, float] = {}
    polls: list[float] = []
    started = time.monotonic()
    kubectl("create", "-f", "-", input=json.dumps(batch))
    deadline = started + 300
    while len(running) < pods or len(answered) < pods:
        if time.monotonic() > deadline:
            raise RuntimeError(f"burst: after 300 s, {len(answered)} Allocate answered and {len(running)} of "
                               f"{pods} pods Running")
        look = time.monotonic()
        count = int(allocations(pod_ip) - before)
        read = time.monotonic()  # an answer counted now came before this moment: the figures err long, not short
        answered += [read - started] * (min(count, pods) - len(answered))
        phases = kubectl("get", "pods", "-n", "default", "-l", "bench=burst", "-o",
                         r"jsonpath={range .items[*]}{.metadata.name}={.status.phase}{'\n'}{end}")
        seen = time.monotonic()
        for line in phases.splitlines():
            name, _, phase = line.partition("=")
            if phase == "Running" and name not in running:
                running[name] = seen - started
        polls.append(seen - look)
        time.sleep(POLL_S)
    kubectl("delete", "pods", "-n", "default", "-l", "bench=burst", "--grace-period=0", "--force", "--wait=true")
    return {"pods": pods, "replicas_per_gpu": BURST_REPLICAS, "allocate_answered": spread(answered),
            "running": spread(list(running.values())), "poll_s": round(statistics.median(polls), 3)}


def measure(runs: int) -> dict[str, Any]:
    """Brings a cluster up without the agent, measures, takes it down (whatever happens)."""
    if os.geteuid() != 0:
        raise RuntimeError("the cluster benchmark needs root (it starts containerd and a kubelet)")
    if RUN_DIR.exists():
        raise RuntimeError(f"a cluster is already running ({RUN_DIR}): make cluster-down first")
    started = time.monotonic()
    try:
        subprocess.run([str(HACK / "up.sh"), PRESET], check=True, timeout=900,
                       env={**os.environ, "CLUSTER_DEPLOY": "0"})
        up_s = time.monotonic() - started
        details = {"runs": runs, "preset": PRESET, "cluster_up_without_agent_s": round(up_s, 1),
                   "apply_to_allocatable": apply_to_allocatable(runs),
                   "kubelet_restart": kubelet_restart(runs),
                   "pod_to_allocate": pod_to_allocate(runs),
                   "burst": burst(BURST_PODS),
                   "kubelet_version": kubectl("get", "node", NODE, "-o", "jsonpath={.status.nodeInfo.kubeletVersion}")}
    finally:
        subprocess.run([str(HACK / "down.sh")], check=True, timeout=300)
    details["duration_s"] = round(time.monotonic() - started, 1)
    return details


def figures(details: dict[str, Any], figure: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows for bench/results.json (reported, no budget), made with bench/run.py's `figure`."""
    node = f"real kubelet {details.get('kubelet_version', 'of the test rig')}, {details['preset']}"
    where = f"{node}, median of {details['runs']}"
    rows = [
        ("cluster.apply_to_allocatable", f"DaemonSet applied -> Node Allocatable nvidia.com/gpu 8, {where}",
         details["apply_to_allocatable"]),
        ("cluster.kubelet_restart.registered", f"kubelet restart -> agent registered again, {where}",
         details["kubelet_restart"]["registered"]),
        ("cluster.kubelet_restart.allocatable", f"kubelet restart -> Node Allocatable 8 again, {where}",
         details["kubelet_restart"]["allocatable"]),
        ("cluster.pod_to_allocate", f"2-GPU pod created -> agent answered Allocate, {where}",
         details["pod_to_allocate"]["allocate_answered"]),
        ("cluster.pod_to_running", f"2-GPU pod created -> pod Running, {where}",
         details["pod_to_allocate"]["running"]),
    ]
    out = [figure(key, label, series["median_s"], "s", "report") for key, label, series in rows]
    if "burst" in details:
        b = details["burst"]
        what = f"{b['pods']} single-GPU pods created at once ({b['replicas_per_gpu']} time-sliced replicas per GPU)"
        out += [figure("cluster.burst_to_allocate", f"{what} -> Allocate answered, p99, {node}",
                       b["allocate_answered"]["p99_s"], "s", "report"),
                figure("cluster.burst_to_running", f"{what} -> pod Running, p99, {node}",
                       b["running"]["p99_s"], "s", "report")]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "cluster.json",
                        help="where the figures are written (default: %(default)s)")
    args = parser.parse_args()
    try:
        details = measure(args.runs)
    except (RuntimeError, subprocess.CalledProcessError) as err:
        print(f"cluster_bench: {err}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(details, indent=2) + "\n")
    print(json.dumps(details, indent=2))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
