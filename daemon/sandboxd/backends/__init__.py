"""The one Backend protocol that every sandbox engine implements (Docker now, nsjail
next). A backend is told a spec; it never sees a policy."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..output import OutputSpool

if TYPE_CHECKING:
    from ..compile import Attachments, SandboxIdentity
    from ..policy import EffectivePolicy
    from ..preflight import HostPlan


@dataclass
class SandboxHandle:
    sandbox_id: str
    engine_id: str  # container id, jail pid, ...
    spec: Any
    # Set when the sandbox's output streams reached EOF: its process tree is gone.
    output_closed: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None


@dataclass(frozen=True)
class ExitStatus:
    exit_code: int
    signal: str  # "" when the command exited on its own
    oom_killed: bool


@dataclass(frozen=True)
class ResourceUsage:
    cpu_ms: int
    peak_memory_bytes: int


class Backend(Protocol):
    name: str

    def check(self) -> None:
        """Raises BackendUnavailable when the engine or a feature it needs is missing."""

    def compile(self, policy: "EffectivePolicy", plan: "HostPlan", identity: "SandboxIdentity", *,
                argv: tuple[str, ...], image: str, stdin_open: bool, attachments: "Attachments | None" = None) -> Any:
        """This backend's spec for a call: its pure compiler, fed the host facts only the
        backend knows (mask file, seccomp profile, root filesystem) and the call's
        attachments (the shim, the egress endpoint, secrets)."""

    def image_digest(self, image: str) -> str:
        """The local image's content digest; FailedPrecondition when it is absent."""

    def resolve_image(self, image: str) -> tuple[str, tuple[str, ...]]:
        """The local image a reference resolves to: its digest and every name the engine
        gives it (repository:tag), which the image allowlist is checked against."""

    def create(self, spec: Any) -> SandboxHandle:
        """Creates the sandbox; nothing runs yet. Cleans up after itself on failure."""

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        """Starts the command and pumps its output into `sink` until EOF."""

    def wait(self, handle: SandboxHandle, timeout_s: float) -> bool:
        """True once the whole process tree has ended; False at the timeout."""

    def kill(self, handle: SandboxHandle) -> None:
        """Kills the whole process tree now."""

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        """Exit status and resource usage of an ended sandbox."""

    def destroy(self, handle: SandboxHandle) -> None:
        """Removes the sandbox and everything it held. Idempotent."""

    def reap_orphans(self, daemon_id: str) -> int:
        """Removes sandboxes a previous run of this daemon left behind."""


log = logging.getLogger("sandboxd.backends")

# Each running daemon holds an exclusive lock on <its id>.lock here, host-wide: another
# daemon's cleanup never touches the cgroups of one that is running.
DAEMON_LOCK_DIR = Path("/run/sandboxd-daemons")


def hold_daemon_lock(daemon_id: str) -> int:
    """The lock that says this daemon id is running (held until the process ends)."""
    DAEMON_LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(DAEMON_LOCK_DIR / f"{daemon_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.warning("another process holds the lock of daemon id %s", daemon_id)
    return fd


def daemon_running(daemon_id: str) -> bool:
    """Whether a daemon with this id holds its lock now."""
    try:
        fd = os.open(DAEMON_LOCK_DIR / f"{daemon_id}.lock", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False  # never started here (or before these locks existed)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


CGROUP_ROOT = "/sys/fs/cgroup"
# Sandbox cgroups younger than this are never taken for leftovers: a live daemon may
# have just made one and not yet put a process in it.
STALE_CGROUP_S = 600.0


def remove_stale_cgroups(roots: tuple[str, ...], min_age_s: float = STALE_CGROUP_S,
                         cgroup_root: str = CGROUP_ROOT,
                         keep: Callable[[str, str], bool] = lambda root, name: False) -> int:
    """Removes, deepest first, the cgroup directories below each of `roots` (in every
    hierarchy) that hold no process anywhere below them and were made more than
    `min_age_s` ago: what daemons killed outright (or whose state was wiped) left, which
    no restart of theirs will reap. A live daemon's sandbox cgroups always hold a
    process (a jail, a container, a spawn slot's waiting nsjail) or are younger, but not
    in every instant (a jail that just ended, an idle daemon's empty directory): so
    `keep(root, name)` spares each first-level directory whose owner is alive (a running
    daemon's id, a sandbox that still exists). The roots themselves stay. Returns how
    many directories went."""
    now = time.time()
    removed = 0
    try:
        hierarchies = [e.path for e in os.scandir(cgroup_root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    kept: dict[tuple[str, str], bool] = {}  # asked once per name, not per hierarchy
    for top, root in [(f"{h}/{r}", r) for h in hierarchies + [cgroup_root] for r in roots]:
        if not os.path.isdir(top):
            continue
        emptied: set[str] = set()  # directories whose (stale) children went in this pass
        # Post-order: a directory is considered once its children are gone (or stay).
        for dirpath, dirnames, _files in os.walk(top, topdown=False):
            if dirpath == top or any(os.path.isdir(os.path.join(dirpath, d)) for d in dirnames):
                continue
            name = os.path.relpath(dirpath, top).split(os.sep, 1)[0]
            if (root, name) not in kept:
                kept[(root, name)] = keep(root, name)
            if kept[(root, name)]:
                continue
            try:
                st = os.stat(dirpath)
                # Removing its children just now made it look new.
                if dirpath not in emptied and now - max(st.st_mtime, st.st_ctime) < min_age_s:
                    continue
                with open(os.path.join(dirpath, "cgroup.procs")) as f:
                    if f.read().strip():
                        continue
                os.rmdir(dirpath)
                removed += 1
                emptied.add(os.path.dirname(dirpath))
            except OSError:
                continue  # busy, gone meanwhile, or not a cgroup: left alone
    return removed
