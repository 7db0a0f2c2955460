"""sandboxd.egress.proxy, the pure parts: request heads, authorities, TLS ClientHello SNI, the
origin-form rewrite, response status lines, refusals and records; and the CONNECT
tunnel's first-bytes check, fed from an in-memory StreamReader. No sockets: the
ClientHellos are real ones, produced by the ssl module into memory BIOs."""

from __future__ import annotations

import asyncio
import re
import ssl
from ipaddress import ip_address

import pytest

from sandboxd.policy.egress_rules import EgressRules, decide_address, decide_host, parse_ip
from sandboxd.egress.proxy import (
    HOP_BY_HOP,
    MAX_HELLO_RECORD,
    ConnectionRecord,
    IncompleteHello,
    ProxyRefusal,
    looks_like_tls,
    parse_head,
    refusal_response,
    response_status,
    split_host_port,
    summarize_external_calls,
    tls_client_hello_sni,
)
from sandboxd.egress.http import TunnelRequests, origin_form_request, parse_proxy_target, parse_request
from sandboxd.egress.tunnel import check_first_bytes as check_tunnel_first_bytes


def refusal(fn, *args) -> ProxyRefusal:
    with pytest.raises(ProxyRefusal) as info:
        fn(*args)
    return info.value


# ------------------------------------------------------------------ ProxyRefusal


def test_proxy_refusal_fields():
    exc = ProxyRefusal(403, "not-allowlisted", "host a.test is not in allowDomains")
    assert isinstance(exc, Exception)
    assert (exc.status, exc.rule, exc.reason, exc.decision) == (
        403, "not-allowlisted", "host a.test is not in allowDomains", "denied")
    assert str(exc) == "host a.test is not in allowDomains"
    allowed = ProxyRefusal(502, "*.a.test", "cannot connect", decision="allowed")
    assert allowed.decision == "allowed"
    with pytest.raises(ProxyRefusal, match="cannot connect"):
        raise allowed


# ------------------------------------------------------------------ parse_head


def test_parse_head_full_request():
    head = (b"GET http://a.test/x?y=1 HTTP/1.1\r\nHost: a.test\r\nUser-Agent: curl/8.5.0\r\n"
            b"X-Empty:\r\nX-Spaces:   padded value  \r\nX-Colon: a:b:c")
    assert parse_head(head) == ("GET", "http://a.test/x?y=1", "HTTP/1.1", [
        ("Host", "a.test"), ("User-Agent", "curl/8.5.0"), ("X-Empty", ""), ("X-Spaces", "padded value"),
        ("X-Colon", "a:b:c"),
    ])


@pytest.mark.parametrize("head", [
    b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nhost: dup.test",  # two Hosts
    b"GET / HTTP/1.1\r\nAccept: */*",  # HTTP/1.1 without Host (origin-form)
    b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n",  # an empty line inside the head
    b"GET http://a.test/ HTTP/1.1\r\n\r\nA: b",
    b"GET http://a.test/ HTTP/1.1\r\nX-A: a\x01b",  # a control character in a value
    b"GET http://a.test/ HTTP/1.1\r\nContent-Length: 1, 2",
    b"GET http://a.test/ HTTP/1.1\r\nContent-Length: -1",
    b"GET http://a.test/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2",
    b"GET http://a.test/ HTTP/1.1\r\nContent-Length: 99999999999999999999",
    b"POST http://a.test/ HTTP/1.0\r\nTransfer-Encoding: chunked",
    b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3",
    b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: identity",
    b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
])
def test_parse_head_refuses_what_another_parser_could_read_differently(head):
    exc = refusal(parse_head, head)
    assert (exc.status, exc.rule, exc.decision) == (400, "bad-request", "denied")


