"""The simulated-node file format (version v1) and its built-in presets, resolved into a NodeSpec."""

from __future__ import annotations

import hashlib
import re
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, get_args

import pynvml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.nvml.catalog import GpuModel, UnknownGpuModel, lookup
from agent.yamlfile import FileProblems, InputFileError, YamlProblem, clip, load_yaml, read_text_file, shown

PcieLevel = Literal["single", "multiple", "hostbridge", "node", "system"]
PCIE_LEVELS: tuple[str, ...] = get_args(PcieLevel)
# Levels that stay inside one CPU socket, so both GPUs must sit on the same NUMA node.
_SOCKET_LOCAL_LEVELS = frozenset({"single", "multiple", "hostbridge", "node"})

DEFAULT_DRIVER_VERSION = "570.133.20"
DEFAULT_CUDA_VERSION = "12.8"
MAX_GPUS = 64

# Default bus numbers by position within a group of eight (those of a DGX H100); every further group of
# eight moves to the next PCI domain, so defaults stay unique up to MAX_GPUS.
_DEFAULT_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

_UUID_RE = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_BUS_ID_RE = re.compile(r"(?P<domain>[0-9a-fA-F]{4}|[0-9a-fA-F]{8}):(?P<bus>[0-9a-fA-F]{2}):"
                        r"(?P<device>[0-9a-fA-F]{2})\.(?P<function>[0-7])")
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_DRIVER_RE = re.compile(r"\d+\.\d+(\.\d+)?")
_CUDA_RE = re.compile(r"\d+\.\d+")
_CLUSTER_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MAX_IMEX_CHANNELS = 2048
"""The driver's IMEX channels are numbered 0..2047."""

FabricState = Literal["completed", "in-progress", "not-started", "not-supported"]
FABRIC_STATE_CODES: Mapping[str, int] = MappingProxyType({
    "not-supported": pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    "not-started": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
    "in-progress": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    "completed": pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
})
NVML_RETURNS: Mapping[str, int] = MappingProxyType({
    "success": pynvml.NVML_SUCCESS,
    **{name.removeprefix("NVML_ERROR_").lower().replace("_", "-"): int(getattr(pynvml, name))
       for name in dir(pynvml) if name.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, name), int)},
})
"""NVML return codes by the names a node file uses for a fabric's status: success, or NVML_ERROR_<X> as x, in
lower case with '-' for '_' (not-ready, unknown, ...)."""


class NodeFileError(FileProblems):
    """A node file or preset that cannot be used: one line per problem, naming origin and key path."""


def normalize_bus_id(text: str) -> str | None:
    """The NVML form (``00000000:1B:00.0``) of a PCI address in NVML or sysfs form; None if it is neither."""
    match = _BUS_ID_RE.fullmatch(text.strip())
    if match is None or int(match["device"], 16) > 0x1F:
        return None
    return (f"{int(match['domain'], 16):08X}:{int(match['bus'], 16):02X}:"
            f"{int(match['device'], 16):02X}.{match['function']}")


# --- the file as written -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _DriverDoc(_Strict):
    version: str = DEFAULT_DRIVER_VERSION
    cuda: str = DEFAULT_CUDA_VERSION

    @field_validator("version")
    @classmethod
    def _driver_version(cls, value: str) -> str:
        if not _DRIVER_RE.fullmatch(value):
            raise ValueError(f"must look like 570.133.20, got {shown(value)}")
        return value

    @field_validator("cuda")
    @classmethod
    def _cuda_version(cls, value: str) -> str:
        if not _CUDA_RE.fullmatch(value):
            raise ValueError(f"must look like 12.8, got {shown(value)}")
        return value


class _FabricDoc(_Strict):
    cluster_uuid: str
    clique_id: Annotated[int, Field(ge=0, le=0xFFFFFFFF)]
    state: FabricState = "completed"
    status: str = "success"

    @field_validator("cluster_uuid")
    @classmethod
    def _cluster_form(cls, value: str) -> str:
        if not _CLUSTER_RE.fullmatch(value):
            raise ValueError(
                f"must look like xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx in lowercase hex, got {shown(value)}")
        return value

    @field_validator("status")
    @classmethod
    def _status_name(cls, value: str) -> str:
        if value not in NVML_RETURNS:
            raise ValueError(f"must be success or an NVML error name such as not-ready or unknown, got {shown(value)}")
        return value


