"""The MIG label protocol end to end on the fake NVML: label -> pending -> success/failed, devices withdrawn and
re-advertised live, pods holding devices respected."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml

from agent.agent import Agent
from agent.config import parse_config
from agent.mig import controller
from agent.nvml.fake import FakeNvml
from agent.podresources_v1 import api_pb2 as pr
from agent.podresources_v1 import api_pb2_grpc as pr_grpc
from agent.simulate import InMemoryNode, StandInKubelet
from tests.plugin_harness import running_agent, short_dir, wait_until

STATE = "nvidia.com/mig.config.state"
REASON = "nvidia.com/mig.config.state.reason"


class RecordingNode(InMemoryNode):
    """An in-memory Node that remembers every value its MIG state label took."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.states: list[str] = []

    def _next(self, **changes: object) -> object:
        view = super()._next(**changes)
        state = self.view.labels.get(STATE)
        if state and (not self.states or self.states[-1] != state):
            self.states.append(state)
        return view


class PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, holding: dict[str, list[str]]) -> None:
        self.holding = holding

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(name=pod, namespace="ml", containers=[pr.ContainerResources(
                name="train", devices=[pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids)])])
            for pod, ids in self.holding.items()
        ])


@contextlib.asynccontextmanager
async def pod_resources(directory: Path, holding: dict[str, list[str]]) -> AsyncIterator[None]:
    """A PodResources server on the node's socket where the given pods hold the given devices (the dict can
    change while it serves)."""
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(PodResources(holding), server)
    server.add_insecure_port(f"unix://{directory}/pr.sock")
    await server.start()
    try:
        yield
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def mig_node(**mig: object) -> AsyncIterator[tuple[Agent, RecordingNode, FakeNvml, StandInKubelet, Path]]:
    directory = short_dir()
    settings = {"stateDir": f"{directory}/state", "podResourcesSocket": f"{directory}/pr.sock", **mig}
    config = parse_config(yaml.safe_dump({"version": "v1", "flags": {"migStrategy": "mixed"}, "mig": settings}))
    node = RecordingNode("gpu-node-1")
    try:
        async with running_agent("dgx-h100", config, kube=node, directory=directory) as rig:
            yield rig.agent, node, rig.fake, rig.kubelet, directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def counts(kubelet: StandInKubelet) -> dict[str, int]:
    return {r: len(v.devices) for r, v in kubelet.plugins.items() if v.devices}


async def test_label_applies_the_layout_and_readvertises_live() -> None:
    async with mig_node() as (_, node, _, kubelet, directory):
        await node.patch_metadata({"nvidia.com/mig.config": "all-1g.10gb"}, {})
        await wait_until(lambda: node.view.labels.get(STATE) == "success", timeout=30, what="success")
        assert node.states == ["pending", "success"]
        assert node.view.annotations[REASON] == "layout 'all-1g.10gb' applied: 64 change(s)"
        await wait_until(lambda: counts(kubelet) == {"nvidia.com/mig-1g.10gb": 56}, what="56 MIG devices")
        assert node.view.labels["nvidia.com/mig-1g.10gb.count"] == "56"
        assert ("Normal", "MigConfigApplied",
                "MIG layout all-1g.10gb: success: layout 'all-1g.10gb' applied: 64 change(s)") in node.events
        assert not (directory / "state" / "mig-journal.json").exists()

        await node.patch_metadata({"nvidia.com/mig.config": "all-disabled"}, {})
        await wait_until(lambda: counts(kubelet) == {"nvidia.com/gpu": 8}, timeout=30, what="whole GPUs again")
        assert node.states == ["pending", "success", "pending", "success"]


async def test_unknown_layout_fails_naming_the_layout_and_the_file() -> None:
    async with mig_node() as (_, node, _, kubelet, _):
        await node.patch_metadata({"nvidia.com/mig.config": "all-9g.99gb"}, {})
        await wait_until(lambda: node.view.labels.get(STATE) == "failed", timeout=30, what="failed")
        assert node.view.annotations[REASON].startswith(
            "built-in default-layouts.yaml: no layout named 'all-9g.99gb' (known: all-disabled, all-enabled,"
        )
        assert counts(kubelet) == {"nvidia.com/gpu": 8}
        assert node.events[-1][:2] == ("Warning", "MigConfigFailed")


async def test_impossible_layout_is_refused_before_anything_changes(tmp_path: Path) -> None:
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text("version: v1\nmig-configs:\n  too-big:\n    - devices: all\n      mig-enabled: true\n"
                       "      mig-devices: {4g.40gb: 1, 2g.20gb: 2}\n")
    async with mig_node(layoutsFile=str(layouts)) as (agent, node, _, kubelet, _):
        await node.patch_metadata({"nvidia.com/mig.config": "too-big"}, {})
        await wait_until(lambda: node.view.labels.get(STATE) == "failed", timeout=30, what="failed")
        assert node.view.annotations[REASON].startswith(
            "GPU 0: 4g.40gb + 2 x 2g.20gb do not fit together: 4g.40gb must use slices 0-3;"
        )
        inventory = agent.bus.current.inventory
        assert not any(g.mig_enabled for g in inventory.gpus)
        assert counts(kubelet) == {"nvidia.com/gpu": 8}


