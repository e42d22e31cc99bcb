"""Prometheus metrics over the newest NodeState and the health monitor's latest sample, and the /healthz and
/readyz endpoints. A scrape reads snapshots; it never calls NVML.

Two families share /metrics: the agent's own (gpu_agent_*, through prometheus_client) and dcgm-exporter's
(DCGM_FI_*, rendered by agent.telemetry.exposition and appended); docs/metrics.md lists both."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent import logsink
from agent.inventory import Device
from agent.nvml.records import HealthReading, NodeInventory
from agent.nvmlthread import NvmlThread
from agent.state import NodeState, StateBus
from agent.topology.fragmentation import Fragmentation, fragmentation
from agent.topology.model import Topology
from agent.topology.prefer import topology_of

log = logging.getLogger(__name__)

MIB = 1024 * 1024

THROTTLE_REASONS: dict[str, int] = {
    "thermal": 0x20 | 0x40,
    "power_cap": 0x04,
    "power_brake": 0x80,
}
"""Clock-event reason bits (nvmlClocksEventReason*) behind gpu_agent_gpu_throttled: Sw/HwThermalSlowdown,
SwPowerCap, HwPowerBrakeSlowdown."""


class Metrics:
    """The agent's registry; components count their own events through these."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.task_restarts = Counter("gpu_agent_task_restarts", "Supervised tasks restarted after an error.",
                                     ["task"], registry=r)
        self.allocations = Counter("gpu_agent_allocations", "Devices handed out by Allocate.", ["resource"],
                                   registry=r)
        self.allocate_errors = Counter("gpu_agent_allocate_errors", "Allocate calls refused.", ["resource"],
                                       registry=r)
        self.registrations = Counter("gpu_agent_kubelet_registrations", "Registrations with the kubelet.",
                                     ["resource"], registry=r)
        self.api_errors = Counter("gpu_agent_api_errors", "Failed API server requests (retried).", registry=r)
        self.mig_reconfigurations = Counter("gpu_agent_mig_reconfigurations", "MIG layouts applied, by outcome.",
                                            ["outcome"], registry=r)
        self.mig_seconds = Histogram("gpu_agent_mig_reconfiguration_seconds", "Time to apply a MIG layout.",
                                     buckets=(1, 5, 15, 30, 60, 120, 300, 600), registry=r)
        self.mig_retries = Counter("gpu_agent_mig_retries", "MIG layouts tried again while the label stayed, by "
                                   "the outcome that made them retry.", ["outcome"], registry=r)
        self.config_keys_without_effect = Gauge(
            "gpu_agent_config_keys_without_effect",
            "Keys of the config in force that are accepted but have no effect here (1 each).", ["key"], registry=r)
        self.unmatched_selectors = Gauge(
            "gpu_agent_sharing_unmatched_selectors",
            "Sharing entries and device selectors of the config in force that select nothing on this node.",
            registry=r)
        self.dra_health_mode = Gauge(
            "gpu_agent_dra_health_mode",
            "DRA mode: how unhealthy devices are kept out of claims, once decided (1 for the mode in effect): "
            "taints (the API server keeps device taints) or withdrawal (it drops them).", ["mode"], registry=r)

        self.registry.register(_LogDropCollector())

    def health_mode(self, mode: str) -> None:
        """Record the DRA health mode the slice publisher decided on ("taints" or "withdrawal")."""
        for known in ("taints", "withdrawal"):
            self.dra_health_mode.labels(mode=known).set(int(known == mode))

    def config_in_force(self, without_effect: tuple[str, ...]) -> None:
        """Count the config's keys without effect (lines "<file>: <key> ..." from AgentConfig.without_effect)."""
        self.config_keys_without_effect.clear()
        for line in without_effect:
            key = line.split(": ", 1)[-1].split(" ", 1)[0]
            self.config_keys_without_effect.labels(key=key).set(1)

    _extra: tuple[Callable[[], bytes], ...] = ()

    def serve_also(self, render: Callable[[], bytes]) -> None:
        """Append another family's exposition text to every /metrics response."""
        self._extra = (*self._extra, render)

    def exposition(self) -> bytes:
        return generate_latest(self.registry) + b"".join(render() for render in self._extra)

    def watch_ready(self, ready: Callable[[], tuple[bool, str]]) -> None:
        self.registry.register(ReadyCollector(ready))

    def watch_nvml(self, threads: Sequence[NvmlThread]) -> None:
        """The NVML calls in flight on these threads: the oldest's age and the calls past their deadline."""
        self.registry.register(NvmlCollector(tuple(threads)))

    def watch(self, bus: StateBus, devices: Callable[[], dict[str, tuple[Device, ...]]],
              telemetry: Callable[[], Mapping[str, HealthReading]],
              xids: Callable[[], Mapping[tuple[str, int], int]]) -> None:
        self.registry.register(StateCollector(bus, devices, telemetry, xids))

    def watch_free(self, bus: StateBus, holdings: Callable[[], Collection[str] | None]) -> None:
        """The free GPUs and how fragmented they are; `holdings`: the GPU and MIG device UUIDs pods hold, None
        where the agent does not know them."""
        self.registry.register(FreeCapacityCollector(bus, holdings))

    def watch_usage(self, usage: Collector) -> None:
        """The GPU-seconds held per namespace and pod (agent/telemetry/chargeback.py), as the telemetry passes
        count them."""
        self.registry.register(usage)


