"""Spawn slots: nsjails started ahead of the calls, each in a cgroup of its own. Moving
a task between cgroups waits for an RCU grace period (5-15 ms on an idle host), so the
cgroup, and the nsjail born in it (waiting for its config), are made before a call
arrives; the call then only renames the cgroup to its sandbox's name (v1) or marks it
with the sandbox's id (v2). One background thread keeps each daemon id's slots filled."""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from sandboxd.backends.cgroups import Layout
from sandboxd.backends.nsjail.compile import NSJAIL_CGROUP_ROOT, nsjail_command
from sandboxd.backends.nsjail.jail_cgroup import remove_cgroups
from sandboxd.backends.nsjail.pipes import CONFIG_PIPE_BYTES, output_pipes
from sandboxd.core.errors import InternalError

log = logging.getLogger("sandboxd.nsjail")
# A slot's cgroup, until a sandbox takes it: <daemon id>/.slot-<random>.
SLOT_PREFIX = ".slot-"
# Starts the jail's nsjail with the Popen it is given (one that starts it in a cgroup).
Spawn = Callable[[Callable[..., "subprocess.Popen[bytes]"]], "subprocess.Popen[bytes]"]


def spawn_in_cgroup(layout: Layout, cgroup: str, spawn: Spawn) -> subprocess.Popen[bytes]:
    """Runs `spawn(popen)` so that the process it starts is born in the sandbox's cgroup
    and no task of the sandbox ever runs outside it. v1: on a fresh thread that first
    moves itself there (the caller's thread never changes cgroup); v2: the process
    starts as the join helper (Layout.popen_in)."""
    if not layout.moves_threads:
        return spawn(layout.popen_in(cgroup))
    procs: list[subprocess.Popen[bytes]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            layout.enter_thread(cgroup)
            procs.append(spawn(subprocess.Popen))
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    t = threading.Thread(target=run, name="nsjail-spawn", daemon=True)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return procs[0]


@dataclass
class Early:
    """nsjail started ahead of its call, blocked reading its config from a pipe: its
    process made and its libraries loaded (about 5 ms) before the call arrives. EOF
    without a config (the daemon died) makes it exit: an empty or cut config has no
    command (exec_bin is the config's last line)."""

    proc: subprocess.Popen[bytes]
    config_w: int
    config_room: int  # the pipe's capacity: a config must fit in one write
    log_fd: int
    stdin_w: int
    out_r: int
    err_r: int

    @classmethod
    def spawn(cls, binary: str, popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen) -> Early:
        config_r, config_w = os.pipe2(os.O_CLOEXEC)
        made = [config_r, config_w]
        try:
            room = fcntl.fcntl(config_w, fcntl.F_SETPIPE_SZ, CONFIG_PIPE_BYTES)
            log_fd = os.memfd_create("sandboxd-nsjail.log", os.MFD_CLOEXEC)
            made.append(log_fd)
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            made += [in_r, in_w]
            out_r, out_w, err_r, err_w = output_pipes()
            made += [out_r, out_w, err_r, err_w]
            proc = popen(nsjail_command(binary, f"/proc/self/fd/{config_r}", log_fd), env={}, cwd="/",
                         close_fds=True, pass_fds=(config_r, log_fd), stdin=in_r, stdout=out_w,
                         stderr=err_w, start_new_session=True)
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        for fd in (config_r, in_r, out_w, err_w):
            os.close(fd)
        return cls(proc, config_w, room, log_fd, in_w, out_r, err_r)

    def discard(self) -> None:
        """Kills it (if it still waits) and closes what is still ours."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.error("a waiting nsjail (pid %d) did not exit after SIGKILL", self.proc.pid)
        for name in ("config_w", "stdin_w", "out_r", "err_r", "log_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class Slot:
    """A cgroup directory of its own with one nsjail already born there, waiting for its
    config (`Early`); on v1, also a thread moved into it, which spawns the jail's
    nsjail late if that one failed or cannot be used. Moving a task between cgroups
    waits for an RCU grace period (5-15 ms on an idle host), so slots are made ahead of
    the calls that use them; a call then only renames the directory to its sandbox's
    name. On v2 a slot without its waiting nsjail is not made (no thread can move)."""

    def __init__(self, layout: Layout, daemon_id: str, binary: str | None = None,
                 limits: dict[str, str] | None = None, top: str = NSJAIL_CGROUP_ROOT):
        self.daemon_id = daemon_id
        self.early: Early | None = None
        self.limits: dict[str, str] = {}  # written ahead: the last call's, most likely the next's
        self.cgroup = f"{top}/{daemon_id}/{SLOT_PREFIX}{secrets.token_hex(6)}"
        self._layout = layout
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        layout.make(self.cgroup)
        if limits:
            try:
                layout.write_limits(self.cgroup, limits, {})
                self.limits = dict(limits)
            except OSError as exc:
                log.warning("cannot write limits ahead into a spawn slot: %s", exc)
        if not layout.moves_threads:
            try:
                if not binary:
                    raise InternalError("a v2 spawn slot needs the nsjail binary")
                self.early = Early.spawn(binary, layout.popen_in(self.cgroup))  # born in this cgroup
            except BaseException:
                layout.remove(self.cgroup, timeout_s=0.5)
                raise
            return
        ready = threading.Event()
        failure: list[BaseException] = []

        def body() -> None:
            try:
                layout.enter_thread(self.cgroup)
            except BaseException as exc:  # handed to the maker
                failure.append(exc)
                ready.set()
                return
            if binary:
                try:
                    self.early = Early.spawn(binary)  # born in this cgroup
                except Exception as exc:  # noqa: BLE001 - the slot still spawns late
                    log.warning("cannot start an nsjail ahead of its call: %s", exc)
            ready.set()
            job = self._jobs.get()
            if job is not None:
                job()

        self._thread = threading.Thread(target=body, name="nsjail-slot", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            layout.remove(self.cgroup, timeout_s=0.5)
            raise failure[0]

    def claim(self, cgroup: str, sandbox_id: str) -> bool:
        """Makes the slot's cgroup the sandbox's: renamed to `cgroup` (v1), or, where
        cgroups cannot be renamed (v2), kept and marked with the sandbox's id, its path
        then the sandbox's (self.cgroup). False (and the slot released) if that fails."""
        try:
            if self._layout.renames:
                self._layout.rename(self.cgroup, cgroup)
                self.cgroup = cgroup
            else:
                self._layout.mark(self.cgroup, sandbox_id)
        except OSError as exc:
            log.warning("cannot use spawn slot %s for %s: %s", self.cgroup, cgroup, exc)
            self.release(remove=True)  # its waiting nsjail and cgroup go too
            return False
        return True

    def run(self, spawn: Spawn) -> subprocess.Popen[bytes]:
        """Spawns into the slot's cgroup: from the slot's thread (v1), which then ends,
        or as the join helper (v2)."""
        if self._thread is None:
            return spawn_in_cgroup(self._layout, self.cgroup, spawn)
        done = threading.Event()
        procs: list[subprocess.Popen[bytes]] = []
        errors: list[BaseException] = []

        def job() -> None:
            try:
                procs.append(spawn(subprocess.Popen))
            except BaseException as exc:  # handed to the caller
                errors.append(exc)
            finally:
                done.set()

        self._jobs.put(job)
        done.wait()
        if errors:
            raise errors[0]
        return procs[0]

    def take_early(self) -> Early | None:
        """Its waiting nsjail; None if it has none, or if that one died waiting (killed
        from outside): the jail's nsjail then starts late, from this slot's thread."""
        early, self.early = self.early, None
        if early is not None and early.proc.poll() is not None:
            log.warning("a waiting nsjail (pid %d) had exited: one is started late", early.proc.pid)
            early.discard()
            return None
        return early

    def discard_early(self) -> None:
        early, self.early = self.early, None
        if early is not None:
            early.discard()

    def release(self, remove: bool = False, wait: bool = True) -> None:
        """Ends the thread without spawning (it leaves the cgroup by ending); with
        `remove`, an early nsjail nobody took and the cgroup go too."""
        if self._thread is not None:
            self._jobs.put(None)
            if wait or remove:
                self._thread.join(5)
        if remove:
            self.discard_early()
            remove_cgroups(self._layout, self.cgroup, timeout_s=1.0)


class SlotPool:
    """Keeps `per_daemon` slots ready for each daemon id that asked, refilled by one
    background thread: after the call that took a slot has ended, unless none is left."""

    # Making a slot moves a thread between cgroups, which holds the kernel's cgroup
    # mutex through an RCU grace period (5-15 ms): every rename, mkdir and rmdir of a
    # call's cgroups meanwhile waits, and the new nsjail's start takes CPU. So while a
    # call runs and a slot is still ready, the refill waits for the call's end (at most
    # this long after its take, which also bounds a pool's long-lived sandboxes).
    DEFER_MAX_S = 0.5

    def __init__(self, per_daemon: int, binary: str | None = None, layout: Layout | None = None,
                 top: str = NSJAIL_CGROUP_ROOT):
        self._per = per_daemon
        self._top = top  # the jails' cgroups' top (cgroup_home.py)
        self._layout = layout  # None: no cgroups on this host (the backend refuses itself), no slots
        self._binary = binary
        self._limits: dict[str, str] = {}
        self._cond = threading.Condition()
        self._ready: dict[str, list[Slot]] = {}
        self._wanted: set[str] = set()
        self._running: dict[str, float] = {}  # cgroup of a call that took a slot -> when
        self._filler: threading.Thread | None = None
        self._closed = False

    def want(self, daemon_id: str) -> None:
        if self._per <= 0 or self._layout is None:
            return
        with self._cond:
            if self._closed:
                return
            self._wanted.add(daemon_id)
            if self._filler is None:
                self._filler = threading.Thread(target=self._fill, name="nsjail-slots", daemon=True)
                self._filler.start()
            self._cond.notify_all()

    def take(self, daemon_id: str, cgroup: str, sandbox_id: str,
             limits: dict[str, str] | None = None) -> Slot | None:
        """A ready slot claimed for the sandbox (its cgroup is then slot.cgroup: `cgroup`,
        or on v2 the slot's own), or None (the caller spawns the slow way). `limits` are
        the call's: slots made from now on write them ahead. done() takes the cgroup the
        sandbox ended up in."""
        self.want(daemon_id)
        while True:
            with self._cond:
                taken = time.monotonic()
                self._running[cgroup] = taken
                if limits:
                    self._limits = dict(limits)
                ready = self._ready.get(daemon_id)
                slot = ready.pop() if ready else None
                self._cond.notify_all()
            if slot is None or slot.claim(cgroup, sandbox_id):
                if slot is not None and slot.cgroup != cgroup:
                    with self._cond:
                        self._running.pop(cgroup, None)
                        self._running[slot.cgroup] = taken
                return slot

    def _short(self) -> str | None:
        for daemon_id in sorted(self._wanted):
            if len(self._ready.get(daemon_id, [])) < self._per:
                return daemon_id
        return None

    def done(self, cgroup: str) -> None:
        """The call that took a slot for `cgroup` has ended (its cgroups are gone)."""
        with self._cond:
            if self._running.pop(cgroup, None) is not None:
                self._cond.notify_all()

    def _next(self) -> str | None:
        """The daemon id to make a slot for, once it is time; None once closed."""
        while not self._closed:
            daemon_id = self._short()
            if daemon_id is None:
                self._cond.wait()
                continue
            now = time.monotonic()
            for cgroup, taken in list(self._running.items()):
                if now - taken >= self.DEFER_MAX_S:
                    del self._running[cgroup]
            if not self._running or not self._ready.get(daemon_id):
                return daemon_id
            self._cond.wait(max(self._running.values()) + self.DEFER_MAX_S - now)
        return None

    def _fill(self) -> None:
        while True:
            with self._cond:
                daemon_id = self._next()
                if daemon_id is None:
                    return
                limits = dict(self._limits)
            try:
                assert self._layout is not None  # no filler is started without one
                slot = Slot(self._layout, daemon_id, self._binary, limits, self._top)
            except Exception as exc:  # the slow path still works; try again later
                log.warning("cannot make a spawn slot: %s", exc)
                time.sleep(1.0)
                continue
            with self._cond:
                keep = not self._closed and daemon_id in self._wanted
                if keep:
                    self._ready.setdefault(daemon_id, []).append(slot)
            if not keep:
                slot.release(remove=True)

    def forget(self, daemon_id: str) -> None:
        """Stops keeping slots for this daemon id and removes those it had."""
        with self._cond:
            self._wanted.discard(daemon_id)
            slots = self._ready.pop(daemon_id, [])
        for slot in slots:
            slot.release(remove=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            slots = [s for ready in self._ready.values() for s in ready]
            self._ready.clear()
            self._cond.notify_all()
        for slot in slots:
            slot.release(remove=True)


