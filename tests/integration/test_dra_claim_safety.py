"""The DRA kubelet plugin under the kubelet's concurrency and the agent's crashes, called over its real unix
socket as the kubelet calls it, with the claims as the API server would answer them: an unprepare that arrives
while a prepare waits for the API server is not undone by it; a device held by one claim is refused to another;
a prepare or an unprepare cut short at any step (on the fake NVML, with dra.dynamicMig too) converges after a
restart and the kubelet's retry, leaving no CDI spec, MIG device or claim behind."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.config import parse_config
from agent.dra import claims as dra_claims
from agent.dra.claims import ClaimStore, Paths
from agent.dra.dynamic import DynamicMig, DynamicSlicePublisher
from agent.dra.plugin import DraKubeletPlugin
from agent.dra.v1 import api_pb2 as v1
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.state import NodeState, StateBus
from tests.plugin_harness import carve_mig, gpu_instances, short_dir

DRIVER = "gpu.gpu-node-agent.io"
NODE = "node-a"
NS = "team"
KIND = f"{DRIVER}/gpu"
SHARED = "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [0]}]}}\n"
DRA_MODE = "version: v1\ndra: {enabled: true}\n"
"""The config of a node in DRA mode (the kubelet plugin prepares claims only there)."""


class ApiClaims:
    """The claims as the API server answers them; a claim whose name is in `held` is answered only once
    its event is set (the read is slow), and `asked` is set when such a read begins."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.held: dict[str, asyncio.Event] = {}
        self.asked = asyncio.Event()

    def allocate(self, name: str, uid: str, devices: list[str], share: bool = False) -> None:
        results = [{"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d,
                    **({"shareID": f"share-{uid}"} if share else {})} for d in devices]
        self.claims[(NS, name)] = {"metadata": {"namespace": NS, "name": name, "uid": uid},
                                   "status": {"allocation": {"devices": {"results": results}}}}

    async def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        if name in self.held:
            self.asked.set()
            await self.held[name].wait()
        return copy.deepcopy(self.claims.get((namespace, name)))


class Node:
    """A node's DRA kubelet plugin over the given directory: made again for each "start" of the agent."""

    def __init__(self, directory: Path, preset: str = "a100-pcie-nvlink-pairs", config: str = "",
                 dynamic_mig: bool = False) -> None:
        self.directory = directory
        self.fake = FakeNvml(load_node(preset))
        if dynamic_mig:
            carve_mig(self.fake, 0, [])
        self.backend = fake_backend(self.fake)
        self.backend.init()
        text = "version: v1\n" + config + ("dra: {enabled: true, dynamicMig: true}\n" if dynamic_mig
                                           else "dra: {enabled: true}\n")
        self.bus = StateBus(NodeState(version=1, inventory=self.backend.inventory(), config=parse_config(text)))
        self.api = ApiClaims()
        self.paths = Paths.under(directory, DRIVER, directory / "cdi")
        self.dynamic_mig = dynamic_mig
        self._pool = ThreadPoolExecutor(1)

    async def nvml(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def plugin(self) -> DraKubeletPlugin:
        """The plugin as a start of the agent makes it (its checkpoint read again)."""
        dynamic = DynamicMig(self.backend, self.nvml, ClaimStore(self.paths, DRIVER)) if self.dynamic_mig else None
        self.dynamic = dynamic
        return DraKubeletPlugin(self.paths, DRIVER, NODE, self.bus, self.api, [], Path("/"), lambda: None, {},
                                dynamic)

    async def publish(self) -> None:
        """The slice publisher's first write with dra.dynamicMig, against an API server that keeps counters."""
        assert self.dynamic is not None
        await DynamicSlicePublisher(Slices(), self.bus, NODE, DRIVER, self.dynamic).sync(self.bus.current)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[tuple[DraKubeletPlugin, v1_grpc.DRAPluginStub]]:
        plugin = self.plugin()
        await plugin.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.paths.endpoint}") as channel:
                yield plugin, v1_grpc.DRAPluginStub(channel)
        finally:
            await plugin.stop()

    def spec(self, uid: str) -> Path:
        return self.directory / "cdi" / f"{DRIVER}-claim-{uid}.json"

    def cdi_files(self) -> list[str]:
        folder = self.directory / "cdi"
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []

    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint as a user reads it."""
        found: dict[str, Any] = json.loads(self.paths.checkpoint.read_text())
        return found

    def claims(self) -> dict[str, str]:
        """The checkpoint's claims and their states."""
        return {uid: entry["state"] for uid, entry in self.checkpoint()["claims"].items()}

    def close(self) -> None:
        self._pool.shutdown()


