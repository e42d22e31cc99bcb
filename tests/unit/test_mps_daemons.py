"""The MPS control daemons the agent starts, as the node sees them: every daemon it starts is stopped when its GPU
no longer wants it and when the agent stops, whatever moment the stop (SIGTERM: Agent.stop cancels the loop)
arrives at, after a limit command that fails, after a burst of config changes, and a daemon an earlier agent left
is not answered "already running" for ever. What runs is counted from the stand-in control program's daemons
themselves (tests/mps/nvidia-cuda-mps-control: the pid each logs at start, looked up in /proc), not from the
agent's records.

The stand-in is reached through a wrapper (`WRAPPER`) that a test steers with files in a GPU's log directory: `stall`
names a step (`-d`, after the daemon started, or a command, whole or its first word, after the daemon got it) where
the control program then hangs, as one that does not answer; `fail-once` names a command word that fails once, before it
reaches the daemon; `fail-always` does so every time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.mps import MpsDaemons
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvml.records import NodeInventory
from agent.simulate import SimulatedMpsControl
from agent.state import NodeState, StateBus
from tests.plugin_harness import running_agent, short_dir, wait_until

STAND_IN = Path(__file__).resolve().parents[1] / "mps" / "nvidia-cuda-mps-control"
H100_NVL_MIB = 95830
"""Total memory of the fake H100 NVL as NVML reports it, in MiB."""
STOP_S = 5.0
"""How long Agent.stop waits for a cancelled task (agent.agent.STOP_TASK_S): the MPS loop must be done by then."""

WRAPPER = f"""#!/bin/sh
knob() {{ cat "$CUDA_MPS_LOG_DIRECTORY/$1" 2>/dev/null; }}
stall() {{ echo $$ >> "$CUDA_MPS_LOG_DIRECTORY/stalled.pids"; exec sleep 30; }}
if [ "$1" = "-d" ]; then
  [ "$(knob fail-always)" = "-d" ] && {{ echo "injected failure of -d" >&2; exit 1; }}
  {STAND_IN} -d || exit $?
  [ "$(knob stall)" = "-d" ] && stall
  exit 0
fi
read -r line
word=${{line%% *}}
if [ "$(knob fail-once)" = "$word" ]; then
  rm -f "$CUDA_MPS_LOG_DIRECTORY/fail-once"; echo "injected failure of $word" >&2; exit 1
fi
out=$(printf '%s\\n' "$line" | {STAND_IN}); rc=$?
stalled=$(knob stall)
[ "$stalled" = "$word" ] || [ "$stalled" = "$line" ] && stall
[ -n "$out" ] && printf '%s\\n' "$out"
exit $rc
"""


@dataclass
class Node:
    """A 2-GPU node (two H100 NVL) whose driver root holds the wrapped stand-in, and its MPS root."""

    driver: Path
    mps: Path
    inventory: NodeInventory

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.inventory.gpus]

    def config(self, replicas: int = 4) -> str:
        return (f"version: v1\nflags:\n  mpsRoot: {self.mps}\n  plugin:\n    containerDriverRoot: {self.driver}\n"
                f"sharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {replicas}\n")

    def log(self, uuid: str) -> list[str]:
        path = self.mps / uuid / "log" / "control.log"
        return path.read_text().splitlines() if path.exists() else []

    def started(self, uuid: str) -> list[int]:
        """The pids of every daemon started for the GPU, in order."""
        return [int(line.split()[1].removeprefix("pid=")) for line in self.log(uuid) if line.startswith("started")]

    def running(self, uuid: str) -> list[int]:
        """The GPU's daemons that run now (a live process of the stand-in, not a zombie)."""
        return [pid for pid in self.started(uuid) if alive(pid)]

    def stopped(self, uuid: str) -> int:
        return sum(line == "stopped" for line in self.log(uuid))

    def knob(self, uuid: str, name: str, value: str) -> None:
        directory = self.mps / uuid / "log"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(value)

    def limits_of(self, pid: int, uuid: str, replicas: int) -> bool:
        """Whether the daemon `pid` of the GPU got this agent's limits for `replicas` replicas after it started."""
        lines = self.log(uuid)
        got = lines[lines.index(next(x for x in lines if x.startswith(f"started pid={pid} "))) + 1:][:2]
        return got == [f"command set_default_active_thread_percentage {100 // replicas}",
                       f"command set_default_device_pinned_mem_limit 0 {H100_NVL_MIB // replicas}M"]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and b"nvidia-cuda-mps-control" in cmdline