class _LogDropCollector(Collector):
    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("gpu_agent_log_lines_dropped", "Log lines dropped because stderr was not "
                                     "being read (agent/logsink.py).")
        family.add_metric([], sum(sink.dropped for sink in logsink.sinks()))
        yield family


class NvmlCollector(Collector):
    def __init__(self, threads: tuple[NvmlThread, ...]) -> None:
        self._threads = threads

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        oldest = GaugeMetricFamily("gpu_agent_nvml_call_age_seconds",
                                   "How long the oldest NVML call in flight has been running (0 when none).")
        waited = [call.waited(now) for thread in self._threads if (call := thread.current) is not None]
        oldest.add_metric([], max(waited, default=0.0))
        yield oldest
        overdue = CounterMetricFamily("gpu_agent_nvml_overdue_calls",
                                      "NVML calls that ran past their deadline (health.nvmlDeadlineSeconds).")
        overdue.add_metric([], sum(thread.overdue_calls for thread in self._threads))
        yield overdue


class ReadyCollector(Collector):
    def __init__(self, ready: Callable[[], tuple[bool, str]]) -> None:
        self._ready = ready

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("gpu_agent_ready", "1 when /readyz answers ready, 0 when not.")
        family.add_metric([], 1 if self._ready()[0] else 0)
        yield family


