"""The public Unix socket and who is on the other end of it.

grpc-python cannot see a peer's credentials, so the daemon accepts connections itself,
reads SO_PEERCRED, and relays each connection to its private gRPC socket from a client
socket bound to a path that names the peer (`<n>.<uid>`). The servicers read the uid
back from `context.peer()` (api/auth.py); only this relay can connect to the private socket (its
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
import time
from dataclasses import dataclass
from pathlib import Path

from sandboxd.core.errors import FailedPrecondition
from sandboxd.core.safe_open import UnsafeFile, load_library
from sandboxd.core.settings import DaemonSettings

log = logging.getLogger("sandboxd.api.transport")


class RelayPump:
    """The byte pump of native/relay.c (`make native`), loaded from `library` (the
    setting relay_library); FailedPrecondition when it was not built."""

    def __init__(self, library: Path):
        try:
            lib = load_library(library, setting="relay_library", use_errno=True)  # a FIFO there: refused
        except (OSError, UnsafeFile) as exc:
            raise FailedPrecondition(f"the relay {library} cannot be loaded (build it with `make native`): "
                                     f"{exc}") from None
        counter = ctypes.POINTER(ctypes.c_int)
        lib.relay_start.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, counter, counter]
        lib.relay_start.restype = ctypes.c_int
        lib.relay_count_add.argtypes, lib.relay_count_add.restype = [counter, ctypes.c_int], ctypes.c_int
        self._lib = lib

    def counter(self) -> "ConnectionCounter":
        return ConnectionCounter(self._lib)

    def relay(self, a: socket.socket, b: socket.socket, idle_ms: int = 0,
              counters: tuple["ConnectionCounter | None", "ConnectionCounter | None"] = (None, None)) -> None:
        """Moves bytes both ways between two connected sockets until each side has ended,
        then closes both; the sockets are detached from Python at once. With idle_ms, `a`
        silent that long ends the connection. Each counter given is counted down when the
        connection has ended (the caller counted it up)."""
        fa, fb = a.detach(), b.detach()
        c1, c2 = (None if c is None else c.pointer for c in counters)
        started = self._lib.relay_start(fa, fb, idle_ms, c1, c2)
        if started < 0:
            err = ctypes.get_errno()
            os.close(fa)
            os.close(fb)
            raise OSError(err, f"no relay thread: {os.strerror(err)}")
        if started == 1:  # the relay ends the connection, closes both and counts it off itself
            err = ctypes.get_errno()
            raise RelayEnded(err, f"only one relay thread: {os.strerror(err)}; the connection was ended")


class RelayEnded(OSError):
    """The relay took the connection and ended it at once (it counted it off)."""


class ConnectionCounter:
    """Connections alive of one kind: up when accepted, down by the relay (in C) once
    the connection has ended."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._value = ctypes.c_int(0)
        self.pointer = ctypes.pointer(self._value)

    def add(self, delta: int) -> int:
        return int(self._lib.relay_count_add(self.pointer, delta))

    @property
    def value(self) -> int:
        return self.add(0)


@dataclass(frozen=True)
class ConnectionLimits:
    """How many connections the public socket relays at once (settings.rpc_limits)."""

    principal_uids: frozenset[int] = frozenset()
    per_principal: int = 64
    unauthenticated: int = 8
    total: int = 1024
    unauthenticated_idle_ms: int = 5000

    @classmethod
    def from_settings(cls, settings: DaemonSettings) -> "ConnectionLimits":
        rpc = settings.rpc_limits
        return cls(frozenset(settings.principals), rpc.connections_per_principal, rpc.unauthenticated_connections,
                   rpc.max_connections, int(rpc.unauthenticated_idle_timeout_s * 1000))


class PeerCredentialRelay:
    """Accepts on the public socket and relays each connection, within the caps of
    `limits`: connections per principal's uid, of every other uid together, and in all.
    One over a cap is closed at once (the client sees UNAVAILABLE). `library` is the
    relay's byte pump (settings.relay_library)."""

    def __init__(self, public_path: Path, internal_socket: Path, internal_dir: Path, mode: int,
                 owner: tuple[int, int] | None = None, limits: ConnectionLimits | None = None, *,
                 library: Path):
        self._pump = RelayPump(library)  # refused here, before the socket exists
        self._limits = limits or ConnectionLimits()
        self._total = self._pump.counter()
        self._per_uid: dict[int, ConnectionCounter] = {}  # principals' uids, and -1: everyone else
        self._refused = 0
        self._refused_logged_at = 0.0
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

    def connections(self, uid: int | None = None) -> int:
        """Connections relayed now: in all, or of one principal's uid (-1: of the others)."""
        if uid is None:
            return self._total.value
        counter = self._per_uid.get(uid)
        return 0 if counter is None else counter.value

    def _admit(self, uid: int) -> tuple[ConnectionCounter, ConnectionCounter] | None:
        """The connection counted in, or None when it is over a cap."""
        known = uid in self._limits.principal_uids
        key, cap = (uid, self._limits.per_principal) if known else (-1, self._limits.unauthenticated)
        mine = self._per_uid.get(key)
        if mine is None:
            mine = self._per_uid[key] = self._pump.counter()
        if self._total.add(1) > self._limits.total:
            self._total.add(-1)
            return None
        if mine.add(1) > cap:
            mine.add(-1)
            self._total.add(-1)
            return None
        return mine, self._total

    def _refuse(self, conn: socket.socket, uid: int) -> None:
        conn.close()
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= 10:  # a flood of connections never floods the log
            log.warning("refused %d connections over the caps (the last from uid %d)", self._refused, uid)
            self._refused, self._refused_logged_at = 0, now

    def _relay(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        counted = self._admit(uid)
        if counted is None:
            self._refuse(conn, uid)
            return
        # A peer that is no principal can only ever be told UNAUTHENTICATED: it may not
        # keep its connection (two threads, seven descriptors) by staying quiet.
        idle_ms = 0 if uid in self._limits.principal_uids else self._limits.unauthenticated_idle_ms
        try:
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = self._internal_dir / f"{next(self._counter)}.{uid}"
            try:
                upstream.bind(str(name))
                upstream.connect(str(self._internal_socket))
            except OSError:
                upstream.close()
                raise
            finally:
                name.unlink(missing_ok=True)  # the bound name stays the socket's address
            self._pump.relay(conn, upstream, idle_ms, counted)
        except RelayEnded:
            raise
        except OSError:
            for counter in counted:
                counter.add(-1)
            raise
