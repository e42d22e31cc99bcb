"""Renders docs/benchmarks.md from bench/results.json, and from bench/fleet.json (bench/fleet.py) and
bench/input_cost.json (bench/input_cost.py) where they exist; every number on the page comes from those files.

Usage: python bench/report.py [bench/results.json] [docs/benchmarks.md]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "bench" / "fleet.json"
INPUT_COST = ROOT / "bench" / "input_cost.json"
IMAGE = ROOT / "bench" / "image.json"


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
    if budget == "report":
        return "report"
    op = {"<": "<", "<=": "≤", "==": "=", ">=": "≥"}[budget["op"]]
    return f"{op} {budget['limit']:g} {row['unit']}"


def _figures(results: dict[str, Any]) -> list[str]:
    lines = ["| figure | value | budget | verdict |", "|---|---:|---:|---|"]
    for row in results["figures"]:
        verdict = {"pass": "pass", "fail": "**FAIL**", "info": "—", "report": "reported"}[row["verdict"]]
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
    for m in details["many_devices"].values():
        where = f"{m['devices']} {m['resource']} ({m['preset']})"
        series += [(f"GetPreferredAllocation, {where}", m["preferred"]), (f"Allocate, {where}", m["allocate"])]
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


def _many_devices(many: dict[str, Any]) -> list[str]:
    columns = [(f"{m['devices']} {m['resource']}", kind, m[kind]) for m in many.values()
               for kind in ("preferred", "allocate")]
    buckets: list[str] = []
    for _, _, series in columns:
        buckets += [b for b in series["by_size"] if b not in buckets]
    call = {"preferred": "GetPreferredAllocation", "allocate": "Allocate"}
    lines = [
        "| request size | " + " | ".join(f"{call[kind]}, {where}" for where, kind, _ in columns) + " |",
        "|---:|" + "---:|" * len(columns),
    ]
    for bucket in sorted(buckets, key=lambda b: int(b.split("-")[0])):
        cells = []
        for _, _, series in columns:
            row = series["by_size"].get(bucket)
            cells.append("" if row is None else f"{row['p50_ms']:.3f} / {row['p99_ms']:.3f} ({row['calls']})")
        lines.append(f"| {bucket} | " + " | ".join(cells) + " |")
    return lines


def _mig_apply(apply: dict[str, Any]) -> list[str]:
    lines = [
        "| part | p50 | max | runs |",
        "|---|---:|---:|---:|",
    ]
    for label, key in (("total", "total"), ("inside NVML calls", "inside_nvml"),
                       ("total minus inside NVML (agent)", "agent")):
        r = apply[key]
        lines.append(f"| {label} | {r['p50_ms']:.3f} ms | {r['max_ms']:.3f} ms | {r['calls']} |")
    return lines


def _apiserver(details: dict[str, Any]) -> list[str]:
    taint, steady, rig = details["taint"], details["steady_state"], details["apiserver"]
    samples = ", ".join(f"{ms:.1f}" for ms in sorted(taint["samples_ms"]))
    versions = ", ".join(f"{name} {version}" for name, version in rig["versions"].items())
    return [
        f"A real etcd and kube-apiserver ({versions}) on loopback, built by `hack/testbin.sh`, with one Node "
        f"`{rig['node']}`; started in {rig['start_s']:.0f} s.",
        "",
        f"- **XID {taint['xid']} to taint** (`{taint['taint']}`), {taint['calls']} injections, one fresh agent "
        f"each, sorted, in ms: {samples}.",
        *([f"- **DRA mode: XID {w['xid']} to the GPU withdrawn from the slice**, {w['calls']} injections on one "
           f"agent, sorted, in ms: {', '.join(f'{ms:.1f}' for ms in sorted(w['samples_ms']))}."]
          if (w := details.get("dra_withdrawal")) else []),
        f"- **Steady state.** A fresh agent made {steady['agent_writes_to_converge']} write(s) to converge the "
        f"Node, then {steady['agent_writes']} in {steady['window_s']:.0f} s; the benchmark's watch saw "
        f"{steady['node_updates_seen']} Node update(s); resourceVersion {steady['resource_version_before']} "
        f"before and {steady['resource_version_after']} after. In that window the agent read its Node "
        f"{steady['agent_node_reads']['get']} time(s), opened {steady['agent_node_reads']['watch']} new "
        f"watch(es) and counted {steady['agent_api_errors']} failed API request(s) "
        "(`gpu_agent_api_errors_total`).",
    ]


def _cluster(details: dict[str, Any]) -> list[str]:
    """The single-node cluster section (bench/cluster_bench.py), when the run had one."""
    c = details.get("cluster")
    if not c:
        return []

    def series(s: dict[str, Any]) -> str:
        return f"median {s['median_s']:.2f} s, max {s['max_s']:.2f} s ({', '.join(f'{x:.2f}' for x in s['samples_s'])})"

    return [
        "## On a real single-node cluster",
        "",
        f"`hack/cluster/up.sh` without the agent ({c['cluster_up_without_agent_s']:.0f} s): etcd, kube-apiserver, "
        "kube-controller-manager, kube-scheduler, containerd and a kubelet "
        f"{c.get('kubelet_version', 'of the test rig release')} in their own network namespace; "
        f"the agent's image built from the Dockerfile, on the fake NVML of {c['preset']}; {c['runs']} runs each, "
        "times from the benchmark's own clock, polling every 50 ms.",
        "",
        f"- **DaemonSet applied -> Allocatable 8** on the Node (`kubectl apply --server-side -k`, the kubelet had no "
        f"agent before): {series(c['apply_to_allocatable'])}.",
        f"- **kubelet restart -> agent registered again** (the kubelet's log): "
        f"{series(c['kubelet_restart']['registered'])}; **-> Allocatable 8 on the Node**: "
        f"{series(c['kubelet_restart']['allocatable'])}.",
        f"- **2-GPU pod created -> Allocate answered** (the agent's `gpu_agent_allocations_total`): "
        f"{series(c['pod_to_allocate']['allocate_answered'])}; **-> pod Running**: "
        f"{series(c['pod_to_allocate']['running'])}.",
        *_burst(c.get("burst")),
        "",
    ]


def _burst(b: dict[str, Any] | None) -> list[str]:
    """The 50-pod burst's line, when the run had one."""
    if not b:
        return []

    def spread(s: dict[str, Any]) -> str:
        return f"p50 {s['p50_s']:.2f} s, p99 {s['p99_s']:.2f} s, max {s['max_s']:.2f} s"

    return [
        f"- **A burst of {b['pods']} single-GPU pods** created by one request on the node shared by time-slicing "
        f"({b['replicas_per_gpu']} replicas per GPU): each pod created -> **Allocate answered** "
        f"{spread(b['allocate_answered'])}; -> **pod Running** {spread(b['running'])} (one look at the counter and "
        f"the pods took {b['poll_s']:.2f} s, median: the figures are no finer).",
    ]


