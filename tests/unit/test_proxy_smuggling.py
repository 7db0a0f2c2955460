"""The egress proxy's framing, end to end through a real EgressProxy endpoint: request
smuggling (CL+TE, transfer codings other than chunked, bytes after a chunked body, a
pipelined second request, obsolete line folding), heads inside a CONNECT tunnel that
are not HTTP this proxy can read, a Host that changes inside a plain-HTTP tunnel, that
what is checked is what goes (however the stream is cut into reads; Host against the
URL, userinfo, HTTP/1.0 keep-alive, Expect, Upgrade, CONNECT targets), and inputs that
once raised inside the handler (fuzzed: every attempt gets an answer and a record, and
no exception escapes).

The one seam: `_connect` goes to an in-process origin on a Unix socket instead of a
resolved address (the address rules are egress.py's and tested there; the proxy
refuses every loopback address by design). The origin keeps every byte it is sent, so
each test states exactly what reached it. Nothing waits by sleeping: the origin is read
once every connection the proxy opened to it has ended (`Origin.requests`), and a
piece sent "later" goes once the origin holds what the proxy made of the pieces before
it (so the proxy read them apart)."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h11
import pytest

from sandboxd.policy.egress_rules import EgressRules, decide_host
from sandboxd.egress.proxy import EgressProxy, ProxyRefusal
from sandboxd.egress.http import BodyFramer, TunnelRequests, parse_request

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class Origin:
    """A lenient origin in this process: each connection is read to its end (EOF or a
    reset), kept as it arrives, then answered once."""

    def __init__(self, path: Path):
        self.path = path
        self._streams: list[bytearray] = []  # one per connection, in the order they came
        self._ended = 0
        self._opened = 0  # counted by the proxy as it connects (ToOrigin._connect)
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(256)
        threading.Thread(target=self._accept, daemon=True).start()

    def opening(self) -> None:
        with self._cond:
            self._opened += 1

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            stream = bytearray()
            with self._cond:
                self._streams.append(stream)
            threading.Thread(target=self._serve, args=(conn, stream), daemon=True).start()

    def _serve(self, conn: socket.socket, stream: bytearray) -> None:
        conn.settimeout(10)
        try:
            while chunk := conn.recv(65536):
                with self._cond:
                    stream += chunk
                    self._cond.notify_all()
            conn.sendall(ANSWER)
        except OSError:
            pass
        finally:
            conn.close()
            with self._cond:
                self._ended += 1
                self._cond.notify_all()

    def _wait(self, condition, what: str) -> None:
        with self._cond:
            assert self._cond.wait_for(condition, timeout=15), f"the origin never {what}"

    def requests(self) -> list[bytes]:
        """What each connection brought, once every connection the proxy opened has ended."""
        self._wait(lambda: self._ended >= self._opened, "saw the end of every connection")
        with self._cond:
            return [bytes(s) for s in self._streams]

    def everything(self) -> bytes:
        return b"".join(self.requests())

    def wait_for(self, data: bytes) -> None:
        """Until the origin has received `data` (on any connection)."""
        self._wait(lambda: any(data in s for s in self._streams), f"received {data!r}")

    def close(self) -> None:
        self._sock.close()


class ToOrigin(EgressProxy):
    """The real proxy; only where a checked host's connection goes is the test's."""

    origin: Origin

    async def _connect(self, ep, rec):
        decision = decide_host(rec.host, ep.rules)
        if not decision.allowed:
            raise ProxyRefusal(403, decision.rule, decision.reason)
        rec.rule, rec.address = decision.rule, "origin"
        self.origin.opening()  # before any byte can reach it: the test waits for its end
        reader, writer = await asyncio.open_unix_connection(str(self.origin.path))
        ep.transports.add(writer.transport)
        return reader, writer


class Harness:
    def __init__(self, tmp: Path):
        self.origin = Origin(tmp / "origin.sock")
        self.proxy = ToOrigin(socket_dir=tmp / "egress", host_overrides={}, system_dns=False)
        self.proxy.origin = self.origin
        self.loop_errors: list[dict] = []
        self.proxy._loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(ctx))
        self.proxy.start()
        rules = EgressRules(("allowed.test", "*.allowed.test"), True)
        self.ep = self.proxy.open_endpoint("sbx-test", rules, uid=0, gid=0)

    def send(self, data: bytes, *, pause_after: bytes = b"", then: tuple[tuple[bytes, bytes], ...] = (),
             timeout_s: float = 10.0) -> bytes:
        """One connection: `data` (then, once answered, `pause_after`, and each `(seen,
        piece)` of `then` once the origin has received `seen`, so that the proxy has read
        what came before apart from it), half-closed; everything the proxy answered until
        it closed."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        s.connect(str(self.ep.socket_path))
        out = b""
        try:
            s.sendall(data)
            if pause_after:
                # A tunnel: wait for its answer, so what follows is the tunnel's.
                while b"\r\n\r\n" not in out and (chunk := s.recv(65536)):
                    out += chunk
                s.sendall(pause_after)
            for seen, piece in then:
                self.origin.wait_for(seen)
                s.sendall(piece)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        finally:
            s.close()
        return out

    def records(self):
        records, dropped, _ = self.proxy.take_records(self.ep)
        return records, dropped

    def close(self) -> None:
        self.proxy.close_endpoint(self.ep)
        self.proxy.stop()
        self.origin.close()


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def status_line(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode("iso-8859-1")


def as_origin_reads(stream: bytes) -> list[tuple[str, str, bytes]]:
    """(method, target, body) of each request in what an origin received, read by a
    strict parser (h11), which must find the stream to end exactly after the last one:
    two chunkings of one body compare equal."""
    out, rest = [], stream
    while rest:
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(rest)
        req, body = conn.next_event(), b""
        assert isinstance(req, h11.Request), (req, rest[:80])
        while isinstance(event := conn.next_event(), h11.Data):
            body += event.data
        assert isinstance(event, h11.EndOfMessage), (event, rest[:80])
        out.append((req.method.decode(), req.target.decode(), body))
        rest = conn.trailing_data[0]
    return out


# ------------------------------------------------------------------ plain proxy requests


SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n"


@pytest.mark.parametrize("framing", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked",
    b"Transfer-Encoding: chunked\r\nContent-Length: 5",
    b"Content-Length: 0\r\nTransfer-Encoding: chunked",
])
def test_content_length_and_transfer_encoding_together_are_refused_before_anything_is_sent(h, framing):
    answer = h.send(b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n" + framing + b"\r\n\r\n"
                    b"0\r\n\r\n" + SMUGGLED)
    assert status_line(answer) == "HTTP/1.1 400 Bad Request"
    assert h.origin.everything() == b""
    [rec] = h.records()[0]
    assert (rec.host, rec.decision, rec.rule, rec.status) == ("allowed.test", "denied", "bad-request", 400)
    assert "both Content-Length and Transfer-Encoding" in rec.reason


