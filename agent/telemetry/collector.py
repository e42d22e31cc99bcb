"""The collection task: every interval, one NVML pass over all devices and one PodResources List, kept as an
immutable snapshot that scrapes read (a scrape never calls NVML or the kubelet)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent.nvml.backend import NvmlBackend
from agent.nvml.fields import DeviceReading, FieldReader
from agent.nvmlthread import BoundedCalls, NvmlCall, NvmlStuck
from agent.podresources import PodResourcesUnavailable, allocations
from agent.state import StateBus

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


class TelemetryCollector:
    """Producer of the dcgm-family snapshot."""

    def __init__(self, backend: NvmlBackend, bus: StateBus, nvml: NvmlCall,
                 xid_counts: Callable[[], Mapping[tuple[str, int], int]],
                 late: Callable[[], object] = lambda: None) -> None:
        """`late`: called when a GPU's read is not waited for any longer (NvmlThread.overdue, which sets its worker
        aside so that the next GPU's read does not queue behind it)."""
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

    async def _holders(self) -> dict[str, tuple[Holder, ...]]:
        socket = self._socket
        if not socket.exists():
            # No kubelet here (a simulated node, or one not mounting the socket): say so once, not each pass.
            why = f"no kubelet PodResources socket at {socket}: GPU metrics carry no pod labels"
            if self._podresources_down != why:
                log.info("%s", why)
                self._podresources_down = why
            return {}
        try:
            found = await allocations(socket)
        except PodResourcesUnavailable as err:
            if self._podresources_down != str(err):
                log.warning("no pod labels on GPU metrics: %s", err)
                self._podresources_down = str(err)
            return {}
        if self._podresources_down is not None:
            log.info("kubelet PodResources answers again: pod attribution on GPU metrics resumed")
            self._podresources_down = None
        return holders_by_device(found)

    async def collect_once(self) -> Snapshot:
        started = time.perf_counter()
        holders = await self._holders()
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
