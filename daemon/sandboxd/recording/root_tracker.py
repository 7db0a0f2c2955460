"""Snapshots of write roots kept current by inotify between and during calls, so that a
call's before/after snapshots cost O(what changed) instead of a walk of the whole tree.

A `RootTracker` walks its root once, watching every directory (the watch is added
before the directory is listed, so nothing created meanwhile is missed), and afterwards
only rescans the directories that events name: creations, deletions and renames of
their entries, writes to and closes after writing of their files, attribute changes.
Events are queued by the kernel as the change happens, so draining the queue once a
call's processes are gone yields every change they made. The result is, entry for
entry, what `snapshot.take` would walk at that moment (tests hold the two against each
other after random changes).

Every entry but a directory or a symlink has a watch on its inode itself, so a change
made through any of its links (another path in the tree, a link from outside it, one
made and removed within a call) is seen; directories' watches report their entries made,
removed and renamed. A queue overflow, a replaced root, the watch limit, an entry cap,
an error a walk would report as a gap, or a tree that never settles: the root is walked
in full instead (and for a while after, when its tracker gave up)."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Iterator

from sandboxd.recording.inotify import (IN_ATTRIB, IN_CLOSE_WRITE, IN_CREATE, IN_DELETE, IN_DELETE_SELF,
                                        IN_DONT_FOLLOW, IN_IGNORED, IN_MODIFY, IN_MOVE_SELF, IN_MOVED_FROM,
                                        IN_MOVED_TO, IN_ONLYDIR, IN_Q_OVERFLOW, inotify_add_watch, inotify_events,
                                        inotify_init)
from sandboxd.recording.snapshot import _OPEN_DIR, MAX_DEPTH, Entry, HashBudget, HashCache, Snapshot, _open_beneath_root
from sandboxd.recording.tree_record import TreeRecord

# A directory's own watch: its entries made, removed, renamed; its own attributes (and
# its children's: IN_ATTRIB reaches a directory's watch for them too). Writes are left to
# the files' own watches: a stream of writes to one file then queues one event, not two
# alternating ones that the kernel could not merge.
_DIR_MASK = (IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
             | IN_ONLYDIR)
# Every other entry's (but symlinks) own inode: written, closed after writing, attributes
# (mode, times, its link count) changed, renamed (which moves its ctime: its other links'
# entries must follow), through whichever of its links.
_FILE_MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVE_SELF | IN_DONT_FOLLOW



class Untrackable(Exception):
    """This root cannot be tracked right now: the caller walks it instead."""


class RootTracker(TreeRecord):
    """One write root (a directory) as `sandbox_root` sees it, kept current."""

    def __init__(self, sandbox_root: str, host_root: str, hashes: HashCache | None) -> None:
        super().__init__(sandbox_root, hashes)
        self.host_root = host_root
        self._ifd = -1
        self.closed = False
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self._valid = False
        self._wd_dir: dict[int, str] = {}
        self._dir_wd: dict[str, int] = {}
        self._wd_inode: dict[int, tuple[int, int]] = {}  # a watched file's (dev, inode)
        self._dirty: set[str] = set()
        self._root_id: tuple[int, int] = (0, 0)
        self.full_walks = 0  # for tests and metrics
        self.caps = (0, 0, 0)  # the last call's hashing budget, largest file and entry cap
        self.ahead = 0  # refreshes ahead since a call last used it

    def close(self) -> None:
        if self._ifd >= 0:
            os.close(self._ifd)
            self._ifd = -1
        self._valid = False
        self.closed = True

    def fileno(self) -> int:
        return self._ifd

    def snapshot(self, budget: HashBudget, max_entries: int, *, use: bool = True) -> Snapshot:
        """The root's entries now; raises Untrackable when only a walk can tell. `use`
        False: a refresh ahead of the next call (it does not keep the tracker alive)."""
        if use:
            self.last_used = time.monotonic()
            self.caps = (budget.bytes_left, budget.max_file, max_entries)
            self.ahead = 0
        root_fd = self._open_root()
        try:
            for _ in range(2):
                if self._ifd >= 0:
                    self._drain()
                st = os.fstat(root_fd)
                if not self._valid or (st.st_dev, st.st_ino) != self._root_id:
                    self._full_walk(root_fd, budget, max_entries)
                self._refresh(root_fd, budget, max_entries)
                st = os.fstat(root_fd)
                if self._valid and (st.st_dev, st.st_ino) == self._root_id:
                    break
            else:  # overflowed (or the root replaced) twice while being brought up to date
                raise Untrackable("the tree changed faster than it could be followed")
            if len(self._entries) > max_entries:
                raise Untrackable("over the entry cap")
        except BaseException:
            self._valid = False
            raise
        finally:
            os.close(root_fd)
        return self._hand_out()

    # -- events -------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                buf = os.read(self._ifd, 256 * 1024)
            except BlockingIOError:
                return
            for wd, mask in inotify_events(buf):
                if mask & IN_Q_OVERFLOW:
                    self._valid = False
                    continue
                inode = self._wd_inode.get(wd)
                if inode is not None:  # a file's own watch: whichever link it was changed through
                    if mask & IN_IGNORED:
                        del self._wd_inode[wd]
                    self._dirty |= {p.rsplit("/", 1)[0] for p in self._paths_of.get(inode, ())}
                    continue
                path = self._wd_dir.get(wd)
                if path is None:
                    continue
                if mask & (IN_IGNORED | IN_DELETE_SELF):
                    if path == self.sandbox_root:
                        self._valid = False
                    elif self._dir_wd.get(path) == wd:
                        # Gone: a directory made in its place may get its inode number.
                        self._forget_subtree(path)
                        self._drop(path)
                        self._dirty.add(path.rsplit("/", 1)[0])
                    if mask & IN_IGNORED:
                        del self._wd_dir[wd]
                    continue
                if mask & IN_MOVE_SELF:
                    if path == self.sandbox_root:
                        self._valid = False  # the root itself moved: walk what is there now
                    continue  # its old and new parents' own events rescan both places
                self._dirty.add(path)

    # -- walking ------------------------------------------------------------------------
    def _open_root(self) -> int:
        try:
            parent_fd = _open_beneath_root(os.path.dirname(self.host_root))
        except OSError as exc:
            raise Untrackable(str(exc)) from None
        try:
            return os.open(os.path.basename(self.host_root), _OPEN_DIR, dir_fd=parent_fd)
        except OSError as exc:
            raise Untrackable(str(exc)) from None
        finally:
            os.close(parent_fd)

    def _full_walk(self, root_fd: int, budget: HashBudget, max_entries: int) -> None:
        self.full_walks += 1
        # A fresh instance: watches of the old tree must not name paths of the new one.
        if self._ifd >= 0:
            os.close(self._ifd)
        try:
            self._ifd = inotify_init()
        except OSError as exc:
            self._ifd = -1
            raise Untrackable(f"inotify_init1: {exc.strerror}") from None
        self._forget_all()
        self._wd_dir, self._dir_wd, self._wd_inode, self._dirty = {}, {}, {}, set()
        st = os.fstat(root_fd)
        self._root_id = (st.st_dev, st.st_ino)
        self._valid = True
        self._walk_new(os.dup(root_fd), self.sandbox_root, budget, max_entries, 0)

    def _refresh(self, root_fd: int, budget: HashBudget, max_entries: int) -> None:
        # A file left unhashed (over one snapshot's budget, unreadable) is tried again,
        # as a walk would.
        self._dirty |= {p.rsplit("/", 1)[0] for p in self._unhashed}
        rescans_left = 2 * len(self._children) + 100  # a tree that never settles is walked
        while self._dirty and self._valid:
            rescans_left -= 1
            if rescans_left < 0:
                raise Untrackable("the tree kept changing while it was rescanned")
            path = min(self._dirty, key=lambda p: (p.count("/"), p))  # parents first
            self._dirty.discard(path)
            if path != self.sandbox_root and path not in self._children:
                continue  # no longer a directory of the tree (its parent's rescan said so)
            fd = self._open_dir(root_fd, path)
            if fd < 0:
                if path == self.sandbox_root:
                    raise Untrackable("the write root cannot be opened")
                self._dirty.add(path.rsplit("/", 1)[0])
                continue
            self._rescan(fd, path, budget, max_entries)
            self._drain()  # what the rescan itself raced with

    def _open_dir(self, root_fd: int, path: str) -> int:
        """A descriptor of the tree's directory `path`, reached from the root without
        following symlinks; -1 when it is no longer a directory there."""
        fd = os.dup(root_fd)
        try:
            for part in [p for p in path[len(self.sandbox_root):].split("/") if p]:
                nxt = os.open(part, _OPEN_DIR, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return -1
            raise Untrackable(f"{path}: {exc.strerror}") from None  # EMFILE, EACCES: a walk says it
        return fd

    def _add_watch(self, target: str, mask: int, what: str) -> int:
        try:
            return inotify_add_watch(self._ifd, target, mask)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return -1
            raise Untrackable(f"inotify_add_watch {what}: {exc.strerror}"
                            + (" (fs.inotify.max_user_watches)" if exc.errno == errno.ENOSPC else "")) from None

    def _watch_dir(self, fd: int, path: str) -> None:
        wd = self._add_watch(f"/proc/self/fd/{fd}", _DIR_MASK, path)
        old = self._wd_dir.get(wd)
        if old is not None and old != path and self._dir_wd.get(old) == wd:
            del self._dir_wd[old]  # the same directory, moved: its watch follows it
        self._wd_dir[wd] = path
        self._dir_wd[path] = wd

    def _examine(self, dir_fd: int, e: os.DirEntry) -> os.stat_result | None:
        """An entry's stat; None when it is gone. Any entry but a directory or a symlink
        gets a watch on its inode itself first (so no change after the stat is missed):
        a change through any of its links, in the tree or not, is announced there."""
        if e.is_dir(follow_symlinks=False) or e.is_symlink():
            return e.stat(follow_symlinks=False)
        wd = self._add_watch(f"/proc/self/fd/{dir_fd}/{e.name}", _FILE_MASK, e.name)
        if wd < 0:
            return None
        st = os.stat(e.name, dir_fd=dir_fd, follow_symlinks=False)
        self._wd_inode[wd] = (st.st_dev, st.st_ino)
        return st

    def _walk_new(self, fd: int, path: str, budget: HashBudget, max_entries: int, depth: int) -> None:
        """Watches and lists a directory new to the tracker, and everything below it.
        Takes ownership of `fd`."""
        try:
            if depth > MAX_DEPTH:
                raise Untrackable(f"{path}: deeper than {MAX_DEPTH} levels")
            self._watch_dir(fd, path)  # before the listing: nothing created meanwhile is missed
            names: set[str] = set()
            subdirs = []
            for name, st in self._listing(fd, path):
                if len(self._entries) >= max_entries:
                    raise Untrackable("over the entry cap")
                names.add(name)
                self._set(f"{path}/{name}", self._entry(fd, name, st, budget))
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(name)
            self._children[path] = names
            self._walk_below(fd, path, subdirs, budget, max_entries, depth + 1)
        finally:
            os.close(fd)

    def _listing(self, fd: int, path: str) -> Iterator[tuple[str, os.stat_result]]:
        """(name, stat) of each entry of a directory, examined (and watched) as it comes;
        one gone since the listing is left out."""
        with os.scandir(fd) as it:
            for e in it:
                try:
                    st = self._examine(fd, e)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise Untrackable(f"{path}/{e.name}: {exc.strerror}") from None
                if st is not None:
                    yield e.name, st

    def _walk_below(self, fd: int, path: str, subdirs: list[str], budget: HashBudget, max_entries: int,
                    depth: int) -> None:
        for name in subdirs:
            try:
                sub = os.open(name, _OPEN_DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    self._dirty.add(path)  # changed since the listing: look again
                    continue
                raise Untrackable(f"{path}/{name}: {exc.strerror}") from None
            self._walk_new(sub, f"{path}/{name}", budget, max_entries, depth)

    def _forget_subtree(self, path: str) -> None:
        prefix = path + "/"
        for p in [p for p in self._entries if p.startswith(prefix)]:
            self._drop(p)
        for d in [d for d in self._children if d == path or d.startswith(prefix)]:
            del self._children[d]
            wd = self._dir_wd.pop(d, None)
            if wd is not None and self._wd_dir.get(wd) == d:
                del self._wd_dir[wd]  # its kernel watch stays until IN_IGNORED (or it reappears)
            self._dirty.discard(d)

    def _rescan(self, fd: int, path: str, budget: HashBudget, max_entries: int) -> None:
        """Lists one known directory again: entries added, removed or changed in it.
        Takes ownership of `fd`."""
        try:
            self._watch_dir(fd, path)  # the same watch if it had one; a new one if it was replaced
            if path != self.sandbox_root:
                # Its own entry (listed in its parent) moves with every change inside it.
                st = os.fstat(fd)
                self._set(path, Entry(st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                      "", "", st.st_dev))
            old = self._children.get(path, set())
            names: set[str] = set()
            new_dirs = []
            for name, st in self._listing(fd, path):
                child = f"{path}/{name}"
                names.add(name)
                was = self._entries.get(child)
                if was is not None and stat.S_ISDIR(was.mode) and (
                        not stat.S_ISDIR(st.st_mode) or (was.dev, was.inode) != (st.st_dev, st.st_ino)):
                    self._forget_subtree(child)  # a different directory (or none) now
                    was = None
                if was is None and len(self._entries) >= max_entries:
                    raise Untrackable("over the entry cap")
                if was is None or stat.S_ISREG(st.st_mode) or (
                        was.inode, was.mode, was.size, was.mtime_ns, was.ctime_ns) != (
                        st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                    self._set(child, self._entry(fd, name, st, budget))
                if stat.S_ISDIR(st.st_mode) and child not in self._children:
                    new_dirs.append(name)
            for name in old - names:
                child = f"{path}/{name}"
                gone = self._entries.get(child)
                self._drop(child)
                if gone is not None and stat.S_ISDIR(gone.mode):
                    self._forget_subtree(child)
            self._children[path] = names
            self._walk_below(fd, path, new_dirs, budget, max_entries, self._depth(path) + 1)
        finally:
            os.close(fd)
