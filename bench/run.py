"""`make bench`: the agent's figures over real gRPC sockets, a real kube-apiserver and the fake NVML, held to
their budgets, into bench/results.json and docs/benchmarks.md.

Usage: python bench/run.py [--quick] [--seed S] [--out bench/results.json] [--doc docs/benchmarks.md] [--check]
                           [--no-cluster] [--only SECTION[,SECTION...] [--merge]]

--quick runs every measurement with fewer calls, a 10 s idle window and a 30 s steady state (a smoke run, not
for the page); --check exits 1 when a figure misses its budget; --only measures some sections (e.g.
--only floor,many_devices; `cluster` is the single-node cluster, which needs root), prints their figures and
writes them to bench/out/only.json, not to the page; with
--merge (full runs only) they replace those sections' figures and details in bench/results.json, and the page is
rendered again from it, naming the sections measured again, when, and at which revision. The
API-server figures need the binaries hack/testbin.sh builds; the run builds them first when they are missing
(minutes, once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from agent.config import parse_config  # noqa: E402
from bench import (  # noqa: E402
    cluster_bench,
    dra_bench,
    grpc_bench,
    kube_bench,
    mig_bench,
    report,
    stuck_bench,
    telemetry_bench,
)
from tests.integration import apiserver  # noqa: E402

PREFERRED_PRESETS = ("a100-pcie-nvlink-pairs", "dgx-h100", "hgx-16-nvswitch", "pcie-16-nvlink-pairs")
ALLOCATE_PRESETS = ("dgx-h100", "hgx-16-nvswitch")
HEALTH_PRESET = "dgx-h100"
PROCESS_PRESET = "dgx-h100"
MIG_PRESET, MIG_LAYOUT, MIG_RESOURCE = "dgx-h100", "all-1g.10gb", "nvidia.com/mig-1g.10gb"
MIG_CONFIG = "version: v1\nflags:\n  migStrategy: mixed\n"
REPLICA_PRESET, REPLICA_RESOURCE, REPLICAS = "hgx-16-nvswitch", "nvidia.com/gpu", 50
REPLICA_CONFIG = (f"version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: {REPLICA_RESOURCE}\n"
                  f"      replicas: {REPLICAS}\n")
APPLY_PRESET, APPLY_LAYOUT, APPLY_FROM = "dgx-h100", "all-balanced", "all-disabled"
RIG_NODE = "bench-node"
DRA_NODE = "bench-dra-node"
TAINT_PRESET = "dgx-h100"
DRA_PRESET = "dgx-h100"
STEADY_PRESET = "dgx-h100"
TELEMETRY_PRESET = "dgx-h100"
STUCK_NODE = "bench-stuck-node"
SIGTERM_MS = 10_000.0
STUCK_RATIO = 2.0
"""Allocate and GetPreferredAllocation p99 while NVML is stuck, at most this many times their p99 with it answering."""
ENDPOINT_MS = 100.0

PREFERRED_P99_MS = 20.0
ALLOCATE_P99_MS = 2.0
HEALTH_MS = 100.0
TAINT_MS = 1000.0
RSS_MB = 100.0
IDLE_CPU_PERCENT = 1.0
TELEMETRY_PASS_CPU_MS = 50.0
SCRAPE_P99_MS = 25.0
CLIENTS_PRESET = "hgx-16-nvswitch"
CLIENTS = 64
CLIENT_RATE = 5.0
"""Calls per second each of the CLIENTS makes on average (a Poisson process): 320 calls a second in all, several
times the Allocate calls of a 50-pod burst on one node."""
FLOOR_PRESET = "dgx-h100"
"""The Go floor, the empty Python server and the agent's CPU per call are reported without a budget: no user
notices them; what the kubelet notices is the latency, held to its budgets while 64 clients call at once."""
MB = 1_000_000


@dataclass(frozen=True)
class Plan:
    preferred_calls_per_size: int
    allocate_calls: int
    xid_injections: int
    process_allocations: int
    idle_s: float
    many_preferred_calls: int
    many_allocate_calls: int
    mig_apply_runs: int
    taint_injections: int
    steady_state_s: float
    telemetry_passes: int = 50
    telemetry_scrapes: int = 500
    floor_rounds: int = 3
    floor_calls: int = 3000
    clients_seconds: float = 30.0
    clients_back_to_back_seconds: float = 10.0
    stuck_runs: int = 10
    stuck_calls: int = 500
    stuck_sigterm_runs: int = 5
    stuck_restart_runs: int = 4


FULL = Plan(preferred_calls_per_size=100, allocate_calls=2000, xid_injections=50, process_allocations=10_000,
            idle_s=60.0, many_preferred_calls=1000, many_allocate_calls=2000, mig_apply_runs=10,
            taint_injections=20, steady_state_s=300.0)
QUICK = Plan(preferred_calls_per_size=10, allocate_calls=200, xid_injections=16, process_allocations=2000,
             idle_s=10.0, many_preferred_calls=100, many_allocate_calls=200, mig_apply_runs=3,
             taint_injections=5, steady_state_s=30.0, telemetry_passes=10, telemetry_scrapes=50,
             floor_calls=300, clients_seconds=5.0, clients_back_to_back_seconds=3.0, stuck_runs=3, stuck_calls=100,
             stuck_sigterm_runs=2, stuck_restart_runs=2)


def figure(
    key: str, label: str, value: float, unit: str, op: str | None = None, limit: float | None = None
) -> dict[str, Any]:
    """One row of the results: a value, and when it has a budget, the budget and whether it was met.

    op "report" marks a figure asked for without a budget: reported, never judged."""
    if op == "report":
        return {"id": key, "figure": label, "value": value, "unit": unit, "budget": "report", "verdict": "report"}
    if op is None or limit is None:
        return {"id": key, "figure": label, "value": value, "unit": unit, "budget": None, "verdict": "info"}
    met = {"<": value < limit, "<=": value <= limit, "==": value == limit}[op]
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


class Sections:
    """The load average when each section starts and how long it runs: other work on the machine shows here."""

    def __init__(self) -> None:
        self.record: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        load = [round(x, 2) for x in os.getloadavg()]
        started = time.monotonic()
        try:
            yield
        finally:
            self.record[name] = {"load_average_at_start": load, "duration_s": round(time.monotonic() - started, 1)}


RESULTS = ROOT / "bench" / "results.json"
SECTIONS = ("preferred", "allocate", "many_clients", "many_devices", "health", "telemetry", "mig_apply", "floor",
            "process", "apiserver", "nvml_stuck")
"""The sections of the in-process run; apiserver is the taint, DRA withdrawal, steady-state and API-client process
figures."""
ONLY_CHOICES = (*SECTIONS, "cluster")
"""What --only can choose: the sections and the single-node cluster (bench/cluster_bench.py, needs root)."""
FIGURE_SECTIONS = {"preferred": "preferred", "allocate": "allocate", "clients": "many_clients", "many": "many_devices",
                   "health": "health", "telemetry": "telemetry", "mig_apply": "mig_apply", "floor": "floor",
                   "process": "process", "process_kube": "apiserver", "taint": "apiserver", "dra": "apiserver",
                   "steady": "apiserver", "stuck": "nvml_stuck"}
"""The section each figure comes from, by the first part of its id; any other figure is the cluster's."""
DETAIL_SECTIONS = {"taint": "apiserver", "dra_withdrawal": "apiserver", "steady_state": "apiserver",
                   "process_kube": "apiserver", "stuck_unhealthy": "nvml_stuck", "stuck_served": "nvml_stuck",
                   "stuck_sigterm": "nvml_stuck", "stuck_taint": "nvml_stuck", "stuck_restart": "nvml_stuck",
                   "stuck_apiserver": "nvml_stuck"}
