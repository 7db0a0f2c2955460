"""What a command in a Sandbox gives back: CommandResult (the ToolResult's fields under
Python names, with the whole output as bytes), the OutputChunks of a streamed command,
and CommandFailed, which CommandResult.check raises. Pure: no RPC here."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .client import CallOutcome
from .errors import SandboxdClientError
from sandboxd_contract.pb import sandboxd_pb2 as pb

StreamName = Literal["stdout", "stderr"]
_STREAMS: dict[int, StreamName] = {pb.OUTPUT_STREAM_STDOUT: "stdout", pb.OUTPUT_STREAM_STDERR: "stderr"}
# How much of a failed command's stderr (its end) and argv a CommandFailed message shows.
MESSAGE_STDERR_CHARS = 1000
MESSAGE_ARGV_CHARS = 200


@dataclass(frozen=True)
class ToolErrorInfo:
    """Why a result is not a success, as the daemon put it: `code` is one of TIMEOUT,
    OOM_KILLED, NONZERO_EXIT, OUTPUT_TRUNCATED, CANCELLED or the sandbox's failure kind."""

    code: str
    message: str
    retryable: bool = False


@dataclass(frozen=True)
class ArtifactRef:
    """A stored artifact of the command (its stdout, its stderr, a file it changed, the
    diff): fetch one with `sandbox.client.download_artifact(ref.artifact_id, sink)`,
    which checks its sha256. A `file` artifact names its `path` and `change` (created,
    modified, renamed from `previous_path`, or deleted: nothing to download)."""

    artifact_id: str
    kind: str
    uri: str
    content_hash: str
    size_bytes: int
    summary: str = ""
    path: str = ""
    change: str = ""
    previous_path: str = ""
    file_mode: str = ""


@dataclass(frozen=True)
class OutputChunk:
    """Output of a streamed command as it came: `offset` is where `data` starts in its stream."""

    stream: StreamName
    data: bytes
    offset: int = 0

    @property
    def text(self) -> str:
        """`data` as UTF-8 (a character split between chunks shows as U+FFFD in both)."""
        return self.data.decode("utf-8", "replace")


@dataclass(frozen=True, repr=False)
class CommandResult:
    """A finished command. `stdout` and `stderr` are its whole output as stored (secrets
    struck, up to each stream's cap: `stdout_truncated` says it was cut); `raw` is the
    daemon's ToolResult, with what is not copied here (effects_observed, usage, provenance)."""

    argv: tuple[str, ...]
    tool_call_id: str
    status: str
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    oom_killed: bool = False
    signal: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: ToolErrorInfo | None = None
    artifacts: tuple[ArtifactRef, ...] = ()
    raw: pb.ToolResult = field(default_factory=pb.ToolResult, compare=False)

    @property
    def changed_files(self) -> tuple[ArtifactRef, ...]:
        """The files the command created, modified, renamed or deleted in its write roots."""
        return tuple(a for a in self.artifacts if a.kind == "file")

    @property
    def diff(self) -> ArtifactRef | None:
        """Its diff artifact (the text it changed, against the content before), if any."""
        return next((a for a in self.artifacts if a.kind == "diff"), None)

    @classmethod
    def of(cls, argv: Sequence[str], result: pb.ToolResult, stdout: bytes, stderr: bytes,
           tool_call_id: str = "") -> "CommandResult":
        error = None
        if result.HasField("error") and (result.error.code or result.error.message):
            error = ToolErrorInfo(result.error.code, result.error.message, result.error.retryable)
        artifacts = tuple(ArtifactRef(a.artifact_id, a.kind, a.uri, a.content_hash, a.size_bytes, a.summary, a.path,
                                      a.change, a.previous_path, a.file_mode) for a in result.artifacts)
        return cls(tuple(argv), result.tool_call_id or tool_call_id, result.status, result.exit_code, stdout, stderr,
                   result.timed_out, result.oom_killed, result.signal, result.stdout_truncated,
                   result.stderr_truncated, error, artifacts, result)

    @classmethod
    def from_outcome(cls, argv: Sequence[str], outcome: CallOutcome) -> "CommandResult":
        return cls.of(argv, outcome.result, outcome.stdout, outcome.stderr, outcome.tool_call_id)

    @property
    def ok(self) -> bool:
        """The command ran to its end and exited 0 ("partial": its output passed a cap)."""
        return self.status in ("success", "partial") and self.exit_code == 0

    @property
    def text(self) -> str:
        """stdout as UTF-8 (undecodable bytes as U+FFFD)."""
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def check(self) -> "CommandResult":
        """This result if `ok`, else raises CommandFailed (carrying it): for chaining,
        `sb.run([...]).check().text`."""
        if not self.ok:
            raise CommandFailed(failure_message(self), self)
        return self

    def __repr__(self) -> str:
        # The output's sizes, not the output: a repr must stay one short line.
        error = f", error={self.error.code}" if self.error else ""
        return (f"CommandResult(argv={_shown_argv(self.argv)!r}, status={self.status!r}, exit_code={self.exit_code}, "
                f"stdout={len(self.stdout)} bytes, stderr={len(self.stderr)} bytes{error}, "
                f"tool_call_id={self.tool_call_id!r})")


