"""Renders docs/benchmarks.md from bench/results.json; every number on the page comes from that file.

Usage: python bench/report.py [bench/results.json] [docs/benchmarks.md]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _number(value: float, unit: str) -> str:
    if unit == "ms":
        text = f"{value:.3f}"
    elif unit == "MB":
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


def _budget(row: dict[str, Any]) -> str:
    budget = row["budget"]
    if budget is None:
        return "—"
    op = {"<": "<", "==": "="}[budget["op"]]
    return f"{op} {budget['limit']:g} {row['unit']}"


def _figures(results: dict[str, Any]) -> list[str]:
    lines = ["| figure | value | budget | verdict |", "|---|---:|---:|---|"]
    for row in results["figures"]:
        verdict = {"pass": "pass", "fail": "**FAIL**", "info": "—"}[row["verdict"]]
        lines.append(f"| {row['figure']} | {_number(row['value'], row['unit'])} | {_budget(row)} | {verdict} |")
    return lines


def _by_size(preferred: dict[str, Any]) -> list[str]:
    presets = list(preferred)
    largest = max(p["gpus"] for p in preferred.values())
    lines = [
        "| size | " + " | ".join(f"{name} ({preferred[name]['gpus']} GPUs)" for name in presets) + " |",
        "|---:|" + "---:|" * len(presets),
    ]
    for size in range(1, largest + 1):
        cells = []
        for name in presets:
            row = preferred[name]["by_size"].get(str(size))
            cells.append("" if row is None else f"{row['p50_ms']:.3f} / {row['p99_ms']:.3f}")
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return lines


def _wall_and_cpu(details: dict[str, Any]) -> list[str]:
    lines = [
        "| series | calls | wall p50 | wall p99 | wall max | CPU p50 | CPU p99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    series = [(f"GetPreferredAllocation, {name}", r) for name, r in details["preferred"].items()]
    series += [(f"Allocate, {name}", r) for name, r in details["allocate"].items()]
    for label, r in series:
        lines.append(
            f"| {label} | {r['calls']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.3f} "
            f"| {r['cpu_p50_ms']:.3f} | {r['cpu_p99_ms']:.3f} |"
        )
    return lines


def _mismatches(preferred: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for name, result in preferred.items():
        for m in result["optimum"]["mismatches"]:
            lines.append(
                f"- {name}: size {m['size']}, available {m['available']}, must include {m['must_include']}: "
                f"answered {m['answer']}, optimum {m['optimum']}"
            )
    if lines:
        return ["", "## Answers that differ from the brute-force optimum (first ten per topology)", "", *lines]
    return []


def _method(results: dict[str, Any]) -> list[str]:
    plan, details, constants = results["plan"], results["details"], results["constants"]
    preferred = details["preferred"]
    checks = ", ".join(
        f"{name} {p['optimum']['checked']} of {p['calls']}" for name, p in preferred.items()
    )
    health, process = details["health"], details["process"]
    return [
        "- **Where.** Every figure runs the agent's real code on the fake NVML (`agent/nvml/fake.py`, which "
        "replaces only the C library under the real NVML backend), loaded with the preset named in the figure "
        "(`agent/nvml/presets/`). Each call goes over gRPC on a unix socket.",
        "- **In-process figures** (GetPreferredAllocation, Allocate on N GPUs, XID): an `Agent` runs in the "
        "benchmark process and registers with the stand-in kubelet (`agent/simulate.py`) in a temporary "
        "directory; the benchmark opens its own channel to the plugin's socket, as the kubelet does, and times "
        "each call from send to response. Client and agent share one Python process and one event loop, so "
        f"these figures include the client's share of the work. {constants['warmup_calls']} untimed calls warm "
        "each channel first.",
        f"- **GetPreferredAllocation requests.** For every size 1..N, {plan['preferred_calls_per_size']} calls, "
        "each offering a random set of available GPUs (at least `size`, the count drawn uniformly); every "
        "fourth request of size 2 or more also names one or two must-include GPUs among them. Random draws "
        f"are seeded (`--seed {results['seed']}`). p50 and p99 are nearest-rank over all sizes of a topology; "
        "the table below splits them by size.",
        "- **Optimum.** Answers are compared, outside the timing, with a brute force over "
        "`itertools.combinations` ordered as `docs/allocation.md` defines (value, then NUMA span, then the best "
        "value left for a same-size request, then the index tuple); the remainder is evaluated only for the "
        "sets that tie on value and span, which the left-to-right order allows. Requests checked: "
        f"{checks}. The budget is 100 % because the allocator promises the exact optimum up to 16 candidates.",
        "- **Allocate** calls name a random set of 1..N device IDs "
        f"({details['allocate'][next(iter(details['allocate']))]['calls']} timed calls per in-process topology).",
        f"- **XID to ListAndWatch.** `FakeNvml.inject_xid(gpu, {health['xid']})` after a random "
        f"0-{constants['inject_phase_s'] * 1000:.0f} ms pause "
        "(so injections land at every phase of the health monitor's 200 ms event wait and 5 s sampling), "
        "timed to the first response on the benchmark's own ListAndWatch stream that lists that GPU "
        "Unhealthy. A faulted GPU recovers only after several clean samples, longer than one agent's round of "
        "injections, so each injection goes to a GPU still healthy, and a fresh agent takes over once all are "
        f"unhealthy: {health['calls']} injections on {health['agents']} agents.",
        f"- **Agent process.** `{process['command']}` runs as a subprocess against a stand-in kubelet in "
        f"the benchmark process. RSS is `VmRSS` of `/proc/<pid>/status` {constants['settle_s']:.0f} s after "
        "registration and after "
        f"{process['allocate']['allocations']:,} sequential Allocate calls (MB = 10^6 bytes; peak `VmHWM` "
        f"{process['rss_peak_bytes'] / 1_000_000:.1f} MB). Idle CPU is the growth of utime + stime in "
        f"`/proc/<pid>/stat` over {process['idle']['wall_s']:.0f} s of idling divided by that wall time, while "
        "the stand-in kubelet keeps its ListAndWatch stream open.",
        "- **Budgets.** GetPreferredAllocation p99 < 20 ms is set for 16 GPUs; the smaller nodes are held to "
        "it too. Allocate p99 < 2 ms, health change to ListAndWatch < 100 ms (p99 and max), RSS < 100 MB, "
        "idle CPU < 1 % of a core. Rows marked — are context without a budget.",
        "- **Reproduce.** `make bench` runs `bench/allocator_bench.py` (the allocator alone, into "
        "`bench/out/`) and `bench/run.py`, which writes `bench/results.json` and this page; "
        "`python bench/report.py` re-renders the page from the JSON. `bench/run.py --quick` is a smoke run "
        "with fewer calls and a 10 s idle window. No test times anything; these figures come only from here.",
    ]


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    failed = sum(row["verdict"] == "fail" for row in results["figures"])
    budgeted = sum(row["verdict"] != "info" for row in results["figures"])
    verdict = f"All {budgeted} budgets met." if not failed else f"**{failed} of {budgeted} budgets missed.**"
    load = ", ".join(str(x) for x in m["load_average_at_start"])
    load_end = ", ".join(str(x) for x in m["load_average_at_end"])
    process = results["details"]["process"]
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by bench/report.py from bench/results.json (`make bench`); do not edit by hand. -->",
        "",
        f"`{results['generated_by']}` ({results['mode']} run) on {results['date']}, {results['duration_s']:.0f} s: "
        f"{m['nproc']} CPUs ({m['cpu_model']}), {m['memory']} memory, load average {load} at start and "
        f"{load_end} at the end; {m['implementation']} {m['python']}, grpcio {m['grpcio']}, "
        f"revision `{m['git']}`. {verdict}",
        "",
        *_figures(results),
        "",
        "## GetPreferredAllocation by request size",
        "",
        f"p50 / p99 in ms, {results['plan']['preferred_calls_per_size']} calls per size.",
        "",
        *_by_size(results["details"]["preferred"]),
        *_mismatches(results["details"]["preferred"]),
        "",
        "## Wall clock and CPU time",
        "",
        "In ms per call, for the in-process series. CPU is the time the benchmark process (client and agent, "
        "all threads) spent on the call; where wall time is well above it, the call waited for a core. "
        f"The agent process spent {process['allocate']['agent_cpu_ms_per_call']:.3f} ms of CPU per Allocate "
        f"call on average over its {process['allocate']['allocations']:,} calls (wall p50 "
        f"{process['allocate']['p50_ms']:.3f} ms, p99 {process['allocate']['p99_ms']:.3f} ms, max "
        f"{process['allocate']['max_ms']:.3f} ms).",
        "",
        *_wall_and_cpu(results["details"]),
        "",
        "## Method",
        "",
        *_method(results),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results.json"
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / "benchmarks.md"
    target.write_text(render(json.loads(source.read_text())))
    print(f"written to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
