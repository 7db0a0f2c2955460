"""One call's file-access recording, entered by the run as a context manager: the
before-snapshot of the writable mounts, the fanotify watch (attached behind the gate for
a fresh sandbox, the kept one of a leased sandbox), the after-snapshot once the command's
processes are gone, and their merge into the call's FileRecord with what limited it.
A recording that cannot start fails the call: a call never runs unrecorded."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from sandboxd.core.errors import FailedPrecondition
from sandboxd.recording import activity
from sandboxd.recording import snapshot
from sandboxd.recording.changes import ChangedFile, changed_files
from sandboxd.recording.filewatch import MAX_PATHS as MAX_WATCHED_PATHS
from sandboxd.recording.filewatch import FileWatch, FileWatchError, GateArrival
from sandboxd.recording.live_snapshot import LiveSnapshots
from sandboxd.sandbox.protocol import Process

log = logging.getLogger("sandboxd.recording.recorder")
# How long a started sandbox may take to show a process the file watch can attach to.
GATE_TIMEOUT_S = 10.0

WriteRoots = list[tuple[str, str]]  # (sandbox path, host path) of each writable mount


@dataclass
class FileRecord:
    """What a call did to files: FileAccessObserved entries, and why they may not be all."""
    events: activity.FileEvents = field(default_factory=lambda: activity.FileEvents([], []))
    incomplete: list[str] = field(default_factory=list)
    # The regular files the call created, modified, renamed or deleted (its artifacts' source).
    changed: list[ChangedFile] = field(default_factory=list)


def _watch_gaps(watch: Any) -> list[str]:
    gaps: list[str] = []
    if watch.overflowed:
        gaps.append("the kernel's event queue overflowed: some opens were not recorded")
    if watch.dropped:
        gaps.append(f"more than {MAX_WATCHED_PATHS} paths were opened: {watch.dropped} opens of "
                    "further paths are not listed")
    if watch.unresolved:
        gaps.append(f"{watch.unresolved} events were in directories removed before they were read: "
                    "their paths are unknown")
    if watch.unnamed:
        gaps.append(f"{watch.unnamed} events could not be named (a path longer than the system's limit, "
                    "or an error resolving it)")
    return gaps


def file_record(accesses: Sequence[tuple[str, int, int]], watch: Any, before: snapshot.Snapshot | None,
                after: snapshot.Snapshot | None) -> FileRecord:
    """The watch's accesses and the snapshots' changes merged into one record. `watch`
    gives the watch's counts of what it missed (overflowed, dropped, unresolved, unnamed)."""
    incomplete = _watch_gaps(watch)
    changes: list[dict[str, Any]] = []
    if before is not None:
        if after is None:
            incomplete.append("the write roots could not be walked after the call: no hashes after, "
                              "creations, deletions and renames not compared")
        else:
            for gap in dict.fromkeys(before.gaps + after.gaps):
                incomplete.append(gap)
            if before.complete and after.complete:
                changes = activity.diff(before.entries, after.entries,
                                        LiveSnapshots.changed_between(before, after))
            else:
                incomplete.append("creations, deletions and renames were not compared")
            unhashed = {p for s in (before, after) if s.unhashed for p, e in s.entries.items() if e.note}
            if unhashed:
                incomplete.append(f"{len(unhashed)} files have no content hash (over the hashing caps or "
                                  "unreadable): see sha256BeforeMissing / sha256AfterMissing")
    before_entries, after_entries = before.entries if before else {}, after.entries if after else {}
    changed = changed_files(changes, before_entries, after_entries)
    events = activity.file_events(list(accesses), changes, before_entries, after_entries)
    return FileRecord(events, [activity.printable(gap) for gap in incomplete], changed)  # gaps name paths