@pytest.mark.parametrize("coding", [b"identity", b"xchunked", b"chunked, identity", b"gzip, chunked", b"chunked ;x",
                                    b"Chunked\r\nTransfer-Encoding: chunked", b""])
def test_a_transfer_coding_other_than_chunked_is_refused(h, coding):
    answer = h.send(b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: " + coding
                    + b"\r\n\r\n0\r\n\r\n" + SMUGGLED)
    assert status_line(answer) == "HTTP/1.1 400 Bad Request"
    assert h.origin.everything() == b""
    [rec] = h.records()[0]
    assert (rec.host, rec.decision, rec.rule) == ("allowed.test", "denied", "bad-request")
    assert "Transfer-Encoding" in rec.reason


def test_a_chunked_body_is_read_to_its_end_and_what_follows_never_reaches_the_origin(h):
    answer = h.send(b"POST http://allowed.test/up HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"5;name=value\r\nhello\r\n000\r\nX-Trailer: t\r\n\r\n" + SMUGGLED)
    assert answer == ANSWER
    # Re-serialized: the chunk extension and the trailer are gone, and nothing follows the last chunk.
    assert h.origin.requests() == [b"POST /up HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n"
                                 b"Connection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"]
    [rec] = h.records()[0]
    assert (rec.decision, rec.status) == ("allowed", 200)
    assert f"{len(SMUGGLED)} bytes after the end of the request were not forwarded" in rec.error


def test_a_chunked_body_split_anywhere_is_framed_the_same(h):
    body = b"4\r\nwiki\r\n5\r\npedia\r\n0\r\n\r\n"
    head = b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(h.ep.socket_path))
    for i in range(0, len(head + body + SMUGGLED), 3):
        s.sendall((head + body + SMUGGLED)[i:i + 3])
    s.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    s.close()
    assert answer == ANSWER
    # The proxy streams: how the body is re-chunked depends on its reads, the body never.
    assert as_origin_reads(h.origin.everything()) == [("POST", "/", b"wikipedia")]


