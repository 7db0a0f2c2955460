"""The egress proxy: the only way out of an `allowlist` sandbox.

A sandbox with egress `allowlist` has no network at all, only its own loopback. The
daemon opens one Unix socket per sandbox (an EgressEndpoint), binds it into the sandbox,
and the egress shim there relays 127.0.0.1:PORT to it; HTTP_PROXY and friends point at
that port. Every connection on an endpoint therefore belongs to exactly one call: no
attribution by source address, and no route for anything that ignores the proxy.

The proxy speaks HTTP/1.1 proxy requests (absolute-form, one request per connection),
CONNECT, and SOCKS5 CONNECT (no authentication; told apart by its first byte) on the
same port. It checks the name against allowDomains before resolving it (a name that
is not allowed is never looked up), resolves it itself, checks every resolved address
(so DNS rebinding to a private address fails), connects to exactly an address it
checked, and refuses a TLS SNI or Host header that disagrees with the target. Each
connection leaves one ConnectionRecord, the call's NetworkAccessObserved event.

It runs on one asyncio loop in its own thread; the call threads talk to it through
open_endpoint / close_endpoint."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import re
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import dns
from . import events as ev
from .egress import (Decision, EgressRules, IPAddress, decide_address, decide_host, host_addresses, normalize_host,
                     parse_ip)

log = logging.getLogger("sandboxd.proxy")

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0
# A connection that has not said what it wants within this long is closed.
FIRST_BYTE_TIMEOUT_S = 10.0
# Ports whose protocols let the server speak first (SSH, SMTP, FTP, POP, IMAP, MySQL):
# a tunnel there is relayed if the client stays silent for a second. Every other tunnel
# waits for the client's first bytes, so a delayed ClientHello is still checked.
SERVER_FIRST_PORTS = frozenset({21, 22, 25, 110, 143, 465, 587, 993, 995, 3306})
SERVER_FIRST_WAIT_S = 1.0
# Connections open at once across every endpoint: one sandbox must not take the
# daemon's file descriptors from the others.
MAX_CONNECTIONS_TOTAL = 4096
# Host-resolver lookups one sandbox may have running at once, and how long one may take.
DNS_LOOKUPS_PER_SANDBOX = 4
DNS_TIMEOUT_S = 5.0
# How long a finished connection may take to flush to a peer that reads slowly.
FLUSH_GRACE_S = 30.0
# Records without a destination (garbage, half a request) kept per call; the rest counted.
MAX_NAMELESS_RECORDS = 50
# Destinations summarized (with counts) once a call's records are full.
MAX_SUMMARIZED_DESTINATIONS = 1000
RELAY_CHUNK = 256 * 1024
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate",
                        "te", "trailer", "upgrade"})


@dataclass
class ConnectionRecord:
    """One attempt to reach something through the proxy."""

    protocol: str  # "http" | "connect" | "socks5"
    method: str = ""
    host: str = ""
    port: int = 0
    address: str = ""
    decision: str = "denied"  # "allowed" | "denied"
    rule: str = ""
    reason: str = ""
    error: str = ""
    status: int = 0  # what the proxy answered the client (200 for an established tunnel)
    bytes_up: int = 0  # sandbox -> destination
    bytes_down: int = 0  # destination -> sandbox
    started_at: str = field(default_factory=ev.utc_now)
    ended_at: str = ""

    def to_event(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol, "method": self.method, "host": self.host, "port": self.port,
            "address": self.address, "decision": self.decision, "rule": self.rule, "reason": self.reason,
            "error": self.error, "status": self.status, "bytesUp": self.bytes_up, "bytesDown": self.bytes_down,
            "startedAt": self.started_at, "endedAt": self.ended_at,
        }


@dataclass
class EgressEndpoint:
    sandbox_id: str
    socket_path: Path
    rules: EgressRules
    record_allowed: bool
    records: list[ConnectionRecord] = field(default_factory=list)
    dropped_records: int = 0
    nameless_records: int = 0
    # Past max_records: (host, port, decision) -> [attempts, bytes up, bytes down].
    overflow: dict[tuple[str, int, str], list[int]] = field(default_factory=dict)
    server: asyncio.base_events.Server | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)
    # Every transport of the endpoint (both sides): aborted when the sandbox ends.
    transports: set[asyncio.BaseTransport] = field(default_factory=set)
    dns_slots: asyncio.Semaphore | None = None


class ProxyRefusal(Exception):
    def __init__(self, status: int, rule: str, reason: str, decision: str = "denied"):
        super().__init__(reason)
        self.status, self.rule, self.reason, self.decision = status, rule, reason, decision


# ---------------------------------------------------------------- pure parsing


def parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(method, target, version, headers) of a request head ending in CRLFCRLF."""
    try:
        text = head.decode("iso-8859-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes any byte
        raise ProxyRefusal(400, "bad-request", "undecodable request head") from None
    lines = text.split("\r\n")
    if any("\n" in line or "\r" in line or "\0" in line for line in lines):
        # A bare line break would let the origin see a header this proxy never checked.
        raise ProxyRefusal(400, "bad-request", "a bare CR, LF or NUL inside the request head")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ProxyRefusal(400, "bad-request", "not an HTTP/1.x request line")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ProxyRefusal(400, "bad-request", f"malformed header line {line[:40]!r}")
        headers.append((name, value.strip()))
    return parts[0], parts[1], parts[2], headers


def split_host_port(authority: str, default_port: int | None) -> tuple[str, int]:
    """host and port of `host:port` / `[v6]:port`; the host normalized."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise ProxyRefusal(400, "bad-request", f"bad authority {authority!r}")
        host, rest = authority[1:end], authority[end + 1:]
        if rest and not rest.startswith(":"):
            raise ProxyRefusal(400, "bad-request", f"bad authority {authority!r}")
        port_text = rest[1:]
    elif authority.count(":") == 1:
        host, port_text = authority.split(":")
    elif ":" in authority:  # a bare IPv6 literal
        host, port_text = authority, ""
    else:
        host, port_text = authority, ""
    if not port_text:
        if default_port is None:
            raise ProxyRefusal(400, "bad-request", f"{authority!r} names no port")
        port = default_port
    else:
        if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
            raise ProxyRefusal(400, "bad-request", f"bad port in {authority!r}")
        port = int(port_text)
    return normalize_host(host), port


class IncompleteHello(ValueError):
    """The bytes start a TLS ClientHello that is not all there (or not well formed)."""


# A ClientHello must fit one TLS record (16 KiB of plaintext plus its header).
MAX_HELLO_RECORD = 5 + 16384


def looks_like_tls(data: bytes) -> bool:
    return bool(data) and data[0] == 0x16 and (len(data) < 2 or data[1] == 0x03)


def tls_client_hello_sni(data: bytes) -> tuple[bool, str | None]:
    """(is_tls, server_name) of the bytes a client sent first. is_tls is False for
    anything that is not a TLS handshake record; server_name is None when a complete
    ClientHello carries no SNI. A hello that is cut short, split over several records
    or malformed raises IncompleteHello: never a partial name."""
    if not looks_like_tls(data):
        return False, None
    if len(data) < 5:
        raise IncompleteHello("short record header")
    record_len = int.from_bytes(data[3:5], "big")
    if len(data) < 5 + record_len:
        raise IncompleteHello("the record is not all there yet")
    body = data[5:5 + record_len]

    def need(end: int) -> None:
        if end > len(body):
            raise IncompleteHello("the ClientHello does not fit its record")

    need(4)
    if body[0] != 0x01:  # not a ClientHello: no name to check, the server will refuse it
        return True, None
    need(4 + int.from_bytes(body[1:4], "big"))
    i = 4 + 2 + 32  # handshake header, version, random
    need(i + 1)
    i += 1 + body[i]  # session id
    need(i + 2)
    i += 2 + int.from_bytes(body[i:i + 2], "big")  # cipher suites
    need(i + 1)
    i += 1 + body[i]  # compression methods
    if i == 4 + int.from_bytes(body[1:4], "big"):
        return True, None  # no extensions at all
    need(i + 2)
    end = i + 2 + int.from_bytes(body[i:i + 2], "big")
    need(end)
    i += 2
    while i < end:
        need(i + 4)
        ext_type = int.from_bytes(body[i:i + 2], "big")
        ext_len = int.from_bytes(body[i + 2:i + 4], "big")
        need(i + 4 + ext_len)
        ext = body[i + 4:i + 4 + ext_len]
        if ext_type == 0:  # server_name: list length, then (type, length, name) entries
            j = 2
            while j + 3 <= len(ext):
                name_type, name_len = ext[j], int.from_bytes(ext[j + 1:j + 3], "big")
                if j + 3 + name_len > len(ext):
                    raise IncompleteHello("the server name does not fit its extension")
                if name_type == 0:
                    return True, ext[j + 3:j + 3 + name_len].decode("ascii", "replace")
                j += 3 + name_len
            return True, None
        i += 4 + ext_len
    return True, None


_HTTP_START = re.compile(rb"[A-Za-z]{1,20}(?: |$)")


def looks_like_http(data: bytes) -> bool:
    """The start of an HTTP request line (a method token, then a space or nothing yet)."""
    return bool(_HTTP_START.match(data[:21]))


def http_host_header(data: bytes) -> str | None:
    """The Host header of an HTTP request's first bytes, or None if they are not one."""
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    try:
        _, _, _, headers = parse_head(head)
    except ProxyRefusal:
        return None
    for name, value in headers:
        if name.lower() == "host":
            return value
    return None


def origin_form_request(method: str, url: str, version: str, headers: list[tuple[str, str]],
                        host: str, port: int) -> bytes:
    """The request as the destination sees it: origin-form target, no proxy or
    hop-by-hop headers, and one request per connection."""
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    connection_named = set()
    for name, value in headers:
        if name.lower() == "connection":
            connection_named |= {v.strip().lower() for v in value.split(",")}
    # Naming a framing header in Connection must not strip it: the body would become a request.
    connection_named -= {"content-length", "transfer-encoding", "host"}
    out = [f"{method} {path} {version}"]
    have_host = False
    for name, value in headers:
        low = name.lower()
        if low in HOP_BY_HOP or low in connection_named:
            continue
        if low == "host":
            have_host = True
        out.append(f"{name}: {value}")
    if not have_host:
        shown = f"[{host}]" if ":" in host else host
        out.append(f"Host: {shown}" + ("" if port == 80 else f":{port}"))
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("iso-8859-1")


# RFC 1928 reply codes for what the HTTP side answers with a status.
SOCKS5_REPLY_FOR_STATUS = {400: 0x07, 403: 0x02, 502: 0x05, 503: 0x01, 504: 0x04}


def socks5_reply(code: int) -> bytes:
    """A SOCKS5 reply; the bound address is not ours to tell (all zeros)."""
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


def request_body_limit(headers: list[tuple[str, str]]) -> int | None:
    """How many bytes after the head belong to the request: its Content-Length, 0 when
    there is no body, None for a chunked body (relayed as it comes). Anything past it
    would be a second request the proxy never checked, so it is not forwarded."""
    lengths = {v.strip() for k, v in headers if k.lower() == "content-length"}
    chunked = any(k.lower() == "transfer-encoding" for k, v in headers)
    if chunked and lengths:
        raise ProxyRefusal(400, "bad-request", "both Content-Length and Transfer-Encoding")
    if chunked:
        return None
    if len(lengths) > 1:
        raise ProxyRefusal(400, "bad-request", "conflicting Content-Length headers")
    if not lengths:
        return 0
    value = lengths.pop()
    if not (value.isascii() and value.isdigit()):
        raise ProxyRefusal(400, "bad-request", f"bad Content-Length {value!r}")
    return int(value)


def response_status(first: bytes) -> int:
    """The status code of an HTTP response's first bytes, 0 if they are not one."""
    parts = first[:64].split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit() and len(parts[1]) == 3:
        return int(parts[1])
    return 0


def refusal_response(status: int, rule: str, reason: str) -> bytes:
    phrase = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable",
              504: "Gateway Timeout"}.get(status, "Error")
    body = f"sandboxd egress proxy: {reason} (rule: {rule})\n".encode()
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"X-Sandboxd-Egress-Rule: {rule}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body


