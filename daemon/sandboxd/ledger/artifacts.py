"""FileArtifactStore: content-addressed blobs (sha256) in a blob store (blobs.py: the
local one under the daemon's state dir, or S3 behind it), indexed in SQLite with the call
and the event that persisted them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sandboxd.core.errors import NotFound
from sandboxd.core.settings import ArtifactSettings
from sandboxd.ledger import artifact_usage
from sandboxd.ledger.blobs import BlobStore, BlobStoreUnavailable, LocalBlobStore
from sandboxd.ledger.store import Database

log = logging.getLogger("sandboxd.ledger.artifacts")


def open_blob_store(settings: ArtifactSettings, blob_dir: Path) -> BlobStore:
    """The store the settings name. `s3`: blobs land in the local store first and are
    uploaded behind the call (s3_blobs.SpooledS3BlobStore); boto3 is imported here."""
    local = LocalBlobStore(blob_dir)
    if settings.store == "local":
        return local
    from sandboxd.ledger.s3_blobs import SpooledS3BlobStore, s3_store

    store = SpooledS3BlobStore(local, s3_store(settings))
    store.start()
    return store


_WITH_FILES = ("SELECT a.*, coalesce(f.path, '') AS path, coalesce(f.change, '') AS change,"
               " coalesce(f.previous_path, '') AS previous_path, coalesce(f.file_mode, '') AS file_mode"
               " FROM artifacts a LEFT JOIN file_artifacts f ON f.artifact_id = a.artifact_id")


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
    # A `file` artifact's: the sandbox path, created | modified | renamed | deleted,
    # where a renamed file was, its mode after the call ("0644"; "" when deleted).
    path: str = ""
    change: str = ""
    previous_path: str = ""
    file_mode: str = ""

    @property
    def uri(self) -> str:
        return f"sandboxd://artifacts/{self.artifact_id}"


class FileArtifactStore:
    def __init__(self, blob_dir: Path, db: Database, blobs: BlobStore | None = None):
        self._blob_dir = blob_dir
        self._db = db
        self.blobs: BlobStore = blobs if blobs is not None else LocalBlobStore(blob_dir)
        # One is held while a blob is put and while retention removes it: a blob is never
        # removed between a call putting it and that call's row naming it. Striped by
        # hash: a removal waiting on S3 holds up no put of other content.
        self._blob_locks = [threading.Lock() for _ in range(64)]

    def _blob_lock(self, content_hash: str) -> threading.Lock:
        return self._blob_locks[hash(content_hash) % len(self._blob_locks)]

    def blob_path(self, content_hash: str) -> Path:
        """Where the local store keeps a blob (with S3: until it is uploaded)."""
        return LocalBlobStore(self._blob_dir).path(content_hash)

    def incoming_dir(self) -> Path:
        """Where a blob is written before it is put (beside the store: the put is a rename)."""
        path = self._blob_dir / "incoming"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path

    def put_blob(self, src: Path, content_hash: str) -> Path:
        """Moves a finished, already-hashed spool file into the content address.
        Durable on return (in the local store; S3 gets it behind the call)."""
        with self._blob_lock(content_hash):
            self.blobs.put(src, content_hash)
        return self.blob_path(content_hash)

    def open_blob(self, content_hash: str) -> BinaryIO:
        """A blob's bytes, verified against the hash as they are read
        (FileNotFoundError: no store has it)."""
        return self.blobs.open(content_hash)

    def remove_unreferenced(self, content_hashes: Iterable[str], grace_s: float = 600.0) -> list[str]:
        """Removes the blobs of these hashes that no artifact row names and that were not
        put in the last `grace_s` (a call that put one names it in its result's commit,
        which may not have happened yet). Returns the hashes settled: removed, already
        gone, or named by a row; the others (put too recently, or their store
        unreachable) are for a later try."""
        settled = []
        for content_hash in sorted(set(content_hashes)):
            with self._blob_lock(content_hash):
                if not self._db.query("SELECT 1 FROM artifacts WHERE content_hash = ? LIMIT 1", (content_hash,)):
                    try:
                        stored_at = self.blobs.stored_at(content_hash)
                        if stored_at is not None and stored_at > time.time() - grace_s:
                            continue
                        if stored_at is not None:
                            self.blobs.remove(content_hash)
                    except BlobStoreUnavailable as exc:
                        log.warning("blob %s not removed yet: %s", content_hash, exc.reason)
                        continue
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
        artifact_usage.add(conn, record.tool_call_id, record.size_bytes)
        if record.path:
            conn.execute("INSERT INTO file_artifacts (artifact_id, path, change, previous_path, file_mode)"
                         " VALUES (?,?,?,?,?)",
                         (record.artifact_id, record.path, record.change, record.previous_path, record.file_mode))

    def get(self, artifact_id: str) -> ArtifactRecord:
        rows = self._db.query(f"{_WITH_FILES} WHERE a.artifact_id = ?", (artifact_id,))
        if not rows:
            raise NotFound(f"no artifact {artifact_id}", field="artifactId")
        return ArtifactRecord(**rows[0])

    def expired(self, artifact_id: str) -> tuple[str, str] | None:
        """(tool_call_id, expired_at) of an artifact that retention removed."""
        rows = self._db.query("SELECT tool_call_id, expired_at FROM expired_artifacts WHERE artifact_id = ?",
                              (artifact_id,))
        return (rows[0]["tool_call_id"], rows[0]["expired_at"]) if rows else None

    def list_for_call(self, tool_call_id: str) -> list[ArtifactRecord]:
        rows = self._db.query(f"{_WITH_FILES} WHERE a.tool_call_id = ? ORDER BY a.created_at, a.artifact_id",
                              (tool_call_id,))
        return [ArtifactRecord(**r) for r in rows]

    def open(self, record: ArtifactRecord) -> BinaryIO:
        return self.open_blob(record.content_hash)
