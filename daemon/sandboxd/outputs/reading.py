"""Reading a file the call left, by its sandbox path, from the host directory bound
there: opened beneath the write root with no symlink on the way (the sandbox may have
left links anywhere), only if it is still a regular file, and no more bytes than the
record says it held (a file that changed since the record is told, not kept)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sandboxd.core.as_user import AsUser
from sandboxd.core.safe_open import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.recording.snapshot import _open_beneath_root

CHUNK_BYTES = 1024 * 1024
_BENEATH = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS


class NotReadable(Exception):
    """Why a changed file cannot be kept (its text goes into artifactsOmitted)."""


@dataclass(frozen=True)
class Located:
    host_root: str  # the directory to open beneath
    relative: str  # the path below it ("" never: a bound file is its parent's child)
    sandbox_root: str = ""  # the sandbox path of host_root ("": a bound file's parent, outside the sandbox)

    def sandbox_path(self, depth: int) -> str:
        """The sandbox path of the directory `depth` names below host_root (0: itself)."""
        parts = self.relative.split("/")[:depth]
        return "/".join([self.sandbox_root, *parts]) if self.sandbox_root else ""


def locate(path: str, write_roots: list[tuple[str, str]]) -> Located:
    """The host directory and relative path of a sandbox path in one of the write roots
    ((sandbox path, host path) pairs); the deepest root that holds it."""
    best: tuple[str, str] | None = None
    for sandbox_root, host_root in write_roots:
        root = sandbox_root.rstrip("/")
        if (path == root or path.startswith(root + "/")) and (best is None or len(root) > len(best[0])):
            best = (root, host_root)
    if best is None:
        raise NotReadable("not in a write root")
    root, host_root = best
    if path == root:  # a bound file
        return Located(os.path.dirname(host_root), os.path.basename(host_root))
    return Located(host_root, path[len(root) + 1:], root)


def _open_each(root_fd: int, relative: str, seen: list[os.stat_result]) -> int:
    """An O_PATH descriptor of `relative` beneath `root_fd`, opened one name at a time,
    each beneath the last and never through a symlink; the stat of each one opened (the
    directories on the way, then the file) appended to `seen`, taken from what was opened."""
    fd = os.dup(root_fd)
    try:
        for part in relative.split("/"):
            nxt = openat2(fd, part, _BENEATH)
            os.close(fd)
            fd = nxt
            seen.append(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_chunks(where: Located, size: int, as_user: AsUser | None = None,
                found_as: tuple[int, ...] = (), seen: list[os.stat_result] | None = None) -> Iterator[bytes]:
    """The file's bytes, in chunks; NotReadable when it is not a regular file there now,
    holds more than `size` bytes, or (with `as_user`, the sandbox's user) is one the
    sandbox's user could not have read: opened as that user, from the write root down,
    so the kernel decides (directories it cannot search, mode bits, ACLs): the daemon
    reads as root, and what the sandbox could not read, a file it moved out of a
    directory closed to it, must not come out through its artifacts. `seen`: given the
    stat of the write root, of each directory on the way and of the file, as opened."""
    def run(fn: Callable[..., int], *args: object) -> int:
        return as_user.run(fn, *args) if as_user is not None else fn(*args)

    passed: list[os.stat_result] = []
    try:
        root_fd = _open_beneath_root(where.host_root)
    except OSError as exc:
        raise NotReadable(f"its write root cannot be opened ({exc.strerror})") from None
    try:
        passed.append(os.fstat(root_fd))
        try:
            path_fd = run(_open_each, root_fd, where.relative, passed)
        except PermissionError:
            raise NotReadable("the sandbox's user cannot reach it: not kept") from None
        except OSError as exc:
            raise NotReadable(f"not readable ({exc.strerror})") from None
        try:
            st = os.fstat(path_fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotReadable("no longer a regular file")
            if found_as and (st.st_dev, st.st_ino, st.st_ctime_ns) != found_as:
                raise NotReadable("changed after the call ended (not the file the record found there)")
            try:
                fd = run(os.open, f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except PermissionError:
                raise NotReadable("the sandbox's user cannot read it: not kept") from None
        finally:
            os.close(path_fd)
    finally:
        os.close(root_fd)
    if seen is not None:
        seen[:] = passed
    try:
        left = size + 1  # one byte more: a file that grew shows
        while left > 0:
            data = os.read(fd, min(CHUNK_BYTES, left))
            if not data:
                break
            left -= len(data)
            if left <= 0:
                raise NotReadable("changed after the call ended (it is larger than the record says)")
            yield data
        if found_as and os.fstat(fd).st_ctime_ns != found_as[2]:
            raise NotReadable("changed while it was read, after the call ended")
    finally:
        os.close(fd)


def copy_verified(chunks: Iterator[bytes], expected_sha256: str, sink: Callable[[bytes], None]) -> str:
    """Passes the chunks to `sink` and returns their sha256 ("sha256:<hex>"); NotReadable
    when the record holds a different hash (the file changed after the call ended)."""
    digest = hashlib.sha256()
    for data in chunks:
        digest.update(data)
        sink(data)
    found = "sha256:" + digest.hexdigest()
    if expected_sha256 and found != expected_sha256:
        raise NotReadable("changed after the call ended (its content no longer has the recorded hash)")
    return found
