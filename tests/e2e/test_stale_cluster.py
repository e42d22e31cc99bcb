"""A cluster left behind by a run stopped with the machine: none of its processes alive, its pods' network
namespaces, mounts, cgroups and files still there. The next run takes it down first (hack/cluster/down.sh
--if-stale, called by hack/test.sh and the session's cluster fixture) rather than refusing to start. This module runs
last: it leaves the session's cluster dead, and the session's teardown then checks the machine is as it was."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from cluster import HACK, RUN_DIR, Cluster
from dra_mode import slices_gone


def every_process_of(run_dir: Path) -> set[int]:
    """The daemons up.sh started, containerd's shims, and every process in the kubelet's cgroups (the pods)."""
    pids = {int(f.read_text()) for f in (run_dir / "pids").glob("*.pid")}
    socket = str(run_dir / "containerd" / "containerd.sock").encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if socket in (proc / "cmdline").read_bytes():
                    pids.add(int(proc.name))
            except OSError:
                continue
    for hierarchy in (Path("/sys/fs/cgroup/kubepods"), Path("/sys/fs/cgroup/pids/kubepods")):
        for procs in hierarchy.rglob("cgroup.procs") if hierarchy.is_dir() else ():
            pids |= {int(p) for p in procs.read_text().split()}
    return {p for p in pids if p != os.getpid() and Path(f"/proc/{p}").exists()}


def running_state(pid: int) -> str | None:
    """The state letter in /proc/PID/stat (Z: a zombie, dead), None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return None


def test_a_cluster_whose_every_process_died_is_taken_down_by_the_next_run(cluster: Cluster) -> None:
    slices_gone()  # nothing of the modules before still watching the cluster
    # The cluster serving, in whatever MIG layout the modules before left it.
    ready = [c["status"] for c in cluster.node()["status"]["conditions"] if c["type"] == "Ready"]
    assert ready == ["True"]
    running = subprocess.run([str(HACK / "down.sh"), "--if-stale"], capture_output=True, text=True, timeout=60,
                             check=False)
    assert (running.returncode, running.stderr, RUN_DIR.is_dir()) == (0, "", True), "a live cluster is left alone"

    processes = every_process_of(RUN_DIR)
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (alive := {p for p in processes if running_state(p) not in (None, "Z")}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"still running after SIGKILL: {sorted(alive)}"
    netns = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if line.split()[4].startswith("/run/netns/cni-")]
    assert netns, "the pods' network namespaces outlive their processes, as after a machine stop"

    stale = subprocess.run([str(HACK / "down.sh"), "--if-stale"], capture_output=True, text=True, timeout=300,
                           check=False)
    assert stale.returncode == 0, stale.stderr
    assert stale.stderr.splitlines()[0] == (f"cluster: a cluster none of whose processes is alive was left in "
                                            f"{RUN_DIR}: taking it down")
    assert not RUN_DIR.exists()
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert [m for m in mounts if m in netns] == []
    # The session's teardown (conftest.py) finds no cluster and checks the machine is as it was before the session.