async def test_pods_holding_the_gpus_fail_the_apply_naming_them() -> None:
    async with mig_node() as (agent, node, _, kubelet, directory):
        gpus = agent.bus.current.inventory.gpus
        # trainer-0 holds GPUs 2 and 5 in one container; eval-0 holds GPU 5 too (a second container would be
        # another pod entry with the same GPU): the reason names the two held GPUs and each pod once.
        holding = {"trainer-0": [gpus[5].uuid, gpus[2].uuid], "eval-0": [gpus[5].uuid]}
        lists = kubelet.plugins["nvidia.com/gpu"].updates
        async with pod_resources(directory, holding):
            await node.patch_metadata({"nvidia.com/mig.config": "all-1g.10gb"}, {})
            await wait_until(lambda: node.view.labels.get(STATE) == "failed", timeout=30, what="failed")
            # The reason, then when it is tried again while the label stays.
            reason = "GPUs 2, 5 are in use by ml/trainer-0, ml/eval-0"
            await wait_until(lambda: node.view.annotations.get(REASON) == f"{reason}; next try in 30s (retry 1 "
                             "of 5)", what="the retry announced")
            assert ("Warning", "MigConfigFailed", f"MIG layout all-1g.10gb: failed: {reason}") in node.events
            # busyPolicy fail looks for the pods before it withdraws anything: the kubelet was sent no new list,
            # and the GPUs the pods hold never left it.
            assert (kubelet.plugins["nvidia.com/gpu"].updates, counts(kubelet)) == (lists, {"nvidia.com/gpu": 8})
            assert not any(g.mig_enabled for g in agent.bus.current.inventory.gpus)


async def test_devices_are_withdrawn_before_the_layout_changes() -> None:
    async with mig_node() as (agent, node, _, kubelet, _directory):
        seen: list[tuple[str | None, dict[str, int]]] = []

        def status() -> str | None:
            current = agent.bus.current.mig_status
            return current.state if current else None

        async def watch() -> None:
            while True:
                async with kubelet.changed:
                    await kubelet.changed.wait()
                    seen.append((status(), counts(kubelet)))

        watcher = asyncio.create_task(watch())
        await node.patch_metadata({"nvidia.com/mig.config": "all-1g.10gb"}, {})
        await wait_until(lambda: counts(kubelet) == {"nvidia.com/mig-1g.10gb": 56}, timeout=30, what="MIG devices")
        watcher.cancel()
        # The kubelet saw the whole GPUs go (an empty list) while the layout was pending, before any MIG device,
        # and MIG devices only once the layout was applied. (The watcher may not have woken for the last change
        # yet when the poll above saw it: the end is read as it is now.)
        assert seen[0] == ("pending", {})
        assert (status(), counts(kubelet)) == ("success", {"nvidia.com/mig-1g.10gb": 56})
        assert all(state == "success" for state, devices in seen if devices), seen
        assert kubelet.plugins["nvidia.com/gpu"].devices == []


async def test_a_layout_that_selects_no_gpu_succeeds_and_says_so(tmp_path: Path) -> None:
    # An entry for A100-40GB only (its PCI id, as NVIDIA's mig-parted examples filter): a DGX H100 has none.
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text('version: v1\nmig-configs:\n  a100-only:\n    - device-filter: ["0x20B010DE"]\n'
                       '      devices: all\n      mig-enabled: true\n      mig-devices: {"1g.5gb": 7}\n')
    async with mig_node(layoutsFile=str(layouts)) as (_, node, _, kubelet, _):
        await node.patch_metadata({"nvidia.com/mig.config": "a100-only"}, {})
        await wait_until(lambda: node.view.labels.get(STATE) == "success", timeout=30, what="success")
        reason = ("layout 'a100-only' selects no GPU on this node: none of its device filters and device lists "
                  "matches the node's 8 GPUs; nothing changed")
        assert node.view.annotations[REASON] == reason
        assert ("Normal", "MigConfigApplied", f"MIG layout a100-only: success: {reason}") in node.events
        assert counts(kubelet) == {"nvidia.com/gpu": 8}


async def test_a_failed_layout_is_tried_again_while_the_label_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller, "RETRY_DELAYS_S", (0.5, 0.5))
    async with mig_node() as (agent, node, _, kubelet, directory):
        gpus = agent.bus.current.inventory.gpus
        holding = {"trainer-0": [gpus[3].uuid]}
        async with pod_resources(directory, holding):
            await node.patch_metadata({"nvidia.com/mig.config": "all-1g.10gb"}, {})
            await wait_until(lambda: node.view.labels.get(STATE) == "failed", timeout=30, what="failed")
            holding.clear()  # the training pod ends: the next try goes through
            await wait_until(lambda: node.view.labels.get(STATE) == "success", timeout=30, what="success")
            assert node.states == ["pending", "failed", "pending", "success"]
            assert agent.metrics.mig_retries.labels(outcome="failed")._value.get() == 1
            await wait_until(lambda: counts(kubelet) == {"nvidia.com/mig-1g.10gb": 56}, what="56 MIG devices")

            # Held for good: two retries, then it says it stops trying.
            await node.patch_metadata({"nvidia.com/mig.config": "all-disabled"}, {})
            await wait_until(lambda: node.view.labels.get(STATE) == "success" and counts(kubelet) == {
                "nvidia.com/gpu": 8}, timeout=30, what="whole GPUs again")
            holding["trainer-0"] = [gpus[3].uuid]
            await node.patch_metadata({"nvidia.com/mig.config": "all-1g.10gb"}, {})
            reason = "GPU 3 is in use by ml/trainer-0"
            await wait_until(lambda: node.view.annotations.get(REASON) == f"{reason}; {controller.NO_MORE_TRIES}",
                             timeout=30, what="no more tries")
            assert [e for e in node.events if e[1] == "MigConfigFailed"][-3:] == [
                ("Warning", "MigConfigFailed", f"MIG layout all-1g.10gb: failed: {reason}")] * 3
