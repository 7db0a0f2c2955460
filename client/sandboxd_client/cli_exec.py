"""`sandboxctl exec`: the flags made into the call's policy, the call streamed to this
terminal, its result as the exit code (and as JSON with --json / --result-json).

A flag fills a field the policy file leaves unset; where the file sets that field to
something else, the flag contradicts it and the command is refused naming both (a policy
file is often written by someone else: a flag must never quietly widen or change it)."""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from typing import Any

from .cli_common import EXIT_CANCELLED, connect, dump_json, exit_code_for, fail, load_policy, rpc_failed, workspace_of
from .client import to_json
from .errors import SandboxdClientError
from .local_files import write_whole
from .terminal import Sink, sink, visible
from sandboxd_contract.pb import sandboxd_pb2 as pb

WORKSPACE = "/workspace"
_SECTIONS = ("filesystem", "network", "environment", "process")


class FlagConflict(ValueError):
    """A flag that contradicts the policy file (or another flag): the message names both."""


def parse_network(value: str) -> tuple[str, list[str]]:
    """--network none | open | DOMAIN,DOMAIN,... -> (egress, allowDomains)."""
    if value in ("none", "open"):
        return value, []
    domains = [d.strip() for d in value.split(",")]
    if not value or not all(domains):
        raise FlagConflict(f"--network {value!r}: expected none, open or DOMAIN[,DOMAIN...] (no empty names)")
    return "allowlist", domains


def _same(a: Any, b: Any) -> bool:
    """Policy values as a file may spell them (5000 or "5000")."""
    return str(a) == str(b)


def _fill(section: dict[str, Any], key: str, value: Any, flag: str, field: str, show: bool = True) -> None:
    if key in section and section[key] is not None and not _same(section[key], value):
        given = f" ({dump_json(section[key])})" if show else ""  # (an env value may be a secret)
        raise FlagConflict(f"{flag} contradicts {field}{given} of the policy file: drop the flag or change the file")
    section[key] = value


def _fill_roots(fs: dict[str, Any], key: str, roots: list[str], flag: str) -> None:
    given = fs.get(key)
    if given is not None and sorted(map(str, given)) != sorted(roots):
        raise FlagConflict(f"{flag} contradicts policy.filesystem.{key} ({dump_json(given)}) of the policy file: "
                           "drop the flag or change the file")
    fs[key] = roots


def _filesystem(policy: dict[str, Any], write: Sequence[str], read_only: bool) -> None:
    if read_only and write:
        raise FlagConflict("--read-only contradicts -w/--write: give one")
    if not write and not read_only:
        return
    if policy.get("filesystem") is None:
        # No section in the file means /workspace read-only; a section is taken
        # literally, so the default view is written out beside the flag's roots.
        policy["filesystem"] = {"readRoots": [WORKSPACE]}
    fs = policy["filesystem"]
    if read_only:
        _fill_roots(fs, "writeRoots", [], "--read-only")
        if fs.get("readRoots") is None:
            fs["readRoots"] = [WORKSPACE]
        return
    if any(not p for p in write):
        raise FlagConflict("-w/--write: a path is empty")
    _fill_roots(fs, "writeRoots", list(write), "-w/--write " + " ".join(write))


def _network(policy: dict[str, Any], value: str | None) -> None:
    if value is None:
        return
    egress, domains = parse_network(value)
    net = policy.setdefault("network", {})
    _fill(net, "egress", egress, f"--network {value}", "policy.network.egress")
    given = net.get("allowDomains")
    if given and sorted(map(str, given)) != sorted(domains):
        raise FlagConflict(f"--network {value} contradicts policy.network.allowDomains ({dump_json(given)}) of the "
                           "policy file: drop the flag or change the file")
    if domains:
        net["allowDomains"] = domains


def _environment(policy: dict[str, Any], env: Sequence[str]) -> None:
    if not env:
        return
    environment = policy.setdefault("environment", {})
    if environment.get("injectedEnv") is None:
        environment["injectedEnv"] = {}
    injected = environment["injectedEnv"]
    if not isinstance(injected, dict):
        raise ValueError("policy.environment.injectedEnv must be a mapping of names to values")
    for item in env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise FlagConflict(f"-e/--env {item!r}: expected NAME=VALUE")
        _fill(injected, name, value, f"-e {name}=...", f"policy.environment.injectedEnv.{name}",
              show=False)


