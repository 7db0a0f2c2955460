"""The control channel to a warm sandbox's supervisor (the shim's `supervisor` mode).

The supervisor calls in once, on a SOCK_SEQPACKET socket only the sandbox's user may
reach, and says "R" when ready. Each command is then one message: NUL-separated fields
(cwd, argc, argv..., envc, env..., and, with credential files, their count, the tempDir
and their paths) carrying the command's stdin, stdout and stderr pipes and a memfd per
credential file. The supervisor answers "P <pid>" once the command runs (or "E <why>"
when it refuses it), "X <wait status>" when it has ended, and takes "K" to kill it."""

from __future__ import annotations

import array
import os
import select
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sandboxd.core.errors import InternalError
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.sandbox.protocol import Backend, SandboxHandle

READY_TIMEOUT_S = 30.0
# How long the supervisor may take to start a command ("P <pid>").
START_TIMEOUT_S = 10.0
# Room for a command's argv and env in one message.
SEND_BUFFER_BYTES = 4 * 1024 * 1024


def control_socket_path(runtime_dir: Path, sandbox_id: str) -> Path:
    """Where `sandbox_id`'s supervisor calls in (its directory made, traversable only)."""
    control_dir = runtime_dir / "control"
    control_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
    os.chmod(control_dir, 0o711)
    return control_dir / f"{sandbox_id}.sock"


@contextmanager
def control_listener(path: Path, uid: int, gid: int) -> Iterator[socket.socket]:
    """A socket only the sandbox's user may reach, accepted once (before any command
    exists) and removed on leaving, so no command can ever stand in for the supervisor
    or open a second channel."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(str(path))
        os.chown(path, uid, gid)
        os.chmod(path, 0o600)
        listener.listen(1)
        yield listener
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def await_supervisor(listener: socket.socket, backend: Backend, handle: SandboxHandle,
                     spool: OutputSpool) -> socket.socket:
    """The supervisor's connection, once it calls in. A sandbox that ends first is
    reported then, not after the whole wait."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    poller = select.poll()  # not select: the daemon's descriptors go past 1023
    poller.register(listener, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise InternalError(f"the supervisor of {handle.sandbox_id} did not call in within {READY_TIMEOUT_S:.0f} s: "
                                f"{spool.summary(STDERR).preview[-300:]!r}")
        if poller.poll(min(left, 0.1) * 1000):
            return listener.accept()[0]
        if backend.wait(handle, 0):
            status, _ = backend.collect(handle)
            raise InternalError(f"the sandbox {handle.sandbox_id} ended before its supervisor called in (exit code "
                                f"{status.exit_code}{', ' + status.signal if status.signal else ''}): "
                                f"{spool.summary(STDERR).preview[-300:]!r}")


def await_ready(conn: socket.socket, sandbox_id: str) -> None:
    """The supervisor's "R"; then the connection blocks, and takes a whole command."""
    conn.settimeout(READY_TIMEOUT_S)
    if conn.recv(16) != b"R":
        raise InternalError(f"the supervisor of {sandbox_id} did not say it was ready")
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


def command_message(cwd: str, argv: Sequence[str], env: Mapping[str, str], temp_dir: str,
                    file_paths: Sequence[str]) -> bytes:
    """A command's fields, as the supervisor reads them."""
    fields = [cwd, str(len(argv)), *argv, str(len(env)), *(f"{k}={v}" for k, v in env.items())]
    if file_paths:
        fields += [str(len(file_paths)), temp_dir, *file_paths]
    return b"\0".join(f.encode("utf-8", "surrogateescape") for f in fields) + b"\0"


def memfd(content: bytes) -> int:
    fd = os.memfd_create("credential", os.MFD_CLOEXEC)
    try:
        os.write(fd, content)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class CommandPipes:
    """A command's three pipes and its credential files' memfds. The supervisor's ends
    go with the command message and are closed here once sent."""

    contents: tuple[int, ...]
    in_r: int
    in_w: int
    out_r: int
    out_w: int
    err_r: int
    err_w: int

    @classmethod
    def open(cls, file_contents: Iterable[bytes]) -> CommandPipes:
        made: list[int] = []
        try:
            for value in file_contents:
                made.append(memfd(value))
            contents = tuple(made)
            for _ in range(3):
                made += os.pipe2(os.O_CLOEXEC)
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        return cls(contents, *made[len(contents):])

    def theirs(self) -> list[int]:
        """What the supervisor is sent, in the order it reads them."""
        return [self.in_r, self.out_w, self.err_w, *self.contents]

    def close_theirs(self) -> None:
        for fd in self.theirs():
            try:
                os.close(fd)
            except OSError:
                pass

    def close_ours(self) -> None:
        for fd in (self.in_w, self.out_r, self.err_r):
            os.close(fd)


def send_command(conn: socket.socket, payload: bytes, fds: list[int]) -> bytes:
    """Sends one command; its answer ("P <pid>", "E <why>", or b"" if the supervisor is
    gone). A supervisor that does not answer in time raises (socket.timeout)."""
    conn.settimeout(START_TIMEOUT_S)  # a supervisor that does not answer is a dead sandbox
    try:
        conn.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        return conn.recv(256)
    finally:
        conn.settimeout(None)


def exit_answer(answer: bytes) -> int | None:
    """The wait status of an "X <status>" answer; None for anything else (the end of the
    connection: the sandbox broke)."""
    return int(answer[2:]) if answer.startswith(b"X ") else None


class CommandIO:
    """A running command's pipes (its stdout, stderr and stdin) and the supervisor's
    socket, polled together."""

    def __init__(self, out_r: int, err_r: int, in_w: int, pending: memoryview, sink: OutputSpool, conn_fd: int):
        self.streams = {out_r: STDOUT, err_r: STDERR}
        self.in_w = in_w
        self.pending = pending
        self.sink = sink
        self.conn_fd = conn_fd
        self.poller = select.poll()
        for fd in self.streams:
            self.poller.register(fd, select.POLLIN)
        self.poller.register(conn_fd, select.POLLIN)
        if in_w >= 0:
            os.set_blocking(in_w, False)
            self.poller.register(in_w, select.POLLOUT)

    def feed_stdin(self) -> None:
        """Writes what stdin still has; closes it once all is written (or unwanted)."""
        try:
            self.pending = self.pending[os.write(self.in_w, self.pending):]
        except BlockingIOError:
            return
        except OSError:
            self.pending = self.pending[:0]  # the command stopped reading
        if not self.pending:
            self.poller.unregister(self.in_w)
            os.close(self.in_w)
            self.in_w = -1

    def drain(self, fd: int) -> None:
        """Moves what an output pipe has to the sink; closes it at its end."""
        data = os.read(fd, 1 << 20)
        if data:
            self.sink.write(self.streams[fd], data)
        else:
            self.poller.unregister(fd)
            os.close(fd)
            del self.streams[fd]

    def close(self) -> None:
        for fd in list(self.streams) + ([self.in_w] if self.in_w >= 0 else []):
            os.close(fd)
        self.streams = {}
        self.in_w = -1
