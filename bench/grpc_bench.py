"""Device-plugin measurements over real unix sockets on the fake NVML: latencies, health propagation, RSS, CPU.

Each function starts what it measures (an in-process Agent with a stand-in kubelet, or a `gpu-agent run`
subprocess), drives it through a gRPC client channel to the plugin socket as the kubelet would, and returns
plain JSON-ready dicts. Nothing here decides pass or fail; `bench/run.py` holds the budgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import grpc

from agent.config import AgentConfig
from agent.deviceplugin.server import plugin_server
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.health.monitor import EVENT_WAIT_MS
from agent.nvml.fake import FakeNvml
from agent.simulate import StandInKubelet
from agent.topology.model import Topology
from agent.topology.prefer import topology_of
from tests.plugin_harness import Rig, running_agent, short_dir

ROOT = Path(__file__).resolve().parent.parent
RESOURCE = "nvidia.com/gpu"
WARMUP_CALLS = 20
"""Untimed calls before each timed series: the first calls on a channel pay for connection setup."""
XID = 48
"""Double-bit ECC error: the default health policy marks the GPU unhealthy at once."""
INJECT_PHASE_S = EVENT_WAIT_MS / 1000
"""Each injection waits a random 0..this long first, so injections land at every phase of the health monitor's
NVML event wait (one wait is this long) and of its sampling loop."""
UPDATE_TIMEOUT_S = 5.0
SETTLE_S = 2.0
"""Pause after the agent process registers, so its first health sample is done before RSS is read."""


# --- statistics --------------------------------------------------------------------------------------------


def percentile(ascending: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, -(-len(ascending) * q // 100))
    return ascending[int(rank) - 1]


def latency(ms: Sequence[float], cpu_ms: Sequence[float] | None = None) -> dict[str, Any]:
    """Nearest-rank p50, p99 and max of wall-clock times; with `cpu_ms`, p50 and p99 of the CPU time this
    process spent per call too (all its threads), which a busy machine inflates far less than wall time."""
    ordered = sorted(ms)
    figures = {
        "calls": len(ordered),
        "p50_ms": round(percentile(ordered, 50), 3),
        "p99_ms": round(percentile(ordered, 99), 3),
        "max_ms": round(ordered[-1], 3),
    }
    if cpu_ms is not None:
        cpu = sorted(cpu_ms)
        figures |= {"cpu_p50_ms": round(percentile(cpu, 50), 3), "cpu_p99_ms": round(percentile(cpu, 99), 3)}
    return figures


class Timer:
    """Wall-clock and process CPU time of each timed call, in ms."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        cpu, wall = time.process_time(), time.perf_counter()
        yield
        self.wall.append((time.perf_counter() - wall) * 1000)
        self.cpu.append((time.process_time() - cpu) * 1000)

    def figures(self) -> dict[str, Any]:
        return latency(self.wall, self.cpu)


# --- the brute-force optimum ---------------------------------------------------------------------------------


def brute_force_optimum(topo: Topology, available: Sequence[int], must: Sequence[int], size: int) -> list[int]:
    """The best set of `size` GPUs by the order of docs/allocation.md, found by enumerating every set.

    Order: highest value, fewest NUMA nodes, highest remainder (best value of a `size`-subset of the candidates
    left over, skipped when fewer than `size` are left), smallest sorted index tuple. The key is compared
    left to right, so the remainder only needs computing for the sets that tie on value and span; it is the
    first disjoint set in the list of all `size`-subsets ranked by value, which is every `size`-subset of the
    leftover candidates enumerated.
    """
    candidates = sorted(set(available) | set(must))
    scores, numa = topo.scores, topo.numa
    must_mask = sum(1 << g for g in set(must))
    subsets: list[tuple[int, int, tuple[int, ...]]] = []
    for combo in combinations(candidates, size):
        value = 0
        for i, a in enumerate(combo):
            row = scores[a]
            for b in combo[i + 1 :]:
                value += row[b]
        subsets.append((value, sum(1 << g for g in combo), combo))
    keyed = [
        (value, len({numa[g] for g in combo}), mask, combo)
        for value, mask, combo in subsets
        if mask & must_mask == must_mask
    ]
    best_value = max(k[0] for k in keyed)
    best_span = min(k[1] for k in keyed if k[0] == best_value)
    ties = [k for k in keyed if k[0] == best_value and k[1] == best_span]
    if len(ties) == 1 or len(candidates) - size < size:
        return list(min(t[3] for t in ties))
    ranked = sorted(subsets, key=lambda s: -s[0])

    def remainder(mask: int) -> int:
        return next(value for value, other, _ in ranked if other & mask == 0)

    return list(min(ties, key=lambda t: (-remainder(t[2]), t[3]))[3])


