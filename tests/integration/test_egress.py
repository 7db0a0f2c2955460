"""egress 'allowlist' for real, on both backends: the sandbox has no network but its own
loopback, the daemon's proxy is its one way out, and every attempt is on the trace.

The "remote" hosts are servers in a network namespace this test run creates
(egress_hosts.py); the proxy resolves test names with the DNS server there. Nothing is
ever aimed at an address the run did not make."""

from __future__ import annotations

import dataclasses
import json
import shutil
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandboxd_testing import make_daemon
from sandboxd_client import errors

from .conftest import BACKENDS, DAEMON_ENV, AdapterClient, call, leftover_sandboxes, public_tmpdir, stop_and_clean
from .egress_hosts import RemoteHosts

ALLOW = ["allowed.test", "*.allowed.test", "rebind.test", "private.test", "self.test"]


@pytest.fixture(scope="module")
def hosts():
    workdir = public_tmpdir("sandboxd-egress-hosts-")
    h = RemoteHosts(workdir).start()
    yield h
    h.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def egress_daemon(docker_engine, hosts):
    base = public_tmpdir("sandboxd-egress-")
    # The tests' principal may lower denyPrivateNetworks (the operator's floor otherwise refuses it).
    egress = {**hosts.daemon_egress_settings(), "private_networks_principals": ["root"]}
    d = make_daemon(base, env=DAEMON_ENV, max_concurrent_calls=64, quotas={"concurrent_calls": 64},
                    egress=egress).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture(params=BACKENDS)
def ec(egress_daemon, request):
    c = AdapterClient(str(egress_daemon.socket), request.param)
    yield c
    c.close()


@pytest.fixture
def ws(egress_daemon) -> Path:
    return egress_daemon.new_workspace({"README.md": "egress\n"})


def allowlist(domains=None, **network) -> dict:
    return {"network": {"egress": "allowlist", "allowDomains": ALLOW if domains is None else domains, **network}}


def py(script: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(script)]


def network_events(client, tool_call_id: str) -> list[dict]:
    return [json.loads(e.payload_json) for e in client.get_trace(tool_call_id) if e.type == "NetworkAccessObserved"]


def run(client, ws, script: str, policy=None, **kw):
    out = client.run(call(ws, py(script), policy or allowlist(), **kw), timeout_s=120)
    assert out.result.status == "success", (out.stdout, out.stderr, out.result.error)
    return dataclasses.replace(out, stdout=out.stdout.decode(), stderr=out.stderr.decode())


FETCH = """
import json, os, ssl, sys, urllib.request, urllib.error
def fetch(url):
    ctx = None
    if url.startswith("https"):
        cafile = "/workspace/cert.pem" if os.path.exists("/workspace/cert.pem") else None
        ctx = ssl.create_default_context(cafile=cafile)
    try:
        r = urllib.request.urlopen(url, timeout=20, context=ctx)
        return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode()}
    except Exception as e:
        return {"status": 0, "body": repr(e)}
"""


# A CONNECT tunnel through the proxy, from inside a sandbox: (socket, status line).
TUNNEL = """
import socket, ssl, time
def tunnel(target):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n".encode())
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        head += s.recv(1)
    return s, head.split(b"\\r\\n")[0].decode()
def client_hello(server_name):
    # The first TLS record a client would send for server_name, without a connection.
    ctx = ssl.create_default_context(cafile="/workspace/cert.pem")
    outg = ssl.MemoryBIO()
    try:
        ctx.wrap_bio(ssl.MemoryBIO(), outg, server_hostname=server_name).do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outg.read()
"""


def fetch_script(*urls: str) -> str:
    return FETCH + f"print(json.dumps([fetch(u) for u in {list(urls)!r}]))\n"


def with_cert(egress_daemon, hosts) -> Path:
    ws = egress_daemon.new_workspace({"cert.pem": hosts.cert.read_text()})
    return ws


# ---------------------------------------------------------------- allowed and denied


