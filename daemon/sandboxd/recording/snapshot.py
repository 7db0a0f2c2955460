"""Before/after snapshots of a call's writable mounts, with content hashes: what fanotify
mount marks cannot report (creations, deletions, renames, replacement by rename, mode
changes, truncate(2)) and the content a write found and left. Sound to attribute to the
call because a call that can write a workspace runs alone on it (executor.py).

The walk opens every directory relative to its parent without following symlinks, so
nothing the sandbox left behind can send the daemon outside the write root. Content
hashes are cached by (device, inode) and reused while size, mtime and ctime are
unchanged (git's index rule: ctime cannot be set from user space), so only files that
changed since the last call are read again.

A hashed file also carries its birth: the birth time (statx) and the generation
(FS_IOC_GETVERSION) its file system gives it. A freed inode number is soon given to a
new file (ext4 reuses it at once): (device, inode) alone cannot tell a file changed in
place from another one made where it was; a birth both have that differs can, and only
a birth both have that is equal confirms the same file (`same_file`)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from sandboxd.recording.libc import libc


MAX_ENTRIES = 200_000
# Deeper directories are not walked (each level holds a descriptor while it is walked).
MAX_DEPTH = 256
# A file whose mtime or ctime is this recent is hashed every time (see HashCache.digest).
RACY_NS = 2 * 10**9
MAX_HASH_FILE_BYTES = 256 * 2**20
HASH_BUDGET_BYTES = 1024 * 2**20
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)


class Entry(NamedTuple):  # a tuple: a walk makes one per file, and it must be cheap
    inode: int
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int = 0
    sha256: str = ""  # "sha256:<hex>" of a regular file; "" when not hashed (see note)
    note: str = ""  # why a regular file has no hash
    dev: int = 0
    btime_ns: int = 0  # a hashed file's birth time; 0 where unknown
    generation: int = -1  # and its generation (FS_IOC_GETVERSION); -1 where unknown

    @property
    def regular(self) -> bool:
        return stat.S_ISREG(self.mode)


def born_apart(a: Entry, b: Entry) -> bool:
    """Known to be two files: a birth time or a generation both have differs."""
    return bool(a.btime_ns and b.btime_ns and a.btime_ns != b.btime_ns) \
        or (a.generation >= 0 and b.generation >= 0 and a.generation != b.generation)


def same_inode(a: Entry, b: Entry) -> bool:
    """The same inode as far as is known: the same device and inode number, not born apart."""
    return a.inode == b.inode and a.dev == b.dev and not born_apart(a, b)


def same_file(a: Entry, b: Entry) -> bool:
    """Known to be the same file: the same inode, and a birth time or a generation that
    both have, equal. Where neither is known (a file system that gives neither, a file
    not hashed), it is not known: a new file may have taken a freed inode number."""
    return same_inode(a, b) and bool((a.btime_ns and b.btime_ns) or (a.generation >= 0 and b.generation >= 0))


class _Statx(ctypes.Structure):
    """struct statx (linux/stat.h) up to stx_btime, padded to its 256 bytes."""
    _fields_ = [("stx_mask", ctypes.c_uint32), ("_blksize", ctypes.c_uint32), ("_attributes", ctypes.c_uint64),
                ("_nlink", ctypes.c_uint32), ("_uid", ctypes.c_uint32), ("_gid", ctypes.c_uint32),
                ("_mode", ctypes.c_uint16), ("_spare0", ctypes.c_uint16), ("_ino", ctypes.c_uint64),
                ("_size", ctypes.c_uint64), ("_blocks", ctypes.c_uint64), ("_attributes_mask", ctypes.c_uint64),
                ("_atime", ctypes.c_byte * 16), ("btime_sec", ctypes.c_int64), ("btime_nsec", ctypes.c_uint32),
                ("_btime_reserved", ctypes.c_int32), ("_rest", ctypes.c_byte * 160)]


_STATX_BTIME = 0x800
_AT_EMPTY_PATH = 0x1000
_FS_IOC_GETVERSION = 0x80087601  # _IOR('v', 1, long)
_statx_buffers = threading.local()  # one per thread
UNBORN = (0, -1)  # (birth time, generation) unknown


def birth(fd: int) -> tuple[int, int]:
    """(birth time in ns, generation) of an open file, each 0 / -1 where its file system
    does not give it."""
    buf = getattr(_statx_buffers, "buf", None)
    if buf is None:
        buf = _statx_buffers.buf = _Statx()
    btime = 0
    if libc().statx(fd, b"", _AT_EMPTY_PATH, _STATX_BTIME, ctypes.byref(buf)) == 0 and buf.stx_mask & _STATX_BTIME:
        btime = buf.btime_sec * 10**9 + buf.btime_nsec
    try:  # the kernel writes an int (ext4, xfs, btrfs); ENOTTY where there is none
        generation = struct.unpack_from("=I", fcntl.ioctl(fd, _FS_IOC_GETVERSION, bytes(8)))[0]
    except OSError:
        generation = -1
    return btime, generation


@dataclass
class Snapshot:
    entries: dict[str, Entry] = field(default_factory=dict)
    # Why the snapshot may not list everything (empty: it does, and two such compare).
    gaps: list[str] = field(default_factory=list)
    unhashed: int = 0  # regular files listed without a hash (0: none of its entries has a note)
    # Where each write root's entries came from, when a tracker kept them (live_snapshot):
    # sandbox root -> (tracker, generation). Two snapshots of tracked roots can then be
    # compared at the paths that changed between them only. `walked`: some root was not.
    origins: dict[str, tuple[Any, int]] = field(default_factory=dict)
    walked: bool = False

    @property
    def complete(self) -> bool:
        return not self.gaps


@dataclass
class HashBudget:
    """How much uncached content one snapshot may read, and the largest file it hashes.
    `keep` False: what it reads may hold what a call with secrets wrote: none of it goes
    into the baseline, and its hashes are refused there for good (baseline.py). `kept`:
    given the hashes whose content went into the baseline."""
    bytes_left: int = HASH_BUDGET_BYTES
    max_file: int = MAX_HASH_FILE_BYTES
    keep: bool = True
    kept: list[str] | None = None


# What HashCache.digest finds: (hash, why not, birth time, generation).
Hashed = tuple[str, str, int, int]


class HashCache:
    """sha256 of regular files by (device, inode), valid while size, mtime and ctime
    are what they were when it was read (a new file in a freed inode number has a new
    ctime: it is read again). Bounded: the oldest entries go first."""

    def __init__(self, max_entries: int = 250_000, baseline: Any = None):
        self._max = max_entries
        # baseline.Baseline: given the content of the files it wants as they are read.
        self._baseline = baseline
        self._lock = threading.Lock()
        self._by_inode: OrderedDict[tuple[int, int], tuple[int, int, int, str, int, int]] = OrderedDict()
        self.hashed_bytes = 0  # content read (for tests and metrics)

    @property
    def baseline(self) -> Any:
        return self._baseline

    def digest(self, dir_fd: int, name: str, st: os.stat_result, budget: HashBudget) -> Hashed:
        """(hash, "", birth time, generation) or ("", why not, 0, -1) for the regular file
        `name` in `dir_fd`."""
        key, stamp = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        known = self._by_inode.get(key)  # a plain read needs no lock; eviction order is rough
        if known is not None and known[:3] == stamp:
            return known[3], "", known[4], known[5]
        if st.st_size > budget.max_file:
            return "", f"larger than the hashing cap of {budget.max_file} bytes", *UNBORN
        if st.st_size > budget.bytes_left:
            return "", "over the snapshot's hashing budget", *UNBORN
        try:
            fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
        except OSError as exc:
            return "", f"not readable: {exc.strerror}", *UNBORN
        baseline = self._baseline
        try:
            first = os.fstat(fd)
            if not stat.S_ISREG(first.st_mode) or (first.st_dev, first.st_ino) != key:
                return "", "replaced while it was read", *UNBORN
            born = birth(fd)
            content = None
            if baseline is not None and budget.keep and baseline.wants(first.st_size):
                content = _read_all(fd, first.st_size)
                digest = "sha256:" + hashlib.sha256(content).hexdigest()
            else:
                with os.fdopen(os.dup(fd), "rb") as f:
                    digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
            last = os.fstat(fd)
        finally:
            os.close(fd)
        budget.bytes_left -= last.st_size
        self.hashed_bytes += last.st_size
        if (last.st_size, last.st_mtime_ns, last.st_ctime_ns) != stamp:
            return "", "changed while it was read", *UNBORN
        if baseline is not None and not budget.keep:
            baseline.refuse(digest)  # whenever these bytes are read again, they are not kept
        elif content is not None and len(content) == last.st_size:
            baseline.keep(digest, content)
            if budget.kept is not None:
                budget.kept.append(digest)
        if time.time_ns() - max(stamp[1], stamp[2]) < RACY_NS:
            # Changed moments ago: a write in the same timestamp tick would keep the
            # stamp, so the hash is used now but not trusted later (git's racy rule).
            return digest, "", *born
        with self._lock:
            self._by_inode[key] = (*stamp, digest, *born)
            self._by_inode.move_to_end(key)
            while len(self._by_inode) > self._max:
                self._by_inode.popitem(last=False)
        return digest, "", *born


def _read_all(fd: int, size: int) -> bytes:
    """A small file's whole content (one byte more is asked for: a file that grew shows)."""
    parts, want = [], size + 1
    while want > 0:
        part = os.read(fd, want)
        if not part:
            break
        parts.append(part)
        want -= len(part)
    return b"".join(parts)


