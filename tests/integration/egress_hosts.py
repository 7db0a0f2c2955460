"""The "remote" hosts of the egress tests: servers in a network namespace the test run
creates, on a veth pair of its own. Nothing here ever talks to an address it did not
make. Run as a script (inside the namespace) it is the servers:

  main    .2:80  HTTP, .2:443 HTTPS, .2:53/udp DNS   allowed.test
  other   .3:80  HTTP, .3:443 HTTPS                    other.test (must never be reached
                                                       through a tunnel to allowed.test)
  lenient .2:8080 HTTP, keep-alive, read as leniently as the most forgiving origins
                  (leading white space, any white space between the parts of a request
                  line, bare LFs, folded lines, Transfer-Encoding only if it says
                  "chunked" somewhere, else Content-Length): every request it reads is
                  logged, so a smuggled second request would show.

GET /bytes/N answers N bytes of body. Every connection and every DNS question is
logged as one JSON line (with the exact bytes read and written on the TCP socket),
so a test can compare what the servers saw with what the proxy recorded."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    from .netns import add_namespace, json_lines, remove_namespace, self_signed, serve_in
except ImportError:  # run as a script inside the namespace: its servers need none of it
    from netns import add_namespace, json_lines, remove_namespace, self_signed, serve_in  # type: ignore[no-redef]


# ---------------------------------------------------------------- the servers (in the netns)


class Log:
    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, **entry) -> None:
        with self._lock:
            self._f.write(json.dumps(entry) + "\n")


def _read_head(conn) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


class Counting:
    """A socket wrapper counting the TCP bytes each way (below TLS when there is TLS)."""

    def __init__(self, sock):
        self.sock, self.read, self.written = sock, 0, 0

    def recv(self, n):
        data = self.sock.recv(n)
        self.read += len(data)
        return data

    def sendall(self, data):
        self.sock.sendall(data)
        self.written += len(data)


def serve_http(name: str, addr: str, port: int, log: Log, tls: ssl.SSLContext | None) -> None:
    listener = socket.create_server((addr, port), backlog=256)

    def handle(raw: socket.socket) -> None:
        entry = {"server": name, "port": port, "tls": tls is not None, "host": "", "path": "", "sni": ""}
        counter = Counting(raw)
        try:
            conn = raw
            if tls is not None:
                incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
                obj = tls.wrap_bio(incoming, outgoing, server_side=True)
                conn = _BioSocket(counter, obj, incoming, outgoing)
                conn.handshake()
                entry["sni"] = conn.sni
            else:
                conn = counter
            head = _read_head(conn)
            if not head:
                return
            lines = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else "/"
            entry["path"] = path
            for line in lines[1:]:
                k, _, v = line.partition(":")
                if k.lower() == "host":
                    entry["host"] = v.strip()
            sized = path.startswith("/bytes/")
            size = int(path.split("/bytes/")[1]) if sized else len(name) + 1
            body_head = f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()
            conn.sendall(body_head)
            chunk = b"x" * 65536 if sized else name.encode() + b"\n"
            left = size
            while left:
                piece = chunk[:left]
                conn.sendall(piece)
                left -= len(piece)
            if tls is not None:
                conn.close_notify()
        except (OSError, ssl.SSLError) as exc:
            entry["error"] = repr(exc)
        finally:
            entry["bytes_read"], entry["bytes_written"] = counter.read, counter.written
            raw.close()
            log.write(**entry)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def _lenient_requests(conn, log: "Log") -> None:
    """Reads request after request on one connection, as leniently as it can."""
    buf = b""

    def fill() -> bool:
        nonlocal buf
        chunk = conn.recv(65536)
        buf += chunk
        return bool(chunk)

    while True:
        buf = buf.lstrip(b" \t\r\n")
        while not (end := re.search(rb"\r?\n\r?\n", buf)):
            if not fill():
                return
            buf = buf.lstrip(b" \t\r\n")
        head, buf = buf[:end.start()].replace(b"\r\n", b"\n"), buf[end.end():]
        lines = head.decode("latin-1").split("\n")
        parts = lines[0].split()
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.setdefault(name.strip().lower(), value.strip())
        body = b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                while b"\n" not in buf:
                    if not fill():
                        return
                size_line, _, buf = buf.partition(b"\n")
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                while len(buf) < size + 2 and fill():
                    pass
                body, buf = body + buf[:size], buf[size:].lstrip(b"\r").removeprefix(b"\n")
                if not size:
                    break
        elif headers.get("content-length", "").isdigit():
            size = int(headers["content-length"])
            while len(buf) < size and fill():
                pass
            body, buf = buf[:size], buf[size:]
        log.write(server="lenient", method=parts[0] if parts else "", path=parts[1] if len(parts) > 1 else "",
                  host=headers.get("host", ""), body=body.decode("latin-1"))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")


def serve_lenient(addr: str, port: int, log: "Log") -> None:
    listener = socket.create_server((addr, port), backlog=256)

    def handle(conn: socket.socket) -> None:
        try:
            _lenient_requests(conn, log)
        except (OSError, ValueError) as exc:
            log.write(server="lenient", error=repr(exc))
        finally:
            conn.close()

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


class _BioSocket:
    """TLS over a counted plain socket, so the counts are the bytes on the wire."""

    def __init__(self, counter: Counting, obj: ssl.SSLObject, incoming, outgoing):
        self.c, self.obj, self.inc, self.out = counter, obj, incoming, outgoing
        self.sni = ""

    def _flush(self):
        data = self.out.read()
        if data:
            self.c.sendall(data)

    def _fill(self) -> bool:
        data = self.c.recv(65536)
        if not data:
            self.inc.write_eof()
            return False
        self.inc.write(data)
        return True

    def handshake(self):
        while True:
            try:
                self.obj.do_handshake()
                self._flush()
                self.sni = getattr(self.obj, "sni_seen", "")
                return
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise OSError("eof during handshake")

    def recv(self, n):
        while True:
            try:
                return self.obj.read(n)
            except ssl.SSLWantReadError:
                if not self._fill():
                    return b""
            except ssl.SSLZeroReturnError:
                return b""

    def sendall(self, data):
        self.obj.write(data)
        self._flush()

    def close_notify(self):
        try:
            self.obj.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLError):
            pass
        self._flush()


def serve_dns(addr: str, table: dict[str, str], log: Log) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((addr, 53))
    while True:
        data, peer = sock.recvfrom(2048)
        if len(data) < 12:
            continue
        txid = data[:2]
        i, labels = 12, []
        while i < len(data) and data[i]:
            labels.append(data[i + 1:i + 1 + data[i]].decode("ascii", "replace"))
            i += 1 + data[i]
        question = data[12:i + 5]
        qtype = struct.unpack("!H", data[i + 1:i + 3])[0]
        name = ".".join(labels).lower()
        log.write(dns=name, qtype=qtype)
        answer = b""
        ancount, rcode = 0, 3
        if name in table:
            rcode = 0
            if qtype == 1:
                answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(table[name])
                ancount = 1
        header = txid + struct.pack("!HHHHH", 0x8180 | rcode, 1, ancount, 0, 0)
        sock.sendto(header + question + answer, peer)


def run_servers(prefix: str, cert: str, key: str, log_path: str, table_json: str) -> None:
    log = Log(log_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    tls.sni_callback = lambda obj, name, _ctx: setattr(obj, "sni_seen", name or "")
    threads = [
        threading.Thread(target=serve_http, args=("allowed", f"{prefix}.2", 80, log, None)),
        threading.Thread(target=serve_http, args=("allowed", f"{prefix}.2", 443, log, tls)),
        threading.Thread(target=serve_http, args=("other", f"{prefix}.3", 80, log, None)),
        threading.Thread(target=serve_http, args=("other", f"{prefix}.3", 443, log, tls)),
        threading.Thread(target=serve_lenient, args=(f"{prefix}.2", 8080, log)),
        threading.Thread(target=serve_dns, args=(f"{prefix}.2", json.loads(table_json), log)),
    ]
    for t in threads:
        t.daemon = True
        t.start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------- the namespace (test side)


class RemoteHosts:
    """A network namespace with the servers above, reachable from the host only."""

    def __init__(self, workdir: Path, *, tag: str = "t", subnet: str = "10.213"):
        # `tag` and `subnet` tell apart the namespaces of several users in one process.
        n = os.getpid() % 200 + 20
        self.ns = f"sbx{tag}-{os.getpid()}"
        self.host_if, self.ns_if = f"s{tag}h{os.getpid()}"[:15], f"s{tag}s{os.getpid()}"[:15]
        self.prefix = f"{subnet}.{n}"
        self.workdir = workdir
        self.log_path = workdir / "servers.jsonl"
        self.proc: subprocess.Popen | None = None

    @property
    def allowed_ip(self) -> str:
        return f"{self.prefix}.2"

    @property
    def other_ip(self) -> str:
        return f"{self.prefix}.3"

    @property
    def allowed_ip6(self) -> str:
        return f"fd5b:213:{self.prefix.rsplit('.', 1)[1]}::2"

    @property
    def host_side_ip(self) -> str:
        return f"{self.prefix}.1"

    def dns_table(self) -> dict[str, str]:
        return {
            "allowed.test": self.allowed_ip, "www.allowed.test": self.allowed_ip,
            "audit.allowed.test": self.allowed_ip, "other.test": self.other_ip,
            # Addresses the proxy must refuse after resolution; both are this run's own.
            "rebind.test": "127.0.0.1", "self.test": self.host_side_ip, "private.test": f"{self.prefix}.4",
        }

    def start(self) -> "RemoteHosts":
        self.stop()
        add_namespace(self.ns, self.host_if, self.ns_if, self.host_side_ip, [self.allowed_ip, self.other_ip])
        # IPv6 too where the host has it, so that a direct IPv6 attempt has a real target.
        six = subprocess.run(["ip", "-n", self.ns, "-6", "addr", "add", f"{self.allowed_ip6}/64", "dev", self.ns_if,
                              "nodad"], capture_output=True)
        self.has_ipv6 = six.returncode == 0
        cert, key = self.workdir / "cert.pem", self.workdir / "key.pem"
        self_signed(cert, key, ["allowed.test", "other.test"])
        self.cert = cert
        self.proc = serve_in(self.ns, [sys.executable, __file__, self.prefix, str(cert), str(key), str(self.log_path),
                                       json.dumps(self.dns_table())], "test servers")
        return self

    def stop(self) -> None:
        remove_namespace(self.proc, self.ns, self.host_if)
        self.proc = None

    def entries(self) -> list[dict]:
        return json_lines(self.log_path)

    def daemon_egress_settings(self) -> dict:
        return {"dns_servers": [f"{self.allowed_ip}:53"], "system_dns": False,
                "exempt_networks": [f"{self.allowed_ip}/32", f"{self.other_ip}/32"]}


if __name__ == "__main__":
    run_servers(*sys.argv[1:6])
