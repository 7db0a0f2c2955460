"""A sandbox's cgroup, on cgroup v1 or v2: where its directories are, how its limits are
spelled, how processes are put in it, counted, killed and how it goes away.

- v1 (and hybrid hosts): one directory per controller (memory, pids, cpu, cpuacct),
  each named by the same relative path. A single thread may move, so a thread of the
  daemon moves itself in and every process it spawns is born there.
- v2 (unified): one directory, the controllers enabled in each ancestor's
  cgroup.subtree_control (no process may sit in an ancestor: the sandbox cgroups are
  leaves under a tree of the daemon's own). Only whole processes move, so a process
  starts as a small helper (native/cgroup-exec.c) that joins the cgroup and then execs
  the program (`popen_in`): it never runs a line of its program outside it.

The sandbox's relative path (<top>/<daemon id>/<sandbox id>, cgroup_home.py) is the same on
both. The layout is made from the host's cgroup version, probed once at the daemon's
start (core/hostfacts.py; `layout_for`), and handed to what needs it: never at import.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from typing import Any, Callable

from sandboxd.core.hostfacts import CGROUP_ROOT
from sandboxd.core import assets
from sandboxd.core.hostfacts import CgroupVersion, cgroup_version
from sandboxd.sandbox.protocol import ResourceUsage

# How long the helper may take to join and exec before the spawn counts as failed.
JOIN_TIMEOUT_S = 30.0

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")
# Files each v1 controller must offer.
_V1_FILES = {
    "memory": ("memory.limit_in_bytes", "memory.max_usage_in_bytes", "memory.oom_control"),
    "pids": ("pids.max",),
    "cpu": ("cpu.cfs_quota_us", "cpu.cfs_period_us"),
    "cpuacct": ("cpuacct.usage",),
}
_V2_FILES = ("memory.max", "memory.events", "pids.max", "cpu.max", "cpu.stat")
# On v2, where a cgroup cannot be renamed, the sandbox a cgroup was made for ahead
# (a spawn slot) is written on the directory itself (as systemd's trusted.invocation_id).
SANDBOX_XATTR = "trusted.sandboxd.sandbox"


class CgroupUnavailable(Exception):
    """The host's cgroups cannot hold a sandbox (said plainly, as the backend's refusal)."""


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:
        return []


def _keyed(path: str, key: str) -> int:
    """The value of `key` in a flat keyed file (memory.events, cpu.stat, oom_control)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


