"""The device plugin against the kubelet's own device-manager code, through the Go harness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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

GPU_AGENT = Path(sys.executable).with_name("gpu-agent")
PRESET = "mock:dgx-h100"


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
