"""`sandboxctl ps`, `logs`, `cancel` and `pool`: what runs now, its output, its end, and
warm sandboxes."""

from __future__ import annotations

import argparse
import json
import sys

from .cli_common import (EXIT_CANCELLED, connect, dump_json, fail, load_policy, print_table, rpc_failed, shorten,
                         shown, workspace_of)
from .client import to_json
from .errors import SandboxdClientError
from .terminal import sink
from sandboxd_contract.pb import sandboxd_pb2 as pb


def _when(rfc3339: str) -> str:
    return rfc3339[:19].replace("T", " ") or "-"


def cmd_ps(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            running = client.list_running()
        except SandboxdClientError as exc:
            return rpc_failed(exc)
    if args.quiet:
        for c in running.calls:
            print(shown(c.tool_call_id))  # (a caller may choose its call's id)
        return 0
    if args.json:
        print(dump_json(to_json(running)))
        return 0
    # Every cell escaped: a command's argv is the agent's.
    rows = [("CALL", "PRINCIPAL", "BACKEND", "LEASE", "REQUESTED", "WORKSPACE", "COMMAND")]
    rows += [(shown(c.tool_call_id), shown(c.principal), c.backend, c.lease_id or "-", _when(c.requested_at),
              shown(c.workspace), shorten(shown(c.command) or "(not recorded)", 60)) for c in running.calls]
    print_table(rows)
    if running.leases:
        print()
        lease_rows = [("LEASE", "PRINCIPAL", "BACKEND", "EXPIRES", "RUNNING", "WORKSPACE")]
        lease_rows += [(h.lease.lease_id, shown(h.principal), h.lease.backend, _when(h.lease.expires_at),
                  h.tool_call_id or "-", shown(h.workspace)) for h in running.leases]
        print_table(lease_rows)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """A call's stdout to stdout and stderr to stderr, as `docker logs`: what there is
    (a finished call's stored output), or with -f everything until the call ends."""
    if args.since_byte < 0:
        return fail("--since-byte: must be 0 or more", 2)
    out, err = sink(sys.stdout, args.raw), sink(sys.stderr, args.raw)  # the sandbox's bytes
    with connect(args) as client:
        stream = client.stream_output(args.call_id, follow=args.follow, stdout_offset=args.since_byte,
                                      stderr_offset=args.since_byte)
        try:
            for event in stream:
                if event.WhichOneof("kind") == "output":
                    target = out if event.output.stream == pb.OUTPUT_STREAM_STDOUT else err
                    target.write(event.output.data)
                    target.flush()
        except KeyboardInterrupt:
            stream.cancel()  # only this reader stops: the call goes on
            return EXIT_CANCELLED
        except SandboxdClientError as exc:
            return rpc_failed(exc)
        finally:
            out.close()
            err.close()
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Each call cancelled (its id printed, as `docker kill` does); 1 if any was not."""
    failed = 0
    with connect(args) as client:
        for call_id in args.call_ids:
            try:
                cancelled = client.cancel(call_id, args.reason or "")
            except SandboxdClientError as exc:
                failed += 1
                rpc_failed(exc)
                continue
            if cancelled:
                print(call_id)
            else:
                failed += 1
                fail(f"call {call_id} had already finished: nothing to cancel", 1)
    return 1 if failed else 0


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
                print_table(rows, last_free=False)
            elif args.pool_command == "acquire":
                policy = load_policy(args.policy) if args.policy else None
                lease = client.acquire_sandbox(workspace_of(args), policy,
                                               image=args.image or "", adapter=args.adapter or "",
                                               lease_ms=args.lease_ms, wait_ms=args.wait_ms)
                print(json.dumps(to_json(lease), sort_keys=True) if args.json else lease.lease_id)
            elif args.pool_command == "create":
                policy = load_policy(args.policy) if args.policy else None
                status = client.create_pool(workspace_of(args), policy,
                                            image=args.image or "", adapter=args.adapter or "")
                print(json.dumps(to_json(status), sort_keys=True) if args.json else status.pool_key)
            elif args.pool_command == "release":
                client.release_sandbox(args.lease_id)
            elif args.pool_command == "drain":
                print(f"destroyed {client.drain_pools(args.pool_key or '')} sandboxes")
        except SandboxdClientError as exc:
            return fail(f"{exc.code.name}: {exc.message}", 1)
    return 0
