"""Forensic queries against a real daemon: the index is built from the calls' events as
they are recorded, answers through the AuditService and `sandboxctl audit`, keeps
tenants apart, and survives a restart (catching up from the log)."""

from __future__ import annotations

import io
import json
import sqlite3

import pytest

from sandboxd_client import errors

from .conftest import call, sh, wait_for
from .test_cli import ctl
from .test_tenants import ALICE, BOB, client_as


@pytest.fixture
def audited(spare_daemon):
    return spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, admins=["root"],
                        socket_mode=0o666).start()


def test_queries_find_calls_by_command_status_and_workspace(audited):
    d = audited
    ws_a, ws_b = d.new_workspace(), d.new_workspace()
    with d.client() as c:
        ok = c.run(call(ws_a, sh("echo needle-in-haystack")))
        failed = c.run(call(ws_b, sh("exit 3")))
        timed_out = c.run(call(ws_a, ["sleep", "30"], {"process": {"timeoutMs": 300}}))
        hidden = c.run(call(ws_a, sh("echo secret-command"), {"audit": {"recordCommand": False}}))
        with pytest.raises(errors.InvalidArgument):
            c.run(call(ws_a, sh("echo refused"), {"network": {"egress": "allowlist", "allowDomains": ["*"]}}))

        found = c.query_calls(command_contains="needle-in")
        assert [x.tool_call_id for x in found.calls] == [ok.tool_call_id]
        row = found.calls[0]
        assert row.status == "success" and row.exit_code == 0 and row.principal == "root"
        assert row.command == "/bin/sh -c 'echo needle-in-haystack'" and row.backend == "docker"
        assert row.workspace == str(ws_a) and row.requested_at <= row.finished_at

        errors_ = c.query_calls(status="error")
        assert {x.tool_call_id: x.error_code for x in errors_.calls} == {
            failed.tool_call_id: "NONZERO_EXIT", timed_out.tool_call_id: "TIMEOUT"}
        assert [x.tool_call_id for x in c.query_calls(workspace=str(ws_b)).calls] == [failed.tool_call_id]
        # Not recorded means not searchable either.
        assert not c.query_calls(command_contains="secret-command").calls
        assert c.query_calls(command_contains="", status="success").calls[0].tool_call_id == hidden.tool_call_id
        refused = c.query_calls(status="rejected").calls
        assert len(refused) == 1 and refused[0].error_code == "INVALID_ARGUMENT" and not refused[0].HasField("exit_code")

        # Newest first, paged without gaps or repeats.
        first = c.query_calls(page_size=2)
        assert len(first.calls) == 2 and first.next_page_token
        rest = list(c.iter_calls(page_token=first.next_page_token, page_size=2))
        everything = [x.tool_call_id for x in list(first.calls) + rest]
        assert everything == [x.tool_call_id for x in c.query_calls(page_size=50).calls]
        assert len(everything) == 5 and everything[-1] == ok.tool_call_id

        with pytest.raises(errors.InvalidArgument) as exc:
            c.query_calls(status="finished")
        assert "status" in exc.value.message


def test_tenants_query_only_their_own_calls_and_admins_all(audited):
    d = audited
    alice_ws = d.new_workspace(uid=ALICE)
    bob_ws = d.new_workspace(uid=BOB)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob, d.client() as root:
        mine = alice.run(call(alice_ws, sh("echo shared-word alice")))
        theirs = bob.run(call(bob_ws, sh("echo shared-word bob")))
        assert [x.tool_call_id for x in alice.query_calls(command_contains="shared-word").calls] == [mine.tool_call_id]
        assert [x.tool_call_id for x in bob.query_calls(command_contains="shared-word").calls] == [theirs.tool_call_id]
        # Asking for another principal's calls is answered as if there were none.
        assert not alice.query_calls(principal="bob").calls
        assert {x.tool_call_id for x in root.query_calls(command_contains="shared-word").calls} == {
            mine.tool_call_id, theirs.tool_call_id}
        assert [x.principal for x in root.query_calls(principal="bob").calls] == ["bob"]


def test_sandboxctl_audit_table_and_json(audited):
    d = audited
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(call(ws, sh("echo audit-me")))
        # An argv that would print a line of its own and erase one: escaped in the table.
        forged = c.run(call(ws, ["echo", "audit-me\n2026-01-01 00:00:00  tc_fake  root  success\x1b[2K"]))
    table = ctl(d, "audit", "--command", "audit-me").stdout.decode()
    header, newest, line = table.splitlines()
    assert header.split() == ["REQUESTED", "CALL", "PRINCIPAL", "PROPOSER", "STATUS", "EXIT", "DOMAINS", "COMMAND"]
    assert done.tool_call_id in line and "success" in line and "audit-me" in line
    assert forged.tool_call_id in newest and "\x1b" not in table and "audit-me\\n2026" in newest
    rows = [json.loads(x) for x in ctl(d, "audit", "--json", "--status", "success").stdout.splitlines()]
    assert [r["toolCallId"] for r in rows] == [forged.tool_call_id, done.tool_call_id] and rows[1]["exitCode"] == 0
    bad = ctl(d, "audit", "--path", "src", "--op", "teleport")
    assert bad.returncode == 1 and b"pathOperation" in bad.stderr


