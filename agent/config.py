"""The versioned agent config file: schema, defaults and strict validation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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
    mig_strategy: Literal["none"] = Field(default="none", alias="migStrategy")
    """MIG strategy; this version advertises whole GPUs only ("none")."""
    plugin: PluginFlags = PluginFlags()


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

    @field_validator("xid", mode="after")
    @classmethod
    def _merge_defaults(cls, value: dict[int, Action]) -> dict[int, Action]:
        return {**DEFAULT_XID_ACTIONS, **value}

    def xid_action(self, xid: int) -> Action:
        return self.xid.get(xid, self.xid_default)


class AgentConfig(_Strict):
    version: Literal["v1"]
    flags: Flags = Flags()
    health: HealthSettings = HealthSettings()


DEFAULT_CONFIG = AgentConfig(version="v1")


def _format(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        reason = e["msg"]
        if loc and loc[-1] == "[key]":
            loc.pop()
            reason = f"bad key: {reason}"
        path = ".".join(loc) or "(top level)"
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
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{origin}: not valid YAML: {err}".replace("\n", " ")) from err
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with 'version: v1' at the top level")
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, origin)) from err


def load_config(path: Path | None) -> AgentConfig:
    """The config at `path`, or the defaults when no file is given."""
    if path is None:
        return DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from err
    return parse_config(text, str(path))
