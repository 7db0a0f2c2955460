"""The forensic index keeps who proposed each call and in which session (the request's
proposedBy and sessionId, from its ToolCallRequested), answers exact filters on them
through their own indexes, refuses a filter no call could match (too long, a NUL byte)
naming it, and an index an older daemon built without them is rebuilt from the log.
Real SQLite, events appended through EventLog as the daemon appends them; no Docker."""

from __future__ import annotations

from typing import Any

import pytest

from sandboxd.api.messages import call_summary
from sandboxd.ledger import audit
from sandboxd.ledger import events as ev
from sandboxd.ledger.events import EventDraft, EventLog
from sandboxd.ledger.store import Database
from sandboxd.policy.models import PreparedToolCall
from sandboxd_client.cli_parser import build_parser

from .test_audit_index import accept, call_row, clock, ids, rejected, requested, run_call  # noqa: F401 - clock: fixture

CLAUDE, CURSOR = "mcp:claude-code/2.1.3", "mcp:cursor/1.0"


@pytest.fixture
def db(tmp_path):
    d = Database(tmp_path / "db.sqlite")
    audit.ensure_schema(d)
    yield d
    d.close()


@pytest.fixture
def log(db, clock) -> EventLog:
    return EventLog(db, on_append=audit.index_events)


def proposed(proposed_by: str | None, session_id: str | None, **req: Any) -> EventDraft:
    """A ToolCallRequested whose request names its proposer and session (omitted: None)."""
    d = requested(**req)
    extra = {k: v for k, v in (("proposedBy", proposed_by), ("sessionId", session_id)) if v is not None}
    return EventDraft(d.type, {**extra, **d.payload})


def run_proposed(log: EventLog, tcid: str, proposed_by: str | None, session_id: str | None, **req: Any) -> None:
    log.record(tcid, "", [proposed(proposed_by, session_id, **req)])


@pytest.fixture
def agents(log) -> EventLog:
    """Four calls: two agents, two sessions of one of them, and one that named nobody."""
    run_proposed(log, "c-claude-1", CLAUDE, "mcp-session:a")
    run_proposed(log, "c-cursor", CURSOR, "mcp-session:b", principal="bob")
    run_proposed(log, "c-claude-2", CLAUDE, "mcp-session:c")
    run_call(log, "c-nobody")
    return log


# ------------------------------------------------------------------ projection


def test_the_request_s_proposer_and_session_are_indexed(db, agents):
    row = call_row(db, "c-cursor")
    assert (row["proposed_by"], row["session_id"], row["principal"]) == (CURSOR, "mcp-session:b", "bob")
    assert (call_row(db, "c-nobody")["proposed_by"], call_row(db, "c-nobody")["session_id"]) == ("", "")


def test_a_refused_request_keeps_its_proposer_and_a_malformed_one_none(db, log):
    log.record("r-named", "", [proposed(CLAUDE, "s-1"), rejected()])
    log.record("r-bad", "", [EventDraft(ev.REQUESTED, {"argv": ["x"], "principal": "x", "proposedBy": ["not", "text"],
                                                        "sessionId": 7}), rejected("INVALID_ARGUMENT", "validation")])
    row = call_row(db, "r-named")
    assert (row["status"], row["proposed_by"], row["session_id"]) == ("rejected", CLAUDE, "s-1")
    row = call_row(db, "r-bad")
    assert (row["status"], row["proposed_by"], row["session_id"]) == ("rejected", "", "")


def test_the_summary_carries_them(db, agents):
    rows, _ = audit.query_calls(db, audit.CallQuery(proposed_by=CURSOR))
    summary = call_summary(rows[0])
    assert (summary.proposed_by, summary.session_id, summary.tool_call_id) == (CURSOR, "mcp-session:b", "c-cursor")


# ------------------------------------------------------------------ queries


def test_proposed_by_is_an_exact_filter(db, agents):
    assert ids(db, proposed_by=CURSOR) == ["c-cursor"]
    assert ids(db, proposed_by=CLAUDE) == ["c-claude-2", "c-claude-1"]
    # Exact: neither a prefix, nor a LIKE pattern, nor another case.
    for near in ("mcp:claude-code", "mcp:claude-code/2.1.%", "MCP:CURSOR/1.0", "mcp:cursor/1.0 "):
        assert ids(db, proposed_by=near) == []


def test_session_id_is_an_exact_filter(db, agents):
    assert ids(db, session_id="mcp-session:c") == ["c-claude-2"]
    assert ids(db, session_id="mcp-session:") == []


def test_the_new_filters_combine_with_the_others(db, agents):
    assert ids(db, proposed_by=CLAUDE, session_id="mcp-session:a") == ["c-claude-1"]
    assert ids(db, proposed_by=CLAUDE, session_id="mcp-session:b") == []
    assert ids(db, proposed_by=CURSOR, principal="bob") == ["c-cursor"]
    assert ids(db, proposed_by=CURSOR, principal="alice") == []
    # Empty means no filter.
    assert ids(db, proposed_by="", session_id="") == ["c-nobody", "c-claude-2", "c-cursor", "c-claude-1"]


def test_paging_under_the_proposer_filter(db, log):
    for i in range(7):
        run_proposed(log, f"p-{i}", CLAUDE if i % 2 else CURSOR, f"s-{i}")
    first, token = audit.query_calls(db, audit.CallQuery(proposed_by=CLAUDE, page_size=2))
    assert [r["tool_call_id"] for r in first] == ["p-5", "p-3"] and token
    assert ids(db, proposed_by=CLAUDE, page_size=2) == ["p-5", "p-3", "p-1"]