def policy_with_flags(policy: dict[str, Any], *, env: Sequence[str] = (), write: Sequence[str] = (),
                      network: str | None = None, read_only: bool = False, timeout_ms: int | None = None,
                      memory_mb: int | None = None) -> dict[str, Any]:
    """The policy file's content with exec's flags in it (a new dict; raises
    FlagConflict naming the flag and the field it contradicts)."""
    out = copy.deepcopy(policy)
    for section in _SECTIONS:
        if section in out and out[section] is not None and not isinstance(out[section], dict):
            raise ValueError(f"policy.{section} must be a mapping")
        if section in out and out[section] is None:
            del out[section]  # "process:" with nothing under it
    _filesystem(out, write, read_only)
    _network(out, network)
    _environment(out, env)
    if timeout_ms is not None or memory_mb is not None:
        process = out.setdefault("process", {})
        if timeout_ms is not None:
            _fill(process, "timeoutMs", timeout_ms, f"--timeout-ms {timeout_ms}", "policy.process.timeoutMs")
        if memory_mb is not None:
            _fill(process, "maxMemoryMb", memory_mb, f"--memory-mb {memory_mb}", "policy.process.maxMemoryMb")
    return out


def exec_call(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The PreparedToolCall (JSON form) exec sends."""
    policy = load_policy(args.policy) if args.policy else {}
    policy = policy_with_flags(policy, env=args.env or (), write=args.write or (), network=args.network,
                               read_only=args.read_only, timeout_ms=args.timeout_ms, memory_mb=args.memory_mb)
    call: dict[str, Any] = {
        "toolId": "sandboxctl.exec",
        "argv": argv,
        "workspace": workspace_of(args),
        "policy": policy,
        "authorization": {"status": "not_required"},
        "runtime": {"image": args.image or "", "adapter": args.adapter or "", "leaseId": args.lease or ""},
    }
    if args.cwd:
        call["cwd"] = args.cwd
    return call


def write_result_json(path: str, result: pb.ToolResult) -> None:
    """Whole or not at all (a reader never finds half a result), readable by its owner,
    under a name no one else can plant a link at."""
    write_whole(path, lambda f: f.write(dump_json(to_json(result)).encode() + b"\n"), mode=0o600)


def _stream(client: Any, call: dict[str, Any], out: Sink, err: Sink) -> tuple[pb.ToolResult | None, int | None]:
    """The call's output to `out` and `err` (this process's stdout and stderr, made
    visible on a terminal); (its result, or None and the exit code when it has none)."""
    stream = client.execute(call)
    result = None
    try:
        for event in stream:
            kind = event.WhichOneof("kind")
            if kind == "output":
                target = out if event.output.stream == pb.OUTPUT_STREAM_STDOUT else err
                target.write(event.output.data)
                target.flush()
            elif kind == "finished":
                result = event.finished.result
    except KeyboardInterrupt:
        stream.cancel()
        return None, fail("interrupted; the call was cancelled", EXIT_CANCELLED)
    except SandboxdClientError as exc:
        return None, rpc_failed(exc, 125)
    return result, None


def cmd_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv and args.argv[0] == "--" else args.argv
    if not argv:
        return fail("exec needs a command after --")
    try:
        call = exec_call(args, argv)
    except FlagConflict as exc:
        return fail(str(exc))
    if args.stdin:
        call["stdin"] = sys.stdin.buffer.read()
    out, err = sink(sys.stdout, args.raw), sink(sys.stderr, args.raw)
    with connect(args) as client:
        try:
            result, code = _stream(client, call, out, err)
        finally:
            out.close()
            err.close()
    if result is None:
        return code if code is not None else fail("the daemon ended the stream without a result")
    if args.result_json:
        write_result_json(args.result_json, result)
    if args.json:
        sys.stdout.buffer.write(dump_json(to_json(result)).encode() + b"\n")
        sys.stdout.buffer.flush()
    if result.status == "error" and result.exit_code < 0 and result.error.message:
        print(f"sandboxctl: {visible(result.error.code)}: {visible(result.error.message)}", file=sys.stderr)
    return exit_code_for(result)
