"""The fake NVML's state: the records it keeps per GPU (persisted as JSON with ``--mock-state``), the lock
around them, the cross-process file and its lock, the event log, and the wrappers every call and every fault
goes through (injected failures, the init check, a state refresh, persistence)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import pynvml
from pydantic import BaseModel, ConfigDict, ValidationError

from agent.nvml import MockStateError
from agent.nvml.fake_telemetry import TELEMETRY_FUNCTIONS, FakeTelemetry
from agent.nvml.nodefile import GpuSpec, NodeSpec
from agent.yamlfile import InputFileError, clip, read_text_file, shown, sync_directory

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="FakeState")

WHOLE_GPU = 0xFFFFFFFF
"""gpuInstanceId / computeInstanceId of an event about the whole GPU."""

CRASH_AFTER_ENV = "GPU_AGENT_FAKE_CRASH_AFTER"
"""Test hook: the fake ends the process after this many state-changing calls (see :class:`FakeNvml`)."""
CRASH_EXIT_CODE = 137
"""The exit status of a process the crash hook ends: that of a process killed by SIGKILL."""

_EVENT_LOG_LIMIT = 256

MAX_STATE_BYTES = 256 * 1024
"""The largest mock state file read: the state of 64 GPUs in MIG mode with the 256 events kept is a fraction of
it, and reading any file up to it costs at most 20 MB of memory and 1 s of CPU (bench/input_cost.py)."""

log = logging.getLogger("agent.nvml.fake")


def nvml_error(code: int) -> pynvml.NVMLError:
    error: pynvml.NVMLError = pynvml.NVMLError(code)
    return error


# --- persisted state -----------------------------------------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ComputeInstance(_Record):
    id: int
    profile_id: int
    start: int
    size: int
    token: int


class GpuInstance(_Record):
    id: int
    profile_id: int
    start: int
    size: int
    token: int
    compute_instances: list[ComputeInstance] = []

    def ci(self, ci_id: int) -> ComputeInstance | None:
        return next((c for c in self.compute_instances if c.id == ci_id), None)


class GpuState(_Record):
    mig_current: int = pynvml.NVML_DEVICE_MIG_DISABLE
    mig_pending: int = pynvml.NVML_DEVICE_MIG_DISABLE
    gpu_instances: list[GpuInstance] = []
    lost: bool = False
    lost_keeps_handle: bool = False
    """How NVML shows the lost GPU: False, no handle (nvmlDeviceGetHandleByIndex fails with GPU_IS_LOST); True, the
    handle is given and every call on it fails with GPU_IS_LOST."""
    busy: bool = False
    hung: bool = False
    """Every call about this GPU blocks until it is unhung, as on a GPU whose driver calls no longer return."""
    ecc_corrected_volatile: int = 0
    ecc_uncorrected_volatile: int = 0
    ecc_corrected_aggregate: int = 0
    ecc_uncorrected_aggregate: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    retired_pages_pending: bool = False
    clocks_event_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle
    temperature_c: int = 34
    power_mw: int = 70_000
    utilization_gpu: int = 0
    utilization_memory: int = 0

    def gi(self, gi_id: int) -> GpuInstance | None:
        return next((g for g in self.gpu_instances if g.id == gi_id), None)


class _EventRecord(_Record):
    seq: int
    gpu_uuid: str
    event_type: int
    data: int
    gpu_instance: int = WHOLE_GPU
    compute_instance: int = WHOLE_GPU


class _State(_Record):
    format: Literal[1] = 1
    node: str = ""
    driver_loaded: bool = True
    driver_hung: bool = False
    """Every call blocks until the driver is unhung (a wedged driver, a GPU off the bus holding it)."""
    next_token: int = 1
    next_seq: int = 1
    gpus: dict[str, GpuState] = {}
    events: list[_EventRecord] = []


@dataclass
class EventSet:
    registrations: dict[int, int] = field(default_factory=dict)
    queue: deque[_EventRecord] = field(default_factory=deque)
    freed: bool = False


HANG_POLL_S = 0.02


def crash_after_from_env() -> int | None:
    text = os.environ.get(CRASH_AFTER_ENV)
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{CRASH_AFTER_ENV} must be a whole number >= 1, got {text!r}")
    return int(text)


def api_call(*, mutates: bool = False) -> Callable[
    [Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R]
]:
    """Wrap a pynvml-named method: injected failures first, then the init check, then a state refresh."""

    def wrap(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
        name = fn.__name__
        needs_init = not name.startswith("nvmlInit")

        @functools.wraps(fn)
        def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            self._wait_while_hung(args)
            with self._lock:
                self._take_injected_failure(name)
                if needs_init and self._refcount == 0:
                    raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
                if not mutates:
                    self._sync()
                    return fn(self, *args, **kwargs)
                with self._exclusive():
                    result = fn(self, *args, **kwargs)
                    self._persist()
                self._count_change()
                return result

        API_FUNCTIONS.add(name)
        return call

    return wrap


def fault_call(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Wrap a fault-injection method: exclusive access to the state, persisted afterwards."""

    @functools.wraps(fn)
    def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock, self._exclusive():
            result = fn(self, *args, **kwargs)
            self._persist()
            return result

    return call


