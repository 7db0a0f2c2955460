"""Baseline: the text files of the write roots as they were last hashed, by sha256, so
that a call's diff can show what a file held before the call (the before-snapshot keeps
only hashes). Filled by the hash cache (snapshot.HashCache) as it reads a file anyway;
bounded, the least recently used first out; emptied at the daemon's start, when the hash
cache starts empty too and every file is read again.

What a call with secrets wrote is never kept: its artifacts are redacted, and the daemon
keeps no raw copy of it either. From before such a call's sandbox is made, its write
roots are withheld (`withhold`): whatever is hashed there keeps nothing, and its hash is
refused for good, so those bytes are not kept when they are read again later (a chmod
moves the ctime, the hash cache evicts, the daemon restarts). Redacting them instead
would need the call's redactor at every later read, when only the bytes are left. A root
stays withheld after the call until a snapshot begun after it hashed every file small
enough to keep (`settle`), so nothing it wrote goes unrefused. Refused hashes are a Bloom
filter in a file of its own (a false positive costs a diff one file's content before,
never a secret its place), and the withheld roots are on disk too: both outlive restarts."""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("sandboxd.recording.baseline")
# A file with a NUL in its first bytes is binary (git's rule): named in a diff, never kept.
BINARY_SNIFF_BYTES = 8000
# The refused hashes' filter: 2**25 bits (4 MiB) probed 7 times holds ~3.5 million
# hashes at 1% false positives; past that it refuses more, never fewer.
REFUSED_FILTER_BITS = 2**25
REFUSED_FILTER_PROBES = 7


def looks_binary(data: bytes) -> bool:
    return b"\0" in data[:BINARY_SNIFF_BYTES]


