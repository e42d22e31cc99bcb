"""Fixtures for tests against a real kube-apiserver: `apiserver` (session-scoped) and its helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from apiserver import NODE, OTHER_NODE, STARTED_GROUPS, ApiServer, ensure_testbin, group_alive, running


def _uses_apiserver(item: pytest.Item) -> bool:
    return "apiserver" in getattr(item, "fixturenames", ()) or item.get_closest_marker("testbin") is not None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "testbin: the test needs the binaries hack/testbin.sh builds")


def pytest_collection_finish(session: pytest.Session) -> None:
    # A cold build takes many minutes: do it here, before any test's timeout starts, with its
    # progress on the terminal rather than in captured output.
    if any(_uses_apiserver(item) for item in session.items):
        capture = session.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            ensure_testbin()


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """etcd + kube-apiserver on loopback, with Nodes gpu-node-1 and other-node."""
    ensure_testbin()
    with running(tmp_path_factory.mktemp("apiserver"), nodes=(NODE, OTHER_NODE)) as rig:
        yield rig


@pytest.fixture(scope="module")
def dra_kubeconfig(apiserver: ApiServer) -> Path:
    """A kubeconfig of the agent's ServiceAccount in DRA mode, with the DRA objects applied (dra_rig.setup_cluster)."""
    from dra_rig import AGENT_ACCOUNT, AGENT_NAMESPACE, setup_cluster

    setup_cluster(apiserver)
    return apiserver.service_account_kubeconfig(AGENT_ACCOUNT, AGENT_NAMESPACE)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Session fixtures are torn down by now: any group still alive is a leak the rig must not have.
    leaked = [pgid for pgid in STARTED_GROUPS if group_alive(pgid)]
    if leaked:
        message = f"apiserver rig: process groups still running after teardown: {leaked}"
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            # A pytest-xdist worker: the process that started it fails the run and prints this (tests/conftest.py).
            workeroutput["leaked"] = message
        session.config.get_terminal_writer().line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