API_FUNCTIONS: set[str] = set(TELEMETRY_FUNCTIONS)
"""Names of the pynvml functions the fake implements (filled as the class body is evaluated)."""


class FakeState(FakeTelemetry):
    """The state, its lock and its persistence; the bottom of FakeNvml."""

    # Set by FakeNvml.__init__:
    spec: NodeSpec
    state_file: Path | None
    _lock: threading.RLock
    _events_ready: threading.Condition
    _refcount: int
    _crash_after: int | None
    _changes: int
    _lose_at: tuple[int, int, bool] | None
    """(change count, GPU index, keeps its handle): the GPU falls off the bus right after that change."""
    _failures: dict[str, deque[int]]
    _event_sets: dict[int, EventSet]
    _next_event_set: int
    _file_key: tuple[int, int, int] | None
    state_problem: str | None
    _by_uuid: dict[str, GpuSpec]
    _by_bus: dict[str, GpuSpec]
    _state: _State
    _seen_seq: int

    # --- state and persistence ---------------------------------------------------------------------

    def _fresh_state(self) -> _State:
        return _State(node=self.spec.name, gpus={g.uuid: GpuState() for g in self.spec.gpus})

    def _complete_state(self) -> None:
        for g in self.spec.gpus:
            self._state.gpus.setdefault(g.uuid, GpuState())

    @staticmethod
    def _stat_key(path: Path) -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read_state(self, path: Path) -> _State:
        """The state another process (or an earlier run) wrote; MockStateError in one line when it is not one
        this fake wrote for this node."""
        try:
            text = read_text_file(path, MAX_STATE_BYTES)
        except InputFileError as err:
            raise MockStateError(f"mock state {err}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise MockStateError(f"mock state {path}: not JSON ({err.msg} at line {err.lineno}, column "
                                 f"{err.colno}); delete it to start the simulated node afresh") from None
        except (RecursionError, ValueError) as err:  # nested past the recursion limit; a number too long to read
            why = "nested too deeply" if isinstance(err, RecursionError) else "a number too long to read"
            raise MockStateError(f"mock state {path}: not a fake NVML state file ({why}); delete it to start the "
                                 "simulated node afresh") from None
        if not isinstance(data, dict) or "format" not in data or "gpus" not in data:
            raise MockStateError(f"mock state {path}: not a fake NVML state file (no 'format' and 'gpus'); delete "
                                 "it to start the simulated node afresh")
        try:
            state = _State.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(clip(str(part)) for part in first["loc"]) or "(top level)"
            raise MockStateError(f"mock state {path}: {where}: {first['msg'].lower()}; delete it to start the "
                                 "simulated node afresh") from None
        if state.node and state.node != self.spec.name:
            raise MockStateError(f"mock state {path}: written for node {shown(state.node)}, not {self.spec.name!r}")
        unknown = sorted(set(state.gpus) - set(self._by_uuid))
        if unknown:
            raise MockStateError(f"mock state {path}: GPU {clip(unknown[0])} is not a GPU of node {self.spec.name!r}")
        return state

    def _hangs(self, args: tuple[Any, ...]) -> bool:
        """Whether a call with these arguments blocks now: every call while the driver hangs (FakeHandles adds
        the calls about a hung GPU)."""
        return self._state.driver_hung

    def _wait_while_hung(self, args: tuple[Any, ...]) -> None:
        """Block, as the real library's call would, while the driver or the GPU the call is about hangs; the
        state is looked at again every HANG_POLL_S (another process unhangs it through the state file)."""
        while True:
            with self._lock:
                try:
                    self._sync()
                except pynvml.NVMLError:
                    return  # the call itself says what is wrong with the state
                if not self._hangs(args):
                    return
                if self.state_file is None:
                    # Only this process can unhang it (set_hung notifies): blocked as the real call is, not polling.
                    self._events_ready.wait()
                    continue
            time.sleep(HANG_POLL_S)

    def _sync(self) -> None:
        """Pick up changes another process wrote to the state file, and deliver its new events."""
        if self.state_file is None:
            return
        key = self._stat_key(self.state_file)
        if key is None and self.state_problem is not None:
            # The broken file was deleted, as its line advises: the simulated node starts afresh, its events
            # numbered from 1 again as in the file the next change writes.
            log.info("mock state %s: gone; the simulated node starts afresh", self.state_file)
            self._state, self._file_key, self._seen_seq, self.state_problem = self._fresh_state(), None, 0, None
            return
        if key is None or key == self._file_key:
            return
        try:
            state = self._read_state(self.state_file)
        except MockStateError as err:
            # As a broken driver does: every call fails until the file is usable again; the last good state
            # is kept, and the agent reports itself not ready with this line.
            if self.state_problem != str(err):
                log.error("%s", err)
            self.state_problem = str(err)
            raise nvml_error(pynvml.NVML_ERROR_UNKNOWN) from None
        self.state_problem = None
        self._state = state
        self._file_key = key
        self._complete_state()
        for record in self._state.events:
            if record.seq > self._seen_seq:
                self._deliver(record)

    def _persist(self) -> None:
        if self.state_file is None:
            return
        path = self.state_file.resolve()  # a symlink's target is what gets replaced, not the link
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        data = self._state.model_dump_json(indent=1).encode()
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            sync_directory(path.parent)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise MockStateError(f"mock state {self.state_file}: cannot write it: {err.strerror}") from None
        self._file_key = self._stat_key(path)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the cross-process lock (when there is a state file) around read-modify-write."""
        if self.state_file is None:
            yield
            return
        lock_path = self.state_file.with_name(self.state_file.name + ".lock")
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            parent = self.state_file.parent
            why = f"{parent} is not a directory" if parent.exists() and not parent.is_dir() else err.strerror
            raise MockStateError(f"mock state {self.state_file}: cannot write it: {why}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._sync()
            yield
        finally:
            os.close(fd)

    def _count_change(self) -> None:
        self._changes += 1
        if self._crash_after is not None and self._changes >= self._crash_after:
            os._exit(CRASH_EXIT_CODE)
        lose = self._lose_at
        if lose is not None and self._changes >= lose[0]:
            self._lose_at = None
            state = self._state.gpus[self.spec.gpus[lose[1]].uuid]
            state.lost, state.lost_keeps_handle = True, lose[2]

    def _take_injected_failure(self, name: str) -> None:
        codes = self._failures.get(name)
        if codes:
            raise nvml_error(codes.popleft())

    # --- events ------------------------------------------------------------------------------------

    def _record_event(self, index: int, event_type: int, data: int, gi: int, ci: int) -> None:
        record = _EventRecord(
            seq=self._state.next_seq,
            gpu_uuid=self.spec.gpus[index].uuid,
            event_type=event_type,
            data=data,
            gpu_instance=gi,
            compute_instance=ci,
        )
        self._state.next_seq += 1
        self._state.events = [*self._state.events[-(_EVENT_LOG_LIMIT - 1):], record]
        self._deliver(record)

    def _deliver(self, record: _EventRecord) -> None:
        self._seen_seq = max(self._seen_seq, record.seq)
        gpu = self._by_uuid.get(record.gpu_uuid)
        if gpu is None:
            return
        for event_set in self._event_sets.values():
            if not event_set.freed and event_set.registrations.get(gpu.index, 0) & record.event_type:
                event_set.queue.append(record)
        self._events_ready.notify_all()
