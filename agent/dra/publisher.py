"""Keeps the node's ResourceSlice equal to the newest NodeState: a consumer of the StateBus, like the node
reconciler. Writes only when the devices change, each time with the pool generation one higher; checks the
slice again every RECHECK_S and whenever `republish()` is called (the kubelet deletes a driver's slices when the
driver registers), and removes any other slice of this driver and node."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from agent.dra.pci import sysfs_pcie_root
from agent.dra.slices import PcieRootLookup, slice_name, slice_spec
from agent.kube.node import REQUEST_TIMEOUT_S, ApiError, Credentials, NodeApi
from agent.kube.view import describe_error
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
RECHECK_S = 30.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0


class SliceClient(Protocol):
    async def get(self, name: str) -> dict[str, Any] | None: ...
    async def create(self, body: dict[str, Any]) -> dict[str, Any]: ...
    async def replace(self, name: str, body: dict[str, Any]) -> dict[str, Any]: ...
    async def delete(self, name: str) -> None: ...
    async def list(self, node: str, driver: str) -> list[dict[str, Any]]: ...


class SliceApi:
    """ResourceSlices through the API server with the agent's own credentials (aiohttp, as agent/kube/node.py)."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials
        self._session: aiohttp.ClientSession | None = None
        self.writes = 0

    @classmethod
    def sharing(cls, node_api: NodeApi) -> SliceApi:
        """The same server and credentials as the agent's Node client."""
        return cls(node_api._credentials)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._credentials.ssl, limit=2))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Accept": "application/json", **self._credentials.headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body)
        async with self._http().request(method, self._credentials.server + path, data=data, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as response:
            payload = await response.read()
            if response.status >= 400:
                try:
                    detail = json.loads(payload)
                    raise ApiError(response.status, str(detail.get("reason", "")), str(detail.get("message", "")))
                except ValueError:
                    raise ApiError(response.status, "", payload.decode(errors="replace")[:200]) from None
            return json.loads(payload) if payload else None

    async def get(self, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self._request("GET", f"{SLICES}/{quote(name, safe='')}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return found

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        created: dict[str, Any] = await self._request("POST", SLICES, body)
        return created

    async def replace(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        replaced: dict[str, Any] = await self._request("PUT", f"{SLICES}/{quote(name, safe='')}", body)
        return replaced

    async def delete(self, name: str) -> None:
        self.writes += 1
        try:
            await self._request("DELETE", f"{SLICES}/{quote(name, safe='')}")
        except ApiError as err:
            if err.status != 404:
                raise

    async def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A ResourceClaim, for the kubelet plugin; None when there is none of that name."""
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"
        try:
            found: dict[str, Any] = await self._request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return found

    async def list(self, node: str, driver: str) -> list[dict[str, Any]]:
        selector = quote(f"spec.nodeName={node},spec.driver={driver}", safe="")
        listed = await self._request("GET", f"{SLICES}?fieldSelector={selector}")
        return list(listed.get("items") or [])


class SlicePublisher:
    """Publishes the node's pool as one ResourceSlice and keeps it so."""

    def __init__(self, api: SliceClient, bus: StateBus, node: str, driver: str,
                 pcie_root: PcieRootLookup = sysfs_pcie_root, on_error: Callable[[], None] = lambda: None) -> None:
        self._api = api
        self._bus = bus
        self.node = node
        self.driver = driver
        self.name = slice_name(node, driver)
        self._pcie_root = pcie_root
        self._on_error = on_error
        self._wake = asyncio.Event()
        self.generation = 0
        """The pool generation last written (0 before the first write)."""
        self._written: tuple[object, object] | None = None
        """The resourceVersion of this agent's last write and the devices it wrote."""
        self.published = asyncio.Event()
        """Set once the slice matches the current state."""

    async def close(self) -> None:
        close = getattr(self._api, "close", None)
        if close is not None:
            await close()

    def republish(self) -> None:
        """Check the slice now (call after the kubelet plugin registers: the kubelet deletes the driver's
        slices then)."""
        self._wake.set()

    async def sync(self, state: NodeState) -> bool:
        """Make the slice match `state`; returns whether anything was written."""
        wanted = slice_spec(state, self.node, self.driver, 0, self._pcie_root)
        wrote = False
        for other in await self._api.list(self.node, self.driver):
            other_name = (other.get("metadata") or {}).get("name")
            if other_name and other_name != self.name:
                log.info("deleting stale ResourceSlice %s of driver %s", other_name, self.driver)
                await self._api.delete(other_name)
                wrote = True
        have = await self._api.get(self.name)
        if have is not None:
            meta = have.get("metadata") or {}
            if self._written == (meta.get("resourceVersion"), wanted["devices"]):
                return wrote  # unchanged since this agent wrote it
            generation = int(((have.get("spec") or {}).get("pool") or {}).get("generation") or 0)
            self.generation = max(self.generation, generation) + 1
            wanted["pool"]["generation"] = self.generation
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta, "spec": wanted}
            written = await self._api.replace(self.name, body)
        else:
            self.generation += 1
            wanted["pool"]["generation"] = self.generation
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"name": self.name}, "spec": wanted}
            written = await self._api.create(body)
        self._written = ((written.get("metadata") or {}).get("resourceVersion"), wanted["devices"])
        log.info("published ResourceSlice %s: %d device(s), pool generation %d", self.name,
                 len(wanted["devices"]), self.generation)
        return True

    async def run(self) -> None:
        backoff = BACKOFF_MIN_S
        version = -1
        while True:
            state = self._bus.current
            try:
                await self.sync(state)
                version = state.version
                self.published.set()
                backoff = BACKOFF_MIN_S
                timeout: float = RECHECK_S
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.published.clear()
                self._on_error()
                log.warning("ResourceSlice update failed (%s); retrying in %.1fs", describe_error(err), backoff)
                timeout, backoff = backoff, min(BACKOFF_MAX_S, backoff * 2)
            newer = asyncio.ensure_future(self._bus.wait_newer(version))
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({newer, woken}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                newer.cancel()
                woken.cancel()
            if self._wake.is_set():
                self._wake.clear()
            if self._bus.current.version != version:
                self.published.clear()


def publisher_for(kube: object, bus: StateBus, driver: str, on_error: Callable[[], None]) -> SlicePublisher | None:
    """The publisher for the agent's own Node client, sharing its server and credentials; None (said in the
    log) when the agent has no API server client to share."""
    if not isinstance(kube, NodeApi):
        log.warning("DRA mode: no API server client; no ResourceSlice is published")
        return None
    return SlicePublisher(SliceApi.sharing(kube), bus, kube.node_name, driver, on_error=on_error)


def claim_reader(publisher: SlicePublisher) -> SliceApi:
    """The publisher's API client, which also reads ResourceClaims for the kubelet plugin."""
    assert isinstance(publisher._api, SliceApi)
    return publisher._api
