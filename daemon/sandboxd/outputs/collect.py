"""A finished call's changed files kept as `file` artifacts, and its diff as a `diff`
artifact, within the daemon's per-call caps (ArtifactSettings). Runs after the sandbox
is gone and before the result is recorded: the writer still holds its workspace alone,
and a file that changed since the record anyway is told, not kept. With secrets in the
call, what is kept is redacted as its output is (the content hash is then the
redacted bytes')."""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path

from sandboxd.core.artifact_settings import ArtifactSettings
from sandboxd.core.as_user import AsUser, IdentityError
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import ArtifactRecord, FileArtifactStore
from sandboxd.outputs.diff import FileVersions, Pending, unified_diff
from sandboxd.outputs.reading import NotReadable, copy_verified, locate, read_chunks
from sandboxd.recording.baseline import Baseline
from sandboxd.recording.changes import ChangedFile
from sandboxd.recording.activity import printable
from sandboxd.secrets.redact import Redactor

# Omissions listed one by one in the result; the rest are counted.
MAX_OMISSIONS_LISTED = 100
_FILE_STREAM = 9  # the Redactor's stream number for a file's bytes (any but stdout's and stderr's)


@dataclass
class Collected:
    records: list[ArtifactRecord] = field(default_factory=list)
    omitted: list[str] = field(default_factory=list)


@dataclass
class _Budget:
    files: int
    bytes: int


def movable_masks(masks: Sequence[str], mount_points: Sequence[str], write_roots: Sequence[str]) -> tuple[str, ...]:
    """The masked paths the sandbox could carry out from under their masks by renaming a
    directory on their way: those with a directory inside a write root, between the mask
    and the top of that root, that is no mount point of the sandbox (rename refuses a
    mount point with EBUSY, but moves a directory that merely holds one: a read root nested
    in a write root is carried along by its parent). A mask right below a root, in no
    write root's directory but its mounts, leaves collection on (the operator's `.env`)."""
    mounts = set(mount_points)

    def in_a_write_root(path: str) -> bool:
        return any(path == w or path.startswith(w.rstrip("/") + "/") for w in write_roots)

    def movable(mask: str) -> bool:
        directory = posixpath.dirname(mask)
        while in_a_write_root(directory):
            if directory not in mounts:
                return True
            if directory == "/":
                break
            directory = posixpath.dirname(directory)
        return False

    return tuple(m for m in masks if movable(m))