def test_allowed_name_works_over_http_and_https_connect(ec, egress_daemon, hosts):
    ws = with_cert(egress_daemon, hosts)
    out = run(ec, ws, fetch_script("http://allowed.test/", "https://allowed.test/", "http://www.allowed.test/bytes/5"))
    got = json.loads(out.stdout)
    assert got == [{"status": 200, "body": "allowed\n"}, {"status": 200, "body": "allowed\n"},
                   {"status": 200, "body": "xxxxx"}]
    records = network_events(ec, out.tool_call_id)
    assert [(r["protocol"], r["host"], r["port"], r["decision"]) for r in records] == [
        ("http", "allowed.test", 80, "allowed"), ("connect", "allowed.test", 443, "allowed"),
        ("http", "www.allowed.test", 80, "allowed")]
    assert records[0]["address"] == hosts.allowed_ip and records[0]["rule"] == "allowed.test"
    assert records[2]["rule"] == "*.allowed.test"
    assert records[1]["status"] == 200 and records[0]["status"] == 200
    assert list(out.result.effects_observed.external_calls) == ["allowed.test:80", "allowed.test:443",
                                                                "www.allowed.test:80"]
    # The TLS server saw the name the client asked for, through the tunnel.
    assert any(e.get("sni") == "allowed.test" for e in hosts.entries())


def test_denied_name_gets_403_naming_the_rule_and_is_never_resolved(ec, ws, hosts):
    out = run(ec, ws, fetch_script("http://denied.test/", "https://denied.test/")
              + "import subprocess; print(subprocess.run(['curl', '-sS', 'https://denied.test/'], capture_output=True,"
                " text=True).stderr)\n")
    first, curl_err = out.stdout.split("\n", 1)
    got = json.loads(first)
    assert got[0]["status"] == 403
    assert "denied.test is not in allowDomains" in got[0]["body"] and "not-allowlisted" in got[0]["body"]
    assert got[1]["status"] == 0 and "403" in got[1]["body"]  # urllib: "Tunnel connection failed: 403"
    assert "403" in curl_err
    records = network_events(ec, out.tool_call_id)
    assert len(records) == 3
    assert all(r["decision"] == "denied" and r["rule"] == "not-allowlisted" and r["host"] == "denied.test"
               for r in records)
    assert {r["protocol"] for r in records} == {"http", "connect"}
    assert list(out.result.effects_observed.external_calls) == []
    # A name that is not allowed is never looked up: no DNS question left the proxy.
    assert not [e for e in hosts.entries() if e.get("dns") == "denied.test"]


def test_socks5_connect_gets_the_same_decisions(ec, egress_daemon, hosts):
    ws = with_cert(egress_daemon, hosts)
    out = run(ec, ws, f"""
        import socket, subprocess
        def curl(url):
            r = subprocess.run(["curl", "-sS", "--cacert", "/workspace/cert.pem", "-x", "socks5h://127.0.0.1:3128",
                                url], capture_output=True, text=True)
            return r.returncode, r.stdout.strip()
        print(curl("http://allowed.test/"), curl("https://allowed.test/"), curl("http://denied.test/")[0])
        s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
        s.sendall(bytes([5, 1, 0]))
        print(s.recv(2).hex())
        s.sendall(bytes([5, 1, 0, 1]) + socket.inet_aton("{hosts.allowed_ip}") + (80).to_bytes(2, "big"))
        print(s.recv(10)[1])
    """)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "(0, 'allowed') (0, 'allowed') 97"  # curl 97: the proxy refused the connection
    assert lines[1:] == ["0500", "2"]  # no authentication; reply 2: not allowed by the ruleset
    records = network_events(ec, out.tool_call_id)
    assert [(r["protocol"], r["host"], r["port"], r["decision"], r["rule"]) for r in records] == [
        ("socks5", "allowed.test", 80, "allowed", "allowed.test"),
        ("socks5", "allowed.test", 443, "allowed", "allowed.test"),
        ("socks5", "denied.test", 80, "denied", "not-allowlisted"),
        ("socks5", hosts.allowed_ip, 80, "denied", "not-allowlisted")]


