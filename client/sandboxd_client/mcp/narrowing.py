"""What a tool call may ask of the operator's policy: less, never more. The operator fixes
the SandboxPolicy when the server starts (config.py); a model's arguments can only pick a
shorter timeout, a working directory and paths the policy already shows. Anything beyond
it is refused here by name, before a call is sent (and the daemon, which enforces the
policy in the sandbox, would refuse or fail it anyway: this is the first of two walls).

Paths are sandbox paths: relative ones are under /workspace, as the daemon reads them."""

from __future__ import annotations

import copy
import posixpath
from dataclasses import dataclass
from typing import Any

WORKSPACE = "/workspace"
DEFAULT_TEMP_DIR = "/tmp"


class Refusal(Exception):
    """A tool call the operator's policy does not allow; `argument` names what asked for it."""

    def __init__(self, argument: str, reason: str):
        super().__init__(f"{argument}: {reason}")
        self.argument = argument
        self.reason = reason


def within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def normalized(path: str) -> str:
    """An absolute, normalized sandbox path (relative: under /workspace). Lexical only:
    the sandbox resolves symlinks itself (tools.py's scripts check where they lead)."""
    joined = posixpath.normpath(posixpath.join(WORKSPACE, path))
    # normpath keeps a leading "//" (POSIX allows it a meaning); a sandbox path never has one.
    return "/" + joined.lstrip("/")


def _roots(policy_fs: dict[str, Any] | None, key: str) -> tuple[str, ...]:
    if policy_fs is None:
        return (WORKSPACE,) if key == "readRoots" else ()
    return tuple(normalized(str(r)) for r in policy_fs.get(key) or ())


@dataclass(frozen=True)
class OperatorPolicy:
    """The operator's SandboxPolicy (proto JSON, camelCase) and what a tool call is checked
    against: its roots as normalized sandbox paths and its timeout, the ceiling."""

    policy: dict[str, Any]
    timeout_ms: int
    read_roots: tuple[str, ...]
    write_roots: tuple[str, ...]
    blocked_paths: tuple[str, ...]
    temp_dir: str

    @classmethod
    def of(cls, policy: dict[str, Any], default_timeout_ms: int) -> "OperatorPolicy":
        """The policy with its timeout written out: `process.timeoutMs` when it has one,
        else `default_timeout_ms` (so the daemon and this server agree on the ceiling)."""
        policy = copy.deepcopy(policy)
        process = policy.setdefault("process", {})
        timeout_ms = int(process.get("timeoutMs") or default_timeout_ms)
        if timeout_ms <= 0:
            raise ValueError("policy.process.timeoutMs must be positive")
        process["timeoutMs"] = timeout_ms
        fs = policy.get("filesystem")
        if fs is not None and not isinstance(fs, dict):
            raise ValueError("policy.filesystem must be a mapping")
        temp_dir = normalized(str((fs or {}).get("tempDir") or DEFAULT_TEMP_DIR))
        return cls(policy, timeout_ms, _roots(fs, "readRoots"), _roots(fs, "writeRoots"),
                   _roots(fs, "blockedPaths"), temp_dir)

    @property
    def writes_workspace(self) -> bool:
        return any(within(r, WORKSPACE) for r in self.write_roots)

    @property
    def egress(self) -> str:
        return str((self.policy.get("network") or {}).get("egress") or "none")

    @property
    def max_stdout_bytes(self) -> int:
        """The policy's stdout cap (0: the daemon's default)."""
        return int((self.policy.get("process") or {}).get("maxStdoutBytes") or 0)


def command_timeout(op: OperatorPolicy, requested_ms: int | None, *, argument: str = "timeout_ms",
                    default_ms: int | None = None) -> int:
    """The command's timeout: what the call asked for (at most the operator's), else
    `default_ms` (at most the operator's), else the operator's own."""
    if requested_ms is None:
        return min(default_ms, op.timeout_ms) if default_ms else op.timeout_ms
    if requested_ms > op.timeout_ms:
        raise Refusal(argument, f"{requested_ms} ms is more than the {op.timeout_ms} ms the operator's policy allows "
                                "(a tool call may shorten the timeout, never lengthen it)")
    return requested_ms


def command_policy(op: OperatorPolicy, timeout_ms: int, max_stdout_bytes: int | None = None) -> dict[str, Any]:
    """The operator's policy with this command's own parts (those a leased sandbox takes
    per command: the timeout, the stdout cap), never above the operator's."""
    if timeout_ms > op.timeout_ms:
        raise Refusal("timeout_ms", f"{timeout_ms} ms is more than the operator's {op.timeout_ms} ms")
    policy = copy.deepcopy(op.policy)
    policy["process"]["timeoutMs"] = timeout_ms
    if max_stdout_bytes is not None:
        ceiling = op.max_stdout_bytes
        policy["process"]["maxStdoutBytes"] = min(max_stdout_bytes, ceiling) if ceiling else max_stdout_bytes
    return policy


def _blocked(op: OperatorPolicy, path: str, argument: str) -> None:
    for blocked in op.blocked_paths:
        if within(path, blocked):  # (a directory above one is listed: the sandbox hides it)
            raise Refusal(argument, f"{path} is blocked by the operator's policy ({blocked})")


def workspace_path(op: OperatorPolicy, value: str, argument: str) -> str:
    """`value` as a sandbox path inside /workspace, and not blocked."""
    if "\x00" in value:
        raise Refusal(argument, "a path must not contain a NUL byte")
    if not value.strip():
        raise Refusal(argument, "a path must not be empty")
    path = normalized(value)
    if not within(path, WORKSPACE):
        raise Refusal(argument, f"{value!r} is outside the workspace ({path} is not under {WORKSPACE})")
    _blocked(op, path, argument)
    return path


def readable_path(op: OperatorPolicy, value: str, argument: str) -> str:
    path = workspace_path(op, value, argument)
    roots = op.read_roots + op.write_roots
    # A directory above the roots (/workspace when only parts are shown) is listed too:
    # the sandbox shows what of it lies under them.
    if not any(within(path, r) or within(r, path) for r in roots):
        shown = ", ".join(roots) or "none"
        raise Refusal(argument, f"{path} is not visible under the operator's policy (its roots: {shown})")
    return path


def writable_path(op: OperatorPolicy, value: str, argument: str) -> str:
    path = workspace_path(op, value, argument)
    if path == WORKSPACE:
        raise Refusal(argument, f"{path} is the workspace itself, not a file")
    if not any(within(path, r) for r in op.write_roots):
        roots = ", ".join(r for r in op.write_roots if within(r, WORKSPACE))
        reason = f"its write roots are {roots}" if roots else "it has no write roots in the workspace"
        raise Refusal(argument, f"{path} is outside what the operator's policy lets a call write ({reason})")
    return path
