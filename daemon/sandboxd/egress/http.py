"""HTTP/1.1 framing for the egress proxy, pure: no sockets, no loop.

The rule: the proxy forwards only what it has parsed, and it parses with a real HTTP/1.1
parser (h11) behind a strict lexical check of its own. A request head is exactly
`method SP target SP HTTP/1.0|1.1`, CRLF line ends, no bare CR, LF or NUL, no obsolete
line folding; its body is framed by one Content-Length or by `Transfer-Encoding:
chunked` (parsed to its last chunk and trailer), never both, and no other transfer
coding. What reaches the origin is re-serialized from the parse (a chunked body as
canonical chunks, no extensions or trailers), so an origin that reads HTTP more
leniently than we do never sees bytes we did not read as the same request. A plain
proxy request is one request per connection: bytes past its end are dropped and
counted. Inside a CONNECT tunnel that carries plain HTTP, every request is framed the
same way and each one's Host is checked (`TunnelRequests`); anything it cannot read
ends the tunnel. What goes upstream is a function of the client's bytes alone, never
of how they were cut into reads: a refusal carries (`ProxyRefusal.forward`) whatever
was checked before the refused input in the same read.

The framers also say since when they hold an incomplete framing element (a request
head, a chunk-size line, a body's last chunk and trailer): `pending_since`, on the
clock they are given. The relay ends a connection whose element is not whole within
the head timeout of its first byte, so no part of the framing this proxy buffers can
be trickled in for longer than a request head may take (`timed_out` says how)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import h11

from sandboxd.policy.egress_rules import normalize_host, parse_ip

MAX_HEAD_BYTES = 64 * 1024
# How long a request head (and any framing element the proxy holds: a SOCKS5 request, a
# TLS ClientHello, a chunk-size line, a trailer) may take from its first byte to its
# last, wherever the proxy reads one: a deadline, however the bytes trickle in.
HEAD_TIMEOUT_S = 30.0
# A host as the record keeps it when the request could not be read whole: bounded.
MAX_RECORDED_HOST_CHARS = 255
MAX_RECORDED_METHOD_CHARS = 64
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate",
                        "te", "trailer", "upgrade"})


class ProxyRefusal(Exception):
    def __init__(self, status: int, rule: str, reason: str, decision: str = "denied"):
        super().__init__(reason)
        self.status, self.rule, self.reason, self.decision = status, rule, reason, decision
        # What a framer had checked, in the same read, before the refused input: it goes
        # upstream before the cut, so what the destination gets never depends on where
        # the client's stream happened to be split into reads.
        self.forward = b""


def _bad(reason: str) -> ProxyRefusal:
    return ProxyRefusal(400, "bad-request", reason)


# ---------------------------------------------------------------- request heads

_TCHAR = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_REQUEST_LINE = re.compile(rb"(%s+) ([\x21-\x7e]+) (HTTP/1\.[01])" % _TCHAR)
_HEADER_NAME = re.compile(rb"%s+" % _TCHAR)
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
# What the start of a request can look like before its line is complete: a method
# token still arriving, or a token and a space. Anything else can never become one.
_REQUEST_START = re.compile(rb"%s*\Z|%s+ " % (_TCHAR, _TCHAR))


@dataclass
class RequestHead:
    method: str
    target: str
    version: str  # "HTTP/1.0" | "HTTP/1.1"
    headers: list[tuple[str, str]]
    chunked: bool
    length: int  # the Content-Length; 0 for none (and for chunked)
    parser: h11.Connection  # positioned at the body

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name]


def _lexical_check(head: bytes) -> list[tuple[bytes, bytes]]:
    """The head's lines, strictly: anything another parser could read differently is refused."""
    if b"\0" in head:
        raise _bad("a bare CR, LF or NUL inside the request head")
    lines = head.split(b"\r\n")
    if any(b"\r" in line or b"\n" in line for line in lines):
        # A bare line break would let the origin see a header this proxy never checked.
        raise _bad("a bare CR, LF or NUL inside the request head")
    if not _REQUEST_LINE.fullmatch(lines[0]):
        raise _bad("not an HTTP/1.x request line")
    fields = []
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            raise _bad(f"obsolete line folding (a header line starting with white space): "
                       f"{line[:40].decode('iso-8859-1')!r}")
        name, sep, value = line.partition(b":")
        if not sep or not _HEADER_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise _bad(f"malformed header line {line.decode('iso-8859-1')[:40]!r}")
        fields.append((name.lower(), value.strip(b" \t")))
    return fields


