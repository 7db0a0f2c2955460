"""The append-only, hash-chained event log: the single source of truth for what
happened. Each event's hash covers its content and the previous event's hash, so an
edited, removed or reordered event breaks the chain at a point `verify_chain` names."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sandboxd_contract.canonical import (GENESIS_HASH, ChainReport, canonical_json, check_checkpoints, event_hash,
                                       verify_chain)

from sandboxd.ledger.store import Database

_log = logging.getLogger("sandboxd.ledger.events")


# The seed's causal chain of one call, in order.
REQUESTED = "ToolCallRequested"
ARGS_VALIDATED = "ToolArgsValidated"
POLICY_CHECKED = "ToolPolicyChecked"
SANDBOX_PREPARED = "ToolSandboxPrepared"
STARTED = "ToolCallStarted"
FINISHED = "ToolCallFinished"
RESULT_VALIDATED = "ToolResultValidated"
ARTIFACT_PERSISTED = "ArtifactPersisted"
REJECTED = "ToolCallRejected"
# One connection attempt through the egress proxy, allowed or denied.
NETWORK_ACCESS = "NetworkAccessObserved"
# A credential put into a sandbox: binding id, principal and target, never the value.
CREDENTIAL_INJECTED = "CredentialInjected"
# A warm sandbox leased to a principal, and the end of that lease (released, expired,
# drained, or the daemon stopping). Their "call" id is the lease id.
SANDBOX_LEASED = "SandboxLeased"
SANDBOX_LEASE_ENDED = "SandboxLeaseEnded"
# Accesses to files under the sandbox's mounted roots: {"reads": [[path, opens], ...]}
# for paths opened and never written, {"accesses": [entry, ...]} for the rest, or why the
# record is incomplete (docs/CANONICAL.md; sandboxd_contract.canonical.file_accesses).
FILE_ACCESS = "FileAccessObserved"
# A retry with an already accepted idempotency key, answered from the first call.
REPLAYED = "ToolCallReplayed"
# The tombstone of a call past the retention period: its artifacts and index rows are
# gone (listed here by id and content hash), its events stay.
EXPIRED = "ToolCallExpired"
# A FileService upload or download, under its transfer id: one event, refused or done.
FILES_TRANSFERRED = "FilesTransferred"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Event:
    seq: int
    event_id: str
    tool_call_id: str
    type: str
    time: str
    parent_event_id: str
    payload_json: str
    prev_hash: str
    hash: str

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.payload_json)


@dataclass(frozen=True)
class EventDraft:
    type: str
    payload: dict[str, Any]
    event_id: str = ""


class EventLog:
    def __init__(self, db: Database, on_append: Callable[[Any, list["Event"]], None] | None = None):
        """`on_append(conn, events)` runs inside each appending transaction: the
        forensic index (audit.py) is kept that way, never behind a committed event."""
        self._db = db
        self._on_append = on_append
        # (the appending transaction's serial, seq, hash): the head, while that
        # transaction is the last one to have committed (not rolled back, no other
        # commit since). One query a commit fewer.
        self._head: tuple[int, int, str] | None = None

    def append(self, conn, tool_call_id: str, parent_event_id: str, drafts: Sequence[EventDraft]) -> list[Event]:
        """Appends drafts as a causal chain (each the parent of the next) inside the
        caller's transaction `conn` (Database.transaction())."""
        known = self._head
        if known is not None and known[0] == self._db.last_committed and known[0] != self._db.serial:
            seq, prev = known[1], known[2]
        else:
            row = conn.execute("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
            seq, prev = (row[0], row[1]) if row else (0, GENESIS_HASH)
        out: list[Event] = []
        parent = parent_event_id
        for d in drafts:
            seq += 1
            event_id = d.event_id or new_id("ev")
            time = utc_now()
            payload_json = canonical_json(d.payload).decode()
            h = event_hash(seq, event_id, tool_call_id, d.type, time, parent, payload_json, prev)
            conn.execute(
                "INSERT INTO events (seq, event_id, tool_call_id, type, time, parent_event_id, payload_json, prev_hash, hash)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (seq, event_id, tool_call_id, d.type, time, parent, payload_json, prev, h),
            )
            ev = Event(seq, event_id, tool_call_id, d.type, time, parent, payload_json, prev, h)
            out.append(ev)
            prev, parent = h, event_id
        if self._on_append is not None and out:
            self._on_append(conn, out)
        # Valid once this transaction has committed, until another one does.
        self._head = (self._db.serial, seq, prev) if out else None
        return out

    def record(self, tool_call_id: str, parent_event_id: str, drafts: Sequence[EventDraft],
               durable: bool = True) -> list[Event]:
        with self._db.transaction(durable) as conn:
            return self.append(conn, tool_call_id, parent_event_id, drafts)

    def for_call(self, tool_call_id: str) -> list[Event]:
        rows = self._db.query("SELECT * FROM events WHERE tool_call_id = ? ORDER BY seq", (tool_call_id,))
        return [Event(**r) for r in rows]

    def flush(self) -> None:
        self._db.flush()

    def has_call(self, tool_call_id: str) -> bool:
        return bool(self._db.query("SELECT 1 FROM events WHERE tool_call_id = ? LIMIT 1", (tool_call_id,)))

    def range(self, after_seq: int = 0, limit: int = 10_000) -> list[Event]:
        rows = self._db.query("SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
        return [Event(**r) for r in rows]

    def head(self) -> tuple[int, str]:
        rows = self._db.query("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")
        return (rows[0]["seq"], rows[0]["hash"]) if rows else (0, GENESIS_HASH)

    def verify(self, checkpoints: Sequence["Checkpoint"] = ()) -> ChainReport:
        """Recomputes the chain, then holds it against the checkpoints: a log that ends
        before a checkpoint was truncated, one whose event differs from a checkpoint was
        rewritten (even if consistently re-chained)."""
        total, prev_hash, prev_seq = 0, GENESIS_HASH, 0
        wanted = {c.seq for c in checkpoints}
        seen: dict[int, str] = {}
        while True:
            batch = self.range(prev_seq)
            if not batch:
                break
            report = verify_chain(batch, prev_hash, prev_seq)
            if not report.ok:
                return ChainReport(False, total + report.events_checked, report.first_bad_seq, report.reason)
            total += report.events_checked
            seen.update((e.seq, e.hash) for e in batch if e.seq in wanted)
            prev_hash, prev_seq = batch[-1].hash, batch[-1].seq
        broken = check_checkpoints({c.seq: seen.get(c.seq, "") for c in checkpoints}, prev_seq, total, checkpoints)
        return broken or ChainReport(True, total, head_hash=prev_hash if total else "")


@dataclass(frozen=True)
class Checkpoint:
    seq: int
    hash: str
    time: str


class CheckpointFile:
    """The log's head, written down outside the database after each call: an append-only
    JSONL file, fsynced, and the same line in the daemon's own log (which operators ship
    elsewhere). Removing events from the end of the log, or rewriting it wholesale and
    re-chaining, then no longer verifies."""

    def __init__(self, path, log: EventLog, min_interval_s: float = 1.0):
        self._path = path
        self._log = log
        self._lock = threading.Lock()
        self._last_seq = max((c.seq for c in self.read()), default=0)
        # One fsynced line per call would cost every call a disk flush: at most one per
        # interval (one skipped is written once the interval has passed, and always at
        # shutdown), which bounds what an undetected truncation could remove to the last
        # interval's events.
        self._min_interval_s = min_interval_s
        self._last_time = float("-inf")  # none written yet by this daemon
        # The last checkpoint() was skipped for the interval: try again once it has passed
        # (known without reading the log's head, which a call's commit holds the lock of).
        self.skipped = False

    @property
    def min_interval_s(self) -> float:
        return self._min_interval_s

    def read(self) -> list[Checkpoint]:
        try:
            with open(self._path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                d = json.loads(line)
                out.append(Checkpoint(int(d["seq"]), str(d["hash"]), str(d["time"])))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line (a crash mid-write) checks nothing
        return out

    def checkpoint(self, force: bool = False) -> Checkpoint | None:
        """Writes the current head if it moved (and the interval passed); returns it."""
        with self._lock:
            now = time.monotonic()
            self.skipped = not force and now - self._last_time < self._min_interval_s
            if self.skipped:
                return None
            seq, h = self._log.head()
            if seq <= self._last_seq:
                return None
            # The head may be a relaxed commit's (an accepted call's, before its command
            # starts): on disk before a checkpoint names it.
            self._log.flush()
            self._last_time = now
            c = Checkpoint(seq, h, utc_now())
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (json.dumps({"seq": c.seq, "hash": c.hash, "time": c.time}) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self._last_seq = seq
            _log.info("log checkpoint seq=%d hash=%s", c.seq, c.hash)
            return c
