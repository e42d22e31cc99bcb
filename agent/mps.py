"""One MPS control daemon per GPU that the config shares with MPS: started, given its limits, checked,
restarted when it dies and stopped when the GPU is no longer shared. Its readiness goes into
NodeState.mps; the inventory withholds a GPU's MPS replicas until its daemon is up.

Every daemon the agent may have started is recorded from the moment `-d` runs, before its limits are sent, and
is sent `quit` (bounded by QUIT_TIMEOUT_S) on every way out: a limit command that fails, a cancellation (SIGTERM
or a reload while it starts), a config that no longer shares its GPU, and the agent's stop. A daemon the agent
did not start but finds running in a GPU's pipe directory (an earlier agent's, say) is quit and a new one
started: its limits may not be this agent's."""

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
QUIT_TIMEOUT_S = 3.0
"""How long a `quit` may take before the agent goes on without its answer: a stop of every daemon (they are
quit side by side) fits in the agent's stop (SIGTERM to exit in under 10 s; Agent.stop waits 5 s for a task)."""
RETRY_S = 1.0
"""The wait before a daemon that did not start is started again; it doubles with each failure in a row."""
RETRY_MAX_S = 60.0
"""The longest wait between two starts of a daemon that keeps failing."""


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
        daemon of the spec's pipe directory); its output, or ControlError. Cancelled, it leaves no control
        program running (a daemon that `-d` started before may run on: the caller quits it)."""


class ProgramControl:
    """Runs the driver's nvidia-cuda-mps-control as a process."""

    def program(self, config: AgentConfig) -> str | None:
        return control_program(config)

    async def __call__(self, spec: DaemonSpec, *args: str, command: str | None = None) -> str:
        return await _control(spec, *args, command=command)


async def _control(spec: DaemonSpec, *args: str, command: str | None = None) -> str:
    """Run the control program once (with -d it starts the daemon; otherwise it sends `command` on stdin); it is
    killed when it does not answer in COMMAND_TIMEOUT_S or the call is cancelled."""
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
        raise ControlError(f"{CONTROL} {command or ' '.join(args)} did not answer in {COMMAND_TIMEOUT_S:g}s") from None
    finally:
        if proc.returncode is None:  # timed out or cancelled: no control program outlives its call
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())  # reaped even when cancelled again meanwhile
    text = out.decode(errors="replace").strip()
    if proc.returncode != 0:
        what = command or " ".join(args)
        last = f": {text.splitlines()[-1]}" if text else ""
        raise ControlError(f"{CONTROL} {what} exited {proc.returncode}{last}")
    return text


@dataclass
class _Daemon:
    """A daemon the agent may have running: recorded before `-d` runs, dropped once it was told to quit."""

    spec: DaemonSpec
    started: bool = False
    """`-d` answered that it started (and it has not stopped answering since)."""
    ready: bool = False
    """Its limits are set: the GPU's replicas are served."""


@dataclass(frozen=True)
class _Failure:
    """A daemon that did not start: why, and when it is started again."""

    spec: DaemonSpec
    reason: str
    due: float
    delay: float


