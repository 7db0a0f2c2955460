"""The operator's always_blocked (DaemonSettings.always_blocked): paths masked in every
call, whatever its policy; this module is its pattern language, pure. Each pattern is one
or more names relative to the workspace, the last a glob ('*', '?', '[...]', fnmatch's:
'*' matches a leading dot too); written '**/...' it matches at any depth, '!...' exempts
what an earlier pattern matched (the last pattern that matches a path decides), and a
trailing '/' is for the reader (a directory is masked whole, with what it holds; a file
of the name is masked too). A plain pattern is matched at the top of the workspace and
of each directory above it up to its workspace root, so that a workspace named inside a
blocked directory (`-w ~/.ssh`) is refused and `-w ~/.docker` still has `config.json`
masked. policy/preflight.py matches them against the host: listing only the directories
it needs (the workspace's top, once); a '**/' pattern walks every root the call shows,
at each call, bounded: past the bound the call is refused, never half-checked."""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sandboxd.core.errors import InvalidArgument

ALWAYS_BLOCKED = "always_blocked"
GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class BlockedPattern:
    """One always_blocked entry, parsed: its names (only the last a glob), whether it
    matches at any depth ('**/'), whether it exempts ('!')."""

    text: str
    parts: tuple[str, ...]
    any_depth: bool = False
    negated: bool = False

    def matches(self, names: Sequence[str]) -> bool:
        """Whether the path `names` (from an anchor) is this pattern's: exactly, or (any
        depth) by its last names."""
        n = len(self.parts)
        if len(names) < n or (len(names) != n and not self.any_depth):
            return False
        return all(fnmatch.fnmatchcase(name, glob) for name, glob in zip(names[len(names) - n:], self.parts))


@dataclass(frozen=True)
class AlwaysBlocked:
    """The operator's always_blocked, parsed once."""

    patterns: tuple[BlockedPattern, ...]
    # Any blocking pattern's last name: a name matching none is decided by none (the walk's
    # one regular-expression test per entry).
    last_names: re.Pattern[str] | None

    @property
    def walks(self) -> bool:
        """Whether a '**/' pattern needs every shown directory walked."""
        return any(p.any_depth and not p.negated for p in self.patterns)

    def blocking(self, names: Sequence[str], anchors: int) -> BlockedPattern | None:
        """The pattern that blocks the path `names` (from the workspace root), if one
        does: the last pattern matching it from any of its first `anchors` directories
        (the workspace and those above it) decides."""
        if self.last_names is None or not self.last_names.match(names[-1]):
            return None
        starts = range(min(anchors, len(names)))
        for p in reversed(self.patterns):
            if any(p.matches(names[a:]) for a in starts):
                return None if p.negated else p
        return None

    def rule_for(self, above: Sequence[str], rel: Sequence[str]) -> str | None:
        """`always_blocked: <pattern>` when it hides the path `rel` (names below the
        workspace) or a directory on its way; `above`: the names from the workspace
        root down to the workspace. (For whoever checks a name, not an inode: a file
        transfer's path.)"""
        names = (*above, *rel)
        for end in range(1, len(names) + 1):
            found = self.blocking(names[:end], len(above) + 1)
            if found is not None:
                return f"{ALWAYS_BLOCKED}: {found.text}"
        return None


def always_blocked(patterns: Sequence[str]) -> AlwaysBlocked:
    """The setting parsed (cached: a preflight runs at every call); a malformed pattern
    is INVALID_ARGUMENT naming its index, at the daemon's start (calls/prepare.py)."""
    return _parse_always_blocked(tuple(patterns))


@functools.lru_cache(maxsize=8)
def _parse_always_blocked(patterns: tuple[str, ...]) -> AlwaysBlocked:
    parsed = tuple(_parse_pattern(text, f"{ALWAYS_BLOCKED}[{i}]") for i, text in enumerate(patterns))
    lasts = sorted({fnmatch.translate(p.parts[-1]) for p in parsed if not p.negated})
    return AlwaysBlocked(parsed, re.compile("|".join(lasts)) if lasts else None)


def _parse_pattern(text: str, where: str) -> BlockedPattern:
    if "\x00" in text or len(text) > 4096:
        raise InvalidArgument("contains a NUL byte or is longer than 4096 characters", field=where)
    negated = text.startswith("!")
    body = text[1:] if negated else text
    any_depth = body.startswith("**/")
    body = body[3:] if any_depth else body
    body = body[:-1] if body.endswith("/") else body
    if not body or body.startswith("/"):
        raise InvalidArgument(f"{text!r} is no path relative to the workspace (e.g. '.env', '**/.env', '.ssh/')",
                              field=where)
    parts = tuple(body.split("/"))
    for k, name in enumerate(parts):
        if name in ("", ".", ".."):
            raise InvalidArgument(f"{text!r} has an empty, '.' or '..' name", field=where)
        if "**" in name:
            raise InvalidArgument(f"{text!r}: '**' only as its first name ('**/name' matches at any depth)",
                                  field=where)
        if k < len(parts) - 1 and GLOB_CHARS & set(name):
            raise InvalidArgument(f"{text!r}: only its last name may hold '*', '?' or '['", field=where)
        if len(name.encode("utf-8", "surrogateescape")) > 255:
            raise InvalidArgument(f"{text!r} has a name longer than 255 bytes", field=where)
    return BlockedPattern(text, parts, any_depth, negated)
