"""The device plugin against the kubelet's own device-manager code, through the Go harness."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness_binaries import HarnessBinaries

# The harness's checks, in the order it prints them.
CHECKS = [
    "registration",
    "plugin-options",
    "capacity",
    "device-ids",
    "numa-topology",
    "topology-hints",
    "preferred-allocation",
    "allocate",
    "allocate-env",
    "kubelet-restart",
    "capacity-after-restart",
    "sigterm-exit",
    "socket-removed",
]

# The checks of the other scenarios (-scenario), in the order the harness prints them.
ALLOCATION_CHECKS = [
    "registration",
    "capacity",
    "device-ids",
    "numa-topology",
    "preferred-allocation",
    "allocate",
    "allocate-env",
    "sigterm-exit",
    "socket-removed",
]
HEALTH_CHECKS = [
    "registration",
    "capacity",
    "device-ids",
    "health-unhealthy",
    "health-recovered",
    "sigterm-exit",
    "socket-removed",
]

GPU_AGENT = Path(sys.executable).with_name("gpu-agent")
PRESET = "mock:dgx-h100"

# Facts of the DGX H100 preset: eight H100 80GB, GPUs 0-3 on NUMA node 0 and 4-7 on node 1. On an H100
# 80GB, 7 MIG devices of 1g.10gb fit, or 2 of 3g.40gb (NVIDIA's MIG user guide, supported profiles).
GPUS = 8
MIG_1G_PER_GPU = 7
MIG_3G_PER_GPU = 2


def numa_of(gpu_index: int) -> int:
    return 0 if gpu_index < 4 else 1


def run_harness(harness: Path, *args: str) -> tuple[int, dict[str, str], str]:
    """Runs the harness; returns its exit code, the verdict per check, and all output for messages."""
    done = subprocess.run([str(harness), *args], capture_output=True, text=True, timeout=120)
    verdicts: dict[str, str] = {}
    for line in done.stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        name = rest.split(":", 1)[0]
        assert name not in verdicts, f"{name} reported twice:\n{done.stdout}"
        verdicts[name] = verdict
    return done.returncode, verdicts, done.stdout + done.stderr


def expected_numa() -> str:
    """GPUs 0-3 of the DGX H100 preset sit on NUMA node 0, GPUs 4-7 on node 1, as ID=node pairs."""
    inspect = subprocess.run(
        [str(GPU_AGENT), "inspect", "--nvml", PRESET, "--json"], capture_output=True, text=True, timeout=60
    )
    assert inspect.returncode == 0, f"gpu-agent inspect failed:\n{inspect.stderr}"
    gpus = json.loads(inspect.stdout)["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    return ",".join(f"{g['uuid']}={0 if g['index'] < 4 else 1}" for g in gpus)


def agent_command(*extra: str) -> list[str]:
    """The agent on the mock DGX H100, serving the harness's socket directory."""
    return [str(GPU_AGENT), "run", "--nvml", PRESET, "--kubelet-dir", "{dir}", "--no-kube", "--metrics-port", "0",
            *extra]