class OutputCollector:
    """One call's collection: its store, caps and write roots."""

    def __init__(self, settings: ArtifactSettings, store: FileArtifactStore, baseline: Baseline | None,
                 tool_call_id: str, write_roots: list[tuple[str, str]],
                 redactor: Callable[[], Redactor] | None = None, reader: tuple[int, int] | None = None,
                 blocked: tuple[str, ...] = ()):
        """`reader`: the sandbox's (uid, gid): only what it could read is kept. `blocked`:
        the masked paths a rename could move (movable_masks); with any, no changed file
        is kept (a rename of a blocked file's parent moves it out from under its mask on
        the host, and what came from under a mask cannot yet be told apart)."""
        self._settings = settings
        self._store = store
        self._baseline = baseline
        self._call = tool_call_id
        self._roots = write_roots
        self._reader = reader
        self._blocked = blocked
        self._redactor = redactor
        self._budget = _Budget(settings.max_files_per_call, settings.max_collected_mb_per_call * 2**20)
        self._omitted: list[str] = []
        # Raw content kept for the diff, by path, with what its read as the sandbox's user passed.
        self._afters: dict[str, tuple[bytes, list[os.stat_result]]] = {}
        self._afters_left = settings.diff_max_mb * 2**20  # no more held than the diff can show
        self._diffed: set[str] = set()  # the paths the diff shows content of
        text_redactor = redactor() if redactor is not None else None
        # A name is as much the sandbox's choice as the content: struck the same way.
        self._redact_text = text_redactor.redact_text if text_redactor is not None and text_redactor.active \
            else (lambda text: text)
        self._incoming = store.incoming_dir()
        self._user: AsUser | None = None

    def _as_user(self) -> AsUser | None:
        """The thread that reads as the sandbox's user (made at the first file read)."""
        if self._reader is None:
            return None
        if self._user is None:
            try:
                self._user = AsUser(*self._reader)
            except IdentityError as exc:  # never read as root instead
                raise NotReadable(f"cannot be read as the sandbox's user ({exc})") from None
        return self._user

    def _read(self, f: ChangedFile, seen: list[os.stat_result] | None = None) -> Iterator[bytes]:
        return read_chunks(locate(f.path, self._roots), f.size, self._as_user(), f.found_as, seen)

    def collect(self, changed: list[ChangedFile], kept: list[ChangedFile] | None = None) -> Collected:
        """`changed`: the write roots' changed files (artifacts, and the diff); `kept`:
        persistOutputs' files of the tempDir (artifacts even with collect_files off)."""
        try:
            return self._collect(changed, kept)
        finally:
            if self._user is not None:
                self._user.close()
                self._user = None

    def _collect(self, changed: list[ChangedFile], kept: list[ChangedFile] | None) -> Collected:
        records: list[ArtifactRecord] = []
        if self._blocked and changed:
            self._omitted.append(f"{len(changed)} changed files: none is kept or diffed when a blocked path lies below a "
                                 "directory the sandbox could move")
            changed = []
        if self._settings.diff:
            self._diffed = {f.path for f in changed if f.change != "deleted" and not f.replaced}
        # The write roots' first: what a call did to the workspace matters most under the caps.
        for f in (changed if self._settings.collect_files else []) + (kept or []):
            record = self._file_artifact(f)
            if record is not None:
                records.append(record)
        if self._settings.diff and changed:
            records.append(self._diff_artifact(changed))
        return Collected(records, self._omissions())

    # -- file artifacts ------------------------------------------------------------
    def _shown(self, path: str) -> str:
        return self._redact_text(printable(path))

    def _omit(self, path: str, why: str) -> None:
        self._omitted.append(f"{self._shown(path)}: {why}")

    def _omissions(self) -> list[str]:
        listed = self._omitted[:MAX_OMISSIONS_LISTED]
        if len(self._omitted) > MAX_OMISSIONS_LISTED:
            listed.append(f"... and {len(self._omitted) - MAX_OMISSIONS_LISTED} more files not kept")
        return listed

    def _file_artifact(self, f: ChangedFile) -> ArtifactRecord | None:
        if self._budget.files <= 0:
            self._omit(f.path, f"over the per-call cap of {self._settings.max_files_per_call} file artifacts")
            return None
        shown = self._shown(f.path)
        if f.change == "deleted":
            self._budget.files -= 1
            return self._record(f, f.sha256_before, 0, f"{shown}: deleted by the call")
        if f.size > self._budget.bytes:
            self._omit(f.path, f"{f.size} bytes: over the per-call cap of "
                               f"{self._settings.max_collected_mb_per_call} MB of file artifacts")
            return None
        try:
            content_hash, size, redacted = self._copy_in(f)
        except NotReadable as exc:
            self._omit(f.path, str(exc))
            return None
        self._budget.files -= 1
        self._budget.bytes -= size
        summary = f"{shown}: {f.change}" + (f" from {self._shown(f.previous_path)}" if f.previous_path else "")
        summary += f", {size} bytes" + ("; secrets redacted" if redacted else "")
        return self._record(f, content_hash, size, summary)

    def _record(self, f: ChangedFile, content_hash: str, size: int, summary: str) -> ArtifactRecord:
        mode = "" if f.change == "deleted" else f"{stat.S_IMODE(f.mode):04o}"
        return ArtifactRecord(ev.new_id("art"), self._call, ev.new_id("ev"), "file", content_hash, size, summary,
                              ev.utc_now(), self._shown(f.path), f.change, self._shown(f.previous_path), mode)

    def _copy_in(self, f: ChangedFile) -> tuple[str, int, bool]:
        """The file into the store: (content hash, size stored, redacted)."""
        keep_for_diff = (f.path in self._diffed and f.size <= self._settings.diff_max_file_kb * 1024
                         and f.size <= self._afters_left)
        kept: list[bytes] = []
        seen: list[os.stat_result] = []
        redactor = self._redactor() if self._redactor is not None else None
        redacting = redactor is not None and redactor.active
        tmp = self._incoming / f"{self._call}.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                def sink(data: bytes) -> None:
                    if keep_for_diff:
                        kept.append(data)
                    out.write(redactor.feed(_FILE_STREAM, data) if redacting and redactor else data)

                raw_hash = copy_verified(self._read(f, seen), f.sha256_after, sink)
                if redacting and redactor:
                    out.write(redactor.flush(_FILE_STREAM))
            size = tmp.stat().st_size
            content_hash = raw_hash if not redacting else _hash_file(tmp)
            self._store.put_blob(tmp, content_hash)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if keep_for_diff:
            self._afters[f.path] = (b"".join(kept), seen)
            self._afters_left -= f.size
        return content_hash, size, redacting

    # -- the diff ------------------------------------------------------------------
    def _diff_artifact(self, changed: list[ChangedFile]) -> ArtifactRecord:
        text, left_out = unified_diff([Pending(printable(f.path), partial(self._versions, f)) for f in changed],
                                       self._settings.diff_max_mb * 2**20)
        redactor = self._redactor() if self._redactor is not None else None
        if redactor is not None and redactor.active:
            text = redactor.feed(_FILE_STREAM, text) + redactor.flush(_FILE_STREAM)
        tmp = self._incoming / f"{self._call}.{uuid.uuid4().hex}.diff"
        tmp.write_bytes(text)
        content_hash = _hash_file(tmp)
        self._store.put_blob(tmp, content_hash)
        summary = f"diff of {len(changed)} changed files, {len(text)} bytes"
        if left_out:
            summary += f"; {len(left_out)} only named (the diff's cap of {self._settings.diff_max_mb} MB)"
        return ArtifactRecord(ev.new_id("art"), self._call, ev.new_id("ev"), "diff", content_hash, len(text),
                              summary, ev.utc_now())

    def _versions(self, f: ChangedFile) -> FileVersions:
        cap = self._settings.diff_max_file_kb * 1024
        before: bytes | None = b""
        after: bytes | None = b""
        why = ""
        if f.change != "created":
            before, why = self._before(f)
        if f.change != "deleted" and before is not None:
            after, why, seen = self._after(f, cap)
            if after is not None and f.change == "modified":
                why = self._unreadable_before(f, seen)
                if why:
                    before = None
        return FileVersions(printable(f.path), f.change, f.mode, before, after, printable(f.previous_path), why)

    def _before(self, f: ChangedFile) -> tuple[bytes | None, str]:
        """The file's content before the call, as the baseline kept it (read as root): only
        of the very file the path holds now, its birth too, not only an inode number a new
        file may have taken; shown only if the sandbox's user could read it before the
        call (`_unreadable_before`, once it is read as that user after the call)."""
        if f.change == "renamed" and f.sha256_before == f.sha256_after:
            return b"", ""  # the same content: the rename is all there is to show
        if f.change != "modified" or f.replaced or not f.same_file:
            return None, "its content before the call is shown only for a file changed in place"
        if not f.sha256_before:
            return None, "the file had no content hash before the call (over the hashing caps)"
        kept = self._baseline.read(f.sha256_before) if self._baseline is not None else None
        if kept is None:
            return None, ("its content before the call was not kept (binary, larger than "
                          f"{self._settings.diff_max_file_kb} KB, past the baseline's cap, or written by a "
                          "call with secrets)")
        return kept, ""

    def _unreadable_before(self, f: ChangedFile, seen: list[os.stat_result]) -> str:
        """Why the sandbox's user could not read the file before the call ("" if it could).
        `seen`: the write root, the directories on the way and the file, as the read of its
        content after the call passed them as that user: the kernel let it through them
        (mode bits, ACLs). Before the call the same held of all it does not own: the call
        runs as that user with no capability, so it changes no one else's modes, ACLs or
        owners. What it owns it may have opened to itself during the call: there the
        record's modes before the call decide (an owner's bits are all the kernel looks at
        for its owner). The write root's own mode before the call is not in the record:
        for it, the kernel's judgement after the call stands."""
        where = locate(f.path, self._roots)
        if self._reader is None or len(seen) != 1 + len(where.relative.split("/")):
            return "its content before the call is shown only for a file read as the sandbox's user"
        before = {path: (dev, ino, mode) for path, dev, ino, mode in f.modes_before}
        passed = [(where.sandbox_path(depth), st, stat.S_IXUSR) for depth, st in enumerate(seen[1:-1], start=1)]
        passed.append((f.path, seen[-1], stat.S_IRUSR))
        for path, st, needed in passed:
            if st.st_uid != self._reader[0]:
                continue  # not the sandbox user's: as the kernel judged it just now, so it was before
            was = before.get(path)
            if was is None or was[:2] != (st.st_dev, st.st_ino) or not was[2] & needed:
                return "the sandbox's user could not read it before the call: its content then is not shown"
        return ""

    def _after(self, f: ChangedFile, cap: int) -> tuple[bytes | None, str, list[os.stat_result]]:
        if f.change == "renamed" and f.sha256_before == f.sha256_after:
            return b"", "", []
        if f.size > cap:
            return None, (f"{f.size} bytes: larger than the diff's per-file cap of "
                          f"{self._settings.diff_max_file_kb} KB"), []
        if f.path in self._afters:
            content, passed = self._afters[f.path]
            return content, "", passed
        try:  # not kept as an artifact (a cap, or collection off): read for the diff alone
            kept: list[bytes] = []
            seen: list[os.stat_result] = []
            copy_verified(self._read(f, seen), f.sha256_after, kept.append)
            return b"".join(kept), "", seen
        except NotReadable as exc:
            return None, str(exc), []


def _hash_file(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