def test_a_malformed_chunk_cuts_the_upstream_connection(h):
    answer = h.send(b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"5\r\nhelloXX" + SMUGGLED)
    [rec] = h.records()[0]
    assert rec.rule == "bad-request" and "malformed request body" in rec.reason
    # The chunk before the malformed one went (as it would have in a read of its own), then the end.
    assert h.origin.everything() == (b"POST / HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n"
                                     b"Connection: close\r\n\r\n5\r\nhello\r\n")
    assert status_line(answer) in ("HTTP/1.1 400 Bad Request", "")


def test_a_pipelined_second_request_is_dropped_and_counted(h):
    first = b"POST http://allowed.test/a HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 3\r\n\r\nabc"
    answer = h.send(first + SMUGGLED)
    assert answer == ANSWER
    assert h.origin.requests() == [b"POST /a HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 3\r\n"
                                 b"Connection: close\r\n\r\nabc"]
    [rec] = h.records()[0]
    assert f"{len(SMUGGLED)} bytes after the end of the request were not forwarded" in rec.error


def test_a_get_without_a_body_forwards_nothing_after_its_head(h):
    answer = h.send(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n" + SMUGGLED)
    assert answer == ANSWER
    assert h.origin.requests() == [b"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"]


@pytest.mark.parametrize("folded", [b"X-A: 1\r\n Host: other.test", b"X-A: 1\r\n\tx", b"Host: allowed.test\r\n  other"])
def test_obsolete_line_folding_is_refused(h, folded):
    answer = h.send(b"GET http://allowed.test/ HTTP/1.1\r\n" + folded + b"\r\n\r\n")
    assert status_line(answer) == "HTTP/1.1 400 Bad Request"
    assert h.origin.everything() == b""
    [rec] = h.records()[0]
    assert rec.host == "allowed.test" and "obsolete line folding" in rec.reason


# ------------------------------------------------------------------ inside a CONNECT tunnel


def tunnel(h: Harness, inside: bytes, target: bytes = b"allowed.test:80",
           then: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    return h.send(b"CONNECT " + target + b" HTTP/1.1\r\nHost: " + target + b"\r\n\r\n", pause_after=inside,
                  then=then)


@pytest.mark.parametrize("inside", [
    b" GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",  # a leading space
    b"GET\t/ HTTP/1.1\r\nHost: other.test\r\n\r\n",  # a tab after the method
    b"GET /\tHTTP/1.1\r\nHost: other.test\r\n\r\n",
    b"GET / HTTP/1.1\nHost: other.test\n\n",  # bare LFs
    b"GET / HTTP/1.1\r\nHost: allowed.test\r\n Host: other.test\r\n\r\n",  # folded
    b"GET / HTTP/1.1\r\nHost : other.test\r\n\r\n",
    b"GET / HTTP/2.0\r\nHost: other.test\r\n\r\n",
    b"GET http://other.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: other.test\r\n\r\n",
    b"\x00\x01\x02 GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.6\r\nGET / HTTP/1.1\r\nHost: other.test\r\n\r\n",  # no banner on port 80
])
def test_a_head_the_proxy_cannot_read_inside_a_tunnel_closes_it(h, inside):
    answer = tunnel(h, inside)
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert h.origin.everything() == b""
    [rec] = h.records()[0]
    assert rec.decision == "denied" and rec.rule in ("unreadable-first-bytes", "host-mismatch"), rec
    assert rec.bytes_up == 0


def test_a_21_letter_method_is_parsed_and_its_host_checked(h):
    method = b"A" * 21
    tunnel(h, method + b" / HTTP/1.1\r\nHost: other.test\r\n\r\n")
    assert h.origin.everything() == b""
    assert h.records()[0][0].rule == "host-mismatch"
    tunnel(h, method + b" / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert h.origin.everything() == method + b" / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"


def test_a_host_change_inside_a_plain_http_tunnel_closes_it(h):
    first = b"GET /one HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    answer = tunnel(h, first, then=((first, SMUGGLED + b"GET /three HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),))
    assert answer.startswith(b"HTTP/1.1 200 Connection established\r\n\r\n")
    assert h.origin.everything() == first
    [rec] = h.records()[0]
    assert (rec.decision, rec.rule) == ("denied", "host-mismatch")
    assert "'other.test' disagrees with the CONNECT target allowed.test" in rec.reason
    assert rec.bytes_up == len(first)


