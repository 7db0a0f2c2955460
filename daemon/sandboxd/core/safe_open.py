"""openat2(2), which Python does not wrap: a path opened beneath a directory and with
no symlink anywhere on the way, so that what a check found is what is used. Returns an
O_PATH descriptor (a handle to the inode, for fstat, further openat2 and mounts).
And the files a setting names (the seccomp profile, credentials, TLS keys): opened once,
checked and read through one descriptor (open_setting_file, read_setting_file)."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from sandboxd.core.errors import FailedPrecondition

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


# ------------------------------------------------------------- files a setting names
# A file the daemon (or `sandboxd check`) reads because a setting names it: opened once,
# without following a symlink at its name, never blocking (a FIFO or a device there would
# hang the start), never becoming a controlling terminal; what is checked is the open
# descriptor, and what is read comes from it: no name looked at twice.
CONFIG_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class UnsafeFile(FailedPrecondition):
    """A file a setting names, refused. `problem` says why without the file's path (for
    whoever may not learn it: a caller told that its credential is unavailable); never
    anything of the file's content."""

    def __init__(self, path: str | os.PathLike[str], problem: str, *, setting: str):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path} {problem}", field=setting)


def open_setting_file(path: str | os.PathLike[str], *, setting: str, private: bool = False,
                      follow: bool = False) -> tuple[int, os.stat_result]:
    """The descriptor (the caller closes it) and status of the regular file `path`.
    `private`: it holds a secret, so it must be the daemon's own (its euid) and closed
    to group and others. `follow`: a symlink at its name is followed (the config file
    itself; never a secret's). Refused with UnsafeFile naming `setting`."""
    text = os.fspath(path)
    if "\0" in text:
        raise UnsafeFile(repr(text), "holds a NUL byte", setting=setting)
    try:
        fd = os.open(text, CONFIG_FILE_FLAGS & ~(os.O_NOFOLLOW if follow else 0))
    except OSError as exc:
        raise UnsafeFile(text, _open_problem(exc), setting=setting) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((f"is {name}, not" for test, name in _FILE_KINDS if test(st.st_mode)), "is not")
            raise UnsafeFile(text, f"{kind} a regular file", setting=setting)
        euid = os.geteuid()
        if private and (st.st_uid != euid or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)):
            raise UnsafeFile(text, f"must be the daemon's own (uid {euid}) and closed to group and others (mode "
                                   f"0600 or stricter); it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}",
                             setting=setting)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def read_fd(fd: int, limit: int) -> bytes:
    """At most `limit` bytes of `fd`, from where it is, up to its end."""
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_setting_file(path: str | os.PathLike[str], *, setting: str, max_bytes: int, private: bool = False,
                      follow: bool = False) -> bytes:
    """The content of the file `path` (open_setting_file's checks), refused past `max_bytes`."""
    fd, _st = open_setting_file(path, setting=setting, private=private, follow=follow)
    try:
        try:
            data = read_fd(fd, max_bytes + 1)
        except OSError as exc:
            raise UnsafeFile(path, f"cannot be read ({exc.strerror})", setting=setting) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnsafeFile(path, f"is larger than {max_bytes} bytes", setting=setting)
    return data


def _open_problem(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symbolic link (the daemon follows none to a file a setting names: name the file itself)"
    if exc.errno == errno.ENOENT:
        return "does not exist"
    if exc.errno == errno.ENXIO:
        return "is not a regular file (a socket, or a device without its driver)"
    return f"cannot be opened ({exc.strerror})"


@contextmanager
def held_setting_file(path: str | os.PathLike[str], *, setting: str = "") -> Iterator[str]:
    """The regular file `path` (a symlink at its name followed: the packaged helpers may
    be links), held open through a non-blocking descriptor while the caller reads,
    copies or loads it by the name yielded, its /proc/self/fd one: the same file,
    whatever is renamed meanwhile. Anything else is refused (UnsafeFile) before any
    blocking open: a FIFO named as a binary or a library would block an ELF header
    read, a copy or a dlopen for good (the daemon's start with it)."""
    fd, _st = open_setting_file(path, setting=setting, follow=True)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


# The libraries loaded through their descriptors (load_library), by file and errno use;
# each descriptor stays open for the process's life: glibc's dlopen knows a loaded object
# by the name it was given, and a /proc/self/fd/N closed and reused would make a later
# load return the earlier library. (ctypes never unloads one: nothing is kept longer.)
_LIBRARIES: dict[tuple[int, int, bool], tuple[int, ctypes.CDLL]] = {}


def load_library(path: str | os.PathLike[str], *, setting: str, use_errno: bool = False) -> ctypes.CDLL:
    """The shared library `path` a setting names, loaded through one held non-blocking
    descriptor (held_setting_file's checks: a FIFO there is refused, never waited on);
    a file loaded before is that load's library."""
    fd, st = open_setting_file(path, setting=setting, follow=True)
    key = (st.st_dev, st.st_ino, use_errno)
    if key in _LIBRARIES:
        os.close(fd)
        return _LIBRARIES[key][1]
    try:
        library = ctypes.CDLL(f"/proc/self/fd/{fd}", use_errno=use_errno)
    except BaseException:
        os.close(fd)
        raise
    _LIBRARIES[key] = (fd, library)
    return library


def library_descriptors() -> frozenset[int]:
    """The descriptors load_library holds (for whoever counts the process's own)."""
    return frozenset(fd for fd, _ in _LIBRARIES.values())
