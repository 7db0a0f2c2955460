"""Who is calling: a principal of the daemon's settings, from the uid the peer-credential
relay recorded (the Unix socket) or from the client certificate (mutual TLS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from sandboxd.core.errors import Unauthenticated
from sandboxd.core.settings import DaemonSettings
from sandboxd.policy.principal import Principal


def resolve_principal(uid: int, settings: DaemonSettings) -> Principal:
    name = settings.principals.get(uid)
    if name is None:
        raise Unauthenticated(f"uid {uid} is not a principal of this daemon")
    return Principal(name=name, uid=uid, admin=name in settings.admins)


def peer_uid(context: grpc.ServicerContext, internal_dir: Path) -> int:
    """The uid the relay recorded for this connection; -1 when it came any other way."""
    peer = context.peer() or ""
    prefix = f"unix:{internal_dir}/"
    if not peer.startswith(prefix):
        return -1
    _, _, uid = peer[len(prefix):].partition(".")
    return int(uid) if uid.isdigit() else -1


class Authenticator:
    """The caller of an RPC: on the Unix socket, from the uid the peer-credential relay
    recorded; on TCP (mutual TLS only), from the client certificate's subject CN. Either
    way a principal of the daemon's config, or UNAUTHENTICATED."""

    def __init__(self, settings: DaemonSettings):
        self._settings = settings
        self._uid_of = {name: uid for uid, name in settings.principals.items()}

    def __call__(self, context: grpc.ServicerContext) -> Principal:
        auth = context.auth_context() or {}
        if auth.get("transport_security_type") == [b"ssl"]:
            return self._from_certificate(auth)
        return resolve_principal(peer_uid(context, self._settings.internal_dir), self._settings)

    def _from_certificate(self, auth: dict[str, Any]) -> Principal:
        tcp = self._settings.tcp
        names = auth.get("x509_common_name") or []
        if tcp is None or not names:
            raise Unauthenticated("the client certificate names no subject (CN)")
        cn = names[0].decode("utf-8", "replace")
        name = tcp.subjects.get(cn) if tcp.subjects else cn
        if name is None or name not in self._uid_of:
            raise Unauthenticated(f"certificate subject CN={cn} is not a principal of this daemon")
        # A TCP principal is the same tenant as its uid on the socket: same workspaces.
        return Principal(name=name, uid=self._uid_of[name], admin=name in self._settings.admins)
