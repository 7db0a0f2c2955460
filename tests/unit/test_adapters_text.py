"""What the agent-framework adapters tell the model, pure: a command's result as compact
text (exit code, each stream's head and tail around a marker naming the artifact, the
call id), a call that failed as a call, the daemon's and the sandbox's refusals, and
the operator's limits checked."""

from __future__ import annotations

import pytest

from sandboxd_client import errors
from sandboxd_client.adapters import ToolLimits
from sandboxd_client.adapters.text import (MIN_OUTPUT_CHARS, argument_text, call_failure, cap_text, refusal_text,
                                           result_text)
from sandboxd_client.sandbox_errors import PathNotWritable
from sandboxd_client.sandbox_result import ArtifactRef, CommandResult, ToolErrorInfo


def result(**fields) -> CommandResult:
    base = {"argv": ("sh", "-c", "x"), "tool_call_id": "tc_1", "status": "success", "exit_code": 0}
    return CommandResult(**(base | fields))


def test_text_that_fits_is_whole():
    text = "x" * MIN_OUTPUT_CHARS
    assert cap_text(text, MIN_OUTPUT_CHARS, stream="stdout", whole_at="w") == text


def test_long_text_keeps_its_head_and_tail_around_a_marker():
    lines = [f"line {i:04d}" for i in range(2000)]
    text = "\n".join(lines) + "\n"
    capped = cap_text(text, 1000, stream="stdout", whole_at="the whole stdout is artifact a1")
    head, marker, rest = capped.partition("[... ")
    marker, _, tail = rest.partition(" ...]\n")
    assert head.startswith("line 0000\n") and tail.endswith("line 1999\n")
    assert len(head) + len(tail) <= 1000  # the limit holds, the marker aside
    # The cut falls on line boundaries: no line is kept in part.
    assert all(line in lines for line in (head + tail).splitlines())
    cut = len(text) - len(head) - len(tail)
    assert marker == f"{cut} characters ({cut // 10} line breaks) cut from the middle of stdout; " \
                     "the whole stdout is artifact a1"


def test_the_cut_counts_the_line_breaks_it_took():
    text = "a" * 600 + "\n" * 10 + "b" * 600
    capped = cap_text(text, 512, stream="stderr", whole_at="w")
    assert "(10 line breaks)" in capped
    assert capped.startswith("a" * 256) and capped.endswith("b" * 256)


def test_a_limit_below_the_minimum_is_refused():
    with pytest.raises(ValueError, match=f"at least {MIN_OUTPUT_CHARS}"):
        cap_text("x", MIN_OUTPUT_CHARS - 1, stream="stdout", whole_at="w")


def test_a_result_says_its_exit_code_its_streams_and_its_call():
    r = result(status="error", exit_code=3, stdout=b"hi\n", stderr=b"oops\n",
               error=ToolErrorInfo("NONZERO_EXIT", "exited with 3"))
    assert call_failure(r) is None  # a command that exited non-zero is an answer
    assert result_text(r, 1000) == "exit code 3 (call tc_1)\n--- stdout ---\nhi\n\n--- stderr ---\noops\n"
    assert result_text(result(), 1000) == "exit code 0 (call tc_1)\n(no output)"
    assert result_text(result(signal="SIGKILL", exit_code=137), 1000).startswith("exit code 137 (SIGKILL) (call tc_1)")


def test_long_output_is_capped_per_stream_naming_its_artifact():
    r = result(stdout=b"o" * 5000, stderr=b"e" * 100,
               artifacts=(ArtifactRef("art_out", "stdout", "", "", 5000),
                          ArtifactRef("art_err", "stderr", "", "", 100)))
    text = result_text(r, 1000)
    assert "the whole stdout is artifact art_out of call tc_1" in text and "4000 characters" in text
    assert text.endswith("--- stderr ---\n" + "e" * 100)
    undecodable = result(stdout=b"\xff\xfe ok")
    assert "\ufffd\ufffd ok" in result_text(undecodable, 1000)


def test_output_the_policy_cut_says_so():
    text = result_text(result(status="partial", stdout=b"x" * 10, stdout_truncated=True), 1000)
    assert "--- stdout (the policy's output cap ended it: the rest was never kept) ---" in text


@pytest.mark.parametrize("fields, why", [
    ({"timed_out": True, "exit_code": -1, "error": ToolErrorInfo("TIMEOUT", "killed after 500 ms")},
     "error: timed out: killed after 500 ms (call tc_1)"),
    ({"oom_killed": True, "exit_code": 137}, "error: killed at its memory limit (call tc_1)"),
    ({"status": "cancelled", "exit_code": -1}, "error: cancelled (call tc_1)"),
    ({"exit_code": -1, "error": ToolErrorInfo("SANDBOX_FAILED", "no image")},
     "error: SANDBOX_FAILED: no image (call tc_1)"),
    ({"exit_code": -1}, "error: ERROR: the sandbox failed before or around the command (call tc_1)"),
])
def test_a_call_that_failed_as_a_call_says_why(fields, why):
    r = result(**({"status": "error", "stderr": b"partial\n"} | fields))
    assert call_failure(r) is not None
    assert result_text(r, 1000).splitlines()[0] == why
    assert "--- stderr ---\npartial" in result_text(r, 1000)  # what it printed before stays


def test_refusals_name_the_code_the_reason_and_the_call():
    assert refusal_text(errors.PermissionDenied("not your workspace", "tc_9")) == \
        "sandboxd refused the call: PERMISSION_DENIED: not your workspace (call tc_9)"
    assert refusal_text(errors.InvalidArgument("argv: too long")) == \
        "sandboxd refused the call: INVALID_ARGUMENT: argv: too long (nothing ran)"
    assert refusal_text(errors.Unavailable("connection refused")).startswith(
        "sandboxd is not answering (connection refused); nothing ran")
    assert refusal_text(PathNotWritable("/etc/x is not under the write roots", "/etc/x")) == \
        "refused: /etc/x is not under the write roots (nothing ran)"
    assert argument_text("timeout_ms", "too long") == "refused: timeout_ms: too long (nothing ran)"


@pytest.mark.parametrize("fields, named", [
    ({"output_chars": MIN_OUTPUT_CHARS - 1}, "output_chars"), ({"output_chars": True}, "output_chars"),
    ({"read_bytes": 0}, "read_bytes"), ({"timeout_ms": -5}, "timeout_ms"), ({"timeout_ms": 1.5}, "timeout_ms"),
])
def test_the_operators_limits_are_checked_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=f"^{named}:"):
        ToolLimits(**fields)
    assert ToolLimits(output_chars=MIN_OUTPUT_CHARS, timeout_ms=1).timeout_ms == 1