def _framing(version: bytes, fields: list[tuple[bytes, bytes]]) -> tuple[bool, int]:
    encodings = [v for k, v in fields if k == b"transfer-encoding"]
    lengths = {v for k, v in fields if k == b"content-length"}
    if encodings:
        shown = b", ".join(encodings).decode("iso-8859-1")[:60]
        if len(encodings) > 1 or encodings[0].lower() != b"chunked":
            raise _bad(f"Transfer-Encoding {shown!r} is not supported (chunked only)")
        if lengths:
            raise _bad("both Content-Length and Transfer-Encoding")
        if version == b"HTTP/1.0":
            raise _bad("Transfer-Encoding in an HTTP/1.0 request")
        return True, 0
    if len(lengths) > 1:
        raise _bad("conflicting Content-Length headers")
    if not lengths:
        return False, 0
    value = lengths.pop()
    if not re.fullmatch(rb"[0-9]{1,18}", value):
        raise _bad(f"bad Content-Length {value.decode('iso-8859-1')[:40]!r}")
    return False, int(value)


def parse_request(head: bytes) -> RequestHead:
    """A request head (without its final CRLFCRLF), checked strictly and parsed by h11,
    whose connection is left at the request's body."""
    fields = _lexical_check(head)
    request_line = _REQUEST_LINE.fullmatch(head.split(b"\r\n", 1)[0])
    if request_line is None:  # _lexical_check refused it already (said for the type checker)
        raise _bad("not an HTTP/1.x request line")
    method, target, version = request_line.groups()
    chunked, length = _framing(version, fields)
    # h11 insists on Host in HTTP/1.1; a proxy request routes by its target instead (the
    # proxy adds Host from it), so one is lent to the parser and taken back after.
    lend_host = (method == b"CONNECT" or b"://" in target) and not any(k == b"host" for k, _ in fields)
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    try:
        parser.receive_data(head + (b"\r\nHost: lent.invalid" if lend_host else b"") + b"\r\n\r\n")
        event = parser.next_event()
    except h11.RemoteProtocolError as exc:
        raise _bad(f"malformed request head: {str(exc)[:120]}") from None
    if not isinstance(event, h11.Request):  # pragma: no cover - a complete head is a request or an error
        raise _bad("not a request")
    headers = [(k.decode("iso-8859-1"), v.decode("iso-8859-1")) for k, v in event.headers.raw_items()]
    if lend_host:
        headers.pop()
    return RequestHead(method.decode("ascii"), target.decode("ascii"), version.decode("ascii"), headers,
                       chunked, length, parser)


def parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(method, target, version, headers) of a request head without its final CRLFCRLF."""
    req = parse_request(head)
    return req.method, req.target, req.version, req.headers


# ---------------------------------------------------------------- targets and hosts


def split_host_port(authority: str, default_port: int | None) -> tuple[str, int]:
    """host and port of `host:port` / `[v6]:port`; the host normalized."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise _bad(f"bad authority {authority!r}")
        host, rest = authority[1:end], authority[end + 1:]
        if (rest and not rest.startswith(":")) or ":" not in host or parse_ip(host) is None:
            # Brackets hold an IPv6 literal, nothing else (urlsplit raised here).
            raise _bad(f"bad authority {authority!r}")
        port_text = rest[1:]
    elif authority.count(":") == 1:
        host, port_text = authority.split(":")
    elif ":" in authority:  # a bare IPv6 literal
        host, port_text = authority, ""
    else:
        host, port_text = authority, ""
    if not host.strip():
        raise _bad(f"{authority!r} names no host")
    if not port_text:
        if default_port is None:
            raise _bad(f"{authority!r} names no port")
        port = default_port
    else:
        if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
            raise _bad(f"bad port in {authority!r}")
        port = int(port_text)
    host = normalize_host(host)
    if len(host) > 253:
        raise _bad(f"a host name of {len(host)} characters")
    return host, port


