"""A stateful fake of the pynvml call surface: MIG, events, faults, and state shared through a file."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import logging
import os
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import pynvml
from pydantic import BaseModel, ConfigDict, ValidationError

from agent.nvml import MockStateError
from agent.nvml.catalog import MIB, GpuModel, MigProfile, Placement
from agent.nvml.fake_telemetry import TELEMETRY_FUNCTIONS, FakeTelemetry
from agent.nvml.nodefile import GpuSpec, NodeSpec, normalize_bus_id
from agent.yamlfile import InputFileError, read_text_file

P = ParamSpec("P")
R = TypeVar("R")

WHOLE_GPU = 0xFFFFFFFF
"""gpuInstanceId / computeInstanceId of an event about the whole GPU."""

SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
)
MAX_MIG_DEVICES = 7
"""One MIG device per compute slice at most."""

# Drivers up to R535 cannot list GPU-instance profiles while MIG is disabled (NVIDIA/mig-parted#312); the
# first later production branch is taken as the one that can.
PROFILES_WITHOUT_MIG_FROM_DRIVER = 550

CRASH_AFTER_ENV = "GPU_AGENT_FAKE_CRASH_AFTER"
"""Test hook: the fake ends the process after this many state-changing calls (see :class:`FakeNvml`)."""
CRASH_EXIT_CODE = 137
"""The exit status of a process the crash hook ends: that of a process killed by SIGKILL."""

_EVENT_LOG_LIMIT = 256
_CROSS_PROCESS_POLL_S = 0.05

_PCIE_TOPOLOGY = {
    "single": pynvml.NVML_TOPOLOGY_SINGLE,
    "multiple": pynvml.NVML_TOPOLOGY_MULTIPLE,
    "hostbridge": pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
    "node": pynvml.NVML_TOPOLOGY_NODE,
    "system": pynvml.NVML_TOPOLOGY_SYSTEM,
}

# NVSwitch wiring per GPU link count: DGX/HGX H100 boards spread 18 links over four switches (5, 4, 4, 5),
# DGX A100 boards 12 links over six (2 each).
_SWITCH_LINKS = {18: (5, 4, 4, 5), 12: (2, 2, 2, 2, 2, 2)}
_SWITCH_PCI_DEVICE_ID = {
    pynvml.NVML_DEVICE_ARCH_AMPERE: 0x1AF110DE,
    pynvml.NVML_DEVICE_ARCH_HOPPER: 0x22A310DE,
}
_SWITCH_BUS_BASE = 0xE0

_CArgObject = type(ctypes.byref(ctypes.c_uint()))

MAX_STATE_BYTES = 64 * 1024 * 1024
"""The largest mock state file read (it grows with the events it keeps)."""

log = logging.getLogger(__name__)


PCI_3D_CONTROLLER = 0x030200
"""PCI class code of a 3D controller: a GPU in compute mode."""


def _nvml_error(code: int) -> pynvml.NVMLError:
    error: pynvml.NVMLError = pynvml.NVMLError(code)
    return error


# --- persisted state -----------------------------------------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ComputeInstance(_Record):
    id: int
    profile_id: int
    start: int
    size: int
    token: int


class _GpuInstance(_Record):
    id: int
    profile_id: int
    start: int
    size: int
    token: int
    compute_instances: list[_ComputeInstance] = []

    def ci(self, ci_id: int) -> _ComputeInstance | None:
        return next((c for c in self.compute_instances if c.id == ci_id), None)


class _GpuState(_Record):
    mig_current: int = pynvml.NVML_DEVICE_MIG_DISABLE
    mig_pending: int = pynvml.NVML_DEVICE_MIG_DISABLE
    gpu_instances: list[_GpuInstance] = []
    lost: bool = False
    busy: bool = False
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

    def gi(self, gi_id: int) -> _GpuInstance | None:
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
    next_token: int = 1
    next_seq: int = 1
    gpus: dict[str, _GpuState] = {}
    events: list[_EventRecord] = []


# --- handles -------------------------------------------------------------------------------------------

_KIND_GPU, _KIND_MIG, _KIND_GI, _KIND_CI, _KIND_EVENT_SET = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class _Ref:
    """What a handle names: kind, GPU index, GPU-instance id, compute-instance id, token."""

    kind: int
    gpu: int = 0
    gi: int = 0
    ci: int = 0
    token: int = 0

    @property
    def address(self) -> int:
        fields = (self.kind << 56) | (self.gpu << 48) | (self.gi << 40) | (self.ci << 32)
        return fields | (self.token & 0xFFFFFFFF)

    @classmethod
    def of(cls, handle: Any) -> _Ref | None:
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            return None
        if not address:
            return None
        return cls(
            kind=(address >> 56) & 0xFF,
            gpu=(address >> 48) & 0xFF,
            gi=(address >> 40) & 0xFF,
            ci=(address >> 32) & 0xFF,
            token=address & 0xFFFFFFFF,
        )

    def handle(self, pointer_type: Any) -> Any:
        return ctypes.cast(ctypes.c_void_p(self.address), pointer_type)


@dataclass
class _EventSet:
    registrations: dict[int, int] = field(default_factory=dict)
    queue: deque[_EventRecord] = field(default_factory=deque)
    freed: bool = False


@dataclass(frozen=True)
class _LinkEnd:
    """The far end of one NVLink: another GPU (by index) or an NVSwitch (by number)."""

    to_switch: bool
    peer: int


# --- ctypes argument helpers ---------------------------------------------------------------------------


def _referent(ref: Any, what: str) -> Any:
    """The ctypes object behind a ``byref()`` or ``pointer()`` argument."""
    if isinstance(ref, _CArgObject):
        return ref._obj  # type: ignore[attr-defined]
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    raise TypeError(f"{what} must be passed by reference (ctypes.byref), got {type(ref).__name__}")


def _count_ref(ref: Any) -> Any:
    count = _referent(ref, "count")
    if not isinstance(count, ctypes.c_uint):
        raise TypeError(f"count must refer to a ctypes.c_uint, got {type(count).__name__}")
    return count


def _out_array(ref: Any, element: Any) -> tuple[Any, int | None]:
    """A pointer to write ``element`` values through, and the buffer length when it is known."""
    if ref is None:
        return None, None
    target = ref._obj if isinstance(ref, _CArgObject) else ref  # type: ignore[attr-defined]
    if isinstance(target, ctypes.Array):
        if ctypes.sizeof(target._type_) != ctypes.sizeof(element):
            raise TypeError(f"array of {target._type_.__name__} where {element.__name__} is expected")
        return ctypes.cast(target, ctypes.POINTER(element)), len(target)
    if isinstance(target, ctypes._Pointer):
        return ctypes.cast(target, ctypes.POINTER(element)), None
    if isinstance(ref, _CArgObject) and ctypes.sizeof(target) == ctypes.sizeof(element):
        return ctypes.cast(ctypes.pointer(target), ctypes.POINTER(element)), None
    raise TypeError(f"expected a ctypes array of {element.__name__}, got {type(ref).__name__}")


def _placement_arg(ref: Any) -> Placement:
    if ref is None:
        raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    struct = _referent(ref, "placement")
    if ctypes.sizeof(struct) != ctypes.sizeof(pynvml.c_nvmlGpuInstancePlacement_t):
        raise TypeError(f"placement must be a c_nvmlGpuInstancePlacement_t, got {type(struct).__name__}")
    value = ctypes.cast(ctypes.pointer(struct), ctypes.POINTER(pynvml.c_nvmlGpuInstancePlacement_t)).contents
    return Placement(int(value.start), int(value.size))


def _text_arg(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _overlaps(a: Placement, b: Placement) -> bool:
    return a.start < b.start + b.size and b.start < a.start + a.size


def _gi_id_for(placement: Placement) -> int:
    """GPU-instance id by placement, as a freshly configured A100 numbers them (NVIDIA/DCGM#138):
    whole GPU 0, halves 1-2, quarters 3-6, eighths 7-14."""
    first = {8: 0, 4: 1, 2: 3, 1: 7}[placement.size]
    return first + placement.start // placement.size


def _crash_after_from_env() -> int | None:
    text = os.environ.get(CRASH_AFTER_ENV)
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{CRASH_AFTER_ENV} must be a whole number >= 1, got {text!r}")
    return int(text)


def _api(*, mutates: bool = False) -> Callable[
    [Callable[Concatenate[FakeNvml, P], R]], Callable[Concatenate[FakeNvml, P], R]
]:
    """Wrap a pynvml-named method: injected failures first, then the init check, then a state refresh."""

    def wrap(fn: Callable[Concatenate[FakeNvml, P], R]) -> Callable[Concatenate[FakeNvml, P], R]:
        name = fn.__name__
        needs_init = not name.startswith("nvmlInit")

        @functools.wraps(fn)
        def call(self: FakeNvml, /, *args: P.args, **kwargs: P.kwargs) -> R:
            with self._lock:
                self._take_injected_failure(name)
                if needs_init and self._refcount == 0:
                    raise _nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
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


def _fault(fn: Callable[Concatenate[FakeNvml, P], R]) -> Callable[Concatenate[FakeNvml, P], R]:
    """Wrap a fault-injection method: exclusive access to the state, persisted afterwards."""

    @functools.wraps(fn)
    def call(self: FakeNvml, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock, self._exclusive():
            result = fn(self, *args, **kwargs)
            self._persist()
            return result

    return call


API_FUNCTIONS: set[str] = set(TELEMETRY_FUNCTIONS)
"""Names of the pynvml functions the fake implements (filled as the class body is evaluated)."""


class FakeNvml(FakeTelemetry):
    """A simulated NVML driver for ``spec``; ``state_file`` shares its mutable state across processes.

    The methods have pynvml's names, positional signatures, return shapes and errors, so code written
    against the ``pynvml`` module runs unchanged with ``lib = FakeNvml(spec)``; constants still come from
    pynvml. Handles are ctypes pointers of pynvml's handle types whose addresses encode what they name;
    they are never dereferenced. With a state file, every mutation is written atomically and every call
    first re-reads the file if another process changed it, so several processes see one driver.

    Test hook: with ``GPU_AGENT_FAKE_CRASH_AFTER=N`` in the environment when the fake is built, the process
    ends with ``os._exit(137)`` right after the N-th successful state-changing pynvml call (MIG mode, GPU or
    compute instance create/destroy) has been persisted and its cross-process lock released: a stand-in for
    a SIGKILL between two driver calls, for crash tests. Fault-injection methods do not count.
    """

    def __init__(self, spec: NodeSpec, state_file: Path | None = None) -> None:
        self.spec = spec
        self.state_file = state_file
        self._lock = threading.RLock()
        self._events_ready = threading.Condition(self._lock)
        self._refcount = 0
        self._crash_after = _crash_after_from_env()
        self._changes = 0
        self._failures: dict[str, deque[int]] = {}
        self._event_sets: dict[int, _EventSet] = {}
        self._next_event_set = 1
        self._file_key: tuple[int, int, int] | None = None
        self.state_problem: str | None = None
        """Why the state file cannot be used (one line), while it cannot; None when it can."""
        self._by_uuid = {g.uuid: g for g in spec.gpus}
        self._by_bus = {g.pci_bus_id: g for g in spec.gpus}
        self._links = [self._wire_nvlinks(g) for g in spec.gpus]
        self._state = self._fresh_state()
        if state_file is not None and state_file.exists():
            self._state = self._read_state(state_file)
            self._file_key = self._stat_key(state_file)
            self._complete_state()
        self._seen_seq = self._state.next_seq - 1

    # --- state and persistence ---------------------------------------------------------------------

    def _fresh_state(self) -> _State:
        return _State(node=self.spec.name, gpus={g.uuid: _GpuState() for g in self.spec.gpus})

    def _complete_state(self) -> None:
        for g in self.spec.gpus:
            self._state.gpus.setdefault(g.uuid, _GpuState())

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
        if not isinstance(data, dict) or "format" not in data or "gpus" not in data:
            raise MockStateError(f"mock state {path}: not a fake NVML state file (no 'format' and 'gpus'); delete "
                                 "it to start the simulated node afresh")
        try:
            state = _State.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise MockStateError(f"mock state {path}: {where}: {first['msg'].lower()}; delete it to start the "
                                 "simulated node afresh") from None
        if state.node and state.node != self.spec.name:
            raise MockStateError(f"mock state {path}: written for node {state.node!r}, not {self.spec.name!r}")
        unknown = sorted(set(state.gpus) - set(self._by_uuid))
        if unknown:
            raise MockStateError(f"mock state {path}: GPU {unknown[0]} is not a GPU of node {self.spec.name!r}")
        return state

    def _sync(self) -> None:
        """Pick up changes another process wrote to the state file, and deliver its new events."""
        if self.state_file is None:
            return
        key = self._stat_key(self.state_file)
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
            raise _nvml_error(pynvml.NVML_ERROR_UNKNOWN) from None
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
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
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

    def _take_injected_failure(self, name: str) -> None:
        codes = self._failures.get(name)
        if codes:
            raise _nvml_error(codes.popleft())

    # --- lookups -----------------------------------------------------------------------------------

    def _gpu_state(self, index: int) -> _GpuState:
        return self._state.gpus[self.spec.gpus[index].uuid]

    def _check_gpu_index(self, index: int) -> GpuSpec:
        if not 0 <= index < len(self.spec.gpus):
            raise IndexError(f"GPU index {index} out of range 0..{len(self.spec.gpus) - 1}")
        return self.spec.gpus[index]

    def _ref(self, handle: Any, kinds: tuple[int, ...]) -> _Ref:
        ref = _Ref.of(handle)
        if ref is None or ref.kind not in kinds or ref.gpu >= len(self.spec.gpus):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ref

    def _device(self, handle: Any, *, allow_mig: bool = False, check_lost: bool = True) -> _Ref:
        """Decode a device handle (a GPU, or a MIG device where allowed); a lost GPU raises GpuIsLost."""
        ref = self._ref(handle, (_KIND_GPU, _KIND_MIG) if allow_mig else (_KIND_GPU,))
        if ref.kind == _KIND_MIG:
            self._mig_parts(ref)
        if check_lost and self._gpu_state(ref.gpu).lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ref

    def _mig_parts(self, ref: _Ref) -> tuple[_GpuInstance, _ComputeInstance]:
        gi = self._gpu_state(ref.gpu).gi(ref.gi)
        ci = gi.ci(ref.ci) if gi is not None else None
        if gi is None or ci is None or ci.token != ref.token:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi, ci

    def _gi(self, handle: Any) -> tuple[_Ref, _GpuInstance]:
        ref = self._ref(handle, (_KIND_GI,))
        gi = self._gpu_state(ref.gpu).gi(ref.gi)
        if gi is None or gi.token != ref.token:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpu_state(ref.gpu).lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ref, gi

    def _ci(self, handle: Any) -> tuple[_Ref, _GpuInstance, _ComputeInstance]:
        ref = self._ref(handle, (_KIND_CI,))
        gi, ci = self._mig_parts(ref)
        if self._gpu_state(ref.gpu).lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ref, gi, ci

    def _model(self, ref: _Ref) -> GpuModel:
        return self.spec.gpus[ref.gpu].model

    def _gpu_handle(self, index: int) -> Any:
        return _Ref(_KIND_GPU, gpu=index).handle(pynvml.c_nvmlDevice_t)

    def _gi_handle(self, index: int, gi: _GpuInstance) -> Any:
        return _Ref(_KIND_GI, gpu=index, gi=gi.id, token=gi.token).handle(pynvml.c_nvmlGpuInstance_t)

    def _ci_handle(self, index: int, gi: _GpuInstance, ci: _ComputeInstance) -> Any:
        ref = _Ref(_KIND_CI, gpu=index, gi=gi.id, ci=ci.id, token=ci.token)
        return ref.handle(pynvml.c_nvmlComputeInstance_t)

    def _mig_handle(self, index: int, gi: _GpuInstance, ci: _ComputeInstance) -> Any:
        ref = _Ref(_KIND_MIG, gpu=index, gi=gi.id, ci=ci.id, token=ci.token)
        return ref.handle(pynvml.c_nvmlDevice_t)

    def _next_token(self) -> int:
        token = self._state.next_token
        self._state.next_token = token % 0xFFFFFFFF + 1
        return token

    def _profile_for(self, gi: _GpuInstance, model: GpuModel) -> MigProfile:
        profile = model.profile_by_id(gi.profile_id)
        assert profile is not None, f"GPU instance {gi.id} has profile {gi.profile_id} unknown to {model.key}"
        return profile

    def _mig_devices(self, index: int) -> list[tuple[_GpuInstance, _ComputeInstance]]:
        """The GPU's MIG devices in enumeration order: by GPU-instance id, then compute-instance id."""
        state = self._gpu_state(index)
        return [(gi, ci) for gi in sorted(state.gpu_instances, key=lambda g: g.id)
                for ci in sorted(gi.compute_instances, key=lambda c: c.id)]

    def mig_uuid(self, gpu_index: int, gi_id: int, ci_id: int) -> str:
        """The UUID the fake gives the MIG device (GPU instance ``gi_id``, compute instance ``ci_id``)."""
        parent = uuidlib.UUID(self._check_gpu_index(gpu_index).uuid.removeprefix("GPU-"))
        return f"MIG-{uuidlib.uuid5(parent, f'{gi_id}/{ci_id}')}"

    # --- NVLink wiring -----------------------------------------------------------------------------

    def _wire_nvlinks(self, gpu: GpuSpec) -> list[_LinkEnd | None]:
        """Each link of the GPU and its far end; None for a link that goes nowhere (inactive)."""
        links = gpu.model.nvlink_links
        if links == 0:
            return []
        ends: list[_LinkEnd | None] = []
        if self.spec.nvswitch:
            for switch, count in enumerate(_SWITCH_LINKS.get(links, (links,))):
                ends.extend([_LinkEnd(True, switch)] * count)
        else:
            for peer, count in self.spec.nvlink_peers(gpu.index):
                ends.extend([_LinkEnd(False, peer)] * count)
        return ends + [None] * (links - len(ends))

    def _pci_info(self, gpu: GpuSpec) -> Any:
        return self._pci_struct(gpu.pci_bus_id, gpu.model.pci_device_id)

    @staticmethod
    def _pci_struct(bus_id: str, device_id: int) -> Any:
        domain, bus, rest = bus_id.split(":")
        device, _ = rest.split(".")
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{rest}".encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device, 16)
        info.pciDeviceId = device_id
        info.pciSubSystemId = 0
        info.busId = bus_id.encode()
        return info

    def _switch_pci_info(self, gpu: GpuSpec, switch: int) -> Any:
        bus_id = f"00000000:{_SWITCH_BUS_BASE + switch:02X}:00.0"
        return self._pci_struct(bus_id, _SWITCH_PCI_DEVICE_ID.get(gpu.model.architecture, 0x22A310DE))

    def _link_end(self, handle: Any, link: int) -> tuple[GpuSpec, _LinkEnd | None]:
        ref = self._device(handle)
        gpu = self.spec.gpus[ref.gpu]
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link >= gpu.model.nvlink_links:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, self._links[ref.gpu][link]

    def _active_link(self, handle: Any, link: int) -> tuple[GpuSpec, _LinkEnd]:
        gpu, end = self._link_end(handle, link)
        if end is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, end

    # --- MIG helpers -------------------------------------------------------------------------------

    def _mig_model(self, ref: _Ref) -> GpuModel:
        model = self._model(ref)
        if not model.mig_capable:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    def _mig_enabled(self, ref: _Ref) -> GpuModel:
        model = self._mig_model(ref)
        if self._gpu_state(ref.gpu).mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    def _gi_profile(self, model: GpuModel, profile_id: int) -> MigProfile:
        profile = model.profile_by_id(profile_id)
        if profile is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return profile

    def _profiles_listable(self, ref: _Ref) -> GpuModel:
        model = self._mig_model(ref)
        mig_on = self._gpu_state(ref.gpu).mig_current == pynvml.NVML_DEVICE_MIG_ENABLE
        if not mig_on and self.spec.driver_major < PROFILES_WITHOUT_MIG_FROM_DRIVER:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    @staticmethod
    def _gi_profile_struct(profile: MigProfile, version: int) -> Any:
        if version == 2:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = f"MIG {profile.name}".encode()
        elif version == 1:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise _nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = profile.id
        info.isP2pSupported = 0
        info.sliceCount = profile.slice_count
        info.instanceCount = profile.instance_count
        info.multiprocessorCount = profile.multiprocessor_count
        info.copyEngineCount = profile.copy_engines
        info.decoderCount = profile.decoders
        info.encoderCount = profile.encoders
        info.jpegCount = profile.jpegs
        info.ofaCount = profile.ofas
        info.memorySizeMB = profile.memory_size_mib
        return info

    @staticmethod
    def _occupied(state: _GpuState) -> list[Placement]:
        return [Placement(g.start, g.size) for g in state.gpu_instances]

    @staticmethod
    def _free(placements: tuple[Placement, ...], occupied: list[Placement]) -> list[Placement]:
        return [p for p in placements if not any(_overlaps(p, o) for o in occupied)]

    def _choose_placement(self, model: GpuModel, profile: MigProfile, occupied: list[Placement]) -> Placement:
        """NVML's own pick when no placement is given: the free one that blocks the fewest other free
        placements, lowest start on a tie. This reproduces real layouts (3g lands at 4:4 first, so a 4g
        still fits at 0:4); it is a model, not NVIDIA's algorithm."""
        candidates = self._free(profile.placements, occupied)
        if not candidates:
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        every = sorted({p for q in model.mig_profiles for p in q.placements})
        still_free = self._free(tuple(every), occupied)
        return min(candidates, key=lambda c: (sum(_overlaps(c, p) for p in still_free), c.start))

    def _create_gi(self, handle: Any, profile_id: int, placement: Placement | None) -> Any:
        ref = self._device(handle)
        model = self._mig_enabled(ref)
        profile = self._gi_profile(model, profile_id)
        state = self._gpu_state(ref.gpu)
        if placement is not None and placement not in profile.placements:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if sum(g.profile_id == profile_id for g in state.gpu_instances) >= profile.instance_count:
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        occupied = self._occupied(state)
        if placement is None:
            placement = self._choose_placement(model, profile, occupied)
        elif any(_overlaps(placement, o) for o in occupied):
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi = _GpuInstance(
            id=_gi_id_for(placement),
            profile_id=profile_id,
            start=placement.start,
            size=placement.size,
            token=self._next_token(),
        )
        state.gpu_instances.append(gi)
        return self._gi_handle(ref.gpu, gi)

    def _write_handles(self, out: Any, count_ref: Any, handles: list[Any], element: Any) -> None:
        count = _count_ref(count_ref)
        pointer, length = _out_array(out, element)
        if pointer is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        capacity = length if length is not None else count.value
        if capacity < len(handles):
            count.value = len(handles)
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, h in enumerate(handles):
            pointer[i] = h
        count.value = len(handles)

    def _clear_layout(self, state: _GpuState) -> None:
        state.gpu_instances = []

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

    def _event_set(self, handle: Any) -> _EventSet:
        ref = _Ref.of(handle)
        event_set = None
        if ref is not None and ref.kind == _KIND_EVENT_SET:
            event_set = self._event_sets.get(ref.token)
        if event_set is None or event_set.freed:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return event_set

    # ===============================================================================================
    # pynvml functions
    # ===============================================================================================

    # --- init and system ---------------------------------------------------------------------------

    @_api()
    def nvmlInitWithFlags(self, flags: int) -> None:
        if not self._state.driver_loaded:
            raise _nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._refcount += 1

    @_api()
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @_api()
    def nvmlShutdown(self) -> None:
        self._refcount -= 1

    @_api()
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.spec.driver_version

    @_api()
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.spec.cuda_driver_version

    @_api()
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.spec.cuda_driver_version

    @_api()
    def nvmlSystemGetNVMLVersion(self) -> str:
        return f"{self.spec.cuda_version.split('.')[0]}.{self.spec.driver_version}"

    # --- enumeration and identity ------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetCount(self) -> int:
        return len(self.spec.gpus)

    @_api()
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self.spec.gpus):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpu_state(index).lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpu_handle(index)

    @_api()
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        text = _text_arg(uuid)
        gpu = self._by_uuid.get(text)
        if gpu is not None:
            if self._gpu_state(gpu.index).lost:
                raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
            return self._gpu_handle(gpu.index)
        for g in self.spec.gpus:
            for gi, ci in self._mig_devices(g.index):
                if self.mig_uuid(g.index, gi.id, ci.id) == text:
                    if self._gpu_state(g.index).lost:
                        raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return self._mig_handle(g.index, gi, ci)
        raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    @_api()
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> Any:
        bus_id = normalize_bus_id(_text_arg(pciBusId))
        gpu = self._by_bus.get(bus_id) if bus_id is not None else None
        if gpu is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        if self._gpu_state(gpu.index).lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpu_handle(gpu.index)

    @_api()
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        ref = self._device(handle, allow_mig=True)
        if ref.kind == _KIND_MIG:
            return self.mig_uuid(ref.gpu, ref.gi, ref.ci)
        return self.spec.gpus[ref.gpu].uuid

    @_api()
    def nvmlDeviceGetName(self, handle: Any) -> str:
        ref = self._device(handle, allow_mig=True)
        model = self._model(ref)
        if ref.kind == _KIND_MIG:
            gi, _ = self._mig_parts(ref)
            return f"{model.nvml_name} MIG {self._profile_for(gi, model).name}"
        return model.nvml_name

    @_api()
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._device(handle).gpu

    @_api()
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self.spec.gpus[self._device(handle).gpu].minor_number

    @_api()
    def nvmlDeviceGetVirtualizationMode(self, handle: Any) -> int:
        self._device(handle)
        return int(pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE)  # bare metal

    @_api()
    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        return self.spec.gpus[self._device(handle).gpu].serial

    @_api()
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        return self._pci_info(self.spec.gpus[self._device(handle).gpu])

    @_api()
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    @_api()
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        ref = self._device(handle, allow_mig=True)
        model = self._model(ref)
        if ref.kind == _KIND_MIG:
            gi, _ = self._mig_parts(ref)
            total = self._profile_for(gi, model).memory_size_mib * MIB
        else:
            total = model.memory_mib * MIB
        mig_uuid = self.mig_uuid(ref.gpu, ref.gi, ref.ci) if ref.kind == _KIND_MIG else None
        used, reserved = self._live_memory(ref.gpu, total, mig_uuid)
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)
        if version != pynvml.nvmlMemory_v2:
            raise _nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved,
                                        free=total - used - reserved, used=used)

    @_api()
    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        return self._model(self._device(handle, allow_mig=True)).architecture

    @_api()
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._model(self._device(handle, allow_mig=True)).compute_capability

    @_api()
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        # Only GPUs that are NUMA nodes themselves (coherent platforms) answer; these x86 nodes do not.
        self._device(handle)
        raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @_api()
    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        ref = self._device(handle, allow_mig=True)
        model = self._model(ref)
        attrs = pynvml.c_nvmlDeviceAttributes()
        if ref.kind == _KIND_MIG:
            gi, _ = self._mig_parts(ref)
            profile = self._profile_for(gi, model)
            attrs.multiprocessorCount = profile.multiprocessor_count
            attrs.sharedCopyEngineCount = profile.copy_engines
            attrs.sharedDecoderCount = profile.decoders
            attrs.sharedEncoderCount = profile.encoders
            attrs.sharedJpegCount = profile.jpegs
            attrs.sharedOfaCount = profile.ofas
            attrs.gpuInstanceSliceCount = profile.slice_count
            attrs.computeInstanceSliceCount = profile.slice_count
            attrs.memorySizeMB = profile.memory_size_mib
            return attrs
        attrs.multiprocessorCount = model.multiprocessor_count
        attrs.memorySizeMB = model.memory_mib
        return attrs

    # --- topology and NVLink -----------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a, b = self._device(device1).gpu, self._device(device2).gpu
        if a == b:
            return int(pynvml.NVML_TOPOLOGY_INTERNAL)
        return int(_PCIE_TOPOLOGY[self.spec.pcie_level(a, b)])

    @_api()
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        _, end = self._link_end(device, link)
        return int(pynvml.NVML_FEATURE_DISABLED if end is None else pynvml.NVML_FEATURE_ENABLED)

    @_api()
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        gpu, end = self._active_link(device, link)
        if end.to_switch:
            return self._switch_pci_info(gpu, end.peer)
        return self._pci_info(self.spec.gpus[end.peer])

    @_api()
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        _, end = self._active_link(handle, link)
        kind = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if end.to_switch else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
        return int(kind)

    # --- MIG mode ----------------------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        ref = self._device(device)
        self._mig_model(ref)
        state = self._gpu_state(ref.gpu)
        return [state.mig_current, state.mig_pending]

    @_api(mutates=True)
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        """Returns the activation status (mig-profiles.md section 6). Hopper and later switch at once when
        the GPU is idle; Ampere keeps the new mode pending until a GPU reset (``reset_gpu``), as does any
        GPU with clients (``set_gpu_busy``): both report NVML_ERROR_IN_USE as the activation status.
        Disabling MIG while GPU instances exist fails with InUse: destroy them first."""
        ref = self._device(device)
        model = self._mig_model(ref)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpu_state(ref.gpu)
        if mode == pynvml.NVML_DEVICE_MIG_DISABLE and state.gpu_instances:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        state.mig_pending = mode
        if state.mig_current == mode:
            return int(pynvml.NVML_SUCCESS)
        if model.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER and not state.busy:
            state.mig_current = mode
            self._clear_layout(state)
            return int(pynvml.NVML_SUCCESS)
        return int(pynvml.NVML_ERROR_IN_USE)

    # --- GPU-instance profiles ---------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        ref = self._device(device)
        model = self._mig_model(ref)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._profiles_listable(ref)
        found = model.profile_by_index(profile)
        if found is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._gi_profile_struct(found, version)

    @_api()
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        ref = self._device(device)
        model = self._profiles_listable(ref)
        return self._gi_profile_struct(self._gi_profile(model, profileId), 2)

    # pynvml binds these names to the same functions.
    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo
    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    @_api()
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        ref = self._device(device)
        profile = self._gi_profile(self._mig_enabled(ref), profileId)
        state = self._gpu_state(ref.gpu)
        left = profile.instance_count - sum(g.profile_id == profileId for g in state.gpu_instances)
        return max(0, min(left, len(self._free(profile.placements, self._occupied(state)))))

    @_api()
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """All placements of the profile, free or not. ``placementsRef`` None asks for the count only;
        otherwise ``countRef`` holds the array's capacity on entry (InsufficientSize when short)."""
        ref = self._device(device)
        profile = self._gi_profile(self._mig_enabled(ref), profileId)
        count = _count_ref(countRef)
        pointer, length = _out_array(placementsRef, pynvml.c_nvmlGpuInstancePlacement_t)
        needed = len(profile.placements)
        if pointer is not None:
            capacity = count.value if length is None else min(count.value, length)
            if capacity < needed:
                count.value = needed
                raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, p in enumerate(profile.placements):
                pointer[i].start = p.start
                pointer[i].size = p.size
        count.value = needed
        return int(pynvml.NVML_SUCCESS)

    # --- GPU instances -----------------------------------------------------------------------------

    @_api(mutates=True)
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        return self._create_gi(device, profileId, None)

    @_api(mutates=True)
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        return self._create_gi(device, profileId, _placement_arg(placement))

    @_api()
    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        ref = self._device(device)
        self._gi_profile(self._mig_enabled(ref), profileId)
        found = sorted((g for g in self._gpu_state(ref.gpu).gpu_instances if g.profile_id == profileId),
                       key=lambda g: g.id)
        handles = [self._gi_handle(ref.gpu, g) for g in found]
        self._write_handles(gpuInstancesRef, countRef, handles, pynvml.c_nvmlGpuInstance_t)
        return int(pynvml.NVML_SUCCESS)

    @_api()
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        ref = self._device(device)
        self._mig_enabled(ref)
        gi = self._gpu_state(ref.gpu).gi(gpuInstanceId)
        if gi is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._gi_handle(ref.gpu, gi)

    @_api()
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        ref, gi = self._gi(gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._gpu_handle(ref.gpu)
        info.id = gi.id
        info.profileId = gi.profile_id
        info.placement = pynvml.c_nvmlGpuInstancePlacement_t(gi.start, gi.size)
        return info

    @_api(mutates=True)
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        ref, gi = self._gi(gpuInstance)
        if gi.compute_instances:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        state = self._gpu_state(ref.gpu)
        state.gpu_instances = [g for g in state.gpu_instances if g.id != gi.id]
        return int(pynvml.NVML_SUCCESS)

    # --- compute instances -------------------------------------------------------------------------

    def _ci_profile(self, ref: _Ref, gi: _GpuInstance) -> MigProfile:
        return self._profile_for(gi, self._model(ref))

    @_api()
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        """Only the compute-instance profile that spans the whole GPU instance is offered."""
        ref, gi = self._gi(device)
        if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= engProfile < pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi_profile = self._ci_profile(ref, gi)
        if profile != gi_profile.ci_profile_index:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            info.name = f"MIG {gi_profile.name}".encode()
        elif version == 1:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            raise _nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = gi_profile.ci_profile_id
        info.sliceCount = gi_profile.slice_count
        info.instanceCount = 1
        info.multiprocessorCount = gi_profile.multiprocessor_count
        info.sharedCopyEngineCount = gi_profile.copy_engines
        info.sharedDecoderCount = gi_profile.decoders
        info.sharedEncoderCount = gi_profile.encoders
        info.sharedJpegCount = gi_profile.jpegs
        info.sharedOfaCount = gi_profile.ofas
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    @_api()
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any, profileId: int) -> int:
        ref, gi = self._gi(gpuInstance)
        if profileId != self._ci_profile(ref, gi).ci_profile_id:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 0 if gi.compute_instances else 1

    @_api(mutates=True)
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        ref, gi = self._gi(gpuInstance)
        profile = self._ci_profile(ref, gi)
        if profileId != profile.ci_profile_id:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gi.compute_instances:
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci = _ComputeInstance(id=0, profile_id=profileId, start=0, size=profile.slice_count,
                              token=self._next_token())
        gi.compute_instances.append(ci)
        return self._ci_handle(ref.gpu, gi, ci)

    @_api()
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        ref, gi = self._gi(gpuInstance)
        if profileId != self._ci_profile(ref, gi).ci_profile_id:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        handles = [self._ci_handle(ref.gpu, gi, c) for c in sorted(gi.compute_instances, key=lambda c: c.id)]
        self._write_handles(computeInstancesRef, countRef, handles, pynvml.c_nvmlComputeInstance_t)
        return int(pynvml.NVML_SUCCESS)

    @_api()
    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        ref, gi = self._gi(gpuInstance)
        ci = gi.ci(computeInstanceId)
        if ci is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._ci_handle(ref.gpu, gi, ci)

    @_api()
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any:
        ref, gi, ci = self._ci(computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._gpu_handle(ref.gpu)
        info.gpuInstance = self._gi_handle(ref.gpu, gi)
        info.id = ci.id
        info.profileId = ci.profile_id
        info.placement = pynvml.c_nvmlComputeInstancePlacement_t(ci.start, ci.size)
        return info

    @_api()
    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)

    @_api(mutates=True)
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        _, gi, ci = self._ci(computeInstance)
        gi.compute_instances = [c for c in gi.compute_instances if c.id != ci.id]
        return int(pynvml.NVML_SUCCESS)

    # --- MIG devices -------------------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        """Zero unless MIG is supported and enabled."""
        ref = self._device(device)
        enabled = self._gpu_state(ref.gpu).mig_current == pynvml.NVML_DEVICE_MIG_ENABLE
        return MAX_MIG_DEVICES if self._model(ref).mig_capable and enabled else 0

    @_api()
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        ref = self._device(device)
        self._mig_model(ref)
        if not 0 <= index < MAX_MIG_DEVICES:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = self._mig_devices(ref.gpu)
        if index >= len(devices):
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = devices[index]
        return self._mig_handle(ref.gpu, gi, ci)

    @_api()
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        ref = self._ref(migDevice, (_KIND_MIG,))
        self._mig_parts(ref)
        return self._gpu_handle(ref.gpu)

    @_api()
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        ref = self._device(device, allow_mig=True, check_lost=False)
        return ctypes.c_uint(1 if ref.kind == _KIND_MIG else 0)

    @_api()
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        ref = self._ref(device, (_KIND_MIG,))
        gi, _ = self._mig_parts(ref)
        return gi.id

    @_api()
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        ref = self._ref(device, (_KIND_MIG,))
        _, ci = self._mig_parts(ref)
        return ci.id

    # --- events ------------------------------------------------------------------------------------

    @_api()
    def nvmlEventSetCreate(self) -> Any:
        key = self._next_event_set
        self._next_event_set += 1
        self._event_sets[key] = _EventSet()
        return _Ref(_KIND_EVENT_SET, token=key).handle(pynvml.c_nvmlEventSet_t)

    @_api()
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._device(handle)
        return int(SUPPORTED_EVENTS)

    @_api()
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        ref = self._device(handle)
        event_set = self._event_set(eventSet)
        if eventTypes & ~SUPPORTED_EVENTS:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.registrations[ref.gpu] = event_set.registrations.get(ref.gpu, 0) | eventTypes

    @_api()
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Block up to ``timeoutms`` for an event (the lock is released while waiting); Timeout if none."""
        event_set = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, timeoutms) / 1000
        while True:
            if event_set.freed:
                raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if event_set.queue:
                record = event_set.queue.popleft()
                data = pynvml.c_nvmlEventData_t()
                gpu = self._by_uuid[record.gpu_uuid]
                data.device = self._gpu_handle(gpu.index)
                data.eventType = record.event_type
                data.eventData = record.data
                data.gpuInstanceId = record.gpu_instance
                data.computeInstanceId = record.compute_instance
                return data
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _nvml_error(pynvml.NVML_ERROR_TIMEOUT)
            if self.state_file is None:
                self._events_ready.wait(remaining)
            else:
                # Another process may add events to the file: look at it now and then.
                self._events_ready.wait(min(remaining, _CROSS_PROCESS_POLL_S))
                self._sync()

    @_api()
    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @_api()
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        event_set = self._event_set(eventSet)
        event_set.freed = True
        self._events_ready.notify_all()

    # --- health ------------------------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        state = self._gpu_state(self._device(handle).gpu)
        corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        volatile, aggregate = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
        counters = {
            (corrected, volatile): state.ecc_corrected_volatile,
            (corrected, aggregate): state.ecc_corrected_aggregate,
            (uncorrected, volatile): state.ecc_uncorrected_volatile,
            (uncorrected, aggregate): state.ecc_uncorrected_aggregate,
        }
        if (errorType, counterType) not in counters:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return counters[errorType, counterType]

    @_api()
    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        self._device(handle)
        return [pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_ENABLED]

    @_api()
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        """Page retirement is the pre-Ampere mechanism; Ampere and later remap rows instead."""
        ref = self._device(device)
        if self._model(ref).architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(self._gpu_state(ref.gpu).retired_pages_pending)

    @_api()
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        """Ampere and later; not on a MIG-enabled GPU while it has GPU instances."""
        ref = self._device(device)
        state = self._gpu_state(ref.gpu)
        if self._model(ref).architecture < pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if state.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE and state.gpu_instances:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (state.remapped_correctable, state.remapped_uncorrectable,
                int(state.remap_pending), int(state.remap_failure))

    @_api()
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu_state(self._device(handle).gpu).clocks_event_reasons

    @_api()
    def nvmlDeviceGetTemperatureV(
        self, handle: Any, sensor: int, version: int = pynvml.nvmlTemperature_v1
    ) -> int:
        if version != pynvml.nvmlTemperature_v1:
            raise _nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return self._temperature(handle, sensor)

    @_api()
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._temperature(handle, sensor)

    def _temperature(self, handle: Any, sensor: int) -> int:
        ref = self._device(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._live_temperature(ref.gpu, self._gpu_state(ref.gpu).temperature_c)

    @_api()
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        ref = self._device(handle)
        return self._live_power_mw(ref.gpu, self._gpu_state(ref.gpu).power_mw)

    @_api()
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        """Busy percentages over the last sample period; NotSupported with MIG on, as on real GPUs."""
        ref = self._device(handle)
        state = self._gpu_state(ref.gpu)
        if state.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlUtilization_t(*self._live_utilization(ref.gpu, state.utilization_gpu,
                                                                  state.utilization_memory))

    # ===============================================================================================
    # Fault injection and simulated operator actions (not pynvml functions; no nvmlInit needed)
    # ===============================================================================================

    @_fault
    def inject_xid(
        self, gpu_index: int, xid: int, gi_id: int | None = None, ci_id: int | None = None
    ) -> None:
        """Raise an XID critical-error event on a GPU (or on one of its MIG devices)."""
        self._check_gpu_index(gpu_index)
        if ci_id is not None and gi_id is None:
            raise ValueError("ci_id needs gi_id")
        gi = WHOLE_GPU if gi_id is None else gi_id
        ci = WHOLE_GPU if ci_id is None else ci_id
        self._record_event(gpu_index, pynvml.nvmlEventTypeXidCriticalError, xid, gi, ci)

    @_fault
    def set_gpu_lost(self, gpu_index: int, lost: bool = True) -> None:
        """A lost GPU (fallen off the bus) answers every call about it with GpuIsLost."""
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).lost = lost

    @_fault
    def set_ecc_uncorrected(self, gpu_index: int, count: int) -> None:
        """Set the volatile uncorrected ECC count; a rise also adds to the aggregate count and raises a
        double-bit ECC event."""
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        rise = count - state.ecc_uncorrected_volatile
        state.ecc_uncorrected_volatile = count
        if rise > 0:
            state.ecc_uncorrected_aggregate += rise
            self._record_event(gpu_index, pynvml.nvmlEventTypeDoubleBitEccError, 0, WHOLE_GPU, WHOLE_GPU)

    @_fault
    def set_ecc_corrected(self, gpu_index: int, count: int) -> None:
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        state.ecc_corrected_aggregate += max(0, count - state.ecc_corrected_volatile)
        state.ecc_corrected_volatile = count

    @_fault
    def set_remapped_rows(
        self,
        gpu_index: int,
        pending: bool = False,
        failure: bool = False,
        correctable: int = 0,
        uncorrectable: int = 0,
    ) -> None:
        gpu = self._check_gpu_index(gpu_index)
        if gpu.model.architecture < pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise ValueError(f"GPU {gpu_index} ({gpu.model.key}) retires pages instead of remapping rows")
        state = self._gpu_state(gpu_index)
        state.remap_pending, state.remap_failure = pending, failure
        state.remapped_correctable, state.remapped_uncorrectable = correctable, uncorrectable

    @_fault
    def set_retired_pages_pending(self, gpu_index: int, pending: bool = True) -> None:
        gpu = self._check_gpu_index(gpu_index)
        if gpu.model.architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
            raise ValueError(f"GPU {gpu_index} ({gpu.model.key}) remaps rows instead of retiring pages")
        self._gpu_state(gpu_index).retired_pages_pending = pending

    @_fault
    def set_clocks_event_reasons(self, gpu_index: int, reasons: int) -> None:
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).clocks_event_reasons = reasons

    @_fault
    def set_temperature(self, gpu_index: int, celsius: int) -> None:
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).temperature_c = celsius

    @_fault
    def set_power_usage(self, gpu_index: int, milliwatts: int) -> None:
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).power_mw = milliwatts

    @_fault
    def set_utilization(self, gpu_index: int, gpu_percent: int, memory_percent: int = 0) -> None:
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        state.utilization_gpu, state.utilization_memory = gpu_percent, memory_percent

    @_fault
    def set_gpu_busy(self, gpu_index: int, busy: bool = True) -> None:
        """Mark the GPU as held by clients: MIG mode changes stay pending and resets fail with InUse."""
        self._check_gpu_index(gpu_index)
        self._gpu_state(gpu_index).busy = busy

    @_fault
    def set_driver_loaded(self, loaded: bool = True) -> None:
        """Without the driver, nvmlInit raises DriverNotLoaded."""
        self._state.driver_loaded = loaded

    @_fault
    def reset_gpu(self, gpu_index: int) -> None:
        """What ``nvidia-smi -r`` does: apply a pending MIG mode, drop the MIG layout, clear volatile ECC
        counts and apply pending row remaps or page retirements. Fails with InUse while the GPU has
        clients and with GpuIsLost for a lost GPU."""
        self._check_gpu_index(gpu_index)
        state = self._gpu_state(gpu_index)
        if state.lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if state.busy:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        self._reset(state)

    @_fault
    def reboot(self) -> None:
        """A node reboot: every GPU is reset and loses its clients; MIG modes persist, layouts do not."""
        for gpu in self.spec.gpus:
            state = self._gpu_state(gpu.index)
            state.busy = False
            self._reset(state)

    def _reset(self, state: _GpuState) -> None:
        state.mig_current = state.mig_pending
        self._clear_layout(state)
        state.ecc_corrected_volatile = 0
        state.ecc_uncorrected_volatile = 0
        state.remap_pending = False
        state.retired_pages_pending = False

    def fail_next(self, function_name: str, error_code: int, times: int = 1) -> None:
        """Make the next ``times`` calls of a pynvml function raise ``NVMLError(error_code)``. An alias
        (``...ProfileInfoV``) fails together with the function it names, as in pynvml."""
        function = getattr(type(self), function_name, None)
        name = getattr(function, "__name__", None)
        if name not in API_FUNCTIONS:
            raise ValueError(f"FakeNvml has no pynvml function {function_name!r}")
        if error_code not in pynvml.NVMLError._valClassMapping:
            raise ValueError(f"unknown NVML error code {error_code}")
        with self._lock:
            self._failures.setdefault(str(name), deque()).extend([error_code] * times)

    def pci_class(self, bus_id: str) -> int | None:
        """The PCI class code Linux would report (sysfs ``class``): the simulated GPUs are 3D controllers (compute
        mode, no display), as data-centre GPUs are; None for a device that is not one of them."""
        normalized = normalize_bus_id(bus_id)
        return PCI_3D_CONTROLLER if normalized is not None and normalized in self._by_bus else None

    def numa_node(self, bus_id: str) -> int | None:
        """The NUMA node Linux would report for a PCI device (sysfs ``numa_node``); None when unknown."""
        normalized = normalize_bus_id(bus_id)
        gpu = self._by_bus.get(normalized) if normalized is not None else None
        return gpu.numa_node if gpu is not None else None
