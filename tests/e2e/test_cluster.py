"""The agent as users run it: its image built from the Dockerfile, daemonset/ applied (through the overlay that
swaps real GPUs for the fake NVML of a DGX H100), a real kubelet, containerd and control plane (hack/cluster).
Everything is checked through what a user sees: kubectl, the Node, pods and their containers."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cluster import KUBECTL, NAMESPACE, NODE, PRESET, REPO, RUN_DIR, TIMES, Cluster, eventually, gpu_pod

pytestmark = pytest.mark.timeout(600)

# A DGX H100, as NVIDIA documents it: eight H100 SXM5 80GB (81559 MiB as NVML reports it), compute capability
# 9.0, four GPUs on each of two CPU sockets, every pair connected through the NVSwitches.
EXPECTED_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.family": "hopper",
    "nvidia.com/gpu.compute.major": "9",
    "nvidia.com/gpu.compute.minor": "0",
    "nvidia.com/mig.capable": "true",
    "gpu-node-agent.io/numa.nodes": "2",
    "gpu-node-agent.io/numa.max-gpus": "4",
    "gpu-node-agent.io/nvlink.full-mesh": "true",
}
TAINT_KEY = "gpu-node-agent.io/gpu-fault"


def gpu_uuids() -> list[str]:
    """The preset's GPU UUIDs by index, as `gpu-agent inspect` shows them."""
    out = subprocess.run([str(REPO / ".venv" / "bin" / "gpu-agent"), "inspect", "--nvml", f"mock:{PRESET}", "--json"],
                         capture_output=True, text=True, check=True).stdout
    return [g["uuid"] for g in sorted(json.loads(out)["gpus"], key=lambda g: g["index"])]


def visible_devices(cluster: Cluster, pod: str) -> set[str]:
    """What the container was given in NVIDIA_VISIBLE_DEVICES (the pod prints it first thing)."""
    def printed() -> str:
        return cluster.kubectl("logs", "-n", "default", pod, check=False).strip()
    line = eventually(printed, 60, f"{pod} to print NVIDIA_VISIBLE_DEVICES")
    return set(line.splitlines()[0].split(","))


def wait_running(cluster: Cluster, pod: str, timeout: float = 90) -> None:
    eventually(lambda: cluster.get("pod", "-n", "default", pod)["status"].get("phase") == "Running", timeout,
               f"pod {pod} Running")


def agent_registrations(cluster: Cluster) -> int:
    """How often the kubelet logged a registration of nvidia.com/gpu by the agent."""
    return sum("Got registration request from device plugin" in line and 'resourceName="nvidia.com/gpu"' in line
               for line in cluster.kubelet_log().splitlines())


# --- the DaemonSet on the node ------------------------------------------------------------------------------------


@pytest.mark.matrix
def test_agent_pod_is_ready_and_the_kubelet_advertises_eight_gpus(cluster: Cluster) -> None:
    pod = cluster.get("pod", "-n", NAMESPACE, cluster.agent_pod())
    conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conditions["Ready"] == "True"
    assert pod["status"]["containerStatuses"][0]["ready"] is True
    assert pod["spec"]["nodeName"] == NODE
    node = cluster.node()
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    labels = node["metadata"]["labels"]
    assert {k: labels.get(k) for k in EXPECTED_LABELS} == EXPECTED_LABELS
    gpu_healthy = {c["type"]: c for c in node["status"]["conditions"]}["GPUHealthy"]
    assert (gpu_healthy["status"], gpu_healthy["message"]) == ("True", "all 8 GPUs healthy")
    described = cluster.kubectl("describe", "node", NODE)
    assert described.count("nvidia.com/gpu:     8") == 2, described  # Capacity and Allocatable


# --- pods on the GPUs ---------------------------------------------------------------------------------------------