@pytest.fixture
def node() -> Iterator[Node]:
    top = short_dir()
    driver, mps = top / "driver", top / "mps"
    (driver / "usr" / "bin").mkdir(parents=True)
    program = driver / "usr" / "bin" / "nvidia-cuda-mps-control"
    program.write_text(WRAPPER)
    program.chmod(0o755)
    made = Node(driver, mps, inventory())
    yield made
    # Whatever a test (or the agent under it) left running is killed, so that no test sees another's.
    for uuid in made.uuids:
        stalled = mps / uuid / "log" / "stalled.pids"
        pids = made.started(uuid) + ([int(p) for p in stalled.read_text().split()] if stalled.exists() else [])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(top, ignore_errors=True)


def inventory() -> NodeInventory:
    backend = fake_backend(FakeNvml(load_node("pcie-h100-nvl-pair")))
    backend.init()
    return backend.inventory()


def bus_for(node: Node, replicas: int = 4) -> StateBus:
    return StateBus(NodeState(version=1, inventory=node.inventory, config=parse_config(node.config(replicas))))


async def stop(task: asyncio.Task[None]) -> None:
    """What Agent.stop does to the MPS loop on SIGTERM: cancel it and wait (it must end within STOP_S)."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=STOP_S)
    assert done == {task}, f"the MPS loop did not stop within {STOP_S:g}s of SIGTERM"


def served(bus: StateBus, node: Node) -> bool:
    return dict(bus.current.mps) == dict.fromkeys(node.uuids, "")


@pytest.mark.parametrize("step", ["-d", "set_default_active_thread_percentage", "set_default_device_pinned_mem_limit"])
async def test_sigterm_while_a_daemon_starts_leaves_none_running(node: Node, step: str) -> None:
    """The control program hangs at `step` of the start (after `-d` started the daemon, or once the daemon got a
    limit command) and SIGTERM arrives then: no daemon runs after the stop."""
    for uuid in node.uuids:
        node.knob(uuid, "stall", step)
    bus = bus_for(node)
    task = asyncio.create_task(MpsDaemons(bus, interval=60).run())
    stalled = [node.mps / u / "log" / "stalled.pids" for u in node.uuids]
    await wait_until(lambda: all(p.exists() for p in stalled), 10, f"both GPUs' starts hung at {step}")
    assert [len(node.running(u)) for u in node.uuids] == [1, 1]  # started: the agent has something to stop
    await stop(task)
    assert {u: node.running(u) for u in node.uuids} == {u: [] for u in node.uuids}
    assert [node.stopped(u) for u in node.uuids] == [1, 1]  # each was told to quit, not killed by the test


async def test_the_agents_stop_while_its_daemons_start_leaves_none_running(node: Node) -> None:
    """The whole agent, stopped (as on SIGTERM) while each GPU's daemon waits for its first limit command."""
    for uuid in node.uuids:
        node.knob(uuid, "stall", "set_default_active_thread_percentage")
    async with running_agent("pcie-h100-nvl-pair", config=parse_config(node.config())):
        stalled = [node.mps / u / "log" / "stalled.pids" for u in node.uuids]
        await wait_until(lambda: all(p.exists() for p in stalled), 10, "both GPUs' starts hung")
        assert [len(node.running(u)) for u in node.uuids] == [1, 1]
    assert {u: node.running(u) for u in node.uuids} == {u: [] for u in node.uuids}
    assert [node.stopped(u) for u in node.uuids] == [1, 1]


