"""Applies a MIG layout through NVML: plan from what the hardware reports, change only what differs, verify.

Crash safety comes from two facts. Every apply plans from the hardware as it is now, so running it again after
an interruption finishes the job (a GPU instance left without its compute instance is completed, one left
half-created is kept or destroyed like any other). And a journal file records the layout while an apply is in
progress, so an agent that starts after a crash knows which layout to finish even without a cluster.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.mig.layout import MigLayout
from agent.mig.planner import GpuMigState, GpuPlan, MigInstance, ModeChange, NodePlan, PlanError, plan_node
from agent.nvml.mig_ops import MigCallError, MigGpuState, MigOps, MigResetRequired
from agent.yamlfile import write_atomically

JOURNAL = "mig-journal.json"

Outcome = Literal["success", "failed", "rebooting"]
Step = Callable[[str], None]
"""Called with a description before each change to the hardware (progress logs)."""


@dataclass(frozen=True)
class ApplyResult:
    layout: str
    outcome: Outcome
    reason: str
    plan: NodePlan | None = None


class Journal:
    """The layout being applied, kept in a file until the apply ends either way."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / JOURNAL

    def begin(self, layout: str, origin: str) -> None:
        record = {"layout": layout, "layouts_file": origin, "started": time.time()}
        write_atomically(self.path, json.dumps(record))

    def pending(self) -> str | None:
        """The layout an interrupted apply was applying, if any."""
        try:
            value = json.loads(self.path.read_text()).get("layout")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def end(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read_node(ops: MigOps, gpus: int) -> list[MigGpuState]:
    """Every GPU's MIG state, by NVML index; MigCallError naming the GPU that NVML cannot read (a lost one)."""
    states = []
    for index in range(gpus):
        try:
            states.append(ops.state(index))
        except MigCallError as err:
            raise MigCallError(f"GPU {index}: reading its MIG state: {err}") from err
    return states


def planning_view(states: list[MigGpuState]) -> list[GpuMigState]:
    return [
        GpuMigState(s.index, s.name, s.pci_device_id, s.profiles, s.mig_enabled,
                    tuple(MigInstance(i.profile, i.start, i.size) for i in s.instances), s.mig_capable)
        for s in states
    ]


def plan_layout(ops: MigOps, gpus: int, layout: MigLayout) -> NodePlan:
    """The plan for the node as it is now; PlanError when any selected GPU cannot take the layout."""
    return plan_node(layout, planning_view(read_node(ops, gpus)))


def _repairs(ops: MigOps, gpus: int, plan: NodePlan) -> tuple[set[int], set[int]]:
    """The selected GPUs an interrupted apply left half done: GPU instances without a compute instance, and a
    MIG mode change still pending."""
    states = read_node(ops, gpus)
    selected = {p.index for p in plan.gpus}
    orphans = {s.index for s in states if s.index in selected and any(i.compute_instances == 0 for i in s.instances)}
    pending = {s.index for s in states if s.index in selected and s.mig_pending}
    return orphans, pending


class _DryRun:
    """MigOps that reads the hardware and changes nothing: apply's steps, written out, for `mig plan`."""

    def __init__(self, ops: MigOps) -> None:
        self._ops = ops

    def state(self, index: int) -> MigGpuState:
        return self._ops.state(index)

    def destroy(self, index: int, start: int) -> None: ...

    def set_mode(self, index: int, enabled: bool) -> None: ...

    def create(self, index: int, profile: str, start: int) -> None: ...

    def ensure_compute_instances(self, index: int) -> None: ...


def planned_steps(ops: MigOps, gpus: int, plan: NodePlan) -> list[str]:
    """Every step apply would take, in its order: the repairs an interrupted apply left (which the plan's
    actions alone do not show), then each GPU's changes."""
    orphans, pending = _repairs(ops, gpus, plan)
    steps: list[str] = []
    for gpu_plan in plan.gpus:
        if not gpu_plan.noop or gpu_plan.index in orphans | pending:
            _apply_gpu(_DryRun(ops), gpu_plan, gpu_plan.index in pending, gpu_plan.index in orphans, steps.append)
    return steps


def _apply_gpu(ops: MigOps | _DryRun, plan: GpuPlan, pending: bool, orphaned: bool, step: Step) -> None:
    if orphaned:
        step(f"GPU {plan.index}: complete GPU instances left without a compute instance")
    for instance in plan.destroy:
        step(f"GPU {plan.index}: destroy {instance}")
        ops.destroy(plan.index, instance.start)
    if plan.mode is not ModeChange.NONE:
        step(f"GPU {plan.index}: {plan.mode.value} MIG")
        ops.set_mode(plan.index, plan.mode is ModeChange.ENABLE)
    elif pending:
        # The mode is right now, but a change to the other mode waits for the next reset: cancel it.
        current = ops.state(plan.index).mig_enabled
        step(f"GPU {plan.index}: cancel the pending MIG {'disable' if current else 'enable'}")
        ops.set_mode(plan.index, current)
    for instance in plan.create:
        step(f"GPU {plan.index}: create {instance}")
        ops.create(plan.index, instance.profile, instance.start)
    if plan.mode is not ModeChange.DISABLE:
        ops.ensure_compute_instances(plan.index)


def apply_layout(ops: MigOps, gpus: int, layout: MigLayout, journal: Journal | None = None,
                 step: Step = lambda _: None) -> ApplyResult:
    """Plan, apply and verify one layout. Runs on the NVML thread; every path ends in a result, a GPU NVML cannot
    read or change (lost) included: `failed`, naming it and the step."""
    try:
        plan = plan_layout(ops, gpus, layout)
        orphans, pending = _repairs(ops, gpus, plan)
    except PlanError as err:
        return ApplyResult(layout.name, "failed", f"layout {layout.name!r} cannot be applied: {err}")
    except MigCallError as err:
        return ApplyResult(layout.name, "failed", f"cannot plan the layout: {err}")
    if plan.noop and not orphans and not pending:
        if journal:
            journal.end()
        return ApplyResult(layout.name, "success", plan.selects_nothing or f"layout {layout.name!r} is already applied",
                           plan)
    if journal:
        journal.begin(layout.name, layout.origin)
    waiting: list[str] = []
    done: list[str] = []

    def counted(description: str) -> None:
        done.append(description)
        step(description)

    for gpu_plan in plan.gpus:
        if gpu_plan.noop and gpu_plan.index not in orphans | pending:
            continue
        try:
            _apply_gpu(ops, gpu_plan, gpu_plan.index in pending, gpu_plan.index in orphans, counted)
        except MigResetRequired as err:
            waiting.append(str(err))
        except MigCallError as err:
            # The journal stays: the next apply (or the next start) goes on from the hardware as it is now.
            where = f"after '{done[-1]}'" if done else "before any change"
            return ApplyResult(layout.name, "failed", f"NVML error on GPU {gpu_plan.index} ({where}): {err}", plan)
    if waiting:
        # The journal stays too: after the reset or reboot, starting the agent finishes the layout.
        return ApplyResult(layout.name, "rebooting", "; ".join(waiting)
                           + "; let the GPUs go idle and apply again, or reset the GPUs (reboot the node)", plan)
    try:
        after = plan_layout(ops, gpus, layout)
    except PlanError as err:
        return ApplyResult(layout.name, "failed", f"layout {layout.name!r} did not verify: {err}", plan)
    except MigCallError as err:
        return ApplyResult(layout.name, "failed", f"layout {layout.name!r} could not be verified: {err}", plan)
    if not after.noop:
        return ApplyResult(layout.name, "failed",
                           f"layout {layout.name!r} did not verify; still to do: {after.describe()}", plan)
    if journal:
        journal.end()
    return ApplyResult(layout.name, "success", f"layout {layout.name!r} applied: {len(done)} change(s)", plan)
