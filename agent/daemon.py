"""Composition root: builds the parts, wires them, owns the event loop, the NVML thread and signals."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent.config import AgentConfig, ConfigError, config_file, load_config
from agent.deviceplugin.response import IMEX_CHANNEL, NodeFiles
from agent.deviceplugin.server import PluginSet
from agent.deviceplugin.servicer import DevicePluginServicer
from agent.dra.slices import plugin_resources
from agent.health.monitor import HealthMonitor
from agent.inventory import Device, PlanCache, plan, sharing_conflicts
from agent.kube.reconciler import NodeClient, NodeIntent, NodeReconciler, TaintPolicy, node_intent
from agent.kube.usage import ApiCollector, ApiCounts
from agent.labels import node_labels, owned
from agent.locks import DirectoryLock, Held
from agent.metrics import HttpEndpoint, Metrics
from agent.mig.controller import MigController
from agent.mig.layout import LayoutError, load_layouts
from agent.mps import MpsDaemons
from agent.nvml import MockStateError
from agent.nvml.backend import NvmlBackend, NvmlUnavailable
from agent.podresources import SocketPathError, check_socket
from agent.state import NodeState, StateBus
from agent.telemetry.collector import TelemetryCollector
from agent.telemetry.exposition import renderer
from agent.topology.prefer import Preferences
from agent.yamlfile import FileProblems, InputFileError, read_text_file

if TYPE_CHECKING:  # DRA mode and the API server's modules load only where the agent uses them
    from agent.dra.plugin import DraKubeletPlugin
    from agent.dra.publisher import SlicePublisher

log = logging.getLogger(__name__)

T = TypeVar("T")

CONFIG_POLL_S = 2.0
NVML_INIT_ATTEMPTS = 5
NVML_INIT_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
STOP_TASK_S = 5.0
"""How long Agent.stop waits for a cancelled task before it cancels it again."""


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
    cannot be used, a MIG state directory that cannot be written, a PodResources socket path that cannot be the
    kubelet's (one not there yet is a warning)."""
    mig = config.mig
    try:
        warning = check_socket(mig.pod_resources_socket, configured="pod_resources_socket" in mig.model_fields_set)
    except SocketPathError as err:
        raise StartupError(str(err)) from None
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
    if warning is not None:
        logging.getLogger("agent.podresources").warning("%s", warning)


def check_on_node(config: AgentConfig, state: NodeState, kubelet_dir: Path, files: NodeFiles) -> list[str]:
    """Refuse a config that only the node shows cannot work: a device selected by two sharing entries, a resource
    name too long for its socket path in the kubelet directory, imex.required without the IMEX channel. The
    same checks at start and at every reload. Returns the warnings to log."""
    conflicts = sharing_conflicts(state, config)
    if conflicts:
        raise ConfigError("\n".join(conflicts))
    check_sockets(kubelet_dir, plan(dataclasses.replace(state, config=config)).resources)
    if config.imex.channel_ids and not files.imex_channel:
        if config.imex.required:
            raise ConfigError(f"imex.required is true but the IMEX channel {IMEX_CHANNEL} does not exist")
        return [f"imex.channelIDs asks for channel 0, but {IMEX_CHANNEL} does not exist; no channel is added"]
    return []


def start_only_changes(old: AgentConfig, new: AgentConfig) -> str | None:
    """Why `new` cannot replace `old` in a running agent, or None: the DRA section decides which parts the agent
    is made of (the device plugin or the DRA driver, its name, the CDI directory), so it takes effect only at
    start."""
    if new.dra == old.dra:
        return None
    changed = [f"dra.{field.alias or name}" for name, field in type(new.dra).model_fields.items()
               if getattr(new.dra, name) != getattr(old.dra, name)]
    return (f"{', '.join(changed)} cannot change while the agent runs (the parts it starts depend on it); "
            "restart the agent to apply it")


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


class Readiness:
    """What /readyz answers. The HTTP endpoint serves from before NVML answers, so it asks through this: not
    ready until the agent exists, then the agent's own answer (or the idle one)."""

    def __init__(self) -> None:
        self.check: Callable[[], tuple[bool, str]] = lambda: (False, "NVML not initialised")

    def __call__(self) -> tuple[bool, str]:
        return self.check()


