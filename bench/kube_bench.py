"""Measurements against a real kube-apiserver (tests/integration/apiserver.py): XID to the agent's taint on its
Node, and the API writes of an agent at rest.

The agent runs in this process on the fake NVML, with `NodeApi` connected to the rig as the DaemonSet's agent
connects to its cluster. The benchmark sees the Node through its own watch (raw JSON lines, stamped on
arrival), never through the agent. Nothing here decides pass or fail; `bench/run.py` holds the budgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.aio import client, config

from agent.agent import Agent
from agent.config import DEFAULT_CONFIG, AgentConfig
from agent.health.monitor import EVENT_WAIT_MS
from agent.kube.node import NodeApi
from agent.kube.reconciler import CONDITION_TYPE
from agent.kube.view import NodeView
from agent.nvml.fake import FakeNvml
from bench.grpc_bench import latency
from tests.plugin_harness import running_agent

XID = 79
"""GPU fallen off the bus: node-fatal by the default health policy, so the agent taints its Node at once."""
TAINT_KEY = DEFAULT_CONFIG.health.taint.key
CONVERGE_TIMEOUT_S = 30.0
TAINT_TIMEOUT_S = 10.0
WATCH_TIMEOUT_S = 600


@dataclass(frozen=True)
class Seen:
    """One version of the Node as the benchmark's watch received it."""

    arrived: float
    """time.perf_counter() when its line arrived, before parsing."""
    resource_version: str
    taint_keys: tuple[str, ...]
    conditions: dict[str, tuple[str, str]]
    """Condition type -> (status, reason)."""


def _seen(arrived: float, node: dict[str, Any]) -> Seen:
    taints = (node.get("spec") or {}).get("taints") or []
    conditions = (node.get("status") or {}).get("conditions") or []
    return Seen(
        arrived,
        node["metadata"]["resourceVersion"],
        tuple(t["key"] for t in taints),
        {c["type"]: (c.get("status", ""), c.get("reason", "")) for c in conditions},
    )


async def api_client(kubeconfig: Path) -> client.ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


class NodeWatch:
    """The benchmark's own view of one Node: every version the API server sends on a watch, in order."""

    def __init__(self, core: client.CoreV1Api, node: str) -> None:
        self._core = core
        self.node = node
        self.versions: list[Seen] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.rewatches = 0
        """Watches opened again after the server (or the client's timeout) ended one."""

    async def start(self) -> None:
        response = await self._core.read_node_without_preload_content(self.node)
        arrived = time.perf_counter()
        self.versions.append(_seen(arrived, json.loads(await response.read())))
        self._task = asyncio.create_task(self._follow(), name="bench-node-watch")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def latest(self) -> Seen:
        return self.versions[-1]

    async def sync(self, timeout: float = CONVERGE_TIMEOUT_S) -> int:
        """Wait until the watch has delivered the version a GET returns now; the number of versions seen then."""
        response = await self._core.read_node_without_preload_content(self.node)
        now = json.loads(await response.read())["metadata"]["resourceVersion"]
        await self.wait_for(lambda s: s.resource_version == now, timeout, f"resourceVersion {now}")
        return len(self.versions)

    async def _follow(self) -> None:
        while True:
            response = await self._core.list_node_without_preload_content(
                watch=True,
                field_selector=f"metadata.name={self.node}",
                resource_version=self.latest.resource_version,
                timeout_seconds=WATCH_TIMEOUT_S,
                # Past the server's own end of the watch: the client's default (5 minutes) would cut it first.
                _request_timeout=WATCH_TIMEOUT_S + 60,
            )
            try:
                while line := await response.content.readline():
                    arrived = time.perf_counter()
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        raise RuntimeError(f"the benchmark's node watch failed: {event['object']}")
                    if event["type"] in ("ADDED", "MODIFIED"):
                        async with self._changed:
                            self.versions.append(_seen(arrived, event["object"]))
                            self._changed.notify_all()
            except TimeoutError:
                pass  # watched again from the last version seen, so no version is missed
            finally:
                response.release()
            self.rewatches += 1

    def check(self) -> None:
        """Raise if the watch has stopped following the Node (its versions would then be incomplete)."""
        if self._task is None or self._task.done():
            error = None if self._task is None or self._task.cancelled() else self._task.exception()
            raise RuntimeError(f"the benchmark's watch on node {self.node} stopped: {error!r}") from error

    async def wait_for(self, predicate: Callable[[Seen], bool], timeout: float, what: str,
                       after: int = 0) -> Seen:
        """The first version from index `after` on that satisfies `predicate`."""
        def found() -> Seen | None:
            return next((v for v in self.versions[after:] if predicate(v)), None)

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: found() is not None), timeout)
            except TimeoutError:
                self.check()
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} on node {self.node}") from None
        seen = found()
        assert seen is not None
        return seen


@contextlib.asynccontextmanager
async def watching(kubeconfig: Path, node: str) -> AsyncIterator[NodeWatch]:
    api = await api_client(kubeconfig)
    watch = NodeWatch(client.CoreV1Api(api), node)
    try:
        await watch.start()
        yield watch
    finally:
        await watch.stop()
        await api.close()


@dataclass
class AgentOnNode:
    agent: Agent
    fake: FakeNvml
    api: NodeApi
    reads: Counter[str]
    """The agent's Node reads by kind: "get" (a list or relist) and "watch" (a watch opened)."""

    def api_errors(self) -> float:
        return self.agent.metrics.registry.get_sample_value("gpu_agent_api_errors_total") or 0.0