class StateCollector(Collector):
    """Node, GPU and resource figures, read at scrape time from snapshots."""

    def __init__(self, bus: StateBus, devices: Callable[[], dict[str, tuple[Device, ...]]],
                 telemetry: Callable[[], Mapping[str, HealthReading]],
                 xids: Callable[[], Mapping[tuple[str, int], int]]) -> None:
        self._bus = bus
        self._devices = devices
        self._telemetry = telemetry
        self._xids = xids

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        state = self._bus.current
        version = GaugeMetricFamily("gpu_agent_state_version", "Version of the node state the agent serves.")
        version.add_metric([], state.version)
        yield version
        gpus = [(str(g.index), g.uuid) for g in state.inventory.gpus]
        labels = ["gpu", "uuid"]
        healthy = GaugeMetricFamily("gpu_agent_gpu_healthy", "1 when the GPU is healthy, 0 when not.", labels=labels)
        cordoned = GaugeMetricFamily("gpu_agent_gpu_cordoned",
                                     "1 while an operator has the GPU out of service (gpu-node-agent.io/cordon).",
                                     labels=labels)
        total = GaugeMetricFamily("gpu_agent_gpu_memory_total_bytes", "GPU memory.", labels=labels)
        for (index, uuid), gpu in zip(gpus, state.inventory.gpus, strict=True):
            healthy.add_metric([index, uuid], 1 if state.gpu_health(uuid).healthy else 0)
            cordoned.add_metric([index, uuid], 1 if uuid in state.cordoned else 0)
            total.add_metric([index, uuid], gpu.memory_mib * MIB)
        yield healthy
        yield cordoned
        yield total
        readings = self._telemetry()
        sampled: dict[str, tuple[str, Callable[[HealthReading], float | None]]] = {
            "gpu_agent_gpu_temperature_celsius": ("GPU temperature.", lambda r: r.temperature_c),
            "gpu_agent_gpu_power_watts": ("GPU power draw.", lambda r: r.power_w),
            "gpu_agent_gpu_utilization_ratio": (
                "Share of time the GPU was busy (not reported with MIG on).",
                lambda r: None if r.utilization_pct is None else r.utilization_pct / 100),
            "gpu_agent_gpu_memory_used_bytes": (
                "GPU memory in use.", lambda r: None if r.memory_used_mib is None else r.memory_used_mib * MIB),
        }
        for name, (doc, read) in sampled.items():
            family = GaugeMetricFamily(name, doc, labels=labels)
            for index, uuid in gpus:
                reading = readings.get(uuid)
                value = None if reading is None else read(reading)
                if value is not None:
                    family.add_metric([index, uuid], value)
            yield family
        lost = GaugeMetricFamily("gpu_agent_gpu_lost", "1 when the GPU has fallen off the bus (NVML GpuIsLost).",
                                 labels=labels)
        ecc = GaugeMetricFamily("gpu_agent_gpu_ecc_uncorrected_errors",
                                "Uncorrected ECC errors since the last GPU reset (volatile count).", labels=labels)
        throttled = GaugeMetricFamily("gpu_agent_gpu_throttled",
                                      "1 while the GPU's clocks are held down for this reason.",
                                      labels=[*labels, "reason"])
        for index, uuid in gpus:
            reading = readings.get(uuid)
            if reading is None:
                continue
            lost.add_metric([index, uuid], 1 if reading.lost else 0)
            if reading.ecc_uncorrected_volatile is not None:
                ecc.add_metric([index, uuid], reading.ecc_uncorrected_volatile)
            if reading.clock_event_reasons is not None:
                for reason, bits in THROTTLE_REASONS.items():
                    throttled.add_metric([index, uuid, reason], 1 if reading.clock_event_reasons & bits else 0)
        yield lost
        yield ecc
        yield throttled
        xid = CounterMetricFamily("gpu_agent_gpu_xid_errors", "XID events seen, by GPU and code.",
                                  labels=["gpu", "uuid", "xid"])
        index_of = {uuid: index for index, uuid in gpus}
        for (uuid, code), count in sorted(self._xids().items()):
            xid.add_metric([index_of.get(uuid, ""), uuid, str(code)], count)
        yield xid
        advertised = GaugeMetricFamily("gpu_agent_resource_devices", "Devices advertised to the kubelet.",
                                       labels=["resource"])
        allocatable = GaugeMetricFamily("gpu_agent_resource_allocatable", "Healthy devices advertised.",
                                        labels=["resource"])
        for resource, items in sorted(self._devices().items()):
            advertised.add_metric([resource], len(items))
            allocatable.add_metric([resource], sum(d.healthy for d in items))
        yield advertised
        yield allocatable


