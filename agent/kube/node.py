"""The agent's own Node through the API server: get, list and watch, patch owned parts, record Events; and a
read of the agent's own Pod.

A few REST calls over aiohttp rather than the generated kubernetes client: the agent makes six kinds of request
on one object, and the generated client's models alone would cost it about 40 MB of its 100 MB budget.
"""

from __future__ import annotations

import datetime
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from agent.kube.client import DEFAULT_BURST, DEFAULT_QPS, REQUEST_TIMEOUT_S, ApiClient, TokenBucket
from agent.kube.credentials import Credentials, from_kubeconfig, in_cluster
from agent.kube.usage import ApiCounts, ApiError
from agent.kube.view import Condition, NodeView

log = logging.getLogger(__name__)

WATCH_TIMEOUT_MIN_S = 1800
"""The server ends each watch after a time drawn from [this, twice this) (the API server's own default range,
--min-request-timeout), and the agent watches again from the last version it saw: a watch costs the control
plane one request per half hour or so, and a fleet's watches do not all end together."""
EVENT_REPEAT_S = 600.0
"""A repeat of an Event within ten minutes counts on the one recorded (the kubelet's recorder aggregates the
same way)."""
EVENT_BURST = 25
EVENT_REFILL_S = 300.0
"""Events per Node: a burst of 25, then one every five minutes (the kubelet's recorder's spam filter)."""
EVENT_CACHE = 64
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
__all__ = ["REQUEST_TIMEOUT_S", "ApiError", "Credentials", "NodeApi", "node_view"]


def _taint(taint: Mapping[str, Any]) -> dict[str, str]:
    """A taint as the API wrote it, timeAdded included, so writing the list back changes nothing foreign."""
    return {k: str(taint[k]) for k in ("key", "value", "effect", "timeAdded") if taint.get(k) is not None}


def node_view(node: Mapping[str, Any]) -> NodeView:
    meta = node.get("metadata") or {}
    conditions = {
        c["type"]: Condition(c["type"], c.get("status", ""), c.get("reason") or "", c.get("message") or "")
        for c in (node.get("status") or {}).get("conditions") or []
    }
    return NodeView(
        name=meta.get("name", ""),
        resource_version=meta.get("resourceVersion", ""),
        uid=meta.get("uid") or "",
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        taints=tuple(_taint(t) for t in (node.get("spec") or {}).get("taints") or []),
        conditions=conditions,
        allocatable={k: str(v) for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()},
    )


