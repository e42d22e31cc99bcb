"""A rolling update of the agent in DRA mode, as a DaemonSet with maxSurge 1 runs it: two real `gpu-agent run`
processes on one node directory, each with its Pod's UID in POD_UID, on the fake NVML of a DGX H100 shared through
a mock state file, against the rig's kube-apiserver and kube-scheduler (DRAPartitionableDevices on, for dynamic
MIG), with a stand-in kubelet for the device plugin. Both register under their own sockets; the new agent
unprepares a claim the old one prepared; a prepare on the new one waits while the old one holds the node's prepare
lock, and then succeeds; the new agent takes the device plugin over only once the old one exited, which leaves no
socket of its own behind."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from apiserver import REPO
from dra_rig import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    DEVICE_CLASS,
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

from agent.dra.pluginregistration import api_pb2 as reg
from agent.dra.pluginregistration import api_pb2_grpc as reg_grpc
from agent.dra.v1 import api_pb2 as v1
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.nvml.fake import CRASH_AFTER_ENV, FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import StandInKubelet
from tests.plugin_harness import carve_mig, short_dir, wait_until

AGENT = [sys.executable, "-m", "agent.cli"]
GATES = "DRAPartitionableDevices=true"
NODE = "dra-rolling"
MIG_RESOURCE = "nvidia.com/mig-3g.40gb"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedApiServer]:
    with gated_apiserver(tmp_path_factory.mktemp("rolling-apiserver"), GATES) as server:
        setup_cluster(server)
        with control_plane(server, tmp_path_factory.mktemp("rolling-control-plane"), GATES):
            yield server


class Node:
    """One node's directories (kubelet, CDI, the fake NVML's state) and the config its agents share."""

    def __init__(self, server: GatedApiServer, directory: Path, dra: dict[str, Any], flags: dict[str, Any]) -> None:
        self.server = server
        self.directory = directory
        # The kubelet's directory is the short directory itself: /tmp/ga-<8>/ is as long as /var/lib/kubelet/, so
        # the sockets named with a Pod UID are as long as on a node (101 bytes for the registration socket).
        self.kubelet_dir = directory / "device-plugins"
        self.kubelet_dir.mkdir(parents=True)
        self.registry = directory / "plugins_registry"
        self.plugin_dir = directory / "plugins" / DRIVER
        self.cdi = directory / "cdi"
        self.state = directory / "nvml.json"
        self.kubeconfig = server.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)
        self.config = directory / "config.yaml"
        self.config.write_text(yaml.safe_dump({
            "version": "v1", "flags": flags, "dra": {"enabled": True, "cdiRoot": str(self.cdi), **dra},
            "mig": {"stateDir": str(directory / "state"), "podResourcesSocket": str(directory / "pr.sock")}}))

    def sockets(self) -> dict[str, list[str]]:
        """The sockets in the kubelet's directories, by directory."""
        return {folder.name: sorted(p.name for p in folder.iterdir() if p.is_socket())
                for folder in (self.kubelet_dir, self.registry, self.plugin_dir) if folder.exists()}

    def claims(self) -> dict[str, str]:
        path = self.plugin_dir / "checkpoint.json"
        found = json.loads(path.read_text())["claims"] if path.exists() else {}
        return {uid: entry["state"] for uid, entry in found.items()}

    def cdi_files(self) -> list[str]:
        return sorted(p.name for p in self.cdi.iterdir()) if self.cdi.exists() else []


class Agent:
    """`gpu-agent run` as one Pod of the DaemonSet: its own POD_UID, its log in a file."""

    def __init__(self, node: Node, name: str) -> None:
        self.node = node
        self.uid = str(uuid.uuid4())
        self.log = node.directory / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.registration = node.registry / f"{DRIVER}-{self.uid}-reg.sock"
        self.endpoint = node.plugin_dir / f"dra-{self.uid}.sock"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("POD_") and k != CRASH_AFTER_ENV}
        env["POD_UID"] = self.uid
        node = self.node
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*AGENT, "run", "--kubeconfig", str(node.kubeconfig), "--node-name", NODE, "--nvml", "mock:dgx-h100",
                 "--mock-state", str(node.state), "--kubelet-dir", str(node.kubelet_dir), "--metrics-port", "0",
                 "--kube-start-jitter", "0", "--config", str(node.config)],
                stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    async def logged(self, text: str, timeout: float = 60) -> None:
        def seen() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.lines()[-20:]
            return any(text in line for line in self.lines())

        await wait_until(seen, timeout, f"the agent to log {text!r}")

    async def serving(self) -> None:
        """Its DRA plugin serves (registration socket and endpoint)."""
        await self.logged(f"DRA plugin {DRIVER}: registration socket {self.registration}, endpoint {self.endpoint}")

    async def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(self.proc.wait, 30)
        self.proc = None
        return code

    async def info(self) -> tuple[str, str, str]:
        """What its registration socket answers the kubelet's GetInfo: type, name, endpoint."""
        async with grpc.aio.insecure_channel(f"unix://{self.registration}") as channel:
            info = await reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)
        return info.type, info.name, info.endpoint

    async def prepare(self, claim: v1.Claim, timeout: float = 30) -> str:
        async with grpc.aio.insecure_channel(f"unix://{self.endpoint}") as channel:
            answer = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim]), timeout=timeout)
        return str(answer.claims[claim.uid].error)

    async def unprepare(self, claim: v1.Claim) -> str:
        async with grpc.aio.insecure_channel(f"unix://{self.endpoint}") as channel:
            answer = await v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim]), timeout=30)
        return str(answer.claims[claim.uid].error)


