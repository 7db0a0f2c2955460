"""`sandboxctl`'s arguments. The connection options (--socket, --tcp, --tls-*, --context,
--config) are taken before the command or after it, by every command."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .cli_exec import cmd_exec
from .cli_live import cmd_cancel, cmd_logs, cmd_pool, cmd_ps
from .cli_records import cmd_artifact_get, cmd_artifact_ls, cmd_audit, cmd_diff, cmd_explain, cmd_trace, point_in_time
from .cli_setup import CONTEXT_COMMANDS, cmd_context
from .cli_transfer import cmd_cp
from .client import default_socket
from .completion import SCRIPTS


def connection_options() -> argparse.ArgumentParser:
    """Unset unless given (SUPPRESS): a command's own copy never hides the one given
    before the command."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    none = argparse.SUPPRESS
    g.add_argument("--socket", default=none, help=f"daemon socket (default $SANDBOXD_SOCKET or {default_socket()})")
    g.add_argument("--tcp", default=none, metavar="HOST:PORT",
                   help="the daemon's mutual-TLS listener instead of the socket (with --tls-*)")
    g.add_argument("--tls-ca", default=none, help="CA certificate that signed the daemon's (PEM)")
    g.add_argument("--tls-cert", default=none, help="this client's certificate (PEM)")
    g.add_argument("--tls-key", default=none, help="this client's private key (PEM)")
    g.add_argument("--context", default=none, help="a named context of the client config file ($SANDBOXD_CONTEXT)")
    g.add_argument("--config", default=none,
                   help="client config file (default $SANDBOXD_CLIENT_CONFIG or ~/.config/sandboxd/client.yaml)")
    return p


def _raw(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw", action="store_true", help="the sandbox's bytes as they are on a terminal too (there, "
                   "by default, control characters but newline and tab are shown as escapes)")


def _exec(sub, conn) -> None:
    p = sub.add_parser("exec", parents=[conn], help="run a command in a fresh (or leased) sandbox")
    p.add_argument("--workspace", help="host workspace directory (default: the current directory)")
    p.add_argument("--policy", help="SandboxPolicy as JSON or YAML (camelCase names); a flag below fills what "
                   "it leaves unset and is refused where it says otherwise")
    p.add_argument("--image", help="image to run (an allowed one; default: the daemon's default_image)")
    p.add_argument("--adapter", help="docker (default) or nsjail")
    p.add_argument("--lease", help="run in this leased warm sandbox (`sandboxctl pool acquire`)")
    p.add_argument("--cwd", help="working directory inside the sandbox")
    p.add_argument("--timeout-ms", type=int, help="kill the command after this many milliseconds "
                   "(policy.process.timeoutMs; exit 124)")
    p.add_argument("--memory-mb", type=int, help="memory limit in MiB (policy.process.maxMemoryMb; exit 137 "
                   "when it is passed)")
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE", help="set in the command's environment "
                   "(policy.environment.injectedEnv); repeatable")
    p.add_argument("-w", "--write", action="append", metavar="PATH", help="a write root: relative to /workspace "
                   "or absolute (policy.filesystem.writeRoots); repeatable; /workspace stays readable")
    p.add_argument("--network", metavar="none|open|DOMAIN,...", help="no network, open network, or only these "
                   "domains through the egress proxy (exact or *.suffix)")
    p.add_argument("--read-only", action="store_true", help="the workspace read-only: a read root, no write roots")
    p.add_argument("--stdin", action="store_true", help="pass this process's stdin to the command")
    p.add_argument("--json", action="store_true", help="print the ToolResult as JSON after the output")
    p.add_argument("--result-json", metavar="FILE", help="write the ToolResult as JSON to FILE (not to stdout)")
    _raw(p)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_exec)


