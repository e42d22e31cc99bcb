"""Metrics, /healthz and /readyz as a Prometheus server and the kubelet's probes see them."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.config import parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.podresources_v1 import api_pb2 as pr
from agent.podresources_v1 import api_pb2_grpc as pr_grpc
from tests.plugin_harness import carve_mig, running_agent, short_dir, wait_until


async def get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "uuid"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


FAST_SAMPLES = parse_config("version: v1\nhealth: {sampleIntervalSeconds: 0.1, recoveryChecks: 1000}\n")


async def test_metrics_reflect_health_xids_and_allocations() -> None:
    async with running_agent("dgx-h100", FAST_SAMPLES, metrics_port=0) as rig:
        port = rig.metrics_port
        ids = [d.ID for d in rig.devices()]
        await rig.stub().Allocate(api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids[:2])]))
        rig.fake.set_utilization(5, 75)
        rig.fake.inject_xid(1, 48)
        rig.fake.inject_xid(2, 13)
        await wait_until(lambda: rig.devices()[1].health == "Unhealthy", what="GPU 1 unhealthy")
        monitor = rig.agent.monitor
        assert monitor is not None
        await wait_until(lambda: len(monitor.xid_counts) == 2, what="both XIDs counted")

        status, body = await get(port, "/metrics")
        assert status == 200
        values = samples(body)
        assert [values[("gpu_agent_gpu_healthy", (("gpu", str(i)),))] for i in range(8)] == [1, 0, 1, 1, 1, 1, 1, 1]
        assert values[("gpu_agent_gpu_xid_errors_total", (("gpu", "1"), ("xid", "48")))] == 1
        assert values[("gpu_agent_gpu_xid_errors_total", (("gpu", "2"), ("xid", "13")))] == 1
        assert values[("gpu_agent_allocations_total", (("resource", "nvidia.com/gpu"),))] == 2
        assert values[("gpu_agent_resource_devices", (("resource", "nvidia.com/gpu"),))] == 8
        assert values[("gpu_agent_resource_allocatable", (("resource", "nvidia.com/gpu"),))] == 7
        assert values[("gpu_agent_kubelet_registrations_total", (("resource", "nvidia.com/gpu"),))] == 1
        assert values[("gpu_agent_gpu_memory_total_bytes", (("gpu", "0"),))] == 81559 * 1024 * 1024
        temperatures = [k for k in values if k[0] == "gpu_agent_gpu_temperature_celsius"]
        assert len(temperatures) == 8
        await wait_until(lambda: monitor.telemetry[rig.agent.bus.current.inventory.gpus[5].uuid]
                         .utilization_pct == 75, what="a sample after the utilisation changed")
        values = samples((await get(port, "/metrics"))[1])
        assert values[("gpu_agent_gpu_utilization_ratio", (("gpu", "5"),))] == 0.75

        assert await get(port, "/healthz") == (200, "ok\n")
        assert await get(port, "/readyz") == (200, "ok\n")
        assert (await get(port, "/nope"))[0] == 404


async def test_readyz_is_false_until_registered() -> None:
    async with running_agent("single-h200", kubelet_first=False, metrics_port=0) as rig:
        port = rig.metrics_port
        assert await get(port, "/readyz") == (503, "not registered with the kubelet\n")
        await rig.kubelet.start()
        await rig.kubelet.wait_for({"nvidia.com/gpu"}, 5)
        await wait_until(lambda: rig.agent.ready()[0], what="ready")
        assert await get(port, "/readyz") == (200, "ok\n")


async def test_keys_without_effect_and_selectors_matching_nothing_are_counted_and_told() -> None:
    config = parse_config("version: v1\nflags:\n  gfd:\n    outputFile: /etc/kubernetes/node-feature-discovery/"
                          "features.d/gfd\nsharing:\n  timeSlicing:\n    resources:\n"
                          "    - {name: nvidia.com/gpu, replicas: 2, devices: [0, 11]}\n", "cfg")
    async with running_agent("dgx-h100", config, metrics_port=0) as rig:
        assert rig.agent.http is not None
        port = rig.agent.http.port
        bus = rig.agent.bus
        warning = "sharing.timeSlicing.resources[0].devices[1]: 11 selects no device of nvidia.com/gpu on this node"
        await wait_until(lambda: any(i.message == warning for i in bus.current.incidents), 5, "the warning Event")
        (incident,) = [i for i in bus.current.incidents if i.kind == "sharing-selector-unmatched"]
        assert incident.message == warning
        _, text = await get(port, "/metrics")
        values = samples(text)
        assert values[("gpu_agent_config_keys_without_effect", (("key", "flags.gfd.outputFile"),))] == 1
        assert values[("gpu_agent_sharing_unmatched_selectors", ())] == 1


class Pods(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources v1 Lister: each pod ("<namespace>/<pod>") holding one device ID."""

    def __init__(self) -> None:
        self.pods: dict[str, str] = {}

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(namespace=key.split("/")[0], name=key.split("/")[1], containers=[
                pr.ContainerResources(name="main", devices=[
                    pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[device])])])
            for key, device in self.pods.items()])