# ---------------------------------------------------------------- the server


class EgressProxy:
    def __init__(self, *, socket_dir: Path, host_overrides: dict[str, tuple[str, ...]],
                 system_dns: bool, dns_servers: tuple[str, ...] = (), exempt_networks: tuple[str, ...] = (), connect_timeout_s: float = 10.0,
                 max_connections: int = 256, max_records: int = 2000):
        self.socket_dir = socket_dir
        self.exempt = tuple(ipaddress.ip_network(n, strict=False) for n in exempt_networks)
        self._overrides = {normalize_host(k): tuple(v) for k, v in host_overrides.items()}
        self._system_dns = system_dns
        self._dns_servers = tuple(dns_servers)
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._max_records = max_records
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="egress-proxy", daemon=True)
        self._started = False
        self._open_connections = 0
        # The host resolver blocks: it gets threads of its own, and each endpoint at most
        # a few of them, so slow lookups from one sandbox never starve the others.
        self._resolver_pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="egress-dns")

    @classmethod
    def from_settings(cls, egress) -> "EgressProxy":
        return cls(socket_dir=egress.socket_dir, host_overrides=dict(egress.hosts),
                   system_dns=egress.system_dns, dns_servers=egress.dns_servers, exempt_networks=egress.exempt_networks,
                   connect_timeout_s=egress.connect_timeout_s, max_connections=egress.max_connections_per_sandbox,
                   max_records=egress.max_records_per_call)

    # -- lifecycle (any thread) ----------------------------------------------------
    def start(self) -> None:
        self.socket_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        # Ours, traversable, not listable: nsjail binds the socket as the sandbox user.
        os.chown(self.socket_dir, os.geteuid(), os.getegid())
        os.chmod(self.socket_dir, 0o711)
        for stale in self.socket_dir.glob("*.sock"):
            stale.unlink(missing_ok=True)
        self._thread.start()
        self._started = True

    def stop(self) -> None:
        if self._started:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._resolver_pool.shutdown(wait=False, cancel_futures=True)

    def socket_path(self, sandbox_id: str) -> Path:
        return self.socket_dir / f"{sandbox_id}.sock"

    def rules(self, allow_domains: tuple[str, ...], deny_private: bool, *, any_host: bool = False) -> EgressRules:
        # The host's addresses now: bridges and interfaces come and go.
        return EgressRules(allow_domains, deny_private, host_addresses(), self.exempt, any_host)

    def open_endpoint(self, sandbox_id: str, rules: EgressRules, *, uid: int, gid: int,
                      record_allowed: bool = True) -> EgressEndpoint:
        ep = EgressEndpoint(sandbox_id, self.socket_path(sandbox_id), rules, record_allowed)
        fut = asyncio.run_coroutine_threadsafe(self._open(ep, uid, gid), self._loop)
        fut.result(10)
        return ep

    def close_endpoint(self, ep: EgressEndpoint, timeout_s: float = 10.0) -> list[ConnectionRecord]:
        """Stops the endpoint and ends its open connections; its records, in start order."""
        fut = asyncio.run_coroutine_threadsafe(self._close(ep), self._loop)
        try:
            fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            log.error("closing the egress endpoint of %s timed out; its records so far are kept", ep.sandbox_id)
        return sorted(list(ep.records), key=lambda r: r.started_at)

    def take_records(self, ep: EgressEndpoint, timeout_s: float = 10.0
                     ) -> tuple[list[ConnectionRecord], int, dict[tuple[str, int, str], list[int]]]:
        """The endpoint's records so far (and what was only counted), leaving it empty:
        a warm sandbox's endpoint serves one command after another."""
        async def swap():
            out = (sorted(ep.records, key=lambda r: r.started_at), ep.dropped_records, dict(ep.overflow))
            ep.records, ep.dropped_records, ep.nameless_records, ep.overflow = [], 0, 0, {}
            return out

        return asyncio.run_coroutine_threadsafe(swap(), self._loop).result(timeout_s)

    # -- on the loop ----------------------------------------------------------------
    async def _open(self, ep: EgressEndpoint, uid: int, gid: int) -> None:
        ep.socket_path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(ep.socket_path))
            # Only the sandbox's user (and root) may connect.
            os.chown(ep.socket_path, uid, gid)
            os.chmod(ep.socket_path, 0o600)
            sock.listen(128)
        except BaseException:
            sock.close()
            ep.socket_path.unlink(missing_ok=True)
            raise
        ep.dns_slots = asyncio.Semaphore(DNS_LOOKUPS_PER_SANDBOX)
        ep.server = await asyncio.start_unix_server(lambda r, w: self._spawn(ep, r, w), sock=sock,
                                                    limit=MAX_HEAD_BYTES)

    def _spawn(self, ep: EgressEndpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Full: refused at once, before a task or a buffer exists for it.
        if len(ep.tasks) >= self._max_connections or self._open_connections >= MAX_CONNECTIONS_TOTAL:
            ep.dropped_records += 1
            writer.transport.abort()
            return
        # Our own task, held by the endpoint, so that closing it can cancel every connection.
        task = self._loop.create_task(self._handle(ep, reader, writer))
        ep.tasks.add(task)
        ep.transports.add(writer.transport)
        self._open_connections += 1

        def done(t: asyncio.Task) -> None:
            ep.tasks.discard(t)
            self._open_connections -= 1

        task.add_done_callback(done)

    async def _close(self, ep: EgressEndpoint) -> None:
        if ep.server is not None:
            ep.server.close()
        for task in list(ep.tasks):
            task.cancel()
        if ep.tasks:
            await asyncio.wait(list(ep.tasks), timeout=5)
        for t in ep.transports:
            t.abort()  # a connection still flushing to a peer that stopped reading
        ep.transports.clear()
        ep.socket_path.unlink(missing_ok=True)

    def _keep(self, ep: EgressEndpoint, rec: ConnectionRecord) -> None:
        rec.ended_at = ev.utc_now()
        if rec.decision == "allowed" and not ep.record_allowed:
            return
        if not rec.host:
            # Garbage names nothing: a few are kept as evidence, the rest only counted,
            # so a flood of them cannot push real attempts out of the record.
            ep.nameless_records += 1
            if ep.nameless_records > MAX_NAMELESS_RECORDS:
                ep.dropped_records += 1
                return
        if len(ep.records) < self._max_records:
            ep.records.append(rec)
            return
        ep.dropped_records += 1
        key = (rec.host, rec.port, rec.decision)
        if key in ep.overflow or len(ep.overflow) < MAX_SUMMARIZED_DESTINATIONS:
            counts = ep.overflow.setdefault(key, [0, 0, 0])
            counts[0] += 1
            counts[1] += rec.bytes_up
            counts[2] += rec.bytes_down

    async def _handle(self, ep: EgressEndpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rec = ConnectionRecord(protocol="http")
        upstream: asyncio.StreamWriter | None = None
        silent = False
        try:
            try:
                first = await asyncio.wait_for(reader.readexactly(1), FIRST_BYTE_TIMEOUT_S)
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                silent = True  # connected and never said a word: nothing was attempted
                return
            if first == b"\x05":
                rec.protocol, rec.method = "socks5", "CONNECT"
                await asyncio.wait_for(self._socks5_request(rec, reader, writer), HEAD_TIMEOUT_S)
                upstream_reader, upstream = await self._connect(ep, rec)
                rec.decision, rec.status = "allowed", 200
                writer.write(socks5_reply(0))
                await writer.drain()
                await self._check_first_bytes(rec, reader, upstream)
                await self._relay(rec, reader, writer, upstream_reader, upstream)
                return
            try:
                head = first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                raise ProxyRefusal(400, "bad-request", "no complete request head") from None
            method, target, version, headers = parse_head(head[:-4])
            rec.method = method
            if method == "CONNECT":
                rec.protocol = "connect"
                rec.host, rec.port = split_host_port(target, None)
            elif target.lower().startswith("http://"):
                parts = urlsplit(target)
                rec.host, rec.port = split_host_port(parts.netloc.rpartition("@")[2], 80)
                hosts = [value for name, value in headers if name.lower() == "host"]
                if len(hosts) > 1:
                    raise ProxyRefusal(400, "bad-request", "more than one Host header")
                if hosts and split_host_port(hosts[0], 80) != (rec.host, rec.port):
                    raise ProxyRefusal(403, "host-mismatch",
                                       f"Host header {hosts[0]!r} disagrees with the request target {rec.host}")
            elif target.lower().startswith("https://"):
                raise ProxyRefusal(400, "bad-request", "https:// URLs go through CONNECT")
            else:
                raise ProxyRefusal(400, "bad-request", "this is a proxy: requests need an absolute http:// URL or CONNECT")
            upstream_reader, upstream = await self._connect(ep, rec)
            rec.decision = "allowed"
            body_limit: int | None = None
            if rec.protocol == "connect":
                rec.status = 200
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                await self._check_first_bytes(rec, reader, upstream)
            else:
                request = origin_form_request(method, target, version, headers, rec.host, rec.port)
                upstream.write(request)
                rec.bytes_up += len(request)
                body_limit = request_body_limit(headers)
            await self._relay(rec, reader, writer, upstream_reader, upstream, body_limit)
        except ProxyRefusal as refusal:
            rec.decision, rec.rule, rec.reason = refusal.decision, refusal.rule, refusal.reason
            rec.status = refusal.status or rec.status
            if refusal.decision == "allowed":
                rec.error = refusal.reason
            if refusal.status:
                try:
                    if rec.protocol == "socks5":
                        writer.write(socks5_reply(SOCKS5_REPLY_FOR_STATUS.get(refusal.status, 1)))
                    else:
                        writer.write(refusal_response(refusal.status, refusal.rule, refusal.reason))
                    await writer.drain()
                except (ConnectionError, RuntimeError):
                    pass
        except asyncio.CancelledError:
            rec.error = rec.error or "the sandbox ended"
        except (ConnectionError, OSError) as exc:
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
        finally:
            for w in (writer, upstream):
                if w is not None:
                    _close_soon(w.transport)
            if not silent:
                self._keep(ep, rec)

    async def _socks5_request(self, rec: ConnectionRecord, reader: asyncio.StreamReader,
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

    async def _connect(self, ep: EgressEndpoint, rec: ConnectionRecord
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        rules = ep.rules
        decision: Decision = decide_host(rec.host, rules)
        if not decision.allowed:
            raise ProxyRefusal(403, decision.rule, decision.reason)
        rec.rule = decision.rule
        assert ep.dns_slots is not None
        async with ep.dns_slots:
            addresses = await self._resolve(rec)
        permitted: list[IPAddress] = []
        first_refusal: Decision | None = None
        for ip in addresses:
            verdict = decide_address(ip, rules)
            if verdict.allowed:
                permitted.append(ip)
            elif first_refusal is None:
                first_refusal = verdict
                rec.address = str(ip)
        if not permitted:
            assert first_refusal is not None
            raise ProxyRefusal(403, first_refusal.rule, f"{rec.host} resolves to {first_refusal.reason}")
        last_error = ""
        for ip in permitted:
            rec.address = str(ip)
            try:
                # Exactly the checked address: no second lookup that DNS could answer differently.
                connected = await asyncio.wait_for(asyncio.open_connection(str(ip), rec.port, limit=RELAY_CHUNK),
                                                   self._connect_timeout_s)
                ep.transports.add(connected[1].transport)
                return connected
            except (OSError, TimeoutError) as exc:
                last_error = f"{ip} port {rec.port}: {exc or type(exc).__name__}"
        raise ProxyRefusal(502, rec.rule, f"cannot connect to {rec.host}: {last_error}", decision="allowed")

    async def _resolve(self, rec: ConnectionRecord) -> list[IPAddress]:
        literal = parse_ip(rec.host)
        if literal is not None:
            return [literal]
        if rec.host in self._overrides:
            return [ipaddress.ip_address(a) for a in self._overrides[rec.host]]
        if self._dns_servers:
            try:
                found = await dns.resolve(rec.host, self._dns_servers)
            except dns.DNSError as exc:
                raise ProxyRefusal(502, rec.rule, str(exc), decision="allowed") from None
            if not found:
                raise ProxyRefusal(502, rec.rule, f"{rec.host} has no address", decision="allowed")
            return found
        if not self._system_dns:
            raise ProxyRefusal(502, rec.rule, f"{rec.host} is not in the proxy's host table", decision="allowed")
        try:
            # Fully qualified ("name."), so the host's search domains are never appended.
            infos = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                self._resolver_pool, socket.getaddrinfo, rec.host + ".", rec.port, 0, socket.SOCK_STREAM),
                DNS_TIMEOUT_S)
        except (socket.gaierror, TimeoutError) as exc:
            raise ProxyRefusal(502, rec.rule, f"cannot resolve {rec.host}: {exc or 'timed out'}",
                               decision="allowed") from None
        out: list[IPAddress] = []
        for info in infos:
            ip = ipaddress.ip_address(info[4][0].split("%")[0])
            if ip not in out:
                out.append(ip)
        return out

    async def _check_first_bytes(self, rec: ConnectionRecord, reader: asyncio.StreamReader,
                                 upstream: asyncio.StreamWriter) -> None:
        """The tunnel's first bytes may name a host (TLS SNI, an HTTP Host header); one
        that disagrees with the CONNECT target ends the tunnel before a byte is passed.
        The check fails closed: a hello or head that never completes, an HTTP head this
        proxy cannot read, more than one Host, or an absolute-form target are refused.
        Only on ports where the server speaks first may a silent client be relayed."""
        wait = SERVER_FIRST_WAIT_S if rec.port in SERVER_FIRST_PORTS else HEAD_TIMEOUT_S
        try:
            first = await asyncio.wait_for(reader.read(RELAY_CHUNK), wait)
        except TimeoutError:
            if rec.port in SERVER_FIRST_PORTS:
                return  # the server speaks first (SSH, SMTP): nothing names a host
            raise ProxyRefusal(0, "unreadable-first-bytes", f"the client sent nothing for {wait:.0f} s") from None
        if not first:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HEAD_TIMEOUT_S

        async def more(why: str, limit: int) -> bytes:
            if len(first) >= limit:
                raise ProxyRefusal(0, "unreadable-first-bytes", why)
            try:
                data = await asyncio.wait_for(reader.read(RELAY_CHUNK), max(0.0, deadline - loop.time()))
            except TimeoutError:
                data = b""
            if not data:
                raise ProxyRefusal(0, "unreadable-first-bytes", why)
            return data

        named: str | None = None
        what = ""
        named_host = None
        # Servers skip empty lines before a request line (RFC 9112 2.2): so does the check.
        while first.strip(b"\r\n") == b"" and len(first) < MAX_HEAD_BYTES:
            first += await more("only empty lines", MAX_HEAD_BYTES)
        text = first.lstrip(b"\r\n")
        if looks_like_tls(first):
            while True:
                try:
                    _, named = tls_client_hello_sni(first)
                    break
                except IncompleteHello as exc:
                    record_done = len(first) >= 5 and len(first) >= 5 + int.from_bytes(first[3:5], "big")
                    if record_done:
                        raise ProxyRefusal(0, "unreadable-first-bytes", f"TLS ClientHello: {exc}") from None
                    first += await more(f"TLS ClientHello: {exc}", MAX_HELLO_RECORD)
            what = "TLS SNI"
            named_host = normalize_host(named) if named is not None else None
        elif looks_like_http(text):
            while b"\r\n\r\n" not in first:
                first += await more("an HTTP request head that never ends", MAX_HEAD_BYTES)
            text = first.lstrip(b"\r\n")
            try:
                _, target, _, headers = parse_head(text.partition(b"\r\n\r\n")[0])
            except ProxyRefusal as exc:
                # What this proxy cannot read, an origin might read differently: refused.
                raise ProxyRefusal(0, "unreadable-first-bytes", f"HTTP request head: {exc.reason}") from None
            if not (target.startswith("/") or target == "*"):
                # An absolute-form target is routed by its URL, whatever Host says.
                raise ProxyRefusal(0, "host-mismatch", f"request target {target[:80]!r} inside a tunnel")
            hosts = [v for k, v in headers if k.lower() == "host"]
            if len(hosts) > 1:
                raise ProxyRefusal(0, "host-mismatch", "more than one Host header inside a tunnel")
            named = hosts[0] if hosts else None
            what = "Host header"
            named_host = split_host_port(named, rec.port)[0] if named is not None else None
        if named_host is not None and named_host != rec.host:
            raise ProxyRefusal(0, "sni-mismatch" if what == "TLS SNI" else "host-mismatch",
                               f"{what} {named!r} disagrees with the CONNECT target {rec.host}")
        upstream.write(first)
        rec.bytes_up += len(first)

    async def _relay(self, rec: ConnectionRecord, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     upstream_reader: asyncio.StreamReader, upstream: asyncio.StreamWriter,
                     up_limit: int | None = None) -> None:
        """Past the checks, bytes only: the transports are handed to two small protocols
        that write what one side receives straight into the other (no stream buffers),
        with back-pressure from each side's write buffer to the other's reading.
        `up_limit` caps what goes upstream (a plain HTTP request's declared body)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        client_t, up_t = writer.transport, upstream.transport
        to_up = _Pipe(rec, up=True, done=done, limit=up_limit)
        to_client = _Pipe(rec, up=False, done=done)
        to_up.pair(sink=up_t, source=client_t, peer=to_client)
        to_client.pair(sink=client_t, source=up_t, peer=to_up)
        # What the stream readers already buffered goes first.
        for stream_reader, pipe in ((reader, to_up), (upstream_reader, to_client)):
            buffered = bytes(stream_reader._buffer)  # noqa: SLF001 - handing the transport over
            stream_reader._buffer.clear()  # noqa: SLF001
            eof = stream_reader.at_eof() or stream_reader._eof  # noqa: SLF001
            if buffered:
                pipe.data_received(buffered)
            if eof:
                pipe.eof_received()
        client_t.set_protocol(_Sink(to_up))
        up_t.set_protocol(_Sink(to_client))
        for t in (client_t, up_t):
            if not t.is_closing():
                t.resume_reading()
        await done


class _Pipe:
    """One direction of a tunnel: what `source` delivers is written to `sink`."""

    def __init__(self, rec: ConnectionRecord, *, up: bool, done: asyncio.Future, limit: int | None = None):
        self.rec, self.up, self.done = rec, up, done
        self.finished = False
        self.left = limit  # bytes still allowed through; None: no limit

    def pair(self, *, sink: asyncio.Transport, source: asyncio.Transport, peer: "_Pipe") -> None:
        self.sink, self.source, self.peer = sink, source, peer

    def data_received(self, data: bytes) -> None:
        if self.left is not None:
            data = data[:self.left]  # past the declared body: dropped, never forwarded
            self.left -= len(data)
            if not data:
                return
        if self.up:
            self.rec.bytes_up += len(data)
        else:
            if self.rec.protocol == "http" and not self.rec.bytes_down:
                self.rec.status = response_status(data)
            self.rec.bytes_down += len(data)
        if not self.sink.is_closing():
            self.sink.write(data)

    def eof_received(self) -> None:
        self.finished = True
        if not self.sink.is_closing() and self.sink.can_write_eof():
            self.sink.write_eof()
        if self.peer.finished:
            self._end()

    def lost(self) -> None:
        """The source is gone: nothing more will flow either way."""
        self.finished = self.peer.finished = True
        self._end()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class _Sink(asyncio.Protocol):
    """The protocol of the transport that feeds `pipe`; its own write buffer filling
    up pauses the other side's reading."""

    def __init__(self, pipe: _Pipe):
        self.pipe = pipe

    def data_received(self, data: bytes) -> None:
        self.pipe.data_received(data)

    def eof_received(self) -> bool:
        self.pipe.eof_received()
        return True  # keep our writing side open: the other direction may still flow

    def connection_lost(self, exc) -> None:
        self.pipe.lost()

    def pause_writing(self) -> None:
        # Our transport (the sink of the peer pipe) is full: stop reading its source.
        self.pipe.peer.source.pause_reading()

    def resume_writing(self) -> None:
        if not self.pipe.peer.source.is_closing():
            self.pipe.peer.source.resume_reading()


def _close_soon(transport: asyncio.BaseTransport) -> None:
    """Closes after flushing what is buffered, but never waits on the peer for long."""
    if transport.is_closing() and not transport.get_write_buffer_size():
        return
    transport.close()
    if transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(FLUSH_GRACE_S, transport.abort)


def summarize_external_calls(records: list[ConnectionRecord],
                             overflow: dict[tuple[str, int, str], list[int]] | None = None) -> list[str]:
    """ToolResult.effectsObserved.externalCalls: each destination the call reached, once
    (including those past the record's size, counted in `overflow`)."""
    seen: list[str] = []
    for r in records:
        # Reached: allowed and bytes moved (a tunnel cut when the sandbox ended counts).
        if r.decision == "allowed" and (not r.error or r.bytes_up or r.bytes_down):
            dest = f"{r.host}:{r.port}" if ":" not in r.host else f"[{r.host}]:{r.port}"
            if dest not in seen:
                seen.append(dest)
    for (host, port, decision), (_, up, down) in sorted((overflow or {}).items()):
        dest = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if decision == "allowed" and (up or down) and dest not in seen:
            seen.append(dest)
    return seen