async def test_a_stop_is_bounded_when_a_daemon_does_not_answer_quit(node: Node) -> None:
    """A daemon whose `quit` never answers does not hold the agent's stop."""
    bus = bus_for(node)
    task = asyncio.create_task(MpsDaemons(bus, interval=60).run())
    await wait_until(lambda: served(bus, node), 10, "both GPUs' daemons up")
    for uuid in node.uuids:
        node.knob(uuid, "stall", "quit")
    await stop(task)
    assert [node.stopped(u) for u in node.uuids] == [1, 1]  # the quit reached them; its answer never came


async def test_a_limit_command_that_fails_once_quits_its_daemon_and_the_next_start_serves(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.mps")
    gpu0, gpu1 = node.uuids
    node.knob(gpu0, "fail-once", "set_default_device_pinned_mem_limit")
    bus = bus_for(node)
    task = asyncio.create_task(MpsDaemons(bus, interval=60).run())
    try:
        await wait_until(lambda: served(bus, node), 10, "both GPUs' daemons up, GPU 0's on a second start")
        first, second = node.started(gpu0)
        assert node.running(gpu0) == [second] and not alive(first)
        assert node.limits_of(second, gpu0, 4)
        assert len(node.running(gpu1)) == 1 and len(node.started(gpu1)) == 1
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert [r.getMessage() for r in errors] == [
            "MPS control daemon of GPU 0 did not start: nvidia-cuda-mps-control set_default_device_pinned_mem_limit "
            "0 23957M exited 1: injected failure of set_default_device_pinned_mem_limit; trying again in 1s"]
        assert all(r.exc_info is None for r in caplog.records)
    finally:
        await stop(task)
    assert {u: node.running(u) for u in node.uuids} == {u: [] for u in node.uuids}


async def test_a_start_that_keeps_failing_is_tried_again_later_and_later(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """Retries back off (1 s, then 2 s, ...), even when the loop checks every 0.1 s; each failure is one line."""
    gpu0, _ = node.uuids
    node.knob(gpu0, "fail-always", "-d")
    bus = bus_for(node)
    task = asyncio.create_task(MpsDaemons(bus, interval=0.1).run())

    def failures() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno >= logging.ERROR]

    try:
        await wait_until(lambda: len(failures()) >= 2, 10, "two failed starts")
        await asyncio.sleep(1.5)  # the third comes 2 s after the second
    finally:
        await stop(task)
    first, second = failures()
    assert second.created - first.created >= 1.0
    assert [first.getMessage(), second.getMessage()] == [
        "MPS control daemon of GPU 0 did not start: nvidia-cuda-mps-control -d exited 1: injected failure of -d; "
        f"trying again in {delay}s" for delay in (1, 2)]
    assert all(r.exc_info is None for r in caplog.records)
    assert dict(bus.current.mps)[gpu0] == "nvidia-cuda-mps-control -d exited 1: injected failure of -d"


async def test_a_daemon_an_earlier_agent_left_is_replaced_by_one_with_this_agents_limits(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    leftover = {}
    for uuid in node.uuids:  # an earlier agent's daemons, started by hand with 2 replicas' limits
        pipe, logs = node.mps / uuid / "pipe", node.mps / uuid / "log"
        pipe.mkdir(parents=True)
        logs.mkdir(parents=True)
        env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": uuid,
               "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
        subprocess.run([str(STAND_IN), "-d"], env=env, check=True, timeout=10)
        for command in ("set_default_active_thread_percentage 50", "set_default_device_pinned_mem_limit 0 47915M"):
            subprocess.run([str(STAND_IN)], input=command + "\n", text=True, env=env, check=True, timeout=10)
        (leftover[uuid],) = node.running(uuid)
    bus = bus_for(node, replicas=4)
    task = asyncio.create_task(MpsDaemons(bus, interval=60).run())
    try:
        await wait_until(lambda: served(bus, node), 10, "both GPUs' daemons up")
        for uuid in node.uuids:
            (ours,) = node.running(uuid)
            assert ours != leftover[uuid] and not alive(leftover[uuid])
            assert node.limits_of(ours, uuid, 4)
        assert sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING) == [
            f"MPS control daemon of GPU {i}: one was running already (left by an earlier agent?); quit it, to start "
            "one with this agent's limits" for i in (0, 1)]
    finally:
        await stop(task)
    assert {u: node.running(u) for u in node.uuids} == {u: [] for u in node.uuids}


async def test_a_daemon_answered_already_running_is_quit_and_started_again(tmp_path: Path) -> None:
    """Where no pipe directory shows it (the simulated control), `-d` refused as "already running" is not taken
    as final: the daemon there is quit and one started with this agent's limits."""
    gpus = inventory().gpus
    root = tmp_path / "mps"
    config = parse_config(f"version: v1\nflags:\n  mpsRoot: {root}\nsharing:\n  mps:\n    resources:\n"
                          "    - name: nvidia.com/gpu\n      replicas: 4\n")
    control = SimulatedMpsControl()
    pipes = [str(root / g.uuid / "pipe") for g in gpus]
    for pipe in pipes:  # an earlier agent's daemons, with 2 replicas' limits
        control.daemons[pipe] = {"active_thread_percentage": "50.0", "pinned_mem_limit": "47915M"}
    bus = StateBus(NodeState(version=1, inventory=inventory(), config=config))
    task = asyncio.create_task(MpsDaemons(bus, interval=60, control=control).run())
    try:
        await wait_until(lambda: dict(bus.current.mps) == {g.uuid: "" for g in gpus}, 10, "both GPUs' daemons up")
        limits = {"active_thread_percentage": "25.0", "pinned_mem_limit": f"{H100_NVL_MIB // 4}M"}
        assert control.daemons == {pipe: limits for pipe in pipes}
    finally:
        await stop(task)
    assert control.daemons == {}


@pytest.mark.parametrize("then", ["settle", "sigterm"])
async def test_a_burst_of_config_changes_ends_with_one_daemon_per_gpu_and_every_other_stopped(
        node: Node, then: str) -> None:
    """20 reloads, each with other limits, a few milliseconds apart; then the agent settles on the last config and
    stops, or SIGTERM arrives while the last config's daemons get their limits."""
    bus = bus_for(node, replicas=2)
    task = asyncio.create_task(MpsDaemons(bus, interval=60 if then == "settle" else 1).run())
    try:
        await wait_until(lambda: served(bus, node), 10, "both GPUs' daemons up")
        if then == "sigterm":
            for uuid in node.uuids:
                node.knob(uuid, "stall", f"set_default_device_pinned_mem_limit 0 {H100_NVL_MIB // 22}M")
        for replicas in range(3, 23):
            await bus.update(config=parse_config(node.config(replicas)))
            await asyncio.sleep(0.005)
        if then == "sigterm":
            stalled = [node.mps / u / "log" / "stalled.pids" for u in node.uuids]
            await wait_until(lambda: all(p.exists() for p in stalled), 15, "the last config's daemons starting")
        else:
            def settled() -> bool:
                """Each GPU runs one daemon, with the last config's limits (each GPU's daemons read once: one may
                stop between two reads)."""
                running = {u: node.running(u) for u in node.uuids}
                return served(bus, node) and all(len(r) == 1 and node.limits_of(r[0], u, 22)
                                                 for u, r in running.items())

            await wait_until(settled, 15, "both GPUs' daemons up with the last config's limits")
            for uuid in node.uuids:
                assert len(node.running(uuid)) == 1
                assert len(node.started(uuid)) - node.stopped(uuid) == 1
    finally:
        await stop(task)
    for uuid in node.uuids:
        assert node.running(uuid) == []
        assert len(node.started(uuid)) == node.stopped(uuid)  # N starts, N stops
