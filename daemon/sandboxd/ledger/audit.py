"""The forensic index: which calls ran what, as whom, where, touched which paths and
contacted which hosts. It is a projection of the event log (the log stays the single
source of truth), kept in a database of its own (`AuditIndex`): a thread tails the log
and indexes what was appended, and every query first brings the index up to the log's
head, so a query sees every call recorded before it. An index that is behind the log
(a new daemon version, a lost or restored file) catches up from it.

Why not in the appending transaction: a call's path rows land all over the by-path
index (a test run touching 3,000 files dirties most of its pages), which cost a
recorded call ~40 ms of its own commit; tailing takes that off the call and batches it."""

from __future__ import annotations

import base64
import json
import logging
import posixpath
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sandboxd.ledger import events as ev
# The projection of the appended events (also audit.index_events, as the log's on_append).
from sandboxd.ledger.audit_projection import index_events as index_events
from sandboxd.ledger.store import Database

log = logging.getLogger("sandboxd.ledger.audit")

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_calls (
    seq INTEGER PRIMARY KEY,              -- of the call's ToolCallRequested: newest first
    tool_call_id TEXT NOT NULL UNIQUE,
    principal TEXT NOT NULL,
    workspace TEXT NOT NULL,
    command TEXT NOT NULL,                -- argv, shell-quoted; "" when not recorded
    tool_id TEXT NOT NULL,
    backend TEXT NOT NULL DEFAULT '',
    image TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL,                 -- running | success | error | partial | cancelled | rejected
    exit_code INTEGER,
    error_code TEXT NOT NULL DEFAULT '',
    requested_at TEXT NOT NULL,
    finished_at TEXT NOT NULL DEFAULT '',
    proposed_by TEXT NOT NULL DEFAULT '', -- the request's proposedBy and sessionId: which agent, which session
    session_id TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS audit_calls_by_principal ON audit_calls (principal, seq);
CREATE INDEX IF NOT EXISTS audit_calls_by_workspace ON audit_calls (workspace, seq);
CREATE INDEX IF NOT EXISTS audit_calls_by_status ON audit_calls (status, seq);
CREATE INDEX IF NOT EXISTS audit_calls_by_time ON audit_calls (requested_at);
CREATE INDEX IF NOT EXISTS audit_calls_by_proposer ON audit_calls (proposed_by, seq);
CREATE INDEX IF NOT EXISTS audit_calls_by_session ON audit_calls (session_id, seq);
-- call_seq is the call's audit_calls.seq: walking (host, call_seq) backwards yields the
-- newest calls first and stops at the page size, however common the host.
CREATE TABLE IF NOT EXISTS audit_network (
    event_seq INTEGER NOT NULL,           -- the NetworkAccessObserved event: indexed once
    call_seq INTEGER NOT NULL,
    tool_call_id TEXT NOT NULL,
    host TEXT NOT NULL,
    rhost TEXT NOT NULL,                  -- host reversed: a suffix becomes a prefix range
    port INTEGER NOT NULL,
    decision TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_network_by_host ON audit_network (host, call_seq);
CREATE INDEX IF NOT EXISTS audit_network_by_rhost ON audit_network (rhost, call_seq);
CREATE INDEX IF NOT EXISTS audit_network_by_call ON audit_network (call_seq);
CREATE UNIQUE INDEX IF NOT EXISTS audit_network_once ON audit_network (event_seq, host, port, decision);
-- A call's (path, operation) once, however many events name it: the table is its own
-- by-path index, and indexing an event again adds nothing. (With a rowid, an event
-- column and an index for each, a test run's 3,000 reads cost 560 KB and 45-70 ms.)
CREATE TABLE IF NOT EXISTS audit_paths (
    path TEXT NOT NULL,                   -- as the sandbox saw it, e.g. /workspace/src/auth.py
    op TEXT NOT NULL,                     -- read | write | create | delete | rename | chmod | upload | download
    call_seq INTEGER NOT NULL,
    PRIMARY KEY (path, op, call_seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS audit_paths_by_call ON audit_paths (call_seq);
CREATE TABLE IF NOT EXISTS audit_meta (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    indexed_seq INTEGER NOT NULL
);
"""

# FileAccessObserved payloads carry these operations.
PATH_OPERATIONS = ("read", "write", "create", "delete", "rename", "chmod", "upload", "download")
STATUSES = ("running", "success", "error", "partial", "cancelled", "rejected")
MAX_PAGE = 500
# A call's proposedBy and sessionId are at most this long (policy.models.PreparedToolCall
# refuses longer ones), so a longer filter is a mistake, refused rather than answered empty.
MAX_CALL_NAME_CHARS = 256


# A call's 3,000 reads dirty as many pages of the by-path table: with SQLite's default
# (a checkpoint, and its fsync, once the WAL holds 1,000 pages) each such call paid one;
# at 16,384 pages (64 MiB of WAL) indexing such calls takes a fifth less on average, in
# fewer, longer checkpoints on the index's thread (bench/audit_query.py --heavy). Once a
# checkpoint has emptied it, the WAL file is cut back to 16 MiB.
INDEX_CHECKPOINT_PAGES = 16384
INDEX_WAL_KEEP_BYTES = 16 * 2**20


def open_index_db(path) -> Database:
    """The forensic index's own database: never fsynced on its own (it is rebuilt from
    the log), checkpointed in large steps."""
    return Database(path, schema="", durable=False, checkpoint_pages=INDEX_CHECKPOINT_PAGES,
                    wal_keep_bytes=INDEX_WAL_KEEP_BYTES)

# Bumped when the index's tables change: the old ones are dropped and rebuilt from the log.
SCHEMA_VERSION = 7  # 5: reads recorded as [path, opens] pairs (an older daemon's rebuild skips them);
#                     6: audit_paths keyed by (path, op, call_seq), without a rowid;
#                     7: audit_calls keeps the request's proposedBy and sessionId
_TABLES = ("audit_calls", "audit_network", "audit_paths", "audit_meta")


def drop_from_log_db(db) -> None:
    """Daemons before the index had its own file kept it in the log's database."""
    db.ensure_schema("".join(f"DROP TABLE IF EXISTS {t};" for t in _TABLES) + "DROP TABLE IF EXISTS audit_schema;")


def ensure_schema(db) -> None:
    db.ensure_schema("CREATE TABLE IF NOT EXISTS audit_schema (version INTEGER NOT NULL)")
    rows = db.query("SELECT version FROM audit_schema")
    if not rows or rows[0]["version"] != SCHEMA_VERSION:
        db.ensure_schema("".join(f"DROP TABLE IF EXISTS {t};" for t in _TABLES)
                         + f"DELETE FROM audit_schema; INSERT INTO audit_schema VALUES ({SCHEMA_VERSION});")
    db.ensure_schema(SCHEMA)


_EVENT_COLUMNS = "seq, event_id, tool_call_id, type, time, parent_event_id, payload_json, prev_hash, hash"


def catch_up(db, batch: int = 5000, log_db=None) -> int:
    """Indexes every event of `log_db`'s log (default: `db`'s own) that the index in
    `db` has not seen; returns how many."""
    done = 0
    while True:
        if log_db is None or log_db is db:
            # Read and index in one write transaction: nothing can be appended in between.
            with db.transaction() as conn:
                row = conn.execute("SELECT indexed_seq FROM audit_meta WHERE id = 1").fetchone()
                after = row[0] if row else 0
                cur = conn.execute(f"SELECT {_EVENT_COLUMNS} FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                                   (after, batch))
                found = [ev.Event(*r) for r in cur.fetchall()]
                index_events(conn, found)
        else:
            # Only this thread writes the index: its position cannot move meanwhile.
            rows = db.query("SELECT indexed_seq FROM audit_meta WHERE id = 1")
            after = rows[0]["indexed_seq"] if rows else 0
            found = [ev.Event(**r) for r in log_db.query(
                f"SELECT {_EVENT_COLUMNS} FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (after, batch))]
            if found:
                with db.transaction() as conn:
                    index_events(conn, found)
        if not found:
            return done
        done += len(found)


class AuditIndex:
    """The index in `index_db`, tailing the log in `log_db` on a thread of its own.
    `notify` (hooked to EventLog's appends) wakes it; `sync` brings it to the log's head
    in the caller's thread. The index file is never fsynced on its own: whatever a crash
    takes from it is indexed again from the log (its position commits with its rows).

    The tail waits for the log to go quiet for `quiet_s` (at most `max_delay_s` after
    the first event it has not indexed) before it reads: indexing right at each commit
    took the log's lock and the interpreter from the call that had just committed, half
    a millisecond of a leased command's five. Queries lose nothing by it: each one
    syncs first."""

    def __init__(self, log_db, index_db, batch: int = 5000, quiet_s: float = 0.02, max_delay_s: float = 0.5):
        self.log_db = log_db
        self.db = index_db
        self._batch = batch
        self._quiet_s = quiet_s
        self._max_delay_s = max_delay_s
        self._lock = threading.Lock()  # one catch-up at a time
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._tail, daemon=True, name="audit-index")
        ensure_schema(index_db)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def notify(self, *_ignored) -> None:
        self._wake.set()

    def lag(self) -> int:
        """Events in the log the index has not seen yet (a metric: it should stay near 0)."""
        head = self.log_db.query("SELECT COALESCE(MAX(seq), 0) AS seq FROM events")[0]["seq"]
        rows = self.db.query("SELECT indexed_seq FROM audit_meta WHERE id = 1")
        return max(0, head - (rows[0]["indexed_seq"] if rows else 0))

    def sync(self) -> int:
        """Indexes everything appended so far; returns how many events that was."""
        with self._lock:
            return catch_up(self.db, self._batch, log_db=self.log_db)

    def _tail(self) -> None:
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()
            give_up = time.monotonic() + self._max_delay_s
            # Each append sets the event again: wait until one quiet interval passes.
            while not self._stopping and self._wake.wait(min(self._quiet_s, max(0.0, give_up - time.monotonic()))):
                self._wake.clear()
                if time.monotonic() >= give_up:
                    break
            if self._stopping:
                return
            try:
                self.sync()
            except Exception:  # retried at the next append; queries sync themselves
                log.exception("indexing the log failed")


class BadFilter(ValueError):
    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class CallQuery:
    command_contains: str = ""
    path: str = ""
    path_operation: str = ""
    domain: str = ""
    principal: str = ""
    workspace: str = ""
    status: str = ""
    since: str = ""
    until: str = ""
    page_size: int = 50
    page_token: str = ""
    proposed_by: str = ""
    session_id: str = ""


def stored_time(text: str, field: str) -> str:
    """An RFC 3339 time (or a bare date: midnight UTC) in the form event times are
    stored in (UTC, microseconds, Z), so that comparing the text compares the instants."""
    text = text.strip()
    if len(text) == 10:
        text += "T00:00:00Z"
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise BadFilter(field, f"{text!r} is not an RFC 3339 time") from None
    if t.tzinfo is None:
        raise BadFilter(field, f"{text!r} needs a time zone (Z or +hh:mm)")
    return t.astimezone(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def encode_token(seq: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"before": seq}).encode()).decode()


def decode_token(token: str) -> int:
    try:
        before = json.loads(base64.urlsafe_b64decode(token.encode()))["before"]
    except (ValueError, KeyError, TypeError):
        raise BadFilter("pageToken", "not a page token from this daemon") from None
    if not isinstance(before, int) or isinstance(before, bool) or not 0 <= before < 2**63:
        raise BadFilter("pageToken", "not a page token from this daemon")
    return before


# A driving filter with at least this many matching rows is read newest-first along the
# call order (stopping at a page) rather than collected from its own index and sorted.
DENSE_ROWS = 2000
_TABLES_BY_ALIAS = {"n": ("audit_network", "audit_network_by_call"), "p": ("audit_paths", "audit_paths_by_call")}


def _check(q: CallQuery) -> int:
    for field, value in (("proposedBy", q.proposed_by), ("sessionId", q.session_id)):
        if "\x00" in value:
            raise BadFilter(field, "contains a NUL byte")
        if len(value) > MAX_CALL_NAME_CHARS:
            raise BadFilter(field, f"{len(value)} characters exceed the maximum of {MAX_CALL_NAME_CHARS}")
    if q.status and q.status not in STATUSES:
        raise BadFilter("status", f"one of {', '.join(STATUSES)}")
    if q.path_operation and q.path_operation not in PATH_OPERATIONS:
        raise BadFilter("pathOperation", f"one of {', '.join(PATH_OPERATIONS)}")
    if q.path_operation and not q.path:
        raise BadFilter("pathOperation", "needs a path")
    size = q.page_size or 50
    if not 0 < size <= MAX_PAGE:
        raise BadFilter("pageSize", f"1 to {MAX_PAGE}")
    return size


def _drivers(q: CallQuery) -> list[tuple[str, str, list[Any]]]:
    """(table alias, condition, args) of the domain and path filters."""
    drivers: list[tuple[str, str, list[Any]]] = []
    if q.domain:
        domain = q.domain.strip().rstrip(".").lower()
        if domain.startswith("*."):
            # Reversed, "tset.selif." is a prefix of every host below files.test.
            prefix = domain[1:][::-1]
            drivers.append(("n", "n.rhost >= ? AND n.rhost < ?", [prefix, prefix[:-1] + chr(ord(".") + 1)]))
        else:
            drivers.append(("n", "n.host = ?", [domain]))
    if q.path:
        path = posixpath.normpath(q.path if q.path.startswith("/") else "/workspace/" + q.path)
        if path.startswith("//"):
            path = "/" + path.lstrip("/")
        if path == "/":
            cond, pargs = "p.path >= ?", ["/"]  # everything
        else:
            cond = "(p.path = ? OR (p.path >= ? AND p.path < ?))"  # the path, or anything below it
            pargs = [path, path + "/", path + "0"]  # "0" sorts right after "/"
        if q.path_operation:
            cond += " AND p.op = ?"
            pargs.append(q.path_operation)
        drivers.append(("p", cond, pargs))
    return drivers


def _call_filters(q: CallQuery) -> tuple[list[str], list[Any]]:
    where: list[str] = []
    args: list[Any] = []
    if q.page_token:
        where.append("c.seq < ?")
        args.append(decode_token(q.page_token))
    for column, value in (("principal", q.principal), ("workspace", q.workspace), ("status", q.status),
                          ("proposed_by", q.proposed_by), ("session_id", q.session_id)):
        if value:
            where.append(f"c.{column} = ?")
            args.append(value)
    if q.since:
        where.append("c.requested_at >= ?")
        args.append(stored_time(q.since, "since"))
    if q.until:
        where.append("c.requested_at < ?")
        args.append(stored_time(q.until, "until"))
    if q.command_contains:
        where.append("c.command LIKE ? ESCAPE '\\'")
        args.append(f"%{_like_escape(q.command_contains)}%")
    return where, args


def build_query(q: CallQuery, walk: bool = False) -> tuple[str, list[Any]]:
    """SQL (and its arguments) for one page of matching calls, newest first. Raises
    BadFilter naming the bad filter.

    A domain or path filter drives the query from its own table, grouped by the call's
    seq; the other filters probe audit_calls by primary key. `walk` reads the driving
    table along the call order (right for a filter that matches many rows: the page
    fills at once) instead of from its own index (right for a selective one)."""
    size = _check(q)
    drivers = _drivers(q)
    where, args = _call_filters(q)
    if not drivers:
        sql = "SELECT c.* FROM audit_calls c"
        if where:
            sql += " WHERE " + " AND ".join(where)
        return sql + " ORDER BY c.seq DESC LIMIT ?", args + [size + 1]
    alias, cond, dargs = drivers[0]
    table, by_call = _TABLES_BY_ALIAS[alias]
    hint = f" INDEXED BY {by_call}" if walk else ""
    sql = f"SELECT c.* FROM {table} {alias}{hint} JOIN audit_calls c ON c.seq = {alias}.call_seq"
    conds, all_args = [cond] + where, dargs + args
    for other, ocond, oargs in drivers[1:]:
        conds.append(f"EXISTS (SELECT 1 FROM {_TABLES_BY_ALIAS[other][0]} {other} "
                     f"WHERE {other}.call_seq = c.seq AND {ocond})")
        all_args += oargs
    sql += " WHERE " + " AND ".join(conds) + f" GROUP BY {alias}.call_seq ORDER BY {alias}.call_seq DESC LIMIT ?"
    return sql, all_args + [size + 1]


def check_query(q: CallQuery) -> None:
    """Raises BadFilter for a filter that build_query (and so query_calls) would refuse."""
    build_query(q)


def driver_rows(db, q: CallQuery, cap: int = DENSE_ROWS) -> int:
    """How many rows the driving filter matches, counted up to `cap` (cheap either way)."""
    drivers = _drivers(q)
    if not drivers:
        return 0
    alias, cond, dargs = drivers[0]
    table = _TABLES_BY_ALIAS[alias][0]
    rows = db.query(f"SELECT COUNT(*) AS n FROM (SELECT 1 FROM {table} {alias} WHERE {cond} LIMIT {int(cap)})",
                    tuple(dargs))
    return rows[0]["n"]


def query_calls(db, q: CallQuery) -> tuple[list[dict[str, Any]], str]:
    """One page of calls and the token of the next page ("" at the end)."""
    sql, args = build_query(q, walk=driver_rows(db, q) >= DENSE_ROWS)
    rows = db.query(sql, tuple(args))
    size = q.page_size or 50
    page, more = rows[:size], len(rows) > size
    if page:
        marks = ",".join("?" * len(page))
        hosts: dict[str, list[str]] = {}
        seqs = tuple(r["seq"] for r in page)
        for r in db.query(f"SELECT DISTINCT tool_call_id, host FROM audit_network WHERE call_seq IN ({marks})"
                          f" AND decision = 'allowed' ORDER BY host", seqs):
            hosts.setdefault(r["tool_call_id"], []).append(r["host"])
        for r in page:
            r["domains"] = hosts.get(r["tool_call_id"], [])
    return page, encode_token(page[-1]["seq"]) if more else ""