# --- helpers ------------------------------------------------------------------------------------------------


def _stub(rig: Rig, resource: str = RESOURCE) -> tuple[grpc.aio.Channel, api_pb2_grpc.DevicePluginStub]:
    endpoint = rig.kubelet.plugins[resource].endpoint
    channel = grpc.aio.insecure_channel(f"unix://{rig.directory / endpoint}")
    return channel, api_pb2_grpc.DevicePluginStub(channel)


def _preferred_request(ids: Sequence[str], available: Sequence[int], must: Sequence[int], size: int) -> Any:
    return api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=[ids[g] for g in available],
                must_include_deviceIDs=[ids[g] for g in must],
                allocation_size=size,
            )
        ]
    )


def _allocate_request(chosen: Sequence[str]) -> Any:
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(chosen))])


def _draw(rng: random.Random, gpus: int, size: int, trial: int) -> tuple[list[int], list[int]]:
    """Random availability of at least `size` GPUs; every fourth request of size 2 or more also names one or
    two must-include GPUs among them (as the kubelet does for devices a container already holds)."""
    available = sorted(rng.sample(range(gpus), rng.randint(size, gpus)))
    must: list[int] = []
    if size >= 2 and trial % 4 == 3:
        must = sorted(rng.sample(available, rng.randint(1, min(2, size - 1))))
    return available, must


# --- GetPreferredAllocation ---------------------------------------------------------------------------------


async def preferred_allocation(
    preset: str, calls_per_size: int, rng: random.Random, check_share: float = 1.0
) -> dict[str, Any]:
    """GetPreferredAllocation latency for every request size 1..N, and how often the answer is the optimum.

    `check_share` of the requests (all by default) are compared with `brute_force_optimum`, outside the timing.
    """
    async with running_agent(preset) as rig:
        inventory = rig.agent.bus.current.inventory
        topo = topology_of(inventory)
        ids = [g.uuid for g in inventory.gpus]
        index = {uuid: g for g, uuid in enumerate(ids)}
        n = len(ids)
        channel, stub = _stub(rig)
        async with channel:
            for trial in range(WARMUP_CALLS):
                available, must = _draw(rng, n, 1 + trial % n, trial)
                await stub.GetPreferredAllocation(_preferred_request(ids, available, must, 1 + trial % n))
            by_size: dict[int, Timer] = {}
            checked = optimal = 0
            mismatches: list[dict[str, Any]] = []
            for size in range(1, n + 1):
                for trial in range(calls_per_size):
                    available, must = _draw(rng, n, size, trial)
                    request = _preferred_request(ids, available, must, size)
                    with by_size.setdefault(size, Timer())():
                        response = await stub.GetPreferredAllocation(request)
                    answer = sorted(index[d] for d in response.container_responses[0].deviceIDs)
                    if rng.random() < check_share:
                        checked += 1
                        best = brute_force_optimum(topo, available, must, size)
                        if answer == best:
                            optimal += 1
                        elif len(mismatches) < 10:
                            mismatches.append(
                                {"available": available, "must_include": must, "size": size,
                                 "answer": answer, "optimum": best}
                            )
    wall = [ms for timer in by_size.values() for ms in timer.wall]
    cpu = [ms for timer in by_size.values() for ms in timer.cpu]
    return {
        "preset": preset,
        "gpus": n,
        **latency(wall, cpu),
        "by_size": {str(size): timer.figures() for size, timer in by_size.items()},
        "optimum": {"checked": checked, "optimal": optimal, "mismatches": mismatches},
    }


# --- Allocate -----------------------------------------------------------------------------------------------


