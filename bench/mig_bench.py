"""MIG measurements on the fake NVML: a node carved by the agent's own applier, and the applier's overhead.

`carved` prepares a fake node with a layout applied through `apply_layout`, for the device-plugin series on
MIG devices. `apply_overhead` times `apply_layout` and, through a timing proxy in place of the backend's
library, the time spent inside NVML calls; the rest is the agent's own work (planning, verification, the
journal). Nothing here decides pass or fail; `bench/run.py` holds the budgets.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from agent.mig.applier import Journal, apply_layout
from agent.mig.layout import MigLayout, load_layouts
from agent.mig.planner import ModeChange
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import load_node
from bench.grpc_bench import latency, percentile

CALIBRATION_CALLS = 20_000


def shipped_layout(name: str) -> MigLayout:
    """A layout from the set the agent ships (the default when no layouts file is configured)."""
    return load_layouts(None).layouts[name]


def carved(preset: str, layout: str) -> FakeNvml:
    """A fake node with `layout` applied through the agent's applier, as the MIG controller would apply it."""
    fake = FakeNvml(load_node(preset))
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    try:
        result = apply_layout(MigOps(backend), len(fake.spec.gpus), shipped_layout(layout))
    finally:
        backend.shutdown()
    if result.outcome != "success":
        raise RuntimeError(f"{preset}: applying {layout} ended {result.outcome}: {result.reason}")
    return fake


class TimedLibrary:
    """Stands in for the backend's `lib`: forwards every attribute, and times each call of a pynvml function
    (a name starting with "nvml"), summing the seconds spent inside them."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.seconds = 0.0
        self.calls: Counter[str] = Counter()

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls.clear()

    def __getattr__(self, name: str) -> Any:
        # Only reached on the first use of a name: the timed wrapper is then stored on the instance, so later
        # calls find it directly and the proxy adds as little as it can to each call.
        target = getattr(self._lib, name)
        if not (name.startswith("nvml") and callable(target)):
            return target
        perf_counter, calls = time.perf_counter, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                self.seconds += perf_counter() - start
                calls[name] += 1

        setattr(self, name, timed)
        return timed


def proxy_cost_us(lib: TimedLibrary, fn: str) -> float:
    """What one call through the proxy costs beyond the call itself, in µs (a cheap NVML function, called
    directly and through the proxy): that much of each proxied call is counted as the agent's own time."""
    direct = getattr(lib._lib, fn)
    start = time.perf_counter()
    for _ in range(CALIBRATION_CALLS):
        direct()
    plain = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(CALIBRATION_CALLS):
        getattr(lib, fn)()
    proxied = time.perf_counter() - start
    lib.reset()
    return max(0.0, (proxied - plain) / CALIBRATION_CALLS * 1e6)


def apply_overhead(preset: str, layout: str, baseline: str, runs: int) -> dict[str, Any]:
    """Time `apply_layout(layout)` from `baseline` (applied untimed before each run) `runs` times on one fake
    node, with the journal the MIG controller keeps; one untimed pair first warms both paths."""
    fake = FakeNvml(load_node(preset))
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    lib = TimedLibrary(fake)
    backend.lib = lib
    ops, gpus = MigOps(backend), len(fake.spec.gpus)
    target, start_from = shipped_layout(layout), shipped_layout(baseline)
    state_dir = Path(tempfile.mkdtemp(prefix="gpu-agent-bench-mig-"))
    journal = Journal(state_dir)
    total: list[float] = []
    inside: list[float] = []
    changes = 0
    try:
        cost = proxy_cost_us(lib, "nvmlDeviceGetCount")
        for run in range(runs + 1):
            reset = apply_layout(ops, gpus, start_from, journal)
            if reset.outcome != "success":
                raise RuntimeError(f"{preset}: applying {baseline} ended {reset.outcome}: {reset.reason}")
            lib.reset()
            started = time.perf_counter()
            result = apply_layout(ops, gpus, target, journal)
            elapsed = time.perf_counter() - started
            if result.outcome != "success" or result.plan is None or result.plan.noop:
                raise RuntimeError(f"{preset}: applying {layout} ended {result.outcome}: {result.reason}")
            if run == 0:
                continue
            total.append(elapsed * 1000)
            inside.append(lib.seconds * 1000)
            calls = sum(lib.calls.values())
            changes = sum(len(p.create) + len(p.destroy) + (p.mode is not ModeChange.NONE) for p in result.plan.gpus)
            by_function = dict(lib.calls.most_common())
    finally:
        backend.shutdown()
        shutil.rmtree(state_dir, ignore_errors=True)
    outside = [t - i for t, i in zip(total, inside, strict=True)]

    def p50(values: list[float]) -> float:
        return round(percentile(sorted(values), 50), 3)

    return {
        "preset": preset,
        "gpus": gpus,
        "layout": layout,
        "from": baseline,
        "runs": runs,
        "changes": changes,
        "nvml_calls_per_apply": calls,
        "nvml_calls_by_function": by_function,
        "proxy_cost_us_per_call": round(cost, 3),
        "proxy_cost_ms_per_apply": round(cost * calls / 1000, 3),
        "total_p50_ms": p50(total),
        "inside_nvml_p50_ms": p50(inside),
        "agent_p50_ms": p50(outside),
        "total": latency(total),
        "inside_nvml": latency(inside),
        "agent": latency(outside),
        "runs_ms": [
            {"total": round(t, 3), "inside_nvml": round(i, 3), "agent": round(t - i, 3)}
            for t, i in zip(total, inside, strict=True)
        ],
    }
