"""A `gpu-agent mig apply` killed between any two driver calls converges when run again.

The fake NVML ends the process with exit status 137 right after its N-th state-changing call has reached the
state file (GPU_AGENT_FAKE_CRASH_AFTER=N), the way a SIGKILL between two driver calls would leave a node.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agent import cli
from agent.mig.applier import JOURNAL, apply_layout, plan_layout
from agent.mig.layout import load_layouts, parse_layouts
from agent.mig.planner import ModeChange, NodePlan
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import CRASH_AFTER_ENV, FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import load_node

AGENT = [sys.executable, "-m", "agent.cli"]
LAYOUT = "all-balanced"
BALANCED_H100 = [("2g.20gb", 0, 2), ("1g.10gb", 2, 1), ("1g.10gb", 3, 1), ("3g.40gb", 4, 4)]
TWO_H100 = """\
version: v1
gpus:
  - {model: H100-SXM5-80GB, numa_node: 0}
  - {model: H100-SXM5-80GB, numa_node: 0}
"""
START_LAYOUTS = """\
version: v1
mig-configs:
  gpu0-sevens:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
"""


@dataclass(frozen=True)
class Start:
    """A node to crash an apply on: its node source and its state before the apply (None: fresh boot)."""

    node: str
    state: bytes | None
    gpus: int


def opened(node: str, state_file: Path) -> tuple[NvmlBackend, MigOps]:
    fake = FakeNvml(load_node(node), state_file)
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    return backend, MigOps(backend)


def prepared(tmp_path: Path, node: str, first: str | None) -> Start:
    """The node with ``first`` applied, in-process (the start of every crash run)."""
    state_file = tmp_path / "start.json"
    backend, ops = opened(node, state_file)
    gpus = len(backend.inventory().gpus)
    if first is None:
        return Start(node, None, gpus)
    layouts = {**load_layouts().layouts, **parse_layouts(START_LAYOUTS, "start-layouts.yaml").layouts}
    assert apply_layout(ops, gpus, layouts[first]).outcome == "success"
    return Start(node, state_file.read_bytes(), gpus)


def driver_calls(plan: NodePlan) -> int:
    """The state-changing NVML calls a plan takes: compute instance and GPU instance for each destroy and
    create, and one per mode change."""
    return sum(2 * len(p.destroy) + 2 * len(p.create) + (p.mode is not ModeChange.NONE) for p in plan.gpus)


def planned(start: Start, tmp_path: Path) -> NodePlan:
    state_file = tmp_path / "planned.json"
    if start.state is not None:
        state_file.write_bytes(start.state)
    _, ops = opened(start.node, state_file)
    return plan_layout(ops, start.gpus, load_layouts().layout(LAYOUT))


def mig(action: str, start: Start, state_file: Path, state_dir: Path,
        crash_after: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CRASH_AFTER_ENV}
    if crash_after is not None:
        env[CRASH_AFTER_ENV] = str(crash_after)
    return subprocess.run(
        [*AGENT, "mig", action, "--nvml", f"mock:{start.node}", "--mock-state", str(state_file),
         "--layout", LAYOUT, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=60, env=env,
    )


_STDOUT = threading.Lock()


def mig_readonly(action: str, start: Start, state_file: Path) -> tuple[int, str]:
    """`gpu-agent mig assert` or `mig plan`, run in this process (they change nothing): exit status and
    output."""
    out = io.StringIO()
    with _STDOUT, contextlib.redirect_stdout(out):
        code = cli.main(["mig", action, "--nvml", f"mock:{start.node}", "--mock-state", str(state_file),
                         "--layout", LAYOUT])
    return code, out.getvalue()


@dataclass(frozen=True)
class Run:
    n: int
    crashed: bool
    state_after_crash: bytes


def crash_and_recover(start: Start, work: Path, n: int) -> Run:
    """Apply with the process killed after driver call ``n``, then, if it was killed, apply again as a user
    would; either way the node ends with the layout and no journal."""
    work.mkdir()
    state_file, state_dir = work / "nvml.json", work / "state"
    if start.state is not None:
        state_file.write_bytes(start.state)

    first = mig("apply", start, state_file, state_dir, crash_after=n)
    crashed = first.returncode != 0
    state_after_crash = state_file.read_bytes()
    if crashed:
        assert (first.returncode, first.stderr) == (137, ""), (n, first.stderr)
        journal = json.loads((state_dir / JOURNAL).read_text())
        assert (journal["layout"], journal["layouts_file"]) == (LAYOUT, "built-in default-layouts.yaml"), n
        _, ops = opened(start.node, state_file)
        remaining = plan_layout(ops, start.gpus, load_layouts().layout(LAYOUT))
        orphaned = {i for i in range(start.gpus) if any(g.compute_instances == 0 for g in ops.state(i).instances)}
        # The second run does exactly what the crash left undone: the planned changes, and for a GPU instance
        # the crash left without its compute instance, the repair (named before that GPU's changes).
        expected = []
        for gpu_plan in remaining.gpus:
            if gpu_plan.index in orphaned:
                expected.append(f"GPU {gpu_plan.index}: complete GPU instances left without a compute instance")
            expected += gpu_plan.actions()
        # `mig plan` shows the same steps, repairs included, before anything runs.
        assert mig_readonly("plan", start, state_file) == (0, "\n".join(expected or ["no changes"]) + "\n"), n
        first = mig("apply", start, state_file, state_dir)
        assert first.returncode == 0, (n, first.stdout, first.stderr)
        assert first.stdout.splitlines()[:-1] == expected, n
    assert first.stdout.splitlines()[-1].startswith(f"success: layout {LAYOUT!r} "), (n, first.stdout)

    assert mig_readonly("assert", start, state_file) == (0, f"layout {LAYOUT!r} is applied\n"), n
    backend, ops = opened(start.node, state_file)
    for index in range(start.gpus):
        found = [(i.profile, i.start, i.size, i.compute_instances) for i in ops.state(index).instances]
        assert found == [(*i, 1) for i in BALANCED_H100], (n, index, found)
    assert len(backend.inventory().mig_devices) == 4 * start.gpus
    assert not (state_dir / JOURNAL).exists(), n
    return Run(n, crashed, state_after_crash)


def crash_at(start: Start, tmp_path: Path, ns: Sequence[int]) -> list[Run]:
    """Crash runs for each N, side by side (each has its own state file and state directory)."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda n: crash_and_recover(start, tmp_path / f"n{n}", n), ns))


