"""A gRPC server for one service, driven straight from grpc's core completion queue.

grpcio's own synchronous server hands every call between its polling thread and a worker thread several times
(12-16 thread wake-ups per unary call). This one answers a unary call on its polling thread, in three completion
events (the call, its request message, its answer sent) and no hand-off. The agent's CPU per Allocate went from
0.674 ms (a full make bench at 29a08b6, grpcio's synchronous server) to 0.186 ms (at e2ab5b0, this server).
Server-streaming calls (ListAndWatch) run on a fixed set of threads, one per open stream, each message sent
before the next is made.

It is written on grpcio's Cython layer (`grpc._cython.cygrpc`), the layer grpcio's own servers are written on.
That layer is not a public API, so pyproject.toml pins grpcio to one minor version, and
tests/unit/test_coreserver.py drives every path here over real sockets.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

cygrpc: Any = importlib.import_module("grpc._cython.cygrpc")

log = logging.getLogger(__name__)

_FLAGS = 0
_SHUTDOWN = object()
"""Tag of the server's shutdown notification: every call has ended."""
_REQUEST = object()
"""Tag of the one outstanding request for a new call."""


class Aborted(Exception):
    """Raised by CallContext.abort: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class CallContext:
    """What a handler may do with its call: end it with a status, or be told when it ends."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] | None = []

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Call `callback` once the call has ended (answered, or the client went away); False when it already
        has."""
        if self._callbacks is None:
            return False
        self._callbacks.append(callback)
        return True

    def _ended(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback()


@dataclass(frozen=True)
class Method:
    """One method of the service: its handler, how its request is parsed, and whether it streams answers."""

    handler: Callable[[Any, CallContext], Any]
    parse: Callable[[bytes], Any]
    streams: bool = False


def _code(code: grpc.StatusCode) -> int:
    return int(code.value[0])


def _initial() -> Any:
    return cygrpc.SendInitialMetadataOperation(None, _FLAGS)


def _status(code: int, details: str) -> Any:
    return cygrpc.SendStatusFromServerOperation(None, code, details.encode(), _FLAGS)


def _close() -> Any:
    return cygrpc.ReceiveCloseOnServerOperation(_FLAGS)


def _failure(err: Exception, method: str) -> tuple[int, str]:
    """The status a handler's exception ends its call with: its own for an abort, UNKNOWN for anything else."""
    if isinstance(err, Aborted):
        return _code(err.code), err.details
    log.error("%s failed: %r", method, err)
    return _code(grpc.StatusCode.UNKNOWN), f"{method} failed in the agent: {err!r}"


