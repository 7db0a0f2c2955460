"""What a write-root tracker knows of its tree: every entry, each file's links (by
inode), and which paths changed between the copies it handed out (generations). The
tracker (root_tracker.py) keeps it current from inotify's events; this part neither
watches nor walks."""

from __future__ import annotations

import os
import stat
from collections import OrderedDict

from sandboxd.recording.snapshot import UNBORN, Entry, HashBudget, HashCache, Snapshot

# Generations of a tracker's changes kept: a call's before and after are a few apart.
HISTORY = 64


class TreeRecord:
    """The entries of one write root (as `sandbox_root` sees it) and their history."""

    def __init__(self, sandbox_root: str, hashes: HashCache | None) -> None:
        self.sandbox_root = sandbox_root.rstrip("/")
        self._hashes = hashes
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
        self._inode_of: dict[str, tuple[int, int]] = {}  # non-directory entry -> (dev, inode)
        self._paths_of: dict[tuple[int, int], set[str]] = {}  # and back: every link of it
        self._unhashed: set[str] = set()  # regular files listed without a hash

    def _forget_all(self) -> None:
        """Before a full walk: no entry is known, and no history leads to what follows."""
        self._entries, self._children = {}, {}
        self._last = None
        self._history.clear()
        self._touched = set()
        self._generation += 1  # no history leads here: earlier snapshots compare in full
        self._inode_of, self._paths_of, self._unhashed = {}, {}, set()

    def _hand_out(self) -> Snapshot:
        """The entries as a snapshot: the last copy if nothing changed since, else a new
        copy (a new generation, its changed paths kept)."""
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

    def _entry(self, dir_fd: int, name: str, st: os.stat_result, budget: HashBudget) -> Entry:
        digest, note, btime, generation = "", "", *UNBORN
        if stat.S_ISREG(st.st_mode) and self._hashes is not None:
            digest, note, btime, generation = self._hashes.digest(dir_fd, name, st, budget)
        return Entry(st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, note, st.st_dev,
                     btime, generation)

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

    def _depth(self, path: str) -> int:
        return path.count("/") - self.sandbox_root.count("/")