async def _allocate_series(
    stub: api_pb2_grpc.DevicePluginStub, ids: Sequence[str], calls: int, rng: random.Random
) -> Timer:
    """Allocate calls for random sets of 1..N devices, each timed."""
    for _ in range(WARMUP_CALLS):
        await stub.Allocate(_allocate_request(rng.sample(list(ids), rng.randint(1, len(ids)))))
    timer = Timer()
    for _ in range(calls):
        request = _allocate_request(rng.sample(list(ids), rng.randint(1, len(ids))))
        with timer():
            await stub.Allocate(request)
    return timer


async def allocate(preset: str, calls: int, rng: random.Random) -> dict[str, Any]:
    """Allocate latency against an in-process agent."""
    async with running_agent(preset) as rig:
        ids = [d.ID for d in rig.devices()]
        channel, stub = _stub(rig)
        async with channel:
            timer = await _allocate_series(stub, ids, calls, rng)
    return {"preset": preset, "gpus": len(ids), **timer.figures()}


# --- many devices: MIG devices and time-sliced replicas -------------------------------------------------------

SIZE_BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 256), (257, 1024))
"""Request-size ranges the many-device series are split by in the details."""


def _by_bucket(sizes: Sequence[int], ms: Sequence[float]) -> dict[str, Any]:
    """Latency figures per request-size range (only the ranges some request fell in)."""
    out: dict[str, Any] = {}
    for lo, hi in SIZE_BUCKETS:
        times = [t for size, t in zip(sizes, ms, strict=True) if lo <= size <= hi]
        if times:
            out[f"{lo}" if lo == hi else f"{lo}-{hi}"] = latency(times)
    return out


def _valid_answer(answer: Sequence[str], available: Sequence[str], must: Sequence[str], size: int) -> bool:
    """A preferred allocation the kubelet can use: `size` distinct offered devices, every must-include one among
    them."""
    chosen = set(answer)
    return len(answer) == size == len(chosen) and chosen <= set(available) | set(must) and set(must) <= chosen


async def many_devices(
    preset: str,
    resource: str,
    config: AgentConfig,
    preferred_calls: int,
    allocate_calls: int,
    rng: random.Random,
    fake: FakeNvml | None = None,
) -> dict[str, Any]:
    """GetPreferredAllocation and Allocate latency on one resource with many devices (MIG devices or replicas).

    Each request draws its size uniformly from 1..N (N = the resource's device count), so every size is as
    likely as any other, as in the whole-GPU series; GetPreferredAllocation offers a random set of at least
    `size` devices, with one or two must-include devices in every fourth request of size 2 or more. Answers
    are checked for validity (outside the timing): `size` distinct offered devices, must-include ones among them.
    """
    async with running_agent(preset, config, fake=fake) as rig:
        ids = [d.ID for d in rig.devices(resource)]
        n = len(ids)
        channel, stub = _stub(rig, resource)
        async with channel:
            for trial in range(WARMUP_CALLS):
                size = rng.randint(1, n)
                available, must = _draw(rng, n, size, trial)
                await stub.GetPreferredAllocation(_preferred_request(ids, available, must, size))
            preferred, preferred_sizes, valid = Timer(), [], 0
            for trial in range(preferred_calls):
                size = rng.randint(1, n)
                available, must = _draw(rng, n, size, trial)
                request = _preferred_request(ids, available, must, size)
                with preferred():
                    response = await stub.GetPreferredAllocation(request)
                preferred_sizes.append(size)
                valid += _valid_answer(response.container_responses[0].deviceIDs,
                                       [ids[i] for i in available], [ids[i] for i in must], size)
            for _ in range(WARMUP_CALLS):
                await stub.Allocate(_allocate_request(rng.sample(ids, rng.randint(1, n))))
            allocate, allocate_sizes = Timer(), []
            for _ in range(allocate_calls):
                chosen = rng.sample(ids, rng.randint(1, n))
                request = _allocate_request(chosen)
                with allocate():
                    response = await stub.Allocate(request)
                if len(response.container_responses) != 1:
                    raise RuntimeError(f"{resource}: Allocate answered {len(response.container_responses)} "
                                       "container responses for one container")
                allocate_sizes.append(len(chosen))
    return {
        "preset": preset,
        "resource": resource,
        "devices": n,
        "preferred": {**preferred.figures(), "valid_answers": valid,
                      "by_size": _by_bucket(preferred_sizes, preferred.wall)},
        "allocate": {**allocate.figures(), "by_size": _by_bucket(allocate_sizes, allocate.wall)},
    }


