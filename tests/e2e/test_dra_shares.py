"""GPU shares by consumable capacity (docs/dra.md, "GPU shares by capacity") on the real kubelet, kube-scheduler and
containerd: the node in DRA mode with dra.sharedCapacity and GPU 0 shared by MPS, its control program the stand-in
tests/mps/nvidia-cuda-mps-control (the node has no NVIDIA driver). GPU 0, an H100 80GB of 81559 MiB, is one device
that claims share by memory (whole GiB) and compute (percent of the SMs). The scheduler packs the claims onto it;
each claim's pod runs as one client of GPU 0's MPS daemon with exactly what its claim was allocated in its
environment; a claim that does not fit, by memory or by compute, leaves its pod Pending with the scheduler's reason;
once a pod is gone (its claim unprepared and deallocated) a waiting pod that now fits runs.

The stand-in daemon records what the agent tells it (its start and its control commands: the defaults for the
replicas); no MPS client ever reaches it here (no CUDA, no GPU), so a client's limits are checked where a real
client reads them, in the environment the kubelet gave its container from the claim's CDI spec, and a process
going over its limit cannot be shown. Where the release has DRAConsumableCapacity off by default (1.35) the agent
publishes GPU 0 as its MPS replicas, which is what is checked there."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import NAMESPACE, NODE, REPO, RUN_DIR, TIMES, Cluster, eventually
from dra_mode import (
    CDI_DIR,
    CHECKPOINT,
    DRIVER,
    NVIDIA_MAJOR,
    agent_log,
    claim_pod,
    enter_dra_mode,
    leave_dra_mode,
    preset_gpus,
    the_slice,
)

from tests.releases import on_by_default, release_name

pytestmark = [pytest.mark.timeout(600)]
# Not marked `matrix`: make test runs it on the default release only. On a release without DRAConsumableCapacity by
# default the module checks the fallback (GPU 0 as its replicas) and skips the claims.

KUSTOMIZATION = RUN_DIR / "kustomize-capacity"
"""The DRA mode of the cluster (RUN_DIR/kustomize-dra) with GPU 0 shared by MPS and dra.sharedCapacity on."""
MPS_ROOT = RUN_DIR / "capacity-mps"
"""flags.mpsRoot: a hostPath mounted at the same path in the agent's container, as the CDI specs name it."""
DRIVER_ROOT = Path("/driver-root")
"""flags.plugin.containerDriverRoot in the agent's container; the stand-in control program is at usr/bin under it."""
STAND_IN = REPO / "tests" / "mps"
"""The directory of the stand-in nvidia-cuda-mps-control, mounted read-only at DRIVER_ROOT/usr/bin."""
REPLICAS = 4
"""sharing.mps replicas of GPU 0: the daemon's defaults (100/4 percent, 81559/4 MiB); without consumable capacity, the
devices published."""
SHARED_CLASS = "shared.gpu-node-agent.io"
GPU_MEMORY_MIB = 81559
"""The H100 80GB HBM3's memory: the device's memory capacity; a claim gets whole GiB of it, 79Gi at most."""

SHOW = ("env | grep -E '^(CUDA|NVIDIA)_' | sed 's/^/ENV /'; "
        "awk '$2 == \"/mps/pipe\" || $2 == \"/mps/log\" || $2 == \"/dev/shm\" {print \"MOUNT\", $2, $4}' /proc/mounts; "
        "[ -S /mps/pipe/control ] && echo 'SOCKET /mps/pipe/control'; "
        "sed 's/^/DAEMON /' /mps/log/control.log; "
        "for d in /dev/nvidia*; do [ -e \"$d\" ] && stat -c 'DEV %n %F %t:%T' \"$d\"; done; "
        "touch \"/dev/shm/client-$POD\" && echo 'SHM written'; echo DONE; sleep 3600")
"""What a client pod prints of what it was given: its CUDA_/NVIDIA_ environment, its MPS mounts, the daemon's
control socket in its pipe directory, the daemon's log as it sees it, its GPU device nodes; it leaves a file in the
/dev/shm it shares with the daemon."""