@pytest.mark.parametrize(("field", "index"), [("proposed_by", "audit_calls_by_proposer"),
                                              ("session_id", "audit_calls_by_session")])
def test_each_filter_is_answered_from_its_own_index(db, agents, field, index):
    sql, args = audit.build_query(audit.CallQuery(**{field: "x"}))
    plan = " ".join(str(r["detail"]) for r in db.query("EXPLAIN QUERY PLAN " + sql, tuple(args)))
    assert index in plan, plan


# ------------------------------------------------------------------ bad filters


def test_the_cap_is_the_calls_own():
    for name in ("proposed_by", "session_id"):
        caps = [m.max_length for m in PreparedToolCall.model_fields[name].metadata if hasattr(m, "max_length")]
        assert caps == [audit.MAX_CALL_NAME_CHARS]


@pytest.mark.parametrize(("field", "wire"), [("proposed_by", "proposedBy"), ("session_id", "sessionId")])
def test_a_filter_at_the_cap_is_answered_and_one_past_it_refused(db, log, field, wire):
    at_cap = "a" * audit.MAX_CALL_NAME_CHARS
    run_proposed(log, "long", at_cap, at_cap)
    assert ids(db, **{field: at_cap}) == ["long"]
    with pytest.raises(audit.BadFilter) as exc:
        audit.check_query(audit.CallQuery(**{field: at_cap + "a"}))
    assert exc.value.field == wire and "257 characters exceed the maximum of 256" in exc.value.reason


@pytest.mark.parametrize(("field", "wire"), [("proposed_by", "proposedBy"), ("session_id", "sessionId")])
def test_a_nul_byte_is_refused_naming_the_filter(db, field, wire):
    with pytest.raises(audit.BadFilter) as exc:
        audit.query_calls(db, audit.CallQuery(**{field: "mcp:x\x00y"}))
    assert (exc.value.field, exc.value.reason) == (wire, "contains a NUL byte")


# ------------------------------------------------------------------ an index from an older daemon

# What a daemon of index version 6 made of audit_calls (without proposed_by, session_id).
V6_AUDIT_CALLS = """
CREATE TABLE audit_calls (
    seq INTEGER PRIMARY KEY, tool_call_id TEXT NOT NULL UNIQUE, principal TEXT NOT NULL,
    workspace TEXT NOT NULL, command TEXT NOT NULL, tool_id TEXT NOT NULL,
    backend TEXT NOT NULL DEFAULT '', image TEXT NOT NULL DEFAULT '', status TEXT NOT NULL,
    exit_code INTEGER, error_code TEXT NOT NULL DEFAULT '', requested_at TEXT NOT NULL,
    finished_at TEXT NOT NULL DEFAULT '');
CREATE INDEX audit_calls_by_principal ON audit_calls (principal, seq);
CREATE TABLE audit_meta (id INTEGER PRIMARY KEY CHECK (id = 1), indexed_seq INTEGER NOT NULL);
CREATE TABLE audit_schema (version INTEGER NOT NULL);
INSERT INTO audit_schema VALUES (6);
"""


def test_an_index_built_before_proposers_were_kept_is_rebuilt_and_answers(tmp_path, clock):
    """The daemon's layout (log and index in files of their own): an index at version 6,
    complete up to the log's head but without the new columns, is dropped when the
    daemon opens it and rebuilt from the log, which held proposedBy all along."""
    log_db = Database(tmp_path / "sandboxd.db")
    log = EventLog(log_db)
    run_proposed(log, "old-claude", CLAUDE, "s-1")
    run_proposed(log, "old-cursor", CURSOR, "s-2")
    head = log.range()[-1]
    old = Database(tmp_path / "audit.db", schema="", durable=False)
    old.ensure_schema(V6_AUDIT_CALLS + f"INSERT INTO audit_meta VALUES (1, {head.seq});")
    with old.transaction() as conn:  # the old projection's row for each call
        for e in log.range():
            conn.execute("INSERT INTO audit_calls (seq, tool_call_id, principal, workspace, command, tool_id, status,"
                         " requested_at) VALUES (?,?,?,?,?,?,?,?)",
                         (e.seq, e.tool_call_id, "alice", "/w", "pytest -q", "unit.tool", "running", e.time))
    old.close()

    index = audit.AuditIndex(log_db, audit.open_index_db(tmp_path / "audit.db"))
    try:
        assert index.db.query("SELECT version FROM audit_schema") == [{"version": audit.SCHEMA_VERSION}]
        assert index.db.query("SELECT COUNT(*) AS n FROM audit_calls") == [{"n": 0}]  # dropped, not patched
        assert index.sync() == len(log.range())
        rows, _ = audit.query_calls(index.db, audit.CallQuery(proposed_by=CURSOR))
        assert [(r["tool_call_id"], r["session_id"]) for r in rows] == [("old-cursor", "s-2")]
        assert ids(index.db, session_id="s-1") == ["old-claude"]
        # The next start keeps the rebuilt index.
        index.db.close()
        index = audit.AuditIndex(log_db, audit.open_index_db(tmp_path / "audit.db"))
        assert index.sync() == 0 and ids(index.db, proposed_by=CLAUDE) == ["old-claude"]
    finally:
        index.db.close()
        log_db.close()


# ------------------------------------------------------------------ sandboxctl audit


def test_sandboxctl_audit_takes_the_new_filters():
    args = build_parser().parse_args(["audit", "--proposed-by", CLAUDE, "--session", "mcp-session:a"])
    assert (args.proposed_by, args.session) == (CLAUDE, "mcp-session:a")
    args = build_parser().parse_args(["audit"])
    assert (args.proposed_by, args.session) == (None, None)
