"""The threads the running agent calls NVML on, and the watch kept on them.

NVML is thread-safe (its API reference: "it is safe to make simultaneous NVML calls from multiple threads"), but
a call can block for as long as the driver does: a GPU off the bus or a wedged driver holds a device call for
tens of seconds or for ever. So every call runs on a worker thread, never on the event loop:
`NvmlThread("nvml")` for the reads and changes, one call at a time, and a second `NvmlThread("nvml-events")`
for the blocking wait for XID events, so that neither holds up the other (an XID is taken while a device call
hangs, and a health sample never queues behind an event wait).

Each call has a deadline (`deadline_s`, set from the config); `overdue()` names the call that has run past it,
which the health monitor reports (the GPU it concerns Unhealthy, the node's condition `NvmlUnresponsive`). The
workers are daemon threads: a call that never returns cannot hold the process's exit, and stopping asks NVML only
what it still answers (`if_answering`).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class NvmlCall(Protocol):
    """How the agent's parts call NVML: an NvmlThread, or in tests anything that runs `fn` and takes the same
    keywords (what the call is, the GPU it concerns, its deadline)."""

    def __call__(self, fn: Callable[[], T], *, what: str | None = None, gpu: int | None = None,
                 deadline_s: float | None = None) -> Awaitable[T]: ...


READ_DEADLINE_S = 10.0
"""The default deadline of an NVML call (health.nvmlDeadlineSeconds)."""


class NvmlStuck(RuntimeError):
    """An NVML call has run past its deadline: NVML is not asked anything else that must end soon."""


@dataclass(frozen=True)
class Call:
    """One NVML call in flight: what it is, the GPU (by NVML index) it concerns if one, since when."""

    what: str
    gpu: int | None
    started: float
    """time.monotonic() when the worker started it."""
    deadline_s: float

    def waited(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started

    def describe(self, now: float | None = None) -> str:
        on = "" if self.gpu is None else f" on GPU {self.gpu}"
        return f"NVML call {self.what}{on} unanswered for {self.waited(now):.1f}s (deadline {self.deadline_s:g}s)"


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not future.done():
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


class NvmlThread:
    """One daemon worker thread that runs NVML calls one at a time, in order, each with a deadline."""

    def __init__(self, name: str = "nvml", deadline_s: float = READ_DEADLINE_S) -> None:
        self.name = name
        self.deadline_s = deadline_s
        """The deadline of a call that names none; the health monitor keeps it at health.nvmlDeadlineSeconds."""
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], str, int | None, float, asyncio.AbstractEventLoop,
                                             asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._current: Call | None = None
        self.overdue_calls = 0
        """Calls that ran past their deadline (counted once each, by `overdue`)."""
        self._counted: Call | None = None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def __call__(self, fn: Callable[[], T], *, what: str | None = None, gpu: int | None = None,
                       deadline_s: float | None = None) -> T:
        """Run `fn` on the worker and return what it returns (or raise what it raises). Cancelling the caller
        does not stop a call already running: its outcome is dropped."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        name = what or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        self._queue.put((fn, name, gpu, self.deadline_s if deadline_s is None else deadline_s, loop, future))
        return await future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, what, gpu, deadline_s, loop, future = item
            if future.cancelled():
                continue
            self._current = Call(what, gpu, time.monotonic(), deadline_s)
            try:
                ok, value = True, fn()
            except Exception as err:
                ok, value = False, err
            finally:
                self._current = None
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, ok, value)

    @property
    def current(self) -> Call | None:
        """The call running now, if one."""
        return self._current

    def overdue(self, now: float | None = None) -> Call | None:
        """The call running past its deadline, if one (counted in `overdue_calls` the first time it is seen)."""
        call = self._current
        if call is None or call.waited(now) <= call.deadline_s:
            return None
        if call is not self._counted:
            self._counted = call
            self.overdue_calls += 1
        return call

    async def if_answering(self, fn: Callable[[], T], timeout_s: float = 1.0) -> T:
        """`fn` on the worker, for a caller that must not wait on a stuck driver (stopping): NvmlStuck at once
        while a call is overdue, and after `timeout_s` when this one does not return."""
        stuck = self.overdue()
        if stuck is not None:
            raise NvmlStuck(stuck.describe())
        try:
            async with asyncio.timeout(timeout_s):
                return await self(fn)
        except TimeoutError:
            raise NvmlStuck(f"NVML did not answer within {timeout_s:g}s") from None

    def close(self) -> None:
        """Let the worker end once the calls queued before have run (at once when none is running)."""
        self._queue.put(None)