def capacity_config(cluster: Cluster) -> dict[str, Any]:
    """The agent's config of the cluster's DRA mode with GPU 0 shared by MPS and shared by capacity."""
    rendered = list(yaml.safe_load_all(cluster.kubectl("kustomize", str(RUN_DIR / "kustomize-dra"))))
    config = next(o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-node-agent-config")
    settings: dict[str, Any] = yaml.safe_load(config["data"]["config.yaml"])
    settings["dra"]["sharedCapacity"] = {"enabled": True}
    flags = settings.setdefault("flags", {})
    flags["mpsRoot"] = str(MPS_ROOT)
    flags.setdefault("plugin", {})["containerDriverRoot"] = str(DRIVER_ROOT)
    settings["sharing"] = {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": REPLICAS, "devices": [0]}]}}
    return settings


class _Blocks(yaml.SafeDumper):
    """Writes a string of several lines as a block (`|`), so that the files the test writes read as a user's."""


_Blocks.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def write_kustomization(cluster: Cluster) -> None:
    """KUSTOMIZATION: RUN_DIR/kustomize-dra with capacity_config, and the agent's two mounts more (the MPS root, the
    stand-in control program)."""
    mounts = [("mps-root", MPS_ROOT, MPS_ROOT, "DirectoryOrCreate", False),
              ("mps-control", STAND_IN, DRIVER_ROOT / "usr" / "bin", "Directory", True)]
    ops: list[dict[str, Any]] = []
    for name, host, inside, kind, read_only in mounts:
        mount: dict[str, Any] = {"name": name, "mountPath": str(inside), **({"readOnly": True} if read_only else {})}
        ops += [{"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-", "value": mount},
                {"op": "add", "path": "/spec/template/spec/volumes/-",
                 "value": {"name": name, "hostPath": {"path": str(host), "type": kind}}}]
    config = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "gpu-node-agent-config", "namespace": NAMESPACE},
              "data": {"config.yaml": yaml.safe_dump(capacity_config(cluster), sort_keys=False)}}
    files = {
        "kustomization.yaml": {
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": ["../kustomize-dra"],
            "patches": [{"path": "configmap-config.yaml"},
                        {"target": {"kind": "DaemonSet", "name": "gpu-node-agent"}, "path": "daemonset-mps.yaml"}]},
        "configmap-config.yaml": config,
        "daemonset-mps.yaml": ops,
    }
    KUSTOMIZATION.mkdir()
    for name, content in files.items():
        (KUSTOMIZATION / name).write_text(yaml.dump(content, Dumper=_Blocks, sort_keys=False))


def uuid0() -> str:
    uuid: str = preset_gpus()[0]["uuid"]
    return uuid


def control_log() -> Path:
    """GPU 0's MPS daemon's log on the node (the stand-in's control.log in the daemon's log directory)."""
    return MPS_ROOT / uuid0() / "log" / "control.log"


def capacity_on(cluster: Cluster) -> bool:
    return on_by_default("DRAConsumableCapacity", cluster.release())


def expected_devices(capacity: bool) -> list[str]:
    """The slice's devices: GPU 0 whole (shared by capacity) or as its replicas, and the seven other GPUs."""
    gpu0 = ["gpu-0"] if capacity else [f"gpu-0-replica-{n}" for n in range(REPLICAS)]
    return sorted([*gpu0, *(f"gpu-{i}" for i in range(1, 8))])


def devices(cluster: Cluster) -> dict[str, Any]:
    return {d["name"]: d for d in the_slice(cluster)["spec"]["devices"]}


@pytest.fixture(scope="module")
def capacity_node(cluster: Cluster) -> Iterator[Cluster]:
    """The node in DRA mode with GPU 0 shared by capacity (its MPS daemon up and GPU 0 published), then back in
    device-plugin mode as dra_mode.py leaves it: the DaemonSet and config as before, no DRA registration, no slice."""
    capacity = capacity_on(cluster)
    went_back = True
    try:
        write_kustomization(cluster)
        started = time.monotonic()
        try:
            enter_dra_mode(cluster, KUSTOMIZATION)

            def published() -> bool:
                found = sorted(devices(cluster))
                assert found == expected_devices(capacity), found
                return True
            eventually(published, 90, "GPU 0 published once its MPS daemon is up")
            TIMES["DRA shared capacity applied -> GPU 0 published"] = time.monotonic() - started
            yield cluster
        finally:
            went_back = leave_dra_mode(cluster, "DRA shared capacity: ")
        if went_back:
            # The agent stopped GPU 0's MPS daemon when it left (the daemon's last line).
            eventually(lambda: control_log().read_text().splitlines()[-1] == "stopped", 30,
                       "GPU 0's MPS daemon stopped by the agent")
    finally:
        shutil.rmtree(KUSTOMIZATION, ignore_errors=True)
        if went_back:
            shutil.rmtree(MPS_ROOT, ignore_errors=True)


