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
directories, and anything outside the marked mounts (tempDir is a private tmpfs).

Beside it: fanotify.py (constants, mount ids, the FID probe), fanotify_reader.py (the
native reader, loaded on first use from the setting file_audit.reader_library),
closer.py (groups closed off the call's path), gate.py (the sandbox's arrival),
inotify.py; their public names are re-exported here."""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

from sandboxd.recording.closer import MAX_CLOSING, close_later
from sandboxd.recording.errors import FileWatchError
from sandboxd.recording.fanotify import (AT_FDCWD, FAN_CLASS_NOTIF, FAN_CLOEXEC, FAN_CLOSE_WRITE, FAN_MARK_ADD,
                                         FAN_MARK_FLUSH, FAN_MARK_MOUNT, FAN_MODIFY, FAN_NONBLOCK, FAN_OPEN,
                                         FAN_Q_OVERFLOW, FAN_REPORT_DFID_NAME, FAN_UNLIMITED_QUEUE, fid_supported,
                                         mount_id)
from sandboxd.recording.fanotify_reader import reader_library, reader_library_path, use_reader_library
from sandboxd.recording.gate import GateArrival
from sandboxd.recording.inotify import IN_OPEN, inotify_add_watch, inotify_events, inotify_init
from sandboxd.recording.libc import libc

# The names this module has always offered (calls/ imports them from here).
__all__ = ["AT_FDCWD", "BATCH_EVENTS", "BATCH_MS", "FAN_CLASS_NOTIF", "FAN_CLOEXEC", "FAN_CLOSE_WRITE", "FAN_MARK_ADD",
           "FAN_MARK_FLUSH", "FAN_MARK_MOUNT", "FAN_MODIFY", "FAN_NONBLOCK", "FAN_OPEN", "FAN_Q_OVERFLOW",
           "FAN_REPORT_DFID_NAME", "FAN_UNLIMITED_QUEUE", "IN_OPEN", "MAX_CLOSING", "MAX_PATHS", "Access", "FileWatch",
           "FileWatchError", "GateArrival", "fid_supported", "inotify_add_watch", "inotify_events", "inotify_init",
           "reader_library", "reader_library_path", "use_reader_library"]

log = logging.getLogger("sandboxd.recording.filewatch")

MAX_PATHS = 10_000
# After a read of fewer events than this, the reader lets more gather for a while.
BATCH_EVENTS = 32
BATCH_MS = 2


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
        fd = libc().fanotify_init(flags, os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC | os.O_NONBLOCK)
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
            if libc().fanotify_mark(self._fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN | FAN_CLOSE_WRITE,
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
                        marked_mount = mount_id(probe)
                    finally:
                        os.close(probe)
                except OSError as exc:
                    raise FileWatchError(f"{mount}: {exc}") from None
                if reader_library().fw_add_mount(self._fw, marked_mount, os.fsencode(mount)) != 0:
                    raise FileWatchError(f"{mount}: too many mounts or too long a path")
            # Opens, and closes of files opened for writing: FAN_MODIFY would add one
            # event per write() of a write-heavy command for nothing more.
            if libc().fanotify_mark(self._fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN | FAN_CLOSE_WRITE,
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
        libc().fanotify_mark(self._fd, FAN_MARK_FLUSH | FAN_MARK_MOUNT, 0, AT_FDCWD, None)
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
            close_later(self._fd)
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
