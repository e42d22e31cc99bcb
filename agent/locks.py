"""Exclusion between processes on one node: one MIG apply per state directory, one agent per kubelet directory
(a second one is refused in one line naming the process that holds the lock, or, during a rolling update in DRA
mode, waits for it: `DirectoryLock.wait`), and one DRA prepare or unprepare at a time across the agents of a
node (`SerialLock`)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from agent.yamlfile import read_text_file

WAIT_POLL_MIN_S = 0.05
WAIT_POLL_MAX_S = 0.5
"""How often `DirectoryLock.wait` tries the lock again: from 50 ms, doubling, to at most 500 ms between tries."""


PROC_LOCKS = Path("/proc/locks")
PROC_LOCKS_MAX_BYTES = 4 * 1024 * 1024
"""The most of /proc/locks read to name a lock's holder: a line is about 60 bytes, so some 70,000 locks on the
machine; past that the holder is "another process"."""


class Held(RuntimeError):
    """Another process holds the lock; the message is one line naming it."""


def _holder_of(path: Path) -> int | None:
    """The pid holding a flock on `path`, from /proc/locks (None when it cannot be told)."""
    try:
        st = os.stat(path)
        wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in read_text_file(PROC_LOCKS, PROC_LOCKS_MAX_BYTES).splitlines():
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
        raise Held(f"{what}: {holder(path)} holds the lock on {path}") from None


def holder(path: Path) -> str:
    """Who holds the flock on `path`, in words: "pid N", or "another process" where /proc/locks does not say."""
    pid = _holder_of(path)
    return f"pid {pid}" if pid is not None else "another process"


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

    @property
    def held(self) -> bool:
        return self._fd is not None

    def follow(self) -> bool:
        """After the directory was replaced (removed and made again at its path): take the lock on the directory
        now at the path and let the old one's go. True when it moved, False when the lock is already on the
        directory at the path (or no directory is there); raises Held, holding the old directory's lock still,
        when another process holds the new one's."""
        assert self._fd is not None, "follow() without the lock"
        try:
            now, held = os.stat(self._directory), os.fstat(self._fd)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return False
        try:
            fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        _flock(fd, self._directory, self._what)
        os.close(self._fd)
        self._fd = fd
        return True

    async def wait(self) -> None:
        """Take the lock once its holder lets it go (exits, or releases it): tried again from every 50 ms up to
        every 500 ms, so a wait costs nothing while the holder runs and is cancelled at once."""
        pause = WAIT_POLL_MIN_S
        while True:
            try:
                self.acquire()
                return
            except Held:
                pass
            await asyncio.sleep(pause)
            pause = min(WAIT_POLL_MAX_S, pause * 2)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SerialLock:
    """One holder at a time among the coroutines of this process and every process that locks the same directory:
    an asyncio lock, then a flock on the directory itself (made when missing; no lock file is left in it), taken on
    a thread so the event loop goes on while another process holds it. The DRA kubelet plugins of a node (two
    during a rolling update) hold it on their plugin directory around each prepare and unprepare."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._local = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        async with self._local:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            locking = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
            try:
                await asyncio.shield(locking)
            except asyncio.CancelledError:
                # The thread still waits for the lock: the descriptor, and with it the lock, goes once it has it.
                locking.add_done_callback(lambda _: os.close(fd))
                raise
            except BaseException:
                os.close(fd)
                raise
            try:
                yield
            finally:
                os.close(fd)
