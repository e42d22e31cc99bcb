"""Telemetry measurements on the fake NVML: one collection pass (NVML calls, wall and CPU time) and a /metrics
scrape (latency, size) with dcgm-exporter's family on, and the scrape with it off.

A pass is timed through the agent's own collection task (`TelemetryCollector.collect_once`, NVML thread
included); a scrape is an HTTP GET of /metrics over loopback, as Prometheus makes it. Half the GPUs are held by a
pod (a stand-in PodResources server on a unix socket), so the fake models load and pod labels are rendered.
Nothing here decides pass or fail; `bench/run.py` holds the budgets. Run alone:
python bench/telemetry_bench.py [--preset dgx-h100] [--passes 50] [--scrapes 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import yaml  # noqa: E402

from agent.config import parse_config  # noqa: E402
from agent.podresources_v1 import api_pb2 as pr  # noqa: E402
from agent.podresources_v1 import api_pb2_grpc as pr_grpc  # noqa: E402
from bench.grpc_bench import latency  # noqa: E402
from tests.plugin_harness import running_agent, short_dir  # noqa: E402

WARMUP = 5


class _Lister(pr_grpc.PodResourcesListerServicer):
    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=[pr.PodResources(
            name="bench-0", namespace="bench", containers=[pr.ContainerResources(name="main", devices=[
                pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=self.ids)])])])


async def _get(port: int) -> tuple[float, int]:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
    await writer.drain()
    body = await reader.read()
    writer.close()
    return (time.perf_counter() - started) * 1000, len(body)


async def _scrapes(port: int, count: int) -> dict[str, Any]:
    for _ in range(WARMUP):
        await _get(port)
    timed = [await _get(port) for _ in range(count)]
    result = latency([ms for ms, _ in timed])
    result["bytes"] = timed[-1][1]
    return result


async def telemetry(preset: str, passes: int, scrapes: int) -> dict[str, Any]:
    directory = short_dir()
    socket = directory / "pr.sock"
    config = parse_config(yaml.safe_dump({"version": "v1", "telemetry": {"intervalSeconds": 3600},
                                          "mig": {"podResourcesSocket": str(socket)}}))
    server = grpc.aio.server()
    lister = _Lister([])
    pr_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    try:
        async with running_agent(preset, config, metrics_port=0) as rig:
            agent = rig.agent
            assert agent.http is not None
            gpus = agent.bus.current.inventory.gpus
            lister.ids = [g.uuid for g in gpus[: len(gpus) // 2]]
            collector = agent.telemetry
            for _ in range(WARMUP):
                await collector.collect_once()
            wall, cpu, calls = [], [], []
            for _ in range(passes):
                cpu0 = time.process_time()
                await collector.collect_once()
                cpu.append((time.process_time() - cpu0) * 1000)
                wall.append(collector.pass_seconds * 1000)
                calls.append(collector.nvml_calls)
            on = await _scrapes(agent.http.port, scrapes)
            series = sum(1 for line in (await _body(agent.http.port)).splitlines()
                         if line.startswith("DCGM_FI_"))
            config_off = agent.bus.current.config.model_copy(update={
                "telemetry": agent.bus.current.config.telemetry.model_copy(update={"dcgm_metrics": False})})
            await agent.bus.update(config=config_off)
            off = await _scrapes(agent.http.port, scrapes)
    finally:
        await server.stop(None)
    return {
        "preset": preset,
        "gpus": len(gpus),
        "held_gpus": len(gpus) // 2,
        "passes": passes,
        "nvml_calls_per_pass": max(calls),
        "nvml_calls_per_gpu": max(calls) / len(gpus),
        "pass": latency(wall, cpu),
        "dcgm_series": series,
        "scrape_dcgm_on": on,
        "scrape_dcgm_off": off,
    }


async def _body(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return raw.decode().partition("\r\n\r\n")[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="dgx-h100")
    parser.add_argument("--passes", type=int, default=50)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = asyncio.run(telemetry(args.preset, args.passes, args.scrapes))
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