# --- health change to ListAndWatch --------------------------------------------------------------------------


async def health_to_list_and_watch(preset: str, injections: int, rng: random.Random) -> dict[str, Any]:
    """Time from `inject_xid` on one GPU to the ListAndWatch response that lists it Unhealthy.

    A faulted GPU recovers only after several clean health samples (seconds), longer than one agent's round of
    injections, so each injection goes to a GPU that is still healthy; once every GPU of an agent has had one,
    a fresh agent takes over.
    """
    samples: list[float] = []
    agents = 0
    while len(samples) < injections:
        agents += 1
        async with running_agent(preset) as rig:
            uuids = [g.uuid for g in rig.agent.bus.current.inventory.gpus]
            channel, stub = _stub(rig)
            async with channel:
                stream = stub.ListAndWatch(api_pb2.Empty())
                first = await asyncio.wait_for(stream.read(), UPDATE_TIMEOUT_S)
                if any(d.health != "Healthy" for d in first.devices):
                    raise RuntimeError(f"{preset}: a fresh agent listed an unhealthy device")
                for gpu, uuid in enumerate(uuids):
                    if len(samples) == injections:
                        break
                    await asyncio.sleep(rng.uniform(0, INJECT_PHASE_S))
                    start = time.perf_counter()
                    rig.fake.inject_xid(gpu, XID)
                    while True:
                        response = await asyncio.wait_for(stream.read(), UPDATE_TIMEOUT_S)
                        health = {d.ID: d.health for d in response.devices}
                        if health[uuid] == "Unhealthy":
                            break
                    samples.append((time.perf_counter() - start) * 1000)
                stream.cancel()
    return {"preset": preset, "xid": XID, "agents": agents, **latency(samples)}


# --- the agent as its own process ---------------------------------------------------------------------------


def agent_command() -> list[str]:
    """`gpu-agent` from this interpreter's environment (the DaemonSet's entrypoint); `-m agent.cli` without it."""
    script = Path(sys.executable).with_name("gpu-agent")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "agent.cli"]


