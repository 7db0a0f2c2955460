"""An upload lands whole or not at all: each file is written, as the sandbox's user (its
bytes too, on a thread with no capability), to a temporary name in its directory, its
size and sha256 checked and synced; only when every entry arrived complete are they
renamed into place. Anything short (a cap, a
size or hash that does not match, the client gone) removes the temporary files and the
directories the upload made."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Any

from sandboxd.core.as_user import AsUser
from sandboxd.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    SandboxdError,
)
from sandboxd.transfer.rules import Placed, Where
from sandboxd.transfer.tree import Walker, denied

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755


def entry_mode(mode: int, kind: str) -> int:
    """The permission bits an entry lands with: setuid, setgid and sticky dropped."""
    bits = mode & 0o777
    return bits or (DEFAULT_DIR_MODE if kind == "dir" else DEFAULT_FILE_MODE)


@dataclass
class _Open:
    placed: Placed
    tmp_name: str
    fd: int
    size: int
    sha256: str
    mode: int
    field: str
    written: int = 0
    digest: Any = None


@dataclass(frozen=True)
class _Staged:
    placed: Placed
    tmp_name: str
    record: dict[str, Any]


class UploadStaging:
    """The files and directories of one upload, staged under temporary names until
    `commit`; `rollback` takes everything back (call it unless commit returned)."""

    def __init__(self, fs: AsUser, where: Where, walker: Walker, transfer_id: str):
        self._fs, self._where, self._walker = fs, where, walker
        self._tmp_prefix = f".sandboxd-upload-{transfer_id}-"
        self._created: list[Placed] = []
        self._staged: list[_Staged] = []
        self._dirs: list[dict[str, Any]] = []
        self._open: _Open | None = None
        # What commit has renamed into place so far: what landed, should it stop halfway.
        self.landed: list[dict[str, Any]] = []

    def _parent(self, placed: Placed, field: str, create: bool) -> int:
        """The entry's directory (the walker's descriptor: not closed here)."""
        return self._walker.dir(placed, placed.parts[:-1], field, DEFAULT_DIR_MODE if create else None,
                                self._created if create else None)

    def add_dir(self, placed: Placed, mode: int, field: str) -> None:
        self._walker.dir(placed, placed.parts, field, entry_mode(mode, "dir"), self._created)
        self._dirs.append({"path": placed.path, "kind": "dir", "mode": entry_mode(mode, "dir")})

    def begin_file(self, placed: Placed, size: int, sha256: str, mode: int, field: str) -> None:
        if not placed.parts:
            raise FailedPrecondition(f"{placed.path} is a write root that is one file: an upload does not replace it",
                                     field=field)
        parent = self._parent(placed, field, create=True)
        self._refuse_existing(parent, placed, field)
        tmp = f"{self._tmp_prefix}{len(self._staged)}"
        try:
            fd = self._fs.run(os.open, tmp, _CREATE, 0o600, dir_fd=parent)
        except OSError as exc:
            raise denied(placed.path, exc, field) from None
        self._open = _Open(placed, tmp, fd, size, sha256, entry_mode(mode, "file"), field, digest=hashlib.sha256())

    def _refuse_existing(self, parent: int, placed: Placed, field: str) -> None:
        """What is already at the file's name may be replaced only if it is no directory
        and no masked inode."""
        try:
            st = self._fs.run(os.stat, placed.parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise denied(placed.path, exc, field) from None
        if stat.S_ISDIR(st.st_mode):
            raise FailedPrecondition(f"{placed.path} is a directory: a file does not replace it", field=field)
        if (st.st_dev, st.st_ino) in self._walker.masks:
            raise PermissionDenied(f"{placed.path} is a blocked path of the policy: never transferred", field=field)
        if (st.st_dev, st.st_ino) in self._walker.read_only:
            raise PermissionDenied(f"{placed.path} is a read root of the policy: an upload does not replace it",
                                   field=field)

    def write(self, data: bytes) -> None:
        current = self._open
        if current is None:
            raise InvalidArgument("data before any file entry", field="data")
        if current.written + len(data) > current.size:
            raise InvalidArgument(f"{current.placed.path}: more bytes than its declared {current.size}",
                                  field=current.field)
        # On the sandbox user's thread, which holds no capability: the bytes take only the
        # room that user could (its quota, never the blocks reserved for root).
        try:
            self._fs.run(_write_all, current.fd, data)
        except OSError as exc:
            raise _write_failed(current.placed.path, exc, current.field) from None
        current.digest.update(data)
        current.written += len(data)

    def end_file(self) -> None:
        current = self._open
        if current is None:
            return
        self._open = None
        try:
            if current.written != current.size:
                raise InvalidArgument(f"{current.placed.path}: {current.written} bytes arrived of its declared "
                                      f"{current.size}", field=current.field)
            got = "sha256:" + current.digest.hexdigest()
            if current.sha256 and current.sha256 != got:
                raise InvalidArgument(f"{current.placed.path}: its bytes hash to {got}, not the declared "
                                      f"{current.sha256}", field=current.field)
            try:
                self._fs.run(_settle, current.fd, current.mode)
            except OSError as exc:
                raise _write_failed(current.placed.path, exc, current.field) from None
        finally:
            os.close(current.fd)
            self._staged.append(_Staged(current.placed, current.tmp_name, {
                "path": current.placed.path, "kind": "file", "mode": current.mode, "sizeBytes": current.size,
                "sha256": "sha256:" + current.digest.hexdigest()}))

    def commit(self) -> list[dict[str, Any]]:
        """Every staged file renamed into place; the entries that landed. Each name is
        checked again first, all of them before the first rename, so that what the
        sandbox changed meanwhile refuses the upload whole; only a change made during
        the renames themselves stops one halfway, and `landed` then says how far."""
        for placed in _deepest_dirs([s.placed for s in self._staged]):
            # Each directory still where the record will say its files landed: checked
            # level by level on the way to the deepest ones, it passes every other.
            self._walker.still_there(placed, placed.parts[:-1], "path")
        for staged in self._staged:
            self._refuse_existing(self._parent(staged.placed, "path", create=False), staged.placed, "path")
        self.landed = list(self._dirs)
        for staged in self._staged:
            parent = self._parent(staged.placed, "path", create=False)
            self._refuse_existing(parent, staged.placed, "path")
            try:
                self._fs.run(os.rename, staged.tmp_name, staged.placed.parts[-1], src_dir_fd=parent,
                             dst_dir_fd=parent)
            except OSError as exc:
                raise denied(staged.placed.path, exc, "path") from None
            self.landed.append(staged.record)
        self._staged.clear()
        self._created.clear()
        return self.landed

    def rollback(self) -> None:
        """The temporary files removed, then the directories this upload made (emptiest
        first; one the sandbox has put something in meanwhile stays)."""
        if self._open is not None:
            os.close(self._open.fd)
            self._staged.append(_Staged(self._open.placed, self._open.tmp_name, {}))
            self._open = None
        # Last first: the walker still holds the last directories it reached (at commit,
        # the deepest), so a file whose directory the sandbox moved is still found.
        for staged in reversed(self._staged):
            self._remove(staged.placed, staged.tmp_name, rmdir=False)
        for placed in reversed(self._created):
            self._remove(placed, placed.parts[-1], rmdir=True)
        self._staged.clear()
        self._created.clear()

    def _remove(self, placed: Placed, name: str, rmdir: bool) -> None:
        try:
            parent = self._parent(placed, "path", create=False)
        except Exception:  # noqa: BLE001 - gone or moved: nothing left to remove there
            return
        try:
            self._fs.run(os.rmdir if rmdir else os.unlink, name, dir_fd=parent)
        except OSError:
            pass


def _deepest_dirs(files: list[Placed]) -> list[Placed]:
    """One file of each directory that holds files and no directory that does."""
    by_dir = {(p.bind.host_path, p.parts[:-1]): p for p in files}
    above = {(root, parts[:i]) for root, parts in by_dir for i in range(len(parts))}
    return [p for key, p in by_dir.items() if key not in above]


def _write_failed(path: str, exc: OSError, field: str) -> SandboxdError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{path}: no room left that the sandbox's user may fill ({exc.strerror})",
                                 field=field)
    return denied(path, exc, field)


def _settle(fd: int, mode: int) -> None:
    os.fchmod(fd, mode)
    os.fsync(fd)  # delayed allocation takes its blocks here: as the user too


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
