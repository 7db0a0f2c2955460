"""The rows a lease keeps beside its events: who holds it, in call_owners under the
lease id (its events are logged under that id as a call's are under its own)."""

from __future__ import annotations

import sqlite3


def insert_lease_owner(conn: sqlite3.Connection, lease_id: str, principal: str) -> None:
    """Records `principal` as the holder of `lease_id` (the first holder stays)."""
    conn.execute("INSERT OR IGNORE INTO call_owners (tool_call_id, principal) VALUES (?,?)", (lease_id, principal))
