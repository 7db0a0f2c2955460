#!/usr/bin/env python3
"""Captures a real daemon's event log after calls that together produce every event
type, one JSON line per event (seq, event_id, tool_call_id, type, time,
parent_event_id, payload_json, prev_hash, hash): the golden log of
tests/unit/test_event_golden.py, and what tests/integration/test_event_shapes.py
compares with it.

Only the public parts are used (sandboxd_testing, sandboxd_client, the daemon's
database file), so that it runs on the tree before and after a restructuring alike.
Needs root, dockerd and the sandboxd/default image. The one "remote" host is a server
in a network namespace this script makes itself (nothing else is ever reached).

Usage: capture-event-golden.py [OUT] (default tests/unit/golden/events/log.jsonl).
Exits 1 naming each event type it could not produce."""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sandboxd_testing import DaemonProcess, make_daemon, prepared_call, wait_for
from sandboxd_client import errors
from sandboxd_client.transfer import target

EVENT_TYPES = (
    "ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked", "ToolSandboxPrepared", "ToolCallStarted",
    "ToolCallFinished", "ToolResultValidated", "ArtifactPersisted", "ToolCallRejected", "NetworkAccessObserved",
    "CredentialInjected", "SandboxLeased", "SandboxLeaseEnded", "FileAccessObserved", "ToolCallReplayed",
    "ToolCallExpired", "FilesTransferred",
)
COLUMNS = ("seq", "event_id", "tool_call_id", "type", "time", "parent_event_id", "payload_json", "prev_hash", "hash")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "unit" / "golden" / "events" / "log.jsonl"
IMAGE = "sandboxd/default:latest"
ADAPTER = "docker"
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "TZ": "UTC",
       "GOLDEN_TOKEN_SOURCE": "golden-env-secret-0123456789"}
# The retention period of the second daemon: every call ended before it started is
# past it by the time its sweeps run.
RETENTION_S = 1.0
# Small caps, so that one call each shows the "past the cap" records.
MAX_NETWORK_RECORDS = 2
MAX_WALKED_ENTRIES = 24
# The namespace's subnet (the egress tests use 10.213-10.215).
SUBNET = "10.216"
SERVER = r"""
import socket, sys
s = socket.create_server((sys.argv[1], 80), backlog=16)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                break
            data += chunk
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\ngolden\n")
    finally:
        c.close()
"""
FETCH = r"""
import urllib.request, urllib.error
for url in ("http://golden.test/", "http://denied.test/", "http://denied.test/again"):
    try:
        print(url, urllib.request.urlopen(url, timeout=20).status)
    except urllib.error.HTTPError as e:
        print(url, e.code)
"""


class RemoteHost:
    """golden.test: a fixed HTTP answer on port 80 of a network namespace of our own."""

    def __init__(self) -> None:
        n = os.getpid() % 200 + 20
        self.ns, self.host_if, self.ns_if = f"sbxg-{os.getpid()}", f"sgh{os.getpid()}"[:15], f"sgs{os.getpid()}"[:15]
        self.host_ip, self.ip = f"{SUBNET}.{n}.1", f"{SUBNET}.{n}.2"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RemoteHost":
        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True)

        ip("netns", "add", self.ns)
        ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        ip("link", "set", self.ns_if, "netns", self.ns)
        ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        ip("link", "set", self.host_if, "up")
        ip("-n", self.ns, "addr", "add", f"{self.ip}/24", "dev", self.ns_if)
        ip("-n", self.ns, "link", "set", self.ns_if, "up")
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable, "-c", SERVER, self.ip],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the test server did not start: {self.proc.stderr.read()}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def daemon_settings(host: RemoteHost, secret_file: Path, public_key: str) -> dict:
    return {
        "egress": {"hosts": {"golden.test": [host.ip]}, "exempt_networks": [f"{host.ip}/32"],
                   "max_records_per_call": MAX_NETWORK_RECORDS},
        "credentials": {"golden-file": {"file": str(secret_file), "principals": ["root"]},
                        "golden-env": {"env": "GOLDEN_TOKEN_SOURCE", "principals": ["root"]}},
        "approvals": {"public_keys": {"golden-tm": public_key}, "unsigned_tools": ["golden.*"]},
        "pools": {"min_idle": 0, "max_size": 1},
        "file_audit": {"max_entries": MAX_WALKED_ENTRIES},
        "limits": {"max_timeout_ms": 120_000},
    }


def call(ws: Path, argv: list[str], policy: dict | None = None, tool: str = "golden.shell", **extra) -> dict:
    c = prepared_call(ws, argv, policy, tool_id=tool, image=IMAGE, **extra)
    c["runtime"]["adapter"] = ADAPTER
    return c


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def ok(outcome, what: str):
    if outcome.result.status != "success":
        raise RuntimeError(f"{what}: {outcome.result.status} {outcome.result.error} {outcome.stderr!r}")
    return outcome


