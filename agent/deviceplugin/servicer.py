"""The DevicePlugin service for one resource: lists, allocates and prefers devices from the newest NodeState.

Its handlers run on the threads of the resource's CoreServer (server.py): Allocate, GetPreferredAllocation and the
options on its polling thread, each ListAndWatch stream on a stream thread. They only read the newest NodeState
(immutable), and ListAndWatch waits for newer ones with StateBus.wait_newer_blocking.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from agent.deviceplugin.coreserver import CallContext
from agent.deviceplugin.response import NodeFiles, RequestError, ResponseBuilder
from agent.deviceplugin.v1beta1 import api_pb2
from agent.inventory import Device, Resource, ResourcePlan
from agent.metrics import Metrics
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_ID_LENGTH = 63
MAX_STREAMS = 4
"""ListAndWatch streams one resource serves at once. The kubelet holds one per registration; each open stream
holds one of the server's stream threads while it waits, so a stream beyond the limit is refused rather than left
waiting for a thread."""

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


class DevicePluginServicer:
    """Serves one resource from the newest NodeState; a resource the state no longer has lists no devices."""

    def __init__(
        self,
        resource: str,
        bus: StateBus,
        plan_of: PlanOf,
        prefer_for: PreferFor,
        metrics: Metrics | None = None,
        files: NodeFiles | None = None,
    ) -> None:
        self.resource = resource
        self._files = files or NodeFiles()
        self._metrics = metrics
        self._bus = bus
        self._plan_of = plan_of
        self._prefer_for = prefer_for
        self._generation = _Generation()
        self._streams = 0
        self._lock = threading.Lock()
        self._index: tuple[Resource, DeviceIndex] | None = None
        """(resource, its index) in one attribute: the handler threads share it and replace it whole."""
        self._builder: tuple[NodeState, ResponseBuilder] | None = None
        """(state, the Allocate response builder for it), likewise."""
        self._counters: dict[str, Any] = {}
        """The metrics' children for this resource, by metric: prometheus_client's labels() is slow per call."""

    def open(self) -> None:
        """Streams opened from now on run until close()."""
        self._generation = _Generation()

    def close(self) -> None:
        """End every open ListAndWatch stream (the server is about to stop)."""
        self._generation.closed = True
        self._bus.wake()

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

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: CallContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(
        self, request: api_pb2.Empty, context: CallContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        with self._lock:
            full = self._streams >= MAX_STREAMS
            self._streams += not full
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"ListAndWatch for {self.resource} already has {MAX_STREAMS} open streams")
        try:
            yield from self._list_and_watch(context)
        finally:
            with self._lock:
                self._streams -= 1

    def _list_and_watch(self, context: CallContext) -> Iterator[api_pb2.ListAndWatchResponse]:
        generation = self._generation
        left = threading.Event()

        def leave() -> None:
            left.set()
            self._bus.wake()

        if not context.add_callback(leave):  # called when the RPC ends: a client that goes away ends the wait
            return

        def ended() -> bool:
            return generation.closed or left.is_set()

        state = self._bus.current
        sent = self._resource(state).devices
        yield to_proto(sent)
        while True:
            newer = self._bus.wait_newer_blocking(state.version, ended)
            if newer is None:
                return  # the server is stopping or the client left: end the stream, free its thread
            state = newer
            devices = self._resource(state).devices
            if devices != sent:
                sent = devices
                log.info("ListAndWatch update for %s: %d devices, %d healthy",
                         self.resource, len(devices), sum(d.healthy for d in devices))
                yield to_proto(devices)

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: CallContext
    ) -> api_pb2.PreferredAllocationResponse:
        resource, index = self._indexed(self._bus.current)
        devices = resource.devices
        prefer = self._prefer_for(resource)
        responses = []
        try:
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
        except ValueError as err:  # RequestError, or the allocator's AllocationError
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: CallContext
    ) -> api_pb2.AllocateResponse:
        state = self._bus.current
        resource, index = self._indexed(state)
        builder = self._responses(state)
        response = api_pb2.AllocateResponse()
        handed_out = 0
        try:
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
        except RequestError as err:
            if self._metrics:
                self._counter("allocate_errors").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if self._metrics and handed_out:  # counted once the whole call is answered: a refused one hands out none
            self._counter("allocations").inc(handed_out)
        return response

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: CallContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


class _Generation:
    """The streams of one serve: close() ends them all."""

    def __init__(self) -> None:
        self.closed = False
