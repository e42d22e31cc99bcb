"""The agent against a real kube-apiserver, with the DaemonSet's own RBAC and admission policy applied:
labels, taints, the GPUHealthy condition and Events on its Node; nothing foreign touched; no steady-state writes."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import NODE, OTHER_NODE, REPO, ApiServer
from kubernetes import client as k8s
from kubernetes import utils
from kubernetes import watch as k8s_watch

from agent.agent import Agent
from agent.config import AgentConfig, parse_config
from agent.kube.client import ApiClient
from agent.kube.credentials import from_kubeconfig
from agent.kube.node import NodeApi
from agent.labels import node_labels
from agent.nvml.fake import FakeNvml
from tests.plugin_harness import health_samples, running_agent, wait_until

NAMESPACE = "gpu-node-agent"
ACCOUNT = "gpu-node-agent"
TAINT_KEY = "gpu-node-agent.io/gpu-fault"
FOREIGN_TAINTS = [
    {"key": "dedicated", "value": "ml", "effect": "NoSchedule"},
    {"key": "example.com/maintenance", "effect": "NoExecute", "timeAdded": "2026-01-02T03:04:05Z"},
]
FAST_HEALTH = parse_config("version: v1\nhealth:\n  sampleIntervalSeconds: 0.1\n  recoveryChecks: 2\n")


def apply_rbac_and_policy(admin: k8s.ApiClient) -> None:
    """Create the kustomize base's API objects (all but the DaemonSet, which needs no running pods here)."""
    kustomization = yaml.safe_load((REPO / "daemonset/kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((REPO / "daemonset" / name).read_text()):
            if doc and doc["kind"] != "DaemonSet":
                with contextlib.suppress(utils.FailToCreateError):
                    utils.create_from_dict(admin, doc)


def bound_token(admin: k8s.ApiClient, node: str) -> str:
    """A token of the agent's ServiceAccount bound to a pod on `node`, as the kubelet would mount it."""
    core = k8s.CoreV1Api(admin)
    pod_name = f"gpu-node-agent-{node}"
    with contextlib.suppress(k8s.ApiException):
        core.create_namespaced_pod(NAMESPACE, k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name=pod_name),
            spec=k8s.V1PodSpec(node_name=node, service_account_name=ACCOUNT,
                               containers=[k8s.V1Container(name="agent", image="gpu-node-agent:test")]),
        ))
    pod = core.read_namespaced_pod(pod_name, NAMESPACE)
    request = k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(
        audiences=["https://kubernetes.default.svc.cluster.local"], expiration_seconds=3600,
        bound_object_ref=k8s.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod_name, uid=pod.metadata.uid),
    ))
    return str(core.create_namespaced_service_account_token(ACCOUNT, NAMESPACE, request).status.token)


def kubeconfig(apiserver: ApiServer, token: str, path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rig",
        "clusters": [{"name": "rig", "cluster": {"server": apiserver.url,
                                                 "certificate-authority": str(apiserver.ca_path)}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "rig", "context": {"cluster": "rig", "user": "agent"}}],
    }))
    return path