def gpu_agent(*args: str) -> str:
    done = subprocess.run([str(GPU_AGENT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"gpu-agent {' '.join(args)} failed:\n{done.stderr}"
    return done.stdout


def inspect(mock_state: Path | None = None) -> dict[str, Any]:
    state = ["--mock-state", str(mock_state)] if mock_state else []
    result: dict[str, Any] = json.loads(gpu_agent("inspect", "--nvml", PRESET, *state, "--json"))
    return result


def numa_pairs(node: dict[str, Any]) -> str:
    """-expect-numa for every GPU and MIG device of the node: each on its GPU's NUMA node, by the preset."""
    pairs = {g["uuid"]: numa_of(g["index"]) for g in node["gpus"]}
    pairs |= {m["uuid"]: numa_of(m["gpu"]) for m in node["mig_devices"]}
    return ",".join(f"{uuid}={n}" for uuid, n in pairs.items())


def device_nodes(node: dict[str, Any]) -> str:
    """-expect-dev for every GPU and MIG device: a MIG device's node is its GPU's, /dev/nvidia<minor>."""
    minor = {g["index"]: g["minor"] for g in node["gpus"]}
    pairs = {g["uuid"]: g["minor"] for g in node["gpus"]} | {m["uuid"]: minor[m["gpu"]] for m in node["mig_devices"]}
    return ",".join(f"{uuid}=/dev/nvidia{n}" for uuid, n in pairs.items())


# The allocation checks with -expect-dev: allocate-devices follows allocate-env.
DEVICE_CHECKS = [*ALLOCATION_CHECKS[:7], "allocate-devices", *ALLOCATION_CHECKS[7:]]
PASS_DEVICE_SPECS = "  plugin:\n    passDeviceSpecs: true\n"


def apply_mig_layout(tmp_path: Path, layout: str, layouts_file: Path | None = None) -> Path:
    """A mock state with the layout applied, as `gpu-agent mig apply` leaves it."""
    state = tmp_path / "mock-state.json"
    chosen = ["--mig-config", str(layouts_file)] if layouts_file else []
    gpu_agent("mig", "apply", "--nvml", PRESET, "--mock-state", str(state), *chosen, "--layout", layout,
              "--state-dir", str(tmp_path / "mig"))
    return state


def write_config(tmp_path: Path, text: str) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    return config


MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


def test_agent_passes_every_kubelet_check(kubelet_harness: HarnessBinaries) -> None:
    agent = [
        str(GPU_AGENT),
        "run",
        "--nvml",
        PRESET,
        "--kubelet-dir",
        "{dir}",
        "--no-kube",
        "--metrics-port",
        "0",
    ]
    code, verdicts, output = run_harness(kubelet_harness.harness, "-expect-numa", expected_numa(), "--", *agent)
    assert verdicts == dict.fromkeys(CHECKS, "PASS"), output
    assert code == 0, output


def test_harness_passes_a_conforming_stand_in(kubelet_harness: HarnessBinaries) -> None:
    stub = [str(kubelet_harness.stub_plugin), "-kubelet-dir", "{dir}"]
    code, verdicts, output = run_harness(kubelet_harness.harness, "--", *stub)
    assert verdicts == dict.fromkeys(CHECKS, "PASS"), output
    assert code == 0, output


@pytest.mark.parametrize(
    ("fault", "failing_check"),
    [
        ("split-numa", "preferred-allocation"),
        ("wrong-env", "allocate-env"),
        ("slow-reregister", "kubelet-restart"),
        ("leave-socket", "socket-removed"),
    ],
)
def test_harness_fails_a_stand_in_that_breaks_the_contract(
    kubelet_harness: HarnessBinaries, fault: str, failing_check: str
) -> None:
    stub = [str(kubelet_harness.stub_plugin), "-kubelet-dir", "{dir}", "-fault", fault]
    code, verdicts, output = run_harness(kubelet_harness.harness, "--", *stub)
    assert verdicts == {**dict.fromkeys(CHECKS, "PASS"), failing_check: "FAIL"}, output
    assert code == 1, output


def test_agent_mig_devices_reach_the_kubelet(kubelet_harness: HarnessBinaries, tmp_path: Path) -> None:
    state = apply_mig_layout(tmp_path, "all-1g.10gb")
    node = inspect(state)
    config = write_config(tmp_path, MIXED + PASS_DEVICE_SPECS)
    agent = agent_command("--mock-state", str(state), "--config", str(config))
    code, verdicts, output = run_harness(
        kubelet_harness.harness, "-scenario", "mig",
        "-resources", f"nvidia.com/mig-1g.10gb={GPUS * MIG_1G_PER_GPU}:1",
        "-expect-numa", numa_pairs(node), "-expect-dev", device_nodes(node), "--", *agent,
    )
    assert verdicts == dict.fromkeys(DEVICE_CHECKS, "PASS"), output
    assert code == 0, output
    assert "PASS capacity: nvidia.com/mig-1g.10gb capacity=56 allocatable=56" in output


# GPUs 0, 1, 4, 5 with seven 1g.10gb, GPUs 2 and 6 with two 3g.40gb, GPUs 3 and 7 whole.
TWO_PROFILES_AND_WHOLE_GPUS = """\
version: v1
mig-configs:
  two-profiles-and-whole-gpus:
    - devices: [0, 1, 4, 5]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [2, 6]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
    - devices: [3, 7]
      mig-enabled: false
"""


def run_multi(harness: Path, tmp_path: Path, config: str, *flags: str) -> tuple[int, dict[str, str], str]:
    """The multi scenario: the agent on the two-profile layout, one pod asking for all three resources."""
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text(TWO_PROFILES_AND_WHOLE_GPUS)
    state = apply_mig_layout(tmp_path, "two-profiles-and-whole-gpus", layouts)
    agent = agent_command("--mock-state", str(state), "--config", str(write_config(tmp_path, config)))
    resources = [
        f"nvidia.com/mig-1g.10gb={4 * MIG_1G_PER_GPU}:2",
        f"nvidia.com/mig-3g.40gb={2 * MIG_3G_PER_GPU}:1",
        "nvidia.com/gpu=2:1",
    ]
    return run_harness(harness, "-scenario", "multi", "-resources", ",".join(resources),
                       "-expect-numa", numa_pairs(inspect(state)), *flags, "--", *agent)


def test_agent_serves_two_mig_profiles_and_whole_gpus_to_one_pod(
    kubelet_harness: HarnessBinaries, tmp_path: Path
) -> None:
    code, verdicts, output = run_multi(kubelet_harness.harness, tmp_path, MIXED)
    assert verdicts == dict.fromkeys(ALLOCATION_CHECKS, "PASS"), output
    assert code == 0, output


CDI_CHECKS = [c if c != "allocate-env" else "allocate-cdi" for c in ALLOCATION_CHECKS]


def test_agent_gives_one_container_every_device_of_three_resources_through_cdi(
    kubelet_harness: HarnessBinaries, tmp_path: Path
) -> None:
    config = MIXED + "  plugin:\n    deviceListStrategy: cdi-cri\n"
    code, verdicts, output = run_multi(kubelet_harness.harness, tmp_path, config, "-one-container",
                                       "-device-list", "cdi-cri")
    assert verdicts == dict.fromkeys(CDI_CHECKS, "PASS"), output
    assert code == 0, output


def test_one_container_with_three_resources_gets_one_visible_devices_list(
    kubelet_harness: HarnessBinaries, tmp_path: Path
) -> None:
    # The kubelet keeps the first NVIDIA_VISIBLE_DEVICES of a container's Allocate responses and drops the
    # others (pkg/kubelet/cm/devicemanager/pod_devices.go, "Environment variable has conflicting setting"):
    # with the envvar strategy, one container cannot get the devices of several resources.
    code, verdicts, output = run_multi(kubelet_harness.harness, tmp_path, MIXED, "-one-container")
    assert verdicts == {**dict.fromkeys(ALLOCATION_CHECKS, "PASS"), "allocate-env": "FAIL"}, output
    assert code == 1, output


def test_agent_time_sliced_replicas_reach_the_kubelet(kubelet_harness: HarnessBinaries, tmp_path: Path) -> None:
    config = write_config(tmp_path, """\
version: v1
flags:
  plugin:
    passDeviceSpecs: true
sharing:
  allocationPolicy: packed
  timeSlicing:
    resources:
      - {name: nvidia.com/gpu, replicas: 4}
""")
    # Packed: the 2 replicas come from one GPU, whose UUID and device node the container gets once.
    node = inspect()
    code, verdicts, output = run_harness(
        kubelet_harness.harness, "-scenario", "replicas", "-resources", f"nvidia.com/gpu={GPUS * 4}:2",
        "-replicas", "4", "-replica-gpus", "1", "-expect-numa", numa_pairs(node), "-expect-dev", device_nodes(node),
        "--", *agent_command("--config", str(config)),
    )
    assert verdicts == dict.fromkeys(DEVICE_CHECKS, "PASS"), output
    assert code == 0, output


def test_agent_xid_drops_allocatable_until_the_gpu_recovers(kubelet_harness: HarnessBinaries, tmp_path: Path) -> None:
    state = tmp_path / "mock-state.json"
    # Fast samples, so that the recovery after an XID (5 clean samples) takes about a second.
    config = write_config(tmp_path, "version: v1\nhealth:\n  sampleIntervalSeconds: 0.2\n  recoveryChecks: 5\n")
    gpu2 = inspect()["gpus"][2]["uuid"]
    # XID 48 (double-bit ECC error) makes a GPU unhealthy (README, Health).
    inject = shlex.join([str(GPU_AGENT), "fault", "--nvml", PRESET, "--mock-state", str(state), "xid", "2", "48"])
    code, verdicts, output = run_harness(
        kubelet_harness.harness, "-scenario", "health", "-resources", f"nvidia.com/gpu={GPUS}:0",
        "-inject", inject, "-unhealthy", gpu2,
        "--", *agent_command("--mock-state", str(state), "--config", str(config)),
    )
    assert verdicts == dict.fromkeys(HEALTH_CHECKS, "PASS"), output
    assert code == 0, output
    assert f"unhealthy [{gpu2}], capacity nvidia.com/gpu=8 allocatable=7" in output


def test_agent_xid_on_a_mig_gpu_drops_its_mig_devices_from_allocatable(
    kubelet_harness: HarnessBinaries, tmp_path: Path
) -> None:
    state = apply_mig_layout(tmp_path, "all-1g.10gb")
    config = write_config(tmp_path, MIXED + "health:\n  sampleIntervalSeconds: 0.2\n  recoveryChecks: 5\n")
    # An XID not scoped to a GPU or compute instance is the whole GPU's: every MIG device on it goes, as in
    # NVIDIA's device plugin.
    on_gpu2 = [m["uuid"] for m in inspect(state)["mig_devices"] if m["gpu"] == 2]
    assert len(on_gpu2) == MIG_1G_PER_GPU
    inject = shlex.join([str(GPU_AGENT), "fault", "--nvml", PRESET, "--mock-state", str(state), "xid", "2", "48"])
    code, verdicts, output = run_harness(
        kubelet_harness.harness, "-scenario", "health",
        "-resources", f"nvidia.com/mig-1g.10gb={GPUS * MIG_1G_PER_GPU}:0",
        "-inject", inject, "-unhealthy", ",".join(on_gpu2),
        "--", *agent_command("--mock-state", str(state), "--config", str(config)),
    )
    assert verdicts == dict.fromkeys(HEALTH_CHECKS, "PASS"), output
    assert code == 0, output
    assert "capacity nvidia.com/mig-1g.10gb=56 allocatable=49 after" in output


STUB_GPU2 = "GPU-5eed0002-0000-4000-8000-000000000002"
STUB_HEALTH = ["-scenario", "health", "-health-within", "3s", "-unhealthy", STUB_GPU2,
               "-inject", "echo 2 > {dir}/stub-unhealthy", "-recover", "rm {dir}/stub-unhealthy"]
STUB_REPLICAS = ["-scenario", "replicas", "-replicas", "4"]


@pytest.mark.parametrize(
    ("harness_args", "stub_args", "checks"),
    [(STUB_REPLICAS, ["-replicas", "4"], ALLOCATION_CHECKS), (STUB_HEALTH, [], HEALTH_CHECKS)],
    ids=["replicas", "health"],
)
def test_scenarios_pass_a_conforming_stand_in(
    kubelet_harness: HarnessBinaries, harness_args: list[str], stub_args: list[str], checks: list[str]
) -> None:
    stub = [str(kubelet_harness.stub_plugin), "-kubelet-dir", "{dir}", *stub_args]
    code, verdicts, output = run_harness(kubelet_harness.harness, *harness_args, "--", *stub)
    assert verdicts == dict.fromkeys(checks, "PASS"), output
    assert code == 0, output


@pytest.mark.parametrize(
    ("harness_args", "stub_args", "checks", "failing"),
    [
        (STUB_REPLICAS, ["-replicas", "4", "-fault", "repeat-uuid"], ALLOCATION_CHECKS, ["allocate-env"]),
        # The stub packs 2 replicas onto one GPU; a plugin expected to spread them over two fails.
        ([*STUB_REPLICAS, "-replica-gpus", "2"], ["-replicas", "4"], ALLOCATION_CHECKS, ["preferred-allocation"]),
        (STUB_HEALTH, ["-fault", "no-recovery"], HEALTH_CHECKS, ["health-recovered"]),
        # Nothing becomes unhealthy, so there is no recovery to check either.
        (STUB_HEALTH, ["-fault", "ignore-health"], HEALTH_CHECKS, ["health-unhealthy", "health-recovered"]),
        # Whole GPUs advertised under a MIG resource name: GPU UUIDs where MIG UUIDs belong.
        (["-scenario", "mig", "-resources", "nvidia.com/mig-1g.10gb=8:2"], ["-resource", "nvidia.com/mig-1g.10gb"],
         ALLOCATION_CHECKS, ["device-ids"]),
    ],
    ids=["repeat-uuid", "packed-where-spread-expected", "no-recovery", "ignore-health", "gpus-as-mig-devices"],
)
def test_scenarios_fail_a_stand_in_that_breaks_the_contract(
    kubelet_harness: HarnessBinaries, harness_args: list[str], stub_args: list[str], checks: list[str],
    failing: list[str],
) -> None:
    stub = [str(kubelet_harness.stub_plugin), "-kubelet-dir", "{dir}", *stub_args]
    code, verdicts, output = run_harness(kubelet_harness.harness, *harness_args, "--", *stub)
    assert verdicts == {**dict.fromkeys(checks, "PASS"), **dict.fromkeys(failing, "FAIL")}, output
    assert code == 1, output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-scenario", "nope"], 'kubelet-harness: -scenario: unknown scenario "nope" '
                                "(known: gpu, health, mig, multi, replicas)"),
        (["-scenario", "health", "--", "true"], "kubelet-harness: -scenario health needs -inject, "
                                                "the command that makes a device unhealthy"),
        (["-scenario", "mig", "-resources", "nvidia.com/mig-1g.10gb=56", "--", "true"],
         'kubelet-harness: -resources: "nvidia.com/mig-1g.10gb=56" is not NAME=DEVICES:REQUEST'),
        (["-scenario", "mig"], "kubelet-harness: -scenario mig needs the plugin command after --"),
        (["-scenario", "mig", "-one-container", "--", "true"],
         "kubelet-harness: -one-container is for -scenario multi"),
        (["-scenario", "mig", "-device-list", "volume-mounts", "--", "true"],
         'kubelet-harness: -device-list: "volume-mounts" is neither envvar nor cdi-cri'),
        (["-scenario", "mig", "-expect-dev", "MIG-x=/dev/sda", "--", "true"],
         'kubelet-harness: -expect-dev: "MIG-x=/dev/sda" is not ID=/dev/nvidiaN'),
        (["-scenario", "replicas", "-inject", "true", "--", "true"],
         "kubelet-harness: -inject is for -scenario health"),
        (["-devices", "4", "-scenario", "mig", "--", "true"], "kubelet-harness: -devices is for -scenario gpu"),
    ],
    ids=["unknown-scenario", "health-without-inject", "bad-resources", "no-plugin", "one-container-not-multi",
         "bad-device-list", "bad-expect-dev", "inject-not-health", "devices-not-gpu"],
)
def test_harness_refuses_bad_scenario_flags_in_one_line(
    kubelet_harness: HarnessBinaries, args: list[str], message: str
) -> None:
    done = subprocess.run([str(kubelet_harness.harness), *args], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", message + "\n")
