"""Dynamic MIG in DRA mode (dra.dynamicMig): the slice shape for Kubernetes 1.34 and 1.35, its counters against
the H100 placement table (docs/reference/mig-profiles.md), creating and destroying MIG devices on the fake NVML,
the publisher's dry run, and the MIG manager's refusal of the label."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agent.config import parse_config
from agent.dra.claims import ClaimStore, Paths
from agent.dra.dynamic import (
    DynamicMig,
    DynamicMigError,
    DynamicSlicePublisher,
    dynamic_slices,
    server_version,
    splits_counters,
)
from agent.mig.controller import MigController
from agent.nvml.backend import NvmlBackend, fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.state import NodeState, StateBus
from tests.plugin_harness import carve_mig, gpu_instances

DRIVER = "gpu.gpu-node-agent.io"
MAIN = f"n-{DRIVER}"

# The H100 80GB placement table (docs/reference/mig-profiles.md): profile -> (starts, size in memory slices).
H100 = {
    "1g.10gb": ((0, 1, 2, 3, 4, 5, 6), 1),
    "1g.10gb+me": ((0, 1, 2, 3, 4, 5, 6), 1),
    "1g.20gb": ((0, 2, 4, 6), 2),
    "2g.20gb": ((0, 2, 4), 2),
    "3g.40gb": ((0, 4), 4),
    "4g.40gb": ((0,), 4),
    "7g.80gb": ((0,), 8),
}
TOKENS = {"1g.10gb": "1g10gb", "1g.10gb+me": "1g10gbme", "1g.20gb": "1g20gb", "2g.20gb": "2g20gb",
          "3g.40gb": "3g40gb", "4g.40gb": "4g40gb", "7g.80gb": "7g80gb"}


def store(root: Path) -> ClaimStore:
    """The DRA checkpoint of a node whose kubelet directory is `root`."""
    return ClaimStore(Paths.under(root, DRIVER, root / "cdi"), DRIVER)


def checkpoint(root: Path) -> dict[str, Any]:
    """The DRA checkpoint as a user reads it."""
    found: dict[str, Any] = json.loads((root / "plugins" / DRIVER / "checkpoint.json").read_text())
    return found


def mig_node(preset: str = "dgx-h100", mig: dict[int, list[tuple[str, int]]] | None = None
             ) -> tuple[NodeState, FakeNvml, NvmlBackend]:
    fake = FakeNvml(load_node(preset))
    for gpu, instances in (mig or {0: []}).items():
        carve_mig(fake, gpu, instances)
    backend = fake_backend(fake)
    backend.init()
    config = parse_config("version: v1\ndra: {enabled: true, dynamicMig: true}\n")
    return NodeState(version=1, inventory=backend.inventory(), config=config), fake, backend


def devices_of(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in spec.get("devices") or []}


def consumed(device: dict[str, Any]) -> dict[str, str]:
    ((entry),) = device["consumesCounters"]
    assert entry["counterSet"] == "gpu-0-counter-set"
    return {k: v["value"] for k, v in entry["counters"].items()}


def test_server_versions_choose_the_shape() -> None:
    assert server_version("v1.34.4") == (1, 34)
    assert server_version("v1.35.0-gke.1200") == (1, 35)
    assert [splits_counters(v) for v in ("v1.34.4", "v1.34.4+k3s1", "v1.35.0", "v1.36.2", "v2.0.0")] == [
        False, False, True, True, True]


def test_134_each_mig_gpu_has_a_slice_with_its_counters_and_every_placement() -> None:
    state, _, _ = mig_node()
    slices = dynamic_slices(state, "n", DRIVER, 4, split=False)
    assert [name for name, _ in slices] == [MAIN, f"{MAIN}-gpu-0"]
    main, gpu0 = (spec for _, spec in slices)
    assert list(devices_of(main)) == [f"gpu-{i}" for i in range(1, 8)]  # GPU 0 is in MIG mode: not whole
    assert "sharedCounters" not in main
    for spec in (main, gpu0):
        assert spec["driver"] == DRIVER and spec["nodeName"] == "n"
        assert spec["pool"] == {"name": "n", "generation": 4, "resourceSliceCount": 2}
    slices_counters = {f"memory-slice-{n}": {"value": "1"} for n in range(8)}
    # 1g.10gb+me: seven placements, one instance per GPU.
    assert gpu0["sharedCounters"] == [{"name": "gpu-0-counter-set", "counters": {
        **slices_counters, "instances-1g10gbme": {"value": "1"}}}]
    expected = sorted(f"gpu-0-mig-{TOKENS[p]}-{s}" for p, (starts, _) in H100.items() for s in starts)
    assert sorted(devices_of(gpu0)) == expected and len(expected) == 25
    for profile, (starts, size) in H100.items():
        for start in starts:
            device = devices_of(gpu0)[f"gpu-0-mig-{TOKENS[profile]}-{start}"]
            wanted = {f"memory-slice-{n}": "1" for n in range(start, start + size)}
            if profile == "1g.10gb+me":
                wanted["instances-1g10gbme"] = "1"
            assert consumed(device) == wanted, device["name"]
            attributes = device["attributes"]
            assert attributes["type"] == {"string": "mig"} and attributes["profile"] == {"string": profile}
            assert attributes["placementStart"] == {"int": start} and attributes["placementSize"] == {"int": size}
            assert attributes["parentIndex"] == {"int": 0}
            assert attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
            assert attributes["nvlinkDomain"] == {"int": 0}  # its parent's topology
    three = devices_of(gpu0)["gpu-0-mig-3g40gb-4"]["capacity"]
    assert three["memory"] == {"value": "40448Mi"} and three["multiprocessors"] == {"value": "60"}


def test_the_counters_keep_overlapping_placements_apart_and_only_those() -> None:
    state, _, _ = mig_node()
    ((_, _), (_, gpu0)) = dynamic_slices(state, "n", DRIVER, 1, split=False)
    names = sorted(devices_of(gpu0))
    spans = {f"gpu-0-mig-{TOKENS[p]}-{s}": set(range(s, s + size)) for p, (starts, size) in H100.items()
             for s in starts}
    for a in names:
        for b in names:
            shared = {k for k in consumed(devices_of(gpu0)[a]) if k.startswith("memory")} & set(
                consumed(devices_of(gpu0)[b]))
            assert bool(shared) == bool(spans[a] & spans[b]), (a, b)
    # Two 3g.40gb fill the GPU; a 4g.40gb then has no memory slice left.
    assert spans["gpu-0-mig-3g40gb-0"] | spans["gpu-0-mig-3g40gb-4"] == set(range(8))


def test_135_counters_go_into_a_slice_of_their_own() -> None:
    state, _, _ = mig_node(mig={0: [], 3: []})
    slices = dynamic_slices(state, "n", DRIVER, 2, split=True)
    assert [name for name, _ in slices] == [MAIN, f"{MAIN}-counters", f"{MAIN}-gpu-0", f"{MAIN}-gpu-3"]
    main, counters, gpu0, gpu3 = (spec for _, spec in slices)
    assert list(devices_of(main)) == ["gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    assert "devices" not in counters
    assert [s["name"] for s in counters["sharedCounters"]] == ["gpu-0-counter-set", "gpu-3-counter-set"]
    for spec in (gpu0, gpu3):
        assert "sharedCounters" not in spec and len(spec["devices"]) == 25
    assert devices_of(gpu3)["gpu-3-mig-7g80gb-0"]["consumesCounters"][0]["counterSet"] == "gpu-3-counter-set"
    for spec in (main, counters, gpu0, gpu3):
        assert spec["nodeName"] == "n" and spec["pool"] == {"name": "n", "generation": 2, "resourceSliceCount": 4}


def test_a_mig_device_made_for_a_claim_is_not_published_twice() -> None:
    state, _, _ = mig_node(mig={0: [("3g.40gb", 4)]})
    slices = dynamic_slices(state, "n", DRIVER, 1, split=False)
    main = slices[0][1]
    # The MIG device that exists (made for a claim) is not published by its ids as well.
    assert list(devices_of(main)) == [f"gpu-{i}" for i in range(1, 8)]
    assert "gpu-0-mig-3g40gb-4" in devices_of(slices[1][1])




@pytest.fixture
def nvml_thread() -> Any:
    pool = ThreadPoolExecutor(1)

    async def call(fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    yield call
    pool.shutdown()


async def test_create_and_destroy_a_placement_and_survive_a_restart_between(tmp_path: Path, nvml_thread: Any) -> None:
    state, fake, backend = mig_node()
    dynamic = DynamicMig(backend, nvml_thread, store(tmp_path))
    await dynamic.load_profiles(state)
    dynamic.active = True
    found = dynamic.devices(state)
    assert len(found) == 25
    made = await dynamic.create("uid-1", found["gpu-0-mig-3g40gb-4"])
    assert gpu_instances(fake, 0) == [(4, 4, 1)]
    assert made.uuid.startswith("MIG-") and made.gpu_index == 0 and made.gpu_minor == 0
    assert await dynamic.create("uid-1", found["gpu-0-mig-3g40gb-4"]) == made  # idempotent
    assert gpu_instances(fake, 0) == [(4, 4, 1)]

    again = DynamicMig(backend, nvml_thread, store(tmp_path))  # the agent restarted
    assert again.made["uid-1/gpu-0-mig-3g40gb-4"]["uuid"] == made.uuid
    assert await again.release("uid-1") == ["gpu-0-mig-3g40gb-4"]
    assert gpu_instances(fake, 0) == []
    assert await again.release("uid-1") == []  # idempotent
    assert DynamicMig(backend, nvml_thread, store(tmp_path)).made == {}


async def test_a_placement_taken_outside_the_agent_fails_with_one_line(tmp_path: Path, nvml_thread: Any) -> None:
    state, fake, backend = mig_node(mig={0: [("4g.40gb", 0)]})  # made by an operator with nvidia-smi
    dynamic = DynamicMig(backend, nvml_thread, store(tmp_path))
    await dynamic.load_profiles(state)
    dynamic.active = True
    with pytest.raises(DynamicMigError) as err:
        await dynamic.create("uid-2", dynamic.devices(state)["gpu-0-mig-3g40gb-0"])
    said = str(err.value)  # NVML's own text for NVML_ERROR_INSUFFICIENT_RESOURCES in the middle
    assert said.startswith("cannot create MIG device 3g.40gb at memory slice 0 of GPU 0: ")
    assert said.endswith(" (is the placement taken by a GPU instance made outside the agent?)")
    assert "\n" not in said
    assert gpu_instances(fake, 0) == [(0, 4, 1)]
    assert dynamic.made == {}


class Slices:
    """ResourceSlices kept in memory, dropping the counters unless `keeps`, as the API server does with the
    DRAPartitionableDevices gate off; records each write as (verb, name, dry run)."""

    def __init__(self, keeps: bool, git_version: str = "v1.34.4") -> None:
        self.keeps = keeps
        self.git_version = git_version
        self.stored: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str, bool]] = []
        self._rv = 0

    async def version(self) -> dict[str, Any]:
        return {"gitVersion": self.git_version}

    def _keep(self, body: dict[str, Any], dry_run: bool, verb: str) -> dict[str, Any]:
        kept = copy.deepcopy(body)
        if not self.keeps:
            kept["spec"].pop("sharedCounters", None)
            for device in kept["spec"].get("devices") or []:
                device.pop("consumesCounters", None)
        name = kept["metadata"]["name"]
        self.writes.append((verb, name, dry_run))
        if not dry_run:
            self._rv += 1
            kept["metadata"] = {**kept["metadata"], "resourceVersion": str(self._rv)}
            self.stored[name] = kept
        return kept

    async def get(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.stored.get(name))

    async def create(self, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self._keep(body, dry_run, "create")

    async def replace(self, name: str, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self._keep(body, dry_run, "replace")

    async def delete(self, name: str) -> None:
        self.writes.append(("delete", name, False))
        self.stored.pop(name, None)

    async def list(self, node: str, driver: str) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.stored.values()))


async def test_the_publisher_writes_the_pool_where_counters_are_kept(tmp_path: Path, nvml_thread: Any) -> None:
    state, _, backend = mig_node()
    api = Slices(keeps=True)
    dynamic = DynamicMig(backend, nvml_thread, store(tmp_path))
    publisher = DynamicSlicePublisher(api, StateBus(state), "n", DRIVER, dynamic)
    assert await publisher.sync(state)
    assert dynamic.active
    assert api.writes == [("create", f"{MAIN}-gpu-0", True), ("create", MAIN, False),
                          ("create", f"{MAIN}-gpu-0", False)]
    assert {n: s["spec"]["pool"]["generation"] for n, s in api.stored.items()} == {MAIN: 1, f"{MAIN}-gpu-0": 1}
    assert not await publisher.sync(state)  # unchanged: nothing written
    assert len(api.writes) == 3


async def test_without_the_gate_the_publisher_says_so_once_and_publishes_the_layout(
        tmp_path: Path, nvml_thread: Any, caplog: pytest.LogCaptureFixture) -> None:
    state, _, backend = mig_node(mig={0: [("3g.40gb", 4)]})
    api = Slices(keeps=False)
    dynamic = DynamicMig(backend, nvml_thread, store(tmp_path))
    publisher = DynamicSlicePublisher(api, StateBus(state), "n", DRIVER, dynamic)
    with caplog.at_level(logging.WARNING, logger="agent.dra.dynamic"):
        assert await publisher.sync(state)
    assert not dynamic.active
    assert [r.getMessage() for r in caplog.records if r.name == "agent.dra.dynamic"] == [
        f"the API server drops the shared counters of ResourceSlice {MAIN}-gpu-0 (the DRAPartitionableDevices "
        "feature gate is off): dra.dynamicMig is off until the agent restarts; MIG devices are published as the "
        "GPUs' layout has them"]
    assert list(api.stored) == [MAIN]
    mig = state.inventory.mig_devices[0]
    assert [d["name"] for d in api.stored[MAIN]["spec"]["devices"]] == [
        *(f"gpu-{i}" for i in range(1, 8)), f"gpu-0-mig-{mig.gpu_instance_id}-{mig.compute_instance_id}"]


async def test_the_mig_manager_refuses_the_label_with_dynamic_mig(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.mig.controller")
    state, fake, backend = mig_node()
    config = parse_config(f"version: v1\ndra: {{enabled: true, dynamicMig: true}}\nmig: {{stateDir: {tmp_path}}}\n")
    bus = StateBus(NodeState(version=1, inventory=state.inventory, config=config))

    async def nvml(fn: Any, **_: Any) -> Any:
        return fn()

    controller = MigController(backend, bus, nvml)
    task = asyncio.create_task(controller.run())
    try:
        await bus.update(mig_request="all-1g.10gb")
        while bus.current.mig_status is None:
            await bus.wait_newer(bus.current.version)
        status = bus.current.mig_status
        assert (status.layout, status.state, status.reason) == (
            "all-1g.10gb", "failed", "not applied: dra.dynamicMig is on, so DRA claims create and destroy this "
            "node's MIG devices; remove the nvidia.com/mig.config label or turn dra.dynamicMig off")
        assert gpu_instances(fake, 0) == []  # nothing changed
        said = [r.getMessage() for r in caplog.records if r.name == "agent.mig.controller"]
        assert said[0] == "dra.dynamicMig is on: the MIG manager applies no nvidia.com/mig.config label on this node"
        assert said[1:] == [f"MIG layout all-1g.10gb: {status.reason}"]
    finally:
        task.cancel()


def test_with_dynamic_mig_the_device_plugin_leaves_mig_devices_to_dra() -> None:
    from agent.dra.slices import plugin_resources
    from agent.inventory import plan

    state, _, _ = mig_node(mig={0: [("3g.40gb", 4)]})  # a MIG device made for a claim
    config = parse_config("version: v1\nflags: {migStrategy: mixed}\ndra: {enabled: true, dynamicMig: true}\n")
    resources = plan(NodeState(version=1, inventory=state.inventory, config=config)).resources
    assert sorted(resources) == ["nvidia.com/gpu", "nvidia.com/mig-3g.40gb"]
    assert plugin_resources(resources, dra=True) == {"nvidia.com/mig-3g.40gb"}
    assert plugin_resources(resources, dra=True, dynamic_mig=True) == set()
    assert plugin_resources(resources, dra=False, dynamic_mig=True) == {"nvidia.com/gpu", "nvidia.com/mig-3g.40gb"}


async def test_a_create_cut_short_by_a_restart_takes_the_instance_it_made(tmp_path: Path, nvml_thread: Any) -> None:
    state, fake, backend = mig_node(mig={0: [("2g.20gb", 2)]})  # created; the agent stopped before recording it
    # Written by an agent of checkpoint version 1, which kept the MIG devices in a file of their own.
    file = tmp_path / "plugins" / DRIVER / "dynamic-mig.json"
    file.parent.mkdir(parents=True)
    file.write_text(json.dumps({"version": 1, "devices": {
        "uid-3/gpu-0-mig-2g20gb-2": {"gpu": 0, "minor": 0, "profile": "2g.20gb", "start": 2}}}))
    dynamic = DynamicMig(backend, nvml_thread, store(tmp_path))
    assert not file.exists()  # folded into the checkpoint
    await dynamic.load_profiles(state)
    dynamic.active = True
    made = await dynamic.create("uid-3", dynamic.devices(state)["gpu-0-mig-2g20gb-2"])
    assert gpu_instances(fake, 0) == [(2, 2, 1)]  # no second instance
    assert made.uuid == state.inventory.mig_devices[0].uuid
    assert checkpoint(tmp_path)["claims"]["uid-3"]["mig"]["gpu-0-mig-2g20gb-2"]["uuid"] == made.uuid


async def test_a_135_server_gets_the_counters_slice_first(tmp_path: Path, nvml_thread: Any) -> None:
    state, _, backend = mig_node()
    api = Slices(keeps=True, git_version="v1.35.1")
    publisher = DynamicSlicePublisher(api, StateBus(state), "n", DRIVER, DynamicMig(backend, nvml_thread,
                                                                                    store(tmp_path)))
    assert await publisher.sync(state)
    assert api.writes == [("create", f"{MAIN}-counters", True), ("create", MAIN, False),
                          ("create", f"{MAIN}-counters", False), ("create", f"{MAIN}-gpu-0", False)]
    assert "devices" not in api.stored[f"{MAIN}-counters"]["spec"]
    assert "sharedCounters" not in api.stored[f"{MAIN}-gpu-0"]["spec"]


async def test_a_135_pool_is_taken_as_written_once_its_counters_slice_exists(tmp_path: Path,
                                                                         nvml_thread: Any) -> None:
    """The counters slice has no devices: a later sync, and a restarted agent's first, take the pool as written."""
    state, _, backend = mig_node()
    api = Slices(keeps=True, git_version="v1.35.1")
    publisher = DynamicSlicePublisher(api, StateBus(state), "n", DRIVER, DynamicMig(backend, nvml_thread,
                                                                                    store(tmp_path)))
    assert await publisher.sync(state)
    assert not await publisher.sync(state)  # unchanged: nothing written
    restarted = DynamicSlicePublisher(api, StateBus(state), "n", DRIVER, DynamicMig(backend, nvml_thread,
                                                                                    store(tmp_path)))
    assert not await restarted.sync(state)  # the pool as the agent left it: taken with no write
    assert api.writes[4:] == [("replace", f"{MAIN}-counters", True)]  # the restarted agent's dry run only
    assert {n: s["spec"]["pool"]["generation"] for n, s in api.stored.items()} == {
        MAIN: 1, f"{MAIN}-counters": 1, f"{MAIN}-gpu-0": 1}


