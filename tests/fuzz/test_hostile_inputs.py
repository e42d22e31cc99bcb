"""What a hostile or careless user can hand the agent, through the real CLI and a running agent (real files,
FIFOs, sockets and signals): each case gives one clear line and changes nothing, with no traceback anywhere."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import signal
import socket
from pathlib import Path

import grpc
import pytest

from agent.deviceplugin.v1beta1 import api_pb2
from tests.builders import AGENT, gpu_agent, one_line, run_agent
from tests.plugin_harness import running_agent, wait_until

# --- files that are not what they claim to be ----------------------------------------------------------


def test_a_config_that_is_not_utf8_is_one_line_for_simulate_and_run(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_bytes(b"version: v1\nflags:\n  migStrategy: \xff\xfe\n")
    expected = f"{config}: cannot read config: not UTF-8 text (byte 0xff at line 3)"
    assert one_line(gpu_agent("simulate", "--node", "single-h200", "--config", str(config))) == (
        f"gpu-agent simulate: error: {expected}")
    assert one_line(run_agent(kubelet_dir, "--config", str(config))) == f"gpu-agent run: error: {expected}"


def test_a_fifo_and_a_device_are_refused_without_reading_them(tmp_path: Path, kubelet_dir: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)  # opening a FIFO for reading would wait for a writer forever
    assert one_line(run_agent(kubelet_dir, "--config", str(fifo))) == (
        f"gpu-agent run: error: {fifo}: cannot read config: is a FIFO, not a regular file")
    assert one_line(run_agent(kubelet_dir, "--config", "/dev/zero")) == (
        "gpu-agent run: error: /dev/zero: cannot read config: is a device, not a regular file")
    layouts = gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", "/dev/zero",
                        "--layout", "all-balanced")
    assert one_line(layouts) == "gpu-agent mig: error: /dev/zero: is a device, not a regular file"


def test_a_huge_config_is_refused_by_size(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    with config.open("wb") as f:
        f.truncate(9 * 1024 * 1024)
    assert one_line(run_agent(kubelet_dir, "--config", str(config))) == (
        f"gpu-agent run: error: {config}: cannot read config: larger than 64 KiB; not read")


def test_twelve_hundred_layouts_and_an_unknown_name_give_a_short_line(tmp_path: Path) -> None:
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text("version: v1\nmig-configs:\n" + "".join(
        f"  l{i}:\n    - devices: all\n      mig-enabled: false\n" for i in range(1200)))
    assert layouts.stat().st_size < 64 * 1024  # within the size limit
    line = one_line(gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(layouts),
                              "--layout", "nope"))
    assert line == (f"gpu-agent mig: error: {layouts}: no layout named 'nope' (known: "
                    + ", ".join(f"l{i}" for i in range(40)) + " and 1160 more)")


@pytest.mark.parametrize(("content", "reason"), [
    (b"{\n", "not JSON (Expecting property name enclosed in double quotes at line 2, column 1); delete it to "
             "start the simulated node afresh"),
    (b"{}", "not a fake NVML state file (no 'format' and 'gpus'); delete it to start the simulated node afresh"),
    (b'{"format": 1, "gpus": {}, "node": "dgx-h100"}', "written for node 'dgx-h100', not 'single-h200'"),
    (b'{"format": 2, "gpus": {}}', "format: input should be 1; delete it to start the simulated node afresh"),
    (b"\xff", "not UTF-8 text (byte 0xff at line 1)"),
])
def test_a_corrupt_mock_state_is_one_line(tmp_path: Path, content: bytes, reason: str) -> None:
    state = tmp_path / "nvml.json"
    state.write_bytes(content)
    result = gpu_agent("inspect", "--nvml", "mock:single-h200", "--mock-state", str(state))
    assert one_line(result) == f"gpu-agent inspect: error: mock state {state}: {reason}"
    assert state.read_bytes() == content


def test_a_mock_state_that_cannot_be_written_names_itself(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    state = blocker / "nvml.json"
    result = gpu_agent("mig", "apply", "--nvml", "mock:single-h200", "--mock-state", str(state), "--layout",
                       "all-balanced", "--state-dir", str(tmp_path / "state"))
    assert result.stderr.strip().splitlines()[-1] == (
        f"gpu-agent mig: error: mock state {state}: cannot write it: {blocker} is not a directory")
    assert "Traceback" not in result.stderr


def test_a_mock_state_behind_a_symlink_updates_the_target(tmp_path: Path) -> None:
    target = tmp_path / "real" / "nvml.json"
    target.parent.mkdir()
    link = tmp_path / "nvml.json"
    link.symlink_to(target)
    applied = gpu_agent("mig", "apply", "--nvml", "mock:single-h200", "--mock-state", str(link), "--layout",
                        "all-balanced", "--state-dir", str(tmp_path / "state"))
    assert applied.returncode == 0, applied.stderr
    assert link.is_symlink() and link.resolve() == target
    assert json.loads(target.read_text())["format"] == 1
    checked = gpu_agent("mig", "assert", "--nvml", "mock:single-h200", "--mock-state", str(target), "--layout",
                        "all-balanced")
    assert (checked.returncode, checked.stdout) == (0, "layout 'all-balanced' is applied\n")


@pytest.mark.parametrize(("kubeconfig", "reason"), [
    ("apiVersion: v1\n", "no current-context (set one with kubectl config use-context)"),
    ("current-context: prod\n", "no context named 'prod'"),
    ("current-context: prod\ncontexts: [{name: prod, context: {cluster: c1}}]\n", "no cluster named 'c1'"),
    ("current-context: prod\ncontexts: [{name: prod, context: {cluster: c1}}]\nclusters: [{name: c1}]\n",
     "cluster 'c1' has no server"),
    ("- a list\n", "not a kubeconfig (expected a mapping)"),
])
def test_kubeconfig_problems_are_worded_for_the_user(tmp_path: Path, kubelet_dir: Path, kubeconfig: str,
                                                     reason: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig)
    result = gpu_agent("run", "--kubeconfig", str(path), "--node-name", "n1", "--nvml", "mock:single-h200",
                       "--kubelet-dir", str(kubelet_dir), "--metrics-port", "0", timeout=30)
    assert one_line(result) == f"gpu-agent run: error: cannot load API server credentials: kubeconfig {path}: {reason}"


# --- start-up problems ----------------------------------------------------------------------------------


def test_a_metrics_port_in_use_is_one_line(kubelet_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = gpu_agent("run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir),
                           "--metrics-port", str(port), "--metrics-address", "127.0.0.1", timeout=30)
    assert one_line(result) == (f"gpu-agent run: error: cannot serve metrics on 127.0.0.1:{port}: Address already "
                                "in use (choose another --metrics-port)")


def test_a_kubelet_dir_too_long_for_socket_paths_is_one_line(tmp_path: Path) -> None:
    directory = Path("/tmp") / ("k" * 70)
    directory.mkdir(exist_ok=True)
    try:
        result = run_agent(directory)
    finally:
        shutil.rmtree(directory)
    assert one_line(result) == (
        f"gpu-agent run: error: kubelet directory {directory} is 75 bytes long: a socket path holds at most 107 "
        "bytes, which leaves 31 for the name of nvidia.com/gpu's socket, and it needs 45 (use a shorter "
        "--kubelet-dir)")


def test_config_paths_needed_later_are_checked_at_start(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nmig:\n  layoutsFile: {tmp_path}/missing.yaml\n")
    assert one_line(run_agent(kubelet_dir, "--config", str(config))) == (
        f"gpu-agent run: error: mig.layoutsFile: {tmp_path}/missing.yaml: no such file")
    (tmp_path / "file").write_text("")
    config.write_text(f"version: v1\nmig:\n  stateDir: {tmp_path}/file/state\n")
    assert one_line(run_agent(kubelet_dir, "--config", str(config))) == (
        f"gpu-agent run: error: mig.stateDir {tmp_path}/file/state: {tmp_path}/file is not a directory")


def test_limits_are_worded_by_the_agent(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                      "    - {name: nvidia.com/gpu, replicas: 5000}\nhealth:\n  recoveryChecks: often\n")
    result = run_agent(kubelet_dir, "--config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"gpu-agent run: error: {config}: sharing.timeSlicing.resources[0].replicas: got 5000; must be at most 1024",
        f"{config}: health.recoveryChecks: got 'often'; must be a whole number",
    ]


# --- a second actor -------------------------------------------------------------------------------------


async def first_agent(kubelet_dir: Path) -> asyncio.subprocess.Process:
    """`gpu-agent run` on `kubelet_dir`, once it has started (its lines after that stay in its stderr pipe)."""
    first = await asyncio.create_subprocess_exec(
        *AGENT, "run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir),
        "--metrics-port", "0", stderr=asyncio.subprocess.PIPE)
    assert first.stderr is not None
    while b"agent started" not in await asyncio.wait_for(first.stderr.readline(), 20):
        pass
    return first


async def line_with(process: asyncio.subprocess.Process, text: str, timeout: float = 10) -> str:
    assert process.stderr is not None
    seen = []
    try:
        async with asyncio.timeout(timeout):
            while text not in (line := (await process.stderr.readline()).decode()):
                assert line, f"the agent's stderr ended without {text!r}"
                seen.append(line)
    except TimeoutError:
        raise AssertionError(f"no line with {text!r} within {timeout}s; the agent said: {''.join(seen)}") from None
    return line.rstrip("\n")


@pytest.mark.parametrize("replaced", [False, True], ids=["as-started", "replaced"])
async def test_a_second_agent_on_the_kubelet_dir_is_refused_naming_the_first(kubelet_dir: Path,
                                                                              replaced: bool) -> None:
    """Also once the kubelet directory was removed and made again: the first agent follows it and takes its lock,
    so a second one started there is refused as on the directory the first started on."""
    first = await first_agent(kubelet_dir)
    try:
        if replaced:
            shutil.rmtree(kubelet_dir)
            kubelet_dir.mkdir()
            await line_with(first, "was replaced; holding its lock now")
        second = await asyncio.to_thread(run_agent, kubelet_dir)
        assert one_line(second) == (f"gpu-agent run: error: another agent serves the kubelet directory "
                                    f"{kubelet_dir}: pid {first.pid} holds the lock on {kubelet_dir}")
    finally:
        first.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(first.wait(), 15) == 0


async def test_an_agent_whose_replaced_kubelet_dir_another_holds_stops_and_exits_non_zero(kubelet_dir: Path) -> None:
    """The directory that replaces the kubelet directory is locked by another process before the agent sees it:
    the agent serves nothing there, says so in one line naming the holder, and exits non-zero (the DaemonSet
    restarts it, and it waits for the lock like any second agent)."""
    first = await first_agent(kubelet_dir)
    try:
        shutil.rmtree(kubelet_dir)
        made = kubelet_dir.with_name(kubelet_dir.name + ".new")
        made.mkdir()
        fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            made.rename(kubelet_dir)  # made and locked in one step, as far as the agent can tell
            line = await line_with(first, "was replaced")
            assert line.split(": ", 1)[1] == (
                f"the kubelet directory {kubelet_dir} was replaced and another agent serves the kubelet directory "
                f"{kubelet_dir}: pid {os.getpid()} holds the lock on {kubelet_dir}; this agent serves nothing "
                "there; stopping")
            assert await asyncio.wait_for(first.wait(), 15) == 1
            assert [p.name for p in kubelet_dir.iterdir()] == []
        finally:
            os.close(fd)
    finally:
        if first.returncode is None:
            first.kill()
            await first.wait()


def test_a_second_mig_apply_is_refused_naming_the_first(tmp_path: Path) -> None:
    from agent.locks import mig_apply_lock

    state_dir = tmp_path / "state"
    with mig_apply_lock(state_dir):
        result = gpu_agent("mig", "apply", "--nvml", "mock:single-h200", "--mock-state", str(tmp_path / "s.json"),
                           "--layout", "all-balanced", "--state-dir", str(state_dir))
    assert one_line(result) == ("gpu-agent mig: error: another MIG apply is running on this node: "
                                f"pid {os.getpid()} holds the lock on {state_dir}")
    assert not (tmp_path / "s.json").exists()  # nothing was touched


# --- a running agent ------------------------------------------------------------------------------------


async def test_a_mock_state_corrupted_under_a_running_agent_makes_it_unready_with_one_line(tmp_path: Path) -> None:
    from agent.nvml.fake import FakeNvml
    from agent.nvml.nodefile import load_node

    state = tmp_path / "nvml.json"
    fake = FakeNvml(load_node("single-h200"), state)
    fake.set_driver_loaded(True)  # writes the state file, as any change to the simulated node does
    good = state.read_bytes()
    async with running_agent("single-h200", fake=fake) as rig:
        assert rig.agent.ready() == (True, "ok")
        state.write_text("{ truncated")
        reason = (f"mock state {state}: not JSON (Expecting property name enclosed in double quotes at line 1, "
                  "column 3); delete it to start the simulated node afresh")
        await wait_until(lambda: rig.agent.ready() == (False, reason), 15, "the agent unready")
        state.write_bytes(good)
        await wait_until(lambda: rig.agent.ready() == (True, "ok"), 15, "the agent ready again")


async def test_deleting_a_broken_mock_state_as_its_line_advises_makes_the_agent_ready(tmp_path: Path) -> None:
    from agent.nvml.fake import FakeNvml
    from agent.nvml.nodefile import load_node

    state = tmp_path / "nvml.json"
    fake = FakeNvml(load_node("single-h200"), state)
    fake.set_driver_loaded(True)
    fake.inject_xid(0, 31)  # an application's XID: the event log has a record, the GPU stays healthy
    async with running_agent("single-h200", fake=fake) as rig:
        state.write_text("[]")
        reason = (f"mock state {state}: not a fake NVML state file (no 'format' and 'gpus'); delete it to start "
                  "the simulated node afresh")
        await wait_until(lambda: rig.agent.ready() == (False, reason), 15, "the agent unready")
        state.unlink()
        await wait_until(lambda: rig.agent.ready() == (True, "ok"), 15, "the agent ready again")
        assert rig.health() == ["Healthy"]
        # The fresh node's events are seen too: another process writes the first one into a new file.
        FakeNvml(load_node("single-h200"), state).inject_xid(0, 79)
        await wait_until(lambda: rig.health() == ["Unhealthy"], 15, "GPU 0 unhealthy after XID 79")


async def test_preferred_allocation_refuses_a_must_include_device_not_offered() -> None:
    async with running_agent("dgx-h100") as rig:
        ids = [d.ID for d in rig.devices()]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rig.stub().GetPreferredAllocation(api_pb2.PreferredAllocationRequest(container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids[:4],
                                                            must_include_deviceIDs=[ids[6]], allocation_size=2)]))
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"must-include device {ids[6]} of nvidia.com/gpu is not among the available devices")


async def http(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def test_the_metrics_endpoint_answers_abuse_with_4xx_and_no_traceback(caplog: pytest.LogCaptureFixture
                                                                           ) -> None:
    async with running_agent("single-h200", metrics_port=0) as rig:
        assert rig.agent.http is not None
        port = rig.agent.http.port
        for _ in range(20):
            assert (await http(port, b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n")).startswith(
                b"HTTP/1.0 431 Request Header Fields Too Large\r\n")
        post = await http(port, b"POST /metrics HTTP/1.0\r\n\r\n")
        assert post.startswith(b"HTTP/1.0 405 Method Not Allowed\r\n") and b"Allow: GET, HEAD\r\n" in post
        assert (await http(port, b"garbage\r\n\r\n")).startswith(b"HTTP/1.0 400 Bad Request\r\n")
        head = await http(port, b"HEAD /healthz HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        got = await http(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.34\r\n\r\n")
        assert got.endswith(b"\r\n\r\nok\n")
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


async def test_a_task_failing_with_a_one_line_error_logs_that_line_not_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    from agent.agent import supervise
    from agent.config import ConfigError
    from agent.metrics import Metrics

    runs: list[int] = []

    async def task() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise ConfigError("cfg.yaml: flags.migStrategy: got 'split'; expected 'none', 'single' or 'mixed'")
        await asyncio.Event().wait()

    metrics = Metrics()
    running = asyncio.create_task(supervise("config-reload", task, metrics))
    await wait_until(lambda: len(runs) == 2, 5, "the task restarted")
    running.cancel()
    (record,) = [r for r in caplog.records if r.name == "agent.daemon"]
    assert (record.levelname, record.exc_info, record.getMessage()) == (
        "ERROR", None, "task config-reload failed: cfg.yaml: flags.migStrategy: got 'split'; expected 'none', "
                       "'single' or 'mixed'; restarting in 0.5s")


async def test_sigterm_in_the_middle_of_mig_apply_stops_between_changes_and_says_how_to_finish(tmp_path: Path,
                                                                                               ) -> None:
    state, state_dir = tmp_path / "nvml.json", tmp_path / "state"
    args = ["--nvml", "mock:hgx-16-nvswitch", "--mock-state", str(state), "--layout", "all-1g.10gb"]
    total = gpu_agent("mig", "plan", *args).stdout.splitlines()
    proc = await asyncio.create_subprocess_exec(*AGENT, "mig", "apply", *args, "--state-dir", str(state_dir),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = await asyncio.wait_for(proc.stdout.readline(), 30)
    proc.send_signal(signal.SIGSTOP)  # hold it where it is, so the SIGTERM lands mid-apply
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    printed = [first.decode().rstrip("\n"), *out.decode().splitlines()]
    assert proc.returncode == 143
    taken = len(printed)
    assert 1 <= taken < len(total) and printed == total[:taken]
    assert err.decode().splitlines() == [
        f"gpu-agent mig: interrupted by SIGTERM after {taken} change(s) (the last: {printed[-1]}); layout "
        f"'all-1g.10gb' is partly applied and its journal is in {state_dir}: run `gpu-agent mig apply --layout "
        "all-1g.10gb` again to finish (`gpu-agent mig plan --layout all-1g.10gb` shows what is left)"]
    assert (state_dir / "mig-journal.json").exists()
    # What plan shows is what the next apply does, and that apply finishes the layout.
    left = gpu_agent("mig", "plan", *args).stdout.splitlines()
    finished = gpu_agent("mig", "apply", *args, "--state-dir", str(state_dir))
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.splitlines()[:-1] == left
    assert len(left) >= len(total) - taken
    assert gpu_agent("mig", "assert", *args).returncode == 0