def test_raw_ip_literals_and_ipv6_are_refused_unless_listed(ec, ws, hosts):
    out = run(ec, ws, fetch_script(f"http://{hosts.allowed_ip}/", "http://[::1]:80/",
                                   f"http://[::ffff:{hosts.allowed_ip}]/"))
    assert [g["status"] for g in json.loads(out.stdout)] == [403, 403, 403]
    records = network_events(ec, out.tool_call_id)
    assert [r["rule"] for r in records] == ["not-allowlisted"] * 3
    # Listed, the literal passes (and still only to an address the rules allow).
    out = run(ec, ws, fetch_script(f"http://{hosts.allowed_ip}/"), allowlist([hosts.allowed_ip]))
    assert json.loads(out.stdout) == [{"status": 200, "body": "allowed\n"}]


def test_names_resolving_to_loopback_private_or_the_host_are_refused(ec, ws, hosts):
    before = len(hosts.entries())
    out = run(ec, ws, fetch_script("http://rebind.test/", "http://private.test/", "http://self.test/"))
    assert [g["status"] for g in json.loads(out.stdout)] == [403, 403, 403]
    records = network_events(ec, out.tool_call_id)
    assert [(r["host"], r["address"], r["rule"]) for r in records] == [
        ("rebind.test", "127.0.0.1", "never-reachable"),
        ("private.test", f"{hosts.prefix}.4", "deny-private-networks"),
        ("self.test", hosts.host_side_ip, "never-reachable"),
    ]
    assert "loopback" in records[0]["reason"] and "daemon host" in records[2]["reason"]
    # They were resolved (that is how the address is known) but nothing was connected.
    assert {e["dns"] for e in hosts.entries()[before:] if "dns" in e} >= {"rebind.test", "private.test", "self.test"}
    assert not [e for e in hosts.entries()[before:] if "server" in e]


def test_deny_private_networks_false_admits_private_but_never_loopback_or_host(ec, ws, hosts):
    out = run(ec, ws, fetch_script("http://rebind.test/", "http://self.test/"),
              allowlist(denyPrivateNetworks=False))
    assert [g["status"] for g in json.loads(out.stdout)] == [403, 403]


# ---------------------------------------------------------------- no other way out


def test_direct_connections_and_dns_fail_fast_and_reach_nothing(ec, ws, hosts):
    before = len(hosts.entries())
    out = run(ec, ws, f"""
        import errno, socket, subprocess, time
        def attempt(kind, fn):
            t = time.monotonic()
            try:
                fn(); r = "ok"
            except OSError as e:
                r = errno.errorcode.get(e.errno, str(e))
            print(kind, r, round(time.monotonic() - t, 1))
        def tcp(addr, family=socket.AF_INET):
            s = socket.socket(family); s.settimeout(10); s.connect(addr)
        def udp(addr):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b"x", addr)
        attempt("tcp", lambda: tcp(("{hosts.allowed_ip}", 80)))
        attempt("udp-dns", lambda: udp(("{hosts.allowed_ip}", 53)))
        attempt("tcp6", lambda: tcp(("{hosts.allowed_ip6}", 80, 0, 0), socket.AF_INET6))
        attempt("getaddrinfo", lambda: socket.getaddrinfo("allowed.test", 80))
        r = subprocess.run(["curl", "-sS", "--noproxy", "*", "-m", "10", "http://allowed.test/"],
                           capture_output=True, text=True)
        print("curl-noproxy", r.returncode)
        r = subprocess.run(["getent", "hosts", "exfil-secret-data.test"], capture_output=True)
        print("getent", r.returncode)
    """)
    lines = dict((ln.split(" ", 1) for ln in out.stdout.strip().splitlines()))
    assert lines["tcp"].split()[0] == "ENETUNREACH"
    assert lines["udp-dns"].split()[0] == "ENETUNREACH"
    assert lines["tcp6"].split()[0] in ("ENETUNREACH", "EADDRNOTAVAIL", "EAFNOSUPPORT")
    assert lines["getaddrinfo"].split()[0] != "ok"
    assert all(float(v.split()[-1]) < 5 for k, v in lines.items() if k in ("tcp", "udp-dns", "tcp6"))
    assert lines["curl-noproxy"] != "0" and lines["getent"] != "0"
    after = hosts.entries()[before:]
    assert not after, f"a direct attempt reached the test hosts: {after}"
    assert network_events(ec, out.tool_call_id) == []