def refused(fn, what: str) -> None:
    try:
        fn()
    except errors.SandboxdClientError:
        return
    raise RuntimeError(f"{what} was not refused")


def signing():
    """(sign_grant, a new key, its public half in base64): the approval module is where
    the tree has it (the contract package, or the client's before it moved)."""
    try:
        from sandboxd_contract.approval import public_key_b64, sign_grant
    except ImportError:
        from sandboxd_client.approval import public_key_b64, sign_grant
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    return sign_grant, key, public_key_b64(key)


def plain_and_refused_calls(d: DaemonProcess, c, sign_grant, key) -> None:
    """A plain call, its idempotent retry (ToolCallReplayed), one without the command
    recorded, a signed one, and refusals at each stage (ToolCallRejected)."""
    ws = d.new_workspace({"README.md": "golden\n"})
    keyed = call(ws, sh("echo plain; echo to-stderr >&2"))
    keyed["runtime"]["idempotencyKey"] = "golden-key-1"
    first = ok(c.run(keyed), "the plain call")
    if c.run(keyed).tool_call_id != first.tool_call_id:
        raise RuntimeError("the retry was not answered from the first call")
    ok(c.run(call(ws, ["true"], {"audit": {"recordCommand": False}})), "the unrecorded command")
    expires = (datetime.now(timezone.utc) + timedelta(minutes=30)).isoformat(timespec="seconds").replace("+00:00", "Z")
    signed = call(ws, ["echo", "signed"], tool="signed.tool")
    sign_grant(signed, key, key_id="golden-tm", expires_at=expires, approved_by="golden@example.test")
    ok(c.run(signed), "the signed call")
    refused(lambda: c.run(call(ws, [])), "an empty argv")  # validation
    refused(lambda: c.run(call(ws, ["true"], toolCallId=first.tool_call_id)), "a reused id")  # admission
    refused(lambda: c.run(call(d.base, ["true"])), "a workspace outside the roots")  # verification


def file_calls(d: DaemonProcess, c) -> None:
    """FileAccessObserved in each form: reads, accesses, and a walk past its cap."""
    ws = d.new_workspace({"input.txt": "in\n", "gone.txt": "x\n", "old.txt": "o\n", "mode.txt": "m\n",
                          "append.txt": "a\n"})
    ok(c.run(call(ws, sh("cat /workspace/input.txt >/dev/null; echo built > /workspace/out.txt; "
                         "rm /workspace/gone.txt; mv /workspace/old.txt /workspace/new.txt; "
                         "chmod 600 /workspace/mode.txt; echo more >> /workspace/append.txt"),
                  {"filesystem": {"writeRoots": ["/workspace"]}})), "the file call")
    crowded = d.new_workspace({f"f{i:02d}.txt": f"{i}\n" for i in range(MAX_WALKED_ENTRIES + 6)})
    ok(c.run(call(crowded, sh("echo new > /workspace/zz.txt"), {"filesystem": {"writeRoots": ["/workspace"]}})),
       "the crowded file call")


def egress_and_credential_calls(d: DaemonProcess, c) -> None:
    ws = d.new_workspace({"README.md": "egress\n"})
    policy = {"network": {"egress": "allowlist", "allowDomains": ["golden.test"]}}
    out = ok(c.run(call(ws, ["python3", "-c", FETCH], policy)), "the egress call")
    if b"http://golden.test/ 200" not in out.stdout:
        raise RuntimeError(f"golden.test was not reached: {out.stdout!r} {out.stderr!r}")
    refs = [{"bindingId": "golden-env", "envName": "GOLDEN_TOKEN"},
            {"bindingId": "golden-file", "filePath": "/tmp/creds/golden"}]
    ok(c.run(call(ws, sh('test -n "$GOLDEN_TOKEN" && test -s /tmp/creds/golden && echo injected'),
                  {"environment": {"secretEnvAllowed": True}}, credentialRefs=refs)), "the credential call")


def lease_calls(d: DaemonProcess, c) -> None:
    ws = d.new_workspace({"README.md": "leased\n"})
    lease = c.acquire_sandbox(str(ws), image=IMAGE, adapter=ADAPTER, wait_ms=60_000)
    leased = call(ws, ["echo", "leased"])
    leased["runtime"]["leaseId"] = lease.lease_id
    ok(c.run(leased), "the leased call")
    c.release_sandbox(lease.lease_id)


