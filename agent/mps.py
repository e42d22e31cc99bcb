"""One MPS control daemon per GPU that the config shares with MPS: started, given its limits, checked,
restarted when it dies and stopped when the GPU is no longer shared. Its readiness goes into
NodeState.mps; the inventory withholds a GPU's MPS replicas until its daemon is up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from agent.config import AgentConfig
from agent.inventory import mps_shared_gpus
from agent.mps_client import mps_log_dir, mps_pipe_dir
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

T = TypeVar("T")

CONTROL = "nvidia-cuda-mps-control"
CHECK_INTERVAL_S = 5.0
COMMAND_TIMEOUT_S = 10.0


def control_program(config: AgentConfig) -> str | None:
    """The MPS control program: under flags.plugin.containerDriverRoot (the host's driver root as mounted in
    the agent's container), else on PATH; None when there is none."""
    under_root = config.flags.plugin.container_driver_root / "usr" / "bin" / CONTROL
    if under_root.is_file() and os.access(under_root, os.X_OK):
        return str(under_root)
    return shutil.which(CONTROL)


@dataclass(frozen=True)
class DaemonSpec:
    """What one GPU's daemon is started with; a change restarts it."""

    gpu_uuid: str
    gpu_index: int
    replicas: int
    memory_mib: int
    program: str
    root: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CUDA_VISIBLE_DEVICES": self.gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(mps_pipe_dir(self.root, self.gpu_uuid)),
            "CUDA_MPS_LOG_DIRECTORY": str(mps_log_dir(self.root, self.gpu_uuid)),
        }

    @property
    def limits(self) -> list[str]:
        """The control commands that split the GPU into equal shares (device 0: the daemon sees one GPU)."""
        return [
            f"set_default_active_thread_percentage {100 // self.replicas}",
            f"set_default_device_pinned_mem_limit 0 {self.memory_mib // self.replicas}M",
        ]


class ControlError(RuntimeError):
    """The control program failed; the message is one line."""


class Control(Protocol):
    """How the agent reaches the driver's MPS control program: on a node, by running it (`ProgramControl`)."""

    def program(self, config: AgentConfig) -> str | None:
        """The control program, or None when there is none."""

    async def __call__(self, spec: DaemonSpec, *args: str, command: str | None = None) -> str:
        """Run the control program once (with -d it starts the daemon; otherwise it sends `command` to the
        daemon of the spec's pipe directory); its output, or ControlError."""


class ProgramControl:
    """Runs the driver's nvidia-cuda-mps-control as a process."""

    def program(self, config: AgentConfig) -> str | None:
        return control_program(config)

    async def __call__(self, spec: DaemonSpec, *args: str, command: str | None = None) -> str:
        return await _control(spec, *args, command=command)


