"""GPU-seconds per namespace: the ledger over a simulated day of pods, the shares of MIG devices and replicas, the
bound on pod series, the telemetry pass feeding it from a stand-in kubelet PodResources server into /metrics, and
the config keys."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from fractions import Fraction

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.config import ConfigError, parse_config
from agent.metrics import Metrics
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvmlthread import NvmlThread
from agent.podresources import CLAIM, DeviceHolder
from agent.podresources_v1 import api_pb2 as pr
from agent.podresources_v1 import api_pb2_grpc as pr_grpc
from agent.state import NodeState, StateBus
from agent.telemetry.chargeback import (
    OTHER_PODS,
    GpuSecondsLedger,
    Held,
    Hold,
    device_shares,
    holds,
    shared_replicas,
)
from agent.telemetry.collector import TelemetryCollector
from tests.builders import MIXED_GPU0, node, serving_pod_resources
from tests.plugin_harness import carve_mig, short_dir

HOUR = 3600
TIME_SLICED_GPU3 = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                    "    - {name: nvidia.com/gpu, replicas: 4, devices: [3]}\n")


def day_node() -> NodeState:
    """A DGX H100: GPU 2 in MIG mode as 3g.40gb + 2g.20gb + 1g.10gb, GPU 3 time-sliced into 4 replicas."""
    return node("dgx-h100", TIME_SLICED_GPU3, mig={2: MIXED_GPU0})


# --- shares -------------------------------------------------------------------------------------------------------


def test_a_gpu_counts_one_a_mig_device_its_compute_slices_over_seven_a_replica_a_quarter() -> None:
    state = day_node()
    gpus = state.inventory.gpus
    migs = {m.profile: m.uuid for m in state.inventory.mig_devices}
    shares = device_shares(state.inventory)
    assert shares[gpus[0].uuid] == 1
    assert (shares[migs["3g.40gb"]], shares[migs["2g.20gb"]], shares[migs["1g.10gb"]]) == (
        Fraction(3, 7), Fraction(2, 7), Fraction(1, 7))
    assert shared_replicas(state) == {gpus[3].uuid: 4}


def test_containers_of_one_pod_count_once_and_holders_never_exceed_their_device() -> None:
    shares = {"GPU-a": Fraction(1), "MIG-b": Fraction(3, 7)}
    found = holds([
        Held("ns", "p", "GPU-a"), Held("ns", "p", "GPU-a"),  # two containers of one pod: one GPU
        Held("ns", "q", "MIG-b::0"), Held("ns", "q", "MIG-b::1"),  # two of MIG-b's 4 replicas
        Held("other", "r", "MIG-b::2"),
    ], shares, {"MIG-b": 4})
    assert found == [Hold("ns", "p", "GPU-a", Fraction(1)), Hold("ns", "q", "MIG-b", Fraction(3, 14)),
                     Hold("other", "r", "MIG-b", Fraction(3, 28))]
    # A replica the plan no longer shares (the sharing config changed while the pod ran) counts as the whole
    # device; with another holder of the whole GPU beside it, both are scaled so that the GPU counts once: 1 and 1
    # become 1/2 and 1/2.
    found = holds([Held("a", "x", "GPU-a::0"), Held("b", "y", "GPU-a")], shares, {})
    assert found == [Hold("a", "x", "GPU-a", Fraction(1, 2)), Hold("b", "y", "GPU-a", Fraction(1, 2))]


# --- a simulated day ------------------------------------------------------------------------------------------------

INTERVAL = 60
MISSED = {3 * HOUR}
"""One pass that did not happen: the next one charges both intervals."""
STALL = (12 * HOUR, 12 * HOUR + 600)
"""No pass between these: the pass at the end charges 2 intervals, not 10."""


def day_passes() -> list[int]:
    return [t for t in range(0, 24 * HOUR + 1, INTERVAL) if t not in MISSED and not STALL[0] < t < STALL[1]]


def test_a_simulated_day_of_pods() -> None:
    state = day_node()
    gpus = [g.uuid for g in state.inventory.gpus]
    mig3g = next(m.uuid for m in state.inventory.mig_devices if m.profile == "3g.40gb")
    shares, replicas = device_shares(state.inventory), shared_replicas(state)
    ledger = GpuSecondsLedger()
    scraped: dict[str, tuple[float, float]] = {}
    scraped_pods: dict[tuple[str, str], tuple[float, float]] = {}
    present_at_end = set()
    for t in day_passes():
        held: list[Held] = []
        utilization: dict[str, float | None] = {}
        if t <= 8 * HOUR:  # research/train-a: GPUs 0 and 1, two containers on GPU 0; idle from 6 h on
            held += [Held("research", "train-a", gpus[0]), Held("research", "train-a", gpus[0]),
                     Held("research", "train-a", gpus[1])]
            utilization[gpus[0]] = utilization[gpus[1]] = 0.01 if t > 6 * HOUR else 0.9
        if 2 * HOUR <= t <= 20 * HOUR:  # inference/serve: the 3g.40gb; idle 10-11 h; no reading 14-15 h
            held.append(Held("inference", "serve", mig3g))
            utilization[mig3g] = 0.02 if 10 * HOUR < t <= 11 * HOUR else 0.6
            if 14 * HOUR < t <= 15 * HOUR:
                del utilization[mig3g]
        if 9 * HOUR <= t <= 17 * HOUR:  # batch: job-1 two of GPU 3's replicas, job-2 one; idle 16-17 h
            held += [Held("batch", "job-1", f"{gpus[3]}::0"), Held("batch", "job-1", f"{gpus[3]}::1"),
                     Held("batch", "job-2", f"{gpus[3]}::2")]
            utilization[gpus[3]] = 0.0 if t > 16 * HOUR else 0.5
        if t >= 18 * HOUR:  # dev/notebook: GPU 4 at 4 % utilization, under the 5 % threshold
            held.append(Held("dev", "notebook", gpus[4]))
            utilization[gpus[4]] = 0.04
        if 21 * HOUR <= t <= 22 * HOUR:  # edge/probe: GPU 5 at exactly the threshold, which is not idle
            held.append(Held("edge", "probe", gpus[5]))
            utilization[gpus[5]] = 0.05
        ledger.record(float(t), holds(held, shares, replicas), utilization, interval_s=INTERVAL, idle_below=0.05,
                      by_pod=True)
        # As Prometheus sees it, scraping after every pass: the last value of each series.
        scraped.update({ns: (float(v.held), float(v.idle)) for ns, v in ledger.namespaces.items()})
        scraped_pods.update({k: (float(v.held), float(v.idle)) for k, v in ledger.pods.items()})
        present_at_end = set(ledger.namespaces)

    # research: passes 0 .. 8 h; the first pass charges nothing, every later one 60 s (the missed pass at 3 h
    # makes the next charge 120 s): 8 h = 28800 s x 2 GPUs. Idle: the passes after 6 h, 2 h = 7200 s x 2.
    # inference: passes 2 .. 20 h, 1081 passes x 60 s = 64860 s, less the stall at 12 h (600 s without a pass,
    # charged 120 s): 64380 s x 3/7. Idle 10-11 h: 3600 s x 3/7; 14-15 h without a reading is not idle.
    # batch: passes 9 .. 17 h, 481 x 60 = 28860 s less the stall's 480 = 28380 s x 3/4 (job-1 2/4, job-2 1/4);
    # idle 16-17 h: 3600 s x 3/4.
    # dev: passes 18 .. 24 h, 361 x 60 = 21660 s, all idle. edge: passes 21 .. 22 h, 61 x 60 = 3660 s, not idle.
    assert scraped == {
        "research": (57600.0, 14400.0),
        "inference": (193140 / 7, 10800 / 7),
        "batch": (21285.0, 2700.0),
        "dev": (21660.0, 21660.0),
        "edge": (3660.0, 0.0),
    }
    assert scraped_pods == {
        ("research", "train-a"): (57600.0, 14400.0),
        ("inference", "serve"): (193140 / 7, 10800 / 7),
        ("batch", "job-1"): (14190.0, 1800.0),
        ("batch", "job-2"): (7095.0, 900.0),
        ("dev", "notebook"): (21660.0, 21660.0),
        ("edge", "probe"): (3660.0, 0.0),
    }
    # Series of namespaces that held nothing for 10 minutes are gone: at 24 h only dev's (edge left at 22 h).
    assert present_at_end == {"dev"}


def test_a_stall_charges_at_most_two_intervals_and_a_pause_charges_nothing() -> None:
    ledger = GpuSecondsLedger()
    hold = [Hold("ns", "p", "GPU-a", Fraction(1))]
    charged = [ledger.record(t, hold, {}, interval_s=10, idle_below=0.05, by_pod=False)
               for t in (100.0, 110.0, 125.0, 3725.0)]
    assert charged == [0.0, 10.0, 15.0, 20.0]
    ledger.pause()
    assert ledger.record(3800.0, hold, {}, interval_s=10, idle_below=0.05, by_pod=False) == 0.0
    assert ledger.record(3810.0, hold, {}, interval_s=10, idle_below=0.05, by_pod=False) == 10.0
    assert float(ledger.namespaces["ns"].held) == 55.0
    assert ledger.pods == {}


def test_pods_beyond_the_limit_are_counted_in_their_namespaces_other_series_until_they_end() -> None:
    ledger = GpuSecondsLedger(max_pods=3, retain_s=600)

    def tick(t: float, pods: list[str]) -> None:
        ledger.record(t, [Hold(p.split("/")[0], p.split("/")[1], f"GPU-{p}", Fraction(1)) for p in pods], {},
                      interval_s=60, idle_below=0.05, by_pod=True)

    tick(0, ["a/p1", "a/p2"])
    tick(60, ["a/p1", "a/p2", "b/p3", "b/p4", "a/p5"])  # p4 and p5 find the 3 pod series taken
    tick(120, ["a/p1", "a/p2", "b/p3", "b/p4", "a/p5"])
    assert {k: float(v.held) for k, v in ledger.pods.items()} == {
        ("a", "p1"): 120.0, ("a", "p2"): 120.0, ("b", "p3"): 120.0,
        ("b", OTHER_PODS): 120.0, ("a", OTHER_PODS): 120.0}
    # p1 ends at 120 s; its series stays 600 s (the pass at 780 drops it), then its place is free for a new pod,
    # while p4 and p5 stay folded for as long as they run.
    for t in range(180, 781, 60):
        tick(t, ["a/p2", "b/p3", "b/p4", "a/p5"])
        assert (("a", "p1") in ledger.pods) == (t < 780)
    tick(840, ["a/p2", "b/p3", "b/p4", "a/p5", "b/p6"])
    assert set(ledger.pods) == {("a", "p2"), ("b", "p3"), ("b", "p6"), ("b", OTHER_PODS), ("a", OTHER_PODS)}
    assert float(ledger.pods[("b", "p6")].held) == 60.0
    assert float(ledger.pods[("a", OTHER_PODS)].held) == 840.0
    # Namespace totals are whole whatever the pod series: a has p1 120 + p2 840 + p5 840 (first seen at the pass at
    # 60 s, which charges 0-60 s), b p3 840 + p4 840 + p6 60.
    assert {k: float(v.held) for k, v in ledger.namespaces.items()} == {"a": 1800.0, "b": 1740.0}


# --- the telemetry pass into /metrics ---------------------------------------------------------------------------


class Lister(pr_grpc.PodResourcesListerServicer):
    """The kubelet's v1 Lister: pods by (namespace, name), device IDs by container."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, list[str]]] = {}

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(namespace=ns, name=name, containers=[
                pr.ContainerResources(name=container, devices=[
                    pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids)])
                for container, ids in containers.items()])
            for (ns, name), containers in self.pods.items()])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def telemetry_rig(telemetry: dict[str, object], claims: list[DeviceHolder] | None = None,
                        ) -> AsyncIterator[tuple[TelemetryCollector, Lister, Clock, FakeNvml, StateBus]]:
    """A telemetry task on a DGX H100 (GPU 2 in a mixed MIG layout, GPU 3 time-sliced by 4) with a stand-in
    PodResources, a clock the test moves and the prepared DRA claims `claims` (they may change while it runs), in
    a short directory of its own, removed afterwards."""
    directory = short_dir()
    socket = directory / "pr.sock"
    config = parse_config(yaml.safe_dump({"version": "v1", "telemetry": telemetry,
                                          "mig": {"podResourcesSocket": str(socket)},
                                          "sharing": {"timeSlicing": {"resources": [
                                              {"name": "nvidia.com/gpu", "replicas": 4, "devices": [3]}]}}}))
    fake = FakeNvml(load_node("dgx-h100"))
    carve_mig(fake, 2, MIXED_GPU0)
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    bus = StateBus(NodeState(version=1, inventory=backend.inventory(), config=config))
    nvml = NvmlThread()
    clock = Clock()
    held = claims if claims is not None else []
    collector = TelemetryCollector(backend, bus, nvml, dict, clock=clock, claims=lambda: list(held))
    try:
        async with serving_pod_resources(socket, Lister()) as lister:
            yield collector, lister, clock, fake, bus
    finally:
        nvml.close()
        shutil.rmtree(directory, ignore_errors=True)