@contextlib.asynccontextmanager
async def node_of(rig: GatedApiServer, dra: dict[str, Any], flags: dict[str, Any],
                  mig: list[tuple[int, list[tuple[str, int]]]]) -> AsyncIterator[tuple[Node, Agent, Agent]]:
    """A schedulable Node with its directories and two agents (not started), everything removed afterwards."""
    directory = short_dir()
    await asyncio.to_thread(create_schedulable_node, rig, NODE)
    fake = FakeNvml(load_node("dgx-h100"), directory / "nvml.json")
    for gpu, instances in mig:
        carve_mig(fake, gpu, instances)
    node = Node(rig, directory, dra, flags)
    old, new = Agent(node, "old"), Agent(node, "new")
    try:
        yield node, old, new
    finally:
        for agent in (old, new):
            if agent.proc is not None:
                agent.proc.kill()
                await asyncio.to_thread(agent.proc.wait, 30)
        await asyncio.to_thread(remove_workloads, rig)
        await asyncio.to_thread(delete_node, rig, NODE)
        custom = k8s.CustomObjectsApi(rig.admin_client())
        for found in await asyncio.to_thread(slices_of, rig, NODE):  # no garbage collector follows the owner here
            await asyncio.to_thread(custom.delete_cluster_custom_object, "resource.k8s.io", "v1", "resourceslices",
                                    found["metadata"]["name"])
        shutil.rmtree(directory, ignore_errors=True)


async def allocated_claim(rig: GatedApiServer, name: str, request: dict[str, Any]) -> tuple[v1.Claim, str]:
    """A claim of one device, allocated on NODE by the scheduler for a pod of the same name: as the kubelet names
    it, and the device."""
    await asyncio.to_thread(create_claim, rig, name, {"devices": {"requests": [{"name": "dev", "exactly": request}]}})
    await asyncio.to_thread(create_pod, rig, name, name)
    where, results = await asyncio.to_thread(allocated, rig, name)
    assert where == NODE and len(results) == 1
    found = await asyncio.to_thread(claim_of_pod, rig, name)
    assert found is not None
    return v1.Claim(namespace=NAMESPACE, uid=found["metadata"]["uid"], name=name), results[0][2]


