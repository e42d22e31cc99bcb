"""GPU-seconds held per namespace (and, when asked, per pod), for chargeback: what each telemetry pass found held,
integrated over the time between passes. Pure: the caller hands in the time, what is held and each device's
utilization; docs/metrics.md ("GPU-seconds per namespace") states the rules.

- A whole GPU counts 1 GPU per second; a MIG device its GPU instance's compute slices over the GPU's (a 3g.40gb
  on an H100: 3/7); a time-sliced or MPS replica (``<id>::<n>``) its device's share over the device's replicas.
  One pod counts each device ID once, however many of its containers hold it; the holders of one GPU or MIG
  device are never charged more than the device itself (their shares are scaled down to it).
- Each pass charges the time since the previous one, at most twice the interval, to what it found held.
- A device counts as idle while its utilization is under the threshold; one without a reading is held, not idle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from agent.inventory import REPLICA_SEPARATOR, plan
from agent.nvml.catalog import MODELS
from agent.nvml.records import NodeInventory
from agent.state import NodeState

MAX_POD_SERIES = 500
"""The most pods with series of their own; later pods are counted in their namespace's OTHER_PODS series."""
OTHER_PODS = "(other)"
"""The pod label of the series that counts a namespace's pods beyond MAX_POD_SERIES (no pod is named so)."""
RETAIN_S = 600.0
"""How long a namespace's or pod's series stays after the last pass that found it holding a device."""
MAX_GAP_INTERVALS = 2
"""A pass charges the time since the previous one up to this many intervals (a stall does not charge hours)."""


@dataclass(frozen=True)
class Held:
    """One device ID a container holds, as the kubelet's PodResources lists it."""

    namespace: str
    pod: str
    device_id: str


@dataclass(frozen=True)
class Hold:
    """What one pod holds of one GPU or MIG device: `share` GPUs."""

    namespace: str
    pod: str
    device: str
    """The GPU or MIG UUID (a replica's device)."""
    share: Fraction


@dataclass
class Totals:
    """GPU-seconds held, and of them held while the device was idle."""

    held: Fraction = Fraction(0)
    idle: Fraction = Fraction(0)
    seen: float = 0.0
    """When a pass last found it holding a device (the caller's clock)."""


def device_shares(inventory: NodeInventory) -> dict[str, Fraction]:
    """The share of a GPU each GPU and MIG device is, by UUID: 1 for a GPU; for a MIG device its GPU instance's
    compute slices over the most a GPU instance of its GPU's model has (7 on an A100 or H100); for a model the
    profile tables lack, its memory over the GPU's."""
    shares: dict[str, Fraction] = {gpu.uuid: Fraction(1) for gpu in inventory.gpus}
    gpus = {gpu.index: gpu for gpu in inventory.gpus}
    for mig in inventory.mig_devices:
        gpu = gpus.get(mig.parent_index)
        if gpu is None:
            continue
        model = next((m for m in MODELS.values() if m.nvml_name == gpu.name and m.mig_profiles), None)
        if model is not None and mig.gi_slices > 0:
            shares[mig.uuid] = Fraction(mig.gi_slices, max(p.slice_count for p in model.mig_profiles))
        elif gpu.memory_mib > 0:
            shares[mig.uuid] = min(Fraction(1), Fraction(mig.memory_mib, gpu.memory_mib))
    return shares


def shared_replicas(state: NodeState) -> dict[str, int]:
    """How many replicas each GPU or MIG device the node shares (time-slicing or MPS) is advertised as, by UUID."""
    return {d.id.partition(REPLICA_SEPARATOR)[0]: d.replicas
            for resource in plan(state).resources.values() for d in resource.devices if d.shared}


