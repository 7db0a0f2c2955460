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
import logging
import os
import select
import stat
import threading
import time
from collections import OrderedDict

from sandboxd.recording.filewatch import inotify_add_watch, inotify_events, inotify_init
from sandboxd.recording.snapshot import _OPEN_DIR, MAX_DEPTH, Entry, HashBudget, HashCache, Snapshot, _open_beneath_root, take

log = logging.getLogger("sandboxd.recording.live_snapshot")

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
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

# Trackers kept (each holds an inotify instance), and how long an unused one lives.
MAX_TRACKERS = 32
IDLE_S = 900.0
# A root whose tracker gave up (watch limit, entry cap, a tree that never settles) is
# walked for this long before it is tracked again.
UNTRACKED_S = 300.0
# Refreshing ahead of calls: what one refresh may hash (a bigger change is hashed by the
# call's own snapshot), the longest wait between refreshes of a root that keeps changing
# with no call (the wait doubles from refresh_after_s), and how long after its last call
# a root is still refreshed at all.
AHEAD_HASH_BYTES = 16 * 1024 * 1024
AHEAD_MAX_DELAY_S = 2.0
AHEAD_IDLE_S = 120.0
# Generations of a tracker's changes kept: a call's before and after are a few apart.
HISTORY = 64


class _Unusable(Exception):
    """This root cannot be tracked right now: the caller walks it instead."""


