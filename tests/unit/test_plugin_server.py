"""The device plugin's gRPC server (server.plugin_server, ResourcePlugin) over a real unix socket with grpc's
blocking client, as a kubelet in another process calls it: the largest legitimate requests answered and one byte
more refused, a slow preferred-allocation search that holds up neither Allocate nor a ListAndWatch update,
stopping with a call in flight and streams open, and a client that dies mid-stream."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from agent.deviceplugin.server import MAX_RECEIVE_BYTES, ResourcePlugin
from agent.deviceplugin.servicer import DevicePluginServicer, Prefer
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.inventory import Device, PlanCache, Resource
from agent.state import DeviceHealth, StateBus
from tests.builders import LoopThread, allocate, node, refusal, serving
from tests.plugin_harness import short_dir

ROOT = Path(__file__).resolve().parents[2]
REPLICAS_1024 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1024}\n"
NOTICED_S = 0.1
"""What a user would notice: the health budget of a ListAndWatch update, and far more than an Allocate takes."""


class HeldSearch:
    """A preference policy whose search runs until the test releases it: a search as slow as the test needs.
    It answers the first `size` devices offered."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, resource: Resource) -> Prefer:
        def prefer(devices: tuple[Device, ...], available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
            self.started.set()
            assert self.release.wait(30)
            return list(available[:size])

        return prefer


def preference_request(available: list[str], size: int, must: list[str] | None = None
                       ) -> api_pb2.PreferredAllocationRequest:
    return api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must or [], allocation_size=size)])


def one_id_request(length: int) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["G" * length])])


def test_the_largest_legitimate_requests_are_answered_with_a_third_to_spare() -> None:
    with serving(node("hgx-16-nvswitch", config=REPLICAS_1024)) as served:
        every = [d.ID for d in next(served.stub.ListAndWatch(api_pb2.Empty(), timeout=30)).devices]
        assert len(every) == 16 * 1024
        assert every[-1] == f"{served.ids[15]}::1023"
        whole = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=every)])
        widest = preference_request(every, len(every), must=every)
        assert (whole.ByteSize(), widest.ByteSize()) == (768_676, 1_537_352)
        assert widest.ByteSize() * 4 // 3 <= MAX_RECEIVE_BYTES
        (container,) = served.stub.Allocate(whole, timeout=30).container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(served.ids)
        (answer,) = served.stub.GetPreferredAllocation(widest, timeout=30).container_responses
        assert sorted(answer.deviceIDs) == sorted(every)


def test_a_request_one_byte_over_the_limit_is_refused_and_the_server_goes_on() -> None:
    with serving(node()) as served:
        stream = served.stub.ListAndWatch(api_pb2.Empty(), timeout=30)
        assert len(next(stream).devices) == 8
        at_limit, over = one_id_request(2 * 1024 * 1024 - 8), one_id_request(2 * 1024 * 1024 - 7)
        assert (at_limit.ByteSize(), over.ByteSize()) == (2_097_152, 2_097_153)
        # At the limit the request is read and answered with the agent's own refusal of the ID.
        with pytest.raises(grpc.RpcError) as read:
            served.stub.Allocate(at_limit, timeout=10)
        assert refusal(read.value) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "device ID 'GGGGGGGGGGGGGGGGGGGG'... is 2097144 characters; IDs have at most 63")
        with pytest.raises(grpc.RpcError) as refused:
            served.stub.Allocate(over, timeout=10)
        code, details = refusal(refused.value)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2097153 vs. 2097152" in details  # grpc's words name both sizes
        # The same channel and the open stream go on.
        (container,) = allocate(served, [served.ids[1]]).container_responses
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": served.ids[1]}
        served.update(health={served.ids[2]: DeviceHealth(False, "XID 79")})
        assert [d.health for d in next(stream).devices] == ["Healthy"] * 2 + ["Unhealthy"] + ["Healthy"] * 5
        stream.cancel()


def test_a_slow_preferred_allocation_holds_up_neither_allocate_nor_a_list_and_watch_update() -> None:
    held = HeldSearch()
    with ThreadPoolExecutor(2) as search:
        try:
            with serving(node(), prefer_for=held, search=search) as served:
                ids = served.ids
                stream = served.stub.ListAndWatch(api_pb2.Empty(), timeout=30)
                assert len(next(stream).devices) == 8
                pending = served.stub.GetPreferredAllocation.future(preference_request(ids, 2), timeout=30)
                assert held.started.wait(5)

                started = time.monotonic()
                (container,) = allocate(served, [ids[3]]).container_responses
                allocate_s = time.monotonic() - started
                assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": ids[3]}

                started = time.monotonic()
                served.update(health={ids[6]: DeviceHealth(False, "XID 48")})
                update = next(stream)
                update_s = time.monotonic() - started
                assert [d.health for d in update.devices] == ["Healthy"] * 6 + ["Unhealthy", "Healthy"]

                # Both answered while the search was still running, each well within what a user notices.
                assert not pending.done()
                assert allocate_s < NOTICED_S, f"Allocate took {allocate_s:.3f}s beside a running search"
                assert update_s < NOTICED_S, f"the update took {update_s:.3f}s beside a running search"
                held.release.set()
                (answer,) = pending.result(5).container_responses
                assert list(answer.deviceIDs) == ids[:2]
                stream.cancel()
        finally:
            held.release.set()


