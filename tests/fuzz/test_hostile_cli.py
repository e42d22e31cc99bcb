"""The command line under hostile conditions, through the real CLI and a running agent: a stderr nobody reads,
signals in the middle of a simulation, and flags whose values are not what they claim to be. Each case gives
one clear line (or keeps serving), with no traceback and nothing left behind."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import termios
import time
import urllib.request
from pathlib import Path

import pytest

from tests.builders import AGENT, gpu_agent, run_agent
from tests.plugin_harness import short_dir


def free_port() -> int:
    """A port nothing listens on now (bound and closed again)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def healthz(host: str, port: int, timeout: float) -> bytes:
    with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=timeout) as answer:
        body: bytes = answer.read()
        return body


def state_version(port: int) -> int:
    """The version of the node state the agent serves, as its /metrics says."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    [value] = [line.split()[1] for line in text.splitlines() if line.startswith("gpu_agent_state_version ")]
    return int(float(value))


def in_pipe(read_end: int) -> int:
    """Bytes written into a pipe and not read yet."""
    return int(struct.unpack("i", fcntl.ioctl(read_end, termios.FIONREAD, b"\0\0\0\0"))[0])


# --- a stderr nobody reads ------------------------------------------------------------------------------


def test_a_stderr_nobody_reads_neither_stops_serving_nor_holds_sigterm(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    port = free_port()
    read_end, write_end = os.pipe()  # the agent's stderr, which nobody reads while it runs
    try:
        agent = subprocess.Popen(
            [*AGENT, "run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir),
             "--config", str(config), "--metrics-port", str(port), "--metrics-address", "127.0.0.1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=write_end)
    finally:
        os.close(write_end)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert agent.poll() is None, "the agent ended at start"
            try:
                assert healthz("127.0.0.1", port, 1) == b"ok\n"
                break
            except OSError:
                assert time.monotonic() < deadline, "the agent did not serve /healthz"
                time.sleep(0.1)
        # Each SIGHUP now rejects the config with an error of about 1.5 KB in the log (ten problems of long keys,
        # and a line counting the rest).
        config.write_text("version: v1\n" + "".join(f"unknown{i:03d}{'x' * 50}: 1\n" for i in range(100)))
        capacity = fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ)
        deadline = time.monotonic() + 30
        # The pipe is full when SIGHUPs go on and nothing more arrives in it for half a second. (Writes smaller
        # than a page fill its pages only in part, so a full pipe can hold less than its capacity.)
        filled, unchanged = -1, 0
        while unchanged < 25:
            assert time.monotonic() < deadline, f"the log filled {in_pipe(read_end)} of the pipe's {capacity} bytes"
            agent.send_signal(signal.SIGHUP)
            time.sleep(0.02)
            now = in_pipe(read_end)
            unchanged = unchanged + 1 if now == filled else 0
            filled = now
        assert filled > capacity // 2, f"the log stopped at {filled} of the pipe's {capacity} bytes"
        for n in range(50):  # well past what the pipe holds: about 175 KB more
            # Each rejection publishes a new state version (its ConfigRejected incident): one SIGHUP at a time,
            # each taken and logged into the full pipe before the next.
            version = state_version(port)
            agent.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while state_version(port) <= version:
                assert time.monotonic() < deadline, f"SIGHUP {n + 1} of 50 was not taken"
                time.sleep(0.05)
        started = time.monotonic()
        assert healthz("127.0.0.1", port, 1) == b"ok\n"
        assert time.monotonic() - started < 1
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=10) == 0
        written = os.read(read_end, capacity)
        assert b"config reload rejected; keeping the last good config: " in written
        assert f"INFO agent.metrics: serving /metrics, /healthz and /readyz on 127.0.0.1:{port}\n".encode() in written
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        os.close(read_end)


# --- simulate -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mig", "reason"), [
    ("layoutsFile: {tmp}/missing.yaml", "mig.layoutsFile: {tmp}/missing.yaml: no such file"),
    ("stateDir: {tmp}/config.yaml/state", "mig.stateDir {tmp}/config.yaml/state: {tmp}/config.yaml is not a directory"),
])
def test_a_start_up_error_of_simulate_is_one_line(tmp_path: Path, mig: str, reason: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nmig:\n  {mig.format(tmp=tmp_path)}\n")
    result = gpu_agent("simulate", "--node", "single-h200", "--config", str(config))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == f"gpu-agent simulate: error: {reason.format(tmp=tmp_path)}\n"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143)])
async def test_a_simulation_ended_by_a_signal_removes_its_directory(tmp_path: Path, signum: int, code: int) -> None:
    from agent.nvml.fake import FakeNvml
    from agent.nvml.nodefile import load_node

    state = tmp_path / "nvml.json"
    FakeNvml(load_node("single-h200"), state).set_driver_loaded(False)  # NVML is retried for about 10 s
    # Its own TMPDIR, short: the simulation's socket paths must fit AF_UNIX's limit under any pytest basetemp.
    temp = short_dir()
    simulation = await asyncio.create_subprocess_exec(
        *AGENT, "simulate", "--node", "single-h200", "--mock-state", str(state),
        env={**os.environ, "TMPDIR": str(temp)}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not list(temp.glob("gpu-agent-sim-*/kubelet.sock")):
            assert simulation.returncode is None and time.monotonic() < deadline, "no simulation directory"
            await asyncio.sleep(0.02)
        simulation.send_signal(signum)
        async with asyncio.timeout(15):
            out, err = await simulation.communicate()
        assert (simulation.returncode, out, err) == (code, b"", b"")
        assert list(temp.iterdir()) == []
    finally:
        if simulation.returncode is None:
            simulation.kill()
            await simulation.wait()
        shutil.rmtree(temp, ignore_errors=True)


# --- flags whose values are not what they claim ----------------------------------------------------------


@pytest.mark.parametrize(("value", "why"), [
    ("-1", "must be 0 or more, got '-1'"), ("inf", "must be 0 or more, got 'inf'"),
    ("nan", "must be 0 or more, got 'nan'"), ("soon", "not a number: 'soon'")])
def test_a_start_jitter_that_is_not_a_duration_is_refused_naming_the_flag(kubelet_dir: Path, value: str,
                                                                          why: str) -> None:
    result = run_agent(kubelet_dir, f"--kube-start-jitter={value}")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == f"gpu-agent run: error: argument --kube-start-jitter: {why}"


@pytest.mark.parametrize("address", ["not an address", "999.1.1.1", "", "[127.0.0.1]", "[::1", "under_score.example"])
def test_a_metrics_address_that_is_not_one_is_refused_naming_the_flag(kubelet_dir: Path, address: str) -> None:
    result = run_agent(kubelet_dir, "--metrics-address", address)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"gpu-agent run: error: argument --metrics-address: not an IPv4 or IPv6 address or a host name: {address!r}")


@pytest.mark.parametrize(("address", "connect", "shown"), [
    ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("[::1]", "[::1]", "[::1]"),
    ("::1", "[::1]", "[::1]"),
])
async def test_the_metrics_endpoint_logs_the_address_and_port_it_serves_on(
        kubelet_dir: Path, address: str, connect: str, shown: str) -> None:
    agent = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir),
        "--metrics-port", "0", "--metrics-address", address, stderr=asyncio.subprocess.PIPE)
    try:
        assert agent.stderr is not None
        pattern = re.compile(
            rf" INFO agent\.metrics: serving /metrics, /healthz and /readyz on {re.escape(shown)}:(\d+)$")
        lines: list[str] = []
        async with asyncio.timeout(20):
            while not (found := pattern.search(lines[-1] if lines else "")):
                line = await agent.stderr.readline()
                assert line, "\n".join(lines)
                lines.append(line.decode().rstrip("\n"))
        port = int(found.group(1))
        assert port != 0
        assert await asyncio.to_thread(healthz, connect, port, 5) == b"ok\n"
    finally:
        agent.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await agent.wait() == 0


EMPTY = "must not be empty (an empty path means the working directory)"


@pytest.mark.parametrize(("args", "flag"), [
    (["run", "--no-kube", "--nvml", "mock:single-h200", "--metrics-port", "0", "--kubelet-dir="], "--kubelet-dir"),
    (["run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", "{kd}", "--config="], "--config"),
    (["run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", "{kd}", "--mock-state="], "--mock-state"),
    (["run", "--node-name", "n1", "--nvml", "mock:single-h200", "--kubelet-dir", "{kd}", "--kubeconfig="],
     "--kubeconfig"),
    (["inspect", "--nvml", "mock:single-h200", "--mock-state="], "--mock-state"),
    (["simulate", "--node", "single-h200", "--config="], "--config"),
    (["simulate", "--node", "single-h200", "--mock-state="], "--mock-state"),
    (["mig", "plan", "--nvml", "mock:single-h200", "--layout", "all-balanced", "--mig-config="], "--mig-config"),
    (["mig", "plan", "--nvml", "mock:single-h200", "--layout", "all-balanced", "--state-dir="], "--state-dir"),
    (["mig", "plan", "--nvml", "mock:single-h200", "--layout", "all-balanced", "--mock-state="], "--mock-state"),
    (["fault", "--nvml", "mock:single-h200", "--mock-state=", "lost", "0"], "--mock-state"),
])
def test_an_empty_path_is_refused_naming_the_flag(kubelet_dir: Path, args: list[str], flag: str) -> None:
    result = gpu_agent(*(a.format(kd=kubelet_dir) for a in args), timeout=30)
    assert (result.returncode, result.stdout) == (2, "")
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == f"gpu-agent {args[0]}: error: argument {flag}: {EMPTY}"