async def test_the_dynamic_publisher_is_built_on_the_agents_node_client(tmp_path: Path, nvml_thread: Any) -> None:
    import functools

    from agent.dra.publisher import SliceApi, slice_api
    from agent.kube.node import Credentials, NodeApi

    state, _, backend = mig_node()
    dynamic = DynamicMig(backend, nvml_thread, store(tmp_path))
    kube = NodeApi(Credentials("https://127.0.0.1:6443", False, token="t"), "n")
    errors: list[int] = []
    modes: list[str] = []
    shared = slice_api(kube)
    assert shared is not None
    client, node = shared
    publisher = functools.partial(DynamicSlicePublisher, dynamic=dynamic)(
        client, StateBus(state), node, DRIVER, on_error=lambda: errors.append(1), on_health_mode=modes.append)
    assert isinstance(publisher, DynamicSlicePublisher)
    assert (publisher.node, publisher.driver, publisher.name, publisher.dynamic) == ("n", DRIVER, MAIN, dynamic)
    assert isinstance(publisher._api, SliceApi) and publisher._api.api is kube.api  # one client, one rate limit
    publisher._on_error()
    publisher._on_health_mode("taints")
    assert (errors, modes) == ([1], ["taints"])
    await publisher.close()

    # The MIG devices made for a claim are in the DRA checkpoint, with the claim.
    api = Slices(keeps=True)
    assert await DynamicSlicePublisher(api, StateBus(state), "n", DRIVER, dynamic).sync(state)
    assert sorted(api.stored) == [MAIN, f"{MAIN}-gpu-0"]
    await dynamic.create("u", dynamic.devices(state)["gpu-0-mig-7g80gb-0"])
    assert checkpoint(tmp_path)["claims"]["u"]["mig"]["gpu-0-mig-7g80gb-0"]["profile"] == "7g.80gb"


