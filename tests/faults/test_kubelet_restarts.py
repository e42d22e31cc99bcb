"""Kubelet restarts: the agent registers again within a second every time, a hundred times in a row and once a
second for a minute with a client's calls going on, without leaking file descriptors or threads; a kubelet that
stays away makes the agent unready until it is back; a resource that goes away and comes back is served on a
socket name never used before, and one the kubelet refuses holds up none of the others."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from agent.config import load_config, parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.simulate import StandInKubelet
from tests.plugin_harness import Rig, carve_mig, running_agent, short_dir, wait_until

RESOURCE = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.10gb"
RESTARTS = 100
REREGISTER_S = 1.0
FD_SLACK = 4
"""Descriptors the runtime may open lazily (an epoll set, a wakeup pipe); a leak of one per restart exceeds it."""
OS_THREAD_SLACK = 4
"""gRPC's core may start a few more of its own threads under load; a thread per restart exceeds it."""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def listed(kubelet: StandInKubelet, expected: list[tuple[str, str]]) -> bool:
    """The kubelet holds a registration for the resource and its ListAndWatch list is the expected one."""
    view = kubelet.plugins.get(RESOURCE)
    return view is not None and view.updates > 0 and [(d.ID, d.health) for d in view.devices] == expected


def plugin_sockets(rig: Rig) -> list[str]:
    return sorted(p.name for p in rig.directory.iterdir() if p.is_socket() and p.name != "kubelet.sock")


async def allocate_one(rig: Rig, device: str) -> dict[str, str]:
    stub = rig.stub()
    response = await stub.Allocate(
        api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[device])]),
        timeout=5,
    )
    return dict(response.container_responses[0].envs)


async def test_a_hundred_kubelet_restarts_each_reregister_within_a_second_without_leaks() -> None:
    async with running_agent("dgx-h100") as rig:
        plugin = rig.agent.plugins.plugins[RESOURCE]
        expected = [(d.ID, "Healthy") for d in rig.devices()]
        assert len(expected) == 8
        # One restart first: whatever the runtime allocates once, lazily, is not a leak.
        await rig.restart_kubelet()
        await wait_until(lambda: listed(rig.kubelet, expected), REREGISTER_S, "re-registration after warm-up")
        fds, threads, tasks = open_fds(), threading.active_count(), os_threads()
        registrations = plugin.registrations
        endpoints = set()

        for restart in range(1, RESTARTS + 1):
            await rig.restart_kubelet()
            await wait_until(lambda: listed(rig.kubelet, expected), REREGISTER_S,
                             f"re-registration after kubelet restart {restart}")
            endpoints.add(rig.kubelet.plugins[RESOURCE].endpoint)

        assert plugin.registrations - registrations == RESTARTS
        assert len(endpoints) == RESTARTS  # a fresh socket each time, never one the old kubelet knew
        assert plugin_sockets(rig) == [rig.kubelet.plugins[RESOURCE].endpoint]
        assert await allocate_one(rig, expected[5][0]) == {"NVIDIA_VISIBLE_DEVICES": expected[5][0]}
        assert open_fds() <= fds + FD_SLACK, f"{open_fds()} descriptors open after {RESTARTS} restarts, {fds} before"
        assert threading.active_count() <= threads
        assert os_threads() <= tasks + OS_THREAD_SLACK


PACED_RESTARTS = 60
"""A kubelet restart every second for a minute."""


async def test_a_kubelet_restart_every_second_for_a_minute_reregisters_each_time_without_leaks() -> None:
    async with running_agent("dgx-h100") as rig:
        plugin = rig.agent.plugins.plugins[RESOURCE]
        expected = [(d.ID, "Healthy") for d in rig.devices()]
        await rig.restart_kubelet()
        await wait_until(lambda: listed(rig.kubelet, expected), REREGISTER_S, "re-registration after warm-up")
        assert await allocate_one(rig, expected[0][0]) == {"NVIDIA_VISIBLE_DEVICES": expected[0][0]}
        fds, threads, tasks = open_fds(), threading.active_count(), os_threads()
        registrations = plugin.registrations
        started = time.monotonic()
        slowest = 0.0
        for restart in range(1, PACED_RESTARTS + 1):
            await asyncio.sleep(max(0.0, started + restart - time.monotonic()))
            restarted = time.monotonic()
            await rig.restart_kubelet()
            await wait_until(lambda: listed(rig.kubelet, expected), REREGISTER_S,
                             f"re-registration after kubelet restart {restart}")
            slowest = max(slowest, time.monotonic() - restarted)
            # The server on the new socket answers at once, as the kubelet's first pod start would need.
            device = expected[restart % len(expected)][0]
            assert await allocate_one(rig, device) == {"NVIDIA_VISIBLE_DEVICES": device}
        assert time.monotonic() - started >= PACED_RESTARTS
        assert plugin.registrations - registrations == PACED_RESTARTS
        assert slowest < REREGISTER_S
        assert plugin_sockets(rig) == [rig.kubelet.plugins[RESOURCE].endpoint]
        assert open_fds() <= fds + FD_SLACK, f"{open_fds()} descriptors open after a minute of restarts, {fds} before"
        assert threading.active_count() <= threads
        assert os_threads() <= tasks + OS_THREAD_SLACK


