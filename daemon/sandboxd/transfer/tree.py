"""A transfer's walks on the host, one name at a time from the root's descriptor, never
through a symlink (O_NOFOLLOW on every name, which has no `/`), each directory's inode
held against the policy's masks (a directory the sandbox renamed keeps its inode, and
its mask with it). Every open, mkdir, rename and unlink runs on the transfer's AsUser
thread: as the sandbox's user, so what the sandbox could not read or write, a transfer
cannot either."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from sandboxd.core.as_user import AsUser
from sandboxd.core.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from sandboxd.core.safe_open import AT_FDCWD, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.policy.preflight import Bind
from sandboxd.transfer.rules import PROC_ROOT_PREFIX, Placed, Where, blocked_by, join

_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put in a file's place is opened, found no regular file, and closed.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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


class Roots:
    """The roots' descriptors, opened once each; closed together."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, bind: Bind, field: str) -> int:
        if bind.host_path not in self._fds:
            self._fds[bind.host_path] = open_root(bind, field)
        return self._fds[bind.host_path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _check_mask(fd: int, path: str, masks: frozenset[tuple[int, int]], field: str) -> os.stat_result:
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) in masks:
        raise PermissionDenied(f"{path} is a blocked path of the policy (moved there): never transferred",
                               field=field)
    return st


def walk_dirs(fs: AsUser, root_fd: int, placed: Placed, names: tuple[str, ...], masks: frozenset[tuple[int, int]],
              field: str, create_mode: int | None = None, created: list[Placed] | None = None) -> int:
    """The directory `names` below the root (O_PATH), each name opened without following
    a link and checked against the masks. With `create_mode`, a missing directory is made
    (as the sandbox's user) and its path added to `created`."""
    fd = os.dup(root_fd)
    try:
        _check_mask(fd, placed.bind.sandbox_path, masks, field)
        for i, name in enumerate(names):
            here = join(placed.bind.sandbox_path, names[:i + 1])
            try:
                nxt = fs.run(_open_dir, fd, name, create_mode)
            except OSError as exc:
                raise denied(here, exc, field) from None
            fd, old = nxt[0], fd
            os.close(old)
            if nxt[1] and created is not None:
                created.append(Placed(here, placed.bind, names[:i + 1]))
            _check_mask(fd, here, masks, field)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_dir(parent: int, name: str, create_mode: int | None) -> tuple[int, bool]:
    made = False
    if create_mode is not None:
        try:
            os.mkdir(name, create_mode, dir_fd=parent)
            made = True
        except FileExistsError:
            pass
    fd = os.open(name, _DIR, dir_fd=parent)
    if made:
        os.chmod(f"/proc/self/fd/{fd}", create_mode or 0o755)  # past the daemon's umask
    return fd, made


@dataclass
class Found:
    """An entry of a download: its path below the transfer's, what it is, its size and
    mode when listed."""

    parts: tuple[str, ...]
    kind: str  # "file" | "dir"
    size: int
    mode: int


@dataclass
class Listing:
    entries: list[Found]
    skipped: list[str]
    total: int = 0


def list_tree(fs: AsUser, dir_fd: int, placed: Placed, where: Where, max_entries: int, field: str) -> Listing:
    """Every file and directory below `dir_fd` (the transfer's path), depth first. A
    symlink, a special file, a blocked path and a directory the sandbox's user cannot
    list are skipped, and said; more than `max_entries` is refused."""
    masks = where.mask_inodes()
    listing = Listing([], [])
    pending: list[tuple[tuple[str, ...], int]] = [((), os.dup(dir_fd))]
    try:
        while pending:
            parts, fd = pending.pop()
            try:
                children = fs.run(_children, fd)
            except OSError as exc:
                listing.skipped.append(f"{join(placed.path, parts)}: not listed ({exc.strerror})")
                continue
            finally:
                os.close(fd)
            for name, st in sorted(children):
                sub = parts + (name,)
                path = join(placed.path, sub)
                why = _skip_reason(where, path, st, masks)
                if why:
                    listing.skipped.append(f"{path}: {why}")
                    continue
                if len(listing.entries) >= max_entries:
                    raise too_many(max_entries, field)
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
                listing.entries.append(Found(sub, kind, 0 if kind == "dir" else st.st_size, stat.S_IMODE(st.st_mode)))
                listing.total += 0 if kind == "dir" else st.st_size
                if kind == "dir":
                    try:
                        pending.append((sub, _reopen(fs, dir_fd, sub, masks)))
                    except OSError as exc:
                        listing.entries.pop()
                        listing.skipped.append(f"{path}: not opened ({exc.strerror})")
    finally:
        for _, fd in pending:
            os.close(fd)
    return listing


def too_many(max_entries: int, field: str) -> ResourceExhausted:
    return ResourceExhausted(f"more than {max_entries} files and directories, the most one transfer moves "
                             "(transfers.max_entries)", field=field)


def _skip_reason(where: Where, path: str, st: os.stat_result, masks: frozenset[tuple[int, int]]) -> str:
    if blocked_by(where, path) or (st.st_dev, st.st_ino) in masks:
        return "a blocked path"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (not followed)"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "not a regular file or a directory"
    return ""


def _children(fd: int) -> list[tuple[str, os.stat_result]]:
    listed = os.open(".", _LIST, dir_fd=fd)
    try:
        with os.scandir(listed) as it:
            return [(e.name, e.stat(follow_symlinks=False)) for e in it]
    finally:
        os.close(listed)


def _reopen(fs: AsUser, dir_fd: int, parts: tuple[str, ...], masks: frozenset[tuple[int, int]]) -> int:
    """The directory `parts` below `dir_fd`, opened again name by name (it is listed
    later, and may have been swapped meanwhile: its inode is checked again)."""
    fd = os.dup(dir_fd)
    try:
        for name in parts:
            nxt = fs.run(os.open, name, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in masks:
            raise PermissionError(13, "a blocked path of the policy")
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(fs: AsUser, parent_fd: int, name: str, path: str, masks: frozenset[tuple[int, int]],
              field: str) -> tuple[int, os.stat_result]:
    """A regular file below `parent_fd`, opened to read as the sandbox's user."""
    try:
        fd = fs.run(os.open, name, _READ, dir_fd=parent_fd)
    except OSError as exc:
        raise denied(path, exc, field) from None
    try:
        st = _check_mask(fd, path, masks, field)
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