def test_a_good_request_read_with_a_bad_one_goes_alone(h):
    # As if each had come in a read of its own: the checked one goes, nothing from the refused one on.
    first = b"GET /one HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    tunnel(h, first + SMUGGLED + first)
    assert h.origin.everything() == first
    [rec] = h.records()[0]
    assert (rec.rule, rec.bytes_up) == ("host-mismatch", len(first))


@pytest.mark.parametrize("split", [False, True])
def test_a_second_request_smuggled_in_a_tunnel_body_is_checked_too(h, split):
    # The first request's body ends where its framing says: what follows is a request, checked.
    first = b"POST /one HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    cut = first.index(b"\r\n\r\n") + 9  # inside the body
    if split:  # the rest once the proxy has read (and forwarded, re-chunked) the body's start
        tunnel(h, first[:cut], then=((first[:cut - 5] + b"2\r\nab\r\n", first[cut:] + SMUGGLED),))
    else:
        tunnel(h, first + SMUGGLED)
    # However it was read, the first request whole and nothing of the second.
    assert as_origin_reads(h.origin.everything()) == [("POST", "/one", b"abc")]
    assert h.records()[0][0].rule == "host-mismatch"


@pytest.mark.parametrize("framing", [b"Transfer-Encoding: identity", b"Content-Length: 3\r\nTransfer-Encoding: chunked"])
def test_bad_framing_inside_a_tunnel_closes_it(h, framing):
    tunnel(h, b"POST / HTTP/1.1\r\nHost: allowed.test\r\n" + framing + b"\r\n\r\nabc" + SMUGGLED)
    assert h.origin.everything() == b""
    assert h.records()[0][0].rule == "unreadable-first-bytes"


def test_pipelined_requests_to_the_tunnels_own_host_all_pass(h):
    reqs = [b"GET /%d HTTP/1.1\r\nHost: allowed.test\r\n\r\n" % i for i in range(3)]
    reqs.append(b"POST /p HTTP/1.1\r\nHost: allowed.test:80\r\nContent-Length: 4\r\n\r\nbody")
    tunnel(h, b"".join(reqs))
    assert h.origin.everything() == b"".join(reqs)
    [rec] = h.records()[0]
    assert (rec.decision, rec.rule, rec.reason) == ("allowed", "allowed.test", "")


def test_an_ssh_banner_is_relayed_on_port_22_only(h):
    tunnel(h, b"SSH-2.0-OpenSSH_9.6\r\n", b"allowed.test:22")
    assert h.origin.everything() == b"SSH-2.0-OpenSSH_9.6\r\n"


# ------------------------------------------------------------------ what is checked is what goes


