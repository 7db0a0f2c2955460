"""An OOM kill ends the whole sandbox, on both backends.

At a cgroup's memory limit the kernel's OOM killer kills one process, the biggest, and
the rest go on: a shell whose child was killed carried on and the call exited 0 (Docker),
or the jail's init was the one killed and the call ended 137 (nsjail). Whichever process
dies, the call must end the same way: every process of it killed, `oomKilled`, 137.

cgroup v2 does this in the kernel (memory.oom.group: the whole group goes). cgroup v1
has no such switch, so one thread waits on an eventfd per sandbox, registered on its
memory.oom_control (cgroup.event_control), and kills the sandbox at the first
notification that is an OOM (the eventfd also fires when the cgroup is removed). An OOM
kill before the registration is caught by the oom_kill counter."""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
# How many 10 ms waits a notification gets for the OOM-kill counter to move.
_COUNTER_WAITS = 20


def _oom_kills_v1(memory_dir: str) -> int:
    try:
        with open(f"{memory_dir}/memory.oom_control") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _an_oom(memory_dir: str) -> bool:
    """Whether a v1 notification is an OOM: it also comes when the cgroup is removed (the
    sandbox ended). The kernel notifies before it kills, so the counter may lag a moment;
    an OOM that killed nothing yet (its victim was exiting) still ends the sandbox."""
    for _ in range(_COUNTER_WAITS):
        if not os.path.isdir(memory_dir):
            return False
        if _oom_kills_v1(memory_dir):
            return True
        time.sleep(0.01)
    return os.path.isdir(memory_dir)


class OomGuard:
    """watch(memory_dir, kill) -> unwatch. The thread starts on the first watch of a v1
    cgroup (never at import) and lives as long as the daemon."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoll: select.epoll | None = None
        self._watches: dict[int, tuple[int, Callable[[], None], str]] = {}  # eventfd -> (oom_control fd, kill, dir)

    def watch(self, memory_dir: str, kill: Callable[[], None]) -> Callable[[], None]:
        if os.path.exists(f"{memory_dir}/memory.oom.group"):  # cgroup v2: the kernel kills the group
            with open(f"{memory_dir}/memory.oom.group", "w") as f:
                f.write("1")
            return _nothing
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            control = os.open(f"{memory_dir}/memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(efd)
            raise
        try:
            with open(f"{memory_dir}/cgroup.event_control", "w") as f:
                f.write(f"{efd} {control}")
            with self._lock:
                self._watches[efd] = (control, kill, memory_dir)
                self._poller().register(efd, select.EPOLLIN)
        except BaseException:
            os.close(efd)
            os.close(control)
            raise
        if _oom_kills_v1(memory_dir):  # killed between the start and the registration
            self._fire(efd)
        return lambda: self._unwatch(efd)

    def _poller(self) -> select.epoll:
        if self._epoll is None:
            self._epoll = select.epoll()
            threading.Thread(target=self._run, args=(self._epoll,), daemon=True, name="oom-guard").start()
        return self._epoll

    def _unwatch(self, efd: int) -> None:
        with self._lock:
            entry = self._watches.pop(efd, None)
            if entry is None:
                return
            if self._epoll is not None:
                self._epoll.unregister(efd)
        os.close(efd)  # the kernel drops the notification with it
        os.close(entry[0])

    def _run(self, epoll: select.epoll) -> None:
        while True:
            for efd, _ in epoll.poll():
                try:
                    os.eventfd_read(efd)
                except OSError:
                    continue  # unwatched meanwhile
                self._fire(efd)

    def _fire(self, efd: int) -> None:
        with self._lock:
            entry = self._watches.get(efd)
        if entry is None:
            return
        _, kill, memory_dir = entry
        if not _an_oom(memory_dir):
            return
        log.info("an OOM kill in %s: ending the whole sandbox", memory_dir)
        try:
            kill()
        except Exception:  # noqa: BLE001 (logged: the call still ends at its timeout)
            log.exception("could not end the sandbox of %s after its OOM kill", memory_dir)


def _nothing() -> None:
    return None
