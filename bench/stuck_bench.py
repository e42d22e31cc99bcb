"""A driver that stops answering and a GPU lost across a restart, measured: an NVML call past its deadline to the
GPU Unhealthy in ListAndWatch and to the taint on the API server; Allocate and GetPreferredAllocation, /metrics
and /healthz while NVML is stuck; SIGTERM to exit with the whole driver hung; and the agent's taint through a
restart with a GPU lost. Plain JSON-ready dicts; `bench/run.py` holds the budgets.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from agent.config import AgentConfig, parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from bench.grpc_bench import Timer, _allocate_request, _draw, _preferred_request, _stub, latency
from bench.kube_bench import agent_on_node, tainted, untainted, watching
from tests.plugin_harness import running_agent, short_dir, wait_until

DEADLINE_S = 2.0
"""health.nvmlDeadlineSeconds for these runs (the default is 10 s; the budgets are relative to it)."""
PRESET = "dgx-h100"
CONFIG = {"version": "v1", "telemetry": {"dcgmMetrics": False},
          "health": {"sampleIntervalSeconds": 0.5, "recoveryChecks": 2, "nvmlDeadlineSeconds": DEADLINE_S}}
"""Without dcgm-exporter's counters, the call that hangs is the health sample of the hung GPU."""
LOSS_CONFIG = {"version": "v1", "health": {"sampleIntervalSeconds": 0.5}}


def _config(extra: dict[str, Any] | None = None) -> AgentConfig:
    return parse_config(yaml.safe_dump({**CONFIG, **(extra or {})}))


async def _http_ms(port: int, path: str) -> float:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    if not raw.startswith(b"HTTP/1.0 200") and not raw.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path} answered {raw[:40]!r}")
    return (time.perf_counter() - started) * 1000


async def stuck_to_unhealthy(runs: int, rng: random.Random) -> dict[str, Any]:
    """Time from a GPU's calls starting to block (FakeNvml.set_hung) to the ListAndWatch response listing it
    Unhealthy; a fresh agent each run."""
    samples: list[float] = []
    for _ in range(runs):
        fake = FakeNvml(load_node(PRESET))
        async with running_agent(PRESET, _config(), fake=fake) as rig:
            uuids = [g.uuid for g in rig.agent.bus.current.inventory.gpus]
            gpu = rng.randrange(len(uuids))
            channel, stub = _stub(rig)
            async with channel:
                stream = stub.ListAndWatch(api_pb2.Empty())
                await stream.read()
                await asyncio.sleep(rng.uniform(0, 0.5))
                start = time.perf_counter()
                fake.set_hung(gpu)
                try:
                    while True:
                        response = await asyncio.wait_for(stream.read(), DEADLINE_S + 10)
                        if {d.ID: d.health for d in response.devices}[uuids[gpu]] == "Unhealthy":
                            break
                    samples.append((time.perf_counter() - start) * 1000)
                finally:
                    fake.set_hung(gpu, False)
                    stream.cancel()
    return {"preset": PRESET, "deadline_s": DEADLINE_S, **latency(samples)}


async def served_while_stuck(calls: int, rng: random.Random) -> dict[str, Any]:
    """Allocate and GetPreferredAllocation latency of one agent with NVML answering, then with a GPU's calls hung
    past the deadline (NVML's one worker held; the requests name the other GPUs); /metrics and /healthz latency
    while it hangs."""
    fake = FakeNvml(load_node(PRESET))
    hung = len(fake.spec.gpus) - 1
    result: dict[str, Any] = {"preset": PRESET, "deadline_s": DEADLINE_S, "hung_gpu": hung}
    async with running_agent(PRESET, _config(), fake=fake, metrics_port=0) as rig:
        ids = [d.ID for d in rig.devices()][:hung]
        channel, stub = _stub(rig)
        async with channel:
            async def series(phase: str) -> None:
                allocate, preferred = Timer(), Timer()
                for trial in range(calls):
                    request = _allocate_request(rng.sample(ids, rng.randint(1, len(ids))))
                    with allocate():
                        await stub.Allocate(request)
                    size = 1 + trial % len(ids)
                    available, must = _draw(rng, len(ids), size, trial)
                    with preferred():
                        await stub.GetPreferredAllocation(_preferred_request(ids, available, must, size))
                result[phase] = {"allocate": allocate.figures(), "preferred": preferred.figures()}

            await series("answering")
            fake.set_hung(hung)
            try:
                await wait_until(lambda: rig.agent.monitor.stuck is not None, DEADLINE_S + 5, "NVML stuck")
                await series("stuck")
                port = rig.metrics_port
                result["stuck"]["metrics"] = latency([await _http_ms(port, "/metrics") for _ in range(50)])
                result["stuck"]["healthz"] = latency([await _http_ms(port, "/healthz") for _ in range(50)])
            finally:
                fake.set_hung(hung, False)
    return result


