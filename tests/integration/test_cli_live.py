"""`sandboxctl ps`, `logs`, `cancel`, `exec --result-json` and `audit --socket` against a
real daemon, and the RPCs under them (ListRunning, StreamOutput) scoped to their caller."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest

from sandboxd_client import errors

from .conftest import call, sh, wait_for
from .test_cli import SANDBOXCTL, ctl
from .test_tenants import ALICE, BOB, client_as


def start(client, c: dict):
    """An Execute stream and its call id, once the command has printed its first line."""
    stream = client.execute(c)
    events = iter(stream)
    call_id = ""
    for event in events:
        call_id = event.tool_call_id
        if event.WhichOneof("kind") == "output":
            break
    return stream, events, call_id


def result_of(events):
    return [e for e in events if e.WhichOneof("kind") == "finished"][-1].finished.result


def test_ps_logs_and_cancel_a_running_call(daemon, client, workspace):
    stream, events, call_id = start(client, call(workspace, sh("echo started; sleep 60")))
    ps = ctl(daemon, "ps")
    assert ps.returncode == 0, ps.stderr
    [row] = [line for line in ps.stdout.decode().splitlines() if call_id in line]
    assert "root" in row and client.adapter in row and "/bin/sh -c 'echo started; sleep 60'" in row
    assert call_id in ctl(daemon, "ps", "-q").stdout.decode().split()
    listed = json.loads(ctl(daemon, "ps", "--json").stdout)
    [mine] = [c for c in listed["calls"] if c["toolCallId"] == call_id]
    assert mine["workspace"] == str(workspace) and mine["backend"] == client.adapter and mine["requestedAt"]

    # Without -f: what there is now, while the call runs on.
    t0 = time.monotonic()
    now = ctl(daemon, "logs", call_id, timeout=30)
    assert (now.returncode, now.stdout) == (0, b"started\n") and time.monotonic() - t0 < 20

    cancelled = ctl(daemon, "cancel", call_id, "--reason", "from the test")
    assert (cancelled.returncode, cancelled.stdout) == (0, call_id.encode() + b"\n"), cancelled.stderr
    result = result_of(events)
    assert result.status == "cancelled" and "from the test" in result.error.message
    assert call_id not in ctl(daemon, "ps", "-q").stdout.decode()
    again = ctl(daemon, "cancel", call_id)
    assert again.returncode == 1 and b"already finished" in again.stderr
    unknown = ctl(daemon, "cancel", "tc_does_not_exist")
    assert unknown.returncode == 1 and b"NOT_FOUND" in unknown.stderr


def test_logs_follow_a_running_call_to_its_end(daemon, client, workspace):
    script = "for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; sleep 0.3; done; exit 3"
    stream, events, call_id = start(client, call(workspace, sh(script)))
    # SIGINT as a terminal gives it: a runner that started the suite in the background
    # (CI) has SIGINT ignored, and an ignored signal stays ignored across exec.
    follower = subprocess.Popen([SANDBOXCTL, "--socket", str(daemon.socket), "logs", "-f", call_id],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert out == b"".join(b"out%d\n" % i for i in range(1, 6))
    assert err == b"".join(b"err%d\n" % i for i in range(1, 6))
    # It ended with the call (its result was recorded before the stream ended).
    assert any(e.type == "ToolCallFinished" for e in client.get_trace(call_id))
    assert result_of(events).exit_code == 3  # the first caller's stream is untouched


def test_a_follower_that_goes_away_cancels_nothing(daemon, client, workspace):
    stream, events, call_id = start(client, call(workspace, sh("echo one; sleep 2; echo two")))
    # SIGINT as a terminal gives it: a runner that started the suite in the background
    # (CI) has SIGINT ignored, and an ignored signal stays ignored across exec.
    follower = subprocess.Popen([SANDBOXCTL, "--socket", str(daemon.socket), "logs", "-f", call_id],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert follower.stdout.readline() == b"one\n"
    follower.send_signal(signal.SIGINT)
    assert follower.wait(30) == 130
    result = result_of(events)
    assert result.status == "success" and result.stdout_preview == "one\ntwo\n"


def test_logs_of_a_finished_call_from_its_stored_output(daemon, client, workspace):
    done = client.run(call(workspace, sh("printf 0123456789; printf abcdef >&2")))
    for flags in ([], ["-f"]):
        p = ctl(daemon, "logs", *flags, done.tool_call_id)
        assert (p.returncode, p.stdout, p.stderr) == (0, b"0123456789", b"abcdef")
    p = ctl(daemon, "logs", "--since-byte", "4", done.tool_call_id)
    assert (p.stdout, p.stderr) == (b"456789", b"ef")
    p = ctl(daemon, "logs", "--since-byte", "100", done.tool_call_id)
    assert (p.returncode, p.stdout, p.stderr) == (0, b"", b"")
    missing = ctl(daemon, "logs", "tc_does_not_exist")
    assert missing.returncode == 1 and b"NOT_FOUND" in missing.stderr


def test_logs_of_a_refused_call_says_it_never_ran(daemon, tmp_path):
    refused = ctl(daemon, "exec", "--workspace", str(tmp_path), "--", "true")
    assert refused.returncode == 125
    call_id = re.search(rb"\(call (tc[_-][\w-]+)\)", refused.stderr).group(1).decode()
    p = ctl(daemon, "logs", call_id)
    assert p.returncode == 1 and b"FAILED_PRECONDITION" in p.stderr and b"never ran" in p.stderr


def test_result_json_keeps_the_result_out_of_stdout(daemon, workspace, tmp_path):
    target = tmp_path / "result.json"
    p = ctl(daemon, "exec", "--result-json", str(target), "--workspace", str(workspace), "--",
            "sh", "-c", "echo out; exit 3")
    assert (p.returncode, p.stdout) == (3, b"out\n"), p.stderr
    result = json.loads(target.read_text())
    assert result["exitCode"] == 3 and result["status"] == "error" and result["stdoutPreview"] == "out\n"
    assert result["toolCallId"] and {a["kind"] for a in result["artifacts"]} == {"stdout"}


def test_audit_takes_socket_after_the_command(daemon, workspace):
    done = ctl(daemon, "exec", "--result-json", str(workspace.parent / "audit-result.json"),
               "--workspace", str(workspace), "--", "true")
    assert done.returncode == 0
    p = subprocess.run([SANDBOXCTL, "audit", "--socket", str(daemon.socket), "--limit", "5", "--json"],
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    call_id = json.loads((workspace.parent / "audit-result.json").read_text())["toolCallId"]
    assert call_id in [json.loads(line).get("toolCallId") for line in p.stdout.splitlines()]


@pytest.fixture
def tenants_with_pools(spare_daemon):
    return spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, admins=["root"], socket_mode=0o666,
                        pools={"min_idle": 0, "max_size": 2}).start()


def test_running_calls_leases_and_output_are_their_principals_own(tenants_with_pools):
    d = tenants_with_pools
    ws = d.new_workspace({"a.txt": "alice\n"}, uid=ALICE)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob, client_as(d, 0) as root:
        lease = alice.acquire_sandbox(str(ws))
        in_lease = call(ws, sh("echo leased; sleep 30"))
        in_lease["runtime"]["leaseId"] = lease.lease_id
        leased_stream, leased_events, leased_id = start(alice, in_lease)
        fresh_stream, fresh_events, fresh_id = start(alice, call(ws, sh("echo fresh; sleep 30")))

        mine = alice.list_running()
        assert {c.tool_call_id for c in mine.calls} == {leased_id, fresh_id}
        assert {c.tool_call_id: c.lease_id for c in mine.calls}[leased_id] == lease.lease_id
        [held] = mine.leases
        assert (held.lease.lease_id, held.principal, held.tool_call_id) == (lease.lease_id, "alice", leased_id)
        assert held.workspace == str(ws)

        # Bob sees none of it, and cannot read her output: as if it did not exist.
        theirs = bob.list_running()
        assert list(theirs.calls) == [] and list(theirs.leases) == []
        with pytest.raises(errors.NotFound):
            list(bob.stream_output(fresh_id, follow=True))
        # The admin sees everyone's, through sandboxctl too.
        assert {c.tool_call_id for c in root.list_running().calls} == {leased_id, fresh_id}
        ps = ctl(d, "ps").stdout.decode()
        assert lease.lease_id in ps and fresh_id in ps

        # A second reader of her own call, from another connection: its output so far.
        events = list(alice.stream_output(fresh_id))
        assert [e.output.data for e in events if e.WhichOneof("kind") == "output"] == [b"fresh\n"]
        for call_id in (leased_id, fresh_id):
            assert alice.cancel(call_id)
        result_of(leased_events), result_of(fresh_events)
        alice.release_sandbox(lease.lease_id)
        assert wait_for(lambda: not alice.list_running().leases and not alice.list_running().calls)
