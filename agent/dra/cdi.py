"""Pure: the CDI spec (Container Device Interface) that gives a container the GPUs prepared for one claim."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CDI_VERSION = "0.6.0"


def cdi_kind(driver: str) -> str:
    """The spec's kind, vendor/class: the driver name and "gpu"."""
    return f"{driver}/gpu"


def claim_device_name(claim_uid: str) -> str:
    return f"claim-{claim_uid}"


def gpu_device_name(claim_uid: str, device: str) -> str:
    return f"claim-{claim_uid}-{device}"


def cdi_id(driver: str, name: str) -> str:
    """A fully qualified CDI device name, vendor/class=name."""
    return f"{cdi_kind(driver)}={name}"


def claim_spec(driver: str, claim_uid: str, devices: Sequence[tuple[str, str, Sequence[str]]],
               control_nodes: Sequence[str], dev_root: Path,
               env: Mapping[str, Mapping[str, str]] | None = None, claim_edits: Mapping[str, Any] | None = None
               ) -> dict[str, Any]:
    """The spec for one claim's devices, given as (device name, GPU or MIG UUID, device nodes): a CDI device
    per device with its device nodes (and the environment `env` gives that device, from the opaque config),
    and one for the claim with the control device nodes and NVIDIA_VISIBLE_DEVICES naming every device of the
    claim (so that a container given all of the claim's CDI devices sees each once), plus `claim_edits` (the
    environment and mounts of an MPS client)."""

    def node(path: str) -> dict[str, str]:
        host = str(dev_root / path.lstrip("/"))
        return {"path": path} if host == path else {"path": path, "hostPath": host}

    def edits(name: str, nodes: Sequence[str]) -> dict[str, Any]:
        found: dict[str, Any] = {"deviceNodes": [node(p) for p in nodes]}
        variables = (env or {}).get(name)
        if variables:
            found["env"] = [f"{k}={v}" for k, v in sorted(variables.items())]
        return found

    listed: list[dict[str, Any]] = [
        {"name": gpu_device_name(claim_uid, name), "containerEdits": edits(name, nodes)} for name, _, nodes in devices
    ]
    visible = ",".join(dict.fromkeys(uuid for _, uuid, _ in devices))  # replicas of one GPU name it once
    extra = claim_edits or {}
    whole: dict[str, Any] = {"env": [f"NVIDIA_VISIBLE_DEVICES={visible}", *extra.get("env", [])]}
    if control_nodes:
        whole["deviceNodes"] = [node(p) for p in control_nodes]
    if extra.get("mounts"):
        whole["mounts"] = list(extra["mounts"])
    listed.append({"name": claim_device_name(claim_uid), "containerEdits": whole})
    return {"cdiVersion": CDI_VERSION, "kind": cdi_kind(driver), "devices": listed}
