"""A Sandbox's file operations as commands in the sandbox: each is a small POSIX shell
script (any image with /bin/sh, cat and stat runs it: Debian's and busybox's alike),
given its paths as arguments (never spliced into the script) and its content on stdin,
that answers with an exit status of its own; and what that answer means. Pure: no RPC
here. The client never touches a workspace file itself: the sandbox's mounts decide
what a command may see and change, as for any other command.

A write is also checked, before anything is sent, against the sandbox's write roots as
the daemon resolved them (WritableView): a path outside them is refused by name, and
nothing runs."""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass
from typing import Any, Literal

from .errors import SandboxdClientError
from .sandbox_errors import (PathNotWritable, SandboxFileError, SandboxFileNotFound, SandboxIsADirectory,
                             SandboxNotADirectory, SandboxOutputTruncated, SandboxPermissionError)
from .sandbox_result import CommandResult

WORKSPACE = "/workspace"
# The helper scripts' own exit statuses (sysexits.h's, clear of what sh and cat use: 1,
# 2, 126, 127, and 128+N for a signal).
EXIT_NOT_FOUND = 66  # EX_NOINPUT
EXIT_IS_A_DIRECTORY = 65
EXIT_NOT_A_DIRECTORY = 64
EXIT_CANNOT_WRITE = 73  # EX_CANTCREAT
EXIT_NO_PERMISSION = 77  # EX_NOPERM

READ_SCRIPT = """[ -e "$1" ] || exit 66
[ -d "$1" ] && exit 65
[ -r "$1" ] || exit 77
exec cat "$1"
"""
# $1 the file, $2 its parent, $3 non-empty: make the parent first.
WRITE_SCRIPT = """[ -d "$1" ] && exit 65
if [ -n "$3" ]; then mkdir -p "$2" || exit 73; fi
[ -e "$2" ] || exit 66
[ -d "$2" ] || exit 64
cat > "$1" || exit 73
"""
# The names (NUL-terminated, each "./"-prefixed so that none reads as an option), then
# one line per name from a single stat: raw mode in hex, size, mtime. A name may hold a
# newline, never a NUL, so the last NUL splits the two parts.
LIST_SCRIPT = """[ -e "$1" ] || exit 66
[ -d "$1" ] || exit 64
cd "$1" && [ -r . ] || exit 77
set --
for f in * .[!.]* ..?*; do
  if [ -e "$f" ] || [ -L "$f" ]; then set -- "$@" "./$f"; fi
done
[ "$#" -eq 0 ] && exit 0
printf '%s\\0' "$@"
exec stat -c '%f %s %Y' "$@"
"""

FileKind = Literal["file", "directory", "symlink", "other"]


@dataclass(frozen=True)
class FileCommand:
    """What a file operation runs: argv, stdin, and its own stdout cap if it has one."""

    argv: list[str]
    stdin: bytes | None = None
    max_stdout_bytes: int | None = None


@dataclass(frozen=True)
class FileEntry:
    """One entry of a listed directory (a link is listed as itself, not its target)."""

    name: str
    path: str
    kind: FileKind
    size: int
    mode: int  # the permission bits (0o644)
    modified: int  # seconds since the epoch

    @property
    def is_dir(self) -> bool:
        return self.kind == "directory"

    @property
    def is_file(self) -> bool:
        return self.kind == "file"


def sandbox_path(path: str | os.PathLike[str], name: str = "path") -> str:
    """An absolute, normalized sandbox path; a relative one is taken under /workspace."""
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"{name}: a sandbox path as str, not {type(path).__name__}")
    if not path:
        raise ValueError(f"{name}: empty; give a sandbox path such as /workspace/notes.txt")
    if "\x00" in path:
        raise ValueError(f"{name}: contains a NUL byte")
    normal = posixpath.normpath(posixpath.join(WORKSPACE, path))
    return "/" + normal.lstrip("/")  # (normpath keeps a leading "//")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class WritableView:
    """Where the sandbox's policy, as the daemon resolved it (ExplainPolicy's effective
    policy), lets a command write: its write roots and its tempDir, minus blocked paths."""

    write_roots: tuple[str, ...]
    temp_dir: str
    blocked_paths: tuple[str, ...] = ()

    @classmethod
    def from_effective_policy(cls, policy: dict[str, Any]) -> "WritableView":
        return cls(tuple(policy.get("writeRoots") or ()), str(policy.get("tempDir") or ""),
                   tuple(policy.get("blockedPaths") or ()))

    def refusal(self, path: str) -> str | None:
        """Why `path` may not be written, or None when it may."""
        for blocked in self.blocked_paths:
            if _within(path, blocked):
                return f"{path} lies in {blocked}, a blocked path of the sandbox's policy: no command sees it"
        if any(_within(path, root) for root in self.write_roots) or (self.temp_dir and _within(path, self.temp_dir)):
            return None
        roots = ", ".join(self.write_roots) or "none"
        return (f"{path} is not under the sandbox's write roots ({roots}) nor its tempDir ({self.temp_dir}): "
                "the policy's filesystem.writeRoots say where a command may write")


