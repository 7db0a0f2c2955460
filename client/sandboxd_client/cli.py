"""`sandboxctl`: run a command in a sandbox, fetch artifacts, read traces, explain
policies. Exit codes follow `docker run` and `timeout`: the command's own code, 124
when the timeout killed it, 137 when it was killed for memory, 125 when sandboxd
refused or failed before the command ran."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from types import SimpleNamespace
from typing import Any

import yaml

from sandboxd_contract.canonical import GENESIS_HASH, check_checkpoints, event_hash, file_accesses, verify_chain
from .client import SandboxdClient, TlsFiles, default_socket, to_json
from .errors import SandboxdClientError
from sandboxd_contract.pb import sandboxd_pb2 as pb

EXIT_REFUSED = 125
EXIT_TIMEOUT = 124
EXIT_OOM = 137
EXIT_CANCELLED = 130


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


def _fail(message: str, code: int = EXIT_REFUSED) -> int:
    print(f"sandboxctl: {message}", file=sys.stderr)
    return code


def cmd_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv and args.argv[0] == "--" else args.argv
    if not argv:
        return _fail("exec needs a command after --")
    policy = load_policy(args.policy) if args.policy else {}
    for section in ("process", "environment"):
        if policy.get(section) is None:
            policy[section] = {}
        elif not isinstance(policy[section], dict):
            return _fail(f"{args.policy}: {section} must be a mapping")
    process = policy["process"]
    if args.timeout_ms:
        process["timeoutMs"] = args.timeout_ms
    if args.memory_mb:
        process["maxMemoryMb"] = args.memory_mb
    if args.env:
        injected = policy["environment"].setdefault("injectedEnv", {}) or {}
        policy["environment"]["injectedEnv"] = injected
        for item in args.env:
            name, sep, value = item.partition("=")
            if not sep:
                return _fail(f"--env {item!r}: expected NAME=VALUE")
            injected[name] = value
    call: dict[str, Any] = {
        "toolId": "sandboxctl.exec",
        "argv": argv,
        "workspace": os.path.abspath(args.workspace or os.getcwd()),
        "policy": policy,
        "authorization": {"status": "not_required"},
        "runtime": {"image": args.image or "", "adapter": args.adapter or "", "leaseId": args.lease or ""},
    }
    if args.cwd:
        call["cwd"] = args.cwd
    if args.stdin:
        call["stdin"] = sys.stdin.buffer.read()
    out, err = sys.stdout.buffer, sys.stderr.buffer
    with connect(args) as client:
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
            return _fail("interrupted; the call was cancelled", EXIT_CANCELLED)
        except SandboxdClientError as exc:
            suffix = f" (call {exc.tool_call_id})" if exc.tool_call_id else ""
            return _fail(f"{exc.code.name}: {exc.message}{suffix}")
    if result is None:
        return _fail("the daemon ended the stream without a result")
    if args.json:
        out.write(json.dumps(to_json(result), sort_keys=True).encode() + b"\n")
        out.flush()
    if result.status == "error" and result.exit_code < 0 and result.error.message:
        print(f"sandboxctl: {result.error.code}: {result.error.message}", file=sys.stderr)
    return exit_code_for(result)


def cmd_artifact_get(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            if args.output and args.output != "-":
                tmp = args.output + ".part"
                with open(tmp, "wb") as f:
                    ref = client.download_artifact(args.artifact_id, f)
                os.replace(tmp, args.output)
            else:
                ref = client.download_artifact(args.artifact_id, sys.stdout.buffer)
                sys.stdout.buffer.flush()
        except SandboxdClientError as exc:
            return _fail(f"{exc.code.name}: {exc.message}", 1)
    print(f"{ref.artifact_id} {ref.kind} {ref.size_bytes} bytes {ref.content_hash} (verified)", file=sys.stderr)
    return 0


def cmd_artifact_ls(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            refs = client.list_artifacts(args.tool_call_id)
        except SandboxdClientError as exc:
            return _fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        print(json.dumps([to_json(r) for r in refs], sort_keys=True))
    else:
        for r in refs:
            print(f"{r.artifact_id}\t{r.kind}\t{r.size_bytes}\t{r.content_hash}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    if args.target == "verify":
        return _trace_verify(args)
    if args.target == "export":
        return _trace_export(args)
    with connect(args) as client:
        try:
            events = client.get_trace(args.target)
        except SandboxdClientError as exc:
            return _fail(f"{exc.code.name}: {exc.message}", 1)
    bad = 0
    for e in events:
        ok = event_hash(e.seq, e.event_id, e.tool_call_id, e.type, e.time, e.parent_event_id,
                        e.payload_json, e.prev_hash) == e.hash
        bad += not ok
        if args.json:
            entry = to_json(e)
            entry["payload"] = json.loads(entry.pop("payloadJson"))
            entry["hashVerified"] = ok
            print(json.dumps(entry, sort_keys=True))
        else:
            payload = json.loads(e.payload_json)
            print(f"{e.seq:>8}  {e.time}  {e.type:<22} {e.event_id}  {'ok' if ok else 'HASH MISMATCH'}")
            if e.type == "NetworkAccessObserved" and not args.verbose:
                print("          " + network_line(payload))
            if e.type == "FileAccessObserved" and not args.verbose:
                print("          " + file_access_line(payload))
            if e.type == "ToolCallExpired" and not args.verbose:
                removed = payload.get("artifactsRemoved", [])
                print(f"          past the retention period ({payload.get('periodDays')} days): "
                      f"{len(removed)} artifact(s) and the call's index rows removed")
            if args.verbose:
                print("          " + json.dumps(payload, sort_keys=True))
    if bad:
        return _fail(f"{bad} event(s) do not match their hash", 1)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    filters = {k: v for k, v in {
        "command_contains": args.command, "path": args.path, "path_operation": args.op, "domain": args.domain,
        "principal": args.principal, "workspace": args.workspace, "status": args.status, "since": args.since,
        "until": args.until, "page_size": args.limit, "page_token": args.page_token}.items() if v}
    with connect(args) as client:
        try:
            page = client.query_calls(**filters)
        except SandboxdClientError as exc:
            return _fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        for c in page.calls:
            print(json.dumps(to_json(c), sort_keys=True))
        if page.next_page_token:
            print(json.dumps({"nextPageToken": page.next_page_token}))
        return 0
    rows = [("REQUESTED", "CALL", "PRINCIPAL", "STATUS", "EXIT", "DOMAINS", "COMMAND")]
    for c in page.calls:
        # Every cell escaped: a command's argv is the agent's, a domain the sandbox's.
        rows.append((shown(c.requested_at[:19].replace("T", " ")), shown(c.tool_call_id), shown(c.principal),
                     shown(c.status + (f" ({c.error_code})" if c.error_code else "")),
                     str(c.exit_code) if c.HasField("exit_code") else "-", shown(",".join(c.domains)) or "-",
                     _shorten(shown(c.command) or "(not recorded)", 60)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    if page.next_page_token:
        print(f"more: --page-token {page.next_page_token}")
    return 0


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def cmd_pool(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            if args.pool_command == "ls":
                pools = client.list_pools()
                if args.json:
                    for p in pools:
                        print(json.dumps(to_json(p), sort_keys=True))
                    return 0
                rows = [("POOL", "BACKEND", "IDLE", "LEASED", "MIN", "MAX", "CREATED", "DESTROYED", "WORKSPACE")]
                rows += [(p.pool_key, p.backend, str(p.idle), str(p.leased), str(p.min_idle), str(p.max_size),
                          str(p.created), str(p.destroyed), shown(p.workspace)) for p in pools]
                widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
                for r in rows:
                    print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
            elif args.pool_command == "acquire":
                policy = load_policy(args.policy) if args.policy else None
                lease = client.acquire_sandbox(os.path.abspath(args.workspace or os.getcwd()), policy,
                                               image=args.image or "", adapter=args.adapter or "",
                                               lease_ms=args.lease_ms, wait_ms=args.wait_ms)
                print(json.dumps(to_json(lease), sort_keys=True) if args.json else lease.lease_id)
            elif args.pool_command == "create":
                policy = load_policy(args.policy) if args.policy else None
                status = client.create_pool(os.path.abspath(args.workspace or os.getcwd()), policy,
                                            image=args.image or "", adapter=args.adapter or "")
                print(json.dumps(to_json(status), sort_keys=True) if args.json else status.pool_key)
            elif args.pool_command == "release":
                client.release_sandbox(args.lease_id)
            elif args.pool_command == "drain":
                print(f"destroyed {client.drain_pools(args.pool_key or '')} sandboxes")
        except SandboxdClientError as exc:
            return _fail(f"{exc.code.name}: {exc.message}", 1)
    return 0


def shown(text: Any) -> str:
    """A name from a sandbox, safe on a terminal: a file may be called "x\n... ok" or
    hold escape sequences, and must not forge or erase a line of the trace."""
    return json.dumps(str(text), ensure_ascii=False)[1:-1]


def file_access_line(p: dict, listed: int = 3) -> str:
    """One FileAccessObserved payload, for people: how many of each operation, the first
    paths, and why the record may be incomplete."""
    accesses = file_accesses(p)
    counts = Counter(shown(a.get("operation", "?")) for a in accesses)
    parts = []
    if accesses:
        first = ", ".join(f"{shown(a.get('operation', '?'))} {shown(a['path'])}"
                          + (f" -> {shown(a['renamedTo'])}" if a.get("renamedTo") else "") for a in accesses[:listed])
        more = f", and {len(accesses) - listed} more" if len(accesses) > listed else ""
        parts.append(", ".join(f"{n} {op}" for op, n in sorted(counts.items())) + f": {first}{more}")
    parts += [f"incomplete: {shown(reason)}" for reason in p.get("incomplete") or []]
    return "; ".join(parts) or "no accesses"


def network_line(p: dict) -> str:
    """One NetworkAccessObserved payload, for people."""
    if "dropped" in p:
        return f"{p['dropped']} more connection(s), counted but not recorded"
    where = f"{shown(p.get('host', ''))}:{shown(p.get('port', ''))}"
    if p.get("address") and p.get("address") != p.get("host"):
        where += f" ({shown(p['address'])})"
    line = f"{shown(p.get('decision', '?'))} {shown(p.get('protocol', ''))} {where}  rule {shown(p.get('rule', ''))}"
    if p.get("decision") == "allowed":
        line += f"  up {p.get('bytesUp', 0)} B, down {p.get('bytesDown', 0)} B"
    if p.get("reason") or p.get("error"):
        line += f"  - {shown(p.get('reason') or p.get('error'))}"
    return line


def _trace_verify(args: argparse.Namespace) -> int:
    """The daemon's whole log, or (with --file) an exported JSONL file, offline."""
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            events = [SimpleNamespace(**_export_fields(json.loads(line))) for line in f if line.strip()]
        first = events[0] if events else None
        report = verify_chain(events, first.prev_hash if first else GENESIS_HASH, first.seq - 1 if first else 0)
        if report.ok and args.checkpoints:
            # The daemon's checkpoints.jsonl (or a copy shipped elsewhere): the export
            # must reach, and agree with, every head the daemon wrote down.
            with open(args.checkpoints, encoding="utf-8") as f:
                marks = [SimpleNamespace(**json.loads(line)) for line in f if line.strip()]
            last = events[-1].seq if events else 0
            report = check_checkpoints({e.seq: e.hash for e in events}, last, report.events_checked,
                                       [m for m in marks if not events or m.seq >= events[0].seq]) or report
    else:
        with connect(args) as client:
            try:
                report = client.verify_log()
            except SandboxdClientError as exc:
                return _fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        print(json.dumps({"ok": report.ok, "eventsChecked": report.events_checked,
                          "firstBadSeq": report.first_bad_seq or 0, "reason": report.reason,
                          "headHash": report.head_hash}, sort_keys=True))
    elif report.ok:
        print(f"ok: {report.events_checked} events, head {report.head_hash}")
    else:
        print(f"BROKEN at seq {report.first_bad_seq}: {report.reason} ({report.events_checked} events checked)")
    return 0 if report.ok else 1


