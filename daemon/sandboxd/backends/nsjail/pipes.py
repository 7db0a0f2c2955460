"""The jail's descriptors: its output pipes and the thread that pumps them into the
call's spool, its stdin feeder, and the memfds its config and nsjail's log live in."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import threading
from typing import IO

from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.sandbox.protocol import SandboxHandle

log = logging.getLogger("sandboxd.nsjail")
READ_BYTES = 1 << 20
# An early nsjail's config pipe: a config (argv included) up to this size goes in one write.
CONFIG_PIPE_BYTES = 1 << 20


def output_pipes() -> tuple[int, int, int, int]:
    """(stdout read, write, stderr read, write), as large as the host allows."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
    except BaseException:
        os.close(out_r)
        os.close(out_w)
        raise
    for fd in (out_r, err_r):
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, READ_BYTES)
        except OSError:
            pass  # above the host's pipe-max-size: the default size works too
    return out_r, out_w, err_r, err_w


def attach(handle: SandboxHandle, sink: OutputSpool, out_r: int, err_r: int, stdin_writer: IO[bytes] | None,
           stdin: bytes) -> None:
    """Output pumped into the spool on a thread; stdin fed (then closed) on another."""
    handle.reader = threading.Thread(target=pump, args=(out_r, err_r, sink, handle), daemon=True,
                                     name=f"pump-{handle.sandbox_id}")
    handle.reader.start()
    if stdin_writer is not None:
        threading.Thread(target=feed, args=(stdin_writer, stdin), daemon=True,
                         name=f"stdin-{handle.sandbox_id}").start()


def pump(out_r: int, err_r: int, sink: OutputSpool, handle: SandboxHandle) -> None:
    """Reads both output pipes into the spool until both reach EOF (every process that
    held them is gone)."""
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    streams = {out_r: STDOUT, err_r: STDERR}
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    try:
        while streams:
            for fd, _events in poller.poll():
                if fd not in streams:
                    continue
                try:
                    n = os.readv(fd, [buf])
                except InterruptedError:
                    continue
                if n:
                    sink.write(streams[fd], view[:n])
                else:
                    poller.unregister(fd)
                    os.close(fd)
                    del streams[fd]
    except OSError as exc:
        log.warning("output of %s broke: %s", handle.sandbox_id, exc)
    finally:
        view.release()
        for fd in streams:
            os.close(fd)
        handle.output_closed.set()


def feed(pipe: IO[bytes], data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
        pipe.close()  # EOF on the command's stdin
    except (OSError, ValueError):
        pass  # the command exited without reading all of it


def memfd(name: str, content: str = "") -> int:
    """A memory file (close-on-exec) holding `content`, read from its start."""
    fd = os.memfd_create(f"sandboxd-{name}", os.MFD_CLOEXEC)
    data = memoryview(content.encode())
    while data:
        data = data[os.write(fd, data):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def log_tail(text: str, lines: int = 6) -> str:
    """nsjail's last log lines, on one line."""
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])
