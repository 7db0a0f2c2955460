"""A download: the path (a file, or a directory and the tree below it) listed first, as
the sandbox's user, and its size and count held against the caps before a byte is
sent; then each file opened again from the root, one name at a time, and streamed with
its sha256. A file that changes while it is sent (its size, its times, a byte past its
size) ends the download: what was sent is not what the file holds.

From a leased sandbox that was given secrets, what leaves is redacted of them as the
lease's output is: each file is read whole, redacted into a spool of the daemon's (so
its entry can say the size that is sent), then sent from there; names are redacted too."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from sandboxd.core.as_user import AsUser
from sandboxd.core.errors import Aborted, FailedPrecondition, PermissionDenied, ResourceExhausted
from sandboxd.core.safe_open import AT_FDCWD, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.secrets.redact import Redactor
from sandboxd.transfer.rules import Placed, Where, join
from sandboxd.transfer.tree import Found, Listing, Skips, Walker, denied, list_tree, open_file

CHUNK_BYTES = 1024 * 1024
# What a download yields: ("entry", {path, kind, mode, sizeBytes}) then, for a file, its
# ("data", bytes) and ("done", {sha256}); the caller adds the result.
Part = tuple[str, Any]


class Download:
    def __init__(self, fs: AsUser, where: Where, walker: Walker, placed: Placed, max_bytes: int, max_entries: int,
                 secrets: Mapping[str, bytes] | None = None, spool_dir: Path | None = None):
        self._fs, self._where, self._walker, self._placed = fs, where, walker, placed
        self._masks = where.mask_inodes()
        self._max_bytes, self._max_entries = max_bytes, max_entries
        self._secrets = dict(secrets or {})
        self._spool_dir = spool_dir
        self.redacting = bool(self._secrets)
        self.redact_text = Redactor(self._secrets).redact_text if self.redacting else _same
        self.records: list[dict[str, Any]] = []
        self.total = 0
        self.skipped = Skips(max_entries, "path")

    def plan(self) -> list[Found]:
        """What will be sent (checked against the caps): the path's file, or its tree."""
        placed, field = self._placed, "path"
        if placed.bind.ino and not placed.parts and not _is_dir_root(placed):
            st = os.stat(placed.bind.host_path, follow_symlinks=False)
            found = [Found((), "file", st.st_size, stat.S_IMODE(st.st_mode))]
            return self._capped(Listing(found, self.skipped, st.st_size))
        if not placed.parts:
            return self._tree(self._walker.dir(placed, (), field))
        parent = self._walker.dir(placed, placed.parts[:-1], field)
        try:
            st = self._fs.run(os.stat, placed.parts[-1], dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            raise denied(placed.path, exc, field) from None
        if (st.st_dev, st.st_ino) in self._masks:
            raise denied(placed.path, PermissionError(13, "a blocked path of the policy"), field)
        if stat.S_ISLNK(st.st_mode):
            raise FailedPrecondition(f"{placed.path} is a symlink, which a transfer never follows: name its "
                                     "target", field=field)
        if stat.S_ISREG(st.st_mode):
            return self._capped(Listing([Found((), "file", st.st_size, stat.S_IMODE(st.st_mode))], self.skipped,
                                        st.st_size))
        if not stat.S_ISDIR(st.st_mode):
            raise FailedPrecondition(f"{placed.path} is neither a regular file nor a directory", field=field)
        return self._tree(self._walker.dir(placed, placed.parts, field))

    def _tree(self, dir_fd: int) -> list[Found]:
        listing = list_tree(self._fs, dir_fd, self._placed, self._where, self._max_entries, "path")
        self.skipped = listing.skipped
        return self._capped(listing)

    def _capped(self, listing: Listing) -> list[Found]:
        if listing.total > self._max_bytes:
            raise ResourceExhausted(f"{self._placed.path} holds {listing.total} bytes, more than the "
                                    f"{self._max_bytes} one download may send (transfers.max_download_mb)",
                                    field="path")
        return listing.entries

    def send(self, found: list[Found]) -> Iterator[Part]:
        name = self.redact_text
        for entry in found:
            shown = {"path": name("/".join(entry.parts)), "kind": entry.kind, "mode": entry.mode,
                     "sizeBytes": entry.size}
            if entry.kind == "dir":
                self.records.append({**shown, "path": name(join(self._placed.path, entry.parts))})
                yield "entry", shown
                continue
            if self.redacting:
                yield from self._send_redacted(entry, shown)
                continue
            try:
                fd, st = self._open(entry)
            except PermissionDenied as exc:
                if not entry.parts:
                    raise
                # In a tree: left out and said, as the listing does for what it may not list.
                self.skipped.add(f"{join(self._placed.path, entry.parts)}: {exc.reason.split(': ', 1)[-1]}")
                continue
            try:
                if st.st_size != entry.size:  # what was held against the cap is what is sent
                    raise Aborted(f"{join(self._placed.path, entry.parts)} changed since it was listed ({entry.size} "
                                  f"bytes, now {st.st_size}): retry when nothing writes it", field="path")
                yield "entry", {**shown, "sizeBytes": st.st_size, "mode": stat.S_IMODE(st.st_mode)}
                digest, sent = hashlib.sha256(), 0
                try:
                    for part in self._stream(fd, st, digest, join(self._placed.path, entry.parts)):
                        sent += len(part[1])
                        yield part
                except BaseException:  # cut off or changed: the record still says what left, and how much
                    self.records.append({"path": join(self._placed.path, entry.parts), "kind": "file",
                                         "mode": stat.S_IMODE(st.st_mode), "sizeBytes": st.st_size, "partial": True,
                                         "sentBytes": sent, "sentSha256": "sha256:" + digest.hexdigest()})
                    self.total += sent
                    raise
            finally:
                os.close(fd)
            sha = "sha256:" + digest.hexdigest()
            self.total += st.st_size
            self.records.append({"path": join(self._placed.path, entry.parts), "kind": "file",
                                 "mode": stat.S_IMODE(st.st_mode), "sizeBytes": st.st_size, "sha256": sha})
            yield "done", {"sha256": sha}

    def _send_redacted(self, entry: Found, shown: dict[str, Any]) -> Iterator[Part]:
        """One file read whole and redacted into a spool, then sent from it: its entry
        says the size and its done message the sha256 of the redacted bytes."""
        path = join(self._placed.path, entry.parts)
        try:
            fd, st = self._open(entry)
        except PermissionDenied as exc:
            if not entry.parts:
                raise
            self.skipped.add(self.redact_text(f"{path}: {exc.reason.split(': ', 1)[-1]}"))
            return
        with tempfile.TemporaryFile(dir=self._spool_dir) as spool:  # O_TMPFILE: no name, root's
            try:
                if st.st_size != entry.size:
                    raise Aborted(f"{path} changed since it was listed ({entry.size} bytes, now {st.st_size}): "
                                  "retry when nothing writes it", field="path")
                redactor = Redactor(self._secrets)
                for _kind, chunk in self._stream(fd, st, hashlib.sha256(), path):
                    spool.write(redactor.feed(0, chunk))
                spool.write(redactor.flush(0))
            finally:
                os.close(fd)
            size = spool.tell()
            if self.total + size > self._max_bytes:  # redaction may lengthen a file: the cap holds still
                raise ResourceExhausted(f"{self._placed.path} holds more than the {self._max_bytes} bytes one "
                                        "download may send, once redacted (transfers.max_download_mb)",
                                        field="path")
            spool.seek(0)
            yield "entry", {**shown, "sizeBytes": size, "mode": stat.S_IMODE(st.st_mode), "redacted": True}
            sha = yield from self._send_spool(spool, path, stat.S_IMODE(st.st_mode), size)
        self.total += size
        self.records.append({"path": self.redact_text(path), "kind": "file", "mode": stat.S_IMODE(st.st_mode),
                             "sizeBytes": size, "sha256": sha, "redacted": True})
        yield "done", {"sha256": sha}

    def _send_spool(self, spool: IO[bytes], path: str, mode: int, size: int) -> Generator[Part, None, str]:
        digest, sent = hashlib.sha256(), 0
        try:
            while chunk := spool.read(CHUNK_BYTES):
                digest.update(chunk)
                sent += len(chunk)
                yield "data", chunk
        except BaseException:  # cut off: the record still says what left, and how much
            self.records.append({"path": self.redact_text(path), "kind": "file", "mode": mode, "sizeBytes": size,
                                 "partial": True, "redacted": True, "sentBytes": sent,
                                 "sentSha256": "sha256:" + digest.hexdigest()})
            self.total += sent
            raise
        return "sha256:" + digest.hexdigest()

    def _open(self, entry: Found) -> tuple[int, os.stat_result]:
        placed = self._placed
        path = join(placed.path, entry.parts)
        if not placed.parts and not entry.parts and not _is_dir_root(placed):  # a bound file
            parent = openat2(AT_FDCWD, os.path.dirname(placed.bind.host_path), RESOLVE_NO_SYMLINKS)
            try:
                return open_file(self._fs, self._walker, parent, os.path.basename(placed.bind.host_path), path,
                                 "path")
            finally:
                os.close(parent)
        names = placed.parts + entry.parts
        parent = self._walker.dir(placed, names[:-1], "path")  # the walker's: held for the next file
        return open_file(self._fs, self._walker, parent, names[-1], path, "path")

    def _stream(self, fd: int, before: os.stat_result, digest: Any, path: str) -> Iterator[Part]:
        left = before.st_size
        while left > 0:
            chunk = os.read(fd, min(CHUNK_BYTES, left))
            if not chunk:
                break
            left -= len(chunk)
            digest.update(chunk)
            yield "data", chunk
        after = os.fstat(fd)
        grew = os.read(fd, 1) if left == 0 else b""
        if left or grew or (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
                before.st_size, before.st_mtime_ns, before.st_ctime_ns):
            raise Aborted(f"{path} changed while it was sent (sha256 of the bytes sent: "
                          f"sha256:{digest.hexdigest()}): retry when nothing writes it", field="path")


def _same(text: str) -> str:
    return text


def _is_dir_root(placed: Placed) -> bool:
    """Whether the root holding the path is a directory (a root may be one bound file)."""
    try:
        return stat.S_ISDIR(os.stat(placed.bind.host_path, follow_symlinks=False).st_mode)
    except OSError:
        return True  # then opening it as a directory fails, and says so
