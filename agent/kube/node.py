"""The agent's own Node through the API server: get, watch with relist, patch owned parts, record Events; and a
read of the agent's own Pod.

A few REST calls over aiohttp rather than the generated kubernetes client: the agent makes six kinds of request
on one object, and the generated client's models alone would cost it about 40 MB of its 100 MB budget.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from agent.kube.view import Condition, NodeView
from agent.yamlfile import InputFileError, YamlProblem, load_yaml, read_text_file

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
"""The server ends each watch after this long; the agent lists and watches again."""
REQUEST_TIMEOUT_S = 30.0
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_LINE = 16 * 1024 * 1024
"""A watch event is one line; a Node with many images in its status is large."""


class ApiError(RuntimeError):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason


class CredentialsError(ValueError):
    """The kubeconfig or in-cluster credentials cannot be used; the message says which part and why."""


TOKEN_MAX_BYTES = 64 * 1024
"""A bearer token is a few kilobytes at most (a projected service-account token is about one)."""


@dataclass
class Credentials:
    server: str
    ssl: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None
    """Read before each request: projected service-account tokens are rotated by the kubelet."""

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            try:
                token = read_text_file(self.token_file, TOKEN_MAX_BYTES).strip()
            except InputFileError as err:
                raise CredentialsError(f"cannot read the token {self.token_file}: {err.reason}") from None
        return {"Authorization": f"Bearer {token}"} if token else {}


def _material(entry: Mapping[str, Any], key: str, base: Path) -> tuple[str | None, bytes | None]:
    """A kubeconfig file reference (`key`, relative to the kubeconfig) or inline data (`key-data`, base64)."""
    if entry.get(f"{key}-data"):
        return None, base64.b64decode(entry[f"{key}-data"])
    if entry.get(key):
        path = Path(entry[key])
        return str(path if path.is_absolute() else base / path), None
    return None, None


def _ssl_context(ca_file: str | None, ca_data: bytes | None, insecure: bool) -> ssl.SSLContext:
    """The TLS context for the API server: its CA, or (insecure-skip-tls-verify) no check of the server at all;
    either way a context, so that a client certificate can still be presented."""
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=ca_file, cadata=ca_data.decode() if ca_data else None)


def _load_client_cert(context: ssl.SSLContext, cert: tuple[str | None, bytes | None],
                      key: tuple[str | None, bytes | None]) -> None:
    (cert_file, cert_data), (key_file, key_data) = cert, key
    if not (cert_file or cert_data):
        return
    with tempfile.TemporaryDirectory(prefix="gpu-agent-cert-") as tmp:
        # The ssl module loads certificates from files only; inline data is written to a private temp dir.
        if cert_data is not None:
            cert_file = os.path.join(tmp, "cert.pem")
            Path(cert_file).write_bytes(cert_data)
        if key_data is not None:
            key_file = os.path.join(tmp, "key.pem")
            Path(key_file).write_bytes(key_data)
        assert cert_file is not None
        context.load_cert_chain(cert_file, key_file)


def _named(config: dict[str, Any], section: str, name: object, path: Path) -> dict[str, Any]:
    """The `section` entry (cluster, user, context) called `name` in a kubeconfig, or CredentialsError."""
    entries = config.get(section + "s") or []
    if not isinstance(entries, list):
        raise CredentialsError(f"kubeconfig {path}: {section}s is not a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(section) or {}
            if not isinstance(body, dict):
                raise CredentialsError(f"kubeconfig {path}: {section} {name!r} is not a mapping")
            return body
    raise CredentialsError(f"kubeconfig {path}: no {section} named {name!r}")


def from_kubeconfig(path: Path) -> Credentials:
    """Server and credentials of the kubeconfig's current context: token, token file or client certificate."""
    try:
        config = load_yaml(read_text_file(path))
    except InputFileError as err:
        raise CredentialsError(f"cannot read kubeconfig {path}: {err.reason}") from None
    except YamlProblem as err:
        raise CredentialsError(f"kubeconfig {path}: {err}") from None
    if not isinstance(config, dict):
        raise CredentialsError(f"kubeconfig {path}: not a kubeconfig (expected a mapping)")
    current = config.get("current-context")
    if not current:
        raise CredentialsError(f"kubeconfig {path}: no current-context (set one with kubectl config use-context)")
    context = _named(config, "context", current, path)
    cluster = _named(config, "cluster", context.get("cluster"), path)
    user = _named(config, "user", context.get("user"), path) if context.get("user") else {}
    if not cluster.get("server"):
        raise CredentialsError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no server")
    if "exec" in user or "auth-provider" in user:
        raise CredentialsError(f"kubeconfig {path}: exec and auth-provider credentials are not supported; "
                               "use a token, a token file or a client certificate")
    base = path.parent
    ca_file, ca_data = _material(cluster, "certificate-authority", base)
    context_ssl = _ssl_context(ca_file, ca_data, bool(cluster.get("insecure-skip-tls-verify")))
    _load_client_cert(context_ssl, _material(user, "client-certificate", base), _material(user, "client-key", base))
    # A relative tokenFile is relative to the kubeconfig, as kubectl reads it (and as the certificate paths are).
    token_file = base / user["tokenFile"] if user.get("tokenFile") else None
    return Credentials(str(cluster["server"]).rstrip("/"), context_ssl, user.get("token"), token_file)


