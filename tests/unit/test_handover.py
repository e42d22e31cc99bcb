"""The handover of a node that switches between the device plugin and DRA while pods run (agent/handover.py): what
pods hold through the mode the node left stays out of the mode in force until they release it, and while that is
not read yet neither mode offers a whole GPU. The kubelet's PodResources API is a stand-in gRPC server on a unix
socket answering as the kubelet does (devices by resource, replicas as `<uuid>::<n>`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.checks import start_only_changes
from agent.config import parse_config
from agent.dra.slices import mig_device_name, slice_spec
from agent.handover import POLL_S, Handover
from agent.inventory import GPU_RESOURCE, PlanCache, plan
from agent.podresources import CLAIM, DeviceHolder
from agent.state import NodeState, StateBus
from tests.builders import node, pod_resources
from tests.plugin_harness import short_dir, wait_until

DRA = "version: v1\ndra:\n  enabled: true\nmig:\n  podResourcesSocket: {socket}\n"
PLUGIN = "version: v1\nmig:\n  podResourcesSocket: {socket}\n"


@contextlib.asynccontextmanager
async def handing_over(state: NodeState, claims: list[DeviceHolder] | None = None) -> AsyncIterator[StateBus]:
    bus = StateBus(state)
    task = asyncio.create_task(Handover(bus, PlanCache(), lambda: claims).run())
    try:
        yield bus
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def slice_devices(state: NodeState) -> list[str]:
    return [d["name"] for d in slice_spec(state, "n", "gpu.gpu-node-agent.io", 1)["devices"]]


@pytest.fixture
def folder() -> Path:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_a_switch_to_dra_keeps_the_gpus_pods_hold_through_the_device_plugin_out_of_the_slice(
        folder: Path) -> None:
    before = node("dgx-h100", PLUGIN.format(socket=folder / "kubelet.sock"))
    uuids = [g.uuid for g in before.inventory.gpus]
    switched = before.evolve(config=parse_config(DRA.format(socket=folder / "kubelet.sock")), handover=True)
    assert slice_devices(switched) == []  # nothing offered until what pods hold is known
    async with pod_resources(folder / "kubelet.sock") as lister:
        lister.pods = {"trainer": {GPU_RESOURCE: [uuids[2], uuids[5]], "example.com/nic": ["nic-0"]},
                       "notebook": {GPU_RESOURCE: [uuids[7]]}}
        async with handing_over(switched) as bus:
            state = await wait_until(lambda: not bus.current.handover and bus.current, 5, "the handover")
            assert state.held == {uuids[2], uuids[5], uuids[7]}
            assert slice_devices(state) == ["gpu-0", "gpu-1", "gpu-3", "gpu-4", "gpu-6"]
            # The trainer ends: its GPUs are offered through DRA at the next read.
            lister.pods = {"notebook": {GPU_RESOURCE: [uuids[7]]}}
            loop = asyncio.get_running_loop()
            ended = loop.time()
            state = await wait_until(lambda: len(bus.current.held) == 1 and bus.current, 2 * POLL_S + 1,
                                     "GPUs 2 and 5 released")
            assert loop.time() - ended <= POLL_S + 1
            assert slice_devices(state) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6"]
            lister.pods = {}
            state = await wait_until(lambda: not bus.current.held and bus.current, 2 * POLL_S + 1, "GPU 7 released")
            assert slice_devices(state) == [f"gpu-{i}" for i in range(8)]


async def test_time_sliced_replicas_hold_their_gpu_and_resources_the_device_plugin_still_serves_do_not(
        folder: Path) -> None:
    socket = folder / "kubelet.sock"
    config = (DRA.format(socket=socket) + "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
              "      replicas: 2\nflags:\n  migStrategy: mixed\n")
    state = node("dgx-h100", config, mig={0: [("1g.10gb", 0)]}).evolve(handover=True)
    uuids = [g.uuid for g in state.inventory.gpus]
    [mig] = state.inventory.mig_devices
    async with pod_resources(folder / "kubelet.sock") as lister:
        # A replica of GPU 3 through nvidia.com/gpu (DRA's now); a MIG device through its own resource, which the
        # device plugin still serves in DRA mode: that one is the device plugin's business, not held.
        lister.pods = {"a": {GPU_RESOURCE: [f"{uuids[3]}::1"]}, "b": {"nvidia.com/mig-1g.10gb": [mig.uuid]}}
        async with handing_over(state) as bus:
            done = await wait_until(lambda: not bus.current.handover and bus.current, 5, "the handover")
    assert done.held == {uuids[3]}
    replicas = [f"gpu-{i}-replica-{n}" for i in (1, 2, 4, 5, 6, 7) for n in (0, 1)]
    assert slice_devices(done) == [*replicas, mig_device_name(mig)]


async def test_a_kubelet_that_does_not_answer_keeps_every_whole_gpu_unoffered_and_says_so_once(
        folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    socket = folder / "kubelet.sock"
    state = node("dgx-h100", DRA.format(socket=socket)).evolve(handover=True)
    caplog.set_level(logging.WARNING, "agent.handover")
    async with pod_resources(folder / "kubelet.sock") as lister, handing_over(state) as bus:
        lister.failing = True
        lister.pods = {"trainer": {GPU_RESOURCE: [state.inventory.gpus[0].uuid]}}
        await wait_until(lambda: lister.lists >= 3, 10, "three reads")  # retried, backing off: 0.5 s, then 1 s
        assert bus.current.handover
        assert slice_devices(bus.current) == []
        lister.failing = False
        done = await wait_until(lambda: not bus.current.handover and bus.current, 10, "the handover")
    assert done.held == {state.inventory.gpus[0].uuid}
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot read which GPUs pods hold through the device plugin (kubelet PodResources at {socket}: pod manager "
        "not synced): no whole GPU is offered until it answers; retrying"]


async def test_without_a_kubelet_nothing_is_held() -> None:
    state = node("dgx-h100", DRA.format(socket="/nonexistent/kubelet.sock")).evolve(handover=True)
    async with handing_over(state) as bus:
        done = await wait_until(lambda: not bus.current.handover and bus.current, 5, "the handover")
    assert done.held == frozenset()
    assert len(slice_devices(done)) == 8


async def test_a_switch_back_keeps_the_gpus_of_prepared_claims_out_of_the_device_plugin() -> None:
    state = node("dgx-h100")
    uuids = [g.uuid for g in state.inventory.gpus]
    claims = [DeviceHolder("ml", "claim-a", "", CLAIM, uuids[1]), DeviceHolder("ml", "claim-a", "", CLAIM, uuids[6])]
    async with handing_over(state.evolve(handover=True), claims) as bus:
        done = await wait_until(lambda: not bus.current.handover and bus.current, 5, "the handover")
        assert done.held == {uuids[1], uuids[6]}
        assert [d.id for d in plan(done).resources[GPU_RESOURCE].devices] == [
            u for i, u in enumerate(uuids) if i not in (1, 6)]
        claims.pop()  # the claim's pod ended and the kubelet unprepared it
        claims.pop()
        released = await wait_until(lambda: not bus.current.held and bus.current, 2 * POLL_S + 1, "released")
    assert [d.id for d in plan(released).resources[GPU_RESOURCE].devices] == uuids


def test_only_dra_enabled_changes_once_the_dra_driver_is_made() -> None:
    plain = parse_config("version: v1\n")
    dra = parse_config("version: v1\ndra:\n  enabled: true\n  dynamicMig: true\n")
    assert start_only_changes(None, dra) is None  # not made yet: made at the switch, with these settings
    assert start_only_changes(dra.dra, plain) is None  # back to the device plugin
    assert start_only_changes(dra.dra, dra) is None
    renamed = parse_config("version: v1\ndra:\n  enabled: true\n  driverName: gpu.example.com\n")
    assert start_only_changes(dra.dra, renamed) == (
        "dra.driverName, dra.dynamicMig cannot change while the agent runs (its DRA driver was made with the value "
        "in force); restart the agent to apply it")
