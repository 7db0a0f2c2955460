"""`sandboxd-mcp`'s options, set by its operator (never by the model): the workspace, the
policy (a file, or presets as `sandboxctl exec` takes them), the image and backend,
where the daemon is, the caps on what tools return, and the transport. Parsed into one
ServerConfig; a contradiction or an unusable value is refused by name before anything
starts."""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..cli_common import load_policy
from ..cli_exec import policy_with_flags
from ..cli_parser import connection_options
from ..client import SandboxdClient
from ..contexts import resolve_target
from .capping import MIN_BUDGET_BYTES
from .narrowing import OperatorPolicy
from .tools import ToolLimits

DEFAULT_TIMEOUT_MS = 60_000
# A resource read of an artifact returns it whole up to this.
DEFAULT_RESOURCE_BYTES = 32 * 1024 * 1024


class UsageError(ValueError):
    """Options that cannot be served: the message names the option."""


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int
    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    allow_remote: bool = False
    path: str = "/mcp"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def mutual_tls(self) -> bool:
        return bool(self.tls_client_ca)


@dataclass(frozen=True)
class ServerConfig:
    workspace: str
    operator: OperatorPolicy
    image: str
    adapter: str
    limits: ToolLimits
    connection: argparse.Namespace
    lease: bool = True
    resource_bytes: int = DEFAULT_RESOURCE_BYTES
    http: HttpConfig | None = None

    def connect(self) -> SandboxdClient:
        """A new client for the daemon the connection options name (contexts.py)."""
        target = resolve_target(self.connection, os.environ)
        if target.tls is not None:
            return SandboxdClient(target=target.address, tls=target.tls)
        return SandboxdClient(target.socket)

    def daemon_address(self) -> str:
        target = resolve_target(self.connection, os.environ)
        return target.address if target.tls is not None else f"unix:{target.socket}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sandboxd-mcp", parents=[connection_options()],
        description="An MCP server whose tools run as sandboxd calls under the policy given here (docs/MCP.md).")
    p.add_argument("--version", action="version", version=f"sandboxd-mcp {__version__}")
    g = p.add_argument_group("the sandbox (fixed by the operator; a tool call can only narrow it)")
    g.add_argument("--workspace", help="host workspace directory (default: the current directory)")
    g.add_argument("--policy", help="SandboxPolicy as JSON or YAML (camelCase names); the flags below fill what it "
                   "leaves unset and are refused where they say otherwise")
    g.add_argument("-w", "--write", action="append", metavar="PATH",
                   help="a write root (relative to /workspace, or absolute); repeatable. Without one, the workspace "
                   "is read-only and write_file is not offered")
    g.add_argument("--read-only", action="store_true", help="the workspace read-only (the default without -w)")
    g.add_argument("--network", metavar="none|open|DOMAIN,...", help="no network (the default without a policy), "
                   "open network, or only these domains through the egress proxy")
    g.add_argument("--timeout-ms", type=int, help=f"each command's timeout, the most a tool call may ask for "
                   f"(default: the policy's, else {DEFAULT_TIMEOUT_MS})")
    g.add_argument("--memory-mb", type=int)
    g.add_argument("-e", "--env", action="append", metavar="NAME=VALUE", help="set in every command's environment")
    g.add_argument("--image", default="", help="sandbox image (default: the daemon's)")
    g.add_argument("--adapter", default="", choices=["", "docker", "nsjail"], help="backend (default: the daemon's)")
    g.add_argument("--no-lease", action="store_true", help="run every call in a fresh sandbox (no warm lease)")
    c = p.add_argument_group("what tools return and take")
    c.add_argument("--output-cap-bytes", type=int, default=ToolLimits.output_bytes,
                   help="per stream: longer output keeps its head and tail (the whole stays an artifact)")
    c.add_argument("--max-read-bytes", type=int, default=ToolLimits.read_bytes, help="read_file refuses larger files")
    c.add_argument("--max-write-bytes", type=int, default=ToolLimits.write_bytes,
                   help="write_file and run_command's stdin refuse more")
    c.add_argument("--max-resource-bytes", type=int, default=DEFAULT_RESOURCE_BYTES,
                   help="an artifact resource larger than this is refused (sandboxctl artifact get has it whole)")
    h = p.add_argument_group("streamable HTTP (default: stdio)")
    h.add_argument("--http", metavar="HOST:PORT", help="serve streamable HTTP at http(s)://HOST:PORT/mcp instead of "
                   "stdio (port 0: any free port, printed on stderr)")
    h.add_argument("--token-file", help="clients must send `Authorization: Bearer <the file's token>`")
    h.add_argument("--http-tls-cert", help="this server's certificate (PEM): serve HTTPS")
    h.add_argument("--http-tls-key", help="its private key (PEM)")
    h.add_argument("--http-client-ca", help="require a client certificate signed by this CA (mutual TLS)")
    h.add_argument("--allow-remote", action="store_true", help="listen on a non-loopback address (still only with "
                   "a token or mutual TLS)")
    return p


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--http {value!r}: expected HOST:PORT (e.g. 127.0.0.1:8765, [::1]:8765)")
    return host.strip("[]"), int(port)


