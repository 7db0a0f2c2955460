"""The regular files a call changed, from its snapshots' comparison: what its artifacts
and its diff are made of (outputs/). Paths are the sandbox's, as the walk read them
(a name that is not UTF-8 keeps its bytes as surrogates: outputs/ shows it printable)."""

from __future__ import annotations

import stat
from typing import Any, NamedTuple

from sandboxd.recording.snapshot import Entry


class ChangedFile(NamedTuple):
    path: str
    change: str  # created | modified | renamed | deleted
    mode: int  # st_mode after the call; before it for a deleted file
    size: int
    sha256_before: str = ""  # "" when it did not exist, or was not hashed
    sha256_after: str = ""
    previous_path: str = ""  # renamed: where it was
    replaced: bool = False  # modified by a new inode taking the path (a rename over it, sed -i)
    # (st_dev, st_ino, st_ctime_ns) of the file after the call, as the record found it:
    # what collection reads must still be it (a file too large to hash has no other check).
    found_as: tuple[int, ...] = ()


def changed_files(changes: list[dict[str, Any]], before: dict[str, Entry], after: dict[str, Entry]) -> list[ChangedFile]:
    """Each regular file created, modified, renamed or deleted, in path order, once
    (a path replaced by a rename is "modified"; modes alone are not a change of content)."""
    out: dict[str, ChangedFile] = {}
    for c in changes:
        op, path = c["operation"], c["path"]
        if op == "rename":
            now = after.get(c["renamedTo"])
            if now is not None and stat.S_ISREG(now.mode):
                was = before.get(path)
                out[c["renamedTo"]] = ChangedFile(c["renamedTo"], "renamed", now.mode, now.size,
                                                  was.sha256 if was else "", now.sha256, path,
                                                  found_as=_found_as(now))
        elif op in ("create", "write"):
            now, was = after.get(path), before.get(path)
            if now is None or not stat.S_ISREG(now.mode):
                continue
            existed = was is not None and stat.S_ISREG(was.mode)
            if path in out and out[path].change == "renamed":
                continue  # renamed over: the rename says where its content came from
            out[path] = ChangedFile(path, "modified" if existed else "created", now.mode, now.size,
                                    was.sha256 if existed and was else "", now.sha256,
                                    replaced=existed and was is not None and was.inode != now.inode,
                                    found_as=_found_as(now))
        elif op == "delete":
            was = before.get(path)
            if was is not None and stat.S_ISREG(was.mode) and path not in after:
                out[path] = ChangedFile(path, "deleted", was.mode, 0, was.sha256)
    return [out[p] for p in sorted(out)]


def _found_as(entry: Entry) -> tuple[int, ...]:
    return (entry.dev, entry.inode, entry.ctime_ns) if entry.dev and entry.inode and entry.ctime_ns else ()
