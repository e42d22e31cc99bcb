"""What the agent knows of its Node, and how API errors are told apart; free of the kubernetes client so that
the agent without an API server (--no-kube, simulate) does not load it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class NodeView:
    name: str
    resource_version: str
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()
    conditions: Mapping[str, Condition] = field(default_factory=dict)
    allocatable: Mapping[str, str] = field(default_factory=dict)
    """status.allocatable as the kubelet last reported it (quantities as strings, e.g. "8")."""


class Conflict(Exception):
    """A write made against an older resourceVersion (HTTP 409)."""

    status = 409
    reason = "Conflict"


def _status(err: BaseException) -> int | None:
    status = getattr(err, "status", None)
    return status if isinstance(status, int) else None


def is_conflict(err: BaseException) -> bool:
    return _status(err) == 409


def is_expired(err: BaseException) -> bool:
    return _status(err) == 410


def describe_error(err: BaseException) -> str:
    status = _status(err)
    if status is not None:
        said = f"API server answered {status} {getattr(err, 'reason', '')}".rstrip()
        message = getattr(err, "message", "")
        return f"{said}: {message}" if isinstance(message, str) and message else said
    if isinstance(err, asyncio.TimeoutError):
        return "API server timed out"
    return f"{type(err).__name__}: {err}"
