"""Composition root: builds the parts, wires them, owns the event loop, the NVML thread and signals."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agent.config import AgentConfig, ConfigError, config_file, load_config
from agent.deviceplugin.response import IMEX_CHANNEL, NodeFiles
from agent.deviceplugin.server import PluginSet
from agent.deviceplugin.servicer import DevicePluginServicer
from agent.dra.plugin import ClaimError, DraKubeletPlugin, Paths
from agent.dra.publisher import SlicePublisher, claim_reader, publisher_for
from agent.dra.slices import plugin_resources
from agent.health.monitor import HealthMonitor
from agent.inventory import Device, PlanCache, plan, sharing_conflicts
from agent.kube.reconciler import NodeClient, NodeIntent, NodeReconciler, TaintPolicy, node_intent
from agent.labels import node_labels, owned
from agent.locks import DirectoryLock, Held
from agent.metrics import HttpEndpoint, Metrics
from agent.mig.controller import MigController
from agent.mig.layout import LayoutError, load_layouts
from agent.mps import MpsDaemons
from agent.nvml import MockStateError
from agent.nvml.backend import NvmlBackend, NvmlUnavailable
from agent.state import NodeState, StateBus
from agent.telemetry.collector import TelemetryCollector
from agent.telemetry.exposition import renderer
from agent.topology.prefer import Preferences
from agent.yamlfile import FileProblems, InputFileError

log = logging.getLogger(__name__)

T = TypeVar("T")

CONFIG_POLL_S = 2.0
NVML_INIT_ATTEMPTS = 5
NVML_INIT_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


@dataclass(frozen=True)
class AgentOptions:
    config: AgentConfig
    kubelet_dir: Path
    metrics_port: int | None = 9400
    metrics_host: str = "0.0.0.0"
    kube: NodeClient | None = None
    """The agent's own Node in the API server; None runs without one (--no-kube)."""
    config_path: Path | None = None
    """Where `config` came from; the agent reloads it on SIGHUP or when the file changes."""


class StartupError(RuntimeError):
    """The agent cannot start as configured; the message is one line naming what to change."""


SOCKET_PATH_MAX = 107
"""AF_UNIX socket paths hold at most 107 bytes (sun_path is 108 with the terminating NUL)."""


def socket_name_length(resource: str) -> int:
    """The longest name the agent gives the device-plugin socket of a resource (gpu-agent-<resource>-<instance>-
    <generation>.sock), with room for a million restarts of its server."""
    return len(f"gpu-agent-{resource.replace('/', '_').replace('.', '-')}-0123abcd-999999.sock")


def check_sockets(kubelet_dir: Path, resources: Iterable[str]) -> None:
    """Refuse a kubelet directory whose path leaves no room for the kubelet's socket or the agent's."""
    room = SOCKET_PATH_MAX - len(str(kubelet_dir)) - 1
    needs = {"the kubelet's socket": len("kubelet.sock"), **{f"{r}'s socket": socket_name_length(r) for r in resources}}
    name, need = max(needs.items(), key=lambda item: item[1])
    if need > room:
        raise StartupError(f"kubelet directory {kubelet_dir} is {len(str(kubelet_dir))} bytes long: a socket path "
                           f"holds at most {SOCKET_PATH_MAX} bytes, which leaves {max(room, 0)} for the name of "
                           f"{name}, and it needs {need} (use a shorter --kubelet-dir)")


