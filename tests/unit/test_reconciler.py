"""The node reconciler against an in-memory Node: owned keys only, foreign taints kept, no steady-state writes."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Mapping

import pytest

from agent.config import DEFAULT_CONFIG
from agent.kube.reconciler import NodeReconciler, TaintPolicy, node_intent, taints_with
from agent.kube.view import Condition, NodeView
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
    Node shows the intent of the bus's current state version, the Node watch has handed the reconciler every
    Node version (its own writes included) and been asked for the next one, and the reconciler has converged
    with every view it was handed. Only then does "no writes" mean the reconciler looked and found nothing to
    write."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not (reconciler.converged_version >= bus.current.version and node.watched == node.view.resource_version
               and not reconciler.busy):
        if loop.time() > deadline:
            raise TimeoutError(f"the reconciler did not take in state {bus.current.version} and Node version "
                               f"{node.view.resource_version} (it shows state {reconciler.converged_version}, "
                               f"its watch is at {node.watched})")
        await asyncio.sleep(0.001)


async def test_labels_taint_condition_converge_and_stay_quiet() -> None:
    node = InMemoryNode("n1")
    node.view = node.view.__class__(
        name="n1", resource_version="1",
        labels={"team": "ml", "gpu-node-agent.io/team": "infra", "nvidia.com/mig.strategy": "mixed"},
        taints=(FOREIGN_TAINT,),
    )
    async with reconciling(node) as (reconciler, bus):
        await settle(reconciler, bus, node)
        labels = dict(node.view.labels)
        assert labels["team"] == "ml"
        # A stale label of the agent's goes (migStrategy none writes none); one it does not write stays, even
        # under its prefix.
        assert "nvidia.com/mig.strategy" not in labels
        assert labels["gpu-node-agent.io/team"] == "infra"
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
    owns = node_intent(machine_state("DGX"), {}, TAINT).owns_taint
    assert taints_with(current, owns, mine) == [FOREIGN_TAINT, {"key": "b", "effect": "NoSchedule"}, mine]
    assert taints_with(current, owns, None) == [FOREIGN_TAINT, {"key": "b", "effect": "NoSchedule"}]


def test_a_configured_taint_key_outside_the_agents_prefix_is_its_own() -> None:
    intent = node_intent(machine_state("DGX"), {}, TaintPolicy("example.com/gpu-broken", "NoExecute"))
    assert intent.owns_taint("example.com/gpu-broken")
    assert intent.owns_taint("gpu-node-agent.io/gpu-fault")  # the default key, set before a config change
    assert not intent.owns_taint("example.com/other")


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


class ValidatingNode(InMemoryNode):
    """An in-memory Node that refuses an invalid label value in a patch, as the API server does (422)."""

    async def patch_metadata(self, labels: Mapping[str, str | None],
                             annotations: Mapping[str, str | None]) -> NodeView:
        for value in labels.values():
            if value is not None and not re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", value):
                raise Invalid(f"metadata.labels: Invalid value: {value!r}")
        return await super().patch_metadata(labels, annotations)


class Invalid(Exception):
    status = 422
    reason = "Invalid"


def machine_state(machine: str) -> NodeState:
    return NodeState(1, NodeInventory(DriverInfo("570.1.2", "12.8"), (gpu(0), gpu(1)), ()), machine=machine)


@pytest.mark.parametrize(("machine", "label"), [
    ("_Custom Build", "Custom-Build"), ("-.DGX H100._", "DGX-H100"), ("..__--", "unknown"),
    ("Custom Build", "Custom-Build"),
])
def test_a_machine_type_becomes_a_valid_label_value(machine: str, label: str) -> None:
    state = machine_state(machine)
    intent = node_intent(state, node_labels(state, DEFAULT_CONFIG), TAINT)
    assert intent.labels["nvidia.com/gpu.machine"] == label
    assert intent.dropped == ()


def test_a_label_that_cannot_be_valid_is_left_out_and_named() -> None:
    state = machine_state("DGX")
    labels = {**node_labels(state, DEFAULT_CONFIG), "nvidia.com/gpu.product": "x" * 70,
              "nvidia.com/cuda.driver.rev": "_1"}
    intent = node_intent(state, labels, TAINT)
    assert "nvidia.com/gpu.product" not in intent.labels and "nvidia.com/cuda.driver.rev" not in intent.labels
    assert intent.labels["nvidia.com/gpu.count"] == "2"
    rule = ("is not a valid label value (at most 63 characters of A-Z, a-z, 0-9, '-', '_' and '.', beginning and "
            "ending with a letter or digit); not written")
    assert intent.dropped == (
        f"label nvidia.com/cuda.driver.rev: the value '_1' {rule}",
        f"label nvidia.com/gpu.product: the value '{'x' * 70}' {rule}",
    )


async def test_a_refused_label_blocks_neither_the_taint_nor_the_condition_nor_other_labels() -> None:
    node = ValidatingNode("n1")
    bus = StateBus(machine_state("DGX"))
    bad = {"nvidia.com/cuda.driver.rev": "_1"}
    reconciler = NodeReconciler(
        node, bus, lambda s: node_intent(s, {**node_labels(s, DEFAULT_CONFIG), **bad}, TAINT), owned)
    task = asyncio.create_task(reconciler.run())
    try:
        await asyncio.wait_for(reconciler.converged_at(1), 5)
        fault = DeviceHealth(False, "XID 79", node_fatal=True)
        await bus.update(health={"GPU-1": fault}, incidents=(Incident(1, "GPU-1", "fault", "XID 79"),))
        await settle(reconciler, bus, node)
        assert node.view.taints == ({"key": TAINT.key, "value": "true", "effect": "NoSchedule"},)
        assert node.view.conditions["GPUHealthy"] == Condition("GPUHealthy", "False", "NodeGPUFault", "XID 79")
        assert node.view.labels["nvidia.com/gpu.count"] == "2"
        assert "nvidia.com/cuda.driver.rev" not in node.view.labels
        line = ("label nvidia.com/cuda.driver.rev: the value '_1' is not a valid label value (at most 63 characters "
                "of A-Z, a-z, 0-9, '-', '_' and '.', beginning and ending with a letter or digit); not written")
        assert node.events == [("Warning", "LabelDropped", line), ("Warning", "GPUFault", "GPU GPU-1: XID 79")]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_failing_label_patch_still_lets_the_taint_through() -> None:
    """Whatever else makes the API server refuse the label patch, the health writes are made first."""
    node = ValidatingNode("n1")
    bus = StateBus(machine_state("DGX"))
    reconciler = NodeReconciler(node, bus, lambda s: node_intent(s, node_labels(s, DEFAULT_CONFIG), TAINT), owned)
    original = node.patch_metadata

    async def refuse(labels: Mapping[str, str | None], annotations: Mapping[str, str | None]) -> NodeView:
        raise Invalid("refused")

    node.patch_metadata = refuse  # type: ignore[method-assign]
    fault = DeviceHealth(False, "XID 79", node_fatal=True)
    await bus.update(health={"GPU-1": fault}, incidents=(Incident(1, "GPU-1", "fault", "XID 79"),))
    task = asyncio.create_task(reconciler.run())
    try:
        for _ in range(500):
            if node.view.taints:
                break
            await asyncio.sleep(0.01)
        assert node.view.taints == ({"key": TAINT.key, "value": "true", "effect": "NoSchedule"},)
        assert node.view.conditions["GPUHealthy"] == Condition("GPUHealthy", "False", "NodeGPUFault", "XID 79")
        assert "nvidia.com/gpu.count" not in node.view.labels
        node.patch_metadata = original  # type: ignore[method-assign]
        await asyncio.wait_for(reconciler.converged_at(bus.current.version), 5)
        assert node.view.labels["nvidia.com/gpu.count"] == "2"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