class _GpuDoc(_Strict):
    model: str
    numa_node: Annotated[int, Field(ge=0)] | None
    uuid: str | None = None
    pci_bus_id: str | None = None
    fabric: _FabricDoc | None = None

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        try:
            lookup(value)
        except UnknownGpuModel:
            raise ValueError(str(UnknownGpuModel(clip(value)))) from None
        return value

    @field_validator("uuid")
    @classmethod
    def _uuid_form(cls, value: str | None) -> str | None:
        if value is not None and not _UUID_RE.fullmatch(value):
            raise ValueError(
                f"must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx in lowercase hex, got {shown(value)}"
            )
        return value

    @field_validator("pci_bus_id")
    @classmethod
    def _bus_id_form(cls, value: str | None) -> str | None:
        if value is None:
            return None
        normalized = normalize_bus_id(value)
        if normalized is None:
            raise ValueError(f"must look like 00000000:18:00.0, got {shown(value)}")
        return normalized


class _LinkDoc(_Strict):
    gpus: list[int]
    nvlink: Annotated[int, Field(ge=1, le=pynvml.NVML_NVLINK_MAX_LINKS)] | None = None
    pcie: PcieLevel | None = None

    @field_validator("gpus")
    @classmethod
    def _pair(cls, value: list[int]) -> list[int]:
        if len(value) != 2:
            raise ValueError(f"must name exactly two GPU indices, got {len(value)}")
        if value[0] == value[1]:
            raise ValueError(f"a GPU cannot link to itself, got [{value[0]}, {value[1]}]")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> _LinkDoc:
        if (self.nvlink is None) == (self.pcie is None):
            raise ValueError("must set exactly one of 'nvlink' or 'pcie'")
        return self


class _NodeDoc(_Strict):
    version: Literal["v1"]
    name: str | None = None
    driver: _DriverDoc = _DriverDoc()
    gpus: Annotated[list[_GpuDoc], Field(min_length=1, max_length=MAX_GPUS)]
    links: list[_LinkDoc] = []
    nvswitch: bool = False
    imex_channels: list[Annotated[int, Field(ge=0, le=MAX_IMEX_CHANNELS - 1)]] = []

    @field_validator("imex_channels")
    @classmethod
    def _distinct_channels(cls, value: list[int]) -> list[int]:
        repeated = sorted({c for c in value if value.count(c) > 1})
        if repeated:
            raise ValueError(f"lists channel {repeated[0]} more than once")
        return value

    @field_validator("name")
    @classmethod
    def _node_name(cls, value: str | None) -> str | None:
        if value is not None and not _NAME_RE.fullmatch(value):
            raise ValueError(f"must be a lowercase DNS name such as gpu-node-1, got {shown(value)}")
        return value


# --- the resolved node ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FabricSpec:
    """A simulated GPU's place in a multi-node NVLink fabric, as nvmlDeviceGetGpuFabricInfoV reports it."""

    cluster_uuid: str
    clique_id: int
    state: int
    """NVML_GPU_FABRIC_STATE_*."""
    status: int
    """An NVML return code: NVML_SUCCESS once the registration completed without error."""


@dataclass(frozen=True)
class GpuSpec:
    """One simulated GPU with every default filled in."""

    index: int
    model: GpuModel
    uuid: str
    pci_bus_id: str
    numa_node: int | None
    serial: str
    fabric: FabricSpec | None = None
    """None: the GPU has no fabric (nvmlDeviceGetGpuFabricInfoV answers NOT_SUPPORTED)."""

    @property
    def minor_number(self) -> int:
        return self.index


@dataclass(frozen=True)
class NodeSpec:
    """A simulated node: its GPUs and how every pair of them is connected."""

    name: str
    origin: str
    driver_version: str
    cuda_version: str
    nvswitch: bool
    gpus: tuple[GpuSpec, ...]
    pcie_levels: Mapping[tuple[int, int], PcieLevel] = field(hash=False, repr=False)
    nvlinks: Mapping[tuple[int, int], int] = field(hash=False, repr=False)
    imex_channels: tuple[int, ...] = ()
    """The IMEX channels whose device nodes the simulated node has (/dev/nvidia-caps-imex-channels/channel<N>)."""

    @property
    def cuda_driver_version(self) -> int:
        """The CUDA version as NVML encodes it: 12.8 -> 12080."""
        major, minor = self.cuda_version.split(".")
        return int(major) * 1000 + int(minor) * 10

    @property
    def driver_major(self) -> int:
        return int(self.driver_version.split(".")[0])

    def pcie_level(self, i: int, j: int) -> PcieLevel:
        """The PCIe path between two GPUs (listed in the file, else derived from their NUMA nodes)."""
        return self.pcie_levels[self._pair(i, j)]

    def nvlink(self, i: int, j: int) -> int:
        """NVLink links between two GPUs; on an NVSwitch node, every link of the smaller side."""
        pair = self._pair(i, j)
        if self.nvswitch:
            return min(self.gpus[i].model.nvlink_links, self.gpus[j].model.nvlink_links)
        return self.nvlinks.get(pair, 0)

    def nvlink_peers(self, i: int) -> tuple[tuple[int, int], ...]:
        """Direct NVLink peers of a GPU as (peer index, link count); empty on NVSwitch nodes."""
        self._check_index(i)
        return tuple(
            (b if a == i else a, count) for (a, b), count in sorted(self.nvlinks.items()) if i in (a, b)
        )

    def _check_index(self, i: int) -> None:
        if not 0 <= i < len(self.gpus):
            raise IndexError(f"GPU index {i} out of range 0..{len(self.gpus) - 1}")

    def _pair(self, i: int, j: int) -> tuple[int, int]:
        self._check_index(i)
        self._check_index(j)
        if i == j:
            raise ValueError(f"GPU {i} paired with itself")
        return (i, j) if i < j else (j, i)


