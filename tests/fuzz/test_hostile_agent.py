"""A hostile or careless operator against a running agent: a reloaded config gets exactly the checks start gives
it (the same one-line refusals, the last good config kept), and an input that is not a file is never waited on."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import load_config
from tests.builders import AGENT, one_line, run_agent
from tests.plugin_harness import running_agent, short_dir, wait_until

IMEX_CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    directory = short_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def too_long_for(directory: Path) -> tuple[str, str]:
    """A time-slicing rename whose socket name does not fit under `directory`, and the line that refuses it."""
    rename = "example.com/" + "a" * 63
    room = 107 - len(str(directory)) - 1
    line = (f"kubelet directory {directory} is {len(str(directory))} bytes long: a socket path holds at most 107 "
            f"bytes, which leaves {room} for the name of {rename}'s socket, and it needs 106 (use a shorter "
            "--kubelet-dir)")
    return (f"version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
            f"      rename: {rename}\n"), line


async def reload_refused(tmp_path: Path, bad: str, directory: Path | None = None) -> str:
    """Start an agent on a good config file, write `bad` over it and reload: the message of the ConfigRejected
    incident, once checked that the agent still serves the config it had."""
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    async with running_agent("single-h200", load_config(path), config_path=path, directory=directory) as rig:
        before = rig.agent.bus.current.config
        path.write_text(bad)
        assert await rig.agent.reload_config() is False
        assert rig.agent.bus.current.config == before
        assert sorted(rig.agent.plugins.plugins) == ["nvidia.com/gpu"]
        incident = rig.agent.bus.current.incidents[-1]
        assert incident.kind == "config-rejected"
        return incident.message


async def test_a_rename_too_long_for_its_socket_is_refused_at_reload_as_at_start(tmp_path: Path,
                                                                                 kubelet_dir: Path) -> None:
    config, line = too_long_for(kubelet_dir)
    (tmp_path / "bad.yaml").write_text(config)
    assert one_line(run_agent(kubelet_dir, "--config", str(tmp_path / "bad.yaml"))) == f"gpu-agent run: error: {line}"
    message = await reload_refused(tmp_path, config, directory=kubelet_dir)
    assert message == f"config reload rejected: {line}"


@pytest.mark.skipif(os.path.exists(IMEX_CHANNEL), reason="this machine has an IMEX channel")
async def test_imex_required_without_the_channel_is_refused_at_reload_as_at_start(tmp_path: Path,
                                                                                  kubelet_dir: Path) -> None:
    config = "version: v1\nimex:\n  channelIDs: [0]\n  required: true\n"
    (tmp_path / "bad.yaml").write_text(config)
    line = f"imex.required is true but the IMEX channel {IMEX_CHANNEL} does not exist"
    assert one_line(run_agent(kubelet_dir, "--config", str(tmp_path / "bad.yaml"))) == f"gpu-agent run: error: {line}"
    assert await reload_refused(tmp_path, config) == f"config reload rejected: {tmp_path / 'config.yaml'}: {line}"


async def test_a_pod_resources_socket_that_is_a_file_is_refused_at_reload_as_at_start(tmp_path: Path,
                                                                                      kubelet_dir: Path) -> None:
    not_a_socket = tmp_path / "kubelet.sock"
    not_a_socket.write_text("")
    config = f"version: v1\nmig:\n  podResourcesSocket: {not_a_socket}\n"
    (tmp_path / "bad.yaml").write_text(config)
    line = (f"mig.podResourcesSocket {not_a_socket} is a regular file, not a socket: set it to the kubelet's "
            "PodResources socket (<kubelet root>/pod-resources/kubelet.sock)")
    assert one_line(run_agent(kubelet_dir, "--config", str(tmp_path / "bad.yaml"))) == f"gpu-agent run: error: {line}"
    assert await reload_refused(tmp_path, config) == f"config reload rejected: {line}"


async def test_dra_enabled_flipped_by_a_reload_without_an_api_server_takes_the_gpus_off_the_device_plugin_and_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    async with running_agent("single-h200", load_config(path), config_path=path) as rig:
        path.write_text("version: v1\ndra:\n  enabled: true\n")
        assert await rig.agent.reload_config() is True
        # DRA mode: whole GPUs are DRA's; with no API server nothing publishes them, and the log says so once.
        await wait_until(lambda: "nvidia.com/gpu" not in rig.agent.plugins.plugins, 10, "nvidia.com/gpu stopped")
        assert rig.agent.dra is None
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            "DRA mode: no API server client; no ResourceSlice is published"]
        path.write_text("version: v1\n")
        assert await rig.agent.reload_config() is True
        await rig.kubelet.wait_for({"nvidia.com/gpu"}, 10)
        await wait_until(lambda: len(rig.devices()) == 1, 10, "the GPU through the device plugin again")
        assert [i.message for i in rig.agent.bus.current.incidents if i.kind == "mode-switched"] == [
            "switching to DRA mode with the pods on the GPUs kept",
            "switching to device-plugin mode with the pods on the GPUs kept"]


async def test_a_switch_to_dra_whose_sockets_do_not_fit_is_refused_at_reload_as_at_start(tmp_path: Path) -> None:
    top = short_dir()
    try:
        kubelet_dir = top / ("k" * 20) / "device-plugins"
        kubelet_dir.mkdir(parents=True)
        root = kubelet_dir.parent
        # Its registration socket would fit as this agent, without POD_UID, names it (<root>/plugins_registry/
        # gpu.example.com-reg.sock, 79 bytes), but not with the Pod UID the next rolling update gives it.
        driver = "gpu.example.com"
        assert len(str(root / "plugins_registry" / f"{driver}-reg.sock")) == len(str(root)) + 42 < 107
        message = await reload_refused(tmp_path, f"version: v1\ndra:\n  enabled: true\n  driverName: {driver}\n",
                                       directory=kubelet_dir)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    # <root>/plugins_registry/<driver>-<36-character UID>-reg.sock: the root, 18 + 1 + 36 + 9 bytes and the name.
    fits, length = 107 - len(str(root)) - 64, len(str(root)) + 64 + len(driver)
    assert message == (
        f"config reload rejected: dra.driverName {driver} is 15 characters, and at most {fits} fit under {root}: "
        f"with the agent Pod's UID in its name (as in a rolling update), its socket "
        f"{root}/plugins_registry/{driver}-<pod-uid>-reg.sock would be {length} bytes long, and a socket path holds "
        f"at most 107 (use a dra.driverName of at most {fits} characters, or a shorter kubelet directory)")


async def test_a_machine_type_file_that_is_a_fifo_is_not_waited_on(tmp_path: Path, kubelet_dir: Path) -> None:
    fifo = tmp_path / "product_name"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nflags:\n  gfd:\n    machineTypeFile: {fifo}\n")
    agent = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir),
        "--metrics-port", "0", "--config", str(config), stderr=asyncio.subprocess.PIPE)
    assert agent.stderr is not None
    lines: list[str] = []
    try:
        while not lines or "agent started" not in lines[-1]:
            lines.append((await asyncio.wait_for(agent.stderr.readline(), 20)).decode())
    finally:
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 15) == 0
    warnings = [line.split(": ", 1)[1].rstrip("\n") for line in lines if " WARNING " in line]
    assert warnings == [f"cannot read the machine type from {fifo}: is a FIFO, not a regular file; "
                        "nvidia.com/gpu.machine is unknown"]


async def agent_lines(argv: list[str], until: str, timeout: float = 20) -> list[str]:
    """Run `argv` (an agent), collect its log lines until one contains `until`, then stop it with SIGTERM and
    check that it exits 0."""
    agent = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
    assert agent.stderr is not None
    lines: list[str] = []
    try:
        while not lines or until not in lines[-1]:
            line = (await asyncio.wait_for(agent.stderr.readline(), timeout)).decode()
            assert line, f"the agent ended before saying {until!r}: {lines}"
            lines.append(line)
    finally:
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 15) == 0
    return lines


def message(line: str) -> str:
    """A text log line's message (after 'LEVEL logger: ')."""
    return line.split(": ", 1)[1].rstrip("\n")


