"""Allocate as an attacker or a broken kubelet would call it: duplicated, unknown, over-long and enormous lists
of IDs get exact gRPC statuses and messages, arbitrary ID lists get the answer the contract gives, and 10,000
concurrent calls over one channel are each answered exactly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from tests.plugin_harness import Rig, running_agent

T = TypeVar("T")

RESOURCE = "nvidia.com/gpu"
MAX_ID = 63
GRPC_MAX_RECEIVE = 2 * 1024 * 1024
"""The largest message the agent's plugin server takes (agent/deviceplugin/server.py, MAX_RECEIVE_BYTES)."""
CONCURRENT_CALLS = 10_000
BATCH = 1_000
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass
class Served:
    """One agent on a simulated DGX H100, served from its own event loop thread for the whole module."""

    loop: asyncio.AbstractEventLoop
    rig: Rig
    stub: api_pb2_grpc.DevicePluginStub
    ids: list[str]

    def run(self, make: Callable[[], Awaitable[T]], timeout: float = 60) -> T:
        async def call() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="served-agent", daemon=True)
    thread.start()
    started: concurrent.futures.Future[tuple[Rig, api_pb2_grpc.DevicePluginStub]] = concurrent.futures.Future()
    stop = asyncio.run_coroutine_threadsafe(_event(), loop).result(5)

    async def hold() -> None:
        try:
            async with running_agent("dgx-h100") as rig:
                started.set_result((rig, rig.stub()))
                await stop.wait()
        except BaseException as err:
            if not started.done():
                started.set_exception(err)
            raise

    held = asyncio.run_coroutine_threadsafe(hold(), loop)
    try:
        rig, stub = started.result(30)
        yield Served(loop, rig, stub, [d.ID for d in rig.devices()])
    finally:
        loop.call_soon_threadsafe(stop.set)
        held.result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()


def request(*containers: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )


def allocate(served: Served, req: api_pb2.AllocateRequest) -> list[dict[str, str]]:
    response = served.run(lambda: served.stub.Allocate(req, timeout=30))
    return [dict(c.envs) for c in response.container_responses]


def refusal(served: Served, req: api_pb2.AllocateRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        served.run(lambda: served.stub.Allocate(req, timeout=30))
    return caught.value.code(), caught.value.details()


def visible(*ids: str) -> dict[str, str]:
    return {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}


def unknown(device: str) -> tuple[grpc.StatusCode, str]:
    return INVALID, f"unknown device ID {device!r} for resource {RESOURCE}"


def too_long(device: str) -> tuple[grpc.StatusCode, str]:
    return INVALID, f"device ID {device[:20]!r}... is {len(device)} characters; IDs have at most {MAX_ID}"


def test_duplicates_are_named_once_in_first_seen_order(served: Served) -> None:
    ids = served.ids
    assert allocate(served, request([ids[3]] * 1000 + [ids[1], ids[3], ids[1]])) == [visible(ids[3], ids[1])]


def test_a_bad_id_anywhere_refuses_the_whole_call_naming_the_first(served: Served) -> None:
    ids = served.ids
    assert refusal(served, request([*ids[:4], "GPU-nope", "GPU-also-nope"])) == unknown("GPU-nope")
    # A bad ID in the second container refuses the first container's devices too: no partial answer.
    assert refusal(served, request(ids[:2], [ids[2], "x" * 64])) == too_long("x" * 64)
    assert refusal(served, request(ids[:2], [])) == (INVALID, f"allocate request for {RESOURCE} names no devices")


def test_the_id_length_limit_is_exact(served: Served) -> None:
    assert refusal(served, request(["a" * MAX_ID])) == unknown("a" * MAX_ID)
    assert refusal(served, request(["a" * (MAX_ID + 1)])) == too_long("a" * (MAX_ID + 1))
    # A real ID with something appended is over-long, not silently truncated to the real one.
    padded = served.ids[0] + "-" * (MAX_ID + 1 - len(served.ids[0]))
    assert refusal(served, request([padded])) == too_long(padded)
    assert refusal(served, request(["é" * MAX_ID + "é"])) == too_long("é" * (MAX_ID + 1))


def test_a_hundred_thousand_ids(served: Served) -> None:
    ids = served.ids
    # Unknown IDs: refused at the first one, without echoing the rest.
    names = [f"id-{i:06d}" for i in range(100_000)]
    assert refusal(served, request(names)) == unknown("id-000000")
    # Real IDs repeated, just under the plugin server's message limit: answered, each GPU once.
    repeated = [ids[i % 8] for i in range(49_000)]
    assert request(repeated).ByteSize() < GRPC_MAX_RECEIVE
    assert allocate(served, request(repeated)) == [visible(*ids)]
    # Over the limit: refused by gRPC before the agent reads it, and the agent keeps serving.
    oversized = request([ids[i % 8] for i in range(100_000)])
    size = oversized.ByteSize()
    assert size > GRPC_MAX_RECEIVE
    assert refusal(served, oversized) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, f"SERVER: Received message larger than max ({size} vs. {GRPC_MAX_RECEIVE})"
    )
    assert allocate(served, request([ids[5]])) == [visible(ids[5])]


