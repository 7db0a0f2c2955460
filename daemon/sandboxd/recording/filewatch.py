"""File-access recording with fanotify: one notification group per call, marking only
that call's own bind mounts (reached through /proc/<pid>/root inside the sandbox's mount
namespace). Every event of the group is therefore the call's: no attribution by pid, no
mixing with other sandboxes on the same files. readlink of an event's descriptor gives
the path as the sandbox sees it (/workspace/...); in FID mode (opt-in) an event names its
directory's handle and the file instead. The events are read, and their paths
counted, by native/fanotify-reader.c outside the GIL (a Python loop cost ~10 µs an
event, beside the call); this module marks, syncs and reads the counts back.

Recorded: opens (reported as "read" unless the file was also closed after being opened
for writing: "write"), per path with counts (lower bounds: the kernel merges repeats of
an event that is still queued). Not recorded here: creations, deletions,
renames and mode changes (a mount mark does not carry directory-entry events), opens of
directories, and anything outside the marked mounts (tempDir is a private tmpfs)."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import select
import struct
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from sandboxd.core import assets

log = logging.getLogger("sandboxd.recording.filewatch")

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
_libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]

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
MAX_PATHS = 10_000
# native/fanotify-reader.c (`make native`): reads a group's events and counts their
# paths outside the GIL. The daemon names it from its settings (use_reader_library).
READER_LIBRARY = assets.packaged(assets.FANOTIFY_READER)
# After a read of fewer events than this, the reader lets more gather for a while.
BATCH_EVENTS = 32
BATCH_MS = 2
# Groups waiting for the closer thread; past it a call closes its own (and waits).
MAX_CLOSING = 32


class FileWatchError(Exception):
    pass


_reader: ctypes.CDLL | None = None


def use_reader_library(path) -> None:
    """The reader this process loads (before any watch is made)."""
    global READER_LIBRARY, _reader
    READER_LIBRARY, _reader = path, None


def reader_library() -> ctypes.CDLL:
    """The event reader (loaded once); FileWatchError when it was not built."""
    global _reader
    if _reader is None:
        try:
            lib = ctypes.CDLL(str(READER_LIBRARY))
        except OSError as exc:
            raise FileWatchError(f"the fanotify reader {READER_LIBRARY} cannot be loaded (build it with "
                                 f"`make native`): {exc}") from None
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
        _reader = lib
    return _reader


class Access(NamedTuple):
    """What was counted on one path (lower bounds: the kernel merges repeats of an event
    that is still queued)."""

    path: str
    opens: int = 0
    writes: int = 0

    @property
    def operation(self) -> str:
        return "write" if self.writes else "read"


@dataclass
class FileWatch:
    pid: int  # any process inside the sandbox
    mounts: tuple[str, ...]  # sandbox paths of the call's bind mounts
    # FID mode (one mount, on a filesystem that reports handles: fid_supported; opt-in,
    # settings.file_watch_fid): events carry their directory's handle and the file's
    # name instead of a descriptor, which the kernel need not open nor the reader
    # resolve and close: a quarter of the reader's CPU per event, taken from the
    # command's second core. A directory removed before its events are read cannot be
    # named: those events are counted (unresolved), not listed.
    fid: bool = False
    # Set when the reader could not answer: the record may be incomplete.
    unanswered: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        lib = reader_library()
        self._fw = lib.fw_new(MAX_PATHS)
        if not self._fw:
            raise FileWatchError("the fanotify reader could not allocate its table")
        # Freed once no thread can use it; never at interpreter exit, when a reader that
        # did not stop may still be reading into it.
        weakref.finalize(self, lib.fw_free, self._fw).atexit = False

    @property
    def accesses(self) -> dict[str, Access]:
        """path -> what was counted on it so far."""
        return {a[0]: Access._make(a) for a in self._counted()}

    def _counted(self) -> list[tuple[str, int, int]]:
        """What was counted so far, (path, opens, writes) in byte order of the paths
        (plain tuples: an Access each cost a test run's 3,000 reads a millisecond)."""
        lib = reader_library()
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            need = lib.fw_export(self._fw, buf, size)
            if need < 0:
                raise MemoryError("the fanotify reader could not sort its table")
            if need <= size:
                break
            size = need + (1 << 12)
        raw = buf.raw[:need]
        n = int.from_bytes(raw[:8], "little")
        if not n:
            return []
        counts = memoryview(raw)[8:8 + 8 * n].cast("I").tolist()
        # One decode for all paths (names are bytes; undecodable ones as os.fsdecode).
        paths = raw[8 + 8 * n:-1].decode("utf-8", "surrogateescape").split("\0")
        return list(zip(paths, counts[0::2], counts[1::2]))

    @property
    def dropped(self) -> int:
        """Opens of paths past MAX_PATHS, not listed."""
        return reader_library().fw_dropped(self._fw)

    @property
    def unresolved(self) -> int:
        """FID mode: events in directories removed before their events were read (their
        paths are unknown)."""
        return reader_library().fw_unresolved(self._fw)

    @property
    def unnamed(self) -> int:
        """Events that could not be named otherwise (a path longer than PATH_MAX, an
        error resolving it)."""
        return reader_library().fw_unnamed(self._fw)

    @property
    def overflowed(self) -> bool:
        return bool(reader_library().fw_overflowed(self._fw)) or self.unanswered

    def start(self) -> None:
        self.prepare()
        try:
            self.attach(self.pid)
        except BaseException:
            self.stop()
            raise

    def prepare(self) -> None:
        """The group and its reader, before the sandbox is up (attach marks its mounts)."""
        self.fid = self.fid and len(set(self.mounts)) == 1
        self._mount_fd = -1
        self._ns_fd = -1
        flags = FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_UNLIMITED_QUEUE
        if self.fid:
            flags |= FAN_REPORT_DFID_NAME
        # The descriptors of events open non-blocking: a FIFO in the workspace must not
        # stall the reader (and with it the recording).
        fd = _libc.fanotify_init(flags, os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            raise FileWatchError(f"fanotify_init: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        lib = reader_library()
        lib.fw_set_fd(self._fw, fd)
        # One marked mount (the usual case): every event is through it. Otherwise the
        # reader tells them apart by mount id (attach).
        if len(set(self.mounts)) == 1 and lib.fw_only_mount(self._fw, os.fsencode(self.mounts[0])) != 0:
            raise FileWatchError(f"{self.mounts[0]}: path too long")
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._settled = False  # every event read, and none can have come since (collect)
        self._thread = threading.Thread(target=self._read, daemon=True, name="filewatch")
        self._thread.start()

    def attach(self, pid: int) -> None:
        """Marks the sandbox's mounts, reached through `pid` (any process inside it)."""
        self.pid = pid
        # The sandbox's mount namespace, held until the watch has stopped: a jail's ends
        # with its command, and an event read after that would name its file relative to
        # the mount's own root, which reads the same as a sandbox path when the mount
        # holds a directory named like the mount's path (/workspace/workspace/x).
        try:
            self._ns_fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise FileWatchError(f"the sandbox's mount namespace: {exc}") from None
        if self.fid:
            # Directory handles are opened through the marked mount itself, so their
            # paths are the sandbox's (kept open until the reader has stopped; opened
            # before the mark, so it is no event; not O_PATH, which open_by_handle_at
            # refuses).
            try:
                self._mount_fd = os.open(f"/proc/{pid}/root{self.mounts[0]}",
                                         os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise FileWatchError(f"{self.mounts[0]}: {exc}") from None
            if reader_library().fw_set_fid(self._fw, self._mount_fd) != 0:
                raise FileWatchError("FID mode watches one mount")
            # The mark goes on that same descriptor's mount: nothing can change between.
            if _libc.fanotify_mark(self._fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN | FAN_CLOSE_WRITE,
                                   self._mount_fd, None) < 0:
                raise FileWatchError(f"fanotify_mark {self.mounts[0]}: {os.strerror(ctypes.get_errno())}")
            return
        for mount in self.mounts:
            path = f"/proc/{pid}/root{mount}".encode()
            if len(set(self.mounts)) > 1:
                # Were the namespace gone, readlink would give a path relative to the
                # mount's own root, which the reader puts back under the mount's sandbox
                # path, found by mount id (a defence: the namespace is held above).
                try:
                    probe = os.open(path, os.O_PATH | os.O_CLOEXEC)
                    try:
                        mount_id = _mount_id(probe)
                    finally:
                        os.close(probe)
                except OSError as exc:
                    raise FileWatchError(f"{mount}: {exc}") from None
                if reader_library().fw_add_mount(self._fw, mount_id, os.fsencode(mount)) != 0:
                    raise FileWatchError(f"{mount}: too many mounts or too long a path")
            # Opens, and closes of files opened for writing: FAN_MODIFY would add one
            # event per write() of a write-heavy command for nothing more.
            if _libc.fanotify_mark(self._fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN | FAN_CLOSE_WRITE,
                                   AT_FDCWD, path) < 0:
                raise FileWatchError(f"fanotify_mark {mount}: {os.strerror(ctypes.get_errno())}")

    def begin(self) -> None:
        """A new command's record from here on (a watch kept on a warm sandbox between
        its commands): whatever was queued before is read and dropped first. Right
        after collect() nothing can be (the sandbox was idle): no round trip then."""
        if not self._settled:
            self._sync()
        self._settled = False
        reader_library().fw_reset(self._fw)
        self.unanswered = False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def unrecorded(self) -> None:
        """A command runs in the sandbox without being recorded: begin() must drop its
        events, not assume there are none."""
        self._settled = False

    def collect(self) -> list[tuple[str, int, int]]:
        """What was opened since begin(), (path, opens, writes) in path order, once every event queued so far
        has been read; the watch stays on for the next command."""
        self._sync()
        self._settled = True
        return self._counted()

    def _sync(self) -> None:
        """Returns once everything queued before this call is counted: drained here, on
        the caller's thread (fw_drain holds the table's lock from its read to its last
        count, so what the reader thread took meanwhile is counted too). A round trip
        to the reader thread cost a leased command two thread switches."""
        if not self._thread.is_alive():
            # A reader that died lost what it had read: the record cannot be complete.
            self.unanswered = True
        try:
            while self._drain():
                pass
        except Exception as exc:  # noqa: BLE001 - the call's record says it is incomplete
            log.error("the file watch of pid %d could not be read: %s; its records may be incomplete", self.pid, exc)
            self.unanswered = True

    def stop(self) -> list[tuple[str, int, int]]:
        """What the call touched, (path, opens, writes) in path order (the queue drained first)."""
        # No new events from here on (what is queued stays queued and is read below).
        _libc.fanotify_mark(self._fd, FAN_MARK_FLUSH | FAN_MARK_MOUNT, 0, AT_FDCWD, None)
        if not self._thread.is_alive():
            self.unanswered = True  # the reader died: what it had read is lost
        os.write(self._stop_w, b"x")
        self._thread.join(10)
        if self._thread.is_alive():
            # Never close descriptors under a thread that still uses them: leak them.
            log.error("the file watch of pid %d did not stop; its records may be incomplete", self.pid)
            self.unanswered = True
        else:
            os.close(self._stop_r)
            os.close(self._stop_w)
            # Closing a group waits for an SRCU grace period in the kernel (5-15 ms
            # here): off the call's path. Nothing reads it any more; a later call's
            # accesses are its own group's.
            _close_later(self._fd)
            if self._mount_fd >= 0:
                reader_library().fw_set_fid(self._fw, -1)  # never a stale descriptor number
                os.close(self._mount_fd)
                self._mount_fd = -1
        if self._ns_fd >= 0:
            # Whether or not the reader stopped (it never uses this one), and here, not
            # later: the sandbox's removal that follows must find its mounts released.
            # The last holder's close unmounts the namespace's tree on this thread (0.06 ms
            # for binds, ~3 ms for a tmpfs holding 20 MB), which the jail's own exit did
            # before.
            os.close(self._ns_fd)
            self._ns_fd = -1
        return self._counted()

    def _read(self) -> None:
        try:
            self._read_until_stopped()
        except Exception:  # e.g. the kernel could not make an event's descriptor (EMFILE): it is gone
            log.exception("the file watch of pid %d stopped reading; its records are incomplete", self.pid)
            self.unanswered = True

    def _read_until_stopped(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        stop_only = select.poll()
        stop_only.register(self._stop_r, select.POLLIN)
        stopping = False
        while True:
            ready = {fd for fd, _ in poller.poll(None if not stopping else 0)}
            if self._stop_r in ready:
                # "x": stop, once everything queued is read.
                stopping = b"x" in os.read(self._stop_r, 4096) or stopping
                while self._drain():
                    pass
            if self._fd in ready or stopping:
                read = self._drain()
                if not read and stopping:
                    return
                if not stopping and read < BATCH_EVENTS:
                    # A trickle: let events gather. A wake-up per event (a command
                    # opening thousands of files one after another) cost the reader twice
                    # the CPU, taken from the command's second core. A burst is read at
                    # once, so that little is left to read once the command has ended;
                    # a stop ends the nap at once.
                    stop_only.poll(BATCH_MS)

    def _drain(self) -> int:
        """Reads what is queued; returns how many events (0: nothing was)."""
        n = reader_library().fw_drain(self._fw)  # without the GIL
        if n < 0:
            raise OSError(-n, os.strerror(-n))
        return n

    def _note(self, path: str, mask: int) -> None:
        """Counts one event on `path`, as the reader does for each it reads."""
        raw = os.fsencode(path)
        reader_library().fw_note(self._fw, raw, len(raw), mask)


# inotify, for the gate here and for live_snapshot's trackers.
IN_OPEN = 0x20
_INOTIFY_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


def inotify_init() -> int:
    """A non-blocking, close-on-exec inotify instance (OSError when there is none)."""
    fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def inotify_add_watch(fd: int, path: str, mask: int) -> int:
    wd = _libc.inotify_add_watch(fd, os.fsencode(path), mask)
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


class GateArrival:
    """Wakes when the sandbox's shim opens its gate FIFO (inotify IN_OPEN), which it
    does only once the sandbox is up: no polling of the sandbox's processes."""

    def __init__(self, gate_path: str):
        try:
            fd = inotify_init()
        except OSError as exc:
            raise FileWatchError(f"inotify_init1: {exc.strerror}") from None
        try:
            inotify_add_watch(fd, gate_path, IN_OPEN)
        except OSError as exc:
            os.close(fd)
            raise FileWatchError(f"inotify_add_watch {gate_path}: {exc.strerror}") from None
        self._fd = fd
        self.arrived = False

    def wait(self, timeout_s: float) -> bool:
        """True once the gate was opened (within `timeout_s` from now, or before)."""
        if not self.arrived:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            if poller.poll(max(0, int(timeout_s * 1000))):
                try:
                    buf = os.read(self._fd, 4096)
                except BlockingIOError:
                    buf = b""
                self.arrived = any(mask & IN_OPEN for _wd, mask in inotify_events(buf))
        return self.arrived

    def close(self) -> None:
        """Off the caller's thread: closing an inotify instance, like a fanotify group,
        waits for the kernel's SRCU grace period (5-15 ms)."""
        if self._fd >= 0:
            _close_later(self._fd)
            self._fd = -1


_fid_by_device: dict[int, bool] = {}


def fid_supported(host_path: str) -> bool:
    """Whether the filesystem holding `host_path` can report directory handles and names
    (FID mode) through a mount mark: a test group marks the path's mount for a moment
    (and is closed unread), once per device. Not every filesystem can (overlayfs
    without nfs_export: inode marks would pass there, mount marks do not)."""
    try:
        dev = os.stat(host_path).st_dev
    except OSError:
        return False
    known = _fid_by_device.get(dev)
    if known is None:
        fd = _libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_DFID_NAME, os.O_RDONLY)
        if fd < 0:
            return False  # (not remembered: the limit on groups, say, may pass)
        marked = _libc.fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN | FAN_CLOSE_WRITE, AT_FDCWD,
                                     os.fsencode(host_path)) == 0
        # The mark goes at once (every open on that mount queues an event while it is
        # there); the group, whose close waits for the kernel, later.
        _libc.fanotify_mark(fd, FAN_MARK_FLUSH | FAN_MARK_MOUNT, 0, AT_FDCWD, None)
        _close_later(fd)
        # The reader opens directory handles: that needs CAP_DAC_READ_SEARCH too.
        known = marked and _handles_open(host_path)
        _fid_by_device[dev] = known
    return known


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 128)]


_libc.name_to_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_FileHandle),
                                    ctypes.POINTER(ctypes.c_int), ctypes.c_int]
_libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.POINTER(_FileHandle), ctypes.c_int]


def _handles_open(path: str) -> bool:
    """Whether a handle of `path` can be made and opened again (as the reader will)."""
    handle, mount_id = _FileHandle(handle_bytes=128), ctypes.c_int()
    if _libc.name_to_handle_at(AT_FDCWD, os.fsencode(path), ctypes.byref(handle), ctypes.byref(mount_id), 0) != 0:
        return False
    try:
        mount_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = _libc.open_by_handle_at(mount_fd, ctypes.byref(handle), os.O_PATH | os.O_CLOEXEC)
        if fd < 0:
            return False
        os.close(fd)
        return True
    finally:
        os.close(mount_fd)


def _close_later(fd: int) -> None:
    if _closer.qsize() < MAX_CLOSING:
        _closer.put(fd)
    else:  # falling behind: each open group counts against the host's limits
        os.close(fd)


def _close_groups(q: "queue.SimpleQueue[int]") -> None:
    while True:
        fd = q.get()
        try:
            os.close(fd)
        except OSError as exc:  # never lose the closer: later groups would leak
            log.error("closing fanotify group %d failed: %s", fd, exc)


_closer: "queue.SimpleQueue[int]" = queue.SimpleQueue()
threading.Thread(target=_close_groups, args=(_closer,), daemon=True, name="fanotify-closer").start()


class _Statx(ctypes.Structure):
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
_statx_buffers = threading.local()  # one per reader thread


def _mount_id(fd: int) -> int:
    """The mount id of an open file: statx(STATX_MNT_ID), ~1.5 µs; reading
    /proc/self/fdinfo costs ~17 µs, once per event (the fallback for kernels before 5.8)."""
    buf = getattr(_statx_buffers, "buf", None)
    if buf is None:
        buf = _statx_buffers.buf = _Statx()
    if _libc.statx(fd, b"", _AT_EMPTY_PATH, _STATX_MNT_ID, ctypes.byref(buf)) == 0 and buf.stx_mask & _STATX_MNT_ID:
        return buf.stx_mnt_id
    return _fdinfo_mount_id(fd)


def _fdinfo_mount_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return -1
