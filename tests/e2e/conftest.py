"""One real single-node cluster for the whole e2e module: brought up before the first test, taken down after the
last one whatever happened, and the machine checked to be as it was before."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import HACK, PRESET, REPO, RUN_DIR, SIM_STATE, TIMES, Cluster
from dra_mode import VISIT, dra_mode, slices_gone

TIMES_FILE = REPO / ".cache" / "cluster" / "e2e-times.json"


def _in_e2e(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).parent == Path(__file__).parent and "cluster" in getattr(item, "fixturenames", ())


def pytest_collection_finish(session: pytest.Session) -> None:
    # Packages, binaries and images can take many minutes cold: build them here, before any test's timeout starts,
    # with their progress on the terminal.
    if not any(_in_e2e(item) for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for script in (HACK / "packages.sh", REPO / "hack" / "testbin.sh", HACK / "containerd.sh", HACK / "images.sh"):
            subprocess.run([str(script)], check=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # DRA mode first (test_dra.py and test_dra_shares.py move the node to DRA mode and back), then
    # test_pod_health.py, then test_mode_switch.py (the live switch, on eight whole GPUs): the other modules then find
    # the node as the cluster brought it up, and their MIG layouts do not reach it.
    here = Path(__file__).parent
    first = [here / "test_dra.py", here / "test_dra_shares.py", here / "test_pod_health.py",
             here / "test_mode_switch.py"]
    dra = [item for path in first for item in items if Path(str(item.fspath)) == path]
    rest = [item for item in items if item not in dra]
    at = next((i for i, item in enumerate(rest) if Path(str(item.fspath)).parent == here), len(rest))
    items[:] = rest[:at] + dra + rest[at:]
    # test_stale_cluster.py kills the cluster: it goes last.
    last = [item for item in items if Path(str(item.fspath)) == here / "test_stale_cluster.py"]
    items[:] = [item for item in items if item not in last] + last


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # Before the item's fixtures are torn down: a module's DRA mode stays for the next module's when it is DRA mode
    # too (dra_mode.py, leave_dra_mode).
    VISIT.following = nextitem


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMES:
        terminalreporter.section("measured on the single-node cluster")
        for what, seconds in TIMES.items():
            terminalreporter.write_line(f"{what}: {seconds:.1f} s")
        TIMES_FILE.parent.mkdir(parents=True, exist_ok=True)
        TIMES_FILE.write_text(json.dumps(TIMES, indent=1) + "\n")


def machine_state() -> dict[str, str]:
    """What cluster-down must leave as it found it, in the machine's own namespaces."""

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout

    sysctls = ["vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
               "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward"]
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    watched = ("/run/netns", "/var/lib/kubelet", "/run/containerd", str(RUN_DIR), "/var/lib/gpu-node-agent")
    paths = ["/var/lib/kubelet", "/var/lib/gpu-node-agent", "/dev/nvidia-caps", "/var/log/pods",
             "/var/log/containers", "/run/containerd", "/var/lib/cni", "/opt/containerd", "/var/lib/containerd",
             "/run/netns", "/run/cdi", str(RUN_DIR)]
    cgroups = sorted(str(p) for p in [*Path("/sys/fs/cgroup").glob("*/kubepods"), Path("/sys/fs/cgroup/kubepods")]
                     if p.exists())
    processes = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(RUN_DIR).encode() in cmdline.read_bytes():
                processes.append(cmdline.parent.name)
        except OSError:
            pass  # gone meanwhile
    return {
        "links": run("ip", "-o", "link", "show"),
        "addresses": run("ip", "-o", "addr", "show"),
        "routes": run("ip", "route", "show", "table", "all"),
        "rules": run("ip", "rule", "show"),
        "iptables": "\n".join(line for line in run("iptables-save").splitlines() if not line.startswith("#")),
        "netns": run("ip", "netns", "list"),
        "sysctls": run("sysctl", *sysctls),
        "mounts": "\n".join(m for m in mounts if m.startswith(watched)),
        "paths": "\n".join(p for p in paths if Path(p).exists()),
        "cgroups": "\n".join(cgroups),
        "processes": "\n".join(processes),
    }