async def sigterm_while_stuck(runs: int, workdir: Path) -> dict[str, Any]:
    """Time from SIGTERM to the exit of a `gpu-agent run` process whose whole driver hangs (past the deadline)."""
    samples: list[float] = []
    codes: list[int] = []
    for run in range(runs):
        state = workdir / f"stuck-{run}.json"
        config = workdir / f"stuck-{run}.yaml"
        config.write_text(yaml.safe_dump({**CONFIG, "mig": {"stateDir": str(workdir / f"state-{run}")}}))
        fake = FakeNvml(load_node(PRESET), state)
        directory = short_dir()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent.cli", "run", "--nvml", f"mock:{PRESET}", "--mock-state", str(state),
            "--kubelet-dir", str(directory), "--config", str(config), "--no-kube", "--metrics-port", "0",
            stderr=asyncio.subprocess.PIPE)
        assert proc.stderr is not None
        try:
            while b"agent started" not in await asyncio.wait_for(proc.stderr.readline(), 30):
                pass
            drain = asyncio.create_task(proc.stderr.read())
            fake.set_hung(None)
            await asyncio.sleep(DEADLINE_S + 1)
            start = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)
            samples.append((time.perf_counter() - start) * 1000)
            codes.append(proc.returncode if proc.returncode is not None else -1)
            await drain
        finally:
            fake.set_hung(None, False)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            shutil.rmtree(directory, ignore_errors=True)
    return {"preset": PRESET, "deadline_s": DEADLINE_S, "exit_codes": codes, **latency(samples)}


async def stuck_to_taint(kubeconfig: Path, node: str, runs: int, rng: random.Random) -> dict[str, Any]:
    """Time from a GPU's calls starting to block to the Node version carrying the agent's taint, on a watch of
    the API server; a fresh agent each run (which first clears the taint the last one left)."""
    samples: list[float] = []
    async with watching(kubeconfig, node) as nodes:
        for _ in range(runs):
            async with agent_on_node(kubeconfig, node, PRESET, _config()) as on:
                after = await nodes.sync()
                if not untainted(nodes.latest):
                    raise RuntimeError(f"node {node} is still tainted after a fresh agent converged")
                gpu = rng.randrange(len(on.fake.spec.gpus))
                await asyncio.sleep(rng.uniform(0, 0.5))
                start = time.perf_counter()
                on.fake.set_hung(gpu)
                try:
                    seen = await nodes.wait_for(tainted, DEADLINE_S + 10, "the taint after a hung GPU", after)
                finally:
                    on.fake.set_hung(gpu, False)
                samples.append((seen.arrived - start) * 1000)
    return {"preset": PRESET, "deadline_s": DEADLINE_S, **latency(samples)}


async def restart_with_a_lost_gpu(kubeconfig: Path, node: str, runs: int, workdir: Path) -> dict[str, Any]:
    """An agent taints the Node for a lost GPU and stops; a new one starts with the GPU still lost. Every Node
    version a watch sees from the first agent's stop until the new one converged is counted, and those without
    the taint among them."""
    versions = untainted_versions = 0
    first_write_ms: list[float] = []
    config = parse_config(yaml.safe_dump(LOSS_CONFIG))
    for run in range(runs):
        fake = FakeNvml(load_node(PRESET))
        identities = workdir / f"lost-{run}-gpus.json"
        async with watching(kubeconfig, node) as nodes:
            api = await _connect(kubeconfig, node)
            async with running_agent(PRESET, config, kube=api, fake=fake, gpu_identities=identities) as rig:
                fake.set_gpu_lost(3, keep_handle=run % 2 == 1)
                await nodes.wait_for(tainted, 30, "the taint for the lost GPU", await nodes.sync())
                await rig.converged(30)
            after = await nodes.sync()
            started = time.perf_counter()
            api = await _connect(kubeconfig, node)
            async with running_agent(PRESET, config, kube=api, fake=fake, gpu_identities=identities) as rig:
                await rig.converged(30)
                seen = await nodes.sync()
            changed = nodes.versions[after:seen]
            versions += len(changed)
            untainted_versions += sum(not tainted(v) for v in changed)
            if changed:
                first_write_ms.append((changed[0].arrived - started) * 1000)
            fake.set_gpu_lost(3, False)
    return {"preset": PRESET, "runs": runs, "node_versions": versions, "untainted_versions": untainted_versions,
            "first_write_ms": [round(ms, 1) for ms in first_write_ms]}


async def _connect(kubeconfig: Path, node: str) -> Any:
    from agent.kube.node import NodeApi

    return await NodeApi.connect(kubeconfig, node)