def read_command(path: str, max_bytes: int | None = None) -> FileCommand:
    return FileCommand(["/bin/sh", "-c", READ_SCRIPT, "sandboxd-read", path], max_stdout_bytes=max_bytes)


def write_command(path: str, data: bytes | bytearray | str, parents: bool = False) -> FileCommand:
    if isinstance(data, str):
        data = data.encode("utf-8")
    elif isinstance(data, bytearray):
        data = bytes(data)
    elif not isinstance(data, bytes):
        raise TypeError(f"data: bytes or str, not {type(data).__name__}")
    parent = posixpath.dirname(path) or "/"
    return FileCommand(["/bin/sh", "-c", WRITE_SCRIPT, "sandboxd-write", path, parent, "1" if parents else ""],
                       stdin=data)


def list_command(path: str) -> FileCommand:
    return FileCommand(["/bin/sh", "-c", LIST_SCRIPT, "sandboxd-list", path])


def _stderr_note(result: CommandResult) -> str:
    said = result.stderr_text.strip()
    return f" (the sandbox said: {said[-300:]})" if said else ""


def _raise_for_status(path: str, result: CommandResult, messages: dict[int, tuple[type[SandboxFileError], str]]) -> None:
    """Raises what the helper's exit status says; a helper that did not run to its
    end (timeout, memory, cancel, a sandbox failure) raises CommandFailed."""
    if result.timed_out or result.oom_killed or result.status == "cancelled" or result.exit_code < 0:
        result.check()
    known = messages.get(result.exit_code)
    if known is not None:
        cls, message = known
        raise cls(message.format(path=path, parent=posixpath.dirname(path) or "/") + _stderr_note(result), path,
                  result.tool_call_id)
    result.check()


def _truncated(path: str, result: CommandResult, what: str) -> SandboxOutputTruncated:
    return SandboxOutputTruncated(f"{path}: the {what} is larger than the command's output cap (the policy's "
                                  "process.maxStdoutBytes, or max_bytes)", path, result.tool_call_id)


_READ = {EXIT_NOT_FOUND: (SandboxFileNotFound, "{path}: no such file in the sandbox (absent, outside its roots, "
                                               "or blocked)"),
         EXIT_IS_A_DIRECTORY: (SandboxIsADirectory, "{path}: is a directory in the sandbox"),
         EXIT_NO_PERMISSION: (SandboxPermissionError, "{path}: the sandbox's user may not read it")}
_WRITE = {EXIT_NOT_FOUND: (SandboxFileNotFound, "{parent}: no such directory in the sandbox (parents=True makes it)"),
          EXIT_IS_A_DIRECTORY: (SandboxIsADirectory, "{path}: is a directory in the sandbox"),
          EXIT_NOT_A_DIRECTORY: (SandboxNotADirectory, "{parent}: not a directory in the sandbox"),
          EXIT_CANNOT_WRITE: (PathNotWritable, "{path}: the sandbox refused the write")}
_LIST = {EXIT_NOT_FOUND: (SandboxFileNotFound, "{path}: no such directory in the sandbox (absent, outside its "
                                               "roots, or blocked)"),
         EXIT_NOT_A_DIRECTORY: (SandboxNotADirectory, "{path}: not a directory in the sandbox"),
         EXIT_NO_PERMISSION: (SandboxPermissionError, "{path}: the sandbox's user may not list it")}


def read_outcome(path: str, result: CommandResult) -> bytes:
    _raise_for_status(path, result, _READ)
    if result.stdout_truncated:
        raise _truncated(path, result, "file")
    return result.stdout


def write_outcome(path: str, result: CommandResult) -> None:
    _raise_for_status(path, result, _WRITE)


def _kind(mode: int) -> FileKind:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def parse_listing(directory: str, stdout: bytes) -> list[FileEntry]:
    """LIST_SCRIPT's output as entries, sorted by name."""
    head, sep, tail = stdout.rpartition(b"\x00")
    names = head.split(b"\x00") if sep else []
    lines = tail.decode("ascii").splitlines()
    if len(names) != len(lines):
        raise SandboxdClientError(f"{directory}: {len(names)} names but {len(lines)} stat lines: the directory "
                                  "changed while it was listed; list it again")
    entries = []
    for raw_name, line in zip(names, lines):
        name = raw_name.removeprefix(b"./").decode("utf-8", "surrogateescape")
        mode_hex, size, modified = line.split()
        mode = int(mode_hex, 16)
        entries.append(FileEntry(name, posixpath.join(directory, name), _kind(mode), int(size), stat.S_IMODE(mode),
                                 int(modified)))
    return sorted(entries, key=lambda e: e.name)


def list_outcome(path: str, result: CommandResult) -> list[FileEntry]:
    _raise_for_status(path, result, _LIST)
    if result.stdout_truncated:
        raise _truncated(path, result, "listing")
    return parse_listing(path, result.stdout)