@contextlib.asynccontextmanager
async def agent_on_node(
    kubeconfig: Path, node: str, preset: str, agent_config: AgentConfig = DEFAULT_CONFIG
) -> AsyncIterator[AgentOnNode]:
    """An in-process agent on the fake NVML with its stand-in kubelet, connected to the API server as `node`;
    yields once it has registered and converged the Node."""
    api = await NodeApi.connect(kubeconfig, node)
    reads = _count_reads(api)
    async with running_agent(preset, agent_config, kube=api, timeout=CONVERGE_TIMEOUT_S) as rig:
        yield AgentOnNode(rig.agent, rig.fake, api, reads)


def _count_reads(api: NodeApi) -> Counter[str]:
    """Count the agent's Node reads by wrapping its client's get and watch (the reconciler calls them through
    the instance)."""
    reads: Counter[str] = Counter()
    get, watch = api.get, api.watch

    async def counted_get() -> NodeView:
        reads["get"] += 1
        return await get()

    def counted_watch(resource_version: str) -> AsyncIterator[NodeView]:
        reads["watch"] += 1
        return watch(resource_version)

    api.get = counted_get  # type: ignore[method-assign]
    api.watch = counted_watch  # type: ignore[method-assign]
    return reads


def untainted(seen: Seen) -> bool:
    return TAINT_KEY not in seen.taint_keys


def tainted(seen: Seen) -> bool:
    return TAINT_KEY in seen.taint_keys


async def xid_to_taint(kubeconfig: Path, node: str, preset: str, injections: int, rng: random.Random) -> dict[str, Any]:
    """Time from `inject_xid(gpu, 79)` to the arrival, on the benchmark's watch, of the Node version carrying the
    agent's taint.

    A node-fatal fault holds the taint until the GPU recovers (clean samples for seconds), so each injection
    gets a fresh agent, which first clears the taint the last one left. Each injection goes to a random GPU
    after a random 0..EVENT_WAIT_MS pause, so it lands at every phase of the health monitor's event wait.
    """
    samples: list[float] = []
    async with watching(kubeconfig, node) as nodes:
        for _ in range(injections):
            async with agent_on_node(kubeconfig, node, preset) as on:
                after = await nodes.sync()
                if not untainted(nodes.latest):
                    raise RuntimeError(f"node {node} is still tainted after a fresh agent converged")
                gpu = rng.randrange(len(on.fake.spec.gpus))
                await asyncio.sleep(rng.uniform(0, EVENT_WAIT_MS / 1000))
                start = time.perf_counter()
                on.fake.inject_xid(gpu, XID)
                seen = await nodes.wait_for(tainted, TAINT_TIMEOUT_S, f"the taint after XID {XID}", after)
                samples.append((seen.arrived - start) * 1000)
    return {"preset": preset, "xid": XID, "taint": TAINT_KEY, "agents": injections, **latency(samples),
            "samples_ms": [round(s, 3) for s in samples]}


async def steady_state(kubeconfig: Path, node: str, preset: str, window_s: float) -> dict[str, Any]:
    """After a fresh agent converged its Node: the agent's API writes (NodeApi.writes) and the Node versions the
    benchmark's watch received over `window_s` seconds."""
    async with watching(kubeconfig, node) as nodes, agent_on_node(kubeconfig, node, preset) as on:
        writes_before, versions_before = on.api.writes, await nodes.sync()
        version_before = nodes.latest.resource_version
        reads_before, errors_before = dict(on.reads), on.api_errors()
        start = time.monotonic()
        await asyncio.sleep(window_s)
        wall = time.monotonic() - start
        nodes.check()
        writes = on.api.writes - writes_before
        updates = len(nodes.versions) - versions_before
        reads = {kind: on.reads[kind] - reads_before.get(kind, 0) for kind in ("get", "watch")}
        errors = on.api_errors() - errors_before
        api = await api_client(kubeconfig)
        try:
            current = await client.CoreV1Api(api).read_node(node)
        finally:
            await api.close()
        writes_to_converge = writes_before
    return {
        "preset": preset,
        "window_s": round(wall, 1),
        "agent_writes": writes,
        "agent_writes_to_converge": writes_to_converge,
        "node_updates_seen": updates,
        "agent_node_reads": reads,
        "agent_api_errors": int(errors),
        "bench_rewatches": nodes.rewatches,
        "resource_version_before": version_before,
        "resource_version_after": current.metadata.resource_version,
    }


async def reset_condition(kubeconfig: Path, node: str) -> None:
    """Mark the agent's condition Unknown from outside, so that an agent's first convergence is visible: it
    writes the condition back."""
    api = await api_client(kubeconfig)
    try:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await client.CoreV1Api(api).patch_node_status(node, {"status": {"conditions": [{
            "type": CONDITION_TYPE, "status": "Unknown", "reason": "BenchmarkReset", "message": "",
            "lastTransitionTime": now, "lastHeartbeatTime": now,
        }]}})
    finally:
        await api.close()


async def wait_condition_written(kubeconfig: Path, node: str, timeout: float = CONVERGE_TIMEOUT_S) -> None:
    """Returns once the Node's agent condition is no longer the one `reset_condition` wrote."""
    async with watching(kubeconfig, node) as nodes:
        await nodes.wait_for(lambda s: s.conditions.get(CONDITION_TYPE, ("", ""))[1] not in ("", "BenchmarkReset"),
                             timeout, f"the agent to write its {CONDITION_TYPE} condition")
