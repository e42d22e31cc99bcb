"""DRA mode against a real kube-apiserver: XID to the GPU out of the agent's ResourceSlice.

The agent runs in this process on the fake NVML in DRA mode, with `NodeApi` connected to the rig as the
DaemonSet's agent connects to its cluster. The benchmark sees the slice through its own watch (raw JSON lines,
stamped on arrival), never through the agent. An unhealthy GPU leaves the slice, or stays in it with a NoSchedule
taint where the API server keeps device taints (on by default from Kubernetes 1.36; docs/dra.md): either way it
is out of what the scheduler allocates, and that moment is measured. Nothing here decides pass or fail;
`bench/run.py` holds the budgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from kubernetes.aio import client

from agent.config import parse_config
from agent.dra.slices import slice_name
from agent.health.monitor import EVENT_WAIT_MS
from agent.kube.node import NodeApi
from bench.grpc_bench import latency
from bench.kube_bench import CONVERGE_TIMEOUT_S, WATCH_TIMEOUT_S, api_client
from tests.plugin_harness import running_agent, short_dir

XID = 48
"""Double-bit ECC error: the default health policy marks the GPU unhealthy at once (not node-fatal)."""
DRIVER = "gpu.gpu-node-agent.io"
WITHDRAW_TIMEOUT_S = 10.0
RECOVER_TIMEOUT_S = 30.0
GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "resourceslices"


class SliceWatch:
    """Every version of one ResourceSlice the API server sends on a watch: (arrival, the names of the devices
    the scheduler may allocate: those in the slice without a NoSchedule or NoExecute taint)."""

    def __init__(self, custom: client.CustomObjectsApi, name: str) -> None:
        self._custom = custom
        self.name = name
        self.versions: list[tuple[float, tuple[str, ...]]] = []
        self._resource_version = ""
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="bench-slice-watch")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        while True:
            response = await self._custom.list_cluster_custom_object_without_preload_content(
                GROUP, VERSION, PLURAL, watch=True, field_selector=f"metadata.name={self.name}",
                resource_version=self._resource_version or None, timeout_seconds=WATCH_TIMEOUT_S,
                _request_timeout=WATCH_TIMEOUT_S + 60)
            try:
                while line := await response.content.readline():
                    arrived = time.perf_counter()
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        raise RuntimeError(f"the benchmark's slice watch failed: {event['object']}")
                    found = event["object"]
                    self._resource_version = found["metadata"]["resourceVersion"]
                    names = tuple(d["name"] for d in (found.get("spec") or {}).get("devices") or []
                                  if not any(t.get("effect") in ("NoSchedule", "NoExecute")
                                             for t in d.get("taints") or []))
                    async with self._changed:
                        self.versions.append((arrived, () if event["type"] == "DELETED" else names))
                        self._changed.notify_all()
            except TimeoutError:
                pass  # watched again from the last version seen
            finally:
                response.release()

    async def wait_for(self, predicate: Callable[[tuple[str, ...]], bool], timeout: float, what: str,
                       after: int = 0) -> float:
        """The arrival time of the first version from index `after` on whose devices satisfy `predicate`."""
        def found() -> float | None:
            return next((at for at, names in self.versions[after:] if predicate(names)), None)

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: found() is not None), timeout)
            except TimeoutError:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} in ResourceSlice "
                                   f"{self.name}") from None
        at = found()
        assert at is not None
        return at


@contextlib.asynccontextmanager
async def watching(kubeconfig: Path, name: str) -> AsyncIterator[SliceWatch]:
    api = await api_client(kubeconfig)
    watch = SliceWatch(client.CustomObjectsApi(api), name)
    try:
        await watch.start()
        yield watch
    finally:
        await watch.stop()
        await api.close()


async def xid_to_withdrawal(kubeconfig: Path, node: str, preset: str, injections: int,
                            rng: random.Random) -> dict[str, Any]:
    """Time from `inject_xid(gpu, 48)` to the arrival, on the benchmark's watch, of the slice version without
    that GPU among the allocatable devices (withdrawn or tainted). One agent; after each injection the GPU is reset (its ECC count cleared), and the next injection
    waits until the slice has it again. Each goes to a random GPU after a random 0..EVENT_WAIT_MS pause."""
    root = short_dir()
    kubelet_dir = root / "device-plugins"
    kubelet_dir.mkdir(parents=True)
    # Health sampled every 0.1 s so that a reset GPU is healthy again quickly; the XID itself arrives as an
    # NVML event, the same path at any sample interval.
    agent_config = parse_config(
        f"version: v1\ndra: {{enabled: true, cdiRoot: {root}/cdi}}\n"
        f"mig: {{stateDir: {root}/state, podResourcesSocket: {root}/pr.sock}}\n"
        "health: {sampleIntervalSeconds: 0.1}\n")
    samples: list[float] = []
    api = await NodeApi.connect(kubeconfig, node)
    try:
        async with watching(kubeconfig, slice_name(node, DRIVER)) as slices, running_agent(
                preset, agent_config, kube=api, kubelet_first=False, directory=kubelet_dir,
                timeout=CONVERGE_TIMEOUT_S) as rig:
            gpus = [f"gpu-{g.index}" for g in rig.fake.spec.gpus]
            await slices.wait_for(lambda names: list(names) == gpus, CONVERGE_TIMEOUT_S, "every GPU")
            for _ in range(injections):
                gpu = rng.randrange(len(gpus))
                after = len(slices.versions)
                await asyncio.sleep(rng.uniform(0, EVENT_WAIT_MS / 1000))
                start = time.perf_counter()
                rig.fake.inject_xid(gpu, XID)
                name = f"gpu-{gpu}"
                arrived = await slices.wait_for(lambda names, name=name: name not in names, WITHDRAW_TIMEOUT_S,
                                                f"{name} withdrawn after XID {XID}", after)
                samples.append((arrived - start) * 1000)
                rig.fake.reset_gpu(gpu)
                await slices.wait_for(lambda names: list(names) == gpus, RECOVER_TIMEOUT_S,
                                      f"gpu-{gpu} back", len(slices.versions) - 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"preset": preset, "xid": XID, "injections": injections, **latency(samples),
            "samples_ms": [round(s, 3) for s in samples]}