def test_parse_request_framing():
    chunked = parse_request(b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: Chunked")
    assert (chunked.chunked, chunked.length) == (True, 0)
    sized = parse_request(b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 007\r\nContent-Length: 007")
    assert (sized.chunked, sized.length) == (False, 7)
    assert parse_request(b"GET http://a.test/ HTTP/1.1").headers == []  # Host is lent to h11, not kept


@pytest.mark.parametrize("head, expected", [
    (b"CONNECT a.test:443 HTTP/1.1", ("CONNECT", "a.test:443", "HTTP/1.1", [])),
    (b"CONNECT [2606:4700::1]:443 HTTP/1.0\r\nHost: [2606:4700::1]:443",
     ("CONNECT", "[2606:4700::1]:443", "HTTP/1.0", [("Host", "[2606:4700::1]:443")])),
    # The head is ISO-8859-1: every byte decodes.
    (b"GET http://a.test/ HTTP/1.1\r\nX-Name: caf\xe9", ("GET", "http://a.test/", "HTTP/1.1", [("X-Name", "caf\xe9")])),
    (b"POST http://a.test/ HTTP/1.0", ("POST", "http://a.test/", "HTTP/1.0", [])),
    (b"A" * 21 + b" http://a.test/ HTTP/1.1", ("A" * 21, "http://a.test/", "HTTP/1.1", [])),
])
def test_parse_head_ok(head, expected):
    assert parse_head(head) == expected


@pytest.mark.parametrize("head", [
    b"",
    b"GET",
    b"GET http://a.test/",
    b"GET http://a.test/ HTTP/2",
    b"GET http://a.test/ HTTP/2.0",
    b"GET http://a.test/ HTTP/1.9",
    b" GET http://a.test/ HTTP/1.1",
    b"GET\thttp://a.test/ HTTP/1.1",
    b"G(T http://a.test/ HTTP/1.1",
    b"GET http://a.test/\xe9 HTTP/1.1",
    b"GET http://a.test/ http/1.1",
    b"GET http://a.test/ HTTP/1.1 extra",
    b"GET  http://a.test/ HTTP/1.1",  # two spaces: four parts
    b"GET http://a.test/ HTTP/1.1 ",
    b"GET http://a.test/\tHTTP/1.1",
    b"\r\nGET http://a.test/ HTTP/1.1",  # a leading empty line
    b"\x16\x03\x01\x02\x01\x01\x01\x01\xfc\x03\x03",  # TLS bytes, no CR, LF or NUL among them
])
def test_parse_head_bad_request_line(head):
    exc = refusal(parse_head, head)
    assert (exc.status, exc.rule, exc.decision) == (400, "bad-request", "denied")
    assert exc.reason == "not an HTTP/1.x request line"


@pytest.mark.parametrize("head", [
    b"GET http://a.test/ HTTP/1.1\nHost: a.test",  # a bare LF ends nothing: refused, not read as one line
    b"GET http://a.test/ HTTP/1.1\rHost: a.test",
    b"GET http://a.test/\n HTTP/1.1",
    b"GET http://a.test/\x00 HTTP/1.1",
    b"GET http://a.test/ HTTP/1.1\x00",
    b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nX-A: 1\nHost: evil.test",
    b"GET http://a.test/ HTTP/1.1\r\nX-A: 1\rHost: evil.test\r\nHost: a.test",
    b"GET http://a.test/ HTTP/1.1\r\nX-A: a\x00b",
    b"GET http://a.test/ HTTP/1.1\r\nX\nA: b",  # inside a header name
    b"GET http://a.test/ HTTP/1.1\r\nX-A: b\r",  # a CR left over before the head's CRLFCRLF
    b"GET http://a.test/ HTTP/1.1\r\n\nX-A: b",
    b"\nGET http://a.test/ HTTP/1.1",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a ClientHello: NULs in its lengths
])
def test_parse_head_refuses_a_bare_cr_lf_or_nul_anywhere(head):
    exc = refusal(parse_head, head)
    assert (exc.status, exc.rule, exc.decision) == (400, "bad-request", "denied")
    assert exc.reason == "a bare CR, LF or NUL inside the request head"


@pytest.mark.parametrize("line", [
    b"NoColonHere",
    b": no-name",
    b"Host : a.test",  # whitespace before the colon
    b"Host\t: a.test",
    b" Host: a.test",  # obsolete line folding
    b"\tcontinued: value",
    b" continued",
])
def test_parse_head_malformed_header(line):
    exc = refusal(parse_head, b"GET http://a.test/ HTTP/1.1\r\nAccept: */*\r\n" + line)
    assert (exc.status, exc.rule, exc.decision) == (400, "bad-request", "denied")
    if line[:1] in b" \t":
        assert exc.reason.startswith("obsolete line folding")
    else:
        assert exc.reason.startswith("malformed header line ")
    assert repr(line.decode("iso-8859-1")[:40]) in exc.reason


def test_parse_head_malformed_header_reason_is_bounded():
    exc = refusal(parse_head, b"GET http://a.test/ HTTP/1.1\r\n" + b"X" * 5000)
    assert exc.status == 400
    assert len(exc.reason) < 80


@pytest.mark.parametrize("sep", [b"\n", b"\r", b"\x00"])
def test_a_bare_line_break_in_a_header_never_reaches_the_origin(sep):
    # An origin that takes a bare LF (or CR) as a line end would see a second Host the
    # proxy never checked: the head is refused before anything is forwarded.
    head = b"GET http://allowed.test/ HTTP/1.1\r\nX-A: 1" + sep + b"Host: evil.test"
    exc = refusal(parse_head, head)
    assert (exc.status, exc.rule, exc.decision) == (400, "bad-request", "denied")
    assert "bare CR, LF or NUL" in exc.reason
    # The same head with a CRLF there is two ordinary headers.
    crlf = b"GET http://allowed.test/ HTTP/1.1\r\nX-A: 1\r\nHost: evil.test"
    assert parse_head(crlf)[3] == [("X-A", "1"), ("Host", "evil.test")]


# ------------------------------------------------------------------ split_host_port


@pytest.mark.parametrize("authority, default, expected", [
    ("a.test:443", None, ("a.test", 443)),
    ("a.test:80", 443, ("a.test", 80)),
    ("A.Test:8080", None, ("a.test", 8080)),
    ("Example.COM.:443", None, ("example.com", 443)),
    ("a.test", 80, ("a.test", 80)),
    ("a.test:", 80, ("a.test", 80)),  # an empty port is the default
    ("a.test:1", None, ("a.test", 1)),
    ("a.test:65535", None, ("a.test", 65535)),
    ("a.test:00080", None, ("a.test", 80)),
    ("93.184.216.34:443", None, ("93.184.216.34", 443)),
    ("93.184.216.34", 80, ("93.184.216.34", 80)),
    ("[::1]:443", None, ("::1", 443)),
    ("[::1]", 80, ("::1", 80)),
    ("[::1]:", 80, ("::1", 80)),
    ("[2606:4700:0:0::1]:8443", None, ("2606:4700::1", 8443)),
    ("[2606:4700::ABCD]:443", None, ("2606:4700::abcd", 443)),
    ("[::ffff:127.0.0.1]:80", None, ("127.0.0.1", 80)),  # mapped: judged as the IPv4 address
    ("2606:4700::1", 443, ("2606:4700::1", 443)),  # a bare IPv6 literal has no port
    ("::FFFF:93.184.216.34", 80, ("93.184.216.34", 80)),
])
def test_split_host_port(authority, default, expected):
    assert split_host_port(authority, default) == expected


@pytest.mark.parametrize("authority, default, why", [
    ("a.test", None, "names no port"),
    ("a.test:", None, "names no port"),
    ("[::1]", None, "names no port"),
    ("2606:4700::1", None, "names no port"),
    ("a.test:0", None, "bad port"),
    ("a.test:65536", None, "bad port"),
    ("a.test:99999999999999999999", None, "bad port"),
    ("a.test:x", 80, "bad port"),
    ("a.test:-1", None, "bad port"),
    ("a.test:+80", None, "bad port"),
    ("a.test: 80", None, "bad port"),
    ("a.test:80 ", None, "bad port"),
    ("a.test:0x50", None, "bad port"),
    ("[::1]:0", None, "bad port"),
    ("[::1]:http", None, "bad port"),
    ("[::1", 443, "bad authority"),
    ("[::1]443", None, "bad authority"),
    ("[::1]x:443", None, "bad authority"),
])
def test_split_host_port_refusals(authority, default, why):
    exc = refusal(split_host_port, authority, default)
    assert (exc.status, exc.rule, exc.decision) == (400, "bad-request", "denied")
    assert why in exc.reason
    assert repr(authority) in exc.reason


@pytest.mark.parametrize("raw", [b"\xb2", b"\xb3", b"\xb9", b"4\xb2\xb3"])
def test_a_non_ascii_digit_port_is_a_bad_request(raw):
    # ISO-8859-1 superscripts are str.isdigit() but not ASCII digits: a 400, never a
    # ValueError that would end the handler without an answer. (A request line never
    # carries them: its target is visible ASCII.)
    assert refusal(parse_head, b"CONNECT a.test:" + raw + b" HTTP/1.1").reason == "not an HTTP/1.x request line"
    target = "a.test:" + raw.decode("iso-8859-1")
    exc = refusal(split_host_port, target, None)
    assert (exc.status, exc.rule, exc.decision) == (400, "bad-request", "denied")
    assert exc.reason == f"bad port in {target!r}"
    exc = refusal(split_host_port, "[::1]:" + raw.decode("iso-8859-1"), 443)
    assert exc.status == 400 and "bad port" in exc.reason


@pytest.mark.parametrize("port", ["\u0664\u0664\u0663", "\uff14\uff14\uff13", "\u09ea", "8\u0660"])
def test_other_unicode_digit_ports_are_bad_requests(port):
    # Arabic-Indic, fullwidth and Bengali digits: int() would take them, the proxy does not.
    exc = refusal(split_host_port, f"a.test:{port}", 80)
    assert (exc.status, exc.rule) == (400, "bad-request")
    assert "bad port" in exc.reason


# ------------------------------------------------------------------ tls_client_hello_sni


def real_client_hello(server_hostname: str | None, *, max_version: ssl.TLSVersion | None = None) -> bytes:
    """The first flight of a real TLS client, captured from a memory BIO."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if max_version is not None:
        ctx.maximum_version = max_version
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    assert hello[0] == 0x16 and hello[5] == 0x01  # a handshake record holding a ClientHello
    return hello


@pytest.mark.parametrize("name", [
    "allowed.test", "a.b.c.example.com", "Mixed.Case.Test", "x" * 63 + "." + "y" * 63 + ".test",
])
@pytest.mark.parametrize("max_version", [None, ssl.TLSVersion.TLSv1_2])
def test_sni_of_a_real_client_hello(name, max_version):
    assert tls_client_hello_sni(real_client_hello(name, max_version=max_version)) == (True, name)


@pytest.mark.parametrize("server_hostname", [None, "93.184.216.34", "2606:4700::1"])
def test_a_real_client_hello_without_sni(server_hostname):
    # No name, or an IP literal (which clients do not put in SNI).
    assert tls_client_hello_sni(real_client_hello(server_hostname)) == (True, None)


def test_only_the_first_bytes_matter():
    hello = real_client_hello("allowed.test")
    assert tls_client_hello_sni(hello + b"\x17\x03\x03\x00\x05extra") == (True, "allowed.test")


def _sni_span(hello: bytes, name: str) -> tuple[int, int]:
    """Where the server_name extension starts (type, length, list length, name type,
    name length: 9 bytes before the name) and where the name ends."""
    start = hello.index(name.encode())
    assert hello[start - 9:start] == (b"\x00\x00" + (len(name) + 5).to_bytes(2, "big")
                                      + (len(name) + 3).to_bytes(2, "big") + b"\x00"
                                      + len(name).to_bytes(2, "big"))
    return start - 9, start + len(name)


@pytest.mark.parametrize("name", ["allowed.test", "allowed.test.evil.example", None])
@pytest.mark.parametrize("max_version", [None, ssl.TLSVersion.TLSv1_2])
def test_every_cut_of_a_real_hello_is_incomplete(name, max_version):
    # Never a partial name, never "no name": from the first byte on, a hello that is
    # not all there says so, wherever it is cut (before, inside or after the SNI).
    hello = real_client_hello(name, max_version=max_version)
    assert int.from_bytes(hello[3:5], "big") == len(hello) - 5  # one record, all of the first flight
    assert tls_client_hello_sni(hello[:0]) == (False, None)
    for cut in range(1, len(hello)):
        with pytest.raises(IncompleteHello):
            tls_client_hello_sni(hello[:cut])
    assert tls_client_hello_sni(hello) == (True, name)


def test_a_hello_cut_inside_the_name_never_yields_another_name():
    real = "allowed.test.evil.example"
    hello = real_client_hello(real)
    ext_start, name_end = _sni_span(hello, real)
    start = name_end - len(real)
    assert ext_start > 101
    # Right after "allowed.test": the old parser answered "allowed.test" here.
    with pytest.raises(IncompleteHello, match="not all there"):
        tls_client_hello_sni(hello[:start + len("allowed.test")])
    for cut in [5, 6, 9, 10, 43, 44, 76, 100, *range(ext_start - 1, name_end + 1), name_end + 7]:
        with pytest.raises(IncompleteHello):
            tls_client_hello_sni(hello[:cut])
    assert tls_client_hello_sni(hello) == (True, real)


def test_incomplete_hello_is_a_value_error():
    assert issubclass(IncompleteHello, ValueError)
    with pytest.raises(ValueError):
        tls_client_hello_sni(real_client_hello("allowed.test")[:20])


def test_a_short_hello_is_told_apart_from_one_without_sni():
    # A caller that needs the name knows to wait for the rest of the record.
    hello = real_client_hello("allowed.test")
    with pytest.raises(IncompleteHello):
        tls_client_hello_sni(hello[:20])
    assert tls_client_hello_sni(real_client_hello(None)) == (True, None)


@pytest.mark.parametrize("head", [b"\x16\x03", b"\x16\x03\x01", b"\x16\x03\x01\x02", b"\x16\x03\x03\x00"])
def test_a_record_header_cut_short_is_incomplete(head):
    with pytest.raises(IncompleteHello):
        tls_client_hello_sni(head)


def test_a_hello_split_over_two_records_is_refused():
    # Legal TLS, but the name could sit in a record not yet read: fail closed.
    hello = real_client_hello("allowed.test")
    handshake = hello[5:]
    first, second = handshake[:50], handshake[50:]
    split = (b"\x16\x03\x01" + len(first).to_bytes(2, "big") + first
             + b"\x16\x03\x01" + len(second).to_bytes(2, "big") + second)
    with pytest.raises(IncompleteHello, match="does not fit its record"):
        tls_client_hello_sni(split)


@pytest.mark.parametrize("data", [
    b"",
    b"\x16\x02",  # a handshake type byte, but not TLS version 3.x
    b"\x16\x00\x00\x00\x00",
    b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"CONNECT x:443 HTTP/1.1\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.6\r\n",
    b"\x17\x03\x03\x00\x05hello",  # TLS application data
    b"\x15\x03\x03\x00\x02\x02\x28",  # TLS alert
    b"\x16\x02\x00\x00\x05\x01\x00\x00\x01\x00",  # not TLS version 3.x
    b"\x80\x2e\x01\x03\x01",  # an SSLv2-framed hello
    b"\x00" * 64,
])
def test_non_tls_bytes(data):
    assert tls_client_hello_sni(data) == (False, None)


# Hand-built ClientHellos, for the shapes real clients do not produce.

def client_hello(extensions: list[tuple[int, bytes]] | None, *, session_id: bytes = b"",
                 ciphers: bytes = b"\x13\x01\x13\x02", msg_type: int = 0x01) -> bytes:
    body = (b"\x03\x03" + bytes(range(32)) + bytes([len(session_id)]) + session_id
            + len(ciphers).to_bytes(2, "big") + ciphers + b"\x01\x00")
    if extensions is not None:
        ext = b"".join(t.to_bytes(2, "big") + len(d).to_bytes(2, "big") + d for t, d in extensions)
        body += len(ext).to_bytes(2, "big") + ext
    handshake = bytes([msg_type]) + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake


def server_name(*names: tuple[int, bytes]) -> tuple[int, bytes]:
    entries = b"".join(bytes([kind]) + len(n).to_bytes(2, "big") + n for kind, n in names)
    return 0, len(entries).to_bytes(2, "big") + entries


SUPPORTED_GROUPS = (10, b"\x00\x04\x00\x1d\x00\x17")
RENEGOTIATION_INFO = (0xFF01, b"\x00")


@pytest.mark.parametrize("hello, expected", [
    (client_hello([server_name((0, b"allowed.test"))]), (True, "allowed.test")),
    (client_hello([SUPPORTED_GROUPS, RENEGOTIATION_INFO, server_name((0, b"late.test"))]), (True, "late.test")),
    (client_hello([server_name((0, b"sid.test"))], session_id=bytes(32), ciphers=bytes(200)), (True, "sid.test")),
    (client_hello([SUPPORTED_GROUPS]), (True, None)),
    (client_hello([]), (True, None)),
    (client_hello(None), (True, None)),  # no extensions block at all
    (client_hello([server_name((1, b"not-a-host-name"))]), (True, None)),  # name type other than host_name
    (client_hello([(0, b"\x00\x00")]), (True, None)),  # an empty server_name extension
    (client_hello([server_name((0, b"x.test"))], msg_type=0x02), (True, None)),  # ServerHello
    (b"\x16\x03\x01\x00\x04\x02\x00\x00\x00", (True, None)),  # a bare handshake header, not a ClientHello
    # Two names: the first host_name is the one.
    (client_hello([server_name((0, b"first.test"), (0, b"second.test"))]), (True, "first.test")),
    (client_hello([server_name((1, b"other"), (0, b"named.test"))]), (True, "named.test")),
])
def test_hand_built_client_hellos(hello, expected):
    assert tls_client_hello_sni(hello) == expected


def tls_record(handshake_payload: bytes, msg_type: int = 0x01) -> bytes:
    """One complete handshake record around a handshake message of `handshake_payload`."""
    message = bytes([msg_type]) + len(handshake_payload).to_bytes(3, "big") + handshake_payload
    return b"\x16\x03\x01" + len(message).to_bytes(2, "big") + message


VERSION_RANDOM = b"\x03\x03" + bytes(32)


def _with_handshake_length(hello: bytes, delta: int) -> bytes:
    length = int.from_bytes(hello[6:9], "big") + delta
    return hello[:6] + length.to_bytes(3, "big") + hello[9:]


def _with_record_tail(hello: bytes, tail: bytes) -> bytes:
    """The hello with `tail` appended inside its record (record and handshake lengths fixed up)."""
    body = hello[5:] + tail
    body = body[:1] + (len(body) - 4).to_bytes(3, "big") + body[4:]
    return hello[:3] + len(body).to_bytes(2, "big") + body


GOOD = client_hello([SUPPORTED_GROUPS, server_name((0, b"allowed.test"))])
_SNI_AT = GOOD.index(b"allowed.test")


@pytest.mark.parametrize("hello", [
    pytest.param(b"\x16\x03\x01\x00\x00", id="empty record"),
    pytest.param(b"\x16\x03\x01\x00\x03\x01\x00\x00", id="handshake header cut"),
    pytest.param(_with_handshake_length(GOOD, 1), id="handshake longer than its record"),
    pytest.param(tls_record(b"\x03\x03"), id="no random"),
    pytest.param(tls_record(VERSION_RANDOM), id="no session id length"),
    pytest.param(tls_record(VERSION_RANDOM + b"\x20" + bytes(5)), id="session id past the record"),
    pytest.param(tls_record(VERSION_RANDOM + b"\x00\x00\x04\x13\x01"), id="cipher suites past the record"),
    pytest.param(tls_record(VERSION_RANDOM + b"\x00\x00\x02\x13\x01"), id="no compression methods"),
    pytest.param(tls_record(VERSION_RANDOM + b"\x00\x00\x02\x13\x01\x02\x00"), id="compression past the record"),
    # Lengths that run past the record, inside a record that is all there.
    pytest.param(GOOD[:5 + 4 + 34] + b"\xff" + GOOD[5 + 4 + 35:], id="session id length too long"),
    pytest.param(GOOD[:_SNI_AT - 2] + b"\x00\x0d" + GOOD[_SNI_AT:], id="name longer than its extension"),
    pytest.param(GOOD[:_SNI_AT - 7] + b"\xff\xff" + GOOD[_SNI_AT - 5:], id="extension longer than the block"),
    pytest.param(_with_record_tail(client_hello(None), b"\x00\x08\x00\x00"), id="extensions block cut"),
    pytest.param(_with_record_tail(client_hello(None), b"\x00\x02\x00\x00"), id="extension header cut"),
])
def test_malformed_hellos_are_incomplete_never_named(hello):
    assert looks_like_tls(hello)
    assert len(hello) == 5 + int.from_bytes(hello[3:5], "big")  # the record is all there
    with pytest.raises(IncompleteHello, match="does not fit"):
        tls_client_hello_sni(hello)


def test_the_hand_built_helpers_make_well_formed_hellos():
    # The malformed cases above differ from these in the one length they break.
    assert tls_client_hello_sni(GOOD) == (True, "allowed.test")
    assert tls_client_hello_sni(tls_record(VERSION_RANDOM + b"\x00\x00\x02\x13\x01\x01\x00")) == (True, None)
    assert tls_client_hello_sni(_with_record_tail(client_hello(None), b"\x00\x00")) == (True, None)


@pytest.mark.parametrize("name", [b"allowed.test", b"allowed.test.evil.example"])
def test_every_cut_of_a_hand_built_hello_is_incomplete(name):
    hello = client_hello([SUPPORTED_GROUPS, RENEGOTIATION_INFO, server_name((0, name))], session_id=bytes(32))
    for cut in range(2, len(hello)):
        with pytest.raises(IncompleteHello):
            tls_client_hello_sni(hello[:cut])
    assert tls_client_hello_sni(hello) == (True, name.decode())


def test_max_hello_record_is_one_full_tls_record():
    assert MAX_HELLO_RECORD == 5 + 2 ** 14
    # A hello that fills a record to the limit (a padding extension before the SNI) is read whole.
    bare = client_hello([(21, b""), server_name((0, b"big.test"))])
    hello = client_hello([(21, bytes(MAX_HELLO_RECORD - len(bare))), server_name((0, b"big.test"))])
    assert len(hello) == MAX_HELLO_RECORD
    assert tls_client_hello_sni(hello) == (True, "big.test")
    with pytest.raises(IncompleteHello):
        tls_client_hello_sni(hello[:-1])


# ------------------------------------------------------------------ looks_like_tls, looks_like_http


@pytest.mark.parametrize("data, expected", [
    (b"\x16", True),  # could still be a handshake record
    (b"\x16\x03", True),
    (b"\x16\x03\x01\x02\x00\x01", True),
    (b"\x16\x03\x03\x00\x00", True),
    (b"", False),
    (b"\x16\x02", False),
    (b"\x16\x00\x03", False),
    (b"\x17\x03\x03\x00\x05hello", False),  # application data
    (b"\x15\x03\x03\x00\x02\x02\x28", False),  # alert
    (b"\x80\x2e\x01\x03\x01", False),  # SSLv2 framing
    (b"\x03\x16", False),
    (b"GET / HTTP/1.1\r\n", False),
])
def test_looks_like_tls(data, expected):
    assert looks_like_tls(data) is expected


def test_a_real_hello_looks_like_tls():
    hello = real_client_hello("allowed.test")
    for cut in range(1, 6):
        assert looks_like_tls(hello[:cut])


def test_record_length_bounds_the_hello():
    # Bytes after the record the header announces belong to the next record: a name
    # there is not the ClientHello's.
    hello = client_hello([SUPPORTED_GROUPS])
    trailing = client_hello([server_name((0, b"evil.test"))])[5:]
    assert tls_client_hello_sni(hello + trailing) == (True, None)


# ------------------------------------------------------------------ origin_form_request


def request_lines(raw: bytes) -> list[str]:
    assert raw.endswith(b"\r\n\r\n")
    return raw[:-4].decode("iso-8859-1").split("\r\n")


def forward(method: str, url: str, version: str, headers: list[tuple[str, str]], host: str, port: int) -> bytes:
    """What the proxy sends the origin for this request head: parsed, then re-made."""
    head = "\r\n".join([f"{method} {url} {version}"] + [f"{k}: {v}" for k, v in headers])
    req = parse_request(head.encode("iso-8859-1"))
    return origin_form_request(req, host, port, parse_proxy_target(url)[2])


def test_origin_form_request_basic():
    raw = forward("GET", "http://a.test/path/x?q=1&r=%20#frag", "HTTP/1.1",
                  [("Host", "a.test"), ("Accept", "*/*")], "a.test", 80)
    assert raw == (b"GET /path/x?q=1&r=%20 HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\n"
                   b"Connection: close\r\n\r\n")


@pytest.mark.parametrize("url, target", [
    ("http://a.test", "/"),
    ("http://a.test/", "/"),
    ("http://a.test?x=1", "/?x=1"),
    ("http://a.test#frag", "/"),
    ("http://a.test:8080/p/q/", "/p/q/"),
    ("http://user:secret@a.test/x", "/x"),  # no userinfo in the request line
    ("http://a.test@a.test/x@y", "/x@y"),
    ("HTTP://A.TEST/Case/Kept", "/Case/Kept"),
    ("http://a.test/a%2Fb?c=d%26e", "/a%2Fb?c=d%26e"),
    ("http://[2606:4700::1]:8080/v6?x", "/v6?x"),
])
def test_origin_form_target(url, target):
    lines = request_lines(forward("GET", url, "HTTP/1.1", [("Host", "a.test")], "a.test", 80))
    assert lines[0] == f"GET {target} HTTP/1.1"


@pytest.mark.parametrize("url, expected", [
    ("http://a.test/x", ("a.test", 80, "/x")),
    ("http://A.Test:8080", ("a.test", 8080, "/")),
    ("http://u:p@[::1]:81/?q", ("::1", 81, "/?q")),
])
def test_parse_proxy_target(url, expected):
    assert parse_proxy_target(url) == expected


@pytest.mark.parametrize("url", ["http://[allowed.test]/", "http://[::1/", "http://:80/", "http://a.test:0/",
                                 "http:///x", "ftp://a.test/", "/relative", "http://a.test:http/"])
def test_parse_proxy_target_refusals_are_400(url):
    exc = refusal(parse_proxy_target, url)
    assert (exc.status, exc.rule) == (400, "bad-request")


def test_origin_form_keeps_method_and_version():
    lines = request_lines(forward("DELETE", "http://a.test/r", "HTTP/1.0", [], "a.test", 80))
    assert lines[0] == "DELETE /r HTTP/1.0"


def test_hop_by_hop_and_proxy_headers_are_stripped():
    headers = [
        ("Host", "a.test"),
        ("Connection", "keep-alive"),
        ("Keep-Alive", "timeout=5"),
        ("Proxy-Connection", "keep-alive"),
        ("Proxy-Authorization", "Basic c2VjcmV0"),
        ("proxy-authenticate", "Basic"),
        ("TE", "trailers"),
        ("Trailer", "Expires"),
        ("UPGRADE", "websocket"),
        ("Content-Length", "5"),
        ("X-Kept", "yes"),
    ]
    lines = request_lines(forward("POST", "http://a.test/", "HTTP/1.1", headers, "a.test", 80))
    # The framing is the proxy's own, from its parse: last, before Connection.
    assert lines == ["POST / HTTP/1.1", "Host: a.test", "X-Kept: yes", "Content-Length: 5", "Connection: close"]


def test_a_chunked_request_is_forwarded_chunked():
    lines = request_lines(forward("POST", "http://a.test/", "HTTP/1.1", [("Host", "a.test"),
                                  ("Transfer-Encoding", "Chunked"), ("Connection", "transfer-encoding")], "a.test", 80))
    assert lines == ["POST / HTTP/1.1", "Host: a.test", "Transfer-Encoding: chunked", "Connection: close"]


@pytest.mark.parametrize("name", sorted(HOP_BY_HOP))
def test_every_hop_by_hop_header_is_stripped_in_any_case(name):
    for spelled in (name, name.upper(), name.title()):
        lines = request_lines(forward("GET", "http://a.test/", "HTTP/1.1", [("Host", "a.test"), (spelled, "v")],
                                      "a.test", 80))
        assert lines == ["GET / HTTP/1.1", "Host: a.test", "Connection: close"]


def test_headers_named_in_connection_are_stripped():
    headers = [("Host", "a.test"), ("connection", "Keep-Alive, X-Secret-Token ,x-other, host, content-length"),
               ("X-Secret-Token", "t0ken"), ("X-OTHER", "o"), ("X-Visible", "v"), ("Content-Length", "0")]
    lines = request_lines(forward("GET", "http://a.test/", "HTTP/1.1", headers, "a.test", 80))
    assert lines == ["GET / HTTP/1.1", "Host: a.test", "X-Visible: v", "Content-Length: 0", "Connection: close"]


def test_connection_close_is_always_the_one_connection_header():
    headers = [("Host", "a.test"), ("Connection", "keep-alive"), ("Connection", "upgrade")]
    lines = request_lines(forward("GET", "http://a.test/", "HTTP/1.1", headers, "a.test", 80))
    assert [line for line in lines if line.lower().startswith("connection")] == ["Connection: close"]
    assert lines[-1] == "Connection: close"


@pytest.mark.parametrize("host, port, expected", [
    ("a.test", 80, "Host: a.test"),
    ("a.test", 8080, "Host: a.test:8080"),
    ("a.test", 443, "Host: a.test:443"),
    ("93.184.216.34", 80, "Host: 93.184.216.34"),
    ("93.184.216.34", 81, "Host: 93.184.216.34:81"),
])
def test_host_is_added_when_missing(host, port, expected):
    lines = request_lines(forward("GET", f"http://{host}:{port}/", "HTTP/1.1", [("Accept", "*/*")], host, port))
    assert lines == ["GET / HTTP/1.1", "Accept: */*", expected, "Connection: close"]


@pytest.mark.parametrize("port, expected", [(8080, "Host: [2606:4700::1]:8080"), (80, "Host: [2606:4700::1]")])
def test_an_added_ipv6_host_is_bracketed(port, expected):
    lines = request_lines(forward("GET", f"http://[2606:4700::1]:{port}/", "HTTP/1.1", [], "2606:4700::1", port))
    assert lines == ["GET / HTTP/1.1", expected, "Connection: close"]
    # ...and reads back as the host and port it was made from.
    assert split_host_port(expected.removeprefix("Host: "), 80) == ("2606:4700::1", port)


def test_a_client_host_header_is_kept_not_duplicated():
    headers = [("HOST", "A.Test:80"), ("Accept", "*/*")]
    lines = request_lines(forward("GET", "http://a.test/", "HTTP/1.1", headers, "a.test", 80))
    assert lines == ["GET / HTTP/1.1", "HOST: A.Test:80", "Accept: */*", "Connection: close"]


def test_origin_form_round_trips_through_parse_head_and_latin1():
    headers = [("Host", "a.test"), ("X-Name", "caf\xe9"), ("Accept", "*/*"), ("Accept", "text/html")]
    raw = forward("GET", "http://a.test/x", "HTTP/1.1", headers, "a.test", 80)
    assert b"X-Name: caf\xe9\r\n" in raw
    assert parse_head(raw[:-4]) == ("GET", "/x", "HTTP/1.1", headers + [("Connection", "close")])


# ------------------------------------------------------------------ response_status


@pytest.mark.parametrize("first, status", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 200),
    (b"HTTP/1.0 404 Not Found\r\n", 404),
    (b"HTTP/1.1 302 Found\r\nLocation: http://a.test/\r\n\r\n", 302),
    (b"HTTP/1.1 101 Switching Protocols\r\n", 101),
    (b"HTTP/1.1 599 Whatever", 599),
    (b"HTTP/1.1 204 ", 204),
    # No reason phrase (RFC 9112 makes it optional): the status line ends at the CRLF.
    (b"HTTP/1.1 204\r\n", 204),
    (b"HTTP/1.1 204\r\nContent-Length: 0\r\n\r\n", 204),
    (b"HTTP/1.0 304\r\nETag: \"a b\"\r\n\r\n", 304),
    (b"HTTP/1.1 200", 200),
    (b"HTTP/1.1 20\r\n0 OK", 0),  # a code is never read across the line end
    (b"HTTP/1.1\r\n200 OK", 0),
    (b"", 0),
    (b"garbage", 0),
    (b"HTTP/1.1", 0),
    (b"HTTP/2 200 OK\r\n", 0),
    (b"HTTP/1.1 20 OK\r\n", 0),
    (b"HTTP/1.1 2000 OK\r\n", 0),
    (b"HTTP/1.1 abc OK\r\n", 0),
    (b"HTTP/1.1  200 OK\r\n", 0),
    (b"ICY 200 OK\r\n", 0),
    (b"SSH-2.0-OpenSSH_9.6 200 x", 0),
    (b"\x16\x03\x03\x00\x5a\x02", 0),
    (b" " * 70 + b"HTTP/1.1 200 OK", 0),
])
def test_response_status(first, status):
    assert response_status(first) == status


# ------------------------------------------------------------------ refusal_response


def parse_response(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep
    lines = head.decode("utf-8").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return lines[0], headers, body


@pytest.mark.parametrize("status, phrase", [
    (400, "Bad Request"), (403, "Forbidden"), (502, "Bad Gateway"), (503, "Service Unavailable"),
    (504, "Gateway Timeout"), (418, "Error"), (500, "Error"),
])
def test_refusal_response(status, phrase):
    raw = refusal_response(status, "not-allowlisted", "host a.test is not in allowDomains")
    status_line, headers, body = parse_response(raw)
    assert status_line == f"HTTP/1.1 {status} {phrase}"
    assert headers == {
        "Content-Type": "text/plain; charset=utf-8",
        "X-Sandboxd-Egress-Rule": "not-allowlisted",
        "Content-Length": str(len(body)),
        "Connection": "close",
    }
    assert body == b"sandboxd egress proxy: host a.test is not in allowDomains (rule: not-allowlisted)\n"
    assert response_status(raw) == status


def test_refusal_response_counts_bytes_not_characters():
    reason = "Host header 'b\xfccher.test' disagrees with the request target a.test"
    _, headers, body = parse_response(refusal_response(403, "host-mismatch", reason))
    assert body.decode("utf-8") == f"sandboxd egress proxy: {reason} (rule: host-mismatch)\n"
    assert int(headers["Content-Length"]) == len(body) > len(body.decode("utf-8"))


def test_refusal_reason_stays_in_the_body():
    reason = "Host header 'x\r\nSet-Cookie: a=b' disagrees"
    raw = refusal_response(403, "host-mismatch", reason)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Set-Cookie" not in head
    assert reason.encode() in body


# ------------------------------------------------------------------ ConnectionRecord, summaries


def test_connection_record_defaults_to_its_event():
    event = ConnectionRecord(protocol="http").observed().to_payload()
    started = event.pop("startedAt")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", started)
    assert event == {
        "protocol": "http", "method": "", "host": "", "port": 0, "address": "", "decision": "denied",
        "rule": "", "reason": "", "error": "", "status": 0, "bytesUp": 0, "bytesDown": 0, "endedAt": "",
    }


def test_connection_record_to_event_maps_every_field():
    rec = ConnectionRecord(protocol="connect", method="CONNECT", host="a.example.com", port=443,
                           address="93.184.216.34", decision="allowed", rule="*.example.com", reason="",
                           error="ConnectionResetError: reset", status=200, bytes_up=517, bytes_down=4096,
                           started_at="2026-01-02T03:04:05.000006Z", ended_at="2026-01-02T03:04:06.000007Z")
    assert rec.observed().to_payload() == {
        "protocol": "connect", "method": "CONNECT", "host": "a.example.com", "port": 443,
        "address": "93.184.216.34", "decision": "allowed", "rule": "*.example.com", "reason": "",
        "error": "ConnectionResetError: reset", "status": 200, "bytesUp": 517, "bytesDown": 4096,
        "startedAt": "2026-01-02T03:04:05.000006Z", "endedAt": "2026-01-02T03:04:06.000007Z",
    }
    # The event is a fresh dict: changing it does not change the record.
    event = rec.observed().to_payload()
    event["host"] = "changed"
    assert rec.host == "a.example.com"


def rec(host: str, port: int, decision: str = "allowed", error: str = "") -> ConnectionRecord:
    return ConnectionRecord(protocol="connect", host=host, port=port, decision=decision, error=error)


def test_summarize_external_calls():
    records = [
        rec("a.test", 443),
        rec("denied.test", 443, decision="denied"),
        rec("a.test", 443),  # seen
        rec("a.test", 80),  # another port: another destination
        rec("failed.test", 443, error="cannot connect to failed.test: refused"),
        rec("2606:4700::1", 443),
        rec("93.184.216.34", 80),
        rec("2606:4700::1", 443),
        rec("b.test", 8443),
    ]
    assert summarize_external_calls(records) == [
        "a.test:443", "a.test:80", "[2606:4700::1]:443", "93.184.216.34:80", "b.test:8443"]


def test_summarize_external_calls_empty():
    assert summarize_external_calls([]) == []
    assert summarize_external_calls([rec("x.test", 443, decision="denied")]) == []


# ------------------------------------------------------------------ the checks, end to end


RULES = EgressRules(("*.example.com", "93.184.216.34", "127.0.0.1"), deny_private=True)


@pytest.mark.parametrize("head, host, port, name_ok, address_ok", [
    (b"CONNECT api.example.com:443 HTTP/1.1", "api.example.com", 443, True, None),
    (b"CONNECT API.Example.COM.:443 HTTP/1.1", "api.example.com", 443, True, None),
    (b"CONNECT example.com:443 HTTP/1.1", "example.com", 443, False, None),
    (b"CONNECT badexample.com:443 HTTP/1.1", "badexample.com", 443, False, None),
    (b"CONNECT 93.184.216.34:443 HTTP/1.1", "93.184.216.34", 443, True, True),
    (b"CONNECT [::ffff:93.184.216.34]:443 HTTP/1.1", "93.184.216.34", 443, True, True),
    (b"CONNECT [::ffff:127.0.0.1]:22 HTTP/1.1", "127.0.0.1", 22, True, False),  # named, yet never reachable
    (b"CONNECT [::1]:443 HTTP/1.1", "::1", 443, False, False),
])
def test_connect_target_through_the_name_and_address_checks(head, host, port, name_ok, address_ok):
    method, target, _, _ = parse_head(head)
    assert method == "CONNECT"
    assert split_host_port(target, None) == (host, port)
    assert decide_host(host, RULES).allowed is name_ok
    literal = parse_ip(host)
    if address_ok is not None:
        assert decide_address(literal, RULES).allowed is address_ok
    else:
        assert literal is None


def test_sni_of_a_real_hello_agrees_with_the_connect_target():
    _, target, _, _ = parse_head(b"CONNECT Allowed.Test:443 HTTP/1.1")
    host, _ = split_host_port(target, None)
    is_tls, sni = tls_client_hello_sni(real_client_hello("allowed.test"))
    assert is_tls and split_host_port(sni, 443)[0] == host
    is_tls, sni = tls_client_hello_sni(real_client_hello("other.test"))
    assert is_tls and split_host_port(sni, 443)[0] != host
    assert decide_address(ip_address("10.0.0.1"), RULES).rule == "deny-private-networks"


# ------------------------------------------------------------------ the CONNECT tunnel's first bytes


class _Upstream:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def check_first_bytes(chunks: list[bytes], target: str = "allowed.test",
                      port: int = 443) -> tuple[ConnectionRecord, bytes]:
    """proxy_tunnel.check_first_bytes over a reader that gets `chunks` one at a time
    (the first before the check starts), then EOF: the record and what reached the
    upstream. A refusal propagates."""
    async def run() -> tuple[ConnectionRecord, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(chunks[0])

        async def feed() -> None:
            for chunk in chunks[1:]:
                await asyncio.sleep(0.01)
                reader.feed_data(chunk)
            await asyncio.sleep(0.01)
            reader.feed_eof()

        feeder = asyncio.ensure_future(feed())
        rec = ConnectionRecord(protocol="connect", host=target, port=port)
        upstream = _Upstream()
        try:
            await check_tunnel_first_bytes(rec, reader, upstream)
        finally:
            feeder.cancel()
        return rec, upstream.data

    return asyncio.run(run())


def test_first_bytes_a_matching_hello_is_passed_whole():
    hello = real_client_hello("Allowed.Test")
    rec, sent = check_first_bytes([hello])
    assert sent == hello and rec.bytes_up == len(hello)


@pytest.mark.parametrize("cut", [2, 5, 50, -1])
def test_first_bytes_a_hello_in_pieces_is_read_to_its_end(cut):
    hello = real_client_hello("allowed.test")
    assert check_first_bytes([hello[:cut], hello[cut:]])[1] == hello
    evil = real_client_hello("allowed.test.evil.example")
    start = evil.index(b"allowed.test.evil.example")
    for at in (cut, start + len("allowed.test")):
        with pytest.raises(ProxyRefusal) as info:
            check_first_bytes([evil[:at], evil[at:]])
        assert (info.value.status, info.value.rule) == (0, "sni-mismatch")


def test_first_bytes_a_hello_that_never_completes_is_refused():
    hello = real_client_hello("allowed.test")
    with pytest.raises(ProxyRefusal) as info:
        check_first_bytes([hello[:40]])
    assert (info.value.status, info.value.rule) == (0, "unreadable-first-bytes")
    assert "TLS ClientHello" in info.value.reason


def test_first_bytes_a_complete_but_malformed_record_is_refused():
    with pytest.raises(ProxyRefusal) as info:
        check_first_bytes([_with_handshake_length(GOOD, 1) + b"more"])
    assert info.value.rule == "unreadable-first-bytes"


def test_first_bytes_a_hello_whose_first_byte_comes_alone_is_still_checked():
    evil = real_client_hello("evil.test")
    with pytest.raises(ProxyRefusal) as info:
        check_first_bytes([evil[:1], evil[1:]])
    assert info.value.rule == "sni-mismatch"


def test_first_bytes_a_mismatching_host_header_is_refused():
    with pytest.raises(ProxyRefusal) as info:
        check_first_bytes([b"GET / HTTP/1.1\r\nHo", b"st: evil.test\r\n\r\n"])
    assert (info.value.status, info.value.rule) == (0, "host-mismatch")
    rec, sent = check_first_bytes([b"GET / HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n"])
    assert sent == b"GET / HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n"


@pytest.mark.parametrize("head", [
    b"GET / HTTP/1.1\nHost: evil.test\r\n\r\n",
    b" GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n",
    b"GET\t/ HTTP/1.1\r\nHost: evil.test\r\n\r\n",
    b"\x00\x01\x02",
    b"\x17\x03\x03\x00\x05hello",  # TLS application data is not a hello
])
def test_first_bytes_an_unreadable_head_is_not_relayed_unchecked(head):
    with pytest.raises(ProxyRefusal) as info:
        check_first_bytes([head])
    assert (info.value.status, info.value.rule) == (0, "unreadable-first-bytes")


def test_first_bytes_a_head_that_never_ends_is_refused():
    with pytest.raises(ProxyRefusal) as info:
        check_first_bytes([b"GET / HTTP/1.1\r\nHost: allowed.test\r\n"])
    assert info.value.rule == "unreadable-first-bytes"


def test_first_bytes_on_a_server_first_port_an_ssh_banner_is_relayed():
    assert check_first_bytes([b"SSH-2.0-OpenSSH_9.6\r\n"], port=22)[1] == b"SSH-2.0-OpenSSH_9.6\r\n"
    with pytest.raises(ProxyRefusal):
        check_first_bytes([b"SSH-2.0-OpenSSH_9.6\r\n"], port=443)


# ------------------------------------------------------------------ TunnelRequests


def test_tunnel_requests_checks_each_request_however_it_is_cut():
    stream = (b"GET /a HTTP/1.1\r\nHost: a.test\r\n\r\n"
              b"POST /b HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3;x\r\nabc\r\n0\r\nT: 1\r\n\r\n"
              b"\r\nPUT /c HTTP/1.1\r\nHost: A.TEST.:80\r\nContent-Length: 2\r\n\r\nhi")
    expected = (b"GET /a HTTP/1.1\r\nHost: a.test\r\n\r\n"
                b"POST /b HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
                b"PUT /c HTTP/1.1\r\nHost: A.TEST.:80\r\nContent-Length: 2\r\n\r\nhi")
    for size in (1, 2, 7, 64, len(stream)):
        t = TunnelRequests("a.test", 80)
        out = b"".join(t.feed(stream[i:i + size]) for i in range(0, len(stream), size))
        assert t.checked == 3
        # However it was cut, the origin gets the same requests (the body maybe in more chunks).
        assert _unchunk(out) == _unchunk(expected), size


def _unchunk(stream: bytes) -> bytes:
    """The stream with chunked bodies joined, so that two chunkings compare equal."""
    out, rest = b"", stream
    while rest:
        head, _, rest = rest.partition(b"\r\n\r\n")
        out += head + b"\r\n\r\n"
        if b"Transfer-Encoding: chunked" in head:
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                if not size:
                    rest = rest[2:]
                    break
                body, rest = body + rest[:size], rest[size + 2:]
            out += body + b"|end|"
        elif b"Content-Length: " in head:
            n = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            out, rest = out + rest[:n], rest[n:]
    return out


@pytest.mark.parametrize("stream, rule", [
    (b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n", "host-mismatch"),
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 1\r\n\r\nxGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
     "host-mismatch"),
    (b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n GET / HTTP/1.1\r\nHost: b.test\r\n\r\n", "unreadable-first-bytes"),
    (b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n\nGET / HTTP/1.1\r\n", "unreadable-first-bytes"),
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", "unreadable-first-bytes"),
    (b"CONNECT b.test:80 HTTP/1.1\r\nHost: b.test\r\n\r\n", "host-mismatch"),
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "unreadable-first-bytes"),
    (b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n", "unreadable-first-bytes"),  # HTTP/1.1 needs a Host
    (b"GET / HTTP/1.1\r\nHost: [a.test]\r\n\r\n", "host-mismatch"),
    (b"A" * (70 * 1024), "unreadable-first-bytes"),
])
def test_tunnel_requests_refusals(stream, rule):
    t = TunnelRequests("a.test", 80)
    with pytest.raises(ProxyRefusal) as info:
        t.feed(stream)
    assert (info.value.status, info.value.rule) == (0, rule)


def test_tunnel_requests_accept_http_1_0_without_host():
    t = TunnelRequests("a.test", 80)
    assert t.feed(b"GET / HTTP/1.0\r\n\r\n") == b"GET / HTTP/1.0\r\n\r\n"
    assert t.checked == 1
