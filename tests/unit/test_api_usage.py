"""The retry discipline and rate limit every API server loop of the agent uses, with a fake clock: how long each
failure waits, what a Retry-After does, how a burst is paced; and the names requests are counted under."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest

from agent.kube.client import TokenBucket, api_error, resource_of
from agent.kube.client import _verb as verb
from agent.kube.usage import ApiError, Backoff, process_started


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def delays(backoff: Backoff, clock: Clock, errors: list[BaseException | None]) -> list[float]:
    out = []
    for err in errors:
        delay = backoff.next_delay(err)
        clock.now += delay
        out.append(round(delay, 3))
    return out


def test_the_first_failure_is_spread_over_twelve_seconds() -> None:
    """A fleet whose watches all broke at once (an API server restart) must not come back at once."""
    firsts = [Backoff(rng=random.Random(seed)).next_delay(ConnectionError()) for seed in range(200)]
    assert min(firsts) >= 1.0 and max(firsts) <= 13.0
    assert max(firsts) - min(firsts) >= 11.0  # spread over the whole range, not bunched


def test_failures_the_server_does_not_answer_wait_ten_to_thirteen_seconds() -> None:
    """Through an outage each agent asks about five times a minute, never more often than every 10 s, and is back
    at most 13 s after the server is; a fleet's retries, each at its own phase, come back spread over 10 s or
    more."""
    clock = Clock()
    backoff = Backoff(rng=random.Random(1), clock=clock)
    waited = delays(backoff, clock, [ConnectionError()] * 40)  # 40 refused connections: minutes of outage
    assert max(waited) <= 13.0 and min(waited[8:]) >= 10.0  # the cap is reached by the seventh, whatever the draws
    assert max(waited[8:]) - min(waited[8:]) >= 2.5  # jittered at the cap too, not in lockstep


def test_a_refusal_that_persists_is_asked_again_once_a_minute_after_two_minutes() -> None:
    """Missing RBAC on a whole fleet: each agent asks six times a minute for two minutes (a restart's 403s pass
    in seconds), then doubles to once a minute."""
    clock = Clock()
    backoff = Backoff(rng=random.Random(2), clock=clock)
    forbidden = ApiError(403, "Forbidden", "nodes is forbidden")
    waited = delays(backoff, clock, [forbidden] * 30)
    elapsed = 0.0
    for delay in waited:
        if elapsed < 120:
            assert delay <= 13.0
        elif elapsed >= 240:
            assert 60.0 <= delay <= 78.0
        elapsed += delay
    assert elapsed > 600  # the slow part was reached and checked


def test_retry_after_is_a_floor_and_success_starts_over() -> None:
    clock = Clock()
    backoff = Backoff(rng=random.Random(3), clock=clock)
    assert backoff.next_delay(ApiError(429, "TooManyRequests", "slow down", retry_after=40.0)) == 40.0
    assert backoff.next_delay(ApiError(503, "ServiceUnavailable", "starting", retry_after=1.0)) >= 10.0
    backoff.succeeded()
    assert 1.0 <= backoff.next_delay(ConnectionError()) <= 13.0


def test_an_answer_carries_its_retry_after_and_a_bounded_message() -> None:
    err = api_error(429, b'{"kind":"Status","reason":"TooManyRequests","message":"too many requests"}', "7")
    assert (err.status, err.reason, err.message, err.retry_after) == (429, "TooManyRequests", "too many requests",
                                                                      7.0)
    assert api_error(503, b"<html>", "soon").retry_after is None
    assert api_error(429, b"{}", "99999").retry_after == 300.0
    long = api_error(422, b'{"reason":"Invalid","message":"' + b"x" * 5000 + b'"}')
    assert str(long) == "422 Invalid: " + "x" * 300 + "... (5000 characters)"


async def test_a_burst_is_paced_to_the_rate() -> None:
    loop = asyncio.get_running_loop()
    bucket = TokenBucket(qps=50.0, burst=5)
    started = loop.time()
    waits = [await bucket.take() for _ in range(15)]
    elapsed = loop.time() - started
    assert waits[:5] == [0.0] * 5  # the burst
    assert all(w > 0 for w in waits[5:])
    assert elapsed == pytest.approx(10 / 50.0, abs=0.08)


def test_a_rate_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="qps > 0 and burst >= 1, got qps 0, burst 10"):
        TokenBucket(0, 10)


@pytest.mark.parametrize(("method", "path", "counted"), [
    ("GET", "/api/v1/nodes/gpu-node-1", ("get", "nodes")),
    ("GET", "/api/v1/nodes?watch=true&fieldSelector=metadata.name%3Dn", ("list", "nodes")),
    ("PATCH", "/api/v1/nodes/gpu-node-1/status", ("patch", "nodes/status")),
    ("POST", "/api/v1/namespaces/default/events", ("post", "events")),
    ("GET", "/api/v1/namespaces/gpu-node-agent/pods/agent-x", ("get", "pods")),
    ("GET", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn", ("list", "resourceslices")),
    ("PUT", "/apis/resource.k8s.io/v1/resourceslices/n-gpu", ("put", "resourceslices")),
    ("GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c", ("get", "resourceclaims")),
    ("GET", "/version", ("get", "version")),
])
def test_requests_are_counted_under_the_api_servers_names(method: str, path: str, counted: tuple[str, str]) -> None:
    assert (verb(method, path), resource_of(path)) == counted


def stat_line(started_ticks: int) -> str:
    """A /proc/<pid>/stat line (proc(5)) with this start time, and a command name with a space and a ')'."""
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "0", "0", "0", "0", "5", "3", "0", "0", "20", "0", "1",
              "0", str(started_ticks), "1000", "100"]
    return "4242 (gpu agent) x) " + " ".join(fields) + "\n"


def test_the_process_start_is_read_from_proc_stat_on_the_monotonic_clock(tmp_path: Path) -> None:
    """A process that started 5 s ago (in clock ticks since boot) started 5 s before now on time.monotonic()."""
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text(stat_line(round((time.clock_gettime(time.CLOCK_BOOTTIME) - 5.0) * hz)))
    assert time.monotonic() - process_started(stat) == pytest.approx(5.0, abs=2.0 / hz + 0.05)


def test_a_process_start_that_cannot_be_read_is_now(tmp_path: Path) -> None:
    before = time.monotonic()
    assert before <= process_started(tmp_path / "absent") <= time.monotonic()
    (tmp_path / "short").write_text("4242 (gpu-agent) S 1 1\n")
    assert before <= process_started(tmp_path / "short") <= time.monotonic()


def test_this_process_started_before_now() -> None:
    """Read from the real /proc/self/stat: the test process has been running for a while (its imports alone)."""
    assert 0.0 < time.monotonic() - process_started() < time.clock_gettime(time.CLOCK_BOOTTIME)
