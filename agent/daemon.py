"""The composition root: `start_agent` checks the config and the node (checks.py), takes the footing (the
kubelet-directory lock, or in a rolling update of DRA mode the wait for it, the NVML thread, the metrics and their
HTTP endpoint), initialises NVML with retries, builds the first NodeState and every part of the `Agent`
(agent.py), the DRA parts in DRA mode, and returns it serving, or the `IdleAgent` where NVML stays unavailable
and that is allowed; a start that fails gives back what it took. `run_until_signal` runs it until SIGTERM or
SIGINT (SIGHUP reloads the config)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent.agent import Agent
from agent.checks import (
    StartupError,
    check_dra_sockets,
    check_on_node,
    check_paths,
    check_sockets,
    machine_type,
)
from agent.config import AgentConfig, DraSettings, beside_kubelet
from agent.cordon import load_cordoned
from agent.deviceplugin.nodefiles import read_node_files
from agent.deviceplugin.response import NodeFiles
from agent.kube.reconciler import NodeClient
from agent.locks import DirectoryLock, Held, holder
from agent.metrics import HttpEndpoint, Metrics
from agent.mps import Control
from agent.nvml.backend import NvmlBackend, NvmlUnavailable
from agent.nvml.identity import load_identities, save_identities
from agent.nvml.records import NodeInventory, node_clique
from agent.nvmlthread import NvmlStuck, NvmlThread
from agent.readiness import Readiness
from agent.state import NodeState, StateBus

if TYPE_CHECKING:  # DRA mode and the API server's modules load only where the agent uses them
    from agent.dra.claims import Paths
    from agent.dra.plugin import DraKubeletPlugin
    from agent.dra.publisher import SlicePublisher

log = logging.getLogger(__name__)

T = TypeVar("T")

POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,35}")
"""What the agent takes as a Pod UID (Kubernetes gives an RFC 4122 UUID, 36 characters): it goes into socket names."""

NVML_INIT_ATTEMPTS = 5
NVML_INIT_BACKOFF_S = 1.0


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
    mps_control: Control | None = None
    """How the MPS control daemons are reached; None: the driver's nvidia-cuda-mps-control (`simulate` gives
    its simulated daemon)."""
    pod_uid: str | None = None
    """The agent Pod's UID (POD_UID, from the downward API): the agent may start beside the node's old agent
    during a rolling update with surge. The DRA sockets carry it in their names; a new agent whose node still
    runs the old one serves DRA at once (in DRA mode) and the rest once the old one stops (docs/dra.md, "Rolling
    updates"). Without it, a second agent on a node is refused."""
    gpu_identities: Path | None = None
    """The file where the agent keeps what it read of each GPU (agent/nvml/identity.py), so that a GPU lost before
    a later start is still named; None keeps it only for the process's life."""
    cordon_file: Path | None = None
    """The file where the agent keeps the GPUs cordoned on its Node (agent/cordon.py), so that a later start
    withholds them before it reads the Node; None keeps them only for the process's life."""

    def __post_init__(self) -> None:
        # The kubelet's PodResources socket, unless the config names one, is the one beside `kubelet_dir`.
        object.__setattr__(self, "config", beside_kubelet(self.config, self.kubelet_dir))

    def dra_paths(self, dra: DraSettings) -> Paths:
        """Where the DRA driver of `dra` keeps its sockets, checkpoint and CDI specs on this node."""
        from agent.dra.claims import Paths

        return Paths.under(self.kubelet_dir.parent, dra.driver_name, dra.cdi_root, self.pod_uid)


@dataclass
class Footing:
    """What the agent holds before NVML answers, in every mode: the kubelet-directory lock, the NVML threads (the
    calls, and the wait for XID events: agent/nvmlthread.py), the metrics and, with a metrics port, the HTTP
    endpoint serving them."""

    backend: NvmlBackend
    options: AgentOptions
    lock: DirectoryLock
    """Held from the start, or (a rolling update in DRA mode) not yet: the Agent takes it once the old agent
    lets it go (`DirectoryLock.wait`)."""
    nvml: NvmlThread
    metrics: Metrics
    readiness: Readiness
    http: HttpEndpoint | None
    """None without a metrics port."""
    events: NvmlThread = field(default_factory=lambda: NvmlThread("nvml-events"))
    """The wait for XID events, apart so that it never holds a call nor waits behind a stuck one."""

    @classmethod
    async def take(cls, backend: NvmlBackend, options: AgentOptions) -> Footing:
        """Check the config's paths and the kubelet directory, take the directory's lock and the metrics port;
        raises StartupError (holding nothing) when one of them cannot be had."""
        check_paths(options.config)
        check_sockets(options.kubelet_dir, ())
        if options.pod_uid is not None and not POD_UID.fullmatch(options.pod_uid):
            raise StartupError(f"POD_UID {options.pod_uid!r} is not a Pod UID (letters, digits and dashes, at most "
                               "36; the DaemonSet sets it from metadata.uid)")
        lock = DirectoryLock(options.kubelet_dir, f"another agent serves the kubelet directory {options.kubelet_dir}")
        try:
            lock.acquire()
        except Held as err:
            if not options.pod_uid:
                raise StartupError(str(err)) from None
            log.info("%s serves the kubelet directory %s (a rolling update): %sthe device plugin, MIG manager, "
                     "MPS daemons and the Node once it stops", holder(options.kubelet_dir), options.kubelet_dir,
                     "serving DRA now, and " if options.config.dra.enabled else "serving ")
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
        try:
            await self.nvml.if_answering(self.backend.shutdown)
        except NvmlStuck as err:  # a call that never returns must not hold the stop: its thread ends with us
            log.warning("stopping without shutting NVML down: %s", err)
        except Exception as err:  # NVML answered with an error: nothing more to give back
            log.debug("NVML shutdown: %s", err)
        self.nvml.close()
        self.events.close()
        self.lock.release()


async def _close_kube(options: AgentOptions) -> None:
    """Close the agent's API server client (its connections), when it has one that can be closed."""
    close = getattr(options.kube, "close", None)
    if close is not None:
        await close()


async def _init_nvml(footing: Footing) -> NodeState:
    identities = footing.options.gpu_identities
    if identities is not None:
        remembered = footing.backend.remembered
        for index, gpu in load_identities(identities).items():
            remembered.setdefault(index, gpu)
    deadline = footing.options.config.health.nvml_deadline_seconds
    footing.nvml.deadline_s = deadline
    for attempt in range(1, NVML_INIT_ATTEMPTS + 1):
        try:
            try:
                async with asyncio.timeout(deadline):
                    await footing.nvml(footing.backend.init, what="nvmlInit")
            except TimeoutError:
                footing.nvml.overdue()  # the worker is set aside: the next attempt runs on a new one
                raise NvmlUnavailable(f"NVML initialisation did not answer within {deadline:g}s "
                                      "(health.nvmlDeadlineSeconds)") from None
            break
        except NvmlUnavailable as err:
            if attempt == NVML_INIT_ATTEMPTS:
                raise
            log.warning("%s (attempt %d of %d)", err, attempt, NVML_INIT_ATTEMPTS)
            await asyncio.sleep(NVML_INIT_BACKOFF_S * attempt)
    inventory = await _first_inventory(footing, deadline)
    if identities is not None:
        save_identities(identities, footing.backend.remembered)
    lost = [g for g in inventory.gpus if g.lost]
    if lost:
        log.warning("NVML counts %d GPU(s), %d of them lost (no handle, or every call failing): %s",
                    len(inventory.gpus), len(lost), "; ".join(
                        f"GPU {g.index}" + (" (never read)" if g.unread else f" {g.uuid}") for g in lost))
    config = footing.options.config
    # The GPUs an operator cordoned stay withheld from the first list on, before the Node is read (with an API
    # server only: without one nothing could lift the cordon).
    cordon = footing.options.cordon_file
    cordoned = load_cordoned(cordon, inventory) if cordon is not None and footing.options.kube is not None else None
    if cordoned:
        log.info("GPUs cordoned when the agent last ran stay cordoned until the Node is read: %s",
                 ", ".join(str(g.index) for g in inventory.gpus if g.uuid in cordoned))
    # In DRA mode whole GPUs are offered once the handover knows which ones pods hold through the device plugin.
    return NodeState(version=1, inventory=inventory, config=config, handover=config.dra.enabled,
                     machine=machine_type(config.flags.gfd.machine_type_file), labelled_at=int(time.time()),
                     cordoned=cordoned or frozenset())


async def _first_inventory(footing: Footing, deadline: float) -> NodeInventory:
    """The inventory, each GPU read within the deadline: a GPU whose read does not return is listed as lost (what
    was last read of it) and the agent starts with the others; its read goes on on a worker set aside, and the
    health monitor reads the GPU whole once it answers."""
    backend, nvml = footing.backend, footing.nvml
    gpus = []
    for index in range(backend.count):
        try:
            async with asyncio.timeout(deadline):
                gpus.append(await nvml(functools.partial(backend.read_gpu, index), what="the inventory", gpu=index))
        except TimeoutError:
            nvml.overdue()  # the worker is set aside: the reads of the other GPUs go on on a new one
            log.warning("GPU %d did not answer NVML within %gs (health.nvmlDeadlineSeconds): listed as lost",
                        index, deadline)
            gpus.append(backend.unanswered(index))
    try:
        async with asyncio.timeout(deadline):
            return await nvml(lambda: backend.inventory_of(tuple(gpus)), what="the inventory")
    except TimeoutError:
        nvml.overdue()
        raise NvmlUnavailable(f"NVML did not list the GPUs within {deadline:g}s (health.nvmlDeadlineSeconds)") from None


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
        files = read_node_files(state.inventory.imex_channels)
        for line in check_on_node(options.config, state, options.kubelet_dir, files):
            log.warning("%s", line)
        clique = node_clique(state.inventory.gpus)
        if clique.problem is not None:  # as GPU feature discovery warns, once, and labels no clique
            logging.getLogger("agent.labels").warning("nvidia.com/gpu.clique: %s", clique.problem)
        bus = StateBus(state)
        dra = dra_parts(options, options.config.dra, bus, files, footing)
        if dra is None and claims_left(options):
            # Device-plugin mode on a node where the agent prepared DRA claims before (it was switched back, then
            # restarted): the DRA kubelet plugin serves their unprepare, and the handover keeps their GPUs out of
            # the device plugin until their pods end.
            dra = dra_parts(options, options.config.dra.model_copy(update={"enabled": True}), bus, files, footing)
            if dra is not None:
                await bus.update(handover=True)
        agent = Agent(footing, bus, files, dra, hangup if hangup is not None else asyncio.Event())
    except BaseException:
        await footing.release()
        raise
    try:
        await agent.begin()
    except BaseException:
        await agent.stop()
        raise
    return agent


@dataclass(frozen=True)
class DraParts:
    """DRA mode with an API server: the node's ResourceSlice and the DRA kubelet plugin."""

    slices: SlicePublisher
    plugin: DraKubeletPlugin


def dra_parts(options: AgentOptions, dra: DraSettings, bus: StateBus, files: NodeFiles,
              footing: Footing) -> DraParts | None:
    """The DRA parts for the settings `dra` (at start, or at the first switch to DRA mode) when dra.enabled and
    the agent has an API server client to publish with; else None. With dra.dynamicMig the publisher offers MIG
    placements and the kubelet plugin makes MIG devices for claims."""
    if not dra.enabled:
        return None
    # Only a NodeApi can publish, and the agent has one only where its module is loaded: without one
    # (--no-kube, `simulate`) the DRA modules, which load the HTTP client, are not imported at all.
    node_module = sys.modules.get("agent.kube.node")
    if node_module is None or not isinstance(options.kube, node_module.NodeApi):
        logging.getLogger("agent.dra.publisher").warning(
            "DRA mode: no API server client; no ResourceSlice is published")
        return None
    from agent.dra.claims import ClaimError, ClaimStore
    from agent.dra.dynamic import DynamicMig, DynamicMigError, DynamicSlicePublisher
    from agent.dra.plugin import DraKubeletPlugin
    from agent.dra.publisher import PublisherClass, SlicePublisher, slice_api

    metrics = footing.metrics
    check_dra_sockets(options.kubelet_dir.parent, dra.driver_name)
    paths = options.dra_paths(dra)
    dynamic: DynamicMig | None = None
    try:
        make: PublisherClass = SlicePublisher
        if dra.dynamic_mig:  # its MIG devices recorded with their claims in the DRA checkpoint
            dynamic = DynamicMig(footing.backend, footing.nvml, ClaimStore(paths, dra.driver_name))
            make = functools.partial(DynamicSlicePublisher, dynamic=dynamic)
        shared = slice_api(options.kube)
        if shared is None:
            return None
        api, node = shared
        slices = make(api, bus, node, dra.driver_name, on_error=metrics.api_errors.inc,
                      on_health_mode=metrics.health_mode)
        plugin = DraKubeletPlugin(
            paths, dra.driver_name, node, bus, api, files.control_nodes,
            bus.current.config.flags.dev_root, slices.republish, files.mig_minors, dynamic)
    except (ClaimError, DynamicMigError) as err:
        raise StartupError(str(err)) from None
    return DraParts(slices, plugin)


def claims_left(options: AgentOptions) -> bool:
    """Whether the DRA checkpoint of the config's driver holds prepared claims (read only where it exists)."""
    dra = options.config.dra
    from agent.dra.claims import ClaimError, ClaimStore

    paths = options.dra_paths(dra)
    if not paths.checkpoint.exists():
        return False
    store = ClaimStore(paths, dra.driver_name)
    try:
        store.refresh(always=True)
    except (ClaimError, OSError) as err:
        log.warning("cannot read the DRA checkpoint %s: %s", paths.checkpoint, err)
        return False
    return bool(store.claims)


class IdleAgent:
    """NVML is unavailable and flags.failOnInitError is false (a DaemonSet that also lands on nodes without
    GPUs): the agent serves nothing but its HTTP endpoint, ready, saying why."""

    def __init__(self, footing: Footing, reason: str) -> None:
        self.footing = footing
        self.metrics = footing.metrics
        self.reason = reason
        self.stopped = asyncio.Event()
        self.failed: str | None = None
        self.failing = asyncio.Event()
        """Never set: an idle agent serves nothing a replaced kubelet directory could take from it."""
        footing.readiness.check = self.ready

    def ready(self) -> tuple[bool, str]:
        return True, self.reason

    async def stop(self) -> None:
        await self.footing.release()
        self.stopped.set()


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
        stopping = asyncio.ensure_future(stop.wait())
        failing = asyncio.ensure_future(agent.failing.wait())
        try:
            await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            failing.cancel()
        if agent.failed is not None:
            log.error("%s; stopping", agent.failed)
            return 1
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
