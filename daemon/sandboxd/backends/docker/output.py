"""A Docker sandbox's output on its way to the daemon: the multiplexed frames of the
attach socket, and the two FIFOs the shim makes the command's stdout and stderr (read
directly, bypassing the engine's own copy of the output)."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import shutil
import time

from sandboxd.core.errors import InternalError
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.sandbox.protocol import SandboxHandle

log = logging.getLogger("sandboxd.docker")
_FIFO_READ_BYTES = 1 << 20
# How long output FIFOs stay open after their container has ended (pump_fifos).
WRITER_GRACE_S = 0.5


def parse_frames(buf: bytes | bytearray | memoryview, sink: OutputSpool) -> int:
    """Writes every complete multiplexed frame of `buf` into `sink`; returns the number
    of bytes consumed. Frame: 1 byte stream, 3 zero bytes, 4 bytes big-endian size.
    Consecutive frames of one stream go to the sink as one write."""
    view = memoryview(buf)
    pos, end = 0, len(view)
    run_stream = 0
    run_parts: list[bytes | memoryview] = []
    while end - pos >= 8:
        size = int.from_bytes(view[pos + 4:pos + 8], "big")
        if end - pos - 8 < size:
            break
        stream = STDERR if view[pos] == 2 else STDOUT
        if stream != run_stream and run_parts:
            sink.write_parts(run_stream, run_parts)
            run_parts = []
        run_stream = stream
        run_parts.append(view[pos + 8:pos + 8 + size])
        pos += 8 + size
    if run_parts:
        sink.write_parts(run_stream, run_parts)
    return pos


def frame_size_needed(buf: bytes | bytearray | memoryview) -> int:
    """Bytes the frame at the start of `buf` needs in all (0 if its header is incomplete)."""
    if len(buf) < 8:
        return 0
    return 8 + int.from_bytes(bytes(buf[4:8]), "big")


def make_stdio_fifos(directory: str, uid: int, gid: int) -> None:
    """A sandbox's stdout and stderr FIFOs, which its user can write and not read. The directory is
    bound read-only into the sandbox, so they cannot be replaced or re-moded from it."""
    remove_stdio_fifos(directory)
    os.mkdir(directory, 0o711)
    for name in ("stdout", "stderr"):
        path = os.path.join(directory, name)
        os.mkfifo(path, 0o200)  # write-only: a command cannot read (steal) its own record
        os.chown(path, uid, gid)


def remove_stdio_fifos(directory: str) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def open_stdio_fifos(directory: str) -> dict[int, int]:
    """{stream: read end}, non-blocking (an open for reading would wait for a writer),
    with a 1 MiB pipe where the kernel allows it (fewer wake-ups per megabyte)."""
    fds: dict[int, int] = {}
    try:
        for stream, name in ((STDOUT, "stdout"), (STDERR, "stderr")):
            fds[stream] = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                fcntl.fcntl(fds[stream], fcntl.F_SETPIPE_SZ, _FIFO_READ_BYTES)
            except OSError:
                pass
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise InternalError(f"the sandbox's output pipes could not be opened: {exc.strerror}") from None
    return fds


def pump_fifos(fifos: dict[int, int], wake_fd: int, sink: OutputSpool, handle: SandboxHandle,
               grace_s: float = WRITER_GRACE_S) -> None:
    """Reads the output FIFOs into `sink` until every writer is gone and the container
    has ended (EOF on `wake_fd`, from the attach pump), then closes the output.

    A FIFO read returns 0 whenever no process holds a write end: before the shim opened
    it, and after the command and all its children closed it. poll() reports a hang-up
    only for the second, so a stream ends at a 0 read after poll said it was ready. Once
    the container has ended, what is left ends `grace_s` later whatever holds it: a
    stream no process ever opened, or one a process outside the container holds open
    (through /proc/<pid>/fd of the command, as the same uid): the call never waits on it."""
    streams = {fd: stream for stream, fd in fifos.items()}
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    poller.register(wake_fd, select.POLLIN)
    unstored = False  # a write to the spool failed (said once)

    def drain(fd: int) -> bool:
        """Reads what is there; True when the stream is over."""
        nonlocal unstored
        while True:
            try:
                data = os.read(fd, _FIFO_READ_BYTES)
            except BlockingIOError:
                return False  # a writer is still there
            except OSError as exc:
                log.warning("output pipe of %s broke: %s", handle.sandbox_id, exc)
                return True
            if not data:
                return True
            try:
                sink.write(streams[fd], data)
            except OSError as exc:  # e.g. the spool's disk is full: read on, never block the command
                if not unstored:
                    log.error("output of %s could not be stored: %s", handle.sandbox_id, exc)
                unstored = True

    def end(fd: int) -> None:
        poller.unregister(fd)
        os.close(fd)
        del streams[fd]

    try:
        deadline: float | None = None  # set once the container has ended
        while streams or deadline is None:
            if deadline is None:
                ready = poller.poll()
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    for fd in list(streams):
                        drain(fd)
                        end(fd)
                    break
                ready = poller.poll(left * 1000)
            for fd, _ in ready:
                if fd == wake_fd:
                    deadline = time.monotonic() + grace_s
                    poller.unregister(wake_fd)
                elif fd in streams and drain(fd):
                    end(fd)
    finally:
        for fd in streams:
            os.close(fd)
        os.close(wake_fd)
        handle.output_closed.set()
