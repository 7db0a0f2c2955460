"""Before/after snapshots of a call's writable mounts: what fanotify mount marks cannot
report (creations, deletions, renames, mode changes). Sound to attribute to the call
because a call that can write a workspace runs alone on it. Pure diffing; the walk is
the only I/O."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

MAX_ENTRIES = 200_000


@dataclass(frozen=True)
class Entry:
    inode: int
    mode: int
    size: int
    mtime_ns: int


def take(binds: list[tuple[str, str]]) -> tuple[dict[str, Entry], bool]:
    """(sandbox path -> entry, complete) for every file and directory below the
    writable binds ((sandbox path, host path) pairs). Symlinks are not followed."""
    out: dict[str, Entry] = {}
    for sandbox_root, host_root in binds:
        for dirpath, dirnames, filenames in os.walk(host_root):
            rel = os.path.relpath(dirpath, host_root)
            base = sandbox_root if rel == "." else f"{sandbox_root.rstrip('/')}/{rel}"
            for name in dirnames + filenames:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                out[f"{base}/{name}"] = Entry(st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)
                if len(out) >= MAX_ENTRIES:
                    return out, False
    return out, True


def diff(before: dict[str, Entry], after: dict[str, Entry]) -> list[dict[str, str]]:
    """create | delete | rename (path -> renamedTo) | chmod, in path order."""
    gone = {p: e for p, e in before.items() if p not in after}
    new = {p: e for p, e in after.items() if p not in before}
    by_inode = {e.inode: p for p, e in gone.items()}
    out: list[dict[str, str]] = []
    renamed_from: set[str] = set()
    for path, entry in sorted(new.items()):
        old = by_inode.get(entry.inode)
        # A rename keeps the inode, the type, the size and the mtime; a file created in
        # a deleted one's place may reuse only the inode.
        was = gone.get(old) if old is not None else None
        if was is not None and stat.S_IFMT(was.mode) == stat.S_IFMT(entry.mode) \
                and was.size == entry.size and was.mtime_ns == entry.mtime_ns:
            out.append({"path": old, "operation": "rename", "renamedTo": path})
            renamed_from.add(old)
        else:
            out.append({"path": path, "operation": "create"})
    out += [{"path": p, "operation": "delete"} for p in sorted(gone) if p not in renamed_from]
    out += [{"path": p, "operation": "chmod"} for p, e in sorted(after.items())
            if p in before and stat.S_IMODE(e.mode) != stat.S_IMODE(before[p].mode)]
    return sorted(out, key=lambda a: (a["path"], a["operation"]))
