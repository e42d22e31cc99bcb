"""The node reconciler against an in-memory Node: owned keys only, foreign taints kept, no steady-state writes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from agent.config import DEFAULT_CONFIG
from agent.kube.reconciler import NodeReconciler, TaintPolicy, node_intent, taints_with
from agent.kube.view import Condition
from agent.labels import node_labels, owned
from agent.nvml.records import DriverInfo, GpuInfo, NodeInventory
from agent.simulate import InMemoryNode
from agent.state import DeviceHealth, Incident, NodeState, StateBus

TAINT = TaintPolicy("gpu-node-agent.io/gpu-fault", "NoSchedule")
FOREIGN_TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}


def gpu(index: int) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index}", "NVIDIA L40S", f"00000000:0{index}:00.0", index, 46068, "ada", (8, 9),
                   0, False, False, False)


async def start(node: InMemoryNode) -> tuple[NodeReconciler, StateBus, asyncio.Task[None]]:
    bus = StateBus(NodeState(1, NodeInventory(DriverInfo("570.1.2", "12.8"), (gpu(0), gpu(1)), ())))
    reconciler = NodeReconciler(
        node, bus, lambda s: node_intent(s, node_labels(s, DEFAULT_CONFIG), TAINT), owned
    )
    task = asyncio.create_task(reconciler.run())
    await asyncio.wait_for(reconciler.converged_at(bus.current.version), 5)
    return reconciler, bus, task


@contextlib.asynccontextmanager
async def reconciling(node: InMemoryNode) -> AsyncIterator[tuple[NodeReconciler, StateBus]]:
    reconciler, bus, task = await start(node)
    try:
        yield reconciler, bus
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def settle(reconciler: NodeReconciler, bus: StateBus, node: InMemoryNode) -> None:
    """Wait until the reconciler has demonstrably dealt with the newest state and the newest Node version: the
    Node shows the intent of the bus's current state version, and the Node watch has handed the reconciler
    every Node version (its own writes included) and been asked for the next one. Only then does "no writes"
    mean the reconciler looked and found nothing to write."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not (reconciler.converged_version >= bus.current.version and node.watched == node.view.resource_version):
        if loop.time() > deadline:
            raise TimeoutError(f"the reconciler did not take in state {bus.current.version} and Node version "
                               f"{node.view.resource_version} (it shows state {reconciler.converged_version}, "
                               f"its watch is at {node.watched})")
        await asyncio.sleep(0.001)


async def test_labels_taint_condition_converge_and_stay_quiet() -> None:
    node = InMemoryNode("n1")
    node.view = node.view.__class__(
        name="n1", resource_version="1", labels={"team": "ml", "gpu-node-agent.io/stale": "x"},
        taints=(FOREIGN_TAINT,),
    )
    async with reconciling(node) as (reconciler, bus):
        await settle(reconciler, bus, node)
        labels = dict(node.view.labels)
        assert labels["team"] == "ml"
        assert "gpu-node-agent.io/stale" not in labels
        assert labels["nvidia.com/gpu.count"] == "2"
        assert node.view.taints == (FOREIGN_TAINT,)
        healthy = Condition("GPUHealthy", "True", "GPUsHealthy", "all 2 GPUs healthy")
        assert node.view.conditions["GPUHealthy"] == healthy
        writes = node.writes
        assert writes == 2  # one label patch, one condition

        await bus.update(draining=frozenset())  # a new state version that changes nothing on the node
        await settle(reconciler, bus, node)
        assert node.writes == writes

        fault = DeviceHealth(False, "XID 79", node_fatal=True)
        await bus.update(health={"GPU-1": fault}, incidents=(Incident(1, "GPU-1", "fault", "XID 79"),))
        await settle(reconciler, bus, node)
        assert node.view.taints == (FOREIGN_TAINT, {"key": TAINT.key, "value": "true", "effect": "NoSchedule"})
        assert node.view.conditions["GPUHealthy"] == Condition("GPUHealthy", "False", "NodeGPUFault", "XID 79")
        assert node.events == [("Warning", "GPUFault", "GPU GPU-1: XID 79")]

        await bus.update(
            health={},
            incidents=(*bus.current.incidents, Incident(2, "GPU-1", "recovered", "recovered from XID 79")),
        )
        await settle(reconciler, bus, node)
        assert node.view.taints == (FOREIGN_TAINT,)
        assert node.view.conditions["GPUHealthy"].status == "True"
        assert node.events[-1] == ("Normal", "GPURecovered", "GPU GPU-1: recovered from XID 79")
        assert len(node.events) == 2


