"""The regular files a call changed, from its snapshots' comparison: what its artifacts
and its diff are made of (outputs/). Paths are the sandbox's, as the walk read them
(a name that is not UTF-8 keeps its bytes as surrogates: outputs/ shows it printable)."""

from __future__ import annotations

import stat
from typing import Any, NamedTuple

from sandboxd.recording.snapshot import Entry, same_file, same_inode


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
    # Modified, and known to be the very file the path held before (snapshot.same_file:
    # its birth too, not only its inode number, which a new file may have taken).
    same_file: bool = False
    # Of a file that is `same_file`: (sandbox path, st_dev, st_ino, st_mode) before the call
    # of each directory on its way that the before-snapshot lists, then of the file
    # itself: what the sandbox's user could open before the call (outputs/collect.py).
    modes_before: tuple[tuple[str, int, int, int], ...] = ()


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
            if path in out and out[path].change == "renamed":
                continue  # renamed over: the rename says where its content came from
            if was is None or not stat.S_ISREG(was.mode):
                out[path] = ChangedFile(path, "created", now.mode, now.size, "", now.sha256, found_as=_found_as(now))
                continue
            same = same_file(was, now)
            out[path] = ChangedFile(path, "modified", now.mode, now.size, was.sha256, now.sha256,
                                    replaced=not same_inode(was, now), found_as=_found_as(now), same_file=same,
                                    modes_before=_modes_before(path, was, before) if same else ())
        elif op == "delete":
            was = before.get(path)
            if was is not None and stat.S_ISREG(was.mode) and path not in after:
                out[path] = ChangedFile(path, "deleted", was.mode, 0, was.sha256)
    return [out[p] for p in sorted(out)]


def _modes_before(path: str, was: Entry, before: dict[str, Entry]) -> tuple[tuple[str, int, int, int], ...]:
    out = []
    cut = path.find("/", 1)
    while cut > 0:
        parent = before.get(path[:cut])
        if parent is not None and stat.S_ISDIR(parent.mode):
            out.append((path[:cut], parent.dev, parent.inode, parent.mode))
        cut = path.find("/", cut + 1)
    out.append((path, was.dev, was.inode, was.mode))
    return tuple(out)


def _found_as(entry: Entry) -> tuple[int, ...]:
    return (entry.dev, entry.inode, entry.ctime_ns) if entry.dev and entry.inode and entry.ctime_ns else ()
