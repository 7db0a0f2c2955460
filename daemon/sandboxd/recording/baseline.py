"""Baseline: the text files of the write roots as they were last hashed, by sha256, so
that a call's diff can show what a file held before the call (the before-snapshot keeps
only hashes). Filled by the hash cache (snapshot.HashCache) as it reads a file anyway;
bounded, the least recently used first out; emptied at the daemon's start, when the hash
cache starts empty too and every file is read again."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("sandboxd.recording.baseline")
# A file with a NUL in its first bytes is binary (git's rule): named in a diff, never kept.
BINARY_SNIFF_BYTES = 8000


def looks_binary(data: bytes) -> bool:
    return b"\0" in data[:BINARY_SNIFF_BYTES]


class Baseline:
    def __init__(self, directory: Path, max_bytes: int, max_file_bytes: int):
        self._dir = directory
        self._max_bytes = max_bytes
        self._max_file_bytes = max_file_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # hex -> size, least recently used first
        self._total = 0
        self._serial = 0

    def open(self) -> None:
        """Starts empty (what an earlier daemon kept may no longer match its hashes' files)."""
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir.mkdir(parents=True, mode=0o700)

    def wants(self, size: int) -> bool:
        return 0 < size <= self._max_file_bytes and self._max_bytes > 0

    def keep(self, digest: str, data: bytes) -> None:
        """Keeps `data` (whose sha256 is `digest`) unless it is binary or already kept."""
        hexdigest = digest.removeprefix("sha256:")
        if looks_binary(data) or len(data) > self._max_bytes:
            return
        with self._lock:
            if hexdigest in self._sizes:
                self._sizes.move_to_end(hexdigest)
                return
            self._serial += 1
            tmp = self._dir / f".{hexdigest}.{self._serial}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, self._dir / hexdigest)
        except OSError as exc:  # a full disk costs the diff a file, never the call
            log.warning("baseline: %s not kept: %s", digest, exc.strerror)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            if hexdigest not in self._sizes:
                self._sizes[hexdigest] = len(data)
                self._total += len(data)
            while self._total > self._max_bytes and self._sizes:
                old, size = self._sizes.popitem(last=False)
                self._total -= size
                (self._dir / old).unlink(missing_ok=True)

    def read(self, digest: str) -> bytes | None:
        """The kept content of `digest`, verified; None when it was not kept (binary, too
        large, evicted, or never read since the start)."""
        hexdigest = digest.removeprefix("sha256:")
        with self._lock:
            if hexdigest not in self._sizes:
                return None
            self._sizes.move_to_end(hexdigest)
        try:
            data = (self._dir / hexdigest).read_bytes()
        except OSError:
            return None
        return data if hashlib.sha256(data).hexdigest() == hexdigest else None

    @property
    def kept_bytes(self) -> int:
        return self._total
