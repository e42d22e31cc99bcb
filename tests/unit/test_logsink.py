"""The log writer (agent/logsink.py): lines come out in order and in the format given, a reader that stops
reading costs dropped lines (counted, and said) but never a wait, and a flush gives up in bounded time."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest

from agent.cli import JsonFormatter
from agent.logsink import LogSink


@pytest.fixture
def pipe() -> Iterator[tuple[int, io.TextIOWrapper]]:
    """(read end, a text stream on the write end)."""
    read_end, write_end = os.pipe()
    stream = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    yield read_end, stream
    stream.close()
    os.close(read_end)


def logger_to(sink: LogSink, fmt: str = "%(levelname)s %(name)s: %(message)s") -> logging.Logger:
    sink.setFormatter(logging.Formatter(fmt))
    logger = logging.getLogger(f"test.logsink.{id(sink)}")
    logger.propagate = False
    logger.handlers[:] = [sink]
    logger.setLevel(logging.INFO)
    return logger


def fill(write_end: int) -> bytes:
    """Fill a pipe to the brim, so that the next write to it waits for a reader; return what was written."""
    flags = fcntl.fcntl(write_end, fcntl.F_GETFL)
    fcntl.fcntl(write_end, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    written = bytearray()
    try:
        while True:
            written += b"x" * os.write(write_end, b"x" * 4096)
    except BlockingIOError:
        pass
    finally:
        fcntl.fcntl(write_end, fcntl.F_SETFL, flags)
    return bytes(written)


def read_all(read_end: int, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += os.read(read_end, size - len(data))
    return bytes(data)


def test_lines_come_out_in_order_in_the_format_given(pipe: tuple[int, io.TextIOWrapper]) -> None:
    read_end, stream = pipe
    sink = LogSink(stream)
    log = logger_to(sink)
    log.info("first %d", 1)
    sink.write("gpu-agent run: error: a plain line")
    log.warning("third: %s", "ünïcode")
    assert sink.drain(5)
    expected = (f"INFO {log.name}: first 1\ngpu-agent run: error: a plain line\nWARNING {log.name}: third: ünïcode\n"
                .encode())
    assert read_all(read_end, len(expected)) == expected
    assert sink.dropped == 0


def test_json_lines_keep_the_exception(pipe: tuple[int, io.TextIOWrapper]) -> None:
    read_end, stream = pipe
    sink = LogSink(stream)
    log = logger_to(sink)
    sink.setFormatter(JsonFormatter())
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("task %s failed", "health")
    assert sink.drain(5)
    line = b""
    while not line.endswith(b"\n"):
        line += os.read(read_end, 65536)
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["msg"]) == ("error", log.name, "task health failed")
    assert entry["exc"].startswith("Traceback (most recent call last):\n")
    assert entry["exc"].endswith("\nValueError: boom")


def test_a_reader_that_stops_reading_costs_lines_not_waits(pipe: tuple[int, io.TextIOWrapper]) -> None:
    read_end, stream = pipe
    prefill = fill(stream.fileno())
    sink = LogSink(stream, capacity=3)
    log = logger_to(sink, "%(message)s")
    log.info("one")
    deadline = time.monotonic() + 5
    while not sink.queue.empty():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The writer now waits in its write of "one"; three lines fit in the queue, the other seven are dropped.
    started = time.monotonic()
    for i in range(2, 12):
        log.info("line %d", i)
    assert time.monotonic() - started < 0.5
    assert sink.dropped == 7
    assert not sink.drain(0.2)  # nobody reads: the flush gives up
    expected = b"one\nline 2\nline 3\nline 4\n7 log line(s) dropped: stderr was not being read\nline 12\n"
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(read_all(read_end, len(prefill) + len(expected))))
    reader.start()
    assert sink.drain(5)
    log.info("line 12")
    assert sink.drain(5)
    reader.join(5)
    assert got == [prefill + expected]
    assert sink.dropped == 7


def test_a_flush_on_a_stalled_reader_waits_once(pipe: tuple[int, io.TextIOWrapper]) -> None:
    _, stream = pipe
    fill(stream.fileno())
    sink = LogSink(stream)
    logger_to(sink).info("stuck")
    started = time.monotonic()
    assert not sink.drain(0.3)
    assert 0.3 <= time.monotonic() - started < 1
    # Nothing has moved since: a second flush (the interpreter's own at exit) waits only briefly.
    started = time.monotonic()
    assert not sink.drain(2)
    assert time.monotonic() - started < 1


def test_a_reader_that_went_away_costs_nothing() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", encoding="utf-8") as stream:
        sink = LogSink(stream)
        log = logger_to(sink)
        for i in range(100):
            log.info("line %d", i)
        assert sink.drain(5)  # every write failed with EPIPE and was let go
        assert sink.dropped == 0
        sink.close()


def test_a_stream_without_a_descriptor_is_written_through() -> None:
    stream = io.StringIO()
    sink = LogSink(stream)
    log = logger_to(sink)
    log.info("a")
    log.error("b")
    assert sink.drain(5)
    assert stream.getvalue() == f"INFO {log.name}: a\nERROR {log.name}: b\n"
