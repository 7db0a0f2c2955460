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
checked, and refuses a TLS SNI or Host header that disagrees with the target. Requests
are framed by a real HTTP/1.1 parser and re-serialized (proxy_http.py); a tunnel
carries TLS (its SNI checked), plain HTTP (every request's Host checked), or a
protocol whose server speaks first, and is closed on anything else. Each connection
leaves one ConnectionRecord, the call's NetworkAccessObserved event.

Nothing a sandbox sends is waited on without a bound: every request head (the first,
and each one inside a tunnel), SOCKS5 request, TLS ClientHello, chunk-size line and
trailer must be whole within head_timeout_s of its first byte; a relayed connection
on which nothing moves for relay_idle_timeout_s is closed; a lookup (its wait for one
of the sandbox's resolver slots included) has DNS_TIMEOUT_S, and a slot is held until
its resolver thread really returns.

It runs on one asyncio loop in its own thread; the call threads talk to it through
open_endpoint / close_endpoint."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from sandboxd.egress import dns
from sandboxd.ledger import events as ev
from sandboxd.policy.egress_rules import (Decision, EgressRules, IPAddress, decide_address, decide_host, host_addresses,
                                          normalize_host, normalize_pattern, parse_ip)
from sandboxd.egress.http import (HOP_BY_HOP, MAX_HEAD_BYTES, MAX_RECORDED_METHOD_CHARS, SOCKS5_REPLY_FOR_STATUS, BodyFramer,
                         ProxyRefusal, origin_form_request, parse_head, parse_proxy_target, parse_request,
                         refusal_response, response_status, socks5_reply, split_host_port)
from sandboxd.egress.records import ConnectionRecord, EgressEndpoint, summarize_external_calls
from sandboxd.egress.relay import FLUSH_GRACE_S, RELAY_IDLE_TIMEOUT_S, close_soon, relay
from sandboxd.egress.tls import MAX_HELLO_RECORD, IncompleteHello, looks_like_tls, tls_client_hello_sni
from sandboxd.egress.tunnel import HEAD_TIMEOUT_S, RELAY_CHUNK, check_first_bytes, note_request_line, read_socks5_request

# Re-exported: the proxy's pure parts live in proxy_http, proxy_tls, proxy_records.
__all__ = [
    "FLUSH_GRACE_S", "HOP_BY_HOP", "MAX_HEAD_BYTES", "MAX_HELLO_RECORD", "ConnectionRecord", "EgressEndpoint",
    "EgressProxy", "IncompleteHello", "ProxyRefusal", "looks_like_tls", "origin_form_request", "parse_head",
    "refusal_response", "response_status", "split_host_port", "summarize_external_calls", "tls_client_hello_sni",
]

log = logging.getLogger("sandboxd.egress.proxy")

# A connection that has not said what it wants within this long is closed.
FIRST_BYTE_TIMEOUT_S = 10.0
# Connections open at once across every endpoint: one sandbox must not take the
# daemon's file descriptors from the others.
MAX_CONNECTIONS_TOTAL = 4096
# Host-resolver lookups one sandbox may have running at once, and how long one may take.
DNS_LOOKUPS_PER_SANDBOX = 4
DNS_TIMEOUT_S = 5.0
# Records without a destination (garbage, half a request) kept per call; the rest counted.
MAX_NAMELESS_RECORDS = 50
# Destinations summarized (with counts) once a call's records are full.
MAX_SUMMARIZED_DESTINATIONS = 1000


@dataclass
class _Link:
    """The upstream side of one proxied connection, once there is one."""

    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None


# ---------------------------------------------------------------- the server


class EgressProxy:
    def __init__(self, *, socket_dir: Path, host_overrides: dict[str, tuple[str, ...]],
                 system_dns: bool, dns_servers: tuple[str, ...] = (), exempt_networks: tuple[str, ...] = (), connect_timeout_s: float = 10.0,
                 max_connections: int = 256, max_records: int = 2000, head_timeout_s: float = HEAD_TIMEOUT_S,
                 relay_idle_timeout_s: float = RELAY_IDLE_TIMEOUT_S):
        self.socket_dir = socket_dir
        self.exempt = tuple(ipaddress.ip_network(n, strict=False) for n in exempt_networks)
        self._overrides = {normalize_host(k): tuple(v) for k, v in host_overrides.items()}
        self._system_dns = system_dns
        self._dns_servers = tuple(dns_servers)
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._max_records = max_records
        self._head_timeout_s = head_timeout_s
        self._relay_idle_timeout_s = relay_idle_timeout_s
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
                   max_records=egress.max_records_per_call, head_timeout_s=egress.head_timeout_s,
                   relay_idle_timeout_s=egress.relay_idle_timeout_s)

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
        # Checked again where they are used (ValueError): a pattern that reached the proxy
        # without admission's check still never admits a public suffix's names.
        patterns = tuple(normalize_pattern(p) for p in allow_domains)
        # The host's addresses now: bridges and interfaces come and go.
        return EgressRules(patterns, deny_private, host_addresses(), self.exempt, any_host)

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
            cast(asyncio.WriteTransport, t).abort()  # a connection still flushing to a peer that stopped reading
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
        """One connection, one record. Nothing a sandbox sends may end here with an
        exception: every attempt gets an answer (while none was given) and a record."""
        rec = ConnectionRecord(protocol="http")
        link = _Link()
        silent = False
        try:
            try:
                first = await asyncio.wait_for(reader.readexactly(1), FIRST_BYTE_TIMEOUT_S)
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                silent = True  # connected and never said a word: nothing was attempted
                return
            if first == b"\x05":
                await self._serve_socks5(ep, rec, link, reader, writer)
            else:
                await self._serve_http(ep, rec, link, first, reader, writer)
        except ProxyRefusal as refusal:
            await self._answer_refusal(rec, writer, refusal)
        except asyncio.CancelledError:
            rec.error = rec.error or "the sandbox ended"
        except (ConnectionError, OSError) as exc:
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a bug must cost one attempt, never the handler
            ep.unexpected_errors += 1
            # Once in full per endpoint: a sandbox repeating the input must not flood the log.
            log.warning("egress proxy: unexpected error on %s's endpoint (%d so far)", ep.sandbox_id,
                        ep.unexpected_errors, exc_info=ep.unexpected_errors == 1)
            rec.error = f"internal error: {type(exc).__name__}"
            status = 0 if (rec.status or rec.bytes_down) else 400
            await self._answer_refusal(rec, writer, ProxyRefusal(status, "bad-request", "the request could not be read"))
        finally:
            for w in (writer, link.writer):
                if w is not None:
                    close_soon(w.transport)
            if not silent:
                self._keep(ep, rec)

    async def _answer_refusal(self, rec: ConnectionRecord, writer: asyncio.StreamWriter, refusal: ProxyRefusal) -> None:
        rec.decision, rec.rule, rec.reason = refusal.decision, refusal.rule, refusal.reason
        rec.status = refusal.status or rec.status
        if refusal.decision == "allowed":
            rec.error = rec.error or refusal.reason
        if not refusal.status:
            return
        try:
            if rec.protocol == "socks5":
                writer.write(socks5_reply(SOCKS5_REPLY_FOR_STATUS.get(refusal.status, 1)))
            else:
                writer.write(refusal_response(refusal.status, refusal.rule, refusal.reason))
            await writer.drain()
        except (ConnectionError, RuntimeError):
            pass

    async def _serve_socks5(self, ep: EgressEndpoint, rec: ConnectionRecord, link: _Link,
                            reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rec.protocol, rec.method = "socks5", "CONNECT"
        try:
            await asyncio.wait_for(read_socks5_request(rec, reader, writer), self._head_timeout_s)
        except TimeoutError:
            raise ProxyRefusal(0, "head-timeout", f"the SOCKS5 request was not complete within "
                               f"{self._head_timeout_s:g} s of its first byte") from None
        link.reader, link.writer = await self._connect(ep, rec)
        rec.decision, rec.status = "allowed", 200
        writer.write(socks5_reply(0))
        await writer.drain()
        await self._tunnel(rec, link, reader, writer)

    async def _tunnel(self, rec: ConnectionRecord, link: _Link, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """An established tunnel (CONNECT or SOCKS5): its first bytes checked, then relayed."""
        assert link.reader is not None and link.writer is not None
        framer = await check_first_bytes(rec, reader, link.writer, self._head_timeout_s)
        await relay(rec, reader, writer, link.reader, link.writer, framer, head_timeout_s=self._head_timeout_s,
                    idle_timeout_s=self._relay_idle_timeout_s)

    async def _serve_http(self, ep: EgressEndpoint, rec: ConnectionRecord, link: _Link, first: bytes,
                          reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A proxy request (CONNECT or absolute-form http://), exactly one per connection."""
        try:
            head = first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._head_timeout_s)
        except TimeoutError:
            note_request_line(rec, first + bytes(reader._buffer))  # type: ignore[attr-defined]  # noqa: SLF001
            raise ProxyRefusal(408, "head-timeout", f"the request head was not complete within "
                               f"{self._head_timeout_s:g} s of its first byte") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
            partial = getattr(exc, "partial", b"")
            note_request_line(rec, first + (partial if isinstance(partial, bytes) else b""))
            raise ProxyRefusal(400, "bad-request", "no complete request head") from None
        note_request_line(rec, head)  # for the record, should the head be refused
        req = parse_request(head[:-4])
        rec.method = req.method[:MAX_RECORDED_METHOD_CHARS]
        if req.method == "CONNECT":
            rec.protocol = "connect"
            rec.host, rec.port = split_host_port(req.target, None)
            if req.chunked or req.length:
                raise ProxyRefusal(400, "bad-request", "a CONNECT request with a body")
            link.reader, link.writer = await self._connect(ep, rec)
            rec.decision, rec.status = "allowed", 200
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await self._tunnel(rec, link, reader, writer)
            return
        if req.target[:8].lower() == "https://":
            raise ProxyRefusal(400, "bad-request", "https:// URLs go through CONNECT")
        rec.host, rec.port, path = parse_proxy_target(req.target)
        hosts = req.values("host")
        if len(hosts) > 1:
            raise ProxyRefusal(400, "bad-request", "more than one Host header")
        if hosts and split_host_port(hosts[0], 80) != (rec.host, rec.port):
            raise ProxyRefusal(403, "host-mismatch",
                               f"Host header {hosts[0][:80]!r} disagrees with the request target {rec.host}")
        link.reader, link.writer = await self._connect(ep, rec)
        rec.decision = "allowed"
        request = origin_form_request(req, rec.host, rec.port, path)
        link.writer.write(request)
        rec.bytes_up += len(request)
        body = BodyFramer(req, self._loop.time)
        try:
            await relay(rec, reader, writer, link.reader, link.writer, body, head_timeout_s=self._head_timeout_s,
                        idle_timeout_s=self._relay_idle_timeout_s)
        except ProxyRefusal as refusal:
            if rec.bytes_down:  # an answer is on its way already: only the record says why it was cut
                refusal.status = 0
            raise
        finally:
            if body.extra:
                rec.error = rec.error or (f"{body.extra} bytes after the end of the request were not forwarded "
                                          "(one request per connection)")

    async def _connect(self, ep: EgressEndpoint, rec: ConnectionRecord
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        rules = ep.rules
        decision: Decision = decide_host(rec.host, rules)
        if not decision.allowed:
            raise ProxyRefusal(403, decision.rule, decision.reason)
        rec.rule = decision.rule
        addresses = await self._resolve(ep, rec)
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

    async def _resolve(self, ep: EgressEndpoint, rec: ConnectionRecord) -> list[IPAddress]:
        literal = parse_ip(rec.host)
        if literal is not None:
            return [literal]
        if rec.host in self._overrides:
            return [ipaddress.ip_address(a) for a in self._overrides[rec.host]]
        if not self._dns_servers and not self._system_dns:
            raise ProxyRefusal(502, rec.rule, f"{rec.host} is not in the proxy's host table", decision="allowed")
        # One deadline for the whole lookup, the wait for one of the sandbox's slots included.
        deadline = self._loop.time() + DNS_TIMEOUT_S
        slots = ep.dns_slots
        assert slots is not None
        try:
            await asyncio.wait_for(slots.acquire(), DNS_TIMEOUT_S)
        except TimeoutError:
            raise ProxyRefusal(502, rec.rule, f"cannot resolve {rec.host}: the sandbox's {DNS_LOOKUPS_PER_SANDBOX} "
                               f"lookups at a time were all still running after {DNS_TIMEOUT_S:g} s",
                               decision="allowed") from None
        if self._dns_servers:
            try:
                found = await asyncio.wait_for(dns.resolve(rec.host, self._dns_servers),
                                               max(0.0, deadline - self._loop.time()))
            except dns.DNSError as exc:
                raise ProxyRefusal(502, rec.rule, str(exc), decision="allowed") from None
            except TimeoutError:
                raise ProxyRefusal(502, rec.rule, f"cannot resolve {rec.host}: no answer within {DNS_TIMEOUT_S:g} s",
                                   decision="allowed") from None
            finally:
                slots.release()
            if not found:
                raise ProxyRefusal(502, rec.rule, f"{rec.host} has no address", decision="allowed")
            return found
        try:
            # Fully qualified ("name."), so the host's search domains are never appended.
            lookup = self._loop.run_in_executor(self._resolver_pool, socket.getaddrinfo, rec.host + ".", rec.port, 0,
                                                socket.SOCK_STREAM)
        except BaseException:
            slots.release()
            raise

        def thread_done(f: asyncio.Future) -> None:
            # The slot is the thread's: a lookup given up on holds it until getaddrinfo
            # returns, so one sandbox never blocks more than its share of the pool.
            slots.release()
            if not f.cancelled():
                f.exception()  # retrieved: nobody may be waiting for it any more

        lookup.add_done_callback(thread_done)
        try:
            infos = await asyncio.wait_for(asyncio.shield(lookup), max(0.0, deadline - self._loop.time()))
        except (socket.gaierror, TimeoutError) as exc:
            raise ProxyRefusal(502, rec.rule, f"cannot resolve {rec.host}: {exc or 'timed out'}",
                               decision="allowed") from None
        out: list[IPAddress] = []
        for info in infos:
            ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            if ip not in out:
                out.append(ip)
        return out
