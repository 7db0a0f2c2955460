"""One command in a leased warm sandbox, run through the sandbox's supervisor. The warm
sandbox outlives its commands: each call sees it as a `LeaseSandbox` (the Sandbox
protocol), whose start() runs the call's command as a `LeasedCommand` (a Process) and
whose destroy() removes nothing: it hands the sandbox back to its lease when nothing of
the command is left in it, and otherwise has it retired."""

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
from sandboxd.pools.leftovers import kill_leftovers, oom_kills, sandbox_processes
from sandboxd.pools.supervisor import CommandIO, CommandPipes, command_message, exit_answer, send_command
from sandboxd.pools.warm import WarmSandbox
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage

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


class LeaseSandbox:
    """One call's view of its leased warm sandbox (the Sandbox protocol): start() runs the
    call's command through the supervisor; destroy() hands the sandbox back to the lease,
    or has it retired if the command broke it or left something in it."""

    def __init__(self, keeper: SandboxKeeper, ws: WarmSandbox, command: CommandSpec,
                 secret_env: dict[str, str] | None = None, secret_files: dict[str, bytes] | None = None):
        self._keeper = keeper
        self.warm = ws
        self._command = command
        # Credential values for the command's environment: sent to the supervisor only.
        self._secret_env = dict(secret_env or {})
        # sandbox path (under tempDir) -> content: the supervisor writes each for this
        # command only, from a memfd (never a file on the host's disk).
        self._secret_files = dict(secret_files or {})
        self.healthy = True  # False: the sandbox is retired after this call, never leased on
        self._process: LeasedCommand | None = None
        self._refused = False  # the supervisor refused the command: nothing ran
        self._given_back = False

    @property
    def sandbox_id(self) -> str:
        return self.warm.sandbox_id

    @property
    def engine_id(self) -> str:
        return self.warm.handle.engine_id

    @property
    def spec(self) -> CommandSpec:
        return self._command

    def broken(self, why: str) -> InternalError:
        """The sandbox cannot take this command: it is replaced, never leased on."""
        self.healthy = False
        return InternalError(why)

    def network_records(self) -> NetworkRecords:
        """What this command's connections through the sandbox's proxy were (the
        endpoint is emptied for the next command)."""
        proxy = self._keeper.proxy
        if self.warm.endpoint is None or proxy is None:
            return [], 0, {}
        return proxy.take_records(self.warm.endpoint)

    def start(self, spool: OutputSpool, stdin: bytes) -> LeasedCommand:
        spec, ws = self._command, self.warm
        if ws.endpoint is not None:
            self.network_records()  # anything from before this command is nobody's
        env = {**spec.env, **self._secret_env}
        payload = command_message(spec.cwd, spec.argv, env, spec.temp_dir, tuple(self._secret_files))
        pipes = CommandPipes.open(self._secret_files.values())
        conn = ws.control  # the supervisor's own connection: one command at a time
        try:
            answer = send_command(conn, payload, pipes.theirs())
        except OSError as exc:
            pipes.close_ours()
            self.healthy = False
            raise InternalError(f"the sandbox's supervisor did not take the command: {exc}") from None
        finally:
            pipes.close_theirs()
        if not answer.startswith(b"P "):
            pipes.close_ours()
            if not answer:
                self.healthy = False  # the supervisor is gone
                raise InternalError("the sandbox's supervisor is gone")
            # A refusal ("E why"): nothing ran, the supervisor waits for the next command.
            self._refused = True
            raise FailedPrecondition("the sandbox's supervisor refused the command: "
                                     + answer[2:200].decode("utf-8", "replace"))
        in_w = pipes.in_w
        if not stdin:
            os.close(in_w)
            in_w = -1
        # Both output pipes, stdin and the supervisor's answer are served by whoever
        # waits for the command (wait()), on its thread: a thread of their own, and the
        # hand-off back from it, cost a short command a quarter of a millisecond.
        io = CommandIO(pipes.out_r, pipes.err_r, in_w, memoryview(stdin), spool, conn.fileno())
        self._process = LeasedCommand(self, conn, io)
        return self._process

    def destroy(self) -> None:
        """The sandbox stays (it is the lease's) if nothing of the command is left in it.
        The supervisor kills what it can see; a process it cannot see (nsjail's /proc
        hides non-dumpable ones) still counts in the sandbox's cgroup, and then the
        sandbox is retired rather than handed the next command. Once: a second call is nothing."""
        if self._given_back:
            return
        self._given_back = True
        healthy = False  # unless shown below: a failure here retires the sandbox
        try:
            process = self._process
            if process is None:
                healthy = self.healthy and self._refused
            else:
                self._process = None
                ended = process.finish()
                healthy = self.healthy and ended
        finally:
            # Always: a sandbox left busy would never be removed, nor leave its pool's count.
            self._keeper.command_done(self.warm, healthy)


