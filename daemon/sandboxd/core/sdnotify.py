"""The systemd notification protocol (sd_notify(3)), written here rather than taken as a
dependency: a `Type=notify` unit (deploy/systemd/sandboxd.service) learns from the daemon
when it serves (READY=1) and when a stop has begun (STOPPING=1).

systemd names its socket in NOTIFY_SOCKET: a filesystem path, or an abstract name
written "@name". A notice is one datagram of newline-separated KEY=VALUE lines. Without
NOTIFY_SOCKET (not started by systemd) every notice is dropped. A notice that cannot be
sent is logged, never raised: systemd's bookkeeping is not worth the daemon's life.

The variable is taken out of the daemon's environment when it is read, so that nothing
the daemon starts (nsjail, the backstop, a credential command) inherits it: the socket
is systemd's channel to the daemon's main process, nobody else's."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass

log = logging.getLogger("sandboxd.sdnotify")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
# A notice is never worth a stuck start or stop: systemd reads its socket at once, so a
# send that blocks this long means nobody will.
SEND_TIMEOUT_S = 2.0


def socket_address(value: str) -> str:
    """NOTIFY_SOCKET's value as an AF_UNIX address: an absolute path as it is, "@name"
    as the abstract name "\\0name". Anything else (a relative path; systemd's newer
    "vsock:" addresses) is a ValueError saying why: sd_notify(3) refuses those too."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    raise ValueError(f"{NOTIFY_SOCKET_ENV}={value!r} is neither an absolute path nor an abstract name (@name)")


def message(fields: dict[str, str]) -> bytes:
    """The datagram for `fields`, one KEY=VALUE a line. A value's own line breaks would
    start a new assignment, so they become spaces."""
    lines = []
    for key, value in fields.items():
        if not key or not key.replace("_", "").isalnum() or not key.isupper():
            raise ValueError(f"{key!r} is not a notification field name")
        lines.append(f"{key}={' '.join(value.splitlines())}")
    return ("\n".join(lines) + "\n").encode()


@dataclass(frozen=True)
class SystemdNotifier:
    """Sends notices to the socket systemd named, or drops them when it named none.
    Built once, at start, by `take_from_environment`; nothing happens before a send."""

    notify_socket: str | None  # NOTIFY_SOCKET as it was given; None: not under systemd

    @classmethod
    def take_from_environment(cls, environ: MutableMapping[str, str] | None = None) -> "SystemdNotifier":
        """The notifier for NOTIFY_SOCKET, which is removed from `environ` (the process's
        own, by default) so that no child process inherits it."""
        environ = os.environ if environ is None else environ
        return cls(environ.pop(NOTIFY_SOCKET_ENV, None) or None)

    @property
    def enabled(self) -> bool:
        return self.notify_socket is not None

    def ready(self, status: str = "") -> bool:
        """Everything is up and serving: systemd ends the start and starts what waits for us."""
        return self.notify({"READY": "1", **({"STATUS": status} if status else {})})

    def stopping(self, status: str = "") -> bool:
        """A stop has begun: systemd shows the unit as deactivating while we clean up."""
        return self.notify({"STOPPING": "1", **({"STATUS": status} if status else {})})

    def status(self, text: str) -> bool:
        """A line for `systemctl status`."""
        return self.notify({"STATUS": text})

    def notify(self, fields: dict[str, str]) -> bool:
        """Sends `fields` as one notice. True when sent; False when there is nobody to
        tell or the send failed (logged: the daemon carries on either way)."""
        if self.notify_socket is None:
            return False
        try:
            address = socket_address(self.notify_socket)
            data = message(fields)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(data, address)
        except (OSError, ValueError) as exc:
            log.error("could not notify systemd (%s) of %s: %s", self.notify_socket,
                      ", ".join(sorted(fields)), exc)
            return False
        return True
