"""OutputSpool: one call's stdout and stderr as they are produced. The backend's reader
writes into it without ever blocking on the consumer (bytes past a stream's cap are
counted and dropped); each stream's spool file is both the live stream's buffer and,
once closed, the artifact. Readers follow it at their own pace by offset."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


STDOUT, STDERR = 1, 2
STREAM_NAMES = {STDOUT: "stdout", STDERR: "stderr"}
MAX_CHUNK_BYTES = 1024 * 1024
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


@dataclass(frozen=True)
class StreamSummary:
    path: Path
    produced_bytes: int  # everything the command wrote
    stored_bytes: int  # what fit under the cap
    truncated: bool
    content_hash: str
    preview: str


class StreamRedactor(Protocol):
    """What a spool needs of the call's redactor (secrets.redact.Redactor): the sandbox
    layer only knows its shape."""

    @property
    def active(self) -> bool: ...

    def feed(self, stream: int, data: bytes) -> bytes: ...

    def flush(self, stream: int) -> bytes: ...


class OutputSpool:
    def __init__(self, directory: Path, caps: dict[int, int], preview_bytes: int, redactor: StreamRedactor | None = None):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._dir = directory
        self._caps = dict(caps)
        self._preview_bytes = preview_bytes
        self._paths = {s: directory / f"{STREAM_NAMES[s]}.out" for s in (STDOUT, STDERR)}
        self._fds = {s: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for s, p in self._paths.items()}
        self._hashes = {s: hashlib.sha256() for s in (STDOUT, STDERR)}
        self._produced = {STDOUT: 0, STDERR: 0}
        self._stored = {STDOUT: 0, STDERR: 0}
        self._truncated = {STDOUT: False, STDERR: False}
        self._previews = {STDOUT: bytearray(), STDERR: bytearray()}
        self._closed = False
        self._cond = threading.Condition()
        # Secrets are struck before a byte is stored: the live stream, the artifact and
        # the preview all read what is stored.
        self._redactor = redactor if redactor is not None and redactor.active else None

    # -- writer side (the backend's reader thread) ------------------------------
    def write(self, stream: int, data: bytes | memoryview) -> None:
        self.write_parts(stream, [data])

    def write_parts(self, stream: int, parts: list[bytes | memoryview]) -> None:
        """Appends the parts in order with one writev: no joined copy of them is made
        (unless secrets must be struck from them)."""
        n = sum(len(p) for p in parts)
        if not n:
            return
        # Under the lock: close() must never free a descriptor that a late write uses.
        with self._cond:
            if self._closed:
                return
            if self._redactor is not None:
                parts = [self._redactor.feed(stream, b"".join(parts))]
            self._store(stream, parts, n)

    def _store(self, stream: int, parts: list[bytes | memoryview], n: int) -> None:
        """Under the lock: `parts` stored up to the cap; `n` bytes were produced."""
        room = self._caps[stream] - self._stored[stream]
        keep: list[bytes | memoryview] = []
        kept = 0
        for part in parts:
            if kept + len(part) > room:
                part = part[:room - kept]
            if len(part):
                keep.append(part)
                kept += len(part)
            if kept >= room:
                break
        for i in range(0, len(keep), IOV_MAX):
            group = keep[i:i + IOV_MAX]
            want = sum(len(p) for p in group)
            written = os.writev(self._fds[stream], group)
            if written < want:  # a short write (disk nearly full): finish it plainly
                rest = memoryview(b"".join(group))[written:]
                while rest:
                    rest = rest[os.write(self._fds[stream], rest):]
        digest = self._hashes[stream]
        preview = self._previews[stream]
        for part in keep:
            digest.update(part)
            if len(preview) < self._preview_bytes:
                preview += part[: self._preview_bytes - len(preview)]
        self._produced[stream] += n
        self._stored[stream] += kept
        if kept < sum(len(p) for p in parts):
            self._truncated[stream] = True
        self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            if self._redactor is not None:
                for stream in (STDOUT, STDERR):
                    rest = self._redactor.flush(stream)
                    if rest:
                        self._store(stream, [rest], 0)
            self._closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._cond.notify_all()

    # -- reader side --------------------------------------------------------------
    def follow(self, should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.25) -> Iterator[tuple[int, int, bytes]]:
        """Yields (stream, offset, data) in production order per stream until the
        spool is closed and drained, or `should_stop()` turns true."""
        sent = {STDOUT: 0, STDERR: 0}
        readers = {s: open(p, "rb", buffering=0) for s, p in self._paths.items()}
        try:
            while True:
                with self._cond:
                    while not self._closed and all(self._stored[s] == sent[s] for s in sent):
                        if should_stop():
                            return
                        self._cond.wait(poll_s)
                    available = dict(self._stored)
                    closed = self._closed
                progressed = False
                for s in (STDOUT, STDERR):
                    while sent[s] < available[s]:
                        n = min(MAX_CHUNK_BYTES, available[s] - sent[s])
                        data = os.pread(readers[s].fileno(), n, sent[s])
                        if not data:
                            break
                        yield s, sent[s], data
                        sent[s] += len(data)
                        progressed = True
                if closed and not progressed and all(sent[s] >= available[s] for s in sent):
                    return
                if should_stop():
                    return
        finally:
            for f in readers.values():
                f.close()

    def summary(self, stream: int) -> StreamSummary:
        with self._cond:
            return StreamSummary(
                path=self._paths[stream],
                produced_bytes=self._produced[stream],
                stored_bytes=self._stored[stream],
                truncated=self._truncated[stream],
                content_hash="sha256:" + self._hashes[stream].hexdigest(),
                preview=bytes(self._previews[stream]).decode("utf-8", errors="replace"),
            )

    def discard(self) -> None:
        self.close()
        for p in self._paths.values():
            p.unlink(missing_ok=True)
        try:
            self._dir.rmdir()
        except OSError:
            pass
