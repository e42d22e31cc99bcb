"""A real `gpu-agent run` in DRA mode with dra.dynamicMig, on the fake NVML of a DGX H100 shared through a mock
state file, against the rig's kube-apiserver and kube-scheduler (DRAPartitionableDevices on): the agent is
killed between two driver calls of a claim's prepare or unprepare (the fake ends the process with status 137
after its N-th GPU change, GPU_AGENT_FAKE_CRASH_AFTER), started again, and the kubelet's retry over the plugin's
socket converges with no MIG device, CDI spec or claim left behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from apiserver import REPO, wait_until
from dra_rig import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    DRIVER,
    MIG_CLASS,
    NAMESPACE,
    GatedApiServer,
    allocated,
    claim_of_pod,
    control_plane,
    create_claim,
    create_pod,
    create_schedulable_node,
    delete_node,
    gated_apiserver,
    remove_workloads,
    setup_cluster,
    slices_of,
)
from kubernetes import client as k8s

from agent.dra.v1 import api_pb2 as v1
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.nvml.backend import fake_backend
from agent.nvml.fake import CRASH_AFTER_ENV, FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import load_node
from tests.plugin_harness import carve_mig, short_dir

AGENT = [sys.executable, "-m", "agent.cli"]
GATES = "DRAPartitionableDevices=true"
NODE = "dra-crash"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    with gated_apiserver(tmp_path_factory.mktemp("crash-apiserver"), GATES) as server:
        setup_cluster(server)
        with control_plane(server, tmp_path_factory.mktemp("crash-control-plane"), GATES):
            yield server


class Agent:
    """`gpu-agent run` on one node directory; its log in a file, read as it grows."""

    def __init__(self, server: GatedApiServer, directory: Path) -> None:
        self.directory = directory
        self.state = directory / "nvml.json"
        self.kubeconfig = server.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
        self.config = directory / "config.yaml"
        self.config.write_text(yaml.safe_dump({"version": "v1", "dra": {
            "enabled": True, "dynamicMig": True, "cdiRoot": str(directory / "cdi")}, "mig": {
            "stateDir": str(directory / "state"), "podResourcesSocket": str(directory / "pr.sock")}}))
        self.endpoint = directory / "plugins" / DRIVER / "dra.sock"
        self.checkpoint = directory / "plugins" / DRIVER / "checkpoint.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = directory / "agent.log"
        self.since = 0
        """The log's lines before the last start."""

    def start(self, crash_after: int | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("POD_") and k != CRASH_AFTER_ENV}
        if crash_after is not None:
            env[CRASH_AFTER_ENV] = str(crash_after)
        (self.directory / "device-plugins").mkdir(parents=True, exist_ok=True)
        self.since = len(self.lines())
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*AGENT, "run", "--kubeconfig", str(self.kubeconfig), "--node-name", NODE, "--nvml", "mock:dgx-h100",
                 "--mock-state", str(self.state), "--kubelet-dir", str(self.directory / "device-plugins"),
                 "--metrics-port", "0", "--kube-start-jitter", "0", "--config", str(self.config)],
                stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def serving(self) -> None:
        """Wait for the DRA plugin's sockets."""
        self.wait_for(f"DRA plugin {DRIVER}: registration socket")

    def wait_for(self, text: str, timeout: float = 60) -> None:
        def seen() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.lines()[-20:]
            return any(text in line for line in self.lines()[self.since:])

        wait_until(seen, timeout, f"the agent to log {text!r}")

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.proc = None
        return code

    def gpu0(self) -> list[tuple[int, int, int]]:
        """GPU 0's GPU instances as the fake's shared state has them: (placement start, size, compute instances)."""
        backend = fake_backend(FakeNvml(load_node("dgx-h100"), self.state))
        backend.init()
        try:
            return [(i.start, i.size, i.compute_instances) for i in MigOps(backend).state(0).instances]
        finally:
            backend.shutdown()

    def claims(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.checkpoint.read_text())["claims"]
        return found

    def cdi(self) -> list[str]:
        folder = self.directory / "cdi"
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def call(agent: Agent, prepare: bool, claim: v1.Claim) -> str | None:
    """NodePrepareResources or NodeUnprepareResources for `claim` as the kubelet sends it; the claim's error, or
    None when the call got no answer (the agent died)."""

    async def send() -> str | None:
        async with grpc.aio.insecure_channel(f"unix://{agent.endpoint}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            try:
                if prepare:
                    answer: Any = await stub.NodePrepareResources(
                        v1.NodePrepareResourcesRequest(claims=[claim]), timeout=20)
                else:
                    answer = await stub.NodeUnprepareResources(
                        v1.NodeUnprepareResourcesRequest(claims=[claim]), timeout=20)
            except grpc.aio.AioRpcError:
                return None
            return str(answer.claims[claim.uid].error)

    return asyncio.run(send())


@pytest.fixture
def agent(rig: GatedApiServer) -> Iterator[Agent]:
    directory = short_dir()
    create_schedulable_node(rig, NODE)
    fake = FakeNvml(load_node("dgx-h100"), directory / "nvml.json")
    carve_mig(fake, 0, [])  # GPU 0 in MIG mode, no instances
    found = Agent(rig, directory)
    try:
        yield found
    finally:
        if found.proc is not None:
            found.proc.kill()
            found.proc.wait(30)
        remove_workloads(rig)
        delete_node(rig, NODE)
        custom = k8s.CustomObjectsApi(rig.admin_client())
        for found_slice in slices_of(rig, NODE):  # no garbage collector runs here to follow the owner
            custom.delete_cluster_custom_object("resource.k8s.io", "v1", "resourceslices",
                                                found_slice["metadata"]["name"])
        shutil.rmtree(directory, ignore_errors=True)


def published(server: GatedApiServer) -> bool:
    return any(s["metadata"]["name"].endswith("-gpu-0") for s in slices_of(server, NODE))


@pytest.mark.parametrize(("crash_after", "left"), [(1, [(4, 4, 0)]), (2, [(4, 4, 1)])],
                         ids=["after-the-gpu-instance", "after-the-compute-instance"])
def test_an_agent_killed_in_a_prepare_rolls_it_back_at_start_and_the_retry_prepares_it(
        rig: GatedApiServer, agent: Agent, crash_after: int, left: list[tuple[int, int, int]]) -> None:
    agent.start(crash_after=crash_after)
    agent.wait_for("the API server keeps shared counters")
    wait_until(lambda: published(rig), 60, "the placements published")
    expression = (f"device.attributes['{DRIVER}'].profile == '3g.40gb' && "
                  f"device.attributes['{DRIVER}'].placementStart == 4")
    create_claim(rig, "crash", {"devices": {"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS, "selectors": [{"cel": {"expression": expression}}]}}]}})
    create_pod(rig, "crash", "crash")
    assert allocated(rig, "crash") == (NODE, [("mig", NODE, "gpu-0-mig-3g40gb-4")])
    found = claim_of_pod(rig, "crash")
    assert found is not None
    uid = found["metadata"]["uid"]
    claim = v1.Claim(namespace=NAMESPACE, uid=uid, name="crash")

    assert call(agent, True, claim) is None  # killed in the middle
    assert agent.stop() == 137
    assert agent.gpu0() == left, agent.lines()[-15:]
    assert {u: c["state"] for u, c in agent.claims().items()} == {uid: "PrepareStarted"}

    agent.start()
    agent.wait_for(f"rolled back the prepare of claim {NAMESPACE}/crash ({uid}) that a restart cut short; the "
                   "kubelet prepares it again")
    agent.serving()
    assert agent.gpu0() == []
    assert (agent.claims(), agent.cdi()) == ({}, [])
    wait_until(lambda: published(rig), 60, "the placements published")
    agent.wait_for("the API server keeps shared counters")  # from here on the placements are devices
    assert call(agent, True, claim) == ""
    assert agent.gpu0() == [(4, 4, 1)]
    assert {u: c["state"] for u, c in agent.claims().items()} == {uid: "PrepareCompleted"}
    assert agent.cdi() == [f"{DRIVER}-claim-{uid}.json"]
    assert call(agent, False, claim) == ""
    assert (agent.gpu0(), agent.claims(), agent.cdi()) == ([], {}, [])
    assert agent.stop() == 0


@pytest.mark.parametrize("crash_after", [3, 4], ids=["after-the-compute-instance", "after-the-gpu-instance"])
def test_an_agent_killed_in_an_unprepare_finishes_it_on_the_retry(
        rig: GatedApiServer, agent: Agent, crash_after: int) -> None:
    # The prepare makes the GPU and the compute instance (changes 1 and 2); the unprepare destroys them (3, 4).
    agent.start(crash_after=crash_after)
    agent.wait_for("the API server keeps shared counters")
    wait_until(lambda: published(rig), 60, "the placements published")
    create_claim(rig, "crash", {"devices": {"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS, "selectors": [{"cel": {
            "expression": f"device.attributes['{DRIVER}'].profile == '7g.80gb'"}}]}}]}})
    create_pod(rig, "crash", "crash")
    assert allocated(rig, "crash") == (NODE, [("mig", NODE, "gpu-0-mig-7g80gb-0")])
    found = claim_of_pod(rig, "crash")
    assert found is not None
    uid = found["metadata"]["uid"]
    claim = v1.Claim(namespace=NAMESPACE, uid=uid, name="crash")
    agent.serving()
    assert call(agent, True, claim) == ""
    assert agent.gpu0() == [(0, 8, 1)]

    assert call(agent, False, claim) is None  # killed in the middle
    assert agent.stop() == 137
    assert agent.gpu0() == ([(0, 8, 0)] if crash_after == 3 else [])
    assert {u: c["state"] for u, c in agent.claims().items()} == {uid: "PrepareCompleted"}

    agent.start()
    agent.serving()
    # The claim is still prepared: the start leaves it, its spec and what is left of its MIG device alone.
    assert agent.cdi() == [f"{DRIVER}-claim-{uid}.json"]
    assert call(agent, False, claim) == ""
    assert (agent.gpu0(), agent.claims(), agent.cdi()) == ([], {}, [])
    assert agent.stop() == 0
