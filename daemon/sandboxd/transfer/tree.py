"""A transfer's walks on the host, one name at a time from the root's descriptor, never
through a symlink (O_NOFOLLOW on every name, which has no `/`), each directory's inode
held against the policy's masks (a directory the sandbox renamed keeps its inode, and
its mask with it). Every open, mkdir, rename and unlink runs on the transfer's AsUser
thread: as the sandbox's user, so what the sandbox could not read or write, a transfer
cannot either."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field

from sandboxd.core.as_user import AsUser
from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, PermissionDenied, ResourceExhausted
from sandboxd.core.safe_open import AT_FDCWD, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.policy.preflight import Bind
from sandboxd.transfer.rules import (MAX_PATH_BYTES, MAX_TRANSFER_PATH_BYTES, PROC_ROOT_PREFIX, Placed, Where,
                                     blocked_by, join)

_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put in a file's place is opened, found no regular file, and closed.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What a download's result says of what it left out, one line each; the rest counted.
SKIPS_SHOWN = 100


def denied(path: str, exc: OSError, field: str) -> PermissionDenied | FailedPrecondition:
    """What an OSError on `path` tells the caller: EACCES is the sandbox's user's own
    refusal; a link or a type changed on the way, a failed precondition."""
    if isinstance(exc, PermissionError):
        return PermissionDenied(f"{path}: the sandbox's user may not do this ({exc.strerror})", field=field)
    return FailedPrecondition(f"{path}: {exc.strerror or exc}", field=field)


def open_root(bind: Bind, field: str) -> int:
    """The root's descriptor (O_PATH), opened as the daemon (the host's directories above
    it may be closed to the sandbox's user) and only if it is the inode preflight found."""
    if bind.host_path.startswith(PROC_ROOT_PREFIX):
        return _open_temp_dir(bind, field)
    try:
        fd = openat2(AT_FDCWD, bind.host_path, RESOLVE_NO_SYMLINKS)
    except OSError:
        raise FailedPrecondition(f"{bind.sandbox_path} is no longer the directory the policy's root named",
                                 field=field) from None
    st = os.fstat(fd)
    if bind.ino and (st.st_dev, st.st_ino) != (bind.dev, bind.ino):
        os.close(fd)
        raise FailedPrecondition(f"{bind.sandbox_path} was replaced on the host since it was checked", field=field)
    return fd