def test_sni_or_host_that_disagrees_with_connect_never_reaches_the_other_host(ec, egress_daemon, hosts):
    ws = with_cert(egress_daemon, hosts)
    before = len(hosts.entries())
    out = run(ec, ws, TUNNEL + textwrap.dedent("""
        s, status = tunnel("allowed.test:443")
        ctx = ssl.create_default_context(cafile="/workspace/cert.pem")
        try:
            t = ctx.wrap_socket(s, server_hostname="other.test")
            t.sendall(b"GET / HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n")
            print("sni", status, t.recv(100))
        except (OSError, ssl.SSLError) as e:
            print("sni", status, "failed", type(e).__name__)
        # The same hello, split over two writes: the check waits for all of it.
        s, status = tunnel("allowed.test:443")
        hello = client_hello("other.test")
        s.sendall(hello[:40]); time.sleep(0.3); s.sendall(hello[40:])
        print("split", status, s.recv(100))
        s, status = tunnel("allowed.test:80")
        s.sendall(b"GET / HTTP/1.1\\r\\nHo"); time.sleep(0.3); s.sendall(b"st: other.test\\r\\n\\r\\n")
        print("host", status, s.recv(100))
        s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
        s.sendall(b"GET http://allowed.test/ HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n")
        print("absolute", s.recv(200).split(b"\\r\\n")[0].decode())
    """))
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("sni HTTP/1.1 200") and "failed" in lines[0]
    assert lines[1] == "split HTTP/1.1 200 Connection established b''"
    assert lines[2] == "host HTTP/1.1 200 Connection established b''"
    assert lines[3] == "absolute HTTP/1.1 403 Forbidden"
    seen = hosts.entries()[before:]
    assert not [e for e in seen if e.get("server") == "other"], seen
    # The allowed server got the tunnels' TCP connections but not one byte of them.
    assert all(e["bytes_read"] == 0 for e in seen if "server" in e)
    rules = [r["rule"] for r in network_events(ec, out.tool_call_id)]
    assert rules == ["sni-mismatch", "sni-mismatch", "host-mismatch", "host-mismatch"]


def test_delayed_split_or_disguised_names_inside_a_tunnel_are_refused(ec, egress_daemon, hosts):
    ws = with_cert(egress_daemon, hosts)
    before = len(hosts.entries())
    out = run(ec, ws, TUNNEL + textwrap.dedent("""
        def answer(s):
            try:
                return s.recv(100)
            except OSError as e:
                return type(e).__name__
        s, _ = tunnel("allowed.test:443"); time.sleep(1.5); s.sendall(client_hello("other.test"))
        print("delayed", answer(s))
        s, _ = tunnel("allowed.test:80"); s.sendall(b"\\r\\nGET / HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n")
        print("crlf", answer(s))
        s, _ = tunnel("allowed.test:80"); s.sendall(b"GET http://other.test/ HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n")
        print("absolute", answer(s))
        s, _ = tunnel("allowed.test:80")
        s.sendall(b"GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\nHost: other.test\\r\\n\\r\\n")
        print("two-hosts", answer(s))
    """))
    assert out.stdout.split() == ["delayed", "b''", "crlf", "b''", "absolute", "b''", "two-hosts", "b''"]
    seen = hosts.entries()[before:]
    assert not [e for e in seen if e.get("server") == "other"]
    assert all(e["bytes_read"] == 0 for e in seen if "server" in e), seen
    rules = [r["rule"] for r in network_events(ec, out.tool_call_id)]
    # Two Hosts: the parser (h11) refuses the head itself.
    assert rules == ["sni-mismatch", "host-mismatch", "host-mismatch", "unreadable-first-bytes"]


def test_a_pipelined_second_request_never_reaches_the_origin(ec, ws, hosts):
    before = len(hosts.entries())
    out = run(ec, ws, """
        import socket
        s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
        s.sendall(b"GET http://allowed.test/ HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n"
                  b"GET /second HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        print(data.split(b"\\r\\n")[0].decode())
    """)
    assert out.stdout.strip() == "HTTP/1.1 200 OK"
    [served] = [e for e in hosts.entries()[before:] if "server" in e]
    [record] = network_events(ec, out.tool_call_id)
    # The origin read exactly the rewritten first request: nothing of the second.
    assert served["bytes_read"] == record["bytesUp"] and served["path"] == "/"


