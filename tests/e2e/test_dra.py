"""DRA mode on the real kubelet: the node moved to DRA mode as docs/dra.md says (deployments/dra/ and the Component
deployments/dra/mode on top of the cluster's DaemonSet), a pod with the shipped "2 GPUs on one NVLink domain" claim
scheduled by the real scheduler, prepared by the agent through the real kubelet and started by containerd with the
claim's CDI devices, and the node moved back to device-plugin mode. conftest.py runs this module first, so the rest
of the e2e tests find the node as the cluster brought it up.

The node has no NVIDIA driver: its GPUs' device nodes are stand-ins (hack/cluster/up.sh makes /dev/nvidia<minor>,
character devices 195:<minor>, under a device root of their own, the agent's flags.nvidiaDevRoot here), which the
CDI specs name as host paths and containerd creates in the containers."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from cluster import BUSYBOX, NAMESPACE, NODE, TIMES, Cluster, eventually
from dra_mode import (
    CDI_DIR,
    CHECKPOINT,
    DRIVER,
    KUBELET,
    NVIDIA_MAJOR,
    PLUGIN_DIR,
    REGISTRY,
    TEMPLATE,
    agent_log,
    agent_uid,
    dra_socket,
    preset_gpus,
    registration_socket,
    rolled_out,
    sockets,
    the_slice,
)

from tests.releases import on_by_default, release_name

pytestmark = [pytest.mark.timeout(300), pytest.mark.matrix]


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


def claim_pod(name: str, template: str) -> dict[str, Any]:
    """A pod holding one claim made from `template`; it prints what its container was given, then sleeps."""
    command = ('echo "VISIBLE $NVIDIA_VISIBLE_DEVICES"; '
               "for d in /dev/nvidia*; do [ -e \"$d\" ] && stat -c 'DEV %n %F %t:%T' \"$d\"; done; sleep 3600")
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
            "containers": [{
                "name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
                "command": ["sh", "-c", command],
                "resources": {"claims": [{"name": "gpus"}]},
            }],
        },
    }


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
