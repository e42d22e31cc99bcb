"""Prometheus metrics over the newest NodeState and the health monitor's latest sample, and the /healthz and
/readyz endpoints. A scrape reads snapshots; it never calls NVML.

Two families share /metrics: the agent's own (gpu_agent_*, through prometheus_client) and dcgm-exporter's
(DCGM_FI_*, rendered by agent.telemetry.exposition and appended); docs/metrics.md lists both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent import logsink
from agent.inventory import Device
from agent.nvml.records import HealthReading
from agent.nvmlthread import NvmlThread
from agent.state import StateBus

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
        total = GaugeMetricFamily("gpu_agent_gpu_memory_total_bytes", "GPU memory.", labels=labels)
        for (index, uuid), gpu in zip(gpus, state.inventory.gpus, strict=True):
            healthy.add_metric([index, uuid], 1 if state.gpu_health(uuid).healthy else 0)
            total.add_metric([index, uuid], gpu.memory_mib * MIB)
        yield healthy
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


REQUEST_LINE_MAX = 8192
"""The longest request or header line the endpoint reads; a longer one is answered 431."""
MAX_HEADERS = 100
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 503: "Service Unavailable"}


class HttpEndpoint:
    """A small HTTP/1.0 server on the event loop for /metrics, /healthz and /readyz."""

    def __init__(self, metrics: Metrics, ready: Callable[[], tuple[bool, str]]) -> None:
        self._metrics = metrics
        self._ready = ready
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, port: int, host: str = "0.0.0.0") -> None:
        self._server = await asyncio.start_server(self._handle, host, port, limit=REQUEST_LINE_MAX)
        # The port actually bound (--metrics-port 0 picks one), on every address the host resolved to.
        bound = [s.getsockname() for s in self._server.sockets]
        log.info("serving /metrics, /healthz and /readyz on %s",
                 ", ".join(f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}" for a in bound))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def respond(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4", self._metrics.exposition()
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            ok, why = self._ready()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            status, ctype, body, head_only = await self._answer(reader)
            extra = "Allow: GET, HEAD\r\n" if status == 405 else ""
            writer.write(
                f"HTTP/1.0 {status} {REASONS[status]}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"{extra}Connection: close\r\n\r\n".encode() + (b"" if head_only else body)
            )
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, whether to leave the body out) for one request; a request that is too
        long or malformed gets a 4xx and at most one short debug line, never a traceback."""
        try:
            async with asyncio.timeout(5):
                line = await reader.readuntil(b"\n")
            for _ in range(MAX_HEADERS):  # the headers, bounded like the request line; none is needed
                async with asyncio.timeout(5):
                    header = await reader.readuntil(b"\n")
                if header.strip() == b"":
                    break
            else:
                return 431, "text/plain", b"too many header lines\n", False
        except asyncio.LimitOverrunError:
            log.debug("HTTP request refused: a line longer than %d bytes", REQUEST_LINE_MAX)
            return 431, "text/plain", b"request line or header too long\n", False
        except asyncio.IncompleteReadError as err:
            if not err.partial:
                raise
            line = err.partial  # a request line without its blank line (HTTP/0.9-style probes): answer it
        parts = line.decode("latin-1").split()
        if len(parts) not in (2, 3) or not parts[1].startswith("/"):
            log.debug("HTTP request refused: malformed request line")
            return 400, "text/plain", b"malformed request\n", False
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n", False
        status, ctype, body = self.respond(target.split("?", 1)[0])
        return status, ctype, body, method == "HEAD"
