"""sandboxd-mcp's tools made into calls, and calls' results made into answers (pure: no
daemon, no SDK session): what each tool runs, the caps on what goes in, the annotations
the policy makes true, and how a timeout, a refusal or a cut output reads."""

from __future__ import annotations

import pytest

from sandboxd_client.client import CallOutcome
from sandboxd_client.mcp.narrowing import OperatorPolicy, Refusal
from sandboxd_client.mcp.results import command_reply, list_reply, read_reply, search_reply, write_reply
from sandboxd_client.mcp.tools import (EXIT_OUTSIDE, EXIT_TOO_LARGE, READ_SCRIPT, SH, ToolLimits, TooLarge, plan,
                                       tool_specs)
from sandboxd_contract.pb import sandboxd_pb2 as pb

WRITABLE = OperatorPolicy.of({"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["out"]},
                              "process": {"timeoutMs": 20_000}}, 60_000)
READ_ONLY = OperatorPolicy.of({"network": {"egress": "allowlist", "allowDomains": ["pypi.org"]}}, 60_000)
LIMITS = ToolLimits(output_bytes=1024, read_bytes=100, write_bytes=10)


def outcome(exit_code=0, stdout=b"", stderr=b"", **result) -> CallOutcome:
    artifacts = [pb.ArtifactRef(artifact_id="art_out", kind="stdout", size_bytes=len(stdout)),
                 pb.ArtifactRef(artifact_id="art_err", kind="stderr", size_bytes=len(stderr))]
    return CallOutcome("call_1", pb.ToolResult(tool_call_id="call_1", exit_code=exit_code, artifacts=artifacts,
                                               **result), stdout, stderr)


def test_tools_and_their_annotations_follow_the_operators_policy():
    specs = {s.name: s for s in tool_specs(WRITABLE, LIMITS)}
    assert list(specs) == ["run_command", "read_file", "write_file", "list_files", "search_files"]
    assert specs["run_command"].destructive and not specs["run_command"].read_only
    assert not specs["run_command"].open_world
    assert specs["write_file"].destructive and "/workspace/out" in specs["write_file"].description
    for name in ("read_file", "list_files", "search_files"):
        assert specs[name].read_only and not specs[name].destructive
    ro = {s.name: s for s in tool_specs(READ_ONLY, LIMITS)}
    assert "write_file" not in ro  # nothing it could write: not offered
    assert not ro["run_command"].destructive and ro["run_command"].open_world


def test_run_command_takes_an_argv_or_a_shell_string():
    p = plan("run_command", WRITABLE, LIMITS, {"command": ["ls", "-l"], "cwd": "src", "timeout_ms": 500})
    assert (p.argv, p.cwd, p.timeout_ms, p.stdin) == (["ls", "-l"], "/workspace/src", 500, b"")
    p = plan("run_command", WRITABLE, LIMITS, {"command": "echo $HOME | wc -c", "stdin": "0123456789"})
    assert p.argv == [SH, "-c", "echo $HOME | wc -c"] and p.timeout_ms == 20_000 and p.stdin == b"0123456789"
    assert p.cwd == ""  # the policy's own (/workspace unless it says otherwise)
    with pytest.raises(TooLarge) as big:
        plan("run_command", WRITABLE, LIMITS, {"command": "cat", "stdin": "01234567890"})
    assert (big.value.argument, big.value.size, big.value.cap) == ("stdin", 11, 10)
    with pytest.raises(Refusal) as wider:
        plan("run_command", WRITABLE, LIMITS, {"command": "sleep 30", "timeout_ms": 20_001})
    assert wider.value.argument == "timeout_ms"
    with pytest.raises(Refusal) as out:
        plan("run_command", WRITABLE, LIMITS, {"command": "ls", "cwd": "../.."})
    assert out.value.argument == "cwd"


def test_file_tools_run_their_scripts_on_checked_paths():
    p = plan("read_file", WRITABLE, LIMITS, {"path": "src/../a.txt"})
    assert p.argv == [SH, "-c", READ_SCRIPT, "sh", "/workspace/a.txt", "100"] and p.max_stdout_bytes == 101
    assert p.timeout_ms == 20_000  # the file tools' 30 s, never above the operator's
    w = plan("write_file", WRITABLE, LIMITS, {"path": "out/new.txt", "content": "0123456789", "create_dirs": True})
    assert w.argv[-2:] == ["/workspace/out/new.txt", "1"] and w.stdin == b"0123456789"
    with pytest.raises(TooLarge) as big:
        plan("write_file", WRITABLE, LIMITS, {"path": "out/new.txt", "content": "é" * 6})
    assert big.value.size == 12 and big.value.argument == "content"
    with pytest.raises(Refusal) as outside:
        plan("write_file", WRITABLE, LIMITS, {"path": "README.md", "content": "x"})
    assert outside.value.argument == "path" and "write roots" in outside.value.reason
    s = plan("search_files", WRITABLE, LIMITS, {"pattern": "-e", "ignore_case": True, "glob": "*.py"})
    assert s.argv[4:] == ["-e", "/workspace", "0", "1", "*.py"]
    assert plan("list_files", WRITABLE, LIMITS, {"max_depth": 3}).argv[-2:] == ["/workspace", "3"]