@pytest.mark.matrix
def test_gpu_pods_get_the_preferred_gpus_and_too_many_gpus_stay_pending(cluster: Cluster) -> None:
    uuids = gpu_uuids()
    try:
        cluster.apply(gpu_pod("two-gpus", 2))
        wait_running(cluster, "two-gpus")
        # GPUs 0 and 1: one NUMA node and one PCIe switch (every pair has the same NVSwitch bandwidth on a DGX).
        assert visible_devices(cluster, "two-gpus") == {uuids[0], uuids[1]}
        # Without a preference the kubelet takes the first IDs in sort order: GPU 0 and GPU 5, across sockets.
        # Three more fit only on the other NUMA node, which still has all four of its GPUs.
        cluster.apply(gpu_pod("three-gpus", 3))
        wait_running(cluster, "three-gpus")
        three = visible_devices(cluster, "three-gpus")
        assert len(three) == 3 and three <= set(uuids[4:8]), three

        cluster.apply(gpu_pod("four-gpus", 4))
        def unschedulable() -> str:
            pod = cluster.get("pod", "-n", "default", "four-gpus")
            scheduled = {c["type"]: c for c in pod["status"].get("conditions", [])}.get("PodScheduled", {})
            return scheduled.get("reason") == "Unschedulable" and scheduled.get("message", "")
        message = eventually(unschedulable, 60, "four-gpus (three are free) to be unschedulable")
        assert "Insufficient nvidia.com/gpu" in message
        assert cluster.get("pod", "-n", "default", "four-gpus")["status"]["phase"] == "Pending"
    finally:
        cluster.delete_pods("two-gpus", "three-gpus", "four-gpus")


def agent_metrics(cluster: Cluster) -> str:
    """The agent's /metrics, read inside its own pod (the endpoint listens on the node's network)."""
    return cluster.kubectl("exec", "-n", NAMESPACE, cluster.agent_pod(), "--", "python", "-c",
                           "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9400/metrics', "
                           "timeout=10).read().decode())")


def test_a_two_gpu_pod_is_named_on_exactly_its_gpus_metrics_until_it_ends(cluster: Cluster) -> None:
    # dcgm-exporter's labels: pod and namespace on the series of the GPUs a container holds, from the kubelet's
    # PodResources API, updated each collection pass (10 s by default).
    def held() -> set[str]:
        return set(re.findall(r'^DCGM_FI_DEV_GPU_TEMP\{[^}]*UUID="([^"]+)"[^}]*pod="metrics-two",namespace="default"',
                              agent_metrics(cluster), re.M))
    try:
        cluster.apply(gpu_pod("metrics-two", 2))
        wait_running(cluster, "metrics-two")
        expected = visible_devices(cluster, "metrics-two")
        assert len(expected) == 2
        eventually(lambda: held() == expected, 60, "the pod's labels on its two GPUs' series")
    finally:
        cluster.delete_pods("metrics-two")
    eventually(lambda: held() == set(), 60, "the pod's labels gone after it ended")


# --- faults -------------------------------------------------------------------------------------------------------