async def _control(spec: DaemonSpec, *args: str, command: str | None = None) -> str:
    """Run the control program once (with -d it starts the daemon; otherwise it sends `command` on stdin)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            spec.program, *args, env=spec.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as err:
        raise ControlError(f"cannot run {spec.program}: {err.strerror}") from None
    try:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            out, _ = await proc.communicate((command + "\n").encode() if command else b"")
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise ControlError(f"{CONTROL} {command or ' '.join(args)} did not answer in {COMMAND_TIMEOUT_S:g}s") from None
    text = out.decode(errors="replace").strip()
    if proc.returncode != 0:
        what = command or " ".join(args)
        last = f": {text.splitlines()[-1]}" if text else ""
        raise ControlError(f"{CONTROL} {what} exited {proc.returncode}{last}")
    return text


class MpsDaemons:
    """Keeps NodeState.mps true to the daemons it runs."""

    def __init__(self, bus: StateBus, interval: float = CHECK_INTERVAL_S, control: Control | None = None) -> None:
        self._bus = bus
        self._interval = interval
        self._control = control or ProgramControl()
        self._running: dict[str, DaemonSpec] = {}

    def wanted(self, state: NodeState) -> dict[str, DaemonSpec] | str:
        """The daemons the state calls for, or why none can run."""
        shared = mps_shared_gpus(state)
        if not shared:
            return {}
        program = self._control.program(state.config)
        if program is None:
            return (f"{CONTROL} not found under {state.config.flags.plugin.container_driver_root}/usr/bin "
                    "or on PATH")
        root = state.config.flags.mps_root
        return {gpu.uuid: DaemonSpec(gpu.uuid, gpu.index, replicas, gpu.memory_mib, program, root)
                for gpu, replicas in shared}

    async def run(self) -> None:
        try:
            check = True
            while True:
                state = self._bus.current
                status = await self._converge(state, check)
                if dict(state.mps) != status:
                    await self._bus.update(mps=status)
                try:
                    async with asyncio.timeout(self._interval):
                        await self._bus.wait_newer(self._bus.current.version)
                    check = False  # a new state: start or stop what it changes; probe the daemons on the interval
                except TimeoutError:
                    check = True
        finally:
            await asyncio.shield(self.stop_all())

    async def _converge(self, state: NodeState, check: bool) -> dict[str, str]:
        """Each GPU's daemon is started, probed or stopped beside the others: a GPU whose control program is slow
        or hangs (up to COMMAND_TIMEOUT_S a run) does not hold back the other GPUs' replicas, and on a busy node
        eight daemons come up in about the time of one."""
        wanted = self.wanted(state)
        if isinstance(wanted, str):
            await self.stop_all()
            return {uuid: wanted for uuid in (g.uuid for g, _ in mps_shared_gpus(state))}
        changed = [u for u, spec in self._running.items() if wanted.get(u) != spec]
        await _each(self._stop(self._running.pop(uuid)) for uuid in changed)
        return dict(zip(wanted, await _each(self._ensure(spec, check) for spec in wanted.values()), strict=True))

    async def _ensure(self, spec: DaemonSpec, check: bool) -> str:
        """'' when the GPU's daemon is up (probed when `check`; started when needed), else why not."""
        if spec.gpu_uuid in self._running and not check:
            return ""
        if spec.gpu_uuid in self._running:
            try:
                await self._control(spec, command="get_default_active_thread_percentage")
                return ""
            except ControlError as err:
                log.warning("MPS control daemon of GPU %d stopped answering (%s); restarting it", spec.gpu_index, err)
                del self._running[spec.gpu_uuid]
        try:
            for directory in (mps_pipe_dir(spec.root, spec.gpu_uuid), mps_log_dir(spec.root, spec.gpu_uuid)):
                directory.mkdir(parents=True, exist_ok=True)
            (spec.root / "shm").mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return f"cannot make the MPS directories under {spec.root}: {err.strerror}"
        try:
            await self._control(spec, "-d")
            for command in spec.limits:
                await self._control(spec, command=command)
        except ControlError as err:
            log.error("MPS control daemon of GPU %d did not start: %s", spec.gpu_index, err)
            return str(err)
        self._running[spec.gpu_uuid] = spec
        log.info("MPS control daemon of GPU %d up: %d replicas, %s", spec.gpu_index, spec.replicas,
                 "; ".join(spec.limits))
        return ""

    async def _stop(self, spec: DaemonSpec) -> None:
        try:
            await self._control(spec, command="quit")
            log.info("MPS control daemon of GPU %d stopped", spec.gpu_index)
        except ControlError as err:
            log.warning("MPS control daemon of GPU %d did not stop cleanly: %s", spec.gpu_index, err)

    async def stop_all(self) -> None:
        """Tell every daemon to quit, all at once."""
        await _each(self._stop(self._running.pop(uuid)) for uuid in list(self._running))


async def _each(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run the calls side by side; their results in order (an error cancels the others and is raised)."""
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(call) for call in calls]
    return [task.result() for task in tasks]
