"""Keeps the node's ResourceSlice equal to the newest NodeState: a consumer of the StateBus, like the node
reconciler. Writes only when the devices change, each time with the pool generation one higher; checks the
slice again every RECHECK_S and whenever `republish()` is called (the kubelet deletes a driver's slices when the
driver registers), and removes any other slice of this driver and node.

Unhealthy devices are written with a device taint; the API server drops that field silently where the
DRADeviceTaints feature gate is off, so the first write with a taint is a dry run whose answer (what the API
server would store) is checked, and so is each write's answer: where the taints are gone, the publisher says
so once and withdraws unhealthy devices from then on.

With dra.sharedCapacity, an MPS-shared GPU is one device with consumable capacity (allowMultipleAllocations and
request policies), fields the API server drops as silently where DRAConsumableCapacity is off: the first time
there is such a device, a dry run shows whether they are kept; where they are not, the publisher says so once
and publishes the GPU's MPS replicas instead, for the rest of its run."""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import quote

from agent.dra.slices import PcieRootLookup, pool_slices, slice_name, slice_spec, taint_key
from agent.kube.client import ApiClient
from agent.kube.node import NodeApi
from agent.kube.usage import ApiError, Backoff
from agent.kube.view import describe_error
from agent.nvml.sysfs import sysfs_pcie_root
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
RECHECK_S = 1800.0
"""How often the slice is read back to see nobody changed or deleted it (times 1 to 1.5, so that a fleet's
checks do not line up): one LIST twice an hour or less."""
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
UNDECIDED, TAINTS, WITHDRAWAL = "undecided", "taints", "withdrawal"
CAPACITY, REPLICAS = "capacity", "replicas"
"""How an MPS-shared GPU is published with dra.sharedCapacity: one device shared by capacity, or its replicas."""


class SliceClient(Protocol):
    async def get(self, name: str) -> dict[str, Any] | None: ...
    async def create(self, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]: ...
    async def replace(self, name: str, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]: ...
    async def delete(self, name: str) -> None: ...
    async def list(self, node: str, driver: str) -> list[dict[str, Any]]: ...


