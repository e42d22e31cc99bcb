"""`make bench`: the agent's figures over real gRPC sockets, held to their budgets, into bench/results.json and
docs/benchmarks.md.

Usage: python bench/run.py [--quick] [--seed S] [--out bench/results.json] [--doc docs/benchmarks.md] [--check]

--quick runs every measurement with fewer calls and a 10 s idle window (a smoke run, not for the page);
--check exits 1 when a figure misses its budget.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench import grpc_bench, report  # noqa: E402

PREFERRED_PRESETS = ("a100-pcie-nvlink-pairs", "dgx-h100", "hgx-16-nvswitch", "pcie-16-nvlink-pairs")
ALLOCATE_PRESETS = ("dgx-h100", "hgx-16-nvswitch")
HEALTH_PRESET = "dgx-h100"
PROCESS_PRESET = "dgx-h100"

PREFERRED_P99_MS = 20.0
ALLOCATE_P99_MS = 2.0
HEALTH_MS = 100.0
RSS_MB = 100.0
IDLE_CPU_PERCENT = 1.0
MB = 1_000_000


@dataclass(frozen=True)
class Plan:
    preferred_calls_per_size: int
    allocate_calls: int
    xid_injections: int
    process_allocations: int
    idle_s: float


FULL = Plan(preferred_calls_per_size=100, allocate_calls=2000, xid_injections=50, process_allocations=10_000,
            idle_s=60.0)
QUICK = Plan(preferred_calls_per_size=10, allocate_calls=200, xid_injections=16, process_allocations=2000,
             idle_s=10.0)


def figure(
    key: str, label: str, value: float, unit: str, op: str | None = None, limit: float | None = None
) -> dict[str, Any]:
    """One row of the results: a value, and when it has a budget, the budget and whether it was met."""
    if op is None or limit is None:
        return {"id": key, "figure": label, "value": value, "unit": unit, "budget": None, "verdict": "info"}
    met = {"<": value < limit, "==": value == limit}[op]
    return {
        "id": key, "figure": label, "value": value, "unit": unit,
        "budget": {"op": op, "limit": limit}, "verdict": "pass" if met else "fail",
    }


def machine() -> dict[str, Any]:
    def first(path: str, key: str) -> str | None:
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return None

    try:
        revision = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": first("/proc/cpuinfo", "model name"),
        "memory": first("/proc/meminfo", "MemTotal"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "grpcio": grpc.__version__,
        "git": revision,
    }


def _rng(seed: int, section: str) -> random.Random:
    """One generator per section, so a section's requests do not depend on what ran before it."""
    return random.Random(f"{seed}/{section}")


