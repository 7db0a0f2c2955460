"""A download: the path (a file, or a directory and the tree below it) listed first, as
the sandbox's user, and its size and count held against the caps before a byte is
sent; then each file opened again from the root, one name at a time, and streamed with
its sha256. A file that changes while it is sent (its size, its times, a byte past its
size) ends the download: what was sent is not what the file holds."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from typing import Any

from sandboxd.core.as_user import AsUser
from sandboxd.core.errors import Aborted, FailedPrecondition, PermissionDenied, ResourceExhausted
from sandboxd.core.safe_open import AT_FDCWD, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.transfer.rules import Placed, Where, join
from sandboxd.transfer.tree import Found, Listing, Skips, Walker, denied, list_tree, open_file

CHUNK_BYTES = 1024 * 1024
# What a download yields: ("entry", {path, kind, mode, sizeBytes}) then, for a file, its
# ("data", bytes) and ("done", {sha256}); the caller adds the result.
Part = tuple[str, Any]


class Download:
    def __init__(self, fs: AsUser, where: Where, walker: Walker, placed: Placed, max_bytes: int, max_entries: int):
        self._fs, self._where, self._walker, self._placed = fs, where, walker, placed
        self._masks = where.mask_inodes()
        self._max_bytes, self._max_entries = max_bytes, max_entries
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
        for entry in found:
            shown = {"path": "/".join(entry.parts), "kind": entry.kind, "mode": entry.mode,
                     "sizeBytes": entry.size}
            if entry.kind == "dir":
                self.records.append({**shown, "path": join(self._placed.path, entry.parts)})
                yield "entry", shown
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


def _is_dir_root(placed: Placed) -> bool:
    """Whether the root holding the path is a directory (a root may be one bound file)."""
    try:
        return stat.S_ISDIR(os.stat(placed.bind.host_path, follow_symlinks=False).st_mode)
    except OSError:
        return True  # then opening it as a directory fails, and says so
