"""Pure MIG planning: exact GPU-instance placements for a layout, and the minimal change from what GPUs have."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.mig.layout import MigLayout, double_selection, parse_profile_name
from agent.nvml.catalog import GpuModel, MigProfile, Placement
from agent.nvml.records import MigDeviceInfo


def display_name(nvml_name: str) -> str:
    """A product name as messages show it: "NVIDIA H100 80GB HBM3" -> "H100 80GB HBM3"."""
    return nvml_name.removeprefix("NVIDIA ")


def _span(start: int, size: int) -> str:
    return str(start) if size == 1 else f"{start}-{start + size - 1}"


def _slices(start: int, size: int) -> str:
    return f"{'slice' if size == 1 else 'slices'} {_span(start, size)}"


@dataclass(frozen=True, order=True)
class MigInstance:
    """A GPU instance: its profile and its placement in memory slices."""

    profile: str
    start: int
    size: int

    def __str__(self) -> str:
        return f"{self.profile} at {_slices(self.start, self.size)}"


def gpu_instances(devices: Iterable[MigDeviceInfo], parent_index: int) -> tuple[MigInstance, ...]:
    """The GPU instances of one GPU from its MIG devices (one per compute instance), by placement."""
    seen: dict[int, MigInstance] = {}
    for d in devices:
        if d.parent_index == parent_index:
            seen.setdefault(d.gpu_instance_id, MigInstance(d.profile, d.placement_start, d.placement_size))
    return tuple(sorted(seen.values(), key=lambda i: i.start))


@dataclass(frozen=True)
class ProfileTable:
    """A GPU model's GPU-instance profiles as NVML reports them, placements included."""

    model: str
    """Shown in messages, e.g. "H100 80GB HBM3"."""
    profiles: tuple[MigProfile, ...]

    @classmethod
    def of(cls, model: GpuModel) -> ProfileTable:
        return cls(display_name(model.nvml_name), model.mig_profiles)

    @property
    def memory_slices(self) -> int:
        """Memory slices of the whole GPU: the end of the furthest placement."""
        return max((p.start + p.size for profile in self.profiles for p in profile.placements), default=0)

    def profile(self, name: str) -> MigProfile | None:
        """The profile called ``name``; attributes may be listed in any order (``+gfx,me`` is ``+me,gfx``)."""
        exact = next((p for p in self.profiles if p.name == name), None)
        if exact is not None:
            return exact
        try:
            wanted = parse_profile_name(name).canonical
        except ValueError:
            return None
        for p in self.profiles:
            try:
                if parse_profile_name(p.name).canonical == wanted:
                    return p
            except ValueError:
                continue
        return None


class Unplaceable(ValueError):
    """The requested instances cannot all exist on the GPU at once; the message says why."""


# --- exact placement -----------------------------------------------------------------------------------


def _order(profile: MigProfile) -> tuple[int, int, str]:
    """Larger profiles first: they have the fewest placements, so conflicts show early."""
    return (-profile.memory_slices, -profile.slice_count, profile.name)


def _mask(placement: Placement) -> int:
    return ((1 << placement.size) - 1) << placement.start


def _search(items: Sequence[MigProfile], prefer: frozenset[MigInstance]) -> list[Placement] | None:
    """Exact backtracking over the memory-slice bitmask.

    Returns the placements (one per item) that keep the most instances of ``prefer`` and, among those, come
    first when every item tries its lowest start first; None when no placement exists. ``items`` must hold
    equal profiles next to each other: the n-th of equal items takes a later placement than the (n-1)-th,
    so no arrangement is tried twice.
    """
    best: list[Placement] | None = None
    best_kept = -1
    chosen: list[Placement] = []
    options = [sorted(p.placements) for p in items]
    # No placement keeps more than this many: once one does, the search is over.
    most = sum(min(sum(i is p for i in items), sum(k.profile == p.name for k in prefer)) for p in set(items))

    def visit(i: int, used: int, kept: int, first_option: int) -> bool:
        """True when the search can stop: nothing better than ``best`` exists."""
        nonlocal best, best_kept
        if i == len(items):
            if kept > best_kept:
                best, best_kept = list(chosen), kept
            return kept == most
        if best is not None and kept + len(items) - i <= best_kept:
            return False
        profile = items[i]
        for k in range(first_option, len(options[i])):
            placement = options[i][k]
            bits = _mask(placement)
            if used & bits:
                continue
            chosen.append(placement)
            gain = MigInstance(profile.name, placement.start, placement.size) in prefer
            next_first = k + 1 if i + 1 < len(items) and items[i + 1] is profile else 0
            stop = visit(i + 1, used | bits, kept + gain, next_first)
            chosen.pop()
            if stop:
                return True
        return False

    visit(0, 0, 0, 0)
    return best