"""Details kept under a name other than their section's."""


def _section_of_figure(key: str) -> str:
    return FIGURE_SECTIONS.get(key.split(".")[0], "cluster")


def _section_of_detail(key: str) -> str:
    name = key.split("/")[0]
    return DETAIL_SECTIONS.get(name, name)


def merge(base: dict[str, Any], partial: dict[str, Any], sections: frozenset[str]) -> dict[str, Any]:
    """`base` (a full run's results) with the figures and details of `sections` replaced by those of `partial`
    (a run of those sections alone), and the partial run recorded under "remeasured"."""
    order = {name: i for i, name in enumerate((*SECTIONS, "cluster"))}

    def place(row: dict[str, Any]) -> tuple[int, int]:  # the API-client process rows follow the --no-kube ones
        if row["id"].startswith("process_kube."):
            return order["process"], 1
        return order[_section_of_figure(row["id"])], 0

    kept = [row for row in base["figures"] if _section_of_figure(row["id"]) not in sections]
    figures = sorted(kept + partial["figures"], key=place)
    details = {key: value for key, value in base["details"].items()
               if key == "sections" or _section_of_detail(key) not in sections}
    details |= {key: value for key, value in partial["details"].items()
                if key != "sections" and _section_of_detail(key) in sections}
    details["sections"] = {key: value for key, value in base["details"]["sections"].items()
                           if _section_of_detail(key) not in sections} | partial["details"]["sections"]
    remeasured = [r | {"sections": [name for name in r["sections"] if name not in sections]}
                  for r in base.get("remeasured", [])]
    remeasured = [r for r in remeasured if r["sections"]]  # an earlier run whose every section was measured again
    kept_keys = ("generated_by", "date", "duration_s", "seed", "plan", "machine")
    remeasured.append({key: partial[key] for key in kept_keys}
                      | {"sections": [name for name in ONLY_CHOICES if name in sections]})
    return base | {"figures": figures, "details": details, "remeasured": remeasured,
                   "passed": all(f["verdict"] != "fail" for f in figures)}


