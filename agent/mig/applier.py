"""Applies a MIG layout through NVML: plan from what the hardware reports, change only what differs, verify.

Crash safety comes from two facts. Every apply plans from the hardware as it is now, so running it again after
an interruption finishes the job (a GPU instance left without its compute instance is completed, one left
half-created is kept or destroyed like any other). And a journal file records the layout while an apply is in
progress, so an agent that starts after a crash knows which layout to finish even without a cluster.

The journal lives in mig.stateDir, on the node's disk. A disk that cannot keep it (full, read-only, an I/O error)
fails the apply before anything on the GPUs changes, with a reason that names the disk and the path
(StateDirError), never NVML; a file in its place that cannot be a journal (a FIFO, a device, a directory, a
symbolic link to nothing, a file too large or not the journal's JSON) is read without waiting or unbounded
memory and refused in one line naming it (Journal.pending).
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.mig.layout import MigLayout, layout_name_problem
from agent.mig.planner import GpuMigState, GpuPlan, MigInstance, ModeChange, NodePlan, PlanError, plan_node
from agent.nvml.mig_ops import MigCallError, MigGpuState, MigOps, MigResetRequired
from agent.yamlfile import InputFileError, clip, printable, read_text_file, shown, write_atomically

JOURNAL = "mig-journal.json"
MAX_JOURNAL_BYTES = 64 * 1024
"""The largest MIG journal the agent reads. The agent writes the layout's name (a label value: at most 63
characters), the layouts file's path (at most PATH_MAX, 4096 bytes, each at most 6 once JSON escapes it: 24 KiB)
and a time: at most about 25 KiB, on any node, since the journal names the layout and not the GPUs or their
instances (a 16-GPU node with every GPU cut into 1g slices writes the same few hundred bytes as one GPU). The
bound leaves more than twice that; a larger file is no journal the agent wrote, and is refused unread."""

Outcome = Literal["success", "failed", "rebooting"]
Step = Callable[[str], None]
"""Called with a description before each change to the hardware (progress logs)."""


@dataclass(frozen=True)
class ApplyResult:
    layout: str
    outcome: Outcome
    reason: str
    plan: NodePlan | None = None


class StateDirError(RuntimeError):
    """mig.stateDir cannot keep the agent's MIG state (the disk is full, read-only, failing, or the path is not a
    directory): the message is one line that says it is the disk, names the path and gives the system's reason."""

    def __init__(self, doing: str, path: Path, err: OSError) -> None:
        self.path = path
        code = errno.errorcode.get(err.errno) if err.errno is not None else None
        why = f"{err.strerror or err}{f' ({code})' if code else ''}"
        super().__init__(f"disk error in mig.stateDir: cannot {doing} {printable(str(path))}: {why}")


class Journal:
    """The layout being applied, kept in a file until the apply ends either way."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / JOURNAL

    def begin(self, layout: str, origin: str) -> None:
        """Write the journal (atomically, flushed to disk); StateDirError when the disk cannot keep it."""
        record = {"layout": layout, "layouts_file": origin, "started": time.time()}
        try:
            write_atomically(self.path, json.dumps(record))
        except OSError as err:
            raise StateDirError("write the MIG journal", self.path, err) from None

    def pending(self) -> str | None:
        """The layout an interrupted apply was applying; None when there is no journal (no apply was
        interrupted). A file there that is no journal the agent wrote (a FIFO, a device, a directory, a symbolic
        link to nothing, larger than MAX_JOURNAL_BYTES, not UTF-8, not JSON, without a layout name) raises
        InputFileError, one line naming it and what is wrong: it says an apply may have been interrupted, but
        not which layout, so it is never taken for "none". It is read as every input file is
        (read_text_file): without waiting on a FIFO and with bounded memory, so it costs the event loop nothing."""
        try:
            text = read_text_file(self.path, MAX_JOURNAL_BYTES)
        except InputFileError:
            if not os.path.lexists(self.path):
                return None
            if _dangling(self.path):
                raise InputFileError(self.path, f"is a symbolic link to {clip(_link_target(self.path), 200)}, "
                                                "which does not exist") from None
            raise
        if not text.strip():
            raise InputFileError(self.path, "is empty, not a MIG journal")
        try:
            record = json.loads(text)
        except RecursionError:
            raise InputFileError(self.path, "not JSON: nested too deeply") from None
        except ValueError as err:  # JSONDecodeError, or a number too long to convert
            detail = (f"{err.msg} (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError)
                      else str(err).split(":", 1)[0])
            raise InputFileError(self.path, f"not JSON: {detail}") from None
        layout = record.get("layout") if isinstance(record, dict) else None
        if not isinstance(layout, str):
            raise InputFileError(self.path, "not a MIG journal: it names no layout (a string under \"layout\")")
        problem = layout_name_problem(layout)
        if problem is not None:
            raise InputFileError(self.path, f"not a MIG journal: its layout {shown(layout)}: {problem}")
        return layout

    def end(self) -> None:
        """Remove the journal (gone already is fine); StateDirError when the disk refuses."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StateDirError("remove the MIG journal", self.path, err) from None


def _dangling(path: Path) -> bool:
    """Whether `path` is a symbolic link to nothing (not one to a file that cannot be read, nor a loop)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return os.path.islink(path)
    except OSError:
        return False
    return False


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


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
            try:
                journal.end()
            except StateDirError as err:
                return ApplyResult(layout.name, "failed", f"{err}; the GPUs have layout {layout.name!r} already, "
                                   "and nothing was changed on them", plan)
        return ApplyResult(layout.name, "success", plan.selects_nothing or f"layout {layout.name!r} is already applied",
                           plan)
    if journal:
        # Before the first change: a disk that cannot keep the journal fails the apply with nothing touched.
        try:
            journal.begin(layout.name, layout.origin)
        except StateDirError as err:
            return ApplyResult(layout.name, "failed", f"{err}; nothing was changed on the GPUs", plan)
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
        try:
            journal.end()
        except StateDirError as err:
            # The GPUs have the layout; the journal stays, and the next try (a no-op apply) removes it.
            return ApplyResult(layout.name, "failed", f"layout {layout.name!r} applied: {len(done)} change(s), "
                               f"but {err}", plan)
    return ApplyResult(layout.name, "success", f"layout {layout.name!r} applied: {len(done)} change(s)", plan)