class NodeApi:
    """What the agent does with the API: its own Node (and a read of its own Pod). Counts every write it makes."""

    def __init__(self, api: ApiClient | Credentials, node_name: str) -> None:
        self.api = api if isinstance(api, ApiClient) else ApiClient(api)
        """The agent's one API server client (rate limit, counts), shared with the DRA slice publisher."""
        self.node_name = node_name
        self.writes = 0
        self._events: dict[tuple[str, str, str, str], _Recorded] = {}
        """The Events recorded lately, oldest first, by (reason, message, type, node UID)."""
        self._event_tokens = TokenBucket(1 / EVENT_REFILL_S, EVENT_BURST)
        self._dropping = False

    @classmethod
    async def connect(cls, kubeconfig: Path | None, node_name: str, qps: float = DEFAULT_QPS,
                      burst: int = DEFAULT_BURST, start_jitter_s: float = 0.0,
                      since: float | None = None) -> NodeApi:
        """The client of the kubeconfig's current context (in-cluster credentials without one), with a rate
        limit of `qps` requests a second on average and bursts of `burst`, whose first requests wait until a
        random moment within `start_jitter_s` of `since` (default now; ApiClient)."""
        credentials = from_kubeconfig(kubeconfig) if kubeconfig is not None else in_cluster()
        return cls(ApiClient(credentials, qps, burst, start_jitter_s, since=since), node_name)

    def start_now(self) -> None:
        """Requests go at once from now on, the start jitter or not (a fault must reach the Node)."""
        self.api.start_now()

    @property
    def counts(self) -> ApiCounts:
        """What the agent's API client sent, for /metrics."""
        return self.api.counts

    async def close(self) -> None:
        await self.api.close()

    @property
    def _node_path(self) -> str:
        return f"/api/v1/nodes/{quote(self.node_name, safe='')}"

    async def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                       timeout: float = REQUEST_TIMEOUT_S, urgent: bool = False) -> Any:
        return await self.api.request(method, path, body, content_type, timeout, urgent)

    async def get(self) -> NodeView:
        return node_view(await self._request("GET", self._node_path))

    async def list(self) -> tuple[NodeView, str]:
        """The Node by a LIST of nodes selected by name, and the list's resourceVersion: the version a watch
        starts from. Not the Node's own version: an API server that has just restarted starts its watch cache
        at the newest version in etcd, and a watch from an older one (the Node's, when the Node has not changed
        since) is refused as expired until the Node changes again. A Node that is not there is ApiError 404."""
        selector = quote(f"metadata.name={self.node_name}", safe="")
        listed = await self._request("GET", f"/api/v1/nodes?fieldSelector={selector}")
        items = listed.get("items") if isinstance(listed, dict) else None
        if not items:
            raise ApiError(404, "NotFound", f'nodes "{self.node_name}" not found')
        view = node_view(items[0])
        return view, str((listed.get("metadata") or {}).get("resourceVersion") or view.resource_version)

    async def get_pod(self, namespace: str, name: str, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """A Pod as the API server has it: the agent reads its own, to check its tolerations (agent/kube/selfpod.py).
        Sent without waiting for the start jitter: the check must answer before the agent starts."""
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        pod = await self._request("GET", path, timeout=timeout, urgent=True)
        return pod if isinstance(pod, dict) else {}

    async def watch(self, resource_version: str) -> AsyncIterator[NodeView | str]:
        """Node versions after `resource_version`, and the resourceVersion of each bookmark (a str), until the
        server ends the watch. A version the server no longer has raises ApiError 410 (list again)."""
        selector = quote(f"metadata.name={self.node_name}", safe="")
        server_timeout = random.randrange(WATCH_TIMEOUT_MIN_S, 2 * WATCH_TIMEOUT_MIN_S)
        path = (f"/api/v1/nodes?watch=true&fieldSelector={selector}&resourceVersion={quote(resource_version)}"
                f"&timeoutSeconds={server_timeout}&allowWatchBookmarks=true")
        async for event in self.api.watch_lines(path, server_timeout):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise ApiError(int(obj.get("code", 500)), obj.get("reason", ""), obj.get("message", ""))
            if kind in ("ADDED", "MODIFIED"):
                yield node_view(obj)
            elif kind == "BOOKMARK":
                yield str((obj.get("metadata") or {}).get("resourceVersion") or resource_version)

    async def patch_metadata(self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]) -> NodeView:
        """A JSON merge patch of the given keys; None deletes a key. Other keys are left alone."""
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        self.writes += 1
        return node_view(await self._request("PATCH", self._node_path, {"metadata": metadata}, MERGE_PATCH))

    async def set_taints(self, taints: Sequence[Mapping[str, str]], resource_version: str) -> NodeView:
        """Replace spec.taints whole, only if the node is still at `resource_version` (409 otherwise)."""
        self.writes += 1
        body = {"metadata": {"resourceVersion": resource_version}, "spec": {"taints": [dict(t) for t in taints]}}
        return node_view(await self._request("PATCH", self._node_path, body, MERGE_PATCH))

    async def set_condition(self, condition: Condition) -> NodeView:
        """Set one node condition (merged by type; the kubelet's own conditions are untouched)."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"status": {"conditions": [{
            "type": condition.type, "status": condition.status, "reason": condition.reason,
            "message": condition.message, "lastTransitionTime": now, "lastHeartbeatTime": now,
        }]}}
        self.writes += 1
        return node_view(await self._request("PATCH", self._node_path + "/status", body, STRATEGIC_MERGE_PATCH))

    async def event(self, reason: str, message: str, kind: str = "Normal", uid: str = "") -> None:
        """Record an Event on the Node, as the kubelet's recorder does: a repeat of the same reason and message
        within EVENT_REPEAT_S raises the count of the Event already there (one PATCH) instead of making another,
        and Events are rate limited (a burst of EVENT_BURST, then one per EVENT_REFILL_S); one beyond the limit
        is dropped, counted and said once."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        key = (reason, message, kind, uid)
        seen = self._events.get(key)
        clock = time.monotonic()
        if seen is not None and clock - seen.at < EVENT_REPEAT_S:
            path = f"/api/v1/namespaces/default/events/{quote(seen.name, safe='')}"
            self.writes += 1
            try:
                await self._request("PATCH", path, {"count": seen.count + 1, "lastTimestamp": now}, MERGE_PATCH)
            except ApiError as err:
                if err.status != 404:
                    raise
                del self._events[key]  # it expired from the API server (an hour by default): record it anew
            else:
                self._events[key] = _Recorded(seen.name, seen.count + 1, clock)
                return
        if not self._event_tokens.take_now():
            self.counts.events_dropped += 1
            if not self._dropping:
                log.warning("Events are rate limited (%d, then one per %.0f s): not recording %s %s and others "
                            "like it for now (gpu_agent_api_events_dropped_total counts them)", EVENT_BURST,
                            EVENT_REFILL_S, reason, message[:80])
            self._dropping = True
            return
        self._dropping = False
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{self.node_name}.", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": self.node_name, **({"uid": uid} if uid else {})},
            "reason": reason, "message": message, "type": kind,
            "source": {"component": "gpu-node-agent", "host": self.node_name},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self.writes += 1
        created = await self._request("POST", "/api/v1/namespaces/default/events", body)
        name = str(((created or {}).get("metadata") or {}).get("name") or "")
        if name:
            self._events[key] = _Recorded(name, 1, clock)
            while len(self._events) > EVENT_CACHE:
                del self._events[next(iter(self._events))]


@dataclass(frozen=True)
class _Recorded:
    """An Event this agent made: its name, its count, when it was last recorded (monotonic)."""

    name: str
    count: int
    at: float
