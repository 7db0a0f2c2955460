"""The tools every adapter offers, without any framework: SandboxTools runs a model's
run_command, read_file and write_file in a Sandbox (or AsyncSandbox) the caller opened,
and answers with text for the model, or raises SandboxToolError whose text says why the
call failed or was refused. Each adapter module only wraps these in its framework's tool
type and turns SandboxToolError into the framework's error form.

The adapter never opens a sandbox or chooses a policy: the operator does, when opening
the Sandbox. A model's arguments may ask for less than the operator's policy (a shorter
timeout), never more; nothing here widens it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import errors
from ..sandbox import AsyncSandbox, Sandbox
from ..sandbox_errors import SandboxOutputTruncated
from ..sandbox_files import sandbox_path
from .text import MIN_OUTPUT_CHARS, argument_text, call_failure, refusal_text, result_text

SHELL = "/bin/sh"
T = TypeVar("T")


class SandboxToolError(Exception):
    """A tool call that failed or was refused: `text` is what the model is told (why, and
    the call id when a call was made)."""

    def __init__(self, text: str, tool_call_id: str = ""):
        super().__init__(text)
        self.text = text
        self.tool_call_id = tool_call_id


@dataclass(frozen=True)
class ToolLimits:
    """The operator's caps on what the tools return and take.

    `output_chars`: each stream's text for the model (longer: its head and tail; the
    whole is kept as the call's artifact). `read_bytes`: the largest file read_file
    returns. `timeout_ms`: each command's timeout and the most a model may ask for (None:
    the sandbox policy's timeout, as the daemon resolves it)."""

    output_chars: int = 16_000
    read_bytes: int = 256 * 1024
    timeout_ms: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.output_chars, bool) or not isinstance(self.output_chars, int) \
                or self.output_chars < MIN_OUTPUT_CHARS:
            raise ValueError(f"output_chars: a whole number of characters, at least {MIN_OUTPUT_CHARS}, "
                             f"not {self.output_chars!r}")
        for name in ("read_bytes", "timeout_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: a whole number above 0, not {value!r}")


@dataclass(frozen=True)
class ToolText:
    """A tool's name, its description and each argument's, the same in every framework."""

    name: str
    description: str
    arguments: dict[str, str]


RUN_COMMAND = ToolText(
    "run_command",
    "Run a command in the sandbox (a sandboxd call of its own: policy-checked, recorded, with its own timeout). "
    "The workspace is /workspace; a command's files in /tmp are there for the next command. Answers with the "
    "exit code, stdout and stderr (long output: its head and tail) and the call id. A command that exits "
    "non-zero is an answer, not an error; a timeout or a refused call is an error.",
    {"command": "A shell line (run by /bin/sh -c), or an argv list (run as it is, no shell).",
     "cwd": "The working directory, a sandbox path (default /workspace).",
     "timeout_ms": "This command's timeout in milliseconds: shorter than the sandbox's, never longer "
                   "(default: the sandbox's)."})
READ_FILE = ToolText(
    "read_file",
    "Read a text file in the sandbox (a relative path is under /workspace). Answers with its content.",
    {"path": "The file's sandbox path, e.g. /workspace/README.md."})
WRITE_FILE = ToolText(
    "write_file",
    "Write a text file in the sandbox (replacing it), where the sandbox's policy lets commands write.",
    {"path": "The file's sandbox path, e.g. /workspace/out/notes.txt.",
     "content": "The whole new content (UTF-8 text).",
     "create_dirs": "Make the missing directories above it (default false)."})


def command_argv(command: Any) -> list[str]:
    """A model's `command` as an argv: a string runs under /bin/sh -c, a list as it is."""
    if isinstance(command, str):
        if not command.strip():
            raise SandboxToolError(argument_text("command", "empty; give a shell line or an argv list"))
        if "\x00" in command:
            raise SandboxToolError(argument_text("command", "contains a NUL byte"))
        return [SHELL, "-c", command]
    if not isinstance(command, list) or not command:
        raise SandboxToolError(argument_text("command", "a shell line (a string) or an argv (a non-empty list "
                                                        f"of strings), not {command!r:.80}"))
    for i, item in enumerate(command):
        if not isinstance(item, str) or "\x00" in item:
            raise SandboxToolError(argument_text(f"command[{i}]", "a string without NUL bytes"))
    if not command[0]:
        raise SandboxToolError(argument_text("command[0]", "the program must not be empty"))
    return list(command)


