"""`gpu-agent run` whose MIG journal (mig.stateDir/mig-journal.json) is a FIFO or a symbolic link to /dev/zero:
the agent starts, registers its device plugin with the kubelet, answers /healthz at once, says what is wrong with
the journal in one line, stays small, and exits 0 on SIGTERM. The process runs with its address space capped, so
that an agent that reads /dev/zero to its end fails the test rather than taking the host's memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from agent.mig.applier import JOURNAL
from agent.simulate import StandInKubelet
from tests.faults.agent_process import collect_lines, free_port, http_get
from tests.mig_rig import dev_zero, fifo
from tests.plugin_harness import short_dir, wait_until

RESOURCE = "nvidia.com/gpu"
ADDRESS_SPACE = 3 << 29
"""1.5 GiB: the agent's own address space is under 500 MB."""
CAPPED = [sys.executable, "-c", "import resource, runpy, sys; "
          f"resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE})); "
          "sys.argv[0] = 'gpu-agent'; runpy.run_module('agent.cli', run_name='__main__')"]
"""`python -m agent.cli` with its address space capped (set in the agent's process itself: a preexec_fn is not
safe in this process, where gRPC runs threads)."""
MAX_RSS_KB = 300 * 1024
"""The most resident memory the agent may have used (it starts at about 65 MB on the fake dgx-h100)."""


def peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("make", [fifo, dev_zero], ids=["fifo", "dev-zero"])
async def test_an_unreadable_journal_neither_stops_nor_swells_the_agent(
        tmp_path: Path, make: Callable[[Path], str]) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    journal = state_dir / JOURNAL
    why = make(journal)
    (tmp_path / "pod-resources").mkdir()  # the kubelet's directory, without its socket: not checked for pods
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"version": "v1", "mig": {
        "stateDir": str(state_dir), "podResourcesSocket": str(tmp_path / "pod-resources" / "kubelet.sock")}}))
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    port = free_port()

    proc = await asyncio.create_subprocess_exec(
        *CAPPED, "run", "--nvml", "mock:dgx-h100", "--kubelet-dir", str(directory), "--config", str(config),
        "--no-kube", "--metrics-port", str(port), stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    lines: list[str] = []
    reader = asyncio.create_task(collect_lines(proc.stderr, lines))
    try:
        await wait_until(lambda: any("agent started" in line for line in lines) or proc.returncode is not None, 30,
                         "the agent to start")
        assert proc.returncode is None, "\n".join(lines)
        await kubelet.wait_for({RESOURCE}, 20)  # the device plugin registered
        await wait_until(lambda: any(str(journal) in line for line in lines), 10, "the line about the journal")
        for _ in range(3):  # the event loop is free: /healthz answers at once, each time
            started = time.monotonic()
            async with asyncio.timeout(5):
                assert await http_get(port, "/healthz") == (200, "ok\n")
            assert time.monotonic() - started < 1.0
            await asyncio.sleep(0.2)
        rss = peak_rss_kb(proc.pid)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            await proc.wait()
        stopped_in = time.monotonic() - sent
        async with asyncio.timeout(5):
            await reader
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    log = "\n".join(lines)
    assert proc.returncode == 0, log
    assert stopped_in < 5, log
    assert rss < MAX_RSS_KB, (rss, log)
    assert "Traceback" not in log, log
    said = [line for line in lines if str(journal) in line]
    assert len(said) == 1, log
    assert " ERROR agent.mig.controller: " in said[0], said
    assert said[0].endswith(f"the MIG journal {journal} cannot be read ({why}): a MIG apply may have been "
                            "interrupted, and which layout it was applying is unknown; nothing was changed on the "
                            "GPUs. Set the nvidia.com/mig.config label to the layout the GPUs should have (its apply "
                            "finishes from what the GPUs have and replaces the file), or remove the file"), said
    assert os.path.lexists(journal)
