"""The CoreServer over real gRPC on a unix socket, with grpcio's client: what a client gets back for every way a
call can go (answered, aborted, a handler's fault, a request that does not parse, an unknown method, a stream
that fails half-way, a client that leaves), and that stopping ends every call and leaves no thread behind."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.deviceplugin.coreserver import CallContext, CoreServer, Method
from agent.deviceplugin.v1beta1 import api_pb2
from tests.plugin_harness import short_dir

SERVICE = "/test.Service/"
STREAM_THREADS = 2


class Service:
    """Answers Echo with the request's resource name; Watch lists `count` devices one message at a time, then
    waits until released or the client leaves."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ended: list[str] = []

    def echo(self, request: api_pb2.RegisterRequest, context: CallContext) -> api_pb2.RegisterRequest:
        if request.resource_name == "abort":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused on purpose")
        if request.resource_name == "fault":
            raise KeyError("boom")
        return api_pb2.RegisterRequest(resource_name=f"echo {request.resource_name}")

    def watch(self, request: api_pb2.RegisterRequest, context: CallContext) -> Iterator[api_pb2.Device]:
        left = threading.Event()
        assert context.add_callback(left.set)
        context.add_callback(lambda: self.ended.append(request.resource_name))
        for i in range(int(request.version or "1")):
            yield api_pb2.Device(ID=f"dev-{i}")
        if request.resource_name == "fault":
            raise ValueError("stream broke")
        while not (self.release.is_set() or left.is_set()):
            left.wait(0.01)


@contextlib.contextmanager
def serving() -> Iterator[tuple[grpc.Channel, Service, CoreServer]]:
    service = Service()
    server = CoreServer({
        SERVICE + "Echo": Method(service.echo, api_pb2.RegisterRequest.FromString),
        SERVICE + "Watch": Method(service.watch, api_pb2.RegisterRequest.FromString, streams=True),
    }, "test", STREAM_THREADS)
    directory = short_dir()
    target = f"unix://{directory}/test.sock"
    assert server.add_port(target)
    server.start()
    channel = grpc.insecure_channel(target)
    try:
        yield channel, service, server
    finally:
        channel.close()
        service.release.set()
        server.stop()
        server.cancel()
        assert server.stopped.wait(5)
        shutil.rmtree(directory)


def echo(channel: grpc.Channel, name: str) -> str:
    call = channel.unary_unary(SERVICE + "Echo", request_serializer=api_pb2.RegisterRequest.SerializeToString,
                               response_deserializer=api_pb2.RegisterRequest.FromString)
    return str(call(api_pb2.RegisterRequest(resource_name=name), timeout=5).resource_name)


def watch(channel: grpc.Channel, name: str, count: int = 1) -> Any:
    call = channel.unary_stream(SERVICE + "Watch", request_serializer=api_pb2.RegisterRequest.SerializeToString,
                                response_deserializer=api_pb2.Device.FromString)
    return call(api_pb2.RegisterRequest(resource_name=name, version=str(count)), timeout=10)


def failure(err: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, str]:
    return err.value.code(), err.value.details()  # type: ignore[attr-defined]


def test_unary_calls_are_answered_and_refusals_carry_their_status() -> None:
    with serving() as (channel, _, _):
        assert echo(channel, "gpu") == "echo gpu"
        with pytest.raises(grpc.RpcError) as aborted:
            echo(channel, "abort")
        assert failure(aborted) == (grpc.StatusCode.FAILED_PRECONDITION, "refused on purpose")
        with pytest.raises(grpc.RpcError) as fault:
            echo(channel, "fault")
        assert failure(fault) == (grpc.StatusCode.UNKNOWN, "/test.Service/Echo failed in the agent: KeyError('boom')")
        assert echo(channel, "again") == "echo again"  # a handler's fault leaves the server answering


