"""Wakes the event loop when files appear in or leave the kubelet's device-plugin directory, or the directory
itself is removed, renamed or made again (Linux inotify)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import struct
from pathlib import Path

log = logging.getLogger(__name__)

IN_CREATE = 0x100
IN_DELETE = 0x200
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_ONLYDIR = 0x1000000
EVENT = struct.Struct("iIII")
"""struct inotify_event: wd, mask, cookie, len (the name follows, NUL-padded to len bytes)."""
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC


class DirWatch:
    """Sets `changed` on any entry created, deleted or moved in one directory, and when an entry of that name is
    made, removed or moved in its parent: the directory replaced (`rm -rf` and `mkdir`). The parent is watched
    because the directory's own watch says nothing of its removal while the agent holds it open (its lock):
    the kernel reports a directory deleted only when its last reference goes.

    Without inotify (another OS, or the directory missing) it does nothing and callers fall back to polling.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.changed = asyncio.Event()
        self._fd = -1
        self._parent = -1
        """The watch descriptor of the parent directory (-1 without one)."""

    @property
    def active(self) -> bool:
        return self._fd >= 0

    def start(self) -> bool:
        name = ctypes.util.find_library("c")
        if name is None:
            return False
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        except (OSError, AttributeError):
            return False
        if fd < 0:
            return False
        mask = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
        if libc.inotify_add_watch(fd, os.fsencode(self.directory), mask) < 0:
            os.close(fd)
            log.debug("cannot watch %s: %s", self.directory, os.strerror(ctypes.get_errno()))
            return False
        self._parent = libc.inotify_add_watch(fd, os.fsencode(self.directory.parent),
                                              IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ONLYDIR)
        self._fd = fd
        asyncio.get_running_loop().add_reader(fd, self._drain)
        return True

    def _drain(self) -> None:
        ours = os.fsencode(self.directory.name)
        changed = False
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self._fd, 64 * 1024):
                offset = 0
                while offset + EVENT.size <= len(data):
                    wd, _, _, length = EVENT.unpack_from(data, offset)
                    name = data[offset + EVENT.size: offset + EVENT.size + length].rstrip(b"\0")
                    offset += EVENT.size + length
                    # The parent's events about other entries are not the directory's business.
                    changed = changed or wd != self._parent or name == ours
        if changed:
            self.changed.set()

    def stop(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = self._parent = -1
