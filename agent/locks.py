"""Exclusion between processes on one node: one MIG apply per state directory, one agent per kubelet directory.
A second one is refused in one line naming the process that holds the lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


class Held(RuntimeError):
    """Another process holds the lock; the message is one line naming it."""


def _holder_of(path: Path) -> int | None:
    """The pid holding a flock on `path`, from /proc/locks (None when it cannot be told)."""
    try:
        st = os.stat(path)
        wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None


def _flock(fd: int, path: Path, what: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = _holder_of(path)
        holder = f"pid {pid}" if pid is not None else "another process"
        raise Held(f"{what}: {holder} holds the lock on {path}") from None


@contextlib.contextmanager
def mig_apply_lock(state_dir: Path) -> Iterator[None]:
    """Held for one MIG apply: the agent's MIG controller and `gpu-agent mig apply` take it alike. It locks the
    state directory itself, so no lock file is left behind."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(state_dir, "another MIG apply is running on this node")
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


class DirectoryLock:
    """A lock on a directory itself (its inode), for directories where no file of the agent's may stay: the
    kubelet removes every file but its own from the device-plugins directory when it starts."""

    def __init__(self, directory: Path, what: str) -> None:
        self._directory, self._what = directory, what
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY)
        _flock(fd, self._directory, self._what)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