@pytest.fixture(scope="module")
def agent_kubeconfig(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    admin = apiserver.admin_client()
    apply_rbac_and_policy(admin)
    token = bound_token(admin, NODE)
    core = agent_core(apiserver, token)
    # A new admission policy takes effect a moment after it is created: wait until it refuses.
    deadline = time.monotonic() + 30
    while True:
        try:
            core.patch_node(NODE, {"metadata": {"labels": {"policy-probe": "1"}}})
        except k8s.ApiException as err:
            if err.status == 403:
                break
            raise
        k8s.CoreV1Api(admin).patch_node(NODE, {"metadata": {"labels": {"policy-probe": None}}})
        assert time.monotonic() < deadline, "the admission policy never took effect"
        time.sleep(0.2)
    return kubeconfig(apiserver, token, tmp_path_factory.mktemp("agent") / "kubeconfig")


@pytest.fixture
def admin_core(apiserver: ApiServer) -> Iterator[k8s.CoreV1Api]:
    core = k8s.CoreV1Api(apiserver.admin_client())
    core.patch_node(NODE, {"metadata": {"labels": {"team": "ml"}}, "spec": {"taints": FOREIGN_TAINTS}})
    yield core
    # Leave the node as the next test expects to find it: no agent labels, taint or condition.
    node = core.read_node(NODE)
    stale = {k: None for k in (node.metadata.labels or {}) if k.startswith(("nvidia.com/", "gpu-node-agent.io/"))}
    core.patch_node(NODE, {"metadata": {"labels": stale}, "spec": {"taints": FOREIGN_TAINTS}})
    conditions = [c.type for c in (node.status.conditions or [])]
    if "GPUHealthy" in conditions:
        # A JSON patch on the status: the test op makes it fail rather than remove another condition if the
        # list changed since it was read.
        at = conditions.index("GPUHealthy")
        core.patch_node_status(NODE, [{"op": "test", "path": f"/status/conditions/{at}/type", "value": "GPUHealthy"},
                                      {"op": "remove", "path": f"/status/conditions/{at}"}])
    node = core.read_node(NODE)
    assert [k for k in node.metadata.labels if k.startswith(("nvidia.com/", "gpu-node-agent.io/"))] == []
    assert agent_taints(node) == []
    assert condition(node) is None


@contextlib.asynccontextmanager
async def agent_on_node(
    kubeconfig_path: Path, config: AgentConfig = FAST_HEALTH
) -> AsyncIterator[tuple[Agent, FakeNvml]]:
    async with running_agent("dgx-h100", config, kube=await NodeApi.connect(kubeconfig_path, NODE)) as rig:
        yield rig.agent, rig.fake


def agent_taints(node: Any) -> list[dict[str, Any]]:
    return [{"key": t.key, "value": t.value, "effect": t.effect} for t in node.spec.taints or []
            if t.key == TAINT_KEY]


def foreign_taints(node: Any) -> list[dict[str, Any]]:
    out = []
    for t in node.spec.taints or []:
        if t.key == TAINT_KEY:
            continue
        taint = {"key": t.key, "effect": t.effect}
        if t.value is not None:
            taint["value"] = t.value
        if t.time_added is not None:
            taint["timeAdded"] = t.time_added.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        out.append(taint)
    return out


def healthy(node: Any) -> str:
    """The GPUHealthy condition's status, "" while there is none."""
    return (condition(node) or ("",))[0]


def condition(node: Any) -> tuple[str, str, str] | None:
    for c in node.status.conditions or []:
        if c.type == "GPUHealthy":
            return c.status, c.reason, c.message
    return None


async def test_labels_reach_the_node_and_foreign_ones_survive(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    async with agent_on_node(agent_kubeconfig) as (agent, _):
        expected = node_labels(agent.bus.current, FAST_HEALTH)
        node = admin_core.read_node(NODE)
        labels = node.metadata.labels
        assert {k: labels.get(k) for k in expected} == expected
        assert labels["team"] == "ml"
        assert labels["kubernetes.io/hostname"] == NODE
        assert foreign_taints(node) == FOREIGN_TAINTS
        assert agent_taints(node) == []
        assert condition(node) == ("True", "GPUsHealthy", "all 8 GPUs healthy")


async def test_steady_state_makes_no_writes(agent_kubeconfig: Path, admin_core: k8s.CoreV1Api) -> None:
    async with agent_on_node(agent_kubeconfig) as (agent, _):
        api = agent.options.kube
        assert isinstance(api, NodeApi)
        writes = api.writes
        version = admin_core.read_node(NODE).metadata.resource_version
        # Thirty health samples (three seconds at 0.1 s), each judged under the config, then the reconciler
        # caught up with whatever state they published.
        await health_samples(agent.monitor, 30)
        assert agent.reconciler is not None
        await asyncio.wait_for(agent.reconciler.converged_at(agent.bus.current.version), 10)
        assert api.writes == writes
        assert admin_core.read_node(NODE).metadata.resource_version == version


async def test_node_fault_taints_then_recovers_keeping_foreign_taints(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    async with agent_on_node(agent_kubeconfig) as (agent, fake):
        fake.set_gpu_lost(3)
        node = await wait_until(
            lambda: (n := admin_core.read_node(NODE)) and agent_taints(n) and healthy(n) == "False" and n,
            10, "taint and condition", blocking=True)
        assert agent_taints(node) == [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
        assert foreign_taints(node) == FOREIGN_TAINTS
        assert condition(node) == ("False", "NodeGPUFault", "GPU is lost (fallen off the bus)")
        uuid = agent.bus.current.inventory.gpus[3].uuid

        def event_messages() -> list[str]:
            events = admin_core.list_namespaced_event("default", field_selector=f"involvedObject.name={NODE}")
            return [f"{e.type} {e.reason} {e.message}" for e in events.items]

        assert f"Warning GPUFault GPU {uuid}: GPU is lost (fallen off the bus)" in await wait_until(
            event_messages, 10, "fault event", blocking=True)

        fake.set_gpu_lost(3, False)
        node = await wait_until(
            lambda: (n := admin_core.read_node(NODE)) and not agent_taints(n) and healthy(n) == "True" and n,
            10, "taint removed and condition healthy", blocking=True)
        assert foreign_taints(node) == FOREIGN_TAINTS
        assert condition(node) == ("True", "GPUsHealthy", "all 8 GPUs healthy")
        assert f"Normal GPURecovered GPU {uuid}: recovered from GPU is lost (fallen off the bus)" in (
            await wait_until(lambda: [m for m in event_messages() if "GPURecovered" in m], 10, "recovery event",
                             blocking=True)
        )


class LongestJitter(random.Random):
    """A start jitter drawn at its longest."""

    def uniform(self, a: float, b: float) -> float:
        return b


def jittered(kubeconfig_path: Path, seconds: float, since: float | None = None) -> NodeApi:
    return NodeApi(ApiClient(from_kubeconfig(kubeconfig_path), start_jitter_s=seconds, rng=LongestJitter(),
                             since=since), NODE)


async def test_an_agent_reaches_the_api_server_only_after_its_start_jitter(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    """Agents started together reach the API server spread over the start jitter: nothing is sent before the
    agent's moment (here the longest, 4 s), and the Node is labelled soon after it."""
    started = time.monotonic()
    kube = jittered(agent_kubeconfig, 4.0)
    async with running_agent("dgx-h100", FAST_HEALTH, kube=kube, await_node=False):
        # A request is counted once answered: the first is seen no earlier than it was sent.
        first = await wait_until(lambda: sum(kube.counts.requests.values()) and time.monotonic(), 10,
                                 "the first request")
        assert 4.0 <= first - started < 7.0
        await wait_until(lambda: (admin_core.read_node(NODE).metadata.labels or {}).get("nvidia.com/gpu.count"),
                         10, "the count label", blocking=True)


async def test_a_slow_start_is_not_added_to_the_start_jitter(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    """The jitter counts from the agent process's start: an agent whose start took 3 s (a busy node), with its
    jitter drawn at the longest (4 s), sends its first request about 1 s after it is up, not 4 s."""
    started = time.monotonic()
    kube = jittered(agent_kubeconfig, 4.0, since=started - 3.0)
    async with running_agent("dgx-h100", FAST_HEALTH, kube=kube, await_node=False):
        first = await wait_until(lambda: sum(kube.counts.requests.values()) and time.monotonic(), 10,
                                 "the first request")
        assert 1.0 <= first - started < 4.0
        await wait_until(lambda: (admin_core.read_node(NODE).metadata.labels or {}).get("nvidia.com/gpu.count"),
                         10, "the count label", blocking=True)


async def test_a_node_fault_at_start_is_not_held_back_by_the_start_jitter(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    """A node fault goes to the Node at once, however long the start jitter: an XID 79 just after the agent
    started taints the node within seconds, not after the 60 s drawn here."""
    kube = jittered(agent_kubeconfig, 60.0)
    async with running_agent("dgx-h100", FAST_HEALTH, kube=kube, await_node=False) as rig:
        assert sum(kube.counts.requests.values()) == 0
        rig.fake.inject_xid(3, 79)
        node = await wait_until(
            lambda: (n := admin_core.read_node(NODE)) and agent_taints(n) and healthy(n) == "False" and n,
            10, "taint and condition", blocking=True)
        assert agent_taints(node) == [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]


async def test_a_machine_type_no_label_takes_still_lets_a_fault_taint_the_node(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api, tmp_path: Path
) -> None:
    """A DMI product name (or machineTypeFile) beginning with '_' was once written as an invalid label value,
    which the API server refused with the whole label patch, forever; the fault's taint never came."""
    machine = tmp_path / "product_name"
    machine.write_text("_Custom Build\n")
    admin_core.patch_node(NODE, {"metadata": {"labels": {"gpu-node-agent.io/team": "infra"}}})
    config = parse_config("version: v1\nflags:\n  gfd:\n    machineTypeFile: " + str(machine)
                          + "\nhealth:\n  sampleIntervalSeconds: 0.1\n  recoveryChecks: 2\n")
    async with agent_on_node(agent_kubeconfig, config) as (_, fake):
        await wait_until(lambda: admin_core.read_node(NODE).metadata.labels.get("nvidia.com/gpu.machine"), 10,
                         "the machine label", blocking=True)
        fake.inject_xid(3, 79)
        node = await wait_until(
            lambda: (n := admin_core.read_node(NODE)) and agent_taints(n) and healthy(n) == "False" and n,
            10, "taint and condition", blocking=True)
        assert agent_taints(node) == [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
        assert node.metadata.labels["nvidia.com/gpu.machine"] == "Custom-Build"
        assert node.metadata.labels["nvidia.com/gpu.count"] == "8"
        # Under the agent's prefix, but not a label the agent writes: left alone.
        assert node.metadata.labels["gpu-node-agent.io/team"] == "infra"


async def test_ready_only_once_the_node_shows_the_gpus_in_allocatable(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    """What the kubelet writes into the Node's status after a registration decides readiness: a rolling update
    then waits until the scheduler can see this node's GPUs before it takes the next node's agent down."""

    def allocatable(gpus: str) -> None:
        # What the kubelet's node-status sync writes once the device plugin's devices are in its device manager.
        admin_core.patch_node_status(NODE, {"status": {"capacity": {"nvidia.com/gpu": gpus},
                                                       "allocatable": {"nvidia.com/gpu": gpus}}})

    allocatable("0")  # the old agent's pod stopped: the kubelet shows no GPUs
    try:
        async with agent_on_node(agent_kubeconfig) as (agent, fake):
            assert agent.ready() == (False, "the Node's Allocatable does not show nvidia.com/gpu: 8 yet")
            allocatable("8")
            await wait_until(lambda: agent.ready() == (True, "ok"), 10, "ready once Allocatable shows 8")
            # A later change (a GPU fault lowers Allocatable) leaves the agent ready: it is still serving.
            fake.set_gpu_lost(3)
            allocatable("7")
            reconciler = agent.reconciler
            assert reconciler is not None
            uuid = agent.bus.current.inventory.gpus[3].uuid
            await wait_until(lambda: (h := agent.bus.current.health.get(uuid)) is not None and not h.healthy, 10,
                             "GPU 3 unhealthy in the agent's state")
            await wait_until(lambda: reconciler.node is not None
                             and reconciler.node.allocatable.get("nvidia.com/gpu") == "7", 10,
                             "the agent's view of the Node showing Allocatable 7")
            assert agent.ready() == (True, "ok")
    finally:
        admin_core.patch_node_status(NODE, [{"op": "remove", "path": "/status/capacity/nvidia.com~1gpu"},
                                            {"op": "remove", "path": "/status/allocatable/nvidia.com~1gpu"}])


async def test_watch_survives_an_api_server_restart(
    apiserver: ApiServer, agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    async with agent_on_node(agent_kubeconfig) as (_, _fake):
        await asyncio.to_thread(apiserver.restart)
        core = k8s.CoreV1Api(apiserver.admin_client())
        core.patch_node(NODE, {"metadata": {"labels": {"nvidia.com/gpu.count": None}}})
        await wait_until(lambda: core.read_node(NODE).metadata.labels.get("nvidia.com/gpu.count") == "8",
                         60, "the agent restoring its label after the restart", blocking=True)


def agent_core(apiserver: ApiServer, token: str) -> k8s.CoreV1Api:
    return k8s.CoreV1Api(apiserver._client(api_key={"BearerToken": token}, api_key_prefix={"BearerToken": "Bearer"}))


def test_agent_identity_is_refused_what_it_must_not_do(
    apiserver: ApiServer, agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    token = yaml.safe_load(agent_kubeconfig.read_text())["users"][0]["user"]["token"]
    core = agent_core(apiserver, token)
    refused = {
        "patch another node": lambda: core.patch_node(
            OTHER_NODE, {"metadata": {"labels": {"gpu-node-agent.io/x": "1"}}}
        ),
        "set a foreign label": lambda: core.patch_node(NODE, {"metadata": {"labels": {"team": "evil"}}}),
        "drop a foreign taint": lambda: core.patch_node(NODE, {"spec": {"taints": []}}),
        "cordon the node": lambda: core.patch_node(NODE, {"spec": {"unschedulable": True}}),
        "cordon a GPU": lambda: core.patch_node(NODE, {"metadata": {"annotations": {
            "gpu-node-agent.io/cordon": "0"}}}),
        "read secrets": lambda: core.list_namespaced_secret("kube-system"),
        "delete the node": lambda: core.delete_node(NODE),
    }
    codes = {}
    for what, call in refused.items():
        with pytest.raises(k8s.ApiException) as caught:
            call()
        codes[what] = caught.value.status
    assert codes == {
        "patch another node": 403, "set a foreign label": 403, "drop a foreign taint": 403,
        "cordon the node": 403, "cordon a GPU": 403, "read secrets": 403, "delete the node": 403,
    }
    patched = core.patch_node(NODE, {"metadata": {"labels": {"gpu-node-agent.io/probe": "1"}}})
    assert patched.metadata.labels["gpu-node-agent.io/probe"] == "1"
    core.patch_node(NODE, {"metadata": {"labels": {"gpu-node-agent.io/probe": None}}})


async def test_mig_label_protocol_on_a_real_node(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api, tmp_path: Path
) -> None:
    config = parse_config(yaml.safe_dump({
        "version": "v1", "flags": {"migStrategy": "mixed"},
        "mig": {"stateDir": str(tmp_path / "state"), "podResourcesSocket": str(tmp_path / "none.sock")},
    }))
    states: list[str] = []

    def record_states(stop: threading.Event) -> None:
        w = k8s_watch.Watch()
        for event in w.stream(admin_core.list_node, field_selector=f"metadata.name={NODE}", timeout_seconds=60):
            state = (event["object"].metadata.labels or {}).get("nvidia.com/mig.config.state")
            if state and (not states or states[-1] != state):
                states.append(state)
            if stop.is_set():
                w.stop()

    stop = threading.Event()
    watcher = threading.Thread(target=record_states, args=(stop,), daemon=True)
    watcher.start()
    try:
        async with agent_on_node(agent_kubeconfig, config) as (agent, _):
            admin_core.patch_node(NODE, {"metadata": {"labels": {"nvidia.com/mig.config": "all-1g.10gb"}}})
            node = await wait_until(
                lambda: (n := admin_core.read_node(NODE)).metadata.labels.get("nvidia.com/mig.config.state")
                == "success" and n, 60, "success", blocking=True)
            assert node.metadata.annotations["nvidia.com/mig.config.state.reason"] == (
                "layout 'all-1g.10gb' applied: 64 change(s)")
            assert node.metadata.labels["nvidia.com/mig-1g.10gb.count"] == "56"
            assert agent.devices() and len(agent.devices()["nvidia.com/mig-1g.10gb"]) == 56

            admin_core.patch_node(NODE, {"metadata": {"labels": {"nvidia.com/mig.config": "no-such-layout"}}})
            node = await wait_until(
                lambda: (n := admin_core.read_node(NODE)).metadata.labels.get("nvidia.com/mig.config.state")
                == "failed" and n, 60, "failed", blocking=True)
            assert node.metadata.annotations["nvidia.com/mig.config.state.reason"].startswith(
                "built-in default-layouts.yaml: no layout named 'no-such-layout' (known: ")
            def reasons() -> list[str]:
                events = admin_core.list_namespaced_event("default", field_selector=f"involvedObject.name={NODE}")
                return [e.reason for e in events.items]

            await wait_until(lambda: "MigConfigFailed" in reasons(), 10, "the failure event", blocking=True)
            assert "MigConfigApplied" in reasons()
        await wait_until(lambda: states[-1:] == ["failed"], 10, "the watch to see failed")
        assert states == ["pending", "success", "pending", "failed"]
    finally:
        stop.set()
        admin_core.patch_node(NODE, {"metadata": {
            "labels": {"nvidia.com/mig.config": None, "nvidia.com/mig.config.state": None},
            "annotations": {"nvidia.com/mig.config.state.reason": None}}})


async def test_a_repeated_event_raises_the_count_of_the_one_recorded(apiserver: ApiServer,
                                                                      admin_core: k8s.CoreV1Api) -> None:
    """As the kubelet's recorder: the same reason and message again is one Event with a count, not two."""
    api = await NodeApi.connect(apiserver.kubeconfig_path, NODE)
    uid = admin_core.read_node(NODE).metadata.uid
    try:
        for _ in range(3):
            await api.event("GPUWarning", "GPU GPU-x: XID 94 (repeat test)", "Warning", uid)
        await api.event("GPUWarning", "GPU GPU-y: XID 94 (repeat test)", "Warning", uid)
    finally:
        await api.close()
    listed = admin_core.list_namespaced_event("default", field_selector=f"involvedObject.name={NODE}")
    mine = sorted((e.message, e.count) for e in listed.items if "(repeat test)" in (e.message or ""))
    assert mine == [("GPU GPU-x: XID 94 (repeat test)", 3), ("GPU GPU-y: XID 94 (repeat test)", 1)]
    assert dict(api.counts.requests) == {("post", "events", "201"): 2, ("patch", "events", "200"): 2}


async def test_a_gpu_cordoned_by_the_nodes_annotation_is_withheld_and_given_back(
    agent_kubeconfig: Path, admin_core: k8s.CoreV1Api
) -> None:
    """The operator's `kubectl annotate node ... gpu-node-agent.io/cordon=5` through the API server: GPU 5 leaves
    the device plugin's offer within 2 s, the Node shows it cordoned, an Event says so; `...cordon-` gives it back
    and the agent's answer leaves the Node. The agent never writes the operator's annotation."""
    mark, answer = "gpu-node-agent.io/cordon", "gpu-node-agent.io/cordon.state"
    uid = admin_core.read_node(NODE).metadata.uid

    def cordon_events() -> list[tuple[str, str]]:
        listed = admin_core.list_namespaced_event("default", field_selector=f"involvedObject.uid={uid}")
        return sorted((e.reason, e.message) for e in listed.items if e.reason in ("GPUCordoned", "GPUUncordoned"))

    async with running_agent("dgx-h100", FAST_HEALTH, kube=await NodeApi.connect(agent_kubeconfig, NODE)) as rig:
        uuid5 = rig.uuid(5)
        try:
            admin_core.patch_node(NODE, {"metadata": {"annotations": {mark: "5"}}})
            await wait_until(lambda: rig.health() == ["Healthy"] * 5 + ["Unhealthy"] + ["Healthy"] * 2, 2,
                             "GPU 5 Unhealthy in ListAndWatch within 2 s of the annotation")
            node = await wait_until(
                lambda: (n := admin_core.read_node(NODE)) and answer in (n.metadata.annotations or {}) and n, 10,
                "the Node's cordon state", blocking=True)
            # No kubelet PodResources socket beside this agent: who holds GPU 5 is not known, and said so.
            assert node.metadata.annotations[answer] == f"GPU 5 ({uuid5}): holders not known"
            assert node.metadata.annotations[mark] == "5"
            await wait_until(lambda: cordon_events() == [("GPUCordoned", "GPU 5 cordoned (gpu-node-agent.io/cordon): "
                                                          "no new pod is given it; pods holding it run on")],
                             10, "the GPUCordoned Event", blocking=True)
        finally:
            admin_core.patch_node(NODE, {"metadata": {"annotations": {mark: None}}})
        await wait_until(lambda: rig.health() == ["Healthy"] * 8, 2, "GPU 5 offered again within 2 s")
        await wait_until(lambda: answer not in (admin_core.read_node(NODE).metadata.annotations or {}), 10,
                         "the agent's answer removed", blocking=True)
        await wait_until(lambda: ("GPUUncordoned", "GPU 5 uncordoned: offered again") in cordon_events(), 10,
                         "the GPUUncordoned Event", blocking=True)
