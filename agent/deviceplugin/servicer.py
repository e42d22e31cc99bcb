"""The DevicePlugin service for one resource: lists, allocates and prefers devices from the newest NodeState."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from agent.deviceplugin.response import NodeFiles, RequestError, container_response
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.inventory import Device, Resource, ResourcePlan
from agent.metrics import Metrics
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_ID_LENGTH = 63

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


def lookup(resource: str, devices: tuple[Device, ...], ids: Sequence[str], *, need_healthy: bool) -> list[Device]:
    """The devices named by `ids`, duplicates removed, order kept; RequestError on an unknown or unhealthy ID."""
    known = {d.id: d for d in devices}
    found: dict[str, Device] = {}
    for device_id in ids:
        if len(device_id) > MAX_ID_LENGTH:
            raise RequestError(
                f"device ID {device_id[:20]!r}... is {len(device_id)} characters; IDs have at most {MAX_ID_LENGTH}"
            )
        device = known.get(device_id)
        if device is None:
            raise RequestError(f"unknown device ID {device_id!r} for resource {resource}")
        if need_healthy and not device.healthy:
            why = f": {device.reason}" if device.reason else ""
            raise RequestError(f"device {device_id} of resource {resource} is unhealthy{why}")
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
    ) -> None:
        self.resource = resource
        self._files = files or NodeFiles()
        self._metrics = metrics
        self._bus = bus
        self._plan_of = plan_of
        self._prefer_for = prefer_for
        self._closing = asyncio.Event()

    def open(self) -> None:
        """Streams opened from now on run until close()."""
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End every open ListAndWatch stream (the server is about to stop)."""
        self._closing.set()

    def _resource(self, state: NodeState) -> Resource:
        return self._plan_of(state).resources.get(self.resource) or Resource(self.resource, ())

    def devices(self) -> tuple[Device, ...]:
        return self._resource(self._bus.current).devices

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        state = self._bus.current
        sent = self._resource(state).devices
        yield to_proto(sent)
        closing = self._closing
        while not closing.is_set():
            newer = asyncio.ensure_future(self._bus.wait_newer(state.version))
            closed = asyncio.ensure_future(closing.wait())
            await asyncio.wait({newer, closed}, return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
            if not newer.done():
                newer.cancel()
                return  # the server is stopping: end the stream so shutdown need not wait for it
            state = newer.result()
            devices = self._resource(state).devices
            if devices != sent:
                sent = devices
                log.info("ListAndWatch update for %s: %d devices, %d healthy",
                         self.resource, len(devices), sum(d.healthy for d in devices))
                yield to_proto(devices)

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        resource = self._resource(self._bus.current)
        devices = resource.devices
        prefer = self._prefer_for(resource)
        responses = []
        try:
            for creq in request.container_requests:
                available = [d.id for d in lookup(self.resource, devices, creq.available_deviceIDs,
                                                  need_healthy=False)]
                must = [d.id for d in lookup(self.resource, devices, creq.must_include_deviceIDs,
                                             need_healthy=False)]
                size = creq.allocation_size
                pool = set(available) | set(must)
                if size < 1 or size > len(pool) or len(must) > size:
                    raise RequestError(
                        f"cannot choose {size} device(s) of {self.resource} from {len(pool)} available "
                        f"with {len(must)} required"
                    )
                chosen = prefer(devices, available, must, size)
                responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        except ValueError as err:  # RequestError, or the allocator's AllocationError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.AllocateResponse:
        state = self._bus.current
        resource = self._resource(state)
        responses = []
        try:
            for creq in request.container_requests:
                if not creq.devices_ids:
                    raise RequestError(f"allocate request for {self.resource} names no devices")
                if resource.fail_requests_greater_than_one and len(creq.devices_ids) > 1:
                    raise RequestError(
                        f"invalid request: maximum request size for shared resource {self.resource} is 1; "
                        f"found {len(creq.devices_ids)}"
                    )
                chosen = lookup(self.resource, resource.devices, creq.devices_ids, need_healthy=True)
                responses.append(container_response(chosen, resource, state.inventory, state.config, self._files))
                if self._metrics:
                    self._metrics.allocations.labels(resource=self.resource).inc(len(chosen))
        except RequestError as err:
            if self._metrics:
                self._metrics.allocate_errors.labels(resource=self.resource).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return api_pb2.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()