def best_effort_host(authority: str) -> str:
    """The host an authority names, as far as it can be read, for the record of a
    request refused as malformed: bounded, printable, never an exception."""
    try:
        host = split_host_port(authority, 1)[0]
    except ProxyRefusal:
        host = authority
        if host.startswith("["):
            host = host[1:].partition("]")[0]
        elif host.count(":") == 1:
            host = host.partition(":")[0]
        host = host.strip().rstrip(".").lower()
    host = host[:MAX_RECORDED_HOST_CHARS]
    return "".join(c if c.isprintable() and not c.isspace() else "?" for c in host)


def _split_url(target: str) -> tuple[str, str]:
    """(authority with any userinfo, the rest) of an absolute URL `scheme://authority/...`."""
    rest = target.partition("://")[2]
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    return rest[:end], rest[end:]


def url_authority(target: str) -> str:
    """The authority of an absolute URL, userinfo dropped."""
    return _split_url(target)[0].rpartition("@")[2]


def parse_proxy_target(target: str) -> tuple[str, int, str]:
    """(host, port, origin-form path) of an absolute-form `http://` target."""
    if target[:7].lower() != "http://":
        raise _bad("this is a proxy: requests need an absolute http:// URL or CONNECT")
    authority, tail = _split_url(target)
    tail = tail.partition("#")[0]
    if not tail.startswith("/"):
        tail = "/" + tail
    host, port = split_host_port(authority.rpartition("@")[2], 80)
    return host, port, tail


def tunnel_host_check(req: RequestHead, host: str, port: int) -> None:
    """A request inside a CONNECT tunnel may only name the tunnel's own host."""
    if not (req.target.startswith("/") or (req.target == "*" and req.method == "OPTIONS")):
        # An absolute-form target is routed by its URL, whatever Host says.
        raise ProxyRefusal(0, "host-mismatch", f"request target {req.target[:80]!r} inside a tunnel")
    if req.method == "CONNECT" or req.values("upgrade"):
        # What follows would not be HTTP this proxy can read: fail closed.
        raise ProxyRefusal(0, "unreadable-first-bytes", "CONNECT or Upgrade inside a plain-HTTP tunnel")
    hosts = req.values("host")
    if len(hosts) > 1:
        raise ProxyRefusal(0, "host-mismatch", "more than one Host header inside a tunnel")
    if hosts:
        try:
            named = split_host_port(hosts[0], port)[0]
        except ProxyRefusal:
            raise ProxyRefusal(0, "host-mismatch", f"Host header {hosts[0][:80]!r} cannot be read") from None
        if named != host:
            raise ProxyRefusal(0, "host-mismatch",
                               f"Host header {hosts[0][:80]!r} disagrees with the CONNECT target {host}")


# ---------------------------------------------------------------- what goes upstream


def _head_bytes(lines: list[str]) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("iso-8859-1")


def _framing_header(req: RequestHead) -> list[str]:
    if req.chunked:
        return ["Transfer-Encoding: chunked"]
    if req.values("content-length"):
        return [f"Content-Length: {req.length}"]
    return []


def origin_form_request(req: RequestHead, host: str, port: int, path: str) -> bytes:
    """The request as the destination sees it: origin-form target, no proxy or
    hop-by-hop headers, the framing the proxy parsed, and one request per connection."""
    connection_named = set()
    for value in req.values("connection"):
        connection_named |= {v.strip().lower() for v in value.split(",")}
    # Naming Host in Connection must not strip it; framing is the proxy's own anyway.
    connection_named.discard("host")
    out = [f"{req.method} {path} {req.version}"]
    for name, value in req.headers:
        low = name.lower()
        if low in HOP_BY_HOP or low in connection_named or low in ("content-length", "transfer-encoding"):
            continue
        out.append(f"{name}: {value}")
    if not req.values("host"):
        shown = f"[{host}]" if ":" in host else host
        out.append(f"Host: {shown}" + ("" if port == 80 else f":{port}"))
    out += _framing_header(req)
    out.append("Connection: close")
    return _head_bytes(out)


