"""The public Unix socket and who is on the other end of it.

grpc-python cannot see a peer's credentials, so the daemon accepts connections itself,
reads SO_PEERCRED, and relays each connection to its private gRPC socket from a client
socket bound to a path that names the peer (`<n>.<uid>`). The servicers read the uid
back from `context.peer()`; only this relay can connect to the private socket (its
directory is 0700, root's), so the name cannot be forged. The bytes are moved by
native/relay.c, on threads outside the interpreter."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from .errors import FailedPrecondition, Unauthenticated
from .settings import REPO_ROOT, DaemonSettings

log = logging.getLogger("sandboxd.transport")
# native/relay.c (`make native`).
RELAY_LIBRARY = REPO_ROOT / "build" / "libsandboxd-relay.so"
_relay_lib: ctypes.CDLL | None = None


def relay_library() -> ctypes.CDLL:
    """The byte pump (loaded once); FailedPrecondition when it was not built."""
    global _relay_lib
    if _relay_lib is None:
        try:
            lib = ctypes.CDLL(str(RELAY_LIBRARY), use_errno=True)
        except OSError as exc:
            raise FailedPrecondition(f"the relay {RELAY_LIBRARY} cannot be loaded (build it with `make native`): "
                                     f"{exc}") from None
        lib.relay_start.argtypes, lib.relay_start.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _relay_lib = lib
    return _relay_lib


def relay(a: socket.socket, b: socket.socket) -> None:
    """Moves bytes both ways between two connected sockets until each side has ended,
    then closes both; the sockets are detached from Python at once."""
    lib = relay_library()
    fa, fb = a.detach(), b.detach()
    started = lib.relay_start(fa, fb)
    if started < 0:
        err = ctypes.get_errno()
        os.close(fa)
        os.close(fb)
        raise OSError(err, f"no relay thread: {os.strerror(err)}")
    if started == 1:  # the relay ends the connection and closes both itself
        err = ctypes.get_errno()
        raise OSError(err, f"only one relay thread: {os.strerror(err)}; the connection was ended")


@dataclass(frozen=True)
class Principal:
    name: str
    uid: int
    admin: bool


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


class PeerCredentialRelay:
    def __init__(self, public_path: Path, internal_socket: Path, internal_dir: Path, mode: int,
                 owner: tuple[int, int] | None = None):
        relay_library()  # refused here, before the socket exists
        self._public_path = public_path
        self._internal_socket = internal_socket
        self._internal_dir = internal_dir
        self._counter = itertools.count()
        public_path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if public_path.exists() or public_path.is_symlink():
            public_path.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(public_path))
        if owner is not None:
            os.chown(public_path, *owner)
        os.chmod(public_path, mode)
        self._listener.listen(128)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="relay-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            self._public_path.unlink()
        except FileNotFoundError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                self._relay(conn)
            except OSError as exc:
                log.warning("could not relay a connection: %s", exc)
                conn.close()

    def _relay(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = self._internal_dir / f"{next(self._counter)}.{uid}"
        upstream.bind(str(name))
        try:
            upstream.connect(str(self._internal_socket))
        finally:
            name.unlink(missing_ok=True)  # the bound name stays the socket's address
        relay(conn, upstream)