@dataclass
class Footing:
    """What the agent holds before NVML answers, in every mode: the kubelet-directory lock, the NVML thread,
    the metrics and, with a metrics port, the HTTP endpoint serving them."""

    backend: NvmlBackend
    options: AgentOptions
    lock: DirectoryLock
    nvml: NvmlThread
    metrics: Metrics
    readiness: Readiness
    http: HttpEndpoint | None
    """None without a metrics port."""

    @classmethod
    async def take(cls, backend: NvmlBackend, options: AgentOptions) -> Footing:
        """Check the config's paths and the kubelet directory, take the directory's lock and the metrics port;
        raises StartupError (holding nothing) when one of them cannot be had."""
        check_paths(options.config)
        check_sockets(options.kubelet_dir, ())
        lock = DirectoryLock(options.kubelet_dir, f"another agent serves the kubelet directory {options.kubelet_dir}")
        try:
            lock.acquire()
        except Held as err:
            raise StartupError(str(err)) from None
        metrics = Metrics()
        readiness = Readiness()
        http = None
        if options.metrics_port is not None:
            http = HttpEndpoint(metrics, readiness)
            try:
                await http.start(options.metrics_port, options.metrics_host)
            except OSError as err:
                lock.release()
                host = options.metrics_host
                if isinstance(err, socket.gaierror):
                    why, fix = err.strerror or str(err), "check --metrics-address"
                else:
                    why = os.strerror(err.errno) if err.errno else str(err)
                    fix = ("choose another --metrics-port" if err.errno in (errno.EADDRINUSE, errno.EACCES)
                           else "check --metrics-address")
                shown = f"[{host}]" if ":" in host else host
                raise StartupError(f"cannot serve metrics on {shown}:{options.metrics_port}: {why} ({fix})") from None
        return cls(backend, options, lock, NvmlThread(), metrics, readiness, http)

    async def release(self) -> None:
        """Give back what the agent holds after its parts stopped: the HTTP endpoint, the API server client,
        NVML, its thread and the lock."""
        if self.http is not None:
            await self.http.stop()
        await _close_kube(self.options)
        with contextlib.suppress(Exception):
            await self.nvml(self.backend.shutdown)
        self.nvml.close()
        self.lock.release()


async def _close_kube(options: AgentOptions) -> None:
    """Close the agent's API server client (its connections), when it has one that can be closed."""
    close = getattr(options.kube, "close", None)
    if close is not None:
        await close()


async def _init_nvml(footing: Footing) -> NodeState:
    for attempt in range(1, NVML_INIT_ATTEMPTS + 1):
        try:
            await footing.nvml(footing.backend.init)
            break
        except NvmlUnavailable as err:
            if attempt == NVML_INIT_ATTEMPTS:
                raise
            log.warning("%s (attempt %d of %d)", err, attempt, NVML_INIT_ATTEMPTS)
            await asyncio.sleep(NVML_INIT_BACKOFF_S * attempt)
    inventory = await footing.nvml(footing.backend.inventory)
    config = footing.options.config
    return NodeState(version=1, inventory=inventory, config=config,
                     machine=machine_type(config.flags.gfd.machine_type_file), labelled_at=int(time.time()))


async def start_agent(backend: NvmlBackend, options: AgentOptions, *,
                      hangup: asyncio.Event | None = None) -> Agent | IdleAgent:
    """Start the agent: checks, the kubelet-directory lock, the HTTP endpoint, NVML (with retries), then every
    part, serving. Returns the running Agent, or the IdleAgent when NVML is unavailable and
    flags.failOnInitError is false. When it raises (or is cancelled, as by a signal during the NVML retries)
    it holds nothing: the lock, the port and the API server client are given back. `hangup` is the event
    SIGHUP sets (reload the config); a new one when not given."""
    try:
        footing = await Footing.take(backend, options)
    except BaseException:
        await _close_kube(options)
        raise
    try:
        for line in options.config.without_effect:
            log.warning("%s", line)
        footing.metrics.config_in_force(options.config.without_effect)
        try:
            state = await _init_nvml(footing)
        except NvmlUnavailable as err:
            if options.config.flags.fail_on_init_error:
                raise
            idle = IdleAgent(footing, f"serving nothing: {err} (flags.failOnInitError is false)")
            log.error("%s", idle.reason)
            return idle
        files = NodeFiles.read()
        for line in check_on_node(options.config, state, options.kubelet_dir, files):
            log.warning("%s", line)
        bus = StateBus(state)
        agent = Agent(footing, bus, files, _dra_parts(options, bus, files, footing),
                      hangup if hangup is not None else asyncio.Event())
    except BaseException:
        await footing.release()
        raise
    try:
        await agent._begin()
    except BaseException:
        await agent.stop()
        raise
    return agent


