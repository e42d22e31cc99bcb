"""The NVML worker threads: calls in order, a call past its deadline named and its worker set aside so the next
calls run (at most MAX_SET_ASIDE set aside at once), the set-aside worker ending once its call returns, and the
bounded calls of a loop that must go on past one GPU that hangs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agent.nvmlthread import MAX_SET_ASIDE, BoundedCalls, NvmlStuck, NvmlThread
from tests.plugin_harness import wait_until


def workers(name: str) -> int:
    return sum(t.name == name or t.name.startswith(f"{name}-") for t in threading.enumerate())


async def test_a_call_past_its_deadline_is_named_and_the_calls_behind_it_run_on_a_new_worker() -> None:
    thread = NvmlThread("nvml-test-a", deadline_s=0.2)
    release = threading.Event()
    try:
        hung = asyncio.ensure_future(thread(release.wait, what="a hung call", gpu=3))
        await wait_until(lambda: thread.current is not None, 2, "the call to start")
        assert thread.overdue() is None  # not yet past its deadline
        queued = asyncio.ensure_future(thread(lambda: "answered", what="the next call"))
        await asyncio.sleep(0.3)
        assert not queued.done()  # one worker, one call at a time: it waits behind the hung one
        late = thread.overdue()
        assert late is not None and (late.what, late.gpu, late.deadline_s) == ("a hung call", 3, 0.2)
        assert late.describe().startswith("NVML call a hung call on GPU 3 unanswered for ")
        assert await asyncio.wait_for(queued, 2) == "answered"
        assert thread.overdue() is late and thread.overdue_calls == 1  # counted once
        assert workers("nvml-test-a") == 2
        release.set()
        assert await asyncio.wait_for(hung, 2) is True
        await wait_until(lambda: workers("nvml-test-a") == 1, 2, "the set-aside worker to end")
        assert thread.overdue() is None and thread.current is None
    finally:
        release.set()
        thread.close()


async def test_at_most_max_set_aside_workers_at_once() -> None:
    thread = NvmlThread("nvml-test-b", deadline_s=0.05)
    release = threading.Event()
    try:
        calls = []
        for n in range(MAX_SET_ASIDE + 2):
            calls.append(asyncio.ensure_future(thread(release.wait, what=f"call {n}")))
            await asyncio.sleep(0.1)
            thread.overdue()
        await asyncio.sleep(0.1)
        thread.overdue()
        # Every worker set aside, and the one serving the queue, hangs too: the driver itself is stuck.
        assert workers("nvml-test-b") == MAX_SET_ASIDE + 1
        assert thread.overdue_calls == MAX_SET_ASIDE + 1
        release.set()
        assert await asyncio.wait_for(asyncio.gather(*calls), 5) == [True] * (MAX_SET_ASIDE + 2)
        await wait_until(lambda: workers("nvml-test-b") == 1, 2, "the set-aside workers to end")
    finally:
        release.set()
        thread.close()


async def test_bounded_calls_give_up_waiting_and_never_ask_a_hung_gpu_twice() -> None:
    thread = NvmlThread("nvml-test-c", deadline_s=0.1)
    release = threading.Event()
    asked: list[int] = []

    def read(gpu: int) -> int:
        asked.append(gpu)
        if gpu == 3:
            release.wait()
        return gpu * 10

    bounded = BoundedCalls(thread, lambda: 0.2, thread.overdue)
    try:
        started = time.monotonic()
        with pytest.raises(NvmlStuck, match=r"^the sample did not return within 0.2s$"):
            await bounded(3, lambda: read(3), what="the sample", gpu=3)
        assert time.monotonic() - started < 1
        # The hung call's worker was set aside: the next GPU is read at once.
        assert await asyncio.wait_for(bounded(4, lambda: read(4), what="the sample", gpu=4), 1) == 40
        with pytest.raises(NvmlStuck, match=r"^the sample: the last call has not returned$"):
            await bounded(3, lambda: read(3), what="the sample", gpu=3)
        assert asked == [3, 4]
        release.set()
        await wait_until(lambda: not bounded.running(3), 2, "the hung call to return")
        assert await bounded(3, lambda: read(3), what="the sample", gpu=3) == 30
    finally:
        release.set()
        thread.close()
