"""The tools, and what each runs in the sandbox. Every tool is a sandboxd call: the file
tools too run a small POSIX sh script in the sandbox (never on this host), so each is
policy-checked by the daemon, recorded on the trace and answered with artifacts. The
scripts resolve symlinks where the sandbox sees them and refuse a path that leads out of
/workspace; what the policy does not mount simply is not there.

A plan is pure: arguments (checked by arguments.py) and the operator's policy in, the
command and its per-command limits out, or a Refusal naming the argument."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .arguments import Field
from .narrowing import OperatorPolicy, command_timeout, readable_path, workspace_path, writable_path

# Exit codes the scripts below end with when they refuse (their reason on stderr, after
# "sandboxd-mcp: "): results.py reads them as refusals, not as a command's failure.
EXIT_OUTSIDE = 81
EXIT_MISSING = 82
EXIT_WRONG_KIND = 83
EXIT_TOO_LARGE = 84
EXIT_WRITE_FAILED = 85
REFUSAL_EXITS = {EXIT_OUTSIDE: "outside_workspace", EXIT_MISSING: "not_found", EXIT_WRONG_KIND: "wrong_kind",
                 EXIT_TOO_LARGE: "too_large", EXIT_WRITE_FAILED: "write_failed"}
# File tools answer quickly or not at all: this, or the operator's timeout when shorter.
FILE_TOOL_TIMEOUT_MS = 30_000
SH = "/bin/sh"

_PRELUDE = r"""
out() { code=$1; shift; printf 'sandboxd-mcp: %s\n' "$*" >&2; exit "$code"; }
inside() { case $1 in /workspace|/workspace/*) return 0;; esac; return 1; }
"""

READ_SCRIPT = _PRELUDE + r"""
p=$1 max=$2
r=$(readlink -f "$p" 2>/dev/null) || r=
[ -n "$r" ] && [ -e "$r" ] || out 82 "no such file: $p"
inside "$r" || out 81 "$p leads outside the workspace (to $r)"
[ -f "$r" ] || out 83 "$p is not a regular file"
s=$(stat -c %s "$r") || out 82 "cannot read $p"
[ "$s" -le "$max" ] || out 84 "$p is $s bytes, more than the $max bytes read_file returns (read parts of it with run_command: head, tail, sed -n)"
exec cat "$r"
"""

WRITE_SCRIPT = _PRELUDE + r"""
p=$1 mk=$2
d=${p%/*} n=${p##*/}
a=$d
while [ -n "$a" ] && [ ! -e "$a" ] && [ ! -L "$a" ]; do a=${a%/*}; done
ra=$(readlink -f "$a" 2>/dev/null) || ra=
inside "$ra" || out 81 "${a:-/} leads outside the workspace (to ${ra:-nowhere})"
if [ ! -d "$d" ]; then
  [ "$mk" = 1 ] || out 82 "no such directory: $d (create_dirs: true makes it)"
  e=$(mkdir -p "$d" 2>&1) || out 85 "cannot make $d: $e"
fi
rd=$(readlink -f "$d" 2>/dev/null) || rd=
inside "$rd" || out 81 "$d leads outside the workspace (to ${rd:-nowhere})"
t=$rd/$n
if [ -L "$t" ]; then
  t=$(readlink -f "$t" 2>/dev/null) || t=
  inside "$t" || out 81 "$p is a symlink that leads outside the workspace (to ${t:-nowhere})"
fi
[ -d "$t" ] && out 83 "$p is a directory"
m=$(stat -c %a "$t" 2>/dev/null) || m=644
tmp=$(mktemp "${t%/*}/.sandboxd-mcp.XXXXXX" 2>&1) || out 85 "cannot write in ${t%/*}: $tmp"
if ! cat > "$tmp"; then rm -f "$tmp"; out 85 "cannot write $p"; fi
chmod "$m" "$tmp" 2>/dev/null
e=$(mv -f "$tmp" "$t" 2>&1) || { rm -f "$tmp"; out 85 "cannot replace $p: $e"; }
"""

LIST_SCRIPT = _PRELUDE + r"""
p=$1 depth=$2
r=$(readlink -f "$p" 2>/dev/null) || r=
[ -n "$r" ] && [ -e "$r" ] || out 82 "no such directory: $p"
inside "$r" || out 81 "$p leads outside the workspace (to $r)"
[ -d "$r" ] || out 83 "$p is not a directory"
cd "$r" || out 82 "cannot enter $p"
if find . -maxdepth 0 -printf '' 2>/dev/null; then
  exec find . -mindepth 1 -maxdepth "$depth" -printf '%y %s %P\0'
fi
exec find . -mindepth 1 -maxdepth "$depth" \( -type d -exec printf 'd 0 %s\000' {} + \) \
  -o \( -type l -exec printf 'l 0 %s\000' {} + \) -o -exec printf 'f 0 %s\000' {} +
"""

SEARCH_SCRIPT = _PRELUDE + r"""
pat=$1 p=$2 fixed=$3 icase=$4 glob=$5
r=$(readlink -f "$p" 2>/dev/null) || r=
[ -n "$r" ] && [ -e "$r" ] || out 82 "no such file or directory: $p"
inside "$r" || out 81 "$p leads outside the workspace (to $r)"
if command -v rg >/dev/null 2>&1; then
  set -- --line-number --no-heading --with-filename --color=never --max-columns=400
  [ "$fixed" = 1 ] && set -- "$@" --fixed-strings
  [ "$icase" = 1 ] && set -- "$@" --ignore-case
  [ -n "$glob" ] && set -- "$@" --glob "$glob"
  exec rg "$@" -e "$pat" -- "$r"
fi
set -- -r -n -H -I
if [ "$fixed" = 1 ]; then set -- "$@" -F; else set -- "$@" -E; fi
[ "$icase" = 1 ] && set -- "$@" -i
[ -n "$glob" ] && set -- "$@" --include="$glob"
exec grep "$@" -e "$pat" -- "$r"
"""


@dataclass(frozen=True)
class ToolLimits:
    """The operator's caps on what a tool returns and takes (config.py)."""

    output_bytes: int = 16 * 1024
    read_bytes: int = 256 * 1024
    write_bytes: int = 1024 * 1024
    list_entries: int = 1000


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    fields: tuple[Field, ...]
    read_only: bool
    destructive: bool
    idempotent: bool
    open_world: bool = False


@dataclass(frozen=True)
class CommandPlan:
    """One sandboxd call: argv, cwd ("": the policy's, /workspace by default) and stdin,
    and its per-command limits."""

    tool: str
    argv: list[str]
    cwd: str
    timeout_ms: int
    stdin: bytes = b""
    max_stdout_bytes: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class TooLarge(Exception):
    """Input larger than the operator's cap: refused before anything is sent."""

    def __init__(self, argument: str, size: int, cap: int):
        super().__init__(f"{argument}: {size} bytes, more than the {cap} bytes the operator allows")
        self.argument = argument
        self.size = size
        self.cap = cap


_PATH = "a path in the workspace: relative to /workspace, or absolute under it"


def tool_specs(op: OperatorPolicy, limits: ToolLimits) -> list[ToolSpec]:
    """The tools this server offers under `op`: write_file only when the policy lets a
    call write in the workspace; annotations as the policy makes them true."""
    open_world = op.egress != "none"
    specs = [
        ToolSpec("run_command", "Run a command in the sandbox",
                 "Runs a command in the sandbox (the workspace at /workspace) under the operator's policy and "
                 "returns its exit code and output (long output is cut in the middle; the whole is an artifact "
                 "resource named in the result). `command` is an argv list, or a string run by `sh -c`. "
                 f"timeout_ms may shorten the operator's timeout ({op.timeout_ms} ms), never lengthen it.",
                 (Field("command", "command", "argv list (run as is) or a string (run by sh -c)", required=True),
                  Field("cwd", "string", f"working directory: {_PATH} (default /workspace)"),
                  Field("timeout_ms", "integer", f"at most {op.timeout_ms}", minimum=1),
                  Field("stdin", "string", "text given to the command's standard input")),
                 read_only=False, destructive=op.writes_workspace, idempotent=False, open_world=open_world),
        ToolSpec("read_file", "Read a file", "Returns a text file of the workspace (at most "
                 f"{limits.read_bytes} bytes; larger files are refused: read parts with run_command).",
                 (Field("path", "string", _PATH, required=True),), read_only=True, destructive=False, idempotent=True),
        ToolSpec("list_files", "List a directory", "Lists the files under a workspace directory: type, size "
                 "and path of each, to max_depth levels.",
                 (Field("path", "string", f"{_PATH} (default /workspace)"),
                  Field("max_depth", "integer", "levels to descend (default 2)", minimum=1, maximum=20)),
                 read_only=True, destructive=False, idempotent=True),
        ToolSpec("search_files", "Search file contents", "Searches the files under a workspace path for a "
                 "pattern (ripgrep where the image has it, else grep -E) and returns path:line:text matches.",
                 (Field("pattern", "string", "regular expression (or literal text with fixed_strings)", required=True,
                        max_chars=4096),
                  Field("path", "string", f"{_PATH} (default /workspace)"),
                  Field("glob", "string", "only files whose names match this glob, e.g. *.py", max_chars=1024),
                  Field("fixed_strings", "boolean", "the pattern is literal text"),
                  Field("ignore_case", "boolean", "match regardless of case")),
                 read_only=True, destructive=False, idempotent=True),
    ]
    if op.writes_workspace:
        specs.insert(2, ToolSpec(
            "write_file", "Write a file", "Writes text to a file of the workspace, replacing it whole (at most "
            f"{limits.write_bytes} bytes). Only paths under the policy's write roots "
            f"({', '.join(op.write_roots)}) can be written.",
            (Field("path", "string", _PATH, required=True),
             Field("content", "string", "the file's new content (UTF-8 text)", required=True),
             Field("create_dirs", "boolean", "make missing parent directories (default false)")),
            read_only=False, destructive=True, idempotent=True))
    return specs


def _run_command(op: OperatorPolicy, limits: ToolLimits, args: dict[str, Any]) -> CommandPlan:
    command = args["command"]
    argv = [SH, "-c", command] if isinstance(command, str) else command
    cwd = workspace_path(op, args["cwd"], "cwd") if "cwd" in args else ""
    stdin = args.get("stdin", "").encode()
    if len(stdin) > limits.write_bytes:
        raise TooLarge("stdin", len(stdin), limits.write_bytes)
    return CommandPlan("run_command", argv, cwd, command_timeout(op, args.get("timeout_ms")), stdin,
                       detail={"shell": isinstance(command, str)})


def _file_timeout(op: OperatorPolicy) -> int:
    return command_timeout(op, None, default_ms=FILE_TOOL_TIMEOUT_MS)


def _read_file(op: OperatorPolicy, limits: ToolLimits, args: dict[str, Any]) -> CommandPlan:
    path = readable_path(op, args["path"], "path")
    return CommandPlan("read_file", [SH, "-c", READ_SCRIPT, "sh", path, str(limits.read_bytes)], "",
                       _file_timeout(op), max_stdout_bytes=limits.read_bytes + 1, detail={"path": path})


def _write_file(op: OperatorPolicy, limits: ToolLimits, args: dict[str, Any]) -> CommandPlan:
    path = writable_path(op, args["path"], "path")
    content = args["content"].encode()
    if len(content) > limits.write_bytes:
        raise TooLarge("content", len(content), limits.write_bytes)
    mkdirs = "1" if args.get("create_dirs") else "0"
    return CommandPlan("write_file", [SH, "-c", WRITE_SCRIPT, "sh", path, mkdirs], "", _file_timeout(op),
                       content, detail={"path": path, "bytes": len(content)})


def _list_files(op: OperatorPolicy, limits: ToolLimits, args: dict[str, Any]) -> CommandPlan:
    path = readable_path(op, args.get("path", "."), "path")
    depth = args.get("max_depth", 2)
    return CommandPlan("list_files", [SH, "-c", LIST_SCRIPT, "sh", path, str(depth)], "", _file_timeout(op),
                       detail={"path": path, "max_depth": depth})


def _search_files(op: OperatorPolicy, limits: ToolLimits, args: dict[str, Any]) -> CommandPlan:
    path = readable_path(op, args.get("path", "."), "path")
    flags = ["1" if args.get(k) else "0" for k in ("fixed_strings", "ignore_case")]
    argv = [SH, "-c", SEARCH_SCRIPT, "sh", args["pattern"], path, *flags, args.get("glob", "")]
    return CommandPlan("search_files", argv, "", _file_timeout(op), detail={"path": path})


_PLANNERS = {"run_command": _run_command, "read_file": _read_file, "write_file": _write_file,
             "list_files": _list_files, "search_files": _search_files}


def plan(tool: str, op: OperatorPolicy, limits: ToolLimits, args: dict[str, Any]) -> CommandPlan:
    """The call `tool` makes for these (checked) arguments; raises Refusal or TooLarge."""
    return _PLANNERS[tool](op, limits, args)