def test_a_flood_of_connections_neither_starves_the_daemon_nor_hides_real_attempts(ec, egress_daemon, hosts):
    """One sandbox holds more idle connections than its endpoint admits and sends a pile
    of junk; its endpoint refuses the excess at once, another sandbox is unaffected, and
    the real attempts made afterwards are still on the record."""
    ws = egress_daemon.new_workspace()
    flood = ec.execute(call(ws, py("""
        import socket, time
        held, refused = [], 0
        for _ in range(400):
            s = socket.socket(socket.AF_UNIX)
            s.connect("/dev/sandboxd/egress.sock")
            held.append(s)
        time.sleep(0.5)
        for s in held:
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    refused += 1
            except BlockingIOError:
                pass
        print("refused", refused, flush=True)
        for s in held:
            s.close()
        for _ in range(300):  # junk: one byte, then gone
            s = socket.socket(socket.AF_UNIX); s.connect("/dev/sandboxd/egress.sock"); s.sendall(b"x"); s.close()
        time.sleep(0.5)
        import urllib.request
        print(urllib.request.urlopen("http://allowed.test/", timeout=20).read().decode().strip(), flush=True)
        try:
            urllib.request.urlopen("http://flood-target.test/", timeout=20)
        except Exception as e:
            print("denied", getattr(e, "code", e), flush=True)
        time.sleep(2)
    """), allowlist()))
    events = iter(flood)
    out = b""
    for event in events:
        if event.WhichOneof("kind") == "output":
            out += event.output.data
            break
    # Meanwhile, another sandbox goes about its business.
    other = run(ec, egress_daemon.new_workspace(), fetch_script("http://allowed.test/"))
    assert json.loads(other.stdout) == [{"status": 200, "body": "allowed\n"}]
    result = None
    for event in events:
        kind = event.WhichOneof("kind")
        if kind == "output":
            out += event.output.data
        elif kind == "finished":
            result = event.finished.result
    text = out.decode()
    refused = int(text.split("refused ")[1].split()[0]) if "refused " in text else None
    assert result is not None and result.status == "success", text
    lines = text.split("\n")
    assert "allowed" in lines and "denied 403" in lines, text
    records = network_events(ec, result.tool_call_id)
    hosts_recorded = [r.get("host") for r in records]
    assert "allowed.test" in hosts_recorded and "flood-target.test" in hosts_recorded
    assert list(result.effects_observed.external_calls) == ["allowed.test:80"]
    # The endpoint admits 256 connections at once; the rest were closed on arrival.
    assert refused is not None and refused >= 400 - 256, text


def test_sandbox_cannot_reach_daemon_socket_docker_api_or_another_sandbox(ec, ws, egress_daemon, hosts):
    listener = ec.execute(call(ws, py("""
        import socket, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 9999)); s.listen(); print("listening", flush=True); time.sleep(20)
    """), allowlist()))
    events = iter(listener)
    for event in events:
        if event.WhichOneof("kind") == "output":
            break
    try:
        out = run(ec, ws, textwrap.dedent(f"""
            import os, socket
            def unix(path):
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(path); return "connected"
                except OSError as e:
                    return type(e).__name__
            print("daemon", unix({str(egress_daemon.socket)!r}))
            print("docker", unix("/var/run/docker.sock"), unix("/run/docker.sock"))
            print("dev", sorted(os.listdir("/dev/sandboxd")))
            s = socket.socket()
            try:
                s.connect(("127.0.0.1", 9999)); print("peer connected")
            except OSError as e:
                print("peer", type(e).__name__)
        """) + FETCH + "print(fetch('http://127.0.0.1:9999/')['status'], fetch('http://localhost:9999/')['status'])\n")
    finally:
        listener.cancel()
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "daemon FileNotFoundError"
    assert lines[1] == "docker FileNotFoundError FileNotFoundError"
    # Docker's output FIFOs (a directory bound read-only); nsjail hands the jail its pipes
    # and binds the seccomp program its shim loads.
    assert lines[2] == ("dev ['egress.sock', 'gate', 'shim', 'stdio']" if ec.adapter == "docker"
                        else "dev ['egress.sock', 'gate', 'seccomp', 'shim']")
    assert lines[3] == "peer ConnectionRefusedError"
    # NO_PROXY keeps loopback direct, and the sandbox's own loopback has nothing there.
    assert lines[4] == "0 0"


