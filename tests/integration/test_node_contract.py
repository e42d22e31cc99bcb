"""One contract for the agent's Node client, run against the real API server (NodeApi on the rig's
kube-apiserver) and against InMemoryNode, the stand-in several tests and `gpu-agent simulate` use.

The cases are what NodeReconciler (agent/kube/reconciler.py) relies on, made with the calls it makes: it reads the
Node and watches from the resourceVersion it read (listing again on 410 Expired, and watching from the list's
version); it writes labels and annotations as merge patches (None removes a key), its condition merged by type, and
its taint list whole with the resourceVersion it last saw as a precondition (reading again on 409 Conflict), that
version coming from the view its previous write returned; and it counts on nothing being written when nothing
changes."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from apiserver import ApiServer
from kubernetes import client as k8s

from agent.kube.node import NodeApi
from agent.kube.reconciler import NodeClient
from agent.kube.view import Condition, NodeView, is_conflict, is_expired
from agent.simulate import InMemoryNode

pytestmark = pytest.mark.matrix  # what the API server does here depends on its release

TAINT = {"key": "gpu-node-agent.io/gpu-fault", "value": "true", "effect": "NoSchedule"}
FOREIGN_TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
WATCH_S = 10.0
"""How long a case waits for a watch to deliver a version that already exists."""
_names = itertools.count()


@dataclass
class Server:
    """One Node behind one of the two implementations, and what a case needs besides the client."""

    kind: str
    node: str
    client: Callable[[], Awaitable[NodeClient]]
    """A client of the Node (NodeApi opens a new connection; the in-memory Node is its own client)."""
    forget_history: Callable[[], Awaitable[None]]
    """Make the server forget the versions before now, as the API server's watch cache does when it starts over
    (kube-apiserver restarted here; etcd stays)."""
    events: Callable[[], Awaitable[list[tuple[str, str, str]]]]
    """The Events recorded about the Node: (type, reason, message)."""
    writes: Callable[[NodeClient], int]


@pytest.fixture(params=["api-server", "in-memory"])
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Server]:
    name = f"contract-{next(_names)}"
    if request.param == "in-memory":
        node = InMemoryNode(name)

        async def same() -> NodeClient:
            return node

        async def compact() -> None:
            node.compact()

        async def recorded() -> list[tuple[str, str, str]]:
            return list(node.events)

        yield Server("in-memory", name, same, compact, recorded, lambda c: node.writes)
        return

    apiserver: ApiServer = request.getfixturevalue("apiserver")
    core = k8s.CoreV1Api(apiserver.admin_client())
    core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    clients: list[NodeApi] = []

    async def connect() -> NodeClient:
        api = await NodeApi.connect(apiserver.kubeconfig_path, name)
        clients.append(api)
        return api

    async def restart() -> None:
        for api in clients:
            await api.close()
        await asyncio.to_thread(apiserver.restart)

    async def listed() -> list[tuple[str, str, str]]:
        found = await asyncio.to_thread(core.list_namespaced_event, "default",
                                        field_selector=f"involvedObject.name={name}")
        return [(e.type, e.reason, e.message) for e in found.items]

    def counted(client: NodeClient) -> int:
        assert isinstance(client, NodeApi)
        return client.writes

    try:
        yield Server("api-server", name, connect, restart, listed, counted)
    finally:
        for api in clients:
            await api.close()
        core = k8s.CoreV1Api(apiserver.admin_client())  # a restart may have closed the first client's pool
        core.delete_node(name)


async def next_view(watch: AsyncIterator[NodeView]) -> NodeView:
    return await asyncio.wait_for(anext(watch), WATCH_S)


def ours(view: NodeView, *keys: str) -> dict[str, str]:
    """The node's labels among ``keys`` (the API server adds kubernetes.io/hostname and others of its own)."""
    return {k: v for k, v in view.labels.items() if k in keys}


async def test_get_returns_the_node_at_a_resource_version(server: Server) -> None:
    client = await server.client()
    view = await client.get()
    assert view.name == server.node
    assert view.resource_version.isdigit(), view.resource_version
    assert view.uid
    assert (await client.get()).resource_version == view.resource_version  # nothing changed, same version


async def test_a_change_gets_a_new_version_and_a_change_that_changes_nothing_keeps_it(server: Server) -> None:
    client = await server.client()
    before = await client.get()
    changed = await client.patch_metadata({"example.com/a": "1"}, {})
    assert changed.resource_version != before.resource_version
    assert (await client.get()).resource_version == changed.resource_version  # what the write returned is current

    same = await client.patch_metadata({"example.com/a": "1"}, {})
    assert same.resource_version == changed.resource_version
    # The taints as they are (an API server's new Node carries node.kubernetes.io/not-ready of its own).
    same = await client.set_taints([dict(t) for t in same.taints], same.resource_version)
    assert same.resource_version == changed.resource_version


async def test_a_watch_delivers_every_later_version_in_order_and_nothing_before(server: Server) -> None:
    client = await server.client()
    start = await client.get()
    first = await client.patch_metadata({"example.com/a": "1"}, {})
    second = await client.patch_metadata({"example.com/a": "2"}, {})

    watch = client.watch(start.resource_version)
    try:
        seen = [await next_view(watch), await next_view(watch)]
    finally:
        await watch.aclose()
    assert [(v.resource_version, ours(v, "example.com/a")) for v in seen] == [
        (first.resource_version, {"example.com/a": "1"}), (second.resource_version, {"example.com/a": "2"})]

    # From the newest version, the first thing a watch delivers is the next change.
    watch = client.watch(second.resource_version)
    try:
        third = await client.patch_metadata({"example.com/a": "3"}, {})
        view = await next_view(watch)
    finally:
        await watch.aclose()
    assert (view.resource_version, ours(view, "example.com/a")) == (third.resource_version, {"example.com/a": "3"})


