"""The agent's own Node through the API server: get, watch with relist, patch owned labels, record events."""

from __future__ import annotations

import datetime
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes.aio import client, config, watch

from agent.kube.view import Condition, NodeView

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
MERGE_PATCH = "application/merge-patch+json"


def _taint(taint: Any) -> dict[str, str]:
    """A taint as the API wrote it, timeAdded included, so writing the list back changes nothing foreign."""
    fields = {"key": taint.key, "value": taint.value, "effect": taint.effect}
    if taint.time_added is not None:
        added = taint.time_added
        if isinstance(added, datetime.datetime):
            added = added.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        fields["timeAdded"] = str(added)
    return {k: v for k, v in fields.items() if v is not None}


def _view(node: Any) -> NodeView:
    meta = node.metadata
    taints = tuple(_taint(t) for t in (node.spec.taints or []))
    conditions = {
        c.type: Condition(c.type, c.status, c.reason or "", c.message or "")
        for c in ((node.status.conditions if node.status else None) or [])
    }
    return NodeView(
        name=meta.name,
        resource_version=meta.resource_version,
        uid=meta.uid or "",
        labels=dict(meta.labels or {}),
        annotations=dict(meta.annotations or {}),
        taints=taints,
        conditions=conditions,
    )


class NodeApi:
    """What the agent does with the API: its own Node only. Counts every write it makes."""

    def __init__(self, api_client: Any, node_name: str) -> None:
        self._client = api_client
        self._core = client.CoreV1Api(api_client)
        self.node_name = node_name
        self.writes = 0

    @classmethod
    async def connect(cls, kubeconfig: Path | None, node_name: str) -> NodeApi:
        configuration = client.Configuration()
        if kubeconfig is not None:
            await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
        return cls(client.ApiClient(configuration), node_name)

    async def close(self) -> None:
        await self._client.close()

    async def get(self) -> NodeView:
        return _view(await self._core.read_node(self.node_name))

    async def watch(self, resource_version: str) -> AsyncIterator[NodeView]:
        """Node versions after `resource_version`; ends when the watch expires (the caller relists)."""
        w = watch.Watch()
        try:
            async for event in w.stream(
                self._core.list_node,
                field_selector=f"metadata.name={self.node_name}",
                resource_version=resource_version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
            ):
                if event["type"] in ("ADDED", "MODIFIED"):
                    yield _view(event["object"])
        finally:
            w.stop()

    async def patch_metadata(self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]) -> NodeView:
        """A JSON merge patch of the given keys; None deletes a key. Other keys are left alone."""
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        self.writes += 1
        node = await self._core.patch_node(
            self.node_name, {"metadata": metadata}, _content_type=MERGE_PATCH
        )
        return _view(node)

    async def set_taints(self, taints: Sequence[Mapping[str, str]], resource_version: str) -> NodeView:
        """Replace spec.taints whole, only if the node is still at `resource_version` (409 otherwise)."""
        self.writes += 1
        node = await self._core.patch_node(
            self.node_name,
            {"metadata": {"resourceVersion": resource_version}, "spec": {"taints": [dict(t) for t in taints]}},
            _content_type=MERGE_PATCH,
        )
        return _view(node)

    async def set_condition(self, condition: Condition) -> NodeView:
        """Set one node condition (merged by type; the kubelet's own conditions are untouched)."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"status": {"conditions": [{
            "type": condition.type, "status": condition.status, "reason": condition.reason,
            "message": condition.message, "lastTransitionTime": now, "lastHeartbeatTime": now,
        }]}}
        self.writes += 1
        node = await self._core.patch_node_status(self.node_name, body)
        return _view(node)

    async def event(self, reason: str, message: str, kind: str = "Normal", uid: str = "") -> None:
        now = datetime.datetime.now(datetime.UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{self.node_name}.", namespace="default"),
            involved_object=client.V1ObjectReference(kind="Node", name=self.node_name, uid=uid or None),
            reason=reason,
            message=message,
            type=kind,
            source=client.V1EventSource(component="gpu-node-agent", host=self.node_name),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        self.writes += 1
        await self._core.create_namespaced_event("default", body)
