"""Which daemons are running here (a lock each holds) and the sweep of the sandbox cgroups
that stopped ones left behind."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from sandboxd.core.hostfacts import CGROUP_ROOT


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
