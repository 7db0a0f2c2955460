"""inotify primitives: for the gate's arrival (gate.py) and the write-root trackers
(root_tracker.py)."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator

from sandboxd.recording.libc import libc

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_OPEN = 0x20
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
_INOTIFY_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


def inotify_init() -> int:
    """A non-blocking, close-on-exec inotify instance (OSError when there is none)."""
    fd: int = libc().inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def inotify_add_watch(fd: int, path: str, mask: int) -> int:
    wd: int = libc().inotify_add_watch(fd, os.fsencode(path), mask)
    if wd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return wd


def inotify_events(buf: bytes) -> Iterator[tuple[int, int]]:
    """(watch descriptor, mask) of each event in one read of an inotify instance."""
    i = 0
    while i + _INOTIFY_EVENT.size <= len(buf):
        wd, mask, _cookie, length = _INOTIFY_EVENT.unpack_from(buf, i)
        i += _INOTIFY_EVENT.size + length
        yield wd, mask