async def measure(plan: Plan, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    details: dict[str, Any] = {"preferred": {}, "allocate": {}}

    for preset in PREFERRED_PRESETS:
        started = time.monotonic()
        result = await grpc_bench.preferred_allocation(
            preset, plan.preferred_calls_per_size, _rng(seed, f"preferred/{preset}")
        )
        details["preferred"][preset] = result
        n, optimum = result["gpus"], result["optimum"]
        share = round(100 * optimum["optimal"] / optimum["checked"], 2)
        where = f"{n} GPUs ({preset})"
        figures += [
            figure(f"preferred.{preset}.p50", f"GetPreferredAllocation p50, {where}", result["p50_ms"], "ms"),
            figure(f"preferred.{preset}.p99", f"GetPreferredAllocation p99, {where}", result["p99_ms"], "ms",
                   "<", PREFERRED_P99_MS),
            figure(f"preferred.{preset}.optimum", f"GetPreferredAllocation answers equal to the brute-force "
                   f"optimum, {where}", share, "%", "==", 100.0),
        ]
        print(f"GetPreferredAllocation {preset}: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, "
              f"max {result['max_ms']} ms over {result['calls']} calls; optimum {optimum['optimal']}/"
              f"{optimum['checked']} checked ({time.monotonic() - started:.0f} s)", flush=True)

    for preset in ALLOCATE_PRESETS:
        result = await grpc_bench.allocate(preset, plan.allocate_calls, _rng(seed, f"allocate/{preset}"))
        details["allocate"][preset] = result
        where = f"{result['gpus']} GPUs ({preset})"
        figures += [
            figure(f"allocate.{preset}.p50", f"Allocate p50, {where}", result["p50_ms"], "ms"),
            figure(f"allocate.{preset}.p99", f"Allocate p99, {where}", result["p99_ms"], "ms", "<", ALLOCATE_P99_MS),
        ]
        print(f"Allocate {preset}: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms over {result['calls']} "
              "calls", flush=True)

    health = await grpc_bench.health_to_list_and_watch(HEALTH_PRESET, plan.xid_injections, _rng(seed, "health"))
    details["health"] = health
    label = f"XID {health['xid']} to ListAndWatch update ({HEALTH_PRESET})"
    figures += [
        figure("health.p50", f"{label}, p50", health["p50_ms"], "ms"),
        figure("health.p99", f"{label}, p99", health["p99_ms"], "ms", "<", HEALTH_MS),
        figure("health.max", f"{label}, max", health["max_ms"], "ms", "<", HEALTH_MS),
    ]
    print(f"XID to ListAndWatch: p50 {health['p50_ms']} ms, p99 {health['p99_ms']} ms, max {health['max_ms']} ms "
          f"over {health['calls']} injections on {health['agents']} agents", flush=True)

    print(f"agent process: {plan.process_allocations} Allocate calls, then {plan.idle_s:.0f} s idle ...", flush=True)
    process = await grpc_bench.agent_process(
        PROCESS_PRESET, plan.process_allocations, plan.idle_s, _rng(seed, "process")
    )
    details["process"] = process
    calls = process["allocate"]["allocations"]
    where = f"gpu-agent process, {process['gpus']} GPUs ({PROCESS_PRESET})"
    figures += [
        figure("process.allocate.p50", f"Allocate p50, {where}", process["allocate"]["p50_ms"], "ms"),
        figure("process.allocate.p99", f"Allocate p99, {where}", process["allocate"]["p99_ms"], "ms",
               "<", ALLOCATE_P99_MS),
        figure("process.rss.start", f"RSS after start, {where}",
               round(process["rss_after_start_bytes"] / MB, 1), "MB", "<", RSS_MB),
        figure("process.rss.allocations", f"RSS after {calls:,} Allocate calls, {where}",
               round(process["rss_after_allocations_bytes"] / MB, 1), "MB", "<", RSS_MB),
        figure("process.idle_cpu", f"Idle CPU over {process['idle']['wall_s']:.0f} s, {where}",
               process["idle"]["cpu_percent_of_core"], "% of a core", "<", IDLE_CPU_PERCENT),
    ]
    print(f"agent process: RSS {process['rss_after_start_bytes'] / MB:.1f} MB after start, "
          f"{process['rss_after_allocations_bytes'] / MB:.1f} MB after {calls} Allocate calls; "
          f"Allocate p99 {process['allocate']['p99_ms']} ms; idle CPU {process['idle']['cpu_percent_of_core']} % "
          "of a core", flush=True)
    return figures, details


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and a 10 s idle window")
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when a figure misses its budget")
    args = parser.parse_args()

    plan = QUICK if args.quick else FULL
    facts = machine()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-agent-bench-") as tmp, grpc_bench.quiet_logs(Path(tmp) / "agent.log"):
        figures, details = asyncio.run(measure(plan, args.seed))
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results = {
        "generated_by": "bench/run.py" + (" --quick" if args.quick else ""),
        "mode": "quick" if args.quick else "full",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "seed": args.seed,
        "plan": asdict(plan),
        "constants": {
            "warmup_calls": grpc_bench.WARMUP_CALLS,
            "inject_phase_s": grpc_bench.INJECT_PHASE_S,
            "settle_s": grpc_bench.SETTLE_S,
        },
        "machine": facts,
        "figures": figures,
        "passed": all(f["verdict"] != "fail" for f in figures),
        "details": details,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text(report.render(results))
    failed = [f["figure"] for f in figures if f["verdict"] == "fail"]
    print(f"{len(figures)} figures, {len(failed)} over budget; written to {args.out} and {args.doc} "
          f"({results['duration_s']:.0f} s)")
    for name in failed:
        print(f"  over budget: {name}")
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
