"""The running agent (`Agent`): its parts, made whole by the composition root (daemon.py) and wired here: the
NodeState bus, device-plugin servers, health monitor, telemetry, MIG manager, MPS daemons and, by mode, the
node reconciler and the DRA parts; the supervised tasks that run them (`supervise`: log, count and restart
with backoff); the takeover in a rolling update of DRA mode (DRA served at once, the parts one agent per node
runs once the old agent stops); the withheld-resource reports; and ordered shutdown. Readiness is in
readiness.py, config reload in reload.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from agent.checks import StartupError
from agent.config import ConfigError
from agent.cordon import Cordons
from agent.deviceplugin.response import NodeFiles
from agent.deviceplugin.server import PluginSet
from agent.deviceplugin.servicer import SEARCH_THREADS, DevicePluginServicer
from agent.dra.slices import plugin_resources
from agent.handover import Handover
from agent.health.monitor import HealthMonitor
from agent.inventory import Device, PlanCache, Resource, ResourcePlan
from agent.kube.reconciler import NodeIntent, NodeReconciler, TaintPolicy, node_intent
from agent.kube.usage import ApiCollector, ApiCounts
from agent.labels import node_labels, owned
from agent.locks import Held
from agent.metrics import Metrics
from agent.mig.controller import MigController
from agent.mps import MpsDaemons
from agent.nvml import MockStateError
from agent.nvml.backend import NvmlBackend, NvmlUnavailable
from agent.readiness import AgentReadiness
from agent.reload import ConfigReload
from agent.state import NodeState, StateBus
from agent.telemetry.collector import TelemetryCollector
from agent.telemetry.exposition import renderer
from agent.topology.prefer import Preferences
from agent.yamlfile import FileProblems, InputFileError

if TYPE_CHECKING:
    from agent.daemon import AgentOptions, DraParts, Footing

log = logging.getLogger("agent.daemon")
"""The agent's own lines keep the logger name they have always had (the operations guide and log filters use it)."""

RESTART_BACKOFF_FIRST_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STOP_TASK_S = 5.0
"""How long Agent.stop waits for a cancelled task before it cancels it again."""
STOP_NVML_S = 2.0
"""How long a stop waits to give the event set back to NVML (the wait for events in flight ends first); a driver
that does not answer in that time is left as it is."""


ONE_LINE_ERRORS: tuple[type[Exception], ...] = (
    ConfigError, MockStateError, FileProblems, InputFileError, StartupError, Held, NvmlUnavailable)
"""Errors whose message already says what is wrong in one line: logged as that line, not as a traceback."""


async def supervise(name: str, run: Callable[[], Awaitable[None]], metrics: Metrics) -> None:
    """Run a long-lived task forever: log and count each failure, restart it with backoff. The backoff doubles
    with each failure up to RESTART_BACKOFF_MAX_S and starts again from the first step after a run that lived
    longer than that: a task that fails now and then is restarted at once, not after the longest wait."""
    backoff = RESTART_BACKOFF_FIRST_S
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            try:
                await run()
            finally:
                if loop.time() - started > RESTART_BACKOFF_MAX_S:
                    backoff = RESTART_BACKOFF_FIRST_S
            log.error("task %s returned; restarting", name)
        except asyncio.CancelledError:
            raise
        except ONE_LINE_ERRORS as err:
            log.error("task %s failed: %s; restarting in %.1fs", name, str(err).replace("\n", "; "), backoff)
        except Exception:
            log.exception("task %s failed; restarting in %.1fs", name, backoff)
        metrics.task_restarts.labels(task=name).inc()
        await asyncio.sleep(backoff)
        backoff = min(RESTART_BACKOFF_MAX_S, backoff * 2)


