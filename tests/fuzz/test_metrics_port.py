"""The metrics port against clients that connect and then dawdle: slow request lines and headers, answers never
read, and floods of connections that send nothing. The figures asserted are the documented ones
(docs/operations.md, "Metrics, alerts and the dashboard"): at most 64 connections held, a request read within 5 s
of its connection, an answer taken within 10 s. What the server holds is counted from outside the code under test:
the process's open descriptors (/proc/self/fd) less the client sockets the test holds, and what each client sees
(an answer, or its connection closed)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress

from agent.metrics import HttpEndpoint, Metrics

CAP = 64
"""The most connections the endpoint holds at once (docs/operations.md)."""
REQUEST_S = 5.0
"""The time a client has, from its connect, to send its request line and headers."""
WRITE_S = 10.0
"""The time a client has to take its answer."""
SLACK_S = 3.0
"""Scheduling on a busy 2-core machine."""
MIB = 1024 * 1024
ESTABLISHED, SYN_SENT, CLOSE = 1, 2, 7
"""TCP states (include/net/tcp_states.h)."""
PROBER = r"""
import select, socket, sys, time
port = int(sys.argv[1])
while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes our stdin
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.34\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    except OSError as err:
        answer = repr(err).encode()
    print(started, time.monotonic() - started, repr(answer), flush=True)
    time.sleep(0.2)
