"""What a command left behind in a warm sandbox: the host pids in its cgroup subtree,
the task count of its pids cgroup, and pidfds on the processes it started with (while
all of those live, an unchanged task count means nothing of a command is left)."""

from __future__ import annotations

import os
import select
import signal
from dataclasses import dataclass
from typing import Any


def pidfds(pids: set[int]) -> tuple[int, ...]:
    """A pidfd on each process, or none at all if one has exited already."""
    out: list[int] = []
    try:
        for pid in sorted(pids):
            out.append(os.pidfd_open(pid))
    except OSError:
        for fd in out:
            os.close(fd)
        return ()
    return tuple(out)


def all_alive(fds: tuple[int, ...]) -> bool:
    """True while none of the processes exited (a pidfd turns readable when it does)."""
    if not fds:
        return False
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return not poller.poll(0)


def _pids_cgroup(spec: Any, cgroup_root: str) -> str | None:
    rel = getattr(spec, "cgroup_dir", None) or getattr(spec, "cgroup", None)
    if not rel:
        return None
    hierarchy = f"{cgroup_root}/pids" if os.path.isdir(f"{cgroup_root}/pids") else cgroup_root
    return f"{hierarchy}/{str(rel).strip('/')}"


def sandbox_task_count(spec: Any, cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Tasks (threads) in the sandbox's pids cgroup subtree, None if unknown."""
    root = _pids_cgroup(spec, cgroup_root)
    if root is None:
        return None
    try:
        with open(f"{root}/pids.current") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def sandbox_processes(spec: Any, cgroup_root: str = "/sys/fs/cgroup") -> set[int] | None:
    """Host pids in the sandbox's cgroup subtree (the v1 pids hierarchy, or the unified
    one on a v2 host), None if unknown. Plain strings and scandir: this runs twice per
    leased command."""
    root = _pids_cgroup(spec, cgroup_root)
    if root is None or not os.path.isdir(root):
        return None
    pids: set[int] = set()
    todo = [root]
    while todo:  # cgroup trees are shallow, but never recurse on what a sandbox can shape
        d = todo.pop()
        try:
            with open(f"{d}/cgroup.procs") as f:
                pids.update(int(line) for line in f if line.strip())
        except OSError:
            pass
        try:
            with os.scandir(d) as it:
                todo += [e.path for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass  # removed meanwhile
    return pids


def oom_kill_files(spec: Any, cgroup_root: str = "/sys/fs/cgroup") -> tuple[str, ...]:
    """Where the sandbox's OOM kills are counted, found once (its cgroup tree is fixed
    once it runs: nothing in it can make cgroups). v2 counts a subtree's in its top
    memory.events; v1 keeps each cgroup's own count (Docker: the per-sandbox parent and
    the container's cgroup below it), so every one of the subtree is read."""
    rel = getattr(spec, "cgroup_dir", None) or getattr(spec, "cgroup", None)
    if not rel:
        return ()
    v1 = f"{cgroup_root}/memory/{str(rel).strip('/')}"
    if not os.path.isdir(v1):
        return (f"{cgroup_root}/{str(rel).strip('/')}/memory.events",)
    files, todo = [], [v1]
    while todo:
        d = todo.pop()
        files.append(f"{d}/memory.oom_control")
        try:
            with os.scandir(d) as it:
                todo += [e.path for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass  # removed meanwhile
    return tuple(files)


def oom_kills(files: tuple[str, ...]) -> int:
    """OOM kills so far in those files (a leased command's are the difference across it)."""
    return sum(_oom_kill_field(path) for path in files)


def _oom_kill_field(path: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True)
class LeftoverCheck:
    """What a command's end found in its warm sandbox."""
    clean: bool  # nothing of the command is left (so nothing need be looked for again)
    intact: bool  # every process the sandbox started with still lives


def kill_leftovers(baseline: set[int], baseline_pidfds: tuple[int, ...], spec: Any) -> LeftoverCheck:
    """What the supervisor could not see (nsjail's hidepid hides non-dumpable processes)
    is still in the sandbox's cgroup: killed from outside, by host pid. A command that
    killed a process the sandbox started with (to hide one of its own in the task count)
    is found by listing the tree, and the sandbox is not intact."""
    intact = all_alive(baseline_pidfds)
    if intact and sandbox_task_count(spec) == len(baseline_pidfds):
        return LeftoverCheck(clean=True, intact=True)  # one read instead of listing the tree (~0.3 ms)
    present = sandbox_processes(spec)
    left = (present or set()) - baseline
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return LeftoverCheck(clean=present is not None and not left, intact=intact or not baseline_pidfds)
