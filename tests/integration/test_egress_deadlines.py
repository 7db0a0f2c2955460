"""The egress proxy's deadlines, for real: a real EgressProxy in this process (its head
timeout and relay idle timeout shortened through its constructor, so nothing here
waits 30 s), its endpoint's Unix socket as the sandbox's shim would use it, and the
test's servers in a network namespace of their own (egress_hosts.py: allowed.test on
.2, "lenient" on :8080 keeps connections alive and logs every request it reads).

What is measured is behaviour: a head trickled in a byte at a time is cut once the
deadline from its first byte has passed, long before its last byte would have come,
and never reaches the origin. Every request head the proxy reads is held to the same
deadline (the first, each later one inside a CONNECT tunnel, a SOCKS5 request, a TLS
ClientHello), and so is the framing it holds of a body (a chunk-size line, a trailer);
a tunnel idle between requests is not cut by it, only by the relay's idle timeout. DNS
traffic goes to UDP sockets on loopback this test holds and never answers."""

from __future__ import annotations

import shutil
import socket
import ssl
import time
from pathlib import Path

import pytest

from sandboxd.egress import proxy as proxy_module
from sandboxd.egress.proxy import EgressProxy

from .conftest import public_tmpdir
from .egress_hosts import RemoteHosts

HEAD_S = 2.0  # the shortened head timeout
TRICKLE_S = 0.3  # a byte per 0.3 s, as the red-team sent it
# Longer than the deadline by far: the whole of it would take ~20 s to trickle in.
SLOW_HEAD = b"GET /two HTTP/1.1\r\nHost: allowed.test\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"


@pytest.fixture(scope="module")
def hosts():
    workdir = public_tmpdir("sandboxd-deadline-hosts-")
    h = RemoteHosts(workdir, tag="d", subnet="10.216").start()
    yield h
    h.stop()
    shutil.rmtree(workdir, ignore_errors=True)


