"""The ResourceSlice the agent publishes in DRA mode, computed from the fake NVML's presets."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import stat
from pathlib import Path

import pytest

from agent.config import ConfigError, parse_config
from agent.dra.cdi import claim_spec
from agent.dra.opaque import ConfigProblem, device_env
from agent.dra.slices import plugin_resources, semver, slice_name, slice_spec
from agent.inventory import plan
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.nvml.sysfs import sysfs_pcie_root
from agent.state import DeviceHealth, NodeState, StateBus
from tests.plugin_harness import carve_mig

DRIVER = "gpu.gpu-node-agent.io"
LOOSE = str(Path(__file__).resolve().parents[1] / "fixtures" / "dra" / "one-pair-two-loose.yaml")


def node(preset: str, mig: dict[int, list[tuple[str, int]]] | None = None) -> NodeState:
    fake = FakeNvml(load_node(preset))
    for gpu, instances in (mig or {}).items():
        carve_mig(fake, gpu, instances)
    backend = fake_backend(fake)
    backend.init()
    return NodeState(version=1, inventory=backend.inventory())


def by_name(spec: dict[str, object]) -> dict[str, dict[str, object]]:
    return {d["name"]: d for d in spec["devices"]}  # type: ignore[attr-defined, index]


def attrs(spec: dict[str, object], attribute: str) -> dict[str, object]:
    return {name: d["attributes"].get(attribute) for name, d in by_name(spec).items()}  # type: ignore[attr-defined]


def test_dgx_h100_gpu_device_carries_nvidias_attributes_and_the_nvswitch_domain() -> None:
    spec = slice_spec(node("dgx-h100"), "gpu-node-1", DRIVER, 3)
    assert spec["driver"] == DRIVER and spec["nodeName"] == "gpu-node-1"
    assert spec["pool"] == {"name": "gpu-node-1", "generation": 3, "resourceSliceCount": 1}
    assert list(by_name(spec)) == [f"gpu-{i}" for i in range(8)]
    gpu0 = by_name(spec)["gpu-0"]
    assert gpu0["attributes"] == {
        "type": {"string": "gpu"},
        "uuid": {"string": "GPU-120cc87c-bc27-3aa8-3344-265acaed1ada"},
        "index": {"int": 0},
        "minor": {"int": 0},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "brand": {"string": "Nvidia"},  # NVML_BRAND_NVIDIA, as go-nvlib names it
        "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "570.133.20"},
        "cudaDriverVersion": {"version": "12.8.0"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
        "numaNode": {"int": 0},
        "nvlinkGroup": {"int": 0},
        "nvlinkDomain": {"int": 0},
    }
    assert gpu0["capacity"] == {"memory": {"value": "81559Mi"}, "multiprocessors": {"value": "132"}}
    assert attrs(spec, "numaNode") == {f"gpu-{i}": {"int": 0 if i < 4 else 1} for i in range(8)}
    # Every GPU reaches every other through the NVSwitches with 18 links: no GPU has one strongest peer.
    assert set(attrs(spec, "nvlinkPair").values()) == {None}


def test_bridged_pairs_are_pairs_groups_and_domains_of_their_own() -> None:
    spec = slice_spec(node("a100-pcie-nvlink-pairs"), "n", DRIVER, 1)
    expected = {"gpu-0": {"int": 0}, "gpu-1": {"int": 0}, "gpu-2": {"int": 2}, "gpu-3": {"int": 2}}
    for attribute in ("nvlinkPair", "nvlinkGroup", "nvlinkDomain"):
        assert attrs(spec, attribute) == expected
    assert attrs(spec, "resource.kubernetes.io/pciBusID") == {
        "gpu-0": {"string": "0000:18:00.0"}, "gpu-1": {"string": "0000:2a:00.0"},
        "gpu-2": {"string": "0000:3a:00.0"}, "gpu-3": {"string": "0000:5d:00.0"}}
    assert by_name(spec)["gpu-0"]["capacity"] == {"memory": {"value": "80Gi"}, "multiprocessors": {"value": "108"}}


def test_gpus_without_nvlink_have_no_clique_attributes() -> None:
    spec = slice_spec(node(LOOSE), "n", DRIVER, 1)
    assert attrs(spec, "nvlinkPair") == {"gpu-0": {"int": 0}, "gpu-1": {"int": 0}, "gpu-2": None, "gpu-3": None}
    assert attrs(spec, "nvlinkDomain") == {"gpu-0": {"int": 0}, "gpu-1": {"int": 0}, "gpu-2": None, "gpu-3": None}
    spec = slice_spec(node("pcie-l40s-4"), "n", DRIVER, 1)
    assert {a for d in by_name(spec).values() for a in d["attributes"] if a.startswith("nvlink")} == set()


def test_unhealthy_draining_and_mig_enabled_gpus_are_withdrawn() -> None:
    state = node("dgx-h100", mig={5: [("1g.10gb", 0)]})
    state = state.evolve(health={state.inventory.gpus[2].uuid: DeviceHealth(False, "XID 79")},
                         draining=frozenset({state.inventory.gpus[6].uuid}))
    # GPU 5 is MIG-enabled: its MIG device is published instead.
    assert list(by_name(slice_spec(state, "n", DRIVER, 1))) == [
        "gpu-0", "gpu-1", "gpu-3", "gpu-4", "gpu-7", "gpu-5-mig-7-0"]


def test_with_taints_unhealthy_gpus_and_their_mig_devices_stay_in_tainted() -> None:
    state = node("dgx-h100", mig={5: [("1g.10gb", 0)]})
    gpus = state.inventory.gpus
    state = state.evolve(health={gpus[2].uuid: DeviceHealth(False, "XID 48"),
                                 gpus[5].uuid: DeviceHealth(False, "GPU is lost (fallen off the bus)", True)},
                         draining=frozenset({gpus[6].uuid}))
    spec = by_name(slice_spec(state, "n", DRIVER, 1, taints=True))
    # Draining GPUs are still left out; unhealthy ones carry the taint.
    assert list(spec) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-7", "gpu-5-mig-7-0"]
    assert {n: d.get("taints") for n, d in spec.items() if d.get("taints")} == {
        "gpu-2": [{"key": "gpu.gpu-node-agent.io/unhealthy", "value": "xid-48", "effect": "NoSchedule"}],
        "gpu-5-mig-7-0": [{"key": "gpu.gpu-node-agent.io/unhealthy", "value": "gpu-is-lost-fallen-off-the-bus",
                           "effect": "NoExecute"}],
    }


def test_a_long_reason_is_cut_to_a_label_value() -> None:
    state = node("a100-pcie-nvlink-pairs")
    reason = "3 uncorrected ECC error(s) since the last reset, and then some more words to pass 63"
    state = state.evolve(health={state.inventory.gpus[0].uuid: DeviceHealth(False, reason)})
    (taint,) = by_name(slice_spec(state, "n", DRIVER, 1, taints=True))["gpu-0"]["taints"]  # type: ignore[index]
    assert taint["value"] == "3-uncorrected-ecc-error-s-since-the-last-reset-and-then-some-mo"  # 63 characters


def test_mig_devices_carry_profile_parent_placement_and_their_gpus_topology() -> None:
    state = node("dgx-h100", mig={6: [("3g.40gb", 4), ("2g.20gb", 0)]})
    spec = slice_spec(state, "n", DRIVER, 1)
    assert [n for n in by_name(spec) if "mig" in n] == ["gpu-6-mig-3-0", "gpu-6-mig-2-0"]
    mig = by_name(spec)["gpu-6-mig-2-0"]
    assert mig["attributes"] == {
        "type": {"string": "mig"},
        "uuid": {"string": "MIG-9857ff08-4c70-56ee-b945-e0462515b939"},
        "profile": {"string": "3g.40gb"},
        "parentUUID": {"string": "GPU-d3ef7d22-95cd-bb41-f3b2-e2bbcb031151"},
        "parentIndex": {"int": 6},
        "parentMinor": {"int": 6},
        "placementStart": {"int": 4},
        "placementSize": {"int": 4},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "brand": {"string": "Nvidia"},
        "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "570.133.20"},
        "cudaDriverVersion": {"version": "12.8.0"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:ba:00.0"},
        "numaNode": {"int": 1},
        "nvlinkGroup": {"int": 0},
        "nvlinkDomain": {"int": 0},
    }
    # docs/reference/mig-profiles.md, H100-80GB: 3g.40gb is 39.50 GiB with 60 SMs.
    assert mig["capacity"]["memory"] == {"value": "40448Mi"}
    assert mig["capacity"]["multiprocessors"] == {"value": "60"}
    # While GPU 6's layout changes, or while it is unhealthy, its MIG devices leave the slice.
    for hidden in (state.evolve(draining=frozenset({state.inventory.gpus[6].uuid})),
                   state.evolve(health={state.inventory.gpus[6].uuid: DeviceHealth(False, "XID 48")})):
        assert [n for n in by_name(slice_spec(hidden, "n", DRIVER, 1)) if "mig" in n] == []


def test_pcie_root_from_sysfs(tmp_path: Path) -> None:
    device = tmp_path / "devices" / "pci0000:17" / "0000:17:01.0" / "0000:18:00.0"
    device.mkdir(parents=True)
    (tmp_path / "devices" / "platform").mkdir()
    bus = tmp_path / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    (bus / "0000:18:00.0").symlink_to(device)
    (bus / "0000:2a:00.0").symlink_to(tmp_path / "devices" / "platform")
    assert sysfs_pcie_root("00000000:18:00.0", tmp_path) == "pci0000:17"
    assert sysfs_pcie_root("00000000:2A:00.0", tmp_path) is None  # not below a PCI root
    assert sysfs_pcie_root("00000000:99:00.0", tmp_path) is None  # unknown to sysfs
    spec = slice_spec(node("a100-pcie-nvlink-pairs"), "n", DRIVER, 1, lambda b: sysfs_pcie_root(b, tmp_path))
    assert attrs(spec, "resource.kubernetes.io/pcieRoot") == {
        "gpu-0": {"string": "pci0000:17"}, "gpu-1": None, "gpu-2": None, "gpu-3": None}


def test_versions_and_names() -> None:
    assert semver("535.104.05") == "535.104.5"
    assert semver("12.8") == "12.8.0"
    assert slice_name("gpu-node-1", DRIVER) == "gpu-node-1-gpu.gpu-node-agent.io"


def test_config_section() -> None:
    config = parse_config("version: v1\ndra: {enabled: true, driverName: gpu.example.com}\n")
    assert (config.dra.enabled, config.dra.driver_name) == (True, "gpu.example.com")
    assert parse_config("version: v1\n").dra.enabled is False
    with pytest.raises(ConfigError) as err:
        parse_config("version: v1\ndra: {driverName: GPU}\n", "cfg")
    assert str(err.value) == ("cfg: dra.driverName: 'GPU' is not a DRA driver name (a lower-case DNS subdomain of "
                              "at most 63 characters with at least one dot, e.g. gpu.example.com)")


def test_cdi_spec_with_a_driver_root_and_control_nodes() -> None:
    spec = claim_spec(DRIVER, "u1", [("gpu-3", "GPU-c", ["/dev/nvidia3"])], ["/dev/nvidiactl", "/dev/nvidia-uvm"],
                      Path("/run/nvidia/driver"))
    assert spec == {"cdiVersion": "0.6.0", "kind": "gpu.gpu-node-agent.io/gpu", "devices": [
        {"name": "claim-u1-gpu-3", "containerEdits": {"deviceNodes": [
            {"path": "/dev/nvidia3", "hostPath": "/run/nvidia/driver/dev/nvidia3"}]}},
        {"name": "claim-u1", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-c"], "deviceNodes": [
            {"path": "/dev/nvidiactl", "hostPath": "/run/nvidia/driver/dev/nvidiactl"},
            {"path": "/dev/nvidia-uvm", "hostPath": "/run/nvidia/driver/dev/nvidia-uvm"}]}},
    ]}


@pytest.mark.parametrize(("content", "problem"), [
    ('{"version": 7, "claims": {}}', "{} is version 7; this agent reads versions 1 and 2"),
    ('{"version": 1, "claims": []}', "{} is damaged: no version and claims"),
    ('{"version": 1, "claims": {"u', "cannot read {}: not JSON (Unterminated string starting at: line 1 column 27 "
                                     "(char 26))"),
    (b'{"version": 1, "claims": {"\xff": {}}}', "cannot read {}: not UTF-8 text (byte 0xff at line 1)"),
    (None, "cannot read {}: is a FIFO, not a regular file"),
])
def test_a_damaged_checkpoint_is_kept_aside_in_one_line_and_the_agent_starts_with_no_claims(
        tmp_path: Path, content: str | bytes | None, problem: str, caplog: pytest.LogCaptureFixture) -> None:
    from agent.dra.claims import ClaimStore, Paths

    paths = Paths.under(tmp_path, DRIVER, tmp_path / "cdi")
    paths.checkpoint.parent.mkdir(parents=True)
    if content is None:
        os.mkfifo(paths.checkpoint)  # read as it is, it would block the agent's start for ever
    elif isinstance(content, bytes):
        paths.checkpoint.write_bytes(content)
    else:
        paths.checkpoint.write_text(content)
    store = ClaimStore(paths, DRIVER)
    assert store.claims == {}
    kept = paths.checkpoint.parent / "checkpoint.json.corrupt"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("ERROR", (
        f"{problem.format(f'the DRA checkpoint {paths.checkpoint}')}: kept as {kept}; starting with no prepared "
        "claims, and removing no CDI spec or MIG device at start while that file is there (which claims own them "
        "is unknown)"))]
    assert not paths.checkpoint.exists()
    if content is None:
        assert stat.S_ISFIFO(kept.lstat().st_mode)
    else:
        assert kept.read_bytes() == (content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize(("brand", "published"), [(13, "NvidiaRTX"), (2, "Tesla"), (0, "Unknown"), (99, None)])
def test_brand_as_nvidias_driver_names_it(brand: int, published: str | None) -> None:
    state = node("pcie-l40s-4")
    gpus = tuple(dataclasses.replace(g, brand=brand) for g in state.inventory.gpus)
    state = state.evolve(inventory=dataclasses.replace(state.inventory, gpus=gpus))
    found = by_name(slice_spec(state, "n", DRIVER, 1))["gpu-0"]["attributes"].get("brand")  # type: ignore[attr-defined]
    assert found == (None if published is None else {"string": published})


def test_the_fake_brands_its_gpus_as_nvml_brands_data_centre_gpus() -> None:
    fake = FakeNvml(load_node("dgx-h100"))
    fake.nvmlInit()
    assert fake.nvmlDeviceGetBrand(fake.nvmlDeviceGetHandleByIndex(0)) == 14  # NVML_BRAND_NVIDIA


def gpu_config(env: object, **extra: object) -> dict[str, object]:
    return {"apiVersion": "gpu.gpu-node-agent.io/v1", "kind": "GpuConfig", "env": env, **extra}


def entry(source: str, parameters: object, requests: list[str] | None = None,
          driver: str = DRIVER) -> dict[str, object]:
    return {"source": source, "requests": requests or [], "opaque": {"driver": driver, "parameters": parameters}}


def test_opaque_config_claim_over_class_by_request() -> None:
    configs = [
        # As the allocator lists them: the claim's entries may come before or after the class's.
        entry("FromClaim", gpu_config({"MODE": "claim", "ONLY_PAIR": "1"}), ["gpus/pair"]),
        entry("FromClass", gpu_config({"MODE": "class", "CLASS": "yes"})),
        entry("FromClaim", {"anything": "at all"}, driver="other.example.com"),  # not this driver's
        entry("FromClaim", gpu_config({"LOG": "debug"}), ["extra"]),
    ]
    env = device_env(DRIVER, configs, {"gpu-0": ["gpus/pair"], "gpu-1": ["gpus/pair"], "gpu-2": ["extra"]})
    assert env == {
        "gpu-0": {"MODE": "claim", "ONLY_PAIR": "1", "CLASS": "yes"},
        "gpu-1": {"MODE": "claim", "ONLY_PAIR": "1", "CLASS": "yes"},
        "gpu-2": {"MODE": "class", "CLASS": "yes", "LOG": "debug"},
    }


@pytest.mark.parametrize(("parameters", "message"), [
    ({"apiVersion": "gpu.nvidia.com/v1beta1", "kind": "GpuConfig"},
     "the claim's config[1]: unknown configuration apiVersion 'gpu.nvidia.com/v1beta1' kind 'GpuConfig' (this "
     "driver reads apiVersion 'gpu.gpu-node-agent.io/v1' kind 'GpuConfig')"),
    (gpu_config({}, sharing={"strategy": "TimeSlicing"}), "the claim's config[1]: GpuConfig has no field 'sharing' "
                                                           "(it has: env)"),
    (gpu_config({"1BAD": "x"}), "the claim's config[1]: GpuConfig.env: '1BAD' is not an environment variable name"),
    (gpu_config({"N": 3}), "the claim's config[1]: GpuConfig.env.N: 3 is not a string"),
    (gpu_config(["A=1"]), "the claim's config[1]: GpuConfig.env is not an object of names to strings"),
    (gpu_config({"NVIDIA_VISIBLE_DEVICES": "all"}),
     "the claim's config[1]: GpuConfig.env: NVIDIA_VISIBLE_DEVICES is set by the driver"),
    ("text", "the claim's config[1]: the parameters are not a JSON object but str"),
])
def test_opaque_config_problems_are_one_line(parameters: object, message: str) -> None:
    configs = [entry("FromClass", gpu_config({"A": "1"})), entry("FromClaim", gpu_config({"B": "2"})),
               entry("FromClaim", parameters)]
    with pytest.raises(ConfigProblem) as caught:
        device_env(DRIVER, configs, {"gpu-0": ["gpus"]})
    assert str(caught.value) == message


def test_cdi_spec_carries_each_devices_environment() -> None:
    spec = claim_spec(DRIVER, "u1", [("gpu-0", "GPU-a", ["/dev/nvidia0"]), ("gpu-1", "GPU-b", ["/dev/nvidia1"])],
                      [], Path("/"), {"gpu-0": {"B": "2", "A": "1"}, "gpu-1": {}})
    assert spec["devices"] == [
        {"name": "claim-u1-gpu-0",
         "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}], "env": ["A=1", "B=2"]}},
        {"name": "claim-u1-gpu-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}},
        {"name": "claim-u1", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b"]}},
    ]


SHARED = parse_config("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                      "      - {name: nvidia.com/gpu, replicas: 3, devices: [0, 2]}\n")


def test_time_sliced_gpus_are_published_as_their_replicas() -> None:
    state = dataclasses.replace(node("a100-pcie-nvlink-pairs"), config=SHARED)
    spec = by_name(slice_spec(state, "n", DRIVER, 1))
    assert list(spec) == ["gpu-0-replica-0", "gpu-0-replica-1", "gpu-0-replica-2", "gpu-1",
                          "gpu-2-replica-0", "gpu-2-replica-1", "gpu-2-replica-2", "gpu-3"]
    whole = by_name(slice_spec(node("a100-pcie-nvlink-pairs"), "n", DRIVER, 1))["gpu-0"]
    second = spec["gpu-0-replica-1"]
    assert second["attributes"] == {**whole["attributes"], "type": {"string": "shared"},  # type: ignore[dict-item]
                                    "sharing": {"string": "time-slicing"}, "replica": {"int": 1},
                                    "replicas": {"int": 3}}
    assert second["capacity"] == whole["capacity"] == {"memory": {"value": "80Gi"},
                                                       "multiprocessors": {"value": "108"}}
    assert second["attributes"]["nvlinkPair"] == {"int": 0}  # type: ignore[index]
    assert spec["gpu-1"]["attributes"]["type"] == {"string": "gpu"}  # type: ignore[index]


def test_mps_replicas_wait_for_their_gpus_daemon() -> None:
    mps = parse_config("version: v1\nsharing:\n  mps:\n    resources:\n"
                       "      - {name: nvidia.com/gpu, replicas: 2, devices: [0, 1]}\n")
    state = dataclasses.replace(node("a100-pcie-nvlink-pairs"), config=mps)
    gpus = state.inventory.gpus
    # No daemon is up yet: GPUs 0 and 1 are in no form, so that no whole-GPU claim takes them meanwhile.
    assert list(by_name(slice_spec(state, "n", DRIVER, 1))) == ["gpu-2", "gpu-3"]
    state = state.evolve(mps={gpus[0].uuid: "", gpus[1].uuid: "control daemon exited with code 1"})
    spec = by_name(slice_spec(state, "n", DRIVER, 1))
    assert list(spec) == ["gpu-0-replica-0", "gpu-0-replica-1", "gpu-2", "gpu-3"]
    assert spec["gpu-0-replica-1"]["attributes"]["sharing"] == {"string": "mps"}  # type: ignore[index]


def test_in_dra_mode_the_device_plugin_leaves_whole_gpus_and_their_replicas_under_any_name() -> None:
    config = parse_config("version: v1\nflags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
                          "      - {name: nvidia.com/gpu, replicas: 2, rename: example.com/shared-gpu}\n"
                          "      - {name: nvidia.com/mig-1g.10gb, replicas: 2}\n")
    state = dataclasses.replace(node("dgx-h100", mig={5: [("1g.10gb", 0)]}), config=config)
    resources = plan(state).resources
    assert sorted(resources) == ["example.com/shared-gpu", "nvidia.com/mig-1g.10gb"]
    assert plugin_resources(resources, dra=True) == {"nvidia.com/mig-1g.10gb"}
    assert plugin_resources(resources, dra=False) == {"example.com/shared-gpu", "nvidia.com/mig-1g.10gb"}


class NoClaims:
    async def claim(self, namespace: str, name: str) -> None:
        return None


async def test_the_health_stream_has_prepared_devices_the_node_lost_as_unknown_and_repeats_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.dra import health as dra_health
    from agent.dra import plugin as dra_plugin
    from agent.dra.claims import Paths, Prepared
    from agent.dra.health_v1alpha1 import api_pb2 as health

    monkeypatch.setattr(dra_health, "HEALTH_RESEND_S", 0.2)
    state = node("dgx-h100", mig={7: [("3g.40gb", 0)]})
    (mig,) = state.inventory.mig_devices
    name = f"gpu-7-mig-{mig.gpu_instance_id}-{mig.compute_instance_id}"
    bus = StateBus(state)
    plugin = dra_plugin.DraKubeletPlugin(Paths.under(tmp_path, DRIVER, tmp_path / "cdi"), DRIVER, "n",
                                         bus, NoClaims(), [], Path("/"), lambda: None)
    plugin.store.put("u1", "ns", "c", [Prepared(("mig",), "n", name, ())], {})
    stream = plugin.watch_health()

    async def report() -> list[tuple[str, str, int]]:
        answer = await asyncio.wait_for(anext(stream), 5)
        return [(d.device.pool_name, d.device.device_name, d.health) for d in answer.devices]

    whole = [("n", f"gpu-{i}", health.HEALTHY) for i in range(7)]
    assert await report() == [*whole, ("n", name, health.HEALTHY)]
    # The layout is replaced while the claim is prepared: its MIG device is gone from the node.
    await bus.update(inventory=dataclasses.replace(state.inventory, mig_devices=()))
    lost = await report()
    assert lost == [*whole, ("n", name, health.UNKNOWN)]
    assert await report() == lost  # nothing changed: the list again, for the kubelet's health timeout
    await plugin.unprepare("u1")
    assert await report() == whole
    await stream.aclose()


class StoredSlices:
    """A stand-in for the API server's ResourceSlices: keeps what is written, dropping device taints unless
    `keeps_taints` (as the DRADeviceTaints gate decides), and records each write as (verb, dry run)."""

    def __init__(self, keeps_taints: bool) -> None:
        self.keeps_taints = keeps_taints
        self.stored: dict[str, dict[str, object]] = {}
        self.writes: list[tuple[str, bool]] = []
        self.version = 0

    def _store(self, verb: str, body: dict[str, object], dry_run: bool) -> dict[str, object]:
        self.writes.append((verb, dry_run))
        kept = copy.deepcopy(body)
        if not self.keeps_taints:
            for device in kept["spec"]["devices"]:  # type: ignore[index]
                device.pop("taints", None)
        if dry_run:
            return kept
        self.version += 1
        kept["metadata"] = {**kept["metadata"], "resourceVersion": str(self.version)}  # type: ignore[dict-item]
        self.stored[kept["metadata"]["name"]] = kept  # type: ignore[index]
        return kept

    async def get(self, name: str) -> dict[str, object] | None:
        return copy.deepcopy(self.stored.get(name))

    async def create(self, body: dict[str, object], dry_run: bool = False) -> dict[str, object]:
        return self._store("create", body, dry_run)

    async def replace(self, name: str, body: dict[str, object], dry_run: bool = False) -> dict[str, object]:
        return self._store("replace", body, dry_run)

    async def delete(self, name: str) -> None:
        self.stored.pop(name, None)

    async def list(self, node: str, driver: str) -> list[dict[str, object]]:
        return list(self.stored.values())


@pytest.mark.parametrize(("keeps", "mode", "gpu3"), [
    (True, "taints", [{"key": "gpu.gpu-node-agent.io/unhealthy", "value": "xid-48", "effect": "NoSchedule"}]),
    (False, "withdrawal", None),
])
async def test_the_first_taint_is_a_dry_run_that_decides_the_health_mode(
        keeps: bool, mode: str, gpu3: object) -> None:
    from agent.dra.publisher import SlicePublisher

    state = node("a100-pcie-nvlink-pairs")
    api, modes = StoredSlices(keeps), []
    publisher = SlicePublisher(api, StateBus(state), "n", DRIVER, lambda bus_id: None, on_health_mode=modes.append)
    assert await publisher.sync(state)
    sick = state.evolve(health={state.inventory.gpus[3].uuid: DeviceHealth(False, "XID 48")})
    assert await publisher.sync(sick)
    assert api.writes == [("create", False), ("replace", True), ("replace", False)]
    assert (publisher.health_mode, modes) == (mode, [mode])
    devices = {d["name"]: d for d in api.stored["n-gpu.gpu-node-agent.io"]["spec"]["devices"]}  # type: ignore[index]
    assert devices.get("gpu-3", {}).get("taints") == gpu3
    assert ("gpu-3" in devices) is keeps
    # Decided: the next fault is written once, with no dry run.
    sicker = sick.evolve(health={**sick.health, state.inventory.gpus[2].uuid: DeviceHealth(False, "XID 48")})
    assert await publisher.sync(sicker)
    assert api.writes[3:] == [("replace", False)]
    assert modes == [mode]


def test_memory_is_written_in_the_api_servers_canonical_form() -> None:
    """The API server stores a quantity in its canonical form (a binary quantity under the largest suffix that
    keeps it whole: 81920Mi comes back as 80Gi); the slice says it that way, so a slice read back compares equal."""
    from agent.dra.slices import mib_quantity

    assert [mib_quantity(m) for m in (81920, 81559, 40448, 1024, 1048576, 1536, 0)] == [
        "80Gi", "81559Mi", "40448Mi", "1Gi", "1Ti", "1536Mi", "0"]


def shared(preset: str, replicas: int) -> NodeState:
    """Every GPU of `preset` time-sliced into `replicas` replicas."""
    state = node(preset)
    config = parse_config("version: v1\nsharing: {timeSlicing: {resources: "
                          f"[{{name: nvidia.com/gpu, replicas: {replicas}}}]}}}}\n")
    return NodeState(version=1, inventory=state.inventory, config=config)


def sizes(slices: list[tuple[str, dict[str, object]]]) -> list[tuple[str, int, int, str, str]]:
    """Per slice: its name, its device count, resourceSliceCount, its first and last device."""
    return [(name, len(spec["devices"]), spec["pool"]["resourceSliceCount"],  # type: ignore[arg-type, index]
             spec["devices"][0]["name"], spec["devices"][-1]["name"])  # type: ignore[index]
            for name, spec in slices]


def test_a_node_with_more_devices_than_a_slice_takes_is_published_in_several() -> None:
    from agent.dra.slices import pool_slices

    main = "n-gpu.gpu-node-agent.io"
    # 8 GPUs x 17 replicas: 136 devices, 128 a slice.
    state = shared("dgx-h100", 17)
    assert sizes(pool_slices(state, "n", DRIVER, 1)) == [
        (main, 128, 2, "gpu-0-replica-0", "gpu-7-replica-8"),
        (f"{main}-1", 8, 2, "gpu-7-replica-9", "gpu-7-replica-16")]
    # A device with a taint: 64 a slice.
    sick = state.evolve(health={state.inventory.gpus[5].uuid: DeviceHealth(False, "XID 48")})
    assert sizes(pool_slices(sick, "n", DRIVER, 1, taints=True)) == [
        (main, 64, 3, "gpu-0-replica-0", "gpu-3-replica-12"),
        (f"{main}-1", 64, 3, "gpu-3-replica-13", "gpu-7-replica-8"),
        (f"{main}-2", 8, 3, "gpu-7-replica-9", "gpu-7-replica-16")]
    # 16 GPUs x 64 replicas: 1024 devices in 8 slices.
    big = pool_slices(shared("hgx-16-nvswitch", 64), "n", DRIVER, 1)
    assert [(n, c, k) for n, c, k, _, _ in sizes(big)] == [
        (main if i == 0 else f"{main}-{i}", 128, 8) for i in range(8)]
    assert all(spec["pool"] == {"name": "n", "generation": 1, "resourceSliceCount": 8} for _, spec in big)
    # 8 GPUs x 16 replicas fit one slice, as before.
    assert sizes(pool_slices(shared("dgx-h100", 16), "n", DRIVER, 1)) == [
        (main, 128, 1, "gpu-0-replica-0", "gpu-7-replica-15")]


async def test_the_publisher_writes_every_slice_of_the_pool_with_one_generation_and_follows_changes() -> None:
    from agent.dra.publisher import SlicePublisher

    main = "n-gpu.gpu-node-agent.io"
    state = shared("dgx-h100", 17)
    api = StoredSlices(keeps_taints=True)
    publisher = SlicePublisher(api, StateBus(state), "n", DRIVER, lambda bus_id: None)
    assert await publisher.sync(state)
    assert api.writes == [("create", False), ("create", False)]

    def pool() -> dict[str, tuple[int, int, int]]:
        return {name: (len(s["spec"]["devices"]), s["spec"]["pool"]["generation"],  # type: ignore[index]
                       s["spec"]["pool"]["resourceSliceCount"]) for name, s in api.stored.items()}  # type: ignore[index]

    assert pool() == {main: (128, 1, 2), f"{main}-1": (8, 1, 2)}
    assert not await publisher.sync(state)  # unchanged: nothing written
    assert len(api.writes) == 2
    # A restarted agent finds its slices as it left them: nothing written.
    again = SlicePublisher(api, StateBus(state), "n", DRIVER, lambda bus_id: None)
    assert not await again.sync(state)
    assert len(api.writes) == 2
    # Fewer replicas: one slice again, the other deleted.
    fewer = shared("dgx-h100", 2)
    assert await again.sync(fewer)
    assert pool() == {main: (16, 2, 1)}
    # And more again: two slices, the next generation.
    assert await again.sync(state)
    assert pool() == {main: (128, 3, 2), f"{main}-1": (8, 3, 2)}


class NodeSlices(StoredSlices):
    """StoredSlices of an API server that has the Node (its UID "node-uid-1")."""

    async def node_uid(self, node: str) -> str:
        return "node-uid-1"


async def test_the_slices_are_owned_by_their_node() -> None:
    from agent.dra.publisher import SlicePublisher

    owner = [{"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "node-uid-1", "controller": True}]
    for state, names in ((node("a100-pcie-nvlink-pairs"), ["n-gpu.gpu-node-agent.io"]),
                         (shared("dgx-h100", 17), ["n-gpu.gpu-node-agent.io", "n-gpu.gpu-node-agent.io-1"])):
        # Written by an agent that gave no owner: written again, with the owner.
        plain = StoredSlices(keeps_taints=True)
        assert await SlicePublisher(plain, StateBus(state), "n", DRIVER, lambda bus_id: None).sync(state)
        assert [s["metadata"].get("ownerReferences") for s in plain.stored.values()] == [  # type: ignore[attr-defined]
            None] * len(names)
        api = NodeSlices(keeps_taints=True)
        api.stored, api.version = copy.deepcopy(plain.stored), plain.version
        assert await SlicePublisher(api, StateBus(state), "n", DRIVER, lambda bus_id: None).sync(state)
        assert sorted(api.stored) == names
        assert [s["metadata"].get("ownerReferences") for s in api.stored.values()] == [  # type: ignore[attr-defined]
            owner] * len(names)
        # A restart finds them owned: nothing written.
        writes = len(api.writes)
        assert not await SlicePublisher(api, StateBus(state), "n", DRIVER, lambda bus_id: None).sync(state)
        assert len(api.writes) == writes


class CountedNodeSlices(NodeSlices):
    """NodeSlices counting the GETs of the Node."""

    node_reads = 0

    async def node_uid(self, node: str) -> str:
        self.node_reads += 1
        return await super().node_uid(node)


async def test_a_restarted_agent_takes_its_slices_owner_from_the_list_without_reading_the_node() -> None:
    from agent.dra.publisher import SlicePublisher

    for state in (node("a100-pcie-nvlink-pairs"), shared("dgx-h100", 17)):  # one slice; two
        api = CountedNodeSlices(keeps_taints=True)
        assert await SlicePublisher(api, StateBus(state), "n", DRIVER, lambda bus_id: None).sync(state)
        assert api.node_reads == 1  # the first agent reads its Node's UID once
        writes = len(api.writes)
        assert not await SlicePublisher(api, StateBus(state), "n", DRIVER, lambda bus_id: None).sync(state)
        assert (len(api.writes), api.node_reads) == (writes, 1)
