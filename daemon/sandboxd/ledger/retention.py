"""Retention: a finished call older than the retention period loses its artifacts and
its forensic index rows. Its events stay, and a ToolCallExpired tombstone joins them,
naming what was removed by id and content hash: the chain still verifies from its first
event to its last, and a reviewer finds why an artifact is gone instead of a hole."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sandboxd.ledger import artifact_usage, transfer_usage
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.audit import AuditIndex
from sandboxd.ledger.event_types import RemovedArtifact, ToolCallExpired, draft
from sandboxd.ledger.events import EventLog
from sandboxd.core.settings import RetentionSettings
from sandboxd.ledger.store import Database

log = logging.getLogger("sandboxd.ledger.retention")

# Longest time a put blob may wait for the row that names it (see remove_unreferenced).
BLOB_GRACE_S = 600.0
# Between two batches of a backlog: the log's lock is free for the calls meanwhile.
BATCH_PAUSE_S = 0.05


def stored_time(t: datetime) -> str:
    """A time as events.utc_now writes it: such strings compare in time order."""
    return t.astimezone(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def cutoff(now: datetime, period_days: float) -> str:
    """Calls that ended before this stored time have expired."""
    return stored_time(now - timedelta(days=period_days))


@dataclass(frozen=True)
class ExpiredCall:
    tool_call_id: str
    artifact_ids: tuple[str, ...]
    content_hashes: tuple[str, ...]


def expire_calls(db: Database, events: EventLog, index: AuditIndex, before: str, period_days: float,
                 limit: int) -> list[ExpiredCall]:
    """Expires up to `limit` calls that ended before `before` (oldest first), each with
    its tombstone, in one transaction. The blobs are left to the caller: removing one
    is not part of the transaction (see FileArtifactStore.remove_unreferenced)."""
    index.sync()
    # A call's end is never before its start: requested_at bounds the scan.
    rows = index.db.query(
        "SELECT tool_call_id, finished_at FROM audit_calls WHERE requested_at < ? AND status != 'running'"
        " AND finished_at != '' AND finished_at < ? ORDER BY seq LIMIT ?", (before, before, limit))
    expired_at = ev.utc_now()
    out: list[ExpiredCall] = []
    with db.transaction() as conn:
        for row in rows:
            tool_call_id, finished_at = row["tool_call_id"], row["finished_at"]
            if conn.execute("SELECT 1 FROM events WHERE tool_call_id = ? AND type = ? LIMIT 1",
                            (tool_call_id, ev.EXPIRED)).fetchone():
                continue  # expired by a sweep whose tombstone the index has not seen yet
            artifacts = conn.execute(
                "SELECT artifact_id, kind, content_hash, size_bytes FROM artifacts WHERE tool_call_id = ?"
                " ORDER BY artifact_id", (tool_call_id,)).fetchall()
            last = conn.execute("SELECT event_id FROM events WHERE tool_call_id = ? ORDER BY seq DESC LIMIT 1",
                                (tool_call_id,)).fetchone()
            conn.execute("DELETE FROM file_artifacts WHERE artifact_id IN"
                         " (SELECT artifact_id FROM artifacts WHERE tool_call_id = ?)", (tool_call_id,))
            artifact_usage.remove_call(conn, tool_call_id)
            transfer_usage.remove_call(conn, tool_call_id)
            conn.execute("DELETE FROM artifacts WHERE tool_call_id = ?", (tool_call_id,))
            # Each blob stays pending here until it is gone: a crash after this commit
            # leaves it to the next sweep, never on disk for good.
            conn.executemany("INSERT OR REPLACE INTO expired_artifacts (artifact_id, tool_call_id, expired_at,"
                             " content_hash, blob_pending) VALUES (?,?,?,?,1)",
                             [(a[0], tool_call_id, expired_at, a[2]) for a in artifacts])
            # The idempotency key stays: a retry under it is refused as expired, never
            # run a second time (CallExecutor._answer_retry).
            # Indexing the tombstone removes the call's index rows (audit_projection.index_event),
            # so an index rebuilt from the log leaves them out as well.
            removed = tuple(RemovedArtifact(a[0], a[1], a[2], a[3]) for a in artifacts)
            events.append(conn, tool_call_id, last[0] if last else "",
                          [draft(ToolCallExpired(period_days, finished_at, expired_at, removed))])
            out.append(ExpiredCall(tool_call_id, tuple(a[0] for a in artifacts), tuple(a[2] for a in artifacts)))
    index.sync()  # the tombstones take the calls out of the index
    return out


class RetentionSweeper:
    """Expires calls at start and then every sweep interval, on a thread of its own."""

    def __init__(self, settings: RetentionSettings, db: Database, events: EventLog, artifacts: FileArtifactStore,
                 index: AuditIndex, on_swept: Callable[[], object] | None = None,
                 now: Callable[[], datetime] | None = None):
        self._settings = settings
        self._db = db
        self._events = events
        self._artifacts = artifacts
        self._index = index
        self._on_swept = on_swept
        self._now = now or (lambda: datetime.now(timezone.utc))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="retention")
        self.expired_total = 0  # calls this daemon expired since it started (a metric)

    def start(self) -> None:
        if self._settings.period_days > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def sweep(self) -> list[ExpiredCall]:
        """Everything expired now, batch by batch; then the blobs no other call names."""
        period = self._settings.period_days
        before = cutoff(self._now(), period)
        done: list[ExpiredCall] = []
        while not self._stop.is_set():
            batch = expire_calls(self._db, self._events, self._index, before, period, self._settings.batch)
            done += batch
            self.expired_total += len(batch)
            if len(batch) < self._settings.batch:
                break
            self._stop.wait(BATCH_PAUSE_S)  # calls' own commits go between batches
        self.remove_blobs(min(BLOB_GRACE_S, period * 86400))
        if done:
            log.info("retention: %d calls expired (ended before %s)", len(done), before)
            if self._on_swept is not None:
                self._on_swept()
        return done

    def remove_blobs(self, grace_s: float) -> int:
        """Removes the blobs of expired artifacts that no call names any more (including
        those an earlier sweep could not); returns how many hashes were settled."""
        pending = [r["content_hash"] for r in self._db.query(
            "SELECT DISTINCT content_hash FROM expired_artifacts WHERE blob_pending = 1")]
        settled = self._artifacts.remove_unreferenced(pending, grace_s)
        if settled:
            with self._db.transaction() as conn:
                conn.executemany("UPDATE expired_artifacts SET blob_pending = 0 WHERE blob_pending = 1"
                                 " AND content_hash = ?", [(h,) for h in settled])
        return len(settled)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:  # a failed sweep is retried at the next interval
                log.exception("the retention sweep failed")
            self._stop.wait(self._settings.sweep_interval_s)
