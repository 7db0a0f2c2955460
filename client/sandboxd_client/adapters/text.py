"""What the adapters' tools say to the model: a finished command as compact text (the
exit code, each stream cut to its head and its tail around a marker, the call id), and
why a call failed or was refused. Pure: no framework, no RPC.

Output is cut by characters, not bytes: a model reads text, and a cut between two
characters can never split one."""

from __future__ import annotations

from .. import errors
from ..sandbox_errors import SandboxFileError
from ..sandbox_result import CommandResult

# Below this a limit leaves no room for a useful head and tail beside the marker.
MIN_OUTPUT_CHARS = 256
# A cut moves to a line boundary when one lies within this share of the kept part.
_LINE_SLACK = 4


def cap_text(text: str, limit_chars: int, *, stream: str, whole_at: str) -> str:
    """`text` whole when it fits in `limit_chars`, else its head and tail (half each, moved
    to a line boundary when one is near) around a marker saying how much of `stream` was
    cut and where the whole of it is (`whole_at`)."""
    if limit_chars < MIN_OUTPUT_CHARS:
        raise ValueError(f"an output limit must be at least {MIN_OUTPUT_CHARS} characters, not {limit_chars}")
    if len(text) <= limit_chars:
        return text
    head_size = limit_chars // 2
    tail_size = limit_chars - head_size
    head = text[:head_size]
    newline = head.rfind("\n")
    if newline >= 0 and head_size - newline <= head_size // _LINE_SLACK:
        head = head[:newline + 1]
    tail = text[-tail_size:]
    newline = tail.find("\n")
    if 0 <= newline < tail_size // _LINE_SLACK and newline + 1 < len(tail):
        tail = tail[newline + 1:]
    middle = text[len(head):len(text) - len(tail)]
    marker = (f"[... {len(middle)} characters ({middle.count(chr(10))} line breaks) cut from the middle of {stream}; "
              f"{whole_at} ...]")
    return head + ("" if head.endswith("\n") else "\n") + marker + "\n" + tail


def whole_at(result: CommandResult, stream: str) -> str:
    """Where the whole of a stream is: the call's artifact of that kind."""
    for ref in result.artifacts:
        if ref.kind == stream:
            return f"the whole {stream} is artifact {ref.artifact_id} of call {result.tool_call_id}"
    return f"the whole {stream} was not stored"


def call_failure(result: CommandResult) -> str | None:
    """Why the call failed as a call (it timed out, was killed for memory, was cancelled,
    or the sandbox failed around it), or None: a command that ran to its end and exited
    non-zero did not fail as a call, its exit code is the answer."""
    detail = f": {result.error.message}" if result.error and result.error.message else ""
    if result.timed_out:
        return f"timed out{detail}"
    if result.oom_killed:
        return f"killed at its memory limit{detail}"
    if result.status == "cancelled":
        return f"cancelled{detail}"
    if result.exit_code < 0:
        code = result.error.code if result.error and result.error.code else "ERROR"
        return f"{code}{detail or ': the sandbox failed before or around the command'}"
    return None


def result_text(result: CommandResult, limit_chars: int) -> str:
    """A finished command for the model: a first line (the exit code, or why the call
    failed, and the call id), then each stream that has output, capped."""
    failure = call_failure(result)
    signal = f" ({result.signal})" if result.signal else ""
    lines = [f"error: {failure} (call {result.tool_call_id})" if failure
             else f"exit code {result.exit_code}{signal} (call {result.tool_call_id})"]
    for stream, data, truncated in (("stdout", result.stdout, result.stdout_truncated),
                                    ("stderr", result.stderr, result.stderr_truncated)):
        if not data:
            continue
        note = " (the policy's output cap ended it: the rest was never kept)" if truncated else ""
        text = cap_text(data.decode("utf-8", "replace"), limit_chars, stream=stream, whole_at=whole_at(result, stream))
        lines.append(f"--- {stream}{note} ---\n{text}")
    if len(lines) == 1:
        lines.append("(no output)")
    return "\n".join(lines)


def refusal_text(exc: errors.SandboxdClientError) -> str:
    """A call the daemon refused, or a file operation the sandbox refused, for the model."""
    call = f" (call {exc.tool_call_id})" if exc.tool_call_id else " (nothing ran)"
    if isinstance(exc, SandboxFileError):
        return f"refused: {exc.message}{call}"
    if isinstance(exc, errors.Unavailable):
        return f"sandboxd is not answering ({exc.message}); nothing ran: retry once it is back"
    return f"sandboxd refused the call: {exc.code.name}: {exc.message}{call}"


def argument_text(argument: str, reason: str) -> str:
    """An argument refused before anything was sent."""
    return f"refused: {argument}: {reason} (nothing ran)"