class SliceApi:
    """ResourceSlices (and the ResourceClaims the kubelet plugin reads) through the agent's one API client."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.writes = 0

    @classmethod
    def sharing(cls, node_api: NodeApi) -> SliceApi:
        """The agent's Node client's API client: the same server, credentials, rate limit and counts."""
        return cls(node_api.api)

    async def close(self) -> None:
        await self.api.close()

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        return await self.api.request(method, path, body)

    async def get(self, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self._request("GET", f"{SLICES}/{quote(name, safe='')}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return found

    async def create(self, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Create the slice; with `dry_run`, only what the API server would store (nothing is written)."""
        self.writes += not dry_run
        created: dict[str, Any] = await self._request("POST", SLICES + ("?dryRun=All" if dry_run else ""), body)
        return created

    async def replace(self, name: str, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        self.writes += not dry_run
        path = f"{SLICES}/{quote(name, safe='')}" + ("?dryRun=All" if dry_run else "")
        replaced: dict[str, Any] = await self._request("PUT", path, body)
        return replaced

    async def delete(self, name: str) -> None:
        self.writes += 1
        try:
            await self._request("DELETE", f"{SLICES}/{quote(name, safe='')}")
        except ApiError as err:
            if err.status != 404:
                raise

    async def node_uid(self, node: str) -> str:
        """The UID of Node `node` (the slices' owner)."""
        found: dict[str, Any] = await self._request("GET", f"/api/v1/nodes/{quote(node, safe='')}")
        return str((found.get("metadata") or {}).get("uid") or "")

    async def version(self) -> dict[str, Any]:
        """The API server's version (GET /version: gitVersion, major, minor)."""
        found: dict[str, Any] = await self._request("GET", "/version")
        return found

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
                 pcie_root: PcieRootLookup = sysfs_pcie_root, on_error: Callable[[], None] = lambda: None,
                 on_health_mode: Callable[[str], None] = lambda mode: None) -> None:
        self._api = api
        self._bus = bus
        self.node = node
        self.driver = driver
        self.name = slice_name(node, driver)
        self._pcie_root = pcie_root
        self._on_error = on_error
        self._on_health_mode = on_health_mode
        """Called with TAINTS or WITHDRAWAL whenever the health mode is decided or changes (for a metric)."""
        self._wake = asyncio.Event()
        self.generation = 0
        """The pool generation last written (0 before the first write)."""
        self._written: tuple[object, object] | None = None
        """The resourceVersion of this agent's last write and the devices it wrote."""
        self._stored: dict[str, Any] | None = None
        """The slice as the API server stored this agent's last write (its metadata makes the next write
        conditional on nothing having changed it since)."""
        self.verify = True
        """The next sync reads what the API server has (set for the first, after a republish or a failure, and
        every RECHECK_S)."""
        self.published = asyncio.Event()
        """Set once the slice matches the current state."""
        self.health_mode = UNDECIDED
        """How unhealthy devices are published: UNDECIDED until one was, then TAINTS where the API server
        kept their device taints, WITHDRAWAL (for the rest of the agent's run) where it dropped them."""
        self.capacity_mode = UNDECIDED
        """With dra.sharedCapacity: UNDECIDED until an MPS-shared GPU was published, then CAPACITY where the API
        server kept consumable capacity, REPLICAS (for the rest of the agent's run) where it dropped it."""
        self._owner: list[dict[str, Any]] | None = None
        """The slices' ownerReferences: the Node (read once; [] where the client cannot read it), so that the
        Node's deletion deletes them."""
        self._slices_written: tuple[object, object] | None = None
        """With several slices: their names and resourceVersions after this agent's last write, and the specs
        it wrote."""

    async def close(self) -> None:
        close = getattr(self._api, "close", None)
        if close is not None:
            await close()

    async def withdraw(self) -> None:
        """Delete the node's slices of this driver (device-plugin mode after a switch from DRA mode: the DRA
        kubelet plugin stays to unprepare the claims still prepared, and offers nothing); the next sync
        publishes them again from nothing."""
        self.published.clear()
        for found in await self._api.list(self.node, self.driver):
            if name := (found.get("metadata") or {}).get("name"):
                await self._api.delete(name)
                log.info("deleted ResourceSlice %s: the node left DRA mode", name)
        self._written = self._stored = self._slices_written = None
        self.verify = True

    def republish(self) -> None:
        """Check the slice now (call after the kubelet plugin registers: the kubelet deletes the driver's
        slices then)."""
        self._wake.set()

    async def sync(self, state: NodeState) -> bool:
        """Make the slice match `state`; returns whether anything was written. Only a check (`verify`: the first
        sync, a republish, a recheck) reads what the API server has; otherwise the slice is what this agent last
        wrote, and a state whose devices are the same costs no request."""
        await self._decide_capacity(state)
        wanted = pool_slices(state, self.node, self.driver, 0, self._pcie_root,
                             taints=self.health_mode != WITHDRAWAL, capacity=self.capacity_mode == CAPACITY)
        if len(wanted) > 1:  # more devices than one slice takes
            self._written = self._stored = None
            return await self._write_pool(state)
        if self._slices_written is not None:  # back to one slice: the others go
            self._slices_written = None
            self.verify = True
        wrote = False
        listed: dict[str, Any] | None = None
        if self.verify:
            listed = {}  # not there, unless the list holds it
            for other in await self._api.list(self.node, self.driver):
                other_name = (other.get("metadata") or {}).get("name")
                if other_name == self.name:
                    listed = other  # this agent's own slice, as stored: no GET of it needed
                elif other_name:
                    log.info("deleting stale ResourceSlice %s of driver %s", other_name, self.driver)
                    await self._api.delete(other_name)
                    wrote = True
            self._owner_from(listed)
        await self._read_owner()
        written = await self._write(state, listed)
        return written or wrote

    async def _write(self, state: NodeState, listed: dict[str, Any] | None = None) -> bool:
        """`listed`: the slice as a LIST just read it ({} where it was not there), None where not listed."""
        read = self.verify or self._stored is None
        while True:
            wanted = slice_spec(state, self.node, self.driver, 0, self._pcie_root,
                                taints=self.health_mode != WITHDRAWAL, capacity=self.capacity_mode == CAPACITY)
            devices = copy.deepcopy(wanted["devices"])
            tainted = {d["name"] for d in devices if d.get("taints")}
            if not read and self._written is not None and self._written[1] == devices:
                return False  # what this agent last wrote, and nothing says it changed since
            if read and listed is not None:
                have, listed = listed or None, None  # a second pass reads it again
            else:
                have = await self._api.get(self.name) if read else self._stored
            body = self._body(self.name, wanted, have)
            if have is not None:
                meta = have.get("metadata") or {}
                if self._written == (meta.get("resourceVersion"), devices):
                    return False  # unchanged since this agent wrote it
                stored_spec = have.get("spec") or {}
                stored = int((stored_spec.get("pool") or {}).get("generation") or 0)
                _keep_taint_times(wanted["devices"], stored_spec.get("devices") or [])
                if (_same_but_generation(wanted, stored_spec) and self._owned(have)
                        and (not tainted or self._keeps_taints(tainted, have))):
                    # What the API server has is what this agent wants (a restarted agent finds the slice it
                    # wrote before): taken as written, with no write.
                    self.generation = stored
                    self._stored = have
                    self._written = (meta.get("resourceVersion"), devices)
                    return False
                generation = max(self.generation, stored) + 1
            else:
                generation = self.generation + 1
            wanted["pool"]["generation"] = generation
            # The first taint goes in a dry run: the API server answers what it would store, so no write
            # publishes an unhealthy device without its taint.
            if tainted and self.health_mode == UNDECIDED and not self._keeps_taints(
                    tainted, await self._send(have is not None, body, dry_run=True)):
                continue
            try:
                written = await self._send(have is not None, body)
            except ApiError as err:
                if err.status not in (404, 409) or read:
                    raise
                read = True  # changed or deleted since this agent wrote it: read it, then write again
                continue
            self.generation = generation
            self._stored = written
            self._written = ((written.get("metadata") or {}).get("resourceVersion"), devices)
            log.info("published ResourceSlice %s: %d device(s), pool generation %d", self.name,
                     len(wanted["devices"]), self.generation)
            if tainted and not self._keeps_taints(tainted, written):
                continue  # the API server stopped keeping them (restarted with the gate off)
            return True

    def _owner_from(self, listed: dict[str, Any]) -> None:
        """The owner from this agent's own slice as a LIST found it: the Node it names there (a restarted agent
        then needs no GET of its Node). No slice: read the Node again at the next write (it may be a new Node
        of the same name)."""
        if not listed:
            self._owner = None
            return
        if self._owner is None:
            refs = (listed.get("metadata") or {}).get("ownerReferences") or []
            uids = [r.get("uid") for r in refs if r.get("kind") == "Node" and r.get("name") == self.node]
            if len(uids) == 1 and uids[0]:
                self._owner = [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": str(uids[0]),
                                "controller": True}]

    async def _owner_of(self, existing: dict[str, dict[str, Any]]) -> None:
        """The owner of the slices `existing` (a LIST's, by name) where they name this agent's Node (a restarted
        agent), else read from the Node."""
        if self._owner is None and existing:
            self._owner_from(existing[min(existing)])
        await self._read_owner()

    async def _read_owner(self) -> None:
        if self._owner is None:
            uid_of = getattr(self._api, "node_uid", None)
            uid = await uid_of(self.node) if uid_of is not None else ""
            self._owner = [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
                            "controller": True}] if uid else []

    def _owned(self, stored: dict[str, Any]) -> bool:
        """Whether a stored slice has the owner this agent gives its slices."""
        return not self._owner or (stored.get("metadata") or {}).get("ownerReferences") == self._owner

    def _body(self, name: str, spec: dict[str, Any], stored: dict[str, Any] | None) -> dict[str, Any]:
        """A ResourceSlice to write: with the stored slice's metadata (its resourceVersion makes the write
        conditional) where there is one, owned by the Node."""
        meta = dict(stored.get("metadata") or {}) if stored is not None else {"name": name}
        if self._owner:
            meta["ownerReferences"] = self._owner
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta, "spec": spec}

    async def _send(self, exists: bool, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        if exists:
            return await self._api.replace(body["metadata"]["name"], body, dry_run=dry_run)
        return await self._api.create(body, dry_run=dry_run)

    async def _write_pool(self, state: NodeState) -> bool:
        """The node's devices in several slices (more than one takes): as _write_slices, after a dry run of the
        first slice with a tainted device while the health mode is undecided."""
        while True:
            wanted = pool_slices(state, self.node, self.driver, 0, self._pcie_root,
                                 taints=self.health_mode != WITHDRAWAL, capacity=self.capacity_mode == CAPACITY)
            existing = await self._listed()
            await self._owner_of(existing)
            tainted = [(n, s) for n, s in wanted if any(d.get("taints") for d in s["devices"])]
            if tainted and self.health_mode == UNDECIDED:
                name, spec = tainted[0]
                body = self._body(name, {**copy.deepcopy(spec), "pool": {**spec["pool"], "generation": 1}},
                                  existing.get(name))
                stored = await self._send(name in existing, body, dry_run=True)
                if not self._keeps_taints({d["name"] for d in spec["devices"] if d.get("taints")}, stored):
                    continue
            return await self._write_slices(wanted, existing)

    async def _decide_capacity(self, state: NodeState) -> None:
        """With dra.sharedCapacity, the first time an MPS-shared GPU is published: a dry run of the slice that
        holds it shows whether the API server keeps consumable capacity (DRAConsumableCapacity); one log line
        either way."""
        if self.capacity_mode != UNDECIDED or not state.config.dra.shared_capacity.enabled:
            return
        wanted = pool_slices(state, self.node, self.driver, 0, self._pcie_root, capacity=True)
        probe = next(((n, s, d["name"]) for n, s in wanted for d in s["devices"] if d.get("allowMultipleAllocations")),
                     None)
        if probe is None:
            return  # no MPS daemon up yet: nothing to decide
        name, spec, device = probe
        existing = await self._listed()
        await self._owner_of(existing)
        body = self._body(name, {**copy.deepcopy(spec), "pool": {**spec["pool"], "generation": 1}},
                          existing.get(name))
        stored = await self._send(name in existing, body, dry_run=True)
        devices = (stored.get("spec") or {}).get("devices") or []
        kept: dict[str, Any] = next((d for d in devices if d.get("name") == device), {})
        if kept.get("allowMultipleAllocations") and ((kept.get("capacity") or {}).get("memory") or {}).get(
                "requestPolicy"):
            log.info("the API server keeps consumable capacity (DRAConsumableCapacity): each GPU that MPS shares is "
                     "one device that claims share by memory and compute")
            self.capacity_mode = CAPACITY
        else:
            log.warning("the API server drops the consumable capacity of %s (the DRAConsumableCapacity feature gate "
                        "is off): dra.sharedCapacity is off until the agent restarts; GPUs that MPS shares are "
                        "published as their replicas", device)
            self.capacity_mode = REPLICAS

    async def _listed(self) -> dict[str, dict[str, Any]]:
        """The driver's slices of this node as the API server has them, by name."""
        return {name: s for s in await self._api.list(self.node, self.driver)
                if (name := (s.get("metadata") or {}).get("name"))}

    async def _write_slices(self, wanted: list[tuple[str, dict[str, Any]]], existing: dict[str, dict[str, Any]]
                            ) -> bool:
        """Make the pool's slices `wanted` (name, spec; the generation is set here) of the slices `existing`:
        nothing when they are what this agent last wrote, or (a restarted agent) what it wants but for the
        generation; else every slice written with the next generation, and the others deleted."""
        for name, spec in wanted:
            if name in existing:
                _keep_taint_times(spec.get("devices") or [], (existing[name].get("spec") or {}).get("devices") or [])
        specs = [(n, copy.deepcopy(s)) for n, s in wanted]
        versions = tuple(sorted((n, (s.get("metadata") or {}).get("resourceVersion")) for n, s in existing.items()))
        if self._slices_written == (versions, specs):
            return False
        generations = {int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0)
                       for s in existing.values()}
        stored_generation = max(generations, default=0)
        if (set(existing) == {n for n, _ in wanted} and len(generations) == 1
                and all(_same_but_generation(spec, existing[n].get("spec") or {}) and self._owned(existing[n])
                        for n, spec in wanted)):
            self.generation = stored_generation
            self._slices_written = (versions, specs)
            return False
        generation = max(self.generation, stored_generation) + 1
        written_versions = []
        for name, spec in wanted:
            spec["pool"]["generation"] = generation
            written = await self._send(name in existing, self._body(name, spec, existing.get(name)))
            written_versions.append((name, (written.get("metadata") or {}).get("resourceVersion")))
        for stale in sorted(set(existing) - {n for n, _ in wanted}):
            log.info("deleting stale ResourceSlice %s of driver %s", stale, self.driver)
            await self._api.delete(stale)
        self.generation = generation
        self._slices_written = (tuple(sorted(written_versions)), specs)
        log.info("published %d ResourceSlice(s) of pool %s: %d device(s), pool generation %d", len(wanted),
                 self.node, sum(len(s.get("devices") or []) for _, s in wanted), generation)
        return True

    def _keeps_taints(self, tainted: set[str], stored_slice: dict[str, Any]) -> bool:
        """Whether the API server stored the taints of the devices `tainted`; decides the health mode."""
        stored = {d.get("name") for d in (stored_slice.get("spec") or {}).get("devices") or [] if d.get("taints")}
        if tainted <= stored:
            if self.health_mode != TAINTS:
                log.info("the API server keeps device taints (DRADeviceTaints): unhealthy devices stay in "
                         "ResourceSlice %s with the taint %s", self.name, taint_key(self.driver))
                self.health_mode = TAINTS
                self._on_health_mode(TAINTS)
            return True
        self.health_mode = WITHDRAWAL
        self._on_health_mode(WITHDRAWAL)
        log.warning("the API server drops the device taints of %s (the DRADeviceTaints feature gate is off): "
                    "unhealthy devices are withdrawn from ResourceSlice %s instead",
                    ", ".join(sorted(tainted - stored)), self.name)
        return False

    async def run(self) -> None:
        """Keep the slice published: at each new state, at each republish, and every RECHECK_S (jittered) to
        see it was not changed or deleted behind the agent's back. A failure waits out a jittered backoff before
        the next try, whatever comes in meanwhile, and is said once per episode with the API server's reason."""
        backoff = Backoff(first_min=BACKOFF_MIN_S, first_max=2 * BACKOFF_MIN_S, cap=BACKOFF_MAX_S)
        while True:
            state = self._bus.current
            if state.handover:  # which GPUs pods hold is not known yet (agent/handover.py): nothing to publish
                self.published.clear()
                await self._bus.wait_newer(state.version)
                continue
            try:
                await self.sync(state)
                self.verify = False
                self.published.set()
                if backoff.failures:
                    log.info("ResourceSlice %s published after %d failed attempt(s)", self.name, backoff.failures)
                backoff.succeeded()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.published.clear()
                self.verify = True
                self._on_error()
                delay = backoff.next_delay(err)
                if backoff.failures == 1:
                    log.warning("ResourceSlice %s update failed (%s); retrying in %.1fs, backing off while it "
                                "fails", self.name, describe_error(err), delay)
                await asyncio.sleep(delay)
                continue
            newer = asyncio.ensure_future(self._bus.wait_newer(state.version))
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                done, _ = await asyncio.wait({newer, woken}, timeout=RECHECK_S * random.uniform(1.0, 1.5),
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                newer.cancel()
                woken.cancel()
            if self._wake.is_set() or not done:
                self._wake.clear()
                self.verify = True  # a republish, or the time for a check
            if self._bus.current.version != state.version:
                self.published.clear()


def _same_but_generation(wanted: dict[str, Any], stored: dict[str, Any]) -> bool:
    """Whether two slice specs say the same but for the pool generation."""
    def masked(spec: dict[str, Any]) -> dict[str, Any]:
        return {**spec, "pool": {**(spec.get("pool") or {}), "generation": None}}
    return masked(wanted) == masked(stored)


def _keep_taint_times(devices: list[dict[str, Any]], stored: list[dict[str, Any]]) -> None:
    """Give each taint the time the API server added it, where the stored device has the same taint, so that
    rewriting the slice does not make an old taint look new."""
    added = {(d.get("name"), t.get("key"), t.get("value", ""), t.get("effect")): t["timeAdded"]
             for d in stored for t in d.get("taints") or [] if t.get("timeAdded")}
    for device in devices:
        for taint in device.get("taints") or []:
            when = added.get((device["name"], taint["key"], taint.get("value", ""), taint["effect"]))
            if when is not None:
                taint["timeAdded"] = when


PublisherClass = Callable[..., SlicePublisher]
"""SlicePublisher or a subclass, or a partial of one: called with (api, bus, node, driver, on_error=...,
on_health_mode=...)."""


def slice_api(kube: object) -> tuple[SliceApi, str] | None:
    """ResourceSlices and ResourceClaims through the agent's one API client, the one its Node client was given
    (the same server, credentials, rate limit, retries and counts), and the node's name; None (said in the log)
    when the agent has no API server client. The composition root hands the one SliceApi to the slice
    publisher and to the kubelet plugin, which reads the claims it prepares through it."""
    if not isinstance(kube, NodeApi):
        log.warning("DRA mode: no API server client; no ResourceSlice is published")
        return None
    return SliceApi.sharing(kube), kube.node_name
