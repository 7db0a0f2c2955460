"""The C library's calls that file recording makes (fanotify, inotify, statx, file
handles), bound on first use: importing this module loads nothing."""

from __future__ import annotations

import ctypes
import functools


class FileHandle(ctypes.Structure):
    """struct file_handle with room for a 128-byte handle (MAX_HANDLE_SZ)."""
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 128)]


@functools.cache
def libc() -> ctypes.CDLL:
    """libc with the argument types of every call made here (errno kept)."""
    lib = ctypes.CDLL("libc.so.6", use_errno=True)
    lib.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
    lib.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    lib.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    lib.inotify_init1.argtypes = [ctypes.c_int]
    lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    lib.name_to_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(FileHandle),
                                      ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.POINTER(FileHandle), ctypes.c_int]
    return lib