def _http(args: argparse.Namespace) -> HttpConfig | None:
    tls_given = [f for f in ("http_tls_cert", "http_tls_key", "http_client_ca", "token_file", "allow_remote")
                 if getattr(args, f)]
    if not args.http:
        if tls_given:
            raise UsageError(f"--{tls_given[0].replace('_', '-')} goes with --http")
        return None
    host, port = _host_port(args.http)
    config = HttpConfig(host, port, args.token_file or "", args.http_tls_cert or "", args.http_tls_key or "",
                        args.http_client_ca or "", args.allow_remote)
    if bool(config.tls_cert) != bool(config.tls_key):
        raise UsageError("--http-tls-cert and --http-tls-key go together")
    if config.tls_client_ca and not config.tls_cert:
        raise UsageError("--http-client-ca (mutual TLS) needs --http-tls-cert and --http-tls-key")
    if not config.token_file and not config.mutual_tls:
        raise UsageError("--http needs --token-file or mutual TLS (--http-client-ca): an MCP endpoint runs commands, "
                         "it is never open")
    if not config.loopback and not config.allow_remote:
        raise UsageError(f"--http {args.http}: {host} is not a loopback address; give --allow-remote to listen there")
    return config


def _limits(args: argparse.Namespace) -> ToolLimits:
    for flag, value, floor in (("--output-cap-bytes", args.output_cap_bytes, MIN_BUDGET_BYTES),
                               ("--max-read-bytes", args.max_read_bytes, 1), ("--max-write-bytes", args.max_write_bytes, 1),
                               ("--max-resource-bytes", args.max_resource_bytes, 1)):
        if value < floor:
            raise UsageError(f"{flag} {value}: must be at least {floor}")
    return ToolLimits(output_bytes=args.output_cap_bytes, read_bytes=args.max_read_bytes,
                      write_bytes=args.max_write_bytes)


def operator_policy(args: argparse.Namespace) -> OperatorPolicy:
    policy: dict[str, Any] = load_policy(args.policy) if args.policy else {}
    if args.timeout_ms is not None and args.timeout_ms <= 0:
        raise UsageError(f"--timeout-ms {args.timeout_ms}: must be positive")
    try:
        policy = policy_with_flags(policy, env=args.env or (), write=args.write or (), network=args.network,
                                   read_only=args.read_only, timeout_ms=args.timeout_ms, memory_mb=args.memory_mb)
    except ValueError as exc:  # FlagConflict: a flag that says otherwise than the file
        raise UsageError(str(exc)) from None
    return OperatorPolicy.of(policy, DEFAULT_TIMEOUT_MS)


def server_config(argv: list[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    workspace = os.path.abspath(args.workspace or os.getcwd())
    if not os.path.isdir(workspace):
        raise UsageError(f"--workspace {workspace}: not a directory")
    return ServerConfig(workspace=workspace, operator=operator_policy(args), image=args.image, adapter=args.adapter,
                        limits=_limits(args), connection=args, lease=not args.no_lease,
                        resource_bytes=args.max_resource_bytes, http=_http(args))
