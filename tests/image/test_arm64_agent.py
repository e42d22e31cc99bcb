"""The arm64 image's own agent, run from the image's root filesystem under qemu: it is aarch64 code, it starts, its
simulated GB200 NVL72 compute tray is the amd64 image's, and it serves the kubelet's real device manager (the Go
harness of tests/kubelet) as the amd64 agent does.

Each image's root filesystem is unpacked from `make image`'s OCI archive (once per image, into .cache/cluster/rootfs/);
a program runs in it with chroot, in a mount namespace of its own (unshare -m), on an overlay of it kept read-only
as the DaemonSet keeps the container's root filesystem, with tmpfs where the DaemonSet's volumes are writable
(/var/lib/gpu-node-agent, /tmp), a fresh /proc, the machine's /dev and, for the harness, its socket directory bound
at the same path, with the environment the image's config gives the container."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from image_archive import ELF_MACHINE, Archive, Rooted, elf_machine, resolve_in, unpacked

from tests.kubelet.harness_binaries import HarnessBinaries, build_harness

pytestmark = pytest.mark.usefixtures("arm64_emulation")

PRESET = "gb200-nvl72-tray"
# A GB200 NVL72 compute tray: two GB200 superchips, each one Grace CPU (its own NUMA node) with two GPUs, in
# order: GPUs 0 and 1 on NUMA node 0, GPUs 2 and 3 on node 1 (docs/reference/gpu-models.md).
TRAY_GPUS = 4
NUMA_OF_GPU = {0: 0, 1: 0, 2: 1, 3: 1}
# The label whose value is the second the node was looked at: the one part of two runs' output that differs.
TIMESTAMP_LABEL = "nvidia.com/gfd.timestamp"
# The harness's checks of the default scenario, in the order it prints them (tests/kubelet/README.md).
HARNESS_CHECKS = [
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


@pytest.fixture(scope="module")
def arm64(index_archive: Archive) -> Rooted:
    return unpacked(index_archive, "linux/arm64")


@pytest.fixture(scope="module")
def amd64(index_archive: Archive) -> Rooted:
    return unpacked(index_archive, "linux/amd64")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessBinaries]:
    yield build_harness(tmp_path_factory.mktemp("kubelet-harness"))


def program_machine(rooted: Rooted) -> int:
    """The ELF machine of the interpreter the image's entrypoint runs (its #! line, links followed in the root)."""
    entry = resolve_in(rooted.root, f"/opt/gpu-node-agent/bin/{rooted.entrypoint[0]}")
    shebang = entry.read_text().splitlines()[0]
    assert shebang.startswith("#!/"), f"{entry}: {shebang!r}"
    return elf_machine(resolve_in(rooted.root, shebang.removeprefix("#!").split()[0]))


def test_the_arm64_image_runs_aarch64_code_and_carries_the_agent_s_version(arm64: Rooted, amd64: Rooted) -> None:
    # The interpreter of the gpu-agent each image runs is built for that image's architecture: this test cannot
    # pass on an amd64 image.
    assert (program_machine(arm64), program_machine(amd64)) == (ELF_MACHINE["arm64"], ELF_MACHINE["amd64"])
    version = arm64.image.config["config"]["Labels"]["org.opencontainers.image.version"]
    assert version == "0.1.0"
    assert arm64.agent("--version").strip() == f"gpu-agent {version} (aarch64)"
    assert amd64.agent("--version").strip() == f"gpu-agent {version} (x86_64)"


def simulate(rooted: Rooted) -> dict[str, Any]:
    node: dict[str, Any] = json.loads(rooted.agent("simulate", "--node", PRESET, "--json"))
    return node


def test_simulate_on_arm64_prints_what_it_prints_on_amd64(arm64: Rooted, amd64: Rooted) -> None:
    on_arm64, on_amd64 = simulate(arm64), simulate(amd64)
    for output in (on_arm64, on_amd64):
        assert output["node"]["capacity"]["nvidia.com/gpu"] == str(TRAY_GPUS)
        assert output["node"]["labels"].pop(TIMESTAMP_LABEL).isdigit()
    assert on_arm64 == on_amd64


def test_the_arm64_agent_serves_the_kubelet_s_device_manager(
    arm64: Rooted, amd64: Rooted, harness: HarnessBinaries
) -> None:
    gpus = json.loads(amd64.agent("inspect", "--nvml", f"mock:{PRESET}", "--json"))["gpus"]
    assert [g["index"] for g in gpus] == list(range(TRAY_GPUS))
    expect_numa = ",".join(f"{g['uuid']}={NUMA_OF_GPU[g['index']]}" for g in gpus)
    # Under qemu the agent runs several times slower: it registered about 2 s after its start (0.2 s natively)
    # and again within 0.1 s of the kubelet's restart on an idle machine, and `make test` runs it beside the rest
    # of pytest on a busy one. The harness's limits for both (20 s and 1 s by default) are widened by its flags.
    done = subprocess.run(
        [str(harness.harness), "-devices", str(TRAY_GPUS), "-expect-numa", expect_numa, "-register-within", "60s",
         "-reregister-within", "5s", "--", *arm64.plugin(PRESET)],
        capture_output=True, text=True, timeout=240,
    )
    verdicts = [line.split(":", 1)[0] for line in done.stdout.splitlines()]
    assert (done.returncode, verdicts) == (0, [f"PASS {check}" for check in HARNESS_CHECKS]), (
        done.stdout + done.stderr
    )
