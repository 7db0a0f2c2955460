"""TLS for the egress proxy, pure: the server name a CONNECT tunnel's first TLS record
asks for (the ClientHello's SNI), so that a tunnel to an allowed host cannot be used
for another name on the same address. Never a partial name: a hello that is cut short
or malformed says so, and the proxy fails closed."""

from __future__ import annotations


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