def test_connect_to_the_docker_api_port_through_the_proxy_is_refused(ec, ws, hosts):
    out = run(ec, ws, """
        import socket
        s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
        s.sendall(b"CONNECT 127.0.0.1:2375 HTTP/1.1\\r\\n\\r\\n")
        print(s.recv(300).split(b"\\r\\n")[0].decode())
    """, allowlist(["127.0.0.1", "allowed.test"]))
    assert out.stdout.strip() == "HTTP/1.1 403 Forbidden"
    [record] = network_events(ec, out.tool_call_id)
    assert record["rule"] == "never-reachable" and record["port"] == 2375


# ---------------------------------------------------------------- recording


def test_byte_counts_match_what_the_server_sent(ec, ws, hosts):
    before = len(hosts.entries())
    out = run(ec, ws, """
        import http.client, urllib.request
        body = urllib.request.urlopen("http://allowed.test/bytes/300000", timeout=20).read()
        c = http.client.HTTPConnection("127.0.0.1", 3128, timeout=20)
        c.set_tunnel("allowed.test", 80)
        c.request("GET", "/bytes/123456")
        body2 = c.getresponse().read()
        print(len(body), len(body2))
    """)
    assert out.stdout.strip() == "300000 123456"
    records = network_events(ec, out.tool_call_id)
    served = sorted((e for e in hosts.entries()[before:] if e.get("server") == "allowed"), key=lambda e: e["path"])
    assert [e["path"] for e in served] == ["/bytes/123456", "/bytes/300000"]
    by_path = {"/bytes/300000": records[0], "/bytes/123456": records[1]}
    for entry in served:
        rec = by_path[entry["path"]]
        assert rec["bytesDown"] == entry["bytes_written"]
        assert rec["bytesUp"] == entry["bytes_read"]
    assert records[0]["startedAt"] <= records[0]["endedAt"]


def test_sandboxctl_shows_network_attempts_and_the_network_plan(egress_daemon, ws, hosts):
    from .test_cli import ctl

    policy = ws.parent / "egress-policy.json"
    policy.write_text(json.dumps(allowlist(["allowed.test"])))
    p = ctl(egress_daemon, "exec", "--json", "--policy", str(policy), "--workspace", str(ws), "--",
            "sh", "-c", "curl -s http://allowed.test/ >/dev/null; curl -s http://denied.test/")
    assert p.returncode == 0, p.stderr
    assert b"not in allowDomains" in p.stdout
    result = json.loads(p.stdout.splitlines()[-1])
    assert result["effectsObserved"]["externalCalls"] == ["allowed.test:80"]
    trace = ctl(egress_daemon, "trace", result["toolCallId"]).stdout.decode()
    assert f"allowed http allowed.test:80 ({hosts.allowed_ip})  rule allowed.test  up " in trace
    assert "denied http denied.test:80  rule not-allowlisted  - host denied.test is not in allowDomains" in trace
    explained = ctl(egress_daemon, "explain", "--json", "--policy", str(policy), "--workspace", str(ws))
    assert json.loads(explained.stdout)["network"]["allowDomains"] == ["allowed.test"]


def test_audit_finds_the_calls_that_tried_a_domain(egress_daemon, ws, hosts):
    with egress_daemon.client() as c:
        reached = run(c, ws, fetch_script("http://audit.allowed.test/"))
        refused = run(c, ws, fetch_script("http://exfil-target.test/"))
        neither = run(c, ws, "print('offline')")
        assert [x.tool_call_id for x in c.query_calls(domain="audit.allowed.test").calls] == [reached.tool_call_id]
        assert reached.tool_call_id in {x.tool_call_id for x in c.query_calls(domain="*.allowed.test").calls}
        # A denied attempt is an attempt: the reviewer asking "who tried?" finds it.
        [row] = c.query_calls(domain="exfil-target.test").calls
        assert row.tool_call_id == refused.tool_call_id and list(row.domains) == []
        found = {x.tool_call_id: list(x.domains) for x in c.query_calls(page_size=500).calls}
        assert found[reached.tool_call_id] == ["audit.allowed.test"] and found[neither.tool_call_id] == []