def test_gpu0_is_one_device_shared_by_memory_and_compute_where_the_release_keeps_capacity(
        capacity_node: Cluster) -> None:
    cluster = capacity_node
    release = cluster.release()
    capacity = capacity_on(cluster)
    print(f"Kubernetes {release_name(release)}: DRAConsumableCapacity {'on' if capacity else 'off'} by default")
    found = devices(cluster)
    assert sorted(found) == expected_devices(capacity)
    log = agent_log(cluster)
    assert (f"MPS control daemon of GPU 0 up: {REPLICAS} replicas, set_default_active_thread_percentage 25; "
            "set_default_device_pinned_mem_limit 0 20389M") in log  # 100/4 and 81559/4: the replicas' defaults
    if not capacity:
        assert ("the API server drops the consumable capacity of gpu-0 (the DRAConsumableCapacity feature gate is "
                "off): dra.sharedCapacity is off until the agent restarts; GPUs that MPS shares are published as "
                "their replicas") in log
        return
    assert ("the API server keeps consumable capacity (DRAConsumableCapacity): each GPU that MPS shares is one "
            "device that claims share by memory and compute") in log
    gpu0 = found["gpu-0"]
    attributes = {k: next(iter(v.values())) for k, v in gpu0["attributes"].items()}
    assert (attributes["type"], attributes["sharing"], attributes["uuid"], attributes["index"]) == (
        "shared", "mps", uuid0(), 0)
    assert "replicas" not in attributes and "replica" not in attributes
    assert gpu0["allowMultipleAllocations"] is True
    # The memory is the GPU's, handed out in whole GiB (79Gi of 81559Mi at most); compute in percent of the SMs.
    assert gpu0["capacity"] == {
        "memory": {"value": f"{GPU_MEMORY_MIB}Mi",
                   "requestPolicy": {"default": "79Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}},
        "compute": {"value": "100", "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}}}}
    # The daemon the agent started for GPU 0, as the stand-in recorded it: its GPU, its directories under mpsRoot,
    # and the replicas' defaults, which each claim's client overrides.
    started, *commands = control_log().read_text().splitlines()
    assert started.startswith("started pid=")
    assert json.loads(started.split(" env=", 1)[1]) == {
        "CUDA_MPS_LOG_DIRECTORY": str(MPS_ROOT / uuid0() / "log"),
        "CUDA_MPS_PIPE_DIRECTORY": str(MPS_ROOT / uuid0() / "pipe"),
        "CUDA_VISIBLE_DEVICES": uuid0()}
    assert commands[:2] == ["command set_default_active_thread_percentage 25",
                            "command set_default_device_pinned_mem_limit 0 20389M"]
    assert set(commands[2:]) <= {"command get_default_active_thread_percentage"}  # the agent's probes


# --- claims of shares ------------------------------------------------------------------------------------------------

TEMPLATES = {"share-20gi-25": ("20Gi", "25"), "share-19gi-25": ("19Gi", "25"), "share-1gi-30": ("1Gi", "30")}
"""ResourceClaimTemplates of one share of an MPS-shared GPU: (memory, compute) each, as docs/dra.md writes the claim."""


def share_template(name: str) -> dict[str, Any]:
    memory, compute = TEMPLATES[name]
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "share", "exactly": {
            "deviceClassName": SHARED_CLASS,
            "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].sharing == 'mps'"}}],
            "capacity": {"requests": {"memory": memory, "compute": compute}}}}]}}},
    }


def client_pod(name: str, template: str) -> dict[str, Any]:
    pod = claim_pod(name, template, claim="share", command=SHOW)
    pod["spec"]["containers"][0]["env"] = [{"name": "POD", "value": name}]
    return pod


