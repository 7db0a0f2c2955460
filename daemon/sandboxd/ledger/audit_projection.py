"""How each event lands in the forensic index's tables (audit.SCHEMA): the projection
that AuditIndex runs over the log. Payloads are read through their types (event_types);
indexing the same event again changes nothing, so a replay of the log rebuilds the index."""

from __future__ import annotations

import shlex
import sqlite3
from collections.abc import Iterable, Sequence

from sandboxd.ledger import events as ev
from sandboxd.ledger.event_types import (FileAccessObserved, FilesTransferred, NetworkAccessObserved, ToolCallExpired,
                                         ToolCallRejected, ToolCallRequested, ToolPolicyChecked,
                                         ToolResultValidated, read_payload)

# The types the index projects (the others it never reads: no payload parsed for them).
INDEXED_TYPES = frozenset({ev.REQUESTED, ev.POLICY_CHECKED, ev.REJECTED, ev.RESULT_VALIDATED, ev.NETWORK_ACCESS,
                           ev.EXPIRED, ev.FILE_ACCESS, ev.FILES_TRANSFERRED})
# A transfer's row: its tool id, and its status as a call's would read.
TRANSFER_TOOL_IDS = {"upload": "sandboxd.upload", "download": "sandboxd.download"}
TRANSFER_STATUS = {"ok": "success", "refused": "rejected"}


def command_text(argv: Sequence[str]) -> str:
    return shlex.join(argv)


def request_text(requested: ToolCallRequested, key: str) -> str:
    """A string field of the request as sent (proposedBy, sessionId); "" when absent or,
    in a refused request, not a string."""
    value = requested.request.get(key, "")
    return value if isinstance(value, str) else ""


def index_event(conn: sqlite3.Connection, e: ev.Event) -> None:
    """Projects one event into the index; indexing the same event again changes nothing."""
    if e.type not in INDEXED_TYPES:
        return
    match read_payload(e.type, e.payload):
        case ToolCallRequested() as requested:
            argv = requested.argv
            conn.execute(
                "INSERT OR IGNORE INTO audit_calls (seq, tool_call_id, principal, workspace, command, tool_id,"
                " status, requested_at, proposed_by, session_id) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (e.seq, e.tool_call_id, str(requested.principal), requested.workspace,
                 command_text(argv) if argv is not None else "", requested.tool_id, "running", e.time,
                 request_text(requested, "proposedBy"), request_text(requested, "sessionId")))
        case ToolPolicyChecked() as checked:
            conn.execute("UPDATE audit_calls SET backend = ?, image = ? WHERE tool_call_id = ?",
                         (str(checked.backend), str(checked.image), e.tool_call_id))
        case ToolCallRejected() as rejected:
            # Only a call refused before it was accepted: a refused retry that reused an
            # accepted call's id must not rewrite that call's row.
            conn.execute("UPDATE audit_calls SET status = 'rejected', error_code = ?, finished_at = ?"
                         " WHERE tool_call_id = ? AND status = 'running' AND backend = ''",
                         (str(rejected.code), e.time, e.tool_call_id))
        case ToolResultValidated() as validated:
            conn.execute("UPDATE audit_calls SET status = ?, exit_code = ?, error_code = ?, finished_at = ?"
                         " WHERE tool_call_id = ?",
                         (validated.status, validated.exit_code, validated.error_code, e.time, e.tool_call_id))
        case NetworkAccessObserved() as network:
            _index_network(conn, e, network)
        case ToolCallExpired():
            _index_expired(conn, e)
        case FileAccessObserved() as files:
            _index_file_access(conn, e, files)
        case FilesTransferred() as transfer:
            _index_transfer(conn, e, transfer)


def _index_network(conn: sqlite3.Connection, e: ev.Event, network: NetworkAccessObserved) -> None:
    # One attempt, or the destinations counted past the record's size.
    attempts = list(network.destinations())
    call_seq = _call_seq(conn, e.tool_call_id) if attempts else None
    if call_seq is not None:
        conn.executemany(
            "INSERT OR IGNORE INTO audit_network (event_seq, call_seq, tool_call_id, host, rhost, port, decision)"
            " VALUES (?,?,?,?,?,?,?)",
            [(e.seq, call_seq, e.tool_call_id, str(host), str(host)[::-1], int(port), str(decision))
             for host, port, decision in attempts])


def _index_expired(conn: sqlite3.Connection, e: ev.Event) -> None:
    # Retention: the call leaves the index (its events and this tombstone stay).
    call_seq = _call_seq(conn, e.tool_call_id)
    if call_seq is not None:
        for table in ("audit_paths", "audit_network"):
            conn.execute(f"DELETE FROM {table} WHERE call_seq = ?", (call_seq,))
        conn.execute("DELETE FROM audit_calls WHERE seq = ?", (call_seq,))


def _index_file_access(conn: sqlite3.Connection, e: ev.Event, files: FileAccessObserved) -> None:
    rows = []
    for a in files.entries():  # every form a daemon has written
        rows.append((str(a["path"]), str(a.get("operation", ""))))
        if a.get("renamedTo"):
            rows.append((str(a["renamedTo"]), "rename"))
    call_seq = _call_seq(conn, e.tool_call_id) if rows else None
    if call_seq is not None:
        conn.executemany("INSERT OR IGNORE INTO audit_paths (path, op, call_seq) VALUES (?,?,?)",
                         [(path, op, call_seq) for path, op in rows])


def _index_transfer(conn: sqlite3.Connection, e: ev.Event, transfer: FilesTransferred) -> None:
    """A transfer is found as a call is: by principal, workspace, status, and each path
    it moved (op "upload" or "download")."""
    conn.execute(
        "INSERT OR IGNORE INTO audit_calls (seq, tool_call_id, principal, workspace, command, tool_id, backend,"
        " status, error_code, requested_at, finished_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (e.seq, e.tool_call_id, str(transfer.principal), str(transfer.workspace), "",
         TRANSFER_TOOL_IDS.get(str(transfer.direction), "sandboxd.transfer"), "",
         TRANSFER_STATUS.get(str(transfer.status), "error"), str(transfer.code), e.time, e.time))
    paths = {str(transfer.path)} | {str(entry.get("path", "")) for entry in transfer.entries} - {""}
    op = str(transfer.direction)
    conn.executemany("INSERT OR IGNORE INTO audit_paths (path, op, call_seq) VALUES (?,?,?)",
                     [(path, op, e.seq) for path in sorted(paths)])


def _call_seq(conn: sqlite3.Connection, tool_call_id: str) -> int | None:
    row = conn.execute("SELECT seq FROM audit_calls WHERE tool_call_id = ?", (tool_call_id,)).fetchone()
    return row[0] if row else None


def index_events(conn: sqlite3.Connection, events: Iterable[ev.Event]) -> None:
    """Indexes appended events. The indexed position only moves when everything before
    them is indexed too; otherwise catch_up fills the gap later (and indexing an event
    twice changes nothing)."""
    events = list(events)
    for e in events:
        index_event(conn, e)
    if not events:
        return
    row = conn.execute("SELECT indexed_seq FROM audit_meta WHERE id = 1").fetchone()
    indexed = row[0] if row else 0
    if indexed >= events[0].seq - 1 and events[-1].seq > indexed:
        conn.execute("INSERT INTO audit_meta (id, indexed_seq) VALUES (1, ?) "
                     "ON CONFLICT (id) DO UPDATE SET indexed_seq = excluded.indexed_seq", (events[-1].seq,))
