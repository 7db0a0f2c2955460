"""The operator's always_blocked patterns (always_blocked.py) matched against a workspace
on the host, for preflight: a plain pattern at the top of the workspace and of each
directory above it, listed through descriptors from the workspace (never a symlink);
a '**/' one by a walk of every root the call shows, each directory entered from its
parent with O_NOFOLLOW. Bounded: past the bound the call is refused, never half-checked."""

from __future__ import annotations

import errno
import fnmatch
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

from sandboxd.core.errors import FailedPrecondition, PermissionDenied
from sandboxd.core.safe_open import AT_FDCWD, RESOLVE_BENEATH, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.policy.always_blocked import ALWAYS_BLOCKED, GLOB_CHARS, AlwaysBlocked
from sandboxd.policy.models import WORKSPACE, is_within

# (workspace, sandbox path) -> the path the sandbox would reach there, None if outside.
Resolver = Callable[[str, str], "str | None"]
# Entries one preflight may list for it. Measured: the default list costs a call ~0.1 ms
# (0.5 ms with a .env to mask); a '**/' walk ~1.2 µs an entry on a warm cache (0.12 s for
# 100,000), several times that cold.
MAX_ALWAYS_BLOCKED_ENTRIES = 100_000
# Directories deep a '**/' walk goes (it holds one descriptor per level).
MAX_ALWAYS_BLOCKED_DEPTH = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC



def refuse_blocked_workspace(always: AlwaysBlocked, workspace_raw: str, workspace: str,
                              above: tuple[str, ...]) -> None:
    """A workspace that is, or lies in, an always-blocked directory (`-w ~/.ssh`)."""
    for end in range(1, len(above) + 1):
        found = always.blocking(above[:end], end)
        if found is not None:
            hidden = os.path.join(workspace[:len(workspace) - len("/".join(above))], *above[:end])
            raise PermissionDenied(f"{workspace_raw} is or lies in {hidden}, which the daemon's "
                                   f"{ALWAYS_BLOCKED}: {found.text} hides from every call", field="workspace")