def _open_temp_dir(bind: Bind, field: str) -> int:
    """A leased sandbox's tempDir: its init's root (the magic link followed once, as the
    daemon), then tempDir's names without a link; it must be a mount of its own there
    (the tmpfs, not the image's directory under it)."""
    try:
        root = os.open(bind.host_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise FailedPrecondition("the leased sandbox is gone", field=field) from None
    fd = root
    try:
        for name in [p for p in bind.sandbox_path.split("/") if p]:
            fd = os.open(name, _DIR, dir_fd=root)
            os.close(root)
            root = fd
        if os.fstat(fd).st_dev == os.stat(bind.host_path).st_dev:
            raise FailedPrecondition(f"{bind.sandbox_path} is not the sandbox's tempDir mount", field=field)
        return fd
    except OSError as exc:
        os.close(fd)
        raise FailedPrecondition(f"the sandbox's tempDir {bind.sandbox_path} cannot be reached ({exc.strerror})",
                                 field=field) from None
    except BaseException:
        os.close(fd)
        raise


class Walker:
    """A transfer's directories, opened one name at a time from each root's descriptor
    and held along the path last asked for: a tree's entries come depth first, so each
    directory is opened once, from its parent, not walked to from the root again. Each
    one is held against the masks and, for an upload, against the read roots' own
    inodes (a read root the sandbox moved under a write root stays read-only)."""

    def __init__(self, fs: AsUser, where: Where, *, write: bool):
        self._fs = fs
        self._init_pid_now = where.init_pid_now
        self.masks = where.mask_inodes()
        self.read_only = where.read_only_inodes() if write else frozenset()
        self._roots: dict[str, int] = {}
        self._held: dict[str, list[tuple[str, int]]] = {}  # per root: (name, fd) of the path below it

    def root(self, bind: Bind, field: str) -> int:
        if bind.host_path not in self._roots:
            fd = open_root(bind, field)
            try:
                if bind.host_path.startswith(PROC_ROOT_PREFIX) and not self._same_init(bind):
                    raise FailedPrecondition("the leased sandbox is gone", field=field)
                self.check(fd, bind.sandbox_path, field)
            except BaseException:
                os.close(fd)
                raise
            self._roots[bind.host_path] = fd
        return self._roots[bind.host_path]

    def _same_init(self, bind: Bind) -> bool:
        """Whether the init whose root was opened lives still: then its pid was not
        another process's when it was opened."""
        pid = bind.host_path[len(PROC_ROOT_PREFIX):].split("/", 1)[0]
        return self._init_pid_now is not None and str(self._init_pid_now()) == pid

    def check(self, fd: int, path: str, field: str) -> os.stat_result:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in self.masks:
            raise PermissionDenied(f"{path} is a blocked path of the policy (moved there): never transferred",
                                   field=field)
        if (st.st_dev, st.st_ino) in self.read_only:
            raise PermissionDenied(f"{path} is a read root of the policy (moved there): an upload does not land "
                                   "in it", field=field)
        return st

    def dir(self, placed: Placed, names: tuple[str, ...], field: str, create_mode: int | None = None,
            created: list[Placed] | None = None) -> int:
        """The directory `names` below the root (O_PATH; the walker's, not to be closed,
        valid until the next call). With `create_mode`, a missing directory is made (as
        the sandbox's user) and its path added to `created`."""
        root = self.root(placed.bind, field)
        held = self._held.setdefault(placed.bind.host_path, [])
        keep = 0
        while keep < min(len(held), len(names)) and held[keep][0] == names[keep]:
            keep += 1
        for _, fd in held[keep:]:
            os.close(fd)
        del held[keep:]
        for i in range(keep, len(names)):
            here = join(placed.bind.sandbox_path, names[:i + 1])
            try:
                fd, made = self._fs.run(_open_dir, held[-1][1] if held else root, names[i], create_mode)
            except OSError as exc:
                if getattr(exc, "made", False) and created is not None:
                    created.append(Placed(here, placed.bind, names[:i + 1]))
                raise denied(here, exc, field) from None
            if made and created is not None:
                created.append(Placed(here, placed.bind, names[:i + 1]))
            try:
                self.check(fd, here, field)
            except BaseException:
                os.close(fd)
                raise
            held.append((names[i], fd))
        return held[-1][1] if held else root

    def still_there(self, placed: Placed, names: tuple[str, ...], field: str) -> None:
        """FAILED_PRECONDITION unless each directory on the path `names` that the walker
        holds is the one a walk from the root finds there today (the sandbox may have
        moved one since)."""
        self.dir(placed, names, field)
        held = [fd for _, fd in self._held[placed.bind.host_path]]
        fresh = os.dup(self.root(placed.bind, field))
        moved = False
        try:
            for name, kept in zip(names, held):
                nxt = self._fs.run(os.open, name, _DIR, dir_fd=fresh)
                os.close(fresh)
                fresh = nxt
                if _inode(fresh) != _inode(kept):
                    moved = True
                    break
        except OSError:
            moved = True
        finally:
            os.close(fresh)
        if moved:
            raise FailedPrecondition(f"{join(placed.bind.sandbox_path, names)} was moved since the upload began: "
                                     "nothing of it landed", field=field)

    def close(self) -> None:
        for held in self._held.values():
            for _, fd in held:
                os.close(fd)
        self._held.clear()
        for fd in self._roots.values():
            os.close(fd)
        self._roots.clear()


def _inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_dir(parent: int, name: str, create_mode: int | None) -> tuple[int, bool]:
    made = False
    if create_mode is not None:
        try:
            os.mkdir(name, create_mode, dir_fd=parent)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except OSError as exc:
        exc.made = made  # type: ignore[attr-defined]  # the caller still undoes the mkdir
        raise
    if made:
        try:
            os.chmod(f"/proc/self/fd/{fd}", create_mode or 0o755)  # past the daemon's umask
        except BaseException as exc:
            os.close(fd)
            exc.made = made  # type: ignore[attr-defined]
            raise
    return fd, made


@dataclass
class Found:
    """An entry of a download: its path below the transfer's, what it is, its size and
    mode when listed."""

    parts: tuple[str, ...]
    kind: str  # "file" | "dir"
    size: int
    mode: int


class Skips:
    """What a download leaves out, and why: the first SKIPS_SHOWN said, the rest counted;
    more than `limit` refuses the download (a tree of nothing but links is no tree to
    send, and its result would not fit a message)."""

    def __init__(self, limit: int, field: str):
        self._limit, self._field = limit, field
        self.shown: list[str] = []
        self.count = 0

    def add(self, reason: str) -> None:
        self.count += 1
        if self.count > self._limit:
            raise ResourceExhausted(f"more than {self._limit} entries left out (links, special files, blocked or "
                                    "unreadable paths; transfers.max_entries): name a path below them",
                                    field=self._field)
        if len(self.shown) < SKIPS_SHOWN:
            self.shown.append(reason)

    def lines(self) -> list[str]:
        more = self.count - len(self.shown)
        return self.shown + ([f"... and {more} more left out"] if more else [])


@dataclass
class Listing:
    entries: list[Found]
    skipped: Skips
    total: int = 0
    path_bytes: int = 0


@dataclass
class _Frame:
    """A directory being listed: its descriptor, held while what is below it is listed
    (so the descriptors held are the depth, at most MAX_PATH_BYTES / 2), and its
    subdirectories still to list, last first."""

    parts: tuple[str, ...]
    fd: int
    dirs: list[Found] = dataclass_field(default_factory=list)


def list_tree(fs: AsUser, dir_fd: int, placed: Placed, where: Where, max_entries: int, field: str) -> Listing:
    """Every file and directory below `dir_fd` (the transfer's path), depth first. A
    symlink, a special file, a blocked path, a path longer than the kernel's and a
    directory the sandbox's user cannot list are left out, and said; more than
    `max_entries` is refused."""
    masks = where.mask_inodes()
    listing = Listing([], Skips(max_entries, field))
    frames = [_Frame((), os.dup(dir_fd))]
    try:
        frames[0].dirs = _list_dir(fs, frames[0], placed, where, masks, listing, max_entries, field)
        while frames:
            top = frames[-1]
            if not top.dirs:
                os.close(frames.pop().fd)
                continue
            found = top.dirs.pop()
            path = join(placed.path, found.parts)
            try:
                fd = fs.run(os.open, found.parts[-1], _DIR, dir_fd=top.fd)
            except OSError as exc:
                _fail_if_out_of_descriptors(exc)
                listing.skipped.add(f"{path}: not listed ({exc.strerror})")
                continue
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in masks:  # swapped in since it was listed
                os.close(fd)
                listing.entries.remove(found)
                listing.skipped.add(f"{path}: a blocked path")
                continue
            frames.append(_Frame(found.parts, fd))
            frames[-1].dirs = _list_dir(fs, frames[-1], placed, where, masks, listing, max_entries, field)
    finally:
        for frame in frames:
            os.close(frame.fd)
    return listing


def _list_dir(fs: AsUser, frame: _Frame, placed: Placed, where: Where, masks: frozenset[tuple[int, int]],
              listing: Listing, max_entries: int, field: str) -> list[Found]:
    """`frame`'s entries added to the listing (read as they come, each held against the
    caps at once); its subdirectories, last first."""
    kept: list[Found] = []

    def visit(name: str, st: os.stat_result) -> None:
        sub = frame.parts + (name,)
        path = join(placed.path, sub)
        why = _skip_reason(where, path, st, masks)
        if why:
            listing.skipped.add(f"{path}: {why}")
            return
        if len(listing.entries) + len(kept) >= max_entries:
            raise too_many(max_entries, field)
        listing.path_bytes += len(path.encode("utf-8", "surrogateescape"))
        if listing.path_bytes > MAX_TRANSFER_PATH_BYTES:
            raise too_long(field)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        kept.append(Found(sub, kind, 0 if kind == "dir" else st.st_size, stat.S_IMODE(st.st_mode)))

    try:
        fs.run(_scan, frame.fd, visit)
    except OSError as exc:
        _fail_if_out_of_descriptors(exc)
        listing.skipped.add(f"{join(placed.path, frame.parts)}: not listed ({exc.strerror})")
    kept.sort(key=lambda found: found.parts[-1])
    listing.entries.extend(kept)
    listing.total += sum(found.size for found in kept)
    return [found for found in reversed(kept) if found.kind == "dir"]


def _scan(fd: int, visit: Callable[[str, os.stat_result], None]) -> None:
    """Each entry of the directory, as it is read (a directory of a million names is
    never held whole)."""
    listed = os.open(".", _LIST, dir_fd=fd)
    try:
        with os.scandir(listed) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed since it was read
                    continue
                visit(entry.name, st)
    finally:
        os.close(listed)


def _fail_if_out_of_descriptors(exc: OSError) -> None:
    """The daemon's own shortage is no reason to leave a file out: it fails the transfer."""
    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        raise BackendUnavailable(f"the daemon is out of descriptors or memory ({exc.strerror}): retry",
                                 field="path") from None


def too_many(max_entries: int, field: str) -> ResourceExhausted:
    return ResourceExhausted(f"more than {max_entries} files and directories, the most one transfer moves "
                             "(transfers.max_entries)", field=field)


def too_long(field: str) -> ResourceExhausted:
    return ResourceExhausted(f"the entries' paths come to more than {MAX_TRANSFER_PATH_BYTES} bytes, the most one "
                             "transfer's record names: transfer the tree in parts", field=field)


def _skip_reason(where: Where, path: str, st: os.stat_result, masks: frozenset[tuple[int, int]]) -> str:
    if blocked_by(where, path) or (st.st_dev, st.st_ino) in masks:
        return "a blocked path"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (not followed)"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "not a regular file or a directory"
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        return f"a path longer than {MAX_PATH_BYTES} bytes"
    return ""


def open_file(fs: AsUser, walker: Walker, parent_fd: int, name: str, path: str,
              field: str) -> tuple[int, os.stat_result]:
    """A regular file below `parent_fd`, opened to read as the sandbox's user."""
    try:
        fd = fs.run(os.open, name, _READ, dir_fd=parent_fd)
    except OSError as exc:
        raise denied(path, exc, field) from None
    try:
        st = walker.check(fd, path, field)
        if not stat.S_ISREG(st.st_mode):
            raise FailedPrecondition(f"{path} is no longer a regular file", field=field)
        os.set_blocking(fd, True)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def read_file(fd: int, chunk_bytes: int) -> Iterator[bytes]:
    while chunk := os.read(fd, chunk_bytes):
        yield chunk
