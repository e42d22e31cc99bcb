"""ListAndWatch streams on the agent's CoreServer: each open stream holds one of the resource's stream
threads, so the number open at once is bounded, a client that leaves frees its thread at once, and every open
stream sees a health change."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from tests.plugin_harness import Rig, running_agent, wait_until

RESOURCE = "nvidia.com/gpu"
STREAMS = 4
"""ListAndWatch streams one resource serves at once (the kubelet's among them)."""


def channel(rig: Rig) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"unix://{rig.directory / rig.kubelet.plugins[RESOURCE].endpoint}")


async def first_list(stream: grpc.aio.UnaryStreamCall) -> list[tuple[str, str]]:
    response = await asyncio.wait_for(stream.read(), 5)
    assert response is not grpc.aio.EOF
    return [(d.ID, d.health) for d in response.devices]


async def allocate(stub: api_pb2_grpc.DevicePluginStub, device: str) -> dict[str, str]:
    response = await stub.Allocate(
        api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[device])]),
        timeout=5)
    return dict(response.container_responses[0].envs)


async def test_a_stream_beyond_the_limit_is_refused_and_calls_are_still_answered() -> None:
    async with running_agent("dgx-h100") as rig:
        ids = [d.ID for d in rig.devices()]
        async with channel(rig) as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            # The stand-in kubelet holds one stream already.
            streams = [stub.ListAndWatch(api_pb2.Empty()) for _ in range(STREAMS - 1)]
            for stream in streams:
                assert await first_list(stream) == [(i, "Healthy") for i in ids]
            refused = stub.ListAndWatch(api_pb2.Empty())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(refused.read(), 5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == "ListAndWatch for nvidia.com/gpu already has 4 open streams"
            assert await allocate(stub, ids[3]) == {"NVIDIA_VISIBLE_DEVICES": ids[3]}

            # Every open stream, the kubelet's too, hears of a GPU going unhealthy.
            updates = rig.kubelet.plugins[RESOURCE].updates
            rig.fake.inject_xid(6, 48)
            for stream in streams:
                response = await asyncio.wait_for(stream.read(), 5)
                assert [d.health for d in response.devices] == ["Healthy"] * 6 + ["Unhealthy", "Healthy"]
            # The kubelet's stream is read by its own task: its update may land a moment after the others.
            await wait_until(lambda: rig.kubelet.plugins[RESOURCE].updates > updates, 5, "the kubelet's update")
            assert rig.kubelet.plugins[RESOURCE].updates == updates + 1
            assert rig.devices()[6].health == "Unhealthy"

            # A client that leaves gives its place back: one more stream opens.
            streams.pop().cancel()
            replacement = stub.ListAndWatch(api_pb2.Empty())
            listed = await asyncio.wait_for(_first_when_open(stub, replacement), 5)
            assert [h for _, h in listed] == ["Healthy"] * 6 + ["Unhealthy", "Healthy"]
            replacement.cancel()
            for stream in streams:
                stream.cancel()


async def _first_when_open(stub: api_pb2_grpc.DevicePluginStub,
                           stream: grpc.aio.UnaryStreamCall) -> list[tuple[str, str]]:
    """The first list of `stream`; while the cancelled stream's thread is still finishing (a moment), the
    server may refuse the new one, so open it again until it is accepted."""
    while True:
        try:
            return await first_list(stream)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            await asyncio.sleep(0.01)
            stream = stub.ListAndWatch(api_pb2.Empty())


async def _open_when_free(
    stub: api_pb2_grpc.DevicePluginStub
) -> tuple[grpc.aio.UnaryStreamCall, list[tuple[str, str]]]:
    """A stream the server accepted (opened again while it refuses, as in _first_when_open), and its first list."""
    while True:
        stream = stub.ListAndWatch(api_pb2.Empty())
        try:
            return stream, await first_list(stream)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            await asyncio.sleep(0.01)


async def test_streams_that_clients_cancel_never_use_up_the_server() -> None:
    async with running_agent("single-h200") as rig:
        ids = [d.ID for d in rig.devices()]
        async with channel(rig) as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            for _ in range(10 * STREAMS):
                stream = stub.ListAndWatch(api_pb2.Empty())
                assert await _first_when_open(stub, stream) == [(ids[0], "Healthy")]
                stream.cancel()
            # Three at once still fit beside the kubelet's, and all of them hear of a fault.
            streams = []
            for _ in range(STREAMS - 1):
                stream, listed = await _open_when_free(stub)
                assert listed == [(ids[0], "Healthy")]
                streams.append(stream)
            rig.fake.inject_xid(0, 48)
            for stream in streams:
                response = await asyncio.wait_for(stream.read(), 5)
                assert [(d.ID, d.health) for d in response.devices] == [(ids[0], "Unhealthy")]
            for stream in streams:
                stream.cancel()