async def test_someone_removing_an_owned_label_gets_it_back() -> None:
    node = InMemoryNode("n1")
    async with reconciling(node) as (reconciler, bus):
        await settle(reconciler, bus, node)
        await node.patch_metadata({"nvidia.com/gpu.count": None, "other": "kept"}, {})
        await settle(reconciler, bus, node)
        assert node.view.labels["nvidia.com/gpu.count"] == "2"
        assert node.view.labels["other"] == "kept"


async def test_a_foreign_change_is_read_and_makes_no_write() -> None:
    node = InMemoryNode("n1")
    async with reconciling(node) as (reconciler, bus):
        await settle(reconciler, bus, node)
        before = node.writes
        view = await node.patch_metadata({"team": "ml"}, {"example.com/owner": "ops"})
        await node.set_taints([*view.taints, FOREIGN_TAINT], view.resource_version)
        await settle(reconciler, bus, node)
        assert reconciler.node == node.view  # it has read the change
        assert node.writes == before + 2  # the two foreign writes, none of its own


def test_taints_with_keeps_foreign_taints_in_order() -> None:
    current = (
        FOREIGN_TAINT,
        {"key": TAINT.key, "value": "true", "effect": "NoExecute"},
        {"key": "b", "effect": "NoSchedule"},
    )
    mine = {"key": TAINT.key, "value": "true", "effect": "NoSchedule"}
    assert taints_with(current, owned, mine) == [FOREIGN_TAINT, {"key": "b", "effect": "NoSchedule"}, mine]
    assert taints_with(current, owned, None) == [FOREIGN_TAINT, {"key": "b", "effect": "NoSchedule"}]


async def test_incidents_past_the_history_bound_are_counted_in_one_event() -> None:
    node = InMemoryNode("n1")
    bus = StateBus(NodeState(1, NodeInventory(DriverInfo("570.1.2", "12.8"), (gpu(0), gpu(1)), ())))
    # A hundred warnings before the reconciler gets to the API server: the history keeps the newest 64.
    for n in range(100):
        await bus.record([("GPU-0", "warning", f"warning {n}")])
    assert [i.seq for i in bus.current.incidents] == list(range(37, 101))
    reconciler = NodeReconciler(node, bus, lambda s: node_intent(s, node_labels(s, DEFAULT_CONFIG), TAINT), owned)
    task = asyncio.create_task(reconciler.run())
    try:
        await asyncio.wait_for(reconciler.converged_at(bus.current.version), 5)
        await settle(reconciler, bus, node)
        assert node.events[0] == ("Warning", "EventsDropped", "36 earlier GPU agent event(s) could not be recorded "
                                  "in time (the history keeps the newest 64, for up to an hour)")
        assert node.events[1:] == [("Warning", "GPUWarning", f"GPU GPU-0: warning {n}") for n in range(36, 100)]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_incidents_older_than_an_hour_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.state

    clock = [1_000_000.0]
    monkeypatch.setattr(agent.state.time, "time", lambda: clock[0])
    bus = StateBus(NodeState(1, NodeInventory(DriverInfo("570.1.2", "12.8"), (gpu(0),), ())))
    await bus.record([("GPU-0", "warning", "old")])
    clock[0] += 3601
    await bus.record([("GPU-0", "warning", "new")])
    assert [(i.seq, i.message) for i in bus.current.incidents] == [(2, "new")]