def _expand(counts: Mapping[MigProfile, int]) -> list[MigProfile]:
    return [p for p in sorted(counts, key=_order) for _ in range(counts[p])]


def _combo(counts: Mapping[MigProfile, int]) -> str:
    ordered = sorted(counts.items(), key=lambda item: _order(item[0]))
    return " + ".join(p.name if n == 1 else f"{n} x {p.name}" for p, n in ordered if n)


def _where(profile: MigProfile) -> str:
    spans = [_span(p.start, p.size) for p in sorted(profile.placements)]
    noun = "slice" if profile.memory_slices == 1 else "slices"
    if len(spans) == 1:
        return f"{profile.name} must use {noun} {spans[0]}"
    return f"{profile.name} can use {noun} {', '.join(spans[:-1])} or {spans[-1]}"


def _conflict(counts: Mapping[MigProfile, int], memory_slices: int) -> str:
    """Why the instances do not fit, told through a smallest subset of them that does not fit."""
    profiles = sorted(counts, key=_order)
    subsets = itertools.product(*(range(counts[p] + 1) for p in profiles))
    smallest = min(
        (s for s in subsets if _search(_expand(dict(zip(profiles, s, strict=True))), frozenset()) is None),
        key=lambda s: (sum(s), [-n for n in s]),
    )
    subset = {p: n for p, n in zip(profiles, smallest, strict=True) if n}
    together = " together" if len(subset) > 1 else ""
    reason = f"{_combo(subset)} do not fit{together}: " + "; ".join(_where(p) for p in subset)
    usable = {s for p in subset for pl in p.placements for s in range(pl.start, pl.start + pl.size)}
    needed = sum(p.memory_slices * n for p, n in subset.items())
    unusable = [s for s in range(memory_slices) if s not in usable]
    if needed > len(usable) and unusable:
        which = f"slice {unusable[0]}" if len(unusable) == 1 else f"slices {', '.join(map(str, unusable))}"
        reason += f" (none of them can use {which})"
    return reason


def _resolve(table: ProfileTable, requested: Mapping[str, int]) -> dict[MigProfile, int]:
    """The requested counts by profile, after every check that needs no placement search."""
    problems: list[str] = []
    counts: dict[MigProfile, int] = {}
    for name, count in requested.items():
        try:
            parsed = parse_profile_name(name)
        except ValueError as err:
            problems.append(f"{name!r}: {err}")
            continue
        if count < 0:
            problems.append(f"count of {name} must be >= 0, got {count}")
            continue
        if parsed.is_compute_instance:
            problems.append(
                f"compute-instance profile {name} is not supported: the agent creates one compute instance "
                f"spanning each GPU instance (use {parsed.gpu_instance})"
            )
            continue
        profile = table.profile(name)
        if profile is None:
            known = ", ".join(p.name for p in table.profiles)
            problems.append(f"profile {name} does not exist on {table.model} (known: {known})")
            continue
        if not profile.placements:
            problems.append(f"profile {name} has no placement on {table.model}")
            continue
        if count:
            counts[profile] = counts.get(profile, 0) + count
    if problems:
        raise Unplaceable("; ".join(problems))
    too_many = [f"at most {p.instance_count} {'instance' if p.instance_count == 1 else 'instances'} of {p.name}, "
                f"{n} requested"
                for p, n in sorted(counts.items(), key=lambda x: _order(x[0])) if n > p.instance_count]
    if too_many:
        raise Unplaceable("; ".join(too_many))
    needed = sum(p.memory_slices * n for p, n in counts.items())
    if needed > table.memory_slices:
        parts = ", ".join(f"{p.name}: {n} x {p.memory_slices}" for p, n in sorted(counts.items(),
                                                                               key=lambda x: _order(x[0])))
        raise Unplaceable(f"needs {needed} memory slices, GPU has {table.memory_slices} ({parts})")
    return counts