def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in bytes, from /proc/<pid>/status (kB there means KiB)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included) from /proc/<pid>/stat."""
    after_comm = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(after_comm[11]), int(after_comm[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ApiTarget:
    """The API server the agent process talks to, and how to tell that it has converged its Node."""

    kubeconfig: Path
    node: str
    converged: Callable[[], Awaitable[None]]
    """Called once the agent has registered; returns when the agent has written its Node (raises on timeout)."""


async def agent_process(
    preset: str, allocations: int, idle_s: float, rng: random.Random, api: ApiTarget | None = None
) -> dict[str, Any]:
    """Run `gpu-agent run --nvml mock:PRESET` against a stand-in kubelet in this process; read its RSS after
    start and after `allocations` Allocate calls, then its CPU time over `idle_s` seconds of idling (the
    stand-in kubelet keeps its ListAndWatch stream open, as a kubelet does).

    Without `api` the agent runs with --no-kube; with it, the agent connects to that API server as that node
    (its Node watch stays open while it idles), and "after start" means after it has converged the Node.
    """
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    log_path = directory / "agent.log"
    kube = ["--no-kube"] if api is None else ["--kubeconfig", str(api.kubeconfig), "--node-name", api.node]
    shown = ["--no-kube"] if api is None else ["--kubeconfig", "KUBECONFIG", "--node-name", api.node]
    command = [*agent_command(), "run", "--nvml", f"mock:{preset}", "--kubelet-dir", str(directory),
               *kube, "--metrics-port", "0"]
    # The agent imported from this tree, whatever the environment's installed copy points at.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log, env=env)
    try:
        try:
            await kubelet.wait_for({RESOURCE}, 60)
            if api is not None:
                await api.converged()
        except TimeoutError:
            raise RuntimeError(f"the agent did not register and converge within 60 s:\n{log_path.read_text()}") \
                from None
        await asyncio.sleep(SETTLE_S)
        rss_start, _ = rss_bytes(proc.pid)
        ids = [d.ID for d in kubelet.plugins[RESOURCE].devices]
        endpoint = kubelet.plugins[RESOURCE].endpoint
        async with grpc.aio.insecure_channel(f"unix://{directory / endpoint}") as channel:
            agent_cpu = cpu_seconds(proc.pid)
            timer = await _allocate_series(api_pb2_grpc.DevicePluginStub(channel), ids, allocations, rng)
            agent_cpu = cpu_seconds(proc.pid) - agent_cpu
        rss_after, rss_peak = rss_bytes(proc.pid)
        cpu_before, wall_before = cpu_seconds(proc.pid), time.monotonic()
        await asyncio.sleep(idle_s)
        cpu_after, wall_after = cpu_seconds(proc.pid), time.monotonic()
        proc.send_signal(signal.SIGTERM)
        exit_code = await asyncio.wait_for(proc.wait(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await kubelet.stop()
        log_text = log_path.read_text(errors="replace")
        shutil.rmtree(directory, ignore_errors=True)
    if exit_code != 0 or "Traceback" in log_text:
        raise RuntimeError(f"the agent process exited {exit_code}:\n{log_text}")
    idle_wall = wall_after - wall_before
    idle_cpu = cpu_after - cpu_before
    return {
        "preset": preset,
        "command": " ".join(["gpu-agent", "run", "--nvml", f"mock:{preset}", "--kubelet-dir", "DIR", *shown,
                             "--metrics-port", "0"]),
        "gpus": len(ids),
        "rss_after_start_bytes": rss_start,
        "rss_after_allocations_bytes": rss_after,
        "rss_peak_bytes": rss_peak,
        "allocate": {
            "allocations": allocations,
            **latency(timer.wall),
            # Warm-up calls included: the agent's CPU is read around the whole series.
            "agent_cpu_ms_per_call": round(1000 * agent_cpu / (allocations + WARMUP_CALLS), 3),
        },
        "idle": {
            "wall_s": round(idle_wall, 3),
            "cpu_s": round(idle_cpu, 3),
            "cpu_percent_of_core": round(100 * idle_cpu / idle_wall, 3),
        },
    }


# --- Allocate against the floor: the agent beside a minimal Go server and an empty Python server -----------

GO_BENCH = Path(os.environ.get("TESTBIN_DIR", ROOT / ".cache" / "testbin")) / "bench-grpc"
GO_BENCH_BUILD = ROOT / "bench" / "goclient" / "build.sh"
FLOOR_SERVERS = ("agent", "go", "python")
"""The order the servers take their turns in."""
FLOOR_METHODS = ("allocate", "preferred")
FLOOR_WARMUP = 200
"""Untimed calls the Go client makes on each fresh connection before the timed ones."""
FLOOR_CHUNK = 100
"""Calls one server answers before the next one's turn, so the three share the same moments of a busy machine."""
SOCKET_WAIT_S = 30.0


def build_go_bench() -> Path:
    """bench-grpc (bench/goclient) built with the test rig's Go into .cache/testbin; seconds when cached."""
    result = subprocess.run(["nice", "-n", "10", "bash", str(GO_BENCH_BUILD)], stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{GO_BENCH_BUILD} failed with exit code {result.returncode}")
    return GO_BENCH


class EmptyServicer(api_pb2_grpc.DevicePluginServicer):
    """The DevicePlugin service doing nothing a Python server could skip: fixed answers, like the Go floor."""

    def __init__(self, ids: Sequence[str]) -> None:
        self._allocate = api_pb2.AllocateResponse(container_responses=[
            api_pb2.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)})])
        self._devices = api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID=i, health="Healthy") for i in ids])

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: Any, context: Any) -> Any:
        yield self._devices

    async def Allocate(self, request: Any, context: Any) -> Any:
        return self._allocate

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return api_pb2.PreferredAllocationResponse(container_responses=[
            api_pb2.ContainerPreferredAllocationResponse(deviceIDs=c.available_deviceIDs[:c.allocation_size])
            for c in request.container_requests])

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return api_pb2.PreStartContainerResponse()