@contextlib.contextmanager
def resource_plugin(held: HeldSearch) -> Iterator[tuple[LoopThread, ResourcePlugin, Path, list[str]]]:
    """nvidia.com/gpu of a DGX H100 served by a ResourcePlugin, as the agent serves it, with the search `held`."""
    loop = LoopThread()
    directory = short_dir()
    search = ThreadPoolExecutor(2)
    state = node()

    def make() -> ResourcePlugin:
        servicer = DevicePluginServicer("nvidia.com/gpu", StateBus(state), PlanCache(), held, None, None, search)
        return ResourcePlugin(servicer, directory)

    try:
        plugin = loop.call(make)
        path = loop.run(plugin.serve())
        yield loop, plugin, path, [g.uuid for g in state.inventory.gpus]
    finally:
        held.release.set()
        search.shutdown()
        loop.close()
        shutil.rmtree(directory)


def test_stopping_answers_the_call_in_flight_within_the_grace_and_ends_the_streams() -> None:
    held = HeldSearch()
    with resource_plugin(held) as (loop, plugin, path, ids), grpc.insecure_channel(f"unix://{path}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        streams = [stub.ListAndWatch(api_pb2.Empty(), timeout=30) for _ in range(2)]
        assert [len(next(s).devices) for s in streams] == [8, 8]
        in_flight = stub.GetPreferredAllocation.future(preference_request(ids, 2), timeout=30)
        assert held.started.wait(5)
        # The search ends 0.3 s into a 1 s grace: the kubelet gets its answer before the server goes.
        threading.Timer(0.3, held.release.set).start()
        started = time.monotonic()
        loop.run(plugin.stop(grace=1.0))
        took = time.monotonic() - started
        (answer,) = in_flight.result(5).container_responses
        assert list(answer.deviceIDs) == ids[:2]
        assert [list(s) for s in streams] == [[], []]  # each stream ended cleanly, nothing more sent
        assert 0.25 <= took < 1.0, f"stop took {took:.3f}s"
        assert not path.exists()


def test_stopping_ends_a_call_that_outlasts_the_grace() -> None:
    held = HeldSearch()
    with resource_plugin(held) as (loop, plugin, path, ids), grpc.insecure_channel(f"unix://{path}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        stream = stub.ListAndWatch(api_pb2.Empty(), timeout=30)
        assert len(next(stream).devices) == 8
        in_flight = stub.GetPreferredAllocation.future(preference_request(ids, 2), timeout=30)
        assert held.started.wait(5)
        started = time.monotonic()
        loop.run(plugin.stop(grace=0.5))
        took = time.monotonic() - started
        with pytest.raises(grpc.RpcError) as ended:
            in_flight.result(5)
        assert refusal(ended.value) == (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")  # grpc's words
        assert list(stream) == []
        assert 0.45 <= took < 1.0, f"stop took {took:.3f}s"
        assert not path.exists()


CLIENT = """
import sys, time, grpc
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
stub = api_pb2_grpc.DevicePluginStub(grpc.insecure_channel(sys.argv[1]))
stream = stub.ListAndWatch(api_pb2.Empty())
print(len(next(stream).devices), flush=True)
time.sleep(60)
"""


def test_a_client_killed_mid_stream_gives_its_place_back() -> None:
    with serving(node()) as served:
        client = subprocess.Popen([sys.executable, "-c", CLIENT, served.target], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert client.stdout is not None
            assert client.stdout.readline() == "8\n"
            streams = [served.stub.ListAndWatch(api_pb2.Empty(), timeout=30) for _ in range(3)]
            assert [len(next(s).devices) for s in streams] == [8, 8, 8]
            with pytest.raises(grpc.RpcError) as full:
                next(served.stub.ListAndWatch(api_pb2.Empty(), timeout=30))
            assert refusal(full.value) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "ListAndWatch for nvidia.com/gpu already has 4 open streams")
            client.send_signal(signal.SIGKILL)
            client.wait(5)
            # The dead client's stream ends with its connection: within a second a fourth stream opens again.
            deadline = time.monotonic() + 1.0
            while True:
                replacement = served.stub.ListAndWatch(api_pb2.Empty(), timeout=30)
                try:
                    assert len(next(replacement).devices) == 8
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
                    assert time.monotonic() < deadline, "the killed client's stream still holds its place"
                    time.sleep(0.02)
            served.update(health={served.ids[0]: DeviceHealth(False, "XID 79")})
            for stream in [*streams, replacement]:
                assert [d.health for d in next(stream).devices] == ["Unhealthy"] + ["Healthy"] * 7
                stream.cancel()
        finally:
            client.kill()
            client.wait(5)
