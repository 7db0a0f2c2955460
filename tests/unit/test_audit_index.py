"""sandboxd.ledger.audit: the forensic index, projected from the event log into a real SQLite
database (no Docker, no network). Events are appended through EventLog with the index
hooked in as on_append, exactly as main.build_daemon wires it, with payloads shaped like
the ones executor.py records (built through their types, sandboxd.ledger.event_types; a
few malformed ones, as an edited or old log may hold, stay literal)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from sandboxd.ledger import audit
from sandboxd.ledger.audit_projection import index_event
from sandboxd.ledger import store
from sandboxd.ledger import events as ev
from sandboxd.ledger.event_types import (CheckedAuthorization, ConnectionAttempt, CountedAttempts,
                                         FileAccessObserved, NetworkAccessObserved, ToolArgsValidated,
                                         ToolCallFinished, ToolCallRejected, ToolCallReplayed, ToolCallRequested,
                                         ToolCallStarted, ToolPolicyChecked, ToolResultValidated,
                                         ToolSandboxPrepared, draft)
from sandboxd.ledger.events import EventDraft, EventLog
from sandboxd.ledger.store import Database

WS_ALICE = "/srv/sandboxd/workspaces/alice"
WS_BOB = "/srv/sandboxd/workspaces/bob"
T0 = datetime(2024, 5, 1, 10, 0, 0, tzinfo=timezone.utc)


# ------------------------------------------------------------------ fixtures


def iso(t: datetime) -> str:
    """The spelling ev.utc_now() uses."""
    return t.isoformat(timespec="microseconds").replace("+00:00", "Z")


class Clock:
    """Replaces ev.utc_now: every event gets a distinct, predictable time (1 ms apart)."""

    def __init__(self) -> None:
        self.t = T0

    def set(self, t: datetime) -> None:
        self.t = t

    def __call__(self) -> str:
        now = self.t
        self.t += timedelta(milliseconds=1)
        return iso(now)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(ev, "utc_now", c)
    return c


@pytest.fixture
def db(tmp_path):
    d = Database(tmp_path / "db.sqlite")
    audit.ensure_schema(d)
    yield d
    d.close()


@pytest.fixture
def log(db, clock) -> EventLog:
    return EventLog(db, on_append=audit.index_events)


# ------------------------------------------------------------------ payloads (as executor.py records them)


def requested(*, principal: str = "alice", workspace: str = WS_ALICE, argv: Any = ("pytest", "-q"),
              tool_id: str = "unit.tool", record_command: bool = True) -> EventDraft:
    summary: dict[str, Any] = {
        "toolId": tool_id, "argv": list(argv) if isinstance(argv, tuple) else argv, "workspace": workspace,
        "authorization": {"status": "not_required"}, "stdinBytes": 0,
        "stdinSha256": "sha256:" + hashlib.sha256(b"").hexdigest(),
    }
    argv_sha256 = None
    if not record_command:
        summary["policy"] = {"audit": {"recordCommand": False}}
        argv_sha256 = "sha256:" + hashlib.sha256(json.dumps(summary["argv"]).encode()).hexdigest()
    return draft(ToolCallRequested.of_request(summary, principal=principal, daemon_id="sbxd_unit",
                                              argv_sha256=argv_sha256))


def args_validated() -> EventDraft:
    return draft(ToolArgsValidated({"timeoutMs": 30000}, "sha256:00"))


def policy_checked(backend: str = "docker", image: str = "python:3.12-slim", workspace: str = WS_ALICE) -> EventDraft:
    return draft(ToolPolicyChecked(backend, image, "sbx-unit", CheckedAuthorization(status="not_required"),
                                   "sha256:" + "ab" * 32, 1000, 1001, workspace, binds=[["/workspace", "rw"]]))


def rejected(code: str = "PERMISSION_DENIED", stage: str = "verification") -> EventDraft:
    return draft(ToolCallRejected(stage, code, "runtime.image", "refused"))


def network(host: str, port: int = 443, decision: str = "allowed") -> EventDraft:
    return draft(NetworkAccessObserved(attempt=ConnectionAttempt(
        "connect", "CONNECT", host, port, "192.0.2.10", decision,
        "allowDomains" if decision == "allowed" else "not-allowed", "", "", 200 if decision == "allowed" else 403,
        10, 20, "2024-05-01T10:00:00.000000Z", "2024-05-01T10:00:00.100000Z")))


def network_dropped(n: int = 7) -> EventDraft:
    """As a daemon before destinations were counted wrote it (no byDestination)."""
    return draft(NetworkAccessObserved(counted=CountedAttempts(
        n, "more than 1000 connections: the rest were counted, not recorded")))


def file_access(path: str, operation: str, renamed_to: str = "") -> EventDraft:
    """One access, as the daemon records it: a plain read as a pair, anything else as an entry."""
    if operation == "read":
        return draft(FileAccessObserved(reads=[[path, 1]]))
    entry: dict[str, Any] = {"path": path, "operation": operation}
    if renamed_to:
        entry["renamedTo"] = renamed_to
    return draft(FileAccessObserved(accesses=[entry]))


def result(tool_call_id: str, status: str = "success", exit_code: int = 0, code: str = "") -> EventDraft:
    res: dict[str, Any] = {"toolCallId": tool_call_id, "status": status, "exitCode": exit_code, "signal": "",
                           "timedOut": code == "TIMEOUT", "oomKilled": False, "artifacts": [],
                           "effectsObserved": {"reads": [], "writes": [], "deletes": [], "externalCalls": []}}
    if code:
        res["error"] = {"code": code, "message": "m", "retryable": False, "safeToShowUser": True}
    return draft(ToolResultValidated(res))


def finished(exit_code: int = 0) -> EventDraft:
    return draft(ToolCallFinished(exit_code, signal="", timed_out=False, oom_killed=False, cancelled=False,
                                  failure=""))


# ------------------------------------------------------------------ call lifecycles


def accept(log: EventLog, tcid: str, *, backend: str = "docker", image: str = "python:3.12-slim",
           **req: Any) -> str:
    """Admission as CallExecutor.submit records it; returns the last event id."""
    evs = log.record(tcid, "", [requested(**req), args_validated(), policy_checked(backend, image)])
    return evs[-1].event_id


def start(log: EventLog, tcid: str, parent: str) -> str:
    evs = log.record(tcid, parent, [draft(ToolSandboxPrepared("sbx-" + tcid, "eng-" + tcid, "docker", "sha256:5"))])
    evs = log.record(tcid, evs[-1].event_id, [draft(ToolCallStarted("sbx-" + tcid, iso(T0)))])
    return evs[-1].event_id


def finish(log: EventLog, tcid: str, parent: str, *, status: str = "success", exit_code: int = 0, code: str = "",
           observed: tuple[EventDraft, ...] = ()) -> str:
    evs = log.record(tcid, parent, [*observed, finished(exit_code), result(tcid, status, exit_code, code)])
    return evs[-1].event_id


def run_call(log: EventLog, tcid: str, *, status: str = "success", exit_code: int = 0, code: str = "",
             observed: tuple[EventDraft, ...] = (), **req: Any) -> None:
    last = accept(log, tcid, **req)
    last = start(log, tcid, last)
    finish(log, tcid, last, status=status, exit_code=exit_code, code=code, observed=observed)


def reject(log: EventLog, tcid: str, code: str = "PERMISSION_DENIED", stage: str = "verification", **req: Any) -> None:
    """CallExecutor.record_refusal: the request and its refusal in one transaction."""
    log.record(tcid, "", [requested(**req), rejected(code, stage)])


def call_row(db: Database, tcid: str) -> dict[str, Any]:
    rows = db.query("SELECT * FROM audit_calls WHERE tool_call_id = ?", (tcid,))
    assert len(rows) == 1, rows
    return rows[0]


def ids(db: Database, **filters: Any) -> list[str]:
    """Every matching call id, newest first, following page tokens to the end."""
    out: list[str] = []
    token = ""
    for _ in range(1000):
        rows, token = audit.query_calls(db, audit.CallQuery(page_token=token, **filters))
        out += [r["tool_call_id"] for r in rows]
        if not token:
            return out
    raise AssertionError("page tokens never ended")


def network_rows(db: Database, tcid: str | None = None) -> list[tuple]:
    """audit_network as (tool_call_id, host, port, decision), a sorted multiset."""
    rows = db.query("SELECT tool_call_id, host, port, decision FROM audit_network")
    return sorted(tuple(r.values()) for r in rows if tcid is None or r["tool_call_id"] == tcid)


def path_rows(db: Database, tcid: str | None = None) -> list[tuple]:
    """audit_paths as (tool_call_id, path, op), a sorted multiset."""
    rows = db.query("SELECT c.tool_call_id, p.path, p.op FROM audit_paths p JOIN audit_calls c ON c.seq = p.call_seq")
    return sorted(tuple(r.values()) for r in rows if tcid is None or r["tool_call_id"] == tcid)


def dump(db: Database) -> dict[str, Any]:
    """The whole index, in a comparable form."""
    return {
        "calls": db.query("SELECT * FROM audit_calls ORDER BY seq"),
        "network": network_rows(db),
        "paths": path_rows(db),
        "meta": db.query("SELECT * FROM audit_meta"),
    }


# ------------------------------------------------------------------ schema
def test_the_index_database_checkpoints_its_wal_less_often_and_cuts_it_back(tmp_path):
    """The index's database (as the daemon opens it) lets its WAL grow to
    INDEX_CHECKPOINT_PAGES before a checkpoint copies it into the database file (with a
    fsync); SQLite's default copies it after 1,000 pages. A checkpoint that emptied it
    cuts the file back to INDEX_WAL_KEEP_BYTES."""
    sizes = {}
    for name, d in (("default", Database(tmp_path / "default.sqlite", schema="", durable=False)),
                    ("index", audit.open_index_db(tmp_path / "index.sqlite"))):
        d.ensure_schema("CREATE TABLE t (v TEXT)")
        for _ in range(10):  # 5,000 pages in all (20 MB), 500 a commit
            with d.transaction() as conn:
                conn.executemany("INSERT INTO t VALUES (?)", [("x" * 3000,)] * 500)
        sizes[name] = (tmp_path / f"{name}.sqlite").stat().st_size
        if name == "index":
            wal = tmp_path / "index.sqlite-wal"
            assert wal.stat().st_size > audit.INDEX_WAL_KEEP_BYTES
            d.query("PRAGMA wal_checkpoint(TRUNCATE)")
            with d.transaction() as conn:  # the next writer starts the WAL over
                conn.execute("INSERT INTO t VALUES ('y')")
            assert wal.stat().st_size <= audit.INDEX_WAL_KEEP_BYTES
        d.close()
    assert sizes["default"] > 4 * 2**20 and sizes["index"] < 2**20, sizes




def test_ensure_schema_is_idempotent_and_keeps_rows(db, log):
    run_call(log, "tc-1")
    audit.ensure_schema(db)
    audit.ensure_schema(db)
    assert call_row(db, "tc-1")["status"] == "success"
    tables = {r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"audit_calls", "audit_network", "audit_paths", "audit_meta"} <= tables


def test_empty_index_answers_an_empty_page(db):
    assert audit.query_calls(db, audit.CallQuery()) == ([], "")
    assert audit.catch_up(db) == 0


# ------------------------------------------------------------------ a call's row


def test_running_then_success_row(db, log, clock):
    clock.set(T0)
    last = accept(log, "tc-ok", principal="alice", workspace=WS_ALICE, argv=("pytest", "-q", "tests"),
                  tool_id="python.test", backend="gvisor", image="python:3.12-slim")
    row = call_row(db, "tc-ok")
    expected = {
        "seq": 1, "tool_call_id": "tc-ok", "principal": "alice", "workspace": WS_ALICE,
        "command": "pytest -q tests", "tool_id": "python.test", "backend": "gvisor", "image": "python:3.12-slim",
        "status": "running", "exit_code": None, "error_code": "", "requested_at": iso(T0), "finished_at": "",
    }
    assert {k: row[k] for k in expected} == expected
    last = start(log, "tc-ok", last)
    assert call_row(db, "tc-ok")["status"] == "running"  # prepared/started change nothing
    finish(log, "tc-ok", last)
    row = call_row(db, "tc-ok")
    assert (row["status"], row["exit_code"], row["error_code"]) == ("success", 0, "")
    times = {e.type: e.time for e in log.for_call("tc-ok")}
    assert row["requested_at"] == times[ev.REQUESTED]
    assert row["finished_at"] == times[ev.RESULT_VALIDATED]
    assert row["finished_at"] > row["requested_at"]


@pytest.mark.parametrize(("status", "exit_code", "code"), [
    ("error", 2, "NONZERO_EXIT"),
    ("error", -1, "TIMEOUT"),
    ("error", 137, "OOM_KILLED"),
    ("partial", 0, "OUTPUT_TRUNCATED"),
    ("cancelled", -1, "CANCELLED"),
])
def test_finished_call_records_status_exit_and_error_code(db, log, status, exit_code, code):
    run_call(log, "tc-x", status=status, exit_code=exit_code, code=code)
    row = call_row(db, "tc-x")
    assert (row["status"], row["exit_code"], row["error_code"]) == (status, exit_code, code)
    assert row["finished_at"] != ""
    assert ids(db, status=status) == ["tc-x"]


def test_interrupted_call_recorded_by_recovery(db, log):
    """recover_interrupted appends FINISHED {interrupted} + an error result with exitCode -1."""
    last = accept(log, "tc-int")
    last = start(log, "tc-int", last)
    log.record("tc-int", last, [
        draft(ToolCallFinished.interrupted_call()),
        draft(ToolResultValidated({"toolCallId": "tc-int", "status": "error", "exitCode": -1,
                                   "error": {"code": "INTERRUPTED", "message": "m"}})),
    ])
    row = call_row(db, "tc-int")
    assert (row["status"], row["exit_code"], row["error_code"]) == ("error", -1, "INTERRUPTED")


def test_result_without_error_leaves_error_code_empty(db, log):
    last = accept(log, "tc-1")
    log.record("tc-1", last, [draft(ToolResultValidated({"status": "success", "exitCode": 0, "error": None}))])
    row = call_row(db, "tc-1")
    assert (row["status"], row["exit_code"], row["error_code"]) == ("success", 0, "")


def test_rejected_call(db, log, clock):
    clock.set(T0)
    reject(log, "tc-rej", code="PERMISSION_DENIED", principal="mallory", workspace="/etc",
           argv=("cat", "/etc/shadow"))
    row = call_row(db, "tc-rej")
    times = {e.type: e.time for e in log.for_call("tc-rej")}
    assert row["status"] == "rejected"
    assert row["error_code"] == "PERMISSION_DENIED"
    assert row["exit_code"] is None
    assert (row["backend"], row["image"]) == ("", "")
    assert row["principal"] == "mallory"
    assert row["command"] == "cat /etc/shadow"
    assert row["requested_at"] == times[ev.REQUESTED] == iso(T0)
    assert row["finished_at"] == times[ev.REJECTED]
    assert ids(db, status="rejected") == ["tc-rej"]
    assert ids(db, status="running") == []


def test_validation_rejection_with_a_malformed_request(db, log):
    """A request that failed parse_call is recorded raw: argv of the wrong types, missing
    workspace/toolId. Indexing must not fail (it would roll the event back)."""
    log.record("tc-bad", "", [
        EventDraft(ev.REQUESTED, {"argv": ["echo", 1, None, {"x": 1}], "principal": "alice", "daemonId": "d"}),
        rejected("INVALID_ARGUMENT", "validation"),
    ])
    log.record("tc-bad2", "", [
        EventDraft(ev.REQUESTED, {"argv": "rm -rf /", "principal": "alice", "toolId": 7}),
        rejected("INVALID_ARGUMENT", "validation"),
    ])
    assert len(log.for_call("tc-bad")) == 2  # the events were committed
    row = call_row(db, "tc-bad")
    assert row["status"] == "rejected" and row["error_code"] == "INVALID_ARGUMENT"
    assert isinstance(row["command"], str)
    assert (row["workspace"], row["tool_id"]) == ("", "")
    row2 = call_row(db, "tc-bad2")
    assert row2["status"] == "rejected" and row2["tool_id"] == "7"
    # searching commands over such rows works too
    assert ids(db, command_contains="echo") in ([], ["tc-bad"])
    assert set(ids(db, status="rejected")) == {"tc-bad", "tc-bad2"}


@pytest.mark.parametrize("state", ["running", "finished"])
def test_refused_retry_reusing_an_accepted_id_does_not_rewrite_the_call(db, log, state):
    last = accept(log, "tc-1", principal="alice", argv=("make", "test"))
    if state == "finished":
        finish(log, "tc-1", start(log, "tc-1", last), status="error", exit_code=2, code="NONZERO_EXIT")
    before = call_row(db, "tc-1")
    # The retry's own request (another principal, another command) and its refusal.
    reject(log, "tc-1", code="RESOURCE_EXHAUSTED", stage="admission", principal="bob", argv=("rm", "-rf", "/"))
    after = call_row(db, "tc-1")
    assert after == before
    assert after["principal"] == "alice" and after["command"] == "make test"
    assert after["status"] == ("running" if state == "running" else "error")
    assert ids(db, status="rejected") == []
    assert ids(db, principal="bob") == []


def test_second_refusal_of_a_refused_id_keeps_the_first(db, log):
    reject(log, "tc-r", code="PERMISSION_DENIED")
    first = call_row(db, "tc-r")
    reject(log, "tc-r", code="RESOURCE_EXHAUSTED")
    assert call_row(db, "tc-r") == first


def test_replayed_retry_changes_nothing(db, log):
    run_call(log, "tc-1", principal="alice")
    before = call_row(db, "tc-1")
    last = log.for_call("tc-1")[-1].event_id
    log.record("tc-1", last, [draft(ToolCallReplayed("bob", "k", False))])
    assert call_row(db, "tc-1") == before
    assert ids(db, principal="bob") == []


def test_events_before_the_request_or_of_unknown_calls_are_harmless(db, log):
    log.record("tc-ghost", "", [policy_checked(), result("tc-ghost"), rejected(),
                                network("pypi.org"), file_access("/workspace/a", "write")])
    assert db.query("SELECT * FROM audit_calls") == []
    assert ids(db) == []
    assert ids(db, path="/workspace/a") == []
    assert ids(db, domain="pypi.org") == []
    run_call(log, "tc-real", observed=(file_access("/workspace/a", "read"),))
    assert ids(db, path="/workspace/a") == ["tc-real"]
    assert ids(db, path="/workspace/a", path_operation="write") == []


def test_index_rolls_back_with_the_events(db, log):
    """Indexed in the appending transaction: never ahead of the log."""
    with pytest.raises(RuntimeError):
        with db.transaction() as conn:
            log.append(conn, "tc-1", "", [requested(), file_access("/workspace/a", "write"), network("x.test")])
            raise RuntimeError("abort")
    assert dump(db) == {"calls": [], "network": [], "paths": [], "meta": []}
    run_call(log, "tc-2")
    assert db.query("SELECT indexed_seq FROM audit_meta") == [{"indexed_seq": log.range()[-1].seq}]


# ------------------------------------------------------------------ command


def test_record_command_false_leaves_command_empty(db, log):
    run_call(log, "tc-secret", argv=("curl", "-H", "Authorization: Bearer s3cr3t"), record_command=False)
    run_call(log, "tc-open", argv=("curl", "https://example.test"))
    assert call_row(db, "tc-secret")["command"] == ""
    assert ids(db, command_contains="s3cr3t") == []
    assert ids(db, command_contains="curl") == ["tc-open"]


@pytest.mark.parametrize("argv", [
    ("echo", "hello world"),
    ("python3", "-c", "print('hi there')"),
    ("sh", "-c", 'echo "$HOME" && ls *.py'),
    ("printf", ""),
    ("grep", "-r", "a\\d+", "src/"),
    ("touch", "naïve file ✓"),
])
def test_command_is_shell_quoted_argv(db, log, argv):
    run_call(log, "tc-1", argv=argv)
    command = call_row(db, "tc-1")["command"]
    assert command == shlex.join(argv)
    assert shlex.split(command) == list(argv)  # round-trips


def test_command_quoting_literal(db, log):
    run_call(log, "tc-1", argv=("echo", "hello world", "it's"))
    assert call_row(db, "tc-1")["command"] == """echo 'hello world' 'it'"'"'s'"""


def test_command_contains_is_a_plain_substring(db, log):
    run_call(log, "tc-space", argv=("echo", "hello world"))
    run_call(log, "tc-pct", argv=("printf", "100%"))
    run_call(log, "tc-100", argv=("seq", "100"))
    run_call(log, "tc-under", argv=("rm", "a_b.txt"))
    run_call(log, "tc-axb", argv=("rm", "axb.txt"))
    run_call(log, "tc-bs", argv=("grep", "a\\d"))
    run_call(log, "tc-ad", argv=("grep", "ad"))
    assert ids(db, command_contains="'hello world'") == ["tc-space"]
    assert ids(db, command_contains="hello wor") == ["tc-space"]
    # % is literal, not "anything"
    assert ids(db, command_contains="100%") == ["tc-pct"]
    assert ids(db, command_contains="%") == ["tc-pct"]
    assert ids(db, command_contains="1%0") == []
    assert ids(db, command_contains="100") == ["tc-100", "tc-pct"]
    # _ is literal, not "any one character"
    assert ids(db, command_contains="a_b") == ["tc-under"]
    assert ids(db, command_contains="_") == ["tc-under"]
    # a backslash is literal, not LIKE's escape
    assert ids(db, command_contains="a\\d") == ["tc-bs"]
    assert ids(db, command_contains="\\") == ["tc-bs"]
    assert ids(db, command_contains="\\%") == []
    assert ids(db, command_contains="nothing-like-this") == []


# ------------------------------------------------------------------ principal / workspace / status / time


@pytest.fixture
def mixed(db, log, clock):
    """Six calls, one second apart: (id, principal, workspace, status)."""
    spec = [
        ("c1", "alice", WS_ALICE, "success"),
        ("c2", "bob", WS_BOB, "error"),
        ("c3", "alice", WS_ALICE, "error"),
        ("c4", "alice", WS_BOB, "rejected"),
        ("c5", "bob", WS_BOB, "success"),
        ("c6", "alice", WS_ALICE, "running"),
    ]
    for i, (tcid, principal, ws, status) in enumerate(spec):
        clock.set(T0 + timedelta(seconds=i))
        if status == "rejected":
            reject(log, tcid, principal=principal, workspace=ws)
        elif status == "running":
            accept(log, tcid, principal=principal, workspace=ws)
        else:
            run_call(log, tcid, principal=principal, workspace=ws, status=status,
                     exit_code=0 if status == "success" else 1, code="" if status == "success" else "NONZERO_EXIT")
    return {tcid: iso(T0 + timedelta(seconds=i)) for i, (tcid, *_rest) in enumerate(spec)}


def test_no_filter_lists_everything_newest_first(db, mixed):
    assert ids(db) == ["c6", "c5", "c4", "c3", "c2", "c1"]


def test_principal_workspace_status_filters(db, mixed):
    assert ids(db, principal="alice") == ["c6", "c4", "c3", "c1"]
    assert ids(db, principal="bob") == ["c5", "c2"]
    assert ids(db, principal="ali") == []  # exact, not a prefix
    assert ids(db, principal="Alice") == []
    assert ids(db, workspace=WS_BOB) == ["c5", "c4", "c2"]
    assert ids(db, workspace="/srv/sandboxd/workspaces") == []
    assert ids(db, status="success") == ["c5", "c1"]
    assert ids(db, status="error") == ["c3", "c2"]
    assert ids(db, status="rejected") == ["c4"]
    assert ids(db, status="running") == ["c6"]
    assert ids(db, status="cancelled") == []


def test_filters_combine_with_and(db, mixed):
    assert ids(db, principal="alice", status="error") == ["c3"]
    assert ids(db, principal="alice", workspace=WS_BOB) == ["c4"]
    assert ids(db, principal="bob", workspace=WS_BOB, status="success") == ["c5"]
    assert ids(db, principal="bob", status="rejected") == []
    assert ids(db, principal="alice", since=mixed["c3"], until=mixed["c6"]) == ["c4", "c3"]


def test_since_is_inclusive_and_until_exclusive(db, mixed):
    assert ids(db, since=mixed["c3"]) == ["c6", "c5", "c4", "c3"]
    assert ids(db, until=mixed["c3"]) == ["c2", "c1"]
    assert ids(db, since=mixed["c2"], until=mixed["c5"]) == ["c4", "c3", "c2"]
    assert ids(db, since=mixed["c3"], until=mixed["c3"]) == []
    assert ids(db, since=mixed["c6"]) == ["c6"]
    assert ids(db, until=mixed["c1"]) == []
    # bounds between two calls
    assert ids(db, since=iso(T0 + timedelta(seconds=4, milliseconds=500))) == ["c6"]
    assert ids(db, until=iso(T0 + timedelta(seconds=0, milliseconds=500))) == ["c1"]
    # a day and a whole-day window
    assert ids(db, since="2024-05-01", until="2024-05-02") == ["c6", "c5", "c4", "c3", "c2", "c1"]
    assert ids(db, since="2024-05-02") == []


def test_time_is_the_request_time_not_the_finish_time(db, log, clock):
    clock.set(T0)
    last = accept(log, "tc-long")
    clock.set(T0 + timedelta(hours=2))
    finish(log, "tc-long", last)
    assert ids(db, since=iso(T0 + timedelta(hours=1))) == []
    assert ids(db, until=iso(T0 + timedelta(hours=1))) == ["tc-long"]


def test_since_without_fraction_includes_calls_in_that_second(db, mixed):
    assert ids(db, since="2024-05-01T10:00:01Z") == ["c6", "c5", "c4", "c3", "c2"]


def test_until_without_fraction_is_exclusive(db, mixed):
    assert ids(db, until="2024-05-01T10:00:01Z") == ["c1"]


def test_since_with_an_offset(db, mixed):
    assert ids(db, since="2024-05-01T12:00:03+02:00") == ["c6", "c5", "c4"]


# ------------------------------------------------------------------ domains


@pytest.fixture
def hosts(db, log):
    run_call(log, "n-api", observed=(network("api.example.test"),))
    run_call(log, "n-apex", observed=(network("example.test"),))
    run_call(log, "n-bad", observed=(network("badexample.test"),))
    run_call(log, "n-deep", observed=(network("deep.sub.example.test", 80),))
    run_call(log, "n-denied", observed=(network("evil.test", 443, "denied"),))
    run_call(log, "n-other", observed=(network("example.test.evil"),))
    run_call(log, "n-none")
    run_call(log, "n-dropped", observed=(network_dropped(),))


def test_domain_exact(db, hosts):
    assert ids(db, domain="example.test") == ["n-apex"]
    assert ids(db, domain="api.example.test") == ["n-api"]
    assert ids(db, domain="sub.example.test") == []
    assert ids(db, domain="nowhere.test") == []


def test_domain_wildcard_matches_strict_subdomains_only(db, hosts):
    assert ids(db, domain="*.example.test") == ["n-deep", "n-api"]
    assert ids(db, domain="*.sub.example.test") == ["n-deep"]
    assert ids(db, domain="*.test") == ["n-denied", "n-deep", "n-bad", "n-apex", "n-api"]


def test_domain_wildcard_escapes_like_metacharacters(db, hosts):
    assert ids(db, domain="*.e_ample.test") == []
    assert ids(db, domain="*.%") == []
    assert ids(db, domain="*.%.test") == []


def test_domain_filter_is_normalised(db, hosts):
    for spelling in ("EXAMPLE.TEST", "example.test.", "Example.Test.", "  example.test  "):
        assert ids(db, domain=spelling) == ["n-apex"], spelling
    for spelling in ("*.EXAMPLE.test", "*.example.test.", " *.Example.TEST. "):
        assert ids(db, domain=spelling) == ["n-deep", "n-api"], spelling


def test_domain_filter_matches_denied_attempts_but_lists_only_allowed_hosts(db, hosts):
    rows, _ = audit.query_calls(db, audit.CallQuery(domain="evil.test"))
    assert [r["tool_call_id"] for r in rows] == ["n-denied"]
    assert rows[0]["domains"] == []


def test_dropped_connection_summary_is_not_a_host(db, hosts):
    rows, _ = audit.query_calls(db, audit.CallQuery())
    by_id = {r["tool_call_id"]: r for r in rows}
    assert by_id["n-dropped"]["domains"] == []
    assert by_id["n-none"]["domains"] == []
    assert network_rows(db, "n-dropped") == []


def test_domains_are_the_allowed_hosts_distinct_and_sorted(db, log):
    run_call(log, "tc-many", observed=(
        network("pypi.org"), network("files.pythonhosted.org"), network("pypi.org"),
        network("evil.test", decision="denied"), network("pypi.org", 80), network("api.github.com"),
        network_dropped(3)))
    run_call(log, "tc-one", observed=(network("pypi.org"),))
    rows, token = audit.query_calls(db, audit.CallQuery())
    assert token == ""
    by_id = {r["tool_call_id"]: r["domains"] for r in rows}
    assert by_id == {"tc-many": ["api.github.com", "files.pythonhosted.org", "pypi.org"], "tc-one": ["pypi.org"]}
    # the filter narrows the calls, never the listed domains
    rows, _ = audit.query_calls(db, audit.CallQuery(domain="api.github.com"))
    assert [(r["tool_call_id"], r["domains"]) for r in rows] == [
        ("tc-many", ["api.github.com", "files.pythonhosted.org", "pypi.org"])]


def test_network_rows_keep_port_and_decision(db, log):
    run_call(log, "tc-1", observed=(network("pypi.org", 443), network("evil.test", 8080, "denied")))
    assert network_rows(db) == [
        ("tc-1", "evil.test", 8080, "denied"), ("tc-1", "pypi.org", 443, "allowed")]


# ------------------------------------------------------------------ paths


@pytest.fixture
def paths(db, log):
    run_call(log, "p-file", observed=(file_access("/workspace/src/a.py", "read"),))
    run_call(log, "p-deep", observed=(file_access("/workspace/src/pkg/mod/b.py", "write"),))
    run_call(log, "p-dir", observed=(file_access("/workspace/src", "chmod"),))
    run_call(log, "p-src2", observed=(file_access("/workspace/src2/a.py", "read"),))
    run_call(log, "p-bak", observed=(file_access("/workspace/src.bak/a.py", "read"),))
    run_call(log, "p-dash", observed=(file_access("/workspace/src-old", "delete"),))
    run_call(log, "p-prefix", observed=(file_access("/workspace/src/a.pyc", "create"),))
    run_call(log, "p-tmp", observed=(file_access("/tmp/scratch", "write"),))
    run_call(log, "p-none")


def test_exact_file_path(db, paths):
    assert ids(db, path="/workspace/src/a.py") == ["p-file"]
    assert ids(db, path="/workspace/src/a.pyc") == ["p-prefix"]
    assert ids(db, path="/workspace/src/a") == []  # a prefix of a name is not a match
    assert ids(db, path="/tmp/scratch") == ["p-tmp"]


def test_directory_matches_itself_and_everything_below_but_not_siblings(db, paths):
    assert ids(db, path="/workspace/src") == ["p-prefix", "p-dir", "p-deep", "p-file"]
    assert ids(db, path="/workspace/src/") == ["p-prefix", "p-dir", "p-deep", "p-file"]
    assert ids(db, path="/workspace/src/pkg") == ["p-deep"]
    assert ids(db, path="/workspace/src2") == ["p-src2"]
    assert ids(db, path="/workspace/src.bak") == ["p-bak"]
    assert ids(db, path="/workspace/sr") == []
    assert ids(db, path="/workspace") == ["p-prefix", "p-dash", "p-bak", "p-src2", "p-dir", "p-deep", "p-file"]
    assert ids(db, path="/work") == []


def test_relative_paths_are_under_workspace(db, paths):
    assert ids(db, path="src/a.py") == ["p-file"]
    assert ids(db, path="src") == ["p-prefix", "p-dir", "p-deep", "p-file"]
    assert ids(db, path="src/") == ["p-prefix", "p-dir", "p-deep", "p-file"]
    assert ids(db, path="tmp/scratch") == []  # /workspace/tmp/scratch, not /tmp/scratch


def test_root_directory_matches_every_path(db, paths):
    assert ids(db, path="/") == ["p-tmp", "p-prefix", "p-dash", "p-bak", "p-src2", "p-dir", "p-deep", "p-file"]


def test_path_operation_filter(db, log):
    run_call(log, "o-read", observed=(file_access("/workspace/src/a.py", "read"),
                                      file_access("/workspace/out/log.txt", "write")))
    run_call(log, "o-write", observed=(file_access("/workspace/src/a.py", "write"),))
    run_call(log, "o-del", observed=(file_access("/workspace/src/old.py", "delete"),))
    run_call(log, "o-chmod", observed=(file_access("/workspace/src/run.sh", "chmod"),))
    run_call(log, "o-create", observed=(file_access("/workspace/src/new.py", "create"),))
    assert ids(db, path="/workspace/src", path_operation="read") == ["o-read"]
    assert ids(db, path="/workspace/src", path_operation="write") == ["o-write"]
    assert ids(db, path="/workspace/src/a.py", path_operation="write") == ["o-write"]
    assert ids(db, path="/workspace/src", path_operation="delete") == ["o-del"]
    assert ids(db, path="/workspace/src", path_operation="chmod") == ["o-chmod"]
    assert ids(db, path="/workspace/src", path_operation="create") == ["o-create"]
    assert ids(db, path="/workspace/src", path_operation="rename") == []
    # o-read wrote elsewhere: path and operation must hold for the same access
    assert ids(db, path="/workspace/out", path_operation="read") == []
    assert ids(db, path="/workspace/out", path_operation="write") == ["o-read"]
    assert ids(db, path="/workspace/src") == ["o-create", "o-chmod", "o-del", "o-write", "o-read"]


def test_rename_indexes_both_names(db, log):
    run_call(log, "r-1", observed=(file_access("/workspace/drafts/a.txt", "rename", "/workspace/final/b.txt"),))
    run_call(log, "r-2", observed=(file_access("/workspace/final/c.txt", "write"),))
    assert ids(db, path="/workspace/final/b.txt") == ["r-1"]
    assert ids(db, path="/workspace/final", path_operation="rename") == ["r-1"]
    assert ids(db, path="/workspace/final", path_operation="write") == ["r-2"]
    assert ids(db, path="/workspace/drafts/a.txt", path_operation="rename") == ["r-1"]
    assert path_rows(db, "r-1") == [
        ("r-1", "/workspace/drafts/a.txt", "rename"), ("r-1", "/workspace/final/b.txt", "rename")]


def test_file_access_without_path_is_ignored(db, log):
    run_call(log, "tc-1", observed=(EventDraft(ev.FILE_ACCESS, {"dropped": 12, "reason": "too many"}),))
    assert db.query("SELECT * FROM audit_paths") == []
    assert call_row(db, "tc-1")["status"] == "success"


def test_all_filters_at_once(db, log, clock):
    clock.set(T0)
    run_call(log, "hit", principal="alice", argv=("pip", "install", "-r", "requirements.txt"),
             observed=(network("pypi.org"), file_access("/workspace/.venv/lib/x.py", "create")))
    run_call(log, "wrong-op", principal="alice", argv=("pip", "install", "-r", "requirements.txt"),
             observed=(network("pypi.org"), file_access("/workspace/.venv/lib/x.py", "read")))
    run_call(log, "wrong-host", principal="alice", argv=("pip", "install", "-r", "requirements.txt"),
             observed=(network("mirror.test"), file_access("/workspace/.venv/lib/x.py", "create")))
    run_call(log, "wrong-principal", principal="bob", argv=("pip", "install", "-r", "requirements.txt"),
             observed=(network("pypi.org"), file_access("/workspace/.venv/lib/x.py", "create")))
    q = dict(command_contains="pip install", path=".venv", path_operation="create", domain="PYPI.org",
             principal="alice", workspace=WS_ALICE, status="success", since=iso(T0), until="2100-01-01")
    assert ids(db, **q) == ["hit"]


def test_a_call_with_many_matching_accesses_is_listed_once(db, log):
    many = tuple(file_access(f"/workspace/src/f{i}.py", op) for i in range(4) for op in ("read", "write")) + (
        network("pypi.org"), network("pypi.org"), network("pypi.org", 80), network("api.pypi.org"))
    run_call(log, "tc-many", observed=many)
    run_call(log, "tc-few", observed=(file_access("/workspace/src/f0.py", "read"), network("pypi.org")))
    for q in (dict(path="src"), dict(path="src", path_operation="write"), dict(domain="pypi.org"),
              dict(domain="*.pypi.org"), dict(path="src", domain="pypi.org"), dict(domain="pypi.org", path="src/f3.py")):
        got = ids(db, **q)
        assert len(got) == len(set(got)), q
    assert ids(db, path="src", domain="pypi.org") == ["tc-few", "tc-many"]
    assert ids(db, path="src", path_operation="write", domain="pypi.org") == ["tc-many"]
    assert ids(db, path="src/f3.py", domain="pypi.org") == ["tc-many"]
    assert ids(db, domain="*.pypi.org") == ["tc-many"]


def test_every_form_of_a_file_access_event_is_indexed(db, log):
    run_call(log, "batched", observed=(draft(FileAccessObserved(
        accesses=[{"path": "/workspace/w", "operation": "write", "opens": 1, "writes": 1},
                  {"path": "/workspace/old", "operation": "rename", "renamedTo": "/workspace/new"}])),
        draft(FileAccessObserved(reads=[["/workspace/r1", 2], ["/workspace/r2", 1]]))))
    # Logs written before reads were pairs: an entry per read, or one access per event.
    run_call(log, "older", observed=(
        EventDraft(ev.FILE_ACCESS, {"accesses": [{"path": "/workspace/r1", "operation": "read", "opens": 1,
                                                  "writes": 0}]}),
        EventDraft(ev.FILE_ACCESS, {"path": "/workspace/w", "operation": "write"})))
    assert path_rows(db) == sorted([
        ("batched", "/workspace/w", "write"), ("batched", "/workspace/old", "rename"),
        ("batched", "/workspace/new", "rename"), ("batched", "/workspace/r1", "read"),
        ("batched", "/workspace/r2", "read"), ("older", "/workspace/r1", "read"), ("older", "/workspace/w", "write")])
    assert ids(db, path="/workspace/r1", path_operation="read") == ["older", "batched"]
    assert ids(db, path="/workspace/r2") == ["batched"]


def test_path_and_domain_must_both_hold_for_the_call(db, log):
    run_call(log, "both", observed=(file_access("/workspace/a", "read"), network("pypi.org")))
    run_call(log, "path-only", observed=(file_access("/workspace/a", "read"), network("other.test")))
    run_call(log, "domain-only", observed=(file_access("/workspace/b", "read"), network("pypi.org")))
    assert ids(db, path="/workspace/a", domain="pypi.org") == ["both"]
    assert ids(db, path="/workspace/a") == ["path-only", "both"]
    assert ids(db, domain="pypi.org") == ["domain-only", "both"]


# ------------------------------------------------------------------ paging


@pytest.mark.parametrize("filters", [
    {}, {"path": "/workspace/src"}, {"domain": "pypi.org"}, {"domain": "*.example.test"},
    {"path": "src", "path_operation": "write", "domain": "pypi.org"}, {"command_contains": "job"},
    {"path": "src", "principal": "alice"},
])
@pytest.mark.parametrize("plan", ["selective", "dense"])
def test_paging_under_filters_that_match_a_call_many_times(db, log, monkeypatch, filters, plan):
    """Calls with several matching accesses and connections: every page boundary is exact,
    whichever way query_calls reads the driving filter (its own index, or along the call
    order once the filter matches DENSE_ROWS rows: forced here for small data)."""
    if plan == "dense":
        monkeypatch.setattr(audit, "DENSE_ROWS", 1, raising=False)
    expected = []
    for i in range(9):
        observed = (file_access(f"/workspace/src/m{i}.py", "read"), file_access(f"/workspace/src/m{i}.py", "write"),
                    file_access("/workspace/src/shared.py", "write"), network("pypi.org"), network("pypi.org"),
                    network(f"h{i}.example.test"), network("x.example.test"))
        principal = "alice" if i % 2 else "bob"
        run_call(log, f"tc-{i}", principal=principal, argv=("run", f"job{i}"), observed=observed)
        if filters.get("principal", principal) == principal:
            expected.insert(0, f"tc-{i}")
    for page_size in (1, 2, 3, 4, 50):
        got, token, pages = [], "", 0
        while True:
            rows, token = audit.query_calls(db, audit.CallQuery(page_size=page_size, page_token=token, **filters))
            pages += 1
            assert len(rows) == page_size if token else 0 < len(rows) <= page_size
            got += [r["tool_call_id"] for r in rows]
            if not token:
                break
        assert got == expected, page_size
        assert pages == -(-len(expected) // page_size), page_size


def test_paging_newest_first_without_gaps_or_duplicates(db, log):
    for i in range(23):
        run_call(log, f"tc-{i:02d}", principal="alice" if i % 2 else "bob")
    expected = [f"tc-{i:02d}" for i in reversed(range(23))]
    seen, token, pages = [], "", 0
    while True:
        rows, token = audit.query_calls(db, audit.CallQuery(page_size=5, page_token=token))
        pages += 1
        assert len(rows) == (5 if token else 3)
        seqs = [r["seq"] for r in rows]
        assert seqs == sorted(seqs, reverse=True)
        seen += [r["tool_call_id"] for r in rows]
        if not token:
            break
        assert isinstance(token, str) and token
    assert pages == 5
    assert seen == expected


def test_last_full_page_has_no_next_token(db, log):
    for i in range(6):
        run_call(log, f"tc-{i}")
    rows1, t1 = audit.query_calls(db, audit.CallQuery(page_size=3))
    rows2, t2 = audit.query_calls(db, audit.CallQuery(page_size=3, page_token=t1))
    assert [r["tool_call_id"] for r in rows1] == ["tc-5", "tc-4", "tc-3"]
    assert [r["tool_call_id"] for r in rows2] == ["tc-2", "tc-1", "tc-0"]
    assert t1 and t2 == ""
    rows, t = audit.query_calls(db, audit.CallQuery(page_size=6))
    assert len(rows) == 6 and t == ""
    rows, t = audit.query_calls(db, audit.CallQuery(page_size=7))
    assert len(rows) == 6 and t == ""


def test_paging_keeps_filters_and_is_stable_under_new_calls(db, log):
    for i in range(10):
        run_call(log, f"tc-{i}", principal="alice" if i % 3 else "bob")
    alice = [f"tc-{i}" for i in reversed(range(10)) if i % 3]
    rows, token = audit.query_calls(db, audit.CallQuery(principal="alice", page_size=4))
    got = [r["tool_call_id"] for r in rows]
    run_call(log, "tc-new", principal="alice")  # newer than the token: not on later pages
    while token:
        rows, token = audit.query_calls(db, audit.CallQuery(principal="alice", page_size=4, page_token=token))
        got += [r["tool_call_id"] for r in rows]
    assert got == alice
    assert ids(db, principal="alice", page_size=4)[0] == "tc-new"


def test_page_size_default_and_maximum(db, log):
    with db.transaction() as conn:
        for i in range(510):
            log.append(conn, f"tc-{i:03d}", "", [requested()])
    rows, token = audit.query_calls(db, audit.CallQuery())
    assert len(rows) == 50 and token
    rows, token = audit.query_calls(db, audit.CallQuery(page_size=0))
    assert len(rows) == 50 and token
    rows, token = audit.query_calls(db, audit.CallQuery(page_size=500))
    assert len(rows) == 500 and token
    rows, token = audit.query_calls(db, audit.CallQuery(page_size=500, page_token=token))
    assert len(rows) == 10 and token == ""
    rows, token = audit.query_calls(db, audit.CallQuery(page_size=1))
    assert [r["tool_call_id"] for r in rows] == ["tc-509"] and token


def test_page_token_round_trip(db):
    assert audit.decode_token(audit.encode_token(42)) == 42
    assert audit.decode_token(audit.encode_token(0)) == 0


# ------------------------------------------------------------------ bad filters


def bad(db, **filters: Any) -> audit.BadFilter:
    with pytest.raises(audit.BadFilter) as info:
        audit.query_calls(db, audit.CallQuery(**filters))
    assert isinstance(info.value, ValueError)
    assert info.value.reason and info.value.field in str(info.value)
    return info.value


@pytest.mark.parametrize("status", ["bogus", "RUNNING", "Success", "ok", "succeeded"])
def test_bad_status(db, status):
    assert bad(db, status=status).field == "status"


@pytest.mark.parametrize("op", ["exec", "READ", "open", "unlink"])
def test_unknown_path_operation(db, op):
    assert bad(db, path="/workspace", path_operation=op).field == "pathOperation"


@pytest.mark.parametrize("op", ["read", "write", "rename"])
def test_path_operation_needs_a_path(db, op):
    err = bad(db, path_operation=op)
    assert err.field == "pathOperation"
    assert "path" in err.reason


@pytest.mark.parametrize("size", [501, 1000, -1])
def test_bad_page_size(db, size):
    assert bad(db, page_size=size).field == "pageSize"


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


@pytest.mark.parametrize("token", [
    "garbage",
    "!!!!",
    "abc",  # bad padding
    b64(b"not json"),
    b64(b"\xff\xfe\x00"),
    b64(b"[1, 2]"),
    b64(b'"before"'),
    b64(b"17"),
    b64(b"null"),
    b64(json.dumps({"after": 5}).encode()),
    b64(json.dumps({"before": "5"}).encode()),
    b64(json.dumps({"before": 5.5}).encode()),
    b64(json.dumps({"before": None}).encode()),
    b64(json.dumps({"before": [5]}).encode()),
    "é",
])
def test_garbage_page_token(db, token):
    assert bad(db, page_token=token).field == "pageToken"


def test_page_token_with_a_huge_integer(db, log):
    run_call(log, "tc-1")
    assert bad(db, page_token=b64(json.dumps({"before": 10 ** 30}).encode())).field == "pageToken"


def test_valid_filters_do_not_raise(db):
    for status in audit.STATUSES:
        assert audit.query_calls(db, audit.CallQuery(status=status)) == ([], "")
    for op in audit.PATH_OPERATIONS:
        assert audit.query_calls(db, audit.CallQuery(path="/workspace", path_operation=op)) == ([], "")
    assert audit.query_calls(db, audit.CallQuery(page_size=1)) == ([], "")


# ------------------------------------------------------------------ catch_up


def scenario(log: EventLog) -> None:
    """Every kind of event the index looks at, interleaved across calls."""
    a = accept(log, "s-ok", principal="alice", argv=("pytest", "-q", "it's"), tool_id="python.test")
    b = accept(log, "s-err", principal="bob", workspace=WS_BOB, backend="gvisor", image="node:20")
    reject(log, "s-rej", code="PERMISSION_DENIED", principal="mallory", argv=("cat", "/etc/shadow"))
    a = start(log, "s-ok", a)
    reject(log, "s-ok", code="RESOURCE_EXHAUSTED", principal="bob")  # refused retry reusing the id
    finish(log, "s-ok", a, observed=(
        network("pypi.org"), network("files.pythonhosted.org"), network("evil.test", 443, "denied"), network_dropped(),
        file_access("/workspace/src/a.py", "read"), file_access("/workspace/out.txt", "write"),
        file_access("/workspace/tmp1", "rename", "/workspace/final.txt")))
    accept(log, "s-secret", record_command=False, argv=("curl", "-H", "token"))
    b = start(log, "s-err", b)
    finish(log, "s-err", b, status="error", exit_code=3, code="NONZERO_EXIT",
           observed=(file_access("/workspace/src/b.py", "delete"), network("registry.npmjs.org")))
    last = log.for_call("s-ok")[-1].event_id
    log.record("s-ok", last, [draft(ToolCallReplayed("alice", "k", False))])
    log.record("s-bad", "", [EventDraft(ev.REQUESTED, {"argv": [1, 2], "principal": "x"}),
                             rejected("INVALID_ARGUMENT", "validation")])


@pytest.mark.parametrize("batch", [1, 4, 5000])
def test_catch_up_indexes_a_log_written_without_the_index(tmp_path, monkeypatch, batch):
    # live: the index hooked into every append
    monkeypatch.setattr(ev, "utc_now", Clock())
    live = Database(tmp_path / "live.sqlite")
    audit.ensure_schema(live)
    scenario(EventLog(live, on_append=audit.index_events))

    # the same log written by a daemon without the index (an upgrade): the index
    # tables appear afterwards, and catch_up fills them
    monkeypatch.setattr(ev, "utc_now", Clock())
    late = Database(tmp_path / "late.sqlite")
    late_log = EventLog(late)
    scenario(late_log)
    audit.ensure_schema(late)
    assert late.query("SELECT count(*) AS n FROM audit_calls") == [{"n": 0}]
    total = len(late_log.range())
    assert audit.catch_up(late, batch=batch) == total
    assert late.query("SELECT indexed_seq FROM audit_meta") == [{"indexed_seq": late_log.range()[-1].seq}]

    assert dump(late) == dump(live)
    assert audit.catch_up(late) == 0
    assert audit.catch_up(live) == 0
    assert dump(late) == dump(live)
    for q in (audit.CallQuery(), audit.CallQuery(domain="*.org"), audit.CallQuery(path="src"),
              audit.CallQuery(status="rejected"), audit.CallQuery(command_contains="it'")):
        assert audit.query_calls(late, q) == audit.query_calls(live, q)
    row = call_row(late, "s-ok")
    assert (row["status"], row["principal"], row["backend"]) == ("success", "alice", "docker")
    live.close()
    late.close()


def test_an_index_of_an_older_schema_is_rebuilt(tmp_path, clock):
    """An index written by an earlier daemon version (other tables, claiming to be up to
    date) is dropped by ensure_schema and rebuilt from the log by catch_up."""
    fresh = Database(tmp_path / "fresh.sqlite")
    audit.ensure_schema(fresh)
    scenario(EventLog(fresh, on_append=audit.index_events))

    clock.set(T0)
    db = Database(tmp_path / "old.sqlite")
    log = EventLog(db)
    scenario(log)
    db.ensure_schema(
        "CREATE TABLE audit_calls (seq INTEGER PRIMARY KEY, tool_call_id TEXT NOT NULL UNIQUE);"
        "CREATE TABLE audit_network (tool_call_id TEXT NOT NULL, host TEXT NOT NULL);"
        "CREATE TABLE audit_paths (tool_call_id TEXT NOT NULL, path TEXT NOT NULL);"
        "CREATE TABLE audit_meta (id INTEGER PRIMARY KEY CHECK (id = 1), indexed_seq INTEGER NOT NULL);"
        f"INSERT INTO audit_meta VALUES (1, {log.range()[-1].seq});")
    audit.ensure_schema(db)
    assert audit.catch_up(db) == len(log.range())
    assert dump(db) == dump(fresh)
    # the next start finds the current version and keeps the index
    audit.ensure_schema(db)
    assert audit.catch_up(db) == 0
    assert dump(db) == dump(fresh)
    fresh.close()
    db.close()


def test_catch_up_after_live_indexing_duplicates_nothing(db, log):
    scenario(log)
    before = dump(db)
    assert audit.catch_up(db) == 0
    assert audit.catch_up(db, batch=1) == 0
    assert dump(db) == before


def test_catch_up_finishes_a_partly_indexed_log(tmp_path, monkeypatch):
    """Indexed live up to a point, then written by a daemon without the index (a
    downgrade), then caught up: calls that span both halves end up complete."""
    def first_half(lg):
        return accept(lg, "h-1", argv=("make",)), accept(lg, "h-2", principal="bob")

    def second_half(lg, p1, p2):
        finish(lg, "h-1", p1, observed=(network("pypi.org"), file_access("/workspace/a", "write")))
        finish(lg, "h-2", p2, status="cancelled", exit_code=-1, code="CANCELLED")
        run_call(lg, "h-3", observed=(file_access("/workspace/b", "read"),))

    monkeypatch.setattr(ev, "utc_now", Clock())
    ref = Database(tmp_path / "ref.sqlite")
    audit.ensure_schema(ref)
    ref_log = EventLog(ref, on_append=audit.index_events)
    second_half(ref_log, *first_half(ref_log))

    monkeypatch.setattr(ev, "utc_now", Clock())
    db = Database(tmp_path / "db.sqlite")
    audit.ensure_schema(db)
    indexed, unindexed = EventLog(db, on_append=audit.index_events), EventLog(db)
    p1, p2 = first_half(indexed)
    seen = len(indexed.range())
    second_half(unindexed, p1, p2)
    assert call_row(db, "h-1")["status"] == "running"  # not yet
    assert audit.catch_up(db, batch=2) == len(unindexed.range()) - seen

    assert dump(db) == dump(ref)
    assert call_row(db, "h-2")["status"] == "cancelled"
    assert ids(db, path="/workspace/b") == ["h-3"]
    assert audit.catch_up(db) == 0
    ref.close()
    db.close()


def test_reindexing_an_event_does_not_duplicate_calls_in_answers(db, log):
    """Even if events are projected twice, answers list each call once with distinct domains."""
    run_call(log, "tc-1", observed=(network("pypi.org"), file_access("/workspace/a", "read")))
    with db.transaction() as conn:
        audit.index_events(conn, log.range())
    rows, token = audit.query_calls(db, audit.CallQuery(path="/workspace/a", domain="pypi.org"))
    assert [(r["tool_call_id"], r["domains"]) for r in rows] == [("tc-1", ["pypi.org"])] and token == ""
    assert call_row(db, "tc-1")["status"] == "success"


def test_index_event_is_idempotent_for_network_and_path_rows(db, log):
    run_call(log, "tc-1", observed=(network("pypi.org"), file_access("/workspace/a", "rename", "/workspace/b")))
    before = dump(db)
    with db.transaction() as conn:
        for e in log.range():
            index_event(conn, e)
    assert dump(db) == before


def test_catch_up_racing_a_live_append_duplicates_nothing(db, clock):
    """catch_up reads and indexes each batch inside one write transaction, so a live
    append running on another thread meanwhile is indexed exactly once."""
    import threading

    unindexed = EventLog(db)
    for i in range(300):
        run_call(unindexed, f"tc-old-{i}", observed=(network("pypi.org"), file_access("/workspace/a", "write")))
    live = EventLog(db, on_append=audit.index_events)
    stop = threading.Event()

    def append_live():
        i = 0
        while not stop.is_set() and i < 100:
            run_call(live, f"tc-live-{i}", observed=(network("pypi.org"), file_access("/workspace/a", "write")))
            i += 1

    t = threading.Thread(target=append_live)
    t.start()
    audit.catch_up(db, batch=50)
    stop.set()
    t.join()
    audit.catch_up(db, batch=50)
    calls = db.query("SELECT COUNT(*) AS n FROM audit_calls")[0]["n"]
    net = db.query("SELECT COUNT(*) AS n FROM audit_network")[0]["n"]
    paths = db.query("SELECT COUNT(*) AS n FROM audit_paths")[0]["n"]
    assert calls == net == paths and calls >= 300

def test_two_thousand_calls(db, log):
    with db.transaction() as conn:
        for i in range(2000):
            tcid = f"tc-{i:04d}"
            principal = ("alice", "bob", "carol")[i % 3]
            status, code, exit_code = ("error", "NONZERO_EXIT", 1) if i % 7 == 0 else ("success", "", 0)
            observed = [file_access(f"/workspace/pkg{i % 10}/m{i}.py", "write" if i % 2 else "read")]
            if i % 5 == 0:
                observed.append(network("pypi.org"))
            log.append(conn, tcid, "", [requested(principal=principal, argv=("python", f"job_{i}.py")),
                                        policy_checked(), *observed, result(tcid, status, exit_code, code)])
    expect = [f"tc-{i:04d}" for i in reversed(range(2000)) if i % 3 == 1 and i % 7 == 0]
    assert ids(db, principal="bob", status="error", page_size=37) == expect
    assert len(ids(db, page_size=500)) == 2000
    assert len(ids(db, domain="pypi.org", page_size=500)) == 400
    assert ids(db, path="/workspace/pkg3", path_operation="write", page_size=500) == [
        f"tc-{i:04d}" for i in reversed(range(2000)) if i % 10 == 3 and i % 2]
    assert ids(db, command_contains="job_1999.py") == ["tc-1999"]
    assert len(ids(db, command_contains="job_1", page_size=500)) == 1111  # 1, 10-19, 100-199, 1000-1999
    # filters matching thousands of index rows (read along the call order)
    everything = [f"tc-{i:04d}" for i in reversed(range(2000))]
    assert ids(db, path="/workspace", page_size=500) == everything
    assert ids(db, path="/workspace", page_size=7)[:20] == everything[:20]
    assert ids(db, path="/workspace", principal="bob", status="error", page_size=37) == expect
    assert ids(db, path="/workspace", domain="pypi.org", page_size=500) == [
        f"tc-{i:04d}" for i in reversed(range(2000)) if i % 5 == 0]
    assert ids(db, path="/workspace", path_operation="read", domain="pypi.org", page_size=500) == [
        f"tc-{i:04d}" for i in reversed(range(2000)) if i % 10 == 0]
    assert db.query("SELECT indexed_seq FROM audit_meta") == [{"indexed_seq": log.range(0, 100_000)[-1].seq}]


# ------------------------------------------------------------------ the daemon's wiring: an index file of its own


@pytest.fixture
def split(tmp_path, clock):
    """As main.build_daemon wires it: the log in sandboxd.db, the index in audit.db,
    EventLog's appends waking the index's thread."""
    log_db = Database(tmp_path / "sandboxd.db")
    index = audit.AuditIndex(log_db, Database(tmp_path / "audit.db", schema="", durable=False))
    yield log_db, index, EventLog(log_db, on_append=index.notify)
    index.stop()
    index.db.close()
    log_db.close()


def test_the_index_file_tails_the_log_on_its_own_thread(split):
    log_db, index, log = split
    index.start()
    run_call(log, "tc_tailed", argv=("make", "tailed"), observed=(file_access("/workspace/t.py", "write"),))
    deadline = time.monotonic() + 10
    while not index.db.query("SELECT 1 FROM audit_calls WHERE status = 'success'"):
        assert time.monotonic() < deadline, "the index never caught up by itself"
        time.sleep(0.01)
    assert audit.query_calls(index.db, audit.CallQuery(path="/workspace/t.py"))[0][0]["tool_call_id"] == "tc_tailed"
    # The log's database holds no index tables at all.
    tables = {r["name"] for r in log_db.query("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert not tables & {"audit_calls", "audit_paths", "audit_network", "audit_meta"}


def test_the_tail_waits_for_a_quiet_log_but_never_longer_than_its_bound(tmp_path, clock):
    """Indexing at each commit competed with the call that had just committed; the
    tail batches instead, and a log that never goes quiet is still indexed in time."""
    log_db = Database(tmp_path / "sandboxd.db")
    index = audit.AuditIndex(log_db, Database(tmp_path / "audit.db", schema="", durable=False),
                             quiet_s=1.0, max_delay_s=2.0)
    log = EventLog(log_db, on_append=index.notify)
    index.start()
    try:
        run_call(log, "tc_first")
        time.sleep(0.1)
        assert ids(index.db) == [], "indexed before the log went quiet"
        # An append every 0.2 s never leaves a quiet second: the bound decides.
        begun = time.monotonic()
        n = 0
        while not ids(index.db):
            assert time.monotonic() - begun < 6, "a busy log was never indexed"
            accept(log, f"tc_busy{n}")
            n += 1
            time.sleep(0.2)
        assert "tc_first" in ids(index.db) and n >= 3  # not before the bound, and while appends went on
        deadline = time.monotonic() + 10
        while index.lag():  # quiet now: the rest follows within a quiet interval
            assert time.monotonic() < deadline, "the index never caught up once the log was quiet"
            time.sleep(0.05)
    finally:
        index.stop()
        index.db.close()
        log_db.close()


def test_sync_brings_the_index_to_the_logs_head(split):
    log_db, index, log = split  # no thread: only sync indexes
    run_call(log, "tc_a", argv=("echo", "a"))
    assert ids(index.db) == [] and index.lag() == len(log.range())
    assert index.sync() == len(log.range()) and index.lag() == 0
    assert ids(index.db) == ["tc_a"] and call_row(index.db, "tc_a")["status"] == "success"
    accept(log, "tc_b")
    assert index.sync() == 3 and index.sync() == 0
    assert ids(index.db) == ["tc_b", "tc_a"] and call_row(index.db, "tc_b")["status"] == "running"


def test_a_lost_index_file_is_rebuilt_from_the_log(split, tmp_path):
    log_db, index, log = split
    run_call(log, "tc_kept", observed=(network("pypi.test"),))
    index.sync()
    index.db.close()
    for name in ("audit.db", "audit.db-wal", "audit.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    again = audit.AuditIndex(log_db, Database(tmp_path / "audit.db", schema="", durable=False))
    try:
        assert ids(again.db) == []
        assert again.sync() == len(log.range())
        assert ids(again.db, domain="pypi.test") == ["tc_kept"]
    finally:
        again.db.close()
    index.db = Database(tmp_path / "audit-closed.db", schema="")  # for the fixture's close


def test_the_index_file_is_not_fsynced_but_the_log_is(split, monkeypatch):
    log_db, index, _ = split
    synced = []
    real = store.os.fsync
    monkeypatch.setattr(store.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    for db in (log_db, index.db):
        with db.transaction() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
            conn.execute("INSERT INTO t VALUES (1)")
    wal, its_dir = log_db._wal_path, os.path.dirname(log_db._wal_path)
    assert synced == [wal, its_dir]  # the WAL's directory once, for its name
    with log_db.transaction(durable=False) as conn:  # relaxed: the next durable commit or flush() syncs it
        conn.execute("INSERT INTO t VALUES (2)")
    assert synced == [wal, its_dir]
    log_db.flush()
    assert synced == [wal, its_dir, wal]


def test_index_tables_left_in_the_log_db_by_an_older_daemon_are_dropped(tmp_path):
    log_db = Database(tmp_path / "sandboxd.db")
    audit.ensure_schema(log_db)  # where daemons before the split kept the index
    audit.drop_from_log_db(log_db)
    tables = {r["name"] for r in log_db.query("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "events" in tables and not tables & {"audit_calls", "audit_paths", "audit_network", "audit_meta",
                                                "audit_schema"}
    log_db.close()


def test_a_bad_filter_is_refused_before_any_query(db):
    with pytest.raises(audit.BadFilter, match="pageToken"):
        audit.check_query(audit.CallQuery(page_token="not-a-token"))
    with pytest.raises(audit.BadFilter, match="pathOperation"):
        audit.check_query(audit.CallQuery(path_operation="read"))
    audit.check_query(audit.CallQuery(path="/workspace/x", path_operation="read"))