def _checked_path(path: Any, argument: str = "path") -> str:
    try:
        return sandbox_path(path, argument)
    except (TypeError, ValueError) as exc:  # sandbox_path's own checks, naming the argument
        raise SandboxToolError(argument_text(argument, str(exc).removeprefix(f"{argument}: "))) from None


def _checked_cwd(cwd: Any) -> str | None:
    return None if cwd is None else _checked_path(cwd, "cwd")


def _checked_timeout(timeout_ms: Any) -> int | None:
    if timeout_ms is not None and (isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0):
        raise SandboxToolError(argument_text("timeout_ms",
                                             f"a whole number of milliseconds above 0, not {timeout_ms!r}"))
    return timeout_ms


@contextmanager
def _refusals(read_bytes: int = 0) -> Iterator[None]:
    """The daemon's refusals (and the sandbox's, of a file operation) as SandboxToolError:
    the one place they are translated. A file read past `read_bytes` says what to do."""
    try:
        yield
    except SandboxOutputTruncated as exc:
        raise SandboxToolError(f"refused: {exc.path} is larger than the {read_bytes} bytes read_file returns: read "
                               f"parts of it with run_command (head, tail, sed -n) (call {exc.tool_call_id})",
                               exc.tool_call_id) from exc
    except errors.SandboxdClientError as exc:
        raise SandboxToolError(refusal_text(exc), exc.tool_call_id) from exc


def _answer(result: Any, limits: ToolLimits) -> str:
    text = result_text(result, limits.output_chars)
    if call_failure(result) is not None:
        raise SandboxToolError(text, result.tool_call_id)
    return text


def _file_text(path: str, data: bytes) -> str:
    if not data:
        return f"[{path} is empty]"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return f"[{path}: {len(data)} bytes of binary data, not shown: look at it with run_command (od, base64)]"


