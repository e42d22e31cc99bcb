"""The collection task: every interval, one NVML pass over all devices and one PodResources List, kept as an
immutable snapshot that scrapes read (a scrape never calls NVML or the kubelet)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.nvml.backend import NvmlBackend
from agent.nvml.fields import GPU_UTIL, PROF_GR_ENGINE_ACTIVE, DeviceReading, FieldReader
from agent.nvmlthread import BoundedCalls, NvmlCall, NvmlStuck
from agent.podresources import DeviceHolder, PodResourcesUnavailable, allocations
from agent.state import NodeState, StateBus
from agent.telemetry.chargeback import GpuSecondsLedger, Held, Totals, device_shares, holds, shared_replicas

log = logging.getLogger(__name__)

T = TypeVar("T")
STALE_PASSES = 3
"""A snapshot older than this many intervals (plus the NVML deadline) is not served: NVML stopped answering."""
CLOSE_S = 1.0
"""How long the task, stopping, waits for NVML to take its GPM samples back."""


@dataclass(frozen=True)
class Holder:
    """A container holding a device."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class Snapshot:
    """What one pass found; replaced whole."""

    readings: tuple[DeviceReading, ...] = ()
    holders: Mapping[str, tuple[Holder, ...]] = field(default_factory=dict)
    """Containers by the GPU or MIG UUID they hold (replicas count for their device)."""
    last_xid: Mapping[str, int] = field(default_factory=dict)
    """The last XID of each GPU, by UUID."""
    taken_at: float = 0.0


def holders_by_device(found: list[Any]) -> dict[str, tuple[Holder, ...]]:
    """Group PodResources holders by device (a replica ID ``<id>::<n>`` counts for ``<id>``); each container once."""
    grouped: dict[str, list[Holder]] = {}
    for h in found:
        device = h.device_id.split("::", 1)[0]
        holder = Holder(h.namespace, h.pod, h.container)
        if holder not in grouped.setdefault(device, []):
            grouped[device].append(holder)
    return {device: tuple(sorted(hs, key=lambda x: (x.namespace, x.pod, x.container)))
            for device, hs in grouped.items()}


def utilization(readings: tuple[DeviceReading, ...] | list[DeviceReading]) -> dict[str, float | None]:
    """Each device's utilization, 0 to 1, by GPU or MIG UUID: DCGM_FI_DEV_GPU_UTIL / 100 where NVML gives it (a
    GPU with MIG off), else DCGM_FI_PROF_GR_ENGINE_ACTIVE (GPM: a MIG device, or a GPU, on Hopper and later from
    the second pass), else None."""
    found: dict[str, float | None] = {}
    for reading in readings:
        if GPU_UTIL in reading.values:
            found[reading.uuid] = reading.values[GPU_UTIL] / 100
        else:
            found[reading.uuid] = reading.values.get(PROF_GR_ENGINE_ACTIVE)
    return found


