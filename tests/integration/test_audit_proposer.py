"""Who proposed each call, in the forensic index of a real daemon: calls carrying
different proposedBy and sessionId are told apart by AuditService.QueryCalls and by
`sandboxctl audit --proposed-by/--session`, a filter no call could match is refused
naming it, and an index an older daemon built without them is rebuilt at start."""

from __future__ import annotations

import json
import sqlite3

import pytest

from sandboxd.ledger.audit import SCHEMA_VERSION
from sandboxd_client import errors

from .conftest import call, sh
from .test_cli import ctl

CLAUDE, CURSOR = "mcp:claude-code/2.1.3", "mcp:cursor/1.0"


@pytest.fixture
def audited(spare_daemon):
    return spare_daemon().start()


def proposed_call(ws, script: str, proposed_by: str, session_id: str) -> dict:
    return call(ws, sh(script), proposedBy=proposed_by, sessionId=session_id)


def test_calls_are_found_by_who_proposed_them_and_their_session(audited):
    d = audited
    ws = d.new_workspace()
    with d.client() as c:
        by_claude = c.run(proposed_call(ws, "echo from-claude", CLAUDE, "mcp-session:one"))
        by_cursor = c.run(proposed_call(ws, "echo from-cursor", CURSOR, "mcp-session:two"))
        unnamed = c.run(call(ws, sh("echo from-nobody")))

        found = c.query_calls(proposed_by=CLAUDE).calls
        assert [x.tool_call_id for x in found] == [by_claude.tool_call_id]
        row = found[0]
        assert (row.proposed_by, row.session_id, row.command) == (
            CLAUDE, "mcp-session:one", "/bin/sh -c 'echo from-claude'")
        assert [x.tool_call_id for x in c.query_calls(session_id="mcp-session:two").calls] == [by_cursor.tool_call_id]
        assert not c.query_calls(proposed_by=CLAUDE, session_id="mcp-session:two").calls
        assert not c.query_calls(proposed_by="mcp:claude-code").calls  # exact, not a prefix
        everyone = {x.tool_call_id: (x.proposed_by, x.session_id) for x in c.query_calls().calls}
        assert everyone == {by_claude.tool_call_id: (CLAUDE, "mcp-session:one"),
                            by_cursor.tool_call_id: (CURSOR, "mcp-session:two"), unnamed.tool_call_id: ("", "")}


def test_sandboxctl_audit_filters_by_and_shows_the_proposer(audited):
    d = audited
    ws = d.new_workspace()
    with d.client() as c:
        mine = c.run(proposed_call(ws, "echo cli-proposer", CURSOR, "mcp-session:cli"))
        c.run(proposed_call(ws, "echo cli-proposer", CLAUDE, "mcp-session:other"))
    table = ctl(d, "audit", "--proposed-by", CURSOR)
    assert table.returncode == 0, table.stderr
    header, line = table.stdout.decode().splitlines()
    assert header.split() == ["REQUESTED", "CALL", "PRINCIPAL", "PROPOSER", "STATUS", "EXIT", "DOMAINS", "COMMAND"]
    assert line.split()[2:6] == [mine.tool_call_id, "root", CURSOR, "success"]
    rows = [json.loads(x) for x in ctl(d, "audit", "--json", "--session", "mcp-session:cli").stdout.splitlines()]
    assert [(r["toolCallId"], r["proposedBy"], r["sessionId"]) for r in rows] == [
        (mine.tool_call_id, CURSOR, "mcp-session:cli")]


@pytest.mark.parametrize(("field", "wire"), [("proposed_by", "proposedBy"), ("session_id", "sessionId")])
def test_a_filter_no_call_could_match_is_refused_naming_it(audited, field, wire):
    d = audited
    with d.client() as c:
        assert not c.query_calls(**{field: "x" * 256}).calls  # the call's own limit: answered
        for bad, reason in (("x" * 257, "257 characters exceed the maximum of 256"), ("mcp:a\x00b", "NUL")):
            with pytest.raises(errors.InvalidArgument) as exc:
                c.query_calls(**{field: bad})
            assert exc.value.message.startswith(f"{wire}: ") and reason in exc.value.message
    flag = "--proposed-by" if field == "proposed_by" else "--session"
    refused = ctl(d, "audit", flag, "x" * 257)
    assert refused.returncode == 1 and f"INVALID_ARGUMENT: {wire}: ".encode() in refused.stderr


def test_an_index_built_before_proposers_were_kept_is_rebuilt_at_start(audited):
    """The index is a view of the log: an older daemon's index (version 6, no proposer
    columns, complete up to the log's head) is dropped at start and rebuilt from the
    log's ToolCallRequested events, which always held proposedBy and sessionId."""
    d = audited
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(proposed_call(ws, "echo before-the-upgrade", CLAUDE, "mcp-session:old"))
    d.stop()
    db = sqlite3.connect(d.state_dir / "audit.db")
    db.executescript("DROP INDEX audit_calls_by_proposer; DROP INDEX audit_calls_by_session;"
                     "ALTER TABLE audit_calls DROP COLUMN proposed_by; ALTER TABLE audit_calls DROP COLUMN session_id;"
                     "UPDATE audit_schema SET version = 6;")
    assert db.execute("SELECT COUNT(*) FROM audit_calls").fetchone() == (1,)
    db.close()
    d.start()
    with d.client() as c:
        rows = c.query_calls(proposed_by=CLAUDE).calls
        assert [(x.tool_call_id, x.session_id, x.status) for x in rows] == [
            (done.tool_call_id, "mcp-session:old", "success")]
    db = sqlite3.connect(d.state_dir / "audit.db")
    assert db.execute("SELECT version FROM audit_schema").fetchall() == [(SCHEMA_VERSION,)]
    db.close()
