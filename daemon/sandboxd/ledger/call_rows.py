"""The rows a call keeps beside its events: who owns it (call_owners), which grant it
used (used_grants), which idempotency key named it (idempotency_keys), and the log
lookups the call's life needs (its last event, the calls or leases left open by a
daemon that stopped). Every statement the calls package runs is here."""

from __future__ import annotations

import sqlite3

from sandboxd.ledger import events as ev
from sandboxd.ledger.store import Database


def insert_owner(conn: sqlite3.Connection, tool_call_id: str, principal: str) -> None:
    conn.execute("INSERT INTO call_owners (tool_call_id, principal) VALUES (?,?)", (tool_call_id, principal))


def insert_owner_if_new(conn: sqlite3.Connection, tool_call_id: str, principal: str) -> None:
    """A refusal's owner (its id may already be on record: then the first owner stays)."""
    conn.execute("INSERT OR IGNORE INTO call_owners (tool_call_id, principal) VALUES (?,?)",
                 (tool_call_id, principal))


def owner_of(db: Database, tool_call_id: str) -> str | None:
    rows = db.query("SELECT principal FROM call_owners WHERE tool_call_id = ?", (tool_call_id,))
    return rows[0]["principal"] if rows else None


def insert_used_grant(conn: sqlite3.Connection, grant_id: str, tool_call_id: str) -> None:
    conn.execute("INSERT INTO used_grants (grant_id, tool_call_id) VALUES (?,?)", (grant_id, tool_call_id))


def grant_holder(db: Database, grant_id: str) -> str | None:
    """The call that used `grant_id`, if one did."""
    rows = db.query("SELECT tool_call_id FROM used_grants WHERE grant_id = ?", (grant_id,))
    return rows[0]["tool_call_id"] if rows else None


def insert_idempotency_key(conn: sqlite3.Connection, key: str, request_digest: str, tool_call_id: str) -> None:
    conn.execute("INSERT INTO idempotency_keys (idempotency_key, request_digest, tool_call_id) VALUES (?,?,?)",
                 (key, request_digest, tool_call_id))


def idempotency_key_row(db: Database, key: str) -> tuple[str, str] | None:
    """(the request digest, the first call's id) a key was accepted with, if it was."""
    rows = db.query("SELECT request_digest, tool_call_id FROM idempotency_keys WHERE idempotency_key = ?", (key,))
    return (rows[0]["request_digest"], rows[0]["tool_call_id"]) if rows else None


def last_event_id(conn: sqlite3.Connection, tool_call_id: str) -> str:
    """The call's last event as of this transaction (the parent of what it appends)."""
    row = conn.execute("SELECT event_id FROM events WHERE tool_call_id = ? ORDER BY seq DESC LIMIT 1",
                       (tool_call_id,)).fetchone()
    return str(row[0])


def unfinished_calls(db: Database) -> list[str]:
    """Calls accepted (ToolPolicyChecked) with no recorded result."""
    rows = db.query(
        "SELECT DISTINCT tool_call_id FROM events e WHERE type = ? AND NOT EXISTS ("
        " SELECT 1 FROM events f WHERE f.tool_call_id = e.tool_call_id AND f.type = ?)",
        (ev.POLICY_CHECKED, ev.RESULT_VALIDATED))
    return [row["tool_call_id"] for row in rows]


def open_leases(db: Database) -> list[str]:
    """Leases granted with neither an end nor an expiry on record."""
    rows = db.query(
        "SELECT DISTINCT tool_call_id FROM events e WHERE type = ? AND NOT EXISTS ("
        " SELECT 1 FROM events f WHERE f.tool_call_id = e.tool_call_id AND f.type IN (?, ?))",
        (ev.SANDBOX_LEASED, ev.SANDBOX_LEASE_ENDED, ev.EXPIRED))
    return [row["tool_call_id"] for row in rows]
