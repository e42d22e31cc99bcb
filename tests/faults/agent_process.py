"""Helpers for the tests that run `gpu-agent run` as a process: a free loopback port, one HTTP GET on it, and the
lines of a stream."""

from __future__ import annotations

import asyncio
import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def http_get(port: int, path: str) -> tuple[int, str] | None:
    """One HTTP/1.0 GET on loopback; None while nothing listens yet, and where the agent's process exited in the
    middle of the request (the connection reset: no answer)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        return None
    finally:
        writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def collect_lines(stream: asyncio.StreamReader, lines: list[str]) -> None:
    while line := await stream.readline():
        lines.append(line.decode().rstrip("\n"))