def holds(held: Iterable[Held], shares: Mapping[str, Fraction], replicas: Mapping[str, int]) -> list[Hold]:
    """What each pod holds of each device, from the device IDs its containers hold. `shares`: device_shares;
    `replicas`: how many replicas each shared device is advertised as. A device ID is counted once per pod; a
    replica ID the plan does not share counts as its whole device; a device ID that is no GPU or MIG device of
    the node counts as one GPU. The holders of one device together never exceed the device's share."""
    ids: dict[tuple[str, str], set[str]] = {}
    for h in held:
        ids.setdefault((h.namespace, h.pod), set()).add(h.device_id)
    per_pod: dict[tuple[str, str, str], Fraction] = {}
    for (namespace, pod), device_ids in ids.items():
        for device_id in device_ids:
            device, replica, _ = device_id.partition(REPLICA_SEPARATOR)
            share = shares.get(device, Fraction(1))
            if replica and replicas.get(device, 1) > 1:
                share /= replicas[device]
            key = (namespace, pod, device)
            per_pod[key] = per_pod.get(key, Fraction(0)) + share
    by_device: dict[str, Fraction] = {}
    for (_, _, device), share in per_pod.items():
        by_device[device] = by_device.get(device, Fraction(0)) + share
    found = []
    for (namespace, pod, device), share in sorted(per_pod.items()):
        whole = shares.get(device, Fraction(1))
        if by_device[device] > whole:
            share = share * whole / by_device[device]
        found.append(Hold(namespace, pod, device, share))
    return found


class GpuSecondsLedger:
    """The GPU-seconds counters, fed once per telemetry pass. Pure: time comes in as an argument (any monotonic
    clock, in seconds), so a test can play a day in a moment."""

    def __init__(self, max_pods: int = MAX_POD_SERIES, retain_s: float = RETAIN_S) -> None:
        self.max_pods = max_pods
        self.retain_s = retain_s
        self.namespaces: dict[str, Totals] = {}
        self.pods: dict[tuple[str, str], Totals] = {}
        """By (namespace, pod); a namespace's pods beyond the limit under (namespace, OTHER_PODS)."""
        self._folded: dict[tuple[str, str], float] = {}
        """Pods counted in their namespace's OTHER_PODS series, with when they were last seen."""
        self._previous: float | None = None
        self._named = 0

    def pause(self) -> None:
        """No pass for a while (the passes switched off): the next pass charges nothing and starts again."""
        self._previous = None

    def record(self, now: float, found: Iterable[Hold], utilization: Mapping[str, float | None], *,
               interval_s: float, idle_below: float, by_pod: bool) -> float:
        """Charge the time since the previous pass (at most MAX_GAP_INTERVALS x `interval_s`; nothing at the first
        pass) to `found`, what this pass found held. `utilization`: each GPU and MIG device's, 0 to 1, by UUID (a
        device absent or None: held, not idle). Returns the seconds charged."""
        previous, self._previous = self._previous, now
        seconds = 0.0 if previous is None else min(max(now - previous, 0.0), MAX_GAP_INTERVALS * interval_s)
        span = Fraction(seconds)
        if not by_pod:
            self.pods.clear()
            self._folded.clear()
        self._named = sum(1 for (_, pod) in self.pods if pod != OTHER_PODS)
        for hold in found:
            reading = utilization.get(hold.device)
            idle = reading is not None and reading < idle_below
            charged = hold.share * span
            for totals in self._totals(hold, now, by_pod):
                totals.held += charged
                if idle:
                    totals.idle += charged
                totals.seen = now
        self._forget(now)
        return seconds

    def _totals(self, hold: Hold, now: float, by_pod: bool) -> list[Totals]:
        found = [self.namespaces.setdefault(hold.namespace, Totals())]
        if not by_pod:
            return found
        key = (hold.namespace, hold.pod)
        if key not in self.pods:
            if key in self._folded or self._named >= self.max_pods:
                self._folded[key] = now
                key = (hold.namespace, OTHER_PODS)
            else:
                self._named += 1
        found.append(self.pods.setdefault(key, Totals()))
        return found

    def _forget(self, now: float) -> None:
        """Drop the series nothing has been found holding for longer than retain_s."""
        for namespace in [k for k, totals in self.namespaces.items() if now - totals.seen > self.retain_s]:
            del self.namespaces[namespace]
        for pod in [k for k, totals in self.pods.items() if now - totals.seen > self.retain_s]:
            del self.pods[pod]
        for key in [k for k, seen in self._folded.items() if now - seen > self.retain_s]:
            del self._folded[key]