def check_paths(config: AgentConfig) -> None:
    """Refuse, before anything starts, the config's paths that would fail only later: a MIG layouts file that
    cannot be used, a MIG state directory that cannot be written."""
    mig = config.mig
    if mig.layouts_file is not None:
        try:
            load_layouts(mig.layouts_file)
        except LayoutError as err:
            raise StartupError(f"mig.layoutsFile: {err}".replace("\n", "; ")) from None
    # Without touching anything: the directory, or the nearest directory above it that exists (where the
    # journal's directory would be made on the first apply), must be a directory the agent can write.
    existing = mig.state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StartupError(f"mig.stateDir {mig.state_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StartupError(f"mig.stateDir {mig.state_dir}: {existing} is not writable")


class NvmlThread:
    """Every NVML call runs on this one worker thread, so NVML is never entered concurrently."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")

    async def __call__(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


ONE_LINE_ERRORS: tuple[type[Exception], ...] = (
    ConfigError, MockStateError, FileProblems, InputFileError, StartupError, Held, NvmlUnavailable)
"""Errors whose message already says what is wrong in one line: logged as that line, not as a traceback."""


async def supervise(name: str, run: Callable[[], Awaitable[None]], metrics: Metrics) -> None:
    """Run a long-lived task forever: log and count each failure, restart it with backoff."""
    backoff = 0.5
    while True:
        try:
            await run()
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
    """The running agent: NodeState bus, device-plugin servers, health monitor and HTTP endpoint."""

    def __init__(self, backend: NvmlBackend, options: AgentOptions) -> None:
        self.backend = backend
        self.options = options
        self.nvml = NvmlThread()
        self.metrics = Metrics()
        self.bus: StateBus | None = None
        self.plugins: PluginSet | None = None
        self.reconciler: NodeReconciler | None = None
        self.monitor: HealthMonitor | None = None
        self.telemetry: TelemetryCollector | None = None
        self.mig: MigController | None = None
        self.slices: SlicePublisher | None = None
        """DRA mode: keeps the node's ResourceSlice."""
        self.dra_plugin: DraKubeletPlugin | None = None
        """DRA mode: the kubelet plugin (registration and the DRA service)."""
        self.http: HttpEndpoint | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.stopped = asyncio.Event()
        self.plans = PlanCache()
        self.hangup = asyncio.Event()
        """Set by SIGHUP: reload the config file."""
        self.idle: str | None = None
        """Why the agent serves nothing (NVML unavailable with flags.failOnInitError false); None when serving."""
        self.mps: MpsDaemons | None = None
        self._kubelet_lock: DirectoryLock | None = None
        self._allocatable_seen: int | None = None
        """The registration count at which the Node last showed the advertised devices in Allocatable."""

    def devices(self) -> dict[str, tuple[Device, ...]]:
        assert self.bus is not None
        resources = self.plans(self.bus.current).resources
        served = plugin_resources(resources, self.options.config.dra.enabled)
        return {name: r.devices for name, r in resources.items() if name in served}

    def ready(self) -> tuple[bool, str]:
        """Ready once registered with the kubelet and, with an API server, once the agent's own Node shows
        every advertised resource in Allocatable with as many devices as are healthy: the scheduler can then
        place pods on them. A rolling update waits for that, not just for the registration, before it takes
        the next node's agent down. Checked once per registration (a later health change does not make the
        agent unready)."""
        if self.idle is not None:
            return True, self.idle
        if self.bus is None:
            return False, "NVML not initialised"
        if (problem := self.backend.problem()) is not None:
            return False, problem
        if self.plugins is None or not self.plugins.registered.is_set():
            return False, "not registered with the kubelet"
        if self.slices is not None and not self.slices.published.is_set():
            return False, "the ResourceSlice is not published yet"
        if self.reconciler is None:
            return True, "ok"
        registrations = sum(p.registrations for p in self.plugins.plugins.values())
        if self._allocatable_seen == registrations:
            return True, "ok"
        node = self.reconciler.node
        if node is None:
            return False, "the Node has not been read yet"
        missing = [f"{name}: {healthy}" for name, healthy in sorted(self._healthy_counts().items())
                   if _quantity(node.allocatable.get(name, "0")) != healthy]
        if missing:
            return False, f"the Node's Allocatable does not show {', '.join(missing)} yet"
        self._allocatable_seen = registrations
        return True, "ok"

    def _healthy_counts(self) -> dict[str, int]:
        return {name: sum(d.healthy for d in devices) for name, devices in self.devices().items()}

    async def _init_nvml(self) -> NodeState:
        for attempt in range(1, NVML_INIT_ATTEMPTS + 1):
            try:
                await self.nvml(self.backend.init)
                break
            except NvmlUnavailable as err:
                if attempt == NVML_INIT_ATTEMPTS:
                    raise
                log.warning("%s (attempt %d of %d)", err, attempt, NVML_INIT_ATTEMPTS)
                await asyncio.sleep(NVML_INIT_BACKOFF_S * attempt)
        inventory = await self.nvml(self.backend.inventory)
        config = self.options.config
        state = NodeState(version=1, inventory=inventory, config=config,
                          machine=machine_type(config.flags.gfd.machine_type_file), labelled_at=int(time.time()))
        conflicts = sharing_conflicts(state, state.config)
        if conflicts:
            raise ConfigError("\n".join(conflicts))
        return state

    async def start(self) -> None:
        opts = self.options
        check_paths(opts.config)
        check_sockets(opts.kubelet_dir, ())
        self._kubelet_lock = DirectoryLock(
            opts.kubelet_dir, f"another agent serves the kubelet directory {opts.kubelet_dir}")
        try:
            self._kubelet_lock.acquire()
        except Held as err:
            raise StartupError(str(err)) from None
        if opts.metrics_port is not None:
            self.http = HttpEndpoint(self.metrics, self.ready)
            try:
                await self.http.start(opts.metrics_port, opts.metrics_host)
            except OSError as err:
                self.http = None
                why = os.strerror(err.errno) if err.errno else str(err)
                raise StartupError(f"cannot serve metrics on {opts.metrics_host}:{opts.metrics_port}: {why} "
                                   "(choose another --metrics-port)") from None
        for line in opts.config.without_effect:
            log.warning("%s", line)
        self.metrics.config_in_force(opts.config.without_effect)
        try:
            state = await self._init_nvml()
        except NvmlUnavailable as err:
            if opts.config.flags.fail_on_init_error:
                raise
            self.idle = f"serving nothing: {err} (flags.failOnInitError is false)"
            log.error("%s", self.idle)
            return
        check_sockets(opts.kubelet_dir, plan(state).resources)
        files = NodeFiles.read()
        if opts.config.imex.channel_ids and not files.imex_channel:
            if opts.config.imex.required:
                raise ConfigError(f"imex.required is true but the IMEX channel {IMEX_CHANNEL} does not exist")
            log.warning("imex.channelIDs asks for channel 0, but %s does not exist; no channel is added",
                        IMEX_CHANNEL)
        self.bus = bus = StateBus(state)
        preferences = Preferences(lambda: bus.current)
        self.plugins = PluginSet(
            lambda name: DevicePluginServicer(name, bus, self.plans, preferences, self.metrics, files),
            lambda: plugin_resources(self.plans(bus.current).resources, opts.config.dra.enabled),
            opts.kubelet_dir,
            bus,
            self.metrics,
        )
        self.monitor = monitor = HealthMonitor(self.backend, bus, self.nvml)
        self.metrics.watch(bus, self.devices, lambda: monitor.telemetry, lambda: monitor.xid_counts)
        self._spawn("device-plugins", self.plugins.run)
        self._spawn("health", monitor.run)
        self.telemetry = telemetry = TelemetryCollector(self.backend, bus, self.nvml, lambda: monitor.xid_counts)
        self.metrics.watch_ready(self.ready)
        self.metrics.serve_also(renderer(lambda: telemetry.snapshot, lambda: bus.current, lambda: telemetry.enabled))
        self._spawn("telemetry", telemetry.run)
        self.mig = MigController(self.backend, bus, self.nvml, self.metrics)
        self._spawn("mig", self.mig.run)
        self._spawn("withheld-resources", self._follow_problems)
        self.mps = MpsDaemons(bus)
        self._spawn("mps", self.mps.run)
        if opts.config_path is not None:
            self._spawn("config-reload", self._follow_config)
        if opts.kube is not None:
            self.reconciler = NodeReconciler(opts.kube, bus, _intent, owned, self.metrics.api_errors.inc)
            self._spawn("node-reconciler", self.reconciler.run)
        if opts.config.dra.enabled:
            self.slices = publisher_for(opts.kube, bus, opts.config.dra.driver_name, self.metrics.api_errors.inc)
            if self.slices is not None:
                self._spawn("dra-slices", self.slices.run)
                dra = opts.config.dra
                try:
                    self.dra_plugin = DraKubeletPlugin(
                        Paths.under(opts.kubelet_dir.parent, dra.driver_name, dra.cdi_root), dra.driver_name,
                        self.slices.node, bus, claim_reader(self.slices), files.control_nodes,
                        opts.config.flags.dev_root, self.slices.republish, files.mig_minors)
                except ClaimError as err:
                    raise StartupError(str(err)) from None
                await self.dra_plugin.start()
        log.info(
            "agent started: %d GPU(s), driver %s, kubelet dir %s, resources %s",
            len(state.inventory.gpus), state.inventory.driver.version, opts.kubelet_dir,
            ", ".join(f"{n}={len(d)}" for n, d in self.devices().items()) or "none",
        )

    async def reload_config(self) -> bool:
        """Load the config again (the file, or the named config the node label asks for); a bad one is
        rejected with its reasons and the last good one keeps serving."""
        assert self.bus is not None and self.options.config_path is not None
        path = self.options.config_path
        name = self.bus.current.config_request
        try:
            new = load_config(path, name)
            conflicts = sharing_conflicts(self.bus.current, new)
            if conflicts:
                raise ConfigError("\n".join(f"{path}: {c}" for c in conflicts))
        except ConfigError as err:
            log.error("config reload rejected; keeping the last good config: %s", err)
            await self.bus.record([("", "config-rejected", f"config reload rejected: {err}")])
            return False
        if new == self.bus.current.config:
            return True
        for line in new.without_effect:
            log.warning("%s", line)
        self.metrics.config_in_force(new.without_effect)
        source = f"{path} ({name})" if name else str(path)
        await self.bus.record([("", "config-applied", f"config reloaded from {source}")], config=new,
                              machine=machine_type(new.flags.gfd.machine_type_file))
        log.info("config reloaded from %s", source)
        return True

    async def _follow_problems(self) -> None:
        """Say why devices are withheld (for example a node that does not fit migStrategy single) whenever that
        changes: in the log and as an Event."""
        assert self.bus is not None
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

    async def _follow_config(self) -> None:
        """Reload on SIGHUP, when the file changes (a ConfigMap update swaps the mounted file), and when the
        node label names another config."""
        assert self.options.config_path is not None and self.bus is not None
        path = self.options.config_path
        bus = self.bus

        def identity() -> tuple[object, ...] | None:
            try:
                st = config_file(path, bus.current.config_request).stat()
            except (OSError, ConfigError):
                return None
            return (st.st_ino, st.st_mtime_ns, st.st_size)

        seen = identity()
        requested = bus.current.config_request
        while True:
            version = bus.current.version
            hangup = asyncio.ensure_future(self.hangup.wait())
            newer = asyncio.ensure_future(bus.wait_newer(version))
            try:
                await asyncio.wait({hangup, newer}, timeout=CONFIG_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                hangup.cancel()
                newer.cancel()
            now = identity()
            relabelled = bus.current.config_request != requested
            if self.hangup.is_set() or relabelled or (now != seen and now is not None):
                self.hangup.clear()
                seen, requested = now, bus.current.config_request
                await self.reload_config()

    def _spawn(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        self._tasks.append(asyncio.create_task(supervise(name, run, self.metrics), name=name))

    async def stop(self) -> None:
        """Ordered shutdown: stop serving (brief grace for in-flight RPCs), remove sockets, release NVML."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                await self.monitor.close()
        if self.plugins is not None:
            await self.plugins.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        if self.dra_plugin is not None:
            await self.dra_plugin.stop()
        if self.slices is not None:
            await self.slices.close()
        close = getattr(self.options.kube, "close", None)
        if close is not None:
            await close()
        with contextlib.suppress(Exception):
            await self.nvml(self.backend.shutdown)
        self.nvml.close()
        if self._kubelet_lock is not None:
            self._kubelet_lock.release()
        self.stopped.set()


def _quantity(text: str) -> int | None:
    """A device count as the API writes it ("8"); None for anything else."""
    return int(text) if text.isdigit() else None


DEFAULT_MACHINE_TYPE_FILE = Path("/sys/class/dmi/id/product_name")


def machine_type(path: Path) -> str:
    """The machine type as GPU feature discovery reads it (flags.gfd.machineTypeFile, by default the DMI product
    name); "unknown" when the file cannot be read."""
    try:
        with path.open("rb") as f:
            text = f.read(4096).decode(errors="replace").strip()
    except OSError as err:
        # Machines without DMI (some VMs) have no product name: only a file someone configured is worth a warning.
        level = logging.INFO if path == DEFAULT_MACHINE_TYPE_FILE else logging.WARNING
        log.log(level, "cannot read the machine type from %s: %s; nvidia.com/gpu.machine is unknown", path,
                err.strerror)
        return "unknown"
    return text or "unknown"


def _intent(state: NodeState) -> NodeIntent:
    health = state.config.health
    taint = TaintPolicy(health.taint.key, health.taint.effect, health.node_fatal_unhealthy_gpus)
    return node_intent(state, node_labels(state, state.config), taint)


async def run_until_signal(agent: Agent) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, agent.hangup.set)
    try:
        starting = asyncio.ensure_future(agent.start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            # A signal while NVML is still being retried: stop now rather than after the retries.
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("signal received while starting; shutting down")
            return 0
        stopping.cancel()
        starting.result()
        # Everything allocated so far lives as long as the process: keep it out of every later collection.
        gc.collect()
        gc.freeze()
        await stop.wait()
        log.info("signal received; shutting down")
    finally:
        await agent.stop()
    return 0


def nvml_sync(backend: NvmlBackend, fn: Callable[[NvmlBackend], Any]) -> Any:
    """Run one NVML operation synchronously (for one-shot commands such as inspect)."""
    backend.init()
    try:
        return fn(backend)
    finally:
        backend.shutdown()