async def measure(plan: Plan, seed: int, workdir: Path,
                  only: frozenset[str] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    def want(name: str) -> bool:
        return only is None or name in only

    figures: list[dict[str, Any]] = []
    details: dict[str, Any] = {"preferred": {}, "allocate": {}, "many_devices": {}}
    section = Sections()
    details["sections"] = section.record

    if want("preferred"):
        for preset in PREFERRED_PRESETS:
            started = time.monotonic()
            with section(f"preferred/{preset}"):
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

    if want("allocate"):
        for preset in ALLOCATE_PRESETS:
            with section(f"allocate/{preset}"):
                result = await grpc_bench.allocate(preset, plan.allocate_calls, _rng(seed, f"allocate/{preset}"))
            details["allocate"][preset] = result
            where = f"{result['gpus']} GPUs ({preset})"
            figures += [
                figure(f"allocate.{preset}.p50", f"Allocate p50, {where}", result["p50_ms"], "ms"),
                figure(f"allocate.{preset}.p99", f"Allocate p99, {where}", result["p99_ms"], "ms", "<",
                       ALLOCATE_P99_MS),
            ]
            print(f"Allocate {preset}: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms over {result['calls']} "
                  "calls", flush=True)

    if want("many_clients"):
        print(f"{CLIENTS} clients at once, {CLIENT_RATE:g} calls a second each, {plan.clients_seconds:.0f} s per "
              f"call, then back to back for {plan.clients_back_to_back_seconds:.0f} s ...", flush=True)
        with section("many_clients"):
            crowd = await grpc_bench.many_clients(CLIENTS_PRESET, CLIENTS, CLIENT_RATE, plan.clients_seconds,
                                                  _rng(seed, "many_clients"), plan.clients_back_to_back_seconds)
        details["many_clients"] = crowd
        runs = crowd["runs"]
        where = (f"{crowd['gpus']} GPUs ({CLIENTS_PRESET}), {CLIENTS} clients at once, {CLIENT_RATE:g} calls/s "
                 "each")
        rush = f"{crowd['gpus']} GPUs ({CLIENTS_PRESET}), {CLIENTS} clients calling back to back"
        paced_alloc, paced_pref = runs["paced.allocate"], runs["paced.preferred"]
        figures += [
            figure("clients.allocate.p50", f"Allocate p50, {where}", paced_alloc["p50_ms"], "ms"),
            figure("clients.allocate.p99", f"Allocate p99, {where}", paced_alloc["p99_ms"], "ms", "<",
                   ALLOCATE_P99_MS),
            figure("clients.preferred.p50", f"GetPreferredAllocation p50, {where}", paced_pref["p50_ms"], "ms"),
            figure("clients.preferred.p99", f"GetPreferredAllocation p99, {where}", paced_pref["p99_ms"], "ms", "<",
                   PREFERRED_P99_MS),
            figure("clients.allocate.cpu", f"Agent CPU per Allocate call, {where}",
                   paced_alloc["agent_cpu_ms_per_call"], "ms", "report"),
        ]
        for method, name in (("allocate", "Allocate"), ("preferred", "GetPreferredAllocation")):
            rushed = runs.get(f"back_to_back.{method}")
            if rushed is not None:
                figures.append(figure(f"clients.back_to_back.{method}.p99", f"{name} p99, {rush}",
                                      rushed["p99_ms"], "ms", "report"))
        print(f"{CLIENTS} clients: " + "; ".join(
            f"{key} p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, {r['calls_per_s']} calls/s, at most "
            f"{r['max_in_flight']} in flight" for key, r in runs.items()), flush=True)

    if want("many_devices"):
        many = {
            "mig": (MIG_PRESET, MIG_RESOURCE, MIG_CONFIG, f"MIG devices ({MIG_PRESET}, {MIG_LAYOUT}, {MIG_RESOURCE})"),
            "replicas": (REPLICA_PRESET, REPLICA_RESOURCE, REPLICA_CONFIG,
                         f"time-sliced replicas ({REPLICA_PRESET}, {REPLICAS} per GPU, {REPLICA_RESOURCE})"),
        }
        for key, (preset, resource, text, what) in many.items():
            started = time.monotonic()
            with section(f"many_devices/{key}"):
                fake = mig_bench.carved(preset, MIG_LAYOUT) if key == "mig" else None
                result = await grpc_bench.many_devices(
                    preset, resource, parse_config(text, f"bench {key} config"), plan.many_preferred_calls,
                    plan.many_allocate_calls, _rng(seed, f"many_devices/{key}"), fake=fake,
                )
            result["config"] = text
            if key == "mig":
                result["layout"] = MIG_LAYOUT
            details["many_devices"][key] = result
            where = f"{result['devices']} {what}"
            pref, alloc = result["preferred"], result["allocate"]
            figures += [
                figure(f"many.{key}.preferred.p50", f"GetPreferredAllocation p50, {where}", pref["p50_ms"], "ms"),
                figure(f"many.{key}.preferred.p99", f"GetPreferredAllocation p99, {where}", pref["p99_ms"], "ms",
                       "<", PREFERRED_P99_MS),
                figure(f"many.{key}.allocate.p50", f"Allocate p50, {where}", alloc["p50_ms"], "ms"),
                figure(f"many.{key}.allocate.p99", f"Allocate p99, {where}", alloc["p99_ms"], "ms",
                       "<", ALLOCATE_P99_MS),
            ]
            print(f"{result['devices']} {what}: GetPreferredAllocation p50 {pref['p50_ms']} ms, "
                  f"p99 {pref['p99_ms']} ms "
                  f"({pref['valid_answers']}/{pref['calls']} answers valid); Allocate p50 {alloc['p50_ms']} ms, "
                  f"p99 {alloc['p99_ms']} ms ({time.monotonic() - started:.0f} s)", flush=True)

    if want("health"):
        with section("health"):
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

    if want("telemetry"):
        with section("telemetry"):
            tele = await telemetry_bench.telemetry(TELEMETRY_PRESET, plan.telemetry_passes, plan.telemetry_scrapes)
        details["telemetry"] = tele
        where = f"{tele['gpus']} GPUs ({TELEMETRY_PRESET}), {tele['held_gpus']} held by a pod"
        figures += [
            figure("telemetry.nvml_calls", f"NVML calls per telemetry pass, {where}", tele["nvml_calls_per_pass"],
                   "calls", "report"),
            figure("telemetry.pass.wall_p50",
                   f"Telemetry pass p50 (NVML thread shared with the health monitor), {where}",
                   tele["pass"]["p50_ms"], "ms", "report"),
            figure("telemetry.pass.cpu_p99", f"Telemetry pass CPU time p99, {where}", tele["pass"]["cpu_p99_ms"], "ms",
                   "<", TELEMETRY_PASS_CPU_MS),
            figure("telemetry.scrape.p99",
                   f"/metrics scrape p99 with DCGM_FI_* on ({tele['dcgm_series']} series), {where}",
                   tele["scrape_dcgm_on"]["p99_ms"], "ms", "<", SCRAPE_P99_MS),
            figure("telemetry.scrape_off.p99", f"/metrics scrape p99 with DCGM_FI_* off, {where}",
                   tele["scrape_dcgm_off"]["p99_ms"], "ms", "report"),
        ]
        print(f"telemetry: {tele['nvml_calls_per_pass']} NVML calls per pass, pass p50 {tele['pass']['p50_ms']} ms "
              f"(CPU p99 {tele['pass']['cpu_p99_ms']} ms); scrape p99 {tele['scrape_dcgm_on']['p99_ms']} ms with "
              f"DCGM_FI_* on, {tele['scrape_dcgm_off']['p99_ms']} ms off", flush=True)

    if want("mig_apply"):
        with section("mig_apply"):
            apply = mig_bench.apply_overhead(APPLY_PRESET, APPLY_LAYOUT, APPLY_FROM, plan.mig_apply_runs)
        details["mig_apply"] = apply
        where = f"{APPLY_LAYOUT} from {APPLY_FROM}, {apply['gpus']} GPUs ({APPLY_PRESET}), p50 of {apply['runs']} runs"
        figures += [
            figure("mig_apply.total", f"MIG apply, total, {where}", apply["total_p50_ms"], "ms", "report"),
            figure("mig_apply.inside_nvml", f"MIG apply, inside NVML calls, {where}", apply["inside_nvml_p50_ms"],
                   "ms", "report"),
            figure("mig_apply.agent", f"MIG apply, total minus inside NVML (agent overhead), {where}",
                   apply["agent_p50_ms"], "ms", "report"),
        ]
        print(f"MIG apply {APPLY_LAYOUT}: p50 total {apply['total_p50_ms']} ms, "
              f"inside NVML {apply['inside_nvml_p50_ms']} "
              f"ms, agent {apply['agent_p50_ms']} ms over {apply['runs']} runs ({apply['nvml_calls_per_apply']} NVML "
              "calls each)", flush=True)

    if want("floor"):
        print(f"Allocate against the floor: {plan.floor_rounds} rounds of {plan.floor_calls} calls per server and "
              "method ...", flush=True)
        with section("floor"):
            floor = await grpc_bench.allocate_floor(FLOOR_PRESET, plan.floor_rounds, plan.floor_calls,
                                                    _rng(seed, "floor"))
        details["floor"] = floor
        alloc, pref = floor["ratios"]["allocate"], floor["ratios"]["preferred"]
        agent_cpu = floor["pooled"]["allocate"]["agent"]["server_cpu_ms_per_call"]
        where = f"{floor['devices']} GPUs ({FLOOR_PRESET}), Go client, {floor['rounds']} x {floor['calls']} calls"
        figures += [
            figure("floor.allocate.p99_ratio", f"Allocate p99, agent / Go floor, {where}", alloc["p99_vs_go"], "x",
                   "report"),
            figure("floor.allocate.p50_ratio", f"Allocate p50, agent / empty Python server, {where}",
                   alloc["p50_vs_python"], "x", "report"),
            figure("floor.allocate.cpu", f"Agent CPU per Allocate call (its process's utime + stime), {where}",
                   agent_cpu, "ms", "report"),
            figure("floor.preferred.p99_ratio", f"GetPreferredAllocation p99, agent / Go floor, {where}",
                   pref["p99_vs_go"], "x", "report"),
            figure("floor.preferred.p50_ratio", f"GetPreferredAllocation p50, agent / empty Python server, {where}",
                   pref["p50_vs_python"], "x", "report"),
        ]
        print(f"Allocate against the floor: agent p99 {alloc['p99_vs_go']}x the Go floor's, p50 "
              f"{alloc['p50_vs_python']}x the empty Python server's, {agent_cpu} ms agent CPU per call; "
              f"GetPreferredAllocation {pref['p99_vs_go']}x and {pref['p50_vs_python']}x", flush=True)

    if want("process"):
        print(f"agent process: {plan.process_allocations} Allocate calls, then {plan.idle_s:.0f} s idle ...",
              flush=True)
        with section("process"):
            process = await grpc_bench.agent_process(
                PROCESS_PRESET, plan.process_allocations, plan.idle_s, _rng(seed, "process")
            )
        details["process"] = process
        calls = process["allocate"]["allocations"]
        where = f"gpu-agent process --no-kube, {process['gpus']} GPUs ({PROCESS_PRESET})"
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
    process_rows = len(figures)  # where the API-client process rows go

    if want("apiserver"):
        apiserver.ensure_testbin()
        started = time.monotonic()
        with apiserver.running(workdir / "apiserver", nodes=(RIG_NODE, DRA_NODE)) as rig:
            kubeconfig = rig.kubeconfig_path
            details["apiserver"] = {"versions": apiserver.pinned_versions(), "node": RIG_NODE,
                                    "start_s": round(time.monotonic() - started, 1)}
            print(f"kube-apiserver and etcd up ({details['apiserver']['start_s']:.0f} s); XID {kube_bench.XID} to "
                  f"taint, {plan.taint_injections} injections ...", flush=True)
            with section("taint"):
                taint = await kube_bench.xid_to_taint(kubeconfig, RIG_NODE, TAINT_PRESET, plan.taint_injections,
                                                      _rng(seed, "taint"))
            details["taint"] = taint
            label = f"XID {taint['xid']} to the agent's taint on its Node in kube-apiserver ({TAINT_PRESET})"
            figures += [
                figure("taint.p50", f"{label}, p50", taint["p50_ms"], "ms"),
                figure("taint.p99", f"{label}, p99", taint["p99_ms"], "ms", "<", TAINT_MS),
                figure("taint.max", f"{label}, max", taint["max_ms"], "ms", "<", TAINT_MS),
            ]
            print(f"XID to taint: p50 {taint['p50_ms']} ms, p99 {taint['p99_ms']} ms, max {taint['max_ms']} ms over "
                  f"{taint['calls']} injections; DRA mode, XID {dra_bench.XID} to the slice ...", flush=True)

            with section("dra_withdrawal"):
                withdrawal = await dra_bench.xid_to_withdrawal(kubeconfig, DRA_NODE, DRA_PRESET,
                                                               plan.taint_injections, _rng(seed, "dra"))
            details["dra_withdrawal"] = withdrawal
            label = (f"DRA mode: XID {withdrawal['xid']} to the GPU out of what the agent's ResourceSlice offers "
                     f"in kube-apiserver (withdrawn, or tainted where the server keeps device taints; {DRA_PRESET})")
            figures += [
                figure("dra.withdrawal.p50", f"{label}, p50", withdrawal["p50_ms"], "ms"),
                figure("dra.withdrawal.p99", f"{label}, p99", withdrawal["p99_ms"], "ms", "<", TAINT_MS),
                figure("dra.withdrawal.max", f"{label}, max", withdrawal["max_ms"], "ms", "<", TAINT_MS),
            ]
            print(f"DRA XID to the GPU out of the slice: p50 {withdrawal['p50_ms']} ms, p99 {withdrawal['p99_ms']} ms, max "
                  f"{withdrawal['max_ms']} ms over {withdrawal['calls']} injections; {plan.steady_state_s:.0f} s of "
                  "steady state ...", flush=True)

            with section("steady_state"):
                steady = await kube_bench.steady_state(kubeconfig, RIG_NODE, STEADY_PRESET, plan.steady_state_s)
            details["steady_state"] = steady
            where = f"{steady['window_s']:.0f} s after the agent converged its Node ({STEADY_PRESET})"
            figures += [
                figure("steady.writes", f"API writes by the agent, {where}", steady["agent_writes"], "writes", "==", 0),
                figure("steady.node_updates", f"Node updates seen on a watch, {where}", steady["node_updates_seen"],
                       "updates", "==", 0),
            ]
            print(f"steady state: {steady['agent_writes']} agent writes, {steady['node_updates_seen']} node updates, "
                  f"resourceVersion {steady['resource_version_before']} -> {steady['resource_version_after']} over "
                  f"{steady['window_s']:.0f} s", flush=True)

            print(f"agent process with the API client: {plan.process_allocations} Allocate calls, then "
                  f"{plan.idle_s:.0f} s idle ...", flush=True)

            async def converged() -> None:
                await kube_bench.wait_condition_written(kubeconfig, RIG_NODE)

            with section("process_kube"):
                await kube_bench.reset_condition(kubeconfig, RIG_NODE)
                kube_process = await grpc_bench.agent_process(
                    PROCESS_PRESET, plan.process_allocations, plan.idle_s, _rng(seed, "process"),
                    grpc_bench.ApiTarget(kubeconfig, RIG_NODE, converged),
                )
        details["process_kube"] = kube_process
        calls = kube_process["allocate"]["allocations"]
        where = (f"gpu-agent process with the API client (kube-apiserver), {kube_process['gpus']} GPUs "
                 f"({PROCESS_PRESET})")
        # Next to the --no-kube rows, so the page shows the two side by side.
        figures[process_rows:process_rows] = [
            figure("process_kube.rss.start", f"RSS after start and converging the Node, {where}",
                   round(kube_process["rss_after_start_bytes"] / MB, 1), "MB", "<", RSS_MB),
            figure("process_kube.rss.allocations", f"RSS after {calls:,} Allocate calls, {where}",
                   round(kube_process["rss_after_allocations_bytes"] / MB, 1), "MB", "<", RSS_MB),
            figure("process_kube.idle_cpu", f"Idle CPU over {kube_process['idle']['wall_s']:.0f} s, {where}",
                   kube_process["idle"]["cpu_percent_of_core"], "% of a core", "<", IDLE_CPU_PERCENT),
        ]
        print(f"agent process with the API client: RSS {kube_process['rss_after_start_bytes'] / MB:.1f} MB after "
              "start, "
              f"{kube_process['rss_after_allocations_bytes'] / MB:.1f} MB after {calls} Allocate calls; idle CPU "
              f"{kube_process['idle']['cpu_percent_of_core']} % of a core", flush=True)

    if want("nvml_stuck"):
        figures += await _nvml_stuck(plan, seed, workdir, section, details)
    return figures, details


async def _nvml_stuck(plan: Plan, seed: int, workdir: Path, section: Sections,
                      details: dict[str, Any]) -> list[dict[str, Any]]:
    """A driver that stops answering (health.nvmlDeadlineSeconds 2 s) and a GPU lost through a restart."""
    deadline_ms = stuck_bench.DEADLINE_S * 1000
    where = f"{stuck_bench.PRESET}, deadline {stuck_bench.DEADLINE_S:g} s"
    print(f"NVML stuck: {plan.stuck_runs} hung GPUs to Unhealthy ...", flush=True)
    with section("stuck_unhealthy"):
        unhealthy = await stuck_bench.stuck_to_unhealthy(plan.stuck_runs, _rng(seed, "stuck_unhealthy"))
    details["stuck_unhealthy"] = unhealthy
    with section("stuck_served"):
        served = await stuck_bench.served_while_stuck(plan.stuck_calls, _rng(seed, "stuck_served"))
    details["stuck_served"] = served
    with section("stuck_sigterm"):
        sigterm = await stuck_bench.sigterm_while_stuck(plan.stuck_sigterm_runs, workdir)
    details["stuck_sigterm"] = sigterm
    apiserver.ensure_testbin()
    with apiserver.running(workdir / "apiserver-stuck", nodes=(STUCK_NODE,)) as rig:
        details["stuck_apiserver"] = {"versions": apiserver.pinned_versions(), "node": STUCK_NODE}
        with section("stuck_taint"):
            taint = await stuck_bench.stuck_to_taint(rig.kubeconfig_path, STUCK_NODE, plan.stuck_runs,
                                                     _rng(seed, "stuck_taint"))
        details["stuck_taint"] = taint
        with section("stuck_restart"):
            restart = await stuck_bench.restart_with_a_lost_gpu(rig.kubeconfig_path, STUCK_NODE,
                                                                plan.stuck_restart_runs, workdir)
        details["stuck_restart"] = restart
    answering, stuck = served["answering"], served["stuck"]
    ratio = {m: round(stuck[m]["p99_ms"] / answering[m]["p99_ms"], 2) for m in ("allocate", "preferred")}
    figures = [
        figure("stuck.unhealthy.max", f"A GPU's NVML call hung to the GPU Unhealthy in ListAndWatch, max ({where})",
               unhealthy["max_ms"], "ms", "<", deadline_ms + 2000),
        figure("stuck.taint.max", f"A GPU's NVML call hung to the agent's taint on its Node in kube-apiserver, max "
               f"({where})", taint["max_ms"], "ms", "<", deadline_ms + 3000),
        figure("stuck.allocate.p99", f"Allocate p99 with NVML stuck on GPU 7 past its deadline ({where})",
               stuck["allocate"]["p99_ms"], "ms", "<", ALLOCATE_P99_MS),
        figure("stuck.allocate.ratio", "Allocate p99 with NVML stuck over its p99 with NVML answering (the same "
               "agent)", ratio["allocate"], "x", "<=", STUCK_RATIO),
        figure("stuck.preferred.p99", f"GetPreferredAllocation p99 with NVML stuck on GPU 7 ({where})",
               stuck["preferred"]["p99_ms"], "ms", "<", PREFERRED_P99_MS),
        figure("stuck.preferred.ratio", "GetPreferredAllocation p99 with NVML stuck over its p99 with NVML "
               "answering (the same agent)", ratio["preferred"], "x", "<=", STUCK_RATIO),
        figure("stuck.metrics.max", f"/metrics with NVML stuck, max of {stuck['metrics']['calls']}",
               stuck["metrics"]["max_ms"], "ms", "<", ENDPOINT_MS),
        figure("stuck.healthz.max", f"/healthz with NVML stuck, max of {stuck['healthz']['calls']}",
               stuck["healthz"]["max_ms"], "ms", "<", ENDPOINT_MS),
        figure("stuck.sigterm.max", f"SIGTERM to exit with the driver hung, max of {sigterm['calls']} gpu-agent "
               "processes", sigterm["max_ms"], "ms", "<", SIGTERM_MS),
        figure("stuck.restart.untainted", f"Node versions without the agent's taint while an agent restarts with a "
               f"GPU lost ({restart['runs']} restarts, {restart['node_versions']} versions)",
               restart["untainted_versions"], "versions", "==", 0),
    ]
    print(f"NVML stuck: to Unhealthy max {unhealthy['max_ms']} ms, to the taint max {taint['max_ms']} ms; Allocate "
          f"p99 {answering['allocate']['p99_ms']} -> {stuck['allocate']['p99_ms']} ms, GetPreferredAllocation p99 "
          f"{answering['preferred']['p99_ms']} -> {stuck['preferred']['p99_ms']} ms; /metrics max "
          f"{stuck['metrics']['max_ms']} ms; SIGTERM max {sigterm['max_ms']} ms (exit {sigterm['exit_codes']}); "
          f"{restart['untainted_versions']} of {restart['node_versions']} Node versions untainted through "
          f"{restart['runs']} restarts with a lost GPU", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and a 10 s idle window")
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when a figure misses its budget")
    parser.add_argument("--no-cluster", action="store_true",
                        help="leave out the figures on a real single-node cluster (they need root)")
    parser.add_argument("--only", metavar="SECTION[,SECTION...]",
                        help=f"measure only these sections ({', '.join(ONLY_CHOICES)}; the cluster only when named): "
                             "the figures are printed and written to --out (default bench/out/only.json), never to "
                             "--doc")
    parser.add_argument("--merge", action="store_true",
                        help="with --only (not --quick): replace those sections in bench/results.json and render "
                             "--doc from it")
    args = parser.parse_args()
    if args.merge and (args.only is None or args.quick):
        parser.error("--merge: only with --only, and not with --quick (a quick run's figures stay off the page)")
    only = None
    if args.only is not None:
        only = frozenset(name.strip() for name in args.only.split(",") if name.strip())
        unknown = sorted(only - set(ONLY_CHOICES))
        if unknown or not only:
            parser.error(f"--only: unknown section(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(ONLY_CHOICES)}")
        if args.out == ROOT / "bench" / "results.json":
            args.out = ROOT / "bench" / "out" / "only.json"

    plan = QUICK if args.quick else FULL
    facts = machine()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-agent-bench-") as tmp, grpc_bench.quiet_logs(Path(tmp) / "agent.log"):
        figures, details = asyncio.run(measure(plan, args.seed, Path(tmp), only))
    if only is not None and "cluster" not in only:
        print(f"single-node cluster: not measured (--only {args.only})", flush=True)
    elif args.no_cluster:
        print("single-node cluster: not measured (--no-cluster)", flush=True)
    else:
        runs = 2 if args.quick else 5
        print(f"single-node cluster (hack/cluster, needs root): {runs} runs of apply, kubelet restart and a GPU "
              "pod ...", flush=True)
        load = [round(x, 2) for x in os.getloadavg()]
        details["cluster"] = cluster_bench.measure(runs)
        details["sections"]["cluster"] = {"load_average_at_start": load,
                                          "duration_s": details["cluster"]["duration_s"]}
        figures += cluster_bench.figures(details["cluster"], figure)
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results = {
        "generated_by": "bench/run.py" + (" --quick" if args.quick else "") + (f" --only {args.only}" if only else ""),
        "mode": "quick" if args.quick else "full",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "seed": args.seed,
        "plan": asdict(plan),
        "constants": {
            "warmup_calls": grpc_bench.WARMUP_CALLS,
            "inject_phase_s": grpc_bench.INJECT_PHASE_S,
            "settle_s": grpc_bench.SETTLE_S,
            "event_wait_ms": kube_bench.EVENT_WAIT_MS,
            "floor_warmup_calls": grpc_bench.FLOOR_WARMUP,
        },
        "machine": facts,
        "figures": figures,
        "passed": all(f["verdict"] != "fail" for f in figures),
        "details": details,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    written = str(args.out)
    page = results
    if only is not None and args.merge:
        page = merge(json.loads(RESULTS.read_text()), results, only)
        RESULTS.write_text(json.dumps(page, indent=2) + "\n")
        written += f", {RESULTS}"
    if only is None or args.merge:
        args.doc.parent.mkdir(parents=True, exist_ok=True)
        args.doc.write_text(
            report.render(page, report.load(report.FLEET), report.load(report.INPUT_COST),
                          report.load(report.IMAGE)))
        written += f" and {args.doc}"
    failed = [f["figure"] for f in figures if f["verdict"] == "fail"]
    print(f"{len(figures)} figures, {len(failed)} over budget; written to {written} ({results['duration_s']:.0f} s)")
    for name in failed:
        print(f"  over budget: {name}")
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