def phase(cluster: Cluster, pod: str) -> str:
    found: str = cluster.get("pod", "-n", "default", pod)["status"].get("phase", "")
    return found


def wait_running(cluster: Cluster, pod: str) -> None:
    eventually(lambda: phase(cluster, pod) == "Running", 90, f"pod {pod} Running")


def claim_of(cluster: Cluster, pod: str) -> Any:
    """The claim made for the pod from its template (the resourceclaim controller names it in the pod's status)."""
    statuses = cluster.get("pod", "-n", "default", pod)["status"]["resourceClaimStatuses"]
    return cluster.get("resourceclaim", "-n", "default", statuses[0]["resourceClaimName"])


def allocated_share(cluster: Cluster, pod: str, memory: str, compute: str) -> tuple[str, str]:
    """The pod's claim allocated one share of gpu-0 with exactly `memory` and `compute`: its UID and share ID."""
    claim = claim_of(cluster, pod)
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert {k: result.get(k) for k in ("request", "driver", "pool", "device", "consumedCapacity")} == {
        "request": "share", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
        "consumedCapacity": {"memory": memory, "compute": compute}}, result
    assert result.get("shareID"), result
    return claim["metadata"]["uid"], result["shareID"]


def unschedulable(cluster: Cluster, pod: str) -> str:
    """The scheduler's reason for leaving the pod Pending, once it tried (its PodScheduled condition)."""
    def reason() -> str | None:
        seen = cluster.get("pod", "-n", "default", pod)
        assert seen["status"].get("phase") == "Pending", seen["status"]
        for condition in seen["status"].get("conditions", []):
            if (condition["type"], condition["status"], condition.get("reason")) == (
                    "PodScheduled", "False", "Unschedulable"):
                return str(condition.get("message", ""))
        return None
    return eventually(reason, 60, f"the scheduler to leave pod {pod} Pending")


def still_pending(cluster: Cluster, pod: str) -> None:
    message = unschedulable(cluster, pod)
    assert "cannot allocate all claims" in message, message
    assert not (claim_of(cluster, pod).get("status") or {}).get("allocation")


def client_output(cluster: Cluster, pod: str) -> list[str]:
    def printed() -> list[str]:
        lines = cluster.kubectl("logs", "-n", "default", pod, check=False).splitlines()
        return lines if "DONE" in lines else []
    return eventually(printed, 60, f"{pod}'s output")


def check_client(cluster: Cluster, pod: str, memory_mib: int, compute: int) -> None:
    """The pod's container is one client of GPU 0's MPS daemon with exactly `memory_mib` of pinned device memory and
    `compute` percent of the SMs, as the claim's CDI spec gave it."""
    lines = client_output(cluster, pod)
    assert sorted(line.removeprefix("ENV ") for line in lines if line.startswith("ENV ")) == sorted([
        f"NVIDIA_VISIBLE_DEVICES={uuid0()}", "CUDA_MPS_PIPE_DIRECTORY=/mps/pipe", "CUDA_MPS_LOG_DIRECTORY=/mps/log",
        f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}", f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={memory_mib}M"]), lines
    mounts = {tuple(line.split()[1:3]) for line in lines if line.startswith("MOUNT ")}
    assert {(where, options.split(",")[0]) for where, options in mounts} == {
        ("/mps/pipe", "rw"), ("/mps/log", "rw"), ("/dev/shm", "rw")}, lines
    # The pipe directory is GPU 0's daemon's: its control socket is there, and the log the pod reads is the one the
    # daemon writes on the node.
    assert "SOCKET /mps/pipe/control" in lines, lines
    seen = [line.removeprefix("DAEMON ") for line in lines if line.startswith("DAEMON ")]
    assert seen and seen == control_log().read_text().splitlines()[:len(seen)], lines
    assert [line for line in lines if line.startswith("DEV ")] == [
        f"DEV /dev/nvidia0 character special file {NVIDIA_MAJOR:x}:0"], lines
    # Its /dev/shm is the one the daemon's clients share, mpsRoot/shm on the node.
    assert "SHM written" in lines and (MPS_ROOT / "shm" / f"client-{pod}").is_file(), lines


