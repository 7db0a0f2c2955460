"""FileService's streams from and to local files: an upload's requests made from a local
file or directory tree, and a download's chunks written below a local directory (each
file's sha256 checked against the daemon's before it is given its name)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from google.protobuf import json_format

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
    """A local file or directory to upload, by its path below the upload's."""

    relative: str
    local: Path
    kind: str
    mode: int
    size: int


def local_entries(source: Path) -> list[LocalEntry]:
    """`source` itself (one file: relative "") or every directory and file below it.
    Symlinks and special files are not sent (the daemon would not follow them either)."""
    st = source.lstat()
    if stat.S_ISREG(st.st_mode):
        return [LocalEntry("", source, "file", stat.S_IMODE(st.st_mode), st.st_size)]
    if not stat.S_ISDIR(st.st_mode):
        raise TransferError(f"{source} is neither a regular file nor a directory")
    found: list[LocalEntry] = []
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            rel = path.relative_to(source).as_posix()
            if stat.S_ISDIR(st.st_mode):
                found.append(LocalEntry(rel, path, "dir", stat.S_IMODE(st.st_mode), 0))
            elif stat.S_ISREG(st.st_mode):
                found.append(LocalEntry(rel, path, "file", stat.S_IMODE(st.st_mode), st.st_size))
    return found


def upload_requests(to: pb.TransferTarget, path: str, entries: Iterable[LocalEntry]) -> Iterator[pb.UploadRequest]:
    yield pb.UploadRequest(target=to, path=path)
    for entry in entries:
        yield pb.UploadRequest(entry=pb.TransferEntry(path=entry.relative, kind=entry.kind, mode=entry.mode,
                                                      size_bytes=entry.size))
        if entry.kind != "file":
            continue
        left = entry.size
        with open(entry.local, "rb") as f:
            while left > 0:
                chunk = f.read(min(CHUNK_BYTES, left))
                if not chunk:
                    raise TransferError(f"{entry.local} shrank while it was sent")
                left -= len(chunk)
                yield pb.UploadRequest(data=chunk)
    yield pb.UploadRequest(commit=True)


def _inside(dest: Path, relative: str) -> Path:
    parts = relative.split("/") if relative else []
    if any(p in ("", ".", "..") for p in parts):
        raise TransferError(f"the daemon sent a path {relative!r} that would land outside {dest}")
    return dest.joinpath(*parts)


class Receiver:
    """Writes a download below `dest` (a single file: at `dest` itself), each file under
    a temporary name until its sha256 is the daemon's. Fed chunk by chunk (by the
    blocking and the async client alike); `feed` returns the daemon's result at the end."""

    def __init__(self, dest: Path):
        self._dest = dest
        self._current: tuple[Path, Path, BinaryIO, Any] | None = None  # (final, tmp, file, digest)

    def feed(self, chunk: pb.DownloadChunk) -> pb.TransferResult | None:
        if chunk.HasField("result"):
            return chunk.result
        if chunk.data:
            if self._current is None:
                raise TransferError("data before any entry")
            self._current[2].write(chunk.data)
            self._current[3].update(chunk.data)
            return None
        entry = chunk.entry
        if entry.sha256 and not entry.kind:
            self._finish(entry.sha256)
            return None
        path = _inside(self._dest, entry.path)
        if entry.kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(entry.mode & 0o777 or 0o755)
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.sandboxd-part")
        f = open(tmp, "wb")
        os.chmod(tmp, entry.mode & 0o777 or 0o644)
        self._current = (path, tmp, f, hashlib.sha256())
        return None

    def _finish(self, sha256: str) -> None:
        if self._current is None:
            raise TransferError("a hash before any file")
        final, tmp, f, digest = self._current
        self._current = None
        f.close()
        got = "sha256:" + digest.hexdigest()
        if got != sha256:
            tmp.unlink()
            raise TransferError(f"{final}: received bytes hash to {got}, the daemon sent {sha256}")
        os.replace(tmp, final)

    def abandon(self) -> None:
        """The download ended short: the file being written is removed."""
        if self._current is not None:
            self._current[2].close()
            self._current[1].unlink(missing_ok=True)
            self._current = None


def receive(chunks: Iterable[pb.DownloadChunk], dest: Path) -> pb.TransferResult:
    receiver = Receiver(dest)
    try:
        for chunk in chunks:
            result = receiver.feed(chunk)
            if result is not None:
                return result
    finally:
        receiver.abandon()
    raise TransferError("the download ended before its result")
