"""File operations done with a sandbox user's file-system identity: a thread of its own
whose fsuid and fsgid are the sandbox's and which has no supplementary group. The kernel
then decides every open, mkdir and rename as it would for the sandbox (mode bits, ACLs,
directories it cannot search), not the daemon's root: the kernel drops the thread's
file capabilities (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_CHOWN, ...)
when its fsuid leaves 0. The thread then drops every other capability too (capset acts
on the calling thread only): CAP_SYS_RESOURCE above all, which would let its writes pass
disk quotas and land in the blocks ext4 reserves for root (the daemon's own log). What
it creates, and the room it takes, is the sandbox user's.

setfsuid, setfsgid and the raw setgroups system call act on the calling thread only
(glibc's setgroups() would change every thread of the daemon: it is not used). For the
same reason, a glibc set*id/setgroups call elsewhere in the daemon would reset this
thread too: the daemon makes none after start (children change theirs after fork)."""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, ThreadPoolExecutor
from typing import TypeVar

from sandboxd.core.safe_open import libc

T = TypeVar("T")

# setgroups(2)'s, capget(2)'s and capset(2)'s numbers, per architecture.
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}
_SYS_CAPGET = {"x86_64": 125, "aarch64": 90}
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class IdentityError(OSError):
    """The thread could not take the sandbox's identity: nothing is done as root instead."""


def _take_identity(uid: int, gid: int) -> None:
    if uid == 0 or gid == 0:  # fsuid 0 keeps every file capability: no sandbox's user is that
        raise IdentityError(f"uid {uid}, gid {gid}: a sandbox's user is never root")
    lib = libc()
    number = _SYS_SETGROUPS.get(platform.machine())
    if number is None:
        raise IdentityError(f"no setgroups system call number known for {platform.machine()}")
    lib.syscall.restype = ctypes.c_long
    if lib.syscall(ctypes.c_long(number), ctypes.c_size_t(0), None) != 0:
        err = ctypes.get_errno()
        raise IdentityError(err, f"setgroups: {os.strerror(err)}")
    lib.setfsgid(ctypes.c_uint(gid))
    lib.setfsuid(ctypes.c_uint(uid))
    # Each returns the previous value, never an error: asked again (with an id that is
    # invalid, so nothing changes), they say what the thread now has.
    if lib.setfsgid(ctypes.c_uint(0xFFFFFFFF)) != gid or lib.setfsuid(ctypes.c_uint(0xFFFFFFFF)) != uid:
        raise IdentityError(f"the thread did not take fsuid {uid} and fsgid {gid}")
    drop_thread_capabilities()


def _capabilities_call(numbers: dict[str, int], data: ctypes.Array[_CapData]) -> None:
    lib = libc()
    number = numbers.get(platform.machine())
    if number is None:
        raise IdentityError(f"no capget/capset system call number known for {platform.machine()}")
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)  # pid 0: the calling thread
    lib.syscall.restype = ctypes.c_long
    if lib.syscall(ctypes.c_long(number), ctypes.byref(header), ctypes.byref(data)) != 0:
        err = ctypes.get_errno()
        raise IdentityError(err, f"capget/capset: {os.strerror(err)}")


def thread_capabilities() -> tuple[int, int]:
    """The calling thread's effective and permitted capability sets, as 64-bit masks."""
    data = (_CapData * 2)()
    _capabilities_call(_SYS_CAPGET, data)
    return data[0].effective | data[1].effective << 32, data[0].permitted | data[1].permitted << 32


def drop_thread_capabilities() -> None:
    """Empties the calling thread's capability sets, for good (its permitted set too, so
    nothing it runs can raise one again); checked after."""
    _capabilities_call(_SYS_CAPSET, (_CapData * 2)())
    if thread_capabilities() != (0, 0):
        raise IdentityError("the thread kept capabilities after dropping them")


class AsUser:
    """Runs callables, one at a time, on one thread acting as (uid, gid). Use as a
    context manager: the thread ends (and its identity with it) on exit."""

    def __init__(self, uid: int, gid: int):
        self.uid, self.gid = uid, gid
        # As the initializer: if it fails, the pool is broken and runs nothing (never as root).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"as-{uid}",
                                        initializer=_take_identity, initargs=(uid, gid))
        try:
            self._pool.submit(os.getpid).result()
        except BrokenExecutor:
            self._pool.shutdown()
            raise IdentityError(f"a thread could not act as uid {uid}, gid {gid}") from None

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> AsUser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
