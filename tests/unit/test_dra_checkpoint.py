"""The agent's state files survive a power loss: the file and then its directory are flushed to disk."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.yamlfile import write_atomically


def test_a_state_file_is_flushed_then_renamed_then_its_directory_is_flushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        events.append("fsync directory" if stat.S_ISDIR(mode) else "fsync file")
        fsync(fd)

    def recorded_replace(src: str, dst: Path) -> None:
        events.append(f"rename to {Path(dst).name}")
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    write_atomically(tmp_path / "state" / "checkpoint.json", "{}")
    assert events == ["fsync file", "rename to checkpoint.json", "fsync directory"]
    assert (tmp_path / "state" / "checkpoint.json").read_text() == "{}"
    assert os.listdir(tmp_path / "state") == ["checkpoint.json"]