def _export_fields(entry: dict[str, Any]) -> dict[str, Any]:
    return {"seq": int(entry["seq"]), "event_id": entry["eventId"], "tool_call_id": entry["toolCallId"],
            "type": entry["type"], "time": entry["time"], "parent_event_id": entry.get("parentEventId", ""),
            "payload_json": entry["payloadJson"], "prev_hash": entry["prevHash"], "hash": entry["hash"]}


def _trace_export(args: argparse.Namespace) -> int:
    """JSONL, one event per line, with payloadJson exactly as hashed (verifiable offline)."""
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    n = 0
    try:
        with connect(args) as client:
            for e in client.export_events(args.call or "", args.after_seq):
                out.write(json.dumps(to_json(e), sort_keys=True) + "\n")
                n += 1
    except SandboxdClientError as exc:
        return _fail(f"{exc.code.name}: {exc.message}", 1)
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"exported {n} events", file=sys.stderr)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    policy = load_policy(args.policy) if args.policy else None
    with connect(args) as client:
        try:
            resp = client.explain(policy, os.path.abspath(args.workspace or os.getcwd()), image=args.image or "")
        except SandboxdClientError as exc:
            return _fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        print(json.dumps({"backend": resp.backend, "image": resp.image,
                          "effectivePolicy": json.loads(resp.effective_policy_json),
                          "spec": json.loads(resp.spec_json), "notes": list(resp.notes),
                          "network": json.loads(resp.network_plan_json or "{}")}, sort_keys=True))
    else:
        print(f"backend: {resp.backend}\nimage:   {resp.image}\n\neffective policy:\n{resp.effective_policy_json}\n")
        print(f"network:\n{resp.network_plan_json}\n")
        print(f"{resp.backend} spec:\n{resp.spec_json}")
        for n in resp.notes:
            print(f"note: {n}")
    return 0