class _Call:
    """One call from its request to its end; each of its batches is tagged with one of its bound methods."""

    def __init__(self, server: CoreServer, call: Any, name: str, method: Method | None) -> None:
        self.server = server
        self.call = call
        self.name = name
        self.method = method
        self.context = CallContext()
        self.sent = threading.Event() if method is not None and method.streams else None
        """Set when a stream's send is done; a unary call sends once and waits for nothing, so it has none."""
        self.sent_ok = False

    def start(self) -> None:
        """Ask for the request message; a stream also asks to hear when the client leaves."""
        if self.method is None:
            self._end(_code(grpc.StatusCode.UNIMPLEMENTED), f"unknown method {self.name}")
        else:
            if self.method.streams:
                self._batch((_close(),), self._closed)
            self._batch((cygrpc.ReceiveMessageOperation(_FLAGS),), self._received)

    def _batch(self, operations: tuple[Any, ...], tag: Callable[[Any], None]) -> bool:
        """Start a batch whose completion calls `tag`; False when the call takes no more (it has ended)."""
        return self.server._start(self.call, operations, tag)

    def _received(self, event: Any) -> None:
        assert self.method is not None
        data = event.batch_operations[0].message() if event.success else None
        try:
            if data is None:
                raise Aborted(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: no request message")
            try:
                request = self.method.parse(data)
            except Exception:  # protobuf's DecodeError, or whatever else a malformed message raises
                raise Aborted(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: the request does not parse") from None
            if self.method.streams:
                self.server._submit(lambda: self._stream(request))
                return
            answer = self.method.handler(request, self.context).SerializeToString()
        except Exception as err:
            if self.method.streams:
                self._send_status(*_failure(err, self.name), initial=True)
            else:
                self._end(*_failure(err, self.name))
            return
        self._batch((_initial(), cygrpc.SendMessageOperation(answer, _FLAGS), _status(0, ""), _close()), self._closed)

    def _end(self, code: int, details: str) -> None:
        """End a unary call with a status and no message."""
        self._batch((_initial(), _status(code, details), _close()), self._closed)

    def _closed(self, event: Any) -> None:
        """The call has ended: answered, or cancelled by the client or by the server's stop."""
        self.context._ended()

    def _on_sent(self, event: Any) -> None:
        assert self.sent is not None
        self.sent_ok = bool(event.success)
        self.sent.set()

    def _status_sent(self, event: Any) -> None:
        """A stream's status is the last thing it sends: nothing waits for it."""

    def _send(self, operations: tuple[Any, ...]) -> bool:
        """Start one send and wait until it is done (on a stream thread); False when the call is over."""
        assert self.sent is not None
        self.sent.clear()
        if not self._batch(operations, self._on_sent):
            return False
        self.sent.wait()
        return self.sent_ok

    def _send_status(self, code: int, details: str, initial: bool) -> None:
        self._batch(((_initial(),) if initial else ()) + (_status(code, details),), self._status_sent)

    def _stream(self, request: Any) -> None:
        """A server-streaming call, on a stream thread."""
        assert self.method is not None
        first = True
        answers: Iterable[Any] = ()
        try:
            answers = self.method.handler(request, self.context)
            for answer in answers:
                operations = (cygrpc.SendMessageOperation(answer.SerializeToString(), _FLAGS),)
                if not self._send((_initial(), *operations) if first else operations):
                    return  # the client went away, or the server is stopping
                first = False
        except Exception as err:
            self._send_status(*_failure(err, self.name), initial=first)
        else:
            self._send_status(0, "", initial=first)
        finally:
            close = getattr(answers, "close", None)
            if close is not None:
                close()  # a generator left early runs its cleanup now, on this thread


class StreamThreads:
    """A fixed set of threads, all started up front, for a server's streaming calls; a call beyond them waits
    for a free one. The count stays the same while the server serves (no call starts a thread), and each thread
    ends after shutdown(), so servers replaced after kubelet restarts leave no thread behind."""

    def __init__(self, count: int, name: str) -> None:
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        self._work.put(work)

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            try:
                work()
            except Exception as err:  # the thread stays for the next stream
                log.error("a stream ended with an error: %r", err)

    def shutdown(self) -> None:
        """Each thread ends after the work submitted before this call."""
        for _ in self.threads:
            self._work.put(None)

    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)


class CoreServer:
    """One service on one address: unary calls answered on the polling thread, streams on `stream_threads`."""

    def __init__(self, methods: dict[str, Method], name: str, stream_threads: int) -> None:
        self._methods = {path.encode(): (path, method) for path, method in methods.items()}
        self._queue = cygrpc.CompletionQueue()
        self._server = cygrpc.Server((), False)
        self._server.register_completion_queue(self._queue)
        self._lock = threading.Lock()
        self._stopping = False
        self._shut = False
        """The server has said every call ended; the queue is shut once nothing of ours is left in flight."""
        self._destroyed = False
        self._active = 0
        """Batches started and not yet completed, the outstanding request for a call, and running streams: the
        queue may only shut down at zero, since a batch started after that would abort the process."""
        self.streams = StreamThreads(stream_threads, f"{name}-stream")
        self._poller = threading.Thread(target=self._poll, name=f"{name}-poll", daemon=True)
        self.stopped = threading.Event()
        """Set once every call has ended and the polling thread is done."""

    def add_port(self, address: str) -> bool:
        """Listen on `address` (e.g. unix:///path); False when it cannot be bound."""
        try:
            return bool(self._server.add_http2_port(address.encode()))
        except RuntimeError:  # grpc reports a failed bind this way in some versions
            return False

    def discard(self) -> None:
        """Free a server that was never started (its port could not be bound)."""
        self.streams.shutdown()
        self._server.destroy()

    def start(self) -> None:
        self._server.start()
        self._settle(+1)
        self._server.request_call(self._queue, self._queue, _REQUEST)
        self._poller.start()

    def _settle(self, change: int) -> None:
        with self._lock:
            self._active += change
            if self._shut and self._active == 0:
                self._shut = False
                self._destroyed = True
                self._server.destroy()  # grpcio frees the core server only here, never when collected
                self._queue.shutdown()

    def _start(self, call: Any, operations: tuple[Any, ...], tag: Callable[[Any], None]) -> bool:
        self._settle(+1)
        if call.start_server_batch(operations, tag) == 0:  # GRPC_CALL_OK
            return True
        self._settle(-1)
        return False

    def _submit(self, stream: Callable[[], None]) -> None:
        def run() -> None:
            try:
                stream()
            finally:
                self._settle(-1)

        self._settle(+1)
        self.streams.submit(run)

    def _poll(self) -> None:
        try:
            while True:
                event = self._queue.poll()
                kind = event.completion_type
                if kind == cygrpc.CompletionType.queue_shutdown:
                    return
                if kind != cygrpc.CompletionType.queue_timeout:
                    self._dispatch(event)
                event = None  # drop the call's references before the next wait
        finally:
            self.streams.shutdown()
            self.stopped.set()

    def _dispatch(self, event: Any) -> None:
        tag = event.tag
        if tag is _SHUTDOWN:
            with self._lock:
                self._shut = True
            self._settle(0)
            return
        try:
            if tag is _REQUEST:
                if event.success:  # it fails when the server is shutting down
                    with self._lock:
                        if not self._stopping:
                            self._active += 1
                            self._server.request_call(self._queue, self._queue, _REQUEST)
                    path = event.call_details.method
                    found = self._methods.get(path)
                    name = found[0] if found else path.decode(errors="replace")
                    _Call(self, event.call, name, found[1] if found else None).start()
            else:
                tag(event)
        except Exception as err:  # never leave the polling thread: the server would stop answering
            log.error("gRPC server: an event failed: %r", err)
        finally:
            self._settle(-1)

    def stop(self) -> None:
        """Take no new calls; calls in flight go on until they finish or cancel() ends them."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._server.shutdown(self._queue, _SHUTDOWN)

    def cancel(self) -> None:
        """End every call still in flight (after stop())."""
        with self._lock:  # never at the same time as destroy(): the core server would be freed under it
            if not self._destroyed:
                self._server.cancel_all_calls()
