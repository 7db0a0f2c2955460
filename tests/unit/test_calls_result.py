"""calls/result.py: the ToolResult and the events of a finished call, built from plain
inputs (no store, no clock, no sandbox)."""

from __future__ import annotations

from pathlib import Path

from sandboxd.calls.result import (CallEnd, NetworkRecord, error_result, finished_call, interrupted_call, outcome,
                                   redact_sandbox_strings)
from sandboxd.core.errors import BackendUnavailable
from sandboxd.egress.records import ConnectionRecord
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import ArtifactRecord
from sandboxd.recording import activity
from sandboxd.recording.recorder import FileRecord
from sandboxd.sandbox.output import StreamSummary
from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage

from .conftest import resolve

POLICY = resolve({"process": {"timeoutMs": 1500}})


def summary(stored: int = 0, truncated: bool = False, preview: str = "") -> StreamSummary:
    return StreamSummary(Path("/nowhere"), stored + (10 if truncated else 0), stored, truncated, "sha256:x", preview)


def end(**fields) -> CallEnd:
    base = dict(tool_call_id="tc_1", policy=POLICY, status=ExitStatus(0, "", False), usage=ResourceUsage(7, 4096),
                latency_ms=12, timed_out=False, cancel_reason="", failure=None, stdout=summary(3, preview="hi\n"),
                stderr=summary(), artifacts=[])
    base.update(fields)
    return CallEnd(**base)


def test_the_first_cause_names_the_outcome():
    failure = BackendUnavailable("docker went away")
    assert outcome(POLICY, 0, False, False, "", None, False) == ("success", None)
    assert outcome(POLICY, 0, False, False, "", None, True)[1]["code"] == "OUTPUT_TRUNCATED"
    assert outcome(POLICY, 3, False, False, "", None, True)[1]["code"] == "NONZERO_EXIT"
    assert outcome(POLICY, 137, True, False, "", None, False)[1]["code"] == "OOM_KILLED"
    state, error = outcome(POLICY, 137, True, True, "", None, False)
    assert (state, error["code"], error["message"]) == ("error", "TIMEOUT", "killed after the 1500 ms timeout")
    assert outcome(POLICY, -1, False, True, "", failure, False)[1]["code"] == failure.kind
    assert outcome(POLICY, -1, False, True, "stop", failure, False) == ("cancelled", {
        "code": "CANCELLED", "message": "stop", "retryable": False, "safeToShowUser": True})


def test_a_finished_call_is_recorded_in_order_with_the_ids_given():
    art = ArtifactRecord("art_1", "tc_1", "ev_art", "stdout", "sha256:x", 3, "stdout of tc_1: 3 bytes", "t")
    done = finished_call(end(artifacts=[art]), "ev_fin", "ev_val")
    assert [d.type for d in done.drafts] == [ev.FINISHED, ev.RESULT_VALIDATED, ev.ARTIFACT_PERSISTED]
    assert [d.event_id for d in done.drafts] == ["ev_fin", "ev_val", "ev_art"]
    assert done.finished_id == "ev_fin"
    r = done.result
    assert (r["status"], r["exitCode"], r["stdoutPreview"]) == ("success", 0, "hi\n")
    assert r["usage"] == {"latencyMs": 12, "cpuMs": 7, "peakMemoryBytes": 4096, "outputBytes": 3}
    assert r["provenance"] == {"eventId": "ev_val", "artifactRefs": ["art_1"]}
    assert r["artifacts"][0]["artifactId"] == "art_1" and "error" not in r
    assert done.drafts[1].payload == {"result": r}
    assert done.drafts[0].payload["stdout"] == {"producedBytes": 3, "storedBytes": 3, "sha256": "sha256:x"}


def test_no_status_means_the_command_never_ran():
    done = finished_call(end(status=None, failure=BackendUnavailable("gone"), stdout=summary()), "f", "v")
    assert done.result["exitCode"] == -1 and done.result["signal"] == ""
    assert done.drafts[0].payload["failure"] == "gone"
    assert done.result["status"] == "error" and done.result["error"]["message"] == "gone"


def test_file_and_network_records_come_before_the_end_and_overflow_is_counted():
    files = FileRecord(activity.FileEvents([{"path": "/w/a", "operation": "write"}], [("/w/r", 1)]),
                       ["the kernel's event queue overflowed"])
    net = NetworkRecord([ConnectionRecord("http", "GET", "example.test", 80, decision="denied")], 2,
                        {("a.test", 443, "denied"): (2, 0, 0)})
    done = finished_call(end(files=files, network=net), "f", "v")
    types = [d.type for d in done.drafts]
    assert types[-2:] == [ev.FINISHED, ev.RESULT_VALIDATED]
    assert types.count(ev.NETWORK_ACCESS) == 2 and ev.FILE_ACCESS in types
    assert {"accesses": [], "incomplete": files.incomplete} in [d.payload for d in done.drafts]
    counted = [d.payload for d in done.drafts if d.type == ev.NETWORK_ACCESS and "dropped" in d.payload][0]
    assert counted["byDestination"] == [{"host": "a.test", "port": 443, "decision": "denied", "attempts": 2,
                                         "bytesUp": 0, "bytesDown": 0}]
    assert done.result["effectsObserved"]["incomplete"] == files.incomplete


def test_redaction_strikes_sandbox_strings_but_not_the_daemon_s():
    files = FileRecord(activity.FileEvents([{"path": "/w/SECRET", "operation": "write"}], []), [])
    done = finished_call(end(files=files, failure=BackendUnavailable("no SECRET"), status=None), "f", "v",
                         redact=lambda s: s.replace("SECRET", "[x]"))
    text = repr([d.payload for d in done.drafts])
    assert "SECRET" not in text and "/w/[x]" in text
    assert done.result["error"]["message"] == "no [x]"
    assert done.drafts[-1].payload["result"] is done.result  # the validated result is the redacted one
    same, result = redact_sandbox_strings(done.drafts, done.result, lambda s: s)
    assert result == done.result and [d.payload for d in same] == [d.payload for d in done.drafts]


def test_an_interrupted_call_keeps_what_it_printed():
    art = ArtifactRecord("art_9", "tc_9", "ev_a", "stderr", "sha256:y", 5, "stderr", "t")
    done = interrupted_call("tc_9", [art], "ev_f", "ev_v")
    assert done.drafts[0].payload == {"interrupted": True, "exitCode": -1}
    assert done.result["error"]["code"] == "INTERRUPTED"
    assert done.result["provenance"] == {"eventId": "ev_v", "artifactRefs": ["art_9"]}
    assert [d.event_id for d in done.drafts] == ["ev_f", "ev_v", "ev_a"]
    assert error_result("t", "INTERNAL", "m")["error"] == {"code": "INTERNAL", "message": "m", "retryable": False,
                                                            "safeToShowUser": True}