class LeasedCommand:
    """A command the supervisor of a leased sandbox spawned (the Process protocol); its
    bytes are moved by whoever waits for it, on that thread."""

    def __init__(self, sandbox: LeaseSandbox, conn: socket.socket, io: CommandIO):
        self._sandbox = sandbox
        self._ws = sandbox.warm
        self._conn = conn
        self._io: CommandIO | None = io  # its descriptors, until it ended and was drained
        self._status: int | None = None
        self._done = threading.Event()
        self._output_closed = threading.Event()
        # Set when the command's end found nothing of it left in the sandbox: nothing
        # can start another process there until the next command, so finish() need not
        # look again.
        self._found_clean = False

    def _unhealthy(self) -> None:
        self._sandbox.healthy = False

    def wait(self, timeout_s: float) -> bool:
        if self._io is None:  # served to the end already
            return self._done.wait(timeout_s) and self._output_closed.wait(5.0)
        return self._serve(timeout_s)

    def _serve(self, timeout_s: float) -> bool:
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
            log.warning("command channel of %s broke: %s", self._ws.sandbox_id, exc)
            self._unhealthy()
        io.close()
        self._io = None
        self._output_closed.set()
        self._done.set()
        return True

    def _answer(self, io: CommandIO) -> None:
        """The supervisor's "X <status>" (or its end: the sandbox broke)."""
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
            self._unhealthy()
        self._done.set()

    def _kill_leftovers(self) -> None:
        ws = self._ws
        if ws.baseline_pids is None:
            return
        check = kill_leftovers(ws.baseline_pids, ws.baseline_pidfds, ws.prepared.spec)
        if not check.intact:
            log.warning("a process the sandbox %s started with is gone: it is retired after this command",
                        ws.sandbox_id)
            self._unhealthy()
        self._found_clean = check.clean

    def kill(self) -> None:
        if not self._done.is_set():
            try:
                self._conn.send(b"K")
            except OSError:
                self._unhealthy()

    def collect(self) -> tuple[ExitStatus, ResourceUsage]:
        # Only this command ran in the sandbox since its last command's count.
        ws = self._ws
        now = oom_kills(ws.oom_kill_files)
        oom_killed, ws.oom_kills_seen = now > ws.oom_kills_seen, now
        status = self._status if self._status is not None else -1
        if status < 0:
            return ExitStatus(-1, "", oom_killed), ResourceUsage(0, 0)
        code = os.waitstatus_to_exitcode(status)
        sig = signal.Signals(-code).name if code < 0 else ""
        return ExitStatus(128 - code if code < 0 else code, sig, oom_killed), ResourceUsage(0, 0)

    def pid(self) -> int:
        return self._ws.init_pid()

    def output_ended(self) -> bool:
        return self._output_closed.is_set()

    def finish(self) -> bool:
        """Whether the command ended leaving nothing of it in the sandbox (its descriptors
        closed either way)."""
        if self._io is not None:  # it never ended, not even after SIGKILL: retired
            self._io.close()
            self._io = None
            self._unhealthy()
        if self._sandbox.healthy and self._ws.baseline_pids is not None and not self._found_clean:
            self._await_leftovers_gone(self._ws.baseline_pids)
        return self._sandbox.healthy and self._done.is_set()

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
                self._unhealthy()
                return
            time.sleep(0.01)