def test_index_catches_up_from_the_log_after_a_restart(audited):
    """The log is the source of truth: an index that lost rows is rebuilt from it."""
    d = audited
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(call(ws, sh("echo rebuild-me")))
    d.stop()
    db = sqlite3.connect(d.state_dir / "audit.db")
    db.execute("DELETE FROM audit_calls")
    db.execute("DELETE FROM audit_meta")
    db.commit()
    db.close()
    d.start()
    with d.client() as c:
        rows = c.query_calls(command_contains="rebuild-me").calls
    assert [x.tool_call_id for x in rows] == [done.tool_call_id] and rows[0].status == "success"


def test_retention_turns_old_calls_into_tombstones_and_the_log_still_verifies(spare_daemon):
    """Past the retention period a call's artifacts (blob included) and index rows go;
    its events stay, closed by a ToolCallExpired tombstone naming what was removed, and
    the whole log verifies. A call inside its period keeps everything."""
    period_s = 5.0
    d = spare_daemon(retention={"period_days": period_s / 86400, "sweep_interval_s": 0.2}).start()
    ws = d.new_workspace({"notes.txt": "n"})
    with d.client() as c:
        keyed = call(ws, sh("cat notes.txt; echo expiring-output; echo ran >> runs.txt"),
                     {"filesystem": {"writeRoots": ["/workspace"]}})
        keyed["runtime"]["idempotencyKey"] = "retention-key-1"
        old = c.run(keyed)
        assert old.result.status == "success"
        assert c.run(keyed).tool_call_id == old.tool_call_id  # replayed while in its period
        [art] = [a for a in c.list_artifacts(old.tool_call_id) if a.kind == "stdout"]
        hexdigest = art.content_hash.removeprefix("sha256:")
        blob = d.state_dir / "blobs" / "sha256" / hexdigest[:2] / hexdigest
        assert blob.read_bytes() == b"nexpiring-output\n"
        assert [x.tool_call_id for x in c.query_calls(command_contains="expiring-output").calls] == [old.tool_call_id]
        kept = [e.event_id for e in c.get_trace(old.tool_call_id)]

        trace = wait_for(lambda: (t := c.get_trace(old.tool_call_id))[-1].type == "ToolCallExpired" and t,
                         timeout_s=period_s + 20)
        assert trace, "the call did not expire"
        fresh = c.run(call(ws, sh("echo fresh-output")))

        assert [e.event_id for e in trace[:-1]] == kept
        tomb = json.loads(trace[-1].payload_json)
        assert {a["artifactId"]: a["contentHash"] for a in tomb["artifactsRemoved"]}[art.artifact_id] == art.content_hash
        assert trace[-1].parent_event_id == kept[-1]
        assert c.verify_log().ok
        assert not c.query_calls(command_contains="expiring-output").calls
        assert {a["kind"] for a in tomb["artifactsRemoved"]} == {"stdout", "file", "diff"}
        assert c.list_artifacts(old.tool_call_id) == [] and not blob.exists()
        with pytest.raises(errors.NotFound, match="expired at .*retention period"):
            c.download_artifact(art.artifact_id, io.BytesIO())
        # A retry under its key is refused, and never runs a second time.
        with pytest.raises(errors.FailedPrecondition, match="expired .*retention period") as refusal:
            c.run(keyed)
        assert (ws / "runs.txt").read_text() == "ran\n"
        refused = c.get_trace(refusal.value.tool_call_id)
        assert [e.type for e in refused] == ["ToolCallRequested", "ToolCallRejected"]
        assert json.loads(refused[1].payload_json)["code"] == "FAILED_PRECONDITION"
        # The call inside its period is whole.
        assert [x.tool_call_id for x in c.query_calls(command_contains="fresh-output").calls] == [fresh.tool_call_id]
        [fresh_art] = [a for a in c.list_artifacts(fresh.tool_call_id) if a.kind == "stdout"]
        sink = io.BytesIO()
        c.download_artifact(fresh_art.artifact_id, sink)
        assert sink.getvalue() == b"fresh-output\n"
    shown = ctl(d, "trace", old.tool_call_id)
    assert shown.returncode == 0 and b"ToolCallExpired" in shown.stdout
    # Its stdout, the file it changed (runs.txt) and the diff.
    assert b"3 artifact(s) and the call's index rows removed" in shown.stdout