def _fleet(fleet: dict[str, Any] | None) -> list[str]:
    """The fleet section (bench/fleet.py), when bench/fleet.json exists."""
    if not fleet:
        return []
    failed = sum(row["verdict"] == "fail" for row in fleet["figures"])
    budgeted = sum(row["verdict"] in ("pass", "fail") for row in fleet["figures"])
    verdict = f"All {budgeted} budgets met." if not failed else f"**{failed} of {budgeted} budgets missed.**"
    lines = [
        "## A fleet against one API server",
        "",
        f"`{fleet['generated_by']}` on {fleet['date']}, {fleet['duration_s']:.0f} s, {fleet['machine']['nproc']} "
        f"CPUs. {verdict} N real `gpu-agent run` processes (fake NVML, each its own Node, ServiceAccount and "
        "directories, no kubelet) against one real kube-apiserver and etcd on loopback; every request counted on "
        "the API server's side, from its audit log of the agents' ServiceAccounts. What the figures mean for "
        "a large cluster: [scale.md](scale.md).",
        "",
        *_figures(fleet),
        "",
    ]
    for run in fleet["details"]:
        versions = ", ".join(f"{name} {version}" for name, version in run["versions"].items())
        lines += [f"**{run['mode']} mode, {run['agents']} agents** ({versions}; {run['duration_s']:.0f} s; audit "
                  f"log {run['audit_log_bytes'] / 1e6:.1f} MB). Requests by verb, resource and answer code:", ""]
        lines += ["| phase | requests | by verb, resource and code |", "|---|---:|---|"]
        for phase in ("steady", "apiserver_restart", "agents_restart", "outage"):
            tally = run[phase]
            kinds = ", ".join(f"{kind}: {n}" for kind, n in tally["by_verb_resource_code"].items()) or "none"
            lines.append(f"| {phase.replace('_', ' ')} ({tally['window_s']:.0f} s) | {tally['requests']} | {kinds} |")
        lines.append("")
    return lines