async def test_a_watch_from_a_version_the_server_no_longer_keeps_gets_410(server: Server) -> None:
    client = await server.client()
    old = await client.patch_metadata({"example.com/a": "1"}, {})
    await client.patch_metadata({"example.com/a": "2"}, {})
    await server.forget_history()
    client = await server.client()

    watch = client.watch(old.resource_version)
    with pytest.raises(Exception) as caught:  # each client has its own error type; is_expired tells
        await next_view(watch)
    await watch.aclose()
    assert is_expired(caught.value), repr(caught.value)

    # Listing again and watching from the list's version works, though the Node has not changed since the
    # restart: what the reconciler does after a 410. (From 1.35 a watch from the Node's own version, older than
    # the restarted watch cache, is refused again.)
    now, version = await client.list()
    assert ours(now, "example.com/a") == {"example.com/a": "2"}
    watch = client.watch(version)
    try:
        later = await client.patch_metadata({"example.com/a": "3"}, {})
        view = await next_view(watch)
    finally:
        await watch.aclose()
    assert view.resource_version == later.resource_version


async def test_taints_written_against_a_stale_version_conflict_and_change_nothing(server: Server) -> None:
    agent, other = await server.client(), await server.client()
    read = await agent.get()
    # Someone else changes the Node after the agent read it.
    await other.set_taints([FOREIGN_TAINT], (await other.get()).resource_version)

    with pytest.raises(Exception) as caught:  # each client has its own error type; is_conflict tells
        await agent.set_taints([FOREIGN_TAINT, TAINT], read.resource_version)
    assert is_conflict(caught.value), repr(caught.value)
    assert (await agent.get()).taints == (FOREIGN_TAINT,)

    # Read again, write again: the list is replaced whole, and the version a write returns is the next
    # write's precondition.
    fresh = await agent.get()
    tainted = await agent.set_taints([FOREIGN_TAINT, TAINT], fresh.resource_version)
    assert tainted.taints == (FOREIGN_TAINT, TAINT)
    labelled = await agent.patch_metadata({"example.com/a": "1"}, {})
    cleared = await agent.set_taints([FOREIGN_TAINT], labelled.resource_version)
    assert cleared.taints == (FOREIGN_TAINT,)
    assert (await other.get()).taints == (FOREIGN_TAINT,)


async def test_labels_and_annotations_are_merged_and_none_removes_a_key(server: Server) -> None:
    client = await server.client()
    await client.patch_metadata({"example.com/a": "1", "example.com/b": "2"}, {"example.com/note": "x"})
    view = await client.patch_metadata({"example.com/a": None, "example.com/c": "3", "example.com/gone": None},
                                       {"example.com/other": "y"})
    keys = ("example.com/a", "example.com/b", "example.com/c", "example.com/gone")
    assert ours(view, *keys) == {"example.com/b": "2", "example.com/c": "3"}
    assert {k: v for k, v in view.annotations.items() if k.startswith("example.com/")} == {
        "example.com/note": "x", "example.com/other": "y"}
    view = await client.patch_metadata({}, {"example.com/note": None})
    assert {k: v for k, v in view.annotations.items() if k.startswith("example.com/")} == {"example.com/other": "y"}
    assert ours(await client.get(), *keys) == {"example.com/b": "2", "example.com/c": "3"}


async def test_conditions_are_merged_by_type(server: Server) -> None:
    client = await server.client()
    kubelet = Condition("Ready", "True", "KubeletReady", "kubelet is posting ready status")
    await client.set_condition(kubelet)
    await client.set_condition(Condition("GPUHealthy", "True", "GPUsHealthy", "all 8 GPUs healthy"))
    view = await client.set_condition(Condition("GPUHealthy", "False", "NodeGPUFault", "XID 79"))
    assert dict(view.conditions) == {
        "Ready": kubelet, "GPUHealthy": Condition("GPUHealthy", "False", "NodeGPUFault", "XID 79")}
    assert dict((await client.get()).conditions) == dict(view.conditions)


async def test_events_are_recorded_and_every_write_request_is_counted(server: Server) -> None:
    client = await server.client()
    view = await client.get()
    await client.event("GPUFault", "GPU GPU-1: XID 79", "Warning", view.uid)
    await client.event("GPURecovered", "GPU GPU-1: recovered from XID 79", "Normal", view.uid)
    assert sorted(await server.events()) == [("Normal", "GPURecovered", "GPU GPU-1: recovered from XID 79"),
                                             ("Warning", "GPUFault", "GPU GPU-1: XID 79")]
    view = await client.patch_metadata({"example.com/a": "1"}, {})
    await client.patch_metadata({"example.com/a": "1"}, {})  # a request that changes nothing is still a write
    view = await client.set_taints([TAINT], view.resource_version)
    await client.set_condition(Condition("GPUHealthy", "True", "GPUsHealthy", "all 8 GPUs healthy"))
    assert server.writes(client) == 6