class RootTracker:
    """One write root (a directory) as `sandbox_root` sees it, kept current."""

    def __init__(self, sandbox_root: str, host_root: str, hashes: HashCache | None):
        self.sandbox_root = sandbox_root.rstrip("/")
        self.host_root = host_root
        self._hashes = hashes
        self._ifd = -1
        self.closed = False
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self._valid = False
        self._entries: dict[str, Entry] = {}
        # The copy of _entries the last snapshot handed out, while nothing has changed
        # since (None once something has): two snapshots of an unchanged tree are then one
        # dict, neither copied nor compared entry by entry. Nobody may change it.
        self._last: dict[str, Entry] | None = None
        # Each copy handed out is a generation; _history[g]: the paths whose entries
        # changed from generation g-1 to g (the last HISTORY of them). A full walk leaves
        # a gap: snapshots across it are compared entry by entry.
        self._generation = 0
        self._history: OrderedDict[int, frozenset[str]] = OrderedDict()
        self._touched: set[str] = set()  # changed since the last copy
        self._children: dict[str, set[str]] = {}  # directory path -> names in it
        self._wd_dir: dict[int, str] = {}
        self._dir_wd: dict[str, int] = {}
        self._wd_inode: dict[int, tuple[int, int]] = {}  # a watched file's (dev, inode)
        self._inode_of: dict[str, tuple[int, int]] = {}  # non-directory entry -> (dev, inode)
        self._paths_of: dict[tuple[int, int], set[str]] = {}  # and back: every link of it
        self._dirty: set[str] = set()
        self._unhashed: set[str] = set()  # regular files listed without a hash
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
        """The root's entries now; raises _Unusable when only a walk can tell. `use`
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
                raise _Unusable("the tree changed faster than it could be followed")
            if len(self._entries) > max_entries:
                raise _Unusable("over the entry cap")
        except BaseException:
            self._valid = False
            raise
        finally:
            os.close(root_fd)
        if self._last is None:
            self._last = dict(self._entries)
            self._generation += 1
            self._history[self._generation] = frozenset(self._touched)
            self._touched = set()
            while len(self._history) > HISTORY:
                self._history.popitem(last=False)
        return Snapshot(self._last, unhashed=len(self._unhashed),
                        origins={self.sandbox_root: (self, self._generation)})

    def changed_between(self, earlier: int, later: int) -> set[str] | None:
        """Every path whose entry changed from generation `earlier` to `later` (a
        superset: one changed and changed back is in it); None if that is not known.
        Holds self.lock."""
        if later < earlier:
            return None
        out: set[str] = set()
        for g in range(earlier + 1, later + 1):
            paths = self._history.get(g)
            if paths is None:
                return None
            out |= paths
        return out

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
            raise _Unusable(str(exc)) from None
        try:
            return os.open(os.path.basename(self.host_root), _OPEN_DIR, dir_fd=parent_fd)
        except OSError as exc:
            raise _Unusable(str(exc)) from None
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
            raise _Unusable(f"inotify_init1: {exc.strerror}") from None
        self._entries, self._children, self._wd_dir, self._dir_wd = {}, {}, {}, {}
        self._last = None
        self._history.clear()
        self._touched = set()
        self._generation += 1  # no history leads here: earlier snapshots compare in full
        self._wd_inode, self._inode_of, self._paths_of, self._dirty, self._unhashed = {}, {}, {}, set(), set()
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
                raise _Unusable("the tree kept changing while it was rescanned")
            path = min(self._dirty, key=lambda p: (p.count("/"), p))  # parents first
            self._dirty.discard(path)
            if path != self.sandbox_root and path not in self._children:
                continue  # no longer a directory of the tree (its parent's rescan said so)
            fd = self._open_dir(root_fd, path)
            if fd < 0:
                if path == self.sandbox_root:
                    raise _Unusable("the write root cannot be opened")
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
            raise _Unusable(f"{path}: {exc.strerror}") from None  # EMFILE, EACCES: a walk says it
        return fd

    def _add_watch(self, target: str, mask: int, what: str) -> int:
        try:
            return inotify_add_watch(self._ifd, target, mask)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return -1
            raise _Unusable(f"inotify_add_watch {what}: {exc.strerror}"
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

    def _entry(self, dir_fd: int, name: str, st: os.stat_result, budget: HashBudget) -> Entry:
        digest = note = ""
        if stat.S_ISREG(st.st_mode) and self._hashes is not None:
            digest, note = self._hashes.digest(dir_fd, name, st, budget)
        return Entry(st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, note, st.st_dev)

    def _set(self, path: str, entry: Entry) -> None:
        if self._entries.get(path) != entry:
            self._last = None
            self._touched.add(path)
        self._entries[path] = entry
        if entry.note:
            self._unhashed.add(path)
        else:
            self._unhashed.discard(path)
        if not stat.S_ISDIR(entry.mode):
            key = (entry.dev, entry.inode)
            if self._inode_of.get(path) != key:
                self._unlink_inode(path)
                self._inode_of[path] = key
                self._paths_of.setdefault(key, set()).add(path)

    def _unlink_inode(self, path: str) -> None:
        key = self._inode_of.pop(path, None)
        if key is not None:
            paths = self._paths_of.get(key)
            if paths is not None:
                paths.discard(path)
                if not paths:
                    del self._paths_of[key]

    def _drop(self, path: str) -> None:
        """Forgets one entry (and its place in the inode map)."""
        if self._entries.pop(path, None) is not None:
            self._last = None
            self._touched.add(path)
        self._unhashed.discard(path)
        self._unlink_inode(path)

    def _walk_new(self, fd: int, path: str, budget: HashBudget, max_entries: int, depth: int) -> None:
        """Watches and lists a directory new to the tracker, and everything below it.
        Takes ownership of `fd`."""
        try:
            if depth > MAX_DEPTH:
                raise _Unusable(f"{path}: deeper than {MAX_DEPTH} levels")
            self._watch_dir(fd, path)  # before the listing: nothing created meanwhile is missed
            names: set[str] = set()
            subdirs = []
            for name, st in self._listing(fd, path):
                if len(self._entries) >= max_entries:
                    raise _Unusable("over the entry cap")
                names.add(name)
                self._set(f"{path}/{name}", self._entry(fd, name, st, budget))
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(name)
            self._children[path] = names
            self._walk_below(fd, path, subdirs, budget, max_entries, depth + 1)
        finally:
            os.close(fd)

    def _listing(self, fd: int, path: str):
        """(name, stat) of each entry of a directory, examined (and watched) as it comes;
        one gone since the listing is left out."""
        with os.scandir(fd) as it:
            for e in it:
                try:
                    st = self._examine(fd, e)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise _Unusable(f"{path}/{e.name}: {exc.strerror}") from None
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
                raise _Unusable(f"{path}/{name}: {exc.strerror}") from None
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

    def _depth(self, path: str) -> int:
        return path.count("/") - self.sandbox_root.count("/")

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
                    raise _Unusable("over the entry cap")
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


class LiveSnapshots:
    """`take` with the result of snapshot.take, from trackers kept per write root."""

    def __init__(self, hashes: HashCache | None, max_trackers: int = MAX_TRACKERS, idle_s: float = IDLE_S,
                 refresh_after_s: float | None = None):
        """`refresh_after_s`: a thread brings a tracker up to date that long after a
        change reaches it (what changed between calls, by the host or by a call that
        records nothing, is then not rescanned by the next call's snapshot)."""
        self._hashes = hashes
        self._max = max_trackers
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._trackers: OrderedDict[tuple[str, str], RootTracker] = OrderedDict()
        self._untracked: dict[tuple[str, str], float] = {}  # root -> when to try tracking again
        self.fallbacks = 0  # walks done because a root could not be tracked
        self.refreshes = 0  # trackers brought up to date ahead of a call (for tests)
        self._closed = False
        self._refresh_after_s = refresh_after_s
        self._soon: set[tuple[str, str]] = set()  # roots to refresh now (refresh_soon)
        self._refresher: threading.Thread | None = None
        if refresh_after_s is not None:
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._refresher = threading.Thread(target=self._refresh_loop, name="write-roots", daemon=True)
            self._refresher.start()

    def take(self, binds: list[tuple[str, str]], budget: HashBudget | None = None,
             max_entries: int = 200_000) -> Snapshot:
        budget = budget or HashBudget()
        out = Snapshot()
        shared = False  # out.entries is a tracker's copy (to be copied before it is added to)
        for sandbox_root, host_root in binds:
            left = max_entries - len(out.entries)
            part = None
            if left > 0:
                # The tracker spends a copy: one that gives up leaves the walk its budget.
                spent = HashBudget(budget.bytes_left, budget.max_file)
                part = self._tracked(sandbox_root, host_root, spent, left)
                if part is not None:
                    budget.bytes_left = spent.bytes_left
            if part is None:
                self.fallbacks += 1
                out.walked = True
                if shared:  # the walk adds to it
                    out.entries, shared = dict(out.entries), False
                gaps = len(out.gaps)
                take([(sandbox_root, host_root)], self._hashes, budget, max_entries, into=out)
                if len(out.gaps) > gaps and len(out.entries) >= max_entries:
                    break  # the cap: the walk stops there too
                continue
            if not out.entries and not out.gaps:
                out.entries = part.entries  # the tracker's own copy: never changed below
                shared = True
            else:
                if shared:
                    out.entries, shared = dict(out.entries), False
                out.entries.update(part.entries)
            out.gaps += part.gaps
            out.unhashed += part.unhashed
            out.origins.update(part.origins)
        return out

    def _tracked(self, sandbox_root: str, host_root: str, budget: HashBudget, max_entries: int) -> Snapshot | None:
        key = (sandbox_root, host_root)
        try:
            if not stat.S_ISDIR(os.lstat(host_root).st_mode):
                return None  # a bind of one file (or a root gone): the walk says what it is
        except OSError:
            return None
        tracker = self._tracker(key)
        if tracker is None:
            return None
        with tracker.lock:
            try:
                if tracker.closed:
                    return None  # retired meanwhile
                return tracker.snapshot(budget, max_entries)
            except (_Unusable, OSError) as exc:
                self._give_up(key, tracker, exc)
                return None

    def _give_up(self, key: tuple[str, str], tracker: RootTracker, exc: Exception) -> None:
        """Holds tracker.lock. Its watches go (they count against the host's limits), and
        the root is walked for a while rather than tracked and walked on every call."""
        log.info("write root %s is walked in full for %.0f s: %s", key[1], UNTRACKED_S, exc)
        tracker.close()
        with self._lock:
            if self._trackers.get(key) is tracker:
                del self._trackers[key]
            self._untracked[key] = time.monotonic() + UNTRACKED_S

    def _refresh_loop(self) -> None:
        """Polls the trackers' inotify descriptors; a tracker with news is refreshed
        `refresh_after_s` later (a burst of changes is taken in one go)."""
        assert self._refresh_after_s is not None
        due: dict[tuple[str, str], float] = {}
        while not self._closed:
            with self._lock:
                trackers = dict(self._trackers)
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            watched = {}
            for key, tracker in trackers.items():
                fd = tracker.fileno()
                if fd >= 0 and key not in due:
                    poller.register(fd, select.POLLIN)
                    watched[fd] = key
            now = time.monotonic()
            # At least once a second the descriptors are looked at again: a tracker that
            # walked its root in full has a new one.
            timeout = 1000 if not due else max(0, min(1000, int((min(due.values()) - now) * 1000) + 1))
            for fd, events in poller.poll(timeout):
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif fd in watched and events & select.POLLIN:
                    tracker = trackers[watched[fd]]
                    delay = min(AHEAD_MAX_DELAY_S, self._refresh_after_s * 2 ** min(tracker.ahead, 16))
                    due.setdefault(watched[fd], time.monotonic() + delay)
            now = time.monotonic()
            with self._lock:
                soon, self._soon = self._soon, set()
            for key in soon & trackers.keys():
                due[key] = now
            for key in [k for k, t in due.items() if t <= now]:
                del due[key]
                tracker = trackers.get(key)
                if tracker is not None:
                    self._refresh_ahead(key, tracker)
            for key in [k for k in due if k not in trackers]:
                del due[key]

    def _refresh_ahead(self, key: tuple[str, str], tracker: RootTracker) -> None:
        with tracker.lock:
            if tracker.closed or tracker.fileno() < 0 or time.monotonic() - tracker.last_used > AHEAD_IDLE_S:
                return  # idle: its queue waits for the next call (or overflows: a walk then)
            budget_bytes, max_file, max_entries = tracker.caps
            try:
                tracker.snapshot(HashBudget(min(budget_bytes, AHEAD_HASH_BYTES), min(max_file, AHEAD_HASH_BYTES)),
                                 max_entries, use=False)
                tracker.ahead += 1
                self.refreshes += 1
            except (_Unusable, OSError) as exc:
                self._give_up(key, tracker, exc)
            except Exception as exc:
                log.exception("refreshing the write root %s failed", key[1])
                self._give_up(key, tracker, exc)

    def _tracker(self, key: tuple[str, str]) -> RootTracker | None:
        now = time.monotonic()
        retired = []
        with self._lock:
            if self._untracked.get(key, 0) > now:
                return None
            self._untracked.pop(key, None)
            for k in [k for k, t in self._trackers.items() if now - t.last_used > self._idle_s and k != key]:
                retired.append(self._trackers.pop(k))
            tracker = self._trackers.get(key)
            if tracker is None:
                while len(self._trackers) >= self._max:
                    retired.append(self._trackers.pop(next(iter(self._trackers))))
                tracker = self._trackers[key] = RootTracker(key[0], key[1], self._hashes)
                self._wake_refresher()
            self._trackers.move_to_end(key)
        for t in retired:  # outside the registry's lock: a snapshot in progress finishes first
            with t.lock:
                t.close()
        return tracker

    @staticmethod
    def changed_between(before: Snapshot, after: Snapshot) -> set[str] | None:
        """Every path whose entry may differ between two snapshots of the same write
        roots, from their trackers' records; None when a root was walked or its tracker
        cannot tell (then the snapshots are compared entry by entry)."""
        if before.walked or after.walked or before.origins.keys() != after.origins.keys():
            return None
        out: set[str] = set()
        for root, (tracker, earlier) in before.origins.items():
            now, later = after.origins[root]
            if now is not tracker:
                return None
            with tracker.lock:
                paths = tracker.changed_between(earlier, later)
            if paths is None:
                return None
            out |= paths
        return out

    def refresh_soon(self, binds: list[tuple[str, str]]) -> None:
        """These roots were just changed by a call that took no snapshot of them: their
        trackers are brought up to date now, off the caller's thread."""
        with self._lock:
            if self._refresher is None or self._closed:
                return
            self._soon.update(k for k in binds if k in self._trackers)
            self._wake_refresher()

    def _wake_refresher(self) -> None:
        """Holds self._lock (close() shuts the pipe under it)."""
        if self._refresher is not None and not self._closed:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # it has wakes pending

    def close(self) -> None:
        with self._lock:
            refresher = self._refresher
            self._wake_refresher()
            self._closed = True
        if refresher is not None:
            refresher.join(5)
            with self._lock:
                if not refresher.is_alive() and self._refresher is not None:
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    self._refresher = None
        with self._lock:
            trackers, self._trackers = list(self._trackers.values()), OrderedDict()
        for t in trackers:
            with t.lock:
                t.close()
