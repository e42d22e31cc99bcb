"""The versioned agent config file: schema, defaults and strict validation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent.yamlfile import YamlProblem, load_yaml

DEVICE_LIST_STRATEGIES = ("envvar", "cdi")
TAINT_KEY = r"gpu-node-agent\.io/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"


class ConfigError(ValueError):
    """The config cannot be used; the message names each key path and reason, one per line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PluginFlags(_Strict):
    device_list_strategy: tuple[Literal["envvar", "cdi"], ...] = Field(
        default=("envvar",), alias="deviceListStrategy"
    )
    """How Allocate hands devices to the runtime: NVIDIA_VISIBLE_DEVICES, CDI device names, or both."""
    device_id_strategy: Literal["uuid", "index"] = Field(default="uuid", alias="deviceIDStrategy")
    """What NVIDIA_VISIBLE_DEVICES and CDI names carry: GPU UUIDs or GPU indices."""

    @field_validator("device_list_strategy", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one strategy")
        return value

    @field_validator("device_list_strategy")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError("lists a strategy twice")
        return value


class Flags(_Strict):
    mig_strategy: Literal["none", "single", "mixed"] = Field(default="none", alias="migStrategy")
    """none: whole GPUs; single: MIG devices as nvidia.com/gpu; mixed: nvidia.com/mig-<profile> per profile."""
    plugin: PluginFlags = PluginFlags()


GpuSelector = int | str
"""A GPU by index, by UUID ("GPU-..."), or by model (the NVML name or its label form, e.g. NVIDIA-H100-80GB-HBM3)."""

RESOURCE_NAME = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"


class ReplicatedResource(_Strict):
    name: str
    """The resource whose devices are shared, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb."""
    replicas: int = Field(ge=2, le=1024)
    rename: str | None = None
    """Advertise the replicas under this resource name instead."""
    devices: Literal["all"] | list[GpuSelector] = "all"
    """Which GPUs this entry shares: all, or a list of indices, UUIDs and models."""

    @field_validator("name", "rename")
    @classmethod
    def _resource_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(RESOURCE_NAME, value):
            raise ValueError(f"{value!r} is not an extended resource name (vendor-domain/name)")
        if value is not None and value.split("/", 1)[0].endswith("kubernetes.io"):
            raise ValueError(f"{value!r} is in the reserved kubernetes.io domain")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _selectors(cls, value: object) -> object:
        if value == "all":
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("must be 'all' or a non-empty list of GPU indices, UUIDs or models")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int | str) or item in ("", None):
                raise ValueError(f"{item!r} is not a GPU index, UUID or model")
            if isinstance(item, int) and item < 0:
                raise ValueError(f"GPU index {item} is negative")
        return value


class TimeSlicing(_Strict):
    rename_by_default: bool = Field(default=False, alias="renameByDefault")
    """Advertise replicas as <name>.shared unless an entry gives `rename`."""
    fail_requests_greater_than_one: bool = Field(default=False, alias="failRequestsGreaterThanOne")
    resources: list[ReplicatedResource] = Field(default_factory=list)


class Sharing(_Strict):
    time_slicing: TimeSlicing = Field(default_factory=TimeSlicing, alias="timeSlicing")
    allocation_policy: Literal["distributed", "packed"] = Field(default="distributed", alias="allocationPolicy")
    """Which replicas GetPreferredAllocation prefers: spread over GPUs, or packed onto the fewest."""


Action = Literal["ignore", "warn", "unhealthy", "node-fatal"]

DEFAULT_XID_ACTIONS: dict[int, Action] = {
    **{x: "ignore" for x in (13, 31, 43, 45, 68, 109)},  # application errors: the GPU stays usable
    **{x: "warn" for x in (63, 92, 94)},  # row remap pending, single-bit storm, contained ECC error
    **{x: "node-fatal" for x in (79, 151, 160)},  # off the bus, key rotation, channel retirement: reboot
}


class CheckActions(_Strict):
    gpu_lost: Action = Field(default="node-fatal", alias="gpuLost")
    ecc_uncorrected: Action = Field(default="unhealthy", alias="eccUncorrected")
    remapped_rows_failure: Action = Field(default="unhealthy", alias="remappedRowsFailure")
    remapped_rows_pending: Action = Field(default="warn", alias="remappedRowsPending")
    retired_pages_pending: Action = Field(default="warn", alias="retiredPagesPending")
    thermal_throttle: Action = Field(default="warn", alias="thermalThrottle")
    power_brake: Action = Field(default="warn", alias="powerBrake")


class TaintSettings(_Strict):
    key: str = "gpu-node-agent.io/gpu-fault"
    """The agent only ever owns taints under its own domain."""
    effect: Literal["NoSchedule", "NoExecute", "PreferNoSchedule"] = "NoSchedule"


    @field_validator("key")
    @classmethod
    def _own_domain(cls, value: str) -> str:
        if not re.fullmatch(TAINT_KEY, value):
            raise ValueError(f"{value!r} is not a taint key under gpu-node-agent.io/ (the agent owns only those)")
        return value


