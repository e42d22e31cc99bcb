"""Whether the agent's own Pod tolerates the taint the agent puts on its Node (health.taint).

The agent taints its node on node-level faults. A pod that does not tolerate that taint is evicted by it
(NoExecute), or cannot come back to the node once it restarts or is updated (NoSchedule): either way nothing is
left on the node to remove the taint, and the node never recovers. So the agent reads its own Pod (named by
POD_NAME and POD_NAMESPACE, set through the downward API) at start and refuses to run with a taint its pod does
not tolerate; after a config reload, the same check is one warning line.

Matching is Kubernetes' (k8s.io/api/core/v1 Toleration.ToleratesTaint): an empty effect matches every effect, an
empty key with operator Exists matches every key, Exists matches any value, Equal (or no operator) only the
same value. A NoExecute taint tolerated with tolerationSeconds evicts the pod after that many seconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp

from agent.config import TaintSettings
from agent.kube.credentials import CredentialsError
from agent.kube.node import ApiError

log = logging.getLogger(__name__)

TAINT_VALUE = "true"
"""The value of the agent's taint (agent/kube/reconciler.py node_intent)."""
READ_TIMEOUT_S = 10.0

CONSEQUENCE = {
    "NoExecute": "on a node fault the agent would evict itself and the node would never recover",
    "NoSchedule": "once the agent restarts on a node it tainted, its pod cannot come back and the node never "
                  "recovers",
    "PreferNoSchedule": "once the agent restarts on a node it tainted, the scheduler avoids putting its pod back",
}


class NotTolerated(Exception):
    """The agent's pod does not tolerate the configured taint; the message is one line naming the toleration."""


@runtime_checkable
class PodReader(Protocol):
    async def get_pod(self, namespace: str, name: str, timeout: float = ...) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def tolerates(toleration: Mapping[str, Any], key: str, value: str, effect: str) -> bool:
    """Whether one toleration tolerates the taint key=value:effect, as the scheduler and the kubelet decide."""
    if toleration.get("effect") and toleration["effect"] != effect:
        return False
    if toleration.get("key") and toleration["key"] != key:
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    if operator == "Equal":
        return (toleration.get("value") or "") == value
    return False


def problem(tolerations: Sequence[Mapping[str, Any]], key: str, effect: str, value: str = TAINT_VALUE) -> str | None:
    """Why `tolerations` do not keep a pod on a node tainted key=value:effect, or None when they do."""
    matching = [t for t in tolerations if tolerates(t, key, value, effect)]
    if not matching:
        return "is not tolerated"
    seconds = [int(t["tolerationSeconds"]) for t in matching if t.get("tolerationSeconds") is not None]
    if effect == "NoExecute" and seconds:
        return f"is tolerated for only {max(min(seconds), 0)}s (tolerationSeconds)"
    return None


def own_pod(env: Mapping[str, str]) -> PodRef | None:
    """The agent's Pod from the downward API variables; None outside a Pod (no POD_NAME)."""
    name = env.get("POD_NAME", "")
    if not name:
        return None
    return PodRef(env.get("POD_NAMESPACE", ""), name)


def _taint_text(taint: TaintSettings) -> str:
    return f"{taint.key}={TAINT_VALUE}:{taint.effect}"


async def _verdict(api: PodReader, taint: TaintSettings, env: Mapping[str, str]) -> tuple[int, str | None]:
    """(logging level, line) for the check; level ERROR means the pod does not tolerate the taint."""
    pod = own_pod(env)
    shown = f"health.taint {_taint_text(taint)}"
    if pod is None:
        return logging.INFO, f"not running in a pod (POD_NAME is not set): not checking that it tolerates {shown}"
    if not pod.namespace:
        return logging.WARNING, (f"POD_NAME is set but POD_NAMESPACE is not: cannot read pod {pod.name} to check "
                                 f"that it tolerates {shown} (set POD_NAMESPACE from metadata.namespace)")
    try:
        found = await api.get_pod(pod.namespace, pod.name, timeout=READ_TIMEOUT_S)
    except ApiError as err:
        if err.status == 403:
            return logging.WARNING, (
                f"cannot check that pod {pod} tolerates {shown}: its ServiceAccount may not read it (it needs "
                f"`get` on pods in namespace {pod.namespace}, which the shipped Role grants); not checked")
        if err.status == 404:
            return logging.WARNING, (f"cannot check that pod {pod} tolerates {shown}: the API server has no such pod "
                                     "(POD_NAME and POD_NAMESPACE come from the downward API); not checked")
        return logging.WARNING, f"cannot check that pod {pod} tolerates {shown}: the API server answered {err}"
    except (TimeoutError, aiohttp.ClientError, OSError, CredentialsError, ValueError) as err:  # ValueError: not JSON
        reason = str(err) or type(err).__name__
        return logging.WARNING, f"cannot check that pod {pod} tolerates {shown}: {reason}; not checked"
    tolerations = [t for t in (found.get("spec") or {}).get("tolerations") or [] if isinstance(t, dict)]
    why = problem(tolerations, taint.key, taint.effect)
    if why is None:
        return logging.DEBUG, None
    fix = (f"remove tolerationSeconds from the toleration of {taint.key}" if "tolerationSeconds" in why else
           f"add {{key: {taint.key}, operator: Exists}} to the DaemonSet's tolerations")
    return logging.ERROR, (f"{shown} {why} by pod {pod} ({CONSEQUENCE[taint.effect]}); {fix}, or set "
                           "health.taint to a taint the pod tolerates")


async def check_at_start(api: PodReader, taint: TaintSettings, env: Mapping[str, str] = os.environ) -> None:
    """Refuse (NotTolerated) a taint the agent's pod does not tolerate; a check that cannot be made is one log
    line, and the agent starts."""
    level, line = await _verdict(api, taint, env)
    if level == logging.ERROR:
        raise NotTolerated(line)
    if line is not None:
        log.log(level, "%s", line)


async def check_reloaded(api: object, taint: TaintSettings, env: Mapping[str, str] = os.environ) -> str | None:
    """Before a reloaded config is taken: why the pod does not tolerate its taint (the reload is then rejected),
    or None. A check that cannot be made is one warning line and None. `api` is the agent's API client
    (AgentOptions.kube); without one that reads Pods (None under --no-kube), nothing is checked."""
    if not isinstance(api, PodReader):
        return None
    level, line = await _verdict(api, taint, env)
    if level == logging.ERROR:
        return line
    if level == logging.WARNING:
        log.warning("%s", line)
    return None
