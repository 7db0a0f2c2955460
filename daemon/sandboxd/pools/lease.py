"""One command in a leased warm sandbox, run through the sandbox's supervisor: the
Backend protocol for a process in a sandbox that outlives it. create() makes nothing
(the sandbox exists) and destroy() removes nothing: it hands the sandbox back to its
lease when nothing of the command is left in it, and otherwise has it retired."""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Protocol

from sandboxd.core.errors import FailedPrecondition, InternalError
from sandboxd.egress.proxy import EgressProxy
from sandboxd.egress.records import ConnectionRecord
from sandboxd.pools.leftovers import all_alive, sandbox_processes, sandbox_task_count
from sandboxd.pools.supervisor import CommandIO, CommandPipes, command_message, exit_answer, send_command
from sandboxd.pools.warm import WarmSandbox
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage, SandboxHandle

log = logging.getLogger("sandboxd.pools.lease")

NetworkRecords = tuple[list[ConnectionRecord], int, dict[tuple[str, int, str], list[int]]]


@dataclass(frozen=True)
class CommandSpec:
    """What a leased command is: the sandbox exists, so only the process is described."""

    lease_id: str
    sandbox_id: str
    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    timeout_ms: int
    max_stdout_bytes: int
    max_stderr_bytes: int
    temp_dir: str = "/tmp"  # where the command's credential files go

    def to_json_dict(self) -> dict[str, Any]:
        # Flat fields: a shallow copy (asdict's deep copy is paid once per command).
        return {f.name: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v)
                for f in fields(self) for v in (getattr(self, f.name),)}


class SandboxKeeper(Protocol):
    """Who a leased sandbox goes back to after a command (the pool manager)."""

    @property
    def proxy(self) -> EgressProxy | None: ...

    def command_done(self, ws: WarmSandbox, healthy: bool) -> None: ...


