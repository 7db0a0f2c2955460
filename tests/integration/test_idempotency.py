"""Idempotency keys: a retried call never runs twice, across restarts and crashes too.
A counter file in the workspace proves how often the command really ran."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from sandboxd_client import errors

from .conftest import call, sh

COUNT = "echo run >> /workspace/out/count; echo runs=$(wc -l < /workspace/out/count)"
POLICY = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]}}


def counting_workspace(d):
    return d.new_workspace({"out/.keep": ""})


def runs(ws) -> int:
    path = ws / "out" / "count"
    return len(path.read_text().splitlines()) if path.exists() else 0


def keyed(ws, key: str, script: str = COUNT, **extra) -> dict:
    c = call(ws, sh(script), POLICY, **extra)
    c["runtime"]["idempotencyKey"] = key
    return c


def test_a_retried_call_runs_once_and_gets_the_first_result(client, daemon):
    ws = counting_workspace(daemon)
    first_id = f"tc-idem-{client.adapter}"
    first = client.run(keyed(ws, f"key-once-{client.adapter}", toolCallId=first_id))
    again = client.run(keyed(ws, f"key-once-{client.adapter}", toolCallId=first_id + "-retry"))
    assert runs(ws) == 1
    assert first.stdout == again.stdout == b"runs=1\n"
    assert again.tool_call_id == first_id and again.result == first.result
    trace = client.get_trace(first_id)
    assert trace[-1].type == "ToolCallReplayed"
    with pytest.raises(errors.NotFound):
        client.get_trace(first_id + "-retry")


def test_the_same_key_for_a_different_call_is_refused(client, daemon):
    ws = counting_workspace(daemon)
    key = f"key-conflict-{client.adapter}"
    first = client.run(keyed(ws, key))
    first_trace = [e.event_id for e in client.get_trace(first.tool_call_id)]
    with pytest.raises(errors.AlreadyExists) as exc:
        client.run(keyed(ws, key, script="echo something else", toolCallId=f"tc-conflict-{client.adapter}"))
    assert "runtime.idempotencyKey" in exc.value.message
    assert runs(ws) == 1
    # The refusal is on record, under an id of its own that the error gives; the first
    # call's trace is untouched.
    refused = client.get_trace(exc.value.tool_call_id)
    assert exc.value.tool_call_id != first.tool_call_id
    assert [e.type for e in refused] == ["ToolCallRequested", "ToolCallRejected"]
    rejected = json.loads(refused[1].payload_json)
    assert (rejected["code"], rejected["field"], rejected["requestedToolCallId"]) == (
        "ALREADY_EXISTS", "runtime.idempotencyKey", f"tc-conflict-{client.adapter}")
    assert first.tool_call_id in rejected["reason"]
    assert [e.event_id for e in client.get_trace(first.tool_call_id)] == first_trace


def test_a_retry_while_running_attaches_to_the_same_call(client, daemon):
    ws = counting_workspace(daemon)
    script = COUNT + "; sleep 2; echo late"
    outcomes = {}

    def first():
        outcomes["first"] = client.run(keyed(ws, f"key-attach-{client.adapter}", script))

    t = threading.Thread(target=first)
    t.start()
    import time

    time.sleep(1.0)
    second = client.run(keyed(ws, f"key-attach-{client.adapter}", script))
    t.join(30)
    assert runs(ws) == 1
    assert second.stdout == outcomes["first"].stdout == b"runs=1\nlate\n"
    assert second.tool_call_id == outcomes["first"].tool_call_id


def test_the_key_survives_a_restart(spare_daemon):
    d = spare_daemon().start()
    ws = counting_workspace(d)
    with d.client() as c:
        first = c.run(keyed(ws, "key-restart"))
    d.stop()
    d.start()
    with d.client() as c:
        again = c.run(keyed(ws, "key-restart"))
    assert runs(ws) == 1 and again.result == first.result


def crash_after_first_output_then_retry(d, client, request):
    """The daemon SIGKILLed once the call has printed, started again, and the call
    retried under its key: the retry's outcome."""
    stream = iter(client.execute(request))
    for event in stream:
        if event.WhichOneof("kind") == "output":
            break
    d.stop(signal.SIGKILL)
    client.close()
    d.start()
    with d.client() as again:
        return again.run(request)


def test_a_call_interrupted_by_a_crash_is_never_run_again(spare_daemon):
    d = spare_daemon().start()
    ws = counting_workspace(d)
    again = crash_after_first_output_then_retry(d, d.client(), keyed(ws, "key-crash", COUNT + "; sleep 60"))
    assert runs(ws) == 1
    assert again.result.status == "error" and again.result.error.code == "INTERRUPTED"
    # What the first attempt printed before the crash was kept, and is what the retry sees.
    assert again.stdout == b"runs=1\n"
    assert [a.kind for a in again.result.artifacts] == ["stdout"]


def test_a_leased_command_interrupted_by_a_crash_keeps_what_it_printed(spare_daemon):
    """A command in a leased sandbox spools its output under the sandbox and the call:
    the restarted daemon finds it there, and the call ends as INTERRUPTED with it."""
    d = spare_daemon(pools={"min_idle": 0, "max_size": 2}).start()
    ws = counting_workspace(d)
    c = d.client()
    request = keyed(ws, "key-leased-crash", COUNT + "; sleep 60")
    request["runtime"]["leaseId"] = c.acquire_sandbox(str(ws), policy=POLICY).lease_id
    again = crash_after_first_output_then_retry(d, c, request)
    assert runs(ws) == 1
    assert again.result.status == "error" and again.result.error.code == "INTERRUPTED"
    assert again.stdout == b"runs=1\n"