class FreeCapacityCollector(Collector):
    """The free whole GPUs, the largest NVLink-connected and one-NUMA-node sets of them, and the MIG instances
    that could still be placed (agent/topology/fragmentation.py), from the newest state and what pods hold at
    scrape time. They are computed again only when either changed, so a scrape costs a comparison in between.
    Where the holdings are not known the free-GPU figures have no sample rather than count held GPUs free."""

    def __init__(self, bus: StateBus, holdings: Callable[[], Collection[str] | None]) -> None:
        self._bus = bus
        self._holdings = holdings
        self._topology: tuple[NodeInventory, Topology] | None = None
        self._last: tuple[NodeState, frozenset[str] | None, Fragmentation] | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def _figures(self) -> tuple[bool, Fragmentation]:
        state = self._bus.current
        found = self._holdings()
        held = None if found is None else frozenset(found)
        last = self._last
        if last is None or last[0] is not state or last[1] != held:
            topology = self._topology
            if topology is None or topology[0] is not state.inventory:
                topology = (state.inventory, topology_of(state.inventory))
                self._topology = topology
            last = (state, held, fragmentation(state, held or frozenset(), topology[1]))
            self._last = last
        return held is not None, last[2]

    def collect(self) -> Iterator[Metric]:
        known, figures = self._figures()
        free = {
            "gpu_agent_free_gpus": ("Whole GPUs free: offered (healthy, MIG off, not draining) and held by no pod.",
                                    len(figures.free)),
            "gpu_agent_free_gpus_largest_nvlink_set": ("The most free GPUs all joined pairwise by NVLink.",
                                                       figures.largest_nvlink_set),
            "gpu_agent_free_gpus_largest_numa_set": ("The most free GPUs on one NUMA node.", figures.largest_numa_set),
        }
        for name, (doc, value) in free.items():
            family = GaugeMetricFamily(name, doc)
            if known:
                family.add_metric([], value)
            yield family
        best = GaugeMetricFamily("gpu_agent_gpus_largest_nvlink_set",
                                 "The most of the node's GPUs, free or not, all joined pairwise by NVLink.")
        best.add_metric([], figures.node_nvlink_set)
        yield best
        mig = GaugeMetricFamily("gpu_agent_mig_placeable_instances",
                                "More instances of the MIG profile the MIG GPUs could take beside theirs, summed.",
                                labels=["profile"])
        for profile, count in figures.mig_placeable.items():
            mig.add_metric([profile], count)
        yield mig


REQUEST_LINE_MAX = 8192
"""The longest request or header line the endpoint reads; a longer one is answered 431."""
MAX_HEADERS = 100
"""The most header lines a request may have; a request with this many is answered 431."""
MAX_CONNECTIONS = 64
"""The most connections the endpoint holds at once. Its clients at one time are a handful (the kubelet's liveness
and readiness probes, one or two Prometheus servers, an operator's curl). 64 slow clients cost at most 64
descriptors and a few MiB: each holds a line of up to REQUEST_LINE_MAX bytes or an answer not yet taken (/metrics
is about 60 KB on an 8-GPU node), in the agent or in the kernel's buffers. Without a cap each connection cost
about 5.5 KB, and ~11,000 of them the pod's 128 MiB. At the cap a new connection is never refused nor queued: it
takes the place of the oldest one still sending its request or, when every one held is being answered, of the
oldest of those; the one it replaces is closed at once (reset) without (the rest of) its answer. So slow clients
cannot keep a new one out: a request that is whole when its connection is accepted (a kubelet probe sends its
request as it connects, and under a flood it waits in the kernel's queue) is answered at once, and any other is
read unless 64 newer connections come before it is whole."""
REQUEST_DEADLINE_S = 5.0
"""The time a client has, from its connection's accept, to send the request line and every header (together,
not each): a kubelet probe sends its whole request at once, within its 1 s timeout. A client still sending then is
closed without an answer."""
WRITE_DEADLINE_S = 10.0
"""The time a client has to take its whole answer once its request is read (Prometheus gives a scrape 10 s by
default): until then the connection is held, also once the kernel has taken the last bytes and only the client's
acknowledgement is awaited, so that an answer nobody reads is never left queued in the kernel past this; a client
that has not taken it by then is reset, and the kernel drops what it still queued."""
FLUSH_POLL_S = 0.05
"""How often an answer written whole is looked at until its client has acknowledged it (SIOCOUTQ)."""
LISTEN_BACKLOG = 100
"""Connections the kernel queues until the endpoint accepts them; also the most accepted in one turn of the loop."""
RECV_BYTES = 16384
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 503: "Service Unavailable"}


class _Client:
    """One connection: what it sent of its request, then what is left of its answer to write. Reading (`out` is
    None), writing (`out` holds the rest), or flushed (`out` empty: written, not yet acknowledged)."""

    __slots__ = ("deadline", "headers", "line", "out", "request_line", "sock", "timer")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.line = bytearray()
        """What came of the line being read."""
        self.request_line: bytes | None = None
        self.headers = 0
        self.out: memoryview | None = None
        self.timer: asyncio.TimerHandle | None = None