def make_gate(path: Path, uid: int, gid: int) -> None:
    """The FIFO a fresh sandbox's shim waits at until its mounts are watched."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    os.chmod(path.parent, 0o711)
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)
    os.chown(path, uid, gid)


class GatedWatch:
    """A fresh sandbox's watch: the command waits at a gate (a FIFO) until a fanotify
    watch is attached to the sandbox's own mounts, then the gate opens."""

    walks_before_create = False  # the sandbox's mounts are written only by its command

    def __init__(self, gate_path: str, uid: int, gid: int, mounts: tuple[str, ...], fid: Callable[[], bool],
                 label: str):
        self._gate_path = gate_path
        self._uid, self._gid = uid, gid
        self._mounts = mounts
        self._fid = fid
        self._label = label
        self._arrival: GateArrival | None = None
        self._gate_fd = -1

    def before_create(self) -> None:
        make_gate(Path(self._gate_path), self._uid, self._gid)
        try:
            self._arrival = GateArrival(self._gate_path)  # before the sandbox can reach it
        except FileWatchError as exc:  # out of inotify instances: the sandbox's pid is polled
            log.warning("call %s: the gate's arrival is polled for: %s", self._label, exc)

    def created(self) -> FileWatch | None:
        return None

    def started(self, process: Process) -> FileWatch:
        """Attaches a fanotify watch to the call's own mounts, then lets the command go."""
        watch = FileWatch(0, self._mounts, fid=self._fid())
        try:
            watch.prepare()  # while the sandbox comes up: only its marks wait for it
        except FileWatchError as exc:
            raise FailedPrecondition(f"file-access recording could not start: {exc}") from None
        try:
            pid = self._await_sandbox(process)
            try:
                watch.attach(pid)
            except FileWatchError as exc:
                raise FailedPrecondition(f"file-access recording could not start: {exc}") from None
            fd = os.open(self._gate_path, os.O_RDWR | os.O_CLOEXEC)  # never blocks on a FIFO
            try:
                os.write(fd, b"1")
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            watch.stop()
            raise
        self._gate_fd = fd
        return watch

    def _await_sandbox(self, process: Process) -> int:
        deadline = time.monotonic() + GATE_TIMEOUT_S
        pid = 0
        while not pid and time.monotonic() < deadline and not process.output_ended():
            # The shim opens the gate once the sandbox is up: its mounts are final.
            # (Without the inotify instance, the sandbox's pid says when it is up.)
            if self._arrival is None or self._arrival.wait(0.05):
                pid = process.pid()
                if not pid:
                    time.sleep(0.0005)
        if not pid:
            raise FailedPrecondition("the sandbox never came up to be watched")
        return pid

    @staticmethod
    def collect(watch: FileWatch) -> list[tuple[str, int, int]]:
        return watch.stop()

    def close(self) -> None:
        if self._arrival is not None:
            self._arrival.close()
        if self._gate_fd >= 0:
            os.close(self._gate_fd)
            self._gate_fd = -1
        Path(self._gate_path).unlink(missing_ok=True)


class WatchKeeper(Protocol):
    """A leased sandbox: it keeps one watch across its commands."""
    watch: FileWatch | None

    def init_pid(self) -> int: ...


class KeptWatch:
    """A leased sandbox's watch on its mounts, begun for one command before the
    supervisor is told to spawn it. Attached at the sandbox's first recorded command and
    kept until it is destroyed: the sandbox is idle between commands, so what a watch
    reads between begin() and collect() is that command's."""

    walks_before_create = True  # the sandbox is idle until its command is spawned

    def __init__(self, keeper: WatchKeeper, mounts: tuple[str, ...], fid: Callable[[], bool],
                 broken: Callable[[str], Exception]):
        self._keeper = keeper
        self._mounts = mounts
        self._fid = fid
        self._broken = broken

    def before_create(self) -> None:
        return None

    def created(self) -> FileWatch:
        ws = self._keeper
        pid = ws.init_pid()
        if not pid:
            raise self._broken("the sandbox's supervisor is gone (its init exited)")
        if ws.watch is not None and not ws.watch.alive:  # its reader failed: a new watch, not a blind one
            ws.watch.stop()
            ws.watch = None
        if ws.watch is None:
            watch = FileWatch(pid, self._mounts, fid=self._fid())
            try:
                watch.start()
            except FileWatchError as exc:
                raise FailedPrecondition(f"file-access recording could not start: {exc}") from None
            ws.watch = watch
        ws.watch.begin()
        return ws.watch

    def started(self, process: Process) -> FileWatch | None:
        return None

    @staticmethod
    def collect(watch: FileWatch) -> list[tuple[str, int, int]]:
        return watch.collect()

    def close(self) -> None:
        return None


