"""DRA on a multi-node NVLink fabric against real components: the agent on a simulated GB200 NVL72 compute tray
publishes each GPU's clique and its IMEX channel on the rig's kube-apiserver, the real kube-scheduler allocates
the shipped four-GPUs-one-clique template (GPUs of the clique and the channel) from it, and the agent prepares
the claim with the channel's device node and NVIDIA_IMEX_CHANNELS in its CDI spec. Then a simulated rack: trays of
one clique and a tray of another, each its own `gpu-agent run` process, and pods asking for GPUs of one clique
land only on trays of that clique, by DRA claim or by a node affinity on nvidia.com/gpu.clique."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from apiserver import ApiServer, _spawn, _stop_group, wait_until
from dra_rig import (
    NAMESPACE,
    ControlPlane,
    allocated,
    claim_of_pod,
    control_plane,
    create_pod,
    create_schedulable_node,
    create_template,
    delete_node,
    dra_agent,
    example,
    remove_workloads,
    setup_cluster,
    slices_of,
    unschedulable,
)
from kubernetes import client as k8s

from agent.dra import plugin as dra_plugin
from agent.dra.v1 import api_pb2 as v1
from agent.nvml.nodefile import preset_text as load_preset_text
from tests.builders import AGENT
from tests.plugin_harness import short_dir

CLIQUE = "5d3c1e2a-8b4f-4c6d-9e7a-1f2b3c4d5e6f.1"
"""The clique of the gb200-nvl72-tray preset: its rack's cluster, clique 1."""
OTHER_CLUSTER = "5d3c1e2a-8b4f-4c6d-9e7a-1f2b3c4d5e6f"
"""The rack's other clique is in the same cluster (another NVLink partition of one rack)."""
IMEX = "imex: {channelIDs: [0]}\n"
TEMPLATE = "four-gpus-one-clique-imex.yaml"