GOOD = b"GET /g HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
CHUNKED = b"POST /c HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"


def tunnel_forwards(stream: bytes, cut: int) -> bytes:
    """What a tunnel to allowed.test:80 lets through of `stream` read in two pieces."""
    t, out = TunnelRequests("allowed.test", 80), b""
    try:
        for piece in (stream[:cut], stream[cut:]):
            out += t.feed(piece)
    except ProxyRefusal as refusal:
        assert refusal.rule == "host-mismatch"
        out += refusal.forward
    return out


def test_a_tunnel_forwards_the_same_however_its_stream_is_cut():
    stream = GOOD + CHUNKED + SMUGGLED + GOOD
    for cut in range(1, len(stream) + 1):
        assert as_origin_reads(tunnel_forwards(stream, cut)) == [("GET", "/g", b""), ("POST", "/c", b"abc")], cut


def test_a_proxy_requests_body_is_framed_the_same_however_it_is_cut():
    head = b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked"
    body = b"4;x=1\r\nwiki\r\n5\r\npedia\r\n0\r\nT: 1\r\n\r\n" + SMUGGLED
    for cut in range(len(body) + 1):
        framer = BodyFramer(parse_request(head))
        out = framer.feed(body[:cut]) + framer.feed(body[cut:])
        assert as_origin_reads(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + out) == [
            ("POST", "/", b"wikipedia")], cut
        assert (framer.done, framer.extra) == (True, len(SMUGGLED)), cut


@pytest.mark.parametrize("rest", [b"0\r\n\r\n", b"\r\n\r\n", b"\r\n", b""])
def test_a_request_after_a_chunked_body_cut_at_its_last_chunk_is_checked(h, rest):
    cut = len(CHUNKED) - len(rest)
    seen = TunnelRequests("allowed.test", 80).feed(CHUNKED[:cut])  # what the first read forwards
    tunnel(h, CHUNKED[:cut], then=((seen, CHUNKED[cut:] + SMUGGLED),))
    assert as_origin_reads(h.origin.everything()) == [("POST", "/c", b"abc")]
    assert h.records()[0][0].rule == "host-mismatch"


def test_a_proxy_request_after_a_chunked_body_cut_at_its_last_chunk_is_dropped(h):
    head = b"POST http://allowed.test/c HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert h.send(head + b"3\r\nabc\r\n0\r\n", then=((b"3\r\nabc\r\n", b"\r\n" + SMUGGLED),)) == ANSWER
    assert as_origin_reads(h.origin.everything()) == [("POST", "/c", b"abc")]
    assert f"{len(SMUGGLED)} bytes after the end" in h.records()[0][0].error