class Slices:
    """ResourceSlices kept in memory, counters included, as an API server with DRAPartitionableDevices."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}

    async def version(self) -> dict[str, str]:
        return {"gitVersion": "v1.36.0"}

    async def create(self, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        kept = {**copy.deepcopy(body), "metadata": {**body["metadata"], "resourceVersion": "1"}}
        if not dry_run:
            self.stored[body["metadata"]["name"]] = kept
        return kept

    async def replace(self, name: str, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return await self.create(body, dry_run)

    async def get(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.stored.get(name))

    async def delete(self, name: str) -> None:
        self.stored.pop(name, None)

    async def list(self, node: str, driver: str) -> list[dict[str, Any]]:
        return list(self.stored.values())


@pytest.fixture
def directory() -> Iterator[Path]:
    found = short_dir()
    yield found
    shutil.rmtree(found, ignore_errors=True)


def prepare_request(*claims: tuple[str, str]) -> v1.NodePrepareResourcesRequest:
    return v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=NS, uid=uid, name=name) for name, uid in claims])


def unprepare_request(*claims: tuple[str, str]) -> v1.NodeUnprepareResourcesRequest:
    return v1.NodeUnprepareResourcesRequest(
        claims=[v1.Claim(namespace=NS, uid=uid, name=name) for name, uid in claims])


def devices_of(answer: Any, uid: str) -> list[tuple[str, list[str]]]:
    return [(d.device_name, list(d.cdi_device_ids)) for d in answer.claims[uid].devices]


# --- serialization -------------------------------------------------------------------------------------------


async def test_an_unprepare_while_the_prepare_waits_for_the_api_server_is_not_undone(directory: Path) -> None:
    node = Node(directory)
    node.api.allocate("train", "uid-a", ["gpu-0"])
    node.api.held["train"] = asyncio.Event()
    async with node.serving() as (plugin, stub):
        unprepare = plugin.preparer.unprepare
        arrived = asyncio.Event()

        async def unprepare_arrived(uid: str) -> None:
            arrived.set()  # what follows runs on until it waits for the claim, before the test goes on
            await unprepare(uid)

        plugin.preparer.unprepare = unprepare_arrived  # type: ignore[method-assign]
        preparing = asyncio.ensure_future(stub.NodePrepareResources(prepare_request(("train", "uid-a")), timeout=10))
        await asyncio.wait_for(node.api.asked.wait(), 5)  # the prepare is reading the claim
        # The pod is deleted meanwhile: the kubelet unprepares the claim.
        unpreparing = asyncio.ensure_future(
            stub.NodeUnprepareResources(unprepare_request(("train", "uid-a")), timeout=10))
        await asyncio.wait_for(arrived.wait(), 5)
        assert not unpreparing.done()  # it waits for the prepare
        node.api.held["train"].set()
        prepared, unprepared = await asyncio.gather(preparing, unpreparing)
    assert devices_of(prepared, "uid-a") == [("gpu-0", [f"{KIND}=claim-uid-a-gpu-0", f"{KIND}=claim-uid-a"])]
    assert unprepared.claims["uid-a"].error == ""
    # The unprepare came last: nothing of the claim is left.
    assert node.cdi_files() == []
    assert node.checkpoint()["claims"] == {}
    node.close()


async def test_back_in_device_plugin_mode_a_new_claim_is_refused_and_a_prepared_one_is_still_served(
        directory: Path) -> None:
    node = Node(directory)
    node.api.allocate("train", "uid-a", ["gpu-0"])
    node.api.allocate("late", "uid-b", ["gpu-1"])  # allocated from the slice just before it was withdrawn
    async with node.serving() as (_, stub):
        first = await stub.NodePrepareResources(prepare_request(("train", "uid-a")), timeout=10)
        await node.bus.update(config=parse_config("version: v1\n"))  # switched back to the device plugin
        again = await stub.NodePrepareResources(prepare_request(("train", "uid-a")), timeout=10)
        assert devices_of(again, "uid-a") == devices_of(first, "uid-a")  # the kubelet asking again: the same answer
        late = await stub.NodePrepareResources(prepare_request(("late", "uid-b")), timeout=10)
        assert late.claims["uid-b"].error == (
            f"claim {NS}/late: the node is in device-plugin mode, its GPUs are the device plugin's; a claim allocated "
            "before the switch is not prepared (delete its pod)")
        unprepared = await stub.NodeUnprepareResources(unprepare_request(("train", "uid-a")), timeout=10)
    assert unprepared.claims["uid-a"].error == ""
    assert node.checkpoint()["claims"] == {}
    assert node.cdi_files() == []
    node.close()


# --- devices held by another claim ---------------------------------------------------------------------------


async def test_a_device_prepared_for_one_claim_is_refused_to_another_in_one_line(directory: Path) -> None:
    node = Node(directory)
    node.api.allocate("first", "uid-1", ["gpu-0", "gpu-1"])
    node.api.allocate("second", "uid-2", ["gpu-1", "gpu-2"])
    async with node.serving() as (_, stub):
        assert (await stub.NodePrepareResources(prepare_request(("first", "uid-1")), timeout=10)
                ).claims["uid-1"].error == ""
        refused = await stub.NodePrepareResources(prepare_request(("second", "uid-2")), timeout=10)
        assert refused.claims["uid-2"].error == (
            f"claim {NS}/second: device gpu-1 is already prepared for claim {NS}/first (uid-1); it is given to "
            "one claim at a time")
        assert node.cdi_files() == [f"{DRIVER}-claim-uid-1.json"]
        assert node.claims() == {"uid-1": "PrepareCompleted"}
        # Once the first is unprepared, the second is prepared.
        await stub.NodeUnprepareResources(unprepare_request(("first", "uid-1")), timeout=10)
        again = await stub.NodePrepareResources(prepare_request(("second", "uid-2")), timeout=10)
        assert [d for d, _ in devices_of(again, "uid-2")] == ["gpu-1", "gpu-2"]


async def test_replicas_of_one_gpu_go_to_two_claims_but_not_one_replica_nor_the_whole_gpu_beside_them(
        directory: Path) -> None:
    node = Node(directory, config=SHARED)
    node.api.allocate("a", "uid-a", ["gpu-0-replica-0"])
    node.api.allocate("b", "uid-b", ["gpu-0-replica-1"])
    node.api.allocate("c", "uid-c", ["gpu-0-replica-1"])
    node.api.allocate("d", "uid-d", ["gpu-0-replica-1"], share=True)  # a share of a device (consumable capacity)
    async with node.serving() as (_, stub):
        answer = await stub.NodePrepareResources(prepare_request(("a", "uid-a"), ("b", "uid-b")), timeout=10)
        assert (answer.claims["uid-a"].error, answer.claims["uid-b"].error) == ("", "")
        answer = await stub.NodePrepareResources(prepare_request(("c", "uid-c")), timeout=10)
        assert answer.claims["uid-c"].error == (
            f"claim {NS}/c: device gpu-0-replica-1 is already prepared for claim {NS}/b (uid-b); it is given to one "
            "claim at a time")
        answer = await stub.NodePrepareResources(prepare_request(("d", "uid-d")), timeout=10)
        assert answer.claims["uid-d"].error == ""
        await stub.NodeUnprepareResources(unprepare_request(("a", "uid-a"), ("b", "uid-b"), ("d", "uid-d")),
                                          timeout=10)
        # GPU 0 whole for one claim; then the sharing config changes and a replica of it is allocated.
        node.api.allocate("whole", "uid-w", ["gpu-0"])
        await node.bus.update(config=parse_config(DRA_MODE))
        assert (await stub.NodePrepareResources(prepare_request(("whole", "uid-w")), timeout=10)
                ).claims["uid-w"].error == ""
        await node.bus.update(config=parse_config(DRA_MODE + SHARED))
        answer = await stub.NodePrepareResources(prepare_request(("a", "uid-a")), timeout=10)
        assert answer.claims["uid-a"].error == (
            f"claim {NS}/a: device gpu-0-replica-0 is already prepared for claim {NS}/whole (uid-w) (as gpu-0, the "
            "same GPU); it is given to one claim at a time")
        # And the other way round: a replica prepared, then the sharing config goes and GPU 0 is allocated whole.
        await stub.NodeUnprepareResources(unprepare_request(("whole", "uid-w")), timeout=10)
        assert (await stub.NodePrepareResources(prepare_request(("b", "uid-b")), timeout=10)
                ).claims["uid-b"].error == ""
        await node.bus.update(config=parse_config(DRA_MODE))
        answer = await stub.NodePrepareResources(prepare_request(("whole", "uid-w")), timeout=10)
        assert answer.claims["uid-w"].error == (
            f"claim {NS}/whole: device gpu-0 is already prepared for claim {NS}/b (uid-b) (as gpu-0-replica-1, the "
            "same GPU); it is given to one claim at a time")
    node.close()


async def test_a_claim_that_fails_the_same_way_on_every_retry_is_said_once_and_its_success_once(
        directory: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(directory)
    caplog.set_level(logging.INFO, "agent.dra")
    async with node.serving() as (_, stub):
        node.api.claims[(NS, "late")] = {"metadata": {"namespace": NS, "name": "late", "uid": "uid-l"},
                                         "status": {}}
        for _ in range(3):  # the kubelet's retries
            answer = await stub.NodePrepareResources(prepare_request(("late", "uid-l")), timeout=10)
            assert answer.claims["uid-l"].error == f"claim {NS}/late: not allocated"
        node.api.claims.pop((NS, "late"))
        answer = await stub.NodePrepareResources(prepare_request(("late", "uid-l")), timeout=10)
        assert answer.claims["uid-l"].error == f"claim {NS}/late: not found"
        node.api.allocate("late", "uid-l", ["gpu-2"])
        answer = await stub.NodePrepareResources(prepare_request(("late", "uid-l")), timeout=10)
        assert answer.claims["uid-l"].error == ""
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "agent.dra.plugin"
            and "late" in r.getMessage()] == [
        ("WARNING", f"cannot prepare claim {NS}/late (uid-l): claim {NS}/late: not allocated"),
        ("WARNING", f"cannot prepare claim {NS}/late (uid-l): claim {NS}/late: not found"),
        ("INFO", f"prepared claim {NS}/late (uid-l): gpu-2"),
        ("INFO", f"prepared claim {NS}/late (uid-l) after 4 failed attempt(s)")]
    node.close()


# --- the checkpoint ------------------------------------------------------------------------------------------


def sha256_of(claims: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


async def test_the_checkpoint_says_each_claims_state_and_its_checksum(directory: Path) -> None:
    node = Node(directory)
    node.api.allocate("train", "uid-a", ["gpu-1"])
    async with node.serving() as (_, stub):
        await stub.NodePrepareResources(prepare_request(("train", "uid-a")), timeout=10)
    claims = {"uid-a": {"namespace": NS, "name": "train", "state": "PrepareCompleted", "mig": {}, "devices": [
        {"requests": ["gpus"], "pool": NODE, "device": "gpu-1", "cdi": [f"{KIND}=claim-uid-a-gpu-1",
                                                                         f"{KIND}=claim-uid-a"]}]}}
    assert node.checkpoint() == {"version": 2, "checksum": sha256_of(claims), "claims": claims}
    node.close()


async def test_a_checksum_that_does_not_match_keeps_the_checkpoint_aside_and_removes_nothing(
        directory: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(directory)
    node.api.allocate("train", "uid-a", ["gpu-1"])
    async with node.serving() as (_, stub):
        await stub.NodePrepareResources(prepare_request(("train", "uid-a")), timeout=10)
    damaged = node.paths.checkpoint.read_text().replace('"gpu-1"', '"gpu-2"')  # a bit flipped on disk
    node.paths.checkpoint.write_text(damaged)
    caplog.clear()
    caplog.set_level(logging.INFO, "agent.dra")
    async with node.serving() as (_, stub):
        kept = node.paths.checkpoint.with_name("checkpoint.json.corrupt")
        assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "agent.dra.plugin"][:2] == [
            ("ERROR", f"the DRA checkpoint {node.paths.checkpoint} is damaged: its checksum does not match its "
                      f"claims: kept as {kept}; starting with no prepared claims, and removing no CDI spec or MIG "
                      "device at start while that file is there (which claims own them is unknown)"),
            ("WARNING", f"removing no CDI spec or MIG device that no claim owns: a damaged checkpoint is kept "
                        f"beside {kept.parent} (remove the .corrupt file once the node's claims are unprepared)")]
        assert kept.read_text() == damaged
        # The claim's spec stays for its running pod; the kubelet's unprepare removes it.
        assert node.cdi_files() == [f"{DRIVER}-claim-uid-a.json"]
        assert (await stub.NodeUnprepareResources(unprepare_request(("train", "uid-a")), timeout=10)
                ).claims["uid-a"].error == ""
        assert node.cdi_files() == []
    node.close()


async def test_a_version_1_checkpoint_and_dynamic_mig_file_are_migrated(
        directory: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(directory, preset="dgx-h100", dynamic_mig=True)
    carve_mig(node.fake, 0, [("3g.40gb", 4)])  # made by the older agent for claim uid-a
    folder = node.paths.checkpoint.parent
    folder.mkdir(parents=True)
    device = {"requests": ["mig"], "pool": NODE, "device": "gpu-0-mig-3g40gb-4",
              "cdi": [f"{KIND}=claim-uid-a-gpu-0-mig-3g40gb-4", f"{KIND}=claim-uid-a"]}
    node.paths.checkpoint.write_text(json.dumps({"version": 1, "claims": {
        "uid-a": {"namespace": NS, "name": "train", "devices": [device]}}}))
    record = {"gpu": 0, "minor": 0, "profile": "3g.40gb", "start": 4, "uuid": "MIG-x", "gi": 1, "ci": 0}
    (folder / "dynamic-mig.json").write_text(json.dumps({"version": 1, "devices": {
        "uid-a/gpu-0-mig-3g40gb-4": record}}))
    (directory / "cdi").mkdir()
    node.spec("uid-a").write_text("{}")
    caplog.set_level(logging.INFO, "agent.dra")
    async with node.serving():
        await node.publish()
    assert [r.getMessage() for r in caplog.records if r.name == "agent.dra.plugin"][:2] == [
        f"migrated the DRA checkpoint {node.paths.checkpoint} from version 1 to 2 (1 claim(s))",
        f"folded {folder / 'dynamic-mig.json'} into the DRA checkpoint {node.paths.checkpoint} (1 MIG device "
        "record(s))"]
    claims = {"uid-a": {"namespace": NS, "name": "train", "state": "PrepareCompleted", "devices": [device],
                        "mig": {"gpu-0-mig-3g40gb-4": record}}}
    assert node.checkpoint() == {"version": 2, "checksum": sha256_of(claims), "claims": claims}
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.json"]
    # The claim, its spec and its MIG device are all kept.
    assert node.cdi_files() == [f"{DRIVER}-claim-uid-a.json"]
    assert gpu_instances(node.fake, 0) == [(4, 4, 1)]
    node.close()


# --- what a start finds --------------------------------------------------------------------------------------


async def test_a_start_removes_the_cdi_specs_and_mig_devices_no_claim_owns(
        directory: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(directory, preset="dgx-h100", dynamic_mig=True)
    node.api.allocate("kept", "uid-k", ["gpu-0-mig-3g40gb-0"])
    async with node.serving() as (_, stub):
        await node.publish()
        assert (await stub.NodePrepareResources(prepare_request(("kept", "uid-k")), timeout=10)
                ).claims["uid-k"].error == ""
    # Left by crashes and by hand: a spec and a MIG device of no claim, a write cut short, another driver's spec.
    cdi = directory / "cdi"
    (cdi / f"{DRIVER}-claim-uid-gone.json").write_text("{}")
    (cdi / f".{DRIVER}-claim-uid-k.json.x1y2").write_text("{")
    (cdi / "other.example.com-claim-uid-x.json").write_text("{}")
    carve_mig(node.fake, 0, [("1g.10gb", 6)])
    caplog.set_level(logging.INFO, "agent.dra")
    async with node.serving():
        await node.publish()
    assert [r.getMessage() for r in caplog.records if "no prepared claim owns it" in r.getMessage()] == [
        f"removed CDI spec {cdi}/.{DRIVER}-claim-uid-k.json.x1y2: no prepared claim owns it",
        f"removed CDI spec {cdi}/{DRIVER}-claim-uid-gone.json: no prepared claim owns it",
        "destroyed MIG device 1g.10gb at memory slice 6 of GPU 0: no prepared claim owns it"]
    assert node.cdi_files() == [f"{DRIVER}-claim-uid-k.json", "other.example.com-claim-uid-x.json"]
    assert gpu_instances(node.fake, 0) == [(0, 4, 1)]
    assert node.claims() == {"uid-k": "PrepareCompleted"}
    node.close()


class Crash(BaseException):
    """The agent killed at this point."""


def crash_after(monkeypatch: pytest.MonkeyPatch, node: Node, n: int | None) -> list[str]:
    """Count every change a prepare or unprepare makes to the node (a file written or removed, an NVML call
    that changes the GPU) and end the agent right after the n-th; returns the steps as they were made."""
    steps: list[str] = []

    def step(what: str) -> None:
        steps.append(what)
        if n is not None and len(steps) == n:
            raise Crash(what)

    write = dra_claims.write_atomically

    def counted_write(path: Path, text: str) -> None:
        write(path, text)
        step(f"write {path.name}")

    monkeypatch.setattr(dra_claims, "write_atomically", counted_write)
    count = node.fake._count_change

    def counted_change() -> None:
        count()
        step("nvml")

    monkeypatch.setattr(node.fake, "_count_change", counted_change)
    unlink = Path.unlink

    def counted_unlink(path: Path, missing_ok: bool = False) -> None:
        unlink(path, missing_ok)
        if path.parent == node.directory / "cdi":
            step(f"remove {path.name}")

    monkeypatch.setattr(Path, "unlink", counted_unlink)
    return steps


PREPARE_STEPS = {
    False: ["write checkpoint.json", f"write {DRIVER}-claim-uid-c.json", "write checkpoint.json"],
    True: ["write checkpoint.json", "write checkpoint.json", "nvml", "nvml", "write checkpoint.json",
           f"write {DRIVER}-claim-uid-c.json", "write checkpoint.json"],
}
"""What a prepare changes, in order: the claim recorded PrepareStarted; with dynamic MIG, its placement
recorded, the GPU and compute instance made, their ids recorded; the CDI spec; the claim PrepareCompleted."""
UNPREPARE_STEPS = {
    False: ["write checkpoint.json", f"remove {DRIVER}-claim-uid-c.json"],
    True: ["nvml", "nvml", "write checkpoint.json", "write checkpoint.json", f"remove {DRIVER}-claim-uid-c.json"],
}
"""What an unprepare changes, in order: with dynamic MIG, the compute and GPU instance destroyed and their
record dropped; the claim forgotten; its CDI spec removed."""


@pytest.mark.parametrize("dynamic_mig", [False, True], ids=["whole-gpu", "dynamic-mig"])
@pytest.mark.parametrize("unprepare", [False, True], ids=["prepare", "unprepare"])
async def test_a_crash_at_each_step_converges_after_a_restart_and_the_kubelets_retry(
        directory: Path, monkeypatch: pytest.MonkeyPatch, dynamic_mig: bool, unprepare: bool) -> None:
    expected = (UNPREPARE_STEPS if unprepare else PREPARE_STEPS)[dynamic_mig]
    for n in range(1, len(expected) + 1):
        work = directory / str(n)
        node = Node(work, preset="dgx-h100", dynamic_mig=dynamic_mig)
        device = "gpu-0-mig-3g40gb-4" if dynamic_mig else "gpu-3"
        node.api.allocate("c", "uid-c", [device])
        async with node.serving() as (plugin, stub):
            if dynamic_mig:
                await node.publish()
            if unprepare:
                assert (await stub.NodePrepareResources(prepare_request(("c", "uid-c")), timeout=10)
                        ).claims["uid-c"].error == ""
            with monkeypatch.context() as patched:
                steps = crash_after(patched, node, n)
                with pytest.raises(Crash):
                    await (plugin.unprepare("uid-c") if unprepare else plugin.prepare(NS, "uid-c", "c"))
                assert steps == expected[:n]
        # The agent starts again; then the kubelet, which got no answer, calls again.
        async with node.serving() as (plugin, stub):
            if dynamic_mig:
                await node.publish()
            done = n == len(expected)
            if unprepare:  # the claim is there until the checkpoint forgets it
                forgotten = n >= len(expected) - 1
                assert node.claims() == ({} if forgotten else {"uid-c": "PrepareCompleted"}), n
                assert node.cdi_files() == ([] if forgotten else [f"{DRIVER}-claim-uid-c.json"]), n
                answer = await stub.NodeUnprepareResources(unprepare_request(("c", "uid-c")), timeout=10)
            else:  # rolled back at start unless it completed
                assert node.claims() == ({"uid-c": "PrepareCompleted"} if done else {}), n
                assert node.cdi_files() == ([f"{DRIVER}-claim-uid-c.json"] if done else []), n
                if dynamic_mig:
                    assert gpu_instances(node.fake, 0) == ([(4, 4, 1)] if done else []), n
                answer = await stub.NodePrepareResources(prepare_request(("c", "uid-c")), timeout=10)
            assert answer.claims["uid-c"].error == "", n
            if unprepare:
                assert (node.claims(), node.cdi_files()) == ({}, []), n
                if dynamic_mig:
                    assert gpu_instances(node.fake, 0) == [], n
            else:
                assert devices_of(answer, "uid-c") == [
                    (device, [f"{KIND}=claim-uid-c-{device}", f"{KIND}=claim-uid-c"])], n
                assert node.claims() == {"uid-c": "PrepareCompleted"}, n
                if dynamic_mig:
                    assert gpu_instances(node.fake, 0) == [(4, 4, 1)], n
                # And the claim's end leaves nothing.
                await stub.NodeUnprepareResources(unprepare_request(("c", "uid-c")), timeout=10)
                assert (node.claims(), node.cdi_files()) == ({}, []), n
                if dynamic_mig:
                    assert gpu_instances(node.fake, 0) == [], n
        node.close()
