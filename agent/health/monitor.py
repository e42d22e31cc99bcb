"""Watches NVML for XID events and samples health signals, publishing device health into NodeState."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from agent.health.policy import Verdict, classify_reading, classify_xid
from agent.nvml.backend import NvmlBackend
from agent.state import DeviceHealth, StateBus

log = logging.getLogger(__name__)

T = TypeVar("T")
NvmlCall = Callable[[Callable[[], T]], Awaitable[T]]

EVENT_WAIT_MS = 200
"""One event wait on the NVML thread; short so periodic samples interleave without concurrent NVML calls."""
SAMPLE_INTERVAL_S = 5.0


class HealthMonitor:
    """Producer of device health. An unhealthy verdict from an event sticks; one from a sample clears when
    a later sample is clean (a GPU that comes back on the bus is healthy again)."""

    def __init__(self, backend: NvmlBackend, bus: StateBus, nvml: NvmlCall[Any]) -> None:
        self._backend = backend
        self._bus = bus
        self._nvml = nvml
        self._from_events: dict[str, Verdict] = {}
        self._from_samples: dict[str, Verdict] = {}

    async def _publish(self) -> None:
        health: dict[str, DeviceHealth] = {}
        for source in (self._from_samples, self._from_events):
            for uuid, verdict in source.items():
                if verdict.action in ("unhealthy", "node-fatal") and uuid not in health:
                    health[uuid] = DeviceHealth(healthy=False, reason=verdict.reason)
        if health != dict(self._bus.current.health):
            log.warning("device health changed: %s", {u: h.reason for u, h in health.items()} or "all healthy")
            await self._bus.update(health=health)

    async def sample(self) -> None:
        gpus = self._bus.current.inventory.gpus
        samples: dict[str, Verdict] = {}
        for gpu in gpus:
            reading = await self._nvml(lambda i=gpu.index: self._backend.health(i))  # type: ignore[misc]
            verdict = classify_reading(reading)
            if verdict.action != "ignore":
                samples[gpu.uuid] = verdict
        self._from_samples = samples
        await self._publish()

    async def run(self) -> None:
        event_set = await self._nvml(self._backend.open_events)
        loop = asyncio.get_running_loop()
        next_sample = 0.0
        try:
            while True:
                if loop.time() >= next_sample:
                    await self.sample()
                    next_sample = loop.time() + SAMPLE_INTERVAL_S
                event = await self._nvml(lambda: self._backend.wait_event(event_set, EVENT_WAIT_MS))
                if event is None:
                    continue
                verdict = classify_xid(event.xid)
                log.warning("XID %d on %s: %s", event.xid, event.gpu_uuid, verdict.action)
                if verdict.action in ("unhealthy", "node-fatal"):
                    self._from_events[event.gpu_uuid] = verdict
                    await self._publish()
        finally:
            await self._nvml(lambda: self._backend.close_events(event_set))
