"""Watches NVML for XID events and samples health signals, publishing device health into NodeState."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent.config import HealthSettings
from agent.health.policy import NVML_UNRESPONSIVE, Verdict, classify_reading, classify_xid
from agent.nvml.backend import EventSetGone, NvmlBackend
from agent.nvml.records import HealthReading, NodeInventory
from agent.nvmlthread import BoundedCalls, Call, NvmlCall, NvmlStuck, NvmlThread
from agent.state import DeviceHealth, StateBus

log = logging.getLogger(__name__)

LOST = HealthReading(uuid="", lost=True)
"""The sample of a GPU NVML cannot read whole."""

EVENT_WAIT_MS = 500
"""One event wait on the events thread (an event ends it at once); bounded so that a stop or a lost event set is
noticed within it."""
STALE_SAMPLES = 3
"""A sample older than this many intervals (plus the NVML deadline) is not served as current."""
RECOUNT_S = 600.0
"""A fault that changes only in a count (uncorrected ECC errors) is reported again at most this often."""
WATCH_S = 0.25
"""How often the NVML threads are looked at for a call past its deadline."""


def _kind(reason: str) -> str:
    """A fault's reason without the count it starts with ("N uncorrected ECC error(s) since the last reset"); an
    XID's ("XID 48") is its own."""
    return re.sub(r"^\d+ ", "N ", reason)


def _drop(wait: asyncio.Future[Any]) -> None:
    """Take the outcome of a wait for events nobody will handle (the set was freed under it)."""
    if not wait.cancelled():
        wait.exception()


