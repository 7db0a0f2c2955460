"""The streamable HTTP listener: the SDK's app behind a bearer token and/or mutual TLS,
on a loopback address unless the operator allows another. An MCP endpoint runs commands,
so it is never served open (config.py refuses --http without a token or mutual TLS)."""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import ssl
import stat
import sys
from typing import Any

from mcp.server import Server
from mcp.server.transport_security import TransportSecuritySettings

from .config import HttpConfig, UsageError

log = logging.getLogger("sandboxd_client.mcp.http")

MIN_TOKEN_CHARS = 16
_LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]


def load_token(path: str) -> str:
    """The token in `path`: its only line, at least MIN_TOKEN_CHARS long, in a file only
    its owner can read (as ssh keeps its keys)."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise UsageError(f"--token-file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"--token-file {path}: group or others may read it (mode {stat.S_IMODE(mode):04o}); "
                         "chmod 600 it")
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise UsageError(f"--token-file {path}: the token must be one word of at least {MIN_TOKEN_CHARS} characters")
    return token


class BearerAuth:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <token>`,
    compared in constant time; anything else gets 401 and reaches nothing."""

    def __init__(self, app: Any, token: str):
        self._app = app
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            body = json.dumps({"error": "unauthorized", "error_description":
                               "this MCP endpoint needs `Authorization: Bearer <token>`"}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self._app(scope, receive, send)


def transport_security(http: HttpConfig) -> TransportSecuritySettings:
    """DNS-rebinding protection: the Host (and a browser's Origin) must name this server.
    On a wildcard address the names are not known here; the token or certificate is the
    protection there."""
    if http.host in ("0.0.0.0", "::"):
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    host = f"[{http.host}]" if ":" in http.host else http.host
    hosts = sorted(set(_LOOPBACK_HOSTS + [f"{host}:*"]))
    origins = [f"{scheme}://{h}" for h in hosts for scheme in ("http", "https")]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)


def bind(http: HttpConfig) -> socket.socket:
    family = socket.AF_INET6 if ":" in http.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((http.host, http.port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise UsageError(f"--http {http.host}:{http.port}: {exc.strerror}") from None
    return sock


def _tls_options(http: HttpConfig) -> dict[str, Any]:
    if not http.tls_cert:
        return {}
    options: dict[str, Any] = {"ssl_certfile": http.tls_cert, "ssl_keyfile": http.tls_key}
    if http.tls_client_ca:
        options |= {"ssl_ca_certs": http.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


async def serve_http(http: HttpConfig, server: Server[Any]) -> None:
    """Serves until SIGINT or SIGTERM (uvicorn's), then ends the server's lifespan."""
    import uvicorn

    app: Any = server.streamable_http_app(streamable_http_path=http.path, host=http.host,
                                          transport_security=transport_security(http))
    if http.token_file:
        app = BearerAuth(app, load_token(http.token_file))
    sock = bind(http)
    host, port = sock.getsockname()[:2]
    scheme = "https" if http.tls_cert else "http"
    shown = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(app, log_level="warning", lifespan="on", **_tls_options(http))
    # The address a client (or a test) reads: the one line on stderr it can rely on.
    print(f"sandboxd-mcp: serving {scheme}://{shown}:{port}{http.path}", file=sys.stderr, flush=True)
    try:
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        sock.close()