@dataclass(frozen=True)
class DraParts:
    """DRA mode with an API server: the node's ResourceSlice and the DRA kubelet plugin."""

    slices: SlicePublisher
    plugin: DraKubeletPlugin


def _dra_parts(options: AgentOptions, bus: StateBus, files: NodeFiles, footing: Footing) -> DraParts | None:
    """The DRA parts when dra.enabled and the agent has an API server client to publish with; else None. With
    dra.dynamicMig the publisher offers MIG placements and the kubelet plugin makes MIG devices for claims."""
    dra = options.config.dra
    if not dra.enabled:
        return None
    from agent.dra.claims import ClaimError, Paths
    from agent.dra.dynamic import DynamicMig, DynamicMigError, DynamicSlicePublisher, state_file
    from agent.dra.plugin import DraKubeletPlugin
    from agent.dra.publisher import PublisherClass, SlicePublisher, claim_reader, publisher_for

    metrics = footing.metrics
    paths = Paths.under(options.kubelet_dir.parent, dra.driver_name, dra.cdi_root)
    dynamic: DynamicMig | None = None
    try:
        make: PublisherClass = SlicePublisher
        if dra.dynamic_mig:  # its checkpoint next to the DRA checkpoint
            dynamic = DynamicMig(footing.backend, footing.nvml, state_file(paths.checkpoint))
            make = functools.partial(DynamicSlicePublisher, dynamic=dynamic)
        slices = publisher_for(options.kube, bus, dra.driver_name, metrics.api_errors.inc,
                               on_health_mode=metrics.health_mode, make=make)
        if slices is None:
            return None
        plugin = DraKubeletPlugin(
            paths, dra.driver_name, slices.node, bus, claim_reader(slices), files.control_nodes,
            options.config.flags.dev_root, slices.republish, files.mig_minors, dynamic)
    except (ClaimError, DynamicMigError) as err:
        raise StartupError(str(err)) from None
    return DraParts(slices, plugin)


