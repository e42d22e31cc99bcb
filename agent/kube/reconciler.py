"""Makes the Node's agent-owned labels match the newest NodeState, writing only what differs."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping

from agent.kube.node import NodeApi, NodeView, describe_error, is_expired
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0

DesiredLabels = Callable[[NodeState], dict[str, str]]


def label_diff(
    current: Mapping[str, str], desired: Mapping[str, str], owned: Callable[[str], bool]
) -> dict[str, str | None]:
    """The merge patch that makes the owned labels equal `desired`: changed or new keys, and None for owned
    keys that are no longer desired. Keys the agent does not own never appear."""
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    patch.update({k: None for k in current if owned(k) and k not in desired})
    return patch


class NodeReconciler:
    """Consumer of NodeState: follows the state bus and the Node watch, converging after either changes.

    While the API server is unreachable it retries with backoff and jitter; the device plugin is unaffected.
    """

    def __init__(self, api: NodeApi, bus: StateBus, desired: DesiredLabels, owned: Callable[[str], bool]) -> None:
        self._api = api
        self._bus = bus
        self._desired = desired
        self._owned = owned
        self._node: NodeView | None = None
        self._lock = asyncio.Lock()
        self.converged = asyncio.Event()

    async def converge(self) -> None:
        async with self._lock:
            if self._node is None:
                return
            patch = label_diff(self._node.labels, self._desired(self._bus.current), self._owned)
            if patch:
                log.info("patching node labels: %s", patch)
                self._node = await self._api.patch_metadata(patch, {})
            self.converged.set()

    async def _follow_state(self) -> None:
        version = self._bus.current.version
        while True:
            state = await self._bus.wait_newer(version)
            version = state.version
            self.converged.clear()
            await self._retrying(self.converge)

    async def _follow_node(self) -> None:
        while True:
            self._node = await self._api.get()
            await self.converge()
            try:
                async for view in self._api.watch(self._node.resource_version):
                    self._node = view
                    await self.converge()
            except Exception as err:
                if not is_expired(err):
                    raise
                log.info("node watch expired; listing again")

    async def _retrying(self, step: Callable[[], object]) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                delay = backoff * random.uniform(0.5, 1.5)
                log.warning("node update failed (%s); retrying in %.1fs", describe_error(err), delay)
                await asyncio.sleep(delay)
                backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def run(self) -> None:
        async def node_loop() -> None:
            await self._retrying(self._follow_node_forever)

        await asyncio.gather(node_loop(), self._follow_state())

    async def _follow_node_forever(self) -> None:
        while True:
            await self._follow_node()