def take(binds: Iterable[tuple[str, str]], hashes: HashCache | None = None, budget: HashBudget | None = None,
         max_entries: int = MAX_ENTRIES, into: Snapshot | None = None) -> Snapshot:
    """Every file and directory below the writable binds ((sandbox path, host path)
    pairs), by sandbox path; regular files hashed when `hashes` is given. Symlinks are
    listed, never followed. `into`: added to that snapshot (the cap counts its entries)."""
    snap = into if into is not None else Snapshot()
    budget = budget or HashBudget()
    for sandbox_root, host_root in binds:
        # Bind sources are real paths (preflight refuses symlinks on the way): one found
        # now was put there since, e.g. by the command renaming a parent of a nested
        # write root and leaving a link in its place. Never followed.
        parent_fd = -1
        try:
            parent_fd = _open_beneath_root(os.path.dirname(host_root))
            name = os.path.basename(host_root)
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                root_fd = os.open(name, _OPEN_DIR, dir_fd=parent_fd)
            elif stat.S_ISREG(st.st_mode):  # a bind of one file
                _add(snap, parent_fd, name, sandbox_root, st, hashes, budget)
                continue
            else:
                snap.gaps.append(f"{sandbox_root}: not walked (no longer a directory or a file)")
                continue
        except OSError as exc:
            why = "a symlink or a non-directory is on its way" if exc.errno in (errno.ELOOP, errno.ENOTDIR) \
                else exc.strerror or str(exc)
            snap.gaps.append(f"{sandbox_root}: not walked ({why})")
            continue
        finally:
            if parent_fd >= 0:
                os.close(parent_fd)
        if not _walk(root_fd, sandbox_root.rstrip("/"), snap, hashes, budget, max_entries):
            break
    return snap


