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


LIMIT_REFUSAL = (grpc.StatusCode.RESOURCE_EXHAUSTED, "ListAndWatch for nvidia.com/gpu already has 4 open streams")
"""What the server answers a stream beyond the limit."""


async def refusal(stub: api_pb2_grpc.DevicePluginStub) -> tuple[grpc.StatusCode, str]:
    """How the server answers one more ListAndWatch, which it must refuse."""
    stream = stub.ListAndWatch(api_pb2.Empty())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(stream.read(), 5)
    return err.value.code(), err.value.details()


async def left(rig: Rig, stream: grpc.aio.UnaryStreamCall) -> None:
    """The client leaves `stream`; once the server has ended its side (grpc cancels the handler a moment
    after the client's cancellation reaches it), the stream no longer counts."""
    before = rig.open_streams()
    stream.cancel()
    await wait_until(lambda: rig.open_streams() == before - 1, 5, "the server to end the stream the client left")


async def test_a_stream_beyond_the_limit_is_refused_and_calls_are_still_answered() -> None:
    async with running_agent("dgx-h100") as rig:
        ids = [d.ID for d in rig.devices()]
        async with channel(rig) as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            # The stand-in kubelet holds one stream already.
            assert rig.open_streams() == 1
            streams = [stub.ListAndWatch(api_pb2.Empty()) for _ in range(STREAMS - 1)]
            for stream in streams:
                assert await first_list(stream) == [(i, "Healthy") for i in ids]
            assert rig.open_streams() == STREAMS
            assert await refusal(stub) == LIMIT_REFUSAL
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

            # A client that leaves gives its place back: one more stream opens, and the one after is refused.
            await left(rig, streams.pop())
            replacement = stub.ListAndWatch(api_pb2.Empty())
            listed = await first_list(replacement)
            assert [h for _, h in listed] == ["Healthy"] * 6 + ["Unhealthy", "Healthy"]
            assert await refusal(stub) == LIMIT_REFUSAL
            replacement.cancel()
            for stream in streams:
                stream.cancel()


async def test_streams_that_clients_cancel_never_use_up_the_server() -> None:
    async with running_agent("single-h200") as rig:
        ids = [d.ID for d in rig.devices()]
        async with channel(rig) as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            for _ in range(10 * STREAMS):
                stream = stub.ListAndWatch(api_pb2.Empty())
                assert await first_list(stream) == [(ids[0], "Healthy")]
                await left(rig, stream)
            assert rig.open_streams() == 1  # the kubelet's
            # Three at once still fit beside the kubelet's, the limit holds, and all of them hear of a fault.
            streams = [stub.ListAndWatch(api_pb2.Empty()) for _ in range(STREAMS - 1)]
            for stream in streams:
                assert await first_list(stream) == [(ids[0], "Healthy")]
            assert await refusal(stub) == LIMIT_REFUSAL
            rig.fake.inject_xid(0, 48)
            for stream in streams:
                response = await asyncio.wait_for(stream.read(), 5)
                assert [(d.ID, d.health) for d in response.devices] == [(ids[0], "Unhealthy")]
            for stream in streams:
                stream.cancel()