class HttpEndpoint:
    """A small HTTP/1.0 server on the event loop for /metrics, /healthz and /readyz, on non-blocking sockets of
    its own: at most MAX_CONNECTIONS connections, each request read within REQUEST_DEADLINE_S of the accept and
    its answer taken within WRITE_DEADLINE_S (docs/operations.md, "Metrics, alerts and the dashboard")."""

    def __init__(self, metrics: Metrics, ready: Callable[[], tuple[bool, str]]) -> None:
        self._metrics = metrics
        self._ready = ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[socket.socket] = []
        self._held: dict[_Client, None] = {}
        """The connections waited on, oldest first."""
        self.dropped = 0
        """Connections closed to keep to MAX_CONNECTIONS."""
        self._warned = -60.0

    @property
    def port(self) -> int:
        assert self._listeners
        return int(self._listeners[0].getsockname()[1])

    async def start(self, port: int, host: str = "0.0.0.0") -> None:
        """Listen on every address the host resolves to, bound as asyncio.start_server binds (OSError, or
        socket.gaierror for a name that does not resolve, when it cannot)."""
        loop = asyncio.get_running_loop()
        infos = set(await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
        listeners: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in infos:
                try:
                    sock = socket.socket(family, kind, proto)
                except OSError:  # a family this host lacks (IPv6): the other addresses may do
                    continue
                listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind(address)
                except OSError as err:
                    raise OSError(err.errno, f"error while attempting to bind on address {address!r}: "
                                  f"{(err.strerror or str(err)).lower()}") from None
                sock.listen(LISTEN_BACKLOG)
                sock.setblocking(False)
            if not listeners:
                raise OSError(errno.EAFNOSUPPORT, f"no address of {host!r} can be listened on")
        except BaseException:
            for sock in listeners:
                sock.close()
            raise
        self._loop, self._listeners = loop, listeners
        for sock in listeners:
            loop.add_reader(sock, self._accept, sock)
        # The port actually bound (--metrics-port 0 picks one), on every address the host resolved to.
        bound = [s.getsockname() for s in listeners]
        log.info("serving /metrics, /healthz and /readyz on %s",
                 ", ".join(f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}" for a in bound))

    async def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        for sock in self._listeners:
            loop.remove_reader(sock)
            sock.close()
        self._listeners = []
        for client in list(self._held):
            self._close(client, loop)

    def respond(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4", self._metrics.exposition()
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            ok, why = self._ready()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        return 404, "text/plain", b"not found\n"

    def _accept(self, listener: socket.socket) -> None:
        loop = self._loop
        if loop is None:
            return
        for _ in range(LISTEN_BACKLOG):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: the connections wait in the kernel's queue for a second.
                    log.warning("metrics endpoint: cannot accept a connection: %s", err.strerror or err)
                    loop.remove_reader(listener)
                    loop.call_later(1.0, self._listen, listener)
                return  # else the connection went away before it was accepted
            sock.setblocking(False)
            client = _Client(sock, loop.time() + REQUEST_DEADLINE_S)
            self._receive(client)  # its request may be whole already: then it is answered now
            if client.out is None and client.sock.fileno() >= 0:
                self._hold(client, loop)

    def _listen(self, listener: socket.socket) -> None:
        if self._loop is not None and listener in self._listeners:
            self._loop.add_reader(listener, self._accept, listener)

    def _hold(self, client: _Client, loop: asyncio.AbstractEventLoop) -> None:
        """Hold a client still reading, or whose answer is not all written or acknowledged, within
        MAX_CONNECTIONS; it waits for the event that moves it on, or its deadline."""
        if client not in self._held:
            if len(self._held) >= MAX_CONNECTIONS:
                oldest = next((c for c in self._held if c.out is None), None)
                self._drop(next(iter(self._held)) if oldest is None else oldest, loop)
            self._held[client] = None
        if client.timer is not None:
            client.timer.cancel()
        if client.out is None:
            loop.add_reader(client.sock, self._receive, client)
        elif client.out:
            loop.add_writer(client.sock, self._send, client)
        else:
            client.timer = loop.call_at(min(loop.time() + FLUSH_POLL_S, client.deadline), self._flushed, client)
            return
        client.timer = loop.call_at(client.deadline, self._close, client, loop)

    def _drop(self, client: _Client, loop: asyncio.AbstractEventLoop) -> None:
        self.dropped += 1
        if loop.time() - self._warned >= 60:
            self._warned = loop.time()
            log.warning("metrics endpoint: %d connections held, its most: closing the oldest still sending its "
                        "request, or else the oldest still being answered (%d closed so far; at most one such "
                        "line a minute)", MAX_CONNECTIONS, self.dropped)
        self._close(client, loop)

    def _close(self, client: _Client, loop: asyncio.AbstractEventLoop, *, reset: bool = True) -> None:
        """Close a client; one with an answer not taken whole is reset, so that the kernel drops what it queued
        for it rather than keep it past the endpoint's deadline."""
        if client.timer is not None:
            client.timer.cancel()
            client.timer = None
        if client in self._held:
            del self._held[client]
            loop.remove_reader(client.sock)
            loop.remove_writer(client.sock)
        if reset and client.out is not None:
            client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.sock.close()

    def _receive(self, client: _Client) -> None:
        try:
            data = client.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client stopped sending: answer a request line, whole or not (HTTP/0.9-style probes)
            line = client.request_line if client.request_line is not None else bytes(client.line)
            if line:
                self._answer(client, *self._reply(line))
            elif self._loop is not None:
                self._close(client, self._loop)
            return
        client.line += data
        while True:
            end = client.line.find(b"\n")
            if end < 0 and len(client.line) <= REQUEST_LINE_MAX:
                return
            if not 0 <= end < REQUEST_LINE_MAX:
                log.debug("HTTP request refused: a line longer than %d bytes", REQUEST_LINE_MAX)
                self._answer(client, 431, "text/plain", b"request line or header too long\n", False)
                return
            line = bytes(client.line[:end + 1])
            del client.line[:end + 1]
            if client.request_line is None:
                client.request_line = line
            elif line.strip() == b"":
                self._answer(client, *self._reply(client.request_line))
                return
            else:
                client.headers += 1  # none is needed
                if client.headers >= MAX_HEADERS:
                    self._answer(client, 431, "text/plain", b"too many header lines\n", False)
                    return

    def _answer(self, client: _Client, status: int, ctype: str, body: bytes, head_only: bool) -> None:
        loop = self._loop
        if loop is None:
            return
        extra = "Allow: GET, HEAD\r\n" if status == 405 else ""
        client.out = memoryview(
            f"HTTP/1.0 {status} {REASONS[status]}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n".encode() + (b"" if head_only else body))
        client.line = bytearray()
        client.deadline = loop.time() + WRITE_DEADLINE_S
        if client in self._held:
            loop.remove_reader(client.sock)
        if self._send(client):
            self._hold(client, loop)  # now waiting to write, within the write deadline

    def _send(self, client: _Client) -> bool:
        """Write what the socket takes of the answer; True while some is left."""
        assert client.out is not None and self._loop is not None
        try:
            client.out = client.out[client.sock.send(client.out):]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(client, self._loop)
            return False
        if client.out:
            return True
        if client in self._held:
            self._loop.remove_writer(client.sock)
        self._flushed(client)
        return False

    def _flushed(self, client: _Client) -> None:
        """An answer written whole: closed once the client has acknowledged every byte (it may not read them:
        until then the kernel holds them), reset at the deadline. What the client sent past its request is read
        first, so that closing sends FIN, not RST, and a client still reading gets the whole answer."""
        assert self._loop is not None
        if client.timer is not None:
            client.timer.cancel()
            client.timer = None
        for _ in range(16):
            try:
                if not client.sock.recv(65536):
                    break
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset by the client
                self._close(client, self._loop)
                return
        unacknowledged = struct.unpack("i", fcntl.ioctl(client.sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        if not unacknowledged:
            self._close(client, self._loop, reset=False)
        elif self._loop.time() >= client.deadline:
            self._close(client, self._loop)
        else:
            self._hold(client, self._loop)

    def _reply(self, line: bytes) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, whether to leave the body out) for a request line; one that is
        malformed gets a 4xx and at most one short debug line, never a traceback."""
        parts = line.decode("latin-1").split()
        if len(parts) not in (2, 3) or not parts[1].startswith("/"):
            log.debug("HTTP request refused: malformed request line")
            return 400, "text/plain", b"malformed request\n", False
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n", False
        status, ctype, body = self.respond(target.split("?", 1)[0])
        return status, ctype, body, method == "HEAD"