def tunnel_request_head(req: RequestHead) -> bytes:
    """A request inside a tunnel, re-serialized as parsed (its own connection headers kept)."""
    out = [f"{req.method} {req.target} {req.version}"]
    out += [f"{k}: {v}" for k, v in req.headers if k.lower() not in ("content-length", "transfer-encoding")]
    out += _framing_header(req)
    return _head_bytes(out)


class BodyFramer:
    """A request's body, read by h11 to its end: `feed` returns what may go upstream
    (a chunked body re-encoded as canonical chunks). Bytes past the end are dropped
    and counted in `extra`; a malformed body raises ProxyRefusal. `pending_since`: when
    the first byte of the chunk-size line or trailer h11 holds incomplete came (`clock`
    time), None when it holds nothing (a Content-Length body is never held)."""

    def __init__(self, req: RequestHead, clock: Callable[[], float] = time.monotonic):
        self._parser, self._chunked = req.parser, req.chunked
        self._clock = clock
        self.done = False
        self.extra = 0
        self.pending_since: float | None = None
        self._events = 0  # events h11 gave so far: a new one means the element held before is whole
        self._drain()  # a request without a body ends at its head

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.extra += len(data)
            return b""
        if not data:
            return b""  # h11 reads empty bytes as the end of the stream
        now, events = self._clock(), self._events
        self._parser.receive_data(data)
        out = self._drain()
        if self.done or not self._parser.trailing_data[0]:
            self.pending_since = None
        elif self._events != events or self.pending_since is None:
            self.pending_since = now  # what h11 holds came in this read
        return out

    def timed_out(self, timeout_s: float) -> ProxyRefusal:
        """The refusal of a body whose held element (pending_since) took too long."""
        return ProxyRefusal(408, "framing-timeout", f"a chunk-size line or trailer of the request body was not "
                            f"complete within {timeout_s:g} s of its first byte", decision="allowed")

    def feed_eof(self) -> None:
        """The client stopped sending: a body cut short is refused."""
        if not self.done:
            self._parser.receive_data(b"")
            self._drain()
            if not self.done:
                raise ProxyRefusal(0, "bad-request", "the client closed before the end of its request body",
                                   decision="allowed")

    def leftover(self) -> bytes:
        """What was read past the end of the request (the next request's start, in a tunnel)."""
        return self._parser.trailing_data[0]

    def _drain(self) -> bytes:
        out: list[bytes] = []
        while not self.done:
            try:
                event = self._parser.next_event()
            except h11.RemoteProtocolError as exc:
                # The destination was allowed and has the request's start: an error, not a denial.
                refusal = ProxyRefusal(400, "bad-request", f"malformed request body: {str(exc)[:120]}",
                                       decision="allowed")
                refusal.forward = b"".join(out)
                raise refusal from None
            if isinstance(event, (h11.Data, h11.EndOfMessage)):
                self._events += 1
            if isinstance(event, h11.Data):
                if self._chunked and event.data:
                    out.append(b"%x\r\n%s\r\n" % (len(event.data), bytes(event.data)))
                elif event.data:
                    out.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if self._chunked:
                    out.append(b"0\r\n\r\n")  # trailers are not forwarded
                self.done = True
                self.extra = len(self.leftover())
            else:  # NEED_DATA (PAUSED cannot come before the end)
                break
        return b"".join(out)