def test_a_crash_after_any_driver_call_converges_on_two_gpus(tmp_path: Path) -> None:
    # GPU 0 goes from seven 1g instances to the balanced layout (destroys and creates), GPU 1 from MIG
    # disabled (a mode change, then creates): every kind of driver call, on more than one GPU.
    node_file = tmp_path / "two-h100.yaml"
    node_file.write_text(TWO_H100)
    start = prepared(tmp_path, str(node_file), "gpu0-sevens")
    plan = planned(start, tmp_path)
    assert [(p.index, p.mode, len(p.destroy), len(p.create)) for p in plan.gpus] == [
        (0, ModeChange.NONE, 5, 2), (1, ModeChange.ENABLE, 0, 4)]
    calls = driver_calls(plan)
    assert calls == 14 + 9

    runs = crash_at(start, tmp_path, range(1, calls + 2))

    # Every N up to the number of driver calls kills the apply; one more lets it finish.
    assert [r.n for r in runs if r.crashed] == list(range(1, calls + 1))
    assert [r.n for r in runs if not r.crashed] == [calls + 1]
    # Each crash happened one persisted driver call later than the one before.
    states = [start.state] + [r.state_after_crash for r in runs if r.crashed]
    assert all(a != b for a, b in itertools.pairwise(states))


def test_a_crash_at_sampled_driver_calls_converges_on_dgx_h100(tmp_path: Path) -> None:
    start = prepared(tmp_path, "dgx-h100", "all-1g.10gb")
    calls = driver_calls(planned(start, tmp_path))
    assert calls == 112
    # First call, first GPU done (14) and the next, mid-node, the last call, and one past it.
    runs = crash_at(start, tmp_path, [1, 14, 15, 57, calls, calls + 1])
    assert [(r.n, r.crashed) for r in runs] == [(1, True), (14, True), (15, True), (57, True), (112, True),
                                                (113, False)]


def test_a_bad_crash_hook_value_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, CRASH_AFTER_ENV: "0"}
    done = subprocess.run(
        [*AGENT, "mig", "apply", "--nvml", "mock:dgx-h100", "--mock-state", str(tmp_path / "nvml.json"),
         "--layout", LAYOUT, "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"gpu-agent mig: error: {CRASH_AFTER_ENV} must be a whole number >= 1, got '0'\n"
    assert not (tmp_path / "nvml.json").exists()