"""
"""A kubelet's liveness probe, in a process of its own: GET /healthz, the request sent as the connection opens,
every 0.2 s (the kubelet: every 10 s), each line "<start> <seconds taken> <answer>"."""


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def alive(sock: socket.socket) -> bool:
    """The connection is open as the client sees it (TCP_INFO's state): connected or still connecting, neither
    closed by the server (FIN: CLOSE_WAIT) nor reset (CLOSE)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in (ESTABLISHED, SYN_SENT)


@asynccontextmanager
async def endpoint(metrics: Metrics | None = None, ready: str = "ok") -> AsyncIterator[HttpEndpoint]:
    http = HttpEndpoint(metrics or Metrics(), lambda: (True, ready))
    await http.start(0, "127.0.0.1")
    try:
        yield http
    finally:
        await http.stop()


@contextmanager
def held(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


async def get(port: int, path: str, within: float) -> bytes:
    """GET a path as a kubelet probe does (the request sent as the connection opens); the answer, or a
    TimeoutError after `within` seconds."""
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", port), timeout=within) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.34\r\n\r\n".encode())
        sock.setblocking(False)
        answer = b""
        async with asyncio.timeout(within):
            while chunk := await loop.sock_recv(sock, 65536):
                answer += chunk
        return answer


async def test_a_client_sending_a_header_line_a_second_is_closed_within_the_request_deadline() -> None:
    async with endpoint() as http:
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        started = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.0\r\n")

        async def trickle() -> None:
            for n in range(600):  # ten minutes of headers, one a second
                await asyncio.sleep(1)
                writer.write(b"X-Slow-%d: yes\r\n" % n)

        sender = asyncio.create_task(trickle())
        try:
            try:
                answer = await asyncio.wait_for(reader.read(), REQUEST_S + SLACK_S)
            except ConnectionResetError:
                answer = b""
            closed_after = time.monotonic() - started
        finally:
            sender.cancel()
            writer.close()
        assert answer == b"", answer
        assert REQUEST_S - 0.5 <= closed_after <= REQUEST_S + SLACK_S, closed_after


async def test_a_request_sent_slowly_but_within_the_deadline_is_answered() -> None:
    async with endpoint() as http:
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        for line in (b"GET /healthz HTTP/1.0\r\n", b"Host: x\r\n", b"Accept: */*\r\n", b"X-Slow: yes\r\n"):
            writer.write(line)
            await asyncio.sleep(1)
        writer.write(b"\r\n")
        answer = await asyncio.wait_for(reader.read(), SLACK_S)
        writer.close()
        assert answer.startswith(b"HTTP/1.0 200 OK\r\n") and answer.endswith(b"\r\n\r\nok\n"), answer


async def test_healthz_answers_while_the_cap_is_full_of_slow_clients_and_the_server_holds_no_more() -> None:
    """Three kinds of slow client, twice the cap in all: one that sends nothing, one that sends a header every
    half second, one that asks for a large /metrics and never reads it."""
    metrics = Metrics()
    metrics.serve_also(lambda: b"#" * 256 * 1024)
    async with endpoint(metrics) as http:
        base = descriptors()
        with held([]) as clients:
            most = 0

            async def trickle() -> None:
                while True:
                    await asyncio.sleep(0.5)
                    for sock in clients[1::3]:
                        with suppress(OSError):
                            sock.send(b"X-Slow: yes\r\n")

            sender = asyncio.create_task(trickle())
            try:
                for n in range(2 * CAP):
                    sock = socket.create_connection(("127.0.0.1", http.port), timeout=5)
                    sock.setblocking(False)
                    if n % 3 == 1:
                        sock.send(b"GET /healthz HTTP/1.0\r\n")
                    elif n % 3 == 2:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                        sock.send(b"GET /metrics HTTP/1.0\r\n\r\n")
                    clients.append(sock)
                    for _ in range(3):
                        await asyncio.sleep(0)
                        most = max(most, descriptors() - base - len(clients))
                started = time.monotonic()
                answer = await get(http.port, "/healthz", 2 * REQUEST_S)
                waited = time.monotonic() - started
                most = max(most, descriptors() - base - len(clients))
                open_at_client = sum(alive(sock) for sock in clients)
            finally:
                sender.cancel()
        assert answer.startswith(b"HTTP/1.0 200 OK\r\n") and answer.endswith(b"\r\n\r\nok\n")
        assert waited <= 2 * REQUEST_S
        assert most <= CAP, f"the server held {most} connections"
        assert open_at_client <= CAP, f"{open_at_client} of {2 * CAP} slow clients still connected"


async def test_ten_thousand_silent_connections_cost_little_memory_and_healthz_still_answers() -> None:
    """10,000 connections that send nothing, opened as fast as this process can while a probe in another
    process asks for /healthz every 0.2 s; the client sockets are plain sockets (kernel memory, no asyncio
    transport), so the RSS growth is the server's."""
    async with endpoint() as http:
        address = ("127.0.0.1", http.port)
        prober = await asyncio.create_subprocess_exec(sys.executable, "-c", PROBER, str(http.port),
                                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert prober.stdin is not None and prober.stdout is not None
        try:
            lines = [await asyncio.wait_for(prober.stdout.readline(), 30)]  # it runs
            base = descriptors()
            rss_before = rss_bytes()
            with held([]) as clients:
                most = 0
                flood_from = time.monotonic()
                for n in range(10_000):
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    clients.append(sock)
                    sock.setblocking(False)
                    sock.connect_ex(address)
                    if n % 50 == 49:
                        await asyncio.sleep(0)
                    if n % 500 == 499:
                        most = max(most, descriptors() - base - len(clients))
                deadline = time.monotonic() + 15
                while (still := sum(alive(sock) for sock in clients)) > CAP and time.monotonic() < deadline:
                    most = max(most, descriptors() - base - len(clients))
                    await asyncio.sleep(0.2)
                flood_to = time.monotonic()
                growth = rss_bytes() - rss_before
                most = max(most, descriptors() - base - len(clients))
                await asyncio.sleep(0.5)  # a probe or two more, with the 10,000 connected
            prober.stdin.close()
            async with asyncio.timeout(10):
                lines += [line async for line in prober.stdout]
        finally:
            if prober.returncode is None:
                prober.kill()
            await prober.wait()
        probes = [(float(started), float(took), answer) for started, took, answer in
                  (line.decode().split(" ", 2) for line in lines)]
        assert most <= CAP, f"the server held {most} connections"
        assert still <= CAP, f"{still} of 10,000 silent clients still connected"
        assert growth < 20 * MIB, f"RSS grew {growth / MIB:.1f} MiB"
        assert any(flood_from <= started <= flood_to for started, _, _ in probes), (flood_from, flood_to, probes)
        for started, took, answer in probes:
            assert answer.startswith("b'HTTP/1.0 200 OK\\r\\n") and answer.rstrip().endswith("\\r\\nok\\n'"), \
                (started - flood_from, answer)
            assert took <= 1.0, (started - flood_from, took)


async def test_clients_that_never_read_their_answers_are_reset_at_the_write_deadline() -> None:
    """Two clients ask and never read: one for an answer larger than the kernel buffers of both ends take (8 MiB
    of /metrics), one for an answer the kernel takes whole (200 KB of /readyz), which would otherwise stay queued
    in the kernel, behind the server's FIN, for as long as the client keeps its window shut."""
    metrics = Metrics()
    metrics.serve_also(lambda: b"#" * 8 * MIB)
    async with endpoint(metrics, ready="x" * 200_000) as http:
        base = descriptors()
        with held([]) as clients:
            for path in ("/metrics", "/readyz"):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                clients.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", http.port))
                sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            started = time.monotonic()
            await asyncio.sleep(1)
            server_side_at_1s = descriptors() - base - len(clients)
            while time.monotonic() - started < WRITE_S + SLACK_S:
                await asyncio.sleep(0.2)
                server_side = descriptors() - base - len(clients)
                if not server_side and not any(alive(sock) for sock in clients):
                    break
            cut_after = time.monotonic() - started
            states = [sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] for sock in clients]
            got = []
            for sock in clients:
                sock.setblocking(False)
                got.append(0)
                try:
                    while chunk := sock.recv(MIB):
                        got[-1] += len(chunk)
                except (BlockingIOError, ConnectionResetError):
                    pass
        assert server_side_at_1s == 2, "the server let go of a client that has not taken its answer"
        assert server_side == 0, "the server still holds a client that does not read"
        assert states == [CLOSE, CLOSE], f"TCP states {states}: not reset"
        assert WRITE_S - 0.5 <= cut_after <= WRITE_S + SLACK_S, cut_after
        assert got[0] < 8 * MIB and got[1] < 200_000, got