class HealthSettings(_Strict):
    xid_default: Action = Field(default="unhealthy", alias="xidDefault")
    """What an XID not listed in `xid` does."""
    xid: dict[Annotated[int, Field(ge=1, le=1023)], Action] = Field(default_factory=lambda: dict(DEFAULT_XID_ACTIONS))
    """Per-XID actions; listed XIDs replace the defaults for those XIDs, the others keep theirs."""
    checks: CheckActions = CheckActions()
    sample_interval_seconds: float = Field(default=5.0, ge=0.05, le=3600, alias="sampleIntervalSeconds")
    recovery_checks: int = Field(default=3, ge=1, le=1000, alias="recoveryChecks")
    """Consecutive clean samples after the last fault before a GPU is healthy again."""
    node_fatal_unhealthy_gpus: int = Field(default=0, ge=0, alias="nodeFatalUnhealthyGpus")
    """Taint the node when at least this many GPUs are unhealthy; 0 turns this off."""
    taint: TaintSettings = TaintSettings()

    @field_validator("xid", mode="before")
    @classmethod
    def _numeric_keys(cls, value: object) -> object:
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, bool) or not isinstance(key, int):
                    raise ValueError(f"XIDs are numbers 1..1023, got the key {key!r}")
        return value

    @field_validator("xid", mode="after")
    @classmethod
    def _merge_defaults(cls, value: dict[int, Action]) -> dict[int, Action]:
        return {**DEFAULT_XID_ACTIONS, **value}

    def xid_action(self, xid: int) -> Action:
        return self.xid.get(xid, self.xid_default)


class TelemetrySettings(_Strict):
    dcgm_metrics: bool = Field(default=True, alias="dcgmMetrics")
    """Serve dcgm-exporter's default counters (DCGM_FI_*) on /metrics; off for clusters that keep dcgm-exporter."""
    interval_seconds: float = Field(default=10.0, ge=1, le=3600, alias="intervalSeconds")
    """How often NVML is read for them (and the kubelet asked which pods hold which devices); scrapes read the
    last pass."""


class MigSettings(_Strict):
    layouts_file: Path | None = Field(default=None, alias="layoutsFile")
    """MIG layouts in the mig-parted v1 format; None uses the layouts shipped with the agent."""
    state_dir: Path = Field(default=Path("/var/lib/gpu-node-agent"), alias="stateDir")
    """Where the apply journal lives; must survive agent restarts."""
    pod_resources_socket: Path = Field(
        default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"), alias="podResourcesSocket"
    )
    busy_policy: Literal["fail", "wait"] = Field(default="fail", alias="busyPolicy")
    """When pods hold devices of a GPU to change: fail at once naming them, or wait for them to end."""
    busy_wait_seconds: float = Field(default=300.0, ge=0, le=86400, alias="busyWaitSeconds")


class AgentConfig(_Strict):
    version: Literal["v1"]
    flags: Flags = Flags()
    sharing: Sharing = Sharing()
    health: HealthSettings = HealthSettings()
    mig: MigSettings = MigSettings()
    telemetry: TelemetrySettings = TelemetrySettings()


DEFAULT_CONFIG = AgentConfig(version="v1")


def _format(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        reason = e["msg"]
        path = ""
        for part in e["loc"]:
            if part == "[key]":
                reason = f"bad key: {reason}"
            elif isinstance(part, int):
                path += f"[{part}]"
            elif "[" in str(part) or str(part).startswith("function-"):
                continue  # a union or validator branch pydantic names in the location: not a key
            else:
                path += ("." if path else "") + str(part)
        path = path or "(top level)"
        if e["type"] == "extra_forbidden":
            reason = "unknown key"
        elif e["type"] == "value_error":
            reason = reason.removeprefix("Value error, ")
        elif e["type"] == "literal_error":
            reason = f"got {e['input']!r}; " + e["msg"].replace("Input should be", "expected")
        lines.append(f"{origin}: {path}: {reason}")
    return "\n".join(lines)


def parse_config(text: str, origin: str = "config") -> AgentConfig:
    try:
        data = load_yaml(text)
    except YamlProblem as err:
        raise ConfigError(f"{origin}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with 'version: v1' at the top level")
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, origin)) from err


def named_configs(directory: Path) -> dict[str, Path]:
    """The configs of a directory (a mounted ConfigMap): every regular file not starting with '.', by its
    name without a .yaml or .yml suffix."""
    found = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        found[entry.name.removesuffix(".yaml").removesuffix(".yml")] = entry
    return found


def config_file(path: Path, name: str | None = None) -> Path:
    """The file to read: `path` itself, or in a directory of named configs the one called `name` (from the
    node label nvidia.com/device-plugin.config), else `default`, else the only one."""
    if not path.is_dir():
        if name is not None:
            raise ConfigError(f"{path}: a config named {name!r} is asked for, but {path} is a single file")
        return path
    try:
        configs = named_configs(path)
    except OSError as err:
        raise ConfigError(f"{path}: cannot list configs: {err.strerror}") from err
    known = ", ".join(configs) or "none"
    if name is not None:
        if name not in configs:
            raise ConfigError(f"{path}: no config named {name!r} (known: {known})")
        return configs[name]
    if "default" in configs:
        return configs["default"]
    if len(configs) == 1:
        return next(iter(configs.values()))
    raise ConfigError(f"{path}: no config named 'default' and no node label choosing one (known: {known})")


def load_config(path: Path | None, name: str | None = None) -> AgentConfig:
    """The config at `path` (a file, or a directory of named configs), or the defaults when none is given."""
    if path is None:
        return DEFAULT_CONFIG
    chosen = config_file(path, name)
    try:
        text = chosen.read_text()
    except OSError as err:
        raise ConfigError(f"{chosen}: cannot read config: {err.strerror}") from err
    return parse_config(text, str(chosen))
