"""FileArtifactStore: content-addressed blobs (sha256) under the daemon's state dir,
indexed in SQLite with the call and the event that persisted them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sandboxd.core.errors import NotFound
from sandboxd.ledger.store import Database


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
        # Held while a blob is put and while retention removes one: a blob is never
        # removed between a call putting it and that call's row naming it.
        self._blob_lock = threading.Lock()
        blob_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def blob_path(self, content_hash: str) -> Path:
        hexdigest = content_hash.removeprefix("sha256:")
        return self._blob_dir / "sha256" / hexdigest[:2] / hexdigest

    def put_blob(self, src: Path, content_hash: str) -> Path:
        """Moves a finished, already-hashed spool file into the content address.
        Durable on return: file and directory fsynced."""
        dest = self.blob_path(content_hash)
        with self._blob_lock:
            if dest.exists():
                src.unlink(missing_ok=True)
                os.utime(dest)  # put just now: see remove_unreferenced
                return dest
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(src, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.utime(src)
            os.replace(src, dest)
            _fsync_dir(dest.parent)
        return dest

    def remove_unreferenced(self, content_hashes: Iterable[str], grace_s: float = 600.0) -> list[str]:
        """Removes the blobs of these hashes that no artifact row names and that were not
        put in the last `grace_s` (a call that put one names it in its result's commit,
        which may not have happened yet). Returns the hashes settled: removed, already
        gone, or named by a row; the others (put too recently) are for a later try."""
        settled = []
        for content_hash in sorted(set(content_hashes)):
            path = self.blob_path(content_hash)
            with self._blob_lock:
                if not self._db.query("SELECT 1 FROM artifacts WHERE content_hash = ? LIMIT 1", (content_hash,)):
                    try:
                        if path.stat().st_mtime > time.time() - grace_s:
                            continue
                        path.unlink()
                    except FileNotFoundError:
                        pass
            settled.append(content_hash)
        return settled

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

    def expired(self, artifact_id: str) -> tuple[str, str] | None:
        """(tool_call_id, expired_at) of an artifact that retention removed."""
        rows = self._db.query("SELECT tool_call_id, expired_at FROM expired_artifacts WHERE artifact_id = ?",
                              (artifact_id,))
        return (rows[0]["tool_call_id"], rows[0]["expired_at"]) if rows else None

    def list_for_call(self, tool_call_id: str) -> list[ArtifactRecord]:
        rows = self._db.query("SELECT * FROM artifacts WHERE tool_call_id = ? ORDER BY created_at, artifact_id", (tool_call_id,))
        return [ArtifactRecord(**r) for r in rows]

    def open(self, record: ArtifactRecord) -> BinaryIO:
        return open(self.blob_path(record.content_hash), "rb")