def test_ten_thousand_containers_in_one_call_each_get_their_answer(served: Served) -> None:
    ids = served.ids
    containers = [[ids[i % 8], ids[(i + 3) % 8]] for i in range(10_000)]
    assert allocate(served, request(*containers)) == [visible(*c) for c in containers]
    assert allocate(served, api_pb2.AllocateRequest()) == []


def test_ten_thousand_concurrent_calls_over_one_channel_are_each_answered_exactly(served: Served) -> None:
    ids = served.ids

    def pair(i: int) -> list[str]:
        return [ids[i % 8], ids[(3 * i + 1) % 8]]  # 2i + 1 is odd, never 0 mod 8: always two GPUs

    async def calls() -> list[list[dict[str, str]]]:
        answers: list[list[dict[str, str]]] = []
        for start in range(0, CONCURRENT_CALLS, BATCH):
            responses = await asyncio.gather(
                *(served.stub.Allocate(request(pair(i)), timeout=60) for i in range(start, start + BATCH))
            )
            answers += [[dict(c.envs) for c in r.container_responses] for r in responses]
        return answers

    answers = served.run(calls, timeout=300)
    assert len(answers) == CONCURRENT_CALLS
    wrong = [i for i, answer in enumerate(answers) if answer != [visible(*pair(i))]]
    assert wrong == []


# --- arbitrary ID lists: the answer the contract gives, whatever the list -------------------------------


def contract(known: list[str], ids: list[str]) -> Any:
    """What Allocate must answer for one container asking for `ids`: the first bad ID named, else each GPU once."""
    for device in ids:
        if len(device) > MAX_ID:
            return too_long(device)
        if device not in known:
            return unknown(device)
    if not ids:
        return INVALID, f"allocate request for {RESOURCE} names no devices"
    return [visible(*dict.fromkeys(ids))]


KNOWN = st.sampled_from(range(8))
NEAR_MISS = st.tuples(KNOWN, st.sampled_from(["upper", "space", "suffix", "prefix", "truncate"]))
ITEMS = st.one_of(
    KNOWN.map(lambda i: ("known", i)),
    NEAR_MISS.map(lambda t: ("near", t)),
    st.text(max_size=MAX_ID + 10).map(lambda s: ("text", s)),
    st.text(min_size=MAX_ID - 1, max_size=MAX_ID + 2).map(lambda s: ("text", s)),
)


def realise(known: list[str], item: tuple[str, Any]) -> str:
    kind, value = item
    if kind == "known":
        return known[value]
    if kind == "near":
        index, how = value
        device = known[index]
        return {"upper": device.upper(), "space": f" {device}", "suffix": f"{device}::0",
                "prefix": device.removeprefix("GPU-"), "truncate": device[:-1]}[how]
    return str(value)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(ITEMS, max_size=12))
def test_any_list_of_ids_gets_the_contract_answer(served: Served, items: list[tuple[str, Any]]) -> None:
    ids = [realise(served.ids, item) for item in items]
    want = contract(served.ids, ids)
    if isinstance(want, list):
        assert allocate(served, request(ids)) == want
    else:
        assert refusal(served, request(ids)) == want