def place(
    table: ProfileTable, requested: Mapping[str, int], prefer: Iterable[MigInstance] = ()
) -> tuple[MigInstance, ...]:
    """Explicit placements for every requested instance, larger profiles first.

    The search is exact: when any placement exists, one is found. Among them it takes one that keeps the most
    of ``prefer`` (instances the GPU has now), then the one with the lowest starts. Raises
    :class:`Unplaceable` with a reason a person can act on.
    """
    counts = _resolve(table, requested)
    items = _expand(counts)
    found = _search(items, frozenset(prefer))
    if found is None:
        raise Unplaceable(_conflict(counts, table.memory_slices))
    return tuple(MigInstance(p.name, pl.start, pl.size) for p, pl in zip(items, found, strict=True))


# --- plans ---------------------------------------------------------------------------------------------


class ModeChange(enum.Enum):
    NONE = "none"
    ENABLE = "enable"
    DISABLE = "disable"


@dataclass(frozen=True)
class GpuPlan:
    """What to do to one GPU, in order: destroy, change mode, create."""

    index: int
    mode: ModeChange
    destroy: tuple[MigInstance, ...]
    create: tuple[MigInstance, ...]
    """Larger profiles first, each at an explicit placement."""
    keep: tuple[MigInstance, ...]

    @property
    def target(self) -> tuple[MigInstance, ...]:
        """The GPU instances the GPU has once the plan is applied, by start."""
        return tuple(sorted(self.keep + self.create, key=lambda i: i.start))

    @property
    def noop(self) -> bool:
        return self.mode is ModeChange.NONE and not self.destroy and not self.create

    def actions(self) -> list[str]:
        lines = [f"GPU {self.index}: destroy {i}" for i in self.destroy]
        if self.mode is not ModeChange.NONE:
            lines.append(f"GPU {self.index}: {self.mode.value} MIG")
        lines += [f"GPU {self.index}: create {i}" for i in self.create]
        return lines


class PlanError(ValueError):
    """The layout cannot be applied to the node: one line per GPU that cannot take it."""

    def __init__(self, problems: Iterable[tuple[int, str]]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(f"GPU {index}: {reason}" for index, reason in self.problems))


def plan_gpu(
    table: ProfileTable,
    current: Sequence[MigInstance],
    desired: Mapping[str, int] | None,
    *,
    mig_enabled_now: bool,
    want_enabled: bool,
    index: int = 0,
    mig_capable: bool = False,
    pci_device_id: int | None = None,
) -> GpuPlan:
    """The smallest change that takes one GPU from ``current`` to ``desired``.

    ``current`` lists the GPU instances NVML reports; ``desired`` maps profile names to counts (None or {}:
    no instances). Existing instances that sit where a target instance can sit are kept; a GPU that already
    has the target gets a no-op plan. Raises :class:`PlanError` naming ``index`` when the target cannot fit, or
    when ``table`` is empty: the GPU has no MIG, or (``mig_capable``: NVML reports a MIG mode) the agent does
    not know the model's profile table.
    """
    have = tuple(sorted(set(current), key=lambda i: (i.start, i.profile)))
    if have and not mig_enabled_now:
        raise ValueError(f"GPU {index}: GPU instances reported while MIG is disabled")
    requested = {name: count for name, count in (desired or {}).items() if count != 0}
    if not want_enabled:
        if requested:
            raise ValueError(f"GPU {index}: instances requested with MIG disabled")
        mode = ModeChange.DISABLE if mig_enabled_now else ModeChange.NONE
        return GpuPlan(index, mode, destroy=have, create=(), keep=())
    if not table.profiles:
        if not mig_capable:
            raise PlanError([(index, f"{table.model} does not support MIG")])
        device = f" (PCI device id 0x{pci_device_id:08X})" if pci_device_id is not None else ""
        raise PlanError([(index, f"cannot plan MIG on {table.model}{device}: its MIG profile table is missing "
                                 "from the agent's GPU catalog, and NVML lists placements only with MIG enabled")])
    try:
        target = place(table, requested, prefer=have)
    except Unplaceable as err:
        raise PlanError([(index, str(err))]) from None
    wanted = set(target)
    return GpuPlan(
        index,
        ModeChange.NONE if mig_enabled_now else ModeChange.ENABLE,
        destroy=tuple(i for i in have if i not in wanted),
        create=tuple(i for i in target if i not in have),
        keep=tuple(i for i in have if i in wanted),
    )


@dataclass(frozen=True)
class GpuMigState:
    """One GPU as NVML reports it, for planning."""

    index: int
    name: str
    """Product name, e.g. "NVIDIA H100 80GB HBM3"."""
    pci_device_id: int
    """NVML ``pciDeviceId``: device id << 16 | vendor id, e.g. 0x233010DE."""
    profiles: tuple[MigProfile, ...]
    """Empty when the GPU is not MIG capable."""
    mig_enabled: bool
    instances: tuple[MigInstance, ...] = ()
    mig_capable: bool = False
    """NVML reports a MIG mode for the GPU (its profiles may still be unknown)."""

    @classmethod
    def of(
        cls, index: int, model: GpuModel, mig_enabled: bool = False, instances: Iterable[MigInstance] = ()
    ) -> GpuMigState:
        return cls(index, model.nvml_name, model.pci_device_id, model.mig_profiles, mig_enabled, tuple(instances),
                   model.mig_capable)

    @property
    def table(self) -> ProfileTable:
        return ProfileTable(display_name(self.name), self.profiles)


@dataclass(frozen=True)
class NodePlan:
    layout: str
    gpus: tuple[GpuPlan, ...]
    """One per GPU the layout selects, by index."""
    untouched: tuple[int, ...]
    """GPUs no entry of the layout selects: left as they are."""

    @property
    def noop(self) -> bool:
        return all(p.noop for p in self.gpus)

    @property
    def selects_nothing(self) -> str | None:
        """Why the layout changes nothing because none of its entries selects a GPU of this node; None when it
        selects some."""
        if self.gpus:
            return None
        count = len(self.untouched)
        return (f"layout {self.layout!r} selects no GPU on this node: none of its device filters and device "
                f"lists matches the node's {count} GPU{'s' if count != 1 else ''}; nothing changed")

    def actions(self) -> list[str]:
        return [line for p in self.gpus for line in p.actions()]

    def describe(self) -> str:
        """One line per action, in the order they run; "no changes" for a no-op plan, and why when the layout
        selects no GPU."""
        return "\n".join(self.actions()) or self.selects_nothing or "no changes"


def plan_node(layout: MigLayout, gpus: Sequence[GpuMigState]) -> NodePlan:
    """Plan a layout for every GPU of a node. Any GPU that cannot take it fails the whole plan with a
    :class:`PlanError` that names every such GPU, so that nothing is touched."""
    plans: list[GpuPlan] = []
    untouched: list[int] = []
    problems: list[tuple[int, str]] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        entries = layout.matching(gpu.index, gpu.pci_device_id, gpu.name)
        if len(entries) > 1:
            problems.append((gpu.index, double_selection(layout.name, entries)))
            continue
        if not entries:
            untouched.append(gpu.index)
            continue
        entry = entries[0]
        try:
            plans.append(plan_gpu(
                gpu.table, gpu.instances, entry.requested,
                mig_enabled_now=gpu.mig_enabled, want_enabled=entry.mig_enabled, index=gpu.index,
                mig_capable=gpu.mig_capable, pci_device_id=gpu.pci_device_id,
            ))
        except PlanError as err:
            problems.extend(err.problems)
    if problems:
        raise PlanError(problems)
    return NodePlan(layout.name, tuple(plans), tuple(untouched))
