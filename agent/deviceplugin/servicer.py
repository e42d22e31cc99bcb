"""The DevicePlugin service for one resource: lists, allocates and prefers devices from the newest NodeState.

Its handlers are coroutines of the resource's grpc.aio server (server.py), on the agent's event loop. They only
read the newest NodeState (immutable); ListAndWatch awaits newer ones with StateBus.wait_newer. The preferred-
allocation search, the one handler whose work grows with the node (branch and bound over the GPUs, or thousands of
replicas), runs on the search executor's threads, so a long search never holds up Allocate, the options or a
ListAndWatch update.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import grpc

from agent.deviceplugin.response import NodeFiles, RequestError, ResponseBuilder
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.inventory import Device, Resource, ResourcePlan
from agent.metrics import Metrics
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_ID_LENGTH = 63
MAX_STREAMS = 4
"""ListAndWatch streams one resource serves at once. The kubelet holds one per registration; a stream beyond the
limit is refused with RESOURCE_EXHAUSTED, so a client that opens streams and never reads them cannot make the
agent hold a list for each."""
SEARCH_THREADS = 2
"""Threads for the preferred-allocation search, shared by every resource (agent.py): a long search leaves one for
the next request while the event loop answers everything else."""

PlanOf = Callable[[NodeState], ResourcePlan]
"""The resources of a NodeState (a cached inventory.plan)."""

Prefer = Callable[[tuple[Device, ...], Sequence[str], Sequence[str], int], list[str]]
"""(devices of the resource, available ids, must-include ids, size) -> preferred ids."""

PreferFor = Callable[[Resource], Prefer]
"""The preference policy for a resource (whole GPUs, MIG devices, or replicas)."""


def to_proto(devices: tuple[Device, ...]) -> api_pb2.ListAndWatchResponse:
    return api_pb2.ListAndWatchResponse(
        devices=[
            api_pb2.Device(
                ID=d.id,
                health=HEALTHY if d.healthy else UNHEALTHY,
                topology=None if d.numa is None else api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=d.numa)]),
            )
            for d in devices
        ]
    )


class DeviceIndex:
    """The devices of one resource in one NodeState by ID, built once per device tuple and shared by the calls
    (the tuple is immutable, so the index is too)."""

    def __init__(self, resource: str, devices: tuple[Device, ...]) -> None:
        self.resource = resource
        self.devices = devices
        self.known = {d.id: d for d in devices}
        self.unhealthy = frozenset(d.id for d in devices if not d.healthy)
        self.short = all(len(i) <= MAX_ID_LENGTH for i in self.known)

    def lookup(self, ids: Sequence[str], *, need_healthy: bool) -> list[Device]:
        """The devices named by `ids`, duplicates removed, order kept; RequestError on an unknown or unhealthy ID
        (the first in the request's order)."""
        unique = dict.fromkeys(ids)
        if self.short and not (need_healthy and self.unhealthy and not self.unhealthy.isdisjoint(unique)):
            try:
                return list(map(self.known.__getitem__, unique))
            except KeyError:
                pass
        return self._refuse(ids, need_healthy)

    def _refuse(self, ids: Sequence[str], need_healthy: bool) -> list[Device]:
        found: dict[str, Device] = {}
        for device_id in ids:
            if len(device_id) > MAX_ID_LENGTH:
                raise RequestError(
                    f"device ID {device_id[:20]!r}... is {len(device_id)} characters; IDs have at most {MAX_ID_LENGTH}"
                )
            device = self.known.get(device_id)
            if device is None:
                raise RequestError(f"unknown device ID {device_id!r} for resource {self.resource}")
            if need_healthy and not device.healthy:
                why = f": {device.reason}" if device.reason else ""
                raise RequestError(f"device {device_id} of resource {self.resource} is unhealthy{why}")
            found.setdefault(device_id, device)
        return list(found.values())


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    """Serves one resource from the newest NodeState; a resource the state no longer has lists no devices."""

    def __init__(
        self,
        resource: str,
        bus: StateBus,
        plan_of: PlanOf,
        prefer_for: PreferFor,
        metrics: Metrics | None = None,
        files: NodeFiles | None = None,
        search: Executor | None = None,
    ) -> None:
        self.resource = resource
        self._search = search
        """Where GetPreferredAllocation's search runs (None: the event loop's default executor)."""
        self._files = files or NodeFiles()
        self._metrics = metrics
        self._bus = bus
        self._plan_of = plan_of
        self._prefer_for = prefer_for
        self._generation = _Generation()
        self._streams = 0
        self._index: tuple[Resource, DeviceIndex] | None = None
        """(resource, its index) in one attribute: the loop and the search threads share it and replace it whole."""
        self._builder: tuple[NodeState, ResponseBuilder] | None = None
        """(state, the Allocate response builder for it), likewise."""
        self._counters: dict[str, Any] = {}
        """The metrics' children for this resource, by metric: prometheus_client's labels() is slow per call."""

    @property
    def open_streams(self) -> int:
        """ListAndWatch streams open now (at most MAX_STREAMS); one a client left counts until its handler ends."""
        return self._streams

    def open(self) -> None:
        """Streams opened from now on run until close()."""
        self._generation = _Generation()

    def close(self) -> None:
        """End every open ListAndWatch stream (the server is about to stop)."""
        self._generation.closed.set()

    def _resource(self, state: NodeState) -> Resource:
        return self._plan_of(state).resources.get(self.resource) or Resource(self.resource, ())

    def devices(self) -> tuple[Device, ...]:
        return self._resource(self._bus.current).devices

    def _indexed(self, state: NodeState) -> tuple[Resource, DeviceIndex]:
        """The resource in `state` and its device index, rebuilt only when the resource's devices change."""
        resource = self._resource(state)
        cached = self._index
        if cached is None or cached[0] is not resource:
            if cached is not None and cached[1].devices == resource.devices:
                cached = (resource, cached[1])
            else:
                cached = (resource, DeviceIndex(self.resource, resource.devices))
            self._index = cached
        return cached

    def _responses(self, state: NodeState) -> ResponseBuilder:
        cached = self._builder
        if cached is None or cached[0] is not state:
            if cached is not None and cached[1].inventory is state.inventory and cached[1].config is state.config:
                cached = (state, cached[1])
            else:
                cached = (state, ResponseBuilder(state.inventory, state.config, self._files))
            self._builder = cached
        return cached[1]

    def _counter(self, name: str) -> Any:
        """The child of metric `name` for this resource, made on first use (a series appears once counted)."""
        child = self._counters.get(name)
        if child is None:
            child = self._counters[name] = getattr(self._metrics, name).labels(resource=self.resource)
        return child

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        if self._streams >= MAX_STREAMS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"ListAndWatch for {self.resource} already has {MAX_STREAMS} open streams")
        self._streams += 1
        try:
            generation = self._generation
            state = self._bus.current
            sent = self._resource(state).devices
            yield to_proto(sent)
            while (newer := await self._newer(state.version, generation)) is not None:
                state = newer
                devices = self._resource(state).devices
                if devices != sent:
                    sent = devices
                    log.info("ListAndWatch update for %s: %d devices, %d healthy",
                             self.resource, len(devices), sum(d.healthy for d in devices))
                    yield to_proto(devices)
        finally:  # the stream ended: close(), the client left (the handler is cancelled), or the server stopped
            self._streams -= 1

    async def _newer(self, version: int, generation: _Generation) -> NodeState | None:
        """The newest state once it is newer than `version`, or None once `generation` is closed. A state
        published before the close is still returned, so a stream whose resource vanished sends its empty list
        before its server stops."""
        current = self._bus.current
        if current.version > version:
            return current
        if generation.closed.is_set():
            return None
        newer = asyncio.ensure_future(self._bus.wait_newer(version))
        closed = asyncio.ensure_future(generation.closed.wait())
        try:
            await asyncio.wait({newer, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            newer.cancel()
            closed.cancel()
        current = self._bus.current
        return current if current.version > version else None

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._search, self.preferred, request)
        except ValueError as err:  # RequestError, or the allocator's AllocationError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise  # not reached: abort raises

    def preferred(self, request: api_pb2.PreferredAllocationRequest) -> api_pb2.PreferredAllocationResponse:
        """GetPreferredAllocation's answer from the newest state (on a search thread); ValueError for a request
        that cannot be answered."""
        resource, index = self._indexed(self._bus.current)
        devices = resource.devices
        prefer = self._prefer_for(resource)
        responses = []
        for creq in request.container_requests:
            available = [d.id for d in index.lookup(creq.available_deviceIDs, need_healthy=False)]
            must = [d.id for d in index.lookup(creq.must_include_deviceIDs, need_healthy=False)]
            size = creq.allocation_size
            offered = set(available)
            outside = [i for i in must if i not in offered]
            if outside:
                # The kubelet offers every must-include device among the available ones.
                raise RequestError(f"must-include device {outside[0]} of {self.resource} is not among the "
                                   "available devices")
            pool = offered | set(must)
            if size < 1 or size > len(pool) or len(must) > size:
                raise RequestError(
                    f"cannot choose {size} device(s) of {self.resource} from {len(pool)} available "
                    f"with {len(must)} required"
                )
            chosen = prefer(devices, available, must, size)
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.AllocateResponse:
        try:
            return self.allocate(request)
        except RequestError as err:
            if self._metrics:
                self._counter("allocate_errors").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise  # not reached: abort raises

    def allocate(self, request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        """Allocate's answer from the newest state; RequestError for a request that names a device it cannot
        have."""
        state = self._bus.current
        resource, index = self._indexed(state)
        builder = self._responses(state)
        response = api_pb2.AllocateResponse()
        handed_out = 0
        for creq in request.container_requests:
            ids = creq.devices_ids
            if not ids:
                raise RequestError(f"allocate request for {self.resource} names no devices")
            if resource.fail_requests_greater_than_one and len(ids) > 1:
                raise RequestError(
                    f"invalid request: maximum request size for shared resource {self.resource} is 1; "
                    f"found {len(ids)}"
                )
            chosen = index.lookup(ids, need_healthy=True)
            builder.fill(response.container_responses.add(), chosen, resource)
            handed_out += len(chosen)
        if self._metrics and handed_out:  # counted once the whole call is answered: a refused one hands out none
            self._counter("allocations").inc(handed_out)
        return response

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


class _Generation:
    """The streams of one serve: close() ends them all."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
