"""The gpu-agent command as a user runs it: real processes, real sockets, exit codes and one-line errors."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.simulate import StandInKubelet
from tests.plugin_harness import short_dir, wait_until

AGENT = [sys.executable, "-m", "agent.cli"]


async def collect_lines(stream: asyncio.StreamReader, lines: list[str]) -> None:
    """Every line of `stream`, as it comes, into `lines`."""
    while line := await stream.readline():
        lines.append(line.decode().rstrip("\n"))


def gpu_agent(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=timeout)


def test_version_names_the_release_in_pyproject_and_the_machine() -> None:
    release = next(line.split('"')[1] for line in (Path(__file__).parents[2] / "pyproject.toml").read_text()
                   .splitlines() if line.startswith("version = "))
    done = gpu_agent("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"gpu-agent {release} ({os.uname().machine})\n", "")


def test_simulate_json_shows_eight_gpus_for_dgx_h100() -> None:
    done = gpu_agent("simulate", "--node", "dgx-h100", "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["node"]["name"] == "sim-dgx-h100"
    assert view["node"]["capacity"] == {"nvidia.com/gpu": "8"}
    assert view["node"]["allocatable"] == {"nvidia.com/gpu": "8"}
    assert view["node"]["taints"] == []
    assert view["node"]["labels"]["nvidia.com/gpu.count"] == "8"
    assert view["node"]["labels"]["gpu-node-agent.io/nvlink.largest-group"] == "8"
    devices = view["devices"]["nvidia.com/gpu"]
    assert [(d["health"], d["numa"]) for d in devices] == [("Healthy", 0)] * 4 + [("Healthy", 1)] * 4
    assert len({d["id"] for d in devices}) == 8


def test_simulate_shows_what_nvidias_mps_example_gives_with_its_daemons_simulated() -> None:
    """NVIDIA's MPS example (10 replicas) on a simulated DGX H100: the driver's MPS control daemons are simulated
    too, so the node offers 80 nvidia.com/gpu, as the example's README says, and nothing is withheld."""
    example = Path(__file__).parents[1] / "fixtures" / "nvidia" / "mps-10.yaml"
    done = gpu_agent("simulate", "--node", "dgx-h100", "--config", str(example), "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["node"]["capacity"] == {"nvidia.com/gpu": "80"}
    assert view["node"]["allocatable"] == {"nvidia.com/gpu": "80"}
    labels = view["node"]["labels"]
    assert (labels["nvidia.com/gpu.sharing-strategy"], labels["nvidia.com/gpu.replicas"],
            labels["nvidia.com/gpu.product"]) == ("mps", "10", "NVIDIA-H100-80GB-HBM3-SHARED")
    assert view["events"] == []
    devices = view["devices"]["nvidia.com/gpu"]
    assert len(devices) == 80 and len({d["id"].split("::")[0] for d in devices}) == 8


def test_simulate_text_looks_like_describe_node() -> None:
    done = gpu_agent("simulate", "--node", "pcie-l40s-4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Name:               sim-pcie-l40s-4"
    capacity = lines.index("Capacity:")
    assert lines[capacity + 1 : capacity + 4] == ["  nvidia.com/gpu:  4", "Allocatable:", "  nvidia.com/gpu:  4"]
    assert "Taints:             <none>" in lines


@pytest.mark.parametrize(
    ("args", "code", "first_words"),
    [
        (["simulate", "--node", "no-such-node"], 1, "gpu-agent simulate: error: unknown node preset 'no-such-node'"),
        (["run", "--nvml", "mock:single-h200", "--kubelet-dir", "/nonexistent/dir", "--no-kube"], 1,
         "gpu-agent run: error: kubelet directory /nonexistent/dir does not exist (set --kubelet-dir)"),
        (["run", "--nvml", "fake", "--kubelet-dir", "/tmp", "--no-kube"], 1,
         "gpu-agent run: error: --nvml must be 'real', 'mock:PRESET' or 'mock:FILE', got 'fake'"),
        (["run", "--kubelet-dir", "/tmp", "--nvml", "mock:single-h200"], 1,
         "gpu-agent run: error: the node name is unknown: set NODE_NAME or --node-name (or run with --no-kube)"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], code: int, first_words: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    done = subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == code
    assert done.stderr.startswith(first_words)
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


def test_bad_config_file_is_named(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n  plugin:\n    deviceIDStrategy: serial\n")
    done = gpu_agent("run", "--config", str(config), "--kubelet-dir", "/tmp", "--no-kube")
    assert done.returncode == 2
    assert done.stderr == (
        f"gpu-agent run: error: {config}: flags.plugin.deviceIDStrategy: got 'serial'; expected 'uuid' or 'index'\n"
    )


def test_malformed_node_file_is_named(tmp_path: Path) -> None:
    node = tmp_path / "node.yaml"
    node.write_text("version: v1\ngpus:\n  - {model: H100-SXM5-80GB, numa_node: 0, colour: green}\n")
    done = gpu_agent("simulate", "--node", str(node))
    assert done.returncode == 1
    assert "gpus[0].colour" in done.stderr or "gpus.0.colour" in done.stderr
    assert "Traceback" not in done.stderr


def test_inspect_json_reports_topology_and_pair_scores() -> None:
    done = gpu_agent("inspect", "--nvml", "mock:a100-pcie-nvlink-pairs", "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert [g["numa_node"] for g in view["gpus"]] == [0, 0, 1, 1]
    nvlinked = sorted(tuple(link["gpus"]) for link in view["links"] if link["nvlink"])
    assert nvlinked == [(0, 1), (2, 3)]
    assert "pair_scores" in view


async def test_sigterm_removes_the_socket_and_exits_zero() -> None:
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    proc = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--nvml", "mock:single-h200", "--kubelet-dir", str(directory), "--no-kube",
        "--metrics-port", "0", stderr=asyncio.subprocess.PIPE,
    )
    try:
        await kubelet.wait_for({"nvidia.com/gpu"}, 30)
        socket = directory / kubelet.plugins["nvidia.com/gpu"].endpoint
        assert socket.is_socket()
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
        assert proc.returncode == 0, stderr.decode()
        assert not socket.exists()
        assert b"Traceback" not in stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


async def test_nvidias_health_variables_ignore_and_enable_xids_in_a_running_agent(tmp_path: Path) -> None:
    """A DaemonSet moved over from NVIDIA's device plugin keeps its health variables: with
    DP_DISABLE_HEALTHCHECKS=48 an XID 48 (double-bit ECC) leaves its GPU healthy, and with
    DP_ENABLE_HEALTHCHECKS=13 an XID 13 (an application error, ignored by default) marks its GPU unhealthy."""
    node = ["--nvml", "mock:dgx-h100", "--mock-state", str(tmp_path / "gpus.json")]
    gpus = json.loads(gpu_agent("inspect", *node, "--json").stdout)["gpus"]
    uuid = {g["index"]: g["uuid"] for g in gpus}
    (tmp_path / "config.yaml").write_text("version: v1\nhealth:\n  sampleIntervalSeconds: 0.1\n")
    directory = short_dir()
    kubelet = StandInKubelet(directory)
    await kubelet.start()
    env = {**os.environ, "DP_DISABLE_HEALTHCHECKS": "48", "DP_ENABLE_HEALTHCHECKS": " 13 "}
    proc = await asyncio.create_subprocess_exec(
        *AGENT, "run", *node, "--kubelet-dir", str(directory), "--no-kube", "--metrics-port", "0",
        "--config", str(tmp_path / "config.yaml"), stderr=asyncio.subprocess.PIPE, env=env)
    assert proc.stderr is not None
    lines: list[str] = []
    reader = asyncio.create_task(collect_lines(proc.stderr, lines))

    def unhealthy() -> list[str]:
        return sorted(d.ID for d in kubelet.plugins["nvidia.com/gpu"].devices if d.health != "Healthy")

    try:
        await kubelet.wait_for({"nvidia.com/gpu"}, 30)
        assert unhealthy() == []
        # 48 first: the agent takes XIDs in order, so once GPU 5 shows unhealthy, 48 has been judged too.
        for gpu, xid in ((2, 48), (5, 13)):
            done = gpu_agent("fault", *node, "xid", str(gpu), str(xid))
            assert done.returncode == 0, done.stderr
        async with kubelet.changed, asyncio.timeout(15):
            await kubelet.changed.wait_for(lambda: unhealthy() != [])
        await wait_until(lambda: any(line.endswith(f": GPU {uuid[2]}: XID 48 ignored by policy") for line in lines),
                         5, "the agent to log XID 48 on GPU 2 as ignored")
        assert unhealthy() == [uuid[5]]
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
        await asyncio.wait_for(reader, 5)
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    log = "\n".join(lines)
    assert "DP_DISABLE_HEALTHCHECKS=48: XIDs 48 ignored" in log
    assert "DP_ENABLE_HEALTHCHECKS= 13 : XID 13 unhealthy" in log


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    shell = f"{sys.executable} -m agent.cli mig plan --nvml mock:hgx-16-nvswitch --layout all-1g.10gb | head -n 1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "GPU 0: enable MIG\n", "")


# --- the kubelet's PodResources socket (mig.podResourcesSocket), checked at start ---------------------------


def pod_resources_config(tmp_path: Path, socket: Path) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nmig:\n  stateDir: {tmp_path / 'state'}\n  podResourcesSocket: {socket}\n")
    return config


@pytest.mark.parametrize(("make", "line"), [
    ("file", "mig.podResourcesSocket {socket} is a regular file, not a socket: set it to the kubelet's PodResources "
             "socket (<kubelet root>/pod-resources/kubelet.sock)"),
    ("dir", "mig.podResourcesSocket {socket} is a directory, not a socket: set it to the kubelet's PodResources "
            "socket (<kubelet root>/pod-resources/kubelet.sock)"),
    ("fifo", "mig.podResourcesSocket {socket} is a FIFO, not a socket: set it to the kubelet's PodResources socket "
             "(<kubelet root>/pod-resources/kubelet.sock)"),
    ("parent-file", "mig.podResourcesSocket {socket}: {parent} is a regular file, not a directory"),
    ("no-parent", "mig.podResourcesSocket {socket}: the directory {parent} does not exist (the kubelet makes its "
                  "socket in <kubelet root>/pod-resources; mount that directory into the container)"),
])
def test_a_pod_resources_path_that_cannot_be_the_socket_is_refused(make: str, line: str, tmp_path: Path) -> None:
    parent = tmp_path / "pod-resources"
    socket = parent / "kubelet.sock"
    if make == "parent-file":
        parent.write_text("")
    elif make != "no-parent":
        parent.mkdir()
        if make == "file":
            socket.write_text("")
        elif make == "dir":
            socket.mkdir()
        else:
            os.mkfifo(socket)
    kubelet_dir = short_dir()
    try:
        done = gpu_agent("run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir),
                         "--metrics-port", "0", "--config", str(pod_resources_config(tmp_path, socket)))
    finally:
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"gpu-agent run: error: {line.format(socket=socket, parent=parent)}\n"
    assert not (tmp_path / "state").exists()  # nothing was started or made


def started_lines(config: Path, kubelet_dir: Path | None = None) -> list[str]:
    """The agent's log up to its start line, then SIGTERM; it exits 0. The kubelet directory is removed after."""
    kubelet_dir = kubelet_dir or short_dir()
    proc = subprocess.Popen([*AGENT, "run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir",
                             str(kubelet_dir), "--metrics-port", "0", "--config", str(config)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if "agent started:" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    assert proc.returncode == 0, lines
    assert "agent started:" in lines[-1], lines
    return lines


def test_a_pod_resources_socket_not_there_yet_is_one_warning(tmp_path: Path) -> None:
    (tmp_path / "pod-resources").mkdir()
    socket = tmp_path / "pod-resources" / "kubelet.sock"
    lines = started_lines(pod_resources_config(tmp_path, socket))
    said = [line.split(" agent.podresources: ", 1) for line in lines if " agent.podresources: " in line]
    assert [(head.split()[-1], text) for head, text in said] == [(
        "WARNING", f"mig.podResourcesSocket {socket} does not exist yet (the kubelet makes it): until it does, MIG "
                   "changes do not check for pods on the GPUs and GPU metrics carry no pod labels")]


def test_without_a_socket_in_the_config_the_one_beside_the_kubelet_directory_is_used(tmp_path: Path) -> None:
    # A kubelet whose root is not /var/lib/kubelet (k0s, MicroK8s): --kubelet-dir alone points the agent at it.
    root = short_dir()
    (root / "device-plugins").mkdir()
    (root / "pod-resources").mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nmig:\n  stateDir: {tmp_path / 'state'}\n")
    try:
        lines = started_lines(config, root / "device-plugins")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    said = [line.split(" agent.podresources: ", 1)[1] for line in lines if " agent.podresources: " in line]
    assert said == [
        f"mig.podResourcesSocket {root}/pod-resources/kubelet.sock does not exist yet (the kubelet makes it): until "
        "it does, MIG changes do not check for pods on the GPUs and GPU metrics carry no pod labels"]


def test_a_pod_resources_socket_that_is_there_is_not_mentioned(tmp_path: Path) -> None:
    import socket as sockets

    directory = short_dir()
    path = directory / "kubelet.sock"
    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    try:
        listener.bind(str(path))
        lines = started_lines(pod_resources_config(tmp_path, path))
    finally:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)
    assert not [line for line in lines if "agent.podresources" in line], lines