class _Lister:
    """The directories one preflight lists for always_blocked, through descriptors from
    the workspace (never a symlink), their entries counted against the bound."""

    def __init__(self, ws_fd: int):
        self.ws_fd = ws_fd
        self.entries = 0

    def count(self, where: str, entries: int = 1) -> None:
        self.entries += entries
        if self.entries > MAX_ALWAYS_BLOCKED_ENTRIES:
            raise FailedPrecondition(
                f"matching the daemon's {ALWAYS_BLOCKED} patterns would list more than {MAX_ALWAYS_BLOCKED_ENTRIES} "
                "entries of the workspace: refused rather than half-checked (name narrower roots, or the operator "
                "narrows the '**/' patterns)", field=where)

    def open_dir(self, rel: str, where: str) -> int | None:
        """The directory `rel` (below the workspace, no symlink on the way), or None if
        it is not one (absent, a file, a symlink: what the sandbox would see there is
        another path, listed if it is matched itself)."""
        try:
            path_fd = openat2(self.ws_fd, rel or ".", RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                return None
            raise FailedPrecondition(f"cannot list {rel or '.'} for {ALWAYS_BLOCKED} ({exc.strerror})",
                                     field=where) from None
        try:
            return os.open(".", _DIR_FLAGS, dir_fd=path_fd)
        except (NotADirectoryError, FileNotFoundError):
            return None
        except OSError as exc:
            raise FailedPrecondition(f"cannot list {rel or '.'} for {ALWAYS_BLOCKED} ({exc.strerror})",
                                     field=where) from None
        finally:
            os.close(path_fd)

    def names(self, dir_fd: int, where: str) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(dir_fd) as entries:
                for entry in entries:
                    self.count(where)
                    yield entry
        except OSError as exc:
            raise FailedPrecondition(f"cannot list a directory for {ALWAYS_BLOCKED} ({exc.strerror})",
                                     field=where) from None


def always_blocked_matches(always: AlwaysBlocked, workspace: str, ws_inode: tuple[int, int], above: tuple[str, ...],
                           roots: Sequence[str], root_fields: Mapping[str, str],
                           resolve: Resolver) -> list[tuple[str, str]]:
    """The workspace's paths the operator's patterns block, each with its pattern's text.
    `roots`: the sandbox paths the call shows (`root_fields` names each one's setting);
    `resolve`: a sandbox path as the sandbox would reach it (preflight.resolve_in_sandbox)."""
    try:
        ws_fd = openat2(AT_FDCWD, workspace, RESOLVE_NO_SYMLINKS)
    except OSError:
        raise FailedPrecondition(f"{workspace} changed while it was checked", field="workspace") from None
    try:
        if (os.fstat(ws_fd).st_dev, os.fstat(ws_fd).st_ino) != ws_inode:
            raise FailedPrecondition(f"{workspace} changed while it was checked", field="workspace")
        lister = _Lister(ws_fd)
        found = _anchored(always, above, lister, workspace, resolve)
        if always.walks:
            found.update(_walked(always, above, lister, roots, root_fields))
    finally:
        os.close(ws_fd)
    anchors = len(above) + 1
    out = []
    for rel in found:
        pattern = always.blocking((*above, *rel), anchors)
        if pattern is not None:
            out.append((f"{WORKSPACE}/{'/'.join(rel)}", pattern.text))
    return out


def _anchored(always: AlwaysBlocked, above: tuple[str, ...], lister: _Lister, workspace: str,
              resolve: Resolver) -> dict[tuple[str, ...], None]:
    """What the plain patterns may name below the workspace (to be decided with the
    negations): a literal path as it is, a glob's directory listed as the sandbox sees
    it (through the workspace's symlinks)."""
    found: dict[tuple[str, ...], None] = {}
    listed: dict[tuple[str, ...], list[str]] = {}
    for p in always.patterns:
        if p.negated or p.any_depth:
            continue
        for a in range(len(above) + 1):
            way = above[a:]  # from this anchor down to the workspace
            if len(p.parts) <= len(way) or not all(fnmatch.fnmatchcase(n, g) for n, g in zip(way, p.parts)):
                continue  # (ending at or above the workspace: refused before)
            rest = p.parts[len(way):]
            if () not in listed:  # the top, listed once: most patterns name nothing there
                listed[()] = _listed(lister, workspace, (), resolve)
            if len(rest) > 1 and rest[0] not in listed[()]:
                continue
            if not GLOB_CHARS & set(rest[-1]):
                if len(rest) > 1 or rest[0] in listed[()]:
                    found[rest] = None
                continue
            parent = rest[:-1]
            if parent not in listed:
                listed[parent] = _listed(lister, workspace, parent, resolve)
            for name in listed[parent]:
                if fnmatch.fnmatchcase(name, rest[-1]):
                    found[(*parent, name)] = None
    return found


def _listed(lister: _Lister, workspace: str, parent: tuple[str, ...], resolve: Resolver) -> list[str]:
    inside = resolve(workspace, "/".join((WORKSPACE, *parent))) if parent else WORKSPACE
    if inside is None:
        return []
    dir_fd = lister.open_dir(os.path.relpath(inside, WORKSPACE) if inside != WORKSPACE else "", "workspace")
    if dir_fd is None:
        return []
    try:
        return [e.name for e in lister.names(dir_fd, "workspace")]
    finally:
        os.close(dir_fd)


def _walked(always: AlwaysBlocked, above: tuple[str, ...], lister: _Lister, roots: Sequence[str],
            root_fields: Mapping[str, str]) -> dict[tuple[str, ...], None]:
    """Every shown path a pattern blocks, at any depth: each outermost root walked, a
    directory entered by descriptor from its parent with O_NOFOLLOW (a directory swapped
    for a link meanwhile is not followed), a blocked directory not entered (masked whole)."""
    found: dict[tuple[str, ...], None] = {}
    anchors = len(above) + 1
    for root in roots:
        if any(r != root and is_within(root, r) for r in roots):
            continue  # walked with its enclosing root
        where = root_fields.get(root, "workspace")
        rel = () if root == WORKSPACE else tuple(os.path.relpath(root, WORKSPACE).split("/"))
        # The root itself, or a directory on its way (a root named inside `**/.ssh/`):
        # found, so that preflight refuses a root that would show it.
        hidden = next((rel[:end] for end in range(1, len(rel) + 1) if always.blocking((*above, *rel[:end]), anchors)),
                      None)
        if hidden is not None:
            found[hidden] = None
            continue
        top = lister.open_dir("/".join(rel), where)
        if top is None:  # a bound file: matched by its name above
            continue
        stack: list[tuple[int, tuple[str, ...], list[str]]] = [(top, rel, [])]
        try:
            _list_into(stack, lister, always, above, found, where)
            while stack:
                dir_fd, names, children = stack[-1]
                if not children:
                    os.close(stack.pop()[0])
                    continue
                child = children.pop()
                if len(stack) >= MAX_ALWAYS_BLOCKED_DEPTH:
                    raise FailedPrecondition(f"matching the daemon's {ALWAYS_BLOCKED} '**/' patterns would walk more "
                                             f"than {MAX_ALWAYS_BLOCKED_DEPTH} directories deep: refused rather than "
                                             "half-checked", field=where)
                try:
                    child_fd = os.open(child, _DIR_FLAGS, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        continue  # gone, or no longer a directory: its name was matched as listed
                    raise FailedPrecondition(f"cannot list {'/'.join((*names, child))} for {ALWAYS_BLOCKED} "
                                             f"({exc.strerror})", field=where) from None
                stack.append((child_fd, (*names, child), []))
                _list_into(stack, lister, always, above, found, where)
        finally:
            for dir_fd, _names, _children in stack:
                os.close(dir_fd)
    return found


def _list_into(stack: list[tuple[int, tuple[str, ...], list[str]]], lister: _Lister, always: AlwaysBlocked,
               above: tuple[str, ...], found: dict[tuple[str, ...], None], where: str) -> None:
    """The top directory of `stack` listed: its blocked entries found, its other
    directories left to enter."""
    dir_fd, names, children = stack[-1]
    anchors = len(above) + 1
    maybe = always.last_names
    seen = 0
    try:
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                seen += 1
                if seen == 1024:  # counted in batches: this loop is the walk's cost
                    lister.count(where, seen)
                    seen = 0
                # (The one test most entries get: no blocking pattern's last name matches theirs.)
                if (maybe is not None and maybe.match(entry.name)
                        and always.blocking((*above, *names, entry.name), anchors)):
                    found[(*names, entry.name)] = None
                elif entry.is_dir(follow_symlinks=False):
                    children.append(entry.name)
    except OSError as exc:
        raise FailedPrecondition(f"cannot list {'/'.join(names) or '.'} for {ALWAYS_BLOCKED} ({exc.strerror})",
                                 field=where) from None
    lister.count(where, seen)