class LeaseBackend:
    """The Backend protocol for one command in a leased sandbox, through its supervisor."""

    def __init__(self, pools: SandboxKeeper, ws: WarmSandbox, secret_env: dict[str, str] | None = None,
                 secret_files: dict[str, bytes] | None = None):
        self._pools = pools
        self._ws = ws
        # Credential values for the command's environment: sent to the supervisor only.
        self._secret_env = dict(secret_env or {})
        # sandbox path (under tempDir) -> content: the supervisor writes each for this
        # command only, from a memfd (never a file on the host's disk).
        self._secret_files = dict(secret_files or {})
        self.name = ws.prepared.backend.name
        self._conn: socket.socket | None = None
        self._io: CommandIO | None = None  # the running command's descriptors
        self._status: int | None = None
        self._done = threading.Event()
        self._healthy = True
        # Set when the command's end found nothing of it left in the sandbox: nothing
        # can start another process there until the next command, so destroy() need not
        # look again.
        self._found_clean = False

    def create(self, spec: CommandSpec) -> SandboxHandle:
        return SandboxHandle(self._ws.sandbox_id, self._ws.handle.engine_id, spec)

    def broken(self, why: str) -> InternalError:
        """The sandbox cannot take this command: it is replaced, never leased on."""
        self._healthy = False
        return InternalError(why)

    def network_records(self) -> NetworkRecords:
        """What this command's connections through the sandbox's proxy were (the
        endpoint is emptied for the next command)."""
        proxy = self._pools.proxy
        if self._ws.endpoint is None or proxy is None:
            return [], 0, {}
        return proxy.take_records(self._ws.endpoint)

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        spec: CommandSpec = handle.spec
        if self._ws.endpoint is not None:
            self.network_records()  # anything from before this command is nobody's
        env = {**spec.env, **self._secret_env}
        payload = command_message(spec.cwd, spec.argv, env, spec.temp_dir, tuple(self._secret_files))
        pipes = CommandPipes.open(self._secret_files.values())
        conn = self._ws.control  # the supervisor's own connection: one command at a time
        try:
            answer = send_command(conn, payload, pipes.theirs())
        except OSError as exc:
            pipes.close_ours()
            self._healthy = False
            raise InternalError(f"the sandbox's supervisor did not take the command: {exc}") from None
        finally:
            pipes.close_theirs()
        if not answer.startswith(b"P "):
            pipes.close_ours()
            if not answer:
                self._healthy = False  # the supervisor is gone
                raise InternalError("the sandbox's supervisor is gone")
            # A refusal ("E why"): nothing ran, the supervisor waits for the next command.
            self._done.set()
            raise FailedPrecondition("the sandbox's supervisor refused the command: "
                                     + answer[2:200].decode("utf-8", "replace"))
        self._conn = conn
        in_w = pipes.in_w
        if not stdin:
            os.close(in_w)
            in_w = -1
        # Both output pipes, stdin and the supervisor's answer are served by whoever
        # waits for the command (wait()), on its thread: a thread of their own, and the
        # hand-off back from it, cost a short command a quarter of a millisecond.
        self._io = CommandIO(pipes.out_r, pipes.err_r, in_w, memoryview(stdin), sink, conn.fileno())

    def _serve(self, handle: SandboxHandle, timeout_s: float) -> bool:
        """Moves the command's bytes until it has ended and its output is drained (True)
        or `timeout_s` passes (False)."""
        io = self._io
        assert io is not None
        deadline = time.monotonic() + timeout_s
        last_look = False
        try:
            while io.streams or not self._done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    if last_look:
                        return False
                    last_look = True  # one pass without waiting: what has ended by now counts
                for fd, _ in io.poller.poll(max(0, math.ceil(left * 1000))):
                    if fd == io.conn_fd:
                        self._answer(io)
                    elif fd == io.in_w:
                        io.feed_stdin()
                    elif fd in io.streams:
                        io.drain(fd)
        except OSError as exc:
            log.warning("command channel of %s broke: %s", handle.sandbox_id, exc)
            self._healthy = False
        io.close()
        self._io = None
        handle.output_closed.set()
        self._done.set()
        return True

    def _answer(self, io: CommandIO) -> None:
        """The supervisor's "X <status>" (or its end: the sandbox broke)."""
        assert self._conn is not None
        try:
            answer = self._conn.recv(256)
        except OSError:
            answer = b""
        io.poller.unregister(io.conn_fd)
        status = exit_answer(answer)
        if status is not None:
            self._status = status
            self._kill_leftovers()
        else:
            self._healthy = False
        self._done.set()

    def _kill_leftovers(self) -> None:
        """What the supervisor could not see (nsjail's hidepid hides non-dumpable
        processes) is still in the sandbox's cgroup: killed from outside, by host pid."""
        ws = self._ws
        baseline = ws.baseline_pids
        if baseline is None:
            return
        intact = all_alive(ws.baseline_pidfds)
        if intact and sandbox_task_count(ws.prepared.spec) == len(ws.baseline_pidfds):
            self._found_clean = True  # one read instead of listing the tree (~0.3 ms)
            return
        if ws.baseline_pidfds and not intact:
            log.warning("a process the sandbox %s started with is gone: it is retired after this command",
                        ws.sandbox_id)
            self._healthy = False
        present = sandbox_processes(ws.prepared.spec)
        left = (present or set()) - baseline
        self._found_clean = present is not None and not left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, handle: SandboxHandle, timeout_s: float) -> bool:
        if self._io is None:  # never started, or served to the end already
            return self._done.wait(timeout_s) and handle.output_closed.wait(5.0)
        return self._serve(handle, timeout_s)

    def kill(self, handle: SandboxHandle) -> None:
        if self._conn is not None and not self._done.is_set():
            try:
                self._conn.send(b"K")
            except OSError:
                self._healthy = False

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        status = self._status if self._status is not None else -1
        if status < 0:
            return ExitStatus(-1, "", False), ResourceUsage(0, 0)
        code = os.waitstatus_to_exitcode(status)
        sig = signal.Signals(-code).name if code < 0 else ""
        return ExitStatus(128 - code if code < 0 else code, sig, False), ResourceUsage(0, 0)

    def destroy(self, handle: SandboxHandle) -> None:
        """The sandbox stays (it is the lease's) if nothing of the command is left in it.
        The supervisor kills what it can see; a process it cannot see (nsjail's /proc
        hides non-dumpable ones) still counts in the sandbox's cgroup, and then the
        sandbox is retired rather than handed the next command."""
        healthy = False  # unless shown below: a failure here retires the sandbox
        try:
            if self._io is not None:  # it never ended, not even after SIGKILL: retired
                self._io.close()
                self._io = None
                self._healthy = False
            if self._healthy and self._ws.baseline_pids is not None and not self._found_clean:
                self._await_leftovers_gone(self._ws.baseline_pids)
            healthy = self._healthy and self._done.is_set()
        finally:
            # Always: a sandbox left busy would never be removed, nor leave its pool's count.
            self._pools.command_done(self._ws, healthy)

    def _await_leftovers_gone(self, baseline: set[int]) -> None:
        """Gives what was killed half a second to leave the cgroup; the sandbox is retired
        if anything of the command is still there."""
        deadline = time.monotonic() + 0.5
        while True:
            left = (sandbox_processes(self._ws.prepared.spec) or set()) - baseline
            if not left:
                return
            if time.monotonic() > deadline:
                log.warning("command left %d process(es) in %s: the sandbox is retired", len(left),
                            self._ws.sandbox_id)
                self._healthy = False
                return
            time.sleep(0.01)
