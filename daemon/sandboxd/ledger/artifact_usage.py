"""What each principal's artifacts hold in the store, in bytes: the sum of its calls'
artifact sizes (a blob two artifacts share counts twice), kept in the same transaction
as the artifact rows it counts, so that a quota can be checked at admission without a
scan (quotas.artifact_mb)."""

from __future__ import annotations

import sqlite3

from sandboxd.ledger.store import Database

def count_existing(db: Database) -> None:
    """At start: a store an older daemon wrote has artifacts but no counts yet; they are
    counted once (the table is in store.SCHEMA; empty, it has never counted)."""
    if db.query("SELECT 1 FROM artifact_usage LIMIT 1"):
        return
    with db.transaction() as conn:
        conn.execute("INSERT OR REPLACE INTO artifact_usage (principal, bytes)"
                     " SELECT o.principal, SUM(a.size_bytes) FROM artifacts a"
                     " JOIN call_owners o ON o.tool_call_id = a.tool_call_id GROUP BY o.principal")


def add(conn: sqlite3.Connection, tool_call_id: str, size_bytes: int) -> None:
    """An artifact of the call was stored: counted to the call's owner."""
    conn.execute("INSERT INTO artifact_usage (principal, bytes)"
                 " SELECT principal, ? FROM call_owners WHERE tool_call_id = ?"
                 " ON CONFLICT (principal) DO UPDATE SET bytes = bytes + excluded.bytes",
                 (size_bytes, tool_call_id))


def remove_call(conn: sqlite3.Connection, tool_call_id: str) -> None:
    """The call's artifacts are about to be removed (retention): no longer counted."""
    conn.execute("UPDATE artifact_usage SET bytes = MAX(0, bytes - (SELECT COALESCE(SUM(size_bytes), 0)"
                 " FROM artifacts WHERE tool_call_id = ?))"
                 " WHERE principal = (SELECT principal FROM call_owners WHERE tool_call_id = ?)",
                 (tool_call_id, tool_call_id))


def stored_bytes(db: Database, principal: str) -> int:
    rows = db.query("SELECT bytes FROM artifact_usage WHERE principal = ?", (principal,))
    return int(rows[0]["bytes"]) if rows else 0