class SandboxTools:
    """The tools over one opened Sandbox or AsyncSandbox. A sandbox runs one command at
    a time, so its tools wait for each other (a model's parallel calls run in turn).
    Make one SandboxTools per sandbox and every framework tool from it."""

    def __init__(self, sandbox: Sandbox | AsyncSandbox, limits: ToolLimits | None = None):
        if not isinstance(sandbox, (Sandbox, AsyncSandbox)):
            raise TypeError(f"sandbox: an opened sandboxd_client Sandbox or AsyncSandbox, not {type(sandbox).__name__}")
        self.sandbox = sandbox
        self.limits = limits or ToolLimits()
        self._thread_lock = threading.Lock()
        self._async_lock = asyncio.Lock()
        self._lease_timeout_ms: int | None = None

    @property
    def blocking(self) -> bool:
        """A blocking Sandbox (its async tools run it in a worker thread)."""
        return isinstance(self.sandbox, Sandbox)

    def _blocking_sandbox(self) -> Sandbox:
        if not isinstance(self.sandbox, Sandbox):
            raise TypeError("these tools are over an AsyncSandbox: call their async form (or give a Sandbox)")
        return self.sandbox

    def _async_sandbox(self) -> AsyncSandbox:
        assert isinstance(self.sandbox, AsyncSandbox)
        return self.sandbox

    # --- the timeout a model may ask for ---

    def _needs_lease_timeout(self, requested: int | None) -> bool:
        """A model asked for a timeout and only the lease's says how long it may be."""
        return requested is not None and self.limits.timeout_ms is None

    def _timeout(self, requested: int | None, lease_timeout_ms: int | None) -> int | None:
        """The command's timeout: the model's (at most the operator's limit, else the
        lease's), else the operator's limit, else None (the lease's own)."""
        if requested is None:
            return self.limits.timeout_ms
        ceiling = self.limits.timeout_ms or lease_timeout_ms or 0
        if requested > ceiling:
            raise SandboxToolError(argument_text("timeout_ms", f"{requested} ms is more than the {ceiling} ms this "
                                                 "sandbox allows (a call may shorten the timeout, never lengthen it)"))
        return requested

    def _explain_args(self) -> dict[str, Any]:
        s = self.sandbox.settings
        return {"policy": s.policy, "workspace": s.workspace, "image": s.image, "adapter": self.sandbox.backend}

    def _remember_lease_timeout(self, effective_policy_json: str) -> None:
        # 0 (never so in practice) would let a model ask for no timeout at all: refuse all.
        self._lease_timeout_ms = int(json.loads(effective_policy_json).get("timeoutMs") or 0)

    def _blocking_lease_timeout(self) -> int:
        """The lease's timeout as the daemon resolves its policy (asked once)."""
        if self._lease_timeout_ms is None:
            explained = self._blocking_sandbox().client.explain(**self._explain_args())
            self._remember_lease_timeout(explained.effective_policy_json)
        assert self._lease_timeout_ms is not None
        return self._lease_timeout_ms

    async def _async_lease_timeout(self) -> int:
        if self._lease_timeout_ms is None:
            explained = await self._async_sandbox().client.explain(**self._explain_args())
            self._remember_lease_timeout(explained.effective_policy_json)
        assert self._lease_timeout_ms is not None
        return self._lease_timeout_ms

    # --- the tools, blocking ---

    def run_command(self, command: Any, cwd: Any = None, timeout_ms: Any = None) -> str:
        argv, directory, requested = command_argv(command), _checked_cwd(cwd), _checked_timeout(timeout_ms)
        sandbox = self._blocking_sandbox()
        with self._thread_lock, _refusals():
            lease_timeout = self._blocking_lease_timeout() if self._needs_lease_timeout(requested) else None
            result = sandbox.run(argv, cwd=directory, timeout_ms=self._timeout(requested, lease_timeout))
        return _answer(result, self.limits)

    def read_file(self, path: Any) -> str:
        target = _checked_path(path)
        sandbox = self._blocking_sandbox()
        with self._thread_lock, _refusals(self.limits.read_bytes):
            data = sandbox.read_file(target, max_bytes=self.limits.read_bytes)
        return _file_text(target, data)

    def write_file(self, path: Any, content: Any, create_dirs: Any = False) -> str:
        target, data, parents = _checked_path(path), _checked_content(content), _checked_flag(create_dirs)
        sandbox = self._blocking_sandbox()
        with self._thread_lock, _refusals():
            sandbox.write_file(target, data, parents=parents)
        return f"wrote {len(data.encode('utf-8'))} bytes to {target}"

    # --- the tools, async ---

    async def _in_turn(self, blocking: Callable[[], T], awaitable: Callable[[], Awaitable[T]]) -> T:
        """A blocking Sandbox's tool in a worker thread (the event loop goes on), or an
        AsyncSandbox's awaited under the async lock."""
        if self.blocking:
            return await asyncio.to_thread(blocking)
        async with self._async_lock:
            return await awaitable()

    async def arun_command(self, command: Any, cwd: Any = None, timeout_ms: Any = None) -> str:
        argv, directory, requested = command_argv(command), _checked_cwd(cwd), _checked_timeout(timeout_ms)

        async def run() -> str:
            with _refusals():
                lease_timeout = await self._async_lease_timeout() if self._needs_lease_timeout(requested) else None
                timeout = self._timeout(requested, lease_timeout)
                result = await self._async_sandbox().run(argv, cwd=directory, timeout_ms=timeout)
            return _answer(result, self.limits)
        return await self._in_turn(lambda: self.run_command(argv, directory, requested), run)

    async def aread_file(self, path: Any) -> str:
        target = _checked_path(path)

        async def read() -> str:
            with _refusals(self.limits.read_bytes):
                data = await self._async_sandbox().read_file(target, max_bytes=self.limits.read_bytes)
            return _file_text(target, data)
        return await self._in_turn(lambda: self.read_file(target), read)

    async def awrite_file(self, path: Any, content: Any, create_dirs: Any = False) -> str:
        target, data, parents = _checked_path(path), _checked_content(content), _checked_flag(create_dirs)

        async def write() -> str:
            with _refusals():
                await self._async_sandbox().write_file(target, data, parents=parents)
            return f"wrote {len(data.encode('utf-8'))} bytes to {target}"
        return await self._in_turn(lambda: self.write_file(target, data, parents), write)


def _checked_content(content: Any) -> str:
    if not isinstance(content, str):
        raise SandboxToolError(argument_text("content", f"text (a string), not {type(content).__name__}"))
    return content


def _checked_flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise SandboxToolError(argument_text("create_dirs", f"true or false, not {value!r:.40}"))
    return value