def process_identity(pid: int) -> str | None:
    """"<pid> <start time>" of a live process (its start time, in clock ticks since boot, tells it from a later
    process given the same pid); None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


def orphaned() -> str | None:
    """The owner recorded by the cluster that is running, when the suite started it and that run is gone (killed
    half-way: its teardown never ran); None for a cluster of `make cluster` or of a suite still running."""
    try:
        owner = (RUN_DIR / "owner").read_text().strip()
    except OSError:
        return None
    pid = owner.split()[0]
    return owner if pid.isdigit() and process_identity(int(pid)) != owner else None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    # A cluster left by a run stopped with the machine (none of its processes alive) is taken down first.
    stale = subprocess.run([str(HACK / "down.sh"), "--quiet", "--if-stale"], capture_output=True, text=True,
                           timeout=300, check=False)
    if stale.returncode != 0:
        pytest.fail(f"hack/cluster/down.sh --if-stale failed:\n{stale.stderr[-4000:]}")
    if RUN_DIR.exists() and (owner := orphaned()) is not None:
        # A run of the suite killed half-way left its cluster running: this run takes it down and starts afresh.
        left = subprocess.run([str(HACK / "down.sh"), "--quiet"], capture_output=True, text=True, timeout=300,
                              check=False)
        if left.returncode != 0:
            pytest.fail(f"hack/cluster/down.sh of the cluster an earlier run (pid {owner.split()[0]}) left "
                        f"failed:\n{left.stderr[-4000:]}")
    if RUN_DIR.exists():
        if os.environ.get("E2E_USE_RUNNING_CLUSTER") == "1":
            # For working on the tests: the cluster of `make cluster`, left running afterwards.
            yield Cluster()
            return
        pytest.fail(f"a cluster is already running ({RUN_DIR} exists): run `make cluster-down` first, "
                    "or set E2E_USE_RUNNING_CLUSTER=1 to test that one")
    before = machine_state()
    try:
        # The kubelet updates the Node's status every second and syncs each pod every 5 s (the defaults: 10 s and a
        # minute), so that the tests wait on the agent rather than on the kubelet's timers.
        # The simulated GPUs start as the preset has them, whatever an earlier cluster left (CLUSTER_FRESH_STATE),
        # and the cluster records this run as its owner: if the run is killed, the next one takes the cluster down.
        owner = process_identity(os.getpid())
        assert owner is not None
        up = subprocess.run([str(HACK / "up.sh"), PRESET], capture_output=True, text=True, timeout=600, check=False,
                            env={**os.environ, "KUBELET_STATUS_S": "1", "KUBELET_SYNC_S": "5",
                                 "CLUSTER_FRESH_STATE": "1", "CLUSTER_OWNER": owner})
        if up.returncode != 0:
            pytest.fail(f"hack/cluster/up.sh failed:\n{up.stderr[-4000:]}")
        yield Cluster()
        slices_gone()  # the last stay in DRA mode's, if no module waited for it
    finally:
        down = subprocess.run([str(HACK / "down.sh")], capture_output=True, text=True, timeout=300, check=False)
        after = machine_state()
    assert down.returncode == 0, f"hack/cluster/down.sh failed:\n{down.stderr[-4000:]}"
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not changed, f"cluster-down left the machine changed: {changed}"
    # The next run's GPUs start from the preset, not from the MIG layouts and faults of this one.
    assert [str(f) for f in SIM_STATE if os.path.lexists(f)] == [], "the simulated GPUs' state outlived the cluster"


@pytest.fixture(scope="module")
def dra_node(cluster: Cluster) -> Iterator[Cluster]:
    """The node in DRA mode for the module's tests, then back in device-plugin mode with nothing of DRA mode left
    (dra_mode.py)."""
    yield from dra_mode(cluster)
