"""Which paths a transfer may touch, decided on names alone (pure): an upload lands only
under a write root, a download reads only what a read or write root shows, a blocked
path never; the deepest root holding a path decides (a read root inside a write root is
read-only). What the names cannot show (a directory renamed over a mask, a link planted
on the way) the walk in tree.py checks on the inodes themselves."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from sandboxd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from sandboxd.policy.models import is_within, normalize_sandbox_path
from sandboxd.policy.preflight import Bind, Mask

MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096
# The names one transfer may carry, all its entries' paths together: its record (one
# event of the log) and its result stay this side of a few MB however deep the tree.
MAX_TRANSFER_PATH_BYTES = 4 * 2**20
PROC_ROOT_PREFIX = "/proc/"


@dataclass(frozen=True)
class Where:
    """What a transfer may touch: the sandbox's roots as bound on the host, its masks and
    blocked names, its tempDir, and the user it runs as."""

    binds: tuple[Bind, ...]
    masks: tuple[Mask, ...]
    blocked: tuple[str, ...]
    temp_dir: str
    uid: int
    gid: int
    workspace: str
    lease_id: str = ""
    # A leased sandbox's init (host pid): its tempDir is reached through /proc/<pid>/root;
    # and its pid now (0 once gone), asked again after that open, so that a pid reused
    # meanwhile by another process is never taken for the sandbox.
    temp_pid: int = 0
    init_pid_now: Callable[[], int] | None = None
    # The operator's always_blocked, asked by name (`always_blocked: <pattern>` or None):
    # the masks cover only what existed when they were placed (a lease's, made earlier).
    always_blocked: Callable[[str], str | None] | None = None

    def mask_inodes(self) -> frozenset[tuple[int, int]]:
        return frozenset((m.dev, m.ino) for m in self.masks if m.ino)

    def read_only_inodes(self) -> frozenset[tuple[int, int]]:
        """The read roots' own directories (or files): an upload never lands in one,
        wherever the sandbox has moved it."""
        return frozenset((b.dev, b.ino) for b in self.binds if b.read_only and b.ino)


@dataclass(frozen=True)
class Placed:
    """A sandbox path placed in its root: the bind and the names below it (none: the
    bind itself, a directory or a bound file)."""

    path: str
    bind: Bind
    parts: tuple[str, ...]


def sandbox_path(raw: str, field: str) -> str:
    """The transfer's path, absolute and normalized (relative: from /workspace)."""
    return normalize_sandbox_path(raw, field)


def entry_parts(raw: str, field: str) -> tuple[str, ...]:
    """An entry's relative path as names: never absolute, never `.` or `..`, no empty
    name, each at most 255 bytes. "" is the transfer's path itself."""
    if raw == "":
        return ()
    if "\x00" in raw or len(raw.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise InvalidArgument("contains a NUL byte or is longer than 4096 bytes", field=field)
    if raw.startswith("/"):
        raise InvalidArgument(f"{raw!r} must be relative to the transfer's path", field=field)
    parts = tuple(raw.split("/"))
    for name in parts:
        if name in ("", ".", ".."):
            raise InvalidArgument(f"{raw!r} has an empty, '.' or '..' name: each entry names its own path",
                                  field=field)
        if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidArgument(f"a name of {raw!r} is longer than {MAX_NAME_BYTES} bytes", field=field)
    return parts


def join(base: str, parts: tuple[str, ...]) -> str:
    return posixpath.join(base, *parts) if parts else base


def blocked_by(where: Where, path: str) -> str | None:
    """The rule that hides `path`, if one does: a blocked path of the policy, a mask
    (named by its rule), or the operator's always_blocked."""
    for blocked in where.blocked:
        if is_within(path, blocked):
            return blocked
    for mask in where.masks:
        if is_within(path, mask.sandbox_path):
            return mask.rule or mask.sandbox_path
    return where.always_blocked(path) if where.always_blocked is not None else None


def temp_bind(where: Where) -> Bind:
    """A leased sandbox's tempDir as a root: its tmpfs, seen through its init's root."""
    return Bind(where.temp_dir, f"{PROC_ROOT_PREFIX}{where.temp_pid}/root", read_only=False)


def place(where: Where, path: str, *, write: bool, field: str) -> Placed:
    """`path` in the deepest root that shows it; PERMISSION_DENIED naming the path and
    the rule when no root lets the transfer do what it asks."""
    blocked = blocked_by(where, path)
    if blocked is not None:
        raise PermissionDenied(f"{path} is blocked ({blocked}): never transferred", field=field)
    holders = [b for b in where.binds if is_within(path, b.sandbox_path)]
    if not holders:
        if is_within(path, where.temp_dir):
            if where.temp_pid:
                rel = posixpath.relpath(path, where.temp_dir)
                return Placed(path, temp_bind(where), () if rel == "." else tuple(rel.split("/")))
            if where.lease_id:
                raise FailedPrecondition(f"{path} is in the sandbox's tempDir ({where.temp_dir}), which cannot be "
                                         "reached: the sandbox's init is gone", field=field)
            raise PermissionDenied(f"{path} is in tempDir ({where.temp_dir}), which exists only inside a sandbox",
                                   field=field)
        rule = "any write root" if write else "any read or write root"
        raise PermissionDenied(f"{path} is not under {rule} of the policy", field=field)
    bind = max(holders, key=lambda b: len(b.sandbox_path))
    if write and bind.read_only:
        raise PermissionDenied(f"{path} is under the read root {bind.sandbox_path}: an upload lands only under a "
                               "write root", field=field)
    rel = posixpath.relpath(path, bind.sandbox_path)
    parts = () if rel == "." else tuple(rel.split("/"))
    return Placed(path, bind, parts)
