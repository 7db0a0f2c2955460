"""The high-level client: a Sandbox is a warm sandbox leased for the length of a `with`
block, in which each command is a sandboxd call of its own (its own trace, result,
artifacts and timeout) that starts in milliseconds:

    with Sandbox("/srv/ws/proj", policy={"filesystem": {"writeRoots": ["/workspace"]}}) as sb:
        sb.write_file("/workspace/notes.txt", "hi\\n")
        print(sb.run(["cat", "notes.txt"]).check().text)

The lease is acquired on entry and released on exit, on an exception too. AsyncSandbox is
the same over AsyncSandboxdClient. What a command sends is made in sandbox_call, what it
gives back in sandbox_result, the file operations' commands in sandbox_files."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from . import errors
from .aio import AsyncExecuteStream, AsyncSandboxdClient
from .client import ExecuteStream, SandboxdClient
from .sandbox_call import DEFAULT_TOOL_ID, DEFAULT_WAIT_MS, AcquireWait, Authorizer, SandboxSettings, command_call
from .sandbox_files import (FileCommand, FileEntry, WritableView, list_command, list_outcome, read_command,
                            read_outcome, sandbox_path, write_command, write_outcome)
from .sandbox_errors import PathNotWritable
from .sandbox_result import CommandResult, OutputChunk, StreamCollector
from sandboxd_contract.pb import sandboxd_pb2 as pb

Data = bytes | bytearray | str


class _SandboxBase:
    """What both twins share: settings, the lease held, and the checks made before a send."""

    _client_type: type = object  # the client class each twin works through

    def __init__(self, workspace: str | os.PathLike[str], *, policy: Mapping[str, Any] | pb.SandboxPolicy | None = None,
                 image: str = "", adapter: str = "", socket: str | None = None, client: Any = None,
                 lease_ms: int = 0, wait_ms: int = DEFAULT_WAIT_MS, tool_id: str = DEFAULT_TOOL_ID, session_id: str = "",
                 authorize: Authorizer | None = None):
        """`workspace` is a directory of the daemon's host (seen at /workspace); `policy`
        the SandboxPolicy's JSON form (camelCase), fixed for the lease; `adapter` docker or
        nsjail ("" the daemon's default). Connects to `socket` (default $SANDBOXD_SOCKET,
        else /run/sandboxd/sandboxd.sock) or through `client` (left open at exit).
        `lease_ms`: the lease's length (0: the daemon's default). `wait_ms`: how long to
        wait for the sandbox, when its pool is full or another sandbox that may write
        the workspace still holds it (0: not at all). `authorize` makes each call's
        authorization (a signed grant) for a daemon with approval keys."""
        if socket is not None and client is not None:
            raise ValueError("socket, client: give one of them (or neither: the default socket)")
        if client is not None and not isinstance(client, self._client_type):
            raise TypeError(f"client: {type(self).__name__} takes a {self._client_type.__name__}, "
                            f"not a {type(client).__name__}")
        self.settings = SandboxSettings.checked(workspace, policy, image=image, adapter=adapter, lease_ms=lease_ms,
                                                wait_ms=wait_ms, tool_id=tool_id, session_id=session_id,
                                                authorize=authorize)
        self._socket = socket
        self._given_client = client
        self._client: Any = None
        self._lease: pb.Lease | None = None
        self._writable: WritableView | None = None

    @property
    def lease(self) -> pb.Lease:
        """The lease held (its id, sandbox id, backend, expiry, pool key)."""
        if self._lease is None:
            raise RuntimeError(f"the {type(self).__name__} is not open: use it in a `with` block (or call open())")
        return self._lease

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    @property
    def sandbox_id(self) -> str:
        return self.lease.sandbox_id

    @property
    def backend(self) -> str:
        return self.lease.backend

    def _call(self, argv: Sequence[str], **options: Any) -> dict[str, Any]:
        return command_call(self.settings, self.lease.lease_id, argv, **options)

    def _file_call(self, command: FileCommand) -> dict[str, Any]:
        return self._call(command.argv, stdin=command.stdin, max_stdout_bytes=command.max_stdout_bytes)

    def _explain_args(self) -> dict[str, Any]:
        s = self.settings
        return {"policy": s.policy, "workspace": s.workspace, "image": s.image, "adapter": self.lease.backend}

    def _refuse_unwritable(self, path: str, view: WritableView) -> None:
        refusal = view.refusal(path)
        if refusal is not None:
            raise PathNotWritable(refusal, path)

    def _forget(self) -> tuple[pb.Lease | None, Any]:
        """The lease and the client, no longer this sandbox's (closed or released next)."""
        lease, client = self._lease, self._client
        self._lease, self._client, self._writable = None, None, None
        return lease, client

    def _owned(self, client: Any) -> bool:
        return client is not None and client is not self._given_client