def _cp(sub, conn) -> None:
    p = sub.add_parser("cp", parents=[conn], help="copy files into or out of a workspace or a leased sandbox: "
                       "`cp SRC LEASE_ID:/path`, `cp WORKSPACE_DIR:/path DST`")
    p.add_argument("src", metavar="SRC", help="a local path, LEASE_ID:/path or WORKSPACE_DIR:/path")
    p.add_argument("dst", metavar="DST", help="the same forms; exactly one side names a sandbox")
    p.add_argument("--policy", help="a workspace's SandboxPolicy as JSON or YAML: the roots that apply (default for "
                   "an upload: the deepest existing directory holding the destination writable)")
    p.add_argument("-w", "--write", action="append", metavar="PATH", help="a write root for an upload to a "
                   "workspace: relative to /workspace or absolute (policy.filesystem.writeRoots); repeatable")
    p.add_argument("--json", action="store_true", help="print the TransferResult as JSON")
    p.set_defaults(func=cmd_cp)


def _live(sub, conn) -> None:
    p = sub.add_parser("ps", parents=[conn], help="your running calls and the leases you hold (an admin: all)")
    p.add_argument("-q", "--quiet", action="store_true", help="call ids only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("logs", parents=[conn], help="a call's output: stored, or live with -f")
    p.add_argument("call_id", metavar="CALL_ID")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the call ends")
    p.add_argument("--since-byte", type=int, default=0, metavar="N",
                   help="skip the first N bytes of stdout and of stderr")
    _raw(p)
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("cancel", parents=[conn], help="cancel running calls (their sandboxes are removed)")
    p.add_argument("call_ids", nargs="+", metavar="CALL_ID")
    p.add_argument("--reason", help="kept in the call's recorded result")
    p.set_defaults(func=cmd_cancel)


def _records(sub, conn) -> None:
    p = sub.add_parser("artifact", parents=[conn], help="artifacts of calls")
    asub = p.add_subparsers(dest="artifact_command", required=True)
    g = asub.add_parser("get", parents=[conn], help="download an artifact and verify its sha256")
    g.add_argument("artifact_id")
    g.add_argument("-o", "--output", help="file to write (default: stdout)")
    _raw(g)
    g.set_defaults(func=cmd_artifact_get)
    ls = asub.add_parser("ls", parents=[conn], help="list a call's artifacts")
    ls.add_argument("tool_call_id")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_artifact_ls)
    p = sub.add_parser("diff", parents=[conn], help="what a call changed in its write roots, as a unified diff")
    p.add_argument("tool_call_id", metavar="CALL_ID")
    _raw(p)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("trace", parents=[conn], help="a call's event chain: `trace CALL_ID`, `trace verify`, "
                       "`trace export`")
    p.add_argument("target", metavar="CALL_ID|verify|export")
    p.add_argument("--json", action="store_true", help="one JSON object per event (JSONL)")
    p.add_argument("-v", "--verbose", action="store_true", help="show payloads")
    p.add_argument("--file", help="verify: check this exported JSONL file offline instead of the daemon's log")
    p.add_argument("--checkpoints", help="verify --file: also hold it against this checkpoints.jsonl")
    p.add_argument("-o", "--output", help="export: write JSONL here (default: stdout)")
    p.add_argument("--call", help="export: only this call's events")
    p.add_argument("--after-seq", type=int, default=0, help="export: only events after this log position")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("explain", parents=[conn], help="show what a policy would materialize to, without running")
    p.add_argument("--policy", help="SandboxPolicy as JSON or YAML (camelCase names)")
    p.add_argument("--workspace", help="host workspace directory (default: the current directory)")
    p.add_argument("--image", help="image to run (an allowed one; default: the daemon's default_image)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)


def _audit(sub, conn) -> None:
    p = sub.add_parser("audit", parents=[conn], help="forensic queries over recorded calls, newest first")
    p.add_argument("--command", help="substring of the command line")
    p.add_argument("--path", help="a sandbox path touched (relative: under /workspace), or anything below it")
    p.add_argument("--op", help="with --path: read|write|create|delete|rename|chmod|upload|download")
    p.add_argument("--domain", help="a host contacted: exact or *.suffix")
    p.add_argument("--principal")
    p.add_argument("--proposed-by", help="the agent or client that proposed the call (its proposedBy), exactly")
    p.add_argument("--session", help="the call's sessionId, exactly")
    p.add_argument("--workspace")
    p.add_argument("--status", help="running|success|error|partial|cancelled|rejected")
    p.add_argument("--since", type=point_in_time, help="RFC 3339, or a time ago (30s, 15m, 1h, 2d, 1w); inclusive")
    p.add_argument("--until", type=point_in_time, help="RFC 3339, or a time ago (30s, 15m, 1h, 2d, 1w); exclusive")
    p.add_argument("--limit", type=int, default=0, help="page size (default 50, at most 500)")
    p.add_argument("--page-token", help="from the previous page")
    p.add_argument("--json", action="store_true", help="one JSON object per call")
    p.set_defaults(func=cmd_audit)


def _pool(sub, conn) -> None:
    p = sub.add_parser("pool", parents=[conn], help="warm sandboxes: `pool ls|create|acquire|release LEASE|drain`")
    psub = p.add_subparsers(dest="pool_command", required=True)
    pl = psub.add_parser("ls", parents=[conn], help="pools and their sandboxes (admin)")
    pl.add_argument("--json", action="store_true")
    pa = psub.add_parser("acquire", parents=[conn], help="lease a warm sandbox; prints the lease id")
    pc = psub.add_parser("create", parents=[conn], help="make a pool and warm it, so that the first lease is warm too")
    for sp in (pa, pc):  # the same sandbox either way
        sp.add_argument("--workspace", help="host workspace directory (default: the current directory)")
        sp.add_argument("--policy", help="SandboxPolicy as JSON or YAML: the part that fixes the sandbox")
        sp.add_argument("--image", help="image to run (an allowed one; default: the daemon's default_image)")
        sp.add_argument("--adapter", help="docker (default) or nsjail")
        sp.add_argument("--json", action="store_true")
    pa.add_argument("--lease-ms", type=int, default=0)
    pa.add_argument("--wait-ms", type=int, default=0, help="wait for a sandbox when the pool is full")
    pr = psub.add_parser("release", parents=[conn], help="end a lease (its sandbox is destroyed)")
    pr.add_argument("lease_id")
    pd = psub.add_parser("drain", parents=[conn], help="destroy a pool's sandboxes (admin)")
    pd.add_argument("pool_key", nargs="?")
    p.set_defaults(func=cmd_pool)


def _setup(sub, conn) -> None:
    p = sub.add_parser("context", parents=[conn], help="named daemons of the client config file: `context ls|use|set|rm`")
    csub = p.add_subparsers(dest="context_command", required=True)
    helps = {"ls": "the contexts (* marks the one in use)", "use": "make NAME the current context",
             "set": "make or replace NAME from --socket, or --tcp with --tls-ca/--tls-cert/--tls-key",
             "rm": "remove NAME"}
    for name in CONTEXT_COMMANDS:
        c = csub.add_parser(name, parents=[conn], help=helps[name])
        if name == "ls":
            c.add_argument("--json", action="store_true")
        else:
            c.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_context)
    p = sub.add_parser("completion", parents=[conn], help="print a shell completion script: `source <(sandboxctl completion bash)`")
    p.add_argument("shell", choices=sorted(SCRIPTS))
    p.set_defaults(func=cmd_completion)


def cmd_completion(args: argparse.Namespace) -> int:
    """The script completes what the parser offers: here, beside it (no import back)."""
    sys.stdout.write(SCRIPTS[args.shell](build_parser()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    conn = connection_options()
    parser = argparse.ArgumentParser(prog="sandboxctl", parents=[conn], description="Client for the sandboxd daemon.")
    parser.add_argument("--version", action="version", version=f"sandboxctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _exec(sub, conn)
    _cp(sub, conn)
    _live(sub, conn)
    _records(sub, conn)
    _audit(sub, conn)
    _pool(sub, conn)
    _setup(sub, conn)
    return parser
