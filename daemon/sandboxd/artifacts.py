"""FileArtifactStore: content-addressed blobs (sha256) under the daemon's state dir,
indexed in SQLite with the call and the event that persisted them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import NotFound
from .store import Database


@dataclass(frozen=True)
class ArtifactRecord:
    artifact_id: str
    tool_call_id: str
    event_id: str
    kind: str
    content_hash: str  # "sha256:<hex>"
    size_bytes: int
    summary: str
    created_at: str

    @property
    def uri(self) -> str:
        return f"sandboxd://artifacts/{self.artifact_id}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileArtifactStore:
    def __init__(self, blob_dir: Path, db: Database):
        self._blob_dir = blob_dir
        self._db = db
        blob_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def blob_path(self, content_hash: str) -> Path:
        hexdigest = content_hash.removeprefix("sha256:")
        return self._blob_dir / "sha256" / hexdigest[:2] / hexdigest

    def put_blob(self, src: Path, content_hash: str) -> Path:
        """Moves a finished, already-hashed spool file into the content address.
        Durable on return: file and directory fsynced."""
        dest = self.blob_path(content_hash)
        if dest.exists():
            src.unlink(missing_ok=True)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(src, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(src, dest)
        _fsync_dir(dest.parent)
        return dest

    def insert(self, conn, record: ArtifactRecord) -> None:
        """Indexes an artifact inside the caller's transaction (with its event)."""
        conn.execute(
            "INSERT INTO artifacts (artifact_id, tool_call_id, event_id, kind, content_hash, size_bytes, summary, created_at)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (record.artifact_id, record.tool_call_id, record.event_id, record.kind, record.content_hash,
             record.size_bytes, record.summary, record.created_at),
        )

    def get(self, artifact_id: str) -> ArtifactRecord:
        rows = self._db.query("SELECT * FROM artifacts WHERE artifact_id = ?", (artifact_id,))
        if not rows:
            raise NotFound(f"no artifact {artifact_id}", field="artifactId")
        return ArtifactRecord(**rows[0])

    def list_for_call(self, tool_call_id: str) -> list[ArtifactRecord]:
        rows = self._db.query("SELECT * FROM artifacts WHERE tool_call_id = ? ORDER BY created_at, artifact_id", (tool_call_id,))
        return [ArtifactRecord(**r) for r in rows]

    def open(self, record: ArtifactRecord) -> BinaryIO:
        return open(self.blob_path(record.content_hash), "rb")
