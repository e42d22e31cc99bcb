"""The collection task against a stand-in kubelet PodResources v1 server on a real unix socket: pod labels on
exactly the devices a pod holds, gone when it ends; the last XID; the switch; and the agent's /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import yaml

from agent.config import parse_config
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvmlthread import NvmlThread
from agent.podresources_v1 import api_pb2 as pr
from agent.podresources_v1 import api_pb2_grpc as pr_grpc
from agent.state import NodeState, StateBus
from agent.telemetry.collector import TelemetryCollector
from agent.telemetry.exposition import render
from tests.builders import exposition_samples as parse
from tests.plugin_harness import short_dir, wait_until


class StandInPodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's v1 Lister: List answers the pods held now; counts the calls."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, list[str]]] = {}
        self.lists = 0

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        self.lists += 1
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(namespace=ns, name=name, containers=[
                pr.ContainerResources(name=container, devices=[
                    pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids),
                    pr.ContainerDevices(resource_name="example.com/nic", device_ids=["nic-0"]),
                ]) for container, ids in containers.items()])
            for (ns, name), containers in self.pods.items()
        ])


class Rig:
    def __init__(self, directory: Path, preset: str, telemetry: dict[str, object]) -> None:
        self.socket = directory / "pr.sock"
        config = parse_config(yaml.safe_dump({"version": "v1", "telemetry": telemetry,
                                              "mig": {"podResourcesSocket": str(self.socket)}}))
        self.fake = FakeNvml(load_node(preset))
        self.backend = NvmlBackend(lib=self.fake, numa_lookup=self.fake.numa_node)
        self.backend.init()
        self.bus = StateBus(NodeState(version=1, inventory=self.backend.inventory(), config=config))
        self.xids: dict[tuple[str, int], int] = {}
        self.nvml = NvmlThread()
        self.collector = TelemetryCollector(self.backend, self.bus, self.nvml, lambda: self.xids)
        self.lister = StandInPodResources()
        self.server: grpc.aio.Server | None = None

    async def serve(self) -> None:
        self.server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(self.lister, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()

    def scrape(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return parse(render(self.collector.snapshot, self.bus.current, "n1").decode())


@asynccontextmanager
async def rig(preset: str = "dgx-h100", serve: bool = True, **telemetry: object) -> AsyncIterator[Rig]:
    directory = short_dir()
    r = Rig(directory, preset, telemetry)
    try:
        if serve:
            await r.serve()
        yield r
    finally:
        if r.server is not None:
            await r.server.stop(None)
        r.nvml.close()
        shutil.rmtree(directory, ignore_errors=True)


def pods_on(scraped: dict[str, list[tuple[dict[str, str], float]]], name: str) -> list[tuple[str, str, str, str]]:
    return sorted((labels["gpu"], labels["namespace"], labels["pod"], labels["container"])
                  for labels, _ in scraped[name] if "pod" in labels)


async def test_a_pod_holding_two_gpus_appears_on_exactly_those_and_goes_when_it_ends() -> None:
    async with rig() as r:
        gpus = r.bus.current.inventory.gpus
        r.lister.pods[("ml", "trainer-0")] = {"train": [gpus[2].uuid, gpus[5].uuid]}
        await r.collector.collect_once()
        scraped = r.scrape()
        for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_XID_ERRORS"):
            assert pods_on(scraped, name) == [("2", "ml", "trainer-0", "train"), ("5", "ml", "trainer-0", "train")]
        assert len(scraped["DCGM_FI_DEV_GPU_UTIL"]) == 8
        del r.lister.pods[("ml", "trainer-0")]
        await r.collector.collect_once()
        assert pods_on(r.scrape(), "DCGM_FI_DEV_GPU_UTIL") == []


async def test_replicas_of_one_gpu_held_by_two_pods() -> None:
    async with rig() as r:
        uuid = r.bus.current.inventory.gpus[0].uuid
        r.lister.pods[("a", "p1")] = {"c": [f"{uuid}::0"]}
        r.lister.pods[("b", "p2")] = {"c": [f"{uuid}::3"]}
        await r.collector.collect_once()
        assert pods_on(r.scrape(), "DCGM_FI_DEV_GPU_TEMP") == [("0", "a", "p1", "c"), ("0", "b", "p2", "c")]


async def test_scrapes_read_the_snapshot_and_never_call_the_kubelet_or_nvml() -> None:
    async with rig() as r:
        await r.collector.collect_once()
        r.fake.nvmlShutdown()  # from here on every NVML call fails with Uninitialized
        for _ in range(5):
            assert len(r.scrape()["DCGM_FI_DEV_GPU_TEMP"]) == 8
        assert r.lister.lists == 1


async def test_without_podresources_the_series_stay_and_carry_no_pod() -> None:
    async with rig(serve=False) as r:
        await r.collector.collect_once()
        scraped = r.scrape()
        assert len(scraped["DCGM_FI_DEV_GPU_TEMP"]) == 8
        assert pods_on(scraped, "DCGM_FI_DEV_GPU_TEMP") == []


async def test_the_last_xid_follows_the_events() -> None:
    async with rig() as r:
        uuid = r.bus.current.inventory.gpus[3].uuid

        async def xid_on_gpu3() -> tuple[float, str]:
            await r.collector.collect_once()
            [(labels, value)] = [s for s in r.scrape()["DCGM_FI_DEV_XID_ERRORS"] if s[0]["gpu"] == "3"]
            return value, labels["err_msg"]

        assert await xid_on_gpu3() == (0, "No Error")
        r.xids[(uuid, 79)] = 1
        assert await xid_on_gpu3() == (79, "GPU has fallen off the bus")
        r.xids[(uuid, 13)] = 1
        assert await xid_on_gpu3() == (13, "Graphics Engine Exception")
        r.xids[(uuid, 79)] = 2
        assert await xid_on_gpu3() == (79, "GPU has fallen off the bus")
        assert await xid_on_gpu3() == (79, "GPU has fallen off the bus")


async def test_the_task_follows_the_switch_and_the_interval() -> None:
    async with rig(intervalSeconds=1) as r:
        task = asyncio.create_task(r.collector.run())
        try:
            await wait_until(lambda: r.collector.passes >= 2, 5, "two passes")
            assert len(r.scrape()["DCGM_FI_DEV_GPU_TEMP"]) == 8
            config = r.bus.current.config.model_copy(
                update={"telemetry": r.bus.current.config.telemetry.model_copy(update={"dcgm_metrics": False})})
            await r.bus.update(config=config)
            # The task's turn at the switch empties the snapshot ...
            await wait_until(lambda: r.scrape() == {}, 5, "the family gone")
            passes, switched_off = r.collector.passes, r.collector.snapshot
            # ... and its next turn, an interval later, empties it again instead of making a pass.
            await wait_until(lambda: r.collector.snapshot is not switched_off, 5, "the next turn after the interval")
            assert r.scrape() == {}
            assert r.collector.passes == passes
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_pass_older_than_three_intervals_and_the_nvml_deadline_is_not_served_as_current() -> None:
    async with rig(serve=False, intervalSeconds=10) as r:
        snapshot = await r.collector.collect_once()
        assert r.collector.current is snapshot and len(snapshot.readings) == 8
        # As when the next passes hang on a driver that stopped answering: 3 x 10 s + 10 s (the default deadline).
        r.collector.snapshot = dataclasses.replace(snapshot, taken_at=time.time() - 39)
        assert r.collector.current.readings == snapshot.readings
        r.collector.snapshot = dataclasses.replace(snapshot, taken_at=time.time() - 41)
        assert r.collector.current.readings == ()