def test_record_network_access_off_still_records_denials(ec, ws, hosts):
    policy = allowlist()
    policy["audit"] = {"recordNetworkAccess": False}
    out = run(ec, ws, fetch_script("http://allowed.test/", "http://denied.test/"), policy)
    assert [g["status"] for g in json.loads(out.stdout)] == [200, 403]
    assert [r["host"] for r in network_events(ec, out.tool_call_id)] == ["denied.test"]


def test_open_with_deny_private_networks_reaches_any_name_but_no_private_address(ec, egress_daemon, hosts):
    ws = with_cert(egress_daemon, hosts)
    out = run(ec, ws, fetch_script("http://other.test/", "https://allowed.test/", "http://rebind.test/",
                                   "http://private.test/", f"http://{hosts.other_ip}/"),
              {"network": {"egress": "open"}})
    assert [g["status"] for g in json.loads(out.stdout)] == [200, 200, 403, 403, 200]
    records = network_events(ec, out.tool_call_id)
    assert [(r["host"], r["decision"], r["rule"]) for r in records] == [
        ("other.test", "allowed", "open"), ("allowed.test", "allowed", "open"),
        ("rebind.test", "denied", "never-reachable"), ("private.test", "denied", "deny-private-networks"),
        (hosts.other_ip, "allowed", "open")]
    assert list(out.result.effects_observed.external_calls) == ["other.test:80", "allowed.test:443",
                                                                f"{hosts.other_ip}:80"]


def test_allowlist_without_the_proxy_is_refused_never_run_open(spare_daemon, docker_engine):
    d = spare_daemon(egress={"enabled": False}).start()
    ws = d.new_workspace()
    with d.client() as c, pytest.raises(errors.Unavailable) as exc:
        c.run(call(ws, ["true"], allowlist(["allowed.test"])))
    assert "policy.network.egress" in exc.value.message and "egress proxy" in exc.value.message
    assert not leftover_sandboxes(docker_engine, d)


@pytest.mark.parametrize("pattern, suffix, section", [
    ("*.railway.app", "up.railway.app", "Public Suffix List, private section"),
    ("*.on.aws", ".on.aws", "Public Suffix List, private section"),
    ("*.herokuapp.com", "herokuapp.com", "Public Suffix List, private section"),
    ("*.firebaseio.com", "firebaseio.com", "sandboxd's own list of shared suffixes"),
])
def test_a_wildcard_over_a_platforms_customers_is_refused_before_anything_starts(ec, ws, egress_daemon,
                                                                                  docker_engine, pattern, suffix,
                                                                                  section):
    with pytest.raises(errors.InvalidArgument) as exc:
        ec.run(call(ws, ["true"], allowlist(["allowed.test", "myapp.railway.app", "*.allowed.test", pattern])))
    message = exc.value.message
    assert "policy.network.allowDomains[3]" in message and pattern in message, message
    assert f"{suffix}', a public suffix ({section})" in message or f"{suffix}' is a public suffix ({section})" \
        in message, message
    assert not leftover_sandboxes(docker_engine, egress_daemon)


def test_explain_shows_the_network_plan(egress_daemon, ws):
    with egress_daemon.client() as c:
        resp = c.explain(allowlist(["pypi.test", "*.files.test"]), str(ws))
    plan = json.loads(resp.network_plan_json)
    assert plan["egress"] == "allowlist" and plan["proxy"] == "http://127.0.0.1:3128"
    assert plan["allowDomains"] == ["pypi.test", "*.files.test"]
    spec = json.loads(resp.spec_json)
    assert spec["argv"][:4] == ["/dev/sandboxd/shim", "--egress", "/dev/sandboxd/egress.sock", "3128"]
    # Docker hands the command its output FIFOs; file accesses are recorded (the default).
    assert spec["argv"][4:9] == ["--stdio", "/dev/sandboxd/stdio", "--gate", "/dev/sandboxd/gate", "--"]