class Layout:
    """The host's cgroup hierarchy as the sandboxes use it. Limits are keyed
    "<directory key>/<file>": the controller on v1, "" on v2."""

    moves_threads = False
    renames = True  # a cgroup made ahead can take the sandbox's name

    def evicts(self, limits: dict[str, str], present: dict[str, str]) -> bool:
        """Whether writing `limits` over `present` may OOM-kill a process already in the
        cgroup. Not on v1: a memory limit below the usage is refused there (EBUSY)."""
        return False

    def __init__(self, root: str = CGROUP_ROOT, join_exec: str | os.PathLike[str] | None = None):
        self.root = root
        # native/cgroup-exec.c (`make native`, the cgroup_exec_binary setting): joins
        # cgroups, then execs the program (`popen_in`).
        self.join_exec = str(join_exec) if join_exec is not None else str(assets.packaged(assets.CGROUP_EXEC))

    def dirs(self, cgroup: str) -> list[str]:
        raise NotImplementedError

    def pids_dir(self, cgroup: str) -> str:
        """The directory whose cgroup.procs and pids.current cover the whole sandbox."""
        raise NotImplementedError

    def memory_dir(self, cgroup: str) -> str:
        """The directory of the sandbox's memory controller (its OOM events)."""
        raise NotImplementedError

    def limits(self, memory_bytes: int, pids_max: int, cpu_quota_us: int, cpu_period_us: int) -> dict[str, str]:
        raise NotImplementedError

    def check(self, top: str) -> None:
        raise NotImplementedError

    def make(self, cgroup: str) -> None:
        for d in self.dirs(cgroup):
            os.makedirs(d, exist_ok=True)

    def limit_path(self, cgroup: str, key: str) -> str:
        where, _, file = key.rpartition("/")
        return f"{self.root}/{where}/{cgroup}/{file}" if where else f"{self.root}/{cgroup}/{file}"

    def write_limits(self, cgroup: str, limits: dict[str, str], present: dict[str, str]) -> None:
        """Writes the limits `present` does not already hold, in an order the kernel accepts."""
        for key in self._write_order(limits, present):
            if present.get(key) != limits[key]:
                _write(self.limit_path(cgroup, key), limits[key])

    def _write_order(self, limits: dict[str, str], present: dict[str, str]) -> list[str]:
        return list(limits)

    def procs(self, cgroup: str) -> set[int]:
        return {p for d in self.dirs(cgroup) for p in _read_pids(f"{d}/cgroup.procs")}

    def oom_kills(self, cgroup: str) -> int:
        raise NotImplementedError

    def usage(self, cgroup: str) -> ResourceUsage:
        return cgroup_usage(cgroup, self.root)

    def kill(self, cgroup: str, timeout_s: float = 0.0) -> bool:
        """SIGKILLs every process of the sandbox's cgroup; with a timeout, waits for them
        to be gone. True when none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            # v1: a thread of this daemon may be in the cgroup (the one that spawns nsjail
            # into it): cgroup.procs then lists the daemon's own pid, never killed.
            pids = sorted(self.procs(cgroup) - {os.getpid()})
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def remove(self, cgroup: str, timeout_s: float) -> list[str]:
        """Removes the sandbox's directories, retrying (and killing) while its last tasks
        finish exiting; the paths still there after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        pending = self.dirs(cgroup)
        while True:
            left = []
            for path in pending:
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(path)
            if not left or time.monotonic() >= deadline:
                return left
            pending = left
            self.kill(cgroup)
            time.sleep(0.01)

    def rename(self, old: str, new: str) -> None:
        """Renames the cgroup (same parent); on failure the directories are as before."""
        done: list[tuple[str, str]] = []
        try:
            for a, b in zip(self.dirs(old), self.dirs(new)):
                os.rename(a, b)
                done.append((a, b))
        except OSError:
            for a, b in reversed(done):
                try:
                    os.rename(b, a)
                except OSError:
                    pass
            raise

    def mark(self, cgroup: str, sandbox_id: str) -> None:
        """Says on a cgroup made ahead which sandbox it now holds (where it cannot be renamed)."""
        os.setxattr(self.dirs(cgroup)[0], SANDBOX_XATTR, sandbox_id.encode())

    def marked(self, cgroup: str) -> str | None:
        """The sandbox `mark` wrote on the cgroup, None if none."""
        try:
            return os.getxattr(self.dirs(cgroup)[0], SANDBOX_XATTR).decode()
        except OSError:
            return None

    def children(self, parent: str) -> set[str]:
        """Names of the cgroups directly below `parent`, in any of its directories."""
        names: set[str] = set()
        for d in self.dirs(parent):
            try:
                names.update(e.name for e in os.scandir(d) if e.is_dir(follow_symlinks=False))
            except OSError:
                pass
        return names

    def enter_thread(self, cgroup: str) -> None:
        """Moves the calling thread into the cgroup (v1 only)."""
        raise NotImplementedError

    def popen_in(self, cgroup: str) -> Callable[..., subprocess.Popen[bytes]]:
        """subprocess.Popen, except that the process is born in the cgroup: it starts as
        the join helper (`join_exec`), which writes itself into the cgroup's cgroup.procs
        and then execs the command. Returns once the command runs; OSError (and nothing
        ran) when the join failed. No Python runs between fork and exec (a preexec_fn
        did, in a child of the threaded daemon, and once in a while hung there), and
        the spawn may vfork."""
        procs = [f"{d}/cgroup.procs" for d in self.dirs(cgroup)]

        def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            try:
                kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), status_w)
                proc = subprocess.Popen([self.join_exec, str(status_w), *procs, "--", *args], **kwargs)
            except BaseException:
                os.close(status_r)
                raise
            finally:
                os.close(status_w)
            try:
                why = _read_to_eof(status_r, JOIN_TIMEOUT_S)
                if why is None or why:
                    raise OSError(f"cannot start in cgroup {cgroup}: {why or 'the join helper did not finish'}")
            except BaseException:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                if proc.stdin is not None:
                    proc.stdin.close()
                raise
            finally:
                os.close(status_r)
            return proc

        return popen


def _read_to_eof(fd: int, timeout_s: float) -> str | None:
    """What is written to the pipe until its last writer closes it; None past the timeout.
    (poll, not select: the daemon's descriptors go past 1023.)"""
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks).decode(errors="replace")
        chunks.append(chunk)


