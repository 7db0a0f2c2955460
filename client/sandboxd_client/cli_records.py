"""`sandboxctl artifact`, `trace`, `audit` and `explain`: what the daemon kept of calls,
and what a policy would materialize to."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any, BinaryIO, cast

from sandboxd_contract.canonical import GENESIS_HASH, check_checkpoints, event_hash, file_accesses, verify_chain
from .cli_common import connect, fail, load_policy, shorten, shown, workspace_of
from .client import to_json
from .errors import SandboxdClientError
from .local_files import write_whole
from .terminal import sink, visible


def cmd_artifact_get(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            if args.output and args.output != "-":
                # Whole or not at all, under a name no one else can plant a link at.
                ref = write_whole(args.output, lambda f: client.download_artifact(args.artifact_id, f))
            else:
                out = sink(sys.stdout, args.raw)  # the sandbox's bytes: made visible on a terminal
                try:
                    ref = client.download_artifact(args.artifact_id, cast(BinaryIO, out))
                finally:
                    out.close()
        except SandboxdClientError as exc:
            return fail(f"{exc.code.name}: {exc.message}", 1)
    print(f"{ref.artifact_id} {ref.kind} {ref.size_bytes} bytes {ref.content_hash} (verified)", file=sys.stderr)
    return 0


def cmd_artifact_ls(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            refs = client.list_artifacts(args.tool_call_id)
        except SandboxdClientError as exc:
            return fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        print(json.dumps([to_json(r) for r in refs], sort_keys=True))
    else:
        for r in refs:
            # The paths are the sandbox's, escaped.
            where = f"\t{r.change} {shown(r.path)}" + (f" (from {shown(r.previous_path)})" if r.previous_path else "") \
                if r.path else ""
            print(f"{r.artifact_id}\t{r.kind}\t{r.size_bytes}\t{r.content_hash}{where}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """A call's diff artifact (the changed text files against their content before it), on stdout."""
    with connect(args) as client:
        try:
            diffs = [r for r in client.list_artifacts(args.tool_call_id) if r.kind == "diff"]
            if not diffs:
                return fail(f"call {args.tool_call_id} has no diff: it changed no file in a write root, "
                            "or the daemon keeps no diffs (artifacts.diff)", 1)
            out = sink(sys.stdout, args.raw)  # what the sandbox wrote: made visible on a terminal
            try:
                client.download_artifact(diffs[0].artifact_id, cast(BinaryIO, out))
            finally:
                out.close()
        except SandboxdClientError as exc:
            return fail(f"{exc.code.name}: {exc.message}", 1)
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
            return fail(f"{exc.code.name}: {exc.message}", 1)
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
        return fail(f"{bad} event(s) do not match their hash", 1)
    return 0


_AGO = re.compile(r"(\d+)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def point_in_time(text: str, now: datetime | None = None) -> str:
    """`--since`/`--until`: RFC 3339 as given, or a time ago (`1h`) as RFC 3339 in UTC."""
    ago = _AGO.fullmatch(text.strip())
    if ago is None:
        return text  # the daemon checks RFC 3339 and names the field when it is not
    at = (now or datetime.now(timezone.utc)) - timedelta(seconds=int(ago.group(1)) * _UNIT_S[ago.group(2)])
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_audit(args: argparse.Namespace) -> int:
    filters = {k: v for k, v in {
        "command_contains": args.command, "path": args.path, "path_operation": args.op, "domain": args.domain,
        "principal": args.principal, "workspace": args.workspace, "status": args.status, "since": args.since,
        "until": args.until, "page_size": args.limit, "page_token": args.page_token,
        "proposed_by": args.proposed_by, "session_id": args.session}.items() if v}
    with connect(args) as client:
        try:
            page = client.query_calls(**filters)
        except SandboxdClientError as exc:
            return fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        for c in page.calls:
            print(json.dumps(to_json(c), sort_keys=True))
        if page.next_page_token:
            print(json.dumps({"nextPageToken": page.next_page_token}))
        return 0
    rows = [("REQUESTED", "CALL", "PRINCIPAL", "PROPOSER", "STATUS", "EXIT", "DOMAINS", "COMMAND")]
    for c in page.calls:
        # Every cell escaped: a command's argv and its proposer are the agent's, a domain the sandbox's.
        rows.append((shown(c.requested_at[:19].replace("T", " ")), shown(c.tool_call_id), shown(c.principal),
                     shorten(shown(c.proposed_by), 40) or "-",
                     shown(c.status + (f" ({c.error_code})" if c.error_code else "")),
                     str(c.exit_code) if c.HasField("exit_code") else "-", shown(",".join(c.domains)) or "-",
                     shorten(shown(c.command) or "(not recorded)", 60)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    if page.next_page_token:
        print(f"more: --page-token {page.next_page_token}")
    return 0


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
                return fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        print(json.dumps({"ok": report.ok, "eventsChecked": report.events_checked,
                          "firstBadSeq": report.first_bad_seq or 0, "reason": report.reason,
                          "headHash": report.head_hash}, sort_keys=True))
    elif report.ok:
        print(f"ok: {report.events_checked} events, head {report.head_hash}")
    else:
        print(f"BROKEN at seq {report.first_bad_seq}: {visible(report.reason)} ({report.events_checked} events "
              "checked)")
    return 0 if report.ok else 1


def _export_fields(entry: dict[str, Any]) -> dict[str, Any]:
    return {"seq": int(entry["seq"]), "event_id": entry["eventId"], "tool_call_id": entry["toolCallId"],
            "type": entry["type"], "time": entry["time"], "parent_event_id": entry.get("parentEventId", ""),
            "payload_json": entry["payloadJson"], "prev_hash": entry["prevHash"], "hash": entry["hash"]}


def _trace_export(args: argparse.Namespace) -> int:
    """JSONL, one event per line, with payloadJson exactly as hashed (verifiable offline)."""
    def export(out: BinaryIO) -> int:
        n = 0
        with connect(args) as client:
            for e in client.export_events(args.call or "", args.after_seq):
                out.write(json.dumps(to_json(e), sort_keys=True).encode() + b"\n")  # (ASCII: escapes shown)
                n += 1
        return n

    try:
        # A file whole or not at all, under a name no one else can plant a link at.
        n = write_whole(args.output, export) if args.output else export(sys.stdout.buffer)
    except SandboxdClientError as exc:
        return fail(f"{exc.code.name}: {exc.message}", 1)
    sys.stdout.flush()
    print(f"exported {n} events", file=sys.stderr)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    policy = load_policy(args.policy) if args.policy else None
    with connect(args) as client:
        try:
            resp = client.explain(policy, workspace_of(args), image=args.image or "")
        except SandboxdClientError as exc:
            return fail(f"{exc.code.name}: {exc.message}", 1)
    if args.json:
        print(json.dumps({"backend": resp.backend, "image": resp.image,
                          "effectivePolicy": json.loads(resp.effective_policy_json),
                          "spec": json.loads(resp.spec_json), "notes": list(resp.notes),
                          "network": json.loads(resp.network_plan_json or "{}")}, sort_keys=True))
    else:
        # Names and paths from a policy (an agent may have written it), escaped.
        print(visible(f"backend: {resp.backend}\nimage:   {resp.image}\n\neffective policy:\n"
                      f"{resp.effective_policy_json}\n"))
        print(visible(f"network:\n{resp.network_plan_json}\n"))
        print(visible(f"{resp.backend} spec:\n{resp.spec_json}"))
        for n in resp.notes:
            print(f"note: {visible(n)}")
    return 0
