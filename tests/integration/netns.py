"""A network namespace of the test's own, joined to the host by a veth pair: the
"remote hosts" of egress tests live there, reachable from the host only (so from a
sandbox only through the daemon's proxy). Its servers are this process's modules run
in the namespace, each saying "ready" on stdout once it listens."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def add_namespace(ns: str, host_if: str, ns_if: str, host_address: str, addresses: list[str]) -> None:
    """The namespace, its end of the pair holding `addresses` (/24), the host's end
    `host_address`, both up, and the namespace's loopback."""
    ip("netns", "add", ns)
    ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
    ip("link", "set", ns_if, "netns", ns)
    ip("addr", "add", f"{host_address}/24", "dev", host_if)
    ip("link", "set", host_if, "up")
    for address in addresses:
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", ns_if)
    ip("-n", ns, "link", "set", ns_if, "up")
    ip("-n", ns, "link", "set", "lo", "up")


def remove_namespace(proc: subprocess.Popen | None, ns: str, host_if: str) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def self_signed(cert: Path, key: Path, names: list[str]) -> None:
    """A one-day certificate for `names` (the first is its CN)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={names[0]}", "-addext", "subjectAltName=" + ",".join(f"DNS:{n}" for n in names),
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)


def serve_in(ns: str, argv: list[str], what: str) -> subprocess.Popen:
    """Starts argv in the namespace and waits for its "ready"."""
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"{what} did not start: {line} {proc.stderr.read()}")
    return proc


def json_lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []
