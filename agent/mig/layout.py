"""MIG layout files (mig-parted v1 format): strict parsing, the profile-name grammar and GPU selection."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from agent.yamlfile import FileProblems, InputFileError, YamlProblem, clip, listing, load_yaml, read_text_file, shown

DEFAULT_LAYOUTS = "default-layouts.yaml"
"""The layout file shipped with the agent (package data of agent.mig)."""

_PROFILE_RE = re.compile(r"(?:(?P<c>[1-9][0-9]*)c\.)?(?P<g>[1-9][0-9]*)g\.(?P<gb>[1-9][0-9]*)gb(?P<suffix>[+-].*)?")
_ATTRIBUTE_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:\.[A-Za-z0-9]+)*")
_PCI_ID_RE = re.compile(r"0[xX][0-9A-Fa-f]{8}")
_SUBSYSTEM_RE = re.compile(r"0[xX][0-9A-Fa-f]{8}:0[xX][0-9A-Fa-f]{8}")
# A layout is selected through a node label value, so its name must be one.
_LABEL_VALUE_RE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


class LayoutError(FileProblems):
    """A layout file or selection that cannot be used: one line per problem, naming origin and key path."""


# --- profile names -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileName:
    """A MIG profile name: ``[<C>c.]<G>g.<GB>gb[+<attr>[,<attr>]...|-<attr>]`` (go-nvlib's grammar).

    ``compute_slices`` equals ``gpu_slices`` unless the name has a ``<C>c.`` prefix, which names a compute
    instance smaller than its GPU instance. ``attributes`` follow ``+`` (``me``, ``me.all``, ``gfx``);
    ``without`` is the attribute after ``-`` (``-me``: the variant without media extensions).
    """

    compute_slices: int
    gpu_slices: int
    memory_gb: int
    attributes: tuple[str, ...] = ()
    without: str | None = None

    @property
    def is_compute_instance(self) -> bool:
        return self.compute_slices < self.gpu_slices

    @property
    def canonical(self) -> str:
        """The name with its ``+`` attributes sorted, so that ``+gfx,me`` and ``+me,gfx`` compare equal."""
        return self._render(self.compute_slices, tuple(sorted(self.attributes)))

    @property
    def gpu_instance(self) -> str:
        """The GPU-instance profile this name lives in: the name without its ``<C>c.`` prefix."""
        return self._render(self.gpu_slices, self.attributes)

    def _render(self, compute_slices: int, attributes: tuple[str, ...]) -> str:
        prefix = f"{compute_slices}c." if compute_slices < self.gpu_slices else ""
        suffix = f"+{','.join(attributes)}" if attributes else ""
        if self.without is not None:
            suffix = f"-{self.without}"
        return f"{prefix}{self.gpu_slices}g.{self.memory_gb}gb{suffix}"


def _attribute_problem(attribute: str, sign: str) -> str | None:
    if not attribute:
        return f"an attribute after '{sign}' is empty"
    if not _ATTRIBUTE_RE.fullmatch(attribute):
        return f"attribute {shown(attribute)} must be letters and digits (dots inside), starting with a letter"
    return None


def parse_profile_name(text: str) -> ProfileName:
    """Parse a profile name; ValueError with the reason when it is not well formed."""
    match = _PROFILE_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            "not a MIG profile name: expected <G>g.<GB>gb, optionally with a <C>c. prefix and a +<attr> or "
            "-<attr> suffix (e.g. 3g.40gb, 1c.3g.40gb, 1g.10gb+me, 1g.24gb-me)"
        )
    g, gb = int(match["g"]), int(match["gb"])
    c = int(match["c"]) if match["c"] else g
    if c > g:
        raise ValueError(f"a compute instance ({c}c) cannot be larger than its GPU instance ({g}g)")
    if match["c"] and c == g:
        raise ValueError(f"write {clip(text[len(match['c']) + 2:])}: a <C>c. prefix names a compute instance "
                         "smaller than its GPU instance")
    suffix = match["suffix"] or ""
    attributes: tuple[str, ...] = ()
    without = None
    if suffix.startswith("+"):
        attributes = tuple(suffix[1:].split(","))
        for attribute in attributes:
            problem = _attribute_problem(attribute, "+")
            if problem is not None:
                raise ValueError(problem)
        repeated = sorted({a for a in attributes if attributes.count(a) > 1})
        if repeated:
            raise ValueError(f"attribute {shown(repeated[0])} is listed twice")
    elif suffix.startswith("-"):
        without = suffix[1:]
        if "," in without:
            raise ValueError("only one attribute may follow '-'")
        problem = _attribute_problem(without, "-")
        if problem is not None:
            raise ValueError(problem)
    return ProfileName(c, g, gb, attributes, without)


# --- the typed layout ----------------------------------------------------------------------------------


def normalize_model_name(name: str) -> str:
    """A GPU product name for comparison: case and spacing ignored, the leading "NVIDIA" optional."""
    words = name.lower().split()
    if words and words[0] == "nvidia":
        words = words[1:]
    return " ".join(words)


@dataclass(frozen=True)
class DeviceFilter:
    """Which GPU models an entry applies to: PCI device ids (NVML ``pciDeviceId``: device id << 16 | vendor
    id, e.g. 0x233010DE) or product names as NVML reports them (e.g. "NVIDIA H100 80GB HBM3")."""

    pci_device_ids: frozenset[int]
    model_names: frozenset[str]
    """Normalised by :func:`normalize_model_name`."""

    def matches(self, pci_device_id: int, name: str) -> bool:
        return pci_device_id in self.pci_device_ids or normalize_model_name(name) in self.model_names


@dataclass(frozen=True)
class LayoutEntry:
    """One entry of a layout: which GPUs it selects and the MIG state they should have."""

    position: int
    """Position in the layout's list, as ``[i]`` in messages."""
    devices: tuple[int, ...] | None
    """GPU indices; None for ``devices: all``."""
    device_filter: DeviceFilter | None
    """None when the entry applies to every model."""
    mig_enabled: bool
    mig_devices: Mapping[str, int]
    """Profile name -> count, as written (zero counts included)."""

    @property
    def requested(self) -> dict[str, int]:
        """The instances to have: profiles with a count above zero."""
        return {name: count for name, count in self.mig_devices.items() if count > 0}

    def selects(self, index: int, pci_device_id: int, name: str) -> bool:
        if self.devices is not None and index not in self.devices:
            return False
        return self.device_filter is None or self.device_filter.matches(pci_device_id, name)


@dataclass(frozen=True)
class MigLayout:
    """A named layout (one ``mig-configs`` key) and its entries."""

    name: str
    entries: tuple[LayoutEntry, ...]
    origin: str = ""

    def matching(self, index: int, pci_device_id: int, name: str) -> tuple[LayoutEntry, ...]:
        """Every entry that selects the GPU (more than one is an error, see :meth:`entry_for`)."""
        return tuple(e for e in self.entries if e.selects(index, pci_device_id, name))

    def entry_for(self, index: int, pci_device_id: int, name: str) -> LayoutEntry | None:
        """The entry that selects the GPU, None when no entry does (the GPU is then left alone).

        A GPU selected by two entries raises :class:`LayoutError`.
        """
        found = self.matching(index, pci_device_id, name)
        if len(found) > 1:
            reason = f"GPU {index} ({name}) is {double_selection(self.name, found)}"
            raise LayoutError(self.origin, [(f"mig-configs.{self.name}", reason)])
        return found[0] if found else None


def double_selection(layout: str, entries: Iterable[LayoutEntry]) -> str:
    """Why a GPU that several entries select cannot be planned."""
    positions = " and ".join(f"[{e.position}]" for e in entries)
    return f"selected by entries {positions} of layout {layout}; each GPU may be selected by one entry only"


@dataclass(frozen=True)
class LayoutFile:
    """A parsed layout file: its layouts by name, and where it came from for messages."""

    origin: str
    layouts: Mapping[str, MigLayout]
    """In file order."""

    def names(self) -> list[str]:
        return list(self.layouts)

    def layout(self, name: str | None = None) -> MigLayout:
        """The layout called ``name``; with None, the only layout of a file that has exactly one."""
        if name is None:
            if len(self.layouts) == 1:
                return next(iter(self.layouts.values()))
            raise LayoutError(self.origin, [("", f"name a layout: the file has {len(self.layouts)} "
                                                 f"({listing(self.layouts)})")])
        try:
            return self.layouts[name]
        except KeyError:
            raise LayoutError(self.origin, [("", f"no layout named {shown(name)} "
                                                 f"(known: {listing(self.layouts)})")]) from None


# --- the file as written -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _FileDoc(_Strict):
    version: Literal["v1"]
    mig_configs: Any = Field(alias="mig-configs")  # walked by _layouts, which names each layout and entry


class _EntryDoc(_Strict):
    # devices and device-filter take one of two shapes each; they are checked by hand so that a mistake
    # reads as one line instead of one per shape pydantic tried.
    devices: Any
    device_filter: Any = Field(default=None, alias="device-filter")
    mig_enabled: StrictBool = Field(alias="mig-enabled")
    # Counts are checked by hand too, so that every bad name and count in one mapping is reported at once.
    mig_devices: dict[str, Any] | None = Field(default=None, alias="mig-devices")


# --- parsing -------------------------------------------------------------------------------------------


def _join(path: str, part: int | str) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{clip(part)}" if path else clip(part)


def _key_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    if loc and loc[-1] == "[key]":
        # A mapping key of the wrong type: name the key itself, not a list position.
        return _join(_key_path(prefix, loc[:-2]), str(loc[-2]))
    path = prefix
    for part in loc:
        path = _join(path, part)
    return path


def _describe(error: Any) -> str:
    kind = error["type"]
    value = error.get("input")
    loc = error["loc"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"must be {error['ctx']['expected']}, got {shown(value)}"
    if loc and loc[-1] == "[key]":
        return f"key must be a string, got {shown(value)} (quote it)"
    if kind == "bool_type":
        return f"must be true or false, got {shown(value)}"
    if kind == "list_type":
        return f"must be a list, got {shown(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping, got {shown(value)}"
    return clip(str(error["msg"]), 200)


def _pydantic_problems(err: ValidationError, prefix: str) -> list[tuple[str, str]]:
    return [(_key_path(prefix, tuple(e["loc"])), _describe(e)) for e in err.errors()]


def _devices(value: Any, path: str, problems: list[tuple[str, str]]) -> tuple[int, ...] | None:
    if value == "all":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        problems.append((path, f"must be 'all' or a list of GPU indices; write [{shown(value)}] for one GPU"))
        return None
    if not isinstance(value, list):
        problems.append((path, f"must be 'all' or a list of GPU indices, got {shown(value)}"))
        return None
    if not value:
        problems.append((path, "must list at least one GPU index (or be 'all')"))
    indices: list[int] = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            problems.append((f"{path}[{i}]", f"GPU index must be an integer >= 0, got {shown(item)}"))
        elif item in indices:
            problems.append((f"{path}[{i}]", f"GPU {item} is listed twice"))
        else:
            indices.append(item)
    return tuple(indices)


def _filter_item(text: str) -> int | str | None:
    """A PCI device id (int), a normalised model name (str), or None when the text is neither."""
    if text[:2].lower() == "0x":
        return int(text, 16) if _PCI_ID_RE.fullmatch(text) else None
    name = normalize_model_name(text)
    return name or None


def _filter_problem(text: str) -> str:
    if _SUBSYSTEM_RE.fullmatch(text):
        return (f"subsystem-qualified ids are not supported; use the device id alone ({text.split(':')[0]}), "
                "or a model name")
    if text[:2].lower() == "0x":
        return (f"a PCI device id is 0x and 8 hex digits, device id then vendor id (e.g. 0x233010DE), "
                f"got {shown(text)}")
    return (f"must be a PCI device id (e.g. 0x233010DE) or a GPU model name (e.g. H100 80GB HBM3), got "
            f"{shown(text)}")


def _device_filter(value: Any, path: str, problems: list[tuple[str, str]]) -> DeviceFilter | None:
    if value is None:
        return None
    items: list[tuple[str, Any]]
    if isinstance(value, str):
        items = [(path, value)]
    elif isinstance(value, list):
        if not value:
            problems.append((path, "must name at least one PCI device id or model"))
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    else:
        problems.append((path, f"must be a string or a list of strings, got {shown(value)}"))
        return None
    ids: set[int] = set()
    names: set[str] = set()
    for item_path, item in items:
        if not isinstance(item, str):
            hint = " (quote it)" if isinstance(item, int) and not isinstance(item, bool) else ""
            problems.append((item_path, f"must be a string, got {shown(item)}{hint}"))
            continue
        parsed = _filter_item(item)
        if parsed is None:
            problems.append((item_path, _filter_problem(item)))
        elif isinstance(parsed, int):
            ids.add(parsed)
        else:
            names.add(parsed)
    return DeviceFilter(frozenset(ids), frozenset(names))


def _mig_devices(value: Any, mig_enabled: Any, path: str, problems: list[tuple[str, str]]) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    if value and mig_enabled is False:
        problems.append((path, "only allowed with mig-enabled: true"))
        return {}
    before = len(problems)
    for name, count in value.items():
        if not isinstance(name, str):
            continue  # reported by pydantic
        try:
            parse_profile_name(name)
        except ValueError as err:
            problems.append((_join(path, name), str(err)))
        if isinstance(count, bool) or not isinstance(count, int):
            problems.append((_join(path, name), f"count must be an integer, got {shown(count)}"))
        elif count < 0:
            problems.append((_join(path, name), f"count must be >= 0, got {shown(count)}"))
    if len(problems) == before and value and not any(value.values()):
        problems.append((path, "all counts are 0; write mig-devices: {} for MIG enabled without instances"))
    return value


def _entry(raw: dict[str, Any], position: int, path: str, problems: list[tuple[str, str]]) -> LayoutEntry | None:
    before = len(problems)
    doc: _EntryDoc | None = None
    try:
        doc = _EntryDoc.model_validate(raw)
    except ValidationError as err:
        problems.extend(_pydantic_problems(err, path))
    devices = _devices(raw["devices"], f"{path}.devices", problems) if "devices" in raw else None
    device_filter = (_device_filter(raw["device-filter"], f"{path}.device-filter", problems)
                     if "device-filter" in raw else None)
    mig_devices = _mig_devices(raw.get("mig-devices"), raw.get("mig-enabled"), f"{path}.mig-devices", problems)
    if doc is None or len(problems) > before:
        return None
    return LayoutEntry(position, devices, device_filter, doc.mig_enabled, MappingProxyType(mig_devices))


def _overlap(a: LayoutEntry, b: LayoutEntry) -> str | None:
    """The GPUs both entries certainly select, in words; None when some GPU could tell them apart."""
    filtered = a.device_filter is not None or b.device_filter is not None
    if a.device_filter is not None and b.device_filter is not None:
        shared_ids = a.device_filter.pci_device_ids & b.device_filter.pci_device_ids
        shared_names = a.device_filter.model_names & b.device_filter.model_names
        if not shared_ids and not shared_names:
            return None
    index_sets = [set(d) for d in (a.devices, b.devices) if d is not None]
    if not index_sets:
        gpus = "every GPU"
    else:
        shared = sorted(set.intersection(*index_sets))
        if not shared:
            return None
        gpus = f"GPU {shared[0]}" if len(shared) == 1 else f"GPUs {', '.join(map(str, shared))}"
    return f"{gpus} of the filtered models" if filtered else gpus


def layout_name_problem(name: str) -> str | None:
    """Why `name` cannot be a layout's name (it must be a label value: the Node's label selects it), or None."""
    if _LABEL_VALUE_RE.fullmatch(name):
        return None
    if "+" in name:
        return f"layout names write '+' as '.' (e.g. {clip(name.replace('+', '.'))}): a name must be a label value"
    return ("a layout name must be a label value: at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit")


def _layouts(configs: Any, origin: str, problems: list[tuple[str, str]]) -> dict[str, MigLayout]:
    if not isinstance(configs, dict):
        problems.append(("mig-configs", f"must be a mapping of layout names to entry lists, got {shown(configs)}"))
        return {}
    if not configs:
        problems.append(("mig-configs", "must have at least 1 layout"))
    layouts: dict[str, MigLayout] = {}
    for name, raw_entries in configs.items():
        path = _join("mig-configs", str(name))
        if not isinstance(name, str):
            problems.append((path, f"layout name must be a string, got {shown(name)} (quote it)"))
            continue
        before = len(problems)
        name_problem = layout_name_problem(name)
        if name_problem is not None:
            problems.append((path, name_problem))
        if not isinstance(raw_entries, list):
            problems.append((path, f"must be a list of entries, got {shown(raw_entries)}"))
            continue
        if not raw_entries:
            problems.append((path, "must have at least 1 entry"))
        entries: list[LayoutEntry] = []
        for i, raw in enumerate(raw_entries):
            if not isinstance(raw, dict):
                problems.append((f"{path}[{i}]", f"must be a mapping, got {shown(raw)}"))
                continue
            entry = _entry(raw, i, f"{path}[{i}]", problems)
            if entry is None:
                continue
            for earlier in entries:
                shared = _overlap(earlier, entry)
                if shared is not None:
                    problems.append((f"{path}[{i}]", f"selects {shared}, which entry [{earlier.position}] "
                                                     "selects too; each GPU may be selected by one entry only"))
            entries.append(entry)
        if len(problems) == before:
            layouts[name] = MigLayout(name, tuple(entries), origin)
    return layouts


def parse_layouts(text: str, origin: str) -> LayoutFile:
    """Parse a layout file's text; ``origin`` names it in errors. Raises :class:`LayoutError`."""
    try:
        data = load_yaml(text)
    except YamlProblem as err:
        raise LayoutError(origin, [("", str(err))]) from None
    if not isinstance(data, dict):
        raise LayoutError(origin, [("", f"must be a mapping with 'version: v1', got {type(data).__name__}")])
    problems: list[tuple[str, str]] = []
    try:
        _FileDoc.model_validate(data)
    except ValidationError as err:
        problems.extend(_pydantic_problems(err, ""))
    layouts = _layouts(data["mig-configs"], origin, problems) if "mig-configs" in data else {}
    if problems:
        raise LayoutError(origin, problems)
    return LayoutFile(origin, MappingProxyType(layouts))


def default_layouts_text() -> str:
    text: str = resources.files("agent.mig").joinpath(DEFAULT_LAYOUTS).read_text(encoding="utf-8")
    return text


def load_layouts(path: Path | None = None) -> LayoutFile:
    """Load a layout file; None loads the shipped default layouts."""
    if path is None:
        return parse_layouts(default_layouts_text(), f"built-in {DEFAULT_LAYOUTS}")
    try:
        text = read_text_file(path)
    except InputFileError as err:
        raise LayoutError(str(path), [("", err.reason)]) from None
    return parse_layouts(text, str(path))
