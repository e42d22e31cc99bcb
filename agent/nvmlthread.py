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
from collections.abc import Awaitable, Callable, Hashable
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


MAX_SET_ASIDE = 4
"""Workers set aside at once at most: past that NVML itself is stuck, and more threads would only pile up."""


class NvmlThread:
    """A daemon worker thread that runs NVML calls one at a time, in order, each with a deadline.

    A worker whose call runs past its deadline is set aside by `overdue` (it ends once that call returns) and a
    new worker serves the calls queued behind it, so that one GPU that hangs holds up no call about another
    (NVML is thread-safe); at most MAX_SET_ASIDE workers are set aside at once."""

    def __init__(self, name: str = "nvml", deadline_s: float = READ_DEADLINE_S) -> None:
        self.name = name
        self.deadline_s = deadline_s
        """The deadline of a call that names none; the health monitor keeps it at health.nvmlDeadlineSeconds."""
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], str, int | None, float, asyncio.AbstractEventLoop,
                                             asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._calls: dict[int, Call] = {}
        """The call each worker runs now, by the worker's number."""
        self._aside: set[int] = set()
        """Workers whose call ran past its deadline: each ends once its call returns."""
        self._counted: set[int] = set()
        """Workers whose call now running has been counted as overdue."""
        self._workers = 0
        self.overdue_calls = 0
        """Calls that ran past their deadline (counted once each, by `overdue`)."""
        self._start_worker()

    def _start_worker(self) -> None:
        number = self._workers
        self._workers += 1
        name = self.name if number == 0 else f"{self.name}-{number}"
        threading.Thread(target=self._work, args=(number,), name=name, daemon=True).start()

    async def __call__(self, fn: Callable[[], T], *, what: str | None = None, gpu: int | None = None,
                       deadline_s: float | None = None) -> T:
        """Run `fn` on the worker and return what it returns (or raise what it raises). Cancelling the caller
        does not stop a call already running: its outcome is dropped."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        name = what or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        self._queue.put((fn, name, gpu, self.deadline_s if deadline_s is None else deadline_s, loop, future))
        return await future

    def _work(self, number: int) -> None:
        while (item := self._queue.get()) is not None:
            fn, what, gpu, deadline_s, loop, future = item
            if future.cancelled():
                continue
            with self._lock:
                self._calls[number] = Call(what, gpu, time.monotonic(), deadline_s)
            try:
                ok, value = True, fn()
            except Exception as err:
                ok, value = False, err
            finally:
                with self._lock:
                    del self._calls[number]
                    self._counted.discard(number)
                    set_aside = number in self._aside
                    self._aside.discard(number)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, ok, value)
            if set_aside:
                return  # another worker serves the queue now

    @property
    def current(self) -> Call | None:
        """The oldest call running now, if one."""
        with self._lock:
            return min(self._calls.values(), key=lambda call: call.started, default=None)

    def overdue(self, now: float | None = None) -> Call | None:
        """The oldest call running past its deadline, if one (see `late`)."""
        late = self.late(now)
        return late[0] if late else None

    def late(self, now: float | None = None) -> list[Call]:
        """The calls running past their deadline, oldest first. Each is counted in `overdue_calls`, and its
        worker set aside with a new one started for the queue, the first time it is seen."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = sorted((call.started, number, call) for number, call in self._calls.items()
                          if call.waited(now) > call.deadline_s)
            for _, number, _ in late:
                if number not in self._counted:
                    self._counted.add(number)
                    self.overdue_calls += 1
                if number not in self._aside and len(self._aside) < MAX_SET_ASIDE:
                    self._aside.add(number)
                    self._start_worker()
            return [call for _, _, call in late]

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
        """Let the serving worker end once the calls queued before have run (at once when none is running); a
        worker set aside ends when its call returns."""
        self._queue.put(None)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Take the outcome of a call nobody waits for any more."""
    if not future.cancelled():
        future.exception()


class BoundedCalls:
    """The calls of a loop that must go on past one GPU that hangs (a health sample, a telemetry pass): each is
    waited for at most `wait_s()`; one that has not returned by then raises NvmlStuck and is left to run, and
    the next call with its key raises NvmlStuck at once until it has returned, so a hung GPU is never asked
    twice."""

    def __init__(self, nvml: NvmlCall, wait_s: Callable[[], float], late: Callable[[], object] = lambda: None) -> None:
        self._nvml = nvml
        self._wait_s = wait_s
        self._late = late
        """Called when a call is not waited for any longer: NvmlThread.overdue sets its worker aside, so that the
        next call does not queue behind it."""
        self._running: dict[Hashable, asyncio.Future[Any]] = {}

    def running(self, key: Hashable) -> bool:
        """Whether the call of `key` has not returned since it ran past its wait."""
        future = self._running.get(key)
        return future is not None and not future.done()

    async def __call__(self, key: Hashable, fn: Callable[[], T], *, what: str, gpu: int | None = None) -> T:
        if self.running(key):
            raise NvmlStuck(f"{what}: the last call has not returned")
        self._running.pop(key, None)
        future: asyncio.Future[T] = asyncio.ensure_future(self._nvml(fn, what=what, gpu=gpu))
        future.add_done_callback(_retrieve)
        wait_s = self._wait_s()
        done, _ = await asyncio.wait({future}, timeout=wait_s)
        if not done:
            self._running[key] = future
            self._late()
            raise NvmlStuck(f"{what} did not return within {wait_s:g}s")
        return future.result()
