"""DRA mode on the real kubelet: the node moved to DRA mode as docs/dra.md says (deployments/dra/ and the Component
deployments/dra/mode on top of the cluster's DaemonSet), a pod with the shipped "2 GPUs on one NVLink domain" claim
scheduled by the real scheduler, prepared by the agent through the real kubelet and started by containerd with the
claim's CDI devices, dynamic MIG claims kept whole through the agent killed in the middle of a prepare and of an
unprepare, and the node moved back to device-plugin mode. conftest.py runs this module first, so the rest
of the e2e tests find the node as the cluster brought it up.

The node has no NVIDIA driver: its GPUs' device nodes are stand-ins (hack/cluster/up.sh makes /dev/nvidia<minor>,
character devices 195:<minor>, under a device root of their own, the agent's flags.nvidiaDevRoot here), which the
CDI specs name as host paths and containerd creates in the containers."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import MOCK_STATE, NAMESPACE, NODE, PRESET, REPO, RUN_DIR, TIMES, Cluster, eventually
from dra_mode import (
    CDI_DIR,
    CHECKPOINT,
    DRIVER,
    KUBELET,
    NVIDIA_MAJOR,
    PLUGIN_DIR,
    REGISTRY,
    SLICE,
    TEMPLATE,
    agent_log,
    agent_uid,
    claim_pod,
    dra_socket,
    node_slices,
    preset_gpus,
    registration_socket,
    rolled_out,
    sockets,
    the_slice,
)
from pod_status import HEALTH_TEMPLATE, follow_health, template_claim_pod, wait_running

from agent.nvml.backend import fake_backend
from agent.nvml.fake import CRASH_AFTER_ENV, FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import load_node
from tests.releases import on_by_default, release_name

pytestmark = [pytest.mark.timeout(300)]
# Every test but the crash test depends on the release (marker `matrix`, run on the oldest release too): the
# crash test's release-dependent part, dynamic MIG's slices with shared counters, is tested on each release by
# integration/test_dra_dynamic_mig_cluster.py, and the kubelet's retry is the same on all.


@pytest.mark.matrix
def test_the_kubelet_registered_the_dra_plugin_and_the_slice_holds_the_eight_gpus(dra_node: Cluster) -> None:
    cluster = dra_node
    uid = agent_uid(cluster)
    assert registration_socket(uid).is_socket() and dra_socket(uid).is_socket()
    registrations = [line for line in cluster.kubelet_log().splitlines()
                     if "RegisterPlugin started" in line and str(registration_socket(uid)) in line]
    assert registrations, "the kubelet never took up the agent's registration socket"
    # The kubelet's NotifyRegistrationStatus(registered) is what the agent logs this on.
    eventually(lambda: f"registered DRA driver {DRIVER} with the kubelet" in agent_log(cluster), 30,
               "the kubelet's registration of the DRA driver")
    # No device plugin for whole GPUs any more: the kubelet has none to give.
    eventually(lambda: cluster.allocatable() == "0", 30, "Allocatable nvidia.com/gpu: 0")

    spec = the_slice(cluster)["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"], spec["pool"]["resourceSliceCount"]) == (
        DRIVER, NODE, NODE, 1)
    devices = {d["name"]: d for d in spec["devices"]}
    gpus = preset_gpus()
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    for gpu in gpus:
        device = devices[f"gpu-{gpu['index']}"]
        attributes = {k: next(iter(v.values())) for k, v in device["attributes"].items()}
        # A DGX H100: eight H100 SXM5 80GB (132 SMs), four on each CPU socket, all eight on one NVSwitch fabric,
        # and no bridged pairs.
        assert {k: attributes.get(k) for k in (
            "type", "uuid", "index", "minor", "productName", "architecture", "cudaComputeCapability", "numaNode",
            "nvlinkGroup", "nvlinkDomain", "nvlinkPair", "resource.kubernetes.io/pciBusID")} == {
            "type": "gpu", "uuid": gpu["uuid"], "index": gpu["index"], "minor": gpu["minor"],
            "productName": "NVIDIA H100 80GB HBM3", "architecture": "Hopper", "cudaComputeCapability": "9.0.0",
            "numaNode": 0 if gpu["index"] < 4 else 1, "nvlinkGroup": 0, "nvlinkDomain": 0, "nvlinkPair": None,
            # NVML's bus id has an 8-digit domain (00000000:18:00.0), sysfs and the attribute 4 (0000:18:00.0).
            "resource.kubernetes.io/pciBusID": gpu["pci_bus_id"].lower().removeprefix("0000")}
        assert device["capacity"] == {"memory": {"value": "81559Mi"}, "multiprocessors": {"value": "132"}}


@pytest.mark.matrix
def test_a_pod_with_a_two_gpu_nvlink_domain_claim_runs_with_its_gpus_and_is_unprepared_after(
        dra_node: Cluster) -> None:
    cluster = dra_node
    uuids = {f"gpu-{g['index']}": g["uuid"] for g in preset_gpus()}
    domains = {d["name"]: d["attributes"].get("nvlinkDomain", {}).get("int")
               for d in the_slice(cluster)["spec"]["devices"]}
    cluster.kubectl("apply", "-n", "default", "-f", str(TEMPLATE))
    try:
        started = time.monotonic()
        cluster.apply(claim_pod("dra-two-gpus", "two-gpus-one-nvlink-domain"))
        eventually(lambda: cluster.get("pod", "-n", "default", "dra-two-gpus")["status"].get("phase") == "Running",
                   90, "the claim's pod Running")
        TIMES["DRA claim pod created -> Running"] = time.monotonic() - started

        pod = cluster.get("pod", "-n", "default", "dra-two-gpus")
        assert pod["spec"]["nodeName"] == NODE
        claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        claim = cluster.get("resourceclaim", "-n", "default", claim_name)
        results = claim["status"]["allocation"]["devices"]["results"]
        devices = sorted(r["device"] for r in results)
        assert [(r["driver"], r["pool"], r["request"]) for r in results] == [(DRIVER, NODE, "gpus")] * 2
        assert len(set(devices)) == 2 and len({domains[d] for d in devices}) == 1 and None not in {
            domains[d] for d in devices}, (devices, domains)
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod["metadata"]["uid"]]

        uid = claim["metadata"]["uid"]
        spec_file = CDI_DIR / f"{DRIVER}-claim-{uid}.json"
        spec = json.loads(spec_file.read_text())
        assert spec["kind"] == f"{DRIVER}/gpu"

        def printed() -> list[str]:
            lines = cluster.kubectl("logs", "-n", "default", "dra-two-gpus", check=False).splitlines()
            return lines if any(line.startswith("VISIBLE ") for line in lines) else []
        lines = eventually(printed, 60, "the pod's output")
        visible = next(line for line in lines if line.startswith("VISIBLE ")).removeprefix("VISIBLE ")
        assert sorted(visible.split(",")) == sorted(uuids[d] for d in devices)
        # Exactly the claim's GPUs' device nodes, with the NVIDIA major and the GPUs' minors (stat prints hex).
        minors = sorted(int(d.removeprefix("gpu-")) for d in devices)
        assert sorted(line for line in lines if line.startswith("DEV ")) == [
            f"DEV /dev/nvidia{m} character special file {NVIDIA_MAJOR:x}:{m:x}" for m in minors]
        assert set(json.loads(CHECKPOINT.read_text())["claims"]) == {uid}

        cluster.delete_pods("dra-two-gpus")
        gone = time.monotonic()
        eventually(lambda: not spec_file.exists(), 60, "the claim's CDI spec removed (NodeUnprepareResources)")
        TIMES["DRA claim pod deleted -> claim unprepared"] = time.monotonic() - gone
        assert json.loads(CHECKPOINT.read_text())["claims"] == {}
        # The claim made from the template goes with its pod.
        eventually(lambda: cluster.get("resourceclaims", "-n", "default")["items"] == [], 60,
                   "the pod's claim deleted")
        assert f"unprepared claim {uid}" in agent_log(cluster)
    finally:
        cluster.delete_pods("dra-two-gpus")
        cluster.kubectl("delete", "-n", "default", "-f", str(TEMPLATE), "--ignore-not-found")


def test_cordoned_gpus_leave_the_slice_while_their_claims_pod_runs_on_and_the_next_claim_gets_others(
        dra_node: Cluster) -> None:
    cluster = dra_node
    cordon = "gpu-node-agent.io/cordon"
    uuids = {g["index"]: g["uuid"] for g in preset_gpus()}

    def running(pod: str) -> bool:
        return cluster.get("pod", "-n", "default", pod)["status"].get("phase") == "Running"

    def claimed(pod: str) -> tuple[str, list[int]]:
        name = cluster.get("pod", "-n", "default", pod)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        results = cluster.get("resourceclaim", "-n", "default", name)["status"]["allocation"]["devices"]["results"]
        return name, sorted(int(r["device"].removeprefix("gpu-")) for r in results)

    def published() -> list[str]:
        return sorted(d["name"] for d in the_slice(cluster)["spec"]["devices"])

    cluster.kubectl("apply", "-n", "default", "-f", str(TEMPLATE))
    try:
        cluster.apply(claim_pod("dra-cordon-held", "two-gpus-one-nvlink-domain"))
        eventually(lambda: running("dra-cordon-held"), 90, "the first claim's pod Running")
        claim, held = claimed("dra-cordon-held")
        started = time.monotonic()
        cluster.kubectl("annotate", "node", NODE, f"{cordon}={','.join(map(str, held))}")
        others = sorted(f"gpu-{i}" for i in range(8) if i not in held)
        eventually(lambda: published() == others, 30, "the cordoned GPUs out of the slice")
        TIMES["cordon annotated -> DRA slice without the GPUs"] = time.monotonic() - started
        expected = "; ".join(f"GPU {i} ({uuids[i]}): held by ResourceClaim default/{claim}" for i in held)
        eventually(lambda: cluster.node()["metadata"].get("annotations", {}).get(f"{cordon}.state") == expected, 30,
                   "the Node saying which claim holds the cordoned GPUs")

        cluster.apply(claim_pod("dra-cordon-next", "two-gpus-one-nvlink-domain"))
        eventually(lambda: running("dra-cordon-next"), 90, "the next claim's pod Running")
        _, given = claimed("dra-cordon-next")
        assert not set(given) & set(held), (given, held)
        assert running("dra-cordon-held")

        cluster.kubectl("annotate", "node", NODE, f"{cordon}-")
        eventually(lambda: published() == [f"gpu-{i}" for i in range(8)], 30, "every GPU in the slice again")
    finally:
        cluster.kubectl("annotate", "node", NODE, f"{cordon}-", check=False)
        cluster.delete_pods("dra-cordon-held", "dra-cordon-next")
        cluster.kubectl("delete", "-n", "default", "-f", str(TEMPLATE), "--ignore-not-found")


@pytest.mark.matrix
def test_an_xid_taints_or_withdraws_the_gpu_as_the_release_keeps_taints_until_it_recovers(
        dra_node: Cluster) -> None:
    """From 1.36 the API server keeps device taints by default and the agent taints the GPU in its slice; on 1.35
    it drops them and the agent withdraws the GPU."""
    cluster = dra_node
    release = cluster.release()
    taints = on_by_default("DRADeviceTaints", release)
    print(f"Kubernetes {release_name(release)}: DRADeviceTaints {'on' if taints else 'off'} by default")

    def devices() -> tuple[int, list[str], dict[str, list[tuple[str, str, str]]]]:
        spec = the_slice(cluster)["spec"]
        tainted = {d["name"]: [(t["key"], t["value"], t["effect"]) for t in d["taints"]]
                   for d in spec["devices"] if d.get("taints")}
        return spec["pool"]["generation"], sorted(d["name"] for d in spec["devices"]), tainted

    generation, names, tainted = devices()
    assert (names, tainted) == ([f"gpu-{i}" for i in range(8)], {})
    injected = time.monotonic()
    cluster.fault("xid", "5", "48")  # a double-bit ECC error: the GPU is unhealthy at once
    expected = ((names, {"gpu-5": [(f"{DRIVER}/unhealthy", "xid-48", "NoSchedule")]}) if taints
                else ([n for n in names if n != "gpu-5"], {}))

    def marked() -> tuple[int, list[str], dict[str, list[tuple[str, str, str]]]] | None:
        now = devices()
        return now if (now[1], now[2]) == expected else None
    what = "gpu-5 tainted in the slice" if taints else "gpu-5 withdrawn from the slice"
    changed = eventually(marked, 30, what, interval=0.05)
    TIMES[f"DRA: XID 48 injected -> {what}"] = time.monotonic() - injected
    assert changed[0] > generation
    # Healthy again after the health policy's clean samples (recoveryChecks), without a restart.
    eventually(lambda: devices()[1:] == (names, {}), 60, "gpu-5 back in the slice, untainted")
    assert devices()[0] > changed[0]
    eventually(lambda: not [t for t in cluster.node()["spec"].get("taints", [])
                            if t["key"] == "gpu-node-agent.io/gpu-fault"], 30, "no health taint on the node")


@pytest.mark.matrix
def test_a_rollout_restart_serves_claims_throughout_and_the_new_agent_takes_over(dra_node: Cluster) -> None:
    """docs/dra.md, "Rolling updates": the new agent Pod starts beside the old one (maxSurge 1), serves DRA at once
    and takes the rest over once the DaemonSet stopped the old one; a pod holding a claim runs on, and a pod with a
    claim created while both agents run gets its devices."""
    cluster = dra_node
    old = cluster.agent_pod()
    old_uid = agent_uid(cluster, old)
    cluster.kubectl("apply", "-n", "default", "-f", str(TEMPLATE))
    try:
        cluster.apply(claim_pod("dra-before", "two-gpus-one-nvlink-domain"))
        eventually(lambda: cluster.get("pod", "-n", "default", "dra-before")["status"].get("phase") == "Running",
                   90, "the first claim's pod Running")
        before_claim = cluster.get("pod", "-n", "default", "dra-before")["status"]["resourceClaimStatuses"][0][
            "resourceClaimName"]
        before_uid = cluster.get("resourceclaim", "-n", "default", before_claim)["metadata"]["uid"]

        restarted = time.monotonic()
        cluster.kubectl("rollout", "restart", "-n", NAMESPACE, "daemonset/gpu-node-agent")

        def new_pod() -> str | None:
            names = [p["metadata"]["name"] for p in cluster.agent_pods() if p["metadata"]["name"] != old]
            return names[0] if names else None
        new = eventually(new_pod, 60, "the new agent pod")
        new_uid = agent_uid(cluster, new)
        cluster.apply(claim_pod("dra-during", "two-gpus-one-nvlink-domain"))
        # Created while the old agent still runs (the DaemonSet stops it only once the new one is ready).
        running = {p["metadata"]["name"] for p in cluster.agent_pods() if not p["metadata"].get("deletionTimestamp")}
        assert running == {old, new}
        eventually(lambda: registration_socket(new_uid).is_socket(), 60, "the new agent's registration socket")
        eventually(lambda: cluster.get("pod", "-n", "default", "dra-during")["status"].get("phase") == "Running",
                   120, "the claim's pod created during the rollout Running")
        TIMES["DRA rollout restart -> a claim's pod created meanwhile Running"] = time.monotonic() - restarted
        rolled_out(cluster)
        TIMES["DRA rollout restart -> rollout status returned"] = time.monotonic() - restarted
        assert cluster.agent_pod() == new
        assert cluster.get("pod", "-n", "default", "dra-before")["status"]["phase"] == "Running"

        log = agent_log(cluster, new)
        assert f"serves the kubelet directory {KUBELET}/device-plugins (a rolling update): serving DRA now" in log
        eventually(lambda: "took over the kubelet directory" in agent_log(cluster, new), 30,
                   "the new agent to take over from the old one")
        # Only the new agent's sockets are left.
        assert [name for name in sockets(REGISTRY) if name.startswith(DRIVER)] == [f"{DRIVER}-{new_uid}-reg.sock"]
        assert sockets(PLUGIN_DIR) == [f"dra-{new_uid}.sock"]
        assert old_uid != new_uid and not registration_socket(old_uid).exists()

        # The claim the old agent prepared is unprepared by the new one.
        assert before_uid in json.loads(CHECKPOINT.read_text())["claims"]
        cluster.delete_pods("dra-before")
        eventually(lambda: before_uid not in json.loads(CHECKPOINT.read_text())["claims"], 60,
                   "the first claim unprepared by the new agent")
        assert not (CDI_DIR / f"{DRIVER}-claim-{before_uid}.json").exists()
        assert f"unprepared claim {before_uid}" in agent_log(cluster, new)
    finally:
        cluster.delete_pods("dra-before", "dra-during")
        cluster.kubectl("delete", "-n", "default", "-f", str(TEMPLATE), "--ignore-not-found")
        eventually(lambda: cluster.get("resourceclaims", "-n", "default")["items"] == [], 60, "the claims deleted")


# --- dynamic MIG: the agent killed in the middle of a prepare and of an unprepare

CRASH_AFTER = 5
"""The agent process ends after its 5th MIG change (GPU_AGENT_FAKE_CRASH_AFTER, counted in each process): the first
agent makes and destroys pod A's MIG device (changes 1 to 4) and dies at pod B's GPU instance (5); the restarted
one rolls that back (1), makes B's MIG device (2, 3) and dies when B's unprepare has destroyed its compute and GPU
instance (4, 5), before the claim is forgotten; the third one makes no change, so it never reaches 5."""
CRASH_TEMPLATE = "crash-mig-3g40gb-4"
CRASH_DEVICE = "gpu-0-mig-3g40gb-4"


def set_mig_mode(gpu: int, enabled: bool) -> None:
    """MIG mode of a GPU in the running agent's fake NVML, switched as `nvidia-smi -i <gpu> -mig 1|0` does (an H100
    switches at once); its GPU instances destroyed first."""
    backend = fake_backend(FakeNvml(load_node(PRESET), MOCK_STATE))
    backend.init()
    try:
        ops = MigOps(backend)
        for instance in ops.state(gpu).instances:
            ops.destroy(gpu, instance.start)
        ops.set_mode(gpu, enabled)
    finally:
        backend.shutdown()


def gpu0_instances() -> list[tuple[int, int, int]]:
    """GPU 0's GPU instances in the agent's fake NVML, with or without a compute instance: (placement start, size,
    compute instances)."""
    backend = fake_backend(FakeNvml(load_node(PRESET), MOCK_STATE))
    backend.init()
    try:
        return [(i.start, i.size, i.compute_instances) for i in MigOps(backend).state(0).instances]
    finally:
        backend.shutdown()


def mig_uuids() -> dict[tuple[int, int], str]:
    """The node's MIG devices as `gpu-agent inspect` shows them: their UUID by (GPU, placement start)."""
    out = subprocess.run([str(REPO / ".venv" / "bin" / "gpu-agent"), "inspect", "--nvml", f"mock:{PRESET}",
                          "--mock-state", str(MOCK_STATE), "--json"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {(m["gpu"], m["placement"]["start"]): m["uuid"] for m in json.loads(out)["mig_devices"]}


def agent_restarts(cluster: Cluster, pod: str) -> tuple[int, int | None]:
    """The agent container's restart count and the exit status of its last run (None before a restart)."""
    (status,) = cluster.get("pod", "-n", NAMESPACE, pod)["status"]["containerStatuses"]
    last = status.get("lastState", {}).get("terminated")
    return status["restartCount"], (last["exitCode"] if last else None)


def checkpoint_claims() -> dict[str, str]:
    return {uid: entry["state"] for uid, entry in json.loads(CHECKPOINT.read_text())["claims"].items()}


def crash_mode(cluster: Cluster) -> list[dict[str, Any]]:
    """The ConfigMap and DaemonSet of the cluster's DRA mode with dra.dynamicMig on and the crash hook armed in the
    agent container's environment, to apply as the same field manager as DRA mode itself: applying DRA mode again
    takes both back."""
    rendered = list(yaml.safe_load_all(cluster.kubectl("kustomize", str(RUN_DIR / "kustomize-dra"))))
    config = next(o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-node-agent-config")
    settings = yaml.safe_load(config["data"]["config.yaml"])
    settings["dra"]["dynamicMig"] = True
    config["data"]["config.yaml"] = yaml.safe_dump(settings)
    daemonset = next(o for o in rendered if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "gpu-node-agent")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    container["env"].append({"name": CRASH_AFTER_ENV, "value": str(CRASH_AFTER)})
    return [config, daemonset]


def mig_claim_pod(name: str) -> dict[str, Any]:
    return claim_pod(name, CRASH_TEMPLATE)


@pytest.mark.matrix
def test_an_xid_on_a_claims_gpu_shows_in_the_pods_status_until_the_gpu_recovers(dra_node: Cluster) -> None:
    """DRA mode: the name `claim:<the pod's name for the claim>`; the device's ID is the first CDI device ID the agent's
    NodePrepareResources gave the kubelet for it, `<driver>/gpu=claim-<claim UID>-<device>` (docs/dra.md)."""
    cluster = dra_node
    cluster.apply(HEALTH_TEMPLATE)
    try:
        cluster.apply(template_claim_pod("health-claim"))
        wait_running(cluster, "health-claim")
        [claim_status] = cluster.get("pod", "-n", "default", "health-claim")["status"]["resourceClaimStatuses"]
        claim = cluster.get("resourceclaim", "-n", "default", claim_status["resourceClaimName"])
        [result] = claim["status"]["allocation"]["devices"]["results"]
        device = result["device"]
        assert (result["driver"], device.startswith("gpu-")) == (DRIVER, True), result
        resource_id = f"{DRIVER}/gpu=claim-{claim['metadata']['uid']}-{device}"
        follow_health(cluster, "health-claim", "claim:gpu", resource_id, int(device.removeprefix("gpu-")), "DRA")
    finally:
        cluster.delete_pods("health-claim")
        cluster.kubectl("delete", "resourceclaimtemplate", "-n", "default", "health-gpu", "--ignore-not-found")
        # The claim made from the template goes with its pod.
        eventually(lambda: cluster.get("resourceclaims", "-n", "default")["items"] == [], 60, "the pod's claim deleted")


def test_dynamic_mig_claims_survive_the_agent_killed_in_a_prepare_and_in_an_unprepare(dra_node: Cluster) -> None:
    """docs/dra.md, "What a start does": the agent container killed in the middle of a claim's prepare and of its
    unprepare and restarted by the kubelet; the pod runs with the MIG device it was allocated, and once it is gone
    no MIG device, CDI spec or checkpoint entry is left."""
    cluster = dra_node
    release = cluster.release()
    # hack/cluster/up.sh turns the gate on where the release has it off.
    print(f"Kubernetes {release_name(release)}: DRAPartitionableDevices "
          f"{'on' if on_by_default('DRAPartitionableDevices', release) else 'off'} by default")
    template = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": CRASH_TEMPLATE, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": "mig.gpu-node-agent.io", "count": 1, "selectors": [{"cel": {"expression": (
                f"device.attributes['{DRIVER}'].profile == '3g.40gb' && "
                f"device.attributes['{DRIVER}'].placementStart == 4")}}]}}]}}},
    }
    set_mig_mode(0, True)  # dynamic MIG needs MIG mode on; the agent does not switch it
    try:
        started = time.monotonic()
        for manifest in crash_mode(cluster):
            cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))
        rolled_out(cluster)
        agent = cluster.agent_pod()
        eventually(lambda: "the API server keeps shared counters" in agent_log(cluster, agent), 60,
                   "the agent to find the shared counters kept")
        eventually(lambda: CRASH_DEVICE in [d["name"] for d in cluster.get("resourceslice", f"{SLICE}-gpu-0")[
            "spec"]["devices"]], 60, f"{CRASH_DEVICE} published")
        TIMES["DRA dynamic MIG applied -> placements published"] = time.monotonic() - started
        cluster.apply(template)

        def running(pod: str) -> Any:
            found = cluster.get("pod", "-n", "default", pod)
            return found if found["status"].get("phase") == "Running" else None

        def visible(pod: str) -> str:
            def printed() -> str | None:
                lines = cluster.kubectl("logs", "-n", "default", pod, check=False).splitlines()
                return next((line for line in lines if line.startswith("VISIBLE ")), None)
            line = eventually(printed, 60, f"{pod}'s output")
            return str(line).removeprefix("VISIBLE ")

        def claim_uid(pod: Any) -> str:
            name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
            claim = cluster.get("resourceclaim", "-n", "default", name)
            assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == [CRASH_DEVICE]
            uid: str = claim["metadata"]["uid"]
            return uid

        def cdi_spec(uid: str) -> Path:
            return CDI_DIR / f"{DRIVER}-claim-{uid}.json"

        # Pod A, with no crash: its MIG device made at the allocated placement and destroyed after it.
        cluster.apply(mig_claim_pod("dra-mig-a"))
        pod_a = eventually(lambda: running("dra-mig-a"), 90, "pod A Running")
        uid_a = claim_uid(pod_a)
        assert gpu0_instances() == [(4, 4, 1)]
        assert visible("dra-mig-a") == mig_uuids()[(0, 4)]
        assert checkpoint_claims() == {uid_a: "PrepareCompleted"}
        cluster.delete_pods("dra-mig-a")
        eventually(lambda: not cdi_spec(uid_a).exists(), 60, "pod A's claim unprepared")
        assert (gpu0_instances(), checkpoint_claims()) == ([], {})
        assert agent_restarts(cluster, agent) == (0, None)

        # Pod B: the agent dies having made the GPU instance, before its compute instance.
        crashed = time.monotonic()
        cluster.apply(mig_claim_pod("dra-mig-b"))
        eventually(lambda: agent_restarts(cluster, agent) == (1, 137), 60, "the agent killed in the prepare")
        TIMES["DRA pod with a dynamic MIG claim created -> the agent killed and restarted"] = (
            time.monotonic() - crashed)
        pod_b = eventually(lambda: running("dra-mig-b"), 120, "pod B Running after the agent's restart")
        TIMES["DRA agent killed in a dynamic-MIG prepare -> the claim's pod Running"] = time.monotonic() - crashed
        uid_b = claim_uid(pod_b)
        claim_b = pod_b["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        # The restarted agent rolled the cut-short prepare back and the kubelet's retry made the device afresh.
        assert (f"rolled back the prepare of claim default/{claim_b} ({uid_b}) that a restart cut short; the kubelet "
                "prepares it again") in agent_log(cluster, agent)
        assert gpu0_instances() == [(4, 4, 1)]
        assert visible("dra-mig-b") == mig_uuids()[(0, 4)]
        assert sorted(line for line in cluster.kubectl("logs", "-n", "default", "dra-mig-b").splitlines()
                      if line.startswith("DEV ")) == [f"DEV /dev/nvidia0 character special file {NVIDIA_MAJOR:x}:0"]
        assert checkpoint_claims() == {uid_b: "PrepareCompleted"}
        assert cluster.agent_pod() == agent and agent_restarts(cluster, agent) == (1, 137)

        # Pod B deleted: the agent dies having destroyed the MIG device, before it forgets the claim.
        gone = time.monotonic()
        cluster.delete_pods("dra-mig-b")
        eventually(lambda: agent_restarts(cluster, agent) == (2, 137), 60, "the agent killed in the unprepare")
        eventually(lambda: not cdi_spec(uid_b).exists(), 120, "pod B's claim unprepared after the agent's restart")
        TIMES["DRA agent killed in a dynamic-MIG unprepare -> the claim unprepared"] = time.monotonic() - gone
        assert (gpu0_instances(), checkpoint_claims(), mig_uuids()) == ([], {}, {})
        assert [p.name for p in CDI_DIR.iterdir() if p.name.startswith(DRIVER)] == []
        assert f"unprepared claim {uid_b}" in agent_log(cluster, agent)
        assert cluster.agent_pod() == agent and agent_restarts(cluster, agent) == (2, 137)
    finally:
        cluster.delete_pods("dra-mig-a", "dra-mig-b")
        cluster.kubectl("delete", "resourceclaimtemplate", "-n", "default", CRASH_TEMPLATE, "--ignore-not-found")
        eventually(lambda: cluster.get("resourceclaims", "-n", "default")["items"] == [], 60, "the claims deleted")
        set_mig_mode(0, False)
        cluster.kubectl("apply", "--server-side", "-k", str(RUN_DIR / "kustomize-dra"))
        rolled_out(cluster)

    def as_before() -> bool:
        found = (node_slices(cluster), sorted(d["name"] for d in the_slice(cluster)["spec"]["devices"]))
        assert found == ([SLICE], [f"gpu-{i}" for i in range(8)]), found
        return True
    # The node as the module found it: eight whole GPUs in one slice.
    eventually(as_before, 60, "the node's eight GPUs in its one slice again")
