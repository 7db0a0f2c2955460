"""openat2(2), which Python does not wrap: a path opened beneath a directory and with
no symlink anywhere on the way, so that what a check found is what is used. Returns an
O_PATH descriptor (a handle to the inode, for fstat, further openat2 and mounts)."""

from __future__ import annotations

import ctypes
import functools
import os

AT_FDCWD = -100
_SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_O_PATH = os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, loaded once (on first use, never at import)."""
    return ctypes.CDLL(None, use_errno=True)


def openat2(dir_fd: int, path: str, resolve: int) -> int:
    how = _OpenHow(_O_PATH, 0, resolve)
    lib = libc()
    lib.syscall.restype = ctypes.c_long
    fd = lib.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(path)),
                      ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)