def transfer_calls(d: DaemonProcess, c, scratch: Path) -> None:
    """FileService: an upload landed, a download sent, an upload refused."""
    ws = d.new_workspace({"README.md": "transferred\n"})
    source = scratch / "upload"
    (source / "dir").mkdir(parents=True)
    (source / "dir" / "a.txt").write_text("uploaded\n")
    writable = target(ws, policy={"filesystem": {"writeRoots": ["/workspace"]}})
    c.upload(writable, "/workspace/in", source)
    c.download(target(ws), "/workspace", scratch / "download")
    refused(lambda: c.upload(target(ws), "/workspace/in", source), "an upload under a read root")


def cancelled_call(d: DaemonProcess, c) -> None:
    ws = d.new_workspace()
    stream = c.execute(call(ws, ["sleep", "60"]), timeout_s=120)
    for event in stream:
        if event.WhichOneof("kind") == "started":
            c.cancel(event.tool_call_id, "golden: cancelled")
        if event.WhichOneof("kind") == "finished":
            return
    raise RuntimeError("the cancelled call's stream ended without its end")


def interrupted_call(d: DaemonProcess, c) -> None:
    """A call running when the daemon is killed: the next start records its end."""
    ws = d.new_workspace()
    stream = iter(c.execute(call(ws, sh("echo before-the-kill; sleep 60")), timeout_s=120))
    tool_call_id = ""
    for event in stream:
        tool_call_id = event.tool_call_id
        if event.WhichOneof("kind") == "output":
            break
    started = wait_for(lambda: any(e.type == "ToolCallStarted" for e in c.get_trace(tool_call_id)), 10)
    if not started:
        raise RuntimeError("the interrupted call's start was not recorded")
    d.stop(signal.SIGKILL)


def expire_everything(d: DaemonProcess) -> None:
    """Waits until every call the log has is expired (ToolCallExpired)."""
    def done() -> bool:
        with d.client() as c:
            calls = {e.tool_call_id for e in c.export_events() if e.type == "ToolCallRequested"}
            expired = {e.tool_call_id for e in c.export_events() if e.type == "ToolCallExpired"}
        return bool(calls) and calls <= expired

    if not wait_for(done, 60, 0.3):
        raise RuntimeError("the calls did not all expire")


def read_events(state_dir: Path) -> list[dict]:
    """Every row of the daemon's event table, in order (read-only)."""
    for path in sorted(glob.glob(str(state_dir / "*.db"))):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'events'").fetchone():
                rows = db.execute(f"SELECT {', '.join(COLUMNS)} FROM events ORDER BY seq").fetchall()
                return [dict(zip(COLUMNS, r)) for r in rows]
        finally:
            db.close()
    raise RuntimeError(f"no database with an events table in {state_dir}")


def unmount_under(base: Path) -> None:
    """Mounts a killed daemon left under `base` (staged workspaces): gone before any
    removal could reach through them."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(str(base) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def remove_containers(daemon_id: str) -> None:
    if not daemon_id or not shutil.which("docker"):
        return
    ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=sandboxd.daemon_id={daemon_id}"],
                         capture_output=True, text=True).stdout.split()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)


def capture(base: Path) -> list[dict]:
    host = RemoteHost()
    secret_file = base / "golden-secret"
    secret_file.write_text("golden-file-secret-abcdef\n")
    secret_file.chmod(0o600)
    sign_grant, key, public_key = signing()
    daemon_id = ""
    settings = daemon_settings(host, secret_file, public_key)
    d = make_daemon(base / "d", env=ENV, **settings)
    try:
        host.start()
        d.start()
        daemon_id = d.daemon_id  # (the state dir keeps it: the second start has the same)
        with d.client() as c:
            plain_and_refused_calls(d, c, sign_grant, key)
            file_calls(d, c)
            egress_and_credential_calls(d, c)
            lease_calls(d, c)
            transfer_calls(d, c, base)
            cancelled_call(d, c)
            interrupted_call(d, c)
        # The same state, now with a retention period: the start records the killed
        # call's end, and the sweeps expire every call.
        d = make_daemon(base / "d", env=ENV, **settings,
                        retention={"period_days": RETENTION_S / 86400, "sweep_interval_s": 0.3})
        d.start()
        expire_everything(d)
        d.stop()
        return read_events(d.state_dir)
    except BaseException:
        print(f"the daemon's log ends:\n{d.log()}", file=sys.stderr)
        raise
    finally:
        d.stop()
        host.stop()
        remove_containers(daemon_id)
        unmount_under(base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT), help="the JSON-lines file to write")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="sandboxd-golden-", dir="/tmp"))
    base.chmod(0o755)  # nsjail and the sandbox user traverse it
    t0 = time.monotonic()
    try:
        rows = capture(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
    found = {r["type"] for r in rows}
    missing = [t for t in EVENT_TYPES if t not in found]
    print(f"{len(rows)} events of {len(found)} types in {time.monotonic() - t0:.1f} s -> {out}")
    if missing:
        print(f"not produced: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