def chargeback_samples(metrics: Metrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if "gpu_seconds" in sample.name:
                found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def test_telemetry_passes_count_gpu_seconds_into_metrics() -> None:
    async with telemetry_rig({"intervalSeconds": 10, "chargebackByPod": True}) as rig:
        collector, lister, clock, fake, bus = rig
        metrics = Metrics()
        metrics.watch_usage(collector.usage)
        gpus = [g.uuid for g in bus.current.inventory.gpus]
        mig3g = next(m.uuid for m in bus.current.inventory.mig_devices if m.profile == "3g.40gb")
        lister.pods[("research", "train")] = {"a": [gpus[0]], "b": [gpus[0], gpus[1]]}
        lister.pods[("inference", "serve")] = {"main": [mig3g]}
        lister.pods[("batch", "job")] = {"main": [f"{gpus[3]}::0", f"{gpus[3]}::2"]}
        fake.set_workload(0, 0.8)
        fake.set_workload(1, 0.02)  # under 5 %: idle
        fake.set_workload(3, 0.5)
        await collector.collect_once()  # the first pass charges nothing
        assert chargeback_samples(metrics)["gpu_agent_namespace_gpu_seconds_total"] == {
            (("namespace", "batch"),): 0.0, (("namespace", "inference"),): 0.0,
            (("namespace", "research"),): 0.0}
        clock.now += 10
        await collector.collect_once()
        clock.now += 15  # a late pass: 15 s
        await collector.collect_once()
        samples = chargeback_samples(metrics)
    # 25 s: research 2 GPUs (GPU 1 idle), inference 3/7 (the fake driver keeps a held MIG device busy: not idle;
    # the first pass's reading has no utilization yet, GPM's needing two samples), batch 2 of GPU 3's 4 replicas.
    assert samples["gpu_agent_namespace_gpu_seconds_total"] == {
        (("namespace", "batch"),): 12.5, (("namespace", "inference"),): 75 / 7, (("namespace", "research"),): 50.0}
    assert samples["gpu_agent_namespace_idle_gpu_seconds_total"] == {
        (("namespace", "batch"),): 0.0, (("namespace", "inference"),): 0.0, (("namespace", "research"),): 25.0}
    assert samples["gpu_agent_pod_gpu_seconds_total"] == {
        (("namespace", "batch"), ("pod", "job")): 12.5, (("namespace", "inference"), ("pod", "serve")): 75 / 7,
        (("namespace", "research"), ("pod", "train")): 50.0}
    assert samples["gpu_agent_pod_idle_gpu_seconds_total"][(("namespace", "research"), ("pod", "train"))] == 25.0


async def test_without_chargeback_by_pod_only_namespaces_have_samples() -> None:
    async with telemetry_rig({"idleUtilizationThreshold": 0.6}) as rig:
        collector, lister, clock, fake, bus = rig
        metrics = Metrics()
        metrics.watch_usage(collector.usage)
        lister.pods[("research", "train")] = {"a": [bus.current.inventory.gpus[0].uuid]}
        fake.set_workload(0, 0.5)  # under the 60 % threshold
        await collector.collect_once()
        clock.now += 10
        await collector.collect_once()
        samples = chargeback_samples(metrics)
    assert samples == {"gpu_agent_namespace_gpu_seconds_total": {(("namespace", "research"),): 10.0},
                       "gpu_agent_namespace_idle_gpu_seconds_total": {(("namespace", "research"),): 10.0}}


async def test_the_gpus_of_prepared_dra_claims_count_for_the_claims_namespace() -> None:
    claims: list[DeviceHolder] = []
    async with telemetry_rig({"intervalSeconds": 10, "chargebackByPod": True}, claims) as rig:
        collector, lister, clock, fake, bus = rig
        metrics = Metrics()
        metrics.watch_usage(collector.usage)
        gpus = [g.uuid for g in bus.current.inventory.gpus]
        # A claim of two whole GPUs, one of them idle, beside a device plugin pod of another namespace.
        claims += [DeviceHolder("vision", "train-gpus-x7k2p", "", CLAIM, gpus[5]),
                   DeviceHolder("vision", "train-gpus-x7k2p", "", CLAIM, gpus[6])]
        lister.pods[("research", "train")] = {"a": [gpus[0]]}
        fake.set_workload(5, 0.9)
        fake.set_workload(6, 0.01)
        fake.set_workload(0, 0.9)
        await collector.collect_once()
        clock.now += 10
        await collector.collect_once()
        samples = chargeback_samples(metrics)
    assert samples["gpu_agent_namespace_gpu_seconds_total"] == {
        (("namespace", "research"),): 10.0, (("namespace", "vision"),): 20.0}
    assert samples["gpu_agent_namespace_idle_gpu_seconds_total"] == {
        (("namespace", "research"),): 0.0, (("namespace", "vision"),): 10.0}
    assert samples["gpu_agent_pod_gpu_seconds_total"][(("namespace", "vision"), ("pod", "train-gpus-x7k2p"))] == 20


# --- config -------------------------------------------------------------------------------------------------------


def test_the_defaults() -> None:
    telemetry = parse_config("version: v1\n").telemetry
    assert (telemetry.idle_utilization_threshold, telemetry.chargeback_by_pod) == (0.05, False)


@pytest.mark.parametrize(("value", "line"), [
    ("idleUtilizationThreshold: 5", "c.yaml: telemetry.idleUtilizationThreshold: got 5; must be at most 1.0"),
    ("idleUtilizationThreshold: -0.1", "c.yaml: telemetry.idleUtilizationThreshold: got -0.1; must be at least 0.0"),
    ("idleUtilizationThreshold: '5%'", "c.yaml: telemetry.idleUtilizationThreshold: got '5%'; must be a number"),
    ("chargebackByPod: 'yes'", "c.yaml: telemetry.chargebackByPod: got 'yes'; must be true or false"),
])
def test_a_bad_value_is_one_line(value: str, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(f"version: v1\ntelemetry: {{{value}}}\n", "c.yaml")
    assert str(err.value) == line