def in_cluster() -> Credentials:
    """The pod's service account: the API server from the environment, the projected token and CA."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise CredentialsError("not running in a pod (KUBERNETES_SERVICE_HOST is not set); pass --kubeconfig")
    ca = SERVICE_ACCOUNT / "ca.crt"
    if not ca.exists():
        raise CredentialsError(f"no service-account CA at {ca}")
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return Credentials(server, _ssl_context(str(ca), None, False), token_file=SERVICE_ACCOUNT / "token")


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

    def __init__(self, credentials: Credentials, node_name: str) -> None:
        self._credentials = credentials
        self.node_name = node_name
        self.writes = 0
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    async def connect(cls, kubeconfig: Path | None, node_name: str) -> NodeApi:
        return cls(from_kubeconfig(kubeconfig) if kubeconfig is not None else in_cluster(), node_name)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._credentials.ssl, limit=4),
                read_bufsize=MAX_LINE // 2,  # a line may grow to twice this before aiohttp refuses it
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def _node_path(self) -> str:
        return f"/api/v1/nodes/{quote(self.node_name, safe='')}"

    async def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                       timeout: float = REQUEST_TIMEOUT_S) -> Any:
        headers = {"Accept": "application/json", **self._credentials.headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._http().request(method, self._credentials.server + path, data=data, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            payload = await response.read()
            if response.status >= 400:
                raise _error(response.status, payload)
            return json.loads(payload) if payload else None

    async def get(self) -> NodeView:
        return node_view(await self._request("GET", self._node_path))

    async def get_pod(self, namespace: str, name: str, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """A Pod as the API server has it: the agent reads its own, to check its tolerations (agent/kube/selfpod.py)."""
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        pod = await self._request("GET", path, timeout=timeout)
        return pod if isinstance(pod, dict) else {}

    async def watch(self, resource_version: str) -> AsyncIterator[NodeView]:
        """Node versions after `resource_version`; ends when the watch expires (the caller lists again).
        An expired version raises ApiError 410."""
        selector = quote(f"metadata.name={self.node_name}", safe="")
        path = (f"/api/v1/nodes?watch=true&fieldSelector={selector}&resourceVersion={quote(resource_version)}"
                f"&timeoutSeconds={WATCH_TIMEOUT_S}&allowWatchBookmarks=true")
        headers = {"Accept": "application/json", **self._credentials.headers()}
        # The server closes the watch after WATCH_TIMEOUT_S; the client waits a little longer for that.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=WATCH_TIMEOUT_S + 30)
        async with self._http().get(self._credentials.server + path, headers=headers, timeout=timeout) as response:
            if response.status >= 400:
                raise _error(response.status, await response.read())
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiError(int(obj.get("code", 500)), obj.get("reason", ""), obj.get("message", ""))
                if kind in ("ADDED", "MODIFIED"):
                    yield node_view(obj)

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
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{self.node_name}.", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": self.node_name, **({"uid": uid} if uid else {})},
            "reason": reason, "message": message, "type": kind,
            "source": {"component": "gpu-node-agent", "host": self.node_name},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self.writes += 1
        await self._request("POST", "/api/v1/namespaces/default/events", body)


def _error(status: int, payload: bytes) -> ApiError:
    try:
        detail = json.loads(payload)
        return ApiError(status, str(detail.get("reason", "")), str(detail.get("message", "")))
    except ValueError:
        return ApiError(status, "", payload.decode(errors="replace")[:200])
