"""The egress proxy's tunnels, before their bytes are relayed: the rest of a SOCKS5
request, and the check of a tunnel's first bytes, which decides what it may carry."""

from __future__ import annotations

import asyncio
import ipaddress

from sandboxd.policy.egress_rules import normalize_host
from sandboxd.egress.http import (HEAD_TIMEOUT_S, MAX_RECORDED_METHOD_CHARS, ProxyRefusal, TunnelRequests, best_effort_host,
                                  url_authority)
from sandboxd.egress.records import ConnectionRecord
from sandboxd.egress.tls import MAX_HELLO_RECORD, IncompleteHello, looks_like_tls, tls_client_hello_sni

# Ports whose protocols let the server speak first (SSH, SMTP, FTP, POP, IMAP, MySQL):
# a tunnel there is relayed if the client stays silent for a second (or, SSH's client
# not waiting for the server, opens with its banner). Every other tunnel waits for the
# client's first bytes, and carries TLS or HTTP only.
SERVER_FIRST_PORTS = frozenset({21, 22, 25, 110, 143, 465, 587, 993, 995, 3306})
SERVER_FIRST_WAIT_S = 1.0
RELAY_CHUNK = 256 * 1024


async def read_socks5_request(rec: ConnectionRecord, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
    """The rest of a SOCKS5 greeting (RFC 1928) and its request: CONNECT only, no
    authentication. Sets the target on `rec`; the version byte is already read."""
    try:
        methods = await reader.readexactly((await reader.readexactly(1))[0])
        if 0 not in methods:
            writer.write(b"\x05\xff")
            raise ProxyRefusal(0, "bad-request", "the SOCKS5 client offers no 'no authentication' method")
        writer.write(b"\x05\x00")
        ver, cmd, _, atyp = await reader.readexactly(4)
        if atyp == 1:
            host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
        elif atyp == 4:
            host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
        elif atyp == 3:
            host = (await reader.readexactly((await reader.readexactly(1))[0])).decode("ascii", "replace")
        else:
            raise ProxyRefusal(400, "bad-request", f"SOCKS5 address type {atyp} is not supported")
        port = int.from_bytes(await reader.readexactly(2), "big")
    except asyncio.IncompleteReadError:
        raise ProxyRefusal(0, "bad-request", "an incomplete SOCKS5 request") from None
    rec.host, rec.port = normalize_host(host), port
    if ver != 5 or cmd != 1:
        raise ProxyRefusal(400, "bad-request", f"SOCKS5 command {cmd} is not supported (CONNECT only)")
    if not 0 < port < 65536:
        raise ProxyRefusal(400, "bad-request", f"bad port {port}")


async def check_first_bytes(rec: ConnectionRecord, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter,
                            head_timeout_s: float = HEAD_TIMEOUT_S) -> TunnelRequests | None:
    """The tunnel's first bytes decide what it may carry. TLS: the ClientHello's SNI
    must agree with the target, then the rest is relayed. Plain HTTP: every request
    is framed and its Host checked (the TunnelRequests returned stays in the relay's
    path, which holds each later head to the same deadline). On a port whose server
    speaks first, a silent client or an SSH banner is relayed. Anything else ends the
    tunnel before a byte is passed; so does a hello or a head that is not whole within
    head_timeout_s of its first byte."""
    wait = SERVER_FIRST_WAIT_S if rec.port in SERVER_FIRST_PORTS else head_timeout_s
    try:
        first = await asyncio.wait_for(reader.read(RELAY_CHUNK), wait)
    except TimeoutError:
        if rec.port in SERVER_FIRST_PORTS:
            return None  # the server speaks first (SSH, SMTP): nothing names a host
        raise ProxyRefusal(0, "unreadable-first-bytes", f"the client sent nothing for {wait:g} s") from None
    if not first:
        return None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + head_timeout_s

    async def more(why: str) -> bytes:
        try:
            data = await asyncio.wait_for(reader.read(RELAY_CHUNK), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise ProxyRefusal(0, "head-timeout", f"{why}: not complete within {head_timeout_s:g} s of its "
                               "first byte") from None
        if not data:
            raise ProxyRefusal(0, "unreadable-first-bytes", f"{why}: the client stopped before its end")
        return data

    if looks_like_tls(first):
        while True:
            try:
                _, named = tls_client_hello_sni(first)
                break
            except IncompleteHello as exc:
                record_done = len(first) >= 5 and len(first) >= 5 + int.from_bytes(first[3:5], "big")
                if record_done or len(first) >= MAX_HELLO_RECORD:
                    raise ProxyRefusal(0, "unreadable-first-bytes", f"TLS ClientHello: {exc}") from None
                first += await more(f"TLS ClientHello: {exc}")
        if named is not None and normalize_host(named) != rec.host:
            raise ProxyRefusal(0, "sni-mismatch", f"TLS SNI {named[:255]!r} disagrees with the CONNECT target "
                               f"{rec.host}")
        upstream.write(first)
        rec.bytes_up += len(first)
        return None
    if rec.port in SERVER_FIRST_PORTS and first.startswith(b"SSH-"):
        upstream.write(first)
        rec.bytes_up += len(first)
        return None
    requests = TunnelRequests(rec.host, rec.port, loop.time)
    out = b""
    try:
        out += requests.feed(first)
        while not requests.checked:
            out += requests.feed(await more("an HTTP request head"))
    except ProxyRefusal as refusal:
        # What was checked before it goes, as it would have had it come in a read of its own.
        out += refusal.forward
        if out:
            upstream.write(out)
            rec.bytes_up += len(out)
        raise
    upstream.write(out)
    rec.bytes_up += len(out)
    return requests


def note_request_line(rec: ConnectionRecord, head: bytes) -> None:
    """What a request line names, as far as it can be read: kept on the record of a
    request refused as malformed (bounded; the parse decides everything else)."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    method = parts[0].decode("iso-8859-1")
    if method.isascii() and method.isalpha():
        rec.method = method[:MAX_RECORDED_METHOD_CHARS]
    if len(parts) < 2:
        return
    target = parts[1][:4096].decode("iso-8859-1")
    if method == "CONNECT":
        rec.protocol = "connect"
        rec.host = best_effort_host(target)
    elif target[:7].lower() == "http://":
        rec.host = best_effort_host(url_authority(target))