def serve_empty(socket: Path, ids: Sequence[str]) -> None:
    """The empty Python server until SIGTERM: the agent's server model (server.plugin_server: grpc.aio with the
    agent's options, agent/deviceplugin/server.py) around EmptyServicer, so the agent's own work is the
    difference."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            server = plugin_server(EmptyServicer(ids), f"unix://{socket}")  # type: ignore[arg-type]
        except OSError as err:
            raise SystemExit(f"cannot listen on {socket}: {err}") from None
        await server.start()
        await stop.wait()
        await server.stop(0)

    asyncio.run(serve())


def _busy_seconds() -> float:
    """CPU time the whole machine has spent busy, all CPUs together (the first line of /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


async def _wait_socket(path: Path, proc: asyncio.subprocess.Process, what: str) -> None:
    deadline = time.monotonic() + SOCKET_WAIT_S
    while not path.is_socket():
        if proc.returncode is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not serve {path} (exit code {proc.returncode})")
        await asyncio.sleep(0.05)


async def _turns(go: Path, sockets: Sequence[Path], pids: Sequence[int], method: str, calls: int, seed: int,
                 ids: Sequence[str]) -> list[dict[str, Any]]:
    """One Go client process on one connection per server: FLOOR_WARMUP untimed calls to each, then `calls`
    timed ones to each, the servers taking turns FLOOR_CHUNK calls at a time. Each server's CPU time (utime +
    stime of its process) and the machine's load are read around the whole run."""
    load_start = os.getloadavg()[0]
    busy, own, wall = _busy_seconds(), time.process_time(), time.monotonic()
    cpu = [cpu_seconds(pid) for pid in pids]
    proc = await asyncio.create_subprocess_exec(
        str(go), "call", "-socket", ",".join(str(s) for s in sockets), "-method", method, "-calls", str(calls),
        "-warmup", str(FLOOR_WARMUP), "-chunk", str(FLOOR_CHUNK), "-seed", str(seed), "-ids", ",".join(ids),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    wall = time.monotonic() - wall
    cpu = [cpu_seconds(pid) - before for pid, before in zip(pids, cpu, strict=True)]
    own = time.process_time() - own
    busy = _busy_seconds() - busy
    if proc.returncode != 0:
        raise RuntimeError(f"bench-grpc call {method} exited {proc.returncode}: {err.decode(errors='replace').strip()}")
    result = json.loads(out)
    served = calls + FLOOR_WARMUP
    shared = {
        "client_cpu_ms_per_call": round(1000 * result["cpu_s"] / (served * len(sockets)), 4),
        "wall_s": round(wall, 3),
        "load_average_start": round(load_start, 2),
        "load_average_end": round(os.getloadavg()[0], 2),
        # Everything else the machine ran meanwhile, in CPUs: busy time less servers, client and this process.
        "other_cpus": round(max(0.0, busy - sum(cpu) - result["cpu_s"] - own) / wall, 3),
    }
    return [{"latency_ms": [ns / 1e6 for ns in ns_list], "server_cpu_ms_per_call": round(1000 * used / served, 4),
             **shared} for ns_list, used in zip(result["latency_ns"], cpu, strict=True)]


async def allocate_floor(preset: str, rounds: int, calls: int, rng: random.Random) -> dict[str, Any]:
    """Allocate and GetPreferredAllocation as the kubelet calls them, from a Go client process (bench-grpc),
    against three servers taking turns FLOOR_CHUNK calls at a time: the agent (`gpu-agent run` on the fake
    NVML, registered with a stand-in kubelet whose ListAndWatch stream stays open), the Go floor (bench-grpc
    serve: grpc-go, fixed answers) and the empty Python server (serve_empty). In a round every server gets the
    same request sequence (one seed per round and method)."""
    go = build_go_bench()
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    log_path = directory / "agent.log"
    command = [*agent_command(), "run", "--nvml", f"mock:{preset}", "--kubelet-dir", str(directory), "--no-kube",
               "--metrics-port", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs: dict[str, asyncio.subprocess.Process] = {}
    try:
        with open(log_path, "wb") as log:
            procs["agent"] = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log, env=env)
        try:
            await kubelet.wait_for({RESOURCE}, 60)
        except TimeoutError:
            raise RuntimeError(f"the agent did not register within 60 s:\n{log_path.read_text()}") from None
        ids = [d.ID for d in kubelet.plugins[RESOURCE].devices]
        sockets = {"agent": directory / kubelet.plugins[RESOURCE].endpoint,
                   "go": directory / "go-floor.sock", "python": directory / "python-empty.sock"}
        procs["go"] = await asyncio.create_subprocess_exec(
            str(go), "serve", "-socket", str(sockets["go"]), "-ids", ",".join(ids))
        procs["python"] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.grpc_bench", "serve-empty", str(sockets["python"]), ",".join(ids),
            cwd=ROOT, env=env)
        for name in ("go", "python"):
            await _wait_socket(sockets[name], procs[name], f"the {name} server")
        await asyncio.sleep(SETTLE_S)
        series: list[dict[str, Any]] = []
        for round_ in range(1, rounds + 1):
            for method in FLOOR_METHODS:
                seed = rng.getrandbits(63)
                turns = await _turns(go, [sockets[n] for n in FLOOR_SERVERS], [procs[n].pid for n in FLOOR_SERVERS],
                                     method, calls, seed, ids)
                series += [{"round": round_, "method": method, "server": server, "seed": seed, **figures}
                           for server, figures in zip(FLOOR_SERVERS, turns, strict=True)]
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {name: await asyncio.wait_for(proc.wait(), 15) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await kubelet.stop()
        log_text = log_path.read_text(errors="replace")
        shutil.rmtree(directory, ignore_errors=True)
    if any(codes.values()) or "Traceback" in log_text:
        raise RuntimeError(f"a server exited with {codes}; the agent's log:\n{log_text}")
    return _floor_figures(preset, len(ids), rounds, calls, series, " ".join(
        ["gpu-agent", "run", "--nvml", f"mock:{preset}", "--kubelet-dir", "DIR", "--no-kube", "--metrics-port", "0"]))


def _floor_figures(preset: str, devices: int, rounds: int, calls: int, series: list[dict[str, Any]],
                   command: str) -> dict[str, Any]:
    """Latency pooled over the rounds per server and method, the ratios to the floors, and each series."""
    pooled: dict[str, dict[str, Any]] = {}
    ratios: dict[str, Any] = {}
    for method in FLOOR_METHODS:
        pooled[method] = {}
        for server in FLOOR_SERVERS:
            mine = [s for s in series if s["method"] == method and s["server"] == server]
            pooled[method][server] = {
                **latency([ms for s in mine for ms in s["latency_ms"]]),
                "server_cpu_ms_per_call": round(sum(s["server_cpu_ms_per_call"] for s in mine) / len(mine), 4),
            }
        by_round = []
        for round_ in range(1, rounds + 1):
            p = {s["server"]: latency(s["latency_ms"]) for s in series
                 if s["method"] == method and s["round"] == round_}
            by_round.append({"round": round_,
                             "p99_vs_go": round(p["agent"]["p99_ms"] / p["go"]["p99_ms"], 3),
                             "p50_vs_python": round(p["agent"]["p50_ms"] / p["python"]["p50_ms"], 3)})
        figures = pooled[method]
        ratios[method] = {
            "p99_vs_go": round(figures["agent"]["p99_ms"] / figures["go"]["p99_ms"], 3),
            "p50_vs_python": round(figures["agent"]["p50_ms"] / figures["python"]["p50_ms"], 3),
            "by_round": by_round,
        }
    for s in series:
        s.update(latency(s.pop("latency_ms")))
    return {"preset": preset, "devices": devices, "rounds": rounds, "calls": calls, "warmup": FLOOR_WARMUP,
            "chunk": FLOOR_CHUNK,
            "servers": list(FLOOR_SERVERS), "agent_command": command,
            "pooled": pooled, "ratios": ratios, "series": series}


# --- many clients at once: 64 kubelet-like clients on connections of their own --------------------------------

LOAD_METHODS = ("allocate", "preferred")
LOAD_WARMUP = 20
"""Untimed calls per client before the timed ones (each client's connection set up and warm)."""


async def many_clients(preset: str, clients: int, rate: float, seconds: float, rng: random.Random,
                       back_to_back_seconds: float = 0.0) -> dict[str, Any]:
    """Allocate and GetPreferredAllocation while `clients` clients call at once: `gpu-agent run` on the fake
    NVML of `preset` (its own process, registered with a stand-in kubelet that holds its ListAndWatch stream),
    and `bench-grpc load` (a Go process, bench/goclient) with `clients` connections of their own, each calling
    at random moments, `rate` calls per second on average (a Poisson process, one call at a time per client),
    for `seconds` per method. With `back_to_back_seconds`, the same clients then each call as soon as their
    previous call is answered, for that long per method (reported, with no budget: every client always has
    a call waiting). The agent's CPU (utime + stime) is read around each run."""
    go = build_go_bench()
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    log_path = directory / "agent.log"
    command = [*agent_command(), "run", "--nvml", f"mock:{preset}", "--kubelet-dir", str(directory), "--no-kube",
               "--metrics-port", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs: dict[str, dict[str, Any]] = {}
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log, env=env)
    try:
        try:
            await kubelet.wait_for({RESOURCE}, 60)
        except TimeoutError:
            raise RuntimeError(f"the agent did not register within 60 s:\n{log_path.read_text()}") from None
        await asyncio.sleep(SETTLE_S)
        ids = [d.ID for d in kubelet.plugins[RESOURCE].devices]
        socket = directory / kubelet.plugins[RESOURCE].endpoint
        modes = [("paced", rate, seconds)] + ([("back_to_back", 0.0, back_to_back_seconds)]
                                              if back_to_back_seconds else [])
        for mode, mode_rate, mode_seconds in modes:
            for method in LOAD_METHODS:
                cpu = cpu_seconds(proc.pid)
                load = await asyncio.create_subprocess_exec(
                    str(go), "load", "-socket", str(socket), "-method", method, "-clients", str(clients),
                    "-rate", str(mode_rate), "-seconds", str(mode_seconds), "-warmup", str(LOAD_WARMUP),
                    "-seed", str(rng.getrandbits(63)), "-ids", ",".join(ids),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await load.communicate()
                cpu = cpu_seconds(proc.pid) - cpu
                if load.returncode != 0:
                    raise RuntimeError(f"bench-grpc load {method} exited {load.returncode}: "
                                       f"{err.decode(errors='replace').strip()}")
                result = json.loads(out)
                if result["errors"]:
                    raise RuntimeError(f"bench-grpc load {method}: {len(result['errors'])} calls failed, first: "
                                       f"{result['errors'][0]}")
                ms = [ns / 1e6 for ns in result["latency_ns"]]
                seen = sorted(result["in_flight_seen"])
                runs[f"{mode}.{method}"] = {
                    "mode": mode, "method": method, **latency(ms),
                    "calls_per_s": round(len(ms) / result["wall_s"], 1),
                    "rate_per_client": mode_rate,
                    "seconds": mode_seconds,
                    "max_in_flight": result["max_in_flight"],
                    "in_flight_p50": percentile(seen, 50),
                    "in_flight_p99": percentile(seen, 99),
                    "agent_cpu_ms_per_call": round(1000 * cpu / (len(ms) + clients * LOAD_WARMUP), 3),
                    "client_cpu_s": round(result["cpu_s"], 3),
                }
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await kubelet.stop()
        log_text = log_path.read_text(errors="replace")
        shutil.rmtree(directory, ignore_errors=True)
    if code != 0 or "Traceback" in log_text:
        raise RuntimeError(f"the agent process exited {code}:\n{log_text}")
    return {"preset": preset, "gpus": len(ids), "clients": clients, "warmup": LOAD_WARMUP,
            "agent_command": " ".join(["gpu-agent", "run", "--nvml", f"mock:{preset}", "--kubelet-dir", "DIR",
                                       "--no-kube", "--metrics-port", "0"]),
            "runs": runs}


@contextlib.contextmanager
def quiet_logs(path: Path) -> Iterator[None]:
    """Send the in-process agent's logs (INFO and up, as the DaemonSet logs) to a file instead of the console."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        handler.close()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "serve-empty":
        raise SystemExit("usage: python -m bench.grpc_bench serve-empty SOCKET ID,ID,...")
    serve_empty(Path(sys.argv[2]), sys.argv[3].split(","))
