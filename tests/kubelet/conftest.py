"""The `kubelet_harness` fixture: the Go harness and its stand-in plugin, built once per session."""

from __future__ import annotations

import contextlib

import pytest
from harness_binaries import HarnessBinaries, build_harness


def pytest_collection_finish(session: pytest.Session) -> None:
    # Build before any test's timeout starts, with its progress on the terminal.
    if any("kubelet_harness" in getattr(item, "fixturenames", ()) for item in session.items):
        capture = session.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            build_harness()


@pytest.fixture(scope="session")
def kubelet_harness(tmp_path_factory: pytest.TempPathFactory) -> HarnessBinaries:
    return build_harness(tmp_path_factory.mktemp("kubelet-harness"))