def connect(args: argparse.Namespace) -> SandboxdClient:
    if getattr(args, "tcp", None):
        files = (args.tls_ca, args.tls_cert, args.tls_key)
        if not all(files):
            raise SystemExit("sandboxctl: --tcp needs --tls-ca, --tls-cert and --tls-key (the daemon only speaks mutual TLS)")
        return SandboxdClient(target=args.tcp, tls=TlsFiles(*files))
    return SandboxdClient(args.socket)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandboxctl", description="Client for the sandboxd daemon.")
    parser.add_argument("--socket", default=None, help=f"daemon socket (default $SANDBOXD_SOCKET or {default_socket()})")
    parser.add_argument("--tcp", default=None, metavar="HOST:PORT",
                        help="the daemon's mutual-TLS listener instead of the socket (with --tls-*)")
    parser.add_argument("--tls-ca", default=None, help="CA certificate that signed the daemon's (PEM)")
    parser.add_argument("--tls-cert", default=None, help="this client's certificate (PEM)")
    parser.add_argument("--tls-key", default=None, help="this client's private key (PEM)")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--socket", default=argparse.SUPPRESS, help="daemon socket")

    p = sub.add_parser("exec", help="run a command in a fresh sandbox")
    common(p)
    p.add_argument("--workspace", help="host workspace directory (default: the current directory)")
    p.add_argument("--policy", help="SandboxPolicy as JSON or YAML (camelCase names)")
    p.add_argument("--image")
    p.add_argument("--adapter", help="docker (default) or nsjail")
    p.add_argument("--lease", help="run in this leased warm sandbox (`sandboxctl pool acquire`)")
    p.add_argument("--cwd", help="working directory inside the sandbox")
    p.add_argument("--timeout-ms", type=int)
    p.add_argument("--memory-mb", type=int)
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("--stdin", action="store_true", help="pass this process's stdin to the command")
    p.add_argument("--json", action="store_true", help="print the ToolResult as JSON after the output")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("artifact", help="artifacts of calls")
    asub = p.add_subparsers(dest="artifact_command", required=True)
    g = asub.add_parser("get", help="download an artifact and verify its sha256")
    common(g)
    g.add_argument("artifact_id")
    g.add_argument("-o", "--output", help="file to write (default: stdout)")
    g.set_defaults(func=cmd_artifact_get)
    ls = asub.add_parser("ls", help="list a call's artifacts")
    common(ls)
    ls.add_argument("tool_call_id")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_artifact_ls)

    p = sub.add_parser("trace", help="a call's event chain: `trace CALL_ID`, `trace verify`, `trace export`")
    common(p)
    p.add_argument("target", metavar="CALL_ID|verify|export")
    p.add_argument("--json", action="store_true", help="one JSON object per event (JSONL)")
    p.add_argument("-v", "--verbose", action="store_true", help="show payloads")
    p.add_argument("--file", help="verify: check this exported JSONL file offline instead of the daemon's log")
    p.add_argument("--checkpoints", help="verify --file: also hold it against this checkpoints.jsonl")
    p.add_argument("-o", "--output", help="export: write JSONL here (default: stdout)")
    p.add_argument("--call", help="export: only this call's events")
    p.add_argument("--after-seq", type=int, default=0, help="export: only events after this log position")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("pool", help="warm sandboxes: `pool ls|create|acquire|release LEASE|drain`")
    psub = p.add_subparsers(dest="pool_command", required=True)
    pl = psub.add_parser("ls", help="pools and their sandboxes (admin)")
    pl.add_argument("--json", action="store_true")
    pa = psub.add_parser("acquire", help="lease a warm sandbox; prints the lease id")
    pc = psub.add_parser("create", help="make a pool and warm it, so that the first lease is warm too")
    for sp in (pa, pc):  # the same sandbox either way
        sp.add_argument("--workspace", help="host workspace directory (default: the current directory)")
        sp.add_argument("--policy", help="SandboxPolicy as JSON or YAML: the part that fixes the sandbox")
        sp.add_argument("--image")
        sp.add_argument("--adapter", help="docker (default) or nsjail")
        sp.add_argument("--json", action="store_true")
    pa.add_argument("--lease-ms", type=int, default=0)
    pa.add_argument("--wait-ms", type=int, default=0, help="wait for a sandbox when the pool is full")
    pr = psub.add_parser("release", help="end a lease (its sandbox is destroyed)")
    pr.add_argument("lease_id")
    pd = psub.add_parser("drain", help="destroy a pool's sandboxes (admin)")
    pd.add_argument("pool_key", nargs="?")
    for q in (pl, pa, pc, pr, pd):
        common(q)
    p.set_defaults(func=cmd_pool)

    p = sub.add_parser("audit", help="forensic queries over recorded calls, newest first")
    p.add_argument("--command", help="substring of the command line")
    p.add_argument("--path", help="a sandbox path touched (relative: under /workspace), or anything below it")
    p.add_argument("--op", help="with --path: read|write|create|delete|rename|chmod")
    p.add_argument("--domain", help="a host contacted: exact or *.suffix")
    p.add_argument("--principal")
    p.add_argument("--workspace")
    p.add_argument("--status", help="running|success|error|partial|cancelled|rejected")
    p.add_argument("--since", help="RFC 3339, inclusive")
    p.add_argument("--until", help="RFC 3339, exclusive")
    p.add_argument("--limit", type=int, default=0, help="page size (default 50, at most 500)")
    p.add_argument("--page-token", help="from the previous page")
    p.add_argument("--json", action="store_true", help="one JSON object per call")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("explain", help="show what a policy would materialize to, without running anything")
    common(p)
    p.add_argument("--policy")
    p.add_argument("--workspace")
    p.add_argument("--image")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        return _fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