async def test_the_new_agent_serves_dra_beside_the_old_one_and_takes_the_device_plugin_over_once_it_exits(
        rig: GatedApiServer) -> None:
    # GPU 1 has a MIG device of the label-driven layout: under migStrategy mixed the device plugin serves it.
    async with node_of(rig, {}, {"migStrategy": "mixed"}, [(1, [("3g.40gb", 0)])]) as (node, old, new):
        kubelet = StandInKubelet(node.kubelet_dir)
        await kubelet.start()
        try:
            old.start()
            await old.serving()
            await wait_until(lambda: MIG_RESOURCE in kubelet.plugins, 30, "the old agent's device plugin")
            served_by_old = kubelet.plugins[MIG_RESOURCE].endpoint

            new.start()
            await new.logged(f"serves the kubelet directory {node.kubelet_dir} (a rolling update): serving DRA now, "
                             "and the device plugin, MIG manager, MPS daemons and the Node once it stops")
            await new.serving()
            # Two registrations of the driver, each naming its own DRA socket.
            assert node.sockets()["plugins_registry"] == sorted(
                [f"{DRIVER}-{old.uid}-reg.sock", f"{DRIVER}-{new.uid}-reg.sock"])
            assert node.sockets()[DRIVER] == sorted([f"dra-{old.uid}.sock", f"dra-{new.uid}.sock"])
            assert await old.info() == ("DRAPlugin", DRIVER, str(old.endpoint))
            assert await new.info() == ("DRAPlugin", DRIVER, str(new.endpoint))

            # A claim prepared by the old agent after the new one started is unprepared by the new one.
            await wait_until(lambda: slices_of(rig, NODE), 30, "the node's ResourceSlice", blocking=True)
            claim, device = await allocated_claim(rig, "train", {"deviceClassName": DEVICE_CLASS})
            assert await old.prepare(claim) == ""
            assert (node.claims(), node.cdi_files()) == (
                {claim.uid: "PrepareCompleted"}, [f"{DRIVER}-claim-{claim.uid}.json"])
            assert await new.unprepare(claim) == ""
            assert (node.claims(), node.cdi_files()) == ({}, [])
            await new.logged(f"unprepared claim {claim.uid}", 10)
            assert device[:4] == "gpu-"

            # The device plugin is still the old agent's alone: the kubelet holds its socket, nothing else registered.
            assert kubelet.plugins[MIG_RESOURCE].endpoint == served_by_old
            assert [name for name in node.sockets()["device-plugins"] if name != "kubelet.sock"] == [served_by_old]
            assert not any("took over the kubelet directory" in line for line in new.lines())

            assert await old.stop() == 0
            await new.logged(f"took over the kubelet directory {node.kubelet_dir}: serving the device plugin, MIG "
                             "manager, MPS daemons and the Node")
            await wait_until(lambda: kubelet.plugins[MIG_RESOURCE].endpoint != served_by_old, 30,
                             "the new agent's device plugin to register")
            served_by_new = kubelet.plugins[MIG_RESOURCE].endpoint
            # No socket of the old agent is left; the new one's serve on.
            assert node.sockets() == {
                "device-plugins": sorted(["kubelet.sock", served_by_new]),
                "plugins_registry": [f"{DRIVER}-{new.uid}-reg.sock"],
                DRIVER: [f"dra-{new.uid}.sock"],
            }
            assert await new.info() == ("DRAPlugin", DRIVER, str(new.endpoint))
            assert await new.stop() == 0
            assert node.sockets() == {"device-plugins": ["kubelet.sock"], "plugins_registry": [], DRIVER: []}
        finally:
            await kubelet.stop()


@contextlib.contextmanager
def nvml_changes_held(node: Node) -> Iterator[None]:
    """Hold the fake NVML's cross-process lock: every GPU change (a MIG device created) waits until it is let go."""
    fd = os.open(node.state.with_name(node.state.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


async def test_a_prepare_on_the_new_agent_waits_while_the_old_one_holds_the_prepare_lock(
        rig: GatedApiServer) -> None:
    async with node_of(rig, {"dynamicMig": True}, {}, [(0, [])]) as (node, old, new):
        old.start()
        await old.logged("the API server keeps shared counters")
        new.start()
        await new.logged("the API server keeps shared counters")
        await new.serving()
        await wait_until(lambda: any(s["metadata"]["name"].endswith("-gpu-0") for s in slices_of(rig, NODE)), 60,
                         "the placements published", blocking=True)
        expression = f"device.attributes['{DRIVER}'].profile == '7g.80gb'"
        mig, mig_device = await allocated_claim(rig, "mig", {"deviceClassName": MIG_CLASS, "selectors": [
            {"cel": {"expression": expression}}]})
        whole, whole_device = await allocated_claim(rig, "whole", {"deviceClassName": DEVICE_CLASS})
        assert (mig_device, whole_device[:4]) == ("gpu-0-mig-7g80gb-0", "gpu-")

        with nvml_changes_held(node):
            # The old agent makes the claim's MIG device under the node's prepare lock; NVML holds it there.
            old_prepare = asyncio.ensure_future(old.prepare(mig))
            await wait_until(lambda: node.claims() == {mig.uid: "PrepareStarted"}, 30,
                             "the old agent to begin the MIG claim's prepare")
            new_prepare = asyncio.ensure_future(new.prepare(whole))
            done, _ = await asyncio.wait({old_prepare, new_prepare}, timeout=2)
            assert done == set()  # the new agent waits for the lock the old one holds
            assert node.claims() == {mig.uid: "PrepareStarted"}
        assert await asyncio.wait_for(old_prepare, 30) == ""
        assert await asyncio.wait_for(new_prepare, 30) == ""
        assert node.claims() == {mig.uid: "PrepareCompleted", whole.uid: "PrepareCompleted"}
        assert node.cdi_files() == sorted([f"{DRIVER}-claim-{mig.uid}.json", f"{DRIVER}-claim-{whole.uid}.json"])
        # Each unprepared by the other agent, the MIG device destroyed by the agent that did not make it.
        assert await new.unprepare(mig) == ""
        assert await old.unprepare(whole) == ""
        assert (node.claims(), node.cdi_files()) == ({}, [])
        await new.logged(f"destroyed the MIG device(s) of claim {mig.uid}: {mig_device}", 10)
        assert await old.stop() == 0
        assert await new.stop() == 0
