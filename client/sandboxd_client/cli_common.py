"""What every `sandboxctl` command shares: exit codes, refusals on stderr, policy files,
the connection (contexts.py decides where to), and text safe on a terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
import yaml

from .client import SandboxdClient
from .contexts import resolve_target
from .errors import SandboxdClientError
from .terminal import visible
from sandboxd_contract.pb import sandboxd_pb2 as pb

EXIT_REFUSED = 125
EXIT_TIMEOUT = 124
EXIT_OOM = 137
EXIT_CANCELLED = 130


def fail(message: str, code: int = EXIT_REFUSED) -> int:
    """The reason on stderr, its control characters shown (it may echo a sandbox's
    path or a daemon's message that does), piped or not."""
    print(f"sandboxctl: {visible(message)}", file=sys.stderr)
    return code


# What gRPC says when nothing listens where the client points (no socket, or refused).
_NOT_LISTENING = ("failed to connect to all addresses", "Connection refused", "No such file or directory")


def rpc_failed(exc: SandboxdClientError, code: int = 1) -> int:
    suffix = f" (call {exc.tool_call_id})" if exc.tool_call_id else ""
    if exc.code == grpc.StatusCode.UNAVAILABLE and any(sign in exc.message for sign in _NOT_LISTENING):
        suffix += ("\nsandboxctl: is sandboxd running, or still starting? Start it with `make run` (a checkout) or "
                   "`sandboxd`; `sandboxctl context ls` shows where this client points")
    return fail(f"{exc.code.name}: {exc.message}{suffix}", code)


def load_policy(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    data = yaml.safe_load(text)  # YAML is a superset of JSON
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a policy must be a mapping")
    return data


def exit_code_for(result: pb.ToolResult) -> int:
    if result.timed_out:
        return EXIT_TIMEOUT
    if result.oom_killed:
        return EXIT_OOM
    if result.status == "cancelled":
        return EXIT_CANCELLED
    if result.exit_code < 0:  # the sandbox failed before or around the command
        return EXIT_REFUSED
    return result.exit_code


def workspace_of(args: argparse.Namespace) -> str:
    return os.path.abspath(getattr(args, "workspace", None) or os.getcwd())


def connect(args: argparse.Namespace) -> SandboxdClient:
    """The daemon the flags, the named context or the environment point at."""
    target = resolve_target(args, os.environ)
    if target.tls is not None:
        return SandboxdClient(target=target.address, tls=target.tls)
    return SandboxdClient(target.socket)


def shown(text: Any) -> str:
    """A name from a sandbox, safe on a terminal: a file may be called "x\n... ok" or
    hold escape sequences, and must not forge or erase a line of the trace. JSON escapes
    C0 controls only: DEL, C1 controls and bidi overrides are escaped as well."""
    return visible(json.dumps(str(text), ensure_ascii=False)[1:-1])


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def print_table(rows: Sequence[Sequence[str]], last_free: bool = True) -> None:
    """Columns padded to their widest cell; the last one (a command, a path) unpadded."""
    fixed = len(rows[0]) - 1 if last_free else len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(fixed)]
    for r in rows:
        cells = [v.ljust(w) for v, w in zip(r, widths)] + (list(r[fixed:]) if last_free else [])
        print("  ".join(cells).rstrip())


def dump_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