class TelemetryCollector:
    """Producer of the dcgm-family snapshot, and of the GPU-seconds per namespace (`ledger`)."""

    def __init__(self, backend: NvmlBackend, bus: StateBus, nvml: NvmlCall,
                 xid_counts: Callable[[], Mapping[tuple[str, int], int]],
                 late: Callable[[], object] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 claims: Callable[[], list[DeviceHolder]] = list) -> None:
        """`late`: called when a GPU's read is not waited for any longer (NvmlThread.overdue, which sets its worker
        aside so that the next GPU's read does not queue behind it). `clock`: the monotonic clock the GPU-seconds
        are counted by. `claims`: the devices of the DRA claims prepared on the node (DraKubeletPlugin.holders),
        counted beside the device plugin's allocations."""
        self._claims = claims
        self._bus = bus
        self._nvml = nvml
        self._bounded = BoundedCalls(nvml, lambda: bus.current.config.health.nvml_deadline_seconds + 0.5, late)
        self._xid_counts = xid_counts
        self._seen_xids: dict[tuple[str, int], int] = {}
        self._last_xid: dict[str, int] = {}
        self._podresources_down: str | None = None
        self.reader = FieldReader(backend)
        self.snapshot = Snapshot()
        self.passes = 0
        self.nvml_calls = 0
        """NVML calls the last pass made."""
        self.pass_seconds = 0.0
        self.ledger = GpuSecondsLedger()
        self.usage = ChargebackCollector(self.ledger)
        """The ledger's counters for the agent's registry (Metrics.watch_usage)."""
        self.clock = clock
        """The monotonic clock the GPU-seconds are counted by (read once per pass)."""
        self._shapes: tuple[NodeState, dict[str, Fraction], dict[str, int]] | None = None

    @property
    def enabled(self) -> bool:
        return self._bus.current.config.telemetry.dcgm_metrics

    @property
    def _socket(self) -> Path:
        return self._bus.current.config.mig.pod_resources_socket

    def _note_xids(self) -> dict[str, int]:
        """The newest XID per GPU: the code whose count rose since the last pass (the highest, when several did)."""
        counts = dict(self._xid_counts())
        risen: dict[str, list[int]] = {}
        for (uuid, code), count in counts.items():
            if count > self._seen_xids.get((uuid, code), 0):
                risen.setdefault(uuid, []).append(code)
        for uuid, codes in risen.items():
            self._last_xid[uuid] = max(codes)
        self._seen_xids = counts
        return dict(self._last_xid)

    async def _listing(self) -> list[DeviceHolder] | None:
        """The devices containers hold, from the kubelet; None where it cannot say."""
        socket = self._socket
        if not socket.exists():
            # No kubelet here (a simulated node, or one not mounting the socket): say so once, not each pass.
            why = f"no kubelet PodResources socket at {socket}: GPU metrics carry no pod labels"
            if self._podresources_down != why:
                log.info("%s", why)
                self._podresources_down = why
            return None
        try:
            found = await allocations(socket)
        except PodResourcesUnavailable as err:
            if self._podresources_down != str(err):
                log.warning("no pod labels on GPU metrics: %s", err)
                self._podresources_down = str(err)
            return None
        if self._podresources_down is not None:
            log.info("kubelet PodResources answers again: pod attribution on GPU metrics resumed")
            self._podresources_down = None
        return found

    def _charge(self, found: list[DeviceHolder] | None, readings: list[DeviceReading]) -> None:
        """Feed the GPU-seconds ledger what this pass found: the device plugin's allocations and the devices of the
        prepared DRA claims (their pod label the claim's name). A pass without a PodResources listing feeds
        nothing, so the next pass with one charges the time since the last that had one (up to the ledger's cap)."""
        if found is None:
            return
        found = [*found, *self._claims()]
        state = self._bus.current
        shapes = self._shapes
        if shapes is None or shapes[0] is not state:
            shapes = (state, device_shares(state.inventory), shared_replicas(state))
            self._shapes = shapes
        telemetry = state.config.telemetry
        self.ledger.record(self.clock(), holds((Held(h.namespace, h.pod, h.device_id) for h in found),
                                                shapes[1], shapes[2]),
                           utilization(readings), interval_s=telemetry.interval_seconds,
                           idle_below=telemetry.idle_utilization_threshold, by_pod=telemetry.chargeback_by_pod)

    async def collect_once(self) -> Snapshot:
        started = time.perf_counter()
        found = await self._listing()
        holders = holders_by_device(found or [])
        inventory = self._bus.current.inventory

        def begin() -> None:
            self.reader.note_allocated(holders)
            self.reader.begin(inventory)

        # One NVML call a GPU, each naming it and waited for at most the deadline: a GPU whose calls hang is the
        # one reported, and has no series, while the others are read.
        readings: list[DeviceReading] = []
        with contextlib.suppress(NvmlStuck):
            await self._bounded("begin", begin, what="the telemetry pass")
            for gpu in inventory.gpus:
                with contextlib.suppress(NvmlStuck):
                    readings += await self._bounded(gpu.index, functools.partial(self.reader.read_gpu, inventory, gpu),
                                                    what="the telemetry pass", gpu=gpu.index)
        self.nvml_calls = self.reader.calls
        self.snapshot = Snapshot(tuple(readings), holders, self._note_xids(), time.time())
        self._charge(found, readings)
        self.passes += 1
        self.pass_seconds = time.perf_counter() - started
        return self.snapshot

    @property
    def current(self) -> Snapshot:
        """The last pass's snapshot while it is current; an empty one once it is older than STALE_PASSES intervals
        and the NVML deadline (a pass hangs on a driver that stopped answering): old readings are not served as
        if they were new."""
        snapshot = self.snapshot
        config = self._bus.current.config
        limit = STALE_PASSES * config.telemetry.interval_seconds + config.health.nvml_deadline_seconds
        if snapshot.taken_at and time.time() - snapshot.taken_at > limit:
            return Snapshot()
        return snapshot

    async def run(self) -> None:
        try:
            while True:
                state = self._bus.current
                if self.enabled:
                    await self.collect_once()
                else:
                    self.snapshot = Snapshot()
                    self.ledger.pause()
                interval = state.config.telemetry.interval_seconds
                # A config change (the family switched on or off, another interval) starts a pass at once.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await self._config_change(state.config)
        finally:
            # The GPM samples given back, unless the driver does not answer: a stop never waits on it for long.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_S):
                    await self._nvml(self.reader.close)

    async def _config_change(self, config: object) -> None:
        state = self._bus.current
        while state.config.telemetry == getattr(config, "telemetry", None):
            state = await self._bus.wait_newer(state.version)


class ChargebackCollector(Collector):
    """The ledger's GPU-seconds as Prometheus counters, per namespace and (with telemetry.chargebackByPod) per
    pod. The families are always served; a namespace or pod has samples while the ledger keeps it."""

    def __init__(self, ledger: GpuSecondsLedger) -> None:
        self._ledger = ledger

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        ledger = self._ledger
        families: tuple[tuple[str, str, list[str], Mapping[Any, Totals]], ...] = (
            ("gpu_agent_namespace_gpu_seconds", "GPU-seconds held by the namespace's pods (a MIG device or a "
             "replica counts its share of a GPU).", ["namespace"], ledger.namespaces),
            ("gpu_agent_pod_gpu_seconds", "GPU-seconds held by the pod (with telemetry.chargebackByPod).",
             ["namespace", "pod"], ledger.pods),
        )
        for name, doc, labels, table in families:
            held = CounterMetricFamily(name, doc, labels=labels)
            idle = CounterMetricFamily(name.replace("_gpu_seconds", "_idle_gpu_seconds"),
                                       "Of those, GPU-seconds held while the device's utilization was under "
                                       "telemetry.idleUtilizationThreshold.", labels=labels)
            for key, totals in sorted(table.items()):
                values = [key] if isinstance(key, str) else list(key)
                held.add_metric(values, float(totals.held))
                idle.add_metric(values, float(totals.idle))
            yield held
            yield idle