def _note_release_failure(exc: BaseException | None, failure: errors.SandboxdClientError) -> None:
    """A release that failed while an exception leaves the block: the block's exception
    stays the one raised, with the release's failure as a note."""
    if exc is None:
        raise failure
    exc.add_note(f"(releasing the sandbox's lease failed too: {failure})")


class _CommandStreamBase:
    """What both streams share: the collected result and its call id."""

    _collector: StreamCollector

    @property
    def tool_call_id(self) -> str:
        return self._collector.tool_call_id

    @property
    def result(self) -> CommandResult:
        if not self._collector.finished:
            raise RuntimeError("the command has not finished: read the stream to its end first (or wait())")
        return self._collector.final()


class CommandStream(_CommandStreamBase):
    """A running command's output as it comes (`for chunk in stream`: OutputChunks);
    `result` once it has ended. Leaving the loop early, or `cancel()`, cancels it."""

    def __init__(self, events: ExecuteStream, argv: Sequence[str]):
        self._events = events
        self._collector = StreamCollector(argv)
        self._read = False

    def __iter__(self) -> Iterator[OutputChunk]:
        if self._read:
            raise RuntimeError("a command's stream is read once")
        self._read = True
        try:
            for event in self._events:
                chunk = self._collector.add(event)
                if chunk is not None:
                    yield chunk
        finally:
            if not self._collector.finished:
                self._events.cancel()
        self._collector.final()

    def wait(self) -> CommandResult:
        """The result, once the rest of the output (unread) has gone by."""
        if not self._read:
            for _chunk in self:
                pass
        return self.result

    def cancel(self) -> None:
        self._events.cancel()

    def __enter__(self) -> "CommandStream":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._collector.finished:
            self.cancel()