class CommandFailed(SandboxdClientError):
    """A command that did not succeed: it exited non-zero, timed out, was killed for
    memory, was cancelled, or the sandbox failed around it. `result` has everything."""

    def __init__(self, message: str, result: CommandResult):
        super().__init__(message, result.tool_call_id)
        self.result = result


def _shown_argv(argv: Sequence[str]) -> str:
    text = shlex.join(argv)
    return text if len(text) <= MESSAGE_ARGV_CHARS else text[:MESSAGE_ARGV_CHARS - 3] + "..."


def failure_message(result: CommandResult) -> str:
    """One line on why `result` failed (the first cause, as the daemon ranks them), its
    call id, then the end of its stderr."""
    if result.timed_out:
        why = "timed out"
    elif result.oom_killed:
        why = "was killed at its memory limit"
    elif result.status == "cancelled":
        why = "was cancelled"
    elif result.exit_code < 0:
        why = "could not run"
    else:
        why = f"exited with {result.exit_code}"
    detail = f" ({result.error.code}: {result.error.message})" if result.error else ""
    message = f"{_shown_argv(result.argv)} {why}{detail}; call {result.tool_call_id}"
    tail = result.stderr_text.rstrip()
    if tail:
        cut = len(tail) > MESSAGE_STDERR_CHARS
        message += "\nstderr" + (" (its end)" if cut else "") + ":\n" + tail[-MESSAGE_STDERR_CHARS:]
    return message


class StreamCollector:
    """An Execute stream's events made into OutputChunks and, at its end, the command's
    CommandResult (whose output is everything the chunks carried)."""

    def __init__(self, argv: Sequence[str]):
        self.argv = tuple(argv)
        self.tool_call_id = ""
        self.result: CommandResult | None = None
        self._output: dict[StreamName, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}

    def add(self, event: pb.ExecuteEvent) -> OutputChunk | None:
        """The chunk an event carries, if it carries output."""
        self.tool_call_id = self.tool_call_id or event.tool_call_id
        kind = event.WhichOneof("kind")
        if kind == "output":
            name = _STREAMS.get(event.output.stream)
            if name is None:
                raise SandboxdClientError(f"call {self.tool_call_id}: output of an unknown stream "
                                          f"{event.output.stream}", self.tool_call_id)
            self._output[name] += event.output.data
            return OutputChunk(name, event.output.data, event.output.offset)
        if kind == "finished":
            self.result = CommandResult.of(self.argv, event.finished.result, bytes(self._output["stdout"]),
                                           bytes(self._output["stderr"]), self.tool_call_id)
        return None

    @property
    def finished(self) -> bool:
        return self.result is not None

    def final(self) -> CommandResult:
        if self.result is None:
            raise SandboxdClientError(f"call {self.tool_call_id or '(not accepted)'}: the stream ended without a result",
                                      self.tool_call_id)
        return self.result
