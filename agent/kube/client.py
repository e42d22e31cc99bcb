"""The agent's one connection to the API server: every request of the Node client and the DRA slice publisher
goes through one `ApiClient` (aiohttp), with one client-side rate limit (a token bucket, as client-go's),
`Retry-After` read from overloaded answers, and counts of what it sent (agent/kube/usage.py) for /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from agent.kube.credentials import Credentials
from agent.kube.usage import MESSAGE_MAX, ApiCounts, ApiError

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
MAX_LINE = 16 * 1024 * 1024
"""A watch event is one line; a Node with many images in its status is large."""
DEFAULT_QPS = 5.0
DEFAULT_BURST = 10
"""client-go's defaults (QPS 5, burst 10): a node agent needs a few requests a minute at most."""
RETRY_AFTER_MAX_S = 300.0
"""The longest Retry-After honoured; a larger one is read as this."""


def _retry_after(value: str | None) -> float | None:
    """A Retry-After of seconds (the API server sends whole seconds); None when absent or not a number."""
    if value is None or not value.strip().isdigit():
        return None
    return min(float(value.strip()), RETRY_AFTER_MAX_S)


def api_error(status: int, payload: bytes, retry_after: str | None = None) -> ApiError:
    """The error an answer `payload` (a Status object, or anything else) with `status` stands for."""
    try:
        detail = json.loads(payload)
        if not isinstance(detail, dict):
            raise ValueError("not a Status")
        return ApiError(status, str(detail.get("reason", "")), str(detail.get("message", "")),
                        _retry_after(retry_after))
    except ValueError:
        return ApiError(status, "", payload[:MESSAGE_MAX].decode(errors="replace"), _retry_after(retry_after))


class TokenBucket:
    """At most `burst` requests at once, refilled at `qps` a second; `take` waits for a token."""

    def __init__(self, qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST,
                 clock: Any = time.monotonic) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs qps > 0 and burst >= 1, got qps {qps}, burst {burst}")
        self.qps, self.burst = qps, burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now

    def take_now(self) -> bool:
        """Take a token if one is there, without waiting."""
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    async def take(self) -> float:
        """Wait for a token; returns how long it waited (0 when one was there)."""
        async with self._lock:  # in order of arrival
            self._refill()
            waited = 0.0
            if self._tokens < 1:
                waited = (1 - self._tokens) / self.qps
                await asyncio.sleep(waited)
                self._refill()
            self._tokens -= 1
            return waited


_RESOURCE = re.compile(r"^/(?:api/v1|apis/[^/]+/[^/]+)(?:/namespaces/[^/]+)?/(?P<resource>[^/?]+)"
                       r"(?:/(?P<name>[^/?]+)(?P<sub>/[^/?]+)?)?")


def resource_of(path: str) -> str:
    """The resource a request path is about, as the API server's metrics name it: "nodes", "nodes/status",
    "resourceslices", "events"; "version" for /version."""
    found = _RESOURCE.match(path)
    if found is None:
        return path.strip("/").split("?")[0] or "/"
    return found["resource"] + (found["sub"] or "")


class ApiClient:
    """Requests to the API server with the agent's credentials, one aiohttp session, one rate limit."""

    def __init__(self, credentials: Credentials, qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST,
                 start_jitter_s: float = 0.0, rng: random.Random | None = None,
                 since: float | None = None) -> None:
        """`start_jitter_s`: requests wait until a random moment within that many seconds of `since` (a
        time.monotonic(); default now), except those sent `urgent` and all of them once `start_now()` was
        called. 0: no wait."""
        self.credentials = credentials
        self.limit = TokenBucket(qps, burst)
        self._session: aiohttp.ClientSession | None = None
        self.counts = ApiCounts()
        self.opens_at = ((time.monotonic() if since is None else since)
                         + (rng or random.Random()).uniform(0.0, max(0.0, start_jitter_s)))
        """When requests may go (time.monotonic()); the start jitter's end."""
        self._started: asyncio.Event | None = None

    @property
    def server(self) -> str:
        return self.credentials.server

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.credentials.ssl, limit=8),
                read_bufsize=MAX_LINE // 2,  # a line may grow to twice this before aiohttp refuses it
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def start_now(self) -> None:
        """End the start jitter's wait: from now on requests go at once (a fault must reach the Node now)."""
        now = time.monotonic()
        if now < self.opens_at:
            log.info("API requests start now, %.1fs before the end of the start jitter", self.opens_at - now)
            self.opens_at = now
        if self._started is not None:
            self._started.set()

    async def _start_jitter(self) -> None:
        """Wait for the end of the start jitter (or for start_now)."""
        delay = self.opens_at - time.monotonic()
        if delay <= 0:
            return
        if self._started is None:
            self._started = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._started.wait()

    async def _throttle(self, urgent: bool = False) -> None:
        if not urgent:
            await self._start_jitter()
        waited = await self.limit.take()
        if waited:
            self.counts.throttled += 1
            self.counts.throttled_seconds += waited

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                      timeout: float = REQUEST_TIMEOUT_S, urgent: bool = False) -> Any:
        """One request; the decoded JSON answer (None for an empty one), or ApiError for an error status.
        `urgent`: sent without waiting for the start jitter (the rate limit still applies)."""
        headers = {"Accept": "application/json", **self.credentials.headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        await self._throttle(urgent)
        verb = _verb(method, path)
        code = "error"
        try:
            async with self._http().request(method, self.server + path, data=data, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                code = str(response.status)
                payload = await response.read()
                if response.status >= 400:
                    raise api_error(response.status, payload, response.headers.get("Retry-After"))
                return json.loads(payload) if payload else None
        finally:
            self.counts.requests[(verb, resource_of(path), code)] += 1

    async def watch_lines(self, path: str, server_timeout_s: float) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch (`path` with watch=true), decoded, until the server ends it."""
        headers = {"Accept": "application/json", **self.credentials.headers()}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=server_timeout_s + 30)
        await self._throttle()
        code = "error"
        try:
            async with self._http().get(self.server + path, headers=headers, timeout=timeout) as response:
                code = str(response.status)
                if response.status >= 400:
                    raise api_error(response.status, await response.read(), response.headers.get("Retry-After"))
                async for line in response.content:
                    if line.strip():
                        event = json.loads(line)
                        if isinstance(event, dict):
                            yield event
        finally:
            self.counts.requests[("watch", resource_of(path), code)] += 1


def _verb(method: str, path: str) -> str:
    """The verb as the API server's metrics name it: a GET of a collection is a LIST."""
    if method != "GET":
        return method.lower()
    found = _RESOURCE.match(path)
    return "list" if found is not None and found["name"] is None else "get"