def _input_cost(cost: dict[str, Any] | None) -> list[str]:
    """The input-cost section (bench/input_cost.py), when bench/input_cost.json exists."""
    if not cost:
        return []
    b, summary = cost["budget"], cost["summary"]
    worst_rss = max(cost["cases"], key=lambda row: row["extra_rss_mb"])
    worst_cpu = max(cost["cases"], key=lambda row: row["cpu_s"])
    lines = [
        "## Reading hostile input files",
        "",
        f"`bench/input_cost.py` over {summary['cases']} cases ({summary['duration_s']:.0f} s): every input file "
        f"the agent reads (config, MIG layouts, node file, mock state, kubeconfig), read in-process and through "
        f"the CLI that reads it, each case in a fresh process. Budget for any file up to its kind's size limit ("
        f"{', '.join(f'{kind} {limit:,} bytes' for kind, limit in b['limits_bytes'].items())}): at most "
        f"{b['extra_rss_mb']:g} MB of RSS and {b['cpu_s']:g} s of CPU above a normal read of a tiny "
        f"valid file, and a refusal of {b['refusal']}. "
        f"**{summary['over_budget']} case(s) over budget, {summary['not_one_line']} refusal(s) not one short "
        f"line.** Most extra RSS: {worst_rss['extra_rss_mb']:.1f} MB ({worst_rss['case']} / "
        f"{worst_rss['reader']}); most CPU: {worst_cpu['cpu_s']:.3f} s ({worst_cpu['case']} / "
        f"{worst_cpu['reader']}).",
        "",
        "| case | reader | bytes | extra RSS | CPU | budget | one line | outcome |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for row in cost["cases"]:
        where = re.sub(r"/tmp/(input-cost|ic)-\w+/", "", row["outcome"])  # the benchmark's own directories
        outcome = " ".join(where.split())[:90].replace("|", "\\|") or row["result"]
        lines.append(f"| {row['case']} | {row['reader']} | {row['size_bytes']:,} | {row['extra_rss_mb']:.1f} MB | "
                     f"{row['cpu_s']:.3f} s | {row['budget']} | {row['one_line']} | {outcome} |")
    lines.append("")
    return lines


def _image(image: dict[str, Any] | None) -> list[str]:
    """The multi-arch image section (bench/image.py), when bench/image.json exists."""
    if not image:
        return []
    m = image["machine"]
    load_end = ", ".join(f"{x:.2f}" for x in m["load_average_at_end"])

    def median(values: list[float]) -> str:
        ordered = sorted(values)
        mid = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                   + ordered[len(ordered) // 2]) / 2
        return f"{mid:.2f} s ({ordered[0]:.2f} to {ordered[-1]:.2f})"

    lines = [
        "## The image for arm64 and amd64",
        "",
        f"`{image['generated_by']}` on {image['date']}, {image['duration_s']:.0f} s, {m['nproc']} CPUs "
        f"({m['cpu_model']}), load average {load_end} at the end, revision `{image['revision']}`: the agent's "
        "image for linux/amd64 and linux/arm64 (`make image`: one OCI image index built from the `Dockerfile` on a "
        f"Debian bookworm base made for each architecture), the arm64 half run under qemu-user-static "
        f"{m['qemu_user_static']}. Reported, not budgeted: under emulation every instruction of the arm64 agent "
        "is translated, so its times say nothing of a Grace node's; they bound what `make test` waits for.",
        "",
        f"| platform | compressed (gzip layers, as a registry holds them) | unpacked | start to registration with "
        f"the kubelet's device manager, median ({image['runs']} runs) | `gpu-agent simulate --node "
        f"{image['preset']} --json`, median |",
        "|---|---|---|---|---|",
    ]
    for platform, p in sorted(image["platforms"].items()):
        native = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}.get(m["host"], m["host"])
        where = platform if platform == native else f"{platform}, under qemu"
        lines.append(f"| {where} | {p['compressed_bytes'] / 1e6:.1f} MB | {p['unpacked_bytes'] / 1e6:.1f} MB | "
                     f"{median(p['registration_s'])} | {median(p['simulate_s'])} |")
    lines += [
        "",
        "Start to registration is the kubelet harness's (tests/kubelet) own clock, from starting the image's agent "
        f"on a simulated {image['preset']} to its `nvidia.com/gpu` registering; the agent runs from the image's "
        "root filesystem with chroot, on a read-only copy as the DaemonSet keeps it.",
        "",
    ]
    return lines


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _sections(sections: dict[str, Any]) -> list[str]:
    lines = ["| section | load average at its start (1, 5, 15 min) | duration |", "|---|---|---:|"]
    for name, row in sections.items():
        load = ", ".join(str(x) for x in row["load_average_at_start"])
        lines.append(f"| {name} | {load} | {row['duration_s']:.0f} s |")
    return lines


def _method(results: dict[str, Any]) -> list[str]:
    plan, details, constants = results["plan"], results["details"], results["constants"]
    preferred = details["preferred"]
    checks = ", ".join(
        f"{name} {p['optimum']['checked']} of {p['calls']}" for name, p in preferred.items()
    )
    health, process, kube_process = details["health"], details["process"], details["process_kube"]
    many, apply, taint, steady = (details["many_devices"], details["mig_apply"], details["taint"],
                                  details["steady_state"])
    mig, replicas = many["mig"], many["replicas"]
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
        f"- **Many devices.** {mig['devices']} MIG devices: `{mig['preset']}` with the shipped layout "
        f"`{mig['layout']}` applied through the agent's own `apply_layout` on the fake before the agent starts, "
        f"config `flags.migStrategy: mixed`, resource `{mig['resource']}`. {replicas['devices']} replicas: "
        f"`{replicas['preset']}` with `sharing.timeSlicing` replicas on `{replicas['resource']}`. Each request's "
        f"size is drawn uniformly from 1..N (N = the device count), the same draw as the whole-GPU series, so "
        "most requests are far larger than a pod usually asks for; the table above splits the latency by "
        f"size. {mig['preferred']['calls']} GetPreferredAllocation calls (random available set of at least "
        "`size`, must-include devices in every fourth request of size 2 or more; each answer checked to be "
        f"`size` distinct offered devices with the must-include ones: {mig['preferred']['valid_answers']} of "
        f"{mig['preferred']['calls']} valid for MIG, {replicas['preferred']['valid_answers']} of "
        f"{replicas['preferred']['calls']} for replicas), then {mig['allocate']['calls']} Allocate calls, per "
        "resource, on one in-process agent each.",
        f"- **XID to ListAndWatch.** `FakeNvml.inject_xid(gpu, {health['xid']})` after a random "
        f"0-{constants['inject_phase_s'] * 1000:.0f} ms pause "
        f"(so injections land at every phase of the health monitor's {constants['event_wait_ms']} ms NVML event "
        "wait and its sampling), "
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
        f"- **Agent process with the API client.** The same, as `{kube_process['command']}` with the rig's "
        "admin kubeconfig, against the kube-apiserver below, the same requests in the same order. Before it "
        "starts, the benchmark sets the agent's `GPUHealthy` condition on the Node to Unknown; \"after start\" "
        f"is {constants['settle_s']:.0f} s after the agent has registered and written the condition back (its "
        f"Node read, watch and first convergence done). Peak `VmHWM` {kube_process['rss_peak_bytes'] / 1e6:.1f} "
        "MB. Its Node watch stays open while it idles.",
        f"- **MIG apply.** `apply_layout` of the shipped `{apply['layout']}` on `{apply['preset']}` "
        f"({apply['changes']} changes: MIG mode and instances), each run from `{apply['from']}` (applied untimed "
        f"before it), {apply['runs']} timed runs after one untimed pair, with the apply journal the MIG "
        "controller keeps (written and fsynced in a temporary directory). The backend's `lib` is replaced by a "
        "proxy that times every call of a pynvml function and sums the time inside them "
        f"({apply['nvml_calls_per_apply']:,} calls per apply); the agent's share is total minus that, per run, "
        "and each row is the p50 of the runs. On the fake, \"inside NVML\" is the fake's Python; on a real "
        "driver those calls take far longer, and the agent's share is what this figure isolates. It includes "
        f"the proxy's own cost, measured at {apply['proxy_cost_us_per_call']:.2f} µs per call "
        f"(about {apply['proxy_cost_ms_per_apply']:.1f} ms per apply).",
        f"- **XID to taint.** The agent runs in this process on the fake `{taint['preset']}` with `NodeApi` "
        "connected to the rig (admin kubeconfig) as the Node below. The benchmark follows the Node on its own "
        "watch (raw JSON lines, each stamped when it arrives, before parsing). Each injection starts a fresh "
        "agent (a node-fatal fault holds the taint until the GPU recovers), waits until the watch has "
        "delivered the version a GET returns after the agent converged and it carries no taint, pauses a "
        f"random 0-{constants['event_wait_ms']} ms, then calls `inject_xid(gpu, {taint['xid']})` on a random "
        f"GPU ({taint['xid']}: off the bus, node-fatal by the default policy) and times to the first Node "
        "version carrying the taint.",
        *(["- **DRA mode: XID to withdrawal.** One agent in DRA mode on the fake `dgx-h100`, its own Node, health "
        "sampled every 0.1 s (so that a reset GPU is healthy again quickly; the XID arrives as an NVML event "
        "either way). The benchmark follows the agent's ResourceSlice on its own watch; each injection "
        f"(`inject_xid(gpu, 48)`, a double-bit ECC error, on a random GPU after a random 0-"
        f"{constants['event_wait_ms']} ms pause) is timed to the first slice version without that GPU (the "
        "rig's API server drops device taints, so the GPU is withdrawn), then the GPU is reset and the next "
        "injection waits until the slice has it again."] if "dra_withdrawal" in details else []),
        f"- **Steady state.** A fresh agent (`{steady['preset']}`, default config) converges the Node; from "
        f"then on for {steady['window_s']:.0f} s the benchmark counts `NodeApi.writes` (every patch, condition "
        "and Event the agent sends) and the Node versions on its watch, and reads the resourceVersion before "
        "and after.",
        "- **Budgets.** GetPreferredAllocation p99 < 20 ms is set for 16 GPUs; the smaller nodes, the MIG "
        "devices and the replicas are held to it too, and so are 16 GPUs while 64 clients call at once (5 calls "
        "a second each). Allocate p99 < 2 ms, alone and while 64 clients call at once, health change to ListAndWatch "
        "< 100 ms (p99 and max), XID to taint < 1 s (p99 and max), in DRA mode XID to withdrawal < 1 s (p99 "
        "and max), no API write and no Node update in steady state, RSS < 100 MB (with and without the API "
        "client), idle CPU < 1 % of a core. Rows marked — are context without a budget; rows marked report were "
        "asked for as figures without a budget.",
        "- **Reproduce.** `make bench` runs `bench/allocator_bench.py` (the allocator alone, into "
        "`bench/out/`) and `bench/run.py`, which writes `bench/results.json` and this page; "
        "`python bench/report.py` re-renders the page from the JSON. `bench/run.py --quick` is a smoke run "
        "with fewer calls, a 10 s idle window and a 30 s steady state; `bench/run.py --only floor,many_devices` "
        "measures only those sections (any of preferred, allocate, many_clients, many_devices, health, telemetry, "
        "mig_apply, floor, process, apiserver, nvml_stuck) into `bench/out/only.json`, and onto this page only with "
        "`--merge`, "
        "which replaces those sections in `bench/results.json` and names them at the top. No test times anything; "
        "these figures come only from here.",
    ]