@pytest.mark.parametrize("target, host, rule", [
    (b"http://allowed.test/", b"other.test", "host-mismatch"),
    (b"http://allowed.test/", b"allowed.test.other.test", "host-mismatch"),
    (b"http://allowed.test/", b"allowed.test:8080", "host-mismatch"),
    (b"http://allowed.test/", b"other.test@allowed.test", "host-mismatch"),
    (b"http://allowed.test/", b"allowed.test, other.test", "host-mismatch"),
    (b"http://allowed.test@other.test/", b"other.test", "not-allowlisted"),  # the host is after the userinfo
    (b"http://allowed.test\\@other.test/", b"other.test", "not-allowlisted"),
])
def test_an_absolute_url_and_a_host_naming_another_host_are_refused(h, target, host, rule):
    answer = h.send(b"GET " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
    assert status_line(answer) == "HTTP/1.1 403 Forbidden"
    assert h.origin.everything() == b""
    assert h.records()[0][0].rule == rule


@pytest.mark.parametrize("target, host, forwarded_host", [
    (b"http://other.test@allowed.test/x", b"", b"allowed.test"),
    (b"http://other.test\\@allowed.test/x", b"", b"allowed.test"),
    (b"http://ALLOWED.test.:80/x", b"Allowed.Test", b"Allowed.Test"),
    (b"http://allowed.test/x", b"allowed.test.:80", b"allowed.test.:80"),
])
def test_what_reaches_the_origin_names_only_the_checked_host(h, target, host, forwarded_host):
    host_line = b"Host: " + host + b"\r\n" if host else b""
    assert h.send(b"GET " + target + b" HTTP/1.1\r\n" + host_line + b"\r\n") == ANSWER
    assert h.origin.requests() == [b"GET /x HTTP/1.1\r\nHost: " + forwarded_host + b"\r\nConnection: close\r\n\r\n"]


def test_http_1_0_keep_alive_is_still_one_request_per_proxied_connection(h):
    answer = h.send(b"GET http://allowed.test/a HTTP/1.0\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\n"
                    + SMUGGLED)
    assert answer == ANSWER
    assert h.origin.requests() == [b"GET /a HTTP/1.0\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"]


def test_http_1_0_keep_alive_in_a_tunnel_has_its_next_request_checked(h):
    first = b"POST /a HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\nabc"
    tunnel(h, first + SMUGGLED)
    assert h.origin.everything() == first
    assert h.records()[0][0].rule == "host-mismatch"


def test_expect_100_continue_goes_with_its_head_and_its_body_is_framed_by_its_length(h):
    head = (b"POST http://allowed.test/e HTTP/1.1\r\nHost: allowed.test\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(SMUGGLED))
    # The head reaches the origin before the body is sent (a client waits for its 100 Continue).
    assert h.send(head, then=((b"Expect: 100-continue", SMUGGLED + SMUGGLED),)) == ANSWER
    assert as_origin_reads(h.origin.everything()) == [("POST", "/e", SMUGGLED)]
    assert f"{len(SMUGGLED)} bytes after the end" in h.records()[0][0].error


def test_expect_100_continue_in_a_tunnel_frames_its_body_then_checks_the_next_request(h):
    first = b"POST /e HTTP/1.1\r\nHost: allowed.test\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(
        SMUGGLED)
    tunnel(h, first, then=((first, SMUGGLED + SMUGGLED),))
    assert as_origin_reads(h.origin.everything()) == [("POST", "/e", SMUGGLED)]
    assert h.records()[0][0].rule == "host-mismatch"


@pytest.mark.parametrize("upgrade", [b"Upgrade: websocket", b"Connection: Upgrade\r\nUpgrade: websocket",
                                     b"Connection: keep-alive, upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                     b"HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA"])
def test_an_upgrade_never_reaches_the_origin(h, upgrade):
    answer = h.send(b"GET http://allowed.test/ws HTTP/1.1\r\nHost: allowed.test\r\n" + upgrade + b"\r\n\r\n"
                    b"\x81\x05hello" + SMUGGLED)
    assert answer == ANSWER
    assert h.origin.requests() == [b"GET /ws HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"]


def test_an_upgrade_inside_a_tunnel_ends_it_before_the_upgraded_bytes(h):
    tunnel(h, GOOD + b"GET /ws HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
           b"\x81\x05hello" + SMUGGLED)
    assert h.origin.everything() == GOOD
    assert h.records()[0][0].rule == "unreadable-first-bytes"


@pytest.mark.parametrize("target, status, rule", [
    (b"user@allowed.test:80", 403, "bad-host"),
    (b"other.test@allowed.test:80", 403, "bad-host"),
    (b"allowed.test:80@other.test:80", 400, "bad-request"),
    (b"allowed.test.other.test.:80", 403, "not-allowlisted"),
])
def test_a_connect_target_with_userinfo_is_refused(h, target, status, rule):
    answer = h.send(b"CONNECT " + target + b" HTTP/1.1\r\n\r\n")
    assert status_line(answer).split(" ")[1] == str(status)
    assert h.origin.everything() == b""
    assert h.records()[0][0].rule == rule


@pytest.mark.parametrize("target", [b"allowed.test.:80", b"ALLOWED.test..:80"])
def test_a_connect_target_with_a_trailing_dot_is_the_host_it_names(h, target):
    inside = b"GET / HTTP/1.1\r\nHost: allowed.test.\r\n\r\n"
    tunnel(h, inside + b"GET / HTTP/1.1\r\nHost: other.test.\r\n\r\n", target=target)
    assert h.origin.everything() == inside
    [rec] = h.records()[0]
    assert (rec.host, rec.rule) == ("allowed.test", "host-mismatch")


# ------------------------------------------------------------------ inputs that raised


@pytest.mark.parametrize("request_line, host", [
    (b"GET http://[allowed.test]/ HTTP/1.1", "allowed.test"),
    (b"GET http://[allowed.test HTTP/1.1", "allowed.test"),
    (b"GET http://[::1 HTTP/1.1", "::1"),
    (b"GET http://allowed.test:99999/ HTTP/1.1", "allowed.test"),
    (b"GET http://:80/ HTTP/1.1", ""),
    (b"GET http://a@/ HTTP/1.1", ""),
])
def test_a_url_that_cannot_be_read_is_answered_400_and_recorded(h, request_line, host):
    answer = h.send(request_line + b"\r\nHost: allowed.test\r\n\r\n")
    assert status_line(answer) == "HTTP/1.1 400 Bad Request"
    [rec] = h.records()[0]
    assert (rec.host, rec.decision, rec.status, rec.rule) == (host, "denied", 400, "bad-request")
    assert not h.loop_errors and not h.ep.unexpected_errors


@pytest.mark.parametrize("target, host", [
    (b"allowed.test", "allowed.test"),
    (b"Allowed.Test:0", "allowed.test"),
    (b"allowed.test:http", "allowed.test"),
    (b"[allowed.test]:443", "allowed.test"),
    (b"[::1]:99999", "::1"),
    (b"x" * 2000 + b":443", "x" * 255),  # bounded on the record
])
def test_a_malformed_connect_keeps_the_host_it_named(h, target, host):
    answer = h.send(b"CONNECT " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_line(answer) == "HTTP/1.1 400 Bad Request"
    [rec] = h.records()[0]
    assert (rec.protocol, rec.method, rec.host, rec.status) == ("connect", "CONNECT", host, 400)


INTERESTING = [b" ", b"\t", b"\r", b"\n", b"\r\n", b"\0", b":", b"[", b"]", b"@", b"%", b"\x80", b"\xff", b"/",
               b"?", b"#", b"0", b"9", b"-", b";", b",", b"\r\n\r\n", b"chunked", b"Content-Length: 1\r\n",
               b"Transfer-Encoding: chunked\r\n", b"[::1]", b"HTTP/1.1", b"\x16\x03\x01"]
SEEDS = [
    b"GET http://allowed.test/x?y HTTP/1.1\r\nHost: allowed.test\r\nAccept: */*\r\n\r\n",
    b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 3\r\n\r\nabc",
    b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n",
    b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n",
    b"GET http://[2606:4700::1]:80/ HTTP/1.0\r\n\r\n",
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(1, len(data))  # never the first byte: 0x05 would be SOCKS5
        kind = rng.randrange(3)
        if kind == 0:
            data = data[:at] + rng.choice(INTERESTING) + data[at:]
        elif kind == 1:
            data = data[:at] + data[at + rng.randint(1, 8):]
        else:
            data = data[:at] + data[at - 1:at] * rng.randint(2, 30) + data[at:]
    return data


def test_fuzzed_requests_always_get_an_answer_and_a_record(h):
    rng = random.Random(20)
    inputs = [mutate(rng, rng.choice(SEEDS)) for _ in range(300)]
    inputs = [d for d in inputs if d[:1] != b"\x05"]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda d: h.send(d, timeout_s=20), inputs))
    unanswered = [d for d, a in zip(inputs, answers) if not a.startswith(b"HTTP/1.1 ")]
    assert not unanswered, unanswered[:5]
    records, dropped = h.records()
    assert len(records) + dropped == len(inputs)
    assert not h.loop_errors, h.loop_errors[:3]
    assert not h.ep.unexpected_errors
