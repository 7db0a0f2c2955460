"""A package index of the test's own: a PyPI-like "simple" index and an npm registry,
served over HTTP (:80) and HTTPS (:443) from a network namespace the test run makes,
under a name the daemon's egress proxy maps to it (its `hosts` setting). Nothing here
talks to an address it did not make. Run as a script (inside the namespace) it is the
server; every request is logged as one JSON line (method, path, Host, peer, tls).

The packages are made here, by hand, from their formats' specifications: a pure-Python
wheel (a zip with METADATA, WHEEL, RECORD and an entry point) and an npm tarball
(package/package.json, gzip'd tar) with its registry metadata document."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

try:
    from .netns import add_namespace, json_lines, remove_namespace, self_signed, serve_in
except ImportError:  # run as a script inside the namespace: its servers need none of it
    from netns import add_namespace, json_lines, remove_namespace, self_signed, serve_in  # type: ignore[no-redef]

# ---------------------------------------------------------------- the server (in the netns)


def _handler(root: Path, log_path: Path, tls: bool) -> type[http.server.BaseHTTPRequestHandler]:
    log_lock = threading.Lock()

    class Handler(http.server.SimpleHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            # npm asks for a package's metadata at /<name> (no extension): npm/<name>.json.
            name = self.path.split("?", 1)[0].lstrip("/")
            document = root / "npm" / f"{name}.json"
            if name and "/" not in name and document.is_file():
                body = document.read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            super().do_GET()

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            # Every answered request, as one JSON line (send_response calls this).
            entry = {"method": self.command, "path": self.path, "host": self.headers.get("Host", ""),
                     "peer": self.client_address[0], "tls": tls, "status": int(code) if str(code).isdigit() else 0}
            with log_lock, open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet on stderr
            pass

    return Handler


def run_server(root: str, addr: str, cert: str, key: str, log_path: str) -> None:
    threads = []
    for port, tls in ((80, False), (443, True)):
        server = http.server.ThreadingHTTPServer((addr, port), _handler(Path(root), Path(log_path), tls))
        server.daemon_threads = True
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        threads.append(threading.Thread(target=server.serve_forever, daemon=True))
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()


# ---------------------------------------------------------------- the packages


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(out_dir: Path, name: str, version: str, module: str, source: str, script: str) -> Path:
    """A pure-Python wheel of `module` (one file, `source`) with a console script
    `name` calling `module:main`."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{module}/__init__.py": source.encode(),
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: sandboxd-tests\nRoot-Is-Purelib: true\n"
                                   b"Tag: py3-none-any\n",
        f"{dist}.dist-info/entry_points.txt": f"[console_scripts]\n{script} = {module}:main\n".encode(),
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    record += f"{dist}.dist-info/RECORD,,\n"
    files[f"{dist}.dist-info/RECORD"] = record.encode()
    wheel = out_dir / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(zipfile.ZipInfo(path, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return wheel


def publish_wheel(root: Path, name: str, wheel: Path) -> None:
    """The wheel under files/ and its PEP 503 page at simple/<name>/ (with its sha256)."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    shutil.copy(wheel, root / "files" / wheel.name)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    page = root / "simple" / name
    page.mkdir(parents=True, exist_ok=True)
    (page / "index.html").write_text(
        f'<!DOCTYPE html>\n<html><body>\n<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>\n'
        "</body></html>\n")
    (root / "simple" / "index.html").write_text(f'<html><body><a href="{name}/">{name}</a></body></html>\n')


def publish_npm(root: Path, base_url: str, name: str, version: str, index_js: str, bin_js: str) -> None:
    """An npm package (gzip'd tar of package/...) and the registry's metadata document
    for it, with the tarball's URL, sha1 and sha512 integrity."""
    package_json = {"name": name, "version": version, "main": "index.js", "bin": {name: "bin.js"},
                    "license": "MIT"}
    members = {"package/package.json": json.dumps(package_json, indent=1).encode(),
               "package/index.js": index_js.encode(), "package/bin.js": bin_js.encode()}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, data in members.items():
            info = tarfile.TarInfo(path)
            info.size, info.mtime = len(data), 1700000000
            info.mode = 0o755 if path.endswith("bin.js") else 0o644
            tar.addfile(info, io.BytesIO(data))
    tarball = buf.getvalue()
    tar_path = f"{name}/-/{name}-{version}.tgz"
    (root / name / "-").mkdir(parents=True, exist_ok=True)
    (root / tar_path).write_bytes(tarball)
    document = {
        "name": name, "dist-tags": {"latest": version},
        "versions": {version: {**package_json, "_id": f"{name}@{version}", "dist": {
            "tarball": f"{base_url.rstrip('/')}/{tar_path}",
            "shasum": hashlib.sha1(tarball).hexdigest(),
            "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()}}},
    }
    (root / "npm").mkdir(parents=True, exist_ok=True)
    (root / "npm" / f"{name}.json").write_text(json.dumps(document))


# ---------------------------------------------------------------- the namespace (test side)


class PackageIndexHost:
    """A network namespace with one address, the server above in it, reachable from
    the host only (so only through the daemon's proxy from a sandbox)."""

    def __init__(self, workdir: Path, domain: str, *, subnet: str = "10.214"):
        pid = os.getpid()
        self.domain = domain
        self.ns = f"sbxpkg-{pid}"
        self.host_if, self.ns_if = f"spkh{pid}"[:15], f"spks{pid}"[:15]
        self.prefix = f"{subnet}.{pid % 200 + 20}"
        self.workdir = workdir
        self.root = workdir / "root"
        self.log_path = workdir / "requests.jsonl"
        self.cert = workdir / "cert.pem"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.prefix}.2"

    @property
    def host_side_address(self) -> str:
        return f"{self.prefix}.1"

    def start(self) -> "PackageIndexHost":
        self.stop()
        self.root.mkdir(parents=True, exist_ok=True)
        add_namespace(self.ns, self.host_if, self.ns_if, self.host_side_address, [self.address])
        key = self.workdir / "key.pem"
        self_signed(self.cert, key, [self.domain])
        self.proc = serve_in(self.ns, [sys.executable, __file__, str(self.root), self.address, str(self.cert),
                                       str(key), str(self.log_path)], "the package index")
        return self

    def stop(self) -> None:
        remove_namespace(self.proc, self.ns, self.host_if)
        self.proc = None

    def requests(self) -> list[dict]:
        return json_lines(self.log_path)

    def daemon_egress_settings(self) -> dict:
        """The proxy resolves the index's name to its address (no DNS) and may reach it
        although it is a private one."""
        return {"hosts": {self.domain: [self.address]}, "exempt_networks": [f"{self.address}/32"]}


if __name__ == "__main__":
    run_server(*sys.argv[1:6])