def default_uuid(node_name: str, index: int) -> str:
    """A GPU UUID that is the same on every run for the same node name and index."""
    digest = hashlib.sha256(f"simulated-gpu/{node_name}/{index}".encode()).digest()
    return f"GPU-{uuidlib.UUID(bytes=digest[:16])}"


def default_bus_id(index: int) -> str:
    domain, slot = divmod(index, len(_DEFAULT_BUSES))
    return f"{domain:08X}:{_DEFAULT_BUSES[slot]:02X}:00.0"


def _serial(gpu_uuid: str) -> str:
    digest = hashlib.sha256(gpu_uuid.encode()).digest()
    return f"{int.from_bytes(digest[:8], 'big') % 10**13:013d}"


# --- parsing -------------------------------------------------------------------------------------------


def _key_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{clip(part)}" if path else clip(part)
    return path


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _describe(error: Any) -> str:
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"must be {ctx['expected']}, got {shown(value)}"
    if kind in ("int_type", "int_parsing"):
        return f"must be an integer, got {shown(value)}"
    if kind == "bool_type":
        return f"must be true or false, got {shown(value)}"
    if kind == "string_type":
        hint = " (quote it)" if isinstance(value, int | float) else ""
        return f"must be a string, got {shown(value)}{hint}"
    if kind == "list_type":
        return f"must be a list, got {shown(value)}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"must be a mapping, got {shown(value)}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}, got {shown(value)}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']}, got {shown(value)}"
    if kind == "too_short":
        return f"must have at least {_entries(ctx['min_length'])}, got {ctx['actual_length']}"
    if kind == "too_long":
        return f"must have at most {_entries(ctx['max_length'])}, got {ctx['actual_length']}"
    if kind == "value_error":
        return clip(str(ctx.get("error", error["msg"])), 400)
    return clip(str(error["msg"]), 200)


def _validation_problems(err: ValidationError) -> list[tuple[str, str]]:
    return [(_key_path(tuple(e["loc"])), _describe(e)) for e in err.errors()]


def parse_node(text: str, origin: str, node_name: str | None = None) -> NodeSpec:
    """Parse and resolve a node file's text. ``origin`` names it in errors; ``node_name`` is the name to use
    when the file sets none (else the origin's file stem)."""
    try:
        data = load_yaml(text)
    except YamlProblem as err:
        raise NodeFileError(origin, [("", str(err))]) from None
    if not isinstance(data, dict):
        found = type(data).__name__
        raise NodeFileError(origin, [("", f"must be a mapping with 'version: v1', got {found}")])
    try:
        doc = _NodeDoc.model_validate(data)
    except ValidationError as err:
        raise NodeFileError(origin, _validation_problems(err)) from None
    return _resolve(doc, origin, node_name or Path(origin).stem)


