"""What the agent's use of the API server comes to, and how its loops retry, without any HTTP client (the agent
without an API server, --no-kube and `simulate`, loads none): `ApiError`, the counts behind /metrics, and
`Backoff`.

A fleet of agents, one per GPU node, shares one control plane: what each agent sends is multiplied by the
number of nodes. `Backoff` is the retry discipline every loop that talks to the API server uses: exponential,
jittered, capped, and reset only after a success that lasted."""

from __future__ import annotations

import collections
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.yamlfile import read_text_file

MESSAGE_MAX = 300
"""An API server's error message is quoted up to this long (a 422 can list every invalid field)."""


class ApiError(RuntimeError):
    """The API server answered with an error status. `retry_after` is its Retry-After in seconds (429 and 503
    from API Priority and Fairness, or a server starting up), else None."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        text = message if len(message) <= MESSAGE_MAX else message[:MESSAGE_MAX] + f"... ({len(message)} characters)"
        super().__init__(f"{status} {reason}: {text}")
        self.status = status
        self.reason = reason
        self.message = text
        self.retry_after = retry_after


@dataclass
class ApiCounts:
    """What the agent's API use came to, for /metrics (ApiCollector)."""

    requests: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    """Requests sent, by (verb, resource, code); code "error" when no answer came."""
    throttled: int = 0
    """Requests that waited for the rate limit."""
    throttled_seconds: float = 0.0
    watch_restarts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    """Watches opened again, by (resource, why the last one ended): "timeout" (it lived), "expired" (410),
    "closed" (it ended early), "error"."""
    relists: collections.Counter[str] = field(default_factory=collections.Counter)
    """Lists made again because a watch could not resume (410 Gone), by resource."""
    events_dropped: int = 0
    """Events not recorded because of the Event rate limit."""



CAP_JITTER = 0.3
"""A wait at the cap is the cap times 1 to 1 + this."""


START_JITTER_S = 12.0
"""`gpu-agent run`'s default: an agent's first request to the API server goes at a random moment within this
many seconds of its process's start (`process_started`), so that a fleet started at once (a rollout with
maxUnavailable 100%, nodes booted together) reaches the API server spread over this long, as after an API server
restart (Backoff's first retry). Counted from the process's start, not from when the client was made, so that a
slow start (a busy node) is not added to the jitter: an agent is never later than its start plus this."""


PROC_STAT_MAX_BYTES = 4096
"""The most read of /proc/<pid>/stat: one line of 52 numbers and a command name of at most 64 bytes, under
1.5 KiB; a larger file is not the kernel's, and is not read."""


def process_started(stat: Path = Path("/proc/self/stat")) -> float:
    """When this process started, on time.monotonic()'s clock: from the start time in `stat` (clock ticks since
    boot, suspend included), or now where that cannot be read."""
    now = time.monotonic()
    try:
        # The fields after "pid (comm)": the state is the first, the start time the 20th.
        ticks = int(read_text_file(stat, PROC_STAT_MAX_BYTES).rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # InputFileError is a ValueError
        return now
    return now - min(max(0.0, age), now)


class Backoff:
    """Exponential backoff with jitter for a loop that talks to the API server.

    The first failure of an episode waits a random time in [first_min, first_max], so that a fleet whose
    connections all broke at once (an API server restart) comes back spread out; each further failure waits
    twice as long (times a jitter of 0.75 to 1.25) up to a cap, and at the cap a random time in
    [cap, (1 + CAP_JITTER) * cap]: `cap` while the server does not answer (a refused connection costs it
    nothing, and a fleet must be back soon after it is) or for the first
    `patient_s` of an episode, then `answered_cap` for failures the server answered (a refusal that persists,
    such as missing RBAC, is asked again once a minute, not six times). A Retry-After is a floor.
    `succeeded()` ends the episode; a caller calls it only after what counts as a lasting success."""

    def __init__(self, first_min: float = 1.0, first_max: float = 13.0, cap: float = 10.0,
                 answered_cap: float = 60.0, patient_s: float = 120.0, rng: random.Random | None = None,
                 clock: Any = time.monotonic) -> None:
        self.first_min, self.first_max, self.cap = first_min, first_max, cap
        self.answered_cap, self.patient_s = answered_cap, patient_s
        self._rng = rng or random.Random()
        self._clock = clock
        self.failures = 0
        self._last = 0.0
        self._since = 0.0

    def next_delay(self, err: BaseException | None = None) -> float:
        """How long to wait after this failure (`err`, or a watch that ended early when None)."""
        now = self._clock()
        if self.failures == 0:
            self._since = now
            delay = self._rng.uniform(self.first_min, self.first_max)
        else:
            answered = isinstance(err, ApiError)
            cap = self.answered_cap if answered and now - self._since >= self.patient_s else self.cap
            doubled = max(self._last * 2, self.first_min)
            # Below the cap, twice the last wait with jitter either way; at the cap, never less than the cap:
            # a fleet waiting out an outage comes back spread over up to 1.3 * cap after the server is, every
            # agent within that, and no agent's retries bunch below the cap.
            delay = (doubled * self._rng.uniform(0.75, 1.25) if doubled < cap else
                     cap * self._rng.uniform(1.0, 1.0 + CAP_JITTER))
        retry_after = err.retry_after if isinstance(err, ApiError) else None
        delay = max(delay, retry_after or 0.0)
        self._last = delay  # the next failure doubles what was waited, a Retry-After included
        self.failures += 1
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self._last = 0.0


class ApiCollector(Collector):
    """The agent's API use at scrape time: requests, throttled waits, watch restarts and relists."""

    def __init__(self, counts: ApiCounts) -> None:
        self._counts = counts

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        c = self._counts
        requests = CounterMetricFamily("gpu_agent_api_requests", "Requests the agent sent to the API server, by "
                                       "verb, resource and answer code (\"error\": no answer).",
                                       labels=["verb", "resource", "code"])
        for (verb, resource, code), n in sorted(c.requests.items()):
            requests.add_metric([verb, resource, code], n)
        yield requests
        throttled = CounterMetricFamily("gpu_agent_api_throttled", "Requests that waited for the agent's own "
                                        "rate limit.")
        throttled.add_metric([], c.throttled)
        yield throttled
        waited = CounterMetricFamily("gpu_agent_api_throttled_seconds", "Time requests waited for the agent's "
                                     "own rate limit.")
        waited.add_metric([], c.throttled_seconds)
        yield waited
        restarts = CounterMetricFamily("gpu_agent_api_watch_restarts", "Watches opened again, by resource and "
                                       "why the last one ended.", labels=["resource", "reason"])
        for (resource, reason), n in sorted(c.watch_restarts.items()):
            restarts.add_metric([resource, reason], n)
        yield restarts
        relists = CounterMetricFamily("gpu_agent_api_relists", "Lists made again because a watch could not "
                                      "resume from the last version seen (410 Gone), by resource.",
                                      labels=["resource"])
        for resource, n in sorted(c.relists.items()):
            relists.add_metric([resource], n)
        yield relists
        dropped = CounterMetricFamily("gpu_agent_api_events_dropped", "Events not recorded because of the "
                                      "agent's Event rate limit (a burst of 25, then one per five minutes).")
        dropped.add_metric([], c.events_dropped)
        yield dropped