def overlaps(a: str, b: str) -> bool:
    """Whether one of two host directories holds the other (or they are one)."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


class RefusedHashes:
    """sha256 hashes whose bytes are never kept: a Bloom filter mapped from `path` (each
    probe a slice of the hash itself, which no content can aim)."""

    def __init__(self, path: Path):
        self._path = path
        self._bits: mmap.mmap | None = None
        self._unusable = False  # a filter of another size: everything is refused

    def open(self) -> None:
        size = REFUSED_FILTER_BITS // 8
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            found = os.fstat(fd).st_size
            if found == 0:
                os.ftruncate(fd, size)
            elif found != size:
                log.error("baseline: %s is not a filter of %d bytes: nothing is kept until it is", self._path, size)
                self._unusable = True
                return
            self._bits = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @staticmethod
    def _probes(digest: str) -> Iterable[tuple[int, int]]:
        raw = bytes.fromhex(digest.removeprefix("sha256:"))
        for i in range(REFUSED_FILTER_PROBES):
            bit = int.from_bytes(raw[4 * i:4 * i + 4], "little") % REFUSED_FILTER_BITS
            yield bit >> 3, 1 << (bit & 7)

    def add(self, digest: str) -> None:
        if self._bits is not None:
            for byte, mask in self._probes(digest):
                self._bits[byte] |= mask

    def __contains__(self, digest: str) -> bool:
        if self._bits is None:
            return True  # not opened, or unusable: refused
        return all(self._bits[byte] & mask for byte, mask in self._probes(digest))

    def flush(self) -> None:
        if self._bits is not None:
            self._bits.flush()


class Baseline:
    def __init__(self, directory: Path, max_bytes: int, max_file_bytes: int):
        self._dir = directory
        self._max_bytes = max_bytes
        self._max_file_bytes = max_file_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # hex -> size, least recently used first
        self._total = 0
        self._serial = 0
        self._refused = RefusedHashes(directory.with_name(directory.name + ".refused"))
        self._withheld_file = directory.with_name(directory.name + ".withheld")
        # Host roots a call with secrets runs on (how many), and those it left that no
        # snapshot has settled yet (with the tick of their release).
        self._held: dict[str, int] = {}
        self._unsettled: dict[str, int] = {}
        self._ticks = 0

    def open(self) -> None:
        """Starts empty (what an earlier daemon kept may no longer match its hashes' files),
        but with what it refused and the roots it still withheld."""
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir.mkdir(parents=True, mode=0o700)
        self._refused.open()
        try:
            roots = json.loads(self._withheld_file.read_text())
        except FileNotFoundError:
            roots = []
        except (OSError, ValueError) as exc:  # never read: no root can be known settled
            log.error("baseline: %s cannot be read (%s): nothing is kept until it is", self._withheld_file, exc)
            self._max_bytes = 0
            roots = []
        self._unsettled = {str(r): 0 for r in roots}

    def wants(self, size: int) -> bool:
        return 0 < size <= self._max_file_bytes and self._max_bytes > 0

    # -- what a call with secrets wrote --------------------------------------------
    def withhold(self, host_roots: Iterable[str]) -> Callable[[], None]:
        """Withholds the write roots of a call with secrets, until the returned function is
        called (once its processes are gone) and a snapshot settles them."""
        roots = list(dict.fromkeys(host_roots))
        if not roots:
            return lambda: None
        with self._lock:
            self._ticks += 1
            for r in roots:
                self._held[r] = self._held.get(r, 0) + 1
            self._save_withheld()
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            self._refused.flush()
            with self._lock:
                self._ticks += 1
                for r in roots:
                    self._held[r] -= 1
                    if not self._held[r]:
                        del self._held[r]
                    self._unsettled[r] = self._ticks
                self._save_withheld()

        return release

    def withheld(self, host_root: str) -> bool:
        """Whether what is hashed under this host root may hold what a call with secrets wrote."""
        with self._lock:
            return any(overlaps(host_root, r) for r in (*self._held, *self._unsettled))

    def tick(self) -> int:
        """Now, for `settle`: taken before a snapshot begins."""
        with self._lock:
            return self._ticks

    def settle(self, host_root: str, since: int) -> None:
        """A snapshot of `host_root` begun at `since` hashed (and refused) every file small
        enough to keep: a root it covers released before then is withheld no more."""
        with self._lock:
            done = [r for r, at in self._unsettled.items()
                    if at <= since and (r == host_root or r.startswith(host_root.rstrip("/") + "/"))]
            if not done:
                return
            for r in done:
                del self._unsettled[r]
            self._refused.flush()
            self._save_withheld()

    def _save_withheld(self) -> None:
        """Holds self._lock."""
        roots = sorted({*self._held, *self._unsettled})
        tmp = self._withheld_file.with_name(self._withheld_file.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, json.dumps(roots).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self._withheld_file)
        except OSError as exc:  # in memory they stay withheld; after a restart they might not
            log.error("baseline: the withheld roots could not be saved: %s", exc.strerror)

    def refuse(self, digest: str) -> None:
        """These bytes are never kept (and a copy kept already goes)."""
        hexdigest = digest.removeprefix("sha256:")
        with self._lock:
            self._refused.add(digest)
            size = self._sizes.pop(hexdigest, None)
            if size is not None:
                self._total -= size
                (self._dir / hexdigest).unlink(missing_ok=True)

    # -- the content ---------------------------------------------------------------
    def keep(self, digest: str, data: bytes) -> None:
        """Keeps `data` (whose sha256 is `digest`) unless it is binary, refused or already kept."""
        hexdigest = digest.removeprefix("sha256:")
        if looks_binary(data) or len(data) > self._max_bytes:
            return
        with self._lock:
            if digest in self._refused:
                return
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
            if digest in self._refused:  # refused while it was written
                (self._dir / hexdigest).unlink(missing_ok=True)
                return
            if hexdigest not in self._sizes:
                self._sizes[hexdigest] = len(data)
                self._total += len(data)
            while self._total > self._max_bytes and self._sizes:
                old, size = self._sizes.popitem(last=False)
                self._total -= size
                (self._dir / old).unlink(missing_ok=True)

    def read(self, digest: str) -> bytes | None:
        """The kept content of `digest`, verified; None when it was not kept (binary, too
        large, evicted, refused, or never read since the start)."""
        hexdigest = digest.removeprefix("sha256:")
        with self._lock:
            if hexdigest not in self._sizes or digest in self._refused:
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
