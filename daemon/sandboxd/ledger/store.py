"""The daemon's SQLite database: one file, WAL, a commit is fsynced before it returns.
The event log and the artifact index share it so that an artifact row and the event
that announces it commit together."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    event_id TEXT NOT NULL UNIQUE,
    tool_call_id TEXT NOT NULL,
    type TEXT NOT NULL,
    time TEXT NOT NULL,
    parent_event_id TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_call ON events (tool_call_id, seq);
CREATE TABLE IF NOT EXISTS artifacts (
    artifact_id TEXT PRIMARY KEY,
    tool_call_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    summary TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS artifacts_by_call ON artifacts (tool_call_id);
CREATE INDEX IF NOT EXISTS artifacts_by_content ON artifacts (content_hash);
-- A `file` artifact's path and what the call did to it (a table of its own: the
-- artifacts table of an older store stays as it is).
CREATE TABLE IF NOT EXISTS file_artifacts (
    artifact_id TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    change TEXT NOT NULL,
    previous_path TEXT NOT NULL,
    file_mode TEXT NOT NULL
);
-- Artifacts removed by retention: a download names the expiry instead of "no artifact";
-- blob_pending until the blob is gone (or named by another call), across restarts.
CREATE TABLE IF NOT EXISTS expired_artifacts (
    artifact_id TEXT PRIMARY KEY,
    tool_call_id TEXT NOT NULL,
    expired_at TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    blob_pending INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS expired_artifacts_pending ON expired_artifacts (blob_pending, content_hash);
-- An index over ToolCallRequested events that carried an idempotency key; written in
-- the same transaction as those events.
-- Who made each call (the principal of its ToolCallRequested event), for tenant checks.
CREATE TABLE IF NOT EXISTS call_owners (
    tool_call_id TEXT PRIMARY KEY,
    principal TEXT NOT NULL
);
-- What each principal's artifacts hold (artifact_usage.py), for quotas.artifact_mb.
CREATE TABLE IF NOT EXISTS artifact_usage (
    principal TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL
);
-- The entries each transfer record names, by its principal (transfer_usage.py), for
-- quotas.transfer_entries; a row leaves when retention expires the transfer.
CREATE TABLE IF NOT EXISTS transfer_usage (
    tool_call_id TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    entries INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS transfer_usage_by_principal ON transfer_usage (principal);
-- Each approval grant runs one call.
CREATE TABLE IF NOT EXISTS used_grants (
    grant_id TEXT PRIMARY KEY,
    tool_call_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    idempotency_key TEXT PRIMARY KEY,
    request_digest TEXT NOT NULL,
    tool_call_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_keys_by_call ON idempotency_keys (tool_call_id);
"""


class Database:
    def __init__(self, path: Path, schema: str = SCHEMA, durable: bool = True, checkpoint_pages: int = 0,
                 wal_keep_bytes: int = -1):
        """`durable` False: no commit is fsynced (a database rebuilt from another one,
        like the forensic index); WAL still keeps it whole across a crash.
        `checkpoint_pages`: the WAL's size that starts a checkpoint (SQLite's default,
        1,000, when 0); a checkpoint fsyncs the database file. `wal_keep_bytes`: what
        the WAL file is cut back to once a checkpoint has emptied it (-1: never cut)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.RLock()
        self._durable = durable
        self._wal_path = str(path) + "-wal"
        # Each transaction's serial (from its BEGIN), and the last one that committed:
        # EventLog keeps the log's head while the transaction that appended it is the
        # last to have committed.
        self.serial = 0
        self.last_committed = 0
        self._dir_synced = False
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # A commit writes the WAL; a durable one then fsyncs it (flush), as
            # synchronous=FULL would, so a relaxed one needs no pragma switched back and forth.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            if checkpoint_pages:
                self._conn.execute(f"PRAGMA wal_autocheckpoint={int(checkpoint_pages)}")
            if wal_keep_bytes >= 0:
                self._conn.execute(f"PRAGMA journal_size_limit={int(wal_keep_bytes)}")
            self._conn.executescript(schema)

    @contextmanager
    def transaction(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """Serialized write transaction; durable (fsynced) when the block returns, unless
        `durable` is False: then it is atomic and ordered but reaches the disk with the
        next durable commit (WAL keeps the log whole either way)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            self.serial += 1
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            self.last_committed = self.serial
            if durable and self._durable:
                self.flush()

    def flush(self) -> None:
        """Makes every commit so far durable, as a durable commit would: fsyncs the WAL
        (relaxed commits are in it, in the page cache, whole to any reader)."""
        try:
            fd = os.open(self._wal_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # no WAL: all is in the database file, which a checkpoint fsyncs
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if not self._dir_synced:  # the WAL's own name, once (as synchronous=FULL does)
            dir_fd = os.open(os.path.dirname(self._wal_path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self._dir_synced = True

    def ensure_schema(self, sql: str) -> None:
        """Runs CREATE ... IF NOT EXISTS statements (a module's own tables)."""
        with self._lock:
            self._conn.executescript(sql)

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._lock:
            cur = self._conn.execute(sql, args)
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, row)) for row in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