class V1(Layout):
    moves_threads = True

    def __init__(self, root: str = CGROUP_ROOT, join_exec: str | os.PathLike[str] | None = None):
        super().__init__(root, join_exec)
        # Controllers mounted together (systemd's cpu and cpuacct: links to cpu,cpuacct)
        # are one directory, named once: it is renamed and removed once.
        seen: set[str] = set()
        self._controllers: list[str] = []
        for c in V1_CONTROLLERS:
            real = os.path.realpath(f"{root}/{c}")
            if real not in seen:
                seen.add(real)
                self._controllers.append(c)

    def dirs(self, cgroup: str) -> list[str]:
        return [f"{self.root}/{c}/{cgroup}" for c in self._controllers]

    def pids_dir(self, cgroup: str) -> str:
        return f"{self.root}/pids/{cgroup}"

    def limits(self, memory_bytes: int, pids_max: int, cpu_quota_us: int, cpu_period_us: int) -> dict[str, str]:
        limits = {"memory/memory.limit_in_bytes": str(memory_bytes)}
        if os.path.exists(f"{self.root}/memory/memory.memsw.limit_in_bytes"):
            limits["memory/memory.memsw.limit_in_bytes"] = str(memory_bytes)  # no swap, as in Docker
        limits["pids/pids.max"] = str(pids_max)
        limits["cpu/cpu.cfs_period_us"] = str(cpu_period_us)
        limits["cpu/cpu.cfs_quota_us"] = str(cpu_quota_us) if cpu_quota_us > 0 else "-1"  # -1: no quota
        return limits

    def _write_order(self, limits: dict[str, str], present: dict[str, str]) -> list[str]:
        names = list(limits)
        mem, memsw = "memory/memory.limit_in_bytes", "memory/memory.memsw.limit_in_bytes"
        if memsw in limits and int(limits[mem]) > int(present.get(mem, -1)) >= 0:
            # Raising: memory+swap first (it may never be below the memory limit).
            names.remove(memsw)
            names.insert(names.index(mem), memsw)
        return names

    def check(self, top: str) -> None:
        for controller, files in _V1_FILES.items():
            base = f"{self.root}/{controller}"
            try:
                os.makedirs(f"{base}/{top}", exist_ok=True)
            except OSError as exc:
                raise CgroupUnavailable(f"cannot create {base}/{top}: {exc}") from None
            missing = [f for f in files if not os.path.exists(f"{base}/{top}/{f}")]
            if missing:
                raise CgroupUnavailable(f"the cgroup '{controller}' controller at {base} lacks {', '.join(missing)}")

    def oom_kills(self, cgroup: str) -> int:
        return _keyed(f"{self.root}/memory/{cgroup}/memory.oom_control", "oom_kill")

    def memory_dir(self, cgroup: str) -> str:
        return f"{self.root}/memory/{cgroup}"

    def enter_thread(self, cgroup: str) -> None:
        tid = str(threading.get_native_id())
        for d in self.dirs(cgroup):
            _write(f"{d}/tasks", tid)


