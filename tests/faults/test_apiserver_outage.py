"""The API server down for a minute: the agent keeps serving the kubelet (Allocate, health changes in
ListAndWatch), and when the server is back the Node converges with nothing lost and nothing twice."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from apiserver import NODE, ApiServer, ensure_testbin, group_alive, running
from kubernetes import client as k8s

from agent.config import parse_config
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.kube.node import NodeApi
from agent.labels import node_labels
from tests.plugin_harness import running_agent, wait_until

OUTAGE_S = 60.0
CONVERGE_S = 15.0
"""The fleet budget: every agent has its Node right within 15 s of the API server being back (with the shipped
backoff: while the server refuses connections, a retry waits at most 12.5 s)."""
RESOURCE = "nvidia.com/gpu"
CONFIG = parse_config("version: v1\nhealth:\n  sampleIntervalSeconds: 0.1\n  recoveryChecks: 2\n")
TAINT = {"key": "gpu-node-agent.io/gpu-fault", "value": "true", "effect": "NoSchedule"}
LOST = "GPU is lost (fallen off the bus)"


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[ApiServer]:
    """A rig of its own: this test stops its API server for a minute, which the session's rig must not see."""
    ensure_testbin()
    with running(tmp_path / "rig", nodes=(NODE,)) as server:
        groups = list(server.process_groups)
        yield server
    assert not [g for g in groups if group_alive(g)], "the rig left processes behind"


def kill_apiserver(server: ApiServer) -> None:
    """Kill kube-apiserver alone, the way a crashed control-plane node loses it; etcd, and so every object, stays.
    (ApiServer.restart, without the start and without a graceful goodbye to open watches.)"""
    proc = server._apiserver
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    server._apiserver = None


def refused(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def taints(node: Any) -> list[dict[str, str | None]]:
    return [{"key": t.key, "value": t.value, "effect": t.effect} for t in node.spec.taints or []]


def agent_taints(node: Any) -> list[dict[str, str | None]]:
    return [t for t in taints(node) if t["key"] == TAINT["key"]]


def condition(node: Any) -> tuple[str, str, str] | None:
    for c in node.status.conditions or []:
        if c.type == "GPUHealthy":
            return c.status, c.reason, c.message
    return None


def owned_labels(node: Any) -> dict[str, str]:
    labels = node.metadata.labels or {}
    return {k: v for k, v in labels.items() if k.startswith(("nvidia.com/", "gpu-node-agent.io/"))}


def events(core: k8s.CoreV1Api) -> Counter[tuple[str, str, str]]:
    listed = core.list_namespaced_event("default", field_selector=f"involvedObject.name={NODE}")
    return Counter((e.type, e.reason, e.message) for e in listed.items)


def allocate_request(*ids: str) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(ids))])


async def test_a_minute_without_the_api_server_serves_the_kubelet_and_converges_after(
    rig: ApiServer
) -> None:
    core = k8s.CoreV1Api(rig.admin_client())
    loop = asyncio.get_running_loop()
    api = await NodeApi.connect(rig.kubeconfig_path, NODE)
    async with running_agent("dgx-h100", CONFIG, kube=api) as on_node:
        agent, kubelet, fake, directory = on_node.agent, on_node.kubelet, on_node.fake, on_node.directory
        uuid = [g.uuid for g in agent.bus.current.inventory.gpus]
        labels = node_labels(agent.bus.current, CONFIG)
        node = core.read_node(NODE)
        assert owned_labels(node) == labels
        assert condition(node) == ("True", "GPUsHealthy", "all 8 GPUs healthy")
        assert events(core) == Counter()
        foreign = taints(node)  # whatever the API server put there (node.kubernetes.io/not-ready) stays
        assert agent_taints(node) == []

        await asyncio.to_thread(kill_apiserver, rig)
        down_since = loop.time()
        assert refused(rig.port)
        # During the outage: GPU 3 falls off the bus, GPU 5 warns (XID 94), GPU 6 faults (XID 48) and recovers.
        fake.set_gpu_lost(3)
        fake.inject_xid(5, 94)
        fake.inject_xid(6, 48)
        view = kubelet.plugins[RESOURCE]
        await wait_until(lambda: [d.health for d in view.devices] == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4
                         and any(i.kind == "recovered" for i in agent.bus.current.incidents),
                         10, "the kubelet to see GPU 3 unhealthy and GPU 6 recovered")
        # It tried, and failed, to tell the API server.
        await wait_until(lambda: (agent.metrics.registry.get_sample_value("gpu_agent_api_errors_total") or 0) > 0,
                         10, "a failed API request")

        channel = grpc.aio.insecure_channel(f"unix://{directory / view.endpoint}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        probes = 0
        while loop.time() - down_since < OUTAGE_S:
            # Through the whole minute the kubelet is served as if nothing had happened.
            response = await stub.Allocate(allocate_request(uuid[0], uuid[7]), timeout=5)
            assert [dict(c.envs) for c in response.container_responses] == [
                {"NVIDIA_VISIBLE_DEVICES": f"{uuid[0]},{uuid[7]}"}]
            with pytest.raises(grpc.aio.AioRpcError) as unhealthy:
                await stub.Allocate(allocate_request(uuid[3]), timeout=5)
            assert (unhealthy.value.code(), unhealthy.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT, f"device {uuid[3]} of resource {RESOURCE} is unhealthy: {LOST}")
            assert refused(rig.port)
            probes += 1
            await asyncio.sleep(min(2.0, max(0.0, OUTAGE_S - (loop.time() - down_since))))
        assert probes >= OUTAGE_S / 3
        await channel.close()

        await asyncio.to_thread(rig._start_apiserver)
        expected_events = Counter({
            ("Warning", "GPUFault", f"GPU {uuid[3]}: {LOST}"): 1,
            ("Warning", "GPUWarning", f"GPU {uuid[5]}: XID 94"): 1,
            ("Warning", "GPUFault", f"GPU {uuid[6]}: XID 48"): 1,
            ("Normal", "GPURecovered", f"GPU {uuid[6]}: recovered from XID 48"): 1,
        })
        node = await wait_until(
            lambda: (n := core.read_node(NODE)) and agent_taints(n) == [TAINT]
            and condition(n) == ("False", "NodeGPUFault", LOST) and events(core) == expected_events and n,
            CONVERGE_S, "the node to converge after the outage", blocking=True)
        # GPU 3 went off the bus during the outage: the label that counts lost GPUs came with it.
        labels = {**labels, "gpu-node-agent.io/gpu.lost": "1"}
        assert owned_labels(node) == labels
        await on_node.converged(CONVERGE_S)
        # The watch is back too: an owned label removed by hand is restored.
        core.patch_node(NODE, {"metadata": {"labels": {"nvidia.com/gpu.count": None}}})
        node = await wait_until(lambda: (n := core.read_node(NODE)) and owned_labels(n) == labels and n,
                                CONVERGE_S, "the agent to restore its label", blocking=True)
        assert taints(node) == [*foreign, TAINT]
        assert events(core) == expected_events
