"""Starting the agent in process: a start that fails after taking the kubelet directory's lock and the metrics
port gives both back, a start cancelled during the NVML retries (what a signal does) gives them back at once,
and the idle mode of flags.failOnInitError false is its own kind of agent."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import daemon
from agent.agent import Agent
from agent.checks import StartupError
from agent.config import ConfigError, parse_config
from agent.daemon import AgentOptions, IdleAgent, start_agent
from agent.deviceplugin.response import IMEX_CHANNEL
from agent.locks import DirectoryLock, Held
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from tests.plugin_harness import short_dir, wait_until


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    directory = short_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def options(directory: Path, port: int, config: str = "version: v1\n") -> AgentOptions:
    return AgentOptions(config=parse_config(config + f"mig: {{stateDir: {directory}/mig}}\n"), kubelet_dir=directory,
                        metrics_port=port, metrics_host="127.0.0.1")


def assert_free(directory: Path, port: int) -> None:
    """Nothing holds the directory's lock or the port: another agent could take both now."""
    lock = DirectoryLock(directory, "probe")
    lock.acquire()  # raises Held while an agent holds it
    lock.release()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


async def test_a_start_failing_after_the_lock_and_the_port_gives_both_back(kubelet_dir: Path) -> None:
    assert not Path(IMEX_CHANNEL).exists()
    fake = FakeNvml(load_node("single-h200"))
    port = free_port()
    with pytest.raises(ConfigError) as refused:
        await start_agent(fake_backend(fake), options(kubelet_dir, port, "version: v1\nimex: {channelIDs: [0], "
                                                                          "required: true}\n"))
    assert str(refused.value) == f"imex.required is true but the IMEX channel {IMEX_CHANNEL} does not exist"
    assert_free(kubelet_dir, port)


async def test_a_second_agent_on_the_directory_is_refused_and_the_first_keeps_it(kubelet_dir: Path) -> None:
    first = await Agent.start(fake_backend(FakeNvml(load_node("single-h200"))), options(kubelet_dir, free_port()))
    try:
        with pytest.raises(StartupError, match=f"^another agent serves the kubelet directory {kubelet_dir}: "):
            await start_agent(fake_backend(FakeNvml(load_node("single-h200"))), options(kubelet_dir, free_port()))
        with pytest.raises(Held):
            DirectoryLock(kubelet_dir, "probe").acquire()
    finally:
        await first.stop()
    assert_free(kubelet_dir, free_port())


async def test_a_start_cancelled_during_the_nvml_retries_gives_back_the_lock_and_the_port(
    kubelet_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.daemon")
    fake = FakeNvml(load_node("single-h200"))
    fake.set_driver_loaded(False)
    port = free_port()
    starting = asyncio.create_task(start_agent(fake_backend(fake), options(kubelet_dir, port)))
    await wait_until(lambda: any("(attempt 1 of 5)" in m for m in caplog.messages), 10, "the first failed attempt")
    with pytest.raises(Held):
        DirectoryLock(kubelet_dir, "probe").acquire()
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert_free(kubelet_dir, port)


async def test_fail_on_init_error_false_gives_an_idle_agent_that_agent_start_refuses(
    kubelet_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml(load_node("single-h200"))
    fake.set_driver_loaded(False)
    port = free_port()
    idle = ("serving nothing: NVML initialisation failed: Driver Not Loaded (flags.failOnInitError is false)")
    config = "version: v1\nflags: {failOnInitError: false}\n"
    monkeypatch.setattr(daemon, "NVML_INIT_BACKOFF_S", 0.01)
    started = await start_agent(fake_backend(fake), options(kubelet_dir, port, config))
    assert isinstance(started, IdleAgent)
    assert started.ready() == (True, idle)
    await started.stop()
    assert_free(kubelet_dir, port)
    with pytest.raises(StartupError) as refused:
        await Agent.start(fake_backend(fake), options(kubelet_dir, port, config))
    assert str(refused.value) == idle
    assert_free(kubelet_dir, port)
