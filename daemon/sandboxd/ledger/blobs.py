"""Where artifact blobs are kept: the BlobStore protocol, the local store (files under
the state dir) and the reader that verifies a blob's sha256 as it is read. The S3 store
(s3_blobs.py, boto3) is imported only when the settings name it
(artifacts.open_blob_store)."""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import BinaryIO, Protocol

from sandboxd.core.errors import InternalError, SandboxdError

_CONTENT_HASH = re.compile(r"sha256:([0-9a-f]{64})")
READ_CHUNK_BYTES = 1024 * 1024


class BlobIntegrityError(InternalError):
    """A blob whose bytes do not hash to its address: refused, never served as complete."""


class BlobStoreUnavailable(SandboxdError):
    """The remote artifact store cannot be reached (or refuses the daemon) just now."""

    status = "UNAVAILABLE"
    kind = "ARTIFACT_STORE_UNAVAILABLE"
    retryable = True


def blob_key(content_hash: str) -> str:
    """`sha256:<hex>` -> `sha256/<ab>/<hex>`, the blob's key in every store. Anything
    else is refused: a key is also a path and an object name."""
    match = _CONTENT_HASH.fullmatch(content_hash)
    if not match:
        raise ValueError(f"{content_hash!r} is not a content hash (sha256:<64 lowercase hex digits>)")
    hexdigest = match.group(1)
    return f"sha256/{hexdigest[:2]}/{hexdigest}"


class ByteSource(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class VerifiedReader(io.RawIOBase):
    """A blob's bytes as they are read, hashed on the way: end of file is reported only
    once they hash to the expected digest; otherwise reading the end raises
    BlobIntegrityError (a download then ends with an error, never as complete)."""

    def __init__(self, raw: ByteSource, content_hash: str, where: str):
        super().__init__()
        blob_key(content_hash)
        self._raw = raw
        self._expected = content_hash.removeprefix("sha256:")
        self._where = where
        self._hash = hashlib.sha256()
        self._size = 0
        self._verified = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self._raw.read(len(buffer))
        if data:
            self._hash.update(data)
            self._size += len(data)
            buffer[:len(data)] = data
            return len(data)
        if not self._verified:
            digest = self._hash.hexdigest()
            if digest != self._expected:
                raise BlobIntegrityError(
                    f"blob sha256:{self._expected} in {self._where} is corrupt: its {self._size} bytes hash to "
                    f"sha256:{digest}; it is not served")
            self._verified = True
        return 0

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


class BlobStore(Protocol):
    """Blobs by content hash. `put` takes a finished local file already hashed to
    `content_hash` and is durable on return; `open` reads through a VerifiedReader
    and raises FileNotFoundError for a blob the store does not have."""

    def put(self, src: Path, content_hash: str) -> None: ...

    def open(self, content_hash: str) -> BinaryIO: ...

    def exists(self, content_hash: str) -> bool: ...

    def stored_at(self, content_hash: str) -> float | None:
        """When the blob was last put (seconds since the epoch); None when it is not stored."""
        ...

    def remove(self, content_hash: str) -> None:
        """Removes the blob; one already gone is no error."""
        ...

    def close(self) -> None: ...


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlobStore:
    """Blobs as files, `<blob_dir>/sha256/<ab>/<hex>` (0700 directories)."""

    def __init__(self, blob_dir: Path):
        self.blob_dir = blob_dir
        blob_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, content_hash: str) -> Path:
        return self.blob_dir / blob_key(content_hash)

    def put(self, src: Path, content_hash: str) -> None:
        """Moves `src` into its address, file and directory fsynced. Content already
        stored: `src` is dropped and the stored file's time refreshed (see stored_at)."""
        dest = self.path(content_hash)
        if dest.exists():
            src.unlink(missing_ok=True)
            os.utime(dest)
            return
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(src, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.utime(src)
        os.replace(src, dest)
        fsync_dir(dest.parent)

    def open(self, content_hash: str) -> BinaryIO:
        raw = open(self.path(content_hash), "rb")
        return io.BufferedReader(VerifiedReader(raw, content_hash, "the local blob store"), READ_CHUNK_BYTES)

    def exists(self, content_hash: str) -> bool:
        return self.path(content_hash).exists()

    def stored_at(self, content_hash: str) -> float | None:
        try:
            return self.path(content_hash).stat().st_mtime
        except FileNotFoundError:
            return None

    def remove(self, content_hash: str) -> None:
        self.path(content_hash).unlink(missing_ok=True)

    def hashes(self) -> list[str]:
        """Every blob stored, oldest first (a restarted uploader's backlog)."""
        found = []
        for path in self.blob_dir.glob("sha256/*/*"):
            try:
                found.append((path.stat().st_mtime, f"sha256:{path.name}"))
            except FileNotFoundError:
                continue
        return [h for _t, h in sorted(found) if _CONTENT_HASH.fullmatch(h)]

    def close(self) -> None:
        pass

