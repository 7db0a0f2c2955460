"""The fake backend's warm-sandbox supervisor: what native/sandbox-shim.c does with
--supervise, in a thread. It connects to the daemon's control socket, says "R", and runs
one command per request: the request's descriptors are the command's stdin, stdout and
stderr, its message "cwd\\0argc\\0argv...\\0envc\\0env...\\0" (and "filec\\0tempdir\\0path...\\0"
with one more descriptor per credential file, which the fake does not place). It answers
"P <pid>" once the command runs and "X <wait status>" when it is over; "K" kills it.
The command runs the fake's script vocabulary (FakeBackend.run)."""

from __future__ import annotations

import array
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable

from sandboxd.sandbox.fake_process import KILLED_EXIT_CODE, FakeProcess
from sandboxd.sandbox.output import STDOUT

__all__ = ["supervise"]

log = logging.getLogger("sandboxd.fake")
# How often the supervisor looks whether its sandbox was killed while it waits.
POLL_S = 0.02
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # the daemon's send buffer for one request
MAX_DESCRIPTORS = 3 + 64

Runner = Callable[[FakeProcess], int]


def supervise(sandbox: FakeProcess, control_path: str, run: Runner) -> int:
    """The warm sandbox's process: serves the daemon until it goes away (exit 0) or the
    sandbox is killed."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    pids = itertools.count(2)  # what "P <pid>" names: the sandbox's init is 1
    try:
        conn.connect(control_path)
        conn.sendall(b"R")
        conn.settimeout(POLL_S)
        while not sandbox.killed.is_set():
            request = _receive(conn)
            if request is None:
                continue
            data, fds = request
            if not data and not fds:
                return 0  # the daemon is gone: so is this sandbox
            if data == b"K" and not fds:
                continue  # a kill that crossed the last command's end
            if not _serve(conn, data, fds, next(pids), sandbox, run):
                return 0
    except OSError as exc:
        log.warning("fake supervisor on %s: %s", control_path, exc)
    finally:
        conn.close()
    return KILLED_EXIT_CODE if sandbox.killed.is_set() else 0


def _receive(conn: socket.socket) -> tuple[bytes, list[int]] | None:
    """One request and its descriptors; None when nothing came within POLL_S."""
    try:
        data, ancdata, _, _ = conn.recvmsg(MAX_REQUEST_BYTES, socket.CMSG_SPACE(MAX_DESCRIPTORS * 4))
    except TimeoutError:
        return None
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            passed = array.array("i")
            passed.frombytes(payload[:len(payload) - len(payload) % passed.itemsize])
            fds += passed.tolist()
    return data, fds


def _parse(data: bytes, descriptors: int) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """(cwd, argv, env) of a request, or ValueError with the shim's refusal."""
    if descriptors < 3:
        raise ValueError("need three descriptors (and one per credential file)")
    try:
        items = [item.decode("utf-8", "surrogateescape") for item in data.split(b"\0")[:-1]]
        cwd, argc = items[0], int(items[1])
        argv = items[2:2 + argc]
        envc = int(items[2 + argc])
        env = items[3 + argc:3 + argc + envc]
        rest = items[3 + argc + envc:]
        files = int(rest[0]) if rest else 0
    except (IndexError, ValueError):
        raise ValueError("malformed request") from None
    if argc <= 0 or len(argv) != argc or len(env) != envc or files != descriptors - 3:
        raise ValueError("malformed request")
    return cwd, tuple(argv), dict(e.partition("=")[::2] for e in env)


def _serve(conn: socket.socket, data: bytes, fds: list[int], pid: int, sandbox: FakeProcess, run: Runner) -> bool:
    """Runs one command to its end; False when the daemon went away meanwhile."""
    try:
        _, argv, _ = _parse(data, len(fds))
    except ValueError as exc:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"E {exc}".encode())
        return True
    for fd in fds[3:]:
        os.close(fd)  # credential files: the fake places none
    stdin_fd, out_fd, err_fd = fds[:3]
    command = FakeProcess(argv, b"", lambda stream, chunk: _write_all(out_fd if stream == STDOUT else err_fd, chunk),
                          lambda: None)
    done = threading.Event()

    def body() -> None:
        try:
            command.stdin = _read_all(stdin_fd)
            command.end(run(command), oom_killed=command.oom_killed)
        finally:
            done.set()

    conn.sendall(f"P {pid}".encode())
    threading.Thread(target=body, daemon=True, name="fake-command").start()
    alive = _watch(conn, command, sandbox, done)
    for fd in (stdin_fd, out_fd, err_fd):  # EOF on its output: the daemon has all of it
        os.close(fd)
    if alive:
        status = command.status
        # A wait status: the signal's number when killed, else the exit code shifted up.
        wait_status = 9 if command.killed.is_set() or status is None else (status.exit_code & 0xFF) << 8
        conn.sendall(f"X {wait_status}".encode())
    return alive


def _watch(conn: socket.socket, command: FakeProcess, sandbox: FakeProcess, done: threading.Event) -> bool:
    """Until the command is over: "K" kills it; the daemon's end or the sandbox's kills
    it too (and then nobody is told). False when the daemon or the sandbox went away."""
    alive = True
    while not done.is_set():
        try:
            message: bytes | None = conn.recv(16)
        except TimeoutError:
            message = None
        if message == b"K":
            command.kill()
        elif message == b"" or sandbox.killed.is_set():
            command.kill()
            alive = False
            done.wait()
    return alive and not sandbox.killed.is_set()


def _read_all(fd: int) -> bytes:
    parts = []
    while chunk := os.read(fd, 1 << 16):
        parts.append(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass  # the daemon stopped reading: the command's output goes nowhere, as in a sandbox