def test_a_command_result_keeps_the_exit_code_and_cuts_long_output():
    long = b"".join(f"{i}\n".encode() for i in range(5000))
    reply = command_reply(outcome(3, long, b"oops\n", status="error",
                                  error=pb.ToolError(code="NONZERO_EXIT", message="exited with 3")), 1024)
    assert not reply.is_error and reply.text.startswith("exit code 3 (call call_1)")
    s = reply.structured
    assert s["exit_code"] == 3 and s["stdout_bytes"] == len(long) and s["stdout_cut_bytes"] > 0
    assert s["stdout"].startswith("0\n1\n") and s["stdout"].endswith("4999\n")
    assert "sandboxd://artifacts/art_out" in s["stdout"] and s["stderr"] == "oops\n"
    assert {a["uri"] for a in s["artifacts"]} == {"sandboxd://artifacts/art_out", "sandboxd://artifacts/art_err"}


@pytest.mark.parametrize("result,expect", [
    ({"timed_out": True, "exit_code": 137, "error": pb.ToolError(code="TIMEOUT", message="killed after 300 ms")},
     "timed out: killed after 300 ms"),
    ({"oom_killed": True, "exit_code": 137, "error": pb.ToolError(code="OOM_KILLED", message="at 64 MB")},
     "killed for memory: at 64 MB"),
    ({"exit_code": -1, "error": pb.ToolError(code="SANDBOX_FAILED", message="no image")}, "SANDBOX_FAILED: no image"),
])
def test_a_timeout_a_memory_kill_and_a_failed_sandbox_are_errors_with_their_reason(result, expect):
    code = result.pop("exit_code")
    reply = command_reply(outcome(code, b"partial\n", status="error", **result), 1024)
    assert reply.is_error and reply.text.startswith(f"error: {expect}") and reply.structured["stdout"] == "partial\n"


def test_a_scripts_refusal_reads_as_a_refusal():
    p = plan("read_file", WRITABLE, LIMITS, {"path": "link"})
    reply = read_reply(outcome(EXIT_OUTSIDE, stderr=b"sandboxd-mcp: /workspace/link leads outside the workspace "
                                                    b"(to /etc/passwd)\n", status="error"), p, 100)
    assert reply.is_error and reply.structured["refusal"]["code"] == "outside_workspace"
    assert reply.text.startswith("refused: /workspace/link leads outside the workspace")
    big = read_reply(outcome(EXIT_TOO_LARGE, stderr=b"sandboxd-mcp: too big\n", status="error"), p, 100)
    assert big.structured["refusal"] == {"code": "too_large", "reason": "too big"}
    failed = write_reply(outcome(1, stderr=b"cat: write error\n", status="error"),
                         plan("write_file", WRITABLE, LIMITS, {"path": "out/a", "content": "x"}))
    assert failed.is_error and "exited with 1" in failed.text and "write error" in failed.text


def test_file_answers():
    p = plan("read_file", WRITABLE, LIMITS, {"path": "a.txt"})
    text = read_reply(outcome(0, "héllo\n".encode()), p, 100)
    assert not text.is_error and text.text == "héllo\n" and text.structured["encoding"] == "utf-8"
    binary = read_reply(outcome(0, b"\xff\x00"), p, 100)
    assert binary.structured == binary.structured | {"encoding": "base64", "content": "/wA="}
    grew = read_reply(outcome(0, b"x" * 101), p, 100)
    assert grew.is_error and grew.structured["refusal"]["code"] == "too_large"
    listing = list_reply(outcome(0, b"d 4096 src\0f 12 src/app.py\0l 7 link\0"),
                         plan("list_files", WRITABLE, LIMITS, {}), 2)
    assert [e["path"] for e in listing.structured["entries"]] == ["link", "src"]
    assert listing.structured["entries_cut"] == 1 and "1 more entries" in listing.text
    none = search_reply(outcome(1, status="error"), plan("search_files", WRITABLE, LIMITS, {"pattern": "x"}), 1024)
    assert not none.is_error and none.text == "no matches under /workspace"
