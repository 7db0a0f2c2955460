"""FileService's streams from and to local files: an upload's requests made from a local
file or directory tree, and a download's chunks written below a local directory (each
file's sha256 checked against the daemon's before it is given its name)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from google.protobuf import json_format

from .local_files import READ_DIR, PartFile, open_dir, own_dir, owned, split_name
from sandboxd_contract.pb import sandboxd_pb2 as pb

CHUNK_BYTES = 1024 * 1024


class TransferError(Exception):
    """A download that did not arrive whole (a hash that does not match, a path that
    would land outside the destination)."""


def target(workspace: str = "", lease_id: str = "",
           policy: pb.SandboxPolicy | dict[str, Any] | None = None) -> pb.TransferTarget:
    """A workspace (with the policy whose roots apply) or a lease to transfer files with."""
    t = pb.TransferTarget(workspace=str(workspace), lease_id=lease_id)
    if isinstance(policy, dict):
        policy = json_format.ParseDict(policy, pb.SandboxPolicy())
    if policy is not None:
        t.policy.CopyFrom(policy)
    return t


@dataclass(frozen=True)
class LocalEntry:
    """A local file or directory to upload, by its path below the upload's; a file's
    inode as listed, so that what is sent is what was listed."""

    relative: str
    local: Path
    kind: str
    mode: int
    size: int
    inode: tuple[int, int] = (0, 0)  # (st_dev, st_ino)


def _entry(relative: str, path: Path, st: os.stat_result) -> LocalEntry | None:
    if stat.S_ISDIR(st.st_mode):
        return LocalEntry(relative, path, "dir", stat.S_IMODE(st.st_mode), 0)
    if stat.S_ISREG(st.st_mode):
        return LocalEntry(relative, path, "file", stat.S_IMODE(st.st_mode), st.st_size, (st.st_dev, st.st_ino))
    return None


def local_entries(source: Path) -> list[LocalEntry]:
    """`source` itself (one file: relative "") or every directory and file below it.
    Symlinks and special files are not sent (the daemon would not follow them either).
    The tree is listed through directory descriptors (os.fwalk): a directory swapped for
    a link while it is listed (by another user who may write in the tree) is not entered."""
    st = source.lstat()
    if stat.S_ISREG(st.st_mode):
        return [LocalEntry("", source, "file", stat.S_IMODE(st.st_mode), st.st_size, (st.st_dev, st.st_ino))]
    if not stat.S_ISDIR(st.st_mode):
        raise TransferError(f"{source} is neither a regular file nor a directory")
    found: list[LocalEntry] = []
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(source, follow_symlinks=False):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            entry = _entry(path.relative_to(source).as_posix(), path,
                           os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            if entry is not None:
                found.append(entry)
    return found


def _open_listed(entry: LocalEntry) -> BinaryIO:
    """The file listed, never a link put in its place nor another file reached through
    a directory swapped for one: refused unless it is the inode that was listed."""
    replaced = TransferError(f"{entry.local} was replaced since it was listed: not sent")
    try:
        fd = os.open(entry.local, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link now
            raise replaced from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != entry.inode:
        os.close(fd)
        raise replaced
    return os.fdopen(fd, "rb")


def upload_requests(to: pb.TransferTarget, path: str, entries: Iterable[LocalEntry]) -> Iterator[pb.UploadRequest]:
    yield pb.UploadRequest(target=to, path=path)
    for entry in entries:
        yield pb.UploadRequest(entry=pb.TransferEntry(path=entry.relative, kind=entry.kind, mode=entry.mode,
                                                      size_bytes=entry.size))
        if entry.kind != "file":
            continue
        left = entry.size
        with _open_listed(entry) as f:
            while left > 0:
                chunk = f.read(min(CHUNK_BYTES, left))
                if not chunk:
                    raise TransferError(f"{entry.local} shrank while it was sent")
                left -= len(chunk)
                yield pb.UploadRequest(data=chunk)
    yield pb.UploadRequest(commit=True)


def _parts(relative: str) -> list[str]:
    """The names of an entry's path below the destination; refused (whatever the daemon
    says) when one of them would climb out of it or name nothing."""
    parts = relative.split("/") if relative else []
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise TransferError(f"the daemon sent a path {relative!r} that would land outside the destination")
    return parts


@dataclass
class _Incoming:
    """The file being received: its part file (and the directory holding it), the mode
    it gets when whole, the bytes the daemon announced and those received."""

    shown: str
    part: PartFile
    dir_fd: int
    mode: int
    size: int
    digest: Any = field(default_factory=hashlib.sha256)
    received: int = 0


class Receiver:
    """Writes a download below `dest` (a single file: at `dest` itself), each file under
    a random temporary name until its sha256 is the daemon's. Every directory below
    `dest` (and `dest` itself) is made or entered relative to its parent's descriptor,
    never through a symlink, and must be this user's (local_files.py says why). Fed
    chunk by chunk (by the blocking and the async client alike); `feed` returns the
    daemon's result at the end."""

    def __init__(self, dest: str | os.PathLike[str]):
        self._dest = os.fspath(dest)
        self._root: int | None = None  # `dest` as a directory, once a tree's first entry came
        self._seen: set[str] = set()
        self._dirs: list[tuple[list[str], int]] = []  # given their modes at the end, deepest first
        self._current: _Incoming | None = None

    def feed(self, chunk: pb.DownloadChunk) -> pb.TransferResult | None:
        if chunk.HasField("result"):
            if self._current is not None:
                raise TransferError(f"{self._current.shown}: the download ended before this file's hash")
            self._give_dir_modes()
            return chunk.result
        if chunk.data:
            current = self._current
            if current is None:
                raise TransferError("data before any entry")
            current.received += len(chunk.data)
            if current.received > current.size:
                raise TransferError(f"{current.shown}: more bytes than the {current.size} the daemon announced")
            current.part.file.write(chunk.data)
            current.digest.update(chunk.data)
            return None
        entry = chunk.entry
        if entry.sha256 and not entry.kind:
            self._finish(entry.sha256)
        else:
            self._start(entry)
        return None

    def _start(self, entry: pb.TransferEntry) -> None:
        if self._current is not None:
            raise TransferError(f"{self._current.shown}: a new entry before this file's hash")
        parts = _parts(entry.path)
        if entry.path in self._seen:
            raise TransferError(f"the daemon sent {entry.path!r} twice")
        if "" in self._seen or (not parts and self._seen):
            raise TransferError(f"the daemon sent a file for {self._dest} itself beside other entries")
        self._seen.add(entry.path)
        if entry.kind == "dir" and parts:
            os.close(self._dir(parts))
            self._dirs.append((parts, entry.mode & 0o777 or 0o755))
            return
        if entry.kind != "file":
            raise TransferError(f"the daemon sent {entry.path!r} as {entry.kind!r}: expected a file or a directory "
                                "below the destination")
        if parts:
            dir_fd, name, shown = self._dir(parts[:-1]), parts[-1], "/".join([self._dest, *parts])
        else:
            parent, name = split_name(self._dest)
            dir_fd, shown = open_dir(parent, create=True), self._dest
        try:
            part = PartFile(dir_fd, name, shown)
        except BaseException:
            os.close(dir_fd)
            raise
        self._current = _Incoming(shown, part, dir_fd, entry.mode & 0o777 or 0o644, entry.size_bytes)

    def _dir(self, parts: list[str]) -> int:
        """The directory `parts` below `dest` (made where missing): its descriptor."""
        if self._root is None:
            parent, name = os.path.split(self._dest.rstrip("/") or self._dest)
            if name in ("", ".", ".."):  # the user's directory itself: it exists
                self._root = owned(open_dir(self._dest), self._dest)
            else:
                parent_fd = open_dir(parent or ".", create=True)
                try:
                    self._root = own_dir(parent_fd, name, self._dest, create=True, mode=0o777)
                finally:
                    os.close(parent_fd)
        fd, shown = os.dup(self._root), self._dest
        for name in parts:
            shown = f"{shown}/{name}"
            try:
                below = own_dir(fd, name, shown, create=True)
            finally:
                os.close(fd)
            fd = below
        return fd

    def _finish(self, sha256: str) -> None:
        current, self._current = self._current, None
        if current is None:
            raise TransferError("a hash before any file")
        try:
            got = "sha256:" + current.digest.hexdigest()
            if got != sha256 or current.received != current.size:
                raise TransferError(f"{current.shown}: received {current.received} bytes that hash to {got}, the "
                                    f"daemon sent {current.size} bytes and {sha256}")
            current.part.commit(current.mode)
        except BaseException:
            current.part.discard()
            raise
        finally:
            os.close(current.dir_fd)

    def _give_dir_modes(self) -> None:
        """Directories are made 0700 while they fill (one the sandbox has read-only
        would refuse its own files) and given their modes last, deepest first."""
        for parts, mode in reversed(self._dirs):
            parent = self._dir(parts[:-1])
            try:
                fd = own_dir(parent, parts[-1], "/".join([self._dest, *parts]), create=False,
                             flags=READ_DIR)
            finally:
                os.close(parent)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def abandon(self) -> None:
        """The download ended (whole or short): a file half written is removed, the
        directories held are let go."""
        current, self._current = self._current, None
        if current is not None:
            current.part.discard()
            os.close(current.dir_fd)
        if self._root is not None:
            os.close(self._root)
            self._root = None


def receive(chunks: Iterable[pb.DownloadChunk], dest: str | os.PathLike[str]) -> pb.TransferResult:
    receiver = Receiver(dest)
    try:
        for chunk in chunks:
            result = receiver.feed(chunk)
            if result is not None:
                return result
    finally:
        receiver.abandon()
    raise TransferError("the download ended before its result")