class V2(Layout):
    renames = False  # cgroup2 has no rename (kernel: cgroup1_rename only)

    def __init__(self, root: str = CGROUP_ROOT, join_exec: str | os.PathLike[str] | None = None, base: str = ""):
        """`base`: the cgroup delegated to the daemon (backends/cgroup_home.py), "" for
        the root: nothing above it is ever written, and the controllers it is offered
        are the ones there are."""
        super().__init__(root, join_exec)
        self.base = base.strip("/")
        self._delegating: set[str] = set()  # ancestors whose subtree_control is known done
        self.swap_control = False  # memory.swap.max exists (swap accounting on): check() says

    def dirs(self, cgroup: str) -> list[str]:
        return [f"{self.root}/{cgroup}"]

    def pids_dir(self, cgroup: str) -> str:
        return f"{self.root}/{cgroup}"

    def memory_dir(self, cgroup: str) -> str:
        return f"{self.root}/{cgroup}"

    def limits(self, memory_bytes: int, pids_max: int, cpu_quota_us: int, cpu_period_us: int) -> dict[str, str]:
        limits = {"memory.max": str(memory_bytes)}
        if self.swap_control:
            limits["memory.swap.max"] = "0"  # no swap, as in Docker
        limits["pids.max"] = str(pids_max)
        quota = str(cpu_quota_us) if cpu_quota_us > 0 else "max"
        limits["cpu.max"] = f"{quota} {cpu_period_us}"
        return limits

    def check(self, top: str) -> None:
        offered = f"{self.root}/{self.base}" if self.base else self.root
        try:
            with open(f"{offered}/cgroup.controllers") as f:
                available = set(f.read().split())
        except OSError as exc:
            raise CgroupUnavailable(f"cannot read {offered}/cgroup.controllers: {exc}") from None
        missing = [c for c in V2_CONTROLLERS if c not in available]
        if missing:
            why = ("(a controller still bound to a v1 hierarchy cannot be used here)" if not self.base else
                   "(the daemon's delegated cgroup is offered only what its parents enable for it)")
            raise CgroupUnavailable(f"the cgroup v2 hierarchy at {offered} does not offer {', '.join(missing)} {why}")
        try:
            self._delegate(top)
        except OSError as exc:
            raise CgroupUnavailable(f"cannot make {self.root}/{top} with the {', '.join(V2_CONTROLLERS)} "
                                    f"controllers enabled below it: {exc}") from None
        absent = [f for f in _V2_FILES if not os.path.exists(f"{self.root}/{top}/{f}")]
        if absent:
            raise CgroupUnavailable(f"the cgroup {self.root}/{top} lacks {', '.join(absent)}")
        self.swap_control = os.path.exists(f"{self.root}/{top}/memory.swap.max")

    def _delegate(self, parent: str) -> None:
        """Makes `parent` (and its ancestors below the base) with the sandbox controllers
        enabled for its children: the base's subtree_control (the root's when there is
        no base), then each level's."""
        parts = [p for p in parent.split("/") if p]
        first = len(self.base.split("/")) if self.base else 0
        if parts[:first] != (self.base.split("/") if self.base else []):
            raise OSError(f"{parent} is not below the daemon's delegated cgroup {self.base}")
        for i in range(first, len(parts) + 1):
            rel = "/".join(parts[:i])
            if rel in self._delegating:
                continue
            path = f"{self.root}/{rel}" if rel else self.root
            if rel:
                os.makedirs(path, exist_ok=True)
            with open(f"{path}/cgroup.subtree_control") as f:
                enabled = set(f.read().split())
            wanted = [c for c in V2_CONTROLLERS if c not in enabled]
            if wanted:
                _write(f"{path}/cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            self._delegating.add(rel)

    def make(self, cgroup: str) -> None:
        parent = cgroup.rpartition("/")[0]
        if parent not in self._delegating or not os.path.isdir(f"{self.root}/{parent}"):
            self._delegating.clear()  # a level removed since (a reap): made and enabled again
            self._delegate(parent)
        os.makedirs(f"{self.root}/{cgroup}", exist_ok=True)

    def oom_kills(self, cgroup: str) -> int:
        return _keyed(f"{self.root}/{cgroup}/memory.events", "oom_kill")

    def kill(self, cgroup: str, timeout_s: float = 0.0) -> bool:
        # cgroup.kill (5.14+) kills the whole cgroup at once, forks in flight included.
        try:
            _write(f"{self.root}/{cgroup}/cgroup.kill", "1")
        except OSError:
            pass  # gone, or an older kernel: the pid sweep below does it
        return super().kill(cgroup, timeout_s)

    def enter_thread(self, cgroup: str) -> None:
        raise CgroupUnavailable("cgroup v2 moves whole processes only")

    def evicts(self, limits: dict[str, str], present: dict[str, str]) -> bool:
        # A memory.max below the usage is accepted: the kernel reclaims, then OOM-kills.
        new, old = limits.get("memory.max"), present.get("memory.max", "max")
        return new is not None and new != old and new != "max" and (old == "max" or int(new) < int(old))


def cgroup_usage(rel: str, root: str = CGROUP_ROOT) -> ResourceUsage:
    """Peak memory and CPU time of a cgroup (its whole subtree): a sandbox's, or the
    parent of a container's."""
    rel = rel.strip("/")
    if os.path.isdir(f"{root}/memory"):  # v1 (or hybrid)
        peak = _read_int(f"{root}/memory/{rel}/memory.max_usage_in_bytes")
        cpu_ns = _read_int(f"{root}/cpuacct/{rel}/cpuacct.usage")
        return ResourceUsage(cpu_ms=(cpu_ns or 0) // 1_000_000, peak_memory_bytes=peak or 0)
    peak = _read_int(f"{root}/{rel}/memory.peak")  # 5.19+
    return ResourceUsage(cpu_ms=_keyed(f"{root}/{rel}/cpu.stat", "usage_usec") // 1000, peak_memory_bytes=peak or 0)


def oom_kills_in(rel: str, root: str = CGROUP_ROOT) -> int:
    """The processes the OOM killer killed in a cgroup: on v2 its whole subtree
    (memory.events is hierarchical), on v1 the cgroup whose limit was met."""
    layout = V1(root) if os.path.isdir(f"{root}/memory") else V2(root)  # v1 (or hybrid), or v2
    return layout.oom_kills(rel.strip("/"))


def layout_for(version: CgroupVersion | None, root: str = CGROUP_ROOT,
               join_exec: str | os.PathLike[str] | None = None, base: str = "") -> Layout | None:
    """The layout of a host whose cgroup version was probed (core/hostfacts.py: once, at
    the daemon's start); None when it has no cgroups. `join_exec`: the
    cgroup_exec_binary setting (default: the packaged helper). `base`: on v2, the
    cgroup delegated to the daemon (cgroup_home.CgroupHome.base)."""
    if version == "v1":
        return V1(root, join_exec)
    if version == "v2":
        return V2(root, join_exec, base)
    return None


def detect(root: str = CGROUP_ROOT, join_exec: str | os.PathLike[str] | None = None) -> Layout | None:
    """The host's layout, probed now (for a backend built without the daemon's probe,
    and for tests)."""
    return layout_for(cgroup_version(root), root, join_exec)
