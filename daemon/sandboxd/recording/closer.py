"""Closing fanotify groups and inotify instances off the caller's thread: a close waits
for an SRCU grace period in the kernel (5-15 ms). The closing thread starts on first
use, never at import."""

from __future__ import annotations

import logging
import os
import queue
import threading

log = logging.getLogger("sandboxd.recording.closer")

# Descriptors waiting for the closer thread; past it a caller closes its own (and waits).
MAX_CLOSING = 32


class DeferredCloser:
    """A thread that closes descriptors handed to it, started by the first one."""

    def __init__(self, max_waiting: int = MAX_CLOSING, name: str = "fanotify-closer") -> None:
        self._max_waiting = max_waiting
        self._name = name
        self._queue: queue.SimpleQueue[int] | None = None
        self._start_lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._queue is not None

    def close_later(self, fd: int) -> None:
        waiting = self._queue if self._queue is not None else self._start()
        if waiting.qsize() < self._max_waiting:
            waiting.put(fd)
        else:  # falling behind: each open group counts against the host's limits
            os.close(fd)

    def _start(self) -> queue.SimpleQueue[int]:
        with self._start_lock:
            if self._queue is None:
                waiting: queue.SimpleQueue[int] = queue.SimpleQueue()
                threading.Thread(target=_close_each, args=(waiting,), daemon=True, name=self._name).start()
                self._queue = waiting
            return self._queue


def _close_each(waiting: queue.SimpleQueue[int]) -> None:
    while True:
        fd = waiting.get()
        try:
            os.close(fd)
        except OSError as exc:  # never lose the closer: later groups would leak
            log.error("closing fanotify group %d failed: %s", fd, exc)


_closer = DeferredCloser()


def close_later(fd: int) -> None:
    """Closes `fd` on the closer thread (started now if it is not yet)."""
    _closer.close_later(fd)
