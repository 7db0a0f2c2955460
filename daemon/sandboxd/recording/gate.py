"""The sandbox's arrival at its gate: the shim opens its gate FIFO only once the sandbox
is up, and inotify says when, with no polling of the sandbox's processes."""

from __future__ import annotations

import os
import select

from sandboxd.recording.closer import close_later
from sandboxd.recording.errors import FileWatchError
from sandboxd.recording.inotify import IN_OPEN, inotify_add_watch, inotify_events, inotify_init


class GateArrival:
    """Wakes when the sandbox's shim opens its gate FIFO (inotify IN_OPEN), which it
    does only once the sandbox is up: no polling of the sandbox's processes."""

    def __init__(self, gate_path: str) -> None:
        try:
            fd = inotify_init()
        except OSError as exc:
            raise FileWatchError(f"inotify_init1: {exc.strerror}") from None
        try:
            inotify_add_watch(fd, gate_path, IN_OPEN)
        except OSError as exc:
            os.close(fd)
            raise FileWatchError(f"inotify_add_watch {gate_path}: {exc.strerror}") from None
        self._fd = fd
        self.arrived = False

    def wait(self, timeout_s: float) -> bool:
        """True once the gate was opened (within `timeout_s` from now, or before)."""
        if not self.arrived:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            if poller.poll(max(0, int(timeout_s * 1000))):
                try:
                    buf = os.read(self._fd, 4096)
                except BlockingIOError:
                    buf = b""
                self.arrived = any(mask & IN_OPEN for _wd, mask in inotify_events(buf))
        return self.arrived

    def close(self) -> None:
        """Off the caller's thread: closing an inotify instance, like a fanotify group,
        waits for the kernel's SRCU grace period (5-15 ms)."""
        if self._fd >= 0:
            close_later(self._fd)
            self._fd = -1
