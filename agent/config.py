"""The versioned agent config file: schema, defaults and strict validation."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEVICE_LIST_STRATEGIES = ("envvar", "cdi")


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


class AgentConfig(_Strict):
    version: Literal["v1"]
    flags: Flags = Flags()


DEFAULT_CONFIG = AgentConfig(version="v1")


def _format(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        reason = e["msg"]
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
