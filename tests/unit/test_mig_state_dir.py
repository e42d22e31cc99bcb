"""What the MIG manager does with a mig.stateDir that cannot keep its state, driven the way the agent drives it
(the MIG controller on the fake NVML, its NodeState read as the Node would show it):

- a journal that cannot be one (a FIFO, a symbolic link to /dev/zero, a directory, a symbolic link to nothing, a
  file over its size limit, not JSON) is read without waiting and with bounded memory, and named in one line: in
  the log and, with no label to follow, in the MIG state, its reason and a MigConfigFailed Event; the GPUs are not
  touched. Each such agent runs in a child process with its address space capped and a deadline, so that a reader
  that waits on the FIFO or reads /dev/zero to its end fails the test instead of hanging it or taking the host's
  memory.
- a disk that cannot keep the journal (full, read-only, a file where the directory should be) fails the apply as a
  disk error naming the path, not as an NVML error, with one log line, no traceback, and nothing changed on the
  GPUs.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.mig.applier import JOURNAL, Journal
from agent.mig.layout import load_layouts
from tests.builders import started
from tests.mig_rig import (
    FRESH,
    JOURNAL_SHAPES,
    LAYOUT,
    PRESET,
    READ_PEAK,
    UNREAD,
    drive,
    gpus,
    in_child,
    mig_config,
)

# --- a journal that cannot be one ----------------------------------------------------------------------------




@pytest.mark.parametrize("make", JOURNAL_SHAPES, ids=[f.__name__ for f in JOURNAL_SHAPES])
def test_an_unreadable_journal_with_no_label_is_named_on_the_node_and_nothing_changes(
        tmp_path: Path, make: Callable[[Path], str]) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    journal = state_dir / JOURNAL
    why = make(journal)

    outcome = in_child(state_dir, tmp_path)

    reason = f"the MIG journal {journal} cannot be read ({why}): {UNREAD}"
    assert outcome["crashed"] is None
    assert outcome["status"] == ["", "failed", reason]
    assert (outcome["state_label"], outcome["annotation"]) == ("failed", reason)
    assert outcome["events"] == [["MigConfigFailed", reason]]
    assert [r for r in outcome["logs"] if str(journal) in r["message"]] == [
        {"level": "ERROR", "message": reason, "traceback": False}]
    assert outcome["peak"] < READ_PEAK, outcome["peak"]
    # Nothing touched: not the GPUs, not their devices, not the file (the evidence stays for the operator).
    assert outcome["gpus"] == FRESH
    assert (outcome["withdrawn"], outcome["draining"]) == (0, 0)
    assert os.path.lexists(journal)


def test_an_unreadable_journal_under_a_label_is_replaced_by_the_labelled_layout(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    journal = state_dir / JOURNAL
    os.mkfifo(journal)

    outcome = in_child(state_dir, tmp_path, LAYOUT)

    assert outcome["status"] == [LAYOUT, "success", f"layout {LAYOUT!r} applied: 64 change(s)"]
    assert [r for r in outcome["logs"] if str(journal) in r["message"]] == [
        {"level": "WARNING", "message": f"the MIG journal {journal} cannot be read (is a FIFO, not a regular file); "
                                        f"applying the labelled layout {LAYOUT}, which replaces it",
         "traceback": False}]
    assert outcome["gpus"] == [(True, False, 7)] * 8
    assert not os.path.lexists(journal)  # replaced by the apply's journal, removed once the layout verified


# --- a disk that cannot keep the journal ---------------------------------------------------------------------


def under(path: str | bytes | os.PathLike[str] | int, directory: Path) -> bool:
    if isinstance(path, int):
        with contextlib.suppress(OSError):
            return os.readlink(f"/proc/self/fd/{path}").startswith(f"{directory}/")
        return False
    text = os.fsdecode(path)
    return os.path.abspath(text).startswith(f"{directory}/")


def disk_full(monkeypatch: pytest.MonkeyPatch, state_dir: Path) -> Path:
    """Every file under `state_dir` fails to reach the disk with ENOSPC, as on a full filesystem."""
    fsync = os.fsync

    def full(fd: int) -> None:
        if under(fd, state_dir):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    return state_dir


def read_only(monkeypatch: pytest.MonkeyPatch, state_dir: Path) -> Path:
    """No file can be created under `state_dir`, as on a read-only filesystem (the directory is there)."""
    opener = os.open

    def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT and under(path, state_dir):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return opener(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    return state_dir


def not_a_directory(monkeypatch: pytest.MonkeyPatch, state_dir: Path) -> Path:
    """mig.stateDir under a regular file: the real thing, no simulation."""
    blocker = state_dir.parent / "a-file"
    blocker.write_text("")
    return blocker / "state"


DISKS: list[tuple[Callable[[pytest.MonkeyPatch, Path], Path], str]] = [
    (disk_full, "cannot write the MIG journal {dir}/mig-journal.json: No space left on device (ENOSPC)"),
    (read_only, "cannot write the MIG journal {dir}/mig-journal.json: Read-only file system (EROFS)"),
    (not_a_directory, "cannot use the directory {dir}: Not a directory (ENOTDIR)"),
]


@pytest.mark.parametrize(("disk", "what"), DISKS, ids=[d.__name__ for d, _ in DISKS])
async def test_a_disk_that_cannot_keep_the_journal_fails_the_layout_as_a_disk_error_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: Callable[[pytest.MonkeyPatch, Path], Path],
        what: str) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_dir = disk(monkeypatch, state_dir)
    reason = f"disk error in mig.stateDir: {what.format(dir=state_dir)}; nothing was changed on the GPUs"

    outcome = await drive(mig_config(state_dir, tmp_path), LAYOUT, lambda s: "next try in" in s.reason)

    # The reason on the Node and in the Event says the disk and the path, not NVML; the retry is announced as for
    # any reason that can pass (the disk may be freed).
    assert outcome["status"] == [LAYOUT, "failed", f"{reason}; next try in 30s (retry 1 of 5)"]
    assert (outcome["state_label"], outcome["annotation"]) == ("failed", outcome["status"][2])
    assert outcome["events"] == [["MigConfigFailed", f"MIG layout {LAYOUT}: failed: {reason}"]]
    errors = [r for r in outcome["logs"] if r["level"] in ("ERROR", "CRITICAL")]
    assert errors == [{"level": "ERROR", "message": f"MIG layout {LAYOUT}: failed: {reason}", "traceback": False}]
    assert not any(r["traceback"] or "NVML error" in r["message"] for r in outcome["logs"])
    assert outcome["gpus"] == FRESH
    # The GPUs withdrawn for the apply are given back, and no temporary file is left behind.
    assert (outcome["withdrawn"], outcome["draining"]) == (8, 0)
    monkeypatch.undo()
    assert not state_dir.exists() or list(state_dir.iterdir()) == []


def test_a_journal_that_cannot_be_removed_after_the_apply_fails_it_and_the_next_try_finishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = started(PRESET)
    journal = Journal(tmp_path)
    unlink = os.unlink

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path) == journal.path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    result = node.apply(load_layouts().layout(LAYOUT), journal)
    assert (result.outcome, result.reason) == (
        "failed", f"layout {LAYOUT!r} applied: 64 change(s), but disk error in mig.stateDir: cannot remove the MIG "
                  f"journal {journal.path}: Read-only file system (EROFS)")
    assert gpus(node.backend) == [(True, False, 7)] * 8
    assert journal.pending() == LAYOUT  # it stays: a start now finishes (a no-op) the same layout

    monkeypatch.undo()
    result = node.apply(load_layouts().layout(LAYOUT), journal)
    assert (result.outcome, result.reason) == ("success", f"layout {LAYOUT!r} is already applied")
    assert journal.pending() is None
