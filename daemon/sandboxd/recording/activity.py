"""What a call did to files, from its before/after snapshots (snapshot.py) and the
accesses fanotify saw: the changes (create, delete, rename, write, chmod, with the
content hashes the snapshots hold), the FileAccessObserved events that record them, the
result's effectsObserved, and printable names for every path the sandbox chose."""

from __future__ import annotations

import base64
import stat
from typing import Any, Iterable, NamedTuple

from sandboxd.ledger.event_types import FileAccessObserved
from sandboxd.recording.snapshot import Entry, born_apart, same_inode


def diff(before: dict[str, Entry], after: dict[str, Entry], candidates: set[str] | None = None) -> list[dict[str, Any]]:
    """create | delete | rename (path -> renamedTo) | write (content changed or the path
    replaced) | chmod, in path order, with the content hashes the snapshots hold.
    `candidates`: a set of paths that holds every path whose entry differs (what the
    trackers saw change), when known: only those are compared."""
    if before is after:  # a tracked tree that did not change: one dict
        return []
    if candidates is not None:
        differing = {p for p in candidates if before.get(p) != after.get(p)}
    else:
        # Only entries that differ can say anything: compared in C, whatever the tree's size.
        differing = {p for p, _ in before.items() ^ after.items()}
    # In path order, whichever way `differing` came: several links of one inode gone,
    # the rename is told from the same one.
    ordered = sorted(differing)
    before = {p: before[p] for p in ordered if p in before}
    after = {p: after[p] for p in ordered if p in after}
    gone = {p: e for p, e in before.items() if p not in after}
    by_inode = {(e.dev, e.inode): p for p, e in gone.items()}
    out: list[dict[str, Any]] = []
    renamed_from: set[str] = set()
    for path, now in sorted(after.items()):
        was = before.get(path)
        if was is not None and same_inode(was, now):
            if now.regular and _content_changed(was, now):
                out.append(_write(path, was, now))
            if stat.S_IMODE(now.mode) != stat.S_IMODE(was.mode):
                out.append({"path": path, "operation": "chmod",
                            "modeBefore": f"{stat.S_IMODE(was.mode):04o}", "modeAfter": f"{stat.S_IMODE(now.mode):04o}"})
            continue
        source = by_inode.get((now.dev, now.inode))
        moved = gone.get(source) if source is not None else None
        # A rename keeps the inode, the type, the size, the mtime, the birth and the
        # content; a file created in a deleted one's place may reuse the inode number
        # (and a command can set the mtime).
        if source is not None and moved is not None and not born_apart(moved, now) \
                and stat.S_IFMT(moved.mode) == stat.S_IFMT(now.mode) \
                and moved.size == now.size and moved.mtime_ns == now.mtime_ns \
                and not (moved.sha256 and now.sha256 and moved.sha256 != now.sha256):
            out.append(_hashed({"path": source, "operation": "rename", "renamedTo": path}, "sha256", now))
            renamed_from.add(source)
        elif was is None or not (was.regular and now.regular):
            out.append(_hashed({"path": path, "operation": "create"}, "sha256After", now))
        if was is not None:  # replaced: by a rename over it (sed -i, editors) or a new file
            if was.regular and now.regular:
                out.append(_write(path, was, now))
            else:
                out.append(_hashed({"path": path, "operation": "delete"}, "sha256Before", was))
    out += [_hashed({"path": p, "operation": "delete"}, "sha256Before", e)
            for p, e in sorted(gone.items()) if p not in renamed_from]
    return sorted(out, key=lambda a: (a["path"], a["operation"]))


class FileEvents(NamedTuple):
    """What a call did to files, as its FileAccessObserved events hold it: `reads`, the
    paths opened and never written with their open counts ((path, opens), in path
    order: a test run reads thousands, and a pair costs the record a third of an
    entry), and `entries` for everything else (writes with their hashes, creations,
    deletions, renames, mode changes, and reads of names that are not UTF-8)."""

    entries: list[dict[str, Any]]
    reads: list[tuple[str, int]]