class Sandbox(_SandboxBase):
    """A leased warm sandbox (see the module's docstring); one command at a time."""

    _client_type = SandboxdClient

    def __enter__(self) -> "Sandbox":
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except errors.SandboxdClientError as failure:
            _note_release_failure(exc, failure)

    def open(self) -> "Sandbox":
        """Acquires the lease (what entering the `with` block does)."""
        if self._lease is not None:
            raise RuntimeError("the Sandbox is open already")
        client = self._given_client or SandboxdClient(self._socket)
        s, wait = self.settings, AcquireWait(self.settings.wait_ms)
        try:
            while self._lease is None:
                try:
                    self._lease = client.acquire_sandbox(s.workspace, s.policy, image=s.image, adapter=s.adapter,
                                                         lease_ms=s.lease_ms, wait_ms=wait.remaining_ms())
                except errors.Aborted:  # the workspace is busy for now: the daemon says retry
                    delay = wait.next_delay()
                    if delay is None:
                        raise
                    time.sleep(delay)
        except BaseException:
            if self._owned(client):
                client.close()
            raise
        self._client = client
        return self

    def close(self) -> None:
        """Releases the lease (its sandbox is destroyed) and closes a client of its own."""
        lease, client = self._forget()
        try:
            if lease is not None:
                try:
                    client.release_sandbox(lease.lease_id)
                except errors.NotFound:
                    pass  # expired or drained: its sandbox is gone already
        finally:
            if self._owned(client):
                client.close()

    @property
    def client(self) -> SandboxdClient:
        """The client the lease is held through (traces, artifacts, audit)."""
        self.lease  # noqa: B018 - raises when not open
        return self._client

    def run(self, argv: Sequence[str], *, cwd: str | None = None, timeout_ms: int | None = None,
            stdin: Data | None = None, env: Mapping[str, str] | None = None, check: bool = False) -> CommandResult:
        """Runs `argv` (a list, never a shell line) to its end. `cwd` a sandbox path,
        `timeout_ms` and `env` (added to the policy's injectedEnv) for this command only.
        A failed command is a result (`check=True`, or `.check()`, raises CommandFailed);
        a call the daemon refuses raises its error."""
        call = self._call(argv, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, env=env)
        result = CommandResult.from_outcome(call["argv"], self.client.run(call))
        return result.check() if check else result

    def stream(self, argv: Sequence[str], *, cwd: str | None = None, timeout_ms: int | None = None,
               stdin: Data | None = None, env: Mapping[str, str] | None = None) -> CommandStream:
        """Starts `argv` (as run) and gives its output as it comes."""
        call = self._call(argv, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, env=env)
        return CommandStream(self.client.execute(call), call["argv"])

    def _file_command(self, command: FileCommand) -> CommandResult:
        call = self._file_call(command)
        return CommandResult.from_outcome(call["argv"], self.client.run(call))

    def read_file(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> bytes:
        """A file's content as the sandbox sees it (a relative path is under /workspace)."""
        target = sandbox_path(path)
        return read_outcome(target, self._file_command(read_command(target, max_bytes)))

    def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        return self.read_file(path).decode(encoding)

    def write_file(self, path: str | os.PathLike[str], data: Data, *, parents: bool = False) -> None:
        """Writes `data` (str as UTF-8) to a file under the sandbox's write roots or its
        tempDir, made if missing (`parents`: its directories too). Elsewhere it raises
        PathNotWritable and sends nothing."""
        target = sandbox_path(path)
        command = write_command(target, data, parents)
        if self._writable is None:
            self._writable = WritableView.from_effective_policy(json.loads(
                self.client.explain(**self._explain_args()).effective_policy_json))
        self._refuse_unwritable(target, self._writable)
        write_outcome(target, self._file_command(command))

    def list_files(self, path: str | os.PathLike[str] = "/workspace") -> list[FileEntry]:
        """A directory's entries, sorted by name (links as themselves)."""
        target = sandbox_path(path)
        return list_outcome(target, self._file_command(list_command(target)))


class AsyncCommandStream(_CommandStreamBase):
    """CommandStream's twin: `async for chunk in stream`, then `stream.result`."""

    def __init__(self, events: AsyncExecuteStream, argv: Sequence[str]):
        self._events = events
        self._collector = StreamCollector(argv)
        self._read = False

    async def __aiter__(self) -> AsyncIterator[OutputChunk]:
        if self._read:
            raise RuntimeError("a command's stream is read once")
        self._read = True
        try:
            async for event in self._events:
                chunk = self._collector.add(event)
                if chunk is not None:
                    yield chunk
        finally:
            if not self._collector.finished:
                self._events.cancel()
        self._collector.final()

    async def wait(self) -> CommandResult:
        if not self._read:
            async for _chunk in self:
                pass
        return self.result

    def cancel(self) -> None:
        self._events.cancel()

    async def __aenter__(self) -> "AsyncCommandStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._collector.finished:
            self.cancel()


class AsyncSandbox(_SandboxBase):
    """Sandbox over AsyncSandboxdClient: `async with`, `await sb.run(...)`,
    `async for chunk in sb.stream(...)`; the same arguments and results."""

    _client_type = AsyncSandboxdClient

    async def __aenter__(self) -> "AsyncSandbox":
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.close()
        except errors.SandboxdClientError as failure:
            _note_release_failure(exc, failure)

    async def open(self) -> "AsyncSandbox":
        if self._lease is not None:
            raise RuntimeError("the AsyncSandbox is open already")
        client = self._given_client or AsyncSandboxdClient(self._socket)
        s, wait = self.settings, AcquireWait(self.settings.wait_ms)
        try:
            while self._lease is None:
                try:
                    self._lease = await client.acquire_sandbox(s.workspace, s.policy, image=s.image,
                                                               adapter=s.adapter, lease_ms=s.lease_ms,
                                                               wait_ms=wait.remaining_ms())
                except errors.Aborted:  # the workspace is busy for now: the daemon says retry
                    delay = wait.next_delay()
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)
        except BaseException:
            if self._owned(client):
                await client.close()
            raise
        self._client = client
        return self

    async def close(self) -> None:
        lease, client = self._forget()
        try:
            if lease is not None:
                try:
                    await client.release_sandbox(lease.lease_id)
                except errors.NotFound:
                    pass  # expired or drained: its sandbox is gone already
        finally:
            if self._owned(client):
                await client.close()

    @property
    def client(self) -> AsyncSandboxdClient:
        self.lease  # noqa: B018 - raises when not open
        return self._client

    async def run(self, argv: Sequence[str], *, cwd: str | None = None, timeout_ms: int | None = None,
                  stdin: Data | None = None, env: Mapping[str, str] | None = None,
                  check: bool = False) -> CommandResult:
        call = self._call(argv, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, env=env)
        result = CommandResult.from_outcome(call["argv"], await self.client.run(call))
        return result.check() if check else result

    def stream(self, argv: Sequence[str], *, cwd: str | None = None, timeout_ms: int | None = None,
               stdin: Data | None = None, env: Mapping[str, str] | None = None) -> AsyncCommandStream:
        call = self._call(argv, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, env=env)
        return AsyncCommandStream(self.client.execute(call), call["argv"])

    async def _file_command(self, command: FileCommand) -> CommandResult:
        call = self._file_call(command)
        return CommandResult.from_outcome(call["argv"], await self.client.run(call))

    async def read_file(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> bytes:
        target = sandbox_path(path)
        return read_outcome(target, await self._file_command(read_command(target, max_bytes)))

    async def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        return (await self.read_file(path)).decode(encoding)

    async def write_file(self, path: str | os.PathLike[str], data: Data, *, parents: bool = False) -> None:
        target = sandbox_path(path)
        command = write_command(target, data, parents)
        if self._writable is None:
            self._writable = WritableView.from_effective_policy(json.loads(
                (await self.client.explain(**self._explain_args())).effective_policy_json))
        self._refuse_unwritable(target, self._writable)
        write_outcome(target, await self._file_command(command))

    async def list_files(self, path: str | os.PathLike[str] = "/workspace") -> list[FileEntry]:
        target = sandbox_path(path)
        return list_outcome(target, await self._file_command(list_command(target)))