Watcher = GatedWatch | KeptWatch


class FileRecorder:
    """The run enters it around the command and calls its three hooks (before the sandbox
    is created, once it is, once it started); after the exit, `record` is the call's file
    record. `watcher` None records nothing (the write roots are still refreshed)."""

    def __init__(self, watcher: Watcher | None, write_roots: WriteRoots,
                 walk: Callable[[WriteRoots], snapshot.Snapshot], refresh: Callable[[WriteRoots], None],
                 label: str):
        self._watcher = watcher
        self._writable = write_roots
        self._walk = walk
        self._refresh = refresh
        self._label = label
        self._watch: FileWatch | None = None
        self._accesses: list[tuple[str, int, int]] = []
        self._before: snapshot.Snapshot | None = None
        self._after: snapshot.Snapshot | None = None
        self.record = FileRecord()

    def __enter__(self) -> "FileRecorder":
        return self

    def before_create(self) -> None:
        if self._watcher is None:
            return
        self._watcher.before_create()
        if self._watcher.walks_before_create and self._writable:
            self._before = self._walk_before()

    def sandbox_created(self) -> None:
        if self._watcher is not None:
            self._watch = self._watcher.created() or self._watch

    def sandbox_started(self, process: Process) -> None:
        if self._watcher is None or self._watcher.walks_before_create:
            return
        if self._writable:
            # Walked while the sandbox comes up, on this thread (a kept snapshot takes
            # well under a millisecond; a thread for it cost more).
            self._before = self._walk_before()
        # The command waits at the gate until its mounts are watched.
        self._watch = self._watcher.started(process)

    def _walk_before(self) -> snapshot.Snapshot:
        """A walk that fails fails the call (it never runs unrecorded)."""
        try:
            return self._walk(self._writable)
        except Exception as exc:
            log.exception("walking the write roots of %s failed", self._label)
            raise FailedPrecondition(f"file-access recording could not walk the write roots: {exc}") from None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()
        if self._watch is not None:
            try:
                self.record = file_record(self._accesses, self._watch, self._before, self._after)
            except Exception as err:  # the call's result is still recorded, saying so
                log.exception("making the file record of %s failed", self._label)
                self.record = FileRecord(incomplete=[f"the file record could not be made: {err}"])

    def _stop(self) -> None:
        """The watch read out and the write roots walked after the command; nothing here
        may keep the sandbox from being destroyed."""
        if self._watch is not None and self._watcher is not None:
            try:
                self._accesses = self._watcher.collect(self._watch)
            except Exception:
                log.exception("stopping the file watch of %s failed", self._label)
        if self._before is not None and self._watch is not None:
            # The command's processes are gone (a leased sandbox's next command waits
            # for this). On this thread: a kept snapshot takes well under a
            # millisecond, and a thread for it beside the removal cost more.
            try:
                self._after = self._walk(self._writable)
            except Exception:
                log.exception("walking the write roots of %s failed", self._label)
        if self._watcher is not None:
            try:
                self._watcher.close()
            except OSError:
                log.exception("removing the file-watch gate of %s failed", self._label)

    def refresh_unseen(self) -> None:
        """A sandbox that ran may have changed its write roots unseen: their kept
        snapshots catch up now, not in the next recording call's first snapshot."""
        if not self._writable or self._after is not None:
            return
        try:
            self._refresh(self._writable)
        except Exception:
            log.exception("asking for the write roots of %s to be refreshed failed", self._label)