def test_rtx_pro_6000_counts_its_twelve_placement_units_and_keeps_every_profile_apart() -> None:
    # The RTX PRO 6000 Blackwell places MIG instances on 12 units (`nvidia-smi mig -lgipp`: {0,3,6,9}:3 for the
    # five 1g profiles, {0,6}:6 for the four 2g ones, {0}:12 for 4g.96gb and 4g.96gb+gfx).
    state, _, _ = mig_node("pcie-rtx-pro-6000-8")
    ((_, _), (_, gpu0)) = dynamic_slices(state, "n", DRIVER, 1, split=False)
    ((counter_set),) = gpu0["sharedCounters"]
    assert {k: v["value"] for k, v in counter_set["counters"].items()} == {
        **{f"memory-slice-{n}": "1" for n in range(12)},
        # One instance per GPU of +me and of each +me.all, whatever their placements.
        "instances-1g24gbme": "1", "instances-1g24gbmeall": "1", "instances-2g48gbmeall": "1",
    }
    tokens = {"1g24gb": (0, 3, 6, 9), "1g24gbme": (0, 3, 6, 9), "1g24gbgfx": (0, 3, 6, 9),
              "1g24gbmeall": (0, 3, 6, 9), "1g24gbnome": (0, 3, 6, 9), "2g48gb": (0, 6), "2g48gbgfx": (0, 6),
              "2g48gbmeall": (0, 6), "2g48gbnome": (0, 6), "4g96gb": (0,), "4g96gbgfx": (0,)}
    assert sorted(devices_of(gpu0)) == sorted(f"gpu-0-mig-{t}-{s}" for t, starts in tokens.items() for s in starts)
    without_media = devices_of(gpu0)["gpu-0-mig-1g24gbnome-9"]
    assert without_media["attributes"]["profile"] == {"string": "1g.24gb-me"}
    assert consumed(without_media) == {f"memory-slice-{n}": "1" for n in (9, 10, 11)}
    assert without_media["capacity"]["decoders"] == {"value": "0"}
    half = devices_of(gpu0)["gpu-0-mig-2g48gbmeall-6"]
    assert consumed(half) == {**{f"memory-slice-{n}": "1" for n in range(6, 12)}, "instances-2g48gbmeall": "1"}
    assert half["capacity"]["memory"] == {"value": "48512Mi"} and half["capacity"]["decoders"] == {"value": "4"}


def test_a_node_of_sixteen_mig_gpus_has_its_counter_sets_in_slices_of_eight() -> None:
    fake = FakeNvml(load_node("hgx-16-nvswitch"))
    for gpu in range(16):
        carve_mig(fake, gpu, [])
    backend = fake_backend(fake)
    backend.init()
    config = parse_config("version: v1\ndra: {enabled: true, dynamicMig: true}\n")
    state = NodeState(version=1, inventory=backend.inventory(), config=config)
    found = dynamic_slices(state, "n", DRIVER, 1, split=True)
    names = [name for name, _ in found]
    assert names == [MAIN, f"{MAIN}-counters", f"{MAIN}-counters-1", *(f"{MAIN}-gpu-{i}" for i in range(16))]
    sets = {name: [c["name"] for c in spec["sharedCounters"]] for name, spec in found if "counters" in name}
    assert sets == {f"{MAIN}-counters": [f"gpu-{i}-counter-set" for i in range(8)],
                    f"{MAIN}-counters-1": [f"gpu-{i}-counter-set" for i in range(8, 16)]}
    assert {spec["pool"]["resourceSliceCount"] for _, spec in found} == {19}
    assert max(len(spec.get("devices") or []) for _, spec in found) <= 64