class MpsDaemons:
    """Keeps NodeState.mps true to the daemons it runs."""

    def __init__(self, bus: StateBus, interval: float = CHECK_INTERVAL_S, control: Control | None = None) -> None:
        self._bus = bus
        self._interval = interval
        self._control = control or ProgramControl()
        self._daemons: dict[str, _Daemon] = {}
        """Every daemon this agent may have running, by GPU uuid."""
        self._failed: dict[str, _Failure] = {}

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
        loop = asyncio.get_running_loop()
        try:
            next_check = loop.time()
            while True:
                check = loop.time() >= next_check  # probe the daemons on the interval, whatever else goes on
                if check:
                    next_check = loop.time() + self._interval
                state = self._bus.current
                status = await self._converge(state, check)
                seen = state.version  # a state published while it converged (a reload) is converged next
                if dict(state.mps) != status:
                    published = await self._bus.update(mps=status)
                    if published.version == seen + 1:  # its own, with nothing else published meanwhile
                        seen = published.version
                wake = min([next_check, *(f.due for f in self._failed.values())])
                with contextlib.suppress(TimeoutError):  # a new state: start or stop what it changes
                    async with asyncio.timeout(max(0.0, wake - loop.time())):
                        await self._bus.wait_newer(seen)
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
        self._failed = {u: f for u, f in self._failed.items() if wanted.get(u) == f.spec}
        await _each(self._stop(u) for u, daemon in list(self._daemons.items()) if wanted.get(u) != daemon.spec)
        return dict(zip(wanted, await _each(self._ensure(spec, check) for spec in wanted.values()), strict=True))

    async def _ensure(self, spec: DaemonSpec, check: bool) -> str:
        """'' when the GPU's daemon is up (probed when `check`; started when needed), else why not."""
        daemon = self._daemons.get(spec.gpu_uuid)
        if daemon is not None and daemon.ready:
            if not check:
                return ""
            try:
                await self._control(spec, command="get_default_active_thread_percentage")
                return ""
            except ControlError as err:
                log.warning("MPS control daemon of GPU %d stopped answering (%s); restarting it", spec.gpu_index, err)
                daemon.started = daemon.ready = False  # quit before the new one, as one that may linger
        failure = self._failed.get(spec.gpu_uuid)
        if failure is not None and asyncio.get_running_loop().time() < failure.due:
            return failure.reason  # backing off
        reason = await self._start(spec)
        if not reason:
            self._failed.pop(spec.gpu_uuid, None)
            log.info("MPS control daemon of GPU %d up: %d replicas, %s", spec.gpu_index, spec.replicas,
                     "; ".join(spec.limits))
            return ""
        delay = RETRY_S if failure is None else min(failure.delay * 2, RETRY_MAX_S)
        self._failed[spec.gpu_uuid] = _Failure(spec, reason, asyncio.get_running_loop().time() + delay, delay)
        log.error("MPS control daemon of GPU %d did not start: %s; trying again in %gs", spec.gpu_index, reason,
                  delay)
        return reason

    async def _start(self, spec: DaemonSpec) -> str:
        """Start the GPU's daemon and set its limits: '', or why not (one line; a daemon `-d` started was quit)."""
        uuid = spec.gpu_uuid
        pipe = mps_pipe_dir(spec.root, uuid)
        try:
            for directory in (pipe, mps_log_dir(spec.root, uuid)):
                directory.mkdir(parents=True, exist_ok=True)
            (spec.root / "shm").mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return f"cannot make the MPS directories under {spec.root}: {err.strerror}"
        if uuid in self._daemons:  # ours, from a start that was cut short or one that stopped answering
            await self._stop(uuid)
        elif (pipe / "control").exists():  # a daemon's socket: one may run that this agent did not start
            await self._quit_stranger(spec)
        daemon = self._daemons[uuid] = _Daemon(spec)  # from here on one may run: every way out quits it
        try:
            try:
                await self._control(spec, "-d")
            except ControlError:
                if not await self._quit_stranger(spec):  # "already running": quit it, start ours
                    raise
                await self._control(spec, "-d")
            daemon.started = True
            for command in spec.limits:
                await self._control(spec, command=command)
        except ControlError as err:
            if not daemon.started:
                del self._daemons[uuid]
                return str(err)
            problem = await self._quit(spec)
            del self._daemons[uuid]
            return str(err) if problem is None else f"{err}; quitting the daemon it started failed too: {problem}"
        daemon.ready = True
        return ""

    async def _quit(self, spec: DaemonSpec) -> str | None:
        """Send the daemon of the spec's pipe directory `quit`, waiting at most QUIT_TIMEOUT_S: None when it
        answered, else why not."""
        try:
            async with asyncio.timeout(QUIT_TIMEOUT_S):
                await self._control(spec, command="quit")
        except ControlError as err:
            return str(err)
        except TimeoutError:
            return f"{CONTROL} quit did not answer in {QUIT_TIMEOUT_S:g}s"
        return None

    async def _quit_stranger(self, spec: DaemonSpec) -> bool:
        """Quit a daemon this agent does not know of that runs in the spec's pipe directory: whether one did."""
        problem = await self._quit(spec)
        if problem is None:
            log.warning("MPS control daemon of GPU %d: one was running already (left by an earlier agent?); quit "
                        "it, to start one with this agent's limits", spec.gpu_index)
        return problem is None

    async def _stop(self, uuid: str) -> None:
        """Quit a daemon of ours; it is forgotten once told (a cancellation keeps it, for stop_all)."""
        daemon = self._daemons[uuid]
        problem = await self._quit(daemon.spec)
        if self._daemons.get(uuid) is daemon:
            del self._daemons[uuid]
        if problem is None:
            log.info("MPS control daemon of GPU %d stopped", daemon.spec.gpu_index)
        elif daemon.started:
            log.warning("MPS control daemon of GPU %d did not stop cleanly: %s", daemon.spec.gpu_index, problem)
        else:  # its start was cut short before `-d` answered, or it had stopped answering: likely none runs
            log.debug("MPS control daemon of GPU %d: none to stop (%s)", daemon.spec.gpu_index, problem)

    async def stop_all(self) -> None:
        """Tell every daemon the agent may have running to quit, all at once (in at most QUIT_TIMEOUT_S)."""
        self._failed.clear()
        await _each(self._stop(uuid) for uuid in list(self._daemons))


async def _each(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run the calls side by side; their results in order (an error cancels the others and is raised)."""
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(call) for call in calls]
    return [task.result() for task in tasks]
