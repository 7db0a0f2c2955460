"""The native event reader (native/fanotify-reader.c, `make native`): it reads a
fanotify group's events and counts their paths outside the GIL (a Python loop cost
~10 µs an event, beside the call). Its path is the setting
`file_audit.reader_library`; it is loaded on first use, never at import."""

from __future__ import annotations

import ctypes
from pathlib import Path

from sandboxd.core.safe_open import UnsafeFile, load_library
from sandboxd.core.settings import FileAuditSettings
from sandboxd.recording.errors import FileWatchError

# None: the setting's default (the packaged library), looked up on first use.
_library_path: Path | None = None
_reader: ctypes.CDLL | None = None


def use_reader_library(path: Path | str | None) -> None:
    """The reader this process loads (before any watch is made): the daemon passes
    settings.file_audit.reader_library; None goes back to the setting's default."""
    global _library_path, _reader
    _library_path, _reader = (Path(path) if path is not None else None), None


def reader_library_path() -> Path:
    """The library that reader_library() loads."""
    return _library_path if _library_path is not None else FileAuditSettings.model_validate({}).reader_library


def reader_library() -> ctypes.CDLL:
    """The event reader (loaded once); FileWatchError when it was not built."""
    global _reader
    if _reader is None:
        path = reader_library_path()
        try:
            lib = load_library(path, setting="file_audit.reader_library")  # a FIFO there: refused
        except (OSError, UnsafeFile) as exc:
            raise FileWatchError(f"the fanotify reader {path} cannot be loaded (build it with "
                                 f"`make native`): {exc}") from None
        _declare(lib)
        _reader = lib
    return _reader


def _declare(lib: ctypes.CDLL) -> None:
    """The reader's functions' signatures."""
    lib.fw_new.argtypes, lib.fw_new.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.fw_free.argtypes, lib.fw_free.restype = [ctypes.c_void_p], None
    lib.fw_set_fd.argtypes, lib.fw_set_fd.restype = [ctypes.c_void_p, ctypes.c_int], None
    lib.fw_set_fid.argtypes, lib.fw_set_fid.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    lib.fw_unresolved.argtypes, lib.fw_unresolved.restype = [ctypes.c_void_p], ctypes.c_uint64
    lib.fw_unnamed.argtypes, lib.fw_unnamed.restype = [ctypes.c_void_p], ctypes.c_uint64
    lib.fw_add_mount.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p]
    lib.fw_only_mount.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.fw_drain.argtypes, lib.fw_drain.restype = [ctypes.c_void_p], ctypes.c_long
    lib.fw_note.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    lib.fw_note.restype = None
    lib.fw_export.argtypes, lib.fw_export.restype = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_long
    lib.fw_dropped.argtypes, lib.fw_dropped.restype = [ctypes.c_void_p], ctypes.c_uint64
    lib.fw_overflowed.argtypes = [ctypes.c_void_p]
    lib.fw_reset.argtypes, lib.fw_reset.restype = [ctypes.c_void_p], None