def _cpu_for(results: dict[str, Any], figure_id: str) -> tuple[float, float] | None:
    """(wall p99, CPU p99) in ms of the in-process series a latency figure comes from, where there is one."""
    details = results["details"]
    parts = figure_id.split(".")
    series: dict[str, Any] | None = None
    if parts[0] in ("allocate", "preferred") and len(parts) == 3:
        series = details[parts[0]].get(parts[1])
    elif parts[0] == "many" and len(parts) == 4:
        series = details["many_devices"].get(parts[1], {}).get(parts[2])
    if not series or "cpu_p99_ms" not in series:
        return None
    return series["p99_ms"], series["cpu_p99_ms"]


def _missed(results: dict[str, Any]) -> list[str]:
    """Each missed budget with what the run itself shows about it: the CPU time behind a latency, and the
    load on the machine when its section started."""
    failed = [row for row in results["figures"] if row["verdict"] == "fail"]
    if not failed:
        return []
    lines = ["## Budgets missed", "", "| figure | value | budget | what the run shows |", "|---|---:|---:|---|"]
    for row in failed:
        section = row["id"].split(".")[0]
        if section == "many":
            section = "many_devices/" + row["id"].split(".")[1]
        elif section in ("allocate", "preferred"):
            section = f"{section}/{row['id'].split('.')[1]}"
        load = results["details"]["sections"].get(section, {}).get("load_average_at_start")
        notes = []
        cpu = _cpu_for(results, row["id"])
        if cpu is not None:
            notes.append(f"CPU time p99 {cpu[1]:.3f} ms against wall p99 {cpu[0]:.3f} ms")
        if row["id"].startswith("process_kube.rss"):
            plain = next((r for r in results["figures"] if r["id"] == row["id"].replace("process_kube", "process")),
                         None)
            if plain is not None:
                notes.append(f"without the API client: {_number(plain['value'], plain['unit'])}")
        if load:
            notes.append(f"load average {load[0]} on {results['machine']['usable_cpus']} CPUs when the section began")
        lines.append(f"| {row['figure']} | {_number(row['value'], row['unit'])} | {_budget(row)} | "
                     f"{'; '.join(notes) or '—'} |")
    return [*lines, ""]


