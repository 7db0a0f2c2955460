"""HTTP request smuggling through the egress proxy, for real, on both backends: a sandbox
sends what a lenient origin would read as a second request (with another Host), through
the proxy and inside a CONNECT tunnel; the origin, in a network namespace this run made
(egress_hosts.py, "lenient" on port 8080), logs every request it reads. The second
request never reaches it, and every attempt is on the call's record."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import pytest

from sandboxd_testing import make_daemon

from .conftest import BACKENDS, DAEMON_ENV, AdapterClient, call, public_tmpdir, stop_and_clean
from .egress_hosts import RemoteHosts

POLICY = {"network": {"egress": "allowlist", "allowDomains": ["allowed.test"]}}


@pytest.fixture(scope="module")
def hosts():
    workdir = public_tmpdir("sandboxd-smuggling-hosts-")
    h = RemoteHosts(workdir, tag="m", subnet="10.214").start()
    yield h
    h.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(docker_engine, hosts):
    base = public_tmpdir("sandboxd-smuggling-")
    # PYTHONPATH passes through, so that this test can be pointed at another tree's daemon.
    env = {**DAEMON_ENV, **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    d = make_daemon(base, env=env, egress=hosts.daemon_egress_settings()).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture(params=BACKENDS)
def client(daemon, request):
    c = AdapterClient(str(daemon.socket), request.param)
    yield c
    c.close()


def run(client, daemon, script: str):
    ws = daemon.new_workspace()
    out = client.run(call(ws, ["python3", "-c", SEND + textwrap.dedent(script)], POLICY), timeout_s=120)
    assert out.result.status == "success", (out.stdout, out.stderr, out.result.error)
    records = [json.loads(e.payload_json) for e in client.get_trace(out.tool_call_id)
               if e.type == "NetworkAccessObserved"]
    return out.stdout.decode().split("\n")[:-1], records


# Inside the sandbox: one connection to the proxy, the pieces sent a moment apart,
# the write side closed, and what came back (its first line).
SEND = """
import re, socket, time
def send(*pieces, tunnel=None):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    got = b""
    if tunnel:
        s.sendall(b"CONNECT " + tunnel + b" HTTP/1.1\\r\\nHost: " + tunnel + b"\\r\\n\\r\\n")
        while b"\\r\\n\\r\\n" not in got:
            got += s.recv(1)
    for i, piece in enumerate(pieces):
        if i:
            time.sleep(0.3)  # a later piece: its own read, most likely (either way is framed the same)
        s.sendall(piece)
    # The proxy ends the connection once its one request is answered or refused: read to
    # that end (half-closing first raced the origin's answer on a busy machine). A
    # connection the proxy keeps waiting on (a body not yet whole) is half-closed after 5 s.
    s.settimeout(5)
    try:
        while chunk := s.recv(65536):
            got += chunk
    except socket.timeout:
        s.settimeout(20)
        try:
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
    except OSError:
        pass
    lines = [l.decode("latin-1") for l in re.findall(rb"HTTP/1[.]1 [0-9]{3}[^\\r\\n]*", got)]
    print(" | ".join(lines) or "nothing")
SMUGGLED = b"GET /smuggled HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n"
"""


def lenient_requests(hosts, before: int) -> list[dict]:
    return [e for e in hosts.entries()[before:] if e.get("server") == "lenient"]


def test_smuggling_through_a_proxy_request_never_reaches_the_origin(client, daemon, hosts):
    before = len(hosts.entries())
    lines, records = run(client, daemon, """
        post = b"POST http://allowed.test:8080/first HTTP/1.1\\r\\nHost: allowed.test:8080\\r\\n"
        send(post + b"Transfer-Encoding: identity\\r\\n\\r\\n" + SMUGGLED)
        send(post + b"Transfer-Encoding: xchunked\\r\\nContent-Length: 0\\r\\n\\r\\n" + SMUGGLED)
        send(post + b"Content-Length: 5\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\n" + SMUGGLED)
        send(post + b"Transfer-Encoding: chunked\\r\\n\\r\\n3\\r\\nabc\\r\\n0\\r\\n\\r\\n" + SMUGGLED)
        send(post + b"Content-Length: 3\\r\\n\\r\\nabc" + SMUGGLED)
        send(b"GET http://allowed.test:8080/first HTTP/1.1\\r\\nX-A: 1\\r\\n Host: other.test\\r\\n\\r\\n")
        send(b"GET http://[allowed.test]:8080/ HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n")
    """)
    assert lines == ["HTTP/1.1 400 Bad Request"] * 3 + ["HTTP/1.1 200 OK"] * 2 + ["HTTP/1.1 400 Bad Request"] * 2, (
        lines, [(r["rule"], r["reason"], r["error"]) for r in records])
    seen = lenient_requests(hosts, before)
    # The origin read exactly the two well-framed requests, their bodies whole, and nothing else.
    assert [(e["method"], e["path"], e["host"], e["body"]) for e in seen] == [
        ("POST", "/first", "allowed.test:8080", "abc")] * 2, seen
    assert [(r["host"], r["decision"], r["rule"], r["status"]) for r in records] == [
        ("allowed.test", "denied", "bad-request", 400)] * 3 + [
        ("allowed.test", "allowed", "allowed.test", 200)] * 2 + [
        ("allowed.test", "denied", "bad-request", 400)] * 2
    assert "Transfer-Encoding 'identity' is not supported" in records[0]["reason"]
    assert "both Content-Length and Transfer-Encoding" in records[2]["reason"]
    assert all("bytes after the end of the request were not forwarded" in r["error"] for r in records[3:5])
    assert "obsolete line folding" in records[5]["reason"]


def test_smuggling_inside_a_connect_tunnel_never_reaches_the_origin(client, daemon, hosts):
    before = len(hosts.entries())
    lines, records = run(client, daemon, """
        first = b"GET /first HTTP/1.1\\r\\nHost: allowed.test:8080\\r\\n\\r\\n"
        t = b"allowed.test:8080"
        send(first, SMUGGLED, tunnel=t)  # the Host changes on the second request
        send(first + b"GET /second HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n", tunnel=t)  # both checked, both pass
        send(b" GET /smuggled HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n", tunnel=t)  # a leading space
        send(b"GET\\t/smuggled HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n", tunnel=t)  # a tab after the method
        send(b"A" * 21 + b" /smuggled HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n", tunnel=t)  # a 21-letter method
        send(b"POST /first HTTP/1.1\\r\\nHost: allowed.test\\r\\nTransfer-Encoding: identity\\r\\n\\r\\n" + SMUGGLED,
             tunnel=t)
    """)
    assert lines[0].startswith("HTTP/1.1 200 Connection established | HTTP/1.1 200 OK")
    assert lines[1] == "HTTP/1.1 200 Connection established | HTTP/1.1 200 OK | HTTP/1.1 200 OK"
    assert lines[2:] == ["HTTP/1.1 200 Connection established"] * 4
    seen = lenient_requests(hosts, before)
    assert sorted(e["path"] for e in seen) == ["/first", "/first", "/second"], seen
    assert not [e for e in seen if e.get("host") == "other.test"]
    assert [(r["decision"], r["rule"]) for r in records] == [
        ("denied", "host-mismatch"), ("allowed", "allowed.test"), ("denied", "unreadable-first-bytes"),
        ("denied", "unreadable-first-bytes"), ("denied", "host-mismatch"), ("denied", "unreadable-first-bytes")]
    assert all(r["host"] == "allowed.test" and r["port"] == 8080 for r in records)
    assert "'other.test' disagrees with the CONNECT target allowed.test" in records[0]["reason"]