def _open_beneath_root(path: str) -> int:
    """A directory descriptor for the absolute `path`, reached one component at a time
    from / without following a symlink anywhere (ELOOP/ENOTDIR if one is on the way)."""
    fd = os.open("/", _OPEN_DIR)
    try:
        for part in [p for p in path.split("/") if p]:
            nxt = os.open(part, _OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _add(snap: Snapshot, dir_fd: int, name: str, path: str, st: os.stat_result, hashes: HashCache | None,
         budget: HashBudget) -> None:
    digest, note, btime, generation = "", "", *UNBORN
    if stat.S_ISREG(st.st_mode) and hashes is not None:
        digest, note, btime, generation = hashes.digest(dir_fd, name, st, budget)
        snap.unhashed += not digest
    snap.entries[path] = Entry(st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, note,
                               st.st_dev, btime, generation)


def _walk(root_fd: int, root: str, snap: Snapshot, hashes: HashCache | None, budget: HashBudget,
          max_entries: int) -> bool:
    """Depth first without recursion; False when the entry cap was reached."""
    stack: list[tuple[int, str, list[str]]] = []  # (dir fd, sandbox path, subdirectories left)
    fd, base = root_fd, root
    entries = snap.entries
    S_ISREG, S_ISDIR = stat.S_ISREG, stat.S_ISDIR
    try:
        while True:
            subdirs: list[str] = []
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # gone since the listing
                        except OSError as exc:
                            snap.gaps.append(f"{base}/{e.name}: not examined ({exc.strerror})")
                            continue
                        if len(entries) >= max_entries:
                            snap.gaps.append(f"more than {max_entries} entries in the write roots: "
                                             "the rest were not compared")
                            return False
                        name = e.name
                        mode = st.st_mode
                        if hashes is not None and S_ISREG(mode):
                            digest, note, btime, generation = hashes.digest(fd, name, st, budget)
                            snap.unhashed += not digest
                            entries[f"{base}/{name}"] = Entry(st.st_ino, mode, st.st_size, st.st_mtime_ns,
                                                              st.st_ctime_ns, digest, note, st.st_dev, btime,
                                                              generation)
                        else:
                            entries[f"{base}/{name}"] = Entry(st.st_ino, mode, st.st_size, st.st_mtime_ns,
                                                              st.st_ctime_ns, "", "", st.st_dev)
                            if S_ISDIR(mode):
                                subdirs.append(name)
            except OSError as exc:
                snap.gaps.append(f"{base or '/'}: not listed ({exc.strerror})")
            if subdirs and len(stack) >= MAX_DEPTH:
                snap.gaps.append(f"{base}: deeper than {MAX_DEPTH} levels, not walked")
                subdirs = []
            stack.append((fd, base, subdirs))
            fd = -1
            while stack and fd < 0:
                parent_fd, parent, left = stack[-1]
                if not left:
                    os.close(parent_fd)
                    stack.pop()
                    continue
                name = left.pop()
                try:
                    fd, base = os.open(name, _OPEN_DIR, dir_fd=parent_fd), f"{parent}/{name}"
                except (FileNotFoundError, NotADirectoryError):
                    fd = -1  # replaced by a non-directory or removed: listed as it was
                except OSError as exc:
                    fd = -1
                    if exc.errno == errno.ELOOP:
                        continue  # replaced by a symlink since the listing: listed as it was
                    snap.gaps.append(f"{parent}/{name}: not walked ({exc.strerror})")
            if fd < 0:
                return True
    finally:  # a directory's descriptor is either `fd` or on the stack, never both
        for open_fd, _, _ in stack:
            os.close(open_fd)
        if fd >= 0:
            os.close(fd)