def test_fifty_parallel_sandboxes_all_get_correct_decisions(egress_daemon, hosts):
    """Half on each backend; each call must see exactly its own two attempts."""
    workspaces = [egress_daemon.new_workspace() for _ in range(50)]
    clients = {name: AdapterClient(str(egress_daemon.socket), name) for name in ("docker", "nsjail")}

    def one(i: int):
        c = clients["docker" if i % 2 else "nsjail"]
        return c, c.run(call(workspaces[i], py(fetch_script(f"http://allowed.test/bytes/{i + 1}",
                                                            f"http://denied{i}.test/")), allowlist()),
                        timeout_s=300)

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(50)))
    for i, (c, out) in enumerate(results):
        assert out.result.status == "success", (i, out.stderr)
        got = json.loads(out.stdout.decode())
        assert got[0] == {"status": 200, "body": "x" * (i + 1)} and got[1]["status"] == 403, (i, got)
        records = network_events(c, out.tool_call_id)
        assert [(r["host"], r["decision"]) for r in records] == [("allowed.test", "allowed"),
                                                                  (f"denied{i}.test", "denied")], i
    for c in clients.values():
        c.close()


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_a_leased_sandbox_keeps_its_allowlist_and_records_each_commands_attempts(egress_daemon, hosts, adapter):
    ws = egress_daemon.new_workspace()
    with egress_daemon.client() as c:
        lease = c.acquire_sandbox(str(ws), allowlist(), adapter=adapter)
        runs = []
        for url in ("http://allowed.test/", "http://denied.test/"):
            cmd = call(ws, py(fetch_script(url)), allowlist())
            cmd["runtime"].update({"leaseId": lease.lease_id, "adapter": adapter})
            out = c.run(cmd)
            assert out.result.status == "success", out.stderr
            runs.append(out)
        c.release_sandbox(lease.lease_id)
    assert json.loads(runs[0].stdout) == [{"status": 200, "body": "allowed\n"}]
    assert json.loads(runs[1].stdout)[0]["status"] == 403
    # Each command's trace holds its own attempt only.
    with egress_daemon.client() as c:
        first, second = (network_events(c, r.tool_call_id) for r in runs)
    assert [(r["host"], r["decision"]) for r in first] == [("allowed.test", "allowed")]
    assert [(r["host"], r["decision"]) for r in second] == [("denied.test", "denied")]
    assert list(runs[0].result.effects_observed.external_calls) == ["allowed.test:80"]


def test_attempts_past_the_record_size_are_counted_by_destination(spare_daemon, hosts):
    """past egress.max_records_per_call the proxy keeps counting: attempts, bytes each
    way, per destination and decision, in one NetworkAccessObserved summary, and what
    was reached still shows in externalCalls"""
    d = spare_daemon(egress={**hosts.daemon_egress_settings(), "max_records_per_call": 3}).start()
    ws = d.new_workspace()
    with d.client() as c:
        out = run(c, ws, FETCH + """
for _ in range(3):
    assert fetch("http://allowed.test/")["status"] == 200
for _ in range(4):
    assert fetch("http://flood-target.test/")["status"] == 403
assert fetch("http://www.allowed.test/")["status"] == 200
""", {**allowlist(), "audit": {"recordNetworkAccess": True}})
        events = network_events(c, out.tool_call_id)
    kept = [e for e in events if "host" in e]
    [summary] = [e for e in events if "dropped" in e]
    assert [e["host"] for e in kept] == ["allowed.test"] * 3
    assert summary["dropped"] == 5
    by = {(s["host"], s["port"], s["decision"]): s for s in summary["byDestination"]}
    assert set(by) == {("flood-target.test", 80, "denied"), ("www.allowed.test", 80, "allowed")}
    assert by[("flood-target.test", 80, "denied")]["attempts"] == 4
    assert by[("www.allowed.test", 80, "allowed")]["attempts"] == 1
    assert by[("www.allowed.test", 80, "allowed")]["bytesDown"] > 0
    assert sorted(out.result.effects_observed.external_calls) == ["allowed.test:80", "www.allowed.test:80"]
