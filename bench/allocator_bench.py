"""Latency of preferred_gpus on 16-GPU topologies over random requests; writes p50/p99 as JSON.

Usage: python bench/allocator_bench.py [OUT.json] [--trials-per-size N] [--seed S]

For each topology and each size 1..16, N requests draw a random set of available GPUs (at least `size` of
them) and up to two must-include GPUs (none in a third of the requests). Every call is timed twice over: wall
clock (perf_counter) and CPU time of this process (process_time), which a busy machine inflates less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.topology.gpus import preferred_gpus
from agent.topology.model import Topology

GPUS = 16


def nvswitch_two_numa() -> Topology:
    """HGX-2 style: every pair joined through NVSwitch (6 links); GPUs 0-7 on NUMA node 0, 8-15 on node 1.
    PCIe: pairs share a switch, fours share a switch tree, eights share a socket."""
    pcie = {}
    for a in range(GPUS):
        for b in range(a + 1, GPUS):
            if a // 2 == b // 2:
                pcie[(a, b)] = "single"
            elif a // 4 == b // 4:
                pcie[(a, b)] = "multiple"
            elif a // 8 == b // 8:
                pcie[(a, b)] = "node"
            else:
                pcie[(a, b)] = "system"
    nvlink = {(a, b): 6 for a in range(GPUS) for b in range(a + 1, GPUS)}
    return Topology.build([g // 8 for g in range(GPUS)], pcie, nvlink)


def pcie_with_nvlink_pairs() -> Topology:
    """PCIe cards with NVLink bridges: pairs (0,1) ... (12,13) bridged with 4 links, 14 and 15 unbridged.
    Fours share a PCIe switch (PIX), two fours per host bridge (PHB), two host bridges per socket (NODE);
    GPUs 0-7 on NUMA node 0, 8-15 on node 1."""
    pcie = {}
    for a in range(GPUS):
        for b in range(a + 1, GPUS):
            if a // 4 == b // 4:
                pcie[(a, b)] = "single"
            elif a // 8 == b // 8:
                pcie[(a, b)] = "hostbridge" if a // 8 == 0 else "node"
            else:
                pcie[(a, b)] = "system"
    nvlink = {(2 * i, 2 * i + 1): 4 for i in range(7)}
    return Topology.build([g // 8 for g in range(GPUS)], pcie, nvlink)


TOPOLOGIES: dict[str, Callable[[], Topology]] = {
    "nvswitch-16gpu-2numa": nvswitch_two_numa,
    "pcie-nvlink-pairs-16gpu-2numa": pcie_with_nvlink_pairs,
}


def percentile(sorted_ms: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, -(-len(sorted_ms) * q // 100))
    return sorted_ms[int(rank) - 1]


def summary(wall: list[float], cpu: list[float]) -> dict[str, float | int]:
    wall, cpu = sorted(wall), sorted(cpu)
    return {
        "calls": len(wall),
        "wall_p50_ms": round(percentile(wall, 50), 3),
        "wall_p99_ms": round(percentile(wall, 99), 3),
        "wall_max_ms": round(wall[-1], 3),
        "cpu_p50_ms": round(percentile(cpu, 50), 3),
        "cpu_p99_ms": round(percentile(cpu, 99), 3),
        "cpu_max_ms": round(cpu[-1], 3),
    }


def run(topo: Topology, trials: int, rng: random.Random) -> dict[str, object]:
    wall: dict[int, list[float]] = {}
    cpu: dict[int, list[float]] = {}
    for size in range(1, GPUS + 1):
        for trial in range(trials):
            available = sorted(rng.sample(range(GPUS), rng.randint(size, GPUS)))
            must = [] if trial % 3 == 0 else rng.sample(available, rng.randint(0, min(2, size)))
            c0, w0 = time.process_time(), time.perf_counter()
            preferred_gpus(topo, available, must, size)
            w1, c1 = time.perf_counter(), time.process_time()
            wall.setdefault(size, []).append((w1 - w0) * 1000)
            cpu.setdefault(size, []).append((c1 - c0) * 1000)
    every_wall = [ms for per in wall.values() for ms in per]
    every_cpu = [ms for per in cpu.values() for ms in per]
    return {
        **summary(every_wall, every_cpu),
        "by_size": {str(size): summary(wall[size], cpu[size]) for size in wall},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="bench/out/allocator.json", help="JSON output path")
    parser.add_argument("--trials-per-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20261202)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    results = {name: run(build(), args.trials_per_size, rng) for name, build in TOPOLOGIES.items()}
    report = {
        "benchmark": "preferred_gpus, 16 GPUs, sizes 1..16, random availability and must_include",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "trials_per_size": args.trials_per_size,
        "seed": args.seed,
        "topologies": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for name, figures in results.items():
        print(
            f"{name}: p50 {figures['wall_p50_ms']} ms, p99 {figures['wall_p99_ms']} ms, "
            f"max {figures['wall_max_ms']} ms (wall); p99 {figures['cpu_p99_ms']} ms (cpu); "
            f"{figures['calls']} calls"
        )
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