class IdleAgent:
    """NVML is unavailable and flags.failOnInitError is false (a DaemonSet that also lands on nodes without
    GPUs): the agent serves nothing but its HTTP endpoint, ready, saying why."""

    def __init__(self, footing: Footing, reason: str) -> None:
        self.footing = footing
        self.metrics = footing.metrics
        self.reason = reason
        self.stopped = asyncio.Event()
        footing.readiness.check = self.ready

    def ready(self) -> tuple[bool, str]:
        return True, self.reason

    async def stop(self) -> None:
        await self.footing.release()
        self.stopped.set()


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
        self._tasks: list[asyncio.Task[None]] = []
        self._allocatable_seen: int | None = None
        """The registration count at which the Node last showed the advertised devices in Allocatable."""
        preferences = Preferences(lambda: bus.current)
        self.plugins = PluginSet(
            lambda name: DevicePluginServicer(name, bus, self.plans, preferences, self.metrics, files),
            lambda: plugin_resources(self.plans(bus.current).resources, options.config.dra.enabled,
                                     options.config.dra.dynamic_mig),
            options.kubelet_dir,
            bus,
            self.metrics,
        )
        self.monitor = HealthMonitor(self.backend, bus, self.nvml)
        self.telemetry = TelemetryCollector(self.backend, bus, self.nvml, lambda: self.monitor.xid_counts)
        self.mig = MigController(self.backend, bus, self.nvml, self.metrics,
                                 dra.plugin.holders if dra is not None else list)
        self.mps = MpsDaemons(bus)
        counts = getattr(options.kube, "counts", None)
        self.api_counts = counts if isinstance(counts, ApiCounts) else ApiCounts()
        """What the agent's API client sent and how its watches fared (for /metrics); zeros without one."""
        self.reconciler: NodeReconciler | None = (
            NodeReconciler(options.kube, bus, _intent, owned, self.metrics.api_errors.inc, self.api_counts)
            if options.kube is not None else None)
        """Keeps the agent's parts of its Node; None without an API server (--no-kube)."""
        self.dra = dra
        """DRA mode with an API server: the ResourceSlice publisher and the DRA kubelet plugin; else None."""

    @classmethod
    async def start(cls, backend: NvmlBackend, options: AgentOptions, *,
                    hangup: asyncio.Event | None = None) -> Agent:
        """start_agent for whoever needs an agent that serves: the idle mode (NVML unavailable with
        flags.failOnInitError false) is a StartupError naming why, with nothing held."""
        started = await start_agent(backend, options, hangup=hangup)
        if isinstance(started, IdleAgent):
            await started.stop()
            raise StartupError(started.reason)
        return started

    async def _begin(self) -> None:
        """Wire the metrics to the parts and start every task (and the DRA kubelet plugin's server)."""
        bus, monitor, telemetry, opts = self.bus, self.monitor, self.telemetry, self.options
        self.metrics.watch(bus, self.devices, lambda: monitor.telemetry, lambda: monitor.xid_counts)
        self._spawn("device-plugins", self.plugins.run)
        self._spawn("health", monitor.run)
        self.metrics.watch_ready(self.ready)
        # Without an API server the figures are there all the same, at zero: dashboards need no special case.
        self.metrics.registry.register(ApiCollector(self.api_counts))
        self.metrics.serve_also(renderer(lambda: telemetry.snapshot, lambda: bus.current, lambda: telemetry.enabled))
        self._spawn("telemetry", telemetry.run)
        self._spawn("mig", self.mig.run)
        self._spawn("withheld-resources", self._follow_problems)
        self._spawn("mps", self.mps.run)
        if opts.config_path is not None:
            self._spawn("config-reload", self._follow_config)
        if self.reconciler is not None:
            self._spawn("node-reconciler", self.reconciler.run)
        if self.dra is not None:
            self._spawn("dra-slices", self.dra.slices.run)
            await self.dra.plugin.start()
        self.footing.readiness.check = self.ready
        state = bus.current
        log.info(
            "agent started: %d GPU(s), driver %s, kubelet dir %s, resources %s",
            len(state.inventory.gpus), state.inventory.driver.version, opts.kubelet_dir,
            ", ".join(f"{n}={len(d)}" for n, d in self.devices().items()) or "none",
        )

    def devices(self) -> dict[str, tuple[Device, ...]]:
        resources = self.plans(self.bus.current).resources
        served = plugin_resources(resources, self.options.config.dra.enabled, self.options.config.dra.dynamic_mig)
        return {name: r.devices for name, r in resources.items() if name in served}

    def ready(self) -> tuple[bool, str]:
        """Ready once registered with the kubelet and, with an API server, once the agent's own Node shows
        every advertised resource in Allocatable with as many devices as are healthy: the scheduler can then
        place pods on them. A rolling update waits for that, not just for the registration, before it takes
        the next node's agent down. Checked once per registration (a later health change does not make the
        agent unready)."""
        if (problem := self.backend.problem()) is not None:
            return False, problem
        if not self.plugins.registered.is_set():
            return False, "not registered with the kubelet"
        if self.dra is not None and not self.dra.slices.published.is_set():
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

    async def reload_config(self) -> bool:
        """Load the config again (the file, or the named config the node label asks for); a bad one is
        rejected with its reasons and the last good one keeps serving."""
        path = self.options.config_path
        if path is None:
            raise ValueError("the agent was started without a config file to reload")
        name = self.bus.current.config_request
        try:
            new = load_config(path, name)
        except ConfigError as err:
            return await self._reject(str(err))
        if new == self.bus.current.config:
            return True
        # Exactly the checks start applies (and the parts only a restart can change), with the same lines.
        try:
            check_paths(new)
            warnings = check_on_node(new, self.bus.current, self.options.kubelet_dir, self.files)
        except StartupError as err:
            return await self._reject(str(err).replace("\n", "; "))
        except ConfigError as err:
            return await self._reject("\n".join(f"{path}: {line}" for line in str(err).splitlines()))
        if (start_only := start_only_changes(self.bus.current.config, new)) is not None:
            return await self._reject(f"{path}: {start_only}")
        if new.health.taint != self.bus.current.config.health.taint:
            from agent.kube.selfpod import check_reloaded

            if (untolerated := await check_reloaded(self.options.kube, new.health.taint)) is not None:
                return await self._reject(untolerated)
        for line in [*warnings, *new.without_effect]:
            log.warning("%s", line)
        self.metrics.config_in_force(new.without_effect)
        source = f"{path} ({name})" if name else str(path)
        await self.bus.record([("", "config-applied", f"config reloaded from {source}")], config=new,
                              machine=machine_type(new.flags.gfd.machine_type_file))
        log.info("config reloaded from %s", source)
        return True

    async def _reject(self, why: str) -> bool:
        """A reloaded config refused: said in the log and as a ConfigRejected Event; the last good one serves."""
        log.error("config reload rejected; keeping the last good config: %s", why)
        await self.bus.record([("", "config-rejected", f"config reload rejected: {why}")])
        return False

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

    async def _follow_config(self) -> None:
        """Reload on SIGHUP, when the file changes (a ConfigMap update swaps the mounted file), and when the
        node label names another config."""
        path = self.options.config_path
        if path is None:
            return
        bus = self.bus

        def identity() -> tuple[object, ...] | None:
            try:
                st = config_file(path, bus.current.config_request).stat()
            except (OSError, ConfigError):
                return None
            return (st.st_ino, st.st_mtime_ns, st.st_size)

        # Not the file's identity now: the config in force was read before this task started, and a change in
        # between must not go unseen. The first look reads the file again (an unchanged config changes nothing).
        seen: tuple[object, ...] | None = None
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
        with contextlib.suppress(Exception):
            await self.monitor.close()
        await self.plugins.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
            self.footing.http = None
        if self.dra is not None:
            await self.dra.plugin.stop()
            await self.dra.slices.close()
        await self.footing.release()
        self.stopped.set()


