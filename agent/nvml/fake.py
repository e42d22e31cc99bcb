"""A stateful fake of the pynvml call surface: MIG, events, faults, and state shared through a file.

:class:`FakeNvml` is the public entry point. It is built in layers, each a module of its own, each layer seeing
the ones below it:

- ``fake_telemetry.py``: clocks, energy, field values, GPM and the load model;
- ``fake_state.py``: the persisted records, the lock, the ``--mock-state`` file (read, written, locked across
  processes), the event log, and the wrappers every pynvml call and every fault goes through;
- ``fake_handles.py``: handles, the lookups from a handle to what it names, ctypes argument conventions, NVLink
  wiring;
- ``fake_mig.py``: the MIG model and the pynvml MIG calls;
- ``fake_calls.py``: the other pynvml calls (init, system, enumeration, topology, events, health);
- ``fake_faults.py``: fault injection and simulated operator actions.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

from agent.nvml.fake_faults import FakeFaults
from agent.nvml.fake_state import API_FUNCTIONS, CRASH_AFTER_ENV, CRASH_EXIT_CODE, EventSet, crash_after_from_env
from agent.nvml.nodefile import NodeSpec, normalize_bus_id

__all__ = ["API_FUNCTIONS", "CRASH_AFTER_ENV", "CRASH_EXIT_CODE", "PCI_3D_CONTROLLER", "FakeNvml"]

PCI_3D_CONTROLLER = 0x030200
"""PCI class code of a 3D controller: a GPU in compute mode."""


class FakeNvml(FakeFaults):
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
        self._crash_after = crash_after_from_env()
        self._lose_at = None
        self._changes = 0
        self._failures: dict[str, deque[int]] = {}
        self._event_sets: dict[int, EventSet] = {}
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

    def pci_class(self, bus_id: str) -> int | None:
        """The PCI class code Linux would report (sysfs ``class``): the simulated GPUs are 3D controllers (compute
        mode, no display), as data-centre GPUs are; None for a device that is not one of them."""
        normalized = normalize_bus_id(bus_id)
        return PCI_3D_CONTROLLER if normalized is not None and normalized in self._by_bus else None

    def imex_channels(self) -> tuple[int, ...]:
        """The IMEX channels whose device nodes the node has (/dev/nvidia-caps-imex-channels/channel<N>), from
        its node file's `imex_channels`."""
        return self.spec.imex_channels

    def numa_node(self, bus_id: str) -> int | None:
        """The NUMA node Linux would report for a PCI device (sysfs ``numa_node``); None when unknown."""
        normalized = normalize_bus_id(bus_id)
        gpu = self._by_bus.get(normalized) if normalized is not None else None
        return gpu.numa_node if gpu is not None else None
