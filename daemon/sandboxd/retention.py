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

from . import events as ev
from .artifacts import FileArtifactStore
from .events import EventDraft, EventLog
from .settings import RetentionSettings
from .store import Database

log = logging.getLogger("sandboxd.retention")

# Longest time a put blob may wait for the row that names it (see remove_unreferenced).
BLOB_GRACE_S = 600.0


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


def expire_calls(db: Database, events: EventLog, before: str, period_days: float, limit: int) -> list[ExpiredCall]:
    """Expires up to `limit` calls that ended before `before` (oldest first), each with
    its tombstone, in one transaction. The blobs are left to the caller: removing one
    is not part of the transaction (see FileArtifactStore.remove_unreferenced)."""
    expired_at = ev.utc_now()
    out: list[ExpiredCall] = []
    with db.transaction() as conn:
        # A call's end is never before its start: requested_at bounds the scan.
        rows = conn.execute(
            "SELECT tool_call_id, finished_at FROM audit_calls WHERE requested_at < ? AND status != 'running'"
            " AND finished_at != '' AND finished_at < ? ORDER BY seq LIMIT ?", (before, before, limit)).fetchall()
        for tool_call_id, finished_at in rows:
            artifacts = conn.execute(
                "SELECT artifact_id, kind, content_hash, size_bytes FROM artifacts WHERE tool_call_id = ?"
                " ORDER BY artifact_id", (tool_call_id,)).fetchall()
            last = conn.execute("SELECT event_id FROM events WHERE tool_call_id = ? ORDER BY seq DESC LIMIT 1",
                                (tool_call_id,)).fetchone()
            conn.execute("DELETE FROM artifacts WHERE tool_call_id = ?", (tool_call_id,))
            conn.executemany("INSERT OR REPLACE INTO expired_artifacts (artifact_id, tool_call_id, expired_at)"
                             " VALUES (?,?,?)", [(a[0], tool_call_id, expired_at) for a in artifacts])
            # A retry under the call's key would be answered from artifacts that are gone.
            conn.execute("DELETE FROM idempotency_keys WHERE tool_call_id = ?", (tool_call_id,))
            # Indexing the tombstone removes the call's index rows (audit.index_event),
            # so an index rebuilt from the log leaves them out as well.
            events.append(conn, tool_call_id, last[0] if last else "", [EventDraft(ev.EXPIRED, {
                "reason": "retention", "periodDays": period_days, "endedAt": finished_at, "expiredAt": expired_at,
                "artifactsRemoved": [{"artifactId": a[0], "kind": a[1], "contentHash": a[2], "sizeBytes": a[3]}
                                     for a in artifacts],
            })])
            out.append(ExpiredCall(tool_call_id, tuple(a[0] for a in artifacts), tuple(a[2] for a in artifacts)))
    return out


class RetentionSweeper:
    """Expires calls at start and then every sweep interval, on a thread of its own."""

    def __init__(self, settings: RetentionSettings, db: Database, events: EventLog, artifacts: FileArtifactStore,
                 on_swept: Callable[[], object] | None = None, now: Callable[[], datetime] | None = None):
        self._settings = settings
        self._db = db
        self._events = events
        self._artifacts = artifacts
        self._on_swept = on_swept
        self._now = now or (lambda: datetime.now(timezone.utc))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="retention")

    def start(self) -> None:
        if self._settings.period_days > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def sweep(self) -> list[ExpiredCall]:
        """Everything expired now, batch by batch; the blobs no other call names go too."""
        period = self._settings.period_days
        before = cutoff(self._now(), period)
        grace_s = min(BLOB_GRACE_S, period * 86400)
        done: list[ExpiredCall] = []
        while not self._stop.is_set():
            batch = expire_calls(self._db, self._events, before, period, self._settings.batch)
            done += batch
            self._artifacts.remove_unreferenced((h for c in batch for h in c.content_hashes), grace_s)
            if len(batch) < self._settings.batch:
                break
        if done:
            log.info("retention: %d calls expired (ended before %s)", len(done), before)
            if self._on_swept is not None:
                self._on_swept()
        return done

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:  # a failed sweep is retried at the next interval
                log.exception("the retention sweep failed")
            self._stop.wait(self._settings.sweep_interval_s)