def _resolve(doc: _NodeDoc, origin: str, default_name: str) -> NodeSpec:
    problems: list[tuple[str, str]] = []

    def problem(path: str, reason: str) -> None:
        problems.append((path, reason))

    name = doc.name or default_name
    gpus: list[GpuSpec] = []
    uuid_owner: dict[str, int] = {}
    bus_owner: dict[str, int] = {}
    for i, g in enumerate(doc.gpus):
        gpu_uuid = g.uuid or default_uuid(name, i)
        bus_id = g.pci_bus_id or default_bus_id(i)
        if gpu_uuid in uuid_owner:
            problem(f"gpus[{i}].uuid", f"{gpu_uuid} is already used by gpus[{uuid_owner[gpu_uuid]}]")
        if bus_id in bus_owner:
            problem(f"gpus[{i}].pci_bus_id", f"{bus_id} is already used by gpus[{bus_owner[bus_id]}]")
        uuid_owner.setdefault(gpu_uuid, i)
        bus_owner.setdefault(bus_id, i)
        model = lookup(g.model)
        fabric = None
        if g.fabric is not None:
            if model.nvlink_links == 0 or model.architecture < pynvml.NVML_DEVICE_ARCH_HOPPER:
                problem(f"gpus[{i}].fabric", f"{model.key} has no NVLink fabric (a Hopper or newer GPU with NVLink "
                                             "has one)")
            fabric = FabricSpec(g.fabric.cluster_uuid, g.fabric.clique_id, FABRIC_STATE_CODES[g.fabric.state],
                                NVML_RETURNS[g.fabric.status])
        gpus.append(GpuSpec(i, model, gpu_uuid, bus_id, g.numa_node, _serial(gpu_uuid), fabric))

    count = len(gpus)
    pcie: dict[tuple[int, int], PcieLevel] = {}
    nvlinks: dict[tuple[int, int], int] = {}
    listed: dict[tuple[str, tuple[int, int]], int] = {}
    for k, link in enumerate(doc.links):
        out_of_range = [v for v in link.gpus if not 0 <= v < count]
        for v in out_of_range:
            problem(f"links[{k}].gpus", f"GPU index {v} is out of range (the node has GPUs 0..{count - 1})")
        if out_of_range:
            continue
        a, b = sorted(link.gpus)
        pair = (a, b)
        kind = "nvlink" if link.nvlink is not None else "pcie"
        if (kind, pair) in listed:
            earlier = listed[kind, pair]
            problem(f"links[{k}]", f"pair [{a}, {b}] already has a {kind} entry at links[{earlier}]")
            continue
        listed[kind, pair] = k
        if link.nvlink is not None:
            if doc.nvswitch:
                problem(f"links[{k}].nvlink", "not allowed with nvswitch: true (NVSwitch joins every pair)")
            for v in pair:
                if gpus[v].model.nvlink_links == 0:
                    problem(f"links[{k}].nvlink", f"GPU {v} ({gpus[v].model.key}) has no NVLink")
            nvlinks[pair] = link.nvlink
        elif link.pcie is not None:
            na, nb = gpus[a].numa_node, gpus[b].numa_node
            if link.pcie in _SOCKET_LOCAL_LEVELS and na is not None and nb is not None and na != nb:
                problem(
                    f"links[{k}].pcie",
                    f"{link.pcie!r} needs both GPUs on one NUMA node; GPU {a} is on {na}, GPU {b} on {nb}",
                )
            pcie[pair] = link.pcie

    for i, gpu in enumerate(gpus):
        used = sum(n for pair, n in nvlinks.items() if i in pair)
        if used > gpu.model.nvlink_links > 0:
            problem("links", f"GPU {i} has {used} NVLink links listed, but {gpu.model.key} has only "
                             f"{gpu.model.nvlink_links}")
        if doc.nvswitch and gpu.model.nvlink_links == 0:
            problem("nvswitch", f"GPU {i} ({gpu.model.key}) has no NVLink")

    if problems:
        raise NodeFileError(origin, problems)

    for a in range(count):
        for b in range(a + 1, count):
            if (a, b) not in pcie:
                na, nb = gpus[a].numa_node, gpus[b].numa_node
                pcie[a, b] = "node" if na is not None and na == nb else "system"

    return NodeSpec(
        name=name,
        origin=origin,
        driver_version=doc.driver.version,
        cuda_version=doc.driver.cuda,
        nvswitch=doc.nvswitch,
        gpus=tuple(gpus),
        pcie_levels=MappingProxyType(pcie),
        nvlinks=MappingProxyType(nvlinks),
        imex_channels=tuple(sorted(doc.imex_channels)),
    )


# --- presets and files ---------------------------------------------------------------------------------


def _preset_dir() -> Any:
    return resources.files("agent.nvml").joinpath("presets")


def presets() -> list[str]:
    """Names of the built-in node presets."""
    return sorted(entry.name.removesuffix(".yaml") for entry in _preset_dir().iterdir()
                  if entry.name.endswith(".yaml"))


def preset_text(name: str) -> str:
    if name not in presets():
        raise NodeFileError("", [("", f"unknown node preset {name!r} (known: {', '.join(presets())})")])
    text: str = _preset_dir().joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return text


def load_node(source: str, node_name: str | None = None) -> NodeSpec:
    """Load a node from a preset name or a node file path. ``node_name`` names the node when the file
    does not (default: the preset name or the file's stem)."""
    path = Path(source)
    if path.exists() and not path.is_dir():
        try:
            text = read_text_file(path)
        except InputFileError as err:
            raise NodeFileError(source, [("", err.reason)]) from None
        return parse_node(text, source, node_name or path.stem)
    if source in presets():
        return parse_node(preset_text(source), f"preset {source}", node_name or source)
    if path.suffix in (".yaml", ".yml") or "/" in source:
        raise NodeFileError(source, [("", "no such node file")])
    raise NodeFileError("", [("", f"unknown node preset {source!r} (known: {', '.join(presets())})")])
