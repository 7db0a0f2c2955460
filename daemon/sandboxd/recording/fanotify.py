"""fanotify's constants and the host facts a watch needs: the mount id of an open file,
and whether a filesystem can report directory handles (FID mode), probed when first
asked, once per device, never at import."""

from __future__ import annotations

import ctypes
import os
import threading

from sandboxd.recording.closer import close_later
from sandboxd.recording.libc import FileHandle, libc

FAN_CLASS_NOTIF = 0x0
FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_UNLIMITED_QUEUE = 0x10
FAN_MARK_ADD = 0x1
FAN_MARK_FLUSH = 0x80
FAN_MARK_MOUNT = 0x10
FAN_MODIFY = 0x2
FAN_CLOSE_WRITE = 0x8
FAN_OPEN = 0x20
FAN_Q_OVERFLOW = 0x4000
FAN_REPORT_DFID_NAME = 0x00000c00  # FAN_REPORT_DIR_FID | FAN_REPORT_NAME (Linux 5.9)
AT_FDCWD = -100

# device -> whether FID mode works on it (fid_supported)
fid_by_device: dict[int, bool] = {}


def fid_supported(host_path: str) -> bool:
    """Whether the filesystem holding `host_path` can report directory handles and names
    (FID mode) through a mount mark: a test group marks the path's mount for a moment
    (and is closed unread), once per device. Not every filesystem can (overlayfs
    without nfs_export: inode marks would pass there, mount marks do not)."""
    try:
        dev = os.stat(host_path).st_dev
    except OSError:
        return False
    known = fid_by_device.get(dev)
    if known is None:
        lib = libc()
        fd = lib.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_DFID_NAME, os.O_RDONLY)
        if fd < 0:
            return False  # (not remembered: the limit on groups, say, may pass)
        marked = lib.fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN | FAN_CLOSE_WRITE, AT_FDCWD,
                                   os.fsencode(host_path)) == 0
        # The mark goes at once (every open on that mount queues an event while it is
        # there); the group, whose close waits for the kernel, later.
        lib.fanotify_mark(fd, FAN_MARK_FLUSH | FAN_MARK_MOUNT, 0, AT_FDCWD, None)
        close_later(fd)
        # The reader opens directory handles: that needs CAP_DAC_READ_SEARCH too.
        known = marked and handles_open(host_path)
        fid_by_device[dev] = known
    return known


def handles_open(path: str) -> bool:
    """Whether a handle of `path` can be made and opened again (as the reader will)."""
    lib = libc()
    handle, mount_id = FileHandle(handle_bytes=128), ctypes.c_int()
    if lib.name_to_handle_at(AT_FDCWD, os.fsencode(path), ctypes.byref(handle), ctypes.byref(mount_id), 0) != 0:
        return False
    try:
        mount_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = lib.open_by_handle_at(mount_fd, ctypes.byref(handle), os.O_PATH | os.O_CLOEXEC)
        if fd < 0:
            return False
        os.close(fd)
        return True
    finally:
        os.close(mount_fd)


class Statx(ctypes.Structure):
    """struct statx (linux/stat.h), up to stx_mnt_id, padded to its 256 bytes."""
    _fields_ = [("stx_mask", ctypes.c_uint32), ("stx_blksize", ctypes.c_uint32), ("stx_attributes", ctypes.c_uint64),
                ("stx_nlink", ctypes.c_uint32), ("stx_uid", ctypes.c_uint32), ("stx_gid", ctypes.c_uint32),
                ("stx_mode", ctypes.c_uint16), ("_spare0", ctypes.c_uint16), ("stx_ino", ctypes.c_uint64),
                ("stx_size", ctypes.c_uint64), ("stx_blocks", ctypes.c_uint64),
                ("stx_attributes_mask", ctypes.c_uint64), ("_times", ctypes.c_byte * 64),
                ("stx_rdev_major", ctypes.c_uint32), ("stx_rdev_minor", ctypes.c_uint32),
                ("stx_dev_major", ctypes.c_uint32), ("stx_dev_minor", ctypes.c_uint32),
                ("stx_mnt_id", ctypes.c_uint64), ("_spare", ctypes.c_uint64 * 13)]


_STATX_MNT_ID = 0x1000
_AT_EMPTY_PATH = 0x1000
_statx_buffers = threading.local()  # one per thread


def mount_id(fd: int) -> int:
    """The mount id of an open file: statx(STATX_MNT_ID), ~1.5 µs; reading
    /proc/self/fdinfo costs ~17 µs (the fallback for kernels before 5.8)."""
    buf = getattr(_statx_buffers, "buf", None)
    if buf is None:
        buf = _statx_buffers.buf = Statx()
    if libc().statx(fd, b"", _AT_EMPTY_PATH, _STATX_MNT_ID, ctypes.byref(buf)) == 0 and buf.stx_mask & _STATX_MNT_ID:
        return int(buf.stx_mnt_id)
    return fdinfo_mount_id(fd)


def fdinfo_mount_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return -1
