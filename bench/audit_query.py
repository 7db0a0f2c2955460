"""Forensic queries on a store of 100,000 calls: audit.query_calls (the index kept with
the event log) versus answering the same question by scanning the event log itself
(json_extract over every payload), measured in one run. Prints a table of medians and
the ratio of the index to the scan. First (--heavy N, 0 to skip), what indexing a heavy
call costs: N calls of 3,000 reads each, indexed one at a time.

The store is synthetic but shaped like the real thing: each call has the events the
daemon writes (Requested, ArgsValidated, PolicyChecked, SandboxPrepared, Started,
NetworkAccessObserved*, FileAccessObserved* in the forms the daemon writes, Finished,
ResultValidated), written through EventLog with the index hook, 20 principals, 200
workspaces.

    .venv/bin/python bench/audit_query.py [--calls 100000] [-n 15] [--db PATH] [--heavy 60]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

from sandboxd.ledger import audit
from sandboxd.ledger import events as ev
from sandboxd.ledger.events import EventDraft, EventLog  # noqa: E402
from sandboxd.ledger.store import Database  # noqa: E402
from sandboxd_testing import timed_ms  # noqa: E402

COMMANDS = [["pytest", "-q", "tests/"], ["git", "status"], ["ls", "-la"], ["grep", "-rn", "TODO", "src"],
            ["pip", "install", "-r", "requirements.txt"], ["python3", "-m", "build"], ["make", "test"]]
HOSTS = ["pypi.test", "files.pythonhosted.test", "github.test", "a.files.test", "b.files.test", "npm.test"]
PATHS = ["/workspace/src/auth/login.py", "/workspace/src/auth/tokens.py", "/workspace/src/app.py",
         "/workspace/README.md", "/workspace/secrets.yaml", "/workspace/tests/test_app.py"]
OPS = ["read", "read", "read", "write", "create", "delete"]


def file_access_events(touched: list[tuple[str, str]]) -> list[EventDraft]:
    """FileAccessObserved as the daemon writes them: plain reads as [path, opens] pairs,
    every other operation as an entry (a write's hashes left out here)."""
    reads = [[path, 1] for path, op in touched if op == "read"]
    entries = [{"path": path, "operation": op} for path, op in touched if op != "read"]
    return ([EventDraft(ev.FILE_ACCESS, {"accesses": entries})] if entries else []) + (
        [EventDraft(ev.FILE_ACCESS, {"reads": reads})] if reads else [])


def populate(db: Database, calls: int, rng: random.Random) -> None:
    log = EventLog(db, on_append=audit.index_events)
    batch = 200
    for start in range(0, calls, batch):
        with db.transaction() as conn:
            for i in range(start, min(start + batch, calls)):
                argv = list(rng.choice(COMMANDS))
                if i == calls // 2:
                    argv = ["echo", "needle-in-the-haystack"]
                tc = f"tc_{i:08d}"
                drafts = [
                    EventDraft(ev.REQUESTED, {"toolId": "shell", "argv": argv, "workspace": f"/srv/ws/{i % 200}",
                                              "principal": f"p{i % 20}", "daemonId": "bench"}),
                    EventDraft(ev.ARGS_VALIDATED, {"policyDigest": "sha256:" + "0" * 64}),
                    EventDraft(ev.POLICY_CHECKED, {"decision": "allowed", "backend": "docker",
                                                   "image": "sandboxd/default:latest"}),
                    EventDraft(ev.SANDBOX_PREPARED, {"sandboxId": f"sbx-{i}"}),
                    EventDraft(ev.STARTED, {"sandboxId": f"sbx-{i}"}),
                ]
                for _ in range(rng.choice((0, 0, 1, 2))):
                    drafts.append(EventDraft(ev.NETWORK_ACCESS, {"host": rng.choice(HOSTS), "port": 443,
                                                                 "decision": rng.choice(("allowed", "denied"))}))
                touched = {(rng.choice(PATHS), rng.choice(OPS)) for _ in range(rng.choice((0, 1, 2, 3)))}
                if i == calls // 3:  # one call that touched something nobody else did
                    drafts.append(EventDraft(ev.NETWORK_ACCESS, {"host": "rare.test", "port": 443, "decision": "allowed"}))
                    touched.add(("/workspace/vault/key.pem", "read"))
                drafts += file_access_events(sorted(touched))
                status = rng.choice(("success", "success", "success", "error"))
                drafts += [
                    EventDraft(ev.FINISHED, {"exitCode": 0 if status == "success" else 1}),
                    EventDraft(ev.RESULT_VALIDATED, {"result": {"status": status, "exitCode": 0 if status == "success" else 1}}),
                ]
                log.append(conn, tc, "", drafts)


SCANS = {
    # The same questions without the index: what the log alone can answer.
    "command": ("SELECT tool_call_id FROM events WHERE type = 'ToolCallRequested' AND payload_json LIKE ? "
                "ORDER BY seq DESC LIMIT 50"),
    "domain": ("SELECT DISTINCT tool_call_id FROM events WHERE type = 'NetworkAccessObserved' "
               "AND json_extract(payload_json, '$.host') = ? ORDER BY seq DESC LIMIT 50"),
    "path read": ("SELECT DISTINCT e.tool_call_id FROM events e, json_each(e.payload_json, '$.reads') r "
                  "WHERE e.type = 'FileAccessObserved' AND json_extract(r.value, '$[0]') LIKE ? "
                  "ORDER BY e.seq DESC LIMIT 50"),
    "path op": ("SELECT DISTINCT e.tool_call_id FROM events e, json_each(e.payload_json, '$.accesses') a "
                "WHERE e.type = 'FileAccessObserved' AND json_extract(a.value, '$.path') LIKE ? "
                "AND json_extract(a.value, '$.operation') = ? ORDER BY e.seq DESC LIMIT 50"),
    "principal": ("SELECT tool_call_id FROM events WHERE type = 'ToolCallRequested' "
                  "AND json_extract(payload_json, '$.principal') = ? ORDER BY seq DESC LIMIT 50"),
}




def heavy_calls(n: int, daemon_wal: bool, reads: int = 3000) -> None:
    """Indexing what a test run leaves: `n` calls of `reads` reads each, appended to a
    log and indexed one at a time by the daemon's AuditIndex (a call's sync is what the
    index's thread does after it), into a database opened as the daemon opens it or
    (`daemon_wal` False) with SQLite's default checkpoints, the baseline."""
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-heavy-"))
    log_db = Database(base / "sandboxd.db")
    log = EventLog(log_db)
    index_db = audit.open_index_db(base / "audit.db") if daemon_wal else Database(base / "audit.db", schema="",
                                                                                    durable=False)
    index = audit.AuditIndex(log_db, index_db)
    paths = [[f"/workspace/pkg/m{j // 100}/test_mod{j}.py", 1] for j in range(reads)]
    times = []
    for i in range(n):
        log.record(f"tc_{i:06d}", "", [
            EventDraft(ev.REQUESTED, {"toolId": "shell", "argv": ["python3", "-m", "unittest"], "workspace": "/ws",
                                      "principal": "p", "daemonId": "bench"}),
            *[EventDraft(ev.FILE_ACCESS, {"reads": paths[k:k + 2000]}) for k in range(0, reads, 2000)],
            EventDraft(ev.RESULT_VALIDATED, {"result": {"status": "success", "exitCode": 0}})])
        t = time.perf_counter()
        index.sync()
        times.append((time.perf_counter() - t) * 1000)
    wal = base / "audit.db-wal"
    last = times[-n // 2:]
    print(f"| {'as the daemon opens it' if daemon_wal else 'SQLite default checkpoints':<27} | "
          f"{statistics.mean(times):6.1f} | {statistics.median(times):6.1f} | {statistics.mean(last):11.1f} | "
          f"{max(times):5.1f} | {(base / 'audit.db').stat().st_size / 2**20:8.1f} | "
          f"{(wal.stat().st_size if wal.exists() else 0) / 2**20:7.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--db", help="reuse (or keep) the store at this path")
    ap.add_argument("--heavy", type=int, default=60,
                    help="also index this many calls of 3,000 reads each, one at a time, as the daemon does")
    args = ap.parse_args()
    if args.heavy:
        print(f"\nindexing {args.heavy} calls of 3,000 reads each, one at a time; ms a call\n")
        print(f"| {'index database':<27} | {'mean':>6} | {'median':>6} | {'mean, last half':>11} | {'max':>5} "
              f"| {'db (MiB)':>8} | {'WAL (MiB)':>7} |")
        print(f"|{'-' * 29}|{'-' * 8}|{'-' * 8}|{'-' * 17}|{'-' * 7}|{'-' * 10}|{'-' * 11}|")
        for daemon_wal in (False, True):
            heavy_calls(args.heavy, daemon_wal)
    path = Path(args.db) if args.db else Path(tempfile.mkdtemp(prefix="sandboxd-bench-audit-")) / "sandboxd.db"
    fresh = not path.exists()
    db = Database(path)
    audit.ensure_schema(db)
    if fresh:
        t = time.perf_counter()
        populate(db, args.calls, random.Random(7))
        print(f"populated {args.calls} calls in {time.perf_counter() - t:.0f} s ({path})")
    else:
        audit.catch_up(db)  # an index of an older schema was dropped above: rebuilt from the log
    n_events = db.query("SELECT COUNT(*) AS n FROM events")[0]["n"]

    def q(**kw):
        return lambda: audit.query_calls(db, audit.CallQuery(**kw))

    def scan(name, *a):
        return lambda: db.query(SCANS[name], a)

    cases = [
        ("newest page, no filter", q(), None),
        ("principal = p7", q(principal="p7"), scan("principal", "p7")),
        ("command contains 'pytest' (common)", q(command_contains="pytest"), scan("command", "%pytest%")),
        ("command contains a rare needle", q(command_contains="needle-in-the"), scan("command", "%needle-in-the%")),
        ("domain = pypi.test", q(domain="pypi.test"), scan("domain", "pypi.test")),
        ("domain = rare.test (one call)", q(domain="rare.test"), scan("domain", "rare.test")),
        ("domain = *.files.test", q(domain="*.files.test"), None),
        ("path under vault/, op read (one call)", q(path="vault", path_operation="read"),
         scan("path read", "/workspace/vault/%")),
        ("path under src/auth/, op write", q(path="src/auth", path_operation="write"),
         scan("path op", "/workspace/src/auth/%", "write")),
        ("status error, one principal, since", q(status="error", principal="p3", since="2000-01-01T00:00:00Z"), None),
    ]
    print(f"\nforensic queries, {args.calls} calls / {n_events} events, n={args.n}; times in ms (first page of 50)\n")
    print(f"| {'query':<38} | {'index':>8} | {'log scan':>9} | {'scan/index':>10} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 11}|{'-' * 12}|")
    for name, indexed, scanned in cases:
        mi = statistics.median(timed_ms(indexed, args.n, warmup=1))
        if scanned is not None:
            ms = statistics.median(timed_ms(scanned, max(3, args.n // 5), warmup=1))
            print(f"| {name:<38} | {mi:8.2f} | {ms:9.1f} | {ms / mi:9.0f}x |")
        else:
            print(f"| {name:<38} | {mi:8.2f} | {'-':>9} | {'-':>10} |")
    db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
