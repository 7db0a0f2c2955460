"""A minimal DNS stub resolver for the egress proxy: A and AAAA over UDP to the servers
the operator names. The proxy only ever asks about names the call's allowDomains admit,
so what reaches a resolver is never chosen by the sandbox alone."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import struct

from sandboxd.core.settings import parse_server
from sandboxd.policy.egress_rules import IPAddress

TYPE_A = 1
TYPE_AAAA = 28
CLASS_IN = 1


class DNSError(Exception):
    pass


def encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DNSError(f"bad label in {name!r}")
        out += bytes([len(raw)]) + raw
    return bytes(out) + b"\0"


def build_query(name: str, qtype: int, txid: int) -> bytes:
    """A recursive query for one name and type."""
    header = struct.pack("!HHHHHH", txid, 0x0100, 1, 0, 0, 0)
    return header + encode_name(name) + struct.pack("!HH", qtype, CLASS_IN)


def _skip_name(data: bytes, i: int) -> int:
    while True:
        if i >= len(data):
            raise DNSError("truncated name")
        n = data[i]
        if n == 0:
            return i + 1
        if n & 0xC0 == 0xC0:  # a compression pointer ends the name
            return i + 2
        i += 1 + n


def parse_response(data: bytes, txid: int, qtype: int) -> list[IPAddress]:
    """The addresses of type `qtype` in a response to query `txid`. An answer to another
    query, a failure code or a malformed message raises DNSError."""
    if len(data) < 12:
        raise DNSError("short response")
    rid, flags, qd, an, _, _ = struct.unpack("!HHHHHH", data[:12])
    if rid != txid or not flags & 0x8000:
        raise DNSError("not the response to our query")
    rcode = flags & 0x000F
    if rcode == 3:
        return []  # NXDOMAIN
    if rcode != 0:
        raise DNSError(f"server answered rcode {rcode}")
    i = 12
    for _ in range(qd):
        i = _skip_name(data, i) + 4
    out: list[IPAddress] = []
    for _ in range(an):
        i = _skip_name(data, i)
        if i + 10 > len(data):
            raise DNSError("truncated answer")
        rtype, rclass, _ttl, rdlen = struct.unpack("!HHIH", data[i:i + 10])
        i += 10
        rdata = data[i:i + rdlen]
        if len(rdata) != rdlen:
            raise DNSError("truncated record")
        i += rdlen
        if rclass == CLASS_IN and rtype == qtype == TYPE_A and rdlen == 4:
            out.append(ipaddress.IPv4Address(rdata))
        elif rclass == CLASS_IN and rtype == qtype == TYPE_AAAA and rdlen == 16:
            out.append(ipaddress.IPv6Address(rdata))
    return out


class _OneAnswer(asyncio.DatagramProtocol):
    def __init__(self, txid: int, qtype: int):
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._txid, self._qtype = txid, qtype

    def datagram_received(self, data: bytes, addr) -> None:
        if self.done.done():
            return
        try:
            self.done.set_result(parse_response(data, self._txid, self._qtype))
        except DNSError:
            pass  # not ours, or garbage: keep waiting for the real answer

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


async def resolve(name: str, servers: tuple[str, ...], timeout_s: float = 2.0) -> list[IPAddress]:
    """A then AAAA records of `name`, from the first server that answers. Both questions
    go at once, so a server that does not answer costs timeout_s, not twice that (the
    proxy holds the whole lookup to one deadline)."""
    last: BaseException | None = None
    for server in servers:
        host, port = parse_server(server)
        out: list[IPAddress] = []
        answered = False
        answers = await asyncio.gather(*(_ask(host, port, name, qtype, timeout_s) for qtype in (TYPE_A, TYPE_AAAA)),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, (OSError, TimeoutError, DNSError)):
                last = answer
            elif isinstance(answer, BaseException):
                raise answer
            else:
                out += answer
                answered = True
        if answered:
            return out  # an answer to either question will do (none: the name has no address)
    raise DNSError(f"no DNS server answered for {name}: {last}")


async def _ask(host: str, port: int, name: str, qtype: int, timeout_s: float) -> list[IPAddress]:
    loop = asyncio.get_running_loop()
    txid = secrets.randbelow(1 << 16)
    transport, proto = await loop.create_datagram_endpoint(lambda: _OneAnswer(txid, qtype),
                                                           remote_addr=(host, port))
    try:
        transport.sendto(build_query(name, qtype, txid))
        return await asyncio.wait_for(proto.done, timeout_s)
    finally:
        transport.close()