@pytest.fixture(scope="module")
def scheduler(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    setup_cluster(apiserver)
    with control_plane(apiserver, tmp_path_factory.mktemp("control-plane")) as plane:
        yield plane


def devices(apiserver: ApiServer, node: str) -> dict[str, dict[str, Any]]:
    (found,) = slices_of(apiserver, node)
    return {d["name"]: d for d in found["spec"].get("devices") or []}


async def test_the_tray_publishes_its_clique_and_channel_and_a_clique_claim_is_prepared_with_the_channel(
        apiserver: ApiServer, scheduler: ControlPlane, dra_kubeconfig: Path) -> None:
    root = short_dir()
    try:
        async with dra_agent(apiserver, dra_kubeconfig, "gb200-tray-1", "gb200-nvl72-tray", root=root,
                             config=IMEX) as (agent, _):
            found = devices(apiserver, "gb200-tray-1")
            assert list(found) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "channel-0"]
            assert {n: d["attributes"]["clique"] for n, d in found.items()} == {n: {"string": CLIQUE} for n in found}
            assert found["channel-0"]["attributes"] == {
                "type": {"string": "channel"}, "id": {"int": 0}, "clique": {"string": CLIQUE}}

            await asyncio.to_thread(create_template, apiserver, "clique", example(TEMPLATE))
            await asyncio.to_thread(create_pod, apiserver, "trainer", template="clique")
            node, results = await asyncio.to_thread(allocated, apiserver, "trainer")
            assert node == "gb200-tray-1"
            assert results == [("gpus", "gb200-tray-1", f"gpu-{i}") for i in range(4)] + [
                ("imex", "gb200-tray-1", "channel-0")]

            claim = await asyncio.to_thread(claim_of_pod, apiserver, "trainer")
            assert claim is not None
            meta = claim["metadata"]
            assert agent.dra is not None
            request = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=NAMESPACE, uid=meta["uid"],
                                                                      name=meta["name"])])
            answer = (await dra_plugin._DraV1(agent.dra.plugin).NodePrepareResources(request, None)
                      ).claims[meta["uid"]]
            assert answer.error == ""
            assert sorted(d.device_name for d in answer.devices) == [
                "channel-0", "gpu-0", "gpu-1", "gpu-2", "gpu-3"]
            (spec_file,) = (root / "cdi").glob(f"*{meta['uid']}*")
            spec = {d["name"]: d["containerEdits"] for d in json.loads(spec_file.read_text())["devices"]}
            assert spec[f"claim-{meta['uid']}-channel-0"] == {
                "deviceNodes": [{"path": "/dev/nvidia-caps-imex-channels/channel0"}],
                "env": ["NVIDIA_IMEX_CHANNELS=0"]}
            uuids = ",".join(g.uuid for g in agent.bus.current.inventory.gpus)
            assert spec[f"claim-{meta['uid']}"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={uuids}"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def rack(apiserver: ApiServer, kubeconfig: Path, trays: dict[str, str]) -> Iterator[dict[str, Path]]:
    """One `gpu-agent run` process in DRA mode per tray (a Node made for it, its node file's text), each in a
    short directory of its own; every process stopped, every Node deleted and the test's workloads removed on
    the way out. Yields each tray's directory (its agent's log is agent.log there)."""
    procs: list[subprocess.Popen[bytes]] = []
    directories: dict[str, Path] = {}
    try:
        for name, node_file in trays.items():
            create_schedulable_node(apiserver, name)
            directory = directories[name] = short_dir()
            (directory / "device-plugins").mkdir(parents=True)
            (directory / "node.yaml").write_text(node_file)
            (directory / "config.yaml").write_text(
                f"version: v1\n{IMEX}mig: {{stateDir: {directory}/state, podResourcesSocket: {directory}/pr.sock}}\n"
                f"dra: {{enabled: true, cdiRoot: {directory}/cdi}}\n")
            procs.append(_spawn([*AGENT, "run", "--nvml", f"mock:{directory}/node.yaml",
                                 "--config", str(directory / "config.yaml"),
                                 "--kubelet-dir", str(directory / "device-plugins"),
                                 "--node-name", name, "--kubeconfig", str(kubeconfig), "--metrics-port", "0"],
                                directory / "agent.log"))
        yield directories
    finally:
        for proc in procs:
            _stop_group(proc)
        remove_workloads(apiserver)
        for name, directory in directories.items():
            delete_node(apiserver, name)
            shutil.rmtree(directory, ignore_errors=True)


def tray(name: str, clique: int) -> str:
    """A GB200 tray's node file: the gb200-nvl72-tray preset's (its rack's cluster, channel 0) named `name`, its
    GPUs in clique `clique`."""
    text = load_preset_text("gb200-nvl72-tray").replace("clique_id: 1}", f"clique_id: {clique}}}")
    return f"name: {name}\n{text}"


def test_a_rack_of_agent_processes_places_each_clique_claim_on_a_tray_of_that_clique(
        apiserver: ApiServer, scheduler: ControlPlane, dra_kubeconfig: Path) -> None:
    other = f"{OTHER_CLUSTER}.2"
    trays = {"rack-tray-1": tray("rack-tray-1", 1), "rack-tray-2": tray("rack-tray-2", 1),
             "rack-tray-3": tray("rack-tray-3", 2)}
    core = k8s.CoreV1Api(apiserver.admin_client())
    with rack(apiserver, dra_kubeconfig, trays) as directories:
        def published() -> dict[str, set[str]]:
            found = {}
            for name in trays:
                listed = slices_of(apiserver, name)
                if listed:
                    found[name] = {d["attributes"]["clique"]["string"] for d in listed[0]["spec"].get("devices") or []}
            return found

        def labelled() -> dict[str, str | None]:
            return {name: (core.read_node(name).metadata.labels or {}).get("nvidia.com/gpu.clique") for name in trays}

        def logs() -> str:
            return "\n".join(f"{n}: {(d / 'agent.log').read_text(errors='replace')[-3000:]}"
                             for n, d in directories.items() if (d / "agent.log").exists())

        try:
            wait_until(lambda: len(published()) == 3 and None not in labelled().values(), 90,
                       "every tray's slice and clique label")
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{logs()}") from None
        assert published() == {"rack-tray-1": {CLIQUE}, "rack-tray-2": {CLIQUE}, "rack-tray-3": {other}}
        assert labelled() == {"rack-tray-1": CLIQUE, "rack-tray-2": CLIQUE, "rack-tray-3": other}

        create_template(apiserver, "clique", example(TEMPLATE))
        ranks = ("rank-0", "rank-1", "rank-2")
        for pod in ranks:
            create_pod(apiserver, pod, template="clique")

        def bound() -> dict[str, str]:
            return {pod: node for pod in ranks if (node := core.read_namespaced_pod(pod, NAMESPACE).spec.node_name)}

        wait_until(lambda: len(bound()) == 2, 60, "two ranks bound")
        placed = bound()
        assert sorted(placed.values()) == ["rack-tray-1", "rack-tray-2"]
        for pod, node in placed.items():
            assert allocated(apiserver, pod) == (node, [("gpus", node, f"gpu-{i}") for i in range(4)]
                                                 + [("imex", node, "channel-0")])
        # The tray of the other clique has four free GPUs and a channel, but not of this clique.
        (left,) = set(ranks) - set(placed)
        assert "cannot allocate all claims" in unschedulable(apiserver, left)

        # Without DRA: a node affinity on GPU feature discovery's label picks the tray of that clique.
        core.create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": "by-label"},
            "spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "nvidia.com/gpu.clique", "operator": "In",
                                                             "values": [other]}]}]}}},
                     "containers": [{"name": "main", "image": "registry.invalid/cuda:test"}]}})
        wait_until(lambda: core.read_namespaced_pod("by-label", NAMESPACE).spec.node_name, 60, "the pod bound")
        assert core.read_namespaced_pod("by-label", NAMESPACE).spec.node_name == "rack-tray-3"
