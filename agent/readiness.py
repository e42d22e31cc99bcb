"""What /readyz answers. `Readiness` is what the HTTP endpoint asks, from before NVML answers (not ready until
the agent exists); `AgentReadiness` is the running agent's answer: registered with the kubelet, the
ResourceSlice published in DRA mode, and, with an API server, the Node's Allocatable showing every advertised
resource with as many devices as are healthy, so that a rolling update moves on only once the scheduler can
see the GPUs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from agent.deviceplugin.server import PluginSet
from agent.inventory import Device
from agent.kube.reconciler import NodeReconciler
from agent.nvml.backend import NvmlBackend


class Readiness:
    """What /readyz answers. The HTTP endpoint serves from before NVML answers, so it asks through this: not
    ready until the agent exists, then the agent's own answer (or the idle one)."""

    def __init__(self) -> None:
        self.check: Callable[[], tuple[bool, str]] = lambda: (False, "NVML not initialised")

    def __call__(self) -> tuple[bool, str]:
        return self.check()


class AgentReadiness:
    """The running agent's readiness, asked by /readyz and the metrics (`Agent.ready`)."""

    def __init__(self, backend: NvmlBackend, plugins: PluginSet, reconciler: NodeReconciler | None,
                 slices_published: Callable[[], asyncio.Event | None],
                 devices: Callable[[], Mapping[str, tuple[Device, ...]]]) -> None:
        self._backend = backend
        self._plugins = plugins
        self._reconciler = reconciler
        """None without an API server (--no-kube)."""
        self._slices_published = slices_published
        """The event set once the ResourceSlice is published (DRA mode with an API server); else None."""
        self._devices = devices
        """The devices of each resource the agent serves."""
        self._allocatable_seen: int | None = None
        """The registration count at which the Node last showed the advertised devices in Allocatable."""

    def __call__(self) -> tuple[bool, str]:
        """Ready once registered with the kubelet and, with an API server, once the agent's own Node shows
        every advertised resource in Allocatable with as many devices as are healthy: the scheduler can then
        place pods on them. A rolling update waits for that, not just for the registration, before it takes
        the next node's agent down. Checked once per registration (a later health change does not make the
        agent unready)."""
        if (problem := self._backend.problem()) is not None:
            return False, problem
        if not self._plugins.registered.is_set():
            return False, "not registered with the kubelet"
        if (published := self._slices_published()) is not None and not published.is_set():
            return False, "the ResourceSlice is not published yet"
        if self._reconciler is None:
            return True, "ok"
        registrations = sum(p.registrations for p in self._plugins.plugins.values())
        if self._allocatable_seen == registrations:
            return True, "ok"
        node = self._reconciler.node
        if node is None:
            return False, "the Node has not been read yet"
        missing = [f"{name}: {healthy}" for name, healthy in sorted(self._healthy_counts().items())
                   if _quantity(node.allocatable.get(name, "0")) != healthy]
        if missing:
            return False, f"the Node's Allocatable does not show {', '.join(missing)} yet"
        self._allocatable_seen = registrations
        return True, "ok"

    def _healthy_counts(self) -> dict[str, int]:
        return {name: sum(d.healthy for d in devices) for name, devices in self._devices().items()}


def _quantity(text: str) -> int | None:
    """A device count as the API writes it ("8"); None for anything else."""
    return int(text) if text.isdigit() else None