@pytest.mark.parametrize("kind", ["a regular file", "a directory"])
async def test_a_kubelet_socket_that_is_not_a_socket_is_named(kubelet_dir: Path, kind: str) -> None:
    impostor = kubelet_dir / "kubelet.sock"
    if kind == "a directory":
        impostor.mkdir()
    else:
        impostor.write_text("")
    lines = await agent_lines([*AGENT, "run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir",
                               str(kubelet_dir), "--metrics-port", "0"], "not the kubelet's socket")
    assert message(lines[-1]) == (f"{impostor} is {kind}, not the kubelet's socket; waiting for the kubelet to make "
                                  "its socket there")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare(1)")
async def test_a_plugin_socket_that_cannot_be_made_says_why(kubelet_dir: Path) -> None:
    """In a mount namespace of its own, the kubelet directory is a read-only tmpfs holding the kubelet's socket:
    the agent's socket cannot be made, and the line says so (it once said only "cannot listen")."""
    make_kubelet = (f"import socket; socket.socket(socket.AF_UNIX).bind({str(kubelet_dir / 'kubelet.sock')!r})")
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs none "$0" && "$1" -c "$2" && mount -o remount,ro "$0" && shift 2 && exec "$@"',
            str(kubelet_dir), AGENT[0], make_kubelet, *AGENT, "run", "--no-kube", "--nvml", "mock:single-h200",
            "--kubelet-dir", str(kubelet_dir), "--metrics-port", "0"]
    lines = await agent_lines(argv, "registration of nvidia.com/gpu with the kubelet failed")
    text = message(lines[-1])
    prefix = (f"registration of nvidia.com/gpu with the kubelet failed, retrying in 0.5s: cannot listen on "
              f"{kubelet_dir}/gpu-agent-")
    assert text.startswith(prefix) and text.endswith(".sock: Read-only file system"), text


def test_an_address_this_machine_does_not_have_blames_the_address_not_the_port(kubelet_dir: Path) -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine.
    result = run_agent(kubelet_dir, "--metrics-address", "192.0.2.1")
    assert one_line(result) == ("gpu-agent run: error: cannot serve metrics on 192.0.2.1:0: Cannot assign requested "
                                "address (check --metrics-address)")