class Agent:
    """The running agent: NodeState bus, device-plugin servers, health monitor, telemetry, MIG manager, MPS
    daemons and, by mode, the node reconciler, the DRA parts and the HTTP endpoint. Made by start_agent, which
    returns it serving; every part exists from then on."""

    def __init__(self, footing: Footing, bus: StateBus, files: NodeFiles, dra: DraParts | None,
                 hangup: asyncio.Event) -> None:
        options = footing.options
        self.footing = footing
        self.backend = footing.backend
        self.options = options
        self.nvml = footing.nvml
        self.metrics = footing.metrics
        self.http = footing.http
        """The /metrics, /healthz and /readyz endpoint; None without a metrics port."""
        self.bus = bus
        self.files = files
        """The device nodes and files the node has (read once at start)."""
        self.plans = PlanCache()
        self.hangup = hangup
        """Set by SIGHUP: reload the config file."""
        self.stopped = asyncio.Event()
        self.taken_over = asyncio.Event()
        self.failed: str | None = None
        """Why the agent cannot go on (another agent holds the lock of a kubelet directory that replaced its
        own): run_until_signal stops it and exits non-zero."""
        self.failing = asyncio.Event()
        """Set when, in a rolling update, the agent took the kubelet directory over from the old agent."""
        self._tasks: list[asyncio.Task[None]] = []
        preferences = Preferences(lambda: bus.current)
        self.search = ThreadPoolExecutor(max_workers=SEARCH_THREADS, thread_name_prefix="preferred-allocation")
        """Where every resource's GetPreferredAllocation search runs, off the event loop."""
        self.plugins = PluginSet(
            lambda name: DevicePluginServicer(name, bus, self.plugin_plan, preferences, self.metrics, files,
                                              self.search),
            lambda: self.served(self.plans(bus.current).resources),
            options.kubelet_dir,
            bus,
            self.metrics,
            footing.lock,
            self._fail,
        )
        self.monitor = HealthMonitor(self.backend, bus, self.nvml, footing.events, (self.nvml, footing.events))
        self.telemetry = TelemetryCollector(self.backend, bus, self.nvml, lambda: self.monitor.xid_counts,
                                            self.nvml.overdue,
                                            claims=lambda: self.dra.plugin.holders() if self.dra is not None else [])
        self.mig = MigController(self.backend, bus, self.nvml, self.metrics,
                                 lambda: self.dra.plugin.holders() if self.dra is not None else [],
                                 kubelet_dir=options.kubelet_dir)
        self.mps = MpsDaemons(bus, control=options.mps_control)
        counts = getattr(options.kube, "counts", None)
        self.api_counts = counts if isinstance(counts, ApiCounts) else ApiCounts()
        """What the agent's API client sent and how its watches fared (for /metrics); zeros without one."""
        self.reconciler: NodeReconciler | None = (
            NodeReconciler(options.kube, bus, _intent, owned, self.metrics.api_errors.inc, self.api_counts)
            if options.kube is not None else None)
        """Keeps the agent's parts of its Node; None without an API server (--no-kube)."""
        self.dra = dra
        """The ResourceSlice publisher and the DRA kubelet plugin, made at start in DRA mode with an API server
        or at the first switch to DRA mode; else None. Once made they serve for as long as the agent runs: after
        a switch back to device-plugin mode the slices are withdrawn and the plugin unprepares what it prepared."""
        self._dra_made = options.config.dra if dra is not None else None
        """The DRA settings the DRA parts were made with; None before they are made."""
        self._slices: asyncio.Task[None] | None = None
        """The task that publishes the slices, or in device-plugin mode withdraws them."""
        self._plugin_plan: tuple[ResourcePlan, ResourcePlan] | None = None
        """(the plan, the device plugin's plan of it) of the newest state in DRA mode: `plugin_plan`."""
        self.handover = Handover(bus, self.plans,
                                 lambda: self.dra.plugin.holders() if self.dra is not None else None)
        """Keeps NodeState.held: what pods hold through the mode the node left (agent/handover.py)."""
        self.cordons = Cordons(bus, self.plans, lambda: self.dra.plugin.holders() if self.dra is not None else [],
                               options.cordon_file)
        """Keeps NodeState.cordoned from the Node's cordon annotation, and who holds each cordoned GPU
        (agent/cordon.py); run with the Node reconciler."""
        self.ready = AgentReadiness(self.backend, self.plugins, self.reconciler, self._slices_published,
                                    self.devices)
        """What /readyz answers once the agent runs (agent/readiness.py)."""
        self.config_reload = ConfigReload(options, bus, files, self.metrics, hangup, lambda: self._dra_made)
        """Reloads the config on SIGHUP, a changed file or a new node label (agent/reload.py)."""

    @classmethod
    async def start(cls, backend: NvmlBackend, options: AgentOptions, *,
                    hangup: asyncio.Event | None = None) -> Agent:
        """start_agent for whoever needs an agent that serves: the idle mode (NVML unavailable with
        flags.failOnInitError false) is a StartupError naming why, with nothing held."""
        from agent.daemon import IdleAgent, start_agent

        started = await start_agent(backend, options, hangup=hangup)
        if isinstance(started, IdleAgent):
            await started.stop()
            raise StartupError(started.reason)
        return started

    async def begin(self) -> None:
        """Wire the metrics to the parts and start every task (and the DRA kubelet plugin's server)."""
        bus, monitor, telemetry, opts = self.bus, self.monitor, self.telemetry, self.options
        self.metrics.watch(bus, self.devices, monitor.current_readings, lambda: monitor.xid_counts)
        self.metrics.watch_nvml((self.nvml, self.footing.events))
        try:
            await monitor.open()  # before any device is served: no XID after that is missed
        except Exception as err:  # the health task registers again when it runs, with its restarts
            log.warning("cannot register for NVML events yet (the health monitor tries again): %s", err)
        try:
            # Before any device is offered and the Node written: a GPU already faulty (lost before this agent
            # started) is unhealthy in the first list and the node's taint stays on through a restart.
            await monitor.sample()
        except Exception as err:  # the health task samples again when it runs, with its restarts
            log.warning("cannot sample the GPUs' health yet (the health monitor tries again): %s", err)
        lock = self.footing.lock
        if lock.held:
            self._spawn_owned()
        self.spawn("health", monitor.run)
        self.metrics.watch_ready(self._ready)
        # Without an API server the figures are there all the same, at zero: dashboards need no special case.
        self.metrics.registry.register(ApiCollector(self.api_counts))
        self.metrics.serve_also(renderer(lambda: telemetry.current, lambda: bus.current, lambda: telemetry.enabled))
        self.metrics.watch_free(bus, self.pod_holdings)
        self.metrics.watch_usage(telemetry.usage)
        self.spawn("telemetry", telemetry.run)
        if opts.config_path is not None:
            self.spawn("config-reload", self.config_reload.follow)
        self.spawn("handover", self.handover.run)
        if self.dra is not None:
            if self.bus.current.config.dra.enabled:
                self._slices = self.spawn("dra-slices", self.dra.slices.run)
            else:  # claims prepared before a switch back and a restart: their unprepare is served, nothing offered
                self._withdraw_dra()
            await self.dra.plugin.start()
        self.spawn("mode", self._follow_mode)
        if not lock.held:
            self._tasks.append(asyncio.create_task(self._take_over(), name="take-over"))
        self.footing.readiness.check = self._ready
        state = bus.current
        log.info(
            "agent started: %d GPU(s), driver %s, kubelet dir %s, resources %s",
            len(state.inventory.gpus), state.inventory.driver.version, opts.kubelet_dir,
            ", ".join(f"{n}={len(d)}" for n, d in self.devices().items()) if lock.held else
            "none until the agent that serves the kubelet directory stops",
        )

    def _spawn_owned(self) -> None:
        """Start the parts one agent per node may run, those of the kubelet-directory lock's holder: the device
        plugin, the MIG manager, the withheld-resource reports, the MPS daemons and the Node reconciler."""
        self.spawn("device-plugins", self.plugins.run)
        self.spawn("mig", self.mig.run)
        self.spawn("withheld-resources", self._follow_problems)
        self.spawn("mps", self.mps.run)
        if self.reconciler is not None:
            self.spawn("node-reconciler", self.reconciler.run)
            self.spawn("cordon", self.cordons.run)

    async def _take_over(self) -> None:
        """A rolling update: DRA is served already (in DRA mode); the rest waits for the old agent to let the
        kubelet directory's lock go (it stops), then starts."""
        await self.footing.lock.wait()
        self.taken_over.set()
        if self.dra is not None:  # the old agent wrote slices until now, perhaps of another shape: check them
            self.dra.slices.republish()
        log.info("took over the kubelet directory %s: serving the device plugin, MIG manager, MPS daemons and the "
                 "Node", self.options.kubelet_dir)
        self._spawn_owned()

    def pod_holdings(self) -> frozenset[str] | None:
        """The GPU and MIG device UUIDs pods hold, for the free-GPU figures of /metrics, from what the agent has
        read already (nothing is asked for a scrape): the device plugin's allocations in the telemetry pass's
        last PodResources listing (a replica counts for its GPU) and the devices of the DRA claims prepared here.
        None outside DRA mode while no pass is current (the dcgm family off, or no pass yet): then no listing
        says which GPUs pods hold. In DRA mode whole GPUs reach pods through the claims only (those held through
        the mode the node left are NodeState.held), so what the agent prepared is enough."""
        listing = self.telemetry.current
        if not listing.taken_at and not self.bus.current.config.dra.enabled:
            return None
        claims = self.dra.plugin.holders() if self.dra is not None else []
        return frozenset(listing.holders) | {h.device_id for h in claims}

    def _ready(self) -> tuple[bool, str]:
        """What /readyz answers: the agent's readiness (`ready`) once it holds the kubelet directory. Before (a
        rolling update), ready once what it can serve beside the old agent is served: in DRA mode its DRA plugin
        registered with the kubelet and the ResourceSlice published; else at once. The DaemonSet then stops the
        old agent, and this one takes over."""
        if self.monitor.stuck is not None:
            return False, self.monitor.stuck.describe()
        if self.footing.lock.held:
            return self.ready()
        if (problem := self.backend.problem()) is not None:
            return False, problem
        if self.dra is None:
            return True, "ok"
        if not self.dra.plugin.registrations:
            return False, "the DRA plugin is not registered with the kubelet yet"
        if not self.dra.slices.published.is_set():
            return False, "the ResourceSlice is not published yet"
        return True, "ok"

    def served(self, resources: Mapping[str, Resource]) -> set[str]:
        """The resources the device plugin serves in the mode in force: in DRA mode, and while a switch of mode
        reads what pods hold (NodeState.handover), not the whole GPUs (plugin_resources). A resource DRA took
        over stays registered, with no devices, while pods hold its devices (NodeState.held, or not known yet):
        the kubelet starts their containers (and DRA's pods that ask for the same name) only through a plugin
        it still knows. No plugin stops for a handover either way: it lists no devices until the handover ends."""
        state = self.bus.current
        dra = state.config.dra
        served = plugin_resources(resources, dra.enabled or state.handover, dra.dynamic_mig)
        if state.handover or (dra.enabled and state.held):
            served |= set(self.plugins.plugins)
        return served

    def plugin_plan(self, state: NodeState) -> ResourcePlan:
        """The plan as the device plugin serves it: in DRA mode, and while a switch of mode reads what pods hold,
        without the resources DRA takes over (a plugin kept registered for one lists no devices)."""
        plan = self.plans(state)
        dra = state.config.dra
        if not (dra.enabled or state.handover):
            return plan
        cached = self._plugin_plan
        if cached is None or cached[0] is not plan:
            served = plugin_resources(plan.resources, True, dra.dynamic_mig)
            cached = (plan, dataclasses.replace(
                plan, resources={name: r for name, r in plan.resources.items() if name in served}))
            self._plugin_plan = cached
        return cached[1]

    def devices(self) -> dict[str, tuple[Device, ...]]:
        """The devices of each resource the device plugin lists now."""
        resources = self.plugin_plan(self.bus.current).resources
        served = self.served(resources)
        return {name: r.devices for name, r in resources.items() if name in served}

    def _slices_published(self) -> asyncio.Event | None:
        """Set once the ResourceSlice is published, in DRA mode with an API server; else None."""
        if self.dra is None or not self.bus.current.config.dra.enabled:
            return None
        return self.dra.slices.published

    async def _follow_mode(self) -> None:
        """Follow the mode the config in force asks for (a reload may switch it while pods run): into DRA mode,
        make the DRA parts if they are not made yet and publish the slices; back into device-plugin mode,
        withdraw the slices and keep the DRA kubelet plugin for the claims still prepared. The device plugin
        follows on its own (`served`), and the handover keeps both from offering what pods hold."""
        state = self.bus.current
        dra = state.config.dra.enabled  # the mode start_agent served
        while True:
            if state.config.dra.enabled != dra:
                dra = state.config.dra.enabled
                if dra:
                    await self._offer_dra(state)
                elif self.dra is not None:
                    await self._leave_dra()
            state = await self.bus.wait_newer(state.version)

    async def _offer_dra(self, state: NodeState) -> None:
        if self.dra is None:
            from agent.daemon import dra_parts

            try:
                self.dra = dra_parts(self.options, state.config.dra, self.bus, self.files, self.footing)
            except StartupError as err:
                log.error("cannot serve DRA: %s", err)
                return
            if self.dra is None:
                return
            self._dra_made = state.config.dra
            await self.dra.plugin.start()
        if self._slices is not None:
            await self._stop_task(self._slices)
        self._slices = self.spawn("dra-slices", self.dra.slices.run)
        log.info("DRA mode: publishing ResourceSlices for driver %s", self.dra.plugin.driver)

    async def _leave_dra(self) -> None:
        if self._slices is not None:
            await self._stop_task(self._slices)
        self._withdraw_dra()

    def _withdraw_dra(self) -> None:
        assert self.dra is not None
        slices = self.dra.slices

        async def withdraw() -> None:
            await slices.withdraw()
            await asyncio.Event().wait()  # withdrawn: nothing more to do until the mode changes again

        self._slices = self.spawn("dra-withdraw", withdraw)
        log.info("device-plugin mode: the ResourceSlices are withdrawn; the DRA plugin stays registered for the "
                 "claims still prepared")

    async def _stop_task(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._tasks.remove(task)

    async def reload_config(self) -> bool:
        """Load the config again (the file, or the named config the node label asks for); a bad one is
        rejected with its reasons and the last good one keeps serving (agent/reload.py)."""
        return await self.config_reload.reload()

    async def _follow_problems(self) -> None:
        """Say why devices are withheld (for example a node that does not fit migStrategy single) whenever that
        changes: in the log and as an Event."""
        reported: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        state = self.bus.current
        while True:
            current = self.plans(state)
            for kind, lines, before in (("resources-withheld", current.problems, reported[0]),
                                        ("sharing-selector-unmatched", current.warnings, reported[1])):
                if lines != before:
                    for line in lines:
                        log.warning("%s", line)
                    if lines:
                        await self.bus.record([("", kind, line) for line in lines])
            reported = (current.problems, current.warnings)
            self.metrics.unmatched_selectors.set(len(current.warnings))
            state = await self.bus.wait_newer(state.version)

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            self.failing.set()

    def spawn(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run `run` as a supervised task named `name` (restarted after an error, counted by that name) for as
        long as the agent runs: stop() cancels it with the others and waits for it."""
        task = asyncio.create_task(supervise(name, run, self.metrics), name=name)
        self._tasks.append(task)
        return task

    async def stop(self) -> None:
        """Ordered shutdown: stop the tasks, stop serving (brief grace for in-flight RPCs), remove sockets,
        then give back the HTTP endpoint, the API server client, NVML and the kubelet-directory lock."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            while not (await asyncio.wait({task}, timeout=STOP_TASK_S))[0]:
                # A loop that swallowed its cancellation would hold the shutdown for ever: say so, ask again.
                log.warning("task %s did not stop within %gs of being cancelled; cancelling it again",
                            task.get_name(), STOP_TASK_S)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        stuck = self.nvml.overdue() or self.footing.events.overdue()
        if stuck is None:  # a stuck driver is asked nothing more: the process's exit frees the event set
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_NVML_S):
                    await self.monitor.close()
        await self.plugins.stop(grace=1.0)
        self.search.shutdown(wait=False, cancel_futures=True)
        if self.http is not None:
            await self.http.stop()
            self.footing.http = None
        if self.dra is not None:
            await self.dra.plugin.stop()
            await self.dra.slices.close()
        await self.footing.release()
        self.stopped.set()


def _intent(state: NodeState) -> NodeIntent:
    health = state.config.health
    taint = TaintPolicy(health.taint.key, health.taint.effect, health.node_fatal_unhealthy_gpus)
    return node_intent(state, node_labels(state, state.config), taint)
