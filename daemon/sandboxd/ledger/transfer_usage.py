"""What each principal's transfer records name: a FilesTransferred event lists every
file and directory moved (an upload of 9,000 empty files costs the ledger and its index
~17 MB), so their number is counted per principal, in the same transaction as the
record, and held against quotas.transfer_entries at the next transfer. Retention's
tombstone takes a transfer out of the count as it takes it out of the index."""

from __future__ import annotations

import sqlite3

from sandboxd.ledger import events as ev
from sandboxd.ledger.store import Database


def count_existing(db: Database) -> None:
    """At start: the records an older daemon wrote, counted once (the table was empty),
    unless retention has expired them."""
    if db.query("SELECT 1 FROM transfer_usage LIMIT 1"):
        return
    with db.transaction() as conn:
        conn.execute(
            "INSERT OR IGNORE INTO transfer_usage (tool_call_id, principal, entries)"
            " SELECT e.tool_call_id, json_extract(e.payload_json, '$.principal'),"
            " COALESCE(json_array_length(e.payload_json, '$.entries'), 0) FROM events e"
            " WHERE e.type = ? AND NOT EXISTS (SELECT 1 FROM events x WHERE x.tool_call_id = e.tool_call_id"
            " AND x.type = ?)", (ev.FILES_TRANSFERRED, ev.EXPIRED))


def add(conn: sqlite3.Connection, transfer_id: str, principal: str, entries: int) -> None:
    conn.execute("INSERT OR REPLACE INTO transfer_usage (tool_call_id, principal, entries) VALUES (?, ?, ?)",
                 (transfer_id, principal, entries))


def remove_call(conn: sqlite3.Connection, tool_call_id: str) -> None:
    """Retention expired it (a call's id is in no row: nothing happens)."""
    conn.execute("DELETE FROM transfer_usage WHERE tool_call_id = ?", (tool_call_id,))


def recorded_entries(db: Database, principal: str) -> int:
    rows = db.query("SELECT COALESCE(SUM(entries), 0) AS n FROM transfer_usage WHERE principal = ?", (principal,))
    return int(rows[0]["n"])
