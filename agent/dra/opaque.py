"""Pure: the driver's opaque configuration of a claim's devices (`config[].opaque` in a DeviceClass or a
ResourceClaim, copied into the claim's allocation by the scheduler).

One kind, `GpuConfig` in API version `<driver>/v1`:

    {"apiVersion": "gpu.gpu-node-agent.io/v1", "kind": "GpuConfig", "env": {"NAME": "value"}}

`env` names environment variables the containers given the devices get. Entries apply to the requests they
name (all of the claim's when they name none; a request named `gpus` covers its subrequests `gpus/pair`...).
The class's entries come first and the claim's after them, so a claim's value of a variable overrides its
class's. Entries of other drivers are not this driver's to read and are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

KIND = "GpuConfig"
VERSION = "v1"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED = frozenset({"NVIDIA_VISIBLE_DEVICES"})
"""Variables the agent sets itself for a claim."""
SOURCE_ORDER = {"FromClass": 0, "FromClaim": 1}


class ConfigProblem(ValueError):
    """An opaque configuration this driver cannot apply; the message says what is wrong in one line."""


def api_version(driver: str) -> str:
    return f"{driver}/{VERSION}"


def parse(driver: str, parameters: Any) -> dict[str, str]:
    """The environment a GpuConfig gives; ConfigProblem for anything else."""
    if not isinstance(parameters, Mapping):
        raise ConfigProblem(f"the parameters are not a JSON object but {type(parameters).__name__}")
    version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if version != api_version(driver) or kind != KIND:
        raise ConfigProblem(f"unknown configuration apiVersion {version!r} kind {kind!r} (this driver reads "
                            f"apiVersion {api_version(driver)!r} kind {KIND!r})")
    unknown = sorted(set(parameters) - {"apiVersion", "kind", "env"})
    if unknown:
        raise ConfigProblem(f"{KIND} has no field {unknown[0]!r} (it has: env)")
    env = parameters.get("env") or {}
    if not isinstance(env, Mapping):
        raise ConfigProblem(f"{KIND}.env is not an object of names to strings")
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise ConfigProblem(f"{KIND}.env: {name!r} is not an environment variable name")
        if name in RESERVED:
            raise ConfigProblem(f"{KIND}.env: {name} is set by the driver")
        if not isinstance(value, str):
            raise ConfigProblem(f"{KIND}.env.{name}: {value!r} is not a string")
    return dict(env)


def _covers(requests: Sequence[str], request: str) -> bool:
    return not requests or request in requests or request.split("/", 1)[0] in requests


def device_env(driver: str, configs: Iterable[Mapping[str, Any]], requests_of: Mapping[str, Sequence[str]]
               ) -> dict[str, dict[str, str]]:
    """The environment of each device (by name, with the requests it was allocated for) from an allocation's
    `devices.config` entries: class entries, then claim entries, later values winning. ConfigProblem names the
    entry that cannot be applied."""
    listed = list(configs)
    ordered = sorted(range(len(listed)), key=lambda i: (SOURCE_ORDER.get(str(listed[i].get("source")), 1), i))
    env: dict[str, dict[str, str]] = {device: {} for device in requests_of}
    for i in ordered:
        entry = listed[i]
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != driver:
            continue
        try:
            values = parse(driver, opaque.get("parameters"))
        except ConfigProblem as err:
            source = entry.get("source")
            # Its place among its source's entries: the class's spec.config or the claim's spec.devices.config.
            place = sum(1 for j in range(i) if listed[j].get("source") == source)
            where = "the class's config" if source == "FromClass" else "the claim's config"
            raise ConfigProblem(f"{where}[{place}]: {err}") from None
        scope = [str(r) for r in entry.get("requests") or []]
        for device, requests in requests_of.items():
            if any(_covers(scope, r) for r in requests):
                env[device].update(values)
    return env