async def test_an_absent_kubelet_makes_the_agent_unready_until_it_returns() -> None:
    async with running_agent("single-h200") as rig:
        expected = [(d.ID, "Healthy") for d in rig.devices()]
        # The kubelet lists the devices before the agent has seen its Register answered: readiness follows.
        await wait_until(lambda: rig.agent.ready() == (True, "ok"), REREGISTER_S, "readiness at start")
        await rig.kubelet.stop()
        for path in rig.directory.iterdir():
            if path.is_socket():
                path.unlink()
        await wait_until(lambda: rig.agent.ready() == (False, "not registered with the kubelet"), 2,
                         "the agent to notice the kubelet is gone")
        # The agent keeps waiting for the kubelet; nothing serves the old socket in the meantime.
        assert plugin_sockets(rig) == []

        rig.kubelet = StandInKubelet(rig.directory)
        await rig.kubelet.start()
        await wait_until(lambda: listed(rig.kubelet, expected), REREGISTER_S, "registration with the new kubelet")
        await wait_until(lambda: rig.agent.ready() == (True, "ok"), REREGISTER_S, "readiness")
        assert await allocate_one(rig, expected[0][0]) == {"NVIDIA_VISIBLE_DEVICES": expected[0][0]}


SHARED = "nvidia.com/gpu.shared"
ROUNDS = 5


async def test_a_resource_that_goes_away_and_comes_back_is_served_on_a_name_never_used_before(
        tmp_path: Path) -> None:
    """A reload that renames the GPUs' resource and one that names it back, five times: each time the resource
    comes back, it is served on a socket name no earlier server of the process had, so a kubelet that still
    tracks an old path can never take the new server for the one it knew."""
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    shared = ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
              "    - name: nvidia.com/gpu\n      replicas: 2\n")
    async with running_agent("single-h200", load_config(path), config_path=path) as rig:
        endpoints = [rig.kubelet.plugins[RESOURCE].endpoint]
        for _ in range(ROUNDS):
            for text, resource in ((shared, SHARED), ("version: v1\n", RESOURCE)):
                path.write_text(text)
                assert await rig.agent.reload_config() is True
                await wait_until(lambda: set(rig.agent.plugins.plugins) == {resource}, 10,  # noqa: B023
                                 f"only {resource} served")
                await rig.kubelet.wait_for({resource}, 10)
                await wait_until(lambda: rig.kubelet.plugins[resource].endpoint not in endpoints,  # noqa: B023
                                 10, f"{resource} registered on a new socket")
                endpoints.append(rig.kubelet.plugins[resource].endpoint)
        assert len(set(endpoints)) == 1 + 2 * ROUNDS
        assert plugin_sockets(rig) == [endpoints[-1]]


class RefusingKubelet(StandInKubelet):
    """A kubelet that refuses the registration of one resource until told to take it."""

    def __init__(self, directory: Path, refused: str) -> None:
        super().__init__(directory)
        self.refused: str | None = refused
        self.refusals = 0

    async def Register(self, request: api_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> api_pb2.Empty:
        if request.resource_name == self.refused:
            self.refusals += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused by the test")
        return await super().Register(request, context)


async def test_one_resource_the_kubelet_refuses_holds_up_none_of_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    """nvidia.com/gpu comes first in every round of registrations; the kubelet refuses it. The MIG devices are
    registered and listed all the same, within the re-registration budget; the refusal is logged once however
    often it is retried, and once the kubelet takes it the GPUs are listed too."""
    fake = FakeNvml(load_node("dgx-h100"))
    carve_mig(fake, 0, [("1g.10gb", start) for start in range(7)])
    directory = short_dir()
    config = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")
    try:
        async with running_agent("dgx-h100", config, fake=fake, directory=directory, kubelet_first=False) as rig:
            rig.kubelet = kubelet = RefusingKubelet(directory, RESOURCE)
            await kubelet.start()
            await kubelet.wait_for({MIG}, REREGISTER_S)
            assert len(kubelet.plugins[MIG].devices) == 7
            await wait_until(lambda: kubelet.refusals >= 3, 10, "three refusals, with backoff")
            assert RESOURCE not in kubelet.plugins
            refusals = [r.getMessage() for r in caplog.records
                        if r.levelname == "WARNING" and "with the kubelet failed" in r.getMessage()]
            assert refusals == [f"registration of {RESOURCE} with the kubelet failed, retrying in 0.5s: "
                                "refused by the test"]
            kubelet.refused = None
            await kubelet.wait_for({RESOURCE}, 10)
            assert len(kubelet.plugins[RESOURCE].devices) == 7
    finally:
        shutil.rmtree(directory, ignore_errors=True)