METRICS_BUDGET_BYTES = 2 * 1024 * 1024
"""The most /metrics may be on the largest node the agent serves with its pods (docs/metrics.md)."""
GPU_SECONDS_BUDGET_BYTES = 64 * 1024
"""The most of it the GPU-seconds counters may take there."""


async def test_metrics_stay_under_budget_on_16_gpus_56_mig_devices_and_200_pods() -> None:
    """16 H100s, 8 of them as 7 x 1g.10gb (56 MIG devices) and 8 time-sliced into 18 replicas; 200 pods over 40
    namespaces, one device each, GPU-seconds counted per pod: /metrics holds every namespace's and pod's
    counters and stays under the budget."""
    directory = short_dir()
    (directory / "pr").mkdir()
    fake = FakeNvml(load_node("hgx-16-nvswitch"))
    for gpu in range(8):
        carve_mig(fake, gpu, [("1g.10gb", start) for start in range(7)])
    config = parse_config(yaml.safe_dump({
        "version": "v1", "flags": {"migStrategy": "mixed"},
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 18}]}},
        "telemetry": {"intervalSeconds": 1, "chargebackByPod": True},
        "mig": {"stateDir": f"{directory}/state", "podResourcesSocket": f"{directory}/pr/pr.sock"}}))
    try:
        lister = Pods()
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(lister, server)
        server.add_insecure_port(f"unix://{directory}/pr/pr.sock")
        await server.start()
        async with running_agent("hgx-16-nvswitch", config, fake=fake, metrics_port=0, directory=directory) as rig:
            inventory = rig.agent.bus.current.inventory
            devices = [m.uuid for m in inventory.mig_devices] + [
                f"{g.uuid}::{n}" for g in inventory.gpus if not g.mig_enabled for n in range(18)]
            assert len(devices) == 56 + 8 * 18 == 200
            lister.pods = {f"ns-{i % 40}/pod-{i}": device for i, device in enumerate(devices)}
            passes = rig.agent.telemetry.passes
            await wait_until(lambda: rig.agent.telemetry.passes >= passes + 2, 10, "two passes with the pods")
            _, text = await get(rig.metrics_port, "/metrics")
    finally:
        await server.stop(None)
        shutil.rmtree(directory, ignore_errors=True)
    counted = [line for line in text.splitlines() if "gpu_seconds_total{" in line]
    assert len(counted) == 2 * 40 + 2 * 200  # held and idle, per namespace and per pod
    # dcgm-exporter's family has a series per device and pod: the 8 MIG GPUs', the 56 MIG devices' (a pod each)
    # and the 8 shared GPUs' with each of their 18 pods.
    assert sum(1 for line in text.splitlines() if line.startswith("DCGM_FI_DEV_FB_USED{")) == 8 + 56 + 8 * 18
    assert len(text.encode()) < METRICS_BUDGET_BYTES, len(text.encode())
    assert sum(len(line) + 1 for line in counted) < GPU_SECONDS_BUDGET_BYTES
