"""Logging that never blocks whoever logs: each record is formatted where it is logged and put, without waiting,
on a bounded queue that one daemon thread writes to stderr. A reader of stderr that stops reading (a container
runtime's log pipe on a slow or full disk) then stalls only that thread: the event loop goes on serving, and
records that find the queue full are dropped and counted. The next line written says how many were lost."""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import queue
import sys
import threading
from typing import TextIO

CAPACITY = 4096
"""Lines waiting for the writer at most; a record logged while the queue is full is dropped."""
FLUSH_S = 1.0
"""How long a flush waits for the queued lines to be written (a stalled reader must not hold the exit)."""

STALLED_S = 0.1
"""How long a flush waits for the writer to move when the last flush gave up on it."""

_STOP = (-1, None)

log = logging.getLogger(__name__)


class LogSink(logging.handlers.QueueHandler):
    """A handler whose emit never waits: the formatted line goes on a bounded queue (dropped and counted when it
    is full), and a daemon thread writes the queue to `stream` in order."""

    def __init__(self, stream: TextIO, capacity: int = CAPACITY) -> None:
        self._lines: queue.Queue[tuple[int, str | None]] = queue.Queue(capacity)
        """(records dropped just before this line, the line or None for the count alone)."""
        super().__init__(self._lines)
        self.dropped = 0
        """Records dropped since the start because the queue was full."""
        self._unreported = 0
        self._closed = False
        self._written = 0
        """Queue items the writer has finished with."""
        self._stalled_at = -1
        """`_written` when a drain last gave up: a later drain waits long only if the writer moves."""
        self._stream = stream
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._fd: int | None
        try:
            stream.flush()
            self._fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None  # a stream without a descriptor (an in-memory capture): written through its methods
        threading.Thread(target=self._write_all, name="log-writer", daemon=True).start()

    def enqueue(self, record: logging.LogRecord) -> None:
        # QueueHandler.prepare has put the line, formatted by this handler's formatter, in record.msg.
        self._put(str(record.msg))

    def write(self, line: str) -> None:
        """Queue a line as it is, after everything logged before it (a command's error line)."""
        self.acquire()
        try:
            self._put(line)
        finally:
            self.release()

    def _put(self, line: str | None) -> None:
        """Called with the handler's lock held (Handler.handle takes it), so the counts need no lock of their own."""
        if self._closed:
            return
        try:
            self._lines.put_nowait((self._unreported, line))
        except queue.Full:
            if line is not None:
                self.dropped += 1
                self._unreported += 1
        else:
            self._unreported = 0

    def drain(self, timeout: float = FLUSH_S) -> bool:
        """Wait, at most `timeout` seconds, until every line queued so far (and the count of lines dropped since
        the last one) is written; False when the writer could not get them out in time."""
        self.acquire()
        try:
            if self._unreported:
                self._put(None)
        finally:
            self.release()
        done = self._lines.all_tasks_done
        with done:
            stalled = self._stalled_at
            if stalled == self._written and not done.wait_for(
                    lambda: self._written != stalled or not self._lines.unfinished_tasks, STALLED_S):
                return False  # still stuck where the last drain gave up: no second long wait (exit flushes twice)
            if done.wait_for(lambda: not self._lines.unfinished_tasks, timeout):
                return True
            self._stalled_at = self._written
            return False

    def flush(self) -> None:
        self.drain()

    def close(self) -> None:
        """Stop the writer after what is queued, without waiting for it (flush waits); later records are
        dropped."""
        self.acquire()
        try:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(queue.Full):
                    self._lines.put_nowait(_STOP)
        finally:
            self.release()
        super().close()

    def _write_all(self) -> None:
        while True:
            item = self._lines.get()
            try:
                if item == _STOP:
                    return
                dropped, line = item
                if dropped:
                    self._write(self.format(logging.LogRecord(
                        log.name, logging.WARNING, __file__, 0, "%d log line(s) dropped: stderr was not being read",
                        (dropped,), None)))
                if line is not None:
                    self._write(line)
            except (OSError, ValueError):
                pass  # the reader went away, or the stream was closed: nothing can be told
            finally:
                with self._lines.all_tasks_done:
                    self._written += 1
                self._lines.task_done()

    def _write(self, line: str) -> None:
        if self._fd is None:
            self._stream.write(line + "\n")
            self._stream.flush()
            return
        # Straight to the descriptor, not through the stream's buffer: a write that waits on a stalled reader
        # then holds no lock of the stream, which the interpreter's exit and print() would wait for.
        data = memoryview((line + "\n").encode(self._encoding, "backslashreplace"))
        while data:
            data = data[os.write(self._fd, data):]


def install(formatter: logging.Formatter, level: int) -> None:
    """Make a LogSink on stderr, with `formatter`, the root logger's only handler (closing a LogSink it had)."""
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, LogSink):
            old.flush()
            old.close()
    sink = LogSink(sys.stderr)
    sink.setFormatter(formatter)
    root.handlers[:] = [sink]
    root.setLevel(level)


def sinks() -> list[LogSink]:
    return [h for h in logging.getLogger().handlers if isinstance(h, LogSink)]


def flush() -> None:
    """Wait, boundedly, until what was logged so far is written."""
    for sink in sinks():
        sink.flush()


def stderr_line(line: str) -> None:
    """Write a line on stderr after everything logged before it: through the log's writer when there is one
    (a stalled reader then loses it rather than holding the process), else directly."""
    installed = sinks()
    if not installed:
        print(line, file=sys.stderr, flush=True)
        return
    installed[0].write(line)
    installed[0].flush()