def test_a_gpu_fault_injected_from_the_host_lowers_allocatable_taints_and_recovers(cluster: Cluster) -> None:
    assert cluster.allocatable() == "8"
    cluster.fault("lost", "3")
    eventually(lambda: cluster.allocatable() == "7", 90, "Allocatable nvidia.com/gpu: 7")
    def own_taints() -> list[dict[str, str]]:
        return [{k: t[k] for k in ("key", "value", "effect")} for t in cluster.node()["spec"].get("taints", [])
                if t["key"] == TAINT_KEY]
    assert eventually(own_taints, 60, "the agent's taint") == [
        {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
    node = cluster.node()
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    cluster.fault("clear", "3")
    eventually(lambda: cluster.allocatable() == "8", 120, "Allocatable nvidia.com/gpu: 8 again")
    eventually(lambda: own_taints() == [], 60, "the taint removed")


# --- a GPU taken out of service -----------------------------------------------------------------------------------

CORDON = "gpu-node-agent.io/cordon"


def cordon_state(cluster: Cluster) -> str | None:
    """The agent's gpu-node-agent.io/cordon.state annotation on the Node."""
    return cluster.node()["metadata"].get("annotations", {}).get(f"{CORDON}.state")


def test_cordoned_gpus_keep_their_pod_running_and_the_next_pod_gets_another_gpu(cluster: Cluster) -> None:
    uuids = gpu_uuids()
    try:
        cluster.apply(gpu_pod("cordon-held", 1))
        wait_running(cluster, "cordon-held")
        (held,) = visible_devices(cluster, "cordon-held")
        index = uuids.index(held)
        # The held GPU's NUMA node, all four: the next one-GPU pod must go to the other node.
        quad = [i for i in range(8) if i // 4 == index // 4]
        started = time.monotonic()
        cluster.kubectl("annotate", "node", NODE, f"{CORDON}={','.join(map(str, quad))}")
        eventually(lambda: cluster.allocatable() == "4", 30, "Allocatable nvidia.com/gpu: 4")
        TIMES["cordon annotated -> Allocatable on the Node"] = time.monotonic() - started
        assert cluster.capacity()["nvidia.com/gpu"] == "8"
        expected = "; ".join(f"GPU {i} ({uuids[i]}): " + ("held by default/cordon-held" if i == index else "free")
                             for i in quad)
        eventually(lambda: cordon_state(cluster) == expected, 30, "the Node saying who holds the cordoned GPUs")
        assert cluster.get("pod", "-n", "default", "cordon-held")["status"]["phase"] == "Running"

        cluster.apply(gpu_pod("cordon-next", 1))
        wait_running(cluster, "cordon-next")
        (given,) = visible_devices(cluster, "cordon-next")
        assert uuids.index(given) not in quad, (given, quad)
        assert cluster.get("pod", "-n", "default", "cordon-held")["status"]["phase"] == "Running"

        cluster.kubectl("annotate", "node", NODE, f"{CORDON}-")
        eventually(lambda: cluster.allocatable() == "8", 30, "Allocatable nvidia.com/gpu: 8 again")
        eventually(lambda: cordon_state(cluster) is None, 30, "the agent's answer removed")
    finally:
        cluster.kubectl("annotate", "node", NODE, f"{CORDON}-", check=False)
        cluster.delete_pods("cordon-held", "cordon-next")


def test_a_lost_gpu_keeps_the_taint_through_an_agent_restart_and_a_hung_gpu_never_holds_a_stop(
        cluster: Cluster) -> None:
    uuids = gpu_uuids()
    def own_taints() -> list[dict[str, str]]:
        return [{k: t[k] for k in ("key", "value", "effect")} for t in cluster.node()["spec"].get("taints", [])
                if t["key"] == TAINT_KEY]
    tainted = [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
    # NVML keeps giving GPU 3's handle, and fails every call on it.
    cluster.fault("lost-handle", "3")
    try:
        eventually(lambda: cluster.allocatable() == "7", 90, "Allocatable nvidia.com/gpu: 7")
        assert eventually(own_taints, 60, "the agent's taint") == tainted

        # The agent pod is deleted and the DaemonSet makes a new one: the taint is on the Node throughout.
        seen: list[list[dict[str, str]]] = []
        stop = threading.Event()
        def follow_taints() -> None:
            while not stop.is_set():
                seen.append(own_taints())
                time.sleep(0.1)
        watcher = threading.Thread(target=follow_taints, daemon=True)
        watcher.start()
        try:
            old = cluster.agent_pod()
            cluster.kubectl("delete", "pod", "-n", NAMESPACE, old, "--wait=true", timeout=60)
            def new_agent_ready() -> bool:
                pods = [p for p in cluster.agent_pods() if p["metadata"]["name"] != old]
                return any(c["type"] == "Ready" and c["status"] == "True"
                           for p in pods for c in p["status"].get("conditions", []))
            eventually(new_agent_ready, 120, "the new agent pod Ready")
        finally:
            stop.set()
            watcher.join()
        assert seen and all(t == tainted for t in seen), [t for t in seen if t != tainted][:3]
        assert cluster.capacity() == {"nvidia.com/gpu": "8"}
        assert cluster.allocatable() == "7"
        condition = {c["type"]: c for c in cluster.node()["status"]["conditions"]}["GPUHealthy"]
        assert (condition["status"], condition["reason"]) == ("False", "NodeGPUFault")
        assert cluster.node()["metadata"]["labels"]["gpu-node-agent.io/gpu.lost"] == "1"
        # The new agent names the lost GPU by the UUID the old one read (its Event, in `kubectl describe node`).
        described = eventually(lambda: (d := cluster.kubectl("describe", "node", NODE))
                               and f"GPU {uuids[3]}: GPU is lost" in d and d, 30, "the lost GPU's Event")
        assert "nvidia.com/gpu:     8" in described and "nvidia.com/gpu:     7" in described

        # GPU 5's calls stop returning: Unhealthy once past the deadline, and a stop of the agent never waits on it.
        cluster.fault("hang", "5")
        hung = time.monotonic()
        eventually(lambda: cluster.allocatable() == "6", 30, "Allocatable nvidia.com/gpu: 6", interval=0.1)
        TIMES["GPU hung -> Allocatable 6 on the Node (deadline 10 s)"] = time.monotonic() - hung
        old = cluster.agent_pod()
        started = time.monotonic()
        cluster.kubectl("delete", "pod", "-n", NAMESPACE, old, "--wait=true", timeout=60)
        TIMES["agent pod deleted with a GPU hung -> gone"] = time.monotonic() - started
        assert time.monotonic() - started < 30  # the DaemonSet's terminationGracePeriodSeconds
        cluster.fault("unhang", "5")
    finally:
        cluster.fault("unhang", "5")
        cluster.fault("clear", "3")
    eventually(lambda: cluster.allocatable() == "8", 120, "Allocatable nvidia.com/gpu: 8 again")
    eventually(lambda: own_taints() == [], 60, "the taint removed")
    eventually(lambda: cluster.agent_pods() and cluster.agent_pod(), 60, "one running agent pod")


# --- the kubelet's Topology Manager -------------------------------------------------------------------------------


def test_single_numa_node_topology_policy_uses_the_agents_topology_info(cluster: Cluster) -> None:
    uuids = gpu_uuids()
    cluster.kubelet("restart", "--topology-manager-policy", "single-numa-node")
    try:
        eventually(lambda: cluster.allocatable() == "8", 90, "Allocatable 8 after the kubelet restart")
        cluster.apply(gpu_pod("four-gpus", 4))
        wait_running(cluster, "four-gpus")
        assert visible_devices(cluster, "four-gpus") == set(uuids[0:4])  # NUMA node 0
        cluster.delete_pods("four-gpus")

        # Eight GPUs free, but no NUMA node has five: the scheduler places the pod, the kubelet refuses it.
        cluster.apply(gpu_pod("five-gpus", 5))
        def rejected() -> Any:
            status = cluster.get("pod", "-n", "default", "five-gpus")["status"]
            return status.get("phase") == "Failed" and status
        status = eventually(rejected, 60, "five-gpus rejected by the kubelet")
        assert status["reason"] == "TopologyAffinityError"
    finally:
        cluster.delete_pods("four-gpus", "five-gpus")
        cluster.kubelet("restart")
        eventually(lambda: cluster.allocatable() == "8", 90, "Allocatable 8 after the kubelet restart")


def test_after_a_kubelet_restart_the_agent_registers_again(cluster: Cluster) -> None:
    before = agent_registrations(cluster)
    cluster.kubelet("stop")
    started = time.monotonic()
    cluster.kubelet("start")
    eventually(lambda: agent_registrations(cluster) > before, 60, "the agent to register again", interval=0.05)
    TIMES["kubelet restart -> agent registered again"] = time.monotonic() - started
    eventually(lambda: cluster.allocatable() == "8", 60, "Allocatable 8", interval=0.1)
    TIMES["kubelet restart -> Allocatable 8 on the Node"] = time.monotonic() - started


# --- the agent's identity -----------------------------------------------------------------------------------------


def test_the_agents_own_token_is_refused_another_nodes_patch_and_secrets(cluster: Cluster) -> None:
    pod = cluster.agent_pod()
    # Just after a kubelet restart the kubelet answers exec with "pod does not exist" until it has synced its pods.
    token = eventually(lambda: cluster.kubectl(
        "exec", "-n", NAMESPACE, pod, "--", "python", "-c",
        "print(open('/var/run/secrets/kubernetes.io/serviceaccount/token').read())").strip(), 60, "the agent's token")
    cluster.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "other-node"}})
    ca = base64.b64encode((RUN_DIR / "pki" / "ca.crt").read_bytes()).decode()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "agent.kubeconfig"
        config.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "agent",
            "clusters": [{"name": "local", "cluster": {"server": "https://127.0.0.1:6443",
                                                       "certificate-authority-data": ca}}],
            "users": [{"name": "agent", "user": {"token": token}}],
            "contexts": [{"name": "agent", "context": {"cluster": "local", "user": "agent"}}],
        }))

        def as_agent(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([str(KUBECTL), *args,
                                   f"--kubeconfig={config}"], capture_output=True, text=True, check=False, timeout=30)

        try:
            assert as_agent("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout == (
                "system:serviceaccount:gpu-node-agent:gpu-node-agent")
            # Its own Node it may read; another Node it may not patch, and no Secret may it read.
            assert as_agent("get", "node", NODE, "-o", "name").stdout.strip() == f"node/{NODE}"
            patch = as_agent("label", "node", "other-node", "nvidia.com/gpu.present=true")
            assert patch.returncode != 0
            assert "other-node" in patch.stderr and ("forbidden" in patch.stderr.lower() or "denied" in patch.stderr)
            secrets = as_agent("get", "secrets", "-n", NAMESPACE)
            assert secrets.returncode != 0 and "forbidden" in secrets.stderr.lower(), secrets.stderr
            assert "nvidia.com/gpu.present" not in cluster.get("node", "other-node")["metadata"].get("labels", {})
        finally:
            cluster.kubectl("delete", "node", "other-node", "--ignore-not-found")


# --- a rolling update ---------------------------------------------------------------------------------------------


def test_a_rolling_update_never_runs_two_agents_and_restores_allocatable(cluster: Cluster) -> None:
    ds = cluster.get("daemonset", "-n", NAMESPACE, "gpu-node-agent")
    image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
    new_image = f"{image}-rollout"
    subprocess.run(["ctr", "--address", str(RUN_DIR / "containerd" / "containerd.sock"), "-n", "k8s.io",
                    "images", "tag", "--force", image, new_image], check=True, capture_output=True)
    seen: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def running_agents() -> None:
        # containerd's own view: agent containers whose task is running, polled as fast as ctr answers.
        sock = str(RUN_DIR / "containerd" / "containerd.sock")
        while not stop.is_set():
            ctr = ["ctr", "--address", sock, "-n", "k8s.io"]
            containers = subprocess.run([*ctr, "containers", "ls"], capture_output=True, text=True).stdout
            agents = {line.split()[0] for line in containers.splitlines()[1:] if "localhost/gpu-node-agent" in line}
            tasks = subprocess.run([*ctr, "tasks", "ls"], capture_output=True, text=True).stdout
            live = [line.split()[0] for line in tasks.splitlines()[1:] if line.split()[2] == "RUNNING"
                    and line.split()[0] in agents]
            seen.append((time.monotonic(), len(live), ",".join(sorted(live))))
            time.sleep(0.05)

    watcher = threading.Thread(target=running_agents, daemon=True)
    watcher.start()
    try:
        old = cluster.agent_pod()
        cluster.kubectl("set", "image", "-n", NAMESPACE, "daemonset/gpu-node-agent", f"gpu-node-agent={new_image}")
        cluster.kubectl("rollout", "status", "-n", NAMESPACE, "daemonset/gpu-node-agent", "--timeout=180s",
                        timeout=200)
        returned = time.monotonic()
        eventually(lambda: cluster.allocatable() == "8", 60, "Allocatable 8 after the rollout", interval=0.1)
        restored = time.monotonic()
    finally:
        stop.set()
        watcher.join()
    assert cluster.agent_pod() != old
    assert max(n for _, n, _ in seen) == 1, [s for s in seen if s[1] > 1][:5]
    first = seen[0][2]
    stopped = next(t for t, n, ids in seen if ids != first)
    TIMES["rolling update: old agent stopped -> new pod Ready (rollout status)"] = returned - stopped
    TIMES["rolling update: old agent stopped -> Allocatable 8 on the Node"] = restored - stopped
    # With readiness waiting for the Node's Allocatable, the Node shows the GPUs by the time rollout status returns.
    assert restored - returned < 1.0, restored - returned


# --- MIG through the node label -----------------------------------------------------------------------------------


def mig_states(cluster: Cluster, until: set[str], timeout: float, listed: threading.Event) -> list[str]:
    """The node's nvidia.com/mig.config.state values as a watch sees them, until one in `until` after the first.
    `listed` is set once the watch has shown the Node as it is: kubectl lists, then watches from the list's
    version, so no change made after that is missed."""
    watch = subprocess.Popen(
        [str(KUBECTL), "get", "node", NODE, "--watch",
         "-o", r'jsonpath={.metadata.labels.nvidia\.com/mig\.config\.state}{"\n"}'],
        stdout=subprocess.PIPE, text=True)
    states: list[str] = []
    timer = threading.Timer(timeout, watch.kill)
    timer.start()
    try:
        assert watch.stdout is not None
        for line in watch.stdout:
            state = line.strip()
            if state and (not states or states[-1] != state):
                states.append(state)
            if listed.is_set() and state in until:
                break
            listed.set()
    finally:
        timer.cancel()
        watch.kill()
        watch.wait()
    return states


def test_a_mig_label_drives_the_layout_and_the_kubelet_advertises_mig_devices(cluster: Cluster) -> None:
    # migStrategy mixed: an operator's config change, picked up by a new agent pod.
    config = cluster.get("configmap", "-n", NAMESPACE, "gpu-node-agent-config")
    text = config["data"]["config.yaml"] + "flags:\n  migStrategy: mixed\n"
    cluster.kubectl("patch", "configmap", "-n", NAMESPACE, "gpu-node-agent-config", "--type=merge",
                    "-p", json.dumps({"data": {"config.yaml": text}}))
    cluster.kubectl("rollout", "restart", "-n", NAMESPACE, "daemonset/gpu-node-agent")
    cluster.kubectl("rollout", "status", "-n", NAMESPACE, "daemonset/gpu-node-agent", "--timeout=180s", timeout=200)

    states: list[str] = []
    listed = threading.Event()
    watcher = threading.Thread(
        target=lambda: states.extend(mig_states(cluster, {"success", "failed"}, 180, listed)))
    watcher.start()
    assert listed.wait(30), "kubectl get --watch showed no Node"
    cluster.kubectl("label", "node", NODE, "nvidia.com/mig.config=all-1g.10gb", "--overwrite")
    watcher.join()
    assert states[-2:] == ["pending", "success"], states
    eventually(lambda: cluster.capacity().get("nvidia.com/mig-1g.10gb") == "56", 90,
               "Capacity nvidia.com/mig-1g.10gb: 56 (seven on each of eight GPUs)")
    assert cluster.node()["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] == "56"
    eventually(lambda: cluster.capacity().get("nvidia.com/gpu") == "0", 60, "no whole GPUs left to advertise")

    # A layout made for another GPU (A100 40GB profiles) cannot be made on an H100: failed, with its reason.
    states.clear()
    listed = threading.Event()
    watcher = threading.Thread(target=lambda: states.extend(mig_states(cluster, {"failed"}, 120, listed)))
    watcher.start()
    assert listed.wait(30), "kubectl get --watch showed no Node"
    cluster.kubectl("label", "node", NODE, "nvidia.com/mig.config=all-1g.5gb", "--overwrite")
    watcher.join()
    assert states[-1] == "failed", states
    node = cluster.node()
    reason = node["metadata"]["annotations"]["nvidia.com/mig.config.state.reason"]
    assert "1g.5gb" in reason, reason
    events = cluster.get("events", "-n", "default", "--field-selector", f"involvedObject.name={NODE}")["items"]
    failed = [e for e in events if e["reason"] == "MigConfigFailed"]
    assert failed and failed[-1]["type"] == "Warning" and "all-1g.5gb" in failed[-1]["message"]
    # The devices of the layout in force are still advertised.
    assert cluster.capacity().get("nvidia.com/mig-1g.10gb") == "56"