class TunnelRequests:
    """Plain HTTP inside a CONNECT tunnel to host:port: every request parsed, its Host
    checked, its head and body re-serialized. `feed` returns what may go upstream and
    raises ProxyRefusal (status 0: the tunnel is closed) at the first request it cannot
    read or that names another host, its `forward` what was checked before it.
    `pending_since`: when the first byte of the head (or of the body's framing) held
    incomplete came, on `clock`; empty lines skipped before a head hold nothing."""

    def __init__(self, host: str, port: int, clock: Callable[[], float] = time.monotonic):
        self.host, self.port = host, port
        self.checked = 0  # requests whose head was read and checked
        self._clock = clock
        self._buf = bytearray()
        self._body: BodyFramer | None = None
        self._head_since: float | None = None

    @property
    def pending_since(self) -> float | None:
        return self._body.pending_since if self._body is not None else self._head_since

    def timed_out(self, timeout_s: float) -> ProxyRefusal:
        """The refusal of the element held too long (pending_since): the tunnel is closed."""
        if self._body is not None:
            return ProxyRefusal(0, "framing-timeout", self._body.timed_out(timeout_s).reason)
        return ProxyRefusal(0, "head-timeout", f"a request head inside the tunnel was not complete within "
                            f"{timeout_s:g} s of its first byte")

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        try:
            self._feed(data, out)
        except ProxyRefusal as refusal:
            refusal.forward = b"".join(out)
            raise
        return b"".join(out)

    def _feed(self, data: bytes, out: list[bytes]) -> None:
        now = self._clock()
        self._buf += data
        while True:
            if self._body is not None:
                if not self._body.done:
                    data = bytes(self._buf)
                    self._buf.clear()
                    try:
                        out.append(self._body.feed(data))
                    except ProxyRefusal as exc:
                        out.append(exc.forward)  # the body's chunks before the malformed one
                        raise ProxyRefusal(0, "unreadable-first-bytes", exc.reason) from None
                    if not self._body.done:
                        break
                    self._buf += self._body.leftover()  # the next request's start
                self._body = None
            # Servers skip empty lines before a request line (RFC 9112 2.2): so does this.
            while self._buf[:2] == b"\r\n":
                del self._buf[:2]
            if not self._buf:
                self._head_since = None
                break
            if self._head_since is None:
                self._head_since = now  # a head's first byte (or half an empty line) is held from now
            if self._buf == b"\r":  # half an empty line
                break
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if not _REQUEST_START.match(self._buf) or len(self._buf) > MAX_HEAD_BYTES:
                    raise ProxyRefusal(0, "unreadable-first-bytes", "bytes inside the tunnel that are not an "
                                       f"HTTP/1.x request: {bytes(self._buf[:40])!r}")
                break
            head = bytes(self._buf[:end])
            del self._buf[:end + 4]
            try:
                req = parse_request(head)
            except ProxyRefusal as exc:
                raise ProxyRefusal(0, "unreadable-first-bytes", f"HTTP request head: {exc.reason}") from None
            tunnel_host_check(req, self.host, self.port)
            self.checked += 1
            self._head_since = None
            out.append(tunnel_request_head(req))
            self._body = BodyFramer(req, self._clock)

    def feed_eof(self) -> None:
        pass  # a request cut short inside a tunnel is the origin's to refuse: nothing more is sent


# ---------------------------------------------------------------- answers


def response_status(first: bytes) -> int:
    """The status code of an HTTP response's first bytes, 0 if they are not one."""
    parts = first[:64].split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit() and len(parts[1]) == 3:
        return int(parts[1])
    return 0


def refusal_response(status: int, rule: str, reason: str) -> bytes:
    phrase = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 502: "Bad Gateway", 503: "Service Unavailable",
              504: "Gateway Timeout"}.get(status, "Error")
    body = f"sandboxd egress proxy: {reason} (rule: {rule})\n".encode()
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"X-Sandboxd-Egress-Rule: {rule}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body


# RFC 1928 reply codes for what the HTTP side answers with a status.
SOCKS5_REPLY_FOR_STATUS = {400: 0x07, 403: 0x02, 408: 0x01, 502: 0x05, 503: 0x01, 504: 0x04}


def socks5_reply(code: int) -> bytes:
    """A SOCKS5 reply; the bound address is not ours to tell (all zeros)."""
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])