def file_events(accesses: Iterable[tuple[str, int, int]], changes: list[dict[str, Any]], before: dict[str, Entry],
                after: dict[str, Entry]) -> FileEvents:
    """A call's file record: what the watch saw opened (a write with the content it
    found and left), then what only the snapshots show."""
    out: list[dict[str, Any]] = []
    reads: list[tuple[str, int]] = []
    watched_writes: dict[str, dict[str, Any]] = {}
    for path, opens, writes in accesses:
        if not writes:  # most of them by far: nothing more to say
            if path.isascii() or printable(path) is path:
                reads.append((path, opens))
            else:
                out.append({"path": path, "operation": "read", "opens": opens, "writes": 0})
            continue
        entry: dict[str, Any] = {"path": path, "operation": "write", "opens": opens, "writes": writes}
        watched_writes[path] = entry
        was, now = before.get(path), after.get(path)
        if was is None:
            entry["sha256Before"] = ""  # the file did not exist before the call
        else:
            _hashed(entry, "sha256Before", was)
        if now is None:
            entry["sha256After"] = ""  # gone by the end of the call (or not in a write root)
        else:
            _hashed(entry, "sha256After", now)
        out.append(entry)
    # A write the watch saw already carries its hashes. (A temporary file renamed over
    # a path before its close was read reads as that path: the watch's entry then also
    # says the file was replaced.)
    for c in changes:
        seen = watched_writes.get(c["path"]) if c["operation"] == "write" else None
        if seen is None:
            out.append(c)
        elif c.get("replaced"):
            seen["replaced"] = True
    for e in out:
        if not e["path"].isascii() or not e.get("renamedTo", "").isascii():
            _printable(e)
    return FileEvents(out, reads)


def file_access_events(files: FileEvents, entries_per_event: int, reads_per_event: int) -> list[FileAccessObserved]:
    """A call's FileAccessObserved events: each holds either a batch of entries
    (`accesses`) or of [path, opens] pairs (`reads`)."""
    entries, reads = files
    return ([FileAccessObserved(accesses=entries[i:i + entries_per_event])
             for i in range(0, len(entries), entries_per_event)]
            + [FileAccessObserved(reads=reads[i:i + reads_per_event]) for i in range(0, len(reads), reads_per_event)])


def _printable(entry: dict[str, Any]) -> dict[str, Any]:
    """A name that is not UTF-8 (Linux names are bytes; here they are decoded with
    surrogateescape) would make the record invalid JSON and the result an invalid
    message: it is recorded printable, its bytes as "\\xe9", and exactly in base64 beside
    it ("pathBase64", "renamedToBase64")."""
    for key in ("path", "renamedTo"):
        name = entry.get(key)
        if name is None:
            continue
        shown = printable(name)
        if shown is not name:
            entry[key] = shown
            entry[f"{key}Base64"] = base64.b64encode(name.encode("utf-8", "surrogateescape")).decode()
    return entry


def printable(text: str) -> str:
    """`text` itself when it is valid UTF-8; else with its undecodable bytes as "\\xe9"
    (a name decoded with surrogateescape, or a message that quotes one)."""
    if text.isascii():
        return text
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def effects(files: FileEvents) -> dict[str, list[str]]:
    """reads (opened, never written), writes (incl. creations, mode changes and rename
    targets) and deletes for ToolResult.effectsObserved, each path once, in path order."""
    # (The watch's reads come sorted already, which sorted() then sees.)
    reads = [path for path, _ in files.reads]
    writes, deletes = set(), set()
    for e in files.entries:
        op = e.get("operation")
        if op == "read":  # a name that is not UTF-8
            reads.append(e["path"])
        elif op in ("write", "create", "chmod"):
            writes.add(e["path"])
        elif op == "delete":
            deletes.add(e["path"])
        elif op == "rename":
            writes.add(e["renamedTo"])
    return {"reads": sorted(dict.fromkeys(reads)), "writes": sorted(writes), "deletes": sorted(deletes)}


def _content_changed(was: Entry, now: Entry) -> bool:
    if (was.size, was.mtime_ns, was.ctime_ns) == (now.size, now.mtime_ns, now.ctime_ns):
        return False
    if was.sha256 and now.sha256:
        return was.sha256 != now.sha256
    # Unhashed: only a changed size or mtime says the content changed (ctime moves
    # with chmod and links too).
    return (was.size, was.mtime_ns) != (now.size, now.mtime_ns)


def _write(path: str, was: Entry, now: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"path": path, "operation": "write"}
    if not same_inode(was, now):
        out["replaced"] = True
    _hashed(out, "sha256Before", was)
    return _hashed(out, "sha256After", now)


def _hashed(out: dict[str, Any], key: str, entry: Entry) -> dict[str, Any]:
    if entry.regular:
        out[key] = entry.sha256
        if entry.note:
            out[key + "Missing"] = entry.note
    return out
