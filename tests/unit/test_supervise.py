"""The agent's supervisor of long-lived tasks (agent/agent.py `supervise`): how long it waits before each restart."""

from __future__ import annotations

import asyncio
import re

import pytest

import agent.agent as agent_module
from agent.agent import supervise
from agent.metrics import Metrics
from tests.plugin_harness import wait_until


async def test_the_restart_backoff_doubles_to_its_cap_and_starts_over_after_a_run_that_lived(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Scaled down (first step 0.1 s, cap 0.8 s) so that a run can outlive the cap in a second.
    monkeypatch.setattr(agent_module, "RESTART_BACKOFF_FIRST_S", 0.1)
    monkeypatch.setattr(agent_module, "RESTART_BACKOFF_MAX_S", 0.8)
    lives = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # how long each run lasts before it fails
    runs: list[int] = []

    async def task() -> None:
        runs.append(1)
        if len(runs) > len(lives):
            await asyncio.Event().wait()
        await asyncio.sleep(lives[len(runs) - 1])
        raise RuntimeError("boom")

    running = asyncio.create_task(supervise("health", task, Metrics()))
    try:
        await wait_until(lambda: len(runs) == len(lives) + 1, 15, "every run made")
    finally:
        running.cancel()
    waits = [float(m.group(1)) for r in caplog.records
             if (m := re.fullmatch(r"task health failed; restarting in ([0-9.]+)s", r.getMessage()))]
    # Doubling to the cap (0.1, 0.2, 0.4, 0.8, 0.8); the run that lived 1 s > the cap starts it over (0.1, 0.2, 0.4).
    assert waits == [0.1, 0.2, 0.4, 0.8, 0.8, 0.1, 0.2, 0.4]
