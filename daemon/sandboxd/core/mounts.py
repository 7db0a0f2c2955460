"""mount(2) and umount2(2), which Python does not wrap, for the few mounts the daemon
makes itself: the staged workspace roots and their masks (backends/staging.py) and the
tmpfs that holds the sandboxes' secrets (hostdirs.open_secrets_dir)."""

from __future__ import annotations

import ctypes
import errno
import os

from sandboxd.core.safe_open import libc

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_PRIVATE = 0x40000
_MNT_DETACH = 0x2
_UMOUNT_NOFOLLOW = 0x8


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if libc().mount(os.fsencode(source) if source else None, os.fsencode(target),
                    os.fsencode(fstype) if fstype else None, ctypes.c_ulong(flags),
                    os.fsencode(data) if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting on {target}: {os.strerror(err)}")


def unmount(target: str) -> None:
    """Detaches what is mounted at `target`, never through a symlink (a directory someone
    else can write in may hold one). Not a mount point, or gone: nothing to do."""
    if libc().umount2(os.fsencode(target), _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"unmounting {target}: {os.strerror(err)}")