def _floor(results: dict[str, Any]) -> list[str]:
    """The Allocate floor section: the agent, the Go floor and the empty Python server in the same run."""
    floor = results["details"].get("floor")
    if floor is None:
        return []
    names = {"agent": "agent", "go": "Go floor", "python": "empty Python server"}
    calls = {"allocate": "Allocate", "preferred": "GetPreferredAllocation"}
    lines = [
        "## Allocate against the floor",
        "",
        "Pooled over the rounds, in ms; CPU is the server process's user + system time per call.",
        "",
        "| call | server | calls | p50 | p99 | max | server CPU per call |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for method, servers in floor["pooled"].items():
        for server, r in servers.items():
            lines.append(f"| {calls[method]} | {names[server]} | {r['calls']} | {r['p50_ms']:.3f} | "
                         f"{r['p99_ms']:.3f} | {r['max_ms']:.3f} | {r['server_cpu_ms_per_call']:.3f} |")
    lines += ["", "Ratios of the agent to the floors, pooled and round by round:", "",
              "| call | agent p99 / Go floor p99 | agent p50 / empty Python p50 | by round (p99 ratio, p50 ratio) |",
              "|---|---:|---:|---|"]
    for method, r in floor["ratios"].items():
        rounds = "; ".join(f"{x['round']}: {x['p99_vs_go']:.2f}, {x['p50_vs_python']:.2f}" for x in r["by_round"])
        lines.append(f"| {calls[method]} | {r['p99_vs_go']:.2f} | {r['p50_vs_python']:.2f} | {rounds} |")
    lines += ["", "Each server in each round and call, in the order they ran. The three took turns within one client "
              "run, so they share its load (the 1-minute load average at its start and end), other CPUs (what the "
              "rest of the machine used meanwhile: busy time in `/proc/stat` less the servers', the client's and "
              "the benchmark's own, divided by the run's wall time), client CPU (per call) and wall time.", "",
              "| round | call | server | p50 | p99 | max | server CPU | client CPU | load | other CPUs | wall |",
              "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for x in floor["series"]:
        lines.append(f"| {x['round']} | {calls[x['method']]} | {names[x['server']]} | {x['p50_ms']:.3f} | "
                     f"{x['p99_ms']:.3f} | {x['max_ms']:.3f} | {x['server_cpu_ms_per_call']:.3f} | "
                     f"{x['client_cpu_ms_per_call']:.3f} | {x['load_average_start']} to {x['load_average_end']} | "
                     f"{x['other_cpus']:.2f} | {x['wall_s']:.1f} s |")
    lines += [
        "",
        f"How: `{floor['agent_command']}` runs as its own process, registered with a stand-in kubelet in the "
        "benchmark process that keeps its ListAndWatch stream open. Beside it run the Go floor (`bench-grpc "
        "serve` from `bench/goclient`: the same DevicePlugin service on grpc-go, answering Allocate with one "
        "fixed response and GetPreferredAllocation with the first devices offered) and the empty Python server "
        "(`python -m bench.grpc_bench serve-empty`: the agent's own server model, `plugin_server` of "
        "`agent/deviceplugin/server.py` (grpc.aio, the same options), with fixed answers), each on a unix socket "
        "in the same directory. "
        "The client is `bench-grpc call`, a separate Go process that dials and calls as the kubelet's device "
        "manager does (grpc-go, the kubelet's `k8s.io/kubelet` API package, `grpc.DialContext` with an insecure "
        "unix dialer and authority `localhost`, one container request per call on `context.Background()`), "
        f"built by `bench/goclient/build.sh` with the test rig's Go. Each round and call is one client process "
        f"with a fresh connection to each server: {floor['warmup']} untimed calls to each, then "
        f"{floor['calls']} timed ones to each, the servers taking turns {floor['chunk']} calls at a time (agent, "
        "Go floor, empty Python, agent, ...), so all three meet the same moments of a busy machine; Allocate "
        f"first, then GetPreferredAllocation, {floor['rounds']} rounds. All three get the same request sequence "
        f"(one seed per round and call). Allocate names a random 1..{floor['devices']} of the "
        f"{floor['devices']} GPUs of `{floor['preset']}`; GetPreferredAllocation draws the size from "
        f"1..{floor['devices']}, a random available set of at least that size, and must-include devices in "
        "every fourth request of size 2 or more. Latency is the client's wall time around each call; p50 and "
        "p99 are nearest-rank. Server CPU is the growth of utime + stime in `/proc/<pid>/stat` (what getrusage "
        "counts for that process, all threads) around the whole client run divided by the calls that server "
        "answered, warm-up included; it also holds what the server did while the others had their turns (for "
        "the agent, its health monitor and telemetry: see its idle CPU above). Every figure here is reported "
        "without a budget: the budgets are what the kubelet notices, the latencies while 64 clients call at once "
        "(above).",
        "",
    ]
    return lines


def _many_clients(results: dict[str, Any]) -> list[str]:
    """The many-clients section: Allocate and GetPreferredAllocation while 64 clients call at once."""
    crowd = results["details"].get("many_clients")
    if crowd is None:
        return []
    names = {"allocate": "Allocate", "preferred": "GetPreferredAllocation"}
    modes = {"paced": "paced", "back_to_back": "back to back"}
    lines = [
        "## Many clients at once",
        "",
        "| call | clients call | calls | calls/s | p50 ms | p99 ms | max ms | in flight p50 / p99 / max | "
        "agent CPU ms/call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in crowd["runs"].values():
        how = f"{r['rate_per_client']:g}/s each" if r["mode"] == "paced" else modes[r["mode"]]
        lines.append(f"| {names[r['method']]} | {how} | {r['calls']} | {r['calls_per_s']} | {r['p50_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} | {r['max_ms']:.3f} | {r['in_flight_p50']} / {r['in_flight_p99']} / "
                     f"{r['max_in_flight']} | {r['agent_cpu_ms_per_call']:.3f} |")
    lines += [
        "",
        f"How: `{crowd['agent_command']}` (`{crowd['preset']}`, {crowd['gpus']} GPUs) runs as its own process, "
        "registered with a stand-in kubelet in the benchmark process that keeps its ListAndWatch stream open. "
        f"`bench-grpc load` (bench/goclient, grpc-go, dialling as the kubelet's device manager does) opens "
        f"{crowd['clients']} connections, one per client, makes {crowd['warmup']} untimed calls on each, then "
        "each client calls at random moments (a Poisson process of the given rate, one call at a time, the next "
        "one when it is due or, if later, when the previous one is answered) for the given time: Allocate with a "
        "random 1..16 of the GPUs, then GetPreferredAllocation drawn as in the series above. Paced, the calls of "
        "different clients overlap when they fall close together; back to back, every client always has a call "
        "in flight, so each call waits for those ahead of it (reported without a budget). In flight is the "
        "number of calls outstanding, the client's own included, as each timed call starts. Latency is the "
        "client's wall time around each call; p50 and p99 are nearest-rank. Agent CPU is the growth of its "
        "utime + stime around each run, divided by its calls, warm-up included. Budgets (paced): Allocate p99 "
        "under 2 ms, GetPreferredAllocation p99 under 20 ms.",
        "",
    ]
    return lines


def _remeasured(results: dict[str, Any]) -> list[str]:
    """The sections measured again since the full run (bench/run.py --only ... --merge), each replacing those
    sections' figures and details."""
    lines = []
    for r in results.get("remeasured", []):
        m = r["machine"]
        load = ", ".join(str(x) for x in m["load_average_at_start"])
        load_end = ", ".join(str(x) for x in m["load_average_at_end"])
        lines += [f"Measured again since, replacing their figures and details below: {', '.join(r['sections'])}, by "
                  f"`{r['generated_by']} --merge` on {r['date']}, {r['duration_s']:.0f} s: load average {load} at "
                  f"start and {load_end} at the end; {m['implementation']} {m['python']}, grpcio {m['grpcio']}, "
                  f"revision `{m['git']}`.", ""]
    return lines


def render(results: dict[str, Any], fleet: dict[str, Any] | None = None,
           input_cost: dict[str, Any] | None = None, image: dict[str, Any] | None = None) -> str:
    m = results["machine"]
    failed = sum(row["verdict"] == "fail" for row in results["figures"])
    budgeted = sum(row["verdict"] in ("pass", "fail") for row in results["figures"])
    verdict = f"All {budgeted} budgets met." if not failed else f"**{failed} of {budgeted} budgets missed.**"
    load = ", ".join(str(x) for x in m["load_average_at_start"])
    load_end = ", ".join(str(x) for x in m["load_average_at_end"])
    process = results["details"]["process"]
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by bench/report.py from bench/results.json, bench/fleet.json, bench/input_cost.json "
        "(`make bench`) and bench/image.json (bench/image.py); do not edit by hand. -->",
        "",
        f"`{results['generated_by']}` ({results['mode']} run) on {results['date']}, {results['duration_s']:.0f} s: "
        f"{m['nproc']} CPUs ({m['cpu_model']}), {m['memory']} memory, load average {load} at start and "
        f"{load_end} at the end; {m['implementation']} {m['python']}, grpcio {m['grpcio']}, "
        f"revision `{m['git']}`. {verdict}",
        "",
        *_remeasured(results),
        *_figures(results),
        "",
        *_missed(results),
        *_many_clients(results),
        *_floor(results),
        "## GetPreferredAllocation by request size",
        "",
        f"p50 / p99 in ms, {results['plan']['preferred_calls_per_size']} calls per size.",
        "",
        *_by_size(results["details"]["preferred"]),
        *_mismatches(results["details"]["preferred"]),
        "",
        "## MIG devices and time-sliced replicas by request size",
        "",
        "p50 / p99 in ms (calls), by the number of devices a request names.",
        "",
        *_many_devices(results["details"]["many_devices"]),
        "",
        "## MIG apply: the agent's share",
        "",
        *_mig_apply(results["details"]["mig_apply"]),
        "",
        "## Against kube-apiserver",
        "",
        *_apiserver(results["details"]),
        "",
        *_cluster(results["details"]),
        *_image(image),
        *_fleet(fleet),
        *_input_cost(input_cost),
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
        "## Load average by section",
        "",
        "Other work shares this machine; the load average (from `/proc/loadavg`) when each section started "
        f"shows how much, against {m['usable_cpus']} usable CPUs.",
        "",
        *_sections(results["details"]["sections"]),
        "",
        "## Method",
        "",
        *_method(results),
        "",
    ]
    return "\n".join(lines)


def write(target: Path | None = None) -> Path:
    """Renders the page anew from the committed results: what fleet.py, input_cost.py and image.py call after
    writing."""
    target = target or ROOT / "docs" / "benchmarks.md"
    target.write_text(render(json.loads((ROOT / "bench" / "results.json").read_text()), load(FLEET),
                             load(INPUT_COST), load(IMAGE)))
    return target


def main() -> int:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results.json"
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / "benchmarks.md"
    target.write_text(render(json.loads(source.read_text()), load(FLEET), load(INPUT_COST), load(IMAGE)))
    print(f"written to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