def _quantity(text: str) -> int | None:
    """A device count as the API writes it ("8"); None for anything else."""
    return int(text) if text.isdigit() else None


DEFAULT_MACHINE_TYPE_FILE = Path("/sys/class/dmi/id/product_name")
MACHINE_TYPE_MAX_BYTES = 4096
"""A DMI product name is a short line; a larger file is not a machine type."""


def machine_type(path: Path) -> str:
    """The machine type as GPU feature discovery reads it (flags.gfd.machineTypeFile, by default the DMI product
    name); "unknown" when the file cannot be read."""
    try:
        # The bounded reader of every input file: a FIFO or device there is refused, never waited on.
        text = read_text_file(path, MACHINE_TYPE_MAX_BYTES).strip()
    except InputFileError as err:
        # Machines without DMI (some VMs) have no product name: only a file someone configured is worth a warning.
        level = logging.INFO if path == DEFAULT_MACHINE_TYPE_FILE else logging.WARNING
        log.log(level, "cannot read the machine type from %s: %s; nvidia.com/gpu.machine is unknown", path,
                err.reason)
        return "unknown"
    return text or "unknown"


def _intent(state: NodeState) -> NodeIntent:
    health = state.config.health
    taint = TaintPolicy(health.taint.key, health.taint.effect, health.node_fatal_unhealthy_gpus)
    return node_intent(state, node_labels(state, state.config), taint)


async def run_until_signal(backend: NvmlBackend, options: AgentOptions) -> int:
    """Start the agent and run it until SIGTERM or SIGINT, then stop it; SIGHUP reloads the config. A signal
    while NVML is still being retried stops at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hangup = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, hangup.set)
    starting = asyncio.ensure_future(start_agent(backend, options, hangup=hangup))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        # A signal while NVML is still being retried: stop now rather than after the retries (start_agent
        # gives back what it took).
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        log.info("signal received while starting; shutting down")
        return 0
    stopping.cancel()
    agent = starting.result()
    try:
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
