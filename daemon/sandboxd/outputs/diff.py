"""The diff artifact's text, pure: a git-style unified diff of the files a call changed
against their content before it. Binary files are named, not diffed; a file whose
content before the call is unknown, or which is over the per-file cap, is named with
the reason on a `# sandboxd:` line (patch tools skip such lines)."""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sandboxd.recording.baseline import looks_binary

# difflib's cost grows with the square of the lines in the worst case (a 1 MB file of
# short repeated lines took ten minutes): past this many lines a file is only named,
# and the whole diff stops computing after DIFF_TIME_BUDGET_S (the rest only named).
MAX_DIFF_LINES = 5000
DIFF_TIME_BUDGET_S = 10.0


@dataclass(frozen=True)
class FileVersions:
    """One changed file as the diff sees it. `before`/`after` None: the content is not
    at hand (`why` says why), b"" for a side that does not exist."""

    path: str
    change: str  # created | modified | renamed | deleted
    mode: int  # st_mode (after; before for a deleted file)
    before: bytes | None
    after: bytes | None
    previous_path: str = ""
    why: str = ""


def _lines(data: bytes) -> list[str]:
    # surrogateescape: any byte survives the trip through str and back.
    return data.decode("utf-8", "surrogateescape").splitlines(keepends=True)


def _hunks(before: bytes, after: bytes, old: str, new: str) -> list[str]:
    out = []
    for line in difflib.unified_diff(_lines(before), _lines(after), old, new):
        if line.endswith("\n"):
            out.append(line)
        else:  # the file's last line has no newline
            out.append(line + "\n\\ No newline at end of file\n")
    return out


def file_diff(f: FileVersions) -> str:
    """One file's part of the diff, headers first."""
    old_path = f.previous_path or f.path
    old, new = f"a{old_path}", f"b{f.path}"
    head = [f"diff --git {old} {new}\n"]
    if f.change == "created":
        head.append(f"new file mode {f.mode:o}\n")
    elif f.change == "deleted":
        head.append(f"deleted file mode {f.mode:o}\n")
    elif f.change == "renamed":
        head += [f"rename from {old_path[1:]}\n", f"rename to {f.path[1:]}\n"]
    if f.before is None or f.after is None:
        return "".join(head + [f"# sandboxd: not diffed: {f.why}\n"])
    if f.before == f.after:
        return "".join(head)  # a rename that kept the content
    if looks_binary(f.before) or looks_binary(f.after):
        return "".join(head + [f"Binary files {old if f.change != 'created' else '/dev/null'} and "
                               f"{new if f.change != 'deleted' else '/dev/null'} differ\n"])
    if max(f.before.count(b"\n"), f.after.count(b"\n")) > MAX_DIFF_LINES:
        return "".join(head + [f"# sandboxd: not diffed: more than {MAX_DIFF_LINES} lines\n"])
    hunks = _hunks(f.before, f.after, old if f.change != "created" else "/dev/null",
                   new if f.change != "deleted" else "/dev/null")
    return "".join(head + hunks)


@dataclass(frozen=True)
class Pending:
    """A changed file whose versions are read only if the diff gets to it: one only
    named (past the cap or the time budget) is never read."""

    path: str
    load: Callable[[], FileVersions]


def unified_diff(files: Iterable[FileVersions | Pending], max_bytes: int,
                 budget_s: float = DIFF_TIME_BUDGET_S) -> tuple[bytes, list[str]]:
    """The whole diff (bytes as the files held them) and the paths only named because
    the diff reached `max_bytes` or its time budget first."""
    parts: list[bytes] = []
    size = 0
    left_out: list[str] = []
    deadline = time.monotonic() + budget_s
    for f in files:
        if left_out or time.monotonic() > deadline:
            left_out.append(f.path)
            continue
        part = file_diff(f.load() if isinstance(f, Pending) else f).encode("utf-8", "surrogateescape")
        if size + len(part) > max_bytes:
            left_out.append(f.path)
            continue
        parts.append(part)
        size += len(part)
    if left_out:
        note = "".join(f"# sandboxd: not diffed (the diff reached its cap of {max_bytes} bytes or "
                       f"{budget_s:g} s): {p}\n" for p in left_out)
        parts.append(note.encode("utf-8", "surrogateescape"))
    return b"".join(parts), left_out