def checkpoint_claims() -> set[str]:
    return set(json.loads(CHECKPOINT.read_text())["claims"])


def test_claims_run_with_exactly_their_share_and_a_claim_that_does_not_fit_waits_for_room(
        capacity_node: Cluster) -> None:
    """On GPU 0 (81559 MiB, 100% of the SMs): three claims of 20Gi and 25%; a fourth of 20Gi does not fit (80Gi) and
    one of 1Gi and 30% does not either (105%); one of 19Gi and 25% fills the GPU (79Gi, 100%). Once the first pod
    is gone, its claim unprepared and deallocated, the fourth runs; the one of 30% still does not fit."""
    cluster = capacity_node
    if not capacity_on(cluster):
        pytest.skip(f"Kubernetes {release_name(cluster.release())} has DRAConsumableCapacity off by default: GPU 0 is "
                    "published as its replicas (the test above)")
    pods = ["client-1", "client-2", "client-3", "client-4", "client-fill", "client-compute"]
    for name in TEMPLATES:
        cluster.apply(share_template(name))
    try:
        shares: dict[str, str] = {}
        uids: dict[str, str] = {}
        started = time.monotonic()
        for pod in pods[:3]:
            cluster.apply(client_pod(pod, "share-20gi-25"))
        for pod in pods[:3]:
            wait_running(cluster, pod)
        TIMES["DRA shared capacity: three claim pods created -> Running"] = time.monotonic() - started
        for pod in pods[:3]:
            uids[pod], shares[pod] = allocated_share(cluster, pod, "20Gi", "25")
            check_client(cluster, pod, 20480, 25)
        assert checkpoint_claims() == {uids[p] for p in pods[:3]}

        # 60Gi and 75% used: a fourth 20Gi does not fit in 81559Mi, nor 30% more compute.
        cluster.apply(client_pod("client-4", "share-20gi-25"))
        cluster.apply(client_pod("client-compute", "share-1gi-30"))
        still_pending(cluster, "client-4")
        still_pending(cluster, "client-compute")

        # 19Gi and 25% fit exactly: 79Gi (the most whole GiB of 81559Mi) and 100%.
        cluster.apply(client_pod("client-fill", "share-19gi-25"))
        wait_running(cluster, "client-fill")
        uids["client-fill"], shares["client-fill"] = allocated_share(cluster, "client-fill", "19Gi", "25")
        check_client(cluster, "client-fill", 19456, 25)
        still_pending(cluster, "client-4")
        still_pending(cluster, "client-compute")

        # The first pod goes: its claim is unprepared (its CDI spec and checkpoint entry gone) and deallocated, and
        # its 20Gi and 25% go to the fourth; 30% more compute still does not fit (75% used).
        spec_file = CDI_DIR / f"{DRIVER}-claim-{uids['client-1']}.json"
        assert spec_file.is_file()
        gone = time.monotonic()
        cluster.delete_pods("client-1")
        wait_running(cluster, "client-4")
        TIMES["DRA shared capacity: a pod deleted -> the pod waiting for its share Running"] = time.monotonic() - gone
        eventually(lambda: not spec_file.exists(), 60, "client-1's claim unprepared (its CDI spec removed)")
        assert f"unprepared claim {uids['client-1']}" in agent_log(cluster)
        uids["client-4"], shares["client-4"] = allocated_share(cluster, "client-4", "20Gi", "25")
        check_client(cluster, "client-4", 20480, 25)
        assert checkpoint_claims() == {uids[p] for p in ("client-2", "client-3", "client-4", "client-fill")}
        still_pending(cluster, "client-compute")
        assert len(set(shares.values())) == len(shares)  # each claim a share of its own
        assert all(phase(cluster, p) == "Running" for p in ("client-2", "client-3", "client-4", "client-fill"))
    finally:
        cluster.delete_pods(*pods)
        for name in TEMPLATES:
            cluster.kubectl("delete", "resourceclaimtemplate", "-n", "default", name, "--ignore-not-found")
        # The claims made from the templates go with their pods.
        eventually(lambda: cluster.get("resourceclaims", "-n", "default")["items"] == [], 60, "the claims deleted")
    eventually(lambda: checkpoint_claims() == set(), 60, "every claim unprepared")