def test_an_unknown_method_and_a_request_that_does_not_parse_are_refused() -> None:
    with serving() as (channel, _, _):
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary(SERVICE + "Nope")(b"", timeout=5)
        assert failure(unknown) == (grpc.StatusCode.UNIMPLEMENTED, "unknown method /test.Service/Nope")
        with pytest.raises(grpc.RpcError) as garbage:
            channel.unary_unary(SERVICE + "Echo")(b"\xff\xff\xff", timeout=5)
        assert failure(garbage) == (grpc.StatusCode.INVALID_ARGUMENT, "/test.Service/Echo: the request does not parse")
        with pytest.raises(grpc.RpcError) as stream_garbage:
            next(channel.unary_stream(SERVICE + "Watch")(b"\xff\xff\xff", timeout=5))
        assert failure(stream_garbage) == (grpc.StatusCode.INVALID_ARGUMENT,
                                           "/test.Service/Watch: the request does not parse")
        assert echo(channel, "still") == "echo still"


def test_many_clients_at_once_each_get_their_own_answer() -> None:
    with serving() as (channel, _, _):
        answers: dict[int, str] = {}

        def client(n: int) -> None:
            for k in range(50):
                answers[n * 100 + k] = echo(channel, f"{n}-{k}")

        threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert answers == {n * 100 + k: f"echo {n}-{k}" for n in range(4) for k in range(50)}


def test_a_stream_sends_every_message_then_its_status() -> None:
    with serving() as (channel, service, _):
        service.release.set()
        assert [d.ID for d in watch(channel, "all", 3)] == ["dev-0", "dev-1", "dev-2"]
        broken = watch(channel, "fault", 2)
        assert [next(broken).ID, next(broken).ID] == ["dev-0", "dev-1"]
        with pytest.raises(grpc.RpcError) as fault:
            next(broken)
        assert failure(fault) == (grpc.StatusCode.UNKNOWN,
                                  "/test.Service/Watch failed in the agent: ValueError('stream broke')")


def test_a_client_that_leaves_ends_its_stream_and_frees_its_thread() -> None:
    with serving() as (channel, service, _):
        for n in range(5 * STREAM_THREADS):  # more streams in turn than there are stream threads
            stream = watch(channel, f"s{n}")
            assert next(stream).ID == "dev-0"
            stream.cancel()
        # Both threads free again: two streams at once, and a third waits for a thread rather than failing.
        held = [watch(channel, "a"), watch(channel, "b")]
        assert [next(s).ID for s in held] == ["dev-0", "dev-0"]
        waiting = watch(channel, "c")
        held[0].cancel()
        assert next(waiting).ID == "dev-0"
        assert "s0" in service.ended and "a" in service.ended
        assert echo(channel, "calls still answered") == "echo calls still answered"
        held[1].cancel()
        waiting.cancel()


def test_stopping_ends_open_streams_and_every_thread() -> None:
    service_threads = {t.ident for t in threading.enumerate()}
    with serving() as (channel, service, server):
        streams = [watch(channel, "x"), watch(channel, "y")]
        assert [next(s).ID for s in streams] == ["dev-0", "dev-0"]
        server.stop()
        server.cancel()  # the streams' handlers never end by themselves: only the cancel ends them
        assert server.stopped.wait(5)
        for stream in streams:
            with pytest.raises(grpc.RpcError) as ended:
                next(stream)
            assert failure(ended) == (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")  # grpc core's words
        for thread in server.streams.threads:
            thread.join(5)
        assert not server.streams.alive()
        assert sorted(service.ended) == ["x", "y"]
    left = [t.name for t in threading.enumerate() if t.ident not in service_threads and t.name.startswith("test-")]
    assert left == []


def test_a_port_that_cannot_be_bound_is_refused_and_the_server_discarded(tmp_path: Path) -> None:
    server = CoreServer({}, "test-unbound", STREAM_THREADS)
    (tmp_path / "file").write_text("")
    assert server.add_port(f"unix://{tmp_path}/file/plugin.sock") is False  # a file where a directory should be
    server.discard()
    for thread in server.streams.threads:
        thread.join(5)
    assert not server.streams.alive()
