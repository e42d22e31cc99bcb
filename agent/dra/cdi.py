"""Pure: the CDI spec (Container Device Interface) that gives a container the GPUs prepared for one claim."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CDI_VERSION = "0.6.0"
IMEX_CHANNELS_DIR = "/dev/nvidia-caps-imex-channels/"


def imex_channel_node(channel: int) -> str:
    """The device node of IMEX channel `channel`."""
    return f"{IMEX_CHANNELS_DIR}channel{channel}"


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
    and one for the claim with the control device nodes and NVIDIA_VISIBLE_DEVICES naming every GPU device of
    the claim (so that a container given all of the claim's CDI devices sees each once), plus `claim_edits` (the
    environment and mounts of an MPS client). An IMEX channel (no UUID, its device node under
    /dev/nvidia-caps-imex-channels/) gets NVIDIA_IMEX_CHANNELS=<id> with its node, as NVIDIA's device plugin
    gives it; a claim of IMEX channels only sets no NVIDIA_VISIBLE_DEVICES, so that it leaves the GPUs another
    claim of the same container names alone."""

    def node(path: str) -> dict[str, str]:
        host = str(dev_root / path.lstrip("/"))
        return {"path": path} if host == path else {"path": path, "hostPath": host}

    def edits(name: str, nodes: Sequence[str]) -> dict[str, Any]:
        found: dict[str, Any] = {"deviceNodes": [node(p) for p in nodes]}
        variables = dict((env or {}).get(name) or {})
        channels = [p.removeprefix(IMEX_CHANNELS_DIR + "channel") for p in nodes if p.startswith(IMEX_CHANNELS_DIR)]
        if channels:
            variables["NVIDIA_IMEX_CHANNELS"] = ",".join(channels)
        if variables:
            found["env"] = [f"{k}={v}" for k, v in sorted(variables.items())]
        return found

    listed: list[dict[str, Any]] = [
        {"name": gpu_device_name(claim_uid, name), "containerEdits": edits(name, nodes)} for name, _, nodes in devices
    ]
    visible = ",".join(dict.fromkeys(uuid for _, uuid, _ in devices if uuid))  # replicas of one GPU name it once
    channels_only = bool(devices) and not visible
    extra = claim_edits or {}
    variables = [*([] if channels_only else [f"NVIDIA_VISIBLE_DEVICES={visible}"]), *extra.get("env", [])]
    whole: dict[str, Any] = {"env": variables} if variables else {}
    if control_nodes:
        whole["deviceNodes"] = [node(p) for p in control_nodes]
    if extra.get("mounts"):
        whole["mounts"] = list(extra["mounts"])
    listed.append({"name": claim_device_name(claim_uid), "containerEdits": whole})
    return {"cdiVersion": CDI_VERSION, "kind": cdi_kind(driver), "devices": listed}
