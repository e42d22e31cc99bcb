"""Fixtures of the image tests: the archives `make image` leaves, and arm64 programs run under qemu."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
from image_archive import AGENT_ARCHIVE, INDEX_ARCHIVE, REPO, Archive

BINFMT = REPO / "hack" / "binfmt.sh"


@pytest.fixture(scope="module")
def index_archive() -> Iterator[Archive]:
    archive = Archive(INDEX_ARCHIVE)
    yield archive
    archive.close()


@pytest.fixture(scope="module")
def agent_archive() -> Iterator[Archive]:
    archive = Archive(AGENT_ARCHIVE)
    yield archive
    archive.close()


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.fail(f"{what} needs root", pytrace=False)


@pytest.fixture(scope="module")
def arm64_emulation() -> Iterator[None]:
    """arm64 programs run here under qemu while the module's tests run (hack/binfmt.sh on); afterwards the
    machine's binfmt_misc registrations are as they were (hack/binfmt.sh off with what `on` changed)."""
    need_root("running the arm64 image under qemu (binfmt_misc, chroot)")
    on = subprocess.run(["bash", str(BINFMT), "on"], capture_output=True, text=True, timeout=600)
    if on.returncode != 0:
        last = (on.stderr.strip().splitlines() or [f"exit status {on.returncode}"])[-1]
        pytest.fail(f"hack/binfmt.sh on failed: {last}", pytrace=False)
    changed = on.stdout.split()
    yield
    off = subprocess.run(["bash", str(BINFMT), "off", *changed], capture_output=True, text=True, timeout=60)
    assert off.returncode == 0, f"hack/binfmt.sh off {' '.join(changed)} failed: {off.stderr}"