class Proxy:
    """A real EgressProxy on the test hosts, one endpoint allowing allowed.test."""

    def __init__(self, tmp: Path, hosts: RemoteHosts | None, dns_servers: tuple[str, ...] = (), **timeouts: float):
        exempt = (f"{hosts.allowed_ip}/32", f"{hosts.other_ip}/32") if hosts else ()
        servers = dns_servers or ((f"{hosts.allowed_ip}:53",) if hosts else ())
        self.proxy = EgressProxy(socket_dir=tmp / "egress", host_overrides={}, system_dns=False, dns_servers=servers,
                                 exempt_networks=exempt, **timeouts)
        self.proxy.start()
        self.ep = self.proxy.open_endpoint("sbx-deadlines", self.proxy.rules(("allowed.test",), True), uid=0, gid=0)
        self._records: list = []

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(20)
        s.connect(str(self.ep.socket_path))
        return s

    def tunnel(self, target: bytes) -> socket.socket:
        s = self.connect()
        s.sendall(b"CONNECT " + target + b" HTTP/1.1\r\nHost: " + target + b"\r\n\r\n")
        assert read_until(s, b"\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        return s

    def record(self):
        """The endpoint's one record, once the proxy has kept it."""
        deadline = time.monotonic() + 10
        while not self._records and time.monotonic() < deadline:
            self._records += self.proxy.take_records(self.ep)[0]
            time.sleep(0.05)
        assert len(self._records) == 1, self._records
        return self._records[0]

    def close(self) -> None:
        self.proxy.close_endpoint(self.ep)
        self.proxy.stop()


@pytest.fixture
def make_proxy(tmp_path):
    made: list[Proxy] = []

    def make(hosts: RemoteHosts | None, **kwargs) -> Proxy:
        p = Proxy(tmp_path / str(len(made)), hosts, **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def read_until(s: socket.socket, end: bytes) -> bytes:
    out = b""
    while not out.endswith(end):
        chunk = s.recv(65536)
        assert chunk, f"closed after {out!r}"
        out += chunk
    return out


def trickle(s: socket.socket, data: bytes) -> tuple[bool, float, bytes]:
    """Sends `data` a byte every TRICKLE_S until the proxy ends the connection:
    (whether it did before the last byte, seconds from the first byte, what it answered)."""
    s.settimeout(TRICKLE_S)
    answer = b""
    start = time.monotonic()
    for i in range(len(data)):
        try:
            s.sendall(data[i:i + 1])
            chunk = s.recv(65536)
        except TimeoutError:
            continue  # nothing yet: the next byte
        except OSError:  # reset, or the write side gone
            return True, time.monotonic() - start, answer
        if not chunk:
            return True, time.monotonic() - start, answer
        answer += chunk
    return False, time.monotonic() - start, answer


def lenient_paths(hosts: RemoteHosts) -> list[str]:
    return [e["path"] for e in hosts.entries() if e.get("server") == "lenient" and "path" in e]


# ------------------------------------------------------------------ request heads


def test_a_later_head_inside_a_connect_tunnel_has_the_head_deadline(hosts, make_proxy):
    p = make_proxy(hosts, head_timeout_s=HEAD_S)
    s = p.tunnel(b"allowed.test:8080")
    s.sendall(b"GET /one HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert read_until(s, b"ok\n").startswith(b"HTTP/1.1 200 OK")
    cut, after_s, answer = trickle(s, SLOW_HEAD)
    s.close()
    assert cut and answer == b"", ("the second head was read to its end", after_s, answer)
    # Cut at the deadline from the head's first byte: not before it, and long before the
    # head's end (some 20 s of trickling).
    assert HEAD_S <= after_s < len(SLOW_HEAD) * TRICKLE_S / 2, after_s
    rec = p.record()
    assert (rec.protocol, rec.rule, rec.status) == ("connect", "head-timeout", 200), rec
    assert "not complete within 2 s" in rec.reason
    assert "/two" not in lenient_paths(hosts)


def test_a_tunnel_idle_between_requests_is_not_cut_by_the_head_deadline(hosts, make_proxy):
    # The deadline runs from a head's first byte, not from the end of the request before.
    p = make_proxy(hosts, head_timeout_s=HEAD_S)
    s = p.tunnel(b"allowed.test:8080")
    s.sendall(b"GET /first HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    read_until(s, b"ok\n")
    time.sleep(HEAD_S + 1)
    s.sendall(b"GET /after-a-pause HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert read_until(s, b"ok\n").startswith(b"HTTP/1.1 200 OK")
    s.close()
    assert "/after-a-pause" in lenient_paths(hosts)


def test_the_first_head_of_a_plain_request_has_the_head_deadline(hosts, make_proxy):
    p = make_proxy(hosts, head_timeout_s=HEAD_S)
    s = p.connect()
    cut, after_s, answer = trickle(s, b"GET http://allowed.test:8080/plain HTTP/1.1\r\nX-Slow: " + b"a" * 60 + b"\r\n\r\n")
    s.close()
    assert cut and answer.startswith(b"HTTP/1.1 408 ") and b"head-timeout" in answer, (after_s, answer)
    assert after_s < 10, after_s
    assert p.record().rule == "head-timeout"
    assert "/plain" not in lenient_paths(hosts)


def test_a_socks5_request_has_the_head_deadline(make_proxy):
    p = make_proxy(None, head_timeout_s=HEAD_S)
    s = p.connect()
    name = b"a-long-name-trickled-in." * 8 + b"allowed.test"
    request = b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + (80).to_bytes(2, "big")
    cut, after_s, _ = trickle(s, request)
    s.close()
    assert cut and HEAD_S <= after_s < len(request) * TRICKLE_S / 2, after_s
    assert p.record().rule == "head-timeout"


def test_a_tls_client_hello_inside_a_tunnel_has_the_head_deadline(hosts, make_proxy):
    p = make_proxy(hosts, head_timeout_s=HEAD_S)
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="allowed.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    s = p.tunnel(b"allowed.test:443")
    cut, after_s, _ = trickle(s, hello)
    s.close()
    assert cut and HEAD_S <= after_s < 10, after_s
    assert p.record().rule == "head-timeout"


# ------------------------------------------------------------------ a body's framing


@pytest.mark.parametrize("tail", [b"0" * 60, b"0\r\nX-Trailer: " + b"t" * 60], ids=["size-line", "trailer"])
def test_a_chunked_bodys_framing_has_the_head_deadline(hosts, make_proxy, tail):
    p = make_proxy(hosts, head_timeout_s=HEAD_S)
    s = p.connect()
    s.sendall(b"POST http://allowed.test:8080/chunked HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    cut, after_s, answer = trickle(s, tail)
    s.close()
    assert cut and answer.startswith(b"HTTP/1.1 408 ") and b"framing-timeout" in answer, (after_s, answer)
    assert HEAD_S <= after_s < len(tail) * TRICKLE_S / 2, after_s
    rec = p.record()
    assert (rec.decision, rec.rule, rec.status) == ("allowed", "framing-timeout", 408), rec
    assert "/chunked" not in lenient_paths(hosts)  # the origin never had a whole request


def test_a_chunked_body_inside_a_tunnel_has_the_head_deadline(hosts, make_proxy):
    p = make_proxy(hosts, head_timeout_s=HEAD_S)
    s = p.tunnel(b"allowed.test:8080")
    s.sendall(b"POST /tunnel-chunked HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n")
    cut, after_s, _ = trickle(s, b"f" * 60)
    s.close()
    assert cut and HEAD_S <= after_s < 10, after_s
    assert p.record().rule == "framing-timeout"


# ------------------------------------------------------------------ the relay and DNS


def test_a_relay_on_which_nothing_moves_is_closed(hosts, make_proxy):
    p = make_proxy(hosts, head_timeout_s=HEAD_S, relay_idle_timeout_s=3.0)
    s = p.tunnel(b"allowed.test:8080")
    s.sendall(b"GET /idle HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    read_until(s, b"ok\n")
    start = time.monotonic()
    s.settimeout(20)
    assert s.recv(65536) == b""
    assert 3.0 <= time.monotonic() - start < 15
    s.close()
    rec = p.record()
    assert rec.decision == "allowed" and "nothing moved either way for 3 s" in rec.error, rec


def test_a_lookup_has_one_deadline_however_many_servers_stay_silent(make_proxy, monkeypatch):
    # Three servers that never answer: each used to cost 2 s per question, one after
    # the other (12 s); the lookup is held to DNS_TIMEOUT_S as a whole.
    monkeypatch.setattr(proxy_module, "DNS_TIMEOUT_S", 1.0)
    silent = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    try:
        for u in silent:
            u.bind(("127.0.0.1", 0))
        servers = tuple(f"127.0.0.1:{u.getsockname()[1]}" for u in silent)
        p = make_proxy(None, dns_servers=servers)
        s = p.connect()
        start = time.monotonic()
        s.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n")
        answer = s.recv(65536)
        elapsed = time.monotonic() - start
        s.close()
        assert answer.startswith(b"HTTP/1.1 502 "), answer
        assert elapsed < 4, elapsed
        assert "no answer within 1 s" in p.record().reason
    finally:
        for u in silent:
            u.close()
