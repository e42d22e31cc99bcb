"""The MIG controller driven as the agent drives it, on a fresh fake dgx-h100 with a label on the Node: what the
Node and the GPUs then show, what was logged, the memory it allocated; in a child process with its address space
capped and a deadline, for inputs that could hang or swell it (tests/unit/test_mig_state_dir.py,
tests/unit/test_mig_sockets.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.config import AgentConfig, parse_config
from agent.kube.reconciler import EVENT_REASONS, MIG_REASON_ANNOTATION, MIG_STATE_LABEL, TaintPolicy, node_intent
from agent.mig.applier import MAX_JOURNAL_BYTES
from agent.mig.controller import MigController
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.mig_ops import MigOps
from agent.nvml.nodefile import load_node
from agent.state import MigStatus, NodeState, StateBus

REPO = Path(__file__).resolve().parents[1]
PRESET = "dgx-h100"
LAYOUT = "all-1g.10gb"
FRESH = [(False, False, 0)] * 8
"""(MIG enabled, mode change pending, GPU instances) of each GPU of a fresh dgx-h100: what "untouched" means."""
SETTLE_S = 10.0
"""Far beyond what the controller takes to publish an outcome on the fake (well under a second)."""
CHILD_S = 30.0
"""The child process's deadline: one that runs into it hung (waiting on a FIFO with the event loop)."""
CHILD_MEMORY = 1 << 30
"""The child's address space: the agent's own needs a few hundred MB; reading /dev/zero to its end does not fit."""
READ_PEAK = 1 << 20
"""The most memory the controller may allocate to find a journal unreadable: the journal's bound is 64 KiB."""
UNREAD = ("a MIG apply may have been interrupted, and which layout it was applying is unknown; nothing was changed "
          "on the GPUs. Set the nvidia.com/mig.config label to the layout the GPUs should have (its apply finishes "
          "from what the GPUs have and replaces the file), or remove the file")


def mig_config(state_dir: Path, tmp: Path) -> AgentConfig:
    return parse_config(yaml.safe_dump({
        "version": "v1", "flags": {"migStrategy": "mixed"},
        "mig": {"stateDir": str(state_dir), "podResourcesSocket": str(tmp / "no-kubelet" / "kubelet.sock")}}))


def gpus(backend: Any) -> list[tuple[bool, bool, int]]:
    """What NVML (the fake) reports of each GPU's MIG state."""
    return [(s.mig_enabled, s.mig_pending, len(s.instances)) for s in map(MigOps(backend).state, range(8))]


@contextlib.contextmanager
def agent_log() -> Iterator[list[dict[str, Any]]]:
    """The agent's log records, as a list of {level, message, traceback}."""
    records: list[dict[str, Any]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append({"level": record.levelname, "message": record.getMessage(),
                            "traceback": record.exc_info is not None})

    logger, handler = logging.getLogger("agent"), Keep()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class RecordingBus(StateBus):
    """A StateBus that keeps which GPUs each published state withdrew (draining)."""

    def __init__(self, state: NodeState) -> None:
        super().__init__(state)
        self.withdrawn: list[frozenset[str]] = []

    async def update(self, **changes: Any) -> NodeState:
        state = await super().update(**changes)
        self.withdrawn.append(state.draining)
        return state

    async def record(self, incidents: list[tuple[str, str, str]], **changes: Any) -> NodeState:
        state = await super().record(incidents, **changes)
        self.withdrawn.append(state.draining)
        return state


async def drive(config: AgentConfig, label: str | None, done: Callable[[MigStatus], bool],
                kubelet_dir: Path | None = None) -> dict[str, Any]:
    """Run the MIG controller on a fresh fake dgx-h100 with `label` on the Node until its status is `done` (at most
    SETTLE_S); what the Node and the GPUs then show, what was logged, and the memory it allocated meanwhile."""
    fake = FakeNvml(load_node(PRESET))
    backend = fake_backend(fake)
    backend.init()
    bus = RecordingBus(NodeState(version=1, inventory=backend.inventory(), config=config, mig_request=label))

    async def nvml(fn: Callable[[], Any], **_: Any) -> Any:
        return fn()

    with agent_log() as logs:
        tracemalloc.start()
        task = asyncio.create_task(MigController(backend, bus, nvml, kubelet_dir=kubelet_dir).run())
        try:
            async with asyncio.timeout(SETTLE_S):
                while (status := bus.current.mig_status) is None or not done(status):
                    await bus.wait_newer(bus.current.version)
        except TimeoutError:
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    state = bus.current
    intent = node_intent(state, {}, TaintPolicy("gpu-node-agent.io/gpu-fault", "NoSchedule"))
    return {
        "status": None if state.mig_status is None else list(vars(state.mig_status).values()),
        "state_label": intent.labels.get(MIG_STATE_LABEL),
        "annotation": intent.annotations.get(MIG_REASON_ANNOTATION),
        "events": [[EVENT_REASONS[i.kind], i.message] for i in state.incidents],
        "logs": logs,
        "gpus": gpus(backend),
        "withdrawn": len({uuid for draining in bus.withdrawn for uuid in draining}),
        "draining": len(state.draining),
        "peak": peak,
        "crashed": repr(task.exception()) if task.done() and not task.cancelled() and task.exception() else None,
    }


def child(args: list[str]) -> None:
    """The child process: the controller on a state directory and label (args), its outcome as JSON on stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    state_dir, tmp, label = Path(args[0]), Path(args[1]), args[2] or None
    outcome = asyncio.run(drive(mig_config(state_dir, tmp), label, lambda s: s.state != "pending"))
    print(json.dumps(outcome))


def in_child(state_dir: Path, tmp: Path, label: str | None = None) -> dict[str, Any]:
    try:
        run = subprocess.run(
            [sys.executable, "-c", "import sys; from tests.mig_rig import child; child(sys.argv[1:])",
             str(state_dir), str(tmp), label or ""],
            cwd=REPO, capture_output=True, text=True, timeout=CHILD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the MIG controller did not answer within {CHILD_S:g}s: it waits on the journal")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(run.stdout)
    outcome["gpus"] = [tuple(gpu) for gpu in outcome["gpus"]]
    return outcome


# --- journals that cannot be one: each makes one at `path` and returns the reason the agent gives ----------


def fifo(path: Path) -> str:
    os.mkfifo(path)
    return "is a FIFO, not a regular file"


def dev_zero(path: Path) -> str:
    path.symlink_to("/dev/zero")
    return "is a device, not a regular file"


def directory(path: Path) -> str:
    path.mkdir()
    (path / "x").write_text("{}")
    return "is a directory, not a regular file"


def dangling(path: Path) -> str:
    path.symlink_to("gone.json")
    return "is a symbolic link to gone.json, which does not exist"


def over_limit(path: Path) -> str:
    # A journal naming a layout, padded past the bound: it is not read at all, not even its first bytes.
    path.write_text(json.dumps({"layout": "all-balanced"}).ljust(MAX_JOURNAL_BYTES + 1))
    return "larger than 64 KiB; not read"


def invalid_json(path: Path) -> str:
    path.write_text('{"layout": "all-balanced", "layouts_file": "built-in def')
    return "not JSON: Unterminated string starting at (line 1, column 44)"


JOURNAL_SHAPES = [fifo, dev_zero, directory, dangling, over_limit, invalid_json]