class HealthMonitor:
    """Producer of device health.

    A fault (from an XID or a sample) makes the GPU unhealthy at once. It is healthy again only after
    `recoveryChecks` consecutive clean samples with no new fault: a GPU off the bus stays faulty until it
    answers, one with uncorrected ECC errors until it is reset.
    """

    def __init__(self, backend: NvmlBackend, bus: StateBus, nvml: NvmlCall, events: NvmlCall | None = None,
                 watched: Sequence[NvmlThread] = ()) -> None:
        self._backend = backend
        self._bus = bus
        self._nvml = nvml
        self._events = events or nvml
        """Where the wait for XID events runs: apart from the other calls, so neither holds up the other."""
        self._watched = tuple(watched)
        """The NVML threads whose calls have deadlines: a call past its deadline is a fault."""
        self._bounded = BoundedCalls(nvml, lambda: self._policy.nvml_deadline_seconds + 2 * WATCH_S,
                                     lambda: [thread.overdue() for thread in self._watched])
        """The health samples, each waited for at most the deadline: a GPU that hangs holds up no other's."""
        self._stuck: dict[Call, int | None] = {}
        """The calls past their deadline, reported, still running (with the GPU each concerns)."""
        self._faults: dict[str, Verdict] = {}
        self._clean: dict[str, int] = {}
        self._warned: dict[str, str] = {}
        self._reported: dict[str, float] = {}
        """When each GPU's fault was last reported (by `clock`)."""
        self.clock: Callable[[], float] = time.monotonic
        self._warn_xids: dict[tuple[str, int], int] = {}
        """Warn-level XIDs since the last sample, by (GPU UUID, XID): one warning each, with the count."""
        self._pending: list[tuple[str, str, str]] = []
        self.telemetry: dict[str, HealthReading] = {}
        """The latest sample of every GPU, by UUID (replaced whole; metrics read `current_readings`)."""
        self.sampled_at: float | None = None
        """When the last sample ended (time.monotonic())."""
        self.xid_counts: dict[tuple[str, int], int] = {}
        """XID events seen, by (GPU UUID, XID)."""
        self.read_errors = 0
        """Samples NVML failed for no reason tied to the GPU; they count neither as faults nor as clean."""
        self.events_seen = 0
        """XID events taken from NVML so far (simulate waits on this)."""
        self._event_set: Any = None
        self._wait: asyncio.Future[Any] | None = None
        """The wait for events in flight, kept across a restart of the monitor."""

    def _fault(self, uuid: str, verdict: Verdict) -> None:
        """The GPU is faulty: reported when its fault changes, but a fault that differs only in a count (a
        growing uncorrected ECC count) at most once per RECOUNT_S, so a steady fault is one line and no new state
        version per sample."""
        self._clean[uuid] = 0
        known = self._faults.get(uuid)
        if known == verdict:
            return
        now = self.clock()
        if (known is not None and known.action == verdict.action and _kind(known.reason) == _kind(verdict.reason)
                and now - self._reported.get(uuid, now) < RECOUNT_S):
            return
        self._faults[uuid] = verdict
        self._reported[uuid] = now
        self._pending.append((uuid, "fault", verdict.reason))

    def _warn(self, uuid: str, reason: str) -> None:
        if self._warned.get(uuid) != reason:
            self._warned[uuid] = reason
            self._pending.append((uuid, "warning", reason))

    def _clean_sample(self, uuid: str) -> None:
        """A sample with no fault (a warning may still stand) counts towards recovery."""
        self._clean[uuid] = self._clean.get(uuid, 0) + 1
        fault = self._faults.get(uuid)
        if fault is not None and self._clean[uuid] >= self._policy.recovery_checks:
            del self._faults[uuid]
            self._pending.append((uuid, "recovered", f"recovered from {fault.reason}"))

    @property
    def _policy(self) -> HealthSettings:
        return self._bus.current.config.health

    async def _publish(self, inventory: NodeInventory | None = None) -> None:
        """Publish the health the faults give, with the incidents since the last publish and, where given, an
        inventory read anew; nothing when none of them changed anything."""
        health = {
            uuid: DeviceHealth(healthy=False, reason=v.reason, node_fatal=v.action == "node-fatal")
            for uuid, v in self._faults.items()
        }
        if health == dict(self._bus.current.health) and not self._pending and inventory is None:
            return
        for uuid, kind, message in self._pending:
            level = logging.INFO if kind == "recovered" else logging.WARNING
            log.log(level, "GPU %s: %s: %s", uuid, kind, message)
        pending, self._pending = self._pending, []
        if inventory is None:
            await self._bus.record(pending, health=health)
        else:
            await self._bus.record(pending, health=health, inventory=inventory)

    async def sample(self) -> None:
        """Read every GPU's health signals once and publish what changed. A GPU the inventory lists as lost that
        answers again has the inventory read anew first (it is served from then on, through the usual recovery);
        until NVML reads it whole, it stays lost whatever its sample says."""
        telemetry = {}
        state = self._bus.current
        readings = {}
        for gpu in state.inventory.gpus:
            try:
                readings[gpu.index] = await self._bounded(
                    gpu.index, lambda i=gpu.index: self._backend.health(i),  # type: ignore[misc]
                    what="the health sample", gpu=gpu.index)
            except NvmlStuck:
                continue  # its call hangs: no reading (the watch reports the call), the other GPUs are sampled
        inventory = state.inventory
        if any(g.lost and g.index in readings and not readings[g.index].lost for g in inventory.gpus):
            try:
                inventory = await self._bounded("inventory", self._backend.inventory, what="the inventory")
            except NvmlStuck:
                inventory = state.inventory
            back = [g for g in inventory.gpus if not g.lost and state.inventory.gpus[g.index].lost]
            for gpu in back:
                log.info("GPU %d %s answers NVML again and is read whole", gpu.index, gpu.uuid)
                known = state.inventory.gpus[gpu.index].uuid
                if known != gpu.uuid and known in self._faults:
                    # Lost since before anything was read of it: its fault goes on under the UUID NVML now gives,
                    # and ends, as any other, after the configured clean samples.
                    self._faults[gpu.uuid] = self._faults.pop(known)
                    self._clean[gpu.uuid] = self._clean.pop(known, 0)
        for gpu in inventory.gpus:
            found = readings.get(gpu.index)
            if found is None:
                # Its sample hangs: no reading served, and no clean sample counted. A GPU the inventory could not
                # read is faulty all the same (the watch tells why, once its call is past the deadline).
                if gpu.lost and gpu.uuid not in self._faults:
                    self._fault(gpu.uuid, classify_reading(LOST, self._policy))
                continue
            reading = LOST if gpu.lost and not found.lost else found
            # (a GPU lost in the inventory stays lost until NVML reads it whole, whatever some of its calls say)
            if reading.unreadable is not None:
                # Neither a fault nor a clean sample: keep the last reading and judge again next time.
                self.read_errors += 1
                log.warning("GPU %s: health sample failed: %s", gpu.uuid, reading.unreadable)
                if gpu.uuid in self.telemetry:
                    telemetry[gpu.uuid] = self.telemetry[gpu.uuid]
                continue
            telemetry[gpu.uuid] = reading
            verdict = classify_reading(reading, self._policy)
            if verdict.faulty:
                self._fault(gpu.uuid, verdict)
            else:
                if verdict.action == "warn":
                    self._warn(gpu.uuid, verdict.reason)
                else:
                    self._warned.pop(gpu.uuid, None)
                self._clean_sample(gpu.uuid)
        self.telemetry = telemetry
        self.sampled_at = time.monotonic()
        warned, self._warn_xids = self._warn_xids, {}
        for (uuid, xid), count in warned.items():
            self._pending.append((uuid, "warning", f"XID {xid}" if count == 1 else f"XID {xid} ({count} times)"))
        await self._publish(inventory if inventory is not state.inventory else None)

    def current_readings(self) -> dict[str, HealthReading]:
        """The latest sample while it is current; none once it is older than STALE_SAMPLES intervals and the NVML
        deadline (a sample hangs on a driver that stopped answering): old readings are not served as new."""
        policy = self._policy
        limit = STALE_SAMPLES * policy.sample_interval_seconds + policy.nvml_deadline_seconds
        if self.sampled_at is not None and time.monotonic() - self.sampled_at > limit:
            return {}
        return self.telemetry

    async def on_xid(self, gpu_uuid: str, xid: int) -> None:
        self.xid_counts[(gpu_uuid, xid)] = self.xid_counts.get((gpu_uuid, xid), 0) + 1
        verdict = classify_xid(xid, self._policy)
        if verdict.faulty:
            self._fault(gpu_uuid, verdict)
        elif verdict.action == "warn":
            # Taken with the next sample: a storm of one XID is one warning (and one state version) per interval.
            self._warn_xids[(gpu_uuid, xid)] = self._warn_xids.get((gpu_uuid, xid), 0) + 1
            return
        else:
            log.info("GPU %s: %s ignored by policy", gpu_uuid, verdict.reason)
        await self._publish()

    async def open(self) -> None:
        """Register for the GPUs' NVML events (once): from here on NVML keeps every XID for the monitor. The
        agent calls this before it serves any device, so an XID that comes after a device is offered is never
        missed (NVML does not deliver events from before a registration)."""
        if self._event_set is None:
            self._event_set = await self._nvml(self._backend.open_events)

    async def run(self) -> None:
        """Sample, take events and watch NVML's calls until cancelled, each on its own loop so that none waits on
        another: samples every sampleIntervalSeconds, whatever the event wait does; an XID taken while a sample
        hangs; a call past its deadline reported while both hang. The event set stays registered when this fails
        and is run again (the agent's supervisor restarts it), a failed wait for events included: NVML keeps the
        events a registered set receives, so an XID that comes while the monitor restarts is taken when it runs
        again, not lost. Only a set NVML no longer knows is given up and registered anew."""
        await self.open()
        loops = [asyncio.create_task(self._sample_loop(), name="health-samples"),
                 asyncio.create_task(self._event_loop(), name="health-events")]
        if self._watched:
            loops.append(asyncio.create_task(self._watch_loop(), name="health-nvml-watch"))
        try:
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _sample_loop(self) -> None:
        while True:
            interval = self._policy.sample_interval_seconds
            since = None if self.sampled_at is None else time.monotonic() - self.sampled_at
            if since is None or since >= interval:  # (the agent's start took one just before)
                await self.sample()
                since = 0.0
            await asyncio.sleep(interval - since)

    async def _event_loop(self) -> None:
        event_set = self._event_set
        assert event_set is not None
        while True:
            if self._wait is None:
                self._wait = asyncio.ensure_future(self._events(
                    lambda: self._backend.wait_event(event_set, EVENT_WAIT_MS), what="nvmlEventSetWait"))
            # A wait in flight when the monitor stops (another loop failed) is kept, not cancelled: the event it
            # takes from NVML is handled when the monitor runs again.
            wait = self._wait
            try:
                event = await asyncio.shield(wait)
            except EventSetGone:
                self._wait = None
                await self.close()  # NVML lost the set itself: the next run registers a new one
                raise
            except Exception:
                self._wait = None
                raise
            self._wait = None
            if event is not None:
                await self.on_xid(event.gpu_uuid, event.xid)
                self.events_seen += 1

    async def _watch_loop(self) -> None:
        while True:
            deadline = self._policy.nvml_deadline_seconds
            late = []
            for thread in self._watched:
                thread.deadline_s = deadline
                late += thread.late()
            for call in late:
                if call not in self._stuck:
                    self._stuck[call] = call.gpu
                    await self.on_stuck(call)
            for call in [call for call in self._stuck if call not in late]:
                del self._stuck[call]
                log.info("NVML answers again: %s%s returned after about %.1fs; the GPUs recover as usual",
                         call.what, "" if call.gpu is None else f" on GPU {call.gpu}", call.waited())
            await asyncio.sleep(WATCH_S)

    @property
    def stuck(self) -> Call | None:
        """The oldest NVML call past its deadline now, if one (each such call is an episode: from its deadline
        until it returns)."""
        return min(self._stuck, key=lambda call: call.started, default=None)

    async def on_stuck(self, call: Call) -> None:
        """An NVML call ran past its deadline: the GPU it concerns (every GPU for a call that concerns none) is
        faulty by health.checks.nvmlUnresponsive until NVML answers and the usual clean samples follow."""
        log.warning("%s", call.describe())
        inventory = self._bus.current.inventory
        on = "" if call.gpu is None else f" on GPU {call.gpu}"
        verdict = Verdict(self._policy.checks.nvml_unresponsive,
                          f"{NVML_UNRESPONSIVE}: {call.what}{on} did not return within {call.deadline_s:g}s")
        if verdict.faulty:
            for gpu in inventory.gpus:
                if call.gpu is None or gpu.index == call.gpu:
                    self._fault(gpu.uuid, verdict)
        await self._publish()

    async def close(self) -> None:
        """Free the event set (the agent is stopping, or NVML lost it); a wait still in flight then ends with
        nothing to hand over."""
        wait, self._wait = self._wait, None
        if wait is not None:
            wait.add_done_callback(_drop)
            if not wait.done():  # the set is not freed under a wait in flight: it ends within EVENT_WAIT_MS
                await asyncio.wait({wait}, timeout=EVENT_WAIT_MS / 1000 + 0.5)
        if self._event_set is not None:
            event_set, self._event_set = self._event_set, None
            await self._nvml(lambda: self._backend.close_events(event_set), what="nvmlEventSetFree")
